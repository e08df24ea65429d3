//! The broker daemon: a Unix socket, one thread per connection, the books under one lock.
//!
//! Locks: the book ([`Book`], a `parking_lot` mutex) guards bookkeeping only. Driver calls
//! (create, export, release), socket reads and queued writes all happen without it, on chunks
//! taken out of the book beforehand (held "moving"); a failure puts back or settles exactly
//! what was taken. Lock order: the book alone; a connection's writer queue is only ever fed
//! with the book released. Waiting for reclaims uses a condition variable on the book's mutex.

use std::fs::File;
use std::os::fd::OwnedFd;
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};

use super::book::{Book, BookError, ConnEntry, Ticket, IDLE};
use super::metrics::Metrics;
use super::protocol::{
    BackendDesc, ChangeOutcome, ErrorKind, FromBroker, Push, Reply, Request, Role, Snapshot,
    ToBroker, MAX_BATCH, MAX_CONNECTIONS, PROTOCOL_VERSION,
};
use crate::backend::counting::Counting;
use crate::backend::{Backend, PhysicalChunk};
use crate::error::{Error, Result};
use crate::ipc::{self, FrameWriter, Outgoing, PeerCredentials};
use crate::shared::ledger::Refusal as LedgerRefusal;

/// How a broker is set up.
#[derive(Debug, Clone)]
pub struct BrokerConfig {
    /// The socket's path.
    pub socket: PathBuf,
    /// The global budget in bytes.
    pub global_limit: u64,
    /// Group allowed to connect as engines besides the broker's user (socket mode 0660 then);
    /// `None`: the broker's user only (mode 0600).
    pub group: Option<u32>,
    /// How long a growth waits for other engines to give memory back.
    pub reclaim_wait: Duration,
    /// How long a connection may take to say hello, and a stuck peer may block a write.
    pub io_timeout: Duration,
}

impl BrokerConfig {
    /// A broker on `socket` with a global budget of `global_limit` bytes, mode 0600, reclaims
    /// waited for 2 s.
    pub fn new(socket: impl Into<PathBuf>, global_limit: u64) -> Self {
        BrokerConfig {
            socket: socket.into(),
            global_limit,
            group: None,
            reclaim_wait: Duration::from_secs(2),
            io_timeout: Duration::from_secs(5),
        }
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
}

/// State shared by the broker's threads.
pub(crate) struct Shared {
    backend: Arc<Counting>,
    pub(crate) desc: BackendDesc,
    config: BrokerConfig,
    pub(crate) book: Mutex<Book>,
    /// Signalled whenever memory comes back or a reclaim ticket is answered.
    changed: Condvar,
    pid: u32,
    uid: u32,
    stopping: AtomicBool,
    pub(crate) metrics: Metrics,
}

/// A running broker. Dropping it (or [`Broker::shutdown`]) stops it: connections are closed and
/// every chunk is released.
pub struct Broker {
    shared: Arc<Shared>,
    accept: Option<JoinHandle<()>>,
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
    /// Start a broker owning `backend`'s chunks (it must export them: CUDA with POSIX-fd
    /// support, or a host backend with per-chunk files). Refused when another broker serves
    /// the same socket.
    pub fn start(backend: Arc<dyn Backend>, config: BrokerConfig) -> Result<Broker> {
        let info = backend.info().clone();
        if !info.posix_fd_exportable {
            return Err(Error::InvalidArgument(format!(
                "the broker's {} backend cannot export chunks as POSIX descriptors (host: use ChunkFiles::PerChunk)",
                info.name
            )));
        }
        if config.global_limit < info.granularity as u64 {
            return Err(Error::InvalidArgument(format!(
                "global limit {} is below one granule of {} bytes",
                config.global_limit, info.granularity
            )));
        }
        crate::ipc::raise_fd_limit();
        let path = config.socket.clone();
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir).map_err(|e| io_err("create socket folder", dir, e))?;
        }
        // One broker per socket: an exclusive lock on a file beside it, held for the broker's
        // life (the kernel drops it when the process dies, so a crashed broker leaves none).
        let lock_path = path.with_extension("lock");
        let lock = File::options()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&lock_path)
            .map_err(|e| io_err("open lock file", &lock_path, e))?;
        if let Err(e) =
            rustix::fs::flock(&lock, rustix::fs::FlockOperation::NonBlockingLockExclusive)
        {
            let holder = std::fs::read_to_string(&lock_path).unwrap_or_default();
            return Err(Error::Ipc {
                op: "start broker",
                detail: format!(
                    "another broker (pid {}) serves {} ({e})",
                    holder.trim(),
                    path.display()
                ),
            });
        }
        let _ = rustix::fs::ftruncate(&lock, 0);
        let _ = std::io::Write::write_all(&mut &lock, std::process::id().to_string().as_bytes());
        // The lock is ours: a socket file left by a dead broker is stale.
        let _ = std::fs::remove_file(&path);
        let listener = UnixListener::bind(&path).map_err(|e| io_err("bind", &path, e))?;
        let mode = if config.group.is_some() { 0o660 } else { 0o600 };
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(mode))
            .map_err(|e| io_err("chmod socket", &path, e))?;
        if let Some(gid) = config.group {
            rustix::fs::chown(&path, None, Some(rustix::process::Gid::from_raw(gid)))
                .map_err(|e| io_err("chown socket", &path, e.into()))?;
        }
        let desc = BackendDesc {
            name: info.name.to_string(),
            device_ordinal: info.device_ordinal,
            granularity: info.granularity as u64,
            device_name: info.device_name.clone(),
        };
        let shared = Arc::new(Shared {
            backend: Arc::new(Counting::new(backend)),
            desc,
            book: Mutex::new(Book::new(config.global_limit)),
            changed: Condvar::new(),
            pid: std::process::id(),
            uid: rustix::process::getuid().as_raw(),
            stopping: AtomicBool::new(false),
            metrics: Metrics::new(),
            config,
        });
        tracing::info!(socket = %path.display(), global_limit = shared.config.global_limit, backend = %shared.desc.name, "broker listening");
        let s = shared.clone();
        let accept = std::thread::Builder::new()
            .name("broker-accept".into())
            .spawn(move || accept_loop(s, listener))
            .map_err(|e| io_err("spawn", &path, e))?;
        Ok(Broker {
            shared,
            accept: Some(accept),
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
        // Wake the accept loop.
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
        let idle = self.shared.book.lock().take_idle(u64::MAX);
        self.shared.release_all(idle, Some(IDLE));
        let _ = std::fs::remove_file(&self.shared.config.socket);
    }
}

impl Drop for Broker {
    fn drop(&mut self) {
        if !self.shared.stopping.load(Ordering::SeqCst) {
            self.stop();
        }
    }
}

fn accept_loop(shared: Arc<Shared>, listener: UnixListener) {
    for stream in listener.incoming() {
        if shared.stopping.load(Ordering::SeqCst) {
            break;
        }
        let stream = match stream {
            Ok(s) => s,
            Err(e) => {
                tracing::warn!(error = %e, "accept failed");
                std::thread::sleep(Duration::from_millis(10));
                continue;
            }
        };
        let id = shared.book.lock().next_id();
        let s = shared.clone();
        let spawned = std::thread::Builder::new()
            .name(format!("broker-conn-{id}"))
            .spawn(move || serve(s, stream, id));
        if let Err(e) = spawned {
            tracing::warn!(error = %e, "cannot spawn a connection thread");
        }
    }
}

fn error_reply(kind: ErrorKind, message: impl Into<String>) -> Reply {
    Reply::Error {
        kind,
        message: message.into(),
    }
}

fn book_error(e: BookError) -> Reply {
    match e {
        BookError::Unknown(m) => error_reply(ErrorKind::Unknown, m),
        BookError::Invalid(m) => error_reply(ErrorKind::InvalidArgument, m),
        BookError::Duplicate(m) => error_reply(ErrorKind::Duplicate, m),
    }
}

fn send(writer: &FrameWriter, id: u64, reply: Reply, fds: Vec<OwnedFd>) -> Result<()> {
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

/// One connection, from hello to cleanup.
fn serve(shared: Arc<Shared>, stream: UnixStream, conn: u64) {
    let peer = match ipc::peer_credentials(&stream) {
        Ok(p) => p,
        Err(e) => {
            tracing::warn!(error = %e, "no peer credentials; connection closed");
            return;
        }
    };
    if shared.stopping.load(Ordering::SeqCst) {
        return;
    }
    let _ = stream.set_write_timeout(Some(shared.config.io_timeout));
    let Ok(clone) = stream.try_clone() else {
        return;
    };
    let Ok((writer, writer_thread)) =
        FrameWriter::spawn(clone, 1024, &format!("broker-conn-{conn}"))
    else {
        return;
    };
    match handshake(&shared, &stream, conn, peer, &writer) {
        Ok(()) => {
            let _ = stream.set_read_timeout(None);
            read_loop(&shared, &stream, conn, &writer);
        }
        Err(reply) => {
            shared.book.lock().counters.refused_connections += 1;
            let _ = send(&writer, 0, reply, Vec::new());
        }
    }
    // Cleanup: every model of this connection goes, with its chunks.
    let chunks = shared.book.lock().drop_conn(conn);
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
    shared.release_all(chunks, None);
    shared.changed.notify_all();
    // Let the writer flush what was queued (an error reply), then close.
    drop(writer);
    let _ = writer_thread.join();
    let _ = stream.shutdown(std::net::Shutdown::Both);
    tracing::debug!(conn, pid = peer.pid, "connection closed");
}

fn handshake(
    shared: &Shared,
    stream: &UnixStream,
    conn: u64,
    peer: PeerCredentials,
    writer: &FrameWriter,
) -> std::result::Result<(), Reply> {
    let _ = stream.set_read_timeout(Some(shared.config.io_timeout));
    let same_user = peer.uid == shared.uid || peer.uid == 0;
    let in_group = shared.config.group.is_some_and(|g| g == peer.gid);
    if !same_user && !in_group {
        return Err(error_reply(
            ErrorKind::Forbidden,
            format!("user {} is not allowed on this broker", peer.uid),
        ));
    }
    let frame = match ipc::recv_frame(stream, ipc::MAX_FRAME) {
        Ok(Some(f)) if f.fds.is_empty() => f,
        Ok(Some(_)) => {
            return Err(error_reply(
                ErrorKind::Malformed,
                "descriptors attached to hello",
            ))
        }
        // A probe (or a peer that died at once): nothing to answer.
        Ok(None) => return Err(error_reply(ErrorKind::Malformed, "closed before hello")),
        Err(e) => return Err(error_reply(ErrorKind::Malformed, e.to_string())),
    };
    let msg: ToBroker = ipc::decode(&frame.payload)
        .map_err(|e| error_reply(ErrorKind::Malformed, e.to_string()))?;
    let Request::Hello {
        version,
        role,
        name,
    } = msg.request
    else {
        return Err(error_reply(
            ErrorKind::Malformed,
            "the first message must be hello",
        ));
    };
    if version != PROTOCOL_VERSION {
        return Err(error_reply(
            ErrorKind::InvalidArgument,
            format!("protocol version {version}, this broker speaks {PROTOCOL_VERSION}"),
        ));
    }
    super::book::check_name("engine name", &name).map_err(book_error)?;
    if role == Role::Control && !same_user {
        return Err(error_reply(
            ErrorKind::Forbidden,
            format!(
                "control connections are for user {} (or root), not {}",
                shared.uid, peer.uid
            ),
        ));
    }
    let Ok(stream_clone) = stream.try_clone() else {
        return Err(error_reply(ErrorKind::Backend, "cannot clone the socket"));
    };
    {
        let mut book = shared.book.lock();
        if book.conns.len() >= MAX_CONNECTIONS {
            return Err(error_reply(
                ErrorKind::Forbidden,
                format!(
                    "{} connections open, {MAX_CONNECTIONS} allowed",
                    book.conns.len()
                ),
            ));
        }
        book.conns.insert(
            conn,
            ConnEntry {
                name: name.clone(),
                role,
                peer,
                writer: writer.clone(),
                stream: stream_clone,
            },
        );
    }
    tracing::info!(conn, name = %name, ?role, pid = peer.pid, uid = peer.uid, gid = peer.gid, "connected");
    let welcome = Reply::Welcome {
        broker_pid: shared.pid,
        backend: shared.desc.clone(),
        global_limit: shared.config.global_limit,
        engine: conn,
    };
    send(writer, msg.id, welcome, Vec::new())
        .map_err(|e| error_reply(ErrorKind::Backend, e.to_string()))
}

fn read_loop(shared: &Shared, stream: &UnixStream, conn: u64, writer: &FrameWriter) {
    let role = shared.book.lock().conns.get(&conn).map(|c| c.role);
    let Some(role) = role else { return };
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
        let started = Instant::now();
        let is_grow = matches!(msg.request, Request::Grow { .. } | Request::GrowMany { .. });
        let (reply, fd) = shared.handle(conn, role, msg.request);
        if is_grow && matches!(reply, Reply::Granted { .. } | Reply::GrantedMany { .. }) {
            shared.metrics.observe_grant(started.elapsed());
            shared.book.lock().counters.grant_micros += started.elapsed().as_micros() as u64;
        }
        if let Err(e) = send(writer, msg.id, reply, fd) {
            tracing::debug!(conn, error = %e, "reply not sent; closing");
            return;
        }
    }
}

impl Shared {
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
        Snapshot {
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
        }
    }

    pub(crate) fn metrics_text(&self) -> String {
        let snap = self.snapshot(None);
        self.metrics.render(&snap, &self.backend.counts())
    }

    /// Release moving chunks to the driver, settling the book for each.
    fn release_all(&self, chunks: Vec<(u64, PhysicalChunk)>, charged_to: Option<u64>) {
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
                let r = self
                    .book
                    .lock()
                    .register(conn, &model, limit, guarantee, priority);
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
                                | BookError::Duplicate(m),
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
                if let Some(t) = book
                    .tickets
                    .get(&ticket)
                    .copied()
                    .filter(|t| t.conn == conn)
                {
                    book.tickets.remove(&ticket);
                    book.ledger.note_reclaimed(t.model, freed);
                }
                drop(book);
                tracing::debug!(conn, ticket, freed, "reclaim answered");
                self.changed.notify_all();
                (Reply::Done, Vec::new())
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
                let idle = self.book.lock().take_idle(u64::MAX);
                let released = idle.iter().map(|(_, c)| c.size as u64).sum();
                self.release_all(idle, Some(IDLE));
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
    /// handed over, or new ones charged then created; when the budget is short, idle chunks of
    /// other sizes are released and other engines asked to give back, once, within the reclaim
    /// wait. Each chunk is exported as a descriptor; one reply carries them all
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
        let count = batch.unwrap_or(1);
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
        let mut granted: Vec<(u64, PhysicalChunk, bool)> = Vec::with_capacity(count as usize);
        // A look-ahead never waits for other engines: as if their reclaim was asked already.
        let mut reclaim_asked = look_ahead;
        while granted.len() < count as usize {
            match self.grant_one(conn, model, size, &mut reclaim_asked) {
                Ok(g) => granted.push(g),
                Err(reply) => {
                    self.undo_grants(conn, model, &granted);
                    return (reply, Vec::new());
                }
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

    /// One chunk of `size` bytes for `model` (see [`Shared::grow`]): its id, the chunk, and
    /// whether it was handed over. A refusal or an error comes back as the reply to send.
    fn grant_one(
        &self,
        conn: u64,
        model: u64,
        size: u64,
        reclaim_asked: &mut bool,
    ) -> std::result::Result<(u64, PhysicalChunk, bool), Reply> {
        loop {
            enum Next {
                HandOver(u64, PhysicalChunk),
                Create,
                ReleaseIdle(Vec<(u64, PhysicalChunk)>),
                Reclaim(Vec<(u64, u64, u64, u64)>),
            }
            let next = {
                let mut book = self.book.lock();
                if let Err(e) = book.own_model(conn, model) {
                    return Err(book_error(e));
                }
                if let Some((cid, chunk)) = book.hand_over(model, size) {
                    Next::HandOver(cid, chunk)
                } else {
                    match book.charge(model, size) {
                        Ok(()) => Next::Create,
                        Err(LedgerRefusal::Global { short }) if book.idle_bytes > 0 => {
                            Next::ReleaseIdle(book.take_idle(short))
                        }
                        Err(why @ LedgerRefusal::Global { short }) if !*reclaim_asked => {
                            let plan = book.reclaim_plan(conn, short);
                            if plan.is_empty() {
                                book.counters.refusals += 1;
                                return Err(Reply::Refused(book.refusal(model, size, why)));
                            }
                            let mut pushes = Vec::new();
                            for (victim, vconn, bytes) in plan {
                                let ticket = book.next_id();
                                book.tickets.insert(
                                    ticket,
                                    Ticket {
                                        conn: vconn,
                                        model: victim,
                                    },
                                );
                                pushes.push((ticket, victim, vconn, bytes));
                            }
                            book.counters.reclaim_requests += pushes.len() as u64;
                            Next::Reclaim(pushes)
                        }
                        Err(why) => {
                            book.counters.refusals += 1;
                            return Err(Reply::Refused(book.refusal(model, size, why)));
                        }
                    }
                }
            };
            match next {
                Next::ReleaseIdle(idle) => self.release_all(idle, Some(IDLE)),
                Next::Reclaim(pushes) => {
                    *reclaim_asked = true;
                    let tickets: Vec<u64> = pushes.iter().map(|p| p.0).collect();
                    self.push_reclaims(&pushes);
                    self.wait_tickets(&tickets, Instant::now() + self.config.reclaim_wait);
                }
                Next::Create => match self.backend.create(size as usize) {
                    Ok(chunk) => {
                        let cid = self.book.lock().add_created(model, chunk);
                        return Ok((cid, chunk, false));
                    }
                    Err(e) => {
                        self.book.lock().ledger.credit(model, size);
                        return Err(error_reply(ErrorKind::Backend, e.to_string()));
                    }
                },
                Next::HandOver(cid, chunk) => return Ok((cid, chunk, true)),
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
            tracing::debug!(ticket, model, bytes, "asking an engine to give memory back");
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

    /// Wait until none of `tickets` is outstanding, or `deadline`.
    fn wait_tickets(&self, tickets: &[u64], deadline: Instant) {
        let mut book = self.book.lock();
        while tickets.iter().any(|t| book.tickets.contains_key(t)) {
            if self.changed.wait_until(&mut book, deadline).timed_out() {
                break;
            }
        }
        for t in tickets {
            book.tickets.remove(t);
        }
    }

    fn set_limit(&self, name: &str, limit: u64, deadline: Duration) -> Reply {
        let (key, conn, old, used, guarantee) = {
            let mut book = self.book.lock();
            let Some(&key) = book.names.get(name) else {
                return error_reply(
                    ErrorKind::Unknown,
                    format!("no model {name:?} is registered"),
                );
            };
            let b = &book.ledger.models[&key];
            let (old, used, guarantee) = (b.limit, b.used, b.guarantee);
            if limit == 0 || limit < guarantee {
                return error_reply(
                    ErrorKind::InvalidArgument,
                    format!("model {name:?}: limit {limit} must be positive and at least its guarantee {guarantee}"),
                );
            }
            if used <= limit {
                book.ledger.set_limit(key, limit);
                tracing::info!(model = %name, old, limit, "limit changed");
                return Reply::Changed(ChangeOutcome {
                    model: name.into(),
                    limit,
                    guarantee,
                    used,
                    reclaimed: 0,
                });
            }
            // Growth stops at the new limit at once; the engine is asked for the rest.
            book.ledger.set_cap(key, limit);
            (key, book.models[&key].conn, old, used, guarantee)
        };
        let ticket = {
            let mut book = self.book.lock();
            let t = book.next_id();
            book.tickets.insert(t, Ticket { conn, model: key });
            book.counters.reclaim_requests += 1;
            t
        };
        self.push_reclaims(&[(ticket, key, conn, used - limit)]);
        let end = Instant::now() + deadline;
        let mut book = self.book.lock();
        loop {
            let now_used = book.ledger.models.get(&key).map_or(0, |b| b.used);
            let gone = !book.models.contains_key(&key);
            if gone || now_used <= limit {
                book.tickets.remove(&ticket);
                if gone {
                    return error_reply(ErrorKind::Unknown, format!("model {name:?} went away"));
                }
                book.ledger.set_limit(key, limit);
                tracing::info!(model = %name, old, limit, reclaimed = used - now_used, "limit lowered");
                return Reply::Changed(ChangeOutcome {
                    model: name.into(),
                    limit,
                    guarantee,
                    used: now_used,
                    reclaimed: used - now_used,
                });
            }
            if self.changed.wait_until(&mut book, end).timed_out() {
                let now_used = book.ledger.models.get(&key).map_or(0, |b| b.used);
                if now_used <= limit {
                    continue;
                }
                book.tickets.remove(&ticket);
                book.ledger.set_cap(key, old);
                return error_reply(
                    ErrorKind::NotReached,
                    format!(
                        "model {name:?}: cannot set limit to {limit} bytes within {} ms: it still uses {now_used} bytes after giving back {}; the limit stays {old}",
                        deadline.as_millis(),
                        used.saturating_sub(now_used)
                    ),
                );
            }
        }
    }

    fn set_guarantee(&self, name: &str, guarantee: u64) -> Reply {
        let mut book = self.book.lock();
        let Some(&key) = book.names.get(name) else {
            return error_reply(
                ErrorKind::Unknown,
                format!("no model {name:?} is registered"),
            );
        };
        let b = &book.ledger.models[&key];
        let (limit, used) = (b.limit, b.used);
        if guarantee > limit {
            return error_reply(
                ErrorKind::InvalidArgument,
                format!("model {name:?}: guarantee {guarantee} is above its limit {limit}"),
            );
        }
        match book.ledger.try_set_guarantee(key, guarantee) {
            Ok(()) => Reply::Changed(ChangeOutcome { model: name.into(), limit, guarantee, used, reclaimed: 0 }),
            Err(max) => error_reply(
                ErrorKind::NotReached,
                format!("model {name:?}: cannot guarantee {guarantee} bytes: at most {max} fit beside the other models' use and guarantees in the global budget of {}", book.ledger.global_limit),
            ),
        }
    }
}
