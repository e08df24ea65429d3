//! The paged KV cache on CUDA VMM: the same suite as on the host (the zero page mapped
//! read-only under many addresses with `cuMemSetAccess(PROT_READ)`).

use std::sync::Arc;

use elastic_vmm::backend::cuda::CudaBackend;
use elastic_vmm::Backend;

fn cuda() -> Arc<dyn Backend> {
    Arc::new(CudaBackend::new(0).expect("CUDA device 0 with VMM support"))
}

crate::kv_suite!(cuda);
