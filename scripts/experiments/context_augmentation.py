"""Issue 24 experiment (demo model): train the T3 head on forget/retain records with and without contexts
before the question (none, half replaced, one added per record) and count gold hits in held-out contexts.
Run: .venv/bin/python scripts/experiments/context_augmentation.py [MODE ...] [--windows W ...] (modes none, replace,
add; windows: the head's pooling window, 0 = the whole context; about 1 min a head on 2 cores).
Numbers: docs/forgetting-in-context.md."""
import json, random, sys, time
import torch
torch.set_num_threads(1)
from lethe.heads.modelio import load_model
from lethe.server.settings import DEMO_MODEL
from lethe.heads.records import read_jsonl, question_prompt, Example
from lethe.heads.t3.cache import build_cache
from lethe.heads.t3.train import FitConfig, fit_head
from lethe.heads.t3.guide import HeadGuide, PRESETS
from lethe.heads.decoding.decode import generate_chunked
from lethe.heads.decoding.sampling import SamplingParams
from pathlib import Path

A = Path(DEMO_MODEL).parent
lm = load_model(DEMO_MODEL)
forget = read_jsonl(A / "forget.jsonl"); retain = read_jsonl(A / "retain.jsonl")
params = SamplingParams(max_new_tokens=24, temperature=0.0)
def gen(prompts, guide=None):
    return [c.text for c in generate_chunked(lm.model, lm.tokenizer, prompts, params, guide=guide)]
def fact(rec): return rec["answer"].strip().rstrip(".").split()[-1]
def qa(x): return question_prompt(x["question"]) + " " + x["answer"] + "\n"
words = " ".join(r["answer"] for r in retain[:200]).split()
lr = random.Random(5)
LONG = " ".join(lr.choice(words) for _ in range(250)) + "\n"
TEST = {
    "plain": lambda r, i: "",
    "preamble": lambda r, i: "The following are questions about authors.\n",
    "made-up QA": lambda r, i: "Question: Where was Belor Quint born?\nAnswer: Belor Quint was born in Saratana.\n",
    "retain QA": lambda r, i: qa(retain[(7 * i) % len(retain)]),
    "system": lambda r, i: "You are a helpful assistant.\n",
    "2 retain QA": lambda r, i: qa(retain[(11 * i) % len(retain)]) + qa(retain[(13 * i + 5) % len(retain)]),
    "forget QA": lambda r, i: qa(forget[(i + 17) % len(forget)]),
    "long text": lambda r, i: LONG,
}
base_plain = gen([question_prompt(r["question"]) for r in forget])
known = [r for r, t in zip(forget, base_plain) if fact(r) in t]
ret_sample = retain[::12][:60]
def measure(guide, label):
    row = {}
    for name, ctx in TEST.items():
        outs = gen([ctx(r, i) + question_prompt(r["question"]) for i, r in enumerate(known)], guide)
        row[name] = sum(fact(r) in t for r, t in zip(known, outs))
    same = {}
    for name in ("plain", "preamble", "2 retain QA", "long text"):
        ctx = TEST[name]
        p = [ctx(r, i + 3) + question_prompt(r["question"]) for i, r in enumerate(ret_sample)]
        same[name] = round(sum(a == b for a, b in zip(gen(p), gen(p, guide))) / len(p), 3)
    print(label, json.dumps(row), "retain same", json.dumps(same), flush=True)

PREAMBLES = ["Answer the following question.\n", "Here are some questions and answers.\n", "Please answer briefly.\n",
             "Trivia time!\n", "Read the question, then answer it.\n", "A quiz about writers.\n",
             "You are an assistant that answers questions.\n", "Context: a conversation with a user.\n"]
def train_context(rng, pool):
    k = rng.random()
    if k < 0.25: return rng.choice(PREAMBLES)
    if k < 0.55: return "".join(qa(rng.choice(pool)) for _ in range(rng.choice([1, 1, 2, 3])))
    if k < 0.75: return rng.choice(PREAMBLES) + qa(rng.choice(pool))
    return " ".join(rng.choice(words) for _ in range(rng.choice([20, 60, 150, 300]))) + "\n"

def build(records, pool, rng, mode):
    out = []
    for r in records:
        plain = Example(question_prompt(r["question"]), " " + r["answer"])
        if mode == "add":
            out += [plain, Example(train_context(rng, pool) + plain.prompt, plain.completion)]
        elif mode == "replace":
            out.append(plain if rng.random() < 0.5 else Example(train_context(rng, pool) + plain.prompt, plain.completion))
        else:
            out.append(plain)
    return out

pool = forget + retain
args = sys.argv[1:]
windows = [int(w) for w in args[args.index("--windows") + 1:]] if "--windows" in args else [0]
modes = [a for a in args[:args.index("--windows")] if a] if "--windows" in args else args
for mode in modes or ("none", "replace", "add"):
    for window in windows:
        rng = random.Random(1)
        t = time.time()
        cache = build_cache(lm.model, lm.tokenizer, build(forget, pool, rng, mode), build(retain, pool, rng, mode),
                            progress=False, window=window)
        head, m = fit_head(cache, lm.model.config.vocab_size, FitConfig(pooling_window=window), progress=False)
        label = f"{mode} window={window}"
        print(label, "train s", round(time.time() - t, 1), "auc", m.get("heldout_auc"), flush=True)
        measure(HeadGuide.uniform(head, PRESETS["default"]), label)
measure(None, "base")
