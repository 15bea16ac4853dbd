"""One worker thread runs the engine, one request at a time (batch 1), from a bounded FIFO queue.

The engine is synchronous and CPU/GPU-bound, so it never runs on the event loop: each request is
a `Job` whose chunks the worker hands to the request's asyncio.Queue with
`loop.call_soon_threadsafe`. Cancelling a job (its client went away) sets its CancelToken, which
the backend polls before every token, and the worker stops consuming and closes the engine's
generator at once; a job cancelled while still queued is dropped from the queue. Every backend
`generate` starts with `reset()`, so nothing of one request leaks into the next."""
from __future__ import annotations

import asyncio
import collections
import logging
import math
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from ..interfaces import CancelToken
from .metrics import Metrics

log = logging.getLogger("kog.server")

END = object()   # posted last on every job's queue


class QueueFull(Exception):
    def __init__(self, retry_after: int):
        super().__init__(f"retry after {retry_after}s")
        self.retry_after = retry_after


@dataclass(eq=False)
class Job:
    id: str
    endpoint: str
    prompt_ids: list[int]
    params: dict[str, Any]                      # engine.stream keyword arguments
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancel: CancelToken = field(default_factory=CancelToken)
    t_arrival: float = field(default_factory=time.perf_counter)
    t_start: float | None = None
    gone: bool = False                          # the client went away (the engine also sets
                                                # `cancel` itself when a stop string is hit)

    def post(self, item) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the event loop is closed (server shutting down)
            pass


class Scheduler:
    def __init__(self, engine, queue_size: int, metrics: Metrics):
        self.engine, self.queue_size, self.metrics = engine, queue_size, metrics
        self._waiting: collections.deque[Job] = collections.deque()
        self._running: Job | None = None
        self._cv = threading.Condition()
        self._closing = False
        self._avg_job_s = 5.0
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------ event-loop side
    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._worker, name="kog-engine", daemon=True)
            self._thread.start()

    def submit(self, job: Job) -> None:
        """Queue a job, or raise QueueFull (the caller answers 429 with Retry-After)."""
        with self._cv:
            if self._closing or len(self._waiting) >= self.queue_size:
                ahead = len(self._waiting) + (1 if self._running else 0)
                raise QueueFull(max(1, min(600, math.ceil(self._avg_job_s * ahead))))
            self._waiting.append(job)
            self._gauges()
            self._cv.notify()

    def cancel(self, job: Job) -> None:
        """The client is gone: stop the job now (running) or drop it (queued)."""
        job.gone = True
        job.cancel.cancel()
        with self._cv:
            if job in self._waiting:
                self._waiting.remove(job)
                self._gauges()
                log.info("req %s cancelled while queued (client disconnected)", job.id)
                self.metrics.observe_finished(0, 0, "cancelled", time.perf_counter() - job.t_arrival,
                                              time.perf_counter() - job.t_arrival)

    def depth(self) -> tuple[int, int]:
        with self._cv:
            return len(self._waiting), (1 if self._running else 0)

    def close(self, timeout: float = 5.0) -> None:
        with self._cv:
            self._closing = True
            for job in self._waiting:
                job.gone = True
                job.cancel.cancel()
                job.post(END)
            self._waiting.clear()
            if self._running is not None:
                self._running.gone = True
                self._running.cancel.cancel()
            self._cv.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)

    # ------------------------------------------------------------------ worker side
    def _gauges(self) -> None:  # under self._cv
        self.metrics.set_queue(len(self._waiting), 1 if self._running else 0)

    def _worker(self) -> None:
        while True:
            with self._cv:
                while not self._waiting and not self._closing:
                    self._cv.wait()
                if self._closing:
                    return
                job = self._waiting.popleft()
                self._running = job
                self._gauges()
            try:
                self._execute(job)
            except BaseException:  # never let the worker die; _execute reports errors itself
                log.exception("req %s: worker error", job.id)
            finally:
                job.post(END)
                with self._cv:
                    self._running = None
                    self._gauges()

    def _execute(self, job: Job) -> None:
        job.t_start = time.perf_counter()
        queue_s = job.t_start - job.t_arrival
        if job.gone:
            return
        result, t_last = None, None
        gen = self.engine.stream(job.prompt_ids, chat=False, cancel=job.cancel, **job.params)
        try:
            for chunk in gen:
                if job.gone:
                    break
                now = time.perf_counter()
                if chunk.token_ids:
                    if t_last is not None:
                        self.metrics.observe_inter_token(now - t_last)
                    t_last = now
                if chunk.result is not None:
                    result = chunk.result
                job.post(chunk)
        except Exception as e:  # noqa: BLE001 - reported to the client as an error body
            log.exception("req %s failed", job.id)
            job.post(e)
            return
        finally:
            gen.close()
        t_end = time.perf_counter()
        total = t_end - job.t_arrival
        self._avg_job_s = 0.8 * self._avg_job_s + 0.2 * (t_end - job.t_start)
        if result is None or job.gone:
            n_out = result.completion_tokens if result else 0
            self.metrics.observe_finished(len(job.prompt_ids), n_out, "cancelled", queue_s, total)
            log.info("req %s %s: cancelled (client disconnected) after %.2fs; %d prompt tokens, %d generated",
                     job.id, job.endpoint, t_end - job.t_start, len(job.prompt_ids), n_out)
            return
        self.metrics.observe_first_token(queue_s + result.ttft_s)
        self.metrics.observe_finished(result.prompt_tokens, result.completion_tokens, result.finish_reason,
                                      queue_s, total)
        log.info("req %s %s: %d prompt (%d cached) + %d completion tokens, queue %.3fs, TTFT %.3fs, %.1f tok/s, "
                 "finish %s, total %.2fs", job.id, job.endpoint, result.prompt_tokens, result.cached_tokens,
                 result.completion_tokens,
                 queue_s, queue_s + result.ttft_s, result.decode_tok_s, result.finish_reason, total)
