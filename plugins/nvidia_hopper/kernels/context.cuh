// What every stage function gets: the trace build's timestamps, the stage context (Ctx) and the
// wait on the previous stage's completion count. Part of the decode kernel: decode.cu includes it
// (cuda_util.kernel_source splices it in, in order).

// ------------------------------------------------------------------------------ trace
// Built only with TRACE (KOG_HOPPER_TRACE, trace.py): per traced token, stage and block, TRACE_W
// u64 (globaltimer ns): consumer 0 stage entered, 1 wait done, 2 input loaded, 3 done; producer
// 4 stage reached, 5 last copy issued, 6 ns spent waiting for free slots; 7 SM id; 8 consumer ns
// waiting for full slots; 9 release done; attention 10 q/k/v ready, 11 first K/V landed, 12 loop
// done, 13 partials written; matvec input loader 14 thread 0's loads landed, 15 norm's sum done;
// attention's first sub-chunk 16 scores, 17 softmax, 18 P.V partials, 19 their reduction done;
// a block's second attention tile, whose code has just run (KOG_HOPPER_ATT_TILES above the block
// count): 20 tile start, 21-24 as 10-13, 25-28 as 16-19. Cold against hot code, the same steps.
// A matvec stage with Laneformer's fused residual (LANE_RESIDUAL): 20 its tail pass begins (blocks
// with rows). The signal warp (SIGNAL_WARP): 29 its release of the stage begins, 30 the release's
// fence is done and the counter's add issued (a gpu-scope release waits on the SM's memory
// operations in flight).
#ifdef TRACE
#define NTRACE 4
#define TRACE_W 31
// The row of token iteration `it`, stage s (null: not traced). base = run[R_TRACE] and it0 =
// run[R_TRACE_IT0], read once at the start (Ctx.tbase / tit0): a read of run[] after an acquire
// poll has emptied L1 is an L2 round trip that delayed the stamp after it by ~0.3 us (session 12).
__device__ __forceinline__ u64* trace_row_at(u64* base, int it0, int it, int s, int nst) {
    const int k = it - it0;
    if (!base || k < 0 || k >= NTRACE) return nullptr;
    return base + (((i64)k * nst + s) * gridDim.x + blockIdx.x) * TRACE_W;
}
#define TMARK(c, f) do { if ((c).tr && threadIdx.x == 0) (c).tr[f] = gtimer(); } while (0)
// an attention stamp: field f on the block's first tile (tk 0), f2 on its second (tk 1)
#define TMARK_TILE(c, tk, f, f2) do { if ((tk) == 0) TMARK(c, f); else if ((tk) == 1) TMARK(c, f2); } while (0)
#else
#define TMARK(c, f) do { } while (0)
#define TMARK_TILE(c, tk, f, f2) do { (void)(tk); } while (0)
#endif

// ------------------------------------------------------------------------------ context
// This stage's, the previous stage's and (arriving during this stage) the next stage's descriptors,
// and this block's share of them (schedule.stream_list block info). Stage functions index s_desc
// themselves (Ctx carries buffer numbers, not pointers): a pointer into it that travels through Ctx
// is generic, and every descriptor read would be a generic load instead of an LDS.
__shared__ __align__(16) i64 s_desc[3][NSLOT];
__shared__ int4 s_blk[3];
// TAG_CHECK (a bisecting build, off): each value a TAG_QKV / TAG_OPROJ reader takes by its parity is
// read again after the counter wait it replaced; differences are printed (the first 24) and counted
#ifndef TAG_CHECK
#define TAG_CHECK 0
#endif
#if TAG_CHECK
__device__ int g_tag_mismatch;
__device__ __forceinline__ void tag_check(const char* what, int s, int it, int i, float got, float want, u32 tag, u32 par) {
    if (__float_as_uint(got) == __float_as_uint(want)) return;
    if (atomicAdd(&g_tag_mismatch, 1) < 24)
        printf("TAGCHK %s stage %d it %d block %d i %d got %08x want %08x tag %08x par %u\n", what, s, it,
               (int)blockIdx.x, i, __float_as_uint(got), __float_as_uint(want), tag, par);
}
#endif
struct Ctx {
#ifdef TRACE
    u64* tr;            // this stage's trace row (null: not traced)
    u64* tbase;         // run[R_TRACE] and run[R_TRACE_IT0], read once at the start
    int tit0;
#endif
    int dcur, dprev;    // s_desc rows of this stage's and the previous stage's descriptors
    int4 blk;           // this block's share of a matvec stage: items, first lane, lanes
    const i64* stages;  // every stage's descriptor (global memory)
    int start_pos;
    i64* run;           // run parameters + state
    float* logits_all;  // logits mode: one row per position (run[R_LOGITS_ALL])
    int it, pos, tok, P, logits_mode, nst;
    int skipmask;       // benchmark breakdown: stage kinds not executed
#if SPLITK_PAIRS
    u32 npair;          // split-K exchanges with the partner block so far (pair_bar's phase)
#endif
#if TAG_CHECK
    const u32* chk_ctr; // TAG_CHECK (a bisecting build): the counters, and this stage's index
    int chk_s;
#endif
};

// Readiness in the data (TAG_QKV, TAG_OPROJ, TAG_DOWN) only where every writer runs and waits: the
// benchmark's skip masks that leave a tagged value's writer out (bit 1: the layer matvecs, bit 2:
// the attention) or drop the waits that keep blocks within one write of each other (bit 6) would
// leave a poll spinning forever (session 29: `kog bench`'s breakdown hung). Its readers then wait on
// the counters as an untagged build does.
// TAG_X_EW: an elementwise stage writes a tagged value too, so bit 3 (no elementwise) as well.
#ifndef TAG_X_EW
#define TAG_X_EW 0
#endif
__device__ __forceinline__ bool polls_on(const Ctx& c) {
    return !(c.skipmask & ((1 << 1) | (1 << 2) | (1 << 6) | (TAG_X_EW ? 1 << 3 : 0)));
}

__device__ __forceinline__ float fslot(const i64* st, int i) { return __int_as_float((int)st[i]); }

__device__ __forceinline__ void wait_counter(const u32* ctr, u32 target) {
    if (threadIdx.x == 0 && target) {  // target 0: the breakdown's "no waits" (no load at all)
        spin_acquire(ctr, target);
    }
    csync();
}
