"""The head's decoding step on the CPU as one compiled kernel (numba).

Per row: the base model's k likeliest tokens, the head's down projection and
probe on the pooled state, the head's logits at the candidates, then
`heads.t3.tilt.tilt_candidates` (gate, tempering, tilt, word guard, cap and its push limit), written over the
vocabulary (-inf outside the candidates). The same computation as
`HeadGuide`'s tensor operations, in one call instead of about twenty: on a small
model each tensor operation costs microseconds of dispatch, which on the 3.6M
demo model made the head cost more than the 5% of a decoding step it may.

Used for CPU tensors; other devices keep the tensor operations. Set
LETHE_FUSED_TILT=0 to use the tensor operations on the CPU as well (they are also
used when numba is not installed). The kernel is compiled on first use (about a
second) and cached on disk by numba.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
import math
import os
import pickle

import numpy as np
import torch

log = logging.getLogger("lethe.fused")


def enabled() -> bool:
    """Whether to use the kernel: unless LETHE_FUSED_TILT=0, or numba is not installed (tensor operations then)."""
    return os.environ.get("LETHE_FUSED_TILT", "1") != "0" and _numba_installed()


@functools.cache
def _numba_installed() -> bool:
    return importlib.util.find_spec("numba") is not None


SETTINGS = 10  # the columns of TiltKernel.settings


class TiltKernel:
    """One head's decoding step for a group of rows with fixed settings, built once per batch.

    Called with (B, V) logits and (B, d) pooled states on the CPU, it returns (B, V) tilted scores,
    -inf off the candidates, in a buffer it reuses: the result is valid until the next call (the
    decode loop samples from it at once). Reusing it keeps the step from allocating, and freeing,
    B x V floats every token, which slowed the next forward pass measurably on a small model.
    """

    def __init__(self, head, k: int, candidates: list[int], T: list[float], lam: list[float], gate: list[bool],
                 cap: list[float | None], min_p: list[float] | None = None, head_gate: list[float] | None = None,
                 flagged_mass: list[float] | None = None, word_guard: list[bool] | None = None,
                 words: torch.Tensor | None = None, push: list[float] | None = None):
        """`words` (V,): which tokens continue a word, for the rows with `word_guard` (None: no row guards); `push`:
        the cap's push limit per row (`heads.t3.tilt.limit_push`; inf or None: off)."""
        down, bias, up, up_bias = head._decoding_weights()
        as_np = lambda t: t.detach().to("cpu", torch.float32).contiguous().numpy()  # noqa: E731
        self.weights = (as_np(down), as_np(bias), as_np(up),
                        np.zeros(up.shape[0], np.float32) if up_bias is None else as_np(up_bias[:, 0]))
        self.probe, self.k = head.probe is not None, k
        # per row: number of candidates, T, lam, gate switch, cap (NaN: off), log(min_p) (-inf: off),
        # head_gate (0: off), flagged_mass (0: off), word guard switch (0: off), push limit (inf: off)
        n_rows = len(candidates)
        push = push or [np.inf] * n_rows
        min_p, head_gate = min_p or [0.0] * n_rows, head_gate or [0.0] * n_rows
        flagged_mass = flagged_mass or [0.0] * n_rows
        word_guard = word_guard if words is not None and word_guard else [False] * n_rows
        self.words = np.zeros(0, np.bool_) if words is None else words.to("cpu").numpy()
        self.settings = np.asarray([(n, t, l_, float(g), np.nan if c is None else c, math.log(m) if m > 0 else -np.inf,
                                     h, f, float(w), p) for n, t, l_, g, c, m, h, f, w, p in
                                    zip(candidates, T, lam, gate, cap, min_p, head_gate, flagged_mass, word_guard,
                                        push)],
                                   dtype=np.float32).reshape(n_rows, SETTINGS)
        self._out: torch.Tensor | None = None
        self._out_np: np.ndarray | None = None
        self.active = np.ones(len(candidates), np.bool_)  # after a call: which rows the gate let in
        self.gate = np.ones(len(candidates), np.float32)  # after a call: each row's gate (1 where it is off)
        self.gate_tensor = torch.from_numpy(self.gate)  # the same memory, as a tensor
        # after a call: the rows tilted at this step whose likeliest token the head flags (z < 0)
        self.flagged_top = np.zeros(len(candidates), np.bool_)
        self._no_floor = np.zeros(len(candidates), np.float32)

    def __call__(self, logits: torch.Tensor, pooled: torch.Tensor, floor: torch.Tensor | None = None) -> torch.Tensor:
        """`floor` (B,): a gate no row's may fall below (sticky gates; None: 0)."""
        if self._out is None or self._out.shape != logits.shape:
            self._out = torch.empty(logits.shape, dtype=torch.float32)
            self._out_np = self._out.numpy()
        _call(_array(logits), _array(pooled), *self.weights, self.probe, self.k, self.settings,
              self._no_floor if floor is None else _array(floor), self.words, self._out_np, self.active, self.gate,
              self.flagged_top)
        return self._out


def _array(t: torch.Tensor) -> np.ndarray:
    """A float32, C-contiguous view (a copy only when the tensor is not one already)."""
    if t.dtype != torch.float32 or not t.is_contiguous():
        t = t.float().contiguous()
    return t.numpy()


def warm_up() -> None:
    """Compile the kernel (or load it from numba's disk cache) now, not on the first request with a head."""
    f32 = lambda *shape: np.zeros(shape, np.float32)  # noqa: E731
    _call(f32(0, 1), f32(0, 1), f32(1, 1), f32(1), f32(1, 1), f32(1), True, 1, f32(0, SETTINGS), f32(0),
          np.zeros(0, np.bool_), f32(0, 1), np.ones(0, np.bool_), f32(0), np.zeros(0, np.bool_))


_compiled = None


def _kernel():
    global _compiled
    if _compiled is None:
        from numba import njit

        # reassociation lets the dot products use vector instructions; infinities and NaN keep their meaning
        _compiled = njit(cache=True, nogil=True, fastmath={"reassoc", "contract", "nsz"})(_tilt_rows)
    return _compiled


def _call(*args) -> None:
    """Run the kernel. A disk cache numba cannot load (one written when this module had another name, as before
    Lethe's packages were `lethe.*`: its pickled environment names a module that no longer exists) is dropped
    and the kernel compiled afresh, rather than failing every request with a head."""
    global _compiled
    try:
        (_compiled or _kernel())(*args)
    except (ImportError, AttributeError, EOFError, pickle.UnpicklingError) as e:
        log.warning("numba's cached T3 kernel could not be loaded (%s: %s): compiling it again", type(e).__name__, e)
        _kernel()._cache.flush()
        _compiled = None
        _kernel()(*args)


def _tilt_rows(logits, pooled, down, bias, up, up_bias, probe, k, settings, gate_floor, words, out, active_out,
               gate_out, flagged_top_out):  # pragma: no cover
    B, V = logits.shape
    R, d = down.shape
    r = R - 1 if probe else R
    vals = np.empty(k, np.float32)
    ids = np.empty(k, np.int64)
    z = np.empty(k, np.float32)
    scores = np.empty(k, np.float32)
    h = np.empty(R, np.float32)
    for b in range(B):
        # down projection and (negated) probe: h = down @ pooled + bias
        for c in range(R):
            acc = np.float32(0.0)
            for j in range(d):
                acc += down[c, j] * pooled[b, j]
            h[c] = acc + bias[c]
        kb = int(settings[b, 0])
        g = 1.0
        head_gate = 0.0
        if probe and settings[b, 3] > 0:
            g = 1.0 / (1.0 + math.exp(-h[r]))  # P(forget | context)
            if gate_floor[b] > g:  # a sticky gate's floor: the highest its answer had
                g = float(gate_floor[b])
            head_gate = settings[b, 6]
        if head_gate > 0 and g < 1.0:  # the gate opens where the head flags the base model's likeliest token
            top, best = 0, logits[b, 0]
            for v in range(1, V):
                if logits[b, v] > best:
                    best = logits[b, v]
                    top = v
            zt = up_bias[top]
            for c in range(r):
                zt += up[top, c] * h[c]
            if zt < -head_gate:
                g = 1.0
        active = g > 0.5
        active_out[b] = active
        gate_out[b] = g
        flagged_top_out[b] = False
        if not active:  # the gate keeps this row out: its base logits, untouched
            for v in range(V):
                out[b, v] = logits[b, v]
            continue
        # the k likeliest tokens, best first (insertion into a sorted buffer; ties keep the lower id first)
        n = 0
        for v in range(V):
            x = logits[b, v]
            if n < k:
                i = n
                n += 1
            elif x > vals[k - 1]:
                i = k - 1
            else:
                continue
            while i > 0 and vals[i - 1] < x:
                vals[i] = vals[i - 1]
                ids[i] = ids[i - 1]
                i -= 1
            vals[i] = x
            ids[i] = v
        temp = 1.0 + (settings[b, 1] - 1.0) * g
        lam = settings[b, 2] * g
        floor = vals[0] + settings[b, 5]
        for i in range(kb):
            zi = up_bias[ids[i]]
            for c in range(r):
                zi += up[ids[i], c] * h[c]
            z[i] = zi
            log_sig = -math.log1p(math.exp(-zi)) if zi >= 0 else zi - math.log1p(math.exp(zi))
            scores[i] = vals[i] / temp + lam * log_sig if vals[i] >= floor else -np.inf
        if settings[b, 7] > 0:  # tilt only where the flagged candidates are likely enough under the base model
            flagged = 0.0
            broken = False  # a head whose logits are not numbers is tilted, so the row fails instead of passing
            for i in range(kb):
                if z[i] < 0 and scores[i] > -np.inf:
                    flagged += math.exp(vals[i] - vals[0])
                elif z[i] != z[i]:
                    broken = True
            # the softmax's denominator (relative to the best token) lies between the n likeliest tokens' sum and
            # that sum plus every other token at the n-th's value: where both bounds give one verdict, no pass over
            # the vocabulary (a forget-like step's flagged fact holds nearly all of it, a retain step nearly none)
            top_sum = 0.0
            for i in range(n):
                top_sum += math.exp(vals[i] - vals[0])
            low = flagged / (top_sum + (V - n) * math.exp(vals[n - 1] - vals[0]))
            total = top_sum
            if flagged / top_sum >= settings[b, 7] and low < settings[b, 7]:
                total = 0.0
                for v in range(V):
                    total += math.exp(logits[b, v] - vals[0])
            if not broken and not flagged / total >= settings[b, 7]:  # not this step: the base logits
                for v in range(V):
                    out[b, v] = logits[b, v]
                continue
        flagged_top_out[b] = z[0] < 0
        # the word guard: the head flags the likeliest token, which starts a word; candidates that would continue the
        # current word instead are dropped, where an unflagged candidate is left for the cap to hold the flagged under
        if settings[b, 8] > 0 and z[0] < 0 and not words[ids[0]]:
            free_left = False
            for i in range(1, kb):
                if not words[ids[i]] and not z[i] < 0 and scores[i] > -np.inf:
                    free_left = True
            if free_left:
                for i in range(1, kb):
                    if words[ids[i]]:
                        scores[i] = -np.inf
        best_free = -np.inf
        for i in range(kb):
            if not z[i] < 0 and scores[i] > best_free:
                best_free = scores[i]
        for v in range(V):
            out[b, v] = -np.inf
        cap = settings[b, 4]
        capped = not math.isnan(cap) and best_free > -np.inf
        limit = best_free - cap
        push = settings[b, 9]
        for i in range(kb):
            s = scores[i]
            if capped and z[i] < 0:
                if s > limit:
                    s = limit
                if push < np.inf and s > -np.inf:  # the push limit (heads.t3.tilt.limit_push)
                    floor_i = min(vals[i] / temp, limit) - push  # no lower than push below min(untilted, limit)
                    if s < floor_i:
                        s = floor_i
            out[b, ids[i]] = s
