//! CUDA virtual memory management through the driver API (`cudarc::driver::sys`).
//!
//! `libcuda` is loaded at run time: on a machine without it, [`CudaBackend::new`] returns
//! [`Error::BackendUnavailable`] before any driver symbol is touched, and the rest of the crate
//! works. Every call binds the device's primary context to the calling thread first (a no-op when
//! it is already current), so pools can be used from any thread, and makes the caller's context
//! current again before it returns.

use std::collections::HashSet;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicU64, Ordering};

use parking_lot::Mutex;

use cudarc::driver::result::{self, DriverError};
use cudarc::driver::sys;

use super::cuda_staging::DescriptorStaging;
pub use super::cuda_staging::GatherUploads;
use super::{
    gather_size, pack_gather, write_gather, Backend, BackendInfo, Copies, GatherPiece, GatherShift,
    MemoryInfo, MemoryKind, PhysicalChunk,
};
use crate::error::{Error, Result};

const NAME: &str = "cuda";

/// The backend's context is current on this thread while this lives (see
/// [`CudaBackend::bind`]); not `Send` (a raw pointer): it belongs to the thread that bound.
#[must_use = "the backend's context stays current only while the guard lives"]
struct Bound {
    /// What was current before, to make current again (null: nothing was); `None` when the
    /// backend's context was current already.
    prev: Option<sys::CUcontext>,
}

impl Drop for Bound {
    fn drop(&mut self) {
        if let Some(prev) = self.prev {
            // SAFETY: `prev` was current on this thread when the guard was made (or null, which
            // makes no context current); the caller's context is alive while it is current.
            if let Err(e) = unsafe { result::ctx::set_current(prev) } {
                tracing::warn!(error = ?e.0, "cuCtxSetCurrent restoring the caller's context failed");
            }
        }
    }
}

/// CUDA VMM on one device. See the module documentation.
#[derive(Debug)]
pub struct CudaBackend {
    info: BackendInfo,
    device: sys::CUdevice,
    ctx: sys::CUcontext,
    prop: Prop,
    physical: AtomicU64,
    /// Handles imported from other processes (not counted in `physical`). Bookkeeping only:
    /// never held across a driver call.
    imported: Mutex<HashSet<u64>>,
    /// The gather kernel in this backend's context, loaded on first use (or why it cannot be).
    gather: std::sync::OnceLock<std::result::Result<GatherKernel, String>>,
    /// Chunks are host memory (`CU_MEM_LOCATION_TYPE_HOST_NUMA`) that the device and the host
    /// both access: a host tier ([`CudaBackend::host_tier`]).
    host_location: bool,
    /// The host NUMA node a host tier's chunks live on (`None`: the driver names none, or
    /// device memory): whose memory [`Backend::memory_info`] reports.
    host_node: Option<u32>,
    /// Threads a batch of new chunks is created on ([`CudaBackend::create_threads`]).
    create_threads: usize,
    /// New device chunks are taken as zeros ([`Backend::creates_zeroed`]); see
    /// [`CudaBackend::clear_new_chunks`].
    new_chunks_zeroed: bool,
}

/// Set to `1` (`true`, `yes`, `on`), the pool clears every new CUDA chunk before anyone sees
/// it, as [`CudaBackend::clear_new_chunks`]`(true)` does; any value other than those and
/// `0`/`false`/`no`/`off` clears too, with a warning (the safe side of a misspelling).
pub const CLEAR_NEW_CHUNKS_ENV: &str = "EVMM_CLEAR_NEW_CHUNKS";

/// Whether [`CLEAR_NEW_CHUNKS_ENV`] asks for new chunks to be cleared.
fn clear_new_chunks_from_env() -> bool {
    let Ok(v) = std::env::var(CLEAR_NEW_CHUNKS_ENV) else {
        return false;
    };
    match v.trim().to_ascii_lowercase().as_str() {
        "1" | "true" | "yes" | "on" => true,
        "" | "0" | "false" | "no" | "off" => false,
        _ => {
            tracing::warn!(value = %v, "{CLEAR_NEW_CHUNKS_ENV} is not one of 1/true/yes/on or 0/false/no/off: new chunks are cleared");
            true
        }
    }
}

/// Threads a host tier creates a batch of chunks on, at most: `cuMemCreate` of host memory pins
/// its pages as it creates them (about 178 ms per GiB on one H100 host thread).
const HOST_CREATE_THREADS: usize = 8;
/// Bytes per thread below which a batch is not worth spreading over threads.
const CREATE_BYTES_PER_THREAD: usize = 64 << 20;

/// The gather kernel's PTX (`src/backend/kernels/gather.cu`, compiled by `scripts/gen-ptx.sh`
/// for `compute_80`; the driver JIT-compiles it for the device), nul-terminated for
/// `cuModuleLoadData`.
const GATHER_PTX: &str = concat!(include_str!("kernels/gather.ptx"), "\0");
/// Threads per block of the gather kernel (its `__launch_bounds__`).
const GATHER_THREADS: u32 = 256;
/// Blocks per multiprocessor the kernel's launch bounds guarantee: the grid is one wave.
const GATHER_BLOCKS_PER_SM: u32 = 4;
/// Descriptor memory the kernel's memory pool keeps across synchronizations.
const GATHER_POOL_KEEP: u64 = 64 << 20;

/// The loaded gather kernel and where its descriptors go: reused pinned and device buffers
/// (`staging`), or, when none is free, the stream-ordered memory pool.
#[derive(Debug)]
struct GatherKernel {
    module: sys::CUmodule,
    function: sys::CUfunction,
    staging: DescriptorStaging,
    pool: sys::CUmemoryPool,
    /// Most blocks in one launch (one resident wave).
    max_grid: u32,
}

/// `CUmemAllocationProp` holds a (null) raw pointer; it is plain data we never share mutably.
#[derive(Debug, Clone, Copy)]
struct Prop(sys::CUmemAllocationProp);

// SAFETY: the raw pointer inside (`win32HandleMetaData`) is always null and never dereferenced;
// the context handle is a process-wide driver object usable from any thread.
unsafe impl Send for CudaBackend {}
// SAFETY: as above; all mutation goes through the driver or an atomic.
unsafe impl Sync for CudaBackend {}

/// One `cuPointerGetAttribute` of `addr` for a 4-byte attribute (memory type, device ordinal,
/// GPUDirect RDMA capability: every one asked here), in the context current on this thread.
fn pointer_attribute(
    addr: u64,
    attr: sys::CUpointer_attribute,
) -> std::result::Result<u32, DriverError> {
    let mut v: u32 = 0;
    // SAFETY: `v` is valid for the attribute's 4 bytes; any address may be asked about.
    unsafe { sys::cuPointerGetAttribute((&mut v as *mut u32).cast(), attr, addr) }
        .result()
        .map(|()| v)
}

/// `cuMemGetAllocationGranularity` of `prop` for `flag`.
fn granularity_of(
    prop: &sys::CUmemAllocationProp,
    flag: sys::CUmemAllocationGranularity_flags,
) -> Result<usize> {
    let mut g = 0usize;
    // SAFETY: `g` and the prop are valid for the call's duration.
    unsafe { sys::cuMemGetAllocationGranularity(&mut g, prop, flag) }
        .result()
        .map_err(driver_error(
            "cuMemGetAllocationGranularity",
            format!("{flag:?}"),
        ))?;
    Ok(g)
}

fn driver_error(
    call: &'static str,
    detail: impl Into<String>,
) -> impl FnOnce(DriverError) -> Error {
    let detail = detail.into();
    move |e| Error::backend(NAME, call, format!("{:?}", e.0), detail)
}

fn unavailable(reason: impl Into<String>) -> Error {
    Error::BackendUnavailable {
        backend: NAME,
        reason: reason.into(),
    }
}

/// Whether a CUDA driver library can be loaded, checked with `dlopen` so that cudarc's loader
/// (which panics when the library is missing) is never reached without one.
fn driver_library_present() -> bool {
    for name in [c"libcuda.so.1", c"libcuda.so"] {
        // SAFETY: `name` is a valid C string; a successful handle is kept open on purpose, as
        // cudarc will open the same library next.
        let handle = unsafe { libc::dlopen(name.as_ptr(), libc::RTLD_NOW | libc::RTLD_GLOBAL) };
        if !handle.is_null() {
            return true;
        }
    }
    false
}

/// The host memory a host tier's chunks come from: NUMA node `node`'s, or the machine's.
fn host_memory(node: Option<u32>) -> Result<MemoryInfo> {
    match node {
        Some(n) => super::meminfo::node(NAME, n),
        None => super::meminfo::machine(NAME),
    }
}

/// A driver UUID as bytes (`c_char` is signed on some targets).
fn uuid_bytes(uuid: &sys::CUuuid) -> [u8; 16] {
    uuid.bytes.map(|b| b as u8)
}

impl CudaBackend {
    /// CUDA VMM on device `ordinal` at the driver's recommended granularity.
    pub fn new(ordinal: i32) -> Result<Self> {
        Self::with_granularity(ordinal, None)
    }

    /// CUDA VMM on device `ordinal`; `granularity` must be a multiple of the driver's minimum
    /// (`None`: the recommended granularity).
    pub fn with_granularity(ordinal: i32, granularity: Option<usize>) -> Result<Self> {
        Self::build(ordinal, granularity, false)
    }

    /// VMM host memory for device `ordinal`: chunks created with `cuMemCreate` at the device's
    /// host NUMA node (`CU_MEM_LOCATION_TYPE_HOST_NUMA`, id `CU_DEVICE_ATTRIBUTE_HOST_NUMA_ID`;
    /// `CU_MEM_LOCATION_TYPE_HOST` where the driver names no node), mapped into reserved ranges
    /// and accessible to the device and to the host. A [`crate::Pool`] over it is an elastic
    /// host tier: page-locked, copied at link speed, created about 2.3x faster than
    /// `cuMemHostAlloc` (see the H100 facts). Its [`BackendInfo`] says host memory with the
    /// device's ordinal; its `total_memory` and [`Backend::memory_info`] are the host memory of
    /// its NUMA node (`/sys/devices/system/node/node<N>/meminfo`: `MemTotal`, `MemFree`), or
    /// the machine's (`/proc/meminfo`: `MemTotal`, `MemAvailable`) where there is no node. Refused ([`Error::BackendUnavailable`]) where the device does not
    /// support host VMM (`CU_DEVICE_ATTRIBUTE_HOST_NUMA_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED`).
    pub fn host_tier(ordinal: i32) -> Result<Self> {
        Self::build(ordinal, None, true)
    }

    /// Create a batch of new chunks ([`Backend::create_many`]: a pool's growth, a host tier's
    /// [`crate::Pool::prefill`]) on up to `threads` threads (at least 1). A host tier starts
    /// with as many as the machine has cores, at most 8 (host memory is pinned as it is
    /// created, which is slow per byte); device memory with 1.
    pub fn create_threads(mut self, threads: usize) -> Self {
        self.create_threads = threads.max(1);
        self
    }

    /// Clear every new chunk before anyone sees it (`true`), or take new device chunks as zeros
    /// (`false`, the default for device memory unless [`CLEAR_NEW_CHUNKS_ENV`] is set).
    ///
    /// CUDA does not promise that `cuMemCreate` hands out zeroed memory, but the driver does
    /// not give one process's bytes to another, and on the H100 (driver 580.159.04,
    /// `scripts/probe-fresh-chunks.py`, `docs/results/h100-fresh-chunks.txt`) new chunks read
    /// as zero even right after this process released the same amount written with a pattern
    /// (4 GiB in 2 MiB chunks, 8 GiB handles). Clearing them cost 2.7 ms per 8 GiB on top of a
    /// 0.5 ms growth, and a synchronous clear is refused inside a CUDA graph capture. Memory
    /// that changes hands inside the crate (another model's cached chunks taken by a growth,
    /// chunks handed over through a broker, a wake's dropped slots) is cleared whatever this
    /// says. A host tier always clears (its pages come from the driver's host allocations,
    /// which were not probed).
    pub fn clear_new_chunks(mut self, clear: bool) -> Self {
        self.new_chunks_zeroed = !clear && !self.host_location;
        self
    }

    fn build(ordinal: i32, granularity: Option<usize>, host: bool) -> Result<Self> {
        if !driver_library_present() {
            return Err(unavailable(
                "libcuda.so.1 not found (no NVIDIA driver on this machine)",
            ));
        }
        result::init().map_err(|e| unavailable(format!("cuInit failed with {:?}", e.0)))?;
        let count = result::device::get_count().map_err(driver_error("cuDeviceGetCount", ""))?;
        if ordinal < 0 || ordinal >= count {
            return Err(unavailable(format!(
                "device ordinal {ordinal} requested, {count} CUDA device(s) present"
            )));
        }
        let device = result::device::get(ordinal)
            .map_err(driver_error("cuDeviceGet", ordinal.to_string()))?;
        let attr = |a: sys::CUdevice_attribute| -> Result<i32> {
            // SAFETY: `device` is a valid device handle from cuDeviceGet.
            unsafe { result::device::get_attribute(device, a) }
                .map_err(driver_error("cuDeviceGetAttribute", format!("{a:?}")))
        };
        let vmm =
            attr(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED)?
                != 0;
        if !vmm {
            return Err(unavailable(format!(
                "device {ordinal} does not support virtual memory management"
            )));
        }
        let rdma = attr(
            sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED,
        )? != 0;
        let posix_fd = attr(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED)? != 0;
        let name = result::device::get_name(device).map_err(driver_error("cuDeviceGetName", ""))?;
        let uuid = result::device::get_uuid(device)
            .map_err(driver_error("cuDeviceGetUuid", ordinal.to_string()))?;
        // SAFETY: `device` is valid.
        let total = unsafe { result::device::total_mem(device) }
            .map_err(driver_error("cuDeviceTotalMem", ""))?;
        // SAFETY: `device` is valid; the retained primary context is released in Drop.
        let ctx = unsafe { result::primary_ctx::retain(device) }
            .map_err(driver_error("cuDevicePrimaryCtxRetain", ""))?;

        // SAFETY: CUmemAllocationProp is plain data; all-zero is its documented default.
        let mut prop: sys::CUmemAllocationProp = unsafe { std::mem::zeroed() };
        prop.type_ = sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
        prop.location.type_ = sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE;
        prop.location.id = ordinal;
        let mut device_name = name.clone();
        let mut host_node = None;
        let rdma = rdma && !host;
        if host {
            let supported = attr(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_HOST_NUMA_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED)? != 0;
            if !supported {
                // SAFETY: retained above, released once.
                let _ = unsafe { result::primary_ctx::release(device) };
                return Err(unavailable(format!(
                    "device {ordinal} does not support host VMM (HOST_NUMA_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED = 0)"
                )));
            }
            let node = attr(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_HOST_NUMA_ID)?;
            if node >= 0 {
                prop.location.type_ = sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_HOST_NUMA;
                prop.location.id = node;
                host_node = u32::try_from(node).ok();
                device_name = format!("host memory (VMM, HOST_NUMA node {node}) of {name}");
            } else {
                prop.location.type_ = sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_HOST;
                prop.location.id = 0;
                device_name = format!("host memory (VMM, HOST) of {name}");
            }
        }
        if posix_fd {
            prop.requestedHandleTypes =
                sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
        }
        prop.allocFlags.gpuDirectRDMACapable = u8::from(rdma);

        let mut backend = CudaBackend {
            info: BackendInfo {
                name: NAME,
                memory_kind: if host {
                    MemoryKind::Host
                } else {
                    MemoryKind::Device
                },
                device_ordinal: Some(ordinal),
                device_uuid: Some(uuid_bytes(&uuid)),
                device_name,
                granularity: 0,
                min_granularity: 0,
                vmm_supported: true,
                rdma_capable: rdma,
                posix_fd_exportable: posix_fd,
                fabric_exportable: false,
                total_memory: total as u64,
                page_locked: host,
            },
            device,
            ctx,
            prop: Prop(prop),
            physical: AtomicU64::new(0),
            imported: Mutex::new(HashSet::new()),
            gather: std::sync::OnceLock::new(),
            host_location: host,
            host_node,
            create_threads: if host {
                std::thread::available_parallelism()
                    .map_or(1, |n| n.get())
                    .min(HOST_CREATE_THREADS)
            } else {
                1
            },
            new_chunks_zeroed: !host && !clear_new_chunks_from_env(),
        };
        let _bound = backend.bind()?;
        let query = |flag| granularity_of(&backend.prop.0, flag);
        let min = query(sys::CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_MINIMUM)?;
        let recommended =
            query(sys::CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_RECOMMENDED)?;
        let granularity = granularity.unwrap_or(recommended);
        if granularity == 0 || granularity % min != 0 || !granularity.is_power_of_two() {
            return Err(Error::InvalidArgument(format!(
                "cuda granularity {granularity} must be a power of two and a multiple of the device minimum {min}"
            )));
        }
        backend.info.granularity = granularity;
        backend.info.min_granularity = min;
        if host {
            // A host tier's memory is the host's (its node's), not the device's.
            backend.info.total_memory = host_memory(host_node)?.total;
        } else {
            backend.probe_chunk_flags();
        }
        let (rdma, fabric) = (backend.info.rdma_capable, backend.info.fabric_exportable);
        tracing::debug!(
            ordinal,
            granularity,
            rdma,
            posix_fd,
            fabric,
            "cuda backend ready"
        );
        Ok(backend)
    }

    /// The device handle.
    pub fn device(&self) -> sys::CUdevice {
        self.device
    }

    /// How the gather kernel's launches uploaded their descriptors so far (all zero before the
    /// kernel's first use, or where it could not be loaded).
    pub fn gather_uploads(&self) -> GatherUploads {
        match self.gather.get() {
            Some(Ok(k)) => k.staging.uploads(),
            _ => GatherUploads::default(),
        }
    }

    /// Wait for the legacy stream, on which the synchronous copy and memset calls run.
    fn wait_legacy(&self, after: &'static str) -> Result<()> {
        // SAFETY: the null handle is the legacy stream of the current (our) context.
        unsafe { result::stream::synchronize(std::ptr::null_mut()) }.map_err(driver_error(
            "cuStreamSynchronize",
            format!("after {after}"),
        ))
    }

    /// What a device chunk really gets, found on one probe chunk of the minimum granularity
    /// (every chunk is created with the same properties): a fabric handle type is asked for
    /// where the device says it supports one and `cuMemCreate` accepts it (multi-node NVLink,
    /// and UCX's `cuda_ipc` for VMM memory, export through it; it needs an IMEX channel, so most
    /// machines refuse it), and the GPUDirect RDMA flag counts only where the mapped chunk's
    /// pointer attribute says so. A probe that cannot run (a full device) changes nothing and is
    /// logged: chunks then get no fabric handle type, and the RDMA flag stands as the device
    /// attribute has it. The probe chunk is made and released with raw driver calls, outside
    /// the backend's byte count.
    fn probe_chunk_flags(&mut self) {
        let size = self.info.min_granularity;
        let plain = self.prop.0.requestedHandleTypes;
        let fabric = sys::CUmemAllocationHandleType(
            plain.0 | sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_FABRIC.0,
        );
        let Ok(_bound) = self.bind() else {
            return;
        };
        let create = |prop: &sys::CUmemAllocationProp| {
            let mut handle: sys::CUmemGenericAllocationHandle = 0;
            // SAFETY: `handle` is valid for writing and the prop outlives the call.
            unsafe { sys::cuMemCreate(&mut handle, size, prop, 0) }
                .result()
                .map(|()| handle)
        };
        // SAFETY: `device` is a valid device handle.
        let supported = unsafe {
            result::device::get_attribute(
                self.device,
                sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED,
            )
        }
        .is_ok_and(|v| v != 0);
        let mut handle = None;
        if supported {
            let mut prop = self.prop.0;
            prop.requestedHandleTypes = fabric;
            match create(&prop) {
                Ok(h) => {
                    self.prop.0 = prop;
                    self.info.fabric_exportable = true;
                    handle = Some(h);
                }
                Err(e) if e.0 == sys::cudaError_enum::CUDA_ERROR_OUT_OF_MEMORY => {
                    tracing::warn!("no memory for a probe chunk: fabric handles not tried, GPUDirect RDMA not verified");
                    return;
                }
                Err(e) => {
                    tracing::info!(error = ?e, "cuMemCreate with a fabric handle type refused (an IMEX channel is needed): chunks without one")
                }
            }
        }
        let handle = match handle.map_or_else(|| create(&self.prop.0), Ok) {
            Ok(h) => h,
            Err(e) => {
                tracing::warn!(error = ?e, "no probe chunk: GPUDirect RDMA not verified");
                return;
            }
        };
        match self.rdma_attribute_of(PhysicalChunk { raw: handle, size }) {
            Ok(capable) => self.info.rdma_capable &= capable,
            Err(e) => {
                tracing::warn!(error = %e, "GPUDirect RDMA attribute of a probe chunk unreadable: not claimed");
                self.info.rdma_capable = false;
            }
        }
        // SAFETY: the probe chunk is ours and unmapped again (rdma_attribute_of unmapped it).
        if let Err(e) = unsafe { sys::cuMemRelease(handle) }.result() {
            tracing::warn!(error = ?e, "the probe chunk could not be released");
        }
        if self.info.fabric_exportable {
            // Granularity may depend on the handle types asked for.
            let min = granularity_of(
                &self.prop.0,
                sys::CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_MINIMUM,
            );
            if !min
                .as_ref()
                .is_ok_and(|&m| m > 0 && self.info.granularity % m == 0)
            {
                tracing::info!(
                    ?min,
                    granularity = self.info.granularity,
                    "fabric handles need another granularity: chunks without one"
                );
                self.prop.0.requestedHandleTypes = plain;
                self.info.fabric_exportable = false;
            }
        }
    }

    /// Map `chunk` at a reservation of its own, read its GPUDirect RDMA pointer attribute, and
    /// take the mapping and the reservation down again (the chunk stays the caller's).
    fn rdma_attribute_of(&self, chunk: PhysicalChunk) -> Result<bool> {
        let size = chunk.size;
        let base = self.reserve(size, size)?;
        // SAFETY: `base..base + size` is our fresh reservation, `chunk` ours and unmapped.
        let mapped = unsafe { self.map(base, chunk) };
        let was_mapped = mapped.is_ok();
        let attr = mapped.and_then(|()| {
            // SAFETY: mapped just now, over the whole reservation.
            unsafe { self.set_access(base, size) }?;
            let _bound = self.bind()?;
            let capable = pointer_attribute(
                base,
                sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_IS_GPU_DIRECT_RDMA_CAPABLE,
            )
            .map_err(driver_error(
                "cuPointerGetAttribute",
                "IS_GPU_DIRECT_RDMA_CAPABLE",
            ))?;
            Ok(capable != 0)
        });
        if was_mapped {
            // SAFETY: mapped above, by us, over the whole reservation.
            if let Err(e) = unsafe { self.unmap(base, size) } {
                tracing::warn!(error = %e, "the probe mapping could not be unmapped");
                return attr;
            }
        }
        // SAFETY: nothing is mapped in the reservation any more.
        if let Err(e) = unsafe { self.free_reservation(base, size) } {
            tracing::warn!(error = %e, "the probe reservation could not be freed");
        }
        attr
    }

    /// Make the device's primary context current on this thread until the guard returned is
    /// dropped, which makes the caller's context (or none) current again: a caller's current
    /// context is the same after our calls (routing's hooks included) as before them.
    fn bind(&self) -> Result<Bound> {
        let current = result::ctx::get_current().map_err(driver_error("cuCtxGetCurrent", ""))?;
        if current == Some(self.ctx) {
            return Ok(Bound { prev: None });
        }
        // SAFETY: `ctx` is the primary context we retained and still hold.
        unsafe { result::ctx::set_current(self.ctx) }
            .map_err(driver_error("cuCtxSetCurrent", ""))?;
        Ok(Bound {
            prev: Some(current.unwrap_or(std::ptr::null_mut())),
        })
    }

    /// Grant `mode` access over a range of our mapped chunks to our device and, with
    /// `owner`, to that other device too (the GPU imported chunks live on).
    ///
    /// # Safety
    /// As for [`Backend::set_access`].
    unsafe fn set_access_for(
        &self,
        addr: u64,
        size: usize,
        mode: super::AccessMode,
        owner: Option<i32>,
    ) -> Result<()> {
        let _bound = self.bind()?;
        let mut ours = self.access_desc();
        if mode == super::AccessMode::ReadOnly {
            ours.flags = sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READ;
        }
        let mut theirs = ours;
        theirs.location.id = owner.unwrap_or_default();
        if self.host_location {
            // A host tier's chunks: the host reaches them too.
            theirs.location.type_ = sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_HOST;
            theirs.location.id = 0;
        }
        let descs = [ours, theirs];
        let n = if owner.is_some() || self.host_location {
            2
        } else {
            1
        };
        // SAFETY: the caller guarantees the range is made of our mapped chunks; `descs`
        // outlives the call and holds `n` descriptors. For a chunk of another device
        // (imported), this grants our device peer access to it; the owner gets access too
        // where named: the kernel reads on ours, and a `cuMemcpy` between the two devices may
        // run on the owner's copy engines.
        unsafe { sys::cuMemSetAccess(addr, size, descs.as_ptr(), n) }
            .result()
            .map_err(driver_error(
                "cuMemSetAccess",
                match owner {
                    None => format!("{size} bytes at {addr:#x} ({mode:?})"),
                    Some(o) => format!(
                        "{size} bytes at {addr:#x} ({mode:?}) for devices {:?} and {o}",
                        self.info.device_ordinal
                    ),
                },
            ))
    }

    fn access_desc(&self) -> sys::CUmemAccessDesc {
        // SAFETY: plain data; all-zero is a valid starting value.
        let mut desc: sys::CUmemAccessDesc = unsafe { std::mem::zeroed() };
        desc.location.type_ = sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE;
        desc.location.id = self.info.device_ordinal.unwrap_or(0);
        desc.flags = sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
        desc
    }
}

impl CudaBackend {
    /// The gather kernel, loaded into this backend's context on first use. A failed load is
    /// kept (logged once as a warning): copies then use `cuMemcpyAsync`, or fail where the
    /// kernel was asked for by name.
    fn gather_kernel(&self) -> Result<&GatherKernel> {
        self.gather
            .get_or_init(|| {
                let r = self.load_gather();
                if let Err(why) = &r {
                    tracing::warn!(device = ?self.info.device_ordinal, %why, "gather kernel not loaded; p2p copies fall back to cuMemcpyAsync");
                }
                r
            })
            .as_ref()
            .map_err(|why| Error::backend(NAME, "gather_async", "UNSUPPORTED", why.clone()))
    }

    fn load_gather(&self) -> std::result::Result<GatherKernel, String> {
        let _bound = self.bind().map_err(|e| e.to_string())?;
        let attr = |a: sys::CUdevice_attribute| {
            // SAFETY: `device` is a valid device handle.
            unsafe { result::device::get_attribute(self.device, a) }
                .map_err(|e| format!("cuDeviceGetAttribute({a:?}) failed with {:?}", e.0))
        };
        if attr(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MEMORY_POOLS_SUPPORTED)? == 0 {
            return Err("the device has no stream-ordered memory pools".into());
        }
        let sms = attr(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)?;
        let sms = u32::try_from(sms).unwrap_or(1).max(1);
        let mut module: sys::CUmodule = std::ptr::null_mut();
        // SAFETY: `GATHER_PTX` is nul-terminated PTX text living for the program; `module` is
        // valid for writing. The context current on this thread is ours (bound above).
        unsafe { sys::cuModuleLoadData(&mut module, GATHER_PTX.as_ptr().cast()) }
            .result()
            .map_err(|e| {
                format!(
                    "cuModuleLoadData of the gather kernel failed with {:?}",
                    e.0
                )
            })?;
        let unload = |module: sys::CUmodule| {
            // SAFETY: loaded above, unloaded once, nothing of it launched.
            let _ = unsafe { sys::cuModuleUnload(module) };
        };
        let mut function: sys::CUfunction = std::ptr::null_mut();
        // SAFETY: `module` is loaded; the name is nul-terminated.
        if let Err(e) =
            unsafe { sys::cuModuleGetFunction(&mut function, module, c"evmm_gather".as_ptr()) }
                .result()
        {
            unload(module);
            return Err(format!(
                "cuModuleGetFunction(evmm_gather) failed with {:?}",
                e.0
            ));
        }
        // Lazy module loading (CUDA's default since 12.2) loads a function at its first launch
        // (a JIT compile of the PTX, milliseconds): an empty launch now, so that no copy an
        // engine waits for pays it. No task: the kernel reads none of its pointers. Not while
        // this thread's stream is being captured (the launch would join the caller's graph).
        let per_thread = raw_stream(super::PER_THREAD_STREAM);
        let capturing =
            super::driver::driver().is_none_or(|d| super::driver::stream_capturing(d, per_thread));
        let (mut p_pieces, mut p_count, mut p_shifts, mut p_tasks) = (0u64, 1u32, 0u64, 0u64);
        let mut params: [*mut std::ffi::c_void; 4] = [
            (&mut p_pieces as *mut u64).cast(),
            (&mut p_count as *mut u32).cast(),
            (&mut p_shifts as *mut u64).cast(),
            (&mut p_tasks as *mut u64).cast(),
        ];
        let r = (!capturing).then(|| {
            // SAFETY: the four parameters point at locals of the kernel's types, read during
            // the call; with no task the kernel dereferences nothing.
            unsafe {
                sys::cuLaunchKernel(
                    function,
                    1,
                    1,
                    1,
                    GATHER_THREADS,
                    1,
                    1,
                    0,
                    per_thread,
                    params.as_mut_ptr(),
                    std::ptr::null_mut(),
                )
            }
            .result()
        });
        if let Some(Err(e)) = r {
            tracing::debug!(error = ?e.0, "empty gather launch failed; the first copy loads the kernel");
        }
        // SAFETY: plain data; all-zero is its documented default.
        let mut props: sys::CUmemPoolProps = unsafe { std::mem::zeroed() };
        props.allocType = sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
        props.handleTypes = sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_NONE;
        props.location.type_ = sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE;
        props.location.id = self.info.device_ordinal.unwrap_or(0);
        let mut pool: sys::CUmemoryPool = std::ptr::null_mut();
        // SAFETY: `pool` is valid for writing, `props` for reading.
        if let Err(e) = unsafe { sys::cuMemPoolCreate(&mut pool, &props) }.result() {
            unload(module);
            return Err(format!("cuMemPoolCreate failed with {:?}", e.0));
        }
        let mut keep = GATHER_POOL_KEEP;
        // SAFETY: the attribute takes a cuuint64_t, which `keep` is; `pool` was just created.
        let r = unsafe {
            sys::cuMemPoolSetAttribute(
                pool,
                sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
                (&mut keep as *mut u64).cast(),
            )
        }
        .result();
        if let Err(e) = r {
            tracing::debug!(error = ?e.0, "gather pool keeps no memory across synchronizations");
        }
        tracing::debug!(sms, "gather kernel loaded");
        Ok(GatherKernel {
            module,
            function,
            staging: DescriptorStaging::default(),
            pool,
            max_grid: sms.saturating_mul(GATHER_BLOCKS_PER_SM),
        })
    }
}

impl CudaBackend {
    /// The pool path of a gather launch's descriptors (no staging slot free): allocate `bytes`
    /// from the kernel's pool on stream `s` and upload them from pageable memory. Returns the
    /// device address, freed by the caller in stream order after the launch.
    fn upload_to_pool(
        &self,
        kernel: &GatherKernel,
        pieces: &[GatherPiece],
        shifts: &[GatherShift],
        bytes: usize,
        s: sys::CUstream,
    ) -> Result<sys::CUdeviceptr> {
        let (words, _) = pack_gather(pieces, shifts)?;
        let mut buf: sys::CUdeviceptr = 0;
        // SAFETY: `buf` is valid for writing; the pool is ours and lives as long as `self`; the
        // caller vouches for the stream.
        unsafe { sys::cuMemAllocFromPoolAsync(&mut buf, bytes, kernel.pool, s) }
            .result()
            .map_err(driver_error(
                "cuMemAllocFromPoolAsync",
                format!(
                    "{bytes} bytes of gather descriptors on stream {:#x}",
                    s as usize
                ),
            ))?;
        // SAFETY: `words` is `bytes` bytes of host memory; from pageable memory the call returns
        // once they are staged (CUDA's documented behaviour), so `words` may go after it; `buf`
        // holds `bytes` bytes in stream order.
        let r = unsafe { sys::cuMemcpyHtoDAsync_v2(buf, words.as_ptr().cast(), bytes, s) }.result();
        if let Err(e) = r {
            // SAFETY: allocated on this stream above, freed once; nothing queued reads it.
            if let Err(f) = unsafe { sys::cuMemFreeAsync(buf, s) }.result() {
                tracing::error!(error = ?f.0, "cuMemFreeAsync of gather descriptors failed; they stay allocated");
            }
            return Err(driver_error(
                "cuMemcpyHtoDAsync",
                format!("{bytes} bytes of gather descriptors"),
            )(e));
        }
        Ok(buf)
    }
}

impl Drop for CudaBackend {
    fn drop(&mut self) {
        if let Some(Ok(mut k)) = self.gather.take() {
            // Every launch ran before the module goes: completions hold the backend, so only a
            // copy whose wait failed could still be queued.
            if let Ok(_bound) = self.bind() {
                // SAFETY: our context is current; waiting has no other effect.
                if let Err(e) = unsafe { sys::cuCtxSynchronize() }.result() {
                    tracing::warn!(error = ?e.0, "cuCtxSynchronize before unloading the gather kernel failed");
                }
                // SAFETY: our context is current and synchronized: no launch reads a slot.
                unsafe { k.staging.destroy() };
                // SAFETY: created by `load_gather`, destroyed once; allocations still
                // outstanding are freed by the driver when their frees ran.
                if let Err(e) = unsafe { sys::cuMemPoolDestroy(k.pool) }.result() {
                    tracing::warn!(error = ?e.0, "cuMemPoolDestroy failed");
                }
                // SAFETY: loaded by `load_gather`, unloaded once, nothing of it runs any more.
                if let Err(e) = unsafe { sys::cuModuleUnload(k.module) }.result() {
                    tracing::warn!(error = ?e.0, "cuModuleUnload failed");
                }
            }
        }
        // SAFETY: we retained the primary context once in `new`.
        if let Err(e) = unsafe { result::primary_ctx::release(self.device) } {
            tracing::warn!(error = ?e.0, "cuDevicePrimaryCtxRelease failed");
        }
    }
}

impl Backend for CudaBackend {
    fn creates_zeroed(&self) -> bool {
        self.new_chunks_zeroed
    }

    fn info(&self) -> &BackendInfo {
        &self.info
    }

    fn reserve(&self, size: usize, alignment: usize) -> Result<u64> {
        let _bound = self.bind()?;
        let mut ptr: sys::CUdeviceptr = 0;
        // SAFETY: `ptr` is valid for writing; a fresh reservation touches no existing memory.
        unsafe { sys::cuMemAddressReserve(&mut ptr, size, alignment, 0, 0) }
            .result()
            .map_err(driver_error(
                "cuMemAddressReserve",
                format!("{size} bytes, alignment {alignment}"),
            ))?;
        Ok(ptr)
    }

    unsafe fn free_reservation(&self, base: u64, size: usize) -> Result<()> {
        let _bound = self.bind()?;
        // SAFETY: the caller guarantees this is one whole unused reservation of ours.
        unsafe { sys::cuMemAddressFree(base, size) }
            .result()
            .map_err(driver_error(
                "cuMemAddressFree",
                format!("{size} bytes at {base:#x}"),
            ))
    }

    fn create(&self, size: usize) -> Result<PhysicalChunk> {
        let _bound = self.bind()?;
        let mut handle: sys::CUmemGenericAllocationHandle = 0;
        // SAFETY: `handle` is valid for writing and the prop outlives the call.
        unsafe { sys::cuMemCreate(&mut handle, size, &self.prop.0, 0) }
            .result()
            .map_err(driver_error(
                "cuMemCreate",
                format!(
                    "{size} bytes on device {}",
                    self.info.device_ordinal.unwrap_or(0)
                ),
            ))?;
        self.physical.fetch_add(size as u64, Ordering::Relaxed);
        Ok(PhysicalChunk { raw: handle, size })
    }

    fn create_many(
        &self,
        size: usize,
        count: usize,
        _need: super::Need,
    ) -> Result<Vec<PhysicalChunk>> {
        let worth = size.saturating_mul(count) / CREATE_BYTES_PER_THREAD;
        super::create_on_threads(self, size, count, self.create_threads.min(worth))
    }

    unsafe fn release(&self, chunk: PhysicalChunk) -> Result<()> {
        let _bound = self.bind()?;
        // SAFETY: the caller guarantees the handle is ours, live and unmapped.
        unsafe { sys::cuMemRelease(chunk.raw) }
            .result()
            .map_err(driver_error(
                "cuMemRelease",
                format!("{} bytes", chunk.size),
            ))?;
        if !self.imported.lock().remove(&chunk.raw) {
            self.physical
                .fetch_sub(chunk.size as u64, Ordering::Relaxed);
        }
        Ok(())
    }

    fn export_chunk(&self, chunk: PhysicalChunk) -> Result<OwnedFd> {
        if !self.info.posix_fd_exportable {
            return Err(Error::backend(
                NAME,
                "cuMemExportToShareableHandle",
                "UNSUPPORTED",
                format!(
                    "device {} does not support POSIX file descriptor handles",
                    self.info.device_ordinal.unwrap_or(0)
                ),
            ));
        }
        let _bound = self.bind()?;
        let mut fd: libc::c_int = -1;
        // SAFETY: `fd` is valid for writing an int, which is what the POSIX-fd handle type
        // writes; the caller's chunk is a live handle of ours (a wrong one is an error).
        unsafe {
            sys::cuMemExportToShareableHandle(
                (&mut fd as *mut libc::c_int).cast(),
                chunk.raw,
                sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
                0,
            )
        }
        .result()
        .map_err(driver_error(
            "cuMemExportToShareableHandle",
            format!("{} bytes", chunk.size),
        ))?;
        if fd < 0 {
            return Err(Error::backend(
                NAME,
                "cuMemExportToShareableHandle",
                "EBADF",
                format!("driver returned descriptor {fd}"),
            ));
        }
        // SAFETY: the driver just created this descriptor for us and owns no reference to it.
        Ok(unsafe { OwnedFd::from_raw_fd(fd) })
    }

    fn import_chunk(&self, fd: OwnedFd, size: usize) -> Result<PhysicalChunk> {
        let g = self.info.granularity;
        if size == 0 || size % g != 0 {
            return Err(Error::Misaligned {
                what: "imported chunk size",
                value: size as u64,
                alignment: g as u64,
            });
        }
        let _bound = self.bind()?;
        let mut handle: sys::CUmemGenericAllocationHandle = 0;
        // SAFETY: `handle` is valid for writing; for the POSIX-fd type the driver reads the
        // descriptor's value from the pointer argument itself and does not take ownership of
        // it (we close it when `fd` drops). A descriptor that is no exported chunk is an error.
        unsafe {
            sys::cuMemImportFromShareableHandle(
                &mut handle,
                std::ptr::without_provenance_mut(fd.as_raw_fd() as usize),
                sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
            )
        }
        .result()
        .map_err(driver_error(
            "cuMemImportFromShareableHandle",
            format!("{size} bytes from descriptor {}", fd.as_raw_fd()),
        ))?;
        drop(fd);
        // The size is checked by the driver when the chunk is mapped: mapping more than the
        // allocation holds fails (CUDA_ERROR_INVALID_VALUE) and maps nothing.
        self.imported.lock().insert(handle);
        Ok(PhysicalChunk { raw: handle, size })
    }

    unsafe fn map(&self, addr: u64, chunk: PhysicalChunk) -> Result<()> {
        let _bound = self.bind()?;
        // SAFETY: the caller guarantees the range is an unmapped part of our reservation.
        unsafe { sys::cuMemMap(addr, chunk.size, 0, chunk.raw, 0) }
            .result()
            .map_err(driver_error(
                "cuMemMap",
                format!("{} bytes at {addr:#x}", chunk.size),
            ))
    }

    unsafe fn set_access(&self, addr: u64, size: usize) -> Result<()> {
        if self.host_location {
            // SAFETY: forwarded contract; device and host access in one call.
            return unsafe { self.set_access_for(addr, size, super::AccessMode::ReadWrite, None) };
        }
        let _bound = self.bind()?;
        let desc = self.access_desc();
        // SAFETY: the caller guarantees the range is made of our mapped chunks.
        unsafe { sys::cuMemSetAccess(addr, size, &desc, 1) }
            .result()
            .map_err(driver_error(
                "cuMemSetAccess",
                format!("{size} bytes at {addr:#x}"),
            ))
    }

    unsafe fn set_access_mode(
        &self,
        addr: u64,
        size: usize,
        mode: super::AccessMode,
    ) -> Result<()> {
        // SAFETY: forwarded contract.
        unsafe { self.set_access_for(addr, size, mode, None) }
    }

    unsafe fn set_import_access(
        &self,
        addr: u64,
        size: usize,
        mode: super::AccessMode,
        owner: Option<i32>,
    ) -> Result<()> {
        let owner = owner.filter(|&o| Some(o) != self.info.device_ordinal);
        // SAFETY: forwarded contract.
        unsafe { self.set_access_for(addr, size, mode, owner) }
    }

    fn pointer_kind(&self, addr: u64) -> Result<Option<(MemoryKind, Option<i32>)>> {
        let _bound = self.bind()?;
        let ty = match pointer_attribute(
            addr,
            sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_MEMORY_TYPE,
        ) {
            Ok(ty) => ty,
            // Memory CUDA does not know: pageable host memory.
            Err(e) if e.0 == sys::cudaError_enum::CUDA_ERROR_INVALID_VALUE => {
                return Ok(Some((MemoryKind::Host, None)))
            }
            Err(e) => {
                return Err(Error::backend(
                    NAME,
                    "cuPointerGetAttribute",
                    format!("{:?}", e.0),
                    format!("MEMORY_TYPE of {addr:#x}"),
                ))
            }
        };
        if ty != sys::CUmemorytype::CU_MEMORYTYPE_DEVICE as u32 {
            return Ok(Some((MemoryKind::Host, None)));
        }
        let ordinal = pointer_attribute(
            addr,
            sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL,
        )
        .map_err(driver_error(
            "cuPointerGetAttribute",
            format!("DEVICE_ORDINAL of {addr:#x}"),
        ))?;
        // The attribute is a C int.
        Ok(Some((MemoryKind::Device, Some(ordinal as i32))))
    }

    fn reach(&self, uuid: &[u8; 16]) -> Result<super::DeviceReach> {
        use super::DeviceReach;
        if self.info.device_uuid.as_ref() == Some(uuid) {
            return Ok(DeviceReach::Same);
        }
        let count = result::device::get_count().map_err(driver_error("cuDeviceGetCount", ""))?;
        for ordinal in 0..count {
            let device = result::device::get(ordinal)
                .map_err(driver_error("cuDeviceGet", ordinal.to_string()))?;
            let theirs = result::device::get_uuid(device)
                .map_err(driver_error("cuDeviceGetUuid", ordinal.to_string()))?;
            if uuid_bytes(&theirs) != *uuid {
                continue;
            }
            let mut can = 0;
            // SAFETY: both are valid device handles; `can` is written by the call.
            unsafe { sys::cuDeviceCanAccessPeer(&mut can, self.device, device) }
                .result()
                .map_err(driver_error(
                    "cuDeviceCanAccessPeer",
                    format!("{:?} to {ordinal}", self.info.device_ordinal),
                ))?;
            return Ok(if can != 0 {
                DeviceReach::Peer { ordinal }
            } else {
                DeviceReach::NoPeerAccess { ordinal }
            });
        }
        Ok(DeviceReach::NotVisible)
    }

    unsafe fn unmap(&self, addr: u64, size: usize) -> Result<()> {
        let _bound = self.bind()?;
        // SAFETY: the caller guarantees the range is made of whole chunks nothing uses.
        unsafe { sys::cuMemUnmap(addr, size) }
            .result()
            .map_err(driver_error(
                "cuMemUnmap",
                format!("{size} bytes at {addr:#x}"),
            ))
    }

    /// Device memory (`cuMemGetInfo`); for a host tier, the host memory of its NUMA node
    /// (`MemFree` of `MemTotal`), or the machine's (`MemAvailable` of `MemTotal`) where the
    /// driver names no node or the kernel has no file for it.
    fn memory_info(&self) -> Result<MemoryInfo> {
        if self.host_location {
            return host_memory(self.host_node);
        }
        let _bound = self.bind()?;
        let (free, total) = result::mem_get_info().map_err(driver_error("cuMemGetInfo", ""))?;
        Ok(MemoryInfo {
            free: free as u64,
            total: total as u64,
        })
    }

    fn physical_bytes(&self) -> Result<u64> {
        Ok(self.physical.load(Ordering::Relaxed))
    }

    fn copies(&self) -> &dyn Copies {
        self
    }
}

impl Copies for CudaBackend {
    unsafe fn write(&self, addr: u64, data: &[u8]) -> Result<()> {
        let _bound = self.bind()?;
        // SAFETY: the caller guarantees the destination is mapped with access.
        unsafe { result::memcpy_htod_sync(addr, data) }.map_err(driver_error(
            "cuMemcpyHtoD",
            format!("{} bytes to {addr:#x}", data.len()),
        ))?;
        // From pageable memory `cuMemcpyHtoD` returns once the bytes are staged, before the DMA
        // has landed: wait, so the caller may unmap (or hand the chunk to another process) as
        // soon as this returns.
        self.wait_legacy("cuMemcpyHtoD")
    }

    unsafe fn read(&self, addr: u64, out: &mut [u8]) -> Result<()> {
        let _bound = self.bind()?;
        let len = out.len();
        // SAFETY: the caller guarantees the source is mapped with access.
        unsafe { result::memcpy_dtoh_sync(out, addr) }.map_err(driver_error(
            "cuMemcpyDtoH",
            format!("{len} bytes from {addr:#x}"),
        ))
    }

    unsafe fn fill(&self, addr: u64, len: usize, byte: u8) -> Result<()> {
        if self.host_location {
            // A host tier's chunks are mapped for the host too (`set_access`), and
            // `cuMemsetD8` refuses them (CUDA_ERROR_INVALID_VALUE on the H100): the CPU writes.
            // SAFETY: the caller guarantees the range is mapped with access and that nothing
            // else uses it meanwhile; the host has read/write access to a host tier's ranges.
            unsafe { std::ptr::write_bytes(addr as *mut u8, byte, len) };
            return Ok(());
        }
        let _bound = self.bind()?;
        // SAFETY: the caller guarantees the range is mapped with access.
        unsafe { result::memset_d8_sync(addr, byte, len) }.map_err(driver_error(
            "cuMemsetD8",
            format!("{len} bytes at {addr:#x}"),
        ))?;
        // `cuMemsetD8` on device memory is asynchronous with respect to the host (it runs on
        // the legacy stream): without this wait a fill followed by an unmap faulted on the H100
        // (the broker's hand-over test), and a chunk handed to another process could still be
        // in the middle of being written.
        self.wait_legacy("cuMemsetD8")
    }

    unsafe fn copy_async(&self, dst: u64, src: u64, bytes: usize, stream: u64) -> Result<()> {
        if bytes == 0 {
            return Ok(());
        }
        let _bound = self.bind()?;
        // SAFETY: the caller guarantees both ranges are mapped with access until the copy ran,
        // that nothing races it, and that `stream` is a stream handle of this context.
        unsafe { result::memcpy_dtod_async(dst, src, bytes, raw_stream(stream)) }.map_err(
            driver_error(
                "cuMemcpyDtoDAsync",
                format!("{bytes} bytes from {src:#x} to {dst:#x} on stream {stream:#x}"),
            ),
        )
    }

    unsafe fn copy_batch_async(&self, copies: &[(u64, u64, usize)], stream: u64) -> Result<()> {
        let one_by_one = |copies: &[(u64, u64, usize)]| -> Result<()> {
            for &(dst, src, bytes) in copies {
                // SAFETY: forwarded contract, copy by copy.
                unsafe { self.copy_async(dst, src, bytes, stream) }?;
            }
            Ok(())
        };
        let copies: Vec<_> = copies.iter().copied().filter(|c| c.2 > 0).collect();
        // The batch call takes no legacy default stream (handles 0 and 1): one by one there.
        if copies.len() < 2 || stream <= 1 || !batch_copies_available() {
            return one_by_one(&copies);
        }
        let _bound = self.bind()?;
        for part in copies.chunks(MAX_BATCH) {
            let mut dsts: Vec<sys::CUdeviceptr> = part.iter().map(|c| c.0).collect();
            let mut srcs: Vec<sys::CUdeviceptr> = part.iter().map(|c| c.1).collect();
            let mut sizes: Vec<usize> = part.iter().map(|c| c.2).collect();
            // SAFETY: plain data; all-zero is a valid starting value.
            let mut attr: sys::CUmemcpyAttributes = unsafe { std::mem::zeroed() };
            attr.srcAccessOrder = sys::CUmemcpySrcAccessOrder::CU_MEMCPY_SRC_ACCESS_ORDER_STREAM;
            let here = self.access_desc().location;
            attr.srcLocHint = here;
            attr.dstLocHint = here;
            let mut index = [0usize];
            // SAFETY: three arrays of `part.len()` entries and one attribute applying from
            // copy 0, valid for the call; the ranges obey the caller's contract.
            let r = unsafe {
                sys::cuMemcpyBatchAsync_v2(
                    dsts.as_mut_ptr(),
                    srcs.as_mut_ptr(),
                    sizes.as_mut_ptr(),
                    part.len(),
                    &mut attr,
                    index.as_mut_ptr(),
                    1,
                    raw_stream(stream),
                )
            }
            .result();
            if let Err(e) = r {
                // Copies of this part may or may not be queued: queue them again one by one
                // (the same bytes again, in stream order), and stop batching.
                BATCH_BROKEN.store(true, Ordering::Relaxed);
                tracing::warn!(error = ?e.0, copies = part.len(), "cuMemcpyBatchAsync failed; copying one by one from now on");
                one_by_one(part)?;
            }
        }
        Ok(())
    }

    fn prepare_gather(&self) -> Result<()> {
        let kernel = self.gather_kernel()?;
        // The first launch's descriptor slot too (pinned host memory, made on first use), once:
        // caches made while the slots are busy make none.
        let _bound = self.bind()?;
        if kernel.staging.uploads().slots == 0 {
            if let Some(slot) = kernel.staging.take(1) {
                kernel.staging.give_back_unused(slot);
            }
        }
        Ok(())
    }

    unsafe fn gather_async(
        &self,
        pieces: &[GatherPiece],
        shifts: &[GatherShift],
        stream: u64,
    ) -> Result<()> {
        if pieces.is_empty() || shifts.is_empty() {
            return Ok(());
        }
        let (bytes, at) = gather_size(pieces, shifts)?;
        let kernel = self.gather_kernel()?;
        let _bound = self.bind()?;
        let s = raw_stream(stream);
        let (buf, slot) = match kernel.staging.take(bytes) {
            Some(mut slot) => {
                write_gather(pieces, shifts, slot.host());
                // SAFETY: the slot's host buffer is pinned and holds the `bytes` written above,
                // its device buffer as many; neither is read by queued work (the slot's last
                // launch completed) nor written until the event recorded after this launch
                // completed.
                let r = unsafe {
                    sys::cuMemcpyHtoDAsync_v2(slot.dev(), slot.host().as_ptr().cast(), bytes, s)
                }
                .result();
                if let Err(e) = r {
                    kernel.staging.give_back_unused(slot);
                    return Err(driver_error(
                        "cuMemcpyHtoDAsync",
                        format!("{bytes} bytes of gather descriptors (pinned)"),
                    )(e));
                }
                (slot.dev(), Some(slot))
            }
            None => (self.upload_to_pool(kernel, pieces, shifts, bytes, s)?, None),
        };
        // After the launch (or its failure): the slot is reusable once what was queued ran;
        // pool memory is freed in stream order.
        let release = |slot: Option<_>, call: &'static str| match slot {
            Some(slot) => kernel.staging.give_back(slot, s),
            None => {
                // SAFETY: `buf` was allocated on this stream by `upload_to_pool` and is freed
                // once, in stream order after everything queued on it that reads it.
                if let Err(e) = unsafe { sys::cuMemFreeAsync(buf, s) }.result() {
                    tracing::error!(error = ?e.0, after = call, "cuMemFreeAsync of gather descriptors failed; they stay allocated");
                }
            }
        };
        let ntasks = pieces.len() as u64 * shifts.len() as u64; // checked by `gather_size`
        let per_block = u64::from(GATHER_THREADS / 32);
        let grid = ntasks
            .div_ceil(per_block)
            .clamp(1, u64::from(kernel.max_grid.max(1))) as u32;
        let mut p_pieces: u64 = buf;
        let mut p_count: u32 = pieces.len() as u32; // checked by `gather_size`
        let mut p_shifts: u64 = buf + (at as u64) * 8;
        let mut p_tasks: u64 = ntasks;
        let mut params: [*mut std::ffi::c_void; 4] = [
            (&mut p_pieces as *mut u64).cast(),
            (&mut p_count as *mut u32).cast(),
            (&mut p_shifts as *mut u64).cast(),
            (&mut p_tasks as *mut u64).cast(),
        ];
        // SAFETY: the kernel's four parameters (pointer, u32, pointer, u64) point at locals of
        // those types, read during the call; the descriptors are in `buf` in stream order
        // before the launch; every copy they describe obeys the caller's contract.
        let r = unsafe {
            sys::cuLaunchKernel(
                kernel.function,
                grid,
                1,
                1,
                GATHER_THREADS,
                1,
                1,
                0,
                s,
                params.as_mut_ptr(),
                std::ptr::null_mut(),
            )
        }
        .result();
        if r.is_ok() {
            kernel.staging.count_launch(slot.is_some());
        }
        release(slot, "cuLaunchKernel");
        r.map_err(driver_error(
            "cuLaunchKernel",
            format!(
                "gather of {} pieces x {} shifts, {grid} blocks, on stream {stream:#x}",
                pieces.len(),
                shifts.len()
            ),
        ))
    }

    fn synchronize(&self, stream: u64) -> Result<()> {
        let _bound = self.bind()?;
        // SAFETY: a stream handle is an opaque driver value; an invalid one is an error.
        unsafe { sys::cuStreamSynchronize(raw_stream(stream)) }
            .result()
            .map_err(driver_error(
                "cuStreamSynchronize",
                format!("stream {stream:#x}"),
            ))
    }

    unsafe fn fill_async(&self, addr: u64, bytes: usize, byte: u8, stream: u64) -> Result<()> {
        if bytes == 0 {
            return Ok(());
        }
        let _bound = self.bind()?;
        // SAFETY: as for `copy_async`, for the one range.
        unsafe { result::memset_d8_async(addr, byte, bytes, raw_stream(stream)) }.map_err(
            driver_error(
                "cuMemsetD8Async",
                format!("{bytes} bytes at {addr:#x} to {byte:#04x} on stream {stream:#x}"),
            ),
        )
    }
    fn staging_alloc(&self, bytes: usize) -> Result<*mut u8> {
        let _bound = self.bind()?;
        // SAFETY: a fresh page-locked allocation touches no existing memory; its contents are
        // unspecified, which is what the contract says. Portable: usable from any context.
        let ptr = unsafe { result::malloc_host(bytes.max(1), sys::CU_MEMHOSTALLOC_PORTABLE) }
            .map_err(driver_error(
                "cuMemHostAlloc",
                format!("{bytes} bytes of page-locked host memory"),
            ))?;
        Ok(ptr.cast())
    }

    unsafe fn staging_free(&self, ptr: *mut u8, bytes: usize) -> Result<()> {
        let _bound = self.bind()?;
        // SAFETY: the caller guarantees `ptr` came from `staging_alloc` and nothing uses it.
        unsafe { result::free_host(ptr.cast()) }.map_err(driver_error(
            "cuMemFreeHost",
            format!("{bytes} bytes at {ptr:p}"),
        ))
    }

    fn copy_stream_create(&self) -> Result<u64> {
        let _bound = self.bind()?;
        let stream = result::stream::create(result::stream::StreamKind::NonBlocking)
            .map_err(driver_error("cuStreamCreate", "non-blocking copy stream"))?;
        Ok(stream as usize as u64)
    }

    unsafe fn copy_stream_destroy(&self, stream: u64) -> Result<()> {
        let _bound = self.bind()?;
        // SAFETY: the caller guarantees the stream is ours and idle.
        unsafe { result::stream::destroy(raw_stream(stream)) }.map_err(driver_error(
            "cuStreamDestroy",
            format!("stream {stream:#x}"),
        ))
    }

    unsafe fn copy_to_host_async(
        &self,
        dst: *mut u8,
        src: u64,
        bytes: usize,
        stream: u64,
    ) -> Result<()> {
        let _bound = self.bind()?;
        // SAFETY: the caller guarantees both ranges stay valid until the copy ran and that
        // `dst` is page-locked staging memory (so the copy is truly asynchronous).
        unsafe { sys::cuMemcpyDtoHAsync_v2(dst.cast(), src, bytes, raw_stream(stream)) }
            .result()
            .map_err(driver_error(
                "cuMemcpyDtoHAsync",
                format!("{bytes} bytes from {src:#x} on stream {stream:#x}"),
            ))
    }

    unsafe fn copy_from_host_async(
        &self,
        dst: u64,
        src: *const u8,
        bytes: usize,
        stream: u64,
    ) -> Result<()> {
        let _bound = self.bind()?;
        // SAFETY: as for `copy_to_host_async`, the other way.
        unsafe { sys::cuMemcpyHtoDAsync_v2(dst, src.cast(), bytes, raw_stream(stream)) }
            .result()
            .map_err(driver_error(
                "cuMemcpyHtoDAsync",
                format!("{bytes} bytes to {dst:#x} on stream {stream:#x}"),
            ))
    }

    unsafe fn marker_record(&self, stream: u64) -> Result<u64> {
        let _bound = self.bind()?;
        let event = result::event::create(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING)
            .map_err(driver_error("cuEventCreate", "copy marker"))?;
        // SAFETY: the event was just created; the caller guarantees the stream is ours.
        if let Err(e) = unsafe { result::event::record(event, raw_stream(stream)) } {
            // SAFETY: the event was never recorded and is ours.
            let _ = unsafe { result::event::destroy(event) };
            return Err(driver_error("cuEventRecord", format!("stream {stream:#x}"))(e));
        }
        Ok(event as usize as u64)
    }

    unsafe fn marker_wait(&self, marker: u64) -> Result<()> {
        let _bound = self.bind()?;
        let event: sys::CUevent = std::ptr::without_provenance_mut(marker as usize);
        // SAFETY: the caller guarantees the marker is a live event of ours, waited for once.
        let waited = unsafe { result::event::synchronize(event) };
        // SAFETY: as above; destroyed once, after the wait.
        let destroyed = unsafe { result::event::destroy(event) };
        waited.map_err(driver_error("cuEventSynchronize", "copy marker"))?;
        destroyed.map_err(driver_error("cuEventDestroy", "copy marker"))
    }

    unsafe fn marker_done(&self, marker: u64) -> Result<bool> {
        let _bound = self.bind()?;
        let event: sys::CUevent = std::ptr::without_provenance_mut(marker as usize);
        // SAFETY: the caller guarantees the marker is a live event of ours.
        match unsafe { sys::cuEventQuery(event) } {
            sys::CUresult::CUDA_SUCCESS => Ok(true),
            sys::CUresult::CUDA_ERROR_NOT_READY => Ok(false),
            e => Err(driver_error("cuEventQuery", "copy marker")(
                cudarc::driver::DriverError(e),
            )),
        }
    }

    unsafe fn stream_wait_marker(&self, stream: u64, marker: u64) -> Result<()> {
        let _bound = self.bind()?;
        let event: sys::CUevent = std::ptr::without_provenance_mut(marker as usize);
        // SAFETY: the caller guarantees a live event of ours and a live stream of this context.
        unsafe { sys::cuStreamWaitEvent(raw_stream(stream), event, 0) }
            .result()
            .map_err(driver_error(
                "cuStreamWaitEvent",
                format!("stream {stream:#x}"),
            ))
    }

    unsafe fn marker_drop(&self, marker: u64) -> Result<()> {
        let _bound = self.bind()?;
        let event: sys::CUevent = std::ptr::without_provenance_mut(marker as usize);
        // SAFETY: the caller guarantees a live event of ours, dropped once; CUDA defers the
        // release until the event's work ran.
        unsafe { result::event::destroy(event) }
            .map_err(driver_error("cuEventDestroy", "copy marker"))
    }
}

/// Most copies in one `cuMemcpyBatchAsync`.
const MAX_BATCH: usize = 4096;

/// Set once a batch copy failed: copies go one by one from then on.
static BATCH_BROKEN: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Whether the driver has `cuMemcpyBatchAsync_v2` (CUDA 13), looked up without the panic a
/// missing symbol would cause in cudarc's loader.
fn batch_copies_available() -> bool {
    static HAVE: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    !BATCH_BROKEN.load(Ordering::Relaxed)
        && *HAVE.get_or_init(|| {
            // The driver library is loaded already (a backend exists): NOLOAD finds it however
            // cudarc loaded or linked it, and the lookup calls nothing.
            // SAFETY: valid nul-terminated strings; the handle is closed once.
            unsafe {
                let lib =
                    libc::dlopen(c"libcuda.so.1".as_ptr(), libc::RTLD_NOW | libc::RTLD_NOLOAD);
                if lib.is_null() {
                    return false;
                }
                let found = !libc::dlsym(lib, c"cuMemcpyBatchAsync_v2".as_ptr()).is_null();
                libc::dlclose(lib);
                found
            }
        })
}

/// A stream handle passed as an integer, as the driver's `CUstream` (a handle, not memory).
fn raw_stream(stream: u64) -> sys::CUstream {
    std::ptr::without_provenance_mut(stream as usize)
}
