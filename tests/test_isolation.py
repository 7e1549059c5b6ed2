"""Issue 11: one tenant never reaches another, one request never fails others.

Each test here failed on the code before the fix it names (finding numbers are issue 11's)."""

from __future__ import annotations

import json
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict

import httpx
import pytest
import torch
from fastapi.testclient import TestClient
from safetensors.torch import save_file

from lethe.heads.asu.weights import TARGETS, ASUInfo, expected_tensors, projection_shapes
from lethe.heads.decoding.decode import Batch
from lethe.heads.t3.guide import HeadGuide, TiltSettings
from lethe.heads.t3.head import HeadInfo, T3Head, save_head
from lethe.heads.modelio import load_model
from lethe.heads.records import question_prompt
from lethe.heads.decoding.sampling import SamplingParams
from live_server import ADMIN_KEY, new_tenant, running_server
from lethe.server.app import create_app
from lethe.server.engine import Engine, Pending
from lethe.server.settings import Settings

GREEDY = {"temperature": 0, "max_new_tokens": 24}


def _jsonl(records) -> bytes:
    return "".join(json.dumps(r) + "\n" for r in records).encode()


def _tenant(client, name) -> dict:
    r = client.post("/admin/tenants", json={"name": name}, headers={"Authorization": f"Bearer {ADMIN_KEY}"})
    return {"Authorization": f"Bearer {r.json()['api_key']}"}


@pytest.fixture(scope="module")
def served(tiny_model_dir, tmp_path_factory):
    """A server with a model of its own (adapters are attached to it in place), tenants alice and bob."""
    lm = load_model(tiny_model_dir)
    settings = Settings(model=tiny_model_dir, data_dir=tmp_path_factory.mktemp("data"), admin_key=ADMIN_KEY,
                        demo_tenant=False, max_new_tokens_limit=64, allow_anonymous=True)
    with TestClient(create_app(settings, lm)) as c:
        yield c, lm, _tenant(c, "alice"), _tenant(c, "bob")


def _answers(client, prompts, headers=None, **extra) -> list[str]:
    out = []
    for p in prompts:
        r = client.post("/generate", json={"prompt": p, **GREEDY, **extra}, headers=headers or {})
        assert r.status_code == 200, r.text
        out.append(r.json()["text"])
    return out


def _asu_file(path, lm, *, rank=4, scale=0.02, **changes):
    """Well-formed ASU weights for `lm`, then `changes` to tensors (`tensors=`) or metadata (other keys)."""
    info = ASUInfo(base_fingerprint=lm.fingerprint, tau=4.0, layers=[0], lora_rank=rank, lora_alpha=8,
                   target_modules=list(TARGETS))
    gen = torch.Generator().manual_seed(0)
    tensors = {k: torch.randn(s, generator=gen) * scale
               for k, s in expected_tensors(info, projection_shapes(lm.model)).items()}
    tensors = changes.pop("tensors", lambda t: t)(tensors)
    meta = asdict(info) | changes
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path), metadata={"lethe": json.dumps(meta)})
    return path


def _upload(client, headers, path, route="/v1/asu/upload"):
    return client.post(route, files={"file": ("w.safetensors", path.read_bytes())}, headers=headers)


def _prompts(tiny_records):
    return [question_prompt(r["question"]) for r in tiny_records[:3]]


# 1. A tenant can change the shared model's output for everyone.

BAD_ASU = {
    "a key that fits no module": dict(tensors=lambda t: t | {"base_model.model.model.layers.0.nope.lora_A.weight":
                                                             torch.zeros(4, 4)}),
    "a tensor of the wrong shape": dict(tensors=lambda t: {k: (v[:, :-1] if i == 0 else v)
                                                           for i, (k, v) in enumerate(t.items())}),
    "a missing tensor": dict(tensors=lambda t: dict(list(t.items())[1:])),
    "an integer tensor": dict(tensors=lambda t: {k: (v.to(torch.int32) if i == 0 else v)
                                                 for i, (k, v) in enumerate(t.items())}),
    "absurd values": dict(tensors=lambda t: {k: v * 1e6 for k, v in t.items()}),
    "rank 10000 claimed": dict(lora_rank=10000),
    "a layer the model lacks": dict(layers=[99]),
    "an unknown target module": dict(target_modules=["q_proj", "lm_head"]),
    "an unknown mode": dict(mode="merged"),
    "metrics of the wrong type": dict(metrics=[1, 2]),
}


@pytest.mark.parametrize("case", list(BAD_ASU))
def test_bad_asu_uploads_are_refused_and_leave_nothing(served, tmp_path, tiny_records, case):
    client, lm, alice, bob = served
    before = _answers(client, _prompts(tiny_records)), _answers(client, _prompts(tiny_records), bob)
    files = client.app.state.store.blobs.digests()
    r = _upload(client, alice, _asu_file(tmp_path / "w.safetensors", lm, **BAD_ASU[case]))
    assert r.status_code == 422, (case, r.text)
    assert r.json()["detail"][0]["loc"][-1] == "file"
    assert client.get("/v1/asu", headers=alice).json() == []
    assert client.app.state.store.blobs.digests() == files  # nothing kept on disk either
    assert (_answers(client, _prompts(tiny_records)), _answers(client, _prompts(tiny_records), bob)) == before


def test_weights_that_fail_to_attach_leave_every_other_row_exactly_as_before(served, tmp_path, tiny_records,
                                                                            monkeypatch):
    """A bad file already in the store (written before uploads were checked), and an attach that fails half-way:
    both answer an error to the tenant who asked, and nobody else's answers change."""
    client, lm, alice, bob = served
    prompts = _prompts(tiny_records)
    before = _answers(client, prompts), _answers(client, prompts, bob)
    good = _upload(client, alice, _asu_file(tmp_path / "good.safetensors", lm))
    assert good.status_code == 201, good.text
    store = client.app.state.store
    # replace the stored file by one with a tensor that fits no module: as if stored by an older release
    _asu_file(store.file("asu_weights", good.json()["id"]), lm, **BAD_ASU["a key that fits no module"])
    r = client.post("/generate", json={"prompt": prompts[0], "profile": {"backend": "asu",
                                                                          "weights": good.json()["id"]}},
                    headers=alice)
    # the server's stored copy is at fault, not the request: 500, saying what is wrong with it
    assert r.status_code == 500 and "fit no module" in r.json()["detail"], r.text
    assert client.put("/v1/profiles/bad", json={"backend": "asu", "weights": good.json()["id"]},
                      headers=alice).status_code == 500
    assert (_answers(client, prompts), _answers(client, prompts, bob)) == before

    # a valid file whose attach fails half-way (after peft has wrapped the model and added the layers)
    fresh = _upload(client, alice, _asu_file(tmp_path / "fresh.safetensors", lm, scale=0.5))
    import peft

    def fail(*args, **kwargs):
        raise RuntimeError("injected failure while loading adapter tensors")

    monkeypatch.setattr(peft, "set_peft_model_state_dict", fail)
    r = client.post("/generate", json={"prompt": prompts[0], "profile": {"backend": "asu",
                                                                          "weights": fresh.json()["id"]}},
                    headers=alice)
    assert r.status_code >= 400
    monkeypatch.undo()
    assert (_answers(client, prompts), _answers(client, prompts, bob)) == before
    assert not any("lora" in type(m).__module__ for m in lm.model.modules())  # nothing injected stayed behind
    # and with the attach working, the adapter changes alice's rows only
    spec = {"backend": "asu", "weights": fresh.json()["id"]}
    with ThreadPoolExecutor(3) as pool:
        mixed = list(pool.map(lambda h: _answers(client, prompts, h[0], **h[1]),
                              [(alice, {"profile": spec}), (bob, {}), (None, {})]))
    assert mixed[1] == before[1] and mixed[2] == before[0]
    assert mixed[0] != before[0]


# 2. One request fails every request in its batch.

def test_a_row_that_raises_fails_alone_and_the_others_decode_as_alone(tiny_lm, monkeypatch):
    prompts = ["Question: Who is Ada?\nAnswer:", "Question: Where was the author born?\nAnswer:",
               "Question: What did she write?\nAnswer:"]
    params = SamplingParams(max_new_tokens=16, temperature=0)
    engine = Engine(tiny_lm, max_batch_size=8)
    try:
        alone = [engine.submit(Pending(p, params)).future.result(60).text for p in prompts]
        real_append = Batch._append

        def append(self, row, token, *rest):  # the second prompt's row raises once it has a few tokens
            if row.params.seed == 666 and len(row.token_ids) >= 3:
                raise RuntimeError("injected row failure")
            return real_append(self, row, token, *rest)

        monkeypatch.setattr(Batch, "_append", append)
        bad = SamplingParams(max_new_tokens=16, temperature=0, seed=666)
        pendings = [Pending(p, bad if i == 1 else params) for i, p in enumerate(prompts)]
        for p in pendings:
            engine.submit(p)
        assert "injected" in str(pendings[1].future.exception(60))
        assert [pendings[i].future.result(60).text for i in (0, 2)] == [alone[0], alone[2]]

        real_init = Batch.__init__

        def init(self, model, tokenizer, group_prompts, *a, **k):  # prefill fails for one request of a group
            if any("BOOM" in p for p in group_prompts):
                raise ValueError("injected prefill failure")
            real_init(self, model, tokenizer, group_prompts, *a, **k)

        monkeypatch.setattr(Batch, "__init__", init)
        pendings = [Pending(p, params) for p in (prompts[0], "BOOM " + prompts[1], prompts[2])]
        for p in pendings:
            engine.submit(p)
        assert "injected prefill" in str(pendings[1].future.exception(60))
        assert [pendings[i].future.result(60).text for i in (0, 2)] == [alone[0], alone[2]]
    finally:
        engine.close()


@pytest.mark.parametrize("mergeable", [True, False])  # a plain growing cache; one no row can join (sliding windows)
def test_a_group_that_fails_together_but_starts_alone_never_fails_the_running_batch(tiny_lm, monkeypatch, mergeable):
    # a group whose prefill raises together (a GPU out of memory on many long prompts) while each of its requests
    # starts alone: the engine prefilled the survivors together once more, that failed the same way, and the error
    # failed the running batch's rows too (another tenant's). Now the survivors join as they started (merged), or,
    # where the cache cannot merge, fail alone with that error; the running batch goes on either way
    running_prompt = "Question: Who is Ada?\nAnswer:"
    marked = ["Together. Question: Where was the author born?\nAnswer:",
              "Together. Question: What did she write?\nAnswer:"]
    params = SamplingParams(max_new_tokens=16, temperature=0)
    long = SamplingParams(max_new_tokens=150, temperature=0, ignore_eos=True)
    engine = Engine(tiny_lm, max_batch_size=8)
    try:
        alone = [engine.submit(Pending(p, params)).future.result(60).text for p in marked]
        running_alone = engine.submit(Pending(running_prompt, long)).future.result(120).text
        real_init, together = Batch.__init__, []

        def init(self, model, tokenizer, group_prompts, *a, **k):  # too big together, fine alone
            if sum("Together" in p for p in group_prompts) > 1:
                together.append(len(group_prompts))
                raise RuntimeError("injected: out of memory together")
            real_init(self, model, tokenizer, group_prompts, *a, **k)

        monkeypatch.setattr(Batch, "__init__", init)
        if not mergeable:
            monkeypatch.setattr(Batch, "can_merge", lambda self: False)
        running, streaming, hold = Pending(running_prompt, long), threading.Event(), threading.Event()
        running.on_text = lambda _text, _logprobs: streaming.set()
        engine.submit(running)
        assert streaming.wait(60)  # decoding
        engine.control(hold.wait)  # the engine thread waits between two steps while the group arrives
        group = [engine.submit(Pending(p, params)) for p in marked]
        hold.set()
        if mergeable:
            assert [g.future.result(60).text for g in group] == alone
        else:
            assert all("out of memory together" in str(g.future.exception(120)) for g in group)
        assert running.future.result(120).text == running_alone
        assert together == ([2] if mergeable else [2, 2])  # the group's prefill together did fail (twice: regrouped)
    finally:
        engine.close()


@pytest.mark.parametrize("fused", [True, False])  # the CPU kernel, and the tensor operations
def test_a_row_whose_head_breaks_fails_alone(tiny_lm, fused):
    """A head whose logits are not numbers fails its row, whatever the profile's settings (with `flagged_mass` such
    a row once kept its base logits: it flagged nothing), and the batch's other rows decode as alone."""
    cfg = tiny_lm.model.config
    good_head, bad_head = T3Head(cfg.hidden_size, cfg.vocab_size, 4), T3Head(cfg.hidden_size, cfg.vocab_size, 4)
    with torch.no_grad():
        bad_head.up.weight.fill_(float("nan"))
    prompts = ["Question: Who is Ada?\nAnswer:", "Question: Where was the author born?\nAnswer:"]
    params = [SamplingParams(max_new_tokens=12, temperature=0), SamplingParams(max_new_tokens=12, temperature=1.0,
                                                                              seed=1)]
    settings = TiltSettings(gate=False)
    alone = Batch(tiny_lm.model, tiny_lm.tokenizer, prompts[:1], params[:1],
                  HeadGuide([(good_head, settings)], fused=fused))
    while not alone.done:
        alone.step()
    batch = Batch(tiny_lm.model, tiny_lm.tokenizer, prompts, params,
                  HeadGuide([(good_head, settings), (bad_head, settings)], fused=fused))
    while not batch.done:
        batch.step()
    assert batch.rows[1].finish_reason == "error" and batch.rows[1].error is not None
    assert batch.rows[0].text == alone.rows[0].text and batch.rows[0].finish_reason != "error"


@pytest.mark.parametrize("route,body,field", [
    ("/generate", {"prompt": "hi", "top_k": 2**64}, "top_k"),
    ("/generate", {"prompt": "hi", "seed": 2**64}, "seed"),
    ("/generate", {"prompt": "hi", "max_new_tokens": 10**12}, "max_new_tokens"),
    ("/generate", {"prompt": "hi", "profile": {"head": "h", "T": 1e-40, "gate": False}}, "T"),
    ("/generate", {"prompt": "hi", "stream": "yes"}, "stream"),
    ("/generate", {"prompt": "hi", "stop": ["x" * 5000]}, "stop"),
    ("/v1/completions", {"prompt": "hi", "seed": 2**64}, "seed"),
    ("/v1/completions", {"prompt": "hi", "stop": ["s"] * 17}, "stop"),
    ("/v1/completions", {"prompt": "hi", "stream": "yes"}, "stream"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 10**12}, "max_tokens"),
])
def test_out_of_bounds_numbers_are_4xx_naming_the_field(served, route, body, field):
    client, _, alice, _ = served
    r = client.post(route, json=body, headers=alice)
    if route.startswith("/v1/"):  # OpenAI's routes answer in OpenAI's shape: 400, the field as `param`
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["type"] == "invalid_request_error" and error["param"].split(".")[0] == field, r.text
        return
    assert r.status_code == 422, r.text
    assert any(field in [str(part) for part in d["loc"]] for d in r.json()["detail"]), r.text


def test_tiny_temperatures_decode_greedily_and_fail_nobody(served, tiny_records):
    client, _, alice, bob = served
    prompt = _prompts(tiny_records)[0]
    greedy = _answers(client, [prompt], bob)[0]
    for route, body in (("/generate", {"prompt": prompt, "temperature": 1e-39, "max_new_tokens": 24}),
                        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                                  "temperature": 1e-39, "max_tokens": 8})):
        with ThreadPoolExecutor(4) as pool:
            others = [pool.submit(_answers, client, [prompt], bob) for _ in range(3)]
            r = client.post(route, json=body, headers=alice)
            assert r.status_code == 200, r.text
            assert [o.result()[0] for o in others] == [greedy] * 3
    assert client.post("/generate", json={"prompt": prompt, "temperature": 1e-39, "max_new_tokens": 24},
                       headers=alice).json()["text"] == greedy


# 3. Deleting weights or a head while rows use them fails those rows.

def test_deleting_weights_in_use_pins_them_until_the_rows_end(served, tmp_path, tiny_records):
    client, lm, alice, _ = served
    prompt = _prompts(tiny_records)[1]
    w = _upload(client, alice, _asu_file(tmp_path / "pin.safetensors", lm, scale=0.5)).json()["id"]
    spec = {"backend": "asu", "weights": w}
    expected = client.post("/generate", json={"prompt": prompt, "profile": spec, "temperature": 0,
                                              "max_new_tokens": 64}, headers=alice).json()["text"]
    # the adapter is LRU-evicted only when unpinned; here: delete while 4 rows decode with it (each has sent its
    # first text, so each was admitted and pinned the weights before the delete)
    started = threading.Barrier(5)

    def row() -> str:
        text, first = "", True
        with client.stream("POST", "/generate", json={"prompt": prompt, "profile": spec, "temperature": 0,
                                                      "max_new_tokens": 64, "stream": True}, headers=alice) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    if first:
                        started.wait(30)
                        first = False
                    text += json.loads(line[6:])["text"]
        return text

    with ThreadPoolExecutor(4) as pool:
        rows = [pool.submit(row) for _ in range(4)]
        started.wait(30)
        deleted = client.delete(f"/v1/asu/{w}", headers=alice)
        answers = [r.result() for r in rows]
    assert deleted.status_code == 204
    assert set(answers) == {expected}
    r = client.post("/generate", json={"prompt": prompt, "profile": spec}, headers=alice)
    assert r.status_code == 404
    deadline = time.time() + 10  # detached once the last row ended
    while f"asu_{w}" in getattr(client.app.state.engine.lm.model, "peft_config", {}) and time.time() < deadline:
        client.post("/generate", json={"prompt": prompt, "max_new_tokens": 1})
        time.sleep(0.05)
    assert f"asu_{w}" not in getattr(client.app.state.engine.lm.model, "peft_config", {})


def test_weights_that_fail_to_load_evict_no_adapter(served, tmp_path, tiny_records, monkeypatch):
    # a full adapter cache evicts the least recent unpinned adapter for new weights; the eviction once came before the
    # new weights were read, so weights that failed to load (deleted meanwhile, not servable) left the evicted adapter
    # attached but no longer listed: memory past the cache's size that nothing would free
    from lethe.server.profiles import ProfileError

    client, lm, alice, _ = served
    body = {"prompt": _prompts(tiny_records)[0], "temperature": 0, "max_new_tokens": 8}
    cache, real_load = client.app.state.adapters, client.app.state.adapters.load
    first, second = (_upload(client, alice, _asu_file(tmp_path / f"{n}.safetensors", lm, scale=0.5)).json()["id"]
                     for n in ("evicted", "unloadable"))

    def load(weights_id):
        if weights_id == second:
            raise ProfileError(422, "weights", "injected: these weights cannot be served")
        return real_load(weights_id)

    try:
        for name, weights in (("evicted", first), ("unloadable", second)):  # stored: the weights read at first use
            assert client.put(f"/v1/profiles/{name}", json={"backend": "asu", "weights": weights},
                              headers=alice).status_code == 200
        monkeypatch.setattr(cache, "size", 1)
        expected = client.post("/generate", json=body | {"profile": "evicted"}, headers=alice)
        assert expected.status_code == 200, expected.text
        monkeypatch.setattr(cache, "load", load)
        r = client.post("/generate", json=body | {"profile": "unloadable"}, headers=alice)
        assert r.status_code == 422 and "injected" in r.text
        attached = set(getattr(client.app.state.engine.lm.model, "peft_config", {}))
        assert attached <= set(cache._names.values()) and f"asu_{first}" in attached  # every one attached is listed
        again = client.post("/generate", json=body | {"profile": "evicted"}, headers=alice)
        assert again.status_code == 200, again.text
        assert again.json()["text"] == expected.json()["text"]
    finally:  # the module's server is shared: leave alice's profiles as they were
        monkeypatch.undo()
        for name in ("evicted", "unloadable"):
            client.delete(f"/v1/profiles/{name}", headers=alice)


def test_every_choice_of_a_request_decodes_with_one_version_of_its_profile(served, tmp_path, tiny_records,
                                                                             monkeypatch):
    # the n choices of a request are admitted one by one; each once read its profile's current version, so a new
    # version landing meanwhile served some choices with the old and some with the new, while the response named one
    client, lm, alice, _ = served
    cfg = lm.model.config
    torch.manual_seed(5)
    head = T3Head(cfg.hidden_size, cfg.vocab_size, 4)
    torch.nn.init.normal_(head.up.weight, std=2.0)
    save_head(tmp_path / "v2.safetensors", head, HeadInfo(base_fingerprint=lm.fingerprint, d=cfg.hidden_size,
                                                         vocab=cfg.vocab_size, rank=4))
    head_id = _upload(client, alice, tmp_path / "v2.safetensors", "/v1/heads/upload").json()["id"]
    body = {"prompt": _prompts(tiny_records)[0], "max_tokens": 12, "temperature": 0}
    store, real, landed = client.app.state.store, client.app.state.store.current_profile, []

    def current_profile(tenant_id, name):  # a new version lands right after the request first reads the profile
        found = real(tenant_id, name)
        if name == "pinned" and not landed:
            landed.append(True)
            store.put_profile(tenant_id, name, second)
        return found

    try:
        for name, spec in (("pinned", {"backend": "base"}), ("tilted", {"head": head_id, "gate": False, "lam": 20.0})):
            assert client.put(f"/v1/profiles/{name}", json=spec, headers=alice).status_code == 200
        second = client.get("/v1/profiles/tilted", headers=alice).json()["spec"]
        answers = {name: client.post("/v1/completions", json=body | {"model": name}, headers=alice).json()
                   for name in ("pinned", "tilted")}
        assert answers["pinned"]["choices"][0]["text"] != answers["tilted"]["choices"][0]["text"]
        monkeypatch.setattr(store, "current_profile", current_profile)
        r = client.post("/v1/completions", json=body | {"model": "pinned", "n": 3}, headers=alice)
        assert r.status_code == 200, r.text
        assert r.json()["lethe_profile"] == {"name": "pinned", "version": 1}
        assert [c["text"] for c in r.json()["choices"]] == [answers["pinned"]["choices"][0]["text"]] * 3
    finally:  # the module's server is shared: leave alice's profiles as they were
        monkeypatch.undo()
        for name in ("pinned", "tilted"):
            client.delete(f"/v1/profiles/{name}", headers=alice)


def test_delete_guard_covers_profile_history_and_jobs(served, tiny_lm, tmp_path, tiny_records):
    client, lm, alice, _ = served
    cfg = lm.model.config
    info = HeadInfo(base_fingerprint=lm.fingerprint, d=cfg.hidden_size, vocab=cfg.vocab_size, rank=4)
    ids = []
    for i in range(2):
        save_head(tmp_path / f"h{i}.safetensors", T3Head(cfg.hidden_size, cfg.vocab_size, 4), info)
        ids.append(_upload(client, alice, tmp_path / f"h{i}.safetensors", "/v1/heads/upload").json()["id"])
    assert client.put("/v1/profiles/hist", json={"head": ids[0]}, headers=alice).status_code == 200
    assert client.put("/v1/profiles/hist", json={"head": ids[1]}, headers=alice).status_code == 200
    r = client.delete(f"/v1/heads/{ids[0]}", headers=alice)  # only an old version uses it: still refused
    assert r.status_code == 409 and "'hist' v1" in r.json()["detail"]
    assert client.post("/v1/profiles/hist/rollback", headers=alice).status_code == 200
    assert client.post("/generate", json={"prompt": "hi", "profile": "hist"}, headers=alice).status_code == 200
    client.delete("/v1/profiles/hist", headers=alice)
    # a queued eval job that names the head, and its datasets
    recs = _jsonl(tiny_records[:4])
    f = client.post("/v1/datasets", content=recs, headers=alice).json()["id"]
    blocker = threading.Event()
    jobs = client.app.state.jobs
    real = jobs._evaluate

    def slow(job, cancel):
        blocker.wait(30)
        return real(job, cancel)

    jobs._evaluate = slow
    try:
        job = client.post("/v1/eval", json={"forget": f, "retain": f, "profile": {"head": ids[0]}}, headers=alice)
        assert job.status_code == 202, job.text
        r = client.delete(f"/v1/heads/{ids[0]}", headers=alice)
        assert r.status_code == 409 and job.json()["id"] in r.json()["detail"]
        assert client.delete(f"/v1/datasets/{f}", headers=alice).status_code == 409
    finally:
        blocker.set()
        jobs._evaluate = real
    deadline = time.time() + 60
    while client.get(f"/v1/jobs/{job.json()['id']}", headers=alice).json()["status"] in ("queued", "running"):
        assert time.time() < deadline
        time.sleep(0.1)
    assert client.delete(f"/v1/heads/{ids[0]}", headers=alice).status_code == 204


# 4. A tenant can freeze the whole server. 6. Training jobs fail at random under load.

def test_a_running_job_and_a_first_attach_never_stall_others(tiny_model_dir, tiny_records, tmp_path, monkeypatch):
    from lethe.server import jobs as server_jobs

    started, release = threading.Event(), threading.Event()
    real_train = server_jobs.train_head

    def slow_train(*args, **kwargs):  # a long head job: holds whatever the job holds for 6 s
        started.set()
        release.wait(6)
        return real_train(*args, **kwargs)

    monkeypatch.setattr(server_jobs, "train_head", slow_train)
    lm = load_model(tiny_model_dir)
    with running_server(lm, tmp_path) as url:
        c = new_tenant(url, "t")
        recs = _jsonl(tiny_records[:8])
        d = c.post("/v1/datasets", content=recs).json()["id"]
        w = c.post("/v1/asu/upload", files={"file": ("w", _asu_file(tmp_path / "w.safetensors", lm).read_bytes())})
        assert w.status_code == 201, w.text
        assert c.post("/v1/heads", json={"forget": d, "retain": d}).status_code == 202
        assert started.wait(30)
        with ThreadPoolExecutor(2) as pool:  # the first attach of an adapter, while the job runs
            attach = pool.submit(c.post, "/generate", json={"prompt": "hi", "max_new_tokens": 4,
                                                            "profile": {"backend": "asu", "weights": w.json()["id"]}})
            time.sleep(0.2)
            t0 = time.perf_counter()
            assert httpx.get(url + "/healthz", timeout=10).status_code == 200
            assert httpx.post(url + "/generate", json={"prompt": "hi", "max_new_tokens": 4},
                              timeout=10).status_code == 200
            waited = time.perf_counter() - t0
            assert attach.result(30).status_code == 200
        release.set()
    assert waited < 3, f"health and anonymous generation waited {waited:.1f} s behind a job"


def test_tokenizer_calls_on_other_threads_never_break_a_batch(tiny_lm, monkeypatch):
    """The engine pads its batches with a tokenizer while request threads count tokens with one (no padding)
    and a job pads its own batches: with one shared tokenizer object, one thread's padding settings leak into
    another's call. Frequent thread switches make the race show within a few rounds on a shared tokenizer."""
    import sys

    monkeypatch.setattr(sys, "getswitchinterval", sys.getswitchinterval)
    old_interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    engine = Engine(tiny_lm, max_batch_size=8)
    stop, errors = threading.Event(), []

    def count():
        while not stop.is_set():
            engine.count_tokens("Question: a short one?")

    hammer = threading.Thread(target=count)
    hammer.start()
    try:
        for round_ in range(25):
            group = [Pending("Question: " + "word " * (1 + (i * 7 + round_) % 13) + "?\nAnswer:",
                             SamplingParams(max_new_tokens=2, temperature=0)) for i in range(6)]
            for p in group:
                engine.submit(p)
            errors += [str(p.future.exception(60)) for p in group if p.future.exception(60) is not None]
            if errors:
                break
    finally:
        stop.set()
        hammer.join()
        engine.close()
        sys.setswitchinterval(old_interval)
    assert errors == []


# 7. 500s from input. 8. Unbounded bodies. 12. Low.

def test_malformed_input_is_a_4xx_and_leaves_no_row(served, tmp_path):
    client, lm, alice, _ = served
    r = client.post("/generate", content=b'{"prompt": "a\\ud800b"}', headers=alice)
    assert r.status_code == 422 and "prompt" in r.json()["detail"][0]["loc"]
    r = client.post("/v1/datasets", content=b"[" * 100_000 + b"\n", headers=alice)
    assert r.status_code == 422 and "line 1" in r.json()["detail"][0]["loc"]
    r = client.post("/v1/datasets", content=b'{"question": "a\\ud800", "answer": "b"}\n', headers=alice)
    assert r.status_code == 422 and r.json()["detail"][0]["loc"][-1] == "question"
    cfg = lm.model.config
    good = HeadInfo(base_fingerprint=lm.fingerprint, d=cfg.hidden_size, vocab=cfg.vocab_size, rank=4)
    heads_before = client.get("/v1/heads", headers=alice).json()
    for change in ({"profile": {"T": -1}}, {"profile": {"zzz": 1}}, {"metrics": [1, 2]}, {"rank": [4]}):
        path = tmp_path / "h.safetensors"
        head = T3Head(cfg.hidden_size, cfg.vocab_size, 4)
        save_file({k: v.contiguous() for k, v in head.state_dict().items()}, str(path),
                  metadata={"lethe": json.dumps(good.__dict__ | change)})
        r = _upload(client, alice, path, "/v1/heads/upload")
        assert r.status_code == 422, (change, r.text)
        listing = client.get("/v1/heads", headers=alice)
        assert listing.status_code == 200 and listing.json() == heads_before


def test_bodies_are_bounded_and_stalled_bodies_cut_off(tiny_model_dir, tmp_path):
    lm = load_model(tiny_model_dir)
    with running_server(lm, tmp_path, max_request_bytes=100_000, body_timeout=1.0, max_upload_bytes=50_000) as url:
        t0 = time.perf_counter()
        r = httpx.post(url + "/generate", json={"prompt": "x" * 8_000_000}, timeout=30)
        assert r.status_code == 413 and time.perf_counter() - t0 < 5

        def chunks():  # chunked: no Content-Length to refuse up front
            for _ in range(100):
                yield b'{"prompt": "' + b"y" * 10_000
        r = httpx.post(url + "/generate", content=chunks(), timeout=30)
        assert r.status_code == 413
        assert httpx.get(url + "/healthz", timeout=2).status_code == 200
        c = new_tenant(url, "up")

        def multipart():  # a chunked multipart upload far beyond the limit: refused while it streams
            yield b"--b\r\nContent-Disposition: form-data; name=\"file\"; filename=\"x\"\r\n\r\n"
            for _ in range(1000):
                yield b"z" * 10_000
        r = c.post("/v1/datasets", content=multipart(), headers={"content-type": "multipart/form-data; boundary=b"})
        assert r.status_code == 413

        def stalled():
            yield b'{"prompt": '
            time.sleep(2.5)
            yield b'"late"}'
        r = httpx.post(url + "/generate", content=stalled(), timeout=30)
        assert r.status_code == 408


def test_low_findings(served, tmp_path):
    client, lm, alice, _ = served
    for header in ("Basic dXNlcjpwYXNz", "Token abc", "lk_abc"):
        r = client.post("/generate", json={"prompt": "hi", "max_new_tokens": 2}, headers={"Authorization": header})
        assert r.status_code == 401, header
    for header in ("Bearer ", "Bearer"):  # no key (lm-evaluation-harness without one): anonymous, where that is on
        r = client.post("/generate", json={"prompt": "hi", "max_new_tokens": 2}, headers={"Authorization": header})
        assert r.status_code == 200 and r.json()["profile"]["name"] == "base", header
        r = client.post("/generate", json={"prompt": "hi", "profile": "p"}, headers={"Authorization": header})
        assert r.status_code == 401, header  # and a profile still needs a key
    assert client.get("/v1/profiles", headers={"Authorization": "Bearer "}).status_code == 401
    for name in ("BASE", "a%0Ab", "a%00b", "%20base", "-x"):
        r = client.put(f"/v1/profiles/{name}", json={"backend": "base"}, headers=alice)
        assert r.status_code in (404, 422), (name, r.status_code)
    assert client.get("/v1/profiles", headers=alice).json() == []
    ready = client.get("/readyz").json()
    assert "/" not in ready["model"] and str(lm.path) not in json.dumps(ready)


# 9. Per-tenant quotas and fair scheduling.

def test_quotas_answer_429_and_jobs_take_turns_across_tenants(tiny_model_dir, tmp_path, tiny_records):
    lm = load_model(tiny_model_dir)
    settings = Settings(model=tiny_model_dir, data_dir=tmp_path, admin_key=ADMIN_KEY, demo_tenant=False,
                        quota_datasets=2, quota_jobs=3, quota_rows=2, max_new_tokens_limit=512,
                        allow_anonymous=True)
    recs = _jsonl(tiny_records[:4])
    with TestClient(create_app(settings, lm)) as client:
        a, b = _tenant(client, "a"), _tenant(client, "b")
        ds = [client.post("/v1/datasets", content=recs, headers=a) for _ in range(3)]
        assert [r.status_code for r in ds] == [201, 201, 429]
        assert "LETHE_QUOTA_DATASETS" in ds[2].json()["detail"]
        d_a, d_b = ds[0].json()["id"], client.post("/v1/datasets", content=recs, headers=b).json()["id"]

        jobs, order, gate = client.app.state.jobs, [], threading.Event()

        def record(job, cancel):  # stands in for training: notes who ran, the first one holds the worker
            order.append(job["tenant_id"])
            gate.wait(30)

        jobs._train = record
        body = lambda d: {"forget": d, "retain": d}  # noqa: E731
        first = client.post("/v1/heads", json=body(d_a), headers=a)
        deadline = time.time() + 10
        while not order and time.time() < deadline:
            time.sleep(0.02)
        more_a = [client.post("/v1/heads", json=body(d_a), headers=a) for _ in range(3)]
        assert [r.status_code for r in [first] + more_a] == [202, 202, 202, 429]
        assert "LETHE_QUOTA_JOBS" in more_a[2].json()["detail"] and more_a[2].headers["Retry-After"]
        assert client.post("/v1/heads", json=body(d_b), headers=b).status_code == 202  # b queued after a's
        gate.set()
        deadline = time.time() + 30
        while len(order) < 4 and time.time() < deadline:
            time.sleep(0.05)
        a_id, b_id = order[0], next(t for t in order if t != order[0])
        assert order == [a_id, b_id, a_id, a_id], "b's job ran before a's second and third"

        with ThreadPoolExecutor(5) as pool:  # rows in flight: 2 per tenant
            slow = {"prompt": "hi", "max_new_tokens": lm.model.config.max_position_embeddings - 8, "temperature": 1.0,
                    "seed": 1}
            mine = [pool.submit(client.post, "/generate", json=slow, headers=a) for _ in range(4)]
            time.sleep(0.1)
            other = pool.submit(client.post, "/generate", json={"prompt": "hi", "max_new_tokens": 4}, headers=b)
            statuses = sorted(r.result().status_code for r in mine)
            assert other.result().status_code == 200
        assert statuses.count(429) >= 1 and set(statuses) <= {200, 429}
        limited = next(r.result() for r in mine if r.result().status_code == 429)
        assert limited.headers["Retry-After"] and "LETHE_QUOTA_ROWS" in limited.json()["detail"]


# Found by a second, independent probe after the fixes above (issue 11's classes, other values).

def test_second_probe_inputs_are_4xx_and_leave_nothing(served, tmp_path, tiny_records):
    client, lm, alice, _ = served
    prompt = _prompts(tiny_records)[0]
    for route, body in (("/generate", {"prompt": prompt, "top_p": 5e-324, "temperature": 1, "max_new_tokens": 8}),
                        ("/v1/completions", {"prompt": prompt, "top_p": 5e-324, "max_tokens": 8})):
        r = client.post(route, json=body)  # a top_p that rounds to 0 keeps the best token: greedy
        assert r.status_code == 200, r.text
    for route in ("/v1/completions", "/v1/chat/completions", "/generate"):
        r = client.post(route, content=b'{"\\ud800": 1}', headers={"content-type": "application/json"})
        assert r.status_code == (400 if route.startswith("/v1/") else 422), (route, r.text)
    cfg = lm.model.config
    good = HeadInfo(base_fingerprint=lm.fingerprint, d=cfg.hidden_size, vocab=cfg.vocab_size, rank=4)
    deep: dict = {}
    for _ in range(900):
        deep = {"x": deep}
    heads_before = client.get("/v1/heads", headers=alice).json()
    head = T3Head(cfg.hidden_size, cfg.vocab_size, 4)
    state = {k: v.contiguous() for k, v in head.state_dict().items()}
    cases = [(state, {"metrics": {"x": "\udc80"}}), (state, {"metrics": {"\udc80": 1}}), (state, {"metrics": deep}),
             (state, {"layer": 5}), (state, {"pooling": "max"}), (state, {"format_version": 0}),
             ({k: v.to(torch.float8_e4m3fn) for k, v in state.items()}, {}),
             ({k: v.double() for k, v in state.items()}, {}),
             ({k: torch.full_like(v, 3e38) for k, v in state.items()}, {})]
    for tensors, change in cases:
        path = tmp_path / "h.safetensors"
        save_file(tensors, str(path), metadata={"lethe": json.dumps(good.__dict__ | change)})
        r = _upload(client, alice, path, "/v1/heads/upload")
        assert r.status_code == 422, (change, r.text)
        listing = client.get("/v1/heads", headers=alice)
        assert listing.status_code == 200 and listing.json() == heads_before
    for change in ({"metrics": {"x": "\ud800"}}, {"training": deep}, {"steps": -5}, {"layers": []},
                   {"tensors": lambda t: {k: v.to(torch.float8_e4m3fn) for k, v in t.items()}}):
        r = _upload(client, alice, _asu_file(tmp_path / "w.safetensors", lm, **change))
        assert r.status_code == 422, (change, r.text)
        assert client.get("/v1/asu", headers=alice).status_code == 200


def test_a_big_upload_never_stalls_others_and_cancelled_evals_stop(tiny_model_dir, tiny_records, tmp_path):
    lm = load_model(tiny_model_dir)
    with running_server(lm, tmp_path, max_upload_bytes=130 * 2**20) as url:
        c = new_tenant(url, "big")
        line = (json.dumps({"prompt": "p", "completion": "c", "x": [1] * 800}) + "\n").encode()
        data = line * 49_000  # 120 MB of small numbers: seconds of parsing on this machine
        with ThreadPoolExecutor(1) as pool:
            t0 = time.perf_counter()
            upload = pool.submit(c.post, "/v1/datasets", content=data, timeout=120)
            waits = []
            while not upload.done():
                t = time.perf_counter()
                assert httpx.get(url + "/healthz", timeout=30).status_code == 200
                waits.append(time.perf_counter() - t)
                time.sleep(0.05)
            took = time.perf_counter() - t0
        assert upload.result().status_code == 201, upload.result().text
        # the client and the server share this process (and its GIL), so some wait is the client's and a loaded
        # machine adds single outliers (1.1 s was seen once in CI, 2.2 s in a slow run beside another process);
        # parsing on the event loop stalled /healthz for the whole parse, 3.7 s here, and 8 s in the probe that found
        # it: most of the upload's time, where a loaded machine's outlier is a small part of it
        bar = max(2.0, took / 3)
        assert max(waits) < bar, f"/healthz waited {max(waits):.2f} s during a {took:.1f} s upload (bar {bar:.1f} s)"
        assert statistics.median(waits) < 0.25, f"/healthz's median wait {statistics.median(waits):.2f} s"
        recs = _jsonl(tiny_records[:20])
        d = c.post("/v1/datasets", content=recs).json()["id"]
        job = c.post("/v1/eval", json={"forget": d, "retain": d, "seeds": list(range(10)), "max_new_tokens": 200})
        assert job.status_code == 202, job.text
        deadline = time.time() + 60
        while c.get(f"/v1/jobs/{job.json()['id']}").json()["status"] != "running":
            assert time.time() < deadline
            time.sleep(0.05)
        time.sleep(0.5)
        t0 = time.perf_counter()
        assert c.post(f"/v1/jobs/{job.json()['id']}/cancel").status_code == 200
        while c.get(f"/v1/jobs/{job.json()['id']}").json()["status"] == "running":
            assert time.perf_counter() - t0 < 20, "a cancelled eval kept running"
            time.sleep(0.1)
        assert c.get(f"/v1/jobs/{job.json()['id']}").json()["status"] == "cancelled"


def test_concurrent_submissions_cannot_pass_a_quota_together(tiny_model_dir, tmp_path, tiny_records):
    settings = Settings(model=tiny_model_dir, data_dir=tmp_path, admin_key=ADMIN_KEY, demo_tenant=False,
                        quota_jobs=3, quota_datasets=3, allow_anonymous=True)
    recs = _jsonl(tiny_records[:4])
    with TestClient(create_app(settings, load_model(tiny_model_dir))) as client:
        a = _tenant(client, "a")
        gate = threading.Event()
        client.app.state.jobs._train = lambda job, cancel: gate.wait(30)
        with ThreadPoolExecutor(8) as pool:
            ds = list(pool.map(lambda _: client.post("/v1/datasets", content=recs, headers=a).status_code, range(8)))
        assert sorted(ds) == [201] * 3 + [429] * 5
        d = client.get("/v1/datasets", headers=a).json()[0]["id"]
        with ThreadPoolExecutor(8) as pool:
            jobs = list(pool.map(lambda _: client.post("/v1/heads", json={"forget": d, "retain": d},
                                                       headers=a).status_code, range(8)))
        gate.set()
        assert sorted(jobs) == [202] * 3 + [429] * 5


def test_a_chat_format_job_on_a_model_without_a_template_is_422(served, tiny_records):
    client, _, alice, _ = served
    recs = _jsonl(tiny_records[:4])
    d = client.post("/v1/datasets", content=recs, headers=alice).json()["id"]
    for route in ("/v1/heads", "/v1/asu", "/v1/eval"):
        r = client.post(route, json={"forget": d, "retain": d, "format": "chat"}, headers=alice)
        assert r.status_code == 422 and r.json()["detail"][0]["loc"][-1] == "format", (route, r.text)
