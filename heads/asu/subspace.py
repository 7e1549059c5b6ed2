"""Keeping ASU's adapters out of the retain set's way: each adapter reads its input with the retain set's main
directions projected out.

For every projection the student adapts, the inputs it sees along the retain examples (prompt and answer, every
token) give a covariance; its top eigenvectors, those that hold `energy` of the total (0.99: 99%), span what the
retain set's inputs are made of. LoRA's A then reads `P x` with `P = I - U U^T`, so an input like the retain set's
reaches the adapter only through what is left of it, and a retain question the set does not hold but resembles
(another template, another country) is held too, where a KL term holds only the examples it is computed on (the
idea of null-space editing, as in AlphaEdit). `P` folds into A after training (`A P`), so the file and serving
are those of any LoRA adapter.
"""

from __future__ import annotations

from collections.abc import Iterable
from contextlib import contextmanager

import torch


def input_covariances(model, batches: Iterable[tuple[torch.Tensor, torch.Tensor]], names: list[str]
                      ) -> dict[str, torch.Tensor]:
    """{module name: sum of x x^T (float64) over every real token} of the inputs of `model`'s Linear modules
    `names`, along `batches` of (token ids, attention mask)."""
    modules = {n: model.get_submodule(n) for n in names}
    sums = {n: torch.zeros(m.in_features, m.in_features, dtype=torch.float64) for n, m in modules.items()}
    keep: list[torch.Tensor] = []  # the current batch's mask, flattened

    def hook(name):
        def record(_module, args):
            x = args[0].reshape(-1, args[0].shape[-1])[keep[0]].double().cpu()
            sums[name] += x.T @ x
        return record

    handles = [m.register_forward_pre_hook(hook(n)) for n, m in modules.items()]
    try:
        with torch.no_grad():
            for ids, mask in batches:
                keep[:] = [mask.reshape(-1).bool()]
                model(input_ids=ids, attention_mask=mask)
    finally:
        for h in handles:
            h.remove()
    return sums


def complement(cov: torch.Tensor, energy: float) -> tuple[torch.Tensor, int]:
    """(P = I - U U^T as float32, the number of directions in U): U the top eigenvectors of `cov` holding at least
    `energy` of its trace."""
    values, vectors = torch.linalg.eigh(cov)  # ascending
    values, vectors = values.flip(0).clamp_min(0), vectors.flip(1)
    share = values.cumsum(0) / values.sum().clamp_min(1e-300)
    k = int((share < energy).sum()) + 1
    u = vectors[:, :k]
    return (torch.eye(cov.shape[0], dtype=torch.float64) - u @ u.T).float(), k


def kept_share(cov: torch.Tensor, p: torch.Tensor) -> float:
    """The share of the energy of inputs with covariance `cov` that passes the projection `p`."""
    p = p.double()
    return float(torch.trace(p @ cov @ p) / torch.trace(cov).clamp_min(1e-300))


def lora_name(name: str) -> str:
    """The peft model's name of base module `name`."""
    return f"base_model.model.{name}"


@contextmanager
def projected(peft_model, projections: dict[str, torch.Tensor], adapter: str = "default"):
    """While inside, the LoRA A of every module in `projections` reads `P x` instead of `x`."""
    handles = []
    for name, p in projections.items():
        a = peft_model.get_submodule(lora_name(name)).lora_A[adapter]
        p = p.to(a.weight.device, a.weight.dtype)
        handles.append(a.register_forward_pre_hook(lambda _m, args, p=p: (args[0] @ p,) + tuple(args[1:])))
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def fold(tensors: dict[str, torch.Tensor], projections: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The adapter tensors with each projected A replaced by `A P` (P is symmetric), so plain LoRA computes what
    training computed."""
    out = dict(tensors)
    for name, p in projections.items():
        key = f"{lora_name(name)}.lora_A.weight"
        out[key] = (tensors[key].float() @ p.to(tensors[key].device)).to(tensors[key].dtype).contiguous()
    return out
