"""Text metrics shared by training checks and evaluation."""

from __future__ import annotations

from functools import lru_cache


@lru_cache(maxsize=1)
def _scorer():
    from rouge_score import rouge_scorer

    return rouge_scorer.RougeScorer(["rougeL"], use_stemmer=True)


def rouge_l_recall(reference: str, generated: str) -> float:
    """ROUGE-L recall of `generated` against `reference`, stemmer on (TOFU's ROUGE)."""
    return _scorer().score(reference, generated)["rougeL"].recall
