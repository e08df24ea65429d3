//! The mapper: the only code of the pool that calls the backend, and the one rollback routine.
//!
//! Every driver call is counted (the pool's [`crate::stats::DriverCalls`]) and traced here;
//! creates and releases count the chunks made and given back (a failed one changes nothing, so
//! creates minus releases is always the chunks the pool holds, however a batch fails). Map
//! and unmap work on *placed* chunks (`(offset, chunk)`), one driver call per chunk, and report
//! exactly which chunks ended up where, so that no caller ever has to guess whether a chunk is
//! still mapped after a failure:
//! - [`Inner::map_run`] maps a run of chunks and grants access; on failure it unmaps what it
//!   mapped ([`Inner::unmap_placed`], the rollback) and hands back, as *stuck*, any chunk whose
//!   rollback unmap failed too (still mapped: it must never be cached, released or reused);
//! - [`Inner::unmap_placed`] unmaps chunk by chunk and splits them into unmapped and still mapped.
//!
//! No lock is held here: callers claim the address ranges and chunks under the pool's lock
//! first, and put each chunk where the outcome says afterwards.

use crate::backend::{DriverCall, PhysicalChunk};
use crate::error::{Error, Result};

use super::Inner;

/// A physical chunk and the offset it is (or is to be) mapped at.
pub(crate) type Placed = (u64, PhysicalChunk);

/// What [`Inner::unmap_placed`] did.
#[derive(Debug, Default)]
pub(crate) struct Unmapped {
    /// Chunks unmapped: their ranges are free, the chunks may be cached or released.
    pub(crate) gone: Vec<Placed>,
    /// Chunks whose unmap failed: still mapped where they were.
    pub(crate) kept: Vec<Placed>,
    /// The first failure.
    pub(crate) error: Option<Error>,
}

/// What [`Inner::remap_each`] did with each chunk.
#[derive(Debug, Default)]
pub(crate) struct Remapped {
    /// Mapped again with access, as before.
    pub(crate) restored: Vec<Placed>,
    /// Not mapped: the chunk may be cached, its range is free.
    pub(crate) unmapped: Vec<Placed>,
    /// Mapped but the rollback of a failed access grant could not unmap it.
    pub(crate) stuck: Vec<Placed>,
}

/// A failed [`Inner::map_run`]: every chunk is unmapped again except `stuck`.
#[derive(Debug)]
pub(crate) struct MapFailure {
    pub(crate) error: Error,
    /// Chunks the rollback could not unmap: still mapped (perhaps without access).
    pub(crate) stuck: Vec<Placed>,
}

/// Total bytes of some chunks.
pub(crate) fn bytes_of<'a>(chunks: impl IntoIterator<Item = &'a PhysicalChunk>) -> u64 {
    chunks.into_iter().map(|c| c.size as u64).sum()
}

impl Inner {
    fn addr(&self, offset: u64) -> u64 {
        self.base + offset
    }

    /// `count` chunks of `size` bytes, all or none. Counted as the chunks made: a batch that
    /// fails made none (what the backend made of it before the failure it released again).
    pub(super) fn call_create_many(
        &self,
        size: u64,
        count: usize,
        need: crate::backend::Need,
    ) -> Result<Vec<PhysicalChunk>> {
        tracing::trace!(pool = %self.name, size, count, "create many");
        let made = self.backend.create_many(size as usize, count, need)?;
        self.drivers.bump_by(DriverCall::Create, made.len() as u64);
        Ok(made)
    }

    /// One result per chunk, in order. Counted as the chunks released (a failed release
    /// leaves the chunk the pool's).
    ///
    /// # Safety
    /// Every chunk is this pool's, mapped nowhere, and nothing refers to it any more.
    pub(super) unsafe fn call_release_many(&self, chunks: &[PhysicalChunk]) -> Vec<Result<()>> {
        tracing::trace!(pool = %self.name, chunks = chunks.len(), "release many");
        // SAFETY: forwarded from the caller.
        let results = unsafe { self.backend.release_many(chunks) };
        let released = results.iter().take(chunks.len()).filter(|r| r.is_ok());
        self.drivers
            .bump_by(DriverCall::Release, released.count() as u64);
        results
    }

    /// Counted if it released the chunk.
    ///
    /// # Safety
    /// `chunk` is this pool's, mapped nowhere, and nothing refers to it any more.
    pub(super) unsafe fn call_release(&self, chunk: PhysicalChunk) -> Result<()> {
        tracing::trace!(pool = %self.name, size = chunk.size, "release");
        // SAFETY: forwarded from the caller.
        unsafe { self.backend.release(chunk) }?;
        self.drivers.bump(DriverCall::Release);
        Ok(())
    }

    /// # Safety
    /// `[offset, offset + len)` is one whole mapped chunk claimed by the caller, unused.
    unsafe fn call_unmap(&self, offset: u64, len: u64) -> Result<()> {
        self.drivers.bump(DriverCall::Unmap);
        tracing::trace!(pool = %self.name, offset, len, "unmap");
        // SAFETY: forwarded from the caller.
        unsafe { self.backend.unmap(self.addr(offset), len as usize) }
    }

    /// Map `chunks` one after the other from `offset` and grant access to the whole run.
    ///
    /// # Safety
    /// The caller claimed `[offset, offset + total size)` (unmapped, in the reservation) and owns
    /// the chunks, which are mapped nowhere.
    pub(super) unsafe fn map_run(
        &self,
        offset: u64,
        chunks: &[PhysicalChunk],
    ) -> Result<(), MapFailure> {
        let mut at = offset;
        let mut done: Vec<Placed> = Vec::with_capacity(chunks.len());
        let mut failed = None;
        for &c in chunks {
            self.drivers.bump(DriverCall::Map);
            tracing::trace!(pool = %self.name, offset = at, size = c.size, "map");
            // SAFETY: `[at, at + c.size)` lies in the claimed, unmapped range; `c` is ours.
            match unsafe { self.backend.map(self.addr(at), c) } {
                Ok(()) => done.push((at, c)),
                Err(e) => {
                    failed = Some(e);
                    break;
                }
            }
            at += c.size as u64;
        }
        if failed.is_none() && at > offset {
            self.drivers.bump(DriverCall::SetAccess);
            tracing::trace!(pool = %self.name, offset, len = at - offset, "set_access");
            // SAFETY: the range is exactly the chunks mapped just above.
            if let Err(e) = unsafe {
                self.backend
                    .set_access(self.addr(offset), (at - offset) as usize)
            } {
                failed = Some(e);
            }
        }
        let Some(error) = failed else {
            return Ok(());
        };
        // SAFETY: rollback of mappings made above that nobody has seen yet.
        let undone = unsafe { self.unmap_placed(done) };
        if !undone.kept.is_empty() {
            tracing::error!(pool = %self.name, chunks = undone.kept.len(), "rolling back a map failed; those chunks stay mapped and are never reused");
        }
        Err(MapFailure {
            error,
            stuck: undone.kept,
        })
    }

    /// Unmap each chunk. Every chunk is tried, whatever failed before it.
    ///
    /// # Safety
    /// Each `(offset, chunk)` is a whole chunk mapped there, claimed by the caller, that nothing
    /// uses any more.
    pub(super) unsafe fn unmap_placed(&self, placed: Vec<Placed>) -> Unmapped {
        let mut out = Unmapped::default();
        for (o, c) in placed {
            // SAFETY: forwarded from the caller, chunk by chunk.
            match unsafe { self.call_unmap(o, c.size as u64) } {
                Ok(()) => out.gone.push((o, c)),
                Err(e) => {
                    tracing::warn!(pool = %self.name, offset = o, size = c.size, error = %e, "unmap failed; the chunk stays mapped");
                    out.kept.push((o, c));
                    out.error.get_or_insert(e);
                }
            }
        }
        out
    }

    /// Map single chunks back where they were (restoring after a failed unmap), and say for
    /// each where it ended up.
    ///
    /// # Safety
    /// Each range is claimed by the caller and unmapped; the chunks are ours.
    pub(super) unsafe fn remap_each(&self, placed: Vec<Placed>) -> Remapped {
        let mut out = Remapped::default();
        for (o, c) in placed {
            // SAFETY: forwarded from the caller.
            match unsafe { self.map_run(o, &[c]) } {
                Ok(()) => out.restored.push((o, c)),
                Err(f) => {
                    tracing::error!(pool = %self.name, offset = o, error = %f.error, "restoring a mapping failed");
                    if f.stuck.is_empty() {
                        out.unmapped.push((o, c));
                    } else {
                        out.stuck.extend(f.stuck);
                    }
                }
            }
        }
        out
    }
}
