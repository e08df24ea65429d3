//! The shared pool on CUDA VMM: its behavioural suite, the concurrency stress test, and a
//! two-model hand-over with `cuMemGetInfo` showing the physical memory moving between models.

use std::sync::Arc;

use elastic_vmm::backend::cuda::CudaBackend;
use elastic_vmm::{Backend, ModelConfig, SharedPool, SharedPoolConfig};

use crate::suite::{self, GIB, MIB};

fn cuda() -> Arc<dyn Backend> {
    Arc::new(CudaBackend::new(0).expect("CUDA device 0 with VMM support"))
}

crate::shared_suite!(cuda);

#[test]
fn concurrent_models_stress() {
    suite::shared::concurrent_models(cuda(), 8, 4, 8, 200);
}

/// A grows to 8 GiB, releases it, B grows to 8 GiB under a 10 GiB budget: the device's free
/// memory shows one 8 GiB moving from A to B, never two.
#[test]
fn hand_over_moves_device_memory() {
    let b = cuda();
    let s =
        SharedPool::new(b.clone(), SharedPoolConfig::new().global_limit(10 * GIB)).expect("shared");
    let a_model = s
        .register(ModelConfig::new("a", (32 * GIB) as usize, 10 * GIB))
        .expect("a");
    let b_model = s
        .register(ModelConfig::new("b", (32 * GIB) as usize, 10 * GIB))
        .expect("b");
    let free = || b.memory_info().expect("cuMemGetInfo").free;
    let f0 = free();
    let held: Vec<_> = (0..4096)
        .map(|_| a_model.allocate(2 * MIB as usize).expect("a grows"))
        .collect();
    let f1 = free();
    drop(held);
    let f2 = free();
    let t = std::time::Instant::now();
    let got: Vec<_> = (0..4096)
        .map(|_| b_model.allocate(2 * MIB as usize).expect("b grows"))
        .collect();
    let secs = t.elapsed().as_secs_f64();
    let f3 = free();
    let st = s.stats();
    let (a, bb) = (&st.models[0], &st.models[1]);
    println!(
        "cuMemGetInfo free (MiB): start {}, A holds 8 GiB {}, A released {}, B grew (in {:.1} ms) {}; A uses {} MiB, B uses {} MiB",
        f0 / MIB,
        f1 / MIB,
        f2 / MIB,
        secs * 1e3,
        f3 / MIB,
        a.used / MIB,
        bb.used / MIB
    );
    assert!(f0 - f1 >= 8 * GIB, "A's 8 GiB came from the device");
    assert!(
        f2 + 64 * MIB >= f1 && f2 <= f1 + 64 * MIB,
        "released memory stays with A until someone needs it"
    );
    assert!(
        f3 + 2 * GIB >= f1,
        "B's growth reused A's memory: the device lost at most what A kept beyond it"
    );
    assert!(
        a.used <= 2 * GIB,
        "A gave its idle memory to B: A still uses {} MiB",
        a.used / MIB
    );
    assert!(bb.used >= 8 * GIB);
    s.audit().expect("audit");
    drop(got);
    for m in [&a_model, &b_model] {
        m.trim().expect("trim");
    }
    assert!(
        free() + 64 * MIB >= f0,
        "everything went back to the device"
    );
}
