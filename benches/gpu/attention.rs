//! `gpu-bench attention`: the paged-attention decode op against the HBM floor, in one run.
//! - the device's copy bandwidth: a 4 GiB `cuMemcpyDtoD`, counted as bytes read plus bytes
//!   written (what the floor divides by);
//! - the op alone, 8B-shaped (32 query heads over 8 KV heads of 128, bf16), batch 32, context
//!   2048, blocks scattered through the cache: against the floor (the K and V bytes it must read
//!   over the bandwidth) and against attention by gather (`index_select` of each sequence's
//!   blocks, then matmuls and a softmax: what the serving example's engine did);
//! - a decode step of an 8B-shaped model (32 layers: the fused QKV, output, gate-up and down
//!   projections as bf16 matmuls, the op per layer, the LM head of 128256 rows) against the
//!   floor of its weights and KV bytes. Norms and rotary embeddings are left out (a few
//!   microseconds each); the new token's K and V writes too (2 KiB per sequence and layer).

use std::time::Instant;

use candle_core::{DType, Device, Tensor, D};
use elastic_vmm::candle::{paged_attention_decode, PagedKvTensors, TensorPool};
use elastic_vmm::kv::PagedKvConfig;
use elastic_vmm::Pool;

use crate::{human, median, result, BoxError, GIB};

const BATCH: usize = 32;
const CONTEXT: usize = 2048;
const HEADS: usize = 32;
const KV_HEADS: usize = 8;
const HEAD_DIM: usize = 128;
const LAYERS: usize = 32;
const HIDDEN: usize = HEADS * HEAD_DIM;
const FFN: usize = 14336;
const VOCAB: usize = 128256;
const TOKENS: usize = 16;

/// Seconds per call of `f`, `n` calls, the device synchronized before and after.
fn timed(
    device: &Device,
    n: usize,
    mut f: impl FnMut() -> Result<(), BoxError>,
) -> Result<f64, BoxError> {
    device.synchronize()?;
    let t = Instant::now();
    for _ in 0..n {
        f()?;
    }
    device.synchronize()?;
    Ok(t.elapsed().as_secs_f64() / n as f64)
}

pub fn run() -> Result<(), BoxError> {
    let device = Device::new_cuda(0)?;
    let pool = Pool::cuda(0, (24 * GIB) as usize)?;
    let tensors = TensorPool::new(&pool, &device)?;
    println!(
        "== attention: {} (paged-attention decode, 8B-shaped) ==",
        pool.backend_info().device_name
    );
    let bw = copy_bandwidth(&device)?;
    println!(
        "device copy bandwidth: {:.0} GB/s (4 GiB copied, read + written)",
        bw / 1e9
    );

    // The cache: every layer's K and V, each sequence's 128 blocks scattered through it.
    let blocks = BATCH * CONTEXT / TOKENS;
    let config = PagedKvConfig::new(LAYERS, KV_HEADS, HEAD_DIM, TOKENS, 2, blocks + 1024);
    let cache = PagedKvTensors::new(&tensors, config, DType::BF16)?;
    let mut ids = cache.alloc(blocks + 1024)?;
    let mut state = 0x9e37_79b9_7f4a_7c15u64;
    for i in (1..ids.len()).rev() {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        ids.swap(i, (state % (i as u64 + 1)) as usize);
    }
    let spare = ids.split_off(blocks);
    cache.free(&spare)?;
    let layer_kv = (2 * blocks * TOKENS * KV_HEADS * HEAD_DIM * 2) as u64;
    // Layer 0's live blocks get values (the op is compared with attention by gather there);
    // the other layers' contents do not change the time.
    for t in [cache.k(0)?, cache.v(0)?] {
        let fill = Tensor::randn(0f32, 1.0, (blocks, TOKENS, KV_HEADS, HEAD_DIM), &device)?
            .to_dtype(DType::BF16)?;
        for (i, &b) in ids.iter().enumerate() {
            t.slice_set(&fill.narrow(0, i, 1)?, 0, b)?;
        }
    }
    let table: Vec<u32> = ids.iter().map(|&b| b as u32).collect();
    let table = Tensor::from_vec(table, (BATCH, CONTEXT / TOKENS), &device)?;
    let lens = Tensor::from_vec(vec![CONTEXT as u32; BATCH], BATCH, &device)?;
    let q = Tensor::randn(0f32, 1.0, (BATCH, HEADS, HEAD_DIM), &device)?.to_dtype(DType::BF16)?;
    let scale = 1.0 / (HEAD_DIM as f32).sqrt();
    let (k0, v0) = (cache.k(0)?, cache.v(0)?);

    // The op alone, against the floor and against attention by gather.
    let op = || -> Result<Tensor, BoxError> {
        Ok(paged_attention_decode(
            &q, &k0, &v0, &table, &lens, CONTEXT, scale,
        )?)
    };
    op()?;
    let ours = median(5, || {
        timed(&device, 50, || op().map(drop)).unwrap_or(f64::NAN)
    });
    let floor = layer_kv as f64 / bw;
    let by_gather =
        || -> Result<Tensor, BoxError> { gather_attention(&q, &k0, &v0, &table, scale) };
    let diff = (op()?.to_dtype(DType::F32)? - by_gather()?.to_dtype(DType::F32)?)?
        .abs()?
        .max_all()?
        .to_scalar::<f32>()?;
    let peer = median(3, || {
        timed(&device, 10, || by_gather().map(drop)).unwrap_or(f64::NAN)
    });
    println!(
        "paged attention, batch {BATCH}, context {CONTEXT}, {HEADS}/{KV_HEADS} heads of {HEAD_DIM}, bf16: {:.1} us for {} of K and V: {:.0} GB/s, floor {:.1} us: {:.2}x the floor; by gather {:.1} us ({:.2}x ours; outputs differ by at most {diff:.4})",
        ours * 1e6,
        human(layer_kv),
        layer_kv as f64 / ours / 1e9,
        floor * 1e6,
        ours / floor,
        peer * 1e6,
        peer / ours
    );
    result(
        "attention/vs-gather",
        &format!("paged-attention decode, batch {BATCH}, context {CONTEXT}, 8B-shaped, bf16"),
        format!("{:.1} us", ours * 1e6),
        "attention by gather: index_select of the blocks, matmuls, softmax",
        format!("{:.1} us", peer * 1e6),
        peer / ours,
    );
    result(
        "attention/floor",
        &format!(
            "paged-attention decode against the HBM floor ({} of K and V read)",
            human(layer_kv)
        ),
        format!("{:.1} us", ours * 1e6),
        "the floor: bytes read over the measured copy bandwidth",
        format!("{:.1} us", floor * 1e6),
        floor / ours,
    );
    decode_step(&device, &cache, &table, &lens, bw, layer_kv)?;
    cache.free(&ids)?;
    Ok(())
}

/// Bytes moved per second by a device-to-device copy of 4 GiB (`cuMemcpyDtoDAsync`, counted
/// as read plus written), the best of five.
fn copy_bandwidth(device: &Device) -> Result<f64, BoxError> {
    let n = 4 * GIB as usize;
    let stream = device.as_cuda_device()?.cuda_stream();
    let src = stream.alloc_zeros::<u8>(n)?;
    let mut dst = stream.alloc_zeros::<u8>(n)?;
    let mut best = f64::INFINITY;
    for _ in 0..5 {
        stream.synchronize()?;
        let t = Instant::now();
        stream.memcpy_dtod(&src, &mut dst)?;
        stream.synchronize()?;
        best = best.min(t.elapsed().as_secs_f64());
    }
    Ok(2.0 * n as f64 / best)
}

/// Attention by gather: each sequence's blocks copied out by table, then matmuls and softmax.
fn gather_attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    table: &Tensor,
    scale: f32,
) -> Result<Tensor, BoxError> {
    let rep = HEADS / KV_HEADS;
    let gather = |c: &Tensor| -> Result<Tensor, BoxError> {
        // [b * nb, bt, kvh, hd] -> [b, kvh, l, hd]
        Ok(c.index_select(&table.flatten_all()?, 0)?
            .reshape((BATCH, CONTEXT, KV_HEADS, HEAD_DIM))?
            .transpose(1, 2)?
            .contiguous()?)
    };
    let (k, v) = (gather(k)?, gather(v)?);
    let q = q.reshape((BATCH, KV_HEADS, rep, HEAD_DIM))?;
    let scores = q
        .matmul(&k.t()?)?
        .to_dtype(DType::F32)?
        .affine(scale as f64, 0.0)?;
    let max = scores.max_keepdim(D::Minus1)?;
    let e = scores.broadcast_sub(&max)?.exp()?;
    let p = e
        .broadcast_div(&e.sum_keepdim(D::Minus1)?)?
        .to_dtype(DType::BF16)?;
    Ok(p.matmul(&v)?.reshape((BATCH, HEADS, HEAD_DIM))?)
}

/// One decode step of an 8B-shaped model against the floor of its weights and KV bytes.
fn decode_step(
    device: &Device,
    cache: &PagedKvTensors,
    table: &Tensor,
    lens: &Tensor,
    bw: f64,
    layer_kv: u64,
) -> Result<(), BoxError> {
    let w = |r: usize, c: usize| Tensor::zeros((r, c), DType::BF16, device);
    let mut layers = Vec::new();
    for _ in 0..LAYERS {
        layers.push((
            w(HIDDEN, HIDDEN + 2 * KV_HEADS * HEAD_DIM)?,
            w(HIDDEN, HIDDEN)?,
            w(HIDDEN, 2 * FFN)?,
            w(FFN, HIDDEN)?,
        ));
    }
    let head = w(HIDDEN, VOCAB)?;
    let weight_bytes: u64 = layers
        .iter()
        .flat_map(|(a, b, c, d)| [a, b, c, d])
        .chain([&head])
        .map(|t| (t.elem_count() * 2) as u64)
        .sum();
    let kv: Vec<(Tensor, Tensor)> = (0..LAYERS)
        .map(|l| Ok((cache.k(l)?, cache.v(l)?)))
        .collect::<Result<_, BoxError>>()?;
    let scale = 1.0 / (HEAD_DIM as f32).sqrt();
    let x0 = Tensor::randn(0f32, 1.0, (BATCH, HIDDEN), device)?.to_dtype(DType::BF16)?;
    let step = || -> Result<(), BoxError> {
        let mut x = x0.clone();
        for ((wqkv, wo, wgu, wd), (k, v)) in layers.iter().zip(&kv) {
            let qkv = x.matmul(wqkv)?;
            let q = qkv
                .narrow(1, 0, HIDDEN)?
                .contiguous()?
                .reshape((BATCH, HEADS, HEAD_DIM))?;
            let a = paged_attention_decode(&q, k, v, table, lens, CONTEXT, scale)?;
            x = (x + a.reshape((BATCH, HIDDEN))?.matmul(wo)?)?;
            let gu = x.matmul(wgu)?;
            let h = (gu.narrow(1, 0, FFN)?.silu()? * gu.narrow(1, FFN, FFN)?)?;
            x = (x + h.matmul(wd)?)?;
        }
        drop(x.matmul(&head)?);
        Ok(())
    };
    step()?;
    let ours = median(3, || timed(device, 10, step).unwrap_or(f64::NAN));
    let bytes = weight_bytes + LAYERS as u64 * layer_kv;
    let floor = bytes as f64 / bw;
    println!(
        "decode step, 8B-shaped ({} of weights, {} of KV), batch {BATCH}, context {CONTEXT}: {:.2} ms, floor {:.2} ms: {:.2}x the floor ({:.0} output tokens/s)",
        human(weight_bytes),
        human(LAYERS as u64 * layer_kv),
        ours * 1e3,
        floor * 1e3,
        ours / floor,
        BATCH as f64 / ours
    );
    result(
        "attention/decode-step-floor",
        &format!("decode step of an 8B-shaped model, batch {BATCH}, context {CONTEXT}, bf16"),
        format!("{:.2} ms", ours * 1e3),
        "the floor: weights and KV bytes over the measured copy bandwidth",
        format!("{:.2} ms", floor * 1e3),
        floor / ours,
    );
    Ok(())
}
