"""Batched decoding with the KV cache, in a few plain steps.

`prefill` runs the left-padded prompts once; `decode_one_token` feeds one token
per row; `Batch` keeps the per-row state between steps (cache, positions, the
last layer's hidden states pooled as each row's head reads them (`heads.t3.pooling`),
stop strings, finish reasons).
A `Guide` (a T3 head, say) may rewrite each step's logits from the pooled state;
rows without one are decoded from the model alone.

Only the decoder's last hidden state is read, and only the last position goes
through the LM head: no step materialises every layer's states or every
position's logits.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Protocol

import torch
from transformers import DynamicCache

from lethe.heads.decoding.logprobs import TokenLogprob, prompt_logprobs, token_logprobs
from lethe.heads.io import crash_after_tokens, crash_point
from lethe.heads.decoding.repeats import AnswerNgrams, ban_repeats, numpy_view, word_classes
from lethe.heads.decoding.sampling import SamplingParams, make_generator, penalize, sample
from lethe.heads.t3.guide import MAX_LOOKAHEAD, on_adapter, whole_vocabulary
from lethe.heads.t3.tilt import keep_whole_words, word_ends
from lethe.heads.t3.pooling import Pool


class Guide(Protocol):
    """Rewrites a batch's next-token logits, given each row's pooled hidden state.

    The result may live in a buffer the guide reuses: it is valid until the guide's next call. A guide may
    also have `repeat_guards()`: per row, after a call, the n of a word n-gram repeat guard (0: none), which the
    loop applies (`heads.decoding.repeats`)."""

    def __call__(self, logits: torch.Tensor, pooled: torch.Tensor) -> torch.Tensor: ...


@dataclass
class Completion:
    text: str
    token_ids: list[int]
    finish_reason: str  # "stop" (EOS or a stop string) or "length"
    prompt_tokens: int
    # with SamplingParams.logprobs / prompt_logprobs (`heads.decoding.logprobs`): one entry per token of
    # `token_ids`, and one more for the end-of-text token when the answer ended with it / one per token of
    # `prompt_ids` (the prompt's first is None); `untilted_*`: the base model's, when asked
    logprobs: list[TokenLogprob] | None = None
    untilted_logprobs: list[TokenLogprob] | None = None
    prompt_ids: list[int] | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None
    untilted_prompt_logprobs: list[TokenLogprob | None] | None = None
    adapter: str | None = None  # the ASU adapter it decoded with (None: the base weights)

    @property
    def completion_tokens(self) -> int:
        return len(self.token_ids)


def eos_ids(model, tokenizer) -> set[int]:
    ids = set()
    for source in (getattr(model, "generation_config", None), model.config, tokenizer):
        value = getattr(source, "eos_token_id", None)
        ids.update(value if isinstance(value, (list, tuple)) else [value] if value is not None else [])
    return ids


def forward_last_hidden(model, input_ids, attention_mask, position_ids, cache) -> torch.Tensor:
    """The decoder's final (normed) hidden states, (B, L, d); the cache is extended in place."""
    out = model.get_decoder()(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                              cache=cache, use_cache=cache is not None)
    return out.last_hidden_state


def additive_mask(sees: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A (B, query, key) bool mask of which keys each query sees as the (B, 1, query, key) additive mask a decoder
    takes as given (0 where it sees, the dtype's lowest value elsewhere)."""
    return torch.zeros(sees.shape, dtype=dtype, device=sees.device).masked_fill_(~sees, torch.finfo(dtype).min)[:, None]


def next_logits(model, hidden_last: torch.Tensor) -> torch.Tensor:
    """LM-head logits for one position per row: (B, d) -> (B, V), float32."""
    return model.get_output_embeddings()(hidden_last).float()


def prefill(model, input_ids, attention_mask, cache):
    """Run the prompts; return (last-position hidden (B, d), every position's hidden (B, L, d))."""
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    hidden = forward_last_hidden(model, input_ids, attention_mask, position_ids, cache)
    return hidden[:, -1], hidden


def left_padded(prompts: list[list[int]], pad: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-id prompts as one left-padded (B, L) batch and its attention mask."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        if p:
            ids[i, width - len(p):] = torch.tensor(p, dtype=torch.long)
            mask[i, width - len(p):] = 1
    return ids.to(device), mask.to(device)


def right_padded(rows: list[list[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-id rows as one right-padded (B, L) batch and its attention mask (on the CPU): each row's positions are
    0..len-1, as scoring and training read them."""
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for r, seq in enumerate(rows):
        ids[r, :len(seq)] = torch.tensor(seq)
        mask[r, :len(seq)] = 1
    return ids, mask


def decode_one_token(model, tokens, attention_mask, positions, cache) -> torch.Tensor:
    """Feed one token per row at its own position; return its hidden state (B, d)."""
    return forward_last_hidden(model, tokens[:, None], attention_mask, positions[:, None], cache)[:, 0]


LOOKAHEAD_BYTES = 256 << 20  # the most the whole-words lookahead copies of rows' caches at once
WHOLE_WORD = 0.5  # a start whose word the base model ends at the next token with at least this probability


class TorchRows:
    """The model side of a batch on a transformers model: the KV cache, attention mask and positions of the rows,
    and their last hidden states (the next-token logits come from these). Built by prefilling the prompts;
    `prompt_hidden` (per row, its prompt's final hidden states (L_i, d)) and `prompt_logits` are the prefill's
    results: per row whose prompt is scored, (a function from a slice of its prompt's positions to their logits,
    its prompt's hidden states), else None. Run under the batch's adapters (`Batch._adapters`).
    The llama.cpp backend's counterpart is `heads.decoding.llamacpp.LlamaRows`."""

    def __init__(self, model, prompts: list[list[int]], keep_prompt_logits: list[bool], pad: int):
        self.model = model
        input_ids, self.attention_mask = left_padded(prompts, pad, next(model.parameters()).device)
        self.cache = DynamicCache(config=model.config)
        self.last_hidden, hidden = prefill(model, input_ids, self.attention_mask, self.cache)
        self.positions = self.attention_mask.sum(1) - 1
        lm_head, width = model.get_output_embeddings(), hidden.size(1)
        self.prompt_hidden = [hidden[i, width - len(p):] for i, p in enumerate(prompts)]
        self.prompt_logits = [  # per row: (its logits at a span of its prompt, its prompt's hidden states)
            ((lambda span, h=h: lm_head(h[span]).float()), h) if keep else None
            for h, keep in zip(self.prompt_hidden, keep_prompt_logits)]

    def logits(self) -> torch.Tensor:
        return next_logits(self.model, self.last_hidden)

    def feed(self, tokens: torch.Tensor) -> torch.Tensor:
        self.attention_mask = torch.cat([self.attention_mask, torch.ones_like(self.attention_mask[:, :1])], 1)
        self.positions = self.positions + 1
        self.last_hidden = decode_one_token(self.model, tokens, self.attention_mask, self.positions, self.cache)
        return self.last_hidden

    def row_bytes(self) -> int:
        """The size of one row's cache (what a lookahead copies per row it looks at, or per token where it does not
        feed them side by side)."""
        return sum((layer.keys[:1].numel() + layer.values[:1].numel()) * layer.keys.element_size()
                   for layer in self.cache.layers if getattr(layer, "keys", None) is not None)

    def peek(self, rows: list[int], tokens: torch.Tensor) -> torch.Tensor | None:
        """(n, V) next-token logits after each of `tokens` (n,) fed to its row of `rows` alone, the batch's cache left
        as it was (a lookahead: `heads.t3.tilt.keep_whole_words`); None where the cache is not a plain growing one.
        Each distinct row's cache is copied once and all its tokens go in one pass side by side, at the same
        position, each seeing the row's past and itself only (a custom mask, on models that take one:
        `heads.t3.cache.packs`); elsewhere each token gets a copy of its row's cache."""
        if not self.can_merge():
            return None
        if not self.side_by_side():
            return self._peek_rows(rows, tokens)
        device = self.attention_mask.device
        distinct: dict[int, int] = {}  # row -> its place in the pass
        which, slot, taken = [], [], []  # per token: its row's place, and its own place among the row's tokens
        for r in rows:
            if r not in distinct:
                distinct[r] = len(distinct)
                taken.append(0)
            which.append(distinct[r])
            slot.append(taken[distinct[r]])
            taken[distinct[r]] += 1
        width = max(taken)
        which, slot = torch.tensor(which, device=device), torch.tensor(slot, device=device)
        ids = tokens.new_zeros((len(distinct), width))  # unused places: token 0, seen by nothing else
        ids[which, slot] = tokens
        idx = torch.tensor(list(distinct), device=device)
        sees = torch.cat([self.attention_mask[idx].bool()[:, None].expand(-1, width, -1),
                          torch.eye(width, dtype=torch.bool, device=device).expand(len(distinct), -1, -1)], -1)
        positions = (self.positions[idx] + 1)[:, None].expand(-1, width)
        hidden = forward_last_hidden(self.model, ids, additive_mask(sees, self.model.dtype), positions,
                                     self._copy_rows(idx))
        return next_logits(self.model, hidden[which, slot])

    def side_by_side(self) -> bool:
        """Whether `peek` feeds a row's tokens side by side on one copy of its cache (the model takes a custom
        mask: `heads.t3.cache.packs`)."""
        from lethe.heads.t3.cache import packs

        return packs(self.model)

    def _peek_rows(self, rows: list[int], tokens: torch.Tensor) -> torch.Tensor:
        """`peek` with one copy of its row's cache per token, each fed as a row of its own."""
        idx = torch.tensor(rows, device=self.attention_mask.device)
        mask = self.attention_mask[idx]
        mask = torch.cat([mask, mask.new_ones(len(rows), 1)], 1)
        return next_logits(self.model, decode_one_token(self.model, tokens, mask, self.positions[idx] + 1,
                                                        self._copy_rows(idx)))

    def _copy_rows(self, idx: torch.Tensor) -> DynamicCache:
        """A cache holding a copy of rows `idx` of the batch's."""
        cache = DynamicCache(config=self.model.config)
        for i, layer in enumerate(self.cache.layers):
            cache.update(layer.keys[idx], layer.values[idx], i)
        return cache

    def can_merge(self) -> bool:
        """Whether rows can join: every cache layer is a plain growing one."""
        from transformers.cache_utils import DynamicLayer

        return all(type(layer) is DynamicLayer for layer in self.cache.layers)

    def merge(self, other: "TorchRows") -> None:
        """Add `other`'s rows; both caches are left-padded to one length."""
        width = max(self.attention_mask.size(1), other.attention_mask.size(1))

        def left_pad(t: torch.Tensor, dim: int) -> torch.Tensor:
            missing = width - t.size(dim)
            if missing == 0:
                return t
            shape = list(t.shape)
            shape[dim] = missing
            return torch.cat([t.new_zeros(shape), t], dim=dim)

        for mine, theirs in zip(self.cache.layers, other.cache.layers):
            mine.keys = torch.cat([left_pad(mine.keys, 2), left_pad(theirs.keys, 2)])
            mine.values = torch.cat([left_pad(mine.values, 2), left_pad(theirs.values, 2)])
        self.attention_mask = torch.cat([left_pad(self.attention_mask, 1), left_pad(other.attention_mask, 1)])
        self.positions = torch.cat([self.positions, other.positions])
        self.last_hidden = torch.cat([self.last_hidden, other.last_hidden])

    def keep(self, keep: list[int]) -> None:
        """Keep rows `keep` (and no padding they do not need)."""
        idx = torch.tensor(keep, device=self.attention_mask.device, dtype=torch.long)
        mask = self.attention_mask[idx]
        used = mask.any(0).nonzero()
        start = int(used[0]) if len(used) else 0
        for layer in self.cache.layers:
            layer.keys = layer.keys[idx, :, start:]
            layer.values = layer.values[idx, :, start:]
        self.attention_mask = mask[:, start:]
        self.positions, self.last_hidden = self.positions[idx], self.last_hidden[idx]

    def close(self) -> None:
        pass


@dataclass
class Row:
    params: SamplingParams
    prompt_tokens: int
    generator: torch.Generator
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    error: Exception | None = None  # why this row failed (finish_reason "error"); the other rows go on
    forced: list[int] | None = None  # a reply the guide chose for this row (abstention), decoded token by token
    prompt_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None  # when its params ask: one per token of token_ids (and the EOS)
    untilted_logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None
    untilted_prompt_logprobs: list[TokenLogprob | None] | None = None
    adapter: str | None = None  # the ASU adapter it decodes with (None: the base weights)
    repeat_guard: int = 0  # a row without a head (ASU alone): its own repeat guard's n (0: off)
    gate_on: bool | None = None  # a gated adapter's row: whether the gate acted on its next logits (None: no gate)
    gate_latched: bool = False  # its gate was on where the answer starts, so it stays on for the whole answer
    ngrams: AnswerNgrams | None = None  # the repeat guard's reading of the answer so far, kept across steps

    def completion(self) -> Completion:
        asked = self.params.prompt_logprobs is not None
        return Completion(self.text, self.token_ids, self.finish_reason or "length", self.prompt_tokens,
                          self.logprobs, self.untilted_logprobs, self.prompt_ids if asked else None,
                          self.prompt_logprobs, self.untilted_prompt_logprobs, self.adapter)


class Batch:
    """Requests that decode together. `step()` adds one token to every unfinished row."""

    def __init__(self, model, tokenizer, prompts: list[str | list[int]], params: list[SamplingParams],
                 guide: Guide | None = None, adapters: list[str] | None = None, guards: list[int] | None = None):
        """`prompts`: text, or token ids fed exactly as given. `adapters`: per row, the name of the ASU adapter
        to decode with (`__base__`: none). `guards`: per row, the n of a repeat guard of its own, for rows the
        guide does not guard (a profile of ASU weights alone; 0: none)."""
        if len(prompts) != len(params) or not prompts:
            raise ValueError("need one SamplingParams per prompt, and at least one prompt")
        self.model, self.tokenizer, self.guide, self.adapters = model, tokenizer, guide, adapters
        if hasattr(guide, "restart"):  # a guide an earlier batch used: its rows' gates are not these rows'
            guide.restart()
        self._hand_words()
        self.eos = eos_ids(model, tokenizer)
        llama = self._llama = hasattr(model, "start_rows")  # a `heads.decoding.llamacpp.LlamaCppModel`
        device = model.device if llama else next(model.parameters()).device
        encoded = [list(p) if not isinstance(p, str) else tokenizer(p, add_special_tokens=False)["input_ids"]
                   for p in prompts]
        if min(len(p) for p in encoded) == 0:  # no position to predict from
            raise ValueError("a prompt encodes to no tokens")
        self.rows = [Row(p, len(ids), make_generator(p.seed, device), prompt_ids=ids) for p, ids in zip(params, encoded)]
        self.temperature = torch.tensor([p.temperature for p in params], device=device, dtype=torch.float32)
        self.top_k = torch.tensor([p.top_k for p in params], device=device)
        self.top_p = torch.tensor([p.top_p for p in params], device=device, dtype=torch.float32)
        self.min_p = torch.tensor([p.min_p for p in params], device=device, dtype=torch.float32)
        scored = [p.prompt_logprobs is not None for p in params]
        if adapters is not None and guide is not None:
            self.adapters = adapters = self._routed(encoded, adapters)
        for row, name in zip(self.rows, adapters or []):
            row.adapter = None if name == "__base__" else name
        for row, n in zip(self.rows, guards or []):
            row.repeat_guard = n
        with torch.inference_mode(), self._adapters():
            self.runner = model.start_rows(encoded, scored, adapters) if llama else \
                TorchRows(model, encoded, scored, tokenizer.pad_token_id or 0)
            self.pool = Pool(self.runner.prompt_hidden, [self._window_of(i) for i in range(len(self.rows))])
            self._read_gates()
            self._score_prompts(self.runner.prompt_logits)
        for row in self.rows:  # a gate on at the prompt's last position (the answer's first token) stays on
            row.gate_latched = bool(row.gate_on)
        self.runner.prompt_logits = self.runner.prompt_hidden = None  # every prompt position's states: done with
        # per-row work a step does only when some row asks for it (nothing added to the others' steps)
        self._min_tokens = any(p.min_new_tokens for p in params)
        self._logging = any(p.logprobs is not None for p in params)
        self._crash_at = crash_after_tokens()
        self._joins_of: tuple[torch.Tensor, torch.Tensor] | None = None  # `_joins`
        for row in self.rows:
            if row.params.max_new_tokens == 0:  # the prompt alone: finished before its first step
                row.finish_reason = "length"
            if row.params.logprobs is not None:
                row.logprobs = []
                row.untilted_logprobs = [] if row.params.untilted_logprobs else None

    def _score_prompts(self, prompt_logits: list) -> None:
        """The prompt log-probabilities the rows ask for, from the prefill (`TorchRows.prompt_logits`)."""
        for i, row in enumerate(self.rows):
            if row.params.prompt_logprobs is None:
                continue
            ids = torch.tensor(row.prompt_ids, device=self.pool.sum.device)
            entry = self._head_of(i)
            guided = None if entry is None else (lambda logits, pooled, e=entry: whole_vocabulary(*e, logits, pooled))
            row.prompt_logprobs, row.untilted_prompt_logprobs = prompt_logprobs(
                *prompt_logits[i], ids, row.params.prompt_logprobs, guided, row.params.untilted_logprobs,
                self._window_of(i))

    def _routed(self, encoded: list[list[int]], adapters: list[str]) -> list[str]:
        """`adapters`, with the rows whose profile applies its ASU adapter only to forget-like prompts
        (`TiltSettings.adapter_above`) set to the base weights where the head's probe, reading the prompt's final
        states under the base weights, gives P(forget) at most that. Such a row then decodes exactly as the base
        model with the head would. The probe's pass is a prefill of those rows alone, thrown away after."""
        asks = [i for i, a in enumerate(adapters)
                if a != "__base__" and (e := self._head_of(i)) is not None and e[1].adapter_above > 0]
        if not asks:
            return adapters
        from lethe.heads.asu.weights import adapters as using

        prompts, base = [encoded[i] for i in asks], ["__base__"] * len(asks)
        with torch.inference_mode(), (nullcontext() if self._llama else using(self.model, base)):
            runner = self.model.start_rows(prompts, [False] * len(asks), base) if self._llama else \
                TorchRows(self.model, prompts, [False] * len(asks), self.tokenizer.pad_token_id or 0)
            try:
                pooled = Pool(runner.prompt_hidden, [self._window_of(i) for i in asks]).pooled()
            finally:
                runner.close()
            out = list(adapters)
            for j, i in enumerate(asks):
                if not on_adapter(*self._head_of(i), pooled[j:j + 1])[0]:
                    out[i] = "__base__"
        return out

    def _head_of(self, i: int):
        """Row i's (head, settings), when its guide has per-row heads (None: no head, or not known)."""
        row = getattr(self.guide, "row", None)
        return row(i) if row is not None else None

    def _window_of(self, i: int) -> int:
        """The window row i's head pools over (`heads.t3.pooling`; 0: the whole context, and rows without one)."""
        entry = self._head_of(i)
        return getattr(entry[0], "window", 0) if entry is not None else 0

    def _adapters(self, rows: list[int] | None = None):
        """The rows' adapters for a forward pass; `rows`: the batch's rows a pass feeds, in order (a lookahead feeds
        each of its items' rows, or each distinct row once: `_peek`; default: every row)."""
        if self.adapters is None or self._llama:  # no per-row adapters (the common case), or llama.cpp's rows,
            return nullcontext()  # which keep their own
        from lethe.heads.asu.weights import adapters

        rows = range(len(self.rows)) if rows is None else rows
        return adapters(self.model, [self.adapters[i] for i in rows], [self.rows[i].gate_latched for i in rows])

    @property
    def done(self) -> bool:
        return all(r.finish_reason is not None for r in self.rows)

    def pooled(self) -> torch.Tensor:
        """Each row's final hidden states pooled as its head reads them, prompt included: (B, d)."""
        return self.pool.pooled()

    @torch.inference_mode()
    def step(self) -> list[int | None]:
        """Choose and feed the next token of every unfinished row; returns it (None for finished rows).

        What is per row (the guide's head and settings, sampling, detokenising) fails per row: a row that
        raises there finishes with reason "error" and its exception in `Row.error`; the others go on."""
        logits = self.runner.logits()
        untilted = [i for i, r in enumerate(self.rows) if r.untilted_logprobs is not None and not r.finish_reason] \
            if self._logging else []
        base = logits[untilted] if untilted else None  # a copy: the guide may write into its buffers
        if self.guide is not None:
            logits = self._guided(logits)
        elif any(r.repeat_guard for r in self.rows):  # rows of ASU weights alone with a guard of their own
            logits = self._guard_repeats(logits.clone())
        logits = penalize(logits, [r.token_ids for r in self.rows], [r.params.presence_penalty for r in self.rows],
                          [r.params.frequency_penalty for r in self.rows])
        if self._min_tokens:
            logits = self._hold_eos(logits)
        failed: dict[int, Exception] = {}
        tokens = sample(logits, self.temperature, self.top_k, self.top_p, [r.generator for r in self.rows], failed,
                        self.min_p)
        for i, error in failed.items():
            self.fail(i, error)
        logged = self._logprobs(logits, tokens, untilted, base) if self._logging else {}
        emitted: list[int | None] = []
        for i, (row, token) in enumerate(zip(self.rows, tokens.tolist())):
            emitted.append(None if row.finish_reason else token)
            if row.finish_reason is None:
                try:
                    self._append(row, token, logged.get(i))
                except Exception as e:
                    self.fail(i, e)
        if not self.done:
            with self._adapters():
                hidden = self.runner.feed(tokens)
                self._read_gates()
            self.pool.push(hidden)
        return emitted

    def _read_gates(self) -> None:
        """After a forward pass: for rows of a gated ASU adapter, whether its gate acted on their next logits."""
        if self.adapters is not None and not self._llama:
            from lethe.heads.asu.gate import last_on

            for row, on in zip(self.rows, last_on(self.model, self.adapters)):
                row.gate_on = on

    def _hold_eos(self, logits: torch.Tensor) -> torch.Tensor:
        """Rows short of their min_new_tokens cannot choose the end-of-text token yet."""
        short = [i for i, r in enumerate(self.rows) if len(r.token_ids) < r.params.min_new_tokens]
        if short and self.eos:
            logits = logits.clone()
            logits[torch.tensor(short)[:, None], torch.tensor(sorted(self.eos))[None, :]] = float("-inf")
        return logits

    def _logprobs(self, scores: torch.Tensor, tokens: torch.Tensor, untilted: list[int],
                  base: torch.Tensor | None) -> dict[int, tuple[TokenLogprob, TokenLogprob | None]]:
        """For the rows that ask: each chosen token's log-probability under the scores it was drawn from, and
        (rows in `untilted`, whose base logits are `base`) under the base model's."""
        asking = [i for i, r in enumerate(self.rows) if r.logprobs is not None and not r.finish_reason]
        if not asking:
            return {}
        top = max(self.rows[i].params.logprobs for i in asking)
        index = torch.tensor(asking, device=scores.device)
        out = dict(zip(asking, ((e, None) for e in token_logprobs(scores[index], tokens[index], top))))
        if base is not None:
            for i, entry in zip(untilted, token_logprobs(base, tokens[torch.tensor(untilted, device=base.device)], top)):
                if i in out:
                    out[i] = (out[i][0], entry)
        for i, (entry, other) in out.items():
            for e in (entry, other):
                if e is not None:
                    e.top = e.top[: self.rows[i].params.logprobs]
        return out

    def _hand_words(self) -> None:
        """Give a guide whose rows guard words (`heads.t3.tilt.guard_words`) the tokenizer's tokens that continue a
        word (built once per tokenizer)."""
        if getattr(self.guide, "wants_words", lambda: False)():
            self.guide.use_words(word_classes(self.tokenizer).joins)

    def _guided(self, logits: torch.Tensor) -> torch.Tensor:
        """The guide's scores, with the repeat guard and forced replies it asks for. If the guide raises, each
        row's own head and settings are tried alone, the rows that fail are failed, and the guide goes on
        without them."""
        pooled = self.pooled()
        try:
            scores = self.guide(logits, pooled)
        except Exception:
            rows = getattr(self.guide, "rows", None)
            if not rows or getattr(self.guide, "same", None) is not None:
                raise  # not per-row: nothing to isolate
            from lethe.heads.t3.guide import HeadGuide

            rows = list(rows)
            for i, row in enumerate(rows):
                if row is not None:
                    try:
                        HeadGuide([row], self.guide.fused, words=self.guide.words)(logits[i:i + 1], pooled[i:i + 1])
                    except Exception as e:
                        self.fail(i, e)
                        rows[i] = None
            self.guide = self.guide.replaced(rows)
            scores = self.guide(logits, pooled)
        return self._force_replies(self._complete_words(self._guard_repeats(scores), logits, pooled), pooled)

    def _guard_repeats(self, scores: torch.Tensor) -> torch.Tensor:
        """Where the guide (or a row's own guard) asks for it, no word that repeats a word n-gram of the row's answer
        (in place). A row's own guard acts where its adapter acts: with a gated adapter, at the tokens its gate is
        on, so the rows the gate leaves alone decode as the base model does."""
        guards = getattr(self.guide, "repeat_guards", None)
        ns = list(guards()) if guards is not None else []
        ns = [(ns[i] if i < len(ns) else 0) or (row.repeat_guard if row.gate_on is not False else 0)
              for i, row in enumerate(self.rows)]
        if any(ns):
            classes, rows = word_classes(self.tokenizer), numpy_view(scores)
            for i, n in enumerate(ns):
                row = self.rows[i]
                if n and row.finish_reason is None:
                    if row.ngrams is None or row.ngrams.n != n:
                        row.ngrams = AnswerNgrams(classes, n)
                    ban_repeats(rows[i], row.token_ids, n, classes, row.ngrams)
        return scores

    def _complete_words(self, scores: torch.Tensor, logits: torch.Tensor, pooled: torch.Tensor) -> torch.Tensor:
        """Where the guide's scores turned away the base model's likeliest word, which the head flags
        (`TiltSettings.whole_words`), the unflagged word starts the base model would go on spelling are dropped
        (`heads.t3.tilt.keep_whole_words`). The lookahead (`peek`, on the rows' weights) reads each row's best
        MAX_LOOKAHEAD starts, every turned row in one pass. Rows with an ASU adapter or a forced reply keep their
        scores; a row whose lookahead raises fails alone. In place."""
        looks = getattr(self.guide, "looks_ahead", None)
        if looks is None or not looks():
            return scores
        flagged_tops = self.guide.flagged_tops()
        if not any(flagged_tops):
            return scores
        joins, goes_on = self._joins(scores.size(-1), scores.device)
        eligible = [r.finish_reason is None and r.adapter is None and not r.forced for r in self.rows]
        found = [t for t in self.guide.turned_words(logits, scores, pooled, joins, eligible, flagged_tops)
                 if len(t[1]) > 1]
        items = [(i, t) for i, starts, _, _ in found for t in starts[:MAX_LOOKAHEAD].tolist()]
        ends: dict[int, list[float]] = {i: [] for i, _, _, _ in found}
        for (i, _), ahead in zip(items, self._look_ahead(items)):
            if ahead is None:  # the runner cannot look ahead, or the row failed
                ends.pop(i, None)
            elif i in ends:
                ends[i].append(float(word_ends(ahead[None], goes_on[: ahead.size(-1)])[0]))
        for i, starts, flagged, cap in found:
            if i in ends and self.rows[i].finish_reason is None:
                keep_whole_words(scores[i], starts, torch.tensor(ends[i]), flagged, cap, WHOLE_WORD)
        return scores

    def _look_ahead(self, items: list[tuple[int, int]]) -> list[torch.Tensor | None]:
        """The next-token logits after each (row, token) of `items` (each row's items together, as the retry below
        gives them back row by row), in passes whose copies of the rows' caches stay within LOOKAHEAD_BYTES; None for
        the items of a row that failed (a pass that raises is run again row by row, and a row that still raises
        fails) or of a runner that cannot look ahead."""
        if not items:
            return []
        out: list[torch.Tensor | None] = []
        for part in self._lookahead_passes(items):
            try:
                out += self._peek(part)
            except Exception:
                for i in dict.fromkeys(i for i, _ in part):
                    mine = [item for item in part if item[0] == i]
                    try:
                        out += self._peek(mine)
                    except Exception as e:
                        self.fail(i, e)
                        out += [None] * len(mine)
        return out

    def _lookahead_passes(self, items: list[tuple[int, int]]) -> list[list[tuple[int, int]]]:
        """(row, token) `items` in passes, in order, whose copies of rows' caches stay within LOOKAHEAD_BYTES: a copy
        per distinct row where the runner feeds a row's tokens side by side (`TorchRows.side_by_side`; a pass holds
        at least one row's items, whatever its cache's size), else one per item (at least one item a pass)."""
        per = getattr(self.runner, "row_bytes", lambda: 0)()
        if not per:
            return [items]
        side_by_side = getattr(self.runner, "side_by_side", lambda: False)()
        passes: list[list[tuple[int, int]]] = [[]]
        rows: set[int] = set()
        for item in items:
            if side_by_side:  # one more copy only for a row new to the pass
                full = bool(rows) and item[0] not in rows and (len(rows) + 1) * per > LOOKAHEAD_BYTES
            else:
                full = bool(passes[-1]) and (len(passes[-1]) + 1) * per > LOOKAHEAD_BYTES
            if full:
                passes.append([])
                rows = set()
            passes[-1].append(item)
            rows.add(item[0])
        return passes

    def _peek(self, items: list[tuple[int, int]]) -> list[torch.Tensor | None]:
        """One lookahead pass over (row, token) `items`, under the rows' adapters (one a row where the runner feeds
        a row's tokens side by side)."""
        rows = [i for i, _ in items]
        fed = list(dict.fromkeys(rows)) if getattr(self.runner, "side_by_side", lambda: False)() else rows
        with self._adapters(fed):
            ahead = self.runner.peek(rows, torch.tensor([t for _, t in items], device=self.temperature.device))
        return [None] * len(items) if ahead is None else list(ahead)

    def _joins(self, vocab: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        """Two (vocab,) masks: the tokens that continue a word (`WordClasses.joins`), and those a word spelled so far
        goes on with (these, and the pieces of a character, `WordClasses.partial`: a start spelled in bytes). The
        model's ids past the tokenizer's are in both (no word starts there). Built once per batch."""
        cached = self._joins_of
        if cached is None or cached[0].size(0) != vocab or cached[0].device != torch.device(device):
            classes = word_classes(self.tokenizer)
            cached = self._joins_of = tuple(torch.ones(vocab, dtype=torch.bool, device=device) for _ in range(2))
            n = min(vocab, len(classes.joins))
            cached[0][:n] = classes.joins[:n].to(device)
            cached[1][:n] = (classes.joins | classes.partial)[:n].to(device)
        return cached

    def _force_replies(self, scores: torch.Tensor, pooled: torch.Tensor) -> torch.Tensor:
        """Rows the guide answers with a fixed reply (abstention) decode exactly that text, token by token. The
        guide decides once per row, from the prompt alone (`abstentions`, at the row's first step)."""
        fresh = [i for i, r in enumerate(self.rows) if r.forced is None and not r.token_ids and r.finish_reason is None]
        abstain = getattr(self.guide, "abstentions", None)
        if fresh and abstain is not None:
            for i, reply in abstain(pooled, fresh).items():
                self.rows[i].forced = self.tokenizer.encode(reply, add_special_tokens=False)
        for i, row in enumerate(self.rows):
            if row.forced and row.finish_reason is None and len(row.token_ids) < len(row.forced):
                scores[i] = float("-inf")
                scores[i, row.forced[len(row.token_ids)]] = 0.0
        return scores

    def fail(self, index: int, error: Exception) -> None:
        """Finish one row with an error; the batch goes on with the others."""
        row = self.rows[index]
        if row.finish_reason is None:
            row.finish_reason, row.error = "error", error

    def _append(self, row: Row, token: int, logged: tuple[TokenLogprob, TokenLogprob | None] | None = None) -> None:
        if logged is not None:  # the end-of-text token too: its probability is part of the answer's (as in vLLM)
            row.logprobs.append(logged[0])
            if row.untilted_logprobs is not None and logged[1] is not None:
                row.untilted_logprobs.append(logged[1])
        if token in self.eos and not row.params.ignore_eos:
            row.finish_reason = "stop"
            return
        row.token_ids.append(token)
        if len(row.token_ids) == self._crash_at:
            crash_point(f"decode:{self._crash_at}")
        row.text = self.tokenizer.decode(row.token_ids, skip_special_tokens=True)
        if row.forced and len(row.token_ids) >= len(row.forced):  # the whole reply is out: it ends here
            row.finish_reason = "stop"
            return
        cut = min((i for i in (row.text.find(s) for s in row.params.stop if s) if i >= 0), default=-1)
        if cut >= 0:
            row.text, row.finish_reason = row.text[:cut], "stop"
        elif len(row.token_ids) >= row.params.max_new_tokens:
            row.finish_reason = "length"

    def finish(self, index: int, reason: str = "abort") -> None:
        """Stop a row early (its client went away); the batch keeps decoding the others."""
        if self.rows[index].finish_reason is None:
            self.rows[index].finish_reason = reason

    # Continuous batching: rows join a running batch and leave it when they finish.

    def can_merge(self) -> bool:
        """Whether rows can join: the model side allows it (a plain growing cache), and the guide is per-row."""
        plain = getattr(self.runner, "can_merge", lambda: True)()
        return plain and (self.guide is None or hasattr(self.guide, "rows") and getattr(self.guide, "same", None) is None)

    def merge(self, other: "Batch") -> None:
        """Add `other`'s rows (freshly prefilled) to this batch."""
        self.runner.merge(other.runner)
        self.pool.merge(other.pool)
        for name in ("temperature", "top_k", "top_p", "min_p"):
            setattr(self, name, torch.cat([getattr(self, name), getattr(other, name)]))
        self._min_tokens = self._min_tokens or other._min_tokens
        self._logging = self._logging or other._logging
        if self.adapters is not None or other.adapters is not None:
            self.adapters = (self.adapters or ["__base__"] * len(self.rows)) + \
                (other.adapters or ["__base__"] * len(other.rows))
        self.rows += other.rows
        if self.guide is not None or other.guide is not None:
            from lethe.heads.t3.guide import HeadGuide

            self.guide = HeadGuide.joined(self.guide, len(self.rows) - len(other.rows), other.guide, len(other.rows),
                                          self.temperature.device)
            self._hand_words()

    def compact(self) -> list[int]:
        """Drop finished rows (and padding no row needs any more); returns the indices of the rows kept."""
        keep = [i for i, r in enumerate(self.rows) if r.finish_reason is None]
        if len(keep) == len(self.rows):
            return keep
        self.runner.keep(keep)
        idx = torch.tensor(keep, device=self.temperature.device, dtype=torch.long)
        self.pool.keep(idx)
        for name in ("temperature", "top_k", "top_p", "min_p"):
            setattr(self, name, getattr(self, name)[idx])
        self.rows = [self.rows[i] for i in keep]
        if self.adapters is not None:
            self.adapters = [self.adapters[i] for i in keep]
        if self.guide is not None:
            self.guide = self.guide.kept(keep)
        return keep

    def completions(self) -> list[Completion]:
        return [r.completion() for r in self.rows]

    def close(self) -> None:
        """Free what the model side holds for the rows (llama.cpp's sequences); the batch is done with."""
        self.runner.close()


def generate(model, tokenizer, prompts: list[str], params: SamplingParams | list[SamplingParams],
             guide: Guide | None = None, adapters: list[str] | None = None, guards: list[int] | None = None
             ) -> list[Completion]:
    """Decode `prompts` together until every row stops."""
    if isinstance(params, SamplingParams):
        params = [params] * len(prompts)
    batch = Batch(model, tokenizer, prompts, params, guide, adapters, guards)
    try:
        while not batch.done:
            batch.step()
        return batch.completions()
    finally:
        batch.close()


def generate_chunked(model, tokenizer, prompts: list[str], params: SamplingParams, batch_size: int = 64,
                     guide: Guide | None = None, before_chunk=None, adapter: str | None = None,
                     repeat_guard: int = 0) -> list[Completion]:
    """`generate` over a long list of prompts, `batch_size` at a time (prompts of similar length together).
    `before_chunk()` runs before each chunk (a job's cancellation check: it may raise). `adapter`: the ASU
    adapter every row decodes with (None: the model's own weights). `repeat_guard`: every row's own repeat
    guard, where the guide does not guard it (0: none)."""
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    out: list[Completion | None] = [None] * len(prompts)
    for start in range(0, len(order), batch_size):
        if before_chunk is not None:
            before_chunk()
        idx = order[start:start + batch_size]
        for i, c in zip(idx, generate(model, tokenizer, [prompts[i] for i in idx], params, guide,
                                      [adapter] * len(idx) if adapter else None, [repeat_guard] * len(idx))):
            out[i] = c
    return out  # type: ignore[return-value]

