//! A backend adaptor that counts every driver call by kind and traces it with its arguments.
//! It wraps any backend and changes nothing about the calls: it is the one place a stack of
//! adaptors (or a pool) gets its driver-call statistics from.

use std::fmt;
use std::sync::Arc;

use super::{Backend, BackendInfo, DriverCall, MemoryInfo, PhysicalChunk};
use crate::error::Result;
use crate::stats::{DriverCalls, DriverCounters};

/// Wraps a backend, counts its driver calls by [`DriverCall`] kind and emits a
/// `tracing::trace!` event per call (target `elastic_vmm::backend::counting`) with the call's
/// arguments and outcome.
///
/// A call is counted when it is made, before it reaches the wrapped backend, so calls that fail
/// count too (as a pool's [`crate::PoolStats::driver_calls`] does). Counting is a relaxed atomic
/// increment: no lock, safe from any thread. The data-movement helpers (`write`, `read`,
/// `fill`) and the queries (`memory_info`, `physical_bytes`) are not driver calls of the
/// virtual-memory model; they are traced, not counted.
#[derive(Debug)]
pub struct Counting {
    inner: Arc<dyn Backend>,
    counters: DriverCounters,
}

impl Counting {
    /// Wrap `inner`, with every count at zero.
    pub fn new(inner: Arc<dyn Backend>) -> Counting {
        Counting {
            inner,
            counters: DriverCounters::default(),
        }
    }

    /// The calls made so far, by kind: a snapshot (each kind read atomically, the kinds one
    /// after another). Use [`DriverCalls::since`] for the calls between two snapshots.
    pub fn counts(&self) -> DriverCalls {
        self.counters.snapshot()
    }

    /// The wrapped backend.
    pub fn inner(&self) -> &Arc<dyn Backend> {
        &self.inner
    }
}

/// `ok`, or the error, for the trace of a finished call (formatted only when traced).
struct Outcome<'a, T>(&'a Result<T>);

impl<T> fmt::Display for Outcome<'_, T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.0 {
            Ok(_) => f.write_str("ok"),
            Err(e) => write!(f, "{e}"),
        }
    }
}

/// A `u64` address in hex, for traces.
fn hex(addr: u64) -> impl fmt::Display {
    struct Hex(u64);
    impl fmt::Display for Hex {
        fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            write!(f, "{:#x}", self.0)
        }
    }
    Hex(addr)
}

impl Backend for Counting {
    fn info(&self) -> &BackendInfo {
        self.inner.info()
    }

    fn reserve(&self, size: usize, alignment: usize) -> Result<u64> {
        self.counters.bump(DriverCall::Reserve);
        let r = self.inner.reserve(size, alignment);
        tracing::trace!(
            call = "reserve",
            size,
            alignment,
            base = r.as_ref().map_or(0, |&b| b),
            outcome = %Outcome(&r),
            "driver call"
        );
        r
    }

    unsafe fn free_reservation(&self, base: u64, size: usize) -> Result<()> {
        self.counters.bump(DriverCall::FreeReservation);
        // SAFETY: forwarded contract.
        let r = unsafe { self.inner.free_reservation(base, size) };
        tracing::trace!(call = "free_reservation", base = %hex(base), size, outcome = %Outcome(&r), "driver call");
        r
    }

    fn create(&self, size: usize) -> Result<PhysicalChunk> {
        self.counters.bump(DriverCall::Create);
        let r = self.inner.create(size);
        tracing::trace!(
            call = "create",
            size,
            handle = r.as_ref().map_or(0, |c| c.raw),
            outcome = %Outcome(&r),
            "driver call"
        );
        r
    }

    fn create_many(
        &self,
        size: usize,
        count: usize,
        need: super::Need,
    ) -> Result<Vec<PhysicalChunk>> {
        self.counters.bump_by(DriverCall::Create, count as u64);
        let r = self.inner.create_many(size, count, need);
        tracing::trace!(
            call = "create_many",
            size,
            count,
            ok = r.is_ok(),
            "driver call"
        );
        r
    }

    unsafe fn release_many(&self, chunks: &[PhysicalChunk]) -> Vec<Result<()>> {
        self.counters
            .bump_by(DriverCall::Release, chunks.len() as u64);
        // SAFETY: forwarded contract.
        unsafe { self.inner.release_many(chunks) }
    }

    unsafe fn release(&self, chunk: PhysicalChunk) -> Result<()> {
        self.counters.bump(DriverCall::Release);
        // SAFETY: forwarded contract.
        let r = unsafe { self.inner.release(chunk) };
        tracing::trace!(call = "release", handle = chunk.raw, size = chunk.size, outcome = %Outcome(&r), "driver call");
        r
    }

    unsafe fn map(&self, addr: u64, chunk: PhysicalChunk) -> Result<()> {
        self.counters.bump(DriverCall::Map);
        // SAFETY: forwarded contract.
        let r = unsafe { self.inner.map(addr, chunk) };
        tracing::trace!(
            call = "map",
            addr = %hex(addr),
            handle = chunk.raw,
            size = chunk.size,
            outcome = %Outcome(&r),
            "driver call"
        );
        r
    }

    unsafe fn set_access(&self, addr: u64, size: usize) -> Result<()> {
        self.counters.bump(DriverCall::SetAccess);
        // SAFETY: forwarded contract.
        let r = unsafe { self.inner.set_access(addr, size) };
        tracing::trace!(call = "set_access", addr = %hex(addr), size, outcome = %Outcome(&r), "driver call");
        r
    }

    unsafe fn set_access_mode(
        &self,
        addr: u64,
        size: usize,
        mode: super::AccessMode,
    ) -> Result<()> {
        self.counters.bump(DriverCall::SetAccess);
        // SAFETY: forwarded contract.
        let r = unsafe { self.inner.set_access_mode(addr, size, mode) };
        tracing::trace!(call = "set_access_mode", addr = %hex(addr), size, ?mode, outcome = %Outcome(&r), "driver call");
        r
    }

    unsafe fn set_import_access(
        &self,
        addr: u64,
        size: usize,
        mode: super::AccessMode,
        owner: Option<i32>,
    ) -> Result<()> {
        self.counters.bump(DriverCall::SetAccess);
        // SAFETY: forwarded contract.
        let r = unsafe { self.inner.set_import_access(addr, size, mode, owner) };
        tracing::trace!(call = "set_import_access", addr = %hex(addr), size, ?mode, ?owner, outcome = %Outcome(&r), "driver call");
        r
    }

    unsafe fn unmap(&self, addr: u64, size: usize) -> Result<()> {
        self.counters.bump(DriverCall::Unmap);
        // SAFETY: forwarded contract.
        let r = unsafe { self.inner.unmap(addr, size) };
        tracing::trace!(call = "unmap", addr = %hex(addr), size, outcome = %Outcome(&r), "driver call");
        r
    }

    fn memory_info(&self) -> Result<MemoryInfo> {
        self.inner.memory_info()
    }

    fn physical_bytes(&self) -> Result<u64> {
        self.inner.physical_bytes()
    }

    unsafe fn write(&self, addr: u64, data: &[u8]) -> Result<()> {
        // SAFETY: forwarded contract.
        let r = unsafe { self.inner.write(addr, data) };
        tracing::trace!(call = "write", addr = %hex(addr), len = data.len(), outcome = %Outcome(&r), "data movement");
        r
    }

    unsafe fn read(&self, addr: u64, out: &mut [u8]) -> Result<()> {
        // SAFETY: forwarded contract.
        let r = unsafe { self.inner.read(addr, out) };
        tracing::trace!(call = "read", addr = %hex(addr), len = out.len(), outcome = %Outcome(&r), "data movement");
        r
    }

    unsafe fn fill(&self, addr: u64, len: usize, byte: u8) -> Result<()> {
        // SAFETY: forwarded contract.
        let r = unsafe { self.inner.fill(addr, len, byte) };
        tracing::trace!(call = "fill", addr = %hex(addr), len, byte, outcome = %Outcome(&r), "data movement");
        r
    }

    fn export_chunk(&self, chunk: PhysicalChunk) -> Result<std::os::fd::OwnedFd> {
        let r = self.inner.export_chunk(chunk);
        tracing::trace!(call = "export_chunk", handle = chunk.raw, size = chunk.size, outcome = %Outcome(&r), "driver call");
        r
    }

    fn import_chunk(&self, fd: std::os::fd::OwnedFd, size: usize) -> Result<PhysicalChunk> {
        let r = self.inner.import_chunk(fd, size);
        tracing::trace!(call = "import_chunk", size, handle = r.as_ref().map_or(0, |c| c.raw), outcome = %Outcome(&r), "driver call");
        r
    }

    unsafe fn copy_async(&self, dst: u64, src: u64, bytes: usize, stream: u64) -> Result<()> {
        // SAFETY: forwarded contract.
        unsafe { self.inner.copy_async(dst, src, bytes, stream) }
    }

    unsafe fn copy_batch_async(&self, copies: &[(u64, u64, usize)], stream: u64) -> Result<()> {
        // SAFETY: forwarded contract.
        unsafe { self.inner.copy_batch_async(copies, stream) }
    }

    fn synchronize(&self, stream: u64) -> Result<()> {
        self.inner.synchronize(stream)
    }

    unsafe fn fill_async(&self, addr: u64, bytes: usize, byte: u8, stream: u64) -> Result<()> {
        // SAFETY: forwarded contract.
        unsafe { self.inner.fill_async(addr, bytes, byte, stream) }
    }

    // Passed on unchanged.
    crate::backend::forward_backend!(
        inner:
        chunk_lender,
        staging_alloc,
        staging_free,
        copy_stream_create,
        copy_stream_destroy,
        marker_record,
        marker_wait,
        gather_async,
        reach,
        copy_to_host_async,
        copy_from_host_async,
    );
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use parking_lot::Mutex;
    use tracing::field::{Field, Visit};
    use tracing::span::{Attributes, Id, Record};
    use tracing::{Event, Metadata};

    use super::*;
    use crate::backend::fault::FaultInjector;
    use crate::backend::host::HostBackend;
    use crate::{Pool, PoolConfig};

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
        unsafe { c.write(at, b"counted") }.expect("write");
        // SAFETY: as above.
        unsafe { c.fill(at + 7, 3, b'!') }.expect("fill");
        let mut out = [0u8; 10];
        // SAFETY: as above.
        unsafe { c.read(at, &mut out) }.expect("read");
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
