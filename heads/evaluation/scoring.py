"""Teacher-forced scoring: the mean per-token NLL of completions under a model, with or without a T3 head.

With a head, each position's distribution is the profile's guided one
(`heads.t3.guide.whole_vocabulary`, without the candidate restriction: like top-k, that is a
decoding truncation, and a truncated distribution gives some answers zero
probability). The pooled state at each position is the running mean of the
final hidden states up to it (or over the head's window), exactly as during decoding.
"""

from __future__ import annotations

import torch

from lethe.heads.decoding.decode import forward_last_hidden, right_padded
from lethe.heads.t3.guide import TiltSettings, on_adapter, whole_vocabulary
from lethe.heads.t3.head import T3Head
from lethe.heads.t3.pooling import pooled_positions
from lethe.heads.records import Example, encode_example


@torch.inference_mode()
def completion_nll(model, tokenizer, examples: list[Example], head: T3Head | None = None,
                   settings: TiltSettings | None = None, batch_size: int = 32, include_eos: bool = False,
                   adapter: str | None = None) -> list[float]:
    """Mean NLL per completion token (EOS excluded unless asked), one value per example.

    `adapter`: the ASU adapter (attached to `model`) the profile scores with; None: the base weights. With a head
    whose settings route (`adapter_above` > 0), an example scores on the base weights where the head's probe, reading
    the whole example there, gives P(forget) at most that (`heads.t3.guide.on_adapter`), as served scoring (echo)
    routes its prompt, the scored text: each option of a question on its own. Set for every batch: generation leaves
    a model in its last batch's state."""
    from lethe.heads.asu.weights import adapters

    device = next(model.parameters()).device
    out: list[float] = [0.0] * len(examples)
    encoded = [encode_example(tokenizer, ex) for ex in examples]
    if not include_eos:
        encoded = [(ids[:-1], n) for ids, n in encoded]
    order = sorted(range(len(encoded)), key=lambda i: len(encoded[i][0]))
    lm_head = model.get_output_embeddings()
    for b in range(0, len(order), batch_size):
        idx = order[b:b + batch_size]
        ids, mask = right_padded([encoded[i][0] for i in idx], tokenizer.pad_token_id or 0)
        ids, mask, width = ids.to(device), mask.to(device), ids.size(1)
        positions = torch.arange(width, device=device).expand(len(idx), width)
        names = _routes(model, head, settings, adapter, (ids, mask, positions), [len(encoded[i][0]) for i in idx])
        with adapters(model, names):
            hidden = forward_last_hidden(model, ids, mask, positions, None)
        for r, i in enumerate(idx):
            seq, n_prompt = encoded[i]
            span = slice(n_prompt - 1, len(seq) - 1)  # positions that predict completion tokens
            logits = lm_head(hidden[r, span]).float()
            if head is not None:
                pooled = pooled_positions(hidden[r, : len(seq) - 1], head.window)[span]
                logits = whole_vocabulary(head, settings or TiltSettings(), logits, pooled)
            target = ids[r, n_prompt:len(seq)]
            out[i] = float(torch.nn.functional.cross_entropy(logits, target))
    return out


def _routes(model, head: T3Head | None, settings: TiltSettings | None, adapter: str | None, batch: tuple,
            lengths: list[int]) -> list[str]:
    """The adapter each of a batch's examples scores with (`__base__`: none); `batch`: its right-padded (ids, mask,
    positions)."""
    if adapter is None:
        return ["__base__"] * len(lengths)
    if head is None or settings is None or settings.adapter_above <= 0:
        return [adapter] * len(lengths)
    from lethe.heads.asu.weights import adapters

    with adapters(model, ["__base__"] * len(lengths)):
        base = forward_last_hidden(model, *batch, None)
    pooled = torch.stack([pooled_positions(base[r, :n], head.window)[-1] for r, n in enumerate(lengths)])
    return [adapter if on else "__base__" for on in on_adapter(head, settings, pooled)]
