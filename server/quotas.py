"""Per-tenant quotas: what one tenant may hold and run at once, so no tenant can crowd out another.

Stored things (datasets and their bytes, heads, ASU weights) are counted from the database when something
is added; queued or running jobs likewise; generation rows in flight are counted in memory (a request holds
its row from admission until it ends, however it ends). Over a quota is 429 with a message naming the quota
and its setting; rows also say when to retry. Anonymous callers share one row quota.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from contextlib import contextmanager

from lethe.server.storage import Store


class QuotaExceeded(Exception):
    def __init__(self, message: str, retry_after: int | None = None):
        super().__init__(message)
        self.message, self.retry_after = message, retry_after


class Quotas:
    def __init__(self, store: Store, settings):
        self.store, self.settings = store, settings
        self._rows: dict[str | None, int] = {}
        self._lock = threading.Lock()
        self._tenant_locks: dict[str, threading.Lock] = {}

    @contextmanager
    def guard(self, tenant_id: str):
        """Hold while checking a quota and adding what it counts, so concurrent requests cannot both pass the
        check (one lock per tenant: tenants never wait for each other)."""
        with self._lock:
            lock = self._tenant_locks.setdefault(tenant_id, threading.Lock())
        with lock:
            yield

    def _count(self, sql: str, *args) -> int:
        return int(self.store.q(sql, *args)[0][0] or 0)

    def dataset(self, tenant_id: str, size: int) -> None:
        """Before storing a dataset of `size` bytes."""
        s = self.settings
        if self._count("SELECT COUNT(*) FROM datasets WHERE tenant_id = ?", tenant_id) >= s.quota_datasets:
            raise QuotaExceeded(f"quota: at most {s.quota_datasets} datasets per tenant (LETHE_QUOTA_DATASETS); "
                                f"delete some first")
        used = self._count("SELECT SUM(bytes) FROM datasets WHERE tenant_id = ?", tenant_id)
        if used + size > s.quota_dataset_bytes:
            raise QuotaExceeded(f"quota: datasets of at most {s.quota_dataset_bytes} bytes in all per tenant "
                                f"(LETHE_QUOTA_DATASET_BYTES); {used} are used")

    def stored(self, tenant_id: str, table: str, pending_kind: str | None = None) -> None:
        """Before adding a head or ASU weights (an upload, or a job that will make one)."""
        limit, setting = ((self.settings.quota_heads, "LETHE_QUOTA_HEADS") if table == "heads"
                          else (self.settings.quota_asu_weights, "LETHE_QUOTA_ASU_WEIGHTS"))
        held = self._count(f"SELECT COUNT(*) FROM {table} WHERE tenant_id = ?", tenant_id)
        if pending_kind is not None:  # jobs that will add one when they succeed
            held += self._count("SELECT COUNT(*) FROM jobs WHERE tenant_id = ? AND kind = ? AND status IN "
                                "('queued', 'running')", tenant_id, pending_kind)
        if held >= limit:
            what = "heads" if table == "heads" else "ASU weights"
            raise QuotaExceeded(f"quota: at most {limit} {what} per tenant ({setting}); delete some first")

    def job(self, tenant_id: str) -> None:
        """Before queueing a job."""
        limit = self.settings.quota_jobs
        active = self._count("SELECT COUNT(*) FROM jobs WHERE tenant_id = ? AND status IN ('queued', 'running')",
                             tenant_id)
        if active >= limit:
            raise QuotaExceeded(f"quota: at most {limit} queued or running jobs per tenant (LETHE_QUOTA_JOBS); "
                                f"wait for one to end or cancel one", retry_after=5)

    def row(self, tenant_id: str | None) -> Callable[[], None]:
        """Take one generation row for the caller; returns the function that gives it back (call it once)."""
        limit = self.settings.quota_rows
        with self._lock:
            held = self._rows.get(tenant_id, 0)
            if held >= limit:
                who = "anonymous callers" if tenant_id is None else "a tenant"
                raise QuotaExceeded(f"quota: at most {limit} generation requests in flight for {who} "
                                    f"(LETHE_QUOTA_ROWS)", retry_after=1)
            self._rows[tenant_id] = held + 1

        def give_back() -> None:
            with self._lock:
                self._rows[tenant_id] -= 1
                if not self._rows[tenant_id]:
                    del self._rows[tenant_id]

        return give_back
