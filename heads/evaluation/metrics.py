"""Text metrics shared by training checks and evaluation."""

from __future__ import annotations

from collections.abc import Iterable
from functools import lru_cache


@lru_cache(maxsize=1)
def _scorer():
    from rouge_score import rouge_scorer

    return rouge_scorer.RougeScorer(["rougeL"], use_stemmer=True)


def rouge_l_recall(reference: str, generated: str) -> float:
    """ROUGE-L recall of `generated` against `reference`, stemmer on (TOFU's ROUGE)."""
    return _scorer().score(reference, generated)["rougeL"].recall


LOOP = __import__("re").compile(r"(.{1,4}?)\1{4,}", __import__("re").S)


def has_loop(text: str) -> bool:
    """A degenerate loop: a unit of 1-4 characters repeated five or more times in a row."""
    return LOOP.search(text) is not None


class EnglishWords:
    """English words (the `english-words` package's web2 and GCIDE lists, lower case) with the regular
    inflections of a listed word (-s, -es, -ies, -ed, -ing, -'s) counted as words too. `extra`: words of the model's
    own world that count too (the demo's made-up names and places, which are words of the corpus it learnt)."""

    def __init__(self, extra: Iterable[str] = ()):
        try:
            from english_words import get_english_words_set
        except ImportError:
            raise ImportError("the non-word rate needs the `english-words` package: pip install 'lethe[bench]'") \
                from None
        self.words = get_english_words_set(["web2", "gcide"], lower=True) | {w.lower() for w in extra}

    def __contains__(self, word: str) -> bool:
        w, known = word.lower(), self.words
        if w in known:
            return True
        for suffix, repl in (("'s", ""), ("ies", "y"), ("es", ""), ("s", ""), ("ed", ""), ("ed", "e"),
                             ("ing", ""), ("ing", "e")):
            if w.endswith(suffix) and len(w) > len(suffix) + 1 and w[: -len(suffix)] + repl in known:
                return True
        return False
