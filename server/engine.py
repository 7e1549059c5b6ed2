"""The engine: one worker thread that decodes queued requests together.

Requests wait in a bounded queue; the worker takes every waiting request (up to
`max_batch_size`) into one `Batch` and decodes it to the end, then takes the
next group. Callers get a future; a full queue raises `QueueFull`.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from concurrent.futures import Future
from dataclasses import dataclass, field

from heads.decode import Batch, Completion
from heads.modelio import LoadedModel
from heads.sampling import SamplingParams

log = logging.getLogger("lethe.engine")


class QueueFull(RuntimeError):
    pass


@dataclass
class Pending:
    prompt: str
    params: SamplingParams
    future: Future = field(default_factory=Future)


class Engine:
    def __init__(self, lm: LoadedModel, max_batch_size: int = 16, max_queue: int = 256):
        self.lm = lm
        self.max_batch_size = max_batch_size
        self.queue: queue.Queue[Pending | None] = queue.Queue(maxsize=max_queue)
        self._thread = threading.Thread(target=self._run, name="lethe-engine", daemon=True)
        self._thread.start()

    @property
    def context_length(self) -> int:
        return int(getattr(self.lm.model.config, "max_position_embeddings", 2048))

    def count_tokens(self, text: str) -> int:
        return len(self.lm.tokenizer(text, add_special_tokens=False)["input_ids"])

    def submit(self, prompt: str, params: SamplingParams) -> Future:
        item = Pending(prompt, params)
        try:
            self.queue.put_nowait(item)
        except queue.Full:
            raise QueueFull(f"{self.queue.maxsize} requests are already waiting") from None
        return item.future

    async def generate(self, prompt: str, params: SamplingParams) -> Completion:
        return await asyncio.wrap_future(self.submit(prompt, params))

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
        return [p for p in group if p.future.set_running_or_notify_cancel()]

    def _run(self) -> None:
        while (group := self._take_group()) is not None:
            if not group:
                continue
            try:
                batch = Batch(self.lm.model, self.lm.tokenizer, [p.prompt for p in group], [p.params for p in group])
                while not batch.done:
                    batch.step()
                for pending, completion in zip(group, batch.completions()):
                    pending.future.set_result(completion)
            except Exception as e:  # a failed batch fails its requests, never the worker
                log.exception("batch of %d failed", len(group))
                for pending in group:
                    if not pending.future.done():
                        pending.future.set_exception(e)
