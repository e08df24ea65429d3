//! Blocks granted between two links of one process over a socket pair (real memfd chunks,
//! exported, imported and mapped again): bad input, revokes, and grants racing releases.

use std::os::fd::OwnedFd;
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use elastic_vmm::backend::host::{ChunkFiles, HostBackend, DEFAULT_GRANULARITY};
use elastic_vmm::backend::testing::DelayInjector;
use elastic_vmm::backend::testing::FaultInjector;
use elastic_vmm::backend::{BackendInfo, Copies, MemoryInfo, PhysicalChunk};
use elastic_vmm::layout::{ElasticLayout, LayoutBuilder, LayoutConfig};
use elastic_vmm::p2p::{CopyStream, GrantStatus, PeerLink, Peers, TransferPath};
use elastic_vmm::{
    AccessMode, Backend, DeviceReach, DriverCall, Error, MemOptions, MemoryKind, Pool, PoolConfig,
    Result,
};

fn exportable() -> Arc<dyn Backend> {
    Arc::new(HostBackend::with_chunk_files(DEFAULT_GRANULARITY, ChunkFiles::PerChunk).unwrap())
}

/// Two links of one process: (sender "prefill", receiver "decode").
fn pair(a: Arc<dyn Backend>, b: Arc<dyn Backend>) -> (PeerLink, PeerLink) {
    let (x, y) = UnixStream::pair().unwrap();
    let t = std::thread::spawn(move || PeerLink::over(y, "decode", b).unwrap());
    let p = PeerLink::over(x, "prefill", a).unwrap();
    (p, t.join().unwrap())
}

fn kv(backend: Arc<dyn Backend>, blocks: usize) -> (Pool, ElasticLayout) {
    let pool = Pool::new(backend, PoolConfig::new(1 << 30).name("p2p")).unwrap();
    let kv = LayoutBuilder::new()
        .config(LayoutConfig::new(blocks, 2, 2, 16, 256, 2))
        .fully_contiguous()
        .elastic(&pool, &MemOptions::new())
        .build()
        .unwrap();
    (pool, kv)
}

#[test]
fn unknown_peer_and_unexportable_memory_are_refused() {
    let (p, d) = pair(exportable(), exportable());
    assert_eq!(p.path().path, TransferPath::PeerImport);
    let mut peers = Peers::new();
    peers.add(p).unwrap();
    let (_pool, layout) = kv(exportable(), 8);
    layout.ensure_backed([0, 1]).unwrap();
    match peers.grant("nobody", &layout, &[0], AccessMode::ReadOnly) {
        Err(Error::UnknownPeer { name, known }) => {
            assert_eq!(name, "nobody");
            assert_eq!(known, vec!["decode".to_string()]);
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(layout.stats().pinned_blocks, 0, "nothing pinned");
    let g = peers
        .grant("decode", &layout, &[0, 1], AccessMode::ReadOnly)
        .unwrap();
    assert_eq!(g.blocks(), 2);
    // Out of range and empty: refused, nothing pinned beyond the grant's own.
    let e = peers
        .grant("decode", &layout, &[8], AccessMode::ReadOnly)
        .unwrap_err()
        .to_string();
    assert!(e.contains("block 8 does not exist"), "{e}");
    assert!(peers
        .grant("decode", &layout, &[], AccessMode::ReadOnly)
        .is_err());
    drop(d.recv_grant(Duration::from_secs(5)).unwrap());
    assert_eq!(
        g.wait_released(Duration::from_secs(5)).unwrap(),
        GrantStatus::Released
    );

    // A backend whose chunks share one memfd cannot export; the path choice says so too.
    let shared: Arc<dyn Backend> = Arc::new(HostBackend::new(DEFAULT_GRANULARITY).unwrap());
    let (p, _d) = pair(shared.clone(), exportable());
    assert_eq!(p.path().path, TransferPath::Nixl);
    assert!(
        p.path().reason.contains("sender's backend"),
        "{:?}",
        p.path()
    );
    let (_pool, layout) = kv(shared, 8);
    layout.ensure_backed([0]).unwrap();
    let e = p
        .grant(&layout, &[0], AccessMode::ReadOnly)
        .unwrap_err()
        .to_string();
    assert!(e.contains("PerChunk"), "{e}");
    assert_eq!(layout.stats().pinned_blocks, 0);
}

#[test]
fn revoke_before_and_after_import() {
    let (p, d) = pair(exportable(), exportable());
    let (_pool, src) = kv(exportable(), 8);
    let (_pool2, dst) = kv(exportable(), 8);
    src.ensure_backed(0..8).unwrap();
    dst.ensure_backed(0..8).unwrap();
    // Not taken yet: the receiver drops it at once.
    let g1 = p.grant(&src, &[1, 2], AccessMode::ReadOnly).unwrap();
    // A timeout past what an instant can hold waits without a deadline.
    assert_eq!(g1.revoke(Duration::MAX).unwrap(), GrantStatus::Released);
    assert_eq!(d.stats().queued_grants, 0);
    src.release([1, 2]).unwrap();
    src.ensure_backed([1, 2]).unwrap();
    // Taken and mapped: the revoke waits for the receiver to drop it; no copy meanwhile.
    let g2 = p.grant(&src, &[3], AccessMode::ReadOnly).unwrap();
    let imported = d.recv_grant(Duration::from_secs(5)).unwrap();
    assert_eq!(imported.access(), AccessMode::ReadOnly);
    assert!(d.stats().imported_bytes > 0);
    assert!(p.stats().granted_bytes > 0);
    let e = g2
        .revoke(Duration::from_millis(100))
        .unwrap_err()
        .to_string();
    assert!(e.contains("still held"), "{e}");
    assert_eq!(g2.status(), GrantStatus::Revoking);
    assert!(matches!(src.release([3]), Err(Error::BlockPinned { .. })));
    let end = std::time::Instant::now() + Duration::from_secs(5);
    let e = loop {
        let e = imported
            .copy_into(&dst, &[0], CopyStream::LEGACY)
            .map(|c| c.wait());
        match e {
            Err(e) if e.to_string().contains("revoked") => break e,
            _ if std::time::Instant::now() < end => std::thread::sleep(Duration::from_millis(5)),
            other => panic!("copy after revoke: {other:?}"),
        }
    };
    assert!(e.to_string().contains("revoked"));
    drop(imported);
    // Two copies into the same destination block at once: the second is refused.
    let g3 = p.grant(&src, &[4, 5], AccessMode::ReadOnly).unwrap();
    let i3 = d.recv_grant(Duration::from_secs(5)).unwrap();
    let first = i3.copy_into(&dst, &[6, 7], CopyStream::LEGACY).unwrap();
    let e = i3
        .copy_into(&dst, &[5, 6], CopyStream::LEGACY)
        .unwrap_err()
        .to_string();
    assert!(e.contains("another p2p copy is writing"), "{e}");
    first.wait().unwrap();
    i3.copy_into(&dst, &[5, 6], CopyStream::LEGACY)
        .unwrap()
        .wait()
        .unwrap();
    drop(i3);
    g3.wait_released(Duration::from_secs(5)).unwrap();
    assert_eq!(
        g2.wait_released(Duration::from_secs(5)).unwrap(),
        GrantStatus::Released
    );
    src.release([3]).unwrap();
    let (ps, ds) = (p.stats(), d.stats());
    assert_eq!((ps.grants_out, ps.granted_bytes), (0, 0));
    assert_eq!(
        (ds.imports, ds.imported_bytes, ds.imported_chunks),
        (0, 0, 0)
    );
}

/// A grant and a release of the same block race, round after round (slowed unmaps and maps
/// widen the window): exactly one of them wins, never both.
#[test]
fn grant_races_release() {
    let delay = Arc::new(DelayInjector::new(exportable()));
    delay.set_delay(DriverCall::Unmap, Duration::from_micros(200));
    let sender: Arc<dyn Backend> = delay.clone();
    let (p, d) = pair(sender.clone(), exportable());
    let (_pool, src) = kv(sender, 64);
    let (mut granted, mut released) = (0, 0);
    for round in 0..200usize {
        let b = round % 64;
        src.ensure_backed([b]).unwrap();
        let (g, r) = std::thread::scope(|s| {
            let g = s.spawn(|| p.grant(&src, &[b], AccessMode::ReadOnly));
            let r = s.spawn(|| src.release([b]));
            (g.join().unwrap(), r.join().unwrap())
        });
        match (g, r) {
            (Ok(g), Err(Error::BlockPinned { .. })) => {
                granted += 1;
                drop(d.recv_grant(Duration::from_secs(5)).unwrap());
                g.wait_released(Duration::from_secs(5)).unwrap();
                src.release([b]).unwrap();
            }
            (Err(e), Ok(_)) => {
                assert!(e.to_string().contains("not backed"), "{e}");
                released += 1;
            }
            other => panic!("round {round}: both or neither won: {other:?}"),
        }
    }
    assert_eq!(granted + released, 200);
    eprintln!("{granted} grants won, {released} releases won");
    assert_eq!(p.stats().grants_out, 0);
}

/// Blocks of 2 MiB (whole pages): what a hand-off moves.
fn page_blocks(pool: &Pool) -> ElasticLayout {
    LayoutBuilder::new()
        .config(LayoutConfig::new(8, 2, 2, 16, 16384, 2))
        .fully_contiguous()
        .elastic(pool, &MemOptions::new())
        .build()
        .unwrap()
}

/// The sender's side: page blocks on a pool of their own exportable backend, `backed` backed.
fn prefill_blocks(backed: &[usize]) -> (Pool, ElasticLayout) {
    let pool = Pool::new(exportable(), PoolConfig::new(1 << 30).name("prefill")).unwrap();
    let src = page_blocks(&pool);
    src.ensure_backed(backed.iter().copied()).unwrap();
    (pool, src)
}

fn fill(kv: &ElasticLayout, b: usize, byte: u8) {
    let v = kv.block(b).unwrap()[0];
    // SAFETY: backed, nobody else uses it.
    unsafe { kv.write(v.addr, &vec![byte; v.len as usize]).unwrap() };
}

fn bytes_of(kv: &ElasticLayout, b: usize) -> Vec<u8> {
    let v = kv.block(b).unwrap()[0];
    let mut out = vec![0u8; v.len as usize];
    // SAFETY: backed, nobody writes it meanwhile.
    unsafe { kv.read(v.addr, &mut out).unwrap() };
    out
}

#[test]
fn hand_off_moves_memory_without_a_copy() {
    let (s, r) = (exportable(), exportable());
    let (p, d) = pair(s.clone(), r.clone());
    let src_pool = Pool::new(s.clone(), PoolConfig::new(1 << 30).name("prefill")).unwrap();
    let src = page_blocks(&src_pool);
    src.ensure_backed([1, 2]).unwrap();
    fill(&src, 1, 0x11);
    fill(&src, 2, 0x22);
    // Blocks that share pages cannot be handed off alone.
    let (small_pool, small) = kv(s.clone(), 8);
    small.ensure_backed([0]).unwrap();
    let e = p.hand_off(&small, &[0]).unwrap_err().to_string();
    assert!(e.contains("whole pages"), "{e}");
    drop((small, small_pool));

    // A receiver whose limit cannot take the memory: refused, the sender keeps its blocks.
    let tight = Pool::new(
        r.clone(),
        PoolConfig::new(1 << 30)
            .name("tight")
            .physical_limit(2 << 20),
    )
    .unwrap();
    let tight_kv = page_blocks(&tight);
    let g = p.hand_off(&src, &[1, 2]).unwrap();
    let imp = d.recv_grant(Duration::from_secs(5)).unwrap();
    let e = imp.adopt_into(&tight_kv, &[0, 1]).unwrap_err().to_string();
    assert!(e.contains("out of physical memory"), "{e}");
    assert_eq!(
        g.wait_released(Duration::from_secs(5)).unwrap(),
        GrantStatus::Released
    );
    assert_eq!(tight.stats().mapped, 0);
    assert!(bytes_of(&src, 1).iter().all(|&b| b == 0x11));

    // A copy grant cannot be adopted; a layout on another backend cannot adopt.
    let g = p.grant(&src, &[1], AccessMode::ReadOnly).unwrap();
    let imp = d.recv_grant(Duration::from_secs(5)).unwrap();
    let dst_pool = Pool::new(r.clone(), PoolConfig::new(1 << 30).name("decode")).unwrap();
    let dst = page_blocks(&dst_pool);
    let e = imp.adopt_into(&dst, &[5]).unwrap_err().to_string();
    assert!(e.contains("use copy_into"), "{e}");
    g.wait_released(Duration::from_secs(5)).unwrap();

    let g = p.hand_off(&src, &[1, 2]).unwrap();
    let imp = d.recv_grant(Duration::from_secs(5)).unwrap();
    let other_pool = Pool::new(exportable(), PoolConfig::new(1 << 30)).unwrap();
    let other = page_blocks(&other_pool);
    // (The grant is consumed by a refusal: the sender gets it back.)
    let e = imp.adopt_into(&other, &[5, 6]).unwrap_err().to_string();
    assert!(e.contains("same backend"), "{e}");
    g.wait_released(Duration::from_secs(5)).unwrap();

    // The hand-off: no copy, the receiver's pool is charged, the sender lets go.
    let created = src_pool.stats().driver_calls;
    let g = p.hand_off(&src, &[1, 2]).unwrap();
    assert_eq!(g.bytes(), 4 << 20);
    let imp = d.recv_grant(Duration::from_secs(5)).unwrap();
    assert_eq!(imp.mode(), elastic_vmm::p2p::GrantMode::HandOff);
    let dst_calls = dst_pool.stats().driver_calls;
    let change = imp.adopt_into(&dst, &[5, 6]).unwrap();
    assert_eq!(
        dst_pool
            .stats()
            .driver_calls
            .since(&dst_calls)
            .get(DriverCall::Create),
        0,
        "adopted, not created"
    );
    assert_eq!((change.blocks, change.bytes), (2, 4 << 20));
    assert_eq!(
        g.wait_released(Duration::from_secs(5)).unwrap(),
        GrantStatus::HandedOff
    );
    assert!(!src.is_backed(1) && !src.is_backed(2));
    // Block 1's page was granted for copying before, so the receiver kept it imported: the
    // sender holds it back (charged) until the receiver forgot that import.
    let end = std::time::Instant::now() + Duration::from_secs(5);
    while src_pool.stats().peer_held > 0 || p.stats().peer_kept_chunks > 0 {
        assert!(std::time::Instant::now() < end, "{:?}", src_pool.stats());
        std::thread::sleep(Duration::from_millis(2));
    }
    assert_eq!(d.stats().kept_imports, 0);
    let ss = src_pool.stats();
    assert_eq!(
        (ss.mapped, ss.cached),
        (0, 0),
        "handed-off chunks are not kept: {ss:?}"
    );
    assert_eq!(
        s.physical_bytes().unwrap(),
        0,
        "the sender holds none of it"
    );
    assert_eq!(
        src_pool
            .stats()
            .driver_calls
            .since(&created)
            .get(DriverCall::Create),
        0
    );
    let ds = dst_pool.stats();
    assert_eq!(ds.mapped, 4 << 20, "{ds:?}");
    assert!(bytes_of(&dst, 5).iter().all(|&b| b == 0x11));
    assert!(bytes_of(&dst, 6).iter().all(|&b| b == 0x22));
    assert_eq!(d.stats().imports, 0);
    assert_eq!(p.stats().grants_out, 0);
    // Ours now: written, released to the cache, trimmed.
    fill(&dst, 5, 0x55);
    assert!(bytes_of(&dst, 5).iter().all(|&b| b == 0x55));
    dst.release([5, 6]).unwrap();
    dst_pool.trim().unwrap();
    assert_eq!(dst_pool.stats().mapped + dst_pool.stats().cached, 0);
}

/// Threads keep trying to release handed-off blocks while the hand-off completes (slowed
/// unmaps widen the window): none ever succeeds in caching a handed-off chunk, which the
/// receiver owns from then on.
#[test]
fn hand_off_races_release() {
    let delay = Arc::new(DelayInjector::new(exportable()));
    delay.set_delay(DriverCall::Unmap, Duration::from_micros(300));
    let s: Arc<dyn Backend> = delay.clone();
    let r = exportable();
    let (p, d) = pair(s.clone(), r.clone());
    let src_pool = Pool::new(s, PoolConfig::new(1 << 30).name("prefill")).unwrap();
    let src = page_blocks(&src_pool);
    let dst_pool = Pool::new(r, PoolConfig::new(1 << 30).name("decode")).unwrap();
    let dst = page_blocks(&dst_pool);
    let mut refused = 0u64;
    for round in 0..20u8 {
        src.ensure_backed([3, 4]).unwrap();
        fill(&src, 3, round);
        let g = p.hand_off(&src, &[3, 4]).unwrap();
        let done = std::sync::atomic::AtomicBool::new(false);
        std::thread::scope(|sc| {
            let hammer: Vec<_> = (0..4)
                .map(|_| {
                    sc.spawn(|| {
                        let mut n = 0u64;
                        while !done.load(std::sync::atomic::Ordering::Acquire) {
                            match src.release([3]) {
                                Err(Error::BlockPinned { .. }) => n += 1,
                                Err(e) => assert!(e.to_string().contains("not backed"), "{e}"),
                                Ok(c) => panic!("a handed-off block was released: {c:?}"),
                            }
                        }
                        n
                    })
                })
                .collect();
            let imp = d.recv_grant(Duration::from_secs(5)).unwrap();
            imp.adopt_into(&dst, &[0, 1]).unwrap();
            assert_eq!(
                g.wait_released(Duration::from_secs(5)).unwrap(),
                GrantStatus::HandedOff
            );
            done.store(true, std::sync::atomic::Ordering::Release);
            refused += hammer.into_iter().map(|h| h.join().unwrap()).sum::<u64>();
        });
        assert_eq!(
            src_pool.stats().cached,
            0,
            "round {round}: a handed-off chunk was cached"
        );
        assert!(bytes_of(&dst, 0).iter().all(|&b| b == round));
        dst.release([0, 1]).unwrap();
    }
    assert!(refused > 0);
}

/// Any mapped range of a pool (here a region's) granted, copied into a range of the
/// receiver's pool; unmapping either while in use is refused.
#[test]
fn ranges_are_granted_and_copied() {
    const G: u64 = DEFAULT_GRANULARITY as u64;
    let (s, r) = (exportable(), exportable());
    let (p, d) = pair(s.clone(), r.clone());
    let sp = Pool::new(s, PoolConfig::new(1 << 30).name("prefill")).unwrap();
    let rp = Pool::new(r, PoolConfig::new(1 << 30).name("decode")).unwrap();
    let region = sp.reserve_region(8 * G).unwrap();
    region.map(G, 3 * G).unwrap();
    let data: Vec<u8> = (0..3 * G).map(|i| (i % 251) as u8).collect();
    // SAFETY: mapped above; nothing else uses it.
    unsafe { region.write(G, &data).unwrap() };
    // Unmapped, or cutting a chunk: refused before anything is pinned or sent.
    let e = p
        .grant_range(&sp, region.offset(), G, AccessMode::ReadOnly)
        .unwrap_err();
    assert!(matches!(e, Error::RangeNotMapped { .. }), "{e}");
    let big = sp
        .reserve_region_with(2 * G, &MemOptions::new().chunk(2 * G))
        .unwrap();
    big.map(0, 2 * G).unwrap();
    let e = p
        .grant_range(&sp, big.offset(), G, AccessMode::ReadOnly)
        .unwrap_err()
        .to_string();
    assert!(e.contains("whole chunks"), "{e}");
    assert_eq!(p.stats().grants_out, 0);
    let g = p
        .grant_range(&sp, region.offset() + G, 3 * G, AccessMode::ReadOnly)
        .unwrap();
    // Pinned for the peer.
    assert!(matches!(region.unmap(G, G), Err(Error::RangeInUse { .. })));
    let imp = d.recv_grant(Duration::from_secs(5)).unwrap();
    assert_eq!(imp.blocks(), &[0]);
    rp.map(0, 6 * G).unwrap();
    let done = imp.copy_to(&rp, G, CopyStream::LEGACY).unwrap();
    // Overlapping destinations at once: refused; the destination is pinned meanwhile.
    let e = imp
        .copy_to(&rp, 0, CopyStream::LEGACY)
        .unwrap_err()
        .to_string();
    assert!(e.contains("another p2p copy is writing"), "{e}");
    assert!(matches!(rp.unmap(G, G), Err(Error::RangeInUse { .. })));
    let report = done.wait().unwrap();
    assert_eq!((report.bytes, report.copies), (3 * G, 1));
    let mut got = vec![0u8; (3 * G) as usize];
    // SAFETY: mapped above, the copy completed, nobody writes it.
    unsafe { rp.backend().copies().read(rp.base() + G, &mut got).unwrap() };
    assert!(got == data, "the range arrived byte for byte");
    // A range beyond what is mapped here: refused.
    assert!(matches!(
        imp.copy_to(&rp, 4 * G, CopyStream::LEGACY),
        Err(Error::RangeNotMapped { .. })
    ));
    drop(imp);
    assert_eq!(
        g.wait_released(Duration::from_secs(5)).unwrap(),
        GrantStatus::Released
    );
    region.unmap(G, 3 * G).unwrap();
    rp.unmap(0, 6 * G).unwrap();
}

/// Blocks far apart are mapped at their offsets in the sender's range (unmapped gaps between
/// them), read back where they were granted, refused in the gaps; copies claim destination
/// blocks, so a packed copy into bytes of a block being written is refused, and one beside it
/// is not.
#[test]
fn scattered_grants_mirror_the_sender_and_claims_are_by_block() {
    let (p, d) = pair(exportable(), exportable());
    let (_sp, src) = kv(exportable(), 256);
    let (dp, dst) = kv(exportable(), 256);
    let gran = DEFAULT_GRANULARITY as u64;
    let block = 32 << 10;
    src.ensure_backed([1, 200]).unwrap();
    let data: Vec<Vec<u8>> = (0..2u8)
        .map(|i| (0..block).map(|j| (j as u8) ^ (i * 91 + 7)).collect())
        .collect();
    for (i, b) in [1usize, 200].into_iter().enumerate() {
        let v = src.block(b).unwrap()[0];
        // SAFETY: backed, used by nothing else.
        unsafe { src.write(v.addr, &data[i]).unwrap() };
    }
    let g = p.grant(&src, &[1, 200], AccessMode::ReadOnly).unwrap();
    let imp = d.recv_grant(Duration::from_secs(5)).unwrap();
    // Pages 0 and 3 of the sender: a reservation of four pages, two mapped.
    let range = imp.mapped_range();
    assert_eq!((range.len, imp.bytes()), (4 * gran, 2 * gran));
    let views = imp.block_views(1).unwrap();
    assert_eq!(views[0].addr, range.addr + 200 * block);
    let mut got = vec![0u8; block as usize];
    // SAFETY: the sender does not write the granted blocks.
    unsafe { imp.read(views[0].addr, &mut got).unwrap() };
    assert!(got == data[1]);
    // SAFETY: as above; refused before any access.
    let e = unsafe { imp.read(range.addr + gran, &mut got[..16]) }.unwrap_err();
    assert!(e.to_string().contains("not inside"), "{e}");
    dst.ensure_backed(0..16).unwrap();
    let first = imp.copy_into(&dst, &[6, 5], CopyStream::LEGACY).unwrap();
    let report = first.report().clone();
    assert_eq!(
        (report.copies, report.engine),
        (2, elastic_vmm::p2p::CopyEngine::Cpu)
    );
    // Packed over blocks 5 and 6 while the copy holds them: refused; over 8 and 9: fine.
    let off = dst.addr() - dp.base();
    let e = imp
        .copy_to(&dp, off + 5 * block, CopyStream::LEGACY)
        .unwrap_err()
        .to_string();
    assert!(e.contains("another p2p copy is writing"), "{e}");
    imp.copy_to(&dp, off + 8 * block, CopyStream::LEGACY)
        .unwrap()
        .wait()
        .unwrap();
    first.wait().unwrap();
    for (b, want) in [
        (6usize, &data[0]),
        (5, &data[1]),
        (8, &data[0]),
        (9, &data[1]),
    ] {
        // SAFETY: backed, every copy into it completed.
        unsafe { dst.read(dst.block(b).unwrap()[0].addr, &mut got).unwrap() };
        assert!(got == *want, "block {b}");
    }
    drop(imp);
    g.wait_released(Duration::from_secs(5)).unwrap();
}

/// Chunks lent by the broker go back to it when their model releases them, and it hands them
/// to other engines: they cannot change owner by a hand-off (the sender would give them back
/// while the receiver uses them), nor can a broker model's pool take over chunks the broker
/// never lent it. Copies between broker models work.
#[cfg(feature = "broker")]
#[test]
fn broker_models_copy_but_never_hand_off() {
    use elastic_vmm::broker::{Broker, BrokerClient, BrokerConfig};
    use elastic_vmm::ModelConfig;

    let dir = std::env::temp_dir().join(format!("evmm-p2p-broker-{}", std::process::id()));
    let broker = Broker::start(
        exportable(),
        BrokerConfig::new(dir.join("b.sock"), 256 << 20),
    )
    .unwrap();
    let model = |name: &str| {
        let local = exportable();
        let client = BrokerClient::connect(broker.socket(), name).unwrap();
        client.set_local_backend(local.clone()).unwrap();
        let m = client
            .register(ModelConfig::new(name, 1 << 30, 64 << 20))
            .unwrap();
        (local, m)
    };
    let (s, prefill) = model("prefill");
    let (r, decode) = model("decode");
    let (p, d) = pair(s.clone(), r.clone());
    let src = page_blocks(&prefill);
    src.ensure_backed([1, 2]).unwrap();
    fill(&src, 1, 0x31);
    fill(&src, 2, 0x32);
    let lent = prefill.broker_view().unwrap().used;

    // The sender's chunks are the broker's: refused before anything is pinned or sent.
    let e = p.hand_off(&src, &[1, 2]).unwrap_err().to_string();
    assert!(
        e.contains("lent by the broker") && e.contains("prefill"),
        "{e}"
    );
    assert_eq!(p.stats().granted_bytes, 0);
    assert!(
        d.recv_grant(Duration::from_millis(50)).is_err(),
        "nothing sent"
    );

    // A plain sender's hand-off into a broker model's layout: refused, the sender keeps its
    // blocks and its bytes, the broker model maps nothing.
    let plain = Pool::new(s.clone(), PoolConfig::new(1 << 30).name("plain")).unwrap();
    let own = page_blocks(&plain);
    own.ensure_backed([0]).unwrap();
    fill(&own, 0, 0x44);
    let dst = page_blocks(&decode);
    let g = p.hand_off(&own, &[0]).unwrap();
    let imp = d.recv_grant(Duration::from_secs(5)).unwrap();
    let e = imp.adopt_into(&dst, &[3]).unwrap_err().to_string();
    assert!(e.contains("takes its chunks from the broker"), "{e}");
    assert_eq!(
        g.wait_released(Duration::from_secs(5)).unwrap(),
        GrantStatus::Released
    );
    assert!(own.is_backed(0) && bytes_of(&own, 0).iter().all(|&b| b == 0x44));
    assert!(!dst.is_backed(3));

    // Copies between two broker models: byte-exact, the books unchanged by the grant.
    dst.ensure_backed([3, 4]).unwrap();
    let g = p.grant(&src, &[1, 2], AccessMode::ReadOnly).unwrap();
    let asked = std::time::Instant::now();
    let imp = d.recv_grant(Duration::from_secs(5)).unwrap();
    // The import alone is timed, within the call.
    let t = imp.import_time();
    assert!(t > Duration::ZERO && t <= asked.elapsed(), "{t:?}");
    imp.copy_into(&dst, &[3, 4], CopyStream::LEGACY)
        .unwrap()
        .wait()
        .unwrap();
    drop(imp);
    assert_eq!(
        g.wait_released(Duration::from_secs(5)).unwrap(),
        GrantStatus::Released
    );
    assert!(bytes_of(&dst, 3).iter().all(|&b| b == 0x31));
    assert!(bytes_of(&dst, 4).iter().all(|&b| b == 0x32));
    assert_eq!(prefill.broker_view().unwrap().used, lent);
    src.release([1, 2]).unwrap();
    broker.shutdown();
    let _ = std::fs::remove_dir_all(dir);
}

/// A hand-off whose release of a chunk fails on the sender: the chunk is kept apart, never
/// cached (the receiver owns its memory now), so the sender's next block cannot land on it.
#[test]
fn a_handed_off_chunk_whose_release_fails_is_never_reused() {
    let fault = Arc::new(FaultInjector::new(exportable()));
    let s: Arc<dyn Backend> = fault.clone();
    let r = exportable();
    let (p, d) = pair(s.clone(), r.clone());
    let src_pool = Pool::new(s, PoolConfig::new(1 << 30).name("prefill")).unwrap();
    let src = page_blocks(&src_pool);
    let dst_pool = Pool::new(r, PoolConfig::new(1 << 30).name("decode")).unwrap();
    let dst = page_blocks(&dst_pool);
    src.ensure_backed([1]).unwrap();
    fill(&src, 1, 0x11);
    let g = p.hand_off(&src, &[1]).unwrap();
    fault.fail_from(DriverCall::Release, 1);
    let imp = d.recv_grant(Duration::from_secs(5)).unwrap();
    imp.adopt_into(&dst, &[4]).unwrap();
    let st = g.wait_released(Duration::from_secs(5)).unwrap();
    fault.clear();
    assert_eq!(st, GrantStatus::HandedOff);
    let ss = src_pool.stats();
    assert_eq!((ss.cached, ss.given_away), (0, 2 << 20), "{ss:?}");
    src.ensure_backed([6]).unwrap();
    fill(&src, 6, 0x66);
    assert!(bytes_of(&dst, 4).iter().all(|&b| b == 0x11));
    // Teardown releases it.
    drop((src, p));
    drop(src_pool);
}

/// A backend that forwards to `inner`, optionally sleeping in `export_chunk`, and whose
/// `synchronize` succeeds (as CUDA's does). As a stand-in GPU ([`Wrap::gpu`]) it says it holds
/// device memory of a GPU with a UUID, reaches other UUIDs as told, and records the owner
/// each import's access was set for.
#[derive(Debug)]
struct Wrap {
    inner: Arc<dyn Backend>,
    export_delay_ms: AtomicU64,
    gpu: Option<StandIn>,
}

#[derive(Debug)]
struct StandIn {
    info: BackendInfo,
    reaches: Vec<([u8; 16], DeviceReach)>,
    owners: Mutex<Vec<Option<i32>>>,
}

impl Wrap {
    fn new(inner: Arc<dyn Backend>) -> Arc<Wrap> {
        Arc::new(Wrap {
            inner,
            export_delay_ms: AtomicU64::new(0),
            gpu: None,
        })
    }

    /// Host memory posing as device `ordinal` with UUID `[id; 16]`, reaching `reaches`.
    fn gpu(ordinal: i32, id: u8, reaches: Vec<([u8; 16], DeviceReach)>) -> Arc<Wrap> {
        let inner = exportable();
        let mut info = inner.info().clone();
        info.memory_kind = MemoryKind::Device;
        info.device_ordinal = Some(ordinal);
        info.device_uuid = Some([id; 16]);
        Arc::new(Wrap {
            inner,
            export_delay_ms: AtomicU64::new(0),
            gpu: Some(StandIn {
                info,
                reaches,
                owners: Mutex::new(Vec::new()),
            }),
        })
    }

    fn owners(&self) -> Vec<Option<i32>> {
        self.gpu.as_ref().unwrap().owners.lock().unwrap().clone()
    }
}

impl Backend for Wrap {
    fn info(&self) -> &BackendInfo {
        match &self.gpu {
            Some(g) => &g.info,
            None => self.inner.info(),
        }
    }
    fn reach(&self, uuid: &[u8; 16]) -> Result<DeviceReach> {
        let Some(g) = &self.gpu else {
            return self.inner.reach(uuid);
        };
        if g.info.device_uuid.as_ref() == Some(uuid) {
            return Ok(DeviceReach::Same);
        }
        Ok(g.reaches
            .iter()
            .find(|(u, _)| u == uuid)
            .map_or(DeviceReach::NotVisible, |r| r.1))
    }
    unsafe fn set_import_access(
        &self,
        addr: u64,
        size: usize,
        mode: AccessMode,
        owner: Option<i32>,
    ) -> Result<()> {
        if let Some(g) = &self.gpu {
            g.owners.lock().unwrap().push(owner);
            // Host memory has no other device to give access to.
            return unsafe { self.inner.set_access_mode(addr, size, mode) };
        }
        unsafe { self.inner.set_import_access(addr, size, mode, owner) }
    }
    fn reserve(&self, size: usize, alignment: usize) -> Result<u64> {
        self.inner.reserve(size, alignment)
    }
    unsafe fn free_reservation(&self, base: u64, size: usize) -> Result<()> {
        unsafe { self.inner.free_reservation(base, size) }
    }
    fn create(&self, size: usize) -> Result<PhysicalChunk> {
        self.inner.create(size)
    }
    unsafe fn release(&self, chunk: PhysicalChunk) -> Result<()> {
        unsafe { self.inner.release(chunk) }
    }
    unsafe fn map(&self, addr: u64, chunk: PhysicalChunk) -> Result<()> {
        unsafe { self.inner.map(addr, chunk) }
    }
    unsafe fn set_access(&self, addr: u64, size: usize) -> Result<()> {
        unsafe { self.inner.set_access(addr, size) }
    }
    unsafe fn set_access_mode(&self, addr: u64, size: usize, mode: AccessMode) -> Result<()> {
        unsafe { self.inner.set_access_mode(addr, size, mode) }
    }
    unsafe fn unmap(&self, addr: u64, size: usize) -> Result<()> {
        unsafe { self.inner.unmap(addr, size) }
    }
    fn memory_info(&self) -> Result<MemoryInfo> {
        self.inner.memory_info()
    }
    fn physical_bytes(&self) -> Result<u64> {
        self.inner.physical_bytes()
    }
    fn export_chunk(&self, chunk: PhysicalChunk) -> Result<OwnedFd> {
        let ms = self.export_delay_ms.load(Ordering::SeqCst);
        if ms > 0 {
            std::thread::sleep(Duration::from_millis(ms));
        }
        self.inner.export_chunk(chunk)
    }
    fn import_chunk(&self, fd: OwnedFd, size: usize) -> Result<PhysicalChunk> {
        self.inner.import_chunk(fd, size)
    }
    fn copies(&self) -> &dyn Copies {
        self
    }
}

impl Copies for Wrap {
    unsafe fn write(&self, addr: u64, data: &[u8]) -> Result<()> {
        unsafe { self.inner.copies().write(addr, data) }
    }
    unsafe fn read(&self, addr: u64, out: &mut [u8]) -> Result<()> {
        unsafe { self.inner.copies().read(addr, out) }
    }
    unsafe fn fill(&self, addr: u64, len: usize, byte: u8) -> Result<()> {
        unsafe { self.inner.copies().fill(addr, len, byte) }
    }
    fn synchronize(&self, _stream: u64) -> Result<()> {
        Ok(())
    }
}

/// The link closes while a grant is exporting (after its checks, before it is recorded): the
/// grant is refused and its blocks unpinned, never pinned for good behind a closed link.
#[test]
fn a_grant_racing_the_link_closing_is_never_pinned_for_good() {
    let w = Wrap::new(exportable());
    let s: Arc<dyn Backend> = w.clone();
    let (p, d) = pair(s.clone(), exportable());
    let pool = Pool::new(s, PoolConfig::new(1 << 30).name("prefill")).unwrap();
    let src = page_blocks(&pool);
    src.ensure_backed([2]).unwrap();
    w.export_delay_ms.store(300, Ordering::SeqCst);
    let granted = std::thread::scope(|sc| {
        let g = sc.spawn(|| p.grant(&src, &[2], AccessMode::ReadOnly));
        std::thread::sleep(Duration::from_millis(100));
        // The peer goes away while the grant exports.
        drop(d);
        g.join().unwrap()
    });
    w.export_delay_ms.store(0, Ordering::SeqCst);
    let e = granted.unwrap_err().to_string();
    assert!(e.contains("closed"), "{e}");
    assert_eq!(p.stats().grants_out, 0);
    src.release([2]).unwrap();
}

/// A receiver that cannot unmap an import keeps it in its books and does not tell the sender,
/// whose blocks stay pinned (it would reuse memory still mapped here).
#[test]
fn an_import_that_cannot_be_unmapped_stays_held() {
    let fault = Arc::new(FaultInjector::new(exportable()));
    let r: Arc<dyn Backend> = fault.clone();
    let s = exportable();
    let (p, d) = pair(s.clone(), r);
    let pool = Pool::new(s, PoolConfig::new(1 << 30).name("prefill")).unwrap();
    let src = page_blocks(&pool);
    src.ensure_backed([3]).unwrap();
    let g = p.grant(&src, &[3], AccessMode::ReadOnly).unwrap();
    let imp = d.recv_grant(Duration::from_secs(5)).unwrap();
    fault.fail_from(DriverCall::Unmap, 1);
    drop(imp);
    fault.clear();
    assert_eq!(d.stats().imports, 1);
    assert!(g.wait_released(Duration::from_millis(300)).is_err());
    assert_eq!(g.status(), GrantStatus::Held);
    assert!(src.release([3]).is_err(), "still pinned");
}

/// A broker model's backend passes GPU waits on to the engine's own backend
/// (a p2p copy into a broker model's layout waits through it), and a link cannot be built on
/// it: the link imports through the engine's own backend, which the client hands out.
#[cfg(feature = "broker")]
#[test]
fn broker_model_backends_forward_waits_and_links_take_the_engines_backend() {
    use elastic_vmm::broker::{Broker, BrokerClient, BrokerConfig};
    use elastic_vmm::ModelConfig;

    let dir = std::env::temp_dir().join(format!("evmm-p2p-fwd-{}", std::process::id()));
    let broker = Broker::start(
        exportable(),
        BrokerConfig::new(dir.join("b.sock"), 256 << 20),
    )
    .unwrap();
    let local: Arc<dyn Backend> = Wrap::new(exportable());
    let client = BrokerClient::connect(broker.socket(), "engine").unwrap();
    client.set_local_backend(local.clone()).unwrap();
    let model = client
        .register(ModelConfig::new("m", 1 << 30, 64 << 20))
        .unwrap();
    assert!(local.copies().synchronize(1).is_ok());
    model.backend().copies().synchronize(1).unwrap();

    let (x, y) = UnixStream::pair().unwrap();
    let e = PeerLink::over(x, "decode", model.backend().clone())
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("lent by the broker") && e.contains("local_backend"),
        "{e}"
    );
    let own = client.local_backend().unwrap();
    assert!(Arc::ptr_eq(&own, &local));
    drop(y);
    broker.shutdown();
    let _ = std::fs::remove_dir_all(dir);
}

fn wait_for(what: &str, mut done: impl FnMut() -> bool) {
    let end = std::time::Instant::now() + Duration::from_secs(10);
    while !done() {
        assert!(
            std::time::Instant::now() < end,
            "timed out waiting for {what}"
        );
        std::thread::sleep(Duration::from_millis(2));
    }
}

/// Kept imports: later grants of the same pages (the same blocks rewritten, or other blocks on
/// chunks reused from the pool's cache) send keys instead of descriptors and import nothing,
/// and copy the bytes as they are now. Trimmed, the chunks are held back, still charged
/// against the sender's limit, until the receiver forgot its imports (its release slowed to
/// hold the window open), and released then.
#[test]
fn kept_imports_are_reused_and_held_back_until_forgotten() {
    let slow = Arc::new(DelayInjector::new(exportable()));
    let recv_backend: Arc<dyn Backend> = slow.clone();
    let send_backend = exportable();
    let (p, d) = pair(send_backend.clone(), recv_backend.clone());
    let src_pool = Pool::new(
        send_backend.clone(),
        PoolConfig::new(1 << 30)
            .name("prefill")
            .physical_limit(16 << 20),
    )
    .unwrap();
    let src = page_blocks(&src_pool);
    let dst_pool = Pool::new(recv_backend, PoolConfig::new(1 << 30).name("decode")).unwrap();
    let dst = page_blocks(&dst_pool);
    src.ensure_backed([0, 1, 2]).unwrap();
    dst.ensure_backed([5, 6, 7]).unwrap();
    let copy = |blocks: &[usize], byte: u8, fresh: usize| {
        for (i, &b) in blocks.iter().enumerate() {
            fill(&src, b, byte + i as u8);
        }
        let g = p.grant(&src, blocks, AccessMode::ReadOnly).unwrap();
        assert_eq!(g.chunks(), blocks.len());
        assert_eq!(g.descriptors(), fresh, "descriptors sent");
        let imp = d.recv_grant(Duration::from_secs(5)).unwrap();
        assert_eq!(imp.kept_chunks(), blocks.len() - fresh, "chunks found kept");
        let mine: Vec<usize> = (5..5 + blocks.len()).collect();
        imp.copy_into(&dst, &mine, CopyStream::LEGACY)
            .unwrap()
            .wait()
            .unwrap();
        for (i, &b) in mine.iter().enumerate() {
            assert!(
                bytes_of(&dst, b).iter().all(|&x| x == byte + i as u8),
                "block {b} after copying {byte:#x}"
            );
        }
        drop(imp);
        assert_eq!(
            g.wait_released(Duration::from_secs(5)).unwrap(),
            GrantStatus::Released
        );
    };
    copy(&[0, 1, 2], 0x10, 3);
    copy(&[0, 1, 2], 0x20, 0);
    copy(&[2, 1, 0], 0x30, 0);
    let (ps, ds) = (p.stats(), d.stats());
    assert_eq!((ps.peer_kept_chunks, ps.peer_kept_bytes), (3, 6 << 20));
    assert_eq!((ds.kept_imports, ds.kept_import_bytes), (3, 6 << 20));
    assert_eq!(ds.kept_hits, 6);
    assert_eq!((ds.imports, ds.imported_bytes), (0, 0), "nothing mapped");

    // Block 0's chunk goes to the pool's cache and backs block 3: still the chunk the peer
    // keeps, so it goes as a key and the copy reads block 3's bytes.
    src.release([0]).unwrap();
    src.ensure_backed([3]).unwrap();
    assert_eq!(src_pool.stats().driver_calls.get(DriverCall::Create), 3);
    copy(&[3], 0x40, 0);

    // Trimmed: released here, but the peer's imports keep the memory alive, so the chunks are
    // held back and stay charged until it forgot them.
    slow.set_delay(DriverCall::Release, Duration::from_millis(300));
    src.release([1, 2, 3]).unwrap();
    src_pool.trim().unwrap();
    let st = src_pool.stats();
    assert_eq!(
        (st.mapped, st.cached, st.peer_held),
        (0, 0, 6 << 20),
        "{st:?}"
    );
    assert_eq!(st.physical(), 6 << 20);
    assert_eq!(send_backend.physical_bytes().unwrap(), 6 << 20);
    // 12 MiB more does not fit the 16 MiB limit while they are held.
    let e = src.ensure_backed(0..6).unwrap_err();
    assert!(matches!(e, Error::OutOfPhysicalMemory { .. }), "{e}");
    wait_for("the peer to forget", || src_pool.stats().peer_held == 0);
    assert_eq!(send_backend.physical_bytes().unwrap(), 0);
    assert_eq!(p.stats().peer_kept_chunks, 0);
    assert_eq!(d.stats().kept_imports, 0);
    src.ensure_backed(0..6).unwrap();
    // New chunks: descriptors again.
    copy(&[0, 1], 0x50, 2);
}

/// A pool that goes away releases the chunks a peer keeps (nothing is left to charge them to)
/// after forgetting them here, and tells the peer, which lets go; a link dropped by the
/// sender asks the peer to forget the rest, so nothing is held back for a peer it left.
#[test]
fn kept_imports_end_with_the_pool_and_with_the_link() {
    let send_backend = exportable();
    let (p, d) = pair(send_backend.clone(), exportable());
    let (dst_pool, dst) = {
        let pool = Pool::new(exportable(), PoolConfig::new(1 << 30)).unwrap();
        let kv = page_blocks(&pool);
        (pool, kv)
    };
    dst.ensure_backed([0, 1]).unwrap();
    let grant_and_copy = |src: &ElasticLayout| {
        let g = p.grant(src, &[0, 1], AccessMode::ReadOnly).unwrap();
        let imp = d.recv_grant(Duration::from_secs(5)).unwrap();
        imp.copy_into(&dst, &[0, 1], CopyStream::LEGACY)
            .unwrap()
            .wait()
            .unwrap();
        drop(imp);
        g.wait_released(Duration::from_secs(5)).unwrap();
    };
    let pool = Pool::new(send_backend.clone(), PoolConfig::new(1 << 30)).unwrap();
    let src = page_blocks(&pool);
    src.ensure_backed([0, 1]).unwrap();
    grant_and_copy(&src);
    assert_eq!(d.stats().kept_imports, 2);
    drop(src);
    drop(pool);
    // The link's reader may hold the pool for a moment as it is dropped here (dropping the
    // grant's pin just after the status went final, or releasing a chunk the peer forgot):
    // then the reader's drop releases the rest, a moment later.
    wait_for("the pool's chunks to be released", || {
        send_backend.physical_bytes().unwrap() == 0
    });
    wait_for("the peer to let go", || {
        d.stats().kept_imports == 0 && p.stats().peer_kept_chunks == 0
    });

    let pool = Pool::new(send_backend.clone(), PoolConfig::new(1 << 30)).unwrap();
    let src = page_blocks(&pool);
    src.ensure_backed([0, 1]).unwrap();
    grant_and_copy(&src);
    assert_eq!(p.stats().peer_kept_chunks, 2);
    let d_stats = {
        let d = &d;
        move || d.stats()
    };
    drop(p);
    wait_for("the peer to forget", || d_stats().kept_imports == 0);
    // Nothing held back: released at once, memory gone.
    src.release([0, 1]).unwrap();
    pool.trim().unwrap();
    assert_eq!(pool.stats().peer_held, 0);
    assert_eq!(send_backend.physical_bytes().unwrap(), 0);
    drop(dst_pool);
}

/// Rounds of grants, copies, releases and trims against a receiver that checks every byte,
/// with slowed maps, unmaps and releases on both sides: kept imports never serve stale or
/// foreign bytes, and once the links are gone nothing is held back or kept anywhere.
#[test]
fn kept_imports_under_churn() {
    let s = Arc::new(DelayInjector::new(exportable()));
    let r = Arc::new(DelayInjector::new(exportable()));
    for x in [&s, &r] {
        x.set_delay(DriverCall::Unmap, Duration::from_micros(300));
        x.set_delay(DriverCall::Release, Duration::from_micros(500));
    }
    let (sb, rb): (Arc<dyn Backend>, Arc<dyn Backend>) = (s.clone(), r.clone());
    let (p, d) = pair(sb.clone(), rb.clone());
    let src_pool = Pool::new(sb.clone(), PoolConfig::new(1 << 30).name("prefill")).unwrap();
    let src = page_blocks(&src_pool);
    let dst_pool = Pool::new(rb, PoolConfig::new(1 << 30).name("decode")).unwrap();
    let dst = page_blocks(&dst_pool);
    dst.ensure_backed(0..8).unwrap();
    const ROUNDS: usize = 60;
    let (tx, rx) = std::sync::mpsc::channel::<(Vec<usize>, u8)>();
    std::thread::scope(|scope| {
        let receiver = scope.spawn(|| {
            let mut hits = 0;
            for (blocks, byte) in rx {
                let imp = d.recv_grant(Duration::from_secs(10)).unwrap();
                assert_eq!(imp.blocks(), &blocks[..]);
                let mine: Vec<usize> = (0..blocks.len()).collect();
                imp.copy_into(&dst, &mine, CopyStream::LEGACY)
                    .unwrap()
                    .wait()
                    .unwrap();
                for (i, &b) in mine.iter().enumerate() {
                    let want = byte.wrapping_add(blocks[i] as u8);
                    assert!(
                        bytes_of(&dst, b).iter().all(|&x| x == want),
                        "stale bytes for sender block {}",
                        blocks[i]
                    );
                }
                hits = d.stats().kept_hits;
            }
            hits
        });
        for round in 0..ROUNDS {
            let blocks: Vec<usize> = (0..3).map(|i| (round * 3 + i * 5) % 8).collect();
            src.ensure_backed(blocks.iter().copied()).unwrap();
            let byte = (round as u8).wrapping_mul(7);
            for &b in &blocks {
                fill(&src, b, byte.wrapping_add(b as u8));
            }
            let g = p.grant(&src, &blocks, AccessMode::ReadOnly).unwrap();
            tx.send((blocks.clone(), byte)).unwrap();
            g.wait_released(Duration::from_secs(10)).unwrap();
            src.release(blocks.iter().copied()).unwrap();
            if round % 3 == 2 {
                src_pool.trim().unwrap();
            }
        }
        drop(tx);
        let hits = receiver.join().unwrap();
        assert!(hits > 0, "no grant found its chunks kept");
        eprintln!("{hits} chunks found kept over {ROUNDS} grants");
    });
    // Dropped while the last trim's forgets may be in flight: the links answer them before
    // they close.
    src_pool.trim().unwrap();
    drop(d);
    drop(p);
    wait_for("held-back chunks to go", || {
        let st = src_pool.stats();
        st.peer_held == 0 && st.in_flight == 0
    });
    let st = src_pool.stats();
    assert_eq!(st.physical(), 0, "{st:?}");
    assert_eq!(sb.physical_bytes().unwrap(), 0);
}

/// A chunk the peer keeps from a copy grant, then handed off to it: the sender holds it back
/// until the peer forgot the kept import, and releases it then. If that release fails, the
/// chunk must be kept apart (the receiver owns its memory now), never cached and reused.
#[test]
fn a_kept_chunk_handed_off_whose_late_release_fails_is_never_reused() {
    let fault = Arc::new(FaultInjector::new(exportable()));
    let s: Arc<dyn Backend> = fault.clone();
    let r = exportable();
    let (p, d) = pair(s.clone(), r.clone());
    let src_pool = Pool::new(s, PoolConfig::new(1 << 30).name("prefill")).unwrap();
    let src = page_blocks(&src_pool);
    let dst_pool = Pool::new(r, PoolConfig::new(1 << 30).name("decode")).unwrap();
    let dst = page_blocks(&dst_pool);
    src.ensure_backed([1]).unwrap();
    fill(&src, 1, 0x11);
    // A copy grant first: the peer keeps the chunk imported.
    let g = p.grant(&src, &[1], AccessMode::ReadOnly).unwrap();
    drop(d.recv_grant(Duration::from_secs(5)).unwrap());
    g.wait_released(Duration::from_secs(5)).unwrap();
    assert_eq!(d.stats().kept_imports, 1);
    // Then handed off: adopted there, held back here until the peer forgot its kept import.
    let g = p.hand_off(&src, &[1]).unwrap();
    let imp = d.recv_grant(Duration::from_secs(5)).unwrap();
    fault.fail_from(DriverCall::Release, 1);
    imp.adopt_into(&dst, &[4]).unwrap();
    assert_eq!(
        g.wait_released(Duration::from_secs(5)).unwrap(),
        GrantStatus::HandedOff
    );
    wait_for("the peer to forget", || {
        src_pool.stats().peer_held == 0 && p.stats().peer_kept_chunks == 0
    });
    fault.clear();
    let ss = src_pool.stats();
    assert_eq!(
        (ss.cached, ss.given_away),
        (0, 2 << 20),
        "a handed-off chunk whose release failed went to the cache: {ss:?}"
    );
    src.ensure_backed([6]).unwrap();
    fill(&src, 6, 0x66);
    assert!(
        bytes_of(&dst, 4).iter().all(|&b| b == 0x11),
        "the sender reused memory the receiver adopted"
    );
    drop((src, p));
    drop(src_pool);
}

/// A grant of more blocks than one frame holds: the block list goes ahead of the grant in
/// several frames and arrives whole and in order (paired by position with the destination).
/// One block more than a grant may hold is refused with the numbers.
#[test]
fn grants_of_many_blocks_span_frames() {
    const N: usize = 10_000;
    let (p, d) = pair(exportable(), exportable());
    let layout = |backend| {
        let pool = Pool::new(backend, PoolConfig::new(1 << 30).name("many")).unwrap();
        let kv = LayoutBuilder::new()
            .config(LayoutConfig::new(N, 1, 1, 16, 8, 2)) // 256-byte blocks
            .fully_contiguous()
            .elastic(&pool, &MemOptions::new())
            .build()
            .unwrap();
        kv.ensure_backed(0..N).unwrap();
        (pool, kv)
    };
    let (_sp, src) = layout(exportable());
    let (_dp, dst) = layout(exportable());
    let pattern = |b: usize| -> Vec<u8> { (0..256).map(|j| (b * 131 + j * 7) as u8).collect() };
    for b in 0..N {
        // SAFETY: backed, used by nothing else.
        unsafe {
            src.write(src.block(b).unwrap()[0].addr, &pattern(b))
                .unwrap()
        };
    }
    // A permutation (7919 is prime and does not divide N): 10 000 blocks, three frames.
    let order: Vec<usize> = (0..N).map(|i| (i * 7919) % N).collect();
    let g = p.grant(&src, &order, AccessMode::ReadOnly).unwrap();
    assert_eq!(g.blocks(), N);
    let imp = d.recv_grant(Duration::from_secs(5)).unwrap();
    assert_eq!(imp.blocks(), &order[..]);
    let all: Vec<usize> = (0..N).collect();
    let report = imp
        .copy_into(&dst, &all, CopyStream::LEGACY)
        .unwrap()
        .wait()
        .unwrap();
    assert_eq!((report.blocks, report.bytes), (N, N as u64 * 256));
    let mut got = vec![0u8; 256];
    for (i, &b) in order.iter().enumerate() {
        // SAFETY: backed, the copy completed.
        unsafe { dst.read(dst.block(i).unwrap()[0].addr, &mut got).unwrap() };
        assert!(
            got == pattern(b),
            "destination block {i} (sender block {b})"
        );
    }
    drop(imp);
    g.wait_released(Duration::from_secs(5)).unwrap();
    let too_many = vec![0usize; elastic_vmm::p2p::MAX_GRANT_BLOCKS + 1];
    let e = p
        .grant(&src, &too_many, AccessMode::ReadOnly)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains(&format!(
            "a grant holds 1 to {} blocks, {} given",
            elastic_vmm::p2p::MAX_GRANT_BLOCKS,
            elastic_vmm::p2p::MAX_GRANT_BLOCKS + 1
        )),
        "{e}"
    );
    // The link is still good for a grant after the refusal.
    let g = p.grant(&src, &[3], AccessMode::ReadOnly).unwrap();
    drop(d.recv_grant(Duration::from_secs(5)).unwrap());
    g.wait_released(Duration::from_secs(5)).unwrap();
}

/// Accepting with a deadline: an error with the wait in it when no engine connects, a link
/// when one does.
#[test]
fn accept_within_gives_up_when_no_engine_connects() {
    let dir = std::env::temp_dir().join(format!("evmm-p2p-accept-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let sock = dir.join("s");
    let listener = elastic_vmm::p2p::listen(&sock).unwrap();
    let t = std::time::Instant::now();
    let e = PeerLink::accept_within(
        &listener,
        "prefill",
        exportable(),
        Duration::from_millis(200),
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("no engine connected within 200ms"), "{e}");
    assert!(
        t.elapsed() >= Duration::from_millis(200),
        "{:?}",
        t.elapsed()
    );
    let path = sock.clone();
    let peer = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(50));
        PeerLink::connect(&path, "decode", exportable()).unwrap()
    });
    let link = PeerLink::accept_within(&listener, "prefill", exportable(), Duration::from_secs(30))
        .unwrap();
    let decode = peer.join().unwrap();
    assert_eq!(link.peer().name, "decode");
    assert_eq!(decode.path().path, TransferPath::PeerImport);
    assert_eq!(link.peer().reach, elastic_vmm::DeviceReach::NoDevice);
    drop((link, decode));
    let _ = std::fs::remove_dir_all(dir);
}

/// Two engines on two GPUs, found by UUID (the stand-in GPUs are host memory saying they are
/// devices): with peer access each way, a grant imports with access for the chunks' own GPU
/// too, and a hand-off is refused (it stays on one GPU). Where the receiver cannot see the
/// sender's GPU, grants that way are refused before anything is pinned, with the reason,
/// while grants the other way go on. A layout on another GPU than the link's is refused.
#[test]
fn devices_are_found_by_uuid_and_each_direction_has_its_path() {
    let (a, b) = ([1u8; 16], [2u8; 16]);
    let prefill = Wrap::gpu(0, 1, vec![(b, DeviceReach::Peer { ordinal: 1 })]);
    let decode = Wrap::gpu(1, 2, vec![(a, DeviceReach::Peer { ordinal: 0 })]);
    let (p, d) = pair(prefill.clone(), decode.clone());
    for path in [p.path(), p.path_in(), d.path(), d.path_in()] {
        assert_eq!(path.path, TransferPath::PeerImport, "{path:?}");
        assert!(path.reason.contains("with peer access"), "{path:?}");
    }
    assert_eq!(p.peer().reach, DeviceReach::Peer { ordinal: 1 });
    assert_eq!(p.peer().reaches_us, DeviceReach::Peer { ordinal: 0 });
    let pool = Pool::new(prefill.clone(), PoolConfig::new(1 << 30).name("prefill")).unwrap();
    let src = page_blocks(&pool);
    src.ensure_backed([1, 2]).unwrap();
    let g = p.grant(&src, &[1], AccessMode::ReadOnly).unwrap();
    let imp = d.recv_grant(Duration::from_secs(5)).unwrap();
    // The decode side set access for its device and the sender's GPU (ordinal 0 there).
    assert!(!decode.owners().is_empty());
    assert!(
        decode.owners().iter().all(|&o| o == Some(0)),
        "{:?}",
        decode.owners()
    );
    drop(imp);
    assert_eq!(
        g.wait_released(Duration::from_secs(5)).unwrap(),
        GrantStatus::Released
    );
    let e = p.hand_off(&src, &[2]).unwrap_err().to_string();
    assert!(e.contains("a hand-off stays on one GPU"), "{e}");
    assert_eq!(src.stats().pinned_blocks, 0);

    // A layout on a third GPU granted over this link: refused.
    let other = Wrap::gpu(2, 3, vec![]);
    let other_pool = Pool::new(other, PoolConfig::new(1 << 30).name("other")).unwrap();
    let elsewhere = page_blocks(&other_pool);
    elsewhere.ensure_backed([0]).unwrap();
    let e = p
        .grant(&elsewhere, &[0], AccessMode::ReadOnly)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains(
            "the layout's memory is on device Some(2), the link's backend on device Some(0)"
        ),
        "{e}"
    );
    assert_eq!(elsewhere.stats().pinned_blocks, 0);
    drop((g, p, d));

    // The decode process cannot see the prefill's GPU (CUDA_VISIBLE_DEVICES): nothing goes
    // that way; the prefill still imports from the decode.
    let prefill = Wrap::gpu(0, 1, vec![(b, DeviceReach::Peer { ordinal: 1 })]);
    let decode = Wrap::gpu(0, 2, vec![]);
    let (p, d) = pair(prefill.clone(), decode.clone());
    assert_eq!(p.path().path, TransferPath::Nixl);
    assert!(
        p.path()
            .reason
            .contains("is not visible in the receiver's process"),
        "{:?}",
        p.path()
    );
    assert_eq!(d.path_in(), p.path());
    assert_eq!(
        p.path_in().path,
        TransferPath::PeerImport,
        "{:?}",
        p.path_in()
    );
    assert_eq!(d.path(), p.path_in());
    let pool = Pool::new(prefill, PoolConfig::new(1 << 30).name("prefill")).unwrap();
    let src = page_blocks(&pool);
    src.ensure_backed([1]).unwrap();
    let e = p
        .grant(&src, &[1], AccessMode::ReadOnly)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("the peer cannot import our chunks: the link's path is nixl"),
        "{e}"
    );
    assert_eq!(src.stats().pinned_blocks, 0);
    let back_pool = Pool::new(decode, PoolConfig::new(1 << 30).name("decode")).unwrap();
    let back = page_blocks(&back_pool);
    back.ensure_backed([0]).unwrap();
    let g = d.grant(&back, &[0], AccessMode::ReadOnly).unwrap();
    let imp = p.recv_grant(Duration::from_secs(5)).unwrap();
    assert_eq!(imp.blocks(), &[0]);
    drop(imp);
    assert_eq!(
        g.wait_released(Duration::from_secs(5)).unwrap(),
        GrantStatus::Released
    );
}

/// A receiver that does not take its grants: the one past the bound is refused to the sender
/// with the numbers (its blocks unpinned), the link stays open, and taking one makes room.
#[test]
fn a_receiver_that_falls_behind_refuses_the_excess_grant() {
    let (p, d) = pair(exportable(), exportable());
    let (_pool, src) = prefill_blocks(&[1]);
    let grants: Vec<_> = (0..256)
        .map(|_| p.grant(&src, &[1], AccessMode::ReadOnly).unwrap())
        .collect();
    let last = p.grant(&src, &[1], AccessMode::ReadOnly).unwrap();
    match last.wait_released(Duration::from_secs(5)).unwrap() {
        GrantStatus::Refused(why) => {
            assert!(
                why.contains("on top of 256 grants not taken yet here"),
                "{why}"
            )
        }
        other => panic!("{other:?}"),
    }
    assert!(p.closed().is_none() && d.closed().is_none());
    drop(d.recv_grant(Duration::from_secs(5)).unwrap());
    let again = p.grant(&src, &[1], AccessMode::ReadOnly).unwrap();
    std::thread::sleep(Duration::from_millis(100));
    assert_eq!(again.status(), GrantStatus::Held);
    drop((grants, again, last, p, d));
}

/// The receiver's access setting on an import goes through the adaptors as a `SetAccess`
/// call: a fault there refuses the grant (the sender unpins), and the counter sees it.
#[test]
fn import_access_goes_through_the_adaptors() {
    use elastic_vmm::backend::counting::Counting;
    let fault = Arc::new(FaultInjector::new(exportable()));
    let counting = Arc::new(Counting::new(fault.clone()));
    let (p, d) = pair(exportable(), counting.clone());
    let (_pool, src) = prefill_blocks(&[3]);
    let before = counting.counts().get(DriverCall::SetAccess);
    fault.fail_from(DriverCall::SetAccess, 1);
    let g = p.grant(&src, &[3], AccessMode::ReadOnly).unwrap();
    assert!(d.recv_grant(Duration::from_secs(5)).is_err());
    assert!(matches!(
        g.wait_released(Duration::from_secs(5)).unwrap(),
        GrantStatus::Refused(_)
    ));
    assert!(fault.calls(DriverCall::SetAccess) >= 1);
    assert!(counting.counts().get(DriverCall::SetAccess) > before);
    fault.clear();
    let g = p.grant(&src, &[3], AccessMode::ReadOnly).unwrap();
    drop(d.recv_grant(Duration::from_secs(5)).unwrap());
    assert_eq!(
        g.wait_released(Duration::from_secs(5)).unwrap(),
        GrantStatus::Released
    );
}

/// Run `f` on a thread of its own and fail if it does not finish within `limit`: a deadlock
/// fails the test instead of hanging it (the stuck thread keeps what it owns, so nothing that
/// would block on the same locks is dropped here).
fn within(limit: Duration, what: &str, f: impl FnOnce() + Send + 'static) {
    let (tx, rx) = std::sync::mpsc::channel();
    let h = std::thread::spawn(move || {
        f();
        let _ = tx.send(());
    });
    match rx.recv_timeout(limit) {
        Ok(()) => h.join().unwrap(),
        // It panicked: its message is the failure.
        Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => {
            std::panic::resume_unwind(h.join().unwrap_err())
        }
        Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {
            panic!("{what} did not finish within {limit:?}: deadlocked")
        }
    }
}

/// A revoke of a grant the receiver released already returns its status at once, and the link
/// goes on (it deadlocked: the revoke waited while holding the link's state lock).
#[test]
fn a_revoke_after_a_release_returns() {
    within(Duration::from_secs(10), "a revoke after a release", || {
        let (p, d) = pair(exportable(), exportable());
        let (_pool, src) = prefill_blocks(&[1]);
        let g = p.grant(&src, &[1], AccessMode::ReadOnly).unwrap();
        drop(d.recv_grant(Duration::from_secs(5)).unwrap());
        assert_eq!(
            g.wait_released(Duration::from_secs(5)).unwrap(),
            GrantStatus::Released
        );
        assert_eq!(
            g.revoke(Duration::from_secs(1)).unwrap(),
            GrantStatus::Released
        );
        // The link still serves grants.
        let g = p.grant(&src, &[1], AccessMode::ReadOnly).unwrap();
        drop(d.recv_grant(Duration::from_secs(5)).unwrap());
        assert_eq!(
            g.wait_released(Duration::from_secs(5)).unwrap(),
            GrantStatus::Released
        );
        assert_eq!(p.stats().grants_out, 0);
    });
}

/// The sender revokes a grant just as the receiver lets go of it, the revoke starting a little
/// later each round, so it crosses the release or comes after it: the revoke returns, and the
/// link goes on (a second answer closed it before a cold review; a revoke after the release
/// deadlocked the link).
#[test]
fn a_revoke_crossing_a_release_keeps_the_link() {
    within(Duration::from_secs(15), "revokes racing releases", || {
        let (p, d) = pair(exportable(), exportable());
        let (_pool, src) = prefill_blocks(&[1]);
        for round in 0..200u64 {
            let g = p.grant(&src, &[1], AccessMode::ReadOnly).unwrap();
            let imp = d.recv_grant(Duration::from_secs(5)).unwrap();
            std::thread::scope(|s| {
                s.spawn(move || drop(imp));
                std::thread::sleep(Duration::from_micros(round % 20 * 25));
                let status = g.revoke(Duration::from_secs(5)).unwrap();
                assert!(
                    matches!(status, GrantStatus::Released),
                    "round {round}: {status:?}"
                );
            });
            assert!(p.closed().is_none(), "round {round}: {:?}", p.closed());
            assert!(d.closed().is_none(), "round {round}: {:?}", d.closed());
        }
        assert_eq!(src.stats().pinned_blocks, 0);
    });
}

/// A read-only grant the receiver cannot map read-only (its access setting fails) is refused,
/// the sender told why; it is never mapped writable. A read-write grant still maps there.
#[test]
fn a_read_only_grant_is_never_mapped_writable() {
    let fault = Arc::new(FaultInjector::new(exportable()));
    let (p, d) = pair(exportable(), fault.clone());
    let (_pool, src) = prefill_blocks(&[3]);
    fault.fail_nth(DriverCall::SetAccess, 1);
    let g = p.grant(&src, &[3], AccessMode::ReadOnly).unwrap();
    match d.recv_grant(Duration::from_secs(5)) {
        Err(e) => assert!(e.to_string().contains("read-only"), "{e}"),
        Ok(imp) => panic!(
            "a read-only grant was mapped with access {:?}",
            imp.access()
        ),
    }
    match g.wait_released(Duration::from_secs(5)).unwrap() {
        GrantStatus::Refused(why) => assert!(why.contains("read-only"), "{why}"),
        other => panic!("the sender was not told: {other:?}"),
    }
    fault.clear();
    let g = p.grant(&src, &[3], AccessMode::ReadWrite).unwrap();
    let imp = d.recv_grant(Duration::from_secs(5)).unwrap();
    assert_eq!(imp.access(), AccessMode::ReadWrite);
    drop(imp);
    assert_eq!(
        g.wait_released(Duration::from_secs(5)).unwrap(),
        GrantStatus::Released
    );
}

/// The socket `listen` makes can be reached by this user only from the moment it exists: it
/// is created with mode 0600 and its attributes never change after (a chmod after `bind` left
/// a window in which a socket made under a permissive umask was open to every user). inotify
/// reports every change of the node's attributes in the folder.
#[test]
fn a_listening_socket_is_private_from_the_moment_it_exists() {
    use std::os::unix::fs::{FileTypeExt, PermissionsExt};

    use rustix::fs::inotify::{self, CreateFlags, ReadFlags, WatchFlags};
    let dir = std::env::temp_dir().join(format!("evmm-p2p-listen-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let sock = dir.join("s");
    let _ = std::fs::remove_file(&sock);
    let watch = inotify::init(CreateFlags::NONBLOCK | CreateFlags::CLOEXEC).unwrap();
    inotify::add_watch(&watch, &dir, WatchFlags::CREATE | WatchFlags::ATTRIB).unwrap();
    let listener = elastic_vmm::p2p::listen(&sock).unwrap();
    let mut buf = [std::mem::MaybeUninit::uninit(); 4096];
    let mut events = inotify::Reader::new(&watch, &mut buf);
    let mut seen = Vec::new();
    loop {
        match events.next() {
            Ok(e) => seen.push((
                e.file_name().map(|n| n.to_string_lossy().into_owned()),
                e.events(),
            )),
            Err(rustix::io::Errno::AGAIN) => break,
            Err(e) => panic!("reading inotify events: {e}"),
        }
    }
    let on_socket: Vec<ReadFlags> = seen
        .iter()
        .filter(|(n, _)| n.as_deref() == Some("s"))
        .map(|(_, f)| *f)
        .collect();
    assert!(
        on_socket.iter().any(|f| f.contains(ReadFlags::CREATE)),
        "{seen:?}"
    );
    assert!(
        !on_socket.iter().any(|f| f.contains(ReadFlags::ATTRIB)),
        "the socket's mode changed after it was created: {seen:?}"
    );
    let meta = std::fs::symlink_metadata(&sock).unwrap();
    assert!(meta.file_type().is_socket());
    assert_eq!(meta.permissions().mode() & 0o777, 0o600);
    // It serves links.
    let path = sock.clone();
    let peer = std::thread::spawn(move || PeerLink::connect(&path, "decode", exportable()));
    let link = PeerLink::accept_within(&listener, "prefill", exportable(), Duration::from_secs(10))
        .unwrap();
    drop((link, peer.join().unwrap().unwrap()));
    let _ = std::fs::remove_dir_all(dir);
}
