//! The one backend adaptor: [`Intercept`] wraps an upstream backend and shows each VMM call to
//! a [`Hook`] before the call goes up and after it came back, as RMM's resource adaptors wrap
//! an upstream resource. Counting ([`super::counting::Counter`]), delaying and failing
//! ([`super::testing`]) are hooks; everything else (queries, data movement, copies and streams
//! but the staging copies of sleep and wake) goes straight to the upstream backend.

use std::fmt;
use std::ops::Deref;
use std::os::fd::OwnedFd;
use std::sync::Arc;

use super::{
    AccessMode, Backend, BackendInfo, Copies, DeviceReach, DriverCall, GatherPiece, GatherShift,
    MemoryInfo, MemoryKind, Need, PhysicalChunk,
};
use crate::error::{Error, Result};

/// A call an [`Intercept`] shows its hook, with its arguments. More kinds may come.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Call {
    /// [`Backend::reserve`].
    Reserve {
        /// Bytes.
        size: usize,
        /// Alignment.
        alignment: usize,
    },
    /// [`Backend::free_reservation`].
    FreeReservation {
        /// Start of the reservation.
        base: u64,
        /// Bytes.
        size: usize,
    },
    /// [`Backend::create`] (`count` 1) or [`Backend::create_many`]: one call, all or none.
    Create {
        /// Bytes per chunk.
        size: usize,
        /// Chunks asked for.
        count: usize,
    },
    /// [`Backend::release`], or one chunk of [`Backend::release_many`] (each chunk of a batch
    /// succeeds or fails on its own).
    Release {
        /// The chunk.
        chunk: PhysicalChunk,
        /// Its position in the batch (0 for a single release).
        index: usize,
    },
    /// [`Backend::map`].
    Map {
        /// Where.
        addr: u64,
        /// What.
        chunk: PhysicalChunk,
    },
    /// [`Backend::set_access`], [`Backend::set_access_mode`] or [`Backend::set_import_access`].
    SetAccess {
        /// Start of the range.
        addr: u64,
        /// Bytes.
        size: usize,
        /// Access granted.
        mode: AccessMode,
        /// The device of this process the chunks live on, for imports.
        owner: Option<i32>,
    },
    /// [`Backend::unmap`].
    Unmap {
        /// Start of the range.
        addr: u64,
        /// Bytes.
        size: usize,
    },
    /// [`Backend::export_chunk`].
    Export {
        /// The chunk.
        chunk: PhysicalChunk,
    },
    /// [`Backend::import_chunk`].
    Import {
        /// Bytes.
        size: usize,
    },
    /// [`Backend::wipe_chunk`]: a chunk cleared before it is mapped.
    Wipe {
        /// The chunk.
        chunk: PhysicalChunk,
    },
    /// A staging copy of sleep or wake ([`Copies::copy_to_host_async`],
    /// [`Copies::copy_from_host_async`]).
    StagingCopy {
        /// Bytes.
        bytes: usize,
        /// Device to host (sleep) or host to device (wake).
        direction: StagingDirection,
    },
}

/// Which way a staging copy goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StagingDirection {
    /// Device memory to host staging (sleep).
    ToHost,
    /// Host staging to device memory (wake).
    FromHost,
}

impl Call {
    /// The driver call of the VMM model this is, if any (exports, imports and staging copies
    /// are not counted as driver calls).
    pub fn kind(&self) -> Option<DriverCall> {
        Some(match self {
            Call::Reserve { .. } => DriverCall::Reserve,
            Call::FreeReservation { .. } => DriverCall::FreeReservation,
            Call::Create { .. } => DriverCall::Create,
            Call::Release { .. } => DriverCall::Release,
            Call::Map { .. } => DriverCall::Map,
            Call::SetAccess { .. } => DriverCall::SetAccess,
            Call::Unmap { .. } => DriverCall::Unmap,
            Call::Export { .. }
            | Call::Import { .. }
            | Call::Wipe { .. }
            | Call::StagingCopy { .. } => return None,
        })
    }

    /// How many driver calls of [`Call::kind`] this stands for (a batch create: its chunks).
    pub fn count(&self) -> u64 {
        match self {
            Call::Create { count, .. } => *count as u64,
            _ => 1,
        }
    }
}

/// What a call returned, as its hook sees it: a value (the base of a reservation, the handle
/// of a single created or imported chunk, 0 otherwise) or the error.
pub type Outcome<'a> = std::result::Result<u64, &'a Error>;

/// What an [`Intercept`] does around each call. Hooks are called from any thread, concurrently;
/// they hold no lock across `before`/`after`.
pub trait Hook: Send + Sync + fmt::Debug {
    /// What `before` hands to `after` for the same call.
    type Pass;

    /// Before `call` goes to the upstream backend (`upstream` is its description). An error
    /// fails the call there: the upstream never sees it, and `after` is not called.
    fn before(&self, call: &Call, upstream: &BackendInfo) -> Result<Self::Pass>;

    /// After the upstream backend returned `outcome` for `call` (by default nothing).
    fn after(&self, _call: &Call, _pass: Self::Pass, _outcome: Outcome<'_>) {}
}

/// Wraps an upstream backend and shows each of its VMM calls to a [`Hook`]. Reads the hook's
/// own methods through `Deref` (`faults.fail_nth(..)`, `counting.counts()`).
#[derive(Debug)]
pub struct Intercept<H> {
    inner: Arc<dyn Backend>,
    hook: H,
}

impl<H: Hook> Intercept<H> {
    /// Wrap `inner` with `hook`.
    pub fn with_hook(inner: Arc<dyn Backend>, hook: H) -> Self {
        Intercept { inner, hook }
    }

    /// The wrapped backend.
    pub fn inner(&self) -> &Arc<dyn Backend> {
        &self.inner
    }

    /// The hook.
    pub fn hook(&self) -> &H {
        &self.hook
    }

    /// Run `f` between the hook's `before` and `after`; `value` reads a success for the hook.
    fn around<T>(
        &self,
        call: Call,
        f: impl FnOnce() -> Result<T>,
        value: fn(&T) -> u64,
    ) -> Result<T> {
        let pass = self.hook.before(&call, self.inner.info())?;
        let r = f();
        self.hook.after(&call, pass, r.as_ref().map(value));
        r
    }
}

impl<H> Intercept<H> {
    /// The upstream's copies and streams.
    fn up(&self) -> &dyn Copies {
        self.inner.copies()
    }
}

impl<H: Hook + Default> Intercept<H> {
    /// Wrap `inner` with the hook's default (nothing planned, counts at zero).
    pub fn new(inner: Arc<dyn Backend>) -> Self {
        Self::with_hook(inner, H::default())
    }
}

impl<H> Deref for Intercept<H> {
    type Target = H;

    fn deref(&self) -> &H {
        &self.hook
    }
}

fn none<T>(_: &T) -> u64 {
    0
}

impl<H: Hook> Backend for Intercept<H> {
    fn reserve(&self, size: usize, alignment: usize) -> Result<u64> {
        let call = Call::Reserve { size, alignment };
        self.around(call, || self.inner.reserve(size, alignment), |&b| b)
    }

    unsafe fn free_reservation(&self, base: u64, size: usize) -> Result<()> {
        // SAFETY: forwarded contract.
        let f = || unsafe { self.inner.free_reservation(base, size) };
        self.around(Call::FreeReservation { base, size }, f, none)
    }

    fn create(&self, size: usize) -> Result<PhysicalChunk> {
        let call = Call::Create { size, count: 1 };
        self.around(call, || self.inner.create(size), |c| c.raw)
    }

    fn create_many(&self, size: usize, count: usize, need: Need) -> Result<Vec<PhysicalChunk>> {
        let call = Call::Create { size, count };
        self.around(call, || self.inner.create_many(size, count, need), none)
    }

    unsafe fn release(&self, chunk: PhysicalChunk) -> Result<()> {
        // SAFETY: forwarded contract.
        let f = || unsafe { self.inner.release(chunk) };
        self.around(Call::Release { chunk, index: 0 }, f, none)
    }

    unsafe fn release_many(&self, chunks: &[PhysicalChunk]) -> Vec<Result<()>> {
        // Each chunk passes the hook on its own; those it lets through go up as one batch.
        let calls: Vec<Call> = (chunks.iter().enumerate())
            .map(|(index, &chunk)| Call::Release { chunk, index })
            .collect();
        let info = self.inner.info();
        let passes: Vec<Result<H::Pass>> =
            calls.iter().map(|c| self.hook.before(c, info)).collect();
        let up: Vec<PhysicalChunk> = (chunks.iter().zip(&passes))
            .filter(|(_, p)| p.is_ok())
            .map(|(&c, _)| c)
            .collect();
        // SAFETY: forwarded contract, for the chunks passed on.
        let mut done = unsafe { self.inner.release_many(&up) }.into_iter();
        (calls.iter().zip(passes))
            .map(|(call, pass)| {
                let pass = pass?;
                let r = done.next().unwrap_or_else(|| {
                    Err(Error::backend(
                        self.inner.info().name,
                        "release_many",
                        "SHORT_REPLY",
                        format!("fewer results than the {} chunks passed on", up.len()),
                    ))
                });
                self.hook.after(call, pass, r.as_ref().map(none));
                r
            })
            .collect()
    }

    unsafe fn map(&self, addr: u64, chunk: PhysicalChunk) -> Result<()> {
        // SAFETY: forwarded contract.
        let f = || unsafe { self.inner.map(addr, chunk) };
        self.around(Call::Map { addr, chunk }, f, none)
    }

    unsafe fn set_access(&self, addr: u64, size: usize) -> Result<()> {
        let call = Call::SetAccess {
            addr,
            size,
            mode: AccessMode::ReadWrite,
            owner: None,
        };
        // SAFETY: forwarded contract.
        self.around(call, || unsafe { self.inner.set_access(addr, size) }, none)
    }

    unsafe fn set_access_mode(&self, addr: u64, size: usize, mode: AccessMode) -> Result<()> {
        let call = Call::SetAccess {
            addr,
            size,
            mode,
            owner: None,
        };
        // SAFETY: forwarded contract.
        let f = || unsafe { self.inner.set_access_mode(addr, size, mode) };
        self.around(call, f, none)
    }

    unsafe fn set_import_access(
        &self,
        addr: u64,
        size: usize,
        mode: AccessMode,
        owner: Option<i32>,
    ) -> Result<()> {
        let call = Call::SetAccess {
            addr,
            size,
            mode,
            owner,
        };
        // SAFETY: forwarded contract.
        let f = || unsafe { self.inner.set_import_access(addr, size, mode, owner) };
        self.around(call, f, none)
    }

    unsafe fn unmap(&self, addr: u64, size: usize) -> Result<()> {
        // SAFETY: forwarded contract.
        let f = || unsafe { self.inner.unmap(addr, size) };
        self.around(Call::Unmap { addr, size }, f, none)
    }

    // A replacing map passes the hook as a map (it is one driver call that maps).
    unsafe fn map_over(&self, addr: u64, chunk: PhysicalChunk, mode: AccessMode) -> Result<()> {
        // SAFETY: forwarded contract.
        let f = || unsafe { self.inner.map_over(addr, chunk, mode) };
        self.around(Call::Map { addr, chunk }, f, none)
    }

    fn maps_over(&self) -> bool {
        self.inner.maps_over()
    }

    // Clearing moves data, as copies do: no driver call of the VMM model, but hooks see it.
    unsafe fn wipe_chunk(&self, chunk: PhysicalChunk) -> Result<()> {
        // SAFETY: forwarded contract.
        let f = || unsafe { self.inner.wipe_chunk(chunk) };
        self.around(Call::Wipe { chunk }, f, none)
    }

    fn creates_zeroed(&self) -> bool {
        self.inner.creates_zeroed()
    }

    fn export_chunk(&self, chunk: PhysicalChunk) -> Result<OwnedFd> {
        self.around(
            Call::Export { chunk },
            || self.inner.export_chunk(chunk),
            none,
        )
    }

    fn import_chunk(&self, fd: OwnedFd, size: usize) -> Result<PhysicalChunk> {
        let f = || self.inner.import_chunk(fd, size);
        self.around(Call::Import { size }, f, |c| c.raw)
    }

    fn copies(&self) -> &dyn Copies {
        self
    }

    fn info(&self) -> &BackendInfo {
        self.inner.info()
    }

    fn memory_info(&self) -> Result<MemoryInfo> {
        self.inner.memory_info()
    }

    fn physical_bytes(&self) -> Result<u64> {
        self.inner.physical_bytes()
    }

    fn chunk_lender(&self) -> Option<String> {
        self.inner.chunk_lender()
    }

    fn reach(&self, uuid: &[u8; 16]) -> Result<DeviceReach> {
        self.inner.reach(uuid)
    }

    fn pointer_kind(&self, addr: u64) -> Result<Option<(MemoryKind, Option<i32>)>> {
        self.inner.pointer_kind(addr)
    }
}

/// Staging copies go through the hook; the rest straight to the upstream's copies.
impl<H: Hook> Copies for Intercept<H> {
    unsafe fn copy_to_host_async(
        &self,
        dst: *mut u8,
        src: u64,
        bytes: usize,
        stream: u64,
    ) -> Result<()> {
        let call = Call::StagingCopy {
            bytes,
            direction: StagingDirection::ToHost,
        };
        // SAFETY: forwarded contract.
        let f = || unsafe { self.up().copy_to_host_async(dst, src, bytes, stream) };
        self.around(call, f, none)
    }

    unsafe fn copy_from_host_async(
        &self,
        dst: u64,
        src: *const u8,
        bytes: usize,
        stream: u64,
    ) -> Result<()> {
        let call = Call::StagingCopy {
            bytes,
            direction: StagingDirection::FromHost,
        };
        // SAFETY: forwarded contract.
        let f = || unsafe { self.up().copy_from_host_async(dst, src, bytes, stream) };
        self.around(call, f, none)
    }

    // The rest: passed on unchanged, each under the caller's contract.

    unsafe fn write(&self, addr: u64, data: &[u8]) -> Result<()> {
        // SAFETY: forwarded contract.
        unsafe { self.up().write(addr, data) }
    }

    unsafe fn read(&self, addr: u64, out: &mut [u8]) -> Result<()> {
        // SAFETY: forwarded contract.
        unsafe { self.up().read(addr, out) }
    }

    unsafe fn fill(&self, addr: u64, len: usize, byte: u8) -> Result<()> {
        // SAFETY: forwarded contract.
        unsafe { self.up().fill(addr, len, byte) }
    }

    unsafe fn copy_async(&self, dst: u64, src: u64, bytes: usize, stream: u64) -> Result<()> {
        // SAFETY: forwarded contract.
        unsafe { self.up().copy_async(dst, src, bytes, stream) }
    }

    unsafe fn copy_batch_async(&self, copies: &[(u64, u64, usize)], stream: u64) -> Result<()> {
        // SAFETY: forwarded contract.
        unsafe { self.up().copy_batch_async(copies, stream) }
    }

    fn prepare_gather(&self) -> Result<()> {
        self.up().prepare_gather()
    }

    unsafe fn gather_async(&self, p: &[GatherPiece], s: &[GatherShift], stream: u64) -> Result<()> {
        // SAFETY: forwarded contract.
        unsafe { self.up().gather_async(p, s, stream) }
    }

    unsafe fn fill_async(&self, addr: u64, bytes: usize, byte: u8, stream: u64) -> Result<()> {
        // SAFETY: forwarded contract.
        unsafe { self.up().fill_async(addr, bytes, byte, stream) }
    }

    fn synchronize(&self, stream: u64) -> Result<()> {
        self.up().synchronize(stream)
    }

    fn staging_alloc(&self, bytes: usize) -> Result<*mut u8> {
        self.up().staging_alloc(bytes)
    }

    unsafe fn staging_free(&self, ptr: *mut u8, bytes: usize) -> Result<()> {
        // SAFETY: forwarded contract.
        unsafe { self.up().staging_free(ptr, bytes) }
    }

    fn copy_stream_create(&self) -> Result<u64> {
        self.up().copy_stream_create()
    }

    unsafe fn copy_stream_destroy(&self, stream: u64) -> Result<()> {
        // SAFETY: forwarded contract.
        unsafe { self.up().copy_stream_destroy(stream) }
    }

    unsafe fn marker_record(&self, stream: u64) -> Result<u64> {
        // SAFETY: forwarded contract.
        unsafe { self.up().marker_record(stream) }
    }

    unsafe fn marker_wait(&self, marker: u64) -> Result<()> {
        // SAFETY: forwarded contract.
        unsafe { self.up().marker_wait(marker) }
    }

    unsafe fn marker_done(&self, marker: u64) -> Result<bool> {
        // SAFETY: forwarded contract.
        unsafe { self.up().marker_done(marker) }
    }

    unsafe fn stream_wait_marker(&self, stream: u64, marker: u64) -> Result<()> {
        // SAFETY: forwarded contract.
        unsafe { self.up().stream_wait_marker(stream, marker) }
    }

    unsafe fn marker_drop(&self, marker: u64) -> Result<()> {
        // SAFETY: forwarded contract.
        unsafe { self.up().marker_drop(marker) }
    }
}
