//! Races between a wake's last steps and the next sleep.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Weak};
use std::thread;
use std::time::Duration;

use super::{SleepPolicy, SleepWatcher};
use crate::error::Result;
use crate::{AfterWake, Error, Pool};

/// A watcher that records whether it is frozen, and thaws slowly to widen the window between
/// a wake marking the pool awake and its watchers being thawed.
struct SlowThaw {
    frozen: AtomicBool,
}

impl SleepWatcher for SlowThaw {
    fn freeze(&self) -> Result<()> {
        self.frozen.store(true, Ordering::SeqCst);
        Ok(())
    }
    fn thaw(&self) {
        thread::sleep(Duration::from_millis(20));
        self.frozen.store(false, Ordering::SeqCst);
    }
    fn unmapping_all(&self) {}
    fn mapped_all(&self) -> Result<()> {
        Ok(())
    }
}

/// A sleep that starts while a wake is still thawing its watchers must not have its freeze
/// undone by that thaw: an asleep pool with a thawed watcher hands out uses of unmapped memory.
#[test]
fn a_sleep_racing_a_wakes_thaw_leaves_its_watchers_frozen() {
    let pool = Pool::host(1 << 30).unwrap();
    let _a = pool.allocate(2 << 20).unwrap();
    let watcher = Arc::new(SlowThaw {
        frozen: AtomicBool::new(false),
    });
    let weak: Weak<dyn SleepWatcher> = Arc::downgrade(&(watcher.clone() as Arc<dyn SleepWatcher>));
    pool.inner().add_watcher(weak);
    let policy = SleepPolicy::discard_all();
    let mut raced = 0;
    for round in 0..10 {
        pool.sleep(&policy).unwrap();
        let waker = {
            let pool = pool.clone();
            thread::spawn(move || pool.wake(AfterWake::KeepHostMemory).unwrap())
        };
        // Sleep again as soon as the pool says it is awake, during the wake's slow thaw.
        let slept = loop {
            if pool.sleep_stats().status == super::SleepStatus::Awake {
                match pool.sleep(&policy) {
                    Ok(_) => break true,
                    Err(Error::Asleep { .. }) | Err(Error::SleepRefused { .. }) => raced += 1,
                    Err(e) => panic!("round {round}: {e}"),
                }
            }
            if waker.is_finished() {
                break false;
            }
            thread::yield_now();
        };
        waker.join().unwrap();
        if slept {
            assert!(
                watcher.frozen.load(Ordering::SeqCst),
                "round {round}: the pool is asleep but the wake's thaw unfroze its watcher"
            );
            pool.wake(AfterWake::KeepHostMemory).unwrap();
        }
        if pool.is_asleep() {
            pool.wake(AfterWake::KeepHostMemory).unwrap();
        }
    }
    assert!(raced > 0, "no sleep ever landed in the thaw window");
}

/// A pool's staging buffer in a host tier is memory the tier must keep mapped: while a pool
/// asleep holds its copy there (or keeps the buffer for its next sleep) a sleep of the tier
/// is refused, naming the pool, and the copy comes back byte-exact. Before, the tier slept,
/// unmapping the buffer under the pool: its wake then copied from unmapped memory (a fault on
/// the host, garbage on a GPU after a discard).
#[test]
fn a_host_tier_does_not_sleep_under_a_staging_buffer() {
    use crate::backend::host::HostBackend;
    let tier_backend = HostBackend::locked(4096).expect("locked host backend");
    let tier = Pool::new(
        Arc::new(tier_backend),
        crate::PoolConfig::new(16 << 20).name("tier"),
    )
    .expect("tier");
    let pool = Pool::host(16 << 20).expect("pool");
    pool.stage_through(Some(tier.clone()))
        .expect("stage through");
    let mut a = pool.allocate(64 << 10).expect("memory");
    let data: Vec<u8> = (0..64 << 10).map(|i| (i * 7) as u8).collect();
    a.write(0, &data).expect("write");
    pool.sleep(&SleepPolicy::offload_all()).expect("sleep");
    assert!(
        tier.stats().mapped >= 64 << 10,
        "the copy lives in the tier"
    );
    let e = tier
        .sleep(&SleepPolicy::discard_all())
        .expect_err("the tier holds a staging buffer");
    assert!(e.to_string().contains("staging"), "{e}");
    assert!(!tier.is_asleep());
    pool.wake(AfterWake::KeepHostMemory).expect("wake");
    let mut back = vec![0u8; data.len()];
    a.read(0, &mut back).expect("read");
    assert!(back == data, "byte-exact");
    // Kept for the next sleep: still refused; released: the tier sleeps.
    tier.sleep(&SleepPolicy::discard_all())
        .expect_err("the buffer is kept");
    pool.release_host_staging().expect("release");
    tier.sleep(&SleepPolicy::discard_all())
        .expect("the tier sleeps");
    tier.wake(AfterWake::FreeHostMemory).expect("tier wakes");
    pool.audit().expect("pool audit");
    tier.audit().expect("tier audit");
}

/// A region dropped while its pool sleeps (a paged KV cache an engine drops while its model
/// sleeps) is given back at the wake: its ranges are not left mapped for good, where nothing
/// could unmap them and the model could never be unregistered (`ModelBusy` with the region's
/// bytes as mapped ranges).
#[test]
fn a_region_dropped_while_asleep_is_given_back_at_the_wake() {
    for policy in [SleepPolicy::discard_all(), SleepPolicy::offload_all()] {
        let pool = Pool::host(1 << 30).unwrap();
        let r = pool.reserve_region(8 << 20).unwrap();
        r.map(0, 8 << 20).unwrap();
        let kept = pool.reserve_region(4 << 20).unwrap();
        kept.map(0, 2 << 20).unwrap();
        pool.sleep(&policy).unwrap();
        drop(r);
        pool.wake(AfterWake::KeepHostMemory).unwrap();
        let s = pool.stats();
        assert_eq!(
            (s.range_mapped, s.reserved_regions, s.in_use),
            (2 << 20, 4 << 20, 2 << 20),
            "{policy:?}: {s:?}"
        );
        drop(kept);
        pool.trim().unwrap();
        let s = pool.stats();
        assert_eq!((s.mapped, s.cached), (0, 0), "{policy:?}: {s:?}");
        pool.inner().close_if_unused("a test").unwrap();
    }
}
