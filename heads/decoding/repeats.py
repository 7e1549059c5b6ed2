"""The repeat guard: no word that would repeat a word n-gram of the answer so far.

A tilted model whose likeliest tokens are flagged can fall into restating itself
("The Capital of the French Empire is indeed the Capital of the French Empire").
Where a profile turns the guard on and the gate calls the context forget-like,
the decode loop drops the tokens that would say a word n-gram of the answer a
second time, as a reader counts it: tokens are compared as words, without case or
the leading space ("The" and " the" are one word), and tokens without a letter or
digit (punctuation, spaces) are skipped, as a word count skips them. Those tokens
get a guard of their own, so that a row cannot loop on them either ("Capital of:
\n- \n- \n- ..."): within the run of word-less tokens that ends the answer, no
token that would repeat an n-gram of that run, compared as tokens. A token that is
part of a character (a byte of an emoji) is never banned, so a character is never cut.
A row keeps at least one choice: if every candidate would repeat, nothing is banned.

Nor does a guarded row say a one-token word twice in a row ("The The"), which an
n-gram guard would stop only at the (n+1)-th time ("The The The" under the default
n = 3). This goes after the n-gram bans, with its own one-choice rule, so it never
lifts them. A word a sentence may double ("had had") is lost on such rows too.

It runs at every step of a guarded row: the common case (nothing to ban) is a few
list operations, and where the answer's last token is a word, a look at the scores
of the tokens that spell that word.
"""

from __future__ import annotations

import math
import re
import weakref
from dataclasses import dataclass

import numpy as np
import torch

_WORDLIKE = re.compile(r"\w")
_WORD_START = ("\u0120", "\u2581")  # byte-level BPE's "Ġ" and SentencePiece's "▁": a token that starts a word
_cache: "weakref.WeakKeyDictionary[object, WordClasses]" = weakref.WeakKeyDictionary()


@dataclass(frozen=True)
class WordClasses:
    """Per token id, the id of the word it spells (-1: no letter or digit), and per word its token ids."""

    of_token: list[int]
    tokens_of: list[list[int]]
    # tokens without a letter or digit that the run guard may ban (not the pieces of a character, not specials)
    symbols: frozenset[int] = frozenset()
    # per token id: True where the token continues the word before it (its text starts with a letter or digit, no
    # space or word-start mark before it): what the word guard (`heads.t3.tilt.guard_words`) reads
    joins: torch.Tensor | None = None
    # per token id: True where the token goes on with a character begun before it (its text starts with a byte of
    # "Р" that is not one alone), as a word start spelled in bytes goes on (what the whole-words lookahead counts as
    # going on spelling; " Р"'s first byte after a space starts a word instead)
    partial: torch.Tensor | None = None
    # per token id: True where the token starts a word (it has a letter or digit, does not join the word before, and
    # is no special token)
    starts: list[bool] | None = None

    def words(self, token_ids: list[int]) -> list[int]:
        """The answer's words, in order (tokens past the tokenizer and word-less tokens skipped)."""
        of, n = self.of_token, len(self.of_token)
        return [w for w in (of[t] if t < n else -1 for t in token_ids) if w >= 0]

    def symbol_run(self, token_ids: list[int]) -> list[int]:
        """The word-less tokens that end the answer (since its last word), in order."""
        of, n = self.of_token, len(self.of_token)
        start = len(token_ids)
        while start > 0 and token_ids[start - 1] < n and of[token_ids[start - 1]] < 0:
            start -= 1
        return token_ids[start:]

    def doubled(self, token_ids: list[int]) -> list[int]:
        """Where the answer ends with a one-token word so far (a token that starts a word, or a word that opens the
        answer or follows a word-less token: "The" after the chat template's newline): the tokens that start the
        same word, which would say it twice in a row ("The The"). Empty where `starts` is not known."""
        of, n = self.of_token, len(self.of_token)
        if self.starts is None or not token_ids or token_ids[-1] >= n or of[token_ids[-1]] < 0:
            return []
        last = token_ids[-1]
        before = token_ids[-2] if len(token_ids) > 1 else None
        if not (self.starts[last] or before is None or (before < n and of[before] < 0)):
            return []  # the token goes on with the word before it
        return [t for t in self.tokens_of[of[last]] if self.starts[t]]


def word_classes(tokenizer) -> WordClasses:
    """The tokenizer's word classes: each token lower-cased and stripped. Built once per tokenizer (about a second
    for a 50k vocabulary)."""
    cached = _cache.get(tokenizer)
    if cached is not None:
        return cached
    size = max(len(tokenizer), max(tokenizer.get_vocab().values()) + 1)
    texts = tokenizer.batch_decode([[i] for i in range(size)], skip_special_tokens=False,
                                   clean_up_tokenization_spaces=False)
    ids: dict[str, int] = {}
    of_token = [ids.setdefault(t.strip().lower(), len(ids)) if _WORDLIKE.search(t) else -1 for t in texts]
    tokens_of: list[list[int]] = [[] for _ in ids]
    for token, word in enumerate(of_token):
        if word >= 0:
            tokens_of[word].append(token)
    special = set(tokenizer.all_special_ids)
    symbols = frozenset(t for t, (w, text) in enumerate(zip(of_token, texts))
                        if w < 0 and "\ufffd" not in text and t not in special)
    pieces = tokenizer.convert_ids_to_tokens(list(range(size)))
    joins = torch.tensor([bool(text) and text[0].isalnum() and t not in special and
                          not (isinstance(piece, str) and piece.startswith(_WORD_START))
                          for t, (text, piece) in enumerate(zip(texts, pieces))])
    partial = torch.tensor([text.startswith("\ufffd") and t not in special for t, text in enumerate(texts)])
    starts = [w >= 0 and not j and t not in special for t, (w, j) in enumerate(zip(of_token, joins.tolist()))]
    classes = WordClasses(of_token, tokens_of, symbols, joins, partial, starts)
    _cache[tokenizer] = classes
    return classes


def repeat_bans(words: list[int], n: int) -> set[int]:
    """The words (class ids) that would make `words` repeat one of its own n-grams (n < 2: none)."""
    if n < 2 or len(words) < n - 1:
        return set()
    tail = words[len(words) - n + 1:]
    return {words[i + n - 1] for i in range(len(words) - n + 1) if words[i:i + n - 1] == tail}


class AnswerNgrams:
    """One answer's words, and which word followed each of its (n - 1)-grams, kept as the answer grows: a step reads
    the words `repeat_bans` would name in a few operations, not by reading the whole answer again (a guarded row
    pays this at every step)."""

    def __init__(self, classes: WordClasses, n: int):
        self.classes, self.n = classes, n
        self.read = 0  # the answer's tokens read so far
        self.words: list[int] = []
        self.after: dict[tuple[int, ...], set[int]] = {}

    def bans(self, answer: list[int]) -> set[int]:
        """`repeat_bans(classes.words(answer), n)`, reading only the tokens `answer` (which only grows) gained."""
        if len(answer) < self.read:
            raise ValueError("AnswerNgrams reads an answer that only grows")
        of, size, n, words = self.classes.of_token, len(self.classes.of_token), self.n, self.words
        for t in answer[self.read:]:
            w = of[t] if t < size else -1
            if w >= 0:
                words.append(w)
                if n >= 2 and len(words) >= n:
                    self.after.setdefault(tuple(words[len(words) - n:-1]), set()).add(w)
        self.read = len(answer)
        if n < 2 or len(words) < n - 1:
            return set()
        return set(self.after.get(tuple(words[len(words) - n + 1:]), ()))  # a copy: the kept set grows


def ban_repeats(scores: torch.Tensor | np.ndarray, answer: list[int], n: int, classes: WordClasses,
                ngrams: AnswerNgrams | None = None) -> None:
    """In place on one row's (V,) scores (a tensor, or a numpy view of a CPU one: `numpy_view`): -inf for the tokens
    whose word would repeat a word n-gram of `answer` (token ids) and the word-less tokens that would repeat an n-gram
    of the word-less run ending it, unless no finite score would be left; then, as far as a finite score is left, for
    those that would say the answer's last one-token word again right after it (`WordClasses.doubled`). `ngrams`: the
    answer's `AnswerNgrams` for this n, kept across steps (None: read the whole answer)."""
    words = ngrams.bans(answer) if ngrams is not None else repeat_bans(classes.words(answer), n)
    banned = [t for w in words for t in classes.tokens_of[w]]
    run = classes.symbol_run(answer)
    if len(run) >= n:  # a run of punctuation and spaces that says an n-gram of itself again
        banned += [t for t in repeat_bans(run, n) if t in classes.symbols]
    _ban(scores, banned)
    _ban(scores, classes.doubled(answer))


def numpy_view(scores: torch.Tensor) -> torch.Tensor | np.ndarray:
    """`scores` as a numpy view where it is a CPU float32 tensor (writes go to `scores`), which the guard's few
    operations per row read and write without tensor dispatch; else `scores`."""
    return scores.numpy() if scores.is_cpu and scores.dtype == torch.float32 else scores


FEW = 8  # a ban of at most this many tokens writes them one at a time


def _finite_left(row: np.ndarray) -> bool:
    """Whether a finite score is left in `row`: its maximum tells, in one pass, unless that is NaN or +inf."""
    top = row.max()
    return math.isfinite(top) or (top != -np.inf and bool(np.isfinite(row).any()))


def _ban(scores: torch.Tensor | np.ndarray, banned: list[int]) -> None:
    """-inf for `banned` (token ids) in one row's (V,) scores, unless no finite score would be left."""
    if not banned:
        return
    row = numpy_view(scores) if isinstance(scores, torch.Tensor) else scores
    if isinstance(row, np.ndarray):
        size = len(row)
        hit = [t for t in banned if t < size and math.isfinite(row[t])]
        if len(hit) > FEW:
            kept = row[hit]
            row[hit] = -np.inf
            if not _finite_left(row):  # nothing is banned
                row[hit] = kept
        elif hit:  # a few tokens (most steps: the one-token word said again): one at a time, cheaper than numpy's
            kept = [row[t] for t in hit]  # indexing with a list
            for t in hit:
                row[t] = -np.inf
            if not _finite_left(row):
                for t, value in zip(hit, kept):
                    row[t] = value
        return
    ids = torch.tensor([t for t in banned if t < scores.size(0)], dtype=torch.long, device=scores.device)
    if len(ids) == 0 or not bool(torch.isfinite(scores[ids]).any()):
        return  # no banned word is a candidate
    kept = scores.index_fill(0, ids, float("-inf"))
    if bool(torch.isfinite(kept).any()):
        scores.copy_(kept)
