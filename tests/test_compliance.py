"""Issue 23: forgetting that cannot be opted out of, and a record that proves it.

Each attacker's route of the issue is driven against a key bound to a forget profile and against a tenant that
enforces it: every one is refused or answered through the profile, and then the gold answer ranks first no more
often than with the profile itself (by greedy generation and by log-likelihood scoring, echo + logprobs, the way
lm-evaluation-harness scores multiple choice)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from lethe.heads.demo.corpus import split_by_author
from lethe.heads.modelio import load_model
from lethe.heads.records import question_prompt
from lethe.server.app import create_app
from lethe.server.report import verify
from lethe.server.settings import Settings
from live_server import ADMIN_KEY

ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
OUT = Path(__file__).resolve().parent / "output"


def _jsonl(records) -> bytes:
    return "".join(json.dumps(r) + "\n" for r in records).encode()


def _bearer(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


def _settings(data_dir, **extra) -> Settings:
    return Settings(model=extra.pop("model"), data_dir=data_dir, admin_key=ADMIN_KEY, demo_tenant=False,
                    max_new_tokens_limit=64, **extra)


def _wait(client, headers, job_id):
    import time

    for _ in range(1200):
        job = client.get(f"/v1/jobs/{job_id}", headers=headers).json()
        if job["status"] in ("succeeded", "failed", "cancelled"):
            assert job["status"] == "succeeded", job
            return job
        time.sleep(0.1)
    raise TimeoutError(job_id)


@pytest.fixture(scope="module")
def world(tiny_model_dir, tiny_records, tmp_path_factory):
    """A server (tiny model, anonymous access at its default: off) with tenant `acme`: its forget and retain sets,
    a head trained on them, profile `forget` using it and profile `other` (the base backend)."""
    lm = load_model(tiny_model_dir)
    data = tmp_path_factory.mktemp("data")
    with TestClient(create_app(_settings(data, model=tiny_model_dir), lm)) as c:
        owner = _bearer(c.post("/admin/tenants", json={"name": "acme"}, headers=ADMIN).json()["api_key"])
        forget, retain = split_by_author(tiny_records, 1)
        f = c.post("/v1/datasets?name=forget", content=_jsonl(forget), headers=owner).json()
        r = c.post("/v1/datasets?name=retain", content=_jsonl(retain), headers=owner).json()
        job = c.post("/v1/heads", json={"forget": f["id"], "retain": r["id"]}, headers=owner).json()
        head = _wait(c, owner, job["id"])["head"]
        assert c.put("/v1/profiles/forget", json={"head": head}, headers=owner).status_code == 200
        assert c.put("/v1/profiles/other", json={"backend": "base"}, headers=owner).status_code == 200
        yield {"client": c, "owner": owner, "forget": forget, "retain": retain, "head": head,
               "datasets": (f, r), "data": data, "model": tiny_model_dir}


def _candidates(world, i: int) -> list[str]:
    """The gold answer of forget record i and three other authors' answers to questions of the same place."""
    retain = world["retain"]
    return [world["forget"][i]["answer"]] + [retain[(i + 20 * k) % len(retain)]["answer"] for k in range(3)]


def _gold_first_by_scoring(c, headers, extra: dict, world, expect: str = "forget") -> tuple[int, list[int]]:
    """How many forget records' gold answer has the highest log-likelihood among 4 (completions, echo + logprobs,
    max_tokens 0), and the statuses seen (a refused route answers 403 and counts no record)."""
    first, statuses = 0, []
    for i, rec in enumerate(world["forget"]):
        prompt = question_prompt(rec["question"])
        body = {"prompt": [f"{prompt} {a}" for a in _candidates(world, i)], "echo": True, "logprobs": 0,
                "max_tokens": 0, **extra}
        r = c.post("/v1/completions", json=body, headers=headers)
        statuses.append(r.status_code)
        if r.status_code != 200:
            continue
        assert r.json()["lethe_profile"]["name"] == expect, r.json()["lethe_profile"]
        scores = [sum(x for x in ch["logprobs"]["token_logprobs"] if x is not None) for ch in r.json()["choices"]]
        first += scores.index(max(scores)) == 0
    return first, statuses


def _gold_hits(c, headers, route: dict, records, expect: str = "forget") -> tuple[int, list[int]]:
    """Greedy answers that contain the gold answer, on /generate or /v1/chat/completions."""
    hits, statuses = 0, []
    for rec in records:
        if route.get("chat"):
            body = {"messages": [{"role": "user", "content": rec["question"]}], "max_tokens": 24, "temperature": 0,
                    **route["chat"]}
            r = c.post("/v1/chat/completions", json=body, headers=headers)
            text = r.json()["choices"][0]["message"]["content"] if r.status_code == 200 else ""
            name = r.json().get("lethe_profile", {}).get("name") if r.status_code == 200 else None
        else:
            body = {"prompt": question_prompt(rec["question"]), "max_new_tokens": 24, "temperature": 0,
                    **route.get("generate", {})}
            r = c.post("/generate", json=body, headers=headers)
            text = r.json()["text"] if r.status_code == 200 else ""
            name = r.json()["profile"]["name"] if r.status_code == 200 else None
        statuses.append(r.status_code)
        if r.status_code == 200:
            assert name == expect, (route, name)
            hits += rec["answer"].strip() in text
    return hits, statuses


# the attacker's routes of issue 23: what the request says (generation, and scoring where it has that field)
ROUTES = {
    "no profile": ({}, {}, {}),
    "empty model": (None, {"model": ""}, {"model": ""}),
    "base by name": ({"profile": "base"}, {"model": "base"}, {"model": "base"}),
    "inline base": ({"profile": {"backend": "base"}}, None, None),
    "another profile": ({"profile": "other"}, {"model": "other"}, {"model": "other"}),
    "another profile by field": (None, {"model": "forget", "unlearning_profile": "other"},
                                 {"model": "forget", "unlearning_profile": "other"}),
    "untilted logprobs": (None, {"model": "forget", "logprobs": True, "lethe_untilted_logprobs": True},
                          {"model": "forget", "lethe_untilted_logprobs": True}),
    "untilted flag alone": (None, {"lethe_untilted_logprobs": True}, None),
    "the profile itself": ({"profile": "forget"}, {"model": "forget"}, {"model": "forget"}),
}


def _attack(world, headers) -> dict:
    """Every route's (gold hits, statuses of generation, gold-first by scoring, statuses of scoring)."""
    c, records = world["client"], world["forget"]
    out: dict = {}
    for name, (generate, chat, score) in ROUTES.items():
        hits, statuses = 0, []
        if generate is not None:
            h, s = _gold_hits(c, headers, {"generate": generate}, records)
            hits, statuses = hits + h, statuses + s
        if chat is not None:
            h, s = _gold_hits(c, headers, {"chat": chat}, records)
            hits, statuses = hits + h, statuses + s
        first, scored = (0, [])
        if score is not None:
            first, scored = _gold_first_by_scoring(c, headers, score, world)
        out[name] = (hits, set(statuses), first, set(scored))
    return out


def _check_attacks(results: dict) -> None:
    print("route: (gold hits, generation statuses, gold first by scoring, scoring statuses)", results)  # with -s
    own_hits, _, own_first, _ = results["the profile itself"]
    for name, (hits, statuses, first, scored) in results.items():
        assert statuses | scored <= {200, 403}, (name, statuses, scored)
        if name in ("no profile", "empty model", "the profile itself"):
            assert statuses | scored == {200}, (name, statuses, scored)  # answered, through the profile
        else:
            assert statuses | scored == {403}, (name, statuses, scored)  # refused
        assert hits <= own_hits and first <= own_first, (name, hits, own_hits, first, own_first)


def test_the_attack_works_on_a_key_without_rules(world):
    """The measure can fail: a plain key gets the base model on these routes, which gives the gold answers."""
    c = world["client"]
    base_hits, _ = _gold_hits(c, world["owner"], {"generate": {"profile": "base"}}, world["forget"], "base")
    own_hits, _ = _gold_hits(c, world["owner"], {"generate": {"profile": "forget"}}, world["forget"])
    base_first, _ = _gold_first_by_scoring(c, world["owner"], {"model": "base"}, world, expect="base")
    own_first, _ = _gold_first_by_scoring(c, world["owner"], {"model": "forget"}, world)
    print(f"plain key, {len(world['forget'])} forget records: gold hits base {base_hits}, profile {own_hits}; "
          f"gold first by scoring base {base_first}, profile {own_first}")  # with -s
    assert base_hits >= 15 and own_hits <= base_hits - 8, (base_hits, own_hits)
    assert base_first >= 15 and own_first < base_first, (base_first, own_first)


def test_a_bound_key_cannot_opt_out_by_any_route(world):
    c = world["client"]
    made = c.post("/admin/tenants/acme/keys", json={"scopes": ["generate"], "profile": "forget"}, headers=ADMIN)
    assert made.status_code == 201, made.text
    bound = _bearer(made.json()["api_key"])
    results = _attack(world, bound)
    _check_attacks(results)
    # what the bound key may ask for, and what it may not touch
    assert [m["id"] for m in c.get("/v1/models", headers=bound).json()["data"]] == ["forget"]
    for method, path, body in (("PUT", "/v1/profiles/forget", {"backend": "base"}), ("GET", "/v1/datasets", None),
                               ("POST", "/v1/profiles/forget/rollback", None), ("DELETE", "/v1/profiles/forget", None),
                               ("PUT", "/v1/enforced-profile", {"profile": None}), ("GET", "/v1/audit", None)):
        r = c.request(method, path, json=body, headers=bound)
        assert r.status_code == 403 and "manage" in r.text, (path, r.status_code, r.text)
    keys = c.get("/admin/tenants/acme/keys", headers=ADMIN).json()
    assert any(k["profile"] == "forget" and k["scopes"] == ["generate"] for k in keys)
    # a bound key has the generate scope alone; it binds to a profile the tenant has
    bad = c.post("/admin/tenants/acme/keys", json={"scopes": ["manage", "generate"], "profile": "forget"},
                 headers=ADMIN)
    assert bad.status_code == 422 and "scopes" in bad.text
    assert c.post("/admin/tenants/acme/keys", json={"profile": "nope"}, headers=ADMIN).status_code == 404
    # a profile a key is bound to cannot be deleted from under it
    r = c.delete("/v1/profiles/forget", headers=world["owner"])
    assert r.status_code == 409 and "bound" in r.text


def test_an_enforced_profile_holds_for_every_key_of_the_tenant(world):
    c, owner = world["client"], world["owner"]
    other_key = _bearer(c.post("/admin/tenants/acme/keys", headers=ADMIN).json()["api_key"])  # every scope
    r = c.put("/v1/enforced-profile", json={"profile": "forget"}, headers=owner)
    assert r.status_code == 200 and c.get("/v1/enforced-profile", headers=owner).json() == {"profile": "forget"}
    try:
        for headers in (other_key, owner):  # an old-style key with every scope, and the managing key itself
            _check_attacks(_attack(world, headers))
        # a binding to another profile cannot be made while one is enforced
        r = c.post("/admin/tenants/acme/keys", json={"profile": "other"}, headers=ADMIN)
        assert r.status_code == 409 and "enforces" in r.text
        # enforced by the operator: the tenant's own keys cannot lift it
        r = c.put("/admin/tenants/acme/enforced-profile", json={"profile": "forget"}, headers=ADMIN)
        assert r.status_code == 200
        r = c.put("/v1/enforced-profile", json={"profile": None}, headers=owner)
        assert r.status_code == 403 and "admin key" in r.text
    finally:
        r = c.put("/admin/tenants/acme/enforced-profile", json={"profile": None}, headers=ADMIN)
        assert r.status_code == 200
    # lifted: the key with every scope may choose again (the base model, untilted numbers)
    assert c.post("/generate", json={"prompt": "hi", "profile": "base", "max_new_tokens": 2},
                  headers=other_key).status_code == 200


def test_untilted_numbers_need_the_evaluate_scope(world):
    c = world["client"]
    body = {"model": "forget", "prompt": "Question: hi\nAnswer:", "max_tokens": 2, "logprobs": 1,
            "lethe_untilted_logprobs": True}
    plain = _bearer(c.post("/admin/tenants/acme/keys", json={"scopes": ["generate"]}, headers=ADMIN).json()["api_key"])
    r = c.post("/v1/completions", json=body, headers=plain)
    assert r.status_code == 403 and r.json()["error"]["param"] == "lethe_untilted_logprobs"
    assert c.post("/v1/completions", json={**body, "lethe_untilted_logprobs": False}, headers=plain).status_code == 200
    evaluator = _bearer(c.post("/admin/tenants/acme/keys", json={"scopes": ["generate", "evaluate"]},
                               headers=ADMIN).json()["api_key"])
    r = c.post("/v1/completions", json=body, headers=evaluator)
    assert r.status_code == 200 and r.json()["choices"][0]["lethe_untilted_logprobs"] is not None
    # a generate-only key manages nothing
    assert c.get("/v1/profiles", headers=plain).status_code == 403


def test_anonymous_access_is_off_unless_turned_on(world, tiny_model_dir, tmp_path):
    c = world["client"]
    r = c.post("/generate", json={"prompt": "hi", "max_new_tokens": 2})
    assert r.status_code == 401
    assert c.post("/v1/completions", json={"model": "base", "prompt": "hi", "max_tokens": 2}).status_code == 401
    assert Settings(model=tiny_model_dir).allow_anonymous is False
    from lethe.server.settings import DEMO_MODEL

    assert Settings().model == DEMO_MODEL and Settings().allow_anonymous is True  # `make serve` on the demo
    on = Settings(model=tiny_model_dir, allow_anonymous=True, data_dir=tmp_path)
    with TestClient(create_app(on, load_model(tiny_model_dir))) as anon:
        # lm-evaluation-harness sends an empty bearer when no key is set: anonymous where that is on
        r = anon.post("/v1/completions", json={"model": "base", "prompt": "hi", "max_tokens": 2},
                      headers={"Authorization": "Bearer "})
        assert r.status_code == 200
        assert anon.post("/generate", json={"prompt": "hi", "max_new_tokens": 2},
                         headers={"Authorization": "Basic x"}).status_code == 401  # malformed stays 401
        # a placeholder beside a real key, two keys, or a Lethe key in other case: never anonymous
        for headers in ({"Authorization": "Bearer EMPTY", "X-API-Key": "lk_abc"},
                        [("authorization", "Bearer EMPTY"), ("authorization", "Bearer lk_abc")],
                        {"Authorization": "Bearer LK_ABC"}):
            r = anon.post("/generate", json={"prompt": "hi", "max_new_tokens": 2}, headers=headers)
            assert r.status_code == 401, headers


def test_versions_are_never_reused(world):
    c, owner = world["client"], world["owner"]
    assert c.put("/v1/profiles/tmp", json={"backend": "base"}, headers=owner).json()["version"] == 1
    assert c.delete("/v1/profiles/tmp", headers=owner).status_code == 204
    again = c.put("/v1/profiles/tmp", json={"head": world["head"]}, headers=owner).json()
    assert again["version"] == 2 and [h["version"] for h in again["history"]] == [2]
    r = c.post("/generate", json={"prompt": "hi", "profile": "tmp", "max_new_tokens": 2}, headers=owner)
    assert r.json()["profile"] == {"name": "tmp", "version": 2}
    assert c.delete("/v1/profiles/tmp", headers=owner).status_code == 204


def test_served_model_name_cannot_shadow_a_profile(world, tmp_path):
    from lethe.server.app import check_served_name
    from lethe.server.storage import Store

    store = Store(world["data"])
    try:
        with pytest.raises(ValueError, match="'Forget'.*'acme'.*'forget'"):
            check_served_name(store, "Forget")
        check_served_name(store, "smollm")  # another name is fine
    finally:
        store.close()
    # the CLI refuses in one line, before the model loads
    from lethe.clients.cli import main

    assert main(["serve", "--data-dir", str(world["data"]), "--served-model-name", "forget", "--port", "0"]) == 1
    # and a profile cannot take the served name
    settings = _settings(tmp_path, model=world["model"], served_model_name="smollm")
    with TestClient(create_app(settings, load_model(world["model"]))) as c:
        owner = _bearer(c.post("/admin/tenants", json={"name": "x"}, headers=ADMIN).json()["api_key"])
        r = c.put("/v1/profiles/SmolLM", json={"backend": "base"}, headers=owner)
        assert r.status_code == 422 and "served-model-name" in r.text
        assert [m["id"] for m in c.get("/v1/models", headers=owner).json()["data"]] == ["base", "smollm"]


def test_metrics_need_the_admin_key_and_the_access_log_names_no_one(world, tiny_model_dir, tmp_path, caplog):
    c = world["client"]
    assert c.get("/metrics").status_code == 403
    assert c.get("/metrics", headers=world["owner"]).status_code == 403
    full = c.get("/metrics", headers=ADMIN)
    assert full.status_code == 200 and "lethe_job_duration_seconds" in full.text and "_created" not in full.text
    public = Settings(model=tiny_model_dir, data_dir=tmp_path, metrics_public=True)
    with TestClient(create_app(public, load_model(tiny_model_dir))) as open_:
        text = open_.get("/metrics").text
        assert "lethe_requests_total" in text and "lethe_job" not in text and "lethe_profile" not in text
    with caplog.at_level("INFO", logger="lethe"):
        c.post("/v1/datasets?name=rtbf-john-doe", content=b'{"text": "x"}\n', headers=world["owner"])
        c.get("/v1/profiles/rtbf-john-doe", headers=world["owner"])
    logged = "\n".join(r.getMessage() for r in caplog.records)
    assert "/v1/datasets" in logged and "rtbf" not in logged and "john" not in logged
    from lethe.clients.cli.serve import uvicorn_config

    assert uvicorn_config(object(), public).access_log is False  # uvicorn's own log would print the raw path


def _trail_actions(entries) -> list[tuple[str, str, str | None]]:
    return [(e["action"], e["actor"], e["target"]) for e in entries]


def test_the_audit_trail_records_each_change_once(tiny_model_dir, tiny_lm, tmp_path, database_url):
    """Every audited action once, with the acting key's id, on SQLite and PostgreSQL; kept across a restart and
    a tenant's deletion; the table refuses UPDATE and DELETE."""
    import torch  # noqa: F401  (the head file below)
    from lethe.heads.t3.head import HeadInfo, T3Head, save_head

    settings = _settings(tmp_path / "data", model=tiny_model_dir, database_url=database_url)
    cfg = tiny_lm.model.config
    with TestClient(create_app(settings, tiny_lm)) as c:
        made = c.post("/admin/tenants", json={"name": "t"}, headers=ADMIN).json()
        owner = _bearer(made["api_key"])
        owner_id = c.get("/admin/tenants/t/keys", headers=ADMIN).json()[0]["id"]
        save_head(tmp_path / "h.safetensors", T3Head(cfg.hidden_size, cfg.vocab_size, 4),
                  HeadInfo(base_fingerprint=tiny_lm.fingerprint, d=cfg.hidden_size, vocab=cfg.vocab_size, rank=4))
        head = c.post("/v1/heads/upload", files={"file": ("h.safetensors", (tmp_path / "h.safetensors").read_bytes())},
                      headers=owner).json()["id"]
        ds = c.post("/v1/datasets?name=d", content=b'{"text": "x"}\n', headers=owner).json()["id"]
        assert c.put("/v1/profiles/p", json={"head": head}, headers=owner).json()["version"] == 1
        assert c.put("/v1/profiles/p", json={"backend": "base"}, headers=owner).json()["version"] == 2
        assert c.post("/v1/profiles/p/rollback", headers=owner).json()["version"] == 1
        key = c.post("/admin/tenants/t/keys", json={"scopes": ["generate"], "profile": "p"}, headers=ADMIN)
        key_id = next(k["id"] for k in c.get("/admin/tenants/t/keys", headers=ADMIN).json() if k["profile"] == "p")
        assert c.patch(f"/admin/tenants/t/keys/{key_id}", json={"scopes": ["generate"]},
                       headers=ADMIN).json()["profile"] is None
        rotated = c.post(f"/admin/tenants/t/keys/{key_id}/rotate", headers=ADMIN)
        new_id = next(k["id"] for k in c.get("/admin/tenants/t/keys", headers=ADMIN).json()
                      if k["id"] not in (owner_id,))
        assert c.delete(f"/admin/tenants/t/keys/{new_id}", headers=ADMIN).status_code == 204
        assert c.put("/v1/enforced-profile", json={"profile": "p"}, headers=owner).status_code == 200
        assert c.put("/admin/tenants/t/enforced-profile", json={"profile": None}, headers=ADMIN).status_code == 200
        assert c.delete("/v1/profiles/p", headers=owner).status_code == 204
        assert c.delete(f"/v1/heads/{head}", headers=owner).status_code == 204
        assert c.delete(f"/v1/datasets/{ds}", headers=owner).status_code == 204
        assert key.status_code == 201 and rotated.status_code == 201
        expected = [("tenant.create", "admin", made["id"]), ("key.create", "admin", owner_id),
                    ("profile.set", owner_id, "p"), ("profile.set", owner_id, "p"), ("profile.rollback", owner_id, "p"),
                    ("key.create", "admin", key_id), ("key.update", "admin", key_id), ("key.rotate", "admin", key_id),
                    ("key.revoke", "admin", new_id), ("tenant.enforce", owner_id, made["id"]),
                    ("tenant.enforce", "admin", made["id"]), ("profile.delete", owner_id, "p"),
                    ("head.delete", owner_id, head), ("dataset.delete", owner_id, ds)]
        trail = c.get("/v1/audit", headers=owner).json()
        assert _trail_actions(trail) == expected
        assert trail[1]["after"] == {"scopes": ["manage", "generate", "evaluate"], "profile": None}
        assert trail[5]["after"] == {"scopes": ["generate"], "profile": "p"}  # the bound key, as made
        first_set = trail[2]
        assert first_set["before"] is None and first_set["after"]["version"] == 1
        assert trail[3]["before"]["version"] == 1 and trail[3]["after"]["spec"] == {"backend": "base"}
        assert _trail_actions(c.get("/v1/audit?profile=p&action=profile.set", headers=owner).json()) == expected[2:4]
        since = trail[5]["at"]
        assert _trail_actions(c.get(f"/v1/audit?since={since}", headers=owner).json()) == expected[5:]
        # append-only below the API too
        store = c.app.state.store
        for statement in ("DELETE FROM audit", "UPDATE audit SET actor = 'someone'"):
            with pytest.raises(Exception, match="append-only"):
                store.tx([(statement, ())])
    with TestClient(create_app(settings, tiny_lm)) as c:  # a restart keeps it
        assert _trail_actions(c.get("/v1/audit?tenant=t", headers=ADMIN).json()) == expected
        assert c.delete("/admin/tenants/t", headers=ADMIN).status_code == 204
        again = c.post("/admin/tenants", json={"name": "t"}, headers=ADMIN).json()  # the name, made again
        kept = c.get("/v1/audit?tenant=t", headers=ADMIN).json()
        assert _trail_actions(kept)[:len(expected) + 1] == expected + [("tenant.delete", "admin", made["id"])]
        assert kept[len(expected)]["before"]["keys"] == [owner_id]
        assert [e["action"] for e in kept[len(expected) + 1:]] == ["tenant.create", "key.create"]
        assert kept[-1]["tenant_id"] == again["id"]


def _chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


def test_the_report_names_every_input_is_stable_and_renders(world, tmp_path):
    c, owner = world["client"], world["owner"]
    f, r = world["datasets"]
    job = c.post("/v1/eval", json={"forget": f["id"], "retain": r["id"], "profile": "forget", "max_new_tokens": 16},
                 headers=owner).json()
    _wait(c, owner, job["id"])
    page = c.get("/v1/profiles/forget/report", headers=owner)
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    again = c.get("/v1/profiles/forget/report?version=1", headers=owner)
    assert page.content == again.content  # the same bytes when made twice
    data = c.get("/v1/profiles/forget/report?format=json", headers=owner).json()
    head = c.get(f"/v1/heads/{world['head']}", headers=owner).json()
    assert {d["sha256"] for d in data["datasets"]} == {f["sha256"], r["sha256"]}
    assert {(d["role"], d["records"]) for d in data["datasets"]} == {("forget", 20), ("retain", 60)}
    assert data["head"]["sha256"] == head["sha256"] and data["head"]["training"]["rank"] == 20
    assert [e["job"] for e in data["evaluations"]] == [job["id"]]
    assert data["served"][0]["until"] is None and data["current"] is True
    ok, digest = verify(page.text)
    assert ok and digest == data["digest"]
    for sha in (f["sha256"], r["sha256"], head["sha256"], digest):
        assert sha in page.text
    assert not verify(page.text.replace('"records":20', '"records":2'))[0]  # a changed report fails the check
    assert not verify(page.text.replace("<td>20</td>", "<td>2</td>"))[0]  # ... what a reader sees too
    assert not verify(page.text.replace("\n", "\r\n"))[0]
    assert c.get("/v1/profiles/forget/report?version=9", headers=owner).status_code == 404
    browser = _chromium()
    if browser is None:
        if os.environ.get("CI"):
            pytest.fail("chromium is missing: .ci/run installs Debian's chromium before the tests")
        pytest.skip("chromium is not installed (Debian: apt-get install chromium)")
    OUT.mkdir(exist_ok=True)
    html, png = tmp_path / "report.html", OUT / "report.png"
    html.write_text(page.text)
    png.unlink(missing_ok=True)
    flags = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
             "--disable-background-networking", "--disable-component-update", "--disable-sync",
             f"--user-data-dir={tmp_path / 'profile'}", "--window-size=1100,1400"]
    subprocess.run([browser, *flags, f"--screenshot={png}", html.as_uri()], check=True, timeout=120,
                   capture_output=True)
    assert png.stat().st_size > 20_000  # a rendered page, not a blank one
    dom = subprocess.run([browser, *flags, "--dump-dom", html.as_uri()], check=True, timeout=120,
                         capture_output=True, text=True).stdout
    assert "Forgetting report" in dom and digest in dom and f["sha256"] in dom


@pytest.fixture(scope="module")
def cli_server(tiny_model_dir, tmp_path_factory):
    """A live server for the command line (started outside the test, before pytest captures its output)."""
    from live_server import running_server

    with running_server(load_model(tiny_model_dir), tmp_path_factory.mktemp("data"), allow_anonymous=False) as url:
        yield url


def test_the_command_line_makes_bound_keys_enforces_and_reports(cli_server, tiny_records, tmp_path, capsys):
    """`lethe tenants key --scope --profile`, `tenants set-key`, `tenants enforce`, `profiles enforce`, `audit`,
    `report --out` and `verify-report`, as an operator types them."""
    from lethe.clients.cli import main

    said = []

    def run(*args) -> tuple[int, list[str]]:
        rc = main(list(args))
        captured = capsys.readouterr()
        said.append(captured.err)
        return rc, captured.out.splitlines()

    url = cli_server
    admin = ("--url", url, "--key", ADMIN_KEY)
    rc, out = run(*admin, "--field", "api_key", "tenants", "create", "cli")
    owner = ("--url", url, "--key", out[0])
    forget, retain = split_by_author(tiny_records, 1)
    (tmp_path / "f.jsonl").write_bytes(_jsonl(forget))
    (tmp_path / "r.jsonl").write_bytes(_jsonl(retain))
    rc, out = run(*owner, "--field", "head", "heads", "train", "--forget", str(tmp_path / "f.jsonl"),
                  "--retain", str(tmp_path / "r.jsonl"), "--wait", "--quiet", "--rank", "4")
    assert rc == 0, out
    assert run(*owner, "profiles", "set", "rtbf", "--head", out[0])[0] == 0
    rc, out = run(*admin, "--field", "api_key", "tenants", "key", "cli", "--scope", "generate", "--profile", "rtbf")
    assert rc == 0 and out[0].startswith("lk_")
    bound = out[0]
    rc, out = run(*admin, "tenants", "keys", "cli")
    keys = [json.loads(line) for line in out]
    assert [(k["scopes"], k["profile"]) for k in keys] == [(["manage", "generate", "evaluate"], None),
                                                            (["generate"], "rtbf")]
    rc, out = run("--url", url, "--key", bound, "generate", "--profile", "base", "Question: hi\nAnswer:")
    assert rc == 1 and "bound to profile 'rtbf'" in said[-1]
    assert run(*owner, "profiles", "enforce", "rtbf")[0] == 0
    assert json.loads(run(*owner, "profiles", "enforce")[1][0]) == {"profile": "rtbf"}
    assert run(*admin, "tenants", "enforce", "cli", "--lift")[0] == 0
    assert run(*admin, "tenants", "enforce", "cli")[0] == 2  # neither a profile nor --lift: bad usage
    rc, out = run(*admin, "tenants", "set-key", "cli", keys[1]["id"], "--scope", "generate", "--scope", "evaluate")
    assert rc == 0 and json.loads(out[0])["profile"] is None
    rc, out = run(*owner, "audit", "--since", "2000-01-01")
    actions = [json.loads(line)["action"] for line in out]
    assert actions == ["tenant.create", "key.create", "profile.set", "key.create", "tenant.enforce",
                       "tenant.enforce", "key.update"], actions
    assert [json.loads(line)["action"] for line in run(*owner, "audit", "--profile", "rtbf",
                                                            "--action", "profile.set")[1]] == ["profile.set"]
    rc, out = run(*owner, "report", "rtbf", "--out", str(tmp_path / "report.html"))
    written = json.loads(out[0])
    assert rc == 0 and written["digest"] in (tmp_path / "report.html").read_text()
    rc, out = run("verify-report", str(tmp_path / "report.html"))
    assert rc == 0 and json.loads(out[0])["verified"] is True
    page = (tmp_path / "report.html").read_text()
    (tmp_path / "changed.html").write_text(page.replace('"records":20', '"records":21'))
    assert run("verify-report", str(tmp_path / "changed.html"))[0] == 1
