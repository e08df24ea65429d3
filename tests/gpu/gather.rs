//! The gather kernel on its own (`Backend::gather_async` of the CUDA backend): pieces of 1, 3,
//! 17 and 1000 bytes and larger, at odd addresses, with source and destination aligned alike
//! or differently modulo 16 (every word width the kernel has), pieces far larger than the
//! 64 KiB a p2p copy splits to, many shifts; every byte of the destination checked against
//! the same copies done on the host, bytes not copied to included.

use std::sync::Arc;

use elastic_vmm::backend::cuda::CudaBackend;
use elastic_vmm::backend::{GatherPiece, GatherShift};
use elastic_vmm::{Backend, Pool, PoolConfig};

const LEN: usize = 32 << 20;

fn bytes(seed: u64, len: usize) -> Vec<u8> {
    let mut x = seed | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

/// Pieces whose destinations never overlap: each piece gets its own slot of `slot` bytes per
/// shift, at a destination offset inside the slot chosen for the alignment case.
fn pieces(slot: u64) -> Vec<GatherPiece> {
    let mut v = Vec::new();
    let mut at = 0u64;
    // (source offset, destination offset in its slot, length): every (dst - src) mod 16 case
    // and unaligned heads and tails.
    let cases: [(u64, u64, u64); 14] = [
        (0, 0, 1),
        (1, 1, 3),
        (7, 3, 17),
        (33, 1, 1000),
        (16, 0, 4096),
        (8, 0, 4104),    // dst - src = 8 mod 16: 8-byte words
        (4, 0, 999),     // 4-byte words
        (2, 0, 1001),    // 2-byte words
        (5, 0, 2049),    // bytes
        (3, 11, 70_001), // crosses 64 KiB, same misalignment on both sides
        (0, 0, 200_000), // larger than a p2p piece
        (9, 2, 131_075), // crosses 64 KiB, byte path
        (12, 4, 65_536), // exactly 64 KiB, 16-byte words after the head
        (100, 100, 31),
    ];
    for (src, dst, len) in cases {
        assert!(dst + len <= slot);
        v.push(GatherPiece {
            src,
            dst: at + dst,
            len,
        });
        at += slot;
    }
    v
}

fn run(stream_kind: &str) {
    let backend: Arc<dyn Backend> = Arc::new(CudaBackend::new(0).expect("CUDA device 0"));
    let pool = Pool::new(backend.clone(), PoolConfig::new(1 << 30).name("gather")).unwrap();
    let src = pool.allocate(LEN).unwrap();
    let dst = pool.allocate(LEN).unwrap();
    let data = bytes(7, LEN);
    let before = bytes(11, LEN);
    // SAFETY: both allocations are mapped and used by nothing else.
    unsafe {
        backend.write(src.addr(), &data).unwrap();
        backend.write(dst.addr(), &before).unwrap();
    }
    let slot = 256 << 10;
    let pieces = pieces(slot);
    let per_shift = pieces.len() as u64 * slot;
    // Shifts: sources at odd distances, destinations one slot row apart.
    let shifts: Vec<GatherShift> = (0..5u64)
        .map(|i| GatherShift {
            src: src.addr() + i * 300_007,
            dst: dst.addr() + i * per_shift,
        })
        .collect();
    assert!(5 * per_shift <= LEN as u64);
    let mut expect = before.clone();
    for h in &shifts {
        for p in &pieces {
            let s = (h.src + p.src - src.addr()) as usize;
            let d = (h.dst + p.dst - dst.addr()) as usize;
            expect[d..d + p.len as usize].copy_from_slice(&data[s..s + p.len as usize]);
        }
    }
    let ctx = cudarc::driver::CudaContext::new(0).unwrap();
    let own = ctx.new_stream().unwrap();
    let stream = match stream_kind {
        "legacy" => 1,
        _ => own.cu_stream() as u64,
    };
    // SAFETY: every copy reads `src` and writes `dst` (both mapped, with access, until the
    // stream is synchronized below); destinations do not overlap one another or any source.
    unsafe { backend.gather_async(&pieces, &shifts, stream).unwrap() };
    backend.synchronize(stream).unwrap();
    let mut got = vec![0u8; LEN];
    // SAFETY: mapped, and the copies completed.
    unsafe { backend.read(dst.addr(), &mut got).unwrap() };
    if let Some(i) = got.iter().zip(&expect).position(|(a, b)| a != b) {
        panic!(
            "byte {i} of the destination is {:#04x}, expected {:#04x} ({stream_kind} stream)",
            got[i], expect[i]
        );
    }
    // Nothing to do is nothing queued.
    // SAFETY: no copies.
    unsafe { backend.gather_async(&[], &shifts, stream).unwrap() };
}

#[test]
fn gather_kernel_is_byte_exact_on_its_own_stream() {
    run("own");
}

#[test]
fn gather_kernel_is_byte_exact_on_the_legacy_stream() {
    run("legacy");
}
