"""Benchmark of the weight stream alone (kernels/stream_probe.cu): TB/s of a shared-memory ring
fed by cp.async.bulk and of plain 16-byte loads, one block per SM, over a 4 GB buffer, with
and without consumer work and pauses. Answers "how fast can this machinery stream at all, and
what does a pause at a stage boundary cost", apart from the decode kernel.

    python3 -m kog_nvidia_hopper.stream_probe [--quick] [--json out.json]

Every line: the configuration, the median of 5 timed launches in TB/s (bytes read), and the
share of the card's copy bandwidth (read + written, measured in the same process).
"""
from __future__ import annotations

import argparse
import ctypes
import json

import numpy as np

from kog_nvidia_hopper.cuda_util import NVRTC_OPTIONS, check, compile_cubin, kernel_source

BUFFER_BYTES = 4 << 30


def compile_probe(unroll: int = 8) -> tuple[bytes, str]:
    src = f"#define UNROLL {unroll}\n" + kernel_source("stream_probe.cu")
    return compile_cubin(src, NVRTC_OPTIONS, name="stream_probe.cu")


# A configuration is (name, kind, settings). Ring settings: consumer warps, slots, slot KB, bulk
# copies per slot, consumer dot products (1) or none (0), a pause of `ns` every `every` items,
# pause stagger, L2 prefetch distance, prefetch warp, cp.async warps (`lsu_kb` of each slot, all of
# it by default), KB of register loads per item, blocks (default: one per SM), traced.
# DECODE_RING is the decode kernel's ring on bench-2b (v15): 10 consumer warps, 6 x 31 KB.
DECODE_RING = dict(warps=10, slots=6, kb=31, chunks=1, consume=1, every=0, ns=0, skew=0, prefetch=0,
                   pf_warp=0, ldgsts=0, extra_kb=0, lat_warp=0, lat_kind=0)
LAT_KINDS = {0: "ld.cg", 1: "ld.acquire.gpu", 2: "fence.acq_rel + ld.cg", 3: "code block cold / hot"}


def configs(quick: bool = False, round_: int = 1):
    if round_ != 1:
        return {2: configs_round2, 3: configs_round3, 4: configs_round4, 5: configs_round5, 6: configs_round6,
                7: configs_round7, 8: configs_round8, 9: configs_round9,
                10: configs_round10, 11: configs_round11, 12: configs_round12, 13: configs_round13,
                14: configs_round14, 15: configs_round15}[round_]()
    out = []
    base = DECODE_RING
    out.append(("ring as decode (10w, 6x31KB, dot)", "ring", base))
    out.append(("  no consumer work", "ring", dict(base, consume=0)))
    for every, ns in ((4, 1000), (4, 3000), (8, 3000), (16, 3000)):
        out.append((f"  pause {ns} ns every {every} items", "ring", dict(base, every=every, ns=ns)))
        if quick:
            break
    for slots, kb in ((4, 48), (8, 23), (12, 16), (16, 12), (3, 64)):
        out.append((f"  {slots} x {kb} KB", "ring", dict(base, slots=slots, kb=kb)))
    for chunks in (2, 4, 8):
        out.append((f"  each slot as {chunks} bulk copies", "ring", dict(base, chunks=chunks)))
    for warps in (4, 8, 16):
        out.append((f"  {warps} consumer warps", "ring", dict(base, warps=warps)))
    out.append(("  12 x 16 KB, pause 3000 ns every 8", "ring", dict(base, slots=12, kb=16, every=8, ns=3000)))
    for unroll in ((8,) if quick else (4, 8, 16)):
        for threads in (384, 1024):
            out.append((f"ldg {threads} threads x {unroll} loads in flight", "ldg", dict(unroll=unroll, threads=threads)))
    return out


def configs_round2():
    """Why a pause is not hidden by the ring: per-SM ceiling (fewer blocks), staggered pauses, traces."""
    base = DECODE_RING
    p8 = dict(base, every=8, ns=3000)
    return [
        ("ring as decode (10w, 6x31KB, dot), traced", "ring", dict(base, trace=1)),
        ("  pause 3000 ns every 8, traced", "ring", dict(p8, trace=1)),
        ("  pause 3000 ns every 8, staggered by block", "ring", dict(p8, skew=1)),
        ("  66 blocks", "ring", dict(base, blocks=66)),
        ("  33 blocks", "ring", dict(base, blocks=33)),
        ("  66 blocks, pause 3000 ns every 8", "ring", dict(p8, blocks=66)),
        ("  12 x 16 KB, pause 3000 ns every 16", "ring", dict(p8, slots=12, kb=16, every=16)),
        ("  3 x 64 KB, pause 3000 ns every 4", "ring", dict(p8, slots=3, kb=64, every=4)),
        ("  66 blocks, 12 x 16 KB, traced", "ring", dict(base, blocks=66, slots=12, kb=16, trace=1)),
        ("ldg 384 threads x 16 loads, 66 blocks", "ldg", dict(unroll=16, threads=384, blocks=66)),
        ("  L2 prefetch 4 items ahead", "ring", dict(base, prefetch=4)),
        ("  L2 prefetch 4 ahead, pause 3000 ns every 8", "ring", dict(p8, prefetch=4)),
        ("  L2 prefetch 8 ahead, pause 3000 ns every 8", "ring", dict(p8, prefetch=8)),
        ("  L2 prefetch 16 ahead, pause 3000 ns every 8", "ring", dict(p8, prefetch=16)),
        ("  L2 prefetch 8 ahead, pause 3000 ns every 8, traced", "ring", dict(p8, prefetch=8, trace=1)),
        ("  prefetch warp 8 ahead", "ring", dict(base, prefetch=8, pf_warp=1)),
        ("  prefetch warp 8 ahead, pause 3000 ns every 8", "ring", dict(p8, prefetch=8, pf_warp=1)),
        ("  prefetch warp 16 ahead, pause 3000 ns every 8", "ring", dict(p8, prefetch=16, pf_warp=1)),
    ]


def configs_round3():
    """The copy engine's per-SM ceiling (~35 KB/us, round 2) against per-thread cp.async (LDGSTS)."""
    base = DECODE_RING
    p8 = dict(base, every=8, ns=3000)
    return [
        ("bulk 6 x 31 KB, 132 blocks", "ring", base),
        ("bulk 6 x 31 KB, 66 blocks", "ring", dict(base, blocks=66)),
        ("ldgsts 6 x 31 KB, 132 blocks", "ring", dict(base, ldgsts=1)),
        ("ldgsts 6 x 31 KB, 66 blocks", "ring", dict(base, ldgsts=1, blocks=66)),
        ("ldgsts 6 x 31 KB, 33 blocks", "ring", dict(base, ldgsts=1, blocks=33)),
        ("ldgsts 6 x 31 KB, pause 3000 ns every 8", "ring", dict(p8, ldgsts=1)),
        ("bulk 6 x 31 KB, pause 3000 ns every 8", "ring", p8),
        ("ldgsts 12 x 16 KB, 132 blocks", "ring", dict(base, ldgsts=1, slots=12, kb=16)),
        ("ldgsts 12 x 16 KB, pause 3000 ns every 16", "ring", dict(p8, ldgsts=1, slots=12, kb=16, every=16)),
        ("ldgsts 6 x 31 KB, 66 blocks, traced", "ring", dict(base, ldgsts=1, blocks=66, trace=1)),
        ("ldg 384 threads x 16 loads, 33 blocks", "ldg", dict(unroll=16, threads=384, blocks=33)),
    ]


def configs_round4():
    """Bulk copy and cp.async side by side: do their per-SM ceilings add up?"""
    base = dict(DECODE_RING, kb=32)
    p8 = dict(base, every=8, ns=3000)
    return [
        ("bulk 6 x 32 KB, 66 blocks", "ring", dict(base, blocks=66)),
        ("cp.async 2 warps, 66 blocks", "ring", dict(base, blocks=66, ldgsts=2)),
        ("cp.async 4 warps, 66 blocks", "ring", dict(base, blocks=66, ldgsts=4)),
        ("bulk 16 KB + cp.async 2 warps 16 KB, 66 blocks", "ring", dict(base, blocks=66, ldgsts=2, lsu_kb=16)),
        ("bulk 20 KB + cp.async 2 warps 12 KB, 66 blocks", "ring", dict(base, blocks=66, ldgsts=2, lsu_kb=12)),
        ("bulk 16 KB + cp.async 2 warps 16 KB, 132 blocks", "ring", dict(base, ldgsts=2, lsu_kb=16)),
        ("  + pause 3000 ns every 8", "ring", dict(p8, ldgsts=2, lsu_kb=16)),
        ("bulk 6 x 32 KB, pause 3000 ns every 8", "ring", p8),
        ("cp.async 4 warps, 132 blocks", "ring", dict(base, ldgsts=4)),
    ]


def configs_round5():
    """The ring plus plain loads into the consumers' registers: do those ceilings add up?"""
    base = dict(DECODE_RING, kb=32)
    return [
        ("bulk 6 x 32 KB, 66 blocks", "ring", dict(base, blocks=66)),
        ("  + 16 KB of loads per item, 66 blocks", "ring", dict(base, blocks=66, extra_kb=16)),
        ("  + 32 KB of loads per item, 66 blocks", "ring", dict(base, blocks=66, extra_kb=32)),
        ("  + 16 KB of loads per item, 132 blocks", "ring", dict(base, extra_kb=16)),
        ("  + 16 KB, pause 3000 ns every 8, 132 blocks", "ring", dict(base, extra_kb=16, every=8, ns=3000)),
        ("bulk 6 x 32 KB, pause 3000 ns every 8", "ring", dict(base, every=8, ns=3000)),
    ]


def configs_round6():
    """What does one global load cost a consumer while the ring streams? (A stage boundary's
    counter poll, input load and residual load are such loads, one after another.)"""
    base = DECODE_RING
    lat = dict(base, lat_warp=1)
    return [
        ("load chains alone, ld.cg", "lat", dict(lat_kind=0)),
        ("load chains alone, ld.acquire.gpu", "lat", dict(lat_kind=1)),
        ("load chains alone, fence + ld.cg", "lat", dict(lat_kind=2)),
        ("ring as decode + chains, ld.cg", "ring", dict(lat, lat_kind=0)),
        ("ring as decode + chains, ld.acquire.gpu", "ring", dict(lat, lat_kind=1)),
        ("ring as decode + chains, fence + ld.cg", "ring", dict(lat, lat_kind=2)),
        ("  3 x 31 KB + chains, ld.cg", "ring", dict(lat, slots=3)),
        ("  4 x 31 KB + chains, ld.cg", "ring", dict(lat, slots=4)),
        ("  66 blocks + chains, ld.cg", "ring", dict(lat, blocks=66)),
        ("  no consumer work + chains, ld.cg", "ring", dict(lat, consume=0)),
        ("  pause 3000 ns every 8 + chains, ld.cg", "ring", dict(lat, every=8, ns=3000)),
    ]


def configs_round7():
    """Does the copy engine fill shared memory faster from L2 than from HBM? (If so, weights asked
    of L2 during a stage boundary's pause could be caught up after it.) Each block re-reads a share
    of `wrap` items: 6 x 31 KB = 24 MB over 132 blocks, within the H200's 50 MB L2."""
    base = DECODE_RING
    return [
        ("ring as decode, from HBM", "ring", base),
        ("  from L2 (6 items a block, re-read)", "ring", dict(base, wrap=6)),
        ("  from L2, 66 blocks", "ring", dict(base, wrap=6, blocks=66)),
        ("  from L2, 33 blocks", "ring", dict(base, wrap=6, blocks=33)),
        ("  from L2, no consumer work", "ring", dict(base, wrap=6, consume=0)),
        ("  from L2, 3 x 64 KB", "ring", dict(base, wrap=3, slots=3, kb=64)),
        ("  from L2, 12 x 16 KB", "ring", dict(base, wrap=12, slots=12, kb=16)),
        ("  from L2 + chains, ld.cg", "ring", dict(base, wrap=6, lat_warp=1)),
    ]


def configs_round8():
    """How much slack over the copies do the consumers need? Each item costs the consumers a
    little more (a pause of `ns` after every item, their barrier included): if the ring's rate
    falls as soon as the consumers' time per item nears the copy's, consumer speed per item is
    what the decode kernel's stream (~27 KB/us per SM on the LM head, the probe 34) lacks."""
    base = DECODE_RING
    out = [("ring as decode (10w, 6x31KB, dot)", "ring", base)]
    for ns in (100, 200, 300, 500):
        out.append((f"  + {ns} ns per item", "ring", dict(base, every=1, ns=ns)))
    out.append(("  8 consumer warps, 5 x 32 KB", "ring", dict(base, warps=8, slots=5, kb=32)))
    out.append(("  8 consumer warps, 5 x 32 KB, + 200 ns per item", "ring", dict(base, warps=8, slots=5, kb=32, every=1, ns=200)))
    return out


def configs_round9():
    """Instruction fetch: does code that has not run for a while cost microseconds while the rings
    stream? The attention's steps (perf notes session 8) take 0.3-1.1 us for a few dozen
    instructions a warp, with no global loads. A 16 KB block of straight-line code is timed cold
    (after 16 or 128 KB of other code) and hot, alone and beside the decode-like ring."""
    base = DECODE_RING
    out = []
    for evict, what in ((0, "no other code between"), (1, "after 16 KB of other code"), (2, "after 128 KB of other code")):
        out.append((f"16 KB code block alone, {what}", "lat", dict(lat_kind=3, evict=evict)))
    for evict, what in ((0, "no other code between"), (1, "after 16 KB"), (2, "after 128 KB")):
        out.append((f"ring as decode + code block, {what}", "ring", dict(base, lat_warp=1, lat_kind=3, evict=evict)))
    return out


def configs_round10():
    """Round 9 again with the clock fixed, then the same with the ring's copies marked L2 evict-first:
    while the ring streams, is cold code slow because the stream evicted it from L2 (an instruction
    miss then goes to HBM behind the stream)? Also: does the hint cost the ring bandwidth, and does it
    shorten a dependent L2 load (a stage boundary's poll or input)?"""
    base = DECODE_RING
    out = configs_round9()
    for evict, what in ((0, "no other code between"), (2, "after 128 KB")):
        out.append((f"ring evict-first + code block, {what}", "ring", dict(base, lat_warp=1, lat_kind=3, evict=evict, l2_first=1)))
    out.append(("ring as decode, evict-first", "ring", dict(base, l2_first=1)))
    out.append(("ring as decode + ld.cg chains", "ring", dict(base, lat_warp=1, lat_kind=0)))
    out.append(("ring evict-first + ld.cg chains", "ring", dict(base, lat_warp=1, lat_kind=0, l2_first=1)))
    return out


def configs_round11():
    """How much code fits in the instruction caches: the 16 KB block cold after 16 to 128 KB of other
    code, alone and beside the ring (evict-first, as the kernel streams since session 9)."""
    base = dict(DECODE_RING, l2_first=1)
    sizes = ((1, 16), (3, 32), (4, 64), (5, 96), (2, 128))
    out = [(f"16 KB code block alone, after {kb} KB", "lat", dict(lat_kind=3, evict=e)) for e, kb in sizes]
    out += [(f"ring evict-first + code block, after {kb} KB", "ring", dict(base, lat_warp=1, lat_kind=3, evict=e))
            for e, kb in sizes]
    return out


def configs_round12():
    """Does the ring's rate follow the bytes of its items? Every K = 2048 stage (and the LM head,
    which streams at 3.81 TB/s in its steady state, session 12) fills its 31 KB slots 30 / 30 / 20
    KB, 26.7 on average: the decode ring with smaller items in the same slots, as evict-first."""
    base = dict(DECODE_RING, l2_first=1)
    out = [("ring as decode, 6 x 31 KB items, evict-first", "ring", base)]
    out += [(f"  6 x {kb} KB items", "ring", dict(base, kb=kb)) for kb in (27, 24, 20)]
    out += [("  7 x 27 KB items (the same bytes in flight as 6 x 31)", "ring", dict(base, slots=7, kb=27))]
    return out


def configs_round13():
    """The decode kernel's own item mix: its K = 2048 stages (bench-2b's and llama-3.2-1b's q/k/v,
    o_proj, gate/up and LM head) cycle items of 30 / 30 / 20 KB through 31 KB slots, packed one after
    another; its LM head streams at ~3.86 TB/s (session 16's trace), laneformer-2b's all-30 KB
    items faster. Does the mix cost the ring ~10%, and do 5 slots (v25), 4 x 40 KB slots
    (KOG_HOPPER_SLOT_KB=40: K = 2048 items of 20 x 1024, all full) or 5 x 36 KB (what
    the removed KOG_HOPPER_SLOT_SEARCH picked) change it?"""
    base = dict(DECODE_RING, l2_first=1)
    mix = dict(base, item_kb=30, short_every=3, short_kb=20)
    full30 = dict(base, short_every=1, short_kb=30)
    return [("ring as decode, 6 x 31 KB items, evict-first", "ring", base),
            ("  5 x 31 KB (v25's ring)", "ring", dict(base, slots=5)),
            ("  6 slots, items 30 / 30 / 20 KB packed", "ring", mix),
            ("  5 slots, items 30 / 30 / 20 KB packed", "ring", dict(mix, slots=5)),
            ("  6 slots, items all 30 KB packed", "ring", full30),
            ("  5 slots, items all 30 KB packed", "ring", dict(full30, slots=5)),
            ("  4 x 40 KB slots and items", "ring", dict(base, slots=4, kb=40)),
            ("  5 x 36 KB slots and items", "ring", dict(base, slots=5, kb=36)),
            ("  5 x 36 KB slots, items 31 KB packed", "ring", dict(base, slots=5, kb=36, short_every=1, short_kb=31))]


def configs_round14():
    """Round 13 again with the mixed-size path's 64-bit divisions gone (a running position in the
    cycle), plus its control: full 31 KB items taken through the mixed-size path (the same bytes
    and slots as v25's ring). Round 13 measured the packed mixes 9-15% under full items (3.81
    TB/s for 30 / 30 / 20 KB, the LM head's rate in the decode kernel); the decode kernel itself
    lost with uniform full items (32 and 40 KB slots, session 17). Is the mix's cost the memory
    system's or the probe's per-item code?"""
    base = dict(DECODE_RING, l2_first=1, slots=5)
    mix = dict(base, item_kb=30, short_every=3, short_kb=20)
    return [("ring as decode, 5 x 31 KB items, evict-first", "ring", base),
            ("  5 x 31 KB, full items by the mixed path", "ring", dict(base, short_every=1, short_kb=31)),
            ("  items 30 / 30 / 20 KB packed", "ring", mix),
            ("  items all 30 KB packed", "ring", dict(base, short_every=1, short_kb=30)),
            ("  5 x 36 KB slots, items 31 KB packed", "ring", dict(base, kb=36, short_every=1, short_kb=31)),
            ("  6 slots, items 30 / 30 / 20 KB packed", "ring", dict(mix, slots=6))]


def configs_round15():
    """The LM head's own layout. Alone (skip mask 0xce, session 17) bench-2b's LM head streams at
    ~3.2 TB/s, ~1.1 us an item, in items of the probe's round-14 mix (30 / 30 / 20 KB), which the
    probe streams at 4.34. The head's blocks each stream one ~3.9 MB share (971-972 rows of 4 KB),
    the shares back to back, all blocks in step; the probe's blocks stream 32 MB shares. Does the
    layout (short shares at a ~3.9 MB stride) or the decode kernel's own per-item code make the
    difference? The short runs (~120 us) carry a ring fill and a tail: compare the rows with each
    other, not with round 14."""
    base = dict(DECODE_RING, l2_first=1, slots=5)
    mix = dict(base, item_kb=30, short_every=3, short_kb=20)
    return [("items 30 / 30 / 20 KB, 32 MB shares (round 14)", "ring", mix),
            ("  the same, 3840 KB shares back to back (LM head)", "ring", dict(mix, share_kb=3884)),
            ("  3840 KB shares at a 3877 KB stride", "ring", dict(mix, share_kb=3884, stride_kb=3877)),
            ("  3840 KB shares at a 4096 KB stride", "ring", dict(mix, share_kb=3884, stride_kb=4096)),
            ("  full 31 KB items, 3813 KB shares", "ring", dict(base, share_kb=3884)),
            ("  4 x 40 KB items, 3840 KB shares", "ring", dict(base, slots=4, kb=40, share_kb=3884))]


def ring_share(name: str, s: dict, blocks: int) -> tuple[int, int]:
    """(bytes each block streams, stride between the blocks' shares; 0: back to back) of a ring
    configuration. Mixed item sizes (rounds 13-15: every short_every-th item short_kb, the others
    item_kb, packed back to back) take one bulk copy an item and nothing else; a share is a whole
    number of items (or cycles), at most the buffer's part per block, or share_kb (round 15)."""
    slot = s["kb"] * 1024
    unit = slot + s["extra_kb"] * 1024
    short_every = s.get("short_every", 0)
    if short_every:
        item_bytes, short_bytes = s.get("item_kb", s["kb"]) * 1024, s.get("short_kb", 0) * 1024
        if s["chunks"] != 1 or s["ldgsts"] or s["extra_kb"] or s.get("wrap") or s["prefetch"] or s["pf_warp"]:
            raise SystemExit(f"{name}: mixed item sizes take one bulk copy an item and nothing else")
        if max(item_bytes, short_bytes) > slot:
            raise SystemExit(f"{name}: an item is larger than its slot")
        unit = (short_every - 1) * item_bytes + short_bytes
    per_block = (BUFFER_BYTES // blocks) // unit * unit
    if s.get("share_kb"):
        per_block = min(per_block, s["share_kb"] * 1024 // unit * unit)
    stride = s.get("stride_kb", 0) * 1024
    if stride and (stride < per_block or stride * blocks > BUFFER_BYTES):
        raise SystemExit(f"{name}: a block's stride must hold its share and the grid fit the buffer")
    return per_block, stride


def trace_summary(tr: np.ndarray, every: int) -> list[str]:
    """tr: [n, 3] (issue, wait start, wait end) of block 0's items, ns."""
    n = len(tr)
    lo, hi = n // 4, n  # steady state: skip the start
    lat = tr[lo:hi, 2] - tr[lo:hi, 0]
    wait = tr[lo:hi, 2] - tr[lo:hi, 1]
    gap = np.diff(tr[lo:hi, 2])
    out = [f"    block 0, items {lo}-{hi}: issue->seen median {np.median(lat) / 1e3:.2f} us (p10 {np.percentile(lat, 10) / 1e3:.2f}, "
           f"p90 {np.percentile(lat, 90) / 1e3:.2f}); consumer wait median {np.median(wait) / 1e3:.2f} us; "
           f"item every {np.median(gap) / 1e3:.2f} us"]
    a = (n // 2) // max(every, 1) * max(every, 1) - 2
    t0 = tr[a, 0]
    for q in range(a, min(a + 2 * max(every, 8) + 2, n)):
        i, w0, w1 = (tr[q] - t0) / 1e3
        out.append(f"    item {q:5d}: issued {i:7.2f}  wait {w0:7.2f} -> {w1:7.2f} us")
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json", default=None)
    ap.add_argument("--round", type=int, nargs="+", default=[1],
                    help="1: the survey; 2: why pauses are not hidden; 3: copy engine vs cp.async; 4: both; "
                         "5: ring + register loads; 6: a load's latency while the ring streams; 7: the ring from L2; "
                         "8: consumer time per item; 9: instruction fetch; 10: the same, clock fixed, and the "
                         "ring's copies L2 evict-first; 11: instruction cache sizes; 12: item bytes "
                         "in the same slots; 13: the decode kernel's item mix (30 / 30 / 20 KB), 5 slots, "
                         "4 x 40 KB; 14: round 13 without its per-item divisions; 15: the LM head's per-block shares (several: in turn)")
    a = ap.parse_args()
    from kog_nvidia_hopper.backend import HopperBackend
    hb = HopperBackend()  # context, stream and the copy-bandwidth measurement
    drv = hb.drv
    copy_bw = hb.copy_bandwidth()
    nb = hb.sms
    buf = hb._alloc(BUFFER_BYTES)
    check(drv.cuMemsetD32(buf, 0x3f803f80, BUFFER_BYTES // 4), "memset")
    outp = hb._alloc(4 * nb)
    # the latency chains' table: 1024 u32 a line (128 B) apart, a cycle through all of them
    chase_n = 1024 * 32
    chase = np.zeros(chase_n, np.uint32)
    order = np.random.default_rng(0).permutation(1024)
    for k in range(1024):
        chase[order[k] * 32] = order[(k + 1) % 1024] * 32
    d_chase = hb._alloc(chase.nbytes)
    check(drv.cuMemcpyHtoD(d_chase, chase.ctypes.data, chase.nbytes), "cuMemcpyHtoD(chase)")
    d_lat = hb._alloc(4 * 8)  # sum, count, worst (+ the code probe's hot sum)
    mods = {}

    def fn(kind, unroll=8):
        key = (kind, unroll)
        if key not in mods:
            cubin, _ = compile_probe(unroll)
            mod = check(drv.cuModuleLoadData(cubin), "cuModuleLoadData")
            f = check(drv.cuModuleGetFunction(mod, b"probe_" + kind.encode()), "cuModuleGetFunction")
            if kind == "lat":
                mods[key] = f
                return f
            check(drv.cuFuncSetAttribute(f, drv.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                                         hb.max_smem - 8192), "cuFuncSetAttribute")
            mods[key] = f
        return mods[key]

    e0 = check(drv.cuEventCreate(0)); e1 = check(drv.cuEventCreate(0))
    results = []
    ntrace = 4096
    d_trace = hb._alloc(ntrace * 3 * 8)
    for name, kind, s in [c for r in a.round for c in configs(a.quick, r)]:
        blocks = s.get("blocks", nb)
        if kind == "lat":
            per_block = 0
            args = [ctypes.c_uint64(d_chase), ctypes.c_int(s["lat_kind"]), ctypes.c_uint32(256), ctypes.c_uint64(d_lat),
                    ctypes.c_int(s.get("evict", 0))]
            f, threads, smem = fn("lat"), 32, 0
        elif kind == "ring":
            slot = s["kb"] * 1024
            per_block, stride = ring_share(name, s, blocks)
            short_every = s.get("short_every", 0)
            item_bytes, short_bytes = s.get("item_kb", s["kb"]) * 1024, s.get("short_kb", 0) * 1024
            args = [ctypes.c_uint64(buf), ctypes.c_uint64(per_block), ctypes.c_uint32(s["slots"]), ctypes.c_uint32(slot),
                    ctypes.c_uint32(s["chunks"]), ctypes.c_int(s["consume"]), ctypes.c_uint32(s["every"]),
                    ctypes.c_uint32(s["ns"]), ctypes.c_uint32(s["skew"]), ctypes.c_uint32(s["prefetch"]), ctypes.c_int(s["pf_warp"]), ctypes.c_int(s["ldgsts"]),
                    ctypes.c_uint32(s.get("lsu_kb", s["kb"] if s["ldgsts"] else 0) * 1024), ctypes.c_uint32(s["extra_kb"] * 1024),
                    ctypes.c_uint64(outp), ctypes.c_uint64(d_trace if s.get("trace") else 0), ctypes.c_uint32(ntrace),
                    ctypes.c_int(s["lat_warp"]), ctypes.c_int(s["lat_kind"]), ctypes.c_uint64(d_chase), ctypes.c_uint64(d_lat),
                    ctypes.c_uint32(s.get("wrap", 0)), ctypes.c_int(s.get("evict", 0)),
                    ctypes.c_int(s.get("l2_first", 0)), ctypes.c_uint32(item_bytes), ctypes.c_uint32(short_every),
                    ctypes.c_uint32(short_bytes), ctypes.c_uint64(stride)]
            f, threads, smem = fn("ring"), 32 * (s["warps"] + 1 + s["ldgsts"] + s["pf_warp"] + s["lat_warp"]), s["slots"] * slot
        else:
            per_block = (BUFFER_BYTES // blocks) // 16 * 16
            args = [ctypes.c_uint64(buf), ctypes.c_uint64(per_block), ctypes.c_uint64(outp)]
            f, threads, smem = fn("ldg", s["unroll"]), s["threads"], 0
        ptrs = (ctypes.c_void_p * len(args))(*[ctypes.addressof(x) for x in args])
        times = []
        check(drv.cuMemsetD32(d_lat, 0, 8), "cuMemsetD32(lat)")
        for _ in range(6):
            check(drv.cuEventRecord(e0, hb.stream))
            check(drv.cuLaunchKernel(f, blocks, 1, 1, threads, 1, 1, smem, hb.stream, ctypes.addressof(ptrs), 0), "cuLaunchKernel")
            check(drv.cuEventRecord(e1, hb.stream))
            check(drv.cuEventSynchronize(e1))
            times.append(check(drv.cuEventElapsedTime(e0, e1)) / 1e3)
        t = float(np.median(times[1:]))
        tbps = per_block * blocks / t / 1e12
        r = dict(name=name.strip(), kind=kind, **s, TBps=round(tbps, 3), of_copy=round(tbps / copy_bw, 3))
        results.append(r)
        line = f"{name:44s} {tbps:6.3f} TB/s  {tbps / copy_bw:5.3f} of copy"
        if kind == "lat" or s.get("lat_warp"):
            lat = np.zeros(4, np.uint64)
            check(drv.cuMemcpyDtoH(lat.ctypes.data, d_lat, lat.nbytes), "cuMemcpyDtoH(lat)")
            if s.get("lat_kind") == 3:  # (cold ns, runs, worst cold, hot ns) of the code block
                runs = max(float(lat[1]), 1.0)
                r["code_cold_ns"], r["code_hot_ns"] = round(float(lat[0]) / runs, 1), round(float(lat[3]) / runs, 1)
                r["code_worst_cold_ns"] = int(lat[2])
                line += (f"  16 KB code: cold {r['code_cold_ns']:8.1f} ns, hot {r['code_hot_ns']:8.1f} ns "
                         f"(worst cold {int(lat[2])} ns, {int(lat[1])} runs)")
            else:
                r["load_ns"] = round(float(lat[0]) / max(float(lat[1]), 1.0), 1)
                r["worst_chain_ns"] = int(lat[2])
                line += f"  one load {r['load_ns']:7.1f} ns (worst chain of 8: {int(lat[2])} ns)"
        print(line, flush=True)
        if s.get("trace"):
            tr = np.zeros((ntrace, 3), np.uint64)
            check(drv.cuMemcpyDtoH(tr.ctypes.data, d_trace, tr.nbytes), "cuMemcpyDtoH(trace)")
            lines = trace_summary(tr[:min(ntrace, per_block // (s["kb"] * 1024 + s["extra_kb"] * 1024))].astype(np.int64), s["every"])
            r["trace"] = lines
            print("\n".join(lines), flush=True)
    print(f"copy bandwidth {copy_bw:.3f} TB/s, {nb} blocks, {BUFFER_BYTES >> 30} GB buffer", flush=True)
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(dict(copy_TBps=copy_bw, results=results), fh, indent=1)
    hb.close()


if __name__ == "__main__":
    main()
