"""Where the kernel goes through local memory or the generic path, by source line.

Compiles a build of kernels/decode.cu (with its .cuh files spliced in), disassembles the cubin with nvdisasm (line info) and
counts per source line:
  - local loads / stores (LDL / STL): spills, arrays whose address escapes, values behind a
    reference parameter of a noinline function. With 227 KB of shared memory taken, L1 is ~20 KB,
    so a local load can be an L2 round trip;
  - generic loads / stores (LD.E / ST.E): a pointer whose address space the compiler could not
    see. For shared memory that is a slower path than LDS / STS (perf notes v16a: the matvec's
    input row came this way in every item).
Both of session 7's gains were found this way (perf notes v16a, v16b).

    python3 -m kog_nvidia_hopper.sass_report [--set KEY=VALUE ...] [--top N]

nvdisasm is not a dependency: it comes from the `nvidia-cuda-nvdisasm` wheel (`pip download
--no-deps nvidia-cuda-nvdisasm`, unzip, `nvidia/cu13/bin/nvdisasm`); found through $KOG_NVDISASM
or on PATH.
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import tempfile
from collections import Counter

from kog_core.errors import KogError

# bench-2b's default build (v25): 10 consumer warps, a 5 x 31 KB ring after 32 KB of stage
# scratch, the attention's shapes compiled in, the grid sampler (4 candidates a thread), a
# 128-byte ring
DEFAULT_BUILD = dict(NT=320, NSLOTS=5, SLOT_BYTES=31744, RING_OFF=32768, KV_BUFS=1, SIGNAL_WARP=1,
                     INLINE_ATTENTION=1, PREFETCH=0, NORM_SMEM=1, STREAM_L2_FIRST=1,
                     NORM_RCP=1, ATT_FASTDIV=1, SAMPLE_GRID=1, SAMPLE_EPT=4, SMEM_ALIGN=128, DEFER_NORM=1, SIGNAL_BAR=1,
                     ATC_L=1, ATC_H=16, ATC_HKV=8, ATC_HD=128, ATC_T=4096, ATC_MAXCH=16,
                     ATC_ROPE_Q=1, ATC_ROPE_K=1)
KINDS = {"LDL": re.compile(r"\bLDL(\.|\s)"), "STL": re.compile(r"\bSTL(\.|\s)"),
         "LD.E": re.compile(r"\bLD\.E"), "ST.E": re.compile(r"\bST\.E")}
_LINE = re.compile(r'//## File ".*", line (\d+)')


def count_by_line(sass: str) -> dict[int, Counter]:
    """{source line: Counter(kind: instructions)} from `nvdisasm -c -g` output."""
    out: dict[int, Counter] = {}
    cur = 0
    for text in sass.splitlines():
        m = _LINE.search(text)
        if m:
            cur = int(m.group(1))
            continue
        for kind, pat in KINDS.items():
            if pat.search(text):
                out.setdefault(cur, Counter())[kind] += 1
    return out


def nvdisasm() -> str:
    path = os.environ.get("KOG_NVDISASM") or shutil.which("nvdisasm")
    if not path or not os.path.exists(path):
        raise KogError("nvdisasm not found: pip download --no-deps nvidia-cuda-nvdisasm, unzip it and set "
                       "KOG_NVDISASM=<dir>/nvidia/cu13/bin/nvdisasm")
    return path


def report(variant: dict, top: int = 40) -> list[str]:
    from kog_nvidia_hopper import schedule as S
    from kog_nvidia_hopper.cuda_util import compile_cubin, ptxas_report, source
    src = source(S.header(variant))
    cubin, log = compile_cubin(src)
    tool = nvdisasm()
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        sass = subprocess.run([tool, "-c", "-g", f.name], capture_output=True, text=True, check=True).stdout
    counts = count_by_line(sass)
    lines = src.splitlines()
    total = sum(counts.values(), Counter())
    out = [f"ptxas: {ptxas_report(log)}",
           "instructions: " + ", ".join(f"{k} {total[k]}" for k in KINDS) + f" (of {sass.count(';')})",
           f"{'line':>6s} {'LDL':>4s} {'STL':>4s} {'LD.E':>5s} {'ST.E':>5s}  source (decode.cu spliced, with its header)"]
    ranked = sorted(counts.items(), key=lambda kv: -(kv[1]["LDL"] + kv[1]["STL"] + kv[1]["LD.E"] + kv[1]["ST.E"]))
    for line, c in ranked[:top]:
        text = lines[line - 1].strip() if 0 < line <= len(lines) else ""
        out.append(f"{line:6d} {c['LDL']:4d} {c['STL']:4d} {c['LD.E']:5d} {c['ST.E']:5d}  {text[:100]}")
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--set", nargs="*", action="extend", default=[],
                    help="build #defines over the default, e.g. --set NSLOTS=4 NT=256 (repeatable)")
    ap.add_argument("--top", type=int, default=40)
    a = ap.parse_args()
    variant = dict(DEFAULT_BUILD)
    for kv in a.set:
        k, _, v = kv.partition("=")
        if not k or not v.lstrip("-").isdigit():
            raise SystemExit(f"--set {kv!r}: use KEY=INTEGER, e.g. --set NSLOTS=4")
        variant[k] = int(v)
    try:
        print("\n".join(report(variant, a.top)))
    except KogError as e:
        raise SystemExit(f"error: {e}")


if __name__ == "__main__":
    main()
