//! The block-pool face of the paged KV cache ([`elastic_vmm::kv::BlockPool`]) on the host
//! backend (real `memfd` memory): take/free, the null block, prefix-cache eviction (LRU, on a
//! short take and on a reclaim), budget changes, sizing by budget, and limits read from the
//! environment.

use std::sync::Arc;

use elastic_vmm::backend::host::HostBackend;
use elastic_vmm::kv::{BlockId, BlockPool, BlockPoolHook, KvLayout, PagedKv, PagedKvConfig};
use elastic_vmm::{
    Backend, Error, ModelConfig, ModelHandle, PoolConfig, SharedPool, SharedPoolConfig,
};

/// The host granularity (2 MiB).
const G: u64 = 2 << 20;

/// One layer (a K and a V tensor), two heads of 64 f16 elements (256 bytes a token), one page
/// per block in each tensor: a block costs `2 * G` of physical memory.
const BLOCK: u64 = 2 * G;

/// Unbacked pages left unmapped: no zero page, so the byte counts are the blocks' alone (the
/// zero page's charge is tested in `tests/shared_pool.rs`, its sizing below).
fn cfg(max_blocks: usize) -> PagedKvConfig {
    PagedKvConfig::new(1, 2, 64, (G / 256) as usize, 2, max_blocks).zero_unbacked(false)
}

fn shared(global: u64) -> SharedPool {
    let backend: Arc<dyn Backend> = Arc::new(HostBackend::new(G as usize).expect("host backend"));
    SharedPool::new(backend, SharedPoolConfig::new().global_limit(global)).expect("shared")
}

/// A model of `limit` bytes, no look-ahead growth (exact byte counts).
fn model(config: ModelConfig) -> ModelConfig {
    config.pool_config(PoolConfig::new(1 << 30).growth_divisor(0))
}

fn register(s: &SharedPool, id: &str, limit: u64) -> ModelHandle {
    s.register(model(ModelConfig::new(id, 1 << 30, limit)))
        .expect("model")
}

fn read(bp: &BlockPool, addr: u64, len: usize) -> Vec<u8> {
    let mut out = vec![0xEEu8; len];
    // SAFETY: the tests read blocks of a live cache, mapped or aliased to the zero page.
    unsafe { bp.kv().pool().backend().copies().read(addr, &mut out) }.expect("read");
    out
}

fn write(bp: &BlockPool, addr: u64, data: &[u8]) {
    // SAFETY: the tests write only blocks they hold a reference to.
    unsafe { bp.kv().pool().backend().copies().write(addr, data) }.expect("write");
}

fn span_at(bp: &BlockPool, b: BlockId, t: usize) -> u64 {
    bp.kv().tensor_addr(t).expect("tensor") + b as u64 * bp.kv().block_span_bytes()
}

/// Distinct bytes for a block's content `tag` in tensor `t`.
fn pattern(tag: u64, t: usize, len: usize) -> Vec<u8> {
    let mut x = (tag << 8 | t as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..len)
        .map(|_| {
            x ^= x >> 12;
            x ^= x << 25;
            x ^= x >> 27;
            x.wrapping_mul(0x2545_F491_4F6C_DD1D) as u8
        })
        .collect()
}

/// Write content `tag` over every tensor's span of `b`.
fn fill(bp: &BlockPool, b: BlockId, tag: u64) {
    let span = bp.kv().block_span_bytes() as usize;
    for t in 0..bp.kv().tensors() {
        write(bp, span_at(bp, b, t), &pattern(tag, t, span));
    }
}

fn holds(bp: &BlockPool, b: BlockId, tag: u64) -> bool {
    let span = bp.kv().block_span_bytes() as usize;
    (0..bp.kv().tensors()).all(|t| read(bp, span_at(bp, b, t), span) == pattern(tag, t, span))
}

fn null_reads_zeros(bp: &BlockPool) -> bool {
    let span = bp.kv().block_span_bytes() as usize;
    (0..bp.kv().tensors()).all(|t| read(bp, span_at(bp, 0, t), span).iter().all(|&x| x == 0))
}

fn used(m: &ModelHandle) -> u64 {
    m.model_stats().expect("stats").used
}

/// Cached blocks are evicted least recently released first when a take is short (here by the
/// model's limit), a revived block (`take_cached`) is the same block with its bytes intact, and
/// a revived block released again is the most recent.
#[test]
fn a_short_take_evicts_the_least_recently_released_and_a_hit_keeps_its_bytes() {
    let s = shared(64 * BLOCK);
    // The null block and four blocks fit the limit; the cache has room for fifteen.
    let m = register(&s, "m", 5 * BLOCK);
    let bp = BlockPool::new(&m, cfg(16)).expect("block pool");
    assert_eq!(bp.null_block(), 0);
    assert_eq!(bp.free_blocks(), 4);
    let ids = bp.take(4).expect("take");
    assert!(!ids.contains(&0), "the null block is never handed out");
    let (a, b, c, d) = (ids[0], ids[1], ids[2], ids[3]);
    for (i, &x) in ids.iter().enumerate() {
        fill(&bp, x, 100 + i as u64);
    }
    // Released (hashes 1..4 for a..d) in the order a, c, b, d.
    for (x, h) in [(a, 1), (c, 3), (b, 2), (d, 4)] {
        bp.release_cached(x, h).expect("release");
    }
    assert_eq!(bp.stats().cached, 4);
    assert_eq!(bp.stats().referenced, 0);
    assert_eq!(bp.lookup(2), Some(b));
    assert_eq!(bp.free_blocks(), 4, "cached blocks count as takeable");
    assert_eq!(used(&m), 5 * BLOCK, "cached blocks keep their pages");

    // The limit is full: each take evicts the oldest cached block.
    let x = bp.take(1).expect("take evicting a");
    assert_eq!(bp.lookup(1), None, "a (released first) evicted first");
    assert_eq!(bp.lookup(3), Some(c));
    let y = bp.take(1).expect("take evicting c");
    assert_eq!(bp.lookup(3), None, "c evicted second");
    assert_eq!((bp.lookup(2), bp.lookup(4)), (Some(b), Some(d)));
    assert_eq!(bp.stats().evicted_for_take, 2);
    assert!(!x.contains(&0) && !y.contains(&0));

    // A hit revives the same block, bytes intact.
    assert_eq!(bp.take_cached(2), Some(b));
    assert!(
        holds(&bp, b, 101),
        "b's bytes survived its time in the cache"
    );
    assert_eq!(bp.take_cached(1), None, "a is gone");
    let st = bp.stats();
    assert_eq!((st.hits, st.misses, st.cached, st.referenced), (1, 1, 1, 3));

    // Released again, b is the most recent: the next short take evicts d, not b.
    bp.release_cached(b, 2).expect("release b again");
    bp.take(1).expect("take evicting d");
    assert_eq!((bp.lookup(4), bp.lookup(2)), (None, Some(b)));
    assert!(holds(&bp, b, 101));
    assert!(null_reads_zeros(&bp));
    assert!(used(&m) <= 5 * BLOCK);
    s.audit().expect("audit");
}

/// An owner presenting the cache otherwise (as `PagedKvTensors` presents it to kernels).
struct Presenter(PagedKv);

impl AsRef<PagedKv> for Presenter {
    fn as_ref(&self) -> &PagedKv {
        &self.0
    }
}

/// A block pool over a cache another owner presents hands out that owner's blocks: what the
/// pool takes is live in the owner's cache, a hit keeps its bytes, a free goes back to it; the
/// conditions of `over` hold (the null block reserved, no block allocated before).
#[test]
fn a_block_pool_over_a_shared_cache_hands_out_the_owners_blocks() {
    let s = shared(64 * BLOCK);
    let m = register(&s, "m", 5 * BLOCK);
    let owner = Arc::new(Presenter(
        PagedKv::new(&m, cfg(16).null_block(true)).expect("cache"),
    ));
    let bp = BlockPool::over_shared(owner.clone()).expect("block pool");
    let ids = bp.take(3).expect("take");
    assert_eq!(owner.0.stats().live, 3, "taken in the owner's cache");
    fill(&bp, ids[0], 7);
    bp.release_cached(ids[0], 70).expect("release");
    assert_eq!(bp.take_cached(70), Some(ids[0]));
    assert!(holds(&bp, ids[0], 7), "a hit keeps its bytes");
    bp.free(&ids).expect("free");
    assert_eq!(owner.0.stats().live, 0, "freed in the owner's cache");
    assert!(null_reads_zeros(&bp));
    // Dropped with blocks held (one referenced, one cached), it gives them back to the owner,
    // whose cache another pool can then adopt.
    let kept = bp.take(2).expect("take");
    bp.release_cached(kept[0], 71).expect("release");
    assert_eq!(owner.0.stats().live, 2);
    drop(bp);
    assert_eq!(
        owner.0.stats().live,
        0,
        "the pool's blocks went back with it"
    );
    let again = BlockPool::over_shared(owner.clone()).expect("a second pool adopts the cache");
    drop(again);
    // Refused as `over` refuses: no null block; blocks allocated already.
    let plain = Arc::new(Presenter(PagedKv::new(&m, cfg(4)).expect("cache")));
    let e = BlockPool::over_shared(plain).expect_err("no null block");
    assert!(e.to_string().contains("null block"), "{e}");
    let held = owner.0.alloc(1).expect("alloc");
    let e = BlockPool::over_shared(owner.clone()).expect_err("a block allocated");
    assert!(e.to_string().contains("1 blocks allocated already"), "{e}");
    owner.0.free(&held).expect("free");
    s.audit().expect("audit");
}

/// The null block reads zeros, is never handed out (a full take gives every other block),
/// cannot be freed or released, and no eviction or reclaim unmaps it; bad ids change nothing.
#[test]
fn the_null_block_is_never_handed_out_freed_or_evicted() {
    let s = shared(64 * BLOCK);
    let m = register(&s, "m", 16 * BLOCK);
    let bp = BlockPool::new(&m, cfg(4)).expect("block pool");
    assert_eq!(bp.total_blocks(), 3);
    assert!(null_reads_zeros(&bp));
    let ids = bp.take(3).expect("every allocatable block");
    let mut sorted = ids.clone();
    sorted.sort_unstable();
    assert_eq!(sorted, vec![1, 2, 3]);
    assert!(matches!(
        bp.take(1),
        Err(Error::KvOutOfBlocks { requested: 1, .. })
    ));
    for (i, &b) in ids.iter().enumerate() {
        fill(&bp, b, i as u64);
    }
    for bad in [
        bp.free(&[0]),
        bp.release_cached(0, 7),
        bp.free(&[ids[0], ids[0]]),
        bp.free(&[9]),
    ] {
        assert!(matches!(bad, Err(Error::KvBadBlock { .. })), "{bad:?}");
    }
    assert_eq!(bp.stats().referenced, 3, "a refused free changes nothing");
    for (i, &b) in ids.iter().enumerate() {
        bp.release_cached(b, i as u64).expect("release");
    }
    assert!(matches!(bp.free(&[ids[0]]), Err(Error::KvBadBlock { .. })));
    // A reclaim of everything evicts every cached block and keeps the null block's pages.
    let given = bp.reclaim(u64::MAX);
    assert_eq!(given, 3 * BLOCK);
    assert_eq!(bp.stats().cached, 0);
    assert_eq!(
        bp.kv().stats().mapped_bytes,
        BLOCK,
        "only the null block is mapped"
    );
    // The pages are the pool's idle memory now (a reclaim callback's caller gives them back
    // to the driver; here a trim does).
    m.trim().expect("trim");
    assert_eq!(used(&m), BLOCK);
    assert!(null_reads_zeros(&bp));
    let again = bp.take(3).expect("take again");
    assert!(!again.contains(&0));
    bp.free(&again).expect("free");
    s.audit().expect("audit");
}

/// kvcached issues 359 and 390: an idle instance's prefix cache pinned 8.9 GiB against a 2.2
/// GiB cap. Here model `a` is idle with its whole cache cached but unreferenced (and one
/// referenced block): model `b`'s growth finds the global budget full, `a`'s reclaim callback
/// evicts its cached blocks (least recently released first) and `b` grows; the orchestrator
/// then lowers `a`'s limit and more cached blocks go. The referenced block keeps its bytes,
/// and a limit below it is refused.
#[test]
fn a_reclaim_evicts_an_idle_models_prefix_cache_and_the_other_model_grows() {
    let s = shared(12 * BLOCK);
    let hook = BlockPoolHook::new();
    let a = s
        .register(model(
            ModelConfig::new("a", 1 << 30, 10 * BLOCK).on_reclaim(hook.callback()),
        ))
        .expect("a");
    let bpa = Arc::new(BlockPool::new(&a, cfg(16)).expect("a's pool"));
    hook.attach(&bpa);
    let ids = bpa.take(8).expect("a takes 8");
    for (i, &x) in ids.iter().enumerate() {
        fill(&bpa, x, i as u64);
    }
    let kept = ids[7];
    for (i, &x) in ids[..7].iter().enumerate() {
        bpa.release_cached(x, 1000 + i as u64).expect("release");
    }
    assert_eq!(used(&a), 9 * BLOCK, "null + 7 cached + 1 referenced");

    // b's growth finds the global budget full: a's callback evicts its oldest cached blocks
    // (the budget engine asks a donor with a callback, as the broker asks an engine), and b
    // grows. 12 blocks in all: a holds 9, b's null block 1, b's 5 need 3 of a's.
    let b = register(&s, "b", 10 * BLOCK);
    let bpb = BlockPool::new(&b, cfg(16)).expect("b's pool");
    let got = bpb.take(5).expect("b grows over a's idle prefix cache");
    assert_eq!(got.len(), 5);
    let st = bpa.stats();
    assert_eq!((st.cached, st.referenced), (4, 1), "{st:?}");
    assert_eq!(st.evicted_for_reclaim, 3);
    for h in 1000..1003 {
        assert_eq!(bpa.lookup(h), None, "older cached blocks go first");
    }
    assert_eq!(bpa.lookup(1003), Some(ids[3]));
    assert!(holds(&bpa, kept, 7), "the referenced block is untouched");

    // The orchestrator lowers a's cap to the null block, the referenced block and one cached
    // block: three more cached blocks go.
    let r = s.set_limit("a", 3 * BLOCK).expect("a's limit lowered");
    assert!(r.reclaimed_by_callback >= 3 * BLOCK, "{r:?}");
    assert!(used(&a) <= 3 * BLOCK);
    let st = bpa.stats();
    assert_eq!((st.cached, st.referenced), (1, 1), "{st:?}");
    assert_eq!(st.evicted_for_reclaim, 6);
    assert_eq!(st.reclaimed_bytes, 6 * BLOCK);
    for h in 1000..1006 {
        assert_eq!(bpa.lookup(h), None, "older cached blocks go first");
    }
    assert_eq!(
        bpa.lookup(1006),
        Some(ids[6]),
        "the most recent stays cached"
    );
    assert!(holds(&bpa, ids[6], 6));
    assert!(holds(&bpa, kept, 7), "the referenced block is untouched");
    assert!(null_reads_zeros(&bpa));

    // Referenced memory is never taken: a limit below it is refused, the block intact.
    let refused = s.set_limit("a", BLOCK);
    assert!(
        matches!(refused, Err(Error::ChangeNotReached { .. })),
        "{refused:?}"
    );
    assert!(holds(&bpa, kept, 7));
    assert_eq!(bpa.stats().cached, 0, "the last cached block went trying");
    bpa.free(&[kept]).expect("free");
    bpb.free(&got).expect("free");
    s.audit().expect("audit");
}

/// `free_blocks` is what a take could get now: it falls when the limit is lowered and rises
/// when it is raised, counting cached blocks as takeable.
#[test]
fn free_blocks_follows_the_models_budget() {
    let s = shared(64 * BLOCK);
    let hook = BlockPoolHook::new();
    let m = s
        .register(model(
            ModelConfig::new("m", 1 << 30, 6 * BLOCK).on_reclaim(hook.callback()),
        ))
        .expect("m");
    let bp = Arc::new(BlockPool::new(&m, cfg(16)).expect("block pool"));
    hook.attach(&bp);
    assert_eq!(bp.free_blocks(), 5, "limit 6 blocks less the null block");
    let ids = bp.take(2).expect("take");
    assert_eq!(bp.free_blocks(), 3);
    bp.release_cached(ids[0], 1).expect("release");
    assert_eq!(bp.free_blocks(), 4, "3 under the limit + 1 cached");

    s.set_limit("m", 4 * BLOCK).expect("lower");
    assert_eq!(bp.free_blocks(), 2, "1 under the limit + 1 cached");
    s.set_limit("m", 10 * BLOCK).expect("raise");
    assert_eq!(bp.free_blocks(), 8);
    s.set_limit("m", 3 * BLOCK).expect("lower to what is used");
    assert_eq!(bp.free_blocks(), 1, "only the cached block");
    s.set_limit("m", 2 * BLOCK)
        .expect("lower below: the cached block goes");
    assert_eq!(bp.free_blocks(), 0);
    assert_eq!(bp.lookup(1), None);
    assert!(matches!(bp.take(1), Err(Error::AdmissionRefused { .. })));
    s.set_limit("m", 10 * BLOCK).expect("raise");
    assert_eq!(
        bp.free_blocks(),
        8,
        "10 less the null block less 1 referenced"
    );
    let more = bp.take(8).expect("take what free_blocks said");
    assert_eq!(bp.free_blocks(), 0);
    bp.free(&more).expect("free");
    bp.free(&ids[1..]).expect("free");
    s.audit().expect("audit");
}

/// Shared blocks: a block found by hash while referenced is shared (reference counted), and
/// only its last release caches it; a second block released under a hash already kept is
/// freed, not cached.
#[test]
fn a_hash_shares_a_referenced_block_and_duplicates_are_not_cached() {
    let s = shared(64 * BLOCK);
    let m = register(&s, "m", 16 * BLOCK);
    let bp = BlockPool::new(&m, cfg(16)).expect("block pool");
    let ids = bp.take(2).expect("take");
    let b = bp.take(1).expect("take")[0];
    // Two sequences hold `b`: the first releases it under 7, the second found it by hash.
    assert_eq!(bp.take_cached(7), None);
    bp.release_cached(b, 7).expect("release");
    assert_eq!(bp.take_cached(7), Some(b));
    assert_eq!(bp.take_cached(7), Some(b), "shared");
    bp.release_cached(b, 7).expect("one reference left");
    assert_eq!(bp.stats().cached, 0, "still referenced");
    bp.free(&[b])
        .expect("the last reference, freed: the content is dropped");
    assert_eq!(bp.lookup(7), None);
    // ids[0] cached under 9; ids[1] released under 9 too is a duplicate: freed.
    bp.release_cached(ids[0], 9).expect("release");
    bp.release_cached(ids[1], 9).expect("release duplicate");
    assert_eq!(bp.lookup(9), Some(ids[0]));
    let st = bp.stats();
    assert_eq!((st.cached, st.referenced), (1, 0));
    assert_eq!(bp.kv().stats().live, 1);
    s.audit().expect("audit");
}

/// Sizing by budget, with a Llama-3-8B-shaped cache: 32 layers, 8 KV heads of 128 f16, 16
/// tokens a block (32 KiB per tensor, 2 MiB per block across the 64 tensors).
#[test]
fn size_for_budget_numbers() {
    const GIB: u64 = 1 << 30;
    // By default unbacked pages alias the zero page, one page of the model's memory: 8 GiB
    // less 2 MiB over 64 tensors rounds down to 126 MiB a tensor, 4032 blocks (the 4 GiB of
    // the guarantee: 62 MiB a tensor, 1984).
    let aliased = PagedKvConfig::new(32, 8, 128, 16, 2, 1).null_block(true);
    let sz = aliased
        .size_for_budget(24 * GIB, 20 * GIB, 16 * GIB, G)
        .expect("sizing");
    assert_eq!((sz.max_blocks, sz.guaranteed_blocks), (4032, 1984));
    // Without the zero page the numbers are the blocks' alone.
    let c = aliased.zero_unbacked(false);
    // Limit 24 GiB, guarantee 20 GiB, 16 GiB of weights: 8 GiB / 64 tensors = 128 MiB a
    // tensor = 4096 blocks of 32 KiB; the guarantee's 4 GiB, 2048.
    let sz = c
        .size_for_budget(24 * GIB, 20 * GIB, 16 * GIB, G)
        .expect("sizing");
    assert_eq!(sz.max_blocks, 4096);
    assert_eq!(sz.guaranteed_blocks, 2048);
    assert_eq!(sz.block_bytes, 2 << 20);
    // Two such models on an 80 GiB device, each 40 GiB: sized by its own limit whatever the
    // other does (a fraction of free memory would give the first to start ~0.9 * 80 GiB).
    let each = c.size_for_budget(40 * GIB, 0, 16 * GIB, G).expect("sizing");
    assert_eq!(each.max_blocks, 12288);
    assert!(2 * (16 * GIB + each.max_blocks as u64 * each.block_bytes) <= 80 * GIB);
    assert_eq!(
        c.clone()
            .for_budget(40 * GIB, 0, 16 * GIB, G)
            .expect("config")
            .max_blocks,
        12288
    );
    // Pages round down per tensor: 8 GiB + 1 MiB still holds 4096 blocks.
    assert_eq!(
        c.blocks_for_budget(24 * GIB + (1 << 20), 16 * GIB, G)
            .expect("blocks"),
        4096
    );
    // Contiguous: one tensor of 2 MiB blocks.
    let cc = c.clone().layout(KvLayout::Contiguous);
    assert_eq!(
        cc.blocks_for_budget(24 * GIB, 16 * GIB, G).expect("blocks"),
        4096
    );
    assert_eq!(c.blocks_for_budget(GIB, 2 * GIB, G).expect("blocks"), 0);
    // Too small (64 MiB beside the weights: one page a tensor, 64 blocks), or inconsistent:
    // errors with the numbers.
    assert_eq!(
        c.blocks_for_budget(16 * GIB + (128 << 20), 16 * GIB, G)
            .expect("blocks"),
        64
    );
    let e = c
        .size_for_budget(16 * GIB + (64 << 20), 0, 16 * GIB, G)
        .unwrap_err();
    assert!(
        matches!(&e, Error::InvalidArgument(m) if m.contains("holds 0 blocks")),
        "{e}"
    );
    assert!(c.size_for_budget(GIB, 2 * GIB, 0, G).is_err());
    assert!(c.blocks_for_budget(GIB, 0, 0).is_err());
}

/// `BlockPool::sized_for` a registered model: the cache holds what the limit leaves beside
/// the weights, all of it can be taken, and the model stays within its limit.
#[test]
fn sized_for_fills_the_limit_beside_the_weights() {
    let s = shared(64 * BLOCK);
    let m = s
        .register(model(
            ModelConfig::new("m", 1 << 30, 20 * G).guarantee(10 * G),
        ))
        .expect("m");
    let weights = m.allocate((6 * G) as usize).expect("weights");
    // Two blocks per page: 14 pages left beside the weights, one of them the zero page; 13
    // pages of KV, 6 per tensor, 12 blocks (the guarantee's 3 pages: 1 per tensor, 2 blocks).
    let c = PagedKvConfig::new(1, 2, 64, (G / 2 / 256) as usize, 2, 1);
    let bp = BlockPool::sized_for(&m, c, 6 * G).expect("sized");
    let sz = bp.sizing().expect("sizing");
    assert_eq!((sz.max_blocks, sz.guaranteed_blocks), (12, 2));
    assert_eq!(bp.total_blocks(), 11);
    assert_eq!(bp.free_blocks(), 11);
    let all = bp.take(11).expect("every block fits the limit");
    // The weights, the zero page and 6 pages in each of the 2 tensors.
    assert_eq!(used(&m), 19 * G);
    assert!(matches!(bp.take(1), Err(Error::KvOutOfBlocks { .. })));
    bp.free(&all).expect("free");
    drop(weights);
    s.audit().expect("audit");
}

fn env<'a>(vars: &'a [(&'a str, &'a str)]) -> impl Fn(&str) -> Option<String> + 'a {
    move |k| {
        vars.iter()
            .find(|(n, _)| *n == k)
            .map(|(_, v)| v.to_string())
    }
}

/// Limits from the orchestrator: `GPU_MEMORY_LIMIT` (bytes, as KAI-Scheduler injects) and
/// `GPU_MEMORY_REQUEST` (the guarantee), with errors quoting the text found.
#[test]
fn model_config_from_the_orchestrators_variables() {
    let c = ModelConfig::from_lookup(
        "m",
        1 << 30,
        env(&[
            ("GPU_MEMORY_LIMIT", "8589934592"),
            ("GPU_MEMORY_REQUEST", " 4294967296\n"),
        ]),
    )
    .expect("config");
    assert_eq!((c.limit_bytes(), c.guarantee_bytes()), (8 << 30, 4 << 30));
    let c = ModelConfig::from_lookup("m", 1 << 30, env(&[("GPU_MEMORY_LIMIT", "1024")]))
        .expect("no request");
    assert_eq!((c.limit_bytes(), c.guarantee_bytes()), (1024, 0));

    let err = |vars: &[(&str, &str)]| {
        ModelConfig::from_lookup("m", 1 << 30, env(vars))
            .expect_err("refused")
            .to_string()
    };
    let e = err(&[]);
    assert!(
        e.contains("GPU_MEMORY_LIMIT") && e.contains("not set"),
        "{e}"
    );
    let e = err(&[("GPU_MEMORY_LIMIT", "8GiB")]);
    assert!(e.contains("\"8GiB\"") && e.contains("not a decimal"), "{e}");
    let e = err(&[("GPU_MEMORY_LIMIT", "-1")]);
    assert!(e.contains("\"-1\""), "{e}");
    let e = err(&[("GPU_MEMORY_LIMIT", "")]);
    assert!(e.contains("GPU_MEMORY_LIMIT=\"\""), "{e}");
    let e = err(&[("GPU_MEMORY_LIMIT", "18446744073709551616")]);
    assert!(
        e.contains("18446744073709551616") && e.contains("above"),
        "{e}"
    );
    let e = err(&[("GPU_MEMORY_LIMIT", "0")]);
    assert!(e.contains("0 bytes"), "{e}");
    let e = err(&[("GPU_MEMORY_LIMIT", "1024"), ("GPU_MEMORY_REQUEST", "2048")]);
    assert!(
        e.contains("GPU_MEMORY_REQUEST=\"2048\"") && e.contains("above the limit"),
        "{e}"
    );
    let e = err(&[("GPU_MEMORY_LIMIT", "1024"), ("GPU_MEMORY_REQUEST", "1k")]);
    assert!(e.contains("\"1k\""), "{e}");

    // A config from the lookup registers as any other.
    let s = shared(64 * BLOCK);
    let c = ModelConfig::from_lookup(
        "env",
        1 << 30,
        env(&[
            ("GPU_MEMORY_LIMIT", "41943040"),
            ("GPU_MEMORY_REQUEST", "0"),
        ]),
    )
    .expect("config");
    let m = s.register(c).expect("registered");
    let st = m.model_stats().expect("stats");
    assert_eq!((st.limit, st.guarantee), (40 << 20, 0));
}

/// `from_env` reads the process environment: checked in a child process of this test binary
/// (so no test changes this process's environment).
#[test]
fn model_config_from_env_in_a_child_process() {
    const CHILD: &str = "ELASTIC_VMM_FROM_ENV_CHILD";
    if std::env::var_os(CHILD).is_some() {
        let c = ModelConfig::from_env("m", 1 << 30).expect("from env");
        assert_eq!((c.limit_bytes(), c.guarantee_bytes()), (3 << 30, 1 << 30));
        return;
    }
    let exe = std::env::current_exe().expect("test binary");
    let out = std::process::Command::new(exe)
        .args([
            "--exact",
            "model_config_from_env_in_a_child_process",
            "--test-threads=1",
        ])
        .env(CHILD, "1")
        .env("GPU_MEMORY_LIMIT", (3u64 << 30).to_string())
        .env("GPU_MEMORY_REQUEST", (1u64 << 30).to_string())
        .output()
        .expect("child");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && text.contains("1 passed"),
        "child: {text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
}
