//! An engine's (or an operator's) connection to the broker.
//!
//! Threads: a reader (replies to their waiting callers, pushes to the reclaim worker), a writer
//! ([`FrameWriter`]), a reclaim worker (gives memory back when the broker asks: trims the
//! model's pool, then asks its reclaim callback) and, for engines, a reporter (the models'
//! pool stats every 250 ms, for the operator's view). None holds the client itself: dropping
//! the last [`BrokerClient`] shuts the socket down and every thread ends.

use std::collections::HashMap;
use std::os::fd::OwnedFd;
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc::{channel, Receiver, RecvTimeoutError, Sender};
use std::sync::{Arc, Weak};
use std::time::Duration;

use parking_lot::Mutex;

use super::protocol::{
    BackendDesc, ErrorKind, FromBroker, Push, Reply, Request, Role, Snapshot, ToBroker,
    PROTOCOL_VERSION,
};
use crate::error::{Error, Result};
use crate::ipc::{self, FrameWriter, Outgoing};
use crate::pool::Inner as PoolInner;
use crate::shared::ReclaimCallback;

/// The id of requests whose reply nobody waits for (reports, reclaim answers, unregister on
/// drop).
pub(crate) const NOTIFY_ID: u64 = u64::MAX;

/// Threads importing the chunks of one batch grant, unless set otherwise.
pub const DEFAULT_IMPORT_THREADS: usize = 4;

/// How long a request waits for its reply (a growth may wait for other engines' reclaims).
const REPLY_TIMEOUT: Duration = Duration::from_secs(120);

type Waiter = Sender<(Reply, Vec<OwnedFd>)>;

/// A request on its way: its id and where its reply arrives.
pub(crate) struct SentRequest {
    id: u64,
    rx: Receiver<(Reply, Vec<OwnedFd>)>,
}

/// Callers waiting for replies, and whether the connection is gone (then nobody may wait).
#[derive(Default)]
struct Pending {
    waiters: HashMap<u64, Waiter>,
    /// Growth requests waiting for their reply: request id -> model (and whether it is a
    /// host-tier model).
    grows: HashMap<u64, (u64, bool)>,
    /// Growth requests whose caller stopped waiting (timed out): if chunks still arrive for
    /// them, they go straight back to the broker instead of staying charged to this engine.
    abandoned: HashMap<u64, (u64, bool)>,
    /// How long a request waits for its reply.
    timeout: Option<Duration>,
    closed: bool,
    /// The broker's last word before it closed the connection (an error about the connection
    /// itself: refused at accept, a malformed frame): what waiters are told.
    last_word: Option<(ErrorKind, String)>,
}

/// What the reclaim worker and the reporter need to reach a model.
pub(crate) struct ModelLink {
    pub(crate) pool: Weak<PoolInner>,
    pub(crate) reclaim: Option<ReclaimCallback>,
    /// A model of the broker's host tier: what is sent about it is wrapped in
    /// [`Request::HostTier`].
    pub(crate) host: bool,
}

/// `request` as sent about a model of the device (`host` false) or of the host tier.
pub(crate) fn for_tier(host: bool, request: Request) -> Request {
    if host {
        Request::HostTier(Box::new(request))
    } else {
        request
    }
}

type Links = Arc<Mutex<HashMap<u64, ModelLink>>>;

/// A connection to a broker. Cheap to clone; `Send + Sync`.
#[derive(Clone, Debug)]
pub struct BrokerClient {
    inner: Arc<ClientInner>,
}

pub(crate) struct ClientInner {
    stream: UnixStream,
    writer: FrameWriter,
    pending: Arc<Mutex<Pending>>,
    next_id: AtomicU64,
    pub(crate) links: Links,
    welcome: Welcome,
    /// The backend chunks are imported and mapped with (see `remote.rs`).
    pub(crate) local: std::sync::OnceLock<Arc<dyn crate::backend::Backend>>,
    /// The backend host-tier chunks are imported and mapped with, and the broker's host tier
    /// (see `remote.rs`).
    pub(crate) host_local: std::sync::OnceLock<(Arc<dyn crate::backend::Backend>, u64)>,
    /// Threads that import the chunks of one batch grant (see `remote.rs`).
    pub(crate) import_threads: AtomicUsize,
    /// Dropped with the client: ends the reporter.
    _stop: Sender<()>,
}

impl std::fmt::Debug for ClientInner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BrokerClient")
            .field("engine", &self.welcome.engine)
            .field("broker_pid", &self.welcome.broker_pid)
            .finish()
    }
}

impl Drop for ClientInner {
    fn drop(&mut self) {
        // What was queued last (a model's unregister, which ends its lease) goes out first.
        if !self.writer.flush(Duration::from_millis(500)) {
            tracing::debug!("the broker connection closed with messages unsent");
        }
        let _ = self.stream.shutdown(std::net::Shutdown::Both);
    }
}

/// What the broker said at hello.
#[derive(Debug, Clone)]
pub struct Welcome {
    /// The broker's process id.
    pub broker_pid: u32,
    /// Its backend: engines map chunks with the same kind.
    pub backend: BackendDesc,
    /// The global budget.
    pub global_limit: u64,
    /// This connection's id.
    pub engine: u64,
}

/// Turn an error reply into the crate's error.
pub(crate) fn reply_error(kind: ErrorKind, message: String) -> Error {
    match kind {
        ErrorKind::Malformed => Error::Ipc {
            op: "broker refused a message",
            detail: message,
        },
        _ => Error::Broker {
            kind: format!("{kind:?}"),
            message,
        },
    }
}

impl BrokerClient {
    /// Connect to the broker at `socket` as an engine called `name`. The process listening
    /// there must run as this process's user or root (`SO_PEERCRED`, checked before anything
    /// is sent): a socket another user listens on is refused, whatever its path.
    pub fn connect(socket: impl AsRef<Path>, name: &str) -> Result<BrokerClient> {
        Self::connect_as(socket, name, Role::Engine, None)
    }

    /// Connect as an engine to the broker of user `broker_uid` (one that lets this user's
    /// group in with `--group`): as [`BrokerClient::connect`], with that user trusted too.
    pub fn connect_trusting(
        socket: impl AsRef<Path>,
        name: &str,
        broker_uid: u32,
    ) -> Result<BrokerClient> {
        Self::connect_as(socket, name, Role::Engine, Some(broker_uid))
    }

    /// Connect for operator's work (`ctl`, `top`): read everything, change limits; no memory.
    /// The broker must run as this process's user or root, as for [`BrokerClient::connect`].
    pub fn connect_control(socket: impl AsRef<Path>, name: &str) -> Result<BrokerClient> {
        Self::connect_as(socket, name, Role::Control, None)
    }

    fn connect_as(
        socket: impl AsRef<Path>,
        name: &str,
        role: Role,
        trusted: Option<u32>,
    ) -> Result<BrokerClient> {
        let path = socket.as_ref();
        let stream = UnixStream::connect(path).map_err(|e| Error::Ipc {
            op: "connect to broker",
            detail: format!("{}: {e}", path.display()),
        })?;
        // Who listens there: a process of another user could hand out chunks it still maps.
        let broker = crate::ipc::peer_credentials(&stream)?;
        let me = rustix::process::geteuid().as_raw();
        if broker.uid != me && broker.uid != 0 && Some(broker.uid) != trusted {
            return Err(Error::Ipc {
                op: "connect to broker",
                detail: format!(
                    "{}: the process listening there (pid {}) runs as uid {}, neither this user (uid {me}) nor root{}: not a broker this process trusts",
                    path.display(),
                    broker.pid,
                    broker.uid,
                    trusted.map_or(String::new(), |t| format!(" nor the trusted uid {t}"))
                ),
            });
        }
        crate::ipc::raise_fd_limit();
        let clone = |s: &UnixStream| {
            s.try_clone().map_err(|e| Error::Ipc {
                op: "clone socket",
                detail: e.to_string(),
            })
        };
        let (writer, _) = FrameWriter::spawn(clone(&stream)?, 1024, "broker-client")?;
        let pending: Arc<Mutex<Pending>> = Arc::default();
        let links: Links = Arc::default();
        let (push_tx, push_rx) = channel::<Push>();
        {
            let stream = clone(&stream)?;
            let pending = pending.clone();
            std::thread::Builder::new()
                .name("broker-client-reader".into())
                .spawn({
                    let writer = writer.clone();
                    move || read_loop(stream, pending, push_tx, writer)
                })
                .map_err(|e| Error::Ipc {
                    op: "spawn reader",
                    detail: e.to_string(),
                })?;
        }
        {
            let writer = writer.clone();
            let links = links.clone();
            std::thread::Builder::new()
                .name("broker-client-reclaim".into())
                .spawn(move || reclaim_worker(push_rx, writer, links))
                .map_err(|e| Error::Ipc {
                    op: "spawn reclaim worker",
                    detail: e.to_string(),
                })?;
        }
        let (stop_tx, stop_rx) = channel::<()>();
        if role == Role::Engine {
            let writer = writer.clone();
            let links = links.clone();
            std::thread::Builder::new()
                .name("broker-client-reporter".into())
                .spawn(move || reporter(stop_rx, writer, links))
                .map_err(|e| Error::Ipc {
                    op: "spawn reporter",
                    detail: e.to_string(),
                })?;
        }
        let mut inner = ClientInner {
            stream,
            writer,
            pending,
            next_id: AtomicU64::new(1),
            import_threads: AtomicUsize::new(DEFAULT_IMPORT_THREADS),
            links,
            welcome: Welcome {
                broker_pid: 0,
                backend: BackendDesc {
                    name: String::new(),
                    device_ordinal: None,
                    granularity: 0,
                    device_name: String::new(),
                    creates_zeroed: false,
                },
                global_limit: 0,
                engine: 0,
            },
            local: std::sync::OnceLock::new(),
            host_local: std::sync::OnceLock::new(),
            _stop: stop_tx,
        };
        let hello = Request::Hello {
            version: PROTOCOL_VERSION,
            role,
            name: name.to_string(),
        };
        match inner.request(hello)? {
            (
                Reply::Welcome {
                    broker_pid,
                    backend,
                    global_limit,
                    engine,
                },
                _,
            ) => {
                inner.welcome = Welcome {
                    broker_pid,
                    backend,
                    global_limit,
                    engine,
                };
            }
            (other, _) => return Err(unexpected("hello", &other)),
        }
        Ok(BrokerClient {
            inner: Arc::new(inner),
        })
    }

    /// How many threads import the chunks of one batch grant (at least 1; default
    /// [`DEFAULT_IMPORT_THREADS`]): a growth by many chunks imports them in parallel while the
    /// broker prepares the next batch.
    pub fn set_import_threads(&self, threads: usize) {
        self.inner
            .import_threads
            .store(threads.max(1), Ordering::Relaxed);
    }

    /// How long requests wait for their reply (default 120 s; a growth may wait for other
    /// engines' reclaims). Chunks granted after a growth stopped waiting go back to the broker.
    pub fn set_reply_timeout(&self, timeout: Duration) {
        self.inner.pending.lock().timeout = Some(timeout);
    }

    /// What the broker said at hello.
    pub fn welcome(&self) -> &Welcome {
        &self.inner.welcome
    }

    /// Send `request` and wait for its reply (and the descriptors attached to it). Error
    /// replies come back as `Ok(Reply::Error {..})`; use the typed helpers to get errors.
    pub fn request(&self, request: Request) -> Result<(Reply, Vec<OwnedFd>)> {
        self.inner.request(request)
    }

    /// Every engine and model (a control connection), or this engine's own.
    pub fn snapshot(&self) -> Result<Snapshot> {
        match self.request(Request::Snapshot)?.0 {
            Reply::Snapshot(s) => Ok(*s),
            other => Err(unexpected("snapshot", &other)),
        }
    }

    pub(crate) fn inner(&self) -> &Arc<ClientInner> {
        &self.inner
    }
}

pub(crate) fn unexpected(what: &str, reply: &Reply) -> Error {
    match reply {
        Reply::Error { kind, message } => reply_error(*kind, message.clone()),
        other => Error::Ipc {
            op: "broker reply",
            detail: format!("unexpected answer to {what}: {other:?}"),
        },
    }
}

impl ClientInner {
    pub(crate) fn request(&self, request: Request) -> Result<(Reply, Vec<OwnedFd>)> {
        let sent = self.send_request(request)?;
        self.wait_reply(sent)
    }

    /// Send a request without waiting: several can be in flight on one connection, and the
    /// broker answers them in order. Wait for each with [`ClientInner::wait_reply`].
    pub(crate) fn send_request(&self, request: Request) -> Result<SentRequest> {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = channel();
        {
            let mut p = self.pending.lock();
            if p.closed {
                return Err(match p.last_word.clone() {
                    Some((kind, message)) => reply_error(kind, message),
                    None => Error::Ipc {
                        op: "broker request",
                        detail: "the connection to the broker is closed".into(),
                    },
                });
            }
            p.waiters.insert(id, tx);
            let (inner, host) = match &request {
                Request::HostTier(inner) => (&**inner, true),
                other => (other, false),
            };
            if let Request::Grow { model, .. } | Request::GrowMany { model, .. } = inner {
                p.grows.insert(id, (*model, host));
            }
        }
        let sent = ipc::encode(&ToBroker { id, request }).and_then(|payload| {
            self.writer.send(Outgoing {
                payload,
                fds: Vec::new(),
            })
        });
        if let Err(e) = sent {
            let mut p = self.pending.lock();
            p.waiters.remove(&id);
            p.grows.remove(&id);
            return Err(e);
        }
        Ok(SentRequest { id, rx })
    }

    /// The reply to a request sent with [`ClientInner::send_request`].
    pub(crate) fn wait_reply(&self, sent: SentRequest) -> Result<(Reply, Vec<OwnedFd>)> {
        let timeout = self.pending.lock().timeout.unwrap_or(REPLY_TIMEOUT);
        match sent.rx.recv_timeout(timeout) {
            Ok(r) => Ok(r),
            Err(RecvTimeoutError::Timeout) => {
                let still_waiting = {
                    let mut p = self.pending.lock();
                    let still = p.waiters.remove(&sent.id).is_some();
                    if still {
                        // Nobody waits now: chunks that still come go back (read loop).
                        if let Some(model) = p.grows.remove(&sent.id) {
                            p.abandoned.insert(sent.id, model);
                        }
                    }
                    still
                };
                if !still_waiting {
                    // The read loop took the waiter between the timeout and the lock: the reply
                    // is on its way (or the connection is gone): it is ours.
                    if let Ok(r) = sent.rx.recv() {
                        return Ok(r);
                    }
                }
                Err(Error::Ipc {
                    op: "broker reply",
                    detail: format!("no reply within {:.1} s", timeout.as_secs_f64()),
                })
            }
            Err(RecvTimeoutError::Disconnected) => {
                Err(match self.pending.lock().last_word.clone() {
                    Some((kind, message)) => reply_error(kind, message),
                    None => Error::Ipc {
                        op: "broker reply",
                        detail: "the broker closed the connection".into(),
                    },
                })
            }
        }
    }

    /// Queue a request whose reply nobody waits for.
    pub(crate) fn notify(&self, request: Request) {
        let id = NOTIFY_ID;
        let sent = ipc::encode(&ToBroker { id, request }).and_then(|payload| {
            self.writer.send(Outgoing {
                payload,
                fds: Vec::new(),
            })
        });
        if let Err(e) = sent {
            tracing::debug!(error = %e, "notification to the broker not sent");
        }
    }

    pub(crate) fn welcome(&self) -> &Welcome {
        &self.welcome
    }
}

fn read_loop(
    stream: UnixStream,
    pending: Arc<Mutex<Pending>>,
    pushes: Sender<Push>,
    writer: FrameWriter,
) {
    loop {
        let frame = match ipc::recv_frame(&stream, ipc::MAX_FRAME) {
            Ok(Some(f)) => f,
            Ok(None) => break,
            Err(e) => {
                tracing::warn!(error = %e, "broker connection failed");
                break;
            }
        };
        match ipc::decode::<FromBroker>(&frame.payload) {
            Ok(FromBroker::Reply { id, reply }) => {
                if id == NOTIFY_ID {
                    if let Reply::Error { kind, message } = reply {
                        tracing::warn!(?kind, %message, "the broker refused a notification");
                    }
                    continue;
                }
                let (waiter, abandoned) = {
                    let mut p = pending.lock();
                    let w = p.waiters.remove(&id);
                    p.grows.remove(&id);
                    (w, p.abandoned.remove(&id))
                };
                match waiter {
                    Some(w) => {
                        let _ = w.send((reply, frame.fds));
                    }
                    None if abandoned.is_some() => {
                        let (model, host) = abandoned.unwrap_or_default();
                        give_back_late(&writer, model, host, reply);
                    }
                    None if id == 0 => {
                        // The broker's last word before closing (an error about this connection).
                        tracing::warn!(?reply, "broker closed the connection");
                        if let Reply::Error { kind, message } = reply {
                            pending.lock().last_word = Some((kind, message));
                        }
                    }
                    None => tracing::debug!(id, "reply nobody waits for (timed out)"),
                }
            }
            Ok(FromBroker::Push(p)) => {
                let _ = pushes.send(p);
            }
            Err(e) => {
                tracing::warn!(error = %e, "malformed message from the broker; closing");
                break;
            }
        }
    }
    let _ = stream.shutdown(std::net::Shutdown::Both);
    // Every waiter learns the connection is gone (their senders drop here), and no new one
    // starts waiting.
    let waiters = {
        let mut p = pending.lock();
        p.closed = true;
        std::mem::take(&mut p.waiters)
    };
    drop(waiters);
}

/// Chunks granted for a growth whose caller stopped waiting go straight back (their
/// descriptors, dropped by the caller, close here): the broker would otherwise keep them
/// charged to this engine until it disconnects.
fn give_back_late(writer: &FrameWriter, model: u64, host: bool, reply: Reply) {
    let chunks = match reply {
        Reply::Granted { chunk, .. } => vec![chunk],
        Reply::GrantedMany { chunks, .. } => chunks,
        _ => return,
    };
    tracing::warn!(
        model,
        chunks = chunks.len(),
        "chunks granted after their growth timed out; given back"
    );
    let back = ToBroker {
        id: NOTIFY_ID,
        request: for_tier(host, Request::GiveBackMany { model, chunks }),
    };
    if let Ok(payload) = ipc::encode(&back) {
        let _ = writer.send(Outgoing {
            payload,
            fds: Vec::new(),
        });
    }
}

fn reclaim_worker(pushes: Receiver<Push>, writer: FrameWriter, links: Links) {
    for push in pushes {
        let Push::Reclaim {
            ticket,
            model,
            bytes,
            ..
        } = push;
        let (pool, callback, host) = {
            let l = links.lock();
            match l.get(&model) {
                Some(link) => (link.pool.upgrade(), link.reclaim.clone(), link.host),
                // Ids of the two tiers never meet: a model unknown here is answered as the
                // broker's host tier numbers its models.
                None => (None, None, model >= super::HOST_IDS),
            }
        };
        // The same give-back as a model of a shared pool asked in its own process.
        let freed = pool.as_ref().map_or(0, |pool| {
            let (got, _) = crate::budget::give_back(pool, callback.as_ref(), bytes);
            got.idle + got.by_callback
        });
        drop(pool);
        tracing::debug!(ticket, model, bytes, freed, "reclaim request served");
        let done = ToBroker {
            id: NOTIFY_ID,
            request: for_tier(host, Request::ReclaimDone { ticket, freed }),
        };
        if let Ok(payload) = ipc::encode(&done) {
            let _ = writer.send(Outgoing {
                payload,
                fds: Vec::new(),
            });
        }
    }
}

fn reporter(stop: Receiver<()>, writer: FrameWriter, links: Links) {
    loop {
        match stop.recv_timeout(Duration::from_millis(250)) {
            Err(RecvTimeoutError::Timeout) => {}
            _ => return,
        }
        let pools: Vec<(u64, Arc<PoolInner>, bool)> = links
            .lock()
            .iter()
            .filter_map(|(&k, l)| Some((k, l.pool.upgrade()?, l.host)))
            .collect();
        for (model, pool, host) in pools {
            // Blocks kept in threads' fronts are idle memory for the broker.
            let s = pool.stats_flushed();
            let report = ToBroker {
                id: NOTIFY_ID,
                request: for_tier(
                    host,
                    Request::Report {
                        model,
                        in_use: s.in_use,
                        idle: s.mapped.saturating_sub(s.in_use),
                        cached: s.cached,
                    },
                ),
            };
            drop(pool);
            if let Ok(payload) = ipc::encode(&report) {
                if writer
                    .send(Outgoing {
                        payload,
                        fds: Vec::new(),
                    })
                    .is_err()
                {
                    return;
                }
            }
        }
    }
}
