//! NIXL between two real processes, whatever the memory (feature `nixl`): the side channel, the
//! metadata exchange, the WRITE and the byte pattern that proves it. Used by `gpu-bench p2p`
//! (device memory, `p2p_nixl.rs`) and by its host test in `tests/nixl.rs` (DRAM, two
//! processes), which includes this file.
//!
//! **Why a WRITE by the prefill.** Pushing is the natural direction for prefill -> decode, and
//! the one UCX serves with `cuda_ipc` on one GPU. A READ (`ucp_get`) of plain device memory is
//! not served by `cuda_ipc` there: UCX 1.23 logs "cuda-ipc get zcopy disabled as no nvlinks
//! detected" (`cuda_ipc_iface.c`), so a READ falls back to software emulation over `tcp/lo`
//! (~0.5 GB/s on an H100, where a WRITE of the same memory between the same two processes ran
//! at 1378 GB/s).
//!
//! - **Side channel**: a Unix socket of its own (never the product's p2p `PeerLink` socket);
//!   every message is a frame (a `u32` little-endian length, then at most [`MAX_FRAME`] bytes).
//!   Per case the decode sends one [`Offer`]; then, set by set, the prefill sends a [`Written`]
//!   after each round of WRITEs and the decode answers a one-byte frame, [`DONE`] or
//!   [`FAILED`].
//! - **The decode (target)** registers its memory with its agent, zeroes it and sends an
//!   [`Offer`]: the agent's metadata (`get_local_md`, taken after every registration, so it
//!   carries them all) and, per set of blocks, the NIXL descriptors of those blocks (the
//!   blocks' views, split where its registrations end: one per physical chunk touched). It
//!   waits for each round's [`Written`] ([`wait_written`]) polling its agent's notifications,
//!   which drives its UCX worker: a transport that emulates remote writes in software (TCP,
//!   the only one UCX 1.23 has for VMM memory between processes) needs the target to make
//!   progress. Then it checks every byte of the set, zeroes it again when more rounds follow,
//!   and answers ([`answer`]).
//! - **The prefill (initiator)** loads the metadata (`load_remote_md`, through [`Remote`]),
//!   takes descriptors for the same blocks of its own memory, cuts both lists at the union of
//!   their boundaries ([`co_split`]) and WRITEs ([`write`]: `create_xfer_req`,
//!   `post_xfer_req`, `get_xfer_status` until done), timed from post to completion; the times
//!   travel in the [`Written`] ([`report_round`]). Dropping the [`Remote`] forgets the metadata
//!   (`invalidate_remote_md`): the decode's registrations change from one case to the next.
//! - **No memory is freed under a WRITE**: a WRITE still running after its timeout ends the
//!   prefill's process (exit 124, no cleanup); the decode frees or zeroes its memory only
//!   after a [`Written`] said that the round's WRITEs are over, and ends its process the same
//!   way when it cannot know (no word within its timeout, a closed channel, a message it cannot
//!   read).
//! - **Proof**: the prefill writes [`write_pattern`] into its blocks; the decode zeroes its
//!   blocks before each round of WRITEs and checks every byte after it ([`verify_pattern`]):
//!   each block's first and last bytes name the block, the rest is [`FILL`].

use std::io::{self, Read, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::time::{Duration, Instant};

use elastic_vmm::layout::KvLayout;
use elastic_vmm::nixl::{sys, NixlAgent, NixlDescriptor};

pub type PeerError = Box<dyn std::error::Error>;

/// The largest framed message either side accepts.
pub const MAX_FRAME: usize = 64 << 20;
/// The decode's answer to a round: every byte it wrote verified.
pub const DONE: u8 = b'D';
/// The decode's answer to a round: the round failed or its bytes did not verify (the decode
/// prints why); no more rounds into that set.
pub const FAILED: u8 = b'F';
/// Every byte of a block but its first and last.
pub const FILL: u8 = 0x5a;
/// Pattern writes and checks go through windows of about this size.
const WINDOW: u64 = 64 << 20;
const MAGIC: &[u8; 8] = b"EVMMNX01";
const WRITTEN_MAGIC: &[u8; 8] = b"EVMMNW01";
/// Bytes of one encoded descriptor: address, length, memory type, device.
const DESC_BYTES: usize = 8 + 8 + 1 + 8;
/// Bytes of one encoded transfer report: bytes, descriptors, nanoseconds.
const REPORT_BYTES: usize = 8 + 8 + 8;

/// NIXL descriptors of `blocks` consecutive blocks of `block_bytes` each, in block order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DescSet {
    pub blocks: u64,
    pub block_bytes: u64,
    pub descs: Vec<NixlDescriptor>,
}

/// What the decode sends per case: its agent's metadata and its blocks' descriptors.
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
    /// What the message is, for errors.
    kind: &'static str,
}

impl<'a> Cursor<'a> {
    fn take(&mut self, n: usize, what: &str) -> Result<&'a [u8], String> {
        let left = self.buf.len() - self.pos;
        if n > left {
            return Err(format!(
                "{} cut short: {what} needs {n} bytes at offset {}, {left} left of {}",
                self.kind,
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
        let mut c = Cursor {
            buf,
            pos: 0,
            kind: "offer",
        };
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

/// What one WRITE did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TransferReport {
    pub bytes: u64,
    /// Descriptor pairs posted.
    pub descriptors: usize,
    /// From posting to NIXL reporting success.
    pub elapsed: Duration,
}

/// What the prefill tells the decode after a round of WRITEs into one set of the decode's
/// offer. Once the decode has it, no WRITE of the round runs any more.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Written {
    /// The set written: its index in the offer.
    pub set: u32,
    /// More rounds into this set follow (only after a round that did not fail): the decode
    /// zeroes the set again before it answers.
    pub more: bool,
    /// Every WRITE of the round, each finished; or why the round failed.
    pub outcome: Result<Vec<TransferReport>, String>,
}

impl Written {
    /// The wire form: magic, set, `more` (0 or 1), status (0: done, then the report count and
    /// per report its bytes, descriptor pairs and nanoseconds; 1: failed, then the reason's
    /// length and UTF-8 bytes), all integers little-endian.
    pub fn encode(&self) -> Result<Vec<u8>, String> {
        let mut out = Vec::with_capacity(64);
        out.extend_from_slice(WRITTEN_MAGIC);
        out.extend_from_slice(&self.set.to_le_bytes());
        out.push(u8::from(self.more));
        match &self.outcome {
            Ok(reports) => {
                out.push(0);
                out.extend_from_slice(&u32_len(reports.len(), "reports")?.to_le_bytes());
                for r in reports {
                    out.extend_from_slice(&r.bytes.to_le_bytes());
                    out.extend_from_slice(&(r.descriptors as u64).to_le_bytes());
                    let ns = u64::try_from(r.elapsed.as_nanos()).unwrap_or(u64::MAX);
                    out.extend_from_slice(&ns.to_le_bytes());
                }
            }
            Err(why) => {
                if self.more {
                    return Err("a failed round cannot announce more rounds".into());
                }
                out.push(1);
                out.extend_from_slice(&u32_len(why.len(), "reason bytes")?.to_le_bytes());
                out.extend_from_slice(why.as_bytes());
            }
        }
        if out.len() > MAX_FRAME {
            return Err(format!(
                "a report of {} bytes exceeds the {MAX_FRAME}-byte frame limit",
                out.len()
            ));
        }
        Ok(out)
    }

    /// Parse what [`Written::encode`] wrote; anything else (a wrong magic, a flag that is not
    /// 0 or 1, a failed round announcing more, a count past the end, a reason that is not
    /// UTF-8, trailing bytes) is an error naming it.
    pub fn decode(buf: &[u8]) -> Result<Written, String> {
        let mut c = Cursor {
            buf,
            pos: 0,
            kind: "report",
        };
        if c.take(WRITTEN_MAGIC.len(), "magic")? != WRITTEN_MAGIC {
            return Err(format!(
                "not a report: the first {} bytes are not {:?}",
                WRITTEN_MAGIC.len(),
                String::from_utf8_lossy(WRITTEN_MAGIC)
            ));
        }
        let set = c.u32("set")?;
        let more = match c.u8("more")? {
            0 => false,
            1 => true,
            other => return Err(format!("report: `more` is {other}, not 0 or 1")),
        };
        let outcome = match c.u8("status")? {
            0 => {
                let n = c.u32("report count")? as usize;
                if n > c.left() / REPORT_BYTES {
                    return Err(format!(
                        "report names {n} transfers but only {} bytes follow",
                        c.left()
                    ));
                }
                let mut reports = Vec::with_capacity(n);
                for i in 0..n {
                    let bytes = c.u64("bytes")?;
                    let descriptors = usize::try_from(c.u64("descriptor pairs")?)
                        .map_err(|_| format!("report: transfer {i} has too many descriptors"))?;
                    let elapsed = Duration::from_nanos(c.u64("nanoseconds")?);
                    reports.push(TransferReport {
                        bytes,
                        descriptors,
                        elapsed,
                    });
                }
                Ok(reports)
            }
            1 => {
                if more {
                    return Err("report: a failed round announces more rounds".into());
                }
                let n = c.u32("reason length")? as usize;
                let why = std::str::from_utf8(c.take(n, "reason")?)
                    .map_err(|e| format!("report: the reason is not UTF-8: {e}"))?;
                Err(why.to_string())
            }
            other => return Err(format!("report: unknown status {other}")),
        };
        if c.left() != 0 {
            return Err(format!("{} bytes follow the report", c.left()));
        }
        Ok(Written { set, more, outcome })
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
    let why = |e: io::Error| match e.kind() {
        io::ErrorKind::UnexpectedEof => "the peer closed the side channel".to_string(),
        _ => e.to_string(),
    };
    let mut len = [0u8; 4];
    r.read_exact(&mut len)
        .map_err(|e| format!("reading a frame's length: {}", why(e)))?;
    let len = u32::from_le_bytes(len) as usize;
    if len > MAX_FRAME {
        return Err(format!("a frame of {len} bytes announced; the limit is {MAX_FRAME}").into());
    }
    let mut buf = vec![0u8; len];
    r.read_exact(&mut buf)
        .map_err(|e| format!("reading a frame of {len} bytes: {}", why(e)))?;
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
/// (consecutive blocks merged), split where registrations end. Both sides of a WRITE must use
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

/// WRITE `local` (memory registered with `agent`) into `remote_descs` (memory of the agent
/// `remote`), pair by pair after [`co_split`]; waits at most `timeout` for NIXL to report
/// success.
///
/// A request still running after `timeout` cannot be let go safely (NIXL cannot say a
/// cancelled request stopped; it reads this process's memory and writes the peer's, which the
/// peer frees once told the WRITE is over), so the process ends at once (exit 124), with no
/// destructor run.
pub fn write(
    agent: &NixlAgent,
    remote: &Remote<'_>,
    local: &[NixlDescriptor],
    remote_descs: &[NixlDescriptor],
    timeout: Duration,
) -> Result<TransferReport, PeerError> {
    let (l, r) = co_split(local, remote_descs)?;
    let bytes: u64 = l.iter().map(|d| d.len).sum();
    let (ll, rl) = (xfer_list(&l)?, xfer_list(&r)?);
    let raw = agent.raw();
    let what = || {
        format!(
            "NIXL WRITE of {bytes} bytes in {} descriptors from {:?} into {:?}",
            l.len(),
            agent.name(),
            remote.name()
        )
    };
    let req = raw
        .create_xfer_req(sys::XferOp::Write, &ll, &rl, remote.name(), None)
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
                        "{} still running after {timeout:?}: ending the process rather than free memory it may use",
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
    Ok(TransferReport {
        bytes,
        descriptors: l.len(),
        elapsed,
    })
}

/// A reader over a non-blocking stream that polls an agent's notifications while no byte is
/// there (which drives the agent's UCX worker), until a deadline.
struct Progressing<'a> {
    stream: &'a mut UnixStream,
    agent: &'a NixlAgent,
    notifs: sys::NotificationMap,
    start: Instant,
    timeout: Duration,
}

impl Read for Progressing<'_> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        loop {
            match self.stream.read(buf) {
                Err(e)
                    if matches!(
                        e.kind(),
                        io::ErrorKind::WouldBlock | io::ErrorKind::Interrupted
                    ) => {}
                r => return r,
            }
            self.agent
                .raw()
                .get_notifications(&mut self.notifs, None)
                .map_err(|e| {
                    io::Error::other(format!("get_notifications on {:?}: {e}", self.agent.name()))
                })?;
            if self.start.elapsed() > self.timeout {
                return Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    format!("nothing from the peer within {:?}", self.timeout),
                ));
            }
            std::thread::yield_now();
        }
    }
}

/// Receive one frame within `timeout`, polling `agent`'s notifications while none is
/// complete: that drives the agent's UCX worker, which transfers over emulating transports
/// need on both sides. A closed channel, a length over [`MAX_FRAME`] or silence past
/// `timeout` are errors.
pub fn recv_frame_within(
    stream: &mut UnixStream,
    agent: &NixlAgent,
    timeout: Duration,
) -> Result<Vec<u8>, PeerError> {
    let notifs = sys::NotificationMap::new().map_err(|e| format!("NotificationMap: {e}"))?;
    stream.set_nonblocking(true)?;
    let frame = recv_frame(&mut Progressing {
        stream: &mut *stream,
        agent,
        notifs,
        start: Instant::now(),
        timeout,
    });
    stream.set_nonblocking(false)?;
    frame
}

/// The prefill's side of a round: send `written`, then wait for the decode's answer, polling
/// `agent` meanwhile. `Ok(true)`: every byte verified ([`DONE`]); `Ok(false)`: the round
/// failed or its bytes did not verify ([`FAILED`]: no more rounds into that set). A broken
/// channel, another answer, or none within `timeout` are errors.
pub fn report_round(
    stream: &mut UnixStream,
    agent: &NixlAgent,
    written: &Written,
    timeout: Duration,
) -> Result<bool, PeerError> {
    send_frame(stream, &written.encode()?)
        .map_err(|e| format!("sending a report to the decode: {e}"))?;
    match recv_frame_within(stream, agent, timeout)?.as_slice() {
        [DONE] => Ok(true),
        [FAILED] => Ok(false),
        other => Err(format!(
            "unexpected answer from the decode process: {} bytes, first {:?}",
            other.len(),
            other.first()
        )
        .into()),
    }
}

/// The decode's side of a round: wait for the prefill's [`Written`] about `set`, polling
/// `agent`'s notifications meanwhile (the progress that WRITEs over emulating transports
/// need from their target).
///
/// That message is the only word that the round's WRITEs into this process's memory are over.
/// Without it (no message within `timeout`, which must exceed what the prefill may take for a
/// round; a closed channel; a message that is not a [`Written`] about `set`) a WRITE may still
/// be running into that memory, so the process ends at once (exit 124), with no destructor run,
/// rather than zero, reuse or free it.
pub fn wait_written(
    stream: &mut UnixStream,
    agent: &NixlAgent,
    set: u32,
    timeout: Duration,
) -> Written {
    let w = recv_frame_within(stream, agent, timeout)
        .map_err(|e| e.to_string())
        .and_then(|f| Written::decode(&f))
        .and_then(|w| {
            if w.set == set {
                Ok(w)
            } else {
                Err(format!("a report about set {}, expected set {set}", w.set))
            }
        });
    match w {
        Ok(w) => w,
        Err(e) => {
            eprintln!(
                "waiting for the prefill's word that its NIXL WRITEs into set {set} are over: {e}; \
                 ending the process rather than free memory a WRITE may still use"
            );
            std::process::exit(124);
        }
    }
}

/// The decode's answer to a round: [`DONE`] when every byte verified (and the set is zeroed
/// again if more rounds follow), else [`FAILED`].
pub fn answer(stream: &mut UnixStream, verified: bool) -> io::Result<()> {
    send_frame(stream, &[if verified { DONE } else { FAILED }])
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
