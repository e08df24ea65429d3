//! The receiving side: a grant's chunks imported, mapped (read-only where the backend allows)
//! into a reservation of this process, and the granted blocks' spans located in it.

use std::fmt;
use std::sync::Arc;

use super::link::{send, InChunk, LinkShared, ReadyGrant};
use super::wire::Msg;
use crate::backend::{AccessMode, Backend, PhysicalChunk};
use crate::backing::BlockGeometry;
use crate::error::{Error, Result};
use crate::ipc::FrameWriter;
use crate::layout::{LayoutConfig, LayoutGeometry, LayoutKind, MemoryView};

/// A run of the sender's chunks that lie back to back there, and where it is mapped here.
#[derive(Debug, Clone, Copy)]
struct Segment {
    /// Offset in the sender's layout range.
    src: u64,
    len: u64,
    /// Address here.
    addr: u64,
}

/// Imported chunks mapped into a reservation of ours. Dropping it unmaps them, releases the
/// imports and frees the reservation; a step that fails leaves the rest in place (leaked and
/// logged, never released while mapped).
struct Mapped {
    backend: Arc<dyn Backend>,
    base: u64,
    len: u64,
    placed: Vec<(u64, PhysicalChunk)>,
    segments: Vec<Segment>,
    access: AccessMode,
}

impl Mapped {
    fn build(
        backend: Arc<dyn Backend>,
        chunks: Vec<InChunk>,
        access: AccessMode,
    ) -> Result<Mapped> {
        let gran = backend.info().granularity as u64;
        let mut total = 0u64;
        let mut prev_end = 0u64;
        for (i, c) in chunks.iter().enumerate() {
            let end = c.offset.checked_add(c.size);
            let ok = c.size > 0 && c.size % gran == 0 && (i == 0 || c.offset >= prev_end);
            let Some(end) = end.filter(|_| ok) else {
                return Err(Error::InvalidArgument(format!(
                    "granted chunk {i} of {} bytes at offset {:#x}: chunks are non-empty multiples of this backend's granularity {gran} in ascending, non-overlapping order (previous ended at {prev_end:#x})",
                    c.size, c.offset
                )));
            };
            prev_end = end;
            total = total
                .checked_add(c.size)
                .ok_or_else(|| Error::SizeOverflow {
                    what: "granted chunks",
                    detail: format!("{total} + {}", c.size),
                })?;
        }
        let len = usize::try_from(total).map_err(|_| Error::SizeOverflow {
            what: "granted chunks",
            detail: format!("{total} bytes"),
        })?;
        let base = backend.reserve(len.max(gran as usize), gran as usize)?;
        let mut m = Mapped {
            backend,
            base,
            len: total.max(gran),
            placed: Vec::with_capacity(chunks.len()),
            segments: Vec::new(),
            access,
        };
        let mut at = base;
        for c in chunks {
            let size = c.size as usize;
            let chunk = m.backend.import_chunk(c.fd, size)?;
            // SAFETY: `[at, at + size)` lies in the reservation made above and is unmapped (each
            // chunk gets its own part); the chunk was just imported and is mapped nowhere.
            if let Err(e) = unsafe { m.backend.map(at, chunk) } {
                // SAFETY: imported above, mapped nowhere, released once.
                if let Err(r) = unsafe { m.backend.release(chunk) } {
                    tracing::error!(error = %r, "releasing an imported chunk after a failed map failed");
                }
                return Err(e);
            }
            m.placed.push((at, chunk));
            match m.segments.last_mut() {
                Some(s) if s.src + s.len == c.offset => s.len += c.size,
                _ => m.segments.push(Segment {
                    src: c.offset,
                    len: c.size,
                    addr: at,
                }),
            }
            at += c.size;
        }
        let mut effective = access;
        for s in m.segments.clone() {
            // SAFETY: the segment is made of chunks mapped just above.
            let r = unsafe { m.backend.set_access_mode(s.addr, s.len as usize, effective) };
            if let Err(e) = r {
                if effective == AccessMode::ReadWrite {
                    return Err(e);
                }
                tracing::info!(error = %e, "read-only mapping not available; mapping imports read-write");
                effective = AccessMode::ReadWrite;
                // SAFETY: as above.
                unsafe { m.backend.set_access_mode(s.addr, s.len as usize, effective) }?;
            }
        }
        if effective != access {
            // Segments done before the fallback keep read-only access: make them all alike.
            for s in m.segments.clone() {
                // SAFETY: as above.
                unsafe { m.backend.set_access_mode(s.addr, s.len as usize, effective) }?;
            }
        }
        m.access = effective;
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

    fn bytes(&self) -> u64 {
        self.placed.iter().map(|(_, c)| c.size as u64).sum()
    }
}

impl Drop for Mapped {
    fn drop(&mut self) {
        let mut clean = true;
        for &(addr, chunk) in &self.placed {
            // SAFETY: the chunk is mapped there by us; nothing uses it any more (every copy
            // from it completed: completions hold the mapping until then).
            match unsafe { self.backend.unmap(addr, chunk.size) } {
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
        if clean {
            // SAFETY: our reservation, nothing mapped in it any more.
            if let Err(e) = unsafe { self.backend.free_reservation(self.base, self.len as usize) } {
                tracing::error!(error = %e, "freeing the import reservation failed");
            }
        }
    }
}

/// The mapping of one grant, shared by the grant and the copies from it: torn down when the
/// last of them goes, then the sender is told.
pub(crate) struct ImportMapping {
    mapped: Option<Mapped>,
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
        drop(self.mapped.take());
        {
            let mut st = self.link.state.lock();
            st.live_in.remove(&self.grant);
            st.revoked_in.remove(&self.grant);
        }
        self.link.changed.notify_all();
        if self.link.state.lock().closed.is_none() {
            if let Err(e) = send(
                &self.writer,
                Msg::Released { grant: self.grant },
                Vec::new(),
            ) {
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
    /// Per granted block, where its spans are mapped here, in the layout's span order.
    pub(crate) spans: Vec<Vec<MemoryView>>,
    pub(crate) mapping: Arc<ImportMapping>,
    access: AccessMode,
    bytes: u64,
}

impl ImportedGrant {
    pub(crate) fn build(
        link: Arc<LinkShared>,
        writer: FrameWriter,
        ready: ReadyGrant,
    ) -> Result<ImportedGrant> {
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
        let chunks = ready.chunks.len();
        let mapped = Mapped::build(link.backend.clone(), ready.chunks, ready.access)?;
        let mut spans = Vec::with_capacity(blocks.len());
        let mut raw = Vec::new();
        for &b in &blocks {
            raw.clear();
            geometry.block_spans(b, &mut raw);
            let mut views = Vec::with_capacity(raw.len());
            for &(src, len) in &raw {
                let Some(addr) = mapped.locate(src, len) else {
                    return Err(Error::InvalidArgument(format!(
                        "granted block {b}: its span [{src:#x}, +{len}) is not covered by the {chunks} chunks sent"
                    )));
                };
                views.push(MemoryView { addr, len });
            }
            spans.push(views);
        }
        let bytes = mapped.bytes();
        let access = mapped.access;
        link.state.lock().live_in.insert(ready.id, (bytes, chunks));
        tracing::debug!(peer = %link.peer.name, grant = ready.id, blocks = blocks.len(), chunks, bytes, ?access, "grant imported");
        Ok(ImportedGrant {
            id: ready.id,
            config,
            kind,
            blocks,
            spans,
            mapping: Arc::new(ImportMapping {
                mapped: Some(mapped),
                link,
                writer,
                grant: ready.id,
            }),
            access,
            bytes,
        })
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

    /// How the chunks are mapped here (read-write where read-only is not available).
    pub fn access(&self) -> AccessMode {
        self.access
    }

    /// Bytes mapped here (whole chunks).
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// Where the spans of the `i`-th granted block are mapped in this process.
    pub fn block_views(&self, i: usize) -> Option<&[MemoryView]> {
        self.spans.get(i).map(Vec::as_slice)
    }

    /// The whole reservation the grant's chunks are mapped into here, back to back in the
    /// sender's address order (`len` is whole chunks).
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
        let inside = addr >= m.base
            && (addr - m.base)
                .checked_add(out.len() as u64)
                .is_some_and(|e| e <= m.len);
        if !inside {
            return Err(Error::InvalidArgument(format!(
                "[{addr:#x}, +{}) is outside the grant's mapping [{:#x}, +{})",
                out.len(),
                m.base,
                m.len
            )));
        }
        // SAFETY: inside our mapping (checked), which lives as long as `self`; no writer is the
        // caller's promise.
        unsafe { m.backend.read(addr, out) }
    }
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
