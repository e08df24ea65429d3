// Paged-attention decode for elastic-vmm's candle face (src/candle/attention.rs launches it).
// The kernels are templates here; paged_attention*.cu instantiate them, one module (one PTX,
// committed and embedded, compiled by scripts/gen-ptx.sh) per block order, so a process JIT-
// compiles only the order it uses.
//
// One query token per sequence attends over its first `lens[b]` cached tokens, read in place
// through its block table (no gather copy). Block orders (L, crate::candle::BlockShape):
//   0 token-major: K and V each [blocks, block_tokens, kv_heads, head_dim] (PagedKv's own,
//     FlashInfer's NHD);
//   1 head-major: K and V each [blocks, kv_heads, block_tokens, head_dim] (FlashInfer's HND);
//   2 split K: K [blocks, kv_heads, head_dim / 8, block_tokens, 8], V [blocks, kv_heads,
//     head_dim, block_tokens] (vLLM's paged-attention kernels, mistral.rs, candle-vllm; 8
//     elements of 16 bits in 16 bytes).
// A lane's 8 elements of a K row are one 16-byte load in every order, and of a V row in orders
// 0 and 1; in order 2 a lane reads, for each of its 8 elements, the tile's tokens of it in one
// load (they are consecutive there).
// Grouped-query attention: the REP query heads of one KV head share every K/V load.
//
// Split-K ("flash decoding"): phase 1 runs one CTA per (sequence, KV head, partition of
// `part` tokens) and writes, per query head, the partition's running max, sum of exponentials
// and unnormalised output (f32); phase 2 merges the partitions of each (sequence, head).
//
// Inside a CTA: 4 warps; each warp is split into groups of G = D / 8 lanes, one group per
// token, each lane holding 8 elements of a row (one 16-byte load). A group walks its tokens
// a tile of U consecutive tokens at a time (4, or 2 for 8 heads per KV head; the groups' tiles
// side by side): the next tile's K and V rows are
// loaded while this one is computed (software pipelining hides the memory latency), its U x
// REP scores are summed across the group together (a reduce-scatter, then a broadcast), and
// the group's online softmax takes one max and one rescale per head per tile rather than per
// token. The groups merge in shared memory at the end.
//
// Bounds: a table entry at or past `num_blocks` and a token past the table's width count as
// masked (they contribute nothing): the kernel never reads outside the cache.

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>
#include <type_traits>

#define WARPS 4

template <int X> struct Log2 { static constexpr int v = 1 + Log2<X / 2>::v; };
template <> struct Log2<1> { static constexpr int v = 0; };

// Sums each of the N values across the G lanes of a group (every lane holds its share of each)
// and leaves every lane with all N sums. A reduce-scatter halves the values a lane holds at each
// step (a lane whose step bit is set keeps the upper half and adds its partner's copy), so the
// sums take N - N / G shuffles where N >= G (N - 1 and log2(G / N) butterfly steps where
// N < G) rather than N * log2(G); then a broadcast (N shuffles) hands every sum to every lane.
template <int N, int G>
__device__ __forceinline__ void group_sums(float (&v)[N], uint32_t gl) {
    constexpr int LG = Log2<G>::v;
    constexpr int S = Log2<(N < G ? N : G)>::v;  // reduce-scatter steps
    constexpr int NS = N >> S;                     // values a lane holds after them
#pragma unroll
    for (int k = 0; k < S; k++) {
        const int o = G >> (k + 1), h = N >> (k + 1);
        const bool up = (gl & o) != 0;
        // A constant trip count (N / 2, the largest h) so that the compiler unrolls both
        // loops and every index is a constant: the values stay in registers.
#pragma unroll
        for (int i = 0; i < N / 2; i++) {
            if (i < h) {
                const float send = up ? v[i] : v[i + h];
                const float keep = up ? v[i + h] : v[i];
                v[i] = keep + __shfl_xor_sync(0xffffffffu, send, o);
            }
        }
    }
#pragma unroll
    for (int k = S; k < LG; k++) {
#pragma unroll
        for (int i = 0; i < NS; i++) v[i] += __shfl_xor_sync(0xffffffffu, v[i], G >> (k + 1));
    }
    // Sum j sits in slot j % NS of the lanes whose top S bits are j / NS.
    float all[N];
#pragma unroll
    for (int j = 0; j < N; j++) all[j] = __shfl_sync(0xffffffffu, v[j % NS], (j / NS) << (LG - S), G);
#pragma unroll
    for (int j = 0; j < N; j++) v[j] = all[j];
}

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
// q [batch, kv_heads * REP, D]; k, v [num_blocks, ...] in order L; table [batch, width];
// lens [batch]; part_out [batch, heads, parts, D]; part_m, part_l [batch, heads, parts].
template <typename T, int D, int REP, int L>
__device__ void phase1(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
                       const uint32_t* __restrict__ table, const uint32_t* __restrict__ lens,
                       float* __restrict__ part_out, float* __restrict__ part_m,
                       float* __restrict__ part_l, uint32_t num_blocks, uint32_t bt,
                       uint32_t kv_heads, uint32_t width, uint32_t part, uint32_t max_len,
                       float scale) {
    constexpr int G = D / 8;             // lanes per token
    constexpr int PER_WARP = 32 / G;     // tokens a warp works on at once
    constexpr int GROUPS = WARPS * PER_WARP;
    // Tokens in a tile: four, or two where eight heads' scores would not fit the registers.
    constexpr int U = REP >= 8 ? 2 : 4;
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
    // Load the tile at `base`: K and V rows of the group's U consecutive tokens, `ok` where a
    // token counts.
    auto load = [&](uint32_t base, uint4 (&kr)[U], uint4 (&vr)[U], bool (&ok)[U]) {
        const uint32_t t0 = base + group * U;
        uint64_t hb = 0;  // split K: the (block, KV head) of the tile's first token
#pragma unroll
        for (int u = 0; u < U; u++) {
            const uint32_t t = t0 + u;
            ok[u] = false;
            kr[u] = vr[u] = make_uint4(0, 0, 0, 0);
            if (t < end) {
                const uint32_t blk = table[(uint64_t)b * width + t / bt];
                if (blk < num_blocks) {
                    const uint32_t o = t % bt;
                    if constexpr (L == 0) {
                        const uint64_t off = ((uint64_t)blk * bt + o) * row + kvh * D + gl * 8;
                        kr[u] = *reinterpret_cast<const uint4*>(k + off);
                        vr[u] = *reinterpret_cast<const uint4*>(v + off);
                    } else if constexpr (L == 1) {
                        const uint64_t off =
                            (((uint64_t)blk * kv_heads + kvh) * bt + o) * D + gl * 8;
                        kr[u] = *reinterpret_cast<const uint4*>(k + off);
                        vr[u] = *reinterpret_cast<const uint4*>(v + off);
                    } else {
                        const uint64_t h = (uint64_t)blk * kv_heads + kvh;
                        if (u == 0) hb = h;
                        kr[u] = *reinterpret_cast<const uint4*>(k + ((h * (D / 8) + gl) * bt + o) * 8);
                    }
                    ok[u] = true;
                }
            }
        }
        if constexpr (L == 2) {
            // V [.., head_dim, block_tokens]: a lane's 8 elements of one token are bt apart,
            // and the tile's U tokens of one element are consecutive. Where the tile is whole
            // in one block (and aligned: bt a multiple of U), each element's U tokens are one
            // load of U * 2 bytes; otherwise each token's elements are read 2 bytes at a time.
            using Run = typename std::conditional<U == 4, uint2, uint32_t>::type;
            bool whole = bt % U == 0 && t0 % U == 0;
#pragma unroll
            for (int u = 0; u < U; u++) whole = whole && ok[u];
            if (whole) {
                const T* vp = v + (hb * D + gl * 8) * bt + t0 % bt;
                T e[U][8];
#pragma unroll
                for (int i = 0; i < 8; i++) {
                    const Run x = *reinterpret_cast<const Run*>(vp + (uint64_t)i * bt);
                    const T* xs = reinterpret_cast<const T*>(&x);
#pragma unroll
                    for (int u = 0; u < U; u++) e[u][i] = xs[u];
                }
#pragma unroll
                for (int u = 0; u < U; u++) vr[u] = *reinterpret_cast<const uint4*>(e[u]);
            } else {
#pragma unroll
                for (int u = 0; u < U; u++) {
                    const uint32_t t = t0 + u;
                    if (!ok[u]) continue;
                    const uint32_t blk = table[(uint64_t)b * width + t / bt];
                    const T* vp = v + (((uint64_t)blk * kv_heads + kvh) * D + gl * 8) * bt + t % bt;
                    T e[8];
#pragma unroll
                    for (int i = 0; i < 8; i++) e[i] = vp[(uint64_t)i * bt];
                    vr[u] = *reinterpret_cast<const uint4*>(e);
                }
            }
        }
    };
    // Software pipelining: the next tile's loads are in flight while this one is computed.
    uint4 kr[U], vr[U];
    bool ok[U];
    load(start, kr, vr, ok);
    // The loop's bounds are the same for every lane (the shuffles need the whole warp).
    for (uint32_t base = start; base < end; base += GROUPS * U) {
        uint4 nk[U], nv[U];
        bool nok[U];
        load(base + GROUPS * U, nk, nv, nok);
        // The tile's scores, index u * REP + r; every lane takes part in the shuffles (groups
        // of a warp may differ in `ok`), a masked token's score is computed from zeros and
        // then left out.
        float s[U * REP];
#pragma unroll
        for (int u = 0; u < U; u++) {
            float kf[8];
            to_float8(kr[u], kf, tag);
#pragma unroll
            for (int r = 0; r < REP; r++) {
                float x = 0.f;
#pragma unroll
                for (int i = 0; i < 8; i++) x += qf[r][i] * kf[i];
                s[u * REP + r] = x;
            }
        }
        group_sums<U * REP, G>(s, gl);
        bool any = false;
#pragma unroll
        for (int u = 0; u < U; u++) any |= ok[u];
        // No token of the tile counts (past the end, or ids past the cache): nothing changes.
        if (any) {
            // One max and one rescale per head; the scores become the tokens' weights.
#pragma unroll
            for (int r = 0; r < REP; r++) {
                float tmax = -INFINITY;
#pragma unroll
                for (int u = 0; u < U; u++)
                    if (ok[u]) tmax = fmaxf(tmax, s[u * REP + r]);
                const float mn = fmaxf(m[r], tmax);
                const float alpha = __expf(m[r] - mn);
                m[r] = mn;
                float sum = 0.f;
#pragma unroll
                for (int u = 0; u < U; u++) {
                    const float pr = ok[u] ? __expf(s[u * REP + r] - mn) : 0.f;
                    s[u * REP + r] = pr;
                    sum += pr;
                }
                l[r] = l[r] * alpha + sum;
#pragma unroll
                for (int i = 0; i < 8; i++) acc[r][i] *= alpha;
            }
#pragma unroll
            for (int u = 0; u < U; u++) {
                float vf[8];
                to_float8(vr[u], vf, tag);
#pragma unroll
                for (int r = 0; r < REP; r++) {
#pragma unroll
                    for (int i = 0; i < 8; i++) acc[r][i] += s[u * REP + r] * vf[i];
                }
            }
        }
#pragma unroll
        for (int u = 0; u < U; u++) {
            kr[u] = nk[u];
            vr[u] = nv[u];
            ok[u] = nok[u];
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

// The new tokens' K (KV = 0) or V (KV = 1) into their slots of a cache in order L, the write
// half of an engine's step (vLLM's reshape_and_cache). Bits are copied: 16-bit elements of
// either dtype. src [tokens, kv_heads, d], slots [tokens] (block * bt + offset; a slot whose
// block is at or past num_blocks is skipped, never written). Grid (tokens), any block size:
// the threads take the token's kv_heads * d / 8 runs of 8 elements in turn.
template <int L, int KV>
__device__ void kv_write(const uint16_t* __restrict__ src, uint16_t* __restrict__ cache,
                         const uint32_t* __restrict__ slots, uint32_t num_blocks, uint32_t bt,
                         uint32_t kv_heads, uint32_t d) {
    const uint32_t t = blockIdx.x;
    const uint32_t slot = slots[t];
    if (slot / bt >= num_blocks) return;
    const uint64_t blk = slot / bt;
    const uint32_t o = slot % bt, runs = d / 8;
    for (uint32_t c = threadIdx.x; c < kv_heads * runs; c += blockDim.x) {
        const uint32_t h = c / runs, j = c % runs;
        const uint4 x = *reinterpret_cast<const uint4*>(src + ((uint64_t)t * kv_heads + h) * d + j * 8);
        const uint64_t hb = blk * kv_heads + h;
        if constexpr (L == 0) {
            *reinterpret_cast<uint4*>(cache + ((blk * bt + o) * kv_heads + h) * d + j * 8) = x;
        } else if constexpr (L == 1) {
            *reinterpret_cast<uint4*>(cache + (hb * bt + o) * d + j * 8) = x;
        } else if constexpr (KV == 0) {
            *reinterpret_cast<uint4*>(cache + ((hb * runs + j) * bt + o) * 8) = x;
        } else {
            const uint16_t* e = reinterpret_cast<const uint16_t*>(&x);
#pragma unroll
            for (int i = 0; i < 8; i++) cache[(hb * d + j * 8 + i) * bt + o] = e[i];
        }
    }
}

// CTAs per SM the register use must allow: three keep 12 warps per SM to hide the loads'
// latency; eight heads per KV head need more registers than three CTAs can have.
#define MIN_CTAS(REP) ((REP) >= 8 ? 2 : 3)

#define PHASE1(NAME, T, D, REP, L)                                                               \
    extern "C" __global__ void __launch_bounds__(WARPS * 32, MIN_CTAS(REP)) NAME(              \
        const T* q, const T* k, const T* v, const uint32_t* table, const uint32_t* lens,        \
        float* part_out, float* part_m, float* part_l, uint32_t num_blocks, uint32_t bt,        \
        uint32_t kv_heads, uint32_t width, uint32_t part, uint32_t max_len, float scale) {      \
        phase1<T, D, REP, L>(q, k, v, table, lens, part_out, part_m, part_l, num_blocks, bt,    \
                             kv_heads, width, part, max_len, scale);                             \
    }

#define PHASE1_REPS(TN, T, D, L)                                     \
    PHASE1(evmm_paged_attn_##TN##_d##D##_r1, T, D, 1, L)             \
    PHASE1(evmm_paged_attn_##TN##_d##D##_r2, T, D, 2, L)             \
    PHASE1(evmm_paged_attn_##TN##_d##D##_r4, T, D, 4, L)             \
    PHASE1(evmm_paged_attn_##TN##_d##D##_r8, T, D, 8, L)

// Every kernel of a module of block order L: phase 1 per dtype, head size and heads per KV
// head; the two merges; the writes of K and V.
#define PAGED_ATTENTION_MODULE(L)                                                                \
    PHASE1_REPS(f16, __half, 64, L)                                                              \
    PHASE1_REPS(f16, __half, 128, L)                                                             \
    PHASE1_REPS(bf16, __nv_bfloat16, 64, L)                                                      \
    PHASE1_REPS(bf16, __nv_bfloat16, 128, L)                                                     \
    extern "C" __global__ void evmm_paged_attn_merge_f16(const float* part_out,                 \
                                                         const float* part_m,                   \
                                                         const float* part_l, __half* out,      \
                                                         uint32_t parts, uint32_t d_len) {      \
        phase2<__half>(part_out, part_m, part_l, out, parts, d_len);                            \
    }                                                                                            \
    extern "C" __global__ void evmm_paged_attn_merge_bf16(                                      \
        const float* part_out, const float* part_m, const float* part_l, __nv_bfloat16* out,    \
        uint32_t parts, uint32_t d_len) {                                                        \
        phase2<__nv_bfloat16>(part_out, part_m, part_l, out, parts, d_len);                     \
    }                                                                                            \
    extern "C" __global__ void evmm_paged_kv_write_k(const uint16_t* src, uint16_t* cache,      \
                                                     const uint32_t* slots, uint32_t num_blocks,\
                                                     uint32_t bt, uint32_t kv_heads,            \
                                                     uint32_t d) {                              \
        kv_write<L, 0>(src, cache, slots, num_blocks, bt, kv_heads, d);                         \
    }                                                                                            \
    extern "C" __global__ void evmm_paged_kv_write_v(const uint16_t* src, uint16_t* cache,      \
                                                     const uint32_t* slots, uint32_t num_blocks,\
                                                     uint32_t bt, uint32_t kv_heads,            \
                                                     uint32_t d) {                              \
        kv_write<L, 1>(src, cache, slots, num_blocks, bt, kv_heads, d);                         \
    }
