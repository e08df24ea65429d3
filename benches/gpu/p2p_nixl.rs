//! The NIXL columns of `gpu-bench p2p` (feature `nixl`): the same blocks moved by NIXL between
//! the same two processes, for the fully contiguous layout at every block size.
//!
//! Each process has one agent (UCX backend): `prefill` and `decode`. After our path's case is
//! done, the prefill writes a byte pattern into (b) a `cuMemAlloc` buffer holding the case's N
//! blocks and (a) an elastic layout over its pool holding the first [`VMM_BYTES`] of them
//! (registered page by page through the agent's mapping hook), and offers both over the side
//! channel of `nixl_peer.rs` (a Unix socket of its own). The decode **READs** them (prefill ->
//! decode, initiated by the decode, as our path is) into the same kinds of memory on its
//! device: plain once to warm up (connection, IPC handles) and [`RUNS`] times timed, VMM once
//! (UCX moves VMM memory between processes by software emulation, ~0.5 GB/s, so its size is
//! bounded). Destinations are zeroed before every READ; the warm-up's and the last READ's bytes
//! are checked in full (each block's first and last bytes name it), so a wrong number cannot be
//! printed as a result.

use std::io::Write;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::process::Child;
use std::sync::Arc;

use cudarc::driver::{result, sys as cu, CudaContext};
use elastic_vmm::layout::{
    ElasticLayout, KvLayout, LayoutBuilder, LayoutConfig, MemoryRange, REGION_ALIGNMENT,
};
use elastic_vmm::nixl::{self, NixlAgent, RegisteredLayout};
use elastic_vmm::{Backend, MemoryKind, Pool};

use super::{config, RUNS, WAIT};
use crate::nixl_peer::{self as peer, DescSet, Offer, PeerError, Remote, DONE, FAILED};
use crate::{BoxError, MIB};

/// The variable that gives the decode process the side channel's socket.
pub const SOCKET_VAR: &str = "EVMM_NIXL_SOCKET";
/// At most this much of each case moves as VMM memory through NIXL (one run).
pub const VMM_BYTES: u64 = 64 * MIB;

/// Blocks of a case that move as VMM memory.
pub fn vmm_blocks(block: u64, n: usize) -> usize {
    ((VMM_BYTES / block) as usize).clamp(1, n)
}

fn boxed(e: PeerError) -> BoxError {
    e.to_string().into()
}

/// A `cuMemAlloc` buffer, freed on drop.
struct DeviceBuffer {
    ctx: Arc<CudaContext>,
    ptr: cu::CUdeviceptr,
    len: u64,
}

impl DeviceBuffer {
    fn new(ctx: &Arc<CudaContext>, len: u64) -> Result<Self, BoxError> {
        ctx.bind_to_thread()?;
        // SAFETY: a plain allocation on the bound context; freed once, in Drop.
        let ptr = unsafe { result::malloc_sync(usize::try_from(len)?) }
            .map_err(|e| format!("cuMemAlloc of {len} bytes: {e:?}"))?;
        Ok(DeviceBuffer {
            ctx: ctx.clone(),
            ptr,
            len,
        })
    }
}

impl Drop for DeviceBuffer {
    fn drop(&mut self) {
        let r = self.ctx.bind_to_thread().map_err(|e| format!("{e:?}"));
        // SAFETY: allocated by `new` on this context and freed only here; whatever was built
        // over it (a registered layout) is dropped before (see `Plain`).
        let r =
            r.and_then(|()| unsafe { result::free_sync(self.ptr) }.map_err(|e| format!("{e:?}")));
        if let Err(e) = r {
            eprintln!("cuMemFree of {} bytes at {:#x}: {e}", self.len, self.ptr);
        }
    }
}

/// Plain device memory holding `num_blocks` blocks, registered with an agent. Fields drop in
/// order: the registrations (with the layout) before the buffer.
struct Plain {
    layout: RegisteredLayout,
    buf: DeviceBuffer,
}

fn plain(
    agent: &NixlAgent,
    ctx: &Arc<CudaContext>,
    device: i32,
    config: LayoutConfig,
) -> Result<Plain, BoxError> {
    let len = config.sizes()?.total;
    let buf = DeviceBuffer::new(ctx, len)?;
    if buf.ptr % REGION_ALIGNMENT != 0 {
        return Err(format!(
            "cuMemAlloc returned {:#x}, not {REGION_ALIGNMENT}-byte aligned",
            buf.ptr
        )
        .into());
    }
    let range = MemoryRange {
        addr: buf.ptr,
        len,
        kind: MemoryKind::Device,
        device: Some(device),
    };
    // SAFETY: `range` is the live cuMemAlloc buffer `buf` of `device`, which outlives the
    // layout and its registrations (`Plain` drops them first); every READ over it has finished
    // before that (`peer::read` waits, or ends the process).
    let layout = unsafe {
        LayoutBuilder::new()
            .config(config)
            .fully_contiguous()
            .regions(vec![range])
    }
    .build()?;
    Ok(Plain {
        layout: agent.register(layout)?,
        buf,
    })
}

/// An elastic layout of `config` over `pool`, every block backed, each page registered with
/// `agent` by its mapping hook (deregistered before it is unmapped, on drop).
fn vmm(agent: &NixlAgent, pool: &Pool, config: LayoutConfig) -> Result<ElasticLayout, BoxError> {
    let kv = LayoutBuilder::new()
        .config(config)
        .fully_contiguous()
        .elastic(pool)
        .hook(agent.mapping_hook())
        .build()?;
    kv.ensure_backed(0..config.num_blocks)?;
    Ok(kv)
}

/// The address of block 0 of a fully contiguous layout (block `i` is `i` blocks further).
fn base(layout: &dyn KvLayout) -> Result<u64, BoxError> {
    Ok(layout.views().block(0)?[0].addr)
}

/// Write the pattern into `blocks` blocks from `addr`.
fn put_pattern(
    backend: &Arc<dyn Backend>,
    addr: u64,
    blocks: usize,
    block: u64,
) -> Result<(), BoxError> {
    peer::write_pattern(blocks, block, |off, bytes| {
        // SAFETY: `[addr + off, + len)` lies in the caller's `blocks` blocks, mapped with
        // access (a backed fully contiguous layout or a live cuMemAlloc buffer of the backend's
        // context), and nothing else uses them now.
        unsafe { backend.write(addr + off, bytes) }.map_err(|e| e.into())
    })
    .map_err(boxed)
}

/// Check every byte of `blocks` blocks from `addr` against the pattern.
fn check_pattern(
    backend: &Arc<dyn Backend>,
    addr: u64,
    blocks: usize,
    block: u64,
) -> Result<(), BoxError> {
    peer::verify_pattern(blocks, block, |off, out| {
        // SAFETY: as in `put_pattern`; no READ into these bytes is running.
        unsafe { backend.read(addr + off, out) }.map_err(|e| e.into())
    })
    .map_err(boxed)
}

fn zero(backend: &Arc<dyn Backend>, addr: u64, len: u64) -> Result<(), BoxError> {
    // SAFETY: as in `put_pattern`; the fill is finished when this returns.
    unsafe { backend.fill(addr, usize::try_from(len)?, 0) }?;
    Ok(())
}

/// Whether a case of `p2p` has NIXL columns: the fully contiguous layout, blocks in order.
pub fn measured(case: super::Case) -> bool {
    matches!(case.kind, elastic_vmm::layout::LayoutKind::FullyContiguous) && !case.scattered
}

/// The prefill's half: its agent and the side channel.
pub struct PrefillNixl {
    agent: NixlAgent,
    ctx: Arc<CudaContext>,
    device: i32,
    listener: UnixListener,
    path: PathBuf,
    stream: Option<UnixStream>,
}

impl PrefillNixl {
    /// The agent `prefill` and a listening socket in `dir`, or `None` (said why) when the NIXL
    /// library cannot be loaded.
    pub fn open(dir: &Path, device: i32) -> Result<Option<Self>, BoxError> {
        if let Err(e) = nixl::available() {
            println!("NIXL columns skipped: {e}");
            return Ok(None);
        }
        // The context is made current on this thread before UCX starts.
        let ctx = CudaContext::new(device as usize)?;
        ctx.bind_to_thread()?;
        let agent = NixlAgent::new("prefill")?;
        let path = dir.join("nixl");
        let _ = std::fs::remove_file(&path);
        let listener = UnixListener::bind(&path)?;
        Ok(Some(PrefillNixl {
            agent,
            ctx,
            device,
            listener,
            path,
            stream: None,
        }))
    }

    /// The socket the decode process connects to (give it through [`SOCKET_VAR`]).
    pub fn socket(&self) -> &Path {
        &self.path
    }

    /// Take the decode process's connection (it connects after its `PeerLink`).
    pub fn accept(&mut self, child: &mut Child) -> Result<(), BoxError> {
        let stream = peer::accept_within(&self.listener, WAIT, || match child.try_wait()? {
            Some(st) => Err(format!("the decode process ended before connecting: {st}").into()),
            None => Ok(()),
        })
        .map_err(boxed)?;
        self.stream = Some(stream);
        Ok(())
    }

    /// Offer `n` blocks of `block` bytes in plain memory and the first [`vmm_blocks`] of them
    /// in an elastic layout of `pool`, and keep them until the decode has read them.
    pub fn serve(
        &mut self,
        backend: &Arc<dyn Backend>,
        pool: &Pool,
        block: u64,
        n: usize,
    ) -> Result<(), BoxError> {
        let stream = self
            .stream
            .as_mut()
            .ok_or("the decode process is not connected to the NIXL side channel")?;
        let nv = vmm_blocks(block, n);
        let src = plain(&self.agent, &self.ctx, self.device, config(block, n))?;
        put_pattern(backend, src.buf.ptr, n, block)?;
        let kv = vmm(&self.agent, pool, config(block, nv))?;
        put_pattern(backend, base(&kv)?, nv, block)?;
        let sets = vec![
            peer::block_descriptors(&self.agent, &src.layout, n).map_err(boxed)?,
            peer::block_descriptors(&self.agent, &kv, nv).map_err(boxed)?,
        ];
        // After every registration: the metadata carries them all.
        let metadata = self
            .agent
            .raw()
            .get_local_md()
            .map_err(|e| format!("get_local_md of agent prefill: {e}"))?;
        let offer = Offer { metadata, sets }.encode()?;
        peer::send_frame(stream, &offer)?;
        peer::wait_answer(stream, &self.agent, WAIT).map_err(boxed)?;
        drop(kv);
        drop(src);
        Ok(())
    }
}

/// One NIXL column of a case: GB/s and descriptor pairs posted, or why there is no number
/// (a failed READ, or bytes that did not verify).
pub type Column = Result<(f64, usize), String>;

/// What NIXL did for one case, as the decode measured it.
pub struct Figures {
    /// Plain memory: median of [`RUNS`] READs after a warm-up.
    pub plain: Column,
    /// VMM memory: one READ of the first [`VMM_BYTES`] of the blocks.
    pub vmm: Column,
}

/// The NIXL columns' header, to follow the table's.
pub fn header() -> String {
    format!(
        " {:>9} {:>12} {:>10} {:>10} {:>10}",
        "nixl desc", "nixl plain", "nixl vmm", "ours/plain", "ours/vmm"
    )
}

/// The NIXL cells of a case without NIXL figures.
pub fn no_cells() -> String {
    format!(
        " {:>9} {:>12} {:>10} {:>10} {:>10}",
        "-", "-", "-", "-", "-"
    )
}

impl Figures {
    /// The NIXL cells of a case where ours moved `ours_gbs`.
    pub fn cells(&self, ours_gbs: f64) -> String {
        let descs = |c: &Column| c.as_ref().map_or("x".to_string(), |&(_, d)| d.to_string());
        let gbs = |c: &Column, prec: usize| {
            c.as_ref()
                .map_or("failed".to_string(), |&(g, _)| format!("{g:.prec$}"))
        };
        let ratio = |c: &Column, prec: usize| {
            c.as_ref().map_or("-".to_string(), |&(g, _)| {
                format!("{:.prec$}x", ours_gbs / g)
            })
        };
        format!(
            " {:>9} {:>12} {:>10} {:>10} {:>10}",
            format!("{}/{}", descs(&self.plain), descs(&self.vmm)),
            gbs(&self.plain, 1),
            gbs(&self.vmm, 2),
            ratio(&self.plain, 2),
            ratio(&self.vmm, 0)
        )
    }

    /// Why a column has no number, one line each.
    pub fn errors(&self) -> Vec<String> {
        [("plain", &self.plain), ("VMM", &self.vmm)]
            .into_iter()
            .filter_map(|(what, c)| c.as_ref().err().map(|e| format!("  NIXL {what}: {e}")))
            .collect()
    }
}

/// The decode's half: its agent and the side channel.
pub struct DecodeNixl {
    agent: NixlAgent,
    ctx: Arc<CudaContext>,
    device: i32,
    stream: UnixStream,
}

impl DecodeNixl {
    /// Connect when the prefill gave a side channel ([`SOCKET_VAR`]); `None` otherwise.
    pub fn connect(device: i32) -> Result<Option<Self>, BoxError> {
        let Some(path) = std::env::var_os(SOCKET_VAR) else {
            return Ok(None);
        };
        let ctx = CudaContext::new(device as usize)?;
        ctx.bind_to_thread()?;
        let agent = NixlAgent::new("decode")?;
        let stream = UnixStream::connect(&path)
            .map_err(|e| format!("connecting to the NIXL side channel {path:?}: {e}"))?;
        stream.set_read_timeout(Some(WAIT))?;
        Ok(Some(DecodeNixl {
            agent,
            ctx,
            device,
            stream,
        }))
    }

    /// Receive the prefill's offer for this case, READ it, verify, answer [`DONE`] once its
    /// memory is no longer used (a READ that failed or did not verify is a column without a
    /// number, not an error: the other figures still print); [`FAILED`] when the exchange
    /// itself broke.
    pub fn measure(
        &mut self,
        backend: &Arc<dyn Backend>,
        pool: &Pool,
        block: u64,
        n: usize,
    ) -> Result<Figures, BoxError> {
        let r = self.measure_inner(backend, pool, block, n);
        let answer = if r.is_ok() { DONE } else { FAILED };
        let sent = self.stream.write_all(&[answer]);
        match (r, sent) {
            (Ok(f), Ok(())) => Ok(f),
            (Ok(_), Err(e)) => Err(format!("answering the prefill: {e}").into()),
            (Err(e), _) => Err(e),
        }
    }

    fn measure_inner(
        &mut self,
        backend: &Arc<dyn Backend>,
        pool: &Pool,
        block: u64,
        n: usize,
    ) -> Result<Figures, BoxError> {
        let offer = Offer::decode(&peer::recv_frame(&mut self.stream).map_err(boxed)?)?;
        let nv = vmm_blocks(block, n);
        let [ps, vs] = offer.sets.as_slice() else {
            return Err(format!("the offer has {} sets, expected 2", offer.sets.len()).into());
        };
        for (what, s, want) in [("plain", ps, n), ("VMM", vs, nv)] {
            if (s.blocks, s.block_bytes) != (want as u64, block) {
                return Err(format!(
                    "{what} offer: {} blocks of {} bytes, expected {want} of {block}",
                    s.blocks, s.block_bytes
                )
                .into());
            }
        }
        let remote = Remote::load(&self.agent, &offer.metadata).map_err(boxed)?;
        let plain = self
            .plain_column(backend, &remote, ps, block, n)
            .map_err(|e| e.to_string());
        let vmm = self
            .vmm_column(backend, pool, &remote, vs, block, nv)
            .map_err(|e| e.to_string());
        drop(remote);
        Ok(Figures { plain, vmm })
    }

    /// (b) plain memory: a warm-up READ (connection, IPC handles), then [`RUNS`] timed, each
    /// into zeroed memory; the warm-up's and the last one's bytes checked.
    fn plain_column(
        &self,
        backend: &Arc<dyn Backend>,
        remote: &Remote<'_>,
        offered: &DescSet,
        block: u64,
        n: usize,
    ) -> Result<(f64, usize), BoxError> {
        let dst = plain(&self.agent, &self.ctx, self.device, config(block, n))?;
        let local = peer::block_descriptors(&self.agent, &dst.layout, n).map_err(boxed)?;
        let (addr, len) = (dst.buf.ptr, dst.buf.len);
        let read = || {
            zero(backend, addr, len)?;
            peer::read(&self.agent, remote, &local.descs, &offered.descs, WAIT).map_err(boxed)
        };
        let warm = read()?;
        check_pattern(backend, addr, n, block)?;
        let mut times = Vec::with_capacity(RUNS);
        for _ in 0..RUNS {
            times.push(read()?.elapsed.as_secs_f64());
        }
        check_pattern(backend, addr, n, block)?;
        times.sort_by(f64::total_cmp);
        Ok((
            warm.bytes as f64 / times[times.len() / 2] / 1e9,
            warm.descriptors,
        ))
    }

    /// (a) VMM memory: one READ of the first `nv` blocks into an elastic layout registered
    /// page by page, its bytes checked.
    fn vmm_column(
        &self,
        backend: &Arc<dyn Backend>,
        pool: &Pool,
        remote: &Remote<'_>,
        offered: &DescSet,
        block: u64,
        nv: usize,
    ) -> Result<(f64, usize), BoxError> {
        let kv = vmm(&self.agent, pool, config(block, nv))?;
        let local = peer::block_descriptors(&self.agent, &kv, nv).map_err(boxed)?;
        let at = base(&kv)?;
        zero(backend, at, nv as u64 * block)?;
        let r =
            peer::read(&self.agent, remote, &local.descs, &offered.descs, WAIT).map_err(boxed)?;
        check_pattern(backend, at, nv, block)?;
        Ok((
            r.bytes as f64 / r.elapsed.as_secs_f64() / 1e9,
            r.descriptors,
        ))
    }
}
