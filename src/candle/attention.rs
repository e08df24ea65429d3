//! Paged-attention decode as a candle op: each sequence's query token attends over its cached
//! tokens read in place through its block table, with no gather copy; and the write of new
//! tokens' K and V into their slots. The kernels are `kernels/paged_attention.cuh`, one
//! module per block order (its PTX committed and embedded, JIT-compiled once a process uses
//! that order).
//!
//! The cache is a [`crate::kv::PagedKv`]'s per-layer tensors in any [`BlockShape`]: K and V
//! `[blocks, block_tokens, kv_heads, head_dim]` (token-major, the default), `[blocks,
//! kv_heads, block_tokens, head_dim]` (head-major), or vLLM's split K `[blocks, kv_heads,
//! head_dim / 8, block_tokens, 8]` with V `[blocks, kv_heads, head_dim, block_tokens]`, as
//! [`super::PagedKvTensors::k`] and [`super::PagedKvTensors::v`] give them. Grouped-query
//! attention: `heads` a multiple of `kv_heads` (1, 2, 4 or 8 query heads per KV head);
//! `head_dim` 64 or 128; f16 or bf16, accumulated in f32.
//!
//! The kernel reads only inside the cache: a table entry past the cache's blocks, or a token
//! past what the table names, counts as masked. A read of a block nobody allocated reads what
//! the cache maps there (see [`crate::kv`]); engines pad tables with such blocks only past each
//! sequence's length, where nothing is read.

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{LaunchConfig, PushKernelArg};
use candle_core::cuda_backend::{CudaDevice, WrapErr};
use candle_core::{CpuStorage, CudaStorage, CustomOp1, DType, Layout, Shape, Storage, Tensor};

use super::{operands, BlockShape};

/// The module of `shape`'s kernels: its name in candle's cache of custom modules and its PTX
/// (compute_80, JIT-compiled by the driver once per process).
pub(super) fn module(shape: BlockShape) -> (&'static str, &'static str) {
    match shape {
        BlockShape::TokenMajor => (
            "evmm_paged_attention",
            include_str!("kernels/paged_attention.ptx"),
        ),
        BlockShape::HeadMajor => (
            "evmm_paged_attention_head_major",
            include_str!("kernels/paged_attention_head_major.ptx"),
        ),
        BlockShape::SplitK => (
            "evmm_paged_attention_split_k",
            include_str!("kernels/paged_attention_split_k.ptx"),
        ),
    }
}

/// Elements in one 16-byte run of split K's innermost dimension (f16 and bf16).
pub(super) const SPLIT: usize = 8;

/// A cache's `(blocks, block_tokens, kv_heads, head_dim)` read from its K tensor in `shape`'s
/// order, V checked to match; an error naming both shapes otherwise.
pub(super) fn cache_dims(
    shape: BlockShape,
    k: &Tensor,
    v: &Tensor,
) -> Result<(usize, usize, usize, usize), String> {
    let (dims, want_v) = match (shape, k.dims()) {
        (BlockShape::TokenMajor, &[n, bt, h, d]) => ((n, bt, h, d), vec![n, bt, h, d]),
        (BlockShape::HeadMajor, &[n, h, bt, d]) => ((n, bt, h, d), vec![n, h, bt, d]),
        (BlockShape::SplitK, &[n, h, dx, bt, SPLIT]) => {
            let d = dx.checked_mul(SPLIT).ok_or("head_dim overflows")?;
            ((n, bt, h, d), vec![n, h, d, bt])
        }
        (BlockShape::SplitK, other) => {
            return Err(format!(
                "k_cache {other:?} is not split K [blocks, kv_heads, head_dim / {SPLIT}, block_tokens, {SPLIT}]"
            ))
        }
        (_, other) => {
            return Err(format!(
                "k_cache {other:?} has {} dimensions, a {shape:?} cache 4",
                other.len()
            ))
        }
    };
    if v.dims() != want_v.as_slice() {
        return Err(format!(
            "v_cache {:?} does not match k_cache {:?} in {shape:?} order (want {want_v:?})",
            v.dims(),
            k.dims()
        ));
    }
    Ok(dims)
}

/// Threads of a phase-1 CTA (the kernel's `WARPS * 32`).
const THREADS: u32 = 128;
/// Tokens of a partition are a multiple of this.
const PART_QUANTUM: usize = 64;
/// A partition holds at most this many tokens.
const MAX_PART: usize = 1024;
/// The grid aims at this many CTAs at least, so a small batch still fills the device.
const TARGET_CTAS: usize = 528;

/// Attention of one decode step over a paged cache of token-major blocks:
/// [`paged_attention_decode_shaped`] with [`BlockShape::TokenMajor`].
pub fn paged_attention_decode(
    q: &Tensor,
    k_cache: &Tensor,
    v_cache: &Tensor,
    block_table: &Tensor,
    context_lens: &Tensor,
    max_context: usize,
    scale: f32,
) -> candle_core::Result<Tensor> {
    paged_attention_decode_shaped(
        BlockShape::TokenMajor,
        q,
        k_cache,
        v_cache,
        block_table,
        context_lens,
        max_context,
        scale,
    )
}

/// Attention of one decode step over a paged cache whose blocks are in `shape`'s order.
///
/// - `q`: `[batch, heads, head_dim]`, contiguous, f16 or bf16;
/// - `k_cache`, `v_cache`: one layer's K and V in `shape`'s order (see the module
///   documentation; [`super::PagedKvTensors::k`] and [`super::PagedKvTensors::v`] of a cache
///   made with that shape), contiguous, q's dtype;
/// - `block_table`: `[batch, width]` u32, sequence `b`'s blocks in order (padded past its
///   length with any id);
/// - `context_lens`: `[batch]` u32, the tokens each sequence attends over;
/// - `max_context`: the longest context (sizes the grid); a sequence longer than it, or than
///   its table names, attends over that many tokens only;
/// - `scale`: applied to the scores (usually `1 / sqrt(head_dim)`).
///
/// Returns `[batch, heads, head_dim]` in q's dtype; a sequence of length 0 gets zeros. Runs on
/// q's device's stream, ordered with candle's other work. Shapes, dtypes and devices are
/// checked, and that q, K and V start 16-byte aligned in their storage; a mismatch is an error
/// naming them. A split-K V's elements of one token lie `block_tokens` apart: where a tile's
/// tokens lie whole in one block (`block_tokens` a multiple of 4, or of 2 with 8 query heads
/// per KV head) each element's tokens are one load, else each element is read 2 bytes at a
/// time; the other orders read 16 bytes at a time.
#[allow(clippy::too_many_arguments)] // the operands of one kernel launch, as vLLM's op takes them
pub fn paged_attention_decode_shaped(
    shape: BlockShape,
    q: &Tensor,
    k_cache: &Tensor,
    v_cache: &Tensor,
    block_table: &Tensor,
    context_lens: &Tensor,
    max_context: usize,
    scale: f32,
) -> candle_core::Result<Tensor> {
    let op = PagedAttention::new(
        shape,
        q,
        k_cache,
        v_cache,
        block_table,
        context_lens,
        max_context,
        scale,
    )?;
    q.apply_op1_no_bwd(&op)
}

/// The op: q is its argument, the rest its fields.
struct PagedAttention {
    shape: BlockShape,
    k: Tensor,
    v: Tensor,
    table: Tensor,
    lens: Tensor,
    max_context: usize,
    scale: f32,
    batch: usize,
    heads: usize,
    head_dim: usize,
    blocks: usize,
    block_tokens: usize,
    kv_heads: usize,
    width: usize,
}

/// The CUDA storage of a tensor's storage, or an error.
fn cuda(s: &Storage) -> candle_core::Result<&CudaStorage> {
    operands::cuda(s).map_err(bad)
}

fn bad(msg: String) -> candle_core::Error {
    candle_core::Error::Msg(format!("paged_attention_decode: {msg}"))
}

impl PagedAttention {
    #[allow(clippy::too_many_arguments)]
    fn new(
        shape: BlockShape,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        table: &Tensor,
        lens: &Tensor,
        max_context: usize,
        scale: f32,
    ) -> candle_core::Result<Self> {
        let (batch, heads, head_dim) = q.dims3()?;
        let (blocks, block_tokens, kv_heads, kd) = cache_dims(shape, k, v).map_err(bad)?;
        if kd != head_dim {
            return Err(bad(format!(
                "the cache's head_dim {kd} differs from q's {head_dim}"
            )));
        }
        if !matches!(head_dim, 64 | 128) {
            return Err(bad(format!("head_dim {head_dim} (supported: 64, 128)")));
        }
        if kv_heads == 0 || heads % kv_heads != 0 || !matches!(heads / kv_heads, 1 | 2 | 4 | 8) {
            return Err(bad(format!(
                "{heads} query heads over {kv_heads} KV heads (supported: 1, 2, 4 or 8 per KV head)"
            )));
        }
        if block_tokens == 0 || blocks == 0 {
            return Err(bad(format!(
                "an empty cache: {blocks} blocks of {block_tokens} tokens"
            )));
        }
        let (tb, width) = table.dims2()?;
        if tb != batch || lens.dims() != [batch] {
            return Err(bad(format!(
                "block_table {:?} and context_lens {:?} must be [{batch}, _] and [{batch}]",
                table.dims(),
                lens.dims()
            )));
        }
        // The kernel indexes with 32-bit block ids and token counts.
        let fits = |n: usize| u32::try_from(n).is_ok();
        if !(fits(blocks)
            && fits(block_tokens)
            && fits(width)
            && fits(kv_heads)
            && fits(max_context))
        {
            return Err(bad(format!(
                "sizes past 32 bits: {blocks} blocks of {block_tokens} tokens, {kv_heads} KV heads, width {width}, max_context {max_context}"
            )));
        }
        operands::check(
            q,
            &[
                ("k_cache", k, q.dtype()),
                ("v_cache", v, q.dtype()),
                ("block_table", table, DType::U32),
                ("context_lens", lens, DType::U32),
            ],
            &[
                ("q", q),
                ("k_cache", k),
                ("v_cache", v),
                ("block_table", table),
                ("context_lens", lens),
            ],
            &[("q", q), ("k_cache", k), ("v_cache", v)],
        )
        .map_err(bad)?;
        Ok(PagedAttention {
            shape,
            k: k.clone(),
            v: v.clone(),
            table: table.clone(),
            lens: lens.clone(),
            max_context,
            scale,
            batch,
            heads,
            head_dim,
            blocks,
            block_tokens,
            kv_heads,
            width,
        })
    }

    /// Tokens per partition: enough partitions that the grid fills the device, each a multiple
    /// of the quantum and at most `MAX_PART` tokens.
    fn partition(&self) -> usize {
        let ctas = self.batch * self.kv_heads;
        let want = TARGET_CTAS.div_ceil(ctas.max(1)).max(1);
        let part = self
            .max_context
            .div_ceil(want)
            .next_multiple_of(PART_QUANTUM);
        part.clamp(PART_QUANTUM, MAX_PART)
    }

    fn launch<T>(
        &self,
        q: &CudaStorage,
        ql: &Layout,
        name: &str,
    ) -> candle_core::Result<CudaStorage>
    where
        T: candle_core::cuda_backend::CudaDType
            + candle_core::cuda_backend::cudarc::driver::DeviceRepr,
    {
        let dev: &CudaDevice = q.device();
        // The storages stay read-locked (shared) until the launches are queued.
        let (ks, kl) = self.k.storage_and_layout();
        let (vs, vl) = self.v.storage_and_layout();
        let (ts, tl) = self.table.storage_and_layout();
        let (ls, ll) = self.lens.storage_and_layout();
        let q = q.as_cuda_slice::<T>()?.slice(ql.start_offset()..);
        let k = cuda(&ks)?.as_cuda_slice::<T>()?.slice(kl.start_offset()..);
        let v = cuda(&vs)?.as_cuda_slice::<T>()?.slice(vl.start_offset()..);
        let table = cuda(&ts)?
            .as_cuda_slice::<u32>()?
            .slice(tl.start_offset()..);
        let lens = cuda(&ls)?
            .as_cuda_slice::<u32>()?
            .slice(ll.start_offset()..);

        let part = self.partition();
        let parts = self.max_context.div_ceil(part).max(1);
        let rows = self.batch * self.heads;
        let out_len = rows * self.head_dim;
        // SAFETY: phase 1 writes every element of the three buffers (every (sequence, head,
        // partition) CTA writes its row, its max and its sum) before phase 2, queued after it
        // on the same stream, reads them; phase 2 writes every element of `out`.
        let (mut part_out, mut part_m, mut part_l, mut out) = unsafe {
            (
                dev.alloc::<f32>(rows * parts * self.head_dim)?,
                dev.alloc::<f32>(rows * parts)?,
                dev.alloc::<f32>(rows * parts)?,
                dev.alloc::<T>(out_len)?,
            )
        };
        let u = |n: usize| n as u32; // checked to fit in `new`
        let (nb, bt, kvh, width, part_u) = (
            u(self.blocks),
            u(self.block_tokens),
            u(self.kv_heads),
            u(self.width),
            u(part),
        );
        let max_len = u(self.max_context);
        let (module, ptx) = module(self.shape);
        let phase1 = dev.get_or_load_custom_func(name, module, ptx)?;
        let mut b = phase1.builder();
        b.arg(&q)
            .arg(&k)
            .arg(&v)
            .arg(&table)
            .arg(&lens)
            .arg(&mut part_out)
            .arg(&mut part_m)
            .arg(&mut part_l)
            .arg(&nb)
            .arg(&bt)
            .arg(&kvh)
            .arg(&width)
            .arg(&part_u)
            .arg(&max_len)
            .arg(&self.scale);
        let grid = (u(self.batch), kvh, u(parts));
        let cfg = LaunchConfig {
            grid_dim: grid,
            block_dim: (THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: the arguments match the kernel's signature in order and type; every tensor's
        // shape and dtype were checked in `new` and the slices start at their layouts'
        // offsets; the kernel reads the cache only at block ids below `nb` and tokens the
        // table names (its width), and writes only the buffers sized above for this grid.
        unsafe { b.launch(cfg) }.w()?;
        let merge = dev.get_or_load_custom_func(
            if name.contains("bf16") {
                "evmm_paged_attn_merge_bf16"
            } else {
                "evmm_paged_attn_merge_f16"
            },
            module,
            ptx,
        )?;
        let (parts_u, d) = (u(parts), u(self.head_dim));
        let mut b = merge.builder();
        b.arg(&part_out)
            .arg(&part_m)
            .arg(&part_l)
            .arg(&mut out)
            .arg(&parts_u)
            .arg(&d);
        let cfg = LaunchConfig {
            grid_dim: (u(rows), 1, 1),
            block_dim: (d, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: as above; one CTA per (sequence, head) row, reading that row's partitions.
        unsafe { b.launch(cfg) }.w()?;
        Ok(CudaStorage::wrap_cuda_slice(out, dev.clone()))
    }
}

impl CustomOp1 for PagedAttention {
    fn name(&self) -> &'static str {
        "paged-attention-decode"
    }

    fn cpu_fwd(&self, _: &CpuStorage, _: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        Err(bad("runs on CUDA devices only".into()))
    }

    fn cuda_fwd(&self, q: &CudaStorage, ql: &Layout) -> candle_core::Result<(CudaStorage, Shape)> {
        let rep = self.heads / self.kv_heads;
        let d = self.head_dim;
        let storage = match q.dtype() {
            DType::F16 => {
                self.launch::<half::f16>(q, ql, &format!("evmm_paged_attn_f16_d{d}_r{rep}"))?
            }
            DType::BF16 => {
                self.launch::<half::bf16>(q, ql, &format!("evmm_paged_attn_bf16_d{d}_r{rep}"))?
            }
            other => return Err(bad(format!("dtype {other:?} (supported: f16, bf16)"))),
        };
        Ok((
            storage,
            Shape::from((self.batch, self.heads, self.head_dim)),
        ))
    }
}
