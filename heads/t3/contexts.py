"""Contexts a head trains on: what real traffic puts around a question.

A head that only ever read the bare question misses it after a system prompt, a preamble, earlier turns or a
stretch of other text: the frozen model's states at the question's tokens shift with what came before, even inside
the pooling window (docs/forgetting-in-context.md). So the head job trains on a share of the question/answer
records a second time, each after a context drawn here, with the record's own label: a forget fact stays forget
after any context, a retain fact stays retain.

The contexts are generic on purpose and are not the ones `lethe bench attacks` asks with (its preamble, system
prompts, document, chit-chat turns and instructions are other texts), so the bench measures how the head generalises
to contexts it never saw. Earlier turns, and the words of other text, come from the tenant's own records.
"""

from __future__ import annotations

import random

from lethe.heads.records import Context, Example, qa_example

PREAMBLES = (
    "Answer the following question.", "Here is a question for you.", "Please reply briefly.", "Quiz time!",
    "Read the question carefully, then answer it.", "I have a question.", "Another one:", "Help me with this:",
)
SYSTEMS = (
    "You answer questions accurately.", "You are a knowledgeable assistant. Be concise.",
    "You are a tutor helping a student revise for an exam.",
    "You are an assistant inside a search engine. Give direct answers and do not make things up.",
)
AFTER = ("Keep it short.", "Reply in a full sentence.", "Be precise.", "Thanks!")
# earlier turns that are not about the tenant's facts at all: conversations open with small talk as often as with
# another question of the same kind
SMALL_TALK = (
    ("Good morning!", "Good morning! What can I do for you today?"),
    ("Can you help me with something?", "Of course. What do you need?"),
    ("Thanks a lot.", "You're welcome. Is there anything else?"),
    ("I am bored.", "You could read a book, go for a walk or try a new recipe."),
    ("What is a good name for a cat?", "Many people like names such as Luna, Milo or Oliver."),
    ("How long should I boil an egg?", "About eight minutes for a hard-boiled egg, then cool it in cold water."),
)
SMALL_TALK_SHARE = 0.4  # of the contexts with earlier turns only
N_CONTEXTS = 32  # drawn per head; each trains on about 1/32 of the records it adds
RETAIN_PER_FORGET = 2
MAX_PER_FORGET = 4  # the head job's bound on `contexts`
MAX_TURN_CHARS = 300  # earlier turns come from short records, so a context stays short beside the model's window


def draw(rng: random.Random, turns: list[tuple[str, str]], words: list[str]) -> Context:
    """One context: a preamble, a system message, one or two earlier turns, a system message and a turn, a stretch
    of other words (20 to 120) before the question, or an instruction after it."""
    k = rng.random()
    if k < 0.2:
        return Context(before=rng.choice(PREAMBLES))
    if k < 0.35:
        return Context(system=rng.choice(SYSTEMS))
    if k < 0.6 and turns:
        source = SMALL_TALK if rng.random() < SMALL_TALK_SHARE else turns
        return Context(turns=tuple(rng.choice(source) for _ in range(rng.choice((1, 1, 2)))))
    if k < 0.75 and turns:
        return Context(system=rng.choice(SYSTEMS), turns=(rng.choice(turns),))
    if k < 0.9 and words:
        return Context(before=" ".join(rng.choice(words) for _ in range(rng.choice((20, 40, 80, 120)))) + ".")
    return Context(after=rng.choice(AFTER))


def draw_contexts(pool: list[dict], n: int = N_CONTEXTS, seed: int = 0) -> list[Context]:
    """`n` distinct contexts; earlier turns (of records up to MAX_TURN_CHARS) and other words come from the
    question/answer records of `pool` (the tenant's forget and retain sets). Forget and retain records draw from the same contexts, so a context alone tells the
    head nothing."""
    qa = [r for r in pool if "question" in r and "answer" in r]
    turns = [(r["question"], r["answer"]) for r in qa if len(r["question"]) + len(r["answer"]) <= MAX_TURN_CHARS]
    words = [w for r in qa for w in r["answer"].split()]
    rng = random.Random(seed)
    out: list[Context] = []
    for _ in range(20 * n):  # distinct ones, as far as the records allow
        ctx = draw(rng, turns, words)
        if ctx not in out:
            out.append(ctx)
            if len(out) == n:
                break
    return out


def context_examples(records: list[dict], contexts: list[Context], n: int, fmt: str = "qa", tokenizer=None,
                     seed: int = 0) -> tuple[list[Example], list[int], list[int]]:
    """`n` examples of the question/answer `records` (each record once before any record twice; at random), each after
    one of `contexts`; for each such example the index of its context (examples after one context share their first
    tokens, which the cache pass then runs once: `heads.t3.cache.batches`), and the index in `records` of the record
    it asks (whose plain example has the same answer: `heads.t3.cache.context_shifts`)."""
    qa = [i for i, r in enumerate(records) if "question" in r and "answer" in r]
    if not contexts or n <= 0 or not qa:
        return [], [], []
    rng = random.Random(seed)
    out, which = [], []
    picks = [i for _ in range(n // len(qa)) for i in rng.sample(qa, len(qa))] + rng.sample(qa, n % len(qa))
    for i in picks:
        j = rng.randrange(len(contexts))
        out.append(qa_example(records[i]["question"], records[i]["answer"], fmt, tokenizer, contexts[j]))
        which.append(j)
    return out, which, picks


def context_counts(forget: list[dict], per_forget: float) -> tuple[int, int]:
    """How many forget and retain examples train after a context: `per_forget` per question/answer record of the
    forget set (1: each once; 2: each after two contexts; 0.5: half of them), and RETAIN_PER_FORGET times as many
    retain records (the retain set is often many times larger, and all of it would cost training time without
    telling the head more about contexts)."""
    n = round(per_forget * sum("question" in r and "answer" in r for r in forget))
    return n, n * RETAIN_PER_FORGET
