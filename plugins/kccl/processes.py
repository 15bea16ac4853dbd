"""All-gather between ranks that are processes on one machine.

One shared-memory segment holds a slot of `capacity` bytes per rank, each with a small
header (tag checksum, byte count). all_gather: write my slot, barrier, copy every slot,
barrier (nobody overwrites a slot before every rank has read it). Two barriers per call keep
it simple and obviously correct; the parts are small (a few lanes of one partial).

Create the group in the parent before starting the rank processes (fork or spawn); each
process uses `group[rank]`."""
from __future__ import annotations

import multiprocessing as mp
import struct
import zlib
from multiprocessing import shared_memory

import numpy as np

from kog_core.interfaces import Collective

_HEADER = struct.Struct("<IQ")     # crc32 of the tag, payload bytes
_HEADER_BYTES = 64                 # keep payloads 64-byte aligned


class ProcessGroup:
    """Shared memory + barrier for R process ranks; `group[r]` is rank r's Collective."""

    def __init__(self, world_size: int, capacity: int = 8 << 20, timeout_s: float = 600.0, context=None):
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        ctx = context or mp.get_context()
        self.world_size, self.capacity, self.timeout_s = world_size, capacity, timeout_s
        self.stride = _HEADER_BYTES + capacity
        self.shm = shared_memory.SharedMemory(create=True, size=world_size * self.stride)
        self.barrier = ctx.Barrier(world_size, timeout=timeout_s)

    def __getitem__(self, rank: int) -> "ProcessCollective":
        if not 0 <= rank < self.world_size:
            raise IndexError(rank)
        coll = ProcessCollective(self.shm.name, self.barrier, rank, self.world_size, self.capacity, self.stride)
        coll._shm = self.shm  # a forked rank uses the inherited mapping; a spawned one re-attaches by name
        return coll

    def __len__(self) -> int:
        return self.world_size

    def abort(self, reason: str = "") -> None:
        self.barrier.abort()

    def close(self) -> None:
        self.shm.close()
        self.shm.unlink()


class ProcessCollective(Collective):
    def __init__(self, shm_name, barrier, rank, world_size, capacity, stride):
        self.shm_name, self._barrier, self.rank, self.world_size = shm_name, barrier, rank, world_size
        self.capacity, self.stride = capacity, stride
        self._shm = None

    def __getstate__(self):  # picklable for spawn: re-attach the segment by name
        state = dict(self.__dict__)
        state["_shm"] = None
        return state

    @property
    def buf(self) -> memoryview:
        if self._shm is None:
            self._shm = shared_memory.SharedMemory(name=self.shm_name)
        return self._shm.buf

    def all_gather(self, tag: str, local: np.ndarray) -> np.ndarray:
        local = np.ascontiguousarray(local)
        if self.world_size == 1:
            return local.copy()
        if local.nbytes > self.capacity:
            raise ValueError(f"all_gather {tag!r}: {local.nbytes} bytes exceed the slot capacity {self.capacity}")
        crc, buf = zlib.crc32(tag.encode()), self.buf
        base = self.rank * self.stride
        _HEADER.pack_into(buf, base, crc, local.nbytes)
        buf[base + _HEADER_BYTES: base + _HEADER_BYTES + local.nbytes] = local.reshape(-1).view(np.uint8)
        self._barrier.wait()
        parts = []
        for r in range(self.world_size):
            base = r * self.stride
            their_crc, nbytes = _HEADER.unpack_from(buf, base)
            if their_crc != crc or nbytes != local.nbytes:
                self._barrier.abort()
                raise RuntimeError(f"rank {self.rank}: all_gather {tag!r} met rank {r} at a different "
                                   f"exchange ({nbytes} bytes); the ranks ran different programs")
            raw = np.frombuffer(buf, np.uint8, nbytes, base + _HEADER_BYTES)
            parts.append(raw.view(local.dtype).reshape(local.shape).copy())
        self._barrier.wait()
        return np.concatenate(parts, axis=0)

    def barrier(self) -> None:
        self._barrier.wait()
