"""Tempered attention for ASU's teacher: softmax(Q K^T / (tau * sqrt(d))) V in chosen layers.

A custom attention function, registered with transformers' `AttentionInterface` under
`lethe_tempered`, wraps the stock SDPA function and divides its scaling by the module's
`lethe_tau` (1 unless set). The SDPA mask function is registered under the same name too:
without it, transformers 5.x silently drops the padding mask for an unknown implementation and
left-padded batches go wrong. With tau = 1 the function is the stock SDPA call, so one model
serves as both the original and the teacher: `tempered(model, tau, layers)` switches it.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

NAME = "lethe_tempered"


def tempered_sdpa(module: torch.nn.Module, query, key, value, attention_mask, scaling: float | None = None,
                  **kwargs):
    tau = getattr(module, "lethe_tau", 1.0)
    if tau != 1.0:
        scaling = (scaling if scaling is not None else query.shape[-1] ** -0.5) / tau
    return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, **kwargs)


AttentionInterface.register(NAME, tempered_sdpa)
AttentionMaskInterface.register(NAME, sdpa_mask)


def attention_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The self-attention modules, in layer order (they carry `layer_idx`)."""
    return [m for m in model.modules() if hasattr(m, "layer_idx") and hasattr(m, "scaling")
            and type(m).__name__.endswith("Attention")]


def use_tempered_attention(model: torch.nn.Module) -> None:
    """Switch the model to the tempered attention function (identical to SDPA while tau = 1)."""
    model.set_attn_implementation(NAME)


def parse_layers(spec: str | None, num_layers: int) -> list[int]:
    """"0-1,3" -> [0, 1, 3]; None or "all" -> every layer. Out-of-range layers are an error."""
    if spec is None or spec == "all":
        return list(range(num_layers))
    layers: set[int] = set()
    for part in spec.split(","):
        lo, _, hi = part.strip().partition("-")
        a, b = int(lo), int(hi or lo)
        if not (0 <= a <= b < num_layers):
            raise ValueError(f"layers: {part!r} is outside 0-{num_layers - 1}")
        layers.update(range(a, b + 1))
    return sorted(layers)


@contextmanager
def tempered(model: torch.nn.Module, tau: float, layers: list[int]):
    """Within the block, attention in `layers` runs at temperature `tau`."""
    chosen = [m for m in attention_modules(model) if m.layer_idx in set(layers)]
    for m in chosen:
        m.lethe_tau = tau
    try:
        yield model
    finally:
        for m in chosen:
            m.lethe_tau = 1.0
