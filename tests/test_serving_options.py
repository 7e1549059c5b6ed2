"""Serving options vLLM users expect (issue 14): a config file, --max-model-len, --served-model-name,
--chat-template, /tokenize, /detokenize and /version."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from lethe.heads.modelio import load_model
from lethe.server.app import create_app
from lethe.server.settings import Settings, read_config


@pytest.fixture(scope="module")
def served(tiny_model_dir, tmp_path_factory):
    folder = tmp_path_factory.mktemp("serving")
    template = folder / "template.jinja"
    template.write_text("{% for m in messages %}<<{{ m['content'] }}>>{% endfor %}")
    settings = Settings(model=tiny_model_dir, data_dir=folder / "data", max_model_len=40, served_model_name="tiny",
                        chat_template=template, max_queue=3, admin_key="adm", allow_anonymous=True)
    with TestClient(create_app(settings, load_model(tiny_model_dir))) as client:
        yield client


def test_version_tokenize_and_detokenize(served):
    v = served.get("/version").json()
    assert v["version"] and v["model"] and len(v["fingerprint"]) == 16 and v["max_model_len"] == 40
    assert v["engine"] == "torch"
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


def test_what_the_first_independent_test_found(served, tmp_path):
    """Each case failed before its fix: a 500, a 429 for ever, a silent acceptance, a crash, or the wrong winner."""
    from lethe.heads.t3.guide import TiltSettings
    from lethe.server.app import use_chat_template

    def completions(**body):
        return served.post("/v1/completions", json={"model": "tiny", "max_tokens": 2, **body})

    for ids in ([-1], [10**6]):  # was a 500 (-1) and a misleading message
        r = completions(prompt=ids)
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt" and "vocabulary" in r.text, r.text
    r = completions(prompt="Question: Who?\nAnswer:", n=4)  # more choices than the queue holds: was 429 for ever
    assert r.status_code == 400 and r.json()["error"]["param"] == "n"
    assert len(completions(prompt="Question: Who?\nAnswer:", n=3, temperature=1, seed=1).json()["choices"]) == 3
    assert completions(prompt="Question: Who?\nAnswer:", logprobs=21).status_code == 400  # at most 20

    def chat(messages, **body):
        return served.post("/v1/chat/completions", json={"model": "tiny", "max_tokens": 4, "messages": messages,
                                                         **body})

    assert chat([{"role": "wizard", "content": "x"}]).status_code == 400
    assert chat([{"role": "user", "content": None}]).status_code == 400
    r = chat([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}])
    assert r.status_code == 400 and "image_url" in r.json()["error"]["message"], r.text
    r = chat([{"role": "user", "content": "hi"}], max_tokens=8, max_completion_tokens=2)
    assert r.json()["usage"]["completion_tokens"] <= 2  # the newer name wins, as in vLLM
    no_max = served.post("/v1/chat/completions", json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}]})
    assert no_max.status_code == 200  # without max_tokens: what the 40-token context leaves, not a 400
    key = served.post("/admin/tenants", json={"name": "t"}, headers={"Authorization": "Bearer adm"}).json()["api_key"]
    r = served.put("/v1/profiles/tiny", json={"backend": "base"}, headers={"Authorization": f"Bearer {key}"})
    assert r.status_code == 422  # the served model name is the base model's, not a profile's
    broken = tmp_path / "broken.jinja"
    broken.write_text("{% for m in messages %}{{ m.content }")
    with pytest.raises(ValueError, match="broken.jinja"):
        use_chat_template(served.app.state.engine.lm.tokenizer, broken)
    assert served.post("/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}).status_code == 200
    (tmp_path / "list.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="table of settings"):
        read_config(tmp_path / "list.json")
    with pytest.raises(ValueError, match="abstain"):
        TiltSettings(abstain="   ").replace()


def test_serve_on_ray_says_what_it_needs(capsys):
    """`lethe serve --ray` refuses, naming the fix, before it starts anything: replicas need a shared PostgreSQL
    database; the Ray flags need --ray."""
    from lethe.clients.cli import main

    assert main(["serve", "--ray", "--database-url", "sqlite:///x.db"]) == 2
    assert "--database-url postgresql://" in capsys.readouterr().err
    assert main(["serve", "--replicas", "3"]) == 2
    assert "need --ray" in capsys.readouterr().err
