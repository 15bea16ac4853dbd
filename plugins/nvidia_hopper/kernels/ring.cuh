// The weight ring's primitives, shared by decode.cu and stream_probe.cu (spliced in by
// cuda_util.kernel_source, so the probe measures exactly the instructions the kernel runs):
// shared-memory addresses, mbarriers, the bulk copy, per-thread cp.async, bf16 dot products.
// Expects the u32 / u64 typedefs of the including file.

// SMEM_ADDR_INTRINSIC (the default since session 17; KOG_HOPPER_DEFINES=SMEM_ADDR_INTRINSIC=0 for
// the old form): the compiler's own conversion instead of cvta in inline asm, which it cannot see
// through: every mbarrier, bulk copy and cp.async address is then formed as a shared-memory offset,
// not as a generic address built from the shared window (S2R SR_SWINHI) and converted back.
// bench-2b's kernel: 138 fewer instructions, e.g. once less per item in the consumers' loop and in
// the producer's copy loop. Same-call A/Bs, two rounds each: bench-2b +0.5%, llama-3.2-1b +0.3%,
// laneformer-2b +0.2% (whose build, at the register bound, then spills 4 bytes at the kernel's entry).
#ifndef SMEM_ADDR_INTRINSIC
#define SMEM_ADDR_INTRINSIC 1
#endif
__device__ __forceinline__ u32 smem_addr(const void* p) {
#if SMEM_ADDR_INTRINSIC
    return (u32)__cvta_generic_to_shared(p);
#else
    u64 a;
    asm("cvta.to.shared.u64 %0, %1;" : "=l"(a) : "l"(p));
    return (u32)a;
#endif
}
__device__ __forceinline__ void mbar_init(u64* bar, u32 count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" :: "r"(smem_addr(bar)), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_expect_tx(u64* bar, u32 bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" :: "r"(smem_addr(bar)), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_arrive(u64* bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" :: "r"(smem_addr(bar)) : "memory");
}
__device__ __forceinline__ bool mbar_try(u64* bar, u32 parity) {
    u32 done;
    asm volatile("{\n\t.reg .pred p;\n\tmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n\tselp.u32 %0, 1, 0, p;\n\t}"
                 : "=r"(done) : "r"(smem_addr(bar)), "r"(parity) : "memory");
    return done != 0;
}
__device__ __forceinline__ void mbar_wait(u64* bar, u32 parity) { while (!mbar_try(bar, parity)) { } }
__device__ __forceinline__ void bulk_copy(void* dst, const void* src, u32 bytes, u64* bar) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                 :: "r"(smem_addr(dst)), "l"(src), "r"(bytes), "r"(smem_addr(bar)) : "memory");
}
// An L2 policy under which the lines a copy brings in are evicted first. The weight stream reads
// every byte once a token (~4 GB through a 50 MB L2), so without it the stream pushes out what the
// kernel reads again soon: its own code (~200 KB of SASS, run once a layer), the stage
// descriptors, the KV cache, the RoPE tables.
__device__ __forceinline__ u64 l2_evict_first_policy() {
    u64 p;
    asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(p));
    return p;
}
__device__ __forceinline__ void bulk_copy_hint(void* dst, const void* src, u32 bytes, u64* bar, u64 policy) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint [%0], [%1], %2, [%3], %4;"
                 :: "r"(smem_addr(dst)), "l"(src), "r"(bytes), "r"(smem_addr(bar)), "l"(policy) : "memory");
}
// ask L2 for `bytes` at p (the copy engine: it queues with the bulk copies)
__device__ __forceinline__ void prefetch_l2(const void* p, u32 bytes) {
    asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" :: "l"(p), "r"(bytes) : "memory");
}
__device__ __forceinline__ void cp_async16(void* dst, const void* src) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" :: "r"(smem_addr(dst)), "l"(src) : "memory");
}
__device__ __forceinline__ void cp_async8(void* dst, const void* src) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 8;" :: "r"(smem_addr(dst)), "l"(src) : "memory");
}
__device__ __forceinline__ void cp_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
__device__ __forceinline__ void cp_wait_all() { asm volatile("cp.async.wait_all;" ::: "memory"); }
// arrive on `bar` once this thread's cp.async copies so far have landed (counts as one expected arrival)
__device__ __forceinline__ void cp_async_arrive_noinc(u64* bar) {
    asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];" :: "r"(smem_addr(bar)) : "memory");
}
__device__ __forceinline__ u64 gtimer() { u64 t; asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)); return t; }

__device__ __forceinline__ float bf_lo(u32 u) { return __uint_as_float(u << 16); }
__device__ __forceinline__ float bf_hi(u32 u) { return __uint_as_float(u & 0xffff0000u); }
// 8 bf16 weights times x in the split layout of matvec.cuh (values 0-3 in a, 4-7 in b)
__device__ __forceinline__ float dot8s(uint4 w, float4 a, float4 b, float acc) {
    acc = fmaf(bf_lo(w.x), a.x, acc); acc = fmaf(bf_hi(w.x), a.y, acc);
    acc = fmaf(bf_lo(w.y), a.z, acc); acc = fmaf(bf_hi(w.y), a.w, acc);
    acc = fmaf(bf_lo(w.z), b.x, acc); acc = fmaf(bf_hi(w.z), b.y, acc);
    acc = fmaf(bf_lo(w.w), b.z, acc); acc = fmaf(bf_hi(w.w), b.w, acc);
    return acc;
}
