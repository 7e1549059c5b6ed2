"""The engine: one worker thread that decodes queued requests together.

Requests wait in a bounded queue, per tenant (`scheduler.FairQueue`). Between two
decoding steps the worker prefills the waiting requests the scheduler admits (up
to `max_batch_size` rows in all, tenant by tenant, the least served first) and
merges them into the running `Batch`; a row that finishes leaves the batch at once
(continuous batching). Each request carries its own (head, settings) row, fixed when it was
admitted, so rows of different tenants and profile versions share a batch.
Callers get a future; a full queue raises `QueueFull`. A streaming caller gets
each new piece of text through `on_text`; a cancelled request (its client went
away) stops decoding at the next step.
"""

from __future__ import annotations

import asyncio
import copy
import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

from lethe.heads.decoding.decode import Batch, Completion
from lethe.heads.t3.guide import HeadGuide, TiltSettings
from lethe.heads.t3.head import T3Head
from lethe.heads.modelio import LoadedModel
from lethe.heads.decoding.sampling import SamplingParams
from lethe.server.scheduler import FairQueue, QueueFull

log = logging.getLogger("lethe.engine")


def _is_peft(model) -> bool:
    from peft import PeftModel

    return isinstance(model, PeftModel)


@dataclass
class Pending:
    prompt: str | list[int]  # text, or token ids fed as given
    params: SamplingParams
    row: tuple[T3Head, TiltSettings] | None = None
    adapter: str | None = None  # the name of an attached ASU adapter
    tenant: str | None = None  # whose request (None: anonymous callers): admission is fair between tenants
    on_text: Callable[[str, list | None], None] | None = None  # (new text, log-probabilities since the last call)
    future: Future = field(default_factory=Future)
    cancelled: threading.Event = field(default_factory=threading.Event)
    sent: int = 0  # characters already passed to on_text
    sent_logprobs: int = 0  # log-probability entries already passed to on_text
    submitted: float = field(default_factory=time.perf_counter)  # for the time-to-first-token metric
    repeat_guard: int = 0  # a row of ASU weights alone: its own repeat guard (heads.decoding.decode.Row)


def _fail_prefill(pending: "Pending", error: Exception) -> None:
    log.warning("request failed at prefill: %s: %s", type(error).__name__, error)
    pending.future.set_exception(error)


class Engine:
    def __init__(self, lm: LoadedModel, max_batch_size: int = 16, max_queue: int = 256, metrics=None,
                 max_model_len: int | None = None, decoder=None, max_rows_per_caller: int | None = None):
        """`decoder`: what decodes instead of `lm.model` (a `heads.decoding.llamacpp.LlamaCppModel`); jobs and
        the tokenizer still use `lm`. `max_rows_per_caller`: rows one tenant may hold at most (default half the
        batch; `scheduler`)."""
        self.lm, self.decoder = lm, decoder
        self.max_model_len = max_model_len
        self.max_batch_size = max_batch_size
        self.metrics = metrics
        self.queue = FairQueue(max_batch_size, max_queue, max_rows_per_caller)
        self.controls: queue.Queue[tuple[Callable, Future]] = queue.Queue()
        # A fast tokenizer keeps its padding settings in the object and changes them on every call, so two
        # threads calling one tokenizer can pad each other's batches: the engine thread decodes with its own
        # copy, other threads share `lm.tokenizer` under `tokenizer_lock`, jobs get copies (`private_copy`).
        self.tokenizer = copy.deepcopy(lm.tokenizer)
        self.tokenizer_lock = threading.Lock()
        self._batch: Batch | None = None
        # prefilled rows still waiting for their first token (kept only with metrics), by id: a request
        # prefilled again (a group retried one by one after a failed prefill) is counted once
        self._fresh: dict[int, Pending] = {}
        self._thread = threading.Thread(target=self._run, name="lethe-engine", daemon=True)
        self._thread.start()

    @property
    def context_length(self) -> int:
        """Prompt plus new tokens at most: the model's context, or less where the operator set max_model_len."""
        own = self.decoder.context if self.decoder is not None else \
            int(getattr(self.lm.model.config, "max_position_embeddings", 2048))
        return own if self.max_model_len is None else min(own, self.max_model_len)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of `text`. A fast tokenizer's own `encode_batch` runs without the interpreter's lock, and
        only the ids become a Python list: the tokenizer's `__call__` also builds attention masks and a
        BatchEncoding while holding it (for a 1 MB prompt, long enough to stall the event loop)."""
        backend = getattr(self.lm.tokenizer, "_tokenizer", None)
        with self.tokenizer_lock:
            if backend is None or backend.truncation is not None or backend.padding is not None:
                # (a call with truncation or padding left them set: the tokenizer's own call resets them)
                return self.lm.tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"]
            return backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def count_tokens(self, text: str | list[int]) -> int:
        return len(text) if not isinstance(text, str) else len(self.encode(text))

    def detokenize(self, ids: list[int]) -> str:
        with self.tokenizer_lock:
            return self.lm.tokenizer.decode(ids)

    def submit(self, pending: Pending) -> Pending:
        self.queue.put(pending)  # QueueFull: this caller holds its part of a full queue
        if self.metrics:
            self.metrics.queue_depth.set(self.queue.qsize())
        return pending

    def control(self, fn: Callable[[], object]) -> Future:
        """Run `fn` in the engine thread between two decoding steps (model changes must not race a step)."""
        future: Future = Future()
        self.controls.put((fn, future))
        self.queue.wake()  # an idle worker waits on the request queue
        return future

    def private_copy(self) -> LoadedModel:
        """The base model (no adapters) and tokenizer as copies of their own, for a job: it runs them on its
        thread for as long as it likes while the engine attaches adapters and decodes. Copied in the engine
        thread between two steps, so never half-way through an attach."""
        from dataclasses import replace

        def copy_base() -> LoadedModel:
            from lethe.heads.asu.weights import restore_base, unload

            restore_base(self.lm.model)  # never a merged adapter's weights into the copy
            model = copy.deepcopy(self.lm.model)
            if _is_peft(model):
                model = unload(model)  # and no gate hook of the served model's adapters (bound to its state)
            with self.tokenizer_lock:
                tokenizer = copy.deepcopy(self.lm.tokenizer)
            return replace(self.lm, model=model, tokenizer=tokenizer)

        return self.control(copy_base).result(timeout=600)

    @property
    def running_adapters(self) -> set[str]:
        batch = self._batch
        return set(batch.adapters or []) if batch is not None else set()

    def replace_model(self, model) -> None:
        """From the engine thread: decode with `model` (the same base, wrapped) from the next step on."""
        from dataclasses import replace

        self.lm = replace(self.lm, model=model)
        if self._batch is not None:
            self._batch.model = self._batch.runner.model = model
            if self._batch.adapters is None and _is_peft(model):
                self._batch.adapters = ["__base__"] * len(self._batch.rows)

    async def generate(self, prompt: str, params: SamplingParams,
                       row: tuple[T3Head, TiltSettings] | None = None, adapter: str | None = None) -> Completion:
        pending = self.submit(Pending(prompt, params, row, adapter))
        try:
            return await asyncio.wrap_future(pending.future)
        except asyncio.CancelledError:
            pending.cancelled.set()
            raise

    def close(self) -> None:
        self.queue.close()
        self._thread.join(timeout=30)
        if self.decoder is not None and not self._thread.is_alive():
            self.decoder.close()

    def _take(self, block: bool, active: list[Pending]) -> list[Pending] | None:
        """The waiting requests admitted to the batch beside `active` (waiting for one when `block`); None when
        told to stop."""
        self._run_controls()
        group = self.queue.take(block, self.max_batch_size - len(active), [p.tenant for p in active])
        if group is None:
            return None
        self._run_controls()
        if self.metrics:
            self.metrics.queue_depth.set(self.queue.qsize())
        for p in group:
            if p.cancelled.is_set():
                p.future.cancel()  # its client left while it waited: settle it, so what it pinned is released
        return [p for p in group if not p.cancelled.is_set() and p.future.set_running_or_notify_cancel()]

    def _run_controls(self) -> None:
        while True:
            try:
                fn, future = self.controls.get_nowait()
            except queue.Empty:
                return
            try:
                future.set_result(fn())
            except Exception as e:
                future.set_exception(e)

    def _run(self) -> None:
        """Continuous batching: new requests are prefilled and join the running batch between steps;
        finished rows leave it at once."""
        from lethe.heads.decoding.repeats import word_classes
        from lethe.heads.t3 import fused

        if fused.enabled() and self.lm.device.type == "cpu":
            fused.warm_up()  # the T3 head's CPU kernel: compiled before the first request that needs it
        word_classes(self.tokenizer)  # the repeat guard's table (about a second for 50k tokens), before any request
        batch, active = None, []
        while True:
            new = self._take(block=batch is None, active=active)
            if new is None:
                break
            joined = None
            try:
                if new:
                    joined, new = self._start_isolated(new)
                if joined is not None:
                    if batch is None:
                        batch, active = joined, new
                    elif batch.can_merge() and joined.can_merge():
                        batch.merge(joined)
                        active += new
                    else:  # this model's cache cannot be merged: finish the running batch first
                        self._drain(batch, active)
                        batch.close()
                        batch, active = joined, new
                self._batch = batch
                if batch is None:
                    continue
                self._step(batch, active)
                if batch.done:
                    batch.close()
                    batch, active, self._batch = None, [], None
                else:
                    active = [active[i] for i in batch.compact()]
            except Exception as e:  # a failed batch fails its requests, never the worker
                log.exception("batch of %d failed", len(active) + len(new))
                for pending in active + new:
                    if not pending.future.done():
                        pending.future.set_exception(e)
                for failed in (batch, joined):
                    if failed is not None:
                        failed.close()
                batch, active, self._batch = None, [], None
        for pending in active:
            if not pending.future.done():
                pending.future.set_exception(RuntimeError("the server is shutting down"))

    def _start_isolated(self, group: list[Pending]) -> tuple[Batch | None, list[Pending]]:
        """Prefill `group` together; if that raises, each request alone, so only the ones that fail alone fail
        (with their own error). Returns the batch of those that started (None if none did) and them."""
        try:
            return self._start(group), group
        except Exception as e:
            if len(group) == 1:
                _fail_prefill(group[0], e)
                return None, []
        alone = []
        for pending in group:
            try:
                alone.append((pending, self._start([pending])))
            except Exception as e:
                _fail_prefill(pending, e)
        return self._joined(alone)

    def _joined(self, alone: list[tuple[Pending, Batch]]) -> tuple[Batch | None, list[Pending]]:
        """Requests prefilled one by one, as one batch: their batches merged (not prefilled together again, which
        could fail as their group did, and that error would fail the running batch: every tenant's rows); where the
        model's cache cannot merge, prefilled together again, and if that fails they fail, the running batch going
        on."""
        started = [pending for pending, _ in alone]
        if not alone:
            return None, []
        if all(b.can_merge() for _, b in alone):
            batch = alone[0][1]
            try:
                for _, other in alone[1:]:
                    batch.merge(other)
                return batch, started
            except Exception as e:
                for pending, b in alone:
                    b.close()
                    _fail_prefill(pending, e)
                return None, []
        for _, b in alone:
            b.close()
        try:
            return self._start(started), started
        except Exception as e:
            for pending in started:
                _fail_prefill(pending, e)
            return None, []

    def _start(self, group: list[Pending]) -> Batch:
        if self.metrics:
            self.metrics.batch_size.observe(len(group))
            self._fresh.update((id(p), p) for p in group)
        guide = HeadGuide([p.row for p in group]) if any(p.row for p in group) else None
        adapters = [p.adapter or "__base__" for p in group] \
            if _is_peft(self.lm.model) or any(p.adapter for p in group) else None  # llama.cpp: where rows use one
        return Batch(self.decoder or self.lm.model, self.tokenizer, [p.prompt for p in group],
                     [p.params for p in group], guide, adapters, [p.repeat_guard for p in group])

    def _first_tokens(self, active: list[Pending]) -> None:
        """Time to first token for the fresh rows that were just stepped (their first step chose their first
        token). Fresh rows not in `active` wait in a batch behind a draining one, or failed (and are dropped)."""
        now, stepped, waiting = time.perf_counter(), {id(p) for p in active}, {}
        for key, pending in self._fresh.items():
            if id(pending) in stepped:
                if not pending.cancelled.is_set():
                    self.metrics.first_token_seconds.observe(now - pending.submitted)
            elif not pending.future.done():
                waiting[key] = pending
        self._fresh = waiting

    def _drain(self, batch: Batch, active: list[Pending]) -> None:
        while not batch.done:
            self._step(batch, active)

    def _step(self, batch: Batch, active: list[Pending]) -> None:
        """One token for every row; stream new text; settle the rows that finished."""
        for i, pending in enumerate(active):
            if pending.cancelled.is_set():
                batch.finish(i)
        if not batch.done:
            batch.step()
            if self.metrics:  # O(1) per step; O(rows) only in a step that new rows joined
                self.metrics.running_rows.observe(len(active))
                if self._fresh:
                    self._first_tokens(active)
        for pending, row in zip(active, batch.rows):
            if pending.on_text is not None and len(row.text) > pending.sent:
                text = row.text
                if row.finish_reason is None and row.params.stop:
                    # hold back text that may be the start of a stop string
                    text = text[: max(pending.sent, len(text) - max(len(s) for s in row.params.stop) + 1)]
                if len(text) > pending.sent:
                    logprobs = None if row.logprobs is None else row.logprobs[pending.sent_logprobs:]
                    pending.on_text(text[pending.sent:], logprobs)
                    pending.sent, pending.sent_logprobs = len(text), pending.sent_logprobs + len(logprobs or [])
            if row.error is not None and not pending.future.done():
                log.warning("a row failed alone: %s: %s", type(row.error).__name__, row.error)
                pending.future.set_exception(row.error)
            elif row.finish_reason is not None and not pending.future.done():
                completion = row.completion()
                if self.metrics:
                    self.metrics.tokens.inc(completion.completion_tokens)
                pending.future.set_result(completion)
