//! The paged-attention decode op (`elastic_vmm::candle::paged_attention_decode`) on the GPU:
//! against a reference attention in f32 candle ops over the same blocks gathered by table, for
//! f16 and bf16, grouped-query ratios 1, 4 and 8, head sizes 64 and 128, lengths from 0 to past
//! one partition, tables padded with never-allocated and out-of-range ids, out-of-range ids
//! inside a length (masked blocks, a whole masked tile among them); bad shapes are
//! errors that leave the device usable.

use candle_core::{DType, Device, Tensor, D};
use elastic_vmm::candle::{paged_attention_decode, BlockShape, PagedKvTensors, TensorPool};
use elastic_vmm::kv::PagedKvConfig;
use elastic_vmm::Pool;

use crate::suite::{Rng, GIB};

const TOKENS: usize = 16;
const MAX_BLOCKS: usize = 1024;
/// Lengths: empty, one token, one block exactly, one past it, several partitions.
const LENS: [usize; 7] = [0, 1, 16, 17, 300, 1500, 2500];
/// Inside its length, sequence 5's blocks 0, 1 and 4 are ids past the cache (masked): with
/// head size 128 the first tile of every group is wholly masked (with 64, of half the groups),
/// then valid tokens follow. The reference leaves them out.
const MASKED: (usize, [usize; 3]) = (5, [0, 1, 4]);

/// The attention of one sequence in f32 candle ops: q `[heads, d]` over its first `len` tokens
/// of k, v `[len, kv_heads, d]`.
fn reference(q: &Tensor, k: &Tensor, v: &Tensor, heads: usize, scale: f64) -> Tensor {
    let (len, kvh, d) = k.dims3().expect("k dims");
    if len == 0 {
        return Tensor::zeros((heads, d), DType::F32, q.device()).expect("zeros");
    }
    let rep = heads / kvh;
    // [len, kvh, d] -> [kvh, len, d] -> repeated per query head: [heads, len, d]
    let expand = |t: &Tensor| {
        t.transpose(0, 1)
            .and_then(|t| t.unsqueeze(1))
            .and_then(|t| t.broadcast_as((kvh, rep, len, d)))
            .and_then(|t| t.reshape((heads, len, d)))
            .expect("expand kv")
    };
    let (k, v) = (expand(k), expand(v));
    let scores = q
        .unsqueeze(1)
        .and_then(|q| q.matmul(&k.t()?))
        .and_then(|s| s.affine(scale, 0.0))
        .expect("scores");
    let p = candle_nn_free_softmax(&scores);
    p.matmul(&v)
        .and_then(|o| o.squeeze(1))
        .expect("weighted values")
}

/// Softmax over the last dimension in plain candle ops (no candle-nn in this target).
fn candle_nn_free_softmax(x: &Tensor) -> Tensor {
    let max = x.max_keepdim(D::Minus1).expect("max");
    let e = x.broadcast_sub(&max).and_then(|d| d.exp()).expect("exp");
    let sum = e.sum_keepdim(D::Minus1).expect("sum");
    e.broadcast_div(&sum).expect("normalise")
}

fn check(dtype: DType, heads: usize, kv_heads: usize, head_dim: usize, seed: u64) {
    let dev = Device::new_cuda(0).expect("candle CUDA device 0");
    let pool = Pool::cuda(0, 8 * GIB as usize).expect("CUDA pool");
    let tensors = TensorPool::new(&pool, &dev).expect("tensor pool");
    let config = PagedKvConfig::new(1, kv_heads, head_dim, TOKENS, 2, MAX_BLOCKS);
    let cache = PagedKvTensors::new(&tensors, config, dtype).expect("paged cache");
    // Blocks scattered: take many, give back a random part, hand the rest out shuffled.
    let mut rng = Rng::new(seed);
    let need: usize = LENS.iter().map(|l| l.div_ceil(TOKENS)).sum();
    let mut ids = cache.alloc(need + 200).expect("alloc");
    for i in (1..ids.len()).rev() {
        ids.swap(i, rng.below(i as u64 + 1) as usize);
    }
    let spare = ids.split_off(need);
    cache.free(&spare).expect("free the spare blocks");
    let (k, v) = (cache.k(0).expect("k"), cache.v(0).expect("v"));
    for &b in &ids {
        for t in [&k, &v] {
            let data = Tensor::randn(0f32, 1.0, (1, TOKENS, kv_heads, head_dim), &dev)
                .and_then(|x| x.to_dtype(dtype))
                .expect("block data");
            t.slice_set(&data, 0, b).expect("write a block");
        }
    }
    let width = LENS.iter().map(|l| l.div_ceil(TOKENS)).max().unwrap_or(0) + 2;
    let mut table = Vec::new();
    let mut next = ids.iter();
    for (i, &len) in LENS.iter().enumerate() {
        let n = len.div_ceil(TOKENS);
        for j in 0..n {
            let id = *next.next().expect("enough blocks") as u32;
            let masked = i == MASKED.0 && MASKED.1.contains(&j);
            table.push(if masked { u32::MAX } else { id });
        }
        // Padding: a block nobody allocated, or an id past the cache.
        for j in n..width {
            table.push(if (i + j) % 2 == 0 {
                (MAX_BLOCKS - 1) as u32
            } else {
                u32::MAX
            });
        }
    }
    let batch = LENS.len();
    let table_t = Tensor::from_vec(table.clone(), (batch, width), &dev).expect("table");
    let lens: Vec<u32> = LENS.iter().map(|&l| l as u32).collect();
    let lens_t = Tensor::from_vec(lens, batch, &dev).expect("lens");
    let q = Tensor::randn(0f32, 1.0, (batch, heads, head_dim), &dev)
        .and_then(|x| x.to_dtype(dtype))
        .expect("q");
    let scale = 1.0 / (head_dim as f64).sqrt();
    let max_context = *LENS.iter().max().expect("lengths");
    let got = paged_attention_decode(&q, &k, &v, &table_t, &lens_t, max_context, scale as f32)
        .and_then(|o| o.to_dtype(DType::F32))
        .expect("paged attention");
    assert_eq!(got.dims(), [batch, heads, head_dim]);
    let tol = if dtype == DType::BF16 { 2e-2 } else { 4e-3 };
    for (b, &len) in LENS.iter().enumerate() {
        let n = len.div_ceil(TOKENS);
        if n == 0 {
            // Nothing to attend over: zeros (no empty table to gather the reference by).
            let sum = got
                .get(b)
                .and_then(|o| o.abs())
                .and_then(|o| o.sum_all())
                .and_then(|o| o.to_scalar::<f32>())
                .expect("row of an empty sequence");
            assert_eq!(sum, 0.0, "sequence {b} of length 0 is not zeros");
            continue;
        }
        // The named blocks in order; a masked block's tokens are not attended over.
        let named: Vec<u32> = table[b * width..b * width + n]
            .iter()
            .copied()
            .filter(|&id| id != u32::MAX)
            .collect();
        let m = named.len();
        let attended = len - (n - m) * TOKENS;
        let rows = Tensor::from_vec(named, m, &dev).expect("rows");
        let gather = |c: &Tensor| {
            c.index_select(&rows, 0)
                .and_then(|x| x.reshape((m * TOKENS, kv_heads, head_dim)))
                .and_then(|x| x.narrow(0, 0, attended))
                .and_then(|x| x.to_dtype(DType::F32))
                .expect("gather")
        };
        let qb = q
            .get(b)
            .and_then(|x| x.to_dtype(DType::F32))
            .expect("q row");
        let want = reference(&qb, &gather(&k), &gather(&v), heads, scale);
        let diff = (got.get(b).expect("out row") - &want)
            .and_then(|d| d.abs())
            .and_then(|d| d.max_all())
            .and_then(|d| d.to_scalar::<f32>())
            .expect("diff");
        assert!(
            diff <= tol,
            "{dtype:?} heads {heads}/{kv_heads} d {head_dim}: sequence {b} (length {len}) differs by {diff} (tolerance {tol})"
        );
    }
    cache.free(&ids).expect("free");
}

#[test]
fn paged_attention_matches_a_reference_bf16_gqa4_d128() {
    check(DType::BF16, 32, 8, 128, 1);
}

#[test]
fn paged_attention_matches_a_reference_f16_gqa8_d128() {
    check(DType::F16, 16, 2, 128, 2);
}

#[test]
fn paged_attention_matches_a_reference_bf16_mha_d64() {
    check(DType::BF16, 8, 8, 64, 3);
}

#[test]
fn paged_attention_matches_a_reference_f16_gqa2_d64() {
    check(DType::F16, 8, 4, 64, 4);
}

#[test]
fn paged_attention_refuses_bad_shapes_and_the_device_stays_usable() {
    let dev = Device::new_cuda(0).expect("candle CUDA device 0");
    let q = Tensor::zeros((2, 8, 128), DType::BF16, &dev).expect("q");
    let kv = Tensor::zeros((4, TOKENS, 2, 128), DType::BF16, &dev).expect("kv");
    let table = Tensor::zeros((2, 4), DType::U32, &dev).expect("table");
    let lens = Tensor::zeros(2, DType::U32, &dev).expect("lens");
    let bad_dim = Tensor::zeros((4, TOKENS, 2, 96), DType::BF16, &dev).expect("kv96");
    let q96 = Tensor::zeros((2, 8, 96), DType::BF16, &dev).expect("q96");
    let f32_kv = Tensor::zeros((4, TOKENS, 2, 128), DType::F32, &dev).expect("f32");
    let short = Tensor::zeros((1, 4), DType::U32, &dev).expect("short table");
    for (what, r) in [
        (
            "head_dim",
            paged_attention_decode(&q96, &bad_dim, &bad_dim, &table, &lens, 64, 1.0),
        ),
        (
            "cache dim",
            paged_attention_decode(&q, &bad_dim, &bad_dim, &table, &lens, 64, 1.0),
        ),
        (
            "dtype",
            paged_attention_decode(&q, &f32_kv, &f32_kv, &table, &lens, 64, 1.0),
        ),
        (
            "table rows",
            paged_attention_decode(&q, &kv, &kv, &short, &lens, 64, 1.0),
        ),
        (
            "3 heads per kv head",
            paged_attention_decode(
                &Tensor::zeros((2, 6, 128), DType::BF16, &dev).expect("q6"),
                &kv,
                &kv,
                &table,
                &lens,
                64,
                1.0,
            ),
        ),
    ] {
        let e = r.expect_err(what).to_string();
        assert!(e.contains("paged_attention_decode"), "{what}: {e}");
    }
    // Lengths 0: zeros, and the device still computes.
    let out = paged_attention_decode(&q, &kv, &kv, &table, &lens, 64, 1.0)
        .and_then(|o| o.to_dtype(DType::F32))
        .and_then(|o| o.abs())
        .and_then(|o| o.sum_all())
        .and_then(|o| o.to_scalar::<f32>())
        .expect("a valid call after the refusals");
    assert_eq!(out, 0.0);
}

/// Token-major data `[n, tokens, kv_heads, d]` in the order of `shape` for K (`kv` 0) or V.
fn to_shape(t: &Tensor, shape: BlockShape, kv: usize) -> Tensor {
    let (n, bt, h, d) = t.dims4().expect("dims");
    let x = 16 / t.dtype().size_in_bytes();
    match (shape, kv) {
        (BlockShape::TokenMajor, _) => t.clone(),
        (BlockShape::HeadMajor, _) => t.permute((0, 2, 1, 3)).expect("head major"),
        (BlockShape::SplitK, 0) => t
            .reshape((n, bt, h, d / x, x))
            .and_then(|t| t.permute((0, 2, 3, 1, 4)))
            .expect("split k"),
        (BlockShape::SplitK, _) => t.permute((0, 2, 3, 1)).expect("transposed v"),
    }
    .contiguous()
    .expect("contiguous")
}

/// The inverse of [`to_shape`]: blocks in `shape`'s order back to `[n, tokens, kv_heads, d]`.
fn from_shape(t: &Tensor, shape: BlockShape, kv: usize) -> Tensor {
    match (shape, kv) {
        (BlockShape::TokenMajor, _) => t.clone(),
        (BlockShape::HeadMajor, _) => t.permute((0, 2, 1, 3)).expect("head major"),
        (BlockShape::SplitK, 0) => {
            let (n, h, dx, bt, x) = t.dims5().expect("split k dims");
            t.permute((0, 3, 1, 2, 4))
                .and_then(|t| t.reshape((n, bt, h, dx * x)))
                .expect("split k back")
        }
        (BlockShape::SplitK, _) => t.permute((0, 3, 1, 2)).expect("transposed v back"),
    }
    .contiguous()
    .expect("contiguous")
}

/// The engines' block orders (vLLM's split K and transposed V, FlashInfer's head-major, ours):
/// each layer's K and V written block by block through candle tensors of that shape and read
/// back by table bit-exact; attention over the blocks read from each shape matches the
/// paged-attention kernel over the same data in the token-major cache; every shape spans the
/// same bytes per block; a split K that does not divide head_dim, or a shape on a contiguous
/// cache, is refused with the numbers.
#[test]
fn paged_kv_block_shapes_hold_the_engines_orders() {
    let dev = Device::new_cuda(0).expect("candle CUDA device 0");
    let pool = Pool::cuda(0, 4 * GIB as usize).expect("CUDA pool");
    let tensors = TensorPool::new(&pool, &dev).expect("tensor pool");
    let (heads, kvh, d, layers, blocks) = (8, 2, 64, 2, 256);
    let mut rng = Rng::new(5);
    let config = || PagedKvConfig::new(layers, kvh, d, TOKENS, 2, blocks);
    let caches: Vec<(BlockShape, PagedKvTensors)> = [
        BlockShape::TokenMajor,
        BlockShape::HeadMajor,
        BlockShape::SplitK,
    ]
    .into_iter()
    .map(|s| {
        let c = PagedKvTensors::with_shape(&tensors, config(), DType::BF16, s).expect("cache");
        (s, c)
    })
    .collect();
    let per_block = TOKENS * kvh * d;
    for (s, c) in &caches {
        assert_eq!(c.block_shape(), *s);
        for t in [c.k(0).expect("k"), c.v(1).expect("v")] {
            assert_eq!(t.dims()[0], blocks, "{s:?}");
            assert_eq!(t.dims()[1..].iter().product::<usize>(), per_block, "{s:?}");
        }
    }
    assert_eq!(
        caches[0].1.k(0).expect("k").dims(),
        &[blocks, TOKENS, kvh, d]
    );
    assert_eq!(
        caches[1].1.v(1).expect("v").dims(),
        &[blocks, kvh, TOKENS, d]
    );
    assert_eq!(
        caches[2].1.k(0).expect("k").dims(),
        &[blocks, kvh, d / 8, TOKENS, 8]
    );
    assert_eq!(
        caches[2].1.v(0).expect("v").dims(),
        &[blocks, kvh, d, TOKENS]
    );
    // Scattered live blocks in each cache: 48 taken, every third given back.
    let ids: Vec<Vec<usize>> = caches
        .iter()
        .map(|(_, c)| {
            let all = c.alloc(48).expect("alloc");
            let gone: Vec<usize> = all.iter().copied().filter(|b| b % 3 == 1).collect();
            c.free(&gone).expect("free");
            all.into_iter().filter(|b| b % 3 != 1).collect()
        })
        .collect();
    let n = ids[0].len();
    assert!(ids.iter().all(|i| i.len() == n), "{ids:?}");
    let tables: Vec<Tensor> = ids
        .iter()
        .map(|live| {
            let t: Vec<u32> = live.iter().map(|&b| b as u32).collect();
            Tensor::new(t.as_slice(), &dev).expect("table")
        })
        .collect();
    // Per layer and K/V, token-major reference data for the live blocks.
    let data: Vec<Tensor> = (0..2 * layers)
        .map(|_| {
            let v: Vec<f32> = (0..n * per_block)
                .map(|_| rng.below(2001) as f32 / 1000.0 - 1.0)
                .collect();
            Tensor::from_vec(v, (n, TOKENS, kvh, d), &dev)
                .and_then(|t| t.to_dtype(DType::BF16))
                .expect("data")
        })
        .collect();
    for (ci, (s, c)) in caches.iter().enumerate() {
        let table = &tables[ci];
        for l in 0..layers {
            for kv in 0..2 {
                let t = if kv == 0 { c.k(l) } else { c.v(l) }.expect("layer tensor");
                let shaped = to_shape(&data[2 * l + kv], *s, kv);
                for (i, &b) in ids[ci].iter().enumerate() {
                    t.slice_set(&shaped.narrow(0, i, 1).expect("block"), 0, b)
                        .expect("write a block");
                }
                let back = from_shape(&t.index_select(table, 0).expect("gather"), *s, kv);
                let diff = (back.to_dtype(DType::F32).expect("f32")
                    - data[2 * l + kv].to_dtype(DType::F32).expect("f32"))
                .and_then(|t| t.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>())
                .expect("diff");
                assert_eq!(diff, 0.0, "{s:?} layer {l} kv {kv}: read back differs");
            }
        }
    }
    // One sequence over all the live blocks: the kernel on the token-major cache against
    // attention over the blocks each shape gives back.
    let len = n * TOKENS - 5;
    let q: Vec<f32> = (0..heads * d)
        .map(|_| rng.below(2001) as f32 / 1000.0 - 1.0)
        .collect();
    let q = Tensor::from_vec(q, (1, heads, d), &dev)
        .and_then(|t| t.to_dtype(DType::BF16))
        .expect("q");
    let scale = 1.0 / (d as f64).sqrt();
    let (_, token_major) = &caches[0];
    let lens = Tensor::new(&[len as u32], &dev).expect("lens");
    let tab2 = tables[0].reshape((1, n)).expect("table row");
    for l in 0..layers {
        let got = paged_attention_decode(
            &q,
            &token_major.k(l).expect("k"),
            &token_major.v(l).expect("v"),
            &tab2,
            &lens,
            len,
            scale as f32,
        )
        .and_then(|t| t.to_dtype(DType::F32))
        .expect("kernel");
        for (ci, (s, c)) in caches.iter().enumerate() {
            let read = |kv: usize| {
                let t = if kv == 0 { c.k(l) } else { c.v(l) }.expect("layer tensor");
                from_shape(&t.index_select(&tables[ci], 0).expect("gather"), *s, kv)
                    .reshape((n * TOKENS, kvh, d))
                    .and_then(|t| t.narrow(0, 0, len))
                    .and_then(|t| t.to_dtype(DType::F32))
                    .expect("blocks")
            };
            let q32 = q
                .to_dtype(DType::F32)
                .and_then(|q| q.squeeze(0))
                .expect("q");
            let want = reference(&q32, &read(0), &read(1), heads, scale);
            let diff = (got.squeeze(0).expect("squeeze") - want)
                .and_then(|t| t.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>())
                .expect("diff");
            assert!(diff < 2e-2, "{s:?} layer {l}: the kernel differs by {diff}");
        }
    }
    // Shapes that cannot hold the config are refused before anything is mapped.
    let e = PagedKvTensors::with_shape(
        &tensors,
        PagedKvConfig::new(1, 2, 12, TOKENS, 2, 8),
        DType::BF16,
        BlockShape::SplitK,
    )
    .expect_err("head_dim 12 with x = 8");
    assert!(
        e.to_string()
            .contains("head_dim 12 is not a multiple of x = 8"),
        "{e}"
    );
    let e = PagedKvTensors::with_shape(
        &tensors,
        config().layout(elastic_vmm::kv::KvLayout::Contiguous),
        DType::BF16,
        BlockShape::HeadMajor,
    )
    .expect_err("a shape on a contiguous cache");
    assert!(e.to_string().contains("per-layer tensors"), "{e}");
    drop(caches);
    dev.synchronize().expect("device still usable");
}

/// The write kernel, the decode kernel and the prefill kernel in every block order (the
/// engines' orders: ours, FlashInfer's head-major, vLLM's split K with transposed V), f16 and
/// bf16, head sizes 64 and 128, 2, 4 and 8 query heads per KV head, blocks of 16, 12, 10 and 7
/// tokens (tiles whole in a block or not), every live block poisoned with NaN first: tokens
/// written by `paged_kv_write` read back bit-exact through candle tensors of the order, the
/// first slot past the cache skipped; decode over each order matches the reference over the
/// written tokens (a block inside a length named by an id past the cache left out) and gives
/// the token-major output bit for bit (the same arithmetic, other loads), and so does prefill
/// (the prefill op's own tests check token-major against a reference); a cache whose tensors
/// do not match the order named, or bad tokens, are refused with the shapes.
#[test]
fn paged_attention_reads_and_writes_every_block_order() {
    /// The block of the longest sequence named by an id past the cache.
    const MASKED_AT: usize = 3;
    use elastic_vmm::candle::{
        paged_attention_decode_shaped, paged_attention_prefill_shaped, paged_kv_write, PrefillPiece,
    };
    let dev = Device::new_cuda(0).expect("candle CUDA device 0");
    let pool = Pool::cuda(0, 4 * GIB as usize).expect("CUDA pool");
    let tensors = TensorPool::new(&pool, &dev).expect("tensor pool");
    let shapes = [
        BlockShape::TokenMajor,
        BlockShape::HeadMajor,
        BlockShape::SplitK,
    ];
    let mut rng = Rng::new(11);
    // Blocks of 10 tokens: no tile of 4 lies whole in a block's run (split K's V read 2 bytes
    // at a time); 8 heads per KV head take tiles of 2, which do.
    for (dtype, heads, kvh, d, bt) in [
        (DType::BF16, 32, 8, 128, TOKENS),
        (DType::F16, 8, 8, 64, TOKENS),
        (DType::BF16, 16, 2, 64, TOKENS),
        (DType::BF16, 32, 8, 128, 10),
        (DType::F16, 16, 2, 128, 10),
        // 12: decode's tiles of 4 lie whole in a block, prefill's runs of 8 do not.
        (DType::F16, 16, 8, 64, 12),
        // 7: odd, even decode's tiles of 2 (8 query heads per KV head) straddle blocks.
        (DType::BF16, 64, 8, 128, 7),
    ] {
        let blocks = 192;
        let caches: Vec<PagedKvTensors> = shapes
            .iter()
            .map(|&s| {
                PagedKvTensors::with_shape(
                    &tensors,
                    PagedKvConfig::new(1, kvh, d, bt, 2, blocks),
                    dtype,
                    s,
                )
                .expect("cache")
            })
            .collect();
        // Three sequences over scattered blocks of each cache (fresh caches hand out the same
        // ids; each keeps its own).
        let lens = [1usize, 37, 700];
        let need: usize = lens.iter().map(|l| l.div_ceil(bt)).sum();
        let ids: Vec<Vec<usize>> = caches
            .iter()
            .map(|c| {
                // A fifth goes back below: enough for the longest need (7-token blocks).
                let mut all = c.alloc(need + need / 4 + 8).expect("alloc");
                let spare: Vec<usize> = all.iter().copied().filter(|b| b % 5 == 2).collect();
                all.retain(|b| b % 5 != 2);
                c.free(&spare).expect("free");
                all.truncate(need);
                all
            })
            .collect();
        assert!(ids.iter().all(|i| i.len() == need), "{ids:?}");
        // Every live block poisoned with NaN first: a slot no token is written to (the rest of
        // each sequence's last block) and any masked key a kernel failed to zero would show.
        for (c, live) in caches.iter().zip(&ids) {
            for t in [c.k(0).expect("k"), c.v(0).expect("v")] {
                let mut dims = t.dims().to_vec();
                dims[0] = 1;
                let nan = Tensor::full(f32::NAN, dims, &dev)
                    .and_then(|x| x.to_dtype(dtype))
                    .expect("NaN block");
                for &b in live {
                    t.slice_set(&nan, 0, b).expect("poison");
                }
            }
        }
        // Every token of every sequence: K and V `[tokens, kvh, d]`, written in one call per
        // cache, with one extra token whose slot is past the cache.
        let total: usize = lens.iter().sum();
        let rand = |rng: &mut Rng, n: usize| {
            let v: Vec<f32> = (0..n)
                .map(|_| rng.below(2001) as f32 / 1000.0 - 1.0)
                .collect();
            v
        };
        let k_new = Tensor::from_vec(
            rand(&mut rng, (total + 1) * kvh * d),
            (total + 1, kvh, d),
            &dev,
        )
        .and_then(|t| t.to_dtype(dtype))
        .expect("k");
        let v_new = Tensor::from_vec(
            rand(&mut rng, (total + 1) * kvh * d),
            (total + 1, kvh, d),
            &dev,
        )
        .and_then(|t| t.to_dtype(dtype))
        .expect("v");
        let width = lens.iter().map(|l| l.div_ceil(bt)).max().unwrap_or(1);
        let mut outs = Vec::new();
        for (ci, (s, c)) in shapes.iter().zip(&caches).enumerate() {
            let mut slots = Vec::with_capacity(total + 1);
            let mut table = Vec::new();
            let mut next = ids[ci].iter();
            for (si, &len) in lens.iter().enumerate() {
                let own: Vec<usize> = next.by_ref().take(len.div_ceil(bt)).copied().collect();
                for t in 0..len {
                    slots.push((own[t / bt] * bt + t % bt) as u32);
                }
                // Inside the longest sequence, its block MASKED_AT is named by an id past the
                // cache: its tokens are written but not attended over.
                table.extend(own.iter().enumerate().map(|(j, &b)| {
                    if si == 2 && j == MASKED_AT {
                        (blocks + 5) as u32
                    } else {
                        b as u32
                    }
                }));
                // Padding: the sequence's last block again.
                table.extend(std::iter::repeat_n(
                    *own.last().expect("a block") as u32,
                    width - own.len(),
                ));
            }
            // The first slot past the cache.
            slots.push((blocks * bt) as u32);
            let slots_t = Tensor::new(slots.as_slice(), &dev).expect("slots");
            let (kc, vc) = (c.k(0).expect("k"), c.v(0).expect("v"));
            paged_kv_write(*s, &k_new, &v_new, &kc, &vc, &slots_t).expect("write");
            // Read back through the order's tensors, token by token against what was written.
            let live: Vec<u32> = ids[ci].iter().map(|&b| b as u32).collect();
            let live_t = Tensor::new(live.as_slice(), &dev).expect("live");
            for (kv, src) in [(0, &k_new), (1, &v_new)] {
                let t = if kv == 0 { &kc } else { &vc };
                let back = from_shape(&t.index_select(&live_t, 0).expect("gather"), *s, kv)
                    .reshape((need * bt, kvh, d))
                    .expect("tokens");
                // Token i of the call sits at row (position of its block in `live`) * bt + offset.
                let rows: Vec<u32> = slots[..total]
                    .iter()
                    .map(|&sl| {
                        let b = sl as usize / bt;
                        let at = ids[ci].iter().position(|&x| x == b).expect("a live block");
                        (at * bt + sl as usize % bt) as u32
                    })
                    .collect();
                let got = back
                    .index_select(&Tensor::new(rows.as_slice(), &dev).expect("rows"), 0)
                    .expect("written rows");
                let want = src.narrow(0, 0, total).expect("tokens written");
                let diff = (got.to_dtype(DType::F32).expect("f32")
                    - want.to_dtype(DType::F32).expect("f32"))
                .and_then(|t| t.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>())
                .expect("diff");
                assert_eq!(
                    diff, 0.0,
                    "{dtype:?} d {d} {s:?} kv {kv}: written tokens read back differ"
                );
            }
            let table_t = Tensor::from_vec(table, (lens.len(), width), &dev).expect("table");
            let lens_t = Tensor::new(&lens.map(|l| l as u32), &dev).expect("lens");
            let q = Tensor::from_vec(
                rand(&mut Rng::new(3), lens.len() * heads * d),
                (lens.len(), heads, d),
                &dev,
            )
            .and_then(|t| t.to_dtype(dtype))
            .expect("q");
            let scale = 1.0 / (d as f64).sqrt();
            let out = paged_attention_decode_shaped(
                *s,
                &q,
                &kc,
                &vc,
                &table_t,
                &lens_t,
                700,
                scale as f32,
            )
            .and_then(|o| o.to_dtype(DType::F32))
            .expect("decode");
            // Against the reference over the written tokens of each sequence.
            let q32 = q.to_dtype(DType::F32).expect("q f32");
            let mut off = 0;
            for (b, &len) in lens.iter().enumerate() {
                let part = |t: &Tensor| {
                    let x = t.narrow(0, off, len).expect("part");
                    let x = if b == 2 {
                        // Without the masked block's tokens.
                        let (m0, m1) = (MASKED_AT * bt, (MASKED_AT + 1) * bt);
                        Tensor::cat(
                            &[
                                x.narrow(0, 0, m0).expect("before"),
                                x.narrow(0, m1, len - m1).expect("after"),
                            ],
                            0,
                        )
                        .expect("cat")
                    } else {
                        x
                    };
                    x.to_dtype(DType::F32).expect("f32")
                };
                let want = reference(
                    &q32.get(b).expect("q row"),
                    &part(&k_new),
                    &part(&v_new),
                    heads,
                    scale,
                );
                let diff = (out.get(b).expect("row") - want)
                    .and_then(|t| t.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>())
                    .expect("diff");
                let tol = if dtype == DType::BF16 { 2e-2 } else { 4e-3 };
                assert!(
                    diff <= tol,
                    "{dtype:?} d {d} {s:?}: sequence {b} differs from the reference by {diff}"
                );
                off += len;
            }
            outs.push(out);
        }
        // Prefill over each order: each sequence's last (up to) 40 tokens as a piece over the
        // tokens written, bit for bit the token-major output.
        let pieces: Vec<PrefillPiece> = lens
            .iter()
            .map(|&l| PrefillPiece {
                start: l - l.min(40),
                len: l.min(40),
            })
            .collect();
        let rows: usize = pieces.iter().map(|p| p.len).sum();
        let qp = Tensor::from_vec(
            rand(&mut Rng::new(4), rows * heads * d),
            (rows, heads, d),
            &dev,
        )
        .and_then(|t| t.to_dtype(dtype))
        .expect("prefill q");
        let mut prefills = Vec::new();
        for (ci, (s, c)) in shapes.iter().zip(&caches).enumerate() {
            let mut table = Vec::new();
            let mut next = ids[ci].iter();
            for &len in &lens {
                let own: Vec<u32> = next
                    .by_ref()
                    .take(len.div_ceil(bt))
                    .map(|&b| b as u32)
                    .collect();
                let last = *own.last().expect("a block");
                table.extend(own.iter().copied());
                table.extend(std::iter::repeat_n(last, width - own.len()));
            }
            let table_t = Tensor::from_vec(table, (lens.len(), width), &dev).expect("table");
            let scale = 1.0 / (d as f32).sqrt();
            let out = paged_attention_prefill_shaped(
                *s,
                &qp,
                &c.k(0).expect("k"),
                &c.v(0).expect("v"),
                &table_t,
                &pieces,
                scale,
            )
            .and_then(|o| o.to_dtype(DType::F32))
            .expect("prefill");
            prefills.push(out);
        }
        for (s, out) in shapes.iter().zip(&prefills).skip(1) {
            let diff = (out - &prefills[0])
                .and_then(|t| t.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>())
                .expect("diff");
            assert_eq!(
                diff, 0.0,
                "{dtype:?} d {d} bt {bt}: {s:?} prefill differs from token-major's"
            );
        }
        for (s, out) in shapes.iter().zip(&outs).skip(1) {
            let diff = (out - &outs[0])
                .and_then(|t| t.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>())
                .expect("diff");
            assert_eq!(
                diff, 0.0,
                "{dtype:?} d {d}: {s:?} decode differs from token-major's"
            );
        }
        // Refusals: the split-K cache named token-major, tokens of the wrong head size.
        let (kc, vc) = (caches[2].k(0).expect("k"), caches[2].v(0).expect("v"));
        let slots1 = Tensor::new(&[0u32], &dev).expect("slot");
        let one = k_new.narrow(0, 0, 1).expect("one token");
        let e = paged_kv_write(BlockShape::TokenMajor, &one, &one, &kc, &vc, &slots1)
            .expect_err("split-K tensors as token-major");
        assert!(
            e.to_string().contains("paged_kv_write") && e.to_string().contains("dimensions"),
            "{e}"
        );
        let e = paged_kv_write(
            BlockShape::HeadMajor,
            &one,
            &one,
            &caches[1].k(0).expect("k"),
            &caches[0].v(0).expect("v"),
            &slots1,
        )
        .expect_err("V of another order");
        assert!(e.to_string().contains("does not match"), "{e}");
        let narrow = one
            .narrow(2, 0, 8)
            .expect("head dim 8")
            .contiguous()
            .expect("c");
        let e = paged_kv_write(BlockShape::SplitK, &narrow, &narrow, &kc, &vc, &slots1)
            .expect_err("head size 8");
        assert!(
            e.to_string().contains(&format!("[tokens, {kvh}, {d}]")),
            "{e}"
        );
        let e = paged_attention_decode_shaped(
            BlockShape::HeadMajor,
            &q_for(&dev, heads, d, dtype),
            &kc,
            &vc,
            &slots1.reshape((1, 1)).expect("t"),
            &slots1,
            1,
            1.0,
        )
        .expect_err("split-K tensors as head-major");
        assert!(e.to_string().contains("paged_attention_decode"), "{e}");
        for (c, i) in caches.iter().zip(&ids) {
            c.free(i).expect("free");
        }
    }
    dev.synchronize().expect("device still usable");
}

/// A query of one sequence.
fn q_for(dev: &Device, heads: usize, d: usize, dtype: DType) -> Tensor {
    Tensor::zeros((1, heads, d), dtype, dev).expect("q")
}
