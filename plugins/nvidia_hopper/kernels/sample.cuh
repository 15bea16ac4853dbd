// The sample stage: greedy from the LM head's partials (block 0), or temperature / top-k / top-p
// with the reference's Philox draw (every block with SAMPLE_GRID, sample_grid.cuh; else block 0);
// then the stop check (block 0). Part of the decode kernel: decode.cu includes it
// (cuda_util.kernel_source splices it in, in order).
#ifndef SAMPLE_GRID
#define SAMPLE_GRID 0
#endif

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

// ------------------------------------------------------------------------------ sampling
// Order of candidates: z descending, index ascending, encoded in one u64
// comb = key(z) << 32 | ~index, so "prefix up to e" = {i : comb_i >= comb_e}.
__device__ __forceinline__ u32 fkey(float f) {
    u32 u = __float_as_uint(f);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}
__device__ __forceinline__ u64 comb_of(const float* z, int i) {
    return ((u64)fkey(z[i]) << 32) | (u64)(0xffffffffu - (u32)i);
}

// Block 0's sampler, when SAMPLE_GRID (sample_grid.cuh, the default) cannot hold the vocabulary
// in the grid's registers: top-k, top-p and the draw by a radix select over the candidate key,
// 8 passes of 8 bits; once the prefix leaves at most SAMPLE_CAP candidates, they are listed in
// shared memory and only those are read. (Before session 10: binary searches of 64 passes each over
// the vocabulary's z and p, 118 tok/s on bench-2b; this select, 217; the grid's: docs/benchmarks.md.)
// Masses are summed in fixed point (p 2^40, exact for p >= 2^-40: a power-of-two scale): integer
// sums are the same in any order, so seeded runs stay deterministic with atomics; targets are the
// float32 products of the CPU definition (kog_core/sampling.py), converted to the same fixed point.
// The algorithm is checked against a full sort on the CPU (tests/test_hopper_sampling_radix.py,
// an emulation).
// SAMPLE_CAP (schedule.CONSTS): candidates the radix select lists in the stage's shared scratch
__device__ __forceinline__ u64 fixed_mass(float p) { return (u64)(p * 1099511627776.0f); }  // p 2^40, truncated
__device__ __forceinline__ float mass_f32(u64 m) { return __ull2float_rn(m) * (1.0f / 1099511627776.0f); }
__device__ __forceinline__ u32 match_any(int v) {
    u32 r;
    asm volatile("match.any.sync.b32 %0, %1, 0xffffffff;" : "=r"(r) : "r"(v));
    return r;
}
// 256 bins in shared memory, every field a 32-bit word: shared-memory atomics are native only on 32
// bits (a 64-bit add or max compiles to a compare-and-swap loop, ATOMS.CAST.SPIN.64). A bin's
// 64-bit mass is two words, the low word's carry added into the high word (exact in any order).
struct Bins { u32 mlo[256], mhi[256], cnt[256]; };
__device__ __forceinline__ u64 bin_mass(const Bins* h, int b) { return (u64)h->mlo[b] | ((u64)h->mhi[b] << 32); }
__device__ __forceinline__ void bins_zero(Bins* h, u32* kx) {
    for (int b = threadIdx.x; b < 256; b += NT) {
        h->mlo[b] = 0; h->mhi[b] = 0; h->cnt[b] = 0;
        if (kx) { kx[b] = 0; kx[256 + b] = 0; }
    }
}
// Warp-wide sums over all 32 lanes (an immediate full mask: one REDUX each; redux.sync with a mask
// that differs between lanes, such as match.any's groups, compiles to a WARPSYNC.COLLECTIVE loop
// over the distinct masks, which made each of the grid sampler's histograms ~4.6 us: session 11)
__device__ __forceinline__ u32 warp_add_u32(u32 v) {
    u32 r;
    asm volatile("redux.sync.add.u32 %0, %1, 0xffffffff;" : "=r"(r) : "r"(v));
    return r;
}
__device__ __forceinline__ u32 warp_xor_u32(u32 v) {
    u32 r;
    asm volatile("redux.sync.xor.b32 %0, %1, 0xffffffff;" : "=r"(r) : "r"(v));
    return r;
}
// One lane's atomics into bin b: mass s (the low word's carry into the high word), count n, keys' XOR.
__device__ __forceinline__ void bin_add(Bins* h, int b, u64 s, u32 n, u32* kx, u64 kxv) {
    const u32 old = atomicAdd(&h->mlo[b], (u32)s);
    const u32 carry_hi = (u32)(s >> 32) + ((u32)(old + (u32)s) < old ? 1u : 0u);
    if (carry_hi) atomicAdd(&h->mhi[b], carry_hi);
    atomicAdd(&h->cnt[b], n);
    if (kx) { atomicXor(&kx[b], (u32)kxv); atomicXor(&kx[256 + b], (u32)(kxv >> 32)); }
}
// Adds v to bin b (b < 0: nothing). When the warp's candidates fall in a few bins (a flat
// distribution's first pass puts nearly all of them in two or three), each bin's sums are taken
// over the warp first and one lane adds them, instead of 32 atomics on one address; spread over
// more bins, every lane adds its own (few collisions). With kx ([2][256], SAMPLE_GRID), the XOR of
// the bin's keys too, word by word: the key of the bin's candidate when it holds one, the only case
// the grid sampler reads it. Every lane must call.
#define HIST_FEW_BINS 4
__device__ __forceinline__ void hist_add(Bins* h, int b, u64 v, u32* kx = nullptr, u64 key = 0) {
    const int lane = threadIdx.x & 31;
    const u32 same = match_any(b);
    const u32 leaders = __ballot_sync(0xffffffffu, b >= 0 && lane == __ffs(same) - 1);
    if (__popc(leaders) > HIST_FEW_BINS) {
        if (b >= 0) bin_add(h, b, v, 1u, kx, key);
        return;
    }
    for (u32 todo = leaders; todo; todo &= todo - 1) {  // warp-uniform: one bin at a time
        const int l = __ffs(todo) - 1;
        const bool mine = b == __shfl_sync(0xffffffffu, b, l);
        // v < 2^41: three 20-bit parts, each summed over <= 32 lanes within 32 bits
        const u32 s0 = warp_add_u32(mine ? (u32)(v & 0xfffffu) : 0u);
        const u32 s1 = warp_add_u32(mine ? (u32)((v >> 20) & 0xfffffu) : 0u);
        const u32 s2 = warp_add_u32(mine ? (u32)(v >> 40) : 0u);
        u64 kxv = 0;
        if (kx) kxv = (u64)warp_xor_u32(mine ? (u32)key : 0u) | ((u64)warp_xor_u32(mine ? (u32)(key >> 32) : 0u) << 32);
        if (lane == l) bin_add(h, b, (u64)s0 + ((u64)s1 << 20) + ((u64)s2 << 40), (u32)__popc(same), kx, kxv);
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
    Bins* hist = (Bins*)smem_f();   // the next byte's bins: counts or fixed-point masses, candidates
    u64* sel = (u64*)(hist + 1);    // prefix, mass or count above it, candidates under it, list size
    u32* list = (u32*)(sel + 4);    // [SAMPLE_CAP] the candidates under the prefix, once that few
    const int tid = threadIdx.x;
    u64 prefix = 0, above = 0;
    int nlist = -1;  // -1: passes read the whole vocabulary
    for (int pass = 0; pass < 8; ++pass) {
        const int shift = 56 - 8 * pass;
        bins_zero(hist, nullptr);
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
            hist_add(hist, b, v);
        }
        csync();
        if (tid == 0) {
            u64 acc = above, acc_last = above;
            int chosen = -1, lastnz = -1;
            for (int b = 255; b >= 0; --b) {
                if (hist->cnt[b] == 0) continue;
                const u64 nx = acc + bin_mass(hist, b);
                lastnz = b;
                acc_last = acc;
                if (kind == 2 ? nx > target : nx >= target) { chosen = b; break; }
                acc = nx;
            }
            if (chosen < 0) { chosen = lastnz; acc = acc_last; }  // never reached: the lowest candidate
            sel[0] = (prefix << 8) | (u64)chosen;
            sel[1] = acc;
            sel[2] = hist->cnt[chosen];
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

#if SAMPLE_GRID
__device__ __noinline__ u64 sample_grid(Ctx& c, float temp, int n);  // sample_grid.cuh
#endif

// SAMPLE_TAIL (session 23, an experiment; KOG_HOPPER_DEFINES=SAMPLE_TAIL=1): the stop check's inputs
// loaded before the sampling, and the host's token and count written after the next token's inputs
// with one release store instead of two __threadfence_system() (MEMBAR.SC.SYS). The trace puts
// block 0's stop check at ~4.4 us a token after the other blocks' end of the sample stage.
#ifndef SAMPLE_TAIL
#define SAMPLE_TAIL 0
#endif
__device__ __noinline__ void run_sample(Ctx& c) {
    const i64* st = s_desc[c.dcur];
    i64* run = c.run;
    const int tid = threadIdx.x;
    __shared__ int s_tok;
    const float temp = __int_as_float((int)run[R_TEMP]);
#if SAMPLE_GRID  // sampled decoding: every block takes part
    u64 ce_grid = 0;
    if (!c.logits_mode && c.it >= c.P - 1 && temp > 0.f) ce_grid = sample_grid(c, temp, c.it - (c.P - 1));
#endif
    if (blockIdx.x != 0) return;
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
    u32 cancel = 0;
    if (tid == 0 && run[R_CANCEL]) cancel = ld_sys((const volatile u32*)run[R_CANCEL]);
#if SAMPLE_TAIL
    // the stop check's inputs, loaded by warp 0 now so that their round trips overlap the sampling
    // (read after it, they were two round trips in a row on every token's critical path)
    int stop_hit = 0;  // warp 0: one stop id a lane, up to 32 ids; more are checked below
    const int nstop = tid < 32 ? (int)run[R_NSTOP] : 0;
    const int* stops = (const int*)run[R_STOPIDS];
    const int stop_id = tid < nstop && tid < 32 ? stops[tid] : -1;
    const int maxnew = (int)run[R_MAXNEW], ctx = (int)run[R_CTX];
#endif
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
#if SAMPLE_GRID
        const u64 ce = ce_grid;
#else
        float* z = (float*)run[R_SCRATCH];
        float* p = z + V;
        float zm = -__int_as_float(0x7f800000);
        for (int i = tid; i < V; i += NT) { float v = __fdiv_rn(ldf(logits + i), temp); z[i] = v; zm = fmaxf(zm, v); }
        zm = block_max(zm);
        for (int i = tid; i < V; i += NT) p[i] = expf(z[i] - zm);
        csync();
        const int topk = (int)run[R_TOPK];
        const float topp = __int_as_float((int)run[R_TOPP]);
        const u32 w = philox_w0((u64)run[R_SEED], (u32)n);
        const float u = (float)(w >> 8) * (1.0f / 16777216.0f);
        u64 cmin = 0;
        if (topk > 0 && topk < V) cmin = radix_select(z, p, V, 0, (u64)topk, 0);
        u64 ckeep = cmin;
        if (topp < 1.0f) {
            const u64 total = mass_fixed(z, p, V, cmin);
            const u64 cp = radix_select(z, p, V, 1, fixed_mass(__fmul_rn(topp, mass_f32(total))), cmin);
            ckeep = cp > cmin ? cp : cmin;
        }
        const u64 kept = mass_fixed(z, p, V, ckeep);
        const u64 ce = radix_select(z, p, V, 2, fixed_mass(__fmul_rn(u, mass_f32(kept))), ckeep);
#endif
        // ce is the comb of the chosen element (or ckeep: the last kept one)
        if (tid == 0) s_tok = (int)(0xffffffffu - (u32)(ce & 0xffffffffu));
        csync();
    }
#if SAMPLE_TAIL
    if (tid < 32) {
        const int tok = s_tok;
        int hit = stop_id == tok;
        for (int j = 32 + tid; j < nstop; j += 32) hit |= stops[j] == tok;
        stop_hit = __any_sync(0xffffffffu, hit);
    }
    if (tid == 0) {
        const int tok = s_tok;
        int stop = stop_hit;
        if (n + 1 >= maxnew) stop = 1;
        if (c.pos + 1 >= ctx) stop = 1;
        if (cancel) stop = 2;
        run[R_TOK] = tok;  // what the next token needs, before the host's writes
        run[R_STOP] = stop;
        if (stop != 2) {
            ((volatile int*)run[R_HOST_OUT])[n] = tok;
            // a release: the token before its count (one fence, not a sequentially consistent one
            // before and after: the host polls the count and needs only that order)
            asm volatile("st.release.sys.global.u32 [%0], %1;" :: "l"(run[R_HOST_COUNT]), "r"((u32)(n + 1)) : "memory");
        }
    }
#else
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
#endif
    csync();
}
