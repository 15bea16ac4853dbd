// How the attention splits a query's positions into tiles (chunks x kv heads x lanes): shared by
// the attention stage, the producer's K/V prefetch and the loader that combines the chunks. Part of
// the decode kernel: decode.cu includes it (cuda_util.kernel_source splices it in, in order).

// The attention's shapes (L, H, HKV, HD, T, MAXCH, ROPE_Q, ROPE_K). When every attention stage has
// the same ones, the backend defines them (ATC_*; default since v18, KOG_HOPPER_SHAPE_CONSTS=0 for
// none) and they are compile-time constants: divisions by them become shifts and multiplies, loops
// get fixed trip counts, dead branches go (bench-2b: 203 -> 184 KB of code, +3.4%). Code matters:
// the attention's runs once a layer, and a line missing from the ~100 KB instruction cache costs
// ~150 ns from L2 while the ring streams (stream probe rounds 10-11).
#ifdef ATC_HD
#define AT_I(st, F) ATC_##F
#else
#define AT_I(st, F) ((int)(st)[AT_##F])
#endif

// ATT_FASTDIV (the backend sets it by default since v18b; KOG_HOPPER_ATT_FASTDIV=0 for none): the
// attention's divisions by its run-time chunk count and size (tile -> chunk, kv head, lane) from a
// float reciprocal estimate, corrected to the exact quotient: ~6 instructions instead of the ~25
// of an integer division, inlined at every site. Exact for 0 <= a < 2^20, 1 <= b < 2^20 (the
// estimate is off by at most one).
#ifndef ATT_FASTDIV
#define ATT_FASTDIV 0
#endif
__device__ __forceinline__ int att_div(int a, int b) {
    if (!ATT_FASTDIV) return a / b;
    float rb;
    asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(rb) : "f"((float)b));
    int q = (int)((float)a * rb);
    const int r = a - q * b;
    return q + (r >= b) - (r < 0);
}
// The tile t of an attention over nch chunks: chunk, kv head, lane.
__device__ __forceinline__ void att_tile(int t, int nch, int Hkv, int& ch, int& g, int& l) {
    const int u = att_div(t, nch);
    ch = t - u * nch;
    l = u / Hkv;  // Hkv: a constant with SHAPE_CONSTS
    g = u - l * Hkv;
}

// ATT_SUB (schedule.CONSTS): positions per K/V sub-chunk of attention in shared memory (double-buffered)

// How attention splits the positions [start, pos] of a query: nch chunks of csz (the last one
// shorter), about one tile per block over lanes x kv heads, chunks of >= ATT_SUB (one shared-memory
// sub-chunk: the fewest dependent steps) and <= 512 positions.
// Shared by the attention stage and the loader that combines its chunks (IN_ATTN).
__device__ __forceinline__ void att_chunks(const i64* at, int pos, int& start, int& nch, int& csz) {
    const int L = AT_I(at, L), Hkv = AT_I(at, HKV), W = (int)at[AT_WINDOW];
    start = W > 0 ? max(0, pos - W + 1) : 0;
    const int n = pos - start + 1;
    nch = (n + ATT_SUB - 1) / ATT_SUB;
    nch = min(nch, max(1, (int)at[AT_TARGET] / (L * Hkv)));
    nch = max(nch, (n + 511) / 512);
    nch = min(nch, AT_I(at, MAXCH));
    csz = att_div(n + nch - 1, nch);
    nch = att_div(n + csz - 1, csz);
}
