// SAMPLE_GRID (the default for sampled decoding when the vocabulary fits; backend.py): temperature,
// top-k, top-p and the draw on every block, not on block 0 alone. Part of the decode kernel:
// decode.cu includes it after sample.cuh (cuda_util.kernel_source splices it in, in order).
//
// Why: block 0 alone reads the vocabulary's z and p once per select pass; at 128k tokens that is
// ~1 MB from L2 at one SM's rate per pass, and sampled decoding ran at 118 tok/s (radix select:
// 217) against greedy's 720 (session 10, call 1). Here each block keeps its slice of the
// vocabulary (SAMPLE_EPT candidates per thread) in registers for the whole token, and each pass
// of the radix select (sample.cuh, the same definitions) is one grid-wide round:
//   1. the block's candidates go into 256-bin shared histograms (mass, count, XOR of the keys);
//   2. its non-empty bins are added into this round's global bins (atomics at L2);
//   3. it counts its arrival (release) and waits for every block's (acquire);
//   4. the block reads the 256 global bins and every warp chooses; every block and warp chooses the
//      same bin, since the sums are integers (the same in any order): nothing is broadcast.
// Two sets of shared bins alternate by round, so each round zeroes the next one's set on the way:
// four barriers a round.
// A select ends as soon as its chosen bin holds one candidate (that bin's keys' XOR is the
// candidate's key), usually after 3-4 passes instead of 8. A top-p or draw select's target comes
// from its first pass: the sum of all bins is the mass of the candidates above the floor.
// Rounds are counted over the launch (one arrival counter, never reset); each token's rounds use
// one of two sets of global bins by its parity, and the blocks zero the other set's used rounds
// (the token before last: nobody reads them any more, and the stage counters order these stores
// before the next token's atomics). The host zeroes both sets and the counter at each launch.
#if SAMPLE_GRID
// SG_ROUNDS (schedule.CONSTS, which also sizes the global bins): rounds a token at most
struct SgRound { u64 mass[256]; u64 kx[256]; u32 cnt[256]; };  // 5 KB of global bins (kx: the keys' XOR)
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
    // two sets of shared bins (this block's, then the grid's), by round parity: a round zeroes the
    // next round's set while nobody reads it, so no barrier is spent on zeroing
    Bins* hs = (Bins*)smem_f();
    u32* kxs = (u32*)(hs + 2);     // [2][2][256] the bins' keys' XOR, low and high words
    bins_zero(hs, kxs);
    csync();
    u64 floor = 0;  // candidates: key >= floor; each select's result is the next one's floor
    u32 r = 0;      // rounds this token
    for (int kind = 0; kind < 3; ++kind) {  // 0: top-k (counts), 1: top-p (masses), 2: the draw
        if (kind == 0 && !(topk > 0 && topk < V)) continue;
        if (kind == 1 && !(topp < 1.0f)) continue;
        u64 prefix = 0, above = 0, target = (u64)topk;
        for (int pass = 0; pass < 8; ++pass, ++r) {
            const int shift = 56 - 8 * pass;
            Bins* h = hs + (r & 1);
            u32* hkx = kxs + (r & 1) * 512;
            SG_STAMP(-1);
#pragma unroll
            for (int k = 0; k < SAMPLE_EPT; ++k) {
                const u64 cb = key[k];
                const bool in = cb != 0 && cb >= floor && (pass == 0 || (cb >> (shift + 8)) == prefix);
                hist_add(h, in ? (int)(cb >> shift) & 255 : -1, kind == 0 ? 1ull : mass[k], hkx, cb);
            }
            csync();
            SG_STAMP(0);
            SgRound* R = set + r;
            for (int b = tid; b < 256; b += NT) {
                if (!h->cnt[b]) continue;
                // reductions in global memory, named as such: through a generic pointer the compiler
                // also emits a shared-memory path (a compare-and-swap loop) for each
                asm volatile("red.global.add.u64 [%0], %1;" :: "l"(&R->mass[b]), "l"(bin_mass(h, b)) : "memory");
                asm volatile("red.global.add.u32 [%0], %1;" :: "l"(&R->cnt[b]), "r"(h->cnt[b]) : "memory");
                asm volatile("red.global.xor.b64 [%0], %1;" :: "l"(&R->kx[b]), "l"((u64)hkx[b] | ((u64)hkx[256 + b] << 32)) : "memory");
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
            bins_zero(hs + ((r + 1) & 1), kxs + ((r + 1) & 1) * 512);  // last read in round r - 1's choice
            for (int b = tid; b < 256; b += NT) {  // the grid's bins replace the block's
                h->cnt[b] = ldu32(&R->cnt[b]);
                const u64 m = (u64)ldi64((const i64*)&R->mass[b]), kx = (u64)ldi64((const i64*)&R->kx[b]);
                h->mlo[b] = (u32)m; h->mhi[b] = (u32)(m >> 32);
                hkx[b] = (u32)kx; hkx[256 + b] = (u32)(kx >> 32);
            }
            csync();
            SG_STAMP(3);
            // every warp makes the same choice from the same bins (nothing to broadcast, and the
            // warp-wide steps run converged); lane l: bins 255 - 8l ... 248 - 8l, in the order candidates run
            const int b0 = 255 - 8 * lane;
            u64 ls = 0;
            bool any = false;
#pragma unroll
            for (int j = 0; j < 8; ++j) { ls += bin_mass(h, b0 - j); any |= h->cnt[b0 - j] != 0; }
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
            u64 acc = reach - ls;
            int chosen = -1;
            if (lane == L) {
                u64 acc_last = acc;
                int last = b0;
                for (int b = b0; b > b0 - 8; --b) {
                    if (!h->cnt[b]) continue;
                    const u64 nx = acc + bin_mass(h, b);
                    last = b;
                    acc_last = acc;
                    if (hit && (kind == 2 ? nx > target : nx >= target)) { chosen = b; break; }
                    acc = nx;
                }
                if (chosen < 0) { chosen = last; acc = acc_last; }
            }
            chosen = __shfl_sync(0xffffffffu, chosen, L);
            above = __shfl_sync(0xffffffffu, acc, L);
            prefix = (prefix << 8) | (u64)chosen;
            const u32 count = nz ? h->cnt[chosen] : 1u;  // no candidate at all cannot happen; end the select
            SG_STAMP(4);
            // the bin's one key (by pass 7 every bit is chosen, and keys are unique: one candidate)
            if (count == 1 || pass == 7) {
                floor = nz ? (u64)hkx[chosen] | ((u64)hkx[256 + chosen] << 32) : floor;
                ++r;
                break;
            }
        }
    }
    csync();  // every warp has made its last choice from the bins: the stage scratch is free again
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
