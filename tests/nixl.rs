//! NIXL registration and transfers on host memory with the real NIXL library (feature `nixl`).
//!
//! Without the library (`libnixl_capi.so` not on `LD_LIBRARY_PATH`) every test prints why and
//! skips: any NIXL call would abort the whole binary. With `ELASTIC_VMM_REQUIRE_NIXL` set (to
//! anything but `0`; scripts/test.sh sets it to 1) a missing library fails every test instead,
//! so CI cannot pass by skipping.
#![cfg(feature = "nixl")]

#[path = "suite/mod.rs"]
mod suite;

/// The two-process NIXL exchange of `gpu-bench p2p`, memory-independent: tested here on DRAM
/// (`prepare_env`, which changes the environment, is for the bench's `main` only).
#[path = "../benches/gpu/nixl_peer.rs"]
#[allow(dead_code)]
mod nixl_peer;

use std::sync::Arc;

use elastic_vmm::backend::host::HostBackend;
use elastic_vmm::nixl::{self, NixlAgent};
use elastic_vmm::{Backend, Error, MemOptions};

fn host() -> Arc<dyn Backend> {
    Arc::new(HostBackend::new(2 << 20).expect("host backend"))
}

/// Whether NIXL tests can run; a missing library fails when `ELASTIC_VMM_REQUIRE_NIXL` is set.
fn nixl_ready() -> bool {
    match nixl::available() {
        Ok(()) => true,
        Err(e) => {
            let required =
                std::env::var("ELASTIC_VMM_REQUIRE_NIXL").is_ok_and(|v| !v.is_empty() && v != "0");
            assert!(!required, "ELASTIC_VMM_REQUIRE_NIXL is set but {e}");
            println!("skipped: {e}");
            false
        }
    }
}

crate::nixl_suite!(host, nixl_ready);

/// Without the library every entry point is an error, never an abort; with it agents come up.
#[test]
fn missing_library_is_an_error_not_an_abort() {
    let agent = NixlAgent::new("probe");
    if nixl_ready() {
        let a = agent.expect("agent with UCX");
        assert_eq!((a.name(), a.registrations()), ("probe", 0));
    } else {
        match agent {
            Err(Error::NixlUnavailable { reason }) => {
                assert!(reason.contains("LD_LIBRARY_PATH"), "{reason}")
            }
            other => panic!("expected NixlUnavailable, got {other:?}"),
        }
    }
}

/// Host-memory transfer bandwidth between two agents in one process (printed; run with
/// `--nocapture` to see it).
#[test]
fn host_transfer_bandwidth() {
    if nixl_ready() {
        let (w, r) = suite::layout::nixl::bandwidth(host(), 64 << 20);
        assert!(w > 0.0 && r > 0.0);
    }
}

/// A transfer that times out while NIXL still runs it keeps its blocks pinned, and its
/// source's registrations and memory alive, until NIXL reports it finished (see the suite).
///
/// Over shared memory (CMA) UCX completes a host transfer inside the post call, so nothing can
/// be caught running; over TCP it runs in the background. UCX reads `UCX_TLS` when an agent
/// starts, so the scenario runs in a child process of this binary with `UCX_TLS=tcp`.
#[test]
fn timed_out_transfer_keeps_blocks_pinned() {
    if !nixl_ready() {
        return;
    }
    const CHILD: &str = "ELASTIC_VMM_NIXL_TCP_CHILD";
    if std::env::var_os(CHILD).is_some() {
        suite::layout::nixl::timed_out_transfer_keeps_blocks_pinned(host());
        return;
    }
    let name = "timed_out_transfer_keeps_blocks_pinned";
    let out = std::process::Command::new(std::env::current_exe().expect("test binary"))
        .args(["--exact", name, "--nocapture", "--test-threads=1"])
        .env("UCX_TLS", "tcp")
        .env(CHILD, "1")
        .output()
        .expect("run the child");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    println!("child (UCX_TLS=tcp):\n{stdout}{stderr}");
    assert!(out.status.success(), "the child failed: {}", out.status);
    assert!(
        stdout.contains("1 passed"),
        "the child did not run the scenario"
    );
}

/// Block geometry of the two-process test: 4 layers x K/V x 16 tokens x 96 elements x 2 bytes
/// = 24 KiB per block, so blocks straddle the 2 MiB pages of the host backend.
fn peer_config(blocks: usize) -> elastic_vmm::layout::LayoutConfig {
    elastic_vmm::layout::LayoutConfig::new(blocks, 4, 2, 16, 96, 2)
}

/// Blocks offered per round: the second round offers fewer blocks in new memory, so the prefill
/// must forget the first metadata and load the second.
const PEER_ROUNDS: [usize; 2] = [200, 120];
/// WRITEs per round of WRITEs, per set (plain, elastic): plain has two rounds, so the decode
/// zeroes it again between them, as the bench does after its warm-up.
const PEER_WRITES: [&[usize]; 2] = [&[1, 2], &[1]];
const PEER_SOCKET: &str = "ELASTIC_VMM_NIXL_PEER_SOCKET";
const PEER_WAIT: std::time::Duration = std::time::Duration::from_secs(60);

/// The exchange `gpu-bench p2p` uses for its NIXL columns (`benches/gpu/nixl_peer.rs`), between
/// two real processes on host memory: this process is the prefill (the initiator: registers
/// and fills its memory, receives the decode's offer over a Unix socket of its own, loads its
/// metadata, WRITEs round by round and reports each round, times included), this binary again
/// the decode (the target, `PEER_SOCKET` set: registers and zeroes its memory, offers its
/// metadata and descriptors, keeps its agent progressing while it waits, checks every byte
/// after each round, zeroes again between rounds, answers). Per case, plain (a pool allocation
/// registered whole per chunk) and elastic memory (pages registered by the mapping hook;
/// 2 MiB pages on the prefill, 4 MiB on the decode, so the two descriptor lists split at
/// different places).
#[test]
fn two_processes_exchange_and_write() {
    if !nixl_ready() {
        return;
    }
    if let Some(path) = std::env::var_os(PEER_SOCKET) {
        peer_decode(std::path::Path::new(&path));
        return;
    }
    use elastic_vmm::layout::{KvLayout, LayoutBuilder};
    use std::process::{Command, Stdio};

    let name = "two_processes_exchange_and_write";
    let dir = std::env::temp_dir().join(format!("evmm-nixl-peer-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let sock = dir.join("nixl");
    let _ = std::fs::remove_file(&sock);
    let listener = std::os::unix::net::UnixListener::bind(&sock).expect("bind");
    let mut child = Command::new(std::env::current_exe().expect("test binary"))
        .args(["--exact", name, "--nocapture", "--test-threads=1"])
        .env(PEER_SOCKET, &sock)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn the decode process");
    let backend = host();
    let pool = suite::layout::pool(&backend, 256 << 20);
    let agent = NixlAgent::new("prefill").expect("agent");
    let result = (|| -> Result<(), nixl_peer::PeerError> {
        let mut stream =
            nixl_peer::accept_within(&listener, PEER_WAIT, || match child.try_wait()? {
                Some(st) => Err(format!("the decode process ended before connecting: {st}").into()),
                None => Ok(()),
            })?;
        for n in PEER_ROUNDS {
            let plain = agent.register(
                LayoutBuilder::new()
                    .config(peer_config(n))
                    .fully_contiguous()
                    .allocate(&pool, &MemOptions::new())
                    .build()?,
            )?;
            let kv = LayoutBuilder::new()
                .config(peer_config(n))
                .fully_contiguous()
                .elastic(&pool, &MemOptions::new())
                .hook(agent.mapping_hook())
                .build()?;
            kv.ensure_backed(0..n)?;
            let block = peer_config(n).sizes()?.block;
            for l in [&plain as &dyn KvLayout, &kv] {
                let base = l.views().block(0)?[0].addr;
                nixl_peer::write_pattern(n, block, |off, bytes| {
                    // SAFETY: inside the layout's `n` blocks, all backed; nothing else uses them.
                    unsafe { backend.copies().write(base + off, bytes) }.map_err(|e| e.into())
                })?;
            }
            let local = [
                nixl_peer::block_descriptors(&agent, &plain, n)?,
                nixl_peer::block_descriptors(&agent, &kv, n)?,
            ];
            assert_eq!(
                local[0].descs.len(),
                plain.chunks().len(),
                "one descriptor per chunk"
            );
            assert!(
                local[1].descs.len() >= 2,
                "{n} blocks of {block} bytes span several 2 MiB pages"
            );
            let frame = nixl_peer::recv_frame_within(&mut stream, &agent, PEER_WAIT)?;
            let offer = nixl_peer::Offer::decode(&frame)?;
            assert_eq!(offer.sets.len(), 2);
            let remote = nixl_peer::Remote::load(&agent, &offer.metadata)?;
            assert_eq!(remote.name(), "decode");
            for (set, ((what, mine), theirs)) in ["plain", "elastic"]
                .iter()
                .zip(&local)
                .zip(&offer.sets)
                .enumerate()
            {
                assert_eq!(
                    (theirs.blocks, theirs.block_bytes),
                    (n as u64, block),
                    "{what}"
                );
                let rounds = PEER_WRITES[set];
                for (k, &count) in rounds.iter().enumerate() {
                    let reports = (0..count)
                        .map(|_| {
                            nixl_peer::write(&agent, &remote, &mine.descs, &theirs.descs, PEER_WAIT)
                        })
                        .collect::<Result<Vec<_>, _>>()
                        .map_err(|e| format!("{what}: {e}"))?;
                    for r in &reports {
                        assert_eq!(r.bytes, n as u64 * block, "{what}");
                        println!(
                            "{what}: {n} blocks, {} bytes in {} descriptor pairs ({} local, {} \
                             remote) in {:?}",
                            r.bytes,
                            r.descriptors,
                            mine.descs.len(),
                            theirs.descs.len(),
                            r.elapsed
                        );
                    }
                    let written = nixl_peer::Written {
                        set: set as u32,
                        more: k + 1 < rounds.len(),
                        outcome: Ok(reports),
                    };
                    if !nixl_peer::report_round(&mut stream, &agent, &written, PEER_WAIT)? {
                        return Err(format!("{what}: the decode found wrong bytes").into());
                    }
                }
            }
            drop(remote);
            println!("round of {n} blocks: the decode verified plain and elastic memory");
        }
        Ok(())
    })();
    let out = child.wait_with_output().expect("decode process output");
    let _ = std::fs::remove_dir_all(&dir);
    let log = format!(
        "decode process ({}):\n{}{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    println!("{log}");
    if let Err(e) = result {
        panic!("prefill side: {e}");
    }
    assert!(out.status.success(), "the decode process failed");
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("1 passed"),
        "the decode process did not run its side"
    );
}

/// The decode side of [`two_processes_exchange_and_write`].
fn peer_decode(path: &std::path::Path) {
    use elastic_vmm::layout::{KvLayout, LayoutBuilder};

    let backend = host();
    let pool = suite::layout::pool(&backend, 256 << 20);
    let agent = NixlAgent::new("decode").expect("agent");
    let mut stream = std::os::unix::net::UnixStream::connect(path).expect("connect");
    for n in PEER_ROUNDS {
        let block = peer_config(n).sizes().expect("sizes").block;
        let len = n as u64 * block;
        let plain = agent
            .register(
                LayoutBuilder::new()
                    .config(peer_config(n))
                    .fully_contiguous()
                    .allocate(&pool, &MemOptions::new())
                    .build()
                    .expect("plain layout"),
            )
            .expect("register");
        let kv = LayoutBuilder::new()
            .config(peer_config(n))
            .fully_contiguous()
            .elastic(&pool, &MemOptions::new().chunk(4 << 20))
            .hook(agent.mapping_hook())
            .build()
            .expect("elastic layout");
        kv.ensure_backed(0..n).expect("back");
        let layouts = [&plain as &dyn KvLayout, &kv];
        let bases = layouts.map(|l| l.views().block(0).expect("block 0")[0].addr);
        let zero = |base: u64| {
            // SAFETY: the layout's `n` blocks, all backed; no WRITE into them runs (none has
            // started, or the prefill said its round is over).
            unsafe { backend.copies().fill(base, len as usize, 0) }.expect("zero");
        };
        bases.iter().for_each(|&b| zero(b));
        let sets = layouts
            .map(|l| nixl_peer::block_descriptors(&agent, l, n).expect("local descriptors"))
            .to_vec();
        let metadata = agent.raw().get_local_md().expect("metadata");
        let offer = nixl_peer::Offer { metadata, sets }
            .encode()
            .expect("encode");
        nixl_peer::send_frame(&mut stream, &offer).expect("send the offer");
        for (set, (what, base)) in ["plain", "elastic"].iter().zip(bases).enumerate() {
            let mut shape = Vec::new();
            loop {
                // Past this call no WRITE of the round runs (or the process has ended).
                let w = nixl_peer::wait_written(&mut stream, &agent, set as u32, PEER_WAIT * 3);
                let reports = w.outcome.unwrap_or_else(|e| panic!("{what}: {e}"));
                let checked = nixl_peer::verify_pattern(n, block, |off, out| {
                    // SAFETY: as in `zero`: the round is over.
                    unsafe { backend.copies().read(base + off, out) }.map_err(|e| e.into())
                });
                if checked.is_ok() && w.more {
                    zero(base);
                }
                nixl_peer::answer(&mut stream, checked.is_ok()).expect("answer");
                checked.unwrap_or_else(|e| panic!("{what}: {e}"));
                assert!(reports.iter().all(|r| r.bytes == len), "{what}");
                shape.push(reports.len());
                if !w.more {
                    break;
                }
            }
            assert_eq!(shape, PEER_WRITES[set], "{what}: WRITEs per round");
            println!("{what}: {n} blocks, rounds of {shape:?} WRITEs, every byte verified");
        }
    }
}

/// The side channel's wire formats (the decode's offer, the prefill's report of a round)
/// round-trip and refuse bad input with the numbers, never a panic or a huge allocation (no
/// NIXL call: runs without the library).
#[test]
fn offer_wire_format_refuses_bad_input() {
    use elastic_vmm::nixl::{sys::MemType, NixlDescriptor};
    use nixl_peer::{co_split, DescSet, Offer};

    let d = |addr, len, mem_type| NixlDescriptor {
        addr,
        len,
        mem_type,
        device_id: 1,
    };
    let offer = Offer {
        metadata: b"metadata bytes".to_vec(),
        sets: vec![
            DescSet {
                blocks: 3,
                block_bytes: 4096,
                descs: vec![
                    d(0x1000, 8192, MemType::Vram),
                    d(0x9000, 4096, MemType::Vram),
                ],
            },
            DescSet {
                blocks: 1,
                block_bytes: 64,
                descs: vec![d(0x40, 64, MemType::Dram)],
            },
        ],
    };
    let wire = offer.encode().expect("encode");
    assert_eq!(Offer::decode(&wire).expect("decode"), offer);
    for cut in [0, 7, 12, wire.len() - 1] {
        let e = Offer::decode(&wire[..cut]).expect_err("cut short");
        assert!(
            ["cut short", "not an offer", "bytes follow"]
                .iter()
                .any(|w| e.contains(w)),
            "{cut}: {e}"
        );
    }
    let mut trailing = wire.clone();
    trailing.push(0);
    assert!(Offer::decode(&trailing)
        .expect_err("trailing")
        .contains("1 bytes follow"));
    let mut bad_type = wire.clone();
    // The first descriptor's memory type byte: magic 8, md len 4 + 14, set count 4, blocks 8,
    // block bytes 8, count 4, address 8, length 8.
    bad_type[8 + 4 + 14 + 4 + 8 + 8 + 4 + 16] = 9;
    assert!(Offer::decode(&bad_type)
        .expect_err("type")
        .contains("memory type code 9"));
    let mut huge = wire.clone();
    huge[8 + 4 + 14..8 + 4 + 14 + 4].copy_from_slice(&u32::MAX.to_le_bytes());
    assert!(Offer::decode(&huge)
        .expect_err("huge")
        .contains("4294967295 sets"));
    assert!(Offer {
        metadata: vec![],
        sets: vec![DescSet {
            blocks: 1,
            block_bytes: 1,
            descs: vec![d(0, 1, MemType::File)],
        }],
    }
    .encode()
    .expect_err("file")
    .contains("cannot be offered"));

    // Frames: a length over the limit is refused before reading it.
    let mut r = std::io::Cursor::new((u32::MAX).to_le_bytes().to_vec());
    assert!(nixl_peer::recv_frame(&mut r)
        .expect_err("big")
        .to_string()
        .contains("limit"));

    // The prefill's report of a round of WRITEs.
    use nixl_peer::{TransferReport, Written};
    let report = TransferReport {
        bytes: 4096,
        descriptors: 3,
        elapsed: std::time::Duration::from_nanos(1_234_567),
    };
    let done = Written {
        set: 1,
        more: true,
        outcome: Ok(vec![report; 2]),
    };
    let wire = done.encode().expect("encode");
    assert_eq!(Written::decode(&wire).expect("decode"), done);
    for cut in [0, 7, 12, wire.len() - 1] {
        let e = Written::decode(&wire[..cut]).expect_err("cut short");
        assert!(
            ["report cut short", "bytes follow"]
                .iter()
                .any(|w| e.contains(w)),
            "{cut}: {e}"
        );
    }
    let mut trailing = wire.clone();
    trailing.push(0);
    assert!(Written::decode(&trailing)
        .expect_err("trailing")
        .contains("1 bytes follow the report"));
    assert!(Written::decode(&[&b"EVMMNX01"[..], &wire[8..]].concat())
        .expect_err("an offer's magic")
        .contains("not a report"));
    // Magic 8, set 4: `more` at 12, the status at 13, the report count at 14.
    let mut bad = wire.clone();
    bad[12] = 2;
    assert!(Written::decode(&bad)
        .expect_err("more")
        .contains("not 0 or 1"));
    let mut bad = wire.clone();
    bad[13] = 7;
    assert!(Written::decode(&bad)
        .expect_err("status")
        .contains("unknown status 7"));
    let mut bad = wire.clone();
    bad[14..18].copy_from_slice(&u32::MAX.to_le_bytes());
    assert!(Written::decode(&bad)
        .expect_err("huge")
        .contains("4294967295 transfers"));
    let failed = Written {
        set: 0,
        more: false,
        outcome: Err("post_xfer_req: refused".into()),
    };
    let wire = failed.encode().expect("encode");
    assert_eq!(Written::decode(&wire).expect("decode"), failed);
    assert!(Written {
        more: true,
        ..failed.clone()
    }
    .encode()
    .expect_err("more after a failure")
    .contains("cannot announce"));
    let mut bad = wire.clone();
    bad[12] = 1;
    assert!(Written::decode(&bad)
        .expect_err("more after a failure")
        .contains("announces more"));
    // The reason's first byte, after its length (14..18).
    let mut bad = wire.clone();
    bad[18] = 0xff;
    assert!(Written::decode(&bad)
        .expect_err("not UTF-8")
        .contains("not UTF-8"));

    // Cutting at the union of boundaries: [8192 + 4096] against [4096 + 8192].
    let (l, rm) = co_split(
        &[
            d(0x1000, 8192, MemType::Vram),
            d(0x9000, 4096, MemType::Vram),
        ],
        &[
            d(0x100000, 4096, MemType::Vram),
            d(0x200000, 8192, MemType::Vram),
        ],
    )
    .expect("same bytes");
    let pairs: Vec<_> = l
        .iter()
        .zip(&rm)
        .map(|(a, b)| (a.addr, b.addr, a.len))
        .collect();
    assert_eq!(
        pairs,
        [
            (0x1000, 0x100000, 4096),
            (0x2000, 0x200000, 4096),
            (0x9000, 0x201000, 4096)
        ]
    );
    assert!(
        co_split(&[d(0, 10, MemType::Dram)], &[d(0, 11, MemType::Dram)])
            .expect_err("differ")
            .contains("cover 10 bytes")
    );

    // The pattern: every byte checked, the culprit named.
    let (blocks, block) = (5usize, 100u64);
    let mut mem = vec![0u8; blocks * block as usize];
    nixl_peer::write_pattern(blocks, block, |off, b| {
        mem[off as usize..off as usize + b.len()].copy_from_slice(b);
        Ok(())
    })
    .expect("write");
    let check = |mem: &[u8]| {
        nixl_peer::verify_pattern(blocks, block, |off, out| {
            out.copy_from_slice(&mem[off as usize..off as usize + out.len()]);
            Ok(())
        })
    };
    check(&mem).expect("intact");
    mem[3 * 100 + 42] ^= 1;
    let e = check(&mem).expect_err("flipped").to_string();
    assert!(e.contains("block 3 of 5: byte 42 (offset 342)"), "{e}");
    assert!(nixl_peer::write_pattern(1, 1, |_, _| Ok(())).is_err());
}

/// Blocks between system memory and a file through NIXL's POSIX backend, with the real
/// library: registering a disk layout with a UCX-only agent creates its POSIX backend (FILE
/// needs one), the file's registrations live apart from memory's, WRITE puts the blocks in the
/// file (read back with std::fs) and READ brings them into other memory byte-exact. A kind no
/// backend of the agent moves is refused before any registration, naming the plugins.
#[test]
fn blocks_between_memory_and_a_file_through_posix() {
    use elastic_vmm::layout::{LayoutBuilder, LayoutConfig, MemoryRange, StorageKind};
    use elastic_vmm::nixl::{transfer_blocks, BlockSet, TransferOp};
    use elastic_vmm::MemoryKind;
    if !nixl_ready() {
        return;
    }
    let dir = std::env::temp_dir().join(format!("evmm-nixl-file-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("dir");
    let path = dir.join("kv.bin");
    let c = LayoutConfig::new(16, 2, 2, 16, 64, 2); // 8 KiB blocks
    let block = c.sizes().expect("sizes").block;
    let a = NixlAgent::new("files").expect("agent with UCX");
    assert!(!a.has_backend("POSIX"));
    let sys = |tag: u8| {
        let l = LayoutBuilder::new()
            .config(c)
            .fully_contiguous()
            .system()
            .build()
            .expect("system");
        let m = l.chunks()[0];
        // SAFETY: the layout's own memory, `m.len` bytes, nobody else uses it yet.
        let bytes = unsafe { std::slice::from_raw_parts_mut(m.addr as *mut u8, m.len as usize) };
        for (i, b) in bytes.iter_mut().enumerate() {
            *b = (i as u64 * 7 + tag as u64) as u8;
        }
        l
    };
    let disk = LayoutBuilder::new()
        .config(c)
        .fully_contiguous()
        .disk(&path)
        .build()
        .expect("disk");
    assert_eq!(disk.storage(), StorageKind::Disk);
    let disk = a.register(disk).expect("register FILE");
    assert!(
        a.has_backend("POSIX"),
        "POSIX created for the file: {:?}",
        a.backends()
    );
    // Registered after POSIX came: with UCX and POSIX both.
    let src = a.register(sys(1)).expect("register DRAM");
    assert_eq!(a.registrations(), 2);
    let blocks = [2usize, 3, 4, 9];
    let at = [0usize, 1, 2, 15];
    let t = std::time::Duration::from_secs(20);
    let w = transfer_blocks(
        TransferOp::Write,
        BlockSet {
            agent: &a,
            layout: &src,
            blocks: &blocks,
        },
        BlockSet {
            agent: &a,
            layout: &disk,
            blocks: &at,
        },
        t,
    )
    .expect("DRAM -> FILE");
    assert_eq!(w.bytes, 4 * block);
    let file = std::fs::read(&path).expect("read the file");
    let expect = |blk: usize, i: usize| ((blk * block as usize + i) as u64 * 7 + 1) as u8;
    for (&s, &d) in blocks.iter().zip(&at) {
        let got = &file[d * block as usize..(d + 1) * block as usize];
        assert!(
            got.iter().enumerate().all(|(i, &b)| b == expect(s, i)),
            "block {s} in the file at block {d}"
        );
    }
    let dst = a.register(sys(9)).expect("register DRAM");
    let r = transfer_blocks(
        TransferOp::Read,
        BlockSet {
            agent: &a,
            layout: &dst,
            blocks: &[5, 6, 7, 8],
        },
        BlockSet {
            agent: &a,
            layout: &disk,
            blocks: &at,
        },
        t,
    )
    .expect("FILE -> DRAM");
    assert_eq!(r.bytes, 4 * block);
    let m = dst.chunks()[0];
    // SAFETY: the layout's memory; the transfer finished.
    let mem = unsafe { std::slice::from_raw_parts(m.addr as *const u8, m.len as usize) };
    for (k, &s) in blocks.iter().enumerate() {
        let d = 5 + k;
        let got = &mem[d * block as usize..(d + 1) * block as usize];
        assert!(
            got.iter().enumerate().all(|(i, &b)| b == expect(s, i)),
            "block {s} back at {d}"
        );
    }
    drop((src, disk, dst));
    assert_eq!(a.registrations(), 0);

    // A POSIX-only agent cannot move device memory: refused before any registration.
    let p = NixlAgent::with_backend("posix-only", "POSIX").expect("POSIX agent");
    let keep = vec![0u8; 128 << 10];
    let base = (keep.as_ptr() as u64).next_multiple_of(512);
    // SAFETY: declared as device memory, refused before NIXL sees it; `keep` outlives it.
    let vram = unsafe {
        LayoutBuilder::new()
            .config(c)
            .fully_contiguous()
            .regions(vec![MemoryRange {
                addr: base,
                len: block * 16,
                kind: MemoryKind::Device,
                device: Some(0),
            }])
    }
    .build()
    .expect("caller layout");
    let e = p.register(vram).expect_err("no backend for VRAM");
    assert!(
        matches!(&e, Error::NixlNoBackend { have, .. } if have == &vec!["POSIX".to_string()])
            && e.to_string().contains("UCX or GDS_MT"),
        "{e}"
    );
    assert_eq!(p.registrations(), 0);
    drop(keep);
    std::fs::remove_dir_all(&dir).expect("clean up");
}
