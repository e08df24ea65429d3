//! NIXL between two real processes, whatever the memory (feature `nixl`): the side channel, the
//! metadata exchange, the READ and the byte pattern that proves it. Used by `gpu-bench p2p`
//! (device memory, `p2p_nixl.rs`) and by its host test in `tests/nixl.rs` (DRAM, two
//! processes), which includes this file.
//!
//! - **Side channel**: a Unix socket of its own (never the product's p2p `PeerLink` socket).
//!   The prefill sends one framed message per case (a `u32` little-endian length, then at most
//!   [`MAX_FRAME`] bytes); the decode answers one byte, [`DONE`] or [`FAILED`].
//! - **The prefill (target)** registers its memory with its agent, then sends an [`Offer`]: the
//!   agent's metadata (`get_local_md`, taken after every registration, so it carries them all)
//!   and, per set of blocks, the NIXL descriptors of those blocks (the blocks' views, split
//!   where its registrations end: one per physical chunk touched). While it waits for the
//!   answer it polls its agent's notifications, which drives its UCX worker: a transport that
//!   emulates remote reads in software (TCP, the only one UCX 1.23 has for VMM memory between
//!   processes) needs the target to make progress.
//! - **The decode (initiator)** loads the metadata (`load_remote_md`, through [`Remote`]),
//!   takes descriptors for the same blocks of its own memory, cuts both lists at the union of
//!   their boundaries ([`co_split`]) and READs ([`read`]: `create_xfer_req`, `post_xfer_req`,
//!   `get_xfer_status` until done). Dropping the [`Remote`] forgets the metadata
//!   (`invalidate_remote_md`): the prefill's registrations change from one case to the next.
//! - **Proof**: the prefill writes [`write_pattern`] into its blocks; the decode zeroes its
//!   blocks before a READ and checks every byte after it ([`verify_pattern`]): each block's
//!   first and last bytes name the block, the rest is [`FILL`].

use std::io::{self, Read, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::time::{Duration, Instant};

use elastic_vmm::layout::KvLayout;
use elastic_vmm::nixl::{sys, NixlAgent, NixlDescriptor};

pub type PeerError = Box<dyn std::error::Error>;

/// The largest framed message either side accepts.
pub const MAX_FRAME: usize = 64 << 20;
/// The decode's answer: every READ of the offer verified.
pub const DONE: u8 = b'D';
/// The decode's answer: something failed (its error is on its stderr).
pub const FAILED: u8 = b'F';
/// Every byte of a block but its first and last.
pub const FILL: u8 = 0x5a;
/// Pattern writes and checks go through windows of about this size.
const WINDOW: u64 = 64 << 20;
const MAGIC: &[u8; 8] = b"EVMMNX01";
/// Bytes of one encoded descriptor: address, length, memory type, device.
const DESC_BYTES: usize = 8 + 8 + 1 + 8;

/// NIXL descriptors of `blocks` consecutive blocks of `block_bytes` each, in block order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DescSet {
    pub blocks: u64,
    pub block_bytes: u64,
    pub descs: Vec<NixlDescriptor>,
}

/// What the prefill sends per case: its agent's metadata and its blocks' descriptors.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Offer {
    pub metadata: Vec<u8>,
    pub sets: Vec<DescSet>,
}

fn mem_code(m: sys::MemType) -> Result<u8, String> {
    match m {
        sys::MemType::Dram => Ok(0),
        sys::MemType::Vram => Ok(1),
        other => Err(format!(
            "memory type {other:?} cannot be offered (DRAM or VRAM only)"
        )),
    }
}

/// A reader over a received message that refuses to read past its end.
struct Cursor<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Cursor<'a> {
    fn take(&mut self, n: usize, what: &str) -> Result<&'a [u8], String> {
        let left = self.buf.len() - self.pos;
        if n > left {
            return Err(format!(
                "offer cut short: {what} needs {n} bytes at offset {}, {left} left of {}",
                self.pos,
                self.buf.len()
            ));
        }
        let s = &self.buf[self.pos..self.pos + n];
        self.pos += n;
        Ok(s)
    }
    fn u8(&mut self, what: &str) -> Result<u8, String> {
        Ok(self.take(1, what)?[0])
    }
    fn u32(&mut self, what: &str) -> Result<u32, String> {
        let b = self.take(4, what)?;
        Ok(u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    }
    fn u64(&mut self, what: &str) -> Result<u64, String> {
        let mut a = [0u8; 8];
        a.copy_from_slice(self.take(8, what)?);
        Ok(u64::from_le_bytes(a))
    }
    fn left(&self) -> usize {
        self.buf.len() - self.pos
    }
}

fn u32_len(n: usize, what: &str) -> Result<u32, String> {
    u32::try_from(n).map_err(|_| format!("{what}: {n} does not fit the offer's 32-bit count"))
}

impl Offer {
    /// The wire form: magic, metadata length and bytes, set count, then per set its block
    /// count, block size, descriptor count and descriptors (all integers little-endian).
    pub fn encode(&self) -> Result<Vec<u8>, String> {
        let descs: usize = self.sets.iter().map(|s| s.descs.len()).sum();
        let mut out =
            Vec::with_capacity(MAGIC.len() + 8 + self.metadata.len() + descs * DESC_BYTES);
        out.extend_from_slice(MAGIC);
        out.extend_from_slice(&u32_len(self.metadata.len(), "metadata bytes")?.to_le_bytes());
        out.extend_from_slice(&self.metadata);
        out.extend_from_slice(&u32_len(self.sets.len(), "sets")?.to_le_bytes());
        for s in &self.sets {
            out.extend_from_slice(&s.blocks.to_le_bytes());
            out.extend_from_slice(&s.block_bytes.to_le_bytes());
            out.extend_from_slice(&u32_len(s.descs.len(), "descriptors")?.to_le_bytes());
            for d in &s.descs {
                out.extend_from_slice(&d.addr.to_le_bytes());
                out.extend_from_slice(&d.len.to_le_bytes());
                out.push(mem_code(d.mem_type)?);
                out.extend_from_slice(&d.device_id.to_le_bytes());
            }
        }
        if out.len() > MAX_FRAME {
            return Err(format!(
                "offer of {} bytes exceeds the {MAX_FRAME}-byte frame limit",
                out.len()
            ));
        }
        Ok(out)
    }

    /// Parse what [`Offer::encode`] wrote; anything else (a wrong magic, a count past the end,
    /// an unknown memory type, trailing bytes) is an error naming it.
    pub fn decode(buf: &[u8]) -> Result<Offer, String> {
        let mut c = Cursor { buf, pos: 0 };
        if c.take(MAGIC.len(), "magic")? != MAGIC {
            return Err(format!(
                "not an offer: the first {} bytes are not {:?}",
                MAGIC.len(),
                String::from_utf8_lossy(MAGIC)
            ));
        }
        let md_len = c.u32("metadata length")? as usize;
        let metadata = c.take(md_len, "metadata")?.to_vec();
        let nsets = c.u32("set count")? as usize;
        // Each set takes at least 20 bytes: a count past the message is refused before any
        // allocation.
        if nsets > c.left() / 20 {
            return Err(format!(
                "offer names {nsets} sets but only {} bytes follow",
                c.left()
            ));
        }
        let mut sets = Vec::with_capacity(nsets);
        for i in 0..nsets {
            let blocks = c.u64("block count")?;
            let block_bytes = c.u64("block size")?;
            let n = c.u32("descriptor count")? as usize;
            if n > c.left() / DESC_BYTES {
                return Err(format!(
                    "set {i} names {n} descriptors but only {} bytes follow",
                    c.left()
                ));
            }
            let mut descs = Vec::with_capacity(n);
            for j in 0..n {
                let addr = c.u64("descriptor address")?;
                let len = c.u64("descriptor length")?;
                let mem_type = match c.u8("memory type")? {
                    0 => sys::MemType::Dram,
                    1 => sys::MemType::Vram,
                    other => {
                        return Err(format!(
                            "set {i}, descriptor {j}: unknown memory type code {other}"
                        ))
                    }
                };
                let device_id = c.u64("device id")?;
                if addr.checked_add(len).is_none() {
                    return Err(format!(
                        "set {i}, descriptor {j}: [{addr:#x}, +{len}) passes the end of the address space"
                    ));
                }
                descs.push(NixlDescriptor {
                    addr,
                    len,
                    mem_type,
                    device_id,
                });
            }
            sets.push(DescSet {
                blocks,
                block_bytes,
                descs,
            });
        }
        if c.left() != 0 {
            return Err(format!("{} bytes follow the offer's last set", c.left()));
        }
        Ok(Offer { metadata, sets })
    }
}

/// What a run needs of the environment, to be called before any thread starts (it may change
/// the process's environment): UCX fails to create its backend on an empty `UCX_TLS`, so an
/// empty one is removed and UCX picks its transports (between processes: `cuda_ipc` for plain
/// device memory, TCP emulation for VMM memory, CMA or TCP for host memory). A non-empty
/// `UCX_TLS` is the caller's choice and stays.
pub fn prepare_env() {
    if std::env::var_os("UCX_TLS").is_some_and(|v| v.is_empty()) {
        std::env::remove_var("UCX_TLS");
    }
}

/// Send one framed message.
pub fn send_frame(w: &mut impl Write, bytes: &[u8]) -> io::Result<()> {
    let len = u32::try_from(bytes.len())
        .ok()
        .filter(|&n| n as usize <= MAX_FRAME)
        .ok_or_else(|| {
            io::Error::new(
                io::ErrorKind::InvalidInput,
                format!(
                    "a frame of {} bytes exceeds the {MAX_FRAME}-byte limit",
                    bytes.len()
                ),
            )
        })?;
    w.write_all(&len.to_le_bytes())?;
    w.write_all(bytes)?;
    w.flush()
}

/// Receive one framed message (a length over [`MAX_FRAME`] is refused before reading it).
pub fn recv_frame(r: &mut impl Read) -> Result<Vec<u8>, PeerError> {
    let mut len = [0u8; 4];
    r.read_exact(&mut len)
        .map_err(|e| format!("reading a frame's length: {e}"))?;
    let len = u32::from_le_bytes(len) as usize;
    if len > MAX_FRAME {
        return Err(format!("a frame of {len} bytes announced; the limit is {MAX_FRAME}").into());
    }
    let mut buf = vec![0u8; len];
    r.read_exact(&mut buf)
        .map_err(|e| format!("reading a frame of {len} bytes: {e}"))?;
    Ok(buf)
}

/// Accept one connection on `listener` within `timeout`; `alive` is asked between attempts
/// (the peer process may have died before connecting) and may give up with an error.
pub fn accept_within(
    listener: &UnixListener,
    timeout: Duration,
    mut alive: impl FnMut() -> Result<(), PeerError>,
) -> Result<UnixStream, PeerError> {
    listener.set_nonblocking(true)?;
    let start = Instant::now();
    let stream = loop {
        match listener.accept() {
            Ok((s, _)) => break s,
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                alive()?;
                if start.elapsed() > timeout {
                    return Err(format!(
                        "no peer connected to the NIXL side channel within {timeout:?}"
                    )
                    .into());
                }
                std::thread::sleep(Duration::from_millis(2));
            }
            Err(e) => return Err(e.into()),
        }
    };
    listener.set_nonblocking(false)?;
    stream.set_nonblocking(false)?;
    Ok(stream)
}

/// Descriptors of blocks `0..blocks` of `layout`, registered with `agent`: the blocks' views
/// (consecutive blocks merged), split where registrations end. Both sides of a READ must use
/// layouts of one kind and shape, so the two lists cover the same bytes in the same order.
pub fn block_descriptors(
    agent: &NixlAgent,
    layout: &dyn KvLayout,
    blocks: usize,
) -> Result<DescSet, PeerError> {
    if blocks == 0 {
        return Err("a NIXL offer needs at least one block".into());
    }
    let views = layout.views();
    let mut descs = Vec::new();
    for v in views.blocks(0, blocks)? {
        descs.extend(agent.descriptors(v)?);
    }
    Ok(DescSet {
        blocks: blocks as u64,
        block_bytes: views.geometry().sizes().block,
        descs,
    })
}

/// Cut two descriptor lists covering the same number of bytes at the union of their
/// boundaries: pairs of one length, each piece inside one registration of its side.
pub fn co_split(
    local: &[NixlDescriptor],
    remote: &[NixlDescriptor],
) -> Result<(Vec<NixlDescriptor>, Vec<NixlDescriptor>), String> {
    let total = |d: &[NixlDescriptor]| {
        d.iter()
            .try_fold(0u64, |acc, x| acc.checked_add(x.len))
            .ok_or_else(|| "descriptor lengths overflow 64 bits".to_string())
    };
    let (lt, rt) = (total(local)?, total(remote)?);
    if lt != rt {
        return Err(format!(
            "local descriptors cover {lt} bytes ({} descriptors), remote {rt} ({})",
            local.len(),
            remote.len()
        ));
    }
    let (mut out_l, mut out_r) = (Vec::new(), Vec::new());
    let (mut i, mut j, mut oi, mut oj) = (0, 0, 0u64, 0u64);
    while i < local.len() && j < remote.len() {
        let n = (local[i].len - oi).min(remote[j].len - oj);
        if n > 0 {
            out_l.push(NixlDescriptor {
                addr: local[i].addr + oi,
                len: n,
                ..local[i]
            });
            out_r.push(NixlDescriptor {
                addr: remote[j].addr + oj,
                len: n,
                ..remote[j]
            });
        }
        oi += n;
        oj += n;
        if oi == local[i].len {
            i += 1;
            oi = 0;
        }
        if oj == remote[j].len {
            j += 1;
            oj = 0;
        }
    }
    Ok((out_l, out_r))
}

/// A remote agent's metadata loaded into a local agent; dropping it forgets the metadata.
pub struct Remote<'a> {
    agent: &'a NixlAgent,
    name: String,
}

impl<'a> Remote<'a> {
    /// Load `metadata` (a peer's `get_local_md`) into `agent`.
    pub fn load(agent: &'a NixlAgent, metadata: &[u8]) -> Result<Self, PeerError> {
        let name = agent.raw().load_remote_md(metadata).map_err(|e| {
            format!(
                "load_remote_md of {} bytes into agent {:?}: {e}",
                metadata.len(),
                agent.name()
            )
        })?;
        Ok(Remote { agent, name })
    }

    /// The remote agent's name, as its metadata gives it.
    pub fn name(&self) -> &str {
        &self.name
    }
}

impl Drop for Remote<'_> {
    fn drop(&mut self) {
        if let Err(e) = self.agent.raw().invalidate_remote_md(&self.name) {
            eprintln!(
                "invalidate_remote_md({:?}) on agent {:?}: {e}",
                self.name,
                self.agent.name()
            );
        }
    }
}

/// What one READ did.
#[derive(Debug, Clone, Copy)]
pub struct ReadReport {
    pub bytes: u64,
    /// Descriptor pairs posted.
    pub descriptors: usize,
    /// From posting to NIXL reporting success.
    pub elapsed: Duration,
}

fn xfer_list(descs: &[NixlDescriptor]) -> Result<sys::XferDescList<'static>, PeerError> {
    let mem = descs.first().map_or(sys::MemType::Dram, |d| d.mem_type);
    if let Some(d) = descs.iter().find(|d| d.mem_type != mem) {
        return Err(format!(
            "descriptors mix memory types: {mem:?} and {:?} at {:#x}",
            d.mem_type, d.addr
        )
        .into());
    }
    let mut list =
        sys::XferDescList::new(mem).map_err(|e| format!("XferDescList::new({mem:?}): {e}"))?;
    for d in descs {
        let (addr, len) = (usize::try_from(d.addr)?, usize::try_from(d.len)?);
        list.add_desc(addr, len, d.device_id);
    }
    Ok(list)
}

/// READ `remote` (memory of the agent `remote`) into `local` (memory registered with `agent`),
/// pair by pair after [`co_split`]; waits at most `timeout` for NIXL to report success.
///
/// A request still running after `timeout` cannot be let go safely (NIXL cannot say a
/// cancelled request stopped, and it writes this process's memory), so the process ends at
/// once, with no destructor run, rather than free that memory under it.
pub fn read(
    agent: &NixlAgent,
    remote: &Remote<'_>,
    local: &[NixlDescriptor],
    remote_descs: &[NixlDescriptor],
    timeout: Duration,
) -> Result<ReadReport, PeerError> {
    let (l, r) = co_split(local, remote_descs)?;
    let bytes: u64 = l.iter().map(|d| d.len).sum();
    let (ll, rl) = (xfer_list(&l)?, xfer_list(&r)?);
    let raw = agent.raw();
    let what = || {
        format!(
            "NIXL READ of {bytes} bytes in {} descriptors from {:?} into {:?}",
            l.len(),
            remote.name(),
            agent.name()
        )
    };
    let req = raw
        .create_xfer_req(sys::XferOp::Read, &ll, &rl, remote.name(), None)
        .map_err(|e| format!("create_xfer_req: {e} ({})", what()))?;
    let start = Instant::now();
    let mut running = raw
        .post_xfer_req(&req, None)
        .map_err(|e| format!("post_xfer_req: {e} ({})", what()))?;
    while running {
        match raw.get_xfer_status(&req) {
            Ok(sys::XferStatus::Success) => running = false,
            Ok(sys::XferStatus::InProgress) => {
                if start.elapsed() > timeout {
                    eprintln!(
                        "{} still running after {timeout:?}: ending the process rather than free memory it may write",
                        what()
                    );
                    std::mem::forget(req);
                    std::process::exit(124);
                }
                std::hint::spin_loop();
            }
            Err(e) => return Err(format!("get_xfer_status: {e} ({})", what()).into()),
        }
    }
    let elapsed = start.elapsed();
    Ok(ReadReport {
        bytes,
        descriptors: l.len(),
        elapsed,
    })
}

/// The prefill's side after sending an offer: wait for the decode's one-byte answer, polling
/// `agent`'s notifications meanwhile (that drives its progress, which READs over emulating
/// transports need). [`DONE`] is success; [`FAILED`], a closed channel or silence past
/// `timeout` are errors.
pub fn wait_answer(
    stream: &mut UnixStream,
    agent: &NixlAgent,
    timeout: Duration,
) -> Result<(), PeerError> {
    let mut notifs = sys::NotificationMap::new().map_err(|e| format!("NotificationMap: {e}"))?;
    stream.set_nonblocking(true)?;
    let start = Instant::now();
    let answer = loop {
        let mut b = [0u8; 1];
        match stream.read(&mut b) {
            Ok(0) => {
                break Err(
                    "the decode process closed the NIXL side channel without answering".to_string(),
                )
            }
            Ok(_) => break Ok(b[0]),
            Err(e)
                if matches!(
                    e.kind(),
                    io::ErrorKind::WouldBlock | io::ErrorKind::Interrupted
                ) => {}
            Err(e) => break Err(format!("reading the decode's answer: {e}")),
        }
        if let Err(e) = agent.raw().get_notifications(&mut notifs, None) {
            break Err(format!("get_notifications on {:?}: {e}", agent.name()));
        }
        if start.elapsed() > timeout {
            break Err(format!(
                "no answer from the decode process within {timeout:?}"
            ));
        }
        std::thread::yield_now();
    };
    stream.set_nonblocking(false)?;
    match answer? {
        DONE => Ok(()),
        FAILED => {
            Err("the decode process reports a failed NIXL READ (its error is on its stderr)".into())
        }
        other => Err(format!("unexpected answer byte {other:#04x} from the decode process").into()),
    }
}

/// The first and last byte of block `i`: never 0 (a zeroed block fails), and the pair differs
/// for every block below 255 * 255.
pub fn tags(i: u64) -> (u8, u8) {
    (1 + (i % 255) as u8, 1 + ((i / 255) % 255) as u8)
}

/// Bytes per pattern window: whole blocks, about [`WINDOW`].
fn window_bytes(block: u64) -> u64 {
    block * (WINDOW / block).max(1)
}

fn check_sizes(blocks: usize, block: u64) -> Result<u64, PeerError> {
    if block < 2 {
        return Err(format!("pattern blocks need at least 2 bytes, got {block}").into());
    }
    (blocks as u64)
        .checked_mul(block)
        .filter(|&t| t > 0 && usize::try_from(window_bytes(block).min(t)).is_ok())
        .ok_or_else(|| format!("{blocks} blocks of {block} bytes: no pattern to write").into())
}

/// Write the pattern over `blocks` consecutive blocks of `block` bytes through `put(offset,
/// bytes)` (offset from the first block's first byte), window by window.
pub fn write_pattern(
    blocks: usize,
    block: u64,
    mut put: impl FnMut(u64, &[u8]) -> Result<(), PeerError>,
) -> Result<(), PeerError> {
    let total = check_sizes(blocks, block)?;
    let w = window_bytes(block).min(total);
    let mut buf = vec![FILL; w as usize];
    let mut at = 0;
    while at < total {
        let n = (total - at).min(w) as usize;
        buf.fill(FILL);
        for (k, b) in buf[..n].chunks_mut(block as usize).enumerate() {
            let (first, last) = tags(at / block + k as u64);
            b[0] = first;
            b[b.len() - 1] = last;
        }
        put(at, &buf[..n])?;
        at += n as u64;
    }
    Ok(())
}

/// Check every byte of `blocks` consecutive blocks of `block` bytes, read through
/// `get(offset, out)`, against [`write_pattern`]; the first wrong byte is an error naming its
/// block, offset, and what was expected and found.
pub fn verify_pattern(
    blocks: usize,
    block: u64,
    mut get: impl FnMut(u64, &mut [u8]) -> Result<(), PeerError>,
) -> Result<(), PeerError> {
    let total = check_sizes(blocks, block)?;
    let w = window_bytes(block).min(total);
    let mut buf = vec![0u8; w as usize];
    let mut at = 0;
    while at < total {
        let n = (total - at).min(w) as usize;
        get(at, &mut buf[..n])?;
        for (k, b) in buf[..n].chunks(block as usize).enumerate() {
            let i = at / block + k as u64;
            let (first, last) = tags(i);
            let wrong = |off: usize, want: u8, got: u8| -> PeerError {
                format!(
                    "block {i} of {blocks}: byte {off} (offset {}) is {got:#04x}, expected {want:#04x}",
                    i * block + off as u64
                )
                .into()
            };
            if b[0] != first {
                return Err(wrong(0, first, b[0]));
            }
            let end = b.len() - 1;
            if b[end] != last {
                return Err(wrong(end, last, b[end]));
            }
            if let Some(p) = b[1..end].iter().position(|&x| x != FILL) {
                return Err(wrong(p + 1, FILL, b[p + 1]));
            }
        }
        at += n as u64;
    }
    Ok(())
}
