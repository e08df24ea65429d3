//! KV blocks between two processes on CUDA: the host suite's scenarios with device memory
//! (exported as POSIX descriptors, imported, mapped read-only where the driver allows, copied
//! with `cuMemcpyDtoDAsync`/`cuMemcpyBatchAsync`), on one GPU and across two (peer access).
//!
//! Each test spawns this test binary again as the other engine: the child runs the ignored
//! test `p2p::child_role` with `EVMM_CHILD_ROLE` naming its part.

use std::os::unix::net::UnixListener;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use elastic_vmm::backend::cuda::CudaBackend;
use elastic_vmm::layout::{BlockDim, LayoutKind};
use elastic_vmm::p2p::{self, CopyStream, GrantStatus, PeerLink};
use elastic_vmm::{AccessMode, Backend};

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
            scenario::decode(&link, backend, INNER, stream);
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

fn byte_exact(prefill_device: i32, decode_device: i32) {
    let dir = temp_dir();
    let listener: UnixListener = p2p::listen(dir.join("s")).unwrap();
    let child = spawn("decode", &dir, decode_device);
    let backend = cuda(prefill_device);
    let link = PeerLink::accept(&listener, "prefill", backend.clone()).unwrap();
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

/// Prefill on GPU 0, decode on GPU 1 (imports mapped with peer access). Needs two GPUs:
/// `--ignored p2p_two_gpus` on nvidia-h200-x2.
#[test]
#[ignore = "needs two GPUs"]
fn p2p_two_gpus_byte_exact() {
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
    let link = PeerLink::accept(&listener, "prefill", backend.clone()).unwrap();
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
    receiver_killed(1);
}

/// Ownership hand-off between two processes on GPU 0: no copy, the memory changes hands.
#[test]
fn p2p_one_gpu_hand_off() {
    let dir = temp_dir();
    let listener = p2p::listen(dir.join("s")).unwrap();
    let child = spawn("adopt", &dir, 0);
    let backend = cuda(0);
    let link = PeerLink::accept(&listener, "prefill", backend.clone()).unwrap();
    scenario::hand_off_sender(&link, backend);
    assert!(wait_child(child, 120).success(), "adopting process failed");
    let _ = std::fs::remove_dir_all(dir);
}
