//! KV blocks moving between engine processes on one node at device speed (prefill to decode).
//!
//! NIXL moves blocks across nodes. Between two processes on one node it moves VMM memory by
//! software emulation where UCX has no POSIX-fd VMM path (0.5 GB/s measured on an H100 against
//! 1476 GB/s for this path). Here the sender exports the physical chunks under the blocks as
//! POSIX descriptors and sends them over a Unix socket ([`crate::ipc`], `SCM_RIGHTS`); the
//! receiver imports and maps them (read-only when so granted, else refused: never writable) and
//! copies the blocks
//! into its own layout itself, in stream order on the GPU (device to device, or over NVLink
//! with peer access when the two engines use two GPUs).
//!
//! ```text
//! prefill                                   decode
//! PeerLink::connect / accept  <-- hello -->  PeerLink::accept / connect   (path chosen, logged)
//! link.grant(&kv, &blocks, ReadOnly)         (pins, exports, sends)
//!                                            g = link.recv_grant(timeout)   (imports, maps)
//!                                            g.copy_into(&kv, &mine, CopyStream::LEGACY)?.wait()?
//!                                            drop(g)                        (unmaps; chunks stay imported)
//! grant.wait_released(timeout)               (pins dropped)
//! ```
//!
//! Any mapped range of a pool goes the same way ([`PeerLink::grant_range`],
//! [`ImportedGrant::copy_to`]).
//!
//! Ownership hand-off ([`PeerLink::hand_off`], [`ImportedGrant::adopt_into`]): the chunks
//! become the receiver's, mapped under its blocks and charged to its pool; the sender releases
//! its blocks and lets go of the chunks without caching them. Chunks lent by a broker
//! ([`crate::backend::Backend::chunk_lender`]) never change hands this way: released, they go
//! back to the broker, which hands them to other engines.
//!
//! # Kept imports
//! Importing costs a driver call per chunk (about 75-80 µs on the H100) and a prefill engine
//! grants the same pages again and again, so the receiver keeps the chunks of copy grants
//! imported, not mapped, after the grant goes, and the sender sends later grants of them as
//! keys, without descriptors ([`crate::p2p::Grant::descriptors`],
//! [`ImportedGrant::kept_chunks`]): a steady stream of grants imports each page once. Their
//! memory stays alive while the peer keeps them, so a pool that releases such a chunk holds it
//! back, still charged ([`crate::PoolStats::peer_held`]), until the peer forgot it; a link that
//! ends asks the peer to forget everything, and a peer that exits lets go with its process.
//! Hand-offs are never kept. See `cache.rs`.
//!
//! # Who may link
//! A process of our own (effective) user, as the kernel reports it (`SO_PEERCRED`), checked by
//! both ends before any hello; other users only where [`LinkOptions::allow_uid`] allows them.
//! [`listen`] creates its socket with mode 0600 from the start. The books below isolate
//! cooperating engines; they cannot protect memory from a peer that keeps a mapping after it
//! said it let go (README, "Security model").
//!
//! # Safety and books
//! - The sender's granted blocks are pinned ([`crate::BlockBacking::pin`]) from before any
//!   export until the receiver says it let go ([`GrantStatus::Released`]), refused the grant,
//!   or its process exited (watched with a pidfd): none can be released meanwhile, so no chunk
//!   under them is reused while the peer may map it. [`Grant::revoke`] asks the receiver to let
//!   go and waits until its mapping is gone.
//! - The receiver's destination blocks and the imported mapping are held by the
//!   [`Completion`] until the copies completed (a drop waits too).
//! - A link that ends drops the grants received and not taken; a grant taken refuses new
//!   copies once its sender is gone, and is unmapped when dropped.
//! - [`LinkStats`] counts what the peer may still map of ours (`granted_bytes`), what it keeps
//!   imported (`peer_kept_bytes`), what we map of the peer's (`imported_bytes`) and what we keep
//!   imported (`kept_import_bytes`).
//! - A link ends with a bye each way ([`PeerLink`]'s drop, or the peer's): answers in flight
//!   (releases, forgotten imports) arrive before the socket closes.
//!
//! # Engines
//! The receiver's import mirrors the sender's layout range, so a granted block is one address
//! and its spans are the layout's block-0 pattern moved by a stride. A copy is that pattern and
//! one shift per block pair, built in O(blocks) ([`ImportedGrant::copy_into`]): few large runs
//! go to `cuMemcpyAsync`, everything else to one launch of the gather kernel
//! ([`crate::backend::Copies::gather_async`]); [`CopyReport::engine`] says which, and
//! [`EngineChoice`] forces one. Destinations are claimed by block (or by range for
//! [`ImportedGrant::copy_to`]): two copies in flight into the same bytes are refused.
//!
//! # Path
//! [`choose_path`] picks [`TransferPath::PeerImport`] from a sender to a receiver when both
//! run on one node (same boot id), hold the same kind of memory, can export chunks as
//! descriptors and (GPUs) the receiver's device reaches the sender's GPU, found by UUID since
//! ordinals are per process: the same GPU, or another with peer access
//! ([`crate::DeviceReach`]); [`TransferPath::Nixl`] otherwise. A link decides at hello for
//! each direction ([`PeerLink::path`] for our grants, refused unless `PeerImport`, and
//! [`PeerLink::path_in`] for the peer's) and logs both with their reasons; every
//! [`CopyReport`] carries the incoming one.
//!
//! # Locking
//! A link's state mutex is a leaf guarding bookkeeping only: pins, mappings and descriptors are
//! taken out under it and dropped after it is released; no driver call or socket write happens
//! under it. It is never held while a backing's or a pool's lock is taken. A link's send lock
//! comes before it (a grant decides which chunks go as keys and queues its messages under it;
//! no driver call there). The kept-imports registry (`cache.rs`) is a leaf too, taken under a
//! pool's state lock or a link's send lock.

pub(crate) mod cache;
mod copy;
mod export;
mod import;
mod link;
mod path;
mod plan;
mod wire;

pub use copy::{Completion, CopyReport, CopyStream};
pub use export::Grant;
pub use import::ImportedGrant;
pub use link::{listen, GrantStatus, LinkOptions, LinkStats, PeerInfo, PeerLink, Peers};
pub use path::{boot_id, choose_path, Endpoint, PathChoice, TransferPath};
pub use plan::{CopyEngine, EngineChoice};
pub use wire::{GrantMode, MAX_GRANT_BLOCKS, MAX_GRANT_CHUNKS};

#[cfg(test)]
mod tests;
