"""Turns between running jobs: one computes at a time, and a job of another tenant gets its turn within `turn`
seconds instead of waiting for a long job to end.

Each job runs on a thread of its own and holds the turn while it computes. At every progress report it calls
`checkpoint`: once it has held the turn for `turn` seconds and another job waits, it hands the turn over and
waits at the back of the line. A job's running time (`used`) counts its turns only, so a job's time budget is
not spent while it waits.
"""

from __future__ import annotations

import threading
import time
from collections import deque


class Turns:
    def __init__(self, turn: float):
        self.turn = turn
        self._cond = threading.Condition()
        self._holder: str | None = None
        self._line: deque[str] = deque()
        self._since = 0.0
        self._used: dict[str, float] = {}

    def take(self, job: str) -> None:
        """Wait in line for the turn, then hold it."""
        with self._cond:
            self._line.append(job)
            while self._holder is not None or self._line[0] != job:
                self._cond.wait()
            self._line.popleft()
            self._holder, self._since = job, time.monotonic()

    def give(self, job: str) -> None:
        """Hand the turn back (the job ended, or yields); the next in line takes it."""
        with self._cond:
            if self._holder == job:
                self._used[job] = self.used(job)
                self._holder = None
                self._cond.notify_all()

    def checkpoint(self, job: str) -> None:
        """Between two pieces of a job's work: yield to a waiting job once this one's turn is over."""
        with self._cond:
            over = self._holder == job and self._line and time.monotonic() - self._since >= self.turn
        if over:
            self.give(job)
            self.take(job)

    def used(self, job: str) -> float:
        """Seconds `job` has held the turn so far."""
        held = time.monotonic() - self._since if self._holder == job else 0.0
        return self._used.get(job, 0.0) + held

    def forget(self, job: str) -> None:
        self.give(job)
        with self._cond:
            self._used.pop(job, None)
