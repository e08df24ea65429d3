//! KV-cache layouts: offset views over mapped memory.
//!
//! - [`LayoutConfig`]: the dimensions (blocks, layers, K/V, tokens per block, inner size, dtype
//!   width), validated with checked arithmetic.
//! - [`LayoutKind`]: fully contiguous (`[block][layer][outer][page][inner]`, one region) or
//!   layer separate (a region per layer) with the block dimension first
//!   (`[block][outer][page][inner]`) or second (`[outer][block][page][inner]`).
//! - [`LayoutGeometry`]: where each (block, layer, outer) unit lies; region starts aligned to
//!   [`REGION_ALIGNMENT`] (512 bytes). Pure arithmetic.
//! - [`LayoutBuilder`]: config, then kind, then memory, then build. The memory is a pool
//!   allocation or a fully mapped pool region ([`Layout`]), caller-owned ranges ([`Layout`]),
//!   or a pool region backed block by block on demand ([`ElasticLayout`]); or memory of a
//!   [`StorageKind`] the layout owns: system memory, pinned host memory, a file on disk.
//! - [`copy_blocks`] and [`KvTiers`]: blocks moved between layouts of one geometry on
//!   different storage (device, host, disk), runs merged, checked first, rolled back;
//!   [`KvTiers::start_move`] returns a [`TierMove`] with the copies under way (in stream
//!   order on a device, on I/O threads for disk).
//! - [`LayoutViews`]: a unit, a whole block or a run of consecutive blocks as [`MemoryView`]s,
//!   merged as far as the kind allows.

mod builder;
mod config;
pub(crate) mod copies;
mod elastic;
mod geometry;
mod kind;
mod mapped;
mod place;
mod storage;
mod tier;
mod view;

pub use builder::{
    CallerRegions, ElasticRegion, LayoutBuilder, NoConfig, NoKind, NoMemory, PoolAllocation,
    PoolRegion,
};
pub use config::{LayoutConfig, LayoutSizes, REGION_ALIGNMENT};
pub use copies::{copy_blocks, MoveReport};
pub use elastic::ElasticLayout;
pub use geometry::{LayoutGeometry, Span};
pub use kind::{BlockDim, LayoutKind};
pub use mapped::{Layout, MemoryRange};
pub use place::{DiskStorage, PinnedMemory, SystemMemory};
pub use storage::StorageKind;
pub use tier::{KvTiers, TierBlock, TierMove};
#[cfg(feature = "nixl")]
pub(crate) use view::sealed;
pub use view::{KvLayout, LayoutPin, LayoutViews, MemoryView};
