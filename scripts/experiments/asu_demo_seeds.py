"""Issue 26: the spread of the demo's ASU tau=16 row over training seeds (the row `lethe bench asu-quality` prints,
with the minimal preset's other settings, evaluated as that bench evaluates it: greedy, no repeat guard).
Run: .venv/bin/python scripts/experiments/asu_demo_seeds.py SEED [SEED ...]   (about 80 s a seed on 2 cores)
Prints one JSON line per seed."""
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

from lethe.heads.asu.distill import ASUConfig, train_asu
from lethe.heads.asu.weights import attach
from lethe.heads.evaluation.evaluate import EvalConfig, Profile, corpus_vocabulary, evaluate, truth_ratios
from lethe.heads.modelio import load_model
from lethe.heads.records import read_jsonl
from lethe.server.settings import DEMO_MODEL

assets = Path(DEMO_MODEL).parent
lm, reference = load_model(DEMO_MODEL), load_model(assets / "retain_model")
forget, retain = read_jsonl(assets / "forget.jsonl"), read_jsonl(assets / "retain.jsonl")
vocab = corpus_vocabulary(forget + retain)
reference_ratios = truth_ratios(reference.model, reference.tokenizer, forget, Profile("reference"))
seeds = [int(s) for s in sys.argv[1:]] or [0]
started = time.perf_counter()
trained = [train_asu(lm, forget, retain, ASUConfig(tau=16.0, seed=seed), progress=False) for seed in seeds]  # base
model = lm.model
for seed, (tensors, info) in zip(seeds, trained):
    name = f"seed{seed}"
    model = attach(model, name, tensors, info)
    model.set_adapter(name)
    r = evaluate(replace(lm, model=model), forget, retain, Profile(name, adapter=name, repeat_guard=0), reference,
                 vocab, EvalConfig(), reference_ratios)
    print(json.dumps({"seed": seed, "forget_rouge": round(r["forget"]["rouge"], 3),
                      "retain_rouge": round(r["retain"]["rouge"], 3),
                      "forget_rouge_paraphrased": round(r["forget"]["rouge_paraphrased"], 3),
                      "repeated_3gram_rate": round(r["forget"]["repeated_3gram_rate"], 3),
                      "forget_quality": float(f"{r['forget_quality']:.3g}")}), flush=True)
print(f"{time.perf_counter() - started:.0f} s", file=sys.stderr)
