"""Runs one backend per rank, each in its own thread, behind the KernelBackend interface.

Rank r holds lanes [r*L/R, (r+1)*L/R); the ranks meet in the program's `collective` ops through
a collective plugin (e.g. kccl's cpu_threads). Rank 0's logits are the result."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Mapping

import numpy as np

from .errors import KogError
from .interfaces import KernelBackend


class MultiRankBackend(KernelBackend):
    name = "multirank"

    def __init__(self, registry, backend_name: str, options: dict, program, weights: Mapping[str, np.ndarray],
                 ranks: int, collective_name: str):
        super().__init__()
        if program.lanes % ranks:
            raise KogError(f"{ranks} ranks do not divide the model's {program.lanes} lanes; pick a divisor of {program.lanes}")
        group = registry.collective(collective_name, world_size=ranks)  # unknown name: one-line PluginError
        self.program, self.ranks = program, ranks
        self.backends = [registry.create_backend(backend_name, **options) for _ in range(ranks)]
        self.capabilities = self.backends[0].capabilities
        self.pool = ThreadPoolExecutor(max_workers=ranks, thread_name_prefix="kog-rank")
        self._all(lambda r, b: b.load(program, weights, rank=r, ranks=ranks, collective=group[r]))

    def _all(self, fn):
        futures = [self.pool.submit(fn, r, b) for r, b in enumerate(self.backends)]
        results = [f.result() for f in futures]
        return results[0]

    def load(self, program, weights, *, rank=0, ranks=1, collective=None):  # done in __init__
        raise NotImplementedError

    def reset(self):
        self._all(lambda r, b: b.reset())

    def step(self, token: int, pos: int) -> np.ndarray:
        return self._all(lambda r, b: b.step(token, pos))

    def close(self):
        self.pool.shutdown(wait=False)

    def describe(self) -> dict:
        return {"backend": self.backends[0].name, "ranks": self.ranks}
