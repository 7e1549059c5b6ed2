"""T3 end to end: cache the frozen model's pooled states once, fit a head, describe it for its file."""

from __future__ import annotations

import time
from dataclasses import asdict

from heads.cache import build_cache
from heads.guide import PRESETS
from heads.head import HeadInfo, T3Head
from heads.modelio import LoadedModel
from heads.records import PROMPT_FORMAT, examples
from heads.train import FitConfig, fit_head


def train_head(lm: LoadedModel, forget: list[dict], retain: list[dict], cfg: FitConfig | None = None,
               progress: bool = True, on_progress=None) -> tuple[T3Head, HeadInfo]:
    """Train a head that tells `forget` continuations from `retain` ones, on `lm`'s final hidden states.

    `on_progress(phase, fraction)` reports "caching" then "fitting"; it may raise to cancel.
    """
    report = (lambda phase: (lambda f: on_progress(phase, f))) if on_progress else (lambda phase: None)
    cfg = cfg or FitConfig()
    if not forget:
        raise ValueError("forget: the forget set is empty")
    if not retain:
        raise ValueError("retain: the retain set is empty")
    started = time.perf_counter()
    cache = build_cache(lm.model, lm.tokenizer, examples(forget), examples(retain), progress=progress,
                        on_progress=report("caching"))
    cache_seconds = time.perf_counter() - started
    head, metrics = fit_head(cache, lm.model.config.vocab_size, cfg, progress=progress, on_progress=report("fitting"))
    metrics |= {"cache_seconds": round(cache_seconds, 3), "forget_records": len(forget),
                "retain_records": len(retain), "positions": len(cache)}
    info = HeadInfo(base_fingerprint=lm.fingerprint, d=lm.model.config.hidden_size,
                    vocab=lm.model.config.vocab_size, rank=cfg.rank, prompt_format=PROMPT_FORMAT,
                    profile=asdict(PRESETS["default"]), training=metrics.pop("config"), metrics=metrics)
    return head, info
