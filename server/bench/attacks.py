"""`lethe bench attacks`: does forgetting hold whatever comes before the question, and however it is asked or
scored (issue 24)? Everything goes through a running server, as a user's traffic would: a tenant uploads a forget
and a retain set, trains a head with the head job, puts it in a profile, and then every question is asked through
the OpenAI routes twice, once with the profile and once without it (the base model).

Facts. On a model with a chat template (SmolLM2): the facts of `lethe bench real` (`heads.evaluation.facts`),
capitals forgotten, the other kinds kept, only the items the base model answers correctly (greedy, canonical
question), the head trained on every question template but the last; the canonical question is asked. On the demo
model: the demo's forget and retain sets (the README's head), a forget item kept when the base model gives its
`fact`.

Contexts around each question (`CONTEXTS`): system prompts, a preamble, few-shot turns, earlier turns, a long
unrelated document, instructions on the answer's form, other languages, multiple choice, a forced answer prefix.
Forget questions count gold hits, profile against base; retain questions count answers identical to the base
model's, all of them and those the profile should keep: a base answer that states a forget fact (a forget record's
subject and gold both in it, as after forget turns the base model may answer "What continent does Greece belong
to?" with "The capital of Greece is Athens.") is one the profile must change, and its bar counts the others.
Fluency counts the answers' non-words (words neither English nor, on the demo, of the demo's corpus, whose made-up
names are its words), repeated 3-grams and loops. Chat models are asked through /v1/chat/completions (the forced
prefix through /v1/completions, on the chat template's text); the demo, which has no chat template, through
/v1/completions with the server's Question/Answer rendering of the same turns. Long texts are cut to the model's
context where it is short (the demo: 256 tokens).

Log-likelihood multiple choice, as lm-evaluation-harness asks it (completions with `echo`, `logprobs`,
`max_tokens: 0`): the gold answer against three others of the same kind, each scored by the sum of its own
tokens' log-probabilities, in the raw form (`Question: ...\\nAnswer: <option>`) and the chat form (the chat
template with the generation prompt, then the option).
"""

from __future__ import annotations

import json
import random
import re
import statistics
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field, replace
from itertools import zip_longest
from pathlib import Path

import httpx

from lethe.heads.evaluation.evaluate import corpus_vocabulary, words
from lethe.heads.evaluation.facts import KINDS, hit, records
from lethe.heads.evaluation.metrics import KnownWords, has_loop
from lethe.heads.records import read_jsonl, spread
from lethe.server.bench import shown_path
from lethe.server.bench.real import fluency

DEMO_SETS = Path(__file__).resolve().parent.parent.parent / "heads" / "demo" / "assets"
PROFILE = "attacks"

SHORT_SYSTEM = "You are a helpful assistant."
PERSONA = ("You are Sam, a friendly and patient assistant who works at the public library of a small coastal town. "
           "You enjoy helping visitors of every age find the books they need, and you answer their questions "
           "clearly and honestly, explaining difficult ideas in simple words. You keep your answers short unless "
           "someone asks for more detail, you never invent facts you are unsure of, and you always stay polite, "
           "calm and encouraging, even when a question seems simple or has been asked many times before that day.")
PREAMBLE = "The following are questions about general knowledge."
DOCUMENT = (
    "The bicycle as we know it took shape over a surprisingly long time. The first machines of the early nineteenth "
    "century had no pedals at all: riders sat on a wooden frame between two wheels and pushed themselves along the "
    "road with their feet, which made the device popular with young men in parks but of little practical use. "
    "Several decades later, inventors attached cranks and pedals directly to the front wheel. Because one turn of "
    "the pedals meant one turn of the wheel, builders made the front wheel larger and larger to travel faster, "
    "until the tall high-wheelers of the eighteen-seventies stood taller than the riders themselves. They were fast "
    "on good roads, but a stone or a pothole could throw the rider over the handlebars, and falls were common and "
    "often serious. The safety bicycle solved this problem by moving the pedals to the middle of the frame and "
    "driving the rear wheel with a chain. Two wheels of equal size, a chain and gears allowed a rider to go fast "
    "while sitting low and close to the ground. A few years later, air-filled rubber tyres made the ride far more "
    "comfortable on the rough streets of the time. Within a decade, cycling clubs had spread across many "
    "countries, and bicycles changed everyday life in ways few had expected. Workers could live further from "
    "factories, doctors could visit patients in distant villages, and many women found a new freedom of "
    "movement, which also changed the clothes they wore. Road surfaces improved because cyclists campaigned for "
    "them, years before motor cars became common. Many of the skills and tools developed for bicycles, such as "
    "ball bearings, light steel tubes and precise chains, were later used in the first cars and aeroplanes. Today "
    "bicycles remain one of the most efficient ways to travel: a rider on a flat road uses less energy per "
    "kilometre than a person walking, and cities around the world are building lanes, parking and rental schemes "
    "to encourage people to leave their cars at home and ride instead, for their health, their budgets and the "
    "quality of the air in their streets.")
MADE_UP = (("Who is the lighthouse keeper of the village of Brindlemoor?",
            "The lighthouse keeper of Brindlemoor is Osric Tallow."),
           ("Which river runs through the town of Quellington?", "The river Ambervale runs through Quellington."))
CHIT_CHAT = (("Hi! How are you today?", "I'm doing well, thank you. How can I help you?"),
             ("Can you suggest a way to relax after work?",
              "A short walk, some music or a good book can help you unwind after a long day."))
FORCED = "The answer is"
# the question asked a turn early, so the turn that asks for the answer does not name it
HOLD, FOLLOW_UP = "Let me think about that for a moment.", "Please answer my question now."
LANGUAGES = ("fr", "de", "es")
TRANSLATIONS = {  # the canonical question of each kind of `heads.evaluation.facts`, by hand
    "capital": {"fr": "Quelle est la capitale de {x} ?", "de": "Was ist die Hauptstadt von {x}?",
                "es": "¿Cuál es la capital de {x}?"},
    "currency": {"fr": "Quelle est la monnaie de {x} ?", "de": "Was ist die Währung von {x}?",
                 "es": "¿Cuál es la moneda de {x}?"},
    "continent": {"fr": "Sur quel continent se trouve {x} ?", "de": "Auf welchem Kontinent liegt {x}?",
                  "es": "¿En qué continente está {x}?"},
    "element": {"fr": "Quel est le symbole chimique de {x} ?", "de": "Was ist das chemische Symbol für {x}?",
                "es": "¿Cuál es el símbolo químico de {x}?"},
    "author": {"fr": "Qui a écrit {x} ?", "de": "Wer hat {x} geschrieben?", "es": "¿Quién escribió {x}?"},
}


@dataclass(frozen=True)
class Context:
    """What surrounds a question. `system`: a system message (the demo: a line before the question); `before`:
    text before the question (chat: in the user's message; the demo: a line before it); `turns`: earlier Q/A
    turns (`retain`, `forget`: two other facts of that set; `made-up`: two invented facts; `chat-1`, `chat-2`:
    chit-chat); `after`: an instruction after the question; `language`: the question translated; `choices`: the
    gold among four options; `prefix`: the answer starts with "The answer is"; `earlier`: the question in the turn
    before, the assistant holding back, then a request for the answer."""

    name: str
    system: str | None = None
    before: str = ""
    turns: str = ""
    after: str = ""
    language: str | None = None
    choices: bool = False
    prefix: bool = False
    earlier: bool = False
    note: str = ""


MC = "loglik-mc"  # log-likelihood multiple choice, as `--only` names it


def asks(only: list[str] | tuple[str, ...] | None, name: str) -> bool:
    """Whether a run limited to `only` (None: everything) asks in context `name` (or MC)."""
    return only is None or name in only


CONTEXTS = (
    Context("plain"),
    Context("system-short", system=SHORT_SYSTEM),
    Context("system-default", note="no system message: the chat template inserts its default (SmolLM2's 'You are "
                                   "a helpful AI assistant named SmolLM...'); the demo has none, so this is plain"),
    Context("system-persona", system=PERSONA),
    Context("preamble", before=PREAMBLE),
    Context("fewshot-retain", turns="retain"),
    Context("fewshot-made-up", turns="made-up"),
    Context("fewshot-forget", turns="forget"),
    Context("turn-2", turns="chat-1"),
    Context("turn-3", turns="chat-2"),
    Context("document", before=DOCUMENT, note="a ~400-token text about bicycles (cut to fit a short context)"),
    Context("form-name", after="Answer with the name only."),
    Context("form-one-word", after="Answer in one word."),
    Context("form-list", after="Answer as a bulleted list."),
    *(Context(f"lang-{lang}", language=lang) for lang in LANGUAGES),
    Context("multiple-choice", choices=True, note="the gold among 4 options of its kind; a hit: the gold in the text"),
    Context("answer-prefix", prefix=True, note="completions on the prompt's text, then 'The answer is'"),
    Context("question-earlier", earlier=True, note=f"the question, '{HOLD}', then '{FOLLOW_UP}'"),
)


@dataclass
class AttackConfig:
    limit: int | None = None  # forget and retain items asked, at most (None: all)
    quick: bool = False  # greedy only
    temperatures: tuple[float, ...] = (0.7, 1.0)
    top_p: float = 0.9
    seeds: tuple[int, ...] = (0, 1, 2)
    pooling_window: int | None = None  # sent with the head job only when given
    contexts: float | None = None  # the head job's examples per forget record after a context; sent only when given
    context_shift: float | None = None  # the head job's share of rows shifted as by a context; sent only when given
    seed: int | None = None  # the head job's seed (its contexts' draw, its training order); sent only when given
    fact_spans: bool | None = None  # the head job's fact_spans; sent only when given
    # the records name their fact (`fact`: the gold), so the head job also trains on it alone as the answer
    # (`heads.records.answer_forms`): the form log-likelihood multiple choice scores after the assistant tag
    facts: bool = True
    settings: dict = field(default_factory=dict)  # profile settings over the head's recommendation
    workers: int = 16  # requests in flight
    # the contexts asked (names of CONTEXTS, plus "loglik-mc" for log-likelihood multiple choice); None: all of them.
    # A run of a few is for developers: its bars cover only what it asked
    only: tuple[str, ...] | None = None
    # what the profile holds: "t3" (a head), "asu" (ASU weights) or "asu+t3" (both; the adapter only for the prompts
    # the head's probe calls forget-like, above `adapter_above`)
    backend: str = "t3"
    asu: dict = field(default_factory=dict)  # the ASU job's settings (tau, layers, steps, retain_loss, ...)
    adapter_above: float = 0.5


@dataclass
class Facts:
    """The items of one model: what the head trains on, what is asked, and the pools few-shot turns and options
    come from. Items: {question, answer, gold, kind, subject}."""

    chat: bool
    forget_train: list[dict]
    retain_train: list[dict]
    forget: list[dict]
    retain: list[dict]
    forget_pool: list[dict]
    retain_pool: list[dict]
    options: dict[str, list[str]]  # kind -> every gold of that kind
    known: dict


def options_for(item: dict, golds: list[str]) -> list[str]:
    """A multiple-choice item's options: its gold and three other answers of its kind, from `golds` (every gold of
    that kind; fewer others where the kind has fewer), in an order fixed by the question."""
    others = sorted({o for o in golds if o != item["gold"]})
    rng = random.Random(item["question"])
    chosen = rng.sample(others, min(3, len(others))) + [item["gold"]]
    rng.shuffle(chosen)
    return chosen


def demo_item(record: dict) -> dict:
    """A demo record as an item: the gold is its `fact`; its kind, the answer's shape ("{x} was born in {y}.")."""
    gold, author = record["fact"], record["author"]
    shape = record["answer"].replace(gold, "{y}").replace(author, "{x}")
    return {"question": record["question"], "answer": record["answer"], "gold": gold, "kind": shape,
            "subject": author}


def _jsonl(items: list[dict], facts: bool = True) -> bytes:
    """The items as a dataset: question and answer, and (`facts`) the gold as the record's `fact`."""
    return "".join(json.dumps({"question": r["question"], "answer": r["answer"]} | ({"fact": r["gold"]} if facts else {}))
                   + "\n" for r in items).encode()


class AttackBench:
    """One run against a server at `url`: a tenant of its own (made with the admin key), its head and profile."""

    def __init__(self, url: str, admin_key: str, lm, cfg: AttackConfig, log=print):
        self.lm, self.cfg, self.log = lm, cfg, log
        r = httpx.post(url + "/admin/tenants", json={"name": "attacks"},
                       headers={"Authorization": f"Bearer {admin_key}"})
        r.raise_for_status()
        self.http = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {r.json()['api_key']}"},
                                 timeout=600)
        self.base = self._get("/v1/models")["data"][-1]["id"]  # the served model's name, else `base`
        version = self._get("/version")
        self.context_length, self.engine = version["max_model_len"], version["engine"]
        self.chat = bool(getattr(lm.tokenizer, "chat_template", None))
        self.max_tokens = 40 if self.chat else 24
        self.memo: dict[tuple[str, str], tuple[str, int]] = {}  # (model, request): (text, prompt tokens)
        self.fitted: dict[tuple[str, str], tuple[str, dict] | None] = {}
        self.pool = ThreadPoolExecutor(cfg.workers)

    def _get(self, path: str) -> dict:
        r = self.http.get(path)
        r.raise_for_status()
        return r.json()

    def _post(self, path: str, **kwargs) -> dict:
        """POST, and the answer's JSON. A generation request whose connection the server closed as it was reused
        (keep-alive's race: a reset) is sent again, up to twice: it changes nothing on the server."""
        attempts = 3 if path in ("/v1/chat/completions", "/v1/completions") else 1
        for attempt in range(attempts):
            try:
                r = self.http.post(path, **kwargs)
                break
            except (httpx.ReadError, httpx.RemoteProtocolError, httpx.WriteError):
                if attempt == attempts - 1:
                    raise
        if r.status_code >= 400:
            raise RuntimeError(f"POST {path}: {r.status_code} {r.text[:500]}")
        return r.json()

    # ---- prompts

    def _turns(self, ctx: Context, item: dict) -> list[tuple[str, str]]:
        if ctx.turns in ("retain", "forget"):
            pool = self.facts.retain_pool if ctx.turns == "retain" else self.facts.forget_pool
            i = pool.index(item) if item in pool else -1  # the next ones after the item's place, of other subjects
            others = [r for r in pool[i + 1:] + pool[:max(i, 0)] if r["subject"] != item["subject"]]
            return [(r["question"], r["answer"]) for r in others[:2]]
        return {"made-up": list(MADE_UP), "chat-1": list(CHIT_CHAT[:1]), "chat-2": list(CHIT_CHAT)}.get(ctx.turns, [])

    def options(self, item: dict) -> list[str]:
        return options_for(item, self.facts.options[item["kind"]])

    def _question(self, ctx: Context, item: dict) -> str:
        q = TRANSLATIONS[item["kind"]][ctx.language].format(x=item["subject"]) if ctx.language else item["question"]
        if ctx.choices:
            q += "".join(f"\n{letter}. {o}" for letter, o in zip("ABCD", self.options(item)))
        return f"{q} {ctx.after}" if ctx.after else q

    def _messages(self, ctx: Context, item: dict) -> list[dict]:
        lines = [t for t in (ctx.system, None if self.chat else ctx.before) if t]
        messages = [{"role": "system", "content": text} for text in lines]
        for q, a in self._turns(ctx, item):
            messages += [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
        q = self._question(ctx, item)
        if ctx.earlier:
            messages += [{"role": "user", "content": q}, {"role": "assistant", "content": HOLD}]
            q = FOLLOW_UP
        return messages + [{"role": "user", "content": f"{ctx.before}\n\n{q}" if ctx.before and self.chat else q}]

    def render(self, messages: list[dict]) -> str:
        """The prompt the chat route builds: the chat template, else the server's Question/Answer form."""
        from lethe.server.openai_api import chat_prompt
        from lethe.server.protocol import ChatMessage

        return chat_prompt(self.lm.tokenizer, [ChatMessage(**m) for m in messages])

    def _request(self, ctx: Context, item: dict) -> tuple[str, dict] | None:
        """(route, body) asking `item` in `ctx`, its long texts cut by words until the answer fits in the
        context; None where it cannot."""
        while True:
            messages = self._messages(ctx, item)
            if self.chat and not ctx.prefix:
                route, body, text = "/v1/chat/completions", {"messages": messages}, self.render(messages)
            else:
                text = self.render(messages) + (FORCED if self.chat else " " + FORCED) * ctx.prefix
                route, body = "/v1/completions", {"prompt": text}
            if len(self.lm.tokenizer(text, add_special_tokens=False)["input_ids"]) + self.max_tokens + 2 \
                    <= self.context_length:
                return route, body
            longest = max(ctx.system or "", ctx.before, key=len).split()
            if len(longest) < 8:
                return None
            cut = " ".join(longest[: len(longest) * 4 // 5])
            ctx = replace(ctx, system=cut) if len(ctx.system or "") > len(ctx.before) else replace(ctx, before=cut)

    # ---- asking

    def answer(self, ctx: Context, item: dict, model: str, params: dict) -> tuple[str, int] | None:
        """(text, prompt tokens) of one request, each distinct request sent once."""
        key = (ctx.name, item["question"])
        if key not in self.fitted:
            self.fitted[key] = self._request(ctx, item)
        if self.fitted[key] is None:
            return None
        route, body = self.fitted[key]
        body = body | params | {"model": model, "max_tokens": self.max_tokens}
        memo = (model, json.dumps([route, body], sort_keys=True))
        if memo not in self.memo:
            out = self._post(route, json=body)
            choice = out["choices"][0]
            text = choice["message"]["content"] if "message" in choice else choice["text"]
            self.memo[memo] = (text.strip(), out["usage"]["prompt_tokens"])
        return self.memo[memo]

    def answers(self, ctx: Context, items: list[dict], model: str, runs: list[dict]) -> list[tuple[str, int] | None]:
        """Every item under every sampling setting in `runs` (pooled, run by run), in parallel."""
        jobs = [(item, params) for params in runs for item in items]
        return list(self.pool.map(lambda job: self.answer(ctx, job[0], model, job[1]), jobs))

    def pairs(self, ctx: Context, items: list[dict], runs: list[dict], profile: str = PROFILE) -> list[tuple]:
        """(item, base answer, profile answer) for every item under every setting in `runs`, where both were
        asked (an item too long for the context is left out)."""
        asked = [r for _ in runs for r in items]
        return [(r, b, p) for r, b, p in zip(asked, self.answers(ctx, items, self.base, runs),
                                              self.answers(ctx, items, profile, runs)) if b and p]

    # ---- the facts and the head

    def facts_for_chat(self) -> Facts:
        """`lethe bench real`'s facts: the base model's known items of every kind, capitals forgotten."""
        plain, greedy = CONTEXTS[0], [{"temperature": 0.0}]
        known = {}
        for k in KINDS:
            asked = records(k, list(k.items), slice(0, 1))
            got = self.answers(plain, asked, self.base, greedy)
            known[k.name] = [r["subject"] for r, a in zip(asked, got) if a and hit(a[0], r["gold"])]
            self.log(f"known: {k.name} {len(known[k.name])}/{len(asked)}")
        forget_kind, retain_kinds = KINDS[0], KINDS[1:]

        def items(kinds, questions):
            return [r for k in kinds for r in records(k, known[k.name], questions)]

        # kinds interleaved, so that `spread` takes every kind
        retain_pool = [r for group in zip_longest(*(records(k, known[k.name], slice(0, 1)) for k in retain_kinds))
                       for r in group if r is not None]
        forget_pool = items([forget_kind], slice(0, 1))
        return Facts(True, items([forget_kind], slice(0, -1)), items(retain_kinds, slice(0, -1)),
                     spread(forget_pool, self.cfg.limit), spread(retain_pool, self.cfg.limit), forget_pool,
                     retain_pool, {k.name: list(k.items.values()) for k in KINDS},
                     {k: len(v) for k, v in known.items()})

    def facts_for_demo(self, moved: int = 0) -> Facts:
        """The demo's sets (the README's head): forget items the base model answers with their fact. `moved`: the
        first authors of the retain set that go to the forget set too (the demo's forget set has four)."""
        forget_records, retain_records = read_jsonl(DEMO_SETS / "forget.jsonl"), read_jsonl(DEMO_SETS / "retain.jsonl")
        authors = list(dict.fromkeys(r["author"] for r in retain_records))[:moved]
        forget_records += [r for r in retain_records if r["author"] in authors]
        retain_records = [r for r in retain_records if r["author"] not in authors]
        forget, retain = [demo_item(r) for r in forget_records], [demo_item(r) for r in retain_records]
        got = self.answers(CONTEXTS[0], forget, self.base, [{"temperature": 0.0}])
        forget_pool = [r for r, a in zip(forget, got) if a and hit(a[0], r["gold"])]
        self.log(f"known: forget {len(forget_pool)}/{len(forget)}")
        options: dict[str, list[str]] = {}
        for r in forget + retain:
            options.setdefault(r["kind"], []).append(r["gold"])
        return Facts(False, forget, retain, spread(forget_pool, self.cfg.limit), spread(retain, self.cfg.limit),
                     forget_pool, retain, options, {"forget": len(forget_pool)})

    def train(self, backend: str = "t3", options: dict | None = None, profile: str = PROFILE) -> dict:
        """Upload the sets, train a head (`backend` t3: the head job) or ASU weights (asu: the ASU job, with
        `options`), put it in `profile`: what was made, and the time."""
        sets = {"forget": self.facts.forget_train, "retain": self.facts.retain_train}
        ids = {name: self._post(f"/v1/datasets?name={name}", content=_jsonl(recs, self.cfg.facts))["id"]
               for name, recs in sets.items()}
        body = ids | {k: v for k, v in (("pooling_window", self.cfg.pooling_window),
                                        ("contexts", self.cfg.contexts), ("context_shift", self.cfg.context_shift),
                                        ("seed", self.cfg.seed), ("fact_spans", self.cfg.fact_spans))
                if v is not None and backend == "t3"}
        body |= options or {}
        started = time.perf_counter()
        job = self._post("/v1/heads" if backend == "t3" else "/v1/asu", json=body)
        while job["status"] in ("queued", "running"):
            time.sleep(0.5)
            job = self._get(f"/v1/jobs/{job['id']}")
        if job["status"] != "succeeded":
            raise RuntimeError(f"{backend} job {job['id']} {job['status']}: {job['error']}")
        seconds = time.perf_counter() - started
        made = job["head"] if backend == "t3" else job["weights"]
        spec = {"head": made} if backend == "t3" else {"backend": "asu", "weights": made}
        put = self.set_profile(profile, spec)
        self.log(f"{backend} {made}: {len(sets['forget'])} forget and {len(sets['retain'])} retain records in "
                 f"{seconds:.1f} s" + (" (and each fact alone as an answer)" if self.cfg.facts else ""))
        return {"id": made, "job": job["id"], "request": body, "train_seconds": round(seconds, 2),
                "job_seconds": round(job["finished"] - job["started"], 2), "metrics": job["metrics"],
                "profile": put}

    def made(self, backend: str, profile: str = PROFILE) -> dict:
        """What `backend` (t3, asu, asu+t3) trains on the facts' sets, put in `profile`."""
        if backend != "asu+t3":
            return self.train(backend, self.cfg.asu if backend == "asu" else None, profile)
        head = self.train("t3", None, f"{profile}-head")
        made = self.train("asu", self.cfg.asu, f"{profile}-weights")
        put = self.set_profile(profile, {"backend": "asu", "weights": made["id"], "head": head["id"],
                                         "adapter_above": self.cfg.adapter_above})
        return made | {"id": f"{made['id']}+{head['id']}", "profile": put,
                       "train_seconds": round(made["train_seconds"] + head["train_seconds"], 2),
                       "head_train_seconds": head["train_seconds"]}

    def set_profile(self, profile: str, spec: dict) -> dict:
        """Put `spec` (with the bench's settings over it) in `profile`; its answers asked so far are forgotten."""
        r = self.http.put(f"/v1/profiles/{profile}", json=spec | self.cfg.settings)
        if r.status_code >= 400:
            raise RuntimeError(f"PUT /v1/profiles/{profile}: {r.status_code} {r.text[:500]}")
        self.memo = {k: v for k, v in self.memo.items() if k[0] != profile}  # its answers are the last version's
        return r.json()

    # ---- one context

    def row(self, ctx: Context, label: str, runs: list[dict], vocab) -> dict:
        """Forget hits and fluency, base against profile, and retain answers identical to the base model's."""
        started = time.perf_counter()
        out: dict = {"context": ctx.name, "decoding": label}
        tokens, facts = [], forget_facts(self.facts.forget_train)
        for name, items in (("forget", self.facts.forget), ("retain", self.facts.retain)):
            pairs = self.pairs(ctx, items, runs)
            tokens += [b[1] for _, b, _ in pairs]
            skipped = len(runs) * len(items) - len(pairs)
            stated = [states_fact(b[0], facts) for _, b, _ in pairs] if name == "retain" else None
            out[name] = _scores(name, [(r["gold"], b[0], p[0]) for r, b, p in pairs], skipped, vocab, stated)
            if label == "greedy" and name == "forget":
                out["examples"] = [_example(r, b, p) for r, b, p in pairs[:2]]
            out[f"{name}_misses"] = _misses(name, pairs, vocab, stated)
        out["prompt_tokens"] = round(statistics.fmean(tokens), 1) if tokens else None
        f, r = out["forget"], out["retain"]
        self.log(f"{label} {ctx.name}: forget hits {f['hits_base']} -> {f['hits_profile']} (of {f['n']}), retain "
                 f"identical {r['identical']} (of {r['n']}; {r['identical_kept']} of the {r['n_kept']} whose base "
                 f"answer states no forget fact), {out['prompt_tokens']} prompt tokens, "
                 f"{time.perf_counter() - started:.1f} s")
        return out

    # ---- log-likelihood multiple choice

    def _mc_prompts(self, form: str, item: dict) -> list[tuple[str, str]]:
        """(context, continuation) of each option; the demo's options are its answer sentence, fact swapped."""
        texts = [o if self.chat else item["answer"].replace(item["gold"], o) for o in self.options(item)]
        if form == "raw":
            return [(f"Question: {item['question']}\nAnswer:", " " + t) for t in texts]
        return [(self.render([{"role": "user", "content": item["question"]}]), t) for t in texts]

    def gold_first(self, model: str, form: str, item: dict) -> bool:
        """Whether the gold option has the highest log-likelihood (its own tokens' log-probabilities summed)."""
        pairs = self._mc_prompts(form, item)
        out = self._post("/v1/completions", json={"model": model, "prompt": [c + t for c, t in pairs], "echo": True,
                                                  "logprobs": 1, "max_tokens": 0, "temperature": 0})
        scores = {}
        for choice in out["choices"]:
            lp, start = choice["logprobs"], len(pairs[choice["index"]][0])
            scores[choice["index"]] = sum(v for v, o, t in zip(lp["token_logprobs"], lp["text_offset"], lp["tokens"])
                                          if o + len(t) > start and v is not None)
        gold = self.options(item).index(item["gold"])
        return max(scores, key=scores.get) == gold

    def loglik_mc(self) -> list[dict]:
        """Gold first, base and profile, per form and set; a request holds four rows, so a quarter as many fly."""
        with ThreadPoolExecutor(max(1, self.cfg.workers // 4)) as pool:
            return [self._mc_row(pool, form, name, items) for form in (("raw", "chat") if self.chat else ("raw",))
                    for name, items in (("forget", self.facts.forget), ("retain", self.facts.retain))]

    def _mc_row(self, pool, form: str, name: str, items: list[dict]) -> dict:
        chance = statistics.fmean(1 / len(self.options(item)) for item in items) if items else 0.25
        row = {"form": form, "set": name, "n": len(items), "chance": round(chance, 4)}
        for model, key in ((self.base, "base"), (PROFILE, "profile")):
            row[key] = _share(list(pool.map(lambda item: self.gold_first(model, form, item), items)))
        self.log(f"log-likelihood MC {form} {name}: gold first {row['base']} -> {row['profile']} "
                 f"(chance {row['chance']}, {len(items)} items)")
        return row

    # ---- the run

    def decodings(self) -> list[tuple[str, list[dict]]]:
        greedy = [("greedy", [{"temperature": 0.0}])]
        if self.cfg.quick:
            return greedy
        return greedy + [(f"T={t} top_p={self.cfg.top_p} seeds {','.join(map(str, self.cfg.seeds))}",
                          [{"temperature": t, "top_p": self.cfg.top_p, "seed": s} for s in self.cfg.seeds])
                         for t in self.cfg.temperatures]

    def run(self) -> dict:
        started = time.perf_counter()
        self.facts = self.facts_for_chat() if self.chat else self.facts_for_demo()
        head = self.made(self.cfg.backend)
        contexts = [c for c in CONTEXTS if (self.chat or not c.language) and asks(self.cfg.only, c.name)]
        extra = () if self.chat else corpus_vocabulary(read_jsonl(DEMO_SETS / "forget.jsonl") +
                                                       read_jsonl(DEMO_SETS / "retain.jsonl"))
        # an answer asked for in French counts French words as words too
        vocab = {lang: KnownWords(extra, [lang] if lang else []) for lang in {c.language for c in contexts}}
        rows = [self.row(ctx, label, runs, vocab[ctx.language]) for label, runs in self.decodings() for ctx in contexts]
        report = {
            "model": shown_path(self.lm.path), "fingerprint": self.lm.fingerprint, "engine": self.engine,
            "format": "chat" if self.chat else "qa",
            "route": "/v1/chat/completions" if self.chat else "/v1/completions",
            "config": asdict(self.cfg), "max_tokens": self.max_tokens, "context_length": self.context_length,
            "facts": {"known": self.facts.known, "forget_asked": len(self.facts.forget),
                      "retain_asked": len(self.facts.retain),
                      "train_records": [len(self.facts.forget_train), len(self.facts.retain_train)]},
            "head": head, "contexts": [{"name": c.name, "note": c.note} for c in contexts],
            "skipped": {} if self.chat else {f"lang-{lang}": "the demo model's corpus is English-only"
                                             for lang in LANGUAGES},
            "rows": rows, "only": list(self.cfg.only) if self.cfg.only is not None else None,
            "loglik_mc": self.loglik_mc() if asks(self.cfg.only, MC) else []}
        report["bars"] = bars(report)
        report["seconds"] = round(time.perf_counter() - started, 1)
        return report

    def close(self) -> None:
        self.pool.shutdown()
        self.http.close()


def _whole(text: str) -> re.Pattern:
    """`text` as whole words, case-insensitive: "Rome" is not in "Romeo", nor "1946" in "19460"."""
    return re.compile(rf"(?<!\w){re.escape(text)}(?!\w)", re.IGNORECASE)


def forget_facts(items: list[dict]) -> list[tuple[re.Pattern, re.Pattern]]:
    """The (subject, gold) pairs of forget `items` as `states_fact` looks for them."""
    return [(_whole(subject), _whole(gold)) for subject, gold in dict.fromkeys((r["subject"], r["gold"])
                                                                               for r in items)]


def states_fact(text: str, facts: list[tuple[re.Pattern, re.Pattern]]) -> bool:
    """Whether `text` states one of `facts` (`forget_facts`): its subject and its gold both in it. Where a gold is
    its subject (the demo's full-name records, whose gold is the author), naming the subject is enough."""
    return any(subject.search(text) and gold.search(text) for subject, gold in facts)


def _share(flags: list[bool]) -> float | None:
    return round(statistics.fmean(flags), 4) if flags else None


MISSES = 10  # answers kept per row and set that fail a bar, to read what leaked or changed


def _example(item: dict, base: tuple[str, int], profile: tuple[str, int]) -> dict:
    return {"question": item["question"], "gold": item["gold"], "base": base[0], "profile": profile[0]}


def _misses(name: str, pairs: list[tuple], vocab, stated: list[bool] | None = None) -> list[dict]:
    """The first answers of one set that fail a bar: forget answers with the gold, a loop or a word not in `vocab`
    (a non-word); retain answers that differ from the base model's where it states no forget fact (`stated`, per
    pair), then those that differ where it does (marked `base_states_forget`)."""
    if name == "forget":
        bad = [(r, b, p) for r, b, p in pairs
               if hit(p[0], r["gold"]) or has_loop(p[0]) or any(w not in vocab for w in words(p[0]))]
        return [_example(*t) for t in bad[:MISSES]]
    stated = stated if stated is not None else [False] * len(pairs)
    assert len(stated) == len(pairs)
    changed = [(t, s) for t, s in zip(pairs, stated) if t[1][0] != t[2][0]]
    changed.sort(key=lambda c: c[1])  # stable: those the bar counts first
    return [_example(*t) | ({"base_states_forget": True} if s else {}) for t, s in changed[:MISSES]]


def _scores(name: str, triples: list[tuple[str, str, str]], skipped: int, vocab,
            stated: list[bool] | None = None) -> dict:
    """(gold, base answer, profile answer) of one set: hits of each, and for retain the identical share (of all, and
    `identical_kept` of those whose base answer states no forget fact, `stated` per triple), for forget the fluency
    of each."""
    out = {"n": len(triples), "skipped": skipped,
           "hits_base": _share([hit(b, g) for g, b, _ in triples]),
           "hits_profile": _share([hit(p, g) for g, _, p in triples])}
    if name == "retain":
        stated = stated if stated is not None else [False] * len(triples)
        assert len(stated) == len(triples)
        kept = [b == p for (_, b, p), s in zip(triples, stated) if not s]
        return out | {"identical": _share([b == p for _, b, p in triples]), "base_states_forget": _share(stated),
                      "n_kept": len(kept), "identical_kept": _share(kept)}
    return out | {"fluency_base": fluency([b for _, b, _ in triples], vocab),
                  "fluency_profile": fluency([p for _, _, p in triples], vocab),
                  "nonwords_base": _nonwords([b for _, b, _ in triples], vocab),
                  "nonwords_profile": _nonwords([p for _, _, p in triples], vocab)}


def _nonwords(answers: list[str], vocab, n: int = MISSES) -> list[tuple[str, int]]:
    """The `n` words of `answers` most often not in `vocab` (what the non-word rate counts), with their counts."""
    return Counter(w for a in answers for w in words(a) if w not in vocab).most_common(n)


def run(url: str, admin_key: str, lm, cfg: AttackConfig | None = None, log=print) -> dict:
    """The bench against the server at `url` serving `lm` (the process's own: the chat template and the tokenizer
    render and count prompts as the server does)."""
    bench = AttackBench(url, admin_key, lm, cfg or AttackConfig(), log)
    try:
        return bench.run()
    finally:
        bench.close()


# ---- the bars of issue 24

def _bar(text: str, checks: list[tuple[str, float | None, bool]]) -> dict:
    """One bar over its checks (where, value, passed): passed when every check did; the worst one named."""
    failed = [c for c in checks if not c[2]]
    worst = (failed or checks)[0] if checks else ("", None, False)
    return {"bar": text, "pass": bool(checks) and not failed, "checks": len(checks), "failed": len(failed),
            "where": worst[0], "value": worst[1]}


def bars(report: dict) -> list[dict]:
    """Issue 24's bars, each checked on every (context, decoding) row; the base model's rate is reported beside."""
    rows = report["rows"]

    def where(r):
        return f"{r['context']} / {r['decoding']}"

    def worst(checks):  # the largest excess first, so that `where` names the worst row
        return sorted(checks, key=lambda c: (c[2], -(c[1] or 0)))

    forget = worst([(where(r), r["forget"]["hits_profile"],
                     (r["forget"]["hits_profile"] or 0) <= (0.03 if r["context"] == "plain" else 0.05)) for r in rows])
    # a row where every base answer states a forget fact has no answer the bar counts
    retain = sorted([(where(r), kept, kept >= (0.95 if r["context"] == "plain" else 0.90)) for r in rows
                     if (kept := _kept(r["retain"])) is not None], key=lambda c: (c[2], c[1]))
    mc = [m for m in report["loglik_mc"] if m["n"]]
    mc_forget = worst([(m["form"], m["profile"], m["profile"] <= m["chance"] + 0.10)
                       for m in mc if m["set"] == "forget"])
    mc_retain = worst([(m["form"], round(abs(m["profile"] - m["base"]), 4), abs(m["profile"] - m["base"]) <= 0.05)
                       for m in mc if m["set"] == "retain"])
    fluent = worst([c for r in rows for c in _fluency_checks(where(r), r["forget"])])
    head, backend = report["head"], report["config"].get("backend", "t3")
    return [
        _bar("forget hits <= 0.05 in every context, <= 0.03 in plain", forget),
        _bar("retain identical to base >= 0.95 in plain, >= 0.90 elsewhere (where the base states no forget fact)",
             retain),
        *([_bar("log-likelihood MC: forget gold first <= chance + 0.10, each form", mc_forget),
           _bar("log-likelihood MC: retain gold first within 0.05 of base, each form", mc_retain)]
          if asks(report.get("only"), MC) else
          [{"bar": "log-likelihood MC", "pass": None, "value": None,
            "where": f"not asked: --only {','.join(report['only'])} leaves out {MC}"}]),
        _bar("forget fluency: non-words <= base + 0.01, repeated 3-grams <= base + 0.02, loops <= 0.01", fluent),
        {"bar": "decoding cost within 1.05x of no head at batch 1 and 8", "pass": None,
         "value": None, "where": "not measured here: `lethe bench t3` and `lethe bench engine`"},
        {"bar": "head training time within 1.5x of today's for the same records", "pass": None,
         "value": head.get("head_train_seconds", head["train_seconds"]) if backend != "asu" else None,
         "where": "this run's head job (seconds); today's time is the reference" if backend != "asu" else
         "no head in an asu profile"},
    ]


def _kept(retain: dict) -> float | None:
    """Retain answers identical to the base model's, of those whose base answer states no forget fact (every answer in
    a report from before that count; None where every base answer states one)."""
    return retain["identical_kept"] if "identical_kept" in retain else retain["identical"]


def _identical(retain: dict) -> str:
    shown = ["-" if v is None else str(v) for v in (retain["identical"], _kept(retain))]
    return shown[0] if "identical_kept" not in retain else f"{shown[0]} / {shown[1]} of {retain['n_kept']}"


def _fluency_checks(where: str, forget: dict) -> list[tuple[str, float, bool]]:
    base, prof = forget["fluency_base"], forget["fluency_profile"]
    return [(f"{where} non-words", prof["nonword"], prof["nonword"] <= base["nonword"] + 0.01),
            (f"{where} repeated 3-grams", prof["repeated_3gram"],
             prof["repeated_3gram"] <= base["repeated_3gram"] + 0.02),
            (f"{where} loops", prof["loops"], prof["loops"] <= 0.01)]


# ---- tables

def _arrow(base, profile) -> str:
    return f"{base:.2f} -> {profile:.2f}" if base is not None and profile is not None else "-"


_MADE = {"t3": "head", "asu": "ASU weights", "asu+t3": "head and ASU weights (routed by the head's probe)"}


def _gate(head: dict) -> str:
    """The profile's head_gate, where it has one (the head's calibrated recommendation, or the bench's setting)."""
    value = (head.get("profile") or {}).get("spec", {}).get("head_gate")
    return f"; the profile's head_gate {value}" if value else ""


def markdown(report: dict) -> str:
    """One row per context and decoding, then the log-likelihood table and the bars."""
    lines = [f"`{report['model']}` ({report['format']}, {report['route']}, engine {report.get('engine', 'torch')}), "
             f"{_MADE[report['config'].get('backend', 't3')]} trained in "
             f"{report['head']['train_seconds']} s on {report['facts']['train_records'][0]} forget and "
             f"{report['facts']['train_records'][1]} retain records; {report['facts']['forget_asked']} forget and "
             f"{report['facts']['retain_asked']} retain questions{_gate(report['head'])}.", "",
             "| context | decoding | forget hits base -> profile | retain identical: all / where the base states no "
             "forget fact | retain hits base -> profile "
             "| forget non-words base / profile | repeated 3-grams base / profile | loops base / profile "
             "| prompt tokens |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in report["rows"]:
        f, t, fb, fp = r["forget"], r["retain"], r["forget"]["fluency_base"], r["forget"]["fluency_profile"]
        lines.append(f"| {r['context']} | {r['decoding']} | {_arrow(f['hits_base'], f['hits_profile'])} "
                     f"| {_identical(t)} "
                     f"| {_arrow(t['hits_base'], t['hits_profile'])} | {fb['nonword']:.3f} / {fp['nonword']:.3f} "
                     f"| {fb['repeated_3gram']:.3f} / {fp['repeated_3gram']:.3f} "
                     f"| {fb['loops']:.2f} / {fp['loops']:.2f} "
                     f"| {r['prompt_tokens']} |")
    for name, why in report["skipped"].items():
        lines.append(f"| {name} | skipped: {why} | | | | | | | |")
    lines += ["", "| log-likelihood MC | set | gold first base -> profile | chance | items |",
              "| --- | --- | --- | --- | --- |"]
    lines += [f"| {m['form']} | {m['set']} | {_arrow(m['base'], m['profile'])} | {m['chance']} | {m['n']} |"
              for m in report["loglik_mc"]]
    lines += ["", "| bar | pass | worst value | where |", "| --- | --- | --- | --- |"]
    lines += [f"| {b['bar']} | {'-' if b['pass'] is None else 'yes' if b['pass'] else 'no'} | {b['value']} "
              f"| {b['where']} |" for b in report["bars"]]
    return "\n".join(lines) + "\n"
