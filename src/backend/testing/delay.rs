//! Delays: a hook of [`Intercept`] that sleeps inside chosen driver calls, to widen race
//! windows in tests: a map that takes 20 ms leaves time for another thread to release, trim or
//! change a limit in the middle of it. Calls without a planned delay go straight through.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use parking_lot::Mutex;

use crate::backend::intercept::{Call, Hook, Intercept, Outcome};
use crate::backend::{BackendInfo, DriverCall};
use crate::error::Result;
/// Whether the delay comes before the call reaches the wrapped backend or after it returned.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum DelayPoint {
    /// Sleep, then forward: the caller has decided to make the call, the driver has not seen it.
    #[default]
    Before,
    /// Forward, then sleep: the driver has done the work, the caller does not know yet.
    After,
}

/// How one kind of driver call is delayed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Delay {
    duration: Duration,
    every: u64,
    point: DelayPoint,
}

impl Delay {
    /// Sleep `duration` in every call of the kind, before forwarding it.
    pub fn new(duration: Duration) -> Delay {
        Delay {
            duration,
            every: 1,
            point: DelayPoint::Before,
        }
    }

    /// Delay only every `n`-th call (the `n`-th, `2n`-th, ... counted from when the delay is
    /// set); `n = 0` is taken as 1.
    pub fn every(mut self, n: u64) -> Delay {
        self.every = n.max(1);
        self
    }

    /// Sleep before forwarding the call (the default) or after it returned.
    pub fn at(mut self, point: DelayPoint) -> Delay {
        self.point = point;
        self
    }

    /// How long each delayed call sleeps.
    pub fn duration(&self) -> Duration {
        self.duration
    }
}

/// A planned delay and the call count it was set at.
#[derive(Debug, Clone, Copy)]
struct Plan {
    delay: Delay,
    /// Calls of the kind made before the delay was set: the `every` count starts after them.
    armed_at: u64,
}

/// A backend that sleeps inside the driver calls chosen with [`Delays::set`]:
/// [`Intercept`] with [`Delays`] (`DelayInjector::new(inner)`).
pub type DelayInjector = Intercept<Delays>;

/// Sleeps inside the driver calls chosen with [`Delays::set`]. A batch (a create of many
/// chunks, a release of many) is one call: it sleeps once, as a broker serves it in one
/// request.
///
/// Thread-safe and reconfigurable while calls are in flight: a change applies to calls that
/// start after it. The plan is read under a short lock and the sleep happens with no lock held,
/// so concurrent calls sleep side by side rather than one after another.
#[derive(Debug)]
pub struct Delays {
    calls: [AtomicU64; DriverCall::ALL.len()],
    delayed: [AtomicU64; DriverCall::ALL.len()],
    plans: Mutex<[Option<Plan>; DriverCall::ALL.len()]>,
}

impl Default for Delays {
    fn default() -> Self {
        Delays {
            calls: Default::default(),
            delayed: Default::default(),
            plans: Mutex::new([None; DriverCall::ALL.len()]),
        }
    }
}

impl Delays {
    /// Sleep `duration` in every call of kind `call` from now on, before forwarding it.
    /// Replaces any delay set for that kind.
    pub fn set_delay(&self, call: DriverCall, duration: Duration) {
        self.set(call, Delay::new(duration));
    }

    /// Delay calls of kind `call` as `delay` says, from now on. Replaces any delay set for
    /// that kind.
    pub fn set(&self, call: DriverCall, delay: Delay) {
        let mut plans = self.plans.lock();
        // Read under the lock so that `every` counts from a point no concurrent `set` moved.
        let armed_at = self.calls[call.index()].load(Ordering::SeqCst);
        plans[call.index()] = Some(Plan { delay, armed_at });
    }

    /// Stop delaying calls of kind `call`.
    pub fn clear_call(&self, call: DriverCall) {
        self.plans.lock()[call.index()] = None;
    }

    /// Stop delaying every kind.
    pub fn clear(&self) {
        *self.plans.lock() = [None; DriverCall::ALL.len()];
    }

    /// How many calls of `call` went through this adaptor.
    pub fn calls(&self, call: DriverCall) -> u64 {
        self.calls[call.index()].load(Ordering::SeqCst)
    }

    /// How many calls of `call` were delayed.
    pub fn delayed(&self, call: DriverCall) -> u64 {
        self.delayed[call.index()].load(Ordering::SeqCst)
    }

    /// Count the call and decide whether (and where) it sleeps.
    fn plan(&self, call: DriverCall) -> Option<Delay> {
        // Counted under the lock, so a concurrent `set` sees either all of this call or none.
        let plans = self.plans.lock();
        let n = self.calls[call.index()].fetch_add(1, Ordering::SeqCst) + 1;
        let plan = plans[call.index()]?;
        drop(plans);
        let since_armed = n.saturating_sub(plan.armed_at);
        (since_armed % plan.delay.every == 0).then(|| {
            self.delayed[call.index()].fetch_add(1, Ordering::SeqCst);
            plan.delay
        })
    }

    fn sleep(call: DriverCall, delay: Delay) {
        tracing::trace!(%call, duration = ?delay.duration, point = ?delay.point, "delaying a driver call");
        std::thread::sleep(delay.duration);
    }
}

impl Hook for Delays {
    /// A delay to sleep after the call.
    type Pass = Option<(DriverCall, Delay)>;

    fn before(&self, call: &Call, _: &BackendInfo) -> Result<Self::Pass> {
        // One decision per batch: its first chunk stands for it.
        let Some(kind) = call
            .kind()
            .filter(|_| !matches!(call, Call::Release { index: 1.., .. }))
        else {
            return Ok(None);
        };
        Ok(match self.plan(kind) {
            Some(d) if d.point == DelayPoint::Before => {
                Self::sleep(kind, d);
                None
            }
            after => after.map(|d| (kind, d)),
        })
    }

    fn after(&self, _: &Call, pass: Self::Pass, _: Outcome<'_>) {
        if let Some((kind, d)) = pass {
            Self::sleep(kind, d);
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Instant;

    use super::*;
    use crate::backend::host::HostBackend;
    use crate::backend::Backend;
    use std::sync::Arc;

    const GRAN: usize = 2 << 20;
    const D: Duration = Duration::from_millis(40);

    // Timing checks are one-sided on purpose: a sleep of D makes a call take at least D on any
    // machine, while "fast" is only probable on a loaded CI box; calls that must not sleep are
    // checked with `delayed()` instead.

    fn wrapped() -> (Arc<DelayInjector>, usize) {
        let host: Arc<dyn Backend> = Arc::new(HostBackend::new(GRAN).expect("host backend"));
        let gran = host.info().granularity;
        (Arc::new(DelayInjector::new(host)), gran)
    }

    /// Time `f`.
    fn timed<T>(f: impl FnOnce() -> T) -> (T, Duration) {
        let t = Instant::now();
        let out = f();
        (out, t.elapsed())
    }

    #[test]
    fn delays_the_chosen_kind_and_forwards_every_call() {
        let (d, gran) = wrapped();
        d.set_delay(DriverCall::Create, D);
        let (chunk, took) = timed(|| d.create(gran).expect("create"));
        assert!(took >= D, "create took {took:?}, less than the {D:?} delay");
        assert_eq!(d.delayed(DriverCall::Create), 1);
        // The chunk is real: the host backend holds its memory.
        assert_eq!(d.physical_bytes().expect("bytes"), gran as u64);

        // Every other call goes through to the host backend, undelayed.
        let base = d.reserve(4 * gran, gran).expect("reserve");
        // SAFETY: `base` is a fresh reservation of this backend, `chunk` is ours and unmapped.
        unsafe { d.map(base, chunk) }.expect("map");
        // SAFETY: the chunk was just mapped there.
        unsafe { d.set_access(base, gran) }.expect("access");
        // SAFETY: mapped with access above; nothing else uses it.
        unsafe { d.copies().write(base + 100, b"through the adaptor") }.expect("write");
        let mut out = [0u8; 19];
        // SAFETY: as above.
        unsafe { d.copies().read(base + 100, &mut out) }.expect("read");
        assert_eq!(&out, b"through the adaptor");
        // SAFETY: as above.
        unsafe { d.copies().fill(base, 4, 0xAB) }.expect("fill");
        let mut four = [0u8; 4];
        // SAFETY: as above.
        unsafe { d.copies().read(base, &mut four) }.expect("read");
        assert_eq!(four, [0xAB; 4]);
        // SAFETY: the whole chunk mapped above, unused from here on.
        unsafe { d.unmap(base, gran) }.expect("unmap");
        // SAFETY: created above, now mapped nowhere, released once.
        unsafe { d.release(chunk) }.expect("release");
        // SAFETY: the reservation made above, with nothing mapped in it.
        unsafe { d.free_reservation(base, 4 * gran) }.expect("free");
        assert_eq!(d.physical_bytes().expect("bytes"), 0);
        for call in DriverCall::ALL {
            assert_eq!(d.calls(call), 1, "{call} went through once");
            let delayed = u64::from(call == DriverCall::Create);
            assert_eq!(d.delayed(call), delayed, "{call}");
        }
        assert!(d.memory_info().expect("memory info").total > 0);
        assert_eq!(d.info().name, "host");
    }

    #[test]
    fn every_nth_call_counts_from_when_the_delay_is_set() {
        let (d, gran) = wrapped();
        // One call before the delay is set: it must not shift the count.
        let mut chunks = vec![d.create(gran).expect("create")];
        d.set(DriverCall::Create, Delay::new(D).every(3));
        let mut slow = Vec::new();
        for i in 1..=7 {
            let before = d.delayed(DriverCall::Create);
            let (c, took) = timed(|| d.create(gran).expect("create"));
            chunks.push(c);
            if d.delayed(DriverCall::Create) > before {
                assert!(took >= D, "call {i} was delayed but took {took:?}");
                slow.push(i);
            }
        }
        assert_eq!(
            slow,
            vec![3, 6],
            "only the 3rd and 6th calls after `set` sleep"
        );
        assert_eq!(d.calls(DriverCall::Create), 8);
        for c in chunks {
            // SAFETY: created above, never mapped, released once.
            unsafe { d.release(c) }.expect("release");
        }
        assert_eq!(d.physical_bytes().expect("bytes"), 0);
    }

    #[test]
    fn after_means_the_call_is_done_when_the_sleep_starts() {
        let (d, gran) = wrapped();
        // Long enough that the main thread surely looks while the worker sleeps.
        let long = Duration::from_millis(400);
        for (point, expect_mid) in [(DelayPoint::After, gran as u64), (DelayPoint::Before, 0)] {
            d.set(DriverCall::Create, Delay::new(long).at(point));
            let delayed_before = d.delayed(DriverCall::Create);
            let (mid, took) = std::thread::scope(|s| {
                let worker = s.spawn(|| timed(|| d.create(gran).expect("create")));
                // The call is counted before it sleeps (and, with `After`, before it is
                // forwarded): wait for the count, then look while it sleeps.
                while d.delayed(DriverCall::Create) == delayed_before {
                    std::thread::yield_now();
                }
                let deadline = Instant::now() + long / 2;
                let mut mid = d.physical_bytes().expect("bytes");
                while mid != expect_mid && Instant::now() < deadline {
                    std::thread::yield_now();
                    mid = d.physical_bytes().expect("bytes");
                }
                let still_sleeping = !worker.is_finished();
                let (chunk, took) = worker.join().expect("worker");
                // SAFETY: created above, never mapped, released once.
                unsafe { d.release(chunk) }.expect("release");
                assert!(still_sleeping, "{point:?}: the worker finished too early");
                (mid, took)
            });
            assert!(took >= long, "{point:?}: create took {took:?}");
            assert_eq!(
                mid, expect_mid,
                "{point:?}: physical bytes during the sleep"
            );
            assert_eq!(d.delayed(DriverCall::Create), delayed_before + 1);
            d.clear();
        }
    }

    #[test]
    fn a_sleeping_call_holds_no_lock_and_plans_change_meanwhile() {
        let (d, gran) = wrapped();
        let long = Duration::from_millis(400);
        d.set_delay(DriverCall::Create, long);
        d.set_delay(DriverCall::Release, D);
        std::thread::scope(|s| {
            let sleeper = s.spawn(|| d.create(gran).expect("create"));
            while d.delayed(DriverCall::Create) == 0 {
                std::thread::yield_now();
            }
            // While it sleeps: reconfigure, and make calls of the same kind that go through.
            d.clear_call(DriverCall::Create);
            let quick = d.create(gran).expect("create while another sleeps");
            assert!(
                !sleeper.is_finished(),
                "a call waited for the sleeping one: a lock is held across the sleep"
            );
            assert_eq!(d.delayed(DriverCall::Create), 1);
            let (_, took) = timed(|| {
                // SAFETY: created above, never mapped, released once.
                unsafe { d.release(quick) }.expect("release")
            });
            assert!(took >= D, "release still delayed, took {took:?}");
            d.clear();
            let slow = sleeper.join().expect("sleeper");
            // SAFETY: created above, never mapped, released once.
            unsafe { d.release(slow) }.expect("release");
        });
        assert_eq!(
            d.delayed(DriverCall::Release),
            1,
            "cleared before the second"
        );
        assert_eq!(d.calls(DriverCall::Release), 2);
        assert_eq!(d.physical_bytes().expect("bytes"), 0);
    }

    #[test]
    fn a_pool_on_a_delayed_backend_works_and_sleeps_where_asked() {
        let (d, _) = wrapped();
        let backend: Arc<dyn Backend> = d.clone();
        let pool = crate::Pool::new(backend, crate::PoolConfig::new(1 << 30)).expect("pool");
        d.set_delay(DriverCall::Map, D);
        let (mut a, took) = timed(|| pool.allocate(GRAN).expect("allocate"));
        assert!(took >= D, "allocate that maps took {took:?}");
        let maps = d.delayed(DriverCall::Map);
        assert!(maps >= 1);
        a.write(0, b"abc").expect("write");
        drop(a);
        // Reuse of idle memory makes no driver call, so no delay.
        let a = pool.allocate(GRAN).expect("reuse");
        assert_eq!(d.delayed(DriverCall::Map), maps);
        drop(a);
        d.clear();
        pool.trim().expect("trim");
        assert_eq!(d.physical_bytes().expect("bytes"), 0);
    }
}
