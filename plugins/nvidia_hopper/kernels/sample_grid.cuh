// SAMPLE_GRID (the default for sampled decoding when the vocabulary fits; backend.py): temperature,
// top-k, top-p and the draw on every block, not on block 0 alone. Part of the decode kernel:
// decode.cu includes it after sample.cuh (cuda_util.kernel_source splices it in, in order).
//
// Why: block 0 alone reads the vocabulary's z and p once per select pass; at 128k tokens that is
// ~1 MB from L2 at one SM's rate per pass, and sampled decoding ran at 118 tok/s (radix select:
// 217) against greedy's 720 (session 10, call 1). Here each block keeps its slice of the
// vocabulary (SAMPLE_EPT candidates per thread) in registers for the whole token, and each pass
// of the radix select (sample.cuh, the same definitions) is one grid-wide round:
//   1. the block's candidates go into 256-bin shared histograms (mass, count, largest key);
//   2. its non-empty bins are added into this round's global bins (atomics at L2);
//   3. it counts its arrival (release) and waits for every block's (acquire);
//   4. the block reads the 256 global bins, and warp 0 chooses; every block chooses the same bin, since the
//      sums are integers (the same in any order): nothing is broadcast.
// A select ends as soon as its chosen bin holds one candidate (that bin's largest key is the
// candidate's key), usually after 3-4 passes instead of 8. A top-p or draw select's target comes
// from its first pass: the sum of all bins is the mass of the candidates above the floor.
// Rounds are counted over the launch (one arrival counter, never reset); each token's rounds use
// one of two sets of global bins by its parity, and the blocks zero the other set's used rounds
// (the token before last: nobody reads them any more, and the stage counters order these stores
// before the next token's atomics). The host zeroes both sets and the counter at each launch.
#if SAMPLE_GRID
// SG_ROUNDS (schedule.CONSTS, which also sizes the global bins): rounds a token at most
struct SgRound { u64 mass[256]; u64 kmax[256]; u32 cnt[256]; };  // 5 KB of global bins
__shared__ u32 s_sg_round;  // rounds run in this launch (every block runs the same ones)
__shared__ u32 s_sg_used;   // rounds the previous sampled token ran

// Trace build (context.cuh; thread 0 of each block, the sample stage's row): 20 keys ready, 21 rounds
// run, 22-26 the rounds' summed ns in their histograms, global atomics, arrival (release + poll),
// bins read and choice. Fields 10-19 and 28 stay 0: trace.py reads those as other stages' steps.
#ifdef TRACE
#define SG_STAMP(i) do { if (c.tr && tid == 0) { const u64 t_ = gtimer(); if ((i) >= 0) tsum[i] += t_ - tprev; tprev = t_; } } while (0)
#else
#define SG_STAMP(i) do { } while (0)
#endif

// The key (comb_of order) of the sampled token. All consumer threads of every block call it.
__device__ __noinline__ u64 sample_grid(Ctx& c, float temp, int n) {
    const i64* st = s_desc[c.dcur];
    const i64* run = c.run;
    const int tid = threadIdx.x, lane = tid & 31;
    const u32 nb = gridDim.x;
    const int V = (int)st[SM_V];
    u32* arrivals = (u32*)run[R_SAMPLE_SYNC];
    SgRound* sets = (SgRound*)(arrivals + 32);  // the counter has its own 128-byte line
    SgRound* set = sets + (n & 1) * SG_ROUNDS;
    const u32 round0 = s_sg_round;
    {   // zero the rounds the token before last ran (this block's share)
        u64* other = (u64*)(sets + ((n + 1) & 1) * SG_ROUNDS);
        const u32 words = s_sg_used * (u32)(sizeof(SgRound) / 8);
        const u32 w1 = (u32)((u64)(blockIdx.x + 1) * words / nb);
        for (u32 w = (u32)((u64)blockIdx.x * words / nb) + tid; w < w1; w += NT) other[w] = 0;
    }
    // this block's slice of the vocabulary: key and fixed-point mass of each candidate (key 0: none;
    // a real key is never 0, fkey is 0 only for one NaN pattern). z's maximum from the LM head's
    // per-block maxima: z = logit / temp is monotone in the logit.
    const float* lmax = (const float*)st[SM_ARGMAX];
    float mx = -__int_as_float(0x7f800000);
    for (int j = tid; j < (int)st[SM_NPART]; j += NT) mx = fmaxf(mx, ldf(lmax + j));
    const float zm = __fdiv_rn(block_max(mx), temp);
    const float* logits = (const float*)st[SM_LOGITS];
    const int lo = (int)((i64)blockIdx.x * V / nb), hi = (int)((i64)(blockIdx.x + 1) * V / nb);
    float lg[SAMPLE_EPT];
#pragma unroll
    for (int k = 0; k < SAMPLE_EPT; ++k) lg[k] = lo + tid + k * NT < hi ? ldf(logits + lo + tid + k * NT) : 0.f;
    u64 key[SAMPLE_EPT], mass[SAMPLE_EPT];
#pragma unroll
    for (int k = 0; k < SAMPLE_EPT; ++k) {
        const int i = lo + tid + k * NT;
        const float z = __fdiv_rn(lg[k], temp);
        key[k] = i < hi ? ((u64)fkey(z) << 32) | (u64)(0xffffffffu - (u32)i) : 0ull;
        mass[k] = i < hi ? fixed_mass(expf(z - zm)) : 0ull;
    }
    TMARK(c, 20);
#ifdef TRACE
    u64 tsum[5] = {0, 0, 0, 0, 0}, tprev = 0;
#endif
    const int topk = (int)run[R_TOPK];
    const float topp = __int_as_float((int)run[R_TOPP]);
    const float u = (float)(philox_w0((u64)run[R_SEED], (u32)n) >> 8) * (1.0f / 16777216.0f);
    u64* hmass = (u64*)smem_f();   // [256] this block's bins
    u64* hkmax = hmass + 256;      // [256]
    u32* hcnt = (u32*)(hkmax + 256);  // [256]
    u64* res = (u64*)(hcnt + 256);    // the choice: prefix, mass above, count, key, target
    u64 floor = 0;  // candidates: key >= floor; each select's result is the next one's floor
    u32 r = 0;      // rounds this token
    for (int kind = 0; kind < 3; ++kind) {  // 0: top-k (counts), 1: top-p (masses), 2: the draw
        if (kind == 0 && !(topk > 0 && topk < V)) continue;
        if (kind == 1 && !(topp < 1.0f)) continue;
        u64 prefix = 0, above = 0, target = (u64)topk;
        for (int pass = 0; pass < 8; ++pass, ++r) {
            const int shift = 56 - 8 * pass;
            SG_STAMP(-1);
            for (int b = tid; b < 256; b += NT) { hmass[b] = 0; hkmax[b] = 0; hcnt[b] = 0; }
            csync();
#pragma unroll
            for (int k = 0; k < SAMPLE_EPT; ++k) {
                const u64 cb = key[k];
                const bool in = cb != 0 && cb >= floor && (pass == 0 || (cb >> (shift + 8)) == prefix);
                hist_add(hmass, hcnt, in ? (int)(cb >> shift) & 255 : -1, kind == 0 ? 1ull : mass[k], hkmax, cb);
            }
            csync();
            SG_STAMP(0);
            SgRound* R = set + r;
            for (int b = tid; b < 256; b += NT) {
                if (!hcnt[b]) continue;
                atomicAdd((unsigned long long*)&R->mass[b], (unsigned long long)hmass[b]);
                atomicAdd(&R->cnt[b], hcnt[b]);
                atomicMax((unsigned long long*)&R->kmax[b], (unsigned long long)hkmax[b]);
            }
            csync();  // the block's atomics before thread 0's release (as the stage counters)
            SG_STAMP(1);
            if (tid == 0) {
                red_release(arrivals, 1u);
                const u32 all = nb * (round0 + r + 1);
                spin_acquire(arrivals, all);
            }
            csync();
            SG_STAMP(2);
            for (int b = tid; b < 256; b += NT) {  // the grid's bins replace the block's
                hcnt[b] = ldu32(&R->cnt[b]);
                hmass[b] = kind == 0 ? (u64)hcnt[b] : (u64)ldi64((const i64*)&R->mass[b]);
                hkmax[b] = (u64)ldi64((const i64*)&R->kmax[b]);
            }
            csync();
            SG_STAMP(3);
            if (tid < 32) {  // lane l: bins 255 - 8l ... 248 - 8l, in the order candidates run
                const int b0 = 255 - 8 * lane;
                u64 ls = 0;
                bool any = false;
#pragma unroll
                for (int j = 0; j < 8; ++j) { ls += hmass[b0 - j]; any |= hcnt[b0 - j] != 0; }
                if (pass == 0 && kind != 0) {  // the mass above the floor: a float32 product, as the CPU
                    u64 tot = ls;
#pragma unroll
                    for (int o = 16; o > 0; o >>= 1) tot += __shfl_xor_sync(0xffffffffu, tot, o);
                    target = fixed_mass(__fmul_rn(kind == 1 ? topp : u, mass_f32(tot)));
                }
                u64 inc = ls;  // running total over the lanes before this one, then this one
#pragma unroll
                for (int o = 1; o < 32; o <<= 1) {
                    const u64 t = __shfl_up_sync(0xffffffffu, inc, o);
                    if (lane >= o) inc += t;
                }
                const u64 reach = above + inc;
                // lanes without candidates add nothing: the crossing is in one with some
                const u32 hit = __ballot_sync(0xffffffffu, any && (kind == 2 ? reach > target : reach >= target));
                const u32 nz = __ballot_sync(0xffffffffu, any);
                // the first lane that reaches the target; if none does, the lowest candidate's
                const int L = hit ? __ffs(hit) - 1 : nz ? 31 - __clz(nz) : 0;
                if (lane == L) {
                    u64 acc = reach - ls, acc_last = acc;
                    int chosen = -1, last = b0;
                    for (int b = b0; b > b0 - 8; --b) {
                        if (!hcnt[b]) continue;
                        const u64 nx = acc + hmass[b];
                        last = b;
                        acc_last = acc;
                        if (hit && (kind == 2 ? nx > target : nx >= target)) { chosen = b; break; }
                        acc = nx;
                    }
                    if (chosen < 0) { chosen = last; acc = acc_last; }
                    res[0] = (prefix << 8) | (u64)chosen;
                    res[1] = acc;
                    res[2] = nz ? hcnt[chosen] : 1;  // no candidate at all cannot happen; end the select
                    res[3] = nz ? hkmax[chosen] : floor;
                    res[4] = target;
                }
            }
            csync();
            prefix = res[0];
            above = res[1];
            target = res[4];
            SG_STAMP(4);
            if (res[2] == 1 || pass == 7) { floor = res[3]; ++r; break; }  // pass 7: the key is the prefix
        }
    }
    csync();  // every thread has read res before thread 0 moves the round count on
    if (tid == 0) { s_sg_round = round0 + r; s_sg_used = r; }
#ifdef TRACE
    if (c.tr && tid == 0) {
        c.tr[21] = r;
        for (int i = 0; i < 5; ++i) c.tr[22 + i] = tsum[i];
    }
#endif
    return floor;
}
#endif
