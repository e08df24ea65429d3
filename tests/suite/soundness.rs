//! Soundness under interleavings: lifetimes across threads, locks, the books of the shared
//! pool, and rollback of rollbacks. Race windows are widened with the delaying adaptor.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{mpsc, Arc, Barrier};
use std::thread;
use std::time::{Duration, Instant};

use elastic_vmm::backend::testing::DelayInjector;
use elastic_vmm::backend::testing::FaultInjector;
use elastic_vmm::{
    Backend, DriverCall, Error, ModelConfig, Pool, PoolConfig, SharedPool, SharedPoolConfig,
};

use super::Rng;

/// `backend` with every unmap and release slowed down by `d`.
fn slowed(backend: &Arc<dyn Backend>, d: Duration) -> Arc<DelayInjector> {
    let slow = Arc::new(DelayInjector::new(backend.clone()));
    slow.set_delay(DriverCall::Unmap, d);
    slow.set_delay(DriverCall::Release, d);
    slow
}

/// Run `f` on a thread and fail (instead of hanging the suite) if it does not end in `limit`.
fn within<T: Send + 'static>(
    limit: Duration,
    what: &str,
    f: impl FnOnce() -> T + Send + 'static,
) -> T {
    let (tx, rx) = mpsc::channel();
    let t = thread::spawn(move || {
        let _ = tx.send(f());
    });
    match rx.recv_timeout(limit) {
        Ok(v) => v,
        Err(mpsc::RecvTimeoutError::Disconnected) => match t.join() {
            Err(panic) => std::panic::resume_unwind(panic),
            Ok(()) => panic!("{what} ended without a result"),
        },
        Err(mpsc::RecvTimeoutError::Timeout) => {
            panic!("{what} did not finish in {limit:?}: deadlock")
        }
    }
}

/// Allocations dropped on several threads after the last pool handle is gone: every free may
/// run the closed pool's trim while another frees the last allocation. Nothing may be used
/// after it is freed, nothing released twice, and every byte must go back.
pub fn allocations_outlive_their_pool(backend: Arc<dyn Backend>) {
    let g = backend.info().granularity;
    let slow = slowed(&backend, Duration::from_micros(200));
    let before = backend.physical_bytes().expect("physical bytes");
    for round in 0..12 {
        let pool = Pool::new(
            slow.clone(),
            PoolConfig::new(64 * g)
                .max_chunk(g)
                .growth_divisor(1_000_000),
        )
        .expect("pool");
        let allocs: Vec<_> = (0..8)
            .map(|_| pool.allocate(g).expect("allocate"))
            .collect();
        // The pool's range mappings go at close too, racing the frees.
        pool.map(48 * g as u64, 2 * g as u64).expect("map");
        let start = Arc::new(Barrier::new(allocs.len() + 1));
        let threads: Vec<_> = allocs
            .into_iter()
            .map(|a| {
                let start = start.clone();
                thread::spawn(move || {
                    start.wait();
                    drop(a);
                })
            })
            .collect();
        start.wait();
        drop(pool);
        for t in threads {
            t.join().expect("a free panicked");
        }
        let after = backend.physical_bytes().expect("physical bytes");
        assert_eq!(
            after, before,
            "round {round}: {after} bytes held after the pool and all its allocations went, {before} before"
        );
    }
}

/// Unregister a model and drop its last handle while other models are refused (their
/// admission walks the registry for donors): no thread may stop for good.
pub fn unregister_during_refusals_does_not_deadlock(backend: Arc<dyn Backend>) {
    let g = backend.info().granularity as u64;
    let slow = slowed(&backend, Duration::from_micros(100));
    let shared =
        SharedPool::new(slow, SharedPoolConfig::new().global_limit(8 * g)).expect("shared");
    within(
        Duration::from_secs(60),
        "unregister during refusals",
        move || {
            let hog = shared
                .register(ModelConfig::new("hog", (64 * g) as usize, 6 * g))
                .expect("hog");
            let _held = hog
                .allocate((6 * g) as usize)
                .expect("hog holds most of the budget");
            let stop = Arc::new(AtomicBool::new(false));
            let askers: Vec<_> = (0..3)
                .map(|i| {
                    let m = shared
                        .register(ModelConfig::new(
                            format!("asker{i}"),
                            (64 * g) as usize,
                            8 * g,
                        ))
                        .expect("asker");
                    let stop = stop.clone();
                    thread::spawn(move || {
                        let mut refused = 0u64;
                        while !stop.load(Ordering::Relaxed) {
                            match m.allocate((4 * g) as usize) {
                                Ok(a) => drop(a),
                                Err(_) => refused += 1,
                            }
                        }
                        refused
                    })
                })
                .collect();
            for round in 0..150 {
                let id = format!("short-lived{round}");
                let m = shared
                    .register(ModelConfig::new(&id, (16 * g) as usize, 2 * g))
                    .expect("register");
                // Idle memory makes it a donor candidate while it goes away.
                if let Ok(a) = m.allocate(g as usize) {
                    drop(a);
                }
                shared.unregister(&id).expect("unregister");
                drop(m);
            }
            stop.store(true, Ordering::Relaxed);
            let refused: u64 = askers.into_iter().map(|t| t.join().expect("asker")).sum();
            assert!(
                refused > 0,
                "the askers were never refused: the test exercised nothing"
            );
            shared.audit().expect("books after the run");
        },
    );
}

/// Models that keep asking for more than the room while others come and go: charges always
/// equal what each model holds (checked continuously from another thread), and once every
/// allocation is gone nothing stays charged, so a model that holds nothing is never refused.
pub fn charges_always_match_holdings(backend: Arc<dyn Backend>) {
    let g = backend.info().granularity as u64;
    let slow = slowed(&backend, Duration::from_micros(20));
    let shared =
        SharedPool::new(slow, SharedPoolConfig::new().global_limit(16 * g)).expect("shared");
    let stop = Arc::new(AtomicBool::new(false));
    let auditor = {
        let (shared, stop) = (shared.clone(), stop.clone());
        thread::spawn(move || {
            let mut audits = 0u64;
            while !stop.load(Ordering::Relaxed) {
                if let Err(e) = shared.audit() {
                    panic!("books broke during the run after {audits} audits: {e}");
                }
                audits += 1;
            }
            audits
        })
    };
    let workers: Vec<_> = (0..4u64)
        .map(|i| {
            let m = shared
                .register(
                    ModelConfig::new(format!("m{i}"), (256 * g) as usize, 12 * g)
                        .pool_config(PoolConfig::new(0).max_chunk((2 * g) as usize)),
                )
                .expect("register");
            thread::spawn(move || {
                let mut rng = Rng::new(i + 7);
                let mut live = Vec::new();
                for _ in 0..400 {
                    let ask = (1 + rng.below(9)) * g;
                    match m.allocate(ask as usize) {
                        Ok(a) => live.push(a),
                        Err(e) => assert!(e.is_out_of_memory(), "unexpected error: {e}"),
                    }
                    if live.len() > 2 || rng.below(3) == 0 {
                        let k = rng.below(live.len().max(1) as u64) as usize;
                        if k < live.len() {
                            live.swap_remove(k);
                        }
                    }
                    if rng.below(50) == 0 {
                        let _ = m.trim();
                    }
                }
                drop(live);
                m
            })
        })
        .collect();
    let models: Vec<_> = workers
        .into_iter()
        .map(|t| t.join().expect("worker"))
        .collect();
    stop.store(true, Ordering::Relaxed);
    let audits = auditor.join().expect("auditor");
    assert!(audits > 0);
    shared.audit().expect("books at rest");
    for m in &models {
        let st = m.model_stats().expect("stats");
        assert_eq!(
            st.used,
            st.mapped + st.cached,
            "model {} is charged for more than it holds: {st:?}",
            st.id
        );
        assert_eq!(st.in_flight, 0, "{st:?}");
        m.trim().expect("trim");
    }
    let st = shared.stats();
    assert_eq!(
        st.global.used, 0,
        "stranded charges after every model trimmed: {st:?}"
    );
    // A model that holds nothing gets the whole budget.
    let whole = models[0].allocate((12 * g) as usize);
    assert!(
        whole.is_ok(),
        "refused after everything was given back: {:?}",
        whole.err()
    );
}

/// An unmap that fails after two chunks of a range were unmapped, whose restore maps the first
/// back and fails on the second: the chunk that is mapped again must be counted as mapped (never
/// cached, where another range would map it a second time), the other one as cached.
pub fn failed_unmap_restore_never_aliases(backend: Arc<dyn Backend>) {
    let g = backend.info().granularity as u64;
    let faults = Arc::new(FaultInjector::new(backend.clone()));
    let pool = Pool::new(faults.clone(), PoolConfig::new((64 * g) as usize)).expect("pool");
    pool.map(0, 4 * g).expect("map");
    faults.fail_nth(DriverCall::Unmap, 3);
    faults.fail_nth(DriverCall::Map, 2);
    let err = pool.unmap(0, 4 * g).expect_err("the third unmap fails");
    assert!(matches!(err, Error::Backend { .. }), "{err}");
    faults.clear();
    pool.audit().expect("books after the failed unmap");
    assert!(
        pool.is_mapped(0, g),
        "the chunk mapped back must be counted as mapped"
    );
    assert!(
        !pool.is_mapped(g, g),
        "the chunk that could not be mapped back is not mapped"
    );
    assert!(
        pool.is_mapped(2 * g, 2 * g),
        "chunks never unmapped stay mapped"
    );
    // Whatever is cached now goes to another range; it must not share memory with the first.
    pool.map(16 * g, 2 * g).expect("map elsewhere");
    let a = vec![0xA5u8; g as usize];
    let b = vec![0x5Au8; 2 * g as usize];
    let mut back = vec![0u8; g as usize];
    // SAFETY: both ranges are mapped (checked above) and nothing else touches them.
    unsafe {
        faults.copies().write(pool.base(), &a).expect("write first");
        faults
            .copies()
            .write(pool.base() + 16 * g, &b)
            .expect("write second");
        faults
            .copies()
            .read(pool.base(), &mut back)
            .expect("read first");
    }
    assert!(back == a, "two ranges share physical memory");
    pool.unmap(0, g).expect("unmap restored");
    pool.unmap(2 * g, 2 * g).expect("unmap rest");
    pool.unmap(16 * g, 2 * g).expect("unmap other");
    pool.trim().expect("trim");
    pool.audit().expect("books at the end");
    assert_eq!(pool.stats().physical(), 0);
}

/// A release that fails when a model's pool goes: the memory still exists, so the budget keeps
/// counting it (as leaked) instead of handing it out again.
pub fn leaked_memory_stays_counted(backend: Arc<dyn Backend>) {
    let g = backend.info().granularity as u64;
    let faults = Arc::new(FaultInjector::new(backend.clone()));
    let shared = SharedPool::new(faults.clone(), SharedPoolConfig::new().global_limit(8 * g))
        .expect("shared");
    let m = shared
        .register(ModelConfig::new("m", (16 * g) as usize, 8 * g))
        .expect("register");
    drop(m.allocate((2 * g) as usize).expect("allocate"));
    faults.fail_from(DriverCall::Release, 1);
    let _ = shared.unregister("m");
    drop(m);
    faults.clear();
    let st = shared.stats();
    assert!(
        st.global.leaked >= 2 * g,
        "leaked memory not counted: {st:?}"
    );
    assert_eq!(st.global.used, st.global.leaked, "{st:?}");
    shared.audit().expect("books with leaked memory");
    let other = shared
        .register(ModelConfig::new("other", (16 * g) as usize, 8 * g))
        .expect("other");
    let err = other
        .allocate((8 * g) as usize)
        .expect_err("the leaked bytes are not free");
    assert!(err.is_out_of_memory(), "{err}");
    other
        .allocate((8 * g - st.global.leaked) as usize)
        .expect("the rest is");
}

/// Numbers at the edges of `u64` are refused with errors, never a panic or a wrap-around.
pub fn huge_numbers_are_refused_cleanly(backend: Arc<dyn Backend>) {
    let g = backend.info().granularity as u64;
    let shared =
        SharedPool::new(backend, SharedPoolConfig::new().global_limit(u64::MAX)).expect("shared");
    let a = shared
        .register(ModelConfig::new("a", (16 * g) as usize, u64::MAX).guarantee(u64::MAX / 2))
        .expect("a");
    let b = shared
        .register(ModelConfig::new("b", (16 * g) as usize, u64::MAX))
        .expect("b");
    let refused =
        shared.register(ModelConfig::new("c", (16 * g) as usize, u64::MAX).guarantee(u64::MAX));
    assert!(
        refused.is_err(),
        "a guarantee beyond the budget was accepted"
    );
    // With something charged, `used + bytes` is where a sum could wrap.
    let _held = b.allocate(g as usize).expect("b holds a granule");
    for bytes in [u64::MAX, u64::MAX - 1, u64::MAX / 2 + 2] {
        let e = b.check_admission(bytes).expect_err("too much");
        assert!(e.to_string().contains(&bytes.to_string()), "{e}");
    }
    a.check_admission(g).expect("a small growth fits");
    shared.set_guarantee("a", 0).expect("lower the guarantee");
    shared
        .set_limit("a", u64::MAX - 1)
        .expect("raise the limit");
    assert!(a.allocate(usize::MAX).is_err());
    let one = a.allocate(g as usize).expect("small allocation");
    drop(one);
    shared.audit().expect("books");
}

/// Many models and threads at once: registration and unregistration, live limit changes with
/// reclaim callbacks, pools dropped with allocations alive on other threads, and the books
/// checked continuously. Bounded by `rounds`.
pub fn stress_books_hold(backend: Arc<dyn Backend>, rounds: usize) {
    let g = backend.info().granularity as u64;
    let slow = slowed(&backend, Duration::from_micros(10));
    let shared =
        SharedPool::new(slow, SharedPoolConfig::new().global_limit(24 * g)).expect("shared");
    let stop = Arc::new(AtomicBool::new(false));
    let auditor = {
        let (shared, stop) = (shared.clone(), stop.clone());
        thread::spawn(move || {
            while !stop.load(Ordering::Relaxed) {
                if let Err(e) = shared.audit() {
                    panic!("books broke: {e}");
                }
            }
        })
    };
    let started = Instant::now();
    let workers: Vec<_> = (0..4u64)
        .map(|w| {
            let shared = shared.clone();
            thread::spawn(move || {
                let mut rng = Rng::new(w * 31 + 1);
                for r in 0..rounds {
                    let id = format!("w{w}r{r}");
                    let guarantee = if rng.below(3) == 0 { g } else { 0 };
                    let Ok(m) = shared.register(
                        ModelConfig::new(&id, (64 * g) as usize, (4 + rng.below(8)) * g)
                            .guarantee(guarantee)
                            .priority(rng.below(3) as i32)
                            .on_reclaim(|_| {}),
                    ) else {
                        continue;
                    };
                    let mut live = Vec::new();
                    for _ in 0..20 {
                        if let Ok(a) = m.allocate(((1 + rng.below(4)) * g) as usize) {
                            live.push(a);
                        }
                        if rng.below(4) == 0 && !live.is_empty() {
                            live.swap_remove(0);
                        }
                    }
                    let _ = shared.set_limit(&id, (2 + rng.below(10)) * g);
                    // Drop the handle with allocations alive, free them on another thread.
                    let _ = shared.unregister(&id);
                    let freer = thread::spawn(move || drop(live));
                    drop(m);
                    freer.join().expect("freer");
                    let _ = shared.unregister(&id);
                }
            })
        })
        .collect();
    for t in workers {
        t.join().expect("worker");
    }
    stop.store(true, Ordering::Relaxed);
    auditor.join().expect("auditor");
    shared.audit().expect("books at rest");
    let st = shared.stats();
    assert_eq!(st.global.in_flight, 0, "{st:?}");
    tracing::info!(elapsed = ?started.elapsed(), "stress done");
}

/// Threads' fronts (each thread's last freed block, kept without the pool's lock) against the
/// pool's state changing under them: six threads allocate, write, read back and free blocks of
/// two sizes and two tags while another sleeps and wakes the pool, trims it, takes stats (each
/// a flush of the fronts from another thread) and audits the books, with unmaps and releases
/// slowed. A block served twice shows another thread's bytes; a block kept past a flush or
/// lost by one shows in the books or the final accounting.
pub fn thread_fronts_race_sleep_trim_and_stats(backend: Arc<dyn Backend>, rounds: usize) {
    use elastic_vmm::{AfterWake, MemOptions, SleepPolicy, Tag};
    let g = backend.info().granularity as u64;
    let slow: Arc<dyn Backend> = slowed(&backend, Duration::from_micros(50));
    let p = Pool::new(slow, PoolConfig::new(1 << 30)).expect("pool");
    let stop = Arc::new(AtomicBool::new(false));
    // Each worker's blocks checked and refusals so far: the rounds go on until both happened
    // (on a busy machine the workers may start late).
    let progress = Arc::new([AtomicU64::new(0), AtomicU64::new(0)]);
    let workers: Vec<_> = (0..6u8)
        .map(|w| {
            let (p, stop, progress) = (p.clone(), stop.clone(), progress.clone());
            thread::spawn(move || {
                let mut rng = Rng::new(u64::from(w) + 77);
                let (mut served, mut refused, mut checked) = (0u64, 0u64, 0u64);
                while !stop.load(Ordering::Relaxed) {
                    let size = ((1 + rng.below(2)) * g) as usize;
                    let tag = if rng.below(2) == 0 {
                        Tag::Kv
                    } else {
                        Tag::Scratch
                    };
                    match p.allocate_with(size, &MemOptions::new().tag(tag)) {
                        Ok(mut a) => {
                            // This worker's number and this allocation's, no other's.
                            let mine = (u64::from(w) << 56 | served).to_le_bytes().repeat(512);
                            let written = a.write(size - 4096, &mine);
                            thread::yield_now();
                            let mut back = vec![0u8; 4096];
                            // Refused only while the pool sleeps (held across a sleep).
                            if written.is_ok() && a.read(size - 4096, &mut back).is_ok() {
                                assert_eq!(back, mine, "worker {w}: another thread's bytes");
                                checked += 1;
                                progress[0].fetch_add(1, Ordering::Relaxed);
                            }
                            served += 1;
                        }
                        Err(Error::Asleep { .. }) => {
                            refused += 1;
                            progress[1].fetch_add(1, Ordering::Relaxed);
                        }
                        Err(e) => panic!("worker {w}: {e}"),
                    }
                }
                (served, refused, checked)
            })
        })
        .collect();
    let started = Instant::now();
    let mut round = 0;
    while round < rounds
        || (progress.iter().any(|n| n.load(Ordering::Relaxed) == 0)
            && started.elapsed() < Duration::from_secs(30))
    {
        round += 1;
        p.sleep(&SleepPolicy::offload_all())
            .unwrap_or_else(|e| panic!("round {round}: sleep: {e}"));
        assert_eq!(p.stats().mapped, 0, "round {round}: mapped while asleep");
        p.audit()
            .unwrap_or_else(|e| panic!("round {round}, asleep: {e}"));
        p.wake(AfterWake::KeepHostMemory)
            .unwrap_or_else(|e| panic!("round {round}: wake: {e}"));
        p.trim()
            .unwrap_or_else(|e| panic!("round {round}: trim: {e}"));
        let _ = p.stats();
        p.audit()
            .unwrap_or_else(|e| panic!("round {round}, awake: {e}"));
    }
    stop.store(true, Ordering::Relaxed);
    let (mut served, mut refused, mut checked) = (0, 0, 0);
    for w in workers {
        let (s, r, c) = w.join().expect("worker");
        served += s;
        refused += r;
        checked += c;
    }
    assert!(
        checked > 0 && refused > 0,
        "the workers checked {checked} blocks' bytes and were refused {refused} times: the race was not run"
    );
    p.trim().expect("trim");
    let s = p.stats();
    assert_eq!((s.in_use, s.live_allocations, s.mapped), (0, 0, 0), "{s:?}");
    assert_eq!(s.allocations, s.frees, "{s:?}");
    assert_eq!(
        s.allocations, served,
        "every allocation served is counted: {s:?}"
    );
    p.audit().expect("books at the end");
}
