// Gather copy for elastic-vmm's p2p moves (src/p2p/copy.rs builds the plan, src/backend/cuda.rs
// launches it). Compiled to PTX by scripts/gen-ptx.sh; the PTX is committed next to this file
// and embedded in the crate, so building the crate needs no CUDA compiler.
//
// The work is a pattern of pieces shifted once per block:
//   task t = (block i, piece j), i = t / npieces, j = t % npieces
//   copy pieces[j].len bytes from shifts[i].src + pieces[j].src to shifts[i].dst + pieces[j].dst
// Addresses wrap modulo 2^64 (the host computes shifts with wrapping arithmetic and checks the
// sums). A plain list of copies is the same thing with one shift of (0, 0).
//
// One warp per task, tasks taken in a grid-stride loop. Each task copies with the widest word
// (16, 8, 4, 2 or 1 bytes) that source and destination share an alignment for: the bytes before
// the destination's first aligned word and after its last are copied one by one, by lanes.
// Source and destination of a launch never overlap (the host's contract).

#include <stdint.h>

struct Piece {
    uint64_t src;
    uint64_t dst;
    uint64_t len;
};

struct Shift {
    uint64_t src;
    uint64_t dst;
};

// Copy `len` bytes with words of type T: `d` and `s` are equally aligned modulo sizeof(T).
template <typename T>
__device__ __forceinline__ void copy_words(unsigned char* __restrict__ d,
                                           const unsigned char* __restrict__ s, uint64_t len,
                                           unsigned lane) {
    const uint64_t w = sizeof(T);
    uint64_t head = (w - ((uintptr_t)d & (w - 1))) & (w - 1);
    if (head > len) {
        head = len;
    }
    if (lane < head) {
        d[lane] = s[lane];
    }
    d += head;
    s += head;
    len -= head;
    const uint64_t n = len / w;
    T* __restrict__ dv = reinterpret_cast<T*>(d);
    const T* __restrict__ sv = reinterpret_cast<const T*>(s);
    uint64_t i = lane;
    // Four loads in flight per lane before their stores.
    for (; i + 96 < n; i += 128) {
        T a = sv[i];
        T b = sv[i + 32];
        T c = sv[i + 64];
        T e = sv[i + 96];
        dv[i] = a;
        dv[i + 32] = b;
        dv[i + 64] = c;
        dv[i + 96] = e;
    }
    // At most three words left per lane: two loads in flight before their stores, so short
    // pieces (a layer's 1 KiB span of a small block) overlap their loads too.
    if (i + 32 < n) {
        T a = sv[i];
        T b = sv[i + 32];
        dv[i] = a;
        dv[i + 32] = b;
        i += 64;
    }
    if (i < n) {
        dv[i] = sv[i];
    }
    const uint64_t done = n * w;
    const uint64_t tail = len - done;
    if (lane < tail) {
        d[done + lane] = s[done + lane];
    }
}

__device__ __forceinline__ void warp_copy(uint64_t dst, uint64_t src, uint64_t len, unsigned lane) {
    unsigned char* d = reinterpret_cast<unsigned char*>(dst);
    const unsigned char* s = reinterpret_cast<const unsigned char*>(src);
    const unsigned mis = (unsigned)((dst ^ src) & 15);
    if (mis == 0) {
        copy_words<uint4>(d, s, len, lane);
    } else if ((mis & 7) == 0) {
        copy_words<uint2>(d, s, len, lane);
    } else if ((mis & 3) == 0) {
        copy_words<unsigned int>(d, s, len, lane);
    } else if ((mis & 1) == 0) {
        copy_words<unsigned short>(d, s, len, lane);
    } else {
        for (uint64_t i = lane; i < len; i += 32) {
            d[i] = s[i];
        }
    }
}

extern "C" __global__ void __launch_bounds__(256, 4)
evmm_gather(const Piece* __restrict__ pieces, uint32_t npieces, const Shift* __restrict__ shifts,
            uint64_t ntasks) {
    const unsigned lane = threadIdx.x & 31;
    const uint64_t warp = ((uint64_t)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    const uint64_t warps = ((uint64_t)gridDim.x * blockDim.x) >> 5;
    for (uint64_t t = warp; t < ntasks; t += warps) {
        const uint64_t i = t / npieces;
        const uint32_t j = (uint32_t)(t - i * npieces);
        const Piece p = pieces[j];
        const Shift h = shifts[i];
        warp_copy(h.dst + p.dst, h.src + p.src, p.len, lane);
    }
}
