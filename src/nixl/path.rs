//! Which path a transfer's bytes take. Transfers here are between agents of one process (both
//! [`NixlAgent`](super::NixlAgent)s live in it), and between two agents of one process NIXL's
//! UCX moves device memory only by software emulation over TCP loopback: 0.3-0.5 GB/s on an
//! H100, for VMM and `cuMemAlloc` memory alike, where a device copy runs at over 1,000 GB/s
//! (`../shared/recipes/nixl.md`; between two processes the wheel's UCX has the same fallback for
//! VMM memory, since its `cuda_ipc` exports VMM memory only through fabric handles or a
//! POSIX-fd path it was built without).
//!
//! So a transfer never runs at that speed silently. With [`TransferVia::Auto`] (the default):
//! - no side is device memory, or one side is a file: NIXL (UCX moves host memory with shared
//!   memory or CMA, POSIX moves files, GDS moves device memory to files);
//! - device memory on both sides, of one device, both in pools: the crate's own copy on the
//!   device (the pools' backend: one gather launch, or a batch of copies, on a stream of its
//!   own, waited for with the blocks pinned), reported as [`TransferPath::DeviceCopy`];
//! - anything else with device memory (the caller's own memory, two devices, device and host
//!   memory, which UCX's path in one process was not measured for): refused before any byte
//!   moves ([`Error::NixlNoDevicePath`]), naming the override.
//!
//! [`TransferVia::Nixl`], or `EVMM_NIXL_VIA=nixl` in the environment (read once, at the first
//! transfer), sends every transfer through NIXL: for a UCX built with a device path for this
//! memory, or to measure NIXL.

use std::sync::{Arc, OnceLock};

use nixl_sys::MemType;

use super::registry::NixlDescriptor;
use crate::backend::{gather_or_copy_async, Backend, GatherPiece, GatherShift};
use crate::error::{Error, Result};
use crate::layout::KvLayout;

/// The environment variable that sets [`TransferVia::from_env`]: `auto` or `nixl`.
pub const VIA_ENV: &str = "EVMM_NIXL_VIA";

/// What a caller does to send device memory through NIXL anyway.
const REMEDY: &str = "transfer_blocks_via(.., TransferVia::Nixl), or EVMM_NIXL_VIA=nixl set before the process's first transfer, sends it through NIXL anyway";

/// How a finished transfer moved its bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TransferPath {
    /// Through NIXL (its UCX, POSIX or GDS backend).
    Nixl,
    /// The crate's own copy on the device: device memory of one process, where UCX has no
    /// device path (see the module documentation).
    DeviceCopy,
}

/// Which paths a transfer may take.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum TransferVia {
    /// NIXL for host memory and files, the crate's device copy for device memory, a refusal
    /// where neither has a device path (see the module documentation).
    #[default]
    Auto,
    /// Always NIXL, whatever its speed.
    Nixl,
}

impl TransferVia {
    /// From [`VIA_ENV`]: `nixl`, or `auto` (also when unset); anything else is an error
    /// quoting it. Read once per process.
    pub fn from_env() -> Result<Self> {
        static VIA: OnceLock<Option<String>> = OnceLock::new();
        match VIA.get_or_init(|| std::env::var(VIA_ENV).ok()).as_deref() {
            None | Some("auto") | Some("") => Ok(TransferVia::Auto),
            Some("nixl") => Ok(TransferVia::Nixl),
            Some(other) => Err(Error::InvalidArgument(format!(
                "{VIA_ENV}={other:?}: expected auto or nixl"
            ))),
        }
    }
}

/// One side of a transfer as the choice sees it.
pub(super) struct Side<'a> {
    pub(super) layout: &'a dyn KvLayout,
    pub(super) mem: MemType,
    pub(super) device: u64,
}

/// What a transfer will do.
pub(super) enum Plan {
    Nixl,
    /// Copy with this backend's device copies.
    Copy(Arc<dyn Backend>),
}

/// Choose the path for an `op` of `bytes` between `local` and `remote` (see the module
/// documentation).
pub(super) fn plan(
    via: TransferVia,
    op: &'static str,
    bytes: u64,
    local: Side<'_>,
    remote: Side<'_>,
) -> Result<Plan> {
    let device = |s: &Side<'_>| s.mem == MemType::Vram;
    let file = |s: &Side<'_>| s.mem == MemType::File;
    if via == TransferVia::Nixl
        || !(device(&local) || device(&remote))
        || file(&local)
        || file(&remote)
    {
        return Ok(Plan::Nixl);
    }
    let refuse = |why: String| Error::NixlNoDevicePath {
        op,
        bytes,
        why,
        remedy: REMEDY,
    };
    if !(device(&local) && device(&remote)) {
        return Err(refuse(
            "device memory to or from host memory in one process: the crate's device copy does not cover it, and UCX's path for it there was not measured (device to device it is software emulation over TCP loopback)".into(),
        ));
    }
    if local.device != remote.device {
        return Err(refuse(format!(
            "device memory of devices {} and {}, which UCX moves over TCP loopback in one process and the crate's device copy does not cover",
            local.device, remote.device
        )));
    }
    let (Some(lp), Some(rp)) = (local.layout.pool_of(), remote.layout.pool_of()) else {
        return Err(refuse(
            "a side is memory the caller owns, with no pool whose backend the crate could copy with, and UCX moves device memory over TCP loopback in one process".into(),
        ));
    };
    let ordinal = |p: &crate::Pool| p.backend_info().device_ordinal;
    if ordinal(lp) != ordinal(rp) {
        return Err(refuse(format!(
            "the pools' backends are of devices {:?} and {:?}, which the crate's device copy does not cover, and UCX moves device memory over TCP loopback in one process",
            ordinal(lp),
            ordinal(rp)
        )));
    }
    Ok(Plan::Copy(lp.backend().clone()))
}

/// The copies of a transfer, `(dst, src, bytes)` per descriptor pair, checked: no destination
/// overlaps another copy's destination or any source (a transfer within one layout may name
/// the same bytes on both sides).
pub(super) fn copies(
    write: bool,
    local: &[NixlDescriptor],
    remote: &[NixlDescriptor],
) -> Result<Vec<(u64, u64, usize)>> {
    let mut out = Vec::with_capacity(local.len());
    for (l, r) in local.iter().zip(remote) {
        let (dst, src) = if write { (r, l) } else { (l, r) };
        let len = usize::try_from(l.len).map_err(|_| {
            Error::InvalidArgument(format!("a descriptor of {} bytes on this host", l.len))
        })?;
        out.push((dst.addr, src.addr, len));
    }
    // Destinations sorted by start: each must end before the next starts, and no source may
    // meet one.
    let mut dsts: Vec<(u64, u64)> = out
        .iter()
        .map(|&(d, _, n)| (d, d.saturating_add(n as u64)))
        .collect();
    dsts.sort_unstable();
    let clash = |what: &str, a: (u64, u64), b: (u64, u64)| {
        Error::InvalidArgument(format!(
            "a transfer's {what} overlap: [{:#x}, {:#x}) and [{:#x}, {:#x})",
            a.0, a.1, b.0, b.1
        ))
    };
    for w in dsts.windows(2) {
        if w[1].0 < w[0].1 {
            return Err(clash("destinations", w[0], w[1]));
        }
    }
    for &(_, s, n) in &out {
        let src = (s, s.saturating_add(n as u64));
        // The last destination starting before the source ends is the only one that can meet it.
        let i = dsts.partition_point(|d| d.0 < src.1);
        if let Some(&d) = i.checked_sub(1).and_then(|i| dsts.get(i)) {
            if d.1 > src.0 {
                return Err(clash("source and destination", src, d));
            }
        }
    }
    Ok(out)
}

/// Copy `copies` with `backend` on a stream of its own and wait for them: one launch of the
/// backend's gather kernel, or (without one) a batch of copies. The caller holds pins on both
/// sides' blocks (mapped, with access, not released meanwhile) and has checked them with
/// [`copies`]. `Err(_, true)`: the wait itself failed, so copies may still run on the device,
/// and the caller must keep its pins for good. After any error the destination's bytes are
/// unspecified.
pub(super) fn run(
    backend: &dyn Backend,
    copies: &[(u64, u64, usize)],
) -> std::result::Result<(), (Error, bool)> {
    let c = backend.copies();
    let stream = c.copy_stream_create().map_err(|e| (e, false))?;
    let pieces: Vec<GatherPiece> = copies
        .iter()
        .map(|&(dst, src, len)| GatherPiece {
            src,
            dst,
            len: len as u64,
        })
        .collect();
    // SAFETY: every range lies in pinned, mapped device memory of this backend's device (the
    // pins hold until after the wait below); `copies` checked that no destination overlaps
    // another copy's bytes; the stream was created just now and is never captured. Ordering
    // with other work on these bytes is left to the caller, as `transfer_blocks` documents
    // (as for NIXL's own transfers): work queued over them, on any stream, is finished, and
    // no other transfer writes them meanwhile (pins are shared, so one is not refused).
    let queued =
        unsafe { gather_or_copy_async(c, &pieces, &[GatherShift { src: 0, dst: 0 }], stream) };
    // Waited for also after a failed queueing: part of the batch may be on its way.
    let waited = c.synchronize(stream);
    if let Err(e) = waited {
        // The stream is not destroyed either: work on it may still run.
        return Err((e, true));
    }
    // SAFETY: created above, destroyed once, with nothing on it still running.
    if let Err(e) = unsafe { c.copy_stream_destroy(stream) } {
        tracing::warn!(error = %e, "a transfer's copy stream could not be destroyed");
    }
    queued.map_err(|e| (e, false))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn d(addr: u64, len: u64) -> NixlDescriptor {
        NixlDescriptor {
            addr,
            len,
            device_id: 0,
            mem_type: MemType::Vram,
        }
    }

    #[test]
    fn copies_pair_descriptors_by_direction_and_refuse_overlaps() {
        let (l, r) = ([d(0, 16), d(64, 16)], [d(128, 16), d(256, 16)]);
        assert_eq!(
            copies(true, &l, &r).unwrap(),
            vec![(128, 0, 16), (256, 64, 16)]
        );
        assert_eq!(
            copies(false, &l, &r).unwrap(),
            vec![(0, 128, 16), (64, 256, 16)]
        );
        // A WRITE whose destination meets its own source.
        let e = copies(true, &[d(0, 16)], &[d(8, 16)]).unwrap_err();
        assert!(e.to_string().contains("overlap"), "{e}");
        // Two destinations meeting.
        let e = copies(true, &[d(0, 16), d(100, 16)], &[d(200, 16), d(210, 16)]).unwrap_err();
        assert!(e.to_string().contains("destinations"), "{e}");
        // Touching is not overlapping.
        assert!(copies(true, &[d(0, 16)], &[d(16, 16)]).is_ok());
        // One copy's source meeting another copy's destination, apart in the sort order.
        let e = copies(true, &[d(0, 16), d(500, 16)], &[d(1000, 16), d(4, 16)]).unwrap_err();
        assert!(e.to_string().contains("source and destination"), "{e}");
    }
}
