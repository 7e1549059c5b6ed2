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


# wordfreq's lists hold web text's fragments too ("ine", "ard", "sm": Zipf 2.9-3.7), as short as the pieces a
# tilted model glues onto a name. A word of 4 letters or more counts from Zipf 2 (0.1 per million words: "isfahan"
# 2.5, "tehran" 3.6; "londen" 1.4 and "egypto" 0 stay non-words), a shorter one only from Zipf 4.5 ("uk" 5.1, "usa"
# 4.8; "ive" 4.0, "ou" 3.8 in English stay non-words)
FREQUENT_ZIPF, SHORT_LETTERS, SHORT_ZIPF = 2.0, 4, 4.5


class KnownWords:
    """What the non-word rate counts as a word: a word of the English lists (the `english-words` package's web2 and
    GCIDE, lower case), with the regular inflections of a listed word (-s, -es, -ies, -ed, -ing, -'s); a word that
    wordfreq's frequency lists (Wikipedia, subtitles, news, books and web text) hold in English or in one of
    `languages` (ISO 639-1 codes) often enough (FREQUENT_ZIPF; SHORT_ZIPF below SHORT_LETTERS letters): the place
    and person names and the other languages' words the English lists lack ("africa", "oslo", "uk", "tehran";
    "hauptstadt", "ciudad"), while a stitched fragment ("bratisl", "dredrougpbinary", "ine") is not; or one of
    `extra`: words of the model's own world (the demo's made-up names and places, which are
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
            least = SHORT_ZIPF if len(w) < SHORT_LETTERS else FREQUENT_ZIPF
            self._seen[w] = any(self._frequency(w, lang) >= least for lang in self.languages)
        return self._seen[w]
