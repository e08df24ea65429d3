//! `gpu-bench attention`: the paged-attention decode op against the HBM floor, in one run.
//! - the device's copy bandwidth: a 4 GiB `cuMemcpyDtoD`, counted as bytes read plus bytes
//!   written (what the floor divides by);
//! - the op alone, 8B-shaped (32 query heads over 8 KV heads of 128, bf16), batch 32, context
//!   2048, blocks scattered through the cache: against the floor (the K and V bytes it must read
//!   over the bandwidth) and against attention by gather (`index_select` of each sequence's
//!   blocks, then matmuls and a softmax: what the serving example's engine did);
//! - the op over the same blocks in vLLM's split-K order (mistral.rs's and candle-vllm's
//!   paged-attention layout) against the token-major run;
//! - a decode step of an 8B-shaped model (32 layers: the fused QKV, output, gate-up and down
//!   projections as bf16 matmuls, the op per layer, the LM head of 128256 rows) against the
//!   floor of its weights and KV bytes. Norms and rotary embeddings are left out (a few
//!   microseconds each); the new token's K and V writes too (2 KiB per sequence and layer);
//! - the paged-attention prefill op, 8B-shaped: a chunk of 512 new tokens at positions
//!   3584..4096 of one sequence (the last chunk of a 4k prompt, where the serving example's
//!   engine prefilled slowest), against attention by gather (`index_select` of the blocks,
//!   matmuls, a causal mask, a softmax over the materialised scores: that engine's prefill);
//! - a prefill forward of an 8B-shaped model over that chunk (the decode step's matmuls with
//!   512 rows, the prefill op per layer), in tensor-core FLOP/s: how far the engine's prefill
//!   is from the device's compute (the H100 SXM's dense bf16 peak is 989 TFLOP/s).

use std::time::Instant;

use candle_core::{DType, Device, Tensor, D};
use elastic_vmm::candle::{
    paged_attention_decode, paged_attention_decode_shaped, paged_attention_prefill, BlockShape,
    PagedKvTensors, PrefillPiece, TensorPool,
};
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
    split_k(&device, &tensors, &ids, &table, &lens, &q, ours)?;
    decode_step(&device, &cache, &table, &lens, bw, layer_kv)?;
    // The prefill chunk reads sequence 0's and 1's blocks of layer 0 as one 4096-token context.
    let ctx_table = Tensor::from_vec(
        ids[..2 * CONTEXT / TOKENS]
            .iter()
            .map(|&b| b as u32)
            .collect::<Vec<_>>(),
        (1, 2 * CONTEXT / TOKENS),
        &device,
    )?;
    prefill(&device, &k0, &v0, &ctx_table)?;
    prefill_step(&device, &cache, &ctx_table)?;
    cache.free(&ids)?;
    Ok(())
}

/// The op over one layer of a cache in vLLM's split-K order (mistral.rs's and candle-vllm's
/// paged-attention layout: V transposed, a tile's tokens of one element per load), the same blocks and shapes
/// as the token-major run that took `token_major` seconds.
fn split_k(
    device: &Device,
    tensors: &TensorPool,
    ids: &[usize],
    table: &Tensor,
    lens: &Tensor,
    q: &Tensor,
    token_major: f64,
) -> Result<(), BoxError> {
    let n = ids.iter().max().map_or(1, |m| m + 1);
    let cache = PagedKvTensors::with_shape(
        tensors,
        PagedKvConfig::new(1, KV_HEADS, HEAD_DIM, TOKENS, 2, n),
        DType::BF16,
        BlockShape::SplitK,
    )?;
    let mine = cache.alloc(n)?;
    let (k, v) = (cache.k(0)?, cache.v(0)?);
    for t in [&k, &v] {
        let dims = t.dims().to_vec();
        t.slice_set(
            &Tensor::randn(0f32, 1.0, dims, device)?.to_dtype(DType::BF16)?,
            0,
            0,
        )?;
    }
    let scale = 1.0 / (HEAD_DIM as f32).sqrt();
    let op = || -> Result<Tensor, BoxError> {
        Ok(paged_attention_decode_shaped(
            BlockShape::SplitK,
            q,
            &k,
            &v,
            table,
            lens,
            CONTEXT,
            scale,
        )?)
    };
    op()?;
    let t = median(5, || {
        timed(device, 50, || op().map(drop)).unwrap_or(f64::NAN)
    });
    println!(
        "paged attention over split-K blocks (vLLM's order), batch {BATCH}, context {CONTEXT}: {:.1} us, token-major {:.1} us ({:.2}x)",
        t * 1e6,
        token_major * 1e6,
        token_major / t
    );
    result(
        "attention/split-k",
        &format!("paged-attention decode over split-K blocks, batch {BATCH}, context {CONTEXT}, 8B-shaped, bf16"),
        format!("{:.1} us", t * 1e6),
        "the op over the same blocks in token-major order",
        format!("{:.1} us", token_major * 1e6),
        token_major / t,
    );
    cache.free(&mine)?;
    Ok(())
}

/// New tokens of the prefill chunk, and where it starts.
const CHUNK: usize = 512;
const CHUNK_START: usize = 2 * CONTEXT - CHUNK;

/// The prefill op on the last chunk of a 4096-token context against attention by gather.
fn prefill(device: &Device, k: &Tensor, v: &Tensor, table: &Tensor) -> Result<(), BoxError> {
    let q = Tensor::randn(0f32, 1.0, (CHUNK, HEADS, HEAD_DIM), device)?.to_dtype(DType::BF16)?;
    let scale = 1.0 / (HEAD_DIM as f32).sqrt();
    let piece = [PrefillPiece {
        start: CHUNK_START,
        len: CHUNK,
    }];
    let op = || -> Result<Tensor, BoxError> {
        Ok(paged_attention_prefill(&q, k, v, table, &piece, scale)?)
    };
    let by_gather = || -> Result<Tensor, BoxError> { gather_prefill(&q, k, v, table, scale) };
    let diff = (op()?.to_dtype(DType::F32)? - by_gather()?.to_dtype(DType::F32)?)?
        .abs()?
        .max_all()?
        .to_scalar::<f32>()?;
    let ours = median(5, || {
        timed(device, 20, || op().map(drop)).unwrap_or(f64::NAN)
    });
    let peer = median(3, || {
        timed(device, 5, || by_gather().map(drop)).unwrap_or(f64::NAN)
    });
    // Causal: query i (position CHUNK_START + i) multiplies by CHUNK_START + i + 1 keys, twice
    // (scores and values), 2 flops a multiply-add.
    let pairs: usize = (0..CHUNK).map(|i| CHUNK_START + i + 1).sum();
    let softmax = if cfg!(feature = "candle-example") {
        "candle-nn's fused softmax"
    } else {
        "softmax in plain ops"
    };
    let flops = (4 * HEADS * HEAD_DIM * pairs) as f64;
    println!(
        "paged prefill, {CHUNK} new tokens at {CHUNK_START}..{}, {HEADS}/{KV_HEADS} heads of {HEAD_DIM}, bf16: {:.1} us ({:.0} TFLOP/s); by gather ({softmax}) {:.1} us ({:.2}x ours; outputs differ by at most {diff:.4}); per 32 layers: {:.1} ms against {:.1} ms",
        CHUNK_START + CHUNK,
        ours * 1e6,
        flops / ours / 1e12,
        peer * 1e6,
        peer / ours,
        ours * 1e3 * LAYERS as f64,
        peer * 1e3 * LAYERS as f64,
    );
    result(
        "attention/prefill-vs-gather",
        &format!(
            "paged-attention prefill, {CHUNK} tokens at {CHUNK_START}..{}, 8B-shaped, bf16",
            CHUNK_START + CHUNK
        ),
        format!("{:.1} us", ours * 1e6),
        "attention by gather: index_select of the blocks, matmuls, causal mask, softmax",
        format!("{:.1} us", peer * 1e6),
        peer / ours,
    );
    Ok(())
}

/// One prefill forward of an 8B-shaped model: the chunk's 512 tokens through 32 layers of
/// matmuls and the prefill op (norms, rotary embeddings and K/V writes left out, as in the
/// decode step), timed and counted in FLOP/s.
fn prefill_step(device: &Device, cache: &PagedKvTensors, table: &Tensor) -> Result<(), BoxError> {
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
    let params: usize = layers
        .iter()
        .flat_map(|(a, b, c, d)| [a, b, c, d])
        .map(|t| t.elem_count())
        .sum();
    let kv: Vec<(Tensor, Tensor)> = (0..LAYERS)
        .map(|l| Ok((cache.k(l)?, cache.v(l)?)))
        .collect::<Result<_, BoxError>>()?;
    let scale = 1.0 / (HEAD_DIM as f32).sqrt();
    let piece = [PrefillPiece {
        start: CHUNK_START,
        len: CHUNK,
    }];
    let x0 = Tensor::randn(0f32, 1.0, (CHUNK, HIDDEN), device)?.to_dtype(DType::BF16)?;
    let step = |matmul_only: bool| -> Result<(), BoxError> {
        let mut x = x0.clone();
        for ((wqkv, wo, wgu, wd), (k, v)) in layers.iter().zip(&kv) {
            let qkv = x.matmul(wqkv)?;
            let a = if matmul_only {
                qkv.narrow(1, 0, HIDDEN)?.contiguous()?
            } else {
                let q = qkv
                    .narrow(1, 0, HIDDEN)?
                    .contiguous()?
                    .reshape((CHUNK, HEADS, HEAD_DIM))?;
                paged_attention_prefill(&q, k, v, table, &piece, scale)?.reshape((CHUNK, HIDDEN))?
            };
            x = (x + a.matmul(wo)?)?;
            let gu = x.matmul(wgu)?;
            let h = (gu.narrow(1, 0, FFN)?.silu()? * gu.narrow(1, FFN, FFN)?)?;
            x = (x + h.matmul(wd)?)?;
        }
        Ok(())
    };
    step(false)?;
    let ours = median(3, || timed(device, 3, || step(false)).unwrap_or(f64::NAN));
    let matmuls = median(3, || timed(device, 3, || step(true)).unwrap_or(f64::NAN));
    let pairs: usize = (0..CHUNK).map(|i| CHUNK_START + i + 1).sum();
    let mm_flops = (2 * CHUNK * params) as f64;
    let attn_flops = (4 * HEADS * HEAD_DIM * pairs * LAYERS) as f64;
    println!(
        "prefill forward, 8B-shaped, {CHUNK} tokens at {CHUNK_START}..{}: {:.2} ms ({:.0} tokens/s, {:.0} TFLOP/s); its matmuls alone {:.2} ms ({:.0} TFLOP/s)",
        CHUNK_START + CHUNK,
        ours * 1e3,
        CHUNK as f64 / ours,
        (mm_flops + attn_flops) / ours / 1e12,
        matmuls * 1e3,
        mm_flops / matmuls / 1e12
    );
    Ok(())
}

/// The serving example's prefill attention: the context's blocks gathered, the scores
/// materialised in f32, masked, softmaxed, multiplied by the values.
fn gather_prefill(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    table: &Tensor,
    scale: f32,
) -> Result<Tensor, BoxError> {
    let rep = HEADS / KV_HEADS;
    let (len, ctx) = (CHUNK, CHUNK_START + CHUNK);
    let dev = q.device();
    let q = (q
        .reshape((len, KV_HEADS, rep, HEAD_DIM))?
        .permute((1, 2, 0, 3))?
        .contiguous()?
        .reshape((KV_HEADS, rep * len, HEAD_DIM))?
        * scale as f64)?;
    let gather = |c: &Tensor| -> Result<Tensor, BoxError> {
        Ok(c.index_select(&table.flatten_all()?, 0)?
            .reshape((ctx, KV_HEADS, HEAD_DIM))?
            .transpose(0, 1)?
            .contiguous()?)
    };
    let (k, v) = (gather(k)?, gather(v)?);
    let scores = q
        .matmul(&k.t()?)?
        .to_dtype(DType::F32)?
        .reshape((KV_HEADS, rep, len, ctx))?;
    let key = Tensor::arange(0u32, ctx as u32, dev)?.reshape((1, ctx))?;
    let query = Tensor::arange(CHUNK_START as u32, ctx as u32, dev)?.reshape((len, 1))?;
    let masked = key
        .broadcast_gt(&query)?
        .broadcast_as((KV_HEADS, rep, len, ctx))?;
    let neg = Tensor::new(f32::NEG_INFINITY, dev)?.broadcast_as((KV_HEADS, rep, len, ctx))?;
    let scores = masked.where_cond(&neg, &scores)?;
    // The engine's softmax is candle-nn's fused kernel; a build without candle-nn does it in
    // plain ops (slower: the bench prints which).
    #[cfg(feature = "candle-example")]
    let p = candle_nn::ops::softmax_last_dim(&scores)?;
    #[cfg(not(feature = "candle-example"))]
    let p = {
        let max = scores.max_keepdim(D::Minus1)?;
        let e = scores.broadcast_sub(&max)?.exp()?;
        e.broadcast_div(&e.sum_keepdim(D::Minus1)?)?
    };
    let p = p
        .to_dtype(DType::BF16)?
        .reshape((KV_HEADS, rep * len, ctx))?;
    Ok(p.matmul(&v)?
        .reshape((KV_HEADS, rep, len, HEAD_DIM))?
        .permute((2, 0, 1, 3))?
        .contiguous()?
        .reshape((len, HEADS, HEAD_DIM))?)
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
