//! Counting and tracing driver calls: the [`Counter`] hook of an [`Intercept`]. It changes
//! nothing about the calls: it is the one place a stack of adaptors (or the broker) gets its
//! driver-call statistics from.

use std::fmt;

use super::intercept::{Call, Hook, Intercept, Outcome};
use super::BackendInfo;
use crate::error::Result;
use crate::stats::{DriverCalls, DriverCounters};

/// A backend that counts its driver calls: [`Intercept`] with a [`Counter`]
/// (`Counting::new(inner)`, then `counts()`).
pub type Counting = Intercept<Counter>;

/// Counts driver calls by [`DriverCall`](crate::DriverCall) kind and emits a `tracing::trace!` event per call
/// (target `elastic_vmm::backend::counting`) with the call's arguments and outcome.
///
/// A call is counted when it is made, before it reaches the wrapped backend, so calls that fail
/// count too (as a pool's [`crate::PoolStats::driver_calls`] does); a batch create counts its
/// chunks. Counting is a relaxed atomic increment: no lock, safe from any thread. Exports,
/// imports and staging copies are traced, not counted; data movement and queries neither.
#[derive(Debug, Default)]
pub struct Counter {
    counters: DriverCounters,
}

impl Counter {
    /// The calls made so far, by kind: a snapshot (each kind read atomically, the kinds one
    /// after another). Use [`DriverCalls::since`] for the calls between two snapshots.
    pub fn counts(&self) -> DriverCalls {
        self.counters.snapshot()
    }
}

/// `ok`, or the error, for the trace of a finished call (formatted only when traced).
struct Shown<'a>(Outcome<'a>);

impl fmt::Display for Shown<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.0 {
            Ok(_) => f.write_str("ok"),
            Err(e) => write!(f, "{e}"),
        }
    }
}

/// A `u64` address in hex, for traces.
struct Hex(u64);

impl fmt::Display for Hex {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:#x}", self.0)
    }
}

impl Hook for Counter {
    type Pass = ();

    fn before(&self, call: &Call, _: &BackendInfo) -> Result<()> {
        if let Some(kind) = call.kind() {
            self.counters.bump_by(kind, call.count());
        }
        Ok(())
    }

    fn after(&self, call: &Call, _: (), outcome: Outcome<'_>) {
        let value = *outcome.as_ref().unwrap_or(&0);
        let outcome = Shown(outcome);
        match *call {
            Call::Reserve { size, alignment } => {
                tracing::trace!(call = "reserve", size, alignment, base = value, %outcome, "driver call")
            }
            Call::FreeReservation { base, size } => {
                tracing::trace!(call = "free_reservation", base = %Hex(base), size, %outcome, "driver call")
            }
            Call::Create { size, count: 1 } => {
                tracing::trace!(call = "create", size, handle = value, %outcome, "driver call")
            }
            Call::Create { size, count } => {
                tracing::trace!(call = "create_many", size, count, %outcome, "driver call")
            }
            Call::Release { chunk, .. } => {
                tracing::trace!(call = "release", handle = chunk.raw, size = chunk.size, %outcome, "driver call")
            }
            Call::Map { addr, chunk } => {
                tracing::trace!(call = "map", addr = %Hex(addr), handle = chunk.raw, size = chunk.size, %outcome, "driver call")
            }
            Call::SetAccess {
                addr,
                size,
                mode,
                owner,
            } => {
                tracing::trace!(call = "set_access", addr = %Hex(addr), size, ?mode, ?owner, %outcome, "driver call")
            }
            Call::Unmap { addr, size } => {
                tracing::trace!(call = "unmap", addr = %Hex(addr), size, %outcome, "driver call")
            }
            Call::Export { chunk } => {
                tracing::trace!(call = "export_chunk", handle = chunk.raw, size = chunk.size, %outcome, "driver call")
            }
            Call::Import { size } => {
                tracing::trace!(call = "import_chunk", size, handle = value, %outcome, "driver call")
            }
            Call::StagingCopy { bytes, direction } => {
                tracing::trace!(call = "staging_copy", bytes, ?direction, %outcome, "data movement")
            }
            Call::Wipe { chunk } => {
                tracing::trace!(call = "wipe_chunk", handle = chunk.raw, size = chunk.size, %outcome, "data movement")
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use parking_lot::Mutex;
    use tracing::field::{Field, Visit};
    use tracing::span::{Attributes, Id, Record};
    use tracing::{Event, Metadata};

    use super::*;
    use crate::backend::host::HostBackend;
    use crate::backend::testing::FaultInjector;
    use crate::backend::{Backend, DriverCall};
    use crate::{Pool, PoolConfig};
    use std::sync::Arc;

    const GRAN: usize = 2 << 20;

    fn host() -> Arc<dyn Backend> {
        Arc::new(HostBackend::new(GRAN).expect("host backend"))
    }

    /// The events of this module, each as its fields by name.
    type Events = Arc<Mutex<Vec<BTreeMap<String, String>>>>;

    /// A minimal subscriber that keeps this module's events (no tracing-subscriber: it is a
    /// dependency of the command-line tool only). Installed once as the global default, so
    /// tests on other threads cannot change which call sites are enabled (scoped defaults
    /// race there); each test collects its own thread's events through [`capture`].
    struct Capture;

    thread_local! {
        static SINK: std::cell::RefCell<Option<Events>> = const { std::cell::RefCell::new(None) };
    }

    /// Run `f`, keeping this thread's events of this module in `events`.
    fn capture<T>(events: Events, f: impl FnOnce() -> T) -> T {
        static INSTALL: std::sync::Once = std::sync::Once::new();
        INSTALL.call_once(|| {
            let _ = tracing::subscriber::set_global_default(Capture);
        });
        SINK.with(|s| *s.borrow_mut() = Some(events));
        let out = f();
        SINK.with(|s| *s.borrow_mut() = None);
        out
    }

    struct Fields<'a>(&'a mut BTreeMap<String, String>);

    impl Visit for Fields<'_> {
        fn record_str(&mut self, field: &Field, value: &str) {
            self.0.insert(field.name().to_string(), value.to_string());
        }
        fn record_debug(&mut self, field: &Field, value: &dyn fmt::Debug) {
            self.0
                .insert(field.name().to_string(), format!("{value:?}"));
        }
    }

    impl tracing::Subscriber for Capture {
        fn enabled(&self, _: &Metadata<'_>) -> bool {
            true
        }
        fn new_span(&self, _: &Attributes<'_>) -> Id {
            Id::from_u64(1)
        }
        fn record(&self, _: &Id, _: &Record<'_>) {}
        fn record_follows_from(&self, _: &Id, _: &Id) {}
        fn event(&self, event: &Event<'_>) {
            if event.metadata().target() != module_path!().trim_end_matches("::tests") {
                return;
            }
            SINK.with(|s| {
                if let Some(events) = &*s.borrow() {
                    let mut fields = BTreeMap::new();
                    event.record(&mut Fields(&mut fields));
                    events.lock().push(fields);
                }
            });
        }
        fn enter(&self, _: &Id) {}
        fn exit(&self, _: &Id) {}
    }

    #[test]
    fn counts_every_kind_and_forwards_every_call() {
        let c = Counting::new(host());
        assert_eq!(c.counts(), DriverCalls::default());
        let base = c.reserve(4 * GRAN, GRAN).expect("reserve");
        let chunk = c.create(2 * GRAN).expect("create");
        assert_eq!(c.physical_bytes().expect("bytes"), 2 * GRAN as u64);
        // SAFETY: `base` is a fresh reservation, `chunk` ours and unmapped.
        unsafe { c.map(base + GRAN as u64, chunk) }.expect("map");
        // SAFETY: just mapped there.
        unsafe { c.set_access(base + GRAN as u64, 2 * GRAN) }.expect("access");
        let at = base + GRAN as u64 + 10;
        // SAFETY: mapped with access; nothing else uses it.
        unsafe { c.copies().write(at, b"counted") }.expect("write");
        // SAFETY: as above.
        unsafe { c.copies().fill(at + 7, 3, b'!') }.expect("fill");
        let mut out = [0u8; 10];
        // SAFETY: as above.
        unsafe { c.copies().read(at, &mut out) }.expect("read");
        assert_eq!(&out, b"counted!!!");
        // SAFETY: the whole chunk, unused from here on.
        unsafe { c.unmap(base + GRAN as u64, 2 * GRAN) }.expect("unmap");
        // SAFETY: mapped nowhere now, released once.
        unsafe { c.release(chunk) }.expect("release");
        let mid = c.counts();
        // SAFETY: the reservation made above, nothing mapped in it.
        unsafe { c.free_reservation(base, 4 * GRAN) }.expect("free");
        assert_eq!(c.physical_bytes().expect("bytes"), 0);
        assert!(c.memory_info().expect("memory info").total > 0);
        assert_eq!(c.info().name, "host");

        let n = c.counts();
        for call in DriverCall::ALL {
            assert_eq!(n.get(call), 1, "{call}");
        }
        assert_eq!(
            n.total(),
            7,
            "data movement and queries are not counted: {n}"
        );
        let last = n.since(&mid);
        assert_eq!(last.get(DriverCall::FreeReservation), 1);
        assert_eq!(last.total(), 1);
    }

    #[test]
    fn failed_calls_count_too() {
        let faults = Arc::new(FaultInjector::new(host()));
        let c = Counting::new(faults.clone());
        faults.fail_nth(DriverCall::Create, 2);
        let first = c.create(GRAN).expect("first create");
        let err = c.create(GRAN).expect_err("second create fails");
        assert!(err.to_string().contains("FAULT_INJECTED"), "{err}");
        assert_eq!(c.counts().get(DriverCall::Create), 2);
        assert_eq!(faults.calls(DriverCall::Create), 2);
        // SAFETY: created above, never mapped, released once.
        unsafe { c.release(first) }.expect("release");
        assert_eq!(c.counts().total(), 3);
    }

    #[test]
    fn counts_equal_what_a_pool_on_it_reports() {
        let counting = Arc::new(Counting::new(host()));
        let backend: Arc<dyn Backend> = counting.clone();
        let pool = Pool::new(backend, PoolConfig::new(1 << 30)).expect("pool");
        let same = |what: &str| assert_eq!(counting.counts(), pool.stats().driver_calls, "{what}");
        same("after reserve");
        let a: Vec<_> = (0..5)
            .map(|i| pool.allocate((i + 1) * GRAN).expect("allocate"))
            .collect();
        same("after growth");
        pool.map(512 << 20, 4 * GRAN as u64).expect("range map");
        pool.unmap(512 << 20, 2 * GRAN as u64).expect("range unmap");
        same("after the range API");
        drop(a);
        pool.trim().expect("trim");
        same("after trim");
        let before_drop = counting.counts();
        assert!(before_drop.get(DriverCall::Map) >= 2, "{before_drop}");
        assert!(before_drop.get(DriverCall::Release) >= 1, "{before_drop}");
        drop(pool);
        let teardown = counting.counts().since(&before_drop);
        assert_eq!(teardown.get(DriverCall::FreeReservation), 1, "{teardown}");
        // Half of the range was still mapped: unmapped and released at drop.
        assert!(teardown.get(DriverCall::Unmap) >= 1, "{teardown}");
        assert!(teardown.get(DriverCall::Release) >= 1, "{teardown}");
        assert_eq!(counting.physical_bytes().expect("bytes"), 0);
    }

    #[test]
    fn each_call_is_traced_with_its_arguments() {
        let events: Events = Arc::default();
        let c = Counting::new(Arc::new(FaultInjector::new(host())));
        let (base, handle) = capture(events.clone(), || {
            let base = c.reserve(2 * GRAN, GRAN).expect("reserve");
            let chunk = c.create(GRAN).expect("create");
            // SAFETY: fresh reservation, our unmapped chunk.
            unsafe { c.map(base + GRAN as u64, chunk) }.expect("map");
            // SAFETY: unmapping what was just mapped; never accessed.
            unsafe { c.unmap(base + GRAN as u64, GRAN) }.expect("unmap");
            // SAFETY: mapped nowhere now, released once.
            unsafe { c.release(chunk) }.expect("release");
            // SAFETY: the reservation made above, nothing mapped in it.
            unsafe { c.free_reservation(base, 2 * GRAN) }.expect("free");
            (base, chunk.raw())
        });
        let events = events.lock();
        let calls: Vec<&str> = events.iter().map(|e| e["call"].as_str()).collect();
        assert_eq!(
            calls,
            [
                "reserve",
                "create",
                "map",
                "unmap",
                "release",
                "free_reservation"
            ]
        );
        for e in events.iter() {
            assert_eq!(e["outcome"], "ok", "{e:?}");
            assert_eq!(e["message"], "driver call", "{e:?}");
        }
        assert_eq!(events[0]["size"], (2 * GRAN).to_string());
        assert_eq!(events[0]["alignment"], GRAN.to_string());
        assert_eq!(events[0]["base"], base.to_string());
        assert_eq!(events[1]["handle"], handle.to_string());
        let map = &events[2];
        assert_eq!(map["addr"], format!("{:#x}", base + GRAN as u64));
        assert_eq!(map["handle"], handle.to_string());
        assert_eq!(map["size"], GRAN.to_string());
        assert_eq!(events[3]["size"], GRAN.to_string());
        assert_eq!(events[5]["base"], format!("{base:#x}"));
    }

    #[test]
    fn a_failed_call_is_traced_with_its_error() {
        let events: Events = Arc::default();
        let faults = Arc::new(FaultInjector::new(host()));
        let c = Counting::new(faults.clone());
        faults.fail_nth(DriverCall::Reserve, 1);
        capture(events.clone(), || {
            c.reserve(GRAN, GRAN).expect_err("injected");
        });
        let events = events.lock();
        assert_eq!(events.len(), 1, "{events:?}");
        assert_eq!(events[0]["call"], "reserve");
        assert!(
            events[0]["outcome"].contains("FAULT_INJECTED"),
            "{:?}",
            events[0]
        );
        assert_eq!(c.counts().get(DriverCall::Reserve), 1);
    }
}
