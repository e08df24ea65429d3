//! The shared pool's behavioural suite on the host backend (real memory).

#[path = "suite/mod.rs"]
mod suite;

use std::sync::Arc;

use elastic_vmm::backend::host::HostBackend;
use elastic_vmm::Backend;

fn host() -> Arc<dyn Backend> {
    Arc::new(HostBackend::new(2 << 20).expect("host backend"))
}

crate::shared_suite!(host);

#[test]
fn concurrent_models() {
    suite::shared::concurrent_models(host(), 8, 4, 10, 300);
}

#[test]
fn hand_over() {
    let secs = suite::shared::hand_over(host(), 256 << 20, 16 << 20);
    println!("hand-over of 256 MiB on the host: {:.1} ms", secs * 1e3);
}

#[test]
fn a_lowered_limit_stays_at_least_the_guarantee() {
    suite::shared::a_lowered_limit_stays_at_least_the_guarantee(host());
}
