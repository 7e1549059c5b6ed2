"""Issue 24: head training time, whole-context mean without fact forms (the release before issue 24) against the
defaults (window 16, fact forms, contexts, the head_gate calibration) and variants, each as a ratio to the first.
Run: .venv/bin/python scripts/experiments/training_time.py demo|real [CONTEXTS_SHARE ...]
(demo: median of 3; real: one each; shares: the `contexts` of extra runs, default none)."""
import sys, time, json, statistics
import torch
from lethe.heads.modelio import load_model
from lethe.heads.t3.pipeline import train_head
from lethe.heads.t3.train import FitConfig
from lethe.heads.records import read_jsonl
from lethe.heads.evaluation.facts import KINDS, records
from lethe.server.settings import DEMO_MODEL
from pathlib import Path
which = sys.argv[1]
if which == "demo":
    lm = load_model(DEMO_MODEL); A = Path(DEMO_MODEL).parent
    forget, retain = read_jsonl(A / "forget.jsonl"), read_jsonl(A / "retain.jsonl")
    reps = 3
else:
    lm = load_model("models/smollm2-135m-instruct")
    forget = [r | {"fact": r["gold"]} for r in records(KINDS[0], list(KINDS[0].items)[:31], slice(0, -1))]
    retain = [r | {"fact": r["gold"]} for k in KINDS[1:] for r in records(k, list(k.items)[:25], slice(0, -1))]
    reps = 1
out = {}
import lethe.heads.t3.pipeline as pipeline
shared_cache = pipeline.build_cache
def unshared_cache(*args, groups=None, **kwargs):  # the release before: no shared first tokens
    return shared_cache(*args, **kwargs)
runs = [("the release before: whole context, no fact forms, no shared prefixes",
         FitConfig(pooling_window=0, answer_forms=False, contexts=0, gate_answers=0, cache_precision="model")),
        ("window 16, fact forms, no contexts", FitConfig(contexts=0, gate_answers=0)),
        ("default but no head_gate calibration", FitConfig(gate_answers=0)), ("default", FitConfig())]
runs += [(f"contexts {share}", FitConfig(contexts=float(share))) for share in sys.argv[2:]]
for name, cfg in runs:
    times = []
    pipeline.build_cache = unshared_cache if name.startswith("the release before") else shared_cache
    for _ in range(reps):
        t = time.perf_counter(); _, info = train_head(lm, forget, retain, cfg, progress=False); times.append(time.perf_counter() - t)
    out[name] = {"seconds": round(statistics.median(times), 2), "positions": info.metrics["positions"],
                 "cache_s": info.metrics["cache_seconds"]}
    print(which, name, out[name], flush=True)
first = out[runs[0][0]]["seconds"]
print(which, "ratios to the first:", {name: round(v["seconds"] / first, 2) for name, v in out.items()})
