//! `elastic-vmm`: the command-line tool. Uses the crate's public API only.
//!
//! - `info`: the backend, device, granularity and VMM support.
//! - `demo`: several models' paged KV caches under one budget, the same workload split
//!   statically and elastic; a table as it goes, a comparison and an SVG plot at the end.
//! - `multi`: three models with bursty, out-of-phase load sharing one budget smaller than the
//!   sum of their peaks; per-model use over time, and an SVG plot of it (its folder is created
//!   when missing).
//!
//! - `broker`: the daemon that shares one device's memory between engine processes.
//! - `ctl`: list engines and models, change limits and guarantees, stats, metrics (`--json`).
//! - `top`: a live terminal view of the broker.
//!
//! Built only with the crate's default feature `cli`, which brings clap and tracing-subscriber.

mod demo;
mod multi;
mod ops;
mod output;
mod plot;
mod top;

use std::process::ExitCode;
use std::sync::Arc;

use clap::{Parser, Subcommand, ValueEnum};
use elastic_vmm::backend::{self, cuda::CudaBackend, host::HostBackend};
use elastic_vmm::stats::human_bytes;
use elastic_vmm::Backend;

#[derive(Parser)]
#[command(
    name = "elastic-vmm",
    version,
    about = "Elastic GPU memory: reserve once, map on demand, give back"
)]
struct Cli {
    /// Which memory to use: CUDA device 0 when a GPU is found, else host memory.
    #[arg(long, value_enum, default_value_t = BackendChoice::Auto, global = true)]
    backend: BackendChoice,
    /// CUDA device ordinal (with --backend cuda or auto).
    #[arg(long, default_value_t = 0, global = true)]
    device: i32,
    #[command(subcommand)]
    command: Command,
}

#[derive(Clone, Copy, ValueEnum)]
pub enum BackendChoice {
    Auto,
    Host,
    Cuda,
}

#[derive(Subcommand)]
enum Command {
    /// Print the backend, device, granularity and VMM support.
    Info,
    /// Several models share one budget through paged KV caches, static split against elastic;
    /// prints the table and writes an SVG plot.
    Demo(demo::DemoArgs),
    /// Three models with bursty, out-of-phase load on one budget; writes an SVG plot.
    Multi(multi::MultiArgs),
    /// The broker daemon: one device's memory shared by engine processes, with quotas.
    Broker(ops::BrokerArgs),
    /// Talk to a running broker: list, stats, set limits and guarantees, trim, metrics.
    Ctl(ops::CtlArgs),
    /// A live terminal view of a running broker.
    Top(top::TopArgs),
}

fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "warn".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    match run(cli) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}

pub type BoxError = Box<dyn std::error::Error>;

/// A command-line argument that cannot work, with the numbers given.
#[derive(Debug, thiserror::Error)]
pub enum ArgError {
    /// The arguments are inconsistent or out of range.
    #[error("invalid arguments: {0}")]
    Invalid(String),
    /// A size computed from the arguments does not fit in 64 bits.
    #[error("arguments too large: {what} = {a} x {b} overflows")]
    Overflow {
        /// What was being computed.
        what: &'static str,
        /// The operands.
        a: u64,
        /// The operands.
        b: u64,
    },
}

/// An error naming `what` unless `v` is at least `min`.
pub fn at_least(what: &'static str, v: u64, min: u64) -> Result<(), ArgError> {
    if v < min {
        return Err(ArgError::Invalid(format!(
            "{what} must be at least {min}, got {v}"
        )));
    }
    Ok(())
}

/// `a * b`, or an error naming `what` when it overflows.
pub fn mul(what: &'static str, a: u64, b: u64) -> Result<u64, ArgError> {
    a.checked_mul(b).ok_or(ArgError::Overflow { what, a, b })
}

/// A `u64` from the arguments as a `usize` (they are the same size on the 64-bit targets the
/// crate supports, but the conversion is checked anyway).
pub fn to_usize(what: &'static str, v: u64) -> Result<usize, ArgError> {
    usize::try_from(v).map_err(|_| ArgError::Invalid(format!("{what} = {v} does not fit in usize")))
}

fn open_backend(
    choice: BackendChoice,
    device: i32,
) -> Result<(Arc<dyn Backend>, Option<String>), BoxError> {
    Ok(match choice {
        BackendChoice::Cuda => (Arc::new(CudaBackend::new(device)?), None),
        BackendChoice::Host => (
            Arc::new(HostBackend::new(backend::host::DEFAULT_GRANULARITY)?),
            None,
        ),
        BackendChoice::Auto if device == 0 => backend::default_backend()?,
        BackendChoice::Auto => match CudaBackend::new(device) {
            Ok(b) => (Arc::new(b), None),
            Err(e) => (
                Arc::new(HostBackend::new(backend::host::DEFAULT_GRANULARITY)?),
                Some(e.to_string()),
            ),
        },
    })
}

fn run(cli: Cli) -> Result<(), BoxError> {
    match &cli.command {
        Command::Broker(args) => return ops::run_broker(cli.backend, cli.device, args),
        Command::Ctl(args) => {
            let socket = ops::socket_path(args.socket.clone(), cli.backend, cli.device);
            return ops::run_ctl(socket, args);
        }
        Command::Top(args) => {
            let socket = ops::socket_path(args.socket.clone(), cli.backend, cli.device);
            return top::run(socket, args);
        }
        _ => {}
    }
    let (backend, why_not_cuda) = open_backend(cli.backend, cli.device)?;
    if let Some(why) = &why_not_cuda {
        println!("CUDA not used: {why}");
        println!("using host memory (memfd), the embedded default");
    }
    match cli.command {
        Command::Info => info(&backend),
        Command::Demo(args) => demo::run(backend, &args),
        Command::Multi(args) => multi::run(backend, &args),
        Command::Broker(_) | Command::Ctl(_) | Command::Top(_) => unreachable!("served above"),
    }
}

fn info(backend: &Arc<dyn Backend>) -> Result<(), BoxError> {
    let i = backend.info();
    let mem = backend.memory_info()?;
    println!("backend            {}", i.name);
    println!("device             {}", i.device_name);
    if let Some(o) = i.device_ordinal {
        println!("device ordinal     {o}");
    }
    println!(
        "granularity        {} (minimum {})",
        human_bytes(i.granularity as u64),
        human_bytes(i.min_granularity as u64)
    );
    println!("VMM supported      {}", i.vmm_supported);
    println!("GPUDirect RDMA     {}", i.rdma_capable);
    println!("POSIX fd export    {}", i.posix_fd_exportable);
    println!("fabric handles     {}", i.fabric_exportable);
    println!(
        "memory             {} free of {}",
        human_bytes(mem.free),
        human_bytes(mem.total)
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run_args(args: &[&str]) -> Result<(), BoxError> {
        let mut argv = vec!["elastic-vmm", "--backend", "host"];
        argv.extend_from_slice(args);
        run(Cli::try_parse_from(argv).expect("arguments parse"))
    }

    #[test]
    fn bad_numbers_are_errors_that_name_them_not_panics() {
        for (args, expect) in [
            (
                &["demo", "--report-every", "0"][..],
                "--report-every must be at least 1, got 0",
            ),
            (
                &["demo", "--models", "1"][..],
                "--models must be at least 2, got 1",
            ),
            (&["demo", "--models", "7"][..], "--models 7 is more than"),
            (&["demo", "--max-prompt", "63"][..], "--max-prompt"),
            (
                &["demo", "--peak-rate", "0"][..],
                "--peak-rate must be above 0",
            ),
            (&["demo", "--peak-rate", "NaN"][..], "--peak-rate"),
            (
                &["demo", "--budget-mib", "18446744073709551615"][..],
                "overflows",
            ),
            (
                &["demo", "--block-tokens", "4294967296"][..],
                "--block-tokens must be at most 4096, got 4294967296",
            ),
            (
                &["multi", "--steps", "1"][..],
                "--steps must be at least 2, got 1",
            ),
            (&["multi", "--report-every", "0"][..], "--report-every"),
            (
                &["multi", "--scale-mib", "18446744073709551615"][..],
                "overflows",
            ),
            (
                &["multi", "--block-kib", "18446744073709551615"][..],
                "overflows",
            ),
            (
                &["multi", "--budget-percent", "18446744073709551615"][..],
                "global budget",
            ),
        ] {
            let err = run_args(args).expect_err("refused").to_string();
            assert!(err.contains(expect), "{args:?}: {err}");
        }
    }

    #[test]
    fn multi_writes_its_plot_into_a_folder_it_creates() {
        let dir =
            std::env::temp_dir().join(format!("elastic-vmm-cli-multi-{}", std::process::id()));
        let svg = dir.join("new/folder/multi.svg");
        let svg_arg = svg.to_str().expect("utf-8 temporary path");
        let result = run_args(&[
            "multi",
            "--steps",
            "6",
            "--scale-mib",
            "16",
            "--period",
            "3",
            "--svg",
            svg_arg,
        ]);
        let written = std::fs::read_to_string(&svg);
        let _ = std::fs::remove_dir_all(&dir);
        result.expect("multi runs");
        let written = written.expect("the plot exists");
        assert!(written.starts_with("<svg") && written.trim_end().ends_with("</svg>"));
    }
}
