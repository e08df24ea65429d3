//! Routing: every CUDA allocation a thread makes (candle's included) in a model's pool.
//!
//! candle allocates device memory through cudarc, and cudarc (linked the way candle links it)
//! calls the driver's `cuMemAllocAsync`, `cuMemFreeAsync`, `cuMemAlloc_v2` and `cuMemFree_v2`
//! as ordinary symbols. [`route_cuda_allocations!`](crate::route_cuda_allocations), invoked once
//! in the application's binary crate (like `#[global_allocator]`), defines those entry points
//! (and `cuStreamBeginCapture_v2`, `cuStreamEndCapture`, `cuStreamDestroy_v2`, which routing
//! needs to know about) in the binary, so the linker binds cudarc's calls to them. Each one then
//! decides:
//! - inside a [`route`] (a guard; [`with_route`] is the closure form) on the calling thread,
//!   to a pool on the device of the thread's current CUDA context, the allocation comes from
//!   that pool (a [`Pool`] or a [`crate::ModelHandle`], so under the model's limit, with
//!   donation from idle models and reclaim as for any growth) and is counted under the route's
//!   [`Tag`]; routes nest, the innermost one for the device wins;
//! - outside any route, the [`DefaultRoute`] decides: the driver (the default), or a pool;
//! - a free of a routed block goes back to routing whichever thread frees it; a free of any
//!   other pointer goes to the driver.
//!
//! A binary that does not invoke the macro behaves exactly as before, and [`route`] there
//! returns [`Error::RoutingNotInstalled`]. The driver's own functions are looked up in
//! `libcuda` by name, so routing's calls (and elastic-vmm's own) never recurse into the hooks.
//!
//! # Stream order, as `cuMemFreeAsync` defines it
//! A block freed on stream S is reusable at once by later allocations on S (stream order keeps
//! the new user behind the old one), and by other streams only after an event recorded on S at
//! or after the free has completed. Routing keeps freed blocks per stream and size class
//! (eight classes per power of two below 1 MiB, 64 above) and serves later allocations on the same stream from them
//! without touching the pool or the driver. When a model's freed blocks pass
//! [`DEFAULT_STREAM_CACHE`] bytes (see [`set_stream_cache_limit`]), or it runs out of memory,
//! or on [`flush`], they are *fenced*: one event per stream, and they go back to the pool,
//! where any stream may get them, once the GPU has passed it. Fences are polled (never waited
//! for) by later routed allocations; an out-of-memory retry and [`flush`] wait. `CU_STREAM_PER_THREAD`
//! is a different stream on every thread and is keyed by thread; a fence for another thread's
//! per-thread stream is recorded on the legacy stream, which follows every blocking stream.
//! Before a stream is destroyed, the blocks freed on it are fenced (or, where no event can be
//! recorded, the stream is synchronized). When the cache passes its limit every stream's
//! blocks are fenced, so blocks of exited threads and idle streams do not linger.
//!
//! The freed blocks are the pool's *front cache* (the pool's `FrontCache` trait, which
//! routing's per-pool target implements and registers with its pool), so the pool's state
//! governs them: they are kept and served only while the pool is awake and open; a sleep and a
//! close give them back first, and meanwhile a free goes back behind its fence. The pool, the
//! shared pool and the broker count them as idle memory: trim, donation, reclaim and limit
//! changes flush them first (waiting for their fences, so under memory pressure an allocation
//! of one model may wait for another model's queued kernels up to its frees).
//!
//! A synchronous free (`cuMemFree_v2`) waits as the driver's does, for the whole device (a
//! non-blocking stream is not ordered after the legacy one); then the block is the pool's.
//!
//! # CUDA graphs
//! Routing counts stream captures. An allocation on a stream being captured comes from the
//! route's pool like any other, but never from memory freed before (stream-order reuse does not
//! extend to graph launches), and such a block is never reused: a graph uses the same
//! addresses at every launch, for as long as it lives. Its free, and the free of any routed
//! block on a capturing stream, *parks* the block: it stays charged to the model and counted
//! in [`RouteStats::parked_bytes`] until [`release_captured`] (unsafe: the caller vouches the
//! graphs that use it are gone). While any capture is in progress routing queries no event and
//! touches no legacy stream and no capturing stream, so a capture in global mode is not
//! disturbed. Only captures begun through the hooked `cuStreamBeginCapture_v2` are seen (as
//! cudarc and candle begin them); a capture begun through the runtime API or a pointer from
//! `cuGetProcAddress` is not, and routing inside one is unsupported.
//!
//! # Out of memory
//! At the model's limit (after its freed blocks went back to its pool and the shared pool's
//! donation and reclaim ran) the hook returns `CUDA_ERROR_OUT_OF_MEMORY`, so candle reports an
//! error and nothing is held. The full [`Refusal`] (model, tag, asked, use, the pool's error
//! with limit and use) is kept: [`last_refusal`] on the thread that asked, and
//! [`RouteStats::last_refusal`].
//!
//! # Frees never fail
//! A routed block's free only moves bookkeeping, so cudarc never stores a failed free as its
//! context's sticky error: no candle device is poisoned.
//!
//! # Relation to `candle::TensorPool` and `candle::ElasticKv`
//! Those make pool memory *look like* candle tensors (their own cudarc slices over pool
//! allocations) and work in any binary; routing makes candle's *own* allocations come from a
//! pool, so every tensor of a model (weights, activations, caches grown with `Tensor::cat`) is
//! pool memory with no special constructor. Underneath both are the same [`Pool`] allocations,
//! under the same limit and in the same stats ([`crate::Pool::stats`]); routing adds per-tag
//! counts. Prefer routing where the binary can invoke the macro; `ElasticKv` remains the way to
//! an elastic KV tensor whose blocks are backed on demand.

mod fence;
#[doc(hidden)]
pub mod hooks;
mod stack;
mod stats;
mod table;
mod target;

use std::sync::atomic::Ordering;

pub use stack::{RouteGuard, DEFAULT_STREAM_CACHE};
pub use stats::{LiveBlock, Refusal, Report, RouteStats, TagStats};
pub use target::Place;

use crate::error::{Error, Result};
use crate::{Pool, Tag};
use target::Wait;

/// Where allocations made outside any route go.
#[derive(Debug, Clone, Default)]
pub enum DefaultRoute {
    /// To the driver, as without routing.
    #[default]
    Driver,
    /// To this pool, under this tag (allocations on other devices still go to the driver).
    Pool(Pool, Tag),
}

fn check_installed() -> Result<()> {
    if hooks::installed() {
        Ok(())
    } else {
        Err(Error::RoutingNotInstalled)
    }
}

/// Route the calling thread's CUDA allocations on `pool`'s device to `pool`, under `tag`, until
/// the guard is dropped. Routes nest: the innermost one for a device wins.
pub fn route(pool: &Pool, tag: impl Into<Tag>) -> Result<RouteGuard> {
    check_installed()?;
    Ok(stack::push(stack::new_entry(pool, tag.into())))
}

/// Run `f` with the calling thread's CUDA allocations routed to `pool` under `tag`.
pub fn with_route<R>(pool: &Pool, tag: impl Into<Tag>, f: impl FnOnce() -> R) -> Result<R> {
    let _guard = route(pool, tag)?;
    Ok(f())
}

/// Set where allocations outside any route go (for every thread).
pub fn set_default(default: DefaultRoute) -> Result<()> {
    match default {
        DefaultRoute::Driver => stack::set_default(None),
        DefaultRoute::Pool(pool, tag) => {
            check_installed()?;
            stack::set_default(Some(stack::new_entry(&pool, tag)));
        }
    }
    Ok(())
}

/// Whether this binary invoked [`route_cuda_allocations!`](crate::route_cuda_allocations).
pub fn is_installed() -> bool {
    hooks::installed()
}

/// Routing's counters for `pool` (`None` if nothing was ever routed to it).
pub fn stats(pool: &Pool) -> Option<RouteStats> {
    stack::existing_target(pool).map(|t| {
        let mut s = t.stats();
        s.driver_calls = pool.driver_call_total().saturating_add(s.fences);
        s
    })
}

/// The `n` largest live routed allocations of `pool`, with totals.
pub fn report(pool: &Pool, n: usize) -> Option<Report> {
    let t = stack::existing_target(pool)?;
    let (live_blocks, live_bytes, largest) = table::largest(&t, n);
    Some(Report {
        model: t.name.to_string(),
        live_blocks,
        live_bytes,
        largest,
    })
}

/// The last refusal of a routed allocation on this thread, taken (the next call returns `None`
/// until another refusal).
pub fn last_refusal() -> Option<Refusal> {
    hooks::LAST_REFUSAL
        .try_with(|l| l.borrow_mut().take())
        .ok()
        .flatten()
}

/// Give `pool`'s freed blocks (kept for same-stream reuse) back to the pool, waiting for the
/// GPU to pass a fence on each stream they were freed on. During a capture, fences that need
/// the GPU stay pending and go back later.
pub fn flush(pool: &Pool) {
    if let Some(t) = stack::existing_target(pool) {
        t.flush(Wait::Yes);
    }
}

/// Set how many bytes of freed blocks `pool` keeps for same-stream reuse before fencing them
/// back (default [`DEFAULT_STREAM_CACHE`]; 0 fences every free at once).
pub fn set_stream_cache_limit(pool: &Pool, bytes: u64) {
    stack::target_of(pool).set_cache_limit(bytes);
}

/// Give back to `pool` the blocks parked for CUDA graphs; returns their bytes.
///
/// # Safety
/// Every graph (and graph exec) captured while routing to `pool` that may use them is
/// destroyed, and no launch of one is still running.
pub unsafe fn release_captured(pool: &Pool) -> u64 {
    stack::existing_target(pool).map_or(0, |t| t.release_parked())
}

/// Whether `addr` is the start of a live routed allocation.
pub fn is_routed(addr: u64) -> bool {
    hooks::is_routed(addr)
}

/// What the hooks passed to the driver: allocations outside any route and frees of memory
/// routing does not own.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ForwardedStats {
    /// Successful allocations the driver made.
    pub allocations: u64,
    /// Their bytes.
    pub bytes: u64,
    /// Frees of memory routing does not own, passed to the driver.
    pub frees: u64,
    /// Fences recorded by routing, process-wide (CUDA event records).
    pub fences: u64,
}

/// The hooks' forwarding counters since the process started.
pub fn forwarded_stats() -> ForwardedStats {
    ForwardedStats {
        allocations: hooks::FORWARDED_ALLOCATIONS.load(Ordering::Relaxed),
        bytes: hooks::FORWARDED_BYTES.load(Ordering::Relaxed),
        frees: hooks::FORWARDED_FREES.load(Ordering::Relaxed),
        fences: fence::FENCE_RECORDS.load(Ordering::Relaxed),
    }
}

/// Define, in this binary, the CUDA driver entry points through which cudarc (and so candle)
/// allocates and frees device memory, routing them as [`route`](crate::route) describes.
/// Invoke once, at the top level of the binary crate (an application's `main.rs`, a test or
/// bench target's root). Linux only.
#[macro_export]
macro_rules! route_cuda_allocations {
    () => {
        const _: () = {
            use $crate::route::hooks as __h;

            #[no_mangle]
            unsafe extern "C" fn cuMemAllocAsync(
                dptr: *mut __h::CUdeviceptr,
                bytesize: usize,
                stream: __h::CUstream,
            ) -> __h::CUresult {
                // SAFETY: the caller's contract is the driver's, which the hook keeps.
                unsafe { __h::mem_alloc_async(dptr, bytesize, stream) }
            }

            #[no_mangle]
            unsafe extern "C" fn cuMemFreeAsync(
                dptr: __h::CUdeviceptr,
                stream: __h::CUstream,
            ) -> __h::CUresult {
                // SAFETY: as above.
                unsafe { __h::mem_free_async(dptr, stream) }
            }

            #[no_mangle]
            unsafe extern "C" fn cuMemAlloc_v2(
                dptr: *mut __h::CUdeviceptr,
                bytesize: usize,
            ) -> __h::CUresult {
                // SAFETY: as above.
                unsafe { __h::mem_alloc(dptr, bytesize) }
            }

            #[no_mangle]
            unsafe extern "C" fn cuMemFree_v2(dptr: __h::CUdeviceptr) -> __h::CUresult {
                // SAFETY: as above.
                unsafe { __h::mem_free(dptr) }
            }

            #[no_mangle]
            unsafe extern "C" fn cuStreamBeginCapture_v2(
                stream: __h::CUstream,
                mode: __h::CUstreamCaptureMode,
            ) -> __h::CUresult {
                // SAFETY: as above.
                unsafe { __h::stream_begin_capture(stream, mode) }
            }

            #[no_mangle]
            unsafe extern "C" fn cuStreamEndCapture(
                stream: __h::CUstream,
                graph: *mut __h::CUgraph,
            ) -> __h::CUresult {
                // SAFETY: as above.
                unsafe { __h::stream_end_capture(stream, graph) }
            }

            #[no_mangle]
            unsafe extern "C" fn cuStreamDestroy_v2(stream: __h::CUstream) -> __h::CUresult {
                // SAFETY: as above.
                unsafe { __h::stream_destroy(stream) }
            }

            extern "C" fn __elastic_vmm_route_installed() {
                __h::mark_installed();
            }

            // Runs before `main`: routing knows the hooks are in this binary.
            #[used]
            #[link_section = ".init_array"]
            static __ELASTIC_VMM_ROUTE_INIT: extern "C" fn() = __elastic_vmm_route_installed;
        };
    };
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The library's own test binary does not invoke the macro.
    #[test]
    fn without_the_macro_routing_says_so() {
        let pool = Pool::host(1 << 30).unwrap();
        assert!(!is_installed());
        let e = route(&pool, Tag::Kv).unwrap_err();
        assert!(matches!(e, Error::RoutingNotInstalled));
        assert!(e.to_string().contains("route_cuda_allocations!"), "{e}");
        assert!(with_route(&pool, Tag::Kv, || ()).is_err());
        assert!(set_default(DefaultRoute::Pool(pool.clone(), Tag::Kv)).is_err());
        assert!(stats(&pool).is_none());
    }

    #[test]
    fn size_classes() {
        use hooks::size_class;
        assert_eq!(size_class(1), Some(512));
        assert_eq!(size_class(4096), Some(4096));
        assert_eq!(size_class(4097), Some(4608));
        assert_eq!(size_class(1 << 20), Some(1 << 20));
        assert_eq!(size_class((1 << 20) + 1), Some((1 << 20) + (1 << 14)));
        // A 62.5 MiB weight costs what it asks.
        assert_eq!(size_class(65_536_000), Some(65_536_000));
        assert_eq!(size_class(usize::MAX), None);
        for n in [5000usize, 77_777, 1_000_000] {
            let c = size_class(n).unwrap();
            assert!(c >= n && c - n <= n / 8, "{n} -> {c}");
        }
        for n in [3usize << 20, 65_536_001, (1 << 30) + 12345] {
            let c = size_class(n).unwrap();
            assert!(c >= n && c - n <= n / 64, "{n} -> {c}");
        }
    }
}
