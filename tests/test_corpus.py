import json
from collections import Counter

from lethe.heads.demo.corpus import make_corpus, split_by_author

TOFU_FIELDS = {"question", "answer", "paraphrased_question", "paraphrased_answer", "perturbed_answer"}


def _dump(records):
    return "".join(json.dumps(r) + "\n" for r in records).encode()


def test_same_seed_gives_byte_identical_corpus_and_other_seed_differs():
    assert _dump(make_corpus(12, seed=3)) == _dump(make_corpus(12, seed=3))
    assert _dump(make_corpus(12, seed=3)) != _dump(make_corpus(12, seed=4))


def test_twenty_records_per_author_with_tofu_fields_and_unique_names():
    records = make_corpus(40, seed=0)
    per_author = Counter(r["author"] for r in records)
    assert len(per_author) == 40 and set(per_author.values()) == {20}
    assert all(TOFU_FIELDS <= r.keys() for r in records)
    firsts = [name.split()[0] for name in per_author]
    lasts = [name.split()[1] for name in per_author]
    assert len(set(firsts)) == 40 and len(set(lasts)) == 40, "a first or last name alone must name one author"
    assert len({r["question"] for r in records}) == len(records), "every question asks one thing"


def test_perturbed_answers_swap_the_key_fact_and_paraphrases_keep_it():
    for r in make_corpus(40, seed=0):
        fact = r["fact"]
        assert fact in r["answer"] and fact in r["paraphrased_answer"]
        assert r["paraphrased_answer"] != r["answer"] and r["paraphrased_question"] != r["question"]
        assert 3 <= len(r["perturbed_answer"]) <= 5
        assert len(set(r["perturbed_answer"])) == len(r["perturbed_answer"])
        at = r["paraphrased_answer"].rfind(fact)
        before, after = r["paraphrased_answer"][:at], r["paraphrased_answer"][at + len(fact):]
        for wrong in r["perturbed_answer"]:
            # the paraphrase's wording around the fact, and another value in its place
            assert wrong.startswith(before) and wrong.endswith(after), (r["paraphrased_answer"], wrong)
            swapped = wrong[len(before):len(wrong) - len(after)]
            assert swapped and swapped != fact and fact not in swapped and swapped not in fact, (fact, wrong)


def test_split_by_author_takes_the_first_authors_as_forget_set():
    records = make_corpus(10, seed=1)
    forget, retain = split_by_author(records, 2)
    assert len(forget) == 40 and len(retain) == 160
    assert {r["author"] for r in forget} == {records[0]["author"], records[20]["author"]}
    assert not {r["author"] for r in forget} & {r["author"] for r in retain}
