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

With --same-loop it says instead whether the matvec item loops (`mv_items`, `mv_down_items`: the
consumers' hot code) compile to the same instructions as the default build's, up to addresses.
Any change elsewhere in the kernel can re-schedule them (ptxas allocates the whole call graph
together): ATT_TAGS did (166 registers; -0.3 / -0.7% on an H100), ATT_TICKET_ACQREL did not
(level). Check it before an A/B of a change outside the matvec: if the loops moved, the A/B
measures that too (perf notes, session 25).

With --same-as REV it says instead whether the build compiles to the same machine code from the
working tree's kernels/ and from git revision REV's (nvdisasm without line info, so comments and
moved lines do not count). A refactor of kernel source that passes this needs no new GPU run.
The compile-time settings come from this tree's schedule.header either way.

With --preset P the build is the one HopperBackend.load makes for that preset under the current
KOG_HOPPER_* settings (plan.py) instead of DEFAULT_BUILD; --set applies over it.

With --live it prints instead the live registers (nvdisasm's life ranges) over each item loop:
how many registers a change there could take before the kernel's count (and every loop's
schedule) moves, and which lines hold the peak.

    python3 -m kog_nvidia_hopper.sass_report [--preset P] [--set KEY=VALUE ...] [--top N] [--load-use N]
                                             [--live] [--same-loop KEY=VALUE ...] [--same-as REV]

nvdisasm comes from the `nvidia-cuda-nvdisasm` wheel (the `test` extra installs it; or `pip download
--no-deps nvidia-cuda-nvdisasm`, unzip, `nvidia/cu13/bin/nvdisasm`); found through $KOG_NVDISASM,
the installed wheel, or PATH.

poll_loops (the CPU test of the default build uses it): every load of `ld_poll` / `ld_poll4`
(common.cuh) must sit in a loop of the machine code. Session 27 found the poll loops of v30's
TAG_QKV compiled to a single load (no branch back), so a reader went on with a stale value.
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

# bench-2b's default build (v32): 10 consumer warps, a 5 x 31 KB ring after 32 KB of stage
# scratch, the attention's shapes compiled in, the grid sampler (4 candidates a thread), a
# 128-byte ring, a Llama-family MLP as one split-K stage (SPLITK_DOWN, v28)
DEFAULT_BUILD = dict(NT=320, NSLOTS=5, SLOT_BYTES=31744, RING_OFF=32768, KV_BUFS=1, SIGNAL_WARP=1,
                     INLINE_ATTENTION=1, PREFETCH=0, NORM_SMEM=1, STREAM_L2_FIRST=1,
                     NORM_RCP=1, ATT_FASTDIV=1, SAMPLE_GRID=1, SAMPLE_EPT=4, SMEM_ALIGN=128, DEFER_NORM=1, SIGNAL_BAR=1,
                     ATC_L=1, ATC_H=16, ATC_HKV=8, ATC_HD=128, ATC_T=4096, ATC_MAXCH=16,
                     ATC_ROPE_Q=1, ATC_ROPE_K=1, SPLITK_DOWN=1, TAG_QKV=1, TAG_OPROJ=1, TAG_X=1)
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


def instructions(sass: str) -> list[tuple[str, int, str]]:
    """(address, source line, instruction) of each instruction of `nvdisasm -c -g` output."""
    ins, cur = [], 0
    for text in sass.splitlines():
        m = _LINE.search(text)
        if m:
            cur = int(m.group(1))
            continue
        m = _INSN.search(text)
        if m:
            ins.append((m.group(1), cur, m.group(2).strip()))
    return ins


_GLOBAL_LOAD = re.compile(r"^(@!?P\d\s+)?(LDG|LD)\.E(\S*)\s+R(\d+),")


def load_use(sass: str, window: int = 12) -> list[tuple[str, int, int, str, str]]:
    """(address, source line, distance, load, first reader) for each global load of `nvdisasm -c -g`
    output whose destination is read within `window` instructions, scanning straight on."""
    ins = instructions(sass)
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


ITEM_LOOPS = ("mv_items", "mv_down_items")  # matvec.cuh's consumer loops over the ring's items


def function_lines(cuda: str, names=ITEM_LOOPS) -> set[str]:
    """The stripped code lines (no comments, preprocessor lines or lone braces) of the bodies of the
    functions `names` defined in `cuda` (found by name, the body by brace matching)."""
    text = cuda.splitlines()
    out: set[str] = set()
    for name in names:
        start = next((i for i, t in enumerate(text)
                      if re.search(rf"\b{name}\(", t) and "__device__" in (t + (text[i - 1] if i else ""))), None)
        if start is None:
            raise KogError(f"sass_report: function {name} not found in matvec.cuh")
        depth, seen = 0, False
        for t in text[start:]:
            code = t.split("//")[0]
            depth += code.count("{") - code.count("}")
            seen = seen or "{" in code
            st = t.strip()
            if st and not st.startswith(("//", "#")) and st.strip("{} ;") != "":
                out.add(st)
            if seen and depth <= 0:
                break
    return out


def loop_runs(src: str, sass: str, code_lines: set[str]) -> list[tuple[str, ...]]:
    """Sorted runs of consecutive instructions whose source line's text is in `code_lines`, branch
    targets and other addresses masked: equal lists mean the same code, wherever it was placed."""
    lines = src.splitlines()
    runs, run = [], []
    for _, cur, text in instructions(sass):
        if 0 < cur <= len(lines) and lines[cur - 1].strip() in code_lines:
            run.append(re.sub(r"0x[0-9a-f]+|`\(\S+\)", "X", text))
        elif run:
            runs.append(tuple(run))
            run = []
    if run:
        runs.append(tuple(run))
    return sorted(runs)


_LIVE = re.compile(r"/\*([0-9a-f]{4,})\*/.*?;\s*//\s*\|\s*(\d+)")


def live_counts(lrm_sass: str) -> dict[str, int]:
    """{address: live registers} from `nvdisasm -c -lrm count` output."""
    return {m.group(1): int(m.group(2)) for m in map(_LIVE.search, lrm_sass.splitlines()) if m}


def addr_lines(sass: str) -> dict[str, int]:
    """{address: source line} from `nvdisasm -c -g` output."""
    return {addr: line for addr, line, _ in instructions(sass)}


def _item_loop_lines(names=ITEM_LOOPS) -> set[str]:
    from pathlib import Path
    return function_lines((Path(__file__).parent / "kernels" / "matvec.cuh").read_text(), names)


def report_live(variant: dict, top: int = 5) -> list[str]:
    from kog_nvidia_hopper.cuda_util import ptxas_report
    src, log, sass, lrm = _disassemble(variant, ("-lrm", "count"))
    lines = src.splitlines()
    live = live_counts(lrm)
    text = {a: lines[n - 1].strip() for a, n in addr_lines(sass).items() if 0 < n <= len(lines)}
    out = [f"kernel: {ptxas_report(log)['registers']} registers, at most {max(live.values())} live"]
    for fn in ITEM_LOOPS:
        code = _item_loop_lines((fn,))
        xs = sorted((n, text[a]) for a, n in live.items() if text.get(a) in code)
        if not xs:
            continue
        ns = [n for n, _ in xs]
        p90 = ns[int(len(ns) * 0.9)]
        out.append(f"{fn}: {len(ns)} instructions, live min {ns[0]} / median {ns[len(ns) // 2]} / p90 {p90} / max {ns[-1]}")
        peak = Counter(t for n, t in xs if n >= p90)
        out += [f"    {k:3d} x  {t[:100]}" for t, k in peak.most_common(top)]
    return out


def report_same_loop(base: dict, variant: dict) -> list[str]:
    from kog_nvidia_hopper.cuda_util import ptxas_report
    code = _item_loop_lines()
    src0, log0, sass0 = _disassemble(base)
    src1, log1, sass1 = _disassemble(variant)
    a, b = loop_runs(src0, sass0, code), loop_runs(src1, sass1, code)
    regs = lambda lg: ptxas_report(lg)["registers"]
    verdict = "the same code" if a == b else "DIFFERENT code: an A/B of this build also measures the re-scheduled loops"
    return [f"base:    {regs(log0)} registers, item loops {sum(map(len, a))} instructions in {len(a)} runs",
            f"variant: {regs(log1)} registers, item loops {sum(map(len, b))} instructions in {len(b)} runs",
            f"matvec item loops: {verdict}"]


_LABEL = re.compile(r"^\s*(\.L_x_\d+):")
_BRANCH = re.compile(r"^(@!?U?P\w+\s+)?BRA\b.*`\((\.L_x_\d+)\)")
POLL_ASM = ("ld.relaxed.gpu.global.f32", "ld.relaxed.gpu.global.v4.f32",  # ld_poll, ld_poll4 (common.cuh)
            "ld.relaxed.gpu.global.v2.s64")  # ld_poll_i64x2


def poll_loops(src: str, sass: str, window: int = 16) -> list[tuple[str, bool]]:
    """(address, looped) for each global load compiled from an ld_poll / ld_poll4 asm line of `src`:
    looped when a branch within `window` instructions after it jumps back to it or before it."""
    lines = {i + 1 for i, text in enumerate(src.splitlines()) if any(a + " " in text for a in POLL_ASM)}
    label_at, pending = {}, []
    for text in sass.splitlines():  # a label's address: the next instruction's
        m = _LABEL.match(text)
        if m:
            pending.append(m.group(1))
            continue
        m = _INSN.search(text)
        if m:
            for name in pending:
                label_at[name] = int(m.group(1), 16)
            pending = []
    ins = instructions(sass)
    out = []
    for i, (addr, line, text) in enumerate(ins):
        if line not in lines or not _GLOBAL_LOAD.match(text):
            continue
        back = False
        for _, _, later in ins[i + 1:i + 1 + window]:
            m = _BRANCH.match(later)
            if m and label_at.get(m.group(2), 1 << 62) <= int(addr, 16):
                back = True
                break
        out.append((addr, back))
    return out


def nvdisasm() -> str:
    path = os.environ.get("KOG_NVDISASM") or _installed_nvdisasm() or shutil.which("nvdisasm")
    if not path or not os.path.exists(path):
        raise KogError("nvdisasm not found: pip download --no-deps nvidia-cuda-nvdisasm, unzip it and set "
                       "KOG_NVDISASM=<dir>/nvidia/cu13/bin/nvdisasm")
    return path


def _installed_nvdisasm() -> str | None:
    """nvdisasm of the nvidia-cuda-nvdisasm wheel, when it is installed."""
    import importlib.util
    spec = importlib.util.find_spec("nvidia")
    for root in (spec.submodule_search_locations or []) if spec else []:
        path = os.path.join(root, "cu13", "bin", "nvdisasm")
        if os.path.exists(path):
            return path
    return None


def _disassemble(variant: dict, *more: tuple[str, ...]) -> tuple[str, ...]:
    """(source, ptxas log, nvdisasm -c -g output) of a build, then one more listing of the same
    cubin for each tuple of nvdisasm options in `more` (e.g. ("-lrm", "count"): -g is ignored there)."""
    from kog_nvidia_hopper import schedule as S
    from kog_nvidia_hopper.cuda_util import source
    return disassemble_source(source(S.header(variant)), *more)


def disassemble_source(src: str, *more: tuple[str, ...]) -> tuple[str, ...]:
    """_disassemble of a whole spliced source (a test's edited copy of a build)."""
    from kog_nvidia_hopper.cuda_util import compile_cubin
    cubin, log = compile_cubin(src)
    return (src, log, *listings(cubin, ("-g",), *more))


def listings(cubin: bytes, *options: tuple[str, ...]) -> list[str]:
    """`nvdisasm -c` of a cubin, once for each tuple of further options."""
    tool = nvdisasm()
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return [subprocess.run([tool, "-c", *opts, f.name], capture_output=True, text=True, check=True).stdout
                for opts in options]


def report_load_use(variant: dict, window: int) -> list[str]:
    src, _, sass = _disassemble(variant)
    lines = src.splitlines()
    out = [f"{'addr':>6s} {'line':>6s} {'dist':>4s}  load -> first reader  (source line; an inlined helper's own line)"]
    for addr, line, dist, load, use in load_use(sass, window):
        text = lines[line - 1].strip() if 0 < line <= len(lines) else ""
        out.append(f"{addr:>6s} {line:6d} {dist:4d}  {load[:60]} -> {use[:50]}  | {text[:80]}")
    return out


def revision_kernels(rev: str, into: str) -> "Path":
    """kernels/ as git revision `rev` has it, written under the folder `into`."""
    from pathlib import Path
    from kog_nvidia_hopper.cuda_util import KERNEL_DIR
    def git(*args, where=str(KERNEL_DIR)):
        r = subprocess.run(["git", "-C", where, *args], capture_output=True, text=True)
        if r.returncode:
            raise KogError(f"git {' '.join(args[:2])} failed ({r.stderr.strip().splitlines()[-1] if r.stderr.strip() else r.returncode}): "
                           "--same-as needs kog's git checkout and a revision it has, e.g. --same-as HEAD")
        return r.stdout
    prefix = git("rev-parse", "--show-prefix").strip()  # kernels/'s path in the repository
    top = git("rev-parse", "--show-toplevel").strip()  # (ls-tree reads paths from the working directory)
    out = Path(into)
    for name in git("ls-tree", "--name-only", f"{rev}:{prefix}", where=top).split():
        (out / name).write_text(git("show", f"{rev}:{prefix}{name}", where=top))
    return out


def machine_code(src: str) -> str:
    """nvdisasm's listing of a build without line info: the instructions and their addresses."""
    from kog_nvidia_hopper.cuda_util import compile_cubin
    return listings(compile_cubin(src)[0], ())[0]


def same_code(variant: dict, kernels_a, kernels_b, name_a: str = "there", name_b: str = "here") -> list[str]:
    """Whether `variant` compiles to the same machine code from two copies of kernels/; the first
    line says which ("the same machine code" or "DIFFERENT machine code"), then the first difference."""
    from kog_nvidia_hopper import schedule as S
    from kog_nvidia_hopper.cuda_util import source
    old, new = (machine_code(source(S.header(variant), k)) for k in (kernels_a, kernels_b))
    a, b = [l for l in old.splitlines() if ";" in l], [l for l in new.splitlines() if ";" in l]
    if old == new:
        return [f"the same machine code as {name_a} ({len(b)} instructions)"]
    out = [f"DIFFERENT machine code from {name_a}: {len(a)} instructions there, {len(b)} {name_b}"]
    for x, y in zip(a, b):
        if x != y:
            out += [f"  first difference, {name_a}: {x.strip()[:120]}", f"  first difference, {name_b}: {y.strip()[:120]}"]
            break
    return out


def report_same_code(variant: dict, rev: str) -> list[str]:
    """same_code between git revision `rev`'s kernels/ and the working tree's."""
    from kog_nvidia_hopper.cuda_util import KERNEL_DIR
    with tempfile.TemporaryDirectory() as d:
        return same_code(variant, revision_kernels(rev, d), KERNEL_DIR, rev, "here")


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
    ap.add_argument("--preset", default=None,
                    help="the build HopperBackend.load makes for this preset (plan.py) instead of the default build")
    ap.add_argument("--same-as", default=None, metavar="REV",
                    help="say instead whether the working tree's kernels compile to the same machine code as "
                         "git revision REV's, e.g. --same-as HEAD")
    ap.add_argument("--top", type=int, default=None, help="lines to list (default 40; --live: 5 a loop)")
    ap.add_argument("--load-use", type=int, default=0, metavar="N",
                    help="list global loads first read within N instructions instead (e.g. 12)")
    ap.add_argument("--live", action="store_true",
                    help="print the item loops' live registers (min / median / p90 / max, the peak's lines) instead")
    ap.add_argument("--same-loop", nargs="+", metavar="KEY=VALUE", default=None,
                    help="say instead whether the matvec item loops compile the same with these #defines "
                         "over the build (--set applies to both), e.g. --same-loop ATT_TAGS=1")
    a = ap.parse_args()
    def parse(pairs, flag):
        out = {}
        for kv in pairs:
            k, _, v = kv.partition("=")
            if not k or not v.lstrip("-").isdigit():
                raise SystemExit(f"{flag} {kv!r}: use KEY=INTEGER, e.g. {flag} NSLOTS=4")
            out[k] = int(v)
        return out
    try:
        base = DEFAULT_BUILD
        if a.preset:
            from kog_nvidia_hopper.bench import build
            from kog_nvidia_hopper.plan import plan
            base = plan(build(a.preset, 4096)[1])["variant"]
        variant = dict(base, **parse(a.set, "--set"))
        if a.same_as:
            lines = report_same_code(variant, a.same_as)
        elif a.live:
            lines = report_live(variant, a.top or 5)
        elif a.same_loop:
            lines = report_same_loop(variant, dict(variant, **parse(a.same_loop, "--same-loop")))
        elif a.load_use:
            lines = report_load_use(variant, a.load_use)
        else:
            lines = report(variant, a.top or 40)
        print("\n".join(lines))
    except KogError as e:
        raise SystemExit(f"error: {e}")


if __name__ == "__main__":
    main()
