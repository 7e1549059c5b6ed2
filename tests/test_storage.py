"""The metadata store on both backends: SQLite (the embedded default) and PostgreSQL (shared by replicas).
The same calls, the same answers; schemas versioned and upgraded in place."""

import time

import pytest
import sqlalchemy

from lethe.server.storage import SCHEMA_VERSION, Store


def test_the_same_calls_give_the_same_answers_on_both_backends(tmp_path, database_url):
    store = Store(tmp_path, database_url)
    assert store.dialect == ("sqlite" if database_url is None else "postgresql")
    before = time.time()
    tenant, key = store.create_tenant("acme")
    other, other_key = store.create_tenant("globex")
    assert store.tenant_for_key(key) == tenant and store.tenant_for_key(other_key) == other
    assert store.tenant_for_key(key + "x") is None
    listed = store.tenants()
    assert [t["name"] for t in listed] == ["acme", "globex"] and listed[0]["keys"] == 1
    assert before <= listed[0]["created"] <= time.time()  # timestamps keep sub-second precision (not float4)
    assert abs(listed[1]["created"] - listed[0]["created"]) < 5
    with pytest.raises(sqlalchemy.exc.IntegrityError):
        store.create_tenant("acme")  # names are unique
    second = store.add_key(tenant)
    keys = store.keys(tenant)
    assert len(keys) == 2 and all(k["prefix"] == "lk_" + k["prefix"][3:] for k in keys)
    rotated = store.rotate_key(tenant, keys[0]["id"])
    assert store.tenant_for_key(key) is None and store.tenant_for_key(rotated) == tenant
    assert store.revoke_key(tenant, store.keys(tenant)[0]["id"]) and store.tenant_for_key(second) is None
    assert not store.revoke_key(other, store.keys(tenant)[0]["id"])  # another tenant's key id: not found

    # profiles: versions, the current one, rollback, history; another tenant's are separate
    assert store.put_profile(tenant, "p", {"head": "h1"}, note="first") == 1
    assert store.put_profile(tenant, "p", {"head": "h2"}) == 2
    assert store.put_profile(other, "p", {"head": "x"}) == 1
    assert store.current_profile(tenant, "p") == (2, {"head": "h2"})
    store.set_profile_version(tenant, "p", 1)
    assert store.current_profile(tenant, "p") == (1, {"head": "h1"})
    assert [h["version"] for h in store.profile_history(tenant, "p")] == [1, 2]
    assert store.profile_history(tenant, "p")[0]["note"] == "first"
    assert store.profile_names(tenant) == ["p"] and store.current_profile(other, "p") == (1, {"head": "x"})
    assert store.users_of(tenant, "head", "h2") == ["profile 'p' v2"]

    # owned rows are found by (tenant, id) only
    store.tx([("INSERT INTO datasets VALUES (?, ?, ?, ?, ?, ?, ?)", ("ds_1", tenant, "f", 3, "abc", 10, time.time()))])
    assert store.get("datasets", tenant, "ds_1")["records"] == 3 and store.get("datasets", other, "ds_1") is None
    assert [d["id"] for d in store.list("datasets", tenant)] == ["ds_1"] and store.list("datasets", other) == []
    store.tx([("INSERT INTO jobs (id, tenant_id, kind, status, created) VALUES (?, ?, ?, ?, ?)",
               ("job_1", tenant, "t3", "running", time.time()))])
    with pytest.raises(ValueError, match="job_1"):
        store.delete_tenant(tenant)  # refused while a job runs
    store.tx([("UPDATE jobs SET status = ? WHERE id = ?", ("succeeded", "job_1"))])
    assert store.delete_tenant(tenant) == {"datasets": [("ds_1", "abc")], "heads": [], "asu_weights": []}
    assert store.tenant_by_name("acme") is None and store.profile_names(tenant) == []
    assert store.tenant_by_name("globex") == other and store.current_profile(other, "p") == (1, {"head": "x"})
    store.close()
    reopened = Store(tmp_path, database_url)  # opening it again finds this release's schema and keeps the data
    assert reopened.found_version == SCHEMA_VERSION and reopened.tenant_for_key(other_key) == other
    reopened.close()


def test_a_database_of_the_release_before_versioned_schemas_is_upgraded_in_place(tmp_path, database_url):
    """The tables for tenants and keys as the release before key ids made them (no lethe_schema table)."""
    url = database_url or f"sqlite:///{tmp_path / 'lethe.db'}"
    engine = sqlalchemy.create_engine(url.replace("postgresql://", "postgresql+psycopg://"))
    with engine.begin() as conn:
        conn.execute(sqlalchemy.text("CREATE TABLE tenants (id TEXT PRIMARY KEY, name TEXT UNIQUE NOT NULL, "
                                     "created DOUBLE PRECISION NOT NULL)"))
        conn.execute(sqlalchemy.text("CREATE TABLE api_keys (hash TEXT PRIMARY KEY, tenant_id TEXT NOT NULL "
                                     "REFERENCES tenants(id), created DOUBLE PRECISION NOT NULL)"))
        conn.execute(sqlalchemy.text("INSERT INTO tenants VALUES ('ten_old', 'old', 1.5)"))
        from lethe.server.storage import hash_key

        conn.execute(sqlalchemy.text("INSERT INTO api_keys VALUES (:h, 'ten_old', 2.5)"), {"h": hash_key("lk_old")})
    engine.dispose()
    store = Store(tmp_path, database_url)
    assert store.found_version == 0
    assert store.tenant_for_key("lk_old") == "ten_old"  # old keys keep working
    old = store.caller("lk_old")  # ... with every scope and no binding, as before scopes
    assert old["scopes"] == ("manage", "generate", "evaluate") and old["profile"] is None and old["enforced"] is None
    (key,) = store.keys("ten_old")
    assert key["id"].startswith("key_") and key["created"] == 2.5
    tenant, _ = store.create_tenant("new")  # and the tables this release adds are there
    assert store.put_profile(tenant, "p", {}) == 1
    assert [e["action"] for e in store.audit_trail(tenant)] == ["tenant.create", "key.create", "profile.set"]
    store.close()
    with sqlalchemy.create_engine(store.url).begin() as conn:  # a schema newer than this release is refused
        conn.execute(sqlalchemy.text("UPDATE lethe_schema SET version = :v"), {"v": SCHEMA_VERSION + 1})
    with pytest.raises(RuntimeError, match="newer than this release"):
        Store(tmp_path, database_url)


def _head_job(client) -> tuple[dict, str]:
    """A new tenant's headers, and the id of a head job it started through `client` (one record a set)."""
    from live_server import ADMIN_KEY

    key = client.post("/admin/tenants", json={"name": "t"}, headers={"Authorization": f"Bearer {ADMIN_KEY}"})
    headers = {"Authorization": f"Bearer {key.json()['api_key']}"}
    record = '{"question": "q?", "answer": "a."}\n'
    ids = [client.post("/v1/datasets", content=record.encode(), headers=headers).json()["id"] for _ in range(2)]
    return headers, client.post("/v1/heads", json={"forget": ids[0], "retain": ids[1]}, headers=headers).json()["id"]


def test_a_job_running_on_one_replica_is_cancelled_through_another(tiny_model_dir, tmp_path, postgres_server_url):
    """Two servers on one PostgreSQL database and data directory (as two replicas are): a job that runs on one
    stops when the other is asked to cancel it, at the runner's next heartbeat."""
    import threading

    from fastapi.testclient import TestClient

    from lethe.heads.modelio import load_model
    from lethe.server.app import create_app
    from lethe.server.jobs import Cancelled
    from lethe.server.pg_local import fresh_database
    from lethe.server.settings import Settings
    from live_server import ADMIN_KEY

    database = fresh_database(postgres_server_url)
    lm = load_model(tiny_model_dir)
    settings = Settings(model=tiny_model_dir, data_dir=tmp_path, database_url=database, admin_key=ADMIN_KEY,
                        demo_tenant=False, job_stale_seconds=2.0, allow_anonymous=True)
    with TestClient(create_app(settings, lm)) as one, TestClient(create_app(settings, lm)) as two:
        ran_on, started = {}, threading.Event()
        for name, client in (("one", one), ("two", two)):
            def slow_train(job, cancel, name=name):  # a long job: runs until it is told to stop
                ran_on["name"] = name
                started.set()
                if not cancel.wait(30):
                    raise AssertionError("never cancelled")
                raise Cancelled()
            client.app.state.jobs._train = slow_train
        headers, job = _head_job(one)
        assert started.wait(30)
        other = two if ran_on["name"] == "one" else one
        t0 = time.time()
        assert other.post(f"/v1/jobs/{job}/cancel", headers=headers).status_code == 200
        while (state := other.get(f"/v1/jobs/{job}", headers=headers).json())["status"] == "running":
            assert time.time() - t0 < 10, state
            time.sleep(0.1)
        assert state["status"] == "cancelled" and state["error"] == "cancelled while running", state


def test_a_dispatched_job_whose_task_is_slow_to_start_is_not_failed_as_stale(tiny_model_dir, tmp_path,
                                                                              postgres_server_url):
    """On Ray Serve a job runs as a task that beats only once its process has started and loaded the model; until
    then the replica that dispatched it beats for it, so another replica's stale check (every stale/2 s) does not
    fail a job that is merely waiting for its process, and the reason a task died is what its tenant reads."""
    import threading

    from fastapi.testclient import TestClient

    from lethe.heads.modelio import load_model
    from lethe.server.app import create_app
    from lethe.server.pg_local import fresh_database
    from lethe.server.settings import Settings
    from live_server import ADMIN_KEY

    database = fresh_database(postgres_server_url)
    lm = load_model(tiny_model_dir)
    settings = Settings(model=tiny_model_dir, data_dir=tmp_path, database_url=database, admin_key=ADMIN_KEY,
                        demo_tenant=False, job_stale_seconds=1.0, allow_anonymous=True)
    with TestClient(create_app(settings, lm)) as one, TestClient(create_app(settings, lm)) as two:
        dispatched = threading.Event()

        def slow_task(job):  # a task that never beats: 4x the stale limit to start, then its process dies
            dispatched.set()
            time.sleep(4.0)
            raise RuntimeError("its process died: killed, or out of memory")
        for client in (one, two):
            client.app.state.jobs.dispatch = slow_task
        headers, job = _head_job(one)
        assert dispatched.wait(30)
        t0 = time.time()
        while (state := two.get(f"/v1/jobs/{job}", headers=headers).json())["status"] == "running":
            assert time.time() - t0 < 30, state
            time.sleep(0.1)
        assert state["status"] == "failed", state
        assert state["error"] == ("the job's worker stopped while the job was running (its process died: killed, "
                                  "or out of memory)"), state
