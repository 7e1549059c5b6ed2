"""The engine: one worker thread that decodes queued requests together.

Requests wait in a bounded queue. Between two decoding steps the worker
prefills every waiting request (up to `max_batch_size` rows in all) and merges
it into the running `Batch`; a row that finishes leaves the batch at once
(continuous batching). Each request carries its own (head, settings) row, fixed when it was
admitted, so rows of different tenants and profile versions share a batch.
Callers get a future; a full queue raises `QueueFull`. A streaming caller gets
each new piece of text through `on_text`; a cancelled request (its client went
away) stops decoding at the next step.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

from heads.decode import Batch, Completion
from heads.guide import HeadGuide, TiltSettings
from heads.head import T3Head
from heads.modelio import LoadedModel
from heads.sampling import SamplingParams

log = logging.getLogger("lethe.engine")


class QueueFull(RuntimeError):
    pass


_WAKE = object()  # wakes an idle worker for a control command


def _is_peft(model) -> bool:
    from peft import PeftModel

    return isinstance(model, PeftModel)


@dataclass
class Pending:
    prompt: str
    params: SamplingParams
    row: tuple[T3Head, TiltSettings] | None = None
    adapter: str | None = None  # the name of an attached ASU adapter
    on_text: Callable[[str], None] | None = None
    future: Future = field(default_factory=Future)
    cancelled: threading.Event = field(default_factory=threading.Event)
    sent: int = 0  # characters already passed to on_text


class Engine:
    def __init__(self, lm: LoadedModel, max_batch_size: int = 16, max_queue: int = 256, metrics=None):
        self.lm = lm
        self.max_batch_size = max_batch_size
        self.metrics = metrics
        self.queue: queue.Queue[Pending | None] = queue.Queue(maxsize=max_queue)
        self.controls: queue.Queue[tuple[Callable, Future]] = queue.Queue()
        # held while the model's modules change (adapters attached or removed), and by a job that
        # runs the shared model outside the engine thread, so neither sees the other half-done
        self.model_lock = threading.Lock()
        self._batch: Batch | None = None
        self._thread = threading.Thread(target=self._run, name="lethe-engine", daemon=True)
        self._thread.start()

    @property
    def context_length(self) -> int:
        return int(getattr(self.lm.model.config, "max_position_embeddings", 2048))

    def count_tokens(self, text: str) -> int:
        return len(self.lm.tokenizer(text, add_special_tokens=False)["input_ids"])

    def submit(self, pending: Pending) -> Pending:
        try:
            self.queue.put_nowait(pending)
        except queue.Full:
            raise QueueFull(f"{self.queue.maxsize} requests are already waiting") from None
        if self.metrics:
            self.metrics.queue_depth.set(self.queue.qsize())
        return pending

    def control(self, fn: Callable[[], object]) -> Future:
        """Run `fn` in the engine thread between two decoding steps (model changes must not race a step)."""
        future: Future = Future()
        self.controls.put((fn, future))
        try:
            self.queue.put_nowait(_WAKE)  # an idle worker waits on the request queue
        except queue.Full:
            pass  # a full queue means a busy worker, which runs controls between steps anyway
        return future

    def base_model(self):
        """The base model without adapters, for a job to train with: the shared one while no adapter is
        attached, else a copy (made between steps)."""
        if not _is_peft(self.lm.model):
            return self.lm.model

        def copy_base():
            import copy

            return copy.deepcopy(self.lm.model).unload()

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
            self._batch.model = model
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
        self.queue.put(None)
        self._thread.join(timeout=30)

    def _take(self, block: bool, room: int) -> list[Pending] | None:
        """Up to `room` waiting requests (waiting for the first when `block`); None when told to stop."""
        group: list[Pending] = []
        while len(group) < room:
            self._run_controls()
            try:
                item = self.queue.get() if block and not group else self.queue.get_nowait()
            except queue.Empty:
                break
            if item is None:
                return None
            if item is _WAKE:
                continue
            group.append(item)
        self._run_controls()
        if self.metrics:
            self.metrics.queue_depth.set(self.queue.qsize())
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
        from heads import fused

        if fused.enabled() and self.lm.device.type == "cpu":
            fused.warm_up()  # the T3 head's CPU kernel: compiled before the first request that needs it
        batch, active = None, []
        while True:
            new = self._take(block=batch is None, room=self.max_batch_size - len(active))
            if new is None:
                break
            try:
                if new:
                    joined = self._start(new)
                    if batch is None:
                        batch, active = joined, new
                    elif batch.can_merge() and joined.can_merge():
                        batch.merge(joined)
                        active += new
                    else:  # this model's cache cannot be merged: finish the running batch first
                        self._drain(batch, active)
                        batch, active = joined, new
                self._batch = batch
                if batch is None:
                    continue
                self._step(batch, active)
                if batch.done:
                    batch, active, self._batch = None, [], None
                else:
                    active = [active[i] for i in batch.compact()]
            except Exception as e:  # a failed batch fails its requests, never the worker
                log.exception("batch of %d failed", len(active) + len(new))
                for pending in active + new:
                    if not pending.future.done():
                        pending.future.set_exception(e)
                batch, active, self._batch = None, [], None
        for pending in active:
            if not pending.future.done():
                pending.future.set_exception(RuntimeError("the server is shutting down"))

    def _start(self, group: list[Pending]) -> Batch:
        if self.metrics:
            self.metrics.batch_size.observe(len(group))
        guide = HeadGuide([p.row for p in group]) if any(p.row for p in group) else None
        adapters = [p.adapter or "__base__" for p in group] if _is_peft(self.lm.model) else None
        return Batch(self.lm.model, self.lm.tokenizer, [p.prompt for p in group], [p.params for p in group], guide,
                     adapters)

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
        for pending, row in zip(active, batch.rows):
            if pending.on_text is not None and len(row.text) > pending.sent:
                text = row.text
                if row.finish_reason is None and row.params.stop:
                    # hold back text that may be the start of a stop string
                    text = text[: max(pending.sent, len(text) - max(len(s) for s in row.params.stop) + 1)]
                if len(text) > pending.sent:
                    pending.on_text(text[pending.sent:])
                    pending.sent = len(text)
            if row.finish_reason is not None and not pending.future.done():
                completion = Completion(row.text, row.token_ids, row.finish_reason, row.prompt_tokens)
                if self.metrics:
                    self.metrics.tokens.inc(completion.completion_tokens)
                pending.future.set_result(completion)
