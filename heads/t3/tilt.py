"""Temper-Then-Tilt on one step's logits: pure tensor functions.

The reference (open-unlearning's `T3CausalLM._guide_logits`, `base_temp` = T,
`guidance_scale` = lam):

    guided = log_softmax(logits) / T + lam * logsigmoid(z)

Lethe adds three optional refinements, each a plain tensor operation:

* gate: a per-row weight g in [0, 1] (how forget-like the context is, from a
  sequence-level probe). A context the probe does not call forget-like (g <= 0.5)
  is decoded from the base model's logits exactly, untouched (so a retain answer
  is the base model's answer, sampled ones too); above it, tempering and tilt
  scale with g: T_eff = 1 + (T-1) g, lam_eff = lam g.
* cap: in a forget-like context, a token the head flags (z < 0) may score at most
  the best unflagged token minus a margin: the memorised spike falls just below the
  likeliest alternative, so greedy decoding never follows it, yet its probability
  stays comparable to other answers'.
* candidates: only the base model's own k most likely tokens (untempered) may be
  chosen; the tilt re-ranks among them and never promotes a token the base
  model finds implausible (the word fragments the reference produces).
* push limit: with the cap on, the tilt lowers a flagged token at most `push` nats
  below where the cap holds it (its untilted score, or the best unflagged token
  minus the cap where that is lower): a memorised answer falls among the other
  answers the model finds plausible, not far below them, as in a model that never
  learnt it (pushed further, the true answer scores below made-up ones, and a
  truth-ratio scorer sees the forgetting). Off by default (`TiltSettings.max_push`):
  on SmolLM2 the unlimited push is what keeps multiple-choice scoring at chance.
* min_p: a fluency floor among the candidates: in a forget-like context a
  candidate whose base probability is below min_p times the best token's is
  dropped (min-p sampling's rule, applied before the tilt re-ranks).
* word guard: in a forget-like context, where the head flags the base model's
  likeliest token and that token starts a word (the answer's next word), no
  candidate that would continue the current word instead: the cap turns the
  flagged word away, and the best other candidate must not be a piece glued onto
  the word before it (the "Dredrou" + "g" + "p" + "binary" a small model's
  tilted answer spelled).
* whole words (applied by the decode loop, which can look one token ahead): where
  the tilt turns away the base model's likeliest token, a word start the head flags,
  the unflagged word starts that the base model would go on
  spelling (its next token continues the word, with probability above one half)
  are dropped, where one it would end there is left ("Br" + "atisl" + "ál" for
  "Budapest": a start the small model can only finish with letters of its own).
* repeat guard (`heads.decoding.repeats`, applied by the decode loop, which
  has the tokenizer): in a forget-like context, no word that would repeat a word
  n-gram of the answer so far (the loops and restated titles a tilted small
  model falls into once its likeliest tokens are flagged).

Every setting is a tensor with one entry per row (0 turns candidates off).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from lethe.heads.decoding.sampling import below_min_p


def guided_logits(logits: torch.Tensor, head_logits: torch.Tensor, T: torch.Tensor, lam: torch.Tensor) -> torch.Tensor:
    """The reference T3 formula, row-wise: log_softmax(logits)/T + lam * logsigmoid(z)."""
    return torch.log_softmax(logits.float(), dim=-1) / T[:, None] + lam[:, None] * F.logsigmoid(head_logits.float())


def gated(T: torch.Tensor, lam: torch.Tensor, gate: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Scale tempering and tilt by the gate: (1 + (T - 1) g, lam g)."""
    return 1 + (T - 1) * gate, lam * gate


def restrict_to_candidates(guided: torch.Tensor, logits: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """Keep, per row, only the k tokens the base logits rank highest (k = 0: keep all)."""
    if bool((k <= 0).all()):
        return guided
    vocab = logits.size(-1)
    kk = torch.where(k > 0, k.clamp(max=vocab), torch.full_like(k, vocab))
    kth = logits.float().topk(int(kk.max()), dim=-1).values.gather(-1, (kk - 1)[:, None])
    return guided.masked_fill(logits.float() < kth, float("-inf"))


def cap_flagged(guided: torch.Tensor, head_logits: torch.Tensor, margin: torch.Tensor,
                active: torch.Tensor, untilted: torch.Tensor | None = None,
                push: torch.Tensor | None = None) -> torch.Tensor:
    """Where `active`, a token the head calls forget-like (z < 0: forget likelier than retain) may
    not score above the best unflagged token minus `margin`, so a memorised spike drops below the
    likeliest alternative. With `push` ((B,); inf: off) and `untilted` ((B, V): the scores without
    the tilt), no lower than `push` below that limit or its untilted score, whichever is lower
    (`limit_push`)."""
    flagged = (head_logits < 0) & active[:, None]
    best_free = guided.masked_fill(flagged, float("-inf")).amax(-1, keepdim=True)
    limit = best_free - margin[:, None]
    capped = torch.minimum(guided, limit)
    if push is not None:
        capped = limit_push(capped, untilted, limit, push[:, None])
    return torch.where(flagged & torch.isfinite(best_free), capped, guided)


def limit_push(capped: torch.Tensor, untilted: torch.Tensor, limit: torch.Tensor, push: torch.Tensor) -> torch.Tensor:
    """Flagged tokens' scores after the cap (`capped`), raised to at least min(`untilted`, `limit`) - `push`: the tilt
    lowers a token at most `push` nats below where the cap holds it. Tokens without a score (-inf: outside the
    candidates, under the min-p floor, dropped by the word guard) stay without one; `push` inf leaves every score."""
    floor = torch.minimum(untilted, limit) - push
    return torch.where(torch.isfinite(capped), torch.maximum(capped, floor), capped)


def floor_candidates(guided: torch.Tensor, logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop, per row, the tokens whose base probability is below min_p times the best token's (0: keep all)."""
    return guided.masked_fill(below_min_p(logits, min_p), float("-inf"))


def guard_words(scores: torch.Tensor, head_logits: torch.Tensor, guarded: torch.Tensor,
                joins: torch.Tensor) -> torch.Tensor:
    """The word guard on (B, n) scores and head logits: rows `guarded` ((B,): the head flags the row's likeliest base
    token, which starts a word) drop the tokens that would continue the current word instead (`joins`, (B, n) or
    (1, n)), where an unflagged token (z >= 0) with a score is left after it: otherwise the spike cap would have no
    token to hold the flagged one under, and the row keeps its scores."""
    kept = scores.masked_fill(guarded[:, None] & joins, float("-inf"))
    free_left = (torch.isfinite(kept) & (head_logits >= 0)).any(-1, keepdim=True)
    return torch.where(free_left, kept, scores)


def word_guarded(z_top: torch.Tensor, top_joins: torch.Tensor, switch: torch.Tensor) -> torch.Tensor:
    """Rows where the word guard acts: the row's switch is on, and the head flags (`z_top` < 0) the likeliest base
    token, which starts a word (not `top_joins`). All three shaped alike."""
    return switch & (z_top < 0) & ~top_joins


def flagged_mass(logits: torch.Tensor, head_logits: torch.Tensor, allowed: torch.Tensor | None = None) -> torch.Tensor:
    """(B, V) base logits and head logits -> (B,): the base model's probability (over the whole vocabulary) of the
    tokens the head flags (z < 0: forget likelier than retain), counting only the `allowed` ones (None: all)."""
    flagged = head_logits < 0 if allowed is None else (head_logits < 0) & allowed
    return (torch.softmax(logits.float(), dim=-1) * flagged).sum(-1)


def tilt(logits: torch.Tensor, head_logits: torch.Tensor, T: torch.Tensor, lam: torch.Tensor,
         gate: torch.Tensor | None = None, candidates: torch.Tensor | None = None,
         cap: torch.Tensor | None = None, min_p: torch.Tensor | None = None,
         mass: torch.Tensor | None = None, words: torch.Tensor | None = None,
         word_guard: torch.Tensor | None = None, push: torch.Tensor | None = None) -> torch.Tensor:
    """Guided logits with Lethe's optional gate, spike cap (and its push limit, `push`: with the cap only),
    candidate restriction, fluency floor and word guard
    (`words`, (V,): which tokens continue a word; `word_guard`, (B,): which rows guard; None: no row); a row
    the gate keeps out (g <= 0.5) gets its base logits back untouched, and so does a row whose flagged tokens,
    of those it may sample, hold less than `mass` of the base model's probability (None or 0: no such row)."""
    active = gate > 0.5 if gate is not None else torch.ones_like(T, dtype=torch.bool)
    if gate is not None:
        T, lam = gated(T, lam, gate)
    out = guided_logits(logits, head_logits, T, lam)
    if candidates is not None:
        out = restrict_to_candidates(out, logits, candidates)
    if min_p is not None:
        out = floor_candidates(out, logits, min_p)
    if mass is not None:
        # a head whose logits are not numbers is tilted, so that the row fails rather than passes untouched
        active = active & ((flagged_mass(logits, head_logits, torch.isfinite(out)) >= mass) |
                           head_logits.isnan().any(-1))
    if words is not None and word_guard is not None:  # after the mass: what the row may sample, unguarded
        top = logits.argmax(-1)
        guarded = word_guarded(head_logits.gather(-1, top[:, None])[:, 0], words[top], word_guard)
        out = guard_words(out, head_logits, guarded, words[None, :])
    if cap is not None:  # after the restriction: the best alternative is a candidate
        untilted = None if push is None else torch.log_softmax(logits.float(), dim=-1) / T[:, None]
        out = cap_flagged(out, head_logits, cap, active & (cap >= 0), untilted, push)
    return out if gate is None and mass is None else torch.where(active[:, None], out, logits.float())


def candidates_of(logits: torch.Tensor, k: int, keep: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(values, ids), each (B, k): every row's k likeliest tokens under the base logits, and their logits.

    `keep` (B, k), optional: False where a row wants fewer candidates; those places repeat the row's top
    token and value, so every id is a real candidate and a scatter writes each token's own value.
    """
    values, ids = logits.topk(k, dim=-1)
    if keep is None:
        return values, ids
    return torch.where(keep, values, values[:, :1]), torch.where(keep, ids, ids[:, :1])


def tilt_candidates(values: torch.Tensor, head_logits: torch.Tensor, T: torch.Tensor | None, lam: torch.Tensor,
                    gate: torch.Tensor | None = None, cap: torch.Tensor | None = None,
                    min_p: torch.Tensor | None = None, guarded: torch.Tensor | None = None,
                    joins: torch.Tensor | None = None, push: torch.Tensor | None = None) -> torch.Tensor:
    """`tilt` with candidates, on the candidates only: (B, k) base logits (best first) and head logits ->
    (B, k) scores.

    The settings are (B, 1) columns: T (None: 1 for every row), lam, gate (None: 1), cap (None: off; a
    row's cap of -inf turns it off for that row), min_p (None: off), push (None: off; inf for a row, or a row
    without a cap: off for it); `guarded` (B, 1) and `joins` (B, k): the rows
    where the word guard acts (`word_guarded`) and which candidates continue the current word (None: off). Equal to `tilt(..., candidates=k)` at
    the candidates of a row the gate lets in, up to a constant per row (the log-normaliser, skipped: it
    changes neither the sampling distribution, nor the argmax, nor the cap); the caller gives the rows the
    gate keeps out their base logits. Written in few operations: it runs at every decoding step.
    """
    active = None
    if gate is not None:
        T, lam = (None, lam * gate) if T is None else gated(T, lam, gate)
        active = gate > 0.5
    tempered = values if T is None else values / T
    scores = torch.addcmul(tempered, lam, F.logsigmoid(head_logits))
    if min_p is not None:  # the candidates' best is the row's best: the same floor as over the vocabulary
        scores = scores.masked_fill(below_min_p(values, min_p[:, 0]), float("-inf"))
    if guarded is not None:
        scores = guard_words(scores, head_logits, guarded[:, 0], joins)
    if cap is None:
        return scores
    flagged = head_logits < 0 if active is None else (head_logits < 0) & active
    best_free = scores.masked_fill(flagged, float("-inf")).amax(-1, keepdim=True)
    # no unflagged candidate (-inf), or the row's cap off (nan, or +inf): no limit
    inf = float("inf")
    raw = best_free - cap
    limit = raw.nan_to_num(nan=inf, posinf=inf, neginf=inf)
    held = torch.minimum(scores, limit)
    if push is not None:  # where the cap holds (a finite limit): the untilted scores are the tempered values
        held = torch.where(torch.isfinite(raw), limit_push(held, tempered, raw, push), held)
    return torch.where(flagged, held, scores)



def word_ends(next_logits: torch.Tensor, joins: torch.Tensor) -> torch.Tensor:
    """(k, V) next-token logits after each of k word starts, and (V,) which tokens continue a word -> (k,): the base
    model's probability that the word ends there (its next token does not continue it)."""
    return (torch.softmax(next_logits.float(), dim=-1) * ~joins).sum(-1)


def keep_whole_words(scores: torch.Tensor, starts: torch.Tensor, ends: torch.Tensor, flagged: torch.Tensor,
                     cap: float | None, least: float = 0.5) -> torch.Tensor:
    """One row's (V,) scores without the word starts that would go on spelling, where one that ends is left.

    `starts` ((n,) ids, unflagged, best first): the row's word starts; `ends` ((k,), k <= n): for the first k, the
    probability that the base model ends the word at the next token. Starts below `least`, and those past the k
    looked at, are dropped where one of the k ends (else the scores are kept). The tokens the head flags (`flagged`:
    every id with a score and z < 0) never gain from it: they lose the dropped starts' share of the probability (so
    none is likelier to be sampled than before), and are held under the best unflagged token left minus `cap` again,
    since the one the cap held them under may have gone. With the cap off (None), the scores are kept where a flagged
    token would then score above every unflagged one. In place; returns `scores`."""
    ending = ends >= least
    if not bool(ending.any()):
        return scores
    dropped = torch.cat([starts[: len(ends)][~ending], starts[len(ends):]])
    if not len(dropped):
        return scores
    kept = scores.clone()
    kept[dropped] = float("-inf")
    free_before = torch.isfinite(scores)
    free_before[flagged] = False
    free = free_before & torch.isfinite(kept)
    best_free = kept[free].max()
    if len(flagged):
        # scaled as the unflagged tokens' mass shrank: each flagged token keeps the probability it had
        kept[flagged] += torch.logsumexp(kept[free], 0) - torch.logsumexp(scores[free_before], 0)
        if cap is not None:
            kept[flagged] = torch.minimum(kept[flagged], best_free - cap)
        elif bool((kept[flagged] > best_free).any()):
            return scores
    scores.copy_(kept)
    return scores
