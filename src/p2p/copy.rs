//! Copying granted blocks into a layout of this process, in stream order on a GPU, with a
//! completion to wait on. The work is a pattern and one shift per block ([`super::plan`]),
//! built in O(blocks): few large merged runs go to `cuMemcpyAsync`, everything else to one
//! launch of the gather kernel; host memory is copied by the CPU.

use std::fmt;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::import::{ImportMapping, ImportedGrant};
use super::path::TransferPath;
use super::plan::{self, Claim, CopyEngine, EngineChoice, Plan, WriteClaim};
use crate::backend::{Backend, GatherShift, MemoryKind};
use crate::backing::{BlockPin, SortedBlocks};
use crate::error::{Error, Result};
use crate::layout::{ElasticLayout, LayoutConfig};
use crate::pool::RangePin;
use crate::Pool;

/// What a copy holds on its destination until the copies ran.
enum DstPin {
    Blocks { _pin: BlockPin },
    Range { _pin: RangePin },
}

/// The GPU stream copies are queued on (ignored on the host backend, which copies at once).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CopyStream(u64);

impl CopyStream {
    /// CUDA's legacy default stream: ordered with every blocking stream of the context.
    pub const LEGACY: CopyStream = CopyStream(1);

    /// A stream of the device's primary context, as a raw `CUstream` handle.
    ///
    /// # Safety
    /// The stream stays alive until every [`Completion`] of copies queued on it has been waited
    /// for or dropped, and is not being captured into a CUDA graph meanwhile (a completion
    /// could not synchronize it, and would keep its pins and claim for good); it is not a
    /// per-thread default stream handle (`2`), which names a different stream on the thread
    /// that waits.
    pub unsafe fn from_raw(raw: u64) -> CopyStream {
        CopyStream(raw)
    }

    /// The raw handle.
    pub fn raw(self) -> u64 {
        self.0
    }
}

/// What a finished copy did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CopyReport {
    /// Bytes copied.
    pub bytes: u64,
    /// Blocks copied.
    pub blocks: usize,
    /// Spans of the blocks (one per block for fully contiguous; per layer, or per layer and
    /// K/V, for layer separate).
    pub spans: usize,
    /// Contiguous copies the move is made of after merging runs that are consecutive on both
    /// sides: what the memcpy engine issues, one call each.
    pub copies: usize,
    /// What moved the bytes.
    pub engine: CopyEngine,
    /// Work submitted to the GPU: kernel launches (1) or `cuMemcpyAsync` copies (`copies`);
    /// 0 for the CPU.
    pub launches: usize,
    /// Work items of the kernel (block pairs times pattern pieces of at most 64 KiB, each one
    /// warp's task); `copies` for the other engines.
    pub tasks: u64,
    /// The path the bytes took.
    pub path: TransferPath,
    /// Why that path (from the link's hello).
    pub reason: String,
    /// From the first copy queued to completion seen.
    pub elapsed: Duration,
    /// Host time of the call, from its start until every copy was queued (checks, pins,
    /// claims, the plan and the submission); part of the time a caller waits. For the kernel
    /// that is until its launch (the bookkeeping after it, counting `copies`, runs while the
    /// GPU copies); for `cuMemcpyAsync` it includes building the runs it issues.
    pub host: Duration,
}

/// Copies in flight: the source mapping and the destination blocks stay (pinned) until the
/// copies completed. [`Completion::wait`] waits and reports; dropping it waits too.
pub struct Completion {
    backend: Arc<dyn Backend>,
    stream: u64,
    memory: MemoryKind,
    held: Option<(Arc<ImportMapping>, DstPin, WriteClaim)>,
    report: CopyReport,
    started: Instant,
    /// The copy was refused part way: what was queued is waited for, nothing is counted.
    failed: bool,
}

/// The block sizes of two configs that must match for a copy, or the difference in words.
pub(crate) fn mismatch(src: &LayoutConfig, dst: &LayoutConfig) -> Option<String> {
    let dims = |c: &LayoutConfig| {
        [
            c.num_layers,
            c.outer_dim,
            c.page_size,
            c.inner_dim,
            c.dtype_width_bytes,
        ]
    };
    (dims(src) != dims(dst)).then(|| {
        let bytes = |c: &LayoutConfig| c.sizes().map_or(0, |s| s.block);
        format!(
            "sender blocks are {} bytes (layers {}, outer {}, tokens {}, inner {}, dtype {} bytes), receiver blocks {} bytes (layers {}, outer {}, tokens {}, inner {}, dtype {} bytes)",
            bytes(src), src.num_layers, src.outer_dim, src.page_size, src.inner_dim, src.dtype_width_bytes,
            bytes(dst), dst.num_layers, dst.outer_dim, dst.page_size, dst.inner_dim, dst.dtype_width_bytes,
        )
    })
}

impl ImportedGrant {
    /// Copy the granted blocks into `dst_blocks` of `dst` (paired by position), queued on
    /// `stream` on a GPU (host memory: copied before this returns). The destination blocks are
    /// pinned until the copies completed; so is the source mapping. The engine is chosen as
    /// [`EngineChoice::Auto`] says; see [`ImportedGrant::copy_into_with`].
    ///
    /// Refused before any copy: a sender that is gone or revoked the grant, a layout of another
    /// block size or kind ([`Error::LayoutMismatch`]), a number of blocks that differs, a block
    /// listed twice, out of range or not backed, memory of another kind or device than the
    /// mapping, destination blocks another copy from a grant is writing now.
    ///
    /// The destination blocks' contents are unspecified until the completion is waited for;
    /// nothing else may use them meanwhile (their reads and writes are `unsafe` for that).
    pub fn copy_into(
        &self,
        dst: &ElasticLayout,
        dst_blocks: &[usize],
        stream: CopyStream,
    ) -> Result<Completion> {
        self.copy_into_with(dst, dst_blocks, stream, EngineChoice::Auto)
    }

    /// [`ImportedGrant::copy_into`] with the engine chosen by `engine`: the host work is
    /// O(blocks) whatever the layouts (the grant's pattern and shifts were computed at import).
    pub fn copy_into_with(
        &self,
        dst: &ElasticLayout,
        dst_blocks: &[usize],
        stream: CopyStream,
        engine: EngineChoice,
    ) -> Result<Completion> {
        let called = Instant::now();
        let link = &self.mapping.link;
        self.check_usable("copy")?;
        let (set, bounds) = self.check_shape(dst, dst_blocks)?;
        let src_info = self.mapping.backend().info();
        if dst.memory_kind() != src_info.memory_kind || dst.device() != src_info.device_ordinal {
            return Err(Error::InvalidArgument(format!(
                "the grant is mapped for {:?} memory of device {:?}, the layout holds {:?} memory of device {:?}: link and layout must share a backend",
                src_info.memory_kind,
                src_info.device_ordinal,
                dst.memory_kind(),
                dst.device()
            )));
        }
        let (views, stride) = dst.views().block_pattern();
        let dst_pattern: Arc<[(u64, u64)]> = views.iter().map(|v| (v.addr, v.len)).collect();
        let pieces = plan::pair_pattern(&self.pattern, &dst_pattern)?;
        let shifts = self
            .src_shifts
            .iter()
            .zip(dst_blocks)
            .map(|(&src, &d)| GatherShift {
                src,
                // Below the layout's extent (the block exists).
                dst: d as u64 * stride,
            })
            .collect();
        let plan = Plan {
            pieces,
            shifts,
            src_stride: self.stride,
            dst_stride: stride,
        };
        let holder = format!("p2p copy of grant {} from {}", self.id, link.peer.name);
        // The blocks were checked (in range, none twice) into `set`: the pin takes them from it.
        let pin = dst.pin_sorted(SortedBlocks::from_bitmap(&set, dst_blocks.len()), &holder)?;
        let claim = Claim::blocks(dst_pattern, stride, dst.num_blocks(), set, bounds);
        let backend = dst.backing().pool().backend().clone();
        self.launch(
            backend,
            dst.memory_kind(),
            stream,
            (DstPin::Blocks { _pin: pin }, claim),
            plan,
            (engine, called),
        )
    }

    /// Copy every granted byte, block after block and span after span, packed into
    /// `[offset, offset + bytes)` of `pool`'s reservation, which must be mapped through the
    /// range API (the pool's own, or a [`crate::Region`]'s at its offset plus the offset in
    /// it): the grant of a range ([`crate::p2p::PeerLink::grant_range`]) lands as it was. The
    /// range is pinned against unmapping until the copies ran; queued on `stream` as for
    /// [`ImportedGrant::copy_into`].
    pub fn copy_to(&self, pool: &Pool, offset: u64, stream: CopyStream) -> Result<Completion> {
        self.copy_to_with(pool, offset, stream, EngineChoice::Auto)
    }

    /// [`ImportedGrant::copy_to`] with the engine chosen by `engine`.
    pub fn copy_to_with(
        &self,
        pool: &Pool,
        offset: u64,
        stream: CopyStream,
        engine: EngineChoice,
    ) -> Result<Completion> {
        let called = Instant::now();
        self.check_usable("copy")?;
        let per_block: u64 = self.pattern.iter().map(|s| s.1).sum();
        let bytes = per_block
            .checked_mul(self.blocks.len() as u64)
            .ok_or_else(|| Error::SizeOverflow {
                what: "granted bytes",
                detail: format!("{} blocks of {per_block} bytes", self.blocks.len()),
            })?;
        let src_info = self.mapping.backend().info();
        let info = pool.backend_info();
        if info.memory_kind != src_info.memory_kind
            || info.device_ordinal != src_info.device_ordinal
        {
            return Err(Error::InvalidArgument(format!(
                "the grant is mapped for {:?} memory of device {:?}, the pool holds {:?} memory of device {:?}",
                src_info.memory_kind, src_info.device_ordinal, info.memory_kind, info.device_ordinal
            )));
        }
        let pin = pool.pin_range(offset, bytes)?;
        // Pinned: `[offset, offset + bytes)` lies in the reservation, so no sum below wraps.
        let at = pool.base() + offset;
        let mut packed = Vec::with_capacity(self.pattern.len());
        let mut o = 0;
        for &(_, len) in &self.pattern {
            packed.push((o, len));
            o += len;
        }
        let pieces = plan::pair_pattern(&self.pattern, &packed)?;
        let shifts = self
            .src_shifts
            .iter()
            .enumerate()
            .map(|(i, &src)| GatherShift {
                src,
                dst: at + i as u64 * per_block,
            })
            .collect();
        let plan = Plan {
            pieces,
            shifts,
            src_stride: self.stride,
            dst_stride: per_block,
        };
        let claim = Claim::Range {
            lo: at,
            hi: at + bytes,
        };
        self.launch(
            pool.backend().clone(),
            info.memory_kind,
            stream,
            (DstPin::Range { _pin: pin }, claim),
            plan,
            (engine, called),
        )
    }

    /// Claim the destination and queue `plan` on the engine `choice` leads to, the
    /// destination held by `pin`.
    fn launch(
        &self,
        backend: Arc<dyn Backend>,
        memory: MemoryKind,
        stream: CopyStream,
        (pin, claim): (DstPin, Claim),
        plan: Plan,
        (choice, called): (EngineChoice, Instant),
    ) -> Result<Completion> {
        let claim = WriteClaim::take(claim)?;
        let link = &self.mapping.link;
        let blocks = plan.shifts.len();
        let spans = blocks * self.pattern.iter().filter(|s| s.1 > 0).count();
        let bytes = plan.block_bytes() * blocks as u64;
        // The runs themselves only where an engine copies run by run (building them for
        // thousands of blocks costs tens of µs of host time). Even their count (a pass over
        // the blocks) waits, where the engine does not depend on it, until the kernel is
        // queued: the GPU copies meanwhile.
        let mut counted = None;
        let mut engine = plan::choose(memory, choice, bytes, || {
            *counted.insert(plan.count_copies())
        });
        let started = Instant::now();
        let mut completion = Completion {
            backend: backend.clone(),
            stream: stream.raw(),
            memory,
            held: Some((self.mapping.clone(), pin, claim)),
            report: CopyReport {
                bytes,
                blocks,
                spans,
                // Filled in below, once counted.
                copies: 0,
                engine,
                launches: 0,
                tasks: 0,
                path: TransferPath::PeerImport,
                reason: link.path_in.reason.clone(),
                elapsed: Duration::ZERO,
                host: Duration::ZERO,
            },
            started,
            failed: false,
        };
        let mut queued = None;
        if engine == CopyEngine::Kernel {
            let pieces = plan.split(Plan::piece_size(bytes));
            // SAFETY: every copy of the plan reads the grant's mapping (each span located at
            // import) and writes pinned destination blocks or a pinned range, all mapped with
            // access on this device and kept so by `completion` until it synchronized the
            // stream; sources and destinations lie in different mappings and destinations do
            // not overlap (distinct blocks of one layout, or one packed range; claimed against
            // every other copy in flight); the stream is the legacy one or one the caller
            // vouched for in `CopyStream::from_raw`.
            match unsafe {
                backend
                    .copies()
                    .gather_async(&pieces, &plan.shifts, stream.raw())
            } {
                Ok(()) => {
                    completion.report.launches = 1;
                    completion.report.tasks = pieces.len() as u64 * blocks as u64;
                    // Every copy is queued: what follows is bookkeeping while the GPU copies.
                    queued = Some(called.elapsed());
                }
                Err(e) if choice == EngineChoice::Kernel => {
                    completion.failed = true;
                    drop(completion);
                    return Err(e);
                }
                Err(e) => {
                    // Nothing was queued: the memcpy engine does it.
                    tracing::debug!(error = %e, "gather kernel not available; copying with cuMemcpyAsync");
                    engine = CopyEngine::Memcpy;
                    completion.report.engine = engine;
                }
            }
        }
        let copies = counted.unwrap_or_else(|| plan.count_copies());
        completion.report.copies = copies as usize;
        if engine != CopyEngine::Kernel {
            completion.report.tasks = copies;
        }
        if engine == CopyEngine::Memcpy {
            let mut batch: Vec<(u64, u64, usize)> = Vec::with_capacity(copies as usize);
            plan.for_each_copy(&plan.runs(), |d, s, len| batch.push((d, s, len as usize)));
            // SAFETY: as for the kernel above, copy by copy.
            if let Err(e) = unsafe { backend.copies().copy_batch_async(&batch, stream.raw()) } {
                // Copies queued before must run before the pins go: `completion` waits for
                // them as it drops.
                completion.failed = true;
                drop(completion);
                return Err(e);
            }
            completion.report.launches = batch.len();
        }
        if engine == CopyEngine::Cpu {
            plan.for_each_copy(&plan.runs(), |d, s, len| {
                // SAFETY: `s..s + len` lies in the grant's mapping (located when it was
                // imported), readable and kept mapped by `completion`; `d..d + len` lies in
                // pinned destination memory, mapped read-write; the two are different
                // mappings so they do not overlap. Other use of the destination is excluded by
                // the contracts of the layout's unsafe reads and writes.
                unsafe {
                    std::ptr::copy_nonoverlapping(s as *const u8, d as *mut u8, len as usize)
                };
            });
            completion.report.elapsed = started.elapsed();
        }
        completion.report.host = queued.unwrap_or_else(|| called.elapsed());
        tracing::debug!(peer = %link.peer.name, grant = self.id, blocks, spans, copies, %engine, bytes, path = %TransferPath::PeerImport, reason = %link.path_in.reason, "p2p copy queued");
        Ok(completion)
    }
}

impl Completion {
    /// What the copy moved (elapsed is filled in by [`Completion::wait`]).
    pub fn report(&self) -> &CopyReport {
        &self.report
    }

    /// Wait until the copies completed; the destination blocks are unpinned and the source
    /// mapping let go (unmapped once the grant is dropped too).
    pub fn wait(mut self) -> Result<CopyReport> {
        self.finish()?;
        Ok(self.report.clone())
    }

    fn finish(&mut self) -> Result<()> {
        let Some(held) = self.held.take() else {
            return Ok(());
        };
        if self.memory == MemoryKind::Device {
            if let Err(e) = self.backend.copies().synchronize(self.stream) {
                // Whether the copies ran is unknown: keep their memory mapped for good rather
                // than unmap it under them.
                tracing::error!(error = %e, "waiting for p2p copies failed; their memory stays mapped and pinned");
                std::mem::forget(held);
                return Err(e);
            }
            self.report.elapsed = self.started.elapsed();
        }
        if !self.failed {
            let link = held.0.link.clone();
            let mut st = link.state.lock();
            st.transfers += 1;
            st.bytes_copied += self.report.bytes;
        }
        // Pin and mapping go with no lock held.
        drop(held);
        Ok(())
    }
}

impl Drop for Completion {
    fn drop(&mut self) {
        if let Err(e) = self.finish() {
            tracing::error!(error = %e, "p2p copy failed");
        }
    }
}

impl fmt::Debug for Completion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Completion")
            .field("report", &self.report)
            .field("done", &self.held.is_none())
            .finish()
    }
}
