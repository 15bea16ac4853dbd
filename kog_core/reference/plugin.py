"""Registers the CPU reference backend and the default sampler."""
from kog_core import BackendCapabilities, BackendSpec, SamplerSpec, hookimpl
from kog_core.program import OP_KINDS


@hookimpl
def register_backends(register):
    register(BackendSpec(
        name="reference",
        factory="kog_core.reference.backend:ReferenceBackend",
        capabilities=BackendCapabilities(devices=("cpu",), dtypes=frozenset({"f32", "bf16", "f16"}),
                                         ops=OP_KINDS, max_lanes=64, max_ranks=64, prefix_reuse=True),
        description="numpy float32 on the CPU; the correctness oracle",
        priority=0,
    ))


@hookimpl
def register_samplers(register):
    register(SamplerSpec(name="default", factory="kog_core.sampling:DefaultSampler",
                         description="greedy / temperature / top-k / top-p with a counter-based RNG"))
