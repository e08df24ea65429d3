//! The sending side: grant a peer access to blocks of a layout. The blocks are pinned, the
//! chunks under them exported as descriptors and sent with the layout's shape; the pins stay
//! until the receiver says it let go (or its process exited).

use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::os::fd::OwnedFd;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::cache::{self, KeptOut};
use super::link::{send, GrantPin, GrantStatus, LinkShared, OutGrant, PeerLink};
use super::path::TransferPath;
use super::wire::{
    GrantMode, Msg, WireChunk, WireLayout, BLOCKS_PER_FRAME, MAX_GRANT_BLOCKS, MAX_GRANT_CHUNKS,
    MAX_KEPT_IMPORTS,
};
use crate::backend::{AccessMode, DeviceReach, MemoryKind, PhysicalChunk};
use crate::backing::BlockGeometry;
use crate::error::{Error, Result};
use crate::ipc::{FrameWriter, MAX_FDS};
use crate::layout::{ElasticLayout, LayoutConfig, LayoutKind};
use crate::Pool;

/// A grant as its sender holds it. Dropping the handle does not end the grant: the blocks stay
/// pinned until the receiver lets go (or exits).
pub struct Grant {
    link: Arc<LinkShared>,
    writer: FrameWriter,
    id: u64,
    bytes: u64,
    chunks: usize,
    descriptors: usize,
    blocks: usize,
}

impl PeerLink {
    /// Grant the peer `access` to `blocks` of `layout`: pin them, export the chunks under them
    /// (POSIX descriptors) and send them with the layout's shape. The receiver takes it with
    /// [`PeerLink::recv_grant`] and copies the blocks into its own layout.
    ///
    /// Refused before anything is pinned, exported or sent: a link that is closed, no blocks or
    /// more than [`MAX_GRANT_BLOCKS`], a layout whose memory cannot be exported (host: a backend
    /// without [`crate::backend::host::ChunkFiles::PerChunk`]) or is not the kind the peer maps,
    /// a block out of range or not backed.
    ///
    /// The chunks are whole pages: a page shared with a block not granted is readable by the
    /// peer too. The blocks' bytes must be complete when granting (on a GPU: synchronize the
    /// streams that wrote them; a host-to-device copy from pageable memory may return before
    /// its DMA landed), and the sender must not write granted blocks until the grant is final
    /// ([`Grant::wait_released`], [`Grant::revoke`]): the receiver reads them meanwhile.
    pub fn grant(
        &self,
        layout: &ElasticLayout,
        blocks: &[usize],
        access: AccessMode,
    ) -> Result<Grant> {
        self.grant_as(layout, blocks, access, GrantMode::Copy)
    }

    /// Hand `blocks` of `layout` over to the peer without a copy: as [`PeerLink::grant`]
    /// (read-write), and once the receiver took the chunks into its own layout
    /// ([`crate::p2p::ImportedGrant::adopt_into`], charged to its pool there), the blocks are
    /// released here and their chunks let go at once, never reused here
    /// ([`GrantStatus::HandedOff`]). If the receiver copies or drops the grant instead, the
    /// blocks stay here as after any grant.
    ///
    /// Each block must own whole pages: every span of it starts and ends on a page boundary
    /// of the layout's backing (else an error before anything is pinned).
    pub fn hand_off(&self, layout: &ElasticLayout, blocks: &[usize]) -> Result<Grant> {
        let link = self.shared();
        if link.peer.reaches_us != DeviceReach::Same
            && link.peer.endpoint.memory == MemoryKind::Device
        {
            // Its layout would hold memory of another GPU than its own.
            return Err(link.peer_error(
                "hand off",
                format!(
                    "the peer's device is not ours ({:?} from there): a hand-off stays on one GPU; grant the blocks for copying instead",
                    link.peer.reaches_us
                ),
            ));
        }
        if let Some(lender) = layout.backing().pool().backend().chunk_lender() {
            // Released here, the chunks would go back to their lender, which hands them to
            // someone else while the receiver still uses them.
            return Err(Error::InvalidArgument(format!(
                "the layout's chunks are lent by {lender}: they go back to it when released here, so they cannot be handed off to {} (grant them for copying instead)",
                self.peer().name
            )));
        }
        let page = layout.backing().page_size();
        let geometry = layout.backing().geometry();
        let n = geometry.num_blocks();
        let mut spans = Vec::new();
        for &b in blocks {
            if b >= n {
                return Err(Error::InvalidArgument(format!(
                    "block {b} does not exist: the layout has {n} blocks"
                )));
            }
            spans.clear();
            geometry.block_spans(b, &mut spans);
            if let Some(&(at, len)) = spans
                .iter()
                .find(|(at, len)| at % page != 0 || len % page != 0)
            {
                return Err(Error::InvalidArgument(format!(
                    "block {b}: its span [{at:#x}, +{len}) does not cover whole pages of {page} bytes, so its memory cannot be handed off alone: copy it instead"
                )));
            }
        }
        self.grant_as(layout, blocks, AccessMode::ReadWrite, GrantMode::HandOff)
    }

    fn grant_as(
        &self,
        layout: &ElasticLayout,
        blocks: &[usize],
        access: AccessMode,
        mode: GrantMode,
    ) -> Result<Grant> {
        let link = self.shared();
        if blocks.is_empty() || blocks.len() > MAX_GRANT_BLOCKS {
            return Err(Error::InvalidArgument(format!(
                "a grant holds 1 to {MAX_GRANT_BLOCKS} blocks, {} given",
                blocks.len()
            )));
        }
        let backing = layout.backing();
        let pool = backing.pool();
        self.check_exportable(pool)?;
        let id = {
            let mut st = link.state.lock();
            st.next_grant += 1;
            st.next_grant
        };
        let holder = format!("p2p grant {id} to {}", link.peer.name);
        let pin = layout.pin(blocks.iter().copied(), &holder)?;
        // The chunks under every span of every block, each once, in address order.
        let geometry = backing.geometry();
        let mut chunks: BTreeMap<u64, PhysicalChunk> = BTreeMap::new();
        let mut spans = Vec::new();
        for &b in blocks {
            spans.clear();
            geometry.block_spans(b, &mut spans);
            for &(at, len) in &spans {
                let under = backing.placed_chunks_in(at, len);
                let covered: u64 = under
                    .iter()
                    .map(|(o, c)| (o + c.size as u64).min(at + len) - (*o).max(at))
                    .sum();
                if covered != len {
                    return Err(Error::InvalidArgument(format!(
                        "block {b}: its span [{at:#x}, +{len}) has only {covered} bytes mapped although the block is pinned"
                    )));
                }
                chunks.extend(under);
            }
        }
        let layout_desc = WireLayout::of(layout.config(), layout.kind());
        let wire_blocks: Vec<u64> = blocks.iter().map(|&b| b as u64).collect();
        self.send_out(
            id,
            GrantPin::Blocks(pin),
            pool,
            chunks,
            (mode, access),
            layout_desc,
            wire_blocks,
        )
    }

    /// Grant the peer `access` to `[offset, offset + len)` of `pool`'s reservation, mapped
    /// through the range API (the pool's own [`Pool::map`], or a [`crate::Region`]'s: its
    /// [`crate::Region::offset`] plus the offset in it) and made of whole chunks: the range is
    /// pinned against unmapping until the receiver lets go. The receiver sees it as one block
    /// of `len` bytes (a fully contiguous layout of one block, one layer, `len` one-byte
    /// elements) and copies it with [`crate::p2p::ImportedGrant::copy_to`].
    pub fn grant_range(
        &self,
        pool: &Pool,
        offset: u64,
        len: u64,
        access: AccessMode,
    ) -> Result<Grant> {
        self.check_exportable(pool)?;
        let inner = usize::try_from(len)
            .ok()
            .filter(|&l| l > 0)
            .ok_or(Error::ZeroSize {
                what: "granted range",
            })?;
        let link = self.shared();
        let id = {
            let mut st = link.state.lock();
            st.next_grant += 1;
            st.next_grant
        };
        let pin = pool.pin_range(offset, len)?;
        let end = offset + len;
        let under = pool.placed_chunks_in(offset, len);
        let first = under.first().map_or(offset, |(o, _)| *o);
        let last = under.last().map_or(offset, |(o, c)| o + c.size as u64);
        if first != offset || last != end {
            return Err(Error::InvalidArgument(format!(
                "[{offset:#x}, {end:#x}) is not made of whole chunks: the chunks under it span [{first:#x}, {last:#x}); grant whole chunks"
            )));
        }
        let chunks: BTreeMap<u64, PhysicalChunk> =
            under.into_iter().map(|(o, c)| (o - offset, c)).collect();
        let shape = LayoutConfig::new(1, 1, 1, 1, inner, 1);
        self.send_out(
            id,
            GrantPin::Range(pin),
            pool,
            chunks,
            (GrantMode::Copy, access),
            WireLayout::of(&shape, LayoutKind::FullyContiguous),
            vec![0],
        )
    }

    /// Refuse memory that cannot go to this peer: a closed link, memory that cannot be
    /// exported, or of another kind than the peer maps.
    fn check_exportable(&self, pool: &Pool) -> Result<()> {
        let link = self.shared();
        if let Some(why) = link.state.lock().closed.clone() {
            return Err(link.peer_error("grant", format!("link closed: {why}")));
        }
        let info = pool.backend_info();
        if !info.posix_fd_exportable {
            return Err(Error::InvalidArgument(format!(
                "the layout's memory ({} backend, {}) cannot be exported as POSIX descriptors: {}",
                info.name,
                info.device_name,
                if info.name == "host" {
                    "create the host backend with ChunkFiles::PerChunk"
                } else {
                    "the device has no POSIX-fd handles; move blocks with NIXL"
                }
            )));
        }
        if info.memory_kind != link.peer.endpoint.memory {
            return Err(link.peer_error(
                "grant",
                format!(
                    "the layout holds {:?} memory, the peer maps {:?} memory ({})",
                    info.memory_kind, link.peer.endpoint.memory, link.path.reason
                ),
            ));
        }
        let ours = link.backend.info();
        if info.device_uuid != ours.device_uuid {
            // The peer found how it reaches the link's GPU, not this one.
            return Err(Error::InvalidArgument(format!(
                "the layout's memory is on device {:?}, the link's backend on device {:?}: grant over a link opened with the layout's backend",
                info.device_ordinal, ours.device_ordinal
            )));
        }
        if link.path.path != TransferPath::PeerImport {
            return Err(link.peer_error(
                "grant",
                format!(
                    "the peer cannot import our chunks: the link's path is {} ({})",
                    link.path.path, link.path.reason
                ),
            ));
        }
        Ok(())
    }

    /// Export `chunks` (offsets relative to the granted range's origin), record the grant
    /// with its pin, and send it.
    #[allow(clippy::too_many_arguments)]
    fn send_out(
        &self,
        id: u64,
        pin: GrantPin,
        pool: &Pool,
        chunks: BTreeMap<u64, PhysicalChunk>,
        (mode, access): (GrantMode, AccessMode),
        layout_desc: WireLayout,
        wire_blocks: Vec<u64>,
    ) -> Result<Grant> {
        let link = self.shared();
        if chunks.len() > MAX_GRANT_CHUNKS {
            return Err(Error::InvalidArgument(format!(
                "the memory granted lies on {} chunks; a grant holds at most {MAX_GRANT_CHUNKS}: grant less at a time",
                chunks.len()
            )));
        }
        let backend = pool.backend();
        let bk = cache::backend_key(backend);
        // Chunks granted for copying stay imported at the peer (see `cache`); hand-offs are
        // taken over there, so they go fresh.
        let keep = mode == GrantMode::Copy;
        let bytes: u64 = chunks.values().map(|c| c.size as u64).sum();
        let blocks = wire_blocks.len();
        let mut fds: HashMap<u64, OwnedFd> = HashMap::new();
        let mut spare: Vec<OwnedFd> = Vec::new();
        // The keys the peer keeps the chunks under (none for a hand-off).
        let keys_now = || match keep {
            true => cache::keys_of(bk, chunks.values().map(|c| c.raw), link),
            false => vec![None; chunks.len()],
        };
        let (sending, out) = loop {
            // Descriptors for what the peer does not keep: driver calls, with no lock held.
            for ((&off, &c), k) in chunks.iter().zip(keys_now()) {
                if k.is_none() && !fds.contains_key(&off) {
                    fds.insert(off, backend.export_chunk(c)?);
                }
            }
            let sending = link.send_lock.lock();
            // A kept chunk forgotten meanwhile (the peer's link is ending) needs a descriptor.
            let known = keys_now();
            if chunks
                .keys()
                .zip(&known)
                .any(|(off, k)| k.is_none() && !fds.contains_key(off))
            {
                continue;
            }
            let mut st = link.state.lock();
            // Closed meanwhile: the reader settled the grants it knew of and will not see this
            // one, and nothing of it was sent. The pin drops after the locks.
            if let Some(why) = st.closed.clone() {
                drop(st);
                drop(sending);
                drop(pin);
                return Err(link.peer_error("grant", format!("link closed: {why}")));
            }
            let mut out = Vec::with_capacity(chunks.len());
            for ((&off, &c), k) in chunks.iter().zip(known) {
                let size = c.size as u64;
                let how = match k {
                    Some(k) => {
                        // A descriptor made before another grant recorded the chunk: unused,
                        // closed after the locks.
                        spare.extend(fds.remove(&off));
                        WireChunk::Kept(k)
                    }
                    // No more than the peer keeps: past that it would import the chunk for
                    // this grant alone, and a grant naming it kept meanwhile be refused.
                    None if keep && st.kept_out.len() < MAX_KEPT_IMPORTS => {
                        st.last_key += 1;
                        let k = st.last_key;
                        st.kept_out.insert(
                            k,
                            KeptOut {
                                backend: bk,
                                raw: c.raw,
                                size,
                                forgetting: false,
                            },
                        );
                        cache::record(bk, c.raw, link, k);
                        WireChunk::Keep(k)
                    }
                    None => WireChunk::New,
                };
                out.push((off, size, how, fds.remove(&off)));
            }
            st.out.insert(
                id,
                OutGrant {
                    pin: Some(pin),
                    bytes,
                    mode,
                    status: GrantStatus::Held,
                    detached: false,
                },
            );
            break (sending, out);
        };
        let count = out.len();
        let descriptors = out.iter().filter(|c| c.3.is_some()).count();
        // Queued under the send lock: a key goes out after the descriptor that made it.
        let sent = send_grant(
            self.writer(),
            id,
            mode,
            access,
            layout_desc,
            wire_blocks,
            out,
        );
        drop(sending);
        drop(spare);
        if let Err(e) = sent {
            // Some chunks may have reached the peer: the pins stay until it lets go or exits.
            // Shutting the link down makes a conforming peer drop what it got.
            tracing::error!(peer = %link.peer.name, grant = id, error = %e, "sending a grant failed; closing the link");
            // No `Grant` handle will exist: the entry goes once its pin does (now, if the
            // reader already dropped it for a peer that exited).
            let mut st = link.state.lock();
            if let Some(g) = st.out.get_mut(&id) {
                g.detached = true;
                if g.pin.is_none() {
                    st.out.remove(&id);
                }
            }
            drop(st);
            link.shutdown();
            return Err(e);
        }
        tracing::debug!(peer = %link.peer.name, grant = id, blocks, chunks = count, descriptors, bytes, ?access, ?mode, path = %link.path.path, "granted");
        Ok(Grant {
            link: link.clone(),
            writer: self.writer().clone(),
            id,
            bytes,
            chunks: count,
            descriptors,
            blocks,
        })
    }
}

/// Queue a grant's messages: its chunks, [`MAX_FDS`] to a frame, the blocks beyond the last
/// [`BLOCKS_PER_FRAME`], that many to a frame, then the grant with the last ones.
fn send_grant(
    writer: &FrameWriter,
    id: u64,
    mode: GrantMode,
    access: AccessMode,
    layout: WireLayout,
    blocks: Vec<u64>,
    chunks: Vec<(u64, u64, WireChunk, Option<OwnedFd>)>,
) -> Result<()> {
    let total = chunks.len() as u64;
    let mut it = chunks.into_iter().peekable();
    while it.peek().is_some() {
        let batch: Vec<_> = it.by_ref().take(MAX_FDS).collect();
        let (mut offsets, mut sizes, mut how, mut out) =
            (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        for (o, s, h, fd) in batch {
            offsets.push(o);
            sizes.push(s);
            how.push(h);
            out.extend(fd);
        }
        send(
            writer,
            Msg::Chunks {
                grant: id,
                offsets,
                sizes,
                how,
            },
            out,
        )?;
    }
    // Every frame but the grant's holds a full batch; the grant holds the rest (1 or more).
    let ahead = blocks.len().saturating_sub(1) / BLOCKS_PER_FRAME * BLOCKS_PER_FRAME;
    let mut blocks = blocks;
    let last = blocks.split_off(ahead);
    for batch in blocks.chunks(BLOCKS_PER_FRAME) {
        send(
            writer,
            Msg::Blocks {
                grant: id,
                blocks: batch.to_vec(),
            },
            Vec::new(),
        )?;
    }
    send(
        writer,
        Msg::Grant {
            grant: id,
            mode,
            access,
            layout,
            blocks: last,
            chunks: total,
        },
        Vec::new(),
    )
}

impl Grant {
    /// The grant's number on its link.
    pub fn id(&self) -> u64 {
        self.id
    }

    /// Bytes of the chunks exported (whole pages under the blocks).
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// Chunks granted.
    pub fn chunks(&self) -> usize {
        self.chunks
    }

    /// Chunks sent as descriptors; the others the peer kept imported from earlier grants
    /// (see [`crate::p2p`], "Kept imports").
    pub fn descriptors(&self) -> usize {
        self.descriptors
    }

    /// Blocks granted.
    pub fn blocks(&self) -> usize {
        self.blocks
    }

    /// Where the grant stands now.
    pub fn status(&self) -> GrantStatus {
        self.link
            .state
            .lock()
            .out
            .get(&self.id)
            .map_or(GrantStatus::Released, |g| g.status.clone())
    }

    /// Wait up to `timeout` for the receiver to let go (it released the grant, refused it, or
    /// exited); the blocks are unpinned then. A timeout is an error and changes nothing.
    pub fn wait_released(&self, timeout: Duration) -> Result<GrantStatus> {
        // A timeout too long to add to now waits for good.
        let deadline = Instant::now().checked_add(timeout);
        let (st, ok) = self.link.wait_until(deadline, |st| {
            st.out.get(&self.id).is_none_or(|g| g.status.is_final())
        });
        let status = st
            .out
            .get(&self.id)
            .map_or(GrantStatus::Released, |g| g.status.clone());
        drop(st);
        if !ok {
            return Err(self.link.peer_error(
                "wait for release",
                format!(
                    "grant {} ({} bytes) still held after {timeout:?}: {status:?}",
                    self.id, self.bytes
                ),
            ));
        }
        Ok(status)
    }

    /// Ask the receiver to let go, and wait up to `timeout` until it has (its mapping is gone:
    /// only then may the blocks be released and their chunks reused). A grant the receiver is
    /// still copying from is let go when the copy completed and the receiver dropped it.
    pub fn revoke(&self, timeout: Duration) -> Result<GrantStatus> {
        let revoking = {
            let mut st = self.link.state.lock();
            match st.out.get_mut(&self.id) {
                Some(g) if !g.status.is_final() => {
                    g.status = GrantStatus::Revoking;
                    true
                }
                _ => false,
            }
        };
        // Final already (released, refused, the peer exited): its status, read after the lock
        // above is released (waiting takes it again).
        if !revoking {
            return self.wait_released(Duration::ZERO);
        }
        if let Err(e) = send(&self.writer, Msg::Revoke { grant: self.id }, Vec::new()) {
            tracing::warn!(grant = self.id, error = %e, "revoke not sent; waiting for the peer to release or exit");
        }
        self.wait_released(timeout)
    }
}

impl Drop for Grant {
    fn drop(&mut self) {
        let mut st = self.link.state.lock();
        if let Some(g) = st.out.get_mut(&self.id) {
            if matches!(g.status, GrantStatus::HandOffStuck(_)) {
                // Its chunks belong to the receiver now: the pin stays, for good.
                g.detached = true;
            } else if g.status.is_final() {
                st.out.remove(&self.id);
            } else {
                g.detached = true;
            }
        }
    }
}

impl fmt::Debug for Grant {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Grant")
            .field("id", &self.id)
            .field("peer", &self.link.peer.name)
            .field("blocks", &self.blocks)
            .field("chunks", &self.chunks)
            .field("bytes", &self.bytes)
            .finish()
    }
}
