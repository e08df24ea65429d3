//! NIXL registration and transfers on host memory with the real NIXL library (feature `nixl`).
//!
//! Without the library (`libnixl_capi.so` not on `LD_LIBRARY_PATH`) every test prints why and
//! skips: any NIXL call would abort the whole binary. With `ELASTIC_VMM_REQUIRE_NIXL` set (to
//! anything but `0`; scripts/test.sh sets it to 1) a missing library fails every test instead,
//! so CI cannot pass by skipping.
#![cfg(feature = "nixl")]

#[path = "suite/mod.rs"]
mod suite;

use std::sync::Arc;

use elastic_vmm::backend::host::HostBackend;
use elastic_vmm::nixl::{self, NixlAgent};
use elastic_vmm::{Backend, Error};

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
