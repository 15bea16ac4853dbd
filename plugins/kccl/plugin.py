"""Registers kccl's CPU collectives. Imports nothing heavy.

A collective factory takes the number of ranks and returns a group indexable by rank:
`group = factory(R); group[r]` is rank r's `Collective`."""
from kog_core import CollectiveSpec, hookimpl


@hookimpl
def register_collectives(register):
    register(CollectiveSpec(name="cpu_threads", factory="kog_kccl.threads:ThreadGroup",
                            description="ranks as threads of one process (rendezvous per tag and call)"))
    register(CollectiveSpec(name="cpu_processes", factory="kog_kccl.processes:ProcessGroup",
                            description="ranks as processes on one machine (shared memory + barrier)"))
