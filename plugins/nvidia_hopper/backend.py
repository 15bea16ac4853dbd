"""HopperBackend: the whole request in one cooperative launch of kernels/decode.cu."""
from __future__ import annotations

import ctypes
import os
import struct
import time
from typing import Iterator, Mapping, Sequence

import numpy as np

from kog_core.errors import BackendUnavailable, CapabilityError, ContextLengthExceeded, KogError
from kog_core.interfaces import CancelToken, KernelBackend, SamplingParams, StopCriteria
from kog_core.program import DecodeProgram

from . import schedule as S
from .cuda_util import check, compile_cubin, ptxas_report, source


def _f32bits(x: float) -> int:
    return struct.unpack("<i", struct.pack("<f", float(x)))[0]


def _env_int(name: str, default: int, lo: int = 1, hi: int = 1 << 20) -> int:
    """An integer tuning knob in [lo, hi] from the environment (docs/nvidia-hopper.md)."""
    v = os.environ.get(name)
    if v is None:
        return default
    if not v.strip().isdigit() or not lo <= int(v) <= hi:
        example = min(max(default or 16, lo), hi)  # a value the knob accepts (0-1 switches: 1)
        raise KogError(f"{name}={v!r} is not an integer from {lo} to {hi}: set one (e.g. {name}={example}) or unset it")
    return int(v)


def env_defines() -> dict[str, int]:
    """KOG_HOPPER_DEFINES="NAME=VALUE,..." (or ";"): extra compile-time settings for experiments (what-if
    builds such as matvec.cuh DEBUG_DOT, whose results are wrong on purpose). Upper-case names,
    integer values; anything else is refused with the expected form."""
    out = {}
    # commas or semicolons between pairs (devcall.sh's VARIANTS turns commas into separate variables)
    for item in filter(None, os.environ.get("KOG_HOPPER_DEFINES", "").replace(";", ",").split(",")):
        name, _, value = item.strip().partition("=")
        if not (name.isidentifier() and name.isupper() and value.lstrip("-").isdigit()):
            raise KogError(f"KOG_HOPPER_DEFINES: {item!r} is not NAME=INTEGER: use e.g. KOG_HOPPER_DEFINES=DEBUG_DOT=1,NSLOTS=5")
        out[name] = int(value)
    return out


def defer_norm_refusal(stages, binfo: np.ndarray, variant: dict) -> str:
    """Why the deferred norm (matvec.cuh DEFER_NORM) cannot apply to these stages ("" if it can):
    a block keeps the sums of squares of at most DEFER_NORM_LANES input rows of a normed stage
    (binfo[stage, block, 2]: the block's lanes), and the loader multiplies on the register path."""
    normed = [i for i, st in enumerate(stages)
              if st.type == "matvec" and int(st.f.get("MV_IN_MODE") or 0) & S.CONSTS["IN_NORM"]]
    most = int(binfo[normed, :, 2].max()) if normed else 0
    if most > S.DEFER_NORM_LANES:
        return f"a block takes {most} input rows of a normed stage, more than the {S.DEFER_NORM_LANES} it keeps sums for"
    if "X_CPASYNC" in variant:
        return "KOG_HOPPER_X_CPASYNC=1 loads input rows past the registers"
    return ""


def _to_bf16_bits(a: np.ndarray) -> np.ndarray:
    import ml_dtypes
    a = np.asarray(a)
    if a.dtype == ml_dtypes.bfloat16:
        return np.ascontiguousarray(a).view(np.uint16)
    return np.ascontiguousarray(a, dtype=np.float32).astype(ml_dtypes.bfloat16).view(np.uint16)


def _progress_limit(positions: int) -> float:
    """Seconds without progress after which a running kernel is stuck (_stuck_error): a minute, and
    50 ms more for each position it must run first (the prompt goes through token by token)."""
    return 60.0 + 0.05 * positions


class HopperBackend(KernelBackend):
    name = "nvidia_hopper"
    tagged: dict = {}  # TAG_DOWN's tensors and their sizes (load sets them)
    tagged_parts: tuple = ()  # ATT_TAGS's partial buffers (load sets them)
    stuck: str | None = None  # why the last launch never ended (_stuck_error): no launch after it

    def __init__(self, device: int = 0, **options):
        super().__init__(**options)
        from cuda.bindings import driver as drv
        self.drv = drv
        err, = drv.cuInit(0)
        if int(err) != 0:
            raise BackendUnavailable(f"no NVIDIA GPU found (cuInit: {err.name})")
        n = check(drv.cuDeviceGetCount(), "cuDeviceGetCount")
        if n <= device:
            raise BackendUnavailable(f"no NVIDIA GPU found (device count {n})")
        self.dev = check(drv.cuDeviceGet(device), "cuDeviceGet")
        major = check(drv.cuDeviceGetAttribute(drv.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, self.dev))
        minor = check(drv.cuDeviceGetAttribute(drv.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, self.dev))
        if (major, minor) != (9, 0):
            raise BackendUnavailable(f"nvidia_hopper needs an sm_90 GPU (H100/H200), found compute capability {major}.{minor}")
        self.ctx = check(drv.cuDevicePrimaryCtxRetain(self.dev), "cuDevicePrimaryCtxRetain")
        check(drv.cuCtxSetCurrent(self.ctx), "cuCtxSetCurrent")
        self.sms = check(drv.cuDeviceGetAttribute(drv.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, self.dev))
        self.nb = int(options.get("blocks", self.sms))
        # dynamic shared memory a block may opt into (227 KB on Hopper): sizes the weight ring
        self.max_smem = check(drv.cuDeviceGetAttribute(
            drv.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN, self.dev))
        self.stream = check(drv.cuStreamCreate(1), "cuStreamCreate")  # non-blocking
        self.allocs: list = []
        self._copy_bw = None
        self.program = None

    # ------------------------------------------------------------------ memory helpers
    def _alloc(self, nbytes: int):
        p = check(self.drv.cuMemAlloc(max(int(nbytes), 256)), f"cuMemAlloc({nbytes} bytes)")
        p = int(p)
        self.allocs.append(p)
        return p

    def _upload(self, arr: np.ndarray) -> int:
        arr = np.ascontiguousarray(arr)
        p = self._alloc(arr.nbytes)
        check(self.drv.cuMemcpyHtoD(p, arr.ctypes.data, arr.nbytes), "cuMemcpyHtoD")
        return p

    def _host_mapped(self, nbytes: int):
        drv = self.drv
        h = check(drv.cuMemHostAlloc(nbytes, drv.CU_MEMHOSTALLOC_DEVICEMAP | drv.CU_MEMHOSTALLOC_PORTABLE), "cuMemHostAlloc")
        d = check(drv.cuMemHostGetDevicePointer(h, 0), "cuMemHostGetDevicePointer")
        return int(h), int(d)

    # ------------------------------------------------------------------ load
    def load(self, program: DecodeProgram, weights: Mapping[str, np.ndarray], *, rank: int = 0, ranks: int = 1,
             collective=None) -> None:
        drv = self.drv
        if ranks != 1:
            raise CapabilityError("nvidia_hopper runs on one GPU (all lanes on it); ranks > 1 is not supported")
        problems = self.capabilities.check(program) if self.capabilities.ops else []
        if problems:
            raise CapabilityError("nvidia_hopper cannot run this model: " + "; ".join(problems))
        self.program = program
        # consumer warps per block: 10 by default, with the producer and the signal warp 12 a block
        # (12 leave ptxas 168 registers a thread; 13 cap it at 128 through the register-file
        # quadrants, and the loops spill: perf notes v12-v15)
        self.nw = _env_int("KOG_HOPPER_CONSUMER_WARPS", S.NW_DEFAULT, lo=8, hi=S.NW)
        self.nt = 32 * self.nw
        # a signal warp publishes stage completions, so no consumer warp stalls on the release fence
        # (perf notes v14; racecheck-clean since session 6). KOG_HOPPER_SIGNAL_WARP=0 with
        # KOG_HOPPER_CONSUMER_WARPS=11 is the v13 build
        self.signal_warp = _env_int("KOG_HOPPER_SIGNAL_WARP", 1, lo=0, hi=1)
        self.nthreads = self.nt + 32 + 32 * self.signal_warp  # + the producer warp (+ the signal warp)
        # attention K/V sub-chunk buffers: 1 by default leaves 17 KB more shared memory to the weight ring
        self.kv_bufs = _env_int("KOG_HOPPER_KV_BUFFERS", 1, lo=1, hi=2)
        # Laneformer's delayed DTP residual at the end of the matvec stage that makes its partial
        # (schedule._fuse_lane_residual; the default since session 14: +2.5% on laneformer-2b, +5.4%
        # with RMS_BLOCK; its first form, in every row group's epilogue, was -4.9% in session 13).
        # 0: elementwise stages
        fuse_lr = bool(_env_int("KOG_HOPPER_FUSE_LANE_RESIDUAL", 1, lo=0, hi=1))
        stages = S.lower(program, self.nb, self.nt, self.kv_bufs, fuse_lane_residual=fuse_lr)
        # KOG_HOPPER_SPLITK_DOWN (the default since session 20: +1.4% on bench-2b, +0.9% on
        # llama-3.2-1b): gate/up and down_proj as one stage, down_proj split over the blocks' gate/up
        # rows and summed in 64-bit fixed point with integer atomics (exact, so seeded runs still
        # repeat); the residual stays pending until o_proj writes it (schedule.fuse_down_splitk). One
        # grid-wide boundary and one 32 KB input row less a layer. Off by default under the two
        # experiments that change the unfused down_proj's input path.
        x_cpasync = _env_int("KOG_HOPPER_X_CPASYNC", 0, lo=0, hi=1)
        # TAG_DOWN (below) is on by default only where the MLP stays unfused; asked for explicitly it
        # turns the fusion off by default, as X_CPASYNC does
        explicit_tag_down = os.environ.get("KOG_HOPPER_TAG_DOWN") == "1"
        tag_down = _env_int("KOG_HOPPER_TAG_DOWN", 1, lo=0, hi=1) and not x_cpasync
        if explicit_tag_down and x_cpasync:
            raise KogError("KOG_HOPPER_TAG_DOWN=1 polls down_proj's input on the register path: unset KOG_HOPPER_X_CPASYNC")
        want_splitk = _env_int("KOG_HOPPER_SPLITK_DOWN", int(not (x_cpasync or explicit_tag_down)), lo=0, hi=1)
        if want_splitk and (x_cpasync or explicit_tag_down):
            raise KogError("KOG_HOPPER_SPLITK_DOWN=1 fuses down_proj, whose input KOG_HOPPER_X_CPASYNC / "
                           "KOG_HOPPER_TAG_DOWN change: set KOG_HOPPER_SPLITK_DOWN=0 with them")
        # KOG_HOPPER_SPLITK_CARRY (session 21): the split-K accumulator starts from x (o_proj writes
        # it too), so q/k/v's loader reads it alone, not x beside it (schedule.fuse_down_splitk)
        want_carry = _env_int("KOG_HOPPER_SPLITK_CARRY", 0, lo=0, hi=1)
        self.splitk = S.fuse_down_splitk(program, stages, self.nt, carry=bool(want_carry)) if want_splitk else 0
        self.carry = any(st.f.get("_carry_out") is not None for st in stages)
        if want_carry and not self.carry:
            raise KogError("KOG_HOPPER_SPLITK_CARRY=1 needs split-K stages whose x has one writer before them "
                           "(a Llama-family model, KOG_HOPPER_SPLITK_DOWN=1): unset KOG_HOPPER_SPLITK_CARRY")
        # KOG_HOPPER_SPLITK_PAIRS (session 21): clusters of 2 blocks, each adding both blocks' partials
        # of half the split-K stage's outputs (matvec.cuh SPLITK_PAIRS): half the 64-bit atomics.
        # Needs an even grid and every pair co-resident (checked once the kernel is loaded).
        want_pairs = _env_int("KOG_HOPPER_SPLITK_PAIRS", 0, lo=0, hi=1)
        if want_pairs and not (self.splitk and self.nb % 2 == 0):
            raise KogError(f"KOG_HOPPER_SPLITK_PAIRS=1 needs split-K stages (a Llama-family model, KOG_HOPPER_SPLITK_DOWN=1) "
                           f"and an even number of blocks (here {self.nb}): unset KOG_HOPPER_SPLITK_PAIRS")
        self.pairs = bool(want_pairs)
        # KOG_HOPPER_SPLITK_BULK (session 21): the split-K partials added by one bulk reduction of the
        # copy engine a block (matvec.cuh SPLITK_BULK) instead of red instructions
        want_bulk = _env_int("KOG_HOPPER_SPLITK_BULK", 0, lo=0, hi=1)
        if want_bulk and not self.splitk:
            raise KogError("KOG_HOPPER_SPLITK_BULK=1 needs split-K stages (a Llama-family model, "
                           "KOG_HOPPER_SPLITK_DOWN=1): unset KOG_HOPPER_SPLITK_BULK")
        self.splitk_bulk = bool(want_bulk)
        # KOG_HOPPER_SPLITK_PERM (session 21, not yet run on a GPU): the accumulators' int64s in the
        # loaders' order, so a pending row's loads read whole sectors (matvec.cuh SPLITK_PERM)
        self.splitk_perm = bool(_env_int("KOG_HOPPER_SPLITK_PERM", 0, lo=0, hi=1))
        if self.splitk_perm and (not self.splitk or self.splitk_bulk):
            raise KogError("KOG_HOPPER_SPLITK_PERM=1 needs split-K stages (a Llama-family model, KOG_HOPPER_SPLITK_DOWN=1) "
                           "and not KOG_HOPPER_SPLITK_BULK: unset one of them")
        # KOG_HOPPER_SPLITK_COUNT (session 31, an experiment, off: -2.0% with TAG_X on bench-2b, -1.4% on
        # llama-3.2-1b, an H100): each accumulator word counts its adds in its low 8 bits, and the loader
        # after the split-K stage polls the counts instead of waiting on the stage's count (matvec.cuh
        # SPLITK_COUNT; the sum at 2^-24 instead of 2^-32)
        self.splitk_count = bool(_env_int("KOG_HOPPER_SPLITK_COUNT", 0, lo=0, hi=1))
        if self.splitk_count and (not self.splitk or want_pairs or want_bulk or self.carry or self.nb > 255):
            raise KogError("KOG_HOPPER_SPLITK_COUNT=1 needs split-K stages (a Llama-family model, KOG_HOPPER_SPLITK_DOWN=1) "
                           "summed by plain atomics (not KOG_HOPPER_SPLITK_PAIRS, _BULK or _CARRY) on fewer than 256 SMs: "
                           "unset KOG_HOPPER_SPLITK_COUNT")
        if self.splitk_bulk and self.pairs:
            raise KogError("KOG_HOPPER_SPLITK_BULK=1 and KOG_HOPPER_SPLITK_PAIRS=1 are two forms of the same "
                           "sum: set one of them")
        # attention tiles to aim for (attention_plan.cuh att_chunks; default one per block): fewer, longer
        # chunks leave fewer partials to combine but longer tiles (64 and 96: slower, session 8);
        # more than one per block gives blocks a second tile, whose code has just run (the trace
        # build stamps it: instruction fetch, cold against hot)
        att_tiles = _env_int("KOG_HOPPER_ATT_TILES", 0, lo=0, hi=4 * self.nb)
        for st in stages:
            if st.type == "attn" and att_tiles:
                st.f["AT_TARGET"] = att_tiles
                S.allow_attention_chunks(st, -(-att_tiles // (st.f["AT_L"] * st.f["AT_HKV"])), self.nt)
        self.T = program.context_length
        ptr: dict[str, int] = {}
        consts = program.metadata.get("consts", {})
        # a matvec weight lives only in its stage's packed copy (item order); weights read any other
        # way (embedding tables, norms, biases; a tied LM head's table) are uploaded as they are
        plain = {name for op in program.ops for i, name in enumerate(op.inputs) if not (op.kind == "matvec" and i == 1)}
        for spec in program.tensors.values():
            if spec.kind == "weight":
                if spec.name not in weights:
                    raise KogError(f"weight {spec.name!r} is missing from the checkpoint")
                w = weights[spec.name]
                if tuple(w.shape) != spec.shape:
                    raise KogError(f"weight {spec.name!r} has shape {tuple(w.shape)}, the program expects {spec.shape}")
                if spec.name in plain:
                    ptr[spec.name] = self._upload(_to_bf16_bits(w))
            elif spec.kind == "const":
                c = np.asarray(consts[spec.name], dtype=np.float32).reshape(spec.shape)
                ptr[spec.name] = self._upload(c)
                if c.ndim == 1:  # RoPE inverse frequencies -> exact cos/sin tables like the reference
                    ang = np.arange(self.T, dtype=np.float64)[:, None] * c.astype(np.float64)[None, :]
                    ptr["cos:" + spec.name] = self._upload(np.cos(ang).astype(np.float32))
                    ptr["sin:" + spec.name] = self._upload(np.sin(ang).astype(np.float32))
            elif spec.kind == "kv":
                ptr[spec.name] = self._alloc(spec.numel * 2)  # bf16 KV cache
                check(drv.cuMemsetD16(ptr[spec.name], 0, spec.numel), "cuMemsetD16")
            elif spec.shape:
                ptr[spec.name] = self._alloc(spec.numel * 4)
                check(drv.cuMemsetD32(ptr[spec.name], 0, spec.numel), "cuMemsetD32")
        self.ptr = ptr
        self.argmax_ptr = 0
        self.argmax_tiles = 0

        def argmax_alloc(tiles):
            self.argmax_ptr = self._alloc(tiles * 8)
            self.argmax_tiles = tiles
            return self.argmax_ptr

        prefetch = _env_int("KOG_HOPPER_PREFETCH", 0, lo=0, hi=32)  # items the L2 prefetch runs ahead of the ring
        # weight rows per item (0: the default, 2 per consumer warp; a warp takes at most two)
        item_rows = _env_int("KOG_HOPPER_ITEM_ROWS", 0, lo=0, hi=2 * self.nw) or None
        # k-slices cut on multiples of 256 columns, so every lane has work in every step of the dot
        # loop (default since v17, +0.8% on bench-2b; 0: equal slices)
        self.kalign = 32 if _env_int("KOG_HOPPER_KALIGN", 1, lo=0, hi=1) else 1
        rows = []
        # where the attention's chunk partials are combined: by the last tile of each kv head in the
        # attention stage (default since v17, +1.6%), or by every block in o_proj's loader, which
        # then reads all heads' partials (up to 128 KB a block on bench-2b)
        combine = os.environ.get("KOG_HOPPER_ATTN_COMBINE", "ticket")
        if combine not in ("loader", "ticket"):
            raise KogError(f"KOG_HOPPER_ATTN_COMBINE={combine!r}: use 'loader' or 'ticket' (or leave it unset)")
        if combine == "loader":
            S.fuse_attention_combine(program, stages)
        # KOG_HOPPER_ATT_TAGS (session 23, an experiment, off; not yet run on a GPU): the chunks'
        # partials as 64-bit {value, token tag} words polled by the tile holding pos, instead of a
        # ticket (attention.cuh ATT_TAGS); the words are zeroed before every launch
        self.att_tags = bool(_env_int("KOG_HOPPER_ATT_TAGS", 0, lo=0, hi=1))
        if self.att_tags and combine == "loader":
            raise KogError("KOG_HOPPER_ATT_TAGS=1 needs the attention's last tile to combine: unset "
                           "KOG_HOPPER_ATTN_COMBINE or KOG_HOPPER_ATT_TAGS")
        self.tagged_parts = []  # (pointer, 32-bit words) of ATT_TAGS's partials
        self.d_desc = self._alloc(len(stages) * S.NSLOT * 8)  # rows point at each other (MV_ATTN)
        for st in stages:
            if st.type == "matvec":
                S.finalize_matvec(st, self.nb, program.logits, argmax_alloc,
                                  logits_numel=program.tensors[program.logits].numel)
        # TAG_DOWN (on by default since v32 where the MLP is not fused: Laneformer, +1.0% on
        # laneformer-2b, an H100, session 31): down_proj takes its input when the values carry this
        # write's parity, instead of after gate/up's completion count (a fused split-K stage has no
        # such pair left, so a Llama-family build is unchanged)
        tagged = S.tag_pair_outputs(program, stages) if tag_down else []
        # Readiness in the data on the attention's chain (default since v31, session 27: bench-2b and
        # llama-3.2-1b +3.0% on an H100, both together). TAG_QKV: the attention takes q / k / v when
        # their values carry this write's parity, not after the q/k/v stage's count (attention.cuh);
        # TAG_OPROJ: o_proj takes the attention's output the same way (matvec.cuh). Each stays off
        # where no stage is fed that way (=1 then says why; =0 turns it off). Session 26's failures
        # with them came from the poll loops, which the compiler had folded into one load (ld_poll).
        explicit_qkv = os.environ.get("KOG_HOPPER_TAG_QKV") == "1"
        self.tag_qkv = bool(_env_int("KOG_HOPPER_TAG_QKV", 1, lo=0, hi=1))
        tagged_qkv = S.tag_attention_inputs(program, stages) if self.tag_qkv else []
        if explicit_qkv and not tagged_qkv:
            raise KogError("KOG_HOPPER_TAG_QKV=1 needs attention stages fed by a q/k/v matvec stage that alone "
                           "writes their query, key and value (a Llama-family model): unset KOG_HOPPER_TAG_QKV")
        explicit_oproj = os.environ.get("KOG_HOPPER_TAG_OPROJ") == "1"
        if explicit_oproj and x_cpasync:
            raise KogError("KOG_HOPPER_TAG_OPROJ=1 polls o_proj's input on the register path: unset KOG_HOPPER_X_CPASYNC")
        tag_oproj = bool(_env_int("KOG_HOPPER_TAG_OPROJ", 1, lo=0, hi=1)) and not x_cpasync
        tagged_out = S.tag_attention_outputs(program, stages) if tag_oproj else []
        if explicit_oproj and not tagged_out:
            raise KogError("KOG_HOPPER_TAG_OPROJ=1 needs attention stages that combine their chunks and feed o_proj "
                           "alone (not KOG_HOPPER_ATTN_COMBINE=loader): unset KOG_HOPPER_TAG_OPROJ")
        # KOG_HOPPER_TAG_X (the default since v32, session 31: +1.2% on bench-2b, +1.1% on llama-3.2-1b,
        # an H100, same call): the MLP's normed stage takes x from o_proj when its values carry this
        # write's parity, not after o_proj's count (schedule.tag_residual_outputs); =0 turns it off
        explicit_x = os.environ.get("KOG_HOPPER_TAG_X") == "1"
        if explicit_x and x_cpasync:
            raise KogError("KOG_HOPPER_TAG_X=1 polls the MLP's input on the register path: unset KOG_HOPPER_X_CPASYNC")
        tag_x = bool(_env_int("KOG_HOPPER_TAG_X", 1, lo=0, hi=1)) and not x_cpasync
        # KOG_HOPPER_TAG_X_LANES (the default since v33 where Laneformer's DTP residual is fused: +1.6%
        # on laneformer-2b, an H100, session 32): the same for Laneformer's x, written by the fused
        # residual's tail pass (schedule.tag_residual_outputs(lanes=True)). Only such builds take it by
        # default: its second completion rule would also move Llama-family polls; =0 turns it off
        explicit_x_lanes = os.environ.get("KOG_HOPPER_TAG_X_LANES") == "1"
        has_lane_tail = any(sg.get("SEG_LRX") for st in stages if st.type == "matvec" for sg in st.segs)
        tag_x_lanes = bool(_env_int("KOG_HOPPER_TAG_X_LANES", 1, lo=0, hi=1)) and tag_x and (has_lane_tail or explicit_x_lanes)
        if explicit_x_lanes and not tag_x:
            raise KogError("KOG_HOPPER_TAG_X_LANES=1 extends KOG_HOPPER_TAG_X to Laneformer's lanes: unset KOG_HOPPER_TAG_X=0 "
                           "(and KOG_HOPPER_X_CPASYNC) or KOG_HOPPER_TAG_X_LANES")
        # (SPLITK_COUNT's readers first: tag_residual_outputs reads every stage's wait)
        if self.splitk_count and not S.count_splitk_inputs(stages):
            raise KogError("KOG_HOPPER_SPLITK_COUNT=1 found no loader right after a split-K stage: unset KOG_HOPPER_SPLITK_COUNT")
        # KOG_HOPPER_TAG_X_EW (the default since v34 wherever TAG_X_LANES is on: +0.26% on laneformer-2b,
        # ten rows over two calls on an H100, session 35): also the elementwise lane_residual stages of
        # Laneformer's early (all-reduce) layers write x with their parity; =0 gives v33's build
        asked_x_ew = _env_int("KOG_HOPPER_TAG_X_EW", 1, lo=0, hi=1)  # one reading: "01" is "1" here too
        explicit_x_ew = asked_x_ew == 1 and "KOG_HOPPER_TAG_X_EW" in os.environ
        tag_x_ew = bool(asked_x_ew) and tag_x_lanes
        if explicit_x_ew and not tag_x_lanes:  # a Llama-family model, or the lanes' tags turned off
            raise KogError("KOG_HOPPER_TAG_X_EW=1 extends KOG_HOPPER_TAG_X_LANES, which needs a Laneformer with its DTP "
                           "residual fused (not KOG_HOPPER_TAG_X_LANES=0, KOG_HOPPER_TAG_X=0 or KOG_HOPPER_X_CPASYNC=1): "
                           "unset KOG_HOPPER_TAG_X_EW")
        self.tag_x = bool(S.tag_residual_outputs(program, stages, lanes=tag_x_lanes, ew=tag_x_ew)) if tag_x else False
        self.tag_x_ew = any(st.type == "ew" and st.f.get("EW_OTAG") for st in stages)
        if explicit_x_ew and not self.tag_x_ew:  # (by default, a Laneformer without all-reduce layers builds without it)
            raise KogError("KOG_HOPPER_TAG_X_EW=1 found no elementwise lane_residual writing x before a normed matvec "
                           "(Laneformer's all-reduce layers): unset KOG_HOPPER_TAG_X_EW")
        polled_x = any(st.type == "matvec" and st.f["MV_FLAGS"] & S.CONSTS["MVF_TAG_IN"]
                       and st.f.get("MV_IN_MODE") == S.CONSTS["IN_NORM"] for st in stages)
        if explicit_x_lanes and not any(st.f.get("MV_FLAGS", 0) & S.CONSTS["MVF_TAG_LRX"] for st in stages):
            raise KogError("KOG_HOPPER_TAG_X_LANES=1 needs Laneformer's fused DTP residual (KOG_HOPPER_FUSE_LANE_RESIDUAL=1) "
                           "followed by a normed matvec: unset KOG_HOPPER_TAG_X_LANES")
        if explicit_x and not polled_x:
            raise KogError("KOG_HOPPER_TAG_X=1 needs a matvec that adds into x in place (o_proj) followed by a normed "
                           "matvec reading x (a Llama-family model, not KOG_HOPPER_SPLITK_CARRY): unset KOG_HOPPER_TAG_X")
        # (x is not marked stale before a launch: every tagged read of it follows a tagged write of the same token)
        self.tagged = {name: program.tensors[name].numel for name in tagged + tagged_qkv + tagged_out}  # buffer -> floats
        # sampled decoding (temperature > 0): on every block (sample_grid.cuh; default since session
        # 10) when each thread's share of the vocabulary fits its registers and the LM head leaves
        # per-block maxima; else on block 0 (sample.cuh radix_select). KOG_HOPPER_SAMPLE=block forces
        # block 0.
        mode = os.environ.get("KOG_HOPPER_SAMPLE", "grid")
        if mode not in ("grid", "block"):
            raise KogError(f"KOG_HOPPER_SAMPLE={mode!r}: use 'grid' or 'block' (or leave it unset)")
        self.sample_ept = S.sample_grid_ept(program.vocab_size, self.nb, self.nt)
        self.sample_grid = (mode == "grid" and self.argmax_ptr != 0
                            and self.sample_ept <= S.SAMPLE_GRID_MAX_EPT)
        for st in stages:
            if st.type == "sample":
                st.smem = max(st.smem, S.sample_grid_smem() if self.sample_grid else S.sample_radix_smem())
        # matvec.cuh NORM_SMEM (default since v17, +0.5%): the norm weights a stage preloads before
        # its wait go to shared memory by cp.async instead of local memory
        self.norm_smem = _env_int("KOG_HOPPER_NORM_SMEM", 1, lo=0, hi=1)
        # items of 4 rows a warp where 2 a warp at full K fill at most half a slot (matvec.cuh
        # WIDE_ITEMS; laneformer-2b's o_proj, K = 384; session 15: +2.3%). Not with KOG_HOPPER_ITEM_ROWS
        wide = _env_int("KOG_HOPPER_WIDE_ITEMS", 1, lo=0, hi=1) == 1 and item_rows is None
        # rows dealt lane by lane (a block spans at most two lanes), with 24 weight rows of cost counted
        # at each change of lane, so a block that loads two lanes' input rows takes fewer weights
        # (schedule._deal_rows; session 15: +0.9% on laneformer-2b, pads 0 / 8 / 16 +0.3 / +0.6 / +0.9%;
        # session 16: 24 +0.15% over 16, 32 level). A model without lanes gets the same plan either way
        lane_major = _env_int("KOG_HOPPER_LANE_MAJOR", 1, lo=0, hi=1)
        lane_pad = _env_int("KOG_HOPPER_LANE_PAD_ROWS", 24, lo=0, hi=64)
        for st in stages:
            if st.type == "matvec" and lane_major:
                st.f["_lane_major"], st.f["_lane_pad"] = 1, lane_pad
        # 5 slots by default (session 16, same calls, against 6: laneformer-2b +0.55%, llama-3.2-1b
        # +0.17%, bench-2b +0.15%; 4: bench-2b -0.6%): fewer copies queued in front of every load
        max_slots = _env_int("KOG_HOPPER_SLOTS", S.DEFAULT_SLOTS, lo=2, hi=S.MAX_SLOTS)
        # KOG_HOPPER_POOL (session 26, an experiment, off): this percentage of a long stage's rows (the
        # LM head, a split-K stage) is not dealt but grabbed at run time by whichever block's producer
        # gets there first, in units of a row group (a split-K stage's: KOG_HOPPER_POOL_ROWS rows of
        # gate/up and down), so the stage ends with its last unit, not with its slowest block's share
        # (schedule.pool_rows, stream.cuh DYN_POOL)
        pool_pct = _env_int("KOG_HOPPER_POOL", 0, lo=0, hi=50)
        if pool_pct and self.splitk_count:
            raise KogError("KOG_HOPPER_SPLITK_COUNT counts the split-K stage's adds without a pool: unset KOG_HOPPER_POOL "
                           "or KOG_HOPPER_SPLITK_COUNT")
        if pool_pct and (self.pairs or self.splitk_bulk or _env_int("KOG_HOPPER_COPY_LSU", 0, lo=0, hi=1)):
            raise KogError("KOG_HOPPER_POOL sums split-K partials with red instructions and ends a pool with a plain "
                           "arrive: unset KOG_HOPPER_SPLITK_PAIRS, KOG_HOPPER_SPLITK_BULK and KOG_HOPPER_COPY_LSU, "
                           "or KOG_HOPPER_POOL")
        pool_unit = _env_int("KOG_HOPPER_POOL_ROWS", 7, lo=1, hi=self.nw)
        pool_min = _env_int("KOG_HOPPER_POOL_MIN_ROWS", S.POOL_MIN_ROWS_A_BLOCK, lo=1)
        for st in stages:
            if st.type == "matvec" and pool_pct:
                st.f["_pool_pct"], st.f["_pool_min"] = pool_pct, pool_min
                st.f["_pool_rows"] = pool_unit if st.f.get("_splitk") else 2 * self.nw
        slot_bytes, plans, scratch = self._ring_slots(stages, item_rows, wide, max_slots)
        pooled = [si for si, plan in plans.items() if S.pool_layout(plan, self.nb)]
        self.npools = len(pooled)  # each has one grab counter a token iteration (R_POOL)
        for si in pooled:
            stages[si].f["MV_FLAGS"] = int(stages[si].f["MV_FLAGS"]) | S.CONSTS["MVF_POOL"]
        self.d_acc, self.acc_bytes = self._splitk_accumulators(stages)
        streamed = []
        for si, st in enumerate(stages):
            if st.type == "matvec":
                plan = plans[si]
                packed = S.pack_stage_weights(plan, self.nb, st.segs, lambda name: _to_bf16_bits(weights[name]))
                st.f["MV_PACKED"] = self._upload(packed)
                del packed
                att_next = (si + 1 < len(stages) and stages[si + 1].type == "attn"
                            and _env_int("KOG_HOPPER_ATT_PREFETCH", 0, lo=0, hi=1) == 1)  # measured no gain: off
                streamed.append((si, plan, st.segs, st.f["MV_PACKED"], st.f["MV_FLAGS"], att_next))
                if "_attn_stage" in st.f:  # its input combines the attention's chunks (matvec.cuh mv_load_attn)
                    if st.f["_attn_stage"] != si - 1:
                        raise KogError("nvidia_hopper: an attention combine must read the stage just before it")
                    st.f["MV_ATTN"] = self.d_desc + st.f["_attn_stage"] * S.NSLOT * 8
            if st.type == "attn":
                sc = st.f.pop("_scratch")
                word = 8 if self.att_tags else 4  # ATT_TAGS: {value, tag}
                st.f["AT_PART_O"] = self._alloc(sc["part_o"] * word)
                st.f["AT_PART_ML"] = self._alloc(sc["part_ml"] * word)
                if self.att_tags:
                    self.tagged_parts += [(st.f["AT_PART_O"], sc["part_o"] * 2), (st.f["AT_PART_ML"], sc["part_ml"] * 2)]
                t = self._alloc(sc["ticket"] * 4)
                check(drv.cuMemsetD32(t, 0, sc["ticket"]), "cuMemsetD32")
                st.f["AT_TICKET"] = t
            if st.type == "sample":
                st.f["SM_ARGMAX"] = self.argmax_ptr
                st.f["SM_NPART"] = self.argmax_tiles
            rows.append(self._pack(st))
        self.stages = stages
        stream, binfo = S.stream_list(streamed, self.nb, len(stages))
        self.d_stream, self.d_binfo = self._upload(stream), self._upload(binfo)
        self.desc = np.stack(rows)
        check(drv.cuMemcpyHtoD(self.d_desc, self.desc.ctypes.data, self.desc.nbytes), "cuMemcpyHtoD(stages)")
        self.nst = len(stages)
        self.d_counters = self._alloc(self.nst * 4)
        # the weight ring takes the shared memory the stages leave, up to KOG_HOPPER_SLOTS slots
        nslots = min(max_slots, (self.max_smem - S.STATIC_SMEM - scratch) // slot_bytes)
        if nslots < 2:
            raise CapabilityError(f"nvidia_hopper: the stages need {scratch} bytes of shared memory, leaving no "
                                  f"room for two {slot_bytes}-byte weight slots (try KOG_HOPPER_SLOT_KB=16)")
        variant = dict(NT=self.nt, NSLOTS=nslots, SLOT_BYTES=slot_bytes, RING_OFF=scratch, PREFETCH=prefetch)
        if self.kv_bufs != 2:
            variant["KV_BUFS"] = self.kv_bufs
        if self.signal_warp:
            variant["SIGNAL_WARP"] = 1
            # v21 (session 12, +0.7% on bench-2b): the signal warp sleeps in the consumers' end-of-stage
            # barrier instead of polling a shared word thread 0 sets after it (decode.cu SIGNAL_BAR)
            if _env_int("KOG_HOPPER_SIGNAL_BAR", 1, lo=0, hi=1):
                variant["SIGNAL_BAR"] = 1
        if _env_int("KOG_HOPPER_COPY_LSU", 0, lo=0, hi=1):  # slots filled by per-lane cp.async (perf notes session 6)
            variant["COPY_LSU"] = 1
        if self.norm_smem:
            variant["NORM_SMEM"] = 1
        if _env_int("KOG_HOPPER_COMPACT_ATTENTION", 0, lo=0, hi=1):  # attention loops not unrolled (an experiment, session 8)
            variant["COMPACT_ATTENTION"] = 1
        if x_cpasync:  # input rows by cp.async (an experiment, session 8)
            variant["X_CPASYNC"] = 1
        # an RMSNorm stage of few long rows a block a row (elementwise.cuh RMS_BLOCK; the default
        # since session 14: +2.5% on laneformer-2b), compiled in only where such a stage exists
        if _env_int("KOG_HOPPER_RMS_BLOCK", 1, lo=0, hi=1) and S.has_long_rmsnorm(stages, self.nt):
            variant["RMS_BLOCK"] = 1
        # v18 (session 9): the attention's shapes compiled in when every attention stage shares them
        # (+3.4% on bench-2b), and the weight stream's copies L2 evict-first (+4.2%)
        if _env_int("KOG_HOPPER_SHAPE_CONSTS", 1, lo=0, hi=1):
            variant.update(S.attention_shape_consts(stages))
        if _env_int("KOG_HOPPER_STREAM_L2_FIRST", 1, lo=0, hi=1):
            variant["STREAM_L2_FIRST"] = 1
        if any(sg.get("SEG_LRX") for st in stages for sg in st.segs):
            variant["LANE_RESIDUAL"] = 1
        if any(st.type == "matvec" and st.f["MV_FLAGS"] & S.CONSTS["MVF_WIDE"] for st in stages):
            variant["WIDE_ITEMS"] = 1
        # a block's input rows of several lanes in one batch of loads (matvec.cuh LANES_LOAD), compiled
        # in only where a block of a matvec stage takes more than one lane (Laneformer)
        if _env_int("KOG_HOPPER_LANES_LOAD", 1, lo=0, hi=1) and int(binfo[:, :, 2].max(initial=0)) > 1:
            variant["LANES_LOAD"] = 1
        if tagged:  # TAG_DOWN (an experiment, session 9)
            variant["TAG_DOWN"] = 1
        if tagged_qkv:  # TAG_QKV (default since v31)
            variant["TAG_QKV"] = 1
        if tagged_out:  # TAG_OPROJ (default since v31)
            variant["TAG_OPROJ"] = 1
        if self.tag_x:  # KOG_HOPPER_TAG_X (session 31)
            variant["TAG_X"] = 1
        if self.tag_x_ew:  # KOG_HOPPER_TAG_X_EW (session 32; the default since v34)
            variant["TAG_X_EW"] = 1
        if self.splitk_count:  # KOG_HOPPER_SPLITK_COUNT (session 31)
            variant["SPLITK_COUNT"] = 1
        if self.splitk:  # KOG_HOPPER_SPLITK_DOWN (the default since v28)
            variant["SPLITK_DOWN"] = 1
        if self.carry:  # KOG_HOPPER_SPLITK_CARRY
            variant["SPLITK_CARRY"] = 1
        if self.splitk_perm:  # KOG_HOPPER_SPLITK_PERM
            variant["SPLITK_PERM"] = 1
        if self.att_tags:  # KOG_HOPPER_ATT_TAGS
            variant["ATT_TAGS"] = 1
        if self.pairs:  # the partner's partials land at the end of the stage scratch
            rbuf = max(S.pair_rbuf_bytes(st) for st in stages if st.f.get("_splitk"))
            variant.update(SPLITK_PAIRS=1, PAIR_RBUF_OFF=(scratch - rbuf) // 16 * 16)
        if self.splitk_bulk:  # the bulk reduction's source at the end of the stage scratch (128-byte aligned)
            stg = max(S.splitk_stage_bytes(st) for st in stages if st.f.get("_splitk"))
            variant.update(SPLITK_BULK=1, SPLITK_STAGE_OFF=(scratch - stg) // 128 * 128)
        if self.npools:  # DYN_POOL; a split-K stage's partials (D floats) at the end of the stage scratch
            variant["DYN_POOL"] = 1
            pacc = max([S.pool_partials_bytes(st) for st in stages if st.f.get("_splitk")], default=0)
            if pacc:
                variant["POOL_ACC_OFF"] = (scratch - pacc) // 16 * 16
        if self.sample_grid:
            variant.update(SAMPLE_GRID=1, SAMPLE_EPT=self.sample_ept)
        # the dynamic shared memory (and so every ring slot) on a fixed boundary, not wherever the
        # static shared memory ends (stream.cuh SMEM_ALIGN; session 10)
        smem_align = _env_int("KOG_HOPPER_SMEM_ALIGN", 128, lo=16, hi=1024)
        if smem_align & (smem_align - 1):
            raise KogError(f"KOG_HOPPER_SMEM_ALIGN={smem_align}: use a power of two from 16 to 1024")
        if smem_align != 16:
            variant["SMEM_ALIGN"] = smem_align
        # v21 (session 12, +1.6% on bench-2b): a normed stage's division by the norm moves to the
        # epilogue (matvec.cuh DEFER_NORM). A block keeps the sums of squares of at most
        # DEFER_NORM_LANES input rows; a model that needs more keeps the normalise pass.
        if _env_int("KOG_HOPPER_DEFER_NORM", 1, lo=0, hi=1):
            why = defer_norm_refusal(stages, binfo, variant)
            if not why:
                variant["DEFER_NORM"] = 1
            elif os.environ.get("KOG_HOPPER_DEFER_NORM"):
                raise KogError(f"KOG_HOPPER_DEFER_NORM=1 cannot apply: {why}; unset KOG_HOPPER_DEFER_NORM")
        variant.update(env_defines())  # KOG_HOPPER_DEFINES: experiments' compile-time settings
        # v18b (session 9, +1.3% on bench-2b): less code on the per-layer path, which runs with its
        # instructions fetched from L2 (the normalise pass's divisions through a reciprocal, the
        # attention's divisions by its chunk count from a corrected float estimate)
        for knob in ("NORM_RCP", "ATT_FASTDIV"):
            if _env_int(f"KOG_HOPPER_{knob}", 1, lo=0, hi=1):
                variant[knob] = 1
        if _env_int("KOG_HOPPER_INLINE_ATTENTION", 1, lo=0, hi=1):  # no callee saves in the attention (v15)
            variant["INLINE_ATTENTION"] = 1
        self.trace_it0 = _env_int("KOG_HOPPER_TRACE", 0, lo=0) if os.environ.get("KOG_HOPPER_TRACE") else None
        self.d_trace = 0
        if self.trace_it0 is not None:  # timestamps of 4 tokens from this iteration on (trace.py)
            variant["TRACE"] = 1
            self.trace_shape = (4, len(stages), self.nb, 31)  # context.cuh TRACE_W
            self.d_trace = self._alloc(int(np.prod(self.trace_shape)) * 8)
        self.smem = scratch + nslots * slot_bytes
        self.variant = variant
        self._load_kernel(variant)
        occ = check(drv.cuOccupancyMaxActiveBlocksPerMultiprocessor(self.fn, self.nthreads, self.smem), "occupancy")
        if occ < 1:
            raise KogError(f"the nvidia_hopper kernel does not fit on an SM ({self.smem} bytes shared memory)")
        if self.pairs:  # every pair co-resident (a cluster launch cannot promise it otherwise)
            fits = check(drv.cuOccupancyMaxActiveClusters(self.fn, self._launch_config()), "cuOccupancyMaxActiveClusters")
            if 2 * fits < self.nb:
                raise KogError(f"KOG_HOPPER_SPLITK_PAIRS=1: only {fits} clusters of 2 fit at once, the grid "
                               f"needs {self.nb // 2}: unset KOG_HOPPER_SPLITK_PAIRS")
        # run parameters, prompt, stop ids, sampling scratch, host-mapped outputs
        self.d_run = self._alloc(S.NRUN * 8)
        # DYN_POOL's grab counters, [pool][token iteration]: each used once a launch, zeroed before it
        self.pool_words = self.npools * (self.T + S.CONSTS["POOL_PAD"])  # a producer runs up to a ring past the last token
        self.d_pool = self._alloc(self.pool_words * 4) if self.npools else 0
        self.d_prompt = self._alloc(self.T * 4)
        self.d_stops = self._alloc(256 * 4)
        # sampled decoding's memory: the grid's rounds (sample_grid.cuh), or block 0's z and p (sample.cuh)
        self.d_sample_sync = self._alloc(S.sample_grid_bytes()) if self.sample_grid else 0
        self.d_scratch = 0 if self.sample_grid else self._alloc(program.vocab_size * 8)
        self.h_out, self.d_out = self._host_mapped(self.T * 4 + 64)
        self.h_cnt, self.d_cnt = self._host_mapped(64)
        self.h_cancel, self.d_cancel = self._host_mapped(64)
        self.out_view = np.ctypeslib.as_array((ctypes.c_int32 * self.T).from_address(self.h_out))
        self.cnt_view = np.ctypeslib.as_array((ctypes.c_int32 * 4).from_address(self.h_cnt))
        self.cancel_view = np.ctypeslib.as_array((ctypes.c_int32 * 4).from_address(self.h_cancel))
        self.pos = 0
        # the uploads and memsets above ran in the legacy default stream, which the kernel's
        # non-blocking stream does not wait for: finish them before any launch
        check(drv.cuCtxSynchronize(), "cuCtxSynchronize(load)")

    def _splitk_accumulators(self, stages) -> tuple[int, int]:
        """The split-K stages' fixed-point accumulators (schedule.fuse_down_splitk): [2][D] int64 each,
        one allocation the launch zeroes; their addresses go into the fused stages (MV_ACC) and their
        readers (MV_PEND, MV_RES_PEND). Returns (device address, bytes); (0, 0) without such stages."""
        perm = getattr(self, "splitk_perm", False)
        sizes = {st.f["_acc"]: 2 * S.acc_len(int(st.f["MV_ACC_D"]), perm) * 8 for st in stages if "_acc" in st.f}
        if not sizes:
            return 0, 0
        offs, at = {}, 0
        for k in sorted(sizes):
            offs[k], at = at, at + sizes[k]
        base = self._alloc(at)
        check(self.drv.cuMemsetD32(base, 0, at // 4), "cuMemsetD32(split-K accumulators)")
        for st in stages:
            for key, slot in (("_acc", "MV_ACC"), ("_pend_in", "MV_PEND"), ("_pend_res", "MV_RES_PEND"),
                              ("_carry_out", "MV_CARRY_OUT")):
                if key in st.f:
                    st.f[slot] = base + offs[st.f[key]]
        return base, at

    def _ring_slots(self, stages, item_rows, wide=False, max_slots=S.DEFAULT_SLOTS):
        """The ring's slot size, every matvec stage's stream plan for it, and the shared memory the
        stages need before the ring (each matvec stage's `smem` is set here: its x rows, plus the
        chunk weights when its loader combines the attention's chunks, matvec.cuh mv_load_attn).
        KOG_HOPPER_SLOT_KB sets the slot size; by default the shared memory the stages leave is cut
        into as many slots of 30-32 KB as fit (six slots of 31 KB beat five of 32 on bench-2b: perf
        notes, session 4), of which the ring then uses KOG_HOPPER_SLOTS (default 5: session 16; 32,
        36 and 40 KB slots, whose items hold more bytes, were slower on every preset in session 17).
        wide: stages whose rows are short take items of 4 rows a warp (schedule.wide_items; their
        MV_FLAGS get MVF_WIDE). Returns (slot bytes, {stage: plan}, scratch bytes)."""
        mv = [si for si, st in enumerate(stages) if st.type == "matvec"]
        for si in mv:  # x scratch: set by the row dealing alone, not by the slot size
            at = stages[stages[si].f["_attn_stage"]] if "_attn_stage" in stages[si].f else None
            stages[si].smem = S.x_scratch(stages[si], self.nb) + (at.f["AT_H"] * at.f["AT_MAXCH"] * 8 + 16 if at else 0)
            if self.norm_smem and int(stages[si].f["MV_IN_MODE"]) & S.CONSTS["IN_NORM"]:
                stages[si].smem += int(stages[si].f["MV_K"]) * 2  # NORM_SMEM: the norm weights after the x rows
            if stages[si].f.get("_splitk"):  # then the block's SwiGLU values (matvec.cuh run_matvec)
                stages[si].smem += S.splitk_rows(stages[si], self.nb) * 4
                if getattr(self, "pairs", False):  # and room for the partner's partials at the scratch's end (PAIR_RBUF_OFF)
                    stages[si].smem += S.pair_rbuf_bytes(stages[si]) + 16
                if getattr(self, "splitk_bulk", False):  # or for the bulk reduction's source (SPLITK_STAGE_OFF)
                    stages[si].smem += S.splitk_stage_bytes(stages[si]) + 128
                if S.pool_rows(stages[si], self.nb):  # or for the partials of a pooled stage (POOL_ACC_OFF)
                    stages[si].smem += S.pool_partials_bytes(stages[si]) + 16
        scratch = (max([4096] + [st.smem for st in stages]) + 127) // 128 * 128
        slot_bytes = _env_int("KOG_HOPPER_SLOT_KB", 32) * 1024
        if os.environ.get("KOG_HOPPER_SLOT_KB") is None:
            avail = self.max_smem - S.STATIC_SMEM - scratch
            n = avail // slot_bytes + 1
            if n <= S.MAX_SLOTS and avail // n >= 30 * 1024:
                slot_bytes = avail // n // 1024 * 1024
        plans = {}
        for si in mv:
            w = wide and S.wide_items(stages[si], self.nw, slot_bytes)
            flags = int(stages[si].f["MV_FLAGS"]) & ~S.CONSTS["MVF_WIDE"]  # (a second call may turn it off)
            stages[si].f["MV_FLAGS"] = flags | S.CONSTS["MVF_WIDE"] if w else flags
            plans[si] = S.stream_plan(stages[si], self.nb, self.nw, slot_bytes, item_rows, self.kalign, wide=w)[0]
        return slot_bytes, plans, scratch

    def _pack(self, st: S.Stage) -> np.ndarray:
        row = np.zeros(S.NSLOT, np.int64)
        row[0] = S.CONSTS[{"matvec": "ST_MATVEC", "attn": "ST_ATTN", "ew": "ST_EW", "sample": "ST_SAMPLE"}[st.type]]

        def val(v):
            if isinstance(v, tuple) and v[0] == "f":
                return _f32bits(v[1])
            if isinstance(v, str):
                if v.startswith("@"):
                    if v[1:] not in self.ptr:
                        raise KogError(f"nvidia_hopper: tensor {v[1:]} has no device buffer")
                    return self.ptr[v[1:]]
                if v.startswith("cos:") or v.startswith("sin:"):
                    return self.ptr[v]
                return S.CONSTS[v]
            return int(v)

        for k, v in st.f.items():
            if k.startswith("_"):
                continue
            row[S.SLOTS[k]] = val(v)
        for si, sg in enumerate(st.segs):
            base = S.SLOTS["MV_SEG0"] + si * S.SEG_STRIDE
            for k, v in sg.items():
                if k in ("SEG_W", "SEG_W2"):  # the packed copy (MV_PACKED) holds them; W2 marks a pair
                    row[base + S.SLOTS[k]] = 1 if v else 0
                elif k.startswith("SEG_"):
                    row[base + S.SLOTS[k]] = val(v)
        return row

    # ------------------------------------------------------------------ launching
    def _launch(self, prompt: Sequence[int], start_pos: int, max_new: int, params: SamplingParams,
                stop_ids=(), logits_out: int = 0, skip: int = 0):
        if self.stuck:  # a launch would queue behind the kernel that never ended
            raise KogError(f"{self.stuck}; restart the process to use the GPU again")
        drv = self.drv
        P = len(prompt)
        pr = np.asarray(prompt, dtype=np.int32)
        # Everything the launch reads goes in the kernel's own stream, ahead of it: the stream is
        # non-blocking, so a copy or memset in the legacy default stream (cuMemcpyHtoD, cuMemsetD32)
        # is not ordered before the kernel (pageable copies are staged before these calls return).
        st_ = self.stream
        check(drv.cuMemcpyHtoDAsync(self.d_prompt, pr.ctypes.data, pr.nbytes, st_), "cuMemcpyHtoDAsync(prompt)")
        stops = np.asarray(sorted(stop_ids)[:256], dtype=np.int32)
        if stops.size:
            check(drv.cuMemcpyHtoDAsync(self.d_stops, stops.ctypes.data, stops.nbytes, st_), "cuMemcpyHtoDAsync(stops)")
        run = np.zeros(S.NRUN, np.int64)
        R = S.RUN
        run[R["R_PROMPT"]] = self.d_prompt
        run[R["R_PROMPT_LEN"]] = P
        run[R["R_START_POS"]] = start_pos
        run[R["R_MAXNEW"]] = max_new
        run[R["R_STOPIDS"]] = self.d_stops
        run[R["R_NSTOP"]] = stops.size
        run[R["R_TEMP"]] = _f32bits(params.temperature)
        run[R["R_TOPK"]] = int(params.top_k or 0)
        run[R["R_TOPP"]] = _f32bits(params.top_p)
        run[R["R_SEED"]] = np.uint64(int(params.seed) & ((1 << 64) - 1)).view(np.int64)
        run[R["R_LOGITS_ALL"]] = logits_out
        run[R["R_LOGITS_MODE"]] = 1 if logits_out else 0
        run[R["R_HOST_OUT"]] = self.d_out
        run[R["R_HOST_COUNT"]] = self.d_cnt
        run[R["R_CANCEL"]] = self.d_cancel
        run[R["R_CTX"]] = self.T
        run[R["R_SCRATCH"]] = self.d_scratch
        run[R["R_SAMPLE_SYNC"]] = self.d_sample_sync
        if self.d_sample_sync and params.temperature > 0:  # the grid sampler's counter and bins start at zero
            check(drv.cuMemsetD32Async(self.d_sample_sync, 0, S.sample_grid_bytes() // 4, st_), "cuMemsetD32Async(sample sync)")
        run[R["R_SKIP"]] = skip
        run[R["R_STREAM"]] = self.d_stream
        run[R["R_BINFO"]] = self.d_binfo
        run[R["R_POOL"]] = self.d_pool
        if self.d_trace:
            check(drv.cuMemsetD32Async(self.d_trace, 0, int(np.prod(self.trace_shape)) * 2, st_), "cuMemsetD32Async(trace)")
            run[R["R_TRACE"]] = self.d_trace
            run[R["R_TRACE_IT0"]] = self.trace_it0
        check(drv.cuMemcpyHtoDAsync(self.d_run, run.ctypes.data, run.nbytes, st_), "cuMemcpyHtoDAsync(run)")
        check(drv.cuMemsetD32Async(self.d_counters, 0, self.nst, st_), "cuMemsetD32Async(counters)")
        if self.d_pool:
            check(drv.cuMemsetD32Async(self.d_pool, 0, self.pool_words, st_), "cuMemsetD32Async(pool counters)")
        if self.d_acc:  # split-K accumulators: parity 0 starts at zero (each token zeroes the other for the next)
            check(drv.cuMemsetD32Async(self.d_acc, 0, self.acc_bytes // 4, st_), "cuMemsetD32Async(split-K accumulators)")
        for name, numel in self.tagged.items():  # TAG_DOWN: every value's parity bit says "not yet written" to write 0
            check(drv.cuMemsetD32Async(self.ptr[name], 1, numel, st_), "cuMemsetD32Async(tagged)")
        for ptr, words in self.tagged_parts:  # ATT_TAGS: tag 0 is no token's (a token's is its iteration + 1)
            check(drv.cuMemsetD32Async(ptr, 0, words, st_), "cuMemsetD32Async(attention partials)")
        self.cnt_view[0] = 0
        self.cancel_view[0] = 0
        args = ((self.d_desc, self.nst, self.d_counters, self.d_run),
                (ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p))
        if self.pairs:
            check(drv.cuLaunchKernelEx(self._launch_config(), self.fn, args, 0), "cuLaunchKernelEx(clusters of 2)")
        else:
            check(drv.cuLaunchCooperativeKernel(self.fn, self.nb, 1, 1, self.nthreads, 1, 1, self.smem, self.stream, args),
                  "cuLaunchCooperativeKernel")

    def _load_kernel(self, variant: dict) -> None:
        """Compile the kernel for `variant` (cached on disk), load it and allow its shared memory."""
        drv = self.drv
        cubin, log = compile_cubin(source(S.header(variant)))
        self.ptxas = ptxas_report(log)
        self.module = check(drv.cuModuleLoadData(cubin), "cuModuleLoadData")
        self.fn = check(drv.cuModuleGetFunction(self.module, b"kog_decode"), "cuModuleGetFunction")
        check(drv.cuFuncSetAttribute(self.fn, drv.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, self.smem),
              "cuFuncSetAttribute(shared memory)")

    def _launch_config(self):
        """SPLITK_PAIRS's launch: cooperative (every block co-resident, as cuLaunchCooperativeKernel) in
        clusters of 2 blocks."""
        drv = self.drv
        cfg = drv.CUlaunchConfig()
        cfg.gridDimX, cfg.gridDimY, cfg.gridDimZ = self.nb, 1, 1
        cfg.blockDimX, cfg.blockDimY, cfg.blockDimZ = self.nthreads, 1, 1
        cfg.sharedMemBytes, cfg.hStream = self.smem, self.stream
        coop, cluster = drv.CUlaunchAttribute(), drv.CUlaunchAttribute()
        coop.id = drv.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_COOPERATIVE
        coop.value.cooperative = 1
        cluster.id = drv.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
        cluster.value.clusterDim.x, cluster.value.clusterDim.y, cluster.value.clusterDim.z = 2, 1, 1
        cfg.attrs, cfg.numAttrs = [coop, cluster], 2
        return cfg

    def _stuck_error(self, what: str, seconds: float) -> KogError:
        """A kernel that made no progress (a wait that never ends: a bug): remembered, so that no
        later launch queues behind it and close() leaves its memory alone."""
        self.cancel_view[0] = 1  # in case it still polls the flag
        self.stuck = (f"the nvidia_hopper kernel made no progress for {seconds:.0f} s ({what}): a stage waits on "
                      "data that never comes, a bug to report with the model and the KOG_HOPPER_* settings")
        return KogError(self.stuck)

    def _sync(self):
        check(self.drv.cuStreamSynchronize(self.stream), "the nvidia_hopper kernel")

    def _finish(self, positions: int, what: str) -> None:
        """Wait for the launch to end, as _sync, but a kernel still running after 60 s + 50 ms a
        position is an error (_stuck_error), not a hang."""
        limit = _progress_limit(positions)
        t0 = time.monotonic()
        while True:
            r = self.drv.cuStreamQuery(self.stream)[0]
            if r == self.drv.CUresult.CUDA_SUCCESS:
                return
            if r != self.drv.CUresult.CUDA_ERROR_NOT_READY:
                check(r, "the nvidia_hopper kernel")
            if time.monotonic() - t0 > limit:
                raise self._stuck_error(what, limit)
            time.sleep(1e-4)

    # ------------------------------------------------------------------ KernelBackend
    def reset(self) -> None:
        self.pos = 0

    def _logits_run(self, tokens: Sequence[int], start_pos: int) -> np.ndarray:
        V = self.program.vocab_size
        n = len(tokens)
        if start_pos + n > self.T:
            raise ContextLengthExceeded(f"{start_pos + n} positions exceed the context of {self.T}")
        buf = self._alloc(n * V * 4)
        try:
            self._launch(tokens, start_pos, 1, SamplingParams(), logits_out=buf)
            self._finish(start_pos + n, f"logits of {n} positions")
            out = np.empty((n, V), np.float32)
            check(self.drv.cuMemcpyDtoH(out.ctypes.data, buf, out.nbytes), "cuMemcpyDtoH(logits)")
        finally:
            if not self.stuck:  # freeing would wait on the stuck kernel
                self.allocs.remove(buf)
                self.drv.cuMemFree(buf)
        return out

    def step(self, token: int, pos: int) -> np.ndarray:
        if not 0 <= pos < self.T:
            raise IndexError(f"position {pos} outside the context of {self.T}")
        out = self._logits_run([int(token)], pos)[0]
        self.pos = pos + 1
        return out

    def logits(self, token_ids: Sequence[int]) -> np.ndarray:
        self.reset()
        return self._logits_run([int(t) for t in token_ids], 0)

    def generate(self, prompt_ids: Sequence[int], sampler, params: SamplingParams, stop: StopCriteria,
                 cancel: CancelToken | None = None, start_pos: int = 0) -> Iterator[int]:
        # start_pos > 0: the KV cache below it is the previous launches' (the kernel writes each
        # position's K/V row and reads rows <= pos only; its tags and the sampler count from the
        # launch's first iteration, so nothing else depends on where the sequence started)
        self.reset()
        prompt = [int(t) for t in prompt_ids]
        if not prompt:
            raise KogError("generate needs at least one prompt token")
        if start_pos < 0 or start_pos + len(prompt) > self.T:
            raise ContextLengthExceeded(f"prompt of {len(prompt)} tokens from position {start_pos} exceeds the context of {self.T}")
        if stop.max_tokens <= 0 or (cancel is not None and cancel.cancelled):
            return
        self._launch(prompt, int(start_pos), int(stop.max_tokens), params, stop.stop_token_ids)
        seen = 0
        done = False
        # no new token for this long is a kernel that will not finish (an error, not a hang): the
        # first token waits on the prompt's positions (token by token), each later one milliseconds
        limit, last = _progress_limit(len(prompt)), time.monotonic()
        try:
            while True:
                n = int(self.cnt_view[0])
                if n > seen:
                    limit, last = _progress_limit(0), time.monotonic()
                while seen < n:
                    yield int(self.out_view[seen])
                    seen += 1
                if done:
                    break
                if cancel is not None and cancel.cancelled:
                    self.cancel_view[0] = 1
                r = self.drv.cuStreamQuery(self.stream)[0]
                if r == self.drv.CUresult.CUDA_SUCCESS:
                    done = True  # one more pass drains what the kernel wrote last
                    continue
                if r != self.drv.CUresult.CUDA_ERROR_NOT_READY:
                    check(r, "the nvidia_hopper kernel")
                if time.monotonic() - last > limit:
                    raise self._stuck_error(f"{seen} of at most {stop.max_tokens} tokens out", limit)
                time.sleep(20e-6)
        finally:
            if not done:
                self.cancel_view[0] = 1
            if not self.stuck:  # _stuck_error: synchronizing would wait forever
                self._sync()

    def generate_timed(self, prompt_ids, params: SamplingParams, stop: StopCriteria):
        """(tokens, ttft_s, total_s) of one whole request, for the benchmark."""
        t0 = time.perf_counter()
        toks, ttft = [], None
        for t in self.generate(prompt_ids, None, params, stop):
            if ttft is None:
                ttft = time.perf_counter() - t0
            toks.append(t)
        return toks, ttft, time.perf_counter() - t0

    def _time_request(self, prompt, n_tokens, skip=0) -> float:
        drv = self.drv
        e0 = check(drv.cuEventCreate(0)); e1 = check(drv.cuEventCreate(0))
        check(drv.cuEventRecord(e0, self.stream))
        self._launch(prompt, 0, n_tokens, SamplingParams(), skip=skip)
        check(drv.cuEventRecord(e1, self.stream))
        # _finish, not cuEventSynchronize: a kernel whose wait never ends (session 29: a breakdown
        # mask that skipped a tagged value's writer) is an error, not a hung benchmark
        self._finish(len(prompt) + n_tokens, f"a timed request of {n_tokens} tokens, skip mask {skip:#x}")
        return check(drv.cuEventElapsedTime(e0, e1)) / 1e3

    def bench_breakdown(self, prompt_ids, n_tokens, variants: dict | None = None) -> dict:
        """Per-token time (us) of variants that leave stage kinds out (outputs are garbage then).
        The differences say where the time goes; 'sync only' is the skeleton of waits/signals.
        `variants`: {name: skip mask} to time instead of the standard set."""
        prompt = [int(t) for t in prompt_ids]
        steps = len(prompt) + n_tokens - 1
        variants = variants or {"full": 0, "no attention": 1 << 2, "no LM head": 1 << 5, "no layer matvecs": 1 << 1,
                    "no elementwise": 1 << 3, "sync only (no matvec/attention/LM head)": (1 << 1) | (1 << 2) | (1 << 3) | (1 << 5),
                    "stream only (no waits between stages)": 1 << 6,
                    "weights only (no waits, input loads, attention)": (1 << 6) | (1 << 7) | (1 << 2),
                    "weights only, no release fences but the token's last": (1 << 6) | (1 << 7) | (1 << 2) | (1 << 8)}
        out = {}
        for name, mask in variants.items():
            ts = [self._time_request(prompt, n_tokens, mask) for _ in range(3)]
            out[name + " us/token"] = round(float(np.median(ts)) / steps * 1e6, 2)
        return out

    def read_trace(self) -> np.ndarray:
        """The last launch's timestamps [token, stage, block, 31] (context.cuh, TRACE builds)."""
        out = np.zeros(self.trace_shape, np.uint64)
        check(self.drv.cuMemcpyDtoH(out.ctypes.data, self.d_trace, out.nbytes), "cuMemcpyDtoH(trace)")
        return out

    # ------------------------------------------------------------------ facts
    def copy_bandwidth(self, nbytes: int = 2 << 30, reps: int = 10) -> float:
        if self._copy_bw is None:
            drv = self.drv
            a, b = self._alloc(nbytes), self._alloc(nbytes)
            check(drv.cuMemsetD32(a, 1, nbytes // 4), "memset")
            e0 = check(drv.cuEventCreate(0)); e1 = check(drv.cuEventCreate(0))
            check(drv.cuMemcpyDtoDAsync(b, a, nbytes, self.stream))
            times = []
            for _ in range(reps):
                check(drv.cuEventRecord(e0, self.stream))
                check(drv.cuMemcpyDtoDAsync(b, a, nbytes, self.stream))
                check(drv.cuEventRecord(e1, self.stream))
                check(drv.cuEventSynchronize(e1))
                times.append(check(drv.cuEventElapsedTime(e0, e1)) / 1e3)
            for p in (a, b):
                self.allocs.remove(p)
                drv.cuMemFree(p)
            self._copy_bw = 2 * nbytes / float(np.median(times)) / 1e12
        return self._copy_bw

    def describe(self) -> dict:
        drv = self.drv
        name = check(drv.cuDeviceGetName(128, self.dev)).split(b"\0")[0].decode()
        d = {"backend": self.name, "device": name, "sm_count": self.sms, "blocks": self.nb,
             "copy_bandwidth_TBps": round(self.copy_bandwidth(), 3)}
        if self.program is not None:
            d.update(stages=self.nst, shared_memory=self.smem, variant=getattr(self, "variant", {}), **{f"ptxas_{k}": v for k, v in self.ptxas.items()})
        return d

    def stage_summary(self) -> list[str]:
        out = []
        for st in self.stages:
            if st.type == "matvec":
                out.append(f"matvec[{st.label}] K={st.f['MV_K']} flags={st.f['MV_FLAGS']}")
            else:
                out.append(f"{st.type}[{st.label}]")
        return out

    def close(self) -> None:
        if self.stuck:  # freeing would wait on the kernel; the process's exit frees it
            self.allocs = []
            return
        for p in self.allocs:
            self.drv.cuMemFree(p)
        self.allocs = []
