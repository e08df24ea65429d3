//! Checks the paged-attention ops share on their operands before a launch (the decode op in
//! `attention.rs`, the prefill op in `prefill.rs`): each returns the first failure's message,
//! which the op prefixes with its name.

use candle_core::{CudaStorage, DType, Storage, Tensor};

/// The query, the cache and the index tensors of a launch: each of `typed` has its dtype and is
/// on q's device, q is f16 or bf16, each of `dense` (q among them) is contiguous, and q, K and V
/// (`vectors`) start 16-byte aligned in their storage.
pub(super) fn check(
    q: &Tensor,
    typed: &[(&str, &Tensor, DType)],
    dense: &[(&str, &Tensor)],
    vectors: &[(&str, &Tensor)],
) -> Result<(), String> {
    for &(what, t, want) in typed {
        if t.dtype() != want {
            return Err(format!("{what} is {:?}, not {want:?}", t.dtype()));
        }
        if !t.device().same_device(q.device()) {
            return Err(format!("{what} is on another device than q"));
        }
    }
    if !matches!(q.dtype(), DType::F16 | DType::BF16) {
        return Err(format!("dtype {:?} (supported: f16, bf16)", q.dtype()));
    }
    for &(what, t) in dense {
        if !t.is_contiguous() {
            return Err(format!("{what} is not contiguous"));
        }
    }
    // The kernels read q, K and V 16 bytes at a time: a view starting inside an element group
    // would be a misaligned load (a fault that ends the CUDA context).
    for &(what, t) in vectors {
        let at = t.layout().start_offset() * t.dtype().size_in_bytes();
        if at % 16 != 0 {
            return Err(format!(
                "{what} starts {at} bytes into its storage, not a multiple of 16"
            ));
        }
    }
    Ok(())
}

/// The CUDA storage of a tensor's storage, or the message why not.
pub(super) fn cuda(s: &Storage) -> Result<&CudaStorage, String> {
    match s {
        Storage::Cuda(c) => Ok(c),
        _ => Err("a tensor is not on a CUDA device".into()),
    }
}
