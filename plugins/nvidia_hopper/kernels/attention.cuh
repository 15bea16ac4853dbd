// The attention stage: tiles of (lane, kv head, chunk of positions), K/V through shared memory,
// online softmax, partials combined by the last tile. Part of the decode kernel: decode.cu includes
// it (cuda_util.kernel_source splices it in, in order).

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
// ATT_COMBINE_BATCH (session 12; KOG_HOPPER_DEFINES=ATT_COMBINE_BATCH=0 for the old form): the
// last tile of a kv head copies every chunk's partial output into shared memory at once (cp.async,
// no registers held) instead of loading one chunk per round trip. (Its ticket's reset lost its
// own fence in the same change: a gpu-scope fence waits ~1 us behind the ring's copies; session 12.)
#ifndef ATT_COMBINE_BATCH
#define ATT_COMBINE_BATCH 1
#endif
// ATT_TICKET_ACQREL (session 23, an experiment; KOG_HOPPER_DEFINES=ATT_TICKET_ACQREL=1): a tile takes
// its ticket with one acq_rel atomic instead of __threadfence() (MEMBAR.SC.GPU) and an acquire one.
// The trace (session 23) puts the ticket at ~0.85 us of a tile's end, on the combine's path.
#ifndef ATT_TICKET_ACQREL
#define ATT_TICKET_ACQREL 0
#endif
// ATT_TAGS (session 23, an experiment, off; KOG_HOPPER_ATT_TAGS=1; not yet run on a GPU): readiness
// in the data instead of a ticket. Each partial (m, l, every o) is stored as one 64-bit word {value,
// this token's tag} (a 64-bit access is single-copy atomic: the NCCL LL protocol's form), and the
// tile of the chunk holding pos combines: it polls the other chunks' words until each carries the
// tag. No fence, no ticket and no second round trip on the combine's path (the trace, session 23:
// the ticket ~0.85 us, then the partials' round trip). The backend zeroes the words before each
// launch (tag = token iteration + 1, never 0). Only with the last tile combining (not the loader).
#ifndef ATT_TAGS
#define ATT_TAGS 0
#endif
#ifndef ATT_TAG_BATCH
#define ATT_TAG_BATCH 4  // 16-byte loads (two tagged words) a thread has in flight per pass; 0: none
#endif               // (every o polled in the combine's loop, the path of groups too wide for the scratch)
// An attention output value as stored: with TAG_OPROJ and AT_OTAG set, carrying this write's
// parity in its lowest mantissa bit (o_proj polls for it: schedule.tag_attention_outputs)
__device__ __forceinline__ float att_out_tagged(const i64* st, int it, float v) {
#if TAG_OPROJ
    if (st[AT_OTAG]) return with_parity(v, tag_parity_of((u32)st[AT_OTAG], it));
#endif
    return v;
}
__device__ __forceinline__ void st_tagged(u64* p, float v, u32 tag) {
    asm volatile("st.relaxed.gpu.global.b64 [%0], %1;" :: "l"(p), "l"(((u64)tag << 32) | __float_as_uint(v)) : "memory");
}
__device__ __forceinline__ u64 ld_tagged(const u64* p) {
    u64 r;
    asm volatile("ld.relaxed.gpu.global.b64 %0, [%1];" : "=l"(r) : "l"(p) : "memory");
    return r;
}
// two words in one 16-byte access: a vector access is, in the memory model, one access per element,
// so each 64-bit word keeps its own atomicity (p 16-byte aligned)
__device__ __forceinline__ void ld_tagged2(const u64* p, u64& a, u64& b) {
    asm volatile("ld.relaxed.gpu.global.v2.b64 {%0, %1}, [%2];" : "=l"(a), "=l"(b) : "l"(p) : "memory");
}
__device__ __forceinline__ float ld_tagged_wait(const u64* p, u32 tag, bool poll) {  // one word, polled until it is this token's
    u64 v = ld_tagged(p);
    while (poll && (u32)(v >> 32) != tag) v = ld_tagged(p);
    return __uint_as_float((u32)v);
}

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

// ATT_WARP_ROWS (session 12; KOG_HOPPER_DEFINES=ATT_WARP_ROWS=0 for the block-step form): each
// warp takes whole K/V rows of a sub-chunk (row j: warp j % NW) and keeps its own running softmax
// (m, l, o) for the group's query heads in registers, lane = hd / 32 columns; the warps' states are
// merged once at the end of the tile. A sub-chunk then costs two barriers instead of five, and a
// row's score one warp reduction for all heads at once instead of a 16-lane reduction per head
// and position (the block-step sub-chunk took 1.6 us for 32 positions: scores 0.77, softmax 0.35,
// P.V 0.29, reduction 0.16, each a barrier apart; trace, session 11). Needs the shapes compiled in
// (SHAPE_CONSTS), hd a multiple of 32 up to 256, at most 16 of a lane's (head, column) pairs in
// registers (q and o: 32 floats; more spill), and room for the warps' states in the scratch.
#ifndef ATT_WARP_ROWS
#define ATT_WARP_ROWS 1
#endif
#if ATT_WARP_ROWS && defined(ATC_HD)
#define AG (ATC_H / ATC_HKV)
#define ADPL (ATC_HD / 32)
#define ATT_ROWS_ML ((2 * NW * AG + 3) & ~3)  // floats of the warps' (m, l), then their o [NW][AG][hd]
#if ATC_HD % 32 == 0 && ATC_HD <= 256 && AG * ADPL <= 16 && ATT_ROWS_ML + NW * AG * ATC_HD <= NT * 8 + KV_BUFS * ATT_SUB * (ATC_HD + 8)
#define ATT_ROWS 1
#endif
#endif
#ifndef ATT_ROWS
#define ATT_ROWS 0
#endif
#if ATT_ROWS
// Column i of this lane. With 1, 2, 4 or 8 columns a lane they are adjacent, one aligned vector
// load; with 3, 5, 6 or 7 (hd 96, 160, 192, 224) a vector at ln * ADPL would be misaligned (hd 96:
// 6-byte steps; laneformer-2b failed with CUDA_ERROR_MISALIGNED_ADDRESS, session 13), so the lanes
// take columns ln, ln + 32, ...: one 2-byte load each, a warp's 64 bytes adjacent (no bank conflict).
#if ADPL == 1 || ADPL == 2 || ADPL == 4 || ADPL == 8
#define ACOL(ln, i) ((ln) * ADPL + (i))
#else
#define ACOL(ln, i) ((ln) + 32 * (i))
#endif
// this lane's ADPL columns of a bf16 K or V row `r` in shared memory
__device__ __forceinline__ void att_ld_cols(const u16* r, int ln, float (&f)[ADPL]) {
#if ADPL == 1
    f[0] = bf2f(r[ln]);
#elif ADPL == 2
    const u32 w = *(const u32*)(r + 2 * ln);
    f[0] = bf_lo(w); f[1] = bf_hi(w);
#elif ADPL == 4
    const uint2 w = *(const uint2*)(r + 4 * ln);
    f[0] = bf_lo(w.x); f[1] = bf_hi(w.x); f[2] = bf_lo(w.y); f[3] = bf_hi(w.y);
#elif ADPL == 8
    const uint4 w = *(const uint4*)(r + 8 * ln);
    f[0] = bf_lo(w.x); f[1] = bf_hi(w.x); f[2] = bf_lo(w.y); f[3] = bf_hi(w.y);
    f[4] = bf_lo(w.z); f[5] = bf_hi(w.z); f[6] = bf_lo(w.w); f[7] = bf_hi(w.w);
#else
#pragma unroll
    for (int i = 0; i < ADPL; ++i) f[i] = bf2f(r[ACOL(ln, i)]);
#endif
}
// One position (its K and V rows) into this warp's running softmax for every query head of the
// group: the scores of all heads reduced over the warp together (interleaved shuffles).
__device__ __forceinline__ void att_row(const u16* Kr, const u16* Vr, int ln, const float (&qv)[AG][ADPL], float scale,
                                        float (&wm)[AG], float (&wl)[AG], float (&wo)[AG][ADPL]) {
    float kf[ADPL], vf[ADPL], sc[AG];
    att_ld_cols(Kr, ln, kf);
    att_ld_cols(Vr, ln, vf);
#pragma unroll
    for (int g = 0; g < AG; ++g) {
        float d = 0.f;
#pragma unroll
        for (int i = 0; i < ADPL; ++i) d = fmaf(qv[g][i], kf[i], d);
        sc[g] = d;
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
#pragma unroll
        for (int g = 0; g < AG; ++g) sc[g] += __shfl_xor_sync(0xffffffffu, sc[g], o);
    }
#pragma unroll
    for (int g = 0; g < AG; ++g) {
        const float x = sc[g] * scale, mn = fmaxf(wm[g], x);
        const float a = expf(wm[g] - mn), p = expf(x - mn);  // a = 0 on the warp's first row (m = -inf)
        wl[g] = fmaf(wl[g], a, p);
#pragma unroll
        for (int i = 0; i < ADPL; ++i) wo[g][i] = fmaf(p, vf[i], wo[g][i] * a);
        wm[g] = mn;
    }
}
#endif

// Tile = (lane, kv head, chunk of positions). The chunk count adapts to the length so that the
// tiles roughly fill the grid. A tile streams its chunk's K/V through shared memory in
// sub-chunks of ATT_SUB positions (cp.async, KV_BUFS in flight), with a running (online) softmax per
// query head; partial (m, l, o) go to a scratch buffer and the last tile of a (lane, kv head) to
// finish (atomic ticket) combines them. The chunk holding `pos` also applies RoPE to the new key
// and writes the new K/V (bf16) into the cache.
#if ATT_TAGS
// ATT_TAGS's layout, chunk-major within a (lane, kv head) so that the combining tile's words are
// one contiguous run: o [lane][kv head][chunk][G hd] and (m, l) [lane][kv head][chunk][G][2].
__device__ __forceinline__ u64* att_tag_o(const i64* st, int l, int g, int ch) {
    const int Hkv = AT_I(st, HKV), MAXCH = AT_I(st, MAXCH), GH = AT_I(st, H) / Hkv * AT_I(st, HD);
    return (u64*)st[AT_PART_O] + ((i64)(l * Hkv + g) * MAXCH + ch) * GH;
}
__device__ __forceinline__ u64* att_tag_ml(const i64* st, int l, int g, int ch) {
    const int Hkv = AT_I(st, HKV), MAXCH = AT_I(st, MAXCH), G = AT_I(st, H) / Hkv;
    return (u64*)st[AT_PART_ML] + ((i64)(l * Hkv + g) * MAXCH + ch) * G * 2;
}
// The combining tile (the chunk holding pos) under ATT_TAGS: the other chunks' (m, l) and, where
// they fit beside them in the free scratch, their partial outputs are polled into shared memory,
// ATT_TAG_BATCH words a thread in flight at once; its own chunk's come from ob, s_m, s_l. Then the
// same sums in the same order as the ticket's combine (the same logits bit for bit).
__device__ __forceinline__ void att_combine_tagged(const Ctx& c, int l, int g, int nch, const float* ob,
                                                   const float* s_m, const float* s_l) {
    const i64* st = s_desc[c.dcur];
    const int H = AT_I(st, H), Hkv = AT_I(st, HKV), hd = AT_I(st, HD), MAXCH = AT_I(st, MAXCH);
    const int G = H / Hkv, GH = G * hd, tid = threadIdx.x, n1 = nch - 1;
    const u32 tag = (u32)c.it + 1u;
    const bool poll = polls_on(c);  // not under the benchmark's no-wait mask: a drifted writer could skip this tag
    const u64* po = att_tag_o(st, l, g, 0);
    const u64* pml = att_tag_ml(st, l, g, 0);
    float* mls = smem_f() + att_red_off(c);           // [chunk][G][2]
    float* osm = mls + ((2 * G * MAXCH + 3) & ~3);    // [chunk < nch - 1][G hd]
    constexpr int TB = ATT_TAG_BATCH > 0 ? ATT_TAG_BATCH : 1;
    const bool batch = ATT_TAG_BATCH > 0 && ((2 * G * MAXCH + 3) & ~3) + n1 * GH <= NT * 8 + KV_BUFS * ATT_SUB * (hd + 8);
    const int nml = n1 * G * 2, total = nml + (batch ? n1 * GH : 0);
    // word pairs (nml and n1 G hd are even, and both runs start on 16 bytes)
    for (int i0 = tid; i0 < total / 2; i0 += NT * TB) {
        u64 v[TB][2];
#pragma unroll
        for (int b = 0; b < TB; ++b) {  // every load of the pass issued before any is checked
            const int i = 2 * (i0 + b * NT);
            if (i < total) ld_tagged2(i < nml ? pml + i : po + (i - nml), v[b][0], v[b][1]);
        }
#pragma unroll
        for (int b = 0; b < TB; ++b) {
            const int i = 2 * (i0 + b * NT);
            if (i < total) {
                while (poll && ((u32)(v[b][0] >> 32) != tag || (u32)(v[b][1] >> 32) != tag))  // not yet written: poll
                    ld_tagged2(i < nml ? pml + i : po + (i - nml), v[b][0], v[b][1]);
                float* dst = i < nml ? mls + i : osm + (i - nml);
                dst[0] = __uint_as_float((u32)v[b][0]);
                dst[1] = __uint_as_float((u32)v[b][1]);
            }
        }
    }
    if (tid < G) { mls[(n1 * G + tid) * 2] = s_m[tid]; mls[(n1 * G + tid) * 2 + 1] = s_l[tid]; }
    csync();
    ATT_LOOP
    for (int i = tid; i < GH; i += NT) {
        const int gi = i / hd, d = i - gi * hd, h = g * G + gi;
        float M = -__int_as_float(0x7f800000);
        ATT_LOOP
        for (int k = 0; k < nch; ++k) M = fmaxf(M, mls[(k * G + gi) * 2]);
        float num = 0.f, den = 0.f;
        ATT_LOOP
        for (int k = 0; k < nch; ++k) {
            const float w = expf(mls[(k * G + gi) * 2] - M);
            const float o = k == n1 ? ob[i] : batch ? osm[k * GH + i] : ld_tagged_wait(po + (i64)k * GH + i, tag, poll);
            num = fmaf(w, o, num);
            den = fmaf(w, mls[(k * G + gi) * 2 + 1], den);
        }
        ((float*)st[AT_OUT])[(i64)l * H * hd + (i64)h * hd + d] = att_out_tagged(st, c.it, num / den);
    }
}
#endif

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
        // One loop, every load before the first store: with the new key / value in a loop of their
        // own, the tile holding pos (a full chunk, often the last to finish) waited a second round
        // trip behind q's stores (session 23). hd <= G hd, so the q loop covers them.
        const float* qsrc = (const float*)st[AT_Q] + (i64)l * H * hd + (i64)g * GH;
        const float* ks = (const float*)st[AT_KNEW] + (i64)l * Hkv * hd + (i64)g * hd;
        const float* vs = (const float*)st[AT_VNEW] + (i64)l * Hkv * hd + (i64)g * hd;
#if TAG_QKV
        const bool tagged = st[AT_TAG] != 0 && polls_on(c);  // (schedule.tag_attention_inputs) each value's parity says it is this write's
        const u32 par = tag_parity_of((u32)st[AT_TAG], c.it);
#endif
        ATT_LOOP
        for (int i = tid; i < GH; i += NT) {
            const bool kv = own && i < hd;
            float qi = ldf(qsrc + i);
            float ki = 0.f, vi = 0.f;
            if (kv) { ki = ldf(ks + i); vi = ldf(vs + i); }
#if TAG_QKV
            if (tagged) {  // re-read what the q/k/v stage has not yet written (ld_poll: a fresh load each time)
                while ((__float_as_uint(qi) & 1u) != par) qi = ld_poll(qsrc + i);
                if (kv) {
                    while ((__float_as_uint(ki) & 1u) != par) ki = ld_poll(ks + i);
                    while ((__float_as_uint(vi) & 1u) != par) vi = ld_poll(vs + i);
                }
            }
#if TAG_CHECK
            if (tagged) {
                spin_acquire(c.chk_ctr + c.chk_s - 1, gridDim.x * (u32)(c.it + 1));
                const u32 tw = (u32)st[AT_TAG];
                tag_check("q", c.chk_s, c.it, i, qi, ld_poll(qsrc + i), tw, par);
                if (kv) { tag_check("k", c.chk_s, c.it, i, ki, ld_poll(ks + i), tw, par); tag_check("v", c.chk_s, c.it, i, vi, ld_poll(vs + i), tw, par); }
            }
#endif
#endif
            q[i] = qi;
            ob[i] = 0.f;
            if (kv) { kn[i] = ki; vn[i] = rbf(vi); }
        }
        if (tid < 8) { s_m[tid] = -__int_as_float(0x7f800000); s_l[tid] = 0.f; }
        cp_wait_rope();  // this thread's RoPE copies (att_issue_first) have landed; the barrier shows all
        csync();
        if (ropeq && warp < G) rope_vec(warp * hd, hd, ropeq, att_red_off(c));
        if (own && ropek && warp == NW - 1) rope_vec(GH, hd, ropek, att_red_off(c));
        csync();
        TMARK_TILE(c, tk, 10, 21);
#if ATT_ROWS
        float qv[AG][ADPL], wm[AG], wl[AG], wo[AG][ADPL];  // this warp's running softmax (ATT_WARP_ROWS)
#pragma unroll
        for (int g = 0; g < AG; ++g) {
            wm[g] = -__int_as_float(0x7f800000);
            wl[g] = 0.f;
#pragma unroll
            for (int i = 0; i < ADPL; ++i) { qv[g][i] = q[g * hd + ACOL(ln, i)]; wo[g][i] = 0.f; }
        }
#endif
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
#if ATT_ROWS
            ATT_LOOP
            for (int j = warp; j < cnt; j += NW) att_row(Kb + j * RS, Vb + j * RS, ln, qv, scale, wm, wl, wo);
            csync();  // buffer (s % KV_BUFS) is free again
            if (s == 0) TMARK_TILE(c, tk, 16, 25);
#else
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
#endif
            if (s + KV_BUFS < nsub) att_issue(Kb, Vb, kc, vc, a + KV_BUFS * ATT_SUB, min(a + (KV_BUFS + 1) * ATT_SUB, p1), skip, hd, RS);
            else cp_commit();
        }
        cp_wait_all();
#if ATT_ROWS
        {   // the warps' states merged into ob / s_m / s_l (red and the K/V buffers are free now)
            float* wml = red;                // [NW][AG] (m, l)
            float* wro = red + ATT_ROWS_ML;  // [NW][AG][hd] o
#pragma unroll
            for (int g = 0; g < AG; ++g) {
#pragma unroll
                for (int i = 0; i < ADPL; ++i) wro[(warp * AG + g) * hd + ACOL(ln, i)] = wo[g][i];
                if (ln == 0) { wml[(warp * AG + g) * 2] = wm[g]; wml[(warp * AG + g) * 2 + 1] = wl[g]; }
            }
            csync();
            ATT_LOOP
            for (int i = tid; i < GH; i += NT) {
                const int gi = i / hd, d = i - gi * hd;
                float M = -__int_as_float(0x7f800000);
#pragma unroll
                for (int w = 0; w < NW; ++w) M = fmaxf(M, wml[(w * AG + gi) * 2]);
                float L = 0.f, O = 0.f;
#pragma unroll
                for (int w = 0; w < NW; ++w) {  // a warp without rows has m = -inf: weight 0
                    const float f = expf(wml[(w * AG + gi) * 2] - M);
                    L = fmaf(f, wml[(w * AG + gi) * 2 + 1], L);
                    O = fmaf(f, wro[(w * AG + gi) * hd + d], O);
                }
                ob[i] = O;
                if (d == 0) { s_m[gi] = M; s_l[gi] = L; }
            }
            csync();
        }
#endif
        TMARK_TILE(c, tk, 12, 23);
        ATT_LOOP
        for (int i = tid; i < GH; i += NT) {
            const int gi = i / hd, d = i - gi * hd, h = g * G + gi;
            if (nch == 1 && combine) {
                ((float*)st[AT_OUT])[(i64)l * H * hd + (i64)h * hd + d] = att_out_tagged(st, c.it, ob[i] / s_l[gi]);
            } else if (ATT_TAGS && combine) {
#if ATT_TAGS
                if (ch != nch - 1) {  // the combining tile keeps its own in shared memory
                    const u32 tag = (u32)c.it + 1u;
                    st_tagged(att_tag_o(st, l, g, ch) + i, ob[i], tag);
                    if (d == 0) {
                        st_tagged(att_tag_ml(st, l, g, ch) + gi * 2, s_m[gi], tag);
                        st_tagged(att_tag_ml(st, l, g, ch) + gi * 2 + 1, s_l[gi], tag);
                    }
                }
#endif
            } else {
                partO[(((i64)l * H + h) * MAXCH + ch) * hd + d] = ob[i];
                if (d == 0) {
                    partML[(((i64)l * H + h) * MAXCH + ch) * 2] = s_m[gi];
                    partML[(((i64)l * H + h) * MAXCH + ch) * 2 + 1] = s_l[gi];
                }
            }
        }
        TMARK_TILE(c, tk, 13, 24);
#if ATT_TAGS
        if (nch > 1 && combine && ch == nch - 1) {
            csync();  // ob, s_m and s_l final; red free
            att_combine_tagged(c, l, g, nch, ob, s_m, s_l);
        }
#else
        if (nch > 1 && combine) {
            csync();
            u32* ticket = (u32*)st[AT_TICKET] + l * Hkv + g;
            if (tid == 0) {
                u32 k;  // an acquire: the last tile's reads of the other tiles' partials come after it
#if ATT_TICKET_ACQREL
                // a release as well, after the barrier (as the stage's own release): the block's
                // partials before its ticket, without a sequentially consistent fence (MEMBAR.SC)
                asm volatile("atom.acq_rel.gpu.global.add.u32 %0, [%1], 1;" : "=r"(k) : "l"(ticket) : "memory");
#else
                __threadfence();  // this tile's partials before its ticket
                asm volatile("atom.acquire.gpu.global.add.u32 %0, [%1], 1;" : "=r"(k) : "l"(ticket) : "memory");
#endif
                s_last = (k == (u32)nch - 1);
                // the reset needs no fence of its own: the next use of the ticket (this layer, next
                // token) comes after this block's release of the stage, whose fence orders it
                if (s_last) *ticket = 0u;
            }
            csync();
            if (s_last) {
                // (m, l) of every chunk into shared memory (red is free now), and with ATT_COMBINE_BATCH
                // every chunk's partial output of the group too (red and the K/V buffers are free),
                // all copies in flight at once: one round trip, not one per chunk. Else (no room)
                // the per-chunk loop below.
                float* mls = red;
                float* osm = red + ((2 * G * MAXCH + 3) & ~3);  // [chunk][G * hd]
                const bool batch = ATT_COMBINE_BATCH && (hd & 3) == 0 &&
                                   ((2 * G * MAXCH + 3) & ~3) + nch * GH <= NT * 8 + KV_BUFS * ATT_SUB * RS;
                if (batch) {
                    ATT_LOOP
                    for (int i = tid; i < nch * (GH >> 2); i += NT) {  // float4 i: chunk k, 4 columns of head gi
                        const int k = att_div(i, GH >> 2), c4 = 4 * (i - k * (GH >> 2)), gi = c4 / hd;
                        cp_async16(osm + k * GH + c4,
                                   partO + (((i64)l * H + g * G + gi) * MAXCH + k) * hd + (c4 - gi * hd));
                    }
                    cp_commit();
                }
                ATT_LOOP
                for (int i = tid; i < G * nch; i += NT) {
                    const int gi = att_div(i, nch), k = i - gi * nch;
                    const float* ml = partML + (((i64)l * H + g * G + gi) * MAXCH + k) * 2;
                    mls[i * 2] = ldf(ml);
                    mls[i * 2 + 1] = ldf(ml + 1);
                }
                cp_wait_all();
                csync();
                ATT_LOOP
                for (int i = tid; i < GH; i += NT) {
                    const int gi = i / hd, d = i - gi * hd, h = g * G + gi;
                    const float* ml = mls + gi * nch * 2;
                    float M = -__int_as_float(0x7f800000);
                    ATT_LOOP
                    for (int k = 0; k < nch; ++k) M = fmaxf(M, ml[2 * k]);
                    float num = 0.f, den = 0.f;
                    const float* po = partO + (((i64)l * H + h) * MAXCH) * hd + d;
                    ATT_LOOP
                    for (int k = 0; k < nch; ++k) {
                        const float w = expf(ml[2 * k] - M);
                        num = fmaf(w, batch ? osm[k * GH + i] : __ldcg(po + (i64)k * hd), num);
                        den = fmaf(w, ml[2 * k + 1], den);
                    }
                    ((float*)st[AT_OUT])[(i64)l * H * hd + (i64)h * hd + d] = att_out_tagged(st, c.it, num / den);
                }
            }
        }
#endif
        csync();
    }
}
