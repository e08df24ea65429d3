//! The engine's side of a model on the broker: a [`Pool`] whose physical chunks come from the
//! broker. Its backend ([`ModelBackend`]) asks the broker for each chunk (admission is the
//! broker's), imports the descriptor that comes back, and maps it with the engine's own
//! backend into the model's own reservation; releasing a chunk drops the engine's reference
//! and gives the chunk back to the broker, which may hand it to another engine without any
//! release or create. So allocations, range maps, regions and layouts work unchanged.

use std::collections::{HashMap, HashSet, VecDeque};
use std::ops::Deref;
use std::os::fd::OwnedFd;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

use parking_lot::Mutex;

use super::client::{
    for_tier, reply_error, unexpected, BrokerClient, ClientInner, ModelLink, SentRequest,
};
use super::protocol::{ModelInfo, Refusal, RefusalCause, Reply, Request, MAX_BATCH};
use crate::backend::{
    AccessMode, Backend, BackendInfo, Copies, DeviceReach, MemoryInfo, Need, PhysicalChunk,
};
use crate::error::{Error, Result};
use crate::pool::{Pool, PoolConfig};
use crate::shared::ModelConfig;

/// A model registered on the broker: allocate from it exactly as from a [`Pool`] (it
/// dereferences to its pool). Cheap to clone, `Send + Sync`. When the last clone and the last
/// allocation are gone, its memory is back at the broker and the model is unregistered.
#[derive(Clone, Debug)]
pub struct RemoteModel {
    pool: Pool,
    id: Arc<str>,
    key: u64,
    client: BrokerClient,
    /// The pool's backend, for what leases need of it (`reattach.rs`).
    pub(super) backend: Arc<ModelBackend>,
}

impl Deref for RemoteModel {
    type Target = Pool;
    fn deref(&self) -> &Pool {
        &self.pool
    }
}

impl RemoteModel {
    /// The model's name.
    pub fn id(&self) -> &str {
        &self.id
    }

    /// The broker's id of the model.
    pub fn key(&self) -> u64 {
        self.key
    }

    /// The model's pool.
    pub fn pool(&self) -> &Pool {
        &self.pool
    }

    /// The connection it lives on.
    pub fn client(&self) -> &BrokerClient {
        &self.client
    }

    /// The broker's line for this model (use, limit, guarantee, chunks, refusals), from the
    /// host tier's view for a model of the host tier.
    pub fn broker_view(&self) -> Result<ModelInfo> {
        let s = self.client.snapshot()?;
        s.models
            .into_iter()
            .chain(s.host_tier.into_iter().flat_map(|h| h.models))
            .find(|m| m.id == self.key)
            .ok_or_else(|| Error::UnknownModel {
                model: self.id.to_string(),
            })
    }
}

impl BrokerClient {
    /// Register a model on the broker (its limit, guarantee and priority are the broker's to
    /// enforce; its reclaim callback runs in this process when the broker asks for memory the
    /// pool cannot give back by itself). The model's address space is reserved here, with the
    /// kind of backend the broker has.
    pub fn register(&self, config: ModelConfig) -> Result<RemoteModel> {
        self.register_on(config, false)
    }

    /// Register a model on the broker's host tier ([`super::BrokerConfig::host_budget`]): a
    /// pool of host memory whose chunks the broker makes once, hands over between engines and
    /// takes back when this engine ends, under the host budget, with `config`'s limit,
    /// guarantee and priority enforced by the broker as for device memory. Its pool is
    /// page-locked host memory the device reaches (VMM host memory on CUDA, or pinned memfd
    /// memory): give it to [`crate::Pool::stage_through`] and the device models' sleeps stage
    /// through it. A woken model's staging memory stays idle in this pool (its next sleep
    /// reuses it) until a trim of the pool gives it back, or the broker asks for it because
    /// another engine's sleep needs it; the pool caches no unmapped chunks, so what it gives
    /// back serves the next engine's sleep.
    pub fn register_host_tier(&self, config: ModelConfig) -> Result<RemoteModel> {
        self.register_on(config, true)
    }

    fn register_on(&self, config: ModelConfig, host: bool) -> Result<RemoteModel> {
        let p = config.parts();
        let inner = self.inner().clone();
        // The host tier's backend is known before anything is registered.
        let host_gran = if host {
            Some(inner.host_local_backend()?)
        } else {
            None
        };
        let request = Request::Register {
            model: p.id.to_string(),
            limit: p.limit,
            guarantee: p.guarantee,
            priority: p.priority,
        };
        let key = match self.request(for_tier(host, request))?.0 {
            Reply::Registered { model } => model,
            other => return Err(unexpected("register", &other)),
        };
        self.open_model(key, &config, host_gran.map(|(b, _)| b))
    }

    /// The engine's side of model `key`, registered (or attached) on the broker already: its
    /// backend and pool, its reclaim callback linked. `host`: the host tier's local backend,
    /// for a model of the host tier. On failure the model is unregistered.
    pub(super) fn open_model(
        &self,
        key: u64,
        config: &ModelConfig,
        host: Option<Arc<dyn Backend>>,
    ) -> Result<RemoteModel> {
        let p = config.parts();
        let inner = self.inner().clone();
        let is_host = host.is_some();
        let local = match host {
            Some(b) => Ok(b),
            None => inner.local_backend(),
        };
        let local = match local {
            Ok(b) => b,
            Err(e) => {
                inner.notify(for_tier(is_host, Request::Unregister { model: key }));
                return Err(e);
            }
        };
        let id: Arc<str> = p.id.into();
        let backend = Arc::new(ModelBackend {
            client: inner.clone(),
            model: key,
            host: is_host,
            name: id.clone(),
            local,
            granted: Mutex::new(HashMap::new()),
            fresh: Mutex::new(HashSet::new()),
            zeroed_creates: !is_host && inner.welcome().backend.creates_zeroed,
            held: AtomicU64::new(0),
            kept: Mutex::new(HashMap::new()),
            keeping: AtomicBool::new(false),
        });
        let mut cfg = p.pool.unwrap_or_else(|| {
            let c = PoolConfig::new(p.virtual_capacity);
            if is_host {
                // What the tier frees goes back to the broker at once, for the next engine.
                c.max_cached(0)
            } else {
                c
            }
        });
        cfg.capacity = p.virtual_capacity;
        cfg.name = p.id.to_string();
        // On failure the backend drops here, which unregisters the model.
        let pool = Pool::new(backend.clone(), cfg)?;
        inner.links.lock().insert(
            key,
            ModelLink {
                pool: Arc::downgrade(pool.inner()),
                reclaim: p.reclaim,
                host: is_host,
            },
        );
        tracing::debug!(model = %id, key, "model registered on the broker");
        Ok(RemoteModel {
            pool,
            id,
            key,
            client: self.clone(),
            backend,
        })
    }

    /// Use `backend` to import and map this engine's chunks instead of the default (a host
    /// backend, or CUDA on the broker's device). It must be of the broker's kind and
    /// granularity. Only before the first model is registered.
    pub fn set_local_backend(&self, backend: Arc<dyn Backend>) -> Result<()> {
        let want = &self.welcome().backend;
        let info = backend.info();
        if info.name != want.name || info.granularity as u64 != want.granularity {
            return Err(Error::InvalidArgument(format!(
                "local backend {} with granularity {} cannot map the broker's {} chunks of granularity {}",
                info.name, info.granularity, want.name, want.granularity
            )));
        }
        self.inner()
            .local
            .set(backend)
            .map_err(|_| Error::InvalidArgument("the local backend is chosen already".into()))
    }

    /// The engine's own backend, which maps the broker's chunks here (made on first use if
    /// [`BrokerClient::set_local_backend`] chose none). A p2p link
    /// ([`crate::p2p::PeerLink`]) of a broker engine imports through it.
    pub fn local_backend(&self) -> Result<Arc<dyn Backend>> {
        self.inner().local_backend()
    }
}

impl ClientInner {
    /// The backend this engine maps the broker's host-tier chunks with, and their granularity,
    /// made on first use from the host tier's own view: CUDA's host tier for VMM host memory,
    /// a locked (pinned) host backend for memfd chunks.
    pub(crate) fn host_local_backend(&self) -> Result<(Arc<dyn Backend>, u64)> {
        if let Some(b) = self.host_local.get() {
            return Ok(b.clone());
        }
        let snap = match self
            .request(Request::HostTier(Box::new(Request::Snapshot)))?
            .0
        {
            Reply::Snapshot(s) => s,
            other => return Err(unexpected("host tier", &other)),
        };
        let desc = &snap.backend;
        let gran = usize::try_from(desc.granularity).map_err(|_| {
            Error::InvalidArgument(format!(
                "host tier granularity {} from the broker",
                desc.granularity
            ))
        })?;
        let made: Arc<dyn Backend> = match desc.name.as_str() {
            "host" => Arc::new(crate::backend::host::HostBackend::locked(gran)?),
            "cuda" => Arc::new(crate::backend::cuda::CudaBackend::host_tier(
                desc.device_ordinal.unwrap_or(0),
            )?),
            other => {
                return Err(Error::InvalidArgument(format!(
                    "the broker's host tier backend {other:?} is unknown here"
                )))
            }
        };
        if made.info().granularity != gran {
            return Err(Error::InvalidArgument(format!(
                "the broker's host tier chunks have granularity {gran}, this process's {} backend {}",
                made.info().name,
                made.info().granularity
            )));
        }
        Ok(self
            .host_local
            .get_or_init(|| (made, desc.granularity))
            .clone())
    }

    /// The backend this engine maps the broker's chunks with, made on first use.
    pub(crate) fn local_backend(&self) -> Result<Arc<dyn Backend>> {
        if let Some(b) = self.local.get() {
            return Ok(b.clone());
        }
        let desc = &self.welcome().backend;
        let gran = usize::try_from(desc.granularity).map_err(|_| {
            Error::InvalidArgument(format!("granularity {} from the broker", desc.granularity))
        })?;
        let made: Arc<dyn Backend> = match desc.name.as_str() {
            "host" => Arc::new(crate::backend::host::HostBackend::new(gran)?),
            "cuda" => Arc::new(crate::backend::cuda::CudaBackend::with_granularity(
                desc.device_ordinal.unwrap_or(0),
                Some(gran),
            )?),
            other => {
                return Err(Error::InvalidArgument(format!(
                    "the broker's backend {other:?} is unknown here"
                )))
            }
        };
        Ok(self.local.get_or_init(|| made).clone())
    }
}

/// A model's backend on the engine side: chunks from the broker, mappings by the local backend.
#[derive(Debug)]
pub(crate) struct ModelBackend {
    client: Arc<ClientInner>,
    model: u64,
    /// A model of the broker's host tier (requests wrapped in [`Request::HostTier`]).
    host: bool,
    name: Arc<str>,
    local: Arc<dyn Backend>,
    /// Local raw handle -> the broker's chunk id. Bookkeeping only.
    granted: Mutex<HashMap<u64, u64>>,
    /// Local raw handles of chunks the broker created for this model (none handed over from
    /// another engine) on a backend whose new chunks read as zeros: clearing them is a no-op.
    /// Lock order: taken alone.
    fresh: Mutex<HashSet<u64>>,
    /// Whether created chunks are taken as zeros (the broker's device backend says so; never
    /// for the host tier).
    zeroed_creates: bool,
    held: AtomicU64,
    /// Address spans of the regions kept under a lease, by tag (`reattach.rs`). Lock order:
    /// taken alone, never across a request.
    pub(super) kept: Mutex<HashMap<String, (u64, u64)>>,
    /// [`RemoteModel::keep_on_exit`]: chunks released here are not given back, and the model
    /// is not unregistered when the backend goes; the broker's lease decides at the end of the
    /// connection.
    pub(super) keeping: AtomicBool,
}

impl Drop for ModelBackend {
    fn drop(&mut self) {
        self.client.links.lock().remove(&self.model);
        if !self.keeping.load(Ordering::Acquire) {
            self.client.notify(for_tier(
                self.host,
                Request::Unregister { model: self.model },
            ));
        }
    }
}

/// Batch growth requests one growth keeps in flight.
const GROW_WINDOW: usize = 2;

/// The broker's refusal as the crate's error, numbers kept (the global numbers of a host-tier
/// model's refusal are the host budget's).
fn refusal_error(r: Refusal, host: bool) -> Error {
    let cause = match (host, r.cause) {
        (true, RefusalCause::Global) => "the broker's host budget",
        (true, RefusalCause::ModelLimit) => "the model's host limit",
        (_, c) => c.describe(),
    };
    Error::AdmissionRefused {
        model: r.model,
        requested: r.requested,
        cause,
        model_used: r.model_used,
        model_limit: r.model_limit,
        global_used: r.global_used,
        global_limit: r.global_limit,
        reserved_for_others: r.reserved_for_others,
    }
}

fn not_ours(chunk: PhysicalChunk, model: &str) -> Error {
    Error::backend(
        "broker",
        "release",
        "EBADF",
        format!("handle {:#x} is no chunk of model {model}", chunk.raw),
    )
}

/// Import `fds` (chunks of `size` bytes) on up to `threads` threads; one result per descriptor,
/// in order.
fn import_all(
    local: &dyn Backend,
    fds: Vec<OwnedFd>,
    size: usize,
    threads: usize,
) -> Vec<Result<PhysicalChunk>> {
    let n = fds.len();
    let threads = threads.clamp(1, n.max(1));
    if threads == 1 {
        return fds
            .into_iter()
            .map(|fd| local.import_chunk(fd, size))
            .collect();
    }
    // Descriptor i goes to thread i % threads; results go back to their slots.
    let mut lanes: Vec<Vec<(usize, OwnedFd)>> = (0..threads).map(|_| Vec::new()).collect();
    for (i, fd) in fds.into_iter().enumerate() {
        lanes[i % threads].push((i, fd));
    }
    let mut out: Vec<Option<Result<PhysicalChunk>>> = (0..n).map(|_| None).collect();
    // One import, a panic inside it turned into an error (the lane's other results are kept).
    let import = |fd: OwnedFd| {
        std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            local.import_chunk(fd, size)
        }))
        .unwrap_or_else(|_| {
            Err(Error::backend(
                "broker",
                "import_chunk",
                "PANIC",
                "importing this chunk panicked",
            ))
        })
    };
    std::thread::scope(|s| {
        let mut handles = Vec::new();
        for lane in lanes {
            let work = move || {
                lane.into_iter()
                    .map(|(i, fd)| (i, import(fd)))
                    .collect::<Vec<_>>()
            };
            // A thread that cannot be made (a process limit): this thread does its share.
            let (tx, rx) = std::sync::mpsc::channel();
            let spawned = std::thread::Builder::new().spawn_scoped(s, move || {
                let work = rx.recv().ok();
                work.map(|w: Box<dyn FnOnce() -> Vec<(usize, Result<PhysicalChunk>)> + Send>| w())
            });
            let work: Box<dyn FnOnce() -> Vec<(usize, Result<PhysicalChunk>)> + Send> =
                Box::new(work);
            match spawned {
                Ok(h) => match tx.send(work) {
                    Ok(()) => handles.push(h),
                    Err(back) => {
                        for (i, r) in (back.0)() {
                            out[i] = Some(r);
                        }
                    }
                },
                Err(e) => {
                    tracing::debug!(error = %e, "no import thread; importing here");
                    for (i, r) in work() {
                        out[i] = Some(r);
                    }
                }
            }
        }
        for h in handles {
            if let Ok(Some(done)) = h.join() {
                for (i, r) in done {
                    out[i] = Some(r);
                }
            }
        }
    });
    out.into_iter()
        .map(|r| {
            r.unwrap_or_else(|| {
                Err(Error::backend(
                    "broker",
                    "import_chunk",
                    "NO_RESULT",
                    "the import thread of this chunk ended without a result",
                ))
            })
        })
        .collect()
}

impl ModelBackend {
    /// Forget (at the broker, waiting for its answer) every kept region overlapping
    /// `[start, end)`: part of it is being unmapped.
    pub(super) fn unkeep(&self, start: u64, end: u64) {
        // An engine exiting keeping its lease unmaps what it keeps, unchanged.
        if self.keeping.load(Ordering::Acquire) {
            return;
        }
        let gone: Vec<String> = {
            let mut kept = self.kept.lock();
            let tags: Vec<String> = kept
                .iter()
                .filter(|(_, &(s, e))| s < end && start < e)
                .map(|(t, _)| t.clone())
                .collect();
            for t in &tags {
                kept.remove(t);
            }
            tags
        };
        for tag in gone {
            match self.client.request(self.wrap(Request::Forget {
                model: self.model,
                tag: tag.clone(),
            })) {
                Ok((Reply::Done, _)) => {
                    tracing::debug!(model = %self.name, tag, "a kept region is unmapped; no longer kept")
                }
                // Forgotten already (a chunk of it went back), or the connection is gone.
                other => {
                    tracing::warn!(model = %self.name, tag, answer = ?other.map(|r| r.0), "forgetting an unmapped kept region failed; the broker may still keep it")
                }
            }
        }
    }

    /// Let go of imported chunks mapped nowhere, here only: nothing goes back to the broker
    /// (a failed attach, whose lease keeps them).
    pub(super) fn let_go(&self, chunks: impl Iterator<Item = PhysicalChunk>) {
        for c in chunks {
            self.granted.lock().remove(&c.raw);
            // SAFETY: imported by this backend, mapped nowhere, released once.
            match unsafe { self.local.release(c) } {
                Ok(()) => {
                    self.held.fetch_sub(c.size as u64, Ordering::Relaxed);
                }
                Err(e) => {
                    tracing::error!(model = %self.name, error = %e, "letting go of a kept chunk's import failed")
                }
            }
        }
    }

    /// The broker's id of `chunk`, if it is one of this model's.
    pub(super) fn chunk_id(&self, chunk: PhysicalChunk) -> Option<u64> {
        self.granted.lock().get(&chunk.raw).copied()
    }

    /// Import kept chunks taken over with a lease (`reattach.rs`): each is this model's from
    /// now on, as if granted, and never cleared (its bytes are the point). On failure every
    /// import is let go here and nothing is given back: the chunks stay the model's at the
    /// broker.
    pub(super) fn import_kept(
        &self,
        chunks: &[super::protocol::KeptChunk],
        sizes: &[u64],
        fds: Vec<OwnedFd>,
    ) -> Result<Vec<PhysicalChunk>> {
        let uniform = sizes.windows(2).all(|w| w[0] == w[1]);
        let results: Vec<Result<PhysicalChunk>> = match (uniform, sizes.first()) {
            (true, Some(&size)) => {
                let size = usize::try_from(size).map_err(|_| {
                    Error::InvalidArgument(format!("kept chunk of {size} bytes from the broker"))
                })?;
                let threads = self.client.import_threads.load(Ordering::Relaxed);
                import_all(&*self.local, fds, size, threads)
            }
            _ => fds
                .into_iter()
                .zip(sizes)
                .map(|(fd, &size)| match usize::try_from(size) {
                    Ok(size) => self.local.import_chunk(fd, size),
                    Err(_) => Err(Error::InvalidArgument(format!(
                        "kept chunk of {size} bytes from the broker"
                    ))),
                })
                .collect(),
        };
        let mut made = Vec::with_capacity(results.len());
        let mut failure = None;
        for r in results {
            match r {
                Ok(c) => made.push(c),
                Err(e) => {
                    failure.get_or_insert(e);
                }
            }
        }
        if let Some(e) = failure {
            for c in made {
                // SAFETY: imported just above, mapped nowhere, released once.
                if let Err(r) = unsafe { self.local.release(c) } {
                    tracing::error!(model = %self.name, error = %r, "releasing a kept chunk's import after a failed attach failed");
                }
            }
            return Err(e);
        }
        let mut granted = self.granted.lock();
        for (c, k) in made.iter().zip(chunks) {
            granted.insert(c.raw, k.chunk);
        }
        drop(granted);
        let bytes: u64 = made.iter().map(|c| c.size as u64).sum();
        self.held.fetch_add(bytes, Ordering::Relaxed);
        Ok(made)
    }

    /// `request` for this model's tier.
    fn wrap(&self, request: Request) -> Request {
        for_tier(self.host, request)
    }

    /// Give chunks back in as few messages as the protocol allows; the replies are awaited
    /// after every message went out.
    fn give_back_many(&self, chunks: Vec<u64>) {
        if self.keeping.load(Ordering::Acquire) {
            return;
        }
        let mut sent = Vec::new();
        for batch in chunks.chunks(MAX_BATCH as usize) {
            match self.client.send_request(self.wrap(Request::GiveBackMany {
                model: self.model,
                chunks: batch.to_vec(),
            })) {
                Ok(s) => sent.push(s),
                // The connection is gone: the broker took every chunk back when it closed.
                Err(e) => {
                    tracing::debug!(model = %self.name, chunks = batch.len(), error = %e, "chunks not given back");
                    break;
                }
            }
        }
        for s in sent {
            match self.client.wait_reply(s) {
                Ok((Reply::Done, _)) => {}
                Ok((other, _)) => {
                    tracing::warn!(model = %self.name, reply = ?other, "broker refused chunks given back")
                }
                Err(e) => {
                    tracing::debug!(model = %self.name, error = %e, "chunks not given back")
                }
            }
        }
    }

    fn give_back(&self, chunk: u64) {
        if self.keeping.load(Ordering::Acquire) {
            return;
        }
        match self.client.request(self.wrap(Request::GiveBack {
            model: self.model,
            chunk,
        })) {
            Ok((Reply::Done, _)) => {}
            Ok((other, _)) => {
                tracing::warn!(model = %self.name, chunk, reply = ?other, "broker refused a chunk given back")
            }
            // The connection is gone: the broker took every chunk back when it closed.
            Err(e) => {
                tracing::debug!(model = %self.name, chunk, error = %e, "chunk not given back")
            }
        }
    }
}

impl Backend for ModelBackend {
    fn create(&self, size: usize) -> Result<PhysicalChunk> {
        let (reply, mut fds) = self.client.request(self.wrap(Request::Grow {
            model: self.model,
            size: size as u64,
        }))?;
        match reply {
            Reply::Granted {
                chunk,
                size: granted,
                handed_over,
            } => {
                let fd: Option<OwnedFd> = fds.pop();
                let fd = match fd {
                    Some(fd) if fds.is_empty() && granted == size as u64 => fd,
                    _ => {
                        self.give_back(chunk);
                        return Err(Error::Ipc {
                            op: "grow",
                            detail: format!(
                                "broker granted {granted} bytes with {} descriptors for a request of {size}",
                                fds.len() + 1
                            ),
                        });
                    }
                };
                match self.local.import_chunk(fd, size) {
                    Ok(c) => {
                        self.granted.lock().insert(c.raw, chunk);
                        if self.zeroed_creates && !handed_over {
                            self.fresh.lock().insert(c.raw);
                        }
                        self.held.fetch_add(size as u64, Ordering::Relaxed);
                        Ok(c)
                    }
                    Err(e) => {
                        self.give_back(chunk);
                        Err(e)
                    }
                }
            }
            Reply::Refused(r) => Err(refusal_error(r, self.host)),
            Reply::Error { kind, message } => Err(reply_error(kind, message)),
            other => Err(unexpected("grow", &other)),
        }
    }

    fn create_many(&self, size: usize, count: usize, need: Need) -> Result<Vec<PhysicalChunk>> {
        if count == 0 {
            return Ok(Vec::new());
        }
        // At most GROW_WINDOW batch requests in flight: the broker prepares batch k + 1 while
        // this process imports batch k, and after a failure nothing more is asked (every
        // request sent may make the broker ask other engines to give back).
        let per = MAX_BATCH as usize;
        let mut sent: VecDeque<(usize, SentRequest)> = VecDeque::new();
        let mut failure: Option<Error> = None;
        let mut left = count;
        let fill = |sent: &mut VecDeque<(usize, SentRequest)>,
                    left: &mut usize,
                    failure: &mut Option<Error>| {
            while failure.is_none() && *left > 0 && sent.len() < GROW_WINDOW {
                let n = (*left).min(per);
                match self.client.send_request(self.wrap(Request::GrowMany {
                    model: self.model,
                    size: size as u64,
                    count: n as u32,
                    look_ahead: need == Need::LookAhead,
                })) {
                    Ok(s) => sent.push_back((n, s)),
                    Err(e) => *failure = Some(e),
                }
                *left -= n;
            }
        };
        let mut made: Vec<(PhysicalChunk, u64)> = Vec::with_capacity(count);
        // Ids granted but not imported (after a failure): given back as they are.
        let mut unimported: Vec<u64> = Vec::new();
        loop {
            fill(&mut sent, &mut left, &mut failure);
            let Some((n, s)) = sent.pop_front() else {
                break;
            };
            let (reply, fds) = match self.client.wait_reply(s) {
                Ok(r) => r,
                Err(e) => {
                    failure.get_or_insert(e);
                    continue;
                }
            };
            let (ids, handed_over) = match reply {
                Reply::GrantedMany {
                    chunks,
                    size: granted,
                    handed_over,
                } if chunks.len() == n && fds.len() == n && granted == size as u64 => {
                    (chunks, handed_over as usize)
                }
                Reply::GrantedMany {
                    chunks,
                    size: granted,
                    ..
                } => {
                    unimported.extend(chunks.iter().copied());
                    failure.get_or_insert(Error::Ipc {
                        op: "grow",
                        detail: format!(
                            "broker granted {} chunks of {granted} bytes with {} descriptors for a request of {n} chunks of {size}",
                            chunks.len(),
                            fds.len()
                        ),
                    });
                    continue;
                }
                Reply::Refused(r) => {
                    failure.get_or_insert(refusal_error(r, self.host));
                    continue;
                }
                Reply::Error { kind, message } => {
                    failure.get_or_insert(reply_error(kind, message));
                    continue;
                }
                other => {
                    failure.get_or_insert(unexpected("grow", &other));
                    continue;
                }
            };
            if failure.is_some() {
                unimported.extend(ids);
                continue;
            }
            // The next batch goes out before this one is imported.
            fill(&mut sent, &mut left, &mut failure);
            let threads = self.client.import_threads.load(Ordering::Relaxed);
            // The broker lists the chunks handed over first, then the ones it created.
            for (i, (cid, r)) in ids
                .into_iter()
                .zip(import_all(&*self.local, fds, size, threads))
                .enumerate()
            {
                match r {
                    Ok(c) => {
                        if self.zeroed_creates && i >= handed_over {
                            self.fresh.lock().insert(c.raw);
                        }
                        made.push((c, cid))
                    }
                    Err(e) => {
                        unimported.push(cid);
                        failure.get_or_insert(e);
                    }
                }
            }
        }
        let Some(e) = failure else {
            let mut granted = self.granted.lock();
            for &(c, cid) in &made {
                granted.insert(c.raw, cid);
            }
            drop(granted);
            self.held
                .fetch_add((size * made.len()) as u64, Ordering::Relaxed);
            return Ok(made.into_iter().map(|(c, _)| c).collect());
        };
        // All or none: every import is released here and every chunk goes back.
        for &(c, cid) in &made {
            self.fresh.lock().remove(&c.raw);
            // SAFETY: imported just above, mapped nowhere, released once.
            match unsafe { self.local.release(c) } {
                Ok(()) => unimported.push(cid),
                Err(r) => {
                    tracing::error!(model = %self.name, chunk = cid, error = %r, "releasing an import after a failed growth failed; the chunk stays with this engine until it disconnects")
                }
            }
        }
        self.give_back_many(unimported);
        Err(e)
    }

    unsafe fn release_many(&self, chunks: &[PhysicalChunk]) -> Vec<Result<()>> {
        let mut back = Vec::with_capacity(chunks.len());
        let results = chunks
            .iter()
            .map(|&chunk| {
                let Some(cid) = self.granted.lock().remove(&chunk.raw) else {
                    return Err(not_ours(chunk, &self.name));
                };
                self.fresh.lock().remove(&chunk.raw);
                // SAFETY: forwarded contract: the chunk is ours, live and mapped nowhere.
                if let Err(e) = unsafe { self.local.release(chunk) } {
                    self.granted.lock().insert(chunk.raw, cid);
                    return Err(e);
                }
                self.held.fetch_sub(chunk.size as u64, Ordering::Relaxed);
                back.push(cid);
                Ok(())
            })
            .collect();
        self.give_back_many(back);
        results
    }

    unsafe fn release(&self, chunk: PhysicalChunk) -> Result<()> {
        let Some(cid) = self.granted.lock().remove(&chunk.raw) else {
            return Err(not_ours(chunk, &self.name));
        };
        self.fresh.lock().remove(&chunk.raw);
        // SAFETY: forwarded contract: the chunk is ours, live and mapped nowhere.
        if let Err(e) = unsafe { self.local.release(chunk) } {
            self.granted.lock().insert(chunk.raw, cid);
            return Err(e);
        }
        self.held.fetch_sub(chunk.size as u64, Ordering::Relaxed);
        self.give_back(cid);
        Ok(())
    }

    fn physical_bytes(&self) -> Result<u64> {
        Ok(self.held.load(Ordering::Relaxed))
    }

    fn chunk_lender(&self) -> Option<String> {
        Some(format!("the broker (chunks of model {})", self.name))
    }

    // Sleep and wake stage through the engine's own backend (pinned memory and a copy stream
    // on CUDA), and copies (p2p's too: batches, gathers, waits) run on it; the chunks
    // themselves come from and go back to the broker as above.
    fn copies(&self) -> &dyn Copies {
        self.local.copies()
    }

    // The rest of the VMM core: the engine's own backend, under the caller's contracts.

    fn info(&self) -> &BackendInfo {
        self.local.info()
    }

    fn reserve(&self, size: usize, alignment: usize) -> Result<u64> {
        self.local.reserve(size, alignment)
    }

    unsafe fn free_reservation(&self, base: u64, size: usize) -> Result<()> {
        // SAFETY: forwarded contract.
        unsafe { self.local.free_reservation(base, size) }
    }

    unsafe fn map(&self, addr: u64, chunk: PhysicalChunk) -> Result<()> {
        // Mapped, it may be written: no later clear of it is a no-op.
        self.fresh.lock().remove(&chunk.raw);
        // SAFETY: forwarded contract.
        unsafe { self.local.map(addr, chunk) }
    }

    unsafe fn set_access(&self, addr: u64, size: usize) -> Result<()> {
        // SAFETY: forwarded contract.
        unsafe { self.local.set_access(addr, size) }
    }

    unsafe fn set_access_mode(&self, addr: u64, size: usize, mode: AccessMode) -> Result<()> {
        // SAFETY: forwarded contract.
        unsafe { self.local.set_access_mode(addr, size, mode) }
    }

    unsafe fn set_import_access(
        &self,
        addr: u64,
        size: usize,
        mode: AccessMode,
        owner: Option<i32>,
    ) -> Result<()> {
        // SAFETY: forwarded contract.
        unsafe { self.local.set_import_access(addr, size, mode, owner) }
    }

    unsafe fn unmap(&self, addr: u64, size: usize) -> Result<()> {
        // A kept region no longer whole is no longer kept: the broker forgets it before its
        // chunks can hold anything else (its chunks may stay this model's, in the pool's cache).
        self.unkeep(addr, addr.saturating_add(size as u64));
        // SAFETY: forwarded contract.
        unsafe { self.local.unmap(addr, size) }
    }

    fn memory_info(&self) -> Result<MemoryInfo> {
        self.local.memory_info()
    }

    unsafe fn map_over(&self, addr: u64, chunk: PhysicalChunk, mode: AccessMode) -> Result<()> {
        self.fresh.lock().remove(&chunk.raw);
        // SAFETY: forwarded contract.
        unsafe { self.local.map_over(addr, chunk, mode) }
    }

    fn maps_over(&self) -> bool {
        self.local.maps_over()
    }

    // Imported chunks clear like the engine's own; `creates_zeroed` stays false: a chunk the
    // broker grants may be handed over from another engine with its bytes. One the broker
    // created on a backend whose new chunks read as zeros is cleared already: a clear before
    // its first mapping is a no-op (once mapped it may hold this engine's bytes).
    unsafe fn wipe_chunk(&self, chunk: PhysicalChunk) -> Result<()> {
        if self.fresh.lock().remove(&chunk.raw) {
            return Ok(());
        }
        // SAFETY: forwarded contract.
        unsafe { self.local.wipe_chunk(chunk) }
    }

    fn export_chunk(&self, chunk: PhysicalChunk) -> Result<OwnedFd> {
        // Another process may write it through the export: no later clear is a no-op.
        self.fresh.lock().remove(&chunk.raw);
        self.local.export_chunk(chunk)
    }

    fn reach(&self, uuid: &[u8; 16]) -> Result<DeviceReach> {
        self.local.reach(uuid)
    }
}

#[cfg(test)]
mod tests {
    use std::time::{Duration, Instant};

    use super::*;
    use crate::backend::host::{ChunkFiles, HostBackend, DEFAULT_GRANULARITY};
    use crate::broker::{Broker, BrokerConfig};
    use crate::MemOptions;

    fn socket(tag: &str) -> std::path::PathBuf {
        std::env::temp_dir()
            .join(format!("evmm-unit-{tag}-{}", std::process::id()))
            .join("b.sock")
    }

    #[test]
    fn a_remote_model_is_a_pool_and_fails_fast_when_the_broker_goes() {
        let host =
            HostBackend::with_chunk_files(DEFAULT_GRANULARITY, ChunkFiles::PerChunk).unwrap();
        let broker =
            Broker::start(Arc::new(host), BrokerConfig::new(socket("gone"), 64 << 20)).unwrap();
        let client = BrokerClient::connect(broker.socket(), "unit").unwrap();
        let model = client
            .register(ModelConfig::new("m", 1 << 30, 32 << 20).guarantee(4 << 20))
            .unwrap();
        let mut a = model.allocate(3 << 20).unwrap();
        a.write(0, b"remote").unwrap();
        let mut back = [0u8; 6];
        a.read(0, &mut back).unwrap();
        assert_eq!(&back, b"remote");
        // The broker's refusal carries its numbers.
        let e = model.allocate(40 << 20).unwrap_err();
        assert!(
            matches!(e, Error::AdmissionRefused { model_limit, .. } if model_limit == 32 << 20),
            "{e}"
        );
        let view = model.broker_view().unwrap();
        assert_eq!((view.guarantee, view.limit), (4 << 20, 32 << 20));
        assert!(view.used >= 3 << 20);
        // A duplicate name is refused.
        let dup = client
            .register(ModelConfig::new("m", 1 << 30, 1 << 20))
            .unwrap_err();
        assert!(dup.to_string().contains("already registered"), "{dup}");
        broker.shutdown();
        // The connection is gone: growth fails at once instead of waiting for a reply.
        let t = Instant::now();
        assert!(model.allocate(16 << 20).is_err());
        assert!(t.elapsed() < Duration::from_secs(5), "{:?}", t.elapsed());
        // Memory already mapped stays valid for the allocations that hold it.
        a.read(0, &mut back).unwrap();
        assert_eq!(&back, b"remote");
    }

    /// Issue 33, defect 8: an engine's KV cache on a remote model charges the pool's zero page
    /// once: the broker's line (every chunk the engine holds) equals what the engine's pool
    /// counts (zero page included), and both go to 0 once the cache is gone.
    #[test]
    fn a_remote_kv_cache_charges_its_zero_page_once() {
        use crate::kv::{PagedKv, PagedKvConfig};
        const MIB: u64 = 1 << 20;
        let g = DEFAULT_GRANULARITY as u64;
        let host =
            HostBackend::with_chunk_files(DEFAULT_GRANULARITY, ChunkFiles::PerChunk).unwrap();
        let broker =
            Broker::start(Arc::new(host), BrokerConfig::new(socket("zero"), 64 * MIB)).unwrap();
        let client = BrokerClient::connect(broker.socket(), "unit").unwrap();
        let m = client
            .register(ModelConfig::new("m", 1 << 30, 32 * MIB))
            .unwrap();
        let kv = PagedKv::new(&m, PagedKvConfig::new(1, 2, 64, 4096, 2, 16)).unwrap();
        let ids = kv.alloc(1).unwrap();
        let s = m.stats();
        assert_eq!(s.zero_page, g, "{s:?}");
        let view = m.broker_view().unwrap();
        assert_eq!(view.used, s.physical(), "{view:?} {s:?}");
        assert_eq!(m.backend().physical_bytes().unwrap(), s.physical());
        kv.free(&ids).unwrap();
        drop(kv);
        m.trim().unwrap();
        assert_eq!(m.stats().physical(), 0, "{:?}", m.stats());
        let view = m.broker_view().unwrap();
        assert_eq!((view.used, view.chunks), (0, 0), "{view:?}");
        assert_eq!(client.snapshot().unwrap().audit, None);
        broker.shutdown();
    }

    /// A growth by many chunks travels in batches of [`MAX_BATCH`] and is all or none: a
    /// refusal in a later batch gives back every chunk of the earlier ones, and the books show
    /// nothing held. Handed-over chunks keep their bytes, and a batch give-back returns them.
    #[test]
    fn batch_growth_is_all_or_none_and_hands_over() {
        const MIB: u64 = 1 << 20;
        let host =
            HostBackend::with_chunk_files(DEFAULT_GRANULARITY, ChunkFiles::PerChunk).unwrap();
        let broker = Broker::start(
            Arc::new(host),
            BrokerConfig::new(socket("batch"), 128 * MIB),
        )
        .unwrap();
        let client = BrokerClient::connect(broker.socket(), "unit").unwrap();
        let a = client
            .register(ModelConfig::new("a", 1 << 30, 80 * MIB))
            .unwrap();
        // 50 chunks of 2 MiB = 4 batches; the limit refuses chunk 41, in the third batch.
        let e = a
            .map_with(0, 100 * MIB, &MemOptions::new().chunk(2 * MIB))
            .unwrap_err();
        assert!(
            matches!(e, Error::AdmissionRefused { model_limit, .. } if model_limit == 80 * MIB),
            "{e}"
        );
        let view = a.broker_view().unwrap();
        assert_eq!((view.used, view.chunks), (0, 0), "{view:?}");
        assert_eq!(a.backend().physical_bytes().unwrap(), 0);
        let s = client.snapshot().unwrap();
        assert_eq!(s.audit, None);
        // The chunks made for the failed growth wait idle at the broker; the next growth
        // takes them over.
        let created = s.counters.creates;
        assert!(created >= 32, "{:?}", s.counters);
        a.map_with(0, 64 * MIB, &MemOptions::new().chunk(2 * MIB))
            .unwrap();
        // SAFETY: [0, 64 MiB) was just mapped with access; nothing else uses it.
        unsafe {
            a.backend()
                .copies()
                .fill(a.base(), (64 * MIB) as usize, 0xab)
                .unwrap()
        };
        a.unmap(0, 64 * MIB).unwrap();
        a.trim().unwrap();
        let mid = client.snapshot().unwrap().counters;
        assert_eq!(mid.creates, created.max(32), "{mid:?}");
        // Another engine takes them over, 32 chunks in two batch requests.
        let other = BrokerClient::connect(broker.socket(), "other").unwrap();
        other.set_import_threads(3);
        let b = other
            .register(ModelConfig::new("b", 1 << 30, 64 * MIB))
            .unwrap();
        b.map_with(0, 64 * MIB, &MemOptions::new().chunk(2 * MIB))
            .unwrap();
        let mut byte = [0u8; 1];
        for i in 0..32u64 {
            // SAFETY: mapped with access just above.
            unsafe {
                b.backend()
                    .copies()
                    .read(b.base() + i * 2 * MIB, &mut byte)
                    .unwrap()
            };
            // Handed over from engine a: cleared, none of a's bytes show (issue 33, defect 3).
            assert_eq!(byte[0], 0, "chunk {i} shows its last owner's byte");
        }
        let after = other.snapshot().unwrap().counters;
        assert_eq!(after.creates, mid.creates, "no create: {after:?}");
        assert_eq!(after.handovers - mid.handovers, 32, "{after:?}");
        b.unmap(0, 64 * MIB).unwrap();
        b.trim().unwrap();
        let end = other.snapshot().unwrap();
        assert_eq!(end.counters.give_backs - after.give_backs, 32);
        assert!(end.models.iter().all(|m| m.used == 0), "{:?}", end.models);
        assert_eq!(end.audit, None);
        broker.shutdown();
    }

    /// Counts the chunks an engine's local backend is asked to clear.
    #[derive(Debug, Default)]
    struct Wipes(std::sync::atomic::AtomicU64);

    impl crate::backend::intercept::Hook for Wipes {
        type Pass = ();
        fn before(
            &self,
            call: &crate::backend::intercept::Call,
            _: &crate::backend::BackendInfo,
        ) -> Result<()> {
            if matches!(call, crate::backend::intercept::Call::Wipe { .. }) {
                self.0.fetch_add(1, Ordering::Relaxed);
            }
            Ok(())
        }
    }

    /// An engine on a local backend that counts its clears.
    fn counting_engine(
        socket: &std::path::Path,
        name: &str,
    ) -> (
        BrokerClient,
        Arc<crate::backend::intercept::Intercept<Wipes>>,
    ) {
        let client = BrokerClient::connect(socket, name).unwrap();
        let local =
            HostBackend::with_chunk_files(DEFAULT_GRANULARITY, ChunkFiles::PerChunk).unwrap();
        let counted = Arc::new(crate::backend::intercept::Intercept::<Wipes>::new(
            Arc::new(local),
        ));
        client.set_local_backend(counted.clone()).unwrap();
        (client, counted)
    }

    /// Chunks the broker creates on a backend whose new chunks read as zeros are not cleared
    /// again by the engine (the broker says which chunks it created); chunks handed over from
    /// another engine still are, and read as zeros.
    #[test]
    fn created_chunks_are_not_cleared_again_handed_over_ones_are() {
        const MIB: u64 = 1 << 20;
        let host =
            HostBackend::with_chunk_files(DEFAULT_GRANULARITY, ChunkFiles::PerChunk).unwrap();
        assert!(host.creates_zeroed());
        let broker =
            Broker::start(Arc::new(host), BrokerConfig::new(socket("fresh"), 64 * MIB)).unwrap();
        let (ca, wa) = counting_engine(broker.socket(), "a");
        assert!(ca.welcome().backend.creates_zeroed);
        let a = ca
            .register(ModelConfig::new("a", 1 << 30, 32 * MIB))
            .unwrap();
        // A batch growth and a single one, both of new chunks.
        a.map_with(0, 16 * MIB, &MemOptions::new().chunk(2 * MIB))
            .unwrap();
        let mut one = a.allocate(2 * MIB as usize).unwrap();
        assert_eq!(wa.0.load(Ordering::Relaxed), 0, "new chunks were cleared");
        one.fill(0xab).unwrap();
        // SAFETY: [0, 16 MiB) was just mapped with access; nothing else uses it.
        unsafe {
            a.backend()
                .copies()
                .fill(a.base(), (16 * MIB) as usize, 0xab)
                .unwrap()
        };
        drop(one);
        a.unmap(0, 16 * MIB).unwrap();
        a.trim().unwrap();
        // Engine b takes a's chunks over: each is cleared (9 chunks: 8 and the single one).
        let (cb, wb) = counting_engine(broker.socket(), "b");
        let b = cb
            .register(ModelConfig::new("b", 1 << 30, 32 * MIB))
            .unwrap();
        b.map_with(0, 18 * MIB, &MemOptions::new().chunk(2 * MIB))
            .unwrap();
        let handed = cb.snapshot().unwrap().counters.handovers;
        assert!(handed >= 9, "{handed} handed over");
        assert_eq!(
            wb.0.load(Ordering::Relaxed),
            9,
            "handed-over chunks cleared"
        );
        let mut buf = vec![0u8; (18 * MIB) as usize];
        // SAFETY: mapped with access just above.
        unsafe { b.backend().copies().read(b.base(), &mut buf).unwrap() };
        assert!(buf.iter().all(|&x| x == 0), "a's bytes show in b's memory");
        broker.shutdown();
    }

    /// The per-model series a planner scrapes (issue 36): physical bytes, limit, guarantee,
    /// reclaimable bytes and the grant-latency histogram, under the model's name; a model
    /// gone takes its series with it.
    #[test]
    fn metrics_carry_each_models_bytes_and_grant_latency() {
        const MIB: u64 = 1 << 20;
        let host =
            HostBackend::with_chunk_files(DEFAULT_GRANULARITY, ChunkFiles::PerChunk).unwrap();
        let broker = Broker::start(
            Arc::new(host),
            BrokerConfig::new(socket("metrics"), 64 * MIB),
        )
        .unwrap();
        let client = BrokerClient::connect(broker.socket(), "unit").unwrap();
        let m = client
            .register(ModelConfig::new("planner", 1 << 30, 32 * MIB).guarantee(2 * MIB))
            .unwrap();
        let a = m.allocate((8 * MIB) as usize).unwrap();
        drop(a);
        // 8 MiB charged, all of it idle in the engine's pool: 6 MiB above the guarantee.
        let used = m.broker_view().unwrap().used;
        // The engine reports its idle memory every 250 ms.
        let deadline = Instant::now() + Duration::from_secs(5);
        while m.broker_view().unwrap().idle == 0 {
            assert!(Instant::now() < deadline, "no report of idle memory");
            std::thread::sleep(Duration::from_millis(20));
        }
        let text = broker.metrics_text();
        for want in [
            format!("elastic_vmm_broker_model_physical_bytes{{model=\"planner\"}} {used}"),
            format!(
                "elastic_vmm_broker_model_limit_bytes{{model=\"planner\"}} {}",
                32 * MIB
            ),
            format!(
                "elastic_vmm_broker_model_guarantee_bytes{{model=\"planner\"}} {}",
                2 * MIB
            ),
            "elastic_vmm_broker_model_grant_seconds_count{model=\"planner\"}".to_string(),
            "elastic_vmm_broker_model_reclaimable_bytes{model=\"planner\"}".to_string(),
        ] {
            assert!(text.contains(&want), "{want} missing:\n{text}");
        }
        let reclaimable: u64 = text
            .lines()
            .find_map(|l| {
                l.strip_prefix("elastic_vmm_broker_model_reclaimable_bytes{model=\"planner\"} ")
            })
            .and_then(|v| v.trim().parse().ok())
            .unwrap();
        assert!(
            reclaimable > 0 && reclaimable <= used - 2 * MIB,
            "{reclaimable} reclaimable of {used} charged"
        );
        drop(m);
        // The unregistration is a message; the next scrape no longer shows the model.
        let deadline = Instant::now() + Duration::from_secs(5);
        while broker.metrics_text().contains("model=\"planner\"") {
            assert!(Instant::now() < deadline, "{}", broker.metrics_text());
            std::thread::sleep(Duration::from_millis(10));
        }
        broker.shutdown();
    }

    /// Batch requests with bad counts, and a batch give-back naming a chunk the engine does not
    /// hold: clear errors with the numbers; the chunks it does hold still go back.
    #[test]
    fn bad_batches_are_refused_with_their_numbers() {
        use crate::broker::protocol::MAX_BATCH;
        let host =
            HostBackend::with_chunk_files(DEFAULT_GRANULARITY, ChunkFiles::PerChunk).unwrap();
        let broker = Broker::start(
            Arc::new(host),
            BrokerConfig::new(socket("badbatch"), 64 << 20),
        )
        .unwrap();
        let client = BrokerClient::connect(broker.socket(), "unit").unwrap();
        let m = client
            .register(ModelConfig::new("m", 1 << 30, 64 << 20))
            .unwrap();
        for count in [0, MAX_BATCH + 1, u32::MAX] {
            let (reply, fds) = client
                .request(Request::GrowMany {
                    model: m.key(),
                    size: 2 << 20,
                    count,
                    look_ahead: false,
                })
                .unwrap();
            assert!(fds.is_empty());
            match reply {
                Reply::Error { message, .. } => {
                    assert!(message.contains(&count.to_string()), "{message}")
                }
                other => panic!("count {count}: {other:?}"),
            }
        }
        let (reply, fds) = client
            .request(Request::GrowMany {
                model: m.key(),
                size: 2 << 20,
                count: 3,
                look_ahead: false,
            })
            .unwrap();
        let Reply::GrantedMany { chunks, .. } = reply else {
            panic!("{reply:?}")
        };
        assert_eq!((chunks.len(), fds.len()), (3, 3));
        drop(fds);
        let mut back = chunks.clone();
        back.push(999_999);
        let (reply, _) = client
            .request(Request::GiveBackMany {
                model: m.key(),
                chunks: back,
            })
            .unwrap();
        match reply {
            Reply::Error { message, .. } => assert!(message.contains("999999"), "{message}"),
            other => panic!("{other:?}"),
        }
        let view = m.broker_view().unwrap();
        assert_eq!((view.used, view.chunks), (0, 0), "{view:?}");
        let too_many: Vec<u64> = (0..=u64::from(MAX_BATCH)).collect();
        let (reply, _) = client
            .request(Request::GiveBackMany {
                model: m.key(),
                chunks: too_many,
            })
            .unwrap();
        assert!(
            matches!(&reply, Reply::Error { message, .. } if message.contains(&(MAX_BATCH + 1).to_string())),
            "{reply:?}"
        );
        broker.shutdown();
    }

    /// A growth's look-ahead never costs another engine: with the budget short, the required
    /// part is served and the look-ahead refused at once, without asking anyone to give back.
    #[test]
    fn look_ahead_never_reclaims_from_others() {
        const MIB: u64 = 1 << 20;
        let host =
            HostBackend::with_chunk_files(DEFAULT_GRANULARITY, ChunkFiles::PerChunk).unwrap();
        let broker =
            Broker::start(Arc::new(host), BrokerConfig::new(socket("ahead"), 64 * MIB)).unwrap();
        let client = BrokerClient::connect(broker.socket(), "unit").unwrap();
        let a = client
            .register(ModelConfig::new("a", 1 << 30, 64 * MIB))
            .unwrap();
        // A holds 40 MiB, unmapped and cached: reclaimable, but A's.
        a.map(0, 40 * MIB).unwrap();
        a.unmap(0, 40 * MIB).unwrap();
        // B, another engine, maps at least all it has mapped again on each growth (divisor 1).
        let other = BrokerClient::connect(broker.socket(), "other").unwrap();
        let b = other
            .register(
                ModelConfig::new("b", 1 << 30, 64 * MIB)
                    .pool_config(PoolConfig::new(1 << 30).growth_divisor(1)),
            )
            .unwrap();
        let ctl = BrokerClient::connect_control(broker.socket(), "ctl").unwrap();
        let first = b.allocate((16 * MIB) as usize).unwrap();
        let before = ctl.snapshot().unwrap();
        // 4 MiB more is needed (8 MiB free); the look-ahead (12 MiB more) finds no free budget.
        let second = b.allocate((4 * MIB) as usize).unwrap();
        let after = ctl.snapshot().unwrap();
        assert_eq!(
            after.counters.reclaim_requests, before.counters.reclaim_requests,
            "a look-ahead asked another engine to give back: {:?}",
            after.counters
        );
        let used = |s: &crate::broker::Snapshot, name: &str| {
            s.models.iter().find(|m| m.name == name).map(|m| m.used)
        };
        assert_eq!(used(&after, "a"), Some(40 * MIB), "A keeps its memory");
        assert_eq!(used(&after, "b"), Some(20 * MIB), "B mapped what it needed");
        // A required growth does ask: B needs 16 MiB, 12 MiB more than the budget has free.
        let third = b.allocate((16 * MIB) as usize).unwrap();
        let end = ctl.snapshot().unwrap();
        assert!(
            end.counters.reclaim_requests > after.counters.reclaim_requests,
            "{:?}",
            end.counters
        );
        assert_eq!(end.audit, None);
        drop((first, second, third));
        broker.shutdown();
    }

    /// A growth of many batches that the budget refuses asks other engines to give back at
    /// most once per batch in flight ([`GROW_WINDOW`]), not once per batch: after the first
    /// refusal nothing more is asked for.
    #[test]
    fn a_refused_growth_asks_others_at_most_once_per_window() {
        use std::sync::atomic::AtomicUsize;
        const MIB: u64 = 1 << 20;
        let host =
            HostBackend::with_chunk_files(DEFAULT_GRANULARITY, ChunkFiles::PerChunk).unwrap();
        let broker = Broker::start(
            Arc::new(host),
            BrokerConfig::new(socket("window"), 64 * MIB).reclaim_wait(Duration::from_millis(200)),
        )
        .unwrap();
        let ca = BrokerClient::connect(broker.socket(), "a").unwrap();
        let asked = Arc::new(AtomicUsize::new(0));
        let seen = asked.clone();
        let a = ca
            .register(
                ModelConfig::new("a", 1 << 30, 64 * MIB).on_reclaim(move |_| {
                    seen.fetch_add(1, Ordering::SeqCst);
                }),
            )
            .unwrap();
        // In use through the range API: a trim frees nothing, so every reclaim reaches the
        // callback and the growth below is refused.
        a.map(0, 60 * MIB).unwrap();
        let cb = BrokerClient::connect(broker.socket(), "b").unwrap();
        let b = cb
            .register(ModelConfig::new("b", 1 << 30, 1 << 30))
            .unwrap();
        let ctl = BrokerClient::connect_control(broker.socket(), "ctl").unwrap();
        let before = ctl.snapshot().unwrap().counters.reclaim_requests;
        // 128 chunks of 2 MiB: 8 batches.
        let e = b
            .map_with(0, 256 * MIB, &MemOptions::new().chunk(2 * MIB))
            .unwrap_err();
        assert!(e.is_out_of_memory(), "{e}");
        let s = ctl.snapshot().unwrap();
        let pushed = s.counters.reclaim_requests - before;
        // Two batches in flight at most (GROW_WINDOW); with every batch sent at once, each
        // of the 8 asked (8 pushes).
        assert!(
            (1..=2).contains(&pushed),
            "one refused growth pushed {pushed} reclaim requests"
        );
        assert!(asked.load(Ordering::SeqCst) <= 2);
        assert!(
            s.models.iter().all(|m| m.name != "b" || m.used == 0),
            "{:?}",
            s.models
        );
        assert_eq!(s.audit, None);
        broker.shutdown();
    }

    /// A growth whose reply comes after the caller stopped waiting: the chunks granted late go
    /// straight back, so the broker does not keep them charged to this engine.
    #[test]
    fn chunks_granted_after_a_timeout_go_back() {
        use crate::backend::testing::DelayInjector;
        use crate::backend::DriverCall;
        const MIB: u64 = 1 << 20;
        let host =
            HostBackend::with_chunk_files(DEFAULT_GRANULARITY, ChunkFiles::PerChunk).unwrap();
        let slow = Arc::new(DelayInjector::new(Arc::new(host)));
        slow.set_delay(DriverCall::Create, Duration::from_millis(300));
        let broker = Broker::start(slow, BrokerConfig::new(socket("late"), 64 * MIB)).unwrap();
        let client = BrokerClient::connect(broker.socket(), "unit").unwrap();
        let m = client
            .register(ModelConfig::new("m", 1 << 30, 64 * MIB))
            .unwrap();
        client.set_reply_timeout(Duration::from_millis(50));
        let e = m.allocate((2 * MIB) as usize).unwrap_err();
        assert!(e.to_string().contains("no reply within"), "{e}");
        client.set_reply_timeout(Duration::from_secs(120));
        let ctl = BrokerClient::connect_control(broker.socket(), "ctl").unwrap();
        let t = Instant::now();
        loop {
            let s = ctl.snapshot().unwrap();
            let used = s.models.iter().find(|x| x.name == "m").map(|x| x.used);
            if used == Some(0) && s.counters.give_backs >= 1 {
                assert_eq!(s.audit, None);
                break;
            }
            assert!(
                t.elapsed() < Duration::from_secs(5),
                "the late chunk stays charged: {used:?}, {:?}",
                s.counters
            );
            std::thread::sleep(Duration::from_millis(10));
        }
        broker.shutdown();
    }

    /// Two engines sleep through the broker's host tier in turn: A's sleep maps host chunks
    /// the broker made, its wake and trim give them back (to the broker's idle list), and B's sleep is
    /// served by those very chunks (hand-overs, no create). Contents come back byte-exact; a
    /// host limit refuses with the numbers and the host tier's wording.
    #[test]
    fn engines_sleep_through_the_brokers_host_tier_in_turn() {
        use crate::{AfterWake, SleepPolicy};
        const MIB: u64 = 1 << 20;
        let broker =
            Broker::host(BrokerConfig::new(socket("hosttier"), 64 * MIB).host_budget(8 * MIB))
                .unwrap();
        let engine = |name: &str, tag: u8| {
            let c = BrokerClient::connect(broker.socket(), name).unwrap();
            let m = c
                .register(ModelConfig::new(name, 1 << 30, 32 * MIB))
                .unwrap();
            let tier = c
                .register_host_tier(ModelConfig::new(format!("{name}-host"), 1 << 30, 8 * MIB))
                .unwrap();
            m.stage_through(Some(tier.pool().clone())).unwrap();
            let mut a = m.allocate((4 * MIB) as usize).unwrap();
            let data: Vec<u8> = (0..4 * MIB).map(|i| (i as u8).wrapping_mul(tag)).collect();
            a.write(0, &data).unwrap();
            (c, m, tier, a, data)
        };
        let host = |c: &BrokerClient| c.snapshot().unwrap().host_tier.unwrap();
        let (ca, ma, ta, aa, da) = engine("a", 3);
        ma.sleep(&SleepPolicy::offload_all()).unwrap();
        let asleep = host(&ca);
        assert!(asleep.global_used >= 4 * MIB, "{asleep:?}");
        assert_eq!(ta.broker_view().unwrap().used, asleep.global_used);
        let made = asleep.counters.creates;
        assert!(made >= 1);
        ma.wake(AfterWake::FreeHostMemory).unwrap();
        // The woken staging memory stays idle in A's tier pool (for A's next sleep) until A
        // gives it back to the broker (a trim) or the broker reclaims it for another engine.
        ta.pool().trim().unwrap();
        let mut back = vec![0u8; da.len()];
        aa.read(0, &mut back).unwrap();
        assert!(back == da, "A byte-exact");
        let woke = host(&ca);
        assert_eq!(ta.broker_view().unwrap().used, 0, "{woke:?}");
        assert_eq!(
            woke.idle, asleep.global_used,
            "A's host chunks wait at the broker"
        );
        let (cb, mb, tb, ab, db) = engine("b", 5);
        mb.sleep(&SleepPolicy::offload_all()).unwrap();
        let b_asleep = host(&cb);
        assert_eq!(b_asleep.counters.creates, made, "no host chunk made for B");
        assert!(
            b_asleep.counters.handovers >= made,
            "{:?}",
            b_asleep.counters
        );
        assert!(tb.broker_view().unwrap().used >= 4 * MIB);
        // A's tier may not take what B holds beyond the budget: refused with the numbers.
        let e = ta.allocate((6 * MIB) as usize).unwrap_err();
        assert!(
            matches!(e, Error::AdmissionRefused { global_limit, .. } if global_limit == 8 * MIB),
            "{e}"
        );
        assert!(e.to_string().contains("host"), "{e}");
        mb.wake(AfterWake::FreeHostMemory).unwrap();
        ab.read(0, &mut back).unwrap();
        assert!(back == db, "B byte-exact");
        // The device books never saw host memory.
        let s = ca.snapshot().unwrap();
        assert!(
            s.models.iter().all(|m| !m.name.ends_with("-host")),
            "{:?}",
            s.models
        );
        assert_eq!(s.audit, None);
        assert_eq!(host(&ca).audit, None);
        drop((aa, ab, ma, mb, ta, tb, ca, cb));
        broker.shutdown();
    }

    /// The host budget under many threads: four engines' host tiers, two threads each, grow
    /// and free 2 to 6 MiB at a time against a host budget of 8 MiB while a sampler reads the
    /// host tier's books: its use never passes the budget, every refusal is an admission
    /// refusal, the books balance throughout, and everything is back at the end.
    #[test]
    fn the_host_budget_holds_under_many_threads() {
        use std::sync::atomic::AtomicBool;
        const MIB: u64 = 1 << 20;
        let budget = 8 * MIB;
        let broker = Broker::host(
            BrokerConfig::new(socket("hostmany"), 64 * MIB)
                .host_budget(budget)
                .reclaim_wait(Duration::from_millis(50)),
        )
        .unwrap();
        let tiers: Vec<(BrokerClient, RemoteModel)> = (0..4)
            .map(|i| {
                let c = BrokerClient::connect(broker.socket(), &format!("e{i}")).unwrap();
                let t = c
                    .register_host_tier(ModelConfig::new(format!("e{i}-host"), 1 << 30, budget))
                    .unwrap();
                (c, t)
            })
            .collect();
        let ctl = BrokerClient::connect_control(broker.socket(), "ctl").unwrap();
        let done = AtomicBool::new(false);
        let (mut granted, mut refused) = (0u64, 0u64);
        std::thread::scope(|s| {
            let sampler = s.spawn(|| {
                let mut samples = 0u64;
                while !done.load(Ordering::SeqCst) {
                    let h = ctl.snapshot().unwrap().host_tier.unwrap();
                    assert!(h.global_used <= h.global_limit, "{h:?}");
                    assert_eq!(h.audit, None);
                    samples += 1;
                }
                samples
            });
            let workers: Vec<_> = tiers
                .iter()
                .flat_map(|(_, t)| [t.clone(), t.clone()])
                .enumerate()
                .map(|(k, t)| {
                    s.spawn(move || {
                        let (mut ok, mut no) = (0u64, 0u64);
                        for i in 0..40u64 {
                            let mib = 2 + (i * 7 + k as u64) % 5;
                            match t.allocate((mib * MIB) as usize) {
                                Ok(mut a) => {
                                    a.write(0, &[k as u8; 64]).unwrap();
                                    let mut back = [0u8; 64];
                                    a.read(0, &mut back).unwrap();
                                    assert_eq!(back, [k as u8; 64]);
                                    ok += 1;
                                }
                                Err(e) => {
                                    assert!(matches!(e, Error::AdmissionRefused { .. }), "{e}");
                                    no += 1;
                                }
                            }
                        }
                        (ok, no)
                    })
                })
                .collect();
            for w in workers {
                let (ok, no) = w.join().unwrap();
                granted += ok;
                refused += no;
            }
            done.store(true, Ordering::SeqCst);
            assert!(sampler.join().unwrap() > 0);
        });
        assert!(granted > 0, "{granted} granted, {refused} refused");
        for (_, t) in &tiers {
            t.trim().unwrap();
        }
        let h = ctl.snapshot().unwrap().host_tier.unwrap();
        assert!(h.models.iter().all(|m| m.used == 0), "{:?}", h.models);
        assert_eq!((h.global_used, h.audit.clone()), (h.idle, None), "{h:?}");
        drop((tiers, ctl));
        broker.shutdown();
    }
}
