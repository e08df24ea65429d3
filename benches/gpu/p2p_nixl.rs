//! The NIXL columns of `gpu-bench p2p` (feature `nixl`): the same blocks moved by NIXL between
//! the same two processes, for the fully contiguous layout at every block size.
//!
//! Each process has one agent (UCX backend): `prefill` and `decode`. After our path's case is
//! done, the decode registers (b) a `cuMemAlloc` buffer holding the case's N blocks and (a) an
//! elastic layout over its pool holding the first [`VMM_BYTES`] of them (registered page by
//! page through the agent's mapping hook), zeroes both and offers them over the side channel of
//! `nixl_peer.rs` (a Unix socket of its own). The prefill, which has written a byte pattern into
//! the same kinds of memory on its device, **WRITEs** it into the decode's (prefill -> decode,
//! initiated by the prefill): plain once to warm up (connection, IPC handles) and [`RUNS`]
//! times timed, VMM once (UCX moves VMM memory between processes by software emulation,
//! ~0.5 GB/s, so its size is bounded).
//!
//! Why a WRITE, not a READ by the decode: on one GPU UCX 1.23 logs "cuda-ipc get zcopy disabled
//! as no nvlinks detected", so a READ of plain memory falls back to software emulation over
//! tcp/lo (0.5 GB/s on an H100), where a WRITE of it goes through `cuda_ipc` (1378 GB/s between
//! the same two processes).
//!
//! The prefill times each WRITE (post to completion) and sends the times over the side channel
//! after each round; the decode zeroes its memory before each round and checks every byte after
//! it (the warm-up, the timed runs, the VMM run: each block's first and last bytes name it), so
//! a wrong number cannot be printed as a result.

use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::process::Child;
use std::sync::Arc;

use cudarc::driver::{result, sys as cu, CudaContext};
use elastic_vmm::layout::{
    ElasticLayout, KvLayout, LayoutBuilder, LayoutConfig, MemoryRange, REGION_ALIGNMENT,
};
use elastic_vmm::nixl::{self, NixlAgent, RegisteredLayout};
use elastic_vmm::{Backend, MemOptions, MemoryKind, Pool};

use super::{config, RUNS, WAIT};
use crate::nixl_peer::{self as peer, Offer, PeerError, Remote, TransferReport, Written};
use crate::{BoxError, MIB};

/// The variable that gives the decode process the side channel's socket.
pub const SOCKET_VAR: &str = "EVMM_NIXL_SOCKET";
/// At most this much of each case moves as VMM memory through NIXL (one run).
pub const VMM_BYTES: u64 = 64 * MIB;
/// Rounds of WRITEs per set of a case, and WRITEs per round: plain a warm-up then [`RUNS`],
/// VMM one.
const ROUNDS: [&[usize]; 2] = [&[1, RUNS], &[1]];
/// How long the decode waits for the word that a round is over: longer than the prefill may
/// take for one (each of its WRITEs gives up after [`WAIT`], ending its process).
const ROUND_WAIT: std::time::Duration = WAIT.saturating_mul(RUNS as u32 + 1);

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
    // layout and its registrations (`Plain` drops them first). No WRITE uses it when it goes:
    // the prefill's WRITEs from it have finished (`peer::write` waits, or ends the process),
    // and the decode lets it go only after the prefill's word that the WRITEs into it are over
    // (`peer::wait_written`, or the process ends).
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
        .elastic(pool, &MemOptions::new())
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
        unsafe { backend.copies().write(addr + off, bytes) }.map_err(|e| e.into())
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
        // SAFETY: as in `put_pattern`; no WRITE into these bytes is running (the prefill said
        // its round is over).
        unsafe { backend.copies().read(addr + off, out) }.map_err(|e| e.into())
    })
    .map_err(boxed)
}

fn zero(backend: &Arc<dyn Backend>, addr: u64, len: u64) -> Result<(), BoxError> {
    // SAFETY: as in `put_pattern` (no WRITE into these bytes is running: none has started,
    // or the prefill said its round is over); the fill is finished when this returns.
    unsafe { backend.copies().fill(addr, usize::try_from(len)?, 0) }?;
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

    /// Write `n` blocks of `block` bytes from plain memory, and the first [`vmm_blocks`] of
    /// them from an elastic layout of `pool`, into the memory the decode offers for this case:
    /// set by set, round by round ([`ROUNDS`]), each round reported to the decode (with the
    /// WRITEs' times), which checks its bytes. A WRITE that fails, or an offer that cannot be
    /// written, is reported as such (a column without a number); only a broken exchange is an
    /// error.
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
        let local = [
            peer::block_descriptors(&self.agent, &src.layout, n).map_err(boxed)?,
            peer::block_descriptors(&self.agent, &kv, nv).map_err(boxed)?,
        ];
        let frame = peer::recv_frame_within(stream, &self.agent, WAIT)
            .map_err(|e| format!("waiting for the decode's NIXL offer: {e}"))?;
        let offer = Offer::decode(&frame).and_then(|o| check_offer(o, block, [n, nv]));
        let remote = match &offer {
            Ok(o) => Remote::load(&self.agent, &o.metadata).map_err(|e| e.to_string()),
            Err(e) => Err(e.clone()),
        };
        for (set, rounds) in ROUNDS.iter().enumerate() {
            for (k, &count) in rounds.iter().enumerate() {
                let outcome = match (&offer, &remote) {
                    (Ok(o), Ok(r)) => (0..count)
                        .map(|_| {
                            peer::write(&self.agent, r, &local[set].descs, &o.sets[set].descs, WAIT)
                                .map_err(|e| e.to_string())
                        })
                        .collect(),
                    (Err(e), _) | (_, Err(e)) => Err(e.clone()),
                };
                let more = k + 1 < rounds.len() && outcome.is_ok();
                let written = Written {
                    set: set as u32,
                    more,
                    outcome,
                };
                let verified =
                    peer::report_round(stream, &self.agent, &written, WAIT).map_err(boxed)?;
                if !(more && verified) {
                    break;
                }
            }
        }
        drop(remote);
        drop(kv);
        drop(src);
        Ok(())
    }
}

/// The decode's offer if it has the two sets a case needs (`blocks[i]` blocks of `block` bytes
/// in set `i`), else why not.
fn check_offer(offer: Offer, block: u64, blocks: [usize; 2]) -> Result<Offer, String> {
    if offer.sets.len() != blocks.len() {
        return Err(format!(
            "the decode's offer has {} sets, expected {}",
            offer.sets.len(),
            blocks.len()
        ));
    }
    for ((what, s), want) in ["plain", "VMM"].iter().zip(&offer.sets).zip(blocks) {
        if (s.blocks, s.block_bytes) != (want as u64, block) {
            return Err(format!(
                "{what} offer: {} blocks of {} bytes, expected {want} of {block}",
                s.blocks, s.block_bytes
            ));
        }
    }
    Ok(offer)
}

/// One NIXL column of a case: GB/s and descriptor pairs posted, or why there is no number
/// (a failed WRITE, or bytes that did not verify).
pub type Column = Result<(f64, usize), String>;

/// What NIXL did for one case: timed by the prefill, verified by the decode.
pub struct Figures {
    /// Plain memory: median of [`RUNS`] WRITEs after a warm-up.
    pub plain: Column,
    /// VMM memory: one WRITE of the first [`VMM_BYTES`] of the blocks.
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

    /// Offer this case's memory to the prefill (plain: `n` blocks of `block` bytes; VMM: the
    /// first [`vmm_blocks`] of them), zeroed; take the prefill's WRITEs round by round, check
    /// every byte after each, and make the columns of the prefill's times. A WRITE that failed
    /// or did not verify is a column without a number, not an error: the other figures still
    /// print. The memory goes only once the prefill said its WRITEs into it are over
    /// ([`peer::wait_written`] ends the process otherwise).
    pub fn measure(
        &mut self,
        backend: &Arc<dyn Backend>,
        pool: &Pool,
        block: u64,
        n: usize,
    ) -> Result<Figures, BoxError> {
        let nv = vmm_blocks(block, n);
        let dst = plain(&self.agent, &self.ctx, self.device, config(block, n))?;
        let kv = vmm(&self.agent, pool, config(block, nv))?;
        let targets = [(dst.buf.ptr, n), (base(&kv)?, nv)];
        for &(addr, blocks) in &targets {
            zero(backend, addr, blocks as u64 * block)?;
        }
        let sets = vec![
            peer::block_descriptors(&self.agent, &dst.layout, n).map_err(boxed)?,
            peer::block_descriptors(&self.agent, &kv, nv).map_err(boxed)?,
        ];
        // After every registration: the metadata carries them all.
        let metadata = self
            .agent
            .raw()
            .get_local_md()
            .map_err(|e| format!("get_local_md of agent decode: {e}"))?;
        let offer = Offer { metadata, sets }.encode()?;
        peer::send_frame(&mut self.stream, &offer)
            .map_err(|e| format!("sending the NIXL offer: {e}"))?;
        // From here on the prefill may write into `dst` and `kv`: nothing below returns before
        // the prefill's word that its WRITEs into both are over, but a failed answer (then the
        // prefill waits for it and starts no WRITE).
        let [(pa, pn), (va, vn)] = targets;
        let plain = column(
            self.rounds(backend, 0, pa, pn, block)?,
            ROUNDS[0],
            pn as u64 * block,
        );
        let vmm = column(
            self.rounds(backend, 1, va, vn, block)?,
            ROUNDS[1],
            vn as u64 * block,
        );
        drop(kv);
        drop(dst);
        Ok(Figures { plain, vmm })
    }

    /// The rounds of WRITEs into set `set` of the offer (`blocks` blocks of `block` bytes at
    /// `addr`): after each, every byte checked, the set zeroed again when more rounds follow,
    /// the answer sent. The rounds' reports, or why the column has no number; an error only
    /// when the answer could not be sent.
    fn rounds(
        &mut self,
        backend: &Arc<dyn Backend>,
        set: u32,
        addr: u64,
        blocks: usize,
        block: u64,
    ) -> Result<Result<Vec<Vec<TransferReport>>, String>, BoxError> {
        let mut rounds = Vec::new();
        loop {
            let w = peer::wait_written(&mut self.stream, &self.agent, set, ROUND_WAIT);
            let more = w.more;
            let checked = w.outcome.and_then(|reports| {
                check_pattern(backend, addr, blocks, block).map_err(|e| e.to_string())?;
                if more {
                    zero(backend, addr, blocks as u64 * block).map_err(|e| e.to_string())?;
                }
                Ok(reports)
            });
            peer::answer(&mut self.stream, checked.is_ok())
                .map_err(|e| format!("answering the prefill: {e}"))?;
            match checked {
                Ok(r) => rounds.push(r),
                Err(e) => return Ok(Err(e)),
            }
            if !more {
                return Ok(Ok(rounds));
            }
        }
    }
}

/// A column from the rounds of one set: they must have `shape` WRITEs each of `bytes` bytes;
/// GB/s of the median WRITE of the last round, descriptor pairs of the first.
fn column(rounds: Result<Vec<Vec<TransferReport>>, String>, shape: &[usize], bytes: u64) -> Column {
    let rounds = rounds?;
    let counts: Vec<usize> = rounds.iter().map(Vec::len).collect();
    if counts != shape {
        return Err(format!(
            "the prefill reported rounds of {counts:?} WRITEs, expected {shape:?}"
        ));
    }
    if let Some(r) = rounds.iter().flatten().find(|r| r.bytes != bytes) {
        return Err(format!(
            "the prefill reported a WRITE of {} bytes, expected {bytes}",
            r.bytes
        ));
    }
    let (Some(first), Some(last)) = (rounds.first().and_then(|r| r.first()), rounds.last()) else {
        return Err("the prefill reported no WRITE".into());
    };
    let mut times: Vec<f64> = last.iter().map(|r| r.elapsed.as_secs_f64()).collect();
    times.sort_by(f64::total_cmp);
    match times.get(times.len() / 2) {
        Some(&t) if t > 0.0 => Ok((bytes as f64 / t / 1e9, first.descriptors)),
        _ => Err(format!("the prefill reported WRITE times {times:?}")),
    }
}
