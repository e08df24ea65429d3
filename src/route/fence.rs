//! Fences: the point in a stream after which memory freed on it may be used by other streams.
//!
//! A freed block is reusable at once on the stream it was freed on (stream order protects it);
//! before it goes back to the pool, where any stream may get it, a fence is recorded on that
//! stream and the block waits until the GPU has passed it. On the host backend nothing is queued
//! on a GPU, so every fence has passed the moment it is made.

use std::cell::Cell;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

use cudarc::driver::sys::{CUcontext, CUevent, CUresult, CUstream};
use parking_lot::{Mutex, RwLock};

use crate::backend::driver::{
    driver, stream_capturing, Driver, EVENT_DISABLE_TIMING, STREAM_LEGACY, STREAM_PER_THREAD,
};

/// Stream captures in progress anywhere in the process (counted by the capture hooks). While
/// one is, routing makes no call that could disturb it: no event query or synchronize, and no
/// use of the legacy stream.
static ACTIVE_CAPTURES: AtomicUsize = AtomicUsize::new(0);
/// The streams being captured (a capture ends at `cuStreamEndCapture` or with its stream).
static CAPTURING: Mutex<Vec<usize>> = Mutex::new(Vec::new());

pub(crate) fn capture_active() -> bool {
    ACTIVE_CAPTURES.load(Ordering::Acquire) > 0
}

/// A capture on `stream` is about to begin (counted before it starts: no moment where one runs
/// uncounted).
pub(crate) fn capture_begins(stream: usize) {
    let mut c = CAPTURING.lock();
    c.push(stream);
    ACTIVE_CAPTURES.store(c.len(), Ordering::Release);
}

/// The capture on `stream` ended (or never began).
pub(crate) fn capture_ends(stream: usize) {
    let mut c = CAPTURING.lock();
    if let Some(i) = c.iter().position(|&s| s == stream) {
        c.swap_remove(i);
    }
    ACTIVE_CAPTURES.store(c.len(), Ordering::Release);
}

/// A small number per thread, cheaper to get than `std::thread::current().id()`.
pub(crate) fn thread_number() -> u64 {
    static NEXT: AtomicU64 = AtomicU64::new(1);
    thread_local! { static ME: Cell<u64> = const { Cell::new(0) }; }
    // During thread teardown the number is gone: such a thread names no stream of its own.
    ME.try_with(|me| {
        if me.get() == 0 {
            me.set(NEXT.fetch_add(1, Ordering::Relaxed));
        }
        me.get()
    })
    .unwrap_or(u64::MAX)
}

/// Which stream a block was freed on. `CU_STREAM_PER_THREAD` names a different stream on every
/// thread, so it is keyed by the thread too.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum StreamKey {
    /// The legacy default stream (handle 0 or `CU_STREAM_LEGACY`).
    Legacy,
    /// The per-thread default stream of a thread.
    PerThread(u64),
    /// A stream created by someone (a non-special handle).
    Stream(usize),
}

impl StreamKey {
    /// The key of `stream` as passed by the calling thread.
    pub(crate) fn of(stream: CUstream) -> StreamKey {
        match stream as usize {
            0 | STREAM_LEGACY => StreamKey::Legacy,
            STREAM_PER_THREAD => StreamKey::PerThread(thread_number()),
            h => StreamKey::Stream(h),
        }
    }

    /// The handle to record a fence on from the calling thread: the stream itself where this
    /// thread can name it, else the legacy stream, which is ordered after all work queued
    /// before on every blocking stream (each thread's per-thread stream is one).
    fn record_handle(self) -> usize {
        match self {
            StreamKey::Legacy => STREAM_LEGACY,
            StreamKey::PerThread(t) if t == thread_number() => STREAM_PER_THREAD,
            StreamKey::PerThread(_) => STREAM_LEGACY,
            StreamKey::Stream(h) => h,
        }
    }
}

/// Fences recorded, process-wide (also counted per target).
pub(crate) static FENCE_RECORDS: AtomicU64 = AtomicU64::new(0);

/// Keeps stream handles valid while fences are recorded on them: fencing holds it shared from
/// taking blocks out of a cache until their fences are recorded; the stream-destroy hook holds
/// it exclusively while it fences the dying stream's blocks, before the driver destroys it.
/// The one lock held across driver calls (`cuEventRecord`, and `cuStreamSynchronize` in the
/// destroy hook): nothing taken under it waits for another routing lock's holder.
/// Lock order: `STREAM_LIFE` -> a target's `cache` / `fenced`.
pub(crate) static STREAM_LIFE: RwLock<()> = RwLock::new(());

/// A point in a stream.
#[derive(Debug)]
pub(crate) enum Fence {
    /// Already passed (nothing was queued on a GPU, or the stream was synchronized).
    Passed,
    /// A CUDA event recorded on the stream. It lives no longer than the blocks it guards, which
    /// keep their pool and with it the device's context alive.
    Event { event: usize, ctx: usize },
}

/// What a poll of a fence found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum FenceState {
    /// The GPU has passed it: what it guards may be reused.
    Passed,
    /// Not yet, or it cannot be asked now (a capture is in progress).
    Pending,
}

/// Run `f` with `ctx` current on this thread, restoring the previous context afterwards.
fn in_context<R>(d: &Driver, ctx: CUcontext, f: impl FnOnce() -> R) -> R {
    let mut prev: CUcontext = std::ptr::null_mut();
    // SAFETY: valid out-pointer.
    unsafe { (d.ctx_get_current)(&mut prev) };
    if prev == ctx {
        return f();
    }
    // SAFETY: `ctx` is the context a routed allocation or free ran in; it stays alive while
    // pool memory of its device is in use (the pool's backend holds it).
    unsafe { (d.ctx_set_current)(ctx) };
    let r = f();
    // SAFETY: restoring what was current (possibly none).
    unsafe { (d.ctx_set_current)(prev) };
    r
}

impl Fence {
    /// A fence at the end of what is queued on `key` now, in context `ctx` (`None` for host
    /// memory). `None` back when it cannot be recorded now (during a capture the legacy stream
    /// and capturing streams are off limits: a record there would join the graph) or the
    /// driver refused: the caller keeps the blocks where they were. The caller holds
    /// [`STREAM_LIFE`] (shared or exclusive) for a [`StreamKey::Stream`].
    pub(crate) fn record(ctx: Option<usize>, key: StreamKey) -> Option<Fence> {
        let Some(ctx) = ctx else {
            return Some(Fence::Passed);
        };
        let d = driver()?;
        let handle = key.record_handle();
        if capture_active() && (handle == STREAM_LEGACY || stream_capturing(d, handle as CUstream))
        {
            return None;
        }
        in_context(d, ctx as CUcontext, || {
            let mut e: CUevent = std::ptr::null_mut();
            // SAFETY: valid out-pointer; the context is current.
            let r = unsafe { (d.event_create)(&mut e, EVENT_DISABLE_TIMING) };
            if r != CUresult::CUDA_SUCCESS {
                tracing::warn!(?r, "routing: cuEventCreate failed; blocks stay cached");
                return None;
            }
            // SAFETY: a live event of this context; `handle` is a special handle or a stream
            // kept alive by `STREAM_LIFE` (the destroy hook fences before it goes).
            let r = unsafe { (d.event_record)(e, handle as CUstream) };
            if r != CUresult::CUDA_SUCCESS {
                tracing::warn!(?r, "routing: cuEventRecord failed; blocks stay cached");
                // SAFETY: the event just made, used by nothing.
                unsafe { (d.event_destroy)(e) };
                return None;
            }
            FENCE_RECORDS.fetch_add(1, Ordering::Relaxed);
            Some(Fence::Event {
                event: e as usize,
                ctx,
            })
        })
    }

    /// A fence for a stream about to be destroyed when no event can be recorded on it: wait
    /// for the stream instead (not during a capture).
    pub(crate) fn by_synchronizing(ctx: Option<usize>, key: StreamKey) -> Option<Fence> {
        let Some(ctx) = ctx else {
            return Some(Fence::Passed);
        };
        let d = driver()?;
        let handle = key.record_handle();
        if capture_active() {
            return None;
        }
        in_context(d, ctx as CUcontext, || {
            // SAFETY: the stream is alive (its destroy hook is running, holding STREAM_LIFE).
            let r = unsafe { (d.stream_synchronize)(handle as CUstream) };
            (r == CUresult::CUDA_SUCCESS).then_some(Fence::Passed)
        })
    }

    /// Whether the GPU has passed the fence, without waiting.
    pub(crate) fn poll(&self) -> FenceState {
        match *self {
            Fence::Passed => FenceState::Passed,
            Fence::Event { event, .. } => {
                if capture_active() {
                    return FenceState::Pending;
                }
                let Some(d) = driver() else {
                    return FenceState::Pending;
                };
                // SAFETY: a live event.
                match unsafe { (d.event_query)(event as CUevent) } {
                    CUresult::CUDA_SUCCESS => FenceState::Passed,
                    // Not ready, or an error: `wait` settles errors.
                    _ => FenceState::Pending,
                }
            }
        }
    }

    /// Wait until the GPU has passed the fence (not while a capture is in progress: then it
    /// stays pending). An event that cannot be waited for is settled by synchronizing its
    /// whole context.
    pub(crate) fn wait(&self) -> FenceState {
        match *self {
            Fence::Passed => FenceState::Passed,
            Fence::Event { event, ctx } => {
                if capture_active() {
                    return FenceState::Pending;
                }
                let Some(d) = driver() else {
                    return FenceState::Pending;
                };
                in_context(d, ctx as CUcontext, || {
                    // SAFETY: a live event of this context.
                    match unsafe { (d.event_synchronize)(event as CUevent) } {
                        CUresult::CUDA_SUCCESS => FenceState::Passed,
                        r => {
                            tracing::warn!(
                                ?r,
                                "routing: cuEventSynchronize failed; synchronizing the context"
                            );
                            // SAFETY: the context is current; no capture is in progress.
                            match unsafe { (d.ctx_synchronize)() } {
                                CUresult::CUDA_SUCCESS => FenceState::Passed,
                                _ => FenceState::Pending,
                            }
                        }
                    }
                })
            }
        }
    }
}

/// Wait for all work of context `ctx` (no-op success for host memory).
pub(crate) fn synchronize_context(ctx: Option<usize>) -> bool {
    let Some(ctx) = ctx else {
        return true;
    };
    let Some(d) = driver() else {
        return false;
    };
    in_context(d, ctx as CUcontext, || {
        // SAFETY: the context is current; the caller checked no capture is in progress.
        unsafe { (d.ctx_synchronize)() == CUresult::CUDA_SUCCESS }
    })
}

impl Drop for Fence {
    fn drop(&mut self) {
        if let Fence::Event { event, .. } = *self {
            if let Some(d) = driver() {
                // SAFETY: a live event nobody else refers to (its context is alive: see above).
                unsafe { (d.event_destroy)(event as CUevent) };
            }
        }
    }
}
