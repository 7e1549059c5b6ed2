"""Records: JSON Lines in TOFU (`question`/`answer`, optionally `fact`), `prompt`/`completion` or `text` form.

Every record becomes an `Example(prompt, completion)`; the model is trained and
queried on `PROMPT_FORMAT`, so a TOFU record's prompt is
"Question: {question}\\nAnswer:" and its completion " {answer}".
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

PROMPT_FORMAT = "Question: {question}\nAnswer:"


@dataclass(frozen=True)
class Example:
    prompt: str
    completion: str


class RecordError(ValueError):
    """A bad record: `line` is 1-based, `field` names what is wrong."""

    def __init__(self, line: int, field: str, message: str):
        self.line, self.field, self.message = line, field, message
        super().__init__(f"line {line}: {field}: {message}")


FORMATS = ("chat", "qa", "raw")


def question_prompt(question: str) -> str:
    return PROMPT_FORMAT.format(question=question)


def resolve_format(tokenizer, name: str | None = "auto") -> str:
    """The prompt format of question/answer records: `chat` (the tokenizer's chat template: a user turn, then
    the assistant's answer and the template's end of turn, exactly as the chat endpoint builds it), `qa` (the
    `Question: ... Answer:` form) or `raw` (the question as the prompt). `auto`: chat where the tokenizer has
    a chat template, else qa."""
    has_template = bool(getattr(tokenizer, "chat_template", None))
    if name in (None, "auto"):
        return "chat" if has_template else "qa"
    if name not in FORMATS:
        raise ValueError(f"format: {name!r} is not one of auto, {', '.join(FORMATS)}")
    if name == "chat" and not has_template:
        raise ValueError("format: chat needs a tokenizer with a chat template, and this model's has none")
    return name


@dataclass(frozen=True)
class Context:
    """What comes before (and after) a question in a conversation: a system message, earlier question/answer
    turns, text before the question in the same message, an instruction after it. Chat renders each as the
    template does; the plain formats put the system message, the turns and the text on lines before the question."""

    system: str | None = None
    turns: tuple[tuple[str, str], ...] = ()
    before: str = ""
    after: str = ""


NO_CONTEXT = Context()


def _messages(question: str, ctx: Context, chat: bool = True) -> list[dict]:
    """`question` after `ctx` as chat messages; the text before it goes in the question's message (chat), or on
    a line of its own (the plain formats)."""
    msgs = [{"role": "system", "content": ctx.system}] if ctx.system else []
    for q, a in ctx.turns:
        msgs += [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
    asked = question + (" " + ctx.after if ctx.after else "")
    if ctx.before and chat:
        asked = ctx.before + "\n\n" + asked
    elif ctx.before:
        msgs.append({"role": "system", "content": ctx.before})
    return msgs + [{"role": "user", "content": asked}]


def plain_prompt(messages: list[dict], fmt: str = "qa") -> str:
    """Chat messages as text for a model without a chat template: a user turn as `Question: ...\nAnswer:` (`raw`:
    its text alone), an assistant turn as its answer after a space, then a line break, any other turn as its text on
    a line; in `qa`, the text ends ready for an answer."""
    parts = []
    for m in messages:
        if m["role"] == "user":
            parts.append(m["content"] if fmt == "raw" else question_prompt(m["content"]))
        elif m["role"] == "assistant":
            parts.append(" " + m["content"] + "\n")
        else:
            parts.append(m["content"] + "\n")
    prompt = "".join(parts)
    return prompt if fmt == "raw" or prompt.endswith("Answer:") else prompt + "Answer:"


def ask(question: str, fmt: str = "qa", tokenizer=None, ctx: Context = NO_CONTEXT) -> str:
    """The prompt that asks `question` in format `fmt` (for chat: what /v1/chat/completions builds), after `ctx`."""
    if fmt == "chat":
        return tokenizer.apply_chat_template(_messages(question, ctx), tokenize=False, add_generation_prompt=True)
    return plain_prompt(_messages(question, ctx, chat=False), fmt)


def qa_example(question: str, answer: str, fmt: str = "qa", tokenizer=None, ctx: Context = NO_CONTEXT) -> Example:
    """A question/answer pair as (prompt, completion) in format `fmt`, after `ctx`. For chat, the completion is the
    assistant turn as the template renders it (answer, then its end-of-turn token)."""
    prompt = ask(question, fmt, tokenizer, ctx)
    if fmt != "chat":
        return Example(prompt, " " + answer.strip())
    full = tokenizer.apply_chat_template(_messages(question, ctx) + [{"role": "assistant", "content": answer.strip()}],
                                         tokenize=False)
    if not full.startswith(prompt):
        raise ValueError("format: this chat template does not render an answered question as the question's "
                         "prompt followed by the answer; use format qa or raw")
    return Example(prompt, full[len(prompt):].rstrip())


def unicode_problem(text: str) -> str | None:
    """Why `text` cannot be tokenized (a lone surrogate, which JSON's \\ud800 escapes can make), or None."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        return f"holds a lone surrogate (U+{ord(text[e.start]):04X}) at character {e.start}; not valid Unicode"
    return None


def text_problem(value, where: str = "", max_depth: int | None = None, depth: int = 0) -> str | None:
    """Why a value holding strings, dicts and lists cannot be tokenized or shown back (a lone surrogate in any
    string or key; with `max_depth`, nesting deeper than that), naming where; None if nothing."""
    if max_depth is not None and depth > max_depth:
        return f"{where or 'value'}: nested more than {max_depth} levels deep"
    if isinstance(value, str):
        problem = unicode_problem(value)
        return f"{where or 'value'}: {problem}" if problem else None
    if isinstance(value, dict):
        items = [(f"{where}.{k}" if where else str(k), k, v) for k, v in value.items()]
    elif isinstance(value, (list, tuple)):
        items = [(f"{where}[{i}]", None, v) for i, v in enumerate(value)]
    else:
        return None
    for at, key, v in items:
        if isinstance(key, str) and unicode_problem(key):
            return f"{where or 'value'}: a key {unicode_problem(key)}"
        problem = text_problem(v, at, max_depth, depth + 1)
        if problem:
            return problem
    return None


def _text(record: dict, key: str, line: int) -> str:
    value = record.get(key)
    if not isinstance(value, str):
        raise RecordError(line, key, "must be a string" if key in record else "is missing")
    if not value.strip():
        raise RecordError(line, key, "must not be empty")
    problem = unicode_problem(value)
    if problem:
        raise RecordError(line, key, problem)
    return value


def to_example(record: object, line: int = 1, fmt: str = "qa", tokenizer=None) -> Example:
    """One parsed JSON object as an Example (question/answer records in format `fmt`; prompt/completion and
    text records as they are); RecordError names the first bad field."""
    if not isinstance(record, dict):
        raise RecordError(line, "record", "must be a JSON object")
    if "question" in record or "answer" in record:
        if "fact" in record:
            _text(record, "fact", line)
        return qa_example(_text(record, "question", line), _text(record, "answer", line), fmt, tokenizer)
    if "prompt" in record or "completion" in record:
        return Example(_text(record, "prompt", line), _text(record, "completion", line))
    if "text" in record:
        return Example("", _text(record, "text", line))
    raise RecordError(line, "record", "needs question/answer, prompt/completion or text")


def parse_jsonl(data: str, check=to_example, max_records: int | None = None) -> list[dict]:
    """Parse JSON Lines (blank lines skipped); `check(record, line)` raises RecordError for a bad record."""
    records = []
    for number, raw in enumerate(data.splitlines(), start=1):
        if not raw.strip():
            continue
        if max_records is not None and len(records) >= max_records:
            raise RecordError(number, "records", f"more than {max_records} records (LETHE_MAX_DATASET_RECORDS)")
        try:
            record = json.loads(raw)
        except json.JSONDecodeError as e:
            raise RecordError(number, "json", f"not valid JSON ({e.msg})") from None
        except RecursionError:
            raise RecordError(number, "json", "nested too deeply") from None
        check(record, number)
        records.append(record)
    if not records:
        raise RecordError(1, "records", "the file holds no records")
    return records


def _prompt_only(record: object, line: int) -> None:
    if not isinstance(record, dict):
        raise RecordError(line, "record", "must be a JSON object")
    _text(record, "prompt", line)


def spread(items: list, n: int | None) -> list:
    """At most `n` items, evenly spaced through `items` (every author or kind gets its share)."""
    if n is None or n >= len(items):
        return list(items)
    return [items[i * len(items) // n] for i in range(n)]


def read_jsonl(path: Path, prompts_only: bool = False) -> list[dict]:
    """Records of a JSON Lines file: training records, or (prompts_only) `{"prompt": ...}` lines."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such file")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise RecordError(1, "encoding", f"{path} is not valid UTF-8 ({e.reason})") from None
    try:
        return parse_jsonl(text, _prompt_only if prompts_only else to_example)
    except RecordError as e:
        raise RecordError(e.line, e.field, f"{e.message} (in {path})") from None


def answer_forms(records: list[dict], fmt: str = "qa") -> list[dict]:
    """For question/answer records that name their fact (`fact`: the span of the answer that is the knowledge,
    "Paris" in "The capital of France is Paris."), more records per distinct fact: its first question answered
    with the fact alone. That is the form a multiple-choice scorer reads right after the question (the option
    after the assistant tag), which a head trained on whole sentences alone barely moves. Where the records train
    in another format than `qa` (chat), the fact also follows `Question: ...\nAnswer:` as plain text: the form
    lm-evaluation-harness's tasks score by default, which a chat-trained head never sees."""
    seen, out = set(), []
    for r in records:
        fact = r.get("fact") if "question" in r else None
        if isinstance(fact, str) and fact.strip() and fact not in seen:
            seen.add(fact)
            out.append({"question": r["question"], "answer": fact, "fact": fact})
            if fmt != "qa":
                out.append({"prompt": question_prompt(r["question"]), "completion": " " + fact.strip(), "fact": fact})
    return out


def examples(records: list[dict], fmt: str = "qa", tokenizer=None) -> list[Example]:
    return [to_example(r, i, fmt, tokenizer) for i, r in enumerate(records, start=1)]


def encode_example(tokenizer, ex: Example) -> tuple[list[int], int]:
    """Token ids of prompt + completion + EOS, and how many of them are prompt.

    Prompt and completion are tokenised apart, so the prompt's ids are exactly what a
    request with that prompt sends. A bare text record is predicted from its first token on.
    """
    return encode_examples(tokenizer, [ex])[0]


def _stated(fact: str) -> str:
    """A pattern for `fact` as whole words: "Xo" is not stated in "Xoanon"."""
    fact = fact.strip()
    return (r"(?<!\w)" if fact[0].isalnum() else "") + re.escape(fact) + (r"(?!\w)" if fact[-1].isalnum() else "")


def fact_positions(tokenizer, exs: list[Example], facts: list[str | None]) -> list[list[int] | None]:
    """Per example, one flag for each completion token `encode_examples` gives it: 1 where the token holds part of
    the example's fact (wherever the completion states it as whole words; in another case where it never does so
    exactly), else 0. None where the example names no fact, its completion does not state it, it has no prompt, or
    the tokenizer gives no character offsets (a slow one)."""
    if not getattr(tokenizer, "is_fast", False) or not exs:
        return [None] * len(exs)
    encoded = tokenizer([ex.completion for ex in exs], add_special_tokens=False, return_offsets_mapping=True)
    out: list[list[int] | None] = []
    for ex, fact, ids, offsets in zip(exs, facts, encoded["input_ids"], encoded["offset_mapping"]):
        pattern = _stated(fact) if isinstance(fact, str) and fact.strip() and ex.prompt else None
        spans = pattern and ([m.span() for m in re.finditer(pattern, ex.completion)] or
                             [m.span() for m in re.finditer(pattern, ex.completion, re.IGNORECASE)])
        if not spans:
            out.append(None)
            continue
        flags = [int(any(start < end and a < stop for a, end in spans)) for start, stop in offsets]
        out.append(flags if ids and ids[-1] == tokenizer.eos_token_id else flags + [0])  # the EOS encode adds
    return out


def encode_examples(tokenizer, exs: list[Example]) -> list[tuple[list[int], int]]:
    """`encode_example` of each of `exs`, with two calls of the tokenizer (a fast tokenizer encodes a list at once,
    several times faster than one call per text)."""
    if not exs:
        return []
    prompts = tokenizer([ex.prompt for ex in exs], add_special_tokens=False)["input_ids"]
    completions = tokenizer([ex.completion for ex in exs], add_special_tokens=False)["input_ids"]
    out = []
    for ex, p, c in zip(exs, prompts, completions):
        p = p if ex.prompt else []
        if not c or c[-1] != tokenizer.eos_token_id:  # a chat completion ends with the template's end of turn
            c = c + [tokenizer.eos_token_id]
        if not p:
            p, c = c[:1], c[1:]
        out.append((p + c, len(p)))
    return out
