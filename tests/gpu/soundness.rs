//! The soundness suite on CUDA VMM: the same interleavings, rollbacks and books as on the host.

use std::sync::Arc;

use elastic_vmm::backend::cuda::CudaBackend;
use elastic_vmm::Backend;

use crate::suite;

fn cuda() -> Arc<dyn Backend> {
    Arc::new(CudaBackend::new(0).expect("CUDA device 0 with VMM support"))
}

crate::soundness_suite!(cuda);

#[test]
fn stress_books_hold() {
    suite::soundness::stress_books_hold(cuda(), 10);
}
