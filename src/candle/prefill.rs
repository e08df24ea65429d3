//! Paged-attention prefill as a candle op: a batch of prefill pieces (a chunk of each
//! sequence's new tokens) attends causally over each sequence's cached tokens, read in place
//! through its block table: no gather copy and no score matrix in memory (flash attention on
//! tensor cores; the kernel is `kernels/paged_prefill.cu`, its PTX committed and embedded).
//!
//! The pieces' own K and V must be in the cache before the call (write them into their blocks
//! first, as the decode op expects of a step's token): a token at position `p` attends over the
//! sequence's tokens `0..=p`. The cache is a [`crate::kv::PagedKv`]'s per-layer tensors in any
//! [`BlockShape`] (token-major `[blocks, block_tokens, kv_heads, head_dim]`, the default;
//! head-major; vLLM's split K), as for [`super::paged_attention_decode_shaped`].
//! Grouped-query attention with any number of query heads per KV head; `head_dim` 64 or 128;
//! f16 or bf16, scores and softmax in f32.

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::sys::CUfunction_attribute_enum;
use candle_core::cuda_backend::cudarc::driver::{LaunchConfig, PushKernelArg};
use candle_core::cuda_backend::{CudaDevice, WrapErr};
use candle_core::{CpuStorage, CudaStorage, CustomOp1, DType, Layout, Shape, Storage, Tensor};

use super::attention::cache_dims;
use super::{operands, BlockShape};

/// The PTX of the kernels (compute_80, JIT-compiled by the driver once per process).
const PTX: &str = include_str!("kernels/paged_prefill.ptx");
/// The module's name in candle's cache of custom modules.
const MODULE: &str = "evmm_paged_prefill";
/// Threads of a CTA (the kernel's `PF_WARPS * 32`).
const THREADS: u32 = 128;
/// Query rows of a CTA (the kernel's `PF_M`).
const TILE: usize = 64;

/// One piece of a prefill batch: `len` new tokens of a sequence, at positions `start..start +
/// len` (the earlier `start` tokens are already in its blocks).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PrefillPiece {
    /// Position of the piece's first new token.
    pub start: usize,
    /// New tokens in the piece.
    pub len: usize,
}

/// Causal attention of a prefill batch over a paged cache of token-major blocks:
/// [`paged_attention_prefill_shaped`] with [`BlockShape::TokenMajor`].
pub fn paged_attention_prefill(
    q: &Tensor,
    k_cache: &Tensor,
    v_cache: &Tensor,
    block_tables: &Tensor,
    pieces: &[PrefillPiece],
    scale: f32,
) -> candle_core::Result<Tensor> {
    paged_attention_prefill_shaped(
        BlockShape::TokenMajor,
        q,
        k_cache,
        v_cache,
        block_tables,
        pieces,
        scale,
    )
}

/// Causal attention of a prefill batch over a paged cache whose blocks are in `shape`'s order.
///
/// - `q`: `[tokens, heads, head_dim]`, contiguous, f16 or bf16: every piece's new tokens, piece
///   after piece (`tokens` is the sum of the pieces' lengths);
/// - `k_cache`, `v_cache`: one layer's K and V in `shape`'s order (see
///   [`super::paged_attention_decode_shaped`]), contiguous, q's dtype, with the pieces' own
///   tokens already written;
/// - `block_tables`: `[pieces, width]` u32, piece `i`'s sequence's blocks in order; a table
///   must name every block of its piece's context (`start + len` tokens); an id at or past the
///   cache's blocks counts as masked;
/// - `pieces`: where each piece's tokens are in its sequence;
/// - `scale`: applied to the scores (usually `1 / sqrt(head_dim)`).
///
/// Returns `[tokens, heads, head_dim]` in q's dtype; a token whose every visible key is masked
/// gets zeros. Runs on q's device's stream, ordered with candle's other work. Shapes, dtypes,
/// devices, the pieces, that q, K and V start 16-byte aligned in their storage, and that the
/// device has the kernel's shared memory (110 KiB a block for head_dim 128: not on sm_86 and
/// sm_89 cards; [`paged_prefill_supported`] asks) are checked; a mismatch is an error naming
/// them. Every order gives the token-major output bit for bit (the same rows reach shared
/// memory).
pub fn paged_attention_prefill_shaped(
    shape: BlockShape,
    q: &Tensor,
    k_cache: &Tensor,
    v_cache: &Tensor,
    block_tables: &Tensor,
    pieces: &[PrefillPiece],
    scale: f32,
) -> candle_core::Result<Tensor> {
    let op = Prefill::new(shape, q, k_cache, v_cache, block_tables, pieces, scale)?;
    q.apply_op1_no_bwd(&op)
}

/// The op: q is its argument, the rest its fields.
struct Prefill {
    shape: BlockShape,
    k: Tensor,
    v: Tensor,
    table: Tensor,
    /// Per CTA row: first row in q, position of that row, rows (1..=64), piece.
    tiles: Vec<u32>,
    scale: f32,
    tokens: usize,
    heads: usize,
    head_dim: usize,
    blocks: usize,
    block_tokens: usize,
    kv_heads: usize,
    width: usize,
}

fn bad(msg: String) -> candle_core::Error {
    candle_core::Error::Msg(format!("paged_attention_prefill: {msg}"))
}

/// The CUDA storage of a tensor's storage, or an error.
fn cuda(s: &Storage) -> candle_core::Result<&CudaStorage> {
    operands::cuda(s).map_err(bad)
}

/// The most dynamic shared memory a block may opt in to on `dev` (227 KiB on the H100; 99 KiB
/// on sm_86/sm_89 cards, where head_dim 128 does not fit). Read from the driver once per device
/// and kept: every layer of every prefill asks.
fn shared_memory_limit(dev: &CudaDevice) -> candle_core::Result<usize> {
    use candle_core::cuda_backend::cudarc::driver::{result, sys};
    use std::sync::Mutex;
    // Per device handle; a leaf lock, never held across the driver call.
    static LIMITS: Mutex<Vec<(sys::CUdevice, usize)>> = Mutex::new(Vec::new());
    let cu_device = dev.cuda_stream().context().cu_device();
    let known =
        |l: &Vec<(sys::CUdevice, usize)>| l.iter().find(|(d, _)| *d == cu_device).map(|&(_, n)| n);
    if let Some(n) = known(&LIMITS.lock().unwrap_or_else(|p| p.into_inner())) {
        return Ok(n);
    }
    let attr = sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN;
    // Not `CudaContext::attribute`: it first takes (and so clears) an error another operation
    // left in the context's error slot, and would report it as ours.
    // SAFETY: `cu_device` is the device handle of a live context (the candle device holds it);
    // the call only reads one of the device's attributes.
    let n = unsafe { result::device::get_attribute(cu_device, attr) }.w()?;
    let n = usize::try_from(n).unwrap_or(0);
    let mut limits = LIMITS.lock().unwrap_or_else(|p| p.into_inner());
    if known(&limits).is_none() {
        limits.push((cu_device, n));
    }
    Ok(n)
}

/// Whether the prefill op runs on `device` for heads of `head_dim` (64 or 128, and the shared
/// memory its kernel needs is there): an engine asks before it chooses the op over its own
/// path, as the serving example does.
pub fn paged_prefill_supported(device: &candle_core::Device, head_dim: usize) -> bool {
    let Ok(dev) = device.as_cuda_device() else {
        return false;
    };
    matches!(head_dim, 64 | 128)
        && shared_memory_limit(dev).is_ok_and(|limit| smem_bytes(head_dim) <= limit)
}

/// Dynamic shared memory of the kernel for `head_dim` (the kernel's `PrefillSmem::BYTES`, 2-byte
/// elements): Q, K and V tiles, scores, probabilities, the output and the key mask.
fn smem_bytes(head_dim: usize) -> usize {
    let (m, n) = (TILE, 64);
    let ldt = head_dim + 8;
    3 * 2 * m * ldt + 4 * m * (n + 4) + 2 * m * (n + 8) + 4 * m * (head_dim + 4) + 4 * n
}

impl Prefill {
    fn new(
        shape: BlockShape,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        table: &Tensor,
        pieces: &[PrefillPiece],
        scale: f32,
    ) -> candle_core::Result<Self> {
        let (tokens, heads, head_dim) = q
            .dims3()
            .map_err(|_| bad(format!("q {:?}: want [tokens, heads, head_dim]", q.dims())))?;
        let (blocks, block_tokens, kv_heads, kd) = cache_dims(shape, k, v).map_err(bad)?;
        if kd != head_dim {
            return Err(bad(format!(
                "the cache's head_dim {kd} differs from q's {head_dim}"
            )));
        }
        if !matches!(head_dim, 64 | 128) {
            return Err(bad(format!("head_dim {head_dim} (supported: 64, 128)")));
        }
        if kv_heads == 0 || heads == 0 || heads % kv_heads != 0 {
            return Err(bad(format!(
                "{heads} query heads over {kv_heads} KV heads (a multiple is needed)"
            )));
        }
        if block_tokens == 0 || blocks == 0 {
            return Err(bad(format!(
                "an empty cache: {blocks} blocks of {block_tokens} tokens"
            )));
        }
        let (tp, width) = table.dims2().map_err(|_| {
            bad(format!(
                "block_tables {:?}: want [pieces, width]",
                table.dims()
            ))
        })?;
        if tp != pieces.len() {
            return Err(bad(format!(
                "block_tables {:?} has {tp} rows for {} pieces",
                table.dims(),
                pieces.len()
            )));
        }
        operands::check(
            q,
            &[
                ("k_cache", k, q.dtype()),
                ("v_cache", v, q.dtype()),
                ("block_tables", table, DType::U32),
            ],
            &[
                ("q", q),
                ("k_cache", k),
                ("v_cache", v),
                ("block_tables", table),
            ],
            &[("q", q), ("k_cache", k), ("v_cache", v)],
        )
        .map_err(bad)?;
        if !scale.is_finite() {
            return Err(bad(format!("scale {scale} is not finite")));
        }
        // The kernel indexes with 32-bit block ids, rows and positions, and walks keys 64 at a
        // time in a 32-bit counter (so a context stays 64 below 2^32).
        let cover = width.checked_mul(block_tokens);
        let fits = |n: usize| u32::try_from(n).is_ok();
        let key_room = (u32::MAX - 64) as usize;
        if !(fits(blocks)
            && fits(block_tokens)
            && fits(width)
            && cover.is_some_and(|c| c <= key_room)
            && fits(tokens))
        {
            return Err(bad(format!(
                "sizes past 32 bits: {blocks} blocks, width {width} of {block_tokens} tokens, {tokens} tokens"
            )));
        }
        if heads > 65535 {
            return Err(bad(format!(
                "{heads} query heads: the grid takes at most 65535"
            )));
        }
        let cover = cover.unwrap_or(0);
        let sum = pieces
            .iter()
            .try_fold(0usize, |a, p| a.checked_add(p.len))
            .filter(|&n| n == tokens);
        if sum.is_none() {
            let shown = pieces.iter().fold(0u128, |a, p| a + p.len as u128);
            return Err(bad(format!(
                "q has {tokens} tokens, the pieces' lengths sum to {shown}"
            )));
        }
        let mut tiles = Vec::new();
        let mut row = 0usize;
        for (i, p) in pieces.iter().enumerate() {
            let end = p.start.checked_add(p.len).filter(|&e| e <= cover);
            let Some(_) = end else {
                return Err(bad(format!(
                    "piece {i} (positions {} + {}) goes past its table's {width} blocks of {block_tokens} tokens ({cover})",
                    p.start, p.len
                )));
            };
            for at in (0..p.len).step_by(TILE) {
                let rows = (p.len - at).min(TILE);
                // Each fits: rows < tokens and positions < cover, both checked above.
                tiles.extend([
                    (row + at) as u32,
                    (p.start + at) as u32,
                    rows as u32,
                    i as u32,
                ]);
            }
            row += p.len;
        }
        if tiles.len() / 4 > i32::MAX as usize {
            return Err(bad(format!("{} query tiles", tiles.len() / 4)));
        }
        Ok(Prefill {
            shape,
            k: k.clone(),
            v: v.clone(),
            table: table.clone(),
            tiles,
            scale,
            tokens,
            heads,
            head_dim,
            blocks,
            block_tokens,
            kv_heads,
            width,
        })
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
        let out_len = self.tokens * self.heads * self.head_dim;
        // SAFETY: every (tile, head) CTA writes every element of its rows of `out`, and the
        // tiles cover every token of every piece (checked in `new`: the lengths sum to q's
        // tokens), so no element is left unwritten. An empty batch launches nothing.
        let mut out = unsafe { dev.alloc::<T>(out_len)? };
        let ctas = self.tiles.len() / 4;
        if ctas == 0 {
            return Ok(CudaStorage::wrap_cuda_slice(out, dev.clone()));
        }
        let tiles = dev.clone_htod(&self.tiles)?;
        // The storages stay read-locked (shared) until the launch is queued.
        let (ks, kl) = self.k.storage_and_layout();
        let (vs, vl) = self.v.storage_and_layout();
        let (ts, tl) = self.table.storage_and_layout();
        let q = q.as_cuda_slice::<T>()?.slice(ql.start_offset()..);
        let k = cuda(&ks)?.as_cuda_slice::<T>()?.slice(kl.start_offset()..);
        let v = cuda(&vs)?.as_cuda_slice::<T>()?.slice(vl.start_offset()..);
        let table = cuda(&ts)?
            .as_cuda_slice::<u32>()?
            .slice(tl.start_offset()..);
        let smem = smem_bytes(self.head_dim);
        let limit = shared_memory_limit(dev)?;
        if smem > limit {
            return Err(bad(format!(
                "head_dim {} needs {smem} bytes of shared memory a block; this device allows {limit}",
                self.head_dim
            )));
        }
        let func = dev.get_or_load_custom_func(name, MODULE, PTX)?;
        // More than the default 48 KiB of dynamic shared memory needs the function's opt-in.
        func.set_attribute(
            CUfunction_attribute_enum::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
            smem as i32,
        )
        .w()?;
        let u = |n: usize| n as u32; // checked to fit in `new`
        let (nb, bt, kvh, width) = (
            u(self.blocks),
            u(self.block_tokens),
            u(self.kv_heads),
            u(self.width),
        );
        let mut b = func.builder();
        b.arg(&q)
            .arg(&k)
            .arg(&v)
            .arg(&table)
            .arg(&tiles)
            .arg(&mut out)
            .arg(&nb)
            .arg(&bt)
            .arg(&kvh)
            .arg(&width)
            .arg(&self.scale);
        let cfg = LaunchConfig {
            grid_dim: (u(ctas), u(self.heads), 1),
            block_dim: (THREADS, 1, 1),
            shared_mem_bytes: smem as u32,
        };
        // SAFETY: the arguments match the kernel's signature in order and type; every tensor's
        // shape and dtype were checked in `new` and the slices start at their layouts'
        // offsets; the tiles name rows below q's tokens and positions inside each piece's
        // table; the kernel reads the cache only at block ids below `nb`, reads q and writes
        // `out` only at the tiles' rows, and uses the dynamic shared memory set above.
        unsafe { b.launch(cfg) }.w()?;
        // `tiles` is freed on the stream after the launch (cudarc's stream-ordered free).
        drop(tiles);
        Ok(CudaStorage::wrap_cuda_slice(out, dev.clone()))
    }
}

impl CustomOp1 for Prefill {
    fn name(&self) -> &'static str {
        "paged-attention-prefill"
    }

    fn cpu_fwd(&self, _: &CpuStorage, _: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        Err(bad("runs on CUDA devices only".into()))
    }

    fn cuda_fwd(&self, q: &CudaStorage, ql: &Layout) -> candle_core::Result<(CudaStorage, Shape)> {
        let d = self.head_dim;
        let order = match self.shape {
            BlockShape::TokenMajor => "",
            BlockShape::HeadMajor => "_head_major",
            BlockShape::SplitK => "_split_k",
        };
        let storage = match q.dtype() {
            DType::F16 => {
                self.launch::<half::f16>(q, ql, &format!("evmm_paged_prefill_f16_d{d}{order}"))?
            }
            DType::BF16 => {
                self.launch::<half::bf16>(q, ql, &format!("evmm_paged_prefill_bf16_d{d}{order}"))?
            }
            other => return Err(bad(format!("dtype {other:?} (supported: f16, bf16)"))),
        };
        Ok((
            storage,
            Shape::from((self.tokens, self.heads, self.head_dim)),
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    fn zeros(shape: &[usize], dtype: DType) -> Tensor {
        Tensor::zeros(shape, dtype, &Device::Cpu).expect("cpu tensor")
    }

    /// The argument checks run before anything reaches a device, so they are tested on the CPU
    /// (CI has no GPU); a call that passes them is refused by the CPU path.
    #[test]
    fn bad_input_is_refused_with_the_numbers_before_any_launch() {
        let bf = DType::BF16;
        let q = zeros(&[20, 8, 128], bf);
        let kv = zeros(&[4, 16, 2, 128], bf);
        let table = zeros(&[2, 4], DType::U32);
        let ok = [
            PrefillPiece { start: 0, len: 10 },
            PrefillPiece { start: 3, len: 10 },
        ];
        let err = |r: candle_core::Result<Tensor>| r.expect_err("refused").to_string();
        let short = [ok[0], PrefillPiece { start: 0, len: 5 }];
        assert!(
            err(paged_attention_prefill(&q, &kv, &kv, &table, &short, 1.0))
                .contains("q has 20 tokens, the pieces' lengths sum to 15")
        );
        let huge = [
            ok[0],
            PrefillPiece {
                start: 0,
                len: usize::MAX,
            },
        ];
        assert!(
            err(paged_attention_prefill(&q, &kv, &kv, &table, &huge, 1.0))
                .contains("sum to 18446744073709551625")
        );
        let long = [ok[0], PrefillPiece { start: 60, len: 10 }];
        assert!(
            err(paged_attention_prefill(&q, &kv, &kv, &table, &long, 1.0)).contains(
                "piece 1 (positions 60 + 10) goes past its table's 4 blocks of 16 tokens (64)"
            )
        );
        let shifted = zeros(&[20 * 8 * 128 + 1], bf)
            .narrow(0, 1, 20 * 8 * 128)
            .and_then(|t| t.reshape((20, 8, 128)))
            .expect("a shifted view");
        assert!(err(paged_attention_prefill(
            &shifted, &kv, &kv, &table, &ok, 1.0
        ))
        .contains("q starts 2 bytes into its storage, not a multiple of 16"));
        assert!(err(paged_attention_prefill(
            &q,
            &kv,
            &kv,
            &table,
            &ok,
            f32::INFINITY
        ))
        .contains("scale inf is not finite"));
        assert!(err(paged_attention_prefill(
            &zeros(&[20, 1024], bf),
            &kv,
            &kv,
            &table,
            &ok,
            1.0
        ))
        .contains("q [20, 1024]: want [tokens, heads, head_dim]"));
        let kv96 = zeros(&[4, 16, 2, 96], bf);
        assert!(err(paged_attention_prefill(
            &zeros(&[20, 8, 96], bf),
            &kv96,
            &kv96,
            &table,
            &ok,
            1.0
        ))
        .contains("head_dim 96 (supported: 64, 128)"));
        assert!(err(paged_attention_prefill(
            &zeros(&[20, 3, 128], bf),
            &kv,
            &kv,
            &table,
            &ok,
            1.0
        ))
        .contains("3 query heads over 2 KV heads"));
        assert!(
            err(paged_attention_prefill(&q, &kv, &kv, &table, &ok[..1], 1.0))
                .contains("block_tables [2, 4] has 2 rows for 1 pieces")
        );
        let f32kv = zeros(&[4, 16, 2, 128], DType::F32);
        assert!(err(paged_attention_prefill(
            &q, &f32kv, &f32kv, &table, &ok, 1.0
        ))
        .contains("k_cache is F32, not BF16"));
        // Every check passed: the CPU path says where the op runs.
        assert!(err(paged_attention_prefill(&q, &kv, &kv, &table, &ok, 1.0))
            .contains("runs on CUDA devices only"));
    }

    #[test]
    fn shared_memory_matches_the_kernels_layout() {
        // PrefillSmem<T, D>::BYTES of the kernel, worked by hand for both head sizes.
        assert_eq!(smem_bytes(128), 52224 + 17408 + 9216 + 33792 + 256);
        assert_eq!(smem_bytes(64), 27648 + 17408 + 9216 + 17408 + 256);
        // Two CTAs fit an SM of the H100 (227 KiB usable).
        assert!(2 * smem_bytes(128) <= 227 * 1024);
    }
}
