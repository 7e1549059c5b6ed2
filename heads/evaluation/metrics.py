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


class KnownWords:
    """What the non-word rate counts as a word: a word of the English lists (the `english-words` package's web2 and
    GCIDE, lower case), with the regular inflections of a listed word (-s, -es, -ies, -ed, -ing, -'s); a word that
    wordfreq's frequency lists (Wikipedia, subtitles, news, books and web text) hold in English or in one of
    `languages` (ISO 639-1 codes): the place and person names and the other languages' words the English lists lack
    ("africa", "oslo", "tehran"; "hauptstadt", "ciudad"), while a stitched fragment ("bratisl", "dredrougpbinary") is
    in neither; or one of `extra`: words of the model's own world (the demo's made-up names and places, which are
    words of the corpus it learnt)."""

    def __init__(self, extra: Iterable[str] = (), languages: Iterable[str] = ()):
        try:
            from english_words import get_english_words_set
            from wordfreq import zipf_frequency
        except ImportError:
            raise ImportError("the non-word rate needs the `english-words` and `wordfreq` packages: "
                              "pip install 'lethe[bench]'") from None
        self.words = get_english_words_set(["web2", "gcide"], lower=True) | {w.lower() for w in extra}
        self.languages = ("en", *sorted(set(languages) - {"en"}))
        self._frequency, self._seen = zipf_frequency, {}

    def __contains__(self, word: str) -> bool:
        w, known = word.lower(), self.words
        if w in known:
            return True
        for suffix, repl in (("'s", ""), ("ies", "y"), ("es", ""), ("s", ""), ("ed", ""), ("ed", "e"),
                             ("ing", ""), ("ing", "e")):
            if w.endswith(suffix) and len(w) > len(suffix) + 1 and w[: -len(suffix)] + repl in known:
                return True
        if w not in self._seen:
            self._seen[w] = any(self._frequency(w, lang) > 0 for lang in self.languages)
        return self._seen[w]
