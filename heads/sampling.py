"""Turning one step's logits into next tokens: per-row temperature, top-k, top-p and seed.

Pure tensor functions. Every setting is a tensor with one entry per batch row,
so rows with different settings decode in one batch. Temperature 0 is greedy.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class SamplingParams:
    max_new_tokens: int = 64
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False  # always generate max_new_tokens (benchmarks)


def logits_to_probs(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                    top_p: torch.Tensor) -> torch.Tensor:
    """Probabilities after temperature, then top-k, then top-p (nucleus); rows independent.

    logits (B, V); temperature (B,) > 0; top_k (B,) with 0 meaning off; top_p (B,) in (0, 1].
    """
    logits = logits.float() / temperature[:, None]
    if bool((top_k <= 0).all()) and bool((top_p >= 1).all()):
        return torch.softmax(logits, dim=-1)
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    vocab = logits.size(-1)
    ranks = torch.arange(vocab, device=logits.device).expand_as(sorted_logits)
    k = torch.where(top_k > 0, top_k.clamp(max=vocab), torch.full_like(top_k, vocab))
    remove = ranks >= k[:, None]
    probs = torch.softmax(sorted_logits.masked_fill(remove, float("-inf")), dim=-1)
    before = probs.cumsum(dim=-1) - probs  # mass of the better tokens; the best token always stays
    remove |= before >= top_p[:, None]
    kept = torch.softmax(sorted_logits.masked_fill(remove, float("-inf")), dim=-1)
    return torch.zeros_like(kept).scatter_(-1, order, kept)


def sample(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
           generators: list[torch.Generator]) -> torch.Tensor:
    """Next token per row: argmax where temperature is 0, else a draw from that row's own generator."""
    tokens = logits.argmax(dim=-1)
    sampled = (temperature > 0).nonzero().flatten().tolist()
    if sampled:
        rows = torch.tensor(sampled, device=logits.device)
        probs = logits_to_probs(logits[rows], temperature[rows], top_k[rows], top_p[rows])
        for j, row in enumerate(sampled):
            tokens[row] = torch.multinomial(probs[j], 1, generator=generators[row])[0]
    return tokens


def make_generator(seed: int | None, device: torch.device | str = "cpu") -> torch.Generator:
    g = torch.Generator(device=device)
    if seed is None:
        g.seed()
    else:
        g.manual_seed(seed)
    return g
