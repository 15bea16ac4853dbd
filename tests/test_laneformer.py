"""Laneformer: small random checkpoints in exactly the published layout.

The decode program on the reference backend must match the plain forward at every position
(fp32 vs float64, relative error < 1e-4); multi-rank runs must match one rank bit for bit;
bf16 checkpoints load. The plain forward itself is checked against a second, independent
transcription that follows the structure of the published remote code (global head order,
repeat_kv, complex RoPE, ReduceMode per layer)."""
from __future__ import annotations

import json
import math

import ml_dtypes
import numpy as np
import pytest

from kog_core.interfaces import SamplingParams, StopCriteria, resolve_factory
from kog_core.plugins import load_registry
from kog_kccl.driver import run_ranks
from kog_laneformer.config import LaneformerConfig
from kog_laneformer.model import Laneformer

BASE = dict(model_type="laneformer_tp", hidden_size=32, num_hidden_layers=5, num_attention_heads=8,
            num_key_value_heads=4, intermediate_size=64, vocab_size=48, max_position_embeddings=32,
            rope_theta=10000.0, norm_eps=1e-5, bos_token_id=1, eos_token_id=2)

CONFIGS = {
    "d1-early-replicate": dict(num_lanes=2, broadcast_delay=1),
    "d2-noearly-lane-perlane-swa-start": dict(num_lanes=4, broadcast_delay=2, use_early_comm=False,
                                               lm_head_type="lane", replicated_rmsn_scale=False,
                                               sliding_window=4, sliding_window_n_layers=2),
    "d2-vocabpar-swa-end-unclamped-mha": dict(num_lanes=4, hidden_size=48, num_key_value_heads=8, broadcast_delay=2,
                                              lm_head_type="vocab_parallel", sliding_window=5,
                                              sliding_window_n_layers=-3, unclamped_layers=[3]),
    "nocomm-early-preagg-perlane": dict(num_lanes=2, broadcast_delay=1, use_comm=False,
                                        pre_norm_lane_agg=True, replicated_rmsn_scale=False),
    "d1-perlane-replicate-tied": dict(num_lanes=4, broadcast_delay=1, replicated_rmsn_scale=False,
                                      tie_word_embeddings=True),
    "d2-nocomm-noearly-lane": dict(num_lanes=2, broadcast_delay=2, use_comm=False, use_early_comm=False,
                                   lm_head_type="lane"),
    "d2-early-vocabpar-perlane-swa-unclamped0": dict(num_lanes=4, hidden_size=48, broadcast_delay=2,
                                                     lm_head_type="vocab_parallel", replicated_rmsn_scale=False,
                                                     sliding_window=3, sliding_window_n_layers=4,
                                                     unclamped_layers=[0]),
    "d1-gqa4-swa-all-preagg": dict(num_lanes=2, num_key_value_heads=2, num_hidden_layers=4, broadcast_delay=1,
                                   sliding_window=4, sliding_window_n_layers=9, pre_norm_lane_agg=True),
}

IDS = [1, 7, 33, 5, 12, 40, 9, 9, 21, 3, 47, 18, 30, 2, 11, 26, 8, 44, 15, 6]


def config(name):
    return BASE | CONFIGS[name]


def weights_for(arch, seed=0):
    """Random weights in the published layout, scaled so logits are far from flat."""
    w = arch.random_weights(seed)
    rng = np.random.default_rng(seed + 7)
    for k, v in w.items():
        if "norm" in k:
            continue
        fan_in = v.shape[-1]
        w[k] = (rng.standard_normal(v.shape) / math.sqrt(fan_in) * (1.0 if "tok_emb" in k else 1.5)).astype(np.float32)
    return w


@pytest.fixture(scope="module")
def registry():
    return load_registry()


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def case(request, registry):
    arch = Laneformer(config(request.param))
    w = weights_for(arch)
    program = arch.lower()
    backend = registry.create_backend("reference")
    backend.load(program, w)
    return dict(name=request.param, arch=arch, weights=w, program=program, logits=backend.logits(IDS))


def rel_err(got, ref):
    return float(np.abs(got - ref).max() / np.abs(ref).max())


# --------------------------------------------------------------------------- published structure

def published_forward(cfg: dict, W: dict, ids) -> np.ndarray:
    """A second transcription of the model, following the published modeling file's structure:
    (S, L, D) states, einsum "bsli,loi->bslo" lane linears, global lane-major heads with
    repeat_kv, complex RoPE, ReduceMode chosen per layer in __init__, past lists."""
    c = LaneformerConfig.from_hf(cfg)
    W = {k: np.asarray(v, np.float64) for k, v in W.items()}
    S, L, D, N, d = len(ids), c.num_lanes, c.hidden_size, c.num_hidden_layers, c.broadcast_delay
    H, Hkv, hd = c.num_attention_heads, c.n_kv_heads, c.hd
    eps = c.norm_eps

    def norm(t, name):
        w = W.get(name + ".weight", W.get(name + ".scale"))
        return t / np.sqrt((t * t).mean(-1, keepdims=True) + eps) * w

    def lane_linear(t, w):
        return np.einsum("sli,loi->slo", t, w)

    freqs = 1.0 / (c.rope_theta ** (np.arange(0, hd, 2)[: hd // 2] / hd))
    cis = np.exp(1j * np.outer(np.arange(S), freqs))[:, None, :]          # (S, 1, hd/2)

    def rope(t):  # view_as_complex(t.reshape(..., -1, 2)) * freqs_cis
        z = (t[..., 0::2] + 1j * t[..., 1::2]) * cis
        return np.stack([z.real, z.imag], axis=-1).reshape(t.shape)

    modes = []
    for i in range(N):
        if i < d:
            modes.append("present" if c.use_early_comm else "no_reduce")
        else:
            modes.append("past" if c.use_comm else "no_reduce")

    def reduce_lanes(t, mode, past):
        if mode == "no_reduce":
            return t * math.sqrt(L)
        if mode == "present":
            return t.sum(-2, keepdims=True)
        return t + (past.sum(-2, keepdims=True) - past)

    q_pos, k_pos = np.arange(S)[:, None], np.arange(S)[None, :]
    x = np.broadcast_to(W["model.tok_embeddings.weight"][ids][:, None, :], (S, L, D))
    past_attn, past_mlp = [], []
    for i in range(N):
        p = f"model.layers.{i}."
        visible = k_pos <= q_pos
        sliding = i < c.sliding_window_n_layers or i >= N + c.sliding_window_n_layers
        if i not in c.unclamped_layers and sliding and c.sliding_window:
            visible = visible & (k_pos > q_pos - c.sliding_window)
        h = norm(x, p + "attention_norm")
        xq = rope(lane_linear(h, W[p + "attention.wq.weight"]).reshape(S, H, hd)).transpose(1, 0, 2)
        xk = rope(lane_linear(h, W[p + "attention.wk.weight"]).reshape(S, Hkv, hd)).transpose(1, 0, 2)
        xv = lane_linear(h, W[p + "attention.wv.weight"]).reshape(S, Hkv, hd).transpose(1, 0, 2)
        xk, xv = np.repeat(xk, H // Hkv, axis=0), np.repeat(xv, H // Hkv, axis=0)
        s = xq @ xk.transpose(0, 2, 1) * hd ** -0.5 + np.where(visible, 0.0, -np.inf)
        s = np.exp(s - s.max(-1, keepdims=True))
        s = s / s.sum(-1, keepdims=True)
        o = (s @ xv).transpose(1, 0, 2).reshape(S, L, H * hd // L)
        out = lane_linear(o, W[p + "attention.wo.weight"])
        x = x + reduce_lanes(out, modes[i], past_attn[i - d] if i >= d else None)
        past_attn.append(out)
        h = norm(x, p + "ffn_norm")
        a, b = lane_linear(h, W[p + "feed_forward.w1.weight"]), lane_linear(h, W[p + "feed_forward.w3.weight"])
        out = lane_linear(a / (1 + np.exp(-a)) * b, W[p + "feed_forward.w2.weight"])
        x = x + reduce_lanes(out, modes[i], past_mlp[i - d] if i >= d else None)
        past_mlp.append(out)
    if c.pre_norm_lane_agg:
        h = norm(x.sum(-2), "model.norm")
    elif c.lm_head_type == "replicate":
        h = norm(x, "model.norm").mean(-2)
    else:
        h = norm(x, "model.norm")
    if c.lm_head_type == "replicate":
        head = W["model.tok_embeddings.weight"] if c.tie_word_embeddings else W["lm_head.weight"]
        return h @ head.T
    if c.lm_head_type == "lane":
        return h.reshape(S, L * D) @ W["lm_head.linear.weight"].T
    return np.einsum("sli,loi->slo", h, W["lm_head.weight"]).reshape(S, -1)


def test_forward_matches_published_structure(case):
    ref = published_forward(config(case["name"]), case["weights"], IDS)
    got = case["arch"].forward(case["weights"], IDS).astype(np.float64)
    assert rel_err(got, ref) < 1e-6


# --------------------------------------------------------------------------- decode program

def test_decode_program_matches_forward(case):
    ref = case["arch"].forward(case["weights"], IDS)
    assert case["logits"].shape == (len(IDS), case["arch"].vocab_size)
    assert np.abs(ref).max() > 1.0, "logits too flat to test anything"
    assert rel_err(case["logits"], ref) < 1e-4


def test_multi_rank_bit_identical(case):
    L = case["program"].lanes
    for ranks in sorted({2, L}):
        got = run_ranks(case["program"], case["weights"], ranks, lambda b: b.logits(IDS))
        assert np.array_equal(got, case["logits"]), f"{ranks} ranks differ from one"


def test_multi_rank_processes(registry):
    arch = Laneformer(config("d2-noearly-lane-perlane-swa-start"))
    w, prog = weights_for(arch), arch.lower()
    one = run_ranks(prog, w, 1, lambda b: b.logits(IDS[:8]))
    four = run_ranks(prog, w, 4, lambda b: b.logits(IDS[:8]), processes=True, all_results=True)
    assert all(np.array_equal(r, one) for r in four)


def test_greedy_tokens_identical_across_ranks(registry):
    arch = Laneformer(config("d2-vocabpar-swa-end-unclamped-mha"))
    w, prog = weights_for(arch), arch.lower()
    sampler = registry.sampler()

    def generate(b):
        return list(b.generate(IDS[:6], sampler, SamplingParams(), StopCriteria(max_tokens=12)))

    one = run_ranks(prog, w, 1, generate)
    assert len(one) == 12
    assert run_ranks(prog, w, 2, generate) == one
    assert run_ranks(prog, w, 4, generate) == one


def test_lane_reduction_program_structure():
    """Each partial is sent right after it is produced iff some lane needs it; the last d layers'
    partials are never sent; delayed residuals read the partial of layer i - d."""
    for name in ("d1-early-replicate", "d2-noearly-lane-perlane-swa-start", "nocomm-early-preagg-perlane"):
        arch = Laneformer(config(name))
        c, prog = arch.cfg, arch.lower()
        sent = {op.inputs[0] for op in prog.ops if op.kind == "collective"}
        for i in range(c.num_hidden_layers):
            for kind in ("attn", "mlp"):
                t = f"part.{kind}.{i}"
                needed = c.reduce_mode(i) == "allreduce" or (
                    c.use_comm and i + c.broadcast_delay < c.num_hidden_layers)
                assert (t in sent) == needed, (name, t)
                if t in sent:
                    k = next(j for j, op in enumerate(prog.ops) if op.kind == "matvec" and op.outputs == (t,))
                    assert prog.ops[k + 1].kind == "collective" and prog.ops[k + 1].inputs == (t,)
        residuals = [op for op in prog.ops if op.kind == "lane_residual"]
        assert len(residuals) == 2 * c.num_hidden_layers
        for op in residuals:
            assert op.attrs["mode"] == c.reduce_mode(op.layer)
            if op.attrs["mode"] == "delayed":
                kind = op.inputs[1].split(".")[1]
                assert op.inputs[2] == f"part.{kind}.{op.layer - c.broadcast_delay}"
            if op.attrs["mode"] == "local":
                assert op.attrs["scale"] == pytest.approx(math.sqrt(c.num_lanes))


def test_windows_per_layer():
    c = LaneformerConfig.from_hf(BASE | dict(num_lanes=2, num_hidden_layers=6, sliding_window=8,
                                             sliding_window_n_layers=-2, unclamped_layers=[5]))
    assert [c.window(i) for i in range(6)] == [None, None, None, None, 8, None]
    c = LaneformerConfig.from_hf(BASE | dict(num_lanes=2, num_hidden_layers=6, sliding_window=8,
                                             sliding_window_n_layers=3))
    assert [c.window(i) for i in range(6)] == [8, 8, 8, None, None, None]
    prog = Laneformer(BASE | dict(num_lanes=2, sliding_window=4, sliding_window_n_layers=2)).lower()
    assert [op.attrs["window"] for op in prog.ops if op.kind == "attention"] == [4, 4, None, None, None]


# --------------------------------------------------------------------------- checkpoints

def test_expected_tensors_published_layout():
    arch = Laneformer(BASE | dict(num_lanes=4, replicated_rmsn_scale=False, lm_head_type="vocab_parallel"))
    t = arch.expected_tensors()
    assert t["model.tok_embeddings.weight"] == (48, 32)
    assert t["model.layers.0.attention_norm.scale"] == (4, 32)
    assert t["model.layers.0.attention.wq.weight"] == (4, 8, 32)   # [L, H*hd/L, D]
    assert t["model.layers.0.attention.wk.weight"] == (4, 4, 32)
    assert t["model.layers.0.attention.wo.weight"] == (4, 32, 8)
    assert t["model.layers.0.feed_forward.w1.weight"] == (4, 16, 32)
    assert t["model.layers.0.feed_forward.w2.weight"] == (4, 32, 16)
    assert t["model.norm.scale"] == (4, 32)
    assert t["lm_head.weight"] == (4, 12, 32)
    lane = Laneformer(BASE | dict(num_lanes=2, lm_head_type="lane")).expected_tensors()
    assert lane["lm_head.linear.weight"] == (48, 64) and "model.norm.weight" in lane
    agg = Laneformer(BASE | dict(num_lanes=2, replicated_rmsn_scale=False, pre_norm_lane_agg=True)).expected_tensors()
    assert agg["model.norm.weight"] == (32,) and agg["model.layers.1.ffn_norm.scale"] == (2, 32)
    tied = Laneformer(BASE | dict(num_lanes=2, tie_word_embeddings=True)).expected_tensors()
    assert "lm_head.weight" not in tied


def test_bf16_checkpoint_loads(tmp_path, registry):
    from safetensors.numpy import save_file

    from kog_core.checkpoint import load_checkpoint, validate_tensors
    cfg = config("d2-early-vocabpar-perlane-swa-unclamped0") | {"torch_dtype": "bfloat16"}
    arch = Laneformer(cfg)
    w = {k: v.astype(ml_dtypes.bfloat16) for k, v in weights_for(arch).items()}
    save_file(w, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    ckpt = load_checkpoint(tmp_path, progress=False)
    model = resolve_factory(registry.architecture_for(ckpt.config["model_type"]).factory)(ckpt.config)
    validate_tensors(ckpt.tensors, model.expected_tensors(), str(tmp_path))
    assert ckpt.tensors["model.layers.0.attention.wq.weight"].dtype == np.dtype(ml_dtypes.bfloat16)
    backend = registry.create_backend("reference")
    backend.load(model.lower(), ckpt.tensors)
    got = backend.logits(IDS)
    ref = model.forward({k: np.asarray(v, np.float32) for k, v in ckpt.tensors.items()}, IDS)
    assert rel_err(got, ref) < 1e-4


def test_config_validation():
    with pytest.raises(ValueError, match="must divide num_attention_heads"):
        LaneformerConfig.from_hf(BASE | dict(num_lanes=3))
    with pytest.raises(ValueError, match="vocab_size"):
        LaneformerConfig.from_hf(BASE | dict(num_lanes=4, vocab_size=50, lm_head_type="vocab_parallel"))
    with pytest.raises(ValueError, match="pre_norm_lane_agg"):
        LaneformerConfig.from_hf(BASE | dict(num_lanes=2, lm_head_type="lane", pre_norm_lane_agg=True))
    with pytest.raises(ValueError, match="broadcast_delay"):
        LaneformerConfig.from_hf(BASE | dict(num_lanes=2, broadcast_delay=0))
    with pytest.raises(ValueError, match="intermediate_size"):
        LaneformerConfig.from_hf(BASE | dict(num_lanes=8, num_key_value_heads=8, intermediate_size=60))
    # the published config's training-only fields are accepted and ignored
    LaneformerConfig.from_hf(BASE | dict(num_lanes=2, multiple_of=32, depth_init=True, use_flex_attn=False,
                                         attn_mask_type="causal", use_cache=True, unclamped_layers=None))


# --------------------------------------------------------------------------- the 2B release

def test_2b_preset(registry):
    preset = registry.presets["laneformer-2b"]
    assert preset.hf_repo == "kogai/laneformer-2b-it" and preset.architecture == "laneformer"
    assert registry.architecture_for("laneformer_tp").name == "laneformer"
    arch = Laneformer(preset.config)
    assert sum(math.prod(s) for s in arch.expected_tensors().values()) == 2_320_069_632
    prog = arch.lower()
    embedding_row = 3072 * 2
    per_token = prog.weight_bytes_per_token("bf16") - embedding_row
    assert per_token == pytest.approx(4.44e9, rel=2e-3)
    assert prog.lanes == 8 and prog.context_length == 4096
    windows = [op.attrs["window"] for op in prog.ops if op.kind == "attention"]
    assert windows == [512] * 10 + [None] * 5
    assert "bytes per token" in prog.format(kv_len=0)
    # delay 2: partials of layers 13 and 14 are never sent
    sent = {op.inputs[0] for op in prog.ops if op.kind == "collective"}
    assert "part.attn.12" in sent and "part.attn.13" not in sent and "part.mlp.14" not in sent


# --------------------------------------------------------------------------- end to end

def test_engine_finds_the_published_checkpoint_in_the_hf_cache(tmp_path, monkeypatch):
    """`kog run --model laneformer-2b`: the preset resolves to the local Hugging Face cache
    snapshot of kogai/laneformer-2b-it, whose config.json (here: tiny shapes), bf16 safetensors,
    tokenizer.json and chat template are used; one rank and two ranks give the same tokens."""
    from safetensors.numpy import save_file
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace

    from kog_core import Engine
    cache = tmp_path / "hub"
    repo = cache / "models--kogai--laneformer-2b-it"
    snap = repo / "snapshots" / "0123abcd"
    snap.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0123abcd")
    cfg = config("d2-noearly-lane-perlane-swa-start") | {"torch_dtype": "bfloat16",
                                                         "architectures": ["LaneformerTPForCausalLM"]}
    (snap / "config.json").write_text(json.dumps(cfg))
    arch = Laneformer(cfg)
    save_file({k: v.astype(ml_dtypes.bfloat16) for k, v in weights_for(arch).items()}, str(snap / "model.safetensors"))
    words = ["<unk>", "<s>", "</s>"] + [f"w{i}" for i in range(45)]
    tok = HFTokenizer(WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = Whitespace()
    tok.add_special_tokens(["<s>", "</s>"])
    tok.save(str(snap / "tokenizer.json"))
    (snap / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<s>", "eos_token": "</s>",
        "chat_template": "{{ bos_token }}{% for m in messages %}{{ m['content'] }} {% endfor %}"}))
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))

    outs = []
    for ranks in (1, 2):
        engine = Engine.load(model="laneformer-2b", backend="reference", ranks=ranks)
        assert engine.program.model == "laneformer" and engine.tokenizer is not None
        messages = [{"role": "user", "content": "w3 w7 w11 w5"}]
        assert engine.tokenizer.encode_chat(messages)[:2] == [1, 6]
        outs.append(engine.generate(messages, max_tokens=8, temperature=0.0))
    assert outs[0].token_ids and outs[0].token_ids == outs[1].token_ids
    assert outs[0].text == outs[1].text
