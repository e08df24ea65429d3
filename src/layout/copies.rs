//! Moving blocks between layouts of one geometry on different storage: the mechanism under
//! [`super::KvTiers`] and [`copy_blocks`].
//!
//! - device <-> host: the pool backend's copies, queued on a copy stream of its own (ordered
//!   after an engine's stream when asked) and awaited through a marker;
//! - host <-> disk: `pread`/`pwrite` (`O_DIRECT` where address, offset and length are 4 KiB
//!   aligned) on several I/O threads, pieces split to [`IO_PIECE`] so that one large block
//!   keeps several requests in flight (a single synchronous stream of requests leaves an NVMe
//!   drive mostly idle);
//! - host <-> host: `memcpy` on the same threads.
//!
//! Everything is checked before any byte moves: geometry, counts, block ids, a destination
//! block named twice, a pair of storages it cannot move between. Runs of consecutive ids on
//! both sides become one copy per view of a block (a fully contiguous layout: one copy per
//! run). A [`Flight`] is the copies under way; [`Flight::finish`] waits for every one of them,
//! whatever failed, so nothing stays queued on the memory when it returns.

use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::mapped::{Layout, LayoutMemory};
use super::storage::{DiskFile, StorageKind};
use super::view::LayoutViews;
use crate::backend::{Backend, GatherPiece, GatherShift, MemoryKind};
use crate::error::{Error, Result};

/// What a move did.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct MoveReport {
    /// Blocks moved.
    pub blocks: usize,
    /// Bytes copied.
    pub bytes: u64,
    /// Copies made, after merging runs.
    pub copies: usize,
    /// From the first copy to when its completion was seen.
    pub elapsed: Duration,
}

/// One copy: `len` bytes from `src` to `dst` (addresses, or offsets in a layout's file).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Piece {
    pub(crate) src: u64,
    pub(crate) dst: u64,
    pub(crate) len: u64,
}

/// Milliseconds every I/O thread waits before its first copy: tests widen the window in which
/// a move is under way.
#[cfg(test)]
pub(crate) static IO_DELAY_MS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// Most I/O threads one move uses.
const IO_THREADS: usize = 8;
/// Pieces moved by threads are split to this size (a multiple of the `O_DIRECT` alignment, so
/// aligned pieces stay aligned), and a thread is worth starting per this many bytes.
pub(crate) const IO_PIECE: u64 = 4 << 20;

/// How a layout's bytes are reached.
enum End<'a> {
    /// Pool memory: through its backend.
    Pool(&'a Arc<dyn Backend>),
    /// Host memory by address; `staging` is the backend whose staging memory it is.
    Host {
        staging: Option<&'a Arc<dyn Backend>>,
    },
    /// A file.
    File(&'a DiskFile),
}

impl End<'_> {
    /// Whether the CPU reaches its bytes by address.
    fn cpu(&self) -> bool {
        match self {
            End::Pool(b) => b.info().memory_kind == MemoryKind::Host,
            End::Host { .. } => true,
            End::File(_) => false,
        }
    }
}

fn end_of(layout: &Layout) -> Result<End<'_>> {
    Ok(match layout.memory() {
        LayoutMemory::Allocation { pool, .. } => End::Pool(pool.backend()),
        LayoutMemory::Region(r) => End::Pool(r.pool().backend()),
        LayoutMemory::Caller(_) if layout.memory_kind() == MemoryKind::Host => {
            End::Host { staging: None }
        }
        LayoutMemory::Caller(_) => {
            return Err(Error::InvalidArgument(format!(
                "the layout lies in caller device memory of device {:?}: no backend to copy it with (build it on a pool)",
                layout.device()
            )))
        }
        LayoutMemory::Host(b) => End::Host {
            staging: b.staging_backend(),
        },
        LayoutMemory::Disk(f) => End::File(f),
    })
}

/// Whether `host`, a host pool's backend, is a host tier the device of `device` copies to.
fn reaches(device: &Arc<dyn Backend>, host: &Arc<dyn Backend>) -> bool {
    let h = host.info();
    h.memory_kind == MemoryKind::Host
        && h.page_locked
        && (h.device_ordinal.is_none() || h.device_ordinal == device.info().device_ordinal)
}

/// Whether the device of `device` maps the host tier `host` into its address space (VMM host
/// memory of that device: kernels load and store it), not only copies to it.
fn maps(device: &Arc<dyn Backend>, host: &Arc<dyn Backend>) -> bool {
    host.info().device_ordinal.is_some()
        && host.info().device_ordinal == device.info().device_ordinal
}

fn same_backend(a: &Arc<dyn Backend>, b: &Arc<dyn Backend>) -> bool {
    std::ptr::addr_eq(Arc::as_ptr(a), Arc::as_ptr(b))
}

/// The copies that move `src_blocks` of `src` onto `dst_blocks` of `dst`, runs merged; every
/// check done first.
fn plan(
    src: &LayoutViews,
    src_blocks: &[usize],
    dst: &LayoutViews,
    dst_blocks: &[usize],
) -> Result<Vec<Piece>> {
    if src.geometry() != dst.geometry() {
        return Err(Error::LayoutMismatch {
            detail: format!(
                "source {:?} ({}), destination {:?} ({}): a move needs one geometry",
                src.config(),
                src.kind(),
                dst.config(),
                dst.kind()
            ),
        });
    }
    if src_blocks.len() != dst_blocks.len() {
        return Err(Error::LayoutMismatch {
            detail: format!(
                "{} source blocks, {} destination blocks: they pair by position",
                src_blocks.len(),
                dst_blocks.len()
            ),
        });
    }
    let count = src.num_blocks();
    for &b in src_blocks.iter().chain(dst_blocks) {
        if b >= count {
            return Err(Error::OutOfLayout {
                what: "block",
                index: b,
                count,
            });
        }
    }
    let mut seen = std::collections::HashSet::with_capacity(dst_blocks.len());
    for &b in dst_blocks {
        if !seen.insert(b) {
            return Err(Error::InvalidArgument(format!(
                "destination block {b} is named twice: a move writes each destination block once"
            )));
        }
    }
    let mut pieces = Vec::new();
    for (s0, d0, n) in runs(src_blocks, dst_blocks) {
        let (s, d) = (src.blocks(s0, n)?, dst.blocks(d0, n)?);
        pieces.extend(s.iter().zip(&d).map(|(s, d)| Piece {
            src: s.addr,
            dst: d.addr,
            len: s.len,
        }));
    }
    Ok(pieces)
}

/// Runs of blocks paired by position, consecutive on both sides: `(first source, first
/// destination, blocks)`.
pub(crate) fn runs(src: &[usize], dst: &[usize]) -> Vec<(usize, usize, usize)> {
    let mut out = Vec::new();
    let mut i = 0;
    while i < src.len().min(dst.len()) {
        let mut n = 1;
        while i + n < src.len().min(dst.len())
            && src[i + n - 1] + 1 == src[i + n]
            && dst[i + n - 1] + 1 == dst[i + n]
        {
            n += 1;
        }
        out.push((src[i], dst[i], n));
        i += n;
    }
    out
}

/// How a copy goes between two storages. `Streamed` copies go on the backend's copy stream;
/// `kernel`: both ends are pool memory the device maps (device memory and a host tier), so a
/// gather kernel may make the copies instead of the copy engines.
enum Way<'a> {
    Streamed {
        backend: &'a Arc<dyn Backend>,
        to_host: bool,
        kernel: bool,
    },
    Cpu(CpuOp<'a>),
}

/// Below this mean piece size, moves between device memory and a host tier the device maps go
/// through the gather kernel (one launch, the device's loads and stores over the link) rather
/// than one copy-engine copy per piece (each of which pays a fixed cost: 64 KiB pieces reach a
/// third of the link). `EVMM_TIER_ENGINE=memcpy` or `=kernel` forces one.
const KERNEL_BELOW: u64 = 1 << 20;

/// Whether the pieces of a move between device memory and a host tier go through the kernel.
fn use_kernel(pieces: &[Piece]) -> bool {
    match std::env::var("EVMM_TIER_ENGINE").as_deref() {
        Ok("memcpy") => false,
        Ok("kernel") => true,
        _ => {
            let bytes: u64 = pieces.iter().map(|p| p.len).sum();
            pieces.len() > 1 && bytes / (pieces.len() as u64) < KERNEL_BELOW
        }
    }
}

/// A copy the CPU makes.
#[derive(Clone, Copy)]
enum CpuOp<'a> {
    Memcpy,
    Write(&'a DiskFile),
    Read(&'a DiskFile),
}

/// The way from `from` to `to`, or why there is none.
fn way<'a>(from: &End<'a>, to: &End<'a>, sk: StorageKind, dk: StorageKind) -> Result<Way<'a>> {
    let refuse = |why: &str| {
        Err(Error::InvalidArgument(format!(
            "no way to move blocks from {} to {} storage: {why}",
            sk.name(),
            dk.name()
        )))
    };
    let device = |b: &Arc<dyn Backend>| b.info().memory_kind == MemoryKind::Device;
    let way = match (from, to) {
        (End::File(_), End::File(_)) => return refuse("disk to disk"),
        (End::File(f), e) if e.cpu() => Way::Cpu(CpuOp::Read(f)),
        (e, End::File(f)) if e.cpu() => Way::Cpu(CpuOp::Write(f)),
        (End::File(_), _) | (_, End::File(_)) => {
            return refuse("no GPUDirect Storage here: stage through a pinned host layout")
        }
        // Two host pools: through the source backend's copies (synchronous on host backends,
        // and seen by its hooks, as every pool copy is).
        (End::Pool(a), End::Pool(b)) if !device(a) && !device(b) => Way::Streamed {
            backend: a,
            to_host: true,
            kernel: false,
        },
        // Device memory and a host tier it reaches (VMM host memory of the same device, or
        // the pinned fallback, which has no device).
        (End::Pool(a), End::Pool(b)) if device(a) && reaches(a, b) => Way::Streamed {
            backend: a,
            to_host: true,
            kernel: maps(a, b),
        },
        (End::Pool(a), End::Pool(b)) if device(b) && reaches(b, a) => Way::Streamed {
            backend: b,
            to_host: false,
            kernel: maps(b, a),
        },
        (End::Pool(_), End::Pool(_)) => {
            return refuse(
                "device to device, or a host pool that is no host tier of this device: copy within the device (p2p), or use Pool::host_tier",
            )
        }
        (End::Pool(b), End::Host { staging }) | (End::Host { staging }, End::Pool(b)) => {
            if device(b) && !staging.is_some_and(|s| same_backend(s, b)) {
                return refuse(
                    "the host layout is not pinned by the device pool's backend (build it with LayoutBuilder::pinned(&pool, ..))",
                );
            }
            Way::Streamed {
                backend: b,
                to_host: matches!(from, End::Pool(_)),
                kernel: false,
            }
        }
        (End::Host { .. }, End::Host { .. }) => Way::Cpu(CpuOp::Memcpy),
    };
    Ok(way)
}

impl Way<'_> {
    /// The device whose copy stream the copies go on (they can be ordered after a stream of
    /// that device); `None` for copies no device makes (threads, or a host backend's copies).
    fn device(&self) -> Option<Option<i32>> {
        match self {
            Way::Streamed { backend, .. } if backend.info().memory_kind == MemoryKind::Device => {
                Some(backend.info().device_ordinal)
            }
            _ => None,
        }
    }
}

/// Why a move between `sk` and `dk` cannot be ordered after a stream.
fn no_stream(sk: StorageKind, dk: StorageKind) -> Error {
    Error::InvalidArgument(format!(
        "a move from {} to {} storage has no device copies to order after a stream: synchronize the stream and start the move without one",
        sk.name(),
        dk.name()
    ))
}

/// Whether blocks can move from `src` to `dst` at all (storage kinds and backends): an error
/// saying why not, before anything is taken or copied. `Some(device ordinal)` when a device
/// makes the copies (they can be ordered after a stream of that device).
pub(crate) fn check_path(src: &Layout, dst: &Layout) -> Result<Option<Option<i32>>> {
    let (from, to) = (end_of(src)?, end_of(dst)?);
    Ok(way(&from, &to, src.storage(), dst.storage())?.device())
}

/// Whether blocks can move from memory of a pool on backend `from` to one on `to` (with copies
/// ordered after a stream when `after`): an error saying why not, before anything is taken.
pub(crate) fn check_between_pools(
    from: &Arc<dyn Backend>,
    to: &Arc<dyn Backend>,
    after: bool,
) -> Result<()> {
    let (sk, dk) = (
        StorageKind::of_backend(from.info()),
        StorageKind::of_backend(to.info()),
    );
    let way = way(&End::Pool(from), &End::Pool(to), sk, dk)?;
    if after && way.device().is_none() {
        return Err(no_stream(sk, dk));
    }
    Ok(())
}

/// Start copying `pieces` (addresses) from memory of a pool on backend `from` to memory of a
/// pool on backend `to`: device <-> a host tier of that device on the device's copy stream
/// (after `after`'s work), host <-> host on threads. Refused before any copy: device <->
/// device, a host pool that is no host tier of the device, `after` with no device copy.
///
/// # Safety
/// As for [`start`]: the ranges are mapped memory of those pools, alive and unshared until
/// the flight is finished; `after` a live stream of the device.
pub(crate) unsafe fn start_between_pools(
    from: &Arc<dyn Backend>,
    to: &Arc<dyn Backend>,
    pieces: &[Piece],
    after: Option<u64>,
) -> Result<Flight> {
    check_between_pools(from, to, after.is_some())?;
    let (sk, dk) = (
        StorageKind::of_backend(from.info()),
        StorageKind::of_backend(to.info()),
    );
    let failed = |copied, e| Error::TierMoveFailed {
        blocks: pieces.len(),
        from: sk.name(),
        to: dk.name(),
        copied,
        bytes: pieces.iter().map(|p| p.len).sum(),
        source: Box::new(e),
    };
    match way(&End::Pool(from), &End::Pool(to), sk, dk)? {
        // SAFETY: the caller's promise, forwarded.
        Way::Cpu(op) => unsafe { on_threads(op, pieces) }.map_err(|e| failed(0, e)),
        Way::Streamed {
            backend,
            to_host,
            kernel,
        } => {
            let kernel = kernel && use_kernel(pieces);
            // SAFETY: as above.
            unsafe { streamed(backend, pieces, to_host, kernel, after) }
                .map_err(|(c, e)| failed(c, e))
        }
    }
}

/// Copies under way: what [`start`] queued or handed to threads.
pub(crate) enum Flight {
    /// On a copy stream of `backend`, `marker` recorded after the last copy.
    Stream {
        backend: Arc<dyn Backend>,
        stream: u64,
        marker: u64,
        bytes: u64,
    },
    /// On I/O threads, each giving back the bytes it moved (and its failure); `running`
    /// counts those not done.
    Threads {
        handles: Vec<JoinHandle<(u64, Result<()>)>>,
        running: Arc<Running>,
    },
}

/// Copy threads not done yet, and a wake-up for whoever waits for none.
#[derive(Default)]
pub(crate) struct Running {
    count: parking_lot::Mutex<usize>,
    none: parking_lot::Condvar,
}

impl Running {
    fn start_one(&self) {
        *self.count.lock() += 1;
    }

    fn end_one(&self) {
        let mut n = self.count.lock();
        *n -= 1;
        if *n == 0 {
            self.none.notify_all();
        }
    }

    fn is_none(&self) -> bool {
        *self.count.lock() == 0
    }

    /// Block until every thread counted has ended.
    fn wait_none(&self) {
        let mut n = self.count.lock();
        while *n != 0 {
            self.none.wait(&mut n);
        }
    }
}

/// A way to ask a [`Flight`] how far it is, without holding it (cheap to clone).
#[derive(Clone)]
pub(crate) enum Probe {
    Marker(Arc<dyn Backend>, u64),
    Threads(Arc<Running>),
}

impl Probe {
    /// Whether every copy has run (or failed), without waiting.
    ///
    /// # Safety
    /// The flight is not finished yet (its marker is live).
    pub(crate) unsafe fn is_done(&self) -> bool {
        match self {
            // SAFETY: the marker is live (the caller's promise).
            Probe::Marker(b, m) => unsafe { b.copies().marker_done(*m) }.unwrap_or(true),
            Probe::Threads(running) => running.is_none(),
        }
    }

    /// Make the work queued on `stream` from now on wait for these copies. Copies on threads
    /// have nothing a stream can wait on: this waits for them here.
    ///
    /// # Safety
    /// The flight is not finished yet; `stream` is a live stream of the device whose copy
    /// stream the flight is on.
    pub(crate) unsafe fn order_before(&self, stream: u64) -> Result<()> {
        match self {
            // SAFETY: the marker is live; the stream is the caller's promise.
            Probe::Marker(b, m) => unsafe { b.copies().stream_wait_marker(stream, *m) },
            Probe::Threads(running) => {
                running.wait_none();
                Ok(())
            }
        }
    }
}

impl Flight {
    /// A probe of this flight, valid until it is finished.
    pub(crate) fn probe(&self) -> Probe {
        match self {
            Flight::Stream {
                backend, marker, ..
            } => Probe::Marker(backend.clone(), *marker),
            Flight::Threads { running, .. } => Probe::Threads(running.clone()),
        }
    }

    /// Wait for every copy: the bytes moved, or the failure and the bytes moved before it.
    pub(crate) fn finish(self) -> (u64, Result<()>) {
        match self {
            Flight::Stream {
                backend,
                stream,
                marker,
                bytes,
            } => {
                let copies = backend.copies();
                // SAFETY: the marker is ours, waited once; then everything on the stream ran.
                let waited = unsafe { copies.marker_wait(marker) }
                    .or_else(|e| copies.synchronize(stream).map(|_| ()).or(Err(e)));
                // SAFETY: the stream is ours and idle (waited above).
                if let Err(e) = unsafe { copies.copy_stream_destroy(stream) } {
                    tracing::warn!(error = %e, "destroying a tier move's copy stream failed");
                }
                match waited {
                    Ok(()) => (bytes, Ok(())),
                    Err(e) => (0, Err(e)),
                }
            }
            Flight::Threads { handles, .. } => {
                let mut moved = 0u64;
                let mut failed = Ok(());
                for t in handles {
                    let (n, r) = t.join().unwrap_or_else(|_| {
                        let e = Error::Storage {
                            storage: "tier",
                            op: "copy",
                            detail: "an I/O thread of the move panicked".into(),
                        };
                        (0, Err(e))
                    });
                    moved += n;
                    if failed.is_ok() {
                        failed = r;
                    }
                }
                (moved, failed)
            }
        }
    }
}

/// A started copy of blocks: the flight, and what it moves.
pub(crate) struct Started {
    pub(crate) flight: Flight,
    pub(crate) bytes: u64,
    pub(crate) copies: usize,
    pub(crate) from: StorageKind,
    pub(crate) to: StorageKind,
}

/// Start copying `src_blocks` of `src` onto `dst_blocks` of `dst` (paired by position). With
/// `after`, device copies are ordered after the work queued so far on that stream. On an error
/// nothing is under way (what was queued ran) and the error is [`Error::TierMoveFailed`] once
/// any byte could have moved.
///
/// # Safety
/// Nobody else writes the source blocks, or uses the destination blocks, and both layouts
/// live, until the flight is finished; `after` is a live stream of the device of the move's
/// device pool.
pub(crate) unsafe fn start(
    src: &Layout,
    src_blocks: &[usize],
    dst: &Layout,
    dst_blocks: &[usize],
    after: Option<u64>,
) -> Result<Started> {
    let pieces = plan(src.views(), src_blocks, dst.views(), dst_blocks)?;
    let (sk, dk) = (src.storage(), dst.storage());
    let (from, to) = (end_of(src)?, end_of(dst)?);
    let way = way(&from, &to, sk, dk)?;
    let bytes: u64 = pieces.iter().map(|p| p.len).sum();
    let failed = |copied, e| Error::TierMoveFailed {
        blocks: src_blocks.len(),
        from: sk.name(),
        to: dk.name(),
        copied,
        bytes,
        source: Box::new(e),
    };
    if after.is_some() && way.device().is_none() {
        return Err(no_stream(sk, dk));
    }
    let flight = match way {
        Way::Cpu(op) => {
            // SAFETY: the caller's promise, forwarded.
            unsafe { on_threads(op, &pieces) }.map_err(|e| failed(0, e))?
        }
        Way::Streamed {
            backend,
            to_host,
            kernel,
        } => {
            let kernel = kernel && use_kernel(&pieces);
            // SAFETY: the caller's promise, forwarded.
            unsafe { streamed(backend, &pieces, to_host, kernel, after) }
                .map_err(|(copied, e)| failed(copied, e))?
        }
    };
    Ok(Started {
        flight,
        bytes,
        copies: pieces.len(),
        from: sk,
        to: dk,
    })
}

/// Copy `src_blocks` of `src` onto `dst_blocks` of `dst` (paired by position), two layouts of
/// one geometry, and wait. Device <-> host needs the host side pinned by the device pool's
/// backend (`LayoutBuilder::pinned`) or a host tier of the device (`Pool::host_tier`); host
/// <-> disk and host <-> host work with any host memory; device <-> disk and device <-> device
/// are refused (stage through a pinned layout).
///
/// Everything is checked before any byte moves. On a failure part way the source is intact and
/// the destination blocks hold unspecified bytes ([`super::KvTiers`] rolls its books back); the
/// error is [`Error::TierMoveFailed`] with the bytes copied.
///
/// # Safety
/// Nobody else writes the source blocks, or uses the destination blocks, until this returns.
pub unsafe fn copy_blocks(
    src: &Layout,
    src_blocks: &[usize],
    dst: &Layout,
    dst_blocks: &[usize],
) -> Result<MoveReport> {
    let started = Instant::now();
    // SAFETY: forwarded; the flight is finished before this returns, the layouts borrowed.
    let s = unsafe { start(src, src_blocks, dst, dst_blocks, None) }?;
    let (moved, r) = s.flight.finish();
    match r {
        Ok(()) => {
            let report = MoveReport {
                blocks: src_blocks.len(),
                bytes: s.bytes,
                copies: s.copies,
                elapsed: started.elapsed(),
            };
            tracing::debug!(from = %s.from.name(), to = %s.to.name(), blocks = report.blocks, bytes = s.bytes, copies = s.copies, elapsed = ?report.elapsed, "blocks moved");
            Ok(report)
        }
        Err(e) => Err(Error::TierMoveFailed {
            blocks: src_blocks.len(),
            from: s.from.name(),
            to: s.to.name(),
            copied: moved,
            bytes: s.bytes,
            source: Box::new(e),
        }),
    }
}

/// Queue every piece on a new copy stream of `backend` (to host memory when `to_host`), after
/// `after`'s work; a marker closes them. On a failure to queue, what was queued is waited for
/// and the stream destroyed: the error comes with the bytes that ran before it.
///
/// # Safety
/// Pool-side ranges are mapped memory of `backend`, host-side ranges its staging memory (any
/// host memory on a host backend), all alive and unshared until the flight is finished;
/// `after` a live stream of its device.
unsafe fn streamed(
    backend: &Arc<dyn Backend>,
    pieces: &[Piece],
    to_host: bool,
    kernel: bool,
    after: Option<u64>,
) -> std::result::Result<Flight, (u64, Error)> {
    let copies = backend.copies();
    let stream = copies.copy_stream_create().map_err(|e| (0, e))?;
    let mut queued = 0u64;
    let mut queue = || -> Result<u64> {
        if let Some(after) = after {
            // SAFETY: `after` is the caller's live stream, `stream` ours; the marker is
            // dropped once, after the copy stream's wait on it is queued.
            unsafe {
                let m = copies.marker_record(after)?;
                let waited = copies.stream_wait_marker(stream, m);
                copies.marker_drop(m).and(waited)?;
            }
        }
        if kernel {
            let gather: Vec<GatherPiece> = pieces
                .iter()
                .map(|p| GatherPiece {
                    src: p.src,
                    dst: p.dst,
                    len: p.len,
                })
                .collect();
            let shift = [GatherShift { src: 0, dst: 0 }];
            // SAFETY: the caller's promise for both ranges (pool memory the device maps: device
            // memory and a host tier of the device), finished before they go; the copy stream
            // is ours, never captured. A failure queues nothing.
            match unsafe { copies.gather_async(&gather, &shift, stream) } {
                Ok(()) => {
                    queued = pieces.iter().map(|p| p.len).sum();
                    // SAFETY: `stream` came from `copy_stream_create`.
                    return unsafe { copies.marker_record(stream) };
                }
                // A failed gather queued nothing: the copy engines do it.
                Err(e) => {
                    tracing::debug!(error = %e, "no gather kernel; a tier move copies piece by piece")
                }
            }
        }
        for p in pieces {
            // SAFETY: the caller's promise for both ranges; finished before they go.
            unsafe {
                if to_host {
                    copies.copy_to_host_async(p.dst as *mut u8, p.src, p.len as usize, stream)
                } else {
                    copies.copy_from_host_async(p.dst, p.src as *const u8, p.len as usize, stream)
                }
            }?;
            queued += p.len;
        }
        // SAFETY: `stream` came from `copy_stream_create`.
        unsafe { copies.marker_record(stream) }
    };
    match queue() {
        Ok(marker) => Ok(Flight::Stream {
            backend: backend.clone(),
            stream,
            marker,
            bytes: queued,
        }),
        Err(e) => {
            // Nothing may stay queued on the memory: wait for the stream, then let it go.
            let synced = copies.synchronize(stream);
            // SAFETY: ours, and idle after the synchronize.
            if let Err(e) = unsafe { copies.copy_stream_destroy(stream) } {
                tracing::warn!(error = %e, "destroying a tier move's copy stream failed");
            }
            Err((if synced.is_ok() { queued } else { 0 }, e))
        }
    }
}

/// A file a copy thread uses by pointer: it outlives the thread (the caller of [`on_threads`]
/// finishes the flight before the layout goes).
#[derive(Clone, Copy)]
struct CarriedFile(*const DiskFile);
// SAFETY: only shared access crosses (`DiskFile` is `Sync`: positional I/O on its files), and
// the file outlives the threads (see above).
unsafe impl Send for CarriedFile {}

/// What one copy thread does.
#[derive(Clone, Copy)]
enum ThreadOp {
    Memcpy,
    Write(CarriedFile),
    Read(CarriedFile),
}

impl ThreadOp {
    /// # Safety
    /// As for [`on_threads`].
    unsafe fn run(self, p: &Piece) -> Result<()> {
        match self {
            ThreadOp::Memcpy => {
                // SAFETY: both ranges are host memory of the layouts, alive and unshared until
                // the flight is finished; two layouts' slots do not overlap.
                unsafe {
                    std::ptr::copy_nonoverlapping(
                        p.src as *const u8,
                        p.dst as *mut u8,
                        p.len as usize,
                    )
                };
                Ok(())
            }
            // SAFETY: the file outlives the flight; the source is host memory of the layout,
            // readable while the flight lives.
            ThreadOp::Write(f) => unsafe { (*f.0).write_from(p.src, p.dst, p.len) },
            // SAFETY: as above; the destination is host memory of the layout, unshared.
            ThreadOp::Read(f) => unsafe { (*f.0).read_into(p.dst, p.src, p.len) },
        }
    }
}

/// Hand `pieces` to I/O threads, split to [`IO_PIECE`] and shared out by bytes.
///
/// # Safety
/// As for [`start`]: the ranges and the file live, and are not otherwise used, until the
/// flight is finished.
unsafe fn on_threads(op: CpuOp<'_>, pieces: &[Piece]) -> Result<Flight> {
    let mut split = Vec::with_capacity(pieces.len());
    for p in pieces {
        let mut at = 0;
        while at < p.len {
            let len = (p.len - at).min(IO_PIECE);
            split.push(Piece {
                src: p.src + at,
                dst: p.dst + at,
                len,
            });
            at += len;
        }
    }
    let bytes: u64 = split.iter().map(|p| p.len).sum();
    let threads = (bytes.div_ceil(IO_PIECE) as usize).clamp(1, IO_THREADS);
    let op = match op {
        CpuOp::Memcpy => ThreadOp::Memcpy,
        CpuOp::Write(f) => ThreadOp::Write(CarriedFile(f)),
        CpuOp::Read(f) => ThreadOp::Read(CarriedFile(f)),
    };
    let share = bytes.div_ceil(threads as u64).max(1);
    let mut handles = Vec::with_capacity(threads);
    let running = Arc::new(Running::default());
    let mut rest = split.as_slice();
    while !rest.is_empty() {
        let (mut n, mut sum) = (0, 0);
        while n < rest.len() && (n == 0 || sum < share) {
            sum += rest[n].len;
            n += 1;
        }
        let mine = rest[..n].to_vec();
        rest = &rest[n..];
        running.start_one();
        let done = Done(running.clone());
        let spawned = std::thread::Builder::new()
            .name("evmm-tier-io".into())
            .spawn(move || {
                let _done = done;
                #[cfg(test)]
                std::thread::sleep(Duration::from_millis(
                    IO_DELAY_MS.load(std::sync::atomic::Ordering::Relaxed),
                ));
                let mut moved = 0u64;
                for p in &mine {
                    // SAFETY: the caller's promise, carried to this thread.
                    if let Err(e) = unsafe { op.run(p) } {
                        return (moved, Err(e));
                    }
                    moved += p.len;
                }
                (moved, Ok(()))
            });
        match spawned {
            Ok(h) => handles.push(h),
            Err(e) => {
                // Those started finish before the error goes back: nothing stays under way.
                let _ = Flight::Threads { handles, running }.finish();
                return Err(Error::Storage {
                    storage: "tier",
                    op: "spawn",
                    detail: format!("an I/O thread for a tier move of {bytes} bytes: {e}"),
                });
            }
        }
    }
    Ok(Flight::Threads { handles, running })
}

/// Counts a copy thread out when it ends, panicking or not.
struct Done(Arc<Running>);

impl Drop for Done {
    fn drop(&mut self) {
        self.0.end_one();
    }
}
