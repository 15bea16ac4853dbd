"""All-gather between ranks that are threads of one process.

Every rank calls the collectives of a program in the same order, so the n-th call with a
given tag on every rank is the same exchange: the rendezvous key is (tag, n). A rank drops
its part in the slot for that key and waits until all R parts are there; the last rank to
read a slot deletes it. A rank that fails calls `abort`, so the others raise instead of
waiting forever."""
from __future__ import annotations

import threading
from collections import defaultdict

import numpy as np

from kog_core.interfaces import Collective


class CollectiveAborted(RuntimeError):
    pass


class _Slot:
    __slots__ = ("parts", "arrived", "read")

    def __init__(self, world_size: int):
        self.parts: list[np.ndarray | None] = [None] * world_size
        self.arrived = 0
        self.read = 0


class ThreadGroup:
    """The shared rendezvous of R thread ranks; `group[r]` is rank r's Collective."""

    def __init__(self, world_size: int, timeout_s: float = 600.0):
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        self.world_size, self.timeout_s = world_size, timeout_s
        self.cond = threading.Condition()
        self.slots: dict[tuple[str, int], _Slot] = {}
        self.aborted: str | None = None
        self.ranks = [ThreadCollective(self, r) for r in range(world_size)]

    def __getitem__(self, rank: int) -> "ThreadCollective":
        return self.ranks[rank]

    def __len__(self) -> int:
        return self.world_size

    def abort(self, reason: str) -> None:
        with self.cond:
            self.aborted = reason
            self.cond.notify_all()

    def exchange(self, key: tuple[str, int], rank: int, local: np.ndarray) -> list[np.ndarray]:
        R = self.world_size
        with self.cond:
            slot = self.slots.setdefault(key, _Slot(R))
            slot.parts[rank] = local
            slot.arrived += 1
            if slot.arrived == R:
                self.cond.notify_all()
            elif not self.cond.wait_for(lambda: slot.arrived == R or self.aborted, self.timeout_s):
                raise CollectiveAborted(f"rank {rank}: all_gather {key[0]!r} timed out after {self.timeout_s} s "
                                        f"({slot.arrived} of {R} ranks arrived)")
            if self.aborted:
                raise CollectiveAborted(f"rank {rank}: all_gather {key[0]!r} aborted: {self.aborted}")
            parts = list(slot.parts)
            slot.read += 1
            if slot.read == R:
                del self.slots[key]
        return parts


class ThreadCollective(Collective):
    def __init__(self, group: ThreadGroup, rank: int):
        self.group, self.rank, self.world_size = group, rank, group.world_size
        self.calls: dict[str, int] = defaultdict(int)   # per tag: how many exchanges so far

    def all_gather(self, tag: str, local: np.ndarray) -> np.ndarray:
        if self.world_size == 1:
            return np.array(local, copy=True)
        n = self.calls[tag]
        self.calls[tag] = n + 1
        parts = self.group.exchange((tag, n), self.rank, np.array(local, copy=True))
        return np.concatenate(parts, axis=0)

    def barrier(self) -> None:
        self.all_gather("__barrier__", np.zeros(1, np.float32))
