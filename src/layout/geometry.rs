//! Where every (block, layer, outer) unit of a layout lies: pure arithmetic, no memory.

use super::config::{align_up, LayoutConfig, LayoutSizes, REGION_ALIGNMENT};
use super::kind::{BlockDim, LayoutKind};
use crate::backing::BlockGeometry;
use crate::error::{Error, Result};

/// A contiguous piece of a layout: `len` bytes at `offset` in region `region`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Span {
    /// The layout region (0 for fully contiguous, the layer for layer separate).
    pub region: usize,
    /// Offset in that region.
    pub offset: u64,
    /// Bytes.
    pub len: u64,
}

/// A validated config and kind, with every size computed once.
///
/// When the layout is carved out of one contiguous range, region `r` starts at
/// [`LayoutGeometry::region_offset`]`(r)`: region sizes rounded up to [`REGION_ALIGNMENT`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LayoutGeometry {
    config: LayoutConfig,
    kind: LayoutKind,
    sizes: LayoutSizes,
    regions: usize,
    region_bytes: u64,
    region_stride: u64,
    extent: u64,
}

impl LayoutGeometry {
    /// Validate `config` and place it as `kind` says.
    pub fn new(config: LayoutConfig, kind: LayoutKind) -> Result<Self> {
        let sizes = config.sizes()?;
        let regions = kind.num_regions(config.num_layers);
        let region_bytes = match kind {
            LayoutKind::FullyContiguous => sizes.total,
            LayoutKind::LayerSeparate(_) => sizes.layer,
        };
        let region_stride = align_up("layout region stride", region_bytes, REGION_ALIGNMENT)?;
        let extent = (regions as u64 - 1)
            .checked_mul(region_stride)
            .and_then(|v| v.checked_add(region_bytes))
            .ok_or_else(|| Error::SizeOverflow {
                what: "layout extent",
                detail: format!("{regions} regions of {region_stride} bytes"),
            })?;
        Ok(LayoutGeometry {
            config,
            kind,
            sizes,
            regions,
            region_bytes,
            region_stride,
            extent,
        })
    }

    /// The dimensions.
    pub fn config(&self) -> &LayoutConfig {
        &self.config
    }

    /// The order of the dimensions.
    pub fn kind(&self) -> LayoutKind {
        self.kind
    }

    /// The derived sizes.
    pub fn sizes(&self) -> &LayoutSizes {
        &self.sizes
    }

    /// Number of regions: 1 for fully contiguous, `num_layers` for layer separate.
    pub fn num_regions(&self) -> usize {
        self.regions
    }

    /// Bytes of data in each region.
    pub fn region_bytes(&self) -> u64 {
        self.region_bytes
    }

    /// Offset of region `r` when the layout is carved out of one range (512-byte aligned).
    pub fn region_offset(&self, r: usize) -> u64 {
        r as u64 * self.region_stride
    }

    /// Bytes of one range that holds every region, padding between them included.
    pub fn extent(&self) -> u64 {
        self.extent
    }

    /// Bytes between a view of block `b` and the same view of block `b + 1`: every kind lays
    /// its blocks out at one stride in each region (a block for fully contiguous, a block's
    /// layer for block first, a unit for block second).
    pub(crate) fn block_stride(&self) -> u64 {
        match self.kind {
            LayoutKind::FullyContiguous => self.sizes.block,
            LayoutKind::LayerSeparate(BlockDim::First) => self.sizes.block_per_layer,
            LayoutKind::LayerSeparate(BlockDim::Second) => self.sizes.unit,
        }
    }

    /// Block 0's whole-block spans as `(offset, len)` relative to the start of one range
    /// holding every region (see [`LayoutGeometry::region_offset`]), and the block stride:
    /// span k of block `b` is span k of block 0 moved by `b * stride`
    /// ([`LayoutGeometry::block_stride`]), in every kind.
    pub(crate) fn block_pattern(&self) -> (Vec<(u64, u64)>, u64) {
        let mut spans = Vec::new();
        self.block_spans(0, &mut spans);
        (spans, self.block_stride())
    }

    fn check(what: &'static str, index: usize, count: usize) -> Result<()> {
        if index >= count {
            return Err(Error::OutOfLayout { what, index, count });
        }
        Ok(())
    }

    /// The unit of `(block, layer, outer)`: one contiguous span.
    pub fn unit(&self, block: usize, layer: usize, outer: usize) -> Result<Span> {
        let c = &self.config;
        Self::check("block", block, c.num_blocks)?;
        Self::check("layer", layer, c.num_layers)?;
        Self::check("outer index", outer, c.outer_dim)?;
        let (b, l, o) = (block as u64, layer as u64, outer as u64);
        let (nb, nl, no) = (c.num_blocks as u64, c.num_layers as u64, c.outer_dim as u64);
        let unit = self.sizes.unit;
        // Every product is below a size validated in `new`.
        let (region, index) = match self.kind {
            LayoutKind::FullyContiguous => (0, (b * nl + l) * no + o),
            LayoutKind::LayerSeparate(BlockDim::First) => (layer, b * no + o),
            LayoutKind::LayerSeparate(BlockDim::Second) => (layer, o * nb + b),
        };
        Ok(Span {
            region,
            offset: index * unit,
            len: unit,
        })
    }

    /// The spans of `count` consecutive blocks starting at `first`, as few as the layout
    /// allows: one for fully contiguous, one per layer for block first, one per layer and
    /// outer index for block second. `count == 1` gives the whole-block spans.
    pub fn blocks(&self, first: usize, count: usize) -> Result<Vec<Span>> {
        let mut out = Vec::new();
        self.blocks_into(first, count, &mut out)?;
        Ok(out)
    }

    /// As [`LayoutGeometry::blocks`], appending to `out`.
    pub fn blocks_into(&self, first: usize, count: usize, out: &mut Vec<Span>) -> Result<()> {
        let c = &self.config;
        if count == 0 {
            return Err(Error::InvalidArgument(format!(
                "a run of 0 blocks from block {first} refused: a run holds 1 to {} blocks",
                c.num_blocks
            )));
        }
        Self::check("block", first, c.num_blocks)?;
        let Some(last) = first.checked_add(count - 1) else {
            return Err(Error::InvalidArgument(format!(
                "a run of {count} blocks from block {first} ends past the last block: the layout has {}",
                c.num_blocks
            )));
        };
        Self::check("block", last, c.num_blocks)?;
        let (f, n) = (first as u64, count as u64);
        let s = &self.sizes;
        match self.kind {
            LayoutKind::FullyContiguous => out.push(Span {
                region: 0,
                offset: f * s.block,
                len: n * s.block,
            }),
            LayoutKind::LayerSeparate(BlockDim::First) => {
                out.extend((0..c.num_layers).map(|layer| Span {
                    region: layer,
                    offset: f * s.block_per_layer,
                    len: n * s.block_per_layer,
                }))
            }
            LayoutKind::LayerSeparate(BlockDim::Second) => {
                for layer in 0..c.num_layers {
                    out.extend((0..c.outer_dim as u64).map(|o| Span {
                        region: layer,
                        offset: (o * c.num_blocks as u64 + f) * s.unit,
                        len: n * s.unit,
                    }));
                }
            }
        }
        Ok(())
    }
}

/// Block `b`'s spans relative to the start of one range holding every region: what elastic
/// backing needs to know which pages a block touches.
impl BlockGeometry for LayoutGeometry {
    fn num_blocks(&self) -> usize {
        self.config.num_blocks
    }

    fn extent(&self) -> Result<u64> {
        Ok(self.extent)
    }

    fn block_spans(&self, block: usize, out: &mut Vec<(u64, u64)>) {
        let mut spans = Vec::new();
        // Only called with a valid block (BlockGeometry's contract), so this cannot fail.
        if self.blocks_into(block, 1, &mut spans).is_ok() {
            out.extend(
                spans
                    .iter()
                    .map(|s| (self.region_offset(s.region) + s.offset, s.len)),
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every block's spans are block 0's moved by `b * stride`, in every kind.
    #[test]
    fn blocks_are_the_pattern_shifted_by_the_stride() {
        let kinds = [
            LayoutKind::FullyContiguous,
            LayoutKind::LayerSeparate(BlockDim::First),
            LayoutKind::LayerSeparate(BlockDim::Second),
        ];
        for kind in kinds {
            for config in [
                LayoutConfig::new(7, 3, 2, 4, 5, 3),
                LayoutConfig::new(1, 1, 1, 1, 1, 1),
                LayoutConfig::new(33, 2, 1, 16, 64, 2),
            ] {
                let g = LayoutGeometry::new(config, kind).unwrap();
                let (pattern, stride) = g.block_pattern();
                assert_eq!(pattern.len(), g.blocks(0, 1).unwrap().len());
                for b in 0..config.num_blocks {
                    let mut spans = Vec::new();
                    g.block_spans(b, &mut spans);
                    let moved: Vec<(u64, u64)> = pattern
                        .iter()
                        .map(|&(o, l)| (o + b as u64 * stride, l))
                        .collect();
                    assert_eq!(spans, moved, "{kind} {config:?} block {b}");
                }
            }
        }
    }
}
