"""`lethe bench real`'s scoring (pure functions) and, on the real model, a quick run end to end."""

from __future__ import annotations

import pytest

from lethe.heads.evaluation.evaluate import words as evaluate_words
from lethe.heads.evaluation.facts import KINDS, hit, records
from lethe.heads.evaluation.metrics import KnownWords, has_loop


def test_hits_look_for_the_gold_answer_and_short_symbols_as_words():
    assert hit("The capital of France is Paris.", "Paris") and hit("paris, of course", "Paris")
    assert not hit("The capital of France is Lille.", "Paris")
    # where a word starts: another word that ends in the gold is another answer (the demo's "female" for "male")
    assert not hit("Kavous Dredrou identifies as female.", "male") and hit("He is male.", "Male")
    assert hit("a Parisian, born in Paris", "Paris") and hit("(Paris)", "Paris") and not hit("Éparis", "paris")
    assert hit("The chemical symbol for hydrogen is H.", "H") and hit("It is Fe (iron).", "Fe")
    assert not hit("Hydrogen is written Hg", "H") and not hit("the", "H")


def test_loops_are_a_short_unit_five_times_in_a_row():
    for looped in ("By.B.B.B.B.B.B.B...", "by f.e.e.l.a.s.s.s.s.s", "hahahahaha", "-----"):
        assert has_loop(looped), looped
    for fluent in ("The capital of France is Paris.", "I don't know.", "Mississippi", "a...b"):
        assert not has_loop(fluent), fluent


def test_known_words_count_inflections_names_and_the_asked_language_and_refuse_stitched_names():
    words = KnownWords()
    assert all(w in words for w in ("countries", "located", "written", "capital", "the", "paris", "cities"))
    assert not any(w in words for w in ("babagallitha", "tokumababa", "coriobella", "bratisl", "azerba", "lzk"))
    # short pieces web text holds too, and rare misspellings, stay non-words
    assert not any(w in words for w in ("ine", "ard", "vts", "sm", "ive", "londen", "egypto"))
    # names the English lists lack are words (wordfreq has seen them), as are the asked language's words
    assert all(w in words for w in ("africa", "oslo", "tehran", "nigeria", "uk", "usa"))
    assert "hauptstadt" not in words and "hauptstadt" in KnownWords(languages=["de"])
    assert evaluate_words("España, capital: Madrid") == ["españa", "capital", "madrid"]  # accents stay in a word
    # the demo's made-up names are words of its world: given as extra words, they and their inflections count
    demo = KnownWords(["Zapeavund", "Kaikoleas"])
    assert all(w in demo for w in ("zapeavund", "zapeavund's", "kaikoleas", "capital"))
    assert "zapeavund" not in words and "zapeavun" not in demo and "babagallitha" not in demo


def test_every_kind_holds_out_its_last_question():
    for k in KINDS:
        subject = next(iter(k.items))
        train, held = records(k, [subject], slice(0, -1)), records(k, [subject], slice(-1, None))
        assert len(train) == len(k.questions) - 1 and len(held) == 1
        assert held[0]["question"] not in {r["question"] for r in train}
        assert k.items[subject] in held[0]["answer"] and hit(held[0]["answer"], held[0]["gold"])


@pytest.mark.real
def test_bench_real_quick_run_forgets_the_topic_and_scores_fluency(real_lm):
    from lethe.server.bench.real import RealBenchConfig, markdown, run

    report = run(real_lm, RealBenchConfig(limit=6, seeds=(0,), temperatures=(1.0,), max_new_tokens=16,
                                          variants={"abstain": {"abstain": "I don't know.", "abstain_above": 0.7}}),
                 log=lambda *_: None)  # a head from 3 subjects per kind is less sure than the full bench's: 0.7
    assert report["format"] == "chat" and report["known"]["capital"] >= 3
    greedy = report["rows"][0]
    assert greedy["decoding"] == "greedy" and greedy["forget_hits_base"] == 1.0  # only known items are kept
    assert greedy["forget_hits_head"] <= 0.5 and greedy["retain_identical"] >= 0.7
    assert set(greedy["forget_fluency_head"]) == {"nonword", "repeated_3gram", "loops"}
    assert greedy["variant"] == "head" and report["settings"]["repeat_guard"] == 3
    sampled = next(r for r in report["rows"] if r["decoding"].startswith("T=1.0") and r["variant"] == "head")
    assert sampled["retain_identical"] >= 0.9  # the gate leaves retain contexts untouched, sampled ones too
    abstain = [r for r in report["rows"] if r["variant"] == "abstain"]
    assert len(abstain) == 2 and all(r["forget_abstained"] >= 0.5 and r["retain_abstained"] <= 0.1 for r in abstain)
    assert markdown(report).count("\n| ") == 5  # header rule; greedy and one sampled setting for each variant


def test_bench_heads_serves_every_tenant_its_own_head(tiny_model_dir, tmp_path):
    from lethe.heads.modelio import load_model
    from live_server import ADMIN_KEY, running_server
    from lethe.server.bench.heads import bench_heads

    lm = load_model(tiny_model_dir)
    with running_server(lm, tmp_path) as url:
        result = bench_heads(url, ADMIN_KEY, lm, clients=3, duration=1.0, max_tokens=8)
    assert result["one_client"]["errors"] == [] and result["together"]["errors"] == []
    assert result["one_client"]["tokens"] > 0 and result["together"]["requests"] >= 3
    assert result["together_over_one"] > 0


def test_the_speed_bench_sets_in_docs_are_the_facts_of_today():
    """docs/real-sets (the README's and scripts/gpu-check.sh's `bench t3` sets) are what facts.py makes."""
    import json
    from pathlib import Path

    folder = Path(__file__).resolve().parent.parent / "docs" / "real-sets"
    for name, kinds in (("forget", [k for k in KINDS if k.name == "capital"]),
                        ("retain", [k for k in KINDS if k.name != "capital"])):
        stored = [json.loads(line) for line in (folder / f"{name}.jsonl").read_text().splitlines()]
        assert stored == [r for k in kinds for r in records(k, list(k.items))]
