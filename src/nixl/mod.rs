//! NIXL (feature `nixl`): mapped memory registered with a NIXL agent, one registration per
//! physical chunk, and block transfers between layouts.
//!
//! - Device memory is registered as `VRAM` with its device id, host memory as `DRAM`.
//! - One registration per physical chunk: UCX exports only the first handle of a range backed
//!   by several, so a view across two chunks gives two descriptors.
//! - A registration lives exactly as long as its mapping: an elastic layout registers through
//!   [`NixlAgent::mapping_hook`] (each page registered after it is mapped, deregistered before
//!   it is unmapped: on release, rollback and drop); a fully mapped [`crate::layout::Layout`]
//!   is owned by its [`RegisteredLayout`], which deregisters before the memory goes.
//! - Descriptors for a view come from the registrations that contain it
//!   ([`NixlAgent::descriptors`]), never from a second registration.
//! - [`transfer_blocks`]: WRITE or READ blocks between two layouts of two agents. It pins the
//!   blocks of both sides first (an unbacked block is refused before NIXL is called, a release
//!   of a pinned one is an [`crate::Error::BlockPinned`]) and keeps the pins until NIXL reports
//!   the request finished: after a timeout the request and its pins wait on the agent's list of
//!   pending transfers ([`NixlAgent::pending_transfers`], [`NixlAgent::reap_transfers`]), since
//!   NIXL cannot promise that cancelling a running request stops it.
//! - The path ([`TransferVia`], [`TransferReport::path`]): device memory never moves silently
//!   at TCP speed. Between two agents of one process UCX moves it only by software emulation
//!   over TCP loopback (0.3-0.5 GB/s on an H100), so by default the crate copies it on the
//!   device itself, or refuses where it cannot, naming the override.
//! - Only this crate's layouts take part in transfers ([`crate::layout::KvLayout`] is sealed),
//!   so every byte NIXL touches is pinned by its owner; memory the caller owns enters only
//!   through the `unsafe` [`crate::layout::LayoutBuilder::regions`].
//!
//! Locks: an agent's metadata gate (held across NIXL calls that use a remote's metadata) comes
//! before its bookkeeping mutexes (registrations, loaded metadata, pending transfers), each
//! taken alone and never across a NIXL call; hooks run with no block backing lock held.
//!
//! Without the NIXL library (`libnixl_capi.so` on the library path) any NIXL call aborts the
//! process, so every entry point checks [`available`] first and returns
//! [`crate::Error::NixlUnavailable`].
//!
//! ```no_run
//! use elastic_vmm::layout::{BlockDim, LayoutBuilder, LayoutConfig};
//! use elastic_vmm::nixl::{transfer_blocks, BlockSet, NixlAgent, TransferOp};
//! use elastic_vmm::{MemOptions, Pool};
//! # fn main() -> elastic_vmm::Result<()> {
//! let pool = Pool::host(1 << 30)?;
//! let (a, b) = (NixlAgent::new("prefill")?, NixlAgent::new("decode")?);
//! let config = LayoutConfig::new(64, 4, 2, 16, 128, 2);
//! let src = a.register(LayoutBuilder::new().config(config).fully_contiguous().allocate(&pool, &MemOptions::new()).build()?)?;
//! let dst = LayoutBuilder::new()
//!     .config(config)
//!     .layer_separate(BlockDim::First)
//!     .elastic(&pool, &MemOptions::new())
//!     .hook(b.mapping_hook())
//!     .build()?;
//! dst.ensure_backed([7, 8])?; // mapped and registered with `b`, page by page
//! let done = transfer_blocks(
//!     TransferOp::Write,
//!     BlockSet { agent: &a, layout: &src, blocks: &[0, 1] },
//!     BlockSet { agent: &b, layout: &dst, blocks: &[7, 8] },
//!     std::time::Duration::from_secs(10),
//! )?;
//! println!("{} bytes in {:?}", done.bytes, done.elapsed);
//! # Ok(()) }
//! ```

mod agent;
mod hook;
mod path;
mod registered;
mod registry;
mod transfer;

pub use agent::{available, mem_type_of, NixlAgent};
pub use path::{TransferPath, TransferVia, VIA_ENV};
pub use registered::RegisteredLayout;
pub use registry::NixlDescriptor;
pub use transfer::{transfer_blocks, transfer_blocks_via, BlockSet, TransferOp, TransferReport};

/// The nixl-sys crate, for what this module does not wrap (check [`available`] first).
pub use nixl_sys as sys;
