//! The dimensions of a KV cache and the sizes they imply, validated with checked arithmetic.

use crate::error::{Error, Result};

/// Every layout region starts at a multiple of this many bytes (what vectorized kernels and
/// NIXL's descriptors expect of a tensor's start).
pub const REGION_ALIGNMENT: u64 = 512;

/// The dimensions of a paged KV cache.
///
/// One *unit* is the data of one block in one layer for one outer index (K or V):
/// `page_size * inner_dim * dtype_width_bytes` bytes, always contiguous.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct LayoutConfig {
    /// Blocks in the cache.
    pub num_blocks: usize,
    /// Transformer layers.
    pub num_layers: usize,
    /// 1, or 2 when K and V are kept apart.
    pub outer_dim: usize,
    /// Tokens per block.
    pub page_size: usize,
    /// Elements per token in one layer and outer index (heads times head size).
    pub inner_dim: usize,
    /// Bytes per element.
    pub dtype_width_bytes: usize,
}

/// Sizes derived from a valid [`LayoutConfig`], in bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LayoutSizes {
    /// One block, one layer, one outer index.
    pub unit: u64,
    /// One block in one layer (all outer indices).
    pub block_per_layer: u64,
    /// One block in all layers.
    pub block: u64,
    /// All blocks in one layer (the data of one layer region of a layer-separate layout).
    pub layer: u64,
    /// All data of the cache, without alignment padding.
    pub total: u64,
}

fn mul(what: &'static str, a: u64, b: u64) -> Result<u64> {
    a.checked_mul(b).ok_or_else(|| Error::SizeOverflow {
        what,
        detail: format!("{a} * {b}"),
    })
}

impl LayoutConfig {
    /// A configuration; check it with [`LayoutConfig::sizes`] (the builder does).
    pub fn new(
        num_blocks: usize,
        num_layers: usize,
        outer_dim: usize,
        page_size: usize,
        inner_dim: usize,
        dtype_width_bytes: usize,
    ) -> Self {
        LayoutConfig {
            num_blocks,
            num_layers,
            outer_dim,
            page_size,
            inner_dim,
            dtype_width_bytes,
        }
    }

    /// Validate the dimensions and compute the sizes: a zero dimension, an outer dimension
    /// other than 1 or 2, or a size that does not fit in 64 bits is an error naming the
    /// numbers.
    pub fn sizes(&self) -> Result<LayoutSizes> {
        let dims = [
            ("num_blocks", self.num_blocks),
            ("num_layers", self.num_layers),
            ("outer_dim", self.outer_dim),
            ("page_size", self.page_size),
            ("inner_dim", self.inner_dim),
            ("dtype_width_bytes", self.dtype_width_bytes),
        ];
        if let Some((name, _)) = dims.iter().find(|(_, v)| *v == 0) {
            return Err(Error::InvalidLayout(format!(
                "{name} is 0; every dimension must be at least 1 ({self:?})"
            )));
        }
        if self.outer_dim > 2 {
            return Err(Error::InvalidLayout(format!(
                "outer_dim is {}; it must be 1, or 2 for K and V",
                self.outer_dim
            )));
        }
        let unit = mul(
            "unit bytes (page_size * inner_dim)",
            self.page_size as u64,
            self.inner_dim as u64,
        )?;
        let unit = mul(
            "unit bytes (* dtype_width_bytes)",
            unit,
            self.dtype_width_bytes as u64,
        )?;
        let block_per_layer = mul("block bytes per layer", unit, self.outer_dim as u64)?;
        let block = mul("block bytes", block_per_layer, self.num_layers as u64)?;
        let layer = mul("layer bytes", block_per_layer, self.num_blocks as u64)?;
        let total = mul("total bytes", block, self.num_blocks as u64)?;
        Ok(LayoutSizes {
            unit,
            block_per_layer,
            block,
            layer,
            total,
        })
    }
}

/// `value` rounded up to a multiple of `unit` (a power of two), checked.
pub(crate) fn align_up(what: &'static str, value: u64, unit: u64) -> Result<u64> {
    crate::error::round_up(what, value, unit)
}
