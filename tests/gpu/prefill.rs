//! The paged-attention prefill op (`elastic_vmm::candle::paged_attention_prefill`) on the GPU:
//! against a causal reference attention in f32 candle ops over the same blocks gathered by
//! table, for f16 and bf16, grouped-query ratios 1, 4 and 8, head sizes 64 and 128; pieces that
//! start at 0 and past it, shorter and longer than a tile of 64 queries, crossing block
//! boundaries, one of no tokens, one with ids past the cache inside its context (masked), tables
//! padded past each context, each piece within 1% (bf16) or 0.3% (f16) of its largest output;
//! a token whose every key is masked gets zeros; bad input (a misaligned view among it) is an
//! error that leaves the device usable.

use candle_core::{DType, Device, Tensor, D};
use elastic_vmm::candle::{paged_attention_prefill, PagedKvTensors, PrefillPiece, TensorPool};
use elastic_vmm::kv::PagedKvConfig;
use elastic_vmm::Pool;

use crate::suite::{Rng, GIB};

const TOKENS: usize = 16;
const MAX_BLOCKS: usize = 1024;
/// (start, len) of each piece: from 0, one token, a tile and a bit, inside a block, a long
/// context with a short chunk, a chunk longer than two tiles, no tokens, then the masked one.
const PIECES: [(usize, usize); 8] = [
    (0, 100),
    (0, 1),
    (37, 64),
    (5, 7),
    (1500, 70),
    (300, 200),
    (64, 0),
    (40, 90),
];
/// The last piece's blocks 1 and 4 are ids past the cache: their tokens are masked.
const MASKED: (usize, [usize; 2]) = (7, [1, 4]);

/// Causal attention of one piece in f32 candle ops: q `[len, heads, d]` at positions `start..`
/// over keys k, v `[n, kv_heads, d]` at positions `pos` (masked blocks left out).
fn reference(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    pos: &[usize],
    start: usize,
    scale: f64,
) -> Tensor {
    let (len, heads, d) = q.dims3().expect("q dims");
    let (n, kvh, _) = k.dims3().expect("k dims");
    let rep = heads / kvh;
    let expand = |t: &Tensor| {
        t.transpose(0, 1)
            .and_then(|t| t.unsqueeze(1))
            .and_then(|t| t.broadcast_as((kvh, rep, n, d)))
            .and_then(|t| t.reshape((heads, n, d)))
            .expect("expand kv")
    };
    let (k, v) = (expand(k), expand(v));
    let mask: Vec<f32> = (0..len)
        .flat_map(|i| {
            pos.iter().map(move |&p| {
                if p <= start + i {
                    0.0
                } else {
                    f32::NEG_INFINITY
                }
            })
        })
        .collect();
    let mask = Tensor::from_vec(mask, (1, len, n), q.device()).expect("mask");
    let scores = q
        .transpose(0, 1)
        .and_then(|q| q.contiguous())
        .and_then(|q| q.matmul(&k.t()?))
        .and_then(|s| s.affine(scale, 0.0))
        .and_then(|s| s.broadcast_add(&mask))
        .expect("scores");
    let max = scores.max_keepdim(D::Minus1).expect("max");
    let e = scores
        .broadcast_sub(&max)
        .and_then(|x| x.exp())
        .expect("exp");
    let p = e
        .broadcast_div(&e.sum_keepdim(D::Minus1).expect("sum"))
        .expect("softmax");
    p.matmul(&v)
        .and_then(|o| o.transpose(0, 1))
        .and_then(|o| o.contiguous())
        .expect("weighted values")
}

fn check(dtype: DType, heads: usize, kv_heads: usize, head_dim: usize, seed: u64) {
    let dev = Device::new_cuda(0).expect("candle CUDA device 0");
    let pool = Pool::cuda(0, 8 * GIB as usize).expect("CUDA pool");
    let tensors = TensorPool::new(&pool, &dev).expect("tensor pool");
    let config = PagedKvConfig::new(1, kv_heads, head_dim, TOKENS, 2, MAX_BLOCKS);
    let cache = PagedKvTensors::new(&tensors, config, dtype).expect("paged cache");
    let mut rng = Rng::new(seed);
    let need: usize = PIECES.iter().map(|(s, l)| (s + l).div_ceil(TOKENS)).sum();
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
    let width = PIECES
        .iter()
        .map(|(s, l)| (s + l).div_ceil(TOKENS))
        .max()
        .unwrap_or(0)
        + 2;
    let mut table = Vec::new();
    let mut next = ids.iter();
    for (i, &(s, l)) in PIECES.iter().enumerate() {
        let n = (s + l).div_ceil(TOKENS);
        for j in 0..n {
            let id = *next.next().expect("enough blocks") as u32;
            let masked = i == MASKED.0 && MASKED.1.contains(&j);
            table.push(if masked { u32::MAX } else { id });
        }
        // Padding past the context: a block nobody allocated, or an id past the cache.
        for j in n..width {
            table.push(if (i + j) % 2 == 0 {
                (MAX_BLOCKS - 1) as u32
            } else {
                u32::MAX
            });
        }
    }
    let table_t = Tensor::from_vec(table.clone(), (PIECES.len(), width), &dev).expect("table");
    let pieces: Vec<PrefillPiece> = PIECES
        .iter()
        .map(|&(start, len)| PrefillPiece { start, len })
        .collect();
    let tokens: usize = PIECES.iter().map(|p| p.1).sum();
    let q = Tensor::randn(0f32, 1.0, (tokens, heads, head_dim), &dev)
        .and_then(|x| x.to_dtype(dtype))
        .expect("q");
    let scale = 1.0 / (head_dim as f64).sqrt();
    let got = paged_attention_prefill(&q, &k, &v, &table_t, &pieces, scale as f32)
        .and_then(|o| o.to_dtype(DType::F32))
        .expect("paged prefill");
    assert_eq!(got.dims(), [tokens, heads, head_dim]);
    // Relative to each piece's largest output: a long context averages to small values, where
    // an absolute bound would let a dropped or mis-masked tile of keys pass.
    let tol = if dtype == DType::BF16 { 1e-2 } else { 3e-3 };
    let mut row = 0;
    for (i, &(start, len)) in PIECES.iter().enumerate() {
        if len == 0 {
            continue;
        }
        let n = (start + len).div_ceil(TOKENS);
        // The context's tokens in named blocks, with their positions.
        let mut named = Vec::new();
        let mut pos = Vec::new();
        for j in 0..n {
            let id = table[i * width + j];
            if id == u32::MAX {
                continue;
            }
            named.push(id);
            pos.extend((j * TOKENS..(j + 1) * TOKENS).filter(|&p| p < start + len));
        }
        let rows = Tensor::from_vec(named.clone(), named.len(), &dev).expect("rows");
        let gather = |c: &Tensor| {
            c.index_select(&rows, 0)
                .and_then(|x| x.reshape((named.len() * TOKENS, kv_heads, head_dim)))
                .and_then(|x| x.narrow(0, 0, pos.len()))
                .and_then(|x| x.to_dtype(DType::F32))
                .expect("gather")
        };
        let qp = q
            .narrow(0, row, len)
            .and_then(|x| x.to_dtype(DType::F32))
            .expect("q rows");
        let want = reference(&qp, &gather(&k), &gather(&v), &pos, start, scale);
        let max_abs = |t: &Tensor| {
            t.abs()
                .and_then(|d| d.max_all())
                .and_then(|d| d.to_scalar::<f32>())
                .expect("max")
        };
        let diff = max_abs(&(got.narrow(0, row, len).expect("out rows") - &want).expect("diff"));
        let scale_of = max_abs(&want);
        assert!(
            diff <= tol * scale_of,
            "{dtype:?} heads {heads}/{kv_heads} d {head_dim}: piece {i} (start {start}, {len} tokens) differs by {diff}, {:.4} of its largest output {scale_of} (tolerance {tol})",
            diff / scale_of
        );
        row += len;
    }
    cache.free(&ids).expect("free");
}

#[test]
fn paged_prefill_matches_a_reference_bf16_gqa4_d128() {
    check(DType::BF16, 32, 8, 128, 11);
}

#[test]
fn paged_prefill_matches_a_reference_f16_gqa8_d128() {
    check(DType::F16, 16, 2, 128, 12);
}

#[test]
fn paged_prefill_matches_a_reference_bf16_mha_d64() {
    check(DType::BF16, 8, 8, 64, 13);
}

#[test]
fn paged_prefill_matches_a_reference_f16_gqa2_d64() {
    check(DType::F16, 8, 4, 64, 14);
}

#[test]
fn paged_prefill_refuses_bad_input_and_the_device_stays_usable() {
    let dev = Device::new_cuda(0).expect("candle CUDA device 0");
    let q = Tensor::ones((20, 8, 128), DType::BF16, &dev).expect("q");
    let kv = Tensor::ones((4, TOKENS, 2, 128), DType::BF16, &dev).expect("kv");
    let table = Tensor::zeros((2, 4), DType::U32, &dev).expect("table");
    let f32_kv = Tensor::zeros((4, TOKENS, 2, 128), DType::F32, &dev).expect("f32");
    let ok = [
        PrefillPiece { start: 0, len: 10 },
        PrefillPiece { start: 3, len: 10 },
    ];
    let long = [
        PrefillPiece { start: 0, len: 10 },
        PrefillPiece { start: 60, len: 10 },
    ];
    let short = [
        PrefillPiece { start: 0, len: 10 },
        PrefillPiece { start: 0, len: 5 },
    ];
    for (what, r, needle) in [
        (
            "tokens",
            paged_attention_prefill(&q, &kv, &kv, &table, &short, 1.0),
            "sum to 15",
        ),
        (
            "past the table",
            paged_attention_prefill(&q, &kv, &kv, &table, &long, 1.0),
            "piece 1 (positions 60 + 10)",
        ),
        (
            "dtype",
            paged_attention_prefill(&q, &f32_kv, &f32_kv, &table, &ok, 1.0),
            "F32",
        ),
        (
            "table rows",
            paged_attention_prefill(&q, &kv, &kv, &table, &ok[..1], 1.0),
            "1 pieces",
        ),
        (
            "head_dim",
            paged_attention_prefill(
                &Tensor::zeros((20, 8, 96), DType::BF16, &dev).expect("q96"),
                &Tensor::zeros((4, TOKENS, 2, 96), DType::BF16, &dev).expect("kv96"),
                &Tensor::zeros((4, TOKENS, 2, 96), DType::BF16, &dev).expect("kv96"),
                &table,
                &ok,
                1.0,
            ),
            "head_dim 96",
        ),
        (
            "rank",
            paged_attention_prefill(
                &Tensor::zeros((20, 1024), DType::BF16, &dev).expect("q2"),
                &kv,
                &kv,
                &table,
                &ok,
                1.0,
            ),
            "want [tokens, heads, head_dim]",
        ),
        (
            "scale",
            paged_attention_prefill(&q, &kv, &kv, &table, &ok, f32::NAN),
            "not finite",
        ),
        (
            "3 heads over 2",
            paged_attention_prefill(
                &Tensor::zeros((20, 3, 128), DType::BF16, &dev).expect("q3"),
                &kv,
                &kv,
                &table,
                &ok,
                1.0,
            ),
            "3 query heads over 2",
        ),
    ] {
        let e = r.expect_err(what).to_string();
        assert!(
            e.contains("paged_attention_prefill") && e.contains(needle),
            "{what}: {e}"
        );
    }
    // A q view starting 2 bytes into its storage: refused (the kernel loads 16 bytes at once).
    let shifted = Tensor::zeros(20 * 8 * 128 + 1, DType::BF16, &dev)
        .and_then(|t| t.narrow(0, 1, 20 * 8 * 128))
        .and_then(|t| t.reshape((20, 8, 128)))
        .expect("a shifted view");
    let e = paged_attention_prefill(&shifted, &kv, &kv, &table, &ok, 1.0)
        .expect_err("a misaligned q")
        .to_string();
    assert!(e.contains("starts 2 bytes into its storage"), "{e}");
    // A piece whose every visible key is in a masked block: zeros, and its neighbour's rows are
    // still ones.
    let masked =
        Tensor::from_vec(vec![u32::MAX, 0, 0, 0, 0, 0, 0, 0], (2, 4), &dev).expect("table");
    let out = paged_attention_prefill(&q, &kv, &kv, &masked, &ok, 1.0)
        .and_then(|o| o.to_dtype(DType::F32))
        .expect("a masked piece");
    let sum = |t: Tensor| t.sum_all().and_then(|s| s.to_scalar::<f32>()).expect("sum");
    assert_eq!(
        sum(out.narrow(0, 0, 10).expect("piece 0")),
        0.0,
        "masked rows are zeros"
    );
    assert_eq!(
        sum(out.narrow(0, 10, 10).expect("piece 1")),
        (10 * 8 * 128) as f32
    );
    // Every key and value ones (block 0 everywhere): each output element is 1.
    let out = paged_attention_prefill(&q, &kv, &kv, &table, &ok, 1.0)
        .and_then(|o| o.to_dtype(DType::F32))
        .and_then(|o| o.sum_all())
        .and_then(|o| o.to_scalar::<f32>())
        .expect("a valid call after the refusals");
    assert_eq!(out, (20 * 8 * 128) as f32);
}
