//! The gather kernel on its own (`Copies::gather_async` of the CUDA backend): pieces of 1, 3,
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
        backend.copies().write(src.addr(), &data).unwrap();
        backend.copies().write(dst.addr(), &before).unwrap();
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
    unsafe {
        backend
            .copies()
            .gather_async(&pieces, &shifts, stream)
            .unwrap()
    };
    backend.copies().synchronize(stream).unwrap();
    let mut got = vec![0u8; LEN];
    // SAFETY: mapped, and the copies completed.
    unsafe { backend.copies().read(dst.addr(), &mut got).unwrap() };
    if let Some(i) = got.iter().zip(&expect).position(|(a, b)| a != b) {
        panic!(
            "byte {i} of the destination is {:#04x}, expected {:#04x} ({stream_kind} stream)",
            got[i], expect[i]
        );
    }
    // Nothing to do is nothing queued.
    // SAFETY: no copies.
    unsafe { backend.copies().gather_async(&[], &shifts, stream).unwrap() };
}

#[test]
fn gather_kernel_is_byte_exact_on_its_own_stream() {
    run("own");
}

#[test]
fn gather_kernel_is_byte_exact_on_the_legacy_stream() {
    run("legacy");
}

/// The kernel's descriptors go through reused pinned buffers, each free again only once the
/// launch that read it completed. Many threads queue many launches each, back to back on their
/// own streams without waiting, so buffers are still being read when the next launch wants
/// one (more launches in flight than buffers: the pool path too); every launch has its own
/// descriptors and its own destination, so a buffer overwritten too early shows as bytes
/// copied from the wrong place.
#[test]
fn gather_descriptors_are_not_reused_while_a_launch_reads_them() {
    const THREADS: u64 = 8;
    const ROUNDS: u64 = 12;
    const SHIFTS: u64 = 64;
    const PIECE: u64 = 64 << 10;
    const SRC: usize = 64 << 20;
    let per_round = SHIFTS * PIECE;
    let cuda = Arc::new(CudaBackend::new(0).expect("CUDA device 0"));
    let backend: Arc<dyn Backend> = cuda.clone();
    let pool = Pool::new(
        backend.clone(),
        PoolConfig::new(2 << 30).name("gather-reuse"),
    )
    .unwrap();
    let src = pool.allocate(SRC).unwrap();
    let dst = pool
        .allocate((THREADS * ROUNDS * per_round) as usize)
        .unwrap();
    // Each thread first queues copies into its own scratch, so that its stream is busy while
    // its launches are queued: their buffers are all still unread when the next one is taken.
    let scratch = pool.allocate(THREADS as usize * SRC).unwrap();
    let data = bytes(23, SRC);
    // SAFETY: mapped and used by nothing else.
    unsafe { backend.copies().write(src.addr(), &data).unwrap() };
    // Round r of thread t copies 64 KiB pieces from pseudo-random 16-byte aligned sources.
    let source = |t: u64, r: u64, k: u64| {
        let mut x = (t * 1_000_003 + r * 7919 + k * 104_729) | 1;
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        (x % ((SRC as u64 - PIECE) / 16)) * 16
    };
    let region = |t: u64, r: u64| (t * ROUNDS + r) * per_round;
    let ctx = cudarc::driver::CudaContext::new(0).unwrap();
    std::thread::scope(|s| {
        for t in 0..THREADS {
            let (backend, ctx) = (&backend, &ctx);
            let (src, dst) = (src.addr(), dst.addr());
            let scratch = scratch.addr() + t * SRC as u64;
            s.spawn(move || {
                let stream = ctx.new_stream().unwrap();
                let raw = stream.cu_stream() as u64;
                let piece = [GatherPiece {
                    src: 0,
                    dst: 0,
                    len: PIECE,
                }];
                for _ in 0..4 {
                    // SAFETY: `src` and this thread's scratch are mapped until the stream is
                    // synchronized below; nothing else writes the scratch.
                    unsafe { backend.copies().copy_async(scratch, src, SRC, raw).unwrap() };
                }
                for r in 0..ROUNDS {
                    let shifts: Vec<GatherShift> = (0..SHIFTS)
                        .map(|k| GatherShift {
                            src: src + source(t, r, k),
                            dst: dst + region(t, r) + k * PIECE,
                        })
                        .collect();
                    // SAFETY: sources and destinations are mapped until the stream is
                    // synchronized below; destinations are this launch's own region.
                    unsafe { backend.copies().gather_async(&piece, &shifts, raw).unwrap() };
                }
                backend.copies().synchronize(raw).unwrap();
            });
        }
    });
    // Both paths ran: pinned buffers, and the pool once all of them were busy.
    let uploads = cuda.gather_uploads();
    assert_eq!(
        uploads.pinned + uploads.pooled,
        THREADS * ROUNDS,
        "{uploads:?}"
    );
    assert!(uploads.pinned > 0 && uploads.pooled > 0, "{uploads:?}");
    assert!(uploads.slots <= 8, "{uploads:?}");
    let mut got = vec![0u8; (THREADS * ROUNDS * per_round) as usize];
    // SAFETY: mapped, and every stream was synchronized.
    unsafe { backend.copies().read(dst.addr(), &mut got).unwrap() };
    for t in 0..THREADS {
        for r in 0..ROUNDS {
            for k in 0..SHIFTS {
                let s = source(t, r, k) as usize;
                let d = (region(t, r) + k * PIECE) as usize;
                if got[d..d + PIECE as usize] != data[s..s + PIECE as usize] {
                    panic!("thread {t}, round {r}, piece {k}: wrong bytes (descriptors of another launch?)");
                }
            }
        }
    }
}
