"""Issue 24, SmolLM2: where do the profile's non-words ("bratislál", "pizamal") come from, step by step?

The facts of `lethe bench attacks` rebuilt offline (known capitals forgotten, the other kinds retained), a head
trained as the head job trains it (saved to HEAD and reused on the next run), forget questions answered greedily
with the head's recommended profile in the plain, answer-prefix and few-shot contexts. For every answer with a
non-word (KnownWords, as the bench counts them), each step: the base model's likeliest token and its probability,
the head's logit for it, whether it continues a word, the gate, and the token chosen (TRACE=0: the answers only).
Variants, by environment: WHOLE_WORDS=0 (without `whole_words`, which the script turns on by default); NEUTRAL=1 (every
token the head leaves unflagged tilts alike: logsigmoid capped at log 1/2); STUBS=1 (the word guard also drops word
starts of one or two letters, a capital first); WORDS=1 (it drops every ASCII word start that is no known word of its
own); LOOKAHEAD=1 (the first whole-words trial: full forwards, every start; SHOW_ENDS=1 prints each start's
probability of ending its word).
Run: .venv/bin/python scripts/experiments/fragments.py [MODEL] [HEAD]   (about 4 minutes on 2 cores, 2.5 with HEAD)
"""
import math
import os
import sys
from itertools import zip_longest
from pathlib import Path

import torch

from lethe.heads.decoding import decode as D
from lethe.heads.decoding.repeats import word_classes
from lethe.heads.decoding.sampling import SamplingParams
from lethe.heads.evaluation.evaluate import words
from lethe.heads.evaluation.facts import KINDS, hit, records
from lethe.heads.evaluation.metrics import KnownWords
from lethe.heads.modelio import load_model
from lethe.heads.records import spread
from lethe.heads.t3.guide import HeadGuide, TiltSettings
from lethe.heads.t3.head import load_head, save_head
from lethe.heads.t3.pipeline import train_head
from lethe.heads.t3.train import FitConfig
from lethe.server.bench import attacks as A

MODEL = sys.argv[1] if len(sys.argv) > 1 else "models/smollm2-135m-instruct"
HEAD = Path(sys.argv[2] if len(sys.argv) > 2 else "/tmp/exp/fragments-head.lethe")
LIMIT = 20

lm = load_model(MODEL)
tok = lm.tokenizer
bench = A.AttackBench.__new__(A.AttackBench)  # its prompts only: no server
bench.chat, bench.lm = True, lm
greedy = SamplingParams(max_new_tokens=40, temperature=0.0)


def prompt_of(name: str, item: dict) -> str:
    ctx = next(c for c in A.CONTEXTS if c.name == name)
    return bench.render(bench._messages(ctx, item)) + (A.FORCED if ctx.prefix else "")


def answers(prompts: list[str], guide=None) -> list[str]:
    return [c.text.strip() for c in D.generate_chunked(lm.model, tok, prompts, greedy, guide=guide)]


plain = A.CONTEXTS[0]
known = {}
for k in KINDS:
    asked = records(k, list(k.items), slice(0, 1))
    got = answers([prompt_of("plain", r) for r in asked])
    known[k.name] = [r["subject"] for r, a in zip(asked, got) if hit(a, r["gold"])]
forget_kind, retain_kinds = KINDS[0], KINDS[1:]
forget_train = [r for r in records(forget_kind, known[forget_kind.name], slice(0, -1))]
retain_train = [r for k in retain_kinds for r in records(k, known[k.name], slice(0, -1))]
forget_pool = records(forget_kind, known[forget_kind.name], slice(0, 1))
retain_pool = [r for g in zip_longest(*(records(k, known[k.name], slice(0, 1)) for k in retain_kinds))
               for r in g if r is not None]
bench.facts = A.Facts(True, forget_train, retain_train, spread(forget_pool, LIMIT), spread(retain_pool, LIMIT),
                      forget_pool, retain_pool, {k.name: list(k.items.values()) for k in KINDS}, {})
if HEAD.exists():
    head, info = load_head(HEAD)
else:
    as_records = lambda items: [{"question": r["question"], "answer": r["answer"], "fact": r["gold"]}  # noqa: E731
                                for r in items]
    head, info = train_head(lm, as_records(forget_train), as_records(retain_train), FitConfig(), progress=False)
    save_head(HEAD, head, info)
settings = TiltSettings.from_dict(info.profile).replace(whole_words=os.environ.get("WHOLE_WORDS", "1") == "1")
print("profile:", settings)
vocab = KnownWords()
joins = word_classes(tok).joins

trace: list[list[tuple]] = []
original = D.Batch._guided


CURRENT: list[int] = []  # the prompt's ids, for the lookahead variant
LOOKAHEAD = os.environ.get("LOOKAHEAD") == "1"


def complete_word(scores, logits, z, answer: list[int]) -> None:
    """Variant: where the head flags the likeliest token, which starts a word, the unflagged word starts whose next
    token (under the base model) continues the word with probability > 0.5 are dropped, where one that ends it is
    left; the flagged tokens are held under the best remaining one minus the cap again."""
    top = int(logits.argmax())
    if not (z[top] < 0 and not joins[top]):
        return
    cands = [t for t in torch.isfinite(scores).nonzero()[:, 0].tolist() if z[t] >= 0 and not joins[t]]
    if not cands:
        return
    ids = torch.tensor([CURRENT + answer + [t] for t in cands])
    with torch.no_grad():
        nxt = torch.softmax(lm.model(ids).logits[:, -1].float(), -1)
    ends = (nxt * ~joins[: nxt.size(-1)]).sum(-1)
    if os.environ.get("SHOW_ENDS") == "1":
        print("   ends:", [(tok.decode([t]), round(float(scores[t]), 2), round(e, 2)) for t, e in zip(cands, ends.tolist())])
    if not (ends >= 0.5).any():
        return
    for t, e in zip(cands, ends.tolist()):
        if e < 0.5:
            scores[t] = float("-inf")
    free = [t for t in cands if torch.isfinite(scores[t])]
    limit = max(float(scores[t]) for t in free) - settings.cap
    flagged = (z < 0) & torch.isfinite(scores)
    scores[flagged] = scores[flagged].clamp(max=limit)


def traced(self, logits):
    scores = original(self, logits)
    pooled = self.pooled()
    if LOOKAHEAD:
        with torch.no_grad():
            zz = head(pooled)
        for i in range(len(logits)):
            complete_word(scores[i], logits[i], zz[i], self.rows[i].token_ids)
    with torch.no_grad():
        z = head(pooled)
        gate = head.forget_probability(pooled)
    p = torch.softmax(logits.float(), -1)
    top = logits.argmax(-1)
    chosen = scores.argmax(-1)
    for i in range(len(logits)):
        t, c = int(top[i]), int(chosen[i])
        trace[i].append((tok.decode([t]), round(float(p[i, t]), 3), round(float(z[i, t]), 1), bool(joins[t]),
                         round(float(gate[i]), 2), tok.decode([c]), round(float(p[i, c]), 3),
                         round(float(z[i, c]), 1), bool(joins[c])))
    return scores


D.Batch._guided = traced
if os.environ.get("NEUTRAL") == "1":  # variant: tokens the head leaves unflagged all tilt alike (no retain promotion)
    from lethe.heads.t3 import tilt as tilt_module

    class _F:
        @staticmethod
        def logsigmoid(z):
            return torch.nn.functional.logsigmoid(z).clamp(max=-math.log(2))
    tilt_module.F = _F
    os.environ["LETHE_FUSED_TILT"] = "0"
if os.environ.get("STUBS") == "1":  # variant: the word guard also drops word starts of one or two capital letters
    texts = tok.batch_decode([[i] for i in range(len(joins))], clean_up_tokenization_spaces=False)
    stubs = torch.tensor([t.startswith(" ") and 1 <= len(t.strip()) <= 2 and t.strip().isalpha() and t.strip()[0].isupper()
                          for t in texts])
    print("stubs:", int(stubs.sum()), [texts[i] for i in stubs.nonzero()[:30, 0].tolist()])
    D.Batch._hand_words = lambda self: self.guide.use_words(joins | stubs) if self.guide.wants_words() else None
if os.environ.get("WORDS") == "1":  # variant: the word guard also drops word starts that are no whole known word
    texts = tok.batch_decode([[i] for i in range(len(joins))], clean_up_tokenization_spaces=False)
    starts, lexicon = word_classes(tok).starts, KnownWords(languages=("fr", "de", "es"))

    def stub(i: int) -> bool:  # a word start of ASCII letters that is not a word of its own ("Br", "Sz", "Bar"?)
        w = texts[i].strip()
        return bool(starts[i]) and w.isascii() and w.isalpha() and not (
            (len(w) > 1 or w.lower() in ("a", "i")) and w in lexicon)
    stubs = torch.tensor([stub(i) for i in range(len(joins))])
    print("stubs:", int(stubs.sum()), "of", int(sum(map(bool, starts))), "starts;",
          [texts[i] for i in stubs.nonzero()[:40, 0].tolist()])
    D.Batch._hand_words = lambda self: self.guide.use_words(joins | stubs) if self.guide.wants_words() else None
guide = HeadGuide.uniform(head, settings)
show = os.environ.get("TRACE", "1") == "1"
for name in ("plain", "answer-prefix", "fewshot-retain"):
    bad = leaks = 0
    for item in bench.facts.forget:
        trace.clear()
        trace.append([])
        CURRENT[:] = tok(prompt_of(name, item), add_special_tokens=False)["input_ids"]
        text = answers([prompt_of(name, item)], guide)[0]
        nonwords = [w for w in words(text) if w not in vocab]
        leaks += hit(text, item["gold"])
        if not show:
            print(f"[{name}] {item['question']} -> {text!r}" + (f"; non-words {nonwords}" if nonwords else ""))
        if not nonwords:
            continue
        bad += 1
        if show:
            print(f"\n[{name}] {item['question']} -> {text!r}; non-words {nonwords}")
        for step in trace[0] if show else ():
            mark = "" if step[0] == step[5] else "  <-- tilted"
            print(f"   top {step[0]!r} p={step[1]} z={step[2]} joins={step[3]} gate={step[4]} | chose {step[5]!r} "
                  f"p={step[6]} z={step[7]} joins={step[8]}{mark}")
    print(f"== {name}: {bad} of {len(bench.facts.forget)} answers with a non-word; {leaks} give the gold", flush=True)
