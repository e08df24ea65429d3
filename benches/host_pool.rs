//! Criterion benchmarks on the host backend: the hot allocate+free path (no driver call) and
//! growth, by the allocator in 2 MiB steps and by the range API.

use std::hint::black_box;
use std::sync::Arc;
use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, BatchSize, Criterion, Throughput};
use elastic_vmm::backend::host::HostBackend;
use elastic_vmm::{Backend, Pool, PoolConfig};

const MIB: usize = 1 << 20;

fn host() -> Arc<dyn Backend> {
    Arc::new(HostBackend::new(2 * MIB).expect("host backend"))
}

fn hot_path(c: &mut Criterion) {
    let mut g = c.benchmark_group("hot allocate+free");
    for size in [4096usize, 2 * MIB, 64 * MIB] {
        let pool = Pool::new(host(), PoolConfig::new(16 << 30)).expect("pool");
        drop(pool.allocate(size).expect("warm up"));
        g.bench_function(format!("{} KiB", size / 1024), |b| {
            b.iter(|| {
                let a = pool.allocate(black_box(size)).expect("allocate");
                black_box(a.addr());
            })
        });
    }
    // With other allocations live (free ranges to search and coalesce).
    let pool = Pool::new(host(), PoolConfig::new(16 << 30)).expect("pool");
    let _live: Vec<_> = (0..1000)
        .map(|i| pool.allocate(4096 * (1 + i % 7)).expect("live"))
        .collect();
    g.bench_function("4 KiB among 1000 live", |b| {
        b.iter(|| {
            let a = pool.allocate(black_box(4096)).expect("allocate");
            black_box(a.addr());
        })
    });
    g.finish();
}

fn growth(c: &mut Criterion) {
    let mut g = c.benchmark_group("growth");
    g.sample_size(10).measurement_time(Duration::from_secs(5));
    const TOTAL: usize = 512 * MIB;
    g.throughput(Throughput::Bytes(TOTAL as u64));
    g.bench_function("allocator, 2 MiB steps to 512 MiB", |b| {
        b.iter_batched(
            || Pool::new(host(), PoolConfig::new(8 << 30)).expect("pool"),
            |pool| {
                let v: Vec<_> = (0..TOTAL / (2 * MIB))
                    .map(|_| pool.allocate(2 * MIB).expect("step"))
                    .collect();
                black_box(v.len());
                (pool, v)
            },
            BatchSize::PerIteration,
        )
    });
    g.bench_function("allocator, one 512 MiB request", |b| {
        b.iter_batched(
            || Pool::new(host(), PoolConfig::new(8 << 30)).expect("pool"),
            |pool| {
                let a = pool.allocate(TOTAL).expect("bulk");
                (pool, a)
            },
            BatchSize::PerIteration,
        )
    });
    g.bench_function("range map, 2 MiB pages to 512 MiB", |b| {
        b.iter_custom(|iters| {
            let mut total = Duration::ZERO;
            for _ in 0..iters {
                let pool = Pool::new(host(), PoolConfig::new(8 << 30)).expect("pool");
                let t = Instant::now();
                for i in 0..(TOTAL / (2 * MIB)) as u64 {
                    pool.map(i * 2 * MIB as u64, 2 * MIB as u64).expect("map");
                }
                total += t.elapsed();
            }
            total
        })
    });
    g.finish();
}

criterion_group!(benches, hot_path, growth);
criterion_main!(benches);
