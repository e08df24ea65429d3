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

/// Whether `len` bytes at `addr` can be read now, and what they are: `process_vm_readv` on
/// this process reports a page a kernel could not read (unmapped, or mapped without access)
/// as `EFAULT` instead of raising `SIGSEGV` (it does not force access, as `/proc/self/mem`
/// does).
fn probe(addr: u64, len: usize) -> Option<Vec<u8>> {
    let mut out = vec![0xEEu8; len];
    let local = libc::iovec {
        iov_base: out.as_mut_ptr().cast(),
        iov_len: len,
    };
    let remote = libc::iovec {
        iov_base: addr as *mut libc::c_void,
        iov_len: len,
    };
    // SAFETY: `local` is our own buffer of `len` bytes; the kernel checks `remote` and fails
    // with EFAULT where it is not readable, touching nothing else.
    let n = unsafe { libc::process_vm_readv(libc::getpid(), &local, 1, &remote, 1, 0) };
    (n == len as isize).then_some(out)
}

/// Issue 33, defect 2: a block nobody allocated, on the page of a block being allocated or
/// freed, must stay readable (zeros) all along: a padded block table is read by kernels while
/// other threads allocate and free. With maps slowed to 300 ms, a probe reads block 1 while
/// block 0 (same page) is allocated and freed.
#[test]
fn a_padded_read_finds_no_hole_while_a_neighbour_maps_or_unmaps() {
    use elastic_vmm::backend::testing::DelayInjector;
    use elastic_vmm::kv::{PagedKv, PagedKvConfig};
    use elastic_vmm::{DriverCall, Pool, PoolConfig};
    use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
    use std::time::Duration;

    let g: u64 = 2 << 20;
    let delays = Arc::new(DelayInjector::new(host()));
    let backend: Arc<dyn Backend> = delays.clone();
    let pool =
        Pool::new(backend, PoolConfig::new(64 * g as usize).growth_divisor(0)).expect("pool");
    // One layer (a K and a V tensor), two blocks of 256-byte tokens per page.
    let kv = PagedKv::new(
        &pool,
        PagedKvConfig::new(1, 2, 64, (g / 2 / 256) as usize, 2, 8),
    )
    .expect("cache");
    let span = kv.block_span_bytes();
    let block1: Vec<u64> = (0..kv.tensors())
        .map(|t| kv.tensor_addr(t).expect("tensor") + span)
        .collect();
    for &a in &block1 {
        assert_eq!(
            probe(a, 4096),
            Some(vec![0; 4096]),
            "block 1 reads zeros at rest"
        );
    }
    delays.set_delay(DriverCall::Map, Duration::from_millis(300));
    let stop = AtomicBool::new(false);
    let (holes, stale, reads) = (AtomicU64::new(0), AtomicU64::new(0), AtomicU64::new(0));
    std::thread::scope(|s| {
        s.spawn(|| {
            while !stop.load(Ordering::Acquire) {
                for &a in &block1 {
                    reads.fetch_add(1, Ordering::Relaxed);
                    match probe(a, 4096) {
                        None => holes.fetch_add(1, Ordering::Relaxed),
                        Some(b) if b.iter().any(|&x| x != 0) => {
                            stale.fetch_add(1, Ordering::Relaxed)
                        }
                        Some(_) => 0,
                    };
                }
                std::thread::sleep(Duration::from_micros(200));
            }
        });
        let ids = kv.alloc(1).expect("alloc");
        assert_eq!(ids, vec![0]);
        let during_alloc = holes.load(Ordering::Relaxed);
        kv.free(&ids).expect("free");
        stop.store(true, Ordering::Release);
        let during_free = holes.load(Ordering::Relaxed) - during_alloc;
        assert!(
            during_alloc == 0 && during_free == 0,
            "block 1 could not be read {during_alloc} times during block 0's alloc and \
             {during_free} times during its free ({} reads)",
            reads.load(Ordering::Relaxed)
        );
    });
    assert_eq!(stale.load(Ordering::Relaxed), 0, "block 1 read only zeros");
    assert!(delays.delayed(DriverCall::Map) >= 4, "the maps were slowed");
    pool.audit().expect("audit");
}
