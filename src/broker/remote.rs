//! The engine's side of a model on the broker: a [`Pool`] whose physical chunks come from the
//! broker. Its backend ([`ModelBackend`]) asks the broker for each chunk (admission is the
//! broker's), imports the descriptor that comes back, and maps it with the engine's own
//! backend into the model's own reservation; releasing a chunk drops the engine's reference
//! and gives the chunk back to the broker, which may hand it to another engine without any
//! release or create. So allocations, range maps, regions and layouts work unchanged.

use std::collections::HashMap;
use std::ops::Deref;
use std::os::fd::OwnedFd;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use parking_lot::Mutex;

use super::client::{reply_error, unexpected, BrokerClient, ClientInner, ModelLink};
use super::protocol::{ModelInfo, Reply, Request};
use crate::backend::{Backend, BackendInfo, MemoryInfo, PhysicalChunk};
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

    /// The broker's line for this model (use, limit, guarantee, chunks, refusals).
    pub fn broker_view(&self) -> Result<ModelInfo> {
        self.client
            .snapshot()?
            .models
            .into_iter()
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
        let p = config.parts();
        let request = Request::Register {
            model: p.id.to_string(),
            limit: p.limit,
            guarantee: p.guarantee,
            priority: p.priority,
        };
        let key = match self.request(request)?.0 {
            Reply::Registered { model } => model,
            other => return Err(unexpected("register", &other)),
        };
        let inner = self.inner().clone();
        let local = match inner.local_backend() {
            Ok(b) => b,
            Err(e) => {
                inner.notify(Request::Unregister { model: key });
                return Err(e);
            }
        };
        let id: Arc<str> = p.id.into();
        let backend = Arc::new(ModelBackend {
            client: inner.clone(),
            model: key,
            name: id.clone(),
            local,
            granted: Mutex::new(HashMap::new()),
            held: AtomicU64::new(0),
        });
        let mut cfg = p
            .pool
            .unwrap_or_else(|| PoolConfig::new(p.virtual_capacity));
        cfg.capacity = p.virtual_capacity;
        cfg.name = p.id.to_string();
        // On failure the backend drops here, which unregisters the model.
        let pool = Pool::new(backend, cfg)?;
        inner.links.lock().insert(
            key,
            ModelLink {
                pool: Arc::downgrade(pool.inner()),
                reclaim: p.reclaim,
            },
        );
        tracing::debug!(model = %id, key, "model registered on the broker");
        Ok(RemoteModel {
            pool,
            id,
            key,
            client: self.clone(),
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
}

impl ClientInner {
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
    name: Arc<str>,
    local: Arc<dyn Backend>,
    /// Local raw handle -> the broker's chunk id. Bookkeeping only.
    granted: Mutex<HashMap<u64, u64>>,
    held: AtomicU64,
}

impl Drop for ModelBackend {
    fn drop(&mut self) {
        self.client.links.lock().remove(&self.model);
        self.client
            .notify(Request::Unregister { model: self.model });
    }
}

impl ModelBackend {
    fn give_back(&self, chunk: u64) {
        match self.client.request(Request::GiveBack {
            model: self.model,
            chunk,
        }) {
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

    fn create(&self, size: usize) -> Result<PhysicalChunk> {
        let (reply, mut fds) = self.client.request(Request::Grow {
            model: self.model,
            size: size as u64,
        })?;
        match reply {
            Reply::Granted {
                chunk,
                size: granted,
                ..
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
                        self.held.fetch_add(size as u64, Ordering::Relaxed);
                        Ok(c)
                    }
                    Err(e) => {
                        self.give_back(chunk);
                        Err(e)
                    }
                }
            }
            Reply::Refused(r) => Err(Error::AdmissionRefused {
                model: r.model,
                requested: r.requested,
                cause: r.cause.describe(),
                model_used: r.model_used,
                model_limit: r.model_limit,
                global_used: r.global_used,
                global_limit: r.global_limit,
                reserved_for_others: r.reserved_for_others,
            }),
            Reply::Error { kind, message } => Err(reply_error(kind, message)),
            other => Err(unexpected("grow", &other)),
        }
    }

    unsafe fn release(&self, chunk: PhysicalChunk) -> Result<()> {
        let Some(cid) = self.granted.lock().remove(&chunk.raw) else {
            return Err(Error::backend(
                "broker",
                "release",
                "EBADF",
                format!("handle {:#x} is no chunk of model {}", chunk.raw, self.name),
            ));
        };
        // SAFETY: forwarded contract: the chunk is ours, live and mapped nowhere.
        if let Err(e) = unsafe { self.local.release(chunk) } {
            self.granted.lock().insert(chunk.raw, cid);
            return Err(e);
        }
        self.held.fetch_sub(chunk.size as u64, Ordering::Relaxed);
        self.give_back(cid);
        Ok(())
    }

    unsafe fn map(&self, addr: u64, chunk: PhysicalChunk) -> Result<()> {
        // SAFETY: forwarded contract.
        unsafe { self.local.map(addr, chunk) }
    }

    unsafe fn set_access(&self, addr: u64, size: usize) -> Result<()> {
        // SAFETY: forwarded contract.
        unsafe { self.local.set_access(addr, size) }
    }

    unsafe fn unmap(&self, addr: u64, size: usize) -> Result<()> {
        // SAFETY: forwarded contract.
        unsafe { self.local.unmap(addr, size) }
    }

    fn memory_info(&self) -> Result<MemoryInfo> {
        self.local.memory_info()
    }

    fn physical_bytes(&self) -> Result<u64> {
        Ok(self.held.load(Ordering::Relaxed))
    }

    unsafe fn write(&self, addr: u64, data: &[u8]) -> Result<()> {
        // SAFETY: forwarded contract.
        unsafe { self.local.write(addr, data) }
    }

    unsafe fn read(&self, addr: u64, out: &mut [u8]) -> Result<()> {
        // SAFETY: forwarded contract.
        unsafe { self.local.read(addr, out) }
    }

    unsafe fn fill(&self, addr: u64, len: usize, byte: u8) -> Result<()> {
        // SAFETY: forwarded contract.
        unsafe { self.local.fill(addr, len, byte) }
    }

    fn export_chunk(&self, chunk: PhysicalChunk) -> Result<OwnedFd> {
        self.local.export_chunk(chunk)
    }

    unsafe fn copy_async(&self, dst: u64, src: u64, bytes: usize, stream: u64) -> Result<()> {
        // SAFETY: forwarded contract.
        unsafe { self.local.copy_async(dst, src, bytes, stream) }
    }

    unsafe fn gather_async(
        &self,
        pieces: &[crate::backend::GatherPiece],
        shifts: &[crate::backend::GatherShift],
        stream: u64,
    ) -> Result<()> {
        // SAFETY: forwarded contract.
        unsafe { self.local.gather_async(pieces, shifts, stream) }
    }

    unsafe fn fill_async(&self, addr: u64, bytes: usize, byte: u8, stream: u64) -> Result<()> {
        // SAFETY: forwarded contract.
        unsafe { self.local.fill_async(addr, bytes, byte, stream) }
    }

    // Sleep and wake stage through the engine's own backend (pinned memory and a copy stream
    // on CUDA); the chunks themselves come from and go back to the broker as above.
    fn staging_alloc(&self, bytes: usize) -> Result<*mut u8> {
        self.local.staging_alloc(bytes)
    }

    unsafe fn staging_free(&self, ptr: *mut u8, bytes: usize) -> Result<()> {
        // SAFETY: forwarded contract.
        unsafe { self.local.staging_free(ptr, bytes) }
    }

    fn copy_stream_create(&self) -> Result<u64> {
        self.local.copy_stream_create()
    }

    unsafe fn copy_stream_destroy(&self, stream: u64) -> Result<()> {
        // SAFETY: forwarded contract.
        unsafe { self.local.copy_stream_destroy(stream) }
    }

    unsafe fn copy_to_host_async(
        &self,
        dst: *mut u8,
        src: u64,
        bytes: usize,
        stream: u64,
    ) -> Result<()> {
        // SAFETY: forwarded contract.
        unsafe { self.local.copy_to_host_async(dst, src, bytes, stream) }
    }

    unsafe fn copy_from_host_async(
        &self,
        dst: u64,
        src: *const u8,
        bytes: usize,
        stream: u64,
    ) -> Result<()> {
        // SAFETY: forwarded contract.
        unsafe { self.local.copy_from_host_async(dst, src, bytes, stream) }
    }

    unsafe fn marker_record(&self, stream: u64) -> Result<u64> {
        // SAFETY: forwarded contract.
        unsafe { self.local.marker_record(stream) }
    }

    unsafe fn marker_wait(&self, marker: u64) -> Result<()> {
        // SAFETY: forwarded contract.
        unsafe { self.local.marker_wait(marker) }
    }
}

#[cfg(test)]
mod tests {
    use std::time::{Duration, Instant};

    use super::*;
    use crate::backend::host::{ChunkFiles, HostBackend, DEFAULT_GRANULARITY};
    use crate::broker::{Broker, BrokerConfig};

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
}
