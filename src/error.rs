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

    /// A [`crate::MemOptions`] option was set on a call it does not apply to.
    #[error("option `{option}` does not apply to {call}")]
    OptionNotApplicable {
        /// The option (`name`, `zeroed`, `chunk`).
        option: &'static str,
        /// The call that refused it.
        call: &'static str,
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

    // ---- sleep and wake ----
    /// An operation that needs the pool's memory mapped was refused: the pool is asleep, or
    /// falling asleep, or waking. Wake it first ([`crate::Pool::wake`]).
    #[error("pool {pool} is {state}: {op} refused until it is awake (wake it first)")]
    Asleep {
        /// The pool's name.
        pool: String,
        /// What was refused: `allocate`, `map`, `unmap`, `read`, `write`...
        op: &'static str,
        /// `asleep`, `falling asleep` or `waking`.
        state: &'static str,
    },

    /// A sleep or wake was refused before it changed anything: another one is under way, the
    /// pool is not in the state it needs, or memory it would unmap is in use right now.
    #[error("pool {pool}: {op} refused, nothing changed: {reason}")]
    SleepRefused {
        /// The pool's name.
        pool: String,
        /// `sleep` or `wake`.
        op: &'static str,
        /// Why, with the numbers.
        reason: String,
    },

    /// Waking found no room for the pool's memory; the pool stays asleep with its contents.
    #[error("pool {pool} cannot wake: asked for {asked} bytes, {free} bytes free under a limit of {limit} ({reason}); it stays asleep, nothing lost")]
    WakeRefused {
        /// The pool's name.
        pool: String,
        /// Bytes of physical memory waking needs.
        asked: u64,
        /// Bytes it could have now (the admission's headroom, or the device's free memory).
        free: u64,
        /// The limit that applies (the model's, the pool's, or the device's total).
        limit: u64,
        /// What refused it.
        reason: String,
    },

    /// A message between processes could not be sent or received: a socket error, a closed
    /// connection, or a malformed or oversized frame.
    #[error("ipc: {op}: {detail}")]
    Ipc {
        /// What was being done.
        op: &'static str,
        /// What went wrong, with the numbers.
        detail: String,
    },

    /// A socket's folder, lock file or path is not safe to use: another user owns it, others
    /// may write it, it is a symbolic link, or something other than a stale socket sits at the
    /// socket's path. The path named is left as it was.
    #[error("{path}: {problem}; refused, {path} left as it was")]
    InsecurePath {
        /// The path.
        path: std::path::PathBuf,
        /// What is wrong, with owner and mode.
        problem: String,
    },

    /// The broker refused a request (other than a growth, which is
    /// [`Error::AdmissionRefused`]).
    #[error("broker: {kind}: {message}")]
    Broker {
        /// What kind of failure (`Unknown`, `Duplicate`, `NotReached`, ...).
        kind: String,
        /// Why, with the numbers.
        message: String,
    },

    /// Blocks moving between processes ([`crate::p2p`]): the peer refused, broke the protocol,
    /// or is gone.
    #[error("peer {peer:?}: {op}: {detail}")]
    Peer {
        /// The peer's name (from its hello), or its socket when not known yet.
        peer: String,
        /// What was being done.
        op: &'static str,
        /// What went wrong, with the numbers.
        detail: String,
    },

    /// No peer of this name is connected.
    #[error("no peer {name:?} is connected (connected: {known:?})")]
    UnknownPeer {
        /// The name asked for.
        name: String,
        /// The peers connected now.
        known: Vec<String>,
    },

    /// A p2p peer runs as another user than this process, one not allowed
    /// (`p2p::LinkOptions::allow_uid`): refused before anything is said or sent to it.
    #[error("p2p peer process {pid} runs as uid {uid}, this process as uid {ours}: refused (only uid {ours} and the uids allowed, {allowed:?}, may link)")]
    PeerUserRefused {
        /// The peer's process (`SO_PEERCRED`).
        pid: i32,
        /// The peer's effective user id when it connected or listened.
        uid: u32,
        /// Our effective user id.
        ours: u32,
        /// The other user ids allowed on this link.
        allowed: Vec<u32>,
    },

    /// Two layouts whose blocks cannot be copied one onto the other (block size or kind
    /// differ), or block lists that do not pair up.
    #[error("layout mismatch: {detail}")]
    LayoutMismatch {
        /// What differs, with both sides' numbers.
        detail: String,
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

    /// A setting read from the environment (an orchestrator's variable) is missing or not
    /// what it must be; the text is quoted as it was found.
    #[error("model {model:?}: environment variable {var}={value:?}: {reason}")]
    BadEnvVar {
        /// The model being configured.
        model: String,
        /// The variable.
        var: &'static str,
        /// Its text (empty when unset).
        value: String,
        /// What is wrong.
        reason: String,
    },

    /// Routing was asked for in a binary that does not define the hooks.
    #[error("CUDA allocation routing is not installed in this binary: invoke elastic_vmm::route_cuda_allocations!() once at the top level of the binary crate (main.rs, or the test target's root)")]
    RoutingNotInstalled,

    /// Admission refused a physical growth, before any driver call.
    #[error(
        "model {model:?} asked for {requested} more bytes and was refused: {cause}; model uses {model_used} of its limit {model_limit}, the budget has {global_used} of {global_limit} in use and {reserved_for_others} reserved for other models' guarantees"
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

    /// A shared pool's global limit cannot be lowered that far: models hold (or were
    /// guaranteed) more than it, even after their idle memory was given back. Nothing changed.
    #[error(
        "cannot set the global limit to {wanted} bytes: models hold {used} bytes and {guaranteed} more are guaranteed to them (at least {needed} needed; {reclaimed} bytes of idle memory were given back trying); the limit stays {limit}"
    )]
    GlobalLimitRefused {
        /// The value asked for.
        wanted: u64,
        /// Bytes charged to models (and leaked) afterwards.
        used: u64,
        /// Guaranteed bytes models do not use yet.
        guaranteed: u64,
        /// The lowest limit possible now: `used + guaranteed`.
        needed: u64,
        /// Bytes of idle memory given back while trying.
        reclaimed: u64,
        /// The limit, unchanged.
        limit: u64,
    },

    // ---- layouts and NIXL ----
    /// A KV-cache layout's configuration or memory is unusable (zero dimension, region too
    /// small or misaligned, mixed memory kinds, mismatched shapes).
    #[error("invalid layout: {0}")]
    InvalidLayout(String),

    /// A block, layer or outer index outside the layout.
    #[error("{what} {index} does not exist: the layout has {count}")]
    OutOfLayout {
        /// `"block"`, `"layer"` or `"outer index"`.
        what: &'static str,
        /// The index given.
        index: usize,
        /// How many there are.
        count: usize,
    },

    /// A transfer touches a block of an elastic layout that has no physical memory; refused
    /// before NIXL is called.
    #[error("{side} block {block} is not backed: transfer of {blocks} blocks refused before any NIXL call")]
    BlockNotBacked {
        /// Which side of the transfer: `"local"` or `"remote"`.
        side: &'static str,
        /// The first unbacked block.
        block: usize,
        /// Blocks in the transfer.
        blocks: usize,
    },

    /// The NIXL library cannot be used (feature `nixl`): it is not installed or not on the
    /// library path. Any NIXL call would abort the process, so none was made.
    #[error("NIXL unavailable: {reason}")]
    NixlUnavailable {
        /// Why, and what to do.
        reason: String,
    },

    /// A NIXL call failed (feature `nixl`).
    #[error("NIXL {call} failed: {detail}")]
    Nixl {
        /// The call, e.g. `register_memory`.
        call: &'static str,
        /// NIXL's error and the arguments of the call.
        detail: String,
    },

    /// Memory that must be registered with a NIXL agent is not (entirely).
    #[error(
        "[{addr:#x}, {end:#x}) is not registered with NIXL agent {agent:?}: [{hole_addr:#x}, {hole_end:#x}) within it has no registration",
        end = addr.saturating_add(*len), hole_end = hole_addr.saturating_add(*hole_len)
    )]
    NotRegistered {
        /// The agent.
        agent: String,
        /// Start of the range asked for.
        addr: u64,
        /// Its length.
        len: u64,
        /// Start of the first part with no registration.
        hole_addr: u64,
        /// Length of that part.
        hole_len: u64,
    },

    /// A NIXL transfer did not complete in time; it was released (aborted).
    #[error("NIXL {op} of {bytes} bytes in {descriptors} descriptors did not complete within {waited_ms} ms")]
    TransferTimeout {
        /// `"WRITE"` or `"READ"`.
        op: &'static str,
        /// Bytes in the transfer.
        bytes: u64,
        /// Descriptors in the transfer.
        descriptors: usize,
        /// How long it was waited for.
        waited_ms: u64,
    },

    // ---- candle tensors and elastic tensors ----
    /// A candle operation failed (feature `candle`).
    #[cfg(feature = "candle")]
    #[error("candle {op} failed: {message}")]
    Candle {
        /// The candle operation, e.g. `index_select`.
        op: &'static str,
        /// Candle's error.
        message: String,
    },

    /// An operation on an elastic tensor touches a block with no physical memory; refused before
    /// any kernel could read unmapped memory.
    #[error("elastic tensor: {op} over {blocks} block(s) refused: block {block} is not backed ({backed} of {max_blocks} blocks are)")]
    ElasticBlockNotBacked {
        /// The operation: `view`, `gather`, `write`, `release`...
        op: &'static str,
        /// The first unbacked block.
        block: usize,
        /// Blocks the operation asked for.
        blocks: usize,
        /// Blocks backed now.
        backed: usize,
        /// Blocks of the tensor.
        max_blocks: usize,
    },

    /// A [`crate::kv::PagedKv`] has fewer free blocks than asked for; nothing was allocated.
    #[error("paged KV cache: {requested} blocks asked for, {free} free of {max_blocks}")]
    KvOutOfBlocks {
        /// Blocks asked for.
        requested: usize,
        /// Blocks free (allocated by nobody) now.
        free: usize,
        /// Blocks of the cache.
        max_blocks: usize,
    },

    /// A block id given to a [`crate::kv::PagedKv`] is wrong; nothing was changed.
    #[error("paged KV cache: block {block} (of {max_blocks}): {reason}")]
    KvBadBlock {
        /// The block id.
        block: usize,
        /// Blocks of the cache (ids are `0..max_blocks`).
        max_blocks: usize,
        /// What is wrong with it.
        reason: &'static str,
    },

    /// A [`crate::kv::PagedKv::compact`] failed part way and was rolled back: every block keeps
    /// its id and its contents, the blocks it took were given back.
    #[error("paged KV compaction of {moves} block(s) ({bytes} bytes to copy) failed and was rolled back (every block keeps its id and contents): {source}")]
    KvCompactionFailed {
        /// Blocks the compaction meant to move.
        moves: usize,
        /// Bytes it meant to copy.
        bytes: u64,
        /// What failed.
        source: Box<Error>,
    },

    /// A [`crate::kv::PagedKv::compact`] was asked for while another one runs on the same
    /// cache; nothing was done.
    #[error("paged KV cache: a compaction is already running ({op} refused); call again once it returned")]
    KvCompactionBusy {
        /// What was refused.
        op: &'static str,
    },

    /// A block of an elastic tensor is still used (by a live view, or an operation queuing a
    /// kernel) and cannot be released; nothing was changed.
    #[error("elastic tensor: block {block} is in use by {users} user(s): {detail}")]
    ElasticBlockInUse {
        /// The first block found in use.
        block: usize,
        /// How many views or operations hold the blocks asked for.
        users: usize,
        /// What holds it.
        detail: String,
    },

    // ---- block backing ----
    /// A block of a [`crate::BlockBacking`] (or an elastic layout) is pinned, by a transfer or
    /// another consumer of its memory, and cannot be released; nothing was changed.
    #[error("block {block} is pinned by {pins} user(s), one of them {holder}: release of {blocks} block(s) refused, nothing changed")]
    BlockPinned {
        /// The first pinned block found among those asked for.
        block: usize,
        /// Pins on it now.
        pins: usize,
        /// Who holds one of them (the name given to `pin`).
        holder: String,
        /// Blocks the release asked for.
        blocks: usize,
    },

    /// A transfer of device memory that NIXL would move only by software emulation (over TCP
    /// loopback, 0.3-0.5 GB/s on an H100 where a copy runs at over 1,000 GB/s) and the crate
    /// cannot copy itself; refused before any byte moved (feature `nixl`).
    #[error("no device path for a NIXL {op} of {bytes} bytes: {why}; {remedy}")]
    NixlNoDevicePath {
        /// `WRITE` or `READ`.
        op: &'static str,
        /// Bytes asked for.
        bytes: u64,
        /// Why neither NIXL's UCX nor the crate's own copy has a device path here.
        why: String,
        /// How to move it anyway.
        remedy: &'static str,
    },

    /// A NIXL agent has no backend that moves a layout's memory type; refused before any
    /// registration.
    #[error("NIXL agent {agent:?} has backends {have:?}, none of which moves {mem} memory ({need} does): add one with NixlAgent::add_backend")]
    NixlNoBackend {
        /// The agent.
        agent: String,
        /// The memory type (`Dram`, `Vram`, `File`).
        mem: String,
        /// Its backends.
        have: Vec<String>,
        /// Plugins that would move it.
        need: &'static str,
    },

    // ---- storage kinds and tier moves ----
    /// Memory or a file for a layout's storage could not be made, read or written.
    #[error("{storage} storage: {op} failed: {detail}")]
    Storage {
        /// `"system"`, `"pinned"`, `"disk"`, or `"tier"` (a tier move's own threads).
        storage: &'static str,
        /// The call that failed.
        op: &'static str,
        /// What it was asked, and the OS's answer.
        detail: String,
    },

    /// An existing file is smaller than the layout placed in it; refused, the file untouched.
    #[error("{path} has {len} bytes, the layout needs {need}: refused, the file left as it was")]
    FileTooSmall {
        /// The file.
        path: String,
        /// Its length.
        len: u64,
        /// The layout's extent.
        need: u64,
    },

    /// A move of blocks between tiers failed part way; the source blocks are intact and the
    /// destination's slots were given back (see [`crate::layout::KvTiers`]).
    #[error("tier move of {blocks} block(s) {from} -> {to} failed after {copied} of {bytes} bytes, rolled back (the blocks stay in {from}): {source}")]
    TierMoveFailed {
        /// Blocks asked for.
        blocks: usize,
        /// Source storage.
        from: String,
        /// Destination storage.
        to: String,
        /// Bytes copied before the failure.
        copied: u64,
        /// Bytes the move had to copy.
        bytes: u64,
        /// The failure.
        source: Box<Error>,
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
