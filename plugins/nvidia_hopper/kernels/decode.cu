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
//
// One concern per file, spliced in this order (cuda_util.kernel_source): ring.cuh (the weight
// ring's primitives, shared with the stream probe), common.cuh (helpers), context.cuh (trace
// stamps, the stage context, the wait), attention_plan.cuh (how the attention tiles a query),
// stream.cuh (the producer warp), matvec.cuh, attention.cuh, elementwise.cuh, sample.cuh,
// sample_grid.cuh (the stage kinds); this file keeps the block's layout, the signal warp and the stage loop.

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

#include "common.cuh"
#include "context.cuh"
#include "attention_plan.cuh"
#include "stream.cuh"
#include "matvec.cuh"
#include "attention.cuh"
#include "elementwise.cuh"
#include "sample.cuh"
#include "sample_grid.cuh"

// ------------------------------------------------------------------------------ kernel

// The signal warp (SIGNAL_WARP): lane 0 adds 1 to counter[s] (a gpu-scope release) for every stage
// s the consumers finish, in order. The consumers' barrier orders their writes before thread 0's
// fence and atomic store of s_staged; the atomic read here, followed by the release add's fence,
// carries them on to the blocks that wait on the counter (atomics on both sides: racecheck).
// Exits when the request ends, after the last stage's add.
__device__ __noinline__ void signal_stages(u32* counters, int nst, const i64* run) {
    if ((threadIdx.x & 31) != 0) return;
#ifdef TRACE
    u64* const tbase = (u64*)run[R_TRACE];  // read once: the stamps below must not wait on loads
    const int tit0 = (int)run[R_TRACE_IT0];
#endif
    u32 done = 0;
    for (;;) {
        const u32 now = (u32)atomicAdd(&s_staged, 0u);  // the red.release below is also the acquire fence
        if (now == done) {
            if (atomicAdd(&s_done, 0) && (u32)atomicAdd(&s_staged, 0u) == done) return;
            continue;
        }
        for (; done < now; ++done) {
#ifdef TRACE
            u64* tr = trace_row_at(tbase, tit0, (int)(done / (u32)nst), (int)(done % (u32)nst), nst);
            if (tr) tr[29] = gtimer();
#endif
            red_release(counters + done % (u32)nst, 1u);
#ifdef TRACE
            if (tr) tr[30] = gtimer();  // after the fence: the add is issued once it completes
#endif
        }
    }
}

// SIGNAL_BAR (with SIGNAL_WARP; KOG_HOPPER_SIGNAL_BAR): the signal warp sleeps in the consumers'
// end-of-stage barrier itself (named barrier 2, NT + 32 threads) instead of polling s_staged, which
// thread 0 set after that barrier (thread 0's fence and exchange, then the poll, at every stage
// boundary; +0.7% on bench-2b, session 12). The barrier orders the consumers' writes before the
// release's fence (cumulative at gpu scope). The consumers do not wait on it: stage s + 1 ends only
// after this block's release of stage s (every stage waits on the previous stage's count), so the
// warp is back at the barrier first. (In the benchmark's no-wait modes, or with TAG_DOWN, they may
// reach it first and then wait for the warp there: slower, never wrong.)
#ifndef SIGNAL_BAR
#define SIGNAL_BAR 0
#endif
#define STAGE_BAR (SIGNAL_WARP && SIGNAL_BAR)

// SIGNAL_ARRIVE (with STAGE_BAR; an experiment, off: correct, racecheck-clean, and 0.6-1.0% slower on
// every preset on an H100, perf notes session 40): the consumers do not wait for
// the signal warp at a stage's end. With the tags a stage waits on the count of the stage two back,
// so the consumers can finish stage s + 1 while the signal warp is still in the release fence of
// stage s (1.0-1.6 us behind a matvec stage's copies in flight); in a bar.sync of both they then
// stall, and so do the ring's empty slots. Here the consumers sync among themselves and warp 0
// alone arrives (bar.arrive: its writes and, through the consumers' barrier, theirs are ordered
// before the signal warp's bar.sync and so before its cumulative release) on barrier 3 or 4 by the
// stage's parity; the signal warp syncs on them in turn. A barrier may take warp 0's arrival for
// stage sd only once the signal warp has left it for stage sd - 2 (else two arrivals would complete
// it with no waiter): warp 0 checks s_sig_passed, which the signal warp sets as it leaves each.
#ifndef SIGNAL_ARRIVE
#define SIGNAL_ARRIVE 0
#endif
#define STAGE_ARRIVE (STAGE_BAR && SIGNAL_ARRIVE)
__shared__ u32 s_sig_passed;  // STAGE_ARRIVE: stage barriers the signal warp has left (sd + 1)

// The consumers' end of stage sd (the sd-th stage this block has run).
__device__ __forceinline__ void stage_end_sync(u32 sd) {
    if (STAGE_ARRIVE) {
        csync();  // the consumers' own end of the stage
        if (threadIdx.x < 32) {
            if (threadIdx.x == 0) while ((u32)atomicAdd(&s_sig_passed, 0u) + 1u < sd) {}
            __syncwarp();
            asm volatile("bar.arrive %0, 64;" :: "r"(3 + (sd & 1u)) : "memory");
        }
    } else if (STAGE_BAR) {
        asm volatile("bar.sync 2, %0;" :: "n"(NT + 32) : "memory");
    } else {
        csync();
    }
}

// The signal warp's side of it (STAGE_BAR): wake once the consumers have ended stage `done`.
__device__ __forceinline__ void signal_wait_stage_end(u32 done) {
    if (STAGE_ARRIVE) {
        asm volatile("bar.sync %0, 64;" :: "r"(3 + (done & 1u)) : "memory");
        if ((threadIdx.x & 31) == 0) atomicExch(&s_sig_passed, done + 1);
    } else {
        asm volatile("bar.sync 2, %0;" :: "n"(NT + 32) : "memory");
    }
}
__device__ __noinline__ void signal_stages_bar(u32* counters, int nst, const i64* run) {
    const bool last_only = ((int)run[R_SKIP] >> 8) & 1;  // benchmark bit 8: only the token's last stage signals
#ifdef TRACE
    u64* const tbase = (u64*)run[R_TRACE];  // read once: the stamps below must not wait on loads
    const int tit0 = (int)run[R_TRACE_IT0];
#endif
    for (u32 done = 0;; ++done) {
        signal_wait_stage_end(done);
        if (atomicAdd(&s_done, 0)) return;  // set before the consumers' final barrier (atomics on both sides)
        const u32 s = done % (u32)nst;
        if ((threadIdx.x & 31) == 0 && (!last_only || s == (u32)nst - 1)) {
#ifdef TRACE
            u64* tr = trace_row_at(tbase, tit0, (int)(done / (u32)nst), (int)s, nst);
            if (tr) tr[29] = gtimer();
#endif
            red_release(counters + s, 1u);
#ifdef TRACE
            if (tr) tr[30] = gtimer();
#endif
        }
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
#if SPLITK_PAIRS
    c.npair = 0;
#endif
#if TAG_CHECK
    c.chk_ctr = counters;
#endif
#ifdef TRACE
    c.tbase = (u64*)run[R_TRACE];
    c.tit0 = (int)run[R_TRACE_IT0];
#endif
    const int start_pos = (int)run[R_START_POS];
    c.start_pos = start_pos;
    const int* prompt = (const int*)run[R_PROMPT];
    const u32 nb = gridDim.x;
    if (threadIdx.x == 0) {
        for (int i = 0; i < NSLOTS; ++i) { mbar_init(&full_bar[i], FULL_ARRIVALS); mbar_init(&empty_bar[i], NT); }
        s_done = 0;
        if (SIGNAL_WARP) s_staged = 0;
        if (STAGE_ARRIVE) s_sig_passed = 0;
#if SAMPLE_GRID
        s_sg_round = 0;
        s_sg_used = 0;
#endif
#if SPLITK_PAIRS
        mbar_init(&pair_bar, 1);  // the partner's thread 0 arrives once a split-K stage
#endif
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
#if SPLITK_PAIRS
    // the partner's pair_bar initialised before this block's first remote arrive
    asm volatile("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;" ::: "memory");
#endif
    __syncthreads();  // the last barrier of all NTHREADS: from here on the producer warp goes its own way
    if (SIGNAL_WARP && threadIdx.x >= NT + 32) {
        if (STAGE_BAR) signal_stages_bar(counters, nst, run);
        else signal_stages(counters, nst, run);
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
#if TAG_CHECK
            c.chk_s = s;
#endif
            // the stage waited on: the previous one (-1: the previous token's last), or with TAG_DOWN,
            // whose input values say when they are ready, the stage before their writer
            int ws = s - 1;
            if (TAG_IN && type == ST_MATVEC && ((int)st[MV_FLAGS] & MVF_TAG_IN) && polls_on(c)) ws = s - 2;
            // SPLITK_COUNT: the pending sum's words count their adds, so not the split-K stage's count either
            if (SPLITK_COUNT && type == ST_MATVEC && ((int)st[MV_FLAGS] & MVF_COUNT_IN) && polls_on(c)) ws = s - 2;
            const u32* wctr = ws >= 0 ? counters + ws : counters + nst - 1;
            u32 wtarget = (c.skipmask >> 6) & 1 ? 0u : ws >= 0 ? nb * (u32)(it + 1) : nb * (u32)it;  // bit 6: stream only
            // the tiles poll their inputs' parity instead (TAG_QKV_WAIT=1 keeps the wait as well: a
            // bisecting build, tags written and polled with the old ordering, perf notes session 26)
            if (TAG_QKV && !TAG_QKV_WAIT && type == ST_ATTN && st[AT_TAG] && polls_on(c)) wtarget = 0;
            if (s == 0) c.tok = it < c.P ? prompt[it] : (int)ldi64(run + R_TOK);  // written before the previous iteration's last wait
#ifdef TRACE
            c.tr = trace_row_at(c.tbase, c.tit0, it, s, nst);
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
            stage_end_sync(sd);  // with STAGE_BAR the signal warp wakes here and releases the stage
            TMARK(c, 3);
            // release: every write of this block (ordered by the barrier) is visible before the count.
            // Benchmark bit 8 (with bit 6, no waits): only the token's last stage signals.
            if (!STAGE_BAR && threadIdx.x == 0 && (!((c.skipmask >> 8) & 1) || s == nst - 1)) {
                if (SIGNAL_WARP) { __threadfence_block(); atomicExch(&s_staged, sd + 1); }  // the signal warp adds for it
                else red_release(counters + s, 1u);
            }
            TMARK(c, 9);
        }
        wait_counter(counters + nst - 1, nb * (u32)(it + 1));
        if (ldi64(run + R_STOP)) break;
    }
    if (threadIdx.x == 0) atomicExch(&s_done, 1);  // the producer drains its copies in flight and exits
    if (STAGE_BAR) stage_end_sync(sd);  // the signal warp wakes, finds s_done set and exits
}
