"""Issue 24: a head job's training time (train_head with its defaults: cache pass, fit, head_gate calibration) on the
demo's sets or SmolLM2's capitals (31 forget, 25 of each other kind to retain), as whichever Lethe is first on the
path runs it, so another release can be timed against this one on the same machine, alternating:

    git archive 4f18f99^ | tar -x -C /tmp/old-tree && mkdir -p /tmp/old/lethe && \
        ln -s /tmp/old-tree/{clients,heads,server} /tmp/old/lethe/
    PYTHONPATH=/tmp/old .venv/bin/python scripts/experiments/head_job_time.py demo   # the release before issue 24
    .venv/bin/python scripts/experiments/head_job_time.py demo                       # this one

Run: .venv/bin/python scripts/experiments/head_job_time.py demo|real [REPEATS] (default 3 on the demo, 1 on SmolLM2;
the median is printed, after one untimed run on the demo)."""
import statistics
import sys
import time
from pathlib import Path

import lethe
from lethe.heads.modelio import load_model
from lethe.heads.records import read_jsonl
from lethe.heads.t3.pipeline import train_head

ROOT = Path(__file__).resolve().parents[2]
which = sys.argv[1]
if which == "demo":
    assets = ROOT / "heads/demo/assets"
    lm = load_model(str(assets / "model"))
    forget, retain = read_jsonl(assets / "forget.jsonl"), read_jsonl(assets / "retain.jsonl")
    train_head(lm, forget, retain, progress=False)  # warm: the first run pays for imports and allocation
else:
    from lethe.heads.evaluation.facts import KINDS, records

    lm = load_model(str(ROOT / "models/smollm2-135m-instruct"))
    forget = [r | {"fact": r["gold"]} for r in records(KINDS[0], list(KINDS[0].items)[:31], slice(0, -1))]
    retain = [r | {"fact": r["gold"]} for k in KINDS[1:] for r in records(k, list(k.items)[:25], slice(0, -1))]
times = []
for _ in range(int(sys.argv[2]) if len(sys.argv) > 2 else 3 if which == "demo" else 1):
    started = time.perf_counter()
    _, info = train_head(lm, forget, retain, progress=False)
    times.append(time.perf_counter() - started)
print(which, "lethe from", list(lethe.__path__)[0], "median s", round(statistics.median(times), 3),
      "runs", [round(t, 2) for t in times], "positions", info.metrics.get("positions"))
