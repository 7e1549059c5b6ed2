"""The engine: one worker thread that decodes queued requests together.

Requests wait in a bounded queue; the worker takes every waiting request (up to
`max_batch_size`) into one `Batch` and decodes it to the end, then takes the
next group. Each request carries its own (head, settings) row, fixed when it was
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


@dataclass
class Pending:
    prompt: str
    params: SamplingParams
    row: tuple[T3Head, TiltSettings] | None = None
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

    async def generate(self, prompt: str, params: SamplingParams,
                       row: tuple[T3Head, TiltSettings] | None = None) -> Completion:
        pending = self.submit(Pending(prompt, params, row))
        try:
            return await asyncio.wrap_future(pending.future)
        except asyncio.CancelledError:
            pending.cancelled.set()
            raise

    def close(self) -> None:
        self.queue.put(None)
        self._thread.join(timeout=30)

    def _take_group(self) -> list[Pending] | None:
        first = self.queue.get()
        if first is None:
            return None
        group = [first]
        while len(group) < self.max_batch_size:
            try:
                item = self.queue.get_nowait()
            except queue.Empty:
                break
            if item is None:
                self.queue.put(None)  # leave the stop signal for the outer loop
                break
            group.append(item)
        if self.metrics:
            self.metrics.queue_depth.set(self.queue.qsize())
        return [p for p in group if not p.cancelled.is_set() and p.future.set_running_or_notify_cancel()]

    def _run(self) -> None:
        while (group := self._take_group()) is not None:
            if not group:
                continue
            try:
                self._decode(group)
            except Exception as e:  # a failed batch fails its requests, never the worker
                log.exception("batch of %d failed", len(group))
                for pending in group:
                    if not pending.future.done():
                        pending.future.set_exception(e)

    def _decode(self, group: list[Pending]) -> None:
        if self.metrics:
            self.metrics.batch_size.observe(len(group))
        guide = HeadGuide([p.row for p in group]) if any(p.row for p in group) else None
        batch = Batch(self.lm.model, self.lm.tokenizer, [p.prompt for p in group], [p.params for p in group], guide)
        while not batch.done:
            batch.step()
            for i, (pending, row) in enumerate(zip(group, batch.rows)):
                if pending.cancelled.is_set():
                    batch.finish(i)
                elif pending.on_text is not None and len(row.text) > pending.sent:
                    if row.finish_reason is None and row.params.stop:
                        # hold back text that may be the start of a stop string
                        safe = len(row.text) - max(len(s) for s in row.params.stop) + 1
                        if safe <= pending.sent:
                            continue
                        delta = row.text[pending.sent:safe]
                    else:
                        delta = row.text[pending.sent:]
                    pending.sent += len(delta)
                    pending.on_text(delta)
        for pending, completion in zip(group, batch.completions()):
            if pending.on_text is not None and len(completion.text) > pending.sent:
                pending.on_text(completion.text[pending.sent:])
                pending.sent = len(completion.text)
            if self.metrics:
                self.metrics.tokens.inc(completion.completion_tokens)
            pending.future.set_result(completion)
