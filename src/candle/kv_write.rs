//! The write half of a paged engine's step as a candle op: new tokens' K and V into their
//! slots of a paged cache, in place, in any [`BlockShape`] (vLLM's `reshape_and_cache`). The
//! kernels are in the decode op's modules (`kernels/paged_attention.cuh`).

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{LaunchConfig, PushKernelArg};
use candle_core::cuda_backend::WrapErr;
use candle_core::{CpuStorage, CudaStorage, DType, InplaceOp3, Layout, Tensor};

use super::attention::{cache_dims, module};
use super::{operands, BlockShape};

/// Threads of a write CTA (one CTA per token).
const THREADS: u32 = 128;

/// Writes new tokens' K and V into their slots of one layer's paged cache, in place.
///
/// - `k`, `v`: `[tokens, kv_heads, head_dim]`, contiguous, the cache's dtype (f16 or bf16);
/// - `k_cache`, `v_cache`: the layer's K and V in `shape`'s order (as for
///   [`super::paged_attention_decode_shaped`]), contiguous;
/// - `slots`: `[tokens]` u32, token `i`'s slot `block * block_tokens + offset`.
///
/// A slot whose block is at or past the cache's blocks is skipped. Two tokens given one slot
/// leave either's data there. Write only into blocks the cache allocated
/// ([`super::PagedKvTensors::alloc`]): a write into a page that is not backed is an
/// illegal-address fault on the GPU, as for any other write. Runs on the device's stream,
/// ordered with candle's other work. Shapes, dtypes, devices and 16-byte alignment are checked;
/// a mismatch is an error naming them, and nothing is written.
pub fn paged_kv_write(
    shape: BlockShape,
    k: &Tensor,
    v: &Tensor,
    k_cache: &Tensor,
    v_cache: &Tensor,
    slots: &Tensor,
) -> candle_core::Result<()> {
    let (blocks, block_tokens, kv_heads, head_dim) =
        cache_dims(shape, k_cache, v_cache).map_err(bad)?;
    let (tokens, h, d) = k.dims3()?;
    if (h, d) != (kv_heads, head_dim) || v.dims() != k.dims() || slots.dims() != [tokens] {
        return Err(bad(format!(
            "k {:?}, v {:?} and slots {:?} must be [tokens, {kv_heads}, {head_dim}] twice and [tokens]",
            k.dims(),
            v.dims(),
            slots.dims()
        )));
    }
    if head_dim % 8 != 0 || block_tokens == 0 {
        return Err(bad(format!(
            "head_dim {head_dim} is not a multiple of 8, or blocks of {block_tokens} tokens"
        )));
    }
    let fits = |n: usize| u32::try_from(n).is_ok();
    let runs = kv_heads.checked_mul(head_dim);
    if !(fits(blocks) && fits(block_tokens) && fits(tokens) && runs.is_some_and(fits)) {
        return Err(bad(format!(
            "sizes past 32 bits: {blocks} blocks of {block_tokens} tokens, {tokens} tokens, {kv_heads} x {head_dim}"
        )));
    }
    operands::check(
        k,
        &[
            ("v", v, k.dtype()),
            ("k_cache", k_cache, k.dtype()),
            ("v_cache", v_cache, k.dtype()),
            ("slots", slots, DType::U32),
        ],
        &[
            ("k", k),
            ("v", v),
            ("k_cache", k_cache),
            ("v_cache", v_cache),
            ("slots", slots),
        ],
        &[
            ("k", k),
            ("v", v),
            ("k_cache", k_cache),
            ("v_cache", v_cache),
        ],
    )
    .map_err(bad)?;
    if tokens == 0 {
        return Ok(());
    }
    let u = |n: usize| n as u32; // checked to fit above
    let write = |kv: usize| Write {
        shape,
        kv,
        blocks: u(blocks),
        block_tokens: u(block_tokens),
        kv_heads: u(kv_heads),
        head_dim: u(head_dim),
        tokens: u(tokens),
    };
    k_cache.inplace_op3(k, slots, &write(0))?;
    v_cache.inplace_op3(v, slots, &write(1))
}

fn bad(msg: String) -> candle_core::Error {
    candle_core::Error::Msg(format!("paged_kv_write: {msg}"))
}

/// One launch: K (`kv` 0) or V of the tokens into the cache; the sizes checked in
/// [`paged_kv_write`].
struct Write {
    shape: BlockShape,
    kv: usize,
    blocks: u32,
    block_tokens: u32,
    kv_heads: u32,
    head_dim: u32,
    tokens: u32,
}

impl InplaceOp3 for Write {
    fn name(&self) -> &'static str {
        "paged-kv-write"
    }

    fn cpu_fwd(
        &self,
        _: &mut CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
    ) -> candle_core::Result<()> {
        Err(bad("runs on CUDA devices only".into()))
    }

    fn cuda_fwd(
        &self,
        cache: &mut CudaStorage,
        cl: &Layout,
        src: &CudaStorage,
        sl: &Layout,
        slots: &CudaStorage,
        tl: &Layout,
    ) -> candle_core::Result<()> {
        match cache.dtype() {
            DType::F16 => self.launch::<half::f16>(cache, cl, src, sl, slots, tl),
            DType::BF16 => self.launch::<half::bf16>(cache, cl, src, sl, slots, tl),
            other => Err(bad(format!("dtype {other:?} (supported: f16, bf16)"))),
        }
    }
}

impl Write {
    /// The launch over elements of `T` (the kernel copies them as 16-bit words).
    fn launch<T>(
        &self,
        cache: &mut CudaStorage,
        cl: &Layout,
        src: &CudaStorage,
        sl: &Layout,
        slots: &CudaStorage,
        tl: &Layout,
    ) -> candle_core::Result<()>
    where
        T: candle_core::cuda_backend::CudaDType
            + candle_core::cuda_backend::cudarc::driver::DeviceRepr,
    {
        let dev = src.device().clone();
        let src = src.as_cuda_slice::<T>()?.slice(sl.start_offset()..);
        let slots = slots.as_cuda_slice::<u32>()?.slice(tl.start_offset()..);
        let mut cache = cache
            .as_cuda_slice_mut::<T>()?
            .slice_mut(cl.start_offset()..);
        let (name, ptx) = module(self.shape);
        let func = dev.get_or_load_custom_func(
            if self.kv == 0 {
                "evmm_paged_kv_write_k"
            } else {
                "evmm_paged_kv_write_v"
            },
            name,
            ptx,
        )?;
        let mut b = func.builder();
        b.arg(&src)
            .arg(&mut cache)
            .arg(&slots)
            .arg(&self.blocks)
            .arg(&self.block_tokens)
            .arg(&self.kv_heads)
            .arg(&self.head_dim);
        let cfg = LaunchConfig {
            grid_dim: (self.tokens, 1, 1),
            block_dim: (THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: the arguments match the kernel's signature in order and type (its pointers
        // are to 16-bit elements, T's size); `src` holds `tokens * kv_heads * head_dim`
        // elements and the cache `blocks` blocks in `shape`'s order (both checked in
        // `paged_kv_write`, contiguous from their offsets); the kernel writes only slots of
        // blocks below `blocks`, and reads `tokens` slots.
        unsafe { b.launch(cfg) }.w()?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::candle::paged_attention_decode_shaped;
    use candle_core::Device;

    fn zeros(shape: &[usize], dtype: DType) -> Tensor {
        Tensor::zeros(shape, dtype, &Device::Cpu).expect("cpu tensor")
    }

    /// The write's and the shaped decode's argument checks, every block order, run before
    /// anything reaches a device, so they are tested on the CPU (CI has no GPU); a call that
    /// passes them is refused by the CPU path.
    #[test]
    fn each_block_order_is_checked_with_the_shapes_before_any_launch() {
        let bf = DType::BF16;
        let tokens = zeros(&[3, 2, 64], bf);
        let slots = zeros(&[3], DType::U32);
        // 10 blocks of 16 tokens, 2 KV heads of 64, in each order.
        let orders = [
            (
                BlockShape::TokenMajor,
                vec![10, 16, 2, 64],
                vec![10, 16, 2, 64],
            ),
            (
                BlockShape::HeadMajor,
                vec![10, 2, 16, 64],
                vec![10, 2, 16, 64],
            ),
            (
                BlockShape::SplitK,
                vec![10, 2, 8, 16, 8],
                vec![10, 2, 64, 16],
            ),
        ];
        let err = |r: candle_core::Result<()>| r.expect_err("refused").to_string();
        for (shape, k, v) in &orders {
            let (kc, vc) = (zeros(k, bf), zeros(v, bf));
            // Everything matches: only the CPU path refuses.
            assert!(
                err(paged_kv_write(*shape, &tokens, &tokens, &kc, &vc, &slots))
                    .contains("runs on CUDA devices only"),
                "{shape:?}"
            );
            let q = zeros(&[1, 4, 64], bf);
            let table = zeros(&[1, 2], DType::U32);
            let lens = zeros(&[1], DType::U32);
            let e = paged_attention_decode_shaped(*shape, &q, &kc, &vc, &table, &lens, 20, 1.0)
                .expect_err("no CPU path")
                .to_string();
            assert!(e.contains("runs on CUDA devices only"), "{shape:?}: {e}");
            // V of the wrong order.
            let wrong = zeros(&[10, 16, 64, 2], bf);
            let e = err(paged_kv_write(
                *shape, &tokens, &tokens, &kc, &wrong, &slots,
            ));
            assert!(
                e.contains("v_cache [10, 16, 64, 2] does not match k_cache"),
                "{shape:?}: {e}"
            );
        }
        let (kc, vc) = (zeros(&orders[2].1, bf), zeros(&orders[2].2, bf));
        // Split-K tensors named token-major; a 4-d K named split K.
        assert!(err(paged_kv_write(
            BlockShape::TokenMajor,
            &tokens,
            &tokens,
            &kc,
            &vc,
            &slots
        ))
        .contains("k_cache [10, 2, 8, 16, 8] has 5 dimensions, a TokenMajor cache 4"));
        let four = zeros(&orders[0].1, bf);
        assert!(err(paged_kv_write(
            BlockShape::SplitK,
            &tokens,
            &tokens,
            &four,
            &four,
            &slots
        ))
        .contains("k_cache [10, 16, 2, 64] is not split K"));
        // Tokens of another head size, slots of another count, another dtype, a shifted view.
        let narrow = zeros(&[3, 2, 32], bf);
        assert!(err(paged_kv_write(
            BlockShape::SplitK,
            &narrow,
            &narrow,
            &kc,
            &vc,
            &slots
        ))
        .contains("must be [tokens, 2, 64] twice and [tokens]"));
        let two = zeros(&[2], DType::U32);
        assert!(err(paged_kv_write(
            BlockShape::SplitK,
            &tokens,
            &tokens,
            &kc,
            &vc,
            &two
        ))
        .contains("slots [2]"));
        let half = zeros(&[3, 2, 64], DType::F16);
        assert!(err(paged_kv_write(
            BlockShape::SplitK,
            &half,
            &half,
            &kc,
            &vc,
            &slots
        ))
        .contains("k_cache is BF16, not F16"));
        let shifted = zeros(&[3 * 2 * 64 + 1], bf)
            .narrow(0, 1, 3 * 2 * 64)
            .and_then(|t| t.reshape((3, 2, 64)))
            .expect("a shifted view");
        assert!(err(paged_kv_write(
            BlockShape::SplitK,
            &shifted,
            &tokens,
            &kc,
            &vc,
            &slots
        ))
        .contains("k starts 2 bytes into its storage, not a multiple of 16"));
        let i64_slots = zeros(&[3], DType::I64);
        assert!(err(paged_kv_write(
            BlockShape::SplitK,
            &tokens,
            &tokens,
            &kc,
            &vc,
            &i64_slots
        ))
        .contains("slots is I64, not U32"));
        // No tokens: nothing to do, on any device.
        let none = zeros(&[0, 2, 64], bf);
        let no_slots = zeros(&[0], DType::U32);
        paged_kv_write(BlockShape::SplitK, &none, &none, &kc, &vc, &no_slots)
            .expect("an empty write");
    }
}
