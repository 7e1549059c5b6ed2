"""Loading a local Hugging Face causal-LM directory, with errors that name the path and the problem."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import torch

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


class ModelLoadError(ValueError):
    pass


@dataclass
class LoadedModel:
    model: torch.nn.Module
    tokenizer: object
    path: Path
    fingerprint: str

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device


def _check_dir(path: Path) -> dict:
    if not path.exists():
        raise ModelLoadError(f"{path}: model directory does not exist")
    if not path.is_dir():
        raise ModelLoadError(f"{path}: not a directory")
    config_file = path / "config.json"
    if not config_file.is_file():
        raise ModelLoadError(f"{path}: no config.json, so this is not a Hugging Face model directory")
    try:
        config = json.loads(config_file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ModelLoadError(f"{config_file}: unreadable config ({e})") from None
    tokenizer_files = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")
    if not any(path.glob("*.safetensors")) and not any(path.glob("*.bin")):
        raise ModelLoadError(f"{path}: no weight files (*.safetensors or *.bin)")
    if not any((path / f).is_file() for f in tokenizer_files):
        raise ModelLoadError(f"{path}: no tokenizer files (expected one of {', '.join(tokenizer_files)})")
    return config


def load_model(path: str | Path, device: str = "cpu", dtype: str = "float32") -> LoadedModel:
    """Load model and tokenizer from a local directory; evaluation mode, gradients off."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    path = Path(path)
    if dtype not in DTYPES:
        raise ModelLoadError(f"dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    raw = _check_dir(path)
    try:
        config = AutoConfig.from_pretrained(path, local_files_only=True)
    except Exception as e:  # transformers raises several types for a bad config
        raise ModelLoadError(f"{path}: config.json is not a known model config ({e})") from None
    if config.model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise ModelLoadError(f"{path}: model_type {raw.get('model_type')!r} is not a causal language model")
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    except Exception as e:
        raise ModelLoadError(f"{path}: tokenizer could not be loaded ({e})") from None
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
    try:
        model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True, dtype=DTYPES[dtype])
    except Exception as e:
        raise ModelLoadError(f"{path}: weights could not be loaded ({e})") from None
    model.to(device).eval().requires_grad_(False)
    return LoadedModel(model, tokenizer, path, fingerprint(path))


def fingerprint(path: str | Path) -> str:
    """A short id of a model directory's weights, independent of the dtype it is loaded in.

    Hashes the weight files (whole up to 64 MiB each; beyond that their safetensors header, size and
    first and last 8 MiB), so heads and adapters trained on one base can be told from another's.
    """
    h = hashlib.sha256()
    files = sorted(Path(path).glob("*.safetensors")) or sorted(Path(path).glob("*.bin"))
    for f in files:
        size = f.stat().st_size
        h.update(f"{f.name}:{size}".encode())
        with open(f, "rb") as fh:
            if size <= 64 << 20:
                h.update(fh.read())
            else:
                header = int.from_bytes(fh.read(8), "little") if f.suffix == ".safetensors" else 0
                h.update(fh.read(min(header, 8 << 20)))
                fh.seek(0)
                h.update(fh.read(8 << 20))
                fh.seek(size - (8 << 20))
                h.update(fh.read())
    return h.hexdigest()[:16]
