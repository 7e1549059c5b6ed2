"""Fitting a T3 head (and its gate probe) on a pooled-state cache, in seconds.

Loss: binary cross-entropy on the head's logit at the true next token
(retain = 1, forget = 0), plus the same loss for the sequence-level probe on
the pooled state alone. AdamW; classes weighted to balance by default (the
forget set is usually much smaller), so the head is not biased towards
"retain" by the class prior; a held-out split of whole records with early
stopping; held-out AUC and per-class accuracy are reported.
"""

from __future__ import annotations

import copy
import random
import time
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from scipy.stats import rankdata
from tqdm.auto import tqdm

from lethe.heads.t3.cache import ContextShifts, PooledCache
from lethe.heads.t3.head import T3Head
from lethe.heads.t3.pooling import DEFAULT_WINDOW


@dataclass
class FitConfig:
    rank: int = 20
    lr: float = 1e-2
    weight_decay: float = 1e-2
    batch_size: int = 256
    max_epochs: int = 60
    patience: int = 5
    holdout: float = 0.1  # share of records (of each class) held out for early stopping and metrics
    balance: bool = True  # weight the classes equally
    bias: bool = False
    probe: bool = True
    # A forget position whose next token occurs in more than this share of the retain records'
    # completions is ordinary language (template and function words), not forget knowledge: it
    # trains the probe but not the head. 1.0 (and fact_spans off) keeps every position, as the reference does.
    common_df: float = 0.05
    # A forget record that names its fact (`fact`) trains the head as forget on the fact's tokens (those that are
    # not common) and on words of its answer that no retain answer uses; its other words (template words such as
    # " won" or " on", which retain answers also say) train the probe but not the head. Records without one, or
    # whose answer does not state it, keep the common_df rule alone. Off by default: on SmolLM2 it let the chat
    # form's log-likelihood multiple choice rank the gold first more often (docs/forgetting-in-context.md).
    fact_spans: bool = False
    seed: int = 0
    format: str = "auto"  # how question/answer records become text: heads.records.resolve_format
    # the head reads the mean of the last this many positions' states; 0: all of them (heads.t3.pooling)
    pooling_window: int = DEFAULT_WINDOW
    # records with a `fact` also train with the fact alone as the answer (heads.records.answer_forms)
    answer_forms: bool = True
    # examples per forget record (and twice as many retain ones) that train after a context: a preamble, a system
    # prompt, earlier turns, other text (heads.t3.contexts); 0: off
    contexts: float = 1.0
    # the share of training rows, drawn afresh every batch, to which a context's shift of the pooled state is added
    # (one drawn from what the contexts did to the same answers: heads.t3.cache.context_shifts); 0: off
    context_shift: float = 0.0
    # retain questions the base model answers (greedy) once the head is fitted, to set the head's recommended
    # head_gate one nat past the lowest head logit of a token those answers chose (heads.t3.calibrate); 0: no
    # head_gate (off)
    gate_answers: int = 64
    # the dtype of the cache pass's matrix products (heads.t3.cache.cache_autocast): "auto" bfloat16 on a CPU that
    # computes it natively (about twice as fast there), "model" the model's own
    cache_precision: str = "auto"


def auc(scores: torch.Tensor, labels: torch.Tensor) -> float:
    """Area under the ROC curve: P(score of a positive > score of a negative), ties counted half."""
    pos = labels > 0.5
    n_pos, n_neg = int(pos.sum()), int((~pos).sum())
    if n_pos == 0 or n_neg == 0:
        return float("nan")
    ranks = torch.from_numpy(rankdata(scores.numpy()))
    return float((ranks[pos].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))


def split_records(cache: PooledCache, holdout: float, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Position indices (train, held-out), holding out whole records of each class."""
    rng = random.Random(seed)
    held = set()
    for lo, hi in ((0, cache.n_forget), (cache.n_forget, cache.n_forget + cache.n_retain)):
        ids = list(range(lo, hi))
        rng.shuffle(ids)
        held.update(ids[:max(1, round(holdout * len(ids)))] if holdout > 0 and len(ids) > 1 else [])
    is_held = torch.tensor([int(r) in held for r in cache.record.tolist()])
    return (~is_held).nonzero().flatten(), is_held.nonzero().flatten()


def common_tokens(cache: PooledCache, vocab: int, max_df: float) -> torch.Tensor:
    """(V,) bool: tokens found in more than `max_df` of the retain records' completions."""
    retain = cache.label > 0.5
    if max_df >= 1 or not bool(retain.any()):
        return torch.zeros(vocab, dtype=torch.bool)
    pairs = torch.unique(torch.stack([cache.record[retain], cache.target[retain]]), dim=1)
    df = torch.bincount(pairs[1], minlength=vocab).float() / max(1, cache.n_retain)
    return df > max_df


def fact_flags(cache: PooledCache, flags: list[list[int] | None]) -> torch.Tensor:
    """(N,) int8: per position of `cache`, its example's flag (`heads.records.fact_positions`: 1 the fact, 0 not;
    examples numbered as the cache's `record`, any not given or None -> -1, as one whose flags do not match its
    positions)."""
    out = torch.full((len(cache),), -1, dtype=torch.int8)
    bounds = cache.bounds()
    for i, f in enumerate(flags):
        if f is not None and len(f) == bounds[i + 1] - bounds[i]:
            out[bounds[i]:bounds[i + 1]] = torch.tensor(f, dtype=torch.int8)
    return out


def _losses(head: T3Head, pooled, target, label, weight, head_weight):
    z = head.token_logit(pooled, target)
    loss = F.binary_cross_entropy_with_logits(z, label, weight=weight * head_weight)
    if head.probe is not None:
        loss = loss + F.binary_cross_entropy_with_logits(head.probe(pooled)[:, 0], label, weight=weight)
    return loss, z


def shifted(pooled: torch.Tensor, shifts: torch.Tensor, share: float, generator: torch.Generator,
            eligible: torch.Tensor | None = None) -> torch.Tensor:
    """`pooled` (B, d) with a row of `shifts` (M, d), drawn at random, added to about `share` of its rows (of those
    `eligible`, (B,) bool, where given)."""
    if share <= 0 or len(shifts) == 0:
        return pooled
    chosen = torch.rand(len(pooled), generator=generator) < share
    if eligible is not None:
        chosen &= eligible
    drawn = shifts[torch.randint(len(shifts), (len(pooled),), generator=generator)].float()
    return torch.where(chosen[:, None], pooled + drawn, pooled)


def fit_head(cache: PooledCache, vocab: int, cfg: FitConfig | None = None, progress: bool = True,
             on_progress=None, shifts: ContextShifts | None = None, facts: torch.Tensor | None = None):
    """Train a head on `cache`; returns (head, metrics). `on_progress(fraction)` after every epoch. `shifts`: what
    contexts did to pooled states (`heads.t3.cache.context_shifts`), added to `cfg.context_shift` of the training
    rows they may go to (never to held-out ones). `facts`: (N,) per position, 1 where the next token is part of the
    record's fact, 0 where it is not, -1 where the record names none (`fact_flags`); forget positions at 0 whose
    token a retain answer also has train the probe only, as those of common tokens do. The held-out metrics of the
    head's logits read the positions it trains on."""
    cfg = cfg or FitConfig()
    torch.manual_seed(cfg.seed)
    draw = torch.Generator().manual_seed(cfg.seed)
    started = time.perf_counter()
    d = cache.pooled.shape[1]
    head = T3Head(d, vocab, cfg.rank, bias=cfg.bias, probe=cfg.probe, window=cfg.pooling_window)
    opt = torch.optim.AdamW(head.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay, fused=True)
    train_idx, held_idx = split_records(cache, cfg.holdout, cfg.seed)
    pos = float(cache.label[train_idx].mean())
    class_w = (0.5 / pos, 0.5 / (1 - pos)) if cfg.balance and 0 < pos < 1 else (1.0, 1.0)
    common = common_tokens(cache, vocab, cfg.common_df)
    # the head trains on every position but forget ones of ordinary language, or outside their record's fact with a
    # token the retain answers also use (a template word such as " won"; one no retain answer has still counts)
    outside = torch.zeros(len(cache), dtype=torch.bool)
    if facts is not None:
        if len(facts) != len(cache):
            raise ValueError(f"facts: {len(facts)} flags for {len(cache)} positions")
        outside = (facts == 0) & common_tokens(cache, vocab, 0.0)[cache.target]
    trains_head = ~((cache.label < 0.5) & (common[cache.target] | outside))

    def weights(label):
        return torch.where(label > 0.5, class_w[0], class_w[1])

    def head_weights(idx):  # 1 where the head trains, 0 elsewhere
        return trains_head[idx].float()

    held = (cache.rows(held_idx), cache.target[held_idx], cache.label[held_idx]) if len(held_idx) else None
    best, best_loss, stale, epoch = copy.deepcopy(head.state_dict()), float("inf"), 0, 0
    bar = tqdm(range(cfg.max_epochs), desc="fitting", disable=not progress, leave=False)
    for epoch in bar:
        head.train()
        perm = train_idx[torch.randperm(len(train_idx))]
        for b in range(0, len(perm), cfg.batch_size):
            idx = perm[b:b + cfg.batch_size]
            label = cache.label[idx]
            target = cache.target[idx]
            pooled = cache.rows(idx)
            if shifts is not None:
                pooled = shifted(pooled, shifts.shifts, cfg.context_shift, draw, shifts.rows[idx])
            loss, _ = _losses(head, pooled, target, label, weights(label), head_weights(idx))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
        if on_progress is not None:
            on_progress((epoch + 1) / cfg.max_epochs)
        if held is None:
            continue
        head.eval()
        with torch.no_grad():
            held_loss = float(_losses(head, *held, weights(held[2]), head_weights(held_idx))[0])
        bar.set_postfix(heldout_loss=f"{held_loss:.4f}")
        if held_loss < best_loss - 1e-4:
            best, best_loss, stale = copy.deepcopy(head.state_dict()), held_loss, 0
        else:
            stale += 1
            if stale >= cfg.patience:
                break
    if held is not None:
        head.load_state_dict(best)
    head.eval().requires_grad_(False)
    metrics = {"epochs": epoch + 1, "common_tokens": int(common.sum()), "fact_positions": 0 if facts is None else int((facts == 1).sum()),
               "fit_seconds": round(time.perf_counter() - started, 3),
               "train_positions": len(train_idx), "heldout_positions": len(held_idx)}
    if held is not None:
        with torch.no_grad():
            counted = trains_head[held_idx]
            z = head.token_logit(held[0][counted], held[1][counted])
            label = held[2][counted]
            metrics |= {"heldout_loss": round(best_loss, 5), "heldout_auc": round(auc(z, label), 4),
                        "heldout_acc_retain": round(float(((z > 0) == (label > 0.5))[label > 0.5].float().mean()), 4),
                        "heldout_acc_forget": round(float(((z > 0) == (label > 0.5))[label < 0.5].float().mean()), 4)}
            if head.probe is not None:
                metrics["heldout_probe_auc"] = round(auc(head.probe(held[0])[:, 0], held[2]), 4)
    metrics["config"] = asdict(cfg)
    return head, metrics
