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

With --load-use N it lists instead every global load whose value is first read within N
instructions (straight-line order, so a rough scan): the warp stalls a whole L2 round trip there
(~1 us while the ring streams) unless other loads are in flight. Session 22's three stalls (v29)
and session 23's (v30) were found this way; spin-wait polls show up too and are expected.

    python3 -m kog_nvidia_hopper.sass_report [--set KEY=VALUE ...] [--top N] [--load-use N]

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


_INSN = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
_GLOBAL_LOAD = re.compile(r"^(@!?P\d\s+)?(LDG|LD)\.E(\S*)\s+R(\d+),")


def load_use(sass: str, window: int = 12) -> list[tuple[str, int, int, str, str]]:
    """(address, source line, distance, load, first reader) for each global load of `nvdisasm -c -g`
    output whose destination is read within `window` instructions, scanning straight on."""
    ins, cur = [], 0
    for text in sass.splitlines():
        m = _LINE.search(text)
        if m:
            cur = int(m.group(1))
            continue
        m = _INSN.search(text)
        if m:
            ins.append((m.group(1), cur, m.group(2).strip()))
    out = []
    for i, (addr, line, text) in enumerate(ins):
        m = _GLOBAL_LOAD.match(text)
        if not m:
            continue
        width = 4 if ".128" in m.group(3) else 2 if ".64" in m.group(3) else 1
        dst = set(range(int(m.group(4)), int(m.group(4)) + width))
        for j in range(i + 1, min(i + window, len(ins))):
            body = ins[j][2].split(None, 2)[1:] if ins[j][2].startswith("@") else ins[j][2].split(None, 1)
            if len(body) < 2:
                continue
            op, operands = body[0], body[1].split(",")
            stores = op.startswith(("ST", "RED", "ATOM"))
            sources = operands if stores else operands[1:]  # a store's first operand is its address
            if {int(r) for r in re.findall(r"\bR(\d+)\b", ",".join(sources))} & dst:
                out.append((addr, line, j - i, text, ins[j][2]))
                break
            if not stores:
                dst -= {int(r) for r in re.findall(r"\bR(\d+)\b", operands[0])}  # overwritten before any read
                if not dst:
                    break
    return out


def nvdisasm() -> str:
    path = os.environ.get("KOG_NVDISASM") or shutil.which("nvdisasm")
    if not path or not os.path.exists(path):
        raise KogError("nvdisasm not found: pip download --no-deps nvidia-cuda-nvdisasm, unzip it and set "
                       "KOG_NVDISASM=<dir>/nvidia/cu13/bin/nvdisasm")
    return path


def _disassemble(variant: dict) -> tuple[str, str, str]:
    """(source, ptxas log, nvdisasm -c -g output) of a build."""
    from kog_nvidia_hopper import schedule as S
    from kog_nvidia_hopper.cuda_util import compile_cubin, source
    src = source(S.header(variant))
    cubin, log = compile_cubin(src)
    tool = nvdisasm()
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        sass = subprocess.run([tool, "-c", "-g", f.name], capture_output=True, text=True, check=True).stdout
    return src, log, sass


def report_load_use(variant: dict, window: int) -> list[str]:
    src, _, sass = _disassemble(variant)
    lines = src.splitlines()
    out = [f"{'addr':>6s} {'line':>6s} {'dist':>4s}  load -> first reader  (source line; an inlined helper's own line)"]
    for addr, line, dist, load, use in load_use(sass, window):
        text = lines[line - 1].strip() if 0 < line <= len(lines) else ""
        out.append(f"{addr:>6s} {line:6d} {dist:4d}  {load[:60]} -> {use[:50]}  | {text[:80]}")
    return out


def report(variant: dict, top: int = 40) -> list[str]:
    from kog_nvidia_hopper.cuda_util import ptxas_report
    src, log, sass = _disassemble(variant)
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
    ap.add_argument("--load-use", type=int, default=0, metavar="N",
                    help="list global loads first read within N instructions instead (e.g. 12)")
    a = ap.parse_args()
    variant = dict(DEFAULT_BUILD)
    for kv in a.set:
        k, _, v = kv.partition("=")
        if not k or not v.lstrip("-").isdigit():
            raise SystemExit(f"--set {kv!r}: use KEY=INTEGER, e.g. --set NSLOTS=4")
        variant[k] = int(v)
    try:
        print("\n".join(report_load_use(variant, a.load_use) if a.load_use else report(variant, a.top)))
    except KogError as e:
        raise SystemExit(f"error: {e}")


if __name__ == "__main__":
    main()
