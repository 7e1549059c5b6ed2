import json
import shutil

import pytest

from lethe.heads.modelio import ModelLoadError, load_model


def test_missing_directory_is_named(tmp_path):
    with pytest.raises(ModelLoadError, match=r"nope: model directory does not exist"):
        load_model(tmp_path / "nope")


def test_config_that_is_not_a_causal_lm_is_refused(tmp_path, tiny_model_dir):
    bad = tmp_path / "vit"
    shutil.copytree(tiny_model_dir, bad)
    (bad / "config.json").write_text(json.dumps({"model_type": "vit"}))
    with pytest.raises(ModelLoadError, match=r"vit.*'vit' is not a causal language model"):
        load_model(bad)


def test_missing_tokenizer_is_named(tmp_path, tiny_model_dir):
    bad = tmp_path / "notok"
    shutil.copytree(tiny_model_dir, bad)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        (bad / f).unlink(missing_ok=True)
    with pytest.raises(ModelLoadError, match=r"notok: no tokenizer files"):
        load_model(bad)


def test_directory_without_config_is_named(tmp_path):
    with pytest.raises(ModelLoadError, match="no config.json"):
        load_model(tmp_path)


def test_fingerprint_is_stable_across_loads_and_dtypes_and_tells_models_apart(tmp_path, tiny_model_dir):
    a = load_model(tiny_model_dir)
    b = load_model(tiny_model_dir, dtype="bfloat16")
    assert b.model.dtype.is_floating_point and a.fingerprint == b.fingerprint == load_model(tiny_model_dir).fingerprint
    other = tmp_path / "other"
    shutil.copytree(tiny_model_dir, other)
    a.model.model.norm.weight.data += 0.5
    a.model.save_pretrained(other)
    assert load_model(other).fingerprint != a.fingerprint


def test_missing_weights_are_named(tmp_path, tiny_model_dir):
    bad = tmp_path / "noweights"
    shutil.copytree(tiny_model_dir, bad)
    (bad / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match=r"noweights: no weight files"):
        load_model(bad)


def test_a_gguf_file_without_the_extra_names_the_extra(tmp_path, monkeypatch):
    import sys

    from lethe.heads.modelio import ModelLoadError, load_model

    (tmp_path / "m.gguf").write_bytes(b"GGUF")
    monkeypatch.setitem(sys.modules, "gguf", None)  # as if `lethe[gguf]` were not installed
    for path in (tmp_path / "m.gguf", tmp_path):  # the file, or a directory holding it
        with pytest.raises(ModelLoadError, match=r"pip install 'lethe\[gguf\]'"):
            load_model(path)
    monkeypatch.undo()
    with pytest.raises(ModelLoadError, match="GGUF file could not be loaded"):
        load_model(tmp_path / "m.gguf")
