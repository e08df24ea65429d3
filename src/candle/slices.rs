//! Candle storage over pool memory, the private CUDA contexts that keep cudarc's failed frees
//! away from the user's device, the stream our copies go on, and fences that tell when the GPU
//! is done with memory.
//!
//! cudarc's `CudaSlice` frees its memory on drop with `cuMemFreeAsync` on the slice's stream and
//! stores a failure as the sticky error of that stream's `CudaContext` object; the next checked
//! call through that object (`bind_to_thread`) returns it. On VMM memory the free always fails
//! with `CUDA_ERROR_INVALID_VALUE` and changes nothing. Every `CudaContext::new` is a separate
//! error slot over the same primary context, so each slice made here gets a private context
//! object of its own:
//! - the failed free of a dropped tensor lands in its private context, never in the user's;
//! - a live tensor's own operations (`to_vec*`, `copy`) go through its private context, whose
//!   error slot only its own drop fills, so they never see another tensor's failed free;
//! - once every slice over it is gone, the context's error is absorbed (counted) and the context
//!   is reused for the next tensor, so the steady state makes no driver call to create one.
//!
//! The slice's stream is a borrowed wrapper of the device's *ordering stream* (see
//! [`ordering_stream`] and the module documentation of `candle`) on the private context: what
//! cudarc does through the slice's stream (host reads, `Tensor::copy`, the failed free) is in
//! order with the kernels candle launches on the device, from any thread.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use candle_core::cuda_backend::cudarc::driver::{
    sys, CudaContext, CudaEvent, CudaStream, DevicePtr, DriverError,
};
use candle_core::cuda_backend::{CudaStorage, CudaStorageSlice};
use candle_core::op::BackpropOp;
use candle_core::{CudaDevice, DType, Shape, Storage, Tensor};
use parking_lot::Mutex;

use std::collections::VecDeque;

use super::retire::{settle, Batch, FenceSource, Wait};
use crate::backend::Backend;
use crate::error::{Error, Result};

/// Idle private contexts kept for reuse; beyond this they are released.
const MAX_IDLE_CONTEXTS: usize = 1024;
/// Spare fence events kept for reuse.
const MAX_SPARE_EVENTS: usize = 64;
// The per-thread stream is the one candle 0.11's `Device::new_cuda` launches every kernel on
// (`CudaContext::per_thread_stream`).
pub(crate) use crate::backend::{LEGACY_STREAM, PER_THREAD_STREAM};

/// The stream that orders our copies, fills, host reads and fences with the kernels of a candle
/// device whose stream handle is `device_stream`, whatever thread queues them.
///
/// - A device of `Device::new_cuda` launches on the per-thread default stream of whichever
///   thread runs the operation, so two threads' kernels are on two streams. The legacy default
///   stream is the one stream ordered with all of them: work queued on it starts after all work
///   queued before on every blocking stream of the context (every thread's per-thread stream is
///   one), and work queued on those afterwards starts after it. So: the legacy stream.
/// - A device on the legacy stream (handle 0 or 1): the same.
/// - A device with a stream of its own (`Device::new_cuda_with_stream`, a non-blocking stream,
///   which the legacy stream is *not* ordered with): every thread launches on that one stream,
///   so that stream.
pub(crate) fn ordering_stream(device_stream: u64) -> u64 {
    match device_stream {
        0 | LEGACY_STREAM | PER_THREAD_STREAM => LEGACY_STREAM,
        own => own,
    }
}

/// The raw stream handle of a candle CUDA device, as an integer (raw pointers are not `Send`).
pub(crate) fn device_stream(device: &CudaDevice) -> u64 {
    device.cuda_stream().cu_stream().addr() as u64
}

/// A driver failure as this crate's error.
pub(crate) fn cuda_error(
    call: &'static str,
    detail: impl Into<String>,
) -> impl FnOnce(DriverError) -> Error {
    let detail = detail.into();
    move |e| Error::backend("cuda", call, format!("{:?}", e.0), detail)
}

fn is_failed_free(e: &DriverError) -> bool {
    e.0 == sys::cudaError_enum::CUDA_ERROR_INVALID_VALUE
}

/// Run `f` with the device address of the first element of `src` (a contiguous tensor on a CUDA
/// device), holding its storage until `f` returns: long enough to queue a copy from it in
/// stream order.
pub(crate) fn with_device_ptr<R>(src: &Tensor, f: impl FnOnce(u64) -> Result<R>) -> Result<R> {
    if !src.is_contiguous() {
        return Err(Error::InvalidArgument(format!(
            "copy source of shape {:?} is not contiguous",
            src.dims()
        )));
    }
    let (storage, layout) = src.storage_and_layout();
    let Storage::Cuda(cuda) = &*storage else {
        return Err(Error::InvalidArgument(format!(
            "copy source is on {:?}, not on a CUDA device",
            src.device().location()
        )));
    };
    let stream = cuda.device.cuda_stream();
    let offset = (layout.start_offset() * src.dtype().size_in_bytes()) as u64;
    macro_rules! at {
        ($s:expr) => {{
            let (p, guard) = $s.device_ptr(&stream);
            (p + offset, guard)
        }};
    }
    use CudaStorageSlice as S;
    let (from, _read) = match &cuda.slice {
        S::U8(s) | S::F6E2M3(s) | S::F6E3M2(s) | S::F4(s) | S::F8E8M0(s) => at!(s),
        S::U32(s) => at!(s),
        S::I16(s) => at!(s),
        S::I32(s) => at!(s),
        S::I64(s) => at!(s),
        S::BF16(s) => at!(s),
        S::F16(s) => at!(s),
        S::F32(s) => at!(s),
        S::F64(s) => at!(s),
        S::F8E4M3(s) => at!(s),
    };
    f(from)
}

/// Tells when every slice made over one piece of memory is gone.
///
/// It holds the stream handle that the slice (and any cudarc copy of the slice) holds too: when
/// the tracker's handle is the only one left, no tensor can reach the memory any more.
#[derive(Debug)]
pub(crate) struct Tracker {
    stream: Arc<CudaStream>,
}

impl Tracker {
    /// Whether every slice made with this tracker is gone. Exact: the slices' handles are
    /// clones of ours, and none can be made once the last slice is dropped.
    pub(crate) fn is_unique(&mut self) -> bool {
        // `get_mut` reads the count with acquire ordering, so the other thread's drop of the
        // slice (and its failed free, made before) happened before we go on.
        Arc::get_mut(&mut self.stream).is_some()
    }

    /// Clear the failed free of an already dropped tensor from the private context that its
    /// `Tensor::copy()` copies still use. Other errors are put back. Returns whether one was
    /// absorbed.
    pub(crate) fn absorb_copy_error(&self) -> bool {
        let ctx = self.stream.context();
        match ctx.check_err() {
            Ok(()) => false,
            Err(e) if is_failed_free(&e) => true,
            Err(e) => {
                ctx.record_err::<()>(Err(e));
                false
            }
        }
    }
}

/// Copies and fills in stream order on a device's ordering stream, queued through the pool's
/// backend (the only code that calls the driver for them).
#[derive(Debug, Clone)]
pub(crate) struct Queue {
    backend: Arc<dyn Backend>,
    stream: u64,
}

impl Queue {
    /// Copies and fills through `backend` on the ordering stream of `device`.
    pub(crate) fn new(backend: Arc<dyn Backend>, device: &CudaDevice) -> Self {
        Queue {
            backend,
            stream: ordering_stream(device_stream(device)),
        }
    }

    /// The ordering stream's raw handle.
    pub(crate) fn stream(&self) -> u64 {
        self.stream
    }

    /// Check that the backend queues stream-ordered copies and fills, with a zero-byte call of
    /// each (no driver call on a backend that supports them).
    pub(crate) fn check_supported(&self) -> Result<()> {
        // SAFETY: zero bytes name no memory; the stream is the device's ordering stream.
        unsafe {
            self.backend.copies().copy_async(0, 0, 0, self.stream)?;
            self.backend.copies().fill_async(0, 0, 0, self.stream)
        }
    }

    /// Copy `bytes` from device memory at `src` to `dst`, in order on the ordering stream.
    ///
    /// # Safety
    /// Both ranges are device memory of this backend's device, mapped with access until the GPU
    /// has run the copy (memory of live tensors, or pool memory given back only behind a fence
    /// recorded on the ordering stream after the copy); they do not overlap; every other use of
    /// them is a candle kernel of the device or work on the ordering stream.
    pub(crate) unsafe fn copy(&self, dst: u64, src: u64, bytes: usize) -> Result<()> {
        // SAFETY: the caller's contract is the backend's, and the stream is the ordering stream.
        unsafe {
            self.backend
                .copies()
                .copy_async(dst, src, bytes, self.stream)
        }
    }

    /// Zero `bytes` at `addr`, in order on the ordering stream.
    ///
    /// # Safety
    /// As for [`Queue::copy`], for the one range.
    pub(crate) unsafe fn zero(&self, addr: u64, bytes: usize) -> Result<()> {
        // SAFETY: as above.
        unsafe {
            self.backend
                .copies()
                .fill_async(addr, bytes, 0, self.stream)
        }
    }
}

/// Makes candle tensors over given device memory for one candle CUDA device.
pub(crate) struct SliceFactory {
    device: CudaDevice,
    ordinal: usize,
    /// The ordering stream's raw handle (see [`ordering_stream`]).
    stream: u64,
    idle: Mutex<Vec<Arc<CudaContext>>>,
    created: AtomicU64,
    absorbed: AtomicU64,
}

impl std::fmt::Debug for SliceFactory {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SliceFactory")
            .field("ordinal", &self.ordinal)
            .field("stream", &format_args!("{:#x}", self.stream))
            .field("contexts", &self.created.load(Ordering::Relaxed))
            .finish()
    }
}

impl SliceFactory {
    pub(crate) fn new(device: &CudaDevice, ordinal: usize) -> Self {
        SliceFactory {
            stream: ordering_stream(device_stream(device)),
            device: device.clone(),
            ordinal,
            idle: Mutex::new(Vec::new()),
            created: AtomicU64::new(0),
            absorbed: AtomicU64::new(0),
        }
    }

    /// Private contexts created so far.
    pub(crate) fn contexts_created(&self) -> u64 {
        self.created.load(Ordering::Relaxed)
    }

    /// Failed frees absorbed so far.
    pub(crate) fn absorbed(&self) -> u64 {
        self.absorbed.load(Ordering::Relaxed)
    }

    pub(crate) fn count_absorbed(&self, n: u64) {
        if n > 0 {
            self.absorbed.fetch_add(n, Ordering::Relaxed);
        }
    }

    /// A private context: a recycled one (no driver call), or a new one.
    pub(crate) fn take_context(&self) -> Result<Arc<CudaContext>> {
        if let Some(ctx) = self.idle.lock().pop() {
            return Ok(ctx);
        }
        let ctx = CudaContext::new(self.ordinal).map_err(cuda_error(
            "cuDevicePrimaryCtxRetain",
            format!("private context on device {}", self.ordinal),
        ))?;
        // SAFETY: slices on this context are used by candle's kernels and on the ordering
        // stream, which are in order with each other (see `ordering_stream`), so they need no
        // cross-stream events; without them `upgrade_device_ptr` makes no driver call and
        // cannot panic.
        unsafe { ctx.disable_event_tracking() };
        self.created.fetch_add(1, Ordering::Relaxed);
        tracing::trace!(ordinal = self.ordinal, "private context created");
        Ok(ctx)
    }

    /// Give back a context no slice uses any more: its error slot is emptied (a failed free is
    /// counted, anything else logged) and it waits for the next tensor.
    pub(crate) fn put_back(&self, ctx: Arc<CudaContext>) {
        match ctx.check_err() {
            Ok(()) => {}
            Err(e) if is_failed_free(&e) => self.count_absorbed(1),
            Err(e) => {
                tracing::warn!(error = ?e.0, "unexpected error left in a private context; cleared")
            }
        }
        let excess = {
            let mut idle = self.idle.lock();
            if idle.len() < MAX_IDLE_CONTEXTS {
                idle.push(ctx);
                None
            } else {
                Some(ctx)
            }
        };
        // Dropping a context releases its primary-context reference: outside the lock.
        drop(excess);
    }

    /// Recycle the context of a tracker whose slices are all gone.
    pub(crate) fn retire(&self, tracker: Tracker) {
        let ctx = tracker.stream.context().clone();
        drop(tracker);
        self.put_back(ctx);
    }

    /// A contiguous candle tensor of `shape` and `dtype` over the memory at `addr`, on the
    /// private context `ctx`, and the tracker that tells when it is gone. No driver call.
    ///
    /// # Safety
    /// `addr` must hold `shape.elem_count()` elements of `dtype`, mapped with access on this
    /// device, for as long as the tracker is not unique (or, for a tensor that never leaves this
    /// crate, every kernel queued on it must touch mapped parts only); `dtype` should be
    /// supported ([`super::element_size`]; others are refused) and `ctx` must come from
    /// [`SliceFactory::take_context`] with no slice left on it.
    pub(crate) unsafe fn tensor(
        &self,
        ctx: Arc<CudaContext>,
        addr: u64,
        shape: Shape,
        dtype: DType,
    ) -> Result<(Tensor, Tracker)> {
        let elems = shape.elem_count();
        // SAFETY: the raw stream is the legacy stream (valid in every context) or the candle
        // device's own; every storage made here holds a clone of that device, and so does this
        // factory, which keeps the stream alive while the wrapper can be used.
        let stream = unsafe { ctx.wrap_borrowed_stream(raw_stream(self.stream)) };
        macro_rules! over {
            ($variant:ident) => {
                // SAFETY: the caller guarantees the memory (see above); the slice's failed
                // free on drop lands in the private context.
                CudaStorageSlice::$variant(unsafe { stream.upgrade_device_ptr(addr, elems) })
            };
        }
        let slice = match dtype {
            DType::U8 => over!(U8),
            DType::U32 => over!(U32),
            DType::I16 => over!(I16),
            DType::I32 => over!(I32),
            DType::I64 => over!(I64),
            DType::BF16 => over!(BF16),
            DType::F16 => over!(F16),
            DType::F32 => over!(F32),
            DType::F64 => over!(F64),
            DType::F8E4M3 => over!(F8E4M3),
            other => {
                self.put_back(ctx);
                return Err(super::unsupported_dtype(other));
            }
        };
        let storage = CudaStorage {
            slice,
            device: self.device.clone(),
        };
        let tensor = Tensor::from_storage(Storage::Cuda(storage), shape, BackpropOp::none(), false);
        Ok((tensor, Tracker { stream }))
    }
}

/// A raw stream handle as the driver's `CUstream` (a handle, not memory).
fn raw_stream(stream: u64) -> sys::CUstream {
    std::ptr::without_provenance_mut(stream as usize)
}

/// A point in the ordering stream; passed once the GPU has done everything queued before.
#[derive(Debug)]
pub(crate) struct Fence(CudaEvent);

/// Fences on one candle device's ordering stream, recorded through a context of our own (whose
/// error slot only these events use).
#[derive(Debug)]
pub(crate) struct Fences {
    /// Keeps the stream of `target` alive.
    _device: CudaDevice,
    target: Arc<CudaStream>,
    spare: Mutex<Vec<CudaEvent>>,
}

impl Fences {
    pub(crate) fn new(device: &CudaDevice, ordinal: usize) -> Result<Self> {
        let control = CudaContext::new(ordinal).map_err(cuda_error(
            "cuDevicePrimaryCtxRetain",
            format!("fence context on device {ordinal}"),
        ))?;
        // An event on the legacy stream comes after the work of every blocking stream, every
        // thread's per-thread stream included; a device's own stream gets its own events.
        let stream = ordering_stream(device_stream(device));
        // SAFETY: the legacy stream is valid in every context; a device's own stream is kept
        // alive by `_device`.
        let target = unsafe { control.wrap_borrowed_stream(raw_stream(stream)) };
        Ok(Fences {
            _device: device.clone(),
            target,
            spare: Mutex::new(Vec::new()),
        })
    }

    /// A fence after everything queued so far on the ordering stream. Never blocks.
    pub(crate) fn record(&self) -> Result<Fence> {
        let spare = self.spare.lock().pop();
        let event = match spare {
            Some(e) => e,
            None => self
                .target
                .context()
                .new_event(None)
                .map_err(cuda_error("cuEventCreate", "fence"))?,
        };
        match event.record(&self.target) {
            Ok(()) => Ok(Fence(event)),
            Err(e) => Err(cuda_error("cuEventRecord", "fence")(e)),
        }
    }

    /// Whether the GPU has passed `fence`, without blocking.
    pub(crate) fn is_passed(&self, fence: &Fence) -> Result<bool> {
        // The query needs the device's context current on this thread (cudarc's query does not
        // bind it); binding is a no-op when it is.
        self.target
            .context()
            .bind_to_thread()
            .map_err(cuda_error("cuCtxSetCurrent", "fence context"))?;
        fence
            .0
            .try_is_complete()
            .map_err(cuda_error("cuEventQuery", "fence"))
    }

    /// Block until the GPU has passed `fence`.
    pub(crate) fn wait(&self, fence: &Fence) -> Result<()> {
        fence
            .0
            .synchronize()
            .map_err(cuda_error("cuEventSynchronize", "fence"))
    }

    /// Keep a passed fence's event for the next one.
    pub(crate) fn recycle(&self, fence: Fence) {
        let mut spare = self.spare.lock();
        if spare.len() < MAX_SPARE_EVENTS {
            spare.push(fence.0);
            return;
        }
        drop(spare);
        // Destroying the event is a driver call: outside the lock.
        drop(fence);
    }

    /// Block until the GPU has done everything queued so far on the ordering stream.
    pub(crate) fn synchronize(&self) -> Result<()> {
        let fence = self.record()?;
        let waited = self.wait(&fence);
        self.recycle(fence);
        waited
    }
}

/// An orphan's last use on the GPU: fenced once (when no fence is pending), then settled.
/// True once the GPU has passed it (its fence recycled); `what` names the orphan in warnings.
pub(crate) fn last_use_passed(
    fences: &Fences,
    last_use: &mut VecDeque<Batch<(), Fence>>,
    wait: Wait,
    what: &'static str,
) -> bool {
    if last_use.is_empty() {
        let (batch, err) = Batch::fenced(fences, Vec::new(), 0);
        if let Some(e) = err {
            tracing::warn!(error = %e, what, "fencing an orphan failed; a later reap retries");
        }
        last_use.push_back(batch);
    }
    let settled = settle(fences, std::mem::take(last_use), wait);
    if let Some(e) = settled.error {
        tracing::warn!(error = %e, what, "checking an orphan's fence failed; its memory stays mapped for now");
    }
    let Some(done) = settled.passed.into_iter().next() else {
        *last_use = settled.waiting;
        return false;
    };
    if let Some(f) = done.fence {
        fences.recycle(f);
    }
    true
}

impl FenceSource for Fences {
    type Fence = Fence;

    fn record(&self) -> Result<Fence> {
        Fences::record(self)
    }

    fn is_passed(&self, fence: &Fence) -> Result<bool> {
        Fences::is_passed(self, fence)
    }

    fn wait(&self, fence: &Fence) -> Result<()> {
        Fences::wait(self, fence)
    }

    fn synchronize(&self) -> Result<()> {
        Fences::synchronize(self)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn per_thread_and_legacy_devices_are_ordered_by_the_legacy_stream() {
        assert_eq!(LEGACY_STREAM, 1, "CU_STREAM_LEGACY in cuda.h");
        assert_eq!(PER_THREAD_STREAM, 2, "CU_STREAM_PER_THREAD in cuda.h");
        for device in [0, LEGACY_STREAM, PER_THREAD_STREAM] {
            assert_eq!(ordering_stream(device), LEGACY_STREAM, "{device:#x}");
        }
    }

    #[test]
    fn a_backend_that_queues_no_gpu_work_is_refused_up_front() {
        use crate::backend::host::{HostBackend, DEFAULT_GRANULARITY};
        use crate::backend::testing::FaultInjector;

        let host: Arc<dyn Backend> = Arc::new(HostBackend::new(DEFAULT_GRANULARITY).unwrap());
        let wrapped: Arc<dyn Backend> = Arc::new(FaultInjector::new(host.clone()));
        for backend in [host, wrapped] {
            let queue = Queue {
                backend,
                stream: LEGACY_STREAM,
            };
            let err = queue.check_supported().unwrap_err();
            assert!(
                matches!(&err, Error::Backend { call: "copy_async", code, .. } if code == "UNSUPPORTED"),
                "{err}"
            );
            // SAFETY: zero bytes name no memory.
            let fill = unsafe { queue.zero(0, 0) }.unwrap_err();
            assert!(fill.to_string().contains("fill_async"), "{fill}");
        }
    }

    #[test]
    fn a_device_with_its_own_stream_is_ordered_by_that_stream() {
        for own in [0x5555_0000_1000, 0x7f00_dead_b000, 3] {
            assert_eq!(ordering_stream(own), own);
        }
    }
}
