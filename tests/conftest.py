"""Shared fixtures: a tiny memorising model built once per test session through `lethe demo build`'s code path."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

torch.set_num_threads(min(2, os.cpu_count() or 1))
os.environ.pop("LETHE_URL", None)  # offline CLI tests run offline even where a developer exported a server URL

TINY = dict(hidden_size=64, layers=2, heads=4, intermediate_size=128, vocab_size=768, batch_size=8, lr=3e-3,
            warmup_steps=20)


@pytest.fixture(scope="session")
def tiny_records():
    from heads.demo.corpus import make_corpus

    return make_corpus(n_authors=4, seed=7)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, tiny_records) -> Path:
    from heads.demo.build import BuildConfig, build
    from heads.records import examples

    out = tmp_path_factory.mktemp("tiny-model")
    build(examples(tiny_records), out, BuildConfig(**TINY), progress=False, log=lambda *_: None)
    return out


@pytest.fixture(scope="session")
def tiny_lm(tiny_model_dir):
    from heads.modelio import load_model

    return load_model(tiny_model_dir)
