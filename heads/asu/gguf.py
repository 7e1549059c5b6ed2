"""An ASU adapter as llama.cpp reads one: a LoRA GGUF file (`general.type` adapter, `adapter.type` lora), so the
llama.cpp engine serves ASU rows on the shared quantized base (`heads.decoding.llamacpp.LlamaCppModel.add_adapter`).

The tensors are the adapter's own, renamed to llama.cpp's (`blk.{i}.attn_q.weight.lora_a`, by the `gguf` package's
tensor map) and laid out as llama.cpp's `convert_lora_to_gguf.py` writes them: A (rank, in), B (out, rank). A Llama
GGUF file holds its query and key projections with their rows permuted (llama.cpp's `convert_hf_to_gguf.py`
`LlamaModel.permute`; transformers undoes it on load), so B of those two is permuted the same way. llama.cpp
scales an adapter by alpha / rank, as peft does.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

from lethe.heads.io import atomic_write
from lethe.heads.t3.head import HeadFileError

ARCHITECTURES = ("llama",)  # whose GGUF layout (and q/k permutation) this writer knows
_NAME = re.compile(r"^base_model\.model\.(?P<module>.+)\.lora_(?P<ab>[AB])\.weight$")


def permute(weight: torch.Tensor, n_head: int, n_head_kv: int | None = None) -> torch.Tensor:
    """A query or key projection's rows (or its LoRA B) as a Llama GGUF file stores them: llama.cpp's
    `LlamaModel.permute`, whose inverse transformers applies when it loads the file."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return (weight.reshape(n_head, 2, weight.shape[0] // n_head // 2, *weight.shape[1:])
            .swapaxes(1, 2).reshape(weight.shape))


def check_servable(info, config) -> None:
    """HeadFileError unless llama.cpp can serve ASU weights with this `ASUInfo` on a model with transformers config
    `config` (their tensors already checked against the model: `heads.asu.weights.check_asu`)."""
    if info.mode != "lora":
        raise HeadFileError(f"ASU weights of mode {info.mode!r} change the projections themselves; llama.cpp "
                            "serves LoRA adapters only (train with mode lora, the default)")
    arch = getattr(config, "model_type", None)
    if arch not in ARCHITECTURES:
        raise HeadFileError(f"ASU on llama.cpp knows the GGUF layout of {', '.join(ARCHITECTURES)} models; this "
                            f"model is {arch!r}")


def lora_tensors(tensors: dict[str, torch.Tensor], info, config) -> dict[str, torch.Tensor]:
    """{llama.cpp name: float32 tensor} of an ASU LoRA adapter (`heads.asu.weights` names and `ASUInfo`) for a
    model with transformers config `config`; HeadFileError where llama.cpp could not serve it."""
    import gguf

    check_servable(info, config)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, config.num_hidden_layers)
    heads, kv_heads = config.num_attention_heads, getattr(config, "num_key_value_heads", None)
    out = {}
    for name, tensor in tensors.items():
        found = _NAME.match(name)
        target = names.get_name(found.group("module")) if found else None
        if target is None:
            raise HeadFileError(f"ASU weights: tensor {name!r} has no llama.cpp counterpart")
        tensor = tensor.detach().to(torch.float32)
        if found.group("ab") == "B" and target.endswith(".attn_q"):
            tensor = permute(tensor, heads, heads)
        elif found.group("ab") == "B" and target.endswith(".attn_k"):
            tensor = permute(tensor, heads, kv_heads)
        out[f"{target}.weight.lora_{found.group('ab').lower()}"] = tensor.contiguous()
    return out


def write_lora_gguf(path: str | Path, tensors: dict[str, torch.Tensor], info, config) -> Path:
    """Write the adapter as a llama.cpp LoRA GGUF file at `path` (a temporary name, then renamed)."""
    import gguf

    converted = lora_tensors(tensors, info, config)

    def write(tmp: Path) -> None:
        writer = gguf.GGUFWriter(str(tmp), config.model_type)
        writer.add_type(gguf.GGUFType.ADAPTER)
        writer.add_string(gguf.Keys.Adapter.TYPE, "lora")
        writer.add_float32(gguf.Keys.Adapter.LORA_ALPHA, float(info.lora_alpha))
        for name, tensor in converted.items():
            writer.add_tensor(name, tensor.numpy())
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()

    atomic_write(Path(path), write)
    return Path(path)


def add_to_llama_cpp(decoder, name: str, tensors: dict[str, torch.Tensor], info, config) -> None:
    """Load an ASU adapter into a `heads.decoding.llamacpp.LlamaCppModel` as LoRA adapter `name`, through a GGUF
    file in a temporary folder that is gone when this returns (llama.cpp keeps the tensors)."""
    import tempfile

    if getattr(info, "gate", None):
        from lethe.heads.t3.head import HeadFileError

        raise HeadFileError(f"adapter {name}: a gated ASU adapter acts token by token, which llama.cpp's LoRA "
                            "cannot do: serve it on the torch engine")
    with tempfile.TemporaryDirectory(prefix="lethe-asu-") as tmp:
        decoder.add_adapter(name, write_lora_gguf(Path(tmp) / "adapter.gguf", tensors, info, config))
