"""Benchmark script of the nvidia_hopper backend on a preset with random bf16 weights (the kernel
developer's loop: variants via KOG_HOPPER_* without the engine); `kog bench --backend
nvidia_hopper` is the user-facing benchmark.

    python3 -m kog_nvidia_hopper.bench --preset bench-2b --tokens 512 [--peer path/to/torch_peer.py]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import numpy as np


def random_bf16_weights(arch, seed=0):
    """Random bf16 weights of the expected shapes (kog_core's pooled generator: seconds, not minutes)."""
    import ml_dtypes
    from kog_core.random_weights import random_weights
    return random_weights(arch, seed=seed, dtype=ml_dtypes.bfloat16)


def build(preset_name, context):
    from kog_moe_standard_tp.llama import Llama
    from kog_moe_standard_tp.presets import PRESETS
    pre = {p.name: p for p in PRESETS}.get(preset_name)
    if pre is None:
        try:
            from kog_laneformer.presets import PRESETS as LP  # type: ignore
            pre = {p.name: p for p in LP}[preset_name]
        except Exception as e:
            raise SystemExit(f"unknown preset {preset_name}: {e}")
    if pre.architecture == "llama":
        arch = Llama(pre.config)
    else:
        from kog_core.plugins import load_registry
        reg = load_registry()
        from kog_core.interfaces import resolve_factory
        arch = resolve_factory(reg.architectures[pre.architecture].factory)(pre.config)
    prog = arch.lower(context_length=min(context, arch.context_length), kv_dtype="bf16")
    return arch, prog


def load_preset(preset, context):
    """(program, HopperBackend loaded with the preset's random bf16 weights)."""
    from kog_nvidia_hopper.backend import HopperBackend
    from kog_nvidia_hopper.plugin import CAPABILITIES
    arch, prog = build(preset, context)
    w = random_bf16_weights(arch)
    hb = HopperBackend()
    hb.capabilities = CAPABILITIES
    hb.load(prog, w)
    return prog, hb


def run(preset, tokens, context, breakdown=True, masks=()):
    from kog_core.interfaces import SamplingParams, StopCriteria
    t0 = time.time()
    prog, hb = load_preset(preset, context)
    t_load = time.time() - t0
    desc = hb.describe()
    prompt = [1, 2, 3, 4]
    stop = StopCriteria(max_tokens=tokens)
    greedy = SamplingParams()
    hb.generate_timed(prompt, greedy, StopCriteria(max_tokens=16))  # warm-up
    runs = []
    for _ in range(3):
        toks, ttft, total = hb.generate_timed(prompt, greedy, stop)
        assert len(toks) == tokens, len(toks)
        runs.append((ttft, total))
    ttft = float(np.median([r[0] for r in runs]))
    total = float(np.median([r[1] for r in runs]))
    tps = (tokens - 1) / (total - ttft)
    wbytes = prog.weight_bytes_per_token("bf16")
    kv_mid = len(prompt) + tokens // 2
    per_op = prog.bytes_per_op(kv_len=kv_mid, weight_dtype="bf16", kv_dtype="bf16")
    kvbytes = sum(b for op, b in zip(prog.ops, per_op) if op.kind in ("attention", "kv_append"))
    bw = desc["copy_bandwidth_TBps"]
    res = dict(preset=preset, tokens=tokens, tok_s=round(tps, 1), ttft_ms=round(ttft * 1e3, 2),
               weight_GB=round(wbytes / 1e9, 3), kv_MB_mid=round(kvbytes / 1e6, 2),
               achieved_TBps=round(tps * (wbytes + kvbytes) / 1e12, 3), copy_TBps=bw,
               mbu=round(tps * (wbytes + kvbytes) / 1e12 / bw, 3), floor_tok_s=round(bw * 1e12 / (wbytes + kvbytes), 1),
               load_s=round(t_load, 1), stages=hb.nst, device=desc["device"], ptxas=hb.ptxas,
               variant=hb.variant)
    if breakdown:
        res["breakdown"] = hb.bench_breakdown(prompt, tokens) if hasattr(hb, "bench_breakdown") else None
    if masks:  # the developer's own skip masks (backend.bench_breakdown's bits), us/token each
        res["masks"] = hb.bench_breakdown(prompt, tokens, {f"mask {m:#x}": m for m in masks})
    hb.close()
    return res


def skip_masks(text: str) -> list[int]:
    """--masks: "0x40,0xc0" -> [64, 192] (argparse reports a bad one in one line)."""
    return [int(m, 0) for m in text.split(",") if m.strip()]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", action="append")
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--peer", default=None, help="path of torch_peer.py: run it for the same presets")
    ap.add_argument("--json", default=None)
    ap.add_argument("--no-breakdown", action="store_true")
    ap.add_argument("--masks", type=skip_masks, default=[], help="comma-separated skip masks to time "
                    "(backend.bench_breakdown's bits: 0x40 no waits, 0x80 no input loads, 0x4 no attention, ...)")
    a = ap.parse_args()
    results = []
    for p in a.preset or ["bench-2b"]:
        r = run(p, a.tokens, a.context, breakdown=not a.no_breakdown, masks=a.masks)
        r['env'] = {k: v for k, v in os.environ.items() if k.startswith('KOG_HOPPER_')}
        print(json.dumps(r), flush=True)
        if a.peer:
            peer_name = {"laneformer-2b": "laneformer-2b-dense"}.get(p, p)
            cp = subprocess.run([sys.executable, a.peer, "--preset", peer_name, "--tokens", str(a.tokens), "--modes", "compiled"],
                                capture_output=True, text=True)
            lines = (cp.stdout or "").strip().splitlines()
            try:
                r["peer"] = json.loads(lines[-1])
            except Exception:
                r["peer"] = {"error": (cp.stderr or "")[-800:]}
            print("peer:", json.dumps(r["peer"]), flush=True)
        results.append(r)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=1)
    print(f"{'preset':14s} {'tok/s':>8s} {'MBU':>6s} {'TTFT ms':>8s} {'GB/tok':>7s} {'peer tok/s':>10s}")
    for r in results:
        peer = r.get("peer", {})
        ptok = peer.get("compiled_tok_s", "?") if isinstance(peer, dict) else "?"
        print(f"{r['preset']:14s} {r['tok_s']:8.1f} {r['mbu']:6.3f} {r['ttft_ms']:8.2f} {r['weight_GB']:7.3f} {str(ptok):>10s}")


if __name__ == "__main__":
    main()
