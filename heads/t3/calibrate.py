"""The head's recommended `head_gate`, calibrated on the base model's own retain answers when the head is trained.

`head_gate` t opens the gate at a step whose base-likeliest token the head scores below -t, whatever the probe read
from the context (`heads.t3.guide.TiltSettings.head_gate`): it catches a forget question the earlier turns made look
retain-like. One t does not fit every model. On the demo, t = 2 caught the leaks after two retain turns (0.15 ->
0.025) and changed no more retain answers; on SmolLM2 it changed a fifth of them (retain answers identical 0.80
where they were 1.00): the head reads the model's own wording there, which the sets' answers do not show. So the
head job answers up to `n` retain questions greedily with the base model, reads the head's logit of each token
those answers chose, step by step, on the pooled states decoding has there, and recommends t one nat past the
lowest: no answer it read would have opened the gate.
"""

from __future__ import annotations

import torch

from lethe.heads.records import spread
from lethe.heads.t3.head import T3Head

MARGIN = 1.0  # nats past the lowest logit seen
MAX_GATE = 100.0  # TiltSettings' bound


def asked(records: list[dict], n: int) -> list[dict]:
    """Up to `n` records with distinct questions, evenly spread through `records` (each subject gets its share)."""
    return spread(list({r["question"]: r for r in records if isinstance(r.get("question"), str)}.values()), n)


class _Reader:
    """A guide that leaves the logits as they are (greedy decoding then picks the base model's argmax) and keeps, at
    every step, the head's logit of that token for every row, on the pooled states decoding has there."""

    def __init__(self, head: T3Head):
        self.head, self.steps = head, []

    def __call__(self, logits: torch.Tensor, pooled: torch.Tensor) -> torch.Tensor:
        # decode_terms: the head's weights on the model's device (a head trained on the CPU serves a GPU model)
        self.steps.append(self.head.decode_terms(pooled.float(), logits.argmax(-1)[:, None])[1][:, 0].cpu())
        return logits

    def row(self, i: int):  # every row's head: decoding pools over its window
        from lethe.heads.t3.guide import TiltSettings

        return self.head, TiltSettings()


@torch.inference_mode()
def lowest_chosen_logit(lm, head: T3Head, questions: list[dict], fmt: str, max_new_tokens: int = 32,
                        on_progress=None, batch_size: int = 64) -> float | None:
    """The lowest head logit of a token the base model chose, step by step, in its greedy answers to `questions`
    (the end-of-text token too, where an answer ended with it; the first `max_new_tokens` of a longer one): the logit
    `head_gate` reads at those steps, read while the answers decode (no second pass of the model). None: no step.
    `on_progress(fraction)` is called before each batch of `batch_size` answers and after it (it may raise to
    stop)."""
    from lethe.heads.decoding.decode import generate
    from lethe.heads.decoding.sampling import SamplingParams
    from lethe.heads.records import ask

    prompts = [ask(r["question"], fmt, lm.tokenizer) for r in questions]
    report, lowest = on_progress or (lambda fraction: None), None
    greedy = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0)
    for start in range(0, len(prompts), batch_size):
        report(start / len(prompts))
        reader = _Reader(head)
        said = generate(lm.model, lm.tokenizer, prompts[start:start + batch_size], greedy, reader)
        read = torch.stack(reader.steps, 1) if reader.steps else None  # (rows, steps): every row at every step
        for i, answer in enumerate(said):
            steps = len(answer.token_ids) + (answer.finish_reason == "stop")  # the step that chose end-of-text too
            if answer.finish_reason not in ("stop", "length") or not steps:  # a row that failed: nothing to read
                continue
            low = float(read[i, :steps].min())
            lowest = low if lowest is None else min(lowest, low)
        report(min(1.0, (start + batch_size) / len(prompts)))
    return lowest


def head_gate_for(lowest: float | None) -> float:
    """The recommended head_gate: `MARGIN` past the lowest logit seen on retain answers (0, off, where none was)."""
    return 0.0 if lowest is None else round(min(MAX_GATE, MARGIN + max(0.0, -lowest)), 2)
