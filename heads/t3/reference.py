"""Importing a head from the public T3 reference (open-unlearning's `T3CausalLM` save).

The reference saves a whole model: the base weights plus `guidance_head.proj.0.weight`
(r x d, the down projection) and the last `guidance_head.proj.N.weight` (V x r, the up
projection), with `base_temp`, `guidance_scale`, `extraction_layer` and `pooling` in its
config. Lethe keeps only the two head matrices, and the settings become the profile
(the reference applies the tilt always and over the whole vocabulary: gate off, no
candidate restriction).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch

from lethe.heads.t3.guide import PRESETS
from lethe.heads.t3.head import HeadFileError, HeadInfo, T3Head

PROJ = re.compile(r"(?:^|\.)guidance_head\.proj\.(\d+)\.weight$")


def _reference_tensors(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors import safe_open

    found: dict[str, torch.Tensor] = {}
    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(str(f), "pt") as sf:
            found |= {k: sf.get_tensor(k) for k in sf.keys() if PROJ.search(k)}
    for f in sorted(folder.glob("*.bin")):
        state = torch.load(f, map_location="cpu", weights_only=True)
        found |= {k: v for k, v in state.items() if PROJ.search(k)}
    return found


def import_reference(folder: str | Path, base_fingerprint: str, d: int, vocab: int,
                     num_layers: int | None = None) -> tuple[T3Head, HeadInfo]:
    """Read a reference save; `base_fingerprint`, `d`, `vocab` describe the base model it will run on."""
    folder = Path(folder)
    config_file = folder / "config.json"
    if not config_file.is_file():
        raise HeadFileError(f"{folder}: no config.json; not a reference T3 save")
    config = json.loads(config_file.read_text())
    missing = [k for k in ("base_temp", "guidance_scale") if k not in config]
    if missing:
        raise HeadFileError(f"{config_file}: no {', '.join(missing)}; not a reference T3 config")
    layer = config.get("extraction_layer", -1)
    if layer is not None and layer not in (-1, num_layers):
        raise HeadFileError(f"{config_file}: extraction_layer {layer}; Lethe pools the last layer only")
    pooling = config.get("pooling", "mean")
    if pooling != "mean":
        raise HeadFileError(f"{config_file}: pooling {pooling!r}; Lethe pools with the running mean only")
    tensors = _reference_tensors(folder)
    by_index = {int(PROJ.search(k).group(1)): v for k, v in tensors.items()}
    if 0 not in by_index or len(by_index) < 2:
        raise HeadFileError(f"{folder}: guidance_head.proj.0.weight and a later projection are needed, "
                            f"found {sorted(tensors) or 'none'}")
    down, up = by_index[0].float(), by_index[max(by_index)].float()
    rank = down.shape[0]
    if down.shape != (rank, d) or up.shape != (vocab, rank):
        raise HeadFileError(f"{folder}: head shapes {tuple(down.shape)} and {tuple(up.shape)} do not fit "
                            f"a base model with hidden size {d} and vocabulary {vocab}")
    head = T3Head(d, vocab, rank, bias=False, probe=False)
    head.load_state_dict({"down.weight": down, "up.weight": up})
    settings = PRESETS["paper"].replace(T=float(config["base_temp"]), lam=float(config["guidance_scale"]))
    info = HeadInfo(base_fingerprint=base_fingerprint, d=d, vocab=vocab, rank=rank, profile=settings.as_dict(),
                    training={"imported_from": str(folder)})
    return head.eval().requires_grad_(False), info
