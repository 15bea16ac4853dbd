"""kccl: CPU collectives (threads and processes) and the rank driver."""
from __future__ import annotations

import threading

import numpy as np
import pytest

from kog_core.interfaces import Collective, resolve_factory
from kog_core.plugins import load_registry
from kog_kccl.driver import run_ranks
from kog_kccl.processes import ProcessGroup
from kog_kccl.threads import ThreadGroup


def _exchange_pattern(coll: Collective):
    """Several tags, each used several times, interleaved, with 2 rows per rank."""
    out = []
    for step in range(3):
        for tag in ("a", "b"):
            local = np.full((2, 3), 100 * step + 10 * coll.rank + (tag == "b"), np.float32)
            out.append(coll.all_gather(tag, local))
    return out


def _expected(world):
    out = []
    for step in range(3):
        for tag in ("a", "b"):
            out.append(np.concatenate([np.full((2, 3), 100 * step + 10 * r + (tag == "b"), np.float32)
                                       for r in range(world)]))
    return out


def _threads(group, fn):
    results = [None] * len(group)

    def main(r):
        results[r] = fn(group[r])

    ts = [threading.Thread(target=main, args=(r,), name=f"test-rank-{r}") for r in range(len(group))]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    return results


def test_registered():
    reg = load_registry()
    assert {"cpu_threads", "cpu_processes"} <= set(reg.collectives)
    group = resolve_factory(reg.collectives["cpu_threads"].factory)(3)
    assert len(group) == 3 and isinstance(group[2], Collective) and group[2].rank == 2


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_thread_all_gather(world):
    got = _threads(ThreadGroup(world), _exchange_pattern)
    for r in range(world):
        for g, e in zip(got[r], _expected(world)):
            assert np.array_equal(g, e)


def test_process_group_in_threads():
    group = ProcessGroup(3, capacity=1024)
    try:
        got = _threads(group, _exchange_pattern)
    finally:
        group.close()
    for r in range(3):
        assert all(np.array_equal(g, e) for g, e in zip(got[r], _expected(3)))


def test_process_group_capacity():
    group = ProcessGroup(2, capacity=16)
    try:
        with pytest.raises(ValueError, match="capacity"):
            group[0].all_gather("x", np.zeros(8, np.float32))
    finally:
        group.close()


def test_failing_rank_aborts_the_others():
    group = ThreadGroup(2, timeout_s=30)

    def fn(coll):
        if coll.rank == 1:
            group.abort("rank 1 failed")
            raise RuntimeError("boom")
        coll.all_gather("t", np.zeros(1, np.float32))

    errors = []

    def main(r):
        try:
            fn(group[r])
        except Exception as e:
            errors.append(type(e))

    ts = [threading.Thread(target=main, args=(r,)) for r in range(2)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(timeout=10)
    assert sorted(e.__name__ for e in errors) == ["CollectiveAborted", "RuntimeError"]


def _small_laneformer():
    from kog_laneformer.model import Laneformer
    arch = Laneformer(dict(model_type="laneformer_tp", hidden_size=32, num_hidden_layers=3, num_attention_heads=4,
                           num_key_value_heads=4, intermediate_size=32, vocab_size=16, max_position_embeddings=16,
                           num_lanes=4, broadcast_delay=1))
    return arch.lower(), arch.random_weights(3)


def test_run_ranks_reports_the_failing_rank():
    prog, w = _small_laneformer()

    def fn(backend):
        if backend.rank == 1:
            raise KeyError("rank one broke")
        return backend.logits([1, 2, 3])

    with pytest.raises(KeyError, match="rank one broke"):
        run_ranks(prog, w, 2, fn)
    with pytest.raises(ValueError, match="do not divide"):
        run_ranks(prog, w, 3, fn)


def test_run_ranks_threads_and_processes_agree():
    prog, w = _small_laneformer()
    one = run_ranks(prog, w, 1, lambda b: b.logits([1, 2, 3, 4]))
    names = run_ranks(prog, w, 2, lambda b: threading.current_thread().name, all_results=True)
    assert names == ["kccl-rank-0", "kccl-rank-1"]
    for ranks in (2, 4):
        assert np.array_equal(run_ranks(prog, w, ranks, lambda b: b.logits([1, 2, 3, 4])), one)
    assert np.array_equal(run_ranks(prog, w, 2, lambda b: b.logits([1, 2, 3, 4]), processes=True), one)


def test_engine_multirank_backend():
    """The core's MultiRankBackend drives the cpu_threads collective (when it is installed)."""
    multirank = pytest.importorskip("kog_core.multirank")
    prog, w = _small_laneformer()
    reg = load_registry()
    backend = multirank.MultiRankBackend(reg, "reference", {}, prog, w, 4, "cpu_threads")
    try:
        got = backend.logits([1, 2, 3, 4])
    finally:
        backend.close()
    assert np.array_equal(got, run_ranks(prog, w, 1, lambda b: b.logits([1, 2, 3, 4])))
