"""`lethe bench continual` in a short form: the demo model, two forget requests one after the other, T3."""

from __future__ import annotations

import json

from test_bench_attacks import _free_port


def test_bench_continual_forgets_each_request_as_it_comes_and_keeps_the_groups_not_yet_asked(tmp_path):
    from lethe.clients.cli import main
    from lethe.heads.evaluation.facts import hit

    out = tmp_path / "continual.json"
    assert main(["bench", "continual", "--requests", "2", "--limit", "12", "--port", str(_free_port()),
                 "--backends", "t3", "asu+t3", "--asu", '{"steps": 8, "tau": 16}', "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    first, second, *routed = report["rows"]
    assert [r["request"] for r in report["rows"]] == [1, 2, 1, 2]
    assert [r["backend"] for r in report["rows"]] == ["t3", "t3", "asu+t3", "asu+t3"]
    assert len(report["groups"]) == 2 and not set(report["groups"][0]) & set(report["groups"][1])
    assert second["forget_train"] > first["forget_train"] > 0  # request 2 trains on the union
    assert second["profile_version"] == first["profile_version"] + 1  # one profile, swapped
    g1, g2 = first["forget"]
    assert g1["requested"] and not g2["requested"] and g1["n"] > 0 and g2["n"] > 0
    assert g1["hits_base"] > 0.5 and g2["hits_base"] > 0.5  # the base model knows both groups
    assert g1["hits_profile"] < g1["hits_base"] / 2  # request 1 forgotten ...
    assert g2["hits_profile"] > g2["hits_base"] / 2  # ... group 2 not yet asked: still answered
    assert all(f["hits_profile"] < f["hits_base"] / 2 for f in second["forget"])  # after request 2: both gone
    assert g2["misses"] == [] and all(  # a requested group's answers that gave the fact, shown; not another's
        len(f["misses"]) == round(f["hits_profile"] * f["n"]) and all(hit(m["profile"], m["gold"]) for m in f["misses"])
        for f in second["forget"])
    assert second["retain"]["n"] == 12 and second["retain"]["identical"] >= 0.75
    # ASU weights and a head in one profile, the adapter for the prompts the probe calls forget-like: each request
    # made both, and the head's forgetting holds with them
    assert all(r["made"].startswith("asu_") and "+head_" in r["made"] for r in routed), routed
    assert routed[1]["profile_version"] == routed[0]["profile_version"] + 1
    assert all(f["hits_profile"] < f["hits_base"] / 2 for f in routed[1]["forget"])
    assert routed[1]["retain"]["identical"] >= 0.75
    assert [b["backend"] for b in report["bars"]] == ["t3", "t3", "asu+t3", "asu+t3"]
    assert all(isinstance(b["pass"], bool) for b in report["bars"])
    table = out.with_suffix(".md").read_text()
    assert "| after request | group 1 | group 2 |" in table and report["command"].startswith("lethe bench continual")


def test_a_run_from_the_last_request_trains_once_on_the_union_of_every_group(tmp_path):
    """`--from-request K`: no request trains on the one before, so a run from K asks the server for requests K..n
    only, each on the union of groups 1..k, and reads the bars on the last; out of range is refused."""
    from lethe.clients.cli import main
    from lethe.server.bench.attacks import Facts
    from lethe.server.bench.continual import ContinualBench, ContinualConfig

    pool = [{"subject": f"s{i}", "question": f"q{i}", "answer": f"a{i}", "gold": f"a{i}"} for i in range(6)]
    facts = Facts(chat=True, forget_train=pool, retain_train=[], forget=pool, retain=[], forget_pool=pool,
                  retain_pool=[{"subject": "r", "question": "rq", "gold": "ra"}], options={}, known={})
    trained = []

    class Bench(ContinualBench):
        def __init__(self, cfg):  # no server: what each request trains on, and fixed answers
            self.continual, self.chat, self.log = cfg, True, lambda *a: None
            self.lm = type("LM", (), {"path": "m", "fingerprint": "f"})

        def facts_for_chat(self):
            return facts

        def made(self, backend, profile):
            trained.append(sorted(r["subject"] for r in self.facts.forget_train))
            return {"train_seconds": 1.0, "id": f"head_{len(trained)}", "profile": {"version": len(trained)}}

        def _group_rows(self, profile, groups, k, retain):
            return {"forget": [{"group": g, "requested": g <= k, "hits_profile": 0.0, "hits_base": 1.0}
                               for g in range(1, len(groups) + 1)], "retain": {"identical": 1.0}}

    report = Bench(ContinualConfig(requests=3, first=3)).run()
    assert trained == [[f"s{i}" for i in range(6)]]  # one job, on every group
    assert [r["request"] for r in report["rows"]] == [3] and all(b["pass"] for b in report["bars"])
    trained.clear()
    Bench(ContinualConfig(requests=3, first=2)).run()
    assert trained == [["s0", "s1", "s3", "s4"], [f"s{i}" for i in range(6)]]  # groups dealt round-robin
    for bad in ("0", "4"):
        assert main(["bench", "continual", "--requests", "3", "--from-request", bad,
                     "--out", str(tmp_path / "c.json")]) == 2
