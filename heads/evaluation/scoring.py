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
from lethe.heads.t3.guide import TiltSettings, whole_vocabulary
from lethe.heads.t3.head import T3Head
from lethe.heads.t3.pooling import pooled_positions
from lethe.heads.records import Example, encode_example


@torch.inference_mode()
def completion_nll(model, tokenizer, examples: list[Example], head: T3Head | None = None,
                   settings: TiltSettings | None = None, batch_size: int = 32, include_eos: bool = False) -> list[float]:
    """Mean NLL per completion token (EOS excluded unless asked), one value per example."""
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
