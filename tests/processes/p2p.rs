//! KV blocks moving between two real processes over the host backend: chunks are per-chunk
//! memfds exported as descriptors, imported and mapped by the other process, copied there.

use std::os::unix::net::UnixListener;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use elastic_vmm::backend::host::{ChunkFiles, HostBackend, DEFAULT_GRANULARITY};
use elastic_vmm::backend::testing::DelayInjector;
use elastic_vmm::layout::LayoutKind;
use elastic_vmm::p2p::{self, CopyStream, GrantStatus, LinkOptions, PeerLink};
use elastic_vmm::{AccessMode, Backend, DriverCall, Error};

#[path = "../common_p2p/mod.rs"]
mod scenario;

use super::common;
use scenario::{DST_BLOCKS, SRC_BLOCKS, WAIT};

pub const TESTS: &[(&str, fn())] = &[
    ("p2p::blocks_move_byte_exact", blocks_move_byte_exact),
    (
        "p2p::pins_hold_under_concurrent_release",
        pins_hold_under_concurrent_release,
    ),
    (
        "p2p::receiver_killed_mid_transfer",
        receiver_killed_mid_transfer,
    ),
    (
        "p2p::sender_killed_mid_transfer",
        sender_killed_mid_transfer,
    ),
    (
        "p2p::hand_off_between_processes",
        hand_off_between_processes,
    ),
    (
        "p2p::kept_imports_between_processes",
        kept_imports_between_processes,
    ),
    (
        "p2p::peers_of_another_user_are_refused_unless_allowed",
        peers_of_another_user_are_refused_unless_allowed,
    ),
];

pub fn role(name: &str) -> Option<fn()> {
    match name {
        "p2p-decode" => Some(decode_role),
        "p2p-decode-rounds" => Some(decode_rounds_role),
        "p2p-copy-loop" => Some(copy_loop_role),
        "p2p-grant-and-hang" => Some(grant_and_hang_role),
        "p2p-adopt" => Some(adopt_role),
        "p2p-decode-kept" => Some(decode_kept_role),
        "p2p-user" => Some(user_role),
        _ => None,
    }
}

const INNER: usize = 512;
const ROUNDS: usize = 6;

fn exportable() -> Arc<dyn Backend> {
    Arc::new(HostBackend::with_chunk_files(DEFAULT_GRANULARITY, ChunkFiles::PerChunk).unwrap())
}

/// Descriptors of chunk memfds this process holds open.
fn chunk_fds() -> usize {
    std::fs::read_dir("/proc/self/fd")
        .unwrap()
        .filter_map(|e| std::fs::read_link(e.ok()?.path()).ok())
        .filter(|t| t.to_string_lossy().contains("elastic-vmm-chunk"))
        .count()
}

fn wait_for_file(path: &Path) {
    let end = Instant::now() + WAIT;
    while !path.exists() {
        assert!(Instant::now() < end, "{} never appeared", path.display());
        std::thread::sleep(Duration::from_millis(5));
    }
}

struct Setup {
    dir: PathBuf,
    listener: UnixListener,
    child: std::process::Child,
}

fn start(role: &str) -> Setup {
    let dir = common::temp_dir("p2p");
    let listener = p2p::listen(dir.join("s")).unwrap();
    let child = common::spawn(
        role,
        &[
            ("EVMM_SOCKET", dir.join("s").display().to_string()),
            ("EVMM_DIR", dir.display().to_string()),
        ],
    );
    Setup {
        dir,
        listener,
        child,
    }
}

fn child_link(name: &str, backend: Arc<dyn Backend>) -> PeerLink {
    PeerLink::connect(common::var("EVMM_SOCKET"), name, backend).unwrap()
}

/// Three layout kinds, bad input refused on both sides, every byte checked by the receiver.
fn blocks_move_byte_exact() {
    let s = start("p2p-decode");
    let backend = exportable();
    let link = PeerLink::accept_within(&s.listener, "prefill", backend.clone(), WAIT).unwrap();
    assert_eq!(link.peer().name, "decode");
    assert_eq!(link.peer().credentials.pid as u32, s.child.id());
    assert!(
        link.path().reason.contains("same node"),
        "{:?}",
        link.path()
    );
    scenario::prefill(&link, backend.clone(), INNER);
    assert!(
        common::wait_for(s.child, 60).success(),
        "decode process failed"
    );
    assert_eq!(
        backend.physical_bytes().unwrap(),
        0,
        "prefill's pool is gone"
    );
    let _ = std::fs::remove_dir_all(s.dir);
}

fn decode_role() {
    let link = child_link("decode", exportable());
    scenario::decode(
        &link,
        exportable(),
        INNER,
        CopyStream::LEGACY,
        elastic_vmm::p2p::EngineChoice::Auto,
    );
}

/// While the receiver copies, threads of the sender release and re-back other blocks and try
/// to release the granted ones (slowed unmaps widen the windows): granted blocks are never
/// released, the receiver sees every byte, and once it let go they release.
fn pins_hold_under_concurrent_release() {
    let s = start("p2p-decode-rounds");
    let delay = Arc::new(DelayInjector::new(exportable()));
    delay.set_delay(DriverCall::Unmap, Duration::from_micros(300));
    let backend: Arc<dyn Backend> = delay.clone();
    let link = PeerLink::accept_within(&s.listener, "prefill", backend.clone(), WAIT).unwrap();
    let pool = scenario::pool(backend.clone(), "prefill");
    let kv = scenario::layout(
        &pool,
        LayoutKind::FullyContiguous,
        scenario::config(scenario::SRC_COUNT, INNER),
    );
    let refused = AtomicU64::new(0);
    let churned = AtomicU64::new(0);
    for round in 0..ROUNDS {
        kv.ensure_backed(SRC_BLOCKS).unwrap();
        for b in SRC_BLOCKS {
            scenario::fill(&kv, b, round as u64);
        }
        let g = link.grant(&kv, &SRC_BLOCKS, AccessMode::ReadOnly).unwrap();
        let done = AtomicBool::new(false);
        std::thread::scope(|sc| {
            // Blocks that share pages with the granted ones, and blocks on pages of their own.
            for t in 0..4usize {
                let (kv, done, churned) = (&kv, &done, &churned);
                sc.spawn(move || {
                    let mine: Vec<usize> = (0..scenario::SRC_COUNT)
                        .filter(|b| !SRC_BLOCKS.contains(b) && b % 4 == t)
                        .collect();
                    while !done.load(Ordering::Acquire) {
                        kv.ensure_backed(mine.iter().copied()).unwrap();
                        kv.release(mine.iter().copied()).unwrap();
                        churned.fetch_add(1, Ordering::Relaxed);
                    }
                });
            }
            for _ in 0..4 {
                let (kv, done, refused, g) = (&kv, &done, &refused, &g);
                sc.spawn(move || {
                    while !done.load(Ordering::Acquire) {
                        for b in SRC_BLOCKS {
                            match kv.release([b]) {
                                Err(Error::BlockPinned { .. }) => {
                                    refused.fetch_add(1, Ordering::Relaxed);
                                }
                                // Only once the receiver let go (the status is final before
                                // the pins drop); the main thread re-backs for the next round.
                                other => {
                                    assert!(
                                        g.status().is_final(),
                                        "granted block {b} released while held: {other:?}"
                                    );
                                    return;
                                }
                            }
                        }
                        std::thread::yield_now();
                    }
                });
            }
            let status = g.wait_released(WAIT).unwrap();
            done.store(true, Ordering::Release);
            assert_eq!(status, GrantStatus::Released);
        });
        // Whatever the hammering threads released after the grant ended, release the rest.
        let backed: Vec<usize> = SRC_BLOCKS
            .into_iter()
            .filter(|&b| kv.is_backed(b))
            .collect();
        kv.release(backed).unwrap();
    }
    assert!(refused.load(Ordering::Relaxed) > 0);
    assert!(churned.load(Ordering::Relaxed) > 0);
    assert!(
        common::wait_for(s.child, 60).success(),
        "decode process failed"
    );
    assert_eq!(link.stats().grants_out, 0);
    eprintln!(
        "  {} releases of granted blocks refused, {} churn cycles, {} unmaps delayed",
        refused.load(Ordering::Relaxed),
        churned.load(Ordering::Relaxed),
        delay.calls(DriverCall::Unmap)
    );
    let _ = std::fs::remove_dir_all(s.dir);
}

/// Every destination block holds what the prefill wrote into its source block in `round`.
fn expect_round(kv: &elastic_vmm::layout::ElasticLayout, round: usize) {
    for (s, d) in SRC_BLOCKS.into_iter().zip(DST_BLOCKS) {
        let got = scenario::contents(kv, d);
        assert!(
            got == scenario::pattern(round as u64, s, got.len()),
            "round {round}: block {s} -> {d} differs"
        );
    }
}

fn decode_rounds_role() {
    let backend = exportable();
    let link = child_link("decode", backend.clone());
    let pool = scenario::pool(backend, "decode");
    let kv = scenario::layout(
        &pool,
        LayoutKind::FullyContiguous,
        scenario::config(scenario::DST_COUNT, INNER),
    );
    kv.ensure_backed(DST_BLOCKS).unwrap();
    for round in 0..ROUNDS {
        let g = link.recv_grant(WAIT).unwrap();
        let done = g.copy_into(&kv, &DST_BLOCKS, CopyStream::LEGACY).unwrap();
        // Hold the grant a while: the sender's threads hammer its blocks meanwhile.
        std::thread::sleep(Duration::from_millis(40));
        done.wait().unwrap();
        expect_round(&kv, round);
        drop(g);
    }
}

/// The receiver is killed while it copies from the grant in a loop: the sender sees its
/// process exit, unpins, and every byte of memory goes back.
fn receiver_killed_mid_transfer() {
    let mut s = start("p2p-copy-loop");
    let backend = exportable();
    let link = PeerLink::accept_within(&s.listener, "prefill", backend.clone(), WAIT).unwrap();
    let pool = scenario::pool(backend.clone(), "prefill");
    let kv = scenario::layout(
        &pool,
        LayoutKind::LayerSeparate(elastic_vmm::layout::BlockDim::Second),
        scenario::config(scenario::SRC_COUNT, INNER),
    );
    kv.ensure_backed(SRC_BLOCKS).unwrap();
    let g = link.grant(&kv, &SRC_BLOCKS, AccessMode::ReadOnly).unwrap();
    wait_for_file(&s.dir.join("copying"));
    s.child.kill().unwrap();
    let st = s.child.wait().unwrap();
    assert!(!st.success());
    assert_eq!(g.wait_released(WAIT).unwrap(), GrantStatus::PeerExited);
    assert!(link.closed().is_some());
    let stats = link.stats();
    assert_eq!((stats.grants_out, stats.granted_bytes), (0, 0), "{stats:?}");
    kv.release(SRC_BLOCKS).unwrap();
    drop(kv);
    pool.trim().unwrap();
    assert_eq!(backend.physical_bytes().unwrap(), 0);
    drop(pool);
    assert_eq!(chunk_fds(), 0, "every chunk file is closed");
    let _ = std::fs::remove_dir_all(s.dir);
}

fn copy_loop_role() {
    let backend = exportable();
    let link = child_link("decode", backend.clone());
    let pool = scenario::pool(backend, "decode");
    let kv = scenario::layout(
        &pool,
        LayoutKind::LayerSeparate(elastic_vmm::layout::BlockDim::Second),
        scenario::config(scenario::DST_COUNT, INNER),
    );
    kv.ensure_backed(DST_BLOCKS).unwrap();
    let g = link.recv_grant(WAIT).unwrap();
    let marker = PathBuf::from(common::var("EVMM_DIR")).join("copying");
    for i in 0.. {
        g.copy_into(&kv, &DST_BLOCKS, CopyStream::LEGACY)
            .unwrap()
            .wait()
            .unwrap();
        if i == 0 {
            std::fs::write(&marker, b"").unwrap();
        }
    }
}

/// The sender is killed while the receiver imports and maps its grant (slowed maps): the
/// mapping completes and stays sound, new copies from it are refused, a second grant still
/// queued is dropped, and dropping the first unmaps it: no descriptor of the dead peer's
/// chunks stays open.
fn sender_killed_mid_transfer() {
    let mut s = start("p2p-grant-and-hang");
    let delay = Arc::new(DelayInjector::new(exportable()));
    let backend: Arc<dyn Backend> = delay.clone();
    let pool = scenario::pool(backend.clone(), "decode");
    let kv = scenario::layout(
        &pool,
        LayoutKind::FullyContiguous,
        scenario::config(scenario::DST_COUNT, INNER),
    );
    kv.ensure_backed(DST_BLOCKS).unwrap();
    // Before the link exists: nothing of the peer's is open yet.
    let baseline = chunk_fds();
    let link = PeerLink::accept_within(&s.listener, "decode", backend.clone(), WAIT).unwrap();
    // Both grants queued before the import starts.
    let end = Instant::now() + WAIT;
    while link.stats().queued_grants < 2 {
        assert!(Instant::now() < end, "two grants never arrived");
        std::thread::sleep(Duration::from_millis(5));
    }
    delay.set_delay(DriverCall::Map, Duration::from_millis(30));
    let maps0 = delay.calls(DriverCall::Map);
    let child = &mut s.child;
    let g = std::thread::scope(|sc| {
        let killer = sc.spawn(|| {
            while delay.calls(DriverCall::Map) == maps0 {
                std::thread::sleep(Duration::from_millis(1));
            }
            child.kill().unwrap();
            child.wait().unwrap()
        });
        let g = link
            .recv_grant(WAIT)
            .expect("the import completes without its sender");
        assert!(!killer.join().unwrap().success());
        g
    });
    delay.clear();
    let end = Instant::now() + WAIT;
    while link.closed().is_none() {
        assert!(Instant::now() < end, "the link never saw the sender go");
        std::thread::sleep(Duration::from_millis(5));
    }
    assert_eq!(
        link.stats().queued_grants,
        0,
        "the queued grant was dropped"
    );
    let e = g
        .copy_into(&kv, &DST_BLOCKS, CopyStream::LEGACY)
        .unwrap_err()
        .to_string();
    assert!(e.contains("sender is gone"), "{e}");
    assert!(link.stats().imported_bytes > 0);
    drop(g);
    assert_eq!(link.stats().imports, 0);
    assert_eq!(
        chunk_fds(),
        baseline,
        "no chunk of the dead sender stays open"
    );
    let e = link
        .recv_grant(Duration::from_millis(10))
        .unwrap_err()
        .to_string();
    assert!(e.contains("link closed"), "{e}");
    let _ = std::fs::remove_dir_all(s.dir);
}

fn grant_and_hang_role() {
    let backend = exportable();
    let link = child_link("prefill", backend.clone());
    let pool = scenario::pool(backend, "prefill");
    let kv = scenario::layout(
        &pool,
        LayoutKind::FullyContiguous,
        scenario::config(scenario::SRC_COUNT, INNER),
    );
    kv.ensure_backed(0..scenario::SRC_COUNT).unwrap();
    let _a = link.grant(&kv, &SRC_BLOCKS, AccessMode::ReadOnly).unwrap();
    let _b = link.grant(&kv, &[0, 1, 2], AccessMode::ReadOnly).unwrap();
    std::thread::sleep(Duration::from_secs(60));
}

/// Ownership hand-off: the blocks' memory moves to the other process without a copy.
fn hand_off_between_processes() {
    let s = start("p2p-adopt");
    let backend = exportable();
    let link = PeerLink::accept_within(&s.listener, "prefill", backend.clone(), WAIT).unwrap();
    scenario::hand_off_sender(&link, backend.clone());
    assert!(
        common::wait_for(s.child, 60).success(),
        "adopting process failed"
    );
    assert_eq!(backend.physical_bytes().unwrap(), 0);
    let _ = std::fs::remove_dir_all(s.dir);
}

fn adopt_role() {
    let backend = exportable();
    let link = child_link("decode", backend.clone());
    scenario::hand_off_receiver(&link, backend);
}

/// The decode process keeps the chunks it imported: later grants of the same blocks send no
/// descriptor and copy the bytes as they are now; a trim after a release holds the chunks back
/// until the decode process forgot them; once it is killed holding some, the prefill settles
/// its books on its exit and gives every byte back.
fn kept_imports_between_processes() {
    let mut s = start("p2p-decode-kept");
    let backend = exportable();
    let link = PeerLink::accept_within(&s.listener, "prefill", backend.clone(), WAIT).unwrap();
    let pool = scenario::pool(backend.clone(), "prefill");
    let kv = scenario::layout(
        &pool,
        LayoutKind::FullyContiguous,
        scenario::config(scenario::SRC_COUNT, INNER),
    );
    let settle = |what: &str, done: &dyn Fn() -> bool| {
        let end = Instant::now() + WAIT;
        while !done() {
            assert!(Instant::now() < end, "timed out waiting for {what}");
            std::thread::sleep(Duration::from_millis(2));
        }
    };
    kv.ensure_backed(SRC_BLOCKS).unwrap();
    for round in 0..=ROUNDS {
        if round == ROUNDS {
            // Released and trimmed: held back until the decode process forgot its imports.
            kv.release(SRC_BLOCKS).unwrap();
            pool.trim().unwrap();
            settle("the decode process to forget", &|| {
                pool.stats().peer_held == 0 && link.stats().peer_kept_chunks == 0
            });
            assert_eq!(backend.physical_bytes().unwrap(), 0);
            kv.ensure_backed(SRC_BLOCKS).unwrap();
        }
        for b in SRC_BLOCKS {
            scenario::fill(&kv, b, round as u64);
        }
        let g = link.grant(&kv, &SRC_BLOCKS, AccessMode::ReadOnly).unwrap();
        let fresh = round == 0 || round == ROUNDS;
        assert_eq!(
            g.descriptors() > 0,
            fresh,
            "round {round}: {} descriptors for {} chunks",
            g.descriptors(),
            g.chunks()
        );
        if !fresh {
            assert_eq!(g.descriptors(), 0);
        }
        assert_eq!(g.wait_released(WAIT).unwrap(), GrantStatus::Released);
    }
    wait_for_file(&s.dir.join("kept"));
    assert!(link.stats().peer_kept_chunks > 0);
    s.child.kill().unwrap();
    assert!(!s.child.wait().unwrap().success());
    settle("the books to settle on the decode process's exit", &|| {
        link.closed().is_some() && link.stats().peer_kept_chunks == 0
    });
    kv.release(SRC_BLOCKS).unwrap();
    pool.trim().unwrap();
    assert_eq!(pool.stats().peer_held, 0);
    assert_eq!(backend.physical_bytes().unwrap(), 0);
    drop(kv);
    drop(pool);
    drop(link);
    assert_eq!(chunk_fds(), 0, "every chunk file is closed");
    let _ = std::fs::remove_dir_all(s.dir);
}

fn decode_kept_role() {
    let backend = exportable();
    let link = child_link("decode", backend.clone());
    let pool = scenario::pool(backend, "decode");
    let kv = scenario::layout(
        &pool,
        LayoutKind::FullyContiguous,
        scenario::config(scenario::DST_COUNT, INNER),
    );
    kv.ensure_backed(DST_BLOCKS).unwrap();
    for round in 0..=ROUNDS {
        let g = link.recv_grant(WAIT).unwrap();
        g.copy_into(&kv, &DST_BLOCKS, CopyStream::LEGACY)
            .unwrap()
            .wait()
            .unwrap();
        expect_round(&kv, round);
        drop(g);
    }
    let st = link.stats();
    assert!(st.kept_hits > 0 && st.kept_imports > 0, "{st:?}");
    std::fs::write(PathBuf::from(common::var("EVMM_DIR")).join("kept"), b"").unwrap();
    // Killed here, holding its kept imports.
    loop {
        std::thread::sleep(Duration::from_secs(1));
    }
}

/// The user a child drops to (`nobody`).
const OTHER_UID: u32 = 65534;

/// Spawn this binary as `role` running as `uid` (its group the same number; a root parent that
/// sets a uid drops the supplementary groups too), its stdout piped.
fn spawn_as(role: &str, uid: Option<u32>, vars: &[(&str, String)]) -> common::KillOnDrop {
    use std::os::unix::process::CommandExt;
    let mut cmd = std::process::Command::new(std::env::current_exe().unwrap());
    cmd.env(common::ROLE_VAR, role)
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped());
    for (k, v) in vars {
        cmd.env(k, v);
    }
    if let Some(uid) = uid {
        cmd.gid(uid).uid(uid);
    }
    common::KillOnDrop(cmd.spawn().expect("spawn child process"))
}

/// The child's word on how its link went: its first line saying `linked`, `refused` or
/// `failed`.
fn outcome(child: &mut common::KillOnDrop) -> String {
    use std::io::BufRead;
    let out = child.0.stdout.as_mut().expect("piped stdout");
    let mut lines = std::io::BufReader::new(out).lines();
    loop {
        let line = lines
            .next()
            .expect("the child said nothing")
            .expect("read the child's stdout");
        if ["linked", "refused", "failed"]
            .iter()
            .any(|w| line.starts_with(w))
        {
            return line;
        }
    }
}

/// Who may link: a process of another user is refused, on accept and on connect, with both
/// uids named, before any hello; one of our user links; another user allowed on both ends
/// links and moves blocks byte-exact. The socket is opened to everyone here (as one in a
/// shared folder would be), so the user check alone keeps others out.
fn peers_of_another_user_are_refused_unless_allowed() {
    if !rustix::process::geteuid().is_root() {
        eprintln!("skipped: dropping a child to another uid needs root");
        return;
    }
    use std::os::unix::fs::PermissionsExt;
    let dir = common::temp_dir("p2p-user");
    // temp_dir is private (0700); this test opens the folder and the socket to everyone.
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o755)).unwrap();
    let sock = dir.join("s");
    let listener = p2p::listen(&sock).unwrap();
    std::fs::set_permissions(&sock, std::fs::Permissions::from_mode(0o666)).unwrap();
    let at = ("EVMM_SOCKET", sock.display().to_string());
    let allow_root = ("EVMM_ALLOW_UID", "0".to_owned());
    let backend = exportable();

    // Another user, not allowed here: refused on accept.
    let mut child = spawn_as(
        "p2p-user",
        Some(OTHER_UID),
        &[at.clone(), allow_root.clone()],
    );
    let e = PeerLink::accept_within(&listener, "prefill", backend.clone(), WAIT).unwrap_err();
    match &e {
        Error::PeerUserRefused { uid, ours, pid, .. } => {
            assert_eq!((*uid, *ours), (OTHER_UID, 0), "{e}");
            assert_eq!(*pid as u32, child.0.id());
        }
        other => panic!("a peer of uid {OTHER_UID} was not refused: {other:?}"),
    }
    let msg = e.to_string();
    assert!(msg.contains("uid 65534") && msg.contains("uid 0"), "{msg}");
    let said = outcome(&mut child);
    assert!(said.starts_with("failed"), "{said}");
    assert!(child.0.wait().unwrap().success());

    // Allowed here, but the child does not allow us: refused on connect, by the child.
    let mut child = spawn_as("p2p-user", Some(OTHER_UID), std::slice::from_ref(&at));
    let opts = LinkOptions::new().allow_uid(OTHER_UID);
    assert!(opts
        .accept_within(&listener, "prefill", backend.clone(), WAIT)
        .is_err());
    let said = outcome(&mut child);
    assert!(
        said.starts_with("refused") && said.contains("runs as uid 0, this process as uid 65534"),
        "{said}"
    );
    assert!(child.0.wait().unwrap().success());

    // Allowed on both ends: linked, and blocks move byte-exact.
    let mut child = spawn_as("p2p-user", Some(OTHER_UID), &[at.clone(), allow_root]);
    let link = opts
        .accept_within(&listener, "prefill", backend.clone(), WAIT)
        .unwrap();
    assert_eq!(link.peer().credentials.uid, OTHER_UID);
    assert_eq!(outcome(&mut child), "linked");
    scenario::prefill(&link, backend.clone(), INNER);
    drop(link);
    assert!(
        child.0.wait().unwrap().success(),
        "the other user's decode failed"
    );

    // Our own user, with no option: linked.
    let mut child = spawn_as("p2p-user", None, &[at]);
    let link = PeerLink::accept_within(&listener, "prefill", backend.clone(), WAIT).unwrap();
    assert_eq!(outcome(&mut child), "linked");
    scenario::prefill(&link, backend.clone(), INNER);
    drop(link);
    assert!(child.0.wait().unwrap().success(), "decode failed");
    assert_eq!(backend.physical_bytes().unwrap(), 0);
    let _ = std::fs::remove_dir_all(dir);
}

/// Connect to `EVMM_SOCKET` allowing `EVMM_ALLOW_UID` if set, say how it went, and decode.
fn user_role() {
    let mut opts = LinkOptions::new();
    if let Ok(uid) = std::env::var("EVMM_ALLOW_UID") {
        opts = opts.allow_uid(uid.parse().unwrap());
    }
    let link = match opts.connect(common::var("EVMM_SOCKET"), "decode", exportable()) {
        Ok(link) => link,
        Err(e @ Error::PeerUserRefused { .. }) => return println!("refused: {e}"),
        Err(e) => return println!("failed: {e}"),
    };
    println!("linked");
    scenario::decode(
        &link,
        exportable(),
        INNER,
        CopyStream::LEGACY,
        elastic_vmm::p2p::EngineChoice::Auto,
    );
}
