"""Hostile input: property-based uploads and generation bodies never produce a 500; named cases answer a
clear 4xx naming the field; and every endpoint keeps tenants apart."""

import json
import re

import pytest
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import save_file

from lethe.heads.t3.head import HeadInfo, T3Head, save_head
from lethe.heads.records import question_prompt
from live_server import ADMIN_KEY
from lethe.server.app import create_app
from lethe.server.settings import Settings
from lethe.server.storage import hash_key


@pytest.fixture(scope="module")
def app_client(tiny_model_dir, tmp_path_factory):
    from lethe.heads.modelio import load_model

    settings = Settings(model=tiny_model_dir, data_dir=tmp_path_factory.mktemp("data"), admin_key=ADMIN_KEY,
                        demo_tenant=False, max_upload_bytes=20_000, max_new_tokens_limit=64,
                        allow_anonymous=True)
    with TestClient(create_app(settings, load_model(tiny_model_dir))) as c:
        yield c


def tenant(client, name) -> dict:
    key = client.post("/admin/tenants", json={"name": name}, headers={"Authorization": f"Bearer {ADMIN_KEY}"})
    return {"Authorization": f"Bearer {key.json()['api_key']}"}


@pytest.fixture(scope="module")
def alice(app_client):
    return tenant(app_client, "alice")


json_values = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(),
                           lambda children: st.lists(children, max_size=3) | st.dictionaries(st.text(), children,
                                                                                                max_size=3),
                           max_leaves=8)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(body=st.binary(max_size=400) | st.lists(json_values, max_size=4).map(
    lambda xs: "\n".join(json.dumps(x) for x in xs).encode()))
def test_any_dataset_upload_answers_201_or_a_4xx(app_client, alice, body):
    r = app_client.post("/v1/datasets", content=body, headers=alice)
    assert r.status_code in (201, 413, 422), r.text


record = st.fixed_dictionaries({}, optional={"question": st.text(max_size=30), "answer": st.text(max_size=30),
                                             "prompt": st.text(max_size=30), "completion": json_values,
                                             "text": json_values})


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(records=st.lists(record, min_size=1, max_size=4))
def test_records_of_any_shape_answer_201_or_422_naming_the_line(app_client, alice, records):
    body = "".join(json.dumps(r) + "\n" for r in records).encode()
    r = app_client.post("/v1/datasets", content=body, headers=alice)
    assert r.status_code in (201, 422), r.text
    if r.status_code == 422:
        assert r.json()["detail"][0]["loc"][1].startswith("line ")


generate_body = st.fixed_dictionaries({}, optional={
    "prompt": json_values | st.text(max_size=50), "max_new_tokens": json_values, "temperature": json_values,
    "top_p": json_values, "top_k": json_values, "seed": json_values, "stop": json_values, "profile": json_values,
    "stream": st.booleans()})


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(body=generate_body)
def test_any_generate_body_answers_200_or_a_4xx(app_client, alice, body):
    r = app_client.post("/generate", content=json.dumps(body), headers=alice)  # NaN and Infinity included
    assert r.status_code in (200, 401, 404, 409, 422, 429), r.text


@pytest.mark.parametrize("body,field", [
    (b"{broken\n", "line 1"),
    (b'{"question": "q"}\n', "answer"),
    (b'{"prompt": "p"}\n', "completion"),
    (b"\n\n", "records"),
    (rb'{"question": "\u202e\u0000\ud7ff", "answer": ""}' + b"\n", "answer"),
])
def test_named_bad_uploads(app_client, alice, body, field):
    r = app_client.post("/v1/datasets", content=body, headers=alice)
    assert r.status_code == 422 and field in r.json()["detail"][0]["loc"][-1] + r.json()["detail"][0]["loc"][1]


def test_invalid_utf8_oversized_and_unusual_unicode(app_client, alice):
    r = app_client.post("/v1/datasets", content=b'{"text": "\xc3\x28"}\n', headers=alice)
    assert r.status_code == 422 and "UTF-8" in r.json()["detail"][0]["msg"]
    assert app_client.post("/v1/datasets", content=b"x" * 30_000, headers=alice).status_code == 413
    odd = '{"question": "Who wrote \U0001F600 \u0301\u200d e\u0301?", "answer": "\u05d0\u05d1 \uFDFD"}\n'
    assert app_client.post("/v1/datasets", content=odd.encode(), headers=alice).status_code == 201
    r = app_client.post("/generate", json={"prompt": "\U0001F600\u200d\u0301 \uFFFF", "max_new_tokens": 4},
                        headers=alice)
    assert r.status_code == 200


@pytest.mark.parametrize("change,field", [({"T": 0}, "T"), ({"T": -1}, "T"), ({"T": 1e9}, "T"), ({"lam": -0.5}, "lam"),
                                          ({"candidates": -1}, "candidates"), ({"bogus": 1}, "bogus"),
                                          ({"max_push": -1}, "max_push"), ({"max_push": 101}, "max_push"),
                                          ({"backend": "nope"}, "backend")])
def test_bad_profile_settings_name_the_field(app_client, alice, change, field):
    r = app_client.put("/v1/profiles/p", json={"head": "head_x", **change}, headers=alice)
    assert r.status_code == 422 and r.json()["detail"][0]["loc"][-1] == field


def test_uploaded_heads_with_nan_or_for_another_base_are_refused(app_client, alice, tiny_lm, tmp_path):
    cfg = tiny_lm.model.config
    head = T3Head(cfg.hidden_size, cfg.vocab_size, 4)
    good = HeadInfo(base_fingerprint=tiny_lm.fingerprint, d=cfg.hidden_size, vocab=cfg.vocab_size, rank=4)
    save_head(tmp_path / "other.safetensors", head, HeadInfo(**{**good.__dict__, "base_fingerprint": "0" * 16}))
    r = app_client.post("/v1/heads/upload", files={"file": ("h", (tmp_path / "other.safetensors").read_bytes())},
                        headers=alice)
    assert r.status_code == 409 and "trained on base model" in r.json()["detail"][0]["msg"]
    bad = {k: v.clone() for k, v in head.state_dict().items()}
    bad["down.weight"][0, 0] = float("nan")
    save_file(bad, str(tmp_path / "nan.safetensors"), metadata={"lethe": json.dumps(good.__dict__)})
    r = app_client.post("/v1/heads/upload", files={"file": ("h", (tmp_path / "nan.safetensors").read_bytes())},
                        headers=alice)
    assert r.status_code == 422 and "NaN" in r.json()["detail"][0]["msg"]
    save_head(tmp_path / "ok.safetensors", head, good)
    r = app_client.post("/v1/heads/upload", files={"file": ("h", (tmp_path / "ok.safetensors").read_bytes())},
                        headers=alice)
    assert r.status_code == 201
    assert app_client.put("/v1/profiles/up", json={"head": r.json()["id"]}, headers=alice).status_code == 200


def test_prompt_beyond_the_context_and_sampling_limits(app_client, alice, tiny_lm):
    n = tiny_lm.model.config.max_position_embeddings
    r = app_client.post("/generate", json={"prompt": "a " * n}, headers=alice)
    assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["body", "prompt"]
    for field, value in (("temperature", float("nan")), ("temperature", 1e6), ("max_new_tokens", 65)):
        r = app_client.post("/generate", content=json.dumps({"prompt": "x", field: value}), headers=alice)
        assert r.status_code == 422 and r.json()["detail"][0]["loc"][-1] == field


def test_isolation_matrix_every_route_with_an_id_answers_404_for_another_tenant(app_client, alice, tiny_records):
    """Every route that takes an id, for every resource type: another tenant's id looks like a missing one."""
    bob = tenant(app_client, "bob")
    body = "".join(json.dumps(r) + "\n" for r in tiny_records[:20]).encode()
    ds = app_client.post("/v1/datasets", content=body, headers=alice).json()["id"]
    job = app_client.post("/v1/heads", json={"forget": ds, "retain": ds}, headers=alice).json()["id"]
    owned = {"dataset_id": ds, "job_id": job, "name": "up", "model_id": "up"}  # model_id: a profile as a model
    while app_client.get(f"/v1/jobs/{job}", headers=alice).json()["status"] in ("queued", "running"):
        pass
    owned["head_id"] = app_client.get(f"/v1/jobs/{job}", headers=alice).json()["head"] or "head_none"
    owned["weights_id"] = "asu_none"
    checked = 0
    for path, ops in app_client.app.openapi()["paths"].items():
        params = re.findall(r"{(\w+)}", path)
        if not params or path.startswith("/admin"):
            continue
        for method in ops:
            if method == "put":  # PUT /v1/profiles/{name} writes in the caller's own namespace: checked below
                continue
            url = path.format(**{p: owned[p] for p in params})
            theirs = app_client.request(method.upper(), url, headers=bob, json={})
            missing = app_client.request(method.upper(), re.sub(r"(ds|job|head|asu)_\w+", r"\1_0000", url)
                                         if "name" not in params else url.replace("/up", "/nothing"), headers=bob,
                                         json={})
            assert theirs.status_code == 404, (method, url, theirs.text)
            assert missing.status_code == 404 and theirs.json().keys() == missing.json().keys()
            checked += 1
    assert checked >= 12  # get/delete datasets, heads, asu; get, cancel, events of jobs; get, delete, rollback profiles
    for listing in ("/v1/datasets", "/v1/heads", "/v1/jobs", "/v1/profiles", "/v1/asu"):
        assert app_client.get(listing, headers=bob).json() == []
    assert app_client.post("/admin/tenants", json={"name": "x"}, headers=bob).status_code == 403
    r = app_client.post("/generate", json={"prompt": question_prompt("x"), "profile": "up"}, headers=bob)
    assert r.status_code == 404
    before = app_client.get("/v1/profiles/up", headers=alice).json()
    assert app_client.put("/v1/profiles/up", json={"backend": "base"}, headers=bob).json()["version"] == 1
    assert app_client.get("/v1/profiles/up", headers=alice).json() == before, "bob's `up` is his own"
    key = bob["Authorization"].split()[1]
    store = app_client.app.state.store
    raw = b"".join(f.read_bytes() for f in store.dir.glob("lethe.db*"))  # the database and its WAL
    hashes = [r["hash"] for r in store.q("SELECT hash FROM api_keys")]
    assert key.encode() not in raw and hash_key(key) in hashes, "keys are stored hashed"
