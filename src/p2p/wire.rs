//! The protocol between two engines: `postcard` messages in frames ([`crate::ipc`]), chunks as
//! descriptors attached to `Chunks` frames. Every number from the wire is checked by the
//! receiving side before use.

use serde::{Deserialize, Serialize};

use crate::backend::{AccessMode, DeviceReach, MemoryKind};
use crate::error::{Error, Result};
use crate::layout::{BlockDim, LayoutConfig, LayoutKind};

/// Protocol version; a peer with another one is refused at hello.
pub(crate) const VERSION: u32 = 5;
/// Most blocks in one grant: 4 GiB of 64 KiB blocks, a million tokens in 16-token blocks.
pub const MAX_GRANT_BLOCKS: usize = 64 * 1024;
/// Most block indices in one frame (at most 10 bytes each as postcard varints: 40 KiB, under
/// [`crate::ipc::MAX_FRAME`]); a longer list goes in [`Msg::Blocks`] frames before the grant.
pub(crate) const BLOCKS_PER_FRAME: usize = 4096;
/// Most chunks in one grant (sent [`crate::ipc::MAX_FDS`] to a frame).
pub const MAX_GRANT_CHUNKS: usize = 16 * 1024;
/// Most grants a peer may have half sent at once.
pub(crate) const MAX_PARTIAL_GRANTS: usize = 64;
/// Most complete grants a receiver holds before the application takes them
/// ([`crate::p2p::PeerLink::recv_grant`]); a grant beyond them is refused to its sender.
pub(crate) const MAX_QUEUED_GRANTS: usize = 256;
/// Most block indices those grants hold together (2 MiB of them).
pub(crate) const MAX_QUEUED_BLOCKS: usize = 4 * MAX_GRANT_BLOCKS;
/// Most chunks those grants hold together (each may hold a descriptor).
pub(crate) const MAX_QUEUED_CHUNKS: usize = 4 * MAX_GRANT_CHUNKS;
/// Most chunks a receiver keeps imported for one peer (512 GiB of 2 MiB pages): beyond them a
/// chunk sent to be kept is imported for its grant alone and the sender told it was not kept
/// ([`Msg::Forgot`]), so a peer cannot grow the imports (and their descriptors) without limit.
/// Smaller in unit tests, which reach it.
pub(crate) const MAX_KEPT_IMPORTS: usize = if cfg!(test) { 64 } else { 256 * 1024 };

/// Host or device memory, on the wire.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) enum WireMemory {
    Host,
    Device,
}

impl From<MemoryKind> for WireMemory {
    fn from(k: MemoryKind) -> Self {
        match k {
            MemoryKind::Host => WireMemory::Host,
            MemoryKind::Device => WireMemory::Device,
        }
    }
}

impl From<WireMemory> for MemoryKind {
    fn from(k: WireMemory) -> Self {
        match k {
            WireMemory::Host => MemoryKind::Host,
            WireMemory::Device => MemoryKind::Device,
        }
    }
}

/// What each side says of itself when the link opens.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct Hello {
    pub(crate) version: u32,
    pub(crate) name: String,
    /// The kernel's boot id: two processes with the same one run on the same node.
    pub(crate) boot_id: String,
    pub(crate) memory: WireMemory,
    pub(crate) device: Option<i32>,
    pub(crate) granularity: u64,
    /// Whether this side's backend can export and import chunks as POSIX descriptors.
    pub(crate) exportable: bool,
    // Its shape stays as in version 3, so that a peer of another version decodes it and names
    // the versions (what was added since comes in the frames after it).
}

/// How one side's device reaches the other side's GPU, on the wire (after the hellos).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) enum WireReach {
    Same,
    Peer(i32),
    NoPeerAccess(i32),
    NotVisible,
    NoDevice,
}

impl From<DeviceReach> for WireReach {
    fn from(r: DeviceReach) -> Self {
        match r {
            DeviceReach::Same => WireReach::Same,
            DeviceReach::Peer { ordinal } => WireReach::Peer(ordinal),
            DeviceReach::NoPeerAccess { ordinal } => WireReach::NoPeerAccess(ordinal),
            DeviceReach::NotVisible => WireReach::NotVisible,
            DeviceReach::NoDevice => WireReach::NoDevice,
        }
    }
}

impl From<WireReach> for DeviceReach {
    fn from(r: WireReach) -> Self {
        match r {
            WireReach::Same => DeviceReach::Same,
            WireReach::Peer(ordinal) => DeviceReach::Peer { ordinal },
            WireReach::NoPeerAccess(ordinal) => DeviceReach::NoPeerAccess { ordinal },
            WireReach::NotVisible => DeviceReach::NotVisible,
            WireReach::NoDevice => DeviceReach::NoDevice,
        }
    }
}

/// The order of a layout's dimensions, on the wire.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) enum WireKind {
    FullyContiguous,
    LayerSeparateBlockFirst,
    LayerSeparateBlockSecond,
}

impl From<LayoutKind> for WireKind {
    fn from(k: LayoutKind) -> Self {
        match k {
            LayoutKind::FullyContiguous => WireKind::FullyContiguous,
            LayoutKind::LayerSeparate(BlockDim::First) => WireKind::LayerSeparateBlockFirst,
            LayoutKind::LayerSeparate(BlockDim::Second) => WireKind::LayerSeparateBlockSecond,
        }
    }
}

impl From<WireKind> for LayoutKind {
    fn from(k: WireKind) -> Self {
        match k {
            WireKind::FullyContiguous => LayoutKind::FullyContiguous,
            WireKind::LayerSeparateBlockFirst => LayoutKind::LayerSeparate(BlockDim::First),
            WireKind::LayerSeparateBlockSecond => LayoutKind::LayerSeparate(BlockDim::Second),
        }
    }
}

/// A layout's dimensions and kind, on the wire.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct WireLayout {
    pub(crate) dims: [u64; 6],
    pub(crate) kind: WireKind,
}

impl WireLayout {
    pub(crate) fn of(config: &LayoutConfig, kind: LayoutKind) -> Self {
        WireLayout {
            dims: [
                config.num_blocks as u64,
                config.num_layers as u64,
                config.outer_dim as u64,
                config.page_size as u64,
                config.inner_dim as u64,
                config.dtype_width_bytes as u64,
            ],
            kind: kind.into(),
        }
    }

    /// The config, each dimension checked to fit this machine's `usize`.
    pub(crate) fn config(&self) -> Result<LayoutConfig> {
        let mut d = [0usize; 6];
        for (i, (&v, out)) in self.dims.iter().zip(d.iter_mut()).enumerate() {
            *out = usize::try_from(v).map_err(|_| {
                Error::InvalidArgument(format!("layout dimension {i} of {v} does not fit usize"))
            })?;
        }
        Ok(LayoutConfig::new(d[0], d[1], d[2], d[3], d[4], d[5]))
    }
}

/// What the receiver may do with a grant.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum GrantMode {
    /// Map and copy; the sender keeps its blocks.
    Copy,
    /// Take the chunks over without a copy: the receiver maps them into its own layout, the
    /// sender releases its blocks and lets go of the chunks.
    HandOff,
}

/// One message.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) enum Msg {
    Hello(Hello),
    /// Chunks of grant `grant`, in order: each chunk's offset in the sender's layout range, its
    /// size, and how it comes (one descriptor attached per [`WireChunk::New`] and
    /// [`WireChunk::Keep`], in order).
    Chunks {
        grant: u64,
        offsets: Vec<u64>,
        sizes: Vec<u64>,
        how: Vec<WireChunk>,
    },
    /// Block indices of grant `grant` ahead of its [`Msg::Grant`], in order, where the list is
    /// longer than [`BLOCKS_PER_FRAME`].
    Blocks {
        grant: u64,
        blocks: Vec<u64>,
    },
    /// The grant is complete: `chunks` chunks were sent before it; its blocks are those of the
    /// [`Msg::Blocks`] before it, then `blocks`.
    Grant {
        grant: u64,
        mode: GrantMode,
        access: AccessMode,
        layout: WireLayout,
        blocks: Vec<u64>,
        chunks: u64,
    },
    /// The sender asks the receiver to let go of a grant.
    Revoke {
        grant: u64,
    },
    /// The receiver holds nothing of the grant any more (unmapped, descriptors closed).
    Released {
        grant: u64,
    },
    /// The receiver took the chunks of a hand-off over: the sender releases its blocks and
    /// lets go of them (they must never be reused there).
    Adopted {
        grant: u64,
    },
    /// The receiver could not import the grant; it maps nothing of it (chunks sent to be kept
    /// stay kept, or are forgotten).
    Refused {
        grant: u64,
        reason: String,
    },
    /// The sender released these kept chunks: the receiver lets go of its imports once no
    /// mapping uses them, then answers [`Msg::Forgot`].
    Forget {
        keys: Vec<u64>,
    },
    /// The receiver holds no import of these kept chunks any more.
    Forgot {
        keys: Vec<u64>,
    },
    /// The link is ending: no grant follows; what the sender of it owed went before it. Each
    /// side answers what it owes, says it too, and the socket closes once both have.
    Bye,
    /// Right after the hello: the sender's GPU by UUID (ordinals differ between processes);
    /// `None` for host memory.
    Device(Option<[u8; 16]>),
    /// After both sides' [`Msg::Device`]: how the sender of it reaches the other side's GPU,
    /// so both know each direction's path.
    Reach(WireReach),
}

/// How one chunk of a grant comes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) enum WireChunk {
    /// A descriptor, imported for this grant only (hand-offs).
    New,
    /// A descriptor: import it and keep the import under the key after the grant ends, until
    /// the sender says [`Msg::Forget`].
    Keep(u64),
    /// No descriptor: the receiver kept this chunk imported under the key.
    Kept(u64),
}

impl WireChunk {
    /// Whether a descriptor comes with it.
    pub(crate) fn has_fd(self) -> bool {
        !matches!(self, WireChunk::Kept(_))
    }

    /// The key it is kept under, if kept.
    pub(crate) fn key(self) -> Option<u64> {
        match self {
            WireChunk::New => None,
            WireChunk::Keep(k) | WireChunk::Kept(k) => Some(k),
        }
    }
}
