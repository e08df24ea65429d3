//! The broker's front door: one thread accepts every connection and reads every hello, with no
//! thread per connection until its hello is accepted.
//!
//! A connection is counted from accept: against the total ([`MAX_CONNECTIONS`], of which
//! [`OPERATOR_RESERVE`] are kept for the broker's own user and root) and, for other users,
//! against its user's cap ([`BrokerConfig::max_connections_per_user`](super::BrokerConfig));
//! over either it gets an error reply and is closed at once. Until it has said hello it is one socket in this
//! thread's `poll` set, its bytes gathered as they come ([`PartialFrame`]), with one deadline
//! for the whole hello ([`BrokerConfig::hello_timeout`](super::BrokerConfig)). A peer of a user
//! the broker does not serve is refused before it is counted. Only a valid hello gets the
//! connection its reader and writer threads.
//!
//! One user cannot keep this thread from the others' hellos: at most [`ACCEPT_BATCH`]
//! connections are accepted per round before the waiting hellos are read, and a user other
//! than the operator refused [`REFUSAL_BURST`] times within [`REFUSAL_WINDOW`] has its new
//! connections closed at accept, unanswered and without the book's lock, for [`REFUSAL_MUTE`].
//! The operator (the broker's own user and root) is never muted.

use std::os::unix::net::{UnixListener, UnixStream};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use rustix::event::{poll, PollFd, PollFlags, Timespec};
use rustix::io::Errno;

use super::book::{check_name, ConnEntry};
use super::protocol::{
    ErrorKind, Reply, Request, Role, ToBroker, MAX_CONNECTIONS, PROTOCOL_VERSION,
};
use super::server::{book_error, error_reply, send, serve, Shared};
use crate::ipc::{self, Frame, FrameWriter, PartialFrame, PeerCredentials};

/// Most bytes of a hello frame (a name of at most [`super::protocol::MAX_NAME`] bytes, a
/// version and a role fit in far less).
const MAX_HELLO: usize = 1024;

/// Of [`MAX_CONNECTIONS`], this many are kept for the broker's own user and root: other users
/// together never hold more than the rest.
pub const OPERATOR_RESERVE: usize = 16;

/// The longest this thread sleeps in `poll` (it then looks whether the broker stops).
const IDLE_POLL: Duration = Duration::from_secs(1);

/// Most connections accepted per `poll` round: the hellos already waiting are read between
/// batches, so a user that reconnects in a loop cannot keep this thread in `accept`.
const ACCEPT_BATCH: usize = 16;

/// A user (other than the operator's) refused this many times within [`REFUSAL_WINDOW`] is
/// muted (far more than a user at its caps meets by mistake: 200 connections at once over a
/// cap of 32 are 168 refusals, each answered with the reason; a reconnect loop makes tens of
/// thousands a second) and
/// stays so for [`REFUSAL_MUTE`]: its new connections are closed at accept, with no reply and no
/// look at the book.
const REFUSAL_BURST: u32 = 512;
/// See [`REFUSAL_BURST`].
const REFUSAL_WINDOW: Duration = Duration::from_secs(1);
/// See [`REFUSAL_BURST`].
const REFUSAL_MUTE: Duration = Duration::from_secs(1);

/// One user's recent refusals (this thread's own state, no lock).
struct Refusals {
    window_start: Instant,
    count: u32,
    muted_until: Option<Instant>,
}

/// The accept thread's refusal bookkeeping: per user, and a count not yet added to the book's
/// counters (added once per round, so a refusal costs no lock of the book).
#[derive(Default)]
struct Door {
    by_uid: std::collections::HashMap<u32, Refusals>,
    refused: u64,
}

impl Door {
    /// Whether `uid`'s connections are closed unanswered for now.
    fn muted(&mut self, uid: u32, now: Instant) -> bool {
        match self.by_uid.get(&uid).and_then(|r| r.muted_until) {
            Some(until) if now < until => true,
            Some(_) => {
                self.by_uid.remove(&uid);
                false
            }
            None => false,
        }
    }

    /// Count a refusal of `uid` (`operator`: never muted).
    fn refused(&mut self, uid: u32, operator: bool, now: Instant) {
        self.refused += 1;
        if operator {
            return;
        }
        let r = self.by_uid.entry(uid).or_insert(Refusals {
            window_start: now,
            count: 0,
            muted_until: None,
        });
        if now.saturating_duration_since(r.window_start) > REFUSAL_WINDOW {
            r.window_start = now;
            r.count = 0;
        }
        r.count += 1;
        if r.count >= REFUSAL_BURST && r.muted_until.is_none() {
            r.muted_until = Some(now + REFUSAL_MUTE);
            tracing::warn!(
                uid,
                refusals = r.count,
                mute_ms = REFUSAL_MUTE.as_millis() as u64,
                "a user keeps connecting over its caps; its new connections are closed unanswered for a while"
            );
        }
    }

    /// Forget users whose window and mute are over (keeps the map small).
    fn tidy(&mut self, now: Instant) {
        self.by_uid.retain(|_, r| match r.muted_until {
            Some(until) => now < until,
            None => now.saturating_duration_since(r.window_start) <= REFUSAL_WINDOW,
        });
    }
}

/// A connection still to say hello.
struct Waiting {
    stream: UnixStream,
    peer: PeerCredentials,
    conn: u64,
    deadline: Instant,
    hello: PartialFrame,
}

pub(super) fn accept_loop(shared: Arc<Shared>, listener: UnixListener) {
    if let Err(e) = listener.set_nonblocking(true) {
        tracing::error!(error = %e, "cannot make the broker's socket non-blocking; no connection is served");
        return;
    }
    let mut waiting: Vec<Waiting> = Vec::new();
    let mut door = Door::default();
    while !shared.stopping.load(Ordering::SeqCst) {
        let now = Instant::now();
        let wait = waiting
            .iter()
            .map(|w| w.deadline.saturating_duration_since(now))
            .min()
            .unwrap_or(IDLE_POLL)
            .min(IDLE_POLL);
        let timeout = Timespec {
            tv_sec: wait.as_secs() as i64,
            tv_nsec: i64::from(wait.subsec_nanos()),
        };
        let (listener_ready, ready) = {
            let mut fds = Vec::with_capacity(waiting.len() + 1);
            fds.push(PollFd::new(&listener, PollFlags::IN));
            fds.extend(
                waiting
                    .iter()
                    .map(|w| PollFd::new(&w.stream, PollFlags::IN)),
            );
            match poll(&mut fds, Some(&timeout)) {
                Ok(_) => {}
                Err(Errno::INTR) => continue,
                Err(e) => {
                    tracing::warn!(error = %e, "poll failed");
                    std::thread::sleep(Duration::from_millis(10));
                    continue;
                }
            }
            let ready: Vec<bool> = fds[1..].iter().map(|f| !f.revents().is_empty()).collect();
            (!fds[0].revents().is_empty(), ready)
        };
        let now = Instant::now();
        let mut still = Vec::with_capacity(waiting.len());
        for (mut w, readable) in waiting.into_iter().zip(ready) {
            if readable {
                match w.hello.read_available(&w.stream, MAX_HELLO) {
                    Ok(Some(frame)) => {
                        // A refused hello counts against its user, as every other refusal.
                        let uid = w.peer.uid;
                        if !welcome(&shared, w, frame) {
                            door.refused(uid, is_operator(&shared, uid), now);
                        }
                        continue;
                    }
                    Ok(None) => {}
                    // A probe, or a peer that died at once: nothing to answer.
                    Err(e) if ipc::is_disconnect(&e) => continue,
                    Err(e) => {
                        refuse(&w.stream, error_reply(ErrorKind::Malformed, e.to_string()));
                        door.refused(w.peer.uid, is_operator(&shared, w.peer.uid), now);
                        continue;
                    }
                }
            }
            if now >= w.deadline {
                let ms = shared.config.hello_timeout.as_millis();
                tracing::debug!(
                    conn = w.conn,
                    pid = w.peer.pid,
                    uid = w.peer.uid,
                    "no hello in time; closed"
                );
                refuse(
                    &w.stream,
                    error_reply(
                        ErrorKind::Malformed,
                        format!("no hello within {ms} ms of connecting"),
                    ),
                );
                door.refused(w.peer.uid, is_operator(&shared, w.peer.uid), now);
                continue;
            }
            still.push(w);
        }
        waiting = still;
        if listener_ready {
            accept_ready(&shared, &listener, &mut waiting, &mut door);
        }
        if door.refused > 0 {
            shared.book.lock().counters.refused_connections += door.refused;
            door.refused = 0;
        }
        door.tidy(Instant::now());
    }
    // Stopping: connections still to say hello close as `waiting` drops.
}

/// Whether `uid` is the operator's: the broker's own user or root.
fn is_operator(shared: &Shared, uid: u32) -> bool {
    uid == shared.uid || uid == 0
}

/// Accept up to [`ACCEPT_BATCH`] connections waiting at the socket; count each, or refuse it at
/// once (a muted user's without a reply).
fn accept_ready(
    shared: &Shared,
    listener: &UnixListener,
    waiting: &mut Vec<Waiting>,
    door: &mut Door,
) {
    for _ in 0..ACCEPT_BATCH {
        let stream = match listener.accept() {
            Ok((s, _)) => s,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return,
            Err(e) => {
                // Out of descriptors, most likely: let connections end before trying again.
                tracing::warn!(error = %e, "accept failed");
                std::thread::sleep(Duration::from_millis(10));
                return;
            }
        };
        if shared.stopping.load(Ordering::SeqCst) {
            return;
        }
        let peer = match ipc::peer_credentials(&stream) {
            Ok(p) => p,
            Err(e) => {
                tracing::warn!(error = %e, "no peer credentials; connection closed");
                continue;
            }
        };
        let now = Instant::now();
        let operator = is_operator(shared, peer.uid);
        if !operator && door.muted(peer.uid, now) {
            door.refused += 1;
            continue;
        }
        if let Err(e) = stream.set_nonblocking(true) {
            tracing::warn!(error = %e, "cannot make a connection non-blocking; closed");
            continue;
        }
        let conn = match admit(shared, peer, waiting) {
            Ok(conn) => conn,
            Err(reply) => {
                refuse(&stream, reply);
                door.refused(peer.uid, operator, now);
                continue;
            }
        };
        waiting.push(Waiting {
            stream,
            peer,
            conn,
            deadline: Instant::now() + shared.config.hello_timeout,
            hello: PartialFrame::default(),
        });
    }
}

/// Whether a new connection of `peer` may wait for its hello: a user the broker serves, within
/// the total and its user's cap (both counted with the connections still to say hello). Its id.
fn admit(shared: &Shared, peer: PeerCredentials, waiting: &[Waiting]) -> Result<u64, Reply> {
    let operator = |uid: u32| is_operator(shared, uid);
    let in_group = shared.config.group.is_some_and(|g| g == peer.gid);
    if !operator(peer.uid) && !in_group {
        return Err(error_reply(
            ErrorKind::Forbidden,
            format!(
                "user {} (group {}) is not allowed on this broker",
                peer.uid, peer.gid
            ),
        ));
    }
    let mut book = shared.book.lock();
    let uids = book
        .conns
        .values()
        .map(|c| c.peer.uid)
        .chain(waiting.iter().map(|w| w.peer.uid));
    let (mut all, mut mine, mut foreign) = (0usize, 0usize, 0usize);
    for uid in uids {
        all += 1;
        mine += usize::from(uid == peer.uid);
        foreign += usize::from(!operator(uid));
    }
    if all >= MAX_CONNECTIONS {
        return Err(error_reply(
            ErrorKind::Forbidden,
            format!("{all} connections open or saying hello, {MAX_CONNECTIONS} allowed"),
        ));
    }
    if !operator(peer.uid) && foreign >= MAX_CONNECTIONS - OPERATOR_RESERVE {
        return Err(error_reply(
            ErrorKind::Forbidden,
            format!(
                "{foreign} connections of other users than the broker's open or saying hello, {} allowed ({OPERATOR_RESERVE} of {MAX_CONNECTIONS} are kept for the operator)",
                MAX_CONNECTIONS - OPERATOR_RESERVE
            ),
        ));
    }
    let per_user = shared.config.max_connections_per_user;
    if !operator(peer.uid) && mine >= per_user {
        return Err(error_reply(
            ErrorKind::Forbidden,
            format!(
                "user {} has {mine} connections open or saying hello, {per_user} allowed per user",
                peer.uid
            ),
        ));
    }
    Ok(book.next_id())
}

/// Answer `reply` (best effort: the socket is non-blocking and the reply small) and close; the
/// caller counts the refusal.
fn refuse(stream: &UnixStream, reply: Reply) {
    if let Ok(payload) = ipc::encode(&crate::broker::protocol::FromBroker::Reply { id: 0, reply }) {
        let _ = ipc::send_frame(stream, &payload, &[]);
    }
}

/// What a valid hello says: the request id, the role and the name.
fn check_hello(
    shared: &Shared,
    peer: PeerCredentials,
    frame: &Frame,
) -> Result<(u64, Role, String), Reply> {
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
    check_name("engine name", &name).map_err(book_error)?;
    if role == Role::Control && peer.uid != shared.uid && peer.uid != 0 {
        return Err(error_reply(
            ErrorKind::Forbidden,
            format!(
                "control connections are for user {} (or root), not {}",
                shared.uid, peer.uid
            ),
        ));
    }
    Ok((msg.id, role, name))
}

/// A complete hello: check it, then give the connection its threads and welcome it. False when
/// it was refused.
fn welcome(shared: &Arc<Shared>, w: Waiting, frame: Frame) -> bool {
    let Waiting {
        stream, peer, conn, ..
    } = w;
    let (id, role, name) = match check_hello(shared, peer, &frame) {
        Ok(h) => h,
        Err(reply) => {
            refuse(&stream, reply);
            return false;
        }
    };
    let ready = stream
        .set_nonblocking(false)
        .and_then(|()| stream.set_write_timeout(Some(shared.config.io_timeout)))
        .and_then(|()| Ok((stream.try_clone()?, stream.try_clone()?)))
        .and_then(|(w, b)| {
            // The host tier's book knows the connection too (owners, pushes, its end).
            let for_host = match shared.host {
                Some(_) => Some(stream.try_clone()?),
                None => None,
            };
            Ok((w, b, for_host))
        });
    let Ok((for_writer, for_book, for_host)) = ready else {
        refuse(
            &stream,
            error_reply(ErrorKind::Backend, "cannot set the socket up"),
        );
        return false;
    };
    let Ok((writer, writer_thread)) =
        FrameWriter::spawn(for_writer, 1024, &format!("broker-conn-{conn}"))
    else {
        refuse(
            &stream,
            error_reply(ErrorKind::Backend, "cannot start the connection's writer"),
        );
        return false;
    };
    let pidfd = ipc::peer_pidfd(&stream, peer.pid).map(Arc::new);
    if let (Some(h), Some(for_host)) = (&shared.host, for_host) {
        h.book.lock().conns.insert(
            conn,
            ConnEntry {
                name: name.clone(),
                role,
                peer,
                writer: writer.clone(),
                stream: for_host,
                pidfd: pidfd.clone(),
            },
        );
    }
    shared.book.lock().conns.insert(
        conn,
        ConnEntry {
            name: name.clone(),
            role,
            peer,
            writer: writer.clone(),
            stream: for_book,
            pidfd,
        },
    );
    tracing::info!(conn, name = %name, ?role, pid = peer.pid, uid = peer.uid, gid = peer.gid, "connected");
    let welcome = Reply::Welcome {
        broker_pid: shared.pid,
        backend: shared.desc.clone(),
        global_limit: shared.config.global_limit,
        engine: conn,
    };
    if let Err(e) = send(&writer, id, welcome, Vec::new()) {
        tracing::debug!(conn, error = %e, "welcome not sent");
    }
    let s = shared.clone();
    let spawned = std::thread::Builder::new()
        .name(format!("broker-conn-{conn}"))
        .spawn(move || serve(s, stream, conn, peer, role, writer, writer_thread));
    if let Err(e) = spawned {
        // Its stream, writer and writer thread went with the closure; the book forgets it.
        tracing::warn!(conn, error = %e, "cannot spawn a connection thread; closed");
        if let Some(h) = &shared.host {
            h.book.lock().conns.remove(&conn);
        }
        let stream = shared.book.lock().conns.remove(&conn).map(|c| c.stream);
        if let Some(s) = stream {
            let _ = s.shutdown(std::net::Shutdown::Both);
        }
    }
    true
}
