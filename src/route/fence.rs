//! Fences: the point in a stream after which memory freed on it may be used by other streams.
//!
//! A freed block is reusable at once on the stream it was freed on (stream order protects it);
//! before it goes back to the pool, where any stream may get it, a fence is recorded on that
//! stream and the block waits until the GPU has passed it. On the host backend nothing is queued
//! on a GPU, so every fence has passed the moment it is made.

use std::cell::Cell;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

use cudarc::driver::sys::{CUcontext, CUevent, CUresult, CUstream};
use parking_lot::Mutex;

use super::driver::{driver, Driver, EVENT_DISABLE_TIMING, STREAM_LEGACY, STREAM_PER_THREAD};

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
    ME.with(|me| {
        if me.get() == 0 {
            me.set(NEXT.fetch_add(1, Ordering::Relaxed));
        }
        me.get()
    })
}

/// Which stream a block was freed on. `CU_STREAM_PER_THREAD` names a different stream on every
/// thread, so it is keyed by the thread too.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum StreamKey {
    /// The legacy default stream (handle 0 or `CU_STREAM_LEGACY`); also synchronous frees.
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

/// Fences made, passed and waited for, process-wide (also counted per target).
pub(crate) static FENCE_RECORDS: AtomicU64 = AtomicU64::new(0);

/// Events kept for reuse, with the context they belong to: creating an event is a driver call.
static SPARE_EVENTS: Mutex<Vec<(usize, usize)>> = Mutex::new(Vec::new());

/// A point in a stream.
#[derive(Debug)]
pub(crate) enum Fence {
    /// Already passed (nothing was queued on a GPU).
    Passed,
    /// A CUDA event recorded on the stream.
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
    // SAFETY: `ctx` is a context the caller saw current during a routed allocation; primary
    // contexts stay alive while any memory of theirs (our pool's backend holds one) is in use.
    unsafe { (d.ctx_set_current)(ctx) };
    let r = f();
    // SAFETY: restoring what was current (possibly none).
    unsafe { (d.ctx_set_current)(prev) };
    r
}

impl Fence {
    /// A fence at the end of what is queued on `key` now, in context `ctx` (`None` for host
    /// memory). `None` back when it cannot be recorded now (a capture in progress forbids the
    /// legacy stream) or the driver refused: the caller keeps the blocks where they were.
    pub(crate) fn record(ctx: Option<usize>, key: StreamKey) -> Option<Fence> {
        let Some(ctx) = ctx else {
            return Some(Fence::Passed);
        };
        let d = driver()?;
        let handle = key.record_handle();
        if handle == STREAM_LEGACY && capture_active() {
            return None;
        }
        let ctx_ptr = ctx as CUcontext;
        in_context(d, ctx_ptr, || {
            let spare = {
                let mut spare = SPARE_EVENTS.lock();
                spare
                    .iter()
                    .position(|&(c, _)| c == ctx)
                    .map(|i| spare.swap_remove(i).1)
            };
            let event = match spare {
                Some(e) => e,
                None => {
                    let mut e: CUevent = std::ptr::null_mut();
                    // SAFETY: valid out-pointer; the context is current.
                    let r = unsafe { (d.event_create)(&mut e, EVENT_DISABLE_TIMING) };
                    if r != CUresult::CUDA_SUCCESS {
                        tracing::warn!(?r, "routing: cuEventCreate failed; blocks stay cached");
                        return None;
                    }
                    e as usize
                }
            };
            // SAFETY: a live event of this context; `handle` is a special handle or a stream
            // that is alive (streams are fenced by the destroy hook before they go).
            let r = unsafe { (d.event_record)(event as CUevent, handle as CUstream) };
            if r != CUresult::CUDA_SUCCESS {
                tracing::warn!(?r, "routing: cuEventRecord failed; blocks stay cached");
                SPARE_EVENTS.lock().push((ctx, event));
                return None;
            }
            FENCE_RECORDS.fetch_add(1, Ordering::Relaxed);
            Some(Fence::Event { event, ctx })
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
                    _ => FenceState::Pending,
                }
            }
        }
    }

    /// Wait until the GPU has passed the fence (not while a capture is in progress: then it
    /// stays pending).
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
                            tracing::error!(?r, "routing: cuEventSynchronize failed");
                            FenceState::Pending
                        }
                    }
                })
            }
        }
    }
}

impl Drop for Fence {
    fn drop(&mut self) {
        if let Fence::Event { event, ctx } = *self {
            // Kept for the next fence of the same context (at most a few dozen are ever live).
            let mut spare = SPARE_EVENTS.lock();
            if spare.len() < 256 {
                spare.push((ctx, event));
                return;
            }
            drop(spare);
            if let Some(d) = driver() {
                // SAFETY: a live event nobody else refers to.
                unsafe { (d.event_destroy)(event as CUevent) };
            }
        }
    }
}
