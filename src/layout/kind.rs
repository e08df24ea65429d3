//! How the dimensions of a KV cache are ordered in memory.

use std::fmt;

/// Where the block dimension sits in a layer-separate layout.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum BlockDim {
    /// `[block][outer][page][inner]` per layer: a block is one contiguous span per layer.
    First,
    /// `[outer][block][page][inner]` per layer: a block is `outer_dim` spans per layer.
    Second,
}

/// The order of the dimensions of a KV cache in memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum LayoutKind {
    /// One region, `[block][layer][outer][page][inner]`: a block is one contiguous span.
    FullyContiguous,
    /// One region per layer, ordered as [`BlockDim`] says.
    LayerSeparate(BlockDim),
}

impl LayoutKind {
    /// Regions the layout has for `num_layers` layers.
    pub fn num_regions(self, num_layers: usize) -> usize {
        match self {
            LayoutKind::FullyContiguous => 1,
            LayoutKind::LayerSeparate(_) => num_layers,
        }
    }
}

impl fmt::Display for LayoutKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            LayoutKind::FullyContiguous => "fully contiguous [block][layer][outer][page][inner]",
            LayoutKind::LayerSeparate(BlockDim::First) => {
                "layer separate, block first [layer]:[block][outer][page][inner]"
            }
            LayoutKind::LayerSeparate(BlockDim::Second) => {
                "layer separate, block second [layer]:[outer][block][page][inner]"
            }
        })
    }
}
