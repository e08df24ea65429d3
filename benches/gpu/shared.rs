//! Shared pool on the GPU: moving 40 GiB of physical memory from one model to another, the cost
//! of the admission check, and the hot path through a model handle against a plain pool.
//! `RESULT` lines: each hand-over against its 50 ms target, and the model handle's hot pair
//! against the plain pool's.

use std::sync::Arc;
use std::time::Instant;

use elastic_vmm::backend::cuda::CudaBackend;
use elastic_vmm::{Backend, ModelConfig, Pool, PoolConfig, SharedPool, SharedPoolConfig};

use crate::{median, BoxError, GIB, MIB};

pub fn run() -> Result<(), BoxError> {
    let backend: Arc<dyn Backend> = Arc::new(CudaBackend::new(0)?);
    println!("== shared pool: {} ==", backend.info().device_name);
    const MOVE: u64 = 40 * GIB;
    for (label, step) in [("1 GiB requests", GIB), ("2 MiB requests", 2 * MIB)] {
        let mut runs = Vec::new();
        for _ in 0..3 {
            let s = SharedPool::new(
                backend.clone(),
                SharedPoolConfig::new().global_limit(MOVE + GIB),
            )?;
            let a = s.register(ModelConfig::new("a", (64 * GIB) as usize, MOVE + GIB))?;
            let b = s.register(ModelConfig::new("b", (64 * GIB) as usize, MOVE + GIB))?;
            let mut held = Vec::new();
            for _ in 0..MOVE / step {
                held.push(a.allocate(step as usize)?);
            }
            let free0 = backend.memory_info()?.free;
            let t = Instant::now();
            drop(held); // A releases
            let mut got = Vec::new();
            for _ in 0..MOVE / step {
                got.push(b.allocate(step as usize)?); // B grows, reclaiming A's idle memory
            }
            let secs = t.elapsed().as_secs_f64();
            let free1 = backend.memory_info()?.free;
            let st = s.stats();
            runs.push((
                secs,
                st.models[0].used,
                st.models[1].used,
                free0 as i64 - free1 as i64,
            ));
            drop(got);
        }
        runs.sort_by(|x, y| x.0.total_cmp(&y.0));
        let (secs, a_used, b_used, extra) = runs[1];
        println!(
            "move 40 GiB from model A to model B ({label}): {:.1} ms (median of 3; target <= 50 ms); after: A uses {} MiB, B uses {} MiB, device free changed by {} MiB",
            secs * 1e3,
            a_used / MIB,
            b_used / MIB,
            -extra / MIB as i64
        );
        let key = if step == GIB {
            "shared/hand-over-1g"
        } else {
            "shared/hand-over-2m"
        };
        crate::result(
            key,
            &format!("40 GiB moved from model A to model B in {label}"),
            format!("{:.1} ms", secs * 1e3),
            "the target",
            "50 ms".into(),
            0.05 / secs,
        );
    }

    // Admission check cost, and the hot path through a handle vs a plain pool.
    let s = SharedPool::new(
        backend.clone(),
        SharedPoolConfig::new().global_limit(8 * GIB),
    )?;
    let m = s.register(ModelConfig::new("m", (16 * GIB) as usize, 4 * GIB))?;
    let mut ok = 0u64;
    let check_ns = median(5, || {
        let t = Instant::now();
        for _ in 0..1_000_000 {
            ok += u64::from(m.check_admission(2 * MIB).is_ok());
        }
        t.elapsed().as_nanos() as f64 / 1e6
    });
    let pool = Pool::new(backend.clone(), PoolConfig::new((16 * GIB) as usize))?;
    drop(pool.allocate(2 * MIB as usize)?);
    drop(m.allocate(2 * MIB as usize)?);
    let hot = |p: &Pool| {
        median(5, || {
            let t = Instant::now();
            for _ in 0..200_000 {
                drop(p.allocate(2 * MIB as usize));
            }
            t.elapsed().as_nanos() as f64 / 2e5
        })
    };
    let plain_ns = hot(&pool);
    let model_ns = hot(&m);
    println!(
        "admission check: {check_ns:.1} ns per check (target <= 100 ns; {ok} admitted); hot allocate+free 2 MiB: model handle {model_ns:.1} ns vs plain pool {plain_ns:.1} ns"
    );
    crate::result(
        "shared/model-handle-hot",
        "hot allocate+free of 2 MiB through a model handle of a shared pool",
        format!("{model_ns:.1} ns"),
        "the same through a plain pool",
        format!("{plain_ns:.1} ns"),
        plain_ns / model_ns,
    );
    Ok(())
}
