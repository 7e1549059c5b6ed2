"""A throwaway PostgreSQL server, for the tests and `lethe bench scale`: Debian's binaries, `initdb` in a
temporary folder, run as an unprivileged user (PostgreSQL refuses root), on 127.0.0.1 at a free port, trust
authentication, fsync off. Never for data anyone keeps."""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import socket
import subprocess
import uuid
from contextlib import contextmanager
from pathlib import Path



def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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


class PostgresServer:
    """A server with its data in `folder` (user `lethe`, trust authentication on loopback); `url` is its
    `postgres` database. `stop()` and `start()` again keep the data and the port (a restart under load)."""

    def __init__(self, folder: Path):
        self.bindir = binaries()
        assert self.bindir is not None, "PostgreSQL is not installed (Debian: apt-get install postgresql)"
        folder.mkdir(parents=True, exist_ok=True)
        if os.geteuid() == 0:
            entry = pwd.getpwnam("postgres")
            os.chown(folder, entry.pw_uid, entry.pw_gid)
        self.folder, self.data, self.port = folder, folder / "data", free_port()
        self.url = f"postgresql://lethe@127.0.0.1:{self.port}/postgres"
        subprocess.run([*_as_user(), str(self.bindir / "initdb"), "-D", str(self.data), "-U", "lethe", "--auth=trust",
                        "-E", "UTF8", "--no-sync"], check=True, capture_output=True, timeout=120)

    def start(self) -> None:
        options = f"-p {self.port} -k {self.folder} -c listen_addresses=127.0.0.1 -c fsync=off -c max_connections=200"
        subprocess.run([*_as_user(), str(self.bindir / "pg_ctl"), "-D", str(self.data), "-o", options, "-l",
                        str(self.folder / "log"), "-w", "start"], check=True, capture_output=True, timeout=120)

    def stop(self, mode: str = "fast") -> None:
        subprocess.run([*_as_user(), str(self.bindir / "pg_ctl"), "-D", str(self.data), "-m", mode, "-w", "stop"],
                       capture_output=True, timeout=120)


@contextmanager
def postgres_server(folder: Path):
    """Start a server with its data in `folder`; yields its URL. Stopped at once on exit."""
    server = PostgresServer(folder)
    server.start()
    try:
        yield server.url
    finally:
        server.stop("immediate")


def fresh_database(server_url: str) -> str:
    """A new, empty database on the server; its URL."""
    import psycopg

    name = "t_" + uuid.uuid4().hex[:12]
    with psycopg.connect(server_url, autocommit=True) as conn:
        conn.execute(f"CREATE DATABASE {name}")
    return server_url.rsplit("/", 1)[0] + "/" + name
