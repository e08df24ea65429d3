//! Block moves between two engines, written once for any backend: the host process tests
//! (`tests/processes/p2p.rs`) and the GPU tests (`tests/gpu/p2p.rs`) run these scenarios with
//! a real second process at the other end of the link.

#![allow(dead_code)]

use std::sync::Arc;
use std::time::Duration;

use elastic_vmm::layout::{BlockDim, ElasticLayout, LayoutBuilder, LayoutConfig, LayoutKind};
use elastic_vmm::p2p::{CopyEngine, CopyStream, EngineChoice, GrantStatus, PeerLink, TransferPath};
use elastic_vmm::{AccessMode, Backend, Error, MemOptions, Pool, PoolConfig};

/// Every kind a layout can have, in the order both sides walk them.
pub const KINDS: [LayoutKind; 3] = [
    LayoutKind::FullyContiguous,
    LayoutKind::LayerSeparate(BlockDim::First),
    LayoutKind::LayerSeparate(BlockDim::Second),
];
/// The sender's blocks granted, and the receiver's blocks they land in (by position).
pub const SRC_BLOCKS: [usize; 6] = [3, 4, 5, 10, 40, 63];
pub const DST_BLOCKS: [usize; 6] = [0, 1, 2, 7, 8, 15];
/// Blocks in the sender's and the receiver's layouts.
pub const SRC_COUNT: usize = 64;
pub const DST_COUNT: usize = 16;
pub const WAIT: Duration = Duration::from_secs(30);

/// 4 layers, K and V, 16 tokens of `inner` 2-byte elements: `inner = 512` gives 16 KiB units
/// and 128 KiB blocks.
pub fn config(num_blocks: usize, inner: usize) -> LayoutConfig {
    LayoutConfig::new(num_blocks, 4, 2, 16, inner, 2)
}

pub fn pool(backend: Arc<dyn Backend>, name: &str) -> Pool {
    Pool::new(backend, PoolConfig::new(8 << 30).name(name)).expect("pool")
}

pub fn layout(pool: &Pool, kind: LayoutKind, cfg: LayoutConfig) -> ElasticLayout {
    LayoutBuilder::new()
        .config(cfg)
        .kind(kind)
        .elastic(pool, &MemOptions::new())
        .build()
        .expect("layout")
}

/// The bytes block `block` holds in round `seed`, its spans in order.
pub fn pattern(seed: u64, block: usize, len: usize) -> Vec<u8> {
    let mut x = seed
        .wrapping_mul(0x9e37_79b9_7f4a_7c15)
        .wrapping_add(block as u64 + 1);
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

fn block_len(kv: &ElasticLayout, block: usize) -> usize {
    kv.block(block)
        .expect("block views")
        .iter()
        .map(|v| v.len as usize)
        .sum()
}

/// Write the pattern of `(seed, block)` into `block` (backed).
pub fn fill(kv: &ElasticLayout, block: usize, seed: u64) {
    let data = pattern(seed, block, block_len(kv, block));
    let mut at = 0;
    for v in kv.block(block).expect("views") {
        // SAFETY: the block is backed and nothing else uses it in these tests.
        unsafe { kv.write(v.addr, &data[at..at + v.len as usize]) }.expect("write");
        at += v.len as usize;
    }
}

/// Wait until writes queued on the device have landed (a host-to-device copy from pageable
/// memory may return before its DMA finished): a grant promises complete bytes.
pub fn settle(backend: &Arc<dyn Backend>) {
    if backend.info().memory_kind == elastic_vmm::MemoryKind::Device {
        backend.copies().synchronize(1).expect("synchronize");
    }
}

/// The bytes of `block`, spans in order.
pub fn contents(kv: &ElasticLayout, block: usize) -> Vec<u8> {
    let mut out = vec![0u8; block_len(kv, block)];
    let mut at = 0;
    for v in kv.block(block).expect("views") {
        // SAFETY: the block is backed and nobody writes it meanwhile.
        unsafe { kv.read(v.addr, &mut out[at..at + v.len as usize]) }.expect("read");
        at += v.len as usize;
    }
    out
}

/// Prefill: for every kind, back and write the granted blocks, grant them read-only, wait
/// until the receiver let go, then release them (which the pins refused before).
pub fn prefill(link: &PeerLink, backend: Arc<dyn Backend>, inner: usize) {
    assert_eq!(
        link.path().path,
        TransferPath::PeerImport,
        "{:?}",
        link.path()
    );
    let pool = pool(backend.clone(), "prefill");
    for (round, kind) in KINDS.into_iter().enumerate() {
        let kv = layout(&pool, kind, config(SRC_COUNT, inner));
        // An unbacked block is refused before anything is exported or sent.
        let e = link
            .grant(&kv, &SRC_BLOCKS, AccessMode::ReadOnly)
            .unwrap_err()
            .to_string();
        assert!(e.contains("block 3 is not backed"), "{e}");
        assert_eq!(link.stats().grants_out, 0);
        kv.ensure_backed(SRC_BLOCKS).expect("back");
        for b in SRC_BLOCKS {
            fill(&kv, b, round as u64);
        }
        settle(&backend);
        let g = link
            .grant(&kv, &SRC_BLOCKS, AccessMode::ReadOnly)
            .expect("grant");
        assert!(g.bytes() > 0);
        // Pinned for the peer: no release until it let go (which a fast peer may have done
        // already: the status is final before the pins go).
        match kv.release([SRC_BLOCKS[0]]) {
            Err(Error::BlockPinned { holder, .. }) => {
                assert!(holder.contains("p2p grant"), "{holder}")
            }
            Ok(_) => {
                assert!(g.status().is_final(), "released while held");
                kv.ensure_backed([SRC_BLOCKS[0]]).expect("back again");
            }
            other => panic!("release of a granted block: {other:?}"),
        }
        assert_eq!(
            g.wait_released(WAIT).expect("released"),
            GrantStatus::Released
        );
        assert_eq!(link.stats().grants_out, 0);
        kv.release(SRC_BLOCKS).expect("released after the grant");
    }
}

/// Decode: for every kind, refuse bad input before any copy, then copy the granted blocks into
/// its own layout (fewer blocks, other indices) on `stream` with `engine` and check every byte.
pub fn decode(
    link: &PeerLink,
    backend: Arc<dyn Backend>,
    inner: usize,
    stream: CopyStream,
    engine: EngineChoice,
) {
    assert_eq!(
        link.path().path,
        TransferPath::PeerImport,
        "{:?}",
        link.path()
    );
    let backend_kind = backend.info().memory_kind;
    let pool = pool(backend, "decode");
    for (round, kind) in KINDS.into_iter().enumerate() {
        let g = link.recv_grant(WAIT).expect("grant");
        assert_eq!(g.blocks(), SRC_BLOCKS);
        assert_eq!(g.kind(), kind);
        assert!(link.stats().imported_bytes >= g.bytes());
        let kv = layout(&pool, kind, config(DST_COUNT, inner));
        // Destination blocks not backed: refused, nothing copied.
        let e = g
            .copy_into(&kv, &DST_BLOCKS, stream)
            .unwrap_err()
            .to_string();
        assert!(e.contains("is not backed"), "{e}");
        kv.ensure_backed(DST_BLOCKS).expect("back");
        kv.ensure_backed([3]).expect("back a neighbour");
        fill(&kv, 3, 1000);
        // Another block size, another kind, another count: refused before any copy.
        let other = layout(&pool, kind, config(DST_COUNT, inner * 2));
        other.ensure_backed(DST_BLOCKS).expect("back");
        match g.copy_into(&other, &DST_BLOCKS, stream) {
            Err(Error::LayoutMismatch { detail }) => assert!(detail.contains("bytes"), "{detail}"),
            other => panic!("block size mismatch: {other:?}"),
        }
        let other_kind = layout(&pool, KINDS[(round + 1) % 3], config(DST_COUNT, inner));
        other_kind.ensure_backed(DST_BLOCKS).expect("back");
        assert!(matches!(
            g.copy_into(&other_kind, &DST_BLOCKS, stream),
            Err(Error::LayoutMismatch { .. })
        ));
        assert!(matches!(
            g.copy_into(&kv, &DST_BLOCKS[..5], stream),
            Err(Error::LayoutMismatch { .. })
        ));
        let len = contents(&kv, DST_BLOCKS[0]).len();
        let done = g
            .copy_into_with(&kv, &DST_BLOCKS, stream, engine)
            .expect("copy");
        // The destination is pinned until the copy completed.
        assert!(matches!(
            kv.release([DST_BLOCKS[1]]),
            Err(Error::BlockPinned { .. })
        ));
        let report = done.wait().expect("completion");
        assert_eq!(report.path, TransferPath::PeerImport);
        assert_eq!(report.blocks, SRC_BLOCKS.len());
        match (backend_kind, engine) {
            (elastic_vmm::MemoryKind::Host, _) => assert_eq!(report.engine, CopyEngine::Cpu),
            (_, EngineChoice::Kernel) => {
                assert_eq!((report.engine, report.launches), (CopyEngine::Kernel, 1))
            }
            (_, EngineChoice::Memcpy) => assert_eq!(report.engine, CopyEngine::Memcpy),
            (_, EngineChoice::Auto) => {}
        }
        println!("{kind}: {report:?}");
        match kind {
            // Blocks 3, 4, 5 land in 0, 1, 2: one copy for the run.
            LayoutKind::FullyContiguous => assert_eq!(report.copies, 4, "{report:?}"),
            _ => assert!(report.copies < report.spans, "{report:?}"),
        }
        for (s, d) in SRC_BLOCKS.into_iter().zip(DST_BLOCKS) {
            assert!(
                contents(&kv, d) == pattern(round as u64, s, len),
                "block {s} -> {d} differs ({kind})"
            );
        }
        // Bytes next to the destination were not touched.
        assert!(
            contents(&kv, 3) == pattern(1000, 3, len),
            "a neighbour was overwritten"
        );
        drop(g);
        assert_eq!(link.stats().imports, 0);
        assert_eq!(link.stats().imported_bytes, 0);
        kv.release(DST_BLOCKS).expect("release after the copy");
    }
    assert_eq!(link.stats().transfers, KINDS.len() as u64);
}

/// Blocks of 2 MiB (whole pages of the default granularity): 4 layers, K and V, 16 tokens of
/// 8192 2-byte elements.
pub fn page_config(num_blocks: usize) -> LayoutConfig {
    LayoutConfig::new(num_blocks, 4, 2, 16, 8192, 2)
}

/// Hand-off, sending side: blocks 2 and 5 go to the peer without a copy; afterwards they are
/// released here, their chunks let go (not cached), and nothing was created on the way.
pub fn hand_off_sender(link: &PeerLink, backend: Arc<dyn Backend>) {
    let pool = pool(backend.clone(), "prefill");
    let kv = layout(&pool, LayoutKind::FullyContiguous, page_config(8));
    kv.ensure_backed([2, 5]).expect("back");
    fill(&kv, 2, 7);
    fill(&kv, 5, 7);
    settle(&backend);
    let g = link.hand_off(&kv, &[2, 5]).expect("hand off");
    assert_eq!(
        g.wait_released(WAIT).expect("adopted"),
        GrantStatus::HandedOff
    );
    assert!(!kv.is_backed(2) && !kv.is_backed(5));
    let st = pool.stats();
    assert_eq!((st.mapped, st.cached), (0, 0), "{st:?}");
    assert_eq!(link.stats().grants_out, 0);
}

/// Hand-off, receiving side: the chunks become blocks 0 and 1 here, charged to this pool,
/// every byte as the sender wrote it, no chunk created.
pub fn hand_off_receiver(link: &PeerLink, backend: Arc<dyn Backend>) {
    let pool = pool(backend, "decode");
    let kv = layout(&pool, LayoutKind::FullyContiguous, page_config(4));
    let g = link.recv_grant(WAIT).expect("grant");
    let before = pool.stats().driver_calls;
    let change = g.adopt_into(&kv, &[0, 1]).expect("adopt");
    assert_eq!(change.blocks, 2);
    assert_eq!(
        pool.stats()
            .driver_calls
            .since(&before)
            .get(elastic_vmm::DriverCall::Create),
        0
    );
    assert!(pool.stats().mapped >= 4 << 20);
    for (s, d) in [(2, 0), (5, 1)] {
        let got = contents(&kv, d);
        assert!(got == pattern(7, s, got.len()), "block {s} -> {d} differs");
    }
    assert_eq!(link.stats().imports, 0);
    kv.release([0, 1]).expect("release");
}
