"""Metadata in SQLite (WAL), files in the data directory.

Layout of the data directory:
    lethe.db            tenants, keys (hashed), datasets, heads, jobs, profiles and their versions
    datasets/<id>.jsonl uploaded records, as received
    heads/<id>.safetensors
    asu/<id>.safetensors  ASU adapters
Every file is written atomically (heads.io); a row points at a file only once the file is complete.
"""

from __future__ import annotations

import hashlib
import json
import secrets
import sqlite3
import threading
import time
import uuid
from pathlib import Path

SCHEMA = """
CREATE TABLE IF NOT EXISTS tenants (id TEXT PRIMARY KEY, name TEXT UNIQUE NOT NULL, created REAL NOT NULL);
CREATE TABLE IF NOT EXISTS api_keys (hash TEXT PRIMARY KEY, tenant_id TEXT NOT NULL REFERENCES tenants(id),
    created REAL NOT NULL);
CREATE TABLE IF NOT EXISTS datasets (id TEXT PRIMARY KEY, tenant_id TEXT NOT NULL, name TEXT, records INTEGER,
    sha256 TEXT, bytes INTEGER, created REAL NOT NULL);
CREATE TABLE IF NOT EXISTS heads (id TEXT PRIMARY KEY, tenant_id TEXT NOT NULL, job_id TEXT, bytes INTEGER,
    info TEXT, created REAL NOT NULL);
CREATE TABLE IF NOT EXISTS asu_weights (id TEXT PRIMARY KEY, tenant_id TEXT NOT NULL, job_id TEXT, bytes INTEGER,
    info TEXT, created REAL NOT NULL);
CREATE TABLE IF NOT EXISTS jobs (id TEXT PRIMARY KEY, tenant_id TEXT NOT NULL, kind TEXT NOT NULL,
    status TEXT NOT NULL, phase TEXT, progress REAL, params TEXT, metrics TEXT, result TEXT, error TEXT,
    created REAL NOT NULL, started REAL, finished REAL);
CREATE TABLE IF NOT EXISTS profile_versions (tenant_id TEXT NOT NULL, name TEXT NOT NULL, version INTEGER NOT NULL,
    spec TEXT NOT NULL, created REAL NOT NULL, note TEXT, PRIMARY KEY (tenant_id, name, version));
CREATE TABLE IF NOT EXISTS profiles (tenant_id TEXT NOT NULL, name TEXT NOT NULL, version INTEGER NOT NULL,
    PRIMARY KEY (tenant_id, name));
"""

KEY_PREFIX = "lk_"  # every API key Lethe issues starts with it


TABLES = ("datasets", "heads", "jobs", "asu_weights")


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:16]}"


def _new_key(tenant_id: str, now: float) -> tuple[str, tuple[str, tuple]]:
    """A new API key and the statement that stores it: hashed, with a public id and its first characters."""
    key = KEY_PREFIX + secrets.token_urlsafe(24)
    return key, ("INSERT INTO api_keys (hash, tenant_id, created, id, prefix, last_used) VALUES (?, ?, ?, ?, ?, NULL)",
                 (hash_key(key), tenant_id, now, new_id("key"), key[:7]))


class Store:
    """Thread-safe access to the metadata database; one connection, serialised by a lock."""

    def __init__(self, data_dir: Path):
        self.dir = Path(data_dir)
        for sub in ("datasets", "heads", "asu"):
            (self.dir / sub).mkdir(parents=True, exist_ok=True)
        self._db = sqlite3.connect(self.dir / "lethe.db", check_same_thread=False, isolation_level=None)
        self._db.row_factory = sqlite3.Row
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=FULL")
        self._db.executescript(SCHEMA)
        self._migrate()
        self._lock = threading.RLock()
        self._touched: dict[str, float] = {}  # key hash -> when last_used was last written (at most once a minute)

    def _migrate(self) -> None:
        """Bring a database made by an earlier release up to this one, in place (columns added, values filled)."""
        columns = {r["name"] for r in self._db.execute("PRAGMA table_info(api_keys)")}
        if "id" not in columns:  # keys gained a public id, a shown prefix and a last-used time
            self._db.execute("BEGIN IMMEDIATE")
            self._db.execute("ALTER TABLE api_keys ADD COLUMN id TEXT")
            self._db.execute("ALTER TABLE api_keys ADD COLUMN prefix TEXT")
            self._db.execute("ALTER TABLE api_keys ADD COLUMN last_used REAL")
            self._db.execute("UPDATE api_keys SET id = 'key_' || substr(hash, 1, 16) WHERE id IS NULL")
            self._db.execute("COMMIT")

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def q(self, sql: str, *args) -> list[sqlite3.Row]:
        with self._lock:
            return self._db.execute(sql, args).fetchall()

    def tx(self, statements: list[tuple[str, tuple]]) -> None:
        """Run statements in one transaction."""
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                for sql, args in statements:
                    self._db.execute(sql, args)
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise

    # tenants and keys
    def create_tenant(self, name: str) -> tuple[str, str]:
        """A new tenant and its first API key: (tenant id, key). The key is stored hashed only."""
        tenant_id, now = new_id("ten"), time.time()
        key, insert = _new_key(tenant_id, now)
        self.tx([("INSERT INTO tenants VALUES (?, ?, ?)", (tenant_id, name, now)), insert])
        return tenant_id, key

    def add_key(self, tenant_id: str) -> str:
        key, insert = _new_key(tenant_id, time.time())
        self.tx([insert])
        return key

    def tenant_for_key(self, key: str) -> str | None:
        digest = hash_key(key)
        rows = self.q("SELECT tenant_id FROM api_keys WHERE hash = ?", digest)
        if not rows:
            return None
        now = time.time()
        if now - self._touched.get(digest, 0.0) > 60:  # last_used to the minute: no write on every request
            self._touched[digest] = now
            self.tx([("UPDATE api_keys SET last_used = ? WHERE hash = ?", (now, digest))])
        return rows[0]["tenant_id"]

    def tenants(self) -> list[dict]:
        return [dict(r) for r in self.q(
            "SELECT t.id, t.name, t.created, (SELECT count(*) FROM api_keys k WHERE k.tenant_id = t.id) AS keys "
            "FROM tenants t ORDER BY t.created")]

    def keys(self, tenant_id: str) -> list[dict]:
        """A tenant's keys as an operator sees them: id, the key's first characters, created, last used."""
        return [dict(r) for r in self.q("SELECT id, prefix, created, last_used FROM api_keys WHERE tenant_id = ? "
                                        "ORDER BY created", tenant_id)]

    def _key_hash(self, tenant_id: str, key_id: str) -> str | None:
        found = self.q("SELECT hash FROM api_keys WHERE tenant_id = ? AND id = ?", tenant_id, key_id)
        return found[0]["hash"] if found else None

    def revoke_key(self, tenant_id: str, key_id: str) -> bool:
        with self._lock:
            digest = self._key_hash(tenant_id, key_id)
            if digest is not None:
                self.tx([("DELETE FROM api_keys WHERE hash = ?", (digest,))])
            return digest is not None

    def rotate_key(self, tenant_id: str, key_id: str) -> str | None:
        """A new key in place of `key_id`, in one transaction (the old one stops working as the new one starts)."""
        with self._lock:
            digest = self._key_hash(tenant_id, key_id)
            if digest is None:
                return None
            key, insert = _new_key(tenant_id, time.time())
            self.tx([("DELETE FROM api_keys WHERE hash = ?", (digest,)), insert])
            return key

    def delete_tenant(self, tenant_id: str) -> dict[str, list[str]]:
        """Delete a tenant's rows, keys included, in one transaction; returns the ids of its datasets, heads and
        ASU weights (the caller removes their files and cached copies after). Refused (ValueError) while one of
        its jobs is queued or running."""
        with self._lock:
            active = self.q("SELECT id FROM jobs WHERE tenant_id = ? AND status IN ('queued', 'running')", tenant_id)
            if active:
                raise ValueError(f"jobs {', '.join(r['id'] for r in active)} are queued or running: cancel them first")
            owned = {table: [r["id"] for r in self.q(f"SELECT id FROM {table} WHERE tenant_id = ?", tenant_id)]
                     for table in ("datasets", "heads", "asu_weights")}
            self.tx([(f"DELETE FROM {table} WHERE tenant_id = ?", (tenant_id,))
                     for table in ("profiles", "profile_versions", *TABLES, "api_keys")]
                    + [("DELETE FROM tenants WHERE id = ?", (tenant_id,))])
            return owned

    def tenant_by_name(self, name: str) -> str | None:
        rows = self.q("SELECT id FROM tenants WHERE name = ?", name)
        return rows[0]["id"] if rows else None

    # owned resources: every lookup is by (tenant, id), so another tenant's id is simply not found
    def get(self, table: str, tenant_id: str, item_id: str) -> dict | None:
        assert table in TABLES
        rows = self.q(f"SELECT * FROM {table} WHERE tenant_id = ? AND id = ?", tenant_id, item_id)
        return dict(rows[0]) if rows else None

    def list(self, table: str, tenant_id: str) -> list[dict]:
        assert table in TABLES
        return [dict(r) for r in self.q(f"SELECT * FROM {table} WHERE tenant_id = ? ORDER BY created", tenant_id)]

    def public(self, message: str) -> str:
        """A message as a tenant may see it: the data directory's path (as given and resolved) masked."""
        for path in sorted({str(self.dir.resolve()), str(self.dir)} - {"", "."}, key=len, reverse=True):
            message = message.replace(path, "<data>")
        return message

    def dataset_path(self, dataset_id: str) -> Path:
        return self.dir / "datasets" / f"{dataset_id}.jsonl"

    def head_path(self, head_id: str) -> Path:
        return self.dir / "heads" / f"{head_id}.safetensors"

    def asu_path(self, weights_id: str) -> Path:
        return self.dir / "asu" / f"{weights_id}.safetensors"

    # profiles
    def put_profile(self, tenant_id: str, name: str, spec: dict, note: str | None = None) -> int:
        """Store `spec` as the next version of profile `name` and make it current; returns the version."""
        with self._lock:
            rows = self.q("SELECT MAX(version) AS v FROM profile_versions WHERE tenant_id = ? AND name = ?",
                          tenant_id, name)
            version = (rows[0]["v"] or 0) + 1
            self.tx([("INSERT INTO profile_versions VALUES (?, ?, ?, ?, ?, ?)",
                      (tenant_id, name, version, json.dumps(spec), time.time(), note)),
                     ("INSERT OR REPLACE INTO profiles VALUES (?, ?, ?)", (tenant_id, name, version))])
            return version

    def current_profile(self, tenant_id: str, name: str) -> tuple[int, dict] | None:
        rows = self.q("SELECT v.version, v.spec FROM profiles p JOIN profile_versions v ON v.tenant_id = p.tenant_id "
                      "AND v.name = p.name AND v.version = p.version WHERE p.tenant_id = ? AND p.name = ?",
                      tenant_id, name)
        return (rows[0]["version"], json.loads(rows[0]["spec"])) if rows else None

    def profile_history(self, tenant_id: str, name: str) -> list[dict]:
        return [{"version": r["version"], "spec": json.loads(r["spec"]), "created": r["created"], "note": r["note"]}
                for r in self.q("SELECT * FROM profile_versions WHERE tenant_id = ? AND name = ? ORDER BY version",
                                tenant_id, name)]

    def profile_names(self, tenant_id: str) -> list[str]:
        return [r["name"] for r in self.q("SELECT name FROM profiles WHERE tenant_id = ? ORDER BY name", tenant_id)]

    def set_profile_version(self, tenant_id: str, name: str, version: int) -> None:
        self.tx([("UPDATE profiles SET version = ? WHERE tenant_id = ? AND name = ?", (version, tenant_id, name))])

    def users_of(self, tenant_id: str, key: str, value: str) -> list[str]:
        """What still refers to a head (`key` head), ASU weights (`weights`) or dataset (`forget`/`retain`):
        any version of a profile (a rollback may make it current again) and any queued or running job."""
        users = []
        for r in self.q("SELECT name, version, spec FROM profile_versions WHERE tenant_id = ? ORDER BY name, version",
                        tenant_id):
            if json.loads(r["spec"]).get(key) == value:
                users.append(f"profile {r['name']!r} v{r['version']}")
        for r in self.q("SELECT id, params FROM jobs WHERE tenant_id = ? AND status IN ('queued', 'running')",
                        tenant_id):
            params = json.loads(r["params"] or "{}")
            if value in (params.get("forget"), params.get("retain"), (params.get("spec") or {}).get(key)):
                users.append(f"job {r['id']}")
        return users

    def delete_profile(self, tenant_id: str, name: str) -> None:
        self.tx([("DELETE FROM profiles WHERE tenant_id = ? AND name = ?", (tenant_id, name)),
                 ("DELETE FROM profile_versions WHERE tenant_id = ? AND name = ?", (tenant_id, name))])
