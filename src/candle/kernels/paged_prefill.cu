// Paged-attention prefill for elastic-vmm's candle face (src/candle/prefill.rs launches it).
// Compiled to PTX by scripts/gen-ptx.sh; the PTX is committed next to this file and embedded.
//
// A prefill chunk's new query tokens attend causally over their sequence's cached tokens (the
// earlier chunks and their own, already written into the blocks), read in place through the
// block table: no gather copy, no score matrix in memory. The cache's blocks are in one of the
// orders of paged_attention.cuh (ORD, crate::candle::BlockShape): 0 token-major, K and V each
// [blocks, block_tokens, kv_heads, head_dim] (PagedKv's own); 1 head-major, [blocks, kv_heads,
// block_tokens, head_dim]; 2 split K, K [blocks, kv_heads, head_dim / 8, block_tokens, 8] and
// V [blocks, kv_heads, head_dim, block_tokens] (vLLM's, mistral.rs's). Every order lands in
// shared memory as the same rows: only the loads differ (a split-K V is read 8 keys of one
// element at a time and stored transposed).
//
// Flash attention on tensor cores (WMMA, 16x16x16, f32 accumulation): one CTA per (tile of 64
// query tokens of one piece, query head), 4 warps of 16 query rows each. The CTA walks its
// keys 64 at a time: the K and V rows of the tile into shared memory (masked keys as zeros;
// the next tile's rows loaded into registers while this one is computed),
// S = Q K^T per warp on tensor cores, the online softmax per row in f32 (two lanes a row), and
// O += P V on tensor cores, O in registers (rescaled through shared memory in a tile where a
// row's max grew). Keys stop at the
// tile's last query position (causal), so early tiles of a piece read fewer keys.
//
// Bounds: a table entry at or past `num_blocks` counts as masked (contributes nothing), as in
// the decode kernel; the host checks that every piece's context fits its table's width.

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <mma.h>
#include <stdint.h>

using namespace nvcuda;

#define PF_WARPS 4
#define PF_M 64  // query rows per CTA (16 per warp)
#define PF_N 64  // keys per tile

__device__ __forceinline__ __half pf_from_float(float x, const __half*) { return __float2half(x); }
__device__ __forceinline__ __nv_bfloat16 pf_from_float(float x, const __nv_bfloat16*) {
    return __float2bfloat16(x);
}

// Shared memory: row strides padded (fewer bank conflicts) and every array and every fragment's
// first element 32-byte aligned, as WMMA loads and stores need.
template <typename T, int D>
struct PrefillSmem {
    static constexpr int LDT = D + 8;     // Q, K, V rows (T)
    static constexpr int LDS = PF_N + 4;  // scores (f32)
    static constexpr int LDP = PF_N + 8;  // probabilities (T)
    static constexpr int LDO = D + 4;     // output (f32)
    static constexpr size_t Q = 0;
    static constexpr size_t K = Q + sizeof(T) * PF_M * LDT;
    static constexpr size_t V = K + sizeof(T) * PF_N * LDT;
    static constexpr size_t S = V + sizeof(T) * PF_N * LDT;
    static constexpr size_t P = S + sizeof(float) * PF_M * LDS;
    static constexpr size_t O = P + sizeof(T) * PF_M * LDP;
    static constexpr size_t VALID = O + sizeof(float) * PF_M * LDO;
    static constexpr size_t BYTES = VALID + sizeof(int) * PF_N;
};

// Grid (tiles, heads), PF_WARPS * 32 threads, PrefillSmem::BYTES of dynamic shared memory.
// q, out [tokens, heads, D]; k, v [num_blocks, ...] in order ORD; table [pieces, width];
// tiles [tiles, 4]: (first row in q, position of that row, rows (1..=64), piece).
template <typename T, int D, int ORD>
__device__ void prefill(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
                        const uint32_t* __restrict__ table, const uint32_t* __restrict__ tiles,
                        T* __restrict__ out, uint32_t num_blocks, uint32_t bt, uint32_t kv_heads,
                        uint32_t width, float scale) {
    using L = PrefillSmem<T, D>;
    extern __shared__ __align__(128) unsigned char smem[];
    T* qs = reinterpret_cast<T*>(smem + L::Q);
    T* ks = reinterpret_cast<T*>(smem + L::K);
    T* vs = reinterpret_cast<T*>(smem + L::V);
    float* ss = reinterpret_cast<float*>(smem + L::S);
    T* ps = reinterpret_cast<T*>(smem + L::P);
    float* os = reinterpret_cast<float*>(smem + L::O);
    int* valid = reinterpret_cast<int*>(smem + L::VALID);
    const T* tag = nullptr;

    const uint32_t h = blockIdx.y, heads = gridDim.y;
    const uint32_t kvh = h / (heads / kv_heads);
    const uint32_t* td = tiles + (uint64_t)blockIdx.x * 4;
    const uint32_t row0 = td[0], pos0 = td[1], rows = td[2], piece = td[3];
    const uint32_t* tab = table + (uint64_t)piece * width;
    const uint32_t key_end = pos0 + rows;  // the last query sees keys 0..pos0 + rows - 1
    const uint32_t warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    constexpr int VEC = 8;         // elements per 16-byte load
    constexpr int CH = D / VEC;    // 16-byte pieces per row

    // The query tile (rows past the piece's as zeros).
    for (uint32_t x = threadIdx.x; x < PF_M * CH; x += blockDim.x) {
        const uint32_t r = x / CH, c = x % CH;
        uint4 val = make_uint4(0, 0, 0, 0);
        if (r < rows)
            val = *reinterpret_cast<const uint4*>(q + ((uint64_t)(row0 + r) * heads + h) * D + c * VEC);
        *reinterpret_cast<uint4*>(qs + r * L::LDT + c * VEC) = val;
    }
    __syncthreads();

    // Two lanes a row: this lane's row of the tile, the half of the keys (and of O) it takes.
    const uint32_t my_row = warp * 16 + lane / 2, half = lane % 2;
    const bool row_ok = my_row < rows;
    const uint32_t my_pos = pos0 + my_row;
    float m = -INFINITY, l = 0.f;
    // The warp's running output, 16 rows x D, in registers.
    wmma::fragment<wmma::accumulator, 16, 16, 16, float> of[D / 16];
#pragma unroll
    for (int n = 0; n < D / 16; n++) wmma::fill_fragment(of[n], 0.f);
    float* const ow = os + warp * 16 * L::LDO;  // the warp's rows of the staging area

    // A tile's K and V rows, each thread LOADS 16-byte pieces of each: the block ids first (all
    // of them, then all the rows: two round trips to memory, not one per piece), into
    // registers. A key past the end or in a block past the cache is masked and its rows zeros
    // (a zero times a zero weight: no NaN from what a block held).
    constexpr int LOADS = PF_N * CH / (PF_WARPS * 32);
    uint4 kr[LOADS], vr[LOADS];
    bool kok[LOADS];
    // Split K, blocks of a multiple of 8 tokens: a V piece is 8 keys (x / D) of element x % D,
    // one 16-byte load, stored transposed; otherwise a V piece is a key's 8 elements, read 2
    // bytes at a time where they lie bt apart.
    const bool v_runs = ORD == 2 && bt % VEC == 0;
    auto load = [&](uint32_t kb) {
        uint32_t blk[LOADS], vblk[LOADS];
#pragma unroll
        for (int i = 0; i < LOADS; i++) {
            const uint32_t x = threadIdx.x + i * PF_WARPS * 32, t = kb + x / CH;
            kok[i] = t < key_end;
            blk[i] = kok[i] ? tab[t / bt] : num_blocks;
            if (ORD == 2 && v_runs) {
                const uint32_t tv = kb + (x / D) * VEC;
                vblk[i] = tv < key_end ? tab[tv / bt] : num_blocks;
            }
        }
#pragma unroll
        for (int i = 0; i < LOADS; i++) {
            const uint32_t x = threadIdx.x + i * PF_WARPS * 32, t = kb + x / CH, c = x % CH;
            kok[i] = kok[i] && blk[i] < num_blocks;
            kr[i] = vr[i] = make_uint4(0, 0, 0, 0);
            const uint64_t o = t % bt;
            if (kok[i]) {
                if constexpr (ORD == 0) {
                    const uint64_t off = (((uint64_t)blk[i] * bt + o) * kv_heads + kvh) * D + c * VEC;
                    kr[i] = *reinterpret_cast<const uint4*>(k + off);
                    vr[i] = *reinterpret_cast<const uint4*>(v + off);
                } else if constexpr (ORD == 1) {
                    const uint64_t off = (((uint64_t)blk[i] * kv_heads + kvh) * bt + o) * D + c * VEC;
                    kr[i] = *reinterpret_cast<const uint4*>(k + off);
                    vr[i] = *reinterpret_cast<const uint4*>(v + off);
                } else {
                    const uint64_t hb = (uint64_t)blk[i] * kv_heads + kvh;
                    kr[i] = *reinterpret_cast<const uint4*>(k + ((hb * CH + c) * bt + o) * VEC);
                    if (!v_runs) {
                        const T* vp = v + (hb * D + c * VEC) * bt + o;
                        T e[VEC];
#pragma unroll
                        for (int j = 0; j < VEC; j++) e[j] = vp[(uint64_t)j * bt];
                        vr[i] = *reinterpret_cast<const uint4*>(e);
                    }
                }
            }
            if (ORD == 2 && v_runs) {
                // Keys kb + (x / D) * 8 .. + 8 of element x % D: one block (bt a multiple of
                // 8, kb of 64); keys past the end as zeros.
                const uint32_t tv = kb + (x / D) * VEC, d = x % D;
                if (vblk[i] < num_blocks) {
                    const uint64_t hb = (uint64_t)vblk[i] * kv_heads + kvh;
                    uint4 run = *reinterpret_cast<const uint4*>(v + (hb * D + d) * bt + tv % bt);
                    T* e = reinterpret_cast<T*>(&run);
#pragma unroll
                    for (int j = 0; j < VEC; j++)
                        if (tv + j >= key_end) e[j] = pf_from_float(0.f, tag);
                    vr[i] = run;
                }
            }
        }
    };
    load(0);
    for (uint32_t kb = 0; kb < key_end; kb += PF_N) {
        // This tile's rows into shared memory; then the next tile's loads are issued, in flight
        // while this one is computed (software pipelining).
#pragma unroll
        for (int i = 0; i < LOADS; i++) {
            const uint32_t x = threadIdx.x + i * PF_WARPS * 32, r = x / CH, c = x % CH;
            *reinterpret_cast<uint4*>(ks + r * L::LDT + c * VEC) = kr[i];
            if (ORD == 2 && v_runs) {
                const uint32_t run = x / D, d = x % D;
                const T* e = reinterpret_cast<const T*>(&vr[i]);
#pragma unroll
                for (int j = 0; j < VEC; j++) vs[(run * VEC + j) * L::LDT + d] = e[j];
            } else {
                *reinterpret_cast<uint4*>(vs + r * L::LDT + c * VEC) = vr[i];
            }
            if (c == 0) valid[r] = kok[i];
        }
        __syncthreads();
        if (kb + PF_N < key_end) load(kb + PF_N);

        // S = Q K^T for the warp's 16 rows: K rows in shared memory are K^T column-major. Q's
        // fragments come from shared memory each tile (registers hold the output instead).
        wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc[PF_N / 16];
#pragma unroll
        for (int n = 0; n < PF_N / 16; n++) wmma::fill_fragment(acc[n], 0.f);
#pragma unroll
        for (int kk = 0; kk < D / 16; kk++) {
            wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::row_major> qa;
            wmma::load_matrix_sync(qa, qs + warp * 16 * L::LDT + kk * 16, L::LDT);
#pragma unroll
            for (int n = 0; n < PF_N / 16; n++) {
                wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::col_major> kf;
                wmma::load_matrix_sync(kf, ks + n * 16 * L::LDT + kk * 16, L::LDT);
                wmma::mma_sync(acc[n], qa, kf, acc[n]);
            }
        }
#pragma unroll
        for (int n = 0; n < PF_N / 16; n++)
            wmma::store_matrix_sync(ss + warp * 16 * L::LDS + n * 16, acc[n], L::LDS, wmma::mem_row_major);
        __syncwarp();

        // Online softmax of the row, in f32: this lane's 32 keys, the pair's max and sum.
        const float* srow = ss + my_row * L::LDS + half * (PF_N / 2);
        T* prow = ps + my_row * L::LDP + half * (PF_N / 2);
        // Two passes over the scores in shared memory (the max, then the weights) rather than
        // 32 registers a lane holding them.
        auto score = [&](int j) {
            const uint32_t c = half * (PF_N / 2) + j;
            const bool ok = row_ok && valid[c] && kb + c <= my_pos;
            return ok ? srow[j] * scale : -INFINITY;
        };
        float tmax = -INFINITY;
#pragma unroll
        for (int j = 0; j < PF_N / 2; j++) tmax = fmaxf(tmax, score(j));
        tmax = fmaxf(tmax, __shfl_xor_sync(0xffffffffu, tmax, 1));
        const float mn = fmaxf(m, tmax);
        // Nothing seen yet (mn still -inf): weights 0 and O unchanged.
        const float alpha = mn == -INFINITY ? 1.f : __expf(m - mn);
        float sum = 0.f;
#pragma unroll
        for (int j = 0; j < PF_N / 2; j++) {
            const float x = score(j);
            const float p = x == -INFINITY ? 0.f : __expf(x - mn);
            sum += p;
            prow[j] = pf_from_float(p, tag);
        }
        sum += __shfl_xor_sync(0xffffffffu, sum, 1);
        l = l * alpha + sum;
        m = mn;
        // A row whose max grew rescales its output: the warp's O goes through shared memory
        // (a fragment's element-to-row map is the hardware's), only in tiles where one did.
        if (__any_sync(0xffffffffu, alpha != 1.f)) {
#pragma unroll
            for (int n = 0; n < D / 16; n++)
                wmma::store_matrix_sync(ow + n * 16, of[n], L::LDO, wmma::mem_row_major);
            __syncwarp();
            float* orow = os + my_row * L::LDO + half * (D / 2);
#pragma unroll 8
            for (int d = 0; d < D / 2; d++) orow[d] *= alpha;
            __syncwarp();
#pragma unroll
            for (int n = 0; n < D / 16; n++)
                wmma::load_matrix_sync(of[n], ow + n * 16, L::LDO, wmma::mem_row_major);
        }
        __syncwarp();

        // O += P V for the warp's rows.
        wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::row_major> pa[PF_N / 16];
#pragma unroll
        for (int kk = 0; kk < PF_N / 16; kk++)
            wmma::load_matrix_sync(pa[kk], ps + warp * 16 * L::LDP + kk * 16, L::LDP);
#pragma unroll
        for (int n = 0; n < D / 16; n++) {
#pragma unroll
            for (int kk = 0; kk < PF_N / 16; kk++) {
                wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::row_major> vb;
                wmma::load_matrix_sync(vb, vs + kk * 16 * L::LDT + n * 16, L::LDT);
                wmma::mma_sync(of[n], pa[kk], vb, of[n]);
            }
        }
        // Every warp is done with this tile's K, V and mask before the next overwrites them.
        __syncthreads();
    }

    // Normalised rows out; a row that attended over nothing (no valid key) gets zeros.
#pragma unroll
    for (int n = 0; n < D / 16; n++)
        wmma::store_matrix_sync(ow + n * 16, of[n], L::LDO, wmma::mem_row_major);
    __syncwarp();
    if (row_ok) {
        const float inv = l > 0.f ? 1.f / l : 0.f;
        const float* orow = os + my_row * L::LDO + half * (D / 2);
        T* dst = out + ((uint64_t)(row0 + my_row) * heads + h) * D + half * (D / 2);
#pragma unroll 8
        for (int d = 0; d < D / 2; d++) dst[d] = pf_from_float(orow[d] * inv, tag);
    }
}

#define PREFILL(NAME, T, D, ORD)                                                                \
    extern "C" __global__ void __launch_bounds__(PF_WARPS * 32) NAME(                          \
        const T* q, const T* k, const T* v, const uint32_t* table, const uint32_t* tiles,      \
        T* out, uint32_t num_blocks, uint32_t bt, uint32_t kv_heads, uint32_t width,           \
        float scale) {                                                                         \
        prefill<T, D, ORD>(q, k, v, table, tiles, out, num_blocks, bt, kv_heads, width, scale); \
    }

#define PREFILL_ORDER(SUFFIX, ORD)                                                          \
    PREFILL(evmm_paged_prefill_f16_d64##SUFFIX, __half, 64, ORD)                            \
    PREFILL(evmm_paged_prefill_f16_d128##SUFFIX, __half, 128, ORD)                          \
    PREFILL(evmm_paged_prefill_bf16_d64##SUFFIX, __nv_bfloat16, 64, ORD)                    \
    PREFILL(evmm_paged_prefill_bf16_d128##SUFFIX, __nv_bfloat16, 128, ORD)

PREFILL_ORDER(, 0)
PREFILL_ORDER(_head_major, 1)
PREFILL_ORDER(_split_k, 2)
