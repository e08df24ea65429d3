//! Moving blocks between two layouts with NIXL: the blocks of both sides are pinned before any
//! NIXL call (an unbacked block is refused then), descriptors come from the registrations (one
//! per chunk touched on each side), the remote's metadata is reloaded only when its
//! registrations changed, and completion is awaited with a timeout.
//!
//! # Pins and timeouts
//! The pins hold from before the descriptors are taken until NIXL reports the request finished:
//! neither side's blocks can be released meanwhile, and their memory and registrations stay
//! even if a layout is dropped. On a timeout the request is *not* released: releasing a running
//! request asks the backend to cancel it, and UCX cannot promise that a put or get already
//! issued stops, nor can NIXL say whether it did. So the request goes, with its pins, to the
//! initiating agent's list of pending transfers, and the pins are dropped only once NIXL
//! reports the request finished (successfully or with an error): at the start of the agent's
//! next `transfer_blocks`, or at [`NixlAgent::reap_transfers`]. Until then a release of those
//! blocks is an [`Error::BlockPinned`] naming the transfer, and the remote's metadata is not
//! reloaded (that would disconnect the running request). A request that never finishes keeps
//! its memory for good (leaked when the agent goes), never freed under it. An error from NIXL
//! (posting, or a failed status) is taken to mean that NIXL stopped the request.

use std::fmt;
use std::sync::RwLockReadGuard;
use std::time::{Duration, Instant};

use nixl_sys::{XferDescList, XferOp, XferRequest, XferStatus};

use std::sync::Arc;

use super::agent::{available, nixl_error, AgentShared, NixlAgent};
use super::path::{self, Plan, Side, TransferPath, TransferVia};
use super::registered::registration_of;
use super::registry::NixlDescriptor;
use crate::backing::PinRefused;
use crate::error::{Error, Result};
use crate::layout::{KvLayout, LayoutPin, MemoryView};

/// The direction of a transfer, as the initiating (local) agent sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TransferOp {
    /// Local blocks are written into the remote blocks.
    Write,
    /// Remote blocks are read into the local blocks.
    Read,
}

impl TransferOp {
    fn name(self) -> &'static str {
        match self {
            TransferOp::Write => "WRITE",
            TransferOp::Read => "READ",
        }
    }

    fn nixl(self) -> XferOp {
        match self {
            TransferOp::Write => XferOp::Write,
            TransferOp::Read => XferOp::Read,
        }
    }
}

/// One side of a transfer: blocks of a layout registered with an agent.
#[derive(Clone, Copy)]
pub struct BlockSet<'a> {
    /// The agent the layout's memory is registered with.
    pub agent: &'a NixlAgent,
    /// The layout.
    pub layout: &'a dyn KvLayout,
    /// Its blocks, paired by position with the other side's.
    pub blocks: &'a [usize],
}

/// What a finished transfer did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TransferReport {
    /// Bytes moved.
    pub bytes: u64,
    /// Descriptor pairs posted (after merging contiguous pieces, split at chunks).
    pub descriptors: usize,
    /// From posting to completion.
    pub elapsed: Duration,
    /// Whether the remote's metadata had to be (re)loaded first.
    pub metadata_loaded: bool,
    /// How the bytes moved.
    pub path: TransferPath,
}

/// A request NIXL may still be running, with the pins on the memory it touches. Fields drop in
/// order: the request (released) before the pins.
pub(crate) struct Parked {
    req: XferRequest,
    _pins: [LayoutPin; 2],
    remote: String,
    op: &'static str,
    bytes: u64,
    since: Instant,
}

impl Parked {
    /// Whether NIXL says the request is still running (asking drives its progress).
    pub(crate) fn still_running(&self, agent: &nixl_sys::Agent) -> bool {
        matches!(agent.get_xfer_status(&self.req), Ok(XferStatus::InProgress))
    }
}

impl fmt::Display for Parked {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "NIXL {} of {} bytes to agent {:?}, timed out {:?} ago",
            self.op,
            self.bytes,
            self.remote,
            self.since.elapsed()
        )
    }
}

/// Ask NIXL about `agent`'s pending transfers and let the finished ones go (requests released,
/// then pins dropped, with no lock held). Returns how many are still running.
pub(crate) fn reap(agent: &AgentShared) -> usize {
    let (finished, running) = {
        // Shared: the remote metadata these requests use stays loaded while NIXL is asked.
        let _gate = agent
            .metadata_gate
            .read()
            .unwrap_or_else(|e| e.into_inner());
        let parked = std::mem::take(&mut *agent.pending.lock());
        if parked.is_empty() {
            return 0;
        }
        let (running, finished): (Vec<Parked>, Vec<Parked>) = parked
            .into_iter()
            .partition(|p| p.still_running(&agent.agent));
        let n = running.len();
        agent.pending.lock().extend(running);
        (finished, n)
    };
    for p in &finished {
        tracing::debug!(agent = %agent.name, "{p}: finished; its blocks are unpinned");
    }
    drop(finished);
    running
}

/// Keep `req` and `pins` on `agent`'s pending list when NIXL says the request is still
/// running; otherwise let them go.
fn park_or_drop(
    agent: &AgentShared,
    req: XferRequest,
    pins: [LayoutPin; 2],
    remote: &str,
    op: TransferOp,
    bytes: u64,
) {
    let parked = Parked {
        req,
        _pins: pins,
        remote: remote.to_owned(),
        op: op.name(),
        bytes,
        since: Instant::now(),
    };
    if parked.still_running(&agent.agent) {
        tracing::warn!(agent = %agent.name, "{parked}: still running; its blocks stay pinned until NIXL reports it finished");
        agent.pending.lock().push(parked);
    }
}

/// The error for a side whose pin was refused.
fn pin_error(side: &'static str, blocks: usize, e: PinRefused) -> Error {
    match e {
        PinRefused::NotBacked(block) => Error::BlockNotBacked {
            side,
            block,
            blocks,
        },
        PinRefused::Invalid(e) => e,
    }
}

/// Move `local.blocks` to `remote.blocks` (WRITE) or back (READ), block `i` of one side with
/// block `i` of the other, unit by unit (block, layer, outer index), so the two layouts may be
/// of different kinds but must have the same layers, outer dimension and unit size. The local
/// agent initiates. A block without memory on either side is refused before any NIXL call;
/// bytes outside every registration are an error naming them. Waits at most `timeout`.
///
/// The blocks of both sides are pinned for the whole transfer: a concurrent release of one is
/// an [`Error::BlockPinned`]. After a timeout ([`Error::TransferTimeout`]) they stay pinned
/// until NIXL reports the request finished; see the module documentation. Nobody else may write
/// the bytes the transfer reads or use the bytes it writes meanwhile (work queued on the GPU
/// over them included, on any stream: finish it first). Both sides naming the same bytes are
/// refused on the device-copy path.
///
/// The path is [`TransferVia::from_env`]'s: by default device memory is copied by the crate,
/// not by NIXL, which has no device path between two agents of one process (see
/// [`TransferVia`]); [`TransferReport::path`] says which path was taken.
pub fn transfer_blocks(
    op: TransferOp,
    local: BlockSet<'_>,
    remote: BlockSet<'_>,
    timeout: Duration,
) -> Result<TransferReport> {
    transfer_blocks_via(op, local, remote, timeout, TransferVia::from_env()?)
}

/// As [`transfer_blocks`], on the paths `via` allows. The crate's device copy has no timeout:
/// it is waited for to the end.
pub fn transfer_blocks_via(
    op: TransferOp,
    local: BlockSet<'_>,
    remote: BlockSet<'_>,
    timeout: Duration,
    via: TransferVia,
) -> Result<TransferReport> {
    let (lv, rv) = (local.layout.views(), remote.layout.views());
    if local.blocks.len() != remote.blocks.len() || local.blocks.is_empty() {
        return Err(Error::InvalidArgument(format!(
            "a transfer pairs blocks one to one: {} local and {} remote blocks given",
            local.blocks.len(),
            remote.blocks.len()
        )));
    }
    let (lc, rc) = (lv.config(), rv.config());
    let (lu, ru) = (lv.geometry().sizes().unit, rv.geometry().sizes().unit);
    if (lc.num_layers, lc.outer_dim, lu) != (rc.num_layers, rc.outer_dim, ru) {
        return Err(Error::InvalidLayout(format!(
            "layouts do not correspond: local has {} layers x {} outer of {lu} bytes per unit, remote {} x {} of {ru}",
            lc.num_layers, lc.outer_dim, rc.num_layers, rc.outer_dim
        )));
    }
    // One agent on both sides: a local transfer (host memory to its file through POSIX, say);
    // two agents of one name are refused.
    let same = Arc::ptr_eq(&local.agent.shared, &remote.agent.shared);
    if !same && local.agent.name() == remote.agent.name() {
        return Err(Error::InvalidArgument(format!(
            "both sides use a NIXL agent named {:?}: two agents need two names",
            local.agent.name()
        )));
    }
    let (lspace, lmem, ldev) = registration_of(lv)?;
    let (rspace, rmem, rdev) = registration_of(rv)?;
    // Indices first (an index past the end is an error naming it), then backing: the pins.
    let (local_units, remote_units) = (lv.units_of(local.blocks)?, rv.units_of(remote.blocks)?);
    let blocks = local.blocks.len();
    let (ls, rs) = (&local.agent.shared, &remote.agent.shared);
    let holder = format!(
        "a NIXL {} of {blocks} blocks between agents {:?} and {:?}",
        op.name(),
        ls.name,
        rs.name
    );
    let local_pin = local
        .layout
        .pin_blocks(local.blocks, &holder)
        .map_err(|e| pin_error("local", blocks, e))?;
    let remote_pin = remote
        .layout
        .pin_blocks(remote.blocks, &holder)
        .map_err(|e| pin_error("remote", blocks, e))?;
    // Pinned: the registrations under these blocks cannot go until the pins do.
    let pairs = merged_pairs(local_units, remote_units);
    let (mut ld, mut rd) = (Vec::new(), Vec::new());
    let (mut lp, mut rp) = (Vec::new(), Vec::new());
    for (l, r) in pairs {
        lp.clear();
        rp.clear();
        ls.descriptors_into(lspace, l, &mut lp)?;
        rs.descriptors_into(rspace, r, &mut rp)?;
        co_split(&lp, &rp, &mut ld, &mut rd);
    }
    let bytes: u64 = ld.iter().map(|d| d.len).sum();
    let plan = path::plan(
        via,
        op.name(),
        bytes,
        Side {
            layout: local.layout,
            mem: lmem,
            device: ldev,
        },
        Side {
            layout: remote.layout,
            mem: rmem,
            device: rdev,
        },
    )?;
    if let Plan::Copy(backend) = plan {
        let copies = path::copies(op == TransferOp::Write, &ld, &rd)?;
        let pins = [local_pin, remote_pin];
        let start = Instant::now();
        if let Err((e, running)) = path::run(&*backend, &copies) {
            if running {
                // Copies may still run on the device: their memory stays, pinned, for good.
                tracing::error!(error = %e, bytes, "a transfer's device copies could not be waited for: their blocks stay pinned");
                std::mem::forget(pins);
            }
            return Err(e);
        }
        let elapsed = start.elapsed();
        drop(pins);
        tracing::debug!(
            op = op.name(),
            bytes,
            copies = copies.len(),
            ?elapsed,
            "device copy done"
        );
        return Ok(TransferReport {
            bytes,
            descriptors: copies.len(),
            elapsed,
            metadata_loaded: false,
            path: TransferPath::DeviceCopy,
        });
    }

    available()?;
    reap(ls);
    let (_gate, metadata_loaded) = if same {
        // Nothing remote to load: NIXL moves between the agent's own registrations.
        let gate = ls.metadata_gate.read().unwrap_or_else(|e| e.into_inner());
        (gate, false)
    } else {
        sync_remote(ls, rs)?
    };
    let list = |descs: &[NixlDescriptor]| -> Result<XferDescList<'static>> {
        let mem = descs
            .first()
            .map_or(nixl_sys::MemType::Dram, |d| d.mem_type);
        let mut list = XferDescList::new(mem).map_err(|e| nixl_error("XferDescList::new", e))?;
        for d in descs {
            list.add_desc(d.addr as usize, d.len as usize, d.device_id);
        }
        Ok(list)
    };
    let (local_list, remote_list) = (list(&ld)?, list(&rd)?);
    let req = ls
        .agent
        .create_xfer_req(op.nixl(), &local_list, &remote_list, &rs.name, None)
        .map_err(|e| {
            nixl_error(
                "create_xfer_req",
                format!(
                    "{e} ({} of {bytes} bytes in {} descriptors from {:?} to {:?})",
                    op.name(),
                    ld.len(),
                    ls.name,
                    rs.name
                ),
            )
        })?;
    let pins = [local_pin, remote_pin];
    let start = Instant::now();
    let mut pending = match ls.agent.post_xfer_req(&req, None) {
        Ok(p) => p,
        Err(e) => {
            // Part of it may be on its way: keep the pins if NIXL says it runs.
            park_or_drop(ls, req, pins, &rs.name, op, bytes);
            return Err(nixl_error(
                "post_xfer_req",
                format!("{e} ({} of {bytes} bytes)", op.name()),
            ));
        }
    };
    while pending {
        match ls.agent.get_xfer_status(&req) {
            Ok(XferStatus::Success) => pending = false,
            Ok(XferStatus::InProgress) => {
                if start.elapsed() > timeout {
                    let waited_ms = start.elapsed().as_millis() as u64;
                    park_or_drop(ls, req, pins, &rs.name, op, bytes);
                    return Err(Error::TransferTimeout {
                        op: op.name(),
                        bytes,
                        descriptors: ld.len(),
                        waited_ms,
                    });
                }
                if start.elapsed() < Duration::from_millis(1) {
                    std::thread::yield_now();
                } else {
                    std::thread::sleep(Duration::from_micros(50));
                }
            }
            // NIXL reports the request failed: it no longer runs; the request goes, then
            // the pins.
            Err(e) => {
                drop(req);
                drop(pins);
                return Err(nixl_error(
                    "get_xfer_status",
                    format!("{e} ({} of {bytes} bytes)", op.name()),
                ));
            }
        }
    }
    let elapsed = start.elapsed();
    // Released before the pins (declaration order is the other way round).
    drop(req);
    drop(pins);
    tracing::debug!(
        op = op.name(),
        bytes,
        descriptors = ld.len(),
        ?elapsed,
        "NIXL transfer done"
    );
    Ok(TransferReport {
        bytes,
        descriptors: ld.len(),
        elapsed,
        metadata_loaded,
        path: TransferPath::Nixl,
    })
}

/// Pair units one to one, merging a pair into the previous one when both sides continue it.
fn merged_pairs(local: Vec<MemoryView>, remote: Vec<MemoryView>) -> Vec<(MemoryView, MemoryView)> {
    let mut out: Vec<(MemoryView, MemoryView)> = Vec::new();
    for (l, r) in local.into_iter().zip(remote) {
        match out.last_mut() {
            // Views of live layouts: their ends fit in 64 bits (checked anyway).
            Some((pl, pr)) if pl.end().ok() == Some(l.addr) && pr.end().ok() == Some(r.addr) => {
                pl.len += l.len;
                pr.len += r.len;
            }
            _ => out.push((l, r)),
        }
    }
    out
}

/// Cut two descriptor lists covering the same number of bytes at the union of their
/// boundaries, so that every pair has one length and each piece lies in one registration.
fn co_split(
    a: &[NixlDescriptor],
    b: &[NixlDescriptor],
    out_a: &mut Vec<NixlDescriptor>,
    out_b: &mut Vec<NixlDescriptor>,
) {
    let (mut i, mut j, mut oa, mut ob) = (0, 0, 0u64, 0u64);
    while i < a.len() && j < b.len() {
        let n = (a[i].len - oa).min(b[j].len - ob);
        out_a.push(NixlDescriptor {
            addr: a[i].addr + oa,
            len: n,
            ..a[i]
        });
        out_b.push(NixlDescriptor {
            addr: b[j].addr + ob,
            len: n,
            ..b[j]
        });
        oa += n;
        ob += n;
        if oa == a[i].len {
            i += 1;
            oa = 0;
        }
        if ob == b[j].len {
            j += 1;
            ob = 0;
        }
    }
}

/// Make sure `local` holds `remote`'s current metadata (reloading it if the remote's
/// registrations changed since it was loaded) and return the shared gate that keeps it from
/// being reloaded while the caller uses it.
fn sync_remote<'a>(
    local: &'a AgentShared,
    remote: &AgentShared,
) -> Result<(RwLockReadGuard<'a, ()>, bool)> {
    let want = remote.registry.lock().generation;
    let read = || {
        local
            .metadata_gate
            .read()
            .unwrap_or_else(|e| e.into_inner())
    };
    if local.loaded.lock().get(&remote.name) == Some(&want) {
        return Ok((read(), false));
    }
    {
        let _exclusive = local
            .metadata_gate
            .write()
            .unwrap_or_else(|e| e.into_inner());
        let want = remote.registry.lock().generation;
        let loaded = local.loaded.lock().get(&remote.name).copied();
        if loaded.is_some() && loaded != Some(want) {
            // Forgetting the remote's metadata would pull it from under requests to it that
            // may still run (parked after a timeout).
            let running = local
                .pending
                .lock()
                .iter()
                .filter(|p| p.remote == remote.name)
                .count();
            if running > 0 {
                return Err(nixl_error(
                    "invalidate_remote_md",
                    format!(
                        "{:?} must reload the metadata of {:?} (its registrations changed) but {running} timed-out transfer(s) to it may still run; NixlAgent::reap_transfers lets them go once NIXL reports them finished",
                        local.name, remote.name
                    ),
                ));
            }
        }
        if loaded != Some(want) {
            let md = remote.agent.get_local_md().map_err(|e| {
                nixl_error("get_local_md", format!("{e} (agent {:?})", remote.name))
            })?;
            if loaded.is_some() {
                local
                    .agent
                    .invalidate_remote_md(&remote.name)
                    .map_err(|e| {
                        nixl_error(
                            "invalidate_remote_md",
                            format!("{e} ({:?} forgetting {:?})", local.name, remote.name),
                        )
                    })?;
                local.loaded.lock().remove(&remote.name);
            }
            local.agent.load_remote_md(&md).map_err(|e| {
                nixl_error(
                    "load_remote_md",
                    format!("{e} ({:?} loading {:?})", local.name, remote.name),
                )
            })?;
            local.loaded.lock().insert(remote.name.clone(), want);
            tracing::debug!(local = %local.name, remote = %remote.name, generation = want, "remote NIXL metadata loaded");
        }
    }
    Ok((read(), true))
}
