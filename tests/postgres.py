"""A PostgreSQL server of the tests' own: Debian's binaries, `initdb` in a temporary folder, run as an
unprivileged user (PostgreSQL refuses root), listening on 127.0.0.1 at a free port."""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import subprocess
import uuid
from contextlib import contextmanager
from pathlib import Path

from live_server import free_port


def binaries() -> Path | None:
    """The folder of initdb and pg_ctl (Debian keeps them off PATH, under /usr/lib/postgresql/N/bin)."""
    found = shutil.which("initdb")
    if found:
        return Path(os.path.realpath(found)).parent
    versions = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"))
    return Path(versions[-1]).parent if versions else None


def _as_user() -> list[str]:
    """A prefix that runs a command as an unprivileged user when we are root (Debian's `postgres`)."""
    if os.geteuid() != 0:
        return []
    return ["runuser", "-u", "postgres", "--"]


@contextmanager
def postgres_server(folder: Path):
    """Start a server with its data in `folder`; yields a URL of its `postgres` database (user `lethe`, trust
    authentication on loopback). Stopped, fast, on exit."""
    bindir = binaries()
    assert bindir is not None, "PostgreSQL is not installed (Debian: apt-get install postgresql)"
    folder.mkdir(parents=True, exist_ok=True)
    if os.geteuid() == 0:
        entry = pwd.getpwnam("postgres")
        os.chown(folder, entry.pw_uid, entry.pw_gid)
    data, port = folder / "data", free_port()
    run = _as_user()
    subprocess.run([*run, str(bindir / "initdb"), "-D", str(data), "-U", "lethe", "--auth=trust", "-E", "UTF8",
                    "--no-sync"], check=True, capture_output=True, timeout=120)
    options = f"-p {port} -k {folder} -c listen_addresses=127.0.0.1 -c fsync=off -c max_connections=200"
    subprocess.run([*run, str(bindir / "pg_ctl"), "-D", str(data), "-o", options, "-l", str(folder / "log"), "-w",
                    "start"], check=True, capture_output=True, timeout=120)
    try:
        yield f"postgresql://lethe@127.0.0.1:{port}/postgres"
    finally:
        subprocess.run([*run, str(bindir / "pg_ctl"), "-D", str(data), "-m", "immediate", "-w", "stop"],
                       capture_output=True, timeout=120)


def fresh_database(server_url: str) -> str:
    """A new, empty database on the server; its URL."""
    import psycopg

    name = "t_" + uuid.uuid4().hex[:12]
    with psycopg.connect(server_url, autocommit=True) as conn:
        conn.execute(f"CREATE DATABASE {name}")
    return server_url.rsplit("/", 1)[0] + "/" + name
