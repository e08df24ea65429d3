//! The pool's behavioural suite on the host backend (real `memfd` memory), plus host-only checks.

#[path = "suite/mod.rs"]
mod suite;

use std::sync::Arc;

use elastic_vmm::backend::host::HostBackend;
use elastic_vmm::Backend;

fn host() -> Arc<dyn Backend> {
    Arc::new(HostBackend::new(2 << 20).expect("host backend"))
}

crate::pool_suite!(host);

#[test]
fn concurrent_invariants() {
    suite::concurrent_invariants(host(), 12, 400);
}

/// Fresh physical memory on the host backend reads as zero (documented zeroing semantics).
#[test]
fn fresh_host_memory_is_zero() {
    let pool = elastic_vmm::Pool::new(host(), elastic_vmm::PoolConfig::new(1 << 30)).expect("pool");
    let a = pool.allocate(8 << 20).expect("alloc");
    let mut buf = vec![0xAAu8; 8 << 20];
    a.read(0, &mut buf).expect("read");
    assert!(buf.iter().all(|&b| b == 0));
}

/// A smaller granularity works the same way.
#[test]
fn small_granularity() {
    let backend: Arc<dyn Backend> = Arc::new(HostBackend::new(64 << 10).expect("host"));
    suite::range_api(backend.clone());
    suite::trim_returns_physical_memory(backend);
    assert!(
        HostBackend::new(3000).is_err(),
        "granularity must be a power of two >= page size"
    );
}
