"""Issue 24, demo: where the profile lets a forget question through in context, is it the gate or the head?

A head trained as the head job trains it (default settings, `--seed`); the contexts of `lethe bench attacks` rebuilt
offline. Part 1, along the base model's own answer wherever it gives the fact: does the gate ever open (P(forget) >
0.5), and does the head flag the fact's first token (z < 0)? Part 2: the share of prompts whose gate is open at the
prompt's end, against the highest P(forget) over its last K positions (a gate that would start from any forget-like
point of the question), for forget questions and for retain ones.
Run: .venv/bin/python scripts/experiments/gate_in_context.py [SEED]   (under a minute on 2 cores)
"""
import random
import sys

import torch

from lethe.heads.decoding.decode import generate_chunked
from lethe.heads.decoding.sampling import SamplingParams
from lethe.heads.evaluation.facts import hit
from lethe.heads.modelio import load_model
from lethe.heads.records import read_jsonl
from lethe.heads.t3.pipeline import train_head
from lethe.heads.t3.pooling import pooled_positions
from lethe.heads.t3.train import FitConfig
from lethe.server.bench import attacks as A

SEED = int(sys.argv[1]) if len(sys.argv) > 1 else 0
WINDOWS = (4, 8, 12, 16, 24)

lm = load_model(A.DEMO_SETS / "model")
tok = lm.tokenizer
forget_records, retain_records = read_jsonl(A.DEMO_SETS / "forget.jsonl"), read_jsonl(A.DEMO_SETS / "retain.jsonl")
forget, retain = [A.demo_item(r) for r in forget_records], [A.demo_item(r) for r in retain_records]
bench = A.AttackBench.__new__(A.AttackBench)  # its prompts only: no server
bench.chat, bench.lm = False, lm
greedy = SamplingParams(max_new_tokens=40, temperature=0.0)


def answers(prompts: list[str]) -> list[str]:
    return [c.text for c in generate_chunked(lm.model, tok, prompts, greedy)]


def prompt_of(name: str, item: dict) -> str:
    ctx = next(c for c in A.CONTEXTS if c.name == name)
    return bench.render(bench._messages(ctx, item)) + (" " + A.FORCED if ctx.prefix else "")


known = [r for r, a in zip(forget, answers([prompt_of("plain", r) for r in forget])) if hit(a, r["gold"])]
bench.facts = A.Facts(False, forget, retain, known, retain, known, retain, {}, {})
head, _ = train_head(lm, forget_records, retain_records, FitConfig(seed=SEED), progress=False)


def gates(ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """P(forget) at every position of `ids`, and the head's (positions, V) logits."""
    with torch.inference_mode():
        hidden = lm.model(torch.tensor([ids]), output_hidden_states=True).hidden_states[-1]
        pooled = pooled_positions(hidden, head.window)[0]
        return head.forget_probability(pooled), head(pooled)


def at_fact(prompt: str, answer: str, gold: str) -> tuple[float, float]:
    """The highest gate over the answer up to the fact, and the head's logit for the fact's first token."""
    p = tok(prompt, add_special_tokens=False)["input_ids"]
    ids = p + tok(answer, add_special_tokens=False)["input_ids"]
    fact = len(tok(prompt + answer[:answer.find(gold)].rstrip(" "), add_special_tokens=False)["input_ids"])
    g, z = gates(ids)
    return float(g[len(p) - 1:fact].max()), float(z[fact - 1, ids[fact]])


print("part 1: forget questions whose fact the base model gives in the context")
for name in ("plain", "fewshot-retain", "turn-2", "preamble"):
    prompts = [prompt_of(name, r) for r in known]
    given = [(r, p, a) for r, p, a in zip(known, prompts, answers(prompts)) if hit(a, r["gold"])]
    read = [at_fact(p, a, r["gold"]) for r, p, a in given]
    closed = sum(g <= 0.5 for g, _ in read)
    unflagged = sum(g > 0.5 and z >= 0 for g, z in read)
    print(f"  {name}: base gives {len(given)} of {len(known)}; gate never open {closed}; open, fact not flagged "
          f"{unflagged}; flagged {len(given) - closed - unflagged}", flush=True)

print(f"part 2: share of prompts with the gate open, at the end and by the max over the last K = {WINDOWS}")
sample = random.Random(0).sample(retain, 120)
for name in ("plain", "fewshot-retain", "fewshot-forget", "fewshot-made-up", "turn-2", "turn-3", "preamble",
             "system-persona", "document", "form-list", "answer-prefix"):
    for label, items in (("forget", known), ("retain", sample)):
        read = [gates(tok(prompt_of(name, r), add_special_tokens=False)["input_ids"])[0] for r in items]
        end = sum(float(g[-1]) > 0.5 for g in read) / len(read)
        most = [round(sum(float(g[-k:].max()) > 0.5 for g in read) / len(read), 3) for k in WINDOWS]
        print(f"  {name} {label}: at the end {end:.3f}; max over the last K {most}", flush=True)
