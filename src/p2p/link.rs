//! A link between two engines over a Unix stream socket: the hello, a reader thread that takes
//! the peer's messages, a writer thread ([`crate::ipc::FrameWriter`]) for ours, and the
//! bookkeeping of grants both ways.
//!
//! Lock order: a link's `state` mutex is a leaf. It guards bookkeeping only: no driver call, no
//! socket write, no drop of a pin, a mapping or a descriptor happens under it (they are taken
//! out under the lock and dropped after it is released).

use std::collections::{HashMap, HashSet, VecDeque};
use std::fmt;
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex, MutexGuard};

use super::cache::{self, KeptIn, KeptOut};
use super::path::{choose_path, Endpoint, PathChoice, TransferPath};
use super::wire::{
    GrantMode, Hello, Msg, WireChunk, WireLayout, MAX_GRANT_BLOCKS, MAX_GRANT_CHUNKS,
    MAX_KEPT_IMPORTS, MAX_PARTIAL_GRANTS, MAX_QUEUED_BLOCKS, MAX_QUEUED_CHUNKS, MAX_QUEUED_GRANTS,
    VERSION,
};
use crate::backend::{AccessMode, Backend, DeviceReach, PhysicalChunk};
use crate::backing::BlockPin;
use crate::error::{Error, Result};
use crate::ipc::{self, FrameWriter, Outgoing, PeerCredentials};
use crate::pool::RangePin;

/// How long the hello may take.
const HELLO_TIMEOUT: Duration = Duration::from_secs(10);
/// How long dropping a link waits for its queued frames to go out.
const FLUSH_TIMEOUT: Duration = Duration::from_secs(5);
/// How long a link that both sides said bye on waits for the peer's last answers.
const BYE_TIMEOUT: Duration = Duration::from_secs(1);
/// Frames the writer queue holds (a grant of [`MAX_GRANT_CHUNKS`] chunks and
/// [`MAX_GRANT_BLOCKS`] blocks takes 1040: 1024 of chunks, 15 of blocks, the grant).
const WRITER_DEPTH: usize = 4096;

/// What a link knows of the engine at the other end.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PeerInfo {
    /// The name it gave in its hello.
    pub name: String,
    /// Its process, user and group as the kernel recorded them (`SO_PEERCRED`).
    pub credentials: PeerCredentials,
    /// Its node, memory and whether it can import chunks.
    pub endpoint: Endpoint,
    /// Its backend's mapping unit.
    pub granularity: u64,
    /// How our device reaches its GPU: the same one, another with peer access (imports are
    /// mapped with access for both), or neither (its grants come over NIXL:
    /// [`PeerLink::path_in`]).
    pub reach: DeviceReach,
    /// How its device reaches our GPU, as it said.
    pub reaches_us: DeviceReach,
}

/// Where a grant stands, as its sender sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum GrantStatus {
    /// The receiver may hold the chunks: the blocks stay pinned.
    Held,
    /// A revoke was sent; the blocks stay pinned until the receiver has let go.
    Revoking,
    /// The receiver unmapped everything and closed its descriptors: pins dropped.
    Released,
    /// The receiver could not (or would not: too many grants waiting there) import the grant
    /// and maps nothing of it, keeping only chunks sent to be kept: pins dropped.
    Refused(String),
    /// The receiver's process exited: whatever it mapped is gone with it; pins dropped.
    PeerExited,
    /// A hand-off: the receiver took the chunks over; the blocks were released here and their
    /// chunks let go (never reused here).
    HandedOff,
    /// A hand-off the receiver took over, but releasing the blocks here failed (logged): they
    /// stay pinned for good, so their chunks are never reused here.
    HandOffStuck(String),
}

impl GrantStatus {
    /// Whether the blocks are free again (the receiver can no longer touch them).
    pub fn is_final(&self) -> bool {
        !matches!(self, GrantStatus::Held | GrantStatus::Revoking)
    }
}

/// A snapshot of a link's books.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LinkStats {
    /// Grants sent whose receiver may still hold chunks (blocks pinned here).
    pub grants_out: usize,
    /// Bytes of chunks exported in those grants: memory of ours the peer can still map.
    pub granted_bytes: u64,
    /// Grants received and mapped here now.
    pub imports: usize,
    /// Bytes of the peer's chunks mapped here now.
    pub imported_bytes: u64,
    /// Chunks of the peer's mapped here now.
    pub imported_chunks: usize,
    /// Grants received, not taken yet ([`PeerLink::recv_grant`]).
    pub queued_grants: usize,
    /// Copies finished ([`crate::p2p::Completion::wait`]).
    pub transfers: u64,
    /// Bytes those copies moved.
    pub bytes_copied: u64,
    /// Chunks of ours the peer keeps imported between grants (its import cache): their memory
    /// stays alive while it does, so a pool that releases one holds it back
    /// ([`crate::PoolStats::peer_held`]) until the peer forgot it.
    pub peer_kept_chunks: usize,
    /// Bytes of those chunks.
    pub peer_kept_bytes: u64,
    /// Chunks of the peer's kept imported here between grants (mapped or not).
    pub kept_imports: usize,
    /// Bytes of those chunks.
    pub kept_import_bytes: u64,
    /// Chunks of grants received that were found imported here already (no descriptor sent,
    /// no import).
    pub kept_hits: u64,
}

/// A chunk received: where it lies in the sender's layout range, its size, how it came, its
/// descriptor if one came.
#[derive(Debug)]
pub(crate) struct InChunk {
    pub(crate) offset: u64,
    pub(crate) size: u64,
    pub(crate) how: WireChunk,
    pub(crate) fd: Option<OwnedFd>,
}

/// A grant received whole, not imported yet.
#[derive(Debug)]
pub(crate) struct ReadyGrant {
    pub(crate) id: u64,
    pub(crate) mode: super::wire::GrantMode,
    pub(crate) access: AccessMode,
    pub(crate) layout: WireLayout,
    pub(crate) blocks: Vec<u64>,
    pub(crate) chunks: Vec<InChunk>,
}

/// What a grant holds on the sender's memory.
pub(crate) enum GrantPin {
    /// Blocks of a layout.
    Blocks(BlockPin),
    /// A mapped range of a pool.
    Range(RangePin),
}

/// A grant sent: the pins on its blocks until the receiver lets go.
pub(crate) struct OutGrant {
    pub(crate) pin: Option<GrantPin>,
    pub(crate) bytes: u64,
    /// Granted for copying or handed off: only a hand-off may be adopted.
    pub(crate) mode: GrantMode,
    pub(crate) status: GrantStatus,
    /// The [`crate::p2p::Grant`] handle is gone: forget the entry once final.
    pub(crate) detached: bool,
}

#[derive(Default)]
pub(crate) struct LinkState {
    /// Set when the connection ended: why.
    pub(crate) closed: Option<String>,
    pub(crate) next_grant: u64,
    pub(crate) out: HashMap<u64, OutGrant>,
    partial: HashMap<u64, Vec<InChunk>>,
    /// Block indices of partial grants that came in [`Msg::Blocks`] frames (after their
    /// chunks, so at most [`MAX_PARTIAL_GRANTS`] lists).
    partial_blocks: HashMap<u64, Vec<u64>>,
    ready: VecDeque<ReadyGrant>,
    /// Grants received and mapped here: id to (bytes, chunks).
    pub(crate) live_in: HashMap<u64, (u64, usize)>,
    /// Grants the peer asked back (no new copy from them).
    pub(crate) revoked_in: HashSet<u64>,
    pub(crate) transfers: u64,
    pub(crate) bytes_copied: u64,
    /// Sender: the last key given to a kept chunk (keys are never reused on a link).
    pub(crate) last_key: u64,
    /// Sender: chunks of ours the peer keeps imported, by key.
    pub(crate) kept_out: HashMap<u64, KeptOut>,
    /// Receiver: chunks of the peer's kept imported here, by key.
    pub(crate) kept_in: HashMap<u64, KeptIn>,
    pub(crate) kept_hits: u64,
    /// We said [`Msg::Bye`].
    bye_sent: bool,
    /// The peer said [`Msg::Bye`].
    bye_received: bool,
}

impl LinkState {
    /// Whether `Forget`s we sent are still unanswered.
    fn forgets_pending(&self) -> bool {
        self.kept_out.values().any(|e| e.forgetting)
    }
}

/// What a link's handle, its reader thread, its grants and its imports share.
pub(crate) struct LinkShared {
    pub(crate) name: String,
    pub(crate) peer: PeerInfo,
    pub(crate) backend: Arc<dyn Backend>,
    /// How our grants reach the peer.
    pub(crate) path: PathChoice,
    /// How the peer's grants reach us.
    pub(crate) path_in: PathChoice,
    pub(crate) state: Mutex<LinkState>,
    pub(crate) changed: Condvar,
    /// Our messages to the peer.
    pub(crate) writer: FrameWriter,
    /// Held while a grant decides which chunks go as keys and queues its messages, so a key
    /// goes out after the descriptor that made it (lock order: before the registry's and
    /// the state's; no driver call under it).
    pub(crate) send_lock: Mutex<()>,
    /// A handle on the connection, to shut it down.
    socket: UnixStream,
}

impl LinkShared {
    /// End the connection (the reader then settles the books).
    pub(crate) fn shutdown(&self) {
        let _ = self.socket.shutdown(std::net::Shutdown::Both);
    }

    pub(crate) fn peer_error(&self, op: &'static str, detail: impl Into<String>) -> Error {
        Error::Peer {
            peer: self.peer.name.clone(),
            op,
            detail: detail.into(),
        }
    }

    /// Wait on the condition variable until `ready` holds or `deadline` passes (`None`: no
    /// deadline); returns the lock and whether `ready` holds.
    pub(crate) fn wait_until(
        &self,
        deadline: Option<Instant>,
        mut ready: impl FnMut(&LinkState) -> bool,
    ) -> (MutexGuard<'_, LinkState>, bool) {
        let mut st = self.state.lock();
        loop {
            if ready(&st) {
                return (st, true);
            }
            match deadline {
                Some(d) => {
                    if self.changed.wait_until(&mut st, d).timed_out() {
                        let ok = ready(&st);
                        return (st, ok);
                    }
                }
                None => self.changed.wait(&mut st),
            }
        }
    }

    /// Sender: ask the peer to forget kept chunks `keys` (a pool released them and holds them
    /// back until it has).
    pub(crate) fn forget_out(&self, keys: Vec<u64>) {
        {
            let mut st = self.state.lock();
            for k in &keys {
                if let Some(e) = st.kept_out.get_mut(k) {
                    e.forgetting = true;
                }
            }
        }
        tracing::debug!(peer = %self.peer.name, chunks = keys.len(), "asking the peer to forget kept imports");
        if let Err(e) = send(&self.writer, Msg::Forget { keys }, Vec::new()) {
            // The link is ending, or the peer does not read: end it, so the chunks are
            // released once the peer's process exited (never held back for good behind an
            // open link that lost the request).
            tracing::debug!(peer = %self.peer.name, error = %e, "forget not sent; closing the link");
            self.shutdown();
        }
    }

    /// Sender: the peer holds no import of kept chunks `keys` any more; release those a pool
    /// held back for it alone. A key it was never given (or forgot already) is an error.
    fn forgot_out(self: &Arc<Self>, keys: Vec<u64>) -> std::result::Result<(), String> {
        let mut gone = Vec::with_capacity(keys.len());
        let mut unknown = None;
        {
            let mut st = self.state.lock();
            for k in keys {
                match st.kept_out.remove(&k) {
                    Some(e) => gone.push((k, e)),
                    None => unknown = Some(k),
                }
            }
        }
        self.settle_forgotten(gone);
        match unknown {
            Some(k) => Err(format!(
                "the peer forgot chunk key {k}, which it does not keep"
            )),
            None => Ok(()),
        }
    }

    /// Take kept chunks off the registry; release those held back for this peer alone.
    fn settle_forgotten(self: &Arc<Self>, gone: Vec<(u64, KeptOut)>) {
        for (key, e) in gone {
            if let Some(pool) = cache::forgotten(e.backend, e.raw, self, key) {
                if let Some(pool) = pool.upgrade() {
                    pool.release_held_back(e.raw);
                }
            }
        }
        self.changed.notify_all();
    }

    /// Receiver: use kept chunk `key` of `size` bytes for a mapping.
    pub(crate) fn use_kept(&self, key: u64, size: u64) -> Result<PhysicalChunk> {
        let mut st = self.state.lock();
        match st.kept_in.get_mut(&key) {
            Some(e) if !e.forgotten && e.chunk.size as u64 == size => {
                e.users += 1;
                let c = e.chunk;
                st.kept_hits += 1;
                Ok(c)
            }
            Some(e) => Err(self.peer_error(
                "import",
                format!(
                    "kept chunk {key} is {} bytes{}, the grant says {size}",
                    e.chunk.size,
                    if e.forgotten {
                        " and being forgotten"
                    } else {
                        ""
                    }
                ),
            )),
            None => Err(self.peer_error(
                "import",
                format!("the grant names kept chunk {key}, which is not kept here (forgotten, or never kept: at most {MAX_KEPT_IMPORTS} are)"),
            )),
        }
    }

    /// Receiver: keep `chunk`, just imported, under `key`, used by one mapping; `false` (not
    /// kept) where [`MAX_KEPT_IMPORTS`] are kept already. A key kept already is refused (the
    /// chunk is not kept then; the caller releases it).
    pub(crate) fn keep(&self, key: u64, chunk: PhysicalChunk) -> Result<bool> {
        let mut st = self.state.lock();
        if st.kept_in.contains_key(&key) {
            return Err(self.peer_error(
                "import",
                format!("the grant sends chunk key {key} again, which is kept here already"),
            ));
        }
        if st.kept_in.len() >= MAX_KEPT_IMPORTS {
            return Ok(false);
        }
        st.kept_in.insert(
            key,
            KeptIn {
                chunk,
                users: 1,
                forgotten: false,
            },
        );
        Ok(true)
    }

    /// Receiver: a mapping stopped using kept chunks `keys`; those the sender asked us to
    /// forget (or all, once the link closed) and now unused are released, and the sender told.
    pub(crate) fn unuse_kept(&self, keys: &[u64]) {
        let (release, closed) = {
            let mut st = self.state.lock();
            let closed = st.closed.is_some();
            let mut release = Vec::new();
            for k in keys {
                let Some(e) = st.kept_in.get_mut(k) else {
                    continue;
                };
                e.users = e.users.saturating_sub(1);
                if e.users == 0 && (e.forgotten || closed) {
                    release.extend(st.kept_in.remove(k).map(|e| (*k, e.chunk)));
                }
            }
            (release, closed)
        };
        self.release_kept(release, !closed);
    }

    /// Receiver: release imports of kept chunks (no lock held) and, if `tell`, tell the sender.
    fn release_kept(&self, chunks: Vec<(u64, PhysicalChunk)>, tell: bool) {
        if chunks.is_empty() {
            return;
        }
        let mut keys = Vec::with_capacity(chunks.len());
        let mut failed = Vec::new();
        for (k, c) in chunks {
            // SAFETY: imported by this link, mapped nowhere (no mapping uses it), released once
            // (taken out of the books above).
            match unsafe { self.backend.release(c) } {
                Ok(()) => keys.push(k),
                Err(e) => {
                    tracing::error!(peer = %self.peer.name, key = k, error = %e, "releasing a kept import failed; it stays imported and in the books");
                    failed.push((k, c));
                }
            }
        }
        if !failed.is_empty() {
            // Still imported: the books keep it, the sender keeps it held back.
            let mut st = self.state.lock();
            for (k, chunk) in failed {
                st.kept_in.insert(
                    k,
                    KeptIn {
                        chunk,
                        users: 0,
                        forgotten: true,
                    },
                );
            }
        }
        self.changed.notify_all();
        if tell && !keys.is_empty() {
            if let Err(e) = send(&self.writer, Msg::Forgot { keys }, Vec::new()) {
                // The sender would hold the chunks back for as long as the link stays open.
                tracing::debug!(peer = %self.peer.name, error = %e, "forgot not sent; closing the link");
                self.shutdown();
            }
        }
    }

    /// Receiver: chunks of a grant that was not imported (revoked while queued, or refused):
    /// those sent to be kept are imported and kept all the same, unused, as the sender counts
    /// on (it may name them in its next grant already); one that cannot be imported is
    /// reported forgotten. Driver calls: no lock held.
    pub(crate) fn keep_unimported(&self, chunks: Vec<InChunk>) {
        for c in chunks {
            let (WireChunk::Keep(k), Some(fd)) = (c.how, c.fd) else {
                continue;
            };
            match self.import_to_keep(k, fd, c.size) {
                Ok((_, Some(k))) => self.unuse_kept(&[k]),
                // Not kept (too many are): imported for nothing, so let go at once.
                Ok((chunk, None)) => {
                    // SAFETY: imported just now, mapped nowhere, not kept, released once.
                    if let Err(e) = unsafe { self.backend.release(chunk) } {
                        tracing::error!(error = %e, "releasing an imported chunk failed");
                    }
                }
                // Told already when the import failed; a repeated key keeps the first.
                Err(e) => {
                    tracing::warn!(peer = %self.peer.name, key = k, error = %e, "a chunk to keep was not kept");
                }
            }
        }
    }

    /// Receiver: import the chunk of `fd` (`size` bytes) and keep it under `key`, used by one
    /// mapping. An import that fails is reported forgotten to the sender; a key kept already
    /// is refused (the new import is released). Driver calls: no lock held.
    pub(crate) fn import_to_keep(
        &self,
        key: u64,
        fd: OwnedFd,
        size: u64,
    ) -> Result<(PhysicalChunk, Option<u64>)> {
        let chunk = usize::try_from(size)
            .map_err(|_| Error::SizeOverflow {
                what: "kept chunk",
                detail: format!("{size} bytes"),
            })
            .and_then(|size| self.backend.import_chunk(fd, size));
        let chunk = match chunk {
            Ok(c) => c,
            Err(e) => {
                // Never kept: the sender hears so.
                self.send_forgot(vec![key]);
                return Err(e);
            }
        };
        match self.keep(key, chunk) {
            Ok(true) => Ok((chunk, Some(key))),
            Ok(false) => {
                // Imported for this use alone; the sender stops naming it as kept.
                tracing::debug!(peer = %self.peer.name, key, "kept imports full; chunk not kept");
                self.send_forgot(vec![key]);
                Ok((chunk, None))
            }
            Err(e) => {
                // SAFETY: imported just now, mapped nowhere, not kept, released once.
                if let Err(r) = unsafe { self.backend.release(chunk) } {
                    tracing::error!(error = %r, "releasing an imported chunk failed");
                }
                Err(e)
            }
        }
    }

    fn send_forgot(&self, keys: Vec<u64>) {
        if keys.is_empty() {
            return;
        }
        if let Err(e) = send(&self.writer, Msg::Forgot { keys }, Vec::new()) {
            tracing::debug!(peer = %self.peer.name, error = %e, "forgot not sent; closing the link");
            self.shutdown();
        }
    }

    /// End the link from our side, once: let go of kept imports nothing maps, ask the peer to
    /// forget what it keeps of ours, and say [`Msg::Bye`] after them (no grant follows: the
    /// send lock orders it after any grant being queued).
    fn say_bye(&self) {
        let forget: Vec<u64> = {
            let _sending = self.send_lock.lock();
            let mut st = self.state.lock();
            if std::mem::replace(&mut st.bye_sent, true) {
                return;
            }
            st.kept_out
                .iter()
                .filter(|(_, e)| !e.forgetting)
                .map(|(&k, _)| k)
                .collect()
        };
        self.release_unused_kept(true);
        if !forget.is_empty() {
            self.forget_out(forget);
        }
        if let Err(e) = send(&self.writer, Msg::Bye, Vec::new()) {
            tracing::debug!(peer = %self.peer.name, error = %e, "bye not sent");
        }
    }

    /// Receiver: let go of every kept chunk no mapping uses (the link is ending).
    fn release_unused_kept(&self, tell: bool) {
        let release: Vec<(u64, PhysicalChunk)> = {
            let mut st = self.state.lock();
            let unused: Vec<u64> = st
                .kept_in
                .iter()
                .filter(|(_, e)| e.users == 0)
                .map(|(&k, _)| k)
                .collect();
            unused
                .into_iter()
                .filter_map(|k| st.kept_in.remove(&k).map(|e| (k, e.chunk)))
                .collect()
        };
        self.release_kept(release, tell);
    }

    /// The receiver took hand-off `id` over: release its blocks here with the pin dropped in
    /// the same step, their chunks released at once (the receiver owns the memory now).
    fn finish_hand_off(&self, id: u64) {
        let pin = {
            let mut st = self.state.lock();
            st.out.get_mut(&id).and_then(|g| g.pin.take())
        };
        let Some(pin) = pin else {
            tracing::warn!(peer = %self.peer.name, grant = id, "adoption of an unknown grant ignored");
            return;
        };
        // Driver calls, with no lock held.
        let pin = match pin {
            GrantPin::Blocks(p) => p,
            GrantPin::Range(p) => {
                // Only blocks are handed off: a peer saying otherwise gets the range back.
                tracing::warn!(peer = %self.peer.name, grant = id, "adoption of a range grant ignored");
                let mut st = self.state.lock();
                if let Some(g) = st.out.get_mut(&id) {
                    g.status = GrantStatus::Released;
                }
                drop(st);
                drop(p);
                self.changed.notify_all();
                return;
            }
        };
        let (status, keep) = match pin.release_as(crate::pool::ChunkFate::Release) {
            Ok(change) => {
                tracing::debug!(peer = %self.peer.name, grant = id, blocks = change.blocks, bytes = change.bytes, "blocks handed off");
                (GrantStatus::HandedOff, None)
            }
            Err(refused) => {
                let (e, pin) = *refused;
                tracing::error!(peer = %self.peer.name, grant = id, error = %e, "releasing handed-off blocks failed; they stay pinned");
                (
                    GrantStatus::HandOffStuck(e.to_string()),
                    Some(GrantPin::Blocks(pin)),
                )
            }
        };
        let mut st = self.state.lock();
        if let Some(g) = st.out.get_mut(&id) {
            g.status = status;
            g.pin = keep;
            if g.detached && g.pin.is_none() {
                st.out.remove(&id);
            }
        }
        drop(st);
        self.changed.notify_all();
    }

    /// Whether the peer may answer grant `id` so (`adopted`: it took the chunks over). A
    /// conforming peer answers each grant once, and adopts hand-offs only: any other answer
    /// would release blocks it may still map (or that were granted for copying), so it is a
    /// protocol violation and the link closes with the pins kept. An unknown id (forgotten
    /// once final and its handle gone) is passed on and ignored there.
    fn check_answer(&self, id: u64, adopted: bool) -> std::result::Result<(), String> {
        let st = self.state.lock();
        let Some(g) = st.out.get(&id) else {
            return Ok(());
        };
        if g.status.is_final() {
            return Err(format!(
                "the peer answered grant {id} again (it is {:?} already)",
                g.status
            ));
        }
        if adopted && g.mode != GrantMode::HandOff {
            return Err(format!(
                "the peer says it adopted grant {id}, which was granted for copying, not handed off"
            ));
        }
        Ok(())
    }

    /// The receiver let go of grant `id` (or refused it): its pins go.
    fn finish_out(&self, id: u64, status: GrantStatus) {
        let pin = {
            let mut st = self.state.lock();
            let Some(g) = st.out.get_mut(&id) else {
                tracing::debug!(peer = %self.peer.name, grant = id, "release of an unknown grant ignored");
                return;
            };
            g.status = status;
            let pin = g.pin.take();
            if g.detached {
                st.out.remove(&id);
            }
            pin
        };
        // The pin drops here, with no lock held (it may tear a backing down).
        drop(pin);
        self.changed.notify_all();
        tracing::debug!(peer = %self.peer.name, grant = id, "grant released; blocks unpinned");
    }
}

impl Drop for LinkShared {
    fn drop(&mut self) {
        // Every mapping using a kept import holds the link: none is left, so all can go.
        let left: Vec<(u64, PhysicalChunk)> = self
            .state
            .get_mut()
            .kept_in
            .drain()
            .map(|(k, e)| (k, e.chunk))
            .collect();
        for (k, c) in left {
            // SAFETY: imported by this link, mapped nowhere (no mapping is left), released once.
            if let Err(e) = unsafe { self.backend.release(c) } {
                tracing::error!(peer = %self.peer.name, key = k, error = %e, "releasing a kept import failed");
            }
        }
    }
}

/// A link to one other engine on this node; see the module documentation of [`crate::p2p`].
///
/// Dropping it shuts the connection down. Grants the peer still holds keep their blocks pinned
/// until the peer's process exits; imports held here stay valid until dropped.
pub struct PeerLink {
    shared: Arc<LinkShared>,
    writer: FrameWriter,
    stream: UnixStream,
}

/// A listening socket for peers at `path`, connectable by this user only (mode 0600, less what
/// the umask takes) from the moment it exists. Who may link is checked on each connection as
/// well ([`LinkOptions`]).
pub fn listen(path: impl AsRef<Path>) -> Result<UnixListener> {
    use rustix::net::{AddressFamily, SocketAddrUnix, SocketFlags, SocketType};
    let path = path.as_ref();
    let fail = |op: &'static str| {
        move |e: rustix::io::Errno| ipc::frame::ipc_error(op, format!("{}: {e}", path.display()))
    };
    let socket = rustix::net::socket_with(
        AddressFamily::UNIX,
        SocketType::STREAM,
        SocketFlags::CLOEXEC,
        None,
    )
    .map_err(fail("socket"))?;
    // Linux creates the node `bind` makes with the socket's own mode less the umask, so the mode
    // set here is the node's from its first instant. Chosen over a chmod after bind (a window in
    // which others may connect), a process-wide umask change (not thread-safe) and a private
    // folder (the caller picks the path, and often its folder is shared by design).
    rustix::fs::fchmod(&socket, rustix::fs::Mode::from_raw_mode(0o600))
        .map_err(fail("fchmod 0600"))?;
    let addr = SocketAddrUnix::new(path).map_err(fail("socket address"))?;
    rustix::net::bind(&socket, &addr).map_err(fail("bind"))?;
    rustix::net::listen(&socket, 128).map_err(fail("listen"))?;
    Ok(UnixListener::from(socket))
}

/// Who may be at the other end of a link. [`PeerLink::connect`], [`PeerLink::accept`],
/// [`PeerLink::accept_within`] and [`PeerLink::over`] use the defaults: only processes of this
/// process's (effective) user. The peer's user is the kernel's word (`SO_PEERCRED`, recorded
/// when it connected or listened), checked before anything is said or sent to it; a peer of
/// another user is refused with [`Error::PeerUserRefused`].
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LinkOptions {
    allowed_uids: Vec<u32>,
}

impl LinkOptions {
    /// The defaults: peers of this process's user only.
    pub fn new() -> Self {
        Self::default()
    }

    /// Also link with processes of user `uid` (both ends of a link check: the other side must
    /// allow ours too). Such a peer may do on this link what one of our user may: map the
    /// chunks we grant it and grant us its own.
    pub fn allow_uid(mut self, uid: u32) -> Self {
        if !self.allowed_uids.contains(&uid) {
            self.allowed_uids.push(uid);
        }
        self
    }

    /// [`PeerLink::connect`] with these options.
    pub fn connect(
        &self,
        path: impl AsRef<Path>,
        name: &str,
        backend: Arc<dyn Backend>,
    ) -> Result<PeerLink> {
        let path = path.as_ref();
        let s = UnixStream::connect(path)
            .map_err(|e| ipc::frame::ipc_error("connect", format!("{}: {e}", path.display())))?;
        self.over(s, name, backend)
    }

    /// [`PeerLink::accept_within`] with these options.
    pub fn accept_within(
        &self,
        listener: &UnixListener,
        name: &str,
        backend: Arc<dyn Backend>,
        timeout: Duration,
    ) -> Result<PeerLink> {
        let end = Instant::now().checked_add(timeout);
        loop {
            let left = end.map(|end| end.saturating_duration_since(Instant::now()));
            if left.is_some_and(|l| l.is_zero()) {
                return Err(ipc::frame::ipc_error(
                    "accept",
                    format!("no engine connected within {timeout:?}"),
                ));
            }
            let mut fds = [rustix::event::PollFd::new(
                listener,
                rustix::event::PollFlags::IN,
            )];
            let wait = left.map(|left| rustix::event::Timespec {
                tv_sec: left.as_secs().try_into().unwrap_or(i64::MAX),
                tv_nsec: left.subsec_nanos().into(),
            });
            match rustix::event::poll(&mut fds, wait.as_ref()) {
                Ok(n) if n > 0 => return self.accept(listener, name, backend),
                Ok(_) | Err(rustix::io::Errno::INTR) => {}
                Err(e) => return Err(ipc::frame::ipc_error("poll", e.to_string())),
            }
        }
    }

    /// [`PeerLink::accept`] with these options.
    pub fn accept(
        &self,
        listener: &UnixListener,
        name: &str,
        backend: Arc<dyn Backend>,
    ) -> Result<PeerLink> {
        let (s, _) = listener
            .accept()
            .map_err(|e| ipc::frame::ipc_error("accept", e.to_string()))?;
        self.over(s, name, backend)
    }

    /// [`PeerLink::over`] with these options.
    pub fn over(
        &self,
        stream: UnixStream,
        name: &str,
        backend: Arc<dyn Backend>,
    ) -> Result<PeerLink> {
        let credentials = ipc::peer_credentials(&stream)?;
        self.check(&credentials)?;
        PeerLink::open(stream, credentials, name, backend)
    }

    /// Refuse a peer of another user than ours, unless allowed.
    fn check(&self, peer: &PeerCredentials) -> Result<()> {
        let ours = rustix::process::geteuid().as_raw();
        if peer.uid == ours || self.allowed_uids.contains(&peer.uid) {
            return Ok(());
        }
        tracing::warn!(pid = peer.pid, uid = peer.uid, ours, allowed = ?self.allowed_uids, "p2p peer of another user refused");
        Err(Error::PeerUserRefused {
            pid: peer.pid,
            uid: peer.uid,
            ours,
            allowed: self.allowed_uids.clone(),
        })
    }
}

/// A hello of another protocol version than ours, which may not decode as ours: its first
/// words (the message's variant, 0 for a hello, then the version) say which, so the error
/// names the version rather than a decoding failure.
fn hello_version(payload: &[u8]) -> Option<Error> {
    let ((variant, version), _) = postcard::take_from_bytes::<(u32, u32)>(payload).ok()?;
    (variant == 0 && version != VERSION).then(|| other_version("?".into(), version))
}

/// The refusal of a peer speaking protocol `version`, not ours.
fn other_version(peer: String, version: u32) -> Error {
    Error::Peer {
        peer,
        op: "hello",
        detail: format!("protocol version {version} (ours is {VERSION})"),
    }
}

impl PeerLink {
    /// Connect to the engine listening at `path`, introducing ourselves as `name`. `backend` is
    /// the backend of this engine's layouts: imports are mapped through it. A broker engine
    /// passes its own backend (`BrokerClient::local_backend`), not a model's: the broker lends
    /// a model's chunks, it does not import other processes' (refused). Only an engine of our
    /// user is linked with ([`LinkOptions`] allows others).
    pub fn connect(
        path: impl AsRef<Path>,
        name: &str,
        backend: Arc<dyn Backend>,
    ) -> Result<PeerLink> {
        LinkOptions::new().connect(path, name, backend)
    }

    /// [`PeerLink::accept`], giving up after `timeout` with an error if no engine connected
    /// (a peer process that died before connecting leaves no one waiting forever); a timeout
    /// too long to add to now waits without one. Another thread accepting on the same
    /// listener may take the engine first: then this waits in `accept` (blocking listener)
    /// or fails with `EAGAIN` (non-blocking).
    pub fn accept_within(
        listener: &UnixListener,
        name: &str,
        backend: Arc<dyn Backend>,
        timeout: Duration,
    ) -> Result<PeerLink> {
        LinkOptions::new().accept_within(listener, name, backend, timeout)
    }

    /// Accept one engine on `listener`; one of another user is refused ([`LinkOptions`]).
    pub fn accept(
        listener: &UnixListener,
        name: &str,
        backend: Arc<dyn Backend>,
    ) -> Result<PeerLink> {
        LinkOptions::new().accept(listener, name, backend)
    }

    /// A link over a connected stream (either end of a `UnixStream::pair` works too); a peer
    /// of another user is refused ([`LinkOptions`]).
    pub fn over(stream: UnixStream, name: &str, backend: Arc<dyn Backend>) -> Result<PeerLink> {
        LinkOptions::new().over(stream, name, backend)
    }

    /// The hello over `stream`, whose peer (`credentials`) may link, then the link.
    fn open(
        stream: UnixStream,
        credentials: PeerCredentials,
        name: &str,
        backend: Arc<dyn Backend>,
    ) -> Result<PeerLink> {
        if let Some(lender) = backend.chunk_lender() {
            return Err(Error::InvalidArgument(format!(
                "a p2p link maps imports through the engine's own backend; this one's chunks are lent by {lender} and it imports none (a broker engine passes BrokerClient::local_backend)"
            )));
        }
        // A grant in flight holds a descriptor per chunk (thousands): the soft limit (often
        // 1024) would truncate them.
        ipc::raise_fd_limit();
        let info = backend.info();
        let local = Endpoint::local(info);
        let hello = Hello {
            version: VERSION,
            name: name.to_owned(),
            boot_id: local.boot_id.clone(),
            memory: info.memory_kind.into(),
            device: info.device_ordinal,
            granularity: info.granularity as u64,
            exportable: info.posix_fd_exportable,
        };
        let io =
            |op: &'static str| move |e: std::io::Error| ipc::frame::ipc_error(op, e.to_string());
        // The whole hello (three frames each way) within the timeout, not each read.
        let hello_end = Instant::now() + HELLO_TIMEOUT;
        // The hello and our GPU go out back to back; neither side reads before it sent both.
        ipc::send_frame(&stream, &ipc::encode(&Msg::Hello(hello))?, &[])?;
        ipc::send_frame(&stream, &ipc::encode(&Msg::Device(info.device_uuid))?, &[])?;
        let next = || -> Result<(Msg, usize)> {
            let left = hello_end.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(ipc::frame::ipc_error(
                    "hello",
                    format!("the peer did not finish its hello within {HELLO_TIMEOUT:?}"),
                ));
            }
            stream
                .set_read_timeout(Some(left))
                .map_err(io("set timeout"))?;
            let frame = ipc::recv_frame(&stream, ipc::MAX_FRAME)?
                .ok_or_else(|| ipc::frame::ipc_error("hello", "peer closed the connection"))?;
            let msg = ipc::decode::<Msg>(&frame.payload)
                .map_err(|e| hello_version(&frame.payload).unwrap_or(e))?;
            Ok((msg, frame.fds.len()))
        };
        let theirs = match next()? {
            (Msg::Hello(h), 0) => h,
            (other, fds) => {
                return Err(ipc::frame::ipc_error(
                    "hello",
                    format!(
                    "expected a hello without descriptors, got {other:?} with {fds} descriptors"
                ),
                ))
            }
        };
        if theirs.version != VERSION {
            return Err(other_version(theirs.name, theirs.version));
        }
        let unexpected = |what: &str, (other, fds): (Msg, usize)| Error::Peer {
            peer: theirs.name.clone(),
            op: "hello",
            detail: format!("expected {what}, got {other:?} with {fds} descriptors"),
        };
        let device_uuid = match next()? {
            (Msg::Device(uuid), 0) => uuid,
            other => return Err(unexpected("its GPU", other)),
        };
        let endpoint = Endpoint {
            boot_id: theirs.boot_id.clone(),
            memory: theirs.memory.into(),
            device: theirs.device,
            device_uuid,
            exportable: theirs.exportable,
        };
        // Each side finds whether its device reaches the other's GPU (by UUID: ordinals are
        // per process) and says so, so both know the path of each direction.
        let reach = match (&endpoint.device_uuid, endpoint.memory == local.memory) {
            (Some(uuid), true) => backend.reach(uuid).unwrap_or_else(|e| {
                tracing::warn!(error = %e, peer = %theirs.name, "finding the peer's GPU failed; its blocks come over NIXL");
                DeviceReach::NoDevice
            }),
            _ => DeviceReach::NoDevice,
        };
        ipc::send_frame(&stream, &ipc::encode(&Msg::Reach(reach.into()))?, &[])?;
        let reaches_us: DeviceReach = match next()? {
            (Msg::Reach(r), 0) => r.into(),
            other => return Err(unexpected("how it reaches our device", other)),
        };
        stream.set_read_timeout(None).map_err(io("set timeout"))?;
        let path = choose_path(&local, &endpoint, reaches_us);
        let path_in = choose_path(&endpoint, &local, reach);
        let peer = PeerInfo {
            name: theirs.name,
            credentials,
            endpoint,
            granularity: theirs.granularity,
            reach,
            reaches_us,
        };
        // Whether the peer's process is gone decides when pins of grants it never released
        // can go; a pidfd says so without any race on reused process ids.
        let pidfd = rustix::process::Pid::from_raw(credentials.pid).and_then(|pid| {
            rustix::process::pidfd_open(pid, rustix::process::PidfdFlags::empty()).ok()
        });
        if pidfd.is_none() {
            tracing::warn!(peer = %peer.name, pid = credentials.pid, "no pidfd for the peer: grants it never releases stay pinned for good");
        }
        tracing::info!(peer = %peer.name, pid = credentials.pid, uid = credentials.uid, path = %path.path, reason = %path.reason, path_in = %path_in.path, reason_in = %path_in.reason, "p2p link open");
        let clone = |s: &UnixStream| s.try_clone().map_err(io("dup socket"));
        let (writer, _) = FrameWriter::spawn(clone(&stream)?, WRITER_DEPTH, "p2p")?;
        let shared = Arc::new(LinkShared {
            socket: clone(&stream)?,
            name: name.to_owned(),
            peer,
            backend,
            path,
            path_in,
            state: Mutex::new(LinkState::default()),
            changed: Condvar::new(),
            writer: writer.clone(),
            send_lock: Mutex::new(()),
        });
        let reader = Reader {
            shared: shared.clone(),
            writer: writer.clone(),
            stream: clone(&stream)?,
            pidfd,
        };
        std::thread::Builder::new()
            .name(format!("p2p-{}-reader", shared.peer.name))
            .spawn(move || reader.run())
            .map_err(|e| ipc::frame::ipc_error("spawn reader", e.to_string()))?;
        Ok(PeerLink {
            shared,
            writer,
            stream,
        })
    }

    /// Our name on this link.
    pub fn name(&self) -> &str {
        &self.shared.name
    }

    /// The engine at the other end.
    pub fn peer(&self) -> &PeerInfo {
        &self.shared.peer
    }

    /// How our grants move to the peer and why (decided at hello, logged then): a grant is
    /// refused unless this is [`super::TransferPath::PeerImport`].
    pub fn path(&self) -> &PathChoice {
        &self.shared.path
    }

    /// How the peer's grants move to us and why: what [`super::CopyReport`] carries.
    pub fn path_in(&self) -> &PathChoice {
        &self.shared.path_in
    }

    /// Why the connection ended, once it has.
    pub fn closed(&self) -> Option<String> {
        self.shared.state.lock().closed.clone()
    }

    /// The link's books now.
    pub fn stats(&self) -> LinkStats {
        let st = self.shared.state.lock();
        let out = st.out.values().filter(|g| g.pin.is_some());
        LinkStats {
            grants_out: out.clone().count(),
            granted_bytes: out.map(|g| g.bytes).sum(),
            imports: st.live_in.len(),
            imported_bytes: st.live_in.values().map(|v| v.0).sum(),
            imported_chunks: st.live_in.values().map(|v| v.1).sum(),
            queued_grants: st.ready.len(),
            transfers: st.transfers,
            bytes_copied: st.bytes_copied,
            peer_kept_chunks: st.kept_out.len(),
            peer_kept_bytes: st.kept_out.values().map(|e| e.size).sum(),
            kept_imports: st.kept_in.len(),
            kept_import_bytes: st.kept_in.values().map(|e| e.chunk.size as u64).sum(),
            kept_hits: st.kept_hits,
        }
    }

    pub(crate) fn shared(&self) -> &Arc<LinkShared> {
        &self.shared
    }

    pub(crate) fn writer(&self) -> &FrameWriter {
        &self.writer
    }

    /// Take the next grant the peer sent, waiting up to `timeout`, and import and map its
    /// chunks here with the access granted (a read-only grant this backend cannot map read-only
    /// is refused, never mapped writable). A grant that cannot be imported is refused back to
    /// the sender (which unpins its blocks, and its status says why) and the error comes back
    /// here.
    ///
    /// Grants wait here until taken, at most 256 of them holding 262144 blocks and 65536
    /// chunks together; one beyond that is refused to its sender at once
    /// ([`GrantStatus::Refused`], with the numbers), and the link goes on.
    pub fn recv_grant(&self, timeout: Duration) -> Result<super::ImportedGrant> {
        // A timeout too long to add to now waits for good.
        let deadline = Instant::now().checked_add(timeout);
        let ready = {
            let (mut st, ok) = self
                .shared
                .wait_until(deadline, |st| !st.ready.is_empty() || st.closed.is_some());
            if !ok {
                return Err(self
                    .shared
                    .peer_error("receive grant", format!("no grant within {timeout:?}")));
            }
            match st.ready.pop_front() {
                Some(g) => {
                    st.live_in.insert(g.id, (0, 0));
                    g
                }
                None => {
                    let why = st.closed.clone().unwrap_or_default();
                    return Err(self
                        .shared
                        .peer_error("receive grant", format!("link closed: {why}")));
                }
            }
        };
        let id = ready.id;
        match super::import::ImportedGrant::build(self.shared.clone(), self.writer.clone(), ready) {
            Ok(g) => Ok(g),
            Err(e) => {
                {
                    let mut st = self.shared.state.lock();
                    st.live_in.remove(&id);
                    // A revoke that came meanwhile is answered by the refusal.
                    st.revoked_in.remove(&id);
                }
                let reason = e.to_string();
                tracing::warn!(peer = %self.shared.peer.name, grant = id, error = %reason, "grant refused");
                let _ = send(&self.writer, Msg::Refused { grant: id, reason }, Vec::new());
                Err(e)
            }
        }
    }
}

impl fmt::Debug for PeerLink {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PeerLink")
            .field("name", &self.shared.name)
            .field("peer", &self.shared.peer)
            .field("path", &self.shared.path)
            .field("path_in", &self.shared.path_in)
            .field("stats", &self.stats())
            .finish()
    }
}

impl Drop for PeerLink {
    fn drop(&mut self) {
        // Kept imports nothing maps go now and the peer hears so; it is asked to forget what it
        // keeps of ours; then bye. What we queued (releases of imports dropped just before)
        // goes out first, so the peer unpins on our word rather than on our exit.
        self.shared.say_bye();
        if !self.writer.flush(FLUSH_TIMEOUT) {
            tracing::debug!(peer = %self.shared.peer.name, "frames not flushed before the link closed");
        }
        // The peer answers what it owes and says bye; the reader reads it all and closes. A
        // peer that does not answer in time is cut off (the reader then settles the books).
        let deadline = Instant::now().checked_add(FLUSH_TIMEOUT);
        let (st, ended) = self.shared.wait_until(deadline, |st| st.closed.is_some());
        drop(st);
        if !ended {
            tracing::debug!(peer = %self.shared.peer.name, "no bye from the peer in time; closing the link");
            let _ = self.stream.shutdown(std::net::Shutdown::Both);
        }
    }
}

/// Queue one message with descriptors on a link's writer.
pub(crate) fn send(writer: &FrameWriter, msg: Msg, fds: Vec<OwnedFd>) -> Result<()> {
    writer.send(Outgoing {
        payload: ipc::encode(&msg)?,
        fds,
    })
}

/// The reader thread of a link.
struct Reader {
    shared: Arc<LinkShared>,
    writer: FrameWriter,
    stream: UnixStream,
    pidfd: Option<OwnedFd>,
}

impl Reader {
    fn run(self) {
        let reason = loop {
            match ipc::recv_frame(&self.stream, ipc::MAX_FRAME) {
                Ok(Some(frame)) => {
                    let msg = match ipc::decode::<Msg>(&frame.payload) {
                        Ok(m) => m,
                        Err(e) => break format!("malformed message: {e}"),
                    };
                    if let Err(e) = self.handle(msg, frame.fds) {
                        break format!("protocol error: {e}");
                    }
                    // Both said bye: done once our requests are answered; the peer's answers
                    // come before its own end, which a timeout bounds.
                    let st = self.shared.state.lock();
                    if st.bye_sent && st.bye_received {
                        if !st.forgets_pending() {
                            break "both sides said bye".to_owned();
                        }
                        drop(st);
                        let _ = self.stream.set_read_timeout(Some(BYE_TIMEOUT));
                    }
                }
                Ok(None) => break "the peer closed the connection".to_owned(),
                Err(e) => break e.to_string(),
            }
        };
        self.close(reason);
    }

    fn handle(&self, msg: Msg, fds: Vec<OwnedFd>) -> Result<()> {
        let bad = |d: String| self.shared.peer_error("receive", d);
        match msg {
            Msg::Hello(_) => return Err(bad("a second hello".into())),
            Msg::Device(_) | Msg::Reach(_) => {
                return Err(bad(
                    "its GPU or how it reaches ours again, after the hello".into()
                ))
            }
            Msg::Chunks {
                grant,
                offsets,
                sizes,
                how,
            } => {
                let with_fd = how.iter().filter(|h| h.has_fd()).count();
                if offsets.len() != how.len()
                    || sizes.len() != how.len()
                    || with_fd != fds.len()
                    || how.is_empty()
                {
                    return Err(bad(format!(
                        "chunks of grant {grant}: {} offsets, {} sizes, {} chunks of which {with_fd} with descriptors, {} descriptors",
                        offsets.len(),
                        sizes.len(),
                        how.len(),
                        fds.len()
                    )));
                }
                let mut st = self.shared.state.lock();
                if st.live_in.contains_key(&grant) || st.ready.iter().any(|g| g.id == grant) {
                    return Err(bad(format!("chunks for grant {grant}, which is complete")));
                }
                if !st.partial.contains_key(&grant) && st.partial.len() >= MAX_PARTIAL_GRANTS {
                    return Err(bad(format!(
                        "more than {MAX_PARTIAL_GRANTS} grants half sent"
                    )));
                }
                let part = st.partial.entry(grant).or_default();
                if part.len() + how.len() > MAX_GRANT_CHUNKS {
                    return Err(bad(format!(
                        "grant {grant} has more than {MAX_GRANT_CHUNKS} chunks"
                    )));
                }
                let mut fds = fds.into_iter();
                part.extend(offsets.into_iter().zip(sizes).zip(how).map(
                    |((offset, size), how)| InChunk {
                        offset,
                        size,
                        how,
                        fd: if how.has_fd() { fds.next() } else { None },
                    },
                ));
            }
            Msg::Blocks { grant, blocks } => {
                if !fds.is_empty() {
                    return Err(bad(format!(
                        "{} descriptors on a blocks message",
                        fds.len()
                    )));
                }
                let mut st = self.shared.state.lock();
                // Chunks come first: a grant with none is not half sent, and the count of
                // half-sent grants bounds these lists.
                if !st.partial.contains_key(&grant) {
                    return Err(bad(format!(
                        "blocks for grant {grant}, which has no chunks here"
                    )));
                }
                let part = st.partial_blocks.entry(grant).or_default();
                if blocks.is_empty() || part.len() + blocks.len() > MAX_GRANT_BLOCKS {
                    return Err(bad(format!(
                        "grant {grant}: {} blocks after {} (1 or more, {MAX_GRANT_BLOCKS} in all allowed)",
                        blocks.len(),
                        part.len()
                    )));
                }
                part.extend(blocks);
            }
            Msg::Grant {
                grant,
                mode,
                access,
                layout,
                blocks: last,
                chunks,
            } => {
                if !fds.is_empty() {
                    return Err(bad(format!("{} descriptors on a grant message", fds.len())));
                }
                let mut st = self.shared.state.lock();
                // A second grant of a live or queued id would unbook (and refuse) the first.
                if st.live_in.contains_key(&grant) || st.ready.iter().any(|g| g.id == grant) {
                    drop(st);
                    return Err(bad(format!("grant {grant} again, while the first is here")));
                }
                let got = st.partial.remove(&grant).unwrap_or_default();
                let mut blocks = st.partial_blocks.remove(&grant).unwrap_or_default();
                blocks.extend(last);
                if got.len() as u64 != chunks
                    || blocks.is_empty()
                    || blocks.len() > MAX_GRANT_BLOCKS
                {
                    drop(st);
                    return Err(bad(format!(
                        "grant {grant} announces {chunks} chunks ({} arrived) and {} blocks (1 to {MAX_GRANT_BLOCKS} allowed)",
                        got.len(),
                        blocks.len()
                    )));
                }
                // Grants the application has not taken yet: bounded, so a peer cannot grow
                // them (and the descriptors they hold) without limit. One more is refused, as
                // a grant that cannot be imported is: the sender unpins it, the link goes on.
                let (queued_blocks, queued_chunks) = st
                    .ready
                    .iter()
                    .fold((0, 0), |(b, c), g| (b + g.blocks.len(), c + g.chunks.len()));
                if st.ready.len() >= MAX_QUEUED_GRANTS
                    || queued_blocks + blocks.len() > MAX_QUEUED_BLOCKS
                    || queued_chunks + got.len() > MAX_QUEUED_CHUNKS
                {
                    let n = st.ready.len();
                    drop(st);
                    let reason = format!(
                        "grant {grant} ({} blocks, {} chunks) on top of {n} grants not taken yet here ({queued_blocks} blocks, {queued_chunks} chunks): at most {MAX_QUEUED_GRANTS} grants, {MAX_QUEUED_BLOCKS} blocks and {MAX_QUEUED_CHUNKS} chunks wait",
                        blocks.len(),
                        got.len()
                    );
                    tracing::warn!(peer = %self.shared.peer.name, grant, %reason, "grant refused");
                    // Its chunks sent to be kept are kept all the same; descriptors close.
                    self.shared.keep_unimported(got);
                    return send(&self.writer, Msg::Refused { grant, reason }, Vec::new());
                }
                if self.shared.path_in.path != TransferPath::PeerImport {
                    // A conforming sender does not grant over this path; refused before any
                    // import.
                    drop(st);
                    let reason = format!(
                        "grant {grant}: the peer's chunks cannot be imported here ({})",
                        self.shared.path_in.reason
                    );
                    // Nothing imported, nothing kept: the sender hears so of each key it sent
                    // to be kept; the descriptors close.
                    let keys: Vec<u64> = got
                        .iter()
                        .filter_map(|c| match c.how {
                            WireChunk::Keep(k) => Some(k),
                            _ => None,
                        })
                        .collect();
                    drop(got);
                    self.shared.send_forgot(keys);
                    return send(&self.writer, Msg::Refused { grant, reason }, Vec::new());
                }
                st.ready.push_back(ReadyGrant {
                    id: grant,
                    mode,
                    access,
                    layout,
                    blocks,
                    chunks: got,
                });
                drop(st);
                self.shared.changed.notify_all();
            }
            Msg::Revoke { grant } => {
                // Not taken yet: drop it now. Mapped here: no new copy from it, and the release
                // goes out when its last holder lets go. Neither: answered already (released or
                // refused; frames come in order, and a revoke follows its whole grant), so a
                // second answer, which the sender takes for a protocol error, stays unsent.
                let dropped = {
                    let mut st = self.shared.state.lock();
                    let queued = st
                        .ready
                        .iter()
                        .position(|g| g.id == grant)
                        .and_then(|i| st.ready.remove(i))
                        .map(|g| g.chunks);
                    let partial = st.partial.remove(&grant);
                    st.partial_blocks.remove(&grant);
                    if st.live_in.contains_key(&grant) {
                        st.revoked_in.insert(grant);
                        None
                    } else if queued.is_none() && partial.is_none() {
                        tracing::debug!(peer = %self.shared.peer.name, grant, "revoke of a grant answered already");
                        None
                    } else {
                        Some((queued, partial))
                    }
                };
                self.shared.changed.notify_all();
                if let Some((queued, partial)) = dropped {
                    let chunks = queued.into_iter().chain(partial).flatten().collect();
                    self.shared.keep_unimported(chunks);
                    send(&self.writer, Msg::Released { grant }, Vec::new())?;
                }
            }
            Msg::Released { grant } => {
                self.shared.check_answer(grant, false).map_err(bad)?;
                self.shared.finish_out(grant, GrantStatus::Released)
            }
            Msg::Adopted { grant } => {
                self.shared.check_answer(grant, true).map_err(bad)?;
                self.shared.finish_hand_off(grant)
            }
            Msg::Refused { grant, reason } => {
                self.shared.check_answer(grant, false).map_err(bad)?;
                tracing::warn!(peer = %self.shared.peer.name, grant, %reason, "peer refused a grant");
                self.shared.finish_out(grant, GrantStatus::Refused(reason))
            }
            Msg::Forget { keys } => {
                // Unused ones go now; those a mapping uses go when it is unmapped.
                let release: Vec<(u64, PhysicalChunk)> = {
                    let mut st = self.shared.state.lock();
                    let mut release = Vec::new();
                    for k in keys {
                        // Unknown: released here already (our link is ending), nothing to do.
                        let Some(e) = st.kept_in.get_mut(&k) else {
                            continue;
                        };
                        e.forgotten = true;
                        if e.users == 0 {
                            release.extend(st.kept_in.remove(&k).map(|e| (k, e.chunk)));
                        }
                    }
                    release
                };
                self.shared.release_kept(release, true);
            }
            Msg::Forgot { keys } => self.shared.forgot_out(keys).map_err(bad)?,
            Msg::Bye => {
                {
                    let mut st = self.shared.state.lock();
                    if std::mem::replace(&mut st.bye_received, true) {
                        return Err(bad("a second bye".into()));
                    }
                    // No grant comes any more, and none may go: the link is closed for use.
                    st.closed
                        .get_or_insert_with(|| "the peer closed the link".to_owned());
                }
                self.shared.changed.notify_all();
                self.shared.say_bye();
            }
        }
        Ok(())
    }

    /// The connection ended: grants not taken are dropped (descriptors closed); pins of grants
    /// the peer never released go once its process has exited.
    fn close(self, reason: String) {
        tracing::info!(peer = %self.shared.peer.name, %reason, "p2p link closed");
        let (partial, ready) = {
            // Under the send lock: a grant deciding what goes as keys is done, and no later one
            // records anything for this link.
            let _sending = self.shared.send_lock.lock();
            let mut st = self.shared.state.lock();
            st.closed.get_or_insert(reason);
            (
                {
                    st.partial_blocks.clear();
                    std::mem::take(&mut st.partial)
                },
                std::mem::take(&mut st.ready),
            )
        };
        // Chunks sent to be kept that never got imported: the sender hears they are not kept
        // (if it still listens: it may have closed only its own end).
        let never: Vec<u64> = partial
            .into_values()
            .flatten()
            .chain(ready.into_iter().flat_map(|g| g.chunks))
            .filter_map(|c| match c.how {
                WireChunk::Keep(k) => Some(k),
                _ => None,
            })
            .collect();
        self.shared.changed.notify_all();
        // Our imports of the peer's chunks that nothing maps go (the rest when unmapped).
        self.shared.release_unused_kept(true);
        if !never.is_empty() {
            let _ = send(&self.writer, Msg::Forgot { keys: never }, Vec::new());
        }
        // What we owe goes out before the end (a peer that closed only its own end reads it).
        if !self.writer.flush(FLUSH_TIMEOUT) {
            tracing::debug!(peer = %self.shared.peer.name, "frames not flushed before the link closed");
        }
        let _ = self.stream.shutdown(std::net::Shutdown::Both);
        let outstanding = {
            let st = self.shared.state.lock();
            st.out.values().any(|g| g.pin.is_some()) || !st.kept_out.is_empty()
        };
        if !outstanding {
            return;
        }
        let Some(pidfd) = &self.pidfd else {
            tracing::error!(peer = %self.shared.peer.name, "the peer may still map granted chunks or keep them imported and its exit cannot be watched: their blocks stay pinned and released chunks held back");
            return;
        };
        tracing::info!(peer = %self.shared.peer.name, pid = self.shared.peer.credentials.pid, "waiting for the peer's process to exit before unpinning its grants");
        wait_exit(pidfd);
        let pins: Vec<GrantPin> = {
            let mut st = self.shared.state.lock();
            let mut pins = Vec::new();
            for g in st.out.values_mut() {
                if matches!(g.status, GrantStatus::HandOffStuck(_)) {
                    continue;
                }
                if let Some(p) = g.pin.take() {
                    g.status = GrantStatus::PeerExited;
                    pins.push(p);
                }
            }
            st.out.retain(|_, g| !g.detached || g.pin.is_some());
            pins
        };
        tracing::info!(peer = %self.shared.peer.name, grants = pins.len(), "peer exited; its grants are unpinned");
        drop(pins);
        // Its kept imports went with it.
        let kept: Vec<(u64, KeptOut)> = self.shared.state.lock().kept_out.drain().collect();
        self.shared.settle_forgotten(kept);
        self.shared.changed.notify_all();
    }
}

/// Block until the process behind `pidfd` has exited.
fn wait_exit(pidfd: &OwnedFd) {
    let mut p = libc::pollfd {
        fd: pidfd.as_fd().as_raw_fd(),
        events: libc::POLLIN,
        revents: 0,
    };
    loop {
        // SAFETY: `p` is one valid pollfd for the duration of the call.
        let rc = unsafe { libc::poll(&mut p, 1, -1) };
        if rc > 0 {
            return;
        }
        if rc < 0 && std::io::Error::last_os_error().raw_os_error() != Some(libc::EINTR) {
            tracing::error!(error = %std::io::Error::last_os_error(), "poll on a pidfd failed");
            return;
        }
    }
}

/// Links to several peers by name: a grant names its receiver.
#[derive(Debug, Default)]
pub struct Peers {
    links: Vec<PeerLink>,
}

impl Peers {
    /// No peers.
    pub fn new() -> Self {
        Peers::default()
    }

    /// Add a link; a second link to a peer of the same name is refused.
    pub fn add(&mut self, link: PeerLink) -> Result<()> {
        if self.links.iter().any(|l| l.peer().name == link.peer().name) {
            return Err(Error::InvalidArgument(format!(
                "a peer named {:?} is connected already",
                link.peer().name
            )));
        }
        self.links.push(link);
        Ok(())
    }

    /// The names of the peers connected.
    pub fn names(&self) -> Vec<String> {
        self.links.iter().map(|l| l.peer().name.clone()).collect()
    }

    /// The link to `name`, or [`Error::UnknownPeer`].
    pub fn get(&self, name: &str) -> Result<&PeerLink> {
        self.links
            .iter()
            .find(|l| l.peer().name == name)
            .ok_or_else(|| Error::UnknownPeer {
                name: name.to_owned(),
                known: self.names(),
            })
    }

    /// Grant `peer` access to `blocks` of `layout` (see [`PeerLink::grant`]); an unknown peer
    /// is an error before anything is pinned or exported.
    pub fn grant(
        &self,
        peer: &str,
        layout: &crate::layout::ElasticLayout,
        blocks: &[usize],
        access: AccessMode,
    ) -> Result<super::Grant> {
        self.get(peer)?.grant(layout, blocks, access)
    }
}
