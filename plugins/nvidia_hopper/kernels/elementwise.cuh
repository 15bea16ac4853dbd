// Elementwise stages (ops no other stage fused): embedding, RMSNorm, RoPE, KV append, SwiGLU, adds,
// Laneformer's lane ops. Part of the decode kernel: decode.cu includes it (cuda_util.kernel_source
// splices it in, in order).

// RMS_BLOCK (the default since session 14, +2.5% on laneformer-2b; KOG_HOPPER_RMS_BLOCK=0: a warp a
// row; the backend defines it only when a stage has such rows, schedule.has_long_rmsnorm): an
// RMSNorm of few long rows (256 to 4 * NT * RMS_V values a row; Laneformer's final norm, 8 lanes x
// 3072) takes a block a row, every value of the row loaded at once into registers (float4s, RMS_V a
// thread; schedule.RMS_BLOCK_VALUES must match), one block reduction, instead of a warp a row
// looping over it: 96 loads a lane in two passes, unrolled by ~4, about 50 L2 round trips in a row
// on one block. Session 13's trace: laneformer-2b's final norm stage 39.9 us a token (its last
// block 37 us after the median), 2.6% of the token.
#ifndef RMS_BLOCK
#define RMS_BLOCK 0
#endif
// TAG_X_EW (KOG_HOPPER_TAG_X_EW; with TAG_X, on with TAG_X_LANES since v34): Laneformer's early (all-reduce) layers'
// elementwise lane_residual stores x with its write's parity (EW_OTAG), so the normed matvec after it
// polls x instead of waiting on this stage's count (schedule.tag_residual_outputs(ew=True)). Its
// default (0) is set in context.cuh, spliced in earlier, whose polls_on reads it too.
#if TAG_X_EW && !TAG_X
#error "TAG_X_EW extends TAG_X: its readers poll on TAG_X's path"
#endif
#define RMS_V 4

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
        if (RMS_BLOCK && grp >= 256 && grp <= 4 * NT * RMS_V && (grp & 3) == 0 && (wl & 3) == 0) {
            const int n4 = grp >> 2;
            for (int u = blockIdx.x; u < L * ng; u += gridDim.x) {  // block-uniform: block_sum's barriers
                const int l = u / ng, gi = u - l * ng;
                const float4* x4 = (const float4*)(a + (i64)l * D + (i64)gi * grp);
                float4 v[RMS_V];
                float ss = 0.f;
#pragma unroll
                for (int k = 0; k < RMS_V; ++k) {
                    const int i4 = threadIdx.x + k * NT;
                    v[k] = i4 < n4 ? ldcg4_volatile(x4 + i4) : make_float4(0.f, 0.f, 0.f, 0.f);
                }
#pragma unroll
                for (int k = 0; k < RMS_V; ++k)
                    ss = fmaf(v[k].w, v[k].w, fmaf(v[k].z, v[k].z, fmaf(v[k].y, v[k].y, fmaf(v[k].x, v[k].x, ss))));
                ss = block_sum(ss);
                const float dd = sqrtf(ss / (float)grp + eps);
                const u16* wr = w + (wl ? l * wl + (i64)gi * grp : 0);
                float4* o4 = (float4*)(out + (i64)l * D + (i64)gi * grp);
#pragma unroll
                for (int k = 0; k < RMS_V; ++k) {
                    const int i4 = threadIdx.x + k * NT;
                    if (i4 < n4) {
                        const uint2 wb = *(const uint2*)(wr + 4 * i4);
                        o4[i4] = make_float4(v[k].x / dd * bf_lo(wb.x), v[k].y / dd * bf_hi(wb.x),
                                             v[k].z / dd * bf_lo(wb.y), v[k].w / dd * bf_hi(wb.y));
                    }
                }
            }
            return;
        }
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
#if TAG_X_EW  // (schedule.tag_residual_outputs(ew=True)) x stored with this write's parity for the normed stage after to poll
        const int tagp = st[EW_OTAG] ? (int)tag_parity_of((u32)st[EW_OTAG], c.it) : -1;
#endif
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
#if TAG_X_EW
            x[i] = tagp >= 0 ? with_parity(ldf(x + i) + acc, (u32)tagp) : ldf(x + i) + acc;
#else
            x[i] = ldf(x + i) + acc;
#endif
        }
    }
}
