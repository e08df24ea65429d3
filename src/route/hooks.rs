//! The bodies of the driver entry points [`crate::route_cuda_allocations!`] defines.
//!
//! Each one decides between the pool of the calling thread's route and the driver's own
//! function (looked up in `libcuda`, never through the linker: see `driver.rs`). They never
//! unwind into the caller: a panic becomes `CUDA_ERROR_UNKNOWN`.

use std::cell::RefCell;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

pub use cudarc::driver::sys::{CUdeviceptr, CUgraph, CUresult, CUstream, CUstreamCaptureMode};

use super::fence::{capture_active, capture_begins, capture_ends, StreamKey};
use super::stack::current_route;
use super::stats::Refusal;
use super::table::{self, Block, Origin};
use super::target::{self, Wait};
use crate::backend::driver::{self, driver};
use crate::error::Error;
use crate::MemOptions;

static INSTALLED: AtomicBool = AtomicBool::new(false);

/// Allocations and frees the hooks passed to the driver (outside any route, or foreign).
pub(crate) static FORWARDED_ALLOCATIONS: AtomicU64 = AtomicU64::new(0);
pub(crate) static FORWARDED_BYTES: AtomicU64 = AtomicU64::new(0);
pub(crate) static FORWARDED_FREES: AtomicU64 = AtomicU64::new(0);

thread_local! {
    pub(crate) static LAST_REFUSAL: RefCell<Option<Refusal>> = const { RefCell::new(None) };
}

/// Called by the macro's constructor when the binary starts.
#[doc(hidden)]
pub fn mark_installed() {
    INSTALLED.store(true, Ordering::Release);
}

pub(crate) fn installed() -> bool {
    INSTALLED.load(Ordering::Acquire)
}

fn guarded(f: impl FnOnce() -> CUresult) -> CUresult {
    catch_unwind(AssertUnwindSafe(f)).unwrap_or(CUresult::CUDA_ERROR_UNKNOWN)
}

const NO_DRIVER: CUresult = CUresult::CUDA_ERROR_NOT_INITIALIZED;

/// Size classes: a block freed on a stream serves any later request of its class there.
/// Up to 4 KiB: multiples of 512 bytes; below 1 MiB: eight classes per power of two (at most
/// 12.5% more than asked, 128 KiB at most); from 1 MiB: 64 per power of two (at most 1.6%, so
/// weights and other large tensors cost hardly more than asked).
pub(crate) fn size_class(bytes: usize) -> Option<usize> {
    if bytes <= 4096 {
        return Some(bytes.max(1).div_ceil(512) * 512);
    }
    let top = usize::BITS - 1 - bytes.leading_zeros();
    let step = if bytes < 1 << 20 {
        1usize << (top - 3)
    } else {
        1usize << (top - 6)
    };
    bytes.div_ceil(step).checked_mul(step)
}

enum Outcome {
    Forward,
    Served(u64),
    Refused,
}

/// The model's use and limit from an admission refusal.
fn limit_of(e: &Error) -> Option<(u64, u64)> {
    match e {
        Error::AdmissionRefused {
            model_used,
            model_limit,
            ..
        } => Some((*model_used, *model_limit)),
        _ => None,
    }
}

fn is_out_of_memory(e: &Error) -> bool {
    matches!(
        e,
        Error::AdmissionRefused { .. }
            | Error::OutOfPhysicalMemory { .. }
            | Error::OutOfAddressSpace { .. }
    )
}

/// How the memory of an allocation may be used.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Use {
    /// Stream-ordered (`cuMemAllocAsync`): a block freed on the same stream may serve it.
    OnStream,
    /// Synchronous (`cuMemAlloc_v2`): usable on any stream at once, so never a cached block.
    Anywhere,
}

fn routed_alloc(bytes: usize, stream: CUstream, usage: Use) -> Outcome {
    if bytes == 0 {
        return Outcome::Forward; // exactly the driver's answer for an empty allocation
    }
    let Some((entry, ctx)) = current_route() else {
        return Outcome::Forward;
    };
    target::reap_pending();
    let t = &entry.target;
    t.note_context(ctx);
    let capturing =
        capture_active() && driver().is_some_and(|d| driver::stream_capturing(d, stream));
    let key = StreamKey::of(stream);
    let refuse = |reason: String, limit: Option<(u64, u64)>| {
        let r = Refusal {
            model: t.name.to_string(),
            tag: entry.tag.tag.clone(),
            asked: bytes as u64,
            routed_live: t.stats().live_bytes(),
            physical: entry.pool.stats().physical(),
            model_used: limit.map(|l| l.0),
            model_limit: limit.map(|l| l.1),
            reason,
        };
        tracing::warn!(refusal = %r, "routing: allocation refused");
        entry.tag.refused();
        t.set_refusal(r.clone());
        let _ = LAST_REFUSAL.try_with(|l| *l.borrow_mut() = Some(r));
        Outcome::Refused
    };
    let Some(class) = size_class(bytes) else {
        return refuse(
            format!("{bytes} bytes cannot be rounded to a size class without overflow"),
            None,
        );
    };
    // Never a cached block during a capture (graph launches are outside stream order) or for
    // a synchronous allocation (usable on any stream at once).
    let cached = if capturing || usage != Use::OnStream {
        None
    } else {
        t.take_cached(key, class)
    };
    let (memory, reused, origin) = match cached {
        Some(m) => (m, true, Origin::Eager),
        None => {
            // Read only on this path: a cache hit costs no counter reads.
            let calls_before = entry.pool.driver_call_total();
            let opts = MemOptions::new().tag(entry.tag.tag.clone());
            // Routed blocks are kept by routing's own front (per stream, fenced), never by
            // a thread's.
            let allocate = || {
                entry.pool.allocate_with(class, &opts).map(|mut m| {
                    m.bypass_thread_fronts();
                    m
                })
            };
            let (m, origin) = if capturing {
                match allocate() {
                    Ok(m) => (m, Origin::Captured),
                    Err(e) => return refuse(e.to_string(), limit_of(&e)),
                }
            } else {
                let m = match allocate() {
                    Ok(m) => m,
                    Err(e) if is_out_of_memory(&e) && !capture_active() => {
                        // Blocks this model keeps for reuse go back to its pool first (waiting
                        // for the GPU to finish with them), then one more try.
                        t.flush(Wait::Yes);
                        match allocate() {
                            Ok(m) => m,
                            Err(e) => return refuse(e.to_string(), limit_of(&e)),
                        }
                    }
                    Err(e) => return refuse(e.to_string(), limit_of(&e)),
                };
                (m, Origin::Eager)
            };
            t.pool_allocations.fetch_add(1, Ordering::Relaxed);
            entry
                .tag
                .drove(entry.pool.driver_call_total().saturating_sub(calls_before));
            (m, false, origin)
        }
    };
    if origin == Origin::Captured {
        t.captured_allocations.fetch_add(1, Ordering::Relaxed);
    }
    entry.tag.allocated(bytes as u64, reused);
    let addr = memory.addr();
    table::insert(Block {
        memory,
        target: entry.target.clone(),
        tag: entry.tag.clone(),
        size: bytes,
        class,
        origin,
    });
    Outcome::Served(addr)
}

/// A free of `ptr` on `stream` (`None`: a synchronous free). `false` when routing does not
/// own `ptr`.
fn routed_free(ptr: u64, stream: Option<CUstream>) -> bool {
    let Some(block) = table::remove(ptr) else {
        return false;
    };
    block.tag.freed(block.size as u64);
    let capturing = match stream {
        Some(s) if capture_active() => driver().is_some_and(|d| driver::stream_capturing(d, s)),
        _ => false,
    };
    let Block {
        memory,
        target,
        class,
        origin,
        ..
    } = block;
    let ctx = || driver::current_context().map(|c| c as usize);
    if origin == Origin::Captured || capturing {
        // A graph may use this memory at every launch: never reused until released.
        target.park(memory);
    } else if let Some(s) = stream {
        target.put_cached(StreamKey::of(s), class, memory, ctx());
    } else {
        target.free_synchronously(memory, ctx());
    }
    drop(target);
    target::reap_pending();
    true
}

/// `cuMemAllocAsync`.
///
/// # Safety
/// As the driver's: `dptr` is writable, `stream` a valid stream of the current context.
pub unsafe fn mem_alloc_async(dptr: *mut CUdeviceptr, bytes: usize, stream: CUstream) -> CUresult {
    guarded(|| {
        if !dptr.is_null() {
            match routed_alloc(bytes, stream, Use::OnStream) {
                // SAFETY: the caller's out-pointer.
                Outcome::Served(addr) => return unsafe { served(dptr, addr) },
                Outcome::Refused => return CUresult::CUDA_ERROR_OUT_OF_MEMORY,
                Outcome::Forward => {}
            }
        }
        let Some(d) = driver() else { return NO_DRIVER };
        // SAFETY: the caller's arguments, passed on unchanged.
        let r = unsafe { (d.mem_alloc_async)(dptr, bytes, stream) };
        forwarded_alloc(r, bytes);
        r
    })
}

/// `cuMemAlloc_v2`: routed like an allocation on the legacy stream.
///
/// # Safety
/// As the driver's.
pub unsafe fn mem_alloc(dptr: *mut CUdeviceptr, bytes: usize) -> CUresult {
    guarded(|| {
        if !dptr.is_null() {
            match routed_alloc(bytes, driver::STREAM_LEGACY as CUstream, Use::Anywhere) {
                // SAFETY: the caller's out-pointer.
                Outcome::Served(addr) => return unsafe { served(dptr, addr) },
                Outcome::Refused => return CUresult::CUDA_ERROR_OUT_OF_MEMORY,
                Outcome::Forward => {}
            }
        }
        let Some(d) = driver() else { return NO_DRIVER };
        // SAFETY: the caller's arguments, passed on unchanged.
        let r = unsafe { (d.mem_alloc)(dptr, bytes) };
        forwarded_alloc(r, bytes);
        r
    })
}

unsafe fn served(dptr: *mut CUdeviceptr, addr: u64) -> CUresult {
    // SAFETY: the caller of the hook passed a writable out-pointer (checked non-null).
    unsafe { dptr.write(addr) };
    CUresult::CUDA_SUCCESS
}

fn forwarded_alloc(r: CUresult, bytes: usize) {
    if r == CUresult::CUDA_SUCCESS {
        FORWARDED_ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
        FORWARDED_BYTES.fetch_add(bytes as u64, Ordering::Relaxed);
    }
}

/// `cuMemFreeAsync`. A routed block never fails to free.
///
/// # Safety
/// As the driver's.
pub unsafe fn mem_free_async(ptr: CUdeviceptr, stream: CUstream) -> CUresult {
    guarded(|| {
        if routed_free(ptr, Some(stream)) {
            return CUresult::CUDA_SUCCESS;
        }
        FORWARDED_FREES.fetch_add(1, Ordering::Relaxed);
        let Some(d) = driver() else { return NO_DRIVER };
        // SAFETY: a pointer routing does not own, passed on unchanged.
        unsafe { (d.mem_free_async)(ptr, stream) }
    })
}

/// `cuMemFree_v2`: a routed block goes back to its pool once the device is done with it (the
/// driver's free waits for the device too), never kept for one stream's reuse.
///
/// # Safety
/// As the driver's.
pub unsafe fn mem_free(ptr: CUdeviceptr) -> CUresult {
    guarded(|| {
        if routed_free(ptr, None) {
            return CUresult::CUDA_SUCCESS;
        }
        FORWARDED_FREES.fetch_add(1, Ordering::Relaxed);
        let Some(d) = driver() else { return NO_DRIVER };
        // SAFETY: a pointer routing does not own, passed on unchanged.
        unsafe { (d.mem_free)(ptr) }
    })
}

/// `cuStreamBeginCapture_v2`: counted, so that routing makes no call that would disturb a
/// capture while one is in progress.
///
/// # Safety
/// As the driver's.
pub unsafe fn stream_begin_capture(stream: CUstream, mode: CUstreamCaptureMode) -> CUresult {
    guarded(|| {
        let Some(d) = driver() else { return NO_DRIVER };
        capture_begins(stream as usize);
        // SAFETY: the caller's arguments, passed on unchanged.
        let r = unsafe { (d.stream_begin_capture)(stream, mode) };
        if r != CUresult::CUDA_SUCCESS {
            capture_ends(stream as usize);
        }
        r
    })
}

/// `cuStreamEndCapture`.
///
/// # Safety
/// As the driver's.
pub unsafe fn stream_end_capture(stream: CUstream, graph: *mut CUgraph) -> CUresult {
    guarded(|| {
        let Some(d) = driver() else { return NO_DRIVER };
        // SAFETY: the caller's arguments, passed on unchanged.
        let r = unsafe { (d.stream_end_capture)(stream, graph) };
        // The capture is over whatever the result (an invalidated one ends with an error), unless
        // the stream is still capturing (a call from the wrong thread in thread-local mode).
        if !driver::stream_capturing(d, stream) {
            capture_ends(stream as usize);
        }
        r
    })
}

/// `cuStreamDestroy_v2`: blocks freed on the stream are fenced while its handle is valid.
///
/// # Safety
/// As the driver's.
pub unsafe fn stream_destroy(stream: CUstream) -> CUresult {
    guarded(|| {
        // A capture abandoned on this stream ends with it.
        capture_ends(stream as usize);
        target::stream_destroyed(StreamKey::of(stream));
        let Some(d) = driver() else { return NO_DRIVER };
        // SAFETY: the caller's argument, passed on unchanged.
        unsafe { (d.stream_destroy)(stream) }
    })
}

/// Whether `addr` is a live routed allocation.
pub(crate) fn is_routed(addr: u64) -> bool {
    table::contains(addr)
}
