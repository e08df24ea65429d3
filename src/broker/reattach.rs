//! The engine's side of leases (the broker's is `lease.rs`): arm a lease on a model, keep its
//! regions and a blob across the engine's end, and take them over in a new engine process at
//! the same offsets of a region of its own, their bytes as they were.
//!
//! ```no_run
//! # use elastic_vmm::{broker::BrokerClient, MemOptions, ModelConfig, Tag};
//! # fn main() -> elastic_vmm::Result<()> {
//! let engine = BrokerClient::connect("/tmp/elastic-vmm-0/cuda0.sock", "engine-1")?;
//! let llama = engine.register(ModelConfig::new("llama", 64 << 30, 40 << 30))?;
//! let lease = llama.lease()?;                       // keep lease.token for the next engine
//! let weights = llama.reserve_region_with(16 << 30, &MemOptions::new().tag(Tag::Weights))?;
//! weights.map(0, 16 << 30)?;                        // ... load the weights into it
//! llama.keep(&weights)?;                            // kept if this engine dies from here on
//! llama.store_blob(b"tensor names and offsets")?;
//! // In the next engine process, the same user, within the broker's grace period:
//! let back = engine.attach(ModelConfig::new("llama", 64 << 30, 40 << 30), &lease.token)?;
//! let weights = &back.regions[0];                   // mapped, the same bytes
//! # Ok(()) }
//! ```

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use super::client::{reply_error, unexpected, BrokerClient};
use super::protocol::{KeptChunk, LeaseToken, Reply, Request, MAX_BATCH, MAX_KEEP};
use super::remote::RemoteModel;
use crate::backend::PhysicalChunk;
use crate::error::{Error, Result};
use crate::pool::{MemOptions, Region};
use crate::shared::ModelConfig;
use crate::tag::Tag;

/// A model's lease: the token a later engine presents, and how long the broker holds the
/// kept memory once this engine is gone.
#[derive(Debug, Clone, Copy)]
pub struct Lease {
    /// Give it to the next engine (as the same user); void once used.
    pub token: LeaseToken,
    /// The broker's grace period.
    pub grace: Duration,
}

/// A leased model this engine took over ([`BrokerClient::attach`]).
pub struct Reattached {
    /// The model, this engine's now, under its old limit, guarantee and priority.
    pub model: RemoteModel,
    /// The kept regions, mapped, with the bytes the last engine left, in tag order; each
    /// carries its tag ([`Region::tag`]).
    pub regions: Vec<Region>,
    /// The blob the last engine stored.
    pub blob: Vec<u8>,
    /// The lease, with a new token for the engine after this one.
    pub lease: Lease,
}

impl std::fmt::Debug for Reattached {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Reattached")
            .field("model", &self.model.id())
            .field("regions", &self.regions.len())
            .field("blob", &self.blob.len())
            .finish()
    }
}

impl Reattached {
    /// The region kept under `tag`.
    pub fn region(&self, tag: &Tag) -> Option<&Region> {
        self.regions.iter().find(|r| r.tag() == tag)
    }
}

impl RemoteModel {
    fn done(&self, what: &'static str, request: Request) -> Result<()> {
        match self.client().request(request)?.0 {
            Reply::Done => Ok(()),
            Reply::Error { kind, message } => Err(reply_error(kind, message)),
            other => Err(unexpected(what, &other)),
        }
    }

    /// Put this model under a lease: from now on, if this engine's connection ends without
    /// unregistering the model (the process crashes, or exits after
    /// [`RemoteModel::keep_on_exit`]), the broker keeps the regions named by
    /// [`RemoteModel::keep`] and the blob of [`RemoteModel::store_blob`], charged to the model,
    /// for its grace period, and releases the rest; an engine of the same user presenting the
    /// token takes them over ([`BrokerClient::attach`]). Dropping the model as usual
    /// unregisters it and ends the lease. Asked again, it gives a new token (the old one is
    /// void).
    pub fn lease(&self) -> Result<Lease> {
        match self
            .client()
            .request(Request::Lease { model: self.key() })?
            .0
        {
            Reply::Leased { token, grace_ms } => Ok(Lease {
                token,
                grace: Duration::from_millis(grace_ms),
            }),
            Reply::Error { kind, message } => Err(reply_error(kind, message)),
            other => Err(unexpected("lease", &other)),
        }
    }

    /// Keep `region` (of this model's pool) under its tag across this engine's end: its
    /// chunks mapped now and where they lie (the holes stay holes). Keeping again replaces
    /// what was kept under that tag; a chunk of it unmapped later (given back) drops the
    /// region from the lease. Needs [`RemoteModel::lease`] first.
    pub fn keep(&self, region: &Region) -> Result<()> {
        if !Arc::ptr_eq(region.pool().inner(), self.pool().inner()) {
            return Err(Error::InvalidArgument(format!(
                "model {}: a region of another pool cannot be kept",
                self.id()
            )));
        }
        let tag = region.tag().as_str().to_string();
        let placed = self.pool().placed_chunks_in(region.offset(), region.len());
        let mut kept = Vec::with_capacity(placed.len());
        for (at, chunk) in placed {
            let cid = self.backend.chunk_id(chunk).ok_or_else(|| {
                Error::InvalidArgument(format!(
                    "model {}: the chunk at {at:#x} of region {tag:?} is not the broker's",
                    self.id()
                ))
            })?;
            let offset = at.checked_sub(region.offset()).ok_or_else(|| {
                Error::InvalidArgument(format!(
                    "model {}: a chunk at {at:#x} starts before region {tag:?} at {:#x}",
                    self.id(),
                    region.offset()
                ))
            })?;
            kept.push(KeptChunk { chunk: cid, offset });
        }
        let mut first = true;
        for batch in kept
            .chunks(MAX_KEEP)
            .chain(kept.is_empty().then_some(&[][..]))
        {
            let sent = self.done(
                "keep",
                Request::Keep {
                    model: self.key(),
                    tag: tag.clone(),
                    len: region.len(),
                    chunks: batch.to_vec(),
                    append: !first,
                },
            );
            if let Err(e) = sent {
                // Half a region is not kept.
                if !first {
                    let _ = self.forget(region.tag());
                }
                return Err(e);
            }
            first = false;
        }
        // Unmapping any of it from now on makes the broker forget it (`ModelBackend::unmap`).
        self.backend
            .kept
            .lock()
            .insert(tag, (region.addr(), region.addr() + region.len()));
        Ok(())
    }

    /// Stop keeping the region of `tag` (its memory stays this model's).
    pub fn forget(&self, tag: &Tag) -> Result<()> {
        self.backend.kept.lock().remove(tag.as_str());
        self.done(
            "forget",
            Request::Forget {
                model: self.key(),
                tag: tag.as_str().to_string(),
            },
        )
    }

    /// Store `blob` with the lease for the next engine (at most
    /// [`super::protocol::MAX_BLOB`] bytes: block tables, prefix hashes, tensor names and
    /// offsets), replacing the last one.
    pub fn store_blob(&self, blob: &[u8]) -> Result<()> {
        self.done(
            "store blob",
            Request::StoreBlob {
                model: self.key(),
                blob: blob.to_vec(),
            },
        )
    }

    /// This engine is about to exit and keeps the lease: from now on, memory this model's pool
    /// releases is not given back to the broker and dropping the model does not unregister
    /// it, so when the connection ends the lease holds its kept regions (the rest goes back
    /// then). Without a lease the connection's end takes everything back, as always.
    pub fn keep_on_exit(&self) {
        self.backend.keeping.store(true, Ordering::Release);
    }
}

impl BrokerClient {
    /// Take over the held lease of model `config`'s id, presenting `token` (this engine's user
    /// must be the lease's): the model becomes this engine's under its old limit, guarantee
    /// and priority (`config`'s are not used; its capacity, pool settings and reclaim callback
    /// are), its kept regions are mapped at their old offsets of regions of this model's pool,
    /// with their bytes, and the blob comes back. The token is void from then on; the lease
    /// goes on under the new one. Refused: another user's lease or none ("unknown"), a wrong
    /// token, one attached elsewhere or whose previous engine's process still lives (busy).
    /// A failure after the broker gave the model over unregisters it: its memory goes back.
    pub fn attach(&self, config: ModelConfig, token: &LeaseToken) -> Result<Reattached> {
        let name = config.parts().id.to_string();
        let a = match self
            .request(Request::Attach {
                model: name,
                token: *token,
            })?
            .0
        {
            Reply::Attached(a) => a,
            Reply::Error { kind, message } => return Err(reply_error(kind, message)),
            other => return Err(unexpected("attach", &other)),
        };
        let model = self.open_model(a.model, &config, None)?;
        match map_kept(&model, &a) {
            Ok(regions) => {
                let kept: Vec<(String, (u64, u64))> = regions
                    .iter()
                    .map(|r| (r.tag().as_str().to_string(), (r.addr(), r.addr() + r.len())))
                    .collect();
                model.backend.kept.lock().extend(kept);
                // The presented token is void from here on.
                let lease = model.lease()?;
                tracing::info!(model = %model.id(), regions = regions.len(), "lease attached");
                Ok(Reattached {
                    model,
                    regions,
                    blob: a.blob,
                    lease,
                })
            }
            Err(e) => {
                // Nothing goes back to the broker: whatever this process imported and mapped
                // is let go here (the regions with the model), then the lease holds again,
                // under the same token.
                model.keep_on_exit();
                let key = model.key();
                let client = model.client().clone();
                drop(model);
                if let Err(d) = client.request(Request::Detach { model: key }) {
                    tracing::warn!(error = %d, "giving a failed attach back to its lease failed");
                }
                Err(e)
            }
        }
    }
}

/// Map the kept regions of `a` into `model`'s pool; on failure every chunk this process
/// imported and did not map is let go (mapped ones go with the regions).
fn map_kept(model: &RemoteModel, a: &super::protocol::Attachment) -> Result<Vec<Region>> {
    let mut regions = Vec::with_capacity(a.regions.len());
    for r in &a.regions {
        let tag = Tag::named(&r.tag);
        let region = model.reserve_region_with(r.len, &MemOptions::new().tag(tag))?;
        let mut placed = take_kept(model, &r.tag, r.chunks)?.into_iter().peekable();
        // Back-to-back runs of chunks map in one adoption each.
        while let Some((at, first)) = placed.next() {
            let mut run = vec![first];
            let mut end = at + first.size as u64;
            while let Some(&(next, c)) = placed.peek() {
                if next != end {
                    break;
                }
                end += c.size as u64;
                run.push(c);
                placed.next();
            }
            // The run is consumed either way (released on failure); the rest is let go.
            if let Err(e) = region.adopt(at, run) {
                model.backend.let_go(placed.map(|(_, c)| c));
                return Err(e);
            }
        }
        regions.push(region);
    }
    Ok(regions)
}

/// The `count` kept chunks of region `tag`, imported, each with its offset in the region.
fn take_kept(model: &RemoteModel, tag: &str, count: u32) -> Result<Vec<(u64, PhysicalChunk)>> {
    let mut out = Vec::with_capacity(count as usize);
    let mut from = 0u32;
    while from < count {
        let n = (count - from).min(MAX_BATCH);
        let (reply, fds) = model.client().request(Request::TakeKept {
            model: model.key(),
            tag: tag.to_string(),
            from,
            count: n,
        })?;
        let (chunks, sizes) = match reply {
            Reply::KeptChunks { chunks, sizes } => (chunks, sizes),
            Reply::Error { kind, message } => return Err(reply_error(kind, message)),
            other => return Err(unexpected("take kept", &other)),
        };
        if chunks.len() != n as usize || sizes.len() != chunks.len() || fds.len() != chunks.len() {
            return Err(Error::Ipc {
                op: "take kept",
                detail: format!(
                    "region {tag:?}: {n} chunks asked, {} ids, {} sizes and {} descriptors came",
                    chunks.len(),
                    sizes.len(),
                    fds.len()
                ),
            });
        }
        match model.backend.import_kept(&chunks, &sizes, fds) {
            Ok(imported) => out.extend(chunks.iter().map(|k| k.offset).zip(imported)),
            Err(e) => {
                model.backend.let_go(out.into_iter().map(|(_, c)| c));
                return Err(e);
            }
        }
        from += n;
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::time::{Duration, Instant};

    use crate::backend::host::{ChunkFiles, HostBackend, DEFAULT_GRANULARITY};
    use crate::backend::Backend;
    use crate::broker::protocol::LeaseState;
    use crate::broker::{Broker, BrokerClient, BrokerConfig};
    use crate::shared::ModelConfig;

    /// A broker that stops ends every lease: the memory a lease keeps (here one whose engine's
    /// connection closed while its process lives, so waiting) is released with the broker's
    /// other chunks, not leaked.
    #[test]
    fn a_stopped_broker_ends_every_lease() {
        let host = Arc::new(
            HostBackend::with_chunk_files(DEFAULT_GRANULARITY, ChunkFiles::PerChunk).unwrap(),
        );
        let socket = std::env::temp_dir()
            .join(format!("evmm-unit-lease-stop-{}", std::process::id()))
            .join("b.sock");
        let broker = Broker::start(host.clone(), BrokerConfig::new(socket, 64 << 20)).unwrap();
        let client = BrokerClient::connect(broker.socket(), "unit").unwrap();
        let model = client
            .register(ModelConfig::new("m", 1 << 30, 32 << 20))
            .unwrap();
        model.lease().unwrap();
        let region = model.reserve_region(8 << 20).unwrap();
        region.map(0, 8 << 20).unwrap();
        model.keep(&region).unwrap();
        model.keep_on_exit();
        drop(region);
        drop(model);
        drop(client);
        let end = Instant::now() + Duration::from_secs(10);
        loop {
            let s = broker.snapshot();
            let state = s
                .models
                .first()
                .and_then(|m| m.lease.as_ref())
                .map(|l| l.state);
            if state == Some(LeaseState::Waiting) {
                assert_eq!(s.models[0].lease.as_ref().unwrap().kept, 8 << 20);
                break;
            }
            assert!(Instant::now() < end, "the lease never waited: {s:?}");
            std::thread::sleep(Duration::from_millis(5));
        }
        assert!(host.physical_bytes().unwrap() >= 8 << 20);
        broker.shutdown();
        assert_eq!(host.physical_bytes().unwrap(), 0, "every chunk released");
    }
}
