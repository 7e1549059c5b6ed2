"""One forward pass of the frozen model over the forget and retain records.

For every completion position t of every record it keeps the pooled state (the
running mean of the final hidden states over positions 0..t, prompt included, or
over the last `window` of them: `heads.t3.pooling`),
the true next token and the label (retain = 1, forget = 0). Pooled states are
stored in float16; when they would exceed `memory_budget` bytes they go to a
memory-mapped file on disk instead. Training then never runs the base model again.
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from lethe.heads.decoding.decode import forward_last_hidden
from lethe.heads.records import Example, encode_example
from lethe.heads.t3.pooling import pooled_positions


@dataclass
class PooledCache:
    pooled: np.ndarray | torch.Tensor  # (N, d) float16, in memory or memory-mapped
    target: torch.Tensor  # (N,) next-token ids
    label: torch.Tensor  # (N,) 1 retain, 0 forget
    record: torch.Tensor  # (N,) index of the record the position belongs to (forget first, then retain)
    n_forget: int  # records
    n_retain: int

    def __len__(self) -> int:
        return len(self.target)

    def rows(self, index: torch.Tensor) -> torch.Tensor:
        """Pooled states of some positions as a float32 tensor."""
        if isinstance(self.pooled, torch.Tensor):
            return self.pooled[index].float()
        return torch.from_numpy(np.asarray(self.pooled[index.numpy()])).float()


@torch.inference_mode()
def build_cache(model, tokenizer, forget: list[Example], retain: list[Example], batch_size: int = 32,
                memory_budget: int = 2 << 30, spill_dir: Path | None = None, progress: bool = True,
                on_progress=None, window: int = 0) -> PooledCache:
    """`on_progress(fraction)` is called after every batch (it may raise to stop the pass)."""
    device = next(model.parameters()).device
    encoded = [encode_example(tokenizer, ex) for ex in forget + retain]
    labels = [0] * len(forget) + [1] * len(retain)
    counts = [len(ids) - n_prompt for ids, n_prompt in encoded]
    total, d = sum(counts), model.config.hidden_size
    if total * d * 2 <= memory_budget:
        pooled = torch.empty((total, d), dtype=torch.float16)
    else:
        folder = Path(tempfile.mkdtemp(prefix="lethe-cache-", dir=spill_dir))
        pooled = np.lib.format.open_memmap(folder / "pooled.npy", mode="w+", dtype=np.float16, shape=(total, d))
    target = torch.empty(total, dtype=torch.long)
    label = torch.empty(total, dtype=torch.float32)
    record = torch.empty(total, dtype=torch.long)
    order = sorted(range(len(encoded)), key=lambda i: len(encoded[i][0]))  # similar lengths share a batch
    starts = np.concatenate([[0], np.cumsum(counts)])
    for b in tqdm(range(0, len(order), batch_size), desc="caching", disable=not progress, leave=False):
        idx = order[b:b + batch_size]
        width = max(len(encoded[i][0]) for i in idx)
        ids = torch.full((len(idx), width), tokenizer.pad_token_id or 0)
        mask = torch.zeros((len(idx), width), dtype=torch.long)
        for r, i in enumerate(idx):  # right padding: positions are 0..len-1 with no offset
            ids[r, :len(encoded[i][0])] = torch.tensor(encoded[i][0])
            mask[r, :len(encoded[i][0])] = 1
        positions = torch.arange(width).expand(len(idx), width)
        hidden = forward_last_hidden(model, ids.to(device), mask.to(device), positions.to(device), None).float()
        pooled_all = pooled_positions(hidden, window)  # right padding: each row's positions are its own first
        for r, i in enumerate(idx):
            seq, n_prompt = encoded[i]
            lo, hi = starts[i], starts[i + 1]
            rows = pooled_all[r, n_prompt - 1:len(seq) - 1].to(torch.float16).cpu()
            pooled[lo:hi] = rows if isinstance(pooled, torch.Tensor) else rows.numpy()
            target[lo:hi] = torch.tensor(seq[n_prompt:])
            label[lo:hi] = labels[i]
            record[lo:hi] = i
        if on_progress is not None:
            on_progress(min(1.0, (b + batch_size) / len(order)))
    if isinstance(pooled, np.memmap):
        pooled.flush()
    return PooledCache(pooled, target, label, record, len(forget), len(retain))
