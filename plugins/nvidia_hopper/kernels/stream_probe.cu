// Weight-stream probes: how fast can one block per SM stream a contiguous share of a large buffer
// (no model, no dependencies), and what does a consumer pause cost? The decode kernel's "weights
// only" breakdown reaches ~2.8 TB/s on bench-2b while the LM head alone streams at ~4.0; these
// kernels separate the stream machinery from everything else (stream_probe.py runs them).
//
// probe_ring: the decode kernel's scheme. The last warp is the producer: lane 0 fills a ring of
// `nslots` shared-memory slots of `slot_bytes` with cp.async.bulk (each slot's copy cut into
// `chunks` bulk copies on one mbarrier); the other warps consume every slot and release it
// (one arrive per thread, as the decode kernel). consume = 0: release at once; 1: a dot product of the
// slot's bf16 values with an f32 vector in shared memory (matvec.cuh's inner loop). Every
// `pause_every` items the consumers stop together for `pause_ns` (a stage boundary's cost);
// pause_skew staggers the blocks' pauses (block b pauses b * pause_skew items earlier);
// prefetch > 0: with each copy the producer asks L2 for the item `prefetch` places after it
// (cp.async.bulk.prefetch.L2), or with pf_warp a last warp does so with 128-byte prefetch.global.L2.
//
// trace (block 0, first ntrace items): per item the producer's issue time and the consumers' wait
// start and end (globaltimer ns), so a pause's effect on the copies can be seen item by item.
//
// ldgsts: that many more warps copy the last lsu_bytes of each slot with 16-byte cp.async (LDGSTS),
// completion through cp.async.mbarrier.arrive.noinc; the bulk copy takes the rest (lsu_bytes =
// slot_bytes: none). Do the two paths' per-SM ceilings add up?
//
// lat_warp: one more warp whose lane 0, while the ring streams, times chains of 8 dependent loads
// through `chase` (a small L2-resident table: a stage boundary's poll, input or residual load is
// such a load), kind 0 ld.global.cg, 1 ld.acquire.gpu, 2 fence.acq_rel.gpu + ld.global.cg; sums
// (ns, loads, worst chain) go to lat_out. probe_lat: the same chains with nothing else running.
// Kind 3 times instruction fetch instead: a 16 KB block of straight-line code (code_timed) run
// cold (after `evict` other code: 0 none, 1 a different 16 KB block, 2 a 128 KB one; 3-5: 32,
// 64, 96 KB) and at once
// again (hot); lat_out gets (cold ns, runs, worst cold, hot ns). Does code that has not run for a
// while (the attention's, once a layer) cost microseconds to fetch while the rings stream?
//
// probe_ldg: no ring; every thread streams 16-byte ld.global.nc loads, `UNROLL` in flight.
typedef unsigned int u32;
typedef unsigned long long u64;
#include "ring.cuh"  // the decode kernel's ring primitives

#define MAX_SLOTS 16
#define XLEN 1024  // floats of the dot product's vector (reused across the slot)

extern __shared__ __align__(128) unsigned char probe_smem[];
__shared__ u64 full_bar[MAX_SLOTS], empty_bar[MAX_SLOTS];
__shared__ float4 xvec[XLEN / 4];
__shared__ u32 s_issued;  // the producer's last issued item (read by the prefetch warp)
__shared__ u32 s_cdone;   // the consumers are done (read by the latency warp)

// One dependent chain of 8 loads through `chase` from index i; returns the last index.
__device__ __forceinline__ u32 chase8(const u32* chase, u32 i, int kind) {
#pragma unroll
    for (int k = 0; k < 8; ++k) {
        if (kind == 1) asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(i) : "l"(chase + i) : "memory");
        else {
            if (kind == 2) asm volatile("fence.acq_rel.gpu;" ::: "memory");
            asm volatile("ld.global.cg.u32 %0, [%1];" : "=r"(i) : "l"(chase + i) : "memory");
        }
    }
    return i;
}
__device__ __forceinline__ void lat_record(u64* lat_out, u64 sum, u64 n, u64 worst) {
    atomicAdd(lat_out, sum);
    atomicAdd(lat_out + 1, n);
    atomicMax(lat_out + 2, worst);
}

// Straight-line code: N x 4 independent FMAs (16 bytes an instruction); SALT keeps blocks distinct.
template <int N, int SALT>
__device__ __noinline__ float code_block(float x) {
    float a = x, b = x + 1.f, c = x + 2.f, d = x + 3.f;
#pragma unroll
    for (int i = 0; i < N; ++i) {
        a = fmaf(a, 1.0001f + SALT * 1e-6f, 0.5f); b = fmaf(b, 0.9999f, 0.25f);
        c = fmaf(c, 1.0002f, 0.125f); d = fmaf(d, 0.9998f, 0.0625f + SALT * 1e-6f);
    }
    return a + b + c + d;
}
__device__ __forceinline__ float code_timed(float x) { return code_block<256, 1>(x); }  // 16 KB
__device__ __forceinline__ float code_evict(float x, int evict) {
    if (evict == 1) return code_block<256, 2>(x);    // 16 KB
    if (evict == 2) return code_block<2048, 3>(x);   // 128 KB
    if (evict == 3) return code_block<512, 4>(x);    // 32 KB (round 11: the instruction caches' sizes)
    if (evict == 4) return code_block<1024, 5>(x);   // 64 KB
    if (evict == 5) return code_block<1536, 6>(x);   // 96 KB
    return x;
}
// The clock, read after x is computed and before it is used again: x passes through the asm, so the
// compiler cannot move a call that makes or uses x across the read (a plain volatile read of the
// clock does not order a call to a pure function: round 9's first run timed nothing as "cold").
__device__ __forceinline__ u64 gtimer_at(float& x) {
    u64 t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t), "+f"(x));
    return t;
}
// One cold and one hot run of code_timed: adds (cold ns, 1, -, hot ns) to the sums.
__device__ __forceinline__ float code_round(float x, int evict, u64& cold, u64& worst, u64& hot) {
    x = code_evict(x, evict);
    const u64 t0 = gtimer_at(x);
    x = code_timed(x);
    const u64 t1 = gtimer_at(x);
    x = code_timed(x);
    const u64 t2 = gtimer_at(x);
    cold += t1 - t0; hot += t2 - t1; worst = t1 - t0 > worst ? t1 - t0 : worst;
    return x;
}

__device__ __forceinline__ void consumers_sync(int n) { asm volatile("bar.sync 1, %0;" :: "r"(n) : "memory"); }

// Mixed item sizes (short_every > 0): every short_every-th item is short_bytes long, the others
// item_bytes, packed one after another in the source as the decode kernel packs a stage's items
// (its K = 2048 stages cycle 30 / 30 / 20 KB items through 31 KB slots). Otherwise every item fills
// a slot, one slot's stride apart. Producer and consumers walk the cycle with a running position
// (round 14): round 13's per-item 64-bit divisions (q / short_every, q % short_every) were extra
// work on both sides of the ring that the full-item rows did not have.
__device__ __forceinline__ u32 mixed_len(u32 k, u32 item_bytes, u32 short_every, u32 short_bytes) {
    return k == short_every - 1 ? short_bytes : item_bytes;
}
__device__ __forceinline__ u32 mixed_next(u32 k, u32 short_every) { return k + 1 == short_every ? 0 : k + 1; }

extern "C" __global__ void __launch_bounds__(1024, 1)
probe_ring(const unsigned char* __restrict__ src, u64 per_block, u32 nslots, u32 slot_bytes, u32 chunks,
           int consume, u32 pause_every, u32 pause_ns, u32 pause_skew, u32 prefetch, int pf_warp, int ldgsts, u32 lsu_bytes, u32 extra_bytes, float* out, u64* trace, u32 ntrace,
           int lat_warp, int lat_kind, const u32* chase, u64* lat_out, u32 wrap_items, int evict, int l2_first,
           u32 item_bytes, u32 short_every, u32 short_bytes, u64 block_stride) {
    // consumers, then the bulk producer warp, then `ldgsts` cp.async warps, then the prefetch warp, then the latency warp
    const int nc = blockDim.x - 32 - 32 * ldgsts - 32 * pf_warp - 32 * lat_warp;
    const int tid = threadIdx.x;
    // (mixed sizes: the host makes per_block a whole number of cycles; no extra loads, one chunk)
    const u64 nitems = short_every ? per_block / ((u64)(short_every - 1) * item_bytes + short_bytes) * short_every
                                   : per_block / (slot_bytes + extra_bytes);
    // extra_bytes: with each item the consumers also load that many bytes into registers (plain
    // 16-byte loads) from the rest of the block's share: do the ring's and the loads' ceilings add?
    const uint4* extra = (const uint4*)(src + (u64)blockIdx.x * per_block + nitems * slot_bytes);
    // wrap_items > 0: item q reads the block's item q % wrap_items, so a small share stays in L2
    // block_stride > 0 (round 15): block b's share starts b * block_stride bytes in (otherwise right after b - 1's)
    const unsigned char* base = src + (u64)blockIdx.x * (wrap_items ? (u64)wrap_items * slot_bytes
                                                                    : block_stride ? block_stride : per_block);
    if (tid == 0) {
        s_issued = 0;
        s_cdone = 0;
        for (u32 i = 0; i < nslots; ++i) { mbar_init(&full_bar[i], 1 + 32 * ldgsts); mbar_init(&empty_bar[i], nc); }
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    for (int i = tid; i < XLEN / 4; i += blockDim.x) xvec[i] = make_float4(1.f, 0.5f, 0.25f, 0.125f);
    __syncthreads();
    if (lat_warp && tid >= nc + 32 + 32 * ldgsts + 32 * pf_warp) {  // latency warp: lane 0 times load chains
        if ((tid & 31) != 0) return;
        if (lat_kind == 3) {  // instruction fetch: cold and hot runs of a code block
            u64 cold = 0, n = 0, worst = 0, hot = 0;
            float x = (float)blockIdx.x;
            while (!*(volatile u32*)&s_cdone) {
                x = code_round(x, evict, cold, worst, hot);
                ++n;
                __nanosleep(2000);
            }
            lat_record(lat_out, cold, n, worst);
            atomicAdd(lat_out + 3, hot);
            if (x == 1.2345f) out[0] = x;
            return;
        }
        u32 i = (blockIdx.x * 37u) & 1023u;
        u64 sum = 0, n = 0, worst = 0;
        while (!*(volatile u32*)&s_cdone) {
            const u64 t0 = gtimer();
            i = chase8(chase, i, lat_kind);
            const u64 dt = gtimer() - t0;
            sum += dt; n += 8; worst = dt > worst ? dt : worst;
            __nanosleep(500);
        }
        lat_record(lat_out, sum, n, worst);
        if (i == 0xffffffffu) out[0] = 0.f;
        return;
    }
    if (pf_warp && tid >= nc + 32 + 32 * ldgsts) {  // prefetch warp: 128-byte L2 prefetches (LSU, not the copy engine)
        const int ln = tid & 31;
        for (u64 q = prefetch; q < nitems; ++q) {  // item q once the producer has issued item q - prefetch
            while ((u64)*(volatile u32*)&s_issued + prefetch < q + 1) { }
            const unsigned char* p = base + q * slot_bytes;
            for (u32 o = ln * 128; o < slot_bytes; o += 32 * 128) asm volatile("prefetch.global.L2 [%0];" :: "l"(p + o));
        }
        return;
    }
    if (tid >= nc + 32) {  // cp.async warps: the last lsu_bytes of every slot, 16 bytes a lane (LSU path)
        const int ln = tid - nc - 32;  // 0 .. 32 * ldgsts - 1
        const u32 first = slot_bytes - lsu_bytes;
        for (u64 q = 0; q < nitems; ++q) {
            const u32 s = (u32)(q % nslots);
            if (q >= nslots) mbar_wait(&empty_bar[s], (u32)((q / nslots - 1) & 1));
            const unsigned char* g = base + q * slot_bytes;
            unsigned char* d = probe_smem + (u64)s * slot_bytes;
            for (u32 o = first + ln * 16; o < slot_bytes; o += 32 * ldgsts * 16) cp_async16(d + o, g + o);
            cp_async_arrive_noinc(&full_bar[s]);
        }
        cp_wait_all();
        return;
    }
    if (tid >= nc) {  // producer warp
        if (tid != nc) return;
        const u32 cb = (slot_bytes - lsu_bytes) / chunks;
        const u64 pol = l2_evict_first_policy();  // l2_first: the copies' lines are evicted first
        u64 poff = 0;  // mixed sizes: this item's source offset and its place in the cycle
        u32 pk = 0;
        for (u64 q = 0; q < nitems; ++q) {
            const u32 s = (u32)(q % nslots);
            if (q >= nslots) mbar_wait(&empty_bar[s], (u32)((q / nslots - 1) & 1));
            if (trace && blockIdx.x == 0 && q < ntrace) trace[3 * q] = gtimer();
            if (pf_warp) *(volatile u32*)&s_issued = (u32)q;
            else if (prefetch && q + prefetch < nitems)  // ask L2 for an item beyond the ring: HBM keeps streaming through a pause
                prefetch_l2(base + (q + prefetch) * slot_bytes, slot_bytes);
            if (lsu_bytes >= slot_bytes) { mbar_arrive(&full_bar[s]); continue; }
            if (short_every) {  // one copy of this item's length
                const u32 len = mixed_len(pk, item_bytes, short_every, short_bytes);
                mbar_expect_tx(&full_bar[s], len);
                unsigned char* d = probe_smem + (u64)s * slot_bytes;
                const unsigned char* g = base + poff;
                if (l2_first) bulk_copy_hint(d, g, len, &full_bar[s], pol);
                else bulk_copy(d, g, len, &full_bar[s]);
                poff += len;
                pk = mixed_next(pk, short_every);
                continue;
            }
            mbar_expect_tx(&full_bar[s], slot_bytes - lsu_bytes);
            for (u32 k = 0; k < chunks; ++k) {
                unsigned char* d = probe_smem + (u64)s * slot_bytes + k * cb;
                const unsigned char* g = base + (wrap_items ? q % wrap_items : q) * slot_bytes + k * cb;
                if (l2_first) bulk_copy_hint(d, g, cb, &full_bar[s], pol);
                else bulk_copy(d, g, cb, &full_bar[s]);
            }
        }
        for (u64 q = nitems > nslots ? nitems - nslots : 0; q < nitems; ++q)  // none may be in flight at exit
            mbar_wait(&full_bar[q % nslots], (u32)((q / nslots) & 1));
        return;
    }
    float acc = 0.f;
    u32 ck = 0;  // mixed sizes: this item's place in the cycle
    for (u64 q = 0; q < nitems; ++q) {
        const int n16 = (short_every ? mixed_len(ck, item_bytes, short_every, short_bytes) : slot_bytes) / 16;
        if (short_every) ck = mixed_next(ck, short_every);
        const u32 s = (u32)(q % nslots);
        const bool tr = trace && blockIdx.x == 0 && tid == 0 && q < ntrace;
        if (tr) trace[3 * q + 1] = gtimer();
        mbar_wait(&full_bar[s], (u32)((q / nslots) & 1));
        if (tr) trace[3 * q + 2] = gtimer();
        if (consume) {
            const uint4* w = (const uint4*)(probe_smem + (u64)s * slot_bytes);
#pragma unroll 4
            for (int i = tid; i < n16; i += nc) {
                const int xi = (2 * i) & (XLEN / 4 - 1);
                acc = dot8s(w[i], xvec[xi], xvec[xi + 1], acc);
            }
        }
        mbar_arrive(&empty_bar[s]);
        if (extra_bytes) {
            const uint4* e = extra + q * (extra_bytes / 16);
            const int ne = extra_bytes / 16;
            uint4 v[8];
#pragma unroll
            for (int u = 0; u < 8; ++u) {
                const int i = tid + u * nc;
                if (i < ne) asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
                                         : "=r"(v[u].x), "=r"(v[u].y), "=r"(v[u].z), "=r"(v[u].w) : "l"(e + i));
                else v[u] = make_uint4(0, 0, 0, 0);
            }
#pragma unroll
            for (int u = 0; u < 8; ++u) acc += __uint_as_float(v[u].x ^ v[u].w);
        }
        if (pause_every && (q + 1 + blockIdx.x * pause_skew) % pause_every == 0) {
            consumers_sync(nc);
            if (tid == 0) { const u64 t0 = gtimer(); while (gtimer() - t0 < pause_ns) { } }
            consumers_sync(nc);
        }
    }
    if (tid == 0) *(volatile u32*)&s_cdone = 1;
    if (acc == 1.2345f) out[blockIdx.x] = acc;  // keeps the dot products alive
}

// The load chains of the latency warp with nothing else running (one thread per block).
extern "C" __global__ void probe_lat(const u32* chase, int lat_kind, u32 chains, u64* lat_out, int evict) {
    if (threadIdx.x != 0) return;
    if (lat_kind == 3) {  // the code block's cold and hot runs with nothing else running
        u64 cold = 0, worst = 0, hot = 0;
        float x = (float)blockIdx.x;
        for (u32 c = 0; c < chains; ++c) { x = code_round(x, evict, cold, worst, hot); __nanosleep(500); }
        lat_record(lat_out, cold, (u64)chains + (x == 1.2345f), worst);
        atomicAdd(lat_out + 3, hot);
        return;
    }
    u32 i = (blockIdx.x * 37u) & 1023u;
    u64 sum = 0, worst = 0;
    for (u32 c = 0; c < chains; ++c) {
        const u64 t0 = gtimer();
        i = chase8(chase, i, lat_kind);
        const u64 dt = gtimer() - t0;
        sum += dt; worst = dt > worst ? dt : worst;
        __nanosleep(500);
    }
    lat_record(lat_out, sum, (u64)chains * 8 + (i == 0xffffffffu), worst);
}

#ifndef UNROLL
#define UNROLL 8
#endif
extern "C" __global__ void __launch_bounds__(1024, 1)
probe_ldg(const uint4* __restrict__ src, u64 per_block, float* out) {
    const u64 n16 = per_block / 16;
    const uint4* base = src + (u64)blockIdx.x * n16;
    const u32 stride = blockDim.x;
    float acc = 0.f;
    for (u64 i0 = threadIdx.x; i0 < n16; i0 += (u64)UNROLL * stride) {
        uint4 v[UNROLL];
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            const u64 i = i0 + (u64)u * stride;
            if (i < n16) asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
                                      : "=r"(v[u].x), "=r"(v[u].y), "=r"(v[u].z), "=r"(v[u].w) : "l"(base + i));
            else v[u] = make_uint4(0, 0, 0, 0);
        }
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) acc += __uint_as_float(v[u].x ^ v[u].y ^ v[u].z ^ v[u].w);
    }
    if (acc == 1.2345f) out[blockIdx.x] = acc;
}
