// Paged-attention decode for elastic-vmm's candle face (src/candle/attention.rs launches it).
// Compiled to PTX by scripts/gen-ptx.sh; the PTX is committed next to this file and embedded.
//
// One query token per sequence attends over its first `lens[b]` cached tokens, read in place
// through its block table (no gather copy). The cache is the per-layer layout of PagedKv and
// of mistral.rs's FlashInfer path: K and V each [blocks, block_tokens, kv_heads, head_dim].
// Grouped-query attention: the REP query heads of one KV head share every K/V load.
//
// Split-K ("flash decoding"): phase 1 runs one CTA per (sequence, KV head, partition of
// `part` tokens) and writes, per query head, the partition's running max, sum of exponentials
// and unnormalised output (f32); phase 2 merges the partitions of each (sequence, head).
//
// Inside a CTA: 4 warps; each warp is split into groups of G = D / 8 lanes, one group per
// token, each lane holding 8 elements of a row (one 16-byte load). A group walks its tokens
// with its own online softmax, U tokens' K and V rows loaded before any is used (loads in
// flight hide the memory latency); the groups merge in shared memory at the end.
//
// Bounds: a table entry at or past `num_blocks` and a token past the table's width count as
// masked (they contribute nothing): the kernel never reads outside the cache.

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

#define WARPS 4
#define U 4

__device__ __forceinline__ void to_float8(const uint4& v, float* f, const __half*) {
    const __half2* h = reinterpret_cast<const __half2*>(&v);
#pragma unroll
    for (int i = 0; i < 4; i++) {
        float2 x = __half22float2(h[i]);
        f[2 * i] = x.x;
        f[2 * i + 1] = x.y;
    }
}

__device__ __forceinline__ void to_float8(const uint4& v, float* f, const __nv_bfloat16*) {
    const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&v);
#pragma unroll
    for (int i = 0; i < 4; i++) {
        float2 x = __bfloat1622float2(h[i]);
        f[2 * i] = x.x;
        f[2 * i + 1] = x.y;
    }
}

__device__ __forceinline__ __half from_float(float x, const __half*) { return __float2half(x); }
__device__ __forceinline__ __nv_bfloat16 from_float(float x, const __nv_bfloat16*) {
    return __float2bfloat16(x);
}

// Phase 1. Grid (batch, kv_heads, partitions), WARPS * 32 threads.
// q [batch, kv_heads * REP, D]; k, v [num_blocks, bt, kv_heads, D]; table [batch, width];
// lens [batch]; part_out [batch, heads, parts, D]; part_m, part_l [batch, heads, parts].
template <typename T, int D, int REP>
__device__ void phase1(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
                       const uint32_t* __restrict__ table, const uint32_t* __restrict__ lens,
                       float* __restrict__ part_out, float* __restrict__ part_m,
                       float* __restrict__ part_l, uint32_t num_blocks, uint32_t bt,
                       uint32_t kv_heads, uint32_t width, uint32_t part, uint32_t max_len,
                       float scale) {
    constexpr int G = D / 8;             // lanes per token
    constexpr int PER_WARP = 32 / G;     // tokens a warp works on at once
    constexpr int GROUPS = WARPS * PER_WARP;
    const uint32_t b = blockIdx.x, kvh = blockIdx.y, p = blockIdx.z, parts = gridDim.z;
    const uint32_t heads = kv_heads * REP;
    const uint32_t lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const uint32_t gl = lane % G;                         // lane within the group
    const uint32_t group = warp * PER_WARP + lane / G;    // group within the CTA
    const T* tag = nullptr;

    uint32_t len = lens[b];
    const uint32_t cover = width * bt;  // tokens the table can name
    if (len > cover) len = cover;
    if (len > max_len) len = max_len;
    const uint32_t start = p * part;
    uint32_t end = start + part;
    if (end > len) end = len;

    float qf[REP][8];
#pragma unroll
    for (int r = 0; r < REP; r++) {
        const uint4 raw = *reinterpret_cast<const uint4*>(
            q + ((uint64_t)b * heads + kvh * REP + r) * D + gl * 8);
        to_float8(raw, qf[r], tag);
#pragma unroll
        for (int i = 0; i < 8; i++) qf[r][i] *= scale;
    }
    float m[REP], l[REP], acc[REP][8];
#pragma unroll
    for (int r = 0; r < REP; r++) {
        m[r] = -INFINITY;
        l[r] = 0.f;
#pragma unroll
        for (int i = 0; i < 8; i++) acc[r][i] = 0.f;
    }
    const uint64_t row = (uint64_t)kv_heads * D;  // elements between two tokens of a block
    // The loop's bounds are the same for every lane (the shuffles need the whole warp).
    for (uint32_t base = start; base < end; base += GROUPS * U) {
        uint4 kr[U], vr[U];
        bool ok[U];
#pragma unroll
        for (int u = 0; u < U; u++) {
            const uint32_t t = base + group + u * GROUPS;
            ok[u] = false;
            if (t < end) {
                const uint32_t blk = table[(uint64_t)b * width + t / bt];
                if (blk < num_blocks) {
                    const uint64_t off = ((uint64_t)blk * bt + t % bt) * row + kvh * D + gl * 8;
                    kr[u] = *reinterpret_cast<const uint4*>(k + off);
                    vr[u] = *reinterpret_cast<const uint4*>(v + off);
                    ok[u] = true;
                }
            }
        }
#pragma unroll
        for (int u = 0; u < U; u++) {
            // Every lane takes part in the shuffles (groups of a warp may differ in `ok`);
            // a masked token's score is computed from zeros and then dropped.
            float kf[8], vf[8];
            if (!ok[u]) kr[u] = vr[u] = make_uint4(0, 0, 0, 0);
            to_float8(kr[u], kf, tag);
            to_float8(vr[u], vf, tag);
#pragma unroll
            for (int r = 0; r < REP; r++) {
                float s = 0.f;
#pragma unroll
                for (int i = 0; i < 8; i++) s += qf[r][i] * kf[i];
#pragma unroll
                for (int o = G / 2; o > 0; o /= 2) s += __shfl_xor_sync(0xffffffffu, s, o);
                if (!ok[u]) continue;
                const float mn = fmaxf(m[r], s);
                const float alpha = __expf(m[r] - mn);
                const float pr = __expf(s - mn);
                m[r] = mn;
                l[r] = l[r] * alpha + pr;
#pragma unroll
                for (int i = 0; i < 8; i++) acc[r][i] = acc[r][i] * alpha + pr * vf[i];
            }
        }
    }

    // Merge the groups: each writes its state, then the CTA's threads combine per (head, d).
    __shared__ float sm_m[GROUPS][REP];
    __shared__ float sm_l[GROUPS][REP];
    __shared__ float sm_acc[GROUPS][REP][D];
#pragma unroll
    for (int r = 0; r < REP; r++) {
        if (gl == 0) {
            sm_m[group][r] = m[r];
            sm_l[group][r] = l[r];
        }
#pragma unroll
        for (int i = 0; i < 8; i++) sm_acc[group][r][gl * 8 + i] = acc[r][i];
    }
    __syncthreads();
    for (uint32_t x = threadIdx.x; x < REP * D; x += blockDim.x) {
        const uint32_t r = x / D, d = x % D;
        float mx = -INFINITY;
        for (int g = 0; g < GROUPS; g++) mx = fmaxf(mx, sm_m[g][r]);
        float sum = 0.f, o = 0.f;
        if (mx != -INFINITY) {
            for (int g = 0; g < GROUPS; g++) {
                if (sm_m[g][r] == -INFINITY) continue;
                const float w = __expf(sm_m[g][r] - mx);
                sum += sm_l[g][r] * w;
                o += sm_acc[g][r][d] * w;
            }
        }
        const uint64_t hp = ((uint64_t)b * heads + kvh * REP + r) * parts + p;
        part_out[hp * D + d] = o;
        if (d == 0) {
            part_m[hp] = mx;
            part_l[hp] = sum;
        }
    }
}

// Phase 2. Grid (batch * heads), D threads: out[b, h] = the merged partitions, normalised.
// A sequence with no token attended (length 0) gets zeros.
template <typename T>
__device__ void phase2(const float* __restrict__ part_out, const float* __restrict__ part_m,
                       const float* __restrict__ part_l, T* __restrict__ out, uint32_t parts,
                       uint32_t d_len) {
    const uint64_t bh = blockIdx.x;
    const T* tag = nullptr;
    for (uint32_t d = threadIdx.x; d < d_len; d += blockDim.x) {
        float mx = -INFINITY;
        for (uint32_t p = 0; p < parts; p++) mx = fmaxf(mx, part_m[bh * parts + p]);
        float sum = 0.f, o = 0.f;
        if (mx != -INFINITY) {
            for (uint32_t p = 0; p < parts; p++) {
                const float pm = part_m[bh * parts + p];
                if (pm == -INFINITY) continue;
                const float w = __expf(pm - mx);
                sum += part_l[bh * parts + p] * w;
                o += part_out[(bh * parts + p) * d_len + d] * w;
            }
        }
        out[bh * d_len + d] = from_float(sum > 0.f ? o / sum : 0.f, tag);
    }
}

#define PHASE1(NAME, T, D, REP)                                                                  \
    extern "C" __global__ void __launch_bounds__(WARPS * 32) NAME(                              \
        const T* q, const T* k, const T* v, const uint32_t* table, const uint32_t* lens,        \
        float* part_out, float* part_m, float* part_l, uint32_t num_blocks, uint32_t bt,        \
        uint32_t kv_heads, uint32_t width, uint32_t part, uint32_t max_len, float scale) {      \
        phase1<T, D, REP>(q, k, v, table, lens, part_out, part_m, part_l, num_blocks, bt,       \
                          kv_heads, width, part, max_len, scale);                                \
    }

#define PHASE1_REPS(TN, T, D)                                     \
    PHASE1(evmm_paged_attn_##TN##_d##D##_r1, T, D, 1)             \
    PHASE1(evmm_paged_attn_##TN##_d##D##_r2, T, D, 2)             \
    PHASE1(evmm_paged_attn_##TN##_d##D##_r4, T, D, 4)             \
    PHASE1(evmm_paged_attn_##TN##_d##D##_r8, T, D, 8)

PHASE1_REPS(f16, __half, 64)
PHASE1_REPS(f16, __half, 128)
PHASE1_REPS(bf16, __nv_bfloat16, 64)
PHASE1_REPS(bf16, __nv_bfloat16, 128)

extern "C" __global__ void evmm_paged_attn_merge_f16(const float* part_out, const float* part_m,
                                                     const float* part_l, __half* out,
                                                     uint32_t parts, uint32_t d_len) {
    phase2<__half>(part_out, part_m, part_l, out, parts, d_len);
}

extern "C" __global__ void evmm_paged_attn_merge_bf16(const float* part_out, const float* part_m,
                                                      const float* part_l, __nv_bfloat16* out,
                                                      uint32_t parts, uint32_t d_len) {
    phase2<__nv_bfloat16>(part_out, part_m, part_l, out, parts, d_len);
}
