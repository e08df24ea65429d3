//! The broker's books: which chunk is where, which model is whose, what each is charged.
//! Pure bookkeeping under one lock, no driver call, no socket write (see `server.rs` for who
//! calls what without it).
//!
//! Every chunk the broker made is in exactly one place: held by a model (granted, charged to
//! it), idle (given back, charged to the broker's own line [`IDLE`], waiting to be handed over),
//! or moving (taken out by a thread that is releasing or exporting it without the lock; its
//! charge is settled by that thread). The ledger's rules (`crate::shared::ledger`) hold at every
//! instant: no model above its limit, no charge above the global budget less the other models'
//! unused guarantees.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::os::fd::OwnedFd;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::lease::Lease;
use super::protocol::{
    BrokerCounters, EngineInfo, LeaseState, ModelInfo, Refusal, RefusalCause, Role, MAX_MODELS,
    MAX_NAME,
};
use crate::backend::PhysicalChunk;
use crate::budget::{Ledger, ModelBook, Refusal as LedgerRefusal};
use crate::ipc::{FrameWriter, PeerCredentials};

/// The ledger line of the broker's idle chunks.
pub(crate) const IDLE: u64 = 0;

/// Where a chunk is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Holder {
    /// Granted to a model.
    Model(u64),
    /// Given back, waiting for a hand-over.
    Idle,
    /// Taken out by a thread working without the lock.
    Moving,
}

#[derive(Debug)]
pub(crate) struct ChunkEntry {
    pub(crate) chunk: PhysicalChunk,
    pub(crate) holder: Holder,
    /// Idle, given back by a model while it was asked to give back for model `reserved`: it
    /// serves that model's request first (see [`Book::kept_for_other`]).
    pub(crate) reserved: Option<u64>,
}

#[derive(Debug)]
pub(crate) struct ModelEntry {
    pub(crate) name: Arc<str>,
    pub(crate) conn: u64,
    /// The user of the engine that registered it (`SO_PEERCRED`).
    pub(crate) uid: u32,
    /// Its connection ended while its process lived (see [`Book::end_conn`]): retired, its name
    /// free, its chunks and charges kept until the process is gone.
    pub(crate) orphaned: bool,
    /// Its lease (`lease.rs`): while held, `conn` is 0 (no connection has that id).
    pub(crate) lease: Option<Lease>,
    pub(crate) chunks: BTreeSet<u64>,
    pub(crate) in_use: u64,
    pub(crate) idle: u64,
    pub(crate) cached: u64,
}

#[derive(Debug)]
pub(crate) struct ConnEntry {
    pub(crate) name: String,
    pub(crate) role: Role,
    pub(crate) peer: PeerCredentials,
    pub(crate) writer: FrameWriter,
    /// Kept to shut the connection down when the broker stops.
    pub(crate) stream: std::os::unix::net::UnixStream,
    /// The peer's process (a pidfd), if the kernel gave one: whether it still lives decides
    /// what happens to its memory when the connection ends.
    pub(crate) pidfd: Option<Arc<OwnedFd>>,
}

/// The models of a connection that ended while its process lived: their chunks may still be
/// mapped there, so they stay charged until the process is gone.
#[derive(Debug)]
pub(crate) struct Orphan {
    pub(crate) conn: u64,
    pub(crate) pid: i32,
    pub(crate) pidfd: Arc<OwnedFd>,
    pub(crate) models: Vec<u64>,
}

/// An outstanding reclaim request (see [`crate::budget`]: a remote donor asked to give back).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Ticket {
    pub(crate) conn: u64,
    pub(crate) model: u64,
    /// The model whose request asked (`None`: the model's own limit was lowered). The ticket
    /// stays in the book until that request ends, and what the model gives back before it
    /// answered is kept for the asker meanwhile.
    pub(crate) asker: Option<u64>,
    /// The engine's answer: the bytes it says it gave back (`None` until it answered).
    pub(crate) freed: Option<u64>,
}

/// The operator's caps per user (see [`super::BrokerConfig`]).
#[derive(Debug, Clone)]
pub(crate) struct Policy {
    /// The broker's own user: it (and root) may hold guarantees by default; others may not.
    pub(crate) broker_uid: u32,
    pub(crate) max_models_per_user: usize,
    /// `None`: the global limit (the ledger's rule: guarantees fit beside everything used or
    /// promised).
    pub(crate) max_guarantee_total: Option<u64>,
    pub(crate) max_guarantee_per_user: Option<u64>,
    /// The most bytes the models of one user other than the broker's and root may hold
    /// together, orphaned models included.
    pub(crate) max_bytes_per_user: u64,
    /// The highest priority a user other than the broker's and root may register a model at
    /// (reclaims take from the lowest priority first: above the operator's, a user's models
    /// would make the operator's give first).
    pub(crate) max_priority_per_user: i32,
}

impl Policy {
    /// The most bytes of guarantees the models of `uid` may hold together, under a budget of
    /// `global` bytes: the operator's cap, else the global limit for the broker's user and
    /// root and nothing for other users.
    pub(crate) fn guarantee_cap(&self, uid: u32, global: u64) -> u64 {
        match self.max_guarantee_per_user {
            Some(cap) => cap.min(global),
            None if uid == self.broker_uid || uid == 0 => global,
            None => 0,
        }
    }

    /// Whether every model's guarantee together stays within the policy's total when the
    /// guarantee of `model` (a new one when `None`) becomes `guarantee`.
    pub(crate) fn check_guarantee_total(
        &self,
        ledger: &Ledger,
        name: &str,
        model: Option<u64>,
        guarantee: u64,
    ) -> Result<(), BookError> {
        // Without a total of the operator's, the ledger's own rule is the total (guarantees
        // fit beside everything used or promised), refused with the room left.
        let Some(max) = self.max_guarantee_total else {
            return Ok(());
        };
        let others = ledger
            .models
            .iter()
            .filter(|(k, _)| Some(**k) != model)
            .fold(0u64, |sum, (_, b)| sum.saturating_add(b.guarantee));
        if others.checked_add(guarantee).is_none_or(|g| g > max) {
            return Err(BookError::Forbidden(format!(
                "model {name:?}: guarantee {guarantee} refused: the other models hold guarantees of {others} bytes, {max} allowed in all"
            )));
        }
        Ok(())
    }
}

/// Everything under the broker's lock.
#[derive(Debug)]
pub(crate) struct Book {
    pub(crate) ledger: Ledger,
    pub(crate) policy: Policy,
    pub(crate) models: BTreeMap<u64, ModelEntry>,
    pub(crate) names: HashMap<Arc<str>, u64>,
    pub(crate) chunks: HashMap<u64, ChunkEntry>,
    /// Idle chunk ids by size.
    idle: BTreeMap<u64, Vec<u64>>,
    pub(crate) idle_bytes: u64,
    pub(crate) conns: BTreeMap<u64, ConnEntry>,
    /// Connections ended with memory held by processes that still live.
    pub(crate) orphans: Vec<Orphan>,
    pub(crate) tickets: HashMap<u64, Ticket>,
    pub(crate) counters: BrokerCounters,
    /// How long a lease whose engine is gone holds its memory.
    pub(crate) lease_grace: Duration,
    next_id: u64,
}

/// Why an engine's request about a model or chunk cannot be served.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum BookError {
    Unknown(String),
    Invalid(String),
    Duplicate(String),
    /// The operator's policy (caps per user, guarantees) does not allow it.
    Forbidden(String),
    /// Held by another engine or process right now.
    Busy(String),
}

impl Book {
    pub(crate) fn new(global_limit: u64, policy: Policy) -> Book {
        let mut ledger = Ledger::new(global_limit);
        let idle = ModelBook::new("(broker idle)".into(), u64::MAX, 0, i32::MIN);
        // A line without a guarantee needs no room: this cannot fail, and is logged if it did.
        if let Err(room) = ledger.add(IDLE, idle) {
            tracing::error!(room, "the broker's idle line did not fit its book");
        }
        Book {
            ledger,
            policy,
            models: BTreeMap::new(),
            names: HashMap::new(),
            chunks: HashMap::new(),
            idle: BTreeMap::new(),
            idle_bytes: 0,
            conns: BTreeMap::new(),
            orphans: Vec::new(),
            tickets: HashMap::new(),
            counters: BrokerCounters::default(),
            lease_grace: Duration::from_secs(300),
            next_id: 0,
        }
    }

    /// Ids from `base` on: the host tier's book, whose model, chunk and ticket ids must never
    /// be the device book's (an engine's links and the reclaim pushes are keyed by model id).
    pub(crate) fn ids_from(mut self, base: u64) -> Book {
        self.next_id = base;
        self
    }

    /// When a lease held from now ends (a grace too long for the clock: in a century).
    pub(crate) fn lease_expiry(&self) -> Instant {
        let now = Instant::now();
        now.checked_add(self.lease_grace)
            .or_else(|| now.checked_add(Duration::from_secs(100 * 365 * 86_400)))
            .unwrap_or(now)
    }

    /// Leases whose engine is gone hold their memory for `grace`.
    pub(crate) fn lease_grace(mut self, grace: Duration) -> Book {
        self.lease_grace = grace;
        self
    }

    /// A fresh id (models, chunks, connections and tickets share one sequence; never 0).
    pub(crate) fn next_id(&mut self) -> u64 {
        self.next_id += 1;
        self.next_id
    }

    /// The model `model` if connection `conn` owns it. Another engine's model is "unknown":
    /// an engine cannot even learn that it exists.
    pub(crate) fn own_model(&self, conn: u64, model: u64) -> Result<&ModelEntry, BookError> {
        match self.models.get(&model) {
            Some(m) if m.conn == conn => Ok(m),
            _ => Err(BookError::Unknown(format!(
                "no model {model} registered by this connection"
            ))),
        }
    }

    /// Register a model of connection `conn`, whose user is `uid`: within the model caps
    /// (on the broker, and per user for users other than the broker's own and root), the
    /// priority cap (users other than the broker's own and root), the guarantee policy (in
    /// all and per user), and if its guarantee fits beside everything already used or
    /// promised.
    pub(crate) fn register(
        &mut self,
        conn: u64,
        uid: u32,
        name: &str,
        limit: u64,
        guarantee: u64,
        priority: i32,
    ) -> Result<u64, BookError> {
        check_name("model name", name)?;
        if limit == 0 {
            return Err(BookError::Invalid(format!(
                "model {name:?}: limit must be at least 1 byte, got 0"
            )));
        }
        if guarantee > limit {
            return Err(BookError::Invalid(format!(
                "model {name:?}: guarantee {guarantee} is above its limit {limit}"
            )));
        }
        if let Some(held) = self.names.get(name).and_then(|k| self.models.get(k)) {
            // Only the lease's own user learns that it is one.
            let leased = held.lease.as_ref().filter(|_| held.uid == uid);
            return Err(BookError::Duplicate(match leased.map(|l| l.state) {
                Some(LeaseState::Held) => format!(
                    "model {name:?} is held under a lease: attach it with its token, or wait for its grace period to end"
                ),
                Some(LeaseState::Waiting) => format!(
                    "model {name:?} is under a lease whose engine's process still lives; once it is gone, attach it with its token"
                ),
                _ => format!("model {name:?} is already registered"),
            }));
        }
        if self.models.len() >= MAX_MODELS {
            return Err(BookError::Invalid(format!(
                "{} models registered, {MAX_MODELS} allowed",
                self.models.len()
            )));
        }
        let of_user = self.models.values().filter(|m| m.uid == uid).count();
        let operator = uid == self.policy.broker_uid || uid == 0;
        if !operator && of_user >= self.policy.max_models_per_user {
            return Err(BookError::Forbidden(format!(
                "model {name:?}: user {uid} has {of_user} models registered, {} allowed per user",
                self.policy.max_models_per_user
            )));
        }
        if !operator && priority > self.policy.max_priority_per_user {
            return Err(BookError::Forbidden(format!(
                "model {name:?}: priority {priority} refused: {} allowed per user for users other than the broker's (uid {}) and root (above it their models would outrank the operator's in a reclaim)",
                self.policy.max_priority_per_user, self.policy.broker_uid
            )));
        }
        if guarantee > 0 {
            let cap = self.policy.guarantee_cap(uid, self.ledger.global_limit);
            let held = self.guarantees(|m| m.uid == uid);
            // Without an operator's cap, the broker's user and root are bounded by the global
            // limit: a guarantee above it is the policy's refusal; what does not fit beside the
            // others is the ledger's, with the room left (it holds the same bound).
            let asked = if self.policy.max_guarantee_per_user.is_none() && cap > 0 {
                Some(guarantee)
            } else {
                held.checked_add(guarantee)
            };
            if asked.is_none_or(|g| g > cap) {
                let why = match self.policy.max_guarantee_per_user {
                    None if cap == 0 => format!(" (users other than the broker's, uid {}, and root get none unless the operator allows them some)", self.policy.broker_uid),
                    None => " (the global limit: no cap per user is set)".to_string(),
                    Some(_) => String::new(),
                };
                return Err(BookError::Forbidden(format!(
                    "model {name:?}: guarantee {guarantee} refused: the models of user {uid} hold guarantees of {held} bytes, {cap} allowed per user{why}"
                )));
            }
            self.policy
                .check_guarantee_total(&self.ledger, name, None, guarantee)?;
        }
        let id = self.next_id();
        let name: Arc<str> = name.into();
        let book = ModelBook::new(name.clone(), limit, guarantee, priority);
        self.ledger.add(id, book).map_err(|room| {
            BookError::Invalid(format!(
                "model {name:?}: guarantee {guarantee} does not fit: {room} bytes of the global budget {} are neither used nor promised",
                self.ledger.global_limit
            ))
        })?;
        self.names.insert(name.clone(), id);
        self.models.insert(
            id,
            ModelEntry {
                name,
                conn,
                uid,
                orphaned: false,
                lease: None,
                chunks: BTreeSet::new(),
                in_use: 0,
                idle: 0,
                cached: 0,
            },
        );
        Ok(id)
    }

    /// The guarantees of the models `which` selects, added up.
    fn guarantees(&self, which: impl Fn(&ModelEntry) -> bool) -> u64 {
        self.models
            .iter()
            .filter(|(_, m)| which(m))
            .filter_map(|(k, _)| self.ledger.models.get(k))
            .fold(0u64, |sum, b| sum.saturating_add(b.guarantee))
    }

    /// Remove a model; returns its chunks, now moving, their charges credited.
    pub(crate) fn unregister(&mut self, model: u64) -> Vec<(u64, PhysicalChunk)> {
        let Some(m) = self.models.remove(&model) else {
            return Vec::new();
        };
        // An orphan's name may belong to a newer model by now.
        if self.names.get(&m.name) == Some(&model) {
            self.names.remove(&m.name);
        }
        let mut out = Vec::new();
        for cid in m.chunks {
            if let Some(e) = self.chunks.get_mut(&cid) {
                self.ledger.credit(model, e.chunk.size as u64);
                e.holder = Holder::Moving;
                out.push((cid, e.chunk));
            }
        }
        self.ledger.remove(model);
        out
    }

    /// Hand an idle chunk of exactly `size` bytes to `model`, if there is one and the model's
    /// limit allows; the chunk is then held by the model.
    pub(crate) fn hand_over(&mut self, model: u64, size: u64) -> Option<(u64, PhysicalChunk)> {
        let list = self.idle.get(&size)?;
        let at = list
            .iter()
            .rposition(|&c| !self.kept_for_other(c, Some(model)))?;
        let cid = list[at];
        // Both are invariants (idle chunks are in the table; the caller checked the model); if
        // one were broken the request is served by a new chunk instead of a broker panic.
        if !self.chunks.contains_key(&cid) || !self.models.contains_key(&model) {
            tracing::error!(
                chunk = cid,
                model,
                "broker book: idle chunk or model missing; no hand-over"
            );
            return None;
        }
        if !self.ledger.transfer(IDLE, model, size) {
            return None;
        }
        if let Some(list) = self.idle.get_mut(&size) {
            list.remove(at);
            if list.is_empty() {
                self.idle.remove(&size);
            }
        }
        self.idle_bytes -= size;
        let e = self.chunks.get_mut(&cid)?;
        e.holder = Holder::Model(model);
        e.reserved = None;
        let chunk = e.chunk;
        if let Some(m) = self.models.get_mut(&model) {
            m.chunks.insert(cid);
        }
        self.counters.handovers += 1;
        self.counters.grants += 1;
        Some((cid, chunk))
    }

    /// Whether `model`'s user may hold `size` bytes more: users other than the broker's and root
    /// are bounded by [`Policy::max_bytes_per_user`], counting every model of theirs (orphaned
    /// ones included, whose memory stays charged while their process lives).
    pub(crate) fn check_user_bytes(&self, model: u64, size: u64) -> Result<(), BookError> {
        let Some(uid) = self.models.get(&model).map(|m| m.uid) else {
            return Ok(());
        };
        if uid == self.policy.broker_uid || uid == 0 {
            return Ok(());
        }
        let held: u64 = self
            .models
            .iter()
            .filter(|(_, m)| m.uid == uid)
            .filter_map(|(id, _)| self.ledger.models.get(id))
            .map(|b| b.used)
            .fold(0u64, u64::saturating_add);
        let cap = self.policy.max_bytes_per_user;
        if held.checked_add(size).is_none_or(|t| t > cap) {
            return Err(BookError::Forbidden(format!(
                "model {model}: {size} bytes more refused: the models of user {uid} hold {held} bytes (orphaned ones included), {cap} allowed per user"
            )));
        }
        Ok(())
    }

    /// Record a chunk created for `model` (charged before).
    pub(crate) fn add_created(&mut self, model: u64, chunk: PhysicalChunk) -> u64 {
        let cid = self.next_id();
        self.chunks.insert(
            cid,
            ChunkEntry {
                chunk,
                holder: Holder::Model(model),
                reserved: None,
            },
        );
        if let Some(m) = self.models.get_mut(&model) {
            m.chunks.insert(cid);
        }
        self.counters.creates += 1;
        self.counters.grants += 1;
        cid
    }

    /// A chunk held by `model` comes back. It stays idle (for hand-over) if the budget lets the
    /// broker hold it; otherwise it is returned moving, for release.
    pub(crate) fn give_back(
        &mut self,
        conn: u64,
        model: u64,
        cid: u64,
    ) -> Result<Option<PhysicalChunk>, BookError> {
        self.own_model(conn, model)?;
        // Asked to give back and not answered yet: this may be what it gives for the asker
        // (of its oldest ticket: an engine serves its reclaim requests in order).
        let asker = self
            .tickets
            .iter()
            .filter(|(_, t)| t.model == model && t.freed.is_none())
            .min_by_key(|(&id, _)| id)
            .and_then(|(_, t)| t.asker);
        let Some(e) = self
            .chunks
            .get_mut(&cid)
            .filter(|e| e.holder == Holder::Model(model))
        else {
            return Err(BookError::Unknown(format!(
                "model {model} holds no chunk {cid}"
            )));
        };
        let size = e.chunk.size as u64;
        self.ledger.credit(model, size);
        let out = if self.ledger.try_charge(IDLE, size).is_ok() {
            e.holder = Holder::Idle;
            e.reserved = asker;
            self.idle.entry(size).or_default().push(cid);
            self.idle_bytes += size;
            None
        } else {
            e.holder = Holder::Moving;
            Some(e.chunk)
        };
        if let Some(m) = self.models.get_mut(&model) {
            m.chunks.remove(&cid);
        }
        self.counters.give_backs += 1;
        self.unkeep(model, cid);
        Ok(out)
    }

    /// Whether idle chunk `cid` is kept for another model than `model` (`None`: anyone): it
    /// was given back for that model's request, which is still under way (its ticket is in the
    /// book). Engines growing at once under pressure would otherwise take what was given back
    /// for each other (the donor's own growth first of all) until their rounds ran out.
    pub(crate) fn kept_for_other(&self, cid: u64, model: Option<u64>) -> bool {
        let Some(asker) = self.chunks.get(&cid).and_then(|e| e.reserved) else {
            return false;
        };
        model != Some(asker) && self.tickets.values().any(|t| t.asker == Some(asker))
    }

    /// Take idle chunks out (moving) until at least `bytes` are taken or none is left, largest
    /// first, leaving those kept for other models than `asker` ([`Book::kept_for_other`];
    /// `None`: none is left, as for the operator's trim); their charges stay on the idle line
    /// until [`Book::released`].
    pub(crate) fn take_idle(
        &mut self,
        bytes: u64,
        asker: Option<u64>,
    ) -> Vec<(u64, PhysicalChunk)> {
        let mut out = Vec::new();
        let mut got = 0u64;
        let sizes: Vec<u64> = self.idle.keys().rev().copied().collect();
        for size in sizes {
            if got >= bytes {
                break;
            }
            let Some(mut list) = self.idle.remove(&size) else {
                continue;
            };
            let mut kept = Vec::new();
            while let Some(cid) = list.pop() {
                if got >= bytes || (asker.is_some() && self.kept_for_other(cid, asker)) {
                    kept.push(cid);
                    continue;
                }
                let Some(e) = self.chunks.get_mut(&cid) else {
                    tracing::error!(
                        chunk = cid,
                        "broker book: idle chunk missing from the table"
                    );
                    continue;
                };
                e.holder = Holder::Moving;
                e.reserved = None;
                self.idle_bytes -= size;
                got += size;
                out.push((cid, e.chunk));
            }
            if !kept.is_empty() {
                kept.reverse();
                self.idle.insert(size, kept);
            }
        }
        out
    }

    /// A moving chunk was released to the driver: forget it; `charged_to` is the line still
    /// charged for it (the idle line), if any.
    pub(crate) fn released(&mut self, cid: u64, charged_to: Option<u64>) {
        if let Some(e) = self.chunks.remove(&cid) {
            debug_assert_eq!(e.holder, Holder::Moving);
            if let Some(line) = charged_to {
                self.ledger.credit(line, e.chunk.size as u64);
            }
            self.counters.releases += 1;
        }
    }

    /// A moving chunk whose release failed: it still exists, so it stays counted (leaked on
    /// the idle line, never handed out again).
    pub(crate) fn release_failed(&mut self, cid: u64, charged_to: Option<u64>) {
        if let Some(e) = self.chunks.remove(&cid) {
            let size = e.chunk.size as u64;
            if charged_to.is_some() {
                self.ledger.credit(IDLE, size);
            }
            self.ledger.leaked += size;
            self.ledger.used += size;
        }
    }

    /// A connection ended: every model it registered goes, with every chunk (returned moving,
    /// charges credited), and its reclaim tickets.
    #[cfg(test)]
    pub(crate) fn drop_conn(&mut self, conn: u64) -> Vec<(u64, PhysicalChunk)> {
        self.end_conn(conn, None)
    }

    /// A connection ended. `alive`: its process still lives (its pid and pidfd): then its models
    /// that hold chunks (or a lease) stay, orphaned (retired, chunks and charges kept: the
    /// process may still map them) until [`Book::reap`]; their names are freed, but for leased
    /// ones (`lease.rs`), which are waiting. Models holding nothing go. Otherwise (or when
    /// nothing is held) every model goes with every chunk (returned moving, charges credited),
    /// but for leased ones, which are held. Its reclaim tickets go either way.
    pub(crate) fn end_conn(
        &mut self,
        conn: u64,
        alive: Option<(i32, Arc<OwnedFd>)>,
    ) -> Vec<(u64, PhysicalChunk)> {
        self.conns.remove(&conn);
        self.tickets.retain(|_, t| t.conn != conn);
        let models: Vec<u64> = self
            .models
            .iter()
            .filter(|(_, m)| m.conn == conn && !m.orphaned)
            .map(|(&k, _)| k)
            .collect();
        let mut out = Vec::new();
        let mut kept = Vec::new();
        let expires = self.lease_expiry();
        for m in models {
            let (holds, leased) = self.models.get(&m).map_or((false, false), |e| {
                (!e.chunks.is_empty(), e.lease.is_some())
            });
            match &alive {
                Some(_) if holds || leased => {
                    if let Some(e) = self.models.get_mut(&m) {
                        e.orphaned = true;
                        match e.lease.as_mut() {
                            Some(l) => l.state = LeaseState::Waiting,
                            None => {
                                let name = e.name.clone();
                                self.names.remove(&name);
                            }
                        }
                    }
                    self.ledger.retire(m);
                    kept.push(m);
                }
                _ if leased => out.extend(self.hold(m, expires)),
                _ => out.extend(self.unregister(m)),
            }
        }
        if let (Some((pid, pidfd)), false) = (alive, kept.is_empty()) {
            self.counters.orphaned_connections += 1;
            self.orphans.push(Orphan {
                conn,
                pid,
                pidfd,
                models: kept,
            });
        }
        if !out.is_empty() {
            self.counters.dead_engines += 1;
            self.counters.chunks_recovered += out.len() as u64;
        }
        out
    }

    /// The process of orphaned connection `conn` is gone: its models go, with their chunks
    /// (returned moving, charges credited), but for leased ones, which are held.
    pub(crate) fn reap(&mut self, conn: u64) -> Vec<(u64, PhysicalChunk)> {
        let Some(i) = self.orphans.iter().position(|o| o.conn == conn) else {
            return Vec::new();
        };
        let orphan = self.orphans.swap_remove(i);
        let expires = self.lease_expiry();
        let mut out = Vec::new();
        for m in orphan.models {
            if self.models.get(&m).is_some_and(|e| e.lease.is_some()) {
                out.extend(self.hold(m, expires));
            } else {
                out.extend(self.unregister(m));
            }
        }
        self.counters.dead_engines += 1;
        self.counters.chunks_recovered += out.len() as u64;
        out
    }

    /// The lines a growth of `asker` may take from, for the budget engine: the idle line (what
    /// it holds, less what is kept for other requests), and every model whose connection is
    /// open (what it could give only its engine knows; the asker itself is left out by the
    /// engine). The asking connection's other models are reachable too: an engine's give-backs
    /// and reclaim answers are served while its own growth waits (`server.rs`,
    /// `answered_at_once`).
    pub(crate) fn reachable(&self, asker: u64) -> Vec<(u64, u64)> {
        let kept: u64 = if self.tickets.values().any(|t| t.asker.is_some()) {
            self.idle
                .iter()
                .map(|(&size, list)| {
                    size * list
                        .iter()
                        .filter(|&&c| self.kept_for_other(c, Some(asker)))
                        .count() as u64
                })
                .sum()
        } else {
            0
        };
        std::iter::once((IDLE, self.idle_bytes.saturating_sub(kept)))
            .chain(
                self.models
                    .iter()
                    // Orphaned and held models have no engine to ask.
                    .filter(|(_, m)| !m.orphaned && m.conn != 0)
                    .map(|(&k, _)| (k, u64::MAX)),
            )
            .collect()
    }

    pub(crate) fn refusal(&self, model: u64, bytes: u64, why: LedgerRefusal) -> Refusal {
        let b = self.ledger.models.get(&model);
        Refusal {
            model: b.map_or_else(String::new, |m| m.id.to_string()),
            requested: bytes,
            cause: match why {
                LedgerRefusal::ModelLimit => RefusalCause::ModelLimit,
                LedgerRefusal::Global { .. } => RefusalCause::Global,
                LedgerRefusal::Retired => RefusalCause::Retired,
                // The broker answers a policy refusal with its own error (Forbidden); this
                // cause is the nearest should one ever reach here.
                LedgerRefusal::Policy => RefusalCause::Global,
            },
            model_used: b.map_or(0, |m| m.used),
            model_limit: b.map_or(0, |m| m.limit.min(m.cap)),
            global_used: self.ledger.used,
            global_limit: self.ledger.global_limit,
            reserved_for_others: self.ledger.reserved_for_others(model),
        }
    }

    /// Engines and models; an engine connection sees itself and its own models only.
    pub(crate) fn view(&self, viewer: Option<u64>) -> (Vec<EngineInfo>, Vec<ModelInfo>) {
        let now = Instant::now();
        let engines = self
            .conns
            .iter()
            .filter(|(&id, _)| viewer.is_none_or(|v| v == id))
            .map(|(&id, c)| EngineInfo {
                id,
                name: c.name.clone(),
                role: c.role,
                peer: c.peer,
            })
            .collect();
        let models = self
            .models
            .iter()
            .filter(|(_, m)| viewer.is_none_or(|v| v == m.conn))
            .filter_map(|(&id, m)| {
                let b = self.ledger.models.get(&id)?;
                Some(ModelInfo {
                    id,
                    name: m.name.to_string(),
                    engine: m.conn,
                    limit: b.limit,
                    guarantee: b.guarantee,
                    priority: b.priority,
                    used: b.used,
                    peak: b.peak,
                    chunks: m.chunks.len() as u64,
                    refusals: b.refusals,
                    reclaimed: b.reclaimed,
                    in_use: m.in_use,
                    idle: m.idle,
                    cached: m.cached,
                    orphaned: m.orphaned,
                    lease: self.lease_info(id, now),
                })
            })
            .collect();
        (engines, models)
    }

    /// The books against themselves: the ledger's rules, and every charge against the chunks.
    pub(crate) fn audit(&self) -> Result<(), String> {
        self.ledger.audit()?;
        let idle_line = self.ledger.models.get(&IDLE).map_or(0, |m| m.used);
        for (&k, m) in &self.models {
            let held: u64 = m
                .chunks
                .iter()
                .filter_map(|c| self.chunks.get(c))
                .map(|e| e.chunk.size as u64)
                .sum();
            let charged = self.ledger.models.get(&k).map_or(0, |b| b.used);
            // A charge may run ahead of its chunk only while that chunk is being created.
            if held > charged {
                return Err(format!(
                    "model {} holds {held} bytes of chunks but is charged {charged}",
                    m.name
                ));
            }
        }
        if self.idle_bytes > idle_line {
            return Err(format!(
                "idle chunks hold {} bytes, the idle line is charged {idle_line}",
                self.idle_bytes
            ));
        }
        Ok(())
    }
}

/// Names: 1 to [`MAX_NAME`] bytes, printable, no whitespace.
pub(crate) fn check_name(what: &str, name: &str) -> Result<(), BookError> {
    if name.is_empty()
        || name.len() > MAX_NAME
        || name.chars().any(|c| c.is_control() || c.is_whitespace())
    {
        return Err(BookError::Invalid(format!(
            "{what} {name:?} must be 1 to {MAX_NAME} bytes of printable characters without spaces ({} bytes given)",
            name.len()
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The broker runs as uid 0 here; caps generous unless a test says otherwise.
    fn policy() -> Policy {
        Policy {
            broker_uid: 0,
            max_models_per_user: 32,
            max_guarantee_total: None,
            max_guarantee_per_user: None,
            max_priority_per_user: 0,
            max_bytes_per_user: u64::MAX,
        }
    }

    fn chunk(raw: u64, size: usize) -> PhysicalChunk {
        PhysicalChunk { raw, size }
    }

    #[test]
    fn hand_over_moves_charge_without_touching_the_global_use() {
        let mut b = Book::new(100, policy());
        let a = b.register(1, 0, "a", 60, 0, 0).unwrap();
        let c = b.register(2, 0, "c", 60, 0, 0).unwrap();
        b.ledger.try_charge(a, 40).unwrap();
        let cid = b.add_created(a, chunk(7, 40));
        assert_eq!(
            b.give_back(2, a, cid),
            Err(BookError::Unknown(format!(
                "no model {a} registered by this connection"
            )))
        );
        assert_eq!(b.give_back(1, a, cid).unwrap(), None);
        assert_eq!(b.idle_bytes, 40);
        let used = b.ledger.used;
        let (got, ch) = b.hand_over(c, 40).unwrap();
        assert_eq!((got, ch.raw), (cid, 7));
        assert_eq!(b.ledger.used, used);
        assert_eq!(b.counters.handovers, 1);
        b.audit().unwrap();
        // The other model's limit still holds for handed-over chunks.
        b.ledger.try_charge(c, 20).unwrap();
        assert_eq!(b.ledger.try_charge(c, 1), Err(LedgerRefusal::ModelLimit));
        let gone = b.drop_conn(2);
        assert_eq!(gone.len(), 1);
        assert_eq!(b.ledger.models[&IDLE].used, 0);
        assert!(b.register(3, 0, "a b", 1, 0, 0).is_err());
        assert!(b.register(3, 0, "", 1, 0, 0).is_err());
        assert!(b.register(3, 0, "x", 1, 2, 0).is_err());
        assert!(matches!(
            b.register(3, 0, "a", 1, 0, 0),
            Err(BookError::Duplicate(_))
        ));
    }

    #[test]
    fn broker_donors_skip_the_asker_and_guarantees() {
        let mut b = Book::new(1000, policy());
        let lo = b.register(1, 0, "lo", 500, 100, -1).unwrap();
        let hi = b.register(2, 0, "hi", 500, 0, 5).unwrap();
        let mine = b.register(3, 0, "mine", 500, 0, -9).unwrap();
        let me = b.register(3, 0, "me", 500, 0, -20).unwrap();
        b.ledger.try_charge(lo, 300).unwrap();
        b.ledger.try_charge(hi, 300).unwrap();
        b.ledger.try_charge(mine, 300).unwrap();
        b.ledger.try_charge(me, 50).unwrap();
        // The asker's own connection's other model gives too: its engine's give-backs are
        // served while the asker's growth waits.
        let donors = crate::budget::donors(&b.ledger, me, &b.reachable(me));
        let plan = crate::budget::plan(&donors, 600);
        let plan: Vec<(u64, u64)> = plan.iter().map(|a| (a.key, a.bytes)).collect();
        assert_eq!(plan, vec![(mine, 300), (lo, 200), (hi, 100)]);
    }

    /// Issue 33, defect 11: with no cap set, the operator's user may hold guarantees up to the
    /// global limit, and a guarantee above it is refused by the policy with those numbers.
    #[test]
    fn guarantee_caps_default_to_the_global_limit() {
        let mut b = Book::new(1000, policy());
        b.register(1, 0, "g", 100, 32, 0).unwrap();
        let e = b.register(1, 0, "max", u64::MAX, u64::MAX, 0).unwrap_err();
        assert!(
            matches!(&e, BookError::Forbidden(m) if m.contains("guarantee 18446744073709551615 refused") && m.contains("hold guarantees of 32 bytes, 1000 allowed per user")),
            "{e:?}"
        );
        let e = b.register(1, 0, "tib", 1 << 40, 1 << 40, 0).unwrap_err();
        assert!(
            matches!(&e, BookError::Forbidden(m) if m.contains("1000 allowed per user")),
            "{e:?}"
        );
        // Within the global limit but not beside the others: the ledger says how much room
        // is left.
        let e = b.register(1, 0, "more", 1000, 990, 0).unwrap_err();
        assert!(
            matches!(&e, BookError::Invalid(m) if m.contains("guarantee 990 does not fit: 968 bytes of the global budget 1000")),
            "{e:?}"
        );
        b.audit().unwrap();
    }

    #[test]
    fn caps_per_user_and_guarantee_policy() {
        let mut b = Book::new(
            1000,
            Policy {
                max_models_per_user: 2,
                max_guarantee_total: Some(600),
                ..policy()
            },
        );
        // Another user: no guarantee by default, two models at most.
        let e = b.register(9, 7, "g", 500, 500, 0).unwrap_err();
        assert!(
            matches!(&e, BookError::Forbidden(m) if m.contains("guarantee 500 refused") && m.contains("0 allowed per user")),
            "{e:?}"
        );
        b.register(9, 7, "a", 10, 0, 0).unwrap();
        b.register(9, 7, "b", 10, 0, 0).unwrap();
        let e = b.register(9, 7, "c", 10, 0, 0).unwrap_err();
        assert!(
            matches!(&e, BookError::Forbidden(m) if m.contains("user 7 has 2 models registered, 2 allowed per user")),
            "{e:?}"
        );
        // The broker's own user: guarantees up to the policy's total.
        b.register(1, 0, "own", 1000, 400, 0).unwrap();
        let e = b.register(1, 0, "own2", 1000, 300, 0).unwrap_err();
        assert!(
            matches!(&e, BookError::Forbidden(m) if m.contains("hold guarantees of 400 bytes, 600 allowed in all")),
            "{e:?}"
        );
        b.register(1, 0, "own2", 1000, 200, 0).unwrap();
        // A per-user cap given by the operator applies to every user.
        b.policy.max_guarantee_per_user = Some(50);
        b.drop_conn(9);
        b.register(9, 7, "small", 100, 0, 0).unwrap();
        let e = b.register(9, 7, "big", 100, 51, 0).unwrap_err();
        assert!(
            matches!(&e, BookError::Forbidden(m) if m.contains("50 allowed per user")),
            "{e:?}"
        );
        // Peer numbers at the edge do not overflow.
        let e = b.register(9, 7, "max", u64::MAX, u64::MAX, 0).unwrap_err();
        assert!(matches!(e, BookError::Forbidden(_)), "{e:?}");
        b.audit().unwrap();
    }

    /// Issue 33, defect 6: users other than the broker's and root register at most at the
    /// policy's priority (0 by default); the operator's users at any.
    #[test]
    fn priorities_are_capped_per_user() {
        let mut b = Book::new(
            1000,
            Policy {
                broker_uid: 1,
                ..policy()
            },
        );
        let e = b.register(9, 7, "high", 10, 0, i32::MAX).unwrap_err();
        assert!(
            matches!(&e, BookError::Forbidden(m) if m.contains("priority 2147483647 refused: 0 allowed per user")),
            "{e:?}"
        );
        b.register(9, 7, "at", 10, 0, 0).unwrap();
        b.register(9, 7, "low", 10, 0, i32::MIN).unwrap();
        b.register(1, 0, "root", 10, 0, i32::MAX).unwrap();
        b.register(2, 1, "broker's", 10, 0, i32::MAX).unwrap();
        b.policy.max_priority_per_user = 5;
        b.register(9, 7, "five", 10, 0, 5).unwrap();
        let e = b.register(9, 7, "six", 10, 0, 6).unwrap_err();
        assert!(
            matches!(&e, BookError::Forbidden(m) if m.contains("priority 6 refused: 5 allowed per user")),
            "{e:?}"
        );
        b.audit().unwrap();
    }
}
