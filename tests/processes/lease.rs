//! Leases with real processes: an engine keeps a region of a model and dies (SIGKILL), or exits
//! keeping it; a new engine process attaches with the token and finds the bytes; wrong and used
//! tokens, another user, expiry, a race and a clean exit each get their answer. Runs on the
//! host backend (memfd chunks), or on CUDA chunks with `EVMM_PROCESS_BACKEND=cuda`.

use std::io::{BufRead, Write};

use elastic_vmm::broker::protocol::LeaseState;
use elastic_vmm::broker::{BrokerClient, LeaseToken, ModelInfo, Snapshot};
use elastic_vmm::{MemOptions, ModelConfig, Tag};

use super::broker::{check_books, wait_until, BrokerProc, Script, MIB};
use super::common;
use super::security::{require_root, NOBODY};

pub const TESTS: &[(&str, fn())] = &[
    (
        "lease::a_killed_engine_is_reattached_with_its_bytes",
        a_killed_engine_is_reattached_with_its_bytes,
    ),
    (
        "lease::an_engine_exits_keeping_and_the_next_takes_over",
        an_engine_exits_keeping_and_the_next_takes_over,
    ),
    (
        "lease::an_unattached_lease_expires",
        an_unattached_lease_expires,
    ),
    (
        "lease::two_engines_race_for_one_lease",
        two_engines_race_for_one_lease,
    ),
    (
        "lease::a_clean_exit_ends_the_lease",
        a_clean_exit_ends_the_lease,
    ),
    (
        "lease::a_second_user_cannot_attach",
        a_second_user_cannot_attach,
    ),
    (
        "lease::a_kept_region_unmapped_is_no_longer_kept",
        a_kept_region_unmapped_is_no_longer_kept,
    ),
    (
        "lease::a_failed_attach_leaves_the_lease_held",
        a_failed_attach_leaves_the_lease_held,
    ),
];

pub fn role(name: &str) -> Option<fn()> {
    match name {
        "engine-lease" => Some(engine_lease),
        "engine-attach" => Some(engine_attach),
        _ => None,
    }
}

/// The kept region, and the memory beside it that is not kept.
const KEPT: u64 = 64 * MIB;
const UNKEPT: u64 = 32 * MIB;

/// The model's config; `EVMM_CAPACITY` overrides its address space (too small, an attach
/// fails in the engine).
fn model_config() -> ModelConfig {
    let capacity = std::env::var("EVMM_CAPACITY").map_or(4 << 30, |c| c.parse().unwrap());
    ModelConfig::new("llama", capacity, 256 * MIB)
}

fn connect() -> BrokerClient {
    let socket = common::var("EVMM_SOCKET");
    match std::env::var("EVMM_TRUST_UID") {
        Ok(uid) => BrokerClient::connect_trusting(socket, "lease", uid.parse().unwrap()),
        Err(_) => BrokerClient::connect(socket, "lease"),
    }
    .unwrap()
}

fn say(line: &str) {
    println!("{line}");
    std::io::stdout().flush().unwrap();
}

/// The model's region of `tag` filled with `byte` (or checked to hold it).
fn fill(model: &elastic_vmm::broker::RemoteModel, region: &elastic_vmm::Region, byte: u8) {
    let data = vec![byte; region.len() as usize];
    // SAFETY: the whole region is mapped (with access) by this process, and nothing else in it
    // uses it.
    unsafe {
        model
            .backend()
            .copies()
            .write(region.addr(), &data)
            .unwrap()
    };
}

fn holds(model: &elastic_vmm::broker::RemoteModel, region: &elastic_vmm::Region, byte: u8) -> bool {
    let mut data = vec![0u8; region.len() as usize];
    // SAFETY: as for `fill`; mapped by the attach.
    unsafe {
        model
            .backend()
            .copies()
            .read(region.addr(), &mut data)
            .unwrap()
    };
    data.iter().all(|&b| b == byte)
}

/// Then obey stdin: `exit` drops everything (ends the lease), `exit-keep` exits keeping it;
/// a closed stdin exits keeping it too (as a crash would); `drop-kept` drops the first region
/// (its chunks go to the pool's cache, still the model's) and maps a fresh one over them.
fn obey(model: elastic_vmm::broker::RemoteModel, mut keep: Vec<elastic_vmm::Region>) {
    for line in std::io::stdin().lock().lines() {
        match line.unwrap().trim() {
            "drop-kept" => {
                drop(keep.remove(0));
                let other = model.reserve_region(KEPT).unwrap();
                other.map(0, KEPT).unwrap();
                fill(&model, &other, 0xee);
                keep.push(other);
                say("ok");
            }
            "exit" => {
                drop(keep);
                drop(model);
                say("bye");
                return;
            }
            "exit-keep" => break,
            other => say(&format!("unknown command {other:?}")),
        }
    }
    model.keep_on_exit();
    drop(keep);
    drop(model);
    say("bye");
}

/// Registers `llama`, leases it, fills a kept region with `EVMM_BYTE` and an unkept one beside
/// it, stores a blob, prints `token <hex>`, then obeys stdin.
fn engine_lease() {
    let client = connect();
    let model = client.register(model_config()).unwrap();
    let lease = model.lease().unwrap();
    let byte: u8 = common::var("EVMM_BYTE").parse().unwrap();
    let weights = model
        .reserve_region_with(KEPT, &MemOptions::new().tag(Tag::Weights).chunk(8 * MIB))
        .unwrap();
    weights.map(0, KEPT).unwrap();
    fill(&model, &weights, byte);
    let scratch = model.reserve_region(UNKEPT).unwrap();
    scratch.map(0, UNKEPT).unwrap();
    model.keep(&weights).unwrap();
    model.store_blob(format!("blob-{byte}").as_bytes()).unwrap();
    say(&format!("token {}", lease.token));
    obey(model, vec![weights, scratch]);
}

/// Waits for a line `go`, attaches `llama` with `EVMM_TOKEN`, prints `ok <blob> <new token>`
/// when the kept region holds `EVMM_BYTE` (`bytes differ` otherwise) or `refused <kind>`, then
/// obeys stdin.
fn engine_attach() {
    let client = connect();
    let token: LeaseToken = common::var("EVMM_TOKEN").parse().unwrap();
    let byte: u8 = common::var("EVMM_BYTE").parse().unwrap();
    let mut go = String::new();
    std::io::stdin().lock().read_line(&mut go).unwrap();
    match client.attach(model_config(), &token) {
        Ok(back) => {
            match back.region(&Tag::Weights) {
                Some(w) if back.regions.len() == 1 && w.len() == KEPT => {
                    if holds(&back.model, w, byte) {
                        say(&format!(
                            "ok {} {}",
                            String::from_utf8_lossy(&back.blob),
                            back.lease.token
                        ));
                    } else {
                        say("bytes differ");
                    }
                }
                _ => say(&format!("regions {back:?}")),
            }
            obey(back.model, back.regions);
        }
        Err(e) => {
            let kind = match &e {
                elastic_vmm::Error::Broker { kind, .. } => kind.clone(),
                other => format!("{other}"),
            };
            say(&format!("refused {kind}: {e}"));
            for _ in std::io::stdin().lock().lines() {}
        }
    }
}

fn llama(s: &Snapshot) -> Option<&ModelInfo> {
    s.models.iter().find(|m| m.name == "llama")
}

fn lease_state(s: &Snapshot) -> Option<LeaseState> {
    llama(s).and_then(|m| m.lease.as_ref()).map(|l| l.state)
}

/// An engine that kept `KEPT` bytes filled with `byte`, and its token.
fn leasing_engine(broker: &BrokerProc, byte: u8) -> (Script, String) {
    let mut engine = Script::new(common::spawn_piped(
        "engine-lease",
        &[
            ("EVMM_SOCKET", broker.socket.display().to_string()),
            ("EVMM_BYTE", byte.to_string()),
        ],
    ));
    let mut line = String::new();
    engine.stdout.read_line(&mut line).unwrap();
    let token = line
        .trim()
        .strip_prefix("token ")
        .unwrap_or_else(|| panic!("the engine said {line:?}"))
        .to_string();
    (engine, token)
}

/// An attaching engine, waiting for `go`.
fn attacher(broker: &BrokerProc, token: &str, byte: u8, uid: Option<u32>) -> Script {
    let mut vars = vec![
        ("EVMM_SOCKET", broker.socket.display().to_string()),
        ("EVMM_TOKEN", token.to_string()),
        ("EVMM_BYTE", byte.to_string()),
    ];
    Script::new(match uid {
        Some(uid) => {
            vars.push(("EVMM_TRUST_UID", "0".into()));
            common::spawn_as("engine-attach", &vars, uid, uid)
        }
        None => common::spawn_piped("engine-attach", &vars),
    })
}

/// Waits until the lease is held: the engine's process is gone, what was not kept is back.
fn wait_held(control: &BrokerClient) -> Snapshot {
    wait_until("the lease to hold", 20, || {
        lease_state(&control.snapshot().unwrap()) == Some(LeaseState::Held)
    });
    let s = control.snapshot().unwrap();
    check_books(&s);
    s
}

fn a_killed_engine_is_reattached_with_its_bytes() {
    let broker = BrokerProc::start("lease-kill", 512 * MIB, &[]);
    let control = broker.control();
    let (mut engine, token) = leasing_engine(&broker, 0x5a);
    let s = control.snapshot().unwrap();
    assert_eq!(lease_state(&s), Some(LeaseState::Armed));
    assert!(llama(&s).unwrap().used >= KEPT + UNKEPT);
    engine.child.kill().unwrap(); // SIGKILL
    let _ = engine.child.wait();
    let s = wait_held(&control);
    let m = llama(&s).unwrap();
    let lease = m.lease.as_ref().unwrap();
    assert_eq!(
        (m.used, lease.kept, lease.regions),
        (KEPT, KEPT, 1),
        "{m:?}"
    );
    assert!(
        lease.expires_in_ms.is_some_and(|ms| ms > 200_000),
        "{lease:?}"
    );
    assert_eq!(s.global_used, KEPT + s.idle, "what was not kept came back");
    // A wrong token, then the right one.
    let wrong = LeaseToken([7; 32]).to_string();
    let mut bad = attacher(&broker, &wrong, 0x5a, None);
    let answer = bad.ask("go");
    assert!(answer.starts_with("refused Forbidden"), "{answer}");
    let mut next = attacher(&broker, &token, 0x5a, None);
    let answer = next.ask("go");
    let new_token = answer
        .strip_prefix("ok blob-90 ")
        .unwrap_or_else(|| panic!("attach answered {answer:?}"))
        .to_string();
    assert_ne!(new_token, token, "a new token for the next engine");
    let s = control.snapshot().unwrap();
    check_books(&s);
    assert_eq!(lease_state(&s), Some(LeaseState::Armed));
    assert_eq!((s.counters.reattaches, s.counters.attach_refusals), (1, 1));
    // The token was used: void, even once this engine is gone too.
    assert_eq!(next.ask("exit-keep"), "bye");
    next.finish();
    wait_held(&control);
    let mut reuse = attacher(&broker, &token, 0x5a, None);
    let answer = reuse.ask("go");
    assert!(answer.starts_with("refused Forbidden"), "{answer}");
    reuse.finish();
    bad.finish();
    eprintln!("  {:?}", control.snapshot().unwrap().counters);
}

fn an_engine_exits_keeping_and_the_next_takes_over() {
    let broker = BrokerProc::start("lease-exit", 512 * MIB, &[]);
    let control = broker.control();
    let (mut engine, token) = leasing_engine(&broker, 0x33);
    assert_eq!(engine.ask("exit-keep"), "bye");
    engine.finish();
    let s = wait_held(&control);
    assert_eq!(llama(&s).unwrap().used, KEPT);
    // A new model of that name is refused while the lease holds it.
    let other = BrokerClient::connect(&broker.socket, "other").unwrap();
    let e = other.register(model_config()).unwrap_err().to_string();
    assert!(e.contains("lease"), "{e}");
    let mut next = attacher(&broker, &token, 0x33, None);
    let answer = next.ask("go");
    assert!(answer.starts_with("ok blob-51 "), "{answer}");
    assert_eq!(next.ask("exit"), "bye");
    next.finish();
    wait_until("the model to go with its engine's clean exit", 10, || {
        let s = control.snapshot().unwrap();
        eprintln!("{:?} {:?}", llama(&s), s.counters);
        llama(&s).is_none()
    });
    check_books(&control.snapshot().unwrap());
}

fn an_unattached_lease_expires() {
    let broker = BrokerProc::start("lease-expire", 512 * MIB, &["--lease-grace-ms", "400"]);
    let control = broker.control();
    let (mut engine, token) = leasing_engine(&broker, 1);
    engine.child.kill().unwrap();
    let _ = engine.child.wait();
    wait_until("the lease to expire", 20, || {
        let s = control.snapshot().unwrap();
        llama(&s).is_none() && s.global_used == s.idle
    });
    let s = control.snapshot().unwrap();
    check_books(&s);
    assert_eq!(s.counters.leases_expired, 1);
    let mut late = attacher(&broker, &token, 1, None);
    let answer = late.ask("go");
    assert!(answer.starts_with("refused Unknown"), "{answer}");
    late.finish();
}

fn two_engines_race_for_one_lease() {
    let broker = BrokerProc::start("lease-race", 512 * MIB, &[]);
    let control = broker.control();
    for round in 0..3u8 {
        let (mut engine, token) = leasing_engine(&broker, 10 + round);
        engine.child.kill().unwrap();
        let _ = engine.child.wait();
        wait_held(&control);
        let mut a = attacher(&broker, &token, 10 + round, None);
        let mut b = attacher(&broker, &token, 10 + round, None);
        for s in [&mut a, &mut b] {
            writeln!(s.stdin, "go").unwrap();
            s.stdin.flush().unwrap();
        }
        let answers: Vec<String> = [&mut a, &mut b]
            .into_iter()
            .map(|s| {
                let mut l = String::new();
                s.stdout.read_line(&mut l).unwrap();
                l.trim().to_string()
            })
            .collect();
        let won = answers.iter().filter(|a| a.starts_with("ok ")).count();
        assert_eq!(won, 1, "round {round}: {answers:?}");
        assert!(
            answers
                .iter()
                .any(|a| a.starts_with("refused Busy") || a.starts_with("refused Forbidden")),
            "{answers:?}"
        );
        for mut s in [a, b] {
            writeln!(s.stdin, "exit").unwrap();
            s.stdin.flush().unwrap();
            drop(s.stdin);
            assert!(common::wait_for(s.child, 30).success());
        }
        wait_until("the model to go", 10, || {
            llama(&control.snapshot().unwrap()).is_none()
        });
        check_books(&control.snapshot().unwrap());
    }
}

fn a_clean_exit_ends_the_lease() {
    let broker = BrokerProc::start("lease-clean", 512 * MIB, &[]);
    let control = broker.control();
    let (mut engine, token) = leasing_engine(&broker, 2);
    assert_eq!(engine.ask("exit"), "bye");
    engine.finish();
    wait_until("the model to go", 10, || {
        let s = control.snapshot().unwrap();
        llama(&s).is_none() && s.global_used == s.idle
    });
    let mut late = attacher(&broker, &token, 2, None);
    assert!(late.ask("go").starts_with("refused Unknown"));
    late.finish();
    assert_eq!(control.snapshot().unwrap().counters.leases_held, 0);
}

/// Another user (uid 65534, let in by `--group`) presenting the right token is answered as if
/// there were no lease; the owner attaches afterwards.
fn a_second_user_cannot_attach() {
    require_root();
    let group = NOBODY.to_string();
    let broker = BrokerProc::start("lease-user", 512 * MIB, &["--group", &group]);
    let control = broker.control();
    let (mut engine, token) = leasing_engine(&broker, 3);
    engine.child.kill().unwrap();
    let _ = engine.child.wait();
    wait_held(&control);
    let mut foreign = attacher(&broker, &token, 3, Some(NOBODY));
    let answer = foreign.ask("go");
    assert!(answer.starts_with("refused Unknown"), "{answer}");
    assert!(
        !answer.contains("Busy") && !answer.contains("token"),
        "{answer}"
    );
    foreign.finish();
    let mut owner = attacher(&broker, &token, 3, None);
    assert!(owner.ask("go").starts_with("ok blob-3 "));
    assert_eq!(owner.ask("exit"), "bye");
    owner.finish();
}

/// A kept region unmapped (its chunks cached in the pool, still the model's, then mapped
/// elsewhere with other bytes) is forgotten by the broker before the engine dies: the lease
/// holds nothing that would come back as the old bytes.
fn a_kept_region_unmapped_is_no_longer_kept() {
    let broker = BrokerProc::start("lease-unmap", 512 * MIB, &[]);
    let control = broker.control();
    let (mut engine, token) = leasing_engine(&broker, 4);
    assert_eq!(engine.ask("drop-kept"), "ok");
    engine.child.kill().unwrap();
    let _ = engine.child.wait();
    let s = wait_held(&control);
    let lease = llama(&s).unwrap().lease.clone().unwrap();
    assert_eq!((lease.regions, lease.kept), (0, 0), "{lease:?}");
    assert_eq!(s.global_used, s.idle, "nothing kept, nothing charged");
    let mut next = attacher(&broker, &token, 4, None);
    let answer = next.ask("go");
    assert!(
        answer.starts_with("regions "),
        "no region comes back: {answer}"
    );
    assert_eq!(next.ask("exit"), "bye");
    next.finish();
}

/// An attach that fails in the engine (its address space too small for the kept region) gives
/// the model back to the lease, held under the same token: a proper engine attaches next.
fn a_failed_attach_leaves_the_lease_held() {
    let broker = BrokerProc::start("lease-fail", 512 * MIB, &[]);
    let control = broker.control();
    let (mut engine, token) = leasing_engine(&broker, 5);
    engine.child.kill().unwrap();
    let _ = engine.child.wait();
    wait_held(&control);
    let mut small = Script::new(common::spawn_piped(
        "engine-attach",
        &[
            ("EVMM_SOCKET", broker.socket.display().to_string()),
            ("EVMM_TOKEN", token.clone()),
            ("EVMM_BYTE", "5".into()),
            ("EVMM_CAPACITY", (16 * MIB).to_string()),
        ],
    ));
    let answer = small.ask("go");
    assert!(answer.starts_with("refused "), "{answer}");
    let s = wait_held(&control);
    assert_eq!(llama(&s).unwrap().lease.as_ref().unwrap().kept, KEPT);
    small.finish();
    let mut next = attacher(&broker, &token, 5, None);
    let answer = next.ask("go");
    assert!(answer.starts_with("ok blob-5 "), "{answer}");
    assert_eq!(next.ask("exit"), "bye");
    next.finish();
    check_books(&control.snapshot().unwrap());
}
