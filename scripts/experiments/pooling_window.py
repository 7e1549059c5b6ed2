"""Issue 24 experiment (demo model): pool the last layer's states over a window of the last W tokens instead of
the whole context, in the cache the head trains on and at decoding (an unbatched greedy loop with the whole-vocabulary
tilt), and count gold hits in held-out contexts. Run: .venv/bin/python scripts/experiments/pooling_window.py 8 16
(about 6 min on 2 cores). Numbers: docs/forgetting-in-context.md."""
import json, random, time, sys
import torch
torch.set_num_threads(1)
from lethe.heads.modelio import load_model
from lethe.server.settings import DEMO_MODEL
from lethe.heads.records import read_jsonl, question_prompt, Example, encode_example
from lethe.heads.t3.cache import PooledCache
from lethe.heads.t3.train import FitConfig, fit_head
from lethe.heads.t3.guide import PRESETS, whole_vocabulary
from lethe.heads.decoding.decode import forward_last_hidden
from pathlib import Path
import numpy as np

A = Path(DEMO_MODEL).parent
lm = load_model(DEMO_MODEL); model, tok = lm.model, lm.tokenizer
forget = read_jsonl(A / "forget.jsonl"); retain = read_jsonl(A / "retain.jsonl")
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
    "long text": lambda r, i: LONG,
}
def pool(hidden, W):  # hidden (T, d) -> (T, d) pooled at each position
    cs = hidden.cumsum(0)
    n = torch.arange(1, len(hidden) + 1)[:, None].float()
    if W is None: return cs / n
    shifted = torch.cat([torch.zeros(W, hidden.size(1)), cs[:-W]]) if len(hidden) > W else torch.zeros_like(cs)
    return (cs - shifted) / n.clamp(max=W)

@torch.inference_mode()
def hidden_of(ids):
    t = torch.tensor([ids]); m = torch.ones_like(t); pos = torch.arange(len(ids))[None]
    return forward_last_hidden(model, t, m, pos, None)[0].float()

@torch.inference_mode()
def cache(forget_ex, retain_ex, W):
    P, T, L, R = [], [], [], []
    for label, exs in ((0, forget_ex), (1, retain_ex)):
        for ex in exs:
            ids, npr = encode_example(tok, ex)
            h = pool(hidden_of(ids), W)
            P.append(h[npr - 1:len(ids) - 1].half()); T.append(torch.tensor(ids[npr:])); L.append(torch.full((len(ids) - npr,), float(label))); R.append(torch.full((len(ids) - npr,), len(R)))
    return PooledCache(torch.cat(P), torch.cat(T), torch.cat(L), torch.cat(R).long(), len(forget_ex), len(retain_ex))

@torch.inference_mode()
def greedy(prompt, head, W, n=24):
    ids = tok(prompt, add_special_tokens=False)["input_ids"]
    out = []
    for _ in range(n):
        h = hidden_of(ids)
        logits = model.lm_head(h[-1:])
        if head is not None:
            pooled = pool(h, W)[-1:]
            logits = whole_vocabulary(head, PRESETS["default"], logits, pooled)
        t = int(logits.argmax(-1)[0])
        if t == tok.eos_token_id: break
        ids.append(t); out.append(t)
    return tok.decode(out)

plain = [Example(question_prompt(r["question"]), " " + r["answer"]) for r in forget], [Example(question_prompt(r["question"]), " " + r["answer"]) for r in retain]
base_plain = [greedy(question_prompt(r["question"]), None, None) for r in forget]
known = [r for r, t in zip(forget, base_plain) if fact(r) in t][:40]
ret_sample = retain[::12][:40]
base_cache = {}
def measure(head, W, label):
    row = {}
    for name, ctx in TEST.items():
        outs = [greedy(ctx(r, i) + question_prompt(r["question"]), head, W) for i, r in enumerate(known)]
        row[name] = sum(fact(r) in t for r, t in zip(known, outs))
    same = {}
    for name in ("plain", "2 retain QA", "long text"):
        ctx = TEST[name]
        p = [ctx(r, i + 3) + question_prompt(r["question"]) for i, r in enumerate(ret_sample)]
        b = base_cache.setdefault(name, [greedy(x, None, None) for x in p])
        same[name] = round(sum(x == greedy(y, head, W) for x, y in zip(b, p)) / len(p), 3)
    print(label, json.dumps(row), "retain same", json.dumps(same), flush=True)

for W in [None] + [int(x) for x in sys.argv[1:]]:
    t = time.time()
    c = cache(*plain, W)
    head, m = fit_head(c, model.config.vocab_size, FitConfig(), progress=False)
    print("W", W, "train s", round(time.time() - t, 1), "auc", m.get("heldout_auc"), flush=True)
    measure(head, W, f"W={W}")
