//! GPU benchmark binary: elastic-vmm against the driver's allocators and its peers, measured in
//! one run, with ratios printed. Built only with the `gpu-tests` feature:
//! `cargo bench --features gpu-tests --bench gpu --no-run`, then run the binary on the GPU
//! machine. Arguments name the sections to run (`pool`, `shared`, `sleep`, `broker`, `p2p`,
//! `tiers`, `kv`, `candle`); none runs all. With `nixl`, `p2p` has NIXL columns (see `p2p.rs`).

mod broker;
#[cfg(feature = "candle")]
mod candle;
mod kv;
#[cfg(feature = "nixl")]
mod nixl_peer;
mod p2p;
mod pool;
mod shared;
mod sleep;
mod tiers;

use std::process::ExitCode;

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
    println!("RESULT|{key}|{what}|{ours}|{peer}|{peer_figure}|{ratio:.2}x");
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
    let args: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| !a.starts_with('-'))
        .collect();
    let want = |name: &str| args.is_empty() || args.iter().any(|a| a == name);
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
    let mut failed = false;
    for (name, run) in sections {
        if !want(name) {
            continue;
        }
        if let Err(e) = run() {
            eprintln!("section {name} failed: {e}");
            failed = true;
        }
    }
    if failed {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    }
}
