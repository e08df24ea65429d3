//! A Llama-shaped decoder of candle-nn pieces (RMS norm, rotary embeddings, grouped-query
//! attention, SwiGLU MLP) over a paged KV cache: per layer a K and a V tensor, `[blocks,
//! block_tokens, kv_heads, head_dim]` or another block order the cache reads and writes itself
//! ([`LayerCache`]: `PagedKvTensors` on the GPU, ordinary tensors in the host test). Candle only, so a host check can include it by `#[path]`.
//!
//! Checked on the CPU by its unit tests (ordinary tensors as the cache, f32): `cargo test
//! --features candle-example --example serve paged_llama` where that links (the CUDA toolchain);
//! anywhere else, a crate on candle-core/candle-nn 0.11 without CUDA that includes this file by
//! `#[path]` runs them.
//!
//! A forward runs a batch of sequence pieces (a prefill's new tokens, or one token per sequence
//! of a decode step):
//! - the projections and the MLP are one batched matmul over every token of the forward;
//! - each token's K and V (after the rotary embedding) are written into its slot of its
//!   sequence's blocks, in place, only blocks the engine allocated: by the cache's own write
//!   where it has one ([`LayerCache::write`]: the crate's write kernel on the GPU, in any block
//!   order), else by `scatter_set` on the layer's tensor viewed as `[blocks * block_tokens,
//!   kv_heads * head_dim]` (the CPU path);
//! - a decode step (one token per piece) attends in one batch through the block tables
//!   (padded to the longest with the sequence's own last block, keys past its length masked):
//!   in place by the cache's kernel where it has one ([`LayerCache::decode_attention`]: the
//!   crate's paged-attention op on the GPU), else by gathering each sequence's blocks
//!   (`index_select`, as `examples/paged_kv_attention.rs` checks bit for bit against a static
//!   cache; the CPU path, and the reference `serve probe` checks the kernel against);
//! - a prefill attends causally through the block tables in place, in one batch, where the
//!   cache has a kernel ([`LayerCache::prefill_attention`]: the crate's prefill op on the GPU);
//!   else per piece: a piece from position 0 over its own K and V as computed, a later piece of
//!   a sequence over its blocks, gathered (the CPU path and the reference);
//! - only each piece's last token goes through the final norm and the LM head.

use candle_core::{DType, Device, Module, Tensor};
use candle_nn::{Embedding, Init, Linear, VarBuilder};

/// Tokens per KV block (vLLM's default).
pub const BLOCK_TOKENS: usize = 16;
/// Positions the rotary tables cover (a longer context is an error naming it).
pub const MAX_POSITION: usize = 32768;

/// Where a forward finds layer `l`'s K and V tensors, contiguous, written in place: `[blocks,
/// BLOCK_TOKENS, kv_heads, head_dim]`, or blocks in another order where the cache writes them
/// ([`LayerCache::write`]), reads them in its kernels and turns them token-major for the gather
/// paths ([`LayerCache::token_major`]).
pub trait LayerCache {
    /// Layer `l`'s K and V.
    fn layer(&self, l: usize) -> candle_core::Result<(Tensor, Tensor)>;

    /// A decode batch's attention read in place through the block tables, where the cache has
    /// a kernel for it (the GPU's paged-attention op): `q` `[batch, heads, head_dim]`, `table`
    /// `[batch, width]` u32, `lens` `[batch]` u32 (each sequence's context), `max_context` the
    /// longest. `None` where it has none: the forward gathers the blocks instead.
    #[allow(clippy::too_many_arguments)]
    fn decode_attention(
        &self,
        _q: &Tensor,
        _k: &Tensor,
        _v: &Tensor,
        _table: &Tensor,
        _lens: &Tensor,
        _max_context: usize,
        _scale: f32,
    ) -> Option<candle_core::Result<Tensor>> {
        None
    }

    /// A prefill batch's attention read in place through the block tables, causal, where the
    /// cache has a kernel for it (the GPU's paged-attention prefill op): `q` `[tokens, heads,
    /// head_dim]` (every piece's new tokens, piece after piece, their K and V already
    /// written), `table` `[pieces, width]` u32, `spans` each piece's (start, len). `None` where
    /// it has none: the forward gathers each piece's blocks instead.
    fn prefill_attention(
        &self,
        _q: &Tensor,
        _k: &Tensor,
        _v: &Tensor,
        _table: &Tensor,
        _spans: &[(usize, usize)],
        _scale: f32,
    ) -> Option<candle_core::Result<Tensor>> {
        None
    }

    /// The forward's new tokens' K and V (`[tokens, kv_heads * head_dim]`) into their slots
    /// (`slots` `[tokens]` u32, `block * block_tokens + offset`) of layer tensors `kc`, `vc`,
    /// where the cache has a write of its own (a kernel for its block order). `None` where it
    /// has none: the forward scatters into token-major tensors.
    fn write(
        &self,
        _kc: &Tensor,
        _vc: &Tensor,
        _k: &Tensor,
        _v: &Tensor,
        _slots: &Tensor,
    ) -> Option<candle_core::Result<()>> {
        None
    }

    /// Blocks read from a layer's K (`kv` 0) or V tensor by `index_select` (`[n, ..]` in the
    /// cache's block order) as token-major `[n, block_tokens, kv_heads, head_dim]`, for the
    /// gather paths. As they are by default (token-major caches).
    fn token_major(&self, blocks: Tensor, _kv: usize) -> candle_core::Result<Tensor> {
        Ok(blocks)
    }
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

impl PagedLlama {
    /// A fingerprint of the weights: sums of squares (in f32) of the first and last 64 rows
    /// of the embedding, the LM head, the rotary tables and the first and last layers'
    /// attention and MLP weights, and of the norms; equal before a sleep and after the wake
    /// when the bytes came back. Samples, small enough for the activations' reserve.
    pub fn fingerprint(&self) -> candle_core::Result<Vec<f32>> {
        let mut parts = vec![
            self.embed.embeddings().clone(),
            self.lm_head.weight().clone(),
            self.norm.clone(),
            self.cos.clone(),
            self.sin.clone(),
        ];
        for l in [self.layers.first(), self.layers.last()]
            .into_iter()
            .flatten()
        {
            parts.extend([
                l.attn_norm.clone(),
                l.wq.weight().clone(),
                l.wo.weight().clone(),
                l.down.weight().clone(),
            ]);
        }
        let mut sums = Vec::with_capacity(2 * parts.len());
        for t in &parts {
            let rows = t.dim(0)?;
            let n = rows.min(64);
            for at in [0, rows - n] {
                let s = t.narrow(0, at, n)?.to_dtype(DType::F32)?.sqr()?.sum_all()?;
                sums.push(s.to_scalar::<f32>()?);
            }
        }
        Ok(sums)
    }
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
    pub fn forward<'a>(
        &self,
        kv: &dyn LayerCache,
        pieces: &[Piece<'a>],
    ) -> candle_core::Result<Tensor> {
        self.forward_layers(kv, pieces, self.layers.len())
    }

    /// Its shape.
    pub fn shape(&self) -> &LlamaShape {
        &self.shape
    }

    /// [`PagedLlama::forward`] through the first `depth` layers only (then the final norm and
    /// the LM head): how a difference between two attention paths grows with depth.
    pub fn forward_layers<'a>(
        &self,
        kv: &dyn LayerCache,
        pieces: &[Piece<'a>],
        depth: usize,
    ) -> candle_core::Result<Tensor> {
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
        let pos_host = pos;
        let pos = Tensor::new(pos_host.as_slice(), &dev)?;
        let cos = self.cos.index_select(&pos, 0)?.reshape((n, 1, hd / 2))?;
        let sin = self.sin.index_select(&pos, 0)?.reshape((n, 1, hd / 2))?;
        let slots = Tensor::new(rows.as_slice(), &dev)?;
        // The slots as scatter indices `[tokens, kv_heads * head_dim]`, made at the first layer
        // whose cache has no write of its own.
        let mut rows: Option<Tensor> = None;
        let held = |p: &Piece<'a>| &p.blocks[..(p.start + p.len).div_ceil(bt)];
        // Every piece's block table padded to the longest with its own last block: a kernel
        // reads the padding only past a piece's context (masked out in a decode, never read in
        // a prefill).
        let nb = pieces.iter().map(|p| held(p).len()).max().unwrap_or(1);
        let mut padded = Vec::with_capacity(pieces.len() * nb);
        for p in pieces {
            let h = held(p);
            padded.extend_from_slice(h);
            padded.extend(std::iter::repeat_n(h[h.len() - 1], nb - h.len()));
        }
        // A decode step (one token per piece) attends in one batch; a prefill in one batch by
        // the cache's kernel, else per piece.
        let decode = if pieces.iter().all(|p| p.len == 1) {
            let lens: Vec<u32> = pieces.iter().map(|p| (p.start + 1) as u32).collect();
            Some((
                Tensor::new(padded.as_slice(), &dev)?,
                Tensor::new(lens.as_slice(), &dev)?,
                nb,
                lens.iter().copied().max().unwrap_or(1) as usize,
            ))
        } else {
            None
        };
        let tables: Vec<Tensor> = if decode.is_some() {
            Vec::new()
        } else {
            pieces
                .iter()
                .map(|p| Tensor::new(held(p), &dev))
                .collect::<candle_core::Result<_>>()?
        };
        let spans: Vec<(usize, usize)> = pieces.iter().map(|p| (p.start, p.len)).collect();
        let prefill_table = if decode.is_some() {
            None
        } else {
            Some(Tensor::from_vec(padded, (pieces.len(), nb), &dev)?)
        };
        let rope = |x: &Tensor, heads: usize| -> candle_core::Result<Tensor> {
            // Each token its own batch row: `[n, heads, 1, head_dim]` against `[n, 1, hd/2]`.
            candle_nn::rotary_emb::rope(&x.reshape((n, heads, 1, hd))?, &cos, &sin)?
                .reshape((n, heads * hd))
        };
        let max_blocks = kc_blocks(kv)?;
        // Tokens stand in as `position % vocab`: distinct tokens, so every position's K and V
        // differ (identical ones would make attention's output independent of its weights).
        let ids: Vec<u32> = (0..n)
            .map(|i| ((pos_host[i] as usize) % s.vocab) as u32)
            .collect();
        let mut x = self.embed.forward(&Tensor::new(ids.as_slice(), &dev)?)?;
        for (l, w) in self.layers.iter().enumerate().take(depth) {
            let h = candle_nn::ops::rms_norm(&x, &w.attn_norm, s.eps as f32)?;
            let q = rope(&w.wq.forward(&h)?, s.heads)?;
            let k = rope(&w.wk.forward(&h)?, s.kv_heads)?;
            let v = w.wv.forward(&h)?.contiguous()?;
            let (kc, vc) = kv.layer(l)?;
            // The new tokens' K and V into their slots, in place (blocks the engine allocated).
            match kv.write(&kc, &vc, &k, &v, &slots) {
                Some(r) => r?,
                None => {
                    let rows = match &rows {
                        Some(r) => r,
                        None => rows.insert(
                            slots
                                .reshape((n, 1))?
                                .broadcast_as((n, kvd))?
                                .contiguous()?,
                        ),
                    };
                    kc.reshape((max_blocks * bt, kvd))?
                        .scatter_set(rows, &k, 0)?;
                    vc.reshape((max_blocks * bt, kvd))?
                        .scatter_set(rows, &v, 0)?;
                }
            }
            let a = match &decode {
                Some((table, lens, nb, longest)) => {
                    let b = pieces.len();
                    let scale = 1.0 / (hd as f32).sqrt();
                    let q3 = q.reshape((b, s.heads, hd))?;
                    let table2 = table.reshape((b, *nb))?;
                    match kv.decode_attention(&q3, &kc, &vc, &table2, lens, *longest, scale) {
                        Some(a) => a?.reshape((b, s.heads * hd))?,
                        None => attend_decode(s, kv, &q, &kc, &vc, table, lens, *nb)?,
                    }
                }
                None => {
                    let scale = 1.0 / (hd as f32).sqrt();
                    let q3 = q.reshape((n, s.heads, hd))?;
                    let Some(table) = prefill_table.as_ref() else {
                        candle_core::bail!("a prefill without its tables");
                    };
                    match kv.prefill_attention(&q3, &kc, &vc, table, &spans, scale) {
                        Some(a) => a?.reshape((n, s.heads * hd))?,
                        None => attend_pieces(s, kv, pieces, &tables, &q, &k, &v, &kc, &vc)?,
                    }
                }
            };
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

/// A prefill's attention by gather, piece by piece: `q`, `k`, `v` `[tokens, ..]` the forward's
/// new tokens, `kc`, `vc` the layer's cache tensors, `tables` each piece's blocks.
#[allow(clippy::too_many_arguments)]
fn attend_pieces(
    s: &LlamaShape,
    kv: &dyn LayerCache,
    pieces: &[Piece],
    tables: &[Tensor],
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    kc: &Tensor,
    vc: &Tensor,
) -> candle_core::Result<Tensor> {
    let mut outs = Vec::with_capacity(pieces.len());
    let mut off = 0;
    for (p, table) in pieces.iter().zip(tables) {
        let q = q.narrow(0, off, p.len)?;
        // A piece from position 0 has no context but its own tokens: their K and V as
        // computed (what was just written), no gather.
        let src = if p.start == 0 {
            Context::Own(k.narrow(0, off, p.len)?, v.narrow(0, off, p.len)?)
        } else {
            Context::Blocks(kv, kc, vc, table)
        };
        off += p.len;
        outs.push(attend(s, &q, src, p.start, p.len)?);
    }
    Tensor::cat(&outs, 0)
}

impl PagedLlama {
    /// A chunked prefill: each piece's new tokens cut into chunks of at most `chunk` tokens,
    /// packed in order into forwards of at most `chunk` tokens (a sequence's later chunk goes
    /// in a later forward and reads the earlier ones from the blocks). Bounds every forward's
    /// activations by the chunk. Returns each forward's logits (`[pieces in it, vocab]`).
    pub fn prefill_chunked(
        &self,
        kv: &dyn LayerCache,
        pieces: &[Piece],
        chunk: usize,
    ) -> candle_core::Result<Vec<Tensor>> {
        if chunk == 0 {
            candle_core::bail!("a prefill chunk of 0 tokens");
        }
        let mut out = Vec::new();
        let mut batch: Vec<Piece> = Vec::new();
        let mut tokens = 0;
        for p in pieces {
            let end = p.start + p.len;
            let mut at = p.start;
            while at < end {
                let len = (end - at).min(chunk);
                if tokens + len > chunk && !batch.is_empty() {
                    out.push(self.forward(kv, &batch)?);
                    batch.clear();
                    tokens = 0;
                }
                tokens += len;
                batch.push(Piece {
                    blocks: p.blocks,
                    start: at,
                    len,
                });
                at += len;
            }
        }
        if !batch.is_empty() {
            out.push(self.forward(kv, &batch)?);
        }
        Ok(out)
    }
}

/// Where a prefill piece's context is.
enum Context<'a> {
    /// Only its own new tokens (it starts at position 0): their K and V `[len, kv_heads *
    /// head_dim]`.
    Own(Tensor, Tensor),
    /// Its blocks (`table`) of the layer's cache tensors, K and V, read as token-major by the
    /// cache.
    Blocks(&'a dyn LayerCache, &'a Tensor, &'a Tensor, &'a Tensor),
}

/// Attention of one sequence's `len` new queries `q` `[len, heads * head_dim]` (positions
/// `start..start + len`) over its context `0..start + len`. Returns `[len, heads * head_dim]`.
fn attend(
    s: &LlamaShape,
    q: &Tensor,
    context: Context,
    start: usize,
    len: usize,
) -> candle_core::Result<Tensor> {
    let (hd, kvh) = (s.head_dim(), s.kv_heads);
    let rep = s.heads / kvh;
    let ctx = start + len;
    // [len, kvh, rep, hd] -> [kvh, rep * len, hd], scaled here (len rows) rather than the
    // scores (len x ctx, a pass of f32 fewer). In bf16 that rounds q once more and the scale
    // to bf16 (1/sqrt(128) by about 1e-4 relative); decode scales in f32.
    let q = (q
        .reshape((len, kvh, rep, hd))?
        .permute((1, 2, 0, 3))?
        .contiguous()?
        .reshape((kvh, rep * len, hd))?
        * (1.0 / (hd as f64).sqrt()))?;
    let (k, v) = match context {
        Context::Own(k, v) => {
            // [len, kvh * hd] -> [kvh, len, hd]
            let own = |c: Tensor| c.reshape((len, kvh, hd))?.transpose(0, 1)?.contiguous();
            (own(k)?, own(v)?)
        }
        Context::Blocks(cache, kc, vc, table) => {
            let nb = table.dim(0)?;
            let gather = |c: &Tensor, kv: usize| -> candle_core::Result<Tensor> {
                // [nb, bt, kvh, hd] -> [ctx, kvh, hd] -> [kvh, ctx, hd]
                cache
                    .token_major(c.index_select(table, 0)?, kv)?
                    .reshape((nb * BLOCK_TOKENS, kvh, hd))?
                    .narrow(0, 0, ctx)?
                    .transpose(0, 1)?
                    .contiguous()
            };
            (gather(kc, 0)?, gather(vc, 1)?)
        }
    };
    let scores = q
        .matmul(&k.t()?)?
        .to_dtype(DType::F32)?
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

/// Attention of a decode batch: query `b` `q[b]` (`[batch, heads * head_dim]`) over the first
/// `lens[b]` tokens of its `nb` blocks, `table` `[batch * nb]` (padded). Returns `[batch, heads
/// * head_dim]`.
#[allow(clippy::too_many_arguments)]
fn attend_decode(
    s: &LlamaShape,
    kv: &dyn LayerCache,
    q: &Tensor,
    kc: &Tensor,
    vc: &Tensor,
    table: &Tensor,
    lens: &Tensor,
    nb: usize,
) -> candle_core::Result<Tensor> {
    let (hd, kvh) = (s.head_dim(), s.kv_heads);
    let rep = s.heads / kvh;
    let b = q.dim(0)?;
    let l = nb * BLOCK_TOKENS;
    let q = q.reshape((b, kvh, rep, hd))?;
    let gather = |c: &Tensor, which: usize| -> candle_core::Result<Tensor> {
        // [b * nb, bt, kvh, hd] -> [b, l, kvh, hd] -> [b, kvh, l, hd]
        kv.token_major(c.index_select(table, 0)?, which)?
            .reshape((b, l, kvh, hd))?
            .transpose(1, 2)?
            .contiguous()
    };
    let (k, v) = (gather(kc, 0)?, gather(vc, 1)?);
    let scores = q
        .matmul(&k.t()?)?
        .to_dtype(DType::F32)?
        .affine(1.0 / (hd as f64).sqrt(), 0.0)?;
    // Keys at or past a sequence's length (padding, the rest of its last block) masked out.
    let dev = q.device();
    let key = Tensor::arange(0u32, l as u32, dev)?.reshape((1, l))?;
    let masked = key
        .broadcast_ge(&lens.reshape((b, 1))?)?
        .reshape((b, 1, 1, l))?
        .broadcast_as((b, kvh, rep, l))?;
    let neg = Tensor::new(f32::NEG_INFINITY, dev)?.broadcast_as((b, kvh, rep, l))?;
    let p = candle_nn::ops::softmax_last_dim(&masked.where_cond(&neg, &scores)?)?
        .to_dtype(q.dtype())?;
    // [b, kvh, rep, l] x [b, kvh, l, hd] -> [b, kvh, rep, hd]
    p.matmul(&v)?.reshape((b, s.heads * hd))
}

#[cfg(test)]
mod tests {
    //! On the CPU with ordinary tensors as the cache (f32): a decode over the blocks gives the
    //! logits a whole prefill of the same context gives; batching and chunking change nothing;
    //! only the sequences' own blocks are written.
    use super::*;
    use candle_nn::VarMap;

    const BLOCKS: usize = 32;

    fn shape() -> LlamaShape {
        LlamaShape {
            hidden: 64,
            intermediate: 128,
            vocab: 50,
            layers: 2,
            heads: 4,
            kv_heads: 2,
            eps: 1e-5,
            rope_theta: 10_000.0,
        }
    }

    struct Cache(Vec<(Tensor, Tensor)>);

    impl Cache {
        fn new(s: &LlamaShape) -> Cache {
            let z = || {
                Tensor::zeros(
                    (BLOCKS, BLOCK_TOKENS, s.kv_heads, s.head_dim()),
                    DType::F32,
                    &Device::Cpu,
                )
                .unwrap()
            };
            Cache((0..s.layers).map(|_| (z(), z())).collect())
        }
        /// Sum of |x| over block `b` of every tensor.
        fn mass(&self, b: usize) -> f32 {
            self.0
                .iter()
                .flat_map(|(k, v)| [k, v])
                .map(|t| {
                    t.narrow(0, b, 1)
                        .unwrap()
                        .abs()
                        .unwrap()
                        .sum_all()
                        .unwrap()
                        .to_scalar::<f32>()
                        .unwrap()
                })
                .sum()
        }
    }

    impl LayerCache for Cache {
        fn layer(&self, l: usize) -> candle_core::Result<(Tensor, Tensor)> {
            Ok(self.0[l].clone())
        }
    }

    /// The cache with a decode kernel of its own, as the GPU's is: each sequence's K and V
    /// read through its row of the `[batch, width]` table, the first `lens[b]` tokens, per
    /// query head over its KV head, in plain ops; counts its calls.
    struct Hooked(Cache, std::cell::Cell<usize>);

    impl LayerCache for Hooked {
        fn layer(&self, l: usize) -> candle_core::Result<(Tensor, Tensor)> {
            self.0.layer(l)
        }

        fn decode_attention(
            &self,
            q: &Tensor,
            k: &Tensor,
            v: &Tensor,
            table: &Tensor,
            lens: &Tensor,
            max_context: usize,
            scale: f32,
        ) -> Option<candle_core::Result<Tensor>> {
            self.1.set(self.1.get() + 1);
            let run = || -> candle_core::Result<Tensor> {
                let (b, heads, hd) = q.dims3()?;
                let kvh = k.dim(2)?;
                let lens = lens.to_vec1::<u32>()?;
                assert_eq!(lens.len(), b, "a length per sequence");
                assert_eq!(
                    lens.iter().copied().max().unwrap_or(0) as usize,
                    max_context,
                    "max_context is the longest length"
                );
                let mut outs = Vec::with_capacity(b);
                for (i, &len) in lens.iter().enumerate() {
                    let row = table.get(i)?;
                    let read = |c: &Tensor| -> candle_core::Result<Tensor> {
                        let n = row.dim(0)?;
                        c.index_select(&row, 0)?
                            .reshape((n * BLOCK_TOKENS, kvh, hd))?
                            .narrow(0, 0, len as usize)
                    };
                    let (ks, vs) = (read(k)?, read(v)?);
                    let mut per_head = Vec::with_capacity(heads);
                    for h in 0..heads {
                        let g = h / (heads / kvh);
                        let qh = q.get(i)?.get(h)?.reshape((1, hd))?;
                        let kh = ks.narrow(1, g, 1)?.reshape((len as usize, hd))?;
                        let vh = vs.narrow(1, g, 1)?.reshape((len as usize, hd))?;
                        let p = candle_nn::ops::softmax_last_dim(
                            &(qh.matmul(&kh.t()?)? * scale as f64)?,
                        )?;
                        per_head.push(p.matmul(&vh)?.reshape(hd)?);
                    }
                    outs.push(Tensor::stack(&per_head, 0)?);
                }
                Tensor::stack(&outs, 0)
            };
            Some(run())
        }
    }

    /// The cache in head-major order, `[blocks, kv_heads, block_tokens, head_dim]`, written
    /// and turned token-major by its own hooks (as the GPU's cache in another engine's order
    /// is by the crate's kernels); counts its writes.
    struct HeadMajor(Vec<(Tensor, Tensor)>, std::cell::Cell<usize>);

    impl HeadMajor {
        fn new(s: &LlamaShape) -> HeadMajor {
            let z = || {
                Tensor::zeros(
                    (BLOCKS, s.kv_heads, BLOCK_TOKENS, s.head_dim()),
                    DType::F32,
                    &Device::Cpu,
                )
                .unwrap()
            };
            HeadMajor(
                (0..s.layers).map(|_| (z(), z())).collect(),
                Default::default(),
            )
        }
    }

    impl LayerCache for HeadMajor {
        fn layer(&self, l: usize) -> candle_core::Result<(Tensor, Tensor)> {
            Ok(self.0[l].clone())
        }

        fn write(
            &self,
            kc: &Tensor,
            vc: &Tensor,
            k: &Tensor,
            v: &Tensor,
            slots: &Tensor,
        ) -> Option<candle_core::Result<()>> {
            self.1.set(self.1.get() + 1);
            let run = || -> candle_core::Result<()> {
                let (blocks, kvh, bt, hd) = kc.dims4()?;
                for (i, &slot) in slots.to_vec1::<u32>()?.iter().enumerate() {
                    let (b, o) = (slot as usize / bt, slot as usize % bt);
                    for (c, x) in [(kc, k), (vc, v)] {
                        let rows = c.reshape((blocks * kvh * bt, hd))?;
                        let token = x.get(i)?.reshape((kvh, hd))?;
                        for h in 0..kvh {
                            rows.slice_set(&token.narrow(0, h, 1)?, 0, (b * kvh + h) * bt + o)?;
                        }
                    }
                }
                Ok(())
            };
            Some(run())
        }

        fn token_major(&self, blocks: Tensor, _kv: usize) -> candle_core::Result<Tensor> {
            blocks.permute((0, 2, 1, 3))?.contiguous()
        }
    }

    /// A cache in another block order, written and read through its hooks, gives the logits
    /// of the token-major cache: a prefill from position 0, a later chunk over the blocks and
    /// decode steps, batched; the forward never scatters into it (every layer's write goes
    /// through the hook).
    #[test]
    fn a_cache_in_another_block_order_gives_the_same_logits() {
        let m = model();
        let s = shape();
        let tables: [&[u32]; 2] = [&[7, 2, 19], &[4, 30]];
        let prompts = [40usize, 21];
        let (plain, other) = (Cache::new(&s), HeadMajor::new(&s));
        let run = |c: &dyn LayerCache| {
            let mut out = Vec::new();
            let pieces: Vec<Piece> = tables
                .iter()
                .zip(&prompts)
                .map(|(t, &n)| Piece {
                    blocks: t,
                    start: 0,
                    len: n,
                })
                .collect();
            out.extend(rows(&m.forward(c, &pieces).unwrap()));
            // A second chunk of each prompt: a prefill over the blocks (gathered through the
            // cache's order), then decode steps.
            let chunk: Vec<Piece> = tables
                .iter()
                .zip(&prompts)
                .map(|(t, &n)| Piece {
                    blocks: t,
                    start: n,
                    len: 5,
                })
                .collect();
            out.extend(rows(&m.forward(c, &chunk).unwrap()));
            for step in 0..3 {
                let pieces: Vec<Piece> = tables
                    .iter()
                    .zip(&prompts)
                    .map(|(t, &n)| Piece {
                        blocks: t,
                        start: n + 5 + step,
                        len: 1,
                    })
                    .collect();
                out.extend(rows(&m.forward(c, &pieces).unwrap()));
            }
            out
        };
        let (want, got) = (run(&plain), run(&other));
        assert_eq!(
            other.1.get(),
            5 * s.layers,
            "every layer's write through the hook"
        );
        for (i, (w, g)) in want.iter().zip(&got).enumerate() {
            close(g, w, &format!("row {i}"));
        }
    }

    fn model() -> PagedLlama {
        let vm = VarMap::new();
        let vb = VarBuilder::from_varmap(&vm, DType::F32, &Device::Cpu);
        PagedLlama::load(shape(), vb).unwrap()
    }

    fn rows(t: &Tensor) -> Vec<Vec<f32>> {
        t.to_vec2::<f32>().unwrap()
    }

    fn close(a: &[f32], b: &[f32], what: &str) {
        let scale = a.iter().fold(1e-3f32, |m, x| m.max(x.abs()));
        for (i, (x, y)) in a.iter().zip(b).enumerate() {
            assert!(
                (x - y).abs() <= 1e-4 * scale,
                "{what}: logit {i}: {x} vs {y} (scale {scale})"
            );
        }
    }

    /// Prefill `prompt` tokens then decode `steps` one by one: the logits of each step.
    fn incremental(
        m: &PagedLlama,
        cache: &Cache,
        blocks: &[u32],
        prompt: usize,
        steps: usize,
    ) -> Vec<Vec<f32>> {
        let mut out = Vec::new();
        let p = Piece {
            blocks,
            start: 0,
            len: prompt,
        };
        out.push(rows(&m.forward(cache, &[p]).unwrap()).remove(0));
        for t in prompt..prompt + steps {
            let p = Piece {
                blocks,
                start: t,
                len: 1,
            };
            out.push(rows(&m.forward(cache, &[p]).unwrap()).remove(0));
        }
        out
    }

    /// Through every layer `forward_layers` is `forward`; through fewer it is another model.
    #[test]
    fn forward_through_fewer_layers_stops_early() {
        let m = model();
        let s = shape();
        let p = || Piece {
            blocks: &[3, 5],
            start: 0,
            len: 20,
        };
        let whole = rows(&m.forward(&Cache::new(&s), &[p()]).unwrap());
        let all = rows(&m.forward_layers(&Cache::new(&s), &[p()], s.layers).unwrap());
        assert_eq!(whole, all);
        let one = rows(&m.forward_layers(&Cache::new(&s), &[p()], 1).unwrap());
        assert_ne!(whole, one);
    }

    /// The weights' fingerprint is stable, and a changed sampled row changes it.
    #[test]
    fn the_fingerprint_sees_a_changed_weight() {
        let vm = VarMap::new();
        let vb = VarBuilder::from_varmap(&vm, DType::F32, &Device::Cpu);
        let m = PagedLlama::load(shape(), vb).unwrap();
        let first = m.fingerprint().unwrap();
        assert_eq!(first.len(), 2 * (5 + 2 * 4));
        assert!(first.iter().all(|x| x.is_finite()));
        assert_eq!(m.fingerprint().unwrap(), first);
        // Zero the embedding's rows in place (the VarMap's variable is the model's tensor).
        let data = vm.data().lock().unwrap();
        let embed = data
            .iter()
            .find(|(name, _)| name.contains("embed"))
            .map(|(_, v)| v.clone())
            .expect("an embedding variable");
        drop(data);
        embed.set(&embed.zeros_like().unwrap()).unwrap();
        let after = m.fingerprint().unwrap();
        assert_eq!((after[0], after[1]), (0.0, 0.0), "{after:?}");
        assert_eq!(after[2..], first[2..]);
    }

    /// A decode step through the cache's own kernel (the hook the GPU engine's paged-attention
    /// op uses) gives the logits the gather gives: tables as `[batch, width]` rows padded to the
    /// longest, lengths per sequence, output reshaped back; called once per layer.
    #[test]
    fn a_decode_through_the_caches_kernel_equals_the_gather() {
        let m = model();
        let s = shape();
        let tables: [&[u32]; 3] = [&[7, 2, 19], &[4], &[11, 30]];
        let prompts = [40usize, 9, 25];
        let (plain, hooked) = (Cache::new(&s), Hooked(Cache::new(&s), Default::default()));
        for (t, &n) in tables.iter().zip(&prompts) {
            for c in [&plain as &dyn LayerCache, &hooked] {
                let p = Piece {
                    blocks: t,
                    start: 0,
                    len: n,
                };
                m.forward(c, &[p]).unwrap();
            }
        }
        assert_eq!(hooked.1.get(), 0, "a prefill gathers");
        let step = |c: &dyn LayerCache| {
            let pieces: Vec<Piece> = tables
                .iter()
                .zip(&prompts)
                .map(|(t, &n)| Piece {
                    blocks: t,
                    start: n,
                    len: 1,
                })
                .collect();
            rows(&m.forward(c, &pieces).unwrap())
        };
        let (want, got) = (step(&plain), step(&hooked));
        assert_eq!(hooked.1.get(), s.layers, "the kernel once per layer");
        for (i, (w, g)) in want.iter().zip(&got).enumerate() {
            close(g, w, &format!("sequence {i}"));
        }
    }

    #[test]
    fn decode_over_blocks_equals_a_whole_prefill() {
        let m = model();
        let s = shape();
        // Scattered, out of order: the block table matters.
        let blocks = [7u32, 2, 19, 11];
        let cache = Cache::new(&s);
        let got = incremental(&m, &cache, &blocks, 21, 20);
        for (i, g) in got.iter().enumerate() {
            let ctx = 21 + i;
            let fresh = Cache::new(&s);
            let p = Piece {
                blocks: &blocks,
                start: 0,
                len: ctx,
            };
            let want = rows(&m.forward(&fresh, &[p]).unwrap()).remove(0);
            close(g, &want, &format!("context {ctx}"));
        }
        for b in 0..BLOCKS as u32 {
            let used = blocks[..41usize.div_ceil(BLOCK_TOKENS)].contains(&b);
            assert_eq!(
                cache.mass(b as usize) > 0.0,
                used,
                "block {b} written: {}",
                !used
            );
        }
        // Positions matter: a later step's logits differ from the first's.
        assert!(got[0]
            .iter()
            .zip(&got[19])
            .any(|(a, b)| (a - b).abs() > 1e-3));
    }

    #[test]
    fn batched_decode_and_chunked_prefill_change_nothing() {
        let m = model();
        let s = shape();
        let (a, b) = ([3u32, 9, 14], [20u32, 1, 5]);
        // Alone.
        let alone_a = incremental(&m, &Cache::new(&s), &a, 17, 5);
        let alone_b = incremental(&m, &Cache::new(&s), &b, 30, 5);
        // Together, one cache: a prefill of both (b in two pieces), then decode steps of both.
        let cache = Cache::new(&s);
        let first = rows(
            &m.forward(
                &cache,
                &[
                    Piece {
                        blocks: &a,
                        start: 0,
                        len: 17,
                    },
                    Piece {
                        blocks: &b,
                        start: 0,
                        len: 12,
                    },
                    Piece {
                        blocks: &b,
                        start: 12,
                        len: 18,
                    },
                ],
            )
            .unwrap(),
        );
        close(&first[0], &alone_a[0], "a's prefill beside b");
        close(&first[2], &alone_b[0], "b's prefill in two pieces");
        for i in 0..5 {
            let out = rows(
                &m.forward(
                    &cache,
                    &[
                        Piece {
                            blocks: &a,
                            start: 17 + i,
                            len: 1,
                        },
                        Piece {
                            blocks: &b,
                            start: 30 + i,
                            len: 1,
                        },
                    ],
                )
                .unwrap(),
            );
            close(
                &out[0],
                &alone_a[i + 1],
                &format!("a's decode {i} in a batch"),
            );
            close(
                &out[1],
                &alone_b[i + 1],
                &format!("b's decode {i} in a batch"),
            );
        }
    }

    #[test]
    fn a_chunked_prefill_equals_a_whole_one() {
        let m = model();
        let s = shape();
        let (a, b) = ([4u32, 30, 8, 17], [12u32, 0, 25]);
        let whole = |blocks: &[u32], len: usize| {
            let p = Piece {
                blocks,
                start: 0,
                len,
            };
            rows(&m.forward(&Cache::new(&s), &[p]).unwrap()).remove(0)
        };
        let (want_a, want_b) = (whole(&a, 53), whole(&b, 40));
        for chunk in [1, 7, 16, 20, 64] {
            let cache = Cache::new(&s);
            let pieces = [
                Piece {
                    blocks: &a,
                    start: 0,
                    len: 53,
                },
                Piece {
                    blocks: &b,
                    start: 0,
                    len: 40,
                },
            ];
            let out = m.prefill_chunked(&cache, &pieces, chunk).unwrap();
            // Every forward holds at most `chunk` tokens: at least 93 / chunk of them.
            assert!(
                out.len() >= 93usize.div_ceil(chunk),
                "chunk {chunk}: {} forwards",
                out.len()
            );
            // a's last chunk ends some forward; b's last chunk ends the last forward.
            let last = rows(out.last().unwrap());
            close(last.last().unwrap(), &want_b, &format!("b, chunk {chunk}"));
            let a_last = out.iter().flat_map(rows).find(|r| {
                r.iter()
                    .zip(&want_a)
                    .all(|(x, y)| (x - y).abs() <= 1e-3 * (1.0 + y.abs()))
            });
            assert!(
                a_last.is_some(),
                "chunk {chunk}: no forward ends with a's logits"
            );
            // Then decoding on goes on from the cache the chunks wrote.
            let next = rows(
                &m.forward(
                    &cache,
                    &[Piece {
                        blocks: &a,
                        start: 53,
                        len: 1,
                    }],
                )
                .unwrap(),
            )
            .remove(0);
            close(
                &next,
                &whole(&a, 54),
                &format!("a's decode after chunk {chunk}"),
            );
        }
        assert!(m.prefill_chunked(&Cache::new(&s), &[], 0).is_err());
    }

    #[test]
    fn a_context_beyond_its_blocks_is_an_error() {
        let m = model();
        let cache = Cache::new(&shape());
        let p = Piece {
            blocks: &[1, 2],
            start: 0,
            len: 2 * BLOCK_TOKENS + 1,
        };
        let e = m.forward(&cache, &[p]).unwrap_err().to_string();
        assert!(e.contains("33 tokens") && e.contains("2 blocks"), "{e}");
    }
}
