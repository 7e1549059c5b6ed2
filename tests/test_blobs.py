"""Dataset, head and adapter files in a content-addressed blob store: a directory by default, any fsspec URL as an
option (here `memory://`, which stands for an object store: nothing is on the local disk but each replica's cache).
"""

import hashlib
import json
import sqlite3
import threading
import uuid

import httpx
import pytest
import sqlalchemy

from lethe.heads.records import question_prompt
from lethe.server.blobs import BlobMissing, BlobStore
from lethe.server.storage import Store
from live_server import running_server, new_tenant


def _memory_url() -> str:
    return f"memory://lethe-{uuid.uuid4().hex[:8]}"


def test_a_remote_store_is_read_through_each_replicas_checked_cache(tmp_path):
    url = _memory_url()
    one, two = BlobStore(url, tmp_path / "cache-1"), BlobStore(url, tmp_path / "cache-2")
    staged = one.staging()
    staged.write_bytes(b"forget me")
    digest = one.put(staged)
    assert digest == hashlib.sha256(b"forget me").hexdigest() and not staged.exists(), "moved, not copied"
    assert one.exists(digest) and two.exists(digest) and one.digests() == {digest}
    path = two.path(digest)  # the other replica downloads it once, into its own cache
    assert path.read_bytes() == b"forget me" and path.is_relative_to(tmp_path / "cache-2")
    one.fs.pipe_file(one.key(digest), b"changed behind our back")
    assert two.path(digest).read_bytes() == b"forget me", "a cached copy is read from the cache"
    three = BlobStore(url, tmp_path / "cache-3")
    with pytest.raises(OSError, match="does not match its digest"):
        three.path(digest)  # a copy that is not what its name says is refused, and not cached
    assert not list((tmp_path / "cache-3").glob("??/*"))
    one.delete(digest)
    with pytest.raises(BlobMissing):
        BlobStore(url, tmp_path / "cache-4").path(digest)
    with pytest.raises(ValueError):
        one.key("../../etc/passwd")


def test_equal_files_are_stored_once_and_go_when_no_row_names_them(tmp_path, database_url):
    store = Store(tmp_path / "data", database_url)
    tenant, _ = store.create_tenant("t")

    def insert(dataset_id):
        return lambda digest: store.tx([("INSERT INTO datasets VALUES (?, ?, ?, ?, ?, ?, ?)",
                                         (dataset_id, tenant, "d", 1, digest, 3, 0.0))])

    a = store.keep_file(b"abc", insert("ds_a"))
    b = store.keep_file(b"abc", insert("ds_b"))
    assert a == b and store.blobs.digests() == {a}
    with pytest.raises(sqlalchemy.exc.IntegrityError):  # the row is refused: the blob another row names stays
        store.keep_file(b"abc", insert("ds_a"))
    with pytest.raises(sqlalchemy.exc.IntegrityError):  # a refused row's new blob does not stay
        store.keep_file(b"xyz", insert("ds_a"))
    assert store.blobs.digests() == {a}
    store.tx([("DELETE FROM datasets WHERE id = ?", ("ds_a",))])
    assert not store.release(a) and store.file("datasets", "ds_b").read_bytes() == b"abc"
    store.tx([("DELETE FROM datasets WHERE id = ?", ("ds_b",))])
    assert store.release(a) and store.blobs.digests() == set()
    store.close()


def test_a_delete_racing_an_upload_of_the_same_content_never_loses_a_named_file(tmp_path, database_url):
    """One thread keeps adding and removing rows for one content, another does the same on a second Store (a second
    replica on PostgreSQL): at every moment, and at the end, each row's file is there."""
    stores = [Store(tmp_path / "data", database_url)]
    stores.append(Store(tmp_path / "data", database_url) if stores[0].shared else stores[0])
    tenant, _ = stores[0].create_tenant("t")
    missing, errors = [], []

    def churn(store: Store, name: str) -> None:
        try:
            for i in range(40):
                row = f"ds_{name}{i}"
                digest = store.keep_file(b"the same records", lambda d: store.tx([(
                    "INSERT INTO datasets VALUES (?, ?, ?, ?, ?, ?, ?)", (row, tenant, "d", 1, d, 16, 0.0))]))
                if not store.blobs.exists(digest):
                    missing.append(row)
                store.tx([("DELETE FROM datasets WHERE id = ?", (row,))])
                store.release(digest)
        except Exception as e:  # reported below, with the thread's name
            errors.append(f"{name}: {e!r}")

    threads = [threading.Thread(target=churn, args=(s, n)) for s, n in zip(stores, "xy")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and not missing
    assert stores[0].blobs.digests() == set(), "the last release removed it"
    for s in set(stores):
        s.close()


def _ask(client, prompt: str, profile: str | None = None) -> str:
    body = {"prompt": prompt, "temperature": 0, "max_new_tokens": 12} | ({"profile": profile} if profile else {})
    r = client.post("/generate", json=body)
    assert r.status_code == 200, r.text
    return r.json()["text"]


def _train(client, forget, retain) -> str:
    f = client.post("/v1/datasets", content="".join(json.dumps(r) + "\n" for r in forget).encode()).json()["id"]
    r = client.post("/v1/datasets", content="".join(json.dumps(r) + "\n" for r in retain).encode()).json()["id"]
    job = client.post("/v1/heads", json={"forget": f, "retain": r, "max_epochs": 30}).json()["id"]
    import time

    while (state := client.get(f"/v1/jobs/{job}").json())["status"] in ("queued", "running"):
        time.sleep(0.1)
    assert state["status"] == "succeeded", state
    return state["head"]


def test_replicas_on_a_remote_store_serve_the_same_head(tiny_lm, tiny_records, tmp_path):
    """Two servers on one database and one `memory://` store, each with its own cache: a head trained through one
    answers the same through the other, which downloads it; nothing but caches is on the local disks."""
    from lethe.heads.demo.corpus import split_by_author

    url, shared_db = _memory_url(), f"sqlite:///{tmp_path / 'shared.db'}"
    forget, retain = split_by_author(tiny_records, 1)
    prompt = question_prompt(forget[0]["question"])
    with running_server(tiny_lm, tmp_path / "one", blob_url=url, database_url=shared_db) as one:
        a = new_tenant(one, "a")
        head = _train(a, forget, retain)
        a.put("/v1/profiles/p", json={"head": head})
        trained = _ask(a, prompt, "p")
        assert trained != _ask(a, prompt)
        key = a.headers["Authorization"]
    with running_server(tiny_lm, tmp_path / "two", blob_url=url, database_url=shared_db) as two:
        b = httpx.Client(base_url=two, headers={"Authorization": key}, timeout=60)  # tenant a, via the other
        assert _ask(b, prompt, "p") == trained
    assert not list((tmp_path / "one").glob("blobs/??/*")) and not list((tmp_path / "two").glob("blobs/??/*"))
    assert list((tmp_path / "two" / "blob-cache").glob("??/*")), "the head was read through the cache"


def test_files_of_the_release_before_blobs_are_moved_into_the_store(tiny_lm, tiny_records, tmp_path):
    """A data directory as the release before blob stores left it (schema version 2; files at datasets/<id>.jsonl,
    heads/<id>.safetensors): at start-up its files move into the blob store and everything answers as before."""
    from lethe.heads.demo.corpus import split_by_author

    data = tmp_path / "data"
    forget, retain = split_by_author(tiny_records, 1)
    prompt = question_prompt(forget[0]["question"])
    with running_server(tiny_lm, data) as url:
        a = new_tenant(url, "a")
        head = _train(a, forget, retain)
        a.put("/v1/profiles/p", json={"head": head})
        before = _ask(a, prompt, "p")
        datasets = {d["id"]: d["sha256"] for d in a.get("/v1/datasets").json()}
        [head_row] = a.get("/v1/heads").json()
        key = a.headers["Authorization"]
    # make it the previous release's layout
    with sqlite3.connect(data / "lethe.db") as db:
        for folder, table, suffix in (("datasets", "datasets", ".jsonl"), ("heads", "heads", ".safetensors")):
            (data / folder).mkdir()
            for item_id, digest in db.execute(f"SELECT id, sha256 FROM {table}").fetchall():
                (data / "blobs" / digest[:2] / digest).rename(data / folder / f"{item_id}{suffix}")
        (data / "asu").mkdir()
        (data / "datasets" / "ds_orphan.jsonl").write_text("{}\n")  # a file no row names: it goes
        for table in ("heads", "asu_weights"):
            db.execute(f"ALTER TABLE {table} DROP COLUMN sha256")
        db.execute("UPDATE lethe_schema SET version = 2")
    assert not list((data / "blobs").glob("??/*"))
    with running_server(tiny_lm, data) as url:
        a = httpx.Client(base_url=url, headers={"Authorization": key}, timeout=60)
        assert _ask(a, prompt, "p") == before
        assert {d["id"]: d["sha256"] for d in a.get("/v1/datasets").json()} == datasets
        assert a.get("/v1/heads").json() == [head_row]
    assert {p.name for p in (data / "blobs").glob("??/*")} == {*datasets.values(), head_row["sha256"]}
    assert not any((data / folder).exists() for folder in ("datasets", "heads", "asu")), "the old folders are gone"


def test_two_databases_never_share_one_blob_store(tmp_path):
    """Each would take the other's files for files no row names, and delete them."""
    shared = tmp_path / "blobs"
    one = Store(tmp_path / "one", blob_url=str(shared))
    with pytest.raises(ValueError, match="belongs to another Lethe database"):
        Store(tmp_path / "two", blob_url=str(shared))
    one.close()
    Store(tmp_path / "one", blob_url=str(shared)).close()  # its own database opens it again


def test_an_older_copy_of_a_database_is_refused_the_store_the_newer_one_uses(tmp_path):
    """A data directory copied (a backup) and started on the same blob store after the original moved on would
    take the original's newer files for files no row names."""
    import shutil

    shared = str(tmp_path / "blobs")
    Store(tmp_path / "original", blob_url=shared).close()
    shutil.copytree(tmp_path / "original", tmp_path / "backup")
    Store(tmp_path / "original", blob_url=shared).close()  # the original starts again: a newer generation
    with pytest.raises(ValueError, match="older copy"):
        Store(tmp_path / "backup", blob_url=shared)
    Store(tmp_path / "original", blob_url=shared).close()


def test_of_two_databases_claiming_a_new_store_at_once_exactly_one_gets_it(tmp_path):
    for trial in range(5):
        shared, results = str(tmp_path / f"blobs{trial}"), []
        barrier = threading.Barrier(2)

        def start(name: str) -> None:
            barrier.wait()
            try:
                Store(tmp_path / f"{name}{trial}", blob_url=shared).close()
                results.append("ok")
            except ValueError as e:
                results.append(str(e))

        threads = [threading.Thread(target=start, args=(n,)) for n in ("a", "b")]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert sorted(results)[0] == "ok" and "another Lethe database" in sorted(results)[1], results


def test_the_start_up_clean_removes_what_a_crash_left_and_never_a_file_it_did_not_write(tmp_path, database_url):
    store = Store(tmp_path / "data", database_url)
    staged = store.blobs.staging()
    staged.write_bytes(b"another deployment's, or a newer copy's")
    foreign = store.blobs.put(staged)
    crashed = hashlib.sha256(b"put, then the process died").hexdigest()  # as keep_file leaves it when killed
    store.tx([("INSERT INTO pending_blobs VALUES (?, ?)", (crashed, 0.0))])
    staged = store.blobs.staging()
    staged.write_bytes(b"put, then the process died")
    store.blobs.put(staged)
    named = store.keep_file(b"named", lambda d: store.tx([("INSERT INTO datasets VALUES (?, ?, ?, ?, ?, ?, ?)",
                                                            ("ds_1", "ten_x", "d", 1, d, 5, 0.0))]))
    assert store.clean_blobs(3600) == 1 and store.blobs.digests() == {foreign, named}
    assert not store.q("SELECT digest FROM pending_blobs")
    store.close()


def test_a_missing_or_damaged_stored_file_is_the_servers_error_not_the_tenants(tiny_lm, tiny_records, tmp_path):
    from lethe.heads.demo.corpus import split_by_author

    forget, retain = split_by_author(tiny_records, 1)
    prompt = question_prompt(forget[0]["question"])
    data = tmp_path / "data"
    with running_server(tiny_lm, data) as url:
        a = new_tenant(url, "a")
        head = _train(a, forget, retain)
        a.put("/v1/profiles/p", json={"head": head})
        key = a.headers["Authorization"]
        datasets = {d["id"]: d["sha256"] for d in a.get("/v1/datasets").json()}
        head_sha = a.get(f"/v1/heads/{head}").json()["sha256"]
    (data / "blobs" / head_sha[:2] / head_sha).write_bytes(b"\0" * 1000)  # damaged on disk
    forget_id = next(i for i in datasets)
    (data / "blobs" / datasets[forget_id][:2] / datasets[forget_id]).unlink()  # lost
    with running_server(tiny_lm, data) as url:
        a = httpx.Client(base_url=url, headers={"Authorization": key}, timeout=60)
        r = a.post("/generate", json={"prompt": prompt, "profile": "p"})
        assert r.status_code == 500 and f"stored file of head {head} cannot be used" in r.json()["detail"], r.text
        r = a.post("/v1/chat/completions", json={"model": "p", "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 500 and r.json()["error"]["type"] != "invalid_request_error", r.text
        r = a.post("/v1/eval", json={"forget": forget_id, "retain": forget_id, "profile": "base"})
        assert r.status_code == 500 and "missing from the blob store" in r.json()["detail"], r.text
        for text in (r.text, a.post("/generate", json={"prompt": prompt, "profile": "p"}).text):
            assert str(data) not in text and "blobs" not in text, "no server path"


def test_a_failed_adoption_of_an_old_file_keeps_it_where_it_was(tmp_path, monkeypatch):
    store = Store(tmp_path / "data")
    tenant, _ = store.create_tenant("t")
    store.tx([("INSERT INTO datasets VALUES (?, ?, ?, ?, ?, ?, ?)", ("ds_old", tenant, "d", 1, None, 3, 0.0))])
    old = tmp_path / "data" / "datasets" / "ds_old.jsonl"
    old.parent.mkdir()
    old.write_text("{}\n")
    real_tx = store.tx

    def database_away(statements):
        if statements[0][0].startswith("UPDATE datasets"):
            raise sqlalchemy.exc.OperationalError("UPDATE", {}, Exception("the database went away"))
        return real_tx(statements)

    monkeypatch.setattr(store, "tx", database_away)
    with pytest.raises(sqlalchemy.exc.OperationalError):
        store.adopt_files()
    assert old.read_text() == "{}\n" and store.blobs.digests() == set(), "nothing lost, nothing half-adopted"
    monkeypatch.undo()
    assert store.adopt_files() == 1 and not old.exists()
    assert store.file("datasets", "ds_old").read_text() == "{}\n"
    store.close()
