//! The allocator: warm memory first (no driver call), else one planned growth.
//!
//! A growth claims its address range and takes cached chunks under the pool's lock (the plan),
//! then obtains the rest from the chunk sources with no lock held, maps everything with the
//! mapper and records the allocation. Donated chunks bigger than the request are mapped whole:
//! the claim then extends into the free address space the plan saw after it. Only if another
//! thread took that space in the meantime is the request planned again (its chunks wait in
//! the cache), so no driver work is ever thrown away.

use std::sync::Arc;

use super::admission::{Fit, Urgency};
use super::allocation::Allocation;
use super::mapper::{bytes_of, Placed};
use super::sleep::SleepStatus;
use super::state::{LiveRecord, State};
use super::thread_front::front_kind;
use super::Inner;
use crate::backend::PhysicalChunk;
use crate::error::{round_up, Error, Result};
use crate::tag::Tag;

/// How often a growth is planned again when a racing growth took the address space it meant
/// to extend into. Each round keeps its chunks (in the cache), so rounds cost no driver calls.
const MAX_ROUNDS: usize = 4;

/// Where a growth could go: `needed` new bytes mapped at `cold`, the allocation starting at
/// `start` (inside the idle neighbour `idle` when one is used).
struct Candidate {
    needed: u64,
    start: u64,
    idle: Option<(u64, u64)>,
    cold: (u64, u64),
}

/// A planned growth: address space claimed (in transit) and cached chunks taken (in flight).
struct Growth {
    /// Where the allocation starts.
    start: u64,
    /// Idle neighbour used, `[s, e)`.
    idle: Option<(u64, u64)>,
    /// Cold range claimed, `[s, e)`.
    cold: (u64, u64),
    /// End of the free address space the claim may extend into (as seen when planning).
    room_end: u64,
    /// Of the cold range, how much must be mapped for the request (the rest is look-ahead).
    needed: u64,
    /// Chunks taken from the cache.
    cached: Vec<PhysicalChunk>,
}

/// Chunks gathered for a growth, kept apart by where they go if it fails.
#[derive(Default)]
struct Gathered {
    /// From the cache or handed over by other models: back to the cache on failure.
    reusable: Vec<PhysicalChunk>,
    /// Created for this growth: back to the driver on failure.
    created: Vec<PhysicalChunk>,
}

impl Gathered {
    fn bytes(&self) -> u64 {
        bytes_of(&self.reusable) + bytes_of(&self.created)
    }
}

impl Inner {
    pub(super) fn footprint(&self, bytes: usize) -> Result<u64> {
        // Fast path: a size that fits the reservation rounds up without overflow.
        if bytes != 0 && (bytes as u64) <= self.capacity {
            let f = (bytes as u64 + self.alignment - 1) & !(self.alignment - 1);
            if f <= self.capacity {
                return Ok(f);
            }
        }
        self.footprint_refused(bytes)
    }

    /// Why [`Inner::footprint`] refuses `bytes` (kept off the hot path).
    #[cold]
    fn footprint_refused(&self, bytes: usize) -> Result<u64> {
        if bytes == 0 {
            return Err(Error::ZeroSize {
                what: "allocation size",
            });
        }
        let f = round_up("allocation size", bytes as u64, self.alignment)?;
        if f > self.capacity {
            return Err(Error::OutOfAddressSpace {
                requested: f,
                largest_free: self
                    .state
                    .lock()
                    .cold
                    .iter()
                    .map(|(s, e)| e - s)
                    .max()
                    .unwrap_or(0),
                capacity: self.capacity,
            });
        }
        Ok(f)
    }

    pub(super) fn allocate(
        self: &Arc<Self>,
        bytes: usize,
        name: Option<Arc<str>>,
        tag: Tag,
    ) -> Result<Allocation> {
        let footprint = self.footprint(bytes)?;
        let kind = front_kind(name.as_ref(), &tag);
        // Hottest path: a block this thread freed and kept, still live in the books.
        if let Some((off, slot)) = self.take_from_thread_front(footprint, kind) {
            // SAFETY: live in the books, with the pool kept alive for it, and now ours.
            return Ok(unsafe { Allocation::new(self, off, bytes, footprint, slot, kind) });
        }
        {
            // Hot path: a freed range of this very size, no driver call, nothing to plan.
            let mut st = self.state.lock();
            if st.refusing.is_none() && st.sleep.status == SleepStatus::Awake {
                if let Some(off) = st.quick.take(footprint) {
                    // Taking warm memory changes no physical figure: only the in-use peak.
                    let slot = record(&mut st, off, footprint, name, tag);
                    st.peak_in_use = st.peak_in_use.max(st.in_use());
                    st.keep_alive.hold(self);
                    drop(st);
                    // SAFETY: recorded live just above, with the pool kept alive for it.
                    return Ok(unsafe { Allocation::new(self, off, bytes, footprint, slot, kind) });
                }
            }
        }
        self.allocate_slow(bytes, footprint, name, tag, kind)
    }

    /// [`Inner::allocate`] past the quick bins: refusals, best fit in idle memory, growth.
    #[cold]
    #[inline(never)]
    fn allocate_slow(
        self: &Arc<Self>,
        bytes: usize,
        footprint: u64,
        name: Option<Arc<str>>,
        tag: Tag,
        kind: u8,
    ) -> Result<Allocation> {
        let mut fronts_flushed = false;
        let mut rounds = 0;
        while rounds < MAX_ROUNDS {
            let growth = {
                let mut st = self.state.lock();
                if let Some(reason) = &st.refusing {
                    return Err(self.refusal(reason));
                }
                // Idle memory of a sleeping pool is unmapped: nothing may be handed out.
                st.sleep.refuse_unless_awake(&self.name, "allocate")?;
                let warm = match st.take_warm(footprint) {
                    // Hot path: warm memory, no driver call.
                    Some(off) => Some(off),
                    None => {
                        st.flush_quick();
                        st.idle.take_best_fit(footprint)
                    }
                };
                if let Some(off) = warm {
                    // Taking warm memory changes no physical figure: only the in-use peak.
                    let slot = record(&mut st, off, footprint, name, tag);
                    st.peak_in_use = st.peak_in_use.max(st.in_use());
                    st.keep_alive.hold(self);
                    drop(st);
                    // SAFETY: recorded live just above, with the pool kept alive for it.
                    return Ok(unsafe { Allocation::new(self, off, bytes, footprint, slot, kind) });
                }
                if !fronts_flushed {
                    // Blocks threads keep for their next allocation are idle memory: take them
                    // back before growing (or refusing) for this one.
                    drop(st);
                    fronts_flushed = true;
                    self.flush_fronts_now();
                    continue;
                }
                rounds += 1;
                self.plan_growth(&mut st, footprint)?
            };
            if let Some((off, slot)) = self.grow(growth, footprint, &name, &tag)? {
                // SAFETY: `grow` recorded it live and keeps the pool alive for it.
                return Ok(unsafe { Allocation::new(self, off, bytes, footprint, slot, kind) });
            }
        }
        Err(Error::InvalidArgument(format!(
            "allocation of {bytes} bytes lost its address space to racing growths {MAX_ROUNDS} times"
        )))
    }

    /// Choose where to grow: the cold range that needs the least new mapping, using an idle
    /// range that ends where it starts. Claims the ranges and takes cached chunks.
    fn plan_growth(&self, st: &mut State, footprint: u64) -> Result<Growth> {
        let g = self.gran;
        let mut best: Option<Candidate> = None;
        let mut consider = |c: Candidate| {
            if best
                .as_ref()
                .is_none_or(|b| (c.needed, c.start) < (b.needed, b.start))
            {
                best = Some(c);
            }
        };
        for (cs, ce) in st.cold.iter() {
            if let Some((is, ie)) = st.idle.intervals().ending_at(cs) {
                let needed = (footprint - (ie - is)).div_ceil(g) * g;
                if needed <= ce - cs {
                    consider(Candidate {
                        needed,
                        start: is,
                        idle: Some((is, ie)),
                        cold: (cs, ce),
                    });
                }
            }
            let needed = footprint.div_ceil(g) * g;
            if needed <= ce - cs {
                consider(Candidate {
                    needed,
                    start: cs,
                    idle: None,
                    cold: (cs, ce),
                });
            }
        }
        let Some(Candidate {
            needed,
            start,
            idle,
            cold: (cs, ce),
        }) = best
        else {
            let largest = st
                .cold
                .iter()
                .map(|(cs, ce)| {
                    ce - cs + st.idle.intervals().ending_at(cs).map_or(0, |(s, e)| e - s)
                })
                .max()
                .unwrap_or(0)
                .max(st.idle.largest());
            return Err(Error::OutOfAddressSpace {
                requested: footprint,
                largest_free: largest,
                capacity: self.capacity,
            });
        };
        let ahead = st
            .mapped
            .checked_div(self.growth_divisor)
            .map_or(0, |a| (a / g * g).clamp(g, self.max_chunk));
        let mut len = needed.max(ahead).min(ce - cs);
        let mut cached = st.cache.take_up_to(len, self.max_chunk as usize);
        let got = bytes_of(&cached);
        if got < needed {
            // A cached chunk bigger than what is left is still better than a new one (it is
            // created and charged already): grow by all of it when the address space allows.
            let room = (ce - cs - got).min(self.max_chunk) as usize;
            if let Some(c) = st.cache.take_smallest_in((needed - got) as usize, room) {
                len = len.max(got + c.size as u64);
                cached.push(c);
            }
        }
        let cached = self.take_out(cached);
        if let Some((is, ie)) = idle {
            st.idle.remove(is, ie);
            st.in_transit += ie - is;
        }
        st.cold.remove(cs, cs + len);
        st.in_transit += len;
        st.growing += 1;
        Ok(Growth {
            start,
            idle,
            cold: (cs, cs + len),
            room_end: ce,
            needed,
            cached,
        })
    }

    /// Back a planned growth with physical memory, map it and record the allocation. `None`
    /// (nothing lost: the chunks wait in the cache) when the address space it had to extend
    /// into was taken meanwhile: plan again.
    fn grow(
        self: &Arc<Self>,
        plan: Growth,
        footprint: u64,
        name: &Option<Arc<str>>,
        tag: &Tag,
    ) -> Result<Option<(u64, u32)>> {
        let (cs, claimed_end) = plan.cold;
        let mut chunks = Gathered {
            reusable: plan.cached,
            created: Vec::new(),
        };
        // What the request needs is obtained at any cost; the look-ahead only if it is free.
        let required = plan.needed.saturating_sub(chunks.bytes());
        let fit = Fit {
            max_chunk: self.max_chunk,
            room: plan.room_end - cs - chunks.bytes(),
        };
        // Chunks whose bytes were someone else's (another model's, or an earlier user's of new
        // memory where the backend promises no zeros) are cleared before the allocation is
        // handed out.
        let mut dirty: Vec<PhysicalChunk> = Vec::new();
        let zeroed_creates = self.backend.creates_zeroed();
        match self.obtain(required, Urgency::Required, fit) {
            Ok(o) => {
                dirty.extend(&o.donated);
                if !zeroed_creates {
                    dirty.extend(&o.created);
                }
                chunks.reusable.extend(o.donated);
                chunks.created.extend(o.created);
            }
            Err(e) => {
                self.undo_growth(&plan.idle, plan.cold, chunks, &[]);
                return Err(e);
            }
        }
        let optional = (claimed_end - cs).saturating_sub(chunks.bytes());
        if optional > 0 {
            let fit = Fit {
                max_chunk: self.max_chunk,
                room: optional,
            };
            match self.obtain(optional, Urgency::LookAhead, fit) {
                Ok(o) => {
                    dirty.extend(&o.donated);
                    if !zeroed_creates {
                        dirty.extend(&o.created);
                    }
                    chunks.reusable.extend(o.donated);
                    chunks.created.extend(o.created);
                }
                Err(e) if e.is_out_of_memory() => {
                    tracing::debug!(pool = %self.name, optional, "no memory for growth look-ahead; mapping what is needed");
                }
                Err(e) => {
                    self.undo_growth(&plan.idle, plan.cold, chunks, &[]);
                    return Err(e);
                }
            }
        }
        let total = chunks.bytes();
        let mut claim = plan.cold;
        if cs + total > claimed_end {
            // Handed-over or cached chunks bigger than the claim: extend it if still free.
            let mut st = self.state.lock();
            if st.cold.covers(claimed_end, cs + total) {
                st.cold.remove(claimed_end, cs + total);
                st.in_transit += cs + total - claimed_end;
                claim.1 = cs + total;
            } else {
                drop(st);
                let all = chunks.reusable.into_iter().chain(chunks.created).collect();
                self.undo_growth(&plan.idle, plan.cold, Gathered::default(), &[]);
                self.stash(all);
                return Ok(None);
            }
        }
        let order: Vec<PhysicalChunk> = chunks
            .reusable
            .iter()
            .chain(&chunks.created)
            .copied()
            .collect();
        let to_fill = self.wipe_unmapped(dirty);
        // SAFETY: `[cs, cs + total)` is claimed (in transit) and unmapped; the chunks are ours.
        let mapped = unsafe { self.map_run(cs, &order) }.and_then(|()| {
            let mut at = cs;
            let placed: Vec<super::mapper::Placed> = order
                .iter()
                .map(|&c| {
                    at += c.size as u64;
                    (at - c.size as u64, c)
                })
                .collect();
            self.fill_placed(&placed, &to_fill).map_err(|error| {
                // SAFETY: mapped just above, seen by nobody.
                let undone = unsafe { self.unmap_placed(placed) };
                super::mapper::MapFailure {
                    error,
                    stuck: undone.kept,
                }
            })
        });
        if let Err(f) = mapped {
            let stuck: Vec<u64> = f.stuck.iter().map(|(o, _)| *o).collect();
            let keep = |c: &Vec<PhysicalChunk>| -> Vec<PhysicalChunk> {
                let mut at = cs;
                let mut out = Vec::new();
                for x in &order {
                    if !stuck.contains(&at) && c.contains(x) {
                        out.push(*x);
                    }
                    at += x.size as u64;
                }
                out
            };
            let rest = Gathered {
                reusable: keep(&chunks.reusable),
                created: keep(&chunks.created),
            };
            self.undo_growth(&plan.idle, claim, rest, &f.stuck);
            return Err(f.error);
        }
        let mut st = self.state.lock();
        let mut at = cs;
        for c in &order {
            st.chunks.insert(at, *c);
            at += c.size as u64;
        }
        st.mapped += total;
        self.in_flight
            .fetch_sub(total, std::sync::atomic::Ordering::AcqRel);
        st.in_transit -= (claim.1 - cs) + plan.idle.map_or(0, |(s, e)| e - s);
        st.growing -= 1;
        if cs + total < claim.1 {
            st.cold.insert(cs + total, claim.1);
        }
        let end = plan.start + footprint;
        if end < cs + total {
            st.idle.insert(end, cs + total);
        }
        let slot = record(&mut st, plan.start, footprint, name.clone(), tag.clone());
        st.note_peaks();
        st.keep_alive.hold(self);
        drop(st);
        tracing::debug!(pool = %self.name, offset = cs, mapped = total, chunks = order.len(), "grew");
        Ok(Some((plan.start, slot)))
    }

    /// Put a planned growth back: the address space, the reusable chunks to the cache, the
    /// created ones to the driver; `stuck` chunks (mapped, their rollback failed) stay where
    /// they are, out of use.
    fn undo_growth(
        &self,
        idle: &Option<(u64, u64)>,
        (cs, ce): (u64, u64),
        chunks: Gathered,
        stuck: &[Placed],
    ) {
        {
            let mut st = self.state.lock();
            if let Some((s, e)) = *idle {
                st.idle.insert(s, e);
                st.in_transit -= e - s;
            }
            st.in_transit -= ce - cs;
            st.growing -= 1;
            let mut at = cs;
            for &(o, c) in stuck {
                if at < o {
                    st.cold.insert(at, o);
                }
                at = o + c.size as u64;
            }
            if at < ce {
                st.cold.insert(at, ce);
            }
            st.put_stuck(stuck);
            self.in_flight.fetch_sub(
                bytes_of(stuck.iter().map(|(_, c)| c)),
                std::sync::atomic::Ordering::AcqRel,
            );
        }
        self.stash(chunks.reusable);
        // Rollback: a chunk that cannot be released stays cached (logged).
        let _ = self.release_chunks(chunks.created);
    }

    /// Called by [`Allocation`]'s drop. On a closed pool, returns a reference to it (its
    /// last one when this was the last allocation): the caller drops it (which may end the
    /// pool) once nothing of the pool is used any more.
    #[must_use]
    pub(crate) fn free(&self, offset: u64, footprint: u64, slot: u32) -> Option<Arc<Inner>> {
        let (closed, last) = {
            let mut st = self.state.lock();
            st.live.remove(slot);
            st.alloc_bytes -= footprint;
            st.frees += 1;
            st.put_warm(offset, footprint);
            // A closed pool's free goes on using the pool after the lock (the trim below),
            // while another thread may free the last allocation: it holds the pool itself.
            let last = if st.closed {
                st.take_unused_keep_alive()
                    .or_else(|| st.keep_alive.clone_held())
            } else {
                None
            };
            (st.closed, last)
        };
        if closed {
            // Nobody can allocate any more: give the memory straight back.
            if let Err(e) = self.trim(u64::MAX, super::TrimScope::IdleAndCache) {
                tracing::warn!(pool = %self.name, error = %e, "giving back memory of a closed pool failed");
            }
        }
        last
    }
}

fn record(st: &mut State, offset: u64, footprint: u64, name: Option<Arc<str>>, tag: Tag) -> u32 {
    st.alloc_bytes += footprint;
    st.allocations += 1;
    st.live.insert(LiveRecord {
        offset,
        footprint,
        name,
        tag,
    })
}
