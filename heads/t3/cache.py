"""One forward pass of the frozen model over the forget and retain records.

For every completion position t of every record it keeps the pooled state (the
running mean of the final hidden states over positions 0..t, prompt included, or
over the last `window` of them: `heads.t3.pooling`),
the true next token and the label (retain = 1, forget = 0). Pooled states are
stored in float16; when they would exceed `memory_budget` bytes they go to a
memory-mapped file on disk instead. Training then never runs the base model again.
The pass may run the model's matrix products in bfloat16 (`cache_autocast`): on a CPU that
computes it natively, about twice float32's speed, the states within a few tenths of a percent.
Records that begin alike (the chat template's system prompt, the same context
before the question) run their shared first tokens once, and records with the
same prompt (a record and its fact alone as the answer) run it once in one row.
On decoders that read the positions given, many such prefixes run in one forward
and rows after different prefixes share a batch (few forwards, each larger).
"""

from __future__ import annotations

import contextlib
import copy
import platform
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm
from transformers import DynamicCache

from lethe.heads.decoding.decode import additive_mask, forward_last_hidden, right_padded
from lethe.heads.records import Example, encode_examples
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

    def bounds(self) -> np.ndarray:
        """(records + 1,): record i's positions are bounds[i]:bounds[i + 1] (positions are in record order)."""
        return np.searchsorted(self.record.numpy(), np.arange(self.n_forget + self.n_retain + 1))

    def rows(self, index: torch.Tensor) -> torch.Tensor:
        """Pooled states of some positions as a float32 tensor."""
        if isinstance(self.pooled, torch.Tensor):
            return self.pooled[index].float()
        return torch.from_numpy(np.asarray(self.pooled[index.numpy()])).float()


def shared_prefix(sequences: list[list[int]], limit: int) -> int:
    """How many first tokens all `sequences` share, at most `limit`."""
    n, first = limit, sequences[0]
    for seq in sequences[1:]:
        n = min(n, len(seq))
        k = 0
        while k < n and seq[k] == first[k]:
            k += 1
        n = k
    return n


MIN_SAVED = 64  # tokens a group must save to run its prefix apart: below that, copying its cache costs more
MAX_PACKED = 4  # examples with the same prompt that share one row (the prompt once, then each one's answer)
CHUNK_EXAMPLES = 128  # examples of groups whose prefixes run together (one forward), where the model allows it
CHUNK_PREFIX_TOKENS = 4096  # and at most this many prefix tokens, padding included, in that forward
CHUNK_SPREAD = 2  # and a chunk's longest prefix at most this many times its shortest (plus CHUNK_SLACK tokens): rows
CHUNK_SLACK = 16  # after a short prefix carry the chunk's longest as masked keys


def units(idx: list[int], encoded: list[tuple[list[int], int]], pack: bool = True) -> list[list[int]]:
    """`idx` as units of up to MAX_PACKED examples with the same prompt (a record and its fact alone as the answer
    ask the same question), which run their prompt once; one example per unit where `pack` is off."""
    if not pack:
        return [[i] for i in idx]
    by_prompt: dict[tuple[int, ...], list[int]] = {}
    for i in idx:
        ids, n_prompt = encoded[i]
        by_prompt.setdefault(tuple(ids[:n_prompt]), []).append(i)
    return [same[k:k + MAX_PACKED] for same in by_prompt.values() for k in range(0, len(same), MAX_PACKED)]


@dataclass
class Chunk:
    """Shared prefixes (token ids; none: rows that share nothing) that run together in one forward, and the batches
    that follow them: each a list of rows, a row a (unit, its prefix's index in `prefixes`, -1 for none) pair."""

    prefixes: list[list[int]]
    batches: list[list[tuple[list[int], int]]]


def batches(encoded: list[tuple[list[int], int]], groups: list | None, batch_size: int, pack: bool = True,
            mix: bool = False) -> list[Chunk]:
    """The cache pass's plan: chunks of batches of units (`units`: examples with the same prompt, one row), up to
    `batch_size` examples a batch. Records of one group (the same context before their question, or the same chat
    template's system prompt) share their first tokens, which then run once for the whole group where that saves
    at least MIN_SAVED tokens; units of similar lengths share a batch, so little is padding. With `mix`, groups of
    prefixes of similar lengths make one chunk (up to CHUNK_EXAMPLES examples and CHUNK_PREFIX_TOKENS prefix
    tokens, the longest prefix at most CHUNK_SPREAD times the shortest plus CHUNK_SLACK): their prefixes run in one
    forward and their rows share batches (fewer forwards, each larger: a small one costs more a token); otherwise
    each group is a chunk of its own."""
    members: dict = {}
    for i, g in enumerate(groups if groups is not None else [None] * len(encoded)):
        members.setdefault(g, []).append(i)

    def planned(rows: list[tuple[list[int], int]], prefixes: list[list[int]]) -> Chunk:
        def width(row: tuple[list[int], int]) -> int:  # the row's own tokens: its prompt after the prefix, answers
            unit, p = row
            return encoded[unit[0]][1] - (len(prefixes[p]) if p >= 0 else 0) + sum(
                len(encoded[i][0]) - encoded[i][1] for i in unit)
        out: list[list[tuple[list[int], int]]] = [[]]
        for row in sorted(rows, key=width):  # at most `batch_size` examples a batch (each gets its own states)
            if out[-1] and sum(len(u) for u, _ in out[-1]) + len(row[0]) > batch_size:
                out.append([])
            out[-1].append(row)
        return Chunk(prefixes, [batch for batch in out if batch])

    shared_groups, rest = [], members.pop(None, [])
    for idx in members.values():
        # at least one prompt token stays each record's own
        shared = shared_prefix([encoded[i][0] for i in idx], min(encoded[i][1] for i in idx) - 1)
        if shared * (len(idx) - 1) < MIN_SAVED:
            rest += idx
        else:
            shared_groups.append((encoded[idx[0]][0][:shared], idx))
    plan: list[Chunk] = []
    together: list[tuple[list[int], list[int]]] = []

    def flush() -> None:
        if together:
            prefixes = [prefix for prefix, _ in together]
            plan.append(planned([(u, p) for p, (_, idx) in enumerate(together) for u in units(idx, encoded, pack)],
                                prefixes))
            together.clear()

    for prefix, idx in sorted(shared_groups, key=lambda g: len(g[0])) if mix else shared_groups:
        if together and not (mix and sum(len(i) for _, i in together) + len(idx) <= CHUNK_EXAMPLES and
                             (len(together) + 1) * len(prefix) <= CHUNK_PREFIX_TOKENS and
                             len(prefix) <= CHUNK_SPREAD * len(together[0][0]) + CHUNK_SLACK):
            flush()
        together.append((prefix, idx))
    flush()
    if rest:
        plan.append(planned([(u, -1) for u in units(rest, encoded, pack)], []))
    return plan


# decoders whose layers all attend with rotary positions read from the position ids given: a custom mask and positions
# that restart after the prompt give each packed answer the states it gets alone (not ALiBi, not a recurrent state)
PACKING_MODELS = frozenset({"llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "phi3",
                            "gemma", "granite", "olmo", "olmo2", "stablelm", "smollm3"})


def packs(model) -> bool:
    """Whether examples with the same prompt may share a row, and rows after prefixes of several lengths a batch: a
    decoder of PACKING_MODELS on sdpa or eager attention whose every layer attends to the whole context
    (transformers passes a custom mask to every layer as it is, which would lose a sliding window)."""
    config = model.config
    return config.model_type in PACKING_MODELS and getattr(config, "sliding_window", None) is None and \
        set(getattr(config, "layer_types", None) or ["full_attention"]) == {"full_attention"} and \
        getattr(config, "_attn_implementation", None) in ("sdpa", "eager")


@dataclass
class Prefixes:
    """A chunk's shared prefixes after one forward: their KV cache (G rows, right-padded to the longest), their
    final hidden states (G, P, d) and lengths."""

    cache: DynamicCache
    hidden: torch.Tensor
    lengths: list[int]

    @classmethod
    def run(cls, model, prefixes: list[list[int]], pad: int, device) -> "Prefixes":
        ids, mask = right_padded(prefixes, pad)
        cache = DynamicCache(config=model.config)
        positions = torch.arange(ids.size(1)).expand_as(ids)
        hidden = forward_last_hidden(model, ids.to(device), mask.to(device), positions.to(device), cache).float()
        return cls(cache, hidden, mask.sum(-1).tolist())

    def rows(self, which: list[int]) -> DynamicCache:
        """A cache with one row per entry of `which` (prefix indices): the layers are copied, not their tensors,
        and selecting rows gives each copy tensors of its own (a forward extends those, not the chunk's)."""
        cache = copy.copy(self.cache)
        cache.layers = [copy.copy(layer) for layer in self.cache.layers]
        cache.batch_select_indices(torch.tensor(which))  # a CPU index reads tensors on any device
        return cache


def _states(model, batch: list[tuple[list[int], int]], encoded: list[tuple[list[int], int]],
            prefixes: Prefixes | None, pad: int, device) -> torch.Tensor:
    """The final hidden states (E, L, d) of the examples of `batch`'s rows (unit, prefix index), in order, each over
    its whole sequence from its first token (right-padded to L), each row after its prefix in `prefixes` (None: no
    row has one). A unit's row holds its prompt once (after the prefix), then each example's answer; a mask lets an
    answer's tokens see the prefix, the prompt and the answer's own earlier tokens only, and each token's position
    follows the tokens it sees, so each example gets the states it would get alone."""
    lengths = [0 if prefixes is None else prefixes.lengths[p] for _, p in batch]
    rows, spans = [], []  # per example: (row, own prompt tokens, where its answer starts in the row, its length)
    for (unit, _), before in zip(batch, lengths):
        ids, n_prompt = encoded[unit[0]]
        row = list(ids[before:n_prompt])
        for i in unit:
            seq, own = encoded[i]
            spans.append((len(rows), n_prompt - before, len(row), len(seq) - own))
            row += seq[own:]
        rows.append(row)
    ids, own_mask = right_padded(rows, pad)
    width, start = ids.size(1), 0 if prefixes is None else prefixes.hidden.size(1)
    prefix_length = torch.tensor(lengths)
    sees_prefix = torch.arange(start)[None, :] < prefix_length[:, None]  # (R, start): each row sees its prefix only
    if all(len(unit) == 1 for unit, _ in batch):  # one example a row: the model's own causal and padding mask
        positions = prefix_length[:, None] + torch.arange(width)
        mask = torch.cat([sees_prefix.long(), own_mask], 1)
    else:
        part = torch.full((len(rows), width), -1)  # -1 padding, 0 the prompt, k the row's k-th answer
        positions = torch.zeros((len(rows), width), dtype=torch.long)
        for k, (r, q, begin, n) in enumerate(spans):
            part[r, :q], part[r, begin:begin + n] = 0, k + 1
            positions[r, :q] = torch.arange(lengths[r], lengths[r] + q)
            positions[r, begin:begin + n] = torch.arange(lengths[r] + q, lengths[r] + q + n)
        t = torch.arange(width)
        sees = (t[:, None] >= t[None, :]) & (part[:, None, :] >= 0) & \
            ((part[:, None, :] == 0) | (part[:, None, :] == part[:, :, None]))  # (R, query, key)
        sees = torch.cat([sees_prefix[:, None, :].expand(-1, width, -1), sees], -1)
        # the compute dtype (a first parameter may be kept in float32); under a bfloat16 autocast sdpa casts it, the
        # lowest float32 becoming -inf: harmless, as no query is all masked (each sees itself; padding, the prompt)
        mask = additive_mask(sees, model.dtype)
    cache = None if prefixes is None else prefixes.rows([p for _, p in batch])
    hidden = forward_last_hidden(model, ids.to(device), mask.to(device), positions.to(device), cache).float()
    out = hidden.new_zeros((len(spans), max(lengths[r] + q + n for r, q, _, n in spans), hidden.size(-1)))
    for e, (r, q, begin, n) in enumerate(spans):  # right padding: zeros past each example's own length
        p = lengths[r]
        if p:
            out[e, :p] = prefixes.hidden[batch[r][1], :p]
        out[e, p:p + q] = hidden[r, :q]
        out[e, p + q:p + q + n] = hidden[r, begin:begin + n]
    return out


@torch.inference_mode()
def build_cache(model, tokenizer, forget: list[Example], retain: list[Example], batch_size: int = 32,
                memory_budget: int = 2 << 30, spill_dir: Path | None = None, progress: bool = True,
                on_progress=None, window: int = 0, groups: list | None = None,
                autocast: torch.dtype | None = None) -> PooledCache:
    """`on_progress(fraction)` is called after every batch (it may raise to stop the pass). `groups`: per example
    (forget, then retain), a key; examples with the same key run their common first tokens once (None: no
    sharing). `autocast`: the dtype the model's matrix products run in (`cache_autocast`; None: the model's own)."""
    device = next(model.parameters()).device
    encoded = encode_examples(tokenizer, forget + retain)
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
    starts = np.concatenate([[0], np.cumsum(counts)])
    pad, done, mix = tokenizer.pad_token_id or 0, 0, packs(model)
    plan = batches(encoded, groups, batch_size, mix, mix)
    bar = tqdm(total=sum(len(chunk.batches) for chunk in plan), desc="caching", disable=not progress, leave=False)
    precision = torch.autocast(device.type, dtype=autocast) if autocast else contextlib.nullcontext()
    for chunk in plan:
        prefixes = None  # the last chunk's caches go before this chunk's prefixes run
        if chunk.prefixes:  # a chunk's prefixes run once, together
            with precision:
                prefixes = Prefixes.run(model, chunk.prefixes, pad, device)
        for batch in chunk.batches:
            with precision:
                hidden = _states(model, batch, encoded, prefixes, pad, device)
            pooled_all = pooled_positions(hidden, window)  # right padding: each example's positions are its own first
            idx = [i for unit, _ in batch for i in unit]
            for r, i in enumerate(idx):
                seq, n_prompt = encoded[i]
                lo, hi = starts[i], starts[i + 1]
                rows = pooled_all[r, n_prompt - 1:len(seq) - 1].to(torch.float16).cpu()
                pooled[lo:hi] = rows if isinstance(pooled, torch.Tensor) else rows.numpy()
                target[lo:hi] = torch.tensor(seq[n_prompt:])
                label[lo:hi] = labels[i]
                record[lo:hi] = i
            done += len(idx)
            bar.update()
            if on_progress is not None:
                on_progress(min(1.0, done / len(encoded)))
    bar.close()
    if isinstance(pooled, np.memmap):
        pooled.flush()
    return PooledCache(pooled, target, label, record, len(forget), len(retain))


CACHE_PRECISIONS = ("auto", "model")


def cache_autocast(model, precision: str = "auto") -> torch.dtype | None:
    """The dtype `build_cache` runs the model's matrix products in (torch.autocast), None for the model's own.
    "auto": bfloat16 for a float32 model on a CPU that computes bfloat16 natively (`native_bfloat16`), where it is
    about twice as fast and the cached states stay within a few tenths of a percent of float32's
    (docs/forgetting-in-context.md, "The cache pass in bfloat16"); the model's own elsewhere (a GPU model keeps its
    dtype). "model": always the model's own."""
    if precision not in CACHE_PRECISIONS:
        raise ValueError(f"cache_precision: {precision!r} is not one of {', '.join(CACHE_PRECISIONS)}")
    on_cpu = next(model.parameters()).device.type == "cpu"
    if precision == "auto" and on_cpu and model.dtype == torch.float32 and native_bfloat16():
        return torch.bfloat16
    return None


def native_bfloat16() -> bool:
    """Whether this CPU computes bfloat16 products in hardware: AVX512-BF16 or AMX on x86 (oneDNN's own check also
    passes plain AVX512, where bfloat16 is emulated and slower than float32); oneDNN's check elsewhere (Arm)."""
    if platform.machine().lower() in ("x86_64", "amd64", "i386", "i686"):
        return torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()
    return torch.ops.mkldnn._is_mkldnn_bf16_supported()


MAX_SHIFTS = 1 << 16  # rows of context shifts kept (float16: 2^16 x d x 2 bytes, 75 MB at d = 576)


@dataclass
class ContextShifts:
    shifts: torch.Tensor  # (M, d) float16: how contexts moved pooled states
    rows: torch.Tensor  # (N,) bool: the cache's positions they may be added to (question/answer examples')


def context_shifts(cache: PooledCache, pairs: list[tuple[int, int]], seed: int = 0) -> ContextShifts:
    """How a context moved the pooled state, at each answer position of each (example after a context, the same
    record's plain example) pair in `pairs` (example indices, forget side first): the two answers are the same
    tokens, so position t of one faces position t of the other. Pairs whose answers tokenised to different lengths
    are left out; at most MAX_SHIFTS rows, drawn at random. The positions of the examples in `pairs` may take
    them: other examples (a fact alone as the answer, in another form) are not rows the shifts were measured on."""
    bounds = cache.bounds()
    faced = [(torch.arange(a0, a1), torch.arange(p0, p1)) for (a0, a1), (p0, p1)
             in ((bounds[a:a + 2], bounds[p:p + 2]) for a, p in pairs) if a1 - a0 == p1 - p0 and a1 > a0]
    after = torch.cat([a for a, _ in faced]) if faced else torch.empty(0, dtype=torch.long)
    plain = torch.cat([p for _, p in faced]) if faced else torch.empty(0, dtype=torch.long)
    if len(after) > MAX_SHIFTS:  # drawn before any state is read, so memory stays within MAX_SHIFTS rows
        keep = torch.randperm(len(after), generator=torch.Generator().manual_seed(seed))[:MAX_SHIFTS]
        after, plain = after[keep], plain[keep]
    out = cache.rows(after) - cache.rows(plain)
    asked = torch.zeros(cache.n_forget + cache.n_retain, dtype=torch.bool)
    asked[[i for pair in pairs for i in pair]] = True
    return ContextShifts(out.to(torch.float16), asked[cache.record])
