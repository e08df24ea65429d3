//! The paged KV cache's candle tensors on the GPU: reads by block table (`index_select`) over
//! blocks scattered through the tensors, some never allocated (zeros, no fault, the device
//! still usable), candle ops over whole tensors, both layouts; compaction moves scattered
//! blocks byte-exact (read back by table through the new ids).

use candle_core::{DType, Device, IndexOp, Tensor};
use elastic_vmm::candle::{PagedKvTensors, TensorPool};
use elastic_vmm::kv::{KvLayout, PagedKv, PagedKvConfig, Watermarks};
use elastic_vmm::{Pool, PoolConfig};

use crate::suite::{Rng, GIB};

const HEADS: usize = 4;
const DIM: usize = 64;
const TOKENS: usize = 16;

fn setup(layout: KvLayout, max_blocks: usize) -> (Device, Pool, TensorPool, PagedKvTensors) {
    let dev = Device::new_cuda(0).expect("candle CUDA device 0");
    let pool = Pool::cuda(0, 4 * GIB as usize).expect("CUDA pool");
    let tensors = TensorPool::new(&pool, &dev).expect("tensor pool");
    let config = PagedKvConfig::new(2, HEADS, DIM, TOKENS, 4, max_blocks).layout(layout);
    let cache = PagedKvTensors::new(&tensors, config, DType::F32).expect("paged cache");
    (dev, pool, tensors, cache)
}

/// One block's worth of values, distinct per (layer, k/v, block).
fn block_data(dev: &Device, layer: usize, kv: usize, block: usize) -> Tensor {
    let base = (layer * 2 + kv) as f32 * 1e6 + block as f32 * 100.0;
    Tensor::arange(0f32, (TOKENS * HEADS * DIM) as f32, dev)
        .and_then(|t| t.affine(1e-3, base as f64))
        .and_then(|t| t.reshape((1, TOKENS, HEADS, DIM)))
        .expect("block data")
}

fn gather_reads_live_blocks_and_zeros(layout: KvLayout) {
    let (dev, pool, _tensors, cache) = setup(layout, 2048);
    // Scatter: take 600 blocks, give back a random two thirds, keep the rest.
    let mut rng = Rng::new(11);
    let all = cache.alloc(600).expect("alloc");
    let (live, gone): (Vec<usize>, Vec<usize>) = all.into_iter().partition(|_| rng.below(3) == 0);
    cache.free(&gone).expect("free");
    for &b in &live {
        write_block(&cache, &dev, b);
    }
    // A block table: live blocks, blocks freed, blocks never allocated, repeated ids.
    let mut table: Vec<u32> = Vec::new();
    for i in 0..64 {
        table.push(live[(i * 7) % live.len()] as u32);
        table.push(gone[(i * 5) % gone.len()] as u32);
        table.push((1500 + i * 3) as u32);
    }
    let idx = Tensor::new(table.as_slice(), &dev).expect("table");
    for layer in 0..2 {
        for kv in 0..2 {
            let got = gather(&cache, &idx, layer, kv);
            let want: Vec<Tensor> = table
                .iter()
                .map(|&b| {
                    if live.contains(&(b as usize)) {
                        block_data(&dev, layer, kv, b as usize)
                    } else {
                        Tensor::zeros((1, TOKENS, HEADS, DIM), DType::F32, &dev).expect("zeros")
                    }
                })
                .collect();
            let want = Tensor::cat(&want, 0).expect("cat");
            let diff = (got - want)
                .and_then(|d| d.abs())
                .and_then(|d| d.max_all())
                .and_then(|d| d.to_scalar::<f32>())
                .expect("diff");
            assert_eq!(diff, 0.0, "layer {layer} kv {kv}: gathered blocks differ");
        }
    }
    // Candle ops over whole tensors read every page (zeros where unbacked).
    let k0 = cache.k(0).expect("k0").contiguous().expect("k0");
    let total = k0
        .sum_all()
        .and_then(|s| s.to_dtype(DType::F64))
        .and_then(|s| s.to_scalar::<f64>())
        .expect("sum");
    let want: f64 = live
        .iter()
        .map(|&b| {
            block_data(&dev, 0, 0, b)
                .to_dtype(DType::F64)
                .and_then(|t| t.sum_all())
                .and_then(|t| t.to_scalar::<f64>())
                .expect("block sum")
        })
        .sum();
    assert!(
        ((total - want) / want).abs() < 1e-3,
        "sum {total} vs {want}"
    );
    // The device is still usable, and freeing everything takes the memory back.
    cache.free(&live).expect("free");
    let after = cache
        .k(0)
        .expect("k0")
        .sum_all()
        .and_then(|s| s.to_scalar::<f32>())
        .expect("sum after free");
    assert_eq!(after, 0.0, "freed blocks read zeros");
    drop(k0);
    drop(cache);
    Tensor::ones(4, DType::F32, &dev)
        .and_then(|t| t.sum_all())
        .and_then(|t| t.to_scalar::<f32>())
        .expect("device still usable");
    pool.trim().expect("trim");
    assert_eq!(pool.stats().mapped, 0, "{:?}", pool.stats());
}

/// Write block `b` of every tensor with [`block_data`].
fn write_block(cache: &PagedKvTensors, dev: &Device, b: usize) {
    match cache.contiguous() {
        None => {
            for layer in 0..2 {
                for kv in 0..2 {
                    let t = if kv == 0 {
                        cache.k(layer)
                    } else {
                        cache.v(layer)
                    }
                    .expect("tensor");
                    t.slice_set(&block_data(dev, layer, kv, b), 0, b)
                        .expect("write a live block");
                }
            }
        }
        Some(whole) => {
            // [1, layers, 2, tokens, heads, dim]
            let layers: Vec<Tensor> = (0..2)
                .map(|layer| {
                    Tensor::stack(
                        &[block_data(dev, layer, 0, b), block_data(dev, layer, 1, b)],
                        1,
                    )
                    .expect("k, v")
                })
                .collect();
            let block = Tensor::stack(&layers, 1).expect("layers");
            whole.slice_set(&block, 0, b).expect("write a live block");
        }
    }
}

/// Blocks `idx` of layer `layer`'s K (`kv` 0) or V (1): `[n, tokens, heads, dim]`.
fn gather(cache: &PagedKvTensors, idx: &Tensor, layer: usize, kv: usize) -> Tensor {
    match cache.contiguous() {
        None => {
            let t = if kv == 0 {
                cache.k(layer)
            } else {
                cache.v(layer)
            }
            .expect("tensor");
            t.index_select(idx, 0).expect("gather")
        }
        Some(whole) => whole
            .index_select(idx, 0)
            .and_then(|t| t.i((.., layer, kv)))
            .and_then(|t| t.contiguous())
            .expect("gather"),
    }
}

#[test]
fn paged_kv_gather_per_layer() {
    gather_reads_live_blocks_and_zeros(KvLayout::PerLayer);
}

#[test]
fn paged_kv_gather_contiguous() {
    gather_reads_live_blocks_and_zeros(KvLayout::Contiguous);
}

/// Scattered survivors, compacted on the device's ordering stream: every survivor reads back
/// bit for bit through its new id (a gather by table on the GPU), the footprint is the packed
/// floor, and the device is fine.
fn compaction_keeps_blocks_bit_exact(layout: KvLayout) {
    let (dev, pool, _tensors, cache) = setup(layout, 2048);
    let mut rng = Rng::new(29);
    let all = cache.alloc(900).expect("alloc");
    for &b in &all {
        write_block(&cache, &dev, b);
    }
    let (keep, gone): (Vec<usize>, Vec<usize>) = all.into_iter().partition(|_| rng.below(5) == 0);
    cache.free(&gone).expect("free");
    let before = cache.stats();
    let gain = cache.compaction_gain();
    assert!(gain.moves > 0, "{layout:?}: {before:?}");
    // Bounded steps, renaming as an engine does.
    let mut now = keep.clone();
    let mut moved = 0;
    for _ in 0..64 {
        let c = cache.compact(128).expect("compact");
        // The emptied pages go back after the call: counted below once back.
        c.give_back.wait();
        assert!(c.moves.len() <= 128);
        moved += c.moves.len();
        for b in &mut now {
            *b = c.rename(*b);
        }
        if c.is_empty() {
            break;
        }
    }
    assert_eq!(moved, gain.moves, "{layout:?}: moved what the gain said");
    let s = cache.stats();
    assert_eq!(
        s.mapped_bytes, s.packed_floor_bytes,
        "{layout:?}: {before:?} -> {s:?}"
    );
    let table: Vec<u32> = now.iter().map(|&b| b as u32).collect();
    let idx = Tensor::new(table.as_slice(), &dev).expect("table");
    for layer in 0..2 {
        for kv in 0..2 {
            let got = gather(&cache, &idx, layer, kv);
            let want: Vec<Tensor> = keep
                .iter()
                .map(|&b| block_data(&dev, layer, kv, b))
                .collect();
            let want = Tensor::cat(&want, 0).expect("cat");
            let same = got
                .eq(&want)
                .and_then(|t| t.to_dtype(DType::F32))
                .and_then(|t| t.min_all())
                .and_then(|t| t.to_scalar::<f32>())
                .expect("compare");
            assert_eq!(
                same, 1.0,
                "{layout:?} layer {layer} kv {kv}: a moved block differs"
            );
        }
    }
    cache.free(&now).expect("free");
    drop(cache);
    Tensor::ones(4, DType::F32, &dev)
        .and_then(|t| t.sum_all())
        .and_then(|t| t.to_scalar::<f32>())
        .expect("device still usable");
    pool.trim().expect("trim");
    assert_eq!(pool.stats().mapped, 0, "{:?}", pool.stats());
}

#[test]
fn paged_kv_compaction_per_layer() {
    compaction_keeps_blocks_bit_exact(KvLayout::PerLayer);
}

#[test]
fn paged_kv_compaction_contiguous() {
    compaction_keeps_blocks_bit_exact(KvLayout::Contiguous);
}

/// Blocks written by candle kernels go out to a host-tier cache with no host wait in between
/// (the copies ordered after candle's stream), the device pages go back (after the wait), then
/// come home under new ids and read back bit for bit by a gather queued right after (ordered
/// after the copies).
fn blocks_go_to_the_host_tier_and_back(layout: KvLayout) {
    let (dev, pool, _tensors, cache) = setup(layout, 1024);
    let tier = Pool::host_tier(0, PoolConfig::new(2 * GIB as usize)).expect("host tier");
    let host = PagedKv::new(&tier, cache.config().clone()).expect("host cache");
    let ids = cache.alloc(300).expect("alloc");
    for &b in &ids {
        write_block(&cache, &dev, b);
    }
    let mapped = pool.stats().mapped;
    let out = cache.move_out(&ids, &host).expect("move out");
    let on_host = out.destinations().to_vec();
    let r = out.wait().expect("offload");
    assert_eq!(r.blocks, 300);
    // The device pages go back after the wait; a trim waits for them.
    cache.cache().trim();
    assert!(pool.stats().mapped < mapped, "{:?}", pool.stats());
    assert_eq!(host.stats().live, 300);
    let back = cache.move_in(&host, &on_host).expect("move in");
    let now = back.destinations().to_vec();
    let table: Vec<u32> = now.iter().map(|&b| b as u32).collect();
    let idx = Tensor::new(table.as_slice(), &dev).expect("table");
    // Queued before the wait: ordered after the copies by `move_in`.
    let got: Vec<Tensor> = (0..2)
        .flat_map(|layer| (0..2).map(move |kv| (layer, kv)))
        .map(|(layer, kv)| gather(&cache, &idx, layer, kv))
        .collect();
    back.wait().expect("onboard");
    assert_eq!(host.stats().live, 0);
    for (i, (layer, kv)) in (0..2).flat_map(|l| (0..2).map(move |k| (l, k))).enumerate() {
        let want: Vec<Tensor> = ids
            .iter()
            .map(|&b| block_data(&dev, layer, kv, b))
            .collect();
        let want = Tensor::cat(&want, 0).expect("cat");
        let same = got[i]
            .eq(&want)
            .and_then(|t| t.to_dtype(DType::F32))
            .and_then(|t| t.min_all())
            .and_then(|t| t.to_scalar::<f32>())
            .expect("compare");
        assert_eq!(
            same, 1.0,
            "{layout:?} layer {layer} kv {kv}: a block differs"
        );
    }
    cache.free(&now).expect("free");
    drop((cache, host));
    pool.trim().expect("trim");
    assert_eq!(pool.stats().mapped, 0, "{:?}", pool.stats());
}

#[test]
fn paged_kv_moves_to_the_host_tier_per_layer() {
    blocks_go_to_the_host_tier_and_back(KvLayout::PerLayer);
}

#[test]
fn paged_kv_moves_to_the_host_tier_contiguous() {
    blocks_go_to_the_host_tier_and_back(KvLayout::Contiguous);
}

/// Candle tensors span every page of the cache and any candle op reads them whole (`sum_all`
/// on `k(0)`): a cache whose unbacked pages are left unmapped (`zero_unbacked(false)`, a
/// public knob) would let safe code fault the device (an illegal address poisons the context).
/// The constructor must refuse it, or alias those pages anyway (the pool's zero page in use).
/// No kernel is launched here, so a failure does not poison the other tests of this binary.
#[test]
fn paged_kv_tensors_never_leave_unbacked_pages_unmapped() {
    let dev = Device::new_cuda(0).expect("candle CUDA device 0");
    let pool = Pool::cuda(0, GIB as usize).expect("CUDA pool");
    let tensors = TensorPool::new(&pool, &dev).expect("tensor pool");
    let config = PagedKvConfig::new(2, HEADS, DIM, TOKENS, 4, 256).zero_unbacked(false);
    match PagedKvTensors::new(&tensors, config, DType::F32) {
        Err(e) => eprintln!("refused: {e}"),
        Ok(cache) => {
            assert!(
                pool.stats().zero_page > 0,
                "candle tensors over a cache whose unbacked pages are unmapped: {:?}",
                pool.stats()
            );
            drop(cache);
        }
    }
}

/// `move_in` takes its destination blocks from the device cache: a block the engine freed with
/// a kernel still queued on it (allowed: "a kernel queued on a block before its free never sees
/// its page go") may be one of them. The copies into it must run after that kernel, as
/// `move_out` and `compact` order theirs after candle's stream; copies on a copy stream of
/// their own overwrite the block while the kernel still waits behind earlier work, and it reads
/// the onboarded block instead of the one it was queued on.
///
/// Blocks of one page each and a high watermark, so that the `free` keeps the block warm and
/// releases nothing: a release waits for the GPU, which would hide the race. On the H100 this
/// test also passed with `move_in` reverted to an unordered copy (four runs; something on the
/// way still waits for candle's stream), so it checks the data and the block chosen, not yet
/// the ordering itself.
#[test]
fn paged_kv_move_in_waits_for_kernels_queued_on_its_destinations() {
    const TOKENS_PER_BLOCK: usize = 2048; // 2048 x 4 heads x 64 x 4 bytes: one 2 MiB page
    let dev = Device::new_cuda(0).expect("candle CUDA device 0");
    let pool = Pool::cuda(0, 4 * GIB as usize).expect("CUDA pool");
    let tensors = TensorPool::new(&pool, &dev).expect("tensor pool");
    let w = Watermarks {
        low: 0,
        high: 8,
        idle_after: std::time::Duration::from_secs(600),
        tick: std::time::Duration::from_millis(100),
    };
    let config = PagedKvConfig::new(2, HEADS, DIM, TOKENS_PER_BLOCK, 4, 16).watermarks(w);
    let cache = PagedKvTensors::new(&tensors, config, DType::F32).expect("paged cache");
    assert_eq!(cache.cache().block_span_bytes(), 2 << 20);
    let tier = Pool::host_tier(0, PoolConfig::new(GIB as usize)).expect("host tier");
    let host = PagedKv::new(&tier, cache.config().clone()).expect("host cache");
    let ids = cache.alloc(2).expect("alloc");
    assert_eq!(ids, vec![0, 1]);
    let shape = (1, TOKENS_PER_BLOCK, HEADS, DIM);
    for &b in &ids {
        let value = Tensor::full((b + 1) as f32, shape, &dev).expect("value");
        for layer in 0..2 {
            for t in [cache.k(layer), cache.v(layer)] {
                t.expect("tensor").slice_set(&value, 0, b).expect("write");
            }
        }
    }
    let out = cache.move_out(&[1], &host).expect("move out");
    let on_host = out.destinations().to_vec();
    // Block 1 stays mapped, warm.
    out.wait().expect("offload");
    // Work that keeps candle's stream busy for tens of milliseconds, then a read of block 0.
    // (The table is made first: copying it to the device waits for the stream.)
    let idx = Tensor::new(&[0u32], &dev).expect("table");
    let mut x = Tensor::randn(0f32, 1e-3, (4096, 4096), &dev).expect("randn");
    for _ in 0..30 {
        x = x.matmul(&x).expect("matmul");
    }
    let read = gather(&cache, &idx, 0, 0);
    // Freed with the read still queued: warm, nothing released, no wait. The onboard takes
    // it (the lowest warm block) for the block that was 1.
    cache.free(&[0]).expect("free");
    let back = cache.move_in(&host, &on_host).expect("move in");
    assert_eq!(
        back.destinations(),
        &[0],
        "the onboard took the freed block"
    );
    back.wait().expect("onboard");
    let diff = (read - 1.0)
        .and_then(|d| d.abs())
        .and_then(|d| d.max_all())
        .and_then(|d| d.to_scalar::<f32>())
        .expect("diff");
    assert_eq!(
        diff, 0.0,
        "a kernel queued on block 0 before its free read what move_in copied into it"
    );
    drop(x);
    cache.free(&[0]).expect("free");
}

/// A candle engine's block pool over its cache's tensors (vLLM's split-K order): the blocks the
/// pool hands out are written and read through the tensors; a prefix-cache hit gives back the
/// same block with its bytes; the null block reads zeros; freeing through the pool frees the
/// tensors' cache.
#[test]
fn a_block_pool_hands_out_the_blocks_of_candle_tensors() {
    use elastic_vmm::candle::BlockShape;
    use elastic_vmm::kv::BlockPool;
    use std::sync::Arc;
    let dev = Device::new_cuda(0).expect("candle CUDA device 0");
    let pool = Pool::cuda(0, 4 * GIB as usize).expect("CUDA pool");
    let tensors = TensorPool::new(&pool, &dev).expect("tensor pool");
    let config = PagedKvConfig::new(2, HEADS, DIM, TOKENS, 2, 64).null_block(true);
    let cache = Arc::new(
        PagedKvTensors::with_shape(&tensors, config, DType::BF16, BlockShape::SplitK)
            .expect("paged cache"),
    );
    let blocks = BlockPool::over_shared(cache.clone()).expect("block pool");
    let ids = blocks.take(3).expect("take");
    assert_eq!(cache.stats().live, 3);
    let k = cache.k(1).expect("k");
    let one = Tensor::arange(0f32, (HEADS * DIM * TOKENS) as f32, &dev)
        .and_then(|t| t.to_dtype(DType::BF16))
        .and_then(|t| t.reshape((1, HEADS, DIM / 8, TOKENS, 8)))
        .expect("block data");
    k.slice_set(&one, 0, ids[1]).expect("write a taken block");
    blocks.release_cached(ids[1], 42).expect("release");
    assert_eq!(blocks.take_cached(42), Some(ids[1]));
    let table = Tensor::new(&[ids[1] as u32, blocks.null_block() as u32], &dev).expect("table");
    let read = k
        .index_select(&table, 0)
        .and_then(|t| t.to_dtype(DType::F32))
        .expect("read");
    let diff = (read.narrow(0, 0, 1).expect("hit") - one.to_dtype(DType::F32).expect("f32"))
        .and_then(|t| t.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>())
        .expect("diff");
    assert_eq!(diff, 0.0, "the hit kept its bytes");
    let null = read
        .narrow(0, 1, 1)
        .and_then(|t| t.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>())
        .expect("null");
    assert_eq!(null, 0.0, "the null block reads zeros");
    blocks.free(&ids).expect("free");
    assert_eq!(cache.stats().live, 0);
    drop((k, blocks, cache));
    dev.synchronize().expect("device still usable");
}

/// Padding that cannot fault (issue 33): kernels read a block table padded with the null block
/// and with ids across the whole cache while two threads allocate, write and free blocks on the
/// same pages (their pages mapped, aliased to the zero page and unmapped under the reads), for
/// thousands of rounds. Every read succeeds, the null block reads zeros every round, and the
/// device stays usable; under compute-sanitizer memcheck this is also the fault check
/// (`EVMM_CHURN_ROUNDS` sets the rounds, 3000 by default: memcheck slows every kernel).
#[test]
fn a_padded_table_reads_while_neighbours_churn() {
    use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
    use std::sync::Arc;
    let rounds: usize = std::env::var("EVMM_CHURN_ROUNDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(3000);
    const BLOCKS: usize = 512;
    let dev = Device::new_cuda(0).expect("candle CUDA device 0");
    let pool = Pool::cuda(0, 4 * GIB as usize).expect("CUDA pool");
    let tensors = TensorPool::new(&pool, &dev).expect("tensor pool");
    let config = PagedKvConfig::new(2, HEADS, DIM, TOKENS, 4, BLOCKS).null_block(true);
    let cache = Arc::new(PagedKvTensors::new(&tensors, config, DType::F32).expect("paged cache"));
    let stop = AtomicBool::new(false);
    let churned = AtomicU64::new(0);
    std::thread::scope(|s| {
        let churners: Vec<_> = (0..2u64)
            .map(|t| {
                let (cache, dev, stop, churned) = (&cache, &dev, &stop, &churned);
                s.spawn(move || {
                    let mut rng = Rng::new(100 + t);
                    while !stop.load(Ordering::Relaxed) {
                        let n = 1 + rng.below(8) as usize;
                        let ids = cache.alloc(n).expect("alloc");
                        for &b in &ids {
                            let one = block_data(dev, 0, 0, b);
                            let k = cache.k(0).expect("k");
                            k.slice_set(&one, 0, b).expect("write");
                        }
                        cache.free(&ids).expect("free");
                        churned.fetch_add(n as u64, Ordering::Relaxed);
                    }
                })
            })
            .collect();
        let mut rng = Rng::new(7);
        for round in 0..rounds {
            // The null block first, then ids anywhere in the cache (allocated or not).
            let mut table = vec![0u32];
            table.extend((0..31).map(|_| rng.below(BLOCKS as u64) as u32));
            let idx = Tensor::new(table.as_slice(), &dev).expect("table");
            for t in 0..2 {
                let x = if t == 0 { cache.k(1) } else { cache.v(0) }.expect("tensor");
                let read = x
                    .index_select(&idx, 0)
                    .expect("a read through a padded table");
                let null = read
                    .narrow(0, 0, 1)
                    .and_then(|x| x.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>())
                    .expect("the null block's read");
                assert_eq!(null, 0.0, "round {round}: the null block read {null}");
            }
        }
        stop.store(true, Ordering::Relaxed);
        for c in churners {
            c.join().expect("churner");
        }
    });
    assert!(
        churned.load(Ordering::Relaxed) > rounds as u64,
        "the neighbours churned ({} blocks)",
        churned.load(Ordering::Relaxed)
    );
    drop(cache);
    dev.synchronize().expect("device still usable");
}
