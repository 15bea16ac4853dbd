"""Prefix reuse: a request whose prompt starts with the previous request's prompt + output runs only
what follows (an agent loop resends its whole, growing context every step), and its tokens are
exactly those of a run of the whole prompt."""
from __future__ import annotations

import json
import math

import numpy as np

import pytest

from kog_core import Engine
from kog_core.errors import KogError
from kog_core.interfaces import BackendCapabilities, BackendSpec
from kog_core.plugins import load_registry
from kog_core.program import OP_KINDS
from kog_moe_standard_tp.llama import Llama

from conftest import small_llama_config


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from safetensors.numpy import save_file
    d = tmp_path_factory.mktemp("small_llama")
    cfg = small_llama_config()
    # weights scaled so the attention matters: with the default small init, a zeroed KV cache
    # still gave the same greedy tokens (the tests could not fail)
    rng = np.random.default_rng(3)
    weights = {k: v if "norm" in k else (rng.standard_normal(v.shape) * 1.5 / math.sqrt(v.shape[-1])).astype(np.float32)
               for k, v in Llama(cfg).random_weights(3).items()}
    save_file(weights, str(d / "model.safetensors"))
    (d / "config.json").write_text(json.dumps(cfg))
    return str(d)


def count_positions(engine) -> list[int]:
    """The positions the backend runs from now on (a spy on step)."""
    seen, step = [], engine.backend.step

    def spy(token, pos):
        seen.append(pos)
        return step(token, pos)
    engine.backend.step = spy
    return seen


SAMPLED = dict(temperature=0.9, top_k=20, seed=11)


@pytest.mark.parametrize("sampling", [{}, SAMPLED], ids=["greedy", "sampled"])
def test_a_continued_conversation_runs_only_its_new_tokens(checkpoint, sampling):
    engine = Engine.load(model=checkpoint, backend="reference")
    fresh = Engine.load(model=checkpoint, backend="reference")
    first = [5, 9, 14, 3, 22]
    r1 = engine.generate(first, max_tokens=6, ignore_eos=True, **sampling)
    assert r1.cached_tokens == 0 and len(r1.token_ids) == 6
    second = first + r1.token_ids + [40, 41, 42]
    ran = count_positions(engine)
    r2 = engine.generate(second, max_tokens=7, ignore_eos=True, **sampling)
    ref = fresh.generate(second, max_tokens=7, ignore_eos=True, reuse_prefix=False, **sampling)
    # the last output token was never fed back, so it and the new tokens run; nothing before
    kept = len(first) + len(r1.token_ids) - 1
    assert r2.cached_tokens == kept
    assert ran[0] == kept and ran == list(range(kept, len(second) + 6))
    assert r2.token_ids == ref.token_ids and ref.cached_tokens == 0
    assert r2.timings()["cached_tokens"] == kept


def test_a_prompt_that_diverges_keeps_only_the_common_prefix(checkpoint):
    engine = Engine.load(model=checkpoint, backend="reference")
    fresh = Engine.load(model=checkpoint, backend="reference")
    engine.generate([5, 9, 14, 3, 22, 8], max_tokens=4, ignore_eos=True)
    edited = [5, 9, 14, 60, 61]  # an edit at position 3: positions 3.. must run again
    r = engine.generate(edited, max_tokens=5, ignore_eos=True)
    assert r.cached_tokens == 3
    assert r.token_ids == fresh.generate(edited, max_tokens=5, ignore_eos=True, reuse_prefix=False).token_ids
    # the same prompt again: all but its last token are kept (its logits give the first new token)
    again = engine.generate(edited, max_tokens=5, ignore_eos=True)
    assert again.cached_tokens == len(edited) - 1 and again.token_ids == r.token_ids
    # and a shorter one inside what is cached
    short = engine.generate(edited[:2], max_tokens=3, ignore_eos=True)
    assert short.cached_tokens == 1
    assert short.token_ids == fresh.generate(edited[:2], max_tokens=3, ignore_eos=True, reuse_prefix=False).token_ids


def test_reuse_prefix_false_and_logits_run_the_whole_prompt(checkpoint):
    engine = Engine.load(model=checkpoint, backend="reference")
    p = [5, 9, 14, 3]
    engine.generate(p, max_tokens=3, ignore_eos=True)
    ran = count_positions(engine)
    r = engine.generate(p, max_tokens=3, ignore_eos=True, reuse_prefix=False)
    assert r.cached_tokens == 0 and ran[0] == 0
    engine.logits([7, 7, 7])  # starts the sequence again: nothing of the last request is left
    assert engine.generate(p, max_tokens=3, ignore_eos=True).cached_tokens == 0


def test_a_failed_request_vouches_for_nothing(checkpoint):
    """A request that dies mid-prompt leaves KV entries of an unknown extent: the next one runs
    everything after what was reused."""
    engine = Engine.load(model=checkpoint, backend="reference")
    fresh = Engine.load(model=checkpoint, backend="reference")
    p = [5, 9, 14, 3, 22, 8, 30]
    engine.generate(p[:3], max_tokens=2, ignore_eos=True)
    step = engine.backend.step

    def failing(token, pos):
        if pos == 5:
            raise KogError("device fell over")
        return step(token, pos)
    engine.backend.step = failing
    with pytest.raises(KogError, match="fell over"):
        engine.generate(p, max_tokens=4, ignore_eos=True)
    engine.backend.step = step
    r = engine.generate(p, max_tokens=4, ignore_eos=True)
    assert r.cached_tokens == 0
    assert r.token_ids == fresh.generate(p, max_tokens=4, ignore_eos=True).token_ids


def test_a_backend_without_the_capability_is_never_asked_to_continue(checkpoint, monkeypatch):
    """Third-party backends written before prefix reuse: their generate gets no start_pos."""
    reg = load_registry()
    monkeypatch.setitem(reg.backends, "no_reuse", BackendSpec(
        name="no_reuse", factory="kog_core.reference.backend:ReferenceBackend",
        capabilities=BackendCapabilities(dtypes=frozenset({"f32", "bf16", "f16"}), ops=OP_KINDS)))
    monkeypatch.setattr("kog_core.engine.load_registry", lambda: reg)
    engine = Engine.load(model=checkpoint, backend="no_reuse")
    calls = []
    gen = engine.backend.generate

    def old_style(prompt_ids, sampler, params, stop, cancel=None):
        calls.append(len(prompt_ids))
        return gen(prompt_ids, sampler, params, stop, cancel)
    engine.backend.generate = old_style
    r1 = engine.generate([5, 9, 14], max_tokens=3, ignore_eos=True)
    r2 = engine.generate([5, 9, 14] + r1.token_ids, max_tokens=3, ignore_eos=True)
    assert calls == [3, 6] and r2.cached_tokens == 0


def test_laneformer_on_two_ranks_continues_as_it_would_start():
    """Laneformer's DTP state lives inside a token (the delay counts layers), so the KV cache is all
    a continued sequence needs; two ranks (kccl threads) and one give the same tokens."""
    from test_laneformer import config, weights_for
    from kog_core.config import KogConfig
    from kog_core.engine import _make_backend
    from kog_laneformer.model import Laneformer

    arch = Laneformer(config("d2-noearly-lane-perlane-swa-start"))
    weights = weights_for(arch)
    prog = arch.lower(context_length=64)
    reg = load_registry()
    outs = []
    for ranks in (1, 2):
        cfg = KogConfig.model_validate({"model": {"name": "laneformer-test"}, "parallel": {"ranks": ranks}})
        backend = _make_backend(reg, "reference", cfg, prog, weights)
        engine = Engine(cfg, reg, arch, prog, backend, None, None, None, 0.0)
        first = [1, 6, 9, 4]
        r1 = engine.generate(first, max_tokens=5, ignore_eos=True)
        second = first + r1.token_ids + [3, 12]
        r2 = engine.generate(second, max_tokens=6, ignore_eos=True)
        ref = engine.generate(second, max_tokens=6, ignore_eos=True, reuse_prefix=False)
        assert r2.cached_tokens == len(first) + 4
        assert r2.token_ids == ref.token_ids
        outs.append(np.array(r2.token_ids))
    assert (outs[0] == outs[1]).all()


def test_the_server_setting_turns_reuse_off(checkpoint):
    """[server] prefix_reuse = false: clients cannot time each other's prompts."""
    pytest.importorskip("fastapi")
    from kog_core.config import ServerSection
    from kog_core.server.app import create_app
    engine = Engine.load(model=checkpoint, backend="reference")
    create_app(engine, ServerSection(prefix_reuse=False))
    engine.generate([5, 9, 14], max_tokens=3, ignore_eos=True)
    assert engine.generate([5, 9, 14], max_tokens=3, ignore_eos=True).cached_tokens == 0
