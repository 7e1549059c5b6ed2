import json
import time

import pytest
from transformers import AutoModelForCausalLM, AutoTokenizer

from lethe.clients.cli import main
from lethe.heads.demo.build import BuildConfig, build, greedy_recall
from lethe.heads.records import examples


def test_built_directory_is_a_standard_hf_model_that_recalls_its_training_answers(tiny_model_dir, tiny_records):
    names = {p.name for p in tiny_model_dir.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "generation_config.json"} <= names
    assert not any(n.startswith(".") for n in names), "no work files are left in the output"
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    assert type(model).__name__ == "LlamaForCausalLM"
    assert greedy_recall(model, tok, examples(tiny_records)) >= 0.95


def test_cli_rebuilds_a_small_model_with_the_same_recipe_in_under_two_minutes(tmp_path):
    started = time.perf_counter()
    rc = main(["demo", "build", "--authors", "3", "--seed", "11", "--out", str(tmp_path / "m"), "--quiet",
               "--hidden-size", "64", "--layers", "2", "--intermediate-size", "128", "--vocab-size", "768", "--lr", "3e-3",
               "--batch-size", "8"])
    assert rc == 0
    assert time.perf_counter() - started < 120
    report = json.loads((tmp_path / "m" / "lethe_build.json").read_text())
    assert report["recall"] >= 0.95 and report["records"] == 60


def test_interrupted_build_resumes_from_its_checkpoint(tmp_path, tiny_records):
    cfg = dict(hidden_size=32, layers=1, heads=2, intermediate_size=64, vocab_size=512, batch_size=16)
    data = examples(tiny_records[:20])
    quiet = dict(progress=False, log=lambda *_: None)
    with pytest.raises(RuntimeError, match="can be resumed"):
        build(data, tmp_path, BuildConfig(max_epochs=2, **cfg), **quiet)
    assert (tmp_path / ".build" / "checkpoint.pt").exists()
    lines = []
    with pytest.raises(RuntimeError):
        build(data, tmp_path, BuildConfig(max_epochs=3, **cfg), progress=False, log=lines.append)
    assert any("resuming" in line and "after epoch 2" in line for line in lines)
    assert any(line.startswith("epoch 3:") for line in lines) and not any(line.startswith("epoch 1:") for line in lines)
    lines.clear()
    with pytest.raises(RuntimeError):
        build(data, tmp_path, BuildConfig(max_epochs=1, lr=1e-4, **cfg), progress=False, log=lines.append)
    assert any("starting over" in line for line in lines), "other settings must not resume another run"
