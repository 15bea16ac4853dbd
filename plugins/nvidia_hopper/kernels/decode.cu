// kog nvidia_hopper: one persistent, cooperative kernel that runs a whole request.
//
// The host lowers the model's DecodeProgram into a list of *stages* (fused groups of ops,
// see schedule.py); every block walks the same stage list once per token. A stage is split
// into work that every block takes its share of. Ordering between stages uses one monotonically
// increasing completion counter per stage in global memory: a block signals stage s once
// (red.release.gpu) after finishing its share, and before stage s+1 it spins (ld.acquire.gpu,
// one thread) until counter[s] == gridDim.x * (token_iteration + 1). Nothing is ever reset
// within a launch. Matvec weights do not wait for any of this: each block's producer warp
// streams them into shared memory ahead of the consumers, across stages and tokens.
//
// The stage-descriptor slot numbers (S_*, MV_*, AT_*, EW_*, R_*) are #defined by the host
// (kog_nvidia_hopper/schedule.py) in a header prepended to this file at compile time.
// No CUDA headers are included: bf16 <-> f32 conversions are bit operations.

typedef unsigned long long u64;
typedef unsigned int u32;
typedef unsigned short u16;
typedef long long i64;
#include "ring.cuh"

// Block: NT consumer threads plus one producer warp that streams every matvec's weights into a
// ring of shared-memory slots with the bulk copy engine, from a per-block item list built by the
// host (schedule.stream_plan), across stage and token boundaries: weight streaming never waits
// on activations, and consumer warps never wait on each other per item.
#ifndef NT
#define NT 384
#endif
#define NW (NT / 32)
// SIGNAL_WARP: one more warp that publishes the block's stage completions (the release fence and
// counter add), so that no consumer warp stalls on the fence while the ring waits for its arrivals.
#ifndef SIGNAL_WARP
#define SIGNAL_WARP 0
#endif
#define NTHREADS (NT + 32 + 32 * SIGNAL_WARP)
#ifndef NSLOTS
#define NSLOTS 4
#endif
#ifndef SLOT_BYTES
#define SLOT_BYTES 32768
#endif
#ifndef RING_OFF
#define RING_OFF 0    // byte offset of the ring in dynamic shared memory (after every stage's scratch)
#endif

// ------------------------------------------------------------------------------ helpers
__device__ __forceinline__ float bf2f(u16 h) { return __uint_as_float(((u32)h) << 16); }
__device__ __forceinline__ u16 f2bf(float f) {
    u32 u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (u16)0x7fc0;
    u += 0x7fffu + ((u >> 16) & 1u);
    return (u16)(u >> 16);
}
__device__ __forceinline__ float rbf(float f) { return bf2f(f2bf(f)); }

// Data written inside the launch by other blocks: read at L2 (never a stale L1 line).
__device__ __forceinline__ float ldf(const float* p) {
    float r;
    asm volatile("ld.global.cg.f32 %0, [%1];" : "=f"(r) : "l"(p));
    return r;
}
__device__ __forceinline__ i64 ldi64(const i64* p) {
    i64 r;
    asm volatile("ld.global.cg.s64 %0, [%1];" : "=l"(r) : "l"(p));
    return r;
}
__device__ __forceinline__ u32 ld_acquire(const u32* p) {
    u32 v;
    asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}
__device__ __forceinline__ void red_release(u32* p, u32 v) {
    asm volatile("red.release.gpu.global.add.u32 [%0], %1;" :: "l"(p), "r"(v) : "memory");
}
__device__ __forceinline__ u32 ld_sys(const volatile u32* p) {
    u32 v;
    asm volatile("ld.relaxed.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}



struct OpSum { template <class T> __device__ __forceinline__ T operator()(T a, T b) const { return a + b; } };
struct OpMax { __device__ __forceinline__ float operator()(float a, float b) const { return fmaxf(a, b); } };
template <class T, class Op>
__device__ __forceinline__ T warp_reduce(T v, Op op) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = op(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}
__device__ __forceinline__ float warp_sum(float v) { return warp_reduce(v, OpSum()); }
__device__ __forceinline__ float warp_max(float v) { return warp_reduce(v, OpMax()); }

// Barrier of the consumer threads only (the producer warp never joins).
__device__ __forceinline__ void csync() {
    asm volatile("bar.sync 1, %0;" :: "n"(NT) : "memory");
}

// Block-wide reductions (all consumer threads must call; result broadcast) through s_red (NW + 1
// values; named here, not passed, so its accesses compile to LDS/STS).
__shared__ float s_red[NW + 2];
template <class T, class Op>
__device__ __forceinline__ T block_reduce(T v, T identity, Op op) {
    T* red = (T*)s_red;
    v = warp_reduce(v, op);
    int w = threadIdx.x >> 5, l = threadIdx.x & 31;
    csync();
    if (l == 0) red[w] = v;
    csync();
    if (w == 0) {
        T t = l < NW ? red[l] : identity;
        t = warp_reduce(t, op);
        if (l == 0) red[NW] = t;
    }
    csync();
    return red[NW];
}
__device__ __forceinline__ float block_sum(float v) { return block_reduce(v, 0.f, OpSum()); }
__device__ __forceinline__ float block_max(float v) { return block_reduce(v, -__int_as_float(0x7f800000), OpMax()); }
__device__ __forceinline__ u32 block_count(u32 v) { return block_reduce(v, 0u, OpSum()); }

// ------------------------------------------------------------------------------ Philox
__device__ __forceinline__ u32 philox_w0(u64 seed, u32 n) {
    u32 c0 = n, c1 = 0, c2 = 0, c3 = 0;
    u32 k0 = (u32)seed, k1 = (u32)(seed >> 32);
#pragma unroll
    for (int r = 0; r < 10; ++r) {
        u32 hi0 = __umulhi(0xD2511F53u, c0), lo0 = 0xD2511F53u * c0;
        u32 hi1 = __umulhi(0xCD9E8D57u, c2), lo1 = 0xCD9E8D57u * c2;
        u32 n0 = hi1 ^ c1 ^ k0, n2 = hi0 ^ c3 ^ k1;
        c0 = n0; c1 = lo1; c2 = n2; c3 = lo0;
        k0 += 0x9E3779B9u; k1 += 0xBB67AE85u;
    }
    return c0;
}

// ------------------------------------------------------------------------------ trace
// Built only with TRACE (KOG_HOPPER_TRACE, trace.py): per traced token, stage and block, TRACE_W
// u64 (globaltimer ns): consumer 0 stage entered, 1 wait done, 2 input loaded, 3 done; producer
// 4 stage reached, 5 last copy issued, 6 ns spent waiting for free slots; 7 SM id; 8 consumer ns
// waiting for full slots; 9 release done; attention 10 q/k/v ready, 11 first K/V landed, 12 loop
// done, 13 partials written; matvec input loader 14 thread 0's loads landed, 15 norm's sum done;
// attention's first sub-chunk 16 scores, 17 softmax, 18 P.V partials, 19 their reduction done;
// a block's second attention tile, whose code has just run (KOG_HOPPER_ATT_TILES above the block
// count): 20 tile start, 21-24 as 10-13, 25-28 as 16-19. Cold against hot code, the same steps.
#ifdef TRACE
#define NTRACE 4
#define TRACE_W 29
__device__ __forceinline__ u64* trace_row(const i64* run, int it, int s, int nst) {
    const int k = it - (int)run[R_TRACE_IT0];
    if (!run[R_TRACE] || k < 0 || k >= NTRACE) return nullptr;
    return (u64*)run[R_TRACE] + (((i64)k * nst + s) * gridDim.x + blockIdx.x) * TRACE_W;
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
struct Ctx {
#ifdef TRACE
    u64* tr;
#endif
    int dcur, dprev;    // s_desc rows of this stage's and the previous stage's descriptors
    int4 blk;           // this block's share of a matvec stage: items, first lane, lanes
    const i64* stages;  // every stage's descriptor (global memory)
    int start_pos;
    i64* run;           // run parameters + state
    float* logits_all;  // logits mode: one row per position (run[R_LOGITS_ALL])
    int it, pos, tok, P, logits_mode, nst;
    int skipmask;       // benchmark breakdown: stage kinds not executed
};

__device__ __forceinline__ float fslot(const i64* st, int i) { return __int_as_float((int)st[i]); }

// ------------------------------------------------------------------------------ matvec
__device__ __forceinline__ void wait_counter(const u32* ctr, u32 target) {
    if (threadIdx.x == 0 && target) {  // target 0: the breakdown's "no waits" (no load at all)
        while (ld_acquire(ctr) < target) { }
    }
    csync();
}
// Segment s of a matvec stage: MV_SEG0 + s * SEG_STRIDE + field
__device__ __forceinline__ const i64* seg(const i64* st, int s) { return st + MV_SEG0 + s * SEG_STRIDE; }

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

// Stage input for the embedding mode: block 0 also writes the embedding row (the residual stream).
__device__ void write_embedding(const Ctx& c) {
    const i64* st = s_desc[c.dcur];
    if (!((st[MV_IN_MODE] & IN_EMBED) && st[MV_EMB_OUT] && blockIdx.x == 0)) return;
    const int K = (int)st[MV_K], L = (int)st[MV_L];
    const u16* tab = (const u16*)st[MV_EMB_TABLE] + (i64)c.tok * K;
    float* out = (float*)st[MV_EMB_OUT];
    for (int j = threadIdx.x; j < K * L; j += NT) out[j] = bf2f(tab[j % K]);
}

// Does this matvec stage run at token iteration `it`? (The producer's walk and the consumers'
// must agree exactly: they count ring slots independently.)
__device__ __forceinline__ bool mv_runs(const i64* st, int it, const Ctx& c) {
    if ((int)st[S_TYPE] != ST_MATVEC) return false;
    const int flags = (int)st[MV_FLAGS];
    if ((flags & MVF_SKIP_PROMPT) && !c.logits_mode && it < c.P - 1) return false;
    return !((c.skipmask >> ((flags & MVF_LOGITS) ? 5 : 1)) & 1);
}

// ---------------------------------------------------------------- weight stream (producer warp)
// An item (schedule.stream_plan) is `rows` weight rows (pair segments: gate rows then up rows) x
// klen columns, <= SLOT_BYTES, stored contiguously in the stage's packed weights: one bulk copy.
// Its header, 8 ints: segment | lane << 2, offset / 16, first row, rows, k0, klen, flags
// (IT_FIRST / IT_LAST k-slice of its row group), x offset. The producer writes it into the slot's
// header beside the data, so a consumer never reads an item description from global memory.
#define IT_FIRST 1
#define IT_LAST 2

extern __shared__ float4 smem4[];
// The stages' shared scratch as float*, always derived from smem4 in the function that uses it:
// a pointer that reaches a noinline function through Ctx is generic, and its loads compile to
// generic LD (address-window check) instead of LDS, also in the matvec's inner loop.
__device__ __forceinline__ float* smem_f() { return (float*)smem4; }
__shared__ u64 full_bar[NSLOTS], empty_bar[NSLOTS];
__shared__ int4 slot_hdr[NSLOTS][2];  // the item in each slot (written by the producer before the copy)
__shared__ int s_done;  // set once by the consumers when the request ends; atomics on both sides
__shared__ u32 s_staged;  // SIGNAL_WARP: stages this block has finished (it * nst + s + 1), for the signal warp

// COPY_LSU (an experiment, off): the producer warp's 32 lanes fill a slot with 16-byte cp.async
// (the load/store path) instead of one bulk copy, to get past the copy engine's ~35 KB/us per SM.
// Measured slower (bench-2b 529 vs 600): shared memory fills no faster by this path (stream
// probe, perf notes session 6). The slot's full barrier then expects 33 arrivals: one per lane
// when its copies land (noinc) and lane 0's after the header.
#ifndef COPY_LSU
#define COPY_LSU 0
#endif
#define FULL_ARRIVALS (COPY_LSU ? 33 : 1)
// STREAM_L2_FIRST (the backend sets it by default since v18; KOG_HOPPER_STREAM_L2_FIRST=0 for
// none): the weight stream's bulk copies carry an L2 evict-first policy, so the ~4 GB a token
// streams through the 50 MB L2 stop evicting what is read again within the token: the kernel's
// code, descriptors, KV cache and RoPE rows. bench-2b +4.2%; a dependent L2 load while the ring
// streams 1.36 -> 1.06 us (stream probe round 10).
#ifndef STREAM_L2_FIRST
#define STREAM_L2_FIRST 0
#endif
__device__ __forceinline__ void lsu_copy(void* dst, const void* src, u32 bytes, u64* bar, int ln) {
    for (u32 o = ln * 16; o < bytes; o += 32 * 16)
        cp_async16((unsigned char*)dst + o, (const unsigned char*)src + o);
    cp_async_arrive_noinc(bar);
}
__device__ __forceinline__ unsigned char* ring_slot(u32 q) {
    return (unsigned char*)smem4 + RING_OFF + (q % NSLOTS) * SLOT_BYTES;
}

// The block's stream list (schedule.stream_list): every item of every matvec stage in the order
// the consumers take them, 48 bytes each: source address (lo, hi), bytes, flags, then the item
// header. Per-block ranges [nb + 1] first, entries from SE_HEAD(nb) on (uint4 units, 3 per
// entry). One list is one token; the producer walks it again for every token, skipping the
// entries whose stage does not run (mv_runs).
#define SE_HEAD(nb) (((nb) + 4) >> 2)
#define SE_SKIP_PROMPT 1  // the stage's MVF_SKIP_PROMPT
#define SE_LOGITS 2       // the stage writes the logits (benchmark skip bit 5 rather than 1)
#define SE_ATT_NEXT 4     // first item of a stage that an attention stage follows
#ifndef PREFETCH
#define PREFETCH 0        // items the L2 prefetch runs ahead of the ring's copies (0..32)
#endif

__device__ __forceinline__ bool se_runs(u32 f, int it, const Ctx& c) {
    if ((f & SE_SKIP_PROMPT) && !c.logits_mode && it < c.P - 1) return false;
    return !((c.skipmask >> ((f & SE_LOGITS) ? 5 : 1)) & 1);
}
// Lane l's entry of the batch starting at entry bi of token bit (the list repeats every token).
struct SEntry { uint4 copy; int4 h, g; };
__device__ __forceinline__ void se_load(const uint4* ent, int n, int bi, int bit, SEntry& e, int& eit) {
    int i = bi + (threadIdx.x & 31), t = bit;
    while (i >= n) { i -= n; ++t; }
    e.copy = __ldg(ent + 3 * i);
    e.h = __ldg((const int4*)ent + 3 * i + 1);
    e.g = __ldg((const int4*)ent + 3 * i + 2);
    eit = t;
}
__device__ __forceinline__ int4 shfl4(int4 v, int k) {
    return make_int4(__shfl_sync(0xffffffffu, v.x, k), __shfl_sync(0xffffffffu, v.y, k),
                     __shfl_sync(0xffffffffu, v.z, k), __shfl_sync(0xffffffffu, v.w, k));
}
__device__ __forceinline__ void prefetch_l2(uint4 e) { prefetch_l2((const void*)(((u64)e.y << 32) | e.x), e.z); }
// The K/V cache rows of this block's first tile of attention stage `as` at token iteration `it`
// (positions before the new one): asked of L2 when the producer reaches the stage before it, so
// the tile's copies do not wait on HBM behind the weight stream.
__device__ void att_prefetch_l2(const Ctx& c, int as, int it) {
    const i64* st = c.stages + (i64)as * NSLOT;
    const int pos = c.start_pos + it;
    int start, nch, csz;
    att_chunks(st, pos, start, nch, csz);
    const int Hkv = AT_I(st, HKV), hd = AT_I(st, HD), T = AT_I(st, T);
    const int t = blockIdx.x;
    if (t >= AT_I(st, L) * Hkv * nch) return;
    int ch, g, l;
    att_tile(t, nch, Hkv, ch, g, l);
    const int p0 = start + ch * csz, p1 = min(p0 + csz, pos);
    if (p1 <= p0) return;
    const i64 row = ((i64)(l * Hkv + g) * T + p0) * hd;
    const u32 bytes = (u32)(p1 - p0) * hd * 2;
    prefetch_l2((const u16*)st[AT_KC] + row, bytes);
    prefetch_l2((const u16*)st[AT_VC] + row, bytes);
}

// The producer warp: walk this block's stream list token after token and copy each item into the
// next ring slot once the consumers have released it (lane 0 issues; the warp loads the list 32
// entries at a time, one batch ahead, so no item waits on a list read). With PREFETCH, the lane
// holding the item PREFETCH places ahead asks L2 for it first, so HBM keeps streaming while the
// ring is full (e.g. during attention). Stops when the consumers are done (s_done), after every
// copy still in flight has landed (a block must not exit with one pending).
__device__ __noinline__ void produce(const Ctx& c) {
    const u32* list = (const u32*)c.run[R_STREAM];
    const int nb = gridDim.x, ln = threadIdx.x & 31;
    const int e0 = (int)list[blockIdx.x], n = (int)list[blockIdx.x + 1] - e0;
    const uint4* ent = (const uint4*)list + SE_HEAD(nb) + 3 * e0;
    u32 q = 0;
    const u64 l2pol = STREAM_L2_FIRST ? l2_evict_first_policy() : 0;
    if (n == 0) {  // no weights to stream in this block
        while (!atomicAdd(&s_done, 0)) __nanosleep(2000);
        return;
    }
    SEntry ce, ne;  // this lane's entry of the current / next batch of 32
    int cit, nit;  // and their tokens
    int bi = 0, bit = 0;
    se_load(ent, n, bi, bit, ce, cit);
    int nbi = bi + 32, nbit = bit;
    while (nbi >= n) { nbi -= n; ++nbit; }
    se_load(ent, n, nbi, nbit, ne, nit);
    for (;;) {
        for (int k = 0; k < 32; ++k) {
            if (PREFETCH > 0) {
                const int kw = k + PREFETCH;
                if (kw < 32 ? (ln == kw && se_runs(ce.copy.w, cit, c)) : (ln == kw - 32 && se_runs(ne.copy.w, nit, c)))
                    prefetch_l2(kw < 32 ? ce.copy : ne.copy);
            }
            const u32 f = __shfl_sync(0xffffffffu, ce.copy.w, k);
            const int t = __shfl_sync(0xffffffffu, cit, k);
            if (!se_runs(f, t, c)) continue;
            if (ln == 1 && (f & SE_ATT_NEXT)) att_prefetch_l2(c, (int)(f >> 8) + 1, t);
            const u32 lo = __shfl_sync(0xffffffffu, ce.copy.x, k), hi = __shfl_sync(0xffffffffu, ce.copy.y, k);
            const u32 bytes = __shfl_sync(0xffffffffu, ce.copy.z, k);
            const int4 ih = shfl4(ce.h, k), ig = shfl4(ce.g, k);
            const u32 slot = q % NSLOTS;
            if (ln == 0) {
                int done = 0;
#ifdef TRACE
                u64* tr = trace_row(c.run, t, (int)(f >> 8), (int)c.nst);
                if (tr && !tr[4]) tr[4] = gtimer();
                const u64 tw = gtimer();
#endif
                if (q >= NSLOTS)
                    while (!mbar_try(&empty_bar[slot], ((q / NSLOTS) - 1) & 1))
                        if (atomicAdd(&s_done, 0)) { done = 1; break; }
#ifdef TRACE
                if (tr) { tr[6] += gtimer() - tw; tr[5] = gtimer(); }
#endif
                if (!done) {
                    slot_hdr[slot][0] = ih;  // released to the consumers by the arrive below
                    slot_hdr[slot][1] = ig;
                    if (COPY_LSU) mbar_arrive(&full_bar[slot]);
                    else {
                        mbar_expect_tx(&full_bar[slot], bytes);
                        if (STREAM_L2_FIRST) bulk_copy_hint(ring_slot(q), (const void*)(((u64)hi << 32) | lo), bytes, &full_bar[slot], l2pol);
                        else bulk_copy(ring_slot(q), (const void*)(((u64)hi << 32) | lo), bytes, &full_bar[slot]);
                    }
                }
                q |= done ? 0x80000000u : 0u;
            }
            q = __shfl_sync(0xffffffffu, q, 0);
            if (q & 0x80000000u) { q &= 0x7fffffffu; goto drain; }
            if (COPY_LSU) lsu_copy(ring_slot(q), (const void*)(((u64)hi << 32) | lo), bytes, &full_bar[slot], ln);
            ++q;
        }
        int done = 0;
        if (ln == 0) done = atomicAdd(&s_done, 0);
        if (__shfl_sync(0xffffffffu, done, 0)) goto drain;
        ce = ne; cit = nit;
        nbi += 32;
        while (nbi >= n) { nbi -= n; ++nbit; }
        se_load(ent, n, nbi, nbit, ne, nit);
    }
drain:
    if (COPY_LSU) cp_wait_all();
    if (ln == 0)
        for (u32 r = q > NSLOTS ? q - NSLOTS : 0; r < q; ++r) mbar_wait(&full_bar[r % NSLOTS], (r / NSLOTS) & 1);
}

// ---------------------------------------------------------------- matvec (consumer warps)
// x of each lane the block touches, in shared memory at xs + (lane - first lane) * K, split in
// halves so that a warp's 16-byte reads are conflict-free: chunk i (x[8i..8i+7]) has its first
// four values at float4 i of the lower half and the last four at float4 i of the upper half.
// x_f4: where float4 i4 of the row (x[4 i4 .. 4 i4 + 3]) lives: half (i4 & 1) of chunk i4 / 2.
__device__ __forceinline__ float4* x_f4(float* x, int K, int i4) {
    return (float4*)(x + ((i4 & 1) ? (K >> 1) : 0) + 4 * (i4 >> 1));
}

#define XV 6  // float4 of the input row per thread in flight at once: one round trip for K <= XV * 4 * NT
                // (7 or 8, to load down's 8192 in one round trip at 10 warps, spill 84+ bytes)
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
__device__ __forceinline__ u32 tag_parity(const i64* st, int it) {
    const u32 t = (u32)st[MV_TAG];  // this write's index k | writes a token n << 16: (it n + k) & 1
    return ((u32)it * (t >> 16) + (t & 0xffffu)) & 1u;
}
__device__ __forceinline__ float with_parity(float v, u32 p) { return __uint_as_float((__float_as_uint(v) & ~1u) | p); }
__device__ __forceinline__ bool has_parity(float4 v, u32 p) {
    return (((__float_as_uint(v.x) ^ p) | (__float_as_uint(v.y) ^ p) | (__float_as_uint(v.z) ^ p) | (__float_as_uint(v.w) ^ p)) & 1u) == 0;
}
__device__ __forceinline__ float4 ldcg4_volatile(const float4* p) {  // re-read on every call (a spin)
    float4 r;
    asm volatile("ld.global.cg.v4.f32 {%0,%1,%2,%3}, [%4];" : "=f"(r.x), "=f"(r.y), "=f"(r.z), "=f"(r.w) : "l"(p));
    return r;
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

// Loads are issued in batches of XV per thread before any is used: a loop of one load per
// iteration costs a full L2 round trip per iteration (K = 8192: six) on every stage's critical path.
// wpre: this thread's norm weights when the caller loaded them before its wait (null: load here).
// (A pointer: wpre lives in local memory. Kept in registers instead, the kernel spills 56 bytes
// elsewhere, in the attention and the stage loop.) nws (NORM_SMEM): the same weights copied by this
// thread into shared memory with cp.async (null: not there); each thread reads only its own copies.
__device__ __forceinline__ void mv_load_x(const Ctx& c, int lane, float* x, const uint2* wpre, const u16* nws) {
    const i64* st = s_desc[c.dcur];
    const int K = (int)st[MV_K], K4 = K >> 2;
    const int mode = (int)st[MV_IN_MODE];
    const float* in = (const float*)st[MV_IN] + (i64)lane * K;
    const u16* tab = (const u16*)st[MV_EMB_TABLE] + (i64)c.tok * K;
    const u16* nw = (const u16*)st[MV_NORM_W] + lane * st[MV_NORM_WL];
    const int tid = threadIdx.x;
    const bool tagged = TAG_DOWN && ((int)st[MV_FLAGS] & MVF_TAG_IN);
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
                const float4 v = *x_f4(x, K, i);
                ss = fmaf(v.x, v.x, ss); ss = fmaf(v.y, v.y, ss); ss = fmaf(v.z, v.z, ss); ss = fmaf(v.w, v.w, ss);
            }
    } else {  // the register path: XV float4 per thread in flight, then stored
        for (int base = 0; base < K4; base += XV * NT) {
            float4 v[XV];
#pragma unroll
            for (int u = 0; u < XV; ++u) {
                const int i = base + u * NT + tid;
                if (i < K4) {
                    if (mode & IN_EMBED) {
                        const uint2 e = *(const uint2*)(tab + 4 * i);
                        v[u] = make_float4(bf_lo(e.x), bf_hi(e.x), bf_lo(e.y), bf_hi(e.y));
                    } else {
                        v[u] = __ldcg((const float4*)in + i);
                    }
                }
            }
#pragma unroll
            for (int u = 0; u < XV; ++u) {
                const int i = base + u * NT + tid;
                if (i < K4) {
                    *x_f4(x, K, i) = v[u];
                    ss = fmaf(v[u].x, v[u].x, ss); ss = fmaf(v[u].y, v[u].y, ss);
                    ss = fmaf(v[u].z, v[u].z, ss); ss = fmaf(v[u].w, v[u].w, ss);
                }
            }
        }
    }
    if (TAG_DOWN && tagged) {  // TAG_DOWN: re-read this thread's stale float4s (a plain input: no norm sum)
#pragma unroll 1
        for (int i = tid; i < K4; i += NT) {
            float4* p = x_f4(x, K, i);
            float4 v = *p;
            if (has_parity(v, par)) continue;
            do { v = ldcg4_volatile((const float4*)in + i); } while (!has_parity(v, par));
            *p = v;
        }
    }
    TMARK(c, 14);  // thread 0's input loads landed
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
                if (i < K4) w[u] = (NORM_SMEM && nws) ? *(const uint2*)(nws + 4 * i)
                                 : wpre ? wpre[u] : *(const uint2*)(nw + 4 * i);
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

// Warp w computes rows (2w, 2w+1) of an item, or gate/up row w of a pair item, accumulating over
// the item's k-slices in registers (a row group's slices are consecutive items of one block), and
// writes its outputs after the last slice. Every consumer thread releases every slot (empty barrier: NT arrivals).
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

    wait_counter(wctr, wtarget);
    TMARK(c, 1);
    write_embedding(c);
    const int nload = (c.skipmask >> 7) & 1 ? 0 : nl;  // benchmark bit 7: no input loads (garbage x)
    for (int l = 0; l < nload; ++l) {
        if (mode & IN_ATTN) {
            mv_load_attn(c, lane0 + l, xs + l * K, xs + nl * K);
            csync();  // the chunk weights are reused by the next lane
        } else {
            mv_load_x(c, lane0 + l, xs + l * K, pre_norm && l == 0 ? wpre : nullptr, l == 0 ? nws : nullptr);
        }
    }
    csync();
    TMARK(c, 2);

#ifdef TRACE
    u64 twait = 0;
#endif
    float best = -__int_as_float(0x7f800000);
    int bidx = 0x7fffffff;
    float acc0 = 0.f, acc1 = 0.f;
    float b0 = 0.f, b1 = 0.f, e0 = 0.f, e1 = 0.f;  // the row group's bias and residual (lane 0)
    for (int j = 0; j < nitems; ++j, ++q) {
        const u32 slot = q % NSLOTS;
#ifdef TRACE
        const u64 tw = c.tr ? gtimer() : 0;
#endif
        mbar_wait(&full_bar[slot], (q / NSLOTS) & 1);
#ifdef TRACE
        if (c.tr) twait += gtimer() - tw;
#endif
        const int4 h = slot_hdr[slot][0], g = slot_hdr[slot][1];
        const i64* sg = seg(st, h.x & 3);
        const bool pair = sg[SEG_W2] != 0;
        const int ra = pair ? warp : 2 * warp;            // row indices within the item
        const int rb = pair ? h.w + warp : ra + 1;
        const bool va = (pair ? warp : ra) < h.w, vb = pair ? va : rb < h.w;
        const int lane = h.x >> 2;
        const int r0 = h.z + ra, r1 = h.z + rb;
        // epilogue inputs of the row group, read with its first slice and used after its last (a
        // load's round trip grows with the bytes the ring has in flight: stream probe round 6)
        const u16* bias = (const u16*)sg[SEG_BIAS];
        const float* res = (const float*)sg[SEG_RES];
        if ((g.z & IT_FIRST) && !pair && ln == 0 && va) {
            if (bias) { const u16* bb = bias + lane * sg[SEG_BIASL]; b0 = bf2f(bb[r0]); if (vb) b1 = bf2f(bb[r1]); }
            if (res) { const float* rr = res + lane * sg[SEG_RESL]; e0 = ldf(rr + r0); if (vb) e1 = ldf(rr + r1); }
        }
        if (g.z & IT_FIRST) { acc0 = 0.f; acc1 = 0.f; }
        if (va) {
            const int n8 = g.y >> 3;
            const uint4* wa = (const uint4*)ring_slot(q) + ra * n8;
            const uint4* wb = vb ? (const uint4*)ring_slot(q) + rb * n8 : wa;
            const float4* xl = (const float4*)(xs + g.w) + (g.x >> 3);
            const float4* xh = (const float4*)(xs + g.w + (K >> 1)) + (g.x >> 3);
#pragma unroll 4
            for (int i = ln; i < n8; i += 32) {
                const uint4 a = wa[i], b = wb[i];
                const float4 lo = xl[i], hi = xh[i];
                acc0 = dot8s(a, lo, hi, acc0);
                acc1 = dot8s(b, lo, hi, acc1);
            }
        }
        // every consumer thread releases the slot itself: an arrive orders only its own thread's
        // reads before the next bulk copy into the slot (a warp-level sync + one arrive does not)
        mbar_arrive(&empty_bar[slot]);
        if (!(g.z & IT_LAST)) continue;
        acc0 = warp_sum(acc0);
        acc1 = warp_sum(acc1);
        if (ln != 0 || !va) continue;
        float* out = (float*)sg[SEG_OUT] + lane * sg[SEG_OUTL];
        if ((flags & MVF_LOGITS) && c.logits_mode)
            out = c.logits_all + (i64)c.it * st[MV_OUT_STRIDE] + lane * sg[SEG_OUTL];  // one logits row per position
        if (pair) {
            const float hv = acc0 / (1.0f + expf(-acc0)) * acc1;
            out[r0 - ra + warp] = TAG_DOWN && (flags & MVF_TAG_OUT) ? with_parity(hv, tag_parity(st, c.it)) : hv;
            continue;
        }
        float y0 = acc0, y1 = acc1;
        if (bias) { y0 += b0; if (vb) y1 += b1; }
        if (res) { y0 += e0; if (vb) y1 += e1; }
        out[r0] = y0;
        if (vb) out[r1] = y1;
        if (flags & MVF_ARGMAX) {  // NaN never wins; ties go to the lower index
            if (y0 > best || (y0 == best && r0 < bidx)) { best = y0; bidx = r0; }
            if (vb && (y1 > best || (y1 == best && r1 < bidx))) { best = y1; bidx = r1; }
        }
    }
    q_io = q;
#ifdef TRACE
    if (c.tr && tid == 0) c.tr[8] = twait;
#endif
    if (flags & MVF_ARGMAX) {  // one (max, index) partial per block
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
}


// ------------------------------------------------------------------------------ attention
// COMPACT_ATTENTION (an experiment, off; KOG_HOPPER_COMPACT_ATTENTION=1): the attention's loops
// are not unrolled, so its code is smaller (600 instructions less). Measured 1.6% slower (perf
// notes session 9): fewer bytes, but more instructions executed per step.
#ifndef COMPACT_ATTENTION
#define COMPACT_ATTENTION 0
#endif
#if COMPACT_ATTENTION
#define ATT_LOOP _Pragma("unroll 1")
#else
#define ATT_LOOP
#endif
// Tile = (lane, kv head, chunk of positions). The chunk count adapts to the length so that
// the tiles roughly fill the grid; partial (m, l, o) go to a scratch buffer and the last tile
// of a (lane, kv head) to finish (atomic ticket) combines them.
__device__ __forceinline__ void rope_pair(float a, float b, float cs, float sn, float& oa, float& ob) {
    oa = __fsub_rn(__fmul_rn(a, cs), __fmul_rn(b, sn));
    ob = __fadd_rn(__fmul_rn(b, cs), __fmul_rn(a, sn));
}
// One head at float offset `off` of the stage scratch, rotated in place (called by one warp), with
// this position's cos and sin rows at offset `tab` (att_issue_first copied them there before the
// stage's wait). Offsets, not pointers: a pointer parameter is generic, and its loads and stores
// would take the generic path instead of LDS / STS (sass_report). Noinline: inlined, it perturbs
// the attention's register allocation into spills.
__device__ __noinline__ void rope_vec(int off, int hd, int style, int tab) {
#ifdef ATC_HD
    hd = ATC_HD;  // a constant: the loop below unrolls to its exact (h2 / 32) steps
#endif
    float* v = smem_f() + off;
    const float* cs = smem_f() + tab;
    const int h2 = hd / 2;
    ATT_LOOP
    for (int k = 0; k < (h2 + 31) / 32; ++k) {  // a trip count, not `j < h2`: fixed when hd is
        const int j = (threadIdx.x & 31) + 32 * k;
        if (j >= h2) break;
        int ia = style == 1 ? j : 2 * j, ib = style == 1 ? j + h2 : 2 * j + 1;
        float oa, ob;
        rope_pair(v[ia], v[ib], cs[j], cs[h2 + j], oa, ob);
        v[ia] = oa; v[ib] = ob;
    }
}


// K/V sub-chunk buffers of the attention (2: the next sub-chunk's copies overlap this one's math;
// 1 leaves 17 KB more shared memory to the weight ring at hd = 128, schedule._attn_stage)
#ifndef KV_BUFS
#define KV_BUFS 2
#endif
// this thread's copies of every group but the KV_BUFS - 1 newest have landed
__device__ __forceinline__ void cp_wait_kv() { asm volatile("cp.async.wait_group %0;" :: "n"(KV_BUFS - 1) : "memory"); }
// this thread's groups but the KV_BUFS newest (the K/V sub-chunks after the RoPE rows) have landed
__device__ __forceinline__ void cp_wait_rope() { asm volatile("cp.async.wait_group %0;" :: "n"(KV_BUFS) : "memory"); }

// Positions [a, b) of one kv head's K and V rows -> shared memory rows of RS bf16 (hd + 8: the
// pad keeps a warp's 16-byte reads of two rows on different banks); row `skip` (the new
// position, written by this tile, not yet in the cache) is left out. Always commits a group.
__device__ __forceinline__ void att_issue(u16* Kb, u16* Vb, const u16* kc, const u16* vc, int a, int b, int skip,
                                          int hd, int RS) {
    const int nd8 = hd >> 3;
    const int n = (b - a) * nd8;
    for (int i = threadIdx.x; i < n; i += NT) {
        int r = i / nd8, c8 = i - r * nd8;
        int p = a + r;
        if (p == skip) continue;
        cp_async16(Kb + r * RS + c8 * 8, kc + (i64)p * hd + c8 * 8);
        cp_async16(Vb + r * RS + c8 * 8, vc + (i64)p * hd + c8 * 8);
    }
    cp_commit();
}

// Shared memory of the attention stage (schedule._attn_stage sizes it): q and running output
// [G][hd], new key / value [hd], scores [G][ATT_SUB], P.V partials NT * 8 (before the loop: this
// position's RoPE cos and sin rows), then the K/V buffers.
__device__ __forceinline__ int att_red_off(const Ctx& c) {  // float offset of the P.V partials
    const int G = AT_I(s_desc[c.dcur], H) / AT_I(s_desc[c.dcur], HKV), hd = AT_I(s_desc[c.dcur], HD);
    return 2 * G * hd + 2 * hd + G * ATT_SUB;
}
__device__ __forceinline__ u16* att_kvbuf(const Ctx& c) {
    return (u16*)(smem_f() + att_red_off(c) + NT * 8);
}
// Issue tile t's RoPE rows (one cp.async group, possibly empty) and first KV_BUFS K/V sub-chunks
// (KV_BUFS groups). They depend on nothing in this token (the new position is left out; its tile
// writes it), so the stage issues the first tile's before it waits for q: after the wait, RoPE
// finds its tables landed instead of loading them (a second round trip after q's).
__device__ void att_issue_first(const Ctx& c, int t) {
    const i64* st = s_desc[c.dcur];
    const int Hkv = AT_I(st, HKV), hd = AT_I(st, HD), T = AT_I(st, T);
    if (AT_I(st, ROPE_Q) || AT_I(st, ROPE_K)) {  // cos then sin row of this position, h2 floats each
        const int h2 = hd >> 1, tid = threadIdx.x;
        float* tab = smem_f() + att_red_off(c);
        if (tid < h2 / 2) {  // h2 / 4 float4 of each row (hd % 8 == 0)
            const bool sn = tid >= h2 / 4;
            const int i4 = sn ? tid - h2 / 4 : tid;
            const float* src = (const float*)st[sn ? AT_SIN : AT_COS] + (i64)c.pos * h2;
            cp_async16(tab + (sn ? h2 : 0) + 4 * i4, src + 4 * i4);
        }
    }
    cp_commit();
    int start, nch, csz;
    att_chunks(st, c.pos, start, nch, csz);
    int ch, g, l;
    att_tile(t, nch, Hkv, ch, g, l);
    const int p0 = start + ch * csz, p1 = min(p0 + csz, c.pos + 1);
    const int nsub = (p1 - p0 + ATT_SUB - 1) / ATT_SUB;
    const int skip = (st[AT_KNEW] != 0 && p1 == c.pos + 1) ? c.pos : -1;
    const u16* kc = (const u16*)st[AT_KC] + ((i64)(l * Hkv + g) * T) * hd;
    const u16* vc = (const u16*)st[AT_VC] + ((i64)(l * Hkv + g) * T) * hd;
    const int RS = hd + 8;
    u16* kvb = att_kvbuf(c);
    for (int s = 0; s < KV_BUFS; ++s) {
        u16* Kb = kvb + (s * 2) * ATT_SUB * RS;
        if (s < nsub) att_issue(Kb, Kb + ATT_SUB * RS, kc, vc, p0 + s * ATT_SUB, min(p0 + (s + 1) * ATT_SUB, p1), skip, hd, RS);
        else cp_commit();
    }
}
__device__ __forceinline__ int att_ntiles(const Ctx& c) {
    int start, nch, csz;
    att_chunks(s_desc[c.dcur], c.pos, start, nch, csz);
    return AT_I(s_desc[c.dcur], L) * AT_I(s_desc[c.dcur], HKV) * nch;
}

// Tile = (lane, kv head, chunk of positions). The chunk count adapts to the length so that the
// tiles roughly fill the grid. A tile streams its chunk's K/V through shared memory in
// sub-chunks of ATT_SUB positions (cp.async, KV_BUFS in flight), with a running (online) softmax per
// query head; partial (m, l, o) go to a scratch buffer and the last tile of a (lane, kv head) to
// finish (atomic ticket) combines them. The chunk holding `pos` also applies RoPE to the new key
// and writes the new K/V (bf16) into the cache.
// INLINE_ATTENTION (the backend's default since v15): inlined, the attention's callee saves go
// (kernel spills 196 -> 36 B; bench-2b +1.9%)
#if INLINE_ATTENTION
__device__ __forceinline__ void run_attention(Ctx& c) {
#else
__device__ __noinline__ void run_attention(Ctx& c) {
#endif
    const i64* st = s_desc[c.dcur];
    const int L = AT_I(st, L), H = AT_I(st, H), Hkv = AT_I(st, HKV), hd = AT_I(st, HD);
    const int T = AT_I(st, T), MAXCH = AT_I(st, MAXCH);
    const int G = H / Hkv;
    const float scale = fslot(st, AT_SCALE);
    const int pos = c.pos;
    int start, nch, csz;
    att_chunks(st, pos, start, nch, csz);
    const int ntiles = L * Hkv * nch;
    const int tid = threadIdx.x, warp = tid >> 5, ln = tid & 31;
    const int nd8 = hd >> 3, RS = hd + 8;
    const bool combine = st[AT_NOCOMBINE] == 0;  // else the next matvec's loader combines the chunks
    const int GH = G * hd;
    // score mapping: lpr lanes per K row (power of two >= nd8), rpw rows per warp
    int lpr = 1;
    while (lpr < nd8) lpr <<= 1;
    const int rpw = 32 / lpr, sr = ln / lpr, sc8 = ln % lpr;
    // P.V mapping: thread = (group, head, 8 columns); NSPLIT groups split the positions
    const int ncol = G * nd8, nsplit = NT / ncol;
    // shared layout (schedule._attn_stage sizes it)
    float* q = smem_f();                   // [G][hd] queries, rotated
    float* kn = q + GH;                    // [hd] new key (rotated, bf16-rounded)
    float* vn = kn + hd;                   // [hd] new value (bf16-rounded)
    float* ob = vn + hd;                   // [G][hd] running output
    float* sc = ob + GH;                   // [G][ATT_SUB] scores -> probabilities
    float* red = sc + G * ATT_SUB;         // [nsplit][G][hd] P.V partials (NT * 8 floats); chunk (m, l) at combine
    u16* kvb = att_kvbuf(c);               // [KV_BUFS][K, V][ATT_SUB][RS] bf16 (= red + NT * 8)
    __shared__ float s_m[8], s_l[8], s_a[8];
    __shared__ int s_last;
    const int ropeq = AT_I(st, ROPE_Q), ropek = AT_I(st, ROPE_K);
    const bool fused = st[AT_KNEW] != 0;
    float* partO = (float*)st[AT_PART_O];
    float* partML = (float*)st[AT_PART_ML];

    int tk = -1;  // the block's tiles so far (trace stamps: its first and second tile)
    for (int t = blockIdx.x; t < ntiles; t += gridDim.x) {
        ++tk;
        int ch, g, l;
        att_tile(t, nch, Hkv, ch, g, l);
        if (tk == 1) TMARK(c, 20);  // the second tile's start (field 0 is the stage's entry)
        const int p0 = start + ch * csz, p1 = min(p0 + csz, pos + 1);
        const int nsub = (p1 - p0 + ATT_SUB - 1) / ATT_SUB;
        const bool own = fused && p1 == pos + 1;
        const int skip = own ? pos : -1;
        u16* kc = (u16*)st[AT_KC] + ((i64)(l * Hkv + g) * T) * hd;
        u16* vc = (u16*)st[AT_VC] + ((i64)(l * Hkv + g) * T) * hd;
        // the cache rows first, KV_BUFS sub-chunks in flight (the first tile's were issued before the wait)
        if (t != (int)blockIdx.x) att_issue_first(c, t);
        // queries of this kv head's group, new key / value
        const float* qsrc = (const float*)st[AT_Q] + (i64)l * H * hd + (i64)g * GH;
        ATT_LOOP
        for (int i = tid; i < GH; i += NT) { q[i] = ldf(qsrc + i); ob[i] = 0.f; }
        if (own) {
            const float* ks = (const float*)st[AT_KNEW] + (i64)l * Hkv * hd + (i64)g * hd;
            const float* vs = (const float*)st[AT_VNEW] + (i64)l * Hkv * hd + (i64)g * hd;
            ATT_LOOP
            for (int i = tid; i < hd; i += NT) { kn[i] = ldf(ks + i); vn[i] = rbf(ldf(vs + i)); }
        }
        if (tid < 8) { s_m[tid] = -__int_as_float(0x7f800000); s_l[tid] = 0.f; }
        cp_wait_rope();  // this thread's RoPE copies (att_issue_first) have landed; the barrier shows all
        csync();
        if (ropeq && warp < G) rope_vec(warp * hd, hd, ropeq, att_red_off(c));
        if (own && ropek && warp == NW - 1) rope_vec(GH, hd, ropek, att_red_off(c));
        csync();
        TMARK_TILE(c, tk, 10, 21);
        if (own) {
            ATT_LOOP
            for (int i = tid; i < hd; i += NT) {
                u16 kb = f2bf(kn[i]);
                kn[i] = bf2f(kb);
                kc[(i64)pos * hd + i] = kb;
                vc[(i64)pos * hd + i] = f2bf(vn[i]);
            }
        }
        for (int s = 0; s < nsub; ++s) {
            const int a = p0 + s * ATT_SUB, cnt = min(ATT_SUB, p1 - a);
            u16* Kb = kvb + ((s % KV_BUFS) * 2) * ATT_SUB * RS;
            u16* Vb = Kb + ATT_SUB * RS;
            cp_wait_kv();  // this thread's copies of sub-chunk s have landed
            if (own && pos >= a && pos < a + cnt) {  // braces: ATT_LOOP may be a pragma, not a statement
                ATT_LOOP
                for (int i = tid; i < hd; i += NT) { Kb[(pos - a) * RS + i] = f2bf(kn[i]); Vb[(pos - a) * RS + i] = f2bf(vn[i]); }
            }
            csync();
            if (s == 0) TMARK_TILE(c, tk, 11, 22);
            // scores: lpr lanes per K row, reduced by shuffles within the row's lanes
            ATT_LOOP
            for (int gi = 0; gi < G; ++gi) {
                float4 qa = make_float4(0.f, 0.f, 0.f, 0.f), qb = qa;
                if (sc8 < nd8) { qa = *(const float4*)(q + gi * hd + sc8 * 8); qb = *(const float4*)(q + gi * hd + sc8 * 8 + 4); }
                ATT_LOOP
                for (int j0 = warp * rpw; j0 < cnt; j0 += NW * rpw) {
                    const int j = j0 + sr;
                    float d = 0.f;
                    if (j < cnt && sc8 < nd8) d = dot8s(*(const uint4*)(Kb + j * RS + sc8 * 8), qa, qb, 0.f);
                    for (int o = lpr >> 1; o > 0; o >>= 1) d += __shfl_xor_sync(0xffffffffu, d, o);
                    if (j < cnt && sc8 == 0) sc[gi * ATT_SUB + j] = d * scale;
                }
            }
            csync();
            if (s == 0) TMARK_TILE(c, tk, 16, 25);
            // running softmax, one warp per query head
            if (warp < G) {
                float v = ln < cnt ? sc[warp * ATT_SUB + ln] : -__int_as_float(0x7f800000);  // ATT_SUB == 32
                const float mo = s_m[warp];
                const float mn = fmaxf(mo, warp_max(v));
                const float e = ln < cnt ? expf(v - mn) : 0.f;
                if (ln < cnt) sc[warp * ATT_SUB + ln] = e;
                const float sum = warp_sum(e);
                __syncwarp();  // every lane has read s_m[warp] before lane 0 replaces it
                if (ln == 0) {
                    const float al = expf(mo - mn);  // 0 on the first sub-chunk (mo = -inf)
                    s_a[warp] = al;
                    s_l[warp] = s_l[warp] * al + sum;
                    s_m[warp] = mn;
                }
            }
            csync();
            if (s == 0) TMARK_TILE(c, tk, 17, 26);
            // P.V partials
            if (tid < nsplit * ncol) {
                const int grp = tid / ncol, col = tid - grp * ncol, gi = col / nd8, d8 = col - gi * nd8;
                float acc[8];
#pragma unroll
                for (int e = 0; e < 8; ++e) acc[e] = 0.f;
                ATT_LOOP
                for (int j = grp; j < cnt; j += nsplit) {
                    const float pr = sc[gi * ATT_SUB + j];
                    const uint4 w = *(const uint4*)(Vb + j * RS + d8 * 8);
                    acc[0] = fmaf(pr, bf_lo(w.x), acc[0]); acc[1] = fmaf(pr, bf_hi(w.x), acc[1]);
                    acc[2] = fmaf(pr, bf_lo(w.y), acc[2]); acc[3] = fmaf(pr, bf_hi(w.y), acc[3]);
                    acc[4] = fmaf(pr, bf_lo(w.z), acc[4]); acc[5] = fmaf(pr, bf_hi(w.z), acc[5]);
                    acc[6] = fmaf(pr, bf_lo(w.w), acc[6]); acc[7] = fmaf(pr, bf_hi(w.w), acc[7]);
                }
                float* rd = red + grp * GH + gi * hd + d8 * 8;
                *(float4*)rd = make_float4(acc[0], acc[1], acc[2], acc[3]);
                *(float4*)(rd + 4) = make_float4(acc[4], acc[5], acc[6], acc[7]);
            }
            csync();
            if (s == 0) TMARK_TILE(c, tk, 18, 27);
            ATT_LOOP
            for (int i = tid; i < GH; i += NT) {
                float o = 0.f;
                ATT_LOOP
                for (int k = 0; k < nsplit; ++k) o += red[k * GH + i];
                ob[i] = ob[i] * s_a[i / hd] + o;
            }
            csync();  // buffer (s % KV_BUFS) and red are free again
            if (s == 0) TMARK_TILE(c, tk, 19, 28);
            if (s + KV_BUFS < nsub) att_issue(Kb, Vb, kc, vc, a + KV_BUFS * ATT_SUB, min(a + (KV_BUFS + 1) * ATT_SUB, p1), skip, hd, RS);
            else cp_commit();
        }
        cp_wait_all();
        TMARK_TILE(c, tk, 12, 23);
        ATT_LOOP
        for (int i = tid; i < GH; i += NT) {
            const int gi = i / hd, d = i - gi * hd, h = g * G + gi;
            if (nch == 1 && combine) {
                ((float*)st[AT_OUT])[(i64)l * H * hd + (i64)h * hd + d] = ob[i] / s_l[gi];
            } else {
                partO[(((i64)l * H + h) * MAXCH + ch) * hd + d] = ob[i];
                if (d == 0) {
                    partML[(((i64)l * H + h) * MAXCH + ch) * 2] = s_m[gi];
                    partML[(((i64)l * H + h) * MAXCH + ch) * 2 + 1] = s_l[gi];
                }
            }
        }
        TMARK_TILE(c, tk, 13, 24);
        if (nch > 1 && combine) {
            csync();
            u32* ticket = (u32*)st[AT_TICKET] + l * Hkv + g;
            if (tid == 0) {
                __threadfence();
                u32 k = atomicAdd(ticket, 1u);
                s_last = (k == (u32)nch - 1);
                if (s_last) { *ticket = 0u; __threadfence(); }
            }
            csync();
            if (s_last) {
                // (m, l) of every chunk into shared memory in parallel (red is free now), then combine
                float* mls = red;
                ATT_LOOP
                for (int i = tid; i < G * nch; i += NT) {
                    const int gi = att_div(i, nch), k = i - gi * nch;
                    const float* ml = partML + (((i64)l * H + g * G + gi) * MAXCH + k) * 2;
                    mls[i * 2] = ldf(ml);
                    mls[i * 2 + 1] = ldf(ml + 1);
                }
                csync();
                ATT_LOOP
                for (int i = tid; i < GH; i += NT) {
                    int gi = i / hd, d = i % hd;
                    int h = g * G + gi;
                    const float* ml = mls + gi * nch * 2;
                    float M = -__int_as_float(0x7f800000);
                    ATT_LOOP
                    for (int k = 0; k < nch; ++k) M = fmaxf(M, ml[2 * k]);
                    float num = 0.f, den = 0.f;
                    const float* po = partO + (((i64)l * H + h) * MAXCH) * hd + d;
                    ATT_LOOP
                    for (int k = 0; k < nch; ++k) {
                        float w = expf(ml[2 * k] - M);
                        num = fmaf(w, __ldcg(po + (i64)k * hd), num);
                        den = fmaf(w, ml[2 * k + 1], den);
                    }
                    ((float*)st[AT_OUT])[(i64)l * H * hd + (i64)h * hd + d] = num / den;
                }
            }
        }
        csync();
    }
}

// ------------------------------------------------------------------------------ elementwise
__device__ __noinline__ void run_ew(Ctx& c) {
    const i64* st = s_desc[c.dcur];
    const int op = (int)st[EW_OP];
    const int L = (int)st[EW_L];
    const int D = (int)st[EW_D];  // per-lane row length
    const float* a = (const float*)st[EW_A];
    const float* b = (const float*)st[EW_B];
    const float* d3 = (const float*)st[EW_C];
    float* out = (float*)st[EW_OUT];
    const int gtid = blockIdx.x * NT + threadIdx.x, gstride = gridDim.x * NT;
    const i64 total = (i64)L * D;
    if (op == OP_EMBED) {
        const u16* tab = (const u16*)st[EW_A] + (i64)c.tok * D;
        for (i64 i = gtid; i < total; i += gstride) out[i] = bf2f(tab[i % D]);
    } else if (op == OP_RMSNORM) {
        // one warp per (lane, group)
        const int grp = (int)st[EW_GROUP];
        const int ng = D / grp;
        const u16* w = (const u16*)st[EW_B];
        const i64 wl = st[EW_WL];
        const float eps = fslot(st, EW_F0);
        const int gw = blockIdx.x * NW + (threadIdx.x >> 5), nwt = gridDim.x * NW, ln = threadIdx.x & 31;
        for (int u = gw; u < L * ng; u += nwt) {
            int l = u / ng, gi = u % ng;
            const float* x = a + (i64)l * D + (i64)gi * grp;
            float ss = 0.f;
            for (int j = ln; j < grp; j += 32) { float v = ldf(x + j); ss = fmaf(v, v, ss); }
            ss = warp_sum(ss);
            float dd = sqrtf(ss / (float)grp + eps);
            __syncwarp();
            for (int j = ln; j < grp; j += 32) {
                float v = ldf(x + j);
                float wv = wl ? bf2f(w[l * wl + gi * grp + j]) : bf2f(w[j]);
                out[(i64)l * D + (i64)gi * grp + j] = v / dd * wv;
            }
        }
    } else if (op == OP_ROPE) {
        const int hd = (int)st[EW_HD], style = (int)st[EW_STYLE];
        const int h2 = hd / 2;
        const float* cs = (const float*)st[EW_B] + (i64)c.pos * h2;
        const float* sn = (const float*)st[EW_C] + (i64)c.pos * h2;
        const i64 npairs = total / 2;
        for (i64 i = gtid; i < npairs; i += gstride) {
            i64 row = i / h2; int j = (int)(i % h2);
            i64 base = row * hd;
            int ia = style == 1 ? j : 2 * j, ib = style == 1 ? j + h2 : 2 * j + 1;
            float oa, ob;
            rope_pair(ldf(a + base + ia), ldf(a + base + ib), cs[j], sn[j], oa, ob);
            out[base + ia] = oa; out[base + ib] = ob;
        }
    } else if (op == OP_KVAPPEND) {
        const int hd = (int)st[EW_HD], T = (int)st[EW_T];
        u16* kc = (u16*)st[EW_OUT];
        u16* vc = (u16*)st[EW_OUT2];
        for (i64 i = gtid; i < total; i += gstride) {
            i64 row = i / hd; int d = (int)(i % hd);  // row = l * Hkv + h
            i64 o = (row * T + c.pos) * hd + d;
            kc[o] = f2bf(ldf(a + i));
            vc[o] = f2bf(ldf(b + i));
        }
    } else if (op == OP_SWIGLU) {
        for (i64 i = gtid; i < total; i += gstride) { float g = ldf(a + i); out[i] = g / (1.0f + expf(-g)) * ldf(b + i); }
    } else if (op == OP_ADD) {
        for (i64 i = gtid; i < total; i += gstride) out[i] = ldf(a + i) + ldf(b + i);
    } else if (op == OP_COPY) {
        for (i64 i = gtid; i < total; i += gstride) out[i] = ldf(a + i);
    } else if (op == OP_LANE_SUM || op == OP_LANE_MEAN) {
        const int LI = (int)st[EW_LIN];
        for (i64 i = gtid; i < D; i += gstride) {
            float s = ldf(a + i);
            for (int l = 1; l < LI; ++l) s += ldf(a + (i64)l * D + i);
            out[i] = op == OP_LANE_MEAN ? s / (float)LI : s;
        }
    } else if (op == OP_LANE_RESIDUAL) {
        const int mode = (int)st[EW_STYLE];
        const float scale = fslot(st, EW_F0);
        float* x = out;
        for (i64 i = gtid; i < total; i += gstride) {
            int l = (int)(i / D); i64 e = i % D;
            float acc;
            if (mode == 0) {          // local
                acc = scale * ldf(b + i);
            } else if (mode == 1) {   // allreduce
                acc = ldf(b + e);
                for (int j = 1; j < L; ++j) acc += ldf(b + (i64)j * D + e);
            } else {                  // delayed
                acc = ldf(b + i);
                for (int j = 0; j < L; ++j) if (j != l) acc += ldf(d3 + (i64)j * D + e);
            }
            x[i] = ldf(x + i) + acc;
        }
    }
}

// ------------------------------------------------------------------------------ sampling
// Block 0 only. Order of candidates: z descending, index ascending, encoded in one u64
// comb = key(z) << 32 | ~index, so "prefix up to e" = {i : comb_i >= comb_e}.
__device__ __forceinline__ u32 fkey(float f) {
    u32 u = __float_as_uint(f);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

// largest c such that f(c) holds, f monotone (true for small c), searching in [lo, hi]
// kind 0: count(comb >= c) >= k ; kind 1: mass(comb >= c, comb >= cmin) >= target ; kind 2: > target
__device__ u64 sample_search(const float* z, const float* p, int V, int kind, u32 k, float target,
                             u64 cmin, u64 lo, u64 hi) {
    while (lo < hi) {
        u64 mid = lo + ((hi - lo) >> 1) + 1;  // hi > lo: no overflow
        bool ok;
        if (kind == 0) {
            u32 cntv = 0;
            for (int i = threadIdx.x; i < V; i += NT) {
                u64 cb = ((u64)fkey(z[i]) << 32) | (u64)(0xffffffffu - (u32)i);
                cntv += cb >= mid;
            }
            ok = block_count(cntv) >= k;
        } else {
            float s = 0.f;
            u64 th = mid > cmin ? mid : cmin;
            for (int i = threadIdx.x; i < V; i += NT) {
                u64 cb = ((u64)fkey(z[i]) << 32) | (u64)(0xffffffffu - (u32)i);
                if (cb >= th) s += p[i];
            }
            float m = block_sum(s);
            ok = kind == 1 ? (m >= target) : (m > target);
        }
        if (ok) lo = mid; else hi = mid - 1;
    }
    return lo;
}

__device__ float mass_ge(const float* z, const float* p, int V, u64 th) {
    float s = 0.f;
    for (int i = threadIdx.x; i < V; i += NT) {
        u64 cb = ((u64)fkey(z[i]) << 32) | (u64)(0xffffffffu - (u32)i);
        if (cb >= th) s += p[i];
    }
    return block_sum(s);
}

// SAMPLE_RADIX (an experiment, off; KOG_HOPPER_SAMPLE_RADIX=1; written in session 9, not yet run on
// the GPU): top-k, top-p and the draw by a radix select instead of binary searches. The binary
// searches take 64 passes each over the vocabulary's z and p (~1 MB from L2 at 128k tokens);
// the radix select takes 8 passes of 8 bits over the 64-bit key, and once the prefix leaves at
// most SAMPLE_CAP candidates, lists them in shared memory and reads only those. Masses are summed
// in fixed point (p 2^40, exact for p >= 2^-40: a power-of-two scale): integer sums are the same in
// any order, so seeded runs stay deterministic with atomics; targets are the float32 products of
// the CPU definition (kog_core/sampling.py), converted to the same fixed point. The algorithm is
// checked against a full sort on the CPU (tests/test_hopper_compile.py, an emulation).
#ifndef SAMPLE_RADIX
#define SAMPLE_RADIX 0
#endif
// SAMPLE_CAP (schedule.CONSTS): candidates the radix select lists in the stage's shared scratch
__device__ __forceinline__ u64 comb_of(const float* z, int i) {
    return ((u64)fkey(z[i]) << 32) | (u64)(0xffffffffu - (u32)i);
}
__device__ __forceinline__ u64 fixed_mass(float p) { return (u64)(p * 1099511627776.0f); }  // p 2^40, truncated
__device__ __forceinline__ float mass_f32(u64 m) { return __ull2float_rn(m) * (1.0f / 1099511627776.0f); }
__device__ __forceinline__ u32 match_any(int v) {
    u32 r;
    asm volatile("match.any.sync.b32 %0, %1, 0xffffffff;" : "=r"(r) : "r"(v));
    return r;
}
__device__ __forceinline__ u32 redux_add(u32 mask, u32 v) {
    u32 r;
    asm volatile("redux.sync.add.u32 %0, %1, %2;" : "=r"(r) : "r"(v), "r"(mask));
    return r;
}
// Adds v to bin b (b < 0: nothing) of the histograms, summed first over the warp's lanes with the
// same bin: one shared atomic per distinct bin, not 32 on one address. Every lane must call.
__device__ __forceinline__ void hist_add(u64* hist, u32* cnt, int b, u64 v) {
    const u32 same = match_any(b);
    if (b < 0) return;
    // v < 2^41: three 20-bit parts, each summed over <= 32 lanes within 32 bits
    const u32 s0 = redux_add(same, (u32)(v & 0xfffffu));
    const u32 s1 = redux_add(same, (u32)((v >> 20) & 0xfffffu));
    const u32 s2 = redux_add(same, (u32)(v >> 40));
    if ((int)(threadIdx.x & 31) == __ffs(same) - 1) {
        atomicAdd((unsigned long long*)&hist[b], (unsigned long long)(s0 + ((u64)s1 << 20) + ((u64)s2 << 40)));
        atomicAdd(&cnt[b], (u32)__popc(same));
    }
}
// The fixed-point mass of the candidates with key >= th (a deterministic block sum).
__device__ __noinline__ u64 mass_fixed(const float* z, const float* p, int V, u64 th) {
    u64* wsum = (u64*)smem_f();  // NW sums (the histograms' place; not in use between selects)
    u64 s = 0;
    for (int i = threadIdx.x; i < V; i += NT)
        if (comb_of(z, i) >= th) s += fixed_mass(p[i]);
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
    csync();
    if ((threadIdx.x & 31) == 0) wsum[threadIdx.x >> 5] = s;
    csync();
    u64 t = 0;
    for (int w = 0; w < NW; ++w) t += wsum[w];
    csync();  // wsum may be reused right after
    return t;
}
// The key of the element where a running total over the candidates (key >= floor) in descending
// key order first reaches `target` (kind 0: counts >= target; 1: masses >= target; 2: masses >
// target); the lowest candidate if it never does. MSB first, 8 bits a pass; bins without
// candidates are never chosen.
__device__ __noinline__ u64 radix_select(const float* z, const float* p, int V, int kind, u64 target, u64 floor) {
    u64* hist = (u64*)smem_f();   // [256] counts or fixed-point masses of the next byte's bins
    u32* cnt = (u32*)(hist + 256);  // [256] candidates per bin
    u64* sel = (u64*)(cnt + 256);   // prefix, mass or count above it, candidates under it, list size
    u32* list = (u32*)(sel + 4);    // [SAMPLE_CAP] the candidates under the prefix, once that few
    const int tid = threadIdx.x;
    u64 prefix = 0, above = 0;
    int nlist = -1;  // -1: passes read the whole vocabulary
    for (int pass = 0; pass < 8; ++pass) {
        const int shift = 56 - 8 * pass;
        for (int b = tid; b < 256; b += NT) { hist[b] = 0; cnt[b] = 0; }
        csync();
        const int n = nlist < 0 ? V : nlist;
        for (int j0 = 0; j0 < n; j0 += NT) {  // every lane takes part in hist_add's warp primitives
            const int j = j0 + tid;
            int b = -1;
            u64 v = 0;
            if (j < n) {
                const int i = nlist < 0 ? j : (int)list[j];
                const u64 cb = comb_of(z, i);
                if (cb >= floor && (pass == 0 || (cb >> (shift + 8)) == prefix)) {
                    b = (int)(cb >> shift) & 255;
                    v = kind == 0 ? 1ull : fixed_mass(p[i]);
                }
            }
            hist_add(hist, cnt, b, v);
        }
        csync();
        if (tid == 0) {
            u64 acc = above, acc_last = above;
            int chosen = -1, lastnz = -1;
            for (int b = 255; b >= 0; --b) {
                if (cnt[b] == 0) continue;
                const u64 nx = acc + hist[b];
                lastnz = b;
                acc_last = acc;
                if (kind == 2 ? nx > target : nx >= target) { chosen = b; break; }
                acc = nx;
            }
            if (chosen < 0) { chosen = lastnz; acc = acc_last; }  // never reached: the lowest candidate
            sel[0] = (prefix << 8) | (u64)chosen;
            sel[1] = acc;
            sel[2] = cnt[chosen];
            sel[3] = 0;
        }
        csync();
        prefix = sel[0];
        above = sel[1];
        if (pass < 7 && nlist < 0 && sel[2] <= SAMPLE_CAP) {  // few enough: list them (any order)
            for (int i = tid; i < V; i += NT) {
                const u64 cb = comb_of(z, i);
                if (cb >= floor && (cb >> shift) == prefix) list[atomicAdd((u32*)&sel[3], 1u)] = (u32)i;
            }
            csync();
            nlist = (int)sel[2];
        }
    }
    csync();  // the scratch is free again
    return prefix;
}

__device__ __noinline__ void run_sample(Ctx& c) {
    const i64* st = s_desc[c.dcur];
    i64* run = c.run;
    if (blockIdx.x != 0) return;
    const int tid = threadIdx.x;
    __shared__ int s_tok;
    if (c.logits_mode) {
        if (tid == 0) { run[R_STOP] = (c.it >= c.P - 1) ? 1 : 0; }
        return;
    }
    if (c.it < c.P - 1) {
        if (tid == 0) run[R_STOP] = 0;
        return;
    }
    const int n = c.it - (c.P - 1);  // generation step
    const int V = (int)st[SM_V];
    const float* logits = (const float*)st[SM_LOGITS];
    const float temp = __int_as_float((int)run[R_TEMP]);
    u32 cancel = 0;
    if (tid == 0 && run[R_CANCEL]) cancel = ld_sys((const volatile u32*)run[R_CANCEL]);
    if (temp <= 0.f) {
        if (st[SM_ARGMAX]) {  // the LM head's (max, index) partials, one per block: one load each, then a tree
            const int nt = (int)st[SM_NPART];
            const float* bv = (const float*)st[SM_ARGMAX];
            const int* bi = (const int*)st[SM_ARGMAX] + nt;
            __shared__ float w_bv[NW]; __shared__ int w_bi[NW];
            float b = -__int_as_float(0x7f800000); int idx = 0x7fffffff;
            for (int j = tid; j < nt; j += NT) {
                const float v = ldf(bv + j);
                const int ixx = __float_as_int(ldf((const float*)(bi + j)));
                if (v > b || (v == b && ixx < idx)) { b = v; idx = ixx; }
            }
#pragma unroll
            for (int o = 16; o > 0; o >>= 1) {
                const float ov = __shfl_xor_sync(0xffffffffu, b, o);
                const int oi = __shfl_xor_sync(0xffffffffu, idx, o);
                if (ov > b || (ov == b && oi < idx)) { b = ov; idx = oi; }
            }
            if ((tid & 31) == 0) { w_bv[tid >> 5] = b; w_bi[tid >> 5] = idx; }
            csync();
            if (tid == 0) {
                for (int w = 1; w < NW; ++w)
                    if (w_bv[w] > b || (w_bv[w] == b && w_bi[w] < idx)) { b = w_bv[w]; idx = w_bi[w]; }
                s_tok = idx == 0x7fffffff ? 0 : idx;
            }
        } else {
            __shared__ float s_bv[NT]; __shared__ int s_bi[NT];
            float b = -__int_as_float(0x7f800000); int idx = 0x7fffffff;
            for (int i = tid; i < V; i += NT) { float v = ldf(logits + i); if (v > b) { b = v; idx = i; } }
            s_bv[tid] = b; s_bi[tid] = idx;
            csync();
            if (tid == 0) {
                for (int j = 1; j < NT; ++j) if (s_bv[j] > b || (s_bv[j] == b && s_bi[j] < idx)) { b = s_bv[j]; idx = s_bi[j]; }
                s_tok = idx == 0x7fffffff ? 0 : idx;
            }
        }
        csync();
    } else {
        float* z = (float*)run[R_SCRATCH];
        float* p = z + V;
        float zm = -__int_as_float(0x7f800000);
        for (int i = tid; i < V; i += NT) { float v = __fdiv_rn(ldf(logits + i), temp); z[i] = v; zm = fmaxf(zm, v); }
        zm = block_max(zm);
        for (int i = tid; i < V; i += NT) p[i] = expf(z[i] - zm);
        csync();
        int topk = (int)run[R_TOPK];
        u64 cmin = 0;
#if SAMPLE_RADIX  // the same steps on fixed-point masses (targets: float32 products, as the CPU)
        const float topp = __int_as_float((int)run[R_TOPP]);
        const u32 w = philox_w0((u64)run[R_SEED], (u32)n);
        const float u = (float)(w >> 8) * (1.0f / 16777216.0f);
        if (topk > 0 && topk < V) cmin = radix_select(z, p, V, 0, (u64)topk, 0);
        u64 ckeep = cmin;
        if (topp < 1.0f) {
            const u64 total = mass_fixed(z, p, V, cmin);
            const u64 cp = radix_select(z, p, V, 1, fixed_mass(__fmul_rn(topp, mass_f32(total))), cmin);
            ckeep = cp > cmin ? cp : cmin;
        }
        const u64 kept = mass_fixed(z, p, V, ckeep);
        const u64 ce = radix_select(z, p, V, 2, fixed_mass(__fmul_rn(u, mass_f32(kept))), ckeep);
#else
        if (topk > 0 && topk < V) cmin = sample_search(z, p, V, 0, (u32)topk, 0.f, 0, 0, ~0ull);
        float total = mass_ge(z, p, V, cmin);
        float topp = __int_as_float((int)run[R_TOPP]);
        u64 ckeep = cmin;
        if (topp < 1.0f) {
            u64 cp = sample_search(z, p, V, 1, 0, topp * total, cmin, cmin, ~0ull);
            ckeep = cp > cmin ? cp : cmin;
        }
        float kept = mass_ge(z, p, V, ckeep);
        u32 w = philox_w0((u64)run[R_SEED], (u32)n);
        float u = (float)(w >> 8) * (1.0f / 16777216.0f);
        float tu = u * kept;
        u64 ce = sample_search(z, p, V, 2, 0, tu, ckeep, ckeep, ~0ull);
#endif
        // ce is the comb of the chosen element (or ckeep: the last kept one)
        if (tid == 0) s_tok = (int)(0xffffffffu - (u32)(ce & 0xffffffffu));
        csync();
    }
    if (tid == 0) {
        int tok = s_tok;
        int stop = 0;
        const int* stops = (const int*)run[R_STOPIDS];
        for (int j = 0; j < (int)run[R_NSTOP]; ++j) if (stops[j] == tok) stop = 1;
        if (n + 1 >= (int)run[R_MAXNEW]) stop = 1;
        if (c.pos + 1 >= (int)run[R_CTX]) stop = 1;
        if (cancel) stop = 2;
        if (stop != 2) {
            volatile int* ho = (volatile int*)run[R_HOST_OUT];
            ho[n] = tok;
            __threadfence_system();
            volatile int* hc = (volatile int*)run[R_HOST_COUNT];
            *hc = n + 1;
            __threadfence_system();
        }
        run[R_TOK] = tok;
        run[R_STOP] = stop;
    }
    csync();
}

// ------------------------------------------------------------------------------ kernel

// The signal warp (SIGNAL_WARP): lane 0 adds 1 to counter[s] (a gpu-scope release) for every stage
// s the consumers finish, in order. The consumers' barrier orders their writes before thread 0's
// fence and atomic store of s_staged; the atomic read here, followed by the release add's fence,
// carries them on to the blocks that wait on the counter (atomics on both sides: racecheck).
// Exits when the request ends, after the last stage's add.
__device__ __noinline__ void signal_stages(u32* counters, int nst) {
    if ((threadIdx.x & 31) != 0) return;
    u32 done = 0;
    for (;;) {
        const u32 now = (u32)atomicAdd(&s_staged, 0u);  // the red.release below is also the acquire fence
        if (now == done) {
            if (atomicAdd(&s_done, 0) && (u32)atomicAdd(&s_staged, 0u) == done) return;
            continue;
        }
        for (; done < now; ++done) red_release(counters + done % (u32)nst, 1u);
    }
}

extern "C" __global__ void __launch_bounds__(NTHREADS, 1)
kog_decode(const i64* __restrict__ stages, int nst, u32* counters, i64* run) {
    // this stage's, the previous stage's and (arriving during this stage) the next stage's
    // descriptors, and this block's share of them (schedule.stream_list block info)
    const int4* binfo = (const int4*)run[R_BINFO];
    Ctx c;
    c.run = run;
    c.logits_all = (float*)run[R_LOGITS_ALL];
    c.nst = nst;
    c.stages = stages;
    c.P = (int)run[R_PROMPT_LEN];
    c.logits_mode = (int)run[R_LOGITS_MODE];
    c.skipmask = (int)run[R_SKIP];
    c.it = 0;
    const int start_pos = (int)run[R_START_POS];
    c.start_pos = start_pos;
    const int* prompt = (const int*)run[R_PROMPT];
    const u32 nb = gridDim.x;
    if (threadIdx.x == 0) {
        for (int i = 0; i < NSLOTS; ++i) { mbar_init(&full_bar[i], FULL_ARRIVALS); mbar_init(&empty_bar[i], NT); }
        s_done = 0;
        if (SIGNAL_WARP) s_staged = 0;
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();  // the last barrier of all NTHREADS: from here on the producer warp goes its own way
    if (SIGNAL_WARP && threadIdx.x >= NT + 32) {
        signal_stages(counters, nst);
        return;
    }
    if (threadIdx.x >= NT) {
        produce(c);
        return;
    }
    u32 q = 0;  // ring items consumed (the same count in every consumer thread)
    // Descriptors are read from shared memory: a global read after a wait would put an L2 round
    // trip on the critical path. The next stage's row is loaded while this one runs.
    const int tid = threadIdx.x;
    if (tid < NSLOT) s_desc[0][tid] = stages[tid];
    if (tid == NSLOT) s_blk[0] = binfo[blockIdx.x];
    u32 sd = 0;  // stages run so far: s_desc[sd % 3] is the current one
    csync();
    for (int it = 0;; ++it) {
        c.it = it;
        c.pos = start_pos + it;
        for (int s = 0; s < nst; ++s, ++sd) {
            const u32 cur = sd % 3, nxt = (sd + 1) % 3;
            const i64* st = s_desc[cur];
            c.dcur = (int)cur;
            c.dprev = (int)((sd + 2) % 3);
            c.blk = s_blk[cur];
            // the next stage's row lands in the buffer of stage sd - 2 (read by nobody since the
            // last barrier) while this stage runs: cp.async, so no register holds it across the
            // stage call (a value live across a noinline call spills)
            const int sn = s + 1 < nst ? s + 1 : 0;
            if (tid < NSLOT) cp_async8(&s_desc[nxt][tid], stages + (i64)sn * NSLOT + tid);
            if (tid == NSLOT) cp_async16(&s_blk[nxt], binfo + sn * gridDim.x + blockIdx.x);
            cp_commit();
            const int type = (int)st[S_TYPE];
            const u32* wctr = s > 0 ? counters + s - 1 : counters + nst - 1;
            // TAG_DOWN: the input's values say when they are ready; wait on the stage before their writer
            if (TAG_DOWN && type == ST_MATVEC && ((int)st[MV_FLAGS] & MVF_TAG_IN)) wctr = counters + s - 2;
            const u32 wtarget = (c.skipmask >> 6) & 1 ? 0u : s > 0 ? nb * (u32)(it + 1) : nb * (u32)it;  // bit 6: stream only
            if (s == 0) c.tok = it < c.P ? prompt[it] : (int)ldi64(run + R_TOK);  // written before the previous iteration's last wait
#ifdef TRACE
            c.tr = trace_row(run, it, s, nst);
            if (c.tr && threadIdx.x == 0) { u32 sm; asm("mov.u32 %0, %%smid;" : "=r"(sm)); c.tr[7] = sm; }
#endif
            TMARK(c, 0);
            const bool skipk = type == ST_MATVEC ? !mv_runs(st, it, c) : (c.skipmask >> type) & 1;
            if (type == ST_ATTN && !skipk && (int)blockIdx.x < att_ntiles(c)) att_issue_first(c, blockIdx.x);
            if (skipk || type != ST_MATVEC) { wait_counter(wctr, wtarget); TMARK(c, 1); TMARK(c, 2); }
            if (skipk) { }
            else if (type == ST_MATVEC) run_matvec(c, q, wctr, wtarget);
            else if (type == ST_ATTN) run_attention(c);
            else if (type == ST_EW) run_ew(c);
            else if (type == ST_SAMPLE) run_sample(c);
            cp_wait_all();  // the next stage's row (visible to all consumers after the barrier)
            csync();
            TMARK(c, 3);
            // release: every write of this block (ordered by the barrier) is visible before the count.
            // Benchmark bit 8 (with bit 6, no waits): only the token's last stage signals.
            if (threadIdx.x == 0 && (!((c.skipmask >> 8) & 1) || s == nst - 1)) {
                if (SIGNAL_WARP) { __threadfence_block(); atomicExch(&s_staged, sd + 1); }  // the signal warp adds for it
                else red_release(counters + s, 1u);
            }
            TMARK(c, 9);
        }
        wait_counter(counters + nst - 1, nb * (u32)(it + 1));
        if (ldi64(run + R_STOP)) break;
    }
    if (threadIdx.x == 0) atomicExch(&s_done, 1);  // the producer drains its copies in flight and exits
}
