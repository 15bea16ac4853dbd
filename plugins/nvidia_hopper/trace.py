"""Where a token's time goes, stage by stage: a TRACE build of the kernel records globaltimer
timestamps per (token, stage, block) for 4 tokens (kernels/context.cuh, "trace"); this script runs a
request on a preset with random weights and prints, per stage, how long its critical chain took
and why (waiting for the previous stage, loading the input, the block's own work, the weight
producer stalling on a full ring). The raw array is saved for a closer look.

    python3 -m kog_nvidia_hopper.trace --preset bench-2b --at 200 [--save trace.npz]
"""
from __future__ import annotations

import argparse
import os

import numpy as np


def summarize(tr: np.ndarray, labels: list[str], weight_bytes: list[int] | None = None) -> list[str]:
    """Text report of a trace [token, stage, block, 29 or 31] (ns; fields: context.cuh "trace"). Times
    are medians over the tokens.
    Per stage: chain = last block done - previous stage's last block done; lat = median block's
    wait end - previous last done (signal propagation); load/work = median block; spread = last
    done - median done (imbalance); p_ahead = how long before the median block got its input the
    producer had reached the stage; p_stall = producer time blocked on a full ring; c_wait = consumer
    time blocked on an empty slot (data not landed); rel = the release's own time. Attention stages
    also get their phases (blocks with a tile): q/k/v loaded + RoPE, first K/V, loop, partials,
    release, and the first sub-chunk's steps (scores, softmax, P.V, reduction); where blocks ran a
    second tile (KOG_HOPPER_ATT_TILES above the block count), the same for it, its code hot: from its
    start, q/k/v + RoPE, first K/V, loop, partials, then its sub-chunk's steps. Matvec stages with
    an input loader: when its input landed (thread 0) and the norm's sum done. The grid sampler's
    stage (sampled decoding): its keys ready after the wait, its rounds, and the rounds' summed
    histograms / atomics / arrival / bins read / choice. With the signal warp's stamps (fields 29-30):
    its release of the stage after the block's done (median), the release's fence, and how long
    after the previous stage's last fence the median block's wait ended (lat without the fences).
    A matvec stage with Laneformer's fused residual (field 20 without the sampler's 21): its tail
    pass, from its start to the block's done, median over the blocks that have rows in it.
    weight_bytes (bytes a stage streams, one entry per stage): the summary by stage kind adds the
    weights' rate over the work, TB/s (the median block's work against the stage's bytes spread
    evenly over the blocks: a long stage's steady state, e.g. the LM head's)."""
    tr = tr.astype(np.int64)
    ntok, nst, nb, ntr = tr.shape
    rows = []
    for k in range(ntok):
        t = tr[k]
        if not t[:, :, 3].all():
            continue
        prev = t[-1] if k == 0 else tr[k - 1, -1]  # the stage before the first: the token's (or the last one's) last
        prev_done = prev[:, 3].max()
        prev_fence = prev[:, 30].max() if ntr >= 31 else 0  # the signal warp's releases (fields 29-30)
        r = []
        for s in range(nst):
            done = t[s, :, 3]
            chain = done.max() - prev_done
            lat = np.median(t[s, :, 1]) - prev_done
            load = np.median(t[s, :, 2] - t[s, :, 1])
            work = np.median(done - t[s, :, 2])
            spread = done.max() - np.median(done)
            reached = t[s, :, 4]
            ahead = np.median(t[s, :, 1] - reached) if reached.any() else 0
            stall = np.median(t[s, :, 6]) if reached.any() else 0
            last = int(np.argmax(done))
            cwait = np.median(t[s, :, 8])
            rel = np.median(t[s, :, 9] - done) if t[s, :, 9].any() else 0
            tiles = t[s, :, 10] > 0
            ph, sub, hot = [0] * 5, [0.0] * 4, [0.0] * 8
            if tiles.any():
                tt = t[s][tiles]

                def steps(fields):  # median time between consecutive stamps, blocks with a tile
                    return [np.median(tt[:, f1] - tt[:, f0]) for f0, f1 in zip(fields, fields[1:])]
                ph = steps([1, 10, 11, 12, 13, 3])
                if t.shape[-1] >= 20 and tt[:, 19].all():  # first sub-chunk: scores, softmax, P.V, reduction
                    sub = steps([11, 16, 17, 18, 19])
                if t.shape[-1] >= 29:  # second tiles: the same phases with the code just run
                    two = t[s][t[s, :, 28] > 0]
                    if len(two):
                        hot = [np.median(two[:, f1] - two[:, f0])
                               for f0, f1 in zip([20, 21, 22, 23, 22, 25, 26, 27], [21, 22, 23, 24, 25, 26, 27, 28])]
            xin = np.median(t[s, :, 14] - t[s, :, 1]) if t[s, :, 14].all() else 0
            nrm = np.median(t[s, :, 15] - t[s, :, 14]) if xin and t[s, :, 15].all() else 0
            sg = [0.0] * 7  # the grid sampler (sample_grid.cuh): keys ready, rounds, the rounds' parts
            if t.shape[-1] >= 27 and t[s, :, 21].all() and not tiles.any():
                sg = [np.median(t[s, :, 20] - t[s, :, 1]), np.median(t[s, :, 21]) * 1e3,
                      *[np.median(t[s, :, f]) for f in range(22, 27)]]
            rs = [0.0] * 3  # release: block done -> signal warp's release begins, its fence; this wait after the last fence
            if ntr >= 31 and t[s, :, 30].all():
                rs[0] = np.median(t[s, :, 29] - done)
                rs[1] = np.median(t[s, :, 30] - t[s, :, 29])
            if ntr >= 31 and prev_fence:
                rs[2] = np.median(t[s, :, 1]) - prev_fence
            tail = 0.0  # the fused lane residual's pass (matvec.cuh LANE_RESIDUAL)
            if t.shape[-1] >= 22 and not tiles.any() and not t[s, :, 21].any() and t[s, :, 20].any():
                rows20 = t[s][t[s, :, 20] > 0]
                tail = np.median(rows20[:, 3] - rows20[:, 20])
            r.append((chain, lat, load, work, spread, ahead, stall, cwait, rel, *ph, int(t[s, last, 7]), xin, nrm, *sub, *hot, *sg, *rs,
                      tail))
            prev_done = done.max()
            prev_fence = t[s, :, 30].max() if ntr >= 31 else 0
        rows.append(r)
    if not rows:
        return ["trace: no complete token recorded (was the request long enough?)"]
    a = np.median(np.asarray(rows, np.float64), axis=0) / 1e3  # us
    out = [f"{'stage':>5s} {'label':24s} {'chain':>7s} {'lat':>6s} {'load':>6s} {'work':>7s} {'spread':>7s} "
           f"{'p_ahead':>8s} {'p_stall':>8s} {'c_wait':>7s} {'rel':>6s} {'last SM':>7s}"]
    for s in range(nst):
        c = a[s]
        line = (f"{s:5d} {labels[s][:24]:24s} {c[0]:7.2f} {c[1]:6.2f} {c[2]:6.2f} {c[3]:7.2f} {c[4]:7.2f} "
                f"{c[5]:8.2f} {c[6]:8.2f} {c[7]:7.2f} {c[8]:6.2f} {int(c[14] * 1e3):7d}")
        if c[9:14].any():
            line += "  attention phases " + " / ".join(f"{v:.2f}" for v in c[9:14])
            if c[17:21].any():
                line += " (first sub-chunk: " + " / ".join(f"{v:.2f}" for v in c[17:21]) + ")"
            if c[21:29].any():
                line += ("; second tile, code hot: " + " / ".join(f"{v:.2f}" for v in c[21:25])
                         + " (sub-chunk: " + " / ".join(f"{v:.2f}" for v in c[25:29]) + ")")
        if c[30]:
            line += (f"  sampler: keys {c[29]:.2f}, {c[30]:.0f} rounds: histograms / atomics / arrival / bins / "
                     "choice " + " / ".join(f"{v:.2f}" for v in c[31:36]))
        if c[15]:
            line += f"  load: input landed {c[15]:.2f}" + (f", norm sum {c[16]:.2f}" if c[16] else "")
        if c[37]:
            line += f"  release: signal warp +{c[36]:.2f}, fence {c[37]:.2f}"
        if c[38]:
            line += f"; waited {c[38]:.2f} after the last fence"
        if c[39]:
            line += f"  residual tail {c[39]:.2f}"
        out.append(line)
    by, nbytes = {}, {}
    for s in range(nst):
        by[labels[s]] = by.get(labels[s], 0) + a[s, :7]
        nbytes[labels[s]] = nbytes.get(labels[s], 0) + (weight_bytes[s] if weight_bytes else 0)
    rate = " / weights TB/s over the work" if weight_bytes else ""
    out.append(f"token: {a[:, 0].sum():.1f} us; by stage kind (sum of chain / lat / load / work / spread / p_stall{rate}):")
    for key, v in sorted(by.items(), key=lambda kv: -kv[1][0]):
        line = f"  {key[:40]:40s} {v[0]:8.1f} {v[1]:7.1f} {v[2]:7.1f} {v[3]:8.1f} {v[4]:7.1f} {v[6]:8.1f}"
        if nbytes[key] and v[3] > 0:
            line += f" {nbytes[key] / (v[3] * 1e-6) / 1e12:7.2f}"
        out.append(line)
    last_sms = [int(r[14]) for r in np.asarray(rows)[0]]
    vals, counts = np.unique(last_sms, return_counts=True)
    out.append("most often last SM (token 0): " + ", ".join(f"{v}x{c}" for v, c in sorted(zip(vals, counts), key=lambda x: -x[1])[:5]))
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="bench-2b")
    ap.add_argument("--at", type=int, default=200, help="first traced token iteration")
    ap.add_argument("--tokens", type=int, default=300)
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--save", default=None)
    ap.add_argument("--skip", type=lambda v: int(v, 0), default=0,
                    help="breakdown skip mask (backend.bench_breakdown), e.g. 0xc4: weights only")
    ap.add_argument("--temperature", type=float, default=0.0, help="sampled decoding (greedy by default)")
    ap.add_argument("--top-k", type=int, default=0)
    ap.add_argument("--top-p", type=float, default=1.0)
    a = ap.parse_args()
    if a.skip and a.temperature > 0:
        # without the waits between stages, blocks could reach the grid sampler's next token while
        # others still read this one's bins
        ap.error("--skip traces greedy decoding only: leave out --temperature")
    os.environ["KOG_HOPPER_TRACE"] = str(a.at)
    from kog_core.interfaces import SamplingParams, StopCriteria
    from .bench import load_preset
    _, hb = load_preset(a.preset, a.context)
    prompt = [1, 2, 3, 4]
    params = SamplingParams(temperature=a.temperature, top_k=a.top_k, top_p=a.top_p, seed=0)
    hb.generate_timed(prompt, params, StopCriteria(max_tokens=a.tokens))
    if a.skip:
        total = hb._time_request(prompt, a.tokens, a.skip)
        ttft = 0.0
    else:
        _, ttft, total = hb.generate_timed(prompt, params, StopCriteria(max_tokens=a.tokens))
    tr = hb.read_trace()
    labels = hb.stage_summary()
    from .schedule import stage_weight_bytes
    wbytes = [stage_weight_bytes(st) for st in hb.stages]
    if a.save:
        np.savez_compressed(a.save, trace=tr, labels=np.asarray(labels), weight_bytes=np.asarray(wbytes))
    how = "greedy" if a.temperature <= 0 else f"temperature {a.temperature}, top-k {a.top_k}, top-p {a.top_p}"
    print(f"{a.preset}: {(a.tokens - 1) / (total - ttft):.1f} tok/s (trace build, {how}, skip {a.skip:#x}), variant {hb.variant}")
    print("\n".join(summarize(tr, labels, wbytes)))
    hb.close()


if __name__ == "__main__":
    main()
