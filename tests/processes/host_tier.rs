//! The broker's host tier with real engine processes: host chunks the broker makes once and
//! hands between engines as descriptors, engines' sleeps staged through them, a host budget and
//! host limits with the device's rules, memory back when an engine dies, and who may ask. On
//! the host backend (memfd chunks, mapped pinned by the engines) or, with
//! `EVMM_PROCESS_BACKEND=cuda`, on CUDA (VMM host chunks of the device where the driver has
//! them).

use std::io::{BufRead, Write};

use elastic_vmm::broker::protocol::{ErrorKind, Reply, Request, PROTOCOL_VERSION};
use elastic_vmm::broker::{BrokerClient, Snapshot};
use elastic_vmm::{AfterWake, ModelConfig, SleepPolicy};

use super::broker::{
    check_books, raw_hello, raw_reply, raw_request, wait_until, BrokerProc, Script, MIB,
};
use super::common;
use super::security::{require_root, NOBODY};

pub const TESTS: &[(&str, fn())] = &[
    (
        "host_tier::engines_sleep_in_turn_in_the_same_host_chunks",
        engines_sleep_in_turn_in_the_same_host_chunks,
    ),
    (
        "host_tier::a_host_limit_refuses_with_the_numbers",
        a_host_limit_refuses_with_the_numbers,
    ),
    (
        "host_tier::an_engine_killed_asleep_gives_its_host_chunks_back",
        an_engine_killed_asleep_gives_its_host_chunks_back,
    ),
    (
        "host_tier::host_chunks_follow_the_security_rules",
        host_chunks_follow_the_security_rules,
    ),
];

pub fn role(name: &str) -> Option<fn()> {
    match name {
        "engine-host-tier" => Some(engine_host_tier),
        _ => None,
    }
}

/// Each engine's device model holds this much data, staged through the host tier to sleep.
const DATA_MIB: u64 = 4;

/// A broker with a host tier of `host_budget` bytes (and 64 MiB of device budget).
fn broker(tag: &str, host_budget: u64, extra: &[&str]) -> BrokerProc {
    let budget = host_budget.to_string();
    let mut args = vec!["--host-budget", budget.as_str()];
    args.extend_from_slice(extra);
    BrokerProc::start(tag, 64 * MIB, &args)
}

/// An engine process with a device model `name` of [`DATA_MIB`] written data, staging its
/// sleeps through its host tier model `<name>-host` of limit `host_limit`; it says "ready".
fn engine(broker: &BrokerProc, name: &str, host_limit: u64) -> Script {
    let mut s = Script::new(common::spawn_piped(
        "engine-host-tier",
        &[
            ("EVMM_SOCKET", broker.socket.display().to_string()),
            ("EVMM_MODEL", name.to_string()),
            ("EVMM_HOST_LIMIT", host_limit.to_string()),
        ],
    ));
    assert_eq!(s.ask("ready?"), "ready");
    s
}

fn host(control: &BrokerClient) -> Snapshot {
    let s = control.snapshot().unwrap();
    let h = *s.host_tier.expect("the broker has a host tier");
    check_books(&h);
    h
}

fn host_used(h: &Snapshot, model: &str) -> Option<u64> {
    h.models.iter().find(|m| m.name == model).map(|m| m.used)
}

// ---------------------------------------------------------------- tests

/// Engine A sleeps through the broker's host tier (host chunks made for it), wakes and gives
/// them back; engine B, whose sleep the host budget refused while A slept, then sleeps in the
/// very chunks A gave back: no host chunk made for it, every one handed over. Both wake
/// byte-exact; the device books never carry host memory.
fn engines_sleep_in_turn_in_the_same_host_chunks() {
    let budget = 6 * MIB;
    let broker = broker("host-turns", budget, &[]);
    let control = broker.control();
    let mut a = engine(&broker, "a", 16 * MIB);
    let mut b = engine(&broker, "b", 16 * MIB);
    let start = host(&control);
    assert_eq!(
        (
            start.global_limit,
            start.global_used,
            start.counters.creates
        ),
        (budget, 0, 0),
        "{start:?}"
    );
    assert_eq!(a.ask("sleep"), "ok");
    let asleep = host(&control);
    let held = host_used(&asleep, "a-host").unwrap();
    assert!(
        held >= DATA_MIB * MIB,
        "A's copy lives in the tier: {asleep:?}"
    );
    let made = asleep.counters.creates;
    assert!(made >= 1, "{:?}", asleep.counters);
    assert_eq!(asleep.physical, asleep.global_used, "{asleep:?}");
    // The host budget holds one engine's copy: B's sleep is refused, with the numbers, and B
    // stays awake with its data.
    let refused = b.ask("sleep");
    assert!(
        refused.starts_with("refused:")
            && refused.contains("host budget")
            && refused.contains(&budget.to_string()),
        "{refused}"
    );
    assert_eq!(b.ask("asleep"), "false");
    assert_eq!(b.ask("check"), "ok");
    assert_eq!(a.ask("wake"), "ok");
    assert_eq!(a.ask("check"), "ok");
    // A's staging memory stays mapped in A's tier pool as idle memory (it would serve A's
    // next sleep with no driver call); B's sleep gets it through the broker's reclaim: A gives
    // it back when asked, and the chunks are handed to B, none made.
    let woke = host(&control);
    assert_eq!(host_used(&woke, "a-host"), Some(held), "{woke:?}");
    let asked = woke.counters.reclaim_requests;
    assert_eq!(b.ask("sleep"), "ok");
    let b_asleep = host(&control);
    assert!(
        b_asleep.counters.reclaim_requests > asked,
        "B's sleep asked A: {:?}",
        b_asleep.counters
    );
    assert_eq!(host_used(&b_asleep, "a-host"), Some(0), "{b_asleep:?}");
    eprintln!(
        "  host tier after B's sleep: {} made in all, counters {:?}",
        made, b_asleep.counters
    );
    assert_eq!(
        b_asleep.counters.creates, made,
        "B slept in A's host chunks, none made"
    );
    assert!(
        b_asleep.counters.handovers >= made,
        "{:?}",
        b_asleep.counters
    );
    assert!(host_used(&b_asleep, "b-host").unwrap() >= DATA_MIB * MIB);
    assert_eq!(b.ask("wake"), "ok");
    assert_eq!(b.ask("check"), "ok");
    // B gives its woken host memory back to the broker at once (a trim of its tier pool).
    assert_eq!(b.ask("give-back"), "ok");
    assert_eq!(host_used(&host(&control), "b-host"), Some(0));
    // The operator's trim releases the host tier's idle chunks too.
    let idle = host(&control).idle;
    assert!(idle >= DATA_MIB * MIB);
    let trimmed = control.request(Request::Trim).unwrap().0;
    assert!(
        matches!(trimmed, Reply::Trimmed { released } if released >= idle),
        "{trimmed:?}"
    );
    let after = host(&control);
    assert_eq!((after.idle, after.global_used, after.physical), (0, 0, 0));
    // Host memory is the host tier's alone.
    let device = control.snapshot().unwrap();
    check_books(&device);
    assert!(
        device.models.iter().all(|m| !m.name.ends_with("-host")),
        "{:?}",
        device.models
    );
    // Host-tier series in the metrics.
    let Reply::Metrics(text) = control.request(Request::Metrics).unwrap().0 else {
        panic!("metrics")
    };
    assert!(
        text.contains(&format!(
            "elastic_vmm_broker_host_global_limit_bytes {budget}"
        )),
        "{text}"
    );
    a.finish();
    b.finish();
}

/// An engine whose host limit is below what its sleep stages: refused with the host limit's
/// numbers, the engine awake and intact; the operator raises the limit (a control request on
/// the host tier) and the sleep goes through.
fn a_host_limit_refuses_with_the_numbers() {
    let broker = broker("host-limit", 32 * MIB, &[]);
    let control = broker.control();
    let mut c = engine(&broker, "c", 2 * MIB);
    let refused = c.ask("sleep");
    assert!(
        refused.starts_with("refused:")
            && refused.contains("host limit")
            && refused.contains(&format!("limit {}", 2 * MIB)),
        "{refused}"
    );
    assert_eq!(c.ask("asleep"), "false");
    assert_eq!(c.ask("check"), "ok");
    let h = host(&control);
    assert_eq!(host_used(&h, "c-host"), Some(0), "nothing kept: {h:?}");
    let raised = control
        .request(Request::HostTier(Box::new(Request::SetLimit {
            model: "c-host".into(),
            limit: 16 * MIB,
            deadline_ms: 1000,
        })))
        .unwrap()
        .0;
    assert!(
        matches!(&raised, Reply::Changed(o) if o.limit == 16 * MIB),
        "{raised:?}"
    );
    assert_eq!(c.ask("sleep"), "ok");
    assert_eq!(c.ask("wake"), "ok");
    assert_eq!(c.ask("check"), "ok");
    c.finish();
}

/// An engine killed (SIGKILL) while asleep, its copy in host chunks: the broker takes them
/// back (released, the host budget whole again), and another engine sleeps at once.
fn an_engine_killed_asleep_gives_its_host_chunks_back() {
    let broker = broker("host-killed", 6 * MIB, &[]);
    let control = broker.control();
    let mut a = engine(&broker, "a", 16 * MIB);
    assert_eq!(a.ask("sleep"), "ok");
    let asleep = host(&control);
    assert!(host_used(&asleep, "a-host").unwrap() >= DATA_MIB * MIB);
    a.child.kill().unwrap(); // SIGKILL
    assert!(!a.child.wait().unwrap().success());
    wait_until("the dead engine's host chunks to come back", 10, || {
        let h = host(&control);
        let device = control.snapshot().unwrap();
        host_used(&h, "a-host").is_none()
            && h.global_used == 0
            && h.physical == 0
            && device.models.iter().all(|m| m.name != "a")
    });
    let h = host(&control);
    assert!(h.counters.dead_engines >= 1, "{:?}", h.counters);
    assert!(h.counters.chunks_recovered >= 1, "{:?}", h.counters);
    let mut b = engine(&broker, "b", 16 * MIB);
    assert_eq!(b.ask("sleep"), "ok");
    assert_eq!(b.ask("wake"), "ok");
    assert_eq!(b.ask("check"), "ok");
    b.finish();
}

/// Who may ask for host chunks: engines only (a control connection is refused, an operator's
/// limit change is not); an engine acts on its own host models only (another's ids are
/// unknown to it, also to a second user let in with --group, who may not hold host
/// guarantees); a request wrapped twice is malformed and closes that connection; a broker
/// without a host tier says so.
fn host_chunks_follow_the_security_rules() {
    require_root();
    // No host tier: a clear error.
    let plain = BrokerProc::start("host-none", 64 * MIB, &[]);
    let s = raw_hello(&plain.socket, PROTOCOL_VERSION);
    raw_reply(&s).unwrap();
    let r = raw_request(&s, 2, Request::HostTier(Box::new(Request::Snapshot)));
    assert!(
        matches!(&r, Reply::Error { kind: ErrorKind::InvalidArgument, message } if message.contains("no host tier")),
        "{r:?}"
    );
    drop((s, plain));

    let group = NOBODY.to_string();
    let broker = broker("host-rules", 32 * MIB, &["--group", &group]);
    let owner = raw_hello(&broker.socket, PROTOCOL_VERSION);
    raw_reply(&owner).unwrap();
    let host = |r: Request| Request::HostTier(Box::new(r));
    let Reply::Registered { model } = raw_request(
        &owner,
        2,
        host(Request::Register {
            model: "own-host".into(),
            limit: 16 * MIB,
            guarantee: 0,
            priority: 0,
        }),
    ) else {
        panic!("register")
    };
    let Reply::Granted { chunk, .. } = raw_request(
        &owner,
        3,
        host(Request::Grow {
            model,
            size: 2 * MIB,
        }),
    ) else {
        panic!("grow")
    };
    // A control connection holds no memory: refused; its operator's requests work.
    let control = broker.control();
    let r = control
        .request(host(Request::Register {
            model: "ctl-host".into(),
            limit: 16 * MIB,
            guarantee: 0,
            priority: 0,
        }))
        .unwrap()
        .0;
    assert!(
        matches!(
            &r,
            Reply::Error {
                kind: ErrorKind::Forbidden,
                ..
            }
        ),
        "{r:?}"
    );
    // Another engine of the same user: the owner's host model and chunk are unknown to it.
    let other = raw_hello(&broker.socket, PROTOCOL_VERSION);
    raw_reply(&other).unwrap();
    for (id, r) in [
        (
            2,
            host(Request::Grow {
                model,
                size: 2 * MIB,
            }),
        ),
        (3, host(Request::GiveBack { model, chunk })),
        (4, host(Request::Unregister { model })),
    ] {
        let reply = raw_request(&other, id, r);
        assert!(
            matches!(
                &reply,
                Reply::Error {
                    kind: ErrorKind::Unknown,
                    ..
                }
            ),
            "{reply:?}"
        );
    }
    // The host tier's ids are not the device's: a device request with a host model's id is
    // unknown too.
    let reply = raw_request(
        &owner,
        4,
        Request::Grow {
            model,
            size: 2 * MIB,
        },
    );
    assert!(
        matches!(
            &reply,
            Reply::Error {
                kind: ErrorKind::Unknown,
                ..
            }
        ),
        "{reply:?}"
    );
    // A hello inside is refused; a host-tier request inside one is malformed: the connection
    // closes, the broker goes on.
    let reply = raw_request(
        &other,
        5,
        host(Request::Hello {
            version: PROTOCOL_VERSION,
            role: elastic_vmm::broker::protocol::Role::Engine,
            name: "x".into(),
        }),
    );
    assert!(matches!(&reply, Reply::Error { .. }), "{reply:?}");
    let reply = raw_request(&other, 6, host(host(Request::Snapshot)));
    assert!(
        matches!(
            &reply,
            Reply::Error {
                kind: ErrorKind::Malformed,
                ..
            }
        ),
        "{reply:?}"
    );
    assert!(raw_reply(&other).is_none(), "the connection is closed");
    // A second user (uid 65534, let in by --group): its own host models only, no guarantee.
    let mut foreign = Script::new(common::spawn_as(
        "foreign-client",
        &[("EVMM_SOCKET", broker.socket.display().to_string())],
        NOBODY,
        NOBODY,
    ));
    assert_eq!(foreign.ask("hello engine"), "welcome");
    let answer = foreign.ask(&format!("host register g {} {}", 16 * MIB, 2 * MIB));
    assert!(
        answer.contains("error Forbidden") && answer.contains("guarantee"),
        "{answer}"
    );
    let answer = foreign.ask(&format!("host register f {} 0", 16 * MIB));
    let fkey: u64 = answer
        .strip_prefix("registered ")
        .unwrap_or_else(|| panic!("{answer}"))
        .parse()
        .unwrap();
    assert!(foreign
        .ask(&format!("host grow {fkey} {}", 2 * MIB))
        .starts_with("granted"));
    for cmd in [
        format!("host grow {model} {}", 2 * MIB),
        format!("host giveback {model} {chunk}"),
        format!("host unregister {model}"),
    ] {
        let answer = foreign.ask(&cmd);
        assert!(answer.starts_with("error Unknown"), "{cmd}: {answer}");
    }
    // Half the host budget per other user: 16 MiB of 32; it holds 2 MiB.
    let mut refused = None;
    for _ in 0..8 {
        let a = foreign.ask(&format!("host grow {fkey} {}", 2 * MIB));
        if !a.starts_with("granted") {
            refused = Some(a);
            break;
        }
    }
    let refused = refused.expect("a refusal within 16 MiB");
    assert!(refused.contains("error Forbidden"), "{refused}");
    assert_eq!(
        foreign.ask("host snapshot"),
        "models 1 engines 1",
        "it sees its own"
    );
    let h = {
        let s = control.snapshot().unwrap();
        *s.host_tier.unwrap()
    };
    check_books(&h);
    assert_eq!(host_used(&h, "f"), Some(16 * MIB), "{h:?}");
    foreign.finish();
    wait_until("the second user's host chunks to come back", 10, || {
        let s = control.snapshot().unwrap();
        host_used(&s.host_tier.unwrap(), "f").is_none()
    });
    // The owner's connection closes while its process (this one) lives: its host chunk stays
    // charged, orphaned, as device chunks do.
    drop((owner, other));
    wait_until("the owner's host model to be orphaned", 10, || {
        let s = control.snapshot().unwrap();
        let h = s.host_tier.unwrap();
        h.models
            .iter()
            .any(|m| m.name == "own-host" && m.orphaned && m.used == 2 * MIB)
    });
}

// ---------------------------------------------------------------- child roles

fn env_num(name: &str) -> u64 {
    common::var(name)
        .parse()
        .unwrap_or_else(|_| panic!("{name} is not a number"))
}

/// An engine: a device model of [`DATA_MIB`] written data staging its sleeps through a model
/// of the broker's host tier; answers "ready?", "sleep", "wake", "give-back" (trim the tier pool), "check", "asleep" on stdout.
fn engine_host_tier() {
    let name = common::var("EVMM_MODEL");
    let client = BrokerClient::connect(common::var("EVMM_SOCKET"), &format!("engine-{name}"))
        .expect("connect");
    let model = client
        .register(ModelConfig::new(name.clone(), 1 << 30, 32 * MIB))
        .expect("device model");
    let tier = client
        .register_host_tier(ModelConfig::new(
            format!("{name}-host"),
            1 << 30,
            env_num("EVMM_HOST_LIMIT"),
        ))
        .expect("host tier model");
    model
        .stage_through(Some(tier.pool().clone()))
        .expect("stage through the broker's host tier");
    let tag = name.as_bytes()[0];
    let data: Vec<u8> = (0..DATA_MIB * MIB)
        .map(|i| (i as u8).wrapping_mul(tag) ^ (i >> 12) as u8)
        .collect();
    let mut a = model.allocate(data.len()).expect("memory");
    a.write(0, &data).expect("write");
    let mut out = std::io::stdout();
    for line in std::io::stdin().lock().lines() {
        let answer = match line.unwrap().trim() {
            "ready?" => "ready".to_string(),
            "sleep" => match model.sleep(&SleepPolicy::offload_all()) {
                Ok(_) => "ok".into(),
                Err(e) => format!("refused: {e}"),
            },
            "wake" => match model.wake(AfterWake::FreeHostMemory) {
                Ok(_) => "ok".into(),
                Err(e) => format!("error: {e}"),
            },
            "give-back" => match tier.pool().trim() {
                Ok(_) => "ok".into(),
                Err(e) => format!("error: {e}"),
            },
            "check" => {
                let mut back = vec![0u8; data.len()];
                a.read(0, &mut back).expect("read");
                if back == data {
                    "ok".into()
                } else {
                    "mismatch".into()
                }
            }
            "asleep" => model.is_asleep().to_string(),
            other => format!("unknown command {other:?}"),
        };
        writeln!(out, "{answer}").unwrap();
        out.flush().unwrap();
    }
    drop(a);
}
