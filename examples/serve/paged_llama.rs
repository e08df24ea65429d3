//! A Llama-shaped decoder of candle-nn pieces (RMS norm, rotary embeddings, grouped-query
//! attention, SwiGLU MLP) over a paged KV cache: per layer a K and a V tensor `[blocks,
//! block_tokens, kv_heads, head_dim]` ([`LayerCache`]: `PagedKvTensors` on the GPU, ordinary
//! tensors in the host test). Candle only, so a host check can include it by `#[path]`.
//!
//! A forward runs a batch of sequence pieces (a prefill's new tokens, or one token per sequence
//! of a decode step):
//! - the projections and the MLP are one batched matmul over every token of the forward;
//! - each token's K and V (after the rotary embedding) are written into its slot of its
//!   sequence's blocks (`scatter_set` on the layer's tensor viewed as `[blocks * block_tokens,
//!   kv_heads * head_dim]`: one kernel per layer for K and one for V, in place; only blocks the
//!   engine allocated are written);
//! - attention is per sequence: its blocks gathered by its block table (`index_select`, as
//!   `examples/paged_kv_attention.rs` checks bit for bit against a static cache), its queries
//!   against its whole context, causal within its new tokens; a piece after an earlier one of
//!   the same sequence reads it from the blocks;
//! - only each piece's last token goes through the final norm and the LM head.

use candle_core::{DType, Device, Module, Tensor};
use candle_nn::{Embedding, Init, Linear, VarBuilder};

/// Tokens per KV block (vLLM's default).
pub const BLOCK_TOKENS: usize = 16;
/// Most tokens in one forward of a prefill: longer contexts (recomputed ones) go in pieces,
/// which bounds the attention's `[heads, n, context]` scores.
pub const PREFILL_CHUNK: usize = 2048;
/// Positions the rotary tables cover (a longer context is an error naming it).
pub const MAX_POSITION: usize = 32768;

/// Where a forward finds layer `l`'s K and V tensors `[blocks, BLOCK_TOKENS, kv_heads,
/// head_dim]`, contiguous, written in place.
pub trait LayerCache {
    /// Layer `l`'s K and V.
    fn layer(&self, l: usize) -> candle_core::Result<(Tensor, Tensor)>;
}

fn kc_blocks(kv: &dyn LayerCache) -> candle_core::Result<usize> {
    kv.layer(0)?.0.dim(0)
}

/// A model's shape.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LlamaShape {
    /// Hidden size.
    pub hidden: usize,
    /// MLP size.
    pub intermediate: usize,
    /// Vocabulary.
    pub vocab: usize,
    /// Layers.
    pub layers: usize,
    /// Query heads.
    pub heads: usize,
    /// KV heads.
    pub kv_heads: usize,
    /// RMS norm epsilon.
    pub eps: f64,
    /// Rotary base.
    pub rope_theta: f64,
}

impl LlamaShape {
    /// Elements per head.
    pub fn head_dim(&self) -> usize {
        self.hidden / self.heads
    }
}

/// One decoder layer's weights.
struct Layer {
    attn_norm: Tensor,
    wq: Linear,
    wk: Linear,
    wv: Linear,
    wo: Linear,
    mlp_norm: Tensor,
    gate: Linear,
    up: Linear,
    down: Linear,
}

/// A Llama-shaped decoder over a paged KV cache.
pub struct PagedLlama {
    shape: LlamaShape,
    embed: Embedding,
    layers: Vec<Layer>,
    norm: Tensor,
    lm_head: Linear,
    /// Rotary tables `[MAX_POSITION, head_dim / 2]`.
    cos: Tensor,
    sin: Tensor,
}

/// A piece of a sequence in one forward: its block table, the position of its first new token
/// and how many new tokens.
pub struct Piece<'a> {
    /// Its block table.
    pub blocks: &'a [u32],
    /// Position of its first new token.
    pub start: usize,
    /// New tokens.
    pub len: usize,
}

fn rotary_tables(
    shape: &LlamaShape,
    dtype: DType,
    dev: &Device,
) -> candle_core::Result<(Tensor, Tensor)> {
    let half = shape.head_dim() / 2;
    let inv: Vec<f32> = (0..half)
        .map(|i| {
            1.0 / shape
                .rope_theta
                .powf(2.0 * i as f64 / shape.head_dim() as f64) as f32
        })
        .collect();
    let inv = Tensor::from_vec(inv, (1, half), &Device::Cpu)?;
    let pos = Tensor::arange(0u32, MAX_POSITION as u32, &Device::Cpu)?
        .to_dtype(DType::F32)?
        .reshape((MAX_POSITION, 1))?;
    let freqs = pos.broadcast_mul(&inv)?;
    let to = |t: Tensor| t.to_dtype(dtype)?.to_device(dev);
    Ok((to(freqs.cos()?)?, to(freqs.sin()?)?))
}

impl PagedLlama {
    /// Its weights from `vb` (random ones on the GPU), in `vb`'s dtype.
    pub fn load(shape: LlamaShape, vb: VarBuilder) -> candle_core::Result<Self> {
        let (h, hd) = (shape.hidden, shape.head_dim());
        let lin = |i: usize, o: usize, vb: VarBuilder| candle_nn::linear_no_bias(i, o, vb);
        let ones = |vb: VarBuilder| vb.get_with_hints(h, "weight", Init::Const(1.0));
        let mut layers = Vec::with_capacity(shape.layers);
        for l in 0..shape.layers {
            let vb = vb.pp(format!("layers.{l}"));
            layers.push(Layer {
                attn_norm: ones(vb.pp("input_layernorm"))?,
                wq: lin(h, shape.heads * hd, vb.pp("q_proj"))?,
                wk: lin(h, shape.kv_heads * hd, vb.pp("k_proj"))?,
                wv: lin(h, shape.kv_heads * hd, vb.pp("v_proj"))?,
                wo: lin(shape.heads * hd, h, vb.pp("o_proj"))?,
                mlp_norm: ones(vb.pp("post_attention_layernorm"))?,
                gate: lin(h, shape.intermediate, vb.pp("gate_proj"))?,
                up: lin(h, shape.intermediate, vb.pp("up_proj"))?,
                down: lin(shape.intermediate, h, vb.pp("down_proj"))?,
            });
        }
        let (cos, sin) = rotary_tables(&shape, vb.dtype(), vb.device())?;
        Ok(PagedLlama {
            shape,
            embed: candle_nn::embedding(shape.vocab, h, vb.pp("embed_tokens"))?,
            layers,
            norm: ones(vb.pp("norm"))?,
            lm_head: lin(h, shape.vocab, vb.pp("lm_head"))?,
            cos,
            sin,
        })
    }

    /// One forward over `pieces` (their new tokens written into their blocks, each attending
    /// to its whole context); logits of each piece's last token, `[pieces, vocab]`.
    pub fn forward(&self, kv: &dyn LayerCache, pieces: &[Piece]) -> candle_core::Result<Tensor> {
        let dev = self.cos.device().clone();
        let s = &self.shape;
        let (hd, kvd) = (s.head_dim(), s.kv_heads * s.head_dim());
        let bt = BLOCK_TOKENS;
        // Every token's position and its row in the cache (`block * block_tokens + slot`).
        let mut pos = Vec::new();
        let mut rows = Vec::new();
        let mut last = Vec::with_capacity(pieces.len());
        for p in pieces {
            if p.len == 0 {
                candle_core::bail!("a step piece with no new tokens");
            }
            let end = p.start + p.len;
            if end > MAX_POSITION || end.div_ceil(bt) > p.blocks.len() {
                candle_core::bail!(
                    "a context of {end} tokens: {} blocks of {bt} held, {MAX_POSITION} positions at most",
                    p.blocks.len()
                );
            }
            for t in p.start..end {
                pos.push(t as u32);
                rows.push(p.blocks[t / bt] * bt as u32 + (t % bt) as u32);
            }
            last.push((pos.len() - 1) as u32);
        }
        let n = pos.len();
        let pos = Tensor::new(pos.as_slice(), &dev)?;
        let cos = self.cos.index_select(&pos, 0)?.reshape((n, 1, hd / 2))?;
        let sin = self.sin.index_select(&pos, 0)?.reshape((n, 1, hd / 2))?;
        let rows = Tensor::new(rows.as_slice(), &dev)?
            .reshape((n, 1))?
            .broadcast_as((n, kvd))?
            .contiguous()?;
        let tables: Vec<Tensor> = pieces
            .iter()
            .map(|p| Tensor::new(&p.blocks[..(p.start + p.len).div_ceil(bt)], &dev))
            .collect::<candle_core::Result<_>>()?;
        let rope = |x: &Tensor, heads: usize| -> candle_core::Result<Tensor> {
            // Each token its own batch row: `[n, heads, 1, head_dim]` against `[n, 1, hd/2]`.
            candle_nn::rotary_emb::rope(&x.reshape((n, heads, 1, hd))?, &cos, &sin)?
                .reshape((n, heads * hd))
        };
        let max_blocks = kc_blocks(kv)?;
        let mut x = self.embed.forward(&Tensor::zeros(n, DType::U32, &dev)?)?;
        for (l, w) in self.layers.iter().enumerate() {
            let h = candle_nn::ops::rms_norm(&x, &w.attn_norm, s.eps as f32)?;
            let q = rope(&w.wq.forward(&h)?, s.heads)?;
            let k = rope(&w.wk.forward(&h)?, s.kv_heads)?;
            let v = w.wv.forward(&h)?.contiguous()?;
            let (kc, vc) = kv.layer(l)?;
            // The new tokens' K and V into their slots, in place (blocks the engine allocated).
            kc.reshape((max_blocks * bt, kvd))?
                .scatter_set(&rows, &k, 0)?;
            vc.reshape((max_blocks * bt, kvd))?
                .scatter_set(&rows, &v, 0)?;
            let mut outs = Vec::with_capacity(pieces.len());
            let mut off = 0;
            for (p, table) in pieces.iter().zip(&tables) {
                let q = q.narrow(0, off, p.len)?;
                off += p.len;
                outs.push(attend(s, &q, &kc, &vc, table, p.start, p.len)?);
            }
            let a = Tensor::cat(&outs, 0)?;
            x = (x + w.wo.forward(&a)?)?;
            let h = candle_nn::ops::rms_norm(&x, &w.mlp_norm, s.eps as f32)?;
            let m = (candle_nn::ops::silu(&w.gate.forward(&h)?)? * w.up.forward(&h)?)?;
            x = (x + w.down.forward(&m)?)?;
        }
        let x = x.index_select(&Tensor::new(last.as_slice(), &dev)?, 0)?;
        let x = candle_nn::ops::rms_norm(&x, &self.norm, s.eps as f32)?;
        self.lm_head.forward(&x)
    }
}

/// Attention of one sequence's `len` new queries `q` `[len, heads * head_dim]` (positions
/// `start..start + len`) over its context `0..start + len`, read from its blocks (`table`) of
/// the layer's cache tensors `[blocks, block_tokens, kv_heads, head_dim]`. Returns
/// `[len, heads * head_dim]`.
fn attend(
    s: &LlamaShape,
    q: &Tensor,
    kc: &Tensor,
    vc: &Tensor,
    table: &Tensor,
    start: usize,
    len: usize,
) -> candle_core::Result<Tensor> {
    let (hd, kvh) = (s.head_dim(), s.kv_heads);
    let rep = s.heads / kvh;
    let ctx = start + len;
    let nb = table.dim(0)?;
    // [len, kvh, rep, hd] -> [kvh, rep * len, hd]
    let q = q
        .reshape((len, kvh, rep, hd))?
        .permute((1, 2, 0, 3))?
        .contiguous()?
        .reshape((kvh, rep * len, hd))?;
    let gather = |c: &Tensor| -> candle_core::Result<Tensor> {
        // [nb, bt, kvh, hd] -> [ctx, kvh, hd] -> [kvh, ctx, hd]
        c.index_select(table, 0)?
            .reshape((nb * BLOCK_TOKENS, kvh, hd))?
            .narrow(0, 0, ctx)?
            .transpose(0, 1)?
            .contiguous()
    };
    let (k, v) = (gather(kc)?, gather(vc)?);
    let scores = q
        .matmul(&k.t()?)?
        .to_dtype(DType::F32)?
        .affine(1.0 / (hd as f64).sqrt(), 0.0)?
        .reshape((kvh, rep, len, ctx))?;
    let scores = if len > 1 {
        // Query i (position start + i) sees keys 0..=start + i.
        let dev = q.device();
        let key = Tensor::arange(0u32, ctx as u32, dev)?.reshape((1, ctx))?;
        let query = Tensor::arange(start as u32, ctx as u32, dev)?.reshape((len, 1))?;
        let masked = key
            .broadcast_gt(&query)?
            .broadcast_as((kvh, rep, len, ctx))?;
        let neg = Tensor::new(f32::NEG_INFINITY, dev)?.broadcast_as((kvh, rep, len, ctx))?;
        masked.where_cond(&neg, &scores)?
    } else {
        scores
    };
    let p = candle_nn::ops::softmax_last_dim(&scores)?
        .to_dtype(q.dtype())?
        .reshape((kvh, rep * len, ctx))?;
    // [kvh, rep * len, hd] -> [len, kvh, rep, hd] -> [len, heads * hd]
    p.matmul(&v)?
        .reshape((kvh, rep, len, hd))?
        .permute((2, 0, 1, 3))?
        .contiguous()?
        .reshape((len, s.heads * hd))
}
