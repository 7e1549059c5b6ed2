"""Metadata in a database (SQLite by default, PostgreSQL for several replicas), files in the data directory.

The database is SQLite (WAL) in the data directory unless `LETHE_DATABASE_URL` names another:
`postgresql://user@host/db` shares tenants, keys, datasets, heads, jobs and profiles between replicas. Both
run the same SQL through SQLAlchemy 2 Core; the schema is versioned (`lethe_schema`) and brought up to date
at start-up (`MIGRATIONS`), so a database made by an earlier release is upgraded in place.

Layout of the data directory:
    lethe.db            tenants, keys (hashed), datasets, heads, jobs, profiles and their versions (SQLite)
    datasets/<id>.jsonl uploaded records, as received
    heads/<id>.safetensors
    asu/<id>.safetensors  ASU adapters
Every file is written atomically (heads.io); a row points at a file only once the file is complete.
"""

from __future__ import annotations

import hashlib
import json
import re
import secrets
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path

from sqlalchemy import (Column, Double, ForeignKey, Integer, MetaData, PrimaryKeyConstraint, Table, Text,
                        create_engine, event, inspect, text)
from sqlalchemy.engine import Connection, Engine

# The schema of this release. Columns are in the order of the positional INSERTs that fill them.
METADATA = MetaData()
Table("tenants", METADATA, Column("id", Text, primary_key=True), Column("name", Text, unique=True, nullable=False),
      Column("created", Double, nullable=False))
Table("api_keys", METADATA, Column("hash", Text, primary_key=True),
      Column("tenant_id", Text, ForeignKey("tenants.id"), nullable=False), Column("created", Double, nullable=False),
      Column("id", Text), Column("prefix", Text), Column("last_used", Double))
Table("datasets", METADATA, Column("id", Text, primary_key=True), Column("tenant_id", Text, nullable=False),
      Column("name", Text), Column("records", Integer), Column("sha256", Text), Column("bytes", Integer),
      Column("created", Double, nullable=False))
for _name in ("heads", "asu_weights"):
    Table(_name, METADATA, Column("id", Text, primary_key=True), Column("tenant_id", Text, nullable=False),
          Column("job_id", Text), Column("bytes", Integer), Column("info", Text), Column("created", Double, nullable=False))
Table("jobs", METADATA, Column("id", Text, primary_key=True), Column("tenant_id", Text, nullable=False),
      Column("kind", Text, nullable=False), Column("status", Text, nullable=False), Column("phase", Text),
      Column("progress", Double), Column("params", Text), Column("metrics", Text), Column("result", Text),
      Column("error", Text), Column("created", Double, nullable=False), Column("started", Double),
      Column("finished", Double), Column("heartbeat", Double))
Table("profile_versions", METADATA, Column("tenant_id", Text, nullable=False), Column("name", Text, nullable=False),
      Column("version", Integer, nullable=False), Column("spec", Text, nullable=False),
      Column("created", Double, nullable=False), Column("note", Text),
      PrimaryKeyConstraint("tenant_id", "name", "version"))
Table("profiles", METADATA, Column("tenant_id", Text, nullable=False), Column("name", Text, nullable=False),
      Column("version", Integer, nullable=False), PrimaryKeyConstraint("tenant_id", "name"))
SCHEMA_TABLE = Table("lethe_schema", METADATA, Column("version", Integer, nullable=False))

KEY_PREFIX = "lk_"  # every API key Lethe issues starts with it


TABLES = ("datasets", "heads", "jobs", "asu_weights")


def _add_columns(conn: Connection, ops, table: str, *columns: Column) -> None:
    """Add the columns a table lacks (a table this release made just now already has them)."""
    have = {c["name"] for c in inspect(conn).get_columns(table)}
    missing = [c for c in columns if c.name not in have]
    if missing:
        with ops.batch_alter_table(table) as batch:
            for column in missing:
                batch.add_column(column)


def _keys_gain_ids(conn: Connection, ops) -> None:
    """1: keys gained a public id, a shown prefix and a last-used time (old keys keep working)."""
    _add_columns(conn, ops, "api_keys", Column("id", Text), Column("prefix", Text), Column("last_used", Double))
    conn.execute(text("UPDATE api_keys SET id = 'key_' || substr(hash, 1, 16) WHERE id IS NULL"))


def _jobs_gain_heartbeat(conn: Connection, ops) -> None:
    """2: a running job's worker writes a heartbeat, so replicas sharing the database can tell a job whose
    worker died (fail it) from one another replica runs (leave it)."""
    _add_columns(conn, ops, "jobs", Column("heartbeat", Double))


# (version, migration): each takes a database at the version before it to its own. A new release that changes
# the schema appends one, and changes METADATA to match.
MIGRATIONS: list[tuple[int, Callable]] = [(1, _keys_gain_ids), (2, _jobs_gain_heartbeat)]
SCHEMA_VERSION = MIGRATIONS[-1][0]


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:16]}"


def _new_key(tenant_id: str, now: float) -> tuple[str, tuple[str, tuple]]:
    """A new API key and the statement that stores it: hashed, with a public id and its first characters."""
    key = KEY_PREFIX + secrets.token_urlsafe(24)
    return key, ("INSERT INTO api_keys (hash, tenant_id, created, id, prefix, last_used) VALUES (?, ?, ?, ?, ?, NULL)",
                 (hash_key(key), tenant_id, now, new_id("key"), key[:7]))


class Record(dict):
    """A result row: by column name, or by position (`row[0]`)."""

    def __getitem__(self, key):
        return list(self.values())[key] if isinstance(key, int) else super().__getitem__(key)


_PLACEHOLDER = re.compile(r"\?")


def _bind(sql: str, args: tuple) -> tuple:
    """`?` placeholders (SQLite's) as named ones, which SQLAlchemy passes to any driver."""
    names = iter(range(len(args)))
    return text(_PLACEHOLDER.sub(lambda _: f":p{next(names)}", sql)), {f"p{i}": a for i, a in enumerate(args)}


def database_url(data_dir: Path, url: str | None = None) -> str:
    """The database to use: `url` (LETHE_DATABASE_URL), else SQLite in the data directory. A plain
    `postgresql://` URL gets the psycopg 3 driver."""
    if not url:
        return f"sqlite:///{Path(data_dir) / 'lethe.db'}"
    if url.startswith(("postgresql://", "postgres://")):
        return "postgresql+psycopg://" + url.split("://", 1)[1]
    return url


def redact(url: str) -> str:
    """A database URL fit for a log: its password hidden."""
    return re.sub(r"://([^:/@]+):[^@]*@", r"://\1:***@", url)


def _connect(url: str) -> Engine:
    if url.startswith("sqlite"):
        engine = create_engine(url, connect_args={"check_same_thread": False})

        @event.listens_for(engine, "connect")
        def _pragmas(dbapi, _record):
            dbapi.execute("PRAGMA journal_mode=WAL")
            dbapi.execute("PRAGMA synchronous=FULL")
            dbapi.execute("PRAGMA busy_timeout=30000")
        return engine
    return create_engine(url, pool_pre_ping=True, pool_size=8, max_overflow=8)


def check_database(url: str) -> None:
    """Connect once; an unreachable database is a ValueError naming it (its password hidden) and the reason."""
    engine = _connect(database_url(Path("."), url))
    try:
        with engine.connect():
            pass
    except Exception as e:
        reason = str(getattr(e, "orig", None) or e).strip().splitlines()[0]
        raise ValueError(f"cannot reach the database {redact(url)}: {reason}") from None
    finally:
        engine.dispose()


def upgrade(engine: Engine) -> int:
    """Bring the database to SCHEMA_VERSION, in one transaction (on PostgreSQL under an advisory lock, so
    replicas starting together migrate once). An empty database gets this release's schema; one made before
    schemas were versioned is recognised by its columns. Returns the version it found."""
    from alembic.runtime.migration import MigrationContext
    from alembic.operations import Operations

    with engine.begin() as conn:
        if conn.dialect.name == "postgresql":
            conn.execute(text("SELECT pg_advisory_xact_lock(7134)"))  # any constant: Lethe's migration lock
        tables = set(inspect(conn).get_table_names())
        if "lethe_schema" in tables:
            found = int(conn.execute(text("SELECT MAX(version) FROM lethe_schema")).scalar() or 0)
        elif "api_keys" in tables:  # a release before versioned schemas: 1 if its keys have ids
            columns = {c["name"] for c in inspect(conn).get_columns("api_keys")}
            found = 1 if "id" in columns else 0
        else:
            found = SCHEMA_VERSION  # a new database: this release's tables, as they are
        if found > SCHEMA_VERSION:
            raise RuntimeError(f"the database's schema is version {found}, newer than this release's "
                               f"({SCHEMA_VERSION}): upgrade Lethe")
        METADATA.create_all(conn, checkfirst=True)  # tables this release adds (and lethe_schema)
        ops = Operations(MigrationContext.configure(conn))
        for version, migrate in MIGRATIONS:
            if version > found:
                migrate(conn, ops)
        conn.execute(SCHEMA_TABLE.delete())
        conn.execute(SCHEMA_TABLE.insert().values(version=SCHEMA_VERSION))
    return found


class Store:
    """Thread-safe access to the metadata database. Statements are SQL with `?` placeholders, portable between
    SQLite and PostgreSQL; `tx` runs several in one transaction."""

    def __init__(self, data_dir: Path, url: str | None = None):
        self.dir = Path(data_dir)
        for sub in ("datasets", "heads", "asu"):
            (self.dir / sub).mkdir(parents=True, exist_ok=True)
        self.url = database_url(self.dir, url)
        self.engine = _connect(self.url)
        self.found_version = upgrade(self.engine)
        self._lock = threading.RLock()
        self._touched: dict[str, float] = {}  # key hash -> when last_used was last written (at most once a minute)

    @property
    def dialect(self) -> str:
        return self.engine.dialect.name

    def close(self) -> None:
        with self._lock:
            self.engine.dispose()

    def q(self, sql: str, *args) -> list[Record]:
        with self._lock, self.engine.connect() as conn:
            result = conn.execute(*_bind(sql, args))
            return [Record(r._mapping) for r in result] if result.returns_rows else []

    def tx(self, statements: list[tuple[str, tuple]]) -> int:
        """Run statements in one transaction; returns the rows the last one changed."""
        changed = 0
        with self._lock, self.engine.begin() as conn:
            for sql, args in statements:
                changed = conn.execute(*_bind(sql, args)).rowcount
        return changed

    @property
    def shared(self) -> bool:
        """Whether other processes may use this database and data directory at once (replicas on PostgreSQL)."""
        return self.dialect != "sqlite"

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
                     ("INSERT INTO profiles VALUES (?, ?, ?) ON CONFLICT (tenant_id, name) DO UPDATE SET "
                      "version = excluded.version", (tenant_id, name, version))])
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
