//! `broker` and `ctl`: the broker daemon and the operator's command line.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use elastic_vmm::backend::cuda::CudaBackend;
use elastic_vmm::backend::host::{ChunkFiles, HostBackend, DEFAULT_GRANULARITY};
use elastic_vmm::broker::protocol::{Reply, Request};
use elastic_vmm::broker::{self, Broker, BrokerClient, BrokerConfig, Snapshot};
use elastic_vmm::stats::human_bytes;
use elastic_vmm::Backend;

use super::{ArgError, BackendChoice, BoxError};

/// Where the broker's socket is: `--socket`, else `$ELASTIC_VMM_BROKER`, else the default for
/// the chosen backend (with `auto`: the CUDA device's when that socket exists, else the host's).
pub fn socket_path(given: Option<PathBuf>, backend: BackendChoice, device: i32) -> PathBuf {
    if let Some(p) = given {
        return p;
    }
    match backend {
        BackendChoice::Host => broker::default_socket("host", None),
        BackendChoice::Cuda => broker::default_socket("cuda", Some(device)),
        BackendChoice::Auto => {
            let cuda = broker::default_socket("cuda", Some(device));
            if cuda.exists() {
                cuda
            } else {
                broker::default_socket("host", None)
            }
        }
    }
}

/// A size: plain bytes, or with a suffix K/KiB, M/MiB, G/GiB, T/TiB (powers of 1024).
pub fn parse_size(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let n: u64 = num
        .parse()
        .map_err(|_| format!("{s:?} is not a size (bytes, or a number with K, M, G or T)"))?;
    let shift = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 0,
        "k" | "kib" | "kb" => 10,
        "m" | "mib" | "mb" => 20,
        "g" | "gib" | "gb" => 30,
        "t" | "tib" | "tb" => 40,
        other => return Err(format!("unknown unit {other:?} in {s:?}")),
    };
    n.checked_mul(1u64 << shift)
        .ok_or_else(|| format!("{s:?} overflows 64 bits"))
}

#[derive(clap::Args, Clone)]
pub struct BrokerArgs {
    /// The socket (default: see `ctl --help`).
    #[arg(long)]
    pub socket: Option<PathBuf>,
    /// Global budget (bytes, or with K/M/G/T). Default: free memory less the margin.
    #[arg(long, value_parser = parse_size)]
    pub global_limit: Option<u64>,
    /// Kept free when the budget is taken from the free memory.
    #[arg(long, value_parser = parse_size, default_value = "1G")]
    pub margin: u64,
    /// Let this group id connect engines too (socket mode 0660 instead of 0600, the socket's
    /// folder 0710 with that group instead of 0700). Its members act on their own models only.
    #[arg(long)]
    pub group: Option<u32>,
    /// How long a new connection has to say hello, in ms (then it is closed).
    #[arg(long, default_value_t = 5000)]
    pub hello_timeout_ms: u64,
    /// Most connections one user of --group may have open (counted from accept, hello pending
    /// included). The broker's own user and root are bounded by the total (128) only.
    #[arg(long, default_value_t = 32)]
    pub max_connections_per_user: usize,
    /// Most models one user of --group may register (the broker's own user and root: the
    /// total, 128, only).
    #[arg(long, default_value_t = 32)]
    pub max_models_per_user: usize,
    /// Most bytes all guarantees may add up to (bytes, or with K/M/G/T). Default: the budget.
    #[arg(long, value_parser = parse_size)]
    pub max_guarantee_total: Option<u64>,
    /// Most bytes the guarantees of one user's models may add up to, for every user. Default:
    /// the budget for the broker's own user and root, none for the users of --group.
    #[arg(long, value_parser = parse_size)]
    pub max_guarantee_per_user: Option<u64>,
    /// Most bytes the models of one user of --group may hold together, orphaned ones included
    /// (bytes, or with K/M/G/T). Default: half the budget. The broker's own user and root are
    /// bounded by the budget only.
    #[arg(long, value_parser = parse_size)]
    pub max_bytes_per_user: Option<u64>,
    /// The highest priority one user of --group may register a model at (on both tiers);
    /// above it is refused. Reclaims take from the lowest priority first, so the default, 0
    /// (a model's default priority), keeps those users from making the operator's models give
    /// first. The broker's own user and root register at any priority.
    #[arg(long, default_value_t = 0, allow_negative_numbers = true)]
    pub max_priority_per_user: i32,
    /// Give the broker a host tier with this budget (bytes, or with K/M/G/T): host memory
    /// (VMM host chunks on CUDA, else pinned memfd chunks) the broker makes once and hands
    /// between engines (`BrokerClient::register_host_tier`), for their sleeps to stage
    /// through, under the same rules as device memory. Default: no host tier.
    #[arg(long, value_parser = parse_size)]
    pub host_budget: Option<u64>,
    /// How long a growth waits for other engines to give memory back, in ms.
    #[arg(long, default_value_t = 2000)]
    pub reclaim_wait_ms: u64,
    /// How long a lease whose engine is gone holds the model's kept memory (charged to it)
    /// for a new engine of the same user to attach, in ms.
    #[arg(long, default_value_t = 300_000)]
    pub lease_grace_ms: u64,
    /// Serve Prometheus metrics on this loopback address (e.g. 127.0.0.1:9464). Every local
    /// user can read that port: it shows aggregate numbers only, unless --metrics-per-model.
    #[arg(long)]
    pub metrics_addr: Option<SocketAddr>,
    /// Show each model's series (names, bytes, limits, guarantees) on --metrics-addr too, to
    /// every local user. Over the socket (`ctl metrics`, the broker's user) they always show.
    #[arg(long, requires = "metrics_addr")]
    pub metrics_per_model: bool,
}

pub fn run_broker(choice: BackendChoice, device: i32, args: &BrokerArgs) -> Result<(), BoxError> {
    let backend: Arc<dyn Backend> = match choice {
        BackendChoice::Host => Arc::new(HostBackend::with_chunk_files(
            DEFAULT_GRANULARITY,
            ChunkFiles::PerChunk,
        )?),
        BackendChoice::Cuda => Arc::new(CudaBackend::new(device)?),
        BackendChoice::Auto => match CudaBackend::new(device) {
            Ok(b) => Arc::new(b),
            Err(e) => {
                eprintln!("CUDA not used ({e}); brokering host memory");
                Arc::new(HostBackend::with_chunk_files(
                    DEFAULT_GRANULARITY,
                    ChunkFiles::PerChunk,
                )?)
            }
        },
    };
    let info = backend.info().clone();
    let socket = args
        .socket
        .clone()
        .unwrap_or_else(|| broker::default_socket(info.name, info.device_ordinal));
    let global_limit = match args.global_limit {
        Some(l) => l,
        None => {
            let free = backend.memory_info()?.free;
            free.checked_sub(args.margin).ok_or_else(|| {
                ArgError::Invalid(format!(
                    "--margin {} is more than the {} bytes free",
                    args.margin, free
                ))
            })?
        }
    };
    let mut config = BrokerConfig::new(&socket, global_limit)
        .reclaim_wait(Duration::from_millis(args.reclaim_wait_ms))
        .lease_grace(Duration::from_millis(args.lease_grace_ms))
        .hello_timeout(Duration::from_millis(args.hello_timeout_ms))
        .max_connections_per_user(args.max_connections_per_user)
        .max_models_per_user(args.max_models_per_user);
    config.group = args.group;
    config.max_guarantee_total = args.max_guarantee_total;
    config.max_guarantee_per_user = args.max_guarantee_per_user;
    config.max_bytes_per_user = args.max_bytes_per_user;
    config.max_priority_per_user = args.max_priority_per_user;
    config.host_budget = args.host_budget;
    let broker = Broker::start(backend, config)?;
    if let Some(addr) = args.metrics_addr {
        let b = Arc::new(broker::BrokerClient::connect_control(&socket, "metrics")?);
        let per_model = args.metrics_per_model;
        let text = Arc::new(move || match b.request(Request::Metrics) {
            Ok((Reply::Metrics(t), _)) if per_model => t,
            Ok((Reply::Metrics(t), _)) => broker::metrics::aggregate_only(&t),
            Ok((other, _)) => format!("# broker answered {other:?}\n"),
            Err(e) => format!("# {e}\n"),
        });
        let bound = broker::metrics::serve_metrics(addr, text)?;
        println!("metrics on http://{bound}/metrics");
    }
    let budget = broker.snapshot().global_limit;
    if budget < global_limit {
        eprintln!(
            "budget cut to the {} free on the device (asked {})",
            human_bytes(budget),
            human_bytes(global_limit)
        );
    }
    let host = broker.snapshot().host_tier.map_or(String::new(), |h| {
        format!(
            ", host tier {} ({}) budget {}",
            h.backend.name,
            h.backend.device_name,
            human_bytes(h.global_limit)
        )
    });
    println!(
        "broker pid {} on {} ({} {}, budget {}{host})",
        std::process::id(),
        socket.display(),
        info.name,
        info.device_name,
        human_bytes(budget)
    );
    broker.wait();
    Ok(())
}

#[derive(clap::Args, Clone)]
pub struct CtlArgs {
    /// The broker's socket: --socket, else $ELASTIC_VMM_BROKER, else
    /// /tmp/elastic-vmm-<uid>/cuda<device>.sock or host.sock.
    #[arg(long)]
    pub socket: Option<PathBuf>,
    /// Print JSON instead of a table.
    #[arg(long)]
    pub json: bool,
    #[command(subcommand)]
    pub command: CtlCommand,
}

#[derive(clap::Subcommand, Clone)]
pub enum CtlCommand {
    /// Engines and models: use, limit, guarantee.
    List,
    /// Everything the broker knows, counters included.
    Stats,
    /// Change a model's limit; lowering it asks the engine to give memory back.
    SetLimit {
        /// The model.
        model: String,
        /// The new limit (bytes, or with K/M/G/T).
        #[arg(value_parser = parse_size)]
        limit: u64,
        /// How long the engine has, in ms.
        #[arg(long, default_value_t = 5000)]
        deadline_ms: u64,
    },
    /// Change a model's guarantee.
    SetGuarantee {
        /// The model.
        model: String,
        /// The new guarantee (bytes, or with K/M/G/T).
        #[arg(value_parser = parse_size)]
        guarantee: u64,
    },
    /// Release the broker's idle chunks.
    Trim,
    /// Prometheus text exposition.
    Metrics,
}

pub fn run_ctl(socket: PathBuf, args: &CtlArgs) -> Result<(), BoxError> {
    let client = BrokerClient::connect_control(&socket, "ctl")?;
    let json = args.json;
    let answer = |r: Reply| -> Result<Reply, BoxError> {
        match r {
            Reply::Error { kind, message } => Err(format!("{kind:?}: {message}").into()),
            other => Ok(other),
        }
    };
    match &args.command {
        CtlCommand::List | CtlCommand::Stats => {
            let snap = client.snapshot()?;
            if json {
                println!("{}", serde_json::to_string_pretty(&snap)?);
            } else {
                print!(
                    "{}",
                    table(&snap, matches!(args.command, CtlCommand::Stats))
                );
            }
        }
        CtlCommand::SetLimit {
            model,
            limit,
            deadline_ms,
        } => {
            let r = answer(
                client
                    .request(Request::SetLimit {
                        model: model.clone(),
                        limit: *limit,
                        deadline_ms: *deadline_ms,
                    })?
                    .0,
            )?;
            print_change(r, json)?;
        }
        CtlCommand::SetGuarantee { model, guarantee } => {
            let r = answer(
                client
                    .request(Request::SetGuarantee {
                        model: model.clone(),
                        guarantee: *guarantee,
                    })?
                    .0,
            )?;
            print_change(r, json)?;
        }
        CtlCommand::Trim => match answer(client.request(Request::Trim)?.0)? {
            Reply::Trimmed { released } if json => println!("{{\"released\": {released}}}"),
            Reply::Trimmed { released } => println!("released {}", human_bytes(released)),
            other => return Err(format!("unexpected answer {other:?}").into()),
        },
        CtlCommand::Metrics => match answer(client.request(Request::Metrics)?.0)? {
            Reply::Metrics(t) => print!("{t}"),
            other => return Err(format!("unexpected answer {other:?}").into()),
        },
    }
    Ok(())
}

fn print_change(r: Reply, json: bool) -> Result<(), BoxError> {
    match r {
        Reply::Changed(c) if json => println!("{}", serde_json::to_string_pretty(&c)?),
        Reply::Changed(c) => println!(
            "{}: limit {}, guarantee {}, uses {} (gave back {})",
            c.model,
            human_bytes(c.limit),
            human_bytes(c.guarantee),
            human_bytes(c.used),
            human_bytes(c.reclaimed)
        ),
        other => return Err(format!("unexpected answer {other:?}").into()),
    }
    Ok(())
}

/// The `list` / `stats` table.
pub fn table(s: &Snapshot, counters: bool) -> String {
    use std::fmt::Write;
    let mut out = String::new();
    let _ = writeln!(
        out,
        "broker pid {}  {} ({})  used {} of {}  idle {}  physical {}",
        s.broker_pid,
        s.backend.name,
        s.backend.device_name,
        human_bytes(s.global_used),
        human_bytes(s.global_limit),
        human_bytes(s.idle),
        human_bytes(s.physical)
    );
    let _ = writeln!(
        out,
        "{:<20} {:>8} {:>11} {:>11} {:>11} {:>5} {:>11} {:>11} {:>7} {:>8}  LEASE",
        "MODEL", "PID", "USED", "LIMIT", "GUARANTEE", "PRIO", "IN USE", "IDLE", "CHUNKS", "REFUSED"
    );
    for m in &s.models {
        let pid = s
            .engines
            .iter()
            .find(|e| e.id == m.engine)
            .map_or(0, |e| e.peer.pid);
        let lease = match &m.lease {
            None => "-".to_string(),
            Some(l) => {
                let left = l.expires_in_ms.map_or(String::new(), |ms| {
                    format!(", {:.0} s left", ms as f64 / 1e3)
                });
                format!(
                    "{:?}: {} kept in {} regions{left}",
                    l.state,
                    human_bytes(l.kept),
                    l.regions
                )
                .to_lowercase()
            }
        };
        let _ = writeln!(
            out,
            "{:<20} {:>8} {:>11} {:>11} {:>11} {:>5} {:>11} {:>11} {:>7} {:>8}  {lease}",
            m.name,
            pid,
            human_bytes(m.used),
            human_bytes(m.limit),
            human_bytes(m.guarantee),
            m.priority,
            human_bytes(m.in_use),
            human_bytes(m.idle + m.cached),
            m.chunks,
            m.refusals
        );
    }
    if counters {
        let _ = writeln!(out, "engines: {}", s.engines.len());
        for e in &s.engines {
            let _ = writeln!(
                out,
                "  {:>4} {:<20} {:?} pid {} uid {}",
                e.id, e.name, e.role, e.peer.pid, e.peer.uid
            );
        }
        let _ = writeln!(out, "counters: {:?}", s.counters);
        if let Some(a) = &s.audit {
            let _ = writeln!(out, "AUDIT FAILED: {a}");
        }
    }
    if let Some(h) = &s.host_tier {
        let _ = write!(out, "host tier: {}", table(h, counters));
    }
    out
}
