"""Applying T3 heads during decoding: per-row heads and settings in one batch.

`TiltSettings` is what a profile chooses (T, lam, and Lethe's gate and
candidate restriction). `HeadGuide` is the decode loop's `Guide`: it groups the
rows by head, runs each head once on its rows' pooled states and applies
`heads.t3.tilt.tilt_candidates` (or `heads.t3.tilt.tilt` over the whole vocabulary when
a row turns candidates off). Rows without a head keep the model's logits untouched.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch

from lethe.heads.t3 import fused as fused_kernel
from lethe.heads.decoding.sampling import below_min_p
from lethe.heads.t3.head import T3Head
from lethe.heads.t3.tilt import candidates_of, tilt, tilt_candidates, word_guarded


MIN_T = 0.05  # tempering below this only divides logits towards overflow; the bound every entry point shares
MAX_CANDIDATES = 100_000
MAX_REPEAT_GUARD = 16
MAX_REPLY = 500


# what settings stored without a key served with: a profile version or a head's recommendation written before the
# setting existed serves as it did then (the new default applies to heads trained and profiles written since)
STORED_BEFORE = {"word_guard": False, "flagged_mass": 0.0}
MAX_LOOKAHEAD = 16  # the word starts `whole_words` looks one token past (the best; the rest are dropped)


@dataclass(frozen=True)
class TiltSettings:
    T: float = 1.0
    lam: float = 1.0
    gate: bool = True  # temper and tilt only as far as the context is forget-like
    # the gate, once open in an answer, stays at least as open for the rest of it (the highest P(forget) of the
    # answer so far, not the current one): a row that turns forget-like partway does not close again before the fact
    sticky_gate: bool = True
    candidates: int = 20  # tilt among the base model's k most likely tokens; 0 = all tokens
    cap: float | None = 0.5  # flagged tokens score at most the best other token minus this; None = off
    # with the cap: the tilt lowers a flagged token at most this many nats below where the cap holds it (its untilted
    # score, or the best unflagged token minus the cap where that is lower), so a forgotten answer scores among the
    # answers the model finds plausible rather than below made-up ones (`heads.t3.tilt.limit_push`). None = no limit,
    # the default: on the demo 4 took forget quality (the truth ratios' KS test) from 7e-07 to 0.56-0.70, but on
    # SmolLM2 it let log-likelihood multiple choice rank the forgotten capital first 0.45-0.50 of the time (chance
    # 0.25), where the unlimited push ranks it first at chance (docs/forgetting-in-context.md, session 36). Not
    # applied again after `whole_words` drops word starts (that step re-caps the flagged tokens only)
    max_push: float | None = None
    min_p: float = 0.0  # forget-like rows: drop candidates below min_p x the best token's probability; 0 = off
    repeat_guard: int = 3  # forget-like rows: no word that repeats a word n-gram of the answer (this n); 0 = off
    # forget-like rows: where the head flags the base model's likeliest token and it starts a word, no candidate that
    # continues the current word instead (`heads.t3.tilt.guard_words`; the decode loop hands the tokenizer's words in)
    word_guard: bool = True
    # forget-like rows: where the tilt turns away the base model's likeliest token, a word start the head flags, no
    # unflagged word start that the base model would go on spelling, where one it would end is left
    # (`heads.t3.tilt.keep_whole_words`; the decode loop looks one token ahead, for rows on the base weights). Off by
    # default: each such step costs the batch a forward pass (the demo's decode bench: 1.5x no head; see
    # docs/forgetting-in-context.md)
    whole_words: bool = False
    # the gate also opens (fully) at a step whose base-likeliest token the head scores below -head_gate (forget
    # e^head_gate times likelier than retain there): the probe reads the context, which earlier turns can make look
    # retain-like, while the head still flags the fact itself; with sticky_gate it stays open. 0 = off
    head_gate: float = 0.0
    # a step tempers and tilts only where the tokens the head flags (z < 0), of those the row may sample, hold at
    # least this much of the base model's probability; other steps keep the base logits, so a row the gate lets in
    # (a retain question after forget turns) samples what the base model samples until a flagged token is likely.
    # The repeat guard still follows the gate. Generation only: log-likelihood scoring tilts every position the gate
    # lets in (a scored text may hold an unlikely flagged token). 0 = off (every step the gate lets in is tilted)
    flagged_mass: float = 0.1
    abstain: str | None = None  # a reply (e.g. "I don't know.") for prompts the probe alone calls forget-like
    abstain_above: float = 0.9  # ... with P(forget | prompt) above this
    # ASU profiles with a head: decode with the adapter only where the probe's P(forget | prompt) is above this,
    # else with the base weights (`heads.decoding.decode.Batch`); 0: the adapter always
    adapter_above: float = 0.0

    def as_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, values: dict) -> "TiltSettings":
        """Settings as stored (a head file's recommendation, a profile); missing keys take defaults, but settings
        stored before the word guard existed keep serving without it, and those stored before `flagged_mass` was
        on by default keep tilting every step the gate lets in (`STORED_BEFORE`)."""
        unknown = set(values) - set(cls.names())
        if unknown:
            raise ValueError(f"unknown profile settings: {', '.join(sorted(unknown))}")
        return cls(**{**asdict(TiltSettings()), **STORED_BEFORE, **values}).replace()

    def replace(self, **changes) -> "TiltSettings":
        """These settings with some fields changed (None values are ignored); checks the values."""
        merged = self.as_dict() | {k: v for k, v in changes.items() if v is not None}
        unknown = set(merged) - set(self.names())
        if unknown:
            raise ValueError(f"unknown profile settings: {', '.join(sorted(unknown))}")
        for name in ("T", "lam", "cap"):
            value = merged[name]
            if not (value is None and name == "cap") and (isinstance(value, bool) or not isinstance(value, (int, float))):
                raise ValueError(f"{name}: must be a number, got {value!r}")
        if isinstance(merged["candidates"], bool) or not isinstance(merged["candidates"], int):
            raise ValueError(f"candidates: must be an integer, got {merged['candidates']!r}")
        for name in ("gate", "sticky_gate", "word_guard", "whole_words"):
            if not isinstance(merged[name], bool):
                raise ValueError(f"{name}: must be true or false, got {merged[name]!r}")
        out = TiltSettings(**merged)
        if not (MIN_T <= out.T <= 100):
            raise ValueError(f"T: must be in [{MIN_T}, 100], got {out.T}")
        if not (out.lam >= 0 and out.lam <= 1000):
            raise ValueError(f"lam: must be in [0, 1000], got {out.lam}")
        if not 0 <= out.candidates <= MAX_CANDIDATES:
            raise ValueError(f"candidates: must be in [0, {MAX_CANDIDATES}], got {out.candidates}")
        if isinstance(out.head_gate, bool) or not isinstance(out.head_gate, (int, float)) or \
                not 0 <= out.head_gate <= 100:
            raise ValueError(f"head_gate: must be a number in [0, 100] (0: off), got {out.head_gate!r}")
        if isinstance(out.flagged_mass, bool) or not isinstance(out.flagged_mass, (int, float)) or \
                not 0 <= out.flagged_mass < 1:
            raise ValueError(f"flagged_mass: must be a probability in [0, 1) (0: off), got {out.flagged_mass!r}")
        if out.cap is not None and not (0 <= out.cap <= 100):
            raise ValueError(f"cap: must be in [0, 100] or null, got {out.cap}")
        if out.max_push is not None and (isinstance(out.max_push, bool) or not isinstance(out.max_push, (int, float))
                                         or not 0 <= out.max_push <= 100):
            raise ValueError(f"max_push: must be a number in [0, 100] or null (no limit), got {out.max_push!r}")
        if isinstance(out.min_p, bool) or not isinstance(out.min_p, (int, float)) or not 0 <= out.min_p < 1:
            raise ValueError(f"min_p: must be a number in [0, 1), got {out.min_p!r}")
        if isinstance(out.repeat_guard, bool) or not isinstance(out.repeat_guard, int) or \
                not (out.repeat_guard == 0 or 2 <= out.repeat_guard <= MAX_REPEAT_GUARD):
            raise ValueError(f"repeat_guard: must be 0 (off) or an n-gram size in [2, {MAX_REPEAT_GUARD}], "
                             f"got {out.repeat_guard!r}")
        if out.abstain is not None and (not isinstance(out.abstain, str) or not out.abstain.strip()
                                        or len(out.abstain) > MAX_REPLY):
            raise ValueError(f"abstain: must be a reply of 1 to {MAX_REPLY} characters (not only spaces) or null, "
                             f"got {out.abstain!r}")
        if isinstance(out.abstain_above, bool) or not isinstance(out.abstain_above, (int, float)) or \
                not 0.5 <= out.abstain_above < 1:
            raise ValueError(f"abstain_above: must be a probability in [0.5, 1), got {out.abstain_above!r}")
        if isinstance(out.adapter_above, bool) or not isinstance(out.adapter_above, (int, float)) or \
                not 0 <= out.adapter_above < 1:
            raise ValueError(f"adapter_above: must be a probability in [0, 1), got {out.adapter_above!r}")
        return out

    @classmethod
    def names(cls) -> tuple[str, ...]:
        """The settings a profile may give (the keys of `as_dict`)."""
        return tuple(asdict(TiltSettings()))


PRESETS = {
    # the public reference's published run: T = 2.5, lam = 1, over the whole vocabulary, always on
    "paper": TiltSettings(T=2.5, lam=1.0, gate=False, sticky_gate=False, candidates=0, cap=None, max_push=None,
                          min_p=0.0, repeat_guard=0, word_guard=False, whole_words=False, flagged_mass=0.0,
                          abstain=None),
    "default": TiltSettings(),
}


def whole_vocabulary(head: T3Head, settings: TiltSettings, logits: torch.Tensor, pooled: torch.Tensor) -> torch.Tensor:
    """The profile's scores over the whole vocabulary at some positions, for scoring: (n, V) base logits and (n, d)
    pooled states -> (n, V). Gate, tempering, tilt and cap; no candidate restriction and no min-p floor (decoding
    truncations: like top-k, they would give some tokens, a forgotten answer included, no probability at all), and the
    cap's push limit."""
    n, device = len(logits), logits.device
    full = lambda value: torch.full((n,), float(value), device=device)  # noqa: E731
    z = head(pooled)
    gate = head.forget_probability(pooled) if settings.gate else None
    if gate is not None and settings.head_gate > 0:
        gate = opened_by_head(gate, likeliest(z, logits), full(settings.head_gate))
    cap = full(settings.cap) if settings.cap is not None else None
    push = full(settings.max_push) if settings.max_push is not None else None  # `tilt` applies it with the cap only
    # no flagged_mass here: it keeps a step's base logits where a flagged token is unlikely to be sampled, but a scored
    # text may hold that token (a multiple-choice option), and its score must be the tilted one
    return tilt(logits, z, full(settings.T), full(settings.lam), gate, cap=cap, push=push)


def on_adapter(head: T3Head, settings: TiltSettings, pooled: torch.Tensor) -> list[bool]:
    """(n, d) pooled states of prompts (or scored texts) on the base weights -> per one, whether a profile of ASU
    weights with this head decodes (or scores) it with its adapter: unless the probe's P(forget) is at most
    `adapter_above` (a NaN: with it)."""
    p = head.forget_probability(pooled.to(next(head.parameters()).device))
    return [not float(x) <= settings.adapter_above for x in p]


def likeliest(z: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """(B, V) head logits and base logits -> (B,): the head's logit for each row's likeliest base token (argmax:
    the lowest id among ties, as the CPU kernel reads it)."""
    return z.gather(-1, logits.argmax(-1, keepdim=True))[:, 0]


def opened_by_head(gate: torch.Tensor, z_top: torch.Tensor, head_gate: torch.Tensor) -> torch.Tensor:
    """Gates, fully open (1) where the head's logit for the likeliest base token (`z_top`, shaped as `gate`) is
    below -head_gate (0: off for that row)."""
    return torch.where((head_gate > 0) & (z_top < -head_gate), 1.0, gate)


class HeadGuide:
    """A `Guide` for a batch whose rows may each carry a different head and settings (or none).

    The per-group tensors (row indices, T, lam, k, gate switch) are built once, not at every step.
    `fused`: on the CPU, run each group's step as one compiled kernel (`heads.t3.fused`); None: unless
    LETHE_FUSED_TILT=0. False keeps the tensor operations (for comparison, and on other devices anyway).
    """

    def __init__(self, rows: list[tuple[T3Head, TiltSettings] | None], fused: bool | None = None,
                 floor: torch.Tensor | None = None, words: torch.Tensor | None = None):
        """`floor`: per row, the highest gate its answer has had so far (rows with `sticky_gate`; 0 for the others):
        what a batch hands on when it rebuilds its guide for rows that joined or left (a new `Batch` given the
        guide starts it again at 0: `restart`). `words`: per token id, whether
        it continues a word (`heads.decoding.repeats.WordClasses.joins`), for the word guard; None: the guard is off
        (the decode loop sets it from its tokenizer)."""
        self.rows = rows
        self.words = words
        self.fused = fused_kernel.enabled() if fused is None else fused
        self.same: tuple[T3Head, TiltSettings] | None = None
        self._groups: list[tuple] | None = None
        self._size = len(rows)
        self.floor = floor
        self._sticky: torch.Tensor | None = None  # (B,) which rows keep their gate open; None: no row

    @classmethod
    def uniform(cls, head: T3Head, settings: TiltSettings, fused: bool | None = None) -> "HeadGuide":
        """One head and settings for every row, whatever the batch size."""
        guide = cls([], fused)
        guide.same = (head, settings)
        return guide

    def kept(self, idx: list[int]) -> "HeadGuide":
        """This guide for rows `idx` only, in that order (a batch dropping its finished rows), floors with them."""
        return HeadGuide([self.row(i) for i in idx], self.fused, None if self.floor is None else self.floor[idx],
                         self.words)

    def replaced(self, rows: list[tuple[T3Head, TiltSettings] | None]) -> "HeadGuide":
        """The same rows with other heads and settings (None where a row failed), their floors kept."""
        return HeadGuide(rows, self.fused, self.floor, self.words)

    @staticmethod
    def joined(first: "HeadGuide | None", n_first: int, second: "HeadGuide | None", n_second: int,
               device) -> "HeadGuide":
        """The guide of two batches' rows, one after the other (a batch without a guide: rows without a head),
        their sticky floors with them."""
        parts = ((first, n_first), (second, n_second))
        rows = [row for guide, n in parts for row in ([guide.row(i) for i in range(n)] if guide else [None] * n)]
        floors = [None if guide is None else guide.floor for guide, _ in parts]
        floor = None
        if any(f is not None for f in floors):
            floor = torch.cat([f if f is not None else torch.zeros(n, device=device)
                               for f, (_, n) in zip(floors, parts)])
        return HeadGuide(rows, (first or second).fused, floor, (first or second).words)

    def _build(self, batch: int, vocab: int, device) -> list["_Group"]:
        rows = [self.same] * batch if self.same is not None else self.rows
        sticky = [row is not None and row[1].sticky_gate and row[1].gate for row in rows]
        self._sticky = torch.tensor(sticky, device=device) if any(sticky) else None
        self._all_sticky = all(sticky)
        if self._sticky is None:
            self.floor = None
        elif self.floor is None or len(self.floor) != batch:
            self.floor = torch.zeros(batch, device=device)
        by_head: dict[int, tuple[T3Head, list[int]]] = {}
        for i, row in enumerate(rows):
            if row is not None:
                by_head.setdefault(id(row[0]), (row[0], []))[1].append(i)
        words = None  # _Group.build drops it for a group without a guarding row
        if self.words is not None:
            words = torch.zeros(vocab, dtype=torch.bool, device=device)  # the model's rows past the tokenizer's: no
            n = min(vocab, len(self.words))
            words[:n] = self.words[:n].to(device)
        return [_Group.build(head, idx, [rows[i][1] for i in idx], len(idx) == batch, device, self.fused, words)
                for head, idx in by_head.values()]

    def __call__(self, logits: torch.Tensor, pooled: torch.Tensor) -> torch.Tensor:
        """(B, V) logits and (B, d) pooled states -> (B, V) scores to sample from."""
        if self._groups is None or self._size != logits.size(0):
            self._groups, self._size = self._build(logits.size(0), logits.size(-1), logits.device), logits.size(0)
        if not self._groups:
            return logits
        out, floor = None, self.floor
        for group in self._groups:
            if group.rows is None:
                out = group(logits, pooled, floor)
                break
            if out is None:
                out = logits.float().clone()
            out[group.rows] = group(logits[group.rows], pooled[group.rows],
                                    None if floor is None else floor[group.rows])
        if floor is not None:  # sticky rows start their next step from the gate they had at this one
            if self._groups[0].rows is None:  # one group: every row
                gates = self._groups[0].last_gate()
            else:
                gates = torch.zeros_like(floor)
                for group in self._groups:
                    gates[group.rows] = group.last_gate()
            # every row sticky (the default): the gates themselves, no copy. One group's kernel writes its gates into
            # the same buffer at its next call, each row's after reading its floor; other gates are fresh tensors
            self.floor = gates if self._all_sticky and torch.is_tensor(gates) else torch.where(self._sticky, gates, 0.0)
        return out

    def restart(self) -> None:
        """A new batch of rows decodes with this guide (`generate_chunked` hands one guide chunk after chunk): no
        row's gate has opened yet, whatever the rows before them in these places had (their sticky floors)."""
        if self.floor is not None:
            self.floor = torch.zeros_like(self.floor)

    def wants_words(self) -> bool:
        """Whether a row guards words and the guide has not been given the tokenizer's words yet (`words`)."""
        rows = [self.same] if self.same is not None else self.rows
        return self.words is None and any(row is not None and row[1].word_guard for row in rows)

    def use_words(self, words: torch.Tensor) -> None:
        """Per token id, whether it continues a word (`heads.decoding.repeats.WordClasses.joins`): the word guard
        acts from the next call on."""
        self.words, self._groups = words, None

    def looks_ahead(self) -> bool:
        """Whether a row has `whole_words` (`turned_words` has rows to find)."""
        rows = [self.same] if self.same is not None else self.rows
        return any(row is not None and row[1].whole_words for row in rows)

    def _per_row(self, read, empty):
        """Per row of the batch, after a call: what `read(group)` gives for the row in its group (a list over the
        group's rows), `empty` for rows without a head or whose group gives nothing."""
        groups = self._groups or []
        if len(groups) == 1 and groups[0].rows is None:  # one group of every row (the common batch): its list
            return read(groups[0]) or [empty] * self._size
        out = [empty] * (self._size or 0)
        for group in groups:
            rows = range(len(out)) if group.rows is None else group.rows.tolist()
            for i, value in zip(rows, read(group)):
                out[i] = value
        return out

    def flagged_tops(self) -> list[bool]:
        """Per row, after a call: whether the gate let it in with its likeliest token flagged (`_Group`)."""
        return self._per_row(_Group.last_flagged_top, False)

    def turned_words(self, logits: torch.Tensor, scores: torch.Tensor, pooled: torch.Tensor, joins: torch.Tensor,
                     eligible: list[bool], flagged_tops: list[bool]
                     ) -> list[tuple[int, torch.Tensor, torch.Tensor, float | None]]:
        """After a call, with its (B, V) `scores` (and the guards after it): the `eligible` rows with `whole_words`
        whose scores turned away the base model's likeliest token where the head flags it (z < 0) and it starts a
        word (not `joins`, (V,)), among the rows `flagged_tops` (`flagged_tops()`) marks. For each: (row, its
        unflagged word starts with a score, best first; every token with a score that the head flags; its cap)."""
        out = []
        for i in [i for i, flagged in enumerate(flagged_tops) if flagged and eligible[i]]:
            entry = self.row(i)
            if entry is None or not entry[1].whole_words:
                continue
            top = int(logits[i].argmax())
            if bool(joins[top]) or int(scores[i].argmax()) == top:
                continue
            head, settings = entry
            ids = torch.isfinite(scores[i]).nonzero()[:, 0]
            device = head.up.weight.device
            z = head.logits_at(pooled[i:i + 1].to(device), ids[None].to(device))[0].to(ids.device)
            starts = ids[(z >= 0) & ~joins[ids]]
            starts = starts[scores[i, starts].argsort(descending=True)]
            out.append((i, starts, ids[z < 0], settings.cap))
        return out

    def row(self, i: int) -> tuple[T3Head, TiltSettings] | None:
        """Row i's head and settings (None: no head)."""
        return self.same if self.same is not None else self.rows[i]

    def abstentions(self, pooled: torch.Tensor, rows: list[int]) -> dict[int, str]:
        """Of `rows` (at their first step: pooled over the prompt alone), those whose settings abstain and whose
        head's probe gives P(forget) above `abstain_above`, with their reply."""
        out = {}
        for i in rows:
            entry = self.row(i)
            if entry is None or entry[1].abstain is None or entry[0].probe is None:
                continue
            head, settings = entry
            if float(head.forget_probability(pooled[i:i + 1].to(head.probe.weight.device))[0]) > settings.abstain_above:
                out[i] = settings.abstain
        return out

    def repeat_guards(self) -> list[int]:
        """Per row, after a call: the n of the repeat guard the decode loop applies (`heads.decoding.repeats`),
        0 where it is off or the gate kept the row out."""
        return self._per_row(lambda group: [n if active else 0 for n, active in
                                            zip(group.repeat_guard, group.last_active())]
                             if group.repeat_guard else [], 0)


@dataclass
class _Group:
    """Rows of a batch that share one head, with their settings as tensors, built once per batch.

    With candidates on every row (the default), settings are (B, 1) columns for `tilt_candidates`, and
    left out where they change nothing (T = 1, no cap, no floor, every row gated), so a step runs few
    operations. Rows the gate keeps out (P(forget) <= 0.5) get their base logits, untouched.
    """

    head: T3Head
    rows: torch.Tensor | None  # None: every row of the batch
    k: int  # > 0: candidates on every row (the most any row asks for); 0: the whole-vocabulary path
    keep: torch.Tensor | None  # (B, k): False past a row's own number of candidates
    T: torch.Tensor | None
    lam: torch.Tensor
    cap: torch.Tensor | None
    min_p: torch.Tensor | None
    gated: torch.Tensor | None  # which rows are gated; None: all of them (if the head has a probe)
    any_gated: bool
    # (T, lam, k, cap, gate switch, min_p, head_gate, flagged_mass, word guard switch, push): (B,) vectors, k == 0
    dense: tuple | None
    repeat_guard: list[int] | None  # per row, the repeat guard's n (None: off for every row)
    head_gate: torch.Tensor | None = None  # (B, 1): `TiltSettings.head_gate` (None: 0, off, on every row)
    flagged_mass: torch.Tensor | None = None  # (B, 1): `TiltSettings.flagged_mass` (None: 0, off, on every row)
    words: torch.Tensor | None = None  # (V,): which tokens continue a word (None: the word guard off on every row)
    word_guard: torch.Tensor | None = None  # (B, 1): `TiltSettings.word_guard`
    fused: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None  # `heads.t3.fused.TiltKernel`, CPU
    _active: torch.Tensor | None = None  # after a call: which rows the gate let in (None: all)
    _gate: torch.Tensor | None = None  # after a call: each row's gate, P(forget) or its floor (None: no gate)
    _flagged_top: torch.Tensor | None = None  # after a call: rows the gate let in whose likeliest token is flagged
    push: torch.Tensor | None = None  # (B, 1): `TiltSettings.max_push`, inf where off (None: off on every row)

    @classmethod
    def build(cls, head: T3Head, idx: list[int], settings: list[TiltSettings], everyone: bool, device,
              fused: bool, words: torch.Tensor | None = None) -> "_Group":
        """`words`: which tokens continue a word, for rows with `word_guard` (None: no row guards)."""
        def column(values, dtype=torch.float32):
            return torch.tensor(values, device=device, dtype=dtype)[:, None]

        rows = None if everyone else torch.tensor(idx, device=device)
        any_gated = any(s.gate for s in settings)
        gated = None if all(s.gate for s in settings) or not any_gated else column([s.gate for s in settings], torch.bool)
        min_p = column([s.min_p for s in settings]) if any(s.min_p > 0 for s in settings) else None
        guard = [s.repeat_guard for s in settings] if any(s.repeat_guard for s in settings) else None
        head_gate = column([s.head_gate for s in settings]) if any(s.head_gate > 0 and s.gate for s in settings) \
            else None
        mass = column([s.flagged_mass for s in settings]) if any(s.flagged_mass > 0 for s in settings) else None
        pushes = [float("inf") if s.max_push is None else s.max_push for s in settings]  # the cap's: none without it
        push = column(pushes) if any(p < float("inf") for p in pushes) else None
        word_guard = None
        if words is not None and any(s.word_guard for s in settings):
            word_guard = column([s.word_guard for s in settings], torch.bool)
        else:
            words = None
        if not all(s.candidates > 0 for s in settings):
            dense = (column([s.T for s in settings])[:, 0], column([s.lam for s in settings])[:, 0],
                     column([s.candidates for s in settings], torch.long)[:, 0],
                     column([-1.0 if s.cap is None else s.cap for s in settings])[:, 0]
                     if any(s.cap is not None for s in settings) else None,
                     column([s.gate for s in settings], torch.bool)[:, 0] if any_gated else None,
                     None if min_p is None else min_p[:, 0], None if head_gate is None else head_gate[:, 0],
                     None if mass is None else mass[:, 0], None if word_guard is None else word_guard[:, 0],
                     None if push is None else push[:, 0])
            return cls(head, rows, 0, None, None, column([s.lam for s in settings]), None, None, gated, any_gated,
                       dense, guard, head_gate, mass, words, word_guard)
        wanted = [min(s.candidates, head.up.out_features) for s in settings]
        k, keep = max(wanted), None
        if any(w != k for w in wanted):
            keep = torch.arange(k, device=device)[None, :] < column(wanted, torch.long)
        T = None if all(s.T == 1 for s in settings) else column([s.T for s in settings])
        cap = None
        if any(s.cap is not None for s in settings):
            cap = column([float("-inf") if s.cap is None else s.cap for s in settings])
        kernel = None
        if fused and torch.device(device).type == "cpu":
            kernel = fused_kernel.TiltKernel(head, k, wanted, [s.T for s in settings], [s.lam for s in settings],
                                             [s.gate for s in settings], [s.cap for s in settings],
                                             [s.min_p for s in settings], [s.head_gate for s in settings],
                                             [s.flagged_mass for s in settings],
                                             None if words is None else [s.word_guard for s in settings], words,
                                             pushes)
        return cls(head, rows, k, keep, T, column([s.lam for s in settings]), cap, min_p, gated, any_gated, None,
                   guard, head_gate, mass, words, word_guard, kernel, push=push)

    def __call__(self, logits: torch.Tensor, pooled: torch.Tensor, floor: torch.Tensor | None = None) -> torch.Tensor:
        """The tilted logits of this group's rows: (B, V) -> (B, V), -inf outside the candidates (the base
        logits on rows the gate keeps out). `floor` (B,): a gate no row's may fall below (sticky gates)."""
        if self.dense is not None:
            return self._dense(logits, pooled, floor)
        if self.fused is not None:
            return self.fused(logits, pooled, floor)
        values, ids = candidates_of(logits, self.k, self.keep)
        if self.head_gate is None and self.words is None:
            forget_p, z = self.head.decode_terms(pooled, ids)
        else:  # the head's logit for the likeliest token as argmax picks it among ties (lowest id), as the kernel does
            top = logits.argmax(-1, keepdim=True)
            forget_p, z = self.head.decode_terms(pooled, torch.cat([ids, top], -1))
            z, z_top = z[:, :-1], z[:, -1:]
        gate = forget_p if self.any_gated else None
        if gate is not None and floor is not None:
            gate = torch.maximum(gate, floor[:, None])
        if gate is not None and self.gated is not None:
            gate = torch.where(self.gated, gate, 1.0)
        if gate is not None and self.head_gate is not None:  # the head flags the likeliest token
            gate = opened_by_head(gate, z_top, self.head_gate)
        self._gate = None if gate is None else gate[:, 0]
        guarded = joins = None
        if self.words is not None:
            guarded, joins = word_guarded(z_top, self.words[top], self.word_guard), self.words[ids]
        scores = tilt_candidates(values.float(), z.float(), self.T, self.lam, gate, self.cap, self.min_p, guarded,
                                 joins, self.push)
        out = torch.full_like(logits, float("-inf"), dtype=torch.float32).scatter_(-1, ids, scores)
        self._active = None if gate is None else gate[:, 0] > 0.5  # the gate's verdict, which the repeat guard follows
        tilted = self._active
        if self.flagged_mass is not None:  # and whether the head flags a likely token at this step
            # a head whose logits are not numbers is tilted, so that the row fails rather than passes untouched
            likely = (self._flagged_mass(logits, values, z) >= self.flagged_mass[:, 0]) | z.isnan().any(-1)
            tilted = likely if tilted is None else tilted & likely
        zt = z_top[:, 0] if self.head_gate is not None or self.words is not None else z[:, 0]  # ids[:, 0]: the top
        self._flagged_top = zt < 0 if tilted is None else (zt < 0) & tilted
        return out if tilted is None else torch.where(tilted[:, None], out, logits.float())

    def _flagged_mass(self, logits: torch.Tensor, values: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """(B,): the base probability of the candidates the head flags, of those the row may sample (its own number
        of candidates, above its min-p floor; before the word guard): `heads.t3.tilt.flagged_mass` at the
        candidates."""
        counted = (z < 0) & torch.isfinite(values)
        if self.min_p is not None:
            counted &= ~below_min_p(values, self.min_p[:, 0])
        if self.keep is not None:
            counted &= self.keep
        p = (values.float() - torch.logsumexp(logits.float(), -1, keepdim=True)).exp()
        return (p * counted).sum(-1)

    def _dense(self, logits: torch.Tensor, pooled: torch.Tensor, floor: torch.Tensor | None) -> torch.Tensor:
        T, lam, k, cap, gate_on, min_p, head_gate, mass, word_guard, push = self.dense
        z, gate = self.head(pooled), None
        z_top = likeliest(z, logits)
        if gate_on is not None:
            forget_p = self.head.forget_probability(pooled)
            gate = torch.where(gate_on, forget_p if floor is None else torch.maximum(forget_p, floor), 1.0)
            if head_gate is not None:
                gate = torch.where(gate_on, opened_by_head(gate, z_top, head_gate), gate)
        self._active = None if gate is None else gate > 0.5
        self._gate = gate
        self._flagged_top = z_top < 0 if gate is None else (z_top < 0) & self._active
        return tilt(logits, z, T, lam, gate, k, cap, min_p, mass, self.words, word_guard, push)

    def last_gate(self) -> torch.Tensor | float:
        """Each row's gate at the last call (1 where there is none)."""
        if self.fused is not None:
            return self.fused.gate_tensor
        return 1.0 if self._gate is None else self._gate

    def last_flagged_top(self) -> list[bool]:
        """Which of this group's rows, at the last call, the gate let in with the likeliest token flagged (z < 0):
        the rows whose scores may have turned a flagged word away."""
        if self.fused is not None:
            return self.fused.flagged_top.tolist()
        return [] if self._flagged_top is None else self._flagged_top.tolist()

    def last_active(self) -> list[bool]:
        """Which of this group's rows the gate let in at the last call."""
        if self.fused is not None:
            return self.fused.active.tolist()
        if self._active is None:  # no gate: every row (the guard's list has one entry per row)
            return [True] * len(self.repeat_guard or [])
        return self._active.tolist()
