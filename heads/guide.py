"""Applying T3 heads during decoding: per-row heads and settings in one batch.

`TiltSettings` is what a profile chooses (T, lam, and Lethe's gate and
candidate restriction). `HeadGuide` is the decode loop's `Guide`: it groups the
rows by head, runs each head once on its rows' pooled states and applies
`heads.tilt.tilt`. Rows without a head keep the model's logits untouched.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from heads.head import T3Head
from heads.tilt import candidates_of, tilt, tilt_among


@dataclass(frozen=True)
class TiltSettings:
    T: float = 1.0
    lam: float = 1.0
    gate: bool = True  # temper and tilt only as far as the context is forget-like
    candidates: int = 20  # tilt among the base model's k most likely tokens; 0 = all tokens
    cap: float | None = 0.5  # flagged tokens score at most the best other token minus this; None = off

    def as_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, values: dict) -> "TiltSettings":
        """Settings as stored (a head file's recommendation, a profile); missing keys take defaults."""
        unknown = set(values) - set(asdict(TiltSettings()))
        if unknown:
            raise ValueError(f"unknown profile settings: {', '.join(sorted(unknown))}")
        return cls(**{**asdict(TiltSettings()), **values}).replace()

    def replace(self, **changes) -> "TiltSettings":
        """These settings with some fields changed (None values are ignored); checks the values."""
        merged = self.as_dict() | {k: v for k, v in changes.items() if v is not None}
        unknown = set(merged) - set(asdict(TiltSettings()))
        if unknown:
            raise ValueError(f"unknown profile settings: {', '.join(sorted(unknown))}")
        out = TiltSettings(**merged)
        if not (out.T > 0 and out.T <= 100):
            raise ValueError(f"T: must be in (0, 100], got {out.T}")
        if not (out.lam >= 0 and out.lam <= 1000):
            raise ValueError(f"lam: must be in [0, 1000], got {out.lam}")
        if out.candidates < 0:
            raise ValueError(f"candidates: must be >= 0, got {out.candidates}")
        if out.cap is not None and not (0 <= out.cap <= 100):
            raise ValueError(f"cap: must be in [0, 100] or null, got {out.cap}")
        return out


PRESETS = {
    # the public reference's published run: T = 2.5, lam = 1, over the whole vocabulary, always on
    "paper": TiltSettings(T=2.5, lam=1.0, gate=False, candidates=0, cap=None),
    "default": TiltSettings(),
}


class HeadGuide:
    """A `Guide` for a batch whose rows may each carry a different head and settings (or none).

    The per-group tensors (row indices, T, lam, k, gate switch) are built once, not at every step.
    """

    def __init__(self, rows: list[tuple[T3Head, TiltSettings] | None]):
        self.rows = rows
        self.same: tuple[T3Head, TiltSettings] | None = None
        self._groups: list[tuple] | None = None
        self._size = len(rows)

    @classmethod
    def uniform(cls, head: T3Head, settings: TiltSettings) -> "HeadGuide":
        """One head and settings for every row, whatever the batch size."""
        guide = cls([])
        guide.same = (head, settings)
        return guide

    def _build(self, batch: int, device) -> list[tuple]:
        rows = [self.same] * batch if self.same is not None else self.rows
        by_head: dict[int, tuple[T3Head, list[int]]] = {}
        for i, row in enumerate(rows):
            if row is not None:
                by_head.setdefault(id(row[0]), (row[0], []))[1].append(i)
        groups = []
        for head, idx in by_head.values():
            s = [rows[i][1] for i in idx]
            everyone = len(idx) == batch
            groups.append((head, None if everyone else torch.tensor(idx, device=device),
                           torch.tensor([x.T for x in s], device=device),
                           torch.tensor([x.lam for x in s], device=device),
                           torch.tensor([x.candidates for x in s], device=device),
                           torch.tensor([-1.0 if x.cap is None else x.cap for x in s], device=device)
                           if any(x.cap is not None for x in s) else None,
                           torch.tensor([x.gate for x in s], device=device) if any(x.gate for x in s) else None,
                           all(x.candidates > 0 for x in s), all(x.gate for x in s)))
        return groups

    def __call__(self, logits: torch.Tensor, pooled: torch.Tensor) -> torch.Tensor:
        if self._groups is None or self._size != logits.size(0):
            self._groups, self._size = self._build(logits.size(0), logits.device), logits.size(0)
        if not self._groups:
            return logits
        out = None
        for head, rows, T, lam, k, cap, gate_on, all_candidates, all_gated in self._groups:
            x, p = (logits, pooled) if rows is None else (logits[rows], pooled[rows])
            if all_candidates:  # only the candidates' terms are needed
                cand = candidates_of(x, k)
                forget_p, z = head.decode_terms(p, cand)
                gate = None if gate_on is None else forget_p if all_gated else torch.where(gate_on, forget_p, 1.0)
                tilted = tilt_among(x, cand, z, T, lam, gate, cap)
            else:
                gate = None
                if gate_on is not None:
                    gate = torch.where(gate_on, head.forget_probability(p), 1.0)
                tilted = tilt(x, head(p), T, lam, gate, k, cap)
            if rows is None:
                return tilted
            if out is None:
                out = logits.float().clone()
            out[rows] = tilted
        return out
