//! Storage kinds: where a layout's bytes live, as the seed's builder had them (system memory,
//! pinned host memory, device memory, a file on disk), and the memory the layout owns for the
//! kinds that are not a pool's.
//!
//! - [`StorageKind::System`]: ordinary pageable host memory (anonymous `mmap`, zeroed), or a
//!   pool on the host backend (memfd pages).
//! - [`StorageKind::Pinned`]: page-locked host memory. With a device pool, the backend's
//!   staging memory (CUDA: `cuMemHostAlloc`), which the device copies to and from at link
//!   speed; with a host pool, `mmap` + `mlock`. NUMA aware where the machine says: on a machine
//!   with more than one NUMA node the pages of a host-pool pinned layout are bound
//!   (`MPOL_PREFERRED`) to the node of the CPU that builds it before they are touched;
//!   `cuMemHostAlloc` places its pages itself ([`crate::layout::Layout::numa_node`] says `None`).
//! - [`StorageKind::Device`]: a pool on a device backend, as before.
//! - [`StorageKind::Disk`]: a file (a path, or a temporary file removed at once), sized to the
//!   layout with `posix_fallocate`; the layout's views are byte offsets in the file, never
//!   addresses. An existing file smaller than the layout is refused. Reads and writes of whole
//!   4 KiB-aligned pieces go through a second `O_DIRECT` descriptor where the file system has
//!   one.

use std::fs::{File, OpenOptions};
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use crate::backend::{Backend, MemoryKind};
use crate::error::{Error, Result};

/// Where a layout's bytes live.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum StorageKind {
    /// Ordinary (pageable) host memory.
    System,
    /// Page-locked host memory.
    Pinned,
    /// Memory of the device with this ordinal.
    Device(i32),
    /// A file on disk: the layout's views are byte offsets in the file.
    Disk,
}

impl StorageKind {
    /// The kind of a pool's memory on a backend of `kind` and `device`.
    pub(crate) fn of_pool(kind: MemoryKind, device: Option<i32>) -> Self {
        match (kind, device) {
            (MemoryKind::Device, Some(d)) => StorageKind::Device(d),
            (MemoryKind::Device, None) => StorageKind::Device(-1),
            (MemoryKind::Host, _) => StorageKind::System,
        }
    }

    /// The kind of a pool's memory on a backend described by `info`: device memory, pinned
    /// host memory (a host tier), or pageable host memory.
    pub(crate) fn of_backend(info: &crate::backend::BackendInfo) -> Self {
        match info.memory_kind {
            MemoryKind::Host if info.page_locked => StorageKind::Pinned,
            kind => Self::of_pool(kind, info.device_ordinal),
        }
    }

    /// Whether the CPU can read and write it through an address (host memory).
    pub fn is_host_memory(self) -> bool {
        matches!(self, StorageKind::System | StorageKind::Pinned)
    }

    /// A short name for messages: `system`, `pinned`, `device N`, `disk`.
    pub fn name(self) -> String {
        match self {
            StorageKind::System => "system".into(),
            StorageKind::Pinned => "pinned".into(),
            StorageKind::Device(d) => format!("device {d}"),
            StorageKind::Disk => "disk".into(),
        }
    }
}

fn page_size() -> usize {
    // SAFETY: sysconf has no memory effects.
    let p = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    usize::try_from(p).ok().filter(|&p| p > 0).unwrap_or(4096)
}

fn os_error(storage: &'static str, op: &'static str, detail: String) -> Error {
    Error::Storage {
        storage,
        op,
        detail: format!("{detail}: {}", io::Error::last_os_error()),
    }
}

/// How host memory a layout owns was made, so it goes back the same way.
enum HostSource {
    /// Anonymous `mmap` (locked or not): `munmap`.
    Mmap { mapped: usize },
    /// A backend's staging memory: `staging_free`.
    Staging(Arc<dyn Backend>),
}

/// Host memory a layout owns: `len` bytes at `addr`, page aligned.
pub(crate) struct HostBuffer {
    pub(crate) addr: u64,
    pub(crate) len: usize,
    source: HostSource,
    pub(crate) numa_node: Option<u32>,
}

impl HostBuffer {
    /// `len` bytes of zeroed pageable memory.
    pub(crate) fn system(len: usize) -> Result<Self> {
        let (addr, mapped) = mmap_anon(len, "system")?;
        Ok(HostBuffer {
            addr,
            len,
            source: HostSource::Mmap { mapped },
            numa_node: None,
        })
    }

    /// `len` bytes of page-locked memory: `mmap`, bound to this CPU's NUMA node when asked and
    /// the machine has more than one, then `mlock` (which faults every page in).
    pub(crate) fn locked(len: usize, numa_aware: bool) -> Result<Self> {
        let (addr, mapped) = mmap_anon(len, "pinned")?;
        let mut buf = HostBuffer {
            addr,
            len,
            source: HostSource::Mmap { mapped },
            numa_node: None,
        };
        buf.numa_node = if numa_aware {
            bind_to_local_node(addr, mapped)
        } else {
            None
        };
        // SAFETY: `[addr, addr + mapped)` is our own mapping.
        if unsafe { libc::mlock(addr as *const libc::c_void, mapped) } != 0 {
            let mut limit = libc::rlimit {
                rlim_cur: 0,
                rlim_max: 0,
            };
            // SAFETY: getrlimit writes the struct we pass.
            unsafe { libc::getrlimit(libc::RLIMIT_MEMLOCK, &mut limit) };
            // `buf` drops: the mapping goes.
            return Err(os_error(
                "pinned",
                "mlock",
                format!(
                    "{mapped} bytes (RLIMIT_MEMLOCK {} bytes; raise it or run with CAP_IPC_LOCK)",
                    limit.rlim_cur
                ),
            ));
        }
        Ok(buf)
    }

    /// `len` bytes of `backend`'s staging memory (CUDA: `cuMemHostAlloc`, page-locked, which
    /// the device copies at link speed).
    pub(crate) fn staging(backend: &Arc<dyn Backend>, len: usize) -> Result<Self> {
        let ptr = backend.copies().staging_alloc(len)?;
        Ok(HostBuffer {
            addr: ptr as u64,
            len,
            source: HostSource::Staging(backend.clone()),
            numa_node: None,
        })
    }

    /// The backend whose staging memory this is, if it is.
    pub(crate) fn staging_backend(&self) -> Option<&Arc<dyn Backend>> {
        match &self.source {
            HostSource::Staging(b) => Some(b),
            HostSource::Mmap { .. } => None,
        }
    }
}

impl Drop for HostBuffer {
    fn drop(&mut self) {
        match &self.source {
            HostSource::Mmap { mapped } => {
                // SAFETY: our own mapping, unmapped once; nothing refers to it any more.
                if unsafe { libc::munmap(self.addr as *mut libc::c_void, *mapped) } != 0 {
                    tracing::error!(addr = self.addr, bytes = mapped, error = %io::Error::last_os_error(), "munmap of a layout's host memory failed");
                }
            }
            HostSource::Staging(backend) => {
                // SAFETY: from this backend's `staging_alloc` of `len` bytes, freed once; every
                // copy on it was awaited by the move that queued it.
                if let Err(e) = unsafe {
                    backend
                        .copies()
                        .staging_free(self.addr as *mut u8, self.len)
                } {
                    tracing::error!(addr = self.addr, bytes = self.len, error = %e, "staging_free of a layout's pinned memory failed");
                }
            }
        }
    }
}

fn mmap_anon(len: usize, storage: &'static str) -> Result<(u64, usize)> {
    let mapped = len
        .checked_next_multiple_of(page_size())
        .filter(|&m| m > 0)
        .ok_or(Error::ZeroSize {
            what: "host layout memory",
        })?;
    // SAFETY: a fresh anonymous private mapping; no existing memory is affected.
    let p = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            mapped,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        )
    };
    if p == libc::MAP_FAILED {
        return Err(os_error(storage, "mmap", format!("{mapped} bytes")));
    }
    Ok((p as u64, mapped))
}

/// NUMA nodes online, from sysfs (`0`, `0-1`, `0,2-3`); 1 when it cannot tell.
fn numa_nodes_online() -> usize {
    let Ok(s) = std::fs::read_to_string("/sys/devices/system/node/online") else {
        return 1;
    };
    s.trim()
        .split(',')
        .filter(|p| !p.is_empty())
        .map(|p| match p.split_once('-') {
            Some((a, b)) => match (a.parse::<usize>(), b.parse::<usize>()) {
                (Ok(a), Ok(b)) if b >= a => b - a + 1,
                _ => 1,
            },
            None => 1,
        })
        .sum::<usize>()
        .max(1)
}

/// Prefer this CPU's NUMA node for `[addr, addr + len)` (before its pages are touched), where
/// the machine has more than one node. Returns the node bound to.
fn bind_to_local_node(addr: u64, len: usize) -> Option<u32> {
    if numa_nodes_online() < 2 {
        return None;
    }
    let (mut cpu, mut node) = (0u32, 0u32);
    // SAFETY: getcpu writes two u32s we own; the cache argument may be null.
    let r = unsafe {
        libc::syscall(
            libc::SYS_getcpu,
            &mut cpu as *mut u32,
            &mut node as *mut u32,
            std::ptr::null_mut::<libc::c_void>(),
        )
    };
    if r != 0 || node >= 64 {
        return None;
    }
    let mask: libc::c_ulong = 1 << node;
    const MPOL_PREFERRED: libc::c_int = 1;
    // SAFETY: mbind on our own fresh mapping with a one-word node mask.
    let r = unsafe {
        libc::syscall(
            libc::SYS_mbind,
            addr as *mut libc::c_void,
            len,
            MPOL_PREFERRED,
            &mask as *const libc::c_ulong,
            64 as libc::c_ulong,
            0 as libc::c_uint,
        )
    };
    if r != 0 {
        tracing::debug!(node, error = %io::Error::last_os_error(), "mbind of pinned layout memory failed; pages go where the kernel puts them");
        return None;
    }
    Some(node)
}

/// A file a layout lives in.
pub(crate) struct DiskFile {
    pub(crate) file: File,
    /// The same file opened with `O_DIRECT`, where the file system allows it.
    pub(crate) direct: Option<File>,
    /// `None` for a temporary file (unlinked at creation).
    pub(crate) path: Option<PathBuf>,
    pub(crate) len: u64,
}

/// Alignment of address, offset and length for `O_DIRECT` I/O.
pub(crate) const DIRECT_ALIGN: u64 = 4096;

static TEMP_SEQ: AtomicU64 = AtomicU64::new(0);

impl DiskFile {
    /// The file at `path`: created and sized to `len` bytes when it does not exist; an existing
    /// one must have at least `len` bytes (its contents are kept).
    pub(crate) fn at(path: &Path, len: u64) -> Result<Self> {
        let err = |op: &'static str, e: io::Error| Error::Storage {
            storage: "disk",
            op,
            detail: format!("{}: {e}", path.display()),
        };
        match OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .open(path)
        {
            Ok(file) => {
                if let Err(e) = allocate(&file, len) {
                    let _ = std::fs::remove_file(path);
                    return Err(Error::Storage {
                        storage: "disk",
                        op: "posix_fallocate",
                        detail: format!("{} bytes for {}: {e}", len, path.display()),
                    });
                }
                Ok(Self::opened(file, Some(path.to_owned()), len))
            }
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {
                let file = OpenOptions::new()
                    .read(true)
                    .write(true)
                    .open(path)
                    .map_err(|e| err("open", e))?;
                let have = file.metadata().map_err(|e| err("stat", e))?.len();
                if have < len {
                    return Err(Error::FileTooSmall {
                        path: path.display().to_string(),
                        len: have,
                        need: len,
                    });
                }
                Ok(Self::opened(file, Some(path.to_owned()), len))
            }
            Err(e) => Err(err("create", e)),
        }
    }

    /// A temporary file of `len` bytes in `dir`, removed from the directory at once (it goes
    /// when the layout does).
    pub(crate) fn temp(dir: &Path, len: u64) -> Result<Self> {
        let name = format!(
            ".elastic-vmm-kv-{}-{}",
            std::process::id(),
            TEMP_SEQ.fetch_add(1, Ordering::Relaxed)
        );
        let path = dir.join(name);
        let mut this = Self::at(&path, len)?;
        if let Err(e) = std::fs::remove_file(&path) {
            tracing::warn!(path = %path.display(), error = %e, "could not unlink a temporary layout file");
        }
        this.path = None;
        Ok(this)
    }

    fn opened(file: File, path: Option<PathBuf>, len: u64) -> Self {
        // A second description of the same file, with O_DIRECT (not every file system has it).
        let proc = format!("/proc/self/fd/{}", file.as_raw_fd());
        let direct = OpenOptions::new()
            .read(true)
            .write(true)
            .custom_flags(libc::O_DIRECT)
            .open(&proc)
            .ok();
        DiskFile {
            file,
            direct,
            path,
            len,
        }
    }

    /// The descriptor NIXL's FILE registrations name (`devId`).
    pub(crate) fn fd(&self) -> i32 {
        self.file.as_raw_fd()
    }

    fn pick(&self, addr: u64, offset: u64, len: u64) -> &File {
        match &self.direct {
            Some(d) if (addr | offset | len) % DIRECT_ALIGN == 0 => d,
            _ => &self.file,
        }
    }

    /// Write `len` bytes from host memory at `addr` to `offset`.
    ///
    /// # Safety
    /// `[addr, addr + len)` is host memory readable for the whole call.
    pub(crate) unsafe fn write_from(&self, addr: u64, offset: u64, len: u64) -> Result<()> {
        self.check(offset, len)?;
        // SAFETY: the caller's promise; `len` fits the file (checked), so it fits usize.
        let data = unsafe { std::slice::from_raw_parts(addr as *const u8, len as usize) };
        let file = self.pick(addr, offset, len);
        let mut r = file.write_all_at(data, offset);
        if r.is_err() && !std::ptr::eq(file, &self.file) {
            // O_DIRECT refused this memory (some mappings cannot be pinned for DMA): buffered.
            r = self.file.write_all_at(data, offset);
        }
        r.map_err(|e| Error::Storage {
            storage: "disk",
            op: "pwrite",
            detail: format!("{len} bytes at offset {offset} of {}: {e}", self.describe()),
        })
    }

    /// Read `len` bytes at `offset` into host memory at `addr`.
    ///
    /// # Safety
    /// `[addr, addr + len)` is host memory writable for the whole call, used by nobody else.
    pub(crate) unsafe fn read_into(&self, addr: u64, offset: u64, len: u64) -> Result<()> {
        self.check(offset, len)?;
        // SAFETY: the caller's promise.
        let out = unsafe { std::slice::from_raw_parts_mut(addr as *mut u8, len as usize) };
        let file = self.pick(addr, offset, len);
        let mut r = file.read_exact_at(out, offset);
        if matches!(&r, Err(e) if e.kind() != std::io::ErrorKind::UnexpectedEof)
            && !std::ptr::eq(file, &self.file)
        {
            // As in `write_from`.
            r = self.file.read_exact_at(out, offset);
        }
        r.map_err(|e| {
            let now = self.file.metadata().map(|m| m.len()).unwrap_or(0);
            Error::Storage {
                storage: "disk",
                op: "pread",
                detail: format!(
                    "{len} bytes at offset {offset} of {} ({now} bytes long now): {e}",
                    self.describe()
                ),
            }
        })
    }

    fn check(&self, offset: u64, len: u64) -> Result<()> {
        match offset.checked_add(len) {
            Some(end) if end <= self.len => Ok(()),
            _ => Err(Error::InvalidArgument(format!(
                "[{offset}, +{len}) is outside the layout's file of {} bytes",
                self.len
            ))),
        }
    }

    pub(crate) fn describe(&self) -> String {
        match &self.path {
            Some(p) => p.display().to_string(),
            None => format!("a temporary file (fd {})", self.fd()),
        }
    }
}

/// Give `file` `len` bytes of disk (`posix_fallocate`); where the file system cannot, set its
/// length (sparse).
fn allocate(file: &File, len: u64) -> io::Result<()> {
    let l = libc::off_t::try_from(len)
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "length over off_t"))?;
    if l == 0 {
        return Ok(());
    }
    // SAFETY: plain syscall on our own descriptor.
    match unsafe { libc::posix_fallocate(file.as_raw_fd(), 0, l) } {
        0 => Ok(()),
        libc::EOPNOTSUPP | libc::EINVAL => file.set_len(len),
        e => Err(io::Error::from_raw_os_error(e)),
    }
}
