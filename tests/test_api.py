"""End to end against a real server: two tenants, datasets, a head job, profiles, hot-swap, OpenAI clients."""

import json
import statistics
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from lethe.heads.demo.corpus import split_by_author
from lethe.heads.evaluation.metrics import has_loop, rouge_l_recall
from lethe.heads.evaluation.evaluate import words
from lethe.heads.modelio import load_model
from lethe.heads.records import question_prompt
from live_server import ADMIN_KEY, new_tenant, running_server


def _jsonl(records) -> bytes:
    return "".join(json.dumps(r) + "\n" for r in records).encode()


@pytest.fixture(scope="module", params=["sqlite", "postgresql", "ray"])
def live(request, tiny_model_dir, tmp_path_factory):
    """A server on each deployment: one process on the embedded SQLite, one process on PostgreSQL, and 2 replicas
    on Ray Serve sharing PostgreSQL and a data directory; every test of this file runs against all three."""
    database = None
    if request.param != "sqlite":
        from lethe.server.pg_local import fresh_database

        database = fresh_database(request.getfixturevalue("postgres_server_url"))
    if request.param == "ray":
        from live_server import running_ray

        with running_ray(tiny_model_dir, tmp_path_factory.mktemp("data"), database, replicas=2,
                         max_new_tokens_limit=128) as url:
            yield url
        return
    # a model of its own: the server attaches ASU adapters to it in place
    lm = load_model(tiny_model_dir)
    with running_server(lm, tmp_path_factory.mktemp("data"), max_new_tokens_limit=128, database_url=database) as url:
        yield url


@pytest.fixture(scope="module")
def tenant_a(live, tiny_records):
    """Tenant A with uploaded sets, a trained head and a profile `forget-1` using it."""
    client = new_tenant(live, "a")
    forget, retain = split_by_author(tiny_records, 1)
    f = client.post("/v1/datasets?name=forget", content=_jsonl(forget)).json()
    r = client.post("/v1/datasets", files={"file": ("retain.jsonl", _jsonl(retain))}).json()
    assert f["records"] == 20 and r["records"] == 60 and r["name"] == "retain.jsonl"
    job = client.post("/v1/heads", json={"forget": f["id"], "retain": r["id"]})
    assert job.status_code == 202 and job.json()["status"] in ("queued", "running")
    phases = []
    with client.stream("GET", f"/v1/jobs/{job.json()['id']}/events") as events:
        for line in events.iter_lines():
            if line.startswith("data: "):
                phases.append(json.loads(line[6:]))
    assert phases[-1]["status"] == "succeeded" and phases[-1]["progress"] == 1.0, phases[-1]
    assert [p["progress"] for p in phases] == sorted(p["progress"] for p in phases)
    head = phases[-1]["head"]
    assert {p["phase"] for p in phases} <= {"queued", "caching", "fitting", "calibrating", "evaluating",
                                           "saving", "done"}
    metrics = client.get(f"/v1/heads/{head}").json()["metrics"]
    assert metrics["heldout_auc"] > 0.8
    assert metrics["sample_forget_rouge_head"] < metrics["sample_forget_rouge_base"]
    prof = client.put("/v1/profiles/forget-1", json={"head": head, "note": "first"})
    assert prof.status_code == 200 and prof.json()["version"] == 1
    return {"client": client, "forget": forget, "retain": retain, "datasets": (f["id"], r["id"]), "head": head,
            "job": job.json()["id"]}


def _ask(client, records, profile=None):
    outs = []
    for rec in records:
        body = {"prompt": question_prompt(rec["question"]), "temperature": 0, "max_new_tokens": 40}
        if profile:
            body["profile"] = profile
        r = client.post("/generate", json=body)
        assert r.status_code == 200, r.text
        outs.append(r.json())
    return outs


def test_tenant_a_forgets_while_tenant_b_still_remembers(live, tenant_a):
    a, b = tenant_a["client"], new_tenant(live, "b")
    forget, retain = tenant_a["forget"], tenant_a["retain"][::6]
    rouge = lambda recs, outs: statistics.fmean(rouge_l_recall(r["answer"], o["text"]) for r, o in zip(recs, outs))  # noqa
    a_forget = _ask(a, forget, "forget-1")
    assert all(o["profile"] == {"name": "forget-1", "version": 1} for o in a_forget)
    b_forget = _ask(b, forget)
    assert rouge(forget, b_forget) > 0.9 and b_forget[0]["profile"]["name"] == "base"
    assert rouge(forget, a_forget) < 0.6 * rouge(forget, b_forget)
    assert rouge(retain, _ask(a, retain, "forget-1")) >= 0.97 * rouge(retain, _ask(b, retain))


def test_another_tenants_resources_answer_404(live, tenant_a):
    b = new_tenant(live, "b2")
    ds, head, job = tenant_a["datasets"][0], tenant_a["head"], tenant_a["job"]
    for method, path in [("GET", f"/v1/datasets/{ds}"), ("DELETE", f"/v1/datasets/{ds}"), ("GET", f"/v1/heads/{head}"),
                         ("DELETE", f"/v1/heads/{head}"), ("GET", f"/v1/jobs/{job}"), ("GET", f"/v1/jobs/{job}/events"),
                         ("POST", f"/v1/jobs/{job}/cancel"), ("GET", "/v1/profiles/forget-1"),
                         ("POST", "/v1/profiles/forget-1/rollback"), ("DELETE", "/v1/profiles/forget-1")]:
        assert b.request(method, path).status_code == 404, (method, path)
    assert b.get("/v1/datasets").json() == [] and b.get("/v1/heads").json() == [] and b.get("/v1/jobs").json() == []
    r = b.post("/generate", json={"prompt": "Question: x\nAnswer:", "profile": "forget-1"})
    assert r.status_code == 404
    r = b.post("/generate", json={"prompt": "Question: x\nAnswer:", "profile": {"head": head}})
    assert r.status_code == 404
    r = b.post("/v1/heads", json={"forget": ds, "retain": ds})
    assert r.status_code == 404 and r.json()["detail"][0]["loc"] == ["body", "forget"]
    assert b.post("/admin/tenants", json={"name": "evil"}).status_code == 403, "tenant keys are not admin keys"
    assert httpx.get(live + "/v1/datasets").status_code == 401


def test_dataset_upload_names_the_first_bad_line_and_limits_size(live, tenant_a, tiny_lm, tmp_path):
    a = tenant_a["client"]
    before = len(a.get("/v1/datasets").json())
    bad = b'{"question": "q", "answer": "a"}\n{"question": "q2"}\n'
    r = a.post("/v1/datasets", content=bad)
    assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["body", "line 2", "answer"]
    assert a.post("/v1/datasets", content=b"{not json\n").json()["detail"][0]["loc"][1] == "line 1"
    assert a.post("/v1/datasets", content=b"\xff\xfe").status_code == 422
    assert a.post("/v1/datasets", content=b"\n\n").status_code == 422
    assert len(a.get("/v1/datasets").json()) == before, "nothing is stored for a refused upload"
    with running_server(tiny_lm, tmp_path, max_upload_bytes=1000) as small:
        c = new_tenant(small, "small")
        assert c.post("/v1/datasets", content=b'{"text": "' + b"x" * 5000 + b'"}\n').status_code == 413
        assert c.post("/v1/datasets", files={"file": ("big.jsonl", b'{"text": "' + b"x" * 5000 + b'"}\n')}
                      ).status_code == 413
        assert c.get("/v1/datasets").json() == [] and not list((tmp_path / "blobs").glob("??/*")), "no file kept"


def test_profile_versions_history_and_rollback(live, tenant_a):
    a, head = tenant_a["client"], tenant_a["head"]
    v2 = a.put("/v1/profiles/swap-test", json={"head": head, "preset": "paper"}).json()
    assert v2["version"] == 1 and v2["spec"]["T"] == 2.5 and v2["spec"]["cap"] is None
    v = a.put("/v1/profiles/swap-test", json={"backend": "base"}).json()
    assert v["version"] == 2 and [h["version"] for h in v["history"]] == [1, 2]
    back = a.post("/v1/profiles/swap-test/rollback").json()
    assert back["version"] == 1 and back["spec"]["backend"] == "t3"
    assert a.put("/v1/profiles/bad", json={"head": head, "T": 0}).status_code == 422
    r = a.put("/v1/profiles/bad", json={"head": head, "lam": -1})
    assert r.status_code == 422 and r.json()["detail"][0]["loc"][-1] == "lam"
    assert a.put("/v1/profiles/bad", json={"head": head, "colour": "red"}).status_code == 422
    assert a.put("/v1/profiles/bad", json={"head": "head_nope"}).status_code == 404
    assert a.get("/v1/profiles/bad").status_code == 404, "a refused profile leaves nothing behind"
    assert {m["id"] for m in a.get("/v1/models").json()["data"]} >= {"base", "forget-1", "swap-test"}


def test_fluency_settings_and_abstention_through_profiles(live, tenant_a):
    a, head = tenant_a["client"], tenant_a["head"]
    assert a.put("/v1/profiles/fluent", json={"head": head}).json()["spec"]["repeat_guard"] == 3  # the default
    assert a.put("/v1/profiles/fluent", json={"head": head, "preset": "paper"}).json()["spec"]["repeat_guard"] == 0
    assert a.put("/v1/profiles/fluent", json={"head": head}).json()["spec"]["sticky_gate"] is True  # the default
    assert a.put("/v1/profiles/fluent", json={"head": head, "preset": "paper"}).json()["spec"]["sticky_gate"] is False
    assert a.put("/v1/profiles/unstuck", json={"head": head, "sticky_gate": False}).json()["spec"]["sticky_gate"] is False
    assert a.put("/v1/profiles/fluent", json={"head": head}).json()["spec"]["flagged_mass"] == 0.1  # the default
    assert a.put("/v1/profiles/fluent", json={"head": head, "preset": "paper"}).json()["spec"]["flagged_mass"] == 0
    assert a.put("/v1/profiles/massless", json={"head": head, "flagged_mass": 0}).json()["spec"]["flagged_mass"] == 0
    assert a.put("/v1/profiles/massed", json={"head": head, "flagged_mass": 0.3}).json()["spec"]["flagged_mass"] == 0.3
    assert a.put("/v1/profiles/fluent", json={"head": head}).json()["spec"]["word_guard"] is True  # the default
    assert a.put("/v1/profiles/fluent", json={"head": head, "preset": "paper"}).json()["spec"]["word_guard"] is False
    assert a.put("/v1/profiles/unguarded", json={"head": head, "word_guard": False}).json()["spec"]["word_guard"] is False
    assert a.put("/v1/profiles/fluent", json={"head": head}).json()["spec"]["whole_words"] is False  # the default
    assert a.put("/v1/profiles/spelt", json={"head": head, "whole_words": True}).json()["spec"]["whole_words"] is True
    for bad, field in (({"repeat_guard": 1}, "repeat_guard"), ({"repeat_guard": 17}, "repeat_guard"),
                       ({"min_p": 1.0}, "min_p"), ({"abstain": ""}, "abstain"), ({"abstain_above": 0.3}, "abstain_above"),
                       ({"sticky_gate": 1}, "sticky_gate"), ({"flagged_mass": 1.0}, "flagged_mass"),
                       ({"flagged_mass": -0.1}, "flagged_mass"), ({"word_guard": "on"}, "word_guard"),
                       ({"whole_words": 1}, "whole_words")):
        r = a.put("/v1/profiles/fluent-bad", json={"head": head, **bad})
        assert r.status_code == 422 and r.json()["detail"][0]["loc"][-1] == field, (bad, r.json())
    assert a.get("/v1/profiles/fluent-bad").status_code == 404
    reply = "I do not know."
    spec = a.put("/v1/profiles/abstains", json={"head": head, "abstain": reply, "abstain_above": 0.5}).json()["spec"]
    assert spec["abstain"] == reply and spec["abstain_above"] == 0.5

    def answers(records, profile):
        return [a.post("/generate", json={"prompt": question_prompt(r["question"]), "profile": profile,
                                          "temperature": 0, "max_new_tokens": 24}).json()["text"] for r in records]

    forget, retain = answers(tenant_a["forget"][:6], "abstains"), answers(tenant_a["retain"][:6], "abstains")
    assert forget.count(reply) >= 3, forget  # the probe, from the prompt alone, calls most forget questions forget-like
    assert retain.count(reply) <= 1, retain  # and few retain questions (false refusals)
    a.put("/v1/profiles/no-abstention", json={"head": head})  # the same head and settings, without the reply
    assert [t for t in retain if t != reply] == [t for t, r in zip(answers(tenant_a["retain"][:6], "no-abstention"),
                                                                   retain) if r != reply]  # the rest: as without it


def test_hot_swap_under_load_no_failures_and_each_answer_matches_its_version(live, tenant_a):
    a, head = tenant_a["client"], tenant_a["head"]
    specs = [{"head": head}, {"backend": "base"}]
    a.put("/v1/profiles/hot", json=specs[0])
    prompts = [question_prompt(r["question"]) for r in tenant_a["forget"][:4] + tenant_a["retain"][:4]]
    results, errors, lock = [], [], threading.Lock()
    key = a.headers["Authorization"]

    def client_loop(worker: int):
        with httpx.Client(base_url=live, headers={"Authorization": key}, timeout=60) as c:
            for i in range(25):
                p = prompts[(worker + i) % len(prompts)]
                r = c.post("/generate", json={"prompt": p, "profile": "hot", "temperature": 0, "max_new_tokens": 24})
                with lock:
                    (results if r.status_code == 200 else errors).append((p, r.status_code, r.json()))

    def swapper():  # 20 swaps spread over the run: one after every ~9 answers
        for i in range(20):
            for _ in range(600):
                with lock:
                    if len(results) + len(errors) >= 9 * i:
                        break
                threading.Event().wait(0.01)
            assert a.put("/v1/profiles/hot", json=specs[(i + 1) % 2]).status_code == 200

    with ThreadPoolExecutor(9) as pool:
        futures = [pool.submit(client_loop, w) for w in range(8)] + [pool.submit(swapper)]
        for f in futures:
            f.result()
    assert errors == [] and len(results) == 200
    versions = {r[2]["profile"]["version"] for r in results}
    assert len(versions) >= 5, "the swaps happened while requests ran"
    history = {h["version"]: h["spec"] for h in a.get("/v1/profiles/hot").json()["history"]}
    solo: dict = {}
    for prompt, _, body in results:
        spec = history[body["profile"]["version"]]
        key_ = (prompt, spec.get("backend"))
        if key_ not in solo:
            solo[key_] = a.post("/generate", json={"prompt": prompt, "profile": spec, "temperature": 0,
                                                   "max_new_tokens": 24}).json()["text"]
        assert body["text"] == solo[key_]


def test_streaming_generate_sends_the_same_text_as_a_plain_call(live, tenant_a):
    a = tenant_a["client"]
    body = {"prompt": question_prompt(tenant_a["retain"][3]["question"]), "temperature": 0, "max_new_tokens": 30}
    plain = a.post("/generate", json=body).json()
    pieces, final = [], None
    with a.stream("POST", "/generate", json=body | {"stream": True}) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                event = json.loads(line[6:])
                if "finish_reason" in event:
                    final = event
                else:
                    pieces.append(event["text"])
    assert "".join(pieces) == plain["text"] and final["finish_reason"] == plain["finish_reason"]


def test_openai_client_completions_and_chat_streaming_and_not(live, tenant_a, tiny_records):
    from openai import OpenAI

    key = tenant_a["client"].headers["Authorization"].split()[1]
    client = OpenAI(base_url=live + "/v1", api_key=key)
    rec = tenant_a["retain"][0]
    c = client.completions.create(model="base", prompt=question_prompt(rec["question"]), max_tokens=40, temperature=0)
    assert c.choices[0].text.strip() == rec["answer"] and c.usage.completion_tokens > 0
    streamed = "".join(ch.choices[0].text for ch in client.completions.create(
        model="base", prompt=question_prompt(rec["question"]), max_tokens=40, temperature=0, stream=True))
    assert streamed == c.choices[0].text
    chat = client.chat.completions.create(model="base", messages=[{"role": "user", "content": rec["question"]}],
                                          max_tokens=40, temperature=0)
    assert chat.choices[0].message.content == rec["answer"]
    parts = list(client.chat.completions.create(model="base", messages=[{"role": "user", "content": rec["question"]}],
                                                max_tokens=40, temperature=0, stream=True,
                                                stream_options={"include_usage": True}))
    chunks = [p for p in parts if p.choices]
    assert "".join(p.choices[0].delta.content or "" for p in chunks) == chat.choices[0].message.content  # same text
    assert [p.choices[0].delta.role for p in chunks].count("assistant") == 1  # the role once
    assert parts[-1].choices == [] and parts[-1].usage.completion_tokens == chat.usage.completion_tokens
    no_usage = list(client.chat.completions.create(model="base", messages=[{"role": "user", "content": "hi"}],
                                                   max_tokens=4, stream=True))
    assert all(p.usage is None for p in no_usage)
    raw = client.chat.completions.with_raw_response.create(model="forget-1", max_tokens=4,
                                                           messages=[{"role": "user", "content": "hi"}])
    assert raw.headers["x-lethe-profile"] == "forget-1" and raw.headers["x-lethe-profile-version"] == "1"
    assert raw.parse().model_extra["lethe_profile"] == {"name": "forget-1", "version": 1}
    f = tenant_a["forget"][1]
    forgot = client.chat.completions.create(model="forget-1", messages=[{"role": "user", "content": f["question"]}],
                                            max_tokens=40, temperature=0)
    assert forgot.choices[0].message.content != f["answer"]
    assert {m.id for m in client.models.list()} >= {"base", "forget-1"}


def test_a_placeholder_key_is_anonymous_and_a_wrong_lethe_key_is_refused(live, tenant_a):
    import openai
    from openai import OpenAI

    rec = tenant_a["retain"][0]
    empty = OpenAI(base_url=live + "/v1", api_key="EMPTY")  # the usual habit with local servers
    chat = empty.chat.completions.create(model="base", messages=[{"role": "user", "content": rec["question"]}],
                                         max_tokens=40, temperature=0)
    assert chat.choices[0].message.content == rec["answer"]
    with pytest.raises(openai.AuthenticationError):  # a profile needs a real key: never the base model instead
        empty.chat.completions.create(model="forget-1", messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    mistyped = OpenAI(base_url=live + "/v1", api_key="lk_mistyped")
    with pytest.raises(openai.AuthenticationError):  # a Lethe key that is wrong is 401, even for the base model
        mistyped.chat.completions.create(model="base", messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    assert httpx.get(live + "/v1/datasets", headers={"Authorization": "Bearer EMPTY"}).status_code == 401


def test_openai_request_shapes_vllm_users_send(live, tenant_a, tiny_lm):
    from openai import OpenAI

    key = tenant_a["client"].headers["Authorization"].split()[1]
    client = OpenAI(base_url=live + "/v1", api_key=key)
    rec = tenant_a["retain"][0]
    q = question_prompt(rec["question"])
    one = client.completions.create(model="base", prompt=q, max_tokens=24, temperature=0)
    many = client.completions.create(model="base", prompt=[q, q], max_tokens=24, temperature=0, n=2)
    assert [c.index for c in many.choices] == [0, 1, 2, 3] and {c.text for c in many.choices} == {one.choices[0].text}
    assert many.usage.completion_tokens == 4 * one.usage.completion_tokens
    ids = client.completions.create(model="base", prompt=tiny_lm.tokenizer.encode(q, add_special_tokens=False),
                                    max_tokens=24, temperature=0)
    assert ids.choices[0].text == one.choices[0].text
    echoed = client.completions.create(model="base", prompt=q, max_tokens=24, temperature=0, echo=True)
    assert echoed.choices[0].text == q + one.choices[0].text
    sampled = client.completions.create(model="base", prompt=q, max_tokens=24, temperature=1, seed=5, n=3)
    assert len({c.text for c in sampled.choices}) >= 2  # seeds 5, 6, 7: different draws
    again = client.completions.create(model="base", prompt=q, max_tokens=24, temperature=1, seed=5, n=3)
    assert [c.text for c in again.choices] == [c.text for c in sampled.choices]  # and repeatable
    penalized = client.completions.create(model="base", prompt=q, max_tokens=24, temperature=0, frequency_penalty=2,
                                          presence_penalty=2, extra_body={"top_k": 5, "min_p": 0.1})
    words = penalized.choices[0].text.split()
    assert len(words) == len(set(words)) or penalized.choices[0].text != one.choices[0].text
    parts = client.chat.completions.create(model="base", max_tokens=40, temperature=0, messages=[
        {"role": "user", "content": [{"type": "text", "text": rec["question"]}]}])
    plain = client.chat.completions.create(model="base", max_tokens=40, temperature=0,
                                           messages=[{"role": "user", "content": rec["question"]}])
    assert parts.choices[0].message.content == plain.choices[0].message.content
    history = client.chat.completions.create(model="base", max_tokens=8, temperature=0, messages=[
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function",
                                                                "function": {"name": "f", "arguments": "{}"}}]},
        {"role": "user", "content": rec["question"]}])
    assert history.choices[0].finish_reason in ("stop", "length")


def test_openai_errors_have_openai_shape(live, tenant_a):
    import openai
    from openai import OpenAI

    key = tenant_a["client"].headers["Authorization"].split()[1]
    client = OpenAI(base_url=live + "/v1", api_key=key)
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="base", messages=[{"role": "user", "content": "hi"}], max_tokens=10**9)
    assert e.value.param == "max_tokens" and e.value.type == "invalid_request_error" and "max_tokens" in str(e.value)
    for refused in ({"logit_bias": {"5": 10}}, {"tools": [{"type": "function", "function": {"name": "f"}}]},
                    {"response_format": {"type": "json_object"}}, {"top_logprobs": 2}):
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model="base", messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                           **refused)
        assert e.value.param == next(iter(refused)), refused  # refused by name, never silently ignored
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="no-such-profile", prompt="hi", max_tokens=2)
    assert "no-such-profile" in str(e.value) and e.value.type == "not_found_error"
    assert client.models.retrieve("forget-1").id == "forget-1" and client.models.retrieve("base").id == "base"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("nope")
    native = httpx.post(live + "/generate", json={"prompt": "hi", "max_new_tokens": 10**9})
    assert native.status_code == 422 and native.json()["detail"][0]["loc"][-1] == "max_new_tokens"  # its own shape


def test_full_queue_answers_429_with_retry_after(tiny_lm, tmp_path):
    with running_server(tiny_lm, tmp_path, max_queue=1, max_batch_size=1) as url:
        body = {"prompt": "Question: hello\nAnswer:", "temperature": 5.0, "max_new_tokens": 120, "seed": 1}
        with ThreadPoolExecutor(24) as pool:
            replies = list(pool.map(lambda _: httpx.post(url + "/generate", json=body, timeout=60), range(24)))
        codes = [r.status_code for r in replies]
        assert set(codes) <= {200, 429} and 429 in codes and 200 in codes
        assert all(r.headers["retry-after"] == "1" for r in replies if r.status_code == 429)
        metrics = httpx.get(url + "/metrics", headers={"Authorization": f"Bearer {ADMIN_KEY}"}).text
        assert 'lethe_requests_total{path="/generate",status="429"}' in metrics
        assert "lethe_generated_tokens_total" in metrics and "lethe_batch_size_bucket" in metrics


def _wait_job(client, job_id: str) -> dict:
    for _ in range(600):
        state = client.get(f"/v1/jobs/{job_id}").json()
        if state["status"] in ("succeeded", "failed", "cancelled"):
            return state
        threading.Event().wait(0.1)
    raise TimeoutError(job_id)


def test_a_head_job_trains_on_the_facts_records_name_where_asked_to(tenant_a):
    a = tenant_a["client"]
    f, r = tenant_a["datasets"]
    assert a.get(f"/v1/heads/{tenant_a['head']}").json()["metrics"]["fact_positions"] == 0  # off by default
    bad = a.post("/v1/heads", json={"forget": f, "retain": r, "fact_spans": "sometimes"})
    assert bad.status_code == 422 and "fact_spans" in bad.text
    job = a.post("/v1/heads", json={"forget": f, "retain": r, "fact_spans": True, "max_epochs": 2, "gate_answers": 0})
    state = _wait_job(a, job.json()["id"])
    assert state["status"] == "succeeded", state
    assert a.get(f"/v1/heads/{state['head']}").json()["metrics"]["fact_positions"] > 0  # the corpus names facts
    assert a.delete(f"/v1/heads/{state['head']}").status_code == 204


def test_a_head_job_runs_its_cache_pass_in_the_precision_asked(tenant_a):
    from lethe.heads.t3.cache import native_bfloat16

    a = tenant_a["client"]
    f, r = tenant_a["datasets"]
    bad = a.post("/v1/heads", json={"forget": f, "retain": r, "cache_precision": "half"})
    assert bad.status_code == 422 and bad.json()["detail"][0]["loc"][-1] == "cache_precision"
    for precision, dtype in (("model", "float32"), ("auto", "bfloat16" if native_bfloat16() else "float32")):
        job = a.post("/v1/heads", json={"forget": f, "retain": r, "cache_precision": precision, "max_epochs": 2,
                                        "gate_answers": 0})
        state = _wait_job(a, job.json()["id"])
        assert state["status"] == "succeeded", state
        assert a.get(f"/v1/heads/{state['head']}").json()["metrics"]["cache_dtype"] == dtype, precision
        assert a.delete(f"/v1/heads/{state['head']}").status_code == 204


def test_asu_job_profile_and_asu_plus_t3_on_the_shared_model(live, tenant_a):
    a = tenant_a["client"]
    forget_id, retain_id = tenant_a["datasets"]
    job = a.post("/v1/asu", json={"forget": forget_id, "retain": retain_id, "steps": 40, "layers": "0-1"})
    assert job.status_code == 202, job.text
    assert a.post("/v1/asu", json={"forget": forget_id, "retain": retain_id, "layers": "0-9"}).status_code == 422
    state = _wait_job(a, job.json()["id"])
    assert state["status"] == "succeeded", state
    weights = state["weights"]
    info = a.get(f"/v1/asu/{weights}").json()
    assert info["layers"] == [0, 1] and info["bytes"] > 0
    # no tau asked: the job's teacher phase chose it, among candidates on the layers asked for, and says why
    teacher = info["metrics"]["teacher"]
    assert teacher["chosen"] == {"tau": info["tau"], "layers": "0-1"} and teacher["reason"]
    # the default preset is lethe, whose recipe rests on the teacher's pick: the tiny model's teacher picks nothing,
    # so it fell back to tau 16 and the settings not given are minimal's; the weights say so
    training = info["training"]
    assert (teacher["pick"], info["tau"], training["preset"], training["settings_from"], training["retain_loss"],
            training["retain_weight"], training["own_answers"], training["retain_own_answers"], training["steps"]) \
        == (None, 16.0, "lethe", "minimal", "gd", 1.0, False, False, 40)
    # the fallback tempers both layers of the test model, so the adapters are in every layer, and ungated
    assert (training["lora_layers"], info["lora_layers"], info["gate"], training["gate"]) == (None, [], {}, False)
    prof = a.put("/v1/profiles/asu", json={"backend": "asu", "weights": weights}).json()
    assert prof["spec"] == {"backend": "asu", "weights": weights, "repeat_guard": 0}  # ungated: off
    # ASU alone has no head to guard its rows: the profile's own repeat guard does
    r = a.put("/v1/profiles/asu-bad", json={"backend": "asu", "weights": weights, "repeat_guard": 1})
    assert r.status_code == 422 and r.json()["detail"][0]["loc"][-1] == "repeat_guard", r.text
    for name, n in (("asu-free", 0), ("asu-guarded", 2)):
        put = a.put(f"/v1/profiles/{name}", json={"backend": "asu", "weights": weights, "repeat_guard": n})
        assert put.json()["spec"]["repeat_guard"] == n
    long = {"prompt": "was born in was born in was born in", "max_tokens": 40, "temperature": 0, "min_tokens": 40}
    texts = {name: a.post("/v1/completions", json=long | {"model": name}).json()["choices"][0]["text"]
             for name in ("asu-free", "asu-guarded")}
    assert has_loop(texts["asu-free"]) and not has_loop(texts["asu-guarded"]), texts  # "Kutaidre........"
    ws = words(texts["asu-guarded"])
    assert len(set(zip(ws, ws[1:]))) == len(ws) - 1, texts  # no word 2-gram twice
    both = a.put("/v1/profiles/asu-t3", json={"backend": "asu", "weights": weights, "head": tenant_a["head"]}).json()
    assert both["spec"]["head"] == tenant_a["head"] and both["spec"]["cap"] == 0.5
    rec = tenant_a["retain"][2]
    base_answer = _ask(a, [rec])[0]["text"]
    for name in ("asu", "asu-t3"):
        out = _ask(a, [rec], name)[0]
        assert out["profile"]["name"] == name
    # the adapter only for prompts the head's probe calls forget-like: other prompts get the head alone
    for bad in ({"backend": "asu", "weights": weights, "adapter_above": 0.5},
                {"head": tenant_a["head"], "adapter_above": 0.5},
                {"backend": "asu", "weights": weights, "head": tenant_a["head"], "adapter_above": 1.0}):
        r = a.put("/v1/profiles/routed-bad", json=bad)
        assert r.status_code == 422 and r.json()["detail"][0]["loc"][-1] == "adapter_above", r.text
    assert a.get("/v1/profiles/routed-bad").status_code == 404
    routed = a.put("/v1/profiles/routed", json={"backend": "asu", "weights": weights, "head": tenant_a["head"],
                                                "adapter_above": 0.999999}).json()
    assert routed["spec"]["adapter_above"] == 0.999999 and both["spec"]["adapter_above"] == 0.0
    a.put("/v1/profiles/head-only", json={"head": tenant_a["head"]})
    served = _ask(a, [rec], "routed")[0]
    assert served["text"] == _ask(a, [rec], "head-only")[0]["text"], \
        "a prompt below the threshold decodes as the head alone does"
    # every OpenAI choice says what it decoded with: the adapter, or (routed away from it) not
    prompt = {"prompt": question_prompt(rec["question"]), "max_tokens": 8, "temperature": 0}
    for model, adapter in (("routed", False), ("asu-t3", True)):
        out = a.post("/v1/completions", json=prompt | {"model": model}).json()
        assert out["choices"][0]["lethe_adapter"] is adapter, out
        chat = a.post("/v1/chat/completions", json={"model": model, "max_tokens": 8, "stream": True,
                                                    "messages": [{"role": "user", "content": rec["question"]}]})
        chunks = [json.loads(line[6:]) for line in chat.text.splitlines() if line.startswith("data: {")]
        assert [c["choices"][0]["lethe_adapter"] for c in chunks if "lethe_adapter" in c["choices"][0]] == [adapter]
    assert "lethe_adapter" not in a.post("/v1/completions", json=prompt | {"model": "head-only"}).json()["choices"][0]
    assert _ask(a, [rec])[0]["text"] == base_answer, "base rows are untouched once adapters are attached"
    assert a.delete(f"/v1/asu/{weights}").status_code == 409, "in use by a profile"
    b = new_tenant(live, "b3")
    assert b.get(f"/v1/asu/{weights}").status_code == 404 and b.delete(f"/v1/asu/{weights}").status_code == 404
    assert b.put("/v1/profiles/x", json={"backend": "asu", "weights": weights}).status_code == 404
    full = a.post("/v1/asu", json={"forget": forget_id, "retain": retain_id, "steps": 10, "full_layers": "1",
                                   "preset": "minimal"})
    assert full.status_code == 202
    assert a.post("/v1/asu", json={"forget": forget_id, "retain": retain_id, "full_layers": "5"}).status_code == 422
    # the distillation's other settings: LoRA in chosen layers, own answers, the KL retain loss along them
    # a forget set whose records name no `fact`: nothing to look for in the student's answers
    unnamed = a.post("/v1/datasets?name=unnamed", content=_jsonl([{k: v for k, v in r.items() if k != "fact"}
                                                                  for r in tenant_a["forget"]])).json()["id"]
    tuned = {"forget": forget_id, "retain": retain_id, "steps": 5, "tau": 4, "lora_layers": "1", "own_answers": True,
             "retain_loss": "kl", "retain_own_answers": True, "distil": "fact", "contexts": 1, "retain_subspace": 0.99,
             "gate": True}
    for wrong, field in (({"lora_layers": "5"}, "lora_layers"), ({"full_layers": "1"}, "lora_layers"),
                         ({"retain_loss": "gd"}, "retain_own_answers"), ({"distil": "word"}, "distil"),
                         ({"contexts": 5}, "contexts"), ({"student_answers": -1}, "student_answers"),
                         ({"student_answers": 1, "forget": unnamed}, "student_answers"),
                         ({"retain_subspace": 1.0}, "retain_subspace"),
                         ({"lora_layers": None, "full_layers": "1", "gate": False}, "retain_subspace"),
                         ({"lora_layers": None, "preset": "minimal"}, "gate")):
        refused = a.post("/v1/asu", json=tuned | wrong)
        assert refused.status_code == 422 and refused.json()["detail"][0]["loc"][-1] == field, refused.text
    tuned = _wait_job(a, a.post("/v1/asu", json=tuned).json()["id"])
    state = _wait_job(a, full.json()["id"])
    assert state["status"] == tuned["status"] == "succeeded", (state, tuned)
    made = a.get(f"/v1/asu/{tuned['weights']}").json()
    assert made["lora_layers"] == [1] and made["gate"] == {"layer": 1, "threshold": 0.5}
    assert made["metrics"]["gate"]["positions"]["forget"] > 0
    assert made["metrics"]["retain_subspace"]["retain_energy_kept"] <= 0.01 + 1e-6  # the adapters' inputs projected
    # distilled after contexts too: each forget record kept by own_answers twice, and twice as many retain records
    # after one
    kept = made["metrics"]["examples"]["forget"] // 2
    assert 0 < kept <= len(tenant_a["forget"])
    assert made["metrics"]["examples"] == {"forget": 2 * kept, "retain": len(tenant_a["retain"]) + 2 * kept}
    # by default (preset lethe) the adapters go where the teacher tempers, gated where that is past the first layer
    gated = _wait_job(a, a.post("/v1/asu", json={"forget": forget_id, "retain": retain_id, "steps": 2, "tau": 4,
                                                 "layers": "1"}).json()["id"])
    assert gated["status"] == "succeeded", gated
    made = a.get(f"/v1/asu/{gated['weights']}").json()
    assert (made["lora_layers"], made["gate"], made["training"]["gate"]) == ([1], {"layer": 1, "threshold": 0.5}, True)
    # with a tau given there is no pick to rest on: the settings not given are lethe's
    assert (made["training"]["preset"], made["training"]["retain_loss"], made["training"]["retain_weight"],
            made["training"]["own_answers"], made["training"]["retain_own_answers"]) == ("lethe", "kl", 5.0, True, True)
    assert "settings_from" not in made["training"]
    assert a.put("/v1/profiles/gated", json={"backend": "asu", "weights": made["id"]}).json()["spec"][
        "repeat_guard"] == 3, "a gated adapter alone guards its rows' repeats by default"
    full_training = a.get(f"/v1/asu/{state['weights']}").json()["training"]
    assert (full_training["preset"], full_training["retain_loss"], full_training["own_answers"]) == \
        ("minimal", "gd", False)
    assert a.post("/v1/asu", json={"forget": forget_id, "retain": retain_id, "preset": "best"}).status_code == 422
    a.put("/v1/profiles/full", json={"backend": "asu", "weights": state["weights"]})
    gated = a.put("/v1/profiles/gated", json={"backend": "asu", "weights": tuned["weights"]}).json()
    assert gated["spec"]["repeat_guard"] == 3, "gated weights guard their rows where the gate is on, by default"
    alone = _ask(a, [rec], "gated")[0]["text"]
    # rows of a LoRA adapter, a full-layer adapter, a gated adapter and the base in one batch
    with ThreadPoolExecutor(4) as pool:
        outs = list(pool.map(lambda p: _ask(a, [rec], p)[0], ["asu", "full", "gated", None]))
    assert [o["profile"]["name"] for o in outs] == ["asu", "full", "gated", "base"] and outs[3]["text"] == base_answer
    assert outs[2]["text"] == alone


def test_jobs_and_adapter_changes_while_serving_fail_no_request(tiny_model_dir, tiny_records, tmp_path):
    """Training (T3 and ASU) and attaching adapters happen while requests stream in; none fails or changes."""
    with running_server(load_model(tiny_model_dir), tmp_path) as url:
        c = new_tenant(url, "busy")
        forget, retain = split_by_author(tiny_records, 1)
        f = c.post("/v1/datasets", content=_jsonl(forget)).json()["id"]
        r = c.post("/v1/datasets", content=_jsonl(retain)).json()["id"]
        rec = retain[4]
        expected = _ask(c, [rec])[0]["text"]
        stop, failures, answers = threading.Event(), [], []

        def load():
            with httpx.Client(base_url=url, headers=c.headers, timeout=60) as h:
                while not stop.is_set():
                    out = h.post("/generate", json={"prompt": question_prompt(rec["question"]), "temperature": 0,
                                                    "max_new_tokens": 40})
                    (answers if out.status_code == 200 else failures).append(out.json())

        with ThreadPoolExecutor(4) as pool:
            workers = [pool.submit(load) for _ in range(3)]
            try:
                asu = _wait_job(c, c.post("/v1/asu", json={"forget": f, "retain": r, "steps": 20}).json()["id"])
                assert asu["status"] == "succeeded", asu
                assert c.put("/v1/profiles/a", json={"backend": "asu", "weights": asu["weights"]}).status_code == 200
                head = _wait_job(c, c.post("/v1/heads", json={"forget": f, "retain": r}).json()["id"])
                assert head["status"] == "succeeded", head  # trained on a copy: an adapter is attached now
                assert c.put("/v1/profiles/t", json={"head": head["head"]}).status_code == 200
                assert _ask(c, [rec], "a")[0]["profile"]["name"] == "a"
            finally:
                stop.set()
                for w in workers:
                    w.result()
        assert failures == [] and len(answers) > 10
        assert {a["text"] for a in answers} == {expected}, "base rows never saw an adapter or a half-changed model"
