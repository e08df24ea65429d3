//! A paged KV cache an engine adopts: block ids in, per-layer tensors' memory out, physical
//! memory only under live blocks.
//!
//! [`PagedKv`] reserves, in one region of a [`crate::Pool`] (or a [`crate::ModelHandle`]'s
//! pool), the address space of a model's whole KV cache for `max_blocks` blocks, laid out as
//! the engine's kernels want it ([`KvLayout`]): per layer a K and a V tensor
//! `[blocks, block_tokens, kv_heads, head_dim]` (mistral.rs and candle-vllm), or one
//! contiguous tensor `[blocks, layers, 2, block_tokens, kv_heads, head_dim]`. Nothing is
//! mapped until blocks are allocated:
//! - [`PagedKv::alloc`] hands out block ids and maps the pages under them in every tensor at
//!   once (one request for memory, one map per page, all or nothing);
//! - [`PagedKv::free`] takes them back; a page goes back to the pool when no backed block
//!   touches it; [`PagedKv::available`] says how many blocks can still be had under the
//!   model's limit without reclaiming anything;
//! - every unbacked page of the tensors is aliased read-only to the pool's zero page (on a host
//!   tier, by default, left unmapped instead: [`PagedKvConfig::zero_unbacked`])
//!   ([`crate::MemOptions::zeroed`] at [`crate::Pool::reserve_region_with`]). What a read of
//!   a block nobody allocated gets: zeros where its page is unbacked; where a backed block
//!   keeps the page mapped, zeros or bytes this cache wrote into it before it was freed, never
//!   another model's or engine's (memory mapped from elsewhere is cleared first). On the host
//!   backend such a read never faults (a page's mapping is replaced in one step); on CUDA a read
//!   racing the map or unmap of its page may fault (an illegal address that poisons the
//!   context). **A write into a block that is not allocated faults** where its page is unbacked
//!   (host: `SIGSEGV`; CUDA: an illegal-address error). Backends that cannot map read-only
//!   are refused when the cache is made;
//! - with [`PagedKvConfig::null_block`], block 0 is reserved for padded block tables
//!   (mistral.rs and candle-vllm pad with 0): backed and all zeros while the pool is awake,
//!   never handed out, freed, released, compacted or moved, charged to the model and counted
//!   in the stats' `mapped_bytes` (not in `live`); `alloc` gives at most `max_blocks - 1`
//!   blocks and [`PagedKv::available`] never counts it. Its pages are never unmapped, so on
//!   CUDA too a padded read of it cannot fault while neighbours are mapped or unmapped. A
//!   sleep that discards KV drops its memory with the rest (no kernel may run while the pool
//!   sleeps); the wake clears it again;
//! - with [`Watermarks`], blocks are kept mapped ahead of need (mapped but free, "warm") by a
//!   background thread, so that `alloc` on the token path makes no driver call in steady
//!   state; see [`Watermarks`] for the rules (never another model's memory, bounded look-ahead,
//!   back to the idle floor after a spike);
//! - the memory is tagged [`crate::Tag::Kv`]: [`crate::Pool::sleep`] with a policy that
//!   discards KV unmaps it and keeps weights, and wakes it at the same addresses (contents
//!   gone); `alloc` is refused while the pool sleeps.
//!
//! - [`PagedKv::compact`] moves live blocks off sparsely used pages into free slots of densely
//!   used ones and gives the sparse pages back (ids change: it returns the renaming for the
//!   engine's block tables); [`PagedKv::compaction_gain`] says what it would give back now.
//!   After a spike, the idle footprint is bounded by placement only at `alloc` time, which
//!   cannot pack survivors allocated interleaved in time; compaction can. See the `compact`
//!   module's documentation (private; summarized on [`PagedKv::compact`]) for the contract.
//!
//! - [`PagedKv::move_to`] moves blocks to another cache of the same shape on other memory (a
//!   cache on a host tier, [`crate::Pool::host_tier`]): an engine evicts cold blocks to host
//!   memory and brings them back, both sides elastic. It returns a [`KvMove`] with the copies
//!   under way (in stream order on a device); the blocks are pinned until it is waited for.
//!   See the `moves` module's documentation (private; summarized on [`KvMove`]).
//!
//! - [`BlockPool`] is the face a candle engine's block manager calls (take, free, a reserved
//!   null block 0, a prefix cache whose unreferenced blocks are reclaimable, evicted least
//!   recently used first when a take is short or the model's memory is reclaimed);
//!   [`PagedKvConfig::size_for_budget`] sizes a cache from a model's limit and guarantee
//!   instead of a fraction of free memory.
//!
//! Reclaim: a model's reclaim callback ([`crate::ModelConfig::on_reclaim`]) frees the blocks of
//! sequences it evicts and calls [`PagedKv::trim`], which gives warm blocks back too.

mod ahead;
mod block_pool;
mod compact;
mod moves;
mod paged;

pub use block_pool::{BlockHash, BlockPool, BlockPoolHook, BlockPoolStats, KvSizing};
pub use compact::{Compaction, CompactionGain, GiveBack};
pub use moves::KvMove;
pub use paged::{BlockId, KvLayout, PagedKv, PagedKvConfig, PagedKvStats, Watermarks};
