//! The broker's wire protocol: what engines and operators send, what the broker answers.
//!
//! Every frame holds one [`ToBroker`] or [`FromBroker`] message (postcard, see
//! [`crate::ipc::codec`]). Requests carry an id the reply repeats; the broker may also push
//! [`Push`] messages (reclaim requests) at any time. A granted chunk travels as the one
//! descriptor attached to its [`Reply::Granted`] frame. Numbers on the wire are checked by the
//! receiver (sizes against the granularity and the limits, ids against the sender's own
//! models and chunks); nothing is trusted because it decoded.

use serde::{Deserialize, Serialize};

use crate::ipc::PeerCredentials;

/// Version of this protocol; a peer with another version is refused at [`Request::Hello`].
pub const PROTOCOL_VERSION: u32 = 5;

/// Most chunks one [`Request::GrowMany`] asks for, and most ids one [`Request::GiveBackMany`]
/// carries: one frame holds at most [`crate::ipc::MAX_FDS`] descriptors.
pub const MAX_BATCH: u32 = crate::ipc::MAX_FDS as u32;

/// Longest model or engine name, in bytes.
pub const MAX_NAME: usize = 64;

/// Most chunks one [`Request::Keep`] names (a frame holds them with room to spare).
pub const MAX_KEEP: usize = 2048;

/// Most kept regions one lease holds.
pub const MAX_KEPT_REGIONS: usize = 16;

/// Longest blob an engine stores with its lease ([`Request::StoreBlob`]), in bytes: with the
/// regions' names it fits one frame of [`Reply::Attached`].
pub const MAX_BLOB: usize = 48 << 10;

/// Most models registered on one broker (keeps a snapshot within one frame).
pub const MAX_MODELS: usize = 128;

/// Most connections served at once, counted from accept (those still to say hello included).
pub const MAX_CONNECTIONS: usize = 128;

/// What a connection is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Role {
    /// An engine: registers models and maps chunks.
    Engine,
    /// An operator's tool (`ctl`, `top`, metrics): reads and changes settings, holds no memory.
    Control,
}

/// A message to the broker.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ToBroker {
    /// Repeated in the reply.
    pub id: u64,
    /// The request.
    pub request: Request,
}

/// What can be asked of the broker.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Request {
    /// First message of every connection.
    Hello {
        /// [`PROTOCOL_VERSION`].
        version: u32,
        /// What the connection is for.
        role: Role,
        /// A name for reports (the engine's).
        name: String,
    },
    /// Register a model of this engine.
    Register {
        /// Unique on the broker.
        model: String,
        /// Physical limit in bytes.
        limit: u64,
        /// Guaranteed bytes (at most the limit).
        guarantee: u64,
        /// Reclaim order: lower priorities give back first.
        priority: i32,
    },
    /// Unregister one of this engine's models; its chunks go back to the broker.
    Unregister {
        /// The id [`Reply::Registered`] gave.
        model: u64,
    },
    /// One more physical chunk of `size` bytes for `model` (charged before anything is made).
    Grow {
        /// The model.
        model: u64,
        /// Chunk size, a multiple of the granularity.
        size: u64,
    },
    /// `count` (1 to [`MAX_BATCH`]) chunks of `size` bytes each for `model`, in one reply
    /// ([`Reply::GrantedMany`]): all or none.
    GrowMany {
        /// The model.
        model: u64,
        /// Chunk size, a multiple of the granularity.
        size: u64,
        /// How many chunks.
        count: u32,
        /// Growth ahead of need: served only from idle chunks or free budget, never by asking
        /// other engines to give back.
        look_ahead: bool,
    },
    /// Chunks this engine unmapped and released go back to the broker (at most
    /// [`MAX_BATCH`] ids); ids it does not hold are reported, the others still go back.
    GiveBackMany {
        /// The model holding them.
        model: u64,
        /// The chunks' ids.
        chunks: Vec<u64>,
    },
    /// A chunk this engine unmapped and released goes back to the broker.
    GiveBack {
        /// The model holding it.
        model: u64,
        /// The chunk's id from [`Reply::Granted`].
        chunk: u64,
    },
    /// Answer to a [`Push::Reclaim`].
    ReclaimDone {
        /// The push's ticket.
        ticket: u64,
        /// Bytes the engine gave back for it.
        freed: u64,
    },
    /// What the engine's pools hold, for the operator's view (no effect on admission).
    Report {
        /// The model.
        model: u64,
        /// Bytes held by live allocations and mapped ranges.
        in_use: u64,
        /// Mapped bytes not in use.
        idle: u64,
        /// Bytes in the pool's chunk cache.
        cached: u64,
    },
    /// Every engine and model, and the broker's counters.
    Snapshot,
    /// Change a model's limit (control connections).
    SetLimit {
        /// The model's name.
        model: String,
        /// New limit in bytes.
        limit: u64,
        /// How long the owning engine has to give memory back.
        deadline_ms: u64,
    },
    /// Change a model's guarantee (control connections).
    SetGuarantee {
        /// The model's name.
        model: String,
        /// New guarantee in bytes.
        guarantee: u64,
    },
    /// Release the broker's idle chunks to the driver, the host tier's too (control
    /// connections).
    Trim,
    /// Prometheus text exposition of the broker's metrics.
    Metrics,
    /// The request inside, about the broker's host tier instead of its device: host models
    /// with their own limits, guarantees and chunks (host memory exported as descriptors),
    /// under the host budget, with the same rules (and the same roles) as device memory.
    /// Refused by a broker without a host tier, and for a hello or another `HostTier` inside.
    /// A [`Request::Snapshot`] inside answers the host tier's view (its backend and budget).
    /// Decoding refuses a `HostTier` inside a `HostTier` (no recursion a peer can deepen).
    HostTier(#[serde(deserialize_with = "one_level")] Box<Request>),
    /// Put one of this engine's models under a lease ([`Reply::Leased`]): from now on, when
    /// the connection ends without unregistering it (a crash, or an exit that keeps it), its
    /// kept regions ([`Request::Keep`]) and blob stay at the broker, charged to it, for the
    /// broker's grace period, and an engine of the same user presenting the token takes them
    /// back ([`Request::Attach`]). Asked again, it answers a new token; the old one is void.
    Lease {
        /// The model.
        model: u64,
    },
    /// Keep a region of a leased model across its engine's end: the model's `chunks`, each at
    /// its offset from the region's start, within `len` bytes, under the region's tag (at
    /// most [`MAX_KEEP`] chunks a message: `append` adds to the region of that tag, else the
    /// message replaces it). A chunk given back later drops its region from the lease.
    Keep {
        /// The model.
        model: u64,
        /// The region's tag (a name, as for models).
        tag: String,
        /// The region's length in bytes.
        len: u64,
        /// The chunks and where they lie in the region.
        chunks: Vec<KeptChunk>,
        /// Add to the region kept under `tag` rather than replace it.
        append: bool,
    },
    /// Stop keeping the region of `tag` (its chunks stay the model's).
    Forget {
        /// The model.
        model: u64,
        /// The region's tag.
        tag: String,
    },
    /// Store `blob` (at most [`MAX_BLOB`] bytes: the engine's block tables, tensor names and
    /// offsets...) with the lease, replacing the last one; the next engine gets it back.
    StoreBlob {
        /// The model.
        model: u64,
        /// The bytes.
        blob: Vec<u8>,
    },
    /// Take over a leased model whose engine is gone ([`Reply::Attached`]): the same user, the
    /// lease's token, within its grace period. The model is this connection's from then on;
    /// its kept chunks come with [`Request::TakeKept`]. The token stays the lease's until the
    /// engine asks for a new one ([`Request::Lease`], which an attach that succeeded does), so
    /// an engine that dies half way leaves the lease held under it.
    Attach {
        /// The model's name.
        model: String,
        /// The lease's token.
        token: LeaseToken,
    },
    /// Give a model this connection attached back to its lease, held again under the same
    /// token (an attach that failed in the engine, which unmapped everything it took first).
    Detach {
        /// The model.
        model: u64,
    },
    /// The descriptors of the chunks `from..from + count` (at most [`MAX_BATCH`]) of the kept
    /// region `tag` of a model this connection attached ([`Reply::KeptChunks`]).
    TakeKept {
        /// The model.
        model: u64,
        /// The region's tag.
        tag: String,
        /// The first chunk, in offset order.
        from: u32,
        /// How many.
        count: u32,
    },
}

/// A lease's secret (32 random bytes): whoever holds it, as the lease's user, can re-attach
/// the model. Shown as 64 hex digits; `Debug` does not show it.
#[derive(Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct LeaseToken(pub [u8; 32]);

impl std::fmt::Debug for LeaseToken {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("LeaseToken(..)")
    }
}

impl std::fmt::Display for LeaseToken {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.0.iter().try_for_each(|b| write!(f, "{b:02x}"))
    }
}

impl std::str::FromStr for LeaseToken {
    type Err = crate::Error;
    fn from_str(s: &str) -> crate::Result<LeaseToken> {
        let s = s.trim();
        let bad = || {
            crate::Error::InvalidArgument(format!(
                "a lease token is 64 hex digits, got {} characters",
                s.len()
            ))
        };
        if s.len() != 64 || !s.is_ascii() {
            return Err(bad());
        }
        let mut out = [0u8; 32];
        for (i, b) in out.iter_mut().enumerate() {
            *b = u8::from_str_radix(&s[2 * i..2 * i + 2], 16).map_err(|_| bad())?;
        }
        Ok(LeaseToken(out))
    }
}

impl LeaseToken {
    /// Compare in time independent of where the tokens differ.
    pub(crate) fn matches(&self, other: &LeaseToken) -> bool {
        self.0
            .iter()
            .zip(other.0.iter())
            .fold(0u8, |acc, (a, b)| acc | (a ^ b))
            == 0
    }
}

/// One chunk of a kept region: the broker's chunk id and its offset in the region.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct KeptChunk {
    /// The chunk's id from its grant.
    pub chunk: u64,
    /// Where it lies, from the region's start.
    pub offset: u64,
}

/// A kept region, as [`Reply::Attached`] lists it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct KeptRegionInfo {
    /// Its tag.
    pub tag: String,
    /// Its length in bytes.
    pub len: u64,
    /// Its chunks ([`Request::TakeKept`] in offset order).
    pub chunks: u32,
    /// The bytes of those chunks.
    pub bytes: u64,
}

/// What [`Request::Attach`] gives the new engine.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Attachment {
    /// The model's id, for later requests.
    pub model: u64,
    /// Its limit, guarantee and priority, as registered.
    pub limit: u64,
    /// See `limit`.
    pub guarantee: u64,
    /// See `limit`.
    pub priority: i32,
    /// The kept regions.
    pub regions: Vec<KeptRegionInfo>,
    /// The blob the last engine stored.
    pub blob: Vec<u8>,
}

/// Where a model's lease stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum LeaseState {
    /// Its engine is connected; the lease holds if the connection ends.
    Armed,
    /// The connection ended while its process lived: held once that process is gone.
    Waiting,
    /// No engine: the kept memory waits for one to attach, until the grace period ends.
    Held,
}

/// A model's lease, as the broker's view shows it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LeaseInfo {
    /// Where it stands.
    pub state: LeaseState,
    /// Kept regions.
    pub regions: u32,
    /// Bytes of their chunks.
    pub kept: u64,
    /// Bytes of the stored blob.
    pub blob: u64,
    /// Time left before a held lease ends, in milliseconds.
    pub expires_in_ms: Option<u64>,
}

std::thread_local! {
    /// Whether this thread is decoding the inside of a [`Request::HostTier`].
    static IN_HOST_TIER: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Decode the request inside a [`Request::HostTier`], refusing another one inside it: a
/// message of nested wrappers would otherwise recurse as deep as a frame is long.
fn one_level<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Box<Request>, D::Error> {
    struct Inside;
    impl Drop for Inside {
        fn drop(&mut self) {
            IN_HOST_TIER.with(|f| f.set(false));
        }
    }
    if IN_HOST_TIER.with(|f| f.replace(true)) {
        return Err(serde::de::Error::custom(
            "a host-tier request inside a host-tier request",
        ));
    }
    let _inside = Inside;
    Request::deserialize(d).map(Box::new)
}

/// A message from the broker.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum FromBroker {
    /// The answer to request `id`.
    Reply {
        /// The request's id.
        id: u64,
        /// The answer.
        reply: Reply,
    },
    /// Something the broker asks of the engine.
    Push(Push),
}

/// What the broker pushes to engines.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Push {
    /// Give back `bytes` of `model`'s idle memory (then ask the model's reclaim callback),
    /// within `deadline_ms`; answer with [`Request::ReclaimDone`].
    Reclaim {
        /// Repeated in the answer.
        ticket: u64,
        /// The model.
        model: u64,
        /// Bytes wanted.
        bytes: u64,
        /// Time allowed.
        deadline_ms: u64,
    },
}

/// What the broker's backend is: the engine maps chunks with the same kind of backend.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BackendDesc {
    /// `"host"` or `"cuda"`.
    pub name: String,
    /// CUDA device ordinal.
    pub device_ordinal: Option<i32>,
    /// Chunk sizes are multiples of this.
    pub granularity: u64,
    /// Device name.
    pub device_name: String,
    /// Whether a chunk the broker creates reads as zeros ([`crate::Backend::creates_zeroed`]
    /// of its device backend): a granted chunk that was created, not handed over, then needs
    /// no clearing. Host-tier chunks are always cleared.
    #[serde(default)]
    pub creates_zeroed: bool,
}

/// Answers.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Reply {
    /// Hello accepted.
    Welcome {
        /// The broker's process id.
        broker_pid: u32,
        /// The broker's backend.
        backend: BackendDesc,
        /// The global budget.
        global_limit: u64,
        /// Id of this connection.
        engine: u64,
    },
    /// The model's id.
    Registered {
        /// Use it in later requests.
        model: u64,
    },
    /// A chunk: its descriptor is attached to this frame.
    Granted {
        /// Give it back with this id.
        chunk: u64,
        /// Its size.
        size: u64,
        /// Whether it was handed over (made earlier, given back by someone) rather than created.
        handed_over: bool,
    },
    /// Chunks for a [`Request::GrowMany`]: their descriptors are attached to this frame, in
    /// the order of the ids.
    GrantedMany {
        /// Give them back with these ids.
        chunks: Vec<u64>,
        /// The size of each.
        size: u64,
        /// How many were handed over (made earlier) rather than created.
        handed_over: u32,
    },
    /// Done.
    Done,
    /// A growth was refused: the numbers.
    Refused(Refusal),
    /// A limit or guarantee change, as far as it got.
    Changed(ChangeOutcome),
    /// Bytes of idle chunks released by [`Request::Trim`].
    Trimmed {
        /// Bytes released.
        released: u64,
    },
    /// Every engine and model.
    Snapshot(Box<Snapshot>),
    /// A lease armed ([`Request::Lease`]): its token, and how long the broker holds its memory
    /// once the engine is gone.
    Leased {
        /// The token a later engine presents.
        token: LeaseToken,
        /// The grace period.
        grace_ms: u64,
    },
    /// A leased model attached ([`Request::Attach`]).
    Attached(Box<Attachment>),
    /// Kept chunks ([`Request::TakeKept`]): their descriptors are attached to this frame, in
    /// order; each chunk is the model's as if granted.
    KeptChunks {
        /// Each chunk and its offset in the region.
        chunks: Vec<KeptChunk>,
        /// The size of each.
        sizes: Vec<u64>,
    },
    /// Prometheus text.
    Metrics(String),
    /// The request failed; for a malformed message the connection is closed after this.
    Error {
        /// What kind of failure.
        kind: ErrorKind,
        /// Why, with the numbers.
        message: String,
    },
}

/// Kinds of failure the broker reports.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum ErrorKind {
    /// The frame or message could not be decoded; the connection is closed.
    Malformed,
    /// A number or name is invalid.
    InvalidArgument,
    /// No such model or chunk (of this connection's).
    Unknown,
    /// A model of that name exists.
    Duplicate,
    /// Not allowed for this connection's role.
    Forbidden,
    /// A limit or guarantee could not be reached.
    NotReached,
    /// The driver failed.
    Backend,
    /// Held by another engine or process right now (a lease attached elsewhere, or whose
    /// previous engine still lives).
    Busy,
}

/// Why a growth was refused, with every number.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Refusal {
    /// The model.
    pub model: String,
    /// Bytes asked for.
    pub requested: u64,
    /// What refused it.
    pub cause: RefusalCause,
    /// The model's use.
    pub model_used: u64,
    /// The model's (effective) limit.
    pub model_limit: u64,
    /// Global use.
    pub global_used: u64,
    /// Global limit.
    pub global_limit: u64,
    /// Unused guarantees of the other models.
    pub reserved_for_others: u64,
}

/// What refused a growth.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum RefusalCause {
    /// The model's limit.
    ModelLimit,
    /// The global budget.
    Global,
    /// The model is unregistered.
    Retired,
}

impl RefusalCause {
    /// As worded in [`crate::Error::AdmissionRefused`].
    pub fn describe(self) -> &'static str {
        match self {
            RefusalCause::ModelLimit => "the model's limit",
            RefusalCause::Global => "the global budget",
            RefusalCause::Retired => "the model is unregistered",
        }
    }
}

/// How a limit or guarantee change went.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChangeOutcome {
    /// The model.
    pub model: String,
    /// The limit now.
    pub limit: u64,
    /// The guarantee now.
    pub guarantee: u64,
    /// Its use now.
    pub used: u64,
    /// Bytes given back while changing.
    pub reclaimed: u64,
}

/// One engine connection.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct EngineInfo {
    /// Connection id.
    pub id: u64,
    /// Its name from Hello.
    pub name: String,
    /// Engine or control.
    pub role: Role,
    /// `SO_PEERCRED` at connect.
    pub peer: PeerCredentials,
}

/// One model, as the broker sees it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ModelInfo {
    /// Model id.
    pub id: u64,
    /// Name.
    pub name: String,
    /// Owning connection.
    pub engine: u64,
    /// Limit.
    pub limit: u64,
    /// Guarantee.
    pub guarantee: u64,
    /// Priority.
    pub priority: i32,
    /// Bytes charged (chunks granted and not given back).
    pub used: u64,
    /// Highest use.
    pub peak: u64,
    /// Chunks held.
    pub chunks: u64,
    /// Growths refused.
    pub refusals: u64,
    /// Bytes given back on reclaim requests and limit changes.
    pub reclaimed: u64,
    /// Last report of the engine: bytes in use.
    pub in_use: u64,
    /// Last report: idle mapped bytes.
    pub idle: u64,
    /// Last report: cached bytes.
    pub cached: u64,
    /// Its engine's connection ended while the engine's process lived: its chunks (perhaps
    /// still mapped there) stay charged until that process is gone; it grows no more and its
    /// name is free.
    pub orphaned: bool,
    /// Its lease, if it has one.
    pub lease: Option<LeaseInfo>,
}

/// The broker's counters.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct BrokerCounters {
    /// Chunks created with the driver.
    pub creates: u64,
    /// Chunks released to the driver.
    pub releases: u64,
    /// Chunks granted (created or handed over).
    pub grants: u64,
    /// Grants of chunks given back earlier (no create).
    pub handovers: u64,
    /// Chunks given back by engines.
    pub give_backs: u64,
    /// Growths refused.
    pub refusals: u64,
    /// Reclaim requests pushed to engines.
    pub reclaim_requests: u64,
    /// Connections that ended with memory still held (crashed or killed engines).
    pub dead_engines: u64,
    /// Chunks taken back from them.
    pub chunks_recovered: u64,
    /// Malformed or oversized messages (their connections were closed).
    pub malformed: u64,
    /// Connections refused (credentials, version, caps, no hello in time).
    pub refused_connections: u64,
    /// Connection threads that panicked (their memory was taken back, the connection closed).
    pub panics: u64,
    /// Connections that ended with memory held while their process lived: that memory stays
    /// charged (orphaned models) until the process is gone.
    pub orphaned_connections: u64,
    /// Sum of grant latencies (request read to reply queued), microseconds.
    pub grant_micros: u64,
    /// Leases armed.
    pub leases: u64,
    /// Leases whose engine ended and whose memory the broker held.
    pub leases_held: u64,
    /// Held leases an engine attached.
    pub reattaches: u64,
    /// Held leases whose grace period ended (their memory went back).
    pub leases_expired: u64,
    /// Attaches refused (wrong token, wrong user, no such lease, busy).
    pub attach_refusals: u64,
}

/// Everything the broker knows, at one instant.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Snapshot {
    /// The broker's process id.
    pub broker_pid: u32,
    /// Its backend.
    pub backend: BackendDesc,
    /// Global budget.
    pub global_limit: u64,
    /// Bytes charged in all (models and idle chunks).
    pub global_used: u64,
    /// Bytes of idle chunks the broker holds for hand-over.
    pub idle: u64,
    /// Physical bytes the broker's backend holds (host: measured from the chunk files).
    pub physical: u64,
    /// Connections.
    pub engines: Vec<EngineInfo>,
    /// Models.
    pub models: Vec<ModelInfo>,
    /// Counters.
    pub counters: BrokerCounters,
    /// The ledger's self-check: `None` when the books balance.
    pub audit: Option<String>,
    /// The host tier's own view (its backend, host budget, host models and counters), when
    /// the broker has one; `None` inside that view.
    pub host_tier: Option<Box<Snapshot>>,
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ipc::{decode, encode};

    /// A bounded fuzz run of the decoder: mutated, truncated and extended encodings of every
    /// kind of request never panic; what decodes re-encodes to a valid message.
    #[test]
    fn the_decoder_survives_mutated_input() {
        let samples: Vec<Vec<u8>> = [
            Request::Hello {
                version: PROTOCOL_VERSION,
                role: Role::Engine,
                name: "e".into(),
            },
            Request::Register {
                model: "m".into(),
                limit: 1 << 40,
                guarantee: 3,
                priority: -7,
            },
            Request::Unregister { model: 9 },
            Request::Grow {
                model: 1,
                size: 2 << 20,
            },
            Request::GiveBack {
                model: 1,
                chunk: u64::MAX,
            },
            Request::GrowMany {
                model: 1,
                size: 1 << 30,
                count: 16,
                look_ahead: true,
            },
            Request::GiveBackMany {
                model: 1,
                chunks: vec![1, 2, u64::MAX],
            },
            Request::ReclaimDone {
                ticket: 4,
                freed: 5,
            },
            Request::Report {
                model: 1,
                in_use: 2,
                idle: 3,
                cached: 4,
            },
            Request::Snapshot,
            Request::SetLimit {
                model: "m".into(),
                limit: 1,
                deadline_ms: 2,
            },
            Request::SetGuarantee {
                model: "m".into(),
                guarantee: 1,
            },
            Request::Trim,
            Request::Metrics,
            Request::HostTier(Box::new(Request::Grow {
                model: 1 << 56,
                size: 2 << 20,
            })),
            Request::Lease { model: 3 },
            Request::Keep {
                model: 3,
                tag: "weights".into(),
                len: 1 << 30,
                chunks: vec![KeptChunk {
                    chunk: 9,
                    offset: 2 << 20,
                }],
                append: true,
            },
            Request::Forget {
                model: 3,
                tag: "kv".into(),
            },
            Request::StoreBlob {
                model: 3,
                blob: vec![1, 2, 3],
            },
            Request::Attach {
                model: "m".into(),
                token: LeaseToken([0xab; 32]),
            },
            Request::TakeKept {
                model: 3,
                tag: "weights".into(),
                from: 16,
                count: 16,
            },
            Request::Detach { model: 3 },
        ]
        .into_iter()
        .map(|request| encode(&ToBroker { id: 77, request }).unwrap())
        .collect();
        let mut rng = 0x2545f4914f6cdd1du64;
        let mut next = move || {
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            rng
        };
        let mut decoded = 0;
        for _ in 0..50_000 {
            let mut m = samples[(next() % samples.len() as u64) as usize].clone();
            match next() % 4 {
                0 => {
                    let i = (next() % m.len() as u64) as usize;
                    m[i] = next() as u8;
                }
                1 => m.truncate((next() % m.len() as u64) as usize),
                2 => m.extend((0..next() % 16).map(|_| next() as u8)),
                _ => m = (0..next() % 64).map(|_| next() as u8).collect(),
            }
            if let Ok(msg) = decode::<ToBroker>(&m) {
                decoded += 1;
                assert_eq!(decode::<ToBroker>(&encode(&msg).unwrap()).unwrap(), msg);
            }
            let _ = decode::<FromBroker>(&m);
        }
        assert!(decoded > 0, "some mutations stay valid messages");
    }

    /// A token reads back from its hex form; other lengths and digits are refused; `Debug`
    /// never shows it.
    #[test]
    fn lease_tokens_print_and_parse() {
        let t = LeaseToken(std::array::from_fn(|i| i as u8 * 7));
        let hex = t.to_string();
        assert_eq!(hex.len(), 64);
        assert_eq!(hex.parse::<LeaseToken>().unwrap(), t);
        assert!(hex[..62].parse::<LeaseToken>().is_err());
        assert!(hex.replace('0', "g").parse::<LeaseToken>().is_err());
        assert!("é".repeat(32).parse::<LeaseToken>().is_err());
        assert_eq!(format!("{t:?}"), "LeaseToken(..)");
        assert!(t.matches(&t) && !t.matches(&LeaseToken([0; 32])));
    }

    /// A host-tier request inside a host-tier request does not decode (a peer cannot make the
    /// decoder recurse), at any depth; one level does, and a failed decode leaves the next
    /// one unaffected.
    #[test]
    fn host_tier_requests_nest_one_level_only() {
        let one = Request::HostTier(Box::new(Request::Snapshot));
        let msg = ToBroker {
            id: 1,
            request: one,
        };
        assert_eq!(decode::<ToBroker>(&encode(&msg).unwrap()).unwrap(), msg);
        let mut nested = Request::Snapshot;
        for _ in 0..2 {
            nested = Request::HostTier(Box::new(nested));
        }
        let two = encode(&ToBroker {
            id: 2,
            request: nested.clone(),
        })
        .unwrap();
        // (postcard reports a custom error without its words.)
        assert!(decode::<ToBroker>(&two).is_err());
        // Deep nesting: the encoder recurses (our own value), the decoder stops at level two.
        for _ in 0..10_000 {
            nested = Request::HostTier(Box::new(nested));
        }
        let deep = std::thread::Builder::new()
            .stack_size(64 << 20)
            .spawn(move || {
                encode(&ToBroker {
                    id: 3,
                    request: nested,
                })
                .unwrap()
            })
            .unwrap()
            .join()
            .unwrap();
        assert!(decode::<ToBroker>(&deep).is_err());
        assert_eq!(decode::<ToBroker>(&encode(&msg).unwrap()).unwrap(), msg);
    }
}
