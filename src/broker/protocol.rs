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
pub const PROTOCOL_VERSION: u32 = 4;

/// Most chunks one [`Request::GrowMany`] asks for, and most ids one [`Request::GiveBackMany`]
/// carries: one frame holds at most [`crate::ipc::MAX_FDS`] descriptors.
pub const MAX_BATCH: u32 = crate::ipc::MAX_FDS as u32;

/// Longest model or engine name, in bytes.
pub const MAX_NAME: usize = 64;

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
