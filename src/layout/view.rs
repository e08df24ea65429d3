//! Views: where a unit, a block or a run of blocks of a layout lies in memory, as offset views
//! of the memory the layout was placed in.

use std::any::Any;
use std::fmt;
use std::sync::Arc;

use super::geometry::{LayoutGeometry, Span};
use super::kind::LayoutKind;
use super::storage::StorageKind;
use super::LayoutConfig;
use crate::backend::MemoryKind;
use crate::backing::{BlockPin, PinRefused};
use crate::error::{Error, Result};

/// A contiguous piece of memory: `len` bytes at `addr` (a device pointer for device memory).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct MemoryView {
    /// Address of the first byte.
    pub addr: u64,
    /// Bytes.
    pub len: u64,
}

impl MemoryView {
    /// One past the last byte; an error with the numbers when it does not fit in 64 bits.
    pub fn end(&self) -> Result<u64> {
        self.addr
            .checked_add(self.len)
            .ok_or_else(|| Error::SizeOverflow {
                what: "memory view end",
                detail: format!("{:#x} + {} bytes", self.addr, self.len),
            })
    }
}

/// A layout placed in memory: its geometry, the address of each region and the kind of memory.
/// Every view is an offset into one region; nothing here owns memory.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LayoutViews {
    geometry: LayoutGeometry,
    bases: Vec<u64>,
    memory: MemoryKind,
    device: Option<i32>,
    storage: StorageKind,
    /// The descriptor of a disk layout's file.
    file: Option<i32>,
}

impl LayoutViews {
    /// `bases[r]` is the address of region `r`; the caller checked there is one per region,
    /// each 512-byte aligned and large enough, and that no address overflows.
    pub(crate) fn new(
        geometry: LayoutGeometry,
        bases: Vec<u64>,
        memory: MemoryKind,
        device: Option<i32>,
    ) -> Self {
        debug_assert_eq!(bases.len(), geometry.num_regions());
        LayoutViews {
            geometry,
            bases,
            memory,
            device,
            storage: StorageKind::of_pool(memory, device),
            file: None,
        }
    }

    /// The same views, of storage `storage` (pinned host memory, a file).
    pub(crate) fn with_storage(mut self, storage: StorageKind) -> Self {
        self.storage = storage;
        self
    }

    /// The views of a disk layout, whose file has descriptor `fd`.
    pub(crate) fn with_file(mut self, fd: i32) -> Self {
        self.file = Some(fd);
        self
    }

    /// The descriptor of a disk layout's file.
    #[cfg_attr(not(feature = "nixl"), allow(dead_code))]
    pub(crate) fn file_fd(&self) -> Option<i32> {
        self.file
    }

    /// Where the bytes live. For [`StorageKind::Disk`] every view is a byte offset in the
    /// layout's file, not an address.
    pub fn storage(&self) -> StorageKind {
        self.storage
    }

    /// Where every unit lies, relative to the regions.
    pub fn geometry(&self) -> &LayoutGeometry {
        &self.geometry
    }

    /// The dimensions.
    pub fn config(&self) -> &LayoutConfig {
        self.geometry.config()
    }

    /// The order of the dimensions.
    pub fn kind(&self) -> LayoutKind {
        self.geometry.kind()
    }

    /// Number of blocks.
    pub fn num_blocks(&self) -> usize {
        self.geometry.config().num_blocks
    }

    /// Host or device memory (all regions of a layout share one kind).
    pub fn memory_kind(&self) -> MemoryKind {
        self.memory
    }

    /// The device ordinal for device memory.
    pub fn device(&self) -> Option<i32> {
        self.device
    }

    /// The regions: one for fully contiguous, one per layer for layer separate.
    pub fn regions(&self) -> Vec<MemoryView> {
        self.bases
            .iter()
            .map(|&addr| MemoryView {
                addr,
                len: self.geometry.region_bytes(),
            })
            .collect()
    }

    fn place(&self, s: Span) -> MemoryView {
        MemoryView {
            addr: self.bases[s.region] + s.offset,
            len: s.len,
        }
    }

    /// The memory of `(block, layer, outer)`: one contiguous view.
    pub fn unit(&self, block: usize, layer: usize, outer: usize) -> Result<MemoryView> {
        Ok(self.place(self.geometry.unit(block, layer, outer)?))
    }

    /// The whole-block views of `block`: one for fully contiguous, one per layer for block
    /// first, one per layer and outer index for block second.
    pub fn block(&self, block: usize) -> Result<Vec<MemoryView>> {
        self.blocks(block, 1)
    }

    /// Block 0's whole-block views and the block stride: view k of block `b` is view k of
    /// block 0 moved by `b * stride` bytes, for every kind (see
    /// [`LayoutGeometry::block_stride`]). What copies of many blocks need, computed once.
    pub(crate) fn block_pattern(&self) -> (Vec<MemoryView>, u64) {
        let mut spans = Vec::new();
        // Block 0 exists in every valid geometry.
        let _ = self.geometry.blocks_into(0, 1, &mut spans);
        (
            spans.into_iter().map(|s| self.place(s)).collect(),
            self.geometry.block_stride(),
        )
    }

    /// The views of `count` consecutive blocks from `first`, merged: as many views as one block
    /// has (see [`LayoutViews::block`]), each `count` times longer.
    pub fn blocks(&self, first: usize, count: usize) -> Result<Vec<MemoryView>> {
        Ok(self
            .geometry
            .blocks(first, count)?
            .into_iter()
            .map(|s| self.place(s))
            .collect())
    }

    /// The views of `blocks` in the order given, with every run of consecutive ascending
    /// indices merged as in [`LayoutViews::blocks`].
    pub fn runs(&self, blocks: &[usize]) -> Result<Vec<MemoryView>> {
        let mut spans = Vec::new();
        let mut i = 0;
        while i < blocks.len() {
            let mut n = 1;
            while i + n < blocks.len() && blocks[i + n - 1].checked_add(1) == Some(blocks[i + n]) {
                n += 1;
            }
            self.geometry.blocks_into(blocks[i], n, &mut spans)?;
            i += n;
        }
        Ok(spans.into_iter().map(|s| self.place(s)).collect())
    }

    /// Every unit of `blocks`, block by block in the order given, then layer, then outer
    /// index: the order in which two layouts of one shape but different kinds correspond.
    pub fn units_of(&self, blocks: &[usize]) -> Result<Vec<MemoryView>> {
        let c = self.geometry.config();
        let per_block = c.num_layers.saturating_mul(c.outer_dim);
        let mut out = Vec::with_capacity(blocks.len().saturating_mul(per_block).min(1 << 20));
        for &b in blocks {
            for l in 0..c.num_layers {
                for o in 0..c.outer_dim {
                    out.push(self.unit(b, l, o)?);
                }
            }
        }
        Ok(out)
    }

    /// The region holding `[addr, addr + len)`, if one does, and the offset in it.
    pub(crate) fn locate(&self, addr: u64, len: u64) -> Option<(usize, u64)> {
        let size = self.geometry.region_bytes();
        self.bases.iter().enumerate().find_map(|(r, &base)| {
            let off = addr.checked_sub(base)?;
            (off.checked_add(len)? <= size).then_some((r, off))
        })
    }
}

/// What a transfer needs of a layout: its views, and pins that keep blocks' memory (and its
/// NIXL registrations) alive while NIXL may touch it.
///
/// Sealed: implemented by [`crate::layout::ElasticLayout`] and, with the `nixl` feature,
/// `nixl::RegisteredLayout`. A safe transfer trusts these implementations to pin what their
/// views point at, so no other type may implement it.
pub trait KvLayout: Send + Sync + sealed::Sealed {
    /// Where everything lies.
    fn views(&self) -> &LayoutViews;

    /// Pin `blocks` for `holder` (a name for errors): none of them can be released, and the
    /// memory under them and its registrations stay, until the pin is dropped. A block without
    /// memory is an error naming it, and nothing is pinned.
    fn pin(&self, blocks: &[usize], holder: &str) -> Result<LayoutPin> {
        self.pin_blocks(blocks, holder).map_err(|e| match e {
            PinRefused::NotBacked(block) => Error::InvalidArgument(format!(
                "block {block} is not backed: pin of {} blocks for {holder} refused, nothing pinned",
                blocks.len()
            )),
            PinRefused::Invalid(e) => e,
        })
    }
}

pub(crate) mod sealed {
    use super::LayoutPin;
    use crate::backing::PinRefused;

    /// The crate-private half of [`super::KvLayout`].
    pub trait Sealed {
        /// Pin `blocks`, telling a block without memory apart from bad input.
        fn pin_blocks(&self, blocks: &[usize], holder: &str) -> Result<LayoutPin, PinRefused>;

        /// The pool the layout's memory comes from (`None`: memory the caller owns), whose
        /// backend can copy it.
        #[cfg_attr(not(feature = "nixl"), allow(dead_code))]
        fn pool_of(&self) -> Option<&crate::Pool>;
    }
}

/// Blocks of a layout held by a consumer (see [`KvLayout::pin`]); dropping it lets them go.
pub struct LayoutPin {
    _held: Held,
}

/// What a pin keeps.
enum Held {
    /// Pinned blocks of a block backing (which they keep alive).
    Blocks(BlockPin),
    /// The owner of fully mapped, registered memory: nothing of it goes while this lives.
    Owner { _owner: Arc<dyn Any + Send + Sync> },
}

impl LayoutPin {
    pub(crate) fn blocks(pin: BlockPin) -> Self {
        LayoutPin {
            _held: Held::Blocks(pin),
        }
    }

    // Used by `nixl::RegisteredLayout`.
    #[cfg_attr(not(feature = "nixl"), allow(dead_code))]
    pub(crate) fn owner(owner: Arc<dyn Any + Send + Sync>) -> Self {
        LayoutPin {
            _held: Held::Owner { _owner: owner },
        }
    }
}

impl fmt::Debug for LayoutPin {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self._held {
            Held::Blocks(p) => f.debug_tuple("LayoutPin").field(p).finish(),
            Held::Owner { .. } => f.write_str("LayoutPin(owner)"),
        }
    }
}
