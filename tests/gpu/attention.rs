//! The paged-attention decode op (`elastic_vmm::candle::paged_attention_decode`) on the GPU:
//! against a reference attention in f32 candle ops over the same blocks gathered by table, for
//! f16 and bf16, grouped-query ratios 1, 4 and 8, head sizes 64 and 128, lengths from 0 to past
//! one partition, tables padded with never-allocated and out-of-range ids; bad shapes are
//! errors that leave the device usable.

use candle_core::{DType, Device, Tensor, D};
use elastic_vmm::candle::{paged_attention_decode, PagedKvTensors, TensorPool};
use elastic_vmm::kv::PagedKvConfig;
use elastic_vmm::Pool;

use crate::suite::{Rng, GIB};

const TOKENS: usize = 16;
const MAX_BLOCKS: usize = 1024;
/// Lengths: empty, one token, one block exactly, one past it, several partitions.
const LENS: [usize; 7] = [0, 1, 16, 17, 300, 1500, 2500];

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
        for _ in 0..n {
            table.push(*next.next().expect("enough blocks") as u32);
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
        let rows =
            Tensor::from_vec(table[b * width..b * width + n].to_vec(), n, &dev).expect("rows");
        let gather = |c: &Tensor| {
            c.index_select(&rows, 0)
                .and_then(|x| x.reshape((n * TOKENS, kv_heads, head_dim)))
                .and_then(|x| x.narrow(0, 0, len))
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
