import pytest
from fastapi.testclient import TestClient

from lethe.heads.records import question_prompt
from lethe.server.app import create_app
from lethe.server.settings import Settings


@pytest.fixture(scope="module")
def client(tiny_lm, tmp_path_factory):
    settings = Settings(model=tiny_lm.path, max_new_tokens_limit=128, data_dir=tmp_path_factory.mktemp("data"),
                        allow_anonymous=True)
    with TestClient(create_app(settings, tiny_lm)) as c:
        yield c


def test_health_and_ready(client, tiny_lm):
    assert client.get("/healthz").json() == {"status": "ok"}
    ready = client.get("/readyz").json()
    assert ready["status"] == "ready" and ready["fingerprint"] == tiny_lm.fingerprint


def test_generate_returns_the_memorised_answer_greedy(client, tiny_records):
    r = tiny_records[2]
    body = client.post("/generate", json={"prompt": question_prompt(r["question"]), "max_new_tokens": 64,
                                          "temperature": 0})
    assert body.status_code == 200, body.text
    data = body.json()
    assert data["text"].strip() == r["answer"] and data["finish_reason"] == "stop"
    usage = data["usage"]
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"] and usage["completion_tokens"] > 3


def test_seeded_sampling_repeats_and_stop_string_is_honoured(client, tiny_records):
    body = {"prompt": question_prompt(tiny_records[3]["question"]), "temperature": 2.0, "top_p": 0.9, "top_k": 50,
            "seed": 5, "max_new_tokens": 16}
    assert client.post("/generate", json=body).json() == client.post("/generate", json=body).json()
    r = tiny_records[1]
    out = client.post("/generate", json={"prompt": question_prompt(r["question"]), "temperature": 0,
                                         "stop": " born"}).json()
    assert out["finish_reason"] == "stop" and "born" not in out["text"]


@pytest.mark.parametrize("field,value", [
    ("prompt", ""),
    ("max_new_tokens", 0),
    ("max_new_tokens", -3),
    ("max_new_tokens", 129),
    ("temperature", -0.1),
    ("top_p", 0),
    ("top_p", 1.5),
    ("top_k", -1),
    ("unknown_option", 1),
])
def test_bad_fields_answer_422_naming_the_field(client, field, value):
    body = {"prompt": "Question: Who?\nAnswer:", field: value}
    r = client.post("/generate", json=body)
    assert r.status_code == 422, r.text
    assert any(field in err["loc"] for err in r.json()["detail"]), r.json()


def test_prompt_longer_than_the_context_is_422(client, tiny_lm):
    ctx = tiny_lm.model.config.max_position_embeddings
    r = client.post("/generate", json={"prompt": "word " * (ctx + 10), "max_new_tokens": 8})
    assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["body", "prompt"]


def test_missing_prompt_and_non_json_body_are_422(client):
    r = client.post("/generate", json={"max_new_tokens": 5})
    assert r.status_code == 422 and ["body", "prompt"] == r.json()["detail"][0]["loc"]
    assert client.post("/generate", content=b"{not json", headers={"content-type": "application/json"}).status_code == 422


def test_body_sent_as_curl_form_data_is_read_as_json(client, tiny_records):
    r = tiny_records[0]
    body = '{"prompt": "Question: %s\\nAnswer:", "temperature": 0}' % r["question"]
    out = client.post("/generate", content=body, headers={"content-type": "application/x-www-form-urlencoded"})
    assert out.status_code == 200, out.text
    assert out.json()["text"].strip() == r["answer"]
