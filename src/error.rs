//! The crate's error type. Every variant carries the numbers a user needs to act on it.

/// Result alias used throughout the crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Everything that can go wrong in elastic-vmm.
///
/// Sizes and offsets are in bytes; offsets are relative to the start of the pool's reservation.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A size that must be positive was zero.
    #[error("{what} must be at least 1 byte, got 0")]
    ZeroSize {
        /// What was zero.
        what: &'static str,
    },

    /// Arithmetic on a size or offset overflowed.
    #[error("size overflow: {what} ({detail})")]
    SizeOverflow {
        /// What was being computed.
        what: &'static str,
        /// The operands.
        detail: String,
    },

    /// A value that must be aligned was not.
    #[error("{what} = {value:#x} is not a multiple of {alignment:#x}")]
    Misaligned {
        /// What was misaligned.
        what: &'static str,
        /// The value given.
        value: u64,
        /// The alignment it needs.
        alignment: u64,
    },

    /// A configuration value or argument is invalid.
    #[error("invalid argument: {0}")]
    InvalidArgument(String),

    /// No free virtual range is large enough.
    #[error(
        "out of address space: requested {requested} bytes, largest free range is {largest_free} bytes of {capacity} reserved"
    )]
    OutOfAddressSpace {
        /// Bytes asked for (rounded to the allocation unit).
        requested: u64,
        /// The largest range that could have been used.
        largest_free: u64,
        /// The pool's reserved capacity.
        capacity: u64,
    },

    /// Physical memory is exhausted: by the pool's own limit or by the device.
    #[error(
        "out of physical memory: requested {requested} bytes, {available} bytes available ({source_of_limit})"
    )]
    OutOfPhysicalMemory {
        /// Bytes of new physical memory needed.
        requested: u64,
        /// Bytes that could still be created.
        available: u64,
        /// Which limit was hit: the pool's limit, or the device.
        source_of_limit: String,
    },

    /// A range lies (partly) outside the reservation.
    #[error("range [{offset:#x}, {end:#x}) is outside the reservation of {capacity:#x} bytes", end = offset.saturating_add(*len))]
    RangeOutOfBounds {
        /// Start of the range.
        offset: u64,
        /// Length of the range.
        len: u64,
        /// Reserved capacity.
        capacity: u64,
    },

    /// `unmap` over a range that is not (entirely) mapped through the range API.
    #[error(
        "range [{offset:#x}, {end:#x}) is not mapped: [{hole_offset:#x}, {hole_end:#x}) within it is unmapped",
        end = offset + len, hole_end = hole_offset + hole_len
    )]
    RangeNotMapped {
        /// Start of the requested range.
        offset: u64,
        /// Length of the requested range.
        len: u64,
        /// Start of the first unmapped part.
        hole_offset: u64,
        /// Length of the first unmapped part.
        hole_len: u64,
    },

    /// `map` over a range that is (partly) mapped already.
    #[error(
        "range [{offset:#x}, {end:#x}) is already mapped: [{mapped_offset:#x}, {mapped_end:#x}) within it is mapped",
        end = offset + len, mapped_end = mapped_offset + mapped_len
    )]
    RangeAlreadyMapped {
        /// Start of the requested range.
        offset: u64,
        /// Length of the requested range.
        len: u64,
        /// Start of the first mapped part.
        mapped_offset: u64,
        /// Length of the first mapped part.
        mapped_len: u64,
    },

    /// `map` over a range the pool's allocator is using for [`crate::Allocation`]s.
    #[error(
        "range [{offset:#x}, {end:#x}) overlaps memory managed by the allocator at [{busy_offset:#x}, {busy_end:#x})",
        end = offset + len, busy_end = busy_offset + busy_len
    )]
    RangeInUse {
        /// Start of the requested range.
        offset: u64,
        /// Length of the requested range.
        len: u64,
        /// Start of the conflicting part.
        busy_offset: u64,
        /// Length of the conflicting part.
        busy_len: u64,
    },

    /// `unmap` would cut a physical chunk in two; chunks are unmapped whole.
    #[error(
        "range [{offset:#x}, {end:#x}) cuts through the physical chunk at [{chunk_offset:#x}, {chunk_end:#x}); unmap whole chunks or map with a smaller chunk size",
        end = offset + len, chunk_end = chunk_offset + chunk_len
    )]
    SplitsChunk {
        /// Start of the requested range.
        offset: u64,
        /// Length of the requested range.
        len: u64,
        /// Start of the chunk that would be split.
        chunk_offset: u64,
        /// Length of that chunk.
        chunk_len: u64,
    },

    /// A driver call failed.
    #[error("{backend} backend: {call} failed with {code}{}", if detail.is_empty() { String::new() } else { format!(" ({detail})") })]
    Backend {
        /// Which backend.
        backend: &'static str,
        /// The driver call, e.g. `cuMemMap`.
        call: &'static str,
        /// The driver's error name, e.g. `CUDA_ERROR_OUT_OF_MEMORY` or `ENOMEM`.
        code: String,
        /// Arguments of the failed call.
        detail: String,
    },

    /// A backend cannot be used on this machine (no driver, no device, no VMM support).
    #[error("{backend} backend unavailable: {reason}")]
    BackendUnavailable {
        /// Which backend.
        backend: &'static str,
        /// Why.
        reason: String,
    },

    /// The pool takes no new allocations or mappings (its model was unregistered).
    #[error("pool {pool} is closed to new memory: {reason}")]
    PoolClosed {
        /// The pool's name.
        pool: String,
        /// Why.
        reason: String,
    },

    // ---- shared pool ----
    /// A model id is registered already.
    #[error("model {model:?} is already registered")]
    DuplicateModel {
        /// The id.
        model: String,
    },

    /// No model with this id is registered.
    #[error("no model {model:?} is registered")]
    UnknownModel {
        /// The id.
        model: String,
    },

    /// A model's settings are inconsistent (guarantee above limit, zero capacity, ...).
    #[error("model {model:?}: {reason}")]
    InvalidModelConfig {
        /// The id.
        model: String,
        /// What is wrong, with the numbers.
        reason: String,
    },

    /// Admission refused a physical growth, before any driver call.
    #[error(
        "model {model:?} asked for {requested} more bytes and was refused: {cause}; model uses {model_used} of its limit {model_limit}, the device budget has {global_used} of {global_limit} in use and {reserved_for_others} reserved for other models' guarantees"
    )]
    AdmissionRefused {
        /// The model.
        model: String,
        /// Bytes of new physical memory asked for.
        requested: u64,
        /// What refused it: the model's limit or the global budget.
        cause: &'static str,
        /// The model's physical use.
        model_used: u64,
        /// The model's limit.
        model_limit: u64,
        /// Physical use of all models.
        global_used: u64,
        /// The global limit.
        global_limit: u64,
        /// Unused guarantees of the other models.
        reserved_for_others: u64,
    },

    /// A model still holds memory and cannot be unregistered.
    #[error("model {model:?} still has {live_allocations} live allocations and {mapped_ranges} bytes of mapped ranges ({bytes} bytes in use)")]
    ModelBusy {
        /// The model.
        model: String,
        /// Live allocations.
        live_allocations: u64,
        /// Bytes mapped through the range API.
        mapped_ranges: u64,
        /// Bytes in use in total.
        bytes: u64,
    },

    /// Lowering a limit or raising a guarantee could not be achieved; nothing was changed
    /// except the memory that was reclaimed on the way.
    #[error(
        "model {model:?}: cannot set {what} to {wanted} bytes: {reason} (model uses {used} bytes after reclaiming {reclaimed})"
    )]
    ChangeNotReached {
        /// The model.
        model: String,
        /// `"limit"` or `"guarantee"`.
        what: &'static str,
        /// The value asked for.
        wanted: u64,
        /// Why it could not be reached, with the numbers.
        reason: String,
        /// The model's physical use now.
        used: u64,
        /// Bytes reclaimed while trying.
        reclaimed: u64,
    },
}

impl Error {
    /// A backend failure with the call's arguments in it.
    pub(crate) fn backend(
        backend: &'static str,
        call: &'static str,
        code: impl Into<String>,
        detail: impl Into<String>,
    ) -> Self {
        Error::Backend {
            backend,
            call,
            code: code.into(),
            detail: detail.into(),
        }
    }

    /// Physical memory ran out: the driver said so, or a limit refused the growth.
    pub fn is_out_of_memory(&self) -> bool {
        match self {
            Error::OutOfPhysicalMemory { .. } | Error::AdmissionRefused { .. } => true,
            Error::Backend { code, .. } => {
                code == "CUDA_ERROR_OUT_OF_MEMORY" || code == "ENOMEM" || code == "ENOSPC"
            }
            _ => false,
        }
    }
}

/// Round `value` up to a multiple of `unit` (a power of two), checked.
pub(crate) fn round_up(what: &'static str, value: u64, unit: u64) -> Result<u64> {
    debug_assert!(unit.is_power_of_two());
    value
        .checked_add(unit - 1)
        .map(|v| v & !(unit - 1))
        .ok_or_else(|| Error::SizeOverflow {
            what,
            detail: format!("{value} rounded up to a multiple of {unit}"),
        })
}
