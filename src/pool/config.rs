//! Pool configuration.

use crate::error::{Error, Result};

/// Default allocation unit: allocations are rounded up to, and aligned at, 512 bytes.
pub const DEFAULT_ALIGNMENT: usize = 512;
/// Default largest physical chunk: 1 GiB. Larger chunks cost fewer driver calls per byte
/// (`cuMemSetAccess` is charged per chunk), smaller ones can be given back piecemeal.
pub const DEFAULT_MAX_CHUNK: usize = 1 << 30;
/// Default growth look-ahead: when the allocator must map, it maps at least 1/8 of what is
/// already mapped, so steady growth makes few, ever larger driver calls.
pub const DEFAULT_GROWTH_DIVISOR: u64 = 8;

/// How a [`crate::Pool`] is set up. Build with [`PoolConfig::new`] and the setters.
#[derive(Debug, Clone)]
pub struct PoolConfig {
    pub(crate) capacity: usize,
    pub(crate) name: String,
    pub(crate) alignment: usize,
    pub(crate) max_chunk: usize,
    pub(crate) range_chunk: Option<usize>,
    pub(crate) growth_divisor: u64,
    pub(crate) max_cached: Option<u64>,
    pub(crate) physical_limit: Option<u64>,
}

impl PoolConfig {
    /// A pool reserving `capacity` bytes of virtual address space (rounded up to the backend's
    /// granularity). Nothing physical is created until asked.
    pub fn new(capacity: usize) -> Self {
        PoolConfig {
            capacity,
            name: "pool".into(),
            alignment: DEFAULT_ALIGNMENT,
            max_chunk: DEFAULT_MAX_CHUNK,
            range_chunk: None,
            growth_divisor: DEFAULT_GROWTH_DIVISOR,
            max_cached: None,
            physical_limit: None,
        }
    }

    /// A name for reports and `tracing` events.
    pub fn name(mut self, name: impl Into<String>) -> Self {
        self.name = name.into();
        self
    }

    /// Allocation unit (a power of two, at most the granularity). Default 512 bytes.
    pub fn alignment(mut self, alignment: usize) -> Self {
        self.alignment = alignment;
        self
    }

    /// Largest physical chunk the allocator creates (a multiple of the granularity).
    /// Default 1 GiB.
    pub fn max_chunk(mut self, bytes: usize) -> Self {
        self.max_chunk = bytes;
        self
    }

    /// Largest physical chunk [`crate::Pool::map`] uses. Default: the granularity, so any
    /// granule-aligned part of a mapped range can be unmapped on its own. Larger values cost fewer
    /// driver calls per byte but [`crate::Pool::unmap`] must then cover whole chunks.
    pub fn range_chunk(mut self, bytes: usize) -> Self {
        self.range_chunk = Some(bytes);
        self
    }

    /// Growth look-ahead: when the allocator has to map, it maps at least `mapped / divisor`
    /// (at most the max chunk). `0` maps exactly what each request needs. Default 8.
    pub fn growth_divisor(mut self, divisor: u64) -> Self {
        self.growth_divisor = divisor;
        self
    }

    /// Cap on cached (created but unmapped) bytes; beyond it chunks are released at once.
    /// Default: no cap ([`crate::Pool::trim`] releases the cache).
    pub fn max_cached(mut self, bytes: u64) -> Self {
        self.max_cached = Some(bytes);
        self
    }

    /// Cap on physical bytes (mapped plus cached) this pool may hold. Default: none beyond
    /// the device's memory.
    pub fn physical_limit(mut self, bytes: u64) -> Self {
        self.physical_limit = Some(bytes);
        self
    }

    /// Check the values against the backend's granularity; returns the rounded capacity.
    pub(crate) fn validate(&self, granularity: usize) -> Result<u64> {
        if self.capacity == 0 {
            return Err(Error::ZeroSize {
                what: "pool capacity",
            });
        }
        let capacity =
            crate::error::round_up("pool capacity", self.capacity as u64, granularity as u64)?;
        if !self.alignment.is_power_of_two() || self.alignment > granularity {
            return Err(Error::InvalidArgument(format!(
                "alignment {} must be a power of two no larger than the granularity {granularity}",
                self.alignment
            )));
        }
        let multiple = |what: &'static str, v: usize| -> Result<()> {
            if v == 0 || v % granularity != 0 {
                return Err(Error::Misaligned {
                    what,
                    value: v as u64,
                    alignment: granularity as u64,
                });
            }
            Ok(())
        };
        multiple("max_chunk", self.max_chunk)?;
        if let Some(rc) = self.range_chunk {
            multiple("range_chunk", rc)?;
        }
        Ok(capacity)
    }
}
