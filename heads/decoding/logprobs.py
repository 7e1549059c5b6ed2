"""Log-probabilities of tokens, as OpenAI's `logprobs` report them: each token's, and the likeliest others'.

What they are the log-probabilities of:
* a generated token: the distribution of the step that chose it, after the profile's tilt, the repeat guard,
  a forced reply and the penalties (what the row samples from), before the caller's own temperature, top-k,
  top-p and min-p, as OpenAI and vLLM report them. A default profile tilts among its candidates, so tokens
  outside them have no probability (reported as `FLOOR`, JSON having no infinity).
* a prompt token (`echo` with logprobs): the profile's distribution over the whole vocabulary at that position
  (`heads.t3.guide.whole_vocabulary`, as `lethe eval` scores answers), so every token has a finite log-probability,
  a forgotten answer included.
* "untilted" ones (a Lethe extension): the base model's own distribution at the same positions.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from functools import lru_cache

import torch

from lethe.heads.t3.pooling import pooled_positions

FLOOR = -9999.0  # vLLM's stand-in for minus infinity
PROMPT_CHUNK = 256  # prompt positions through the LM head at a time (each a vocabulary of floats)


@dataclass
class TokenLogprob:
    token: int
    logprob: float
    top: list[tuple[int, float]]  # the likeliest tokens at this position, likeliest first (as many as asked)


def _finite(value: float) -> float:
    return FLOOR if math.isnan(value) or value < FLOOR else value


def token_logprobs(scores: torch.Tensor, tokens: torch.Tensor, top: int) -> list[TokenLogprob]:
    """Per position (a row of `scores`, (n, V) logits or log-probabilities), the log-probability of its token
    in `tokens` (n,) and the `top` likeliest tokens."""
    logp = torch.log_softmax(scores.float(), dim=-1)
    chosen = logp.gather(1, tokens[:, None].long())[:, 0].tolist()
    if top:
        values, ids = logp.topk(min(top, logp.size(-1)), dim=-1)
        alternatives = [[(t, _finite(v)) for t, v in zip(i, vs)] for i, vs in zip(ids.tolist(), values.tolist())]
    else:
        alternatives = [[] for _ in chosen]
    return [TokenLogprob(t, _finite(v), a) for t, v, a in zip(tokens.tolist(), chosen, alternatives)]


def prompt_logprobs(logits_at, hidden: torch.Tensor, ids: torch.Tensor, top: int, guided=None,
                    untilted: bool = False, window: int = 0
                    ) -> tuple[list[TokenLogprob | None], list[TokenLogprob | None] | None]:
    """A prompt's own tokens scored: `hidden` (L, d) its final hidden states, `logits_at(span)` the base logits
    at a slice of its positions (float32), `ids` (L,) its tokens. The first
    token has no log-probability (None), as in OpenAI's answers. `guided(logits, pooled)` turns the base
    logits at some positions into the profile's (None: no profile), from states pooled over `window` positions
    (`heads.t3.pooling`; 0: the whole context). Returns (scored, untilted or None)."""
    pooled = pooled_positions(hidden, window) if guided is not None else None
    scored: list[TokenLogprob | None] = [None]
    base: list[TokenLogprob | None] | None = [None] if untilted else None
    for start in range(0, len(ids) - 1, PROMPT_CHUNK):
        span = slice(start, min(start + PROMPT_CHUNK, len(ids) - 1))
        logits = logits_at(span)
        targets = ids[span.start + 1:span.stop + 1]
        if base is not None:
            base += token_logprobs(logits, targets, top)
        scored += token_logprobs(logits if guided is None else guided(logits, pooled[span]), targets, top)
    return scored, base


_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # SentencePiece's byte fallback


@lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    return {c: b for b, c in bytes_to_unicode().items()}


def token_bytes(tokenizer, token: int) -> bytes:
    """A token's own bytes, which may be part of one UTF-8 character (decoding such a token alone gives U+FFFD):
    byte-level BPE pieces mapped back to bytes, SentencePiece byte tokens as their byte, else the token's text."""
    piece = tokenizer.convert_ids_to_tokens(token)
    if isinstance(piece, str):
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is not None and type(backend.decoder).__name__ == "ByteLevel":
            decoder = _byte_decoder()
            if all(c in decoder for c in piece):
                return bytes(decoder[c] for c in piece)
        match = _BYTE_TOKEN.fullmatch(piece)
        if match:
            return bytes([int(match.group(1), 16)])
    return tokenizer.decode([token]).encode("utf-8")
