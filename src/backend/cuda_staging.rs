//! Reused buffers for the gather kernel's descriptors: pinned host memory the descriptors are
//! written into and device memory they are uploaded to, a pair per slot, free again once the
//! launch that read them completed (an event recorded after it).
//!
//! Why: the first cut allocated the device buffer from a stream-ordered pool and uploaded from
//! pageable memory on every launch; on the H100 that was 11-13 µs of host time per copy
//! (allocation ~3.5 µs, a pageable 64 KiB upload ~8 µs, the free ~1 µs), a third of a 4096-block
//! copy's host time. From pinned memory the upload is asynchronous and the buffers stay.
//!
//! Bounded: at most [`MAX_SLOTS`] slots of [`SLOT_BYTES`] each (the descriptors of the largest
//! grant a p2p link carries fit one); a launch that finds none free (or needs more) takes the
//! pool path. The memory is the backend's own, outside any pool's books (like the kernel's
//! module), and goes when the backend does. Device memory is taken from the driver itself
//! (`driver.rs`), never through the allocation hooks routing may define, and slots are
//! created in relaxed capture mode, so a graph another thread captures is not invalidated.

use std::sync::atomic::{AtomicU64, Ordering};

use parking_lot::Mutex;

use cudarc::driver::sys;

use super::driver::driver;

/// Most slots a backend keeps: concurrent launches beyond this take the pool path.
pub(super) const MAX_SLOTS: usize = 8;
/// Bytes of every slot: 24 per piece and 16 per shift, so 2 MiB holds the 65536 shifts of the
/// largest p2p grant ([`crate::p2p::MAX_GRANT_BLOCKS`]) and thousands of pieces. One size, so
/// any free slot serves any launch.
pub(super) const SLOT_BYTES: usize = 2 << 20;

/// Pinned host memory and device memory of `cap` bytes each, and the event recorded after the
/// last launch that read them.
#[derive(Debug)]
pub(super) struct Slot {
    host: *mut u8,
    dev: sys::CUdeviceptr,
    cap: usize,
    done: sys::CUevent,
}

// SAFETY: the pointers are driver allocations owned by the slot, which one thread uses at a
// time (it is moved out of the list while in use); driver handles are usable from any thread.
unsafe impl Send for Slot {}

impl Slot {
    /// The device address of the descriptors.
    pub(super) fn dev(&self) -> sys::CUdeviceptr {
        self.dev
    }

    /// The pinned host buffer, `cap` bytes.
    pub(super) fn host(&mut self) -> &mut [u8] {
        // SAFETY: `host` is a live `cuMemHostAlloc` allocation of `cap` bytes owned by this
        // slot, zeroed when created (initialized bytes); no launch reads it (the slot was
        // handed out after its event completed, and the upload of this use is queued only
        // after the caller wrote it); `&mut self` makes the borrow exclusive.
        unsafe { std::slice::from_raw_parts_mut(self.host, self.cap) }
    }

    /// Free the slot's memory and event. The caller makes sure nothing queued uses them.
    ///
    /// # Safety
    /// The backend's context is current and no queued work reads the slot's memory.
    unsafe fn destroy(self) {
        // SAFETY: allocations of this slot, freed once; the caller vouches nothing uses them.
        // The device memory came from the driver's own `cuMemAlloc` (`driver.rs`), so it
        // goes back the same way.
        unsafe {
            if let Some(d) = driver() {
                if let Err(e) = (d.mem_free)(self.dev).result() {
                    tracing::warn!(error = ?e.0, "cuMemFree of a descriptor slot failed");
                }
            }
            if let Err(e) = sys::cuMemFreeHost(self.host.cast()).result() {
                tracing::warn!(error = ?e.0, "cuMemFreeHost of a descriptor slot failed");
            }
            if let Err(e) = sys::cuEventDestroy_v2(self.done).result() {
                tracing::warn!(error = ?e.0, "cuEventDestroy of a descriptor slot failed");
            }
        }
    }
}

/// The slots of one backend. Lock: a leaf, held only to move slots in and out of the lists,
/// never across a driver call.
#[derive(Debug, Default)]
pub(super) struct DescriptorStaging {
    state: Mutex<SlotLists>,
    /// Launches whose descriptors went through a slot, and through the pool.
    pinned: AtomicU64,
    pooled: AtomicU64,
}

/// How a CUDA backend's gather launches uploaded their descriptors
/// ([`super::cuda::CudaBackend::gather_uploads`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct GatherUploads {
    /// Through a reused pinned buffer.
    pub pinned: u64,
    /// Through the stream-ordered pool, from pageable memory (no buffer free, or too large).
    pub pooled: u64,
    /// Pinned buffers the backend holds now.
    pub slots: usize,
}

#[derive(Debug, Default)]
struct SlotLists {
    /// Slots not in use by a launch being queued (their event may still be pending).
    idle: Vec<Slot>,
    /// Slots in existence or being created (idle, in use, or retired).
    count: usize,
    /// Slots whose event could not be recorded: whether a launch still reads them is unknown,
    /// so they are only freed when the backend goes (after synchronizing the context).
    retired: Vec<Slot>,
}

impl DescriptorStaging {
    /// A slot of at least `bytes` whose last launch completed: an idle one, or a new one while
    /// there are fewer than [`MAX_SLOTS`]. `None` where there is none (or `bytes` exceeds
    /// [`SLOT_BYTES`], or allocating failed): the caller takes the pool path. The
    /// backend's context must be current.
    pub(super) fn take(&self, bytes: usize) -> Option<Slot> {
        if bytes > SLOT_BYTES {
            return None;
        }
        let mut busy = Vec::new();
        let mut found = None;
        loop {
            // The smallest idle slot that fits and was not found busy yet.
            let candidate = {
                let mut st = self.state.lock();
                let best = st
                    .idle
                    .iter()
                    .enumerate()
                    .filter(|(_, s)| s.cap >= bytes)
                    .min_by_key(|(_, s)| s.cap)
                    .map(|(i, _)| i);
                best.map(|i| st.idle.swap_remove(i))
            };
            let Some(slot) = candidate else { break };
            // SAFETY: the slot's event is live (destroyed only with the slot).
            match unsafe { sys::cuEventQuery(slot.done) } {
                sys::CUresult::CUDA_SUCCESS => {
                    found = Some(slot);
                    break;
                }
                sys::CUresult::CUDA_ERROR_NOT_READY => busy.push(slot),
                e => {
                    // A failed earlier launch reports here; the slot is not known to be free.
                    tracing::debug!(error = ?e, "descriptor slot's event query failed; slot skipped");
                    busy.push(slot);
                }
            }
        }
        let mut st = self.state.lock();
        st.idle.append(&mut busy);
        if found.is_some() {
            return found;
        }
        if st.count >= MAX_SLOTS {
            return None;
        }
        st.count += 1;
        drop(st);
        let cap = SLOT_BYTES;
        match Self::create_relaxed(cap) {
            Ok(slot) => {
                tracing::debug!(cap, "descriptor slot created");
                Some(slot)
            }
            Err(why) => {
                self.state.lock().count -= 1;
                tracing::debug!(%why, cap, "descriptor slot not created; the pool path uploads");
                None
            }
        }
    }

    /// Hand `slot` back after queuing a launch (or an upload) that reads it on `stream`: its
    /// event is recorded there, so the slot is reused only after that work completed. Where the
    /// event cannot be recorded the slot is retired until the backend goes.
    pub(super) fn give_back(&self, slot: Slot, stream: sys::CUstream) {
        // SAFETY: the event is live; the caller's stream is valid (the launch just used it).
        let r = unsafe { sys::cuEventRecord(slot.done, stream) }.result();
        let mut st = self.state.lock();
        match r {
            Ok(()) => st.idle.push(slot),
            Err(e) => {
                tracing::warn!(error = ?e.0, "cuEventRecord after a gather launch failed; its descriptor slot is retired");
                st.retired.push(slot);
            }
        }
    }

    /// Count a launch: through a slot or through the pool.
    pub(super) fn count_launch(&self, pinned: bool) {
        let c = if pinned { &self.pinned } else { &self.pooled };
        c.fetch_add(1, Ordering::Relaxed);
    }

    /// The counts so far.
    pub(super) fn uploads(&self) -> GatherUploads {
        GatherUploads {
            pinned: self.pinned.load(Ordering::Relaxed),
            pooled: self.pooled.load(Ordering::Relaxed),
            slots: self.state.lock().count,
        }
    }

    /// Hand back a slot nothing was queued with (its event still marks its last use).
    pub(super) fn give_back_unused(&self, slot: Slot) {
        self.state.lock().idle.push(slot);
    }

    /// Free every slot.
    ///
    /// # Safety
    /// The backend's context is current and synchronized: nothing queued reads any slot.
    pub(super) unsafe fn destroy(&mut self) {
        let st = std::mem::take(self.state.get_mut());
        for slot in st.idle.into_iter().chain(st.retired) {
            // SAFETY: forwarded.
            unsafe { slot.destroy() };
        }
    }

    /// [`DescriptorStaging::create`] with this thread in relaxed capture mode: allocating is
    /// not allowed while another thread captures a graph in global mode (it would invalidate
    /// that capture), in relaxed mode it is.
    fn create_relaxed(cap: usize) -> std::result::Result<Slot, String> {
        let mut mode = sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED;
        // SAFETY: `mode` is valid for reading and writing; the call swaps this thread's mode.
        let swapped = unsafe { sys::cuThreadExchangeStreamCaptureMode(&mut mode) }.result();
        let r = Self::create(cap);
        if swapped.is_ok() {
            // SAFETY: as above: the thread's earlier mode goes back.
            let _ = unsafe { sys::cuThreadExchangeStreamCaptureMode(&mut mode) };
        }
        r
    }

    /// Allocate a slot of `cap` bytes; on failure nothing stays allocated.
    fn create(cap: usize) -> std::result::Result<Slot, String> {
        let Some(d) = driver() else {
            return Err("the CUDA driver library's own entry points were not found".into());
        };
        let mut done: sys::CUevent = std::ptr::null_mut();
        // SAFETY: `done` is valid for writing.
        unsafe {
            sys::cuEventCreate(
                &mut done,
                sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as std::ffi::c_uint,
            )
        }
        .result()
        .map_err(|e| format!("cuEventCreate failed with {:?}", e.0))?;
        let mut host: *mut std::ffi::c_void = std::ptr::null_mut();
        // SAFETY: `host` is valid for writing; flags 0: pinned, for this context.
        if let Err(e) = unsafe { sys::cuMemHostAlloc(&mut host, cap, 0) }.result() {
            // SAFETY: created above, never recorded.
            let _ = unsafe { sys::cuEventDestroy_v2(done) };
            return Err(format!(
                "cuMemHostAlloc of {cap} bytes failed with {:?}",
                e.0
            ));
        }
        // Initialized once, so the buffer can be handed out as bytes.
        // SAFETY: `host` holds `cap` writable bytes, just allocated.
        unsafe { std::ptr::write_bytes(host.cast::<u8>(), 0, cap) };
        let mut dev: sys::CUdeviceptr = 0;
        // SAFETY: `dev` is valid for writing; the driver's own entry point, not a hook.
        if let Err(e) = unsafe { (d.mem_alloc)(&mut dev, cap) }.result() {
            // SAFETY: allocated and created above, never used.
            unsafe {
                let _ = sys::cuMemFreeHost(host);
                let _ = sys::cuEventDestroy_v2(done);
            }
            return Err(format!("cuMemAlloc of {cap} bytes failed with {:?}", e.0));
        }
        Ok(Slot {
            host: host.cast(),
            dev,
            cap,
            done,
        })
    }
}
