//! The receiving side: a grant's chunks imported, mapped (with the access granted: a read-only
//! grant this backend cannot map read-only is refused, never mapped writable) into a reservation
//! of this process that mirrors the sender's layout range (each chunk at its offset there,
//! relative to the first chunk), and the granted blocks located in it: block `b`'s spans are the
//! sender's block-0 pattern moved by `b * stride`, so one address per block says where all of
//! its spans are.

use std::fmt;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::link::{send, InChunk, LinkShared, ReadyGrant};
use super::wire::{GrantMode, Msg};
use crate::backend::{AccessMode, Backend, DeviceReach, MemoryKind, PhysicalChunk};
use crate::backing::BackingChange;
use crate::error::{Error, Result};
use crate::ipc::FrameWriter;
use crate::layout::{ElasticLayout, LayoutConfig, LayoutGeometry, LayoutKind, MemoryView};

/// A run of the sender's chunks that lie back to back there, and where it is mapped here.
#[derive(Debug, Clone, Copy)]
struct Segment {
    /// Offset in the sender's layout range.
    src: u64,
    len: u64,
    /// Address here.
    addr: u64,
}

/// Imported chunks mapped into a reservation of ours, each at its offset in the sender's range
/// less the first chunk's (gaps between granted chunks stay unmapped). Dropping it unmaps them,
/// releases the imports (kept ones stay imported, see [`super::cache`]) and frees the
/// reservation; a step that fails leaves the rest in place (leaked and logged, never released
/// while mapped).
struct Mapped {
    backend: Arc<dyn Backend>,
    /// The link whose kept imports some chunks are.
    link: Arc<LinkShared>,
    base: u64,
    len: u64,
    /// Where offset 0 of the sender's range would be here (`base - first chunk's offset`,
    /// modulo 2^64): offset `o` of a granted chunk is mapped at `origin + o`.
    origin: u64,
    /// Where each chunk is mapped, and the key of the kept ones.
    placed: Vec<(u64, PhysicalChunk, Option<u64>)>,
    /// Chunks found kept here (not imported for this grant).
    reused: usize,
    segments: Vec<Segment>,
    access: AccessMode,
}

impl Mapped {
    /// Import and map `chunks`, which must end by `extent` (the sender's layout extent) plus
    /// one chunk: a peer cannot make this process reserve more address space than its layout
    /// spans. On failure, chunks sent to be kept are kept all the same
    /// ([`LinkShared::keep_unimported`]).
    fn build(
        link: &Arc<LinkShared>,
        chunks: Vec<InChunk>,
        access: AccessMode,
        extent: u64,
    ) -> Result<Mapped> {
        let mut rest = chunks.into_iter();
        let r = Self::build_from(link, &mut rest, access, extent);
        if r.is_err() {
            link.keep_unimported(rest.collect());
        }
        r
    }

    /// [`Mapped::build`], taking chunks from `chunks` (those left on failure are not imported).
    fn build_from(
        link: &Arc<LinkShared>,
        chunks: &mut std::vec::IntoIter<InChunk>,
        access: AccessMode,
        extent: u64,
    ) -> Result<Mapped> {
        let backend = link.backend.clone();
        let gran = backend.info().granularity as u64;
        let largest = chunks.as_slice().iter().map(|c| c.size).max().unwrap_or(0);
        let max_end = extent
            .checked_next_multiple_of(gran.max(1))
            .and_then(|e| e.checked_add(largest))
            .unwrap_or(u64::MAX);
        let first = chunks.as_slice().first().map_or(0, |c| c.offset);
        let mut total = 0u64;
        let mut prev_end = 0u64;
        for (i, c) in chunks.as_slice().iter().enumerate() {
            let end = c.offset.checked_add(c.size);
            let ok = c.size > 0
                && c.size % gran == 0
                && c.offset % gran == 0
                && (i == 0 || c.offset >= prev_end);
            let Some(end) = end.filter(|_| ok) else {
                return Err(Error::InvalidArgument(format!(
                    "granted chunk {i} of {} bytes at offset {:#x}: chunks are non-empty multiples of this backend's granularity {gran}, at offsets that are multiples of it, in ascending, non-overlapping order (previous ended at {prev_end:#x})",
                    c.size, c.offset
                )));
            };
            if end > max_end {
                return Err(Error::InvalidArgument(format!(
                    "granted chunk {i} of {} bytes at offset {:#x} ends past the sender's layout ({extent} bytes, so chunks end by {max_end:#x})",
                    c.size, c.offset
                )));
            }
            prev_end = end;
            total = total
                .checked_add(c.size)
                .ok_or_else(|| Error::SizeOverflow {
                    what: "granted chunks",
                    detail: format!("{total} + {}", c.size),
                })?;
        }
        // The range from the first chunk's start to the last one's end, gaps included (address
        // space only: nothing is mapped in the gaps).
        let extent = prev_end - first;
        let len = usize::try_from(extent.max(gran)).map_err(|_| Error::SizeOverflow {
            what: "granted chunks",
            detail: format!("a range of {extent} bytes from offset {first:#x}"),
        })?;
        let base = backend.reserve(len, gran as usize)?;
        let mut m = Mapped {
            backend,
            link: link.clone(),
            reused: 0,
            base,
            len: len as u64,
            origin: base.wrapping_sub(first),
            placed: Vec::with_capacity(chunks.as_slice().len()),
            segments: Vec::new(),
            access,
        };
        for c in chunks.by_ref() {
            let size = c.size as usize;
            // Inside the reservation: first <= offset and offset + size <= prev_end (checked).
            let at = base + (c.offset - first);
            let mut key = c.how.key();
            let chunk = match c.fd {
                // Kept here by an earlier grant: no import.
                None => {
                    let chunk = link.use_kept(key.unwrap_or_default(), c.size)?;
                    m.reused += 1;
                    chunk
                }
                Some(fd) => match key {
                    Some(k) => {
                        let (chunk, kept) = link.import_to_keep(k, fd, c.size)?;
                        // Not kept (too many are): this mapping's own, as a hand-off's is.
                        key = kept;
                        chunk
                    }
                    None => m.backend.import_chunk(fd, size)?,
                },
            };
            // SAFETY: `[at, at + size)` lies in the reservation made above and is unmapped (each
            // chunk gets its own part); a chunk imported may be mapped at several places.
            if let Err(e) = unsafe { m.backend.map(at, chunk) } {
                match key {
                    // Stays kept (imported, the sender's to forget), unused by us.
                    Some(k) => link.unuse_kept(&[k]),
                    // SAFETY: imported above, mapped nowhere, released once.
                    None => {
                        if let Err(r) = unsafe { m.backend.release(chunk) } {
                            tracing::error!(error = %r, "releasing an imported chunk after a failed map failed");
                        }
                    }
                }
                return Err(e);
            }
            m.placed.push((at, chunk, key));
            match m.segments.last_mut() {
                Some(s) if s.src + s.len == c.offset => s.len += c.size,
                _ => m.segments.push(Segment {
                    src: c.offset,
                    len: c.size,
                    addr: at,
                }),
            }
        }
        // Chunks of another GPU: that GPU gets access too (a copy between the two may run on
        // its engines).
        let owner = match link.peer.reach {
            DeviceReach::Peer { ordinal } => Some(ordinal),
            _ => None,
        };
        for s in m.segments.clone() {
            // SAFETY: the segment is made of chunks mapped just above.
            let r = unsafe {
                m.backend
                    .set_import_access(s.addr, s.len as usize, access, owner)
            };
            if let Err(e) = r {
                // Never mapped writable instead: the sender asked that we cannot write its
                // memory, so the grant is refused and the sender told why.
                return Err(match access {
                    AccessMode::ReadWrite => e,
                    AccessMode::ReadOnly => link.peer_error(
                        "import",
                        format!("read-only access was asked and cannot be given here ({e}): refused rather than mapped writable (grant it read-write to copy it here)"),
                    ),
                });
            }
        }
        Ok(m)
    }

    /// Where `[src, src + len)` of the sender's range is mapped here, if the grant covers it.
    fn locate(&self, src: u64, len: u64) -> Option<u64> {
        let i = self
            .segments
            .partition_point(|s| s.src <= src)
            .checked_sub(1)?;
        let s = self.segments[i];
        let end = src.checked_add(len)?;
        (end <= s.src + s.len).then(|| s.addr + (src - s.src))
    }

    /// Whether `[addr, addr + len)` lies in one run of mapped chunks here.
    fn maps(&self, addr: u64, len: u64) -> bool {
        let i = self.segments.partition_point(|s| s.addr <= addr);
        let Some(s) = i.checked_sub(1).map(|i| self.segments[i]) else {
            return false;
        };
        (addr - s.addr)
            .checked_add(len)
            .is_some_and(|end| end <= s.len)
    }

    fn bytes(&self) -> u64 {
        self.placed.iter().map(|(_, c, _)| c.size as u64).sum()
    }
}

impl Drop for Mapped {
    fn drop(&mut self) {
        self.unmap_all();
    }
}

impl Mapped {
    /// Unmap and release every chunk and free the reservation; whether every chunk was
    /// unmapped (one that could not be stays mapped, and the reservation stays). Once only:
    /// the chunks are forgotten here.
    fn unmap_all(&mut self) -> bool {
        let mut clean = true;
        let mut unused = Vec::new();
        for (addr, chunk, key) in std::mem::take(&mut self.placed) {
            // SAFETY: the chunk is mapped there by us; nothing uses it any more (every copy
            // from it completed: completions hold the mapping until then).
            match unsafe { self.backend.unmap(addr, chunk.size) } {
                // Kept: stays imported for the next grant.
                Ok(()) if key.is_some() => unused.extend(key),
                // SAFETY: imported by us, unmapped just now, released once.
                Ok(()) => {
                    if let Err(e) = unsafe { self.backend.release(chunk) } {
                        tracing::error!(error = %e, "releasing an imported chunk failed");
                    }
                }
                Err(e) => {
                    tracing::error!(addr, size = chunk.size, error = %e, "unmapping an imported chunk failed; it stays mapped");
                    clean = false;
                }
            }
        }
        if clean && self.len > 0 {
            // SAFETY: our reservation, nothing mapped in it any more.
            if let Err(e) = unsafe { self.backend.free_reservation(self.base, self.len as usize) } {
                tracing::error!(error = %e, "freeing the import reservation failed");
            }
        }
        // Never freed twice.
        self.len = 0;
        self.link.unuse_kept(&unused);
        clean
    }
}

/// How a grant ended here.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Outcome {
    /// Unmapped: the sender may reuse its blocks.
    Released,
    /// Taken over into a layout here: the sender releases its blocks.
    Adopted,
}

/// The mapping of one grant, shared by the grant and the copies from it: torn down when the
/// last of them goes, then the sender is told.
pub(crate) struct ImportMapping {
    mapped: Option<Mapped>,
    /// What the sender is told when the mapping goes.
    outcome: Outcome,
    pub(crate) link: Arc<LinkShared>,
    writer: FrameWriter,
    grant: u64,
}

impl ImportMapping {
    pub(crate) fn backend(&self) -> &Arc<dyn Backend> {
        &self.mapped.as_ref().expect("mapped until drop").backend
    }
}

impl Drop for ImportMapping {
    fn drop(&mut self) {
        let clean = self.mapped.take().is_none_or(|mut m| m.unmap_all());
        if !clean {
            // A chunk is still mapped here: the books keep the import and the sender is not
            // told, so its blocks stay pinned until this process exits.
            tracing::error!(peer = %self.link.peer.name, grant = self.grant, "an imported chunk could not be unmapped; the grant stays held until this process exits");
            return;
        }
        {
            let mut st = self.link.state.lock();
            st.live_in.remove(&self.grant);
            st.revoked_in.remove(&self.grant);
        }
        self.link.changed.notify_all();
        if self.link.state.lock().closed.is_none() {
            let msg = match self.outcome {
                Outcome::Released => Msg::Released { grant: self.grant },
                Outcome::Adopted => Msg::Adopted { grant: self.grant },
            };
            if let Err(e) = send(&self.writer, msg, Vec::new()) {
                tracing::debug!(grant = self.grant, error = %e, "release not sent");
            }
        }
        tracing::debug!(peer = %self.link.peer.name, grant = self.grant, "import unmapped and released");
    }
}

/// A grant received from a peer, its chunks mapped here. Copy its blocks into a layout of
/// this process with [`ImportedGrant::copy_into`]; drop it to unmap them and tell the sender
/// (after every copy from it completed).
pub struct ImportedGrant {
    pub(crate) id: u64,
    pub(crate) config: LayoutConfig,
    pub(crate) kind: LayoutKind,
    pub(crate) blocks: Vec<usize>,
    /// The sender's block 0 spans as `(offset, len)` in its layout range, in span order; block
    /// `b`'s are these moved by `b * stride`.
    pub(crate) pattern: Vec<(u64, u64)>,
    /// The sender's block stride.
    pub(crate) stride: u64,
    /// Per granted block, the address here that its pattern offsets are added to (modulo
    /// 2^64): `origin + b * stride`. Every span so placed was checked to be mapped.
    pub(crate) src_shifts: Vec<u64>,
    pub(crate) mode: GrantMode,
    pub(crate) mapping: Arc<ImportMapping>,
    access: AccessMode,
    bytes: u64,
    /// Time taken to import, map and set access to the chunks here.
    import_time: Duration,
}

impl ImportedGrant {
    pub(crate) fn build(
        link: Arc<LinkShared>,
        writer: FrameWriter,
        ready: ReadyGrant,
    ) -> Result<ImportedGrant> {
        let shape = || -> Result<_> {
            let config = ready.layout.config()?;
            let kind: LayoutKind = ready.layout.kind.into();
            let geometry = LayoutGeometry::new(config, kind)?;
            let mut blocks = Vec::with_capacity(ready.blocks.len());
            for &b in &ready.blocks {
                match usize::try_from(b) {
                    Ok(b) if b < config.num_blocks => blocks.push(b),
                    _ => {
                        return Err(Error::InvalidArgument(format!(
                            "granted block {b} does not exist: the sender's layout has {} blocks",
                            config.num_blocks
                        )))
                    }
                }
            }
            Ok((config, kind, geometry, blocks))
        };
        let (config, kind, geometry, blocks) = match shape() {
            Ok(s) => s,
            Err(e) => {
                // Refused before any import: chunks sent to be kept are kept all the same.
                link.keep_unimported(ready.chunks);
                return Err(e);
            }
        };
        let chunks = ready.chunks.len();
        let started = Instant::now();
        let mapped = Mapped::build(&link, ready.chunks, ready.access, geometry.extent())?;
        let import_time = started.elapsed();
        let (pattern, stride) = geometry.block_pattern();
        let src_shifts = covered(&mapped, &blocks, &pattern, stride, chunks)?;
        let bytes = mapped.bytes();
        let access = mapped.access;
        link.state.lock().live_in.insert(ready.id, (bytes, chunks));
        tracing::debug!(peer = %link.peer.name, grant = ready.id, blocks = blocks.len(), chunks, bytes, ?access, ?import_time, "grant imported");
        Ok(ImportedGrant {
            id: ready.id,
            config,
            kind,
            blocks,
            pattern,
            stride,
            src_shifts,
            mode: ready.mode,
            mapping: Arc::new(ImportMapping {
                mapped: Some(mapped),
                outcome: Outcome::Released,
                link,
                writer,
                grant: ready.id,
            }),
            access,
            bytes,
            import_time,
        })
    }

    /// How the sender granted the blocks: to copy, or to take over.
    pub fn mode(&self) -> GrantMode {
        self.mode
    }

    /// Take the chunks of a hand-off ([`crate::p2p::PeerLink::hand_off`]) over without a
    /// copy: they are unmapped here and mapped under `dst_blocks` of `dst` (paired by
    /// position), charged to `dst`'s pool as if created here; the sender then releases its
    /// blocks and lets go of the chunks. `dst` must be on the link's backend and the sender's
    /// device, its blocks unbacked and owning whole pages of the same size. The grant is
    /// consumed either way: after a refusal the sender keeps its blocks.
    ///
    /// Refused before anything changes: a copy grant, a sender gone or revoking, a layout
    /// mismatch, copies from this grant still in flight, another backend. A failure while
    /// mapping releases the chunks here (the sender keeps its blocks, as after a copy).
    pub fn adopt_into(
        mut self,
        dst: &ElasticLayout,
        dst_blocks: &[usize],
    ) -> Result<BackingChange> {
        if self.mode != GrantMode::HandOff {
            return Err(Error::InvalidArgument(format!(
                "grant {} was granted for copying (the sender keeps its blocks): use copy_into",
                self.id
            )));
        }
        self.check_usable("adopt")?;
        self.check_shape(dst, dst_blocks)?;
        let link = self.mapping.link.clone();
        let pool_backend = dst.backing().pool().backend();
        if let Some(lender) = pool_backend.chunk_lender() {
            // The pool would give imported chunks back to its lender, which never lent them.
            return Err(Error::InvalidArgument(format!(
                "grant {}: the layout's pool takes its chunks from {lender}, which cannot take over chunks from another process: copy them instead",
                self.id
            )));
        }
        if !std::ptr::addr_eq(Arc::as_ptr(pool_backend), Arc::as_ptr(&link.backend)) {
            return Err(Error::InvalidArgument(
                "adopted chunks are the link's backend's: build the layout's pool on the same backend (Arc) as the link".into(),
            ));
        }
        // By UUID (ordinals are per process); the layout's backend is the link's (above).
        if dst.memory_kind() == MemoryKind::Device && link.peer.reach != DeviceReach::Same {
            return Err(Error::InvalidArgument(format!(
                "the chunks live on the sender's GPU ({:?} from here), the layout on device {:?}: a hand-off stays on one GPU (copy across devices instead)",
                link.peer.reach,
                dst.device()
            )));
        }
        let id = self.id;
        let Some(mapping) = Arc::get_mut(&mut self.mapping) else {
            return Err(Error::InvalidArgument(format!(
                "copies from grant {id} are still in flight: wait for their completions first"
            )));
        };
        let m = mapping.mapped.as_mut().expect("mapped until drop");
        if m.placed.iter().any(|p| p.2.is_some()) {
            // Kept imports are the sender's (it sends hand-offs fresh): never taken over.
            return Err(Error::InvalidArgument(format!(
                "grant {id} names chunks kept imported here: the sender did not hand them off"
            )));
        }
        // Each imported chunk's offset in the sender's range.
        let src_of = |addr: u64| {
            m.segments
                .iter()
                .find(|s| addr >= s.addr && addr < s.addr + s.len)
                .map(|s| s.src + (addr - s.addr))
        };
        let mut by_src = std::collections::BTreeMap::new();
        for (i, &(addr, c, _)) in m.placed.iter().enumerate() {
            if let Some(src) = src_of(addr) {
                by_src.insert(src, (i, c.size as u64));
            }
        }
        let base = dst.addr();
        let mut wanted: Vec<(u64, usize)> = Vec::new();
        for (k, &b) in dst_blocks.iter().enumerate() {
            let views = dst.views().block(b)?;
            let moved = self.blocks[k] as u64 * self.stride;
            for (d, &(src, len)) in views.iter().zip(&self.pattern) {
                let src = src + moved;
                let mut at = src;
                for (&o, &(i, size)) in by_src.range(src..src + len) {
                    if o != at || o + size > src + len {
                        return Err(Error::InvalidArgument(format!(
                            "granted block {}: its span [{src:#x}, +{len}) is not made of whole chunks (one at {o:#x} of {size} bytes)",
                            self.blocks[k]
                        )));
                    }
                    wanted.push((d.addr - base + (o - src), i));
                    at += size;
                }
                if at != src + len {
                    return Err(Error::InvalidArgument(format!(
                        "granted block {}: its span [{src:#x}, +{len}) is not covered by the chunks sent",
                        self.blocks[k]
                    )));
                }
            }
        }
        wanted.sort_unstable();
        let mut taken: Vec<bool> = vec![false; m.placed.len()];
        for &(_, i) in &wanted {
            if std::mem::replace(&mut taken[i], true) {
                return Err(Error::InvalidArgument(
                    "a chunk lies under two adopted spans".into(),
                ));
            }
        }
        // Unmap the chunks from the import reservation; they stay imported (ours to map).
        let mut placed = Vec::with_capacity(wanted.len());
        let mut gone = vec![false; m.placed.len()];
        let mut failure = None;
        for &(off, i) in &wanted {
            let (addr, c, _) = m.placed[i];
            // SAFETY: mapped there by us; no copy uses it (the mapping is not shared).
            match unsafe { m.backend.unmap(addr, c.size) } {
                Ok(()) => {
                    gone[i] = true;
                    placed.push((off, c));
                }
                Err(e) => {
                    failure = Some(e);
                    break;
                }
            }
        }
        let mut k = 0;
        m.placed.retain(|_| {
            k += 1;
            !gone[k - 1]
        });
        if let Some(e) = failure {
            for (_, c) in placed {
                // SAFETY: unmapped above, imported by us, released once.
                if let Err(r) = unsafe { m.backend.release(c) } {
                    tracing::error!(error = %r, "releasing an imported chunk failed");
                }
            }
            return Err(e);
        }
        let change = dst.backing().adopt(dst_blocks, placed)?;
        mapping.outcome = Outcome::Adopted;
        tracing::debug!(peer = %link.peer.name, grant = id, blocks = change.blocks, bytes = change.bytes, "hand-off adopted");
        Ok(change)
    }

    /// Refuse use of a grant whose sender is gone or revoked it.
    pub(crate) fn check_usable(&self, op: &'static str) -> Result<()> {
        let link = &self.mapping.link;
        let st = link.state.lock();
        if let Some(why) = &st.closed {
            return Err(link.peer_error(
                op,
                format!(
                    "the sender is gone ({why}): drop grant {} to release its imports",
                    self.id
                ),
            ));
        }
        if st.revoked_in.contains(&self.id) {
            return Err(link.peer_error(op, format!("grant {} was revoked by its sender", self.id)));
        }
        Ok(())
    }

    /// Refuse a destination of another shape, or block lists that do not pair up (a block
    /// listed twice or out of range); the destination blocks as a bitmap with their bounds.
    pub(crate) fn check_shape(
        &self,
        dst: &ElasticLayout,
        dst_blocks: &[usize],
    ) -> Result<(Vec<u64>, (usize, usize))> {
        if let Some(detail) = super::copy::mismatch(&self.config, dst.config()) {
            return Err(Error::LayoutMismatch { detail });
        }
        if self.kind != dst.kind() {
            return Err(Error::LayoutMismatch {
                detail: format!(
                    "sender layout is {}, receiver layout is {}",
                    self.kind,
                    dst.kind()
                ),
            });
        }
        if dst_blocks.len() != self.blocks.len() {
            return Err(Error::LayoutMismatch {
                detail: format!(
                    "{} blocks granted, {} destination blocks given",
                    self.blocks.len(),
                    dst_blocks.len()
                ),
            });
        }
        super::plan::block_set(dst_blocks, dst.num_blocks())
    }

    /// The grant's number on its link.
    pub fn id(&self) -> u64 {
        self.id
    }

    /// The sender's name.
    pub fn peer(&self) -> &str {
        &self.mapping.link.peer.name
    }

    /// The sender's block indices, in the order they pair with a copy's destination blocks.
    pub fn blocks(&self) -> &[usize] {
        &self.blocks
    }

    /// The sender's layout dimensions.
    pub fn config(&self) -> &LayoutConfig {
        &self.config
    }

    /// The sender's layout kind.
    pub fn kind(&self) -> LayoutKind {
        self.kind
    }

    /// How the chunks are mapped here: as the sender granted them.
    pub fn access(&self) -> AccessMode {
        self.access
    }

    /// Bytes mapped here (whole chunks).
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// How long importing the chunks, mapping them and setting their access took here (in
    /// [`crate::p2p::PeerLink::recv_grant`], after the grant arrived). On a GPU it grows with
    /// the number of chunks more than with their bytes (on the H100 one import took about
    /// 75-80 µs for chunks of 64 MiB and of 1 GiB alike), so a sender whose layout maps larger
    /// pages (`page_size` of [`crate::layout::LayoutBuilder`]) is imported faster.
    pub fn import_time(&self) -> Duration {
        self.import_time
    }

    /// Chunks of this grant that were kept imported here from earlier grants (sent without a
    /// descriptor, not imported again); the others were imported for it.
    pub fn kept_chunks(&self) -> usize {
        self.mapping.mapped.as_ref().map_or(0, |m| m.reused)
    }

    /// Where the spans of the `i`-th granted block are mapped in this process.
    pub fn block_views(&self, i: usize) -> Option<Vec<MemoryView>> {
        let shift = *self.src_shifts.get(i)?;
        Some(
            self.pattern
                .iter()
                .map(|&(o, len)| MemoryView {
                    addr: shift.wrapping_add(o),
                    len,
                })
                .collect(),
        )
    }

    /// The reservation the grant's chunks are mapped into here: from the first chunk's start to
    /// the last one's end, each chunk at its offset in the sender's range (so the grant of
    /// consecutive chunks is mapped back to back; chunks not granted between granted ones
    /// leave unmapped gaps). `len` is whole chunks.
    pub fn mapped_range(&self) -> MemoryView {
        let m = self.mapping.mapped.as_ref().expect("mapped until drop");
        MemoryView {
            addr: m.base,
            len: m.len,
        }
    }

    /// Copy bytes of the mapping at `addr` into `out` (a host read; on CUDA device to host).
    ///
    /// # Safety
    /// The sender must not write those bytes meanwhile.
    pub unsafe fn read(&self, addr: u64, out: &mut [u8]) -> Result<()> {
        let m = self.mapping.mapped.as_ref().expect("mapped until drop");
        if !m.maps(addr, out.len() as u64) {
            return Err(Error::InvalidArgument(format!(
                "[{addr:#x}, +{}) is not inside the grant's mapped chunks (reservation [{:#x}, +{}))",
                out.len(),
                m.base,
                m.len
            )));
        }
        // SAFETY: inside our mapping (checked), which lives as long as `self`; no writer is the
        // caller's promise.
        unsafe { m.backend.copies().read(addr, out) }
    }
}

/// Check that every span of every granted block lies in one run of mapped chunks, and return
/// the blocks' shifts (`origin + b * stride`). O(blocks) when the chunks form one run (the
/// blocks' bounds are checked), one lookup per span otherwise.
fn covered(
    mapped: &Mapped,
    blocks: &[usize],
    pattern: &[(u64, u64)],
    stride: u64,
    chunks: usize,
) -> Result<Vec<u64>> {
    // Spans of a valid block lie within the layout's extent, which fits 64 bits (validated).
    let lo = pattern.iter().map(|s| s.0).min().unwrap_or(0);
    let hi = pattern.iter().map(|s| s.0 + s.1).max().unwrap_or(0);
    let one = match mapped.segments[..] {
        [s] => Some(s),
        _ => None,
    };
    let mut shifts = Vec::with_capacity(blocks.len());
    for &b in blocks {
        let moved = b as u64 * stride;
        let inside = one.is_some_and(|s| lo + moved >= s.src && hi + moved <= s.src + s.len);
        if !inside {
            for &(o, len) in pattern {
                let src = o + moved;
                if mapped.locate(src, len).is_none() {
                    return Err(Error::InvalidArgument(format!(
                        "granted block {b}: its span [{src:#x}, +{len}) is not covered by the {chunks} chunks sent"
                    )));
                }
            }
        }
        shifts.push(mapped.origin.wrapping_add(moved));
    }
    Ok(shifts)
}

impl fmt::Debug for ImportedGrant {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ImportedGrant")
            .field("id", &self.id)
            .field("peer", &self.peer())
            .field("blocks", &self.blocks.len())
            .field("bytes", &self.bytes)
            .field("access", &self.access)
            .finish()
    }
}
