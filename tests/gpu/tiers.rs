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

/// A host tier's memory is its NUMA node's host memory, not the device's: `memory_info` and
/// `total_memory` are the node's `MemTotal` (read here from the kernel's file), or
/// `/proc/meminfo`'s where the driver names no node or the kernel has no file for it.
#[test]
fn a_host_tier_reports_its_numa_nodes_memory() {
    use cudarc::driver::{result, sys};
    let device = cuda();
    let tier = CudaBackend::host_tier(0).expect("host VMM on CUDA device 0");
    // SAFETY: the driver is initialized (the backends above) and device 0 exists.
    let node = unsafe {
        result::device::get_attribute(
            result::device::get(0).expect("device 0"),
            sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_HOST_NUMA_ID,
        )
    }
    .expect("HOST_NUMA_ID");
    let node_file = format!("/sys/devices/system/node/node{node}/meminfo");
    let (path, text) = match std::fs::read_to_string(&node_file) {
        Ok(t) if node >= 0 => (node_file, t),
        _ => (
            "/proc/meminfo".to_string(),
            std::fs::read_to_string("/proc/meminfo").expect("/proc/meminfo"),
        ),
    };
    let mem_total = text
        .lines()
        .find_map(|l| {
            let rest = l.split_once("MemTotal:")?.1;
            let kib: u64 = rest.trim().strip_suffix("kB")?.trim().parse().ok()?;
            Some(kib * 1024)
        })
        .unwrap_or_else(|| panic!("no MemTotal in {path}: {text:?}"));
    let got = tier.memory_info().expect("host tier memory info");
    let dev = device.memory_info().expect("device memory info");
    println!(
        "host tier ({}) on NUMA node {node}: {} of {} bytes free; {path} MemTotal {mem_total}; device {} of {}",
        tier.info().device_name,
        got.free,
        got.total,
        dev.free,
        dev.total
    );
    assert_eq!(
        got.total, mem_total,
        "the host tier's total is {path}'s MemTotal"
    );
    assert_eq!(tier.info().total_memory, mem_total, "and so is its info's");
    assert!(got.free > 0 && got.free <= got.total, "{got:?}");
    assert_ne!(
        got.total, dev.total,
        "the device's memory is not the host tier's"
    );
    assert_ne!(tier.info().total_memory, device.info().total_memory);
}
