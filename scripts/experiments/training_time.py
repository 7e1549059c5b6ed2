"""Issue 24: head training time, whole-context mean without fact forms against the defaults (window 16, fact forms).
Run: .venv/bin/python scripts/experiments/training_time.py demo|real (demo: median of 3; real: one each)."""
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
for name, cfg in (("whole context, no fact forms", FitConfig(pooling_window=0, answer_forms=False)),
                  ("window 16, fact forms (default)", FitConfig())):
    times = []
    for _ in range(reps):
        t = time.perf_counter(); _, info = train_head(lm, forget, retain, cfg, progress=False); times.append(time.perf_counter() - t)
    out[name] = {"seconds": round(statistics.median(times), 2), "positions": info.metrics["positions"],
                 "cache_s": info.metrics["cache_seconds"]}
    print(which, name, out[name], flush=True)
print(which, "ratio", round(out["window 16, fact forms (default)"]["seconds"] / out["whole context, no fact forms"]["seconds"], 2))
