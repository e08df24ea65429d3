//! Host memory with the CUDA VMM model: the embedded default backend.
//!
//! - reserve: `mmap(PROT_NONE, MAP_NORESERVE)`; nothing is committed.
//! - physical chunks: ranges of one sparse `memfd`, committed with `fallocate` at `create`
//!   (fresh chunks therefore read as zero) and handed back with `FALLOC_FL_PUNCH_HOLE` at
//!   `release`, so both the process's resident memory and the memfd's blocks really drop.
//! - map: `mmap(MAP_FIXED | MAP_SHARED)` of the chunk's file range, `PROT_NONE` until
//!   `set_access` (`mprotect` read-write), as CUDA maps without access until `cuMemSetAccess`.
//! - unmap: the range is replaced by a fresh `PROT_NONE` reservation.
//!
//! Sharing between processes ([`ChunkFiles::PerChunk`]): each chunk is a memfd of its own
//! (sealed against shrinking and growing), so exporting a chunk hands out a descriptor of that
//! chunk only, never of the process's other memory. An imported chunk maps the same way
//! (`MAP_SHARED | MAP_FIXED`), so both processes see one set of pages; they go back to the
//! kernel when the last descriptor and the last mapping of them are gone. The default
//! ([`ChunkFiles::Shared`]) keeps every created chunk in one memfd, which costs one descriptor
//! whatever the number of chunks, and cannot export (imports work in both modes).

use std::collections::{BTreeMap, HashMap};
use std::ffi::CStr;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};

use parking_lot::Mutex;

use super::{Backend, BackendInfo, Copies, MemoryInfo, MemoryKind, PhysicalChunk};
use crate::error::{Error, Result};

/// Default mapping granularity of the host backend: 2 MiB, as CUDA's on the H100.
pub const DEFAULT_GRANULARITY: usize = 2 << 20;

/// The memfd is sized once to this (sparse) length; physical chunks are ranges inside it.
const MEMFD_SPAN: u64 = 1 << 46;

const NAME: &str = "host";

/// Raw handles with this bit set name a chunk with a file of its own (created in
/// [`ChunkFiles::PerChunk`] mode, or imported); the others are offsets in the shared memfd,
/// which stay below [`MEMFD_SPAN`].
const OWN_FILE: u64 = 1 << 63;

/// Seals every chunk file carries, so that no holder can shrink it under another's mapping
/// (which would turn reads into `SIGBUS`).
const CHUNK_SEALS: libc::c_int = libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_SEAL;

/// Where created chunks live.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ChunkFiles {
    /// Every chunk is a range of one memfd: one descriptor in all; chunks cannot be exported.
    Shared,
    /// Every chunk is a sealed memfd of its own: one descriptor per chunk; chunks can be
    /// exported to other processes ([`Backend::export_chunk`]).
    PerChunk,
}

/// Whether a chunk with a file of its own was made here or came from another process.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum FileOrigin {
    Created,
    Imported,
}

#[derive(Debug)]
struct ChunkFile {
    fd: OwnedFd,
    origin: FileOrigin,
}

/// Chunks with a file of their own, by raw handle.
#[derive(Debug, Default)]
struct ChunkFileTable {
    next: u64,
    files: HashMap<u64, ChunkFile>,
}

/// The host backend. See the module documentation.
#[derive(Debug)]
pub struct HostBackend {
    info: BackendInfo,
    memfd: OwnedFd,
    chunk_files: ChunkFiles,
    /// Mapped chunks are locked in memory (`mlock` when access is granted): the pinned
    /// fallback of a host tier ([`HostBackend::locked`]).
    locked: bool,
    offsets: Mutex<FileRanges>,
    /// Lock order: taken alone (never with `offsets`), for bookkeeping only.
    own_files: Mutex<ChunkFileTable>,
    /// Live mappings, start to end. `mmap(MAP_FIXED)` would silently replace one; CUDA's
    /// `cuMemMap` refuses to map over a mapping, so this backend refuses too, and a caller
    /// that breaks `map`'s contract fails here as it would on a GPU. Taken alone.
    maps: Mutex<BTreeMap<u64, u64>>,
}

/// Take `[start, end)` out of the live mappings (cutting those it overlaps).
fn forget_maps(maps: &mut BTreeMap<u64, u64>, start: u64, end: u64) {
    let hit: Vec<(u64, u64)> = maps
        .range(..end)
        .rev()
        .take_while(|(_, &e)| e > start)
        .map(|(&s, &e)| (s, e))
        .collect();
    // A mapping that ends before `start` may still hide behind one that overlaps: mappings
    // never overlap each other, so ordered by start they are ordered by end too.
    for (s, e) in hit {
        maps.remove(&s);
        if s < start {
            maps.insert(s, start);
        }
        if e > end {
            maps.insert(end, e);
        }
    }
}

/// Which ranges of the memfd belong to live chunks: a bump pointer plus a coalescing free list.
#[derive(Debug, Default)]
struct FileRanges {
    end: u64,
    free: BTreeMap<u64, u64>,
}

impl FileRanges {
    fn take(&mut self, size: u64) -> Option<u64> {
        // First fit in the free list keeps the file compact; the bump pointer otherwise.
        if let Some((&off, &len)) = self.free.iter().find(|(_, &len)| len >= size) {
            self.free.remove(&off);
            if len > size {
                self.free.insert(off + size, len - size);
            }
            return Some(off);
        }
        let off = self.end;
        let end = off.checked_add(size)?;
        if end > MEMFD_SPAN {
            return None;
        }
        self.end = end;
        Some(off)
    }

    fn give(&mut self, mut off: u64, mut size: u64) {
        if let Some((&prev, &plen)) = self.free.range(..off).next_back() {
            if prev + plen == off {
                self.free.remove(&prev);
                off = prev;
                size += plen;
            }
        }
        if let Some(&nlen) = self.free.get(&(off + size)) {
            self.free.remove(&(off + size));
            size += nlen;
        }
        if off + size == self.end {
            self.end = off;
        } else {
            self.free.insert(off, size);
        }
    }
}

fn errno_name(err: &io::Error) -> String {
    match err.raw_os_error() {
        Some(libc::ENOMEM) => "ENOMEM".into(),
        Some(libc::ENOSPC) => "ENOSPC".into(),
        Some(libc::EINVAL) => "EINVAL".into(),
        Some(libc::EFAULT) => "EFAULT".into(),
        Some(libc::EACCES) => "EACCES".into(),
        Some(libc::EPERM) => "EPERM".into(),
        Some(libc::EINTR) => "EINTR".into(),
        Some(libc::EBADF) => "EBADF".into(),
        _ => err.to_string(),
    }
}

fn os_error(call: &'static str, detail: String) -> Error {
    let err = io::Error::last_os_error();
    Error::backend(NAME, call, errno_name(&err), detail)
}

impl HostBackend {
    /// A host backend with the given granularity (a power of two, at least the 4 KiB page),
    /// every chunk in one shared memfd ([`ChunkFiles::Shared`]).
    pub fn new(granularity: usize) -> Result<Self> {
        Self::with_chunk_files(granularity, ChunkFiles::Shared)
    }

    /// A host backend whose chunks live as `chunk_files` says: [`ChunkFiles::PerChunk`] for a
    /// backend whose chunks other processes import (the broker's).
    pub fn with_chunk_files(granularity: usize, chunk_files: ChunkFiles) -> Result<Self> {
        // SAFETY: sysconf has no preconditions.
        let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) } as usize;
        if !granularity.is_power_of_two() || granularity < page {
            return Err(Error::InvalidArgument(format!(
                "host granularity {granularity} must be a power of two of at least the page size {page}"
            )));
        }
        let name: &CStr = c"elastic-vmm";
        // SAFETY: `name` is a valid nul-terminated string; flags are valid.
        let fd = unsafe { libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC) };
        if fd < 0 {
            return Err(os_error("memfd_create", String::new()));
        }
        // SAFETY: `fd` was just returned by memfd_create and is owned by nobody else.
        let memfd = unsafe { OwnedFd::from_raw_fd(fd) };
        // SAFETY: `memfd` is a valid descriptor; a sparse size commits nothing.
        if unsafe { libc::ftruncate(memfd.as_raw_fd(), MEMFD_SPAN as libc::off_t) } != 0 {
            return Err(os_error(
                "ftruncate",
                format!("memfd to {MEMFD_SPAN} bytes"),
            ));
        }
        let total = super::meminfo::machine(NAME)?.total;
        Ok(HostBackend {
            info: BackendInfo {
                name: NAME,
                memory_kind: MemoryKind::Host,
                device_ordinal: None,
                device_uuid: None,
                device_name: "host memory (memfd)".into(),
                granularity,
                min_granularity: page,
                vmm_supported: true,
                rdma_capable: false,
                posix_fd_exportable: chunk_files == ChunkFiles::PerChunk,
                fabric_exportable: false,
                total_memory: total,
                page_locked: false,
            },
            memfd,
            chunk_files,
            locked: false,
            offsets: Mutex::new(FileRanges::default()),
            own_files: Mutex::new(ChunkFileTable::default()),
            maps: Mutex::new(BTreeMap::new()),
        })
    }

    /// A host backend whose mapped memory is locked (`mlock` as access is granted, unlocked
    /// when unmapped): page-locked host memory, the host tier's fallback where the device has
    /// no host VMM (`Pool::host_tier`). Its [`BackendInfo`] says so (`page_locked`, and the
    /// device name). A lock refused by `RLIMIT_MEMLOCK` fails the mapping with the numbers.
    pub fn locked(granularity: usize) -> Result<Self> {
        let mut b = Self::new(granularity)?;
        b.locked = true;
        b.info.page_locked = true;
        b.info.device_name = "host memory (memfd, mlock'd: pinned fallback)".into();
        Ok(b)
    }

    /// Where this backend creates its chunks.
    pub fn chunk_files(&self) -> ChunkFiles {
        self.chunk_files
    }

    /// Remember a chunk file; returns its chunk.
    fn adopt_file(&self, fd: OwnedFd, origin: FileOrigin, size: usize) -> PhysicalChunk {
        let mut t = self.own_files.lock();
        t.next += 1;
        let raw = OWN_FILE | t.next;
        t.files.insert(raw, ChunkFile { fd, origin });
        PhysicalChunk { raw, size }
    }

    /// The descriptor and file offset a chunk maps from. The returned raw descriptor stays
    /// valid while the chunk is live (the caller's contract keeps it from being released).
    fn file_of(&self, chunk: PhysicalChunk) -> Result<(RawFd, u64)> {
        if chunk.raw & OWN_FILE == 0 {
            return Ok((self.memfd.as_raw_fd(), chunk.raw));
        }
        match self.own_files.lock().files.get(&chunk.raw) {
            Some(f) => Ok((f.fd.as_raw_fd(), 0)),
            None => Err(Error::backend(
                NAME,
                "lookup chunk",
                "EBADF",
                format!("no live chunk with handle {:#x}", chunk.raw),
            )),
        }
    }

    /// A fresh sealed memfd of `size` committed bytes.
    fn create_chunk_file(&self, size: usize) -> Result<OwnedFd> {
        let name: &CStr = c"elastic-vmm-chunk";
        // SAFETY: `name` is a valid nul-terminated string; flags are valid.
        let fd = unsafe {
            libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING)
        };
        if fd < 0 {
            return Err(os_error("memfd_create", format!("chunk of {size} bytes")));
        }
        // SAFETY: `fd` was just returned by memfd_create and is owned by nobody else.
        let file = unsafe { OwnedFd::from_raw_fd(fd) };
        // SAFETY: `file` is a valid descriptor of a file nobody maps yet.
        if unsafe { libc::ftruncate(file.as_raw_fd(), size as libc::off_t) } != 0 {
            return Err(os_error(
                "ftruncate",
                format!("chunk memfd to {size} bytes"),
            ));
        }
        // SAFETY: as above; committing pages of our own file touches no memory of the process.
        if unsafe { libc::fallocate(file.as_raw_fd(), 0, 0, size as libc::off_t) } != 0 {
            return Err(os_error(
                "fallocate",
                format!("chunk memfd of {size} bytes"),
            ));
        }
        // SAFETY: plain fcntl on a valid descriptor.
        if unsafe { libc::fcntl(file.as_raw_fd(), libc::F_ADD_SEALS, CHUNK_SEALS) } != 0 {
            return Err(os_error(
                "fcntl(F_ADD_SEALS)",
                format!("chunk memfd of {size} bytes"),
            ));
        }
        Ok(file)
    }

    fn check_granular(&self, what: &'static str, value: u64) -> Result<()> {
        let g = self.info.granularity as u64;
        if value == 0 || value % g != 0 {
            return Err(Error::Misaligned {
                what,
                value,
                alignment: g,
            });
        }
        Ok(())
    }
}

impl Backend for HostBackend {
    fn info(&self) -> &BackendInfo {
        &self.info
    }

    fn reserve(&self, size: usize, alignment: usize) -> Result<u64> {
        self.check_granular("reservation size", size as u64)?;
        let alignment = alignment.max(self.info.granularity);
        if !alignment.is_power_of_two() {
            return Err(Error::InvalidArgument(format!(
                "reservation alignment {alignment} is not a power of two"
            )));
        }
        let span = size
            .checked_add(alignment)
            .ok_or_else(|| Error::SizeOverflow {
                what: "reservation",
                detail: format!("{size} + alignment {alignment}"),
            })?;
        // SAFETY: an anonymous PROT_NONE mapping at an address of the kernel's choosing touches
        // no existing memory.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                span,
                libc::PROT_NONE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
                -1,
                0,
            )
        };
        if ptr == libc::MAP_FAILED {
            return Err(os_error("mmap(PROT_NONE)", format!("{span} bytes")));
        }
        let start = ptr as usize;
        let base = (start + alignment - 1) & !(alignment - 1);
        let head = base - start;
        let tail = span - head - size;
        // SAFETY: head and tail are the parts of the mapping just made that lie outside
        // [base, base + size); nothing else refers to them.
        unsafe {
            if head > 0 {
                libc::munmap(ptr, head);
            }
            if tail > 0 {
                libc::munmap((base + size) as *mut libc::c_void, tail);
            }
        }
        Ok(base as u64)
    }

    unsafe fn free_reservation(&self, base: u64, size: usize) -> Result<()> {
        forget_maps(
            &mut self.maps.lock(),
            base,
            base.saturating_add(size as u64),
        );
        // SAFETY: the caller guarantees this is exactly one of our reservations, unused.
        if unsafe { libc::munmap(base as *mut libc::c_void, size) } != 0 {
            return Err(os_error("munmap", format!("{size} bytes at {base:#x}")));
        }
        Ok(())
    }

    fn create(&self, size: usize) -> Result<PhysicalChunk> {
        self.check_granular("chunk size", size as u64)?;
        if self.chunk_files == ChunkFiles::PerChunk {
            let fd = self.create_chunk_file(size)?;
            return Ok(self.adopt_file(fd, FileOrigin::Created, size));
        }
        let off = self.offsets.lock().take(size as u64).ok_or_else(|| {
            Error::backend(
                NAME,
                "create",
                "ENOSPC",
                format!("memfd span of {MEMFD_SPAN} bytes exhausted"),
            )
        })?;
        // SAFETY: the file range [off, off + size) belongs to no live chunk; committing its
        // pages touches no memory of the process.
        let rc = unsafe {
            libc::fallocate(
                self.memfd.as_raw_fd(),
                0,
                off as libc::off_t,
                size as libc::off_t,
            )
        };
        if rc != 0 {
            let err = os_error("fallocate", format!("{size} bytes at file offset {off:#x}"));
            // Whatever part was committed goes back before the range is reused.
            // SAFETY: as above, the range belongs to no live chunk.
            unsafe { punch_hole(self.memfd.as_raw_fd(), off, size) };
            self.offsets.lock().give(off, size as u64);
            return Err(err);
        }
        Ok(PhysicalChunk { raw: off, size })
    }

    unsafe fn release(&self, chunk: PhysicalChunk) -> Result<()> {
        if chunk.raw & OWN_FILE != 0 {
            let file = self.own_files.lock().files.remove(&chunk.raw);
            // The descriptor closes here, outside the lock: the pages go back to the kernel
            // once no other process holds or maps the file.
            return match file {
                Some(_) => Ok(()),
                None => Err(Error::backend(
                    NAME,
                    "release",
                    "EBADF",
                    format!("no live chunk with handle {:#x}", chunk.raw),
                )),
            };
        }
        // SAFETY: the caller guarantees the chunk is ours, live and mapped nowhere.
        if unsafe { punch_hole(self.memfd.as_raw_fd(), chunk.raw, chunk.size) } != 0 {
            return Err(os_error(
                "fallocate(PUNCH_HOLE)",
                format!("{} bytes at file offset {:#x}", chunk.size, chunk.raw),
            ));
        }
        self.offsets.lock().give(chunk.raw, chunk.size as u64);
        Ok(())
    }

    unsafe fn map(&self, addr: u64, chunk: PhysicalChunk) -> Result<()> {
        let (fd, offset) = self.file_of(chunk)?;
        let end = addr.saturating_add(chunk.size as u64);
        let mut maps = self.maps.lock();
        if let Some((&s, &e)) = maps.range(..end).next_back().filter(|(_, &e)| e > addr) {
            return Err(Error::backend(
                NAME,
                "mmap(MAP_FIXED)",
                "EEXIST",
                format!(
                    "{} bytes at {addr:#x} over the live mapping [{s:#x}, {e:#x}) (cuMemMap refuses this too)",
                    chunk.size
                ),
            ));
        }
        // Booked before the call (no lock held across it), taken out again if it fails.
        maps.insert(addr, end);
        drop(maps);
        // SAFETY: the caller guarantees [addr, addr + size) is an unmapped part of one of our
        // reservations, so MAP_FIXED replaces only our own PROT_NONE placeholder; `fd` stays
        // open while the chunk is live, and a chunk file is sealed at least `size` long.
        let ptr = unsafe {
            libc::mmap(
                addr as *mut libc::c_void,
                chunk.size,
                libc::PROT_NONE,
                libc::MAP_SHARED | libc::MAP_FIXED,
                fd,
                offset as libc::off_t,
            )
        };
        if ptr == libc::MAP_FAILED {
            self.maps.lock().remove(&addr);
            return Err(os_error(
                "mmap(MAP_FIXED)",
                format!("{} bytes at {addr:#x}", chunk.size),
            ));
        }
        Ok(())
    }

    unsafe fn map_over(
        &self,
        addr: u64,
        chunk: PhysicalChunk,
        mode: super::AccessMode,
    ) -> Result<()> {
        let (fd, offset) = self.file_of(chunk)?;
        let prot = match mode {
            super::AccessMode::ReadWrite => libc::PROT_READ | libc::PROT_WRITE,
            super::AccessMode::ReadOnly => libc::PROT_READ,
        };
        // SAFETY: the caller guarantees [addr, addr + size) lies in one of our reservations and
        // holds only our own mappings nothing uses (or placeholders): MAP_FIXED replaces them
        // in one step, under the kernel's address-space lock, so a concurrent reader faults in
        // either the old pages or the new ones, never in a hole.
        let ptr = unsafe {
            libc::mmap(
                addr as *mut libc::c_void,
                chunk.size,
                prot,
                libc::MAP_SHARED | libc::MAP_FIXED,
                fd,
                offset as libc::off_t,
            )
        };
        if ptr == libc::MAP_FAILED {
            // A failed MAP_FIXED leaves the old mapping (the kernel unmaps only on success).
            return Err(os_error(
                "mmap(MAP_FIXED over)",
                format!("{} bytes at {addr:#x}", chunk.size),
            ));
        }
        let end = addr.saturating_add(chunk.size as u64);
        {
            let mut maps = self.maps.lock();
            forget_maps(&mut maps, addr, end);
            maps.insert(addr, end);
        }
        // SAFETY: the range is our own mapping, readable and writable.
        if self.locked
            && mode == super::AccessMode::ReadWrite
            && unsafe { libc::mlock(addr as *const libc::c_void, chunk.size) } != 0
        {
            return Err(os_error(
                "mlock",
                format!("{} bytes at {addr:#x}", chunk.size),
            ));
        }
        Ok(())
    }

    fn maps_over(&self) -> bool {
        true
    }

    unsafe fn wipe_chunk(&self, chunk: PhysicalChunk) -> Result<()> {
        let (fd, offset) = self.file_of(chunk)?;
        // SAFETY: the caller guarantees the chunk is ours, live and mapped nowhere: its pages
        // go back to the kernel and fresh ones (zeros) are committed in their place, so the
        // file holds as many blocks as before.
        let rc = unsafe {
            let punched = punch_hole(fd, offset, chunk.size);
            if punched != 0 {
                punched
            } else {
                libc::fallocate(fd, 0, offset as libc::off_t, chunk.size as libc::off_t)
            }
        };
        if rc != 0 {
            return Err(os_error(
                "fallocate(clear)",
                format!("{} bytes at file offset {offset:#x}", chunk.size),
            ));
        }
        Ok(())
    }

    fn creates_zeroed(&self) -> bool {
        true
    }

    unsafe fn set_access(&self, addr: u64, size: usize) -> Result<()> {
        // SAFETY: the caller guarantees the range is made of our mapped chunks.
        let rc = unsafe {
            libc::mprotect(
                addr as *mut libc::c_void,
                size,
                libc::PROT_READ | libc::PROT_WRITE,
            )
        };
        if rc != 0 {
            return Err(os_error("mprotect", format!("{size} bytes at {addr:#x}")));
        }
        // SAFETY: the range is our own mapping, now readable and writable.
        if self.locked && unsafe { libc::mlock(addr as *const libc::c_void, size) } != 0 {
            let e = std::io::Error::last_os_error();
            let mut limit = libc::rlimit {
                rlim_cur: 0,
                rlim_max: 0,
            };
            // SAFETY: getrlimit writes the struct we pass.
            unsafe { libc::getrlimit(libc::RLIMIT_MEMLOCK, &mut limit) };
            return Err(Error::backend(
                NAME,
                "mlock",
                "ENOMEM",
                format!(
                    "{size} bytes at {addr:#x}: {e} (RLIMIT_MEMLOCK {} bytes)",
                    limit.rlim_cur
                ),
            ));
        }
        Ok(())
    }

    unsafe fn set_access_mode(
        &self,
        addr: u64,
        size: usize,
        mode: super::AccessMode,
    ) -> Result<()> {
        let prot = match mode {
            super::AccessMode::ReadWrite => libc::PROT_READ | libc::PROT_WRITE,
            super::AccessMode::ReadOnly => libc::PROT_READ,
        };
        // SAFETY: the caller guarantees the range is made of our mapped chunks.
        if unsafe { libc::mprotect(addr as *mut libc::c_void, size, prot) } != 0 {
            return Err(os_error(
                "mprotect",
                format!("{size} bytes at {addr:#x} ({mode:?})"),
            ));
        }
        Ok(())
    }

    unsafe fn unmap(&self, addr: u64, size: usize) -> Result<()> {
        // SAFETY: the caller guarantees the range is made of our mapped chunks that nothing uses;
        // MAP_FIXED atomically turns it back into an inaccessible reservation.
        let ptr = unsafe {
            libc::mmap(
                addr as *mut libc::c_void,
                size,
                libc::PROT_NONE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_FIXED | libc::MAP_NORESERVE,
                -1,
                0,
            )
        };
        if ptr == libc::MAP_FAILED {
            return Err(os_error(
                "mmap(PROT_NONE, MAP_FIXED)",
                format!("{size} bytes at {addr:#x}"),
            ));
        }
        forget_maps(
            &mut self.maps.lock(),
            addr,
            addr.saturating_add(size as u64),
        );
        Ok(())
    }

    fn memory_info(&self) -> Result<MemoryInfo> {
        super::meminfo::machine(NAME)
    }

    fn physical_bytes(&self) -> Result<u64> {
        let mut total = file_stat(self.memfd.as_raw_fd())?.st_blocks as u64 * 512;
        // Chunks created here with files of their own; imported ones are counted by the
        // process that created them.
        let t = self.own_files.lock();
        for f in t.files.values().filter(|f| f.origin == FileOrigin::Created) {
            total += file_stat(f.fd.as_raw_fd())?.st_blocks as u64 * 512;
        }
        Ok(total)
    }

    fn export_chunk(&self, chunk: PhysicalChunk) -> Result<OwnedFd> {
        if chunk.raw & OWN_FILE == 0 {
            return Err(Error::backend(
                NAME,
                "export_chunk",
                "UNSUPPORTED",
                format!(
                    "chunk {:#x} lives in the backend's shared memfd, which holds other chunks too; create the backend with ChunkFiles::PerChunk to export",
                    chunk.raw
                ),
            ));
        }
        let t = self.own_files.lock();
        let Some(f) = t.files.get(&chunk.raw) else {
            return Err(Error::backend(
                NAME,
                "export_chunk",
                "EBADF",
                format!("no live chunk with handle {:#x}", chunk.raw),
            ));
        };
        f.fd.try_clone().map_err(|e| {
            Error::backend(
                NAME,
                "export_chunk(dup)",
                errno_name(&e),
                format!("chunk {:#x}", chunk.raw),
            )
        })
    }

    fn import_chunk(&self, fd: OwnedFd, size: usize) -> Result<PhysicalChunk> {
        self.check_granular("imported chunk size", size as u64)?;
        let st = file_stat(fd.as_raw_fd())?;
        if st.st_mode & libc::S_IFMT != libc::S_IFREG {
            return Err(Error::backend(
                NAME,
                "import_chunk",
                "EINVAL",
                format!("descriptor is not a memory file (mode {:#o})", st.st_mode),
            ));
        }
        let len = u64::try_from(st.st_size).unwrap_or(0);
        if len < size as u64 {
            return Err(Error::backend(
                NAME,
                "import_chunk",
                "EINVAL",
                format!("chunk file holds {len} bytes, {size} asked for"),
            ));
        }
        // A file that could still shrink would turn an access through our mapping into SIGBUS.
        // SAFETY: plain fcntl on a valid descriptor.
        let seals = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_GET_SEALS) };
        if seals < 0 || seals & libc::F_SEAL_SHRINK == 0 {
            return Err(Error::backend(
                NAME,
                "import_chunk",
                "EINVAL",
                format!(
                    "chunk file of {len} bytes is not sealed against shrinking (seals {seals:#x})"
                ),
            ));
        }
        Ok(self.adopt_file(fd, FileOrigin::Imported, size))
    }

    fn copies(&self) -> &dyn Copies {
        self
    }

    /// Every address of a process on the host backend is host memory.
    fn pointer_kind(&self, _addr: u64) -> Result<Option<(MemoryKind, Option<i32>)>> {
        Ok(Some((MemoryKind::Host, None)))
    }
}

impl Copies for HostBackend {
    unsafe fn write(&self, addr: u64, data: &[u8]) -> Result<()> {
        // SAFETY: the caller guarantees the destination is mapped read-write and unshared.
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), addr as *mut u8, data.len()) };
        Ok(())
    }

    unsafe fn read(&self, addr: u64, out: &mut [u8]) -> Result<()> {
        // SAFETY: the caller guarantees the source is mapped with access.
        unsafe { std::ptr::copy_nonoverlapping(addr as *const u8, out.as_mut_ptr(), out.len()) };
        Ok(())
    }

    unsafe fn fill(&self, addr: u64, len: usize, byte: u8) -> Result<()> {
        // SAFETY: as for `write`.
        unsafe { std::ptr::write_bytes(addr as *mut u8, byte, len) };
        Ok(())
    }
}

fn file_stat(fd: RawFd) -> Result<libc::stat> {
    // SAFETY: `st` is a plain struct fstat fills.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: `fd` is a descriptor the caller holds open; `st` is valid for writing.
    if unsafe { libc::fstat(fd, &mut st) } != 0 {
        return Err(os_error("fstat", format!("descriptor {fd}")));
    }
    Ok(st)
}

/// Give the pages of a file range back to the kernel.
///
/// # Safety
/// The range must belong to no chunk that is still in use.
unsafe fn punch_hole(fd: i32, off: u64, size: usize) -> i32 {
    // SAFETY: forwarded from the caller.
    unsafe {
        libc::fallocate(
            fd,
            libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
            off as libc::off_t,
            size as libc::off_t,
        )
    }
}
