//! The behavioural suite of the pool, generic over the backend: the host test target runs it on
//! real host memory, the GPU test target on CUDA VMM. Each function panics on the first broken
//! expectation with the numbers that broke it.

#![allow(dead_code)]

pub mod backing;
pub mod kv;
pub mod layout;
pub mod shared;
pub mod sleep;
pub mod soundness;
pub mod tiers;

/// Every test of the pool's suite, as `#[test]` functions over the backend `$make()` returns.
#[macro_export]
macro_rules! pool_suite {
    ($make:expr) => {
        $crate::suite_tests!(
            $make;
            data_survives_while_mapped,
            hot_path_makes_no_driver_calls,
            address_space_is_reused_and_coalesced,
            large_requests_use_few_chunks,
            trim_returns_physical_memory,
            range_api,
            mem_options,
            bad_input_is_refused_cleanly,
            failures_roll_back,
            driver_counts_match_chunks_held,
            peak_physical_covers_chunks_a_failed_release_keeps,
            pool_drop_reports_and_releases,
            region_takes_space_from_idle_memory,
            thread_fronts_follow_the_pools_state,
        );
    };
}

/// Every test of the shared pool's suite, as `#[test]` functions over `$make()`.
#[macro_export]
macro_rules! shared_suite {
    ($make:expr) => {
        $crate::suite_tests!(
            $make;
            mod shared;
            registration_and_handles,
            admission_refuses_with_numbers,
            idle_memory_does_not_hoard,
            live_limit_changes,
            unregister_credits_everything,
            hand_over_moves_chunks,
            refused_growth_takes_nothing,
            failed_limit_change_keeps_concurrent_cap,
            reclaim_callback_holding_its_handle_is_released,
            donors_race_askers_and_owners,
            global_limit_changes,
            global_limit_races_growth,
            handed_over_memory_shows_nothing_of_its_last_owner,
        );
    };
}

/// Every soundness test (lifetimes across threads, locks, books, rollback of rollbacks), as
/// `#[test]` functions over `$make()`.
#[macro_export]
macro_rules! soundness_suite {
    ($make:expr) => {
        $crate::suite_tests!(
            $make;
            mod soundness;
            allocations_outlive_their_pool,
            unregister_during_refusals_does_not_deadlock,
            charges_always_match_holdings,
            failed_unmap_restore_never_aliases,
            leaked_memory_stays_counted,
            huge_numbers_are_refused_cleanly,
        );
    };
}

/// Every test of the paged KV cache suite, as `#[test]` functions over `$make()`.
#[macro_export]
macro_rules! kv_suite {
    ($make:expr) => {
        $crate::suite_tests!(
            $make;
            mod kv;
            kv_alloc_maps_every_tensor,
            kv_unbacked_blocks_read_zeros,
            kv_read_only_refusal_leaves_nothing,
            kv_bad_input_changes_nothing,
            kv_limits_and_available,
            kv_warm_blocks_make_no_driver_calls,
            kv_ahead_takes_only_its_high_watermark,
            kv_no_startup_race,
            kv_memory_comes_back_after_a_spike,
            kv_sleep_discards_kv_keeps_weights,
            kv_reclaim_callback_frees_blocks,
            kv_races_alloc_free_trim_sleep,
            kv_compaction_moves_contents_byte_exact,
            kv_compaction_reaches_the_floor_after_a_spike,
            kv_free_of_a_block_still_being_allocated_is_refused,
            kv_compaction_bad_input_and_rollback,
            kv_compaction_spares_blocks_of_an_alloc_in_progress,
            kv_compaction_gives_back_after_the_call,
            kv_move_gives_the_source_back_after_the_wait,
            kv_compaction_races_alloc_free_trim_sleep,
            kv_blocks_move_to_a_host_tier_cache_and_back,
            kv_moves_in_batches_and_rolls_back_whole,
            kv_moves_race_compaction_free_and_sleep,
            kv_trim_holds_until_the_next_alloc,
            kv_trim_holds_against_a_refill_under_way,
            kv_move_after_between_host_caches_is_refused,
            kv_alloc_counts_blocks_in_transit,
            kv_trim_holds_against_frees,
            kv_limit_lowering_holds_against_a_refill_in_flight,
            kv_free_blocks_never_show_earlier_bytes,
            kv_null_block_is_reserved_backed_and_zero,
            kv_null_block_reads_zeros_while_neighbours_churn,
        );
    };
}

/// Every test of the regions and block backing suite, as `#[test]` functions over `$make()`.
#[macro_export]
macro_rules! backing_suite {
    ($make:expr) => {
        $crate::suite_tests!(
            $make;
            mod backing;
            region_is_set_apart,
            backing_shares_pages,
            backing_rolls_back,
            backing_respects_model_limits,
            backing_concurrent,
            backing_pages_hold_whole_chunks,
            backing_covers_whole_pages,
            backing_refuses_bad_input,
            backing_pins_hold_blocks,
            backing_pins_concurrent,
        );
    };
}

/// Every sleep and wake test, as `#[test]` functions over `$make()`.
#[macro_export]
macro_rules! sleep_suite {
    ($make:expr) => {
        $crate::suite_tests!(
            $make;
            mod sleep;
            offload_round_trip,
            mixed_tags,
            failures_roll_back,
            wake_goes_through_admission,
            concurrent_refusals,
            backing_hears_sleep,
            async_copies_are_waited_for,
            reserving_staging_does_not_block,
            trim_during_undone_wake,
            failed_sleep_rollback_keeps_lost_chunks_asleep,
            failed_wake_rollback_keeps_addresses_owned,
            kv_structures_are_discarded_by_tag,
        );
    };
}

/// Every test of the layout suite, as `#[test]` functions over `$make()`.
#[macro_export]
macro_rules! layout_suite {
    ($make:expr) => {
        $crate::suite_tests!(
            $make;
            mod layout;
            layout_views_place_data,
            layout_over_caller_regions,
            elastic_layout_backs_on_demand,
            elastic_layout_rolls_back,
            elastic_layout_covers_whole_pages,
        );
    };
}

/// Every test of the NIXL part of the layout suite (feature `nixl`), as `#[test]` functions
/// over `$make()` that run when `$ready()` says the NIXL library is there.
#[macro_export]
macro_rules! nixl_suite {
    ($make:expr, $ready:expr) => {
        $crate::nixl_suite!(
            @tests $make, $ready;
            registration_follows_chunks,
            registration_lifetime_every_path,
            write_then_read_byte_exact,
            unbacked_block_refused_before_nixl,
            transfer_pins_blocks_against_release,
            registration_whole_pages,
            bad_views_are_errors,
            sleep_renews_registrations,
            transfers_take_the_path_their_memory_allows,
        );
    };
    (@tests $make:expr, $ready:expr; $($name:ident),* $(,)?) => {
        $( #[test] fn $name() { if $ready() { $crate::suite::layout::nixl::$name($make()) } } )*
    };
}

/// `#[test] fn name() { suite::[module::]name($make()) }` for each name.
#[macro_export]
macro_rules! suite_tests {
    ($make:expr; mod $module:ident; $($name:ident),* $(,)?) => {
        $( #[test] fn $name() { $crate::suite::$module::$name($make()) } )*
    };
    ($make:expr; $($name:ident),* $(,)?) => {
        $( #[test] fn $name() { $crate::suite::$name($make()) } )*
    };
}

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Barrier};

use elastic_vmm::backend::testing::FaultInjector;
use elastic_vmm::{
    Backend, BlockBacking, DriverCall, Error, MemOptions, Pool, PoolConfig, Tag, UniformBlocks,
};

pub const MIB: u64 = 1 << 20;
pub const GIB: u64 = 1 << 30;

/// A small deterministic generator (xorshift64*), so failures replay.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }
    pub fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    pub fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

fn pool(backend: &Arc<dyn Backend>, config: PoolConfig) -> Pool {
    Pool::new(backend.clone(), config).expect("pool")
}

fn pattern(seed: u64, len: usize) -> Vec<u8> {
    let mut r = Rng::new(seed);
    (0..len).map(|_| r.next() as u8).collect()
}

/// Physical bytes the backend holds must equal what the pool says it holds.
fn assert_backend_matches(backend: &Arc<dyn Backend>, p: &Pool) {
    let s = p.stats();
    let held = backend.physical_bytes().expect("physical_bytes");
    assert_eq!(
        held,
        s.mapped + s.cached,
        "backend holds {held} bytes, pool says mapped {} + cached {}",
        s.mapped,
        s.cached
    );
    p.audit().expect("audit");
}

/// Data written through an allocation reads back, survives other allocations and frees, and
/// memory reused from the pool keeps its contents until overwritten.
pub fn data_survives_while_mapped(backend: Arc<dyn Backend>) {
    let p = pool(&backend, PoolConfig::new(GIB as usize));
    let sizes = [1usize, 511, 4096, 3 * MIB as usize + 17, 9 * MIB as usize];
    let mut live = Vec::new();
    for (i, &n) in sizes.iter().enumerate() {
        let mut a = p.allocate(n).expect("allocate");
        let data = pattern(i as u64, n);
        a.write(0, &data).expect("write");
        live.push((a, data));
    }
    // Churn around them.
    for k in 0..50 {
        let x = p.allocate(((k % 7) + 1) * 300_000).expect("churn");
        drop(x);
    }
    for (a, data) in &live {
        let mut back = vec![0u8; data.len()];
        a.read(0, &mut back).expect("read");
        assert!(
            back == *data,
            "allocation at {:#x} of {} bytes lost its data",
            a.addr(),
            a.size()
        );
    }
    // Reuse keeps contents (documented: reused memory is not zeroed); zeroed allocation zeroes.
    let (a, data) = live.pop().expect("one");
    let off = a.offset();
    let len = a.size();
    drop(a);
    let b = p.allocate(len).expect("reuse");
    assert_eq!(
        b.offset(),
        off,
        "an exact-size free range should be reused first"
    );
    let mut back = vec![0u8; 64];
    b.read(0, &mut back).expect("read");
    assert_eq!(
        &back[..],
        &data[..64],
        "reused memory keeps its previous contents"
    );
    drop(b);
    let z = p
        .allocate_with(len, &MemOptions::new().zeroed())
        .expect("zeroed");
    let mut back = vec![1u8; len];
    z.read(0, &mut back).expect("read");
    assert!(
        back.iter().all(|&x| x == 0),
        "a zeroed allocation returned non-zero bytes"
    );
    // Out-of-bounds access is an error, not a crash.
    let mut buf = [0u8; 8];
    assert!(matches!(
        z.read(len - 4, &mut buf),
        Err(Error::RangeOutOfBounds { .. })
    ));
    drop(z);
    drop(live);
    assert_backend_matches(&backend, &p);
}

/// After warm-up, allocate/free cycles make no driver call at all.
pub fn hot_path_makes_no_driver_calls(backend: Arc<dyn Backend>) {
    let p = pool(&backend, PoolConfig::new(GIB as usize));
    let sizes = [4096usize, 2 * MIB as usize, 5 * MIB as usize + 3];
    for &n in &sizes {
        drop(p.allocate(n).expect("warm up"));
    }
    let before = p.stats().driver_calls;
    for i in 0..10_000 {
        let a = p.allocate(sizes[i % sizes.len()]).expect("hot");
        drop(a);
    }
    let calls = p.stats().driver_calls.since(&before);
    assert_eq!(
        calls.total(),
        0,
        "hot allocate/free made driver calls: {calls}"
    );
    let s = p.stats();
    assert_eq!(s.allocations, 10_003);
    assert_eq!(s.frees, 10_003);
    assert_eq!(s.in_use, 0);
}

/// Freed address ranges are coalesced and reused: endless cycles never run out of address space,
/// and after many small allocations are freed one allocation of the whole capacity fits.
pub fn address_space_is_reused_and_coalesced(backend: Arc<dyn Backend>) {
    let g = backend.info().granularity as u64;
    let cap = 32 * g;
    let p = pool(&backend, PoolConfig::new(cap as usize));
    let mut rng = Rng::new(7);
    let mut live: Vec<elastic_vmm::Allocation> = Vec::new();
    for _ in 0..20_000 {
        if live.len() > 8 || (rng.below(2) == 0 && !live.is_empty()) {
            let i = rng.below(live.len() as u64) as usize;
            live.swap_remove(i);
        } else {
            let n = 1 + rng.below(3 * g) as usize;
            match p.allocate(n) {
                Ok(a) => live.push(a),
                Err(Error::OutOfAddressSpace { .. }) => {
                    // Fragmentation can refuse one request; freeing everything must cure it.
                    live.clear();
                    live.push(p.allocate(n).expect("after freeing everything"));
                }
                Err(e) => panic!("unexpected error: {e}"),
            }
        }
    }
    drop(live);
    // Fill the pool with small allocations until it refuses (old free ranges were carved at
    // 512-byte granularity, so a few odd-sized gaps may stay unused), then free them all.
    let mut small = Vec::new();
    loop {
        match p.allocate(64 << 10) {
            Ok(a) => small.push(a),
            Err(Error::OutOfAddressSpace { requested, .. }) => {
                assert_eq!(requested, 64 << 10);
                break;
            }
            Err(e) => panic!("unexpected error: {e}"),
        }
    }
    let filled = small.len() as u64 * (64 << 10);
    assert!(
        filled >= cap - cap / 16,
        "only {filled} of {cap} bytes could be allocated"
    );
    drop(small);
    let whole = p
        .allocate(cap as usize)
        .expect("whole capacity after coalescing");
    assert_eq!(whole.offset(), 0);
    drop(whole);
    p.audit().expect("audit");
}

/// Large requests are backed by few, large chunks: one chunk per `max_chunk`.
pub fn large_requests_use_few_chunks(backend: Arc<dyn Backend>) {
    let p = pool(
        &backend,
        PoolConfig::new(8 * GIB as usize).max_chunk(256 * MIB as usize),
    );
    let before = p.stats().driver_calls;
    let a = p.allocate(GIB as usize).expect("1 GiB");
    let calls = p.stats().driver_calls.since(&before);
    assert_eq!(
        calls.get(DriverCall::Create),
        4,
        "1 GiB in 256 MiB chunks: {calls}"
    );
    assert_eq!(
        calls.get(DriverCall::SetAccess),
        1,
        "one access grant per growth: {calls}"
    );
    drop(a);
    p.trim().expect("trim");
    assert_backend_matches(&backend, &p);
    // Growth in small steps maps ahead: far fewer driver growths than steps.
    let before = p.stats().driver_calls;
    let steps: Vec<_> = (0..512)
        .map(|_| p.allocate(2 * MIB as usize).expect("step"))
        .collect();
    let calls = p.stats().driver_calls.since(&before);
    assert!(
        calls.get(DriverCall::SetAccess) < 64,
        "512 steps of 2 MiB should need far fewer than 64 growths: {calls}"
    );
    let s = p.stats();
    assert!(
        s.mapped >= GIB && s.mapped <= GIB + GIB / 4,
        "look-ahead bounded: mapped {}",
        s.mapped
    );
    drop(steps);
    p.trim().expect("trim");
    assert_backend_matches(&backend, &p);
}

/// Trim gives idle and cached memory back to the driver; stats keep in use, cached and mapped apart.
pub fn trim_returns_physical_memory(backend: Arc<dyn Backend>) {
    let g = backend.info().granularity as u64;
    let p = pool(&backend, PoolConfig::new(GIB as usize).growth_divisor(0));
    let a = p.allocate(3 * g as usize).expect("a");
    let b = p.allocate(g as usize / 2).expect("b");
    let s = p.stats();
    assert_eq!(s.in_use, 3 * g + g / 2);
    assert_eq!(s.mapped, 4 * g, "exact growth maps whole granules");
    drop(a);
    let s = p.stats();
    assert_eq!(
        (s.in_use, s.mapped, s.cached),
        (g / 2, 4 * g, 0),
        "freed memory stays mapped (idle)"
    );
    p.map(512 * MIB, 2 * g).expect("range");
    p.unmap(512 * MIB, 2 * g).expect("unrange");
    let s = p.stats();
    assert_eq!(s.cached, 2 * g, "unmapped range chunks are cached");
    assert_eq!(s.physical(), 6 * g);
    assert_backend_matches(&backend, &p);
    let r = p.trim().expect("trim");
    assert_eq!(
        r.unmapped,
        3 * g,
        "the idle 3-granule chunk is unmapped; b's stays"
    );
    assert_eq!(r.released, 5 * g);
    let s = p.stats();
    assert_eq!((s.in_use, s.mapped, s.cached), (g / 2, g, 0));
    assert_backend_matches(&backend, &p);
    drop(b);
    p.trim().expect("trim");
    assert_eq!(p.stats().physical(), 0);
    assert_backend_matches(&backend, &p);
}

/// [`MemOptions`]: an option a call does not take is refused by name, a bad chunk with its
/// numbers, both before anything is mapped; `zeroed` zeroes a range mapped from reused chunks;
/// `chunk` on a region is its mapping chunk; tag and name reach the allocation.
pub fn mem_options(backend: Arc<dyn Backend>) {
    let g = backend.info().granularity as u64;
    let p = pool(&backend, PoolConfig::new((64 * g) as usize));
    let refused = |r: Result<(), Error>, option: &str| match r {
        Err(Error::OptionNotApplicable { option: o, call }) => {
            assert_eq!(o, option, "refused by the wrong option, by {call}");
        }
        other => panic!("`{option}` should be refused, got {other:?}"),
    };
    let opt = MemOptions::new();
    refused(
        p.allocate_with(g as usize, &opt.clone().chunk(g)).map(drop),
        "chunk",
    );
    refused(p.map_with(0, g, &opt.clone().name("x")), "name");
    refused(
        p.reserve_region_with(g, &opt.clone().name("r")).map(drop),
        "name",
    );
    let geo = UniformBlocks::packed(2, g);
    refused(
        BlockBacking::reserve(&p, geo, &opt.clone().name("b"), None).map(drop),
        "name",
    );
    for chunk in [0, g / 2, 3 * g / 2] {
        match p.map_with(0, 4 * g, &opt.clone().chunk(chunk)) {
            Err(
                e @ Error::Misaligned {
                    value, alignment, ..
                },
            ) => {
                assert_eq!((value, alignment), (chunk, g));
                assert!(e.to_string().contains("chunk"), "{e}");
            }
            other => panic!("chunk {chunk} accepted: {other:?}"),
        }
        assert!(matches!(
            p.reserve_region_with(4 * g, &opt.clone().chunk(chunk)),
            Err(Error::Misaligned { .. })
        ));
    }
    let s = p.stats();
    assert_eq!(
        (s.mapped, s.range_mapped, s.reserved_regions),
        (0, 0, 0),
        "{s:?}"
    );
    assert_eq!(s.driver_calls.get(DriverCall::Create), 0, "nothing created");

    // A reused chunk keeps its bytes; `zeroed` clears them.
    let data = pattern(7, g as usize);
    p.map(0, g).expect("map");
    // SAFETY: mapped just above; nothing else uses it.
    unsafe { backend.copies().write(p.base(), &data).expect("write") };
    p.unmap(0, g).expect("to the cache");
    let before = p.stats().driver_calls;
    p.map(0, g).expect("map again");
    let mut back = vec![0u8; data.len()];
    // SAFETY: mapped just above.
    unsafe { backend.copies().read(p.base(), &mut back).expect("read") };
    assert!(
        back == data,
        "a plain map of a reused chunk keeps its bytes"
    );
    p.unmap(0, g).expect("to the cache");
    p.map_with(0, g, &opt.clone().zeroed().tag(Tag::Kv))
        .expect("zeroed map");
    let calls = p.stats().driver_calls.since(&before);
    assert_eq!(
        calls.get(DriverCall::Create),
        0,
        "served from the cache: {calls}"
    );
    // SAFETY: mapped just above.
    unsafe { backend.copies().read(p.base(), &mut back).expect("read") };
    assert!(back.iter().all(|&b| b == 0), "map_with(zeroed) left bytes");
    p.unmap(0, g).expect("unmap");

    // A region's chunk is what its maps use (the cache emptied: it would serve granules).
    p.trim().expect("trim");
    let r = p
        .reserve_region_with(8 * g, &opt.clone().chunk(2 * g).tag(Tag::Kv))
        .expect("region");
    assert_eq!((r.chunk(), r.tag()), (2 * g, &Tag::Kv));
    r.map(0, 4 * g).expect("region map");
    assert_eq!(r.chunks_in(0, 4 * g).len(), 2, "chunks of 2 granules");
    assert!(matches!(r.unmap(0, g), Err(Error::SplitsChunk { .. })));
    drop(r);
    assert_eq!(p.reserve_region(g).expect("default").chunk(), g);

    let a = p
        .allocate_with(100, &opt.clone().tag(Tag::Weights).name("w").zeroed())
        .expect("allocate");
    assert_eq!((a.tag(), a.name().as_deref()), (Tag::Weights, Some("w")));
    // `zeroed` on a region is the zero page under its unmapped parts (tests/suite/kv.rs).
    let mapped = p.stats().mapped;
    let z = p.reserve_region_with(g, &opt.clone().zeroed()).unwrap();
    assert_eq!((p.stats().zero_aliased, p.stats().mapped), (g, mapped));
    drop(z);
    assert_eq!(p.stats().zero_aliased, 0);
}

/// The range API: map, unmap, reuse of cached chunks, and every misuse with its numbers.
pub fn range_api(backend: Arc<dyn Backend>) {
    let g = backend.info().granularity as u64;
    let p = pool(
        &backend,
        PoolConfig::new((64 * g) as usize).max_cached(4 * g),
    );
    p.map(4 * g, 4 * g).expect("map");
    assert!(p.is_mapped(4 * g, 4 * g));
    assert!(!p.is_mapped(3 * g, 2 * g));
    assert_eq!(
        p.chunks_in(4 * g, 4 * g).len(),
        4,
        "one chunk per granule by default"
    );
    match p.map(6 * g, 4 * g) {
        Err(Error::RangeAlreadyMapped {
            offset,
            len,
            mapped_offset,
            mapped_len,
        }) => {
            assert_eq!(
                (offset, len, mapped_offset, mapped_len),
                (6 * g, 4 * g, 6 * g, 2 * g)
            );
        }
        other => panic!("expected RangeAlreadyMapped, got {other:?}"),
    }
    match p.unmap(2 * g, 4 * g) {
        Err(Error::RangeNotMapped {
            hole_offset,
            hole_len,
            ..
        }) => {
            assert_eq!((hole_offset, hole_len), (2 * g, 2 * g));
        }
        other => panic!("expected RangeNotMapped, got {other:?}"),
    }
    assert!(matches!(p.map(g / 2, g), Err(Error::Misaligned { .. })));
    assert!(matches!(p.map(0, 0), Err(Error::ZeroSize { .. })));
    assert!(matches!(
        p.map(63 * g, 2 * g),
        Err(Error::RangeOutOfBounds { .. })
    ));
    assert!(matches!(
        p.map(u64::MAX - g + 1, g),
        Err(Error::RangeOutOfBounds { .. })
    ));
    // Data in a mapped range.
    let addr = p.base() + 5 * g;
    let data = pattern(3, 4096);
    // SAFETY: [addr, addr + 4096) lies in the range mapped above, which nothing else uses.
    unsafe { backend.copies().write(addr, &data).expect("write") };
    // Partial unmap of per-granule chunks is fine and keeps the rest.
    p.unmap(4 * g, g).expect("unmap one granule");
    let mut back = vec![0u8; 4096];
    // SAFETY: still mapped.
    unsafe { backend.copies().read(addr, &mut back).expect("read") };
    assert_eq!(back, data);
    // Unmapped chunks are cached and reused: no create for the next map.
    let before = p.stats().driver_calls;
    p.map(20 * g, g).expect("remap from cache");
    let calls = p.stats().driver_calls.since(&before);
    assert_eq!(
        calls.get(DriverCall::Create),
        0,
        "map must reuse the cached chunk: {calls}"
    );
    // Big chunks: unmap must cover whole chunks.
    p.map_with(32 * g, 8 * g, &MemOptions::new().chunk(4 * g))
        .expect("chunked");
    assert_eq!(p.chunks_in(32 * g, 8 * g).len(), 2);
    match p.unmap(32 * g, 2 * g) {
        Err(Error::SplitsChunk {
            chunk_offset,
            chunk_len,
            ..
        }) => {
            assert_eq!((chunk_offset, chunk_len), (32 * g, 4 * g));
        }
        other => panic!("expected SplitsChunk, got {other:?}"),
    }
    assert!(
        p.is_mapped(32 * g, 8 * g),
        "a refused unmap changes nothing"
    );
    p.unmap(32 * g, 8 * g).expect("whole chunks");
    // The cache is capped at 4 granules: the rest was released.
    assert!(p.stats().cached <= 4 * g, "cache cap: {}", p.stats().cached);
    // The allocator and the range API do not step on each other.
    let a = p.allocate(g as usize).expect("alloc");
    let ao = a.offset();
    match p.map(ao, g) {
        Err(Error::RangeInUse { .. }) => {}
        other => panic!("expected RangeInUse, got {other:?}"),
    }
    drop(a);
    p.unmap(5 * g, 3 * g).expect("rest");
    p.unmap(20 * g, g).expect("rest");
    assert_eq!(p.stats().range_mapped, 0);
    assert_backend_matches(&backend, &p);
}

/// Bad input gets a clear error with the numbers in it and changes nothing.
pub fn bad_input_is_refused_cleanly(backend: Arc<dyn Backend>) {
    let g = backend.info().granularity as u64;
    let p = pool(
        &backend,
        PoolConfig::new((16 * g) as usize)
            .physical_limit(4 * g)
            .growth_divisor(0),
    );
    assert!(matches!(p.allocate(0), Err(Error::ZeroSize { .. })));
    assert!(matches!(
        p.allocate(usize::MAX),
        Err(Error::SizeOverflow { .. })
    ));
    match p.allocate((17 * g) as usize) {
        Err(Error::OutOfAddressSpace {
            requested,
            capacity,
            ..
        }) => {
            assert_eq!((requested, capacity), (17 * g, 16 * g));
        }
        other => panic!("expected OutOfAddressSpace, got {other:?}"),
    }
    let a = p.allocate((3 * g) as usize).expect("within limit");
    match p.allocate((2 * g) as usize) {
        Err(
            e @ Error::OutOfPhysicalMemory {
                requested,
                available,
                ..
            },
        ) => {
            assert_eq!((requested, available), (2 * g, g));
            assert!(
                e.to_string().contains(&format!("{}", 4 * g)),
                "message names the limit: {e}"
            );
        }
        other => panic!("expected OutOfPhysicalMemory, got {other:?}"),
    }
    assert!(matches!(
        p.map(8 * g, 2 * g),
        Err(Error::OutOfPhysicalMemory { .. })
    ));
    assert_eq!(p.stats().in_use, 3 * g, "refusals change nothing");
    assert_backend_matches(&backend, &p);
    drop(a);
    p.allocate((2 * g) as usize)
        .expect("idle memory is reused under the limit");
    // Invalid configurations.
    assert!(matches!(
        Pool::new(backend.clone(), PoolConfig::new(0)),
        Err(Error::ZeroSize { .. })
    ));
    assert!(matches!(
        Pool::new(
            backend.clone(),
            PoolConfig::new(GIB as usize).max_chunk(g as usize + 1)
        ),
        Err(Error::Misaligned { .. })
    ));
    assert!(matches!(
        Pool::new(backend.clone(), PoolConfig::new(GIB as usize).alignment(3)),
        Err(Error::InvalidArgument(_))
    ));
}

/// The physical peak is never below what the pool holds (issue 33, defect 10): a growth whose
/// last create fails gives its created chunks back, and a chunk whose release fails stays
/// cached, so the pool holds it: the peak must count it. Chunks of 8 granules, a growth of 20
/// (two chunks of 8 and one of 4), the third create and the first release failing. Today the
/// chunk goes to the cache without the peak noted: physical 8 granules, peak 0.
pub fn peak_physical_covers_chunks_a_failed_release_keeps(backend: Arc<dyn Backend>) {
    let g = backend.info().granularity;
    let faults = Arc::new(FaultInjector::new(backend.clone()));
    let fb: Arc<dyn Backend> = faults.clone();
    let p = pool(
        &fb,
        PoolConfig::new(1 << 30).max_chunk(8 * g).growth_divisor(0),
    );
    faults.fail_nth(DriverCall::Create, 3);
    faults.fail_nth(DriverCall::Release, 1);
    let e = p.allocate(20 * g).expect_err("the third create fails");
    faults.clear();
    let s = p.stats();
    assert!(
        s.physical() > 0,
        "the chunk whose release failed is kept: {s:?} ({e})"
    );
    assert!(
        s.peak_physical >= s.physical(),
        "physical {} bytes, peak {} after a failed release ({e})",
        s.physical(),
        s.peak_physical
    );
    p.trim().expect("trim");
    assert_eq!(p.stats().physical(), 0);
}

/// The pool's driver-call counts follow the chunks it holds whatever fails (issue 22, defect
/// 12): creates minus releases is the chunks mapped and cached, after a batch create that
/// fails at its k-th chunk and after a release that fails.
pub fn driver_counts_match_chunks_held(backend: Arc<dyn Backend>) {
    let g = backend.info().granularity;
    let faults = Arc::new(FaultInjector::new(backend.clone()));
    let fb: Arc<dyn Backend> = faults.clone();
    let p = pool(&fb, PoolConfig::new(1 << 30).max_chunk(g));
    let held = |what: &str| {
        let s = p.stats();
        let (made, gone) = (
            s.driver_calls.get(DriverCall::Create),
            s.driver_calls.get(DriverCall::Release),
        );
        assert_eq!(
            made.checked_sub(gone),
            Some(s.mapped_chunks + s.cached_chunks),
            "{what}: {made} creates, {gone} releases, but {} chunks mapped and {} cached",
            s.mapped_chunks,
            s.cached_chunks
        );
    };
    let keep = p.allocate(g).expect("allocate");
    held("one chunk");
    // One growth of 8 chunks of one granule: one batch of 8.
    for k in [1, 3, 8] {
        faults.fail_nth(DriverCall::Create, k);
        let e = p.allocate(8 * g).expect_err("the batch fails");
        faults.clear();
        held(&format!("a batch of 8 failing at chunk {k} ({e})"));
    }
    let more = p.allocate(8 * g).expect("allocate");
    held("a batch of 8");
    drop(more);
    drop(keep);
    faults.fail_nth(DriverCall::Release, 2);
    p.trim().expect_err("the second release fails");
    faults.clear();
    held("a failed release");
    assert!(p.stats().cached_chunks > 0, "the chunk stays cached");
    p.trim().expect("trim");
    held("trimmed");
    assert_eq!(p.stats().mapped_chunks + p.stats().cached_chunks, 0);
    p.audit().expect("audit");
    assert_backend_matches(&backend, &p);
}

/// A driver failure half way through a multi-chunk operation rolls back: nothing stays mapped,
/// no physical memory leaks, the pool stays usable.
pub fn failures_roll_back(backend: Arc<dyn Backend>) {
    let g = backend.info().granularity;
    let faulty = Arc::new(FaultInjector::new(backend.clone()));
    let as_backend: Arc<dyn Backend> = faulty.clone();
    let p = pool(
        &as_backend,
        PoolConfig::new(64 * g).max_chunk(g).growth_divisor(0),
    );
    let keep = p.allocate(g).expect("baseline");
    let base_stats = p.stats();
    let base_held = backend.physical_bytes().expect("held");
    let check_unchanged = |what: &str| {
        let s = p.stats();
        assert_eq!(
            (s.in_use, s.mapped, s.cached, s.live_allocations),
            (
                base_stats.in_use,
                base_stats.mapped,
                base_stats.cached,
                base_stats.live_allocations
            ),
            "{what}: stats changed"
        );
        assert_eq!(
            backend.physical_bytes().expect("held"),
            base_held,
            "{what}: physical memory leaked"
        );
        p.audit().expect(what);
    };
    let cases = [
        (DriverCall::Create, 3, "third create of five"),
        (DriverCall::Map, 4, "fourth map of five"),
        (DriverCall::SetAccess, 1, "access grant"),
    ];
    for (call, n, what) in cases {
        faulty.fail_nth(call, n);
        match p.allocate(5 * g) {
            Err(Error::Backend { code, call: c, .. }) => {
                assert_eq!(code, "FAULT_INJECTED", "{what}");
                assert_eq!(c, call.name());
            }
            other => panic!("{what}: expected an injected failure, got {other:?}"),
        }
        check_unchanged(what);
        faulty.fail_nth(call, n);
        assert!(
            p.map(16 * g as u64, 5 * g as u64).is_err(),
            "{what}: range map must fail"
        );
        assert!(!p.is_mapped(16 * g as u64, g as u64));
        check_unchanged(what);
    }
    // Failures while giving memory back lose nothing either.
    p.map(16 * g as u64, 3 * g as u64).expect("map");
    faulty.fail_nth(DriverCall::Unmap, 2);
    assert!(p.unmap(16 * g as u64, 3 * g as u64).is_err());
    assert!(
        p.is_mapped(16 * g as u64, 3 * g as u64),
        "failed unmap is rolled back"
    );
    p.audit().expect("audit after failed unmap");
    p.unmap(16 * g as u64, 3 * g as u64).expect("unmap");
    faulty.fail_nth(DriverCall::Release, 1);
    assert!(p.trim().is_err());
    assert!(
        p.stats().cached >= g as u64,
        "a chunk whose release failed stays cached"
    );
    assert_eq!(
        backend.physical_bytes().expect("held"),
        p.stats().physical()
    );
    p.trim().expect("trim");
    // Everything still works.
    let a = p.allocate(5 * g).expect("after failures");
    drop(a);
    drop(keep);
    p.trim().expect("trim");
    assert_eq!(backend.physical_bytes().expect("held"), 0);
}

/// Dropping the pool gives back everything not held by a live allocation; the allocation stays
/// valid and its memory goes back when it is dropped.
pub fn pool_drop_reports_and_releases(backend: Arc<dyn Backend>) {
    let g = backend.info().granularity as u64;
    let p = pool(&backend, PoolConfig::new(GIB as usize).name("leaky"));
    let mut survivor = p
        .allocate_with(g as usize, &MemOptions::new().name("kv-cache"))
        .expect("a");
    let other = p.allocate(3 * g as usize).expect("b");
    drop(other);
    p.map(512 * MIB, 2 * g).expect("range");
    assert_eq!(p.live_allocations().len(), 1);
    assert_eq!(p.live_allocations()[0].name.as_deref(), Some("kv-cache"));
    assert_eq!(survivor.name().as_deref(), Some("kv-cache"));
    drop(p);
    let held = backend.physical_bytes().expect("held");
    assert!(
        held <= 2 * g,
        "only the survivor's chunk may stay: {held} bytes held"
    );
    survivor
        .write(0, b"still mapped")
        .expect("write after pool drop");
    let mut back = [0u8; 12];
    survivor.read(0, &mut back).expect("read");
    assert_eq!(&back, b"still mapped");
    drop(survivor);
    assert_eq!(
        backend.physical_bytes().expect("held"),
        0,
        "everything is back"
    );
}

/// 8 threads allocate and free at random; the invariants hold throughout and exactly at every
/// phase barrier: stats == sum of live allocations, backend holds what the pool says, no two live
/// allocations overlap (every allocation carries a tag checked before it is freed).
pub fn concurrent_invariants(backend: Arc<dyn Backend>, phases: usize, ops_per_phase: usize) {
    const THREADS: usize = 8;
    let g = backend.info().granularity as u64;
    let p = pool(
        &backend,
        PoolConfig::new((4 * GIB) as usize).max_chunk((16 * g) as usize),
    );
    let barrier = Arc::new(Barrier::new(THREADS + 1));
    let live_bytes: Arc<Vec<AtomicU64>> =
        Arc::new((0..THREADS).map(|_| AtomicU64::new(0)).collect());
    let live_count: Arc<Vec<AtomicU64>> =
        Arc::new((0..THREADS).map(|_| AtomicU64::new(0)).collect());
    let stop = Arc::new(AtomicBool::new(false));
    std::thread::scope(|scope| {
        for t in 0..THREADS {
            let (p, barrier, live_bytes, live_count) = (
                p.clone(),
                barrier.clone(),
                live_bytes.clone(),
                live_count.clone(),
            );
            scope.spawn(move || {
                let mut rng = Rng::new(1000 + t as u64);
                let mut mine: Vec<(elastic_vmm::Allocation, u64)> = Vec::new();
                for _ in 0..phases {
                    for _ in 0..ops_per_phase {
                        if !mine.is_empty() && (mine.len() > 24 || rng.below(2) == 0) {
                            let i = rng.below(mine.len() as u64) as usize;
                            let (a, tag) = mine.swap_remove(i);
                            let mut head = [0u8; 8];
                            a.read(0, &mut head).expect("read tag");
                            assert_eq!(
                                u64::from_le_bytes(head),
                                tag,
                                "allocation at {:#x} was overwritten: overlap",
                                a.addr()
                            );
                            live_bytes[t].fetch_sub(a.footprint(), Ordering::SeqCst);
                            live_count[t].fetch_sub(1, Ordering::SeqCst);
                            drop(a);
                        } else {
                            let span = if rng.below(4) == 0 { 6 * g } else { 64 << 10 };
                            let n = 8 + rng.below(span) as usize;
                            let mut a = p.allocate(n).expect("allocate under concurrency");
                            let tag = rng.next();
                            a.write(0, &tag.to_le_bytes()).expect("write tag");
                            live_bytes[t].fetch_add(a.footprint(), Ordering::SeqCst);
                            live_count[t].fetch_add(1, Ordering::SeqCst);
                            mine.push((a, tag));
                        }
                    }
                    barrier.wait(); // phase done: the checker looks
                    barrier.wait(); // checker done
                }
                for (a, tag) in mine.drain(..) {
                    let mut head = [0u8; 8];
                    a.read(0, &mut head).expect("read tag");
                    assert_eq!(u64::from_le_bytes(head), tag);
                    live_bytes[t].fetch_sub(a.footprint(), Ordering::SeqCst);
                    live_count[t].fetch_sub(1, Ordering::SeqCst);
                }
            });
        }
        // A watcher checks what must hold at every instant.
        let (pw, stopw) = (p.clone(), stop.clone());
        let watcher = scope.spawn(move || {
            let mut checks = 0u64;
            while !stopw.load(Ordering::SeqCst) {
                let s = pw.stats();
                assert!(
                    s.in_use <= s.mapped,
                    "in use {} > mapped {}",
                    s.in_use,
                    s.mapped
                );
                assert!(
                    s.mapped + s.cached <= s.capacity,
                    "physical beyond capacity"
                );
                assert!(s.peak_in_use >= s.in_use);
                checks += 1;
                std::thread::yield_now();
            }
            checks
        });
        for phase in 0..phases {
            barrier.wait();
            let s = p.stats();
            let want: u64 = live_bytes.iter().map(|x| x.load(Ordering::SeqCst)).sum();
            let count: u64 = live_count.iter().map(|x| x.load(Ordering::SeqCst)).sum();
            assert_eq!(
                s.in_use, want,
                "phase {phase}: stats in use vs sum of live allocations"
            );
            assert_eq!(
                s.live_allocations, count,
                "phase {phase}: live allocation count"
            );
            assert_backend_matches(&backend, &p);
            if phase % 3 == 2 {
                p.trim().expect("trim between phases");
                assert_backend_matches(&backend, &p);
            }
            barrier.wait();
        }
        stop.store(true, Ordering::SeqCst);
        let checks = watcher.join().expect("watcher");
        assert!(checks > 0);
    });
    let s = p.stats();
    assert_eq!((s.in_use, s.live_allocations), (0, 0));
    assert_eq!(s.allocations, s.frees);
    p.trim().expect("trim");
    assert_eq!(p.stats().physical(), 0);
    assert_backend_matches(&backend, &p);
}

/// A pool whose whole address space was grown into and then freed (idle, mapped) still gives a
/// region: the idle memory is unmapped to make room (seen on the H100: candle tensors dying
/// faster than the GPU passes their fences filled a pool's reservation).
pub fn region_takes_space_from_idle_memory(backend: Arc<dyn Backend>) {
    let g = backend.info().granularity;
    let p = pool(&backend, PoolConfig::new(16 * g).growth_divisor(1_000_000));
    let all: Vec<_> = (0..16).map(|_| p.allocate(g).expect("allocate")).collect();
    drop(all);
    assert_eq!(p.stats().idle(), 16 * g as u64, "{}", p.stats());
    let r = p
        .reserve_region(4 * g as u64)
        .expect("region out of idle memory");
    assert_eq!(r.len(), 4 * g as u64);
    r.map(0, g as u64).expect("map in the region");
    p.audit().expect("books");
    drop(r);
    p.trim().expect("trim");
    assert_eq!(p.stats().physical(), 0);
    assert_backend_matches(&backend, &p);
}

/// A thread keeps the block it freed last for its next allocation of that size and tag (no
/// pool lock): the block stays the pool's, governed by its state. Stats never count it in use;
/// a sleep, a growth that needs the memory, the thread's end and the pool's close each take
/// it back; nothing is served from it while the pool sleeps.
pub fn thread_fronts_follow_the_pools_state(backend: Arc<dyn Backend>) {
    use elastic_vmm::{AfterWake, SleepPolicy};
    let g = backend.info().granularity as u64;
    let p = pool(
        &backend,
        PoolConfig::new(GIB as usize).physical_limit(4 * g),
    );
    let a = p.allocate((2 * g) as usize).expect("first");
    let addr = a.addr();
    drop(a);
    let b = p.allocate((2 * g) as usize).expect("again");
    assert_eq!(b.addr(), addr, "the thread's freed block comes back");
    drop(b);
    // Held back in the front, the block is still mapped: another tag is not served from the
    // front but from the pool, which takes the kept block back first rather than grow, and
    // records it with the new tag.
    let physical = backend.physical_bytes().expect("held");
    let named = p
        .allocate_with((2 * g) as usize, &MemOptions::new().tag(Tag::Weights))
        .expect("another tag");
    assert_eq!(named.tag(), Tag::Weights);
    assert_eq!(named.addr(), addr, "the kept block, given back, serves it");
    assert_eq!(
        backend.physical_bytes().expect("held"),
        physical,
        "no growth"
    );
    drop(named);
    let s = p.stats();
    assert_eq!((s.in_use, s.live_allocations), (0, 0), "{s:?}");
    assert_eq!(
        (s.allocations, s.frees),
        (3, 3),
        "every pair counted: {s:?}"
    );

    // The physical limit holds 4 granules: a kept 2-granule block is given back for a
    // 3-granule growth instead of refusing it.
    let a = p.allocate((2 * g) as usize).expect("kept again");
    drop(a);
    p.trim().expect("trim");
    let a = p.allocate((2 * g) as usize).expect("kept again");
    drop(a);
    let big = p
        .allocate((3 * g) as usize)
        .expect("the kept block is idle memory for a growth");
    drop(big);

    // The range API's growth too: 4 granules mapped at once need the kept block's room.
    let a = p.allocate((2 * g) as usize).expect("kept before a range");
    drop(a);
    p.map(GIB / 2, 4 * g)
        .expect("the kept block is given back for a range mapping");
    p.unmap(GIB / 2, 4 * g).expect("unmap");
    p.trim().expect("trim");

    // Asleep: the kept block went back with the sleep; nothing is served from it.
    let a = p.allocate((2 * g) as usize).expect("kept before the sleep");
    drop(a);
    let r = p.sleep(&SleepPolicy::offload_all()).expect("sleep");
    assert_eq!(r.offloaded, 0, "a kept block is not live data: {r:?}");
    assert_eq!(p.stats().mapped, 0);
    match p.allocate((2 * g) as usize) {
        Err(Error::Asleep { .. }) => {}
        other => panic!("served while asleep: {other:?}"),
    }
    p.wake(AfterWake::FreeHostMemory).expect("wake");
    let a = p.allocate((2 * g) as usize).expect("after the wake");
    drop(a);

    // A thread that ends gives its kept block back: a trim then finds the memory idle.
    let q = p.clone();
    std::thread::spawn(move || drop(q.allocate((2 * g) as usize).expect("on a thread")))
        .join()
        .expect("thread");
    p.trim().expect("trim");
    let s = p.stats();
    assert_eq!((s.in_use, s.mapped), (0, 0), "{s:?}");
    p.audit().expect("books");

    // Closing with a block kept: it is given back with everything else.
    drop(p.allocate(g as usize).expect("kept at the close"));
    drop(p);
    assert_eq!(backend.physical_bytes().expect("held"), 0);
}
