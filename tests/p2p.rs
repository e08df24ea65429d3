//! Blocks granted between two links of one process over a socket pair (real memfd chunks,
//! exported, imported and mapped again): bad input, revokes, and grants racing releases.

use std::os::unix::net::UnixStream;
use std::sync::Arc;
use std::time::Duration;

use elastic_vmm::backend::delay::DelayInjector;
use elastic_vmm::backend::host::{ChunkFiles, HostBackend, DEFAULT_GRANULARITY};
use elastic_vmm::layout::{ElasticLayout, LayoutBuilder, LayoutConfig};
use elastic_vmm::p2p::{CopyStream, GrantStatus, PeerLink, Peers, TransferPath};
use elastic_vmm::{AccessMode, Backend, DriverCall, Error, Pool, PoolConfig};

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
        .elastic(&pool)
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
    assert_eq!(
        g1.revoke(Duration::from_secs(5)).unwrap(),
        GrantStatus::Released
    );
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
    assert!(e.contains("block 6 is being written"), "{e}");
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
