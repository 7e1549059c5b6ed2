"""Session 35: the demo's forget quality (the KS p-value of the forget set's truth ratios against the retain-only
model's, as `lethe bench t3-quality` reads it) for the default profile, with heads trained without one of issue 24's
additions at a time (answer forms, contexts, window pooling), at several tempering values T, and without the cap.

Run: .venv/bin/python scripts/experiments/forget_quality_ablation.py [T ...]   (default: 1 2; about a minute)

Prints, per head and setting, the forget quality and the truth ratios' quartiles (p_wrong / p_correct per record:
above 1, the profile makes the true answer less likely than the perturbed ones)."""
import statistics
import sys
from dataclasses import replace

from scipy.stats import ks_2samp

from lethe.heads.evaluation.evaluate import Profile, truth_ratios
from lethe.heads.modelio import load_model
from lethe.heads.records import read_jsonl
from lethe.heads.t3.guide import PRESETS
from lethe.heads.t3.pipeline import train_head
from lethe.heads.t3.train import FitConfig

ASSETS = "heads/demo/assets"
HEADS = {"today's": {}, "no answer forms": {"answer_forms": False}, "no contexts": {"contexts": 0},
         "whole-context pooling": {"pooling_window": 0},
         "none of the three": {"answer_forms": False, "contexts": 0, "pooling_window": 0}}


def main(temperatures: list[float]) -> None:
    lm, ref = load_model(f"{ASSETS}/model"), load_model(f"{ASSETS}/retain_model")
    forget, retain = read_jsonl(f"{ASSETS}/forget.jsonl"), read_jsonl(f"{ASSETS}/retain.jsonl")
    reference = truth_ratios(ref.model, ref.tokenizer, forget, Profile("reference"))

    def show(name: str, trs: list[float]) -> None:
        q = statistics.quantiles(trs, n=4)
        print(f"{name:40} forget quality {ks_2samp(trs, reference).pvalue:.3g}  "
              f"TR quartiles {q[0]:.3f} {q[1]:.3f} {q[2]:.3f}", flush=True)

    show("reference (retain-only model)", reference)
    show("full model", truth_ratios(lm.model, lm.tokenizer, forget, Profile("full")))
    for name, changes in HEADS.items():
        head, _ = train_head(lm, forget, retain, FitConfig(gate_answers=0, **changes), progress=False)
        settings = [(f"T={t}", replace(PRESETS["default"], T=t)) for t in temperatures]
        for label, s in settings + [("no cap", replace(PRESETS["default"], cap=None))]:
            show(f"{name} head, {label}", truth_ratios(lm.model, lm.tokenizer, forget, Profile(label, head, s)))


if __name__ == "__main__":
    main([float(t) for t in sys.argv[1:]] or [1.0, 2.0])
