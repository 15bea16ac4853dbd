"""kog: batch-1 LLM decode at the memory-bandwidth limit.

Public API: `Engine` (load a model on a backend, generate, score), the plugin hook marker
`hookimpl`, and the specs/interfaces plugins implement."""
import pluggy

hookimpl = pluggy.HookimplMarker("kog")

from .errors import KogError  # noqa: E402
from .interfaces import (BackendCapabilities, BackendSpec, CancelToken, Collective, CollectiveSpec,  # noqa: E402
                         KernelBackend, ModelArchitecture, ModelArchSpec, ModelPreset, Sampler,
                         SamplerSpec, SamplingParams, StopCriteria)
from .program import DecodeProgram, Op, TensorSpec  # noqa: E402

__version__ = "0.1.0"


def __getattr__(name):  # Engine pulls in checkpoints/tokenizers: import it lazily
    if name in ("Engine", "GenerationResult"):
        from . import engine
        return getattr(engine, name)
    raise AttributeError(name)


__all__ = ["Engine", "GenerationResult", "hookimpl", "KogError", "BackendCapabilities", "BackendSpec",
           "CancelToken", "Collective", "CollectiveSpec", "KernelBackend", "ModelArchitecture",
           "ModelArchSpec", "ModelPreset", "Sampler", "SamplerSpec", "SamplingParams", "StopCriteria",
           "DecodeProgram", "Op", "TensorSpec"]
