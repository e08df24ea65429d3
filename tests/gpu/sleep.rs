//! The sleep suite on CUDA VMM: offload to pinned host memory, wake at the same addresses,
//! rollback at every driver call and copy, admission, concurrency, backings.

use std::sync::Arc;

use elastic_vmm::backend::cuda::CudaBackend;
use elastic_vmm::Backend;

use crate::suite;

fn cuda() -> Arc<dyn Backend> {
    Arc::new(CudaBackend::new(0).expect("CUDA device 0 with VMM support"))
}

crate::sleep_suite!(cuda);
