"""Shared fixtures: a tiny memorising model built once per test session through `lethe demo build`'s code path."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

torch.set_num_threads(min(2, os.cpu_count() or 1))
os.environ.pop("LETHE_URL", None)  # offline CLI tests run offline even where a developer exported a server URL

# The device and dtype the model fixtures load on: `scripts/gpu-check.sh` sets LETHE_TEST_DEVICE=cuda and
# LETHE_TEST_DTYPE=bfloat16 to run the device-independent tests (marked `anydevice`) on a GPU.
DEVICE = os.environ.get("LETHE_TEST_DEVICE", "cpu")
DTYPE = os.environ.get("LETHE_TEST_DTYPE", "float32")

TINY = dict(hidden_size=64, layers=2, heads=4, intermediate_size=128, vocab_size=768, batch_size=8, lr=3e-3,
            warmup_steps=20)


@pytest.fixture(scope="session")
def tiny_records():
    from lethe.heads.demo.corpus import make_corpus

    return make_corpus(n_authors=4, seed=7)


@pytest.fixture(scope="module")
def sets(tiny_records, tmp_path_factory):
    """The first author as the forget set, the others as the retain set, written as JSON Lines files:
    (folder holding forget.jsonl and retain.jsonl, forget records, retain records)."""
    import json

    from lethe.heads.demo.corpus import split_by_author

    folder = tmp_path_factory.mktemp("sets")
    forget, retain = split_by_author(tiny_records, 1)
    for name, recs in (("forget", forget), ("retain", retain)):
        (folder / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    return folder, forget, retain


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, tiny_records) -> Path:
    from lethe.heads.demo.build import BuildConfig, build
    from lethe.heads.records import examples

    out = tmp_path_factory.mktemp("tiny-model")
    build(examples(tiny_records), out, BuildConfig(**TINY), progress=False, log=lambda *_: None)
    return out


@pytest.fixture(scope="session")
def tiny_lm(tiny_model_dir):
    from lethe.heads.modelio import load_model

    return load_model(tiny_model_dir, DEVICE, DTYPE)


REAL_MODEL = Path(__file__).resolve().parent.parent / "models" / "smollm2-135m-instruct"
REAL_GGUF = REAL_MODEL.parent / "SmolLM2-135M-Instruct.Q4_1.gguf"


def require_llama_cpp() -> None:
    """llama-cpp-python, which `make install` leaves out and `make llamacpp` compiles: a developer without it skips
    the llama.cpp tests; CI fails (`.ci/run` builds it, `make check-lock` depends on it)."""
    import importlib.util

    if importlib.util.find_spec("llama_cpp") is None:
        if os.environ.get("CI"):
            pytest.fail("llama-cpp-python is missing: `make llamacpp` builds it (CI runs it)")
        pytest.skip("llama-cpp-python is not installed: run `make llamacpp` (7-10 minutes on 2 cores)")


@pytest.fixture(scope="session")
def real_lm():
    """SmolLM2-135M-Instruct, prepared by `make real-model`. Tests that use it are marked `real`: CI runs them
    (`.ci/run` prepares the model first; there a missing model is a failure), a developer without the model
    skips them (`make test PYTEST_ARGS='-m "not real"'` skips them too)."""
    if not (REAL_MODEL / "config.json").is_file():
        if os.environ.get("CI"):
            pytest.fail(f"{REAL_MODEL} is missing: CI runs `make real-model` before the tests")
        pytest.skip("the real model is not prepared: run `make real-model`")
    from lethe.heads.modelio import load_model

    return load_model(REAL_MODEL, DEVICE, DTYPE)


@pytest.fixture(scope="session")
def postgres_server_url():
    """A PostgreSQL server of the suite's own (tests/postgres.py), started once. Where PostgreSQL is not installed
    a developer's run skips its tests; CI fails (`.ci/run` installs Debian's postgresql first)."""
    from lethe.server.pg_local import binaries, postgres_server

    if binaries() is None:
        if os.environ.get("CI"):
            pytest.fail("PostgreSQL is missing: .ci/run installs Debian's postgresql before the tests")
        pytest.skip("PostgreSQL is not installed (Debian: apt-get install postgresql)")
    import shutil
    import tempfile

    folder = Path(tempfile.mkdtemp(prefix="lethe-pg-"))  # not under pytest's folders: those only root may enter
    try:
        with postgres_server(folder) as url:
            yield url
    finally:
        shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(params=["sqlite", "postgresql"])
def database_url(request):
    """A fresh, empty metadata database of each backend: None (SQLite in the data directory), or a new
    PostgreSQL database."""
    if request.param == "sqlite":
        return None
    from lethe.server.pg_local import fresh_database

    return fresh_database(request.getfixturevalue("postgres_server_url"))
