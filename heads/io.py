"""Atomic file writes: write to a temporary name in the same folder, fsync, rename.

A crash leaves either the old file or the new one, never half of one.
"""

from __future__ import annotations

import hashlib
import os
import signal
import tempfile
from collections.abc import Callable
from pathlib import Path


def crash_point(name: str) -> None:
    """Fault injection for the crash-consistency tests: with LETHE_CRASH_AT=<name> (or a comma-separated list
    of names) in the environment, the process kills itself (SIGKILL, as `kill -9`) when it reaches this point.
    Unset, it does nothing."""
    if name in os.environ.get("LETHE_CRASH_AT", "").split(","):
        os.kill(os.getpid(), signal.SIGKILL)


def crash_after_tokens() -> int | None:
    """With `decode:N` in LETHE_CRASH_AT: the answer length at which the decode loop kills its process (a replica
    dying mid-stream, for the fault tests); read once per batch, so the loop's check is one comparison."""
    for name in os.environ.get("LETHE_CRASH_AT", "").split(","):
        if name.startswith("decode:") and name[7:].isdigit():
            return int(name[7:])
    return None


def atomic_write(path: Path, write: Callable[[Path], None]) -> None:
    """Call `write(tmp_path)`, then move the finished file onto `path`."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    tmp_path = Path(tmp)
    try:
        write(tmp_path)
        with open(tmp_path, "rb+") as f:
            os.fsync(f.fileno())
        crash_point(f"before-rename:{path.parent.name}")
        os.replace(tmp_path, path)
    except BaseException:
        tmp_path.unlink(missing_ok=True)
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def atomic_write_bytes(path: Path, data: bytes) -> None:
    atomic_write(path, lambda tmp: tmp.write_bytes(data))


def atomic_write_text(path: Path, text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


def sha256_file(path: str | Path) -> str:
    """A file's sha256, hex, read a MiB at a time."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()
