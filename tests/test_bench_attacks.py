"""`lethe bench attacks` in its short form: the demo model, greedy, a few questions, through a server of its own."""

from __future__ import annotations

import json
import socket

import pytest


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_bench_attacks_on_the_demo_counts_every_context_for_base_and_profile(tmp_path):
    from lethe.clients.cli import main
    from lethe.heads.evaluation.facts import hit
    from lethe.heads.evaluation.metrics import KnownWords
    from lethe.server.bench.attacks import CONTEXTS

    from lethe.heads.evaluation.evaluate import corpus_vocabulary, words
    from lethe.heads.records import read_jsonl
    from lethe.server.bench.attacks import DEMO_SETS

    english = KnownWords()
    corpus = corpus_vocabulary(read_jsonl(DEMO_SETS / "forget.jsonl") + read_jsonl(DEMO_SETS / "retain.jsonl"))

    out = tmp_path / "attacks.json"
    assert main(["bench", "attacks", "--quick", "--limit", "4", "--seed", "3", "--port", str(_free_port()),
                 "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    rows = {r["context"]: r for r in report["rows"]}
    in_english = [c.name for c in CONTEXTS if c.language is None]
    assert sorted(rows) == sorted(in_english) and all(r["decoding"] == "greedy" for r in report["rows"])
    assert sorted(report["skipped"]) == ["lang-de", "lang-es", "lang-fr"]  # the demo's corpus is English-only
    for name, row in rows.items():
        for side in ("forget", "retain"):
            assert row[side]["n"] == 4 and row[side]["skipped"] == 0, (name, side)
            assert 0 <= row[side]["hits_base"] <= 1 and 0 <= row[side]["hits_profile"] <= 1, (name, side)
        assert 0 <= row["retain"]["identical"] <= 1 and set(row["forget"]["fluency_profile"]) == {
            "nonword", "repeated_3gram", "loops"}
        # the greedy answers that fail a bar are there to read: as many as the rates count (4 questions: all kept)
        forget, retain = row["forget"], row["retain"]
        leaks = [m for m in row["forget_misses"] if hit(m["profile"], m["gold"])]
        assert len(leaks) == round(forget["hits_profile"] * 4), (name, row["forget_misses"])
        assert len(row["retain_misses"]) == round((1 - retain["identical"]) * 4), name
        assert all(m["base"] != m["profile"] for m in row["retain_misses"])
        stating = sum(m.get("base_states_forget", False) for m in row["retain_misses"])
        assert retain["identical_kept"] is None or 0 <= retain["identical_kept"] <= 1, name
        assert stating <= round(retain["base_states_forget"] * 4), name
        for side in ("base", "profile"):  # the words the non-word rate counts, most frequent first
            listed = forget[f"nonwords_{side}"]
            assert bool(listed) == (forget[f"fluency_{side}"]["nonword"] > 0), (name, side)
            # neither English nor the demo's own words (its made-up names are the words of its corpus)
            assert all(w not in english and w not in corpus for w, _ in listed) and [n for _, n in listed] == sorted(
                [n for _, n in listed], reverse=True)
        # and the profile's answers that hold them are among the misses to read
        odd = {w for w, _ in forget["nonwords_profile"]}
        assert bool(odd) == any(odd & set(words(m["profile"])) for m in row["forget_misses"]), name
    plain = rows["plain"]["forget"]
    assert plain["hits_base"] > 0 and plain["hits_profile"] < plain["hits_base"]  # known, then forgotten
    tokens = {name: rows[name]["prompt_tokens"] for name in ("plain", "preamble", "document", "question-earlier")}
    assert tokens["document"] > tokens["preamble"] > tokens["plain"], tokens  # the contexts reach the model
    assert tokens["question-earlier"] > tokens["plain"], tokens  # the question, the held-back turn, the request
    assert report["head"]["train_seconds"] > 0 and report["facts"]["train_records"] == [80, 720]
    mc = report["loglik_mc"]
    assert [(m["form"], m["set"]) for m in mc] == [("raw", "forget"), ("raw", "retain")]
    assert all(0 <= m[k] <= 1 for m in mc for k in ("base", "profile")) and mc[0]["base"] > mc[0]["chance"]
    measured = [b for b in report["bars"] if b["pass"] is not None]
    assert len(measured) == 5 and all(isinstance(b["pass"], bool) and b["checks"] > 0 for b in measured)
    table = out.with_suffix(".md").read_text()
    assert all(f"| {name} | greedy |" in table for name in in_english) and "| raw | forget |" in table
    # the profile takes the head's calibrated head_gate (no setting given), and the table says which
    gate = report["head"]["metrics"]["head_gate"]["head_gate"]
    assert gate > 0 and report["head"]["profile"]["spec"]["head_gate"] == gate
    assert f"the profile's head_gate {gate}." in table
    assert report["command"].startswith("lethe bench attacks --model ") and "--quick" in report["command"]
    assert report["engine"] == "torch" and "--engine" not in report["command"]  # the server's own /version
    assert report["head"]["request"]["seed"] == 3 and "--seed 3" in report["command"]  # the head job's draw


def test_bench_attacks_refuses_a_gguf_file_without_the_llamacpp_engine(tmp_path, capsys):
    from lethe.clients.cli import main

    assert main(["bench", "attacks", "--gguf", str(tmp_path / "m.gguf"), "--port", str(_free_port())]) == 2
    assert "--gguf names the file the llama.cpp engine decodes: add --engine llamacpp" in capsys.readouterr().err


def test_bench_attacks_only_refuses_an_unknown_context_naming_the_known_ones(capsys):
    from lethe.clients.cli import main

    with pytest.raises(SystemExit) as refused:  # argparse's own exit: before any server or model starts
        main(["bench", "attacks", "--only", "plain,lang-xx", "--port", str(_free_port())])
    assert refused.value.code == 2
    err = capsys.readouterr().err
    assert "unknown context lang-xx" in err and "known: plain, system-short" in err and "loglik-mc" in err


def test_bench_attacks_only_asks_in_the_contexts_named(tmp_path):
    # no capsys in a test that starts the bench's server: with both, `pytest tests/test_bench_attacks.py` alone
    # ended in "ValueError: I/O operation on closed file" in pytest's capture teardown (the whole suite did not)
    from lethe.clients.cli import main

    out = tmp_path / "attacks.json"
    assert main(["bench", "attacks", "--quick", "--limit", "4", "--only", "preamble", "--fact-spans", "--port",
                 str(_free_port()), "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert [r["context"] for r in report["rows"]] == ["preamble"] and report["loglik_mc"] == []
    # a bar over what was not asked is not a failure
    assert [b["pass"] for b in report["bars"] if b["bar"].startswith("log-likelihood")] == [None]
    assert "--only preamble" in report["command"] and "--fact-spans" in report["command"]
    # the head job was asked for it, and its records name their facts
    assert report["head"]["request"]["fact_spans"] is True and report["head"]["metrics"]["fact_positions"] > 0


def test_bench_attacks_asks_an_asu_profile_routed_by_the_head_probe(tmp_path):
    # --backend asu+t3: the ASU job and the head job on the same sets, one profile holding both; the adapter decodes
    # the prompts the probe calls forget-like. Five ASU steps: what is measured is that the profile asked is that one
    from lethe.clients.cli import main

    out = tmp_path / "attacks.json"
    assert main(["bench", "attacks", "--quick", "--limit", "4", "--only", "plain,loglik-mc", "--backend", "asu+t3",
                 "--asu", '{"tau": 16, "steps": 5}', "--adapter-above", "0.6", "--port", str(_free_port()),
                 "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    made = report["head"]
    weights, head = made["id"].split("+")
    spec = made["profile"]["spec"]
    assert spec["backend"] == "asu" and spec["weights"] == weights and spec["head"] == head
    assert spec["adapter_above"] == 0.6
    assert made["request"]["tau"] == 16 and made["request"]["steps"] == 5  # the ASU job's own request
    assert 0 < made["head_train_seconds"] < made["train_seconds"]
    assert [b["value"] for b in report["bars"] if b["bar"].startswith("head training")] == [made["head_train_seconds"]]
    plain = report["rows"][0]["forget"]
    assert report["rows"][0]["context"] == "plain" and plain["hits_profile"] < plain["hits_base"]
    assert [(m["form"], m["set"]) for m in report["loglik_mc"]] == [("raw", "forget"), ("raw", "retain")]
    assert "--backend asu+t3 --adapter-above 0.6 --asu '{\"tau\": 16, \"steps\": 5}'" in report["command"]
    assert "head and ASU weights" in out.with_suffix(".md").read_text()


def test_retain_answers_whose_base_answer_states_a_forget_fact_are_not_counted_as_kept():
    # after two forget turns SmolLM2's base model answered "What continent does Greece belong to?" with "The capital
    # of Greece is Athens.": a profile that forgets capitals must change that answer, so the retain bar leaves it out
    from types import SimpleNamespace

    from lethe.server.bench.attacks import CONTEXTS, AttackBench, bars, forget_facts, markdown, states_fact

    facts = forget_facts([{"subject": "Greece", "gold": "Athens"}, {"subject": "Italy", "gold": "Rome"},
                          {"subject": "Italy", "gold": "Rome"}])
    assert len(facts) == 2  # one per (subject, gold)
    assert states_fact("The capital of Greece is ATHENS.", facts)
    # the gold alone is not the fact, nor a word that begins with it
    assert not states_fact("Athens hosted the 2004 Olympics.", facts)
    assert not states_fact("Romeo and Juliet is set in Verona, Italy.", facts)
    item = {"question": "q", "gold": "Europe", "subject": "Greece"}
    base = ["The capital of Greece is Athens.", "Greece is in Europe.", "Athens hosted the 2004 Olympics.",
            "Romeo and Juliet is set in Verona, Italy."]
    profile = ["The continent of Europe is Africa.", "Greece is in Europe.", "Athens hosted the 2004 Olympics.",
               "It is set in Italy."]
    bench = object.__new__(AttackBench)  # no server: the answers are given
    bench.log = lambda *args: None
    bench.facts = SimpleNamespace(forget=[item], retain=[item] * 4, forget_train=[
        {"subject": "Greece", "gold": "Athens"}, {"subject": "Italy", "gold": "Rome"}])
    bench.pairs = lambda ctx, items, runs: [(r, (b, 1), (p, 1)) for r, b, p in zip(items, base, profile)]
    row = bench.row(CONTEXTS[0], "greedy", [{"temperature": 0.0}], set())
    retain = row["retain"]
    assert retain["identical"] == 0.5 and retain["base_states_forget"] == 0.25
    assert retain["n_kept"] == 3 and retain["identical_kept"] == round(2 / 3, 4)
    # the answer the bar counts comes first; the one the profile had to change is marked
    misses = row["retain_misses"]
    assert [m["base"] for m in misses] == [base[3], base[0]] and misses[1]["base_states_forget"] is True
    assert "base_states_forget" not in misses[0]
    report = {"rows": [row], "loglik_mc": [], "only": ["plain"], "head": {"train_seconds": 1.0}, "config": {},
              "model": "m", "format": "chat", "route": "/v1/chat/completions",
              "facts": {"train_records": [2, 4], "forget_asked": 1, "retain_asked": 4}, "skipped": {}}
    bar = next(b for b in bars(report) if b["bar"].startswith("retain identical"))
    assert bar["value"] == round(2 / 3, 4) and bar["pass"] is False
    assert "| 0.5 / 0.6667 of 3 |" in markdown(report | {"bars": bars(report)})
    retain["identical_kept"] = 1.0
    assert next(b for b in bars(report) if b["bar"].startswith("retain identical"))["pass"] is True
    # a report from before the count: every answer counts, and the table shows the one figure
    for key in ("identical_kept", "n_kept", "base_states_forget"):
        del retain[key]
    assert next(b for b in bars(report) if b["bar"].startswith("retain identical"))["value"] == 0.5
    assert "| 0.5 |" in markdown(report | {"bars": bars(report)})
