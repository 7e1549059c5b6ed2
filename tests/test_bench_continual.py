"""`lethe bench continual` in a short form: the demo model, two forget requests one after the other, T3."""

from __future__ import annotations

import json

from test_bench_attacks import _free_port


def test_bench_continual_forgets_each_request_as_it_comes_and_keeps_the_groups_not_yet_asked(tmp_path):
    from lethe.clients.cli import main

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
