"""/metrics: no tenant data in labels, bounded label sets, every status counted, latency histograms."""

import re

import pytest
from fastapi import APIRouter
from fastapi.testclient import TestClient
from prometheus_client import generate_latest

from lethe.heads.records import question_prompt
from lethe.server.app import create_app
from lethe.server.settings import Settings

ADMIN = "admin-key-for-metrics"
SECRET = "secret-profile-A"


def _boom_router() -> APIRouter:
    """An included router (like the app's own) with a route whose handler fails: an unhandled 500."""
    router = APIRouter()

    @router.get("/test/boom/{item}")
    def boom(item: str):
        raise RuntimeError("handler failed")

    return router


@pytest.fixture(scope="module")
def client(tiny_lm, tmp_path_factory):
    settings = Settings(model=tiny_lm.path, max_new_tokens_limit=128, admin_key=ADMIN, demo_tenant=False,
                        data_dir=tmp_path_factory.mktemp("data"), allow_anonymous=True)
    app = create_app(settings, tiny_lm)
    app.include_router(_boom_router())
    with TestClient(app, raise_server_exceptions=False) as c:
        yield c


@pytest.fixture(scope="module")
def tenant_key(client):
    r = client.post("/admin/tenants", json={"name": "metrics-tenant"}, headers={"Authorization": f"Bearer {ADMIN}"})
    assert r.status_code == 201, r.text
    return r.json()["api_key"]


def _metrics(client) -> str:
    r = client.get("/metrics", headers={"Authorization": f"Bearer {ADMIN}"})
    assert r.status_code == 200
    return r.text


def _value(text: str, name: str, **labels) -> float:
    """The sample `name{labels}` (labels in any order), 0 when absent."""
    for line in text.splitlines():
        m = re.fullmatch(r"([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})? (\S+)", line)
        if not m or m.group(1) != name:
            continue
        found = dict(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', m.group(2) or ""))
        if found == {k: str(v) for k, v in labels.items()}:
            return float(m.group(3))
    return 0.0


def _label_values(text: str, name: str, label: str) -> set[str]:
    return {m for line in text.splitlines() if line.startswith(name + "{")
            for m in re.findall(label + r'="((?:[^"\\]|\\.)*)"', line)}


def test_a_tenants_profile_name_never_appears_in_metrics(client, tenant_key, tiny_records):
    auth = {"Authorization": f"Bearer {tenant_key}"}
    assert client.put(f"/v1/profiles/{SECRET}", json={"backend": "base"}, headers=auth).status_code == 200
    prompt = question_prompt(tiny_records[0]["question"])
    before = _metrics(client)
    for profile in (SECRET, {"backend": "base"}, "base", None):
        r = client.post("/generate", json={"prompt": prompt, "max_new_tokens": 4, "profile": profile}, headers=auth)
        assert r.status_code == 200, r.text
    text = _metrics(client)
    assert SECRET not in text and "metrics-tenant" not in text and tenant_key not in text
    assert _label_values(text, "lethe_profile_requests_total", "kind") <= {"base", "named", "inline"}
    for kind, added in (("named", 1), ("inline", 1), ("base", 2)):
        assert _value(text, "lethe_profile_requests_total", kind=kind) \
            - _value(before, "lethe_profile_requests_total", kind=kind) == added, kind


def test_path_label_is_the_route_template_and_bounded(client, tenant_key):
    auth = {"Authorization": f"Bearer {tenant_key}"}
    before = _metrics(client)
    for i in range(3):
        assert client.get(f"/v1/heads/h-{i}", headers=auth).status_code == 404
    assert client.get("/v1/heads", headers=auth).status_code == 200
    assert client.get("/no/such/path/xyz").status_code == 404
    text = _metrics(client)

    def grew(name, **labels):
        return _value(text, name, **labels) - _value(before, name, **labels)

    assert grew("lethe_requests_total", path="/v1/heads/{head_id}", status="404") == 3
    assert grew("lethe_requests_total", path="/v1/heads", status="200") == 1
    assert grew("lethe_requests_total", path="unmatched", status="404") == 1
    assert grew("lethe_request_duration_seconds_count", path="/v1/heads/{head_id}") == 3
    paths = _label_values(text, "lethe_requests_total", "path")
    assert not any("h-" in p or "xyz" in p for p in paths), paths
    # many more ids and unknown paths add no series
    series = len([line for line in text.splitlines() if line.startswith("lethe_requests_total{")])
    for i in range(40):
        client.get(f"/v1/heads/other-{i}", headers=auth)
        client.get(f"/unknown-{i}")
    after = _metrics(client)
    assert len([line for line in after.splitlines() if line.startswith("lethe_requests_total{")]) <= series + 1


def test_an_unhandled_exception_is_counted_as_a_500(client):
    before = _value(_metrics(client), "lethe_requests_total", path="/test/boom/{item}", status="500")
    r = client.get("/test/boom/x1")
    assert r.status_code == 500
    text = _metrics(client)
    assert _value(text, "lethe_requests_total", path="/test/boom/{item}", status="500") == before + 1
    assert _value(text, "lethe_request_duration_seconds_count", path="/test/boom/{item}") >= 1


def test_generation_observes_time_to_first_token_and_running_rows(client, tiny_records):
    before = _metrics(client)
    prompt = question_prompt(tiny_records[1]["question"])
    r = client.post("/generate", json={"prompt": prompt, "max_new_tokens": 5, "temperature": 0})
    assert r.status_code == 200, r.text
    steps = r.json()["usage"]["completion_tokens"]
    text = _metrics(client)
    assert _value(text, "lethe_time_to_first_token_seconds_count") \
        == _value(before, "lethe_time_to_first_token_seconds_count") + 1
    assert _value(text, "lethe_time_to_first_token_seconds_sum") > _value(before, "lethe_time_to_first_token_seconds_sum")
    # one decoding step per token (one more when the row stops on EOS), each with one running row
    grew = _value(text, "lethe_running_rows_count") - _value(before, "lethe_running_rows_count")
    assert steps <= grew <= steps + 1
    assert _value(text, "lethe_running_rows_bucket", le="1.0") - _value(before, "lethe_running_rows_bucket", le="1.0") \
        == grew
    assert _value(text, "lethe_request_duration_seconds_count", path="/generate") >= 1


def test_engine_observes_one_first_token_per_request_in_a_shared_batch(tiny_lm, tiny_records):
    from lethe.heads.decoding.sampling import SamplingParams
    from lethe.server.engine import Engine, Pending
    from lethe.server.metrics import Metrics

    metrics = Metrics()
    engine = Engine(tiny_lm, max_batch_size=4, metrics=metrics)
    try:
        pendings = [engine.submit(Pending(question_prompt(r["question"]), SamplingParams(max_new_tokens=6,
                                                                                         temperature=0)))
                    for r in tiny_records[:3]]
        for p in pendings:
            p.future.result(timeout=120)
    finally:
        engine.close()
    text = generate_latest(metrics.registry).decode()
    assert _value(text, "lethe_time_to_first_token_seconds_count") == 3
    steps = _value(text, "lethe_running_rows_count")
    assert 0 < steps <= 3 * 7 and _value(text, "lethe_running_rows_sum") >= 3
