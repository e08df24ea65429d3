//! Storage kinds and tier moves on CUDA: device memory <-> pinned host memory (`cuMemHostAlloc`
//! through the backend's staging) byte-exact through the copy stream, host <-> disk, injected
//! copy failures rolled back, many threads: the same suite as on the host.

use std::sync::Arc;

use elastic_vmm::backend::cuda::CudaBackend;
use elastic_vmm::Backend;

fn cuda() -> Arc<dyn Backend> {
    Arc::new(CudaBackend::new(0).expect("CUDA device 0 with VMM support"))
}

crate::tiers_suite!(cuda);

/// Caller memory's declared kind checked by the driver: device memory declared as host memory
/// is refused (`cuPointerGetAttribute`), and so is host memory declared as device memory.
#[test]
fn caller_device_memory_declared_host_is_refused() {
    use elastic_vmm::layout::{LayoutBuilder, LayoutConfig, MemoryRange};
    use elastic_vmm::{MemoryKind, Pool, PoolConfig};
    let backend = cuda();
    let pool = Pool::new(backend.clone(), PoolConfig::new(256 << 20)).expect("pool");
    let owner = pool.allocate(4 << 20).expect("device memory");
    let c = LayoutConfig::new(8, 2, 2, 16, 64, 2);
    let build = |addr: u64, kind, device| {
        // SAFETY: refused at build, or a layout over `owner`/`host` dropped at once.
        unsafe {
            LayoutBuilder::new()
                .config(c)
                .fully_contiguous()
                .regions(vec![MemoryRange {
                    addr,
                    len: 64 << 10,
                    kind,
                    device,
                }])
        }
        .checked_by(backend.clone())
        .build()
    };
    let e = build(owner.addr(), MemoryKind::Host, None).expect_err("device declared host");
    assert!(e.to_string().contains("driver says it is Device"), "{e}");
    let ordinal = backend.info().device_ordinal;
    build(owner.addr(), MemoryKind::Device, ordinal).expect("device declared device");
    let host = vec![0u8; 1 << 20];
    let addr = (host.as_ptr() as u64).next_multiple_of(4096);
    let e = build(addr, MemoryKind::Device, ordinal).expect_err("host declared device");
    assert!(e.to_string().contains("driver says it is Host"), "{e}");
    drop(host);
}
