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
