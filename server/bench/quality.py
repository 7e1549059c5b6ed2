"""`lethe bench t3-quality`: the quality table — full model, reference, `paper`, default, and each
of Lethe's improvements on its own (added to `paper`) and taken away (from the default).

Two heads are trained: the reference recipe (every answer position, classes unweighted) and
Lethe's (ordinary-language forget tokens left out, classes balanced).
"""

from __future__ import annotations

from dataclasses import replace

from lethe.heads.evaluation.evaluate import EvalConfig, Profile, corpus_vocabulary, evaluate, truth_ratios
from lethe.heads.t3.guide import PRESETS
from lethe.heads.t3.pipeline import train_head
from lethe.heads.t3.train import FitConfig

COLUMNS = [("forget", "rouge", "forget ROUGE"), ("forget", "rouge_sampled", "forget ROUGE sampled"),
           ("forget", "rouge_paraphrased", "forget ROUGE para."), ("retain", "rouge", "retain ROUGE"),
           ("retain", "rouge_sampled", "retain ROUGE sampled"), ("forget", "nonword_rate", "non-words"),
           ("forget", "nonword_rate_sampled", "non-words sampled"), ("forget", "repeated_3gram_rate", "rep. 3-grams"),
           ("forget", "repeated_3gram_rate_sampled", "rep. 3-grams sampled"), (None, "forget_quality", "forget quality"),
           (None, "model_utility", "model utility")]


def variants(paper_head, lethe_head) -> list[tuple[str, Profile]]:
    paper, default = PRESETS["paper"], PRESETS["default"]
    return [
        ("paper (reference recipe, T=2.5, lam=1)", Profile("paper", paper_head, paper)),
        ("default (Lethe)", Profile("default", lethe_head, default)),
        ("paper + Lethe head training", Profile("paper+training", lethe_head, paper)),
        ("paper + T=1 (no tempering)", Profile("paper+T1", paper_head, replace(paper, T=1.0))),
        ("paper + gate", Profile("paper+gate", paper_head, replace(paper, gate=True))),
        ("paper + 20 candidates", Profile("paper+candidates", paper_head, replace(paper, candidates=20))),
        ("paper + cap 0.5", Profile("paper+cap", paper_head, replace(paper, cap=0.5))),
        ("default - Lethe head training", Profile("default-training", paper_head, default)),
        ("default with T=2.5", Profile("default+T2.5", lethe_head, replace(default, T=2.5))),
        ("default - gate", Profile("default-gate", lethe_head, replace(default, gate=False))),
        ("default - candidates", Profile("default-candidates", lethe_head, replace(default, candidates=0))),
        ("default - cap", Profile("default-cap", lethe_head, replace(default, cap=None))),
        ("default + push limit 4", Profile("default+push", lethe_head, replace(default, max_push=4.0))),
        ("default - repeat guard", Profile("default-guard", lethe_head, replace(default, repeat_guard=0))),
        ("paper + repeat guard 3", Profile("paper+guard", paper_head, replace(paper, repeat_guard=3))),
    ]


def quality_table(lm, reference, forget: list[dict], retain: list[dict], cfg: EvalConfig | None = None,
                  log=print) -> list[tuple[str, dict]]:
    cfg = cfg or EvalConfig()
    vocab = corpus_vocabulary(forget + retain)
    # the rows decode with the presets (head_gate 0), so the heads are not calibrated for one (gate_answers 0)
    as_published = FitConfig(common_df=1.0, fact_spans=False, balance=False, gate_answers=0,  # every position
                             cache_precision="model")  # the model's own dtype, as the published code runs it
    paper_head, _ = train_head(lm, forget, retain, as_published, progress=False)
    lethe_head, _ = train_head(lm, forget, retain, FitConfig(gate_answers=0), progress=False)
    ref_trs = truth_ratios(reference.model, reference.tokenizer, forget, Profile("reference"))
    rows = [("full model", evaluate(lm, forget, retain, Profile("full"), reference, vocab, cfg, ref_trs)),
            ("reference (retain-only model)", evaluate(reference, forget, retain, Profile("reference"), reference,
                                                       vocab, cfg, ref_trs))]
    log(markdown_row(*rows[0]))
    log(markdown_row(*rows[1]))
    for label, profile in variants(paper_head, lethe_head):
        rows.append((label, evaluate(lm, forget, retain, profile, reference, vocab, cfg, ref_trs)))
        log(markdown_row(*rows[-1]))
    return rows


def _header(columns) -> str:
    return "| profile | " + " | ".join(c[2] for c in columns) + " |\n|---" + "|---:" * len(columns) + "|"


def _row(label: str, report: dict, columns, short) -> str:
    """One table line: each column's value from the report (`-` if absent), `short(key, value)` picking .3g."""
    cells = []
    for section, key, _ in columns:
        v = (report.get(section) or {}).get(key) if section else report.get(key)
        cells.append("-" if v is None else f"{v:.3g}" if short(key, v) else f"{v:.3f}")
    return f"| {label} | " + " | ".join(cells) + " |"


def markdown_header() -> str:
    return _header(COLUMNS)


def markdown_row(label: str, report: dict) -> str:
    return _row(label, report, COLUMNS, lambda key, v: key == "forget_quality" and v < 0.001)


def asu_table(lm, reference, forget: list[dict], retain: list[dict], taus=(4.0, 16.0), cfg: EvalConfig | None = None,
              log=print, preset: str | None = "lethe") -> list[tuple[str, dict]]:
    """Full model, reference, T3 default, ASU at each tau (the minimal preset's other settings), ASU (last tau) + T3,
    and ASU with a preset's defaults (`heads.asu.presets`; None: not): with training times."""
    import time
    from dataclasses import replace as dc_replace

    from lethe.heads.asu.distill import ASUConfig, train_asu
    from lethe.heads.asu.presets import configure
    from lethe.heads.asu.weights import attach, default_repeat_guard, unload

    cfg = cfg or EvalConfig()
    vocab = corpus_vocabulary(forget + retain)
    ref_trs = truth_ratios(reference.model, reference.tokenizer, forget, Profile("reference"))
    started = time.perf_counter()
    head, _ = train_head(lm, forget, retain, FitConfig(gate_answers=0), progress=False)  # decoded with a preset
    t3_seconds = time.perf_counter() - started
    rows = []

    def add(label, model_lm, profile, seconds):
        report = evaluate(model_lm, forget, retain, profile, reference, vocab, cfg, ref_trs)
        report["training_seconds"] = None if seconds is None else round(seconds, 1)
        rows.append((label, report))
        log(asu_row(label, report))

    add("full model", lm, Profile("full"), None)
    add("reference (retain-only model)", reference, Profile("reference"), None)
    add("T3 default", lm, Profile("t3", head, PRESETS["default"]), t3_seconds)
    trained = [train_asu(lm, forget, retain, ASUConfig(tau=tau), progress=False) for tau in taus]  # on the clean base
    if preset:  # the job's defaults: the teacher's pick and the preset's settings (heads.asu.presets)
        said = {}  # greedy answers the teacher decodes, which training reuses
        asu_cfg, _ = configure(lm, forget, {}, preset, memo=said)
        trained.append(train_asu(lm, forget, retain, asu_cfg, progress=False, memo=said))
    model = lm.model
    for i, (tensors, info) in enumerate(trained):
        name = f"asu_{i}"
        model = attach(model, name, tensors, info)
        model.set_adapter(name)
        label = f"ASU tau={info.tau:g} ({info.steps} steps)" if i < len(taus) else \
            f"ASU preset {preset} (tau={info.tau:g}{', gated' if info.gate else ''}, {info.steps} steps)"
        add(label, dc_replace(lm, model=model), Profile(name, adapter=name, repeat_guard=default_repeat_guard(info)),
            info.metrics["seconds"])
        if i == len(taus) - 1:
            add(f"ASU tau={taus[-1]:g} + T3 default", dc_replace(lm, model=model),
                Profile("asu+t3", head, PRESETS["default"], adapter=name), info.metrics["seconds"] + t3_seconds)
    unload(model)
    return rows


ASU_COLUMNS = [("forget", "rouge", "forget ROUGE"), ("retain", "rouge", "retain ROUGE"),
               ("forget", "rouge_paraphrased", "forget ROUGE para."), ("forget", "nonword_rate", "non-words"),
               ("forget", "repeated_3gram_rate", "rep. 3-grams"), (None, "forget_quality", "forget quality"),
               (None, "training_seconds", "training s")]


def asu_header() -> str:
    return _header(ASU_COLUMNS)


def asu_row(label: str, report: dict) -> str:
    return _row(label, report, ASU_COLUMNS, lambda key, v: key in ("forget_quality", "training_seconds"))
