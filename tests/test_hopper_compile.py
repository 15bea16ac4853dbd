"""CPU CI for nvidia_hopper: the kernel compiles for sm_90a through NVRTC (resource report
checked), the program lowering fuses what it should, and the backend says 'no GPU' cleanly."""
from __future__ import annotations

import functools

import numpy as np
import pytest

from kog_core.errors import BackendUnavailable, CapabilityError, KogError

# The common defines of every default build (v17; a Llama-family model's adds SPLITK_DOWN=1 since
# session 20, a Laneformer's its lane settings): 10 consumer warps + the producer + the signal warp (12 warps a block, so
# up to 168 registers a thread: the register file's quadrants cap 13 warps at 128), one attention
# K/V buffer, the attention inlined, the preloaded norm weights in shared memory.
DEFAULT = dict(NT=320, KV_BUFS=1, SIGNAL_WARP=1, INLINE_ATTENTION=1, NORM_SMEM=1, STREAM_L2_FIRST=1,
               NORM_RCP=1, ATT_FASTDIV=1, SAMPLE_GRID=1, SAMPLE_EPT=4,  # EPT 4: a 128k vocabulary over 132 blocks
               SMEM_ALIGN=128, DEFER_NORM=1, SIGNAL_BAR=1)
MAX_REGISTERS = 168
# Spill bytes of the whole kernel (every function): 0 since session 8. History: 4 at the entry in
# v15 (the next stage's descriptor row by cp.async instead of registers held across the noinline
# stage calls: 36 -> 4), 12 in v16 (shared scratch addressed from smem4), 0 once the attention's
# RoPE took its head as a shared-memory offset in a noinline function (a pointer parameter was
# generic, and inlined it perturbed the stage loop's allocation). See docs/perf-notes-hopper.md.


def _compile(**variant):
    pytest.importorskip("cuda.bindings.nvrtc", reason="cuda-python (NVRTC) is not installed")
    cubin, log, rep = _compile_once(tuple(sorted(variant.items())))
    return cubin, log, dict(rep)


@functools.lru_cache(maxsize=None)
def _compile_once(variant: tuple):
    """One NVRTC compile per build in this run (several tests compare against the default)."""
    from kog_nvidia_hopper import schedule
    from kog_nvidia_hopper.cuda_util import compile_cubin, ptxas_report, source
    cubin, log = compile_cubin(source(schedule.header(dict(variant))), use_cache=False)
    return cubin, log, ptxas_report(log)


def _code_bytes(cubin: bytes) -> int:
    """Bytes of machine code in a cubin: the sizes of its .text sections (ELF64 section headers).
    The file's own length also moves with padding and metadata, and once ordered two builds wrongly."""
    import struct
    shoff, = struct.unpack_from("<Q", cubin, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", cubin, 0x3A)
    def header(i):
        name, _, _, _, off, size = struct.unpack_from("<IIQQQQ", cubin, shoff + i * shentsize)
        return name, off, size
    strtab_off = header(shstrndx)[1]
    total = 0
    for i in range(shnum):
        name, _, size = header(i)
        end = cubin.index(b"\0", strtab_off + name)
        if cubin[strtab_off + name:end].startswith(b".text"):
            total += size
    return total


def _compile_clean(**variant):
    """A build that compiles for sm_90a within the register bound and without any spills."""
    cubin, log, rep = _compile(**variant)
    assert cubin[:4] == b"\x7fELF" and rep["registers"] <= MAX_REGISTERS
    assert rep["spill_stores"] == 0 and rep["spill_loads"] == 0, rep
    return cubin, log, rep


def _compile_clean_but_entry(**variant):
    """As _compile_clean, but a build at the register bound may spill up to 4 bytes at the kernel's
    entry only (laneformer-2b's with SMEM_ADDR_INTRINSIC, the default: one value, reloaded a stage
    at most); nothing in any loop or callee."""
    cubin, log, rep = _compile(**variant)
    assert cubin[:4] == b"\x7fELF" and rep["registers"] <= MAX_REGISTERS
    assert rep["spill_stores"] <= 4 and rep["spill_stores"] == rep["entry_spill_stores"], rep
    assert rep["spill_loads"] == rep["entry_spill_loads"], rep
    return cubin, log, rep


def _bench2b_program():
    """bench-2b's decode program at a 4,096-token context with a bf16 KV cache (the benchmarks')."""
    from kog_moe_standard_tp.llama import Llama
    from kog_moe_standard_tp.presets import BENCH_2B
    return Llama(BENCH_2B.config).lower(context_length=4096, kv_dtype="bf16")


def _laneformer2b_program():
    """laneformer-2b's decode program at a 4,096-token context with a bf16 KV cache."""
    from kog_core.interfaces import resolve_factory
    from kog_core.plugins import load_registry
    from kog_laneformer.presets import LANEFORMER_2B
    arch = resolve_factory(load_registry().architectures["laneformer"].factory)(LANEFORMER_2B.config)
    return arch.lower(context_length=4096, kv_dtype="bf16")


def _laneformer2b_stages_tagged_before_x():
    """laneformer-2b's program and its stages as HopperBackend.load has them just before
    tag_residual_outputs: the DTP residual fused, matvecs finalized, the attention's and the
    gate/up pair's tags applied (the x tags read their waits)."""
    from kog_nvidia_hopper import schedule as S
    prog = _laneformer2b_program()
    stages = S.lower(prog, 132, 32 * S.NW_DEFAULT, 1, fuse_lane_residual=True)
    for st in stages:
        if st.type == "matvec":
            S.finalize_matvec(st, 132, prog.logits, lambda tiles: 0, logits_numel=prog.tensors[prog.logits].numel)
    S.tag_attention_inputs(prog, stages)
    S.tag_attention_outputs(prog, stages)
    S.tag_pair_outputs(prog, stages)
    return prog, stages


def _bench2b_stages_as_loaded():
    """bench-2b's stages as HopperBackend.load has them when it sizes the ring (default build: 10
    consumer warps, one K/V buffer, the attention's chunks combined in the attention stage, matvecs
    finalized). Fresh every call: _ring_slots writes each stage's smem."""
    from kog_nvidia_hopper import schedule as S
    prog = _bench2b_program()
    stages = S.lower(prog, 132, 32 * S.NW_DEFAULT, 1)
    for st in stages:
        if st.type == "matvec":
            S.finalize_matvec(st, 132, prog.logits, lambda tiles: 0, logits_numel=prog.tensors[prog.logits].numel)
    return stages


@functools.lru_cache(maxsize=None)
def _bench2b_build() -> dict:
    """bench-2b's compile-time settings as the backend sets them (its attention shapes compiled in,
    5 slots of 31 KB, the MLP fused as a split-K stage)."""
    from kog_nvidia_hopper import schedule as S
    return dict(DEFAULT, **S.attention_shape_consts(_bench2b_stages_as_loaded()), NSLOTS=5, SLOT_BYTES=31744,
                RING_OFF=32768, PREFETCH=0, SPLITK_DOWN=1)


def _laneformer2b_build(stages=None) -> dict:
    """laneformer-2b's compile-time settings (its attention shapes from `stages`, by default its
    stages lowered with the fused DTP residual), without the tags."""
    from kog_nvidia_hopper import schedule as S
    if stages is None:
        stages = S.lower(_laneformer2b_program(), 132, 320, 1, fuse_lane_residual=True)
    return dict(DEFAULT, **S.attention_shape_consts(stages), NSLOTS=5, SLOT_BYTES=31744, RING_OFF=30720, PREFETCH=0,
                RMS_BLOCK=1, LANE_RESIDUAL=1, WIDE_ITEMS=1, LANES_LOAD=1)


def _bench2b_shape_consts() -> tuple:
    """The attention's compile-time shapes (ATC_*) of bench-2b's default build, as sorted pairs."""
    from kog_nvidia_hopper import schedule as S
    return tuple(sorted(S.attention_shape_consts(_bench2b_stages_as_loaded()).items()))


@pytest.fixture(scope="module")
def compiled():
    return _compile(**DEFAULT)


def test_kernel_source_splices_every_concern_file_once():
    """decode.cu includes its .cuh files (one concern each); the spliced source has none left, and
    each stage kind's entry point comes from its own file."""
    import re
    from kog_nvidia_hopper.cuda_util import KERNEL_DIR, kernel_source
    top = (KERNEL_DIR / "decode.cu").read_text()
    names = re.findall(r'^#include "([\w.]+\.cuh)"', top, flags=re.M)
    assert names[0] == "ring.cuh" and len(names) == len(set(names)) == 10
    spliced = kernel_source("decode.cu")
    assert "#include" not in spliced
    for name, entry in (("matvec.cuh", "run_matvec"), ("attention.cuh", "run_attention"),
                        ("elementwise.cuh", "run_ew"), ("sample.cuh", "run_sample"), ("stream.cuh", "produce")):
        assert f"void {entry}(" in (KERNEL_DIR / name).read_text()
        assert all(f"void {entry}(" not in (KERNEL_DIR / other).read_text() for other in names if other != name)


def test_kernel_compiles_for_sm90a(compiled):
    cubin, log, rep = compiled
    assert cubin[:4] == b"\x7fELF"
    assert "sm_90a" in log
    assert rep["registers"] <= MAX_REGISTERS, rep


def test_zero_spills(compiled):
    _, log, rep = compiled
    assert rep["spill_stores"] == 0 and rep["spill_loads"] == 0, (rep, log[-2000:])


def test_lowering_fuses_llama_layers():
    from kog_nvidia_hopper import schedule as S
    prog = _bench2b_program()
    stages = S.lower(prog, 132)
    # per layer: qkv (+norm), attention (+rope, kv append), o_proj (+residual), gate/up/swiglu (+norm), down (+residual)
    assert len(stages) == 5 * 26 + 2
    assert [s.type for s in stages[:5]] == ["matvec", "attn", "matvec", "matvec", "matvec"]
    assert stages[0].f["MV_IN_MODE"] == 3           # embedding + rmsnorm folded into q/k/v
    assert len(stages[0].segs) == 3
    assert stages[3].segs[0]["SEG_W2"]              # gate/up paired, swiglu in the epilogue
    assert stages[1].f["AT_ROPE_Q"] == 1 and stages[1].f["AT_KNEW"]
    assert stages[-1].type == "sample"
    for st in stages:
        if st.type == "matvec":
            S.finalize_matvec(st, 132, prog.logits, lambda n: 1)
    assert stages[-2].f["MV_FLAGS"] == 1 | 2 | 4     # logits, skipped on prompt positions, argmax partials


def test_lowering_generic_ops_become_stages():
    from kog_moe_standard_tp.llama import Llama
    from kog_nvidia_hopper import schedule as S
    cfg = dict(model_type="qwen3", hidden_size=256, num_hidden_layers=1, num_attention_heads=8, num_key_value_heads=1,
               head_dim=64, intermediate_size=512, vocab_size=300, max_position_embeddings=256)
    stages = S.lower(Llama(cfg).lower(kv_dtype="bf16"), 132)
    assert [s.label for s in stages[:4]][1:3] == ["rmsnorm", "rmsnorm"]  # per-head q/k norms stay elementwise


def test_backend_reports_no_gpu_in_one_line():
    from kog_nvidia_hopper.plugin import probe
    reason = probe()
    if reason is None:
        pytest.skip("a usable GPU is present here")
    assert "\n" not in reason and reason
    from kog_core.plugins import load_registry
    with pytest.raises(BackendUnavailable) as e:
        load_registry(refresh=True).create_backend("nvidia_hopper")
    assert "\n" not in str(e.value)
    assert isinstance(e.value, KogError)


def _plan_stage(K, segs, lanes=1):
    from kog_nvidia_hopper import schedule as S
    st = S.Stage("matvec", dict(MV_K=K))
    st.segs = [dict(SEG_N=n, SEG_W2=1 if pair else 0, lanes=lanes) for n, pair in segs]
    return st


@pytest.mark.parametrize("K,segs,lanes,nb", [
    (2048, [(2048, False), (512, False), (512, False)], 1, 132),   # q, k, v
    (2048, [(8192, True)], 1, 132),                                 # gate/up pair
    (8192, [(2048, False)], 1, 132),                                # down
    (2048, [(128256, False)], 1, 132),                              # LM head
    (384, [(96, False), (7, False)], 8, 132),                       # lanes, rows < blocks
    (64, [(5, True)], 3, 7),
])
@pytest.mark.parametrize("kalign", [1, 32])
@pytest.mark.parametrize("wide", [False, True])
def test_stream_plan_covers_every_weight_once(K, segs, lanes, nb, kalign, wide):
    """Every (segment, lane, row, column) is in exactly one item; items fit a slot; the k-slices
    of a row group are consecutive with FIRST/LAST flags; blocks get equal bytes (+ one group).
    wide (schedule.wide_items, never with a gate/up pair): up to 4 rows a warp."""
    import numpy as np
    from kog_nvidia_hopper import schedule as S
    slot = 32768
    if wide and any(pair for _, pair in segs):  # a gate/up pair item already holds two rows a warp
        with pytest.raises(ValueError):
            S.stream_plan(_plan_stage(K, segs, lanes), nb, 12, slot, kalign=kalign, wide=True)
        return
    plan, xbytes = S.stream_plan(_plan_stage(K, segs, lanes), nb, 12, slot, kalign=kalign, wide=wide)
    rows_max = 48 if wide else 24
    offs = plan[:nb + 1]
    items = S.plan_items(plan, nb)
    assert offs[0] == 0 and offs[-1] == len(items) and np.all(np.diff(offs) >= 0)
    seen = {(si, l): np.zeros((n, K), np.int32) for si, (n, _) in enumerate(segs) for l in range(lanes)}
    per_block = []
    for b in range(nb):
        its = items[offs[b]:offs[b + 1]]
        lane0, nl = plan[nb + 1 + b], plan[2 * nb + 1 + b]
        nbytes = 0
        open_group = None
        for si, lane, _, r0, rows, k0, klen, flags, xoff in its:
            pair = segs[si][1]
            assert rows >= 1 and klen % 8 == 0 and k0 % 8 == 0
            assert rows * (2 if pair else 1) * klen * 2 <= slot
            assert rows <= (12 if pair else rows_max)
            assert xoff == (lane - lane0) * K and lane0 <= lane < lane0 + nl
            seen[(si, lane)][r0:r0 + rows, k0:k0 + klen] += 1
            nbytes += rows * (2 if pair else 1) * klen * 2
            if flags & 1:
                assert open_group is None and k0 == 0
                open_group = (si, lane, r0, rows, k0 + klen)
            else:
                assert open_group is not None and open_group[:4] == (si, lane, r0, rows) and open_group[4] == k0
                open_group = open_group[:4] + (k0 + klen,)
            if flags & 2:
                assert open_group[4] == K
                open_group = None
        assert open_group is None
        assert xbytes >= nl * K * 4
        per_block.append(nbytes)
    for v in seen.values():
        assert np.all(v == 1)
    total = sum(per_block)
    group = rows_max * K * 2
    assert max(per_block) <= total / nb + group


def test_aligned_k_slices_keep_every_lane_busy():
    """KOG_HOPPER_KALIGN: k-slices start and end on multiples of 256 columns when one fits a slot
    (the dot loop's lanes each take a chunk of 8 in every step), with no more slices than needed;
    otherwise the equal cut. bench-2b's shapes: 20 rows of K = 2048 in a 31 KB slot."""
    from kog_nvidia_hopper import schedule as S
    assert S._k_cuts(256, 99, 32) == [0, 64, 160, 256]     # 512 + 768 + 768 columns, 3 slices as before
    assert S._k_cuts(256, 99, 1) == [0, 85, 170, 256]
    assert S._k_cuts(1024, 128, 32) == [128 * i for i in range(9)]
    assert S._k_cuts(256, 20, 32) == S._k_cuts(256, 20, 1)  # a slot smaller than 256 columns
    assert S._k_cuts(250, 99, 32) == S._k_cuts(250, 99, 1)  # K not a multiple of 256
    for chunks, mx in ((256, 99), (1024, 124), (1024, 40), (64, 64)):
        cuts = S._k_cuts(chunks, mx, 32)
        assert cuts[0] == 0 and cuts[-1] == chunks
        assert all(0 < b - a <= mx for a, b in zip(cuts, cuts[1:]))


def test_packed_weights_put_each_item_in_one_contiguous_run():
    """pack_stage_weights: item i's bytes are W[lane, rows, k-slice] (then W2's) at its offset."""
    import numpy as np
    from kog_nvidia_hopper import schedule as S
    rng = np.random.default_rng(0)
    K, nb, lanes = 96, 5, 2
    st = _plan_stage(K, [(37, False), (11, True)], lanes)
    st.segs[0]["SEG_W"] = "@a"
    st.segs[1].update(SEG_W="@g", SEG_W2="@u")
    mats = {"a": rng.integers(0, 65535, (lanes, 37, K), dtype=np.uint16),
            "g": rng.integers(0, 65535, (11, K), dtype=np.uint16),   # 2-D: shared by the lanes
            "u": rng.integers(0, 65535, (11, K), dtype=np.uint16)}
    plan, _ = S.stream_plan(st, nb, 12, 1024)  # small slots: several k-slices per row group
    packed = S.pack_stage_weights(plan, nb, st.segs, lambda n: mats[n])
    items = S.plan_items(plan, nb)
    assert (items[:, 6] < K).any()
    end = 0
    for si, lane, off16, r0, rows, k0, klen, _, _ in items:
        at = off16 * 8
        assert at == end
        if si == 0:
            want = [mats["a"][lane, r0:r0 + rows, k0:k0 + klen]]
        else:
            want = [mats[n][r0:r0 + rows, k0:k0 + klen] for n in ("g", "u")]
        for w in want:
            np.testing.assert_array_equal(packed[at:at + w.size], w.ravel())
            at += w.size
        end = at
    assert end == packed.size


def test_logits_rows_are_one_vocabulary_apart_for_laneformer_heads():
    """Logits mode stores position p's logits at p * V, also when the program has L lanes."""
    from kog_core.interfaces import resolve_factory
    from kog_core.plugins import load_registry
    from kog_nvidia_hopper import schedule as S
    from gpu.hopper_models import LANEFORMER_SMALL
    arch = resolve_factory(load_registry().architectures["laneformer"].factory)(LANEFORMER_SMALL["laneformer-replicate"])
    prog = arch.lower(context_length=64, kv_dtype="bf16")
    stages = S.lower(prog, 132)
    heads = [st for st in stages if st.type == "matvec" and any(sg["out_name"] == prog.logits for sg in st.segs)]
    assert len(heads) == 1
    S.finalize_matvec(heads[0], 132, prog.logits, lambda tiles: 0, logits_numel=prog.tensors[prog.logits].numel)
    assert heads[0].f["MV_OUT_STRIDE"] == prog.vocab_size and prog.lanes == 4


def test_tuning_knobs_reject_malformed_values_in_one_line(monkeypatch):
    from kog_nvidia_hopper.backend import _env_int
    monkeypatch.delenv("KOG_HOPPER_SLOT_KB", raising=False)
    assert _env_int("KOG_HOPPER_SLOT_KB", 32) == 32
    monkeypatch.setenv("KOG_HOPPER_SLOT_KB", "48")
    assert _env_int("KOG_HOPPER_SLOT_KB", 32) == 48
    for bad in ("abc", "0", "-4", "1.5"):
        monkeypatch.setenv("KOG_HOPPER_SLOT_KB", bad)
        with pytest.raises(KogError) as e:
            _env_int("KOG_HOPPER_SLOT_KB", 32)
        assert "\n" not in str(e.value) and "KOG_HOPPER_SLOT_KB" in str(e.value)
    monkeypatch.setenv("KOG_HOPPER_PREFETCH", "0")
    assert _env_int("KOG_HOPPER_PREFETCH", 0, lo=0, hi=32) == 0
    for bad in ("33", "x"):
        monkeypatch.setenv("KOG_HOPPER_PREFETCH", bad)
        with pytest.raises(KogError) as e:
            _env_int("KOG_HOPPER_PREFETCH", 0, lo=0, hi=32)
        assert "\n" not in str(e.value) and "0 to 32" in str(e.value)
    monkeypatch.setenv("KOG_HOPPER_PREFETCH", "0")
    assert _env_int("KOG_HOPPER_PREFETCH", 4, lo=0, hi=32) == 0
    monkeypatch.setenv("KOG_HOPPER_PREFETCH", "33")
    with pytest.raises(KogError):
        _env_int("KOG_HOPPER_PREFETCH", 4, lo=0, hi=32)
    # the value the message suggests is one the knob accepts (an on/off switch: 1, not 16)
    monkeypatch.setenv("KOG_HOPPER_SIGNAL_WARP", "2")
    with pytest.raises(KogError) as e:
        _env_int("KOG_HOPPER_SIGNAL_WARP", 0, lo=0, hi=1)
    assert "e.g. KOG_HOPPER_SIGNAL_WARP=1)" in str(e.value)


def test_stream_list_gives_each_block_its_items_in_stage_order():
    """stream_list: block b's entries are its plan items of every matvec stage, stage after stage,
    each with the packed source address, the item's bytes (W2 doubles them), the stage's flags and
    the item's plan header; the block info gives each block's item count and lanes per stage."""
    import numpy as np
    from kog_nvidia_hopper import schedule as S
    K, nb = 64, 3
    a = _plan_stage(K, [(29, False)], 1)
    b = _plan_stage(K, [(13, True)], 1)
    b.segs[0]["SEG_W2"] = "@u"
    plans = [S.stream_plan(st, nb, 12, 1024)[0] for st in (a, b)]
    bases = [1 << 33, (1 << 34) + 4096]
    stages = [(0, plans[0], a.segs, bases[0], 0), (3, plans[1], b.segs, bases[1], 2 | 1)]
    lst, binfo = S.stream_list(stages, nb, 5)
    head = ((nb + 4) >> 2) * 4
    offs = lst[:nb + 1]
    ent = lst[head:].reshape(-1, S.SE_WORDS)
    assert offs[-1] == len(ent) and binfo.shape == (5, nb, 4)
    for blk in range(nb):
        want = []
        for si, plan, segs, base, fl in stages:
            raw = plan[(3 * nb + 4) & ~3:].reshape(-1, 8)[plan[blk]:plan[blk + 1]]
            its = S.plan_items(plan, nb)[plan[blk]:plan[blk + 1]]
            assert binfo[si, blk, 0] == len(its) and binfo[si, blk, 1] == plan[nb + 1 + blk]
            for r, (seg, _, off16, _, rows, _, klen, _, _) in zip(raw, its):
                want.append((base + off16 * 16, rows * klen * (4 if segs[seg]["SEG_W2"] else 2),
                             (1 if fl & 2 else 0) | (2 if fl & 1 else 0) | (si << 8), tuple(int(v) for v in r)))
        got = [(int(e[0]) | (int(e[1]) << 32), int(e[2]), int(e[3]), tuple(int(v) for v in e[4:].view(np.int32)))
               for e in ent[offs[blk]:offs[blk + 1]]]
        assert got == want and len(got) > 0
    assert not binfo[[1, 2, 4]].any()
    # a stage followed by attention flags each block's first item of it (SE_ATT_NEXT = 4)
    lst2, _ = S.stream_list([(0, plans[0], a.segs, bases[0], 0, True)], nb, 2)
    ent2 = lst2[head:].reshape(-1, S.SE_WORDS)
    firsts = {int(o) for o in lst2[:nb]}
    for i, e in enumerate(ent2):
        assert bool(e[3] & 4) == (i in firsts)


def test_trace_build_compiles():
    """The timestamped build (KOG_HOPPER_TRACE, trace.py) must keep compiling, also with
    Laneformer's fused residual (its tail pass has a stamp of its own)."""
    for extra in ({}, {"LANE_RESIDUAL": 1}):
        cubin, _, rep = _compile(**DEFAULT, TRACE=1, PREFETCH=4, **extra)
        assert cubin[:4] == b"\x7fELF" and rep["registers"] <= MAX_REGISTERS


def test_trace_summary_reads_a_synthetic_trace():
    """trace.summarize: chain = last block done minus the previous stage's last done."""
    import numpy as np
    from kog_nvidia_hopper.trace import summarize
    ntok, nst, nb = 4, 4, 5
    tr = np.zeros((ntok, nst, nb, 31), np.uint64)
    t = 1_000_000
    for k in range(ntok):
        for s in range(nst):
            for b in range(nb):
                tr[k, s, b, :4] = [t, t + 1000, t + 1500, t + 4000 + 100 * b]
                tr[k, s, b, 7] = b
                tr[k, s, b, 29:31] = [t + 4200 + 100 * b, t + 4900 + 100 * b]  # signal warp: +0.2, fence 0.7
                if s == 1:  # attention phases, and the first sub-chunk's steps 200 ns apart
                    tr[k, s, b, 10:14] = [t + 1600, t + 1700, t + 2900, t + 3000]
                    tr[k, s, b, 16:20] = [t + 1900, t + 2100, t + 2300, t + 2500]
                    if b < 2:  # two blocks ran a second tile: start, phases, then its steps 100 ns apart
                        tr[k, s, b, 20:25] = [t + 3000, t + 3300, t + 3400, t + 3800, t + 3900]
                        tr[k, s, b, 25:29] = [t + 3500, t + 3600, t + 3700, t + 3800]
                if s == 3:  # the grid sampler: keys 500 ns after the wait, 6 rounds, their parts
                    tr[k, s, b, 20:27] = [t + 1500, 6, 1200, 600, 3000 + 10 * b, 1800, 300]
                if s == 2 and b >= 2:  # a fused lane residual's tail pass on blocks 2-4: 1.2 / 1.3 / 1.4 us
                    tr[k, s, b, 20] = t + 3000
            t += 4400  # last block done + 0 gap: next stage enters then
    lines = summarize(tr, ["matvec[a]", "attn[attention]", "matvec[b]", "sample[sample]"])
    row = lines[2].split()
    assert row[1] == "attn[attention]" and float(row[2]) == 4.4  # chain us
    assert "attention phases 0.60 / 0.10 / 1.20 / 0.10" in lines[2]
    assert "(first sub-chunk: 0.20 / 0.20 / 0.20 / 0.20)" in lines[2]
    assert "second tile, code hot: 0.30 / 0.10 / 0.40 / 0.10 (sub-chunk: 0.10 / 0.10 / 0.10 / 0.10)" in lines[2]
    assert "first sub-chunk" not in lines[1] and "first sub-chunk" not in lines[3]
    assert "sampler: keys 0.50, 6 rounds: histograms / atomics / arrival / bins / choice 1.20 / 0.60 / 3.02 / 1.80 / 0.30" in lines[4]
    assert all("sampler" not in line for line in lines[1:4])
    assert "residual tail 1.30" in lines[3] and all("residual tail" not in lines[i] for i in (1, 2, 4))
    # the last fence of a stage at +5.3 us from its entry, the next stage's wait done at +5.4
    assert all("release: signal warp +0.20, fence 0.70; waited 0.10 after the last fence" in line for line in lines[1:5])
    assert "release" not in "\n".join(summarize(tr[..., :29], ["matvec[a]", "attn[attention]", "matvec[b]", "sample[sample]"]))
    assert "most often last SM" in lines[-1] and "4x" in lines[-1]
    # with the stages' weight bytes: the rate over the median block's work (2.7 us) by stage kind
    lines = summarize(tr, ["matvec[a]", "attn[attention]", "matvec[b]", "sample[sample]"], [2_700_000, 0, 5_400_000, 0])
    kinds = {ln.split()[0]: ln.split() for ln in lines if ln.startswith("  ")}
    assert "weights TB/s over the work" in "\n".join(lines)
    assert kinds["matvec[a]"][-1] == "1.00" and kinds["matvec[b]"][-1] == "2.00" and len(kinds["attn[attention]"]) == 7


def test_bench_skip_masks_parse():
    """The developer bench's --masks: hex or decimal, commas, blanks ignored; a bad one is argparse's
    one-line error (ValueError from the type function)."""
    from kog_nvidia_hopper.bench import skip_masks
    assert skip_masks("0x40, 0xc0,196") == [0x40, 0xc0, 196] and skip_masks("") == []
    with pytest.raises(ValueError):
        skip_masks("0x40,zz")


def test_stage_weight_bytes_are_the_models_matvec_weights():
    """schedule.stage_weight_bytes over bench-2b's stages: its matvec weights (all but the norms' and the
    embedding's few MB of the program's bytes a token), the gate/up pairs counted twice."""
    from kog_nvidia_hopper.schedule import stage_weight_bytes
    stages = _bench2b_stages_as_loaded()
    total = sum(stage_weight_bytes(st) for st in stages)
    assert 0 < _bench2b_program().weight_bytes_per_token("bf16") - total < 1e6
    assert all(stage_weight_bytes(st) == 0 for st in stages if st.type != "matvec")


def test_twelve_consumer_warps_compile_at_128_registers():
    """KOG_HOPPER_CONSUMER_WARPS=12 (13 warps a block): ptxas stops at 128 registers, the register
    file's quadrant limit for 13 warps (4 x 32 x 128 = 16K); the item plan gives 2 rows per warp."""
    from kog_nvidia_hopper import schedule as S
    cubin, _, rep = _compile(NT=384, KV_BUFS=2)
    assert cubin[:4] == b"\x7fELF" and rep["registers"] == 128
    plan, _ = S.stream_plan(_plan_stage(2048, [(2048, False), (8192, True)]), 132, 11, 32768)
    items = S.plan_items(plan, 132)
    assert items[:, 4].max() <= 22 and items[items[:, 0] == 1, 4].max() <= 11  # 2 rows / 1 pair row per warp


def test_single_kv_buffer_frees_shared_memory_for_the_ring():
    """KOG_HOPPER_KV_BUFFERS=1: the attention stage needs one K/V sub-chunk buffer less (so bench-2b's
    scratch drops from 50.5 to 33 KB and 31 KB slots give a 6-slot ring), and the kernel compiles."""
    from kog_nvidia_hopper import schedule as S
    prog = _bench2b_program()
    two, one = (max(st.smem for st in S.lower(prog, 132, S.NT, kb) if st.type == "attn") for kb in (2, 1))
    assert two - one == 2 * 32 * (128 + 8) * 2 and one < 34 * 1024
    cubin, _, rep = _compile(NT=384, KV_BUFS=1)
    assert cubin[:4] == b"\x7fELF" and rep["registers"] <= MAX_REGISTERS


def test_ring_slots_fill_the_shared_memory_the_stages_leave(monkeypatch):
    """By default bench-2b's ring is six 31 KB slots (H200: 227 KB of shared memory a block), not five
    of 32; KOG_HOPPER_SLOT_KB still sets the size."""
    from types import SimpleNamespace
    from kog_nvidia_hopper import schedule as S
    from kog_nvidia_hopper.backend import HopperBackend
    stages = _bench2b_stages_as_loaded()
    hb = SimpleNamespace(nb=132, nw=S.NW_DEFAULT, max_smem=227 * 1024, norm_smem=1, kalign=32)
    monkeypatch.delenv("KOG_HOPPER_SLOT_KB", raising=False)
    slot, plans, scratch = HopperBackend._ring_slots(hb, stages, None)
    assert scratch == (max(st.smem for st in stages) + 127) // 128 * 128 and scratch < 34 * 1024
    assert slot == 31 * 1024 and (hb.max_smem - S.STATIC_SMEM - scratch) // slot == 6
    assert sorted(plans) == [si for si, st in enumerate(stages) if st.type == "matvec"]
    monkeypatch.setenv("KOG_HOPPER_SLOT_KB", "32")
    slot, _, scratch32 = HopperBackend._ring_slots(hb, stages, None)
    assert scratch32 == scratch and slot == 32 * 1024 and (hb.max_smem - S.STATIC_SMEM - scratch) // slot == 5


def test_ptxas_report_counts_the_spills_of_every_function():
    """A noinline callee's spills are the kernel's too: the report sums them."""
    from kog_nvidia_hopper.cuda_util import ptxas_report
    log = """ptxas info    : Compiling entry function 'kog_decode' for 'sm_90a'
ptxas info    : Function properties for kog_decode
ptxas         .     384 bytes stack frame, 52 bytes spill stores, 56 bytes spill loads
ptxas info    : Used 168 registers, used 2 barriers, 384 bytes cumulative stack size, 4736 bytes smem
ptxas info    : Function properties for _Z13run_attentionR3Ctx
ptxas         .     0 bytes stack frame, 144 bytes spill stores, 160 bytes spill loads
ptxas info    : Function properties for _Z6run_ewR3Ctx
ptxas         .     0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
"""
    assert ptxas_report(log) == dict(spill_stores=196, spill_loads=216, stack=384, entry_spill_stores=52,
                                     entry_spill_loads=56, registers=168)


def test_noinline_attention_build_compiles():
    """KOG_HOPPER_INLINE_ATTENTION=0 (the v14 build): run_attention a noinline callee, whose callee
    saves spill ~150 bytes more; with the signal warp and 10 consumer warps a block is 12 warps
    again, so above 128 registers."""
    cubin, _, rep = _compile(**dict(DEFAULT, INLINE_ATTENTION=0))
    assert cubin[:4] == b"\x7fELF" and 128 < rep["registers"] <= MAX_REGISTERS and rep["spill_stores"] <= 200


def test_compact_attention_experiment_compiles_smaller():
    """KOG_HOPPER_COMPACT_ATTENTION=1 (an experiment, off; 1.6% slower, session 9): the attention's
    loops are not unrolled; the build has no spills and fewer instructions than the default."""
    cubin, log, rep = _compile_clean(**DEFAULT, COMPACT_ATTENTION=1)
    default, _, _ = _compile(**DEFAULT)
    assert _code_bytes(cubin) < _code_bytes(default)


def test_ticket_and_stop_check_experiments_compile_clean_and_differ():
    """ATT_TICKET_ACQREL=1 and SAMPLE_TAIL=1 (experiments, off; session 23, level on an H100), and
    ATT_TAGS=1 (the chunks' partials polled by their tag, no ticket; with and without its batched
    pass; not yet run on a GPU):
    bench-2b's build with each has no spills and is not the default's machine code (their GPU
    tests: the default's, with KOG_HOPPER_DEFINES set)."""
    b2 = _bench2b_build()
    base, _, _ = _compile_clean(**b2)
    for extra in (dict(ATT_TICKET_ACQREL=1), dict(SAMPLE_TAIL=1), dict(ATT_TAGS=1), dict(ATT_TAGS=1, ATT_TAG_BATCH=0)):
        cubin, _, _ = _compile_clean(**b2, **extra)
        assert cubin != base, extra


def test_signal_arrive_experiment_compiles_clean_and_differs():
    """SIGNAL_ARRIVE=1 (an experiment, off: -0.6 to -1.0% on an H100, session 40; decode.cu): the consumers arrive on the
    signal warp's barrier (bar.arrive, barriers 3 and 4 by the stage's parity) instead of syncing
    with it. bench-2b's and laneformer-2b's builds with it have no spills (laneformer-2b's: at most
    its 4 entry bytes), differ from the default's and hold the arrive and the syncs in the SASS."""
    from kog_nvidia_hopper import schedule as S
    b2 = _bench2b_build()
    base, _, _ = _compile_clean(**b2)
    on, _, _ = _compile_clean(**b2, SIGNAL_ARRIVE=1)
    assert on != base
    lf = _laneformer2b_build()
    _compile_clean_but_entry(**lf, SIGNAL_ARRIVE=1)
    _nvdisasm_or_skip()
    from kog_nvidia_hopper.cuda_util import source
    from kog_nvidia_hopper.sass_report import disassemble_source
    sass = disassemble_source(source(S.header(dict(b2, SIGNAL_ARRIVE=1))))[2]
    assert "BAR.ARV" in sass and "BAR.SYNC" in sass
    assert "BAR.ARV" not in disassemble_source(source(S.header(b2)))[2]


@pytest.mark.parametrize("extra", [dict(X_CPASYNC=1), dict(X_CPASYNC=1, COMPACT_ATTENTION=1)])
def test_input_rows_by_cp_async_experiment_compiles(extra):
    """KOG_HOPPER_X_CPASYNC=1 (an experiment, off; 13% slower, session 9): a stage's input row by
    cp.async into shared memory; compiles without spills, alone and with the compact attention
    (with the normalise pass: the deferred norm multiplies by the weights on the register path)."""
    cubin, log, rep = _compile_clean(**dict(DEFAULT, DEFER_NORM=0), **extra)


def test_smem_addr_intrinsic_default_and_its_old_form_compile():
    """SMEM_ADDR_INTRINSIC (ring.cuh; the default since session 17): shared-memory addresses by the
    compiler's conversion; =0, the old inline-asm cvta, still compiles clean and differs. bench-2b's
    default build has no spills; laneformer-2b's, at the register bound, spills 4 bytes at the
    kernel's entry only (a value reloaded a stage at most; without the intrinsic it has none)."""
    b2 = _bench2b_build()  # a Llama-family model's MLP fused (session 20)
    on, _, _ = _compile_clean(**b2)
    off, _, _ = _compile_clean(**b2, SMEM_ADDR_INTRINSIC=0)
    assert on != off
    lf = _laneformer2b_build()
    _compile_clean_but_entry(**lf)
    _compile_clean(**lf, SMEM_ADDR_INTRINSIC=0)


def test_stream_probe_rounds_are_well_formed():
    """Every round's configurations name a known kind and only settings the launcher reads; round 9
    (instruction fetch) times the code block with every eviction size, alone and beside the ring."""
    from kog_nvidia_hopper import stream_probe as P
    known = set(P.DECODE_RING) | {"blocks", "trace", "wrap", "lsu_kb", "evict", "unroll", "threads", "l2_first",
                                  "item_kb", "short_every", "short_kb", "share_kb", "stride_kb"}
    for r in range(1, 16):
        for name, kind, settings in P.configs(round_=r):
            assert kind in ("ring", "ldg", "lat") and name.strip(), (r, name)
            assert set(settings) <= known, (r, name, set(settings) - known)
    r9 = P.configs(round_=9)
    assert sorted((k, s["evict"]) for _, k, s in r9) == [("lat", 0), ("lat", 1), ("lat", 2), ("ring", 0), ("ring", 1), ("ring", 2)]
    assert all(s["lat_kind"] == 3 for _, _, s in r9) and all(s["lat_warp"] == 1 for _, k, s in r9 if k == "ring")


def test_stream_probe_round13_items_fit_their_slots():
    """Round 13 (the decode kernel's 30 / 30 / 20 KB item mix): every mixed configuration's items fit
    its slots and take one bulk copy each (the launcher refuses anything else), and the rows pair
    6 with 5 slots."""
    from kog_nvidia_hopper import stream_probe as P
    r13 = P.configs(round_=13)
    mixed = [s for _, _, s in r13 if s.get("short_every")]
    assert len(mixed) == 5 and all(s["chunks"] == 1 and not s["ldgsts"] and not s["extra_kb"] for s in mixed)
    assert all(max(s.get("item_kb", s["kb"]), s["short_kb"]) <= s["kb"] for s in mixed)
    assert sorted(s["slots"] for s in mixed) == [5, 5, 5, 6, 6]


def test_stream_probe_round14_controls_the_mixed_path():
    """Round 14: every mixed row fits its slots in one bulk copy, and one row takes full 31 KB
    items through the mixed path (the control against the plain ring's first row)."""
    from kog_nvidia_hopper import stream_probe as P
    r14 = P.configs(round_=14)
    base = r14[0][2]
    assert not base.get("short_every") and base["kb"] == 31 and base["slots"] == 5
    mixed = [s for _, _, s in r14 if s.get("short_every")]
    assert all(s["chunks"] == 1 and max(s.get("item_kb", s["kb"]), s["short_kb"]) <= s["kb"] for s in mixed)
    assert any(s["short_every"] == 1 and s["short_kb"] == s["kb"] == 31 and s["slots"] == 5 for s in mixed)


def test_stream_probe_round15_shares_are_the_lm_heads():
    """Round 15: bench-2b's LM head layout in the probe: shares of ~3.8 MB a block (a whole
    number of 30 / 30 / 20 KB cycles or items), back to back or at a stride that holds them; every
    other configuration's share is unchanged (the whole buffer over the blocks)."""
    from kog_nvidia_hopper import stream_probe as P
    r15 = P.configs(round_=15)
    shares = [P.ring_share(n, s, 132) for n, _, s in r15]
    assert shares[0][0] > 30 * 2**20 and shares[0][1] == 0
    assert all(3700 * 1024 <= per <= 3884 * 1024 for per, _ in shares[1:])
    assert [st for _, st in shares[1:4]] == [0, 3877 * 1024, 4096 * 1024]
    assert shares[1][0] % (80 * 1024) == 0 and shares[4][0] % (31 * 1024) == 0 and shares[5][0] % (40 * 1024) == 0
    assert P.ring_share("x", P.configs(round_=14)[0][2], 132) == (P.BUFFER_BYTES // 132 // (31 * 1024) * 31 * 1024, 0)
    with pytest.raises(SystemExit, match="stride"):
        P.ring_share("x", dict(r15[1][2], stride_kb=1000), 132)


def test_stream_probe_round10_pairs_each_code_probe_with_its_evict_first_twin():
    """Round 10 reruns round 9 (clock fixed) and adds the same code probes with the ring's copies
    L2 evict-first, plus the ring alone and with load chains, each with and without the hint."""
    from kog_nvidia_hopper import stream_probe as P
    r10 = P.configs(round_=10)
    code_first = sorted(s["evict"] for _, k, s in r10 if k == "ring" and s["lat_kind"] == 3 and s.get("l2_first"))
    assert code_first == [0, 2]
    chains = sorted(s.get("l2_first", 0) for _, k, s in r10 if k == "ring" and s["lat_warp"] and s["lat_kind"] == 0)
    assert chains == [0, 1]


def test_stream_probe_compiles():
    """The weight-stream probes (kernels/stream_probe.cu, run by stream_probe.py on the GPU)."""
    pytest.importorskip("cuda.bindings.nvrtc", reason="cuda-python (NVRTC) is not installed")
    from kog_nvidia_hopper.cuda_util import ptxas_report
    from kog_nvidia_hopper.stream_probe import compile_probe
    cubin, log = compile_probe(unroll=16)
    assert cubin[:4] == b"\x7fELF"
    for entry in ("probe_ring", "probe_ldg", "probe_lat"):
        rep = ptxas_report(log, entry)
        assert "registers" in rep, log[-1500:]
    assert ptxas_report(log, "probe_ring")["spill_stores"] == 0, log[-1500:]


def test_more_attention_tiles_than_blocks_grow_the_chunk_table():
    """KOG_HOPPER_ATT_TILES above the block count (second tiles for the trace's cold/hot
    comparison): the stage may split into more chunks, its partials scratch grows with it, and a
    count the combine's table cannot hold is refused in one line."""
    from kog_nvidia_hopper import schedule as S
    at = next(st for st in _bench2b_stages_as_loaded() if st.type == "attn")
    f = at.f
    assert f["AT_MAXCH"] == 16 and f["AT_L"] * f["AT_HKV"] == 8
    S.allow_attention_chunks(at, 33, 320)
    assert f["AT_MAXCH"] == 33
    assert f["_scratch"]["part_o"] == f["AT_L"] * f["AT_H"] * 33 * f["AT_HD"]
    assert f["_scratch"]["part_ml"] == f["AT_L"] * f["AT_H"] * 33 * 2
    S.allow_attention_chunks(at, 4, 320)  # never fewer than before
    assert f["AT_MAXCH"] == 33
    with pytest.raises(CapabilityError, match="KOG_HOPPER_ATT_TILES"):
        S.allow_attention_chunks(at, 10_000, 320)


def test_tag_down_marks_each_gate_up_and_down_pair_with_alternating_writes():
    """KOG_HOPPER_TAG_DOWN=1: bench-2b's 26 gate/up stages write the one shared SwiGLU buffer with
    parity tags, write k of 26 a token, and each down_proj reads the write just before it; nothing
    else is tagged. A reader with a norm (not a plain row) is never tagged."""
    from kog_nvidia_hopper import schedule as S
    prog = _bench2b_program()
    stages = _bench2b_stages_as_loaded()
    assert S.tag_pair_outputs(prog, stages) == ["act"]
    out = [i for i, st in enumerate(stages) if st.f.get("MV_FLAGS", 0) & S.CONSTS["MVF_TAG_OUT"]]
    inp = [i for i, st in enumerate(stages) if st.f.get("MV_FLAGS", 0) & S.CONSTS["MVF_TAG_IN"]]
    assert len(out) == 26 and inp == [i + 1 for i in out]
    assert all(stages[i].label == "gate_proj+up_proj" and stages[i + 1].label == "down_proj" for i in out)
    assert [stages[i].f["MV_TAG"] for i in out] == [k | (26 << 16) for k in range(26)]
    assert all(stages[i].f["MV_TAG"] == stages[i + 1].f["MV_TAG"] for i in out)
    fresh = _bench2b_stages_as_loaded()
    for st in fresh:
        if st.label == "down_proj":
            st.f["MV_IN_MODE"] = S.CONSTS["IN_NORM"]
    assert S.tag_pair_outputs(prog, fresh) == []


def test_tag_down_build_compiles_and_leaves_the_default_alone():
    """The TAG_DOWN build has no spills; the parity code exists only in it."""
    consts = dict(_bench2b_shape_consts())
    cubin, log, rep = _compile_clean(**DEFAULT, **consts, TAG_DOWN=1)
    default, _, _ = _compile(**DEFAULT, **consts)
    assert _code_bytes(default) < _code_bytes(cubin)


def test_both_samplers_compile_with_warp_match_and_reduce():
    """Sampled decoding on every block (SAMPLE_GRID, the default; up to SAMPLE_GRID_MAX_EPT
    candidates per thread) and on block 0 (the fallback): no spills either way; the histograms
    group a warp's lanes by bin (match.any) and sum each group with full-warp redux.sync only: a
    member mask that differs between lanes compiles to a WARPSYNC.COLLECTIVE loop (session 11)."""
    import re
    from kog_nvidia_hopper import schedule as S
    from kog_nvidia_hopper.cuda_util import source
    block = {k: v for k, v in DEFAULT.items() if k not in ("SAMPLE_GRID", "SAMPLE_EPT")}
    cubin, log, rep = _compile_clean(**block)
    _compile_clean(**dict(DEFAULT, SAMPLE_EPT=S.SAMPLE_GRID_MAX_EPT))
    for v in (block, DEFAULT):
        assert "match.any.sync" in source(S.header(v))
    src = source(S.header(DEFAULT))
    assert "redux.sync.xor.b32" in src  # the bins' keys' XOR
    reduxes = re.findall(r"redux\.sync\.[a-z0-9.]+ [^;]*;", src)
    assert reduxes and all(r.endswith("0xffffffff;") for r in reduxes), reduxes
    assert S.sample_radix_smem() == 256 * 12 + 32 + 4 * S.CONSTS["SAMPLE_CAP"]
    assert S.sample_grid_smem() == 2 * 256 * 20
    default, _, _ = _compile(**DEFAULT)
    assert default != cubin


def _static_smem(log: str) -> int:
    import re
    return int(re.search(r"(\d+) bytes smem", log).group(1))


def test_dynamic_shared_memory_is_aligned():
    """The ring's slots start on 128-byte boundaries (stream.cuh SMEM_ALIGN): the dynamic shared
    memory follows the static, whose size moves with every __shared__ variable. Off a 128-byte
    boundary the weight copies were 17% slower (perf notes, session 10); without the alignment this
    build's static size is 5456 bytes, and the test fails."""
    for v in (DEFAULT, {k: x for k, x in DEFAULT.items() if k not in ("SAMPLE_GRID", "SAMPLE_EPT")}):
        _, log, _ = _compile(**v)
        assert _static_smem(log) % 128 == 0, log
    _, log, _ = _compile(**dict(DEFAULT, SMEM_ALIGN=16))
    assert _static_smem(log) % 128 != 0  # the test can fail: this build's ring would be misaligned


def test_grid_sampler_takes_a_128k_vocabulary_in_four_candidates_a_thread():
    from kog_nvidia_hopper import schedule as S
    assert S.sample_grid_ept(128256, 132, 320) == 4   # 972 a block
    assert S.sample_grid_ept(1000, 132, 320) == 1
    assert S.sample_grid_ept(320 * 132 * 8, 132, 320) == 8
    assert S.sample_grid_ept(320 * 132 * 8 + 1, 132, 320) == 9  # over the bound: block 0 samples
    # the global bins: a round per pass of each of 3 selects, two sets (a token's parity), 5 KB a round
    assert S.CONSTS["SG_ROUNDS"] == 3 * 8
    assert S.sample_grid_bytes() == 128 + 2 * 24 * 5120


def test_attention_shape_constants_for_bench_2b_and_none_when_stages_differ():
    """KOG_HOPPER_SHAPE_CONSTS=1: bench-2b's attention stages share one shape, which becomes the
    ATC_* constants; stages that differ give none (the descriptor fields stay in use)."""
    from kog_nvidia_hopper import schedule as S
    stages = _bench2b_stages_as_loaded()
    consts = S.attention_shape_consts(stages)
    at = next(st for st in stages if st.type == "attn")
    assert consts == {f"ATC_{k}": at.f[f"AT_{k}"] for k in S.ATTENTION_SHAPE_FIELDS}
    assert consts["ATC_HD"] == 128 and consts["ATC_T"] == 4096
    later = [st for st in stages if st.type == "attn"][-1]
    later.f["AT_HKV"] *= 2
    assert S.attention_shape_consts(stages) == {}


def test_attention_shape_constants_build_compiles_smaller():
    """The SHAPE_CONSTS build (bench-2b's shapes) compiles without spills to fewer instructions."""
    consts = dict(_bench2b_shape_consts())
    cubin, log, rep = _compile_clean(**DEFAULT, **consts)
    default, _, _ = _compile(**DEFAULT)
    assert _code_bytes(cubin) < _code_bytes(default)


@pytest.mark.parametrize("off", [dict(NORM_RCP=0), dict(NORM_RCP=0, ATT_FASTDIV=0)])
def test_v18b_defaults_make_the_code_smaller(off):
    """NORM_RCP (the normalise pass divides through d's reciprocal, Markstein) and ATT_FASTDIV (the
    attention's divisions by its chunk count from a corrected float estimate), defaults since v18b:
    turned off (KOG_HOPPER_NORM_RCP=0, KOG_HOPPER_ATT_FASTDIV=0) the build still has no spills, and
    more code on the per-layer path."""
    consts = dict(_bench2b_shape_consts())
    _compile_clean(**dict(DEFAULT, **consts, **off))
    # sizes compared with block 0's sampler: the grid sampler's allocation moves the total by more
    # than these changes (it is off the per-layer path); with the normalise pass (DEFER_NORM=0),
    # the only code NORM_RCP touches
    block = {k: v for k, v in DEFAULT.items() if k not in ("SAMPLE_GRID", "SAMPLE_EPT")}
    block["DEFER_NORM"] = 0
    cubin, _, _ = _compile(**dict(block, **consts, **off))
    default, _, _ = _compile(**block, **consts)
    assert _code_bytes(default) < _code_bytes(cubin)


def test_markstein_division_is_the_correctly_rounded_quotient():
    """NORM_RCP's x / d = q + (x - q d) r with r = RN(1 / d), q = RN(x r), each FMA rounded once
    (emulated in long double): the same float32 as a division for normal operands."""
    rng = np.random.default_rng(0)
    n = 200_000
    x = (rng.standard_normal(n) * np.exp(rng.uniform(-8, 8, n))).astype(np.float32)
    d = np.exp(rng.uniform(-6, 6, n)).astype(np.float32)
    r = (np.float32(1) / d).astype(np.float32)
    q = (x * r).astype(np.float32)
    L = np.longdouble
    e = (L(x) - L(q) * L(d)).astype(np.float32)
    out = (L(e) * L(r) + L(q)).astype(np.float32)
    assert np.array_equal(out, x / d)


def test_weight_copies_carry_the_l2_evict_first_hint_unless_turned_off():
    """STREAM_L2_FIRST (default since v18; KOG_HOPPER_STREAM_L2_FIRST=0 turns it off): the
    producer's bulk copies carry an L2 evict-first cache policy. No spills either way."""
    from kog_nvidia_hopper import schedule
    from kog_nvidia_hopper.cuda_util import source
    assert "createpolicy.fractional.L2::evict_first" in source(schedule.header(DEFAULT))
    cubin, log, rep = _compile_clean(**dict(DEFAULT, STREAM_L2_FIRST=0))
    default, _, _ = _compile(**DEFAULT)
    assert cubin != default  # the hint changed the code (SASS: UBLKCP with a desc[] operand)


def test_lsu_copy_build_compiles():
    """KOG_HOPPER_COPY_LSU=1: ring slots filled by the producer lanes' 16-byte cp.async instead of
    the bulk copy engine (an experiment, perf notes session 6)."""
    cubin, log, rep = _compile(**DEFAULT, COPY_LSU=1)
    assert cubin[:4] == b"\x7fELF" and rep["registers"] <= MAX_REGISTERS, rep
    assert rep["spill_stores"] == 0, rep


@pytest.mark.parametrize("model", ["bench-2b", "laneformer-small"])
def test_x_scratch_matches_the_stream_plan(model):
    """The ring is sized from x_scratch before any plan is cut (one stream_plan pass at load); it
    must equal what stream_plan itself reports, for any slot size, also with several lanes."""
    from kog_core.interfaces import resolve_factory
    from kog_core.plugins import load_registry
    from kog_nvidia_hopper import schedule as S
    if model == "bench-2b":
        prog = _bench2b_program()
    else:
        from gpu.hopper_models import LANEFORMER_SMALL
        arch = resolve_factory(load_registry().architectures["laneformer"].factory)(LANEFORMER_SMALL["laneformer-replicate"])
        prog = arch.lower(context_length=64, kv_dtype="bf16")
        assert prog.lanes > 1
    stages = [st for st in S.lower(prog, 132, 32 * S.NW_DEFAULT, 1) if st.type == "matvec"]
    for st in stages:
        for slot_kb in (16, 31):
            assert S.x_scratch(st, 132) == S.stream_plan(st, 132, S.NW_DEFAULT, slot_kb * 1024)[1], st.label


def test_sass_report_counts_local_and_generic_accesses_by_source_line(monkeypatch):
    """sass_report (perf notes v16a) reads nvdisasm -g output; without nvdisasm it says where to get it."""
    from kog_core.errors import KogError
    from kog_nvidia_hopper.sass_report import count_by_line, nvdisasm
    sass = """
	//## File "/x/decode.cu", line 12
        /*0010*/                   LDL R7, [R109] ;
        /*0020*/                   LDS.128 R4, [R21] ;
	//## File "/x/decode.cu", line 30
        /*0030*/                   LD.E.128 R28, desc[UR10][R126.64] ;
        /*0040*/                   STL.64 [R1+0x70], R4 ;
        /*0050*/                   ST.E desc[UR10][R30.64], R59 ;
        /*0060*/                   LDL.64 R6, [R120] ;
"""
    c = count_by_line(sass)
    assert c[12] == {"LDL": 1} and c[30] == {"LD.E": 1, "STL": 1, "ST.E": 1, "LDL": 1}
    monkeypatch.setenv("KOG_NVDISASM", "/nonexistent/nvdisasm")
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(KogError) as e:
        nvdisasm()
    assert "nvidia-cuda-nvdisasm" in str(e.value) and "\n" not in str(e.value)


def test_sass_report_load_use_finds_loads_read_too_soon():
    """--load-use (sessions 22-23): a global load whose value is read within the window is listed
    with its source line (five-digit addresses too: the kernel is over 64 KB of code); registers
    overwritten first, shared-memory loads and reads past the window are not."""
    from kog_nvidia_hopper.sass_report import load_use
    sass = """
	//## File "/x/decode.cu", line 40
        /*fff0*/                   LDG.E.STRONG.GPU R12, desc[UR12][R12.64] ;
        /*10000*/                  IMAD R71, R69, 0x4, R20 ;
        /*10010*/                  STS [R71], R12 ;
	//## File "/x/decode.cu", line 41
        /*10020*/              @P0 LD.E.64 R20, desc[UR4][R22.64] ;
        /*10030*/                  MOV R20, RZ ;
        /*10040*/                  FADD R5, R20, R21 ;
        /*10050*/                  LDS.64 R30, [R99+0x48] ;
        /*10060*/                  FADD R6, R30, R31 ;
        /*10070*/                  LDG.E.128 R40, desc[UR4][R8.64] ;
        /*10080*/                  ST.E desc[UR4][R8.64], R7 ;
        /*10090*/                  NOP ;
        /*100a0*/                  NOP ;
        /*100b0*/                  FADD R9, R43, R9 ;
"""
    hits = load_use(sass, window=4)
    assert [(a, line, d) for a, line, d, _, _ in hits] == [("fff0", 40, 2), ("10020", 41, 2)]
    assert hits[1][4].startswith("FADD R5, R20")  # R21 (the 64-bit load's high half) is read there
    assert [a for a, *_ in load_use(sass, window=8)] == ["fff0", "10020", "10070"]


def test_sass_report_same_loop_compares_the_item_loops_up_to_addresses():
    """--same-loop (session 25): the matvec item loops' instructions, found by their source lines,
    compared as runs with addresses masked; a moved block is the same code, a changed or reordered
    instruction is not. The loops' lines are found in the real matvec.cuh."""
    from pathlib import Path
    import kog_nvidia_hopper
    from kog_nvidia_hopper.sass_report import function_lines, loop_runs
    cuda = """// a comment
__device__ __forceinline__ void mv_items(int* q) {
    int a = q[0];  // load
#if X
    a += 1;
#endif
    q[1] = a;
}
__device__ void other() { int b = 2; }
__device__ __forceinline__ void mv_down_items(int* q) {
    q[2] = 3;
}
"""
    code = function_lines(cuda)
    assert code == {"__device__ __forceinline__ void mv_items(int* q) {", "int a = q[0];  // load",
                    "a += 1;", "q[1] = a;", "__device__ __forceinline__ void mv_down_items(int* q) {",
                    "q[2] = 3;"}
    src = "int a = q[0];  // load\nq[1] = a;\nint b = 2;\n"
    def sass(order, addr, extra=""):
        body = {1: f"        /*{addr:04x}*/   LDG.E R2, desc[UR4][R4.64] ;\n"
                   f"        /*{addr + 16:04x}*/   BRA 0x{addr + 64:x} ;\n",
                3: "        /*0400*/   MOV R9, 0x2 ;\n" + extra}
        return "".join(f'\t//## File "/x/decode.cu", line {n}\n' + body[n] for n in order)
    base = loop_runs(src, sass([1, 3], 0x100), code)
    assert base == [("LDG.E R2, desc[UR4][R4.64]", "BRA X")]
    assert loop_runs(src, sass([3, 1], 0x800), code) == base  # placed elsewhere: the same
    moved = sass([1, 3], 0x100).replace("LDG.E R2", "LDG.E R3")
    assert loop_runs(src, moved, code) != base  # another register: not the same schedule
    real = function_lines((Path(kog_nvidia_hopper.__file__).parent / "kernels" / "matvec.cuh").read_text())
    assert any("mv_items(" in t for t in real) and any("mv_down_items(" in t for t in real) and len(real) > 100


def test_sass_report_live_reads_life_ranges_and_source_lines():
    """--live (session 25): nvdisasm -lrm count's '# live' column and -g's source lines, joined by
    address (five-digit addresses too)."""
    from kog_nvidia_hopper.sass_report import addr_lines, live_counts
    lrm = """        /*0000*/                   LDC R1, c[0x0][0x28] ;     // |   12  |   1    |        |
        /*10010*/                  LDG.E.128 R4, desc[UR4][R2.64] ;   // |  148  |   2    |    2   |
        /*10020*/                  NOP ;
"""
    assert live_counts(lrm) == {"0000": 12, "10010": 148}
    g = """	//## File "/x/decode.cu", line 7
        /*0000*/                   LDC R1, c[0x0][0x28] ;
	//## File "/x/decode.cu", line 9
        /*10010*/                  LDG.E.128 R4, desc[UR4][R2.64] ;
"""
    assert addr_lines(g) == {"0000": 7, "10010": 9}


def test_norm_smem_reserves_the_norm_weights_and_the_wpre_build_compiles(monkeypatch):
    """NORM_SMEM (the default since v17; perf notes session 8): the preloaded norm weights go to
    shared memory after the x rows, so a normed stage's scratch grows by K * 2 bytes.
    KOG_HOPPER_NORM_SMEM=0 (the weights in local memory, wpre) still compiles without spills."""
    from types import SimpleNamespace
    from kog_nvidia_hopper import schedule as S
    from kog_nvidia_hopper.backend import HopperBackend
    stages = _bench2b_stages_as_loaded()
    monkeypatch.delenv("KOG_HOPPER_SLOT_KB", raising=False)
    sizes = {}
    for flag in (0, 1):
        hb = SimpleNamespace(nb=132, nw=S.NW_DEFAULT, max_smem=227 * 1024, norm_smem=flag, kalign=1)
        _, _, scratch = HopperBackend._ring_slots(hb, stages, None)
        sizes[flag] = ([st.smem for st in stages], scratch)
    normed = [i for i, st in enumerate(stages) if st.type == "matvec" and st.f["MV_IN_MODE"] & S.CONSTS["IN_NORM"]]
    assert normed
    for i, st in enumerate(stages):
        extra = int(st.f["MV_K"]) * 2 if i in normed else 0
        assert sizes[1][0][i] == sizes[0][0][i] + extra
    assert sizes[1][1] == sizes[0][1]  # bench-2b: the attention's scratch still sets the ring's offset
    cubin, _, rep = _compile(**dict(DEFAULT, NORM_SMEM=0))
    assert cubin[:4] == b"\x7fELF" and rep["registers"] <= MAX_REGISTERS
    assert rep["spill_stores"] == 0, rep


def test_what_if_builds_compile_and_leave_the_default_alone():
    """matvec.cuh DEBUG_DOT (what-if builds whose results are wrong on purpose, set through
    KOG_HOPPER_DEFINES): they compile without spills, and the default build has none of their code."""
    d1, _, _ = _compile_clean(**DEFAULT, DEBUG_DOT=1)
    d2, _, _ = _compile_clean(**DEFAULT, DEBUG_DOT=2)
    default, _, _ = _compile(**DEFAULT)
    assert len({default, d1, d2}) == 3


def test_experiment_defines_are_checked(monkeypatch):
    """KOG_HOPPER_DEFINES takes NAME=INTEGER pairs; anything else is a one-line error with the form."""
    from kog_nvidia_hopper.backend import env_defines
    monkeypatch.setenv("KOG_HOPPER_DEFINES", "DEBUG_DOT=1,NSLOTS=5")
    assert env_defines() == {"DEBUG_DOT": 1, "NSLOTS": 5}
    monkeypatch.setenv("KOG_HOPPER_DEFINES", "DEBUG_DOT=1;NSLOTS=5")
    assert env_defines() == {"DEBUG_DOT": 1, "NSLOTS": 5}
    for bad in ("DEBUG_DOT", "debug_dot=1", "DEBUG_DOT=x", "A B=1"):
        monkeypatch.setenv("KOG_HOPPER_DEFINES", bad)
        with pytest.raises(KogError, match="NAME=INTEGER"):
            env_defines()


def test_normalise_pass_build_compiles_and_deferred_norm_keeps_the_ring_aligned():
    """The deferred norm (default since v21) and the normalise pass (KOG_HOPPER_DEFER_NORM=0, also
    any model with more than DEFER_NORM_LANES input rows a block) both compile without spills, also
    with the norm weights in local memory and in the trace build; the deferred norm's per-warp sums
    of squares keep the dynamic shared memory on a 128-byte boundary."""
    from kog_nvidia_hopper import schedule as S
    _compile_clean(**DEFAULT)
    _compile_clean(**dict(DEFAULT, NORM_SMEM=0))
    _compile_clean(**DEFAULT, TRACE=1)
    pass_build = dict(DEFAULT, DEFER_NORM=0)
    cubin, log, _ = _compile_clean(**pass_build)
    _compile_clean(**dict(pass_build, NORM_SMEM=0))
    assert _static_smem(_compile(**DEFAULT)[1]) % 128 == 0
    assert _static_smem(_compile(**DEFAULT)[1]) == _static_smem(log) + S.DEFER_NORM_LANES * DEFAULT["NT"] // 32 * 4
    assert _compile(**DEFAULT)[0] != cubin


def test_signal_bar_build_uses_a_third_barrier():
    """SIGNAL_BAR (default since v21): the signal warp joins the end-of-stage barrier (named barrier
    2 of NT + 32 threads), so ptxas counts one barrier more than the polling build
    (KOG_HOPPER_SIGNAL_BAR=0), which also compiles without spills, in the trace build too."""
    import re
    _, log, _ = _compile_clean(**DEFAULT, TRACE=1)
    _, poll_log, _ = _compile_clean(**dict(DEFAULT, SIGNAL_BAR=0))
    _compile_clean(**dict(DEFAULT, SIGNAL_BAR=0), TRACE=1)
    barriers = lambda lg: int(re.search(r"used (\d+) barriers", lg).group(1))
    assert barriers(_compile(**DEFAULT)[1]) == barriers(poll_log) + 1 == 3


def test_sass_report_builds_the_default():
    """sass_report's build is the backend's default for bench-2b: the compile tests' DEFAULT plus
    the ring, bench-2b's attention shapes and the split-K MLP (it lagged behind twice: three
    versions, then v28's SPLITK_DOWN until session 25; v31's and v32's tags)."""
    from kog_nvidia_hopper.sass_report import DEFAULT_BUILD
    shapes = dict(_bench2b_shape_consts())
    assert DEFAULT_BUILD == dict(DEFAULT, **shapes, NSLOTS=5, SLOT_BYTES=31744, RING_OFF=32768, PREFETCH=0,
                                 SPLITK_DOWN=1,  # a Llama-family model's MLP (v28)
                                 TAG_QKV=1, TAG_OPROJ=1,  # readiness in the data around the attention (v31)
                                 TAG_X=1)  # and for x between o_proj and the MLP (v32)
    _compile_clean(**DEFAULT_BUILD)  # within the register bound, no spills


def test_every_tuning_knob_is_documented():
    """Each KOG_HOPPER_* variable the backend reads appears in docs/nvidia-hopper.md's knob table."""
    import re
    from pathlib import Path
    root = Path(__file__).resolve().parents[1]
    src = (root / "plugins/nvidia_hopper/backend.py").read_text()
    doc = (root / "docs/nvidia-hopper.md").read_text()
    names = set(re.findall(r"KOG_HOPPER_[A-Z0-9_]+", src))
    assert len(names) > 20
    assert sorted(n for n in names if f"`{n}" not in doc) == []


def test_deferred_norm_is_refused_where_a_block_would_keep_too_many_sums():
    """The deferred norm (default since v21) applies to bench-2b; a block that would take more than
    DEFER_NORM_LANES input rows of a normed stage, or the cp.async input path, keeps the normalise
    pass (the backend says why when KOG_HOPPER_DEFER_NORM=1 asks for it anyway)."""
    import numpy as np
    from kog_nvidia_hopper import schedule as S
    from kog_nvidia_hopper.backend import defer_norm_refusal
    stages = _bench2b_stages_as_loaded()
    binfo = np.zeros((len(stages), 132, 4), np.int32)
    binfo[:, :, 2] = 1  # one lane a block everywhere: bench-2b is dense
    assert defer_norm_refusal(stages, binfo, {}) == ""
    assert "X_CPASYNC" in defer_norm_refusal(stages, binfo, {"X_CPASYNC": 1})
    normed = next(i for i, st in enumerate(stages)
                  if st.type == "matvec" and int(st.f.get("MV_IN_MODE") or 0) & S.CONSTS["IN_NORM"])
    binfo[normed, 7, 2] = S.DEFER_NORM_LANES + 1
    assert f"{S.DEFER_NORM_LANES + 1} input rows" in defer_norm_refusal(stages, binfo, {})
    unnormed = next(i for i, st in enumerate(stages) if st.type != "matvec")
    binfo[normed, 7, 2], binfo[unnormed, 7, 2] = 1, 64  # many lanes where nothing is normed: fine
    assert defer_norm_refusal(stages, binfo, {}) == ""


@pytest.mark.parametrize("shape", [dict(ATC_H=32, ATC_HKV=8, ATC_HD=64),   # llama-3.2-1b: 2 columns a lane
                                   dict(ATC_H=6, ATC_HKV=2, ATC_HD=32),    # 1 column a lane, 3 heads a group
                                   dict(ATC_H=4, ATC_HKV=2, ATC_HD=256),   # 8 columns a lane
                                   dict(ATC_H=32, ATC_HKV=16, ATC_HD=96),  # laneformer-2b: 3 columns a lane, strided
                                   dict(ATC_H=8, ATC_HKV=4, ATC_HD=192),   # 6 columns a lane, strided
                                   dict(ATC_H=4, ATC_HKV=2, ATC_HD=80),    # not a multiple of 32: the block steps
                                   dict(ATC_H=8, ATC_HKV=2, ATC_HD=256)])  # 32 pairs a lane: the block steps
def test_attention_warp_rows_compile_for_other_shapes(shape):
    """ATT_WARP_ROWS (default since session 12 where the shapes are compiled in): each warp keeps its
    own running softmax over whole K/V rows. Builds for other head sizes and group sizes have no
    spills; bench-2b's build differs from the block-step form (ATT_WARP_ROWS=0), so the path is
    really taken there."""
    consts = dict(_bench2b_shape_consts())
    _compile_clean(**dict(DEFAULT, **dict(consts, **shape)))
    if shape["ATC_HD"] == 64:
        rows, _, _ = _compile_clean(**DEFAULT, **consts)
        steps, _, _ = _compile_clean(**DEFAULT, **consts, ATT_WARP_ROWS=0)
        assert rows != steps


def test_rms_block_is_compiled_in_only_where_a_long_rmsnorm_stage_is():
    """elementwise.cuh RMS_BLOCK (the default since session 14; KOG_HOPPER_RMS_BLOCK=0 turns it
    off): laneformer-2b's final norm (8 lanes x 3072) is a stage it takes, and the backend compiles
    it in there; bench-2b and llama-3.2-1b have no such stage (their norms are folded into matvecs),
    so their builds stay without it. The build with it compiles within the register bound and
    without spills, and differs from the one without (the path is really compiled in)."""
    import re
    from kog_moe_standard_tp.llama import Llama
    from kog_moe_standard_tp.presets import LLAMA_32_1B
    from kog_nvidia_hopper import schedule as S
    from kog_nvidia_hopper.cuda_util import KERNEL_DIR
    assert S.has_long_rmsnorm(S.lower(_laneformer2b_program(), 132, 320, 1), 320)
    llama_1b = Llama(LLAMA_32_1B.config).lower(context_length=4096, kv_dtype="bf16")
    for name, prog in (("bench-2b", _bench2b_program()), ("llama-3.2-1b", llama_1b)):
        assert not S.has_long_rmsnorm(S.lower(prog, 132, 320, 1), 320), name
    src = (KERNEL_DIR / "elementwise.cuh").read_text()
    assert int(re.search(r"#define RMS_V (\d+)", src).group(1)) == S.RMS_BLOCK_VALUES
    on, _, _ = _compile_clean(**DEFAULT, RMS_BLOCK=1)
    assert _compile(**DEFAULT)[0] != on


def test_lane_residual_fusion_takes_only_delayed_residuals_and_compiles():
    """schedule._fuse_lane_residual (KOG_HOPPER_FUSE_LANE_RESIDUAL, the default since session 14): on
    laneformer-2b every "delayed" lane_residual (and the collective before it) goes into the
    matvec stage that writes its fresh partial, one stage fewer each; the early layers'
    "allreduce" / "local" residuals stay elementwise stages; each block's rows of a fused stage
    are one contiguous range and the blocks cover every row once; the build with the fused
    residual (LANE_RESIDUAL) has no spills, and a build with no fused stage (a Llama's) none of its code."""
    from kog_nvidia_hopper import schedule as S
    prog = _laneformer2b_program()
    plain = S.lower(prog, 132, 320, 1)
    fused = S.lower(prog, 132, 320, 1, fuse_lane_residual=True)
    delayed = [i for i, op in enumerate(prog.ops) if op.kind == "lane_residual" and op.attr("mode") == "delayed"]
    segs = [(st, sg) for st in fused for sg in st.segs if sg["SEG_LRX"]]
    assert delayed and len(segs) == len(delayed) == len(plain) - len(fused)
    for st, sg in segs:
        op = next(prog.ops[j] for j in st.ops if prog.ops[j].kind == "lane_residual")
        assert sg["out_name"] == op.inputs[1] and sg["SEG_LRX"] == "@" + op.inputs[0] and sg["SEG_LRD"] == "@" + op.inputs[2]
    left = [st for st in fused if st.label == "lane_residual"]
    assert len(left) == sum(1 for op in prog.ops if op.kind == "lane_residual") - len(delayed) > 0
    # each fused stage's rows are covered once, each block's a contiguous range (binfo's fourth field)
    for st in fused:
        if not any(sg["SEG_LRX"] for sg in st.segs):
            continue
        plan, _ = S.stream_plan(st, 132, 10, 31744, None, 32)
        w = S.lane_residual_rows(S.plan_items(plan, 132), plan[:133], st.segs, 132)
        sg = next(sg for sg in st.segs if sg["SEG_LRX"])
        covered = np.zeros(sg["lanes"] * sg["SEG_N"], np.int32)
        for v in w[w != 0]:
            covered[v & 0xffff:(v & 0xffff) + (v >> 16)] += 1
        assert (covered == 1).all()
        assert not S.lane_residual_rows(S.plan_items(plan, 132), plan[:133], [dict(s, SEG_LRD=0) for s in st.segs], 132).any()
    consts = dict(_bench2b_shape_consts())
    _compile_clean(**DEFAULT, LANE_RESIDUAL=1)
    with_lr, _, _ = _compile_clean(**DEFAULT, **consts, LANE_RESIDUAL=1)
    assert _compile(**DEFAULT, **consts)[0] != with_lr


def test_wide_items_fill_the_slots_of_stages_with_short_rows():
    """schedule.wide_items (KOG_HOPPER_WIDE_ITEMS, matvec.cuh WIDE_ITEMS): on laneformer-2b only
    o_proj (K = 384) takes items of 4 rows a warp, which fill its 31 KB slots instead of half of
    each; bench-2b has no such stage, so its build keeps the item loop it had. The backend marks
    the stage (MVF_WIDE) and the build compiles without spills; bench-2b's is unchanged by the knob."""
    from types import SimpleNamespace
    from kog_nvidia_hopper import schedule as S
    from kog_nvidia_hopper.backend import HopperBackend
    prog = _laneformer2b_program()
    stages = S.lower(prog, 132, 320, 1, fuse_lane_residual=True)
    for st in stages:
        if st.type == "matvec":
            S.finalize_matvec(st, 132, prog.logits, lambda tiles: 0, logits_numel=prog.tensors[prog.logits].numel)
    hb = SimpleNamespace(nb=132, nw=S.NW_DEFAULT, max_smem=227 * 1024, norm_smem=1, kalign=32)
    slot, plans, _ = HopperBackend._ring_slots(hb, stages, None, True)
    wide = [si for si in plans if stages[si].f["MV_FLAGS"] & S.CONSTS["MVF_WIDE"]]
    assert slot == 31744 and wide
    assert all(int(stages[si].f["MV_K"]) == 384 and stages[si].label == "wo" for si in wide)
    assert len(wide) == sum(1 for st in stages if st.type == "matvec" and int(st.f["MV_K"]) == 384)
    for si in wide:
        its = S.plan_items(plans[si], 132)
        assert 2 * S.NW_DEFAULT < its[:, 4].max() <= 4 * S.NW_DEFAULT and (its[:, 7] == 3).all()  # one k-slice each
        assert (its[:, 4] * its[:, 6] * 2).mean() > 0.75 * slot  # against 15 KB of 31 an item before
    _, plans_off, _ = HopperBackend._ring_slots(hb, stages, None, False)
    assert not any(st.type == "matvec" and st.f["MV_FLAGS"] & S.CONSTS["MVF_WIDE"] for st in stages)
    assert max(S.plan_items(plans_off[si], 132)[:, 4].max() for si in wide) == 2 * S.NW_DEFAULT
    b2 = _bench2b_stages_as_loaded()
    assert not any(S.wide_items(st, S.NW_DEFAULT, 31744) for st in b2)
    consts = dict(S.attention_shape_consts(stages))
    on, _, _ = _compile_clean(**DEFAULT, **consts, RMS_BLOCK=1, LANE_RESIDUAL=1, WIDE_ITEMS=1)
    assert on != _compile(**DEFAULT, **consts, RMS_BLOCK=1, LANE_RESIDUAL=1)[0]


def test_lanes_load_applies_where_a_block_takes_several_lanes_and_compiles_clean():
    """matvec.cuh LANES_LOAD (KOG_HOPPER_LANES_LOAD): laneformer-2b has blocks whose share of a
    matvec stage spans two lanes' input rows (dealt segment by segment, q/k/v: 20 of 132; lane by
    lane, the default: 4 in each stage), each within one batch of XV float4s a thread with K / 4 a
    multiple of 32 (a warp's batch slot in one lane); bench-2b has none, so its build never has
    the path. The Laneformer build with it and the wide items has no spills but 4 bytes at the kernel's entry."""
    from kog_nvidia_hopper import schedule as S
    stages = S.lower(_laneformer2b_program(), 132, 320, 1, fuse_lane_residual=True)
    multi = 0
    for st in stages:
        if st.type != "matvec":
            continue
        plan, _ = S.stream_plan(st, 132, S.NW_DEFAULT, 31744, None, 32, wide=S.wide_items(st, S.NW_DEFAULT, 31744))
        nl = plan[2 * 132 + 1:3 * 132 + 1]
        K4 = int(st.f["MV_K"]) // 4
        multi += int((nl > 1).sum())
        assert (nl * K4 <= 6 * 320).all() and K4 % 32 == 0  # XV = 6 float4s a thread at 10 warps
        st.f["_lane_major"], st.f["_lane_pad"] = 1, 24  # the backend's default dealing
        plan, _ = S.stream_plan(st, 132, S.NW_DEFAULT, 31744, None, 32, wide=S.wide_items(st, S.NW_DEFAULT, 31744))
        nl = plan[2 * 132 + 1:3 * 132 + 1]
        assert nl.max() <= 2 and (st.label == "lm_head" or (nl == 2).sum() >= 1)
    assert multi >= 20
    for st in _bench2b_stages_as_loaded():
        if st.type == "matvec":
            plan, _ = S.stream_plan(st, 132, S.NW_DEFAULT, 31744, None, 32)
            assert plan[2 * 132 + 1:3 * 132 + 1].max() <= 1
    consts = dict(S.attention_shape_consts(stages))
    on, _, _ = _compile_clean_but_entry(**DEFAULT, **consts, RMS_BLOCK=1, LANE_RESIDUAL=1, WIDE_ITEMS=1, LANES_LOAD=1)
    assert on != _compile(**DEFAULT, **consts, RMS_BLOCK=1, LANE_RESIDUAL=1, WIDE_ITEMS=1)[0]
    _compile_clean(**dict(DEFAULT, DEFER_NORM=0), **consts, LANES_LOAD=1)  # plain inputs only, normed ones a lane at a time


@pytest.mark.parametrize("pad", [0, 8, 16, 24])
def test_rows_dealt_lane_by_lane_cover_every_weight_once(pad):
    """schedule._deal_rows with _lane_major (KOG_HOPPER_LANE_MAJOR) and _lane_pad: on laneformer-2b
    every (segment, lane, row) of every matvec stage is in exactly one block's items, a block takes
    at most two lanes (so the x scratch does not grow), q/k/v has fewer two-lane blocks than dealt
    segment by segment, and with a pad those blocks take fewer weight bytes than the others."""
    from kog_nvidia_hopper import schedule as S
    stages = S.lower(_laneformer2b_program(), 132, 320, 1, fuse_lane_residual=True)
    for st in stages:
        if st.type != "matvec":
            continue
        before = S.stream_plan(st, 132, 10, 31744, None, 32)[0]
        xs = S.x_scratch(st, 132)
        st.f["_lane_major"], st.f["_lane_pad"] = 1, pad
        plan, xbytes = S.stream_plan(st, 132, 10, 31744, None, 32)
        assert S.x_scratch(st, 132) == xbytes <= xs
        its = S.plan_items(plan, 132)
        seen = {(si, l): np.zeros(int(sg["SEG_N"]), np.int32) for si, sg in enumerate(st.segs) for l in range(sg["lanes"])}
        for si, lane, _, r0, rows, k0, klen, flags, _ in its:
            if flags & 1:
                seen[(int(si), int(lane))][r0:r0 + rows] += 1
        assert all((v == 1).all() for v in seen.values()), st.label
        nl, nl_before = plan[2 * 132 + 1:3 * 132 + 1], before[2 * 132 + 1:3 * 132 + 1]
        assert nl.max() <= 2 and (nl == 2).sum() <= (nl_before == 2).sum()
        if st.label == "wq+wk+wv":
            assert (nl == 2).sum() < (nl_before == 2).sum()
            offs = plan[:133]
            by = np.array([int((its[offs[b]:offs[b + 1], 4] * its[offs[b]:offs[b + 1], 6]).sum()) for b in range(132)])
            if pad:
                assert by[nl == 2].max() < by[nl == 1].min()
    # a model without lanes gets the same plan either way (bench-2b's build needs no re-measurement)
    for st in _bench2b_stages_as_loaded():
        if st.type == "matvec":
            before = S.stream_plan(st, 132, 10, 31744, None, 32)[0]
            st.f["_lane_major"], st.f["_lane_pad"] = 1, pad
            assert (S.stream_plan(st, 132, 10, 31744, None, 32)[0] == before).all()


def _small_llama_program(**overrides):
    """A small Llama decode program (hidden 256, intermediate 512, 3 layers) for lowering tests."""
    from kog_moe_standard_tp.llama import Llama
    cfg = dict(model_type="llama", hidden_size=256, num_hidden_layers=3, num_attention_heads=4,
               num_key_value_heads=2, head_dim=64, intermediate_size=512, vocab_size=1000,
               rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=512, tie_word_embeddings=False)
    cfg.update(overrides)
    return Llama(cfg).lower(context_length=512, kv_dtype="bf16")


def test_splitk_down_fuses_every_mlp_and_marks_the_pending_residuals_readers():
    """KOG_HOPPER_SPLITK_DOWN (schedule.fuse_down_splitk) on bench-2b: each layer's gate/up and
    down_proj become one stage (132 -> 106 stages); the next layer's q/k/v loader adds that
    layer's accumulator (pending input) and its o_proj's residual does (and writes x); the last
    layer's pending sum is read by the LM head's loader; nothing else reads x in between."""
    from kog_nvidia_hopper import schedule as S
    prog = _bench2b_program()
    stages = S.lower(prog, 132, 320, 1)
    assert len(stages) == 132
    assert S.fuse_down_splitk(prog, stages, 320) == 26 and len(stages) == 106
    fused = [i for i, st in enumerate(stages) if st.f.get("_splitk")]
    assert [stages[i].f["_acc"] for i in fused] == list(range(26))
    for k, i in enumerate(fused):
        st = stages[i]
        assert st.label == "gate_proj+up_proj+down" and len(st.segs) == 2
        assert st.segs[1]["_splitk"] and st.segs[1]["_k"] == 8192 and st.segs[1]["SEG_N"] == 2048
        assert st.f["MV_ACC_D"] == 2048 and S.stage_weight_bytes(st) == 3 * 2048 * 8192 * 2
        readers = [(j, stages[j].label) for j in range(len(stages))
                   if stages[j].f.get("_pend_in") == k or stages[j].f.get("_pend_res") == k]
        if k < 25:
            assert readers == [(i + 1, "q_proj+k_proj+v_proj"), (i + 3, "o_proj")]
            assert stages[i + 1].f["_pend_in"] == k and stages[i + 3].f["_pend_res"] == k
        else:
            assert readers == [(i + 1, "lm_head")] and stages[i + 1].f["MV_IN_MODE"] == S.CONSTS["IN_NORM"]
    # every program op is still covered once
    covered = sorted(j for st in stages for j in st.ops)
    assert covered == sorted(set(covered))


def test_splitk_down_refuses_where_the_pending_residual_has_another_reader():
    """A layer whose x is read by an elementwise op before o_proj writes it keeps its two stages
    (the other layers still fuse); a model with lanes (Laneformer) fuses nothing."""
    from kog_core.program import Op
    from kog_nvidia_hopper import schedule as S
    prog = _small_llama_program()
    downs = [j for j, op in enumerate(prog.ops) if op.kind == "matvec" and "down_proj" in op.inputs[1]]
    prog.add_tensor("x_copy", (1, 256), "f32", "buffer")
    prog.ops.insert(downs[1] + 1, Op("copy", ["x"], ["x_copy"], 1, {}))
    stages = S.lower(prog, 7, 128, 1)
    n = len(stages)
    assert S.fuse_down_splitk(prog, stages, 128) == 2 and len(stages) == n - 2
    labels = [st.label for st in stages]
    assert labels.count("gate_proj+up_proj+down") == 2 and "down_proj" in labels
    lf = _laneformer2b_program()
    stages = S.lower(lf, 132, 320, 1)
    assert S.fuse_down_splitk(lf, stages, 320) == 0
    # a hidden size past the pending loader's reach (8 values a consumer thread)
    big = _small_llama_program(hidden_size=4096, num_attention_heads=64, num_key_value_heads=8)
    stages = S.lower(big, 7, 320, 1)
    assert S.fuse_down_splitk(big, stages, 320) == 0


def test_splitk_down_plan_and_packed_weights_compute_the_mlp():
    """Emulates a split-K stage from its plan and packed weights as the kernel walks them (each
    block: gate/up items -> SwiGLU values of its rows, then its down items -> a partial of every
    output, summed in 2^-32 fixed point) and compares W_d (silu(W_g x) * W_u x) in float64. Every
    block's down rows are its gate/up rows, its down items come last, and binfo's word says how
    many and from which row."""
    import ml_dtypes
    from kog_nvidia_hopper import schedule as S
    prog = _small_llama_program()
    nb, nw, slot = 7, 4, 4096
    stages = S.lower(prog, nb, 32 * nw, 1)
    assert S.fuse_down_splitk(prog, stages, 32 * nw) == 3
    st = next(st for st in stages if st.f.get("_splitk"))
    D, F = 256, 512
    rng = np.random.default_rng(1)
    names = {"gate": st.segs[0]["SEG_W"][1:], "up": st.segs[0]["SEG_W2"][1:], "down": st.segs[1]["SEG_W"][1:]}
    shapes = {"gate": (F, D), "up": (F, D), "down": (D, F)}
    bits = {names[k]: rng.standard_normal(shapes[k]).astype(ml_dtypes.bfloat16).view(np.uint16) for k in names}
    W = {k: bits[names[k]].view(ml_dtypes.bfloat16).astype(np.float64) for k in names}
    plan, _ = S.stream_plan(st, nb, nw, slot, None, 32)
    packed = S.pack_stage_weights(plan, nb, st.segs, lambda n: bits[n]).view(ml_dtypes.bfloat16).astype(np.float64)
    its = S.plan_items(plan, nb)
    offs = plan[:nb + 1]
    info = S.splitk_block_info(its, offs, st.segs, nb)
    x = rng.standard_normal(D)
    acc = np.zeros(D, np.int64)
    seen = np.zeros(F, int)
    for b in range(nb):
        mine = its[offs[b]:offs[b + 1]]
        ndown, rbase = int(info[b]) & 0xff, int(info[b]) >> 8
        assert ndown and (mine[-ndown:, 0] == 1).all() and (mine[:-ndown, 0] == 0).all()
        g, u, h = {}, {}, {}
        part = np.zeros(D)
        for si, lane, off16, r0, rows, k0, klen, flags, _ in mine:
            at = off16 * 8
            if si == 0:
                wg = packed[at:at + rows * klen].reshape(rows, klen)
                wu = packed[at + rows * klen:at + 2 * rows * klen].reshape(rows, klen)
                for i in range(rows):
                    g[r0 + i] = g.get(r0 + i, 0.0) + wg[i] @ x[k0:k0 + klen]
                    u[r0 + i] = u.get(r0 + i, 0.0) + wu[i] @ x[k0:k0 + klen]
                    if flags & 2:
                        h[r0 + i] = g[r0 + i] / (1 + np.exp(-g[r0 + i])) * u[r0 + i]
            else:
                assert k0 == 0 and klen == D and rows * klen * 2 <= slot
                wt = packed[at:at + rows * klen].reshape(rows, D)
                for i in range(rows):
                    part += h[r0 + i] * wt[i]
                    seen[r0 + i] += 1
        assert min(h) == rbase and sorted(h) == list(range(rbase, rbase + len(h)))
        acc += np.rint(part * 2.0 ** S.FIX_BITS).astype(np.int64)
    assert (seen == 1).all()
    gv, uv = W["gate"] @ x, W["up"] @ x
    want = W["down"] @ (gv / (1 + np.exp(-gv)) * uv)
    got = acc / 2.0 ** S.FIX_BITS
    assert np.abs(got - want).max() <= 1e-6 * np.abs(want).max()


def test_splitk_down_build_compiles_clean_and_only_where_asked():
    """The SPLITK_DOWN build compiles for sm_90a without spills (a warp's atomics over consecutive
    outputs, through shared memory); its code exists only in it."""
    consts = dict(_bench2b_shape_consts())
    cubin, log, rep = _compile_clean(**DEFAULT, **consts, SPLITK_DOWN=1)
    default, _, _ = _compile(**DEFAULT, **consts)
    assert _code_bytes(default) < _code_bytes(cubin)


def test_splitk_pairs_build_compiles_clean_and_needs_its_buffer():
    """SPLITK_PAIRS (clusters of 2 halving the split-K atomics) compiles without spills, its cluster
    code exists only in it, and a build that asks for it without SPLITK_DOWN or without the receive
    buffer's offset is refused at compile time."""
    consts = dict(_bench2b_shape_consts())
    cubin, log, rep = _compile_clean(**DEFAULT, **consts, SPLITK_DOWN=1, SPLITK_PAIRS=1, PAIR_RBUF_OFF=16384)
    unpaired, _, _ = _compile(**DEFAULT, **consts, SPLITK_DOWN=1)
    assert _code_bytes(unpaired) < _code_bytes(cubin)
    for bad in (dict(SPLITK_PAIRS=1, PAIR_RBUF_OFF=16384), dict(SPLITK_DOWN=1, SPLITK_PAIRS=1)):
        with pytest.raises(Exception, match="SPLITK_PAIRS"):
            _compile(**DEFAULT, **consts, **bad)


def test_splitk_bulk_and_what_if_builds_compile_clean():
    """SPLITK_BULK (one bulk reduction a block) and the DEBUG_SPLITK what-if builds compile without
    spills; SPLITK_BULK without its staging offset, or with pairs, is refused at compile time."""
    consts = dict(_bench2b_shape_consts())
    bulk, _, _ = _compile_clean(**DEFAULT, **consts, SPLITK_DOWN=1, SPLITK_BULK=1, SPLITK_STAGE_OFF=14336)
    unpaired, _, _ = _compile(**DEFAULT, **consts, SPLITK_DOWN=1)
    assert _code_bytes(bulk) != _code_bytes(unpaired)
    for n in (1, 2, 4, 7):
        _compile_clean(**DEFAULT, **consts, SPLITK_DOWN=1, DEBUG_SPLITK=n)
    for bad in (dict(SPLITK_DOWN=1, SPLITK_BULK=1),
                dict(SPLITK_DOWN=1, SPLITK_BULK=1, SPLITK_STAGE_OFF=14336, SPLITK_PAIRS=1, PAIR_RBUF_OFF=16384)):
        with pytest.raises(Exception, match="SPLITK_BULK"):
            _compile(**DEFAULT, **consts, **bad)


def test_splitk_carry_plan_on_bench_2b():
    """fuse_down_splitk(carry=True) on bench-2b: every layer's o_proj (x's last writer before the
    split-K stage, one in-place residual segment of D rows) stores the next accumulator's start,
    every reader of a pending x takes the accumulator alone (q/k/v's loader from layer 1 on,
    o_proj's residual, the LM head's loader), the flags say so after finalize, and the carry build
    compiles clean. Without carry nothing is marked."""
    from kog_nvidia_hopper import schedule as S
    prog = _bench2b_program()
    plain = _bench2b_stages_as_loaded()
    S.fuse_down_splitk(prog, plain, 32 * S.NW_DEFAULT)
    assert not any(k in st.f for st in plain for k in ("_carry_out", "_carry", "_carry_in"))
    stages = _bench2b_stages_as_loaded()
    assert S.fuse_down_splitk(prog, stages, 32 * S.NW_DEFAULT, carry=True) == prog.n_layers
    writers = [i for i, st in enumerate(stages) if st.f.get("_carry_out") is not None]
    splitk = [i for i, st in enumerate(stages) if st.f.get("_splitk")]
    assert len(writers) == len(splitk) == prog.n_layers
    for k, (w, i) in enumerate(zip(writers, splitk)):
        assert stages[w].label == "o_proj" and w == i - 1
        assert stages[w].f["_carry_out"] == stages[i].f["_acc"] == k and stages[i].f["_carry_in"]
    readers = [st for st in stages if st.f.get("_carry")]
    assert len(readers) == 2 * (prog.n_layers - 1) + 1
    assert all(("_pend_in" in st.f) != ("_pend_res" in st.f) for st in readers)
    assert stages[-2].label == "lm_head" and stages[-2].f.get("_carry") and stages[-2].f["_pend_in"] == prog.n_layers - 1
    for st in stages:
        if st.type == "matvec":
            S.finalize_matvec(st, 132, prog.logits, lambda tiles: 0, logits_numel=prog.tensors[prog.logits].numel)
            carried = bool(st.f.get("_carry") or st.f.get("_carry_in"))
            assert bool(st.f["MV_FLAGS"] & S.CONSTS["MVF_CARRY"]) == carried
    consts = dict(_bench2b_shape_consts())
    carry, _, _ = _compile_clean(**DEFAULT, **consts, SPLITK_DOWN=1, SPLITK_CARRY=1)
    unfused, _, _ = _compile(**DEFAULT, **consts, SPLITK_DOWN=1)
    assert _code_bytes(carry) != _code_bytes(unfused)
    with pytest.raises(Exception, match="SPLITK_CARRY"):
        _compile(**DEFAULT, **consts, SPLITK_CARRY=1)


def test_splitk_perm_layout_makes_the_loaders_reads_contiguous():
    """SPLITK_PERM's accumulator order (schedule.acc_ix, mirroring matvec.cuh): a bijection on every
    padded block of 128 values; a loader warp's two 16-byte loads a thread (the int64 pairs
    (4q, 4q + 1) and (4q + 2, 4q + 3) of lane q's float4) each read 512 contiguous bytes; a warp's
    32 consecutive atomics land in two runs of 16 int64s (128 bytes). The builds compile clean,
    with carry and pairs too; with the bulk reduction they are refused."""
    from kog_nvidia_hopper import schedule as S
    for D in (192, 2048, 2560):
        Dp = S.acc_len(D, True)
        assert Dp % 128 == 0 and Dp - D < 128 and S.acc_len(D) == D
        ix = S.acc_ix(np.arange(Dp))
        assert sorted(ix.tolist()) == list(range(Dp))
        assert (ix // 128 == np.arange(Dp) // 128).all()
    i = np.arange(2048)
    for u in (0, 1):  # a warp's load instruction u over float4s q = 32 w .. 32 w + 31
        for w in range(2048 // 128):
            q = 32 * w + np.arange(32)
            first = S.acc_ix(4 * q + 2 * u)
            assert (S.acc_ix(4 * q + 2 * u + 1) == first + 1).all()
            assert (np.diff(first) == 2).all() and first[0] % 64 == 0  # 32 x 16 bytes, contiguous
    for w in range(2048 // 32):  # a warp's atomics: 32 consecutive outputs
        pos = np.sort(S.acc_ix(i[32 * w:32 * w + 32]))
        runs = np.split(pos, np.where(np.diff(pos) != 1)[0] + 1)
        assert len(runs) == 2 and all(len(r) == 16 and r[0] % 16 == 0 for r in runs)
    # the kernel's index is this one (schedule.acc_ix mirrors it)
    from pathlib import Path
    cuh = (Path(S.__file__).parent / "kernels" / "matvec.cuh").read_text()
    assert "return (i & ~127) | ((i & 2) << 5) | ((i >> 1) & 62) | (i & 1);" in cuh
    consts = dict(_bench2b_shape_consts())
    for extra in (dict(), dict(SPLITK_CARRY=1), dict(SPLITK_PAIRS=1, PAIR_RBUF_OFF=16384)):
        _compile_clean(**DEFAULT, **consts, SPLITK_DOWN=1, SPLITK_PERM=1, **extra)
    with pytest.raises(Exception, match="SPLITK_PERM"):
        _compile(**DEFAULT, **consts, SPLITK_DOWN=1, SPLITK_PERM=1, SPLITK_BULK=1, SPLITK_STAGE_OFF=14336)


@pytest.mark.parametrize("perm,carry", [(False, False), (True, False), (True, True)])
def test_diagnose_reads_the_pending_sum_in_output_order(perm, carry):
    """diagnose._splitk_pending reads the last split-K accumulator of the last position's parity back
    in output order (SPLITK_PERM: padded, permuted) and says whether it carries x (SPLITK_CARRY)."""
    import ctypes
    from types import SimpleNamespace
    from kog_nvidia_hopper import schedule as S
    from kog_nvidia_hopper.diagnose import _splitk_pending
    stages = _bench2b_stages_as_loaded()
    S.fuse_down_splitk(_bench2b_program(), stages, 32 * S.NW_DEFAULT, carry=carry)
    D, n = 2048, 3
    Dp = S.acc_len(D, perm)
    want = np.arange(D) * 2.0 ** -20 - 1.0  # exact in fixed point and in float32
    dev = np.zeros(2 * Dp, np.int64)
    dev[((n - 1) & 1) * Dp + S.acc_ix(np.arange(D), perm)] = np.rint(want * 2.0 ** 32).astype(np.int64)
    last = max((st for st in stages if st.f.get("_splitk")), key=lambda st: st.f["_acc"])
    last.f["MV_ACC"] = 0

    def memcpy(dst, src, nbytes):
        ctypes.memmove(dst, dev.ctypes.data + src, nbytes)
        return (0,)
    hb = SimpleNamespace(stages=stages, splitk_perm=perm, drv=SimpleNamespace(cuMemcpyDtoH=memcpy))
    pending, in_smem = _splitk_pending(hb, n)
    (name, (carried, got)), = pending.items()
    assert carried == carry and np.array_equal(got, want.astype(np.float32)) and in_smem


def test_splitk_pairs_receive_buffer_lies_past_the_stage_own_scratch():
    """With pairs the split-K stage reserves the partner's partials (the larger half of D, as
    floats) at the end of the stage scratch, past its x row, norm weights and SwiGLU values, where
    PAIR_RBUF_OFF puts them; on bench-2b the scratch (and so the ring) does not grow."""
    from types import SimpleNamespace
    from kog_nvidia_hopper import schedule as S
    from kog_nvidia_hopper.backend import HopperBackend
    got = {}
    for pairs in (False, True):
        stages = _bench2b_stages_as_loaded()
        S.fuse_down_splitk(_bench2b_program(), stages, 32 * S.NW_DEFAULT)
        hb = SimpleNamespace(nb=132, nw=S.NW_DEFAULT, max_smem=227 * 1024, norm_smem=1, kalign=32, pairs=pairs)
        slot, _, scratch = HopperBackend._ring_slots(hb, stages, None)
        sk = [st for st in stages if st.f.get("_splitk")]
        assert sk
        got[pairs] = (slot, scratch, sk[0].smem)
    rbuf = S.pair_rbuf_bytes(sk[0])
    assert rbuf == 2048 // 2 * 4
    (slot0, scratch0, own), (slot1, scratch1, with_rbuf) = got[False], got[True]
    assert (slot1, scratch1) == (slot0, scratch0) and with_rbuf == own + rbuf + 16
    assert own <= (scratch1 - rbuf) // 16 * 16 and (scratch1 - rbuf) // 16 * 16 + rbuf <= scratch1
    # SPLITK_BULK: the fixed-point partials (D int64) at a 128-byte boundary, also past the stage's own
    stages = _bench2b_stages_as_loaded()
    S.fuse_down_splitk(_bench2b_program(), stages, 32 * S.NW_DEFAULT)
    hb = SimpleNamespace(nb=132, nw=S.NW_DEFAULT, max_smem=227 * 1024, norm_smem=1, kalign=32, pairs=False,
                         splitk_bulk=True)
    slot2, _, scratch2 = HopperBackend._ring_slots(hb, stages, None)
    stg = S.splitk_stage_bytes(sk[0])
    assert stg == 2048 * 8 and (slot2, scratch2) == (slot0, scratch0)
    assert own <= (scratch2 - stg) // 128 * 128


def test_tag_qkv_marks_each_layers_qkv_stage_and_attention_with_alternating_writes():
    """schedule.tag_attention_inputs (KOG_HOPPER_TAG_QKV): on bench-2b every q/k/v stage writes q, k
    and v with MVF_TAG_OUT and its attention stage gets AT_TAG = the same write index k | n << 16
    (n = 26 layers: the fused RoPE ops' in-place writes do not count); nothing else is tagged. The
    build without it (KOG_HOPPER_TAG_QKV=0) compiles without spills."""
    from kog_nvidia_hopper import schedule as S
    prog = _bench2b_program()
    stages = _bench2b_stages_as_loaded()
    assert sorted(S.tag_attention_inputs(prog, stages)) == ["k", "q", "v"]
    att = [i for i, st in enumerate(stages) if st.type == "attn"]
    assert len(att) == 26
    for k, i in enumerate(att):
        pv = stages[i - 1]
        assert pv.f["MV_FLAGS"] & S.CONSTS["MVF_TAG_OUT"] and pv.f["MV_TAG"] == stages[i].f["AT_TAG"] == k | 26 << 16
    tagged = {i - 1 for i in att}
    assert not any(st.f.get("MV_FLAGS", 0) & S.CONSTS["MVF_TAG_OUT"] for i, st in enumerate(stages)
                   if st.type == "matvec" and i not in tagged)
    from kog_nvidia_hopper.sass_report import DEFAULT_BUILD  # bench-2b's default build (TAG_QKV on, v31)
    _compile_clean(**dict(DEFAULT_BUILD, TAG_QKV=0))  # KOG_HOPPER_TAG_QKV=0


def test_every_write_a_launch_needs_goes_in_the_kernels_stream_before_it():
    """HopperBackend._launch with a recording driver: the prompt, stop ids, run parameters and every
    memset (counters, split-K accumulators, pool counters, tagged buffers' stale marks) are issued as
    ...Async calls in the kernel's own stream, before the launch. The stream is non-blocking, so a
    legacy-stream cuMemsetD32 / cuMemcpyHtoD would not be ordered before the kernel (session 26)."""
    import numpy as np
    from kog_core.interfaces import SamplingParams
    from kog_nvidia_hopper.backend import HopperBackend

    calls = []

    class Driver:
        def __getattr__(self, name):
            def call(*args):
                calls.append((name, args))
                return (0,)
            return call

    hb = HopperBackend.__new__(HopperBackend)
    stream = object()
    hb.drv, hb.stream, hb.fn, hb.pairs = Driver(), stream, object(), False
    hb.nb, hb.nthreads, hb.smem, hb.nst, hb.T = 132, 384, 200_000, 7, 64
    for name in ("d_prompt", "d_stops", "d_out", "d_cnt", "d_cancel", "d_scratch", "d_stream", "d_binfo",
                 "d_desc", "d_counters", "d_run", "d_acc", "d_pool"):
        setattr(hb, name, 4096)
    hb.d_trace = hb.d_sample_sync = 0
    hb.acc_bytes, hb.pool_words = 1024, 128
    hb.ptr, hb.tagged, hb.tagged_parts = {"q": 8192}, {"q": 16}, [(12288, 32)]
    hb.cnt_view, hb.cancel_view = np.zeros(4, np.int32), np.zeros(4, np.int32)
    hb._launch([1, 2, 3], 0, 8, SamplingParams(), stop_ids=(2,))
    names = [n for n, _ in calls]
    assert names[-1] == "cuLaunchCooperativeKernel" and calls[-1][1][-2] is stream
    writes = [(n, a) for n, a in calls[:-1] if n.startswith(("cuMemset", "cuMemcpy"))]
    assert {n for n, _ in writes} == {"cuMemcpyHtoDAsync", "cuMemsetD32Async"}
    assert all(a[-1] is stream for _, a in writes)
    assert sum(n == "cuMemsetD32Async" for n, _ in writes) == 5  # counters, accumulators, pool, tagged, parts


def _unlaunched_backend_and_model(name):
    """A HopperBackend (plan.PlanningBackend, 132 blocks) whose driver calls all succeed with a fake pointer, so `load`'s
    checks run without a GPU, and the small test model `name` (tests/gpu/hopper_models)."""
    from gpu.hopper_models import laneformer_model, model
    from kog_nvidia_hopper.plan import PlanningBackend  # the stand-in device plan.py uses

    arch, prog, w = (laneformer_model if name.startswith("laneformer") else model)(name)
    return PlanningBackend(132), prog, w


@pytest.mark.parametrize("name,extra,value", [("llama", {}, "1"), ("laneformer-lane", {"KOG_HOPPER_TAG_X_LANES": "0"}, "1"),
                                              ("llama", {}, "01")])
def test_tag_x_ew_without_the_lanes_tags_is_a_one_line_error(name, extra, value, monkeypatch):
    """KOG_HOPPER_TAG_X_EW=1 (any spelling the knob reads as 1) where TAG_X_LANES does not apply (a
    Llama-family model) or is turned off: HopperBackend.load, with a driver that only records,
    stops with one line naming the setting to unset before it builds a kernel."""
    monkeypatch.setenv("KOG_HOPPER_TAG_X_EW", value)
    for key, value in extra.items():
        monkeypatch.setenv(key, value)
    hb, prog, w = _unlaunched_backend_and_model(name)
    with pytest.raises(KogError) as e:
        hb.load(prog, w)
    assert "unset KOG_HOPPER_TAG_X_EW" in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("name,env,expected", [
    ("laneformer-lane", {}, True),  # the default since v34: with the lanes' tags
    ("laneformer-lane", {"KOG_HOPPER_TAG_X_EW": "0"}, False),  # v33's build
    ("laneformer-lane", {"KOG_HOPPER_TAG_X_LANES": "0"}, False),  # no lanes' tags: quietly off, no error
    ("llama", {}, False),  # a Llama-family model: quietly off, no error
])
def test_tag_x_ew_default_follows_the_lanes_tags(name, env, expected, monkeypatch):
    """With KOG_HOPPER_TAG_X_EW unset, HopperBackend.load tags the elementwise residual writes
    exactly where TAG_X_LANES is on, and refuses nothing elsewhere (only an explicit =1 is an
    error there, above); =0 gives v33's build. The load stops at the ring's sizing, after the
    setting is resolved."""
    from kog_nvidia_hopper.backend import HopperBackend

    class Resolved(Exception):
        pass

    def stop(*args, **kwargs):
        raise Resolved

    for key in ("KOG_HOPPER_TAG_X_EW", "KOG_HOPPER_TAG_X_LANES"):
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setattr(HopperBackend, "_ring_slots", stop)
    hb, prog, w = _unlaunched_backend_and_model(name)
    with pytest.raises(Resolved):
        hb.load(prog, w)
    assert hb.tag_x_ew is expected  # (read off the stages: some elementwise stage writes tagged x)


def _backend_whose_kernel_never_finishes(monkeypatch, tokens_out=0):
    """A HopperBackend with a driver whose stream never completes, the kernel having
    written `tokens_out` tokens, and a clock that moves 7 s at each look."""
    import numpy as np
    import kog_nvidia_hopper.backend as B
    from kog_nvidia_hopper.backend import HopperBackend

    class Result:
        CUDA_SUCCESS, CUDA_ERROR_NOT_READY = 0, 600

    class Driver:
        CUresult = Result
        queries = 0
        def cuEventCreate(self, flags): return (0, object())
        def cuEventRecord(self, event, stream): return (0,)
        def cuStreamQuery(self, stream):
            self.queries += 1
            return (Result.CUDA_ERROR_NOT_READY,)
        def cuStreamSynchronize(self, stream):
            raise AssertionError("synchronizing with a kernel that never finishes hangs")
        def cuMemFree(self, p):
            raise AssertionError("freeing a stuck kernel's memory waits on it")

    clock = iter(range(0, 100_000, 7))
    monkeypatch.setattr(B.time, "monotonic", lambda: float(next(clock)))
    monkeypatch.setattr(B.time, "sleep", lambda s: None)
    hb = HopperBackend.__new__(HopperBackend)
    hb.drv, hb.stream, hb.T, hb.allocs = Driver(), object(), 64, [4096]
    hb.cancel_view, hb.cnt_view = np.zeros(4, np.int32), np.array([tokens_out, 0, 0, 0], np.int32)
    hb.out_view = np.arange(64, dtype=np.int32)
    hb._launch = lambda *args, **kwargs: None
    return hb


def test_a_timed_launch_that_never_finishes_is_a_one_line_error(monkeypatch):
    """HopperBackend._time_request (the breakdown's and trace's launches) with a kernel that never
    finishes: a KogError naming the skip mask once the deadline passes and the kernel asked to
    cancel, instead of waiting forever (session 29: a breakdown mask left a tag poll spinning);
    close() then leaves its memory to the process's exit."""
    hb = _backend_whose_kernel_never_finishes(monkeypatch)
    with pytest.raises(KogError, match=r"no progress for \d+ s \(a timed request of 8 tokens, skip mask 0x2\)"):
        hb._time_request([1, 2, 3], 8, skip=2)
    assert hb.cancel_view[0] == 1 and hb.drv.queries > 1
    hb.close()


def test_a_request_whose_kernel_stops_making_progress_is_a_one_line_error(monkeypatch):
    """generate() streams the tokens the kernel wrote, then, with no new one for a minute while the
    kernel still runs, raises a KogError instead of polling forever, without synchronizing with the
    stuck kernel; the next request is refused in one line (it would queue behind it)."""
    from kog_core.interfaces import SamplingParams, StopCriteria
    from kog_nvidia_hopper.backend import HopperBackend
    hb = _backend_whose_kernel_never_finishes(monkeypatch, tokens_out=3)
    got = []
    with pytest.raises(KogError, match=r"no progress for 60 s \(3 of at most 16 tokens out\)"):
        for t in hb.generate([1, 2], None, SamplingParams(), StopCriteria(max_tokens=16)):
            got.append(t)
    assert got == [0, 1, 2] and hb.cancel_view[0] == 1
    del hb._launch  # the real _launch: refused before it touches the driver
    with pytest.raises(KogError, match="restart the process"):
        HopperBackend._launch(hb, [1], 0, 4, SamplingParams())


def test_logits_whose_kernel_never_finishes_are_a_one_line_error(monkeypatch):
    """logits() (a launch that writes every position's logits, then a copy back) with a kernel that
    never finishes: a KogError once 60 s + 50 ms a position have passed, without synchronizing with
    it or freeing the buffer it writes."""
    hb = _backend_whose_kernel_never_finishes(monkeypatch)
    hb.drv.cuMemAlloc = lambda nbytes: (0, 8192)
    hb.program = type("Program", (), {"vocab_size": 32})()
    with pytest.raises(KogError, match=r"no progress for 60 s \(logits of 4 positions\)"):
        hb.logits([1, 2, 3, 4])
    assert 8192 in hb.allocs


def test_tag_oproj_marks_each_attention_output_and_its_o_proj():
    """schedule.tag_attention_outputs (KOG_HOPPER_TAG_OPROJ): on bench-2b each attention stage gets
    AT_OTAG = write k | 26 << 16 and the o_proj after it MVF_TAG_IN with the same MV_TAG (its loader
    polls the parity; decode.cu then waits on the stage before the attention); with the loader
    combine (the attention does not write the output) nothing is tagged. Builds without it, alone
    and with TAG_QKV off too, compile without spills."""
    from kog_nvidia_hopper import schedule as S
    from kog_nvidia_hopper.sass_report import DEFAULT_BUILD
    prog = _bench2b_program()
    stages = _bench2b_stages_as_loaded()
    assert S.tag_attention_outputs(prog, stages) == ["att"]
    att = [i for i, st in enumerate(stages) if st.type == "attn"]
    for k, i in enumerate(att):
        nx = stages[i + 1]
        assert nx.f["MV_FLAGS"] & S.CONSTS["MVF_TAG_IN"] and nx.f["MV_TAG"] == stages[i].f["AT_OTAG"] == k | 26 << 16
    assert sum(bool(st.f.get("MV_FLAGS", 0) & S.CONSTS["MVF_TAG_IN"]) for st in stages) == 26
    loader = _bench2b_stages_as_loaded()
    S.fuse_attention_combine(prog, loader)
    assert S.tag_attention_outputs(prog, loader) == []
    _compile_clean(**dict(DEFAULT_BUILD, TAG_OPROJ=0))  # the default has both (v31)
    _compile_clean(**dict(DEFAULT_BUILD, TAG_OPROJ=0, TAG_QKV=0))


def _nvdisasm_or_skip():
    from kog_nvidia_hopper.sass_report import nvdisasm
    try:
        return nvdisasm()
    except KogError as e:
        pytest.skip(f"nvdisasm is not installed (the test extra's nvidia-cuda-nvdisasm): {e}")


def test_every_poll_of_the_default_build_is_a_loop_in_its_machine_code():
    """The default build's readiness-in-the-data polls (TAG_QKV: the attention's q, k and v;
    TAG_OPROJ: o_proj's input row) each compile to a load with a branch back to it. v30's loads
    (ld.cg, no memory clobber) let the compiler fold `do v = load(p); while (!ready(v));` into
    one load, and the reader went on with a stale value (session 27): that source, put back in
    place of ld_poll / ld_poll4, must fail the same check."""
    pytest.importorskip("cuda.bindings.nvrtc", reason="cuda-python (NVRTC) is not installed")
    _nvdisasm_or_skip()
    from kog_nvidia_hopper import schedule as S
    from kog_nvidia_hopper.cuda_util import source
    from kog_nvidia_hopper.sass_report import DEFAULT_BUILD, disassemble_source, poll_loops
    src = source(S.header(DEFAULT_BUILD))
    polls = poll_loops(src, disassemble_source(src)[2])
    assert len(polls) == 4 and all(looped for _, looped in polls), polls  # q, k, v; o_proj's and the MLP's float4s (one loop)
    v30 = {  # the same lines (so the same source lines mark the loads) with v30's loads
        '"ld.relaxed.gpu.global.f32 %0, [%1];" : "=f"(r) : "l"(p) : "memory");':
        '"ld.global.cg.f32 %0, [%1];" : "=f"(r) : "l"(p));  // ld.relaxed.gpu.global.f32 (v30)',
        '"ld.relaxed.gpu.global.v4.f32 {%0,%1,%2,%3}, [%4];" : "=f"(r.x), "=f"(r.y), "=f"(r.z), "=f"(r.w) : "l"(p) : "memory");':
        '"ld.global.cg.v4.f32 {%0,%1,%2,%3}, [%4];" : "=f"(r.x), "=f"(r.y), "=f"(r.z), "=f"(r.w) : "l"(p));  // ld.relaxed.gpu.global.v4.f32 (v30)'}
    old = src
    for new_text, old_text in v30.items():
        assert new_text in old
        old = old.replace(new_text, old_text)
    folded = poll_loops(old, disassemble_source(old)[2])
    assert not all(looped for _, looped in folded) or len(folded) < 4, folded


def _tag_x_stages(splitk: bool = True, carry: bool = False):
    """bench-2b's stages tagged as the backend does with KOG_HOPPER_TAG_X=1 (after TAG_QKV / TAG_OPROJ)."""
    from kog_nvidia_hopper import schedule as S
    prog = _bench2b_program()
    stages = S.lower(prog, 132, 32 * S.NW_DEFAULT, 1)
    if splitk:
        S.fuse_down_splitk(prog, stages, 32 * S.NW_DEFAULT, carry=carry)
    for st in stages:
        if st.type == "matvec":
            S.finalize_matvec(st, 132, prog.logits, lambda tiles: 0, logits_numel=prog.tensors[prog.logits].numel)
    S.tag_attention_inputs(prog, stages)
    S.tag_attention_outputs(prog, stages)
    return prog, stages, S.tag_residual_outputs(prog, stages)


def _write_complete_when_counted(stages, prev: int, waited: int) -> bool:
    """Whether every block has finished stage `prev` once all blocks have finished stage `waited`
    (decode.cu): some stage j in (prev, waited] waits on a count at or after prev, and a block runs
    its stages in order (schedule.stage_waits_on gives each stage's wait)."""
    from kog_nvidia_hopper import schedule as S
    return any((w := S.stage_waits_on(stages, j)) is not None and w >= prev for j in range(prev + 1, waited + 1))


def test_tag_x_tags_every_o_proj_and_the_mlp_stages_whose_previous_x_is_tagged():
    """schedule.tag_residual_outputs (KOG_HOPPER_TAG_X): on bench-2b (split-K MLP) every o_proj writes
    x with MVF_TAG_OUT and MV_OTAG = write k | 27 << 16 (the embedding is write 0; the fused
    down_projs leave x pending and do not count), its input's MV_TAG (TAG_OPROJ) untouched; the
    split-K stage after it polls (MVF_TAG_IN, MV_TAG = that write) in layers 1-25, not in layer 0,
    whose previous x is the untagged embedding. For every tagged reader the stage it then waits on
    implies x's previous write is complete. With the MLP unfused the readers move to where that
    holds; with SPLITK_CARRY (o_proj also starts the accumulator the MLP stage adds into) none."""
    from kog_nvidia_hopper import schedule as S
    prog, stages, out = _tag_x_stages()
    assert out == ["x"]
    oproj = [i for i, st in enumerate(stages) if st.type == "matvec" and st.f["MV_IN"] == "@att"]
    assert len(oproj) == 26
    for k, i in enumerate(oproj, start=1):
        w, r = stages[i], stages[i + 1]
        assert w.f["MV_FLAGS"] & S.CONSTS["MVF_TAG_OUT"] and w.f["MV_OTAG"] == k | 27 << 16
        assert w.f["MV_TAG"] == stages[i - 1].f["AT_OTAG"]  # TAG_OPROJ's input parity stays
        assert r.f.get("_splitk")
        assert bool(r.f["MV_FLAGS"] & S.CONSTS["MVF_TAG_IN"]) == (k > 1)
        if k > 1:
            assert r.f["MV_TAG"] == w.f["MV_OTAG"] and S.stage_waits_on(stages, i + 1) == i - 1
            assert _write_complete_when_counted(stages, oproj[k - 2], i - 1)
    for splitk, carry in ((False, False), (True, True)):
        prog, stages, out = _tag_x_stages(splitk, carry)
        readers = [i for i, st in enumerate(stages) if st.type == "matvec"
                   and st.f["MV_FLAGS"] & S.CONSTS["MVF_TAG_IN"] and st.f["MV_IN_MODE"] == S.CONSTS["IN_NORM"]]
        if carry:
            assert readers == []
            continue
        # the q/k/v stages of layers 1-25 and the LM head (gate/up's wait would not cover down_proj's write)
        assert len(readers) == 26 and stages[readers[-1]].f["MV_FLAGS"] & S.CONSTS["MVF_LOGITS"]
        writers = [i for i, st in enumerate(stages) if st.f.get("MV_FLAGS", 0) & S.CONSTS["MVF_TAG_OUT"]
                   and st.f.get("MV_OTAG", 0) >> 16 == 53]
        assert len(writers) == 52  # o_proj and down_proj, every layer
        for r in readers:
            prev = max(w for w in writers if w < r - 1)
            assert stages[r].f["MV_TAG"] == stages[r - 1].f["MV_OTAG"]
            assert _write_complete_when_counted(stages, prev, r - 2)


def test_tag_x_off_compiles_clean_and_its_polls_are_loops():
    """The build with TAG_X off (KOG_HOPPER_TAG_X=0: v31's kernel, byte for byte in session 31) has
    no spills and its polls are loads with a branch back to them."""
    pytest.importorskip("cuda.bindings.nvrtc", reason="cuda-python (NVRTC) is not installed")
    from kog_nvidia_hopper.sass_report import DEFAULT_BUILD
    _compile_clean(**dict(DEFAULT_BUILD, TAG_X=0))
    _nvdisasm_or_skip()
    from kog_nvidia_hopper import schedule as S
    from kog_nvidia_hopper.cuda_util import source
    from kog_nvidia_hopper.sass_report import disassemble_source, poll_loops
    src = source(S.header(dict(DEFAULT_BUILD, TAG_X=0)))
    polls = poll_loops(src, disassemble_source(src)[2])
    assert len(polls) == 4 and all(looped for _, looped in polls), polls


def test_splitk_count_marks_the_loader_after_each_split_k_stage():
    """schedule.count_splitk_inputs (KOG_HOPPER_SPLITK_COUNT): on bench-2b the loader that reads each
    split-K stage's accumulator right after it (q/k/v of layers 1-25, the LM head) gets
    MVF_COUNT_IN, so it waits on the stage before the split-K stage (o_proj, x's last writer) and
    nothing else does; with the carry form (o_proj starts the accumulator) no loader. The build
    (with TAG_X too) has no spills, and its count polls are loads with a branch back."""
    from kog_nvidia_hopper import schedule as S
    prog, stages, _ = _tag_x_stages()
    assert S.count_splitk_inputs(stages) == 26
    readers = [i for i, st in enumerate(stages) if st.f.get("MV_FLAGS", 0) & S.CONSTS["MVF_COUNT_IN"]]
    assert len(readers) == 26 and stages[readers[-1]].f["MV_FLAGS"] & S.CONSTS["MVF_LOGITS"]
    for i in readers:
        assert stages[i - 1].f["_acc"] == stages[i].f["_pend_in"]
        assert stages[i - 2].f["MV_IN"] == "@att"  # o_proj: x's last write before the loader
    _, carried, _ = _tag_x_stages(carry=True)
    assert S.count_splitk_inputs(carried) == 0
    pytest.importorskip("cuda.bindings.nvrtc", reason="cuda-python (NVRTC) is not installed")
    from kog_nvidia_hopper.sass_report import DEFAULT_BUILD
    _compile_clean(**dict(DEFAULT_BUILD, SPLITK_COUNT=1))
    for bad in (dict(SPLITK_CARRY=1), dict(SPLITK_BULK=1, SPLITK_STAGE_OFF=14336)):  # refused at compile time
        with pytest.raises(KogError, match="SPLITK_COUNT"):
            _compile(**DEFAULT_BUILD, SPLITK_COUNT=1, **bad)
    _nvdisasm_or_skip()
    from kog_nvidia_hopper.cuda_util import source
    from kog_nvidia_hopper.sass_report import disassemble_source, poll_loops
    src = source(S.header(dict(DEFAULT_BUILD, SPLITK_COUNT=1, TAG_X=1)))
    polls = poll_loops(src, disassemble_source(src)[2])
    assert len(polls) >= 6 and all(looped for _, looped in polls), polls


def test_tag_x_lanes_tags_laneformers_fused_residual_writes_and_their_readers():
    """schedule.tag_residual_outputs(lanes=True) (KOG_HOPPER_TAG_X_LANES): on laneformer-2b each
    delayed layer's two fused DTP residuals (o_proj's and down_proj's tail passes; not the last
    layer's down_proj, read by an elementwise norm) write x with
    MVF_TAG_LRX and MV_OTAG = write k | 31 << 16 (the embedding and the early layers' elementwise
    residuals are the other writes); the normed stage after each polls where x's previous write is
    a tagged one (not after the first fused write, which follows an elementwise residual), and for
    each such reader some stage between the previous write and the stage it waits on either waits
    on a count at or after that write or read that write whole (the previous boundary's reader).
    Without lanes nothing of Laneformer's is tagged. The build (TAG_X with LANE_RESIDUAL) compiles
    with its polls as loops and no spills but the kernel entry's."""
    from kog_nvidia_hopper import schedule as S
    prog, stages = _laneformer2b_stages_tagged_before_x()
    assert S.tag_residual_outputs(prog, stages) == []
    assert S.tag_residual_outputs(prog, stages, lanes=True) == ["x"]
    C = S.CONSTS
    writers = [i for i, st in enumerate(stages) if st.f.get("MV_FLAGS", 0) & C["MVF_TAG_LRX"]]
    readers = [i for i, st in enumerate(stages) if st.type == "matvec" and st.f["MV_IN"] == "@x"
               and st.f["MV_FLAGS"] & C["MVF_TAG_IN"]]
    # 26 fused residuals, less the last layer's down_proj, which the final norm (an elementwise stage) reads
    assert len(writers) == 25 and len(readers) == 24 and readers == [w + 1 for w in writers[1:]]
    assert all(stages[w].f["MV_OTAG"] >> 16 == 31 for w in writers)
    for r in readers:
        prev = max(w for w in writers if w < r - 1)
        assert stages[r].f["MV_TAG"] == stages[r - 1].f["MV_OTAG"] and S.stage_waits_on(stages, r) == r - 2
        # counted, or the previous write's own reader (prev + 1: it waited on prev or polled it whole) lies between
        assert _write_complete_when_counted(stages, prev, r - 2) or prev + 1 <= r - 2
    assert not any(st.f.get("MV_FLAGS", 0) & C["MVF_TAG_OUT"] and st.f.get("MV_OTAG", 0) >> 16 == 31 for st in stages)
    pytest.importorskip("cuda.bindings.nvrtc", reason="cuda-python (NVRTC) is not installed")
    lf = dict(_laneformer2b_build(stages), TAG_QKV=1, TAG_OPROJ=1, TAG_DOWN=1, TAG_X=1)
    _compile_clean_but_entry(**lf)
    _nvdisasm_or_skip()
    from kog_nvidia_hopper.cuda_util import source
    from kog_nvidia_hopper.sass_report import disassemble_source, poll_loops
    src = source(S.header(lf))
    polls = poll_loops(src, disassemble_source(src)[2])
    assert len(polls) == 4 and all(looped for _, looped in polls), polls


def test_tag_x_ew_tags_laneformers_elementwise_residual_writes_and_their_readers():
    """schedule.tag_residual_outputs(lanes=True, ew=True) (KOG_HOPPER_TAG_X_EW): on laneformer-2b the
    four elementwise lane_residual stages of the two all-reduce layers write x with EW_OTAG = write
    k | 31 << 16 (k = 1..4, after the embedding); the normed stage after each polls where x's
    previous write is tagged (not after the first: the embedding's write is untagged), and so does
    the first fused write's reader, whose previous write is now the last elementwise one: 28
    polled readers against TAG_X_LANES's 24, each certified as in the lanes rule. The build
    (TAG_X_EW with TAG_X) compiles without spills but the kernel entry's, its polls are loops, and
    the default Laneformer build's polls_on is unchanged (TAG_X_EW=0 folds the new bit away)."""
    from kog_nvidia_hopper import schedule as S
    prog, stages = _laneformer2b_stages_tagged_before_x()
    assert S.tag_residual_outputs(prog, stages, ew=True) == []  # ew needs lanes
    assert not any(st.f.get("EW_OTAG") for st in stages)
    assert S.tag_residual_outputs(prog, stages, lanes=True, ew=True) == ["x"]
    C = S.CONSTS
    ew_writers = [i for i, st in enumerate(stages) if st.type == "ew" and st.f.get("EW_OTAG")]
    assert len(ew_writers) == 4 and all(stages[i].f["EW_OP"] == "OP_LANE_RESIDUAL" for i in ew_writers)
    assert [stages[i].f["EW_OTAG"] for i in ew_writers] == [k | 31 << 16 for k in (1, 2, 3, 4)]
    tails = [i for i, st in enumerate(stages) if st.f.get("MV_FLAGS", 0) & C["MVF_TAG_LRX"]]
    writers = sorted(ew_writers + tails)
    readers = [i for i, st in enumerate(stages) if st.type == "matvec" and st.f["MV_IN"] == "@x"
               and st.f["MV_FLAGS"] & C["MVF_TAG_IN"]]
    assert len(readers) == 28 and readers == [w + 1 for w in writers[1:]]
    for r in readers:
        prev = max(w for w in writers if w < r - 1)
        w = r - 1
        tag = stages[w].f["EW_OTAG"] if stages[w].type == "ew" else stages[w].f["MV_OTAG"]
        assert stages[r].f["MV_TAG"] == tag and S.stage_waits_on(stages, r) == r - 2
        assert _write_complete_when_counted(stages, prev, r - 2) or prev + 1 <= r - 2
    pytest.importorskip("cuda.bindings.nvrtc", reason="cuda-python (NVRTC) is not installed")
    lf = dict(_laneformer2b_build(stages), TAG_QKV=1, TAG_OPROJ=1, TAG_DOWN=1, TAG_X=1)
    _compile_clean_but_entry(**lf, TAG_X_EW=1)
    _nvdisasm_or_skip()
    from kog_nvidia_hopper.cuda_util import source
    from kog_nvidia_hopper.sass_report import disassemble_source, poll_loops
    src = source(S.header(dict(lf, TAG_X_EW=1)))
    polls = poll_loops(src, disassemble_source(src)[2])
    assert len(polls) == 4 and all(looped for _, looped in polls), polls


def _no_hopper_settings(monkeypatch):
    import os
    for key in [k for k in os.environ if k.startswith("KOG_HOPPER_")]:
        monkeypatch.delenv(key)


def test_plan_builds_what_load_would_on_a_machine_without_a_gpu(monkeypatch):
    """kog_nvidia_hopper.plan (session 40): bench-2b's default plan is the build the GPU tests and
    benchmarks run (106 stages, the MLP fused, a 5 x 31 KB ring, no spills), and a setting changes
    it as `load` would: KOG_HOPPER_TAG_DOWN=1 unfuses the MLP (26 stages more) and polls
    down_proj's input instead."""
    pytest.importorskip("cuda.bindings.nvrtc", reason="cuda-python (NVRTC) is not installed")
    from kog_nvidia_hopper.plan import plan
    _no_hopper_settings(monkeypatch)
    prog = _bench2b_program()
    p = plan(prog)
    v = p["variant"]
    assert p["stages"] == 106 and (p["slots"], p["slot_bytes"]) == (5, 31744)
    assert v["SPLITK_DOWN"] == 1 and v["TAG_X"] == 1 and "TAG_DOWN" not in v
    assert p["ptxas"]["spill_stores"] == p["ptxas"]["spill_loads"] == 0
    assert 0 < p["ptxas"]["registers"] <= MAX_REGISTERS
    monkeypatch.setenv("KOG_HOPPER_TAG_DOWN", "1")
    q = plan(prog)
    assert q["stages"] == 106 + 26 and q["variant"]["TAG_DOWN"] == 1 and "SPLITK_DOWN" not in q["variant"]
    assert q["ptxas"]["spill_stores"] == 0


def test_plan_reports_a_refused_setting_in_one_line(monkeypatch, capsys):
    """A setting `load` refuses (TAG_X_EW on a Llama-family model) stops the plan with load's own
    one-line error, before anything is compiled; the command line prints it as `error: ...`."""
    from kog_nvidia_hopper import plan as P
    _no_hopper_settings(monkeypatch)
    monkeypatch.setenv("KOG_HOPPER_TAG_X_EW", "1")
    compiled = []
    monkeypatch.setattr(P, "compile_cubin", lambda *a, **k: compiled.append(1))
    with pytest.raises(KogError) as e:
        P.plan(_bench2b_program())
    assert "unset KOG_HOPPER_TAG_X_EW" in str(e.value) and "\n" not in str(e.value) and not compiled
    with pytest.raises(SystemExit) as e:
        P.main(["--preset", "bench-2b"])
    assert str(e.value).startswith("error: KOG_HOPPER_TAG_X_EW=1") and "\n" not in str(e.value)


def _kernels_copy(tmp_path, name, edit):
    """A copy of kernels/ in tmp_path / name, decode.cu passed through `edit` (a str -> str)."""
    from kog_nvidia_hopper.cuda_util import KERNEL_DIR
    d = tmp_path / name
    d.mkdir()
    for f in KERNEL_DIR.iterdir():
        if f.suffix in (".cu", ".cuh"):
            text = f.read_text()
            (d / f.name).write_text(edit(text) if f.name == "decode.cu" else text)
    return d


def test_same_code_ignores_comments_and_sees_a_code_change(tmp_path):
    """sass_report.same_code (--same-as, session 40): a comment that moves every later line leaves
    the machine code the same (nvdisasm without line info), a change to the code does not. So a
    kernel refactor that passes it needs no new GPU run."""
    _nvdisasm_or_skip()
    from kog_nvidia_hopper.cuda_util import KERNEL_DIR
    from kog_nvidia_hopper.sass_report import DEFAULT_BUILD, same_code
    anchor = "            int ws = s - 1;\n"
    assert anchor in (KERNEL_DIR / "decode.cu").read_text()
    commented = _kernels_copy(tmp_path, "commented", lambda t: t.replace(anchor, "            // a new comment\n\n" + anchor))
    changed = _kernels_copy(tmp_path, "changed", lambda t: t.replace(anchor, "            int ws = s - 1 - (int)(c.it > (1 << 30));\n"))
    assert same_code(DEFAULT_BUILD, KERNEL_DIR, commented)[0].startswith("the same machine code")
    out = same_code(DEFAULT_BUILD, KERNEL_DIR, changed)
    assert out[0].startswith("DIFFERENT machine code") and len(out) == 3


def test_revision_kernels_reads_a_git_revision(tmp_path):
    """--same-as REV takes kernels/ from git: HEAD's files are the tree's kernel sources by name;
    an unknown revision is a one-line error that says what is needed."""
    import subprocess
    from kog_nvidia_hopper.cuda_util import KERNEL_DIR
    from kog_nvidia_hopper.sass_report import revision_kernels
    if subprocess.run(["git", "-C", str(KERNEL_DIR), "rev-parse"], capture_output=True).returncode:
        pytest.skip("kernels/ is not in a git checkout (an installed wheel)")
    got = revision_kernels("HEAD", str(tmp_path))
    names = sorted(f.name for f in got.iterdir())
    assert "decode.cu" in names and "matvec.cuh" in names
    assert all((KERNEL_DIR / n).exists() for n in names)
    with pytest.raises(KogError) as e:
        revision_kernels("no-such-revision-x", str(tmp_path))
    assert "--same-as needs" in str(e.value) and "\n" not in str(e.value)


def test_plan_variants_sets_each_variant_alone_and_says_which_fail(monkeypatch, capsys):
    """plan.py --variants (devcall.sh's VARIANTS syntax): each variant's settings are in the
    environment for its own plan only and restored after, a refused one prints load's error on its
    line and the others still run, and the exit status says the worst (1: refused, 2: spills)."""
    from kog_nvidia_hopper import plan as P
    _no_hopper_settings(monkeypatch)
    monkeypatch.setenv("KOG_HOPPER_SLOTS", "5")
    assert P.variant_settings("A=1 B=2,C=x=3") == [{"A": "1"}, {"B": "2", "C": "x=3"}]
    with pytest.raises(SystemExit, match="not NAME=VALUE"):
        P.variant_settings("KOG_HOPPER_SLOTS")
    import os
    seen = []

    def fake_plan(program, sms=132):
        seen.append({k: os.environ.get(k) for k in ("KOG_HOPPER_SLOTS", "KOG_HOPPER_X")})
        if os.environ.get("KOG_HOPPER_X") == "bad":
            raise KogError("KOG_HOPPER_X=bad: unset KOG_HOPPER_X")
        spill = 8 if os.environ.get("KOG_HOPPER_X") == "spill" else 0
        return {"stages": 1, "slots": 5, "slot_bytes": 31744, "smem": 1, "variant": {},
                "ptxas": {"registers": 100, "spill_stores": spill, "spill_loads": 0}}
    monkeypatch.setattr(P, "plan", fake_plan)
    monkeypatch.setattr("kog_nvidia_hopper.bench.build", lambda preset, context: (None, None))
    with pytest.raises(SystemExit) as e:
        P.main(["--preset", "bench-2b", "--variants", "KOG_HOPPER_SLOTS=6 KOG_HOPPER_X=bad KOG_HOPPER_X=ok"])
    assert e.value.code == 1
    assert seen == [{"KOG_HOPPER_SLOTS": "6", "KOG_HOPPER_X": None}, {"KOG_HOPPER_SLOTS": "5", "KOG_HOPPER_X": "bad"},
                    {"KOG_HOPPER_SLOTS": "5", "KOG_HOPPER_X": "ok"}]
    assert os.environ["KOG_HOPPER_SLOTS"] == "5" and "KOG_HOPPER_X" not in os.environ
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 3 and lines[1] == "KOG_HOPPER_X=bad: error: KOG_HOPPER_X=bad: unset KOG_HOPPER_X"
    with pytest.raises(SystemExit) as e:
        P.main(["--preset", "bench-2b", "--variants", "KOG_HOPPER_X=spill"])
    assert e.value.code == 2
