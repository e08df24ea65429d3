//! Host memory with the CUDA VMM model: the embedded default backend.
//!
//! - reserve: `mmap(PROT_NONE, MAP_NORESERVE)`; nothing is committed.
//! - physical chunks: ranges of one sparse `memfd`, committed with `fallocate` at `create`
//!   (fresh chunks therefore read as zero) and handed back with `FALLOC_FL_PUNCH_HOLE` at
//!   `release`, so both the process's resident memory and the memfd's blocks really drop.
//! - map: `mmap(MAP_FIXED | MAP_SHARED)` of the chunk's file range, `PROT_NONE` until
//!   `set_access` (`mprotect` read-write), as CUDA maps without access until `cuMemSetAccess`.
//! - unmap: the range is replaced by a fresh `PROT_NONE` reservation.

use std::collections::BTreeMap;
use std::ffi::CStr;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

use parking_lot::Mutex;

use super::{Backend, BackendInfo, MemoryInfo, MemoryKind, PhysicalChunk};
use crate::error::{Error, Result};

/// Default mapping granularity of the host backend: 2 MiB, as CUDA's on the H100.
pub const DEFAULT_GRANULARITY: usize = 2 << 20;

/// The memfd is sized once to this (sparse) length; physical chunks are ranges inside it.
const MEMFD_SPAN: u64 = 1 << 46;

const NAME: &str = "host";

/// The host backend. See the module documentation.
#[derive(Debug)]
pub struct HostBackend {
    info: BackendInfo,
    memfd: OwnedFd,
    offsets: Mutex<FileRanges>,
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

fn read_meminfo() -> Result<MemoryInfo> {
    let text = std::fs::read_to_string("/proc/meminfo")
        .map_err(|e| Error::backend(NAME, "read /proc/meminfo", errno_name(&e), ""))?;
    let field = |key: &str| -> Option<u64> {
        let line = text.lines().find(|l| l.starts_with(key))?;
        let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
        Some(kib * 1024)
    };
    match (field("MemAvailable:"), field("MemTotal:")) {
        (Some(free), Some(total)) => Ok(MemoryInfo { free, total }),
        _ => Err(Error::backend(
            NAME,
            "read /proc/meminfo",
            "unparsable",
            "MemAvailable or MemTotal missing",
        )),
    }
}

impl HostBackend {
    /// A host backend with the given granularity (a power of two, at least the 4 KiB page).
    pub fn new(granularity: usize) -> Result<Self> {
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
        let total = read_meminfo()?.total;
        Ok(HostBackend {
            info: BackendInfo {
                name: NAME,
                memory_kind: MemoryKind::Host,
                device_ordinal: None,
                device_name: "host memory (memfd)".into(),
                granularity,
                min_granularity: page,
                vmm_supported: true,
                rdma_capable: false,
                posix_fd_exportable: true,
                total_memory: total,
            },
            memfd,
            offsets: Mutex::new(FileRanges::default()),
        })
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
        // SAFETY: the caller guarantees this is exactly one of our reservations, unused.
        if unsafe { libc::munmap(base as *mut libc::c_void, size) } != 0 {
            return Err(os_error("munmap", format!("{size} bytes at {base:#x}")));
        }
        Ok(())
    }

    fn create(&self, size: usize) -> Result<PhysicalChunk> {
        self.check_granular("chunk size", size as u64)?;
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
        // SAFETY: the caller guarantees [addr, addr + size) is an unmapped part of one of our
        // reservations, so MAP_FIXED replaces only our own PROT_NONE placeholder.
        let ptr = unsafe {
            libc::mmap(
                addr as *mut libc::c_void,
                chunk.size,
                libc::PROT_NONE,
                libc::MAP_SHARED | libc::MAP_FIXED,
                self.memfd.as_raw_fd(),
                chunk.raw as libc::off_t,
            )
        };
        if ptr == libc::MAP_FAILED {
            return Err(os_error(
                "mmap(MAP_FIXED)",
                format!("{} bytes at {addr:#x}", chunk.size),
            ));
        }
        Ok(())
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
        Ok(())
    }

    fn memory_info(&self) -> Result<MemoryInfo> {
        read_meminfo()
    }

    fn physical_bytes(&self) -> Result<u64> {
        // SAFETY: `st` is a plain struct fstat fills; the descriptor is valid.
        let mut st: libc::stat = unsafe { std::mem::zeroed() };
        // SAFETY: as above.
        if unsafe { libc::fstat(self.memfd.as_raw_fd(), &mut st) } != 0 {
            return Err(os_error("fstat", "memfd".into()));
        }
        Ok(st.st_blocks as u64 * 512)
    }

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
