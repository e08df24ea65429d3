//! Every live routed allocation, by address: how a free on any thread finds its pool.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};
use std::sync::Arc;

use parking_lot::Mutex;

use super::stats::LiveBlock;
use super::target::{TagCounters, Target};
use crate::pool::Allocation;

/// How a block came to be.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Origin {
    /// An ordinary allocation.
    Eager,
    /// Made while its stream was being captured into a CUDA graph: the graph may use it at
    /// every launch, so it is parked when freed, never reused.
    Captured,
}

/// A live routed allocation.
#[derive(Debug)]
pub(crate) struct Block {
    pub(crate) memory: Allocation,
    pub(crate) target: Arc<Target>,
    pub(crate) tag: Arc<TagCounters>,
    /// Bytes asked for.
    pub(crate) size: usize,
    /// The size class it was served from (its key in the stream caches).
    pub(crate) class: usize,
    pub(crate) origin: Origin,
}

/// Addresses are multiples of 512 and hash well with one multiply.
#[derive(Default)]
struct AddrHasher(u64);

impl Hasher for AddrHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0 << 8 | u64::from(b)).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        }
    }
    fn write_u64(&mut self, v: u64) {
        self.0 = (v >> 9).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    }
}

type Shard = Mutex<HashMap<u64, Block, BuildHasherDefault<AddrHasher>>>;

const SHARDS: usize = 16;

static TABLE: [Shard; SHARDS] =
    [const { Mutex::new(HashMap::with_hasher(BuildHasherDefault::new())) }; SHARDS];

fn shard(addr: u64) -> &'static Shard {
    &TABLE[((addr >> 9).wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 60) as usize % SHARDS]
}

/// Record a live block under its address.
pub(crate) fn insert(block: Block) {
    let addr = block.memory.addr();
    let old = shard(addr).lock().insert(addr, block);
    // Two live blocks at one address would mean the pool handed out memory twice.
    debug_assert!(old.is_none(), "routed address {addr:#x} handed out twice");
}

/// Take the live block at `addr` out of the table, if routing owns it.
pub(crate) fn remove(addr: u64) -> Option<Block> {
    shard(addr).lock().remove(&addr)
}

/// Whether `addr` is a live routed allocation.
pub(crate) fn contains(addr: u64) -> bool {
    shard(addr).lock().contains_key(&addr)
}

/// The live blocks of `target`: count, bytes, and the `n` largest.
pub(crate) fn largest(target: &Arc<Target>, n: usize) -> (u64, u64, Vec<LiveBlock>) {
    let mut all = Vec::new();
    for s in &TABLE {
        let s = s.lock();
        all.extend(
            s.values()
                .filter(|b| Arc::ptr_eq(&b.target, target))
                .map(|b| LiveBlock {
                    addr: b.memory.addr(),
                    size: b.size as u64,
                    held: b.memory.footprint(),
                    tag: b.tag.tag.clone(),
                    captured: b.origin == Origin::Captured,
                }),
        );
    }
    let count = all.len() as u64;
    let bytes = all.iter().map(|b| b.size).sum();
    all.sort_by(|a, b| b.size.cmp(&a.size).then(a.addr.cmp(&b.addr)));
    all.truncate(n);
    (count, bytes, all)
}
