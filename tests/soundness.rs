//! Soundness on the host backend (real memfd memory): races widened with the delaying adaptor,
//! rollback of rollbacks, books checked while threads work.

#[path = "suite/mod.rs"]
mod suite;

use std::sync::Arc;

use elastic_vmm::backend::host::HostBackend;
use elastic_vmm::Backend;

fn host() -> Arc<dyn Backend> {
    Arc::new(HostBackend::new(2 << 20).expect("host backend"))
}

crate::soundness_suite!(host);

#[test]
fn stress_books_hold() {
    suite::soundness::stress_books_hold(host(), 25);
}

#[test]
fn thread_fronts_race_sleep_trim_and_stats() {
    suite::soundness::thread_fronts_race_sleep_trim_and_stats(host(), 40);
}
