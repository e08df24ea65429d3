//! Backends: the only code in the crate that calls a driver.
//!
//! A backend offers the CUDA virtual-memory model: reserve a virtual range, create physical
//! chunks, map a chunk at an address, grant access, unmap, release. The [`host`] backend gives the
//! same semantics with `mmap` and a `memfd` on any Linux machine; the [`cuda`] backend uses the
//! CUDA driver's VMM API. One adaptor, [`intercept::Intercept`], wraps any backend and shows
//! its VMM calls to a hook: counting ([`counting::Counting`]), and for tests delays and faults
//! ([`testing`]).

pub mod counting;
pub mod cuda;
pub mod host;
pub mod intercept;
#[doc(hidden)]
pub mod testing;

mod cuda_staging;
pub(crate) mod driver;
pub(crate) mod meminfo;

use std::fmt;
use std::os::fd::OwnedFd;
use std::sync::Arc;

use crate::error::Result;

/// CUDA's legacy default stream of the current context (`CU_STREAM_LEGACY`): ordered with every
/// blocking stream. On the host backend any stream value orders nothing.
pub(crate) const LEGACY_STREAM: u64 = 0x1;
/// CUDA's per-thread default stream of the calling thread (`CU_STREAM_PER_THREAD`).
pub(crate) const PER_THREAD_STREAM: u64 = 0x2;

/// Which kind of memory a backend provides.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum MemoryKind {
    /// Host memory (`memfd` pages).
    Host,
    /// Device memory of a CUDA GPU.
    Device,
}

/// How a backend's device reaches a GPU named by its UUID, as [`Backend::reach`] finds it in
/// this process.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DeviceReach {
    /// The backend's own device.
    Same,
    /// Another device of this process, at `ordinal`, whose memory the backend's device can
    /// access (peer access: `cuDeviceCanAccessPeer`).
    Peer {
        /// Its ordinal in this process.
        ordinal: i32,
    },
    /// Another device of this process, at `ordinal`, whose memory the backend's device cannot
    /// access.
    NoPeerAccess {
        /// Its ordinal in this process.
        ordinal: i32,
    },
    /// No device of this process (hidden by `CUDA_VISIBLE_DEVICES` or a container).
    NotVisible,
    /// The backend has no device (host memory), or cannot tell.
    NoDevice,
}

/// A device UUID as `nvidia-smi` writes it (`GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx`).
pub fn format_uuid(uuid: &[u8; 16]) -> String {
    let hex = |r: std::ops::Range<usize>| {
        uuid[r]
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect::<String>()
    };
    format!(
        "GPU-{}-{}-{}-{}-{}",
        hex(0..4),
        hex(4..6),
        hex(6..8),
        hex(8..10),
        hex(10..16)
    )
}

/// What a backend is and what it supports. Fixed for the backend's life.
#[derive(Debug, Clone)]
pub struct BackendInfo {
    /// Short name: `"host"` or `"cuda"`.
    pub name: &'static str,
    /// Host or device memory.
    pub memory_kind: MemoryKind,
    /// Device ordinal for device memory; `None` for host memory. Meaningful in this process
    /// only: `CUDA_VISIBLE_DEVICES` and containers number GPUs per process.
    pub device_ordinal: Option<i32>,
    /// The device's UUID (CUDA `cuDeviceGetUuid`), which names one GPU in every process of a
    /// node; `None` for host memory.
    pub device_uuid: Option<[u8; 16]>,
    /// Human-readable description of the device (GPU name, or "host memory (memfd)").
    pub device_name: String,
    /// The unit of mapping: every physical chunk and every mapped range is a multiple of it.
    pub granularity: usize,
    /// The smallest granularity the driver allows.
    pub min_granularity: usize,
    /// Whether the device supports virtual memory management at all.
    pub vmm_supported: bool,
    /// Whether physical chunks are created GPUDirect-RDMA capable.
    pub rdma_capable: bool,
    /// Whether physical chunks can be exported as POSIX file descriptors.
    pub posix_fd_exportable: bool,
    /// Whether physical chunks are created with a fabric handle type (CUDA
    /// `CU_MEM_HANDLE_TYPE_FABRIC`: multi-node NVLink needs it, and so does UCX's `cuda_ipc`
    /// for VMM memory where it has no POSIX-fd path); only where a probe `cuMemCreate` with it
    /// succeeded (it needs an IMEX channel).
    pub fabric_exportable: bool,
    /// Total memory of the device (or of the host), in bytes.
    pub total_memory: u64,
    /// Whether the memory is page-locked host memory a device copies at link speed: a host
    /// tier ([`cuda::CudaBackend::host_tier`], or [`host::HostBackend::locked`] as fallback).
    /// False for device memory and pageable host memory.
    pub page_locked: bool,
}

/// A physical chunk created by a backend: an opaque driver handle and its size.
///
/// Chunks are plain values; the pool owns them and hands them back to the backend exactly once.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct PhysicalChunk {
    /// The backend's handle (CUDA: `CUmemGenericAllocationHandle`; host: offset in the memfd).
    pub(crate) raw: u64,
    /// Size in bytes, a multiple of the backend's granularity.
    pub(crate) size: usize,
}

impl PhysicalChunk {
    /// Size in bytes.
    pub fn size(&self) -> usize {
        self.size
    }

    /// The backend's raw handle.
    pub fn raw(&self) -> u64 {
        self.raw
    }
}

/// What a mapping lets the owning device do: what [`Backend::set_access_mode`] grants.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub enum AccessMode {
    /// Read and write (what [`Backend::set_access`] grants).
    ReadWrite,
    /// Read only: a write through the mapping faults (host) or is refused by the device.
    ReadOnly,
}

/// Free and total memory as the driver (or the kernel) reports it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MemoryInfo {
    /// Bytes free on the device (CUDA: `cuMemGetInfo`; host: `MemAvailable`; a CUDA host
    /// tier: `MemFree` of its NUMA node, see [`cuda::CudaBackend::host_tier`]).
    pub free: u64,
    /// Bytes in total.
    pub total: u64,
}

/// The driver calls a backend makes, for stats and fault injection.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DriverCall {
    /// Reserve a virtual range (`cuMemAddressReserve`, `mmap(PROT_NONE)`).
    Reserve,
    /// Free a virtual range (`cuMemAddressFree`, `munmap`).
    FreeReservation,
    /// Create a physical chunk (`cuMemCreate`, `fallocate`).
    Create,
    /// Release a physical chunk (`cuMemRelease`, punch hole).
    Release,
    /// Map a chunk at an address (`cuMemMap`, `mmap(MAP_FIXED)`).
    Map,
    /// Grant read-write access (`cuMemSetAccess`, `mprotect`).
    SetAccess,
    /// Unmap a range (`cuMemUnmap`, `mmap(PROT_NONE, MAP_FIXED)`).
    Unmap,
}

impl DriverCall {
    /// Every kind, in a fixed order (the index used by stats).
    pub const ALL: [DriverCall; 7] = [
        DriverCall::Reserve,
        DriverCall::FreeReservation,
        DriverCall::Create,
        DriverCall::Release,
        DriverCall::Map,
        DriverCall::SetAccess,
        DriverCall::Unmap,
    ];

    /// Position in [`DriverCall::ALL`].
    pub fn index(self) -> usize {
        self as usize
    }

    /// Short lowercase name.
    pub fn name(self) -> &'static str {
        match self {
            DriverCall::Reserve => "reserve",
            DriverCall::FreeReservation => "free_reservation",
            DriverCall::Create => "create",
            DriverCall::Release => "release",
            DriverCall::Map => "map",
            DriverCall::SetAccess => "set_access",
            DriverCall::Unmap => "unmap",
        }
    }
}

impl fmt::Display for DriverCall {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// How much a batch of new chunks is needed, for backends whose chunks come from a shared
/// budget (the broker's engines): a required chunk may cost other users their idle memory (the
/// broker asks them to give back), a look-ahead chunk is taken only if it is free at once.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Need {
    /// The request cannot be served without it.
    Required,
    /// Growth ahead of need: never at anyone else's expense.
    LookAhead,
}

/// `count` chunks of `size` bytes from `backend.create`, one after the other: all, or none (what
/// was made before a failure is released again). [`Backend::create_many`]'s default.
pub(crate) fn create_one_by_one<B: Backend + ?Sized>(
    backend: &B,
    size: usize,
    count: usize,
) -> Result<Vec<PhysicalChunk>> {
    // Released on every way out but success, an unwinding panic included (a batch spread over
    // threads turns a worker's panic into an error, so its chunks must not go with its stack).
    let mut made = Made {
        backend,
        size,
        chunks: Vec::with_capacity(count),
    };
    for _ in 0..count {
        let c = backend.create(size)?;
        made.chunks.push(c);
    }
    Ok(std::mem::take(&mut made.chunks))
}

/// Chunks of a batch create under way: released when dropped (the batch failed or panicked).
struct Made<'a, B: Backend + ?Sized> {
    backend: &'a B,
    size: usize,
    chunks: Vec<PhysicalChunk>,
}

impl<B: Backend + ?Sized> Drop for Made<'_, B> {
    fn drop(&mut self) {
        release_made(self.backend, std::mem::take(&mut self.chunks), self.size);
    }
}

/// Release chunks a failed batch create made (logged, never failing: the create's error is the
/// news).
fn release_made<B: Backend + ?Sized>(backend: &B, made: Vec<PhysicalChunk>, size: usize) {
    for c in made {
        // SAFETY: made by this backend for a batch that failed, mapped nowhere, released once.
        if let Err(r) = unsafe { backend.release(c) } {
            tracing::error!(error = %r, size, "release after a failed batch create failed; the chunk is leaked");
        }
    }
}

/// [`create_one_by_one`] spread over up to `threads` threads, each creating its share: for
/// memory whose creation is slow per byte and scales across cores (VMM host memory, which the
/// driver pins as it creates it). All or none, as one batch: when any thread fails, every chunk
/// made by the others is released again and the first error comes back. Chunks come back in no
/// particular order.
pub(crate) fn create_on_threads<B: Backend + ?Sized>(
    backend: &B,
    size: usize,
    count: usize,
    threads: usize,
) -> Result<Vec<PhysicalChunk>> {
    let threads = threads.clamp(1, count.max(1));
    if threads == 1 {
        return create_one_by_one(backend, size, count);
    }
    let results: Vec<Result<Vec<PhysicalChunk>>> = std::thread::scope(|s| {
        // A thread the system will not give (`scope.spawn` would panic) does its share here.
        let workers: Vec<_> = (0..threads)
            .map(|t| {
                let share = count / threads + usize::from(t < count % threads);
                std::thread::Builder::new()
                    .spawn_scoped(s, move || create_one_by_one(backend, size, share))
                    .map(|h| (h, share))
                    .map_err(|e| (e, share))
            })
            .collect();
        workers
            .into_iter()
            .map(|w| match w {
                Err((e, share)) => {
                    tracing::debug!(error = %e, share, "no thread for a share of a batch create; made here");
                    create_one_by_one(backend, size, share)
                }
                Ok((w, share)) => w.join().unwrap_or_else(|_| {
                    Err(crate::error::Error::backend(
                        backend.info().name,
                        "create_many",
                        "PANIC",
                        format!("a thread creating {share} of a batch of {count} chunks of {size} bytes panicked (the batch was released)"),
                    ))
                }),
            })
            .collect()
    });
    let mut made = Vec::with_capacity(count);
    let mut first = None;
    for r in results {
        match r {
            Ok(cs) => made.extend(cs),
            Err(e) => {
                first.get_or_insert(e);
            }
        }
    }
    match first {
        None => Ok(made),
        Some(e) => {
            release_made(backend, made, size);
            Err(e)
        }
    }
}

/// The virtual-memory driver interface. Implementations are thin: no caching, no policy.
///
/// Addresses are absolute (`u64`, as CUDA's `CUdeviceptr`); sizes are multiples of
/// [`BackendInfo::granularity`]. Moving bytes is [`Copies`]' business.
///
/// The calls that change mappings or touch memory are `unsafe`: on the host backend a wrong
/// address unmaps or overwrites memory the process uses for something else. The pool is the only
/// caller in the crate and upholds each contract stated below.
pub trait Backend: Send + Sync + fmt::Debug {
    /// What this backend is.
    fn info(&self) -> &BackendInfo;

    /// Reserve `size` bytes of virtual address space aligned to `alignment`. Nothing physical.
    fn reserve(&self, size: usize, alignment: usize) -> Result<u64>;

    /// Give a reservation back.
    ///
    /// # Safety
    /// `base`/`size` must be exactly a reservation made by this backend, with nothing mapped in
    /// it and nothing referring to it afterwards.
    unsafe fn free_reservation(&self, base: u64, size: usize) -> Result<()>;

    /// Create a physical chunk of `size` bytes.
    fn create(&self, size: usize) -> Result<PhysicalChunk>;

    /// Give a physical chunk back to the driver (for an imported chunk: this process's reference
    /// to it; the memory lives on while another process holds one).
    ///
    /// # Safety
    /// `chunk` must come from this backend's `create` or `import_chunk`, be released once, and
    /// be mapped nowhere.
    unsafe fn release(&self, chunk: PhysicalChunk) -> Result<()>;

    /// Create `count` physical chunks of `size` bytes each: all of them, or none (what was
    /// made before a failure is released again). Backends whose chunks come from elsewhere
    /// (a broker) serve the whole batch in one request, and tell it how much the chunks are
    /// needed ([`Need`]); this default creates them one by one and ignores `need`.
    fn create_many(&self, size: usize, count: usize, need: Need) -> Result<Vec<PhysicalChunk>> {
        let _ = need;
        create_one_by_one(self, size, count)
    }

    /// Release each of `chunks` as [`Backend::release`] would, one result per chunk in order
    /// (a chunk whose release failed is still the caller's). Backends whose chunks go back
    /// elsewhere (a broker) return the whole batch in one message; this default releases them
    /// one by one.
    ///
    /// # Safety
    /// As for [`Backend::release`], for every chunk.
    unsafe fn release_many(&self, chunks: &[PhysicalChunk]) -> Vec<Result<()>> {
        chunks
            .iter()
            // SAFETY: forwarded contract, chunk by chunk.
            .map(|&c| unsafe { self.release(c) })
            .collect()
    }

    /// Map `chunk` at `addr`, with no access yet.
    ///
    /// # Safety
    /// `addr..addr + chunk.size` must lie in a reservation of this backend and be unmapped;
    /// `chunk` must come from this backend (`create` or `import_chunk`), be live, and be mapped
    /// nowhere else in this process, unless every mapping of it is only ever granted
    /// [`AccessMode::ReadOnly`] (a pool's zero page, aliased under many addresses).
    unsafe fn map(&self, addr: u64, chunk: PhysicalChunk) -> Result<()>;

    /// Grant read-write access to the owning device over a mapped range.
    ///
    /// # Safety
    /// `addr..addr + size` must be made of chunks this backend mapped.
    unsafe fn set_access(&self, addr: u64, size: usize) -> Result<()>;

    /// Grant `mode` access to the owning device over a mapped range. [`AccessMode::ReadWrite`]
    /// is [`Backend::set_access`]; backends that cannot map read-only keep this default, which
    /// fails for [`AccessMode::ReadOnly`] with a [`crate::Error::Backend`] whose code is
    /// `UNSUPPORTED` (the caller may then fall back to read-write).
    ///
    /// # Safety
    /// As for [`Backend::set_access`].
    unsafe fn set_access_mode(&self, addr: u64, size: usize, mode: AccessMode) -> Result<()> {
        match mode {
            // SAFETY: forwarded contract.
            AccessMode::ReadWrite => unsafe { self.set_access(addr, size) },
            AccessMode::ReadOnly => Err(crate::error::Error::backend(
                self.info().name,
                "set_access_mode",
                "UNSUPPORTED",
                "this backend cannot map memory read-only",
            )),
        }
    }

    /// Grant `mode` access over a mapped range of imported chunks to the backend's device
    /// and, with `owner`, to that device of this process too: the GPU the chunks live on
    /// ([`DeviceReach::Peer`]), so a copy queued on either device may read them. The default
    /// is [`Backend::set_access_mode`] and refuses an `owner` (`UNSUPPORTED`): a backend that
    /// wraps another forwards this (as the interceptor and the broker model do), or imports
    /// from another GPU fail.
    ///
    /// # Safety
    /// As for [`Backend::set_access`].
    unsafe fn set_import_access(
        &self,
        addr: u64,
        size: usize,
        mode: AccessMode,
        owner: Option<i32>,
    ) -> Result<()> {
        match owner {
            // SAFETY: forwarded contract.
            None => unsafe { self.set_access_mode(addr, size, mode) },
            Some(o) => Err(crate::error::Error::backend(
                self.info().name,
                "set_import_access",
                "UNSUPPORTED",
                format!("this backend cannot grant device {o} access to its mappings"),
            )),
        }
    }

    /// How the backend's device reaches the GPU named `uuid` (another process's device): the
    /// same device, another one it has peer access to, one without, or none this process sees.
    /// The default knows its own device only ([`BackendInfo::device_uuid`]): anything else is
    /// [`DeviceReach::NoDevice`], so a wrapper that does not forward this moves blocks from
    /// other GPUs over NIXL.
    fn reach(&self, uuid: &[u8; 16]) -> Result<DeviceReach> {
        Ok(if self.info().device_uuid.as_ref() == Some(uuid) {
            DeviceReach::Same
        } else {
            DeviceReach::NoDevice
        })
    }

    /// Unmap a range made of whole mapped chunks; the range returns to the reservation.
    ///
    /// # Safety
    /// `addr..addr + size` must be made of whole chunks this backend mapped, and nothing may use
    /// that memory any more.
    unsafe fn unmap(&self, addr: u64, size: usize) -> Result<()>;

    /// Map `chunk` at `addr` with `mode` access in one step, in place of whatever this backend
    /// maps there (chunks, or read-only aliases of a pool's zero page) or of unmapped space: a
    /// concurrent reader of any byte of the range sees the old mapping or the new one, never
    /// a hole. What was mapped there is unmapped by the call. Backends that cannot replace a
    /// mapping atomically (CUDA: `cuMemMap` needs unmapped space) keep this default, which
    /// fails with code `UNSUPPORTED`; [`Backend::maps_over`] says which it is.
    ///
    /// # Safety
    /// As for [`Backend::map`], except that the range may be mapped: every mapping of it is
    /// whole chunks (or granules of a read-only alias) this backend mapped, which nothing uses
    /// any more (an alias may be read meanwhile).
    unsafe fn map_over(&self, addr: u64, chunk: PhysicalChunk, mode: AccessMode) -> Result<()> {
        let _ = (addr, chunk, mode);
        Err(crate::error::Error::backend(
            self.info().name,
            "map_over",
            "UNSUPPORTED",
            "this backend cannot replace a mapping in one step",
        ))
    }

    /// Whether [`Backend::map_over`] works here.
    fn maps_over(&self) -> bool {
        false
    }

    /// Set every byte of `chunk`, mapped nowhere, to zero without mapping it (host: its file
    /// range is punched and committed again). Backends that can only clear mapped memory keep
    /// this default, which fails with code `UNSUPPORTED`; the pool then clears the chunk once
    /// it is mapped, before anyone sees it.
    ///
    /// # Safety
    /// `chunk` is live, from this backend, and mapped nowhere (in no process).
    unsafe fn wipe_chunk(&self, chunk: PhysicalChunk) -> Result<()> {
        let _ = chunk;
        Err(crate::error::Error::backend(
            self.info().name,
            "wipe_chunk",
            "UNSUPPORTED",
            "this backend clears only mapped memory",
        ))
    }

    /// Whether every chunk [`Backend::create`] makes reads as zero (host: fresh file pages;
    /// CUDA device memory: as measured, see [`cuda::CudaBackend::clear_new_chunks`]). False
    /// where a new chunk may hold what an earlier user of its memory wrote (a broker's engine,
    /// whose chunks may be handed over from another engine; a CUDA host tier; CUDA with
    /// `EVMM_CLEAR_NEW_CHUNKS=1`): the pool then clears what it creates before anyone sees it.
    fn creates_zeroed(&self) -> bool {
        false
    }

    /// Free and total memory of the device.
    fn memory_info(&self) -> Result<MemoryInfo>;

    /// Bytes of physical memory this backend currently holds in created chunks, measured from
    /// the system where possible (host: the memfd's allocated blocks), else from its own counts.
    fn physical_bytes(&self) -> Result<u64>;

    /// Export `chunk` as a POSIX file descriptor another process can import with
    /// [`Backend::import_chunk`] (sent over a Unix socket with `SCM_RIGHTS`, see
    /// [`crate::ipc`]). The descriptor gives access to this chunk only, and keeps its memory
    /// alive until every process that holds it (or an import of it) has let go, whatever this
    /// process does with its own handle afterwards.
    ///
    /// Backends that cannot export keep this default, which fails with a
    /// [`crate::Error::Backend`] whose code is `UNSUPPORTED`; [`BackendInfo::posix_fd_exportable`]
    /// says which.
    fn export_chunk(&self, chunk: PhysicalChunk) -> Result<OwnedFd> {
        let _ = chunk;
        Err(crate::error::Error::backend(
            self.info().name,
            "export_chunk",
            "UNSUPPORTED",
            "this backend cannot export chunks as POSIX file descriptors",
        ))
    }

    /// Who lends this backend's chunks, when they are not this process's own: `None` (the
    /// default) for chunks the backend creates and releases to its driver; a description of
    /// the lender otherwise (a broker model's chunks go back to the broker on release, which
    /// hands them to other engines). Chunks that are lent cannot change owner by a p2p
    /// hand-off ([`crate::p2p::PeerLink::hand_off`]): the lender would take them back while the
    /// new owner still uses them.
    fn chunk_lender(&self) -> Option<String> {
        None
    }

    /// Import a chunk of `size` bytes exported by another process (or this one) with
    /// [`Backend::export_chunk`] of the same kind of backend. The chunk behaves like a created
    /// one: map it, grant access, unmap it, and [`Backend::release`] it once; the memory is
    /// shared with every other holder. The descriptor is consumed. A descriptor that is not an
    /// exported chunk, or one smaller than `size`, is an error, never a mapping of memory that
    /// does not exist.
    ///
    /// Backends that cannot import keep this default, which fails with code `UNSUPPORTED`.
    fn import_chunk(&self, fd: OwnedFd, size: usize) -> Result<PhysicalChunk> {
        let _ = (fd, size);
        Err(crate::error::Error::backend(
            self.info().name,
            "import_chunk",
            "UNSUPPORTED",
            "this backend cannot import chunks from POSIX file descriptors",
        ))
    }

    /// Copies and streams on this backend's memory ([`Copies`]): usually the backend itself;
    /// a wrapper returns the one it wraps, or itself where it intercepts copies.
    fn copies(&self) -> &dyn Copies;

    /// What memory `addr` is, where the driver can tell: its kind and, for device memory, the
    /// device ordinal (CUDA: `cuPointerGetAttribute`; memory CUDA does not know is pageable
    /// host memory). `None` (the default) when the backend cannot tell. The layout builder
    /// checks caller memory's declared kind with it ([`crate::layout::LayoutBuilder::checked_by`]).
    fn pointer_kind(&self, addr: u64) -> Result<Option<(MemoryKind, Option<i32>)>> {
        let _ = addr;
        Ok(None)
    }
}

/// Copies and streams: moving bytes in and out of mapped memory, synchronously or on GPU
/// streams, and the host staging of sleep and wake. Reached through [`Backend::copies`], so a
/// wrapper of the VMM core forwards one method, not these.
///
/// Sizes here are any byte range inside mapped, accessible memory.
pub trait Copies: Backend {
    /// Copy `data` into memory at `addr`.
    ///
    /// # Safety
    /// `addr..addr + data.len()` must be mapped with access, and no one else may use it meanwhile.
    unsafe fn write(&self, addr: u64, data: &[u8]) -> Result<()>;

    /// Copy memory at `addr` into `out`.
    ///
    /// # Safety
    /// `addr..addr + out.len()` must be mapped with access.
    unsafe fn read(&self, addr: u64, out: &mut [u8]) -> Result<()>;

    /// Set `len` bytes at `addr` to `byte`.
    ///
    /// # Safety
    /// As for [`Copies::write`].
    unsafe fn fill(&self, addr: u64, len: usize, byte: u8) -> Result<()>;

    /// Queue a copy of `bytes` bytes from device memory at `src` to `dst` on the GPU stream
    /// `stream` (a raw `CUstream` handle as an integer: `1` is CUDA's legacy default stream,
    /// `2` the calling thread's per-thread default stream), in stream order, without waiting.
    /// `bytes == 0` queues nothing and succeeds on every backend that supports the call.
    ///
    /// Backends that queue no GPU work (the host backend) keep this default, which fails with
    /// a [`crate::Error::Backend`] whose code is `UNSUPPORTED`. The `candle` module queues its
    /// copies and zero fills through these two calls, and upholds their contracts.
    ///
    /// # Safety
    /// - `src..src + bytes` and `dst..dst + bytes` lie in memory of this backend's device that
    ///   is mapped with access, and stay mapped until the GPU has executed the copy (an unmap
    ///   must be ordered after it, by a synchronize or an event recorded on `stream` after it);
    /// - the two ranges do not overlap;
    /// - every other use of `dst`, and every write of `src`, is ordered with `stream` (queued on
    ///   it, joined to it by events, or on a blocking stream when `stream` is the legacy one,
    ///   which CUDA orders implicitly), so that nothing races the copy on the GPU;
    /// - `stream` is a live stream of this device's primary context, or one of the two special
    ///   handles above.
    unsafe fn copy_async(&self, dst: u64, src: u64, bytes: usize, stream: u64) -> Result<()> {
        let _ = (dst, src, bytes, stream);
        Err(crate::error::Error::backend(
            self.info().name,
            "copy_async",
            "UNSUPPORTED",
            "this backend queues no stream-ordered copies",
        ))
    }

    /// Queue every copy of `copies` (`(dst, src, bytes)`) on `stream`, in stream order, as
    /// [`Copies::copy_async`] would one after the other; a backend may submit them as one
    /// batch (CUDA: `cuMemcpyBatchAsync` where the driver has it, on streams other than the
    /// legacy default one). This default queues them one by one.
    ///
    /// # Safety
    /// As for [`Copies::copy_async`], for every copy; no destination overlaps another copy's
    /// source or destination.
    unsafe fn copy_batch_async(&self, copies: &[(u64, u64, usize)], stream: u64) -> Result<()> {
        for &(dst, src, bytes) in copies {
            // SAFETY: forwarded contract, copy by copy.
            unsafe { self.copy_async(dst, src, bytes, stream) }?;
        }
        Ok(())
    }

    /// Queue a gather copy on `stream`: for every shift `h` of `shifts` and every piece `p` of
    /// `pieces`, `p.len` bytes from `h.src + p.src` to `h.dst + p.dst` (sums modulo 2^64), in
    /// stream order, without waiting (CUDA: one launch of the crate's gather kernel, see
    /// [`GatherPiece`]). Empty pieces or shifts queue nothing.
    ///
    /// Backends without such a kernel keep this default, which fails with a
    /// [`crate::Error::Backend`] whose code is `UNSUPPORTED`; the caller then copies with
    /// [`Copies::copy_batch_async`]. A failure queues nothing that reads or writes the ranges.
    ///
    /// # Safety
    /// As for [`Copies::copy_async`], for every copy the pattern makes; no copy's destination
    /// overlaps another copy's destination or any copy's source. The stream is not being
    /// captured into a CUDA graph (the descriptors' buffers are reused once the launch ran,
    /// which a graph's replays would not respect).
    unsafe fn gather_async(
        &self,
        pieces: &[GatherPiece],
        shifts: &[GatherShift],
        stream: u64,
    ) -> Result<()> {
        let _ = (pieces, shifts, stream);
        Err(crate::error::Error::backend(
            self.info().name,
            "gather_async",
            "UNSUPPORTED",
            "this backend has no gather kernel",
        ))
    }

    /// Load what [`Copies::gather_async`] launches now rather than at its first call, so that
    /// call times the copy alone (on CUDA: the kernel's module, JIT-compiled from PTX, and its
    /// descriptor staging). Backends with nothing to load keep this default.
    fn prepare_gather(&self) -> Result<()> {
        Ok(())
    }

    /// Wait until every piece of work queued on the GPU stream `stream` (a raw `CUstream` or one
    /// of the special handles of [`Copies::copy_async`]) has run.
    ///
    /// Backends that queue no GPU work keep this default, which fails with code `UNSUPPORTED`.
    fn synchronize(&self, stream: u64) -> Result<()> {
        let _ = stream;
        Err(crate::error::Error::backend(
            self.info().name,
            "synchronize",
            "UNSUPPORTED",
            "this backend queues no GPU work",
        ))
    }

    /// Queue setting `bytes` bytes at `addr` to `byte` on the GPU stream `stream`, in stream
    /// order, without waiting. Handles, zero sizes and the default as for
    /// [`Copies::copy_async`].
    ///
    /// # Safety
    /// - `addr..addr + bytes` lies in memory of this backend's device that is mapped with
    ///   access, and stays mapped until the GPU has executed the fill;
    /// - every other use of that range is ordered with `stream`;
    /// - `stream` is a live stream of this device's primary context, or a special handle.
    unsafe fn fill_async(&self, addr: u64, bytes: usize, byte: u8, stream: u64) -> Result<()> {
        let _ = (addr, bytes, byte, stream);
        Err(crate::error::Error::backend(
            self.info().name,
            "fill_async",
            "UNSUPPORTED",
            "this backend queues no stream-ordered fills",
        ))
    }

    // ---- host staging for sleep and wake (see `crate::SleepPolicy`) ----
    //
    // A pool that sleeps copies its memory into one host staging buffer, allocated once (ahead
    // of the sleep: pinning is slow) and reused. Copies go through a copy stream of the backend
    // and are awaited through markers, so that unmapping a piece overlaps the copy of the next.
    // The defaults are synchronous and fit every backend whose memory the CPU reaches (the host
    // backend): ordinary memory, no stream, each copy done when the call returns.

    /// Allocate `bytes` of host memory for staging copies (CUDA: page-locked with
    /// `cuMemHostAlloc`, which costs about 0.6 s per GiB; host: ordinary memory). The memory's
    /// contents are unspecified; it is given back with [`Copies::staging_free`].
    fn staging_alloc(&self, bytes: usize) -> Result<*mut u8> {
        let layout = staging_layout(bytes)?;
        // SAFETY: the layout has a non-zero size (checked by `staging_layout`).
        let ptr = unsafe { std::alloc::alloc(layout) };
        if ptr.is_null() {
            return Err(crate::error::Error::backend(
                self.info().name,
                "staging_alloc",
                "ENOMEM",
                format!("{bytes} bytes of host memory"),
            ));
        }
        Ok(ptr)
    }

    /// Give back staging memory.
    ///
    /// # Safety
    /// `ptr` and `bytes` come from one [`Copies::staging_alloc`] of this backend, freed once,
    /// with no copy on it still queued.
    unsafe fn staging_free(&self, ptr: *mut u8, bytes: usize) -> Result<()> {
        let layout = staging_layout(bytes)?;
        // SAFETY: forwarded from the caller: `ptr` came from `alloc` with this layout.
        unsafe { std::alloc::dealloc(ptr, layout) };
        Ok(())
    }

    /// A stream for staging copies (CUDA: a non-blocking stream of the device's primary
    /// context). The default has no stream and returns 0.
    fn copy_stream_create(&self) -> Result<u64> {
        Ok(0)
    }

    /// Destroy a stream from [`Copies::copy_stream_create`].
    ///
    /// # Safety
    /// `stream` came from this backend's `copy_stream_create`, is destroyed once, and nothing
    /// queued on it is still needed (synchronize it first).
    unsafe fn copy_stream_destroy(&self, stream: u64) -> Result<()> {
        let _ = stream;
        Ok(())
    }

    /// Queue a copy of `bytes` bytes of memory at `src` to host memory at `dst` on `stream`
    /// (default: copied before the call returns).
    ///
    /// # Safety
    /// `src..src + bytes` is mapped with access and stays mapped until the copy ran (wait for a
    /// marker recorded after it); `dst..dst + bytes` is staging memory of this backend, or
    /// mapped memory of a host tier this backend's device reaches (`Pool::host_tier`), that
    /// nothing else reads or writes until then; `stream` came from `copy_stream_create`.
    unsafe fn copy_to_host_async(
        &self,
        dst: *mut u8,
        src: u64,
        bytes: usize,
        stream: u64,
    ) -> Result<()> {
        let _ = stream;
        // SAFETY: forwarded from the caller; the staging range is valid for `bytes` writes.
        unsafe { self.read(src, std::slice::from_raw_parts_mut(dst, bytes)) }
    }

    /// Queue a copy of `bytes` bytes of host memory at `src` to memory at `dst` on `stream`
    /// (default: copied before the call returns).
    ///
    /// # Safety
    /// `dst..dst + bytes` is mapped with access, stays mapped until the copy ran, and nothing
    /// else uses it meanwhile; `src..src + bytes` is staging memory of this backend (or of a
    /// host tier its device reaches, as for [`Copies::copy_to_host_async`]), unchanged until
    /// then; `stream` came from `copy_stream_create`.
    unsafe fn copy_from_host_async(
        &self,
        dst: u64,
        src: *const u8,
        bytes: usize,
        stream: u64,
    ) -> Result<()> {
        let _ = stream;
        // SAFETY: forwarded from the caller; the staging range is valid for `bytes` reads.
        unsafe { self.write(dst, std::slice::from_raw_parts(src, bytes)) }
    }

    /// Record a marker on `stream` after everything queued so far (CUDA: an event); the default
    /// queues nothing and returns 0.
    ///
    /// # Safety
    /// `stream` came from `copy_stream_create`, or is a live stream of this device's primary
    /// context (or a special handle of [`Copies::copy_async`]).
    unsafe fn marker_record(&self, stream: u64) -> Result<u64> {
        let _ = stream;
        Ok(0)
    }

    /// Whether the work before `marker` has run, without waiting (CUDA: `cuEventQuery`); the
    /// marker stays live. The default (work done when queued) says yes.
    ///
    /// # Safety
    /// `marker` came from `marker_record` and has not been waited for or dropped.
    unsafe fn marker_done(&self, marker: u64) -> Result<bool> {
        let _ = marker;
        Ok(true)
    }

    /// Make the work queued on `stream` from now on wait for the work before `marker`, without
    /// blocking the host (CUDA: `cuStreamWaitEvent`); the marker stays live. The default (work
    /// done when queued) has nothing to wait for.
    ///
    /// # Safety
    /// `marker` as for [`Copies::marker_done`]; `stream` as for [`Copies::marker_record`].
    unsafe fn stream_wait_marker(&self, stream: u64, marker: u64) -> Result<()> {
        let _ = (stream, marker);
        Ok(())
    }

    /// Give a marker back without waiting for it (CUDA releases the event once its work ran,
    /// also when a stream still waits on it).
    ///
    /// # Safety
    /// `marker` came from `marker_record` and is neither waited for nor dropped again.
    unsafe fn marker_drop(&self, marker: u64) -> Result<()> {
        let _ = marker;
        Ok(())
    }

    /// Wait until the work before a marker ran, then destroy the marker. A failed copy before
    /// it reports its error here.
    ///
    /// # Safety
    /// `marker` came from `marker_record` and is waited for once.
    unsafe fn marker_wait(&self, marker: u64) -> Result<()> {
        let _ = marker;
        Ok(())
    }
}

/// One piece of a gather copy's pattern ([`Copies::gather_async`]): `len` bytes from offset
/// `src` to offset `dst`, both relative to a [`GatherShift`]. Laid out as the kernel reads it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(C)]
pub struct GatherPiece {
    /// Source offset (added to the shift's source, modulo 2^64).
    pub src: u64,
    /// Destination offset (added to the shift's destination, modulo 2^64).
    pub dst: u64,
    /// Bytes.
    pub len: u64,
}

/// Where one repetition of a gather copy's pattern lies ([`Copies::gather_async`]): the
/// pattern's offsets are added to these addresses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(C)]
pub struct GatherShift {
    /// Added to every piece's source offset.
    pub src: u64,
    /// Added to every piece's destination offset.
    pub dst: u64,
}

/// Queue a gather copy on `stream` ([`Copies::gather_async`]), or, where the backend has no
/// gather kernel (or its launch failed, which queues nothing), the same copies one by one in a
/// batch ([`Copies::copy_batch_async`]).
///
/// # Safety
/// As for [`Copies::gather_async`].
pub(crate) unsafe fn gather_or_copy_async(
    copies: &dyn Copies,
    pieces: &[GatherPiece],
    shifts: &[GatherShift],
    stream: u64,
) -> Result<()> {
    // SAFETY: the caller's promise.
    match unsafe { copies.gather_async(pieces, shifts, stream) } {
        Ok(()) => Ok(()),
        Err(e) => {
            tracing::debug!(error = %e, "no gather kernel; copying piece by piece");
            let flat: Vec<(u64, u64, usize)> = shifts
                .iter()
                .flat_map(|s| {
                    pieces.iter().map(move |p| {
                        (
                            s.dst.wrapping_add(p.dst),
                            s.src.wrapping_add(p.src),
                            p.len as usize,
                        )
                    })
                })
                .collect();
            // SAFETY: as above: the same copies; the failed gather queued nothing.
            unsafe { copies.copy_batch_async(&flat, stream) }
        }
    }
}

/// The size of a gather copy's descriptors as the kernel reads them (the pieces, 24 bytes each,
/// then the shifts, 16 bytes each): total bytes and the word index where the shifts start. The
/// pieces' count must fit 32 bits and the tasks (`pieces * shifts`) 64 bits; anything else is
/// an error with the numbers.
pub(crate) fn gather_size(
    pieces: &[GatherPiece],
    shifts: &[GatherShift],
) -> Result<(usize, usize)> {
    let too_many = |detail: String| crate::error::Error::SizeOverflow {
        what: "gather descriptors",
        detail,
    };
    u32::try_from(pieces.len())
        .map_err(|_| too_many(format!("{} pieces (at most {})", pieces.len(), u32::MAX)))?;
    (pieces.len() as u64)
        .checked_mul(shifts.len() as u64)
        .ok_or_else(|| too_many(format!("{} pieces * {} shifts", pieces.len(), shifts.len())))?;
    let at = pieces
        .len()
        .checked_mul(3)
        .ok_or_else(|| too_many(format!("{} pieces", pieces.len())))?;
    let bytes = shifts
        .len()
        .checked_mul(2)
        .and_then(|s| s.checked_add(at))
        .and_then(|w| w.checked_mul(8))
        .ok_or_else(|| too_many(format!("{} pieces + {} shifts", pieces.len(), shifts.len())))?;
    Ok((bytes, at))
}

/// Write a gather copy's descriptors into `out` as the kernel reads them ([`gather_size`]:
/// `out` holds at least its bytes): the pieces (`src, dst, len`) then the shifts (`src, dst`),
/// little-endian words as on the GPU.
pub(crate) fn write_gather(pieces: &[GatherPiece], shifts: &[GatherShift], out: &mut [u8]) {
    let pb = std::mem::size_of_val(pieces);
    let sb = std::mem::size_of_val(shifts);
    debug_assert!(out.len() >= pb + sb, "{} bytes for {pb} + {sb}", out.len());
    let (out_pieces, rest) = out.split_at_mut(pb);
    let out_shifts = &mut rest[..sb];
    if cfg!(target_endian = "little") {
        // SAFETY: `GatherPiece` and `GatherShift` are `repr(C)` structs of `u64` fields only
        // (no padding), so the slices are `pb` and `sb` initialized bytes; on a little-endian
        // target they are the kernel's words as they are.
        let (p, s) = unsafe {
            (
                std::slice::from_raw_parts(pieces.as_ptr().cast::<u8>(), pb),
                std::slice::from_raw_parts(shifts.as_ptr().cast::<u8>(), sb),
            )
        };
        out_pieces.copy_from_slice(p);
        out_shifts.copy_from_slice(s);
    } else {
        let words = pieces.iter().flat_map(|p| [p.src, p.dst, p.len]);
        for (slot, w) in out_pieces.chunks_exact_mut(8).zip(words) {
            slot.copy_from_slice(&w.to_le_bytes());
        }
        let words = shifts.iter().flat_map(|h| [h.src, h.dst]);
        for (slot, w) in out_shifts.chunks_exact_mut(8).zip(words) {
            slot.copy_from_slice(&w.to_le_bytes());
        }
    }
}

/// [`write_gather`] into a new buffer of 64-bit words, with the word index where the shifts
/// start.
pub(crate) fn pack_gather(
    pieces: &[GatherPiece],
    shifts: &[GatherShift],
) -> Result<(Vec<u64>, usize)> {
    let (bytes, at) = gather_size(pieces, shifts)?;
    let mut out = Vec::with_capacity(bytes / 8);
    // Flattened fixed-size arrays: an exact length, so no capacity check per word.
    out.extend(pieces.iter().flat_map(|p| [p.src, p.dst, p.len]));
    out.extend(shifts.iter().flat_map(|h| [h.src, h.dst]));
    Ok((out, at))
}

/// The layout of default staging memory: page aligned, at least one byte.
fn staging_layout(bytes: usize) -> Result<std::alloc::Layout> {
    std::alloc::Layout::from_size_align(bytes.max(1), 4096).map_err(|_| {
        crate::error::Error::SizeOverflow {
            what: "staging buffer",
            detail: format!("{bytes} bytes aligned to 4096"),
        }
    })
}

/// The embedded default: CUDA device 0 when a CUDA driver and a VMM-capable GPU are present,
/// host memory otherwise. When CUDA was not chosen, the reason comes back beside the backend.
pub fn default_backend() -> Result<(Arc<dyn Backend>, Option<String>)> {
    match cuda::CudaBackend::new(0) {
        Ok(b) => Ok((Arc::new(b), None)),
        Err(e) => Ok((
            Arc::new(host::HostBackend::new(host::DEFAULT_GRANULARITY)?),
            Some(e.to_string()),
        )),
    }
}

#[cfg(test)]
mod gather_tests {
    use super::*;

    #[test]
    fn gather_descriptors_pack_as_the_kernel_reads_them() {
        let pieces = [
            GatherPiece {
                src: 1,
                dst: 2,
                len: 3,
            },
            GatherPiece {
                src: 4,
                dst: 5,
                len: 6,
            },
        ];
        let shifts = [GatherShift {
            src: u64::MAX,
            dst: 1 << 40,
        }];
        let (words, at) = pack_gather(&pieces, &shifts).unwrap();
        assert_eq!(words, vec![1, 2, 3, 4, 5, 6, u64::MAX, 1 << 40]);
        assert_eq!(at, 6);
        // The kernel's structs are these words: 24 and 16 bytes, 8-byte aligned.
        assert_eq!(std::mem::size_of::<GatherPiece>(), 24);
        assert_eq!(std::mem::size_of::<GatherShift>(), 16);
        let (words, at) = pack_gather(&[], &shifts).unwrap();
        assert_eq!((words.len(), at), (2, 0));
        // Written into a byte buffer (the pinned staging of the CUDA backend): the same words.
        let (bytes, at) = gather_size(&pieces, &shifts).unwrap();
        assert_eq!((bytes, at), (64, 6));
        let mut out = vec![0xAAu8; bytes + 8];
        write_gather(&pieces, &shifts, &mut out);
        let words: Vec<u64> = out
            .chunks_exact(8)
            .map(|w| u64::from_le_bytes(w.try_into().unwrap()))
            .collect();
        assert_eq!(
            words,
            vec![1, 2, 3, 4, 5, 6, u64::MAX, 1 << 40, 0xAAAA_AAAA_AAAA_AAAA]
        );
    }
}

#[cfg(test)]
mod create_tests {
    use std::sync::Arc;

    use super::*;
    use crate::backend::counting::Counting;
    use crate::backend::testing::FaultInjector;

    /// A batch spread over threads makes every chunk once (distinct handles); a failure on any
    /// thread makes it none: every chunk the other threads made is released again.
    #[test]
    fn a_batch_on_threads_is_all_or_none() {
        let faults = Arc::new(FaultInjector::new(Arc::new(
            host::HostBackend::new(64 << 10).expect("host backend"),
        )));
        let counting = Counting::new(faults.clone());
        let made = create_on_threads(&counting, 64 << 10, 32, 4).expect("batch");
        let mut raw: Vec<u64> = made.iter().map(|c| c.raw).collect();
        raw.sort_unstable();
        raw.dedup();
        assert_eq!(raw.len(), 32, "32 distinct chunks");
        // SAFETY: made just above, mapped nowhere.
        let released = unsafe { counting.release_many(&made) };
        assert!(released.iter().all(|r| r.is_ok()));
        for round in 0..20u64 {
            let before = counting.counts();
            faults.fail_nth(DriverCall::Create, 1 + round % 16);
            let e = create_on_threads(&counting, 64 << 10, 16, 4).expect_err("a create fails");
            assert!(e.to_string().contains("FAULT_INJECTED"), "{e}");
            let d = counting.counts().since(&before);
            // Counted when made, failed ones too: every success was released again.
            assert_eq!(
                d.get(DriverCall::Release),
                d.get(DriverCall::Create) - 1,
                "round {round}: {d:?}"
            );
            faults.clear();
        }
        assert_eq!(counting.physical_bytes().unwrap_or(0), 0, "nothing left");
    }
    /// Panics in the `n`-th create (a backend bug, or a panic in the driver's bindings).
    #[derive(Debug, Default)]
    struct PanicNth {
        n: u64,
        seen: std::sync::atomic::AtomicU64,
    }

    impl crate::backend::intercept::Hook for PanicNth {
        type Pass = ();
        fn before(&self, call: &crate::backend::intercept::Call, _: &BackendInfo) -> Result<()> {
            if call.kind() == Some(DriverCall::Create)
                && self.seen.fetch_add(1, std::sync::atomic::Ordering::SeqCst) + 1 == self.n
            {
                panic!("injected panic in create {}", self.n);
            }
            Ok(())
        }
    }

    /// A thread that panics mid-batch is an error like a failed create, and the chunks it made
    /// before are released with everyone else's (they were leaked with its unwound stack).
    #[test]
    fn a_thread_panicking_mid_batch_leaks_nothing() {
        let host: Arc<dyn Backend> =
            Arc::new(host::HostBackend::new(64 << 10).expect("host backend"));
        // 16 chunks on 4 threads, 4 each: the 16th create is some thread's 4th, 3 made before.
        let b = crate::backend::intercept::Intercept::with_hook(
            host.clone(),
            PanicNth {
                n: 16,
                ..PanicNth::default()
            },
        );
        let e = create_on_threads(&b, 64 << 10, 16, 4).expect_err("a thread panicked");
        assert!(
            e.to_string()
                .contains("a thread creating 4 of a batch of 16 chunks of 65536 bytes panicked"),
            "{e}"
        );
        assert_eq!(
            host.physical_bytes().expect("physical"),
            0,
            "chunks made by the panicking thread were leaked"
        );
    }
}
