"""Lower a DecodeProgram into the monokernel's stage list (pure Python + numpy, no CUDA).

A *stage* is a group of program ops that the persistent kernel runs between two completion
counters. Fusions (all checked, otherwise the op becomes its own stage):
- embed / rmsnorm(ungrouped) feeding matvecs: folded into the matvec stage's input loader
  (every block recomputes the norm of a <=16k-float row: cheaper than a sync);
- consecutive matvecs reading the same input: one stage with up to 4 segments (q, k, v);
- matvec(gate) + matvec(up) + swiglu: one paired segment writing silu(g) * u directly;
- rope(q) + rope(k) + kv_append + attention: one attention stage (split over lane x kv head x
  chunk of positions; the chunk owning `pos` writes the new K/V to the cache).
The result is a list of dicts with symbolic tensor references ("@name"); backend.py resolves
them to device pointers and packs int64 descriptor rows.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from kog_core.errors import CapabilityError
from kog_core.program import DecodeProgram

NT = 384        # most consumer threads per block (12 warps); the block has one more warp, the weight producer
NW = NT // 32
NW_DEFAULT = 10  # 10 consumer warps + the producer + the signal warp: 12 warps per SM, so ptxas may use 168 registers (not 128)
NSLOT = 96
SEG_STRIDE = 12
MAX_SEGS = 4

# ---- descriptor slots (shared with the .cu through a generated header) ----
SLOTS = dict(
    S_TYPE=0,
    # matvec
    MV_K=2, MV_FLAGS=4, MV_IN_MODE=5, MV_IN=6, MV_NORM_W=7, MV_NORM_WL=8,
    MV_EPS=9, MV_EMB_TABLE=10, MV_EMB_OUT=11, MV_L=12, MV_NSEG=13, MV_ARGMAX=14, MV_OUT_STRIDE=15, MV_SEG0=16,
    MV_PACKED=65, MV_ATTN=66, MV_TAG=67,
    MV_ACC=68, MV_PEND=69, MV_RES_PEND=70, MV_ACC_D=71,  # split-K down_proj (fuse_down_splitk)
    MV_CARRY_OUT=72,  # fuse_down_splitk(carry=True): the accumulator x's writer also fills
    MV_OTAG=73,  # the parity a stage writes its outputs with (TAG_X: MV_TAG is then its input's)
    SEG_W=0, SEG_WL=1, SEG_N=2, SEG_OUT=3, SEG_OUTL=4, SEG_BIAS=5, SEG_BIASL=6, SEG_RES=7,
    SEG_RESL=8, SEG_W2=9, SEG_LRX=10, SEG_LRD=11,
    # attention
    AT_L=1, AT_H=2, AT_HKV=3, AT_HD=4, AT_T=5, AT_WINDOW=6, AT_MAXCH=7, AT_SCALE=8, AT_Q=9,
    AT_KC=10, AT_VC=11, AT_OUT=12, AT_ROPE_Q=13, AT_ROPE_K=14, AT_COS=15, AT_SIN=16, AT_KNEW=17,
    AT_VNEW=18, AT_PART_O=19, AT_PART_ML=20, AT_TICKET=21, AT_TARGET=22, AT_NOCOMBINE=23, AT_TAG=24, AT_OTAG=25,
    # elementwise
    EW_OP=1, EW_L=2, EW_D=3, EW_A=4, EW_B=5, EW_C=6, EW_OUT=7, EW_OUT2=8, EW_GROUP=9, EW_WL=10,
    EW_F0=11, EW_HD=12, EW_STYLE=13, EW_T=14, EW_LIN=15,
    EW_OTAG=16,  # TAG_X_EW: the parity an elementwise lane_residual writes x with (0: untagged)
    # sample
    SM_V=1, SM_LOGITS=2, SM_ARGMAX=3, SM_NPART=4,
)
CONSTS = dict(
    NSLOT=NSLOT, SEG_STRIDE=SEG_STRIDE,
    ST_MATVEC=1, ST_ATTN=2, ST_EW=3, ST_SAMPLE=4,
    POOL_PAD=16,  # DYN_POOL: grab counters a pool beyond the context's positions (a producer runs up to a ring ahead)
    ATT_SUB=32,  # attention: positions per shared-memory K/V sub-chunk
    SG_ROUNDS=24,  # the grid sampler's rounds a token at most (sample_grid.cuh: 3 selects of 8 passes)
    SAMPLE_CAP=2048,  # block 0's sampler (sample.cuh radix_select): candidates listed in shared memory once that few
    IN_EMBED=1, IN_NORM=2, IN_ATTN=4,
    MVF_LOGITS=1, MVF_SKIP_PROMPT=2, MVF_ARGMAX=4, MVF_TAG_OUT=8, MVF_TAG_IN=16, MVF_WIDE=32, MVF_SPLITK=64, MVF_CARRY=128, MVF_POOL=256, MVF_COUNT_IN=512, MVF_TAG_LRX=1024,
    OP_EMBED=1, OP_RMSNORM=2, OP_ROPE=3, OP_KVAPPEND=4, OP_SWIGLU=5, OP_ADD=6, OP_COPY=7,
    OP_LANE_SUM=8, OP_LANE_MEAN=9, OP_LANE_RESIDUAL=10,
)
# run-parameter slots (int64 array in device memory)
RUN = dict(
    R_PROMPT=0, R_PROMPT_LEN=1, R_START_POS=2, R_MAXNEW=3, R_STOPIDS=4, R_NSTOP=5, R_TEMP=6,
    R_TOPK=7, R_TOPP=8, R_SEED=9, R_LOGITS_ALL=10, R_LOGITS_MODE=11, R_HOST_OUT=12,
    R_HOST_COUNT=13, R_CANCEL=14, R_CTX=15, R_SCRATCH=16, R_TOK=17, R_STOP=18, R_SKIP=19,
    R_TRACE=20, R_TRACE_IT0=21,  # trace builds only (trace.py)
    R_STREAM=22, R_BINFO=23,     # the producers' copy lists and the blocks' stage info (stream_list)
    R_SAMPLE_SYNC=24,            # SAMPLE_GRID: the rounds' arrival counter and global bins (sample_grid_bytes)
    R_POOL=25,                   # DYN_POOL: the pools' grab counters, [pool][token iteration] (stream_list)
)
NRUN = 26

SUPPORTED_OPS = frozenset({"embed", "rmsnorm", "matvec", "rope", "kv_append", "attention", "swiglu",
                           "add", "copy", "lane_mean", "lane_sum", "collective", "lane_residual",
                           "sample"})


def header(variant: dict | None = None) -> str:
    """The #defines shared with the kernel (kernels/decode.cu and its .cuh files); `variant` sets the ring (NSLOTS, SLOT_BYTES, RING_OFF)."""
    variant = dict(variant or {})
    variant.setdefault("NT", NT)
    lines = [f"#define {k} {v}" for d in (SLOTS, CONSTS, RUN) for k, v in d.items()]
    lines += [f"#define {k} {v}" for k, v in variant.items() if not k.startswith("_")]
    return "\n".join(lines) + "\n"


@dataclass
class Stage:
    type: str                      # matvec | attn | ew | sample
    f: dict = field(default_factory=dict)
    segs: list = field(default_factory=list)
    ops: list = field(default_factory=list)   # program op indices it covers
    smem: int = 0                  # dynamic shared memory bytes it needs
    label: str = ""


def _readers(ops, i, name):
    """Indices j > i of ops reading `name` before an op (j > i) overwrites it without reading."""
    out = []
    for j in range(i + 1, len(ops)):
        op = ops[j]
        if name in op.inputs:
            out.append(j)
        if name in op.outputs and name not in op.inputs:
            break
        if name in op.outputs:
            break
    return out


def _writes_between(ops, i, j, name):
    return any(name in ops[k].outputs for k in range(i + 1, j))


def lower(program: DecodeProgram, nb: int, nt: int = NT, kv_bufs: int = 2,
          fuse_lane_residual: bool = False) -> list[Stage]:
    """The program's ops grouped into stages (docs/nvidia-hopper.md "From decode program to
    stages"). fuse_lane_residual: a Laneformer "delayed" lane_residual right after the matvec that
    writes its fresh partial runs at the end of that matvec's stage (_fuse_lane_residual)."""
    P = program
    ops = P.ops
    T = P.tensors
    L = P.lanes
    unsupported = sorted(P.op_kinds() - SUPPORTED_OPS)
    if unsupported:
        raise CapabilityError(f"nvidia_hopper does not implement ops {', '.join(unsupported)}")
    stages: list[Stage] = []
    pending: dict[str, dict] = {}   # tensor -> loader (embed/norm) not materialised
    i = 0

    def shape_row(name):
        s = T[name].shape
        return s[-1]

    def loader_for(x):
        if x in pending:
            return dict(pending[x])
        return dict(mode=0, inp="@" + x, K=shape_row(x))

    def flush_pending(name):
        """Materialise a pending tensor as its own stage (it is needed by a non-matvec op)."""
        ld = pending.pop(name)
        if ld["mode"] & 1:
            st = Stage("ew", dict(EW_OP="OP_EMBED", EW_L=L, EW_D=ld["K"], EW_A=ld["table"], EW_OUT="@" + ld["emb_name"]),
                       label="embed")
            stages.append(st)
        if ld["mode"] & 2:
            src = ld["emb_name"] if ld["mode"] & 1 else ld["inp"][1:]
            st = Stage("ew", dict(EW_OP="OP_RMSNORM", EW_L=T[src].shape[0] if len(T[src].shape) > 1 else 1,
                                  EW_D=ld["K"], EW_A="@" + src, EW_B=ld["norm_w"], EW_OUT="@" + name,
                                  EW_GROUP=ld["K"], EW_WL=ld["norm_wl"], EW_F0=("f", ld["eps"])), label="rmsnorm")
            stages.append(st)

    while i < len(ops):
        op = ops[i]
        k = op.kind
        if k == "embed":
            table, out = op.inputs[0], op.outputs[0]
            pending[out] = dict(mode=1, table="@" + table, emb_name=out, K=shape_row(out), inp=None)
            # the embedding must still be written (residual stream): done by block 0 in the fused stage
            i += 1
            continue
        if k == "rmsnorm" and not (op.attr("group") and op.attr("group") != shape_row(op.inputs[0])):
            x, w, out = op.inputs[0], op.inputs[1], op.outputs[0]
            rd = _readers(ops, i, out)
            wspec = T[w]
            if rd and all(ops[j].kind == "matvec" and ops[j].inputs[0] == out and out not in ops[j].inputs[1:]
                          and not _writes_between(ops, i, j, x) for j in rd) and x != out:
                base = pending.pop(x, None) if x in pending else None
                ld = dict(mode=2, inp="@" + x, K=shape_row(x), norm_w="@" + w,
                          norm_wl=(shape_row(x) if len(wspec.shape) == 2 else 0), eps=float(op.attr("eps")))
                if base is not None:
                    if base["mode"] != 1:
                        pending[x] = base
                        flush_pending(x)
                    else:
                        ld.update(mode=3, table=base["table"], emb_name=base["emb_name"])
                pending[out] = ld
                i += 1
                continue
        # any op reading a pending tensor other than a matvec input forces it out
        for t in op.inputs:
            if t in pending and not (k == "matvec" and op.inputs[0] == t):
                flush_pending(t)
        if k == "matvec":
            x = op.inputs[0]
            ld = loader_for(x)
            group = [i]
            j = i + 1
            written = set(op.outputs)
            while j < len(ops) and ops[j].kind == "matvec" and ops[j].inputs[0] == x and len(group) < MAX_SEGS:
                if any(t in written for t in ops[j].inputs) or ops[j].outputs[0] == x:
                    break
                group.append(j)
                written |= set(ops[j].outputs)
                j += 1
            segs = []
            consumed = set(group)
            gi = 0
            nxt = j
            while gi < len(group):
                a = ops[group[gi]]
                # gate/up/swiglu pairing: a, b adjacent in group, swiglu(a.out, b.out) right after group
                if gi + 1 < len(group) and nxt < len(ops) and ops[nxt].kind == "swiglu":
                    b = ops[group[gi + 1]]
                    sw = ops[nxt]
                    ga, gb = a.outputs[0], b.outputs[0]
                    if (sw.inputs[0] == ga and sw.inputs[1] == gb and not a.attr("has_bias") and not b.attr("has_bias")
                            and not a.attr("has_residual") and not b.attr("has_residual")
                            and _readers(ops, nxt - 0, ga) == [] and _readers(ops, nxt, gb) == []
                            and _readers(ops, group[gi + 1], ga) == [nxt] and T[a.inputs[1]].shape == T[b.inputs[1]].shape):
                        segs.append(_seg(P, a, L, w2=b.inputs[1], out=sw.outputs[0]))
                        consumed.add(nxt)
                        gi += 2
                        continue
                segs.append(_seg(P, a, L))
                gi += 1
            K = ld["K"]
            if K % 8:
                raise CapabilityError(f"nvidia_hopper needs matvec inner sizes that are multiples of 8 (got {K})")
            f = dict(MV_K=K, MV_IN_MODE=ld["mode"], MV_IN=ld.get("inp") or 0, MV_L=L,
                     MV_NORM_W=ld.get("norm_w", 0), MV_NORM_WL=ld.get("norm_wl", 0),
                     MV_EPS=("f", ld.get("eps", 0.0)), MV_EMB_TABLE=ld.get("table", 0),
                     MV_EMB_OUT=("@" + ld["emb_name"]) if ld["mode"] & 1 else 0, MV_FLAGS=0)
            st = Stage("matvec", f, segs, ops=sorted(consumed),
                       label="+".join(ops[g].inputs[1].split(".")[-2] if "." in ops[g].inputs[1] else ops[g].inputs[1] for g in group))
            stages.append(st)
            # embedding written by this stage: no longer pending
            if ld["mode"] & 1:
                pending.pop(ld["emb_name"], None)
            if fuse_lane_residual:
                consumed |= _fuse_lane_residual(P, ops, max(consumed) + 1, segs, pending)
                st.ops = sorted(consumed)
            i = max(consumed) + 1
            continue
        if k in ("rope", "kv_append", "attention"):
            fused = _match_attention(ops, i, T)
            if fused is not None:
                stages.append(_attn_stage(P, ops, fused, nb, nt, kv_bufs))
                i = fused[-1] + 1
                continue
        if k == "attention":
            stages.append(_attn_stage(P, ops, [i], nb, nt, kv_bufs))
            i += 1
            continue
        if k == "sample":
            stages.append(Stage("sample", dict(SM_V=P.vocab_size, SM_LOGITS="@" + op.inputs[0]), ops=[i], label="sample"))
            i += 1
            continue
        if k == "collective":
            i += 1  # one GPU holds every lane: nothing to do
            continue
        stages.append(_ew_stage(P, op, i))
        i += 1
    if not any(sg["out_name"] == P.logits for st in stages if st.type == "matvec" for sg in st.segs):
        # logits mode and the in-kernel argmax read the logits where a matvec writes them
        raise CapabilityError("nvidia_hopper needs the logits written by a matvec; this head (e.g. Laneformer's "
                              "vocab_parallel) is not supported yet: use --backend reference")
    _finish(P, stages)
    return stages


def _fuse_lane_residual(P, ops, j, segs, pending) -> set:
    """Laneformer's DTP residual at the end of the matvec stage that makes its fresh partial:
    ops j.. may be `collective`s of a segment's output (no-ops on one GPU), then a `lane_residual`
    in "delayed" mode, x[l] += fresh[l] + sum_{j != l} delayed[j], whose fresh is a plain
    (unpaired) segment's output with x's shape and x is not pending. Each block then also updates
    x (SEG_LRX) from the delayed partials (SEG_LRD) for its own rows of fresh after its last item
    (matvec.cuh lane_residual_tail; the rows: lane_residual_rows): the same additions in the same
    order as the elementwise stage, one stage boundary less. Returns the op indices taken (empty: none)."""
    outs = {sg["out_name"]: sg for sg in segs if not sg["SEG_W2"] and not sg["SEG_BIAS"] and not sg["SEG_RES"]}
    k = j
    while k < len(ops) and ops[k].kind == "collective" and ops[k].inputs[0] in outs:
        k += 1
    if k >= len(ops) or ops[k].kind != "lane_residual" or ops[k].attr("mode") != "delayed":
        return set()
    x, fresh, delayed = ops[k].inputs[0], ops[k].inputs[1], ops[k].inputs[2]
    T = P.tensors
    if fresh not in outs or x in pending or x in outs or T[x].shape != T[fresh].shape or T[delayed].shape != T[x].shape:
        return set()
    outs[fresh].update(SEG_LRX="@" + x, SEG_LRD="@" + delayed)
    return set(range(j, k + 1))


def _seg(P, op, L, w2=None, out=None):
    W = P.tensors[op.inputs[1]]
    if len(W.shape) == 3:
        _, N, K = W.shape
        wl = N * K
    else:
        N, K = W.shape
        wl = 0
    extra = list(op.inputs[2:])
    bias = extra.pop(0) if op.attr("has_bias") else None
    res = extra.pop(0) if op.attr("has_residual") else None
    o = out or op.outputs[0]
    ol = P.tensors[o].shape[-1] if len(P.tensors[o].shape) > 1 else 0
    d = dict(SEG_W="@" + op.inputs[1], SEG_WL=wl, SEG_N=N, SEG_OUT="@" + o, SEG_OUTL=ol,
             SEG_BIAS=("@" + bias) if bias else 0, SEG_BIASL=(N if bias and len(P.tensors[bias].shape) == 2 else 0),
             SEG_RES=("@" + res) if res else 0, SEG_RESL=(P.tensors[res].shape[-1] if res else 0),
             SEG_W2=("@" + w2) if w2 else 0, SEG_LRX=0, SEG_LRD=0, out_name=o)
    # lanes this segment computes: one slice per lane for 3-D weights, else the input's lanes
    xs = P.tensors[op.inputs[0]].shape
    d["lanes"] = W.shape[0] if len(W.shape) == 3 else (xs[0] if len(xs) == 2 else 1)
    return d


def _match_attention(ops, i, T):
    """rope(q), rope(k), kv_append(k, v), attention(q) in a row (the ropes optional)."""
    j = i
    ropes = []
    while j < len(ops) and ops[j].kind == "rope" and len(ropes) < 2:
        ropes.append(j)
        j += 1
    if j >= len(ops) or ops[j].kind != "kv_append":
        return None
    kva = j
    if j + 1 >= len(ops) or ops[j + 1].kind != "attention":
        return None
    att = j + 1
    A, KV = ops[att], ops[kva]
    q, k = A.inputs[0], KV.inputs[0]
    if KV.inputs[2] != A.inputs[1] or KV.inputs[3] != A.inputs[2]:
        return None
    for r in ropes:
        R = ops[r]
        if R.inputs[0] != R.outputs[0] or R.inputs[0] not in (q, k):
            return None
        if R.attr("head_dim") != A.attr("head_dim"):
            return None
    # the raw q / k / v must not be read by anything after the attention (we never write them roped)
    for t in (q, k, KV.inputs[1]):
        if any(j2 > att for j2 in _readers(ops, att, t)):
            return None
    return ropes + [kva, att]


def _attn_stage(P, ops, idxs, nb, nt, kv_bufs=2):
    A = ops[idxs[-1]]
    T = P.tensors
    kshape = T[A.inputs[1]].shape  # [L, Hkv, T, hd]
    L, Hkv, Tctx, hd = kshape
    H = A.attr("n_heads")
    G = H // Hkv
    if hd % 8 or hd > 256 or G > 8 or H % Hkv:
        raise CapabilityError("nvidia_hopper attention needs head_dim % 8 == 0, <= 256 and <= 8 query heads per kv head")
    if T[A.inputs[1]].dtype not in ("bf16", "f32"):
        raise CapabilityError("unsupported KV dtype")
    f = dict(AT_L=L, AT_H=H, AT_HKV=Hkv, AT_HD=hd, AT_T=Tctx, AT_WINDOW=A.attr("window") or 0,
             AT_SCALE=("f", float(A.attr("scale"))), AT_Q="@" + A.inputs[0], AT_KC="@" + A.inputs[1],
             AT_VC="@" + A.inputs[2], AT_OUT="@" + A.outputs[0], AT_ROPE_Q=0, AT_ROPE_K=0, AT_COS=0, AT_SIN=0,
             AT_KNEW=0, AT_VNEW=0, AT_TARGET=nb)
    maxch = max(-(-Tctx // 512), max(1, nb // (L * Hkv)))
    f["AT_MAXCH"] = maxch
    if maxch * G * 2 > nt * 8:
        raise CapabilityError(f"nvidia_hopper attention: context {Tctx} with {G} query heads per kv head is too long for one chunk table")
    scratch = dict(part_o=L * H * maxch * hd, part_ml=L * H * maxch * 2, ticket=L * Hkv)
    if len(idxs) > 1:
        KV = ops[idxs[-2]]
        q, k = A.inputs[0], KV.inputs[0]
        f["AT_KNEW"], f["AT_VNEW"] = "@" + k, "@" + KV.inputs[1]
        for r in idxs[:-2]:
            R = ops[r]
            style = 1 if R.attr("style") == "half" else 2
            f["AT_COS"], f["AT_SIN"] = "cos:" + R.inputs[1], "sin:" + R.inputs[1]
            if R.inputs[0] == q:
                f["AT_ROPE_Q"] = style
            else:
                f["AT_ROPE_K"] = style
    st = Stage("attn", f, ops=list(idxs), label="attention")
    st.f["_scratch"] = scratch
    # attention.cuh run_attention: q and running output [G][hd], new k and v [hd], scores [G][ATT_SUB],
    # P.V partials (nt * 8 floats), kv_bufs buffers (attention.cuh KV_BUFS) of K and V sub-chunks [ATT_SUB][hd + 8] bf16
    sub = CONSTS["ATT_SUB"]
    st.smem = (2 * G * hd + 2 * hd + G * sub) * 4 + nt * 8 * 4 + kv_bufs * 2 * sub * (hd + 8) * 2 + 64
    return st


def sample_radix_smem() -> int:
    """Shared scratch of the sample stage's block-0 sampler (sample.cuh radix_select): 256 bins in
    32-bit words (mass as two, count; sample.cuh Bins), 4 u64 of state, the candidate list."""
    return 256 * 3 * 4 + 4 * 8 + CONSTS["SAMPLE_CAP"] * 4


DEFER_NORM_LANES = 16  # matvec.cuh DEFER_NORM_LANES: input rows of one block whose sums of squares it keeps
SAMPLE_GRID_MAX_EPT = 8  # candidates per thread the grid sampler holds in registers at most


def sample_grid_ept(vocab: int, nb: int, nt: int) -> int:
    """Candidates per thread of sample_grid.cuh: each block's slice of the vocabulary over its threads."""
    per_block = -(-vocab // nb)  # ceilings: the largest slice, then its share per thread
    return -(-per_block // nt)


def sample_grid_smem() -> int:
    """Shared scratch of sample_grid.cuh: two sets (by round parity) of 256 bins in 32-bit words
    (mass as two, count, the keys' XOR as two; sample.cuh Bins)."""
    return 2 * 256 * 5 * 4


def sample_grid_bytes() -> int:
    """Global memory of sample_grid.cuh: the arrival counter's 128-byte line, then two sets (a token's
    parity) of SG_ROUNDS rounds of 5 KB bins (SgRound)."""
    return 128 + 2 * CONSTS["SG_ROUNDS"] * 256 * (8 + 8 + 4)


def allow_attention_chunks(st: Stage, maxch: int, nt: int) -> None:
    """Let an attention stage split a query's positions into up to `maxch` chunks (its partials
    scratch grows to match); never fewer than lowering chose."""
    f = st.f
    maxch = max(maxch, f["AT_MAXCH"])
    G = f["AT_H"] // f["AT_HKV"]
    if maxch * G * 2 > nt * 8:
        raise CapabilityError(f"nvidia_hopper attention: {maxch} chunks with {G} query heads per kv head do not fit "
                              f"one chunk table (lower KOG_HOPPER_ATT_TILES)")
    f["AT_MAXCH"] = maxch
    sc = f["_scratch"]
    sc["part_o"] = f["AT_L"] * f["AT_H"] * maxch * f["AT_HD"]
    sc["part_ml"] = f["AT_L"] * f["AT_H"] * maxch * 2


def tag_pair_outputs(P, stages) -> list[str]:
    """matvec.cuh TAG_DOWN: a gate/up stage whose SwiGLU output only the next stage reads, as its
    plain input row (down_proj), writes it with a parity in each value's lowest mantissa bit
    (MVF_TAG_OUT); the reader (MVF_TAG_IN) waits on the stage before the pair instead and takes the
    row once every value carries the parity of this write. Consecutive writes of one buffer (layers
    share it) alternate parity: write k of n a token, token t: (t n + k) & 1, from MV_TAG = k | n << 16
    on both stages. Returns the tagged tensors (the backend marks them stale before each launch)."""
    pairs = []
    for i in range(2, len(stages) - 1):
        st, nx = stages[i], stages[i + 1]
        if st.type != "matvec" or nx.type != "matvec" or len(st.segs) != 1 or not st.segs[0]["SEG_W2"]:
            continue
        h = st.segs[0]["out_name"]
        if nx.f["MV_IN"] != "@" + h or nx.f["MV_IN_MODE"] != 0:
            continue
        writes = [j for j, op in enumerate(P.ops) if h in op.outputs]
        last = max(st.ops)  # the SwiGLU op, which writes h
        readers = _readers(P.ops, last, h)
        if last not in writes or not readers or not set(readers) <= set(nx.ops):
            continue
        pairs.append((st, nx, h, len(writes)))
    tagged = sorted({h for _, _, h, _ in pairs})
    for h in tagged:
        mine = [(st, nx, n) for st, nx, hh, n in pairs if hh == h]
        if len(mine) != mine[0][2]:  # every write of the buffer must be a tagged one, or parities would not alternate
            tagged.remove(h)
            continue
        for k, (st, nx, n) in enumerate(mine):
            st.f["MV_FLAGS"] |= CONSTS["MVF_TAG_OUT"]
            nx.f["MV_FLAGS"] |= CONSTS["MVF_TAG_IN"]
            st.f["MV_TAG"] = st.f["MV_OTAG"] = nx.f["MV_TAG"] = k | (n << 16)
    return tagged


def tag_attention_inputs(P, stages) -> list[str]:
    """KOG_HOPPER_TAG_QKV (attention.cuh TAG_QKV): readiness in the data for the attention's input.
    A q/k/v matvec stage that writes exactly the query, new key and new value the next stage (a
    fused attention) reads stores every output with a parity in its lowest mantissa bit
    (MVF_TAG_OUT), and the attention (AT_TAG) does not wait on the q/k/v stage's count: each tile
    re-reads its values until they carry this write's parity. That takes the q/k/v stage's release
    (its fence waits ~1.5 us for the ring's copies in flight), the signal and the counter's round
    trip off the attention's chain, a wait longer than the ring. Consecutive writes of a buffer
    alternate parity, write k of n a token: (t n + k) & 1 from k | n << 16 in MV_TAG and AT_TAG.
    Everything else the attention reads is ordered as before: its block finished the q/k/v stage,
    which waited on the previous layer's last stage. Returns the tagged tensors (the backend marks
    them stale before each launch)."""
    found = []
    for i in range(1, len(stages)):
        st, pv = stages[i], stages[i - 1]
        if st.type != "attn" or pv.type != "matvec" or not st.f.get("AT_KNEW"):
            continue
        names = {st.f["AT_Q"][1:], st.f["AT_KNEW"][1:], st.f["AT_VNEW"][1:]}
        if {sg["out_name"] for sg in pv.segs} != names or len(pv.segs) != 3 or any(sg["SEG_W2"] for sg in pv.segs):
            continue
        if any(sg.get("SEG_RES") for sg in pv.segs):
            continue
        found.append((pv, st, tuple(sorted(names))))
    if not found:
        return []
    bufs = found[0][2]
    if any(f[2] != bufs for f in found):  # layers share the buffers (or parities would need one count each)
        return []
    # the attention stages' own ops (RoPE in place, fused: they rotate in shared memory) write nothing back
    fused = {j for st in stages if st.type == "attn" for j in st.ops}
    writes = {len([j for j, op in enumerate(P.ops) if name in op.outputs and j not in fused]) for name in bufs}
    if writes != {len(found)}:  # every write of each buffer must be a tagged one
        return []
    n = len(found)
    for k, (pv, st, _) in enumerate(found):
        pv.f["MV_FLAGS"] |= CONSTS["MVF_TAG_OUT"]
        pv.f["MV_TAG"] = pv.f["MV_OTAG"] = st.f["AT_TAG"] = k | (n << 16)
    return list(bufs)


def tag_attention_outputs(P, stages) -> list[str]:
    """KOG_HOPPER_TAG_OPROJ (attention.cuh / matvec.cuh TAG_OPROJ): readiness in the data for
    o_proj's input. An attention stage that combines its chunks itself and whose output only the
    next stage (a matvec taking it as its plain input row: o_proj) reads stores every output value
    with this write's parity (AT_OTAG); o_proj (MVF_TAG_IN, as TAG_DOWN's down_proj) waits on the
    stage before the attention instead of the attention itself and re-reads its row until every
    value carries the parity. That takes the attention's release (signal warp, fence) and o_proj's
    wait off the attention's chain. What o_proj writes (x) the q/k/v stage's loaders read: the wait
    on the q/k/v stage's count orders that; the stage after o_proj waits on o_proj's count, and a
    block finishes o_proj after its own attention stage, so the linear chain holds from there on.
    Returns the tagged tensors (the backend marks them stale before each launch)."""
    found = []
    for i in range(1, len(stages) - 1):
        at, nx = stages[i], stages[i + 1]
        if at.type != "attn" or nx.type != "matvec" or at.f.get("AT_NOCOMBINE"):
            continue
        out = at.f["AT_OUT"][1:]
        if nx.f.get("MV_IN") != "@" + out or nx.f.get("MV_IN_MODE") != 0:
            continue
        writer = max(j for j in at.ops if out in P.ops[j].outputs)
        readers = _readers(P.ops, writer, out)
        if not readers or not set(readers) <= set(nx.ops):
            continue
        found.append((at, nx, out))
    if not found or len({o for *_, o in found}) != 1:
        return []
    out = found[0][2]
    n = len([j for j, op in enumerate(P.ops) if out in op.outputs])
    if n != len(found):  # every write of the buffer must be a tagged one, or parities would not alternate
        return []
    for k, (at, nx, _) in enumerate(found):
        nx.f["MV_FLAGS"] |= CONSTS["MVF_TAG_IN"]
        nx.f["MV_TAG"] = at.f["AT_OTAG"] = k | (n << 16)
    return [out]


def stage_waits_on(stages, j: int) -> int | None:
    """The stage whose completion count stage j waits on (decode.cu): j - 1 (-1: the previous
    token's last), j - 2 for a matvec taking a tagged input row (MVF_TAG_IN) or polling a counted
    split-K accumulator (MVF_COUNT_IN), none for an attention that polls its tagged q / k / v (AT_TAG)."""
    st = stages[j]
    if st.type == "matvec" and st.f.get("MV_FLAGS", 0) & (CONSTS["MVF_TAG_IN"] | CONSTS["MVF_COUNT_IN"]):
        return j - 2
    if st.type == "attn" and st.f.get("AT_TAG"):
        return None
    return j - 1


def tag_residual_outputs(P, stages, lanes: bool = False, ew: bool = False) -> list[str]:
    """KOG_HOPPER_TAG_X (matvec.cuh TAG_X): readiness in the data for the residual stream x between
    a matvec that adds into it in place (o_proj: x += W_o a) and the normed matvec right after it
    (gate/up, or the split-K MLP stage). The writer stores x with this write's parity (MVF_TAG_OUT,
    MV_OTAG = write k | writes a token n << 16); the reader (MVF_TAG_IN, MV_TAG) waits on the stage
    two back instead of the writer and polls each value of its row until it carries the parity.

    A reader is tagged only where that is safe:
    - x's previous write (k - 1) is a tagged write of this token (a value of write k - 2 would carry
      write k's parity; the embedding's write is not tagged, so layer 0's reader keeps its wait);
    - the completion of the stage it waits on implies write k - 1 is complete in every block: some
      stage j after write k - 1's writer, up to that stage, waits on a count at or after the writer
      (a block finishes its stages in order, so all blocks counted there finished that write);
    - the writer does not also write a split-K accumulator that the reader adds into
      (SPLITK_CARRY's carry-out), and the writer writes all of x (one unlaned segment of K rows).
    Write k counts the writes that reach x itself: a split-K stage's fused down_proj is not one.
    Writers of a write whose reader was not tagged are still tagged (the bit costs nothing), so the
    next reader can rely on their parity. Call after the other tag_* passes (it reads their waits).
    Returns the tagged tensors (not marked stale before a launch: no tagged read depends on a
    value from before it).

    lanes (KOG_HOPPER_TAG_X_LANES, an experiment): also Laneformer's x [L, D], written by the fused
    DTP residual's tail pass of a matvec stage (SEG_LRX; the stage gets MVF_TAG_LRX, its tail stores
    the parity, its items' outputs stay untagged) and read by the normed matvec after it over all
    lanes. Where each layer has two such boundaries (o_proj -> gate/up, down_proj -> q/k/v) the
    reader of one is the only stage between the two writes, so a second way to know a write is
    complete counts too: a stage in between that read that write as its whole input row (over all
    lanes, every block its lanes' full rows), waited for or polled, has seen it complete in every
    block once it is counted.

    ew (KOG_HOPPER_TAG_X_EW, on with lanes since v34): also the elementwise lane_residual stages
    that write x whole (Laneformer's early, all-reduce layers): the stage stores x with its write's
    parity (EW_OTAG) and the normed matvec after it polls, under the same rules. Their parity also
    lets the first fused write's reader poll (its previous write is then a tagged one)."""
    found = []
    for i in range(1, len(stages)):
        wr, rd = stages[i - 1], stages[i]
        if rd.type != "matvec":
            continue
        if wr.type == "ew" and lanes and ew:  # an elementwise lane_residual writing x whole
            if wr.f.get("EW_OP") != "OP_LANE_RESIDUAL" or wr.f.get("EW_OTAG") or rd.f.get("MV_L") != wr.f["EW_L"]:
                continue
            x = wr.f["EW_OUT"][1:]
            if wr.f["EW_D"] != rd.f["MV_K"]:
                continue
        elif wr.type != "matvec":
            continue
        elif lanes and len(fused := [sg for sg in wr.segs if sg.get("SEG_LRX")]) == 1 and wr.f["MV_L"] == rd.f["MV_L"]:
            # Laneformer: the fused residual's tail writes x
            x = fused[0]["SEG_LRX"][1:]
            if wr.f["MV_FLAGS"] & CONSTS["MVF_TAG_LRX"] or fused[0]["SEG_N"] != rd.f["MV_K"]:
                continue
        else:
            if len(wr.segs) != 1 or wr.f["MV_L"] != 1 or rd.f["MV_L"] != 1:
                continue
            sg = wr.segs[0]
            x = sg["out_name"]
            if sg["SEG_W2"] or sg.get("SEG_RES") != "@" + x or wr.f["MV_FLAGS"] & CONSTS["MVF_TAG_OUT"]:
                continue
            if sg["SEG_N"] != rd.f["MV_K"]:
                continue
        if rd.f.get("MV_IN") != "@" + x or rd.f["MV_IN_MODE"] != CONSTS["IN_NORM"] or rd.f.get("_pend_in") is not None:
            continue
        if P.tensors[x].numel != rd.f["MV_K"] * rd.f["MV_L"]:
            continue
        found.append((i - 1, i, x))
    if not found or len({x for *_, x in found}) != 1:
        return []
    x = found[0][2]
    # the writes of x a token, in order: a split-K stage's down_proj does not write it (its sum stays
    # pending in the accumulator until o_proj's residual writes x, fuse_down_splitk)
    pending = {j for st in stages if st.f.get("_splitk") for j in st.ops}
    writes = [j for j, op in enumerate(P.ops) if x in op.outputs and j not in pending]
    n = len(writes)
    stage_of_write = {}
    reader_of = {}
    for w, r, _ in found:
        k = writes.index(max(j for j in stages[w].ops if x in P.ops[j].outputs))
        stage_of_write[k] = w
        reader_of[w] = r
        if stages[w].type == "ew":
            stages[w].f["EW_OTAG"] = k | (n << 16)
            continue
        tail = any(sg.get("SEG_LRX") for sg in stages[w].segs) and lanes
        stages[w].f["MV_FLAGS"] |= CONSTS["MVF_TAG_LRX"] if tail else CONSTS["MVF_TAG_OUT"]
        stages[w].f["MV_OTAG"] = k | (n << 16)

    def certifies(j: int, prev: int) -> bool:  # all blocks past stage j => the write at stage prev is complete
        ws = stage_waits_on(stages, j)
        if ws is not None and ws >= prev:
            return True
        return lanes and reader_of.get(prev) == j  # (lanes) j read that write whole, waited for or polled
    for w, r, _ in found:
        k = stages[w].f["EW_OTAG" if stages[w].type == "ew" else "MV_OTAG"] & 0xFFFF
        prev = stage_of_write.get(k - 1)
        if prev is None or prev >= w or stages[w].f.get("_carry_out") is not None:
            continue
        # the reader will wait on stage r - 2: is write k - 1 complete everywhere once that is counted?
        if not any(certifies(j, prev) for j in range(prev + 1, r - 1)):
            continue
        stages[r].f["MV_FLAGS"] |= CONSTS["MVF_TAG_IN"]
        stages[r].f["MV_TAG"] = k | (n << 16)
    return [x]


def count_splitk_inputs(stages) -> int:
    """KOG_HOPPER_SPLITK_COUNT (matvec.cuh SPLITK_COUNT): readiness in the data for the split-K sum.
    The loader that reads a split-K stage's accumulator as its pending row right after it (the next
    layer's q/k/v stage, or the LM head) gets MVF_COUNT_IN: it waits on the stage before the split-K
    stage and re-reads each accumulator word until the low 8 bits count every block's add. Its other
    input, x, is not written by the split-K stage (its sum stays pending), so x's last write is in a
    stage at or before the one it waits on, complete once that stage's count is. The accumulator of a
    token's parity is zeroed by the split-K stage a token before (fuse_down_splitk), which every
    block finished before this token's adds, so no count is stale. Returns the number of readers."""
    n = 0
    for i in range(2, len(stages)):
        st, sk = stages[i], stages[i - 1]
        if st.type != "matvec" or st.f.get("_pend_in") is None or sk.f.get("_acc") != st.f["_pend_in"]:
            continue
        if sk.f.get("_carry_out") is not None or st.f.get("_carry") or st.f["MV_FLAGS"] & CONSTS["MVF_TAG_IN"]:
            continue
        st.f["MV_FLAGS"] |= CONSTS["MVF_COUNT_IN"]
        n += 1
    return n


ATTENTION_SHAPE_FIELDS = ("L", "H", "HKV", "HD", "T", "MAXCH", "ROPE_Q", "ROPE_K")


def attention_shape_consts(stages) -> dict:
    """attention_plan.cuh ATC_*: the attention's shapes as compile-time constants, when every attention
    stage has the same ones (a sliding window may differ: it stays a descriptor field); else {}."""
    shapes = {tuple(st.f[f"AT_{k}"] for k in ATTENTION_SHAPE_FIELDS) for st in stages if st.type == "attn"}
    if len(shapes) != 1:
        return {}
    return {f"ATC_{k}": v for k, v in zip(ATTENTION_SHAPE_FIELDS, shapes.pop())}


RMS_BLOCK_VALUES = 4  # elementwise.cuh RMS_V: float4s a thread in a block-a-row RMSNorm


def has_long_rmsnorm(stages, nt: int = NT) -> bool:
    """Whether an elementwise RMSNorm stage has rows that elementwise.cuh's RMS_BLOCK path takes (256
    to 4 * nt * RMS_V values, a multiple of 4): Laneformer's final norm before the lane mean. The
    backend compiles the path in only then, so other models' builds keep their code unchanged."""
    return any(st.type == "ew" and st.f.get("EW_OP") == "OP_RMSNORM"
               and 256 <= st.f["EW_GROUP"] <= 4 * nt * RMS_BLOCK_VALUES and st.f["EW_GROUP"] % 4 == 0
               for st in stages)


def _ew_stage(P, op, i):
    T = P.tensors
    k = op.kind

    def lanes_of(name):
        s = T[name].shape
        return s[0] if len(s) > 1 else 1

    if k == "rmsnorm":
        x, w, out = op.inputs[0], op.inputs[1], op.outputs[0]
        D = T[x].shape[-1]
        grp = op.attr("group") or D
        return Stage("ew", dict(EW_OP="OP_RMSNORM", EW_L=lanes_of(x), EW_D=D, EW_A="@" + x, EW_B="@" + w, EW_OUT="@" + out,
                                EW_GROUP=grp, EW_WL=(D if len(T[w].shape) == 2 else 0), EW_F0=("f", float(op.attr("eps")))),
                     ops=[i], label="rmsnorm")
    if k == "rope":
        x, inv, out = op.inputs[0], op.inputs[1], op.outputs[0]
        return Stage("ew", dict(EW_OP="OP_ROPE", EW_L=lanes_of(x), EW_D=T[x].shape[-1], EW_A="@" + x, EW_B="cos:" + inv,
                                EW_C="sin:" + inv, EW_OUT="@" + out, EW_HD=op.attr("head_dim"),
                                EW_STYLE=1 if op.attr("style") == "half" else 2), ops=[i], label="rope")
    if k == "kv_append":
        kk, v, ck, cv = op.inputs
        Lk, Hkv, Tc, hd = T[ck].shape
        return Stage("ew", dict(EW_OP="OP_KVAPPEND", EW_L=Lk, EW_D=Hkv * hd, EW_A="@" + kk, EW_B="@" + v,
                                EW_OUT="@" + ck, EW_OUT2="@" + cv, EW_HD=hd, EW_T=Tc), ops=[i], label="kv_append")
    if k in ("swiglu", "add"):
        a, b, out = op.inputs[0], op.inputs[1], op.outputs[0]
        return Stage("ew", dict(EW_OP="OP_SWIGLU" if k == "swiglu" else "OP_ADD", EW_L=lanes_of(out), EW_D=T[out].shape[-1],
                                EW_A="@" + a, EW_B="@" + b, EW_OUT="@" + out), ops=[i], label=k)
    if k == "copy":
        x, out = op.inputs[0], op.outputs[0]
        return Stage("ew", dict(EW_OP="OP_COPY", EW_L=1, EW_D=T[out].numel, EW_A="@" + x, EW_OUT="@" + out), ops=[i], label="copy")
    if k in ("lane_mean", "lane_sum"):
        x, out = op.inputs[0], op.outputs[0]
        return Stage("ew", dict(EW_OP="OP_LANE_MEAN" if k == "lane_mean" else "OP_LANE_SUM", EW_L=1, EW_D=T[out].shape[-1],
                                EW_LIN=T[x].shape[0], EW_A="@" + x, EW_OUT="@" + out), ops=[i], label=k)
    if k == "lane_residual":
        x, fresh = op.inputs[0], op.inputs[1]
        delayed = op.inputs[2] if len(op.inputs) > 2 else None
        mode = {"local": 0, "allreduce": 1, "delayed": 2}[op.attr("mode")]
        return Stage("ew", dict(EW_OP="OP_LANE_RESIDUAL", EW_L=T[x].shape[0], EW_D=T[x].shape[-1], EW_A=0, EW_B="@" + fresh,
                                EW_C=("@" + delayed) if delayed else 0, EW_OUT="@" + x, EW_STYLE=mode,
                                EW_F0=("f", float(op.attr("scale", 1.0)))), ops=[i], label="lane_residual")
    raise CapabilityError(f"nvidia_hopper cannot run op {k}")


def fuse_attention_combine(P, stages) -> None:
    """Stream build: when an attention stage's output feeds only the next stage's matvecs (o_proj),
    the attention tiles just write their chunk partials (m, l, o) and that matvec's input loader
    combines them (IN_ATTN): no ticket, fence and extra round trips between the two stages.
    The matvec gets `_attn_stage` (the attention stage's index) for its MV_ATTN pointer."""
    for i in range(len(stages) - 1):
        at, mv = stages[i], stages[i + 1]
        if at.type != "attn" or mv.type != "matvec" or mv.f.get("MV_IN_MODE") != 0:
            continue
        a = at.ops[-1]
        out = P.ops[a].outputs[0]
        if mv.f.get("MV_IN") != "@" + out or mv.f["MV_K"] != at.f["AT_H"] * at.f["AT_HD"]:
            continue
        readers = _readers(P.ops, a, out)
        if not readers or any(j not in mv.ops for j in readers):
            continue
        at.f["AT_NOCOMBINE"] = 1
        mv.f["MV_IN_MODE"] = CONSTS["IN_ATTN"]
        mv.f["_attn_stage"] = i


SPLITK_PEND_V = 2  # matvec.cuh PEND_V: float4s of a pending input row a thread loads (K <= 8 x consumer threads)
FIX_BITS = 32      # matvec.cuh f2fix: the split-K partials' fixed point, 2^-32 (|sum| < 2^31)


def fuse_down_splitk(P, stages, nt: int, carry: bool = False) -> int:
    """KOG_HOPPER_SPLITK_DOWN (the default for Llama-family layers since v28): gate/up and down_proj
    as one stage, so a layer's MLP has one grid-wide boundary instead of two and down_proj loads
    no 8k-float input row.

    Each block keeps its SwiGLU values h[J_b] (its gate/up rows) in shared memory and then streams
    the same rows of down_proj's transpose, W_d[:, J_b]^T: a partial W_d[:, J_b] h[J_b] of every
    output. The partials are summed in 64-bit fixed point (FIX_BITS) with integer atomics into an
    accumulator [2][D] of the stage (parity: the token), so the sum is exact and does not depend on
    the order the blocks add in (seeded runs repeat bit for bit). The residual x is not updated
    here: x + acc is *pending* until a later matvec stage's residual epilogue writes x (o_proj),
    and every reader in between adds acc itself (an input loader, MV_PEND; a residual, MV_RES_PEND).
    Each block zeroes its slice of the other parity's accumulator, which the previous token's
    readers have finished with, for the next token.

    A (gate/up stage, down stage) pair fuses when: gate/up is one unlaned pair segment, down reads
    only its SwiGLU output as a plain input and adds the residual x in place (x += W_d h), and every
    stage until x is written again reads x only as a loader (K = D <= 8 nt) or as a residual that
    it also writes; a pending x still unwritten at the end of the token must be the one the next
    token's embedding overwrites (stage 0). Pairs are decided last to first (a later fused pair is
    not a writer of x). Mutates `stages`: the down stage goes, its ops join the gate/up stage, whose
    segments gain the down segment (`_splitk`: its rows are dealt with the pair's, stream_plan).
    Fused stages get f["_acc"] = k (accumulator k, [2][D] int64, the backend allocates), readers
    f["_pend_in"] / f["_pend_res"] = k. Returns the number of fused stages.

    carry (KOG_HOPPER_SPLITK_CARRY): the accumulator starts from x instead of zero. The stage that
    last writes x before the pair (o_proj's residual, one segment of D rows) also writes each row's
    value in fixed point into it (f["_carry_out"] = k, MV_CARRY_OUT), so the readers of the pending
    x (f["_carry"]: MVF_CARRY) read the accumulator alone: a loader 16 KB instead of 24 on bench-2b,
    where every block pulls the same lines. The split-K stage then zeroes nothing. Pairs without
    such a writer keep the zero start."""
    def refs(st, name):
        """Fields of a stage that name tensor `name`: (field, value) of st.f and of every segment."""
        tag = "@" + name
        out = [(k, v) for k, v in st.f.items() if v == tag]
        for sg in st.segs:
            out += [(k, v) for k, v in sg.items() if k.startswith("SEG_") and v == tag]
        return out

    def pair_down(i):
        """(x, D) when stages i, i + 1 are a gate/up stage and its down_proj that may fuse, else None."""
        if i + 1 >= len(stages):
            return None
        st, nx = stages[i], stages[i + 1]
        if st.type != "matvec" or nx.type != "matvec" or len(st.segs) != 1 or len(nx.segs) != 1:
            return None
        g, d = st.segs[0], nx.segs[0]
        if not g["SEG_W2"] or g["lanes"] != 1 or st.f["MV_L"] != 1 or st.f["MV_IN_MODE"] & CONSTS["IN_EMBED"]:
            return None
        h, x = g["out_name"], d["out_name"]
        if (nx.f["MV_IN"] != "@" + h or nx.f["MV_IN_MODE"] != 0 or d["SEG_W2"] or d["SEG_BIAS"] or d["lanes"] != 1
                or d["SEG_RES"] != "@" + x or len(P.tensors[x].shape) > 2 or P.tensors[x].shape[0] != 1):
            return None
        readers = _readers(P.ops, max(st.ops), h)
        if not readers or not set(readers) <= set(nx.ops):
            return None
        D = int(d["SEG_N"])
        if D % 8 or D > 4 * SPLITK_PEND_V * nt:  # a pending row: PEND_V float4s a consumer thread
            return None
        return x, D

    def readers_until_written(i, x, D, fused_downs):
        """(loader readers, residual readers) of the pending x after the pair at i, i + 1, or None."""
        loads, resid = [], []
        for j in list(range(i + 2, len(stages))) + [None]:
            if j is None:  # the token's end: the next token's embedding must overwrite x first
                s0 = stages[0]
                ok = (s0.type == "matvec" and s0.f["MV_IN_MODE"] & CONSTS["IN_EMBED"] and s0.f.get("MV_EMB_OUT") == "@" + x)
                return (loads, resid) if ok else None
            st = stages[j]
            r = refs(st, x)
            if not r:
                continue
            if st.type != "matvec" or j in fused_downs:
                return None
            kinds = {k for k, _ in r}
            if kinds - {"MV_IN", "SEG_RES", "SEG_OUT"}:
                return None
            if "MV_IN" in kinds:
                if st.f["MV_IN_MODE"] not in (0, CONSTS["IN_NORM"]) or st.f["MV_L"] != 1 or int(st.f["MV_K"]) != D:
                    return None
                loads.append(j)
            if {"SEG_RES", "SEG_OUT"} & kinds:
                segs = [sg for sg in st.segs if "@" + x in (sg["SEG_RES"], sg["SEG_OUT"])]
                if len(segs) != 1 or segs[0]["SEG_RES"] != "@" + x or segs[0]["SEG_OUT"] != "@" + x:
                    return None  # x written without its pending sum, or read twice
                resid.append(j)
                return loads, resid  # x written: no longer pending
        return None

    fused = []  # (gate/up stage index, D, loaders, residuals), last pair first
    fused_downs: set[int] = set()
    for i in range(len(stages) - 2, -1, -1):
        pd = pair_down(i)
        if pd is None or i + 1 in fused_downs or i in fused_downs:
            continue
        x, D = pd
        rd = readers_until_written(i, x, D, fused_downs)
        if rd is None:
            continue
        fused.append((i, D, *rd))
        fused_downs.add(i + 1)
    if not fused:
        return 0
    def carry_writer(i, x, D):
        """The stage that last writes x before stage i, if it writes all of it as one in-place residual."""
        for j in range(i - 1, -1, -1):
            r = refs(stages[j], x)
            if not any(k == "SEG_OUT" for k, _ in r):
                continue
            st = stages[j]
            segs = [sg for sg in st.segs if sg["SEG_OUT"] == "@" + x]
            ok = (st.type == "matvec" and len(segs) == 1 and segs[0]["SEG_RES"] == "@" + x and segs[0]["lanes"] == 1
                  and int(segs[0]["SEG_N"]) == D and st.f["MV_L"] == 1 and not st.f.get("_splitk"))
            return j if ok else None
        return None

    for k, (i, D, loads, resid) in enumerate(sorted(fused)):
        st, nx = stages[i], stages[i + 1]
        w = carry_writer(i, nx.segs[0]["out_name"], D) if carry else None
        if w is not None:
            stages[w].f.update(_carry_out=k, MV_ACC_D=D)
            st.f["_carry_in"] = True
            for j in loads + resid:
                stages[j].f["_carry"] = True
        d = dict(nx.segs[0])
        d.update(SEG_OUT=0, SEG_RES=0, SEG_RESL=0, _splitk=True, _k=int(st.segs[0]["SEG_N"]))
        st.segs.append(d)
        st.ops = sorted(set(st.ops) | set(nx.ops))
        st.label += "+down"
        st.f.update(_acc=k, _splitk=True, MV_ACC_D=D)
        for j in loads:
            stages[j].f.update(_pend_in=k, MV_ACC_D=D)
        for j in resid:
            stages[j].f.update(_pend_res=k, MV_ACC_D=D)
    for i in sorted(fused_downs, reverse=True):
        del stages[i]
    return len(fused)


def pair_rbuf_bytes(st: "Stage") -> int:
    """SPLITK_PAIRS: a split-K stage's receive buffer, the partner's partials of the larger half of
    the outputs (matvec.cuh mv_down_items: rank 0 adds 8-output groups [0, n8 / 2), rank 1 the rest)."""
    n8 = int(st.f["MV_ACC_D"]) // 8
    return 8 * (n8 - n8 // 2) * 4


def acc_len(D: int, perm: bool = False) -> int:
    """int64s a split-K accumulator holds per token parity (matvec.cuh acc_len): D, or with SPLITK_PERM
    (the loaders' order, 128 values a block) D rounded up to a multiple of 128."""
    return (D + 127) // 128 * 128 if perm else D


def acc_ix(i, perm: bool = True):
    """Where output i's int64 lives in an accumulator (matvec.cuh acc_ix; numpy arrays too)."""
    if not perm:
        return i
    return (i & ~127) | ((i & 2) << 5) | ((i >> 1) & 62) | (i & 1)


def splitk_stage_bytes(st: "Stage") -> int:
    """SPLITK_BULK: a split-K stage's fixed-point partials in shared memory, D int64 (the bulk
    reduction's source, matvec.cuh mv_down_items)."""
    return int(st.f["MV_ACC_D"]) * 8


def pool_partials_bytes(st: "Stage") -> int:
    """DYN_POOL: a split-K stage's down partials in shared memory, D floats (matvec.cuh POOL_ACC_OFF)."""
    return int(st.f["MV_ACC_D"]) * 4


def splitk_rows(st: "Stage", nb: int) -> int:
    """The most gate/up rows one block of a split-K stage takes (its SwiGLU values in shared memory)."""
    pool = pool_rows(st, nb)
    most = pool[3] if pool else 0  # a pool unit's rows take the same place (DYN_POOL)
    for si, *_, b, r0, r1 in _deal_rows(st, nb):
        most = max(most, r1 - r0)
    return most


def _finish(P, stages):
    """Which matvec stages prompt positions may skip (the LM head)."""
    # the stage writing the logits: argmax partials for greedy, prompt positions skip it
    last_layer_stage = max((si for si, st in enumerate(stages) if any(P.ops[j].layer is not None for j in st.ops)), default=-1)
    tail = list(range(last_layer_stage + 1, len(stages)))
    # tail stages can be skipped for prompt positions if nothing before them reads what they write
    tail_writes = set()
    for si in tail:
        for j in stages[si].ops:
            tail_writes |= set(P.ops[j].outputs)
    head_reads = set()
    for si in range(0, last_layer_stage + 1):
        for j in stages[si].ops:
            head_reads |= set(P.ops[j].inputs)
    skippable = not (tail_writes & head_reads)
    for si, st in enumerate(stages):
        if st.type == "matvec":
            st.f["_skip"] = skippable and si in tail
    return stages


STATIC_SMEM = 8192      # the kernel's static shared memory (reductions, mbarriers: ~4.5 KB), rounded up
MAX_SLOTS = 16
DEFAULT_SLOTS = 5  # the ring's slots unless KOG_HOPPER_SLOTS says otherwise (backend.load)


POOL_MIN_ROWS_A_BLOCK = 48  # a stage gets a pool only if each block would still deal this many rows


def pool_rows(st: Stage, nb: int) -> tuple[int, int, int, int] | None:
    """KOG_HOPPER_POOL (DYN_POOL; the backend sets st.f["_pool_pct"] and ["_pool_rows"] on the
    stages it may take): (segment, rows dealt, rows in all, rows a unit) of a matvec stage whose
    last rows form a pool of units that the blocks' producers grab at run time, or None.

    Why: a stage ends when its slowest block does. The trace of v30 (bench-2b, an H100) has the
    blocks' work consistent per SM (24 SMs ~10% faster, the same ones in every stage and token) and
    the rest spread by ~3.4 us a split-K stage: statically equal shares leave the fast SMs idle and
    the stage waiting on the unlucky. Pooled rows go to whichever producer reaches them first.
    Only stages of one dealt segment without lanes (a Llama-family LM head, a split-K gate/up +
    down stage) with at least POOL_MIN_ROWS_A_BLOCK rows a block; the pool is a whole number of
    units, each one row group (and for a split-K stage the same rows of down_proj)."""
    pct, unit = int(st.f.get("_pool_pct", 0)), int(st.f.get("_pool_rows", 0))
    if st.type != "matvec" or pct <= 0 or unit <= 0:
        return None
    dealt = [si for si, sg in enumerate(st.segs) if not sg.get("_splitk")]
    if len(dealt) != 1 or st.segs[dealt[0]]["lanes"] != 1:
        return None
    si = dealt[0]
    n = int(st.segs[si]["SEG_N"])
    units = n * pct // 100 // unit
    if units <= 0 or (n - units * unit) < int(st.f.get("_pool_min", POOL_MIN_ROWS_A_BLOCK)) * nb:
        return None
    return si, n - units * unit, n, unit


def _deal_rows(st: Stage, nb: int):
    """Rows of every (segment, lane) dealt to the blocks in contiguous ranges of equal bytes:
    yields (segment, lane, rows, pair, block, first row, end row) for every non-empty range.
    st.f["_lane_major"] (KOG_HOPPER_LANE_MAJOR, the backend's default since session 15): the runs
    go lane by lane (every segment of lane 0, then of lane 1, ...), so a block spans at most two
    lanes and only at the lane changes (laneformer-2b's q/k/v: 4 blocks with two lanes instead of
    20), and st.f["_lane_pad"] (KOG_HOPPER_LANE_PAD_ROWS, 24) weight rows of cost are counted at
    every change of lane, so a block that loads two lanes' input rows gets fewer weight rows.
    Without lanes both orders are the same."""
    runs = [(si, lane, int(sg["SEG_N"]), bool(sg["SEG_W2"]))  # (segment, lane, rows, pair)
            for si, sg in enumerate(st.segs) if not sg.get("_splitk") for lane in range(sg["lanes"])]
    pool = pool_rows(st, nb)
    if pool:  # the pooled rows (the segment's last) are grabbed at run time, not dealt (pool_rows)
        runs = [(si, lane, pool[1] if si == pool[0] else n, pair) for si, lane, n, pair in runs]
    if st.f.get("_lane_major"):
        runs.sort(key=lambda run: run[1])  # stable: each lane's segments stay in order
    pad = int(st.f.get("_lane_pad", 0)) if st.f.get("_lane_major") else 0
    pads = [pad if i and runs[i][1] != runs[i - 1][1] else 0 for i in range(len(runs))]
    total = sum(n * (2 if pair else 1) for _, _, n, pair in runs) + sum(pads)  # weight rows
    base = 0
    for (si, lane, n, pair), p in zip(runs, pads):
        base += p
        cost = 2 if pair else 1
        blk = ((base + np.arange(n, dtype=np.int64) * cost) * nb) // total
        base += n * cost
        bounds = np.searchsorted(blk, np.arange(nb + 1))
        for b in np.nonzero(bounds[1:] > bounds[:-1])[0]:
            yield si, lane, n, pair, int(b), int(bounds[b]), int(bounds[b + 1])


def x_scratch(st: Stage, nb: int) -> int:
    """Bytes of x scratch a matvec stage needs (the input rows of the lanes one block touches):
    stream_plan's second result, without cutting items (which depends on the slot size)."""
    lanes: dict[int, list[int]] = {}
    for _, lane, *_, b, _r0, _r1 in _deal_rows(st, nb):
        lanes.setdefault(b, []).append(lane)
    cnt = max((max(v) - min(v) + 1 for v in lanes.values()), default=0)
    return cnt * int(st.f["MV_K"]) * 4


WIDE_GROUPS = 2  # an item of a wide stage holds twice the rows: 4 a consumer warp (matvec.cuh WIDE_ITEMS)


def wide_items(st: Stage, nw: int, slot_bytes: int) -> bool:
    """Whether a matvec stage's items take 4 rows a consumer warp instead of 2: its rows are so
    short that an item of 2 rows a warp at full K fills at most half a slot (laneformer-2b's
    o_proj, K = 384: 15 KB items in 31 KB slots stream at about half rate, session 15), and it has
    no gate/up pair segment (a pair item already holds two rows a warp)."""
    return (st.type == "matvec" and not any(sg["SEG_W2"] for sg in st.segs)
            and WIDE_GROUPS * 2 * nw * int(st.f["MV_K"]) * 2 <= slot_bytes)


def stage_weight_bytes(st: Stage) -> int:
    """bf16 weight bytes a stage streams a token (a matvec's segments, every lane; 0 otherwise)."""
    if st.type != "matvec":
        return 0
    K = int(st.f["MV_K"])
    return sum(int(sg["SEG_N"]) * int(sg.get("lanes", 1)) * int(sg.get("_k", K)) * 2 * (2 if sg.get("SEG_W2") else 1)
               for sg in st.segs)


def stream_plan(st: Stage, nb: int, nw: int, slot_bytes: int, max_rows: int | None = None,
                kalign: int = 1, wide: bool = False) -> tuple[np.ndarray, int]:
    """The per-block work list of a matvec stage for the weight stream, and the x scratch it needs.

    Rows of every (segment, lane) are dealt to the blocks in contiguous ranges of equal bytes
    (a row never straddles two blocks: no cross-block reduction, so results do not depend on
    timing). A block's range is cut into row groups (<= max_rows weight rows: 2 per consumer
    warp, gate+up for a pair segment; 4 per warp for a wide stage, wide_items) and each group into
    k-slices so that an item fits one ring slot; the slices of a group are consecutive items, so a
    warp accumulates them in registers.
    Every item is one contiguous run of the stage's packed weights (pack_stage_weights), so the
    producer moves it with a single bulk copy.
    Returns (int32 plan, bytes of x scratch). Layout: see stream.cuh (an item's header)."""
    K = int(st.f["MV_K"])
    if wide and any(sg["SEG_W2"] for sg in st.segs):
        raise ValueError("stream_plan: a stage with a gate/up pair cannot take wide items (wide_items)")
    max_rows = max_rows or 2 * nw * (WIDE_GROUPS if wide else 1)
    per_block: list[list[tuple]] = [[] for _ in range(nb)]
    for si, lane, n, pair, b, r0, r1 in _deal_rows(st, nb):
        cost = 2 if pair else 1
        cap = max_rows // cost
        ngroups = -(-(r1 - r0) // cap)
        edges = [r0 + (r1 - r0) * g // ngroups for g in range(ngroups + 1)]
        if not pair:  # even row counts where possible: a warp takes two rows
            edges = [e + ((e - r0) & 1) if 0 < g < ngroups else e for g, e in enumerate(edges)]
        for g in range(ngroups):
            a, z = edges[g], edges[g + 1]
            if z <= a:
                continue
            rows = (z - a) * cost
            cuts = _k_cuts(K // 8, max(1, slot_bytes // (rows * 2) // 8), kalign)
            nsl = len(cuts) - 1
            for i in range(nsl):
                flags = (1 if i == 0 else 0) | (2 if i == nsl - 1 else 0)
                per_block[int(b)].append([si, lane, a, z - a, cuts[i] * 8, (cuts[i + 1] - cuts[i]) * 8, flags, 0])
    for si, sg in enumerate(st.segs):  # a split-K down_proj (fuse_down_splitk): after each block's gate/up items
        if sg.get("_splitk"):
            _splitk_items(per_block, si, int(sg["SEG_N"]), slot_bytes)
    pool_items = _pool_items(st, nb, slot_bytes, max_rows, kalign)
    if pool_items and not all(per_block):  # a block's input row is loaded for its own items
        raise ValueError("stream_plan: with a pool every block needs rows of its own (raise KOG_HOPPER_POOL_MIN_ROWS)")
    head = (3 * nb + 4) & ~3
    offs, lane0, nl, items = [0], [], [], []
    xbytes = 0
    for b in range(nb):
        its = per_block[b]
        lanes = [it[1] for it in its]
        lo = min(lanes) if its else 0
        cnt = (max(lanes) - lo + 1) if its else 0
        for it in its:
            it[7] = (it[1] - lo) * K
        lane0.append(lo)
        nl.append(cnt)
        items += its
        offs.append(len(items))
        xbytes = max(xbytes, cnt * K * 4)
    items += pool_items  # after every block's: offs[nb] is where the pool begins (pool_layout)
    # packed offsets in 16-byte units; field 0 carries segment | lane << 2, field 1 the offset
    at = 0
    for it in items:
        si, lane, rows, klen = it[0], it[1], it[3], it[5]
        nbytes = rows * klen * 2 * (2 if st.segs[si]["SEG_W2"] else 1)
        it[0], it[1] = si | (lane << 2), at // 16
        at += nbytes
    plan = np.zeros(head + 8 * len(items), np.int32)
    plan[:nb + 1] = offs
    plan[nb + 1:2 * nb + 1] = lane0
    plan[2 * nb + 1:3 * nb + 1] = nl
    if items:
        plan[head:] = np.asarray(items, np.int64).ravel()
    return plan, xbytes


IT_FIRST, IT_LAST = 1, 2  # an item's flags (stream.cuh): first / last k-slice of its row group
IT_UNIT, IT_END = 4, 8  # a pool unit's first item; the pool's end (the producer's marker, no data)


def _pool_items(st: Stage, nb: int, slot_bytes: int, max_rows: int, kalign: int) -> list[list]:
    """The pool's items (pool_rows), unit after unit, every unit cut the same way: one row group of
    `unit` rows in as few k-slices as fit a slot, then for a split-K stage the same rows of
    down_proj's transpose (whole rows). A unit's first item carries IT_UNIT | its gate/up (or
    plain) items << 8 | its down items << 16: the consumers learn a unit's shape from its header."""
    pool = pool_rows(st, nb)
    if not pool:
        return []
    si, n0, n, unit = pool
    K = int(st.f["MV_K"])
    cost = 2 if st.segs[si]["SEG_W2"] else 1
    if unit * cost > max_rows:
        raise ValueError(f"stream_plan: a pool unit of {unit} rows exceeds a row group ({max_rows // cost} rows)")
    cuts = _k_cuts(K // 8, max(1, slot_bytes // (unit * cost * 2) // 8), kalign)
    down = [(j, int(sg["SEG_N"])) for j, sg in enumerate(st.segs) if sg.get("_splitk")]
    out = []
    for a in range(n0, n, unit):
        its = [[si, 0, a, unit, cuts[i] * 8, (cuts[i + 1] - cuts[i]) * 8,
                (IT_FIRST if i == 0 else 0) | (IT_LAST if i == len(cuts) - 2 else 0), 0] for i in range(len(cuts) - 1)]
        ngu = len(its)
        for dj, D in down:
            per = slot_bytes // (D * 2)
            ng = -(-unit // per)
            edges = [a + unit * g // ng for g in range(ng + 1)]
            its += [[dj, 0, edges[g], edges[g + 1] - edges[g], 0, D, (IT_FIRST if g == 0 else 0) | (IT_LAST if g == ng - 1 else 0), 0]
                    for g in range(ng)]
        if ngu >= 256 or len(its) - ngu >= 256 or len(its) > 31:  # (31: produce_pool reads a unit's template from one batch)
            raise ValueError("stream_plan: a pool unit needs at most 31 items")
        its[0][6] |= IT_UNIT | ngu << 8 | (len(its) - ngu) << 16
        out += its
    return out


def pool_layout(plan: np.ndarray, nb: int) -> tuple[int, int, int] | None:
    """(first pool item, items a unit, units) of a stream plan, or None without a pool."""
    its = plan_items(plan, nb)
    start = int(plan[nb])
    if start >= len(its):
        return None
    firsts = np.nonzero(its[start:, 7] & IT_UNIT)[0]
    per = int(firsts[1]) if len(firsts) > 1 else len(its) - start
    return start, per, (len(its) - start) // per


def _splitk_items(per_block: list, si: int, D: int, slot_bytes: int) -> None:
    """A split-K stage's down_proj items: for each block, the rows of W_d^T matching its gate/up rows
    (segment 0, one contiguous range), whole rows of D columns, as few items as fit a slot each,
    cut evenly; IT_FIRST / IT_LAST mark the block's first and last down item."""
    per = slot_bytes // (D * 2)
    if per < 1:
        raise ValueError(f"stream_plan: a split-K down_proj row of {D} values does not fit a {slot_bytes}-byte slot")
    for its in per_block:
        groups = sorted({(it[2], it[3]) for it in its if it[0] == 0})  # the block's gate/up row groups
        if not groups:
            continue
        a, z = groups[0][0], groups[0][0]
        for r, n in groups:
            if r != z:
                raise ValueError("stream_plan: a block's gate/up rows of a split-K stage are not contiguous")
            z = r + n
        ng = -(-(z - a) // per)
        edges = [a + (z - a) * g // ng for g in range(ng + 1)]
        for g in range(ng):
            flags = (1 if g == 0 else 0) | (2 if g == ng - 1 else 0)
            its.append([si, 0, edges[g], edges[g + 1] - edges[g], 0, D, flags, 0])


def _k_cuts(chunks: int, max_chunks: int, kalign: int) -> list[int]:
    """Boundaries (in 8-column chunks) of a row group's k-slices: as few slices as fit
    max_chunks each. kalign = 1: equal slices. kalign = 32: boundaries on multiples of 32 chunks
    (256 columns) where that fits, so that every consumer lane has a chunk in every step of the
    dot loop (matvec.cuh run_matvec: lane i takes chunks i, i + 32, ...); a slice of 85 chunks
    takes 3 steps for 85/96 of the work. (Aligned slices only where they are no more than the
    equal cut's, e.g. 9 instead of 11 for down_proj's 16-row groups: level, session 18.)"""
    if kalign > 1 and max_chunks >= kalign and chunks % kalign == 0:
        units, per = chunks // kalign, max_chunks // kalign
        nsl = -(-units // per)
        return [kalign * (units * i // nsl) for i in range(nsl + 1)]
    nsl = -(-chunks // max_chunks)
    return [chunks * i // nsl for i in range(nsl + 1)]


def plan_items(plan: np.ndarray, nb: int) -> np.ndarray:
    """The items of a plan as rows of (segment, lane, packed offset / 16, row0, rows, k0, klen, flags, xoff)."""
    it = plan[(3 * nb + 4) & ~3:].reshape(-1, 8).astype(np.int64)
    return np.concatenate([it[:, :1] & 3, it[:, :1] >> 2, it[:, 1:]], axis=1)


SE_WORDS = 12  # uint32 per stream-list entry (stream.cuh produce)
SE_POOL, SE_TEMPLATE = 8, 16  # entry flags (stream.cuh): a pool's marker (units, items a unit, unit bytes,
                              # flags; pool index, rows a unit), and its template entries (unit 0's)



def stream_list(stages: list, nb: int, nst: int) -> tuple[np.ndarray, np.ndarray]:
    """The producer warps' copy lists (stream.cuh `produce`) and the consumers' per-stage block info.

    List: for every block, each item of each matvec stage in stage order, as 12 uint32: packed
    source address (lo, hi), bytes, flags (bit 0: the stage skips prompt positions, bit 1: it
    writes the logits, bits 8+: stage index), then the item's 8 plan ints (segment | lane << 2,
    offset / 16, row0, rows, k0, klen, IT_* flags, x offset), which the producer hands to the
    consumers in the slot's header. Layout: per-block entry ranges [nb + 1] padded to 16 bytes,
    then the entries. Block info: int32 [nst][nb][4] = (items, first lane, lanes, 0) of the block
    in each stage (zeros for stages without weights); in a stage with a fused DTP residual
    (_fuse_lane_residual), the fourth is the block's rows of that segment, contiguous in the
    flattened lane * N + row index: first | count << 16 (matvec.cuh lane_residual_tail).
    `stages`: (stage index, plan, segs, packed device address, MV_FLAGS[, an attention stage
    follows]) of every matvec stage (flag bit 2 on a block's first item of such a stage).
    A stage with a pool (pool_rows, DYN_POOL) adds to every block's list, after its own items, the
    pool's marker (SE_POOL: units, items a unit, unit bytes; pool index, rows a unit) and unit 0's
    entries (SE_TEMPLATE), from which the producer copies every unit it grabs."""
    per_block: list[list] = [[] for _ in range(nb)]
    binfo = np.zeros((nst, nb, 4), np.int32)
    npools = 0
    for si, plan, segs, packed, mv_flags, *rest in stages:
        att_next = bool(rest and rest[0])
        raw = plan[(3 * nb + 4) & ~3:].reshape(-1, 8)
        its = plan_items(plan, nb)
        offs = plan[:nb + 1]
        binfo[si, :, 0] = offs[1:] - offs[:-1]
        binfo[si, :, 1] = plan[nb + 1:2 * nb + 1]
        binfo[si, :, 2] = plan[2 * nb + 1:3 * nb + 1]
        binfo[si, :, 3] = lane_residual_rows(its, offs, segs, nb)
        if any(sg.get("_splitk") for sg in segs):
            binfo[si, :, 3] = splitk_block_info(its, offs, segs, nb)
        flags = (1 if mv_flags & 2 else 0) | (2 if mv_flags & 1 else 0) | (si << 8)

        def entry(j, fl):
            seg, _, off16, _, rows, _, klen, _, _ = its[j]
            src = int(packed) + int(off16) * 16
            nbytes = int(rows) * int(klen) * (4 if segs[seg]["SEG_W2"] else 2)
            return [src & 0xFFFFFFFF, src >> 32, nbytes, fl] + [int(v) & 0xFFFFFFFF for v in raw[j]]
        pool = pool_layout(plan, nb)
        if pool:  # a marker, then unit 0's entries as the template of every unit (stream.cuh produce)
            start, per, units = pool
            ubytes = sum(entry(j, 0)[2] for j in range(start, start + per))
            tail = [[units, per, ubytes, flags | SE_POOL, npools, int(its[start][4])] + [0] * 6]
            tail += [entry(j, flags | SE_TEMPLATE) for j in range(start, start + per)]
            npools += 1
        for b in range(nb):
            for j in range(offs[b], offs[b + 1]):
                first_of_attn = att_next and j == offs[b]
                per_block[b].append(entry(j, flags | (4 if first_of_attn else 0)))  # 4: SE_ATT_NEXT, prefetch the next attention's K/V
            if pool:
                per_block[b] += tail
    head = ((nb + 4) >> 2) * 4
    counts = np.cumsum([0] + [len(e) for e in per_block])
    out = np.zeros(head + SE_WORDS * int(counts[-1]), np.uint32)
    out[:nb + 1] = counts
    rows = [e for blk in per_block for e in blk]
    if rows:
        out[head:] = np.asarray(rows, np.uint64).astype(np.uint32).ravel()
    return out, binfo


def lane_residual_rows(its: np.ndarray, offs: np.ndarray, segs: list, nb: int) -> np.ndarray:
    """binfo's fourth field of a matvec stage: for each block, its rows of the segment with a fused
    DTP residual (SEG_LRD) as first | count << 16 in the flattened lane * N + row index (the
    blocks' rows are dealt in contiguous ranges, _deal_rows); zeros without such a segment."""
    out = np.zeros(nb, np.int64)
    fused = [i for i, sg in enumerate(segs) if sg.get("SEG_LRD")]
    if not fused:
        return out
    if len(fused) > 1:
        raise CapabilityError("nvidia_hopper: one fused lane residual a stage at most")
    fs, N = fused[0], int(segs[fused[0]]["SEG_N"])
    for b in range(nb):
        rows = sorted({(int(it[1]) * N + int(it[3]), int(it[4])) for it in its[offs[b]:offs[b + 1]] if it[0] == fs})
        if not rows:
            continue
        first = end = rows[0][0]
        for a, n in rows:
            if a != end:
                raise CapabilityError("nvidia_hopper: a block's rows of a fused lane residual are not contiguous")
            end = a + n
        if first >= 1 << 16 or end - first >= 1 << 15:
            raise CapabilityError("nvidia_hopper: a fused lane residual needs fewer than 65,536 rows (lanes x N)")
        out[b] = first | (end - first) << 16
    return out


def splitk_block_info(its: np.ndarray, offs: np.ndarray, segs: list, nb: int) -> np.ndarray:
    """binfo's fourth field of a split-K stage (fuse_down_splitk): for each block, its down_proj
    items (the last of its items) | its first gate/up row << 8 (matvec.cuh run_matvec: SwiGLU value
    r of the stage lives at hs[r - first row])."""
    sk = next(i for i, sg in enumerate(segs) if sg.get("_splitk"))
    out = np.zeros(nb, np.int64)
    for b in range(nb):
        mine = its[offs[b]:offs[b + 1]]
        down = mine[mine[:, 0] == sk]
        if not len(down):
            continue
        if len(down) >= 256 or int(down[:, 3].min()) >= 1 << 23:
            raise CapabilityError("nvidia_hopper: a split-K stage needs fewer than 256 down items and 2^23 rows a block")
        if not (mine[-len(down):, 0] == sk).all():
            raise CapabilityError("nvidia_hopper: a block's split-K down items must follow its gate/up items")
        out[b] = len(down) | int(down[:, 3].min()) << 8
    return out


def pack_stage_weights(plan: np.ndarray, nb: int, segs: list, weight_bits) -> np.ndarray:
    """The stage's matvec weights (bf16 bits) in the order the producer streams them: item after
    item, each `rows x klen` of W (row-major), then the same rows of W2 for a gate/up pair.
    weight_bits(name) -> uint16 array [N, K] or [L, N, K]."""
    items = plan_items(plan, nb)
    if not len(items):
        return np.zeros(8, np.uint16)
    last = items[-1]
    total = last[2] * 8 + last[4] * last[6] * (2 if segs[last[0]]["SEG_W2"] else 1)
    out = np.empty(total, np.uint16)
    mats = {}
    for si, lane, off16, r0, rows, k0, klen, _, _ in items:
        sg = segs[si]
        names = [sg["SEG_W"][1:]] + ([sg["SEG_W2"][1:]] if sg["SEG_W2"] else [])
        at = off16 * 8
        for name in names:
            if name not in mats:
                mats[name] = weight_bits(name)
            w = mats[name]
            w = w[lane] if w.ndim == 3 else w
            if sg.get("_splitk"):  # down_proj's transpose: item rows are W_d's columns (fuse_down_splitk)
                out[at:at + rows * klen] = w[k0:k0 + klen, r0:r0 + rows].T.ravel()
            else:
                out[at:at + rows * klen] = w[r0:r0 + rows, k0:k0 + klen].ravel()
            at += rows * klen
    return out


def finalize_matvec(st: Stage, nb: int, logits_name: str, argmax_alloc, logits_numel: int = 0):
    """Flags of a matvec stage; the LM head's (max, index) partials (one per block) for greedy sampling."""
    st.f["MV_NSEG"] = len(st.segs)
    flags = 0
    if any(s["out_name"] == logits_name for s in st.segs):
        flags |= 1  # MVF_LOGITS
        # logits mode stores one row of the logits tensor per position: its size, not N x lanes
        # (a Laneformer head has one output lane while the program has L)
        st.f["MV_OUT_STRIDE"] = logits_numel
        if len(st.segs) == 1 and st.segs[0]["lanes"] == 1:
            flags |= 4  # MVF_ARGMAX
            st.f["MV_ARGMAX"] = argmax_alloc(nb)
    if st.f.get("_skip"):
        flags |= 2
    if st.f.get("_splitk"):
        flags |= CONSTS["MVF_SPLITK"]
    if st.f.get("_carry") or st.f.get("_carry_in"):  # fuse_down_splitk(carry=True): x rides in the accumulator
        flags |= CONSTS["MVF_CARRY"]
    st.f["MV_FLAGS"] = flags
    return st
