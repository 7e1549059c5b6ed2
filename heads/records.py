"""Records: JSON Lines in TOFU (`question`/`answer`), `prompt`/`completion` or `text` form.

Every record becomes an `Example(prompt, completion)`; the model is trained and
queried on `PROMPT_FORMAT`, so a TOFU record's prompt is
"Question: {question}\\nAnswer:" and its completion " {answer}".
"""

from __future__ import annotations

import json
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


def question_prompt(question: str) -> str:
    return PROMPT_FORMAT.format(question=question)


def unicode_problem(text: str) -> str | None:
    """Why `text` cannot be tokenized (a lone surrogate, which JSON's \\ud800 escapes can make), or None."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        return f"holds a lone surrogate (U+{ord(text[e.start]):04X}) at character {e.start}; not valid Unicode"
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


def to_example(record: object, line: int = 1) -> Example:
    """One parsed JSON object as an Example; RecordError names the first bad field."""
    if not isinstance(record, dict):
        raise RecordError(line, "record", "must be a JSON object")
    if "question" in record or "answer" in record:
        return Example(question_prompt(_text(record, "question", line)), " " + _text(record, "answer", line).strip())
    if "prompt" in record or "completion" in record:
        return Example(_text(record, "prompt", line), _text(record, "completion", line))
    if "text" in record:
        return Example("", _text(record, "text", line))
    raise RecordError(line, "record", "needs question/answer, prompt/completion or text")


def parse_jsonl(data: str, check=to_example) -> list[dict]:
    """Parse JSON Lines (blank lines skipped); `check(record, line)` raises RecordError for a bad record."""
    records = []
    for number, raw in enumerate(data.splitlines(), start=1):
        if not raw.strip():
            continue
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


def examples(records: list[dict]) -> list[Example]:
    return [to_example(r, i) for i, r in enumerate(records, start=1)]


def encode_example(tokenizer, ex: Example) -> tuple[list[int], int]:
    """Token ids of prompt + completion + EOS, and how many of them are prompt.

    Prompt and completion are tokenised apart, so the prompt's ids are exactly what a
    request with that prompt sends. A bare text record is predicted from its first token on.
    """
    p = tokenizer(ex.prompt, add_special_tokens=False)["input_ids"] if ex.prompt else []
    c = tokenizer(ex.completion, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    if not p:
        p, c = c[:1], c[1:]
    return p + c, len(p)
