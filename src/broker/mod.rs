//! One GPU, many engine processes: a broker owns the physical memory, engines map it.
//!
//! - [`Broker`] (`elastic-vmm broker`): a daemon per device (per host on the host backend). It
//!   owns the global budget (the shared pool's ledger) and every physical chunk, keeping its
//!   own reference to each. Engines connect over a Unix socket (mode 0600, or 0660 for a
//!   configured group; `SO_PEERCRED` checked and recorded), register models (limit, guarantee, priority),
//!   grow one chunk at a time and give chunks back. Chunks travel as descriptors with
//!   `SCM_RIGHTS` ([`crate::ipc`]). A chunk given back waits idle at the broker and goes to
//!   the next engine that asks for that size without any release or create (hand-over); when
//!   the budget is short, idle chunks of other sizes are released and other engines are asked
//!   to give memory back (lowest priority first, above their guarantees) before anyone is
//!   refused. A connection that ends gives every chunk and every charge back once its process
//!   is gone (at once for an engine killed with SIGKILL; a process that lives on may still map
//!   its chunks, so its models stay charged, orphaned, until it exits). The budget never
//!   exceeds the device's free memory at start. Limits and guarantees change live; lowering a limit asks the engine to
//!   give back, with a deadline, and keeps the old limit (with the numbers) when it cannot.
//! - [`BrokerClient`] and [`RemoteModel`]: the engine's side. A remote model dereferences to
//!   an ordinary [`crate::Pool`]: allocations, range maps, regions and layouts work unchanged.
//! - A host tier ([`BrokerConfig::host_budget`]): the same machinery a second time on host
//!   chunks (VMM host memory of the device on CUDA, memfd chunks mapped pinned otherwise), with
//!   its own book, ledger and budget, for the engines' sleeps to stage through
//!   ([`BrokerClient::register_host_tier`], then [`crate::Pool::stage_through`]): what one
//!   engine's wake gives back serves the next engine's sleep without a create. Requests about
//!   it are wrapped in [`protocol::Request::HostTier`] and follow every rule below.
//! - [`protocol`]: the messages. [`metrics`]: Prometheus text.
//!
//! Security model (README, "Security model"): bookkeeping isolation between cooperating
//! engines, not protection against a process that keeps a mapping of a chunk it gave back.
//! - Who connects: the socket's folder is private ([`crate::ipc::SocketDir`]; the socket is
//!   bound, set and removed through the folder's descriptor), the socket mode 0600 (0660 for
//!   `BrokerConfig::group`); the broker checks the peer's `SO_PEERCRED` at
//!   accept, engines check the broker's (its user must be theirs or root, or one they name).
//! - An engine sees, maps and changes only its own models and chunks (ids of another engine's
//!   are "unknown" to it); every number it sends is checked. Operator requests (limits, trim,
//!   metrics, the full view) need a control connection, open to the broker's own user or root.
//! - How much one user may take: connections counted from accept against a total and a
//!   per-user cap, a deadline for the whole hello with no thread per connection before it
//!   (`accept.rs`), models per user, bytes per user, guarantees within the operator's policy,
//!   and a priority cap for users other than the broker's own and root (0 by default:
//!   reclaims take from the lowest priority first, so their models never outrank the
//!   operator's).
//! - A malformed or oversized message gets an error reply and closes that connection; a
//!   connection thread that panics still gives back everything; the broker goes on.
//!
//! Memory handed over is cleared by the engine that receives it before its pool maps it
//! where anyone sees it (a broker's chunks are never taken as zero: `creates_zeroed` is
//! false). A chunk the broker created for the request, on a device backend whose new chunks
//! read as zeros (its `BackendDesc::creates_zeroed`, said at hello; never the host tier), is
//! not cleared again: the grant says which chunks were handed over. A process that keeps a
//! mapping of a chunk it gave back can still see later users' bytes: that is the security
//! model's limit, below.

mod accept;
mod book;
mod client;
mod lease;
mod lease_requests;
pub mod metrics;
pub mod protocol;
mod reattach;
mod remote;
mod server;

pub use client::{BrokerClient, Welcome, DEFAULT_IMPORT_THREADS};
pub use protocol::{LeaseToken, ModelInfo, Snapshot};
pub use reattach::{Lease, Reattached};
pub use remote::RemoteModel;
pub use server::{Broker, BrokerConfig};

/// The first id of the host tier's book: its models, chunks and tickets never share an id with
/// the device book's (an engine's links and the reclaim pushes are keyed by model id).
pub(crate) const HOST_IDS: u64 = 1 << 56;

/// The default socket of the broker of `backend` (`"host"`, or `"cuda"` with a device ordinal):
/// `$ELASTIC_VMM_BROKER` if set, else `$TMPDIR/elastic-vmm-<uid>/<backend>[<ordinal>].sock`
/// (`/tmp` without `TMPDIR`). The broker makes that folder 0700 and refuses it when another user
/// made it first (the name is predictable); engines refuse a listener of another user there.
pub fn default_socket(backend: &str, ordinal: Option<i32>) -> std::path::PathBuf {
    if let Some(p) = std::env::var_os("ELASTIC_VMM_BROKER") {
        return p.into();
    }
    let uid = rustix::process::geteuid().as_raw();
    let file = match ordinal {
        Some(o) => format!("{backend}{o}.sock"),
        None => format!("{backend}.sock"),
    };
    std::env::temp_dir()
        .join(format!("elastic-vmm-{uid}"))
        .join(file)
}
