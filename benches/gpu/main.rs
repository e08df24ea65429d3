//! GPU benchmark binary: elastic-vmm against the driver's allocators and its peers, measured in
//! one run, with ratios printed. Built only with the `gpu-tests` feature:
//! `cargo bench --features gpu-tests --bench gpu --no-run`, then run the binary on the GPU
//! machine. Arguments name the sections to run (`pool`, `shared`, `sleep`, `broker`, `p2p`,
//! `tiers`, `kv`, `candle`, `attention`); none runs all. With `nixl`, `p2p` has NIXL columns
//! (see `p2p.rs`).
//!
//! `--check` compares every `RESULT` line of the run with the saved one in `docs/results/`
//! (or `$EVMM_RESULTS_DIR`) of a run on the same device (the saved log's `# gpu:` line), and
//! fails on a ratio more than 20% worse, a missing line, or no saved run on this device
//! (`check.rs`); `--check-log=FILE` does the same for a log saved before (its `# gpu:` line
//! names the device), without running.

#[cfg(feature = "candle")]
mod attention;
mod broker;
#[cfg(feature = "candle")]
mod candle;
mod check;
mod kv;
#[cfg(feature = "nixl")]
mod nixl_peer;
mod p2p;
mod pool;
mod shared;
mod sleep;
mod tiers;

use std::process::ExitCode;
use std::sync::Mutex;

pub type BoxError = Box<dyn std::error::Error>;

/// One benchmark section: a name and its entry point.
type Section = (&'static str, fn() -> Result<(), BoxError>);

pub const MIB: u64 = 1 << 20;
pub const GIB: u64 = 1 << 30;

/// The median of `runs` measurements.
pub fn median(runs: usize, mut f: impl FnMut() -> f64) -> f64 {
    let mut v: Vec<f64> = (0..runs).map(|_| f()).collect();
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Print "`label`: X.XXx" where X = `peer` / `ours` (both costs: above 1 means we are faster).
pub fn ratio_line(label: &str, peer: f64, ours: f64) {
    println!("{label}: {:.2}x", peer / ours);
}

/// One headline figure for the README's results table: a line
/// `RESULT|key|what|ours|peer|peer's figure|ratio` that `tests/results.rs` reads from the saved
/// runs in `docs/results/` to generate (and check) the table. `ratio` is oriented so that above
/// 1 means elastic-vmm is better.
pub fn result(key: &str, what: &str, ours: String, peer: &str, peer_figure: String, ratio: f64) {
    let line = format!("RESULT|{key}|{what}|{ours}|{peer}|{peer_figure}|{ratio:.2}x");
    println!("{line}");
    RESULTS.lock().unwrap_or_else(|p| p.into_inner()).push(line);
}

/// The `RESULT` lines printed so far, for `--check`.
static RESULTS: Mutex<Vec<String>> = Mutex::new(Vec::new());

/// The saved `RESULT` lines of `gpu-bench` runs on `device`, with their files.
fn saved_lines(device: &str) -> Result<Vec<(String, check::Line)>, BoxError> {
    let dir = std::env::var("EVMM_RESULTS_DIR").unwrap_or_else(|_| "docs/results".into());
    let mut files: Vec<_> = std::fs::read_dir(&dir)
        .map_err(|e| format!("saved results {dir}: {e}"))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|e| e == "log"))
        .collect();
    files.sort();
    let mut logs = Vec::new();
    for p in files {
        let text = std::fs::read_to_string(&p).map_err(|e| format!("{}: {e}", p.display()))?;
        let name = p.file_name().unwrap_or_default().to_string_lossy();
        logs.push((name.into_owned(), text));
    }
    Ok(check::saved_on(device, &logs)?)
}

/// Compare `fresh` (run on `device`) with the saved lines of `sections`; prints the report,
/// returns whether it passed.
fn check_against_saved(device: &str, fresh: &str, sections: &[&str]) -> Result<bool, BoxError> {
    let fresh = check::lines_of(fresh)?;
    let report = check::compare(&saved_lines(device)?, &fresh, sections);
    print!("{}", report.text());
    Ok(report.passed())
}

/// The name of CUDA device 0 (as `nvidia-smi` and the saved logs' `# gpu:` lines give it).
fn device_name() -> Result<String, BoxError> {
    Ok(cudarc::driver::CudaContext::new(0)?.name()?)
}

pub fn human(bytes: u64) -> String {
    elastic_vmm::stats::human_bytes(bytes)
}

fn main() -> ExitCode {
    // First, before any thread: NIXL's UCX reads its environment when an agent starts.
    #[cfg(feature = "nixl")]
    nixl_peer::prepare_env();
    if std::env::var(broker::ROLE).as_deref() == Ok("broker-engine-b") {
        return match broker::engine_b() {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("engine B failed: {e}");
                ExitCode::FAILURE
            }
        };
    }
    // The other process of a two-process section.
    if let Ok(role) = std::env::var(p2p::ROLE_VAR) {
        let r = match role.as_str() {
            "p2p-decode" => p2p::decode(),
            other => Err(format!("unknown role {other}").into()),
        };
        return match r {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("{role} failed: {e}");
                ExitCode::FAILURE
            }
        };
    }
    let all: Vec<String> = std::env::args().skip(1).collect();
    let args: Vec<String> = all
        .iter()
        .filter(|a| !a.starts_with('-'))
        .cloned()
        .collect();
    let want = |name: &str| args.is_empty() || args.iter().any(|a| a == name);
    if let Some(log) = all.iter().find_map(|a| a.strip_prefix("--check-log=")) {
        let text = match std::fs::read_to_string(log) {
            Ok(t) => t,
            Err(e) => {
                eprintln!("--check-log: {log}: {e}");
                return ExitCode::FAILURE;
            }
        };
        // The sections named, or every section with a line in the log.
        let mut sections: Vec<String> = args.clone();
        if sections.is_empty() {
            sections = check::lines_of(&text)
                .unwrap_or_default()
                .iter()
                .map(|l| l.section().to_string())
                .collect();
        }
        if sections.is_empty() {
            eprintln!(
                "--check-log: {log} has no RESULT line and no section was named: nothing to check"
            );
            return ExitCode::FAILURE;
        }
        let sections: Vec<&str> = sections.iter().map(String::as_str).collect();
        // The device is the log's `# gpu:` line.
        let Some(device) = check::saved_device(&text) else {
            eprintln!("--check-log: {log} has no '# gpu: <device>, driver <version>' line");
            return ExitCode::FAILURE;
        };
        return verdict(check_against_saved(device, &text, &sections));
    }
    #[cfg_attr(not(feature = "candle"), allow(unused_mut))]
    let mut sections: Vec<Section> = vec![
        ("pool", pool::run),
        ("shared", shared::run),
        ("sleep", sleep::run),
        ("broker", broker::run),
        ("p2p", p2p::run),
        ("tiers", tiers::run),
        ("kv", kv::run),
    ];
    #[cfg(feature = "candle")]
    sections.push(("candle", candle::run));
    #[cfg(feature = "candle")]
    sections.push(("attention", attention::run));
    // A name that is no section runs nothing: refused, so that a typo cannot pass a check.
    let unknown: Vec<&String> = args
        .iter()
        .filter(|a| !sections.iter().any(|(name, _)| name == a))
        .collect();
    if !unknown.is_empty() {
        let known: Vec<&str> = sections.iter().map(|(name, _)| *name).collect();
        eprintln!(
            "unknown section(s) {unknown:?}; the sections are {}",
            known.join(", ")
        );
        return ExitCode::FAILURE;
    }
    let mut failed = false;
    let mut ran = Vec::new();
    for (name, run) in sections {
        if !want(name) {
            continue;
        }
        ran.push(name);
        if let Err(e) = run() {
            eprintln!("section {name} failed: {e}");
            failed = true;
        }
    }
    if all.iter().any(|a| a == "--check") {
        let fresh = RESULTS.lock().unwrap_or_else(|p| p.into_inner()).join("\n");
        let checked = device_name().and_then(|d| check_against_saved(&d, &fresh, &ran));
        if verdict(checked) == ExitCode::FAILURE {
            failed = true;
        }
    }
    if failed {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    }
}

/// A check's outcome as an exit code (an error reading the saved runs fails it).
fn verdict(passed: Result<bool, BoxError>) -> ExitCode {
    match passed {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::FAILURE,
        Err(e) => {
            eprintln!("check failed: {e}");
            ExitCode::FAILURE
        }
    }
}
