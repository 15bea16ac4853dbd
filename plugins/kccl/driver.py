"""Run one decode program on R ranks of a CPU backend, each rank holding L/R lanes.

    logits = run_ranks(program, weights, 2, lambda b: b.logits(ids))

creates R backends (the reference backend unless told otherwise), loads rank r with its lanes
and its end of the collective, runs fn(backend) on every rank at once (threads named
kccl-rank-<r>, or processes with processes=True) and returns rank 0's result, or every
rank's with all_results=True. A failing rank aborts the collective so the others stop too,
and its exception is raised here."""
from __future__ import annotations

import multiprocessing as mp
import threading
import traceback
from typing import Any, Callable, Mapping

import numpy as np


def _make_backend(name: str, program, weights, rank: int, ranks: int, collective):
    from kog_core.plugins import load_registry
    backend = load_registry().create_backend(name)
    backend.load(program, weights, rank=rank, ranks=ranks, collective=collective)
    return backend


def run_ranks(program, weights: Mapping[str, np.ndarray], ranks: int, fn: Callable[[Any], Any], *,
              backend: str = "reference", processes: bool = False, all_results: bool = False):
    if program.lanes % ranks:
        raise ValueError(f"{ranks} ranks do not divide the program's {program.lanes} lanes")
    runner = _run_processes if processes else _run_threads
    results = runner(program, weights, ranks, fn, backend)
    return results if all_results else results[0]


def _run_threads(program, weights, ranks, fn, backend):
    from .threads import ThreadGroup
    group = ThreadGroup(ranks)
    results: list[Any] = [None] * ranks
    errors: list[BaseException | None] = [None] * ranks

    def rank_main(r: int):
        try:
            results[r] = fn(_make_backend(backend, program, weights, r, ranks, group[r]))
        except BaseException as e:  # noqa: BLE001 - reported below, with the rank
            errors[r] = e
            group.abort(f"rank {r} failed: {type(e).__name__}: {e}")

    threads = [threading.Thread(target=rank_main, args=(r,), name=f"kccl-rank-{r}") for r in range(ranks)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    _raise_first(errors)
    return results


def _run_processes(program, weights, ranks, fn, backend):
    from .processes import ProcessGroup
    ctx = mp.get_context("fork")  # ranks inherit program, weights and fn without pickling
    group = ProcessGroup(ranks, context=ctx)
    queue = ctx.Queue()

    def rank_main(r: int):
        try:
            queue.put((r, fn(_make_backend(backend, program, weights, r, ranks, group[r])), None))
        except BaseException as e:  # noqa: BLE001
            group.abort()
            queue.put((r, None, f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))

    procs = [ctx.Process(target=rank_main, args=(r,), name=f"kccl-rank-{r}") for r in range(ranks)]
    try:
        for p in procs:
            p.start()
        results: list[Any] = [None] * ranks
        errors: list[BaseException | None] = [None] * ranks
        for _ in range(ranks):
            r, result, error = queue.get(timeout=group.timeout_s)
            results[r] = result
            errors[r] = RuntimeError(f"rank {r} failed: {error}") if error else None
        for p in procs:
            p.join()
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        group.close()
    _raise_first(errors)
    return results


def _raise_first(errors):
    # The first failure in rank order that is not just another rank's abort notice.
    from threading import BrokenBarrierError
    from .threads import CollectiveAborted
    real = [e for e in errors if e is not None and not isinstance(e, (CollectiveAborted, BrokenBarrierError))]
    first = real[0] if real else next((e for e in errors if e is not None), None)
    if first is not None:
        raise first
