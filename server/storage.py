"""Metadata in a database (SQLite by default, PostgreSQL for several replicas), files in a blob store.

The database is SQLite (WAL) in the data directory unless `LETHE_DATABASE_URL` names another:
`postgresql://user@host/db` shares tenants, keys, datasets, heads, jobs and profiles between replicas. Both
run the same SQL through SQLAlchemy 2 Core; the schema is versioned (`lethe_schema`) and brought up to date
at start-up (`MIGRATIONS`), so a database made by an earlier release is upgraded in place.

Layout of the data directory:
    lethe.db            tenants, keys (hashed), datasets, heads, jobs, profiles and their versions (SQLite)
    blobs/<ab>/<sha256> uploaded records as received, heads, ASU adapters (`server.blobs`; LETHE_BLOB_URL
                        puts them elsewhere, a shared directory or an object store)
    blob-cache/         this replica's copies of a remote blob store's files
A row names its file by sha256 (`datasets.sha256`, `heads.sha256`, `asu_weights.sha256`) and is inserted only
once the file is stored whole. Releases before blobs kept `datasets/<id>.jsonl`, `heads/<id>.safetensors` and
`asu/<id>.safetensors`; `adopt_files` copies them into the blob store at start-up, removing each old file once
its row names the blob.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import re
import secrets
import shutil
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
      Column("created", Double, nullable=False),
      Column("enforced_profile", Text),  # every generation of every key of the tenant uses this profile ...
      Column("enforced_by", Text))  # ... set by `admin` (then only the admin key changes it) or a key id
# scopes: comma-separated (`manage,generate,evaluate`), NULL for a key made before scopes (every scope); profile:
# the profile every generation through the key uses, NULL for none
Table("api_keys", METADATA, Column("hash", Text, primary_key=True),
      Column("tenant_id", Text, ForeignKey("tenants.id"), nullable=False), Column("created", Double, nullable=False),
      Column("id", Text), Column("prefix", Text), Column("last_used", Double), Column("scopes", Text),
      Column("profile", Text))
Table("datasets", METADATA, Column("id", Text, primary_key=True), Column("tenant_id", Text, nullable=False),
      Column("name", Text), Column("records", Integer), Column("sha256", Text), Column("bytes", Integer),
      Column("created", Double, nullable=False))
for _name in ("heads", "asu_weights"):
    Table(_name, METADATA, Column("id", Text, primary_key=True), Column("tenant_id", Text, nullable=False),
          Column("job_id", Text), Column("bytes", Integer), Column("info", Text), Column("created", Double, nullable=False),
          Column("sha256", Text))
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
# the last version a profile name ever had, kept when the profile is deleted: versions are never reused, so a
# response's (profile, version) names one set of settings for ever
Table("profile_serials", METADATA, Column("tenant_id", Text, nullable=False), Column("name", Text, nullable=False),
      Column("version", Integer, nullable=False), PrimaryKeyConstraint("tenant_id", "name"))
# the audit trail: append-only (no API deletes a row; triggers refuse UPDATE and DELETE), kept when a tenant is
# deleted. `actor`: the acting key's id, or `admin`; `before`/`after`: JSON of what the change replaced and made
AUDIT = Table("audit", METADATA, Column("id", Integer, primary_key=True, autoincrement=True),
              Column("at", Double, nullable=False), Column("tenant_id", Text), Column("tenant", Text),
              Column("actor", Text, nullable=False), Column("action", Text, nullable=False), Column("target", Text),
              Column("profile", Text), Column("before", Text), Column("after", Text))
SCHEMA_TABLE = Table("lethe_schema", METADATA, Column("version", Integer, nullable=False))
# one row: this database's id and generation, written into its blob store (`Store._claim`): two databases, or two
# copies of one, never use one store
Table("lethe_store", METADATA, Column("id", Text, primary_key=True), Column("generation", Integer, nullable=False))
# blobs being put whose row is not inserted yet: what a crash can leave unnamed, and all the start-up clean removes
Table("pending_blobs", METADATA, Column("digest", Text, nullable=False), Column("created", Double, nullable=False))

KEY_PREFIX = "lk_"  # every API key Lethe issues starts with it
SCOPES = ("manage", "generate", "evaluate")  # what a key may do; a key made without scopes may do all three


TABLES = ("datasets", "heads", "jobs", "asu_weights")
FILES = ("datasets", "heads", "asu_weights")  # the tables whose rows name a blob (column sha256)
LEGACY = {"datasets": ("datasets", ".jsonl"), "heads": ("heads", ".safetensors"), "asu_weights": ("asu", ".safetensors")}


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


def _files_gain_digests(conn: Connection, ops) -> None:
    """3: heads and ASU weights name their file by sha256, as datasets did, so files live in a content-addressed
    blob store (`Store.adopt_files` copies the files themselves in, which needs the store, at start-up)."""
    for table in ("heads", "asu_weights"):
        _add_columns(conn, ops, table, Column("sha256", Text))


def _keys_gain_scopes(conn: Connection, ops) -> None:
    """4: keys gain scopes and a profile binding (old keys: NULL, every scope, as before), tenants an enforced
    profile; profile versions count on across delete and re-create (`profile_serials`, filled from the versions
    there are); the audit trail starts (its table is made by `create_all`)."""
    _add_columns(conn, ops, "api_keys", Column("scopes", Text), Column("profile", Text))
    _add_columns(conn, ops, "tenants", Column("enforced_profile", Text), Column("enforced_by", Text))
    conn.execute(text("INSERT INTO profile_serials (tenant_id, name, version) SELECT v.tenant_id, v.name, "
                      "MAX(v.version) FROM profile_versions v WHERE NOT EXISTS (SELECT 1 FROM profile_serials s "
                      "WHERE s.tenant_id = v.tenant_id AND s.name = v.name) GROUP BY v.tenant_id, v.name"))


# (version, migration): each takes a database at the version before it to its own. A new release that changes
# the schema appends one, and changes METADATA to match.
MIGRATIONS: list[tuple[int, Callable]] = [(1, _keys_gain_ids), (2, _jobs_gain_heartbeat), (3, _files_gain_digests),
                                          (4, _keys_gain_scopes)]
SCHEMA_VERSION = MIGRATIONS[-1][0]


def hold_data_dir(data_dir: Path):
    """Take the data directory for this process (an exclusive lock on `<data dir>/serve.lock`, with this process's
    id in it), or refuse it (ValueError naming the process that holds it): two servers on one SQLite database and
    blob store would each clean up the other's files. The lock lasts while the returned file stays open (it goes
    with the process, however it ends)."""
    import fcntl
    import os

    Path(data_dir).mkdir(parents=True, exist_ok=True)
    path = Path(data_dir) / "serve.lock"
    handle = open(path, "a+")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.seek(0)
        holder = handle.read().strip() or "unknown"
        handle.close()
        raise ValueError(f"the data directory {data_dir} is in use by another Lethe server (process {holder}): stop "
                         "it, or give this one another --data-dir") from None
    handle.seek(0)
    handle.truncate()
    handle.write(str(os.getpid()))
    handle.flush()
    return handle


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:16]}"


def _new_key(tenant_id: str, now: float, scopes: str | None = None, profile: str | None = None,
             key_id: str | None = None) -> tuple[str, str, tuple[str, tuple]]:
    """A new API key, its id and the statement that stores it: hashed, with a public id, its first characters,
    its scopes (None: every scope) and the profile it is bound to (None: none)."""
    key, key_id = KEY_PREFIX + secrets.token_urlsafe(24), key_id or new_id("key")
    return key, key_id, ("INSERT INTO api_keys (hash, tenant_id, created, id, prefix, last_used, scopes, profile) "
                         "VALUES (?, ?, ?, ?, ?, NULL, ?, ?)",
                         (hash_key(key), tenant_id, now, key_id, key[:7], scopes, profile))


def key_scopes(stored: str | None) -> tuple[str, ...]:
    """A key's scopes as stored: NULL (a key made before scopes, or without any named) is every scope."""
    return SCOPES if stored is None else tuple(s for s in SCOPES if s in stored.split(","))


def _audit_row(tenant_id: str | None, tenant: str | None, actor: str, action: str, target: str | None,
               profile: str | None, before, after) -> tuple[str, tuple]:
    """The statement that appends one entry to the audit trail (`before`, `after`: JSON-able, or None)."""
    dump = (lambda v: None if v is None else json.dumps(v, sort_keys=True))
    return ("INSERT INTO audit (at, tenant_id, tenant, actor, action, target, profile, before, after) "
            "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
            (time.time(), tenant_id, tenant, actor, action, target, profile, dump(before), dump(after)))


def _version_state(current: tuple[int, dict] | None) -> dict | None:
    """A profile's current version as the audit trail records it."""
    return None if current is None else {"version": current[0], "spec": current[1]}


AUDITED_KIND = {"datasets": "dataset", "heads": "head", "asu_weights": "weights"}


def _audit_trigger_sql(dialect: str) -> list[str]:
    """Statements that make the audit table refuse UPDATE and DELETE (append-only below the API too)."""
    if dialect == "sqlite":
        return [f"CREATE TRIGGER IF NOT EXISTS audit_no_{op.lower()} BEFORE {op} ON audit "
                "BEGIN SELECT RAISE(ABORT, 'the audit trail is append-only'); END" for op in ("UPDATE", "DELETE")]
    if dialect == "postgresql":
        return ["CREATE OR REPLACE FUNCTION lethe_audit_append_only() RETURNS trigger LANGUAGE plpgsql AS "
                "$$ BEGIN RAISE EXCEPTION 'the audit trail is append-only'; END $$",
                "DROP TRIGGER IF EXISTS audit_append_only ON audit",
                "CREATE TRIGGER audit_append_only BEFORE UPDATE OR DELETE ON audit "
                "FOR EACH ROW EXECUTE FUNCTION lethe_audit_append_only()"]
    return []


class StoredFileError(Exception):
    """A stored file (a dataset's, a head's, ASU weights') is missing from the blob store or damaged: the server's
    storage is at fault, not the request (answered 500, naming the item, never a path)."""


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
        for statement in _audit_trigger_sql(conn.dialect.name):
            conn.execute(text(statement))
        conn.execute(SCHEMA_TABLE.delete())
        conn.execute(SCHEMA_TABLE.insert().values(version=SCHEMA_VERSION))
        # the database's id (under the migration lock: replicas starting together make one)
        conn.execute(text("INSERT INTO lethe_store (id, generation) SELECT :id, 0 "
                          "WHERE NOT EXISTS (SELECT 1 FROM lethe_store)"), {"id": new_id("store")})
    return found


class Store:
    """Thread-safe access to the metadata database. Statements are SQL with `?` placeholders, portable between
    SQLite and PostgreSQL; `tx` runs several in one transaction."""

    def __init__(self, data_dir: Path, url: str | None = None, blob_url: str | None = None,
                 blob_cache: Path | None = None):
        from lethe.server.blobs import BlobStore

        self.dir = Path(data_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.blobs = BlobStore(blob_url or self.dir / "blobs", blob_cache or self.dir / "blob-cache")
        self.url = database_url(self.dir, url)
        self.engine = _connect(self.url)
        self.found_version = upgrade(self.engine)
        self.id = self._claim()
        self._lock = threading.RLock()
        self._blob_locks = [threading.Lock() for _ in range(64)]
        self._touched: dict[str, float] = {}  # key hash -> when last_used was last written (at most once a minute)

    def _claim(self) -> str:
        """Take the blob store for this database, or refuse it (ValueError): one another database uses (each would
        delete the files only the other's rows name), or one a newer copy of this database uses (a backup or a
        copy started after the original moved on). Every start raises the generation in the database and then in
        the store's marker, so the older of two copies is the one refused. Returns the database's id."""
        with self.engine.begin() as conn:
            if self.dialect == "postgresql":  # replicas starting together take turns
                conn.execute(text("SELECT pg_advisory_xact_lock(7136)"))
            mine, generation = conn.execute(text("SELECT id, generation FROM lethe_store")).one()
            found = self.blobs.owner()
            if found is not None and found[0] != mine:
                raise ValueError(f"the blob store {self.blobs.url} belongs to another Lethe database ({found[0]}; "
                                 f"this one is {mine}): give each deployment a blob store of its own")
            if found is not None and found[1] > generation:
                raise ValueError(f"this database is an older copy of the one using the blob store {self.blobs.url} "
                                 f"(generation {generation}, the store's {found[1]}): a restored backup or a copied "
                                 "data directory needs a copy of the blob store of its own")
            generation = max(generation, found[1] if found else 0) + 1
            conn.execute(text("UPDATE lethe_store SET generation = :g"), {"g": generation})
        try:
            self.blobs.set_owner(mine, generation, first=found is None)
        except FileExistsError:  # another database claimed this new store at the same moment
            return self._claim()
        return mine

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

    # the audit trail
    def audit_entry(self, tenant_id: str | None, actor: str, action: str, target: str | None = None,
                    profile: str | None = None, before=None, after=None) -> tuple[str, tuple]:
        """The statement that records one change in the audit trail: run it in the change's own transaction, so
        the trail holds every change exactly once (a change that fails records nothing)."""
        name = None
        if tenant_id is not None:
            rows = self.q("SELECT name FROM tenants WHERE id = ?", tenant_id)
            name = rows[0]["name"] if rows else None
        return _audit_row(tenant_id, name, actor, action, target, profile, before, after)

    def audit_trail(self, tenant_id: str | None = None, profile: str | None = None, since: float | None = None,
                    until: float | None = None, action: str | None = None, limit: int = 1000,
                    tenant_name: str | None = None) -> list[dict]:
        """Audit entries, oldest first: one tenant's (None: every tenant's; `tenant_name`: every tenant that had
        that name, a deleted one included), optionally of one profile, within [since, until], of one action."""
        where, args = [], []
        for clause, value in (("tenant_id = ?", tenant_id), ("tenant = ?", tenant_name), ("profile = ?", profile),
                              ("at >= ?", since), ("at <= ?", until), ("action = ?", action)):
            if value is not None:
                where.append(clause)
                args.append(value)
        sql = "SELECT * FROM audit" + (" WHERE " + " AND ".join(where) if where else "") + " ORDER BY id LIMIT ?"
        return [{**dict(r), "before": json.loads(r["before"]) if r["before"] else None,
                 "after": json.loads(r["after"]) if r["after"] else None} for r in self.q(sql, *args, limit)]

    # tenants and keys
    def create_tenant(self, name: str, actor: str = "system") -> tuple[str, str]:
        """A new tenant and its first API key (every scope): (tenant id, key). The key is stored hashed only."""
        tenant_id, now = new_id("ten"), time.time()
        key, key_id, insert = _new_key(tenant_id, now)
        self.tx([("INSERT INTO tenants (id, name, created) VALUES (?, ?, ?)", (tenant_id, name, now)), insert,
                 _audit_row(tenant_id, name, actor, "tenant.create", tenant_id, None, None, {"name": name}),
                 _audit_row(tenant_id, name, actor, "key.create", key_id, None, None,
                            {"scopes": list(SCOPES), "profile": None})])
        return tenant_id, key

    def add_key(self, tenant_id: str, scopes: tuple[str, ...] | None = None, profile: str | None = None,
                actor: str = "system") -> str:
        """A further key: `scopes` (None: every scope), bound to `profile` or not. Returns the key (shown once)."""
        key, key_id, insert = _new_key(tenant_id, time.time(), ",".join(scopes) if scopes is not None else None,
                                       profile)
        self.tx([insert, self.audit_entry(tenant_id, actor, "key.create", key_id, profile, None,
                                          {"scopes": list(key_scopes(insert[1][5])), "profile": profile})])
        return key

    def caller(self, key: str) -> dict | None:
        """Who a key is: its tenant, id, scopes, the profile it is bound to and its tenant's enforced profile;
        None for an unknown key. Writes last_used at most once a minute."""
        digest = hash_key(key)
        rows = self.q("SELECT k.tenant_id, k.id, k.scopes, k.profile, t.enforced_profile FROM api_keys k "
                      "JOIN tenants t ON t.id = k.tenant_id WHERE k.hash = ?", digest)
        if not rows:
            return None
        now = time.time()
        if now - self._touched.get(digest, 0.0) > 60:  # last_used to the minute: no write on every request
            self._touched[digest] = now
            self.tx([("UPDATE api_keys SET last_used = ? WHERE hash = ?", (now, digest))])
        row = rows[0]
        return {"tenant_id": row["tenant_id"], "key_id": row["id"], "scopes": key_scopes(row["scopes"]),
                "profile": row["profile"], "enforced": row["enforced_profile"]}

    def tenant_for_key(self, key: str) -> str | None:
        found = self.caller(key)
        return found["tenant_id"] if found else None

    def tenants(self) -> list[dict]:
        return [dict(r) for r in self.q(
            "SELECT t.id, t.name, t.created, t.enforced_profile, "
            "(SELECT count(*) FROM api_keys k WHERE k.tenant_id = t.id) AS keys FROM tenants t ORDER BY t.created")]

    def keys(self, tenant_id: str) -> list[dict]:
        """A tenant's keys as an operator sees them: id, the key's first characters, created, last used, scopes
        and the profile it is bound to."""
        return [{**dict(r), "scopes": list(key_scopes(r["scopes"]))} for r in self.q(
            "SELECT id, prefix, created, last_used, scopes, profile FROM api_keys WHERE tenant_id = ? "
            "ORDER BY created", tenant_id)]

    def _key_row(self, tenant_id: str, key_id: str) -> dict | None:
        found = self.q("SELECT hash, scopes, profile FROM api_keys WHERE tenant_id = ? AND id = ?", tenant_id, key_id)
        return dict(found[0]) if found else None

    @staticmethod
    def _key_state(row: dict) -> dict:
        return {"scopes": list(key_scopes(row["scopes"])), "profile": row["profile"]}

    def revoke_key(self, tenant_id: str, key_id: str, actor: str = "system") -> bool:
        with self._lock:
            row = self._key_row(tenant_id, key_id)
            if row is not None:
                self.tx([("DELETE FROM api_keys WHERE hash = ?", (row["hash"],)),
                         self.audit_entry(tenant_id, actor, "key.revoke", key_id, row["profile"],
                                          self._key_state(row), None)])
            return row is not None

    def rotate_key(self, tenant_id: str, key_id: str, actor: str = "system") -> str | None:
        """A new key in place of `key_id`, with its scopes and binding, in one transaction (the old one stops
        working as the new one starts)."""
        with self._lock:
            row = self._key_row(tenant_id, key_id)
            if row is None:
                return None
            key, new_key_id, insert = _new_key(tenant_id, time.time(), row["scopes"], row["profile"])
            self.tx([("DELETE FROM api_keys WHERE hash = ?", (row["hash"],)), insert,
                     self.audit_entry(tenant_id, actor, "key.rotate", key_id, row["profile"], self._key_state(row),
                                      {**self._key_state(row), "id": new_key_id})])
            return key

    def update_key(self, tenant_id: str, key_id: str, scopes: tuple[str, ...] | None, profile: str | None,
                   actor: str = "system") -> dict | None:
        """Give a key new scopes and binding (None: every scope; no binding); returns its new state, None if
        there is no such key."""
        with self._lock:
            row = self._key_row(tenant_id, key_id)
            if row is None:
                return None
            stored = ",".join(scopes) if scopes is not None else None
            after = {"scopes": list(key_scopes(stored)), "profile": profile}
            if after == self._key_state(row):  # no change: nothing to record
                return after
            self.tx([("UPDATE api_keys SET scopes = ?, profile = ? WHERE hash = ?", (stored, profile, row["hash"])),
                     self.audit_entry(tenant_id, actor, "key.update", key_id, profile or row["profile"],
                                      self._key_state(row), after)])
            return after

    def bound_keys(self, tenant_id: str, profile: str | None = None) -> list[dict]:
        """The tenant's keys bound to a profile (to `profile`, when given): [{id, profile}]."""
        rows = self.q("SELECT id, profile FROM api_keys WHERE tenant_id = ? AND profile IS NOT NULL ORDER BY created",
                      tenant_id)
        return [dict(r) for r in rows if profile is None or r["profile"] == profile]

    def enforced_profile(self, tenant_id: str) -> str | None:
        return self.enforcement(tenant_id)[0]

    def enforcement(self, tenant_id: str) -> tuple[str | None, str | None]:
        """(the tenant's enforced profile, who set it: `admin` or a key id); (None, None) when none is."""
        rows = self.q("SELECT enforced_profile, enforced_by FROM tenants WHERE id = ?", tenant_id)
        return (rows[0]["enforced_profile"], rows[0]["enforced_by"]) if rows else (None, None)

    def set_enforced_profile(self, tenant_id: str, profile: str | None, actor: str = "system") -> None:
        """Make every generation of every key of the tenant use `profile` (None: no longer); a change that changes
        nothing is not recorded."""
        with self._lock:
            before, by = self.enforcement(tenant_id)
            if before == profile and (profile is None or by == actor):  # the same, set by the same: no change
                return
            self.tx([("UPDATE tenants SET enforced_profile = ?, enforced_by = ? WHERE id = ?",
                      (profile, actor if profile is not None else None, tenant_id)),
                     self.audit_entry(tenant_id, actor, "tenant.enforce", tenant_id, profile or before,
                                      {"enforced_profile": before, "by": by},
                                      {"enforced_profile": profile, "by": actor if profile is not None else None})])

    def delete_tenant(self, tenant_id: str, actor: str = "system") -> dict[str, list[tuple[str, str | None]]]:
        """Delete a tenant's rows, keys included, in one transaction; its audit trail stays, with one more entry
        saying so. Returns its datasets, heads and ASU weights as (id, digest of the file) (the caller releases
        the files and drops cached copies after). Refused (ValueError) while one of its jobs is queued or
        running."""
        with self._lock:
            active = self.q("SELECT id FROM jobs WHERE tenant_id = ? AND status IN ('queued', 'running')", tenant_id)
            if active:
                raise ValueError(f"jobs {', '.join(r['id'] for r in active)} are queued or running: cancel them first")
            owned = {table: [(r["id"], r["sha256"]) for r in self.q(f"SELECT id, sha256 FROM {table} "
                                                                   "WHERE tenant_id = ?", tenant_id)]
                     for table in FILES}
            before = {"profiles": self.profile_names(tenant_id), "keys": [k["id"] for k in self.keys(tenant_id)],
                      **{table: [i for i, _ in items] for table, items in owned.items()}}
            self.tx([self.audit_entry(tenant_id, actor, "tenant.delete", tenant_id, None, before, None)]
                    + [(f"DELETE FROM {table} WHERE tenant_id = ?", (tenant_id,))
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
        """A message as a tenant may see it: the data directory's and the blob store's paths (as given and
        resolved) masked."""
        places = {str(self.dir.resolve()), str(self.dir), self.blobs.url, self.blobs.root, str(self.blobs.cache)}
        for path in sorted(places - {"", "."}, key=len, reverse=True):
            message = message.replace(path, "<data>")
        return message

    # files: a row names its blob by sha256
    def digest(self, table: str, item_id: str) -> str | None:
        assert table in FILES
        rows = self.q(f"SELECT sha256 FROM {table} WHERE id = ?", item_id)
        return rows[0]["sha256"] if rows else None

    def file(self, table: str, item_id: str) -> Path:
        """A local path to a dataset's, head's or ASU weights' file: FileNotFoundError when the row is gone
        (deleted just now, by a request racing this one), StoredFileError when the row is there and its blob is
        missing or does not match its digest."""
        from lethe.server.blobs import BlobMissing

        kind = {"datasets": "dataset", "heads": "head", "asu_weights": "ASU weights"}[table]
        digest = self.digest(table, item_id)
        if digest is None:
            raise FileNotFoundError(f"{kind} {item_id} is gone")
        try:
            return self.blobs.path(digest)
        except BlobMissing:
            raise StoredFileError(f"the stored file of {kind} {item_id} is missing from the blob store: an "
                                  "operator must restore it") from None
        except OSError as e:
            raise StoredFileError(f"the stored file of {kind} {item_id} could not be read ({type(e).__name__}): "
                                  "an operator must check the blob store") from None

    def records(self, dataset_id: str) -> list[dict]:
        """A dataset's records, as uploaded; StoredFileError if its stored file is missing or damaged."""
        from lethe.heads.records import RecordError, read_jsonl

        try:
            return read_jsonl(self.file("datasets", dataset_id))
        except (RecordError, UnicodeDecodeError) as e:
            raise StoredFileError(f"the stored file of dataset {dataset_id} is damaged ({type(e).__name__}): an "
                                  "operator must restore it") from None

    def referenced(self) -> set[str]:
        """The digests some row names."""
        return {r["sha256"] for table in FILES for r in self.q(f"SELECT sha256 FROM {table} WHERE sha256 IS NOT NULL")}

    def _named(self, digest: str) -> bool:
        return bool(self.q(" UNION ALL ".join(f"SELECT id FROM {t} WHERE sha256 = ?" for t in FILES),
                           *([digest] * len(FILES))))

    @contextlib.contextmanager
    def holding(self, digest: str):
        """Exclusive use of one blob: "put it, insert the row naming it" against "no row names it, delete it",
        in this process (a lock per digest) and between replicas (a PostgreSQL advisory lock on the digest)."""
        with self._blob_locks[int(digest[:2], 16) % len(self._blob_locks)]:
            if self.dialect != "postgresql":
                yield
                return
            key = {"k": int(digest[:7], 16)}  # a positive int4: the two-key form is its own space of locks
            with self.engine.connect() as conn:
                conn.execute(text("SELECT pg_advisory_lock(7135, :k)"), key)
                try:
                    yield
                finally:
                    conn.execute(text("SELECT pg_advisory_unlock(7135, :k)"), key)
                    conn.commit()

    def keep_file(self, source: Path | bytes, insert: Callable[[str], None]) -> str:
        """Put a finished file (a local path, which is moved, or bytes) into the blob store and call
        `insert(digest)` to add the row naming it, holding the blob meanwhile. If `insert` raises, the blob goes
        again unless another row names it. Returns the digest."""
        from lethe.server.blobs import sha256_file

        if isinstance(source, bytes):
            staged = self.blobs.staging()
            staged.write_bytes(source)
            digest = hashlib.sha256(source).hexdigest()
        else:
            staged, digest = Path(source), sha256_file(source)
        try:
            with self.holding(digest):
                self.tx([("INSERT INTO pending_blobs VALUES (?, ?)", (digest, time.time()))])
                self.blobs.put(staged, digest)
                try:
                    insert(digest)
                except BaseException:
                    if not self._named(digest):
                        self.blobs.delete(digest)
                    raise
                finally:
                    self.tx([("DELETE FROM pending_blobs WHERE digest = ?", (digest,))])
        finally:
            staged.unlink(missing_ok=True)
        return digest

    def release(self, digest: str | None) -> bool:
        """After a row naming `digest` was deleted: delete the blob unless another row still names it. Returns
        whether it went."""
        if not digest:
            return False
        with self.holding(digest):
            if self._named(digest):
                return False
            self.blobs.delete(digest)
            return True

    def clean_blobs(self, older_than: float) -> int:
        """Remove what a crash left: blobs this database was putting when it died, if no row names them (only
        those: a blob the database never wrote, another deployment's or a newer copy's, is never touched), and
        temporary files older than `older_than` seconds. Returns how many went."""
        removed = self.blobs.clean(self.referenced(), older_than)
        cutoff = time.time() - older_than
        for row in self.q("SELECT DISTINCT digest FROM pending_blobs WHERE created <= ?", cutoff):
            removed += self.release(row["digest"])
            self.tx([("DELETE FROM pending_blobs WHERE digest = ? AND created <= ?", (row["digest"], cutoff))])
        return removed

    def adopt_files(self) -> int:
        """Copy the files of a release before blobs (`datasets/<id>.jsonl`, ...) into the blob store, name them
        in their rows, then remove the old files; returns how many. Replicas starting together may race: a file
        another one adopted first is skipped."""
        adopted = 0
        for table, (folder, suffix) in LEGACY.items():
            old = self.dir / folder
            if not old.is_dir():
                continue
            for row in self.q(f"SELECT id FROM {table}"):
                path = old / f"{row['id']}{suffix}"
                staged = self.blobs.staging()
                try:  # a copy goes in; the old file goes only once its row names the blob (a failure loses nothing)
                    shutil.copyfile(path, staged)
                    size = staged.stat().st_size
                    self.keep_file(staged, lambda digest: self.tx([(f"UPDATE {table} SET sha256 = ?, bytes = ? "
                                                                    "WHERE id = ?", (digest, size, row["id"]))]))
                except FileNotFoundError:  # another replica adopted it first
                    continue
                finally:
                    staged.unlink(missing_ok=True)
                path.unlink(missing_ok=True)
                adopted += 1
        return adopted

    # profiles
    def put_profile(self, tenant_id: str, name: str, spec: dict, note: str | None = None,
                    actor: str = "system") -> int:
        """Store `spec` as the next version of profile `name` and make it current; returns the version. Versions
        count on across delete and re-create (`profile_serials`): a version number is never given twice."""
        with self._lock:
            before = self.current_profile(tenant_id, name)
            rows = self.q("SELECT MAX(v) AS v FROM (SELECT MAX(version) AS v FROM profile_versions WHERE tenant_id = ? "
                          "AND name = ? UNION ALL SELECT version AS v FROM profile_serials WHERE tenant_id = ? "
                          "AND name = ?) AS seen", tenant_id, name, tenant_id, name)
            version = (rows[0]["v"] or 0) + 1
            self.tx([("INSERT INTO profile_versions VALUES (?, ?, ?, ?, ?, ?)",
                      (tenant_id, name, version, json.dumps(spec), time.time(), note)),
                     ("INSERT INTO profiles VALUES (?, ?, ?) ON CONFLICT (tenant_id, name) DO UPDATE SET "
                      "version = excluded.version", (tenant_id, name, version)),
                     ("INSERT INTO profile_serials VALUES (?, ?, ?) ON CONFLICT (tenant_id, name) DO UPDATE SET "
                      "version = excluded.version", (tenant_id, name, version)),
                     self.audit_entry(tenant_id, actor, "profile.set", name, name, _version_state(before),
                                      {"version": version, "spec": spec, "note": note})])
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

    def set_profile_version(self, tenant_id: str, name: str, version: int, actor: str = "system") -> None:
        """Make an earlier version current (a rollback)."""
        with self._lock:
            before = self.current_profile(tenant_id, name)
            spec = next(h["spec"] for h in self.profile_history(tenant_id, name) if h["version"] == version)
            self.tx([("UPDATE profiles SET version = ? WHERE tenant_id = ? AND name = ?", (version, tenant_id, name)),
                     self.audit_entry(tenant_id, actor, "profile.rollback", name, name, _version_state(before),
                                      {"version": version, "spec": spec})])

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

    def delete_profile(self, tenant_id: str, name: str, actor: str = "system") -> None:
        """Delete a profile and its versions; its serial stays, so a profile made again under the name goes on
        from the next version."""
        with self._lock:
            before = self.current_profile(tenant_id, name)
            self.tx([("DELETE FROM profiles WHERE tenant_id = ? AND name = ?", (tenant_id, name)),
                     ("DELETE FROM profile_versions WHERE tenant_id = ? AND name = ?", (tenant_id, name)),
                     self.audit_entry(tenant_id, actor, "profile.delete", name, name, _version_state(before), None)])

    def delete_item(self, table: str, tenant_id: str, item_id: str, actor: str = "system") -> str | None:
        """Delete a dataset's, head's or ASU weights' row (recorded in the audit trail); returns its file's
        digest (release it after)."""
        assert table in FILES
        with self._lock:
            row = self.get(table, tenant_id, item_id)
            if row is None:
                return None
            before = {k: row.get(k) for k in ("id", "name", "records", "job_id", "sha256", "bytes") if k in row}
            self.tx([(f"DELETE FROM {table} WHERE id = ? AND tenant_id = ?", (item_id, tenant_id)),
                     self.audit_entry(tenant_id, actor, f"{AUDITED_KIND[table]}.delete", item_id, None, before, None)])
            return row.get("sha256")
