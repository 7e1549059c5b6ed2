"""Serving options vLLM users expect (issue 14): a config file, --max-model-len, --served-model-name,
--chat-template, /tokenize, /detokenize and /version."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from heads.modelio import load_model
from server.app import create_app
from server.settings import Settings, read_config


@pytest.fixture(scope="module")
def served(tiny_model_dir, tmp_path_factory):
    folder = tmp_path_factory.mktemp("serving")
    template = folder / "template.jinja"
    template.write_text("{% for m in messages %}<<{{ m['content'] }}>>{% endfor %}")
    settings = Settings(model=tiny_model_dir, data_dir=folder / "data", max_model_len=40, served_model_name="tiny",
                        chat_template=template)
    with TestClient(create_app(settings, load_model(tiny_model_dir))) as client:
        yield client


def test_version_tokenize_and_detokenize(served):
    v = served.get("/version").json()
    assert v["version"] and v["model"] and len(v["fingerprint"]) == 16 and v["max_model_len"] == 40
    t = served.post("/tokenize", json={"model": "tiny", "prompt": "Question: Who?\nAnswer:"}).json()
    assert t["count"] == len(t["tokens"]) > 0 and t["max_model_len"] == 40
    assert served.post("/detokenize", json={"tokens": t["tokens"]}).json()["prompt"] == "Question: Who?\nAnswer:"
    chat = served.post("/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}).json()
    assert served.post("/detokenize", json={"tokens": chat["tokens"]}).json()["prompt"] == "<<hi>>"  # the template
    assert served.post("/tokenize", json={}).status_code == 422
    r = served.post("/detokenize", json={"tokens": [10**9]})
    assert r.status_code == 422 and r.json()["detail"][0]["loc"][-1] == "tokens"


def test_max_model_len_and_the_served_model_name(served):
    r = served.post("/v1/completions", json={"model": "tiny", "prompt": "Question: Who?\nAnswer:", "max_tokens": 39})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt" and "40" in r.json()["error"]["message"]
    ok = served.post("/v1/completions", json={"model": "tiny", "prompt": "Question: Who?\nAnswer:", "max_tokens": 8})
    assert ok.status_code == 200 and ok.headers["x-lethe-profile"] == "base"
    assert {m["id"] for m in served.get("/v1/models").json()["data"]} == {"base", "tiny"}
    assert served.get("/v1/models/tiny").status_code == 200


def test_a_config_file_is_read_and_checked(tmp_path):
    good = tmp_path / "lethe.toml"
    good.write_text('max_batch_size = 4\nserved_model_name = "smol"\n')
    assert read_config(good) == {"max_batch_size": 4, "served_model_name": "smol"}
    bad = tmp_path / "bad.toml"
    bad.write_text("max_batch = 4\n")
    with pytest.raises(ValueError, match="unknown settings: max_batch"):
        read_config(bad)
    (tmp_path / "broken.json").write_text("{")
    with pytest.raises(ValueError, match="not valid JSON"):
        read_config(tmp_path / "broken.json")
