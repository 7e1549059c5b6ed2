"""`lethe bench t3-quality`: the quality table — full model, reference, `paper`, default, and each
of Lethe's improvements on its own (added to `paper`) and taken away (from the default).

Two heads are trained: the reference recipe (every answer position, classes unweighted) and
Lethe's (ordinary-language forget tokens left out, classes balanced).
"""

from __future__ import annotations

from dataclasses import replace

from heads.evaluate import EvalConfig, Profile, corpus_vocabulary, evaluate, truth_ratios
from heads.guide import PRESETS
from heads.t3 import train_head
from heads.train import FitConfig

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
    ]


def quality_table(lm, reference, forget: list[dict], retain: list[dict], cfg: EvalConfig | None = None,
                  log=print) -> list[tuple[str, dict]]:
    cfg = cfg or EvalConfig()
    vocab = corpus_vocabulary(forget + retain)
    paper_head, _ = train_head(lm, forget, retain, FitConfig(common_df=1.0, balance=False), progress=False)
    lethe_head, _ = train_head(lm, forget, retain, FitConfig(), progress=False)
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


def markdown_header() -> str:
    return "| profile | " + " | ".join(c[2] for c in COLUMNS) + " |\n|---" + "|---:" * len(COLUMNS) + "|"


def markdown_row(label: str, report: dict) -> str:
    cells = []
    for section, key, _ in COLUMNS:
        v = (report.get(section) or {}).get(key) if section else report.get(key)
        cells.append("-" if v is None else (f"{v:.3g}" if key == "forget_quality" and v < 0.001 else f"{v:.3f}"))
    return f"| {label} | " + " | ".join(cells) + " |"
