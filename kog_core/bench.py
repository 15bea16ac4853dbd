"""`kog bench`: prefill and decode speed, bytes streamed per token, and MBU against the copy
bandwidth measured in the same process (the device's, from the backend, or the CPU's)."""
from __future__ import annotations

import json
import time

import numpy as np


def cpu_copy_bandwidth(nbytes: int = 256 << 20, repeats: int = 5) -> float:
    """Bytes read + written per second by a large numpy copy (median of a few)."""
    a = np.ones(nbytes // 4, np.float32)
    b = np.empty_like(a)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        np.copyto(b, a)
        times.append(time.perf_counter() - t0)
    return 2 * a.nbytes / sorted(times)[len(times) // 2]


def run_bench(engine, tokens: int = 512, prompt_tokens: int = 16, seed: int = 0, temperature: float = 0.0,
              top_k: int = 0, top_p: float = 1.0) -> dict:
    """Decode `tokens` tokens after a random prompt, greedy by default; a temperature (with top-k /
    top-p) measures sampled decoding, whose token choice runs on the device too."""
    prog = engine.program
    rng = np.random.default_rng(seed)
    stops = engine.stop_token_ids()
    prompt = [int(t) for t in rng.integers(3, prog.vocab_size, prompt_tokens) if int(t) not in stops] or [3]
    tokens = min(tokens, prog.context_length - len(prompt))
    info = dict(engine.backend.describe())
    on_device = "copy_bandwidth_TBps" in info
    weight_dtype = "bf16" if on_device else "f32"
    kv_dtype = "bf16" if on_device else "f32"
    # One short warm-up request (compilation, caches), then the measured one.
    sampling = dict(temperature=float(temperature), top_k=int(top_k), top_p=float(top_p), seed=seed)
    # reuse_prefix=False: the measured request runs its whole prompt (the warm-up's KV would serve it)
    engine.generate(prompt, max_tokens=4, ignore_eos=True, reuse_prefix=False, **sampling)
    res = engine.generate(prompt, max_tokens=tokens, ignore_eos=True, reuse_prefix=False, **sampling)
    n = len(res.token_ids)
    weight_bytes = prog.weight_bytes_per_token(weight_dtype)
    per_op = lambda kv_len: prog.bytes_per_op(kv_len=kv_len, weight_dtype=weight_dtype, kv_dtype=kv_dtype)
    kv_ops = [i for i, op in enumerate(prog.ops) if op.kind in ("attention", "kv_append")]
    kv_mid = sum(per_op(len(prompt) + n // 2)[i] for i in kv_ops)
    kv_end = sum(per_op(len(prompt) + n)[i] for i in kv_ops)
    bw = info["copy_bandwidth_TBps"] * 1e12 if on_device else cpu_copy_bandwidth()
    bytes_per_token = weight_bytes + kv_mid
    out = {
        "model": engine.config.model.name, "backend": engine.backend.name, "device": info.get("device", "cpu"),
        "prompt_tokens": len(prompt), "generated_tokens": n,
        "ttft_ms": round(res.ttft_s * 1e3, 3),
        "prefill_tok_s": round(len(prompt) / res.ttft_s, 2) if res.ttft_s > 0 else None,
        "decode_tok_s": round(res.decode_tok_s, 2),
        "sampling": "greedy" if temperature <= 0 else f"temperature {temperature}, top-k {top_k}, top-p {top_p}",
        "weight_bytes_per_token": weight_bytes, "kv_bytes_per_token_mid": kv_mid, "kv_bytes_per_token_end": kv_end,
        "weight_dtype": weight_dtype,
        "copy_bandwidth_TBps": round(bw / 1e12, 4),
        "achieved_TBps": round(res.decode_tok_s * bytes_per_token / 1e12, 4),
        "mbu": round(res.decode_tok_s * bytes_per_token / bw, 4),
        "load_s": round(engine.load_s, 2),
    }
    if hasattr(engine.backend, "bench_breakdown") and temperature <= 0:  # the breakdown's variants decode greedily
        out["breakdown"] = engine.backend.bench_breakdown(prompt, min(tokens, 128))
    return out


def format_bench(r: dict) -> str:
    lines = [
        f"model {r['model']} on {r['backend']} ({r['device']})",
        f"prefill: {r['prompt_tokens']} tokens, TTFT {r['ttft_ms']:.1f} ms",
        f"decode:  {r['generated_tokens']} tokens at {r['decode_tok_s']:.1f} tok/s ({r.get('sampling', 'greedy')})",
        f"bytes/token: weights {r['weight_bytes_per_token'] / 1e9:.3f} GB ({r['weight_dtype']}), "
        f"KV {r['kv_bytes_per_token_mid'] / 1e6:.2f} MB mid-run, {r['kv_bytes_per_token_end'] / 1e6:.2f} MB at the end",
        f"bandwidth: achieved {r['achieved_TBps']:.4f} TB/s of {r['copy_bandwidth_TBps']:.4f} TB/s copy "
        f"bandwidth measured now: MBU {100 * r['mbu']:.1f}%",
    ]
    for k, v in (r.get("breakdown") or {}).items():
        lines.append(f"  {k}: {v}")
    lines.append(json.dumps(r))
    return "\n".join(lines)
