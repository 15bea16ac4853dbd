// Small device helpers of the decode kernel: bf16 conversions, loads of data other blocks wrote,
// the release / acquire counters, warp and block reductions, the consumers' barrier. Part of the
// decode kernel: decode.cu includes it (cuda_util.kernel_source splices it in, in order).

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
// Loads for a poll loop (readiness in the data: TAG_DOWN, TAG_QKV, TAG_OPROJ). Relaxed at gpu scope,
// so a later load sees another block's store, and with a memory clobber: with ldf's weak ld.cg and
// no clobber, the compiler turned `do v = load(p); while (!ready(v));` into a single load (the SASS
// had no branch back), so a reader went on with a stale value (session 27; TAG_DOWN's session-10
// figure came from that build).
__device__ __forceinline__ float ld_poll(const float* p) {
    float r;
    asm volatile("ld.relaxed.gpu.global.f32 %0, [%1];" : "=f"(r) : "l"(p) : "memory");
    return r;
}
__device__ __forceinline__ float4 ld_poll4(const float4* p) {
    float4 r;
    asm volatile("ld.relaxed.gpu.global.v4.f32 {%0,%1,%2,%3}, [%4];" : "=f"(r.x), "=f"(r.y), "=f"(r.z), "=f"(r.w) : "l"(p) : "memory");
    return r;
}
struct I64x2 { i64 a, b; };
__device__ __forceinline__ I64x2 ld_poll_i64x2(const i64* p) {  // two int64s (SPLITK_COUNT's accumulators)
    I64x2 r;
    asm volatile("ld.relaxed.gpu.global.v2.s64 {%0,%1}, [%2];" : "=l"(r.a), "=l"(r.b) : "l"(p) : "memory");
    return r;
}
__device__ __forceinline__ i64 ldi64(const i64* p) {
    i64 r;
    asm volatile("ld.global.cg.s64 %0, [%1];" : "=l"(r) : "l"(p));
    return r;
}
__device__ __forceinline__ u32 ldu32(const u32* p) {
    u32 r;
    asm volatile("ld.global.cg.u32 %0, [%1];" : "=r"(r) : "l"(p));
    return r;
}
__device__ __forceinline__ u32 ld_acquire(const u32* p) {
    u32 v;
    asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}
// Spins until *p >= target, then acquires. (Relaxed polls with one acquire fence after the last,
// which drops the L1 invalidation (CCTL.IVALL) of every acquire poll, measured 2.8% slower: the
// fence is a MEMBAR.ALL.GPU; session 11.)
__device__ __forceinline__ void spin_acquire(const u32* p, u32 target) {
    while (ld_acquire(p) < target) { }
}
__device__ __forceinline__ void red_release(u32* p, u32 v) {
    asm volatile("red.release.gpu.global.add.u32 [%0], %1;" :: "l"(p), "r"(v) : "memory");
}
__device__ __forceinline__ u32 ld_sys(const volatile u32* p) {
    u32 v;
    asm volatile("ld.relaxed.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}


// Distributed shared memory (a cluster launch; matvec.cuh SPLITK_PAIRS): a shared::cluster address
// of p in block `rank` of this cluster, 16-byte stores there, and an mbarrier arrive / wait at
// cluster scope (release on the sender's side, acquire on the receiver's).
__device__ __forceinline__ u32 cluster_ctarank() {
    u32 r;
    asm("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
    return r;
}
__device__ __forceinline__ u32 mapa_shared(const void* p, u32 rank) {
    u32 a;
    asm("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(a) : "r"(smem_addr(p)), "r"(rank));
    return a;
}
__device__ __forceinline__ void st_cluster_f4(u32 a, float4 v) {
    asm volatile("st.shared::cluster.v4.f32 [%0], {%1, %2, %3, %4};"
                 :: "r"(a), "f"(v.x), "f"(v.y), "f"(v.z), "f"(v.w) : "memory");
}
__device__ __forceinline__ void mbar_arrive_cluster(u32 a) {
    asm volatile("mbarrier.arrive.release.cluster.shared::cluster.b64 _, [%0];" :: "r"(a) : "memory");
}
__device__ __forceinline__ bool mbar_try_acquire_cluster(u64* bar, u32 parity) {
    u32 done;
    asm volatile("{\n\t.reg .pred p;\n\tmbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 p, [%1], %2;\n\t"
                 "selp.u32 %0, 1, 0, p;\n\t}" : "=r"(done) : "r"(smem_addr(bar)), "r"(parity) : "memory");
    return done != 0;
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
