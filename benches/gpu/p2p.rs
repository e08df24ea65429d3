//! KV blocks from a prefill process to a decode process on one node (`gpu-bench p2p`): the
//! prefill process backs and writes N blocks and grants them; the decode process (this binary
//! again, `EVMM_BENCH_ROLE=p2p-decode`) imports the chunks and copies the blocks into its own
//! layout. Against a raw device copy of the same imported memory between the same two
//! processes (one `cuMemcpyDtoDAsync` of the whole mapping: the floor; target >= 0.9x), and
//! against what an engine would do by hand (one `cuMemcpyDtoDAsync` per run merged on both
//! sides, on the same stream; only up to 5000 runs), on one GPU and, when there are two, from
//! GPU 0 to GPU 1 (peer access on the imports). Block sizes 64 KiB to 16 MiB; layouts fully
//! contiguous and layer separate (32 layers, block first: 32 spans per block), both also with
//! scattered destinations, where no run merges. Each line names the engine our copy chose
//! (`memcpy`: one `cuMemcpyAsync` per merged run; `kernel`: one launch of the gather kernel,
//! `tasks` warp work items) and the host time of our call until its copies were queued
//! (`host us`); `EVMM_P2P_ENGINE=kernel` or `memcpy` forces one engine for comparison. Before
//! the copies: `wait ms` from asking for the grant to holding it mapped (the prefill's set-up
//! of the case included), `chunks` mapped, `kept` of them found imported already (the decode
//! keeps the chunks of earlier grants, and the prefill's layouts reuse its pool's cached chunks
//! from case to case: the first case imports everything), and `import ms` for importing,
//! mapping and setting access to them alone; `EVMM_P2P_PAGE=<bytes>` maps both layouts in
//! larger pages (fewer chunks to import).
//!
//! With the `nixl` feature (and the NIXL library on `LD_LIBRARY_PATH`; without it the columns
//! are skipped, saying why), NIXL moves the same blocks between the same two processes for the
//! fully contiguous layout at every block size (`p2p_nixl.rs`; exchange in `nixl_peer.rs`): one
//! agent per process (UCX backend), the decode's metadata and descriptors sent to the prefill
//! over a Unix socket of their own; the prefill WRITEs into the decode's memory (the push
//! direction of prefill -> decode) and sends its timings back over it. A WRITE, not a READ by
//! the decode: on one GPU UCX 1.23 logs "cuda-ipc get zcopy disabled as no nvlinks detected",
//! so a READ of plain memory falls back to software emulation over tcp/lo (~0.5 GB/s); a WRITE
//! goes through `cuda_ipc`.
//! *NIXL plain*: `cuMemAlloc` buffers of the same N blocks on both sides (UCX `cuda_ipc`);
//! *NIXL VMM*: the prefill's elastic layout registered with NIXL into the decode's, one run
//! over the first 64 MiB (UCX 1.23 emulates VMM memory between processes over TCP, ~0.5 GB/s).
//! Every NIXL byte is checked on the decode side; the table prints GB/s and ours / NIXL.

use std::os::unix::net::UnixListener;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use elastic_vmm::backend::cuda::CudaBackend;
use elastic_vmm::layout::{BlockDim, ElasticLayout, LayoutBuilder, LayoutConfig, LayoutKind};
use elastic_vmm::p2p::{self, CopyStream, EngineChoice, ImportedGrant, PeerLink};
use elastic_vmm::{AccessMode, Backend, MemOptions, Pool, PoolConfig};

use crate::{median, BoxError, GIB, MIB};

#[cfg(feature = "nixl")]
#[path = "p2p_nixl.rs"]
mod nixl;

/// The variable that makes this binary the decode process.
pub const ROLE_VAR: &str = "EVMM_BENCH_ROLE";
const LAYERS: usize = 32;
const BLOCK_SIZES: [u64; 5] = [64 << 10, 256 << 10, MIB, 4 * MIB, 16 * MIB];
const RUNS: usize = 5;
/// Most merged runs the "raw per run" column copies one by one.
const MAX_RAW_RUNS: usize = 5000;
const WAIT: Duration = Duration::from_secs(120);

/// One measured case, walked in the same order by both processes.
#[derive(Debug, Clone, Copy)]
struct Case {
    kind: LayoutKind,
    block: u64,
    scattered: bool,
}

/// Every case, or those of the block sizes (bytes, comma-separated) in `EVMM_P2P_BLOCKS`
/// (read by both processes: the decode inherits it).
fn cases() -> Vec<Case> {
    let only: Option<Vec<u64>> = std::env::var("EVMM_P2P_BLOCKS")
        .ok()
        .map(|v| v.split(',').filter_map(|b| b.trim().parse().ok()).collect());
    let mut v = Vec::new();
    for block in BLOCK_SIZES {
        if only.as_ref().is_some_and(|o| !o.contains(&block)) {
            continue;
        }
        for kind in [
            LayoutKind::FullyContiguous,
            LayoutKind::LayerSeparate(BlockDim::First),
        ] {
            for scattered in [false, true] {
                v.push(Case {
                    kind,
                    block,
                    scattered,
                });
            }
        }
    }
    v
}

/// Blocks per case: about 1 GiB, at most a grant's limit.
fn blocks_for(block: u64) -> usize {
    ((GIB / block) as usize).min(p2p::MAX_GRANT_BLOCKS)
}

/// 32 layers, K and V, 16 tokens of 2-byte elements: `block` bytes per block.
fn config(block: u64, num_blocks: usize) -> LayoutConfig {
    let inner = (block / (LAYERS as u64 * 2 * 16 * 2)) as usize;
    LayoutConfig::new(num_blocks, LAYERS, 2, 16, inner, 2)
}

/// The page size of both layouts: `EVMM_P2P_PAGE` bytes (read by both processes), else the
/// granularity. Each page is its own chunks, so larger pages mean fewer chunks to import.
fn page_size() -> Option<u64> {
    std::env::var("EVMM_P2P_PAGE").ok()?.trim().parse().ok()
}

fn layout(pool: &Pool, case: Case, n: usize) -> Result<ElasticLayout, BoxError> {
    let opts = match page_size() {
        Some(p) => MemOptions::new().chunk(p),
        None => MemOptions::new(),
    };
    Ok(LayoutBuilder::new()
        .config(config(case.block, n))
        .kind(case.kind)
        .elastic(pool, &opts)
        .build()?)
}

fn device_count() -> i32 {
    cudarc::driver::result::device::get_count().unwrap_or(1)
}

pub fn run() -> Result<(), BoxError> {
    let mut pairs = vec![(0, 0)];
    // The backend initialises the driver before the device count is asked.
    let first = CudaBackend::new(0)?;
    if device_count() >= 2 {
        pairs.push((0, 1));
    }
    println!(
        "== p2p: KV blocks from a prefill process to a decode process ({}) ==",
        first.info().device_name
    );
    // `first` keeps device 0's primary context alive for the whole run: UCX (NIXL) looks for
    // a CUDA context when its agent starts.
    for (src, dst) in pairs {
        prefill(src, dst)?;
    }
    drop(first);
    Ok(())
}

fn prefill(device: i32, decode_device: i32) -> Result<(), BoxError> {
    let dir = std::env::temp_dir().join(format!("evmm-bench-p2p-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let sock = dir.join("s");
    let _ = std::fs::remove_file(&sock);
    let listener: UnixListener = p2p::listen(&sock)?;
    // The device's context first: the NIXL agent (UCX) starts under it.
    let backend: Arc<dyn Backend> = Arc::new(CudaBackend::new(device)?);
    #[cfg(feature = "nixl")]
    let mut nixl_side = nixl::PrefillNixl::open(&dir, device)?;
    let mut cmd = Command::new(std::env::current_exe()?);
    cmd.env(ROLE_VAR, "p2p-decode")
        .env("EVMM_SOCKET", &sock)
        .env("EVMM_DEVICE", decode_device.to_string())
        .stdin(Stdio::null());
    #[cfg(feature = "nixl")]
    if let Some(nx) = &nixl_side {
        cmd.env(nixl::SOCKET_VAR, nx.socket());
    }
    let mut child = cmd.spawn()?;
    let link = PeerLink::accept_within(&listener, "prefill", backend.clone(), WAIT)?;
    #[cfg(feature = "nixl")]
    if let Some(nx) = &mut nixl_side {
        nx.accept(&mut child)?;
    }
    println!(
        "-- GPU {device} -> GPU {decode_device}: path {} ({})",
        link.path().path,
        link.path().reason
    );
    let pool = Pool::new(
        backend.clone(),
        PoolConfig::new((64 * GIB) as usize).name("prefill"),
    )?;
    for case in cases() {
        let n = blocks_for(case.block);
        let kv = layout(&pool, case, n)?;
        kv.ensure_backed(0..n)?;
        for r in kv.regions() {
            // SAFETY: the layout's regions are mapped (every block backed) and nothing else
            // uses them; the legacy stream is synchronized right after.
            unsafe {
                backend
                    .copies()
                    .fill_async(r.addr, r.len as usize, 0x5a, 1)?
            };
        }
        backend.copies().synchronize(1)?;
        let blocks: Vec<usize> = (0..n).collect();
        let g = link.grant(&kv, &blocks, AccessMode::ReadOnly)?;
        g.wait_released(WAIT)?;
        kv.release(0..n)?;
        #[cfg(feature = "nixl")]
        if let (Some(nx), true) = (&mut nixl_side, nixl::measured(case)) {
            nx.serve(&backend, &pool, case.block, n)?;
        }
    }
    drop(link);
    let st = child.wait()?;
    let _ = std::fs::remove_dir_all(dir);
    if !st.success() {
        return Err(format!("decode process failed: {st}").into());
    }
    Ok(())
}

/// The decode process: per case, import, copy RUNS times with our path and with one raw copy
/// of the whole mapping, print the figures.
pub fn decode() -> Result<(), BoxError> {
    let device: i32 = std::env::var("EVMM_DEVICE")?.parse()?;
    let backend: Arc<dyn Backend> = Arc::new(CudaBackend::new(device)?);
    let link = PeerLink::connect(std::env::var("EVMM_SOCKET")?, "decode", backend.clone())?;
    let pool = Pool::new(
        backend.clone(),
        PoolConfig::new((64 * GIB) as usize).name("decode"),
    )?;
    // A stream of our own (the batch copy takes no legacy stream), on the device's primary
    // context, which the backend uses too.
    let ctx = cudarc::driver::CudaContext::new(device as usize)?;
    let cu_stream = ctx.new_stream()?;
    let raw_stream = cu_stream.cu_stream() as u64;
    // SAFETY: `cu_stream` lives until the end of this function, after every completion.
    let stream = unsafe { CopyStream::from_raw(raw_stream) };
    let choice = match std::env::var("EVMM_P2P_ENGINE").as_deref() {
        Ok("kernel") => EngineChoice::Kernel,
        Ok("memcpy") => EngineChoice::Memcpy,
        _ => EngineChoice::Auto,
    };
    #[cfg(feature = "nixl")]
    let mut nixl_side = nixl::DecodeNixl::connect(device)?;
    #[cfg(feature = "nixl")]
    if nixl_side.is_some() {
        println!(
            "NIXL (UCX, UCX_TLS={}): the prefill WRITEs its blocks into the decode's memory; \
             plain = cuMemAlloc buffers of the same blocks, median of {RUNS} after a warm-up; \
             VMM = elastic layouts registered per page, the first {} of the blocks, one run; \
             every byte checked",
            std::env::var("UCX_TLS").unwrap_or_else(|_| "unset".into()),
            crate::human(nixl::VMM_BYTES)
        );
    }
    print!(
        "{:>9} {:<42} {:>6} {:>7} {:>7} {:>8} {:>7} {:>9} {:>6} {:>6} {:>9} {:>10} {:>10} {:>10} {:>12} {:>7} {:>8}",
        "block",
        "layout",
        "blocks",
        "engine",
        "copies",
        "tasks",
        "host us",
        "wait ms",
        "chunks",
        "kept",
        "import ms",
        "ours GB/s",
        "raw GB/s",
        "run GB/s",
        "raw per run",
        "vs raw",
        "vs runs"
    );
    #[cfg(feature = "nixl")]
    if nixl_side.is_some() {
        print!("{}", nixl::header());
    }
    println!();
    // (ours, raw) GB/s of every case, for the headline figure.
    let mut figures = Vec::new();
    for case in cases() {
        let n = blocks_for(case.block);
        let t = Instant::now();
        let g = link.recv_grant(WAIT)?;
        // From asking to holding the mapped grant: the prefill's own set-up of the case (its
        // layout backed and filled) included; the import alone is `import_time`.
        let wait_ms = t.elapsed().as_secs_f64() * 1e3;
        let import_ms = g.import_time().as_secs_f64() * 1e3;
        let chunks = link.stats().imported_chunks;
        let kept = g.kept_chunks();
        let kv = layout(&pool, case, n)?;
        kv.ensure_backed(0..n)?;
        // Scattered: block i lands in block (i * 7919) mod n (a permutation: 7919 is prime
        // and no block count here is a multiple of it), so no run of blocks merges.
        let dst: Vec<usize> = if case.scattered {
            (0..n).map(|i| (i * 7919) % n).collect()
        } else {
            (0..n).collect()
        };
        // Warm-up (and the kernel's first load), then the median of RUNS.
        let mut report = g.copy_into_with(&kv, &dst, stream, choice)?.wait()?;
        let ours = median(RUNS, || {
            let t = Instant::now();
            report = g
                .copy_into_with(&kv, &dst, stream, choice)
                .and_then(|c| c.wait())
                .expect("copy");
            t.elapsed().as_secs_f64()
        });
        let bytes = report.bytes;
        let range = g.mapped_range();
        let raw_dst = pool.allocate(range.len as usize)?;
        let raw = median(RUNS, || {
            let t = Instant::now();
            // SAFETY: the grant's mapping and our allocation are mapped with access on this
            // device for the whole call, do not overlap, and the stream is synchronized
            // before either goes.
            unsafe {
                backend
                    .copies()
                    .copy_async(raw_dst.addr(), range.addr, range.len as usize, raw_stream)
                    .expect("raw copy");
            }
            backend
                .copies()
                .synchronize(raw_stream)
                .expect("synchronize");
            t.elapsed().as_secs_f64()
        });
        // What an engine would do by hand: one copy per run merged on both sides.
        let runs = merged_runs(&g, &kv, &dst)?;
        let per_run = (runs.len() <= MAX_RAW_RUNS).then(|| {
            // Warm-up, then the median of RUNS.
            let once = || {
                let t = Instant::now();
                for &(d, s, len) in &runs {
                    // SAFETY: every run lies in the grant's mapping and in backed destination
                    // blocks, mapped with access on this device, not overlapping; the stream is
                    // synchronized before either goes, and nothing else uses the blocks.
                    unsafe {
                        backend
                            .copies()
                            .copy_async(d, s, len as usize, raw_stream)
                            .expect("raw copy");
                    }
                }
                backend
                    .copies()
                    .synchronize(raw_stream)
                    .expect("synchronize");
                t.elapsed().as_secs_f64()
            };
            once();
            median(RUNS, once)
        });
        let ours_bw = bytes as f64 / ours / 1e9;
        let raw_bw = range.len as f64 / raw / 1e9;
        let run_bw = per_run.map(|t| bytes as f64 / t / 1e9);
        figures.push((ours_bw, raw_bw));
        let label = format!(
            "{}{}",
            match case.kind {
                LayoutKind::FullyContiguous => "fully contiguous",
                _ => "layer separate (32 layers, K/V)",
            },
            if case.scattered { ", scattered" } else { "" }
        );
        let or_dash = |v: Option<f64>, unit: &str| {
            v.map_or_else(|| "-".to_string(), |v| format!("{v:.2}{unit}"))
        };
        drop(raw_dst);
        drop(g);
        kv.release(0..n)?;
        print!(
            "{:>9} {:<42} {:>6} {:>7} {:>7} {:>8} {:>7.1} {:>9.2} {:>6} {:>6} {:>9.2} {:>10.1} {:>10.1} {:>10} {:>12} {:>6.2}x {:>8}",
            crate::human(case.block),
            label,
            n,
            report.engine.to_string(),
            report.copies,
            report.tasks,
            report.host.as_secs_f64() * 1e6,
            wait_ms,
            chunks,
            kept,
            import_ms,
            ours_bw,
            raw_bw,
            or_dash(run_bw, ""),
            or_dash(per_run.map(|t| t * 1e3), " ms"),
            ours_bw / raw_bw,
            or_dash(run_bw.map(|r| ours_bw / r), "x"),
        );
        #[cfg(feature = "nixl")]
        let mut nixl_errors = Vec::new();
        #[cfg(feature = "nixl")]
        if let Some(nx) = &mut nixl_side {
            if nixl::measured(case) {
                let f = nx.measure(&backend, &pool, case.block, n)?;
                print!("{}", f.cells(ours_bw));
                nixl_errors = f.errors();
            } else {
                print!("{}", nixl::no_cells());
            }
        }
        println!();
        #[cfg(feature = "nixl")]
        for e in nixl_errors {
            println!("{e}");
        }
    }
    // The median case by ratio, with the lowest and highest ratio beside it.
    figures.sort_by(|a, b| (a.0 / a.1).total_cmp(&(b.0 / b.1)));
    if let (Some(lo), Some(mid), Some(hi)) = (
        figures.first(),
        figures.get(figures.len() / 2),
        figures.last(),
    ) {
        crate::result(
            "p2p/blocks",
            &format!(
                "KV blocks between processes, median of {} layouts (lowest {:.2}x, highest {:.2}x)",
                figures.len(),
                lo.0 / lo.1,
                hi.0 / hi.1
            ),
            format!("{:.1} GB/s", mid.0),
            "raw cuMemcpyAsync of the same runs",
            format!("{:.1} GB/s", mid.1),
            mid.0 / mid.1,
        );
    }
    let st = link.stats();
    println!(
        "decode link: {} transfers, {} copied, imports left {}, {} chunks kept imported ({}), {} found kept",
        st.transfers,
        crate::human(st.bytes_copied),
        st.imports,
        st.kept_imports,
        crate::human(st.kept_import_bytes),
        st.kept_hits
    );
    Ok(())
}

/// The copies `(dst, src, len)` of the grant's blocks into `dst` blocks of `kv`, merged where
/// both sides continue (in destination order), as an engine would issue them by hand.
fn merged_runs(
    g: &ImportedGrant,
    kv: &ElasticLayout,
    dst: &[usize],
) -> Result<Vec<(u64, u64, u64)>, BoxError> {
    let mut ops = Vec::new();
    for (i, &d) in dst.iter().enumerate() {
        let src = g.block_views(i).ok_or("granted block missing")?;
        for (dv, sv) in kv.block(d)?.iter().zip(&src) {
            ops.push((dv.addr, sv.addr, dv.len));
        }
    }
    ops.sort_unstable();
    let mut merged: Vec<(u64, u64, u64)> = Vec::with_capacity(ops.len());
    for (d, s, len) in ops {
        match merged.last_mut() {
            Some((od, os, ol)) if *od + *ol == d && *os + *ol == s => *ol += len,
            _ => merged.push((d, s, len)),
        }
    }
    Ok(merged)
}
