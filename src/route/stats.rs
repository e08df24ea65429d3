//! What routing reports: per model and tag counters, refusals, the largest live blocks.

use std::fmt;

use crate::Tag;

/// Routed memory of one tag of one model.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TagStats {
    /// The tag.
    pub tag: Tag,
    /// Bytes of live routed allocations (as asked, before rounding to a size class).
    pub live_bytes: u64,
    /// Live routed allocations.
    pub live_blocks: u64,
    /// Highest `live_bytes` seen.
    pub peak_bytes: u64,
    /// Allocations served since routing began.
    pub allocations: u64,
    /// Frees.
    pub frees: u64,
    /// Of `allocations`, those served by a block freed before on the same stream.
    pub reused: u64,
    /// Allocations refused (out of memory at the model's limit, or no room).
    pub refusals: u64,
    /// Driver calls the pool made while serving this tag's allocations (growth: create, map,
    /// set access). A concurrent growth of the same pool for another tag can land in either.
    pub driver_calls: u64,
}

/// Routing's view of one model (one pool).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RouteStats {
    /// The pool's (model's) name.
    pub model: String,
    /// Per tag, in tag order.
    pub tags: Vec<TagStats>,
    /// Bytes of freed blocks kept for reuse on the stream they were freed on (still in use
    /// from the pool's point of view; `route::flush` gives them back).
    pub cached_bytes: u64,
    /// Blocks in that cache.
    pub cached_blocks: u64,
    /// Bytes behind fences: freed, going back to the pool once the GPU passed the fence
    /// (and those a flush is fencing or handing back at the moment).
    pub fenced_bytes: u64,
    /// Bytes held for CUDA graphs (allocated or freed during a capture) until
    /// `route::release_captured`.
    pub parked_bytes: u64,
    /// Allocations that went to the pool (the others reused a cached block).
    pub pool_allocations: u64,
    /// Fences recorded (one CUDA event record each on a GPU).
    pub fences: u64,
    /// Allocations made while their stream was captured into a graph.
    pub captured_allocations: u64,
    /// Driver calls for this model: every call its pool made (growth, trims, releases: see
    /// [`crate::Pool::stats`] by kind) plus the fences routing recorded.
    pub driver_calls: u64,
    /// The last refusal, if any.
    pub last_refusal: Option<Refusal>,
}

impl RouteStats {
    /// Live bytes over all tags.
    pub fn live_bytes(&self) -> u64 {
        self.tags.iter().map(|t| t.live_bytes).sum()
    }

    /// The stats of `tag`, if anything was allocated under it.
    pub fn tag(&self, tag: &Tag) -> Option<&TagStats> {
        self.tags.iter().find(|t| &t.tag == tag)
    }
}

/// Why a routed allocation was refused, with the numbers. The hook itself can only return
/// `CUDA_ERROR_OUT_OF_MEMORY` to candle; this is the whole story
/// (`route::last_refusal` on the thread that asked, or [`RouteStats::last_refusal`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Refusal {
    /// The model (pool) the allocation was routed to.
    pub model: String,
    /// The tag of the route.
    pub tag: Tag,
    /// Bytes asked for.
    pub asked: u64,
    /// Bytes of live routed memory the model had under all tags when it was refused.
    pub routed_live: u64,
    /// Physical bytes the model's pool held (mapped and cached).
    pub physical: u64,
    /// The model's physical use when admission refused (`None` for other refusals).
    pub model_used: Option<u64>,
    /// The model's limit when admission refused.
    pub model_limit: Option<u64>,
    /// The pool's error, with every number it has (e.g. the global budget's).
    pub reason: String,
}

impl fmt::Display for Refusal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "model {:?} ({}) refused {} bytes: {} (routed live {} bytes, pool holds {} bytes)",
            self.model, self.tag, self.asked, self.reason, self.routed_live, self.physical
        )
    }
}

impl std::error::Error for Refusal {}

/// One live routed allocation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LiveBlock {
    /// Device address.
    pub addr: u64,
    /// Bytes asked for.
    pub size: u64,
    /// Bytes held (the size class).
    pub held: u64,
    /// Tag of the route that made it.
    pub tag: Tag,
    /// Whether it was made during a graph capture.
    pub captured: bool,
}

/// The largest live routed allocations of a model, with totals
/// (after gpu-allocator's `generate_report`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Report {
    /// The model.
    pub model: String,
    /// Live routed allocations in all.
    pub live_blocks: u64,
    /// Their bytes.
    pub live_bytes: u64,
    /// The largest, largest first.
    pub largest: Vec<LiveBlock>,
}

impl fmt::Display for Report {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "model {:?}: {} live routed allocations, {} bytes",
            self.model, self.live_blocks, self.live_bytes
        )?;
        writeln!(
            f,
            "  {:>18}  {:>14}  {:>14}  tag",
            "address", "bytes", "held"
        )?;
        for b in &self.largest {
            writeln!(
                f,
                "  {:#18x}  {:>14}  {:>14}  {}{}",
                b.addr,
                b.size,
                b.held,
                b.tag,
                if b.captured { " (graph)" } else { "" }
            )?;
        }
        Ok(())
    }
}
