//! A backend adaptor that fails chosen driver calls, to prove that every multi-step operation
//! rolls back. It wraps any backend; calls it does not fail go straight through.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use parking_lot::Mutex;

use super::{Backend, BackendInfo, DriverCall, MemoryInfo, PhysicalChunk};
use crate::error::{Error, Result};

/// Wraps a backend and fails the Nth call of a chosen kind with a `FAULT_INJECTED` error.
#[derive(Debug)]
pub struct FaultInjector {
    inner: Arc<dyn Backend>,
    calls: [AtomicU64; DriverCall::ALL.len()],
    plans: Mutex<Vec<Plan>>,
    /// Staging copies (to or from host memory) seen, and the counts at which one fails.
    copies: AtomicU64,
    copy_plans: Mutex<Vec<u64>>,
}

#[derive(Debug, Clone, Copy)]
struct Plan {
    call: DriverCall,
    /// Fail when the call counter reaches this value (1-based, counted from arming).
    at: u64,
    /// Keep failing every later call of this kind too.
    sticky: bool,
}

impl FaultInjector {
    /// Wrap `inner`. No call fails until one is armed.
    pub fn new(inner: Arc<dyn Backend>) -> Self {
        FaultInjector {
            inner,
            calls: Default::default(),
            plans: Mutex::new(Vec::new()),
            copies: AtomicU64::new(0),
            copy_plans: Mutex::new(Vec::new()),
        }
    }

    /// Fail the `n`-th call (1-based) of kind `call` made from now on.
    pub fn fail_nth(&self, call: DriverCall, n: u64) {
        let at = self.calls[call.index()].load(Ordering::SeqCst) + n.max(1);
        self.plans.lock().push(Plan {
            call,
            at,
            sticky: false,
        });
    }

    /// Fail every call of kind `call` from the `n`-th one (1-based) on, until [`Self::clear`].
    pub fn fail_from(&self, call: DriverCall, n: u64) {
        let at = self.calls[call.index()].load(Ordering::SeqCst) + n.max(1);
        self.plans.lock().push(Plan {
            call,
            at,
            sticky: true,
        });
    }

    /// Disarm every planned failure.
    pub fn clear(&self) {
        self.plans.lock().clear();
        self.copy_plans.lock().clear();
    }

    /// Fail the `n`-th staging copy (1-based; to or from host memory, as sleep and wake make
    /// them) made from now on.
    pub fn fail_copy_nth(&self, n: u64) {
        let at = self.copies.load(Ordering::SeqCst) + n.max(1);
        self.copy_plans.lock().push(at);
    }

    /// How many staging copies went through this adaptor (failed ones included).
    pub fn copies(&self) -> u64 {
        self.copies.load(Ordering::SeqCst)
    }

    fn check_copy(&self) -> Result<()> {
        let n = self.copies.fetch_add(1, Ordering::SeqCst) + 1;
        let mut plans = self.copy_plans.lock();
        if let Some(i) = plans.iter().position(|&at| at == n) {
            plans.remove(i);
            drop(plans);
            tracing::debug!(n, "injecting a staging copy failure");
            return Err(Error::backend(
                self.inner.info().name,
                "staging copy",
                "FAULT_INJECTED",
                format!("staging copy #{n} failed on purpose"),
            ));
        }
        Ok(())
    }

    /// How many calls of `call` went through this adaptor (failed ones included).
    pub fn calls(&self, call: DriverCall) -> u64 {
        self.calls[call.index()].load(Ordering::SeqCst)
    }

    /// Count the call and decide whether it fails.
    fn check(&self, call: DriverCall) -> Result<()> {
        let n = self.calls[call.index()].fetch_add(1, Ordering::SeqCst) + 1;
        let mut plans = self.plans.lock();
        let hit = plans
            .iter()
            .position(|p| p.call == call && (n == p.at || (p.sticky && n >= p.at)));
        if let Some(i) = hit {
            if !plans[i].sticky {
                plans.remove(i);
            }
            drop(plans);
            tracing::debug!(%call, n, "injecting a driver failure");
            return Err(Error::backend(
                self.inner.info().name,
                call.name(),
                "FAULT_INJECTED",
                format!("call #{n} of {call} failed on purpose"),
            ));
        }
        Ok(())
    }
}

impl Backend for FaultInjector {
    fn info(&self) -> &BackendInfo {
        self.inner.info()
    }

    fn reserve(&self, size: usize, alignment: usize) -> Result<u64> {
        self.check(DriverCall::Reserve)?;
        self.inner.reserve(size, alignment)
    }

    unsafe fn free_reservation(&self, base: u64, size: usize) -> Result<()> {
        self.check(DriverCall::FreeReservation)?;
        // SAFETY: forwarded contract.
        unsafe { self.inner.free_reservation(base, size) }
    }

    fn create(&self, size: usize) -> Result<PhysicalChunk> {
        self.check(DriverCall::Create)?;
        self.inner.create(size)
    }

    fn create_many(
        &self,
        size: usize,
        count: usize,
        need: super::Need,
    ) -> Result<Vec<PhysicalChunk>> {
        // A fault on any chunk of the batch fails it before anything is made (all or none).
        for _ in 0..count {
            self.check(DriverCall::Create)?;
        }
        self.inner.create_many(size, count, need)
    }

    unsafe fn release_many(&self, chunks: &[PhysicalChunk]) -> Vec<Result<()>> {
        chunks
            .iter()
            .map(|&c| {
                self.check(DriverCall::Release)?;
                // SAFETY: forwarded contract, chunk by chunk.
                unsafe { self.inner.release(c) }
            })
            .collect()
    }

    unsafe fn release(&self, chunk: PhysicalChunk) -> Result<()> {
        self.check(DriverCall::Release)?;
        // SAFETY: forwarded contract.
        unsafe { self.inner.release(chunk) }
    }

    unsafe fn map(&self, addr: u64, chunk: PhysicalChunk) -> Result<()> {
        self.check(DriverCall::Map)?;
        // SAFETY: forwarded contract.
        unsafe { self.inner.map(addr, chunk) }
    }

    unsafe fn set_access(&self, addr: u64, size: usize) -> Result<()> {
        self.check(DriverCall::SetAccess)?;
        // SAFETY: forwarded contract.
        unsafe { self.inner.set_access(addr, size) }
    }

    unsafe fn set_access_mode(
        &self,
        addr: u64,
        size: usize,
        mode: super::AccessMode,
    ) -> Result<()> {
        self.check(DriverCall::SetAccess)?;
        // SAFETY: forwarded contract.
        unsafe { self.inner.set_access_mode(addr, size, mode) }
    }

    unsafe fn set_import_access(
        &self,
        addr: u64,
        size: usize,
        mode: super::AccessMode,
        owner: Option<i32>,
    ) -> Result<()> {
        self.check(DriverCall::SetAccess)?;
        // SAFETY: forwarded contract.
        unsafe { self.inner.set_import_access(addr, size, mode, owner) }
    }

    unsafe fn unmap(&self, addr: u64, size: usize) -> Result<()> {
        self.check(DriverCall::Unmap)?;
        // SAFETY: forwarded contract.
        unsafe { self.inner.unmap(addr, size) }
    }

    fn memory_info(&self) -> Result<MemoryInfo> {
        self.inner.memory_info()
    }

    fn physical_bytes(&self) -> Result<u64> {
        self.inner.physical_bytes()
    }

    unsafe fn write(&self, addr: u64, data: &[u8]) -> Result<()> {
        // SAFETY: forwarded contract.
        unsafe { self.inner.write(addr, data) }
    }

    unsafe fn read(&self, addr: u64, out: &mut [u8]) -> Result<()> {
        // SAFETY: forwarded contract.
        unsafe { self.inner.read(addr, out) }
    }

    unsafe fn fill(&self, addr: u64, len: usize, byte: u8) -> Result<()> {
        // SAFETY: forwarded contract.
        unsafe { self.inner.fill(addr, len, byte) }
    }

    fn export_chunk(&self, chunk: PhysicalChunk) -> Result<std::os::fd::OwnedFd> {
        self.inner.export_chunk(chunk)
    }

    fn import_chunk(&self, fd: std::os::fd::OwnedFd, size: usize) -> Result<PhysicalChunk> {
        self.inner.import_chunk(fd, size)
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

    unsafe fn copy_to_host_async(
        &self,
        dst: *mut u8,
        src: u64,
        bytes: usize,
        stream: u64,
    ) -> Result<()> {
        self.check_copy()?;
        // SAFETY: forwarded contract.
        unsafe { self.inner.copy_to_host_async(dst, src, bytes, stream) }
    }

    unsafe fn copy_from_host_async(
        &self,
        dst: u64,
        src: *const u8,
        bytes: usize,
        stream: u64,
    ) -> Result<()> {
        self.check_copy()?;
        // SAFETY: forwarded contract.
        unsafe { self.inner.copy_from_host_async(dst, src, bytes, stream) }
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
    );
}
