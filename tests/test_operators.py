"""An operator's toolkit (issue 14): tenants and keys listed, keys rotated and revoked, a tenant deleted with all
its data, the admin key's absence explained, and a database from the previous release upgraded in place."""

from __future__ import annotations

import sqlite3

import pytest
from fastapi.testclient import TestClient

from lethe.clients.client import Lethe, LetheError
from lethe.heads.records import question_prompt
from live_server import ADMIN_KEY, running_server
from lethe.server.app import create_app
from lethe.server.settings import Settings
from lethe.server.storage import Store, hash_key


@pytest.fixture(scope="module")
def server(tiny_lm, tmp_path_factory):
    data = tmp_path_factory.mktemp("data")
    with running_server(tiny_lm, data) as url:
        yield url, data


def test_keys_are_listed_rotated_and_revoked(server):
    url, _ = server
    admin = Lethe(url, key=ADMIN_KEY)
    first = admin.create_tenant("ops").api_key
    Lethe(url, key=first).generate(question_prompt("Who?"), max_new_tokens=2)
    second = admin.create_key("ops").api_key
    keys = admin.list_keys("ops")
    assert [k.prefix for k in keys] == [first[:7], second[:7]] and keys[0].last_used is not None
    assert keys[1].last_used is None and all(first not in k.model_dump_json() for k in keys)  # never the key
    rotated = admin.rotate_key("ops", keys[0].id).api_key
    for gone in (first,):
        with pytest.raises(LetheError) as e:
            Lethe(url, key=gone).list_datasets()
        assert e.value.status == 401
    assert Lethe(url, key=rotated).list_datasets() == []
    admin.revoke_key("ops", keys[1].id)
    with pytest.raises(LetheError) as e:
        Lethe(url, key=second).list_datasets()
    assert e.value.status == 401
    assert {t.name: t.keys for t in admin.list_tenants()}["ops"] == 1
    with pytest.raises(LetheError) as e:
        admin.revoke_key("ops", "key_nope")
    assert e.value.status == 404
    with pytest.raises(LetheError) as e:
        Lethe(url, key=rotated).list_tenants()
    assert e.value.status == 403 and "LETHE_ADMIN_KEY" in e.value.message


def test_a_tenant_is_deleted_with_all_its_data(server, sets):
    url, data = server
    folder, _, _ = sets
    admin = Lethe(url, key=ADMIN_KEY)
    key = admin.create_tenant("leaving").api_key
    other = admin.create_tenant("staying").api_key
    with Lethe(url, key=key) as c:
        f, r = c.upload_dataset(folder / "forget.jsonl"), c.upload_dataset(folder / "retain.jsonl")
        job = c.train_head(f.id, r.id)
        with pytest.raises(LetheError) as e:
            admin.delete_tenant("leaving")  # its job is queued or running
        assert e.value.status == 409 and job.id in e.value.message
        head = c.wait(job).head
        c.set_profile("p", head=head)
    kept = Lethe(url, key=other).upload_dataset(folder / "forget.jsonl")  # the same content as the leaver's `f`
    assert kept.sha256 == f.sha256
    with sqlite3.connect(data / "lethe.db") as db:
        [(head_digest,)] = db.execute("SELECT sha256 FROM heads WHERE id = ?", (head,)).fetchall()
    blobs = data / "blobs"
    files = [blobs / r.sha256[:2] / r.sha256, blobs / head_digest[:2] / head_digest]
    assert all(p.exists() for p in files)
    admin.delete_tenant("leaving")
    assert not any(p.exists() for p in files), "the leaver's files are gone"
    assert (blobs / f.sha256[:2] / f.sha256).exists(), "a file another tenant's row names stays"
    with pytest.raises(LetheError) as e:
        Lethe(url, key=key).list_datasets()
    assert e.value.status == 401
    assert "leaving" not in {t.name for t in admin.list_tenants()}
    assert [d.id for d in Lethe(url, key=other).list_datasets()] == [kept.id]  # another tenant's data stays
    with pytest.raises(LetheError) as e:
        admin.delete_tenant("leaving")
    assert e.value.status == 404


def test_without_an_admin_key_the_server_says_how_to_set_one(tiny_lm, tmp_path):
    settings = Settings(model=tiny_lm.path, data_dir=tmp_path / "data", admin_key=None)
    with TestClient(create_app(settings, tiny_lm)) as client:
        r = client.post("/admin/tenants", json={"name": "x"}, headers={"Authorization": "Bearer anything"})
    assert r.status_code == 403 and "LETHE_ADMIN_KEY" in r.json()["detail"]


def test_a_database_from_the_previous_release_is_upgraded_in_place(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    old = sqlite3.connect(data / "lethe.db")  # the previous release's tables for tenants and keys
    old.executescript("CREATE TABLE tenants (id TEXT PRIMARY KEY, name TEXT UNIQUE NOT NULL, created REAL NOT NULL);"
                      "CREATE TABLE api_keys (hash TEXT PRIMARY KEY, tenant_id TEXT NOT NULL REFERENCES tenants(id),"
                      " created REAL NOT NULL);")
    old.execute("INSERT INTO tenants VALUES ('ten_old', 'old', 1.0)")
    old.execute("INSERT INTO api_keys VALUES (?, 'ten_old', 2.0)", (hash_key("lk_oldkey"),))
    old.commit()
    old.close()
    store = Store(data)
    assert store.tenant_for_key("lk_oldkey") == "ten_old"  # the old key still works
    [key] = store.keys("ten_old")
    assert key["id"].startswith("key_") and key["prefix"] is None and key["last_used"] is not None
    assert store.rotate_key("ten_old", key["id"]).startswith("lk_") and store.tenant_for_key("lk_oldkey") is None
    store.close()
    Store(data).close()  # opening it again changes nothing
