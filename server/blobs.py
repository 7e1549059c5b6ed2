"""Dataset, head and adapter files in a blob store every replica can read, addressed by their sha256.

The store is a URL (`LETHE_BLOB_URL`): a local or shared directory by default (`<data dir>/blobs`), or any
fsspec URL (`s3://bucket/lethe`, `gs://...`, `memory://...` in tests) with that filesystem's package
installed. A blob lives at `<root>/<first two hex digits>/<sha256>`, so equal files are stored once.

Writing is atomic: a directory gets a temporary name in the same folder, fsync, then a rename (heads.io); an
object store gets the upload under a temporary key, then a move onto the final key, which readers see whole or
not at all. Files are first written locally (`staging()`), hashed, then put.

Reading gives a local path. A directory's blobs are read where they are; a remote store's are downloaded once
into this replica's cache (`LETHE_BLOB_CACHE`), checked against their digest, and kept there.

Several rows (even of different tenants) may point at one blob, so a blob goes only when no row points at it.
`Store.holding(digest)` makes "put the blob, insert its row" and "see no row names it, delete the blob" exclusive
(a lock in this process, and a PostgreSQL advisory lock between replicas), so a delete never removes a blob a
row is being added for. A store belongs to one database (`Store._claim`: its `.lethe-owner` marker holds the
database's id and a generation each start raises), since a database deletes the blobs its own rows stop naming.
"""

from __future__ import annotations

import os
import tempfile
import time
import uuid
from pathlib import Path

from lethe.heads.io import atomic_write, atomic_write_text, crash_point, sha256_file

OWNER = ".lethe-owner"  # in the store's root: "<database id> <generation>" of the database whose rows name its blobs


class BlobMissing(FileNotFoundError):
    pass


def check_blob_url(url: str) -> None:
    """A ValueError naming `url` and the reason, unless a blob store can be opened there: an unknown protocol, a
    missing fsspec package (s3fs for s3://), a path that cannot be a directory; and `memory://`, which would lose
    every file when the process stops."""
    import fsspec

    if url.startswith("memory://"):
        raise ValueError(f"blob store {url}: memory:// keeps files in this process only, and they would be lost when "
                         "it stops; use a directory or an object store")
    try:
        fs, root = fsspec.core.url_to_fs(url)
        fs.makedirs(root, exist_ok=True)
    except Exception as e:  # fsspec and its filesystems raise many kinds
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ValueError(f"blob store {url}: {reason}") from None


class BlobStore:
    def __init__(self, url: str | Path, cache_dir: Path):
        import fsspec
        from fsspec.implementations.local import LocalFileSystem

        self.url = str(url)
        self.fs, root = fsspec.core.url_to_fs(self.url)
        self.local = isinstance(self.fs, LocalFileSystem)
        self.root = root.rstrip("/")
        self.cache = Path(cache_dir)
        if self.local:
            Path(self.root).mkdir(parents=True, exist_ok=True)
            self._staging = Path(self.root) / ".staging"  # beside the blobs: a rename moves a file in
        else:
            self.fs.makedirs(self.root, exist_ok=True)
            self._staging = self.cache / ".staging"
        self._staging.mkdir(parents=True, exist_ok=True)

    def key(self, digest: str) -> str:
        if len(digest) != 64 or not all(c in "0123456789abcdef" for c in digest):
            raise ValueError(f"not a sha256 digest: {digest!r}")
        return f"{self.root}/{digest[:2]}/{digest}"

    def staging(self, suffix: str = "") -> Path:
        """A new local file name to write a blob into before `put` (which moves it)."""
        fd, name = tempfile.mkstemp(prefix=".", suffix=f"{suffix}.tmp", dir=self._staging)
        os.close(fd)
        return Path(name)

    def put(self, source: Path, digest: str | None = None) -> str:
        """Store the finished local file `source` (moved, not copied, where it can be; `digest` is its sha256 if
        known) and return its digest. A blob stored already is not written again."""
        source = Path(source)
        digest = digest or sha256_file(source)
        key = self.key(digest)
        crash_point("blob:put")
        if self.local:
            target = Path(key)
            if target.exists():
                source.unlink(missing_ok=True)
            else:
                atomic_write(target, lambda tmp: os.replace(source, tmp))
            return digest
        if not self.fs.exists(key):
            tmp = f"{key}.{uuid.uuid4().hex[:8]}.tmp"
            self.fs.put_file(str(source), tmp)
            self.fs.mv(tmp, key)
        cached = self._cached(digest)
        cached.parent.mkdir(parents=True, exist_ok=True)
        os.replace(source, cached)  # this replica wrote it: it is in its cache already
        return digest

    def _cached(self, digest: str) -> Path:
        return self.cache / digest[:2] / digest

    def path(self, digest: str) -> Path:
        """A local file holding the blob: the blob itself in a directory store, else this replica's cached copy,
        downloaded (and checked against its digest) on first use. BlobMissing if the store lacks it."""
        key = self.key(digest)
        if self.local:
            if not Path(key).is_file():
                raise BlobMissing(f"blob {digest} is missing from {self.url}")
            return Path(key)
        cached = self._cached(digest)
        if cached.is_file():
            return cached

        def fetch(tmp: Path) -> None:
            try:
                self.fs.get_file(key, str(tmp))
            except FileNotFoundError:
                raise BlobMissing(f"blob {digest} is missing from {self.url}") from None
            if sha256_file(tmp) != digest:
                raise OSError(f"blob {digest} from {self.url} does not match its digest (corrupt or changed)")

        atomic_write(cached, fetch)
        return cached

    def exists(self, digest: str) -> bool:
        key = self.key(digest)
        return Path(key).is_file() if self.local else self.fs.exists(key)

    def owner(self) -> tuple[str, int] | None:
        """(database id, generation) from the store's marker, None if it has none yet."""
        marker = f"{self.root}/{OWNER}"
        try:
            text = Path(marker).read_text() if self.local else self.fs.cat_file(marker).decode()
        except FileNotFoundError:
            return None
        owner, _, generation = text.strip().partition(" ")
        return owner, int(generation or 0)

    def set_owner(self, owner: str, generation: int, first: bool) -> None:
        """Write the marker; `first`: it must not exist yet (an exclusive create, so of two databases claiming a
        new store at once one gets FileExistsError; object stores have no exclusive create, and take the last)."""
        marker, text = f"{self.root}/{OWNER}", f"{owner} {generation}\n"
        if not self.local:
            self.fs.pipe_file(marker, text.encode())
        elif first:
            fd = os.open(marker, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            with os.fdopen(fd, "w") as f:
                f.write(text)
                f.flush()
                os.fsync(f.fileno())
        else:
            atomic_write_text(Path(marker), text)

    def delete(self, digest: str) -> None:
        key = self.key(digest)
        if self.local:
            Path(key).unlink(missing_ok=True)
        else:
            try:
                self.fs.rm(key)
            except FileNotFoundError:
                pass
        self._cached(digest).unlink(missing_ok=True)

    def digests(self) -> set[str]:
        """Every blob in the store."""
        if self.local:
            found = (p.name for p in Path(self.root).glob("??/*"))
        else:
            found = (k.rsplit("/", 1)[-1] for k in self.fs.glob(f"{self.root}/??/*"))
        return {d for d in found if len(d) == 64 and not d.endswith(".tmp")}

    def clean(self, referenced: set[str], older_than: float) -> int:
        """Remove temporary files older than `older_than` seconds (an interrupted write's; a younger one may be
        another replica's write in progress) and cached copies of blobs no row names (`referenced` are the ones
        rows name). Returns how many temporary files went."""
        removed, now = 0, time.time()
        local_tmp = [*self._staging.glob(".*.tmp"), *self.cache.glob("??/.*.tmp")]
        if self.local:
            local_tmp += Path(self.root).glob("??/.*.tmp")
        for tmp in local_tmp:
            try:
                if now - tmp.stat().st_mtime >= older_than:
                    tmp.unlink(missing_ok=True)
                    removed += 1
            except FileNotFoundError:
                pass
        if not self.local:
            for tmp in self.fs.glob(f"{self.root}/??/*.tmp"):
                try:
                    young = now - self.fs.modified(tmp).timestamp() < older_than
                except (FileNotFoundError, NotImplementedError):
                    young = False
                if not young:
                    self.fs.rm(tmp)
                    removed += 1
        for cached in self.cache.glob("??/*"):
            if cached.name not in referenced and not cached.name.endswith(".tmp"):
                cached.unlink(missing_ok=True)
        return removed
