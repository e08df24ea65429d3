//! The link against a hand-written peer: malformed or inconsistent messages close the link or
//! refuse the grant, never crash or map what was not granted.

use std::os::fd::AsFd;
use std::os::unix::net::UnixStream;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::link::PeerLink;
use super::wire::{
    Hello, Msg, WireChunk, WireLayout, WireReach, BLOCKS_PER_FRAME, MAX_GRANT_BLOCKS, VERSION,
};
use crate::backend::host::{ChunkFiles, HostBackend, DEFAULT_GRANULARITY};
use crate::backend::{AccessMode, Backend};
use crate::ipc;
use crate::layout::{LayoutConfig, LayoutKind};
use crate::MemOptions;

fn backend() -> Arc<dyn Backend> {
    Arc::new(HostBackend::with_chunk_files(DEFAULT_GRANULARITY, ChunkFiles::PerChunk).unwrap())
}

/// The hello of a host-memory peer on this node.
fn raw_hello() -> Hello {
    Hello {
        version: VERSION,
        name: "raw".into(),
        boot_id: super::boot_id(),
        memory: crate::MemoryKind::Host.into(),
        device: None,
        granularity: DEFAULT_GRANULARITY as u64,
        exportable: true,
    }
}

/// A link over `x` whose peer at `raw` said `hello`, no GPU, then `last`.
fn open(x: UnixStream, raw: &UnixStream, hello: Hello, last: &Msg) -> crate::Result<PeerLink> {
    for m in [&Msg::Hello(hello), &Msg::Device(None), last] {
        ipc::send_frame(raw, &ipc::encode(m).unwrap(), &[]).unwrap();
    }
    PeerLink::over(x, "engine", backend())
}

/// A link whose peer is `raw`, after the hello.
fn link() -> (PeerLink, UnixStream) {
    let (x, raw) = UnixStream::pair().unwrap();
    let l = open(x, &raw, raw_hello(), &Msg::Reach(WireReach::NoDevice)).unwrap();
    let theirs = ipc::recv_frame(&raw, ipc::MAX_FRAME).unwrap().unwrap();
    assert!(matches!(
        ipc::decode::<Msg>(&theirs.payload).unwrap(),
        Msg::Hello(_)
    ));
    for expect in [Msg::Device(None), Msg::Reach(WireReach::NoDevice)] {
        let theirs = ipc::recv_frame(&raw, ipc::MAX_FRAME).unwrap().unwrap();
        assert_eq!(ipc::decode::<Msg>(&theirs.payload).unwrap(), expect);
    }
    assert_eq!(
        l.path().path,
        super::TransferPath::PeerImport,
        "{:?}",
        l.path()
    );
    (l, raw)
}

fn closed_with(l: &PeerLink, what: &str) {
    let end = Instant::now() + Duration::from_secs(5);
    loop {
        if let Some(why) = l.closed() {
            assert!(why.contains(what), "{why}");
            return;
        }
        assert!(Instant::now() < end, "link still open");
        std::thread::sleep(Duration::from_millis(2));
    }
}

/// A pool and a layout of eight 2 MiB blocks (whole pages) on it, `backed` backed.
fn page_blocks(backed: &[usize]) -> (crate::Pool, crate::layout::ElasticLayout) {
    let pool = crate::Pool::new(backend(), crate::PoolConfig::new(1 << 30)).unwrap();
    let kv = crate::layout::LayoutBuilder::new()
        .config(LayoutConfig::new(8, 2, 2, 16, 16384, 2))
        .fully_contiguous()
        .elastic(&pool, &MemOptions::new())
        .build()
        .unwrap();
    kv.ensure_backed(backed.iter().copied()).unwrap();
    (pool, kv)
}

fn layout() -> WireLayout {
    WireLayout::of(
        &LayoutConfig::new(64, 1, 1, 16, 4096, 2),
        LayoutKind::FullyContiguous,
    )
}

/// A copy grant `grant` of `blocks` (the last of them: earlier ones go in Blocks frames) in
/// `layout()`, after `chunks` chunks.
fn grant_frame(grant: u64, blocks: Vec<u64>, chunks: u64) -> Msg {
    Msg::Grant {
        mode: super::GrantMode::Copy,
        grant,
        access: AccessMode::ReadOnly,
        layout: layout(),
        blocks,
        chunks,
    }
}

/// One chunk of grant `grant`, a page at offset 0, coming as `how`.
fn one_chunk(grant: u64, how: WireChunk) -> Msg {
    Msg::Chunks {
        grant,
        offsets: vec![0],
        sizes: vec![DEFAULT_GRANULARITY as u64],
        how: vec![how],
    }
}

#[test]
fn malformed_and_inconsistent_messages_close_the_link() {
    let (l, raw) = link();
    ipc::send_frame(&raw, &[0xff, 0xff, 0xff], &[]).unwrap();
    closed_with(&l, "malformed");

    // Descriptors that do not match the chunks announced.
    let (l, raw) = link();
    let (a, _b) = UnixStream::pair().unwrap();
    let m = Msg::Chunks {
        grant: 1,
        offsets: vec![0, 1 << 21],
        sizes: vec![1 << 21, 1 << 21],
        how: vec![WireChunk::New, WireChunk::Keep(1)],
    };
    ipc::send_frame(&raw, &ipc::encode(&m).unwrap(), &[a.as_fd()]).unwrap();
    closed_with(&l, "2 chunks of which 2 with descriptors, 1 descriptors");

    // A grant announcing more chunks than arrived.
    let (l, raw) = link();
    let m = grant_frame(1, vec![0], 3);
    ipc::send_frame(&raw, &ipc::encode(&m).unwrap(), &[]).unwrap();
    closed_with(&l, "announces 3 chunks (0 arrived)");
    assert!(l.recv_grant(Duration::from_millis(10)).is_err());
}

#[test]
fn grants_that_do_not_cover_their_blocks_or_are_not_chunks_are_refused() {
    let exporter = backend();
    let chunk = exporter.create(DEFAULT_GRANULARITY).unwrap();
    let fd = exporter.export_chunk(chunk).unwrap();
    // One 2 MiB chunk at offset 0; block 40 (128 KiB blocks) lies at 5 MiB: not covered.
    let (l, raw) = link();
    let m = one_chunk(7, WireChunk::New);
    ipc::send_frame(&raw, &ipc::encode(&m).unwrap(), &[fd.as_fd()]).unwrap();
    let m = grant_frame(7, vec![1, 40], 1);
    ipc::send_frame(&raw, &ipc::encode(&m).unwrap(), &[]).unwrap();
    let e = l
        .recv_grant(Duration::from_secs(5))
        .unwrap_err()
        .to_string();
    assert!(e.contains("block 40") && e.contains("not covered"), "{e}");
    let r = ipc::recv_frame(&raw, ipc::MAX_FRAME).unwrap().unwrap();
    match ipc::decode::<Msg>(&r.payload).unwrap() {
        Msg::Refused { grant: 7, reason } => assert!(reason.contains("not covered"), "{reason}"),
        other => panic!("{other:?}"),
    }
    let s = l.stats();
    assert_eq!(
        (s.imports, s.imported_bytes),
        (0, 0),
        "nothing stays mapped"
    );

    // A descriptor that is no chunk (a socket): refused, link still usable.
    let (a, _b) = UnixStream::pair().unwrap();
    let m = one_chunk(8, WireChunk::New);
    ipc::send_frame(&raw, &ipc::encode(&m).unwrap(), &[a.as_fd()]).unwrap();
    let m = grant_frame(8, vec![1], 1);
    ipc::send_frame(&raw, &ipc::encode(&m).unwrap(), &[]).unwrap();
    let e = l
        .recv_grant(Duration::from_secs(5))
        .unwrap_err()
        .to_string();
    assert!(e.contains("not a memory file"), "{e}");
    assert!(l.closed().is_none());
    // SAFETY: created above, mapped nowhere.
    unsafe { exporter.release(chunk).unwrap() };
}

/// A peer cannot make this process reserve address space far beyond its layout (two chunks
/// 16 TiB apart), nor map a chunk at an offset that is not a multiple of the granularity:
/// both are refused with the numbers, nothing stays mapped, the link goes on.
#[test]
fn grants_far_beyond_the_layout_or_off_granularity_are_refused() {
    let exporter = backend();
    let (l, raw) = link();
    let gran = DEFAULT_GRANULARITY as u64;
    for (grant, offsets, what) in [
        (9u64, vec![0, 1u64 << 44], "ends past the sender's layout"),
        (10, vec![4096], "at offsets that are multiples of it"),
    ] {
        let chunks: Vec<_> = offsets
            .iter()
            .map(|_| exporter.create(DEFAULT_GRANULARITY).unwrap())
            .collect();
        let fds: Vec<_> = chunks
            .iter()
            .map(|&c| exporter.export_chunk(c).unwrap())
            .collect();
        let m = Msg::Chunks {
            grant,
            offsets: offsets.clone(),
            sizes: vec![gran; offsets.len()],
            how: vec![WireChunk::New; offsets.len()],
        };
        let borrowed: Vec<_> = fds.iter().map(|f| f.as_fd()).collect();
        ipc::send_frame(&raw, &ipc::encode(&m).unwrap(), &borrowed).unwrap();
        let m = Msg::Grant {
            mode: super::GrantMode::Copy,
            grant,
            access: AccessMode::ReadOnly,
            layout: layout(),
            blocks: vec![0],
            chunks: offsets.len() as u64,
        };
        ipc::send_frame(&raw, &ipc::encode(&m).unwrap(), &[]).unwrap();
        let e = l
            .recv_grant(Duration::from_secs(5))
            .unwrap_err()
            .to_string();
        assert!(e.contains(what), "{e}");
        let s = l.stats();
        assert_eq!(
            (s.imports, s.imported_bytes),
            (0, 0),
            "nothing stays mapped"
        );
        assert!(l.closed().is_none());
        for c in chunks {
            // SAFETY: created above, mapped nowhere here.
            unsafe { exporter.release(c).unwrap() };
        }
    }
}

/// A peer that says it adopted blocks granted for copying breaks the protocol: the link
/// closes and the blocks stay backed and pinned (its word would otherwise release them).
#[test]
fn adopting_a_copy_grant_closes_the_link_and_keeps_the_blocks() {
    let (l, raw) = link();
    let (_pool, kv) = page_blocks(&[0, 1]);
    let g = l.grant(&kv, &[0, 1], AccessMode::ReadOnly).unwrap();
    let m = Msg::Adopted { grant: g.id() };
    ipc::send_frame(&raw, &ipc::encode(&m).unwrap(), &[]).unwrap();
    closed_with(&l, "granted for copying");
    assert!(kv.is_backed(0) && kv.is_backed(1));
    let e = kv.release([0]).unwrap_err().to_string();
    assert!(e.contains("pinned"), "{e}");
    drop(raw);
}

/// A sender repeating a live grant's id breaks the protocol: the link closes, the live
/// import keeps its books, and the sender is told nothing (a refusal of the id would unpin
/// blocks still mapped here).
#[test]
fn a_repeated_grant_id_closes_the_link_and_leaves_the_live_import_alone() {
    let exporter = backend();
    let chunk = exporter.create(DEFAULT_GRANULARITY).unwrap();
    let fd = exporter.export_chunk(chunk).unwrap();
    let (l, raw) = link();
    let m = one_chunk(5, WireChunk::New);
    ipc::send_frame(&raw, &ipc::encode(&m).unwrap(), &[fd.as_fd()]).unwrap();
    let grant = |chunks| Msg::Grant {
        mode: super::GrantMode::Copy,
        grant: 5,
        access: AccessMode::ReadOnly,
        layout: layout(),
        blocks: vec![0],
        chunks,
    };
    ipc::send_frame(&raw, &ipc::encode(&grant(1)).unwrap(), &[]).unwrap();
    let imp = l.recv_grant(Duration::from_secs(5)).unwrap();
    assert_eq!(l.stats().imports, 1);
    // The same id again, no chunks.
    ipc::send_frame(&raw, &ipc::encode(&grant(0)).unwrap(), &[]).unwrap();
    let second = l.recv_grant(Duration::from_millis(500));
    let s = l.stats();
    raw.set_read_timeout(Some(Duration::from_millis(300)))
        .unwrap();
    let answer = ipc::recv_frame(&raw, ipc::MAX_FRAME)
        .ok()
        .flatten()
        .map(|f| ipc::decode::<Msg>(&f.payload).unwrap());
    assert!(
        s.imports == 1 && s.imported_bytes == DEFAULT_GRANULARITY as u64 && answer.is_none(),
        "grant 5 is still mapped here ({imp:?}); the repeat gave {second:?}; books now {s:?}; the sender was told {answer:?}"
    );
    drop(imp);
    // SAFETY: created above, mapped nowhere here.
    unsafe { exporter.release(chunk).unwrap() };
}

/// A receiver answering a grant twice breaks the protocol (the second answer could drop pins
/// kept for good, as after a hand-off whose release failed): the link closes.
#[test]
fn a_grant_answered_twice_closes_the_link() {
    let (l, raw) = link();
    let (_pool, kv) = page_blocks(&[0]);
    let g = l.grant(&kv, &[0], AccessMode::ReadOnly).unwrap();
    let m = Msg::Released { grant: g.id() };
    ipc::send_frame(&raw, &ipc::encode(&m).unwrap(), &[]).unwrap();
    assert_eq!(
        g.wait_released(Duration::from_secs(5)).unwrap(),
        super::GrantStatus::Released
    );
    ipc::send_frame(&raw, &ipc::encode(&m).unwrap(), &[]).unwrap();
    closed_with(&l, "answered grant");
    kv.release([0]).unwrap();
}

/// A sender whose writer queue is full when a pool releases a chunk the peer keeps: the
/// `Forget` cannot be queued. The chunk is held back (charged) until the peer forgets it, so
/// the request must reach the peer eventually, or the link must end (its books then settle
/// when the peer exits). Here it is dropped silently: the link stays open, the peer never
/// hears of it, and the chunk stays held back for as long as the peer lives.
#[test]
fn a_forget_that_cannot_be_queued_ends_the_link() {
    let (l, raw) = link();
    let (pool, kv) = page_blocks(&[0]);
    // The peer keeps block 0's chunk.
    let g = l.grant(&kv, &[0], AccessMode::ReadOnly).unwrap();
    let mut key = None;
    for _ in 0..2 {
        let f = ipc::recv_frame(&raw, ipc::MAX_FRAME).unwrap().unwrap();
        if let Msg::Chunks { how, .. } = ipc::decode::<Msg>(&f.payload).unwrap() {
            key = how[0].key();
        }
    }
    let key = key.expect("a kept chunk");
    let m = Msg::Released { grant: g.id() };
    ipc::send_frame(&raw, &ipc::encode(&m).unwrap(), &[]).unwrap();
    g.wait_released(Duration::from_secs(5)).unwrap();
    drop(g);

    // The peer stops reading for a while; meanwhile the link's own answers (releases of
    // grants the peer sent) fill its writer queue.
    let exporter = backend();
    let chunk = exporter.create(DEFAULT_GRANULARITY).unwrap();
    let fd = exporter.export_chunk(chunk).unwrap();
    for id in 1..=7000u64 {
        let m = one_chunk(id, WireChunk::New);
        ipc::send_frame(&raw, &ipc::encode(&m).unwrap(), &[fd.as_fd()]).unwrap();
        let m = grant_frame(id, vec![0], 1);
        ipc::send_frame(&raw, &ipc::encode(&m).unwrap(), &[]).unwrap();
        drop(l.recv_grant(Duration::from_secs(5)).unwrap());
    }
    assert!(l.closed().is_none());

    // The chunk the peer keeps is released: held back, and the peer is to be asked to forget.
    kv.release([0]).unwrap();
    pool.trim().unwrap();
    assert_eq!(pool.stats().peer_held, DEFAULT_GRANULARITY as u64);

    // The peer reads again: everything queued comes, but no Forget.
    raw.set_read_timeout(Some(Duration::from_millis(500)))
        .unwrap();
    let mut forget = false;
    while let Ok(Some(f)) = ipc::recv_frame(&raw, ipc::MAX_FRAME) {
        if let Msg::Forget { keys } = ipc::decode::<Msg>(&f.payload).unwrap() {
            forget |= keys.contains(&key);
        }
    }
    let end = Instant::now() + Duration::from_secs(2);
    while !forget && l.closed().is_none() && Instant::now() < end {
        std::thread::sleep(Duration::from_millis(2));
    }
    assert!(
        forget || l.closed().is_some(),
        "the Forget for key {key} was dropped, the link is open and the chunk stays held back: {:?}",
        pool.stats()
    );
    // SAFETY: created above, mapped nowhere here.
    unsafe { exporter.release(chunk).unwrap() };
}

#[test]
fn block_lists_over_frames_are_bounded_and_follow_their_chunks() {
    // Blocks of a grant none of whose chunks came.
    let (l, raw) = link();
    let m = Msg::Blocks {
        grant: 3,
        blocks: vec![0, 1],
    };
    ipc::send_frame(&raw, &ipc::encode(&m).unwrap(), &[]).unwrap();
    closed_with(&l, "blocks for grant 3, which has no chunks here");

    // More blocks in all than a grant may have, over several frames.
    let (l, raw) = link();
    let (a, _b) = UnixStream::pair().unwrap();
    let m = Msg::Chunks {
        grant: 1,
        offsets: vec![0],
        sizes: vec![1 << 21],
        how: vec![WireChunk::New],
    };
    ipc::send_frame(&raw, &ipc::encode(&m).unwrap(), &[a.as_fd()]).unwrap();
    let frames = MAX_GRANT_BLOCKS / BLOCKS_PER_FRAME;
    for _ in 0..frames {
        let m = Msg::Blocks {
            grant: 1,
            blocks: vec![0; BLOCKS_PER_FRAME],
        };
        ipc::send_frame(&raw, &ipc::encode(&m).unwrap(), &[]).unwrap();
    }
    // All of them were taken: the next one is refused with the whole count before it.
    let m = Msg::Blocks {
        grant: 1,
        blocks: vec![0],
    };
    ipc::send_frame(&raw, &ipc::encode(&m).unwrap(), &[]).unwrap();
    closed_with(
        &l,
        &format!("grant 1: 1 blocks after {MAX_GRANT_BLOCKS} (1 or more, {MAX_GRANT_BLOCKS} in all allowed)"),
    );

    // The grant's own list counts too: its blocks and those before it in all.
    let (l, raw) = link();
    let (a, _b) = UnixStream::pair().unwrap();
    let m = Msg::Chunks {
        grant: 2,
        offsets: vec![0],
        sizes: vec![1 << 21],
        how: vec![WireChunk::New],
    };
    ipc::send_frame(&raw, &ipc::encode(&m).unwrap(), &[a.as_fd()]).unwrap();
    for _ in 0..frames {
        let m = Msg::Blocks {
            grant: 2,
            blocks: vec![0; BLOCKS_PER_FRAME],
        };
        ipc::send_frame(&raw, &ipc::encode(&m).unwrap(), &[]).unwrap();
    }
    let m = grant_frame(2, vec![0], 1);
    ipc::send_frame(&raw, &ipc::encode(&m).unwrap(), &[]).unwrap();
    closed_with(
        &l,
        &format!(
            "announces 1 chunks (1 arrived) and {} blocks (1 to {MAX_GRANT_BLOCKS} allowed)",
            MAX_GRANT_BLOCKS + 1
        ),
    );
}

#[test]
fn the_hello_needs_the_peers_reach_and_a_path_that_imports_before_any_grant() {
    // A peer that says something else where its reach or its GPU belongs: no link.
    let (x, raw) = UnixStream::pair().unwrap();
    let e = open(x, &raw, raw_hello(), &Msg::Bye)
        .unwrap_err()
        .to_string();
    assert!(e.contains("expected how it reaches our device"), "{e}");
    let (x, raw) = UnixStream::pair().unwrap();
    for m in [Msg::Hello(raw_hello()), Msg::Reach(WireReach::NoDevice)] {
        ipc::send_frame(&raw, &ipc::encode(&m).unwrap(), &[]).unwrap();
    }
    let e = PeerLink::over(x, "engine", backend())
        .unwrap_err()
        .to_string();
    assert!(e.contains("expected its GPU"), "{e}");

    // A peer of version 3 (the hello has its shape): the error names the versions. So does
    // one of a later version whose hello grew (it does not decode as ours).
    for (version, extra) in [(3, &[][..]), (VERSION + 1, &[7u8][..])] {
        let (x, raw) = UnixStream::pair().unwrap();
        let mut old = raw_hello();
        old.version = version;
        let mut bytes = ipc::encode(&Msg::Hello(old)).unwrap();
        bytes.extend_from_slice(extra);
        ipc::send_frame(&raw, &bytes, &[]).unwrap();
        let e = PeerLink::over(x, "engine", backend())
            .unwrap_err()
            .to_string();
        assert!(
            e.contains(&format!("protocol version {version} (ours is {VERSION})")),
            "{e}"
        );
    }

    // A peer on another node (another boot id): the link opens on the NIXL path, and a grant
    // over it is refused with the reason before anything is pinned or sent.
    let (x, raw) = UnixStream::pair().unwrap();
    let mut hello = raw_hello();
    hello.boot_id = "another-node".into();
    let l = open(x, &raw, hello, &Msg::Reach(WireReach::NoDevice)).unwrap();
    for path in [l.path(), l.path_in()] {
        assert_eq!(path.path, super::TransferPath::Nixl);
        assert!(path.reason.starts_with("different nodes"), "{path:?}");
    }
    assert_eq!(l.peer().reach, crate::DeviceReach::NoDevice);
    let (_pool, kv) = page_blocks(&[0, 1]);
    let e = l
        .grant(&kv, &[0, 1], AccessMode::ReadOnly)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("the peer cannot import our chunks: the link's path is nixl (different nodes"),
        "{e}"
    );
    assert_eq!(kv.stats().pinned_blocks, 0);
    let e = l.hand_off(&kv, &[0]).unwrap_err().to_string();
    assert!(e.contains("the link's path is nixl"), "{e}");
    assert_eq!(kv.stats().pinned_blocks, 0);
    // Nothing went out after the hello, our GPU and our reach.
    raw.set_nonblocking(true).unwrap();
    for n in 0..3 {
        let f = ipc::recv_frame(&raw, ipc::MAX_FRAME).unwrap().unwrap();
        let m = ipc::decode::<Msg>(&f.payload).unwrap();
        assert!(
            matches!(
                (n, &m),
                (0, Msg::Hello(_)) | (1, Msg::Device(None)) | (2, Msg::Reach(_))
            ),
            "{m:?}"
        );
    }
    assert!(ipc::recv_frame(&raw, ipc::MAX_FRAME).is_err());
    raw.set_nonblocking(false).unwrap();
    // A peer granting over it all the same is refused, before any import.
    send_kept_grant(&raw, 1, 1);
    match &answers(&raw)[..] {
        [Msg::Refused { grant: 1, reason }] => assert!(
            reason.contains("the peer's chunks cannot be imported here (different nodes"),
            "{reason}"
        ),
        other => panic!("{other:?}"),
    }
    assert_eq!(l.stats().queued_grants, 0);
    // Chunks it sent to be kept are not imported: forgotten, then the grant refused.
    let exporter = backend();
    let chunk = exporter.create(DEFAULT_GRANULARITY).unwrap();
    let fd = exporter.export_chunk(chunk).unwrap();
    let m = one_chunk(2, WireChunk::Keep(7));
    ipc::send_frame(&raw, &ipc::encode(&m).unwrap(), &[fd.as_fd()]).unwrap();
    let m = grant_frame(2, vec![0], 1);
    ipc::send_frame(&raw, &ipc::encode(&m).unwrap(), &[]).unwrap();
    match &answers(&raw)[..] {
        [Msg::Forgot { keys }, Msg::Refused { grant: 2, .. }] => assert_eq!(keys, &[7]),
        other => panic!("{other:?}"),
    }
    assert_eq!(l.stats().kept_imports, 0);
    drop((l, fd));
    // SAFETY: never imported.
    unsafe { exporter.release(chunk).unwrap() };
}

/// Send a whole grant `grant` of one kept chunk (no descriptor) and `blocks` zeros, over
/// frames as a sender does.
fn send_kept_grant(raw: &UnixStream, grant: u64, blocks: usize) {
    let send = |m: &Msg| ipc::send_frame(raw, &ipc::encode(m).unwrap(), &[]).unwrap();
    send(&Msg::Chunks {
        grant,
        offsets: vec![0],
        sizes: vec![DEFAULT_GRANULARITY as u64],
        how: vec![WireChunk::Kept(grant)],
    });
    let mut left = blocks;
    while left > BLOCKS_PER_FRAME {
        send(&Msg::Blocks {
            grant,
            blocks: vec![0; BLOCKS_PER_FRAME],
        });
        left -= BLOCKS_PER_FRAME;
    }
    send(&Msg::Grant {
        mode: super::GrantMode::Copy,
        grant,
        access: AccessMode::ReadOnly,
        layout: layout(),
        blocks: vec![0; left],
        chunks: 1,
    });
}

/// Complete grants wait for the application in a bounded queue: by count and by blocks, a
/// grant beyond it is refused with the numbers and the link goes on (a cold review grew the
/// receiver by 100 MiB with 200 queued grants before the bound).
#[test]
fn grants_not_taken_yet_are_bounded() {
    use super::wire::{MAX_QUEUED_BLOCKS, MAX_QUEUED_GRANTS};
    let refused = |raw: &UnixStream, grant: u64, what: &str| {
        let f = ipc::recv_frame(raw, ipc::MAX_FRAME).unwrap().unwrap();
        match ipc::decode::<Msg>(&f.payload).unwrap() {
            Msg::Refused { grant: g, reason } if g == grant => {
                assert!(reason.contains(what), "{reason}")
            }
            other => panic!("expected grant {grant} refused, got {other:?}"),
        }
    };
    let (l, raw) = link();
    for g in 1..=MAX_QUEUED_GRANTS as u64 {
        send_kept_grant(&raw, g, 1);
    }
    let last = MAX_QUEUED_GRANTS as u64 + 1;
    send_kept_grant(&raw, last, 1);
    refused(
        &raw,
        last,
        &format!(
            "grant {last} (1 blocks, 1 chunks) on top of {MAX_QUEUED_GRANTS} grants not taken yet here ({MAX_QUEUED_GRANTS} blocks"
        ),
    );
    assert_eq!(l.stats().queued_grants, MAX_QUEUED_GRANTS);
    assert!(l.closed().is_none(), "{:?}", l.closed());

    let (l, raw) = link();
    let full = MAX_QUEUED_BLOCKS / MAX_GRANT_BLOCKS;
    for g in 1..=full as u64 {
        send_kept_grant(&raw, g, MAX_GRANT_BLOCKS);
    }
    let last = full as u64 + 1;
    send_kept_grant(&raw, last, 1);
    refused(
        &raw,
        last,
        &format!("on top of {full} grants not taken yet here ({MAX_QUEUED_BLOCKS} blocks, {full} chunks)"),
    );
    assert_eq!(l.stats().queued_grants, full);
    assert!(l.closed().is_none(), "{:?}", l.closed());
}

/// A grant id reused after a revoke of its half-sent first use, or after the first use
/// completed, carries none of the first use's blocks (cold review: dropping either cleanup
/// passed every other test).
#[test]
fn block_lists_of_a_reused_grant_id_start_empty() {
    let exporter = backend();
    let chunk = exporter.create(DEFAULT_GRANULARITY).unwrap();
    let chunks = |raw: &UnixStream| {
        let fd = exporter.export_chunk(chunk).unwrap();
        let m = one_chunk(5, WireChunk::New);
        ipc::send_frame(raw, &ipc::encode(&m).unwrap(), &[fd.as_fd()]).unwrap();
    };
    let send =
        |raw: &UnixStream, m: &Msg| ipc::send_frame(raw, &ipc::encode(m).unwrap(), &[]).unwrap();
    let ahead = Msg::Blocks {
        grant: 5,
        blocks: vec![0; BLOCKS_PER_FRAME],
    };
    let grant = grant_frame(5, vec![1], 1);

    // Revoked half sent, then sent again under the same id.
    let (l, raw) = link();
    chunks(&raw);
    send(&raw, &ahead);
    send(&raw, &Msg::Revoke { grant: 5 });
    assert_eq!(answers_until(&raw, 1).remove(0), Msg::Released { grant: 5 });
    chunks(&raw);
    send(&raw, &grant);
    let imp = l.recv_grant(Duration::from_secs(5)).unwrap();
    assert_eq!(imp.blocks(), &[1], "blocks of the revoked first use");
    drop(imp);
    assert_eq!(answers_until(&raw, 1).remove(0), Msg::Released { grant: 5 });

    // Completed, released, then sent again under the same id.
    let (l, raw) = link();
    chunks(&raw);
    send(&raw, &ahead);
    send(&raw, &grant);
    let imp = l.recv_grant(Duration::from_secs(5)).unwrap();
    assert_eq!(imp.blocks().len(), BLOCKS_PER_FRAME + 1);
    drop(imp);
    assert_eq!(answers_until(&raw, 1).remove(0), Msg::Released { grant: 5 });
    chunks(&raw);
    send(&raw, &grant);
    let imp = l.recv_grant(Duration::from_secs(5)).unwrap();
    assert_eq!(imp.blocks(), &[1], "blocks of the completed first use");
    drop(imp);
    // SAFETY: every import of the chunk was unmapped and closed with its grant.
    unsafe { exporter.release(chunk).unwrap() };
}

/// Read frames off `raw` until none comes within 300 ms.
fn answers(raw: &UnixStream) -> Vec<Msg> {
    raw.set_read_timeout(Some(Duration::from_millis(300)))
        .unwrap();
    let mut out = Vec::new();
    while let Ok(Some(f)) = ipc::recv_frame(raw, ipc::MAX_FRAME) {
        out.push(ipc::decode::<Msg>(&f.payload).unwrap());
    }
    raw.set_read_timeout(None).unwrap();
    out
}

/// A revoke crossing the receiver's answer (the grant was refused, or released, already) is
/// not answered again: a second answer would make the sender close the link for a protocol
/// error (cold review). Nor is a revoke of a grant never sent.
#[test]
fn a_revoke_of_a_grant_answered_already_gets_no_second_answer() {
    use super::wire::MAX_QUEUED_GRANTS;
    let (l, raw) = link();
    for g in 1..=MAX_QUEUED_GRANTS as u64 + 1 {
        send_kept_grant(&raw, g, 1);
    }
    let last = MAX_QUEUED_GRANTS as u64 + 1;
    let send = |m: &Msg| ipc::send_frame(&raw, &ipc::encode(m).unwrap(), &[]).unwrap();
    send(&Msg::Revoke { grant: last });
    send(&Msg::Revoke { grant: 9999 });
    let got = answers(&raw);
    assert!(
        matches!(&got[..], [Msg::Refused { grant, .. }] if *grant == last),
        "{got:?}"
    );
    // A queued grant revoked: released, once.
    send(&Msg::Revoke { grant: 1 });
    send(&Msg::Revoke { grant: 1 });
    assert_eq!(answers(&raw), vec![Msg::Released { grant: 1 }]);
    assert!(l.closed().is_none(), "{:?}", l.closed());
}

/// Chunks kept imported for a peer are bounded: past the bound a chunk sent to be kept is
/// imported for its grant alone and the sender told it was not kept (`Forgot`); the grant
/// imports as usual.
#[test]
fn kept_imports_are_bounded() {
    use super::wire::MAX_KEPT_IMPORTS;
    let exporter = backend();
    let chunk = exporter.create(DEFAULT_GRANULARITY).unwrap();
    let (l, raw) = link();
    for g in 1..=MAX_KEPT_IMPORTS as u64 + 2 {
        let fd = exporter.export_chunk(chunk).unwrap();
        let m = one_chunk(g, WireChunk::Keep(g));
        ipc::send_frame(&raw, &ipc::encode(&m).unwrap(), &[fd.as_fd()]).unwrap();
        let m = grant_frame(g, vec![0], 1);
        ipc::send_frame(&raw, &ipc::encode(&m).unwrap(), &[]).unwrap();
        let imp = l.recv_grant(Duration::from_secs(5)).unwrap();
        drop(imp);
        let kept = g.min(MAX_KEPT_IMPORTS as u64);
        let want: Vec<Msg> = if g > MAX_KEPT_IMPORTS as u64 {
            vec![Msg::Forgot { keys: vec![g] }, Msg::Released { grant: g }]
        } else {
            vec![Msg::Released { grant: g }]
        };
        let got = answers_until(&raw, want.len());
        assert_eq!(got, want, "grant {g}");
        assert_eq!(l.stats().kept_imports, kept as usize, "grant {g}");
    }
    assert!(l.closed().is_none(), "{:?}", l.closed());
    drop(l);
    // SAFETY: the link is gone, and with it every import of the chunk.
    unsafe { exporter.release(chunk).unwrap() };
}

/// The next `n` frames off `raw`, each within 5 s.
fn answers_until(raw: &UnixStream, n: usize) -> Vec<Msg> {
    raw.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let out = (0..n)
        .map(|i| {
            let f = ipc::recv_frame(raw, ipc::MAX_FRAME)
                .unwrap_or_else(|e| panic!("frame {i} of {n}: {e}"))
                .unwrap();
            ipc::decode::<Msg>(&f.payload).unwrap()
        })
        .collect();
    raw.set_read_timeout(None).unwrap();
    out
}

/// A sender keeps no more chunks at a peer than the peer keeps: past the bound its chunks go
/// with descriptors, so two grants of one such page in flight both import (neither names a
/// key the receiver did not keep, which would refuse it).
#[test]
fn a_sender_keeps_no_more_chunks_at_a_peer_than_the_peer_keeps() {
    use super::wire::MAX_KEPT_IMPORTS;
    let (x, y) = UnixStream::pair().unwrap();
    let t = std::thread::spawn(move || PeerLink::over(y, "decode", backend()).unwrap());
    let p = PeerLink::over(x, "prefill", backend()).unwrap();
    let d = t.join().unwrap();
    let n = MAX_KEPT_IMPORTS + 4;
    let pool = crate::Pool::new(backend(), crate::PoolConfig::new(1 << 30)).unwrap();
    let kv = crate::layout::LayoutBuilder::new()
        .config(LayoutConfig::new(n, 1, 1, 16, 65536, 2))
        .fully_contiguous()
        .elastic(&pool, &MemOptions::new())
        .build()
        .unwrap();
    kv.ensure_backed(0..n).unwrap();
    let wait = Duration::from_secs(5);
    for b in 0..n {
        let g = p.grant(&kv, &[b], AccessMode::ReadOnly).unwrap();
        assert_eq!(g.descriptors(), 1, "block {b}");
        drop(d.recv_grant(wait).unwrap());
        assert_eq!(
            g.wait_released(wait).unwrap(),
            super::GrantStatus::Released,
            "block {b}"
        );
    }
    assert_eq!(p.stats().peer_kept_chunks, MAX_KEPT_IMPORTS);
    assert_eq!(d.stats().kept_imports, MAX_KEPT_IMPORTS);
    // A kept page goes as a key; a page past the bound with a descriptor, every time.
    let g = p.grant(&kv, &[0], AccessMode::ReadOnly).unwrap();
    assert_eq!(g.descriptors(), 0);
    drop(d.recv_grant(wait).unwrap());
    g.wait_released(wait).unwrap();
    let last = n - 1;
    let g1 = p.grant(&kv, &[last], AccessMode::ReadOnly).unwrap();
    let g2 = p.grant(&kv, &[last], AccessMode::ReadOnly).unwrap();
    assert_eq!((g1.descriptors(), g2.descriptors()), (1, 1));
    drop(d.recv_grant(wait).unwrap());
    drop(d.recv_grant(wait).unwrap());
    for g in [g1, g2] {
        assert_eq!(g.wait_released(wait).unwrap(), super::GrantStatus::Released);
    }
    assert_eq!(d.stats().kept_imports, MAX_KEPT_IMPORTS);
    assert!(p.closed().is_none() && d.closed().is_none());
}
