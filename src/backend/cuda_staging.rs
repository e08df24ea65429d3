//! Reused buffers for the gather kernel's descriptors: pinned host memory the descriptors are
//! written into and device memory they are uploaded to, a pair per slot, free again once the
//! launch that read them completed (an event recorded after it).
//!
//! Why: the first cut allocated the device buffer from a stream-ordered pool and uploaded from
//! pageable memory on every launch; on the H100 that was 11-13 µs of host time per copy
//! (allocation ~3.5 µs, a pageable 64 KiB upload ~8 µs, the free ~1 µs), a third of a 4096-block
//! copy's host time. From pinned memory the upload is asynchronous and the buffers stay.
//!
//! Bounded: at most [`MAX_SLOTS`] slots of at most [`MAX_SLOT_BYTES`] each; a launch that finds
//! none free (or needs more) takes the pool path. The memory is the backend's own, outside any
//! pool's books (like the kernel's module), and goes when the backend does.

use parking_lot::Mutex;

use cudarc::driver::sys;

/// Most slots a backend keeps: concurrent launches beyond this take the pool path.
pub(super) const MAX_SLOTS: usize = 8;
/// Largest slot (bytes of descriptors: 24 per piece, 16 per shift; 4 MiB is ~262000 blocks).
pub(super) const MAX_SLOT_BYTES: usize = 4 << 20;
/// Smallest slot, so that slots are reused across copies of somewhat different sizes.
const MIN_SLOT_BYTES: usize = 64 << 10;

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
        // slot; no launch reads it (the slot was handed out after its event completed, and the
        // upload of this use is queued only after the caller wrote it); `&mut self` makes the
        // borrow exclusive.
        unsafe { std::slice::from_raw_parts_mut(self.host, self.cap) }
    }

    /// Free the slot's memory and event. The caller makes sure nothing queued uses them.
    ///
    /// # Safety
    /// The backend's context is current and no queued work reads the slot's memory.
    unsafe fn destroy(self) {
        // SAFETY: allocations of this slot, freed once; the caller vouches nothing uses them.
        unsafe {
            if let Err(e) = sys::cuMemFree_v2(self.dev).result() {
                tracing::warn!(error = ?e.0, "cuMemFree of a descriptor slot failed");
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
    /// [`MAX_SLOT_BYTES`], or allocating failed): the caller takes the pool path. The
    /// backend's context must be current.
    pub(super) fn take(&self, bytes: usize) -> Option<Slot> {
        if bytes > MAX_SLOT_BYTES {
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
        let cap = bytes
            .max(MIN_SLOT_BYTES)
            .checked_next_power_of_two()
            .unwrap_or(MAX_SLOT_BYTES)
            .min(MAX_SLOT_BYTES);
        match Self::create(cap) {
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

    /// Allocate a slot of `cap` bytes; on failure nothing stays allocated.
    fn create(cap: usize) -> std::result::Result<Slot, String> {
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
        let mut dev: sys::CUdeviceptr = 0;
        // SAFETY: `dev` is valid for writing.
        if let Err(e) = unsafe { sys::cuMemAlloc_v2(&mut dev, cap) }.result() {
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
