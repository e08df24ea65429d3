//! The pool's behavioural suite on CUDA VMM, plus device-only checks: data written by the
//! device reads back, and `cuMemGetInfo` sees physical memory return to the device.

use std::sync::Arc;

use cudarc::driver::result;
use elastic_vmm::backend::cuda::CudaBackend;
use elastic_vmm::{Backend, Pool, PoolConfig};

use crate::suite::{self, GIB, MIB};

fn cuda() -> Arc<dyn Backend> {
    Arc::new(CudaBackend::new(0).expect("CUDA device 0 with VMM support"))
}

crate::pool_suite!(cuda);

#[test]
fn concurrent_invariants() {
    suite::concurrent_invariants(cuda(), 6, 150);
}

#[test]
fn backend_reports_the_device() {
    let b = cuda();
    let i = b.info();
    println!(
        "device {:?} ordinal {:?}: granularity {} (min {}), rdma {}, posix fd {}, total {}",
        i.device_name,
        i.device_ordinal,
        i.granularity,
        i.min_granularity,
        i.rdma_capable,
        i.posix_fd_exportable,
        i.total_memory
    );
    assert_eq!(i.name, "cuda");
    assert!(i.vmm_supported);
    assert!(i.granularity >= i.min_granularity && i.granularity % i.min_granularity == 0);
    assert!(i.total_memory > GIB);
    assert!(
        CudaBackend::new(1000).is_err(),
        "a missing ordinal is an error, not a panic"
    );
}

/// Device-side copies cross chunk boundaries: an allocation backed by several chunks behaves as
/// one contiguous buffer for the GPU, and the device's copy lands byte for byte.
#[test]
fn device_copies_across_chunks_read_back() {
    let b = cuda();
    let g = b.info().granularity;
    let pool = Pool::new(
        b,
        PoolConfig::new(4 * GIB as usize)
            .max_chunk(g)
            .growth_divisor(0),
    )
    .expect("pool");
    let n = 5 * g + 12345;
    let mut src = pool.allocate(n).expect("src");
    let dst = pool.allocate(n).expect("dst");
    assert!(
        pool.chunks_in(src.offset(), n as u64).len() >= 5,
        "the source spans several chunks"
    );
    let data: Vec<u8> = (0..n).map(|i| (i * 7 + i / 4099) as u8).collect();
    src.write(0, &data).expect("upload");
    // The backend leaves this thread's context as it found it (none): the raw copy binds the
    // device's primary context (the backend's) itself.
    let ctx = cudarc::driver::CudaContext::new(0).expect("context");
    ctx.bind_to_thread().expect("bind");
    // SAFETY: both ranges are live allocations of n bytes on this context's device.
    unsafe { result::memcpy_dtod_sync(dst.addr(), src.addr(), n) }.expect("device-to-device copy");
    let mut back = vec![0u8; n];
    dst.read(0, &mut back).expect("download");
    assert!(back == data, "device copy across chunks corrupted data");
}

/// Issue 22, defect 13 (part): a backend call leaves the calling thread's current context as
/// it found it, none or a context of the caller's own (routing's hooks run inside cudarc's calls,
/// with cudarc's context current).
#[test]
fn backend_calls_leave_the_callers_context_current() {
    use cudarc::driver::sys;
    std::thread::spawn(|| {
        let current = || result::ctx::get_current().expect("cuCtxGetCurrent");
        let b = cuda();
        assert_eq!(
            current(),
            None,
            "making the backend left its context current"
        );
        let chunk = b.create(b.info().granularity).expect("create");
        assert_eq!(current(), None, "a backend call left its context current");
        let dev = result::device::get(0).expect("device 0");
        let mut mine: sys::CUcontext = std::ptr::null_mut();
        // SAFETY: a valid out-pointer; no parameters ask for a plain context, destroyed below.
        unsafe { sys::cuCtxCreate_v4(&mut mine, std::ptr::null_mut(), 0, dev) }
            .result()
            .expect("cuCtxCreate");
        assert_eq!(current(), Some(mine));
        // SAFETY: a chunk of ours, never mapped, released once.
        unsafe { b.release(chunk) }.expect("release");
        assert_eq!(
            current(),
            Some(mine),
            "a backend call switched the caller's context"
        );
        // SAFETY: our own context, current on this thread only, used by nothing else.
        unsafe { sys::cuCtxDestroy_v2(mine) }
            .result()
            .expect("cuCtxDestroy");
    })
    .join()
    .unwrap();
}

/// `cuMemGetInfo` shows physical memory leaving the device when the pool maps it and coming back
/// after unmap + trim.
#[test]
fn device_memory_returns_after_trim() {
    let b = cuda();
    let pool = Pool::new(b.clone(), PoolConfig::new(64 * GIB as usize)).expect("pool");
    let free0 = b.memory_info().expect("info").free;
    let allocs: Vec<_> = (0..4)
        .map(|_| pool.allocate(GIB as usize).expect("1 GiB"))
        .collect();
    pool.map(32 * GIB, 2 * GIB).expect("range");
    let free1 = b.memory_info().expect("info").free;
    println!(
        "cuMemGetInfo free: {} MiB before, {} MiB with 6 GiB mapped",
        free0 / MIB,
        free1 / MIB
    );
    assert!(
        free0 - free1 >= 6 * GIB - 64 * MIB,
        "mapping 6 GiB took only {} MiB from the device",
        (free0 - free1) / MIB
    );
    drop(allocs);
    pool.unmap(32 * GIB, 2 * GIB).expect("unmap");
    let free2 = b.memory_info().expect("info").free;
    assert!(
        free2 <= free1 + 64 * MIB,
        "idle and cached memory is still held before trim"
    );
    let report = pool.trim().expect("trim");
    let free3 = b.memory_info().expect("info").free;
    println!(
        "after free + unmap: {} MiB; after trim ({report:?}): {} MiB",
        free2 / MIB,
        free3 / MIB
    );
    assert!(
        free3 + 64 * MIB >= free0,
        "trim gave back only {} of {} MiB",
        (free3 - free1) / MIB,
        (free0 - free1) / MIB
    );
    assert_eq!(pool.stats().physical(), 0);
}
