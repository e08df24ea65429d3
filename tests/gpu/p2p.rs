//! KV blocks between two processes on CUDA: the host suite's scenarios with device memory
//! (exported as POSIX descriptors, imported, mapped read-only as granted, copied
//! by the gather kernel or with `cuMemcpyDtoDAsync`/`cuMemcpyBatchAsync`), on one GPU and
//! across two (peer access); and odd shapes (units of 1, 3, 17, 1000 and 100003 bytes at odd
//! addresses, units crossing the kernel's 64 KiB pieces, scattered blocks) through the kernel.
//!
//! Each test spawns this test binary again as the other engine: the child runs the ignored
//! test `p2p::child_role` with `EVMM_CHILD_ROLE` naming its part.

use std::os::unix::net::UnixListener;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use elastic_vmm::backend::cuda::CudaBackend;
use elastic_vmm::layout::{BlockDim, LayoutConfig, LayoutKind};
use elastic_vmm::p2p::{self, CopyEngine, CopyStream, EngineChoice, GrantStatus, PeerLink};
use elastic_vmm::{AccessMode, Backend, DeviceReach};

#[path = "../common_p2p/mod.rs"]
mod scenario;

use scenario::{DST_BLOCKS, SRC_BLOCKS, WAIT};

const ROLE_VAR: &str = "EVMM_CHILD_ROLE";
const INNER: usize = 512;

fn cuda(ordinal: i32) -> Arc<dyn Backend> {
    let b = CudaBackend::new(ordinal).expect("CUDA device with VMM support");
    assert!(
        b.info().posix_fd_exportable,
        "device {ordinal} cannot export POSIX descriptors"
    );
    Arc::new(b)
}

fn temp_dir() -> PathBuf {
    let d = std::env::temp_dir().join(format!(
        "evmm-gpu-p2p-{}-{}",
        std::process::id(),
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_nanos()
    ));
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// Start this binary as `role` with its socket in `dir`.
fn spawn(role: &str, dir: &std::path::Path, device: i32) -> Child {
    spawn_with(role, dir, device, "auto")
}

/// As [`spawn`], the child copying with `engine` (`auto`, `kernel` or `memcpy`).
fn spawn_with(role: &str, dir: &std::path::Path, device: i32, engine: &str) -> Child {
    Command::new(std::env::current_exe().unwrap())
        .args([
            "p2p::child_role",
            "--exact",
            "--ignored",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(ROLE_VAR, role)
        .env("EVMM_SOCKET", dir.join("s"))
        .env("EVMM_DIR", dir)
        .env("EVMM_DEVICE", device.to_string())
        .env("EVMM_ENGINE", engine)
        .stdin(Stdio::null())
        .spawn()
        .expect("spawn child")
}

fn wait_child(mut c: Child, secs: u64) -> std::process::ExitStatus {
    let end = Instant::now() + Duration::from_secs(secs);
    loop {
        if let Some(st) = c.try_wait().unwrap() {
            return st;
        }
        if Instant::now() > end {
            let _ = c.kill();
            let _ = c.wait();
            panic!("child did not finish within {secs} s");
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

fn var(name: &str) -> String {
    std::env::var(name).unwrap_or_else(|_| panic!("child needs {name}"))
}

/// Entry point of the child processes (run by the tests below, never on its own).
#[test]
#[ignore = "child process of the p2p tests"]
fn child_role() {
    let role = var(ROLE_VAR);
    let device: i32 = var("EVMM_DEVICE").parse().unwrap();
    let backend = cuda(device);
    let link = PeerLink::connect(var("EVMM_SOCKET"), "decode", backend.clone()).unwrap();
    match role.as_str() {
        "decode" => {
            // A stream of our own, so the copies go as one batch where the driver can.
            let ctx = cudarc::driver::CudaContext::new(device as usize).unwrap();
            let s = ctx.new_stream().unwrap();
            // SAFETY: `s` outlives every completion of the scenario.
            let stream = unsafe { CopyStream::from_raw(s.cu_stream() as u64) };
            scenario::decode(&link, backend, INNER, stream, engine());
            s.synchronize().unwrap();
        }
        "odd-decode" => {
            let ctx = cudarc::driver::CudaContext::new(device as usize).unwrap();
            let s = ctx.new_stream().unwrap();
            // SAFETY: `s` outlives every completion of the scenario.
            let stream = unsafe { CopyStream::from_raw(s.cu_stream() as u64) };
            odd_decode(&link, backend, stream);
            s.synchronize().unwrap();
        }
        "adopt" => scenario::hand_off_receiver(&link, backend),
        "copy-loop" => {
            let pool = scenario::pool(backend, "decode");
            let kv = scenario::layout(
                &pool,
                LayoutKind::LayerSeparate(BlockDim::First),
                scenario::config(scenario::DST_COUNT, INNER),
            );
            kv.ensure_backed(DST_BLOCKS).unwrap();
            let g = link.recv_grant(WAIT).unwrap();
            let marker = PathBuf::from(var("EVMM_DIR")).join("copying");
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
        other => panic!("unknown role {other}"),
    }
}

/// The engine the parent asked this child to copy with.
fn engine() -> EngineChoice {
    match var("EVMM_ENGINE").as_str() {
        "kernel" => EngineChoice::Kernel,
        "memcpy" => EngineChoice::Memcpy,
        _ => EngineChoice::Auto,
    }
}

fn device_count() -> i32 {
    // The backend initialises the driver before the count is asked.
    drop(cuda(0));
    cudarc::driver::result::device::get_count().unwrap_or(1)
}

/// The two-GPU tests fail, rather than pass silently or hang, where there is one GPU.
fn needs_two_gpus() {
    let n = device_count();
    assert!(n >= 2, "needs two GPUs, found {n}");
}

fn byte_exact(prefill_device: i32, decode_device: i32) {
    byte_exact_with(prefill_device, decode_device, "auto")
}

fn byte_exact_with(prefill_device: i32, decode_device: i32, engine: &str) {
    let dir = temp_dir();
    let listener: UnixListener = p2p::listen(dir.join("s")).unwrap();
    let child = spawn_with("decode", &dir, decode_device, engine);
    let backend = cuda(prefill_device);
    let link = PeerLink::accept_within(&listener, "prefill", backend.clone(), WAIT).unwrap();
    println!("path: {:?}", link.path());
    scenario::prefill(&link, backend, INNER);
    assert!(wait_child(child, 120).success(), "decode process failed");
    let _ = std::fs::remove_dir_all(dir);
}

/// Three layout kinds between two processes on GPU 0, every byte checked.
#[test]
fn p2p_one_gpu_byte_exact() {
    byte_exact(0, 0);
}

/// The same through the gather kernel for every kind.
#[test]
fn p2p_one_gpu_byte_exact_kernel() {
    byte_exact_with(0, 0, "kernel");
}

/// The same with one `cuMemcpyAsync` per merged run.
#[test]
fn p2p_one_gpu_byte_exact_memcpy() {
    byte_exact_with(0, 0, "memcpy");
}

/// Prefill on GPU 0, decode on GPU 1 (imports mapped with peer access). Needs two GPUs:
/// `--ignored p2p_two_gpus` on nvidia-h200-x2.
#[test]
#[ignore = "needs two GPUs"]
fn p2p_two_gpus_byte_exact() {
    needs_two_gpus();
    byte_exact(0, 1);
}

/// The decode process is killed while it copies from a grant: the prefill process unpins,
/// and the device memory goes back once the blocks are released.
fn receiver_killed(decode_device: i32) {
    let dir = temp_dir();
    let listener = p2p::listen(dir.join("s")).unwrap();
    let backend = cuda(0);
    let free0 = backend.memory_info().unwrap().free;
    let mut child = spawn("copy-loop", &dir, decode_device);
    let link = PeerLink::accept_within(&listener, "prefill", backend.clone(), WAIT).unwrap();
    let pool = scenario::pool(backend.clone(), "prefill");
    let kv = scenario::layout(
        &pool,
        LayoutKind::LayerSeparate(BlockDim::First),
        scenario::config(scenario::SRC_COUNT, INNER),
    );
    kv.ensure_backed(SRC_BLOCKS).unwrap();
    let g = link.grant(&kv, &SRC_BLOCKS, AccessMode::ReadOnly).unwrap();
    let end = Instant::now() + WAIT;
    while !dir.join("copying").exists() {
        assert!(Instant::now() < end, "child never copied");
        std::thread::sleep(Duration::from_millis(5));
    }
    child.kill().unwrap();
    child.wait().unwrap();
    assert_eq!(g.wait_released(WAIT).unwrap(), GrantStatus::PeerExited);
    assert_eq!(link.stats().grants_out, 0);
    kv.release(SRC_BLOCKS).unwrap();
    drop(kv);
    pool.trim().unwrap();
    drop(pool);
    assert_eq!(backend.physical_bytes().unwrap(), 0);
    // The killed process's imports went with it: the device has its memory back.
    let end = Instant::now() + WAIT;
    loop {
        let free = backend.memory_info().unwrap().free;
        if free + (64 << 20) >= free0 {
            break;
        }
        assert!(
            Instant::now() < end,
            "device free memory {free} stays below {free0}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn p2p_one_gpu_receiver_killed_mid_transfer() {
    receiver_killed(0);
}

#[test]
#[ignore = "needs two GPUs"]
fn p2p_two_gpus_receiver_killed_mid_transfer() {
    needs_two_gpus();
    receiver_killed(1);
}

/// Ownership hand-off between two processes on GPU 0: no copy, the memory changes hands.
#[test]
fn p2p_one_gpu_hand_off() {
    let dir = temp_dir();
    let listener = p2p::listen(dir.join("s")).unwrap();
    let child = spawn("adopt", &dir, 0);
    let backend = cuda(0);
    let link = PeerLink::accept_within(&listener, "prefill", backend.clone(), WAIT).unwrap();
    scenario::hand_off_sender(&link, backend);
    assert!(wait_child(child, 120).success(), "adopting process failed");
    let _ = std::fs::remove_dir_all(dir);
}

/// Blocks in the sender's layout of the odd shapes, the blocks granted, and where they land in
/// the receiver's layout of [`ODD_DST_COUNT`] blocks (scattered: no run merges).
const ODD_SRC_COUNT: usize = 40;
const ODD_SRC_BLOCKS: [usize; 8] = [0, 1, 2, 7, 13, 21, 22, 39];
const ODD_DST_COUNT: usize = 24;
const ODD_DST_BLOCKS: [usize; 8] = [23, 5, 6, 0, 17, 3, 9, 11];
/// Destination blocks next to the copied ones, written before and checked after.
const ODD_NEIGHBOURS: [usize; 3] = [1, 4, 22];

/// Shapes both processes walk: units (one token of `inner` 1-byte elements) of 1, 3, 17, 1000
/// and 100003 bytes, so spans start at odd addresses and end anywhere, and units of 256 KiB
/// (16 tokens of 8192 2-byte elements), which cross the kernel's 64 KiB pieces; every kind.
fn odd_cases() -> Vec<(LayoutKind, usize, usize, usize)> {
    let mut v = Vec::new();
    for kind in scenario::KINDS {
        for unit in [1, 3, 17, 1000, 100_003] {
            v.push((kind, 1, unit, 1));
        }
        v.push((kind, 16, 8192, 2));
    }
    v
}

fn odd_config(blocks: usize, (page, inner, dtype): (usize, usize, usize)) -> LayoutConfig {
    LayoutConfig::new(blocks, 3, 2, page, inner, dtype)
}

/// Prefill of the odd shapes: back, write and grant the blocks, wait for the receiver.
fn odd_prefill(link: &PeerLink, backend: Arc<dyn Backend>) {
    let pool = scenario::pool(backend.clone(), "prefill");
    for (round, (kind, page, inner, dtype)) in odd_cases().into_iter().enumerate() {
        let kv = scenario::layout(&pool, kind, odd_config(ODD_SRC_COUNT, (page, inner, dtype)));
        kv.ensure_backed(ODD_SRC_BLOCKS).unwrap();
        for b in ODD_SRC_BLOCKS {
            scenario::fill(&kv, b, round as u64);
        }
        scenario::settle(&backend);
        let g = link
            .grant(&kv, &ODD_SRC_BLOCKS, AccessMode::ReadOnly)
            .unwrap();
        assert_eq!(g.wait_released(WAIT).unwrap(), GrantStatus::Released);
        kv.release(ODD_SRC_BLOCKS).unwrap();
    }
}

/// Decode of the odd shapes: through the kernel into scattered blocks, then with the engine
/// chosen by the policy, then packed into a pool range by the kernel (`copy_to`); every byte
/// checked, the neighbours untouched.
fn odd_decode(link: &PeerLink, backend: Arc<dyn Backend>, stream: CopyStream) {
    let pool = scenario::pool(backend.clone(), "decode");
    // Where `copy_to` packs the blocks: a pool of its own, mapped through the range API.
    let packed = scenario::pool(backend.clone(), "packed");
    for (round, (kind, page, inner, dtype)) in odd_cases().into_iter().enumerate() {
        let g = link.recv_grant(WAIT).unwrap();
        let config = odd_config(ODD_DST_COUNT, (page, inner, dtype));
        let kv = scenario::layout(&pool, kind, config);
        kv.ensure_backed(ODD_DST_BLOCKS).unwrap();
        kv.ensure_backed(ODD_NEIGHBOURS).unwrap();
        let len = scenario::contents(&kv, ODD_DST_BLOCKS[0]).len();
        let check = |what: &str| {
            for (s, d) in ODD_SRC_BLOCKS.into_iter().zip(ODD_DST_BLOCKS) {
                assert!(
                    scenario::contents(&kv, d) == scenario::pattern(round as u64, s, len),
                    "{what}: block {s} -> {d} differs ({kind}, unit of {inner} x {dtype} bytes x {page})"
                );
            }
            for n in ODD_NEIGHBOURS {
                assert!(
                    scenario::contents(&kv, n) == scenario::pattern(2000, n, len),
                    "{what}: neighbour {n} was overwritten ({kind}, unit {inner} x {dtype} x {page})"
                );
            }
        };
        for (engine, expect) in [
            (EngineChoice::Kernel, Some(CopyEngine::Kernel)),
            (EngineChoice::Auto, None),
            (EngineChoice::Memcpy, Some(CopyEngine::Memcpy)),
        ] {
            for b in ODD_DST_BLOCKS {
                scenario::fill(&kv, b, 3000);
            }
            for n in ODD_NEIGHBOURS {
                scenario::fill(&kv, n, 2000);
            }
            scenario::settle(&backend);
            let r = g
                .copy_into_with(&kv, &ODD_DST_BLOCKS, stream, engine)
                .unwrap()
                .wait()
                .unwrap();
            if let Some(e) = expect {
                assert_eq!(r.engine, e, "{r:?}");
            }
            assert_eq!(r.bytes, (len * ODD_SRC_BLOCKS.len()) as u64);
            check(&format!("{engine:?}"));
        }
        // Packed into a pool range by the kernel, at an offset of one granule.
        let gran = packed.granularity();
        let bytes = (len * ODD_SRC_BLOCKS.len()) as u64;
        let mapped = bytes.div_ceil(gran) * gran;
        packed.map(gran, mapped).unwrap();
        let r = g
            .copy_to_with(&packed, gran, stream, EngineChoice::Kernel)
            .unwrap()
            .wait()
            .unwrap();
        assert_eq!((r.engine, r.bytes), (CopyEngine::Kernel, bytes), "{r:?}");
        let mut got = vec![0u8; bytes as usize];
        // SAFETY: the range is mapped (above) and the copy into it completed.
        unsafe {
            backend
                .copies()
                .read(packed.base() + gran, &mut got)
                .unwrap()
        };
        for (i, s) in ODD_SRC_BLOCKS.into_iter().enumerate() {
            assert!(
                got[i * len..(i + 1) * len] == scenario::pattern(round as u64, s, len)[..],
                "copy_to: block {s} differs ({kind}, unit {inner} x {dtype} x {page})"
            );
        }
        packed.unmap(gran, mapped).unwrap();
        drop(g);
        kv.release(ODD_DST_BLOCKS).unwrap();
        kv.release(ODD_NEIGHBOURS).unwrap();
    }
}

fn odd_shapes(decode_device: i32) {
    let dir = temp_dir();
    let listener: UnixListener = p2p::listen(dir.join("s")).unwrap();
    let child = spawn("odd-decode", &dir, decode_device);
    let backend = cuda(0);
    let link = PeerLink::accept_within(&listener, "prefill", backend.clone(), WAIT).unwrap();
    odd_prefill(&link, backend);
    assert!(wait_child(child, 300).success(), "decode process failed");
    let _ = std::fs::remove_dir_all(dir);
}

/// Odd shapes between two processes on GPU 0, through the gather kernel and the memcpy
/// engine, every byte checked.
#[test]
fn p2p_one_gpu_odd_shapes_byte_exact() {
    odd_shapes(0);
}

/// The odd shapes with the kernel on GPU 1 reading GPU 0's memory over the peer mapping.
/// Ignored by default (run with `--ignored p2p_two_gpus` on a two-GPU machine); it fails,
/// rather than passing silently, where there is one GPU.
#[test]
#[ignore = "needs two GPUs"]
fn p2p_two_gpus_odd_shapes_byte_exact() {
    needs_two_gpus();
    odd_shapes(1);
}

/// The three kinds through the kernel on GPU 1, from GPU 0. Ignored by default, as above.
#[test]
#[ignore = "needs two GPUs"]
fn p2p_two_gpus_byte_exact_kernel() {
    needs_two_gpus();
    byte_exact_with(0, 1, "kernel");
}

/// A GPU is found by UUID, as another process names it: our own is the same device, an
/// unknown UUID is not visible, every other device of this machine is found at its ordinal
/// (with or without peer access).
#[test]
fn p2p_device_reach_is_by_uuid() {
    let n = device_count();
    let b = cuda(0);
    let uuid = b.info().device_uuid.expect("a CUDA device has a UUID");
    println!("device 0: {}", elastic_vmm::backend::format_uuid(&uuid));
    assert_eq!(b.reach(&uuid).unwrap(), DeviceReach::Same);
    assert_eq!(b.reach(&[0xa5; 16]).unwrap(), DeviceReach::NotVisible);
    for i in 1..n {
        let u = cuda(i).info().device_uuid.unwrap();
        assert_ne!(u, uuid, "devices 0 and {i} share a UUID");
        let r = b.reach(&u).unwrap();
        println!(
            "device {i}: {} reached as {r:?}",
            elastic_vmm::backend::format_uuid(&u)
        );
        assert!(
            matches!(r, DeviceReach::Peer { ordinal } | DeviceReach::NoPeerAccess { ordinal } if ordinal == i),
            "device {i}: {r:?}"
        );
    }
}
