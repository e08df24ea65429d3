//! Sleep and wake on the host backend (real memfd memory). Resident memory dropping on sleep is
//! checked in `host_resident.rs`, alone in its binary.

#[path = "suite/mod.rs"]
mod suite;

use std::sync::Arc;

use elastic_vmm::backend::host::HostBackend;
use elastic_vmm::Backend;

fn host() -> Arc<dyn Backend> {
    Arc::new(HostBackend::new(2 << 20).expect("host backend"))
}

crate::sleep_suite!(host);
