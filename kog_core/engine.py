"""Engine: ties config, plugins, checkpoint, tokenizer and backend together.

    from kog_core import Engine
    engine = Engine.load(model="smollm2-135m")            # best available backend
    print(engine.generate("What is the capital of France?").text)
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Iterator, Sequence, Union

import numpy as np

from .config import KogConfig, load_config
from .errors import CapabilityError, CheckpointError, ContextLengthExceeded, KogError
from .interfaces import CancelToken, ModelArchitecture, ModelPreset, SamplingParams, StopCriteria, resolve_factory
from .plugins import Registry, load_registry
from .stopping import StopStringMatcher

Prompt = Union[str, Sequence[int], Sequence[dict]]
DEFAULT_MAX_CONTEXT = 8192


@dataclass
class GenerationResult:
    token_ids: list[int]
    text: str
    finish_reason: str            # "stop" (EOS / stop token / stop string), "length", "cancelled"
    prompt_tokens: int
    ttft_s: float                 # request start -> first new token
    decode_tok_s: float           # new tokens after the first, per second
    total_s: float
    cached_tokens: int = 0        # prompt tokens whose KV cache the previous request left (not run again)

    @property
    def completion_tokens(self) -> int:
        return len(self.token_ids)

    def timings(self) -> dict:
        return {"prompt_tokens": self.prompt_tokens, "cached_tokens": self.cached_tokens,
                "completion_tokens": self.completion_tokens, "ttft_s": round(self.ttft_s, 6),
                "decode_tok_s": round(self.decode_tok_s, 3), "total_s": round(self.total_s, 6)}


@dataclass
class StreamChunk:
    text: str                                 # new text (stop strings held back until resolved)
    token_ids: list[int] = field(default_factory=list)
    result: GenerationResult | None = None    # set on the last chunk only


class Engine:
    def __init__(self, config: KogConfig, registry: Registry, architecture: ModelArchitecture, program,
                 backend, tokenizer, preset: ModelPreset | None, model_path: str | None, load_s: float):
        self.config, self.registry = config, registry
        self.architecture, self.program, self.backend = architecture, program, backend
        self.tokenizer, self.preset, self.model_path, self.load_s = tokenizer, preset, model_path, load_s
        self.sampler = registry.sampler("default")
        # Prefix reuse: the tokens whose KV cache entries (positions 0 .. n-1) the backend still
        # holds from the last request; a prompt that starts with them runs only what follows.
        self.prefix_reuse = backend.capabilities.prefix_reuse
        self._kv_tokens: list[int] = []

    # ------------------------------------------------------------------ loading
    @classmethod
    def load(cls, model: str | None = None, backend: str | None = None, config: str | KogConfig | None = None, *,
             random_weights: bool | None = None, context_length: int | None = None, ranks: int | None = None,
             progress: bool = False, **backend_options) -> "Engine":
        overrides = {"model": {"name": model, "random_weights": random_weights or None, "context_length": context_length},
                     "backend": {"name": backend, "options": backend_options or None},
                     "parallel": {"ranks": ranks}}
        if isinstance(config, KogConfig):
            data = config.model_dump()
            for section, values in overrides.items():
                data[section].update({k: v for k, v in values.items() if v is not None})
            cfg = KogConfig.model_validate(data)
        else:
            cfg = load_config(config, overrides)
        return cls.from_config(cfg, progress=progress)

    @classmethod
    def from_config(cls, cfg: KogConfig, progress: bool = False) -> "Engine":
        t0 = time.perf_counter()
        reg = load_registry()
        if not cfg.model.name:
            raise KogError("no model given; pass --model NAME (see `kog models`) or set [model] name in the config")
        backend_name = cfg.backend.name or reg.default_backend()
        spec = reg.usable_backend_spec(backend_name)  # unknown or unusable here: one line, before anything loads
        preset = reg.presets.get(cfg.model.name)
        tokenizer, model_path = None, None
        if cfg.model.random_weights:
            if preset is None:
                raise KogError(f"--random-weights needs a preset name; known presets: {', '.join(sorted(reg.presets))}")
            hf_config = dict(preset.config)
            tokenizer = _try_preset_tokenizer(preset, reg)
        else:
            from .checkpoint import read_config
            from .hub import resolve_model
            path = resolve_model(cfg.model.name, reg.presets)
            hf_config, model_path = read_config(path), str(path)  # weights load after the capability check
        arch_spec = reg.architecture_for(str(hf_config.get("model_type")))
        try:
            arch: ModelArchitecture = resolve_factory(arch_spec.factory)(hf_config)
        except KogError:
            raise
        except Exception as e:  # pydantic validation of the model's config.json
            raise CheckpointError(f"model config for {cfg.model.name} is invalid for architecture {arch_spec.name}: "
                                  f"{str(e).splitlines()[0]} ({' '.join(str(e).split())[:300]})")
        ctx = cfg.model.context_length or min(arch.context_length, DEFAULT_MAX_CONTEXT)
        if ctx > arch.context_length:
            raise KogError(f"context length {ctx} exceeds the model's maximum of {arch.context_length}; lower --context-length")
        kv_dtype = "bf16" if "cuda" in spec.capabilities.devices or "hip" in spec.capabilities.devices else "f32"
        program = arch.lower(context_length=ctx, kv_dtype=kv_dtype)
        problems = spec.capabilities.check(program, ranks=cfg.parallel.ranks)
        if problems:
            raise CapabilityError(f"backend {backend_name!r} cannot run {cfg.model.name}: {'; '.join(problems)}")
        if cfg.model.random_weights:
            from .random_weights import random_weights
            weights = random_weights(arch, seed=cfg.model.seed, dtype=_np_dtype(cfg.model.weight_dtype))
        else:
            from .checkpoint import load_checkpoint, validate_tensors
            ckpt = load_checkpoint(model_path, progress=progress)
            validate_tensors(ckpt.tensors, arch.expected_tensors(), source=str(model_path))
            weights, tokenizer = ckpt.tensors, ckpt.tokenizer
        backend = _make_backend(reg, backend_name, cfg, program, weights)
        return cls(cfg, reg, arch, program, backend, tokenizer, preset, model_path, time.perf_counter() - t0)

    # ------------------------------------------------------------------ prompts
    @property
    def is_chat(self) -> bool:
        return bool(self.tokenizer is not None and self.tokenizer.chat_template and (self.preset is None or self.preset.chat))

    def encode_prompt(self, prompt: Prompt, chat: bool | None = None) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise KogError("this model has no tokenizer files; pass token ids instead of text")
            use_chat = self.is_chat if chat is None else chat
            if use_chat:
                if not self.tokenizer.chat_template:
                    raise KogError("this model has no chat template; use --raw to send the prompt as is")
                return self.tokenizer.encode_chat([{"role": "user", "content": prompt}])
            return self.tokenizer.encode(prompt, add_special_tokens=True)
        items = list(prompt)
        if items and isinstance(items[0], dict):
            if self.tokenizer is None or not self.tokenizer.chat_template:
                raise KogError("chat messages need a model with a tokenizer and a chat template")
            return self.tokenizer.encode_chat(items)
        ids = [int(t) for t in items]
        bad = [t for t in ids if not 0 <= t < self.program.vocab_size]
        if bad:
            raise KogError(f"token id {bad[0]} is outside the vocabulary [0, {self.program.vocab_size})")
        return ids

    def stop_token_ids(self) -> frozenset[int]:
        ids = set()
        if self.tokenizer is not None:
            ids |= set(self.tokenizer.eos_token_ids)
        elif self.preset is not None:
            eos = self.preset.config.get("eos_token_id")
            ids |= set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        return frozenset(ids)

    # ------------------------------------------------------------------ generation
    def stream(self, prompt: Prompt, *, max_tokens: int | None = None, temperature: float | None = None,
               top_k: int | None = None, top_p: float | None = None, seed: int | None = None,
               stop: Sequence[str] | None = None, stop_token_ids: Sequence[int] | None = None,
               ignore_eos: bool = False, chat: bool | None = None, cancel: CancelToken | None = None,
               reuse_prefix: bool = True) -> Iterator[StreamChunk]:
        """Yield text chunks as tokens are generated; the last chunk carries the result.

        reuse_prefix (with a backend that can, `prefix_reuse`): the part of the prompt that
        equals the previous request's prompt + output is not run again; the tokens are the same
        as without it (the same decode path wrote those KV entries). False: run the whole prompt."""
        s = self.config.sampling
        t0 = time.perf_counter()
        ids = self.encode_prompt(prompt, chat)
        if not ids:
            raise KogError("the prompt is empty")
        ctx = self.program.context_length
        if len(ids) >= ctx:
            raise ContextLengthExceeded(f"the prompt has {len(ids)} tokens but the context is {ctx}; shorten the "
                                        f"prompt or raise --context-length (model maximum {self.architecture.context_length})")
        want = s.max_tokens if max_tokens is None else int(max_tokens)
        if want < 1:
            raise KogError("max_tokens must be at least 1")
        budget = min(want, ctx - len(ids))
        params = SamplingParams(temperature=s.temperature if temperature is None else float(temperature),
                                top_k=s.top_k if top_k is None else int(top_k),
                                top_p=s.top_p if top_p is None else float(top_p),
                                seed=_seed(s.seed if seed is None else seed))
        stops = frozenset() if ignore_eos else self.stop_token_ids()
        stops |= frozenset(int(t) for t in (stop_token_ids or ()))
        criteria = StopCriteria(max_tokens=budget, stop_token_ids=stops)
        matcher = StopStringMatcher(list(s.stop if stop is None else stop))
        decoder = self.tokenizer.stream_decoder(skip_special_tokens=True) if self.tokenizer is not None else None
        out: list[int] = []
        t_first = None
        finish = "length"          # max tokens, or the context is full
        hit_stop_string = False
        cancel = cancel or CancelToken()
        cached = self._reusable_prefix(ids) if reuse_prefix else 0
        self._kv_tokens = []  # until this request ends cleanly, nothing in the KV cache is vouched for
        if cached:
            gen = self.backend.generate(ids[cached:], self.sampler, params, criteria, cancel, start_pos=cached)
        else:
            gen = self.backend.generate(ids, self.sampler, params, criteria, cancel)
        try:
            for tok in gen:
                t_first = t_first or time.perf_counter()
                out.append(tok)
                if tok in stops:
                    finish = "stop"
                    break
                emit, hit_stop_string = matcher.push(decoder.push(tok) if decoder is not None else "")
                if emit or decoder is None:
                    yield StreamChunk(emit, [tok])
                if hit_stop_string:
                    finish = "stop"
                    break
        finally:
            gen.close()  # a monokernel backend stops its kernel here
        # Each output token but the last was fed back (the next one exists), so the KV cache holds
        # the prompt and out[:-1]; a backend that ran ahead wrote only positions after those. With
        # no output (cancelled early) the prompt may be part-run: only the reused prefix is sure.
        if self.prefix_reuse:
            self._kv_tokens = ids + out[:-1] if out else ids[:cached]
        if cancel.cancelled and finish == "length" and len(out) < budget:
            finish = "cancelled"
        if decoder is not None and not hit_stop_string:
            tail, hit_stop_string = matcher.push(decoder.flush())  # text held back for UTF-8 or a stop-string prefix
            tail += "" if hit_stop_string else matcher.flush()
            finish = "stop" if hit_stop_string else finish
            if tail:
                yield StreamChunk(tail, [])
        t_end = time.perf_counter()
        n_dec = max(len(out) - 1, 0)
        text = self._final_text(out, stops, matcher)
        res = GenerationResult(out, text, finish, len(ids), (t_first or t_end) - t0,
                               n_dec / (t_end - t_first) if t_first and n_dec and t_end > t_first else 0.0, t_end - t0,
                               cached_tokens=cached)
        yield StreamChunk("", [], res)

    def _reusable_prefix(self, ids: list[int]) -> int:
        """Leading prompt tokens whose KV entries the last request left; at least one token runs
        (its logits give the first new token)."""
        if not self.prefix_reuse:
            return 0
        kv, n = self._kv_tokens, 0
        limit = min(len(kv), len(ids) - 1)
        while n < limit and kv[n] == ids[n]:
            n += 1
        return n

    def _final_text(self, out: list[int], stops: frozenset[int], matcher: StopStringMatcher) -> str:
        if self.tokenizer is None:
            return ""
        body = out[:-1] if out and out[-1] in stops else out
        return matcher.truncate(self.tokenizer.decode(body, skip_special_tokens=True))

    def generate(self, prompt: Prompt, **kwargs) -> GenerationResult:
        result = None
        for chunk in self.stream(prompt, **kwargs):
            result = chunk.result or result
        return result

    def logits(self, token_ids: Sequence[int]) -> np.ndarray:
        """float32 logits [len(token_ids), V] at every position, through the decode path."""
        ids = self.encode_prompt(list(token_ids))
        if len(ids) > self.program.context_length:
            raise ContextLengthExceeded(f"{len(ids)} tokens exceed the context of {self.program.context_length}")
        self._kv_tokens = []  # logits() starts the sequence again
        return self.backend.logits(ids)

    def close(self):
        self.backend.close()


def _seed(seed: int | None) -> int:
    return int.from_bytes(os.urandom(8), "little") if seed is None else int(seed)


def _np_dtype(name: str):
    if name == "bf16":
        import ml_dtypes
        return ml_dtypes.bfloat16
    return {"f16": np.float16, "f32": np.float32}[name]


def _try_preset_tokenizer(preset: ModelPreset, reg: Registry):
    """A random-weights run still uses the real tokenizer when the real files are at hand."""
    from .checkpoint import load_tokenizer
    from .hub import resolve_model
    try:
        path = resolve_model(preset.name, reg.presets)
    except KogError:
        return None
    return load_tokenizer(path)


def _make_backend(reg: Registry, name: str, cfg: KogConfig, program, weights):
    ranks = cfg.parallel.ranks
    if ranks == 1:
        backend = reg.create_backend(name, **cfg.backend.options)
        backend.load(program, weights)
        return backend
    from .multirank import MultiRankBackend
    return MultiRankBackend(reg, name, cfg.backend.options, program, weights, ranks, cfg.parallel.collective)
