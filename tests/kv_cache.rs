//! The paged KV cache on the host backend (real `memfd` memory, the zero page mapped read-only
//! under many addresses).

#[path = "suite/mod.rs"]
mod suite;

use std::sync::Arc;

use elastic_vmm::backend::host::HostBackend;
use elastic_vmm::Backend;

fn host() -> Arc<dyn Backend> {
    Arc::new(HostBackend::new(2 << 20).expect("host backend"))
}

crate::kv_suite!(host);
