"""Training jobs: queued in SQLite, started fairly across tenants, computing one at a time in turns.

The worker thread starts the queued job of the tenant served longest ago on a thread of its own, and a second
one (`slots`) of another tenant while the first runs: the two take turns of `turn` seconds (`job_turns.Turns`),
so a tenant's short job starts within a turn however long another tenant's job is. A job's time budget counts
its own turns only.

A job moves through queued -> running (phases: caching, fitting, calibrating, evaluating, saving; for ASU:
copying, distilling, saving) -> succeeded, failed or cancelled. Progress (0-1) and metrics are written to its row, which `GET /v1/jobs/{id}` and the
event stream read. The head file is written atomically before its row is inserted, so a crash
leaves either no head or a complete one.

Replicas sharing a database (PostgreSQL) share the queue: a worker claims a queued job with one conditional
UPDATE, so exactly one runs it, and writes a heartbeat while it runs. A job whose heartbeat stopped (its
worker died) is marked failed by whichever worker notices; on SQLite, the only process, a job still running
at start-up is marked failed at once.

Where the job runs: on this process's job thread (one process), or, given `dispatch` (replicas on Ray Serve),
in a process of its own that `dispatch` starts (a Ray task with its own CPU/GPU reservation, which loads the
model itself: `server.ray_serve.job_dispatcher`), so a job never shares a serving replica's cores. Either way
the job's process runs `execute`: heartbeat, progress, cancel and the job's result all go through the
database, so a job's events stream from any replica as before.
"""

from __future__ import annotations

import json
import logging
import queue
import threading
import time
from collections.abc import Callable

from lethe.heads.t3.guide import TiltSettings
from lethe.heads.t3.head import save_head
from lethe.heads.io import crash_point
from lethe.heads.t3.pipeline import quick_check, train_head
from lethe.heads.t3.train import FitConfig
from lethe.server.job_turns import Turns
from lethe.server.storage import Store, new_id

log = logging.getLogger("lethe.jobs")
TERMINAL = ("succeeded", "failed", "cancelled")
HEARTBEAT = 5.0  # seconds between a running job's heartbeats (and its checks for a cancel asked elsewhere)
CANCEL_ASKED = "cancel requested"  # a running job's error while its worker has not yet stopped it
STALE = 60.0  # a running job without a heartbeat for this long lost its worker


class Cancelled(Exception):
    pass


class OwnModel:
    """The model of a process that runs jobs only (a Ray task): the job may use it as it is (`JobRunner`'s
    `engine` is else the serving engine, whose model a job only ever copies)."""

    decoder = None  # what the replicas decode with instead of lm.model: nothing (Ray's replicas serve on torch)

    def __init__(self, lm):
        self.lm = lm

    def private_copy(self):
        return self.lm


class JobRunner:
    def __init__(self, store: Store, engine, metrics=None, heads=None, stale: float = STALE,
                 dispatch: Callable[[dict], str] | None = None, worker: bool = True, budget: float = 3600.0,
                 turn: float = 20.0, slots: int = 2):
        """`dispatch(job)`: run a claimed job elsewhere and return its final status (None: on this process's job
        threads). `worker=False`: no queue and no thread, only `execute` (a job's own process). `budget`: seconds
        a job may run (its turns only) before it is stopped and failed (LETHE_MAX_JOB_SECONDS). `turn`: seconds a
        job computes before a waiting one of another tenant takes over (LETHE_JOB_TURN_SECONDS); `slots`: jobs
        started at once, of different tenants (LETHE_JOB_SLOTS)."""
        self.store, self.engine, self.metrics, self.heads = store, engine, metrics, heads
        self.stale = stale  # seconds without a heartbeat after which a running job's worker is taken for dead
        self.budget = budget
        self._over: set[str] = set()  # running jobs stopped for their time budget
        self.dispatch = dispatch
        self.queue: queue.Queue[str | None] = queue.Queue()
        self._cancel: dict[str, threading.Event] = {}
        self._last_start: dict[str, float] = {}  # tenant -> when its last job started (fair turns)
        # a job dispatched elsewhere (a Ray task) waits for its own CPUs there: one at a time per replica, as before
        self._turns, self.slots = Turns(turn), slots if dispatch is None else 1
        self._running: dict[str, tuple[str, threading.Thread]] = {}  # job id -> (tenant, its thread), started here
        self._thread = threading.Thread(target=self._run, name="lethe-jobs", daemon=True)
        if worker:
            self._recover()
            self._thread.start()

    def _recover(self) -> None:
        self.fail_stale(0.0 if not self.store.shared else self.stale)
        for row in self.store.q("SELECT id FROM jobs WHERE status = 'queued' ORDER BY created"):
            self.queue.put(row["id"])

    def fail_stale(self, after: float) -> int:
        """Mark failed the running jobs whose worker stopped: no heartbeat for `after` seconds (0: every running
        job, for a process that is the only one to run them). Returns how many. Never a job started here whose
        thread still runs it: a job dispatched to a process that died is failed by that thread, saying why."""
        now = time.time()
        own = list(self._running)  # started here and still running: their threads say so
        mine = f" AND id NOT IN ({', '.join('?' * len(own))})" if own else ""
        return self.store.tx([("UPDATE jobs SET status = 'failed', error = ?, finished = ? WHERE status = 'running' "
                               "AND COALESCE(heartbeat, started, created) < ?" + mine,
                               ("the server stopped while the job was running", now, now - after, *own))])

    def submit(self, tenant_id: str, kind: str, params: dict) -> str:
        job_id = new_id("job")
        self.store.tx([("INSERT INTO jobs (id, tenant_id, kind, status, phase, progress, params, created) "
                        "VALUES (?, ?, ?, 'queued', 'queued', 0, ?, ?)",
                        (job_id, tenant_id, kind, json.dumps(params), time.time()))])
        self.queue.put(job_id)
        return job_id

    def cancel(self, tenant_id: str, job_id: str) -> bool:
        """Cancel a queued or running job; False when it had already ended. A job running on another replica
        (a shared database) reads the request at its next heartbeat and stops there."""
        job = self.store.get("jobs", tenant_id, job_id)
        if job is None or job["status"] in TERMINAL:
            return False
        if job_id in self._cancel:  # running here: at its next progress report
            self._cancel[job_id].set()
        if job["status"] == "queued" and self.store.tx([(
                "UPDATE jobs SET status = 'cancelled', error = ?, finished = ? WHERE id = ? AND status = 'queued'",
                ("cancelled before it started", time.time(), job_id))]) == 1:
            return True
        # running (here, or on another replica: it was claimed as we looked)
        self.store.tx([("UPDATE jobs SET error = ? WHERE id = ? AND status = 'running'", (CANCEL_ASKED, job_id))])
        return True

    def close(self) -> None:
        for event in self._cancel.values():
            event.set()
        if self._thread.is_alive():
            self.queue.put(None)
            self._thread.join(timeout=30)
        for _, thread in list(self._running.values()):
            thread.join(timeout=30)

    def _update(self, job_id: str, **fields) -> None:
        cols = ", ".join(f"{k} = ?" for k in fields)
        self.store.tx([(f"UPDATE jobs SET {cols} WHERE id = ?", (*fields.values(), job_id))])

    def _finish(self, job_id: str, status: str, **fields) -> None:
        self._update(job_id, status=status, finished=time.time(), **fields)

    def _next(self) -> dict | None:
        """The queued job to start next, fairly across tenants: the oldest job of the tenant whose last job
        started longest ago (a tenant never served first), so a tenant with many queued jobs takes turns with
        the others instead of going first with all of them; never a second job of a tenant whose job runs here."""
        busy = {tenant for tenant, _ in list(self._running.values())}
        queued = [j for j in self.store.q("SELECT * FROM jobs WHERE status = 'queued' ORDER BY created")
                  if j["tenant_id"] not in busy]
        if not queued:
            return None
        return dict(min(queued, key=lambda j: (self._last_start.get(j["tenant_id"], 0.0), j["created"])))

    def _claim(self, job_id: str, now: float) -> bool:
        """Take a queued job for this worker; False if another worker (a replica) took it first."""
        return self.store.tx([("UPDATE jobs SET status = 'running', started = ?, heartbeat = ?, phase = 'caching', "
                               "progress = 0 WHERE id = ? AND status = 'queued'", (now, now, job_id))]) == 1

    def _heartbeat(self, job_id: str) -> None:
        self.store.tx([("UPDATE jobs SET heartbeat = ? WHERE id = ? AND status = 'running'", (time.time(), job_id))])

    def _beat(self, job_id: str, done: threading.Event, cancel: threading.Event) -> None:
        """While the job runs: its heartbeat, a cancel asked through another replica passed on to it, and its
        time budget (past it, the job is stopped as a cancel stops it, and failed)."""
        while not done.wait(min(HEARTBEAT, self.stale / 4, self.budget)):
            if self._turns.used(job_id) > self.budget:
                self._over.add(job_id)
                cancel.set()
            try:
                self._heartbeat(job_id)
                if self.store.q("SELECT id FROM jobs WHERE id = ? AND error = ?", job_id, CANCEL_ASKED):
                    cancel.set()
            except Exception:  # a database that is away for a moment: the next beat tries again
                log.warning("heartbeat of job %s not written", job_id, exc_info=True)

    def _run(self) -> None:
        while True:
            try:
                item = self.queue.get(timeout=self.stale / 2)
            except queue.Empty:  # idle: fail the jobs whose worker died (another replica's, on a shared database)
                if self.store.shared:
                    try:
                        self.fail_stale(self.stale)
                        if self.store.q("SELECT id FROM jobs WHERE status = 'queued' LIMIT 1"):
                            self.queue.put("")  # queued by a replica that died before it ran them
                    except Exception:  # the database is away for a moment: the next round tries again
                        log.warning("could not check for stale or queued jobs", exc_info=True)
                continue
            if item is None:
                return
            try:
                self._start_jobs()
            except Exception:  # the database is away for a moment: the next wake-up or idle round tries again
                log.warning("could not start queued jobs", exc_info=True)

    def _start_jobs(self) -> None:
        """Start queued jobs on threads of their own while slots are free (one per tenant at a time)."""
        while len(self._running) < self.slots:
            started = time.time()
            while True:  # which job runs is chosen here, and claimed (another replica may claim it first)
                job = self._next()
                if job is None or self._claim(job["id"], started):
                    break
            if job is None:
                return
            self._last_start[job["tenant_id"]] = started
            thread = threading.Thread(target=self._job_thread, args=(job, started), name=f"lethe-job-{job['id']}",
                                      daemon=True)
            self._running[job["id"]] = (job["tenant_id"], thread)
            thread.start()

    def _job_thread(self, job: dict, started: float) -> None:
        try:
            status = self.execute(job) if self.dispatch is None else self._dispatched(job)
            if self.metrics:
                self.metrics.job_seconds.labels(job["kind"], status).observe(time.time() - started)
        finally:
            self._running.pop(job["id"], None)
            self.queue.put("")  # a slot is free: the worker starts the next queued job

    def execute(self, job: dict) -> str:
        """Run a claimed job to its end in this process, with its heartbeat; returns its final status."""
        job_id = job["id"]
        cancel = self._cancel.setdefault(job_id, threading.Event())
        beating = threading.Event()
        threading.Thread(target=self._beat, args=(job_id, beating, cancel), name="lethe-job-heartbeat",
                         daemon=True).start()
        try:
            self._turns.take(job_id)  # computes only in its turn
            {"asu": self._train_asu, "eval": self._evaluate}.get(job["kind"], self._train)(job, cancel)
            return "succeeded"
        except Cancelled:
            if job_id in self._over:
                self._finish(job_id, "failed", error=f"stopped after its time budget of {self.budget:g} s "
                                                     "(LETHE_MAX_JOB_SECONDS): ask for fewer steps or epochs, or "
                                                     "smaller sets")
                return "failed"
            self._finish(job_id, "cancelled", error="cancelled while running")
            return "cancelled"
        except Exception as e:
            log.exception("job %s failed", job_id)
            self._finish(job_id, "failed", error=self._public(f"{type(e).__name__}: {e}"))
            return "failed"
        finally:
            self._turns.forget(job_id)
            beating.set()
            self._cancel.pop(job_id, None)
            self._over.discard(job_id)

    def _dispatched(self, job: dict) -> str:
        """Run a claimed job through `dispatch`; a job whose process died (or could not start) is failed at once,
        with the reason, unless it ended first. This replica beats for the job while it waits: the task's process
        beats only once it has started and loaded its model, which on a busy machine (or a cluster waiting for free
        CPUs) takes longer than the stale limit; the task dies with this replica (Ray fate-shares a task with its
        owner), so a job whose replica died still goes stale."""
        waiting = threading.Event()
        threading.Thread(target=self._beat_dispatched, args=(job["id"], waiting), daemon=True,
                         name="lethe-job-dispatch-heartbeat").start()
        try:
            return self.dispatch(job)
        except Exception as e:
            log.warning("job %s: its process stopped: %s", job["id"], e)
            reason = self._public(str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__)
            self.store.tx([("UPDATE jobs SET status = 'failed', error = ?, finished = ? WHERE id = ? AND status = "
                            "'running'", (f"the job's worker stopped while the job was running ({reason})", time.time(),
                             job["id"]))])
            return "failed"
        finally:
            waiting.set()

    def _beat_dispatched(self, job_id: str, done: threading.Event) -> None:
        """The dispatching replica's heartbeat for a job: until its task ends, or for the job's time budget at most
        (a task that never started by then is taken for lost: the beat stops and the stale check fails the job)."""
        until = time.monotonic() + self.budget
        while not done.wait(min(HEARTBEAT, self.stale / 4)) and time.monotonic() < until:
            try:
                self._heartbeat(job_id)
            except Exception:  # a database that is away for a moment: the next beat tries again
                log.warning("heartbeat of job %s not written", job_id, exc_info=True)

    def _public(self, message: str) -> str:
        """A job's error as its tenant may see it: no server paths."""
        model = str(getattr(self.engine.lm, "path", "") or "")
        message = self.store.public(message)
        return message.replace(model, "<model>") if model not in ("", ".") else message

    def _progress(self, job_id: str, cancel: threading.Event, spans: dict[str, tuple[float, float]]):
        """A callback `(phase, fraction)` that writes the overall progress and raises when cancelled."""
        last = [0.0]

        def progress(phase: str, fraction: float) -> None:
            crash_point(f"job:{phase}")
            if cancel.is_set():
                raise Cancelled()
            self._turns.checkpoint(job_id)  # another tenant's job may take a turn here
            lo, hi = spans[phase]
            overall = lo + (hi - lo) * fraction
            if overall - last[0] >= 0.02 or fraction >= 1:
                last[0] = overall
                self._update(job_id, phase=phase, progress=round(overall, 3))

        return progress

    def _inputs(self, job: dict) -> tuple[dict, list[dict], list[dict]]:
        params = json.loads(job["params"])
        return params, self.store.records(params["forget"]), self.store.records(params["retain"])

    def _private(self):
        """The base model and tokenizer as copies of the job's own (`Engine.private_copy`): a job never holds a
        lock the engine needs, and never shares a tokenizer with another thread."""
        return self.engine.private_copy()

    def _save_result(self, job_id: str, tenant_id: str, table: str, item_id: str, write, info: dict,
                     metrics: dict) -> None:
        """Write the job's file into the blob store, then, in one transaction, its row and the job's success."""
        self._update(job_id, phase="saving", progress=0.95)
        staged = self.store.blobs.staging()
        try:
            write(staged)
            size = staged.stat().st_size
            self.store.keep_file(staged, lambda digest: self.store.tx([
                (f"INSERT INTO {table} VALUES (?, ?, ?, ?, ?, ?, ?)",
                 (item_id, tenant_id, job_id, size, json.dumps(info), time.time(), digest)),
                ("UPDATE jobs SET status = 'succeeded', phase = 'done', progress = 1, metrics = ?, result = ?, "
                 "finished = ? WHERE id = ?", (json.dumps(metrics), item_id, time.time(), job_id))]))
        finally:
            staged.unlink(missing_ok=True)

    def _evaluate(self, job: dict, cancel: threading.Event) -> None:
        from dataclasses import replace

        from lethe.heads.asu.weights import attach, load_asu
        from lethe.heads.evaluation.evaluate import EvalConfig, Profile, evaluate
        from lethe.server.profiles import asu_repeat_guard

        job_id, tenant_id = job["id"], job["tenant_id"]
        params, forget, retain = self._inputs(job)
        spec = params["spec"]
        head = settings = None
        if spec.get("head"):
            head, _ = self.heads.get(tenant_id, spec["head"])
            settings = TiltSettings.from_dict({k: spec[k] for k in TiltSettings.names() if k in spec})
        self._update(job_id, phase="evaluating", progress=0.05)

        lm = self._private()
        if spec.get("backend") == "asu":  # the adapter goes onto the job's copy, never onto the serving model
            tensors, info = load_asu(self.store.file("asu_weights", spec["weights"]), self.engine.lm.fingerprint)
            lm = replace(lm, model=attach(lm.model, "asu_eval", tensors, info))
        def check() -> None:
            if cancel.is_set():
                raise Cancelled()
            self._turns.checkpoint(job_id)

        cfg = EvalConfig(seeds=tuple(params.get("seeds", [])), max_new_tokens=params.get("max_new_tokens", 64),
                         format=params.get("format", "auto"), check=check)
        # its rows decode as served: the adapter per row (gate latch, routing) and their own repeat guard
        profile = Profile(params.get("profile") or "inline", head, settings,
                          "asu_eval" if spec.get("backend") == "asu" else None, asu_repeat_guard(spec))
        report = evaluate(lm, forget, retain, profile, cfg=cfg)
        if cancel.is_set():
            raise Cancelled()
        report.pop("forget_truth_ratios", None)
        self._finish(job_id, "succeeded", phase="done", progress=1.0, metrics=json.dumps(report))

    def _train(self, job: dict, cancel: threading.Event) -> None:
        job_id, tenant_id = job["id"], job["tenant_id"]
        params, forget, retain = self._inputs(job)
        progress = self._progress(job_id, cancel, {"caching": (0.0, 0.45), "fitting": (0.45, 0.8),
                                                    "calibrating": (0.8, 0.85), "evaluating": (0.85, 0.95)})
        cfg = FitConfig(**{k: params[k] for k in ("rank", "lr", "weight_decay", "max_epochs", "balance",
                                                   "common_df", "seed", "format", "pooling_window", "answer_forms",
                                                   "fact_spans", "contexts", "context_shift", "gate_answers",
                                                   "cache_precision")
                           if k in params})
        lm = self._private()
        head, info = train_head(lm, forget, retain, cfg, progress=False, on_progress=progress)
        progress("evaluating", 0.0)
        # as a profile of this head serves it: the head's recommended settings (its calibrated head_gate)
        info.metrics |= quick_check(lm, head, forget, retain, fmt=cfg.format,
                                    settings=TiltSettings.from_dict(info.profile))
        del lm
        if cancel.is_set():
            raise Cancelled()
        self._save_result(job_id, tenant_id, "heads", new_id("head"), lambda path: save_head(path, head, info),
                          info.__dict__, info.metrics)

    def _train_asu(self, job: dict, cancel: threading.Event) -> None:
        from lethe.heads.asu.distill import train_asu
        from lethe.heads.asu.presets import FIELDS, configure, preset_of, record
        from lethe.heads.asu.weights import save_asu

        job_id, tenant_id = job["id"], job["tenant_id"]
        params, forget, retain = self._inputs(job)
        progress = self._progress(job_id, cancel, {"copying": (0.0, 0.05), "teacher": (0.05, 0.2),
                                                   "distilling": (0.2, 0.95)})
        progress("copying", 0.0)
        lm = self._private()  # training injects LoRA layers into the model it is given: never the serving one
        preset, said = preset_of(params), {}  # said: greedy answers the teacher decodes, which training reuses
        cfg, teacher = configure(lm, forget, {k: params.get(k) for k in FIELDS}, preset,
                                 on_progress=lambda f: progress("teacher", f),
                                 gate_servable=self.engine.decoder is None, memo=said)  # llama.cpp: no gate
        tensors, info = train_asu(lm, forget, retain, cfg, progress=False,
                                  on_progress=lambda f: progress("distilling", f), memo=said)
        record(info, preset, teacher)
        del lm
        if cancel.is_set():
            raise Cancelled()
        from dataclasses import asdict

        self._save_result(job_id, tenant_id, "asu_weights", new_id("asu"),
                          lambda path: save_asu(path, tensors, info), asdict(info), info.metrics)
