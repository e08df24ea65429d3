//! Prometheus metrics of the broker (prometheus-client, text exposition): bytes per model and
//! state, refusals, driver calls, grant latency. Served over the socket ([`super::protocol::Request::Metrics`],
//! `elastic-vmm ctl metrics`) and, when asked, on a localhost TCP port.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener};
use std::sync::Arc;
use std::time::Duration;

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
}

impl Metrics {
    pub(crate) fn new() -> Metrics {
        Metrics {
            // 10 µs to ~160 ms.
            grant_seconds: Histogram::new(
                prometheus_client::metrics::histogram::exponential_buckets(1e-5, 2.0, 15),
            ),
        }
    }

    pub(crate) fn observe_grant(&self, d: Duration) {
        self.grant_seconds.observe(d.as_secs_f64());
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
    let refusals = Family::<ModelLabel, Counter>::default();
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
        refusals.get_or_create(&l).inc_by(m.refusals);
    }
    reg.register("model_bytes", "Bytes per model and state", bytes);
    reg.register("model_limit_bytes", "Physical limit per model", limit);
    reg.register("model_guarantee_bytes", "Guarantee per model", guarantee);
    reg.register("model_refusals", "Growths refused per model", refusals);
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
