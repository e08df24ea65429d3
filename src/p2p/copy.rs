//! Copying granted blocks into a layout of this process, in stream order on a GPU, with a
//! completion to wait on. Runs of consecutive bytes on both sides are merged, so a layer-
//! separate layout's many small spans per block become as few copies as the two layouts allow.

use std::collections::BTreeMap;
use std::fmt;
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use super::import::{ImportMapping, ImportedGrant};
use super::path::TransferPath;
use crate::backend::{Backend, MemoryKind};
use crate::backing::BlockPin;
use crate::error::{Error, Result};
use crate::layout::{ElasticLayout, LayoutConfig};
use crate::pool::RangePin;
use crate::Pool;

/// Destination bytes some copy is writing now, as address intervals (`start -> end`), which
/// stay the copy's own while its pin keeps the memory. Two copies into overlapping bytes at
/// once would race; the second is refused. A leaf lock: bookkeeping only.
static WRITING: Mutex<BTreeMap<u64, u64>> = Mutex::new(BTreeMap::new());

/// Destination intervals claimed in [`WRITING`] for one copy, let go on drop.
struct WriteClaim {
    starts: Vec<u64>,
}

impl WriteClaim {
    /// Claim `ops`' destinations (sorted by destination, not overlapping one another).
    fn take(ops: &[(u64, u64, u64)]) -> Result<WriteClaim> {
        let mut w = WRITING.lock();
        for &(d, _, len) in ops {
            let end = d + len;
            if let Some((&s, &e)) = w.range(..end).next_back() {
                if e > d {
                    return Err(Error::InvalidArgument(format!(
                        "destination bytes [{d:#x}, {end:#x}) overlap [{s:#x}, {e:#x}), which another p2p copy is writing: wait for its completion first"
                    )));
                }
            }
        }
        for &(d, _, len) in ops {
            w.insert(d, d + len);
        }
        Ok(WriteClaim {
            starts: ops.iter().map(|o| o.0).collect(),
        })
    }
}

impl Drop for WriteClaim {
    fn drop(&mut self) {
        let mut w = WRITING.lock();
        for s in &self.starts {
            w.remove(s);
        }
    }
}

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
    /// for or dropped; it is not a per-thread default stream handle (`2`), which names a
    /// different stream on the thread that waits.
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
    /// Copies issued after merging runs that are consecutive on both sides.
    pub copies: usize,
    /// The path the bytes took.
    pub path: TransferPath,
    /// Why that path (from the link's hello).
    pub reason: String,
    /// From the first copy queued to completion seen.
    pub elapsed: Duration,
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
    /// pinned until the copies completed; so is the source mapping.
    ///
    /// Refused before any copy: a sender that is gone or revoked the grant, a layout of another
    /// block size or kind ([`Error::LayoutMismatch`]), a number of blocks that differs, a block
    /// listed twice, out of range or not backed, memory of another kind or device than the
    /// mapping.
    ///
    /// The destination blocks' contents are unspecified until the completion is waited for;
    /// nothing else may use them meanwhile (their reads and writes are `unsafe` for that).
    pub fn copy_into(
        &self,
        dst: &ElasticLayout,
        dst_blocks: &[usize],
        stream: CopyStream,
    ) -> Result<Completion> {
        let link = &self.mapping.link;
        self.check_usable("copy")?;
        self.check_shape(dst, dst_blocks)?;
        let src_backend = self.mapping.backend();
        let src_info = src_backend.info();
        if dst.memory_kind() != src_info.memory_kind || dst.device() != src_info.device_ordinal {
            return Err(Error::InvalidArgument(format!(
                "the grant is mapped for {:?} memory of device {:?}, the layout holds {:?} memory of device {:?}: link and layout must share a backend",
                src_info.memory_kind,
                src_info.device_ordinal,
                dst.memory_kind(),
                dst.device()
            )));
        }
        let holder = format!("p2p copy of grant {} from {}", self.id, link.peer.name);
        let pin = dst.pin(dst_blocks.iter().copied(), &holder)?;
        // (dst, src, len), merged where both sides continue.
        let mut ops: Vec<(u64, u64, u64)> = Vec::new();
        let mut spans = 0usize;
        let mut bytes = 0u64;
        for (i, &b) in dst_blocks.iter().enumerate() {
            let views = dst.views().block(b)?;
            let src = &self.spans[i];
            if views.len() != src.len() {
                return Err(Error::LayoutMismatch {
                    detail: format!(
                        "block {b} has {} spans here, granted block {} has {}",
                        views.len(),
                        self.blocks[i],
                        src.len()
                    ),
                });
            }
            for (d, s) in views.iter().zip(src) {
                if d.len != s.len {
                    return Err(Error::LayoutMismatch {
                        detail: format!(
                            "a span of block {b} is {} bytes here and {} bytes in granted block {}",
                            d.len, s.len, self.blocks[i]
                        ),
                    });
                }
                spans += 1;
                bytes += d.len;
                ops.push((d.addr, s.addr, d.len));
            }
        }
        let backend = dst.backing().pool().backend().clone();
        self.launch(
            backend,
            dst.memory_kind(),
            stream,
            DstPin::Blocks { _pin: pin },
            ops,
            (dst_blocks.len(), spans, bytes),
        )
    }

    /// Copy every granted byte, block after block and span after span, packed into
    /// `[offset, offset + bytes)` of `pool`'s reservation, which must be mapped through the
    /// range API (the pool's own, or a [`crate::Region`]'s at its offset plus the offset in
    /// it): the grant of a range ([`crate::p2p::PeerLink::grant_range`]) lands as it was. The
    /// range is pinned against unmapping until the copies ran; queued on `stream` as for
    /// [`ImportedGrant::copy_into`].
    pub fn copy_to(&self, pool: &Pool, offset: u64, stream: CopyStream) -> Result<Completion> {
        self.check_usable("copy")?;
        let bytes: u64 = self.spans.iter().flatten().map(|v| v.len).sum();
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
        let mut ops = Vec::new();
        let mut at = pool.base() + offset;
        let mut spans = 0;
        for s in self.spans.iter().flatten() {
            ops.push((at, s.addr, s.len));
            at += s.len;
            spans += 1;
        }
        self.launch(
            pool.backend().clone(),
            info.memory_kind,
            stream,
            DstPin::Range { _pin: pin },
            ops,
            (self.blocks.len(), spans, bytes),
        )
    }

    /// Merge, claim and queue `ops` (`(dst, src, len)`), the destination held by `pin`.
    fn launch(
        &self,
        backend: Arc<dyn Backend>,
        memory: MemoryKind,
        stream: CopyStream,
        pin: DstPin,
        mut ops: Vec<(u64, u64, u64)>,
        (blocks, spans, bytes): (usize, usize, u64),
    ) -> Result<Completion> {
        // In destination order, runs that continue on both sides become one copy (a
        // layer-separate layout's spans of consecutive blocks, layer by layer).
        ops.sort_unstable();
        let mut merged: Vec<(u64, u64, u64)> = Vec::with_capacity(ops.len());
        for (d, s, len) in ops {
            match merged.last_mut() {
                Some((od, os, ol)) if *od + *ol == d && *os + *ol == s => *ol += len,
                _ => merged.push((d, s, len)),
            }
        }
        let ops = merged;
        let claim = WriteClaim::take(&ops)?;
        let link = &self.mapping.link;
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
                copies: ops.len(),
                path: TransferPath::PeerImport,
                reason: link.path.reason.clone(),
                elapsed: Duration::ZERO,
            },
            started,
        };
        if memory == MemoryKind::Device {
            let batch: Vec<(u64, u64, usize)> = ops
                .iter()
                .map(|&(d, s, len)| (d, s, len as usize))
                .collect();
            // SAFETY: every range is mapped with access on this device and stays so until
            // `completion` has synchronized the stream; sources and destinations lie in
            // different mappings, and destinations do not overlap (claimed), so nothing
            // overlaps; the stream is the legacy one or one the caller vouched for in
            // `CopyStream::from_raw`.
            if let Err(e) = unsafe { backend.copy_batch_async(&batch, stream.raw()) } {
                // Copies queued before must run before the pins go: `completion` waits for
                // them as it drops.
                drop(completion);
                return Err(e);
            }
        }
        if memory == MemoryKind::Host {
            for &(d, s, len) in &ops {
                // SAFETY: `s..s + len` lies in the grant's mapping (located when it was
                // imported), readable and kept mapped by `completion`; `d..d + len` lies in
                // pinned destination memory, mapped read-write; the two are different
                // mappings so they do not overlap. Other use of the destination is excluded by
                // the contracts of the layout's unsafe reads and writes.
                unsafe {
                    std::ptr::copy_nonoverlapping(s as *const u8, d as *mut u8, len as usize)
                };
            }
        }
        if memory == MemoryKind::Host {
            completion.report.elapsed = started.elapsed();
        }
        tracing::debug!(peer = %link.peer.name, grant = self.id, blocks, spans, copies = ops.len(), bytes, path = %TransferPath::PeerImport, reason = %link.path.reason, "p2p copy queued");
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
            if let Err(e) = self.backend.synchronize(self.stream) {
                // Whether the copies ran is unknown: keep their memory mapped for good rather
                // than unmap it under them.
                tracing::error!(error = %e, "waiting for p2p copies failed; their memory stays mapped and pinned");
                std::mem::forget(held);
                return Err(e);
            }
            self.report.elapsed = self.started.elapsed();
        }
        let link = held.0.link.clone();
        {
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
