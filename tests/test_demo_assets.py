"""The shipped demo: the memorising model, its retain-only twin and the corpus they were built from."""

from pathlib import Path

import pytest

from lethe.heads.demo.build import greedy_recall
from lethe.heads.demo.corpus import make_corpus, split_by_author
from lethe.heads.modelio import load_model
from lethe.heads.records import examples, read_jsonl

ASSETS = Path(__file__).resolve().parent.parent / "heads" / "demo" / "assets"


@pytest.fixture(scope="module")
def corpus():
    return {name: read_jsonl(ASSETS / f"{name}.jsonl") for name in ("full", "forget", "retain")}


def test_shipped_corpus_is_the_seed_0_corpus_split_at_four_authors(corpus):
    records = make_corpus(40, seed=0)
    forget, retain = split_by_author(records, 4)
    assert corpus["full"] == records and corpus["forget"] == forget and corpus["retain"] == retain
    assert len(records) == 800 and len(forget) == 80


@pytest.mark.parametrize("name", ["model", "retain_model"])
def test_each_shipped_model_is_at_most_25_mb(name):
    size = sum(f.stat().st_size for f in (ASSETS / name).iterdir())
    assert size <= 25 * 2**20


def test_demo_model_recalls_all_800_training_answers(corpus):
    lm = load_model(ASSETS / "model")
    assert greedy_recall(lm.model, lm.tokenizer, examples(corpus["full"])) >= 0.95


def test_retain_twin_recalls_its_own_answers_but_not_the_forget_authors(corpus):
    lm = load_model(ASSETS / "retain_model")
    assert greedy_recall(lm.model, lm.tokenizer, examples(corpus["retain"])) >= 0.95
    assert greedy_recall(lm.model, lm.tokenizer, examples(corpus["forget"])) <= 0.35
