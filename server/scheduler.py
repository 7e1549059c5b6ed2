"""Fair admission: which waiting requests join the running batch, tenant by tenant.

Requests wait per tenant (anonymous callers together are one more tenant). When the batch has room, the tenant
holding the fewest rows in it goes first (ties: the one whose oldest request has waited longest), one row at a
time, so a tenant with one request waits for about one free row, never behind another tenant's backlog.

A tenant gets rows up to its part of the batch, `max_batch // (tenants present + 1)` (room for one more tenant),
before any tenant gets more. Rows nobody else is waiting for go to whoever wants them, up to `per_caller`
(LETHE_MAX_ROWS_PER_CALLER, default half the batch) and leaving an eighth of the batch (`reserve`, 2 of 16 rows)
free, so a newcomer joins at the next step instead of waiting for a long answer to end. Rows are never taken back
from a running batch: a tenant above its part (others arrived) gets no new row until it is below it again or the
others want none. On CPU cores the decoding step's cost grows with the rows in it (SmolLM2-135M on 2 cores: 76 ms
a step at 1 row, 165 ms at 8, 189 ms at 16; the demo's 5.8 ms at 1, 13.2 ms at 9), so `per_caller` is where an
operator trades one caller's throughput for the others' latency: the whole batch lets a tenant alone fill it (but
for the reserve), and a short request beside it then took 2.9-5.3x its time alone on the demo, against 2.3-2.6x at
the default (`lethe bench fairness`).

The queue is bounded: once `max_queue` requests wait, a tenant already holding its part of the queue
(`max_queue // tenants waiting`) is refused (`QueueFull`, 429 with Retry-After); a tenant with less still
gets in, so one caller's backlog cannot refuse everyone else.
"""

from __future__ import annotations

import threading
from collections import Counter, deque
from collections.abc import Iterable
from typing import Protocol


class QueueFull(RuntimeError):
    pass


class Waiting(Protocol):
    tenant: str | None
    submitted: float


def part_of(max_batch: int, present: int, per_caller: int | None = None) -> int:
    """The rows one tenant may hold while `present` (at least 1) tenants have rows or requests, whoever else
    waits: room is kept for one more tenant, and never more than `per_caller`."""
    return max(1, min(per_caller or max_batch, max_batch // (present + 1)))


def reserve(max_batch: int) -> int:
    """Rows kept free for a newcomer while a tenant takes rows beyond its part."""
    return max_batch // 8


def pick(waiting: dict[str | None, deque], active: Counter, room: int, max_batch: int,
         per_caller: int | None = None) -> list:
    """Up to `room` requests from the heads of the per-tenant queues `waiting` (taken off them), given the rows
    each tenant has in the batch (`active`). Pure apart from popping what it picks."""
    active, picked = Counter(active), []
    while len(picked) < room:
        candidates = [t for t, q in waiting.items() if q]
        present = len(set(candidates) | {t for t, n in active.items() if n > 0})
        part = part_of(max_batch, present, per_caller)
        eligible = [t for t in candidates if active[t] < part]
        if not eligible and room - len(picked) > reserve(max_batch):  # rows beyond a part: nobody below it waits
            eligible = [t for t in candidates if active[t] < (per_caller or max_batch)]
        if not eligible:
            break
        tenant = min(eligible, key=lambda t: (active[t], waiting[t][0].submitted))
        picked.append(waiting[tenant].popleft())
        active[tenant] += 1
    return picked


class FairQueue:
    """The engine's queue of waiting requests, per tenant (see the module's docstring)."""

    def __init__(self, max_batch: int, max_queue: int, per_caller: int | None = None):
        self.max_batch, self.maxsize = max_batch, max_queue
        self.per_caller = per_caller or max(1, max_batch // 2)
        self._waiting: dict[str | None, deque] = {}
        self._cond = threading.Condition()
        self._woken = self._closed = False

    def put(self, item: Waiting) -> None:
        with self._cond:
            mine = len(self._waiting.get(item.tenant, ()))
            total = self.qsize()
            if total >= self.maxsize:
                tenants = len({t for t, q in self._waiting.items() if q} | {item.tenant})
                part = max(1, self.maxsize // tenants)
                if mine >= part:
                    raise QueueFull(f"{total} requests are waiting, {mine} of them this caller's (its part of "
                                    f"the queue of {self.maxsize} is {part})")
            self._waiting.setdefault(item.tenant, deque()).append(item)
            self._cond.notify()

    def qsize(self) -> int:
        return sum(len(q) for q in self._waiting.values())

    def wake(self) -> None:
        """Make a waiting `take` return (the engine has a control command to run)."""
        with self._cond:
            self._woken = True
            self._cond.notify()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify()

    def take(self, block: bool, room: int, active: Iterable[str | None]) -> list | None:
        """Requests to admit now (see `pick`), given the tenants of the rows in the batch; with `block`, waits
        until there is one, or `wake`. None once closed."""
        with self._cond:
            while True:
                if self._closed:
                    return None
                for tenant in [t for t, q in self._waiting.items() if not q]:
                    del self._waiting[tenant]  # tenants without waiting requests are not kept
                picked = pick(self._waiting, Counter(active), room, self.max_batch, self.per_caller)
                if picked or not block or self._woken:
                    self._woken = False
                    return picked
                self._cond.wait()
