//! # elastic-vmm
//!
//! Elastic GPU memory for LLM serving, managed the way an operating system manages RAM:
//! reserve a huge virtual address range once, map physical memory on demand, give it back when
//! the data goes.
//!
//! - [`backend`]: the only code that calls a driver. [`backend::cuda::CudaBackend`] uses the
//!   CUDA VMM API (loaded at run time); [`backend::host::HostBackend`] gives the same semantics
//!   on host memory with `mmap` and a `memfd`, so everything runs and is tested without a GPU.
//! - [`Pool`]: one reservation on one backend. RAII [`Allocation`]s whose hot path makes no
//!   driver call, and a range API ([`Pool::map`], [`Pool::unmap`]) for KV-cache managers.
//! - [`SharedPool`]: several models on one device, each a [`ModelHandle`] (a pool of its own)
//!   under a physical limit, with guarantees, live limit changes and reclaim of idle memory.
//! - [`Region`]: a part of a pool's reservation set aside for one owner's range mappings, and
//!   [`backing::BlockBacking`]: blocks over a region whose pages are mapped only while a block on
//!   them is in use (the elastic half of a KV cache).
//! - [`layout`]: KV-cache layouts (fully contiguous or layer separate) as offset views over
//!   pool memory, fully mapped or elastic (blocks backed on demand).
//! - `nixl` (feature `nixl`): registration of mapped memory with NIXL, one registration per
//!   physical chunk, and block transfers between layouts.
//! - `candle` (feature `candle`): candle tensors in pool memory, and elastic KV tensors whose
//!   blocks are backed on demand.
//! - Sleep and wake ([`Pool::sleep`], [`Pool::wake`]): a pool (a model) gives its physical
//!   memory back, offloading what its [`SleepPolicy`] keeps (by [`Tag`]) to host memory, and
//!   gets it back at the same virtual addresses.
//! - [`route`]: every CUDA allocation of a thread (candle's own) in a model's pool, opted into
//!   once per binary with [`route_cuda_allocations!`], per-tag stats, stream-ordered reuse.
//! - `broker` (feature `broker`): one device's memory shared by engine processes through a
//!   daemon that owns every chunk, with quotas, hand-over and crash safety.
//! - [`ipc`]: framed messages over Unix sockets with descriptors attached (`SCM_RIGHTS`): how
//!   chunks exported as POSIX descriptors travel between processes.
//! - [`p2p`]: KV blocks moving between engine processes on one node: chunks granted as
//!   descriptors, imported and copied by the receiver at device speed.
//! - [`stats`]: O(1) snapshots of memory and driver calls.
//!
//! ## Zeroing
//! Memory from [`Pool::allocate`] has unspecified contents. Physical memory freshly created on
//! the host backend reads as zero (it comes from a `memfd`); CUDA makes no such promise. Memory
//! reused from the pool (idle mapped memory or cached chunks) keeps whatever was written to it
//! last. Use [`MemOptions::zeroed`] or [`Allocation::fill`] when zeros are needed.
//!
//! ## Example
//! ```
//! use elastic_vmm::Pool;
//! # fn main() -> elastic_vmm::Result<()> {
//! let pool = Pool::host(64 << 30)?; // 64 GiB of address space, nothing physical yet
//! let mut a = pool.allocate(3 << 20)?; // maps physical memory
//! a.write(0, b"hello")?;
//! drop(a); // back to the pool, still mapped for the next allocation
//! assert_eq!(pool.stats().in_use, 0);
//! pool.trim()?; // physical memory goes back to the system
//! assert_eq!(pool.stats().mapped, 0);
//! # Ok(()) }
//! ```

#![warn(missing_docs)]

pub mod backend;
pub mod backing;
#[cfg(feature = "broker")]
pub mod broker;
mod budget;
#[cfg(feature = "candle")]
pub mod candle;
mod error;
pub mod ipc;
pub mod kv;
pub mod layout;
#[cfg(feature = "nixl")]
pub mod nixl;
pub mod p2p;
mod pool;
pub mod route;
pub mod shared;
pub mod stats;
mod tag;

pub use backend::{
    AccessMode, Backend, BackendInfo, Copies, DeviceReach, DriverCall, MemoryInfo, MemoryKind,
    PhysicalChunk,
};
pub use backing::{
    BackingChange, BackingStats, BlockBacking, BlockGeometry, MappingHook, UniformBlocks,
};
pub use error::{Error, Result};
pub use pool::{
    AfterWake, Allocation, ChunkSpan, HostStaging, LiveAllocation, MemOptions, Pool, PoolConfig,
    Region, SleepAction, SleepPolicy, SleepReport, SleepStats, SleepStatus, TrimReport, WakeReport,
    DEFAULT_ALIGNMENT, DEFAULT_GROWTH_DIVISOR, DEFAULT_MAX_CHUNK,
};
pub use shared::{ModelConfig, ModelHandle, SharedPool, SharedPoolConfig};
pub use stats::{DriverCalls, PoolStats};
pub use tag::Tag;
