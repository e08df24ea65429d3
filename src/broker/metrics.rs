//! Prometheus metrics of the broker (prometheus-client, text exposition): bytes per model and
//! state, refusals, driver calls, grant latency. Served over the socket ([`super::protocol::Request::Metrics`],
//! `elastic-vmm ctl metrics`) and, when asked, on a localhost TCP port.
//!
//! Names follow Prometheus's naming conventions: one prefix (`elastic_vmm_broker_`), base
//! units in the name (`_bytes`, `_seconds`), counters ending `_total`, the model as a `model`
//! label. What a planner scrapes per model (a KAI-Scheduler-style request/limit pair is the
//! guarantee/limit pair): `model_physical_bytes` (charged to it), `model_limit_bytes`,
//! `model_guarantee_bytes`, `model_reclaimable_bytes` (what the broker can take back without
//! the engine losing data: idle and cached memory above the guarantee) and
//! `model_grant_seconds` (a histogram of the time to serve its growths: charge, create or hand
//! over, export; the engine then maps).

use std::collections::HashSet;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener};
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;

use prometheus_client::encoding::text::encode;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

use super::protocol::Snapshot;
use crate::backend::DriverCall;
use crate::error::{Error, Result};
use crate::stats::DriverCalls;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ModelState {
    model: String,
    state: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ModelLabel {
    model: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct CallLabel {
    call: &'static str,
}

/// What persists between scrapes: the grant-latency histogram. Everything else is read from a
/// snapshot at each scrape.
#[derive(Debug)]
pub(crate) struct Metrics {
    grant_seconds: Histogram,
    model_grant_seconds: Family<ModelLabel, Histogram, fn() -> Histogram>,
    /// Models with a grant histogram, so that a model gone drops its series at a scrape.
    /// Lock order: a leaf.
    timed: Mutex<HashSet<String>>,
}

/// Models with a grant histogram kept between scrapes at most (see `observe_grant`).
const MAX_TIMED_MODELS: usize = 1024;

/// 10 µs to ~160 ms.
fn grant_buckets() -> Histogram {
    Histogram::new(prometheus_client::metrics::histogram::exponential_buckets(
        1e-5, 2.0, 15,
    ))
}

impl Metrics {
    pub(crate) fn new() -> Metrics {
        Metrics {
            grant_seconds: grant_buckets(),
            model_grant_seconds: Family::new_with_constructor(grant_buckets),
            timed: Mutex::new(HashSet::new()),
        }
    }

    /// A growth of `model` (its name, when it is still registered) took `d`.
    pub(crate) fn observe_grant(&self, model: Option<&str>, d: Duration) {
        self.grant_seconds.observe(d.as_secs_f64());
        if let Some(name) = model {
            // Under the set's lock, so that a scrape's pruning cannot lose a series it then
            // never prunes. Without scrapes, models come and go: past a bound the per-model
            // histograms start over, so the broker's memory stays bounded.
            let mut timed = self.timed.lock();
            if timed.len() >= MAX_TIMED_MODELS && !timed.contains(name) {
                self.model_grant_seconds.clear();
                timed.clear();
            }
            timed.insert(name.to_string());
            self.model_grant_seconds
                .get_or_create(&ModelLabel {
                    model: name.to_string(),
                })
                .observe(d.as_secs_f64());
        }
    }

    /// The text exposition for `snap` and the broker's driver calls; the host tier's, when
    /// there is one (`snap.host_tier` and its driver calls), as the same families prefixed
    /// `elastic_vmm_broker_host_`.
    pub(crate) fn render(
        &self,
        snap: &Snapshot,
        calls: &DriverCalls,
        host_calls: Option<&DriverCalls>,
    ) -> String {
        let mut reg = Registry::with_prefix("elastic_vmm_broker");
        fill(&mut reg, snap, calls);
        reg.register(
            "grant_seconds",
            "Time to serve a growth (charge, create or hand over, export)",
            self.grant_seconds.clone(),
        );
        // Series of models no longer registered go.
        {
            let mut timed = self.timed.lock();
            timed.retain(|name| {
                let live = snap.models.iter().any(|m| m.name == *name);
                if !live {
                    self.model_grant_seconds.remove(&ModelLabel {
                        model: name.clone(),
                    });
                }
                live
            });
        }
        reg.register(
            "model_grant_seconds",
            "Time to serve a growth per model (charge, create or hand over, export)",
            self.model_grant_seconds.clone(),
        );
        if let (Some(h), Some(hc)) = (&snap.host_tier, host_calls) {
            fill(reg.sub_registry_with_prefix("host"), h, hc);
        }
        let mut out = String::new();
        if encode(&mut out, &reg).is_err() {
            out.clear();
        }
        out
    }
}

/// The families of one tier (its models, budget, counters, driver calls) into `reg`.
fn fill(reg: &mut Registry, snap: &Snapshot, calls: &DriverCalls) {
    let bytes = Family::<ModelState, Gauge>::default();
    let limit = Family::<ModelLabel, Gauge>::default();
    let guarantee = Family::<ModelLabel, Gauge>::default();
    let physical = Family::<ModelLabel, Gauge>::default();
    let reclaimable = Family::<ModelLabel, Gauge>::default();
    let refusals = Family::<ModelLabel, Counter>::default();
    let leased = Family::<ModelLabel, Gauge>::default();
    for m in &snap.models {
        let g = |v: u64| i64::try_from(v).unwrap_or(i64::MAX);
        for (state, v) in [
            ("charged", m.used),
            ("in_use", m.in_use),
            ("idle", m.idle),
            ("cached", m.cached),
        ] {
            bytes
                .get_or_create(&ModelState {
                    model: m.name.clone(),
                    state,
                })
                .set(g(v));
        }
        let l = ModelLabel {
            model: m.name.clone(),
        };
        limit.get_or_create(&l).set(g(m.limit));
        guarantee.get_or_create(&l).set(g(m.guarantee));
        physical.get_or_create(&l).set(g(m.used));
        let spare = m.idle.saturating_add(m.cached);
        reclaimable
            .get_or_create(&l)
            .set(g(spare.min(m.used.saturating_sub(m.guarantee))));
        refusals.get_or_create(&l).inc_by(m.refusals);
        if let Some(lease) = &m.lease {
            leased.get_or_create(&l).set(g(lease.kept));
        }
    }
    reg.register("model_bytes", "Bytes per model and state", bytes);
    reg.register("model_limit_bytes", "Physical limit per model", limit);
    reg.register("model_guarantee_bytes", "Guarantee per model", guarantee);
    reg.register(
        "model_physical_bytes",
        "Physical bytes charged per model",
        physical,
    );
    reg.register(
        "model_reclaimable_bytes",
        "Bytes the broker can take back per model without losing data (idle and cached, above the guarantee)",
        reclaimable,
    );
    reg.register("model_refusals", "Growths refused per model", refusals);
    reg.register(
        "model_lease_kept_bytes",
        "Bytes a model's lease keeps across its engine's end (held: no engine attached)",
        leased,
    );
    let gauge = |v: u64| {
        let g = Gauge::<i64>::default();
        g.set(i64::try_from(v).unwrap_or(i64::MAX));
        g
    };
    reg.register(
        "global_limit_bytes",
        "Global budget",
        gauge(snap.global_limit),
    );
    reg.register(
        "global_used_bytes",
        "Bytes charged in all",
        gauge(snap.global_used),
    );
    reg.register(
        "idle_bytes",
        "Idle chunks held for hand-over",
        gauge(snap.idle),
    );
    reg.register(
        "physical_bytes",
        "Physical bytes of the broker's chunks",
        gauge(snap.physical),
    );
    reg.register("engines", "Connections", gauge(snap.engines.len() as u64));
    let c = &snap.counters;
    let counter = |v: u64| {
        let k = Counter::<u64>::default();
        k.inc_by(v);
        k
    };
    reg.register("grants", "Chunks granted", counter(c.grants));
    reg.register(
        "handovers",
        "Chunks handed over without create",
        counter(c.handovers),
    );
    reg.register(
        "give_backs",
        "Chunks given back by engines",
        counter(c.give_backs),
    );
    reg.register("refusals", "Growths refused", counter(c.refusals));
    reg.register(
        "reclaim_requests",
        "Reclaim requests pushed to engines",
        counter(c.reclaim_requests),
    );
    reg.register(
        "dead_engines",
        "Connections closed with memory held",
        counter(c.dead_engines),
    );
    reg.register("malformed", "Malformed messages", counter(c.malformed));
    reg.register("leases", "Leases armed", counter(c.leases));
    reg.register(
        "leases_held",
        "Leases whose engine ended, their memory held",
        counter(c.leases_held),
    );
    reg.register(
        "reattaches",
        "Held leases an engine attached",
        counter(c.reattaches),
    );
    reg.register(
        "leases_expired",
        "Held leases whose grace period ended",
        counter(c.leases_expired),
    );
    reg.register(
        "attach_refusals",
        "Attaches refused (wrong token or user, busy)",
        counter(c.attach_refusals),
    );
    let driver = Family::<CallLabel, Counter>::default();
    for call in DriverCall::ALL {
        driver
            .get_or_create(&CallLabel { call: call.name() })
            .inc_by(calls.get(call));
    }
    reg.register("driver_calls", "Driver calls by kind", driver);
}

/// The metric families with a series per model (their names start with one of these: the
/// device's and the host tier's).
const PER_MODEL: [&str; 2] = [
    "elastic_vmm_broker_model_",
    "elastic_vmm_broker_host_model_",
];

/// `text` without its per-model families (model names and their bytes, limits, guarantees,
/// refusals): what a loopback port, open to every local user, may show unless the operator
/// opts in. Aggregate numbers (global use and limit, idle and physical bytes, counters, driver
/// calls, grant latency) stay.
pub fn aggregate_only(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for line in text.lines() {
        let name = line
            .strip_prefix("# HELP ")
            .or_else(|| line.strip_prefix("# TYPE "))
            .or_else(|| line.strip_prefix("# UNIT "))
            .unwrap_or(line);
        if !PER_MODEL.iter().any(|p| name.starts_with(p)) {
            out.push_str(line);
            out.push('\n');
        }
    }
    out
}

/// Serve `text()` as Prometheus text on `addr`, which must be a loopback address, on a thread of
/// its own. Every request gets the exposition.
pub fn serve_metrics(
    addr: SocketAddr,
    text: Arc<dyn Fn() -> String + Send + Sync>,
) -> Result<SocketAddr> {
    if !addr.ip().is_loopback() {
        return Err(Error::InvalidArgument(format!(
            "metrics address {addr} is not a loopback address; the broker's metrics stay on this host"
        )));
    }
    let listener = TcpListener::bind(addr).map_err(|e| Error::Ipc {
        op: "bind metrics port",
        detail: format!("{addr}: {e}"),
    })?;
    let bound = listener.local_addr().map_err(|e| Error::Ipc {
        op: "bind metrics port",
        detail: e.to_string(),
    })?;
    std::thread::Builder::new()
        .name("broker-metrics".into())
        .spawn(move || {
            for stream in listener.incoming().flatten() {
                let mut stream = stream;
                let _ = stream.set_read_timeout(Some(Duration::from_secs(2)));
                let _ = stream.set_write_timeout(Some(Duration::from_secs(2)));
                let mut buf = [0u8; 1024];
                let _ = stream.read(&mut buf);
                let body = text();
                let _ = write!(
                    stream,
                    "HTTP/1.0 200 OK\r\nContent-Type: text/plain; version=0.0.4\r\nContent-Length: {}\r\n\r\n{body}",
                    body.len()
                );
            }
        })
        .map_err(|e| Error::Ipc {
            op: "spawn metrics thread",
            detail: e.to_string(),
        })?;
    Ok(bound)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn aggregate_only_drops_every_per_model_family() {
        let text = "# HELP elastic_vmm_broker_model_bytes Bytes per model and state.\n\
# TYPE elastic_vmm_broker_model_bytes gauge\n\
elastic_vmm_broker_model_bytes{model=\"secret\",state=\"charged\"} 5\n\
# HELP elastic_vmm_broker_global_used_bytes Bytes charged in all.\n\
# TYPE elastic_vmm_broker_global_used_bytes gauge\n\
elastic_vmm_broker_global_used_bytes 5\n\
elastic_vmm_broker_model_refusals_total{model=\"secret\"} 1\n\
# EOF\n";
        let out = aggregate_only(text);
        assert!(!out.contains("secret") && !out.contains("model_"), "{out}");
        assert!(
            out.contains("elastic_vmm_broker_global_used_bytes 5\n"),
            "{out}"
        );
        assert!(out.ends_with("# EOF\n"), "{out}");
    }
}
