// The matvec stage's consumer warps: the input row (embedding, norm, or the attention's chunks
// combined), the dot products over the ring's items, the epilogue. Part of the decode kernel:
// decode.cu includes it (cuda_util.kernel_source splices it in, in order).

// ------------------------------------------------------------------------------ matvec
// Segment s of a matvec stage: MV_SEG0 + s * SEG_STRIDE + field
__device__ __forceinline__ const i64* seg(const i64* st, int s) { return st + MV_SEG0 + s * SEG_STRIDE; }

// Stage input for the embedding mode: the embedding row, L copies (one a lane), is also the
// residual stream (MV_EMB_OUT). Every block writes its own slice of those K L floats, as float4s:
// readers wait on this stage's count of all blocks, transitively. (Block 0 alone, one float a
// thread a pass, cost a load round trip a pass, serialized: 77 of them for laneformer-2b.)
struct EmbSlice { int lo, hi; uint2 first; };  // float4s [lo, hi) of the K L; this thread's first, raw
// Before the stage's wait (the table and the token are known): this thread's first float4 in flight.
__device__ __forceinline__ EmbSlice emb_prefetch(const Ctx& c) {
    const i64* st = s_desc[c.dcur];
    EmbSlice e{0, 0, make_uint2(0u, 0u)};
    if (!((st[MV_IN_MODE] & IN_EMBED) && st[MV_EMB_OUT])) return e;
    const int K4 = (int)(st[MV_K] >> 2), n4 = K4 * (int)st[MV_L], per = (n4 + (int)gridDim.x - 1) / (int)gridDim.x;
    e.lo = min(n4, per * (int)blockIdx.x); e.hi = min(n4, e.lo + per);
    const uint2* tab = (const uint2*)((const u16*)st[MV_EMB_TABLE] + (i64)c.tok * 4 * K4);
    if (e.lo + (int)threadIdx.x < e.hi) e.first = tab[(e.lo + threadIdx.x) % K4];
    return e;
}
// After the input row's loads, so that the prefetch's round trip overlapped theirs: the stores (a
// slice wider than the block's threads, K L > 4 NT grid, loads the rest here).
__device__ void write_embedding(const Ctx& c, const EmbSlice& e) {
    const i64* st = s_desc[c.dcur];
    const int K4 = (int)(st[MV_K] >> 2);
    const uint2* tab = (const uint2*)((const u16*)st[MV_EMB_TABLE] + (i64)c.tok * 4 * K4);
    float4* out = (float4*)st[MV_EMB_OUT];
    for (int j = e.lo + threadIdx.x; j < e.hi; j += NT) {
        const uint2 w = j < e.lo + NT ? e.first : tab[j % K4];
        out[j] = make_float4(bf_lo(w.x), bf_hi(w.x), bf_lo(w.y), bf_hi(w.y));
    }
}

// Does this matvec stage run at token iteration `it`? (The producer's walk and the consumers'
// must agree exactly: they count ring slots independently.)
__device__ __forceinline__ bool mv_runs(const i64* st, int it, const Ctx& c) {
    if ((int)st[S_TYPE] != ST_MATVEC) return false;
    const int flags = (int)st[MV_FLAGS];
    if ((flags & MVF_SKIP_PROMPT) && !c.logits_mode && it < c.P - 1) return false;
    return !((c.skipmask >> ((flags & MVF_LOGITS) ? 5 : 1)) & 1);
}

// ---------------------------------------------------------------- matvec (consumer warps)
// x of each lane the block touches, in shared memory at xs + (lane - first lane) * K, split in
// halves so that a warp's 16-byte reads are conflict-free: chunk i (x[8i..8i+7]) has its first
// four values at float4 i of the lower half and the last four at float4 i of the upper half.
// x_f4: where float4 i4 of the row (x[4 i4 .. 4 i4 + 3]) lives: half (i4 & 1) of chunk i4 / 2.
__device__ __forceinline__ float4* x_f4(float* x, int K, int i4) {
    return (float4*)(x + ((i4 & 1) ? (K >> 1) : 0) + 4 * (i4 >> 1));
}

// XV: float4 of the input row per thread in flight at once: one round trip for K <= XV * 4 * NT.
// 7 loads down's 8192 in one round trip at 10 warps: no spills in bench-2b's v21 build (the generic
// and trace builds spill) and level with 6 (session 12); 8 spills.
#ifndef XV
#define XV 6
#endif
// X_CPASYNC (an experiment, off; KOG_HOPPER_X_CPASYNC=1): a stage's input row (not an embedding
// row) comes by cp.async straight into shared memory: one round trip for any K (down's 8192 takes
// two with XV 6 at 10 warps). Measured 13% slower (perf notes session 9).
#ifndef X_CPASYNC
#define X_CPASYNC 0
#endif
// NORM_SMEM (the backend sets it by default since v17; KOG_HOPPER_NORM_SMEM=0 for wpre): the norm
// weights that a stage loads before its wait go to shared memory by cp.async (after the x rows)
// instead of to wpre, which lives in local memory (6 LDL after the wait, sass_report); kept in
// registers instead they cost 56 bytes of spills.
#ifndef NORM_SMEM
#define NORM_SMEM 0
#endif

// TAG_DOWN (an experiment, off; KOG_HOPPER_TAG_DOWN=1; schedule.tag_pair_outputs): readiness in
// the data for down_proj's input. gate/up writes each SwiGLU value with a parity in its lowest
// mantissa bit (MVF_TAG_OUT; consecutive writes of the buffer alternate, MV_TAG), and down_proj
// (MVF_TAG_IN) waits on the stage before gate/up instead of gate/up itself, then re-reads each
// float4 of its row until all four values carry this write's parity: the input loads are the poll,
// so the boundary loses gate/up's release and the poll's round trip. A 32-bit store is single-copy
// atomic, so a value read with the new parity is the new value. Safe to overwrite next layer: a
// block writes the buffer again only after every block has finished this down_proj (the next
// layer's qkv waits on its count). The parity costs the value its last mantissa bit.
#ifndef TAG_DOWN
#define TAG_DOWN 0
#endif
#if TAG_DOWN && X_CPASYNC
#error "TAG_DOWN checks the input's parity on the register path only: not with X_CPASYNC"
#endif
__device__ __forceinline__ u32 tag_parity_of(u32 t, int it) {  // t: this write's index k | writes a token n << 16
    return ((u32)it * (t >> 16) + (t & 0xffffu)) & 1u;        // (it n + k) & 1
}
__device__ __forceinline__ u32 tag_parity(const i64* st, int it) { return tag_parity_of((u32)st[MV_TAG], it); }
// TAG_QKV (default since v31; KOG_HOPPER_TAG_QKV=0 off; schedule.tag_attention_inputs): the q/k/v
// stage stores its outputs with the parity of this write (MVF_TAG_OUT, every row's epilogue), and
// the attention after it takes them when they carry it instead of waiting on the stage's count.
#ifndef TAG_QKV
#define TAG_QKV 0
#endif
#ifndef TAG_QKV_WAIT
#define TAG_QKV_WAIT 0
#endif
// TAG_OPROJ (default since v31; KOG_HOPPER_TAG_OPROJ=0 off; schedule.tag_attention_outputs): the
// attention stores its output with this write's parity (AT_OTAG) and o_proj takes its input row as
// TAG_DOWN's down_proj does (MVF_TAG_IN: waits on the stage before the attention, then re-reads
// what does not carry the parity yet)
#ifndef TAG_OPROJ
#define TAG_OPROJ 0
#endif
// TAG_X (default since v32; KOG_HOPPER_TAG_X=0 off; schedule.tag_residual_outputs): readiness in the
// data for the residual stream between o_proj and the MLP. o_proj stores x with the parity of this
// write (MVF_TAG_OUT, its parity from MV_OTAG: MV_TAG already holds its input's, TAG_OPROJ), and the
// gate/up stage after it (MVF_TAG_IN, a normed input row) waits on the attention's count instead of
// o_proj's, then polls each float4 of x before it enters the sum of squares. Takes o_proj's release
// (a matvec stage's fence, 1.0-1.4 us) and the counter's round trip off every layer's boundary.
#ifndef TAG_X
#define TAG_X 0
#endif
#if TAG_X && X_CPASYNC
#error "TAG_X checks the input's parity on the register path only: not with X_CPASYNC"
#endif
#define TAG_IN (TAG_DOWN || TAG_OPROJ || TAG_X)  // some matvec stage may take a tagged input row
// the parity a stage writes its outputs with: MV_OTAG where a stage's input and output are both
// tagged (TAG_X's o_proj); the same value as MV_TAG otherwise (schedule sets both)
__device__ __forceinline__ u32 tag_out_parity(const i64* st, int it) { return tag_parity_of((u32)st[TAG_X ? MV_OTAG : MV_TAG], it); }
#if TAG_OPROJ && X_CPASYNC
#error "TAG_OPROJ checks the input's parity on the register path only: not with X_CPASYNC"
#endif
__device__ __forceinline__ float with_parity(float v, u32 p) { return __uint_as_float((__float_as_uint(v) & ~1u) | p); }
__device__ __forceinline__ bool has_parity(float4 v, u32 p) {
    return (((__float_as_uint(v.x) ^ p) | (__float_as_uint(v.y) ^ p) | (__float_as_uint(v.z) ^ p) | (__float_as_uint(v.w) ^ p)) & 1u) == 0;
}
__device__ __forceinline__ float4 ldcg4_volatile(const float4* p) {  // a load at L2 the compiler keeps (not a poll: ld_poll4)
    float4 r;
    asm volatile("ld.global.cg.v4.f32 {%0,%1,%2,%3}, [%4];" : "=f"(r.x), "=f"(r.y), "=f"(r.z), "=f"(r.w) : "l"(p));
    return r;
}

// DEFER_NORM (the backend's default since v21, +1.6% on bench-2b; KOG_HOPPER_DEFER_NORM=0 for the
// normalise pass, which a block with more than DEFER_NORM_LANES input rows also gets): a normed
// stage computes W (x / d * w) as (W (x * w)) / d. The loader stores x * w as its loads land and
// leaves each warp's partial sum of squares in s_normsq; the division by d = sqrt(mean(x^2) + eps)
// moves to each row group's epilogue. The block reduction (three barriers) and the separate
// normalise pass leave the stage's critical path: per the trace they are ~0.4 + ~0.5 us of the
// ~2 us from a normed stage's wait to its first item (qkv, gate/up). The rounding differs from the
// reference's (one division of the dot product instead of one per element): within fp32 noise.
#ifndef DEFER_NORM
#define DEFER_NORM 0
#endif
#define DEFER_NORM_LANES 16  // input rows (lanes) of one block a deferred-norm stage may take (backend.py checks)
#if DEFER_NORM
__shared__ float s_normsq[DEFER_NORM_LANES * NW];  // [lane of the block][warp]: partial sums of x^2
#endif
#if DEFER_NORM && X_CPASYNC
#error "DEFER_NORM multiplies by the norm weights on the register path only: not with X_CPASYNC"
#endif

// SPLITK_DOWN (the default for Llama-family layers since v28; KOG_HOPPER_SPLITK_DOWN;
// schedule.fuse_down_splitk): gate/up and down_proj as one stage. A block keeps its SwiGLU values
// in shared memory and streams the same rows of down_proj's transpose, then adds its partial of
// every output to the stage's accumulator in 64-bit fixed point (2^-32) with integer atomics: an
// exact sum, whatever order the blocks add in.
// The residual x + acc stays pending until a later stage's residual epilogue writes x; loaders
// (MV_PEND) and residuals (MV_RES_PEND) in between add acc themselves. acc is [2][D], by the token's
// parity; each block zeroes its slice of the other parity for the next token.
#ifndef SPLITK_DOWN
#define SPLITK_DOWN 0
#endif
#define PEND_V 2  // float4s of a pending input row per thread (schedule.SPLITK_PEND_V: K <= 8 NT)
// SPLITK_PAIRS (with SPLITK_DOWN; KOG_HOPPER_SPLITK_PAIRS): the grid runs in clusters of 2 and a
// pair of blocks halves the split-K stage's atomics. Each block stores its partials of the
// partner's half of the outputs into the partner's shared memory (distributed shared memory, at
// PAIR_RBUF_OFF of the dynamic shared memory: the end of the stage scratch), arrives on the
// partner's pair_bar, waits on its own, and adds both blocks' partials of its half: each converted
// to fixed point on its own, so the integer sums, and every bit after them, are those without pairs.
#ifndef SPLITK_PAIRS
#define SPLITK_PAIRS 0
#endif
// DEBUG_SPLITK (what-if builds for the perf notes, never for use; KOG_HOPPER_DEFINES=DEBUG_SPLITK=n;
// the results are wrong on purpose): bit 0 the split-K stage adds no partials (no atomics), bit 1
// no loader adds the pending sum (no 16 KB accumulator reads), bit 2 no residual adds it (o_proj's
// rows). They ask which part of the split-K stage's cost against the unfused stages is the
// atomics and which the pending reads.
#ifndef DEBUG_SPLITK
#define DEBUG_SPLITK 0
#endif
// SPLITK_CARRY (with SPLITK_DOWN; KOG_HOPPER_SPLITK_CARRY; schedule.fuse_down_splitk(carry=True)):
// the split-K accumulator starts from x. The stage that writes x before the split-K stage also
// stores each row's value in fixed point into it (MV_CARRY_OUT); readers of the pending x (MVF_CARRY)
// take the accumulator alone (a loader's 16 KB, not 24 with x), and the split-K stage zeroes
// nothing (every entry is stored again before the next token's adds).
#ifndef SPLITK_CARRY
#define SPLITK_CARRY 0
#endif
#if SPLITK_CARRY && !SPLITK_DOWN
#error "SPLITK_CARRY starts the split-K accumulators from x: only with SPLITK_DOWN"
#endif
#if SPLITK_PAIRS && !SPLITK_DOWN
#error "SPLITK_PAIRS pairs the split-K stage's partials: only with SPLITK_DOWN"
#endif
#if SPLITK_PAIRS
#ifndef PAIR_RBUF_OFF
#error "SPLITK_PAIRS needs PAIR_RBUF_OFF, the receive buffer's byte offset in dynamic shared memory"
#endif
__shared__ u64 pair_bar;  // one phase a split-K stage: the partner's partials of this block's half landed
#endif
// SPLITK_BULK (with SPLITK_DOWN; KOG_HOPPER_SPLITK_BULK): the block's partials, as fixed point, go
// to shared memory (SPLITK_STAGE_OFF of the dynamic shared memory, the end of the stage scratch)
// and one bulk reduction of the copy engine adds them all into the accumulator at L2
// (cp.reduce.async.bulk ... add.u64), instead of 2,048 red instructions a block on bench-2b;
// thread 0 waits for its completion before the stage's end, so the release orders it.
#ifndef SPLITK_BULK
#define SPLITK_BULK 0
#endif
#if SPLITK_BULK && (!SPLITK_DOWN || SPLITK_PAIRS || !defined(SPLITK_STAGE_OFF))
#error "SPLITK_BULK needs SPLITK_DOWN and SPLITK_STAGE_OFF, and not SPLITK_PAIRS"
#endif
#if SPLITK_DOWN && X_CPASYNC
#error "SPLITK_DOWN adds the pending sums on the register path only: not with X_CPASYNC"
#endif
static_assert(XV >= PEND_V, "the pending sums are added in the loader's first batch");
// SPLITK_COUNT (with SPLITK_DOWN; KOG_HOPPER_SPLITK_COUNT, an experiment, off: -2.0% on an H100, perf
// notes session 31; schedule.count_splitk_inputs):
// readiness in the data for the split-K sum. Every block adds to every accumulator word (a block
// without down items adds zeros) its partial rounded to 2^-24 in the upper 56 bits plus 1 in the
// low 8: a word whose low 8 bits read gridDim.x (< 256) holds every block's partial, since adds to
// one word are seen in one order. The loader of the pending row after the split-K stage
// (MVF_COUNT_IN: the next q/k/v stage, or the LM head) waits on the stage before the split-K stage
// instead of it and re-reads each word until its count is complete: the split-K stage's release
// (a matvec stage's fence, 1.0-1.4 us) and the counter's round trip leave the layer's boundary. The
// sum stays exact and order-free (the same bits whatever order the blocks add in), at 2^-24
// instead of 2^-32; the readers drop the count (fix2f).
#ifndef SPLITK_COUNT
#define SPLITK_COUNT 0
#endif
#if SPLITK_COUNT && (!SPLITK_DOWN || SPLITK_PAIRS || SPLITK_BULK || SPLITK_CARRY || DYN_POOL || (DEBUG_SPLITK & 1))
#error "SPLITK_COUNT counts the plain split-K atomics: with SPLITK_DOWN, not PAIRS, BULK, CARRY, a pool or DEBUG_SPLITK bit 0"
#endif
__device__ __forceinline__ i64 f2fix(float v) {  // round to nearest in units of 2^-32 (schedule.FIX_BITS)
    i64 r;
#if SPLITK_COUNT
    asm("cvt.rni.s64.f32 %0, %1;" : "=l"(r) : "f"(v * 16777216.0f));  // 2^-24, then this block's count
    return (i64)((u64)r << 8) + 1;
#else
    asm("cvt.rni.s64.f32 %0, %1;" : "=l"(r) : "f"(v * 4294967296.0f));
    return r;
#endif
}
__device__ __forceinline__ float fix2f(i64 v) {
    float r;
    asm("cvt.rn.f32.s64 %0, %1;" : "=f"(r) : "l"(SPLITK_COUNT ? v & ~255LL : v));  // (the count dropped)
    return r * 2.3283064365386963e-10f;  // 2^-32: exact
}
// SPLITK_COUNT: whether both words carry every block's add
__device__ __forceinline__ bool counted(I64x2 v, u32 nb) { return ((u32)v.a & 255u) == nb && ((u32)v.b & 255u) == nb; }
__device__ __forceinline__ void red_add_i64(i64* p, i64 v) {  // two's complement: the u64 add is the s64 add
    asm volatile("red.relaxed.gpu.global.add.u64 [%0], %1;" :: "l"(p), "l"(v) : "memory");
}
__device__ __forceinline__ I64x2 ldcg_i64x2(const i64* p) {  // written inside the launch: at L2
    I64x2 r;
    asm volatile("ld.global.cg.v2.s64 {%0,%1}, [%2];" : "=l"(r.a), "=l"(r.b) : "l"(p));
    return r;
}
// The accumulator of this token's parity (MV_ACC, MV_PEND or MV_RES_PEND: [2][D] int64)
// SPLITK_PERM (with SPLITK_DOWN; KOG_HOPPER_SPLITK_PERM): the accumulators' int64s in the loaders'
// order. A loader thread takes one float4 of the pending row, so 32 bytes of int64s, in two 16-byte
// loads; in output order a warp's load instruction then touches all 32 sectors of its 1 KB and
// uses half of each (twice the L2 traffic of the data). Permuted, each block of 128 values (a
// warp's 32 float4s) holds first the pairs (4q, 4q + 1) of its float4s, then the pairs (4q + 2,
// 4q + 3): each load instruction reads 512 contiguous bytes. A warp's atomics still cover two runs
// of 128 bytes. The accumulators are padded to a multiple of 128 values (schedule.acc_len).
#ifndef SPLITK_PERM
#define SPLITK_PERM 0
#endif
#if SPLITK_PERM && (!SPLITK_DOWN || SPLITK_BULK)
#error "SPLITK_PERM permutes the split-K accumulators: with SPLITK_DOWN, not with SPLITK_BULK"
#endif
__device__ __forceinline__ int acc_ix(int i) {  // where output i's int64 lives in an accumulator
#if SPLITK_PERM
    return (i & ~127) | ((i & 2) << 5) | ((i >> 1) & 62) | (i & 1);
#else
    return i;
#endif
}
__device__ __forceinline__ i64 acc_len(i64 D) { return SPLITK_PERM ? (D + 127) & ~127LL : D; }
__device__ __forceinline__ const i64* acc_of(const i64* st, int slot, int it) {
    const i64* a = (const i64*)st[slot];
    return a ? a + (it & 1) * acc_len(st[MV_ACC_D]) : nullptr;
}

// NORM_RCP (the backend sets it by default since v18b; KOG_HOPPER_NORM_RCP=0 for the division):
// the normalise pass divides by d through d's correctly rounded reciprocal r and one FMA residual
// (Markstein): q = x r, x / d = q + (x - q d) r, rounded once; the correctly rounded quotient for
// normal operands, as the division gives, in 3 instructions instead of the division's inline fast
// path and slow-path check (24 divisions a thread, ~6 KB of code on every normed stage's path).
#ifndef NORM_RCP
#define NORM_RCP 0
#endif
__device__ __forceinline__ float div_by(float x, float d, float r) {
    if (!NORM_RCP) return x / d;
    const float q = __fmul_rn(x, r);
    return fmaf(fmaf(-q, d, x), r, q);
}

// A float4's squares added to ss in x, y, z, w order (every loader sums in this order), and a float4
// times 4 bf16 norm weights.
__device__ __forceinline__ float add_sq4(const float4& v, float ss) {
    ss = fmaf(v.x, v.x, ss); ss = fmaf(v.y, v.y, ss); ss = fmaf(v.z, v.z, ss); return fmaf(v.w, v.w, ss);
}
__device__ __forceinline__ void mul_w4(float4& v, uint2 w) {
    v.x *= bf_lo(w.x); v.y *= bf_hi(w.x); v.z *= bf_lo(w.y); v.w *= bf_hi(w.y);
}

// The norm weights of float4 i of the row (batch slot u): from this thread's shared-memory copies
// (NORM_SMEM), its preloaded registers (wpre, the first batch only), or global memory.
__device__ __forceinline__ uint2 norm_w4(const u16* nws, const uint2* wpre, const u16* nw, int i, int u) {
    return (NORM_SMEM && nws) ? *(const uint2*)(nws + 4 * i) : wpre ? wpre[u] : *(const uint2*)(nw + 4 * i);
}

// Loads are issued in batches of XV per thread before any is used: a loop of one load per
// iteration costs a full L2 round trip per iteration (K = 8192: six) on every stage's critical path.
// wpre: this thread's norm weights when the caller loaded them before its wait (null: load here).
// (A pointer: wpre lives in local memory. Kept in registers instead, the kernel spills 56 bytes
// elsewhere, in the attention and the stage loop.) nws (NORM_SMEM): the same weights copied by this
// thread into shared memory with cp.async (null: not there); each thread reads only its own copies.
__device__ __forceinline__ void mv_load_x(const Ctx& c, int lane, int li, float* x, const uint2* wpre, const u16* nws) {
    const i64* st = s_desc[c.dcur];
    const int K = (int)st[MV_K], K4 = K >> 2;
    const int mode = (int)st[MV_IN_MODE];
    const float* in = (const float*)st[MV_IN] + (i64)lane * K;
    const u16* tab = (const u16*)st[MV_EMB_TABLE] + (i64)c.tok * K;
    const u16* nw = (const u16*)st[MV_NORM_W] + lane * st[MV_NORM_WL];
    const int tid = threadIdx.x;
    // (not under the benchmark's masks that skip its writer or the waits: polls_on, context.cuh)
    const bool tagged = TAG_IN && ((int)st[MV_FLAGS] & MVF_TAG_IN) && polls_on(c);
    const u32 par = tagged ? tag_parity(st, c.it) : 0u;
    float ss = 0.f;
    if (X_CPASYNC && !(mode & IN_EMBED)) {
        // the row by cp.async: every float4 in flight at once whatever K (no registers held), and
        // each thread then reads back only the float4s it copied itself (no barrier needed)
        for (int i = tid; i < K4; i += NT) cp_async16(x_f4(x, K, i), (const float4*)in + i);
        cp_commit();
        cp_wait_all();
        if (mode & IN_NORM)
            for (int i = tid; i < K4; i += NT) {  // the same order of additions as the register path
                ss = add_sq4(*x_f4(x, K, i), ss);
            }
    } else {  // the register path: XV float4 per thread in flight, then stored
#if SPLITK_DOWN
        // a pending sum (MV_PEND): its float4s' accumulators in flight with the row's (K4 <= PEND_V NT)
        const i64* pend = DEBUG_SPLITK & 2 ? nullptr : acc_of(st, MV_PEND, c.it);
        // SPLITK_CARRY: the accumulator holds x + the partials, so x itself is not read
        const bool carried = SPLITK_CARRY && pend && ((int)st[MV_FLAGS] & MVF_CARRY);
        // SPLITK_COUNT: this loader polls the accumulator's counts (not under the benchmark's masks
        // that skip its writer or the waits: polls_on)
        const bool counting = SPLITK_COUNT && ((int)st[MV_FLAGS] & MVF_COUNT_IN) && polls_on(c);
        I64x2 pa[PEND_V][2];
#endif
        for (int base = 0; base < K4; base += XV * NT) {
            float4 v[XV];
#pragma unroll
            for (int u = 0; u < XV; ++u) {
                const int i = base + u * NT + tid;
                if (i < K4) {
                    if (mode & IN_EMBED) {  // the raw bf16 bits: converted below, after every load is issued
                        const uint2 e = *(const uint2*)(tab + 4 * i);
                        v[u] = make_float4(__uint_as_float(e.x), __uint_as_float(e.y), 0.f, 0.f);
                    } else {
#if SPLITK_DOWN
                        if (carried) v[u] = make_float4(0.f, 0.f, 0.f, 0.f);  // + the accumulator below
                        else
#endif
                        v[u] = __ldcg((const float4*)in + i);
                    }
                }
            }
#if SPLITK_DOWN
            // after the x row's loads: issued before them, their conversions (hoisted by the compiler)
            // made the warp wait one round trip before the x loads left (session 22)
            if (pend && base == 0) {
#pragma unroll
                for (int u = 0; u < PEND_V; ++u) {
                    const int i = u * NT + tid;
                    if (i < K4) { pa[u][0] = ldcg_i64x2(pend + acc_ix(4 * i)); pa[u][1] = ldcg_i64x2(pend + acc_ix(4 * i + 2)); }
                }
            }
#endif
            const bool defer = DEFER_NORM && (mode & IN_NORM);
#if TAG_X
            const bool held = tagged && (mode & IN_NORM);  // TAG_X: summed after the stale values are re-read (below)
#else
            constexpr bool held = false;
#endif
            if (defer && NORM_SMEM && nws && base == 0) cp_wait_all();  // this thread's own norm-weight copies
#pragma unroll
            for (int u = 0; u < XV; ++u) {
                const int i = base + u * NT + tid;
                if (i < K4) {
                    if (mode & IN_EMBED) {
                        const u32 ex = __float_as_uint(v[u].x), ey = __float_as_uint(v[u].y);
                        v[u] = make_float4(bf_lo(ex), bf_hi(ex), bf_lo(ey), bf_hi(ey));
                    }
#if SPLITK_COUNT
                    if (counting && pend && u < PEND_V && base == 0) {  // every block's add in each word
                        while (!counted(pa[u][0], gridDim.x)) pa[u][0] = ld_poll_i64x2(pend + acc_ix(4 * i));
                        while (!counted(pa[u][1], gridDim.x)) pa[u][1] = ld_poll_i64x2(pend + acc_ix(4 * i + 2));
                    }
#endif
#if SPLITK_DOWN
                    if (pend && u < PEND_V && base == 0) {  // x + acc: the residual as it stands
                        v[u].x += fix2f(pa[u][0].a); v[u].y += fix2f(pa[u][0].b);
                        v[u].z += fix2f(pa[u][1].a); v[u].w += fix2f(pa[u][1].b);
                    }
#endif
                    if (!held) {
                        ss = add_sq4(v[u], ss);
                        if (defer) mul_w4(v[u], norm_w4(nws, wpre, nw, i, u));  // x * w now, the division by d in the epilogue
                    }
                    *x_f4(x, K, i) = v[u];
                }
            }
        }
    }
    if (TAG_IN && tagged) {  // TAG_DOWN / TAG_OPROJ / TAG_X: re-read this thread's stale float4s
        // (one float4 at a time: re-reading a whole batch in flight each round measured 0.9% slower
        // than the default in session 11, where this version was +0.3% in session 10: the rounds'
        // re-reads of the whole row load L2 while the rings stream)
#pragma unroll 1
        for (int i = tid; i < K4; i += NT) {
            float4* p = x_f4(x, K, i);
            float4 v = *p;
            if (has_parity(v, par)) continue;
            do { v = ld_poll4((const float4*)in + i); } while (!has_parity(v, par));
            *p = v;
        }
#if TAG_CHECK
        spin_acquire(c.chk_ctr + c.chk_s - 1, gridDim.x * (u32)(c.it + 1));  // the writer's (TAG_OPROJ: the attention)
        for (int i = tid; i < K4; i += NT) {
            const float4 v = *x_f4(x, K, i), w = ld_poll4((const float4*)in + i);
            const u32 tw = (u32)st[MV_TAG];
            tag_check("in.x", c.chk_s, c.it, 4 * i, v.x, w.x, tw, par); tag_check("in.y", c.chk_s, c.it, 4 * i + 1, v.y, w.y, tw, par);
            tag_check("in.z", c.chk_s, c.it, 4 * i + 2, v.z, w.z, tw, par); tag_check("in.w", c.chk_s, c.it, 4 * i + 3, v.w, w.w, tw, par);
        }
#endif
#if TAG_X
        if (mode & IN_NORM) {  // the sum of squares (and x * w) now that each value is this write's: the
            // float4s this thread stored, in the loader's order, so the sum has the untagged build's bits
#pragma unroll 1
            for (int i = tid, u = 0; i < K4; i += NT, ++u) {
                float4* p = x_f4(x, K, i);
                float4 v = *p;
                ss = add_sq4(v, ss);
                if (DEFER_NORM) { mul_w4(v, norm_w4(nws, wpre, nw, i, u)); *p = v; }
            }
        }
#endif
    }
    TMARK(c, 14);  // thread 0's input loads landed
#if DEFER_NORM
    if (mode & IN_NORM) {  // the warp's partial sum of squares; the caller's barrier publishes it
        ss = warp_sum(ss);
        if ((tid & 31) == 0) s_normsq[li * NW + (tid >> 5)] = ss;
        return;
    }
#endif
    if (mode & IN_NORM) {
        const float tot = block_sum(ss);  // includes the barrier
        TMARK(c, 15);
        const float d = sqrtf(tot / (float)K + fslot(st, MV_EPS));  // x / d * w, as the reference rounds
        const float rd = 1.0f / d;  // NORM_RCP
        if (NORM_SMEM && nws) cp_wait_all();
        for (int base = 0; base < K4; base += XV * NT) {
            uint2 w[XV];
#pragma unroll
            for (int u = 0; u < XV; ++u) {
                const int i = base + u * NT + tid;
                if (i < K4) w[u] = norm_w4(nws, wpre, nw, i, u);
            }
#pragma unroll
            for (int u = 0; u < XV; ++u) {
                const int i = base + u * NT + tid;  // this thread stored float4 i above
                if (i < K4) {
                    float4* p = x_f4(x, K, i);
                    float4 xv = *p;
                    xv.x = div_by(xv.x, d, rd) * bf_lo(w[u].x); xv.y = div_by(xv.y, d, rd) * bf_hi(w[u].x);
                    xv.z = div_by(xv.z, d, rd) * bf_lo(w[u].y); xv.w = div_by(xv.w, d, rd) * bf_hi(w[u].y);
                    *p = xv;
                }
            }
        }
    }
}

// LANES_LOAD (KOG_HOPPER_LANES_LOAD; the backend defines it where a block of a matvec stage takes
// input rows of several lanes, as Laneformer's blocks do at lane boundaries): such a block loads
// all its lanes' rows as one batch, every load in flight at once with the norm weights of the
// lanes after the first, instead of one or two round trips a lane. Session 15's trace: on
// laneformer-2b the 20 of 132 q/k/v blocks with two lanes loaded in 2.73 us against 1.32 and
// finished 1.9 us after the median block, most of the stage's spread. Measured +0.7% alone, +0.3%
// with the wide items; normed loads of two lanes still take ~2.7 us (twice the bytes through the
// SM's ingress while its ring streams, likely; an L2 prefetch of the later lanes' norm weights
// before the wait changed nothing, session 15, and is gone), so such blocks are also dealt fewer
// rows (schedule._deal_rows, KOG_HOPPER_LANE_PAD_ROWS).
#ifndef LANES_LOAD
#define LANES_LOAD 0
#endif
#if LANES_LOAD
// Rows of lanes lane0 .. lane0 + nl - 1, contiguous in the input ([L][K]): float4 f of the batch is
// float4 f % K4 of lane f / K4. nl K4 <= XV NT, and K4 a multiple of 32, so that the 32 float4s
// of a warp's batch slot lie in one lane: the warp's sums of squares go lane by lane into s_normsq
// (zeroed first: a warp need not touch every lane), as mv_load_x leaves them for one lane. Plain
// or normed input (deferred norm only); lane 0's norm weights from shared memory (nws) when there.
__device__ __forceinline__ void mv_load_x_lanes(const Ctx& c, int nl, float* xs, const u16* nws) {
    const i64* st = s_desc[c.dcur];
    const int K = (int)st[MV_K], K4 = K >> 2, lane0 = c.blk.y;
    const bool normed = DEFER_NORM && ((int)st[MV_IN_MODE] & IN_NORM);  // (the caller checks)
    const float4* in = (const float4*)((const float*)st[MV_IN] + (i64)lane0 * K);
    const i64 nwl = st[MV_NORM_WL];
    const u16* nw = (const u16*)st[MV_NORM_W] + lane0 * nwl;
    const int tid = threadIdx.x, warp = tid >> 5, ln = tid & 31;
    float4 v[XV];
    uint2 w[XV];
#pragma unroll
    for (int u = 0; u < XV; ++u) {
        const int f = u * NT + tid;
        if (f < nl * K4) {
            const int l = f / K4, i = f - l * K4;
            v[u] = __ldcg(in + f);
            if (normed && !(nws && l == 0)) w[u] = *(const uint2*)(nw + l * nwl + 4 * i);
        }
    }
    if (normed) {
        if (nws) cp_wait_all();  // this thread's own copies of lane 0's norm weights
#if DEFER_NORM
        if (ln == 0)
            for (int l = 0; l < nl; ++l) s_normsq[l * NW + warp] = 0.f;
#endif
    }
    float ss = 0.f;
    int cur = 0;  // the lane ss sums (the same in the whole warp)
#pragma unroll
    for (int u = 0; u < XV; ++u) {
        if (u * NT + 32 * warp < nl * K4) {  // the whole warp or none of it
            const int f = u * NT + tid, l = f / K4, i = f - l * K4;
            if (normed) {
#if DEFER_NORM
                if (l != cur) {
                    ss = warp_sum(ss);
                    if (ln == 0) s_normsq[cur * NW + warp] += ss;
                    ss = 0.f;
                    cur = l;
                }
#endif
                ss = add_sq4(v[u], ss);
                mul_w4(v[u], (nws && l == 0) ? *(const uint2*)(nws + 4 * i) : w[u]);
            }
            *x_f4(xs + l * K, K, i) = v[u];
        }
    }
#if DEFER_NORM
    if (normed) {
        ss = warp_sum(ss);
        if (ln == 0) s_normsq[cur * NW + warp] += ss;
    }
#endif
    TMARK(c, 14);  // thread 0's input loads landed
}
#endif

// IN_ATTN: x of lane `lane` = the attention output, combined here from the attention's chunk
// partials (m, l, o): x[h][d] = sum_k exp(m_k - M) o_k[d] / sum_k exp(m_k - M) l_k.
// wk: H * MAXCH * 2 floats of shared memory for the chunk weights.
__device__ void mv_load_attn(const Ctx& c, int lane, float* x, float* wk) {
    const i64* at = s_desc[c.dprev];  // MV_ATTN: the attention is always the stage just before (fuse_attention_combine)
    const int K = (int)s_desc[c.dcur][MV_K];
    const int H = AT_I(at, H), hd = AT_I(at, HD), MAXCH = AT_I(at, MAXCH);
    int start, nch, csz;
    att_chunks(at, c.pos, start, nch, csz);
    const float* ml = (const float*)at[AT_PART_ML] + (i64)lane * H * MAXCH * 2;
    const float* po = (const float*)at[AT_PART_O] + (i64)lane * H * MAXCH * hd;
    for (int i = threadIdx.x; i < H * nch; i += NT) {
        const int h = att_div(i, nch), k = i - h * nch;
        wk[2 * i] = ldf(ml + (h * MAXCH + k) * 2);
        wk[2 * i + 1] = ldf(ml + (h * MAXCH + k) * 2 + 1);
    }
    csync();
    for (int h = threadIdx.x; h < H; h += NT) {
        float* w = wk + 2 * h * nch;
        float M = -__int_as_float(0x7f800000);
        for (int k = 0; k < nch; ++k) M = fmaxf(M, w[2 * k]);
        float den = 0.f;
        for (int k = 0; k < nch; ++k) { const float e = expf(w[2 * k] - M); w[2 * k] = e; den = fmaf(e, w[2 * k + 1], den); }
        const float inv = 1.0f / den;
        for (int k = 0; k < nch; ++k) w[2 * k] *= inv;
    }
    csync();
    for (int i4 = threadIdx.x; i4 < (K >> 2); i4 += NT) {  // 4 values of one head (hd % 8 == 0)
        const int i = 4 * i4, h = i / hd, d = i - h * hd;
        const float* w = wk + 2 * h * nch;
        const float4* o = (const float4*)(po + (i64)h * MAXCH * hd + d);
        float4 s = make_float4(0.f, 0.f, 0.f, 0.f);
        for (int k0 = 0; k0 < nch; k0 += 6) {  // 6 loads in flight before any is used (a rolled loop waits on each; 8 spill)
            float4 v[6];
#pragma unroll
            for (int k = 0; k < 6; ++k)
                if (k0 + k < nch) v[k] = __ldcg(o + (i64)(k0 + k) * (hd >> 2));
#pragma unroll
            for (int k = 0; k < 6; ++k) {
                if (k0 + k >= nch) break;
                const float wk_ = w[2 * (k0 + k)];
                s.x = fmaf(wk_, v[k].x, s.x); s.y = fmaf(wk_, v[k].y, s.y); s.z = fmaf(wk_, v[k].z, s.z); s.w = fmaf(wk_, v[k].w, s.w);
            }
        }
        *x_f4(x, K, i4) = s;
    }
}

// DEBUG_DOT (what-if builds for the perf notes, never for use; KOG_HOPPER_DEFINES=DEBUG_DOT=n; the
// results are wrong on purpose): 1 the dot loop reads no input row from shared memory (constants
// instead), 2 a warp reads and multiplies only its first row of each pair. They ask how much of a
// consumer's time per item is the input row's shared-memory reads against the weights'.
#ifndef DEBUG_DOT
#define DEBUG_DOT 0
#endif

// LANE_RESIDUAL (KOG_HOPPER_FUSE_LANE_RESIDUAL, the default since session 14; the backend defines
// it when a stage has a fused segment): Laneformer's "delayed" lane_residual, x[l] += fresh[l] +
// sum_{j != l} delayed[j], at the end of the matvec stage that writes fresh
// (schedule._fuse_lane_residual), without a stage boundary: after the block's last item, a pass
// over the block's own rows of fresh (binfo's w: first flattened row lane * N + r | count << 16,
// schedule.stream_list), every row's loads in flight at once, the lanes added in lane order as
// the elementwise stage adds them. Session 13 measured the first form (the residual in every row
// group's epilogue, its state in the item loop): -4.9% on laneformer-2b, ~1.1 us a stage from the
// item loop's larger code alone and ~0.6 us a row group of epilogue waits. This form leaves the
// item loop as the unfused build's: +2.5% on laneformer-2b (session 14; +5.4% with RMS_BLOCK).
#ifndef LANE_RESIDUAL
#define LANE_RESIDUAL 0
#endif
#if LANE_RESIDUAL
// Rows [start, start + cnt) of the flattened (lane, row) index of fresh: x[l][r] += fresh[l][r] +
// the other lanes' delayed[j][r], j in lane order; each thread's loads of 8 lanes in flight at once.
// Noinline and called with plain values: run_matvec's code stays the unfused build's but for the call.
// TAG_X with lanes (schedule.tag_residual_outputs(lanes=True), MVF_TAG_LRX): tagp >= 0 stores x with
// this write's parity for the normed stage after it to poll.
#if TAG_X
__device__ __noinline__ void lane_residual_tail(const float* fresh, float* x, const float* dl, int N, int L,
                                                int ol, int start, int cnt, int tagp) {
#else
__device__ __noinline__ void lane_residual_tail(const float* fresh, float* x, const float* dl, int N, int L,
                                                int ol, int start, int cnt) {
#endif
    for (int i = threadIdx.x; i < cnt; i += NT) {
        const int f = start + i, l = f / N, r = f - l * N;
        float acc = ldf(fresh + l * ol + r);
        const float x0 = ldf(x + l * ol + r);
        for (int j0 = 0; j0 < L; j0 += 8) {
            float d[8];
#pragma unroll
            for (int j = 0; j < 8; ++j) d[j] = j0 + j < L ? ldf(dl + (j0 + j) * ol + r) : 0.f;
#pragma unroll
            for (int j = 0; j < 8; ++j)
                if (j0 + j < L && j0 + j != l) acc += d[j];
        }
#if TAG_X
        x[l * ol + r] = tagp >= 0 ? with_parity(x0 + acc, (u32)tagp) : x0 + acc;
#else
        x[l * ol + r] = x0 + acc;
#endif
    }
}
#endif

// WIDE_ITEMS (KOG_HOPPER_WIDE_ITEMS; the backend defines it when a stage is wide,
// schedule.wide_items): a stage whose rows are so short that a row group of 2 rows a warp at full K
// fills at most half a slot (laneformer-2b's o_proj: K = 384, 15 KB items in 31 KB slots) takes
// items of twice the rows, 4 a warp (mv_items<2>). A ring's rate is its bytes in flight
// over the copies' round trip, so half-full slots stream at half rate (session 15's trace: o_proj
// 9.2 us a layer for 4.2 of weights, the producer stalled on a full ring for 9.9).
#ifndef WIDE_ITEMS
#define WIDE_ITEMS 0
#endif
// The wide loop's unroll: 1 (session 15: +2.3% on laneformer-2b against +1.0% for 2, which also
// leaves no room for LANES_LOAD's batch: 168 registers and 44 bytes of spills in the stage loop)
#ifndef WIDE_UNROLL
#define WIDE_UNROLL 1
#endif
// The other stages' loop unroll (KOG_HOPPER_DEFINES=MV_UNROLL=n to try others): 1, as the wide
// loop's. Session 16, same call: 4 / 2 / 1 gave bench-2b 753.0 / 746.0 / 754.2 tok/s, laneformer-2b
// 739.7 / 739.2 / 742.7 (a k-slice is 1-3 steps of the loop a lane: unrolled copies only add code)
#ifndef MV_UNROLL
#define MV_UNROLL 1
#endif
// A wide item's warp works as two half-warps, each on one pair of the warp's 4 rows with 16 lanes
// over the row (K = 384: 48 chunks, 3 a lane). Until session 18 the whole warp took all 4 rows with
// 32 lanes (2 chunks for lanes 0-15, 1 for the others): a lane did 8 dot products an item instead
// of 6 and the epilogue reduced 4 values over 32 lanes (20 shuffles instead of 8), every item, since
// a wide item is its row group's only k-slice. laneformer-2b's o_proj consumers took ~0.95 us an
// item with its first items already landed (trace), against ~0.6 for its other stages' 30 KB
// items; the half-warps: +0.5% on laneformer-2b (perf notes, session 18).
__device__ __forceinline__ float half_warp_sum(float v) {  // within each 16-lane half
#pragma unroll
    for (int o = 8; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// Rows r0 and (if vb) r1 of a row group, done: bias and residual added, written, and the LM head's
// running (max, index) updated (NaN never wins; ties go to the lower index).
__device__ __forceinline__ void mv_emit_pair(float* out, int r0, int r1, bool vb, float y0, float y1,
                                             float b0, float b1, float e0, float e1, const void* bias, const void* res,
                                             int flags, float& best, int& bidx, i64* cout = nullptr, int tagp = -1) {
    if (bias) { y0 += b0; if (vb) y1 += b1; }
    if (res) { y0 += e0; if (vb) y1 += e1; }
#if TAG_QKV || TAG_X
    if (tagp >= 0) { y0 = with_parity(y0, (u32)tagp); y1 = with_parity(y1, (u32)tagp); }  // the value says it is this write's
#endif
    out[r0] = y0;
    if (vb) out[r1] = y1;
#if SPLITK_CARRY
    if (cout) { cout[acc_ix(r0)] = f2fix(y0); if (vb) cout[acc_ix(r1)] = f2fix(y1); }  // the next split-K sum's start
#endif
    if (flags & MVF_ARGMAX) {
        if (y0 > best || (y0 == best && r0 < bidx)) { best = y0; bidx = r0; }
        if (vb && (y1 > best || (y1 == best && r1 < bidx))) { best = y1; bidx = r1; }
    }
}

// Warp w computes rows (2w, 2w+1) of an item, or gate/up row w of a pair item, accumulating over
// the item's k-slices in registers (a row group's slices are consecutive items of one block), and
// writes its outputs after the last slice. RG = 2 (a wide stage, never a pair): rows 4w .. 4w + 3,
// half-warp h the pair (4w + 2h, 4w + 2h + 1), written by its lane 0 (every wide item of three rows
// or more has a second pair, so the small test models cover it). Every consumer thread releases
// every slot (empty barrier: NT arrivals). run_matvec's item loop, inlined into it.
// HS (a split-K stage, SPLITK_DOWN): a pair's SwiGLU values go to shared memory, hrow[row].
template <int RG, bool HS = false>
__device__ __forceinline__ void mv_items(Ctx& c, u32& q, const i64* st, int nitems, int lane0, int K,
                                         int flags, int mode, const float* xs, float& best, int& bidx,
                                         float* hrow = nullptr, bool until_end = false) {
#ifdef TRACE
    u64 twait = 0;
#endif
    const int tid = threadIdx.x, warp = tid >> 5, ln = tid & 31;
    const int hl = RG > 1 ? ln & 15 : ln;  // the lane within its half-warp (RG = 2) or warp
    constexpr int LSTEP = RG > 1 ? 16 : 32;  // lanes over a row
    float acc0 = 0.f, acc1 = 0.f;
    // the row group's bias (raw bf16: converted in the epilogue, not where a use would make the
    // warp wait for the load, session 22) and residual (lane hl = 0)
    u16 b0 = 0, b1 = 0;
    float e0 = 0.f, e1 = 0.f;
#if SPLITK_DOWN
    i64 p0 = 0, p1 = 0;  // the residual's pending sums, converted only in the epilogue (see below)
    // the residual's pending sum (lane 0 only), once a stage: c.it lives in local memory
    const i64* rpend = DEBUG_SPLITK & 4 ? nullptr : acc_of(st, MV_RES_PEND, c.it);
    const bool rcarried = SPLITK_CARRY && rpend && (flags & MVF_CARRY);  // x + pending is the accumulator alone
#if SPLITK_CARRY
    i64* cout = (i64*)acc_of(st, MV_CARRY_OUT, c.it);
#else
    i64* cout = nullptr;
#endif
#endif
#if TAG_QKV || TAG_X
    const int tagp = (flags & MVF_TAG_OUT) ? (int)tag_out_parity(st, c.it) : -1;  // once a stage: c.it lives in local memory
#else
    const int tagp = -1;
#endif
#if DYN_POOL
    for (int j = 0; j < nitems || until_end; ++j, ++q) {  // until_end: then the pool's units, up to its end marker
#else
    for (int j = 0; j < nitems; ++j, ++q) {
#endif
        const u32 slot = q % NSLOTS;
#ifdef TRACE
        const u64 tw = c.tr ? gtimer() : 0;
#endif
        mbar_wait(&full_bar[slot], (q / NSLOTS) & 1);
#ifdef TRACE
        if (c.tr) twait += gtimer() - tw;
#endif
        const int4 h = slot_hdr[slot][0], g = slot_hdr[slot][1];
#if DYN_POOL
        if (g.z & IT_END) { mbar_arrive(&empty_bar[slot]); ++q; break; }
#endif
        const i64* sg = seg(st, h.x & 3);
        const bool pair = sg[SEG_W2] != 0;
        const int ra = pair ? warp : 2 * RG * warp + (RG > 1 ? 2 * (ln >> 4) : 0);  // row indices within the item
        const int rb = pair ? h.w + warp : ra + 1;
        const bool va = (pair ? warp : ra) < h.w, vb = pair ? va : rb < h.w;
        const int lane = h.x >> 2;
        const int r0 = h.z + ra, r1 = h.z + rb;
        // epilogue inputs of the row group, read with its first slice and used after its last (a
        // load's round trip grows with the bytes the ring has in flight: stream probe round 6)
        const u16* bias = (const u16*)sg[SEG_BIAS];
        const float* res = (const float*)sg[SEG_RES];
        if ((g.z & IT_FIRST) && !pair && hl == 0 && va) {
            if (bias) {
                const u16* bb = bias + lane * sg[SEG_BIASL]; b0 = bb[r0]; if (vb) b1 = bb[r1];
            }
            if (res) {
#if SPLITK_DOWN
                const float* rr = res + lane * sg[SEG_RESL];
                if (!rcarried) { e0 = ldf(rr + r0); if (vb) e1 = ldf(rr + r1); }
                // raw here, added in the epilogue: converted here, they made the warp wait one L2
                // round trip (and the x loads with them) before its first dot product (session 22)
                if (rpend) { p0 = ldi64(rpend + acc_ix(r0)); if (vb) p1 = ldi64(rpend + acc_ix(r1)); }
#else
                const float* rr = res + lane * sg[SEG_RESL]; e0 = ldf(rr + r0); if (vb) e1 = ldf(rr + r1);
#endif
            }
        }
        if (g.z & IT_FIRST) { acc0 = 0.f; acc1 = 0.f; }
        if (va) {
            const int n8 = g.y >> 3;
            const uint4* wa = (const uint4*)ring_slot(q) + ra * n8;
            const uint4* wb = vb ? (const uint4*)ring_slot(q) + rb * n8 : wa;
            const float4* xl = (const float4*)(xs + g.w) + (g.x >> 3);
            const float4* xh = (const float4*)(xs + g.w + (K >> 1)) + (g.x >> 3);
#pragma unroll (RG > 1 ? WIDE_UNROLL : MV_UNROLL)
            for (int i = hl; i < n8; i += LSTEP) {
                const uint4 a = wa[i], b = DEBUG_DOT == 2 ? a : wb[i];
                const float4 lo = DEBUG_DOT == 1 ? make_float4(1.f, 1.f, 1.f, 1.f) : xl[i];
                const float4 hi = DEBUG_DOT == 1 ? make_float4(1.f, 1.f, 1.f, 1.f) : xh[i];
                acc0 = dot8s(a, lo, hi, acc0);
                if (DEBUG_DOT == 2) acc1 = acc0; else acc1 = dot8s(b, lo, hi, acc1);
            }
        }
        // every consumer thread releases the slot itself: an arrive orders only its own thread's
        // reads before the next bulk copy into the slot (a warp-level sync + one arrive does not)
        mbar_arrive(&empty_bar[slot]);
        if (!(g.z & IT_LAST)) continue;
        if (RG > 1) { acc0 = half_warp_sum(acc0); acc1 = half_warp_sum(acc1); }
        else { acc0 = warp_sum(acc0); acc1 = warp_sum(acc1); }
        if (hl != 0 || !va) continue;
#if DEFER_NORM
        if (mode & IN_NORM) {  // the deferred norm: d of this row group's input row (its lane)
            const float* pss = s_normsq + (lane - lane0) * NW;
            float tot = 0.f;
#pragma unroll
            for (int w = 0; w < NW; ++w) tot += pss[w];
            const float d = sqrtf(tot / (float)K + fslot(st, MV_EPS));
            acc0 = __fdiv_rn(acc0, d);
            acc1 = __fdiv_rn(acc1, d);
        }
#endif
        float* out = (float*)sg[SEG_OUT] + lane * sg[SEG_OUTL];
        if ((flags & MVF_LOGITS) && c.logits_mode)
            out = c.logits_all + (i64)c.it * st[MV_OUT_STRIDE] + lane * sg[SEG_OUTL];  // one logits row per position
        if (pair) {
            const float hv = acc0 / (1.0f + expf(-acc0)) * acc1;
            if (HS) hrow[r0 - ra + warp] = hv;
            else out[r0 - ra + warp] = TAG_DOWN && (flags & MVF_TAG_OUT) ? with_parity(hv, tag_out_parity(st, c.it)) : hv;
            continue;
        }
#if SPLITK_DOWN
        if (rpend && res) { e0 += fix2f(p0); if (vb) e1 += fix2f(p1); }  // x + acc, as the loaders add it
        mv_emit_pair(out, r0, r1, vb, acc0, acc1, bf2f(b0), bf2f(b1), e0, e1, bias, res, flags, best, bidx, cout, tagp);
#else
        mv_emit_pair(out, r0, r1, vb, acc0, acc1, bf2f(b0), bf2f(b1), e0, e1, bias, res, flags, best, bidx, nullptr, tagp);
#endif
    }
#ifdef TRACE
    if (c.tr && threadIdx.x == 0) c.tr[8] = twait;
#endif
}

#if SPLITK_DOWN
__device__ __forceinline__ void axpy8(uint4 w, float s, float* a) {  // a[0..7] += s * w (8 bf16)
    a[0] = fmaf(s, bf_lo(w.x), a[0]); a[1] = fmaf(s, bf_hi(w.x), a[1]);
    a[2] = fmaf(s, bf_lo(w.y), a[2]); a[3] = fmaf(s, bf_hi(w.y), a[3]);
    a[4] = fmaf(s, bf_lo(w.z), a[4]); a[5] = fmaf(s, bf_hi(w.z), a[5]);
    a[6] = fmaf(s, bf_lo(w.w), a[6]); a[7] = fmaf(s, bf_hi(w.w), a[7]);
}
// The down items' loop (mv_down_items, DYN_POOL's mv_down_accumulate): a0 / a1 from zero, each item's
// rows added in order; returns n8 = D / 8 (0 without items)
__device__ __forceinline__ int mv_down_loop(u32& q, int nitems, const float* hrow, float (&a0)[8], float (&a1)[8]) {
    const int tid = threadIdx.x;
#pragma unroll
    for (int e = 0; e < 8; ++e) { a0[e] = 0.f; a1[e] = 0.f; }
    int n8 = 0;
    for (int j = 0; j < nitems; ++j, ++q) {
        const u32 slot = q % NSLOTS;
        mbar_wait(&full_bar[slot], (q / NSLOTS) & 1);
        const int4 h = slot_hdr[slot][0], g = slot_hdr[slot][1];
        n8 = g.y >> 3;  // D / 8 (an item holds whole rows: schedule._splitk_items)
        const uint4* w = (const uint4*)ring_slot(q);
        const float* hv = hrow + h.z;
#pragma unroll 1
        for (int r = 0; r < h.w; ++r) {
            const float s = hv[r];
            if (tid < n8) axpy8(w[r * n8 + tid], s, a0);
            if (tid + NT < n8) axpy8(w[r * n8 + tid + NT], s, a1);
        }
        mbar_arrive(&empty_bar[slot]);
    }
    return n8;
}
// A split-K stage's down_proj items (after its gate/up items): an item is `rows` rows of W_d^T
// (down_proj's columns j = row0 ..), each D wide; thread t keeps outputs 8t .. 8t + 7 and
// 8 (t + NT) .. (D <= 16 NT), adding h[j] W_d[:, j] row after row in the block's order, then adds
// them to this token's accumulator in fixed point (the sum is exact, so the order of blocks is not
// seen). The reads of a row are 16 bytes a thread, consecutive: conflict-free.
__device__ __forceinline__ void mv_down_items(Ctx& c, u32& q, const i64* st, int nitems, const float* hrow,
                                              float* xs) {
    const int tid = threadIdx.x;
    float a0[8], a1[8];
    int n8 = mv_down_loop(q, nitems, hrow, a0, a1);
    i64* acc = (i64*)acc_of(st, MV_ACC, c.it);
    // through shared memory (the x row's, unread since the gate/up items), so that a warp's atomics
    // cover 256 consecutive bytes, 8 L2 sectors: a lane's own 8 outputs, one sector a lane, measured
    // -11% against the unfused stages (session 20)
#if SPLITK_PAIRS
    n8 = (int)st[MV_ACC_D] >> 3;  // from the stage: a block without down items still sends its zeros
    const u32 rank = cluster_ctarank();
    const int h8 = n8 >> 1;  // rank 0 adds outputs [0, 8 h8), rank 1 [8 h8, 8 n8)
    const int lo8 = rank ? h8 : 0, hi8 = rank ? n8 : h8, plo8 = rank ? 0 : h8;
    float* rbuf = (float*)((char*)smem_f() + PAIR_RBUF_OFF);  // the partner's partials of [8 lo8, 8 hi8)
    const u32 prbuf = mapa_shared(rbuf, rank ^ 1u);           // the partner's rbuf
    const u32 parity = c.npair & 1u;
    ++c.npair;
#pragma unroll
    for (int u = 0; u < 2; ++u) {
        const int g = tid + u * NT;
        const float* a = u ? a1 : a0;
        if (g >= n8) continue;
        const float4 v0 = make_float4(a[0], a[1], a[2], a[3]), v1 = make_float4(a[4], a[5], a[6], a[7]);
        if (g >= lo8 && g < hi8) { ((float4*)xs)[2 * g] = v0; ((float4*)xs)[2 * g + 1] = v1; }
        else { st_cluster_f4(prbuf + 32 * (g - plo8), v0); st_cluster_f4(prbuf + 32 * (g - plo8) + 16, v1); }
    }
    csync();  // this block's stores to the partner's rbuf, before thread 0's release
    if (tid == 0) mbar_arrive_cluster(mapa_shared(&pair_bar, rank ^ 1u));
    while (!mbar_try_acquire_cluster(&pair_bar, parity)) { }
#pragma unroll 4
    for (int i = 8 * lo8 + tid; i < 8 * hi8; i += NT)
        red_add_i64(acc + acc_ix(i), f2fix(xs[i]) + f2fix(rbuf[i - 8 * lo8]));
#elif SPLITK_BULK
    if (n8 == 0) return;  // no down items: nothing to add
    i64* stg = (i64*)((char*)smem_f() + SPLITK_STAGE_OFF);
#pragma unroll
    for (int u = 0; u < 2; ++u) {
        const int g = tid + u * NT;
        const float* a = u ? a1 : a0;
        if (g >= n8) continue;
#pragma unroll
        for (int e = 0; e < 8; e += 2) *(I64x2*)(stg + 8 * g + e) = I64x2{f2fix(a[e]), f2fix(a[e + 1])};
    }
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");  // this thread's stores, seen by the copy engine
    csync();
    if (tid == 0) {
        asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.u64 [%0], [%1], %2;"
                     :: "l"(acc), "r"(smem_addr(stg)), "r"(64 * n8) : "memory");
        asm volatile("cp.async.bulk.commit_group;" ::: "memory");
        asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");  // the adds performed at L2
        asm volatile("fence.proxy.async.global;" ::: "memory");    // and ordered before the release
    }
#else
    if (SPLITK_COUNT) n8 = (int)st[MV_ACC_D] >> 3;  // a block without down items adds its zeros and its count
    if (tid < n8) { ((float4*)xs)[2 * tid] = make_float4(a0[0], a0[1], a0[2], a0[3]);
                    ((float4*)xs)[2 * tid + 1] = make_float4(a0[4], a0[5], a0[6], a0[7]); }
    if (tid + NT < n8) { ((float4*)xs)[2 * (tid + NT)] = make_float4(a1[0], a1[1], a1[2], a1[3]);
                         ((float4*)xs)[2 * (tid + NT) + 1] = make_float4(a1[4], a1[5], a1[6], a1[7]); }
    csync();
#pragma unroll 4
    for (int i = tid; i < 8 * n8; i += NT) if (!(DEBUG_SPLITK & 1)) red_add_i64(acc + acc_ix(i), f2fix(xs[i]));
#endif
}

#if DYN_POOL
#if SPLITK_PAIRS || SPLITK_BULK
#error "DYN_POOL sums a split-K stage's partials with red instructions: not with SPLITK_PAIRS or SPLITK_BULK"
#endif
#ifndef POOL_ACC_OFF
#error "DYN_POOL needs POOL_ACC_OFF, the byte offset of the split-K partials in dynamic shared memory"
#endif
// DYN_POOL's split-K stage: down items of the static share or of one pool unit, added to this
// thread's partials in shared memory (pacc[8 t .. 8 t + 7] and [8 (t + NT) ..]: its own, so no barrier)
__device__ __forceinline__ void mv_down_accumulate(u32& q, int nitems, const float* hrow, float* pacc) {
    const int tid = threadIdx.x;
    float a0[8], a1[8];
    const int n8 = mv_down_loop(q, nitems, hrow, a0, a1);
#pragma unroll
    for (int u = 0; u < 2; ++u) {
        const int g = tid + u * NT;
        if (g >= n8) continue;
        const float* a = u ? a1 : a0;
        float4* p = (float4*)pacc + 2 * g;
        const float4 v0 = p[0], v1 = p[1];
        p[0] = make_float4(v0.x + a[0], v0.y + a[1], v0.z + a[2], v0.w + a[3]);
        p[1] = make_float4(v1.x + a[4], v1.y + a[5], v1.z + a[6], v1.w + a[7]);
    }
}
// The split-K stage with a pool: the block's own gate/up and down items, then unit after unit of
// the pool (each: its gate/up items into hs, a barrier, its down items) until the end marker, the
// partials summed in shared memory; then the atomics, as mv_down_items's.
__device__ __forceinline__ void run_splitk_pool(Ctx& c, u32& q, const i64* st, int nitems, int ndown, int rbase,
                                                int lane0, int K, int flags, int mode, const float* xs, float* hs,
                                                float& best, int& bidx) {
    const int tid = threadIdx.x;
    const int n8 = (int)st[MV_ACC_D] >> 3;
    float* pacc = (float*)((char*)smem_f() + POOL_ACC_OFF);
    for (int g = tid; g < n8; g += NT) {
        ((float4*)pacc)[2 * g] = make_float4(0.f, 0.f, 0.f, 0.f);
        ((float4*)pacc)[2 * g + 1] = make_float4(0.f, 0.f, 0.f, 0.f);
    }
    int ngu = nitems - ndown, ndn = ndown, rb = rbase;
    for (;;) {
        mv_items<1, true>(c, q, st, ngu, lane0, K, flags, mode, xs, best, bidx, hs - rb);
        csync();  // every warp's SwiGLU values in shared memory
        mv_down_accumulate(q, ndn, hs - rb, pacc);
        if (!(flags & MVF_POOL)) break;
        const u32 slot = q % NSLOTS;  // the next unit, or the end
        mbar_wait(&full_bar[slot], (q / NSLOTS) & 1);
        const int4 h = slot_hdr[slot][0], g = slot_hdr[slot][1];
        if (g.z & IT_END) { mbar_arrive(&empty_bar[slot]); ++q; break; }
        ngu = (g.z >> 8) & 0xff; ndn = (g.z >> 16) & 0xff; rb = h.z;
        csync();  // every thread's reads of hs before this unit's SwiGLU values overwrite it
    }
    csync();  // every thread's partials
    i64* acc = (i64*)acc_of(st, MV_ACC, c.it);
#pragma unroll 4
    for (int i = tid; i < 8 * n8; i += NT) red_add_i64(acc + acc_ix(i), f2fix(pacc[i]));
}
#endif
#endif

// A matvec stage: the norm weights preloaded, the wait, the input row, the items, then the LM
// head's (max, index) partial or the fused DTP residual's tail pass.
// Item headers come with the data (slot_hdr) and the block's share from c.blk (shared memory):
// no global read but the input (and the norm weights, read before the wait) on the critical path.
__device__ __noinline__ void run_matvec(Ctx& c, u32& q_io, const u32* wctr, u32 wtarget) {
    u32 q = q_io;  // a register copy: through the reference, every item re-read it from local memory
    const i64* st = s_desc[c.dcur];
    const int nb = gridDim.x;
    const int nitems = c.blk.x, lane0 = c.blk.y, nl = c.blk.z;
    const int K = (int)st[MV_K], K4 = K >> 2;
    const int flags = (int)st[MV_FLAGS];
    const int mode = (int)st[MV_IN_MODE];
    const int tid = threadIdx.x, warp = tid >> 5, ln = tid & 31;
    float* xs = smem_f();
    __shared__ float s_best[NW];
    __shared__ int s_bidx[NW];
    uint2 wpre[XV];
    const bool pre_norm = (mode & IN_NORM) && nl > 0 && K4 <= XV * NT;
    // NORM_SMEM: after the x rows (schedule: the stage's scratch includes them; not with IN_ATTN,
    // whose chunk weights sit there)
    u16* nws = NORM_SMEM && pre_norm && !(mode & IN_ATTN) ? (u16*)(xs + nl * K) : nullptr;
    if (pre_norm) {
        const u16* nw = (const u16*)st[MV_NORM_W] + lane0 * st[MV_NORM_WL];
#pragma unroll
        for (int u = 0; u < XV; ++u) {
            const int i = u * NT + tid;
            if (i < K4) {
                if (NORM_SMEM && nws) cp_async8(nws + 4 * i, nw + 4 * i);
                else wpre[u] = *(const uint2*)(nw + 4 * i);
            }
        }
        if (NORM_SMEM && nws) cp_commit();
    }

    const EmbSlice emb = emb_prefetch(c);  // (embedding stages only: an empty slice elsewhere)
    wait_counter(wctr, wtarget);
    TMARK(c, 1);
    const int nload = (c.skipmask >> 7) & 1 ? 0 : nl;  // benchmark bit 7: no input loads (garbage x)
#if LANES_LOAD
    // several lanes' rows in one batch (plain or deferred-norm input that fits XV float4s a thread)
    // (not a stage whose input row is polled: mv_load_x_lanes does not poll; until session 31 any
    // build with a tagged stage, so every Laneformer build since v31, lost the batch everywhere)
    const bool one_batch = nl > 1 && nl * K4 <= XV * NT && (K4 & 31) == 0 && !(TAG_IN && (flags & MVF_TAG_IN)) && !X_CPASYNC
                           && !(mode & (IN_ATTN | IN_EMBED)) && (DEFER_NORM || !(mode & IN_NORM));
    if (one_batch && nload) mv_load_x_lanes(c, nl, xs, nws);
    else
#endif
    for (int l = 0; l < nload; ++l) {
        if (mode & IN_ATTN) {
            mv_load_attn(c, lane0 + l, xs + l * K, xs + nl * K);
            csync();  // the chunk weights are reused by the next lane
        } else {
            mv_load_x(c, lane0 + l, l, xs + l * K, pre_norm && l == 0 ? wpre : nullptr, l == 0 ? nws : nullptr);
        }
    }
    if (emb.lo < emb.hi) write_embedding(c, emb);
    csync();
    TMARK(c, 2);

    float best = -__int_as_float(0x7f800000);
    int bidx = 0x7fffffff;
#if SPLITK_DOWN
    if (flags & MVF_SPLITK) {  // gate/up items into shared memory, then down_proj's (schedule.fuse_down_splitk)
        const int ndown = c.blk.w & 0xff, rbase = c.blk.w >> 8;
        float* hs = xs + nl * K + (nws ? K / 2 : 0);  // after the x row and the norm weights (backend _ring_slots)
        if (!(SPLITK_CARRY && (flags & MVF_CARRY))) {  // this block's slice of the other parity's
            // accumulator, for the next token (its readers are done; SPLITK_CARRY: x's writer stores it)
            const int D = (int)acc_len(st[MV_ACC_D]);  // (SPLITK_PERM: the padding too)
            i64* other = (i64*)st[MV_ACC] + ((c.it + 1) & 1) * D;
#pragma unroll 1
            for (int i = D * (int)blockIdx.x / nb + tid; i < D * ((int)blockIdx.x + 1) / nb; i += NT) other[i] = 0;
        }
#if DYN_POOL
        run_splitk_pool(c, q, st, nitems, ndown, rbase, lane0, K, flags, mode, xs, hs, best, bidx);
#else
        mv_items<1, true>(c, q, st, nitems - ndown, lane0, K, flags, mode, xs, best, bidx, hs - rbase);
        csync();  // every warp's SwiGLU values in shared memory
        mv_down_items(c, q, st, ndown, hs - rbase, xs);
#endif
        q_io = q;
        return;
    }
#endif
    const bool until_end = DYN_POOL && (flags & MVF_POOL);  // then the pool's units
#if WIDE_ITEMS
    if (flags & MVF_WIDE) mv_items<2>(c, q, st, nitems, lane0, K, flags, mode, xs, best, bidx, nullptr, until_end);
    else
#endif
    mv_items<1>(c, q, st, nitems, lane0, K, flags, mode, xs, best, bidx, nullptr, until_end);
    q_io = q;
    if (flags & MVF_ARGMAX) {  // one (max, index) partial per block
#if WIDE_ITEMS
        {  // a wide stage's second half-warp wrote its rows from lane 16 (elsewhere it holds no row)
            const float ob = __shfl_down_sync(0xffffffffu, best, 16);
            const int oi = __shfl_down_sync(0xffffffffu, bidx, 16);
            if (ob > best || (ob == best && oi < bidx)) { best = ob; bidx = oi; }
        }
#endif
        if (ln == 0) { s_best[warp] = best; s_bidx[warp] = bidx; }
        csync();
        if (tid == 0) {
            float b = s_best[0]; int bi = s_bidx[0];
            for (int w = 1; w < NW; ++w)
                if (s_best[w] > b || (s_best[w] == b && s_bidx[w] < bi)) { b = s_best[w]; bi = s_bidx[w]; }
            ((float*)st[MV_ARGMAX])[blockIdx.x] = b;
            ((int*)st[MV_ARGMAX])[nb + blockIdx.x] = bi;
        }
    }
#if LANE_RESIDUAL
    if (c.blk.w) {  // a fused stage: the DTP residual of this block's rows (schedule.stream_list)
        const i64* sg = seg(st, 0);
        for (int i = 1; i < (int)st[MV_NSEG] && !sg[SEG_LRD]; ++i) sg = seg(st, i);
        csync();  // every warp's fresh outputs written (a barrier shows a block's global writes to all its threads)
        TMARK(c, 20);  // the trace build: the tail pass begins
        lane_residual_tail((const float*)sg[SEG_OUT], (float*)sg[SEG_LRX], (const float*)sg[SEG_LRD], (int)sg[SEG_N],
                           (int)st[MV_L], (int)sg[SEG_OUTL], c.blk.w & 0xffff, (int)((u32)c.blk.w >> 16)
#if TAG_X
                           , (flags & MVF_TAG_LRX) ? (int)tag_out_parity(st, c.it) : -1
#endif
                           );
    }
#endif
}
