//! Candle tensors in elastic memory (feature `candle`).
//!
//! - [`TensorPool`]: candle [`Tensor`]s of any dtype candle's CUDA backend stores, allocated from
//!   a [`Pool`](crate::Pool) (or a [`ModelHandle`](crate::ModelHandle), which derefs to one) on a
//!   candle CUDA device: [`TensorPool::empty`], [`TensorPool::zeros`], [`TensorPool::copy_in`].
//! - [`ElasticKv`]: one tensor shaped for a model's largest KV cache (`[max_blocks, ...block]`)
//!   whose blocks have physical memory only while they are backed
//!   ([`ElasticKv::ensure_backed`], [`ElasticKv::release`]); kernels reach it only through views
//!   and operations that refuse unbacked blocks.
//!
//! # Who owns the memory, and when it goes back
//! A pool tensor's memory is an [`Allocation`](crate::Allocation) held by its [`TensorPool`],
//! not by the tensor. The pool knows exactly when the tensor and every tensor sharing its storage
//! (clones, `narrow`, `reshape`, `i(..)` views...) are gone: each tensor's cudarc slice holds a
//! handle of its own that the pool also keeps, and the pool's copy becomes the only one when the
//! storage is dropped. The memory then goes back to the pool **lazily**, in two steps:
//! 1. at the next [`TensorPool::collect`] (which [`TensorPool::empty`]/[`TensorPool::zeros`] run
//!    when the number or bytes of live tensors has doubled since the last one, when the pool is
//!    out of memory, and which [`TensorPool::stats`] runs), the dead tensors' memory is put behind
//!    a *fence*: a CUDA event recorded on the device's ordering stream (see below), so after
//!    every kernel any thread queued on the device before;
//! 2. once the GPU has passed that fence (checked without blocking by every later collect, or
//!    waited for by [`TensorPool::collect_blocking`]), the allocation is dropped and the memory
//!    is the pool's again (idle, reused without a driver call, or given back by `trim`).
//!
//! Memory never goes back while a kernel queued before the drop could still use it, and a
//! collect never waits for such a kernel to finish.
//!
//! # The user's candle device is never poisoned
//! cudarc frees a slice on drop with `cuMemFreeAsync` and stores a failure as the sticky error
//! of the slice's `CudaContext` object, which candle would then return from an unrelated
//! operation. On VMM memory that free always fails (`CUDA_ERROR_INVALID_VALUE`, harmless to the
//! mapping). Each slice made here therefore belongs to a *private* `CudaContext` object (a
//! separate error slot over the same primary context, recycled after the slice is gone) and the
//! failed free lands there; the pool absorbs and counts it
//! ([`TensorPoolStats::absorbed_free_errors`]). The slice's stream is the device's ordering
//! stream (see below), so what cudarc queues through it stays in order with candle's kernels.
//!
//! One case is not fully contained: `Tensor::copy()` of a pool tensor or a view makes an
//! ordinary candle allocation whose slice shares the original's private context (cudarc copies
//! the stream handle). The copy keeps the original's pool memory from going back until the copy
//! is dropped too (never early), and if the original is dropped first, the copy's next host read
//! or `copy()` can fail once with `CUDA_ERROR_INVALID_VALUE` unless a pool operation (any
//! allocation, view, `collect`, `stats`, `release`) ran in between and absorbed the error. Use
//! [`detached_copy`] to copy a pool tensor into candle's own memory without that link.
//!
//! # Ordering: which stream our work goes on
//! candle 0.11's `Device::new_cuda(ordinal)` launches every kernel on the *per-thread default
//! stream* of the thread that runs the operation (`CudaContext::per_thread_stream`, handle
//! `CU_STREAM_PER_THREAD`), so kernels that two threads launch on one candle device are on two
//! streams. `Device::new_cuda_with_stream` gives the device one non-blocking stream of its own,
//! which every thread launches on. Everything this module queues itself goes on the device's
//! **ordering stream**, chosen so that it is in order with every kernel of the device, whatever
//! thread queued which:
//! - for a per-thread (or legacy) stream device: CUDA's **legacy default stream**
//!   (`CU_STREAM_LEGACY`), which waits for all work queued before on every blocking stream of
//!   the context (every thread's per-thread stream is one) and which all of them wait for in
//!   turn;
//! - for a device with a stream of its own: that stream.
//!
//! What goes there: the copies of [`TensorPool::copy_in`], [`ElasticKv::write`],
//! [`ElasticKv::write_blocks`] and [`detached_copy`], the fill of [`TensorPool::zeros`] (all
//! queued through the pool's [`crate::backend::Copies::copy_async`] and
//! [`crate::backend::Copies::fill_async`]), the fences that decide when memory goes back, and
//! what cudarc does through a pool tensor's own slice (host reads, `Tensor::copy`). So a tensor
//! computed by one thread can be copied into the pool by another, and a pool tensor zeroed or
//! written by one thread can be read by kernels of another, with no synchronisation of the
//! user's: the order is the order in which the threads queued the work. Kernels on streams the
//! device does not launch on (the user's own streams, another candle device's stream) are not
//! ordered: synchronize with those first, as with candle's own tensors.
//!
//! Pool tensors carry no cudarc events. Moving one to another candle device on the same GPU
//! created with a different stream (`to_device`) needs a `synchronize` of the source device
//! first.
//!
//! # What waits for the GPU
//! [`TensorPool::collect`], [`TensorPool::stats`], [`reap_orphans`] and the collects that
//! allocations run never do: they record and query fences only. [`TensorPool::collect_blocking`],
//! [`reap_orphans_blocking`], [`ElasticKv::release`], an allocation that ran out of memory (it
//! collects blocking once before it gives up), and dropping the last handle of a
//! [`TensorPool`] or an [`ElasticKv`] with no live views do.

mod attention;
mod kv;
mod kv_write;
mod operands;
mod orphans;
mod paged;
mod prefill;
mod retire;
mod slices;
mod tensor_pool;

pub use attention::{paged_attention_decode, paged_attention_decode_shaped};
pub use kv::{ElasticKv, KvStats};
pub use kv_write::paged_kv_write;
pub use orphans::{reap_orphans, reap_orphans_blocking};
pub use paged::{BlockShape, PagedKvTensors};
pub use prefill::{
    paged_attention_prefill, paged_attention_prefill_shaped, paged_prefill_supported, PrefillPiece,
};
pub use tensor_pool::{CollectReport, TensorPool, TensorPoolStats};

use candle_core::{DType, Tensor};

use crate::error::{Error, Result};

/// The dtypes candle's CUDA backend can store (candle refuses the others on CUDA).
pub const SUPPORTED_DTYPES: [DType; 10] = [
    DType::U8,
    DType::U32,
    DType::I16,
    DType::I32,
    DType::I64,
    DType::BF16,
    DType::F16,
    DType::F32,
    DType::F64,
    DType::F8E4M3,
];

/// Bytes per element of `dtype`, or an error for a dtype candle cannot store on CUDA.
pub(crate) fn element_size(dtype: DType) -> Result<usize> {
    if SUPPORTED_DTYPES.contains(&dtype) {
        Ok(dtype.size_in_bytes())
    } else {
        Err(unsupported_dtype(dtype))
    }
}

pub(crate) fn unsupported_dtype(dtype: DType) -> Error {
    Error::InvalidArgument(format!(
        "dtype {dtype:?} has no CUDA storage in candle; supported: {SUPPORTED_DTYPES:?}"
    ))
}

/// A candle failure as this crate's error.
pub(crate) fn candle_error(op: &'static str) -> impl FnOnce(candle_core::Error) -> Error {
    move |e| Error::Candle {
        op,
        message: e.to_string(),
    }
}

impl From<Error> for candle_core::Error {
    /// So that code returning `candle_core::Result` can use `?` on this crate's calls.
    fn from(e: Error) -> Self {
        candle_core::Error::wrap(e)
    }
}

/// A copy of `tensor` in candle's own memory on `tensors`' candle device (a tensor on another
/// device is moved there first), made by candle's allocator and one device-to-device copy on
/// the device's ordering stream through the pool's backend: unlike `Tensor::copy()`, the result
/// has no link to the pool (see the module documentation). Every dtype works.
pub fn detached_copy(tensors: &TensorPool, tensor: &Tensor) -> Result<Tensor> {
    let device = tensors.device();
    let src = tensor
        .to_device(device)
        .and_then(|t| t.contiguous())
        .map_err(candle_error("to_device"))?;
    // SAFETY: candle's `empty` leaves the contents unset; every byte is written by the copy
    // below, queued before the tensor is returned and before any kernel the caller queues.
    let out = unsafe { Tensor::empty(src.shape(), src.dtype(), device) }
        .map_err(candle_error("empty"))?;
    let bytes = src.elem_count() * src.dtype().size_in_bytes();
    if bytes > 0 {
        slices::with_device_ptr(&src, |from| {
            slices::with_device_ptr(&out, |to| {
                // SAFETY: both are live contiguous tensors of `bytes` bytes on this device, held
                // until the copy is queued and freed only in stream order after it; `out` is a
                // fresh allocation, so they do not overlap; their other users are candle
                // kernels of the device, which the ordering stream is in order with.
                unsafe { tensors.queue().copy(to, from, bytes) }
            })
        })?;
    }
    Ok(out)
}
