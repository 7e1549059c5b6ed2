"""Loading a model users have: a local Hugging Face causal-LM directory, a GGUF file (llama.cpp, Ollama), or a
directory holding one GGUF file; errors name the path and the problem.

GGUF files are dequantised to torch tensors by transformers with the `gguf` package (the `lethe[gguf]`
extra). `prepare_gguf` does that once and saves a plain Hugging Face directory the server starts from
quickly. A model's fingerprint identifies its weights, not its file format: for a GGUF file it is computed
from the dequantised tensors, and a prepared directory records it (`lethe_model.json`), so a head trained
against either loads against the other.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import torch

from lethe.heads.io import sha256_file

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
        raise ModelLoadError(f"{path}: not a directory or a .gguf file")
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


PREPARED = "lethe_model.json"  # written by `prepare_gguf`: the source file, its sha256, the weights' fingerprint


def gguf_file(path: str | Path) -> Path | None:
    """The GGUF file `path` names: the file itself, or the one `*.gguf` in a directory without config.json."""
    path = Path(path)
    if path.is_file() and path.suffix.lower() == ".gguf":
        return path
    if path.is_dir() and not (path / "config.json").is_file():
        found = sorted(path.glob("*.gguf"))
        if len(found) > 1:
            raise ModelLoadError(f"{path}: holds {len(found)} GGUF files; name one of them")
        return found[0] if found else None
    return None


def _require_gguf() -> None:
    import importlib

    try:
        importlib.import_module("gguf")
    except ImportError:
        raise ModelLoadError("reading GGUF files needs the `gguf` package: pip install 'lethe[gguf]'") from None


def _load_gguf(file: Path, device: str, dtype: str) -> LoadedModel:
    """Dequantise a GGUF file into a plain model (no quantization_config, so it saves and trains normally)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    _require_gguf()
    try:
        tokenizer = AutoTokenizer.from_pretrained(file.parent, gguf_file=file.name, local_files_only=True)
        loaded = AutoModelForCausalLM.from_pretrained(file.parent, gguf_file=file.name, local_files_only=True,
                                                      dtype=torch.float32)
    except Exception as e:
        raise ModelLoadError(f"{file}: GGUF file could not be loaded ({type(e).__name__}: {e})") from None
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config = AutoConfig.for_model(**config.to_dict())
    fp = weights_fingerprint(loaded)  # of the float32 values, whatever dtype the model is served in
    # Built in the target dtype and filled from the dequantised weights, as `from_pretrained(dtype=...)` builds a
    # prepared directory's model (casting the finished model would also cast its float32 buffers, e.g. RoPE's
    # frequencies, and the GGUF and its prepared directory would give different logits in bfloat16).
    model = AutoModelForCausalLM.from_config(config, dtype=DTYPES[dtype])
    state = loaded.state_dict()
    model.load_state_dict(state, strict=False)
    if getattr(config, "tie_word_embeddings", False):
        model.tie_weights()
    del loaded, state
    _finish_tokenizer(tokenizer)
    model.to(device).eval().requires_grad_(False)
    return LoadedModel(model, tokenizer, file, fp)


def _finish_tokenizer(tokenizer) -> None:
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"


def weights_fingerprint(model: torch.nn.Module) -> str:
    """A short id of a model's weights as float32 values, whatever file they came from (GGUF or a directory)."""
    h = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        h.update(f"{name}:{tuple(tensor.shape)}".encode())
        h.update(tensor.detach().to(torch.float32).contiguous().cpu().numpy().tobytes())
    return h.hexdigest()[:16]


def prepare_gguf(file: str | Path, out: str | Path, dtype: str = "float32") -> Path:
    """Dequantise a GGUF file once into a Hugging Face directory `out` (weights, config, tokenizer and the
    fingerprint of the GGUF's weights); written beside `out` and renamed, so `out` is complete or absent."""
    import os
    import shutil
    import tempfile

    file, out = Path(file), Path(out)
    if dtype not in DTYPES:
        raise ModelLoadError(f"dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    if not file.is_file():
        raise ModelLoadError(f"{file}: no such GGUF file")
    if out.exists():
        raise ModelLoadError(f"{out}: already exists; remove it or choose another --out")
    lm = _load_gguf(file, "cpu", dtype)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent))
    try:
        lm.model.save_pretrained(tmp)
        lm.tokenizer.save_pretrained(tmp)
        (tmp / PREPARED).write_text(json.dumps({"source": file.name, "source_sha256": sha256_file(file),
                                                "fingerprint": lm.fingerprint, "dtype": dtype}, indent=2) + "\n")
        tmp.chmod(0o755)  # mkdtemp made it private; a model directory is as readable as any other
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def load_model(path: str | Path, device: str = "cpu", dtype: str = "float32") -> LoadedModel:
    """Load model and tokenizer from a local directory or a GGUF file; evaluation mode, gradients off."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    path = Path(path)
    if dtype not in DTYPES:
        raise ModelLoadError(f"dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    if path.exists():
        gguf = gguf_file(path)
        if gguf is not None:
            return _load_gguf(gguf, device, dtype)
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
    _finish_tokenizer(tokenizer)
    try:
        model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True, dtype=DTYPES[dtype])
    except Exception as e:
        raise ModelLoadError(f"{path}: weights could not be loaded ({e})") from None
    model.to(device).eval().requires_grad_(False)
    prepared = path / PREPARED
    fp = json.loads(prepared.read_text())["fingerprint"] if prepared.is_file() else fingerprint(path)
    return LoadedModel(model, tokenizer, path, fp)


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
