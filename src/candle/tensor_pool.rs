//! Candle tensors allocated from a pool, with exact lifetime tracking and fenced give-back.

use std::collections::VecDeque;
use std::fmt;
use std::sync::Arc;

use candle_core::{DType, Device, DeviceLocation, Shape, Tensor};
use parking_lot::Mutex;

use super::orphans::{self, Orphan};
use super::retire::{settle, Batch, Wait};
use super::slices::{with_device_ptr, Fence, Fences, Queue, SliceFactory, Tracker};
use super::{candle_error, element_size};
use crate::backend::MemoryKind;
use crate::error::{Error, Result};
use crate::pool::{Allocation, Pool, RangePin, Region};

/// A collect runs on allocation once live tensors exceed twice the survivors of the last one
/// (plus this many), so its scan costs O(1) per allocation on average.
const COLLECT_SLACK_TENSORS: usize = 16;
/// ... or once live bytes exceed twice the survivors' bytes plus this much.
const COLLECT_SLACK_BYTES: u64 = 64 << 20;

/// Candle tensors in pool memory on one candle CUDA device. Cheap to clone (clones share
/// everything), `Send + Sync`, every method takes `&self`.
///
/// See the [module documentation](super) for who owns the memory, when it goes back, and how the
/// candle device is kept free of cudarc's failed frees.
///
/// ```no_run
/// # fn main() -> Result<(), Box<dyn std::error::Error>> {
/// use candle_core::{DType, Device};
/// use elastic_vmm::{candle::TensorPool, Pool};
///
/// let device = Device::new_cuda(0)?;
/// let pool = Pool::cuda(0, 64 << 30)?; // or a ModelHandle: `TensorPool::new(&model, ..)`
/// let tensors = TensorPool::new(&pool, &device)?;
/// let x = tensors.zeros((4, 1024), DType::F16)?; // an ordinary candle Tensor
/// let y = (x.to_dtype(DType::F32)? + 1.0)?;
/// drop(x); // its memory goes back at the next collect, once the GPU is past it
/// tensors.collect_blocking()?;
/// assert_eq!(tensors.stats().live_tensors, 0);
/// # drop(y); Ok(()) }
/// ```
#[derive(Clone)]
pub struct TensorPool {
    shared: Arc<Shared>,
}

struct Shared {
    pool: Pool,
    device: Device,
    ordinal: usize,
    slices: Arc<SliceFactory>,
    fences: Arc<Fences>,
    queue: Queue,
    state: Mutex<State>,
}

/// A tensor the pool handed out, and its memory.
struct Live {
    alloc: Held,
    tracker: Tracker,
    bytes: u64,
}

/// What keeps a live tensor's memory: its own allocation, or a pin on the range of a region it
/// views ([`TensorPool::view`]).
#[derive(Debug)]
enum Held {
    Alloc(#[allow(dead_code)] Allocation),
    Pinned(#[allow(dead_code)] RangePin),
}

/// Memory of dead tensors waiting for the GPU to pass a fence (one batch per collect that found
/// some).
type Retired = Batch<Held, Fence>;

/// Whether a collect looks for dead tensors or only checks the fences of those found before.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Scan {
    /// Scan the live tensors for dead ones.
    LiveTensors,
    /// Only check fences.
    FencesOnly,
}

#[derive(Default)]
struct State {
    live: Vec<Live>,
    live_bytes: u64,
    retired: VecDeque<Retired>,
    retired_tensors: usize,
    retired_bytes: u64,
    survivors: usize,
    survivor_bytes: u64,
    created: u64,
    returned: u64,
}

/// A snapshot of a [`TensorPool`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TensorPoolStats {
    /// Tensors handed out whose storage is still alive (as of the last collect).
    pub live_tensors: usize,
    /// Their bytes.
    pub live_bytes: u64,
    /// Dead tensors whose memory waits for the GPU to pass a fence.
    pub awaiting_gpu: usize,
    /// Their bytes.
    pub awaiting_gpu_bytes: u64,
    /// Tensors handed out so far.
    pub tensors_created: u64,
    /// Tensors whose memory went back to the pool so far.
    pub tensors_returned: u64,
    /// cudarc frees of pool memory that failed, as they must, in a private context and were
    /// absorbed there (one per dropped tensor or view); none reached the candle device.
    pub absorbed_free_errors: u64,
    /// Private CUDA context objects created (each is reused once its tensor is gone).
    pub private_contexts: u64,
}

/// What one collect did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CollectReport {
    /// Dead tensors found (their memory is now behind a fence, or back already).
    pub found_dead: usize,
    /// Tensors whose memory went back to the pool.
    pub returned: usize,
    /// Bytes that went back.
    pub returned_bytes: u64,
    /// Dead tensors whose memory still waits for the GPU.
    pub awaiting_gpu: usize,
}

impl fmt::Debug for TensorPool {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TensorPool")
            .field("pool", &self.shared.pool.name())
            .field("device", &self.shared.device)
            .field("stats", &self.snapshot())
            .finish()
    }
}

impl TensorPool {
    /// Tensors from `pool` (a [`Pool`], or a [`crate::ModelHandle`] through deref) on the candle
    /// CUDA device `device`. The pool must be a CUDA pool on the same GPU.
    pub fn new(pool: &Pool, device: &Device) -> Result<TensorPool> {
        let cuda = device.as_cuda_device().map_err(|_| {
            Error::InvalidArgument(format!(
                "candle tensors in pool memory need a CUDA device, got {:?}",
                device.location()
            ))
        })?;
        let ordinal = match device.location() {
            DeviceLocation::Cuda { gpu_id } => gpu_id,
            other => {
                return Err(Error::InvalidArgument(format!(
                    "candle device at {other:?} is not a CUDA device"
                )))
            }
        };
        let info = pool.backend_info();
        if info.memory_kind != MemoryKind::Device || info.device_ordinal != Some(ordinal as i32) {
            return Err(Error::InvalidArgument(format!(
                "pool {:?} holds {:?} memory of device {:?} ({} backend), the candle device is cuda:{ordinal}",
                pool.name(),
                info.memory_kind,
                info.device_ordinal,
                info.name
            )));
        }
        let queue = Queue::new(pool.backend().clone(), cuda);
        queue.check_supported()?;
        let fences = Arc::new(Fences::new(cuda, ordinal)?);
        tracing::debug!(
            pool = %pool.name(),
            ordinal,
            stream = format_args!("{:#x}", queue.stream()),
            "tensor pool ready"
        );
        Ok(TensorPool {
            shared: Arc::new(Shared {
                pool: pool.clone(),
                device: device.clone(),
                ordinal,
                slices: Arc::new(SliceFactory::new(cuda, ordinal)),
                fences,
                queue,
                state: Mutex::new(State::default()),
            }),
        })
    }

    /// The pool the memory comes from.
    pub fn pool(&self) -> &Pool {
        &self.shared.pool
    }

    /// The candle device the tensors live on.
    pub fn device(&self) -> &Device {
        &self.shared.device
    }

    /// The GPU's ordinal.
    pub fn ordinal(&self) -> usize {
        self.shared.ordinal
    }

    /// A contiguous tensor whose contents are unspecified (what was written to the memory last;
    /// see the crate's notes on zeroing). Any dtype in [`super::SUPPORTED_DTYPES`].
    pub fn empty(&self, shape: impl Into<Shape>, dtype: DType) -> Result<Tensor> {
        self.shared.allocate(shape.into(), dtype, Init::None)
    }

    /// A contiguous tensor of zeros (a fill queued on the device's ordering stream: in order
    /// with every kernel on the tensor, from any thread).
    pub fn zeros(&self, shape: impl Into<Shape>, dtype: DType) -> Result<Tensor> {
        self.shared.allocate(shape.into(), dtype, Init::Zero)
    }

    /// A pool tensor holding a copy of `src` (from any device; a host tensor goes to the GPU
    /// first). The bytes move with one device-to-device copy on the device's ordering stream,
    /// after every kernel queued before on the device by any thread (so `src` may have been
    /// computed by another thread), and every dtype works, including those candle 0.11 has no
    /// copy kernel for (`I16`, `I32`).
    pub fn copy_in(&self, src: &Tensor) -> Result<Tensor> {
        let src = src
            .to_device(&self.shared.device)
            .and_then(|t| t.contiguous())
            .map_err(candle_error("to_device"))?;
        self.shared
            .allocate(src.shape().clone(), src.dtype(), Init::CopyOf(&src))
    }

    /// A contiguous tensor of `shape` and `dtype` over the bytes at `at` of `region` (of this
    /// tensor pool's pool, mapped there), with no copy: how weights kept under a lease
    /// ([`crate::broker::BrokerClient::attach`]) become candle tensors again. The range stays
    /// pinned against unmapping until the tensor and every view of it are gone and the GPU is
    /// past the kernels queued on them (as for [`TensorPool::empty`]); a [`Region::unmap`] of
    /// it meanwhile is refused, and a [`Pool::sleep`] of the pool waits for it. `at` must be a
    /// multiple of the element size.
    pub fn view(
        &self,
        region: &Region,
        at: u64,
        shape: impl Into<Shape>,
        dtype: DType,
    ) -> Result<Tensor> {
        let shape = shape.into();
        let elem = element_size(dtype)?;
        let bytes = (shape.elem_count() as u64)
            .checked_mul(elem as u64)
            .ok_or_else(|| Error::SizeOverflow {
                what: "tensor bytes",
                detail: format!("{shape:?} of {dtype:?}"),
            })?;
        if !Arc::ptr_eq(region.pool().inner(), self.shared.pool.inner()) {
            return Err(Error::InvalidArgument(
                "a tensor view of a region of another pool than the tensor pool's".into(),
            ));
        }
        let len = bytes.max(elem as u64);
        match at.checked_add(len) {
            Some(end) if end <= region.len() && at % elem as u64 == 0 => {}
            _ => {
                return Err(Error::InvalidArgument(format!(
                    "a view of {bytes} bytes ({shape:?} of {dtype:?}) at {at} of a region of {} bytes (offsets are multiples of {elem})",
                    region.len()
                )))
            }
        }
        // Pinned first: mapped now, it stays mapped while the pin lives.
        let pin = self.shared.pool.pin_range(region.offset() + at, len)?;
        let ctx = self.shared.slices.take_context()?;
        // SAFETY: `len >= bytes` bytes at this address are mapped with access on this device
        // (the pin refused otherwise) and stay mapped until the pin, kept in the live list below
        // and then behind a fence, goes; `dtype` was checked.
        let (tensor, tracker) = unsafe {
            self.shared
                .slices
                .tensor(ctx, region.addr() + at, shape, dtype)?
        };
        let mut st = self.shared.state.lock();
        st.live.push(Live {
            alloc: Held::Pinned(pin),
            tracker,
            bytes,
        });
        st.live_bytes += bytes;
        st.created += 1;
        Ok(tensor)
    }

    /// Find the tensors that are gone, put their memory behind a fence on the device's ordering
    /// stream, and give back the memory whose fence the GPU has passed; the same for the
    /// remains of dropped tensor pools and elastic tensors ([`super::reap_orphans`]). Never
    /// waits for the GPU: fences are recorded and queried, never waited for, so memory that a
    /// kernel in flight may still use goes back at a later collect.
    pub fn collect(&self) -> Result<CollectReport> {
        self.shared.collect(Wait::Poll)
    }

    /// As [`TensorPool::collect`], and wait for the GPU to pass every fence (those of dropped
    /// tensor pools and elastic tensors too, [`super::reap_orphans_blocking`]): afterwards the
    /// memory of every tensor dropped before the call is the pool's again (except what another
    /// thread's collect, running at the same moment, has in hand: that one gives it back).
    pub fn collect_blocking(&self) -> Result<CollectReport> {
        self.shared.collect(Wait::Block)
    }

    /// A snapshot, taken after a non-blocking [`TensorPool::collect`] so that the numbers are
    /// current (a failing collect is logged, the snapshot still returned).
    pub fn stats(&self) -> TensorPoolStats {
        if let Err(e) = self.shared.collect(Wait::Poll) {
            tracing::warn!(error = %e, "collect before stats failed");
        }
        self.snapshot()
    }

    fn snapshot(&self) -> TensorPoolStats {
        let st = self.shared.state.lock();
        TensorPoolStats {
            live_tensors: st.live.len(),
            live_bytes: st.live_bytes,
            awaiting_gpu: st.retired_tensors,
            awaiting_gpu_bytes: st.retired_bytes,
            tensors_created: st.created,
            tensors_returned: st.returned,
            absorbed_free_errors: self.shared.slices.absorbed(),
            private_contexts: self.shared.slices.contexts_created(),
        }
    }

    pub(crate) fn slices(&self) -> &Arc<SliceFactory> {
        &self.shared.slices
    }

    pub(crate) fn fences(&self) -> &Arc<Fences> {
        &self.shared.fences
    }

    pub(crate) fn queue(&self) -> &Queue {
        &self.shared.queue
    }
}

/// What a new pool tensor holds.
enum Init<'a> {
    /// Whatever the memory held.
    None,
    /// Zeros.
    Zero,
    /// A copy of a contiguous tensor of the same shape and dtype on the pool's device.
    CopyOf(&'a Tensor),
}

impl Shared {
    fn allocate(&self, shape: Shape, dtype: DType, init: Init<'_>) -> Result<Tensor> {
        let elem = element_size(dtype)?;
        let bytes = shape
            .elem_count()
            .checked_mul(elem)
            .ok_or_else(|| Error::SizeOverflow {
                what: "tensor bytes",
                detail: format!("{shape:?} of {dtype:?}"),
            })?;
        if let Some(scan) = self.collect_due() {
            orphans::reap(Wait::Poll);
            self.collect_with(Wait::Poll, scan)?;
        }
        // An empty tensor still gets an address of its own.
        let want = bytes.max(elem);
        let alloc = match self.pool.allocate(want) {
            Ok(a) => a,
            Err(e) if e.is_out_of_memory() || matches!(e, Error::OutOfAddressSpace { .. }) => {
                // Dead tensors may hold what is missing (memory, or address space when tensors
                // die faster than the GPU passes their fences): give it back, try once more.
                let report = self.collect(Wait::Block)?;
                if report.returned == 0 {
                    return Err(e);
                }
                self.pool.allocate(want)?
            }
            Err(e) => return Err(e),
        };
        let ctx = self.slices.take_context()?;
        let addr = alloc.addr();
        // SAFETY: the allocation holds `want >= bytes` mapped bytes of this device's pool; it
        // stays in the live list below until the tracker is unique (every slice gone) and then
        // behind a fence until the GPU is past every kernel queued before; `dtype` was checked.
        let (tensor, tracker) = unsafe { self.slices.tensor(ctx, addr, shape, dtype)? };
        let zeroed = match init {
            Init::None => Ok(()),
            // SAFETY: `addr..addr + bytes` is the new tensor's mapped memory, kept until a fence
            // recorded on the ordering stream after this fill has passed; no one else has it yet.
            Init::Zero => unsafe { self.queue.zero(addr, bytes) },
            Init::CopyOf(src) if bytes > 0 => with_device_ptr(src, |from| {
                // SAFETY: the destination as above; `src` is a live contiguous tensor of the
                // same device, shape and dtype, held until the copy is queued and freed by
                // candle only in stream order after it (a different allocation: no overlap).
                unsafe { self.queue.copy(addr, from, bytes) }
            }),
            Init::CopyOf(_) => Ok(()),
        };
        {
            let mut st = self.state.lock();
            st.live.push(Live {
                alloc: Held::Alloc(alloc),
                tracker,
                bytes: bytes as u64,
            });
            st.live_bytes += bytes as u64;
            st.created += 1;
        }
        // On failure the tensor is dropped and its memory goes back through the next collect.
        zeroed.map(|()| tensor)
    }

    /// Whether an allocation should collect first: a scan when the live list's size or bytes
    /// doubled since the last one (O(1) per allocation on average), else a check of pending
    /// fences (in order, so that costs one query while the GPU is behind).
    fn collect_due(&self) -> Option<Scan> {
        let st = self.state.lock();
        if st.live.len() > 2 * st.survivors + COLLECT_SLACK_TENSORS
            || st.live_bytes > 2 * st.survivor_bytes + COLLECT_SLACK_BYTES
        {
            Some(Scan::LiveTensors)
        } else if !st.retired.is_empty() {
            Some(Scan::FencesOnly)
        } else {
            None
        }
    }

    /// Reap the remains of dropped owners, then collect this pool's dead tensors.
    fn collect(&self, wait: Wait) -> Result<CollectReport> {
        orphans::reap(wait);
        self.collect_with(wait, Scan::LiveTensors)
    }

    /// Scan for dead tensors (with [`Scan::LiveTensors`]), fence them, give back what the GPU
    /// has passed (all of it, waiting, with [`Wait::Block`]).
    fn collect_with(&self, wait: Wait, scan: Scan) -> Result<CollectReport> {
        let mut absorbed = 0;
        let dead: Vec<Live> = if scan == Scan::FencesOnly {
            Vec::new()
        } else {
            let mut st = self.state.lock();
            let mut dead = Vec::new();
            let mut i = 0;
            while i < st.live.len() {
                if st.live[i].tracker.is_unique() {
                    let d = st.live.swap_remove(i);
                    st.live_bytes -= d.bytes;
                    dead.push(d);
                } else {
                    absorbed += u64::from(st.live[i].tracker.absorb_copy_error());
                    i += 1;
                }
            }
            st.survivors = st.live.len();
            st.survivor_bytes = st.live_bytes;
            dead
        };
        self.slices.count_absorbed(absorbed);
        let found_dead = dead.len();
        let mut first_err = None;
        let mut batches = {
            let mut st = self.state.lock();
            st.retired_tensors = 0;
            st.retired_bytes = 0;
            std::mem::take(&mut st.retired)
        };
        if !dead.is_empty() {
            let mut allocs = Vec::with_capacity(dead.len());
            let mut bytes = 0;
            for d in dead {
                bytes += d.bytes;
                allocs.push(d.alloc);
                self.slices.retire(d.tracker);
            }
            // The fence comes after every kernel queued on these tensors before they died.
            let (batch, err) = Batch::fenced(&*self.fences, allocs, bytes);
            first_err = err;
            batches.push_back(batch);
        }
        let settled = settle(&*self.fences, batches, wait);
        if let Some(e) = settled.error {
            first_err.get_or_insert(e);
        }
        let done = settled.passed;
        let returned: usize = done.iter().map(|b| b.items.len()).sum();
        let returned_bytes: u64 = done.iter().map(|b| b.bytes).sum();
        let awaiting_gpu = {
            let mut st = self.state.lock();
            // Batches retired meanwhile by another thread are newer: ours go in front.
            for b in settled.waiting.into_iter().rev() {
                st.retired.push_front(b);
            }
            st.retired_tensors = st.retired.iter().map(|b| b.items.len()).sum();
            st.retired_bytes = st.retired.iter().map(|b| b.bytes).sum();
            st.returned += returned as u64;
            st.retired_tensors
        };
        for b in done {
            if let Some(f) = b.fence {
                self.fences.recycle(f);
            }
            // Memory back to the pool, outside our lock.
            drop(b.items);
        }
        if returned > 0 || found_dead > 0 {
            tracing::trace!(
                found_dead,
                returned,
                returned_bytes,
                awaiting_gpu,
                "tensor pool collected"
            );
        }
        match first_err {
            Some(e) => Err(e),
            None => Ok(CollectReport {
                found_dead,
                returned,
                returned_bytes,
                awaiting_gpu,
            }),
        }
    }
}

impl Drop for Shared {
    fn drop(&mut self) {
        // Dropping the last handle waits for the GPU (as dropping an elastic tensor does); no
        // collect or reap drops one, since elastic tensors hold only the parts they use.
        if let Err(e) = self.collect_with(Wait::Block, Scan::LiveTensors) {
            tracing::error!(error = %e, "collecting at tensor pool drop failed");
        }
        let st = self.state.get_mut();
        let live = std::mem::take(&mut st.live);
        let retired = std::mem::take(&mut st.retired);
        if live.is_empty() && retired.is_empty() {
            return;
        }
        let bytes: u64 = live.iter().map(|l| l.bytes).sum();
        tracing::warn!(
            pool = %self.pool.name(),
            live_tensors = live.len(),
            bytes,
            "tensor pool dropped while tensors still use its memory; it goes back once they are dropped (see elastic_vmm::candle::reap_orphans)"
        );
        orphans::adopt(Box::new(OrphanTensors {
            live,
            retired,
            fences: self.fences.clone(),
        }));
    }
}

/// The remains of a dropped [`TensorPool`] whose tensors still live.
struct OrphanTensors {
    live: Vec<Live>,
    retired: VecDeque<Retired>,
    fences: Arc<Fences>,
}

impl Orphan for OrphanTensors {
    fn reap(&mut self, wait: Wait) -> bool {
        let mut dead = Vec::new();
        let mut i = 0;
        while i < self.live.len() {
            if self.live[i].tracker.is_unique() {
                dead.push(self.live.swap_remove(i));
            } else {
                self.live[i].tracker.absorb_copy_error();
                i += 1;
            }
        }
        if !dead.is_empty() {
            let bytes = dead.iter().map(|d| d.bytes).sum();
            // Their private contexts go with the trackers; the memory waits for a fence.
            let allocs = dead.into_iter().map(|d| d.alloc).collect();
            let (batch, err) = Batch::fenced(&*self.fences, allocs, bytes);
            if let Some(e) = err {
                tracing::warn!(error = %e, "fencing orphaned tensors failed; a later reap retries");
            }
            self.retired.push_back(batch);
        }
        let settled = settle(&*self.fences, std::mem::take(&mut self.retired), wait);
        self.retired = settled.waiting;
        if let Some(e) = settled.error {
            tracing::warn!(error = %e, "checking fences of orphaned tensors failed; their memory stays mapped for now");
        }
        for b in settled.passed {
            if let Some(f) = b.fence {
                self.fences.recycle(f);
            }
            // The memory goes back to its pool.
            drop(b.items);
        }
        self.live.is_empty() && self.retired.is_empty()
    }
}
