"""T3 end to end: cache the frozen model's pooled states once, fit a head, describe it for its file."""

from __future__ import annotations

import time
from dataclasses import asdict

from lethe.heads.t3.cache import build_cache, cache_autocast, context_shifts
from lethe.heads.t3.calibrate import asked, head_gate_for, lowest_chosen_logit
from lethe.heads.t3.contexts import context_counts, context_examples, draw_contexts
from lethe.heads.t3.guide import PRESETS, TiltSettings
from lethe.heads.t3.head import HeadInfo, T3Head
from lethe.heads.t3.pooling import pooling_name
from lethe.heads.modelio import LoadedModel
from lethe.heads.records import PROMPT_FORMAT, answer_forms, examples, fact_positions, resolve_format
from lethe.heads.t3.train import FitConfig, fact_flags, fit_head


def train_head(lm: LoadedModel, forget: list[dict], retain: list[dict], cfg: FitConfig | None = None,
               progress: bool = True, on_progress=None) -> tuple[T3Head, HeadInfo]:
    """Train a head that tells `forget` continuations from `retain` ones, on `lm`'s final hidden states.

    `on_progress(phase, fraction)` reports "caching", "fitting", then "calibrating" (the recommended head_gate,
    `heads.t3.calibrate`, where `cfg.gate_answers`); it may raise to cancel.
    """
    report = (lambda phase: (lambda f: on_progress(phase, f))) if on_progress else (lambda phase: None)
    cfg = cfg or FitConfig()
    if not forget:
        raise ValueError("forget: the forget set is empty")
    if not retain:
        raise ValueError("retain: the retain set is empty")
    autocast = cache_autocast(lm.model, cfg.cache_precision)  # first: a bad setting fails before any work
    fmt = resolve_format(lm.tokenizer, cfg.format)  # chat where the model has a template: what it serves
    extra = (answer_forms(forget, fmt), answer_forms(retain, fmt)) if cfg.answer_forms else ([], [])
    started = time.perf_counter()
    contexts = draw_contexts(forget + retain, seed=cfg.seed) if cfg.contexts > 0 else []
    sides, groups, added, pairs, facts = [], [], [], [], []
    counts = context_counts(forget, cfg.contexts)
    for i, (records, forms) in enumerate(zip((forget, retain), extra)):
        after, which, sources = context_examples(records, contexts, counts[i], fmt, lm.tokenizer, seed=cfg.seed + i)
        plain = examples(records + forms, fmt, lm.tokenizer)
        offset = sum(map(len, sides))  # examples are numbered forget side first, then retain
        pairs += [(offset + len(plain) + k, offset + source) for k, source in enumerate(sources)]
        sides.append(plain + after)
        if i == 0:  # the forget side's facts (FitConfig.fact_spans)
            facts = [r.get("fact") for r in records + forms] + [records[k].get("fact") for k in sources]
        # examples that begin alike run their first tokens once (heads.t3.cache.batches): the chat template's
        # system prompt, each context
        groups += [("plain", "question" in r) for r in records + forms] + [("context", j) for j in which]
        added.append(len(after))
    cache = build_cache(lm.model, lm.tokenizer, *sides, progress=progress, on_progress=report("caching"),
                        window=cfg.pooling_window, groups=groups, autocast=autocast)
    shifts = context_shifts(cache, pairs, seed=cfg.seed) if cfg.context_shift > 0 and pairs else None
    # forget examples that name their fact train the head on its tokens alone (FitConfig.fact_spans)
    spans = fact_flags(cache, fact_positions(lm.tokenizer, sides[0], facts)) if cfg.fact_spans else None
    cache_seconds = time.perf_counter() - started
    head, metrics = fit_head(cache, lm.model.config.vocab_size, cfg, progress=progress, on_progress=report("fitting"),
                             shifts=shifts, facts=spans)
    profile = asdict(PRESETS["default"])
    if cfg.gate_answers > 0:
        calibrated = time.perf_counter()
        questions = asked(retain, cfg.gate_answers)
        lowest = lowest_chosen_logit(lm, head, questions, fmt, on_progress=report("calibrating"))
        profile["head_gate"] = head_gate_for(lowest)
        metrics["head_gate"] = {"answers": len(questions), "lowest_logit": None if lowest is None else round(lowest, 3),
                                "head_gate": profile["head_gate"],
                                "seconds": round(time.perf_counter() - calibrated, 3)}
    metrics |= {"cache_seconds": round(cache_seconds, 3),
                "cache_dtype": str(autocast or lm.model.dtype).removeprefix("torch."),
                "forget_records": len(forget),
                "retain_records": len(retain), "answer_form_records": [len(e) for e in extra],
                "context_records": added,
                "positions": len(cache)}
    info = HeadInfo(base_fingerprint=lm.fingerprint, d=lm.model.config.hidden_size,
                    vocab=lm.model.config.vocab_size, rank=cfg.rank, pooling=pooling_name(cfg.pooling_window),
                    prompt_format=PROMPT_FORMAT if fmt == "qa" else fmt,
                    profile=profile, training=metrics.pop("config"), metrics=metrics)
    return head, info


def quick_check(lm: LoadedModel, head: T3Head, forget: list[dict], retain: list[dict], n: int = 24,
                fmt: str = "auto", settings: TiltSettings | None = None) -> dict:
    """Greedy ROUGE-L recall with and without the head (under `settings`; default: the default preset) on up to
    `n` records of each set that have TOFU fields: a first look at whether the head forgets and keeps what it
    should."""
    import statistics

    from lethe.heads.decoding.decode import generate_chunked
    from lethe.heads.t3.guide import HeadGuide
    from lethe.heads.evaluation.metrics import rouge_l_recall
    from lethe.heads.records import ask
    from lethe.heads.decoding.sampling import SamplingParams

    out = {}
    fmt = resolve_format(lm.tokenizer, fmt)
    guide = HeadGuide.uniform(head, settings or PRESETS["default"])
    params = SamplingParams(max_new_tokens=64, temperature=0.0)
    for name, records in (("forget", forget), ("retain", retain)):
        qa = [r for r in records if "question" in r and "answer" in r]
        qa = qa[:: max(1, len(qa) // n)][:n]
        if not qa:
            continue
        prompts = [ask(r["question"], fmt, lm.tokenizer) for r in qa]
        for label, g in (("base", None), ("head", guide)):
            texts = [c.text for c in generate_chunked(lm.model, lm.tokenizer, prompts, params, guide=g)]
            out[f"sample_{name}_rouge_{label}"] = round(
                statistics.fmean(rouge_l_recall(r["answer"], t) for r, t in zip(qa, texts)), 4)
    return out
