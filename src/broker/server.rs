//! The broker daemon: a Unix socket, one thread accepting every connection and reading every
//! hello (`accept.rs`), then three threads per connection (its reader, which answers
//! give-backs, reclaim answers and reports at once; its worker, which serves the other
//! requests in order and where a growth waits for other engines; its writer), the books under
//! one lock.
//!
//! Locks: the book ([`Book`], a `parking_lot` mutex) guards bookkeeping only. Driver calls
//! (create, export, release), socket reads and queued writes all happen without it, on chunks
//! taken out of the book beforehand (held "moving"); a failure puts back or settles exactly
//! what was taken. Lock order: the book alone; a connection's writer queue is only ever fed
//! with the book released. Waiting for reclaims uses a condition variable on the book's mutex.

use std::fs::File;
use std::os::fd::OwnedFd;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};

use super::book::{Book, BookError, Policy, Ticket, IDLE};
use super::metrics::Metrics;
use super::protocol::{
    BackendDesc, ChangeOutcome, ErrorKind, FromBroker, Push, Reply, Request, Role, Snapshot,
    ToBroker, MAX_BATCH,
};
use super::HOST_IDS;
use crate::backend::counting::Counting;
use crate::backend::{Backend, Need, PhysicalChunk};
use crate::budget::change::{self, GuaranteeRefused, LimitRefused, Lowering};
use crate::budget::{self, Ask, Donors, GivenBack, Ledger, Refusal as LedgerRefusal};
use crate::error::{Error, Result};
use crate::ipc::{self, FrameWriter, Outgoing, PeerCredentials, SocketDir};

/// How a broker is set up.
#[derive(Debug, Clone)]
pub struct BrokerConfig {
    /// The socket's path. Its folder must be private to the broker's user (made 0700 when
    /// missing; see [`crate::ipc::SocketDir`]).
    pub socket: PathBuf,
    /// The global budget in bytes.
    pub global_limit: u64,
    /// Group allowed to connect as engines besides the broker's user (socket mode 0660 and
    /// folder 0710 with that group then); `None`: the broker's user only (mode 0600, folder
    /// 0700). Checked against the peer's primary group (`SO_PEERCRED`).
    pub group: Option<u32>,
    /// How long a growth waits for other engines to give memory back.
    pub reclaim_wait: Duration,
    /// How long a stuck peer may block a write.
    pub io_timeout: Duration,
    /// How long a new connection has, from accept, to say hello (its whole hello, however
    /// slowly it trickles in); then it is closed.
    pub hello_timeout: Duration,
    /// Most connections one user other than the broker's own and root may have open at once,
    /// counted from accept (those still to say hello included). The operator's user is bounded
    /// by the total only.
    pub max_connections_per_user: usize,
    /// Most models the engines of one user other than the broker's own and root may have
    /// registered at once (the operator's user: the total only).
    pub max_models_per_user: usize,
    /// Most bytes the guarantees of all models may add up to; `None`: the global limit.
    pub max_guarantee_total: Option<u64>,
    /// Most bytes the guarantees of one user's models may add up to. `None`: the global limit
    /// for the broker's own user and root, nothing for other users (allowed in through
    /// [`BrokerConfig::group`]).
    pub max_guarantee_per_user: Option<u64>,
    /// Most bytes the models of one user other than the broker's own and root may hold
    /// together, orphaned models included (their memory stays charged while their process
    /// lives). `None`: half the global limit, so that no other user can take the whole budget
    /// and the operator's engines always have half of it to grow or reclaim into.
    pub max_bytes_per_user: Option<u64>,
    /// The highest priority one user other than the broker's own and root may register a
    /// model at (on both tiers); above it is refused. Reclaims take from the lowest priority
    /// first, so the default, 0 (a model's default priority), keeps the users of
    /// [`BrokerConfig::group`] from making the operator's models give first.
    pub max_priority_per_user: i32,
    /// The host tier's budget in bytes (`None`: no host tier). Engines then get host memory
    /// from the broker too ([`super::BrokerClient::register_host_tier`]): host chunks the
    /// broker makes once (VMM host memory on CUDA, pinned memfd memory otherwise), exported as
    /// descriptors, under this budget and the same rules as device memory (limits,
    /// guarantees, hand-over of idle chunks, reclaims, memory back when an engine ends).
    /// Guarantees on the host tier: the broker's own user and root only, and the caps per
    /// user are half the host budget.
    pub host_budget: Option<u64>,
    /// How long a lease whose engine is gone holds the model's kept memory (charged to it)
    /// for an engine to attach ([`super::RemoteModel::lease`]); then it goes back. Default 5
    /// minutes.
    pub lease_grace: Duration,
}

impl BrokerConfig {
    /// A broker on `socket` with a global budget of `global_limit` bytes, mode 0600, reclaims
    /// waited for 2 s, 5 s to say hello, 32 connections and 32 models per other user than the
    /// broker's and root, guarantees up to the global limit for the broker's own user and root
    /// and none for other users, priorities up to 0 for other users.
    pub fn new(socket: impl Into<PathBuf>, global_limit: u64) -> Self {
        BrokerConfig {
            socket: socket.into(),
            global_limit,
            group: None,
            reclaim_wait: Duration::from_secs(2),
            io_timeout: Duration::from_secs(5),
            hello_timeout: Duration::from_secs(5),
            max_connections_per_user: 32,
            max_models_per_user: 32,
            max_guarantee_total: None,
            max_guarantee_per_user: None,
            max_bytes_per_user: None,
            max_priority_per_user: 0,
            host_budget: None,
            lease_grace: Duration::from_secs(300),
        }
    }

    /// How long a lease whose engine is gone holds its memory (see
    /// [`BrokerConfig::lease_grace`]).
    pub fn lease_grace(mut self, grace: Duration) -> Self {
        self.lease_grace = grace;
        self
    }

    /// Give the broker a host tier with a budget of `bytes` (see [`BrokerConfig::host_budget`]).
    pub fn host_budget(mut self, bytes: u64) -> Self {
        self.host_budget = Some(bytes);
        self
    }

    /// Let group `gid` connect engines too (socket mode 0660).
    pub fn group(mut self, gid: u32) -> Self {
        self.group = Some(gid);
        self
    }

    /// How long a growth waits for other engines to give memory back.
    pub fn reclaim_wait(mut self, wait: Duration) -> Self {
        self.reclaim_wait = wait;
        self
    }

    /// How long a new connection has to say hello.
    pub fn hello_timeout(mut self, timeout: Duration) -> Self {
        self.hello_timeout = timeout;
        self
    }

    /// Most connections per user other than the broker's own and root (from accept).
    pub fn max_connections_per_user(mut self, n: usize) -> Self {
        self.max_connections_per_user = n;
        self
    }

    /// Most models per user other than the broker's own and root.
    pub fn max_models_per_user(mut self, n: usize) -> Self {
        self.max_models_per_user = n;
        self
    }

    /// Most bytes of guarantees in all.
    pub fn max_guarantee_total(mut self, bytes: u64) -> Self {
        self.max_guarantee_total = Some(bytes);
        self
    }

    /// Most bytes of guarantees per user (every user, the broker's own and root included).
    pub fn max_guarantee_per_user(mut self, bytes: u64) -> Self {
        self.max_guarantee_per_user = Some(bytes);
        self
    }

    /// Most bytes one user other than the broker's own and root may hold (see
    /// [`BrokerConfig::max_bytes_per_user`]).
    pub fn max_bytes_per_user(mut self, bytes: u64) -> Self {
        self.max_bytes_per_user = Some(bytes);
        self
    }

    /// The highest priority one user other than the broker's own and root may register at
    /// (see [`BrokerConfig::max_priority_per_user`]).
    pub fn max_priority_per_user(mut self, priority: i32) -> Self {
        self.max_priority_per_user = priority;
        self
    }
}

/// State shared by the broker's threads.
pub(crate) struct Shared {
    pub(super) backend: Arc<Counting>,
    pub(crate) desc: BackendDesc,
    pub(super) config: BrokerConfig,
    pub(crate) book: Mutex<Book>,
    /// Signalled whenever memory comes back or a reclaim ticket is answered.
    pub(super) changed: Condvar,
    pub(super) pid: u32,
    /// The broker's (effective) user.
    pub(super) uid: u32,
    pub(super) stopping: AtomicBool,
    pub(crate) metrics: Metrics,
    /// The host tier: the same machinery on host chunks, with its own book (ids from
    /// [`HOST_IDS`]), budget and backend; `None` for a broker without one, and inside it.
    /// Lock order: never the device book and the host book at once.
    pub(crate) host: Option<Arc<Shared>>,
}

/// A running broker. Dropping it (or [`Broker::shutdown`]) stops it: connections are closed and
/// every chunk is released.
pub struct Broker {
    shared: Arc<Shared>,
    accept: Option<JoinHandle<()>>,
    reaper: Option<JoinHandle<()>>,
    host_reaper: Option<JoinHandle<()>>,
    dir: SocketDir,
    _lock: File,
}

impl std::fmt::Debug for Broker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Broker")
            .field("socket", &self.shared.config.socket)
            .finish()
    }
}

fn io_err(op: &'static str, path: &Path, e: std::io::Error) -> Error {
    Error::Ipc {
        op,
        detail: format!("{}: {e}", path.display()),
    }
}

impl Broker {
    /// Start a broker on host memory (the host backend with one memfd per chunk, so that
    /// chunks travel between processes; 2 MiB granularity): for tests and machines without a
    /// GPU. Otherwise as [`Broker::start`].
    pub fn host(config: BrokerConfig) -> Result<Broker> {
        use crate::backend::host::{ChunkFiles, HostBackend, DEFAULT_GRANULARITY};
        let host = HostBackend::with_chunk_files(DEFAULT_GRANULARITY, ChunkFiles::PerChunk)?;
        Self::start(Arc::new(host), config)
    }

    /// Start a broker on CUDA device `ordinal`. Otherwise as [`Broker::start`].
    pub fn cuda(ordinal: i32, config: BrokerConfig) -> Result<Broker> {
        Self::start(
            Arc::new(crate::backend::cuda::CudaBackend::new(ordinal)?),
            config,
        )
    }

    /// Start a broker owning `backend`'s chunks (it must export them: CUDA with POSIX-fd
    /// support, or a host backend with per-chunk files). Refused when another broker serves
    /// the same socket, and when the socket's folder, lock file or path is not safe
    /// ([`Error::InsecurePath`]: another user's folder, one others can reach, a symbolic link,
    /// or a file other than a stale socket at the socket's path).
    ///
    /// The budget never exceeds the device's free memory at start: memory other processes hold
    /// (engines of an earlier broker that still map its chunks, other programs) is not there
    /// to grant, so a larger `global_limit` is cut to what is free, with a warning.
    ///
    /// With [`BrokerConfig::host_budget`], the host tier's chunks come from VMM host memory of
    /// the device (CUDA) where the driver has it, else from pinned memfd memory (see
    /// [`Broker::start_tiered`]).
    pub fn start(backend: Arc<dyn Backend>, config: BrokerConfig) -> Result<Broker> {
        let host = match config.host_budget {
            Some(_) => Some(default_host_tier(backend.info())?),
            None => None,
        };
        Self::start_tiered(backend, host, config)
    }

    /// [`Broker::start`] with the host tier's chunks from `host` (exported as descriptors; the
    /// engines map them with the matching backend: CUDA's host tier for a `"cuda"` backend,
    /// a locked host backend for `"host"`). `host` is used only with
    /// [`BrokerConfig::host_budget`].
    pub fn start_tiered(
        backend: Arc<dyn Backend>,
        host: Option<Arc<dyn Backend>>,
        mut config: BrokerConfig,
    ) -> Result<Broker> {
        let host = match (config.host_budget, host) {
            (Some(budget), Some(h)) => Some((budget, h)),
            (Some(_), None) => {
                return Err(Error::InvalidArgument(
                    "a host budget without a host tier backend".into(),
                ))
            }
            (None, _) => None,
        };
        let info = backend.info().clone();
        if !info.posix_fd_exportable {
            return Err(Error::InvalidArgument(format!(
                "the broker's {} backend cannot export chunks as POSIX descriptors (host: use ChunkFiles::PerChunk)",
                info.name
            )));
        }
        match backend.memory_info() {
            Ok(mem) if config.global_limit > mem.free => {
                tracing::warn!(
                    asked = config.global_limit,
                    free = mem.free,
                    total = mem.total,
                    "global limit above the device's free memory; the budget is the free memory"
                );
                config.global_limit = mem.free;
            }
            Ok(_) => {}
            Err(e) => {
                tracing::warn!(error = %e, "the device's free memory is unknown; the budget is taken as given")
            }
        }
        if config.global_limit < info.granularity as u64 {
            return Err(Error::InvalidArgument(format!(
                "global limit {} is below one granule of {} bytes",
                config.global_limit, info.granularity
            )));
        }
        if config.max_connections_per_user == 0 || config.max_models_per_user == 0 {
            return Err(Error::InvalidArgument(format!(
                "at least one connection and one model per user: {} connections and {} models asked",
                config.max_connections_per_user, config.max_models_per_user
            )));
        }
        crate::ipc::raise_fd_limit();
        let path = config.socket.clone();
        // The folder is checked (or made) private first; everything after goes through it.
        let dir = SocketDir::claim(&path, config.group)?;
        // One broker per socket: an exclusive lock on a file beside it, held for the broker's
        // life (the kernel drops it when the process dies, so a crashed broker leaves none).
        let lock = dir.lock()?;
        // The lock is ours: a socket left by a dead broker is stale (anything else is refused).
        dir.clear_stale_socket()?;
        let listener = dir.bind()?;
        let mode = if config.group.is_some() { 0o660 } else { 0o600 };
        dir.set_socket_access(mode, config.group)?;
        let desc = BackendDesc {
            name: info.name.to_string(),
            device_ordinal: info.device_ordinal,
            granularity: info.granularity as u64,
            device_name: info.device_name.clone(),
            creates_zeroed: backend.creates_zeroed(),
        };
        let uid = rustix::process::geteuid().as_raw();
        let policy = Policy {
            broker_uid: uid,
            max_models_per_user: config.max_models_per_user,
            max_guarantee_total: config.max_guarantee_total,
            max_guarantee_per_user: config.max_guarantee_per_user,
            max_bytes_per_user: config.max_bytes_per_user.unwrap_or(config.global_limit / 2),
            max_priority_per_user: config.max_priority_per_user,
        };
        let host = match host {
            Some((budget, h)) => Some(host_tier_shared(h, budget, &config, uid)?),
            None => None,
        };
        let shared = Arc::new(Shared {
            backend: Arc::new(Counting::new(backend)),
            desc,
            book: Mutex::new(
                Book::new(config.global_limit, policy).lease_grace(config.lease_grace),
            ),
            changed: Condvar::new(),
            pid: std::process::id(),
            uid,
            stopping: AtomicBool::new(false),
            metrics: Metrics::new(),
            config,
            host,
        });
        tracing::info!(socket = %path.display(), global_limit = shared.config.global_limit, backend = %shared.desc.name, "broker listening");
        let s = shared.clone();
        let reaper = std::thread::Builder::new()
            .name("broker-reaper".into())
            .spawn(move || reap_loop(s))
            .map_err(|e| io_err("spawn", &path, e))?;
        let stop_reapers = |reaper: JoinHandle<()>, host_reaper: Option<JoinHandle<()>>| {
            for s in std::iter::once(&shared).chain(shared.host.as_ref()) {
                s.stopping.store(true, Ordering::SeqCst);
                s.changed.notify_all();
            }
            let _ = reaper.join();
            if let Some(t) = host_reaper {
                let _ = t.join();
            }
        };
        let host_reaper = match shared.host.clone() {
            Some(h) => match std::thread::Builder::new()
                .name("broker-host-reaper".into())
                .spawn(move || reap_loop(h))
            {
                Ok(t) => Some(t),
                Err(e) => {
                    stop_reapers(reaper, None);
                    return Err(io_err("spawn", &path, e));
                }
            },
            None => None,
        };
        let s = shared.clone();
        let accept = std::thread::Builder::new()
            .name("broker-accept".into())
            .spawn(move || super::accept::accept_loop(s, listener));
        let accept = match accept {
            Ok(t) => t,
            Err(e) => {
                stop_reapers(reaper, host_reaper);
                return Err(io_err("spawn", &path, e));
            }
        };
        Ok(Broker {
            shared,
            accept: Some(accept),
            reaper: Some(reaper),
            host_reaper,
            dir,
            _lock: lock,
        })
    }

    /// The socket's path.
    pub fn socket(&self) -> &Path {
        &self.shared.config.socket
    }

    /// Everything the broker knows, now.
    pub fn snapshot(&self) -> Snapshot {
        self.shared.snapshot(None)
    }

    /// Prometheus text exposition.
    pub fn metrics_text(&self) -> String {
        self.shared.metrics_text()
    }

    /// Stop: refuse new connections, close every connection (their engines' memory comes
    /// back), release every chunk.
    pub fn shutdown(mut self) {
        self.stop();
    }

    /// Block until the broker is stopped by another thread or a signal ends the process.
    pub fn wait(mut self) {
        if let Some(t) = self.accept.take() {
            let _ = t.join();
        }
        self.stop();
    }

    fn stop(&mut self) {
        self.shared.stopping.store(true, Ordering::SeqCst);
        // Wake the accept loop (it also looks at least once a second).
        let _ = UnixStream::connect(&self.shared.config.socket);
        if let Some(t) = self.accept.take() {
            let _ = t.join();
        }
        let streams: Vec<UnixStream> = {
            let book = self.shared.book.lock();
            book.conns
                .values()
                .filter_map(|c| c.stream.try_clone().ok())
                .collect()
        };
        for s in streams {
            let _ = s.shutdown(std::net::Shutdown::Both);
        }
        // Connection threads clean up after themselves; wait for them briefly.
        let end = Instant::now() + Duration::from_secs(5);
        while Instant::now() < end && !self.shared.book.lock().conns.is_empty() {
            std::thread::sleep(Duration::from_millis(5));
        }
        self.shared.changed.notify_all();
        if let Some(t) = self.reaper.take() {
            let _ = t.join();
        }
        if let Some(h) = &self.shared.host {
            h.stopping.store(true, Ordering::SeqCst);
            h.changed.notify_all();
        }
        if let Some(t) = self.host_reaper.take() {
            let _ = t.join();
        }
        for s in std::iter::once(&self.shared).chain(self.shared.host.as_ref()) {
            // Orphaned memory too: the broker's references go now (processes that still map
            // a chunk keep their own).
            let orphaned = {
                let mut book = s.book.lock();
                let conns: Vec<u64> = book.orphans.iter().map(|o| o.conn).collect();
                conns
                    .into_iter()
                    .flat_map(|c| book.reap(c))
                    .collect::<Vec<_>>()
            };
            s.release_all(orphaned, None);
            // A broker that stops ends every lease: the kept memory is its process's.
            let leased = {
                let mut book = s.book.lock();
                let held: Vec<u64> = book
                    .models
                    .iter()
                    .filter(|(_, m)| m.lease.is_some())
                    .map(|(&k, _)| k)
                    .collect();
                held.into_iter()
                    .flat_map(|m| book.unregister(m))
                    .collect::<Vec<_>>()
            };
            s.release_all(leased, None);
            let idle = s.book.lock().take_idle(u64::MAX, None);
            s.release_all(idle, Some(IDLE));
        }
        self.dir.remove_socket();
    }
}

impl Drop for Broker {
    fn drop(&mut self) {
        if !self.shared.stopping.load(Ordering::SeqCst) {
            self.stop();
        }
    }
}

/// The host tier's backend for a broker on `device`: VMM host memory of the same CUDA device
/// where the driver exports it as descriptors, else memfd chunks (engines map them pinned).
fn default_host_tier(device: &crate::backend::BackendInfo) -> Result<Arc<dyn Backend>> {
    use crate::backend::host::{ChunkFiles, HostBackend, DEFAULT_GRANULARITY};
    if device.name == "cuda" {
        let ordinal = device.device_ordinal.unwrap_or(0);
        match crate::backend::cuda::CudaBackend::host_tier(ordinal) {
            Ok(b) if b.info().posix_fd_exportable => return Ok(Arc::new(b)),
            Ok(_) => tracing::info!(
                ordinal,
                "host tier: VMM host memory not exportable as descriptors here; memfd chunks, pinned by the engines"
            ),
            Err(e) => tracing::info!(
                ordinal,
                reason = %e,
                "host tier: no VMM host memory; memfd chunks, pinned by the engines"
            ),
        }
    }
    Ok(Arc::new(HostBackend::with_chunk_files(
        DEFAULT_GRANULARITY,
        ChunkFiles::PerChunk,
    )?))
}

/// The host tier's state: the broker's machinery on `backend`'s host chunks under `budget`
/// (cut to the host's free memory), its book's ids apart from the device book's.
fn host_tier_shared(
    backend: Arc<dyn Backend>,
    mut budget: u64,
    config: &BrokerConfig,
    uid: u32,
) -> Result<Arc<Shared>> {
    let info = backend.info().clone();
    if !info.posix_fd_exportable || info.memory_kind != crate::backend::MemoryKind::Host {
        return Err(Error::InvalidArgument(format!(
            "the host tier's {} backend ({}) must make host memory exportable as POSIX descriptors",
            info.name, info.device_name
        )));
    }
    // At most the machine's available memory (page cache the kernel can drop counts as free;
    // a NUMA node's meminfo has no such figure) and the tier's own total (a CUDA host tier's
    // NUMA node: its `memory_info`).
    let room = crate::backend::meminfo::machine(info.name)
        .and_then(|m| Ok((m.free, backend.memory_info()?.total)));
    match room {
        Ok((free, total)) if budget > free.min(total) => {
            tracing::warn!(
                asked = budget,
                free,
                total,
                "host budget above the host's free memory or the tier's total; the budget is the lesser"
            );
            budget = free.min(total);
        }
        Ok(_) => {}
        Err(e) => {
            tracing::warn!(error = %e, "the host's free memory is unknown; the host budget is taken as given")
        }
    }
    if budget < info.granularity as u64 {
        return Err(Error::InvalidArgument(format!(
            "host budget {budget} is below one granule of {} bytes",
            info.granularity
        )));
    }
    let policy = Policy {
        broker_uid: uid,
        max_models_per_user: config.max_models_per_user,
        max_guarantee_total: None,
        max_guarantee_per_user: None,
        max_bytes_per_user: budget / 2,
        max_priority_per_user: config.max_priority_per_user,
    };
    let mut host_config = config.clone();
    host_config.global_limit = budget;
    host_config.host_budget = None;
    tracing::info!(host_budget = budget, backend = %info.name, device = %info.device_name, "broker host tier");
    Ok(Arc::new(Shared {
        backend: Arc::new(Counting::new(backend)),
        desc: BackendDesc {
            name: info.name.to_string(),
            device_ordinal: info.device_ordinal,
            granularity: info.granularity as u64,
            device_name: info.device_name.clone(),
            creates_zeroed: false,
        },
        book: Mutex::new(
            Book::new(budget, policy)
                .ids_from(HOST_IDS)
                .lease_grace(config.lease_grace),
        ),
        changed: Condvar::new(),
        pid: std::process::id(),
        uid,
        stopping: AtomicBool::new(false),
        metrics: Metrics::new(),
        config: host_config,
        host: None,
    }))
}

pub(super) fn error_reply(kind: ErrorKind, message: impl Into<String>) -> Reply {
    Reply::Error {
        kind,
        message: message.into(),
    }
}

pub(super) fn book_error(e: BookError) -> Reply {
    match e {
        BookError::Unknown(m) => error_reply(ErrorKind::Unknown, m),
        BookError::Invalid(m) => error_reply(ErrorKind::InvalidArgument, m),
        BookError::Duplicate(m) => error_reply(ErrorKind::Duplicate, m),
        BookError::Forbidden(m) => error_reply(ErrorKind::Forbidden, m),
        BookError::Busy(m) => error_reply(ErrorKind::Busy, m),
    }
}

pub(super) fn send(writer: &FrameWriter, id: u64, reply: Reply, fds: Vec<OwnedFd>) -> Result<()> {
    let payload = match ipc::encode(&FromBroker::Reply { id, reply }) {
        Ok(p) => p,
        // Too large for one frame (metrics of very many models): say so instead.
        Err(e) => ipc::encode(&FromBroker::Reply {
            id,
            reply: error_reply(ErrorKind::InvalidArgument, format!("reply not sent: {e}")),
        })?,
    };
    writer.send(Outgoing { payload, fds })
}

/// One connection after its hello (the accept thread welcomed it and registered it in the
/// book): its requests until it ends, then its cleanup.
pub(super) fn serve(
    shared: Arc<Shared>,
    stream: UnixStream,
    conn: u64,
    peer: PeerCredentials,
    role: Role,
    writer: FrameWriter,
    writer_thread: JoinHandle<()>,
) {
    shared.guarded(conn, peer, || {
        read_loop(&shared, &stream, conn, role, &writer)
    });
    // Let the writer flush what was queued (an error reply), then close.
    drop(writer);
    let _ = writer_thread.join();
    let _ = stream.shutdown(std::net::Shutdown::Both);
    tracing::debug!(conn, pid = peer.pid, "connection closed");
}

/// Requests queued for a connection's worker (its lane of requests that may wait) before its
/// reader stops reading: the backpressure a connection had when it was served by one thread.
const LANE_DEPTH: usize = 64;

/// Whether `request` is answered by the connection's reader at once, even while a request of
/// the same connection waits (a growth waiting for other engines to give back): what the
/// engine gives back (chunks, reclaim answers, reports) never waits behind its own growth, so
/// engines growing at once under pressure can each serve the others' reclaims. These requests
/// take the book's lock only for bookkeeping and never wait for anyone.
fn answered_at_once(request: &Request) -> bool {
    match request {
        Request::GiveBack { .. }
        | Request::GiveBackMany { .. }
        | Request::ReclaimDone { .. }
        | Request::Report { .. } => true,
        Request::HostTier(inner) => matches!(
            **inner,
            Request::GiveBack { .. }
                | Request::GiveBackMany { .. }
                | Request::ReclaimDone { .. }
                | Request::Report { .. }
        ),
        _ => false,
    }
}

/// Whether `request` unregisters a model (on either tier).
fn unregisters(request: &Request) -> bool {
    match request {
        Request::Unregister { .. } => true,
        Request::HostTier(inner) => matches!(**inner, Request::Unregister { .. }),
        _ => false,
    }
}

/// A connection's requests: its reader answers give-backs, reclaim answers and reports at once
/// ([`answered_at_once`]); every other request goes, in order, to the connection's worker
/// thread, where a growth may wait for other engines. A panic of the worker is resumed here
/// (the connection's cleanup runs after it, see [`Shared::guarded`]).
fn read_loop(shared: &Shared, stream: &UnixStream, conn: u64, role: Role, writer: &FrameWriter) {
    let (lane, queued) = std::sync::mpsc::sync_channel::<ToBroker>(LANE_DEPTH);
    let closing = AtomicBool::new(false);
    std::thread::scope(|s| {
        let worker = std::thread::Builder::new()
            .name(format!("broker-conn-{conn}"))
            .spawn_scoped(s, || {
                let mut unsent = false;
                for msg in queued {
                    // The reader stopped (the peer went away or sent garbage) or a reply could
                    // not be sent: nobody waits for these answers, and the cleanup takes
                    // everything back; but an unregister the engine sent before it went still
                    // ends its model's lease (the cleanup would hold it).
                    let closed = unsent || closing.load(Ordering::SeqCst);
                    if closed && !unregisters(&msg.request) {
                        continue;
                    }
                    if !answer(shared, conn, role, writer, msg) {
                        unsent = true;
                    }
                }
            });
        let (lane, worker) = match worker {
            Ok(w) => (Some(lane), Some(w)),
            Err(e) => {
                // No thread for it: this connection is served by its reader alone, as before.
                tracing::warn!(conn, error = %e, "no worker thread for a connection; its requests are served in turn");
                (None, None)
            }
        };
        read_frames(shared, stream, conn, role, writer, lane.as_ref());
        closing.store(true, Ordering::SeqCst);
        drop(lane);
        if let Some(Err(panic)) = worker.map(|w| w.join()) {
            std::panic::resume_unwind(panic);
        }
    });
}

/// Read `conn`'s frames until it ends; requests that may wait go to `lane` (the worker), the
/// others are answered here (all of them when there is no worker).
fn read_frames(
    shared: &Shared,
    stream: &UnixStream,
    conn: u64,
    role: Role,
    writer: &FrameWriter,
    lane: Option<&std::sync::mpsc::SyncSender<ToBroker>>,
) {
    loop {
        let frame = match ipc::recv_frame(stream, ipc::MAX_FRAME) {
            Ok(Some(f)) => f,
            Ok(None) => return,
            Err(e) if ipc::is_disconnect(&e) => {
                tracing::debug!(conn, error = %e, "peer went away");
                return;
            }
            Err(e) => {
                shared.malformed(writer, 0, e.to_string());
                return;
            }
        };
        if !frame.fds.is_empty() {
            // Engines never send descriptors: whatever came is closed here.
            shared.malformed(
                writer,
                0,
                format!("{} unexpected descriptors attached", frame.fds.len()),
            );
            return;
        }
        let msg: ToBroker = match ipc::decode(&frame.payload) {
            Ok(m) => m,
            Err(e) => {
                shared.malformed(writer, 0, e.to_string());
                return;
            }
        };
        let served = match lane {
            Some(lane) if !answered_at_once(&msg.request) => lane.send(msg).is_ok(),
            _ => answer(shared, conn, role, writer, msg),
        };
        if !served {
            return;
        }
    }
}

/// Serve one request of `conn` and send its reply; false when the reply could not be sent
/// (the connection is done).
fn answer(shared: &Shared, conn: u64, role: Role, writer: &FrameWriter, msg: ToBroker) -> bool {
    let started = Instant::now();
    let grown = match msg.request {
        Request::Grow { model, .. } | Request::GrowMany { model, .. } => Some(model),
        _ => None,
    };
    let (reply, fd) = shared.handle(conn, role, msg.request);
    if let (Some(model), Reply::Granted { .. } | Reply::GrantedMany { .. }) = (grown, &reply) {
        let took = started.elapsed();
        let name = {
            let mut book = shared.book.lock();
            let micros = u64::try_from(took.as_micros()).unwrap_or(u64::MAX);
            book.counters.grant_micros = book.counters.grant_micros.saturating_add(micros);
            book.models.get(&model).map(|m| m.name.clone())
        };
        shared.metrics.observe_grant(name.as_deref(), took);
    }
    if let Err(e) = send(writer, msg.id, reply, fd) {
        tracing::debug!(conn, error = %e, "reply not sent; closing");
        return false;
    }
    true
}

/// Watches the processes of orphaned connections: when one is gone, its models go with their
/// chunks and charges. Sleeps on the book's condition variable while there is none.
fn reap_loop(shared: Arc<Shared>) {
    while !shared.stopping.load(Ordering::SeqCst) {
        let watched: Vec<(u64, i32, Arc<OwnedFd>)> = {
            let mut book = shared.book.lock();
            let now = Instant::now();
            let expired = book.expire(now);
            if !expired.is_empty() {
                drop(book);
                shared.release_all(expired, None);
                shared.changed.notify_all();
                continue;
            }
            if book.orphans.is_empty() {
                let wait = book
                    .next_expiry()
                    .map_or(Duration::from_secs(1), |e| e.saturating_duration_since(now))
                    .min(Duration::from_secs(1));
                shared.changed.wait_for(&mut book, wait);
                continue;
            }
            book.orphans
                .iter()
                .map(|o| (o.conn, o.pid, o.pidfd.clone()))
                .collect()
        };
        let gone: Vec<(u64, i32)> = {
            let mut fds: Vec<_> = watched
                .iter()
                .map(|(_, _, fd)| rustix::event::PollFd::new(&**fd, rustix::event::PollFlags::IN))
                .collect();
            let wait = rustix::event::Timespec {
                tv_sec: 0,
                tv_nsec: 200_000_000,
            };
            if rustix::event::poll(&mut fds, Some(&wait)).is_err() {
                std::thread::sleep(Duration::from_millis(50));
                continue;
            }
            fds.iter()
                .zip(&watched)
                .filter(|(f, _)| !f.revents().is_empty())
                .map(|(_, &(conn, pid, _))| (conn, pid))
                .collect()
        };
        for (conn, pid) in gone {
            let chunks = shared.book.lock().reap(conn);
            let bytes: u64 = chunks.iter().map(|(_, c)| c.size as u64).sum();
            tracing::warn!(
                conn,
                pid,
                chunks = chunks.len(),
                bytes,
                "the process of a closed connection is gone; its memory comes back"
            );
            shared.release_all(chunks, None);
            shared.changed.notify_all();
        }
    }
}

impl Shared {
    /// Run a connection's `body`, then its cleanup, also when `body` panics: every model of
    /// the connection goes, with its chunks and charges, so a bug in serving one engine never
    /// strands memory. (A panic is caught here rather than cleaned up in a `Drop` guard: a
    /// cleanup that itself panicked during unwinding would abort the whole broker.)
    ///
    /// When its process still lives (its pidfd says so), the chunks its models hold may still be
    /// mapped there: they stay charged, orphaned, until the process is gone ([`reap_loop`]),
    /// instead of being credited while still in use.
    pub(super) fn guarded(&self, conn: u64, peer: PeerCredentials, body: impl FnOnce()) {
        if let Err(panic) = std::panic::catch_unwind(std::panic::AssertUnwindSafe(body)) {
            let why = panic
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| panic.downcast_ref::<String>().cloned())
                .unwrap_or_default();
            tracing::error!(conn, pid = peer.pid, panic = %why, "a connection's thread panicked; its memory is taken back and the connection closed");
            self.book.lock().counters.panics += 1;
        }
        let pidfd = self
            .book
            .lock()
            .conns
            .get(&conn)
            .and_then(|c| c.pidfd.clone());
        let alive = pidfd
            // A process that dies closes its sockets a moment before its pidfd says so: a
            // short wait spares the books (and the log) an orphan gone at once.
            .filter(|fd| !ipc::process_exited(&**fd, Duration::from_millis(20)))
            .map(|fd| (peer.pid, fd));
        // The host tier first: the broker's stop waits for the device book's connections.
        if let Some(h) = &self.host {
            h.end_connection(conn, peer, alive.clone());
        }
        self.end_connection(conn, peer, alive);
    }

    /// Connection `conn` ended (see [`Shared::guarded`]): its models go with their memory, or
    /// stay orphaned while its process (`alive`) lives.
    fn end_connection(&self, conn: u64, peer: PeerCredentials, alive: Option<(i32, Arc<OwnedFd>)>) {
        let orphaning = alive.is_some();
        let chunks = {
            let mut book = self.book.lock();
            let before = book.orphans.len();
            let chunks = book.end_conn(conn, alive);
            if orphaning && book.orphans.len() > before {
                tracing::warn!(
                    conn,
                    pid = peer.pid,
                    "connection closed with memory held by a process that still lives; it stays charged until the process is gone"
                );
            }
            chunks
        };
        if !chunks.is_empty() {
            let bytes: u64 = chunks.iter().map(|(_, c)| c.size as u64).sum();
            tracing::warn!(
                conn,
                pid = peer.pid,
                chunks = chunks.len(),
                bytes,
                "connection closed with memory held; taking it back"
            );
        }
        self.release_all(chunks, None);
        self.changed.notify_all();
    }

    fn malformed(&self, writer: &FrameWriter, id: u64, why: String) {
        self.book.lock().counters.malformed += 1;
        tracing::warn!(error = %why, "malformed message; connection closed");
        let _ = send(
            writer,
            id,
            error_reply(ErrorKind::Malformed, why),
            Vec::new(),
        );
    }

    pub(crate) fn snapshot(&self, viewer: Option<u64>) -> Snapshot {
        // Measured outside the lock: the backend is not bookkeeping.
        let physical = self.backend.physical_bytes().unwrap_or(0);
        let book = self.book.lock();
        let (engines, models) = book.view(viewer);
        let mut snap = Snapshot {
            broker_pid: self.pid,
            backend: self.desc.clone(),
            global_limit: book.ledger.global_limit,
            global_used: book.ledger.used,
            idle: book.idle_bytes,
            physical,
            engines,
            models,
            counters: book.counters.clone(),
            audit: book.audit().err(),
            host_tier: None,
        };
        drop(book);
        snap.host_tier = self.host.as_ref().map(|h| Box::new(h.snapshot(viewer)));
        snap
    }

    pub(crate) fn metrics_text(&self) -> String {
        let snap = self.snapshot(None);
        let host_calls = self.host.as_ref().map(|h| h.backend.counts());
        self.metrics
            .render(&snap, &self.backend.counts(), host_calls.as_ref())
    }

    /// Release moving chunks to the driver, settling the book for each.
    pub(super) fn release_all(&self, chunks: Vec<(u64, PhysicalChunk)>, charged_to: Option<u64>) {
        for (cid, chunk) in chunks {
            // SAFETY: a moving chunk is held by no model, idle list or other thread; the broker
            // never maps chunks; other processes' imports keep their own references.
            match unsafe { self.backend.release(chunk) } {
                Ok(()) => self.book.lock().released(cid, charged_to),
                Err(e) => {
                    tracing::error!(chunk = cid, error = %e, "release failed; the chunk stays counted as leaked");
                    self.book.lock().release_failed(cid, charged_to);
                }
            }
        }
    }

    fn handle(&self, conn: u64, role: Role, request: Request) -> (Reply, Vec<OwnedFd>) {
        let engine_only = |r: Reply| {
            if role == Role::Engine {
                r
            } else {
                error_reply(
                    ErrorKind::Forbidden,
                    "engine requests need an engine connection",
                )
            }
        };
        let control_only = |role: Role| role == Role::Control;
        match request {
            Request::Hello { .. } => (
                error_reply(ErrorKind::Malformed, "hello sent twice"),
                Vec::new(),
            ),
            Request::Register {
                model,
                limit,
                guarantee,
                priority,
            } => {
                if role != Role::Engine {
                    return (engine_only(Reply::Done), Vec::new());
                }
                let r = {
                    let mut book = self.book.lock();
                    match book.conns.get(&conn).map(|c| c.peer.uid) {
                        Some(uid) => book.register(conn, uid, &model, limit, guarantee, priority),
                        None => Err(BookError::Unknown(format!("connection {conn} is closing"))),
                    }
                };
                match r {
                    Ok(id) => {
                        tracing::info!(conn, model = %model, id, limit, guarantee, priority, "model registered");
                        (Reply::Registered { model: id }, Vec::new())
                    }
                    Err(e) => (book_error(e), Vec::new()),
                }
            }
            Request::Unregister { model } => {
                let chunks = {
                    let mut book = self.book.lock();
                    if let Err(e) = book.own_model(conn, model) {
                        return (book_error(e), Vec::new());
                    }
                    book.unregister(model)
                };
                self.release_all(chunks, None);
                self.changed.notify_all();
                (Reply::Done, Vec::new())
            }
            Request::Grow { model, size } => self.grow(conn, model, size, None, false),
            Request::GrowMany {
                model,
                size,
                count,
                look_ahead,
            } => {
                if count == 0 || count > MAX_BATCH {
                    return (
                        error_reply(
                            ErrorKind::InvalidArgument,
                            format!("{count} chunks asked for at once: 1 to {MAX_BATCH} allowed"),
                        ),
                        Vec::new(),
                    );
                }
                self.grow(conn, model, size, Some(count), look_ahead)
            }
            Request::GiveBackMany { model, chunks } => {
                if chunks.len() > MAX_BATCH as usize {
                    return (
                        error_reply(
                            ErrorKind::InvalidArgument,
                            format!(
                                "{} chunks given back at once: at most {MAX_BATCH} allowed",
                                chunks.len()
                            ),
                        ),
                        Vec::new(),
                    );
                }
                let mut release = Vec::new();
                let mut unknown = Vec::new();
                {
                    let mut book = self.book.lock();
                    for cid in chunks {
                        match book.give_back(conn, model, cid) {
                            Ok(None) => {}
                            Ok(Some(c)) => release.push((cid, c)),
                            Err(
                                BookError::Unknown(m)
                                | BookError::Invalid(m)
                                | BookError::Duplicate(m)
                                | BookError::Forbidden(m)
                                | BookError::Busy(m),
                            ) => unknown.push(m),
                        }
                    }
                }
                self.release_all(release, None);
                self.changed.notify_all();
                if unknown.is_empty() {
                    (Reply::Done, Vec::new())
                } else {
                    (
                        error_reply(ErrorKind::Unknown, unknown.join("; ")),
                        Vec::new(),
                    )
                }
            }
            Request::GiveBack { model, chunk } => {
                let r = self.book.lock().give_back(conn, model, chunk);
                let reply = match r {
                    Ok(None) => Reply::Done,
                    Ok(Some(c)) => {
                        self.release_all(vec![(chunk, c)], None);
                        Reply::Done
                    }
                    Err(e) => book_error(e),
                };
                self.changed.notify_all();
                (reply, Vec::new())
            }
            Request::ReclaimDone { ticket, freed } => {
                let mut book = self.book.lock();
                let mut reply = Reply::Done;
                if let Some(t) = book
                    .tickets
                    .get(&ticket)
                    .copied()
                    .filter(|t| t.conn == conn && t.freed.is_none())
                {
                    // Answered, however badly: the growth waiting for it goes on (and takes
                    // the ticket out).
                    let so_far = book.ledger.models.get(&t.model).map_or(0, |b| b.reclaimed);
                    let global = book.ledger.global_limit;
                    let counted = if freed > global || so_far.checked_add(freed).is_none() {
                        reply = error_reply(
                            ErrorKind::InvalidArgument,
                            format!("reclaim {ticket}: {freed} bytes freed claimed, more than the global budget of {global}; not counted"),
                        );
                        0
                    } else {
                        book.ledger.note_reclaimed(t.model, freed);
                        freed
                    };
                    if let Some(t) = book.tickets.get_mut(&ticket) {
                        t.freed = Some(counted);
                    }
                }
                drop(book);
                tracing::debug!(conn, ticket, freed, "reclaim answered");
                self.changed.notify_all();
                (reply, Vec::new())
            }
            Request::Report {
                model,
                in_use,
                idle,
                cached,
            } => {
                let mut book = self.book.lock();
                if let Err(e) = book.own_model(conn, model) {
                    return (book_error(e), Vec::new());
                }
                let global = book.ledger.global_limit;
                if [in_use, idle, cached].iter().any(|&v| v > global) {
                    return (
                        error_reply(
                            ErrorKind::InvalidArgument,
                            format!("report of model {model}: {in_use} in use, {idle} idle, {cached} cached: each at most the global budget of {global}"),
                        ),
                        Vec::new(),
                    );
                }
                if let Some(m) = book.models.get_mut(&model) {
                    m.in_use = in_use;
                    m.idle = idle;
                    m.cached = cached;
                }
                (Reply::Done, Vec::new())
            }
            Request::Snapshot => {
                let viewer = (role == Role::Engine).then_some(conn);
                (Reply::Snapshot(Box::new(self.snapshot(viewer))), Vec::new())
            }
            Request::Metrics if control_only(role) => {
                (Reply::Metrics(self.metrics_text()), Vec::new())
            }
            Request::Trim if control_only(role) => {
                // Every idle chunk the broker holds: the host tier's too (`HostTier(Trim)`
                // trims the host tier's alone).
                let mut released = 0u64;
                for s in std::iter::once(self).chain(self.host.as_deref()) {
                    let idle = s.book.lock().take_idle(u64::MAX, None);
                    released += idle.iter().map(|(_, c)| c.size as u64).sum::<u64>();
                    s.release_all(idle, Some(IDLE));
                }
                (Reply::Trimmed { released }, Vec::new())
            }
            Request::SetLimit {
                model,
                limit,
                deadline_ms,
            } if control_only(role) => (
                self.set_limit(
                    &model,
                    limit,
                    Duration::from_millis(deadline_ms.min(600_000)),
                ),
                Vec::new(),
            ),
            Request::SetGuarantee { model, guarantee } if control_only(role) => {
                (self.set_guarantee(&model, guarantee), Vec::new())
            }
            Request::HostTier(inner) => match (&self.host, *inner) {
                (None, _) => (
                    error_reply(
                        ErrorKind::InvalidArgument,
                        "this broker has no host tier (start it with a host budget)",
                    ),
                    Vec::new(),
                ),
                (Some(_), Request::Hello { .. } | Request::HostTier(_)) => (
                    error_reply(
                        ErrorKind::InvalidArgument,
                        "a hello or a host-tier request cannot be sent to the host tier",
                    ),
                    Vec::new(),
                ),
                // The same rules on the host tier's book: roles, owners, numbers, budget.
                (Some(h), inner) => h.handle(conn, role, inner),
            },
            Request::Lease { .. }
            | Request::Keep { .. }
            | Request::Forget { .. }
            | Request::StoreBlob { .. }
            | Request::Attach { .. }
            | Request::Detach { .. }
            | Request::TakeKept { .. } => {
                if role != Role::Engine {
                    return (engine_only(Reply::Done), Vec::new());
                }
                self.handle_lease(conn, request)
            }
            Request::Metrics
            | Request::Trim
            | Request::SetLimit { .. }
            | Request::SetGuarantee { .. } => (
                error_reply(
                    ErrorKind::Forbidden,
                    "operator requests need a control connection",
                ),
                Vec::new(),
            ),
        }
    }

    /// `count` chunks of `size` bytes for `model`, all or none: idle chunks of that size
    /// handed over first, the others charged, then created together in one
    /// [`Backend::create_many`] once the whole batch is admitted (CUDA's host tier spreads it
    /// over threads, instead of a create after each admission). When the budget is short, idle
    /// chunks of other sizes are released and other engines asked to give back, once, within
    /// the reclaim wait. Each chunk is exported as a descriptor; one reply carries them all
    /// ([`Reply::GrantedMany`] for a batch, `count` `Some`; [`Reply::Granted`] for one chunk).
    /// A `look_ahead` growth asks no other engine to give back: short of budget it is refused.
    fn grow(
        &self,
        conn: u64,
        model: u64,
        size: u64,
        batch: Option<u32>,
        look_ahead: bool,
    ) -> (Reply, Vec<OwnedFd>) {
        let gran = self.desc.granularity;
        if size == 0
            || size % gran != 0
            || size > self.config.global_limit
            || usize::try_from(size).is_err()
        {
            return (
                error_reply(
                    ErrorKind::InvalidArgument,
                    format!("chunk of {size} bytes: must be a positive multiple of {gran} no larger than the global limit {}", self.config.global_limit),
                ),
                Vec::new(),
            );
        }
        // Other engines are asked for the whole batch, within one reclaim wait.
        let mut asked = Asked::default();
        let out = self.grow_batch(conn, model, size, batch, look_ahead, &mut asked);
        self.end_asks(&asked);
        out
    }

    /// [`Shared::grow`] of a checked request; `reclaim_asked`: the other engines it asked.
    fn grow_batch(
        &self,
        conn: u64,
        model: u64,
        size: u64,
        batch: Option<u32>,
        look_ahead: bool,
        reclaim_asked: &mut Asked,
    ) -> (Reply, Vec<OwnedFd>) {
        let count = batch.unwrap_or(1);
        let mut granted: Vec<(u64, PhysicalChunk, bool)> = Vec::with_capacity(count as usize);
        // Chunks charged to the model, to be created together once the whole batch is admitted.
        let mut charged = 0usize;
        while granted.len() + charged < count as usize {
            let later = u64::from(count) - 1 - (granted.len() + charged) as u64;
            let rest = size.saturating_mul(later);
            match self.grant_one(conn, model, size, rest, look_ahead, reclaim_asked) {
                Ok(Some((cid, chunk))) => granted.push((cid, chunk, true)),
                Ok(None) => charged += 1,
                Err(reply) => {
                    self.undo_charges(model, size, charged);
                    self.undo_grants(conn, model, &granted);
                    return (reply, Vec::new());
                }
            }
        }
        if charged > 0 {
            let need = if look_ahead {
                Need::LookAhead
            } else {
                Need::Required
            };
            if let Err(reply) = self.create_charged(model, size, charged, need, &mut granted) {
                self.undo_charges(model, size, charged);
                self.undo_grants(conn, model, &granted);
                return (reply, Vec::new());
            }
        }
        let mut fds = Vec::with_capacity(granted.len());
        for &(_, chunk, _) in &granted {
            match self.backend.export_chunk(chunk) {
                Ok(fd) => fds.push(fd),
                Err(e) => {
                    // Undo every grant: the chunks come back as if given back.
                    self.undo_grants(conn, model, &granted);
                    return (error_reply(ErrorKind::Backend, e.to_string()), Vec::new());
                }
            }
        }
        let handed_over = granted.iter().filter(|g| g.2).count();
        let reply = if batch.is_none() && granted.len() == 1 {
            Reply::Granted {
                chunk: granted[0].0,
                size,
                handed_over: granted[0].2,
            }
        } else {
            Reply::GrantedMany {
                chunks: granted.iter().map(|g| g.0).collect(),
                size,
                handed_over: handed_over as u32,
            }
        };
        (reply, fds)
    }

    /// `count` chunks of `size` bytes charged to `model` for this request, none of them made
    /// (or all of them released again by [`Backend::create_many`]), are credited back: the
    /// request failed.
    fn undo_charges(&self, model: u64, size: u64, count: usize) {
        if count == 0 {
            return;
        }
        let mut book = self.book.lock();
        for _ in 0..count {
            book.ledger.credit(model, size);
        }
        drop(book);
        // Room came back: a growth waiting on the budget may go on.
        self.changed.notify_all();
    }

    /// Create the `count` chunks of `size` bytes charged to `model` in one
    /// [`Backend::create_many`] (the book unlocked; CUDA's host tier spreads it over threads),
    /// and book them into `granted`. All or none: on a failure nothing was made (the backend
    /// released what it had made) and the charges are still to be credited by the caller.
    fn create_charged(
        &self,
        model: u64,
        size: u64,
        count: usize,
        need: Need,
        granted: &mut Vec<(u64, PhysicalChunk, bool)>,
    ) -> std::result::Result<(), Reply> {
        let started = Instant::now();
        let made = match self.backend.create_many(size as usize, count, need) {
            Ok(made) => made,
            Err(e) => {
                tracing::debug!(model, size, count, error = %e, "batch create failed; its charges go back");
                return Err(error_reply(ErrorKind::Backend, e.to_string()));
            }
        };
        if made.len() != count || made.iter().any(|c| c.size as u64 != size) {
            let got = made.len();
            let n = made.iter().filter(|c| c.size as u64 == size).count();
            for c in made {
                // SAFETY: just made by this backend, booked nowhere, mapped nowhere.
                if let Err(e) = unsafe { self.backend.release(c) } {
                    tracing::error!(error = %e, "release of a wrong batch failed; the chunk is leaked");
                }
            }
            return Err(error_reply(
                ErrorKind::Backend,
                format!("the backend made {got} chunks ({n} of {size} bytes) for a batch of {count} chunks of {size} bytes"),
            ));
        }
        tracing::debug!(
            model,
            size,
            count,
            micros = started.elapsed().as_micros() as u64,
            "batch of chunks created"
        );
        let mut book = self.book.lock();
        for chunk in made {
            let cid = book.add_created(model, chunk);
            granted.push((cid, chunk, false));
        }
        Ok(())
    }

    /// Chunks granted by this request go back as if given back (the request failed).
    fn undo_grants(&self, conn: u64, model: u64, granted: &[(u64, PhysicalChunk, bool)]) {
        let mut release = Vec::new();
        {
            let mut book = self.book.lock();
            for &(cid, _, _) in granted {
                if let Ok(Some(c)) = book.give_back(conn, model, cid) {
                    release.push((cid, c));
                }
            }
        }
        self.release_all(release, None);
    }

    /// One chunk of `size` bytes for `model` (see [`Shared::grow`]): an idle chunk handed over
    /// (its id and the chunk), or `None` when the model was charged for a new chunk that the
    /// caller creates with the rest of its batch. An idle chunk of that size is reused first;
    /// otherwise the budget engine ([`crate::budget`]) admits it, with the idle list and other
    /// engines as donors. A refusal or an error comes back as the reply to send.
    fn grant_one(
        &self,
        conn: u64,
        model: u64,
        size: u64,
        rest: u64,
        look_ahead: bool,
        reclaim_asked: &mut Asked,
    ) -> std::result::Result<Option<(u64, PhysicalChunk)>, Reply> {
        {
            let mut book = self.book.lock();
            if let Err(e) = book.own_model(conn, model) {
                return Err(book_error(e));
            }
            if let Err(e) = book.check_user_bytes(model, size) {
                book.counters.refusals += 1;
                return Err(book_error(e));
            }
            // Memory no model holds is reused before anything is created, as a pool reuses
            // its own cache.
            if let Some(handed) = book.hand_over(model, size) {
                return Ok(Some(handed));
            }
        }
        let mut remote = Remote {
            shared: self,
            asker: model,
            size,
            rest,
            asked: reclaim_asked,
            handed: None,
        };
        let admitted = budget::admit(&mut remote, model, size, look_ahead);
        if let Some(handed) = remote.handed.take() {
            return Ok(Some(handed));
        }
        match admitted.charged {
            Ok(_) => Ok(None),
            Err((why, _)) => {
                let mut book = self.book.lock();
                tracing::debug!(model, size, idle = book.idle_bytes, ?why, "growth refused");
                book.counters.refusals += 1;
                match (why, book.check_user_bytes(model, size)) {
                    (LedgerRefusal::Policy, Err(e)) => Err(book_error(e)),
                    _ => Err(Reply::Refused(book.refusal(model, size, why))),
                }
            }
        }
    }

    fn push_reclaims(&self, pushes: &[(u64, u64, u64, u64)]) {
        for &(ticket, model, vconn, bytes) in pushes {
            let writer = self.book.lock().conns.get(&vconn).map(|c| c.writer.clone());
            let Some(writer) = writer else { continue };
            let push = FromBroker::Push(Push::Reclaim {
                ticket,
                model,
                bytes,
                deadline_ms: self.config.reclaim_wait.as_millis() as u64,
            });
            let asker = self.book.lock().tickets.get(&ticket).and_then(|t| t.asker);
            tracing::debug!(
                ticket,
                model,
                bytes,
                ?asker,
                "asking an engine to give memory back"
            );
            let sent = ipc::encode(&push).and_then(|payload| {
                writer.send(Outgoing {
                    payload,
                    fds: Vec::new(),
                })
            });
            if let Err(e) = sent {
                tracing::debug!(error = %e, "reclaim request not sent");
                self.book.lock().tickets.remove(&ticket);
            }
        }
    }

    /// Wait until every one of `tickets` is answered (or gone with its connection), or
    /// `deadline`. Returns the bytes each engine said it gave back (0 without an answer). The
    /// tickets stay in the book until their request ends ([`Shared::end_asks`]).
    fn wait_tickets(&self, tickets: &[u64], deadline: Instant) -> Vec<u64> {
        let mut book = self.book.lock();
        let pending = |book: &Book| {
            tickets
                .iter()
                .any(|t| book.tickets.get(t).is_some_and(|t| t.freed.is_none()))
        };
        while pending(&book) {
            if self.changed.wait_until(&mut book, deadline).timed_out() {
                break;
            }
        }
        tickets
            .iter()
            .map(|t| book.tickets.get(t).and_then(|t| t.freed).unwrap_or(0))
            .collect()
    }

    /// A request that asked other engines to give back ended: its tickets go, and what was
    /// given back for it is anyone's now.
    fn end_asks(&self, asked: &Asked) {
        if asked.tickets.is_empty() {
            return;
        }
        let mut book = self.book.lock();
        for t in &asked.tickets {
            book.tickets.remove(t);
        }
        drop(book);
        self.changed.notify_all();
    }

    /// Change a model's limit ([`crate::budget::change`]'s rules, the shared pool's too).
    /// Raising (or lowering to no less than its use) is immediate; lowering below its use stops
    /// growth at the new limit at once (a cap held for this change), asks the engine to give
    /// back, and waits up to `deadline`. A later change of the same model replaces this one
    /// (it stops waiting and says so); one that gives up lifts only its own cap.
    fn set_limit(&self, name: &str, limit: u64, deadline: Duration) -> Reply {
        let Some(key) = self.book.lock().names.get(name).copied() else {
            return error_reply(
                ErrorKind::Unknown,
                format!("no model {name:?} is registered"),
            );
        };
        let mut own = OwnEngine {
            shared: self,
            deadline,
        };
        match change::set_limit(&mut own, key, limit) {
            Ok(c) => {
                let guarantee = self.book.lock().ledger.models.get(&key).map_or(0, |b| b.guarantee);
                Reply::Changed(ChangeOutcome {
                    model: name.into(),
                    limit,
                    guarantee,
                    used: c.used,
                    reclaimed: c.before.saturating_sub(c.used),
                })
            }
            Err(LimitRefused::Unknown) => error_reply(ErrorKind::Unknown, format!("model {name:?} went away")),
            Err(LimitRefused::Invalid { guarantee }) => error_reply(
                ErrorKind::InvalidArgument,
                format!("model {name:?}: limit {limit} must be positive and at least its guarantee {guarantee}"),
            ),
            Err(LimitRefused::Replaced { now }) => error_reply(
                ErrorKind::NotReached,
                format!("model {name:?}: the change of its limit to {limit} bytes was replaced by a later change while it waited (the limit is {now})"),
            ),
            Err(LimitRefused::NotReached { before, used, standing, .. }) => error_reply(
                ErrorKind::NotReached,
                format!(
                    "model {name:?}: cannot set limit to {limit} bytes within {} ms: it still uses {used} bytes after giving back {}; the limit stays {standing}",
                    deadline.as_millis(),
                    before.saturating_sub(used)
                ),
            ),
        }
    }

    /// Change a model's guarantee ([`crate::budget::change`]'s rules): lowering takes effect
    /// at once; raising needs room in the budget, made once by the budget engine's donors (the
    /// idle list, then other engines asked to give back), within the policy's total; else
    /// nothing changes and the error says how much room there is.
    fn set_guarantee(&self, name: &str, guarantee: u64) -> Reply {
        let Some(key) = self.book.lock().names.get(name).copied() else {
            return error_reply(
                ErrorKind::Unknown,
                format!("no model {name:?} is registered"),
            );
        };
        let policy = self.book.lock().policy.clone();
        let mut asked = Asked::default();
        let mut remote = Remote {
            shared: self,
            asker: key,
            size: 0,
            rest: 0,
            asked: &mut asked,
            handed: None,
        };
        let outcome = change::set_guarantee(&mut remote, key, guarantee, |l| {
            policy.check_guarantee_total(l, name, Some(key), guarantee)
        });
        self.end_asks(&asked);
        match outcome {
            Ok(Ok((used, reclaimed))) => {
                let limit = self.book.lock().ledger.models.get(&key).map_or(0, |b| b.limit);
                Reply::Changed(ChangeOutcome { model: name.into(), limit, guarantee, used, reclaimed })
            }
            Ok(Err(GuaranteeRefused::Unknown)) => error_reply(ErrorKind::Unknown, format!("no model {name:?} is registered")),
            Ok(Err(GuaranteeRefused::AboveLimit { limit })) => error_reply(
                ErrorKind::InvalidArgument,
                format!("model {name:?}: guarantee {guarantee} is above its limit {limit}"),
            ),
            Ok(Err(GuaranteeRefused::NoRoom { max, .. })) => error_reply(
                ErrorKind::NotReached,
                format!("model {name:?}: cannot guarantee {guarantee} bytes: at most {max} fit beside the other models' use and guarantees in the global budget of {}", self.config.global_limit),
            ),
            Err(e) => book_error(e),
        }
    }
}

/// An engine asked for its own model's memory (its limit lowered): a reclaim ticket, waited
/// for until the model is within the new limit, a later change replaced this one, or the
/// deadline.
struct OwnEngine<'a> {
    shared: &'a Shared,
    deadline: Duration,
}

impl Lowering for OwnEngine<'_> {
    fn with_ledger<R>(&self, f: impl FnOnce(&mut Ledger) -> R) -> R {
        f(&mut self.shared.book.lock().ledger)
    }

    fn ask_own(
        &mut self,
        key: u64,
        bytes: u64,
        settled: &dyn Fn(&Ledger) -> bool,
    ) -> (GivenBack, Result<()>) {
        let end = Instant::now() + self.deadline;
        let ticket = {
            let mut book = self.shared.book.lock();
            let Some(conn) = book.models.get(&key).map(|m| m.conn) else {
                return (GivenBack::default(), Ok(()));
            };
            let t = book.next_id();
            book.tickets.insert(
                t,
                Ticket {
                    conn,
                    model: key,
                    asker: None,
                    freed: None,
                },
            );
            book.counters.reclaim_requests += 1;
            (t, conn)
        };
        self.shared
            .push_reclaims(&[(ticket.0, key, ticket.1, bytes)]);
        let mut book = self.shared.book.lock();
        while !settled(&book.ledger) {
            if self.shared.changed.wait_until(&mut book, end).timed_out() {
                break;
            }
        }
        book.tickets.remove(&ticket.0);
        // What it gave back is booked as it comes (its answer to the ticket).
        (GivenBack::default(), Ok(()))
    }
}

/// The broker's transport for the budget engine, for one request: the idle list is handed
/// over (a chunk of the size asked) or released, other engines are asked to give back (again
/// only after an ask that gave something back, all within one reclaim wait).
struct Remote<'a> {
    shared: &'a Shared,
    /// The model asking.
    asker: u64,
    /// The size of the chunk asked for (0: not a growth), and the bytes of the batch after it.
    size: u64,
    rest: u64,
    /// Other engines asked for this request so far.
    asked: &'a mut Asked,
    /// The idle chunk handed over.
    handed: Option<(u64, PhysicalChunk)>,
}

/// Other engines asked to give back for one request (a growth's whole batch, a guarantee
/// raised). A request asks again after an ask that gave something back (what is given back
/// for it is kept for it, but a later chunk of its batch may need more); a model that gave
/// nothing is not asked again, the next donors in order are asked instead; it waits no longer
/// in all than the reclaim wait from its first ask.
#[derive(Debug, Default)]
pub(super) struct Asked {
    /// The end of this request's reclaim wait, from its first ask.
    deadline: Option<Instant>,
    /// Its tickets, in the book until the request ends: what the engines asked give back
    /// meanwhile is kept for it.
    tickets: Vec<u64>,
    /// No engine is asked again for this request.
    spent: bool,
    /// Models that gave nothing when asked (or did not answer in time): not asked again.
    dry: std::collections::BTreeSet<u64>,
}

impl Donors for Remote<'_> {
    fn with_ledger<R>(&self, f: impl FnOnce(&mut Ledger) -> R) -> R {
        f(&mut self.shared.book.lock().ledger)
    }

    fn charge(&self, asker: u64, bytes: u64) -> std::result::Result<(), LedgerRefusal> {
        let mut book = self.shared.book.lock();
        if book.check_user_bytes(asker, bytes).is_err() {
            return Err(LedgerRefusal::Policy);
        }
        book.ledger.try_charge(asker, bytes)
    }

    /// Every line but the models that gave nothing when asked for this request.
    fn reachable(&mut self, asker: u64) -> Vec<(u64, u64)> {
        let mut reach = self.shared.book.lock().reachable(asker);
        reach.retain(|(k, _)| !self.asked.dry.contains(k));
        reach
    }

    fn rest(&self) -> u64 {
        self.rest
    }

    /// Only the idle list's chunks move directly: one of the size asked, which serves the whole
    /// request (however little of it the budget lacked).
    fn hand_over(&mut self, asker: u64, from: Ask, _want: u64) -> u64 {
        if from.key != IDLE || self.size == 0 || self.handed.is_some() {
            return 0;
        }
        let got = self.shared.book.lock().hand_over(asker, self.size);
        let n = got.map_or(0, |_| self.size);
        self.handed = got;
        n
    }

    fn reclaim(&mut self, asks: &[Ask]) -> u64 {
        let mut got = 0u64;
        let mut engines = Vec::new();
        for a in asks {
            if a.key == IDLE {
                // Only what this chunk lacks: the rest of a batch may still be handed idle
                // chunks over.
                let want = a.bytes.saturating_sub(self.rest).max(1);
                let idle = self.shared.book.lock().take_idle(want, Some(self.asker));
                got += idle.iter().map(|(_, c)| c.size as u64).sum::<u64>();
                self.shared.release_all(idle, Some(IDLE));
            } else if !self.asked.spent {
                engines.push(*a);
            }
        }
        if engines.is_empty() {
            return got;
        }
        let want = engines
            .iter()
            .fold(0u64, |sum, a| sum.saturating_add(a.bytes));
        let deadline = *self
            .asked
            .deadline
            .get_or_insert_with(|| Instant::now() + self.shared.config.reclaim_wait);
        loop {
            if Instant::now() >= deadline {
                self.asked.spent = true;
                return got;
            }
            let freed = self.ask_engines(&engines, deadline);
            if freed > 0 {
                return got.saturating_add(freed);
            }
            // Those gave nothing (their memory in use, or given for another request already):
            // the next donors in the engine's order are asked, within the same wait.
            let reach = self.reachable(self.asker);
            // Idle memory this request may take came back meanwhile (given back for a request
            // that ended, or by no request): the engine's next round takes it.
            let idle = reach
                .iter()
                .find(|(k, _)| *k == IDLE)
                .map_or(0, |&(_, b)| b);
            if idle > 0 {
                return got.saturating_add(idle);
            }
            let donors = self.with_ledger(|l| budget::donors(l, self.asker, &reach));
            engines = budget::plan(&donors, want)
                .into_iter()
                .filter(|a| a.key != IDLE)
                .collect();
            if engines.is_empty() {
                self.asked.spent = true;
                return got;
            }
        }
    }
}

impl Remote<'_> {
    /// Ask the engines of `asks` to give back, and wait for their answers until `deadline`.
    /// Only what the engines say they gave back counts (it is on the idle list or released by
    /// then: an engine answers after its give-backs were answered); a model that gave nothing,
    /// or did not answer in time, is not asked again for this request.
    fn ask_engines(&mut self, asks: &[Ask], deadline: Instant) -> u64 {
        let pushes: Vec<(u64, u64, u64, u64)> = {
            let mut book = self.shared.book.lock();
            let pushes: Vec<_> = asks
                .iter()
                .filter_map(|a| {
                    let vconn = book.models.get(&a.key)?.conn;
                    let ticket = book.next_id();
                    book.tickets.insert(
                        ticket,
                        Ticket {
                            conn: vconn,
                            model: a.key,
                            asker: Some(self.asker),
                            freed: None,
                        },
                    );
                    Some((ticket, a.key, vconn, a.bytes))
                })
                .collect();
            book.counters.reclaim_requests += pushes.len() as u64;
            pushes
        };
        let tickets: Vec<u64> = pushes.iter().map(|p| p.0).collect();
        self.asked.tickets.extend(&tickets);
        self.shared.push_reclaims(&pushes);
        let answers = self.shared.wait_tickets(&tickets, deadline);
        let mut freed = 0u64;
        for (p, got) in pushes.iter().zip(answers) {
            if got == 0 {
                self.asked.dry.insert(p.1);
            }
            freed = freed.saturating_add(got);
        }
        // Asked models that went away meanwhile gave nothing either.
        for a in asks {
            if !pushes.iter().any(|p| p.1 == a.key) {
                self.asked.dry.insert(a.key);
            }
        }
        freed
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::host::{ChunkFiles, HostBackend, DEFAULT_GRANULARITY};

    /// A connection's thread that panics (here: in the middle of serving, holding a model and a
    /// chunk) still gives everything back: the cleanup runs after the unwind, the books balance.
    #[test]
    fn a_panicking_connection_gives_everything_back() {
        let dir = std::env::temp_dir().join(format!("evmm-unit-panic-{}", std::process::id()));
        let host =
            HostBackend::with_chunk_files(DEFAULT_GRANULARITY, ChunkFiles::PerChunk).unwrap();
        let broker = Broker::start(
            Arc::new(host),
            BrokerConfig::new(dir.join("b.sock"), 64 << 20),
        )
        .unwrap();
        let shared = broker.shared.clone();
        let (ours, theirs) = UnixStream::pair().unwrap();
        let (writer, writer_thread) =
            FrameWriter::spawn(ours.try_clone().unwrap(), 8, "unit").unwrap();
        let peer = PeerCredentials {
            pid: 1,
            uid: 0,
            gid: 0,
        };
        let conn = {
            let mut book = shared.book.lock();
            let conn = book.next_id();
            book.conns.insert(
                conn,
                super::super::book::ConnEntry {
                    name: "unit".into(),
                    role: Role::Engine,
                    peer,
                    writer: writer.clone(),
                    stream: ours,
                    pidfd: None,
                },
            );
            conn
        };
        shared.guarded(conn, peer, || {
            let Reply::Registered { model } = shared
                .handle(
                    conn,
                    Role::Engine,
                    Request::Register {
                        model: "m".into(),
                        limit: 32 << 20,
                        guarantee: 4 << 20,
                        priority: 0,
                    },
                )
                .0
            else {
                panic!("register")
            };
            let (granted, fds) = shared.handle(
                conn,
                Role::Engine,
                Request::Grow {
                    model,
                    size: 2 << 20,
                },
            );
            assert!(matches!(granted, Reply::Granted { .. }), "{granted:?}");
            assert_eq!(fds.len(), 1);
            assert_eq!(shared.snapshot(None).global_used, 2 << 20);
            panic!("injected panic while serving a connection");
        });
        let s = broker.snapshot();
        assert_eq!(s.audit, None);
        assert!(s.models.is_empty() && s.engines.is_empty(), "{s:?}");
        assert_eq!((s.global_used, s.idle), (0, 0));
        assert_eq!(s.counters.panics, 1);
        assert_eq!(s.counters.releases, 1, "the chunk went back to the driver");
        drop((writer, theirs));
        writer_thread.join().unwrap();
        drop(broker);
        let _ = std::fs::remove_dir_all(dir);
    }

    /// A backend whose batch creates go over threads, as CUDA's host tier's do
    /// ([`crate::backend::create_on_threads`]; the host backend's `create_many` is the serial
    /// default); every other call goes to `inner`.
    #[derive(Debug)]
    struct Threaded {
        inner: Arc<dyn Backend>,
        threads: std::sync::atomic::AtomicUsize,
    }

    impl Backend for Threaded {
        fn info(&self) -> &crate::backend::BackendInfo {
            self.inner.info()
        }
        fn reserve(&self, size: usize, alignment: usize) -> Result<u64> {
            self.inner.reserve(size, alignment)
        }
        unsafe fn free_reservation(&self, base: u64, size: usize) -> Result<()> {
            // SAFETY: forwarded contract.
            unsafe { self.inner.free_reservation(base, size) }
        }
        fn create(&self, size: usize) -> Result<PhysicalChunk> {
            self.inner.create(size)
        }
        fn create_many(&self, size: usize, count: usize, _: Need) -> Result<Vec<PhysicalChunk>> {
            let threads = self.threads.load(Ordering::SeqCst);
            crate::backend::create_on_threads(&*self.inner, size, count, threads)
        }
        unsafe fn release(&self, chunk: PhysicalChunk) -> Result<()> {
            // SAFETY: forwarded contract.
            unsafe { self.inner.release(chunk) }
        }
        unsafe fn map(&self, addr: u64, chunk: PhysicalChunk) -> Result<()> {
            // SAFETY: forwarded contract.
            unsafe { self.inner.map(addr, chunk) }
        }
        unsafe fn set_access(&self, addr: u64, size: usize) -> Result<()> {
            // SAFETY: forwarded contract.
            unsafe { self.inner.set_access(addr, size) }
        }
        unsafe fn unmap(&self, addr: u64, size: usize) -> Result<()> {
            // SAFETY: forwarded contract.
            unsafe { self.inner.unmap(addr, size) }
        }
        fn memory_info(&self) -> Result<crate::backend::MemoryInfo> {
            self.inner.memory_info()
        }
        fn physical_bytes(&self) -> Result<u64> {
            self.inner.physical_bytes()
        }
        fn export_chunk(&self, chunk: PhysicalChunk) -> Result<OwnedFd> {
            self.inner.export_chunk(chunk)
        }
        fn copies(&self) -> &dyn crate::backend::Copies {
            self.inner.copies()
        }
    }

    const CHUNK: usize = DEFAULT_GRANULARITY;

    /// A broker on host chunks, seen through (from the driver up): `delays` (single creates),
    /// `faults` (single creates), [`Threaded`] batch creates, and `batches` (no delay set; it
    /// counts the broker's calls, a batch create as one).
    struct Rig {
        broker: Broker,
        host: Arc<dyn Backend>,
        delays: Arc<crate::backend::testing::DelayInjector>,
        faults: Arc<crate::backend::testing::FaultInjector>,
        threaded: Arc<Threaded>,
        batches: Arc<crate::backend::testing::DelayInjector>,
        dir: PathBuf,
    }

    fn rig(tag: &str) -> Rig {
        use crate::backend::testing::{DelayInjector, FaultInjector};
        let dir = std::env::temp_dir().join(format!("evmm-unit-{tag}-{}", std::process::id()));
        let host: Arc<dyn Backend> =
            Arc::new(HostBackend::with_chunk_files(CHUNK, ChunkFiles::PerChunk).unwrap());
        let delays = Arc::new(DelayInjector::new(host.clone()));
        let faults = Arc::new(FaultInjector::new(delays.clone()));
        let threaded = Arc::new(Threaded {
            inner: faults.clone(),
            threads: 8.into(),
        });
        let batches = Arc::new(DelayInjector::new(threaded.clone()));
        let broker = Broker::start(
            batches.clone(),
            BrokerConfig::new(dir.join("b.sock"), 64 << 20),
        )
        .unwrap();
        Rig {
            broker,
            host,
            delays,
            faults,
            threaded,
            batches,
            dir,
        }
    }

    /// What a failed batch must leave as it found: the ledger, the idle list, the model's
    /// charge and chunks, and the driver's physical bytes.
    fn books(rig: &Rig) -> (u64, u64, u64, u64, u64) {
        let s = rig.broker.snapshot();
        assert_eq!(s.audit, None);
        let m = s.models.iter().find(|m| m.name == "m").expect("model m");
        (
            s.global_used,
            s.idle,
            m.used,
            m.chunks,
            rig.host.physical_bytes().unwrap(),
        )
    }

    /// A batch grant hands idle chunks over first, then makes all its new chunks in one
    /// `create_many`: with 100 ms per create spread over 8 threads (as CUDA's host tier
    /// spreads them), 8 new chunks take about one create's delay, not 8; created on one
    /// thread (as the broker did, a create after each admission) they take 8.
    #[test]
    fn a_batch_grant_creates_its_new_chunks_together() {
        use crate::backend::DriverCall::Create;
        use crate::broker::BrokerClient;
        const D: Duration = Duration::from_millis(100);
        let rig = rig("batchcreate");
        let client = BrokerClient::connect(rig.broker.socket(), "unit").unwrap();
        let m = client
            .register(crate::ModelConfig::new("m", 1 << 30, 64 << 20))
            .unwrap();
        let b = m.backend().clone();
        // Two idle chunks at the broker: made, then given back.
        let two = b.create_many(CHUNK, 2, Need::Required).unwrap();
        // SAFETY: just granted, mapped nowhere.
        assert!(unsafe { b.release_many(&two) }.iter().all(|r| r.is_ok()));
        assert_eq!(rig.broker.snapshot().idle, 2 * CHUNK as u64);
        let mut timed = Vec::new();
        for threads in [8, 1] {
            rig.threaded.threads.store(threads, Ordering::SeqCst);
            rig.delays.set_delay(Create, D);
            let before = rig.broker.snapshot().counters;
            let (batches, singles) = (rig.batches.calls(Create), rig.delays.calls(Create));
            let t = Instant::now();
            let got = b.create_many(CHUNK, 10, Need::Required).unwrap();
            let took = t.elapsed();
            rig.delays.clear();
            let after = rig.broker.snapshot().counters;
            assert_eq!(got.len(), 10);
            // The idle chunks first, then one batch create of the other 8.
            assert_eq!(after.handovers - before.handovers, 2, "{after:?}");
            assert_eq!(after.creates - before.creates, 8, "{after:?}");
            assert_eq!(rig.batches.calls(Create) - batches, 1, "one create_many");
            assert_eq!(rig.delays.calls(Create) - singles, 8, "8 creates under it");
            eprintln!(
                "batch of 8 new chunks (+2 handed over), {} ms per create, {threads} thread(s): {} ms",
                D.as_millis(),
                took.as_millis()
            );
            timed.push(took);
            // SAFETY: just granted, mapped nowhere. All 10 go idle for the next round.
            assert!(unsafe { b.release_many(&got) }.iter().all(|r| r.is_ok()));
            // The next round hands 10 over: trim to the two idle chunks it starts from.
            let s = rig.broker.snapshot();
            assert_eq!(s.idle, 10 * CHUNK as u64);
            let idle = rig
                .broker
                .shared
                .book
                .lock()
                .take_idle(8 * CHUNK as u64, None);
            rig.broker.shared.release_all(idle, Some(IDLE));
            assert_eq!(rig.broker.snapshot().idle, 2 * CHUNK as u64);
        }
        // One-sided where it matters: 8 delays of D on one thread take at least 8 D on any
        // machine; on 8 threads they overlap (4 D leaves room for a loaded CI box).
        assert!(timed[1] >= 8 * D, "serial: {:?}", timed[1]);
        assert!(
            timed[0] >= D && timed[0] < 4 * D,
            "on threads: {:?}",
            timed[0]
        );
        drop((m, client));
        drop(rig.broker);
        let _ = std::fs::remove_dir_all(rig.dir);
    }

    /// A batch create that fails part way (one of its 8 creates, the others made on other
    /// threads) leaves everything as it was: the charges of the whole batch credited back, the
    /// chunks made released, the idle chunks handed over back on the idle list, the driver's
    /// physical bytes as before. Every position of the failure, then a batch that goes through.
    #[test]
    fn a_failed_batch_create_leaves_the_books_as_before() {
        use crate::backend::DriverCall::Create;
        use crate::broker::BrokerClient;
        let rig = rig("batchfail");
        let client = BrokerClient::connect(rig.broker.socket(), "unit").unwrap();
        let m = client
            .register(crate::ModelConfig::new("m", 1 << 30, 64 << 20))
            .unwrap();
        let b = m.backend().clone();
        // The model holds one chunk; two wait idle.
        let three = b.create_many(CHUNK, 3, Need::Required).unwrap();
        // SAFETY: just granted, mapped nowhere.
        assert!(unsafe { b.release_many(&three[1..]) }
            .iter()
            .all(|r| r.is_ok()));
        let before = books(&rig);
        assert_eq!(
            before,
            (
                3 * CHUNK as u64,
                2 * CHUNK as u64,
                CHUNK as u64,
                1,
                3 * CHUNK as u64
            )
        );
        for n in 1..=8u64 {
            let counters = rig.broker.snapshot().counters;
            rig.faults.fail_nth(Create, n);
            let e = b
                .create_many(CHUNK, 10, Need::Required)
                .expect_err("a create of the batch fails");
            assert!(e.to_string().contains("FAULT_INJECTED"), "{e}");
            assert_eq!(books(&rig), before, "failure at create {n}");
            let after = rig.broker.snapshot().counters;
            assert_eq!(
                after.handovers - counters.handovers,
                2,
                "handed over, then back"
            );
            assert_eq!(after.creates, counters.creates, "nothing booked as created");
            rig.faults.clear();
        }
        assert_eq!(
            b.physical_bytes().unwrap(),
            CHUNK as u64,
            "the engine holds one"
        );
        let got = b.create_many(CHUNK, 10, Need::Required).unwrap();
        let (used, idle, mine, chunks, physical) = books(&rig);
        assert_eq!(
            (used, idle, mine, chunks),
            (11 * CHUNK as u64, 0, 11 * CHUNK as u64, 11)
        );
        assert_eq!(physical, 11 * CHUNK as u64);
        // SAFETY: granted, mapped nowhere.
        assert!(unsafe { b.release_many(&got) }.iter().all(|r| r.is_ok()));
        drop((m, client));
        drop(rig.broker);
        let _ = std::fs::remove_dir_all(rig.dir);
    }
}
