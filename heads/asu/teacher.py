"""ASU's teacher diagnostic: which attention temperature, in which layers, makes facts fade and grammar stay.

ASU's premise (the paper's): flattening attention lowers the probability of tokens that need sharp attention to
be recalled (facts) far more than that of function words. Whether that holds, and where, depends on the model: on
SmolLM2-135M, tau 2.5 in layers 0-9 lowers the author's name 5.5x more than the rest of the answer, while tau 16
in every layer (the old default) makes the teacher itself answer with dashes (../shared/REFERENCE.md).

`diagnose` teacher-forces each forget record's answer through the base model and through the tempered teacher
for each candidate (tau, layers), and reports the mean drop in log-probability on the answer's *content* tokens
(the record's `fact` where it names one; otherwise its words outside a short list of function words) against its
other tokens, and how often the teacher's top token stops being the base model's there (`fact_flips`,
`other_flips`). `pick` chooses the setting that flips facts most beyond the other tokens, among those that flip at
least `min_flips` of the facts: a teacher that barely moves the facts teaches nothing, one that moves everything
teaches noise.
"""

from __future__ import annotations

import math
import re
import statistics
from dataclasses import asdict, dataclass

import torch

from lethe.heads.asu.attention import parse_layers, tempered, use_tempered_attention
from lethe.heads.records import Example, qa_example, resolve_format

TAUS = (1.5, 2.0, 2.5, 3.0, 4.0, 8.0)
FUNCTION_WORDS = frozenset("""a an the of in on at to for from by with and or but is are was were be been being
has have had do does did it its this that these those he she they his her their him them i you we my your our as
not no so than then there here which who whom whose what when where why how also into about over after before
""".split())


@dataclass
class Setting:
    tau: float
    layers: str  # "0-9", or "all"
    content_drop: float = 0.0  # mean drop in log-probability (nats) on content tokens
    other_drop: float = 0.0  # ... on the answer's other tokens
    ratio: float = 0.0  # content_drop / other_drop (other_drop floored at 0.01)
    records: int = 0  # the known facts measured
    # what greedy decoding sees: the share of facts whose first token, the base model's most likely token there,
    # is no longer the teacher's (a student that copies the teacher then says something else), and the same share
    # over the answer's other tokens (words the student would change too)
    fact_flips: float = 0.0
    other_flips: float = 0.0


def layer_groups(num_layers: int) -> list[str]:
    """Every layer, and the first, middle and last third."""
    third = num_layers // 3
    if third == 0:
        return ["all"]
    return ["all", f"0-{third - 1}", f"{third}-{2 * third - 1}", f"{2 * third}-{num_layers - 1}"]


def token_roles(tokenizer, ex: Example, answer: str, fact: str | None) -> list[str | None]:
    """Per token of the example's completion (tokenized as `encode_example` does): "content", "other", or None
    for tokens outside the answer's own text (the template's end of turn)."""
    enc = tokenizer(ex.completion, add_special_tokens=False, return_offsets_mapping=True)
    start = ex.completion.find(answer)
    if fact and fact in answer:
        at = start + answer.index(fact)
        spans = [(at, at + len(fact))]
    else:
        spans = [(start + m.start(), start + m.end()) for m in re.finditer(r"\w+", answer)
                 if m.group().lower() not in FUNCTION_WORDS]
    roles = []
    for a, b in enc["offset_mapping"]:
        if not (b > start and a < start + len(answer)):
            roles.append(None)
        else:
            roles.append("content" if any(a < e and b > s for s, e in spans) else "other")
    return roles


def _token_logprobs(model, tokenizer, exs: list[Example], device, batch: int = 16
                    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per example, the log-probability of each completion token given everything before it, and whether it is
    the most likely token there (the positions and batches ASU's own distillation reads, `heads.asu.distill`)."""
    from lethe.heads.asu.distill import _answer_logits, _batch

    out = []
    for i in range(0, len(exs), batch):
        ids, mask, spans = _batch(tokenizer, exs[i:i + batch], device)
        with torch.no_grad():
            logits, target = _answer_logits(model, ids, mask, spans)
        logprobs = torch.log_softmax(logits, -1)
        lp = logprobs.gather(-1, target[:, None])[:, 0].cpu()
        top = (logprobs.argmax(-1) == target).cpu()
        sizes = [b - a for a, b in spans]
        out += list(zip(lp.split(sizes), top.split(sizes)))
    return out


def _flips(base_top: list[torch.Tensor], teacher_top: list[torch.Tensor], roles: list[list[str | None]]
           ) -> tuple[float, float]:
    """(facts, other tokens): the share whose token, the base model's top token, is not the teacher's. A fact
    counts by its first content token, where greedy decoding chooses it."""
    facts, other = [], []
    for b, t, row in zip(base_top, teacher_top, roles):
        first = next((j for j, role in enumerate(row) if role == "content"), None)
        if first is not None and bool(b[first]):
            facts.append(not bool(t[first]))
        other += [not bool(t[j]) for j, role in enumerate(row) if role == "other" and bool(b[j])]
    return (round(statistics.fmean(facts), 3) if facts else 0.0, round(statistics.fmean(other), 3) if other else 0.0)


def _answers(lm, records: list[dict], fmt: str, **sampling) -> list[str]:
    """The model's answer to each record's question under `sampling` (SamplingParams' fields), stripped."""
    from lethe.heads.decoding.decode import generate_chunked
    from lethe.heads.decoding.sampling import SamplingParams
    from lethe.heads.records import ask

    said = generate_chunked(lm.model, lm.tokenizer, [ask(r["question"], fmt, lm.tokenizer) for r in records],
                            SamplingParams(**sampling))
    return [c.text.strip() for c in said]


def greedy_answers(lm, records: list[dict], fmt: str, max_new_tokens: int = 48, memo: dict | None = None) -> list[str]:
    """The model's own greedy answer to each record's question, stripped. `memo` ({question: answer}, of one model,
    format and length) keeps them: a question answered once in a training run is not decoded again."""
    memo = {} if memo is None else memo
    new = list({r["question"]: r for r in records if r["question"] not in memo}.values())
    memo.update(zip((r["question"] for r in new), _answers(lm, new, fmt, max_new_tokens=max_new_tokens,
                                                             temperature=0.0) if new else []))
    return [memo[r["question"]] for r in records]


def sampled_answers(lm, records: list[dict], fmt: str, seed: int, max_new_tokens: int = 48) -> list[str]:
    """One answer per record's question sampled from the model (T=1, top-p 0.95, `seed`), stripped."""
    return _answers(lm, records, fmt, max_new_tokens=max_new_tokens, temperature=1.0, top_p=0.95, seed=seed)


def names_fact(record: dict) -> bool:
    """Whether a record names its `fact` (a non-blank string), which answers can be searched for."""
    return isinstance(record.get("fact"), str) and bool(record["fact"].strip())


def stating_fact(records: list[dict], answers: list[str]) -> list[dict]:
    """Each record (naming its fact) whose answer in `answers` states the fact, with that answer as its own and the
    fact as that answer writes it."""
    return [r | {"answer": text, "fact": text[at:at + len(r["fact"])]} for r, text in zip(records, answers)
            if (at := text.lower().find(r["fact"].lower())) >= 0]


def own_answers(lm, records: list[dict], fmt: str, max_new_tokens: int = 48, memo: dict | None = None) -> list[dict]:
    """Records naming a `fact` get the model's own greedy answer instead of theirs, and are dropped where that
    answer lacks the fact: a forget set's sentence is often not how the model says it ("... written by
    Shakespeare." where it says "William Shakespeare"), and the fact's tokens after someone else's words are
    unlikely to begin with. Records without a fact, or without a question to ask, are kept as they are."""
    named = [r for r in records if "question" in r and names_fact(r)]
    answers = dict(zip(map(id, named), greedy_answers(lm, named, fmt, max_new_tokens, memo)))
    out = []
    for r in records:
        out += stating_fact([r], [answers[id(r)]]) if id(r) in answers else [r]
    return out


def _knows(base: torch.Tensor, roles: list[str | None], known_logprob: float) -> bool:
    content = [lp for lp, role in zip(base.tolist(), roles) if role == "content"]
    return bool(content) and statistics.fmean(content) >= known_logprob


def diagnose(lm, forget: list[dict], taus=TAUS, groups: list[str] | None = None, limit: int | None = 64,
             fmt: str = "auto", known_logprob: float = math.log(0.3), on_progress=None,
             memo: dict | None = None) -> list[Setting]:
    """The drops of every candidate (tau, layers) along the facts the model knows among the first `limit`
    question/answer records of `forget` (`own_answers`), whose content tokens the base model gives a mean
    log-probability of at least `known_logprob`; each setting's `records` says how many. `on_progress(fraction)`
    is called after each setting (a job's cancellation point). `memo`: the base model's greedy answers by question
    (`greedy_answers`), shared with the training run that follows."""
    model, tok = lm.model, lm.tokenizer
    qa = [r for r in forget if "question" in r and "answer" in r][:limit]
    if not qa:
        raise ValueError("forget: the diagnostic needs question/answer records")
    fmt = resolve_format(tok, fmt)
    qa = own_answers(lm, qa, fmt, memo=memo)
    exs = [qa_example(r["question"], r["answer"], fmt, tok) for r in qa]
    roles = [token_roles(tok, ex, r["answer"].strip(), r.get("fact")) for ex, r in zip(exs, qa)]
    use_tempered_attention(model)
    base, base_top = map(list, zip(*_token_logprobs(model, tok, exs, lm.device)))
    # only facts the model knows: flattening a fact it does not know raises the gold's low probability, which
    # says nothing about forgetting (on SmolLM2's authors, unknown ones gave negative drops)
    known = [i for i, (b, row) in enumerate(zip(base, roles)) if _knows(b, row, known_logprob)]
    if not known:
        raise ValueError("forget: the model gives none of these facts a probability above "
                         f"{math.exp(known_logprob):.2f} on its content tokens")
    exs, base, roles = [exs[i] for i in known], [base[i] for i in known], [roles[i] for i in known]
    base_top = [base_top[i] for i in known]
    groups = groups or layer_groups(model.config.num_hidden_layers)
    results = []
    for layers in groups:
        chosen = parse_layers(layers, model.config.num_hidden_layers)
        for tau in taus:
            with tempered(model, tau, chosen):
                teacher, teacher_top = zip(*_token_logprobs(model, tok, exs, lm.device))
            drops = {"content": [], "other": []}
            for b, t, row in zip(base, teacher, roles):  # (encode_example's EOS, past the roles, is left out)
                for role, drop in zip(row, (b - t).tolist()):
                    if role is not None:
                        drops[role].append(drop)
            content, other = drops["content"], drops["other"]
            c = statistics.fmean(content) if content else 0.0
            o = statistics.fmean(other) if other else 0.0
            results.append(Setting(tau, layers, round(c, 3), round(o, 3), round(c / max(o, 0.01), 2), len(exs),
                                   *_flips(base_top, list(teacher_top), roles)))
            if on_progress is not None:
                on_progress(len(results) / (len(groups) * len(taus)))
    return results


def pick(settings: list[Setting], min_drop: float = 1.0, min_flips: float = 0.5) -> Setting | None:
    """The setting that changes the greedy choice of facts most beyond that of the other tokens
    (`fact_flips - other_flips`), among those that flip at least `min_flips` of the facts and lower their tokens
    by `min_drop` nats. A drop that leaves the fact the teacher's top token teaches a greedy student nothing: on
    SmolLM2 the most selective setting by nats (tau 2, layers 0-9) flipped 32% of the facts and its student kept
    every one; the pick by flips (tau 8, layers 20-29) flipped 84% and its student forgot every one (README)."""
    strong = [s for s in settings if s.content_drop >= min_drop and s.fact_flips >= min_flips]
    return max(strong, key=lambda s: (round(s.fact_flips - s.other_flips, 6), s.ratio, -s.tau)) if strong else None


def report(settings: list[Setting], min_drop: float = 1.0, min_flips: float = 0.5) -> dict:
    chosen = pick(settings, min_drop, min_flips)
    return {"settings": [asdict(s) for s in settings], "min_drop": min_drop, "min_flips": min_flips,
            "pick": asdict(chosen) if chosen else None}


def choose_teacher(lm, forget: list[dict], layers: str | None = None, fmt: str = "auto", fallback: float = 16.0,
                   on_progress=None, memo: dict | None = None) -> tuple[float, str | None, dict]:
    """The teacher an ASU job distils from when its request names no tau: `pick` over `diagnose`'s candidates on
    the forget set (in `layers` only, where given). Where no candidate qualifies, or the forget set has no
    question/answer record whose facts the model knows, `fallback` on `layers` (None: every layer). Returns (tau,
    layers, the diagnostic's report with what was chosen and why)."""
    try:
        settings = diagnose(lm, forget, groups=[layers] if layers is not None else None, fmt=fmt,
                            on_progress=on_progress, memo=memo)
    except ValueError as e:
        return fallback, layers, {"pick": None, "chosen": {"tau": fallback, "layers": layers or "all"},
                                  "reason": str(e)}
    out = report(settings)
    chosen = pick(settings)
    if chosen is None:
        return fallback, layers, out | {"chosen": {"tau": fallback, "layers": layers or "all"},
                                        "reason": "no candidate flips enough of the facts"}
    return chosen.tau, None if chosen.layers == "all" else chosen.layers, \
        out | {"chosen": {"tau": chosen.tau, "layers": chosen.layers}, "reason": "the diagnostic's pick"}
