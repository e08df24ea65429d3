//! The sleep suite on CUDA VMM: offload to pinned host memory, wake at the same addresses,
//! rollback at every driver call and copy, admission, concurrency, backings.

use std::sync::Arc;

use elastic_vmm::backend::cuda::CudaBackend;
use elastic_vmm::{AfterWake, Backend, MemOptions, Pool, PoolConfig, SleepPolicy, Tag};

fn cuda() -> Arc<dyn Backend> {
    Arc::new(CudaBackend::new(0).expect("CUDA device 0 with VMM support"))
}

crate::sleep_suite!(cuda);

/// 2 GiB in 1 GiB chunks through pinned staging (several 256 MiB pieces per chunk run):
/// every 64 MiB stripe keeps its own byte, at the same address, twice over the same staging.
#[test]
fn large_offload_through_pinned_staging() {
    const MIB: usize = 1 << 20;
    let backend = cuda();
    let p = Pool::new(backend.clone(), PoolConfig::new(64 << 30)).expect("pool");
    p.reserve_host_staging(2 << 30).expect("pin 2 GiB ahead");
    let mut stripes = Vec::new();
    for i in 0..32u8 {
        let mut a = p
            .allocate_with(64 * MIB, &MemOptions::new().tag(Tag::Weights))
            .expect("allocate");
        a.fill(i.wrapping_mul(7).wrapping_add(1)).expect("fill");
        stripes.push(a);
    }
    let addrs: Vec<u64> = stripes.iter().map(|a| a.addr()).collect();
    let mut staging = 0;
    for round in 0..2 {
        let r = p.sleep(&SleepPolicy::offload_all()).expect("sleep");
        assert!(r.offloaded >= 2 << 30, "{r:?}");
        assert_eq!(p.stats().mapped, 0);
        // Whole chunks are copied (growth maps ahead, so a little more than 2 GiB); the second
        // sleep reuses the first one's staging.
        let now = p.stats().host_staging;
        assert!(now >= r.offloaded, "{now} < {}", r.offloaded);
        if round == 1 {
            assert_eq!(now, staging, "staging reused");
        }
        staging = now;
        let w = p.wake(AfterWake::KeepHostMemory).expect("wake");
        println!(
            "round {round}: sleep {:.1} ms, wake {:.1} ms for {} bytes",
            r.duration.as_secs_f64() * 1e3,
            w.duration.as_secs_f64() * 1e3,
            w.restored
        );
        for (i, a) in stripes.iter().enumerate() {
            assert_eq!(a.addr(), addrs[i]);
            let want = (i as u8).wrapping_mul(7).wrapping_add(1);
            let mut head = [0u8; 4096];
            let mut tail = [0u8; 4096];
            a.read(0, &mut head).expect("read");
            a.read(64 * MIB - 4096, &mut tail).expect("read");
            assert!(
                head.iter().chain(&tail).all(|&b| b == want),
                "stripe {i} differs after wake"
            );
        }
        p.audit().expect("audit");
    }
}
