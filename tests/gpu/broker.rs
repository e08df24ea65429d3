//! The broker on CUDA VMM: chunks created by the broker, exported as POSIX descriptors,
//! imported and mapped by engines; a hand-over between two engines with no create and no
//! release; the device's free memory back when an engine's connection goes. (Separate engine
//! processes on CUDA: `gpu-bench broker`; on the host backend: the `processes` test target.)

use std::sync::Arc;

use elastic_vmm::backend::cuda::CudaBackend;
use elastic_vmm::broker::{Broker, BrokerClient, BrokerConfig};
use elastic_vmm::{Backend, MemOptions, ModelConfig, PoolConfig};

use crate::suite::{GIB, MIB};

fn socket(tag: &str) -> std::path::PathBuf {
    std::env::temp_dir()
        .join(format!("evmm-gpu-{tag}-{}", std::process::id()))
        .join("b.sock")
}

#[test]
fn chunks_travel_between_engines_without_create_or_release() {
    let cuda = Arc::new(CudaBackend::new(0).expect("CUDA device 0 with VMM support"));
    assert!(cuda.info().posix_fd_exportable, "POSIX-fd export supported");
    let broker = Broker::start(cuda.clone(), BrokerConfig::new(socket("handover"), 2 * GIB))
        .expect("broker");
    let cfg = || PoolConfig::new((8 * GIB) as usize).max_chunk((64 * MIB) as usize);
    let ca = BrokerClient::connect(broker.socket(), "a").unwrap();
    let cb = BrokerClient::connect(broker.socket(), "b").unwrap();
    let a = ca
        .register(ModelConfig::new("a", (8 * GIB) as usize, 2 * GIB).pool_config(cfg()))
        .unwrap();
    let b = cb
        .register(ModelConfig::new("b", (8 * GIB) as usize, 2 * GIB).pool_config(cfg()))
        .unwrap();
    a.map_with(0, GIB, &MemOptions::new().chunk(64 * MIB))
        .unwrap();
    // SAFETY: [0, 1 GiB) was just mapped with access and nothing else uses it.
    unsafe {
        a.backend()
            .copies()
            .fill(a.base(), GIB as usize, 0x3c)
            .unwrap()
    };
    a.unmap(0, GIB).unwrap();
    a.trim().unwrap();
    let before = broker.snapshot().counters;
    let t = std::time::Instant::now();
    b.map_with(0, GIB, &MemOptions::new().chunk(64 * MIB))
        .unwrap();
    let took = t.elapsed();
    let after = broker.snapshot().counters;
    let mut byte = [0u8; 1];
    // SAFETY: mapped with access just above.
    unsafe {
        b.backend()
            .copies()
            .read(b.base() + GIB - 1, &mut byte)
            .unwrap()
    };
    println!("1 GiB handed over in {took:.2?}; {after:?}");
    // The same device memory (no create, no release below), cleared on the way: none of A's
    // bytes show (issue 33, defect 3).
    assert_eq!(byte[0], 0, "B sees A's bytes");
    assert_eq!(after.creates, before.creates);
    assert_eq!(after.releases, before.releases);
    assert_eq!(after.handovers - before.handovers, 16);
    // Refusals carry the numbers.
    let e = b
        .map_with(GIB, 2 * GIB, &MemOptions::new().chunk(64 * MIB))
        .unwrap_err()
        .to_string();
    assert!(e.contains("limit"), "{e}");
    b.unmap(0, GIB).unwrap();
}

#[test]
fn memory_goes_back_to_the_device_when_an_engine_leaves() {
    let cuda = Arc::new(CudaBackend::new(0).expect("CUDA device 0 with VMM support"));
    let broker =
        Broker::start(cuda.clone(), BrokerConfig::new(socket("leave"), 8 * GIB)).expect("broker");
    let free = || cuda.memory_info().unwrap().free;
    let f0 = free();
    {
        let c = BrokerClient::connect(broker.socket(), "e").unwrap();
        let m = c
            .register(ModelConfig::new("m", (16 * GIB) as usize, 8 * GIB))
            .unwrap();
        let held: Vec<_> = (0..16)
            .map(|_| m.allocate((256 * MIB) as usize).unwrap())
            .collect();
        assert!(f0 - free() >= 4 * GIB, "4 GiB on the device");
        drop(held);
    }
    let end = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while !broker.snapshot().models.is_empty() && std::time::Instant::now() < end {
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    let s = broker.snapshot();
    assert!(s.models.is_empty(), "{s:?}");
    assert_eq!(s.global_used, s.idle, "only idle chunks stay charged");
    // Idle chunks released: the device's memory is back (within 256 MiB of other users).
    let c = BrokerClient::connect_control(broker.socket(), "ctl").unwrap();
    c.request(elastic_vmm::broker::protocol::Request::Trim)
        .unwrap();
    assert!(free() + 256 * MIB >= f0, "free {} of {} before", free(), f0);
}

/// A chunk exported and imported in one process: whatever handle the driver gives back, the
/// import's release must leave the original usable.
#[test]
fn a_same_process_import_leaves_the_original_alive() {
    let cuda = CudaBackend::new(0).expect("CUDA device 0");
    let g = cuda.info().granularity;
    let c = cuda.create(g).unwrap();
    let fd = cuda.export_chunk(c).unwrap();
    let imported = cuda.import_chunk(fd, g).unwrap();
    println!(
        "created handle {:#x}, imported handle {:#x} (same: {})",
        c.raw(),
        imported.raw(),
        c.raw() == imported.raw()
    );
    // SAFETY: the imported handle is mapped nowhere.
    unsafe { cuda.release(imported).unwrap() };
    let base = cuda.reserve(g, g).unwrap();
    let mut back = vec![0u8; 4096];
    // SAFETY: a fresh reservation of one chunk; mapped, accessed, written, read, unmapped, and
    // released in order, used by nothing else.
    unsafe {
        cuda.map(base, c).unwrap();
        cuda.set_access(base, g).unwrap();
        cuda.copies().write(base, &[0x5a; 4096]).unwrap();
        cuda.copies().read(base, &mut back).unwrap();
        cuda.unmap(base, g).unwrap();
        cuda.release(c).unwrap();
        cuda.free_reservation(base, g).unwrap();
    }
    assert!(back.iter().all(|&b| b == 0x5a));
}

/// Two engines' models sleep in turn through the broker's host tier on CUDA (VMM host chunks
/// of the device, exported as descriptors): A's sleep maps host chunks the broker makes, its
/// wake gives them back, and B's sleep takes them over without a create. 1 GiB each, contents
/// back byte-exact (sampled), timings printed.
#[test]
fn engines_sleep_in_turn_through_the_brokers_host_tier() {
    use elastic_vmm::{AfterWake, SleepPolicy};
    let cuda = Arc::new(CudaBackend::new(0).expect("CUDA device 0 with VMM support"));
    let broker = Broker::start(
        cuda.clone(),
        BrokerConfig::new(socket("host-tier"), 4 * GIB).host_budget(GIB + GIB / 2),
    )
    .expect("broker with a host tier");
    let host = broker.snapshot().host_tier.expect("host tier");
    println!(
        "host tier: {} ({}), granularity {}, budget {}",
        host.backend.name, host.backend.device_name, host.backend.granularity, host.global_limit
    );
    let engine = |name: &str, byte: u8| {
        let c = BrokerClient::connect(broker.socket(), name).unwrap();
        let m = c
            .register(ModelConfig::new(name, (8 * GIB) as usize, 2 * GIB))
            .unwrap();
        let tier = c
            .register_host_tier(ModelConfig::new(
                format!("{name}-host"),
                (8 * GIB) as usize,
                2 * GIB,
            ))
            .unwrap();
        m.stage_through(Some(tier.pool().clone())).unwrap();
        let a = m.allocate(GIB as usize).unwrap();
        // SAFETY: the allocation's memory is mapped with access and only this test uses it.
        unsafe {
            m.backend()
                .copies()
                .fill(a.addr(), GIB as usize, byte)
                .unwrap()
        };
        (c, m, tier, a)
    };
    let sample = |a: &elastic_vmm::Allocation, byte: u8| {
        for off in [0, GIB / 2, GIB - 1] {
            let mut b = [0u8; 1];
            a.read(off as usize, &mut b).unwrap();
            assert_eq!(b[0], byte, "byte at {off}");
        }
    };
    let (_ca, ma, _ta, aa) = engine("a", 0x5a);
    let t = std::time::Instant::now();
    ma.sleep(&SleepPolicy::offload_all()).unwrap();
    let a_sleep = t.elapsed();
    let made = broker.snapshot().host_tier.unwrap().counters.creates;
    let t = std::time::Instant::now();
    ma.wake(AfterWake::FreeHostMemory).unwrap();
    let a_wake = t.elapsed();
    sample(&aa, 0x5a);
    let (_cb, mb, _tb, ab) = engine("b", 0xa5);
    let t = std::time::Instant::now();
    mb.sleep(&SleepPolicy::offload_all()).unwrap();
    let b_sleep = t.elapsed();
    let h = broker.snapshot().host_tier.unwrap();
    mb.wake(AfterWake::FreeHostMemory).unwrap();
    sample(&ab, 0xa5);
    println!(
        "1 GiB: A sleeps in {a_sleep:.2?} (host chunks made), wakes in {a_wake:.2?}; B sleeps in {b_sleep:.2?} (handed over); host tier {:?}",
        h.counters
    );
    assert_eq!(h.counters.creates, made, "B's sleep made no host chunk");
    assert!(h.counters.handovers >= made, "{:?}", h.counters);
    assert_eq!(h.audit, None);
}
