"""What a T3 head reads: the last layer's hidden states pooled over the context so far.

Two poolings, named in a head file's metadata (`HeadInfo.pooling`):
- `mean` (the published T3's): the running mean over every position so far, prompt included;
- `window:W`: the mean over the last W positions only. Text before the question (a system prompt, earlier
  turns, a retrieved document) does not dilute it, so a head forgets in those contexts too
  (docs/forgetting-in-context.md).

`pooled_positions` pools every position of one sequence (training's cache, prompt scoring); `Pool` keeps the
rows' pooled states while a batch decodes, one token per step.
"""

from __future__ import annotations

import torch

MAX_WINDOW = 4096
DEFAULT_WINDOW = 16  # what a head trains with unless asked otherwise (docs/forgetting-in-context.md)


def window_of(pooling: str) -> int:
    """The window of a pooling name (0: the whole context's mean); ValueError for anything else."""
    if pooling == "mean":
        return 0
    kind, _, size = pooling.partition(":")
    if kind != "window" or not size.isdigit() or not 1 <= int(size) <= MAX_WINDOW:
        raise ValueError(f"pooling: 'mean' or 'window:W' with W in [1, {MAX_WINDOW}], got {pooling!r}")
    return int(size)


def pooling_name(window: int) -> str:
    return "mean" if window == 0 else f"window:{window}"


def pooled_positions(hidden: torch.Tensor, window: int = 0) -> torch.Tensor:
    """(..., L, d) -> (..., L, d): at each position, the mean of the states over the last `window` positions up to
    it (0: all of them)."""
    total = hidden.float().cumsum(-2)
    counts = torch.arange(1, hidden.size(-2) + 1, device=hidden.device, dtype=total.dtype)[:, None]
    if window == 0:
        return total / counts
    zeros = total.new_zeros(*total.shape[:-2], window, total.size(-1))
    before = torch.cat([zeros, total], -2)[..., :hidden.size(-2), :]  # the sum up to t - window
    return (total - before) / counts.clamp(max=window)


class Pool:
    """The pooled states of a batch's rows, row i over its own window `windows[i]` (0: the whole context).

    Keeps the running sum and count of every row, and, when some row has a window, the last states of every
    row in a (B, width, d) ring buffer (a few hundred kilobytes: nothing beside a forward pass; a step writes the
    new states over the oldest, at `_start`) and each row's sum over its window, updated as a state enters it and
    one leaves (a few operations a step, where summing the buffer again took a tenth of a millisecond; summed afresh
    every `REFRESH` steps, so rounding cannot build up over a long answer)."""

    REFRESH = 256

    def __init__(self, prompt_hidden: list[torch.Tensor], windows: list[int]):
        """`prompt_hidden`: per row, the final hidden states of its prompt (L_i, d)."""
        self.sum = torch.stack([h.float().sum(0) for h in prompt_hidden])
        self.count = torch.tensor([len(h) for h in prompt_hidden], device=self.sum.device,
                                  dtype=torch.float32)[:, None]
        self.window = torch.tensor(windows, device=self.sum.device, dtype=torch.float32)[:, None]  # (B, 1)
        self.recent = None
        width = max(windows, default=0)
        if width:
            self.recent = self.sum.new_zeros(len(prompt_hidden), width, self.sum.size(1))
            for i, (h, w) in enumerate(zip(prompt_hidden, windows)):
                tail = h[-w:].float() if w else h[:0].float()
                self.recent[i, width - len(tail):] = tail
        self._start = 0  # the buffer's oldest slot, where the next step writes
        self._arrange()

    def _ordered(self) -> torch.Tensor | None:
        """The buffer oldest state first (the ring turned back to slot 0)."""
        if self.recent is None or self._start == 0:
            return self.recent
        return torch.roll(self.recent, -self._start, dims=1)

    def _arrange(self) -> None:
        """After the rows change: each row's window sum from the buffer, and what a step needs, computed once."""
        self._pushes = 0
        if self.recent is None:
            return
        self.recent, self._start = self._ordered(), 0
        width = self.recent.size(1)
        slots = torch.arange(width, device=self.sum.device)[None, :]
        last = (slots >= width - self.window).float()[:, :, None]  # the row's last W slots (none where W = 0)
        self.window_sum = (self.recent * last).sum(1)
        # the slot (counted from the oldest) whose state leaves each row's window at the next step (rows without a
        # window: any, unused)
        self._leaving = (width - self.window[:, 0].long()).clamp(max=width - 1)
        self._rows = torch.arange(len(self.sum), device=self.sum.device)
        self._span = self.window.clamp(min=1)
        self._all_windowed = bool((self.window > 0).all())
        self._full = bool((self.window == width).all())  # every row's window spans the buffer: the oldest slot leaves

    def pooled(self) -> torch.Tensor:
        """(B, d): each row's pooled state now."""
        if self.recent is None:
            return self.sum / self.count
        windowed = self.window_sum / torch.minimum(self.count, self._span)
        return windowed if self._all_windowed else torch.where(self.window > 0, windowed, self.sum / self.count)

    def push(self, hidden: torch.Tensor) -> None:
        """Every row moves on by one position whose final state is `hidden` (B, d)."""
        hidden = hidden.float()
        self.sum += hidden
        self.count = self.count + 1
        if self.recent is not None:
            start, width = self._start, self.recent.size(1)
            leaving = self.recent[:, start] if self._full else \
                self.recent[self._rows, (self._leaving + start) % width]
            self.window_sum += hidden - leaving
            self.recent[:, start] = hidden
            self._start = (start + 1) % width
            self._pushes += 1
            if self._pushes == self.REFRESH:
                self._arrange()

    def keep(self, idx: torch.Tensor) -> None:
        self.sum, self.count, self.window = self.sum[idx], self.count[idx], self.window[idx]
        if self.recent is not None:
            self.recent = self.recent[idx]  # its slots turn with the rows kept; _arrange orders them
        self._arrange()

    def merge(self, other: "Pool") -> None:
        """Add `other`'s rows after these."""
        rows = len(self.sum)
        width = max([int(self.window.max()), int(other.window.max())] +
                    [p.recent.size(1) for p in (self, other) if p.recent is not None])
        self.sum, self.count = torch.cat([self.sum, other.sum]), torch.cat([self.count, other.count])
        self.window = torch.cat([self.window, other.window])
        if width:
            self.recent = torch.cat([_left(self._ordered(), width, rows, self.sum),
                                     _left(other._ordered(), width, len(other.sum), self.sum)])
            self._start = 0
        self._arrange()


def _left(recent: torch.Tensor | None, width: int, rows: int, like: torch.Tensor) -> torch.Tensor:
    """A rows' recent-state buffer widened to `width` slots on the left (zeros: no state there)."""
    if recent is None:
        return like.new_zeros(rows, width, like.size(1))
    missing = width - recent.size(1)
    return recent if missing == 0 else torch.cat([recent.new_zeros(rows, missing, recent.size(2)), recent], 1)
