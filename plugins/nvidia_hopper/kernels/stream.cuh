// The weight stream: each block's producer warp copies every matvec item into a ring of shared-
// memory slots, across stages and tokens. Part of the decode kernel: decode.cu includes it
// (cuda_util.kernel_source splices it in, in order).

// An item (schedule.stream_plan) is `rows` weight rows (pair segments: gate rows then up rows) x
// klen columns, <= SLOT_BYTES, stored contiguously in the stage's packed weights: one bulk copy.
// Its header, 8 ints: segment | lane << 2, offset / 16, first row, rows, k0, klen, flags
// (IT_FIRST / IT_LAST k-slice of its row group), x offset. The producer writes it into the slot's
// header beside the data, so a consumer never reads an item description from global memory.
#define IT_FIRST 1
#define IT_LAST 2
#define IT_UNIT 4  // a pool unit's first item; bits 8-15 its gate/up (or plain) items, 16-23 its down items
#define IT_END 8   // the pool's end: a slot without data (DYN_POOL)

// SMEM_ALIGN: the dynamic shared memory (stage scratch, then the ring) starts on this boundary. It
// follows the static shared memory, whose size moves with every __shared__ variable: without it,
// adding two u32 (session 10) moved the ring from a 64- to a 16-byte boundary and bench-2b lost 15%.
#ifndef SMEM_ALIGN
#define SMEM_ALIGN 16
#endif
extern __shared__ __align__(SMEM_ALIGN) float4 smem4[];
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
#define SE_POOL 8         // a pool's marker (schedule.stream_list; DYN_POOL)
#define SE_TEMPLATE 16    // the pool's unit 0, the template of every unit it copies
// DYN_POOL (KOG_HOPPER_POOL, schedule.pool_rows): the last rows of a long stage (the LM head, a
// split-K gate/up + down stage) are not dealt to the blocks: they form a pool of equal units, and
// after its own items each block's producer grabs units (one atomic on the stage's counter for
// this token) and copies them until the pool is empty, then puts an end marker in the next slot.
// Blocks whose SMs stream faster, or which were luckier this time, take more units, so the stage
// ends when the last unit does, not when the slowest block's fixed share does.
#ifndef DYN_POOL
#define DYN_POOL 0
#endif
// POOL_GRAB_AT: a block asks for its next unit before copying item POOL_GRAB_AT of the current
// one (0: at once, so the atomic's round trip overlaps the unit's copies, but a block may hold a
// unit it has not started when the pool runs dry; >= the unit's items: after its last copy)
#ifndef POOL_GRAB_AT
#define POOL_GRAB_AT 0
#endif
#if DYN_POOL && COPY_LSU
#error "DYN_POOL's end marker completes a slot with one arrival: not with COPY_LSU"
#endif
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

#if DYN_POOL
// One item into ring slot q % NSLOTS once the consumers have released it (lane 0; the header
// beside the data, then the copy; bytes 0: the pool's end marker, completed by a plain arrive).
// False when the request ended while waiting.
__device__ __forceinline__ bool put_slot(u32 q, u64 src, u32 bytes, int4 ih, int4 ig, u64 l2pol) {
    const u32 slot = q % NSLOTS;
    if (q >= NSLOTS)
        while (!mbar_try(&empty_bar[slot], ((q / NSLOTS) - 1) & 1))
            if (atomicAdd(&s_done, 0)) return false;
    slot_hdr[slot][0] = ih;  // released to the consumers by the arrive below
    slot_hdr[slot][1] = ig;
    if (bytes == 0) { mbar_arrive(&full_bar[slot]); return true; }
    mbar_expect_tx(&full_bar[slot], bytes);
    if (STREAM_L2_FIRST) bulk_copy_hint(ring_slot(q), (const void*)src, bytes, &full_bar[slot], l2pol);
    else bulk_copy(ring_slot(q), (const void*)src, bytes, &full_bar[slot]);
    return true;
}
// A pool's marker at entry k of the batch ce (its template entries follow it, in ce and ne): grab
// units and copy them, then the end marker. Each grab's successor is asked for while its unit's
// copies go out (POOL_GRAB_AT), so the atomic's round trip is not paid between units. False: the
// request ended.
__device__ __forceinline__ bool produce_pool(const u32* pool_ctr, int k, const SEntry& ce, const SEntry& ne, u32& q, u64 l2pol) {
    const int ln = threadIdx.x & 31;
    const u32 units = __shfl_sync(0xffffffffu, ce.copy.x, k), per = __shfl_sync(0xffffffffu, ce.copy.y, k);
    const u32 ubytes = __shfl_sync(0xffffffffu, ce.copy.z, k);
    const u32 urows = (u32)__shfl_sync(0xffffffffu, ce.h.y, k);  // rows a unit (h.x, the pool index, picked the counter)
    // lane i < per: template entry i (entries k + 1 + i of this batch and the next)
    const int j = (k + 1 + ln) & 31;
    const bool here = k + 1 + ln < 32;
    // (every lane runs every shuffle: a shuffle inside ?: runs on only the lanes that take it)
    const uint4 c0 = make_uint4(__shfl_sync(0xffffffffu, ce.copy.x, j), __shfl_sync(0xffffffffu, ce.copy.y, j),
                                __shfl_sync(0xffffffffu, ce.copy.z, j), 0u);
    const uint4 c1 = make_uint4(__shfl_sync(0xffffffffu, ne.copy.x, j), __shfl_sync(0xffffffffu, ne.copy.y, j),
                                __shfl_sync(0xffffffffu, ne.copy.z, j), 0u);
    const uint4 tc = here ? c0 : c1;
    const int4 th0 = shfl4(ce.h, j), th1 = shfl4(ne.h, j), tg0 = shfl4(ce.g, j), tg1 = shfl4(ne.g, j);
    const int4 th = here ? th0 : th1, tg = here ? tg0 : tg1;
    u32* ctr = (u32*)pool_ctr;  // this pool's counter for this token iteration
    u32 u = 0;
    if (ln == 0) u = atomicAdd(ctr, 1u);
    u = __shfl_sync(0xffffffffu, u, 0);
    while (u < units) {
        u32 un = 0;
        for (u32 i = 0; i < per; ++i) {
            if (i == POOL_GRAB_AT && ln == 0) un = atomicAdd(ctr, 1u);  // the next unit, asked for now
            const u32 lo = __shfl_sync(0xffffffffu, tc.x, i), hi = __shfl_sync(0xffffffffu, tc.y, i);
            const u32 bytes = __shfl_sync(0xffffffffu, tc.z, i);
            int4 ih = shfl4(th, i);
            const int4 ig = shfl4(tg, i);
            ih.z += (int)(u * urows);  // the unit's rows
            int ok = 1;
            if (ln == 0) ok = put_slot(q, (((u64)hi << 32) | lo) + (u64)u * ubytes, bytes, ih, ig, l2pol);
            if (!__shfl_sync(0xffffffffu, ok, 0)) return false;
            ++q;
        }
        if (POOL_GRAB_AT >= per && ln == 0) un = atomicAdd(ctr, 1u);
        u = __shfl_sync(0xffffffffu, un, 0);
    }
    int ok = 1;
    if (ln == 0) ok = put_slot(q, 0, 0, make_int4(0, 0, 0, 0), make_int4(0, 0, IT_END, 0), l2pol);
    if (!__shfl_sync(0xffffffffu, ok, 0)) return false;
    ++q;
    return true;
}
#endif

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
#if DYN_POOL
    const u32* pool_ctr = (const u32*)c.run[R_POOL];
    const int pool_T = (int)c.run[R_CTX] + POOL_PAD;  // counters a pool: every token iteration, and a ring past the last
#endif
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
#if DYN_POOL
            if (f & SE_TEMPLATE) continue;  // copied unit by unit from the marker before it
            if (f & SE_POOL) {  // counter [pool][token iteration]
                if (!produce_pool(pool_ctr + (i64)__shfl_sync(0xffffffffu, ce.h.x, k) * pool_T + t, k, ce, ne, q, l2pol))
                    goto drain;
                continue;
            }
#endif
            if (ln == 1 && (f & SE_ATT_NEXT)) att_prefetch_l2(c, (int)(f >> 8) + 1, t);
            const u32 lo = __shfl_sync(0xffffffffu, ce.copy.x, k), hi = __shfl_sync(0xffffffffu, ce.copy.y, k);
            const u32 bytes = __shfl_sync(0xffffffffu, ce.copy.z, k);
            const int4 ih = shfl4(ce.h, k), ig = shfl4(ce.g, k);
            const u32 slot = q % NSLOTS;
            if (ln == 0) {
                int done = 0;
#ifdef TRACE
                u64* tr = trace_row_at(c.tbase, c.tit0, t, (int)(f >> 8), (int)c.nst);
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
