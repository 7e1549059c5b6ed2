"""The repeat guard: no word that would repeat a word n-gram of the answer so far.

A tilted model whose likeliest tokens are flagged can fall into restating itself
("The Capital of the French Empire is indeed the Capital of the French Empire").
Where a profile turns the guard on and the gate calls the context forget-like,
the decode loop drops the candidates that would say a word n-gram of the answer
a second time, as a reader counts it: tokens are compared as words, without case
or the leading space ("The" and " the" are one word), and tokens without a letter
or digit (punctuation, spaces) are skipped, as a word count skips them. A row
keeps at least one choice: if every candidate would repeat, nothing is banned.
"""

from __future__ import annotations

import re
import weakref

import torch

_WORDLIKE = re.compile(r"\w")
_cache: "weakref.WeakKeyDictionary[object, torch.Tensor]" = weakref.WeakKeyDictionary()


def word_classes(tokenizer) -> torch.Tensor:
    """(V,) long: per token id, the id of the word it spells (lower-cased, stripped), or -1 for a token with no
    letter or digit. Built once per tokenizer (about a second for a 50k vocabulary)."""
    cached = _cache.get(tokenizer)
    if cached is not None:
        return cached
    size = max(len(tokenizer), max(tokenizer.get_vocab().values()) + 1)
    texts = tokenizer.batch_decode([[i] for i in range(size)], skip_special_tokens=False,
                                   clean_up_tokenization_spaces=False)
    ids: dict[str, int] = {}
    classes = torch.tensor([ids.setdefault(t.strip().lower(), len(ids)) if _WORDLIKE.search(t) else -1
                            for t in texts], dtype=torch.long)
    _cache[tokenizer] = classes
    return classes


def repeat_bans(words: list[int], n: int) -> set[int]:
    """The words (class ids) that would make `words` repeat one of its own n-grams (n < 2: none)."""
    if n < 2 or len(words) < n - 1:
        return set()
    tail = words[len(words) - n + 1:]
    return {words[i + n - 1] for i in range(len(words) - n + 1) if words[i:i + n - 1] == tail}


def _class_of(ids: torch.Tensor, classes: torch.Tensor) -> torch.Tensor:
    """Word ids of token ids; -1 for an id past the tokenizer (a model's padded vocabulary)."""
    ids = ids.cpu()
    inside = ids < len(classes)
    return torch.where(inside, classes[ids.clamp(max=len(classes) - 1)], -1)


def ban_repeats(scores: torch.Tensor, answer: list[int], n: int, classes: torch.Tensor) -> None:
    """In place on one row's (V,) scores: -inf for the candidates (finite scores) whose word would repeat a word
    n-gram of `answer` (token ids), unless that would leave the row no candidate."""
    if not answer:
        return
    words = [c for c in _class_of(torch.tensor(answer), classes).tolist() if c >= 0]
    banned = repeat_bans(words, n)
    if not banned:
        return
    finite = torch.isfinite(scores).nonzero().flatten()
    look = finite if len(finite) <= 1000 else scores.topk(1000).indices  # the whole vocabulary: the likeliest
    hit = torch.tensor([c in banned for c in _class_of(look, classes).tolist()], dtype=torch.bool)
    if not bool(hit.any()) or (bool(hit.all()) and len(look) == len(finite)):
        return
    scores[look[hit.to(look.device)]] = float("-inf")
