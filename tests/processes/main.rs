//! Tests with several real processes: this binary spawns itself in other roles.
//!
//! The harness is our own (`harness = false`): `main` either runs one child role (the
//! `EVMM_CHILD_ROLE` variable names it; the parent passes what it needs in other variables) or
//! runs every test whose name contains one of the arguments (all when there is none), one after
//! the other, and fails when any failed.

mod broker;
mod chunks;
mod common;
mod host_tier;
mod lease;
mod p2p;
mod security;

use std::process::ExitCode;

type Test = (&'static str, fn());

fn tests() -> Vec<Test> {
    let mut t: Vec<Test> = Vec::new();
    t.extend(chunks::TESTS);
    t.extend(broker::TESTS);
    t.extend(security::TESTS);
    t.extend(p2p::TESTS);
    t.extend(host_tier::TESTS);
    t.extend(lease::TESTS);
    t
}

fn main() -> ExitCode {
    if let Ok(role) = std::env::var(common::ROLE_VAR) {
        return common::run_child(&role);
    }
    let filters: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| !a.starts_with('-'))
        .collect();
    let mut failed = Vec::new();
    let mut ran = 0;
    for (name, f) in tests() {
        if !filters.is_empty() && !filters.iter().any(|p| name.contains(p.as_str())) {
            continue;
        }
        ran += 1;
        eprintln!("test {name} ...");
        let start = std::time::Instant::now();
        match std::panic::catch_unwind(f) {
            Ok(()) => eprintln!("test {name} ... ok ({:.2?})", start.elapsed()),
            Err(_) => {
                eprintln!("test {name} ... FAILED");
                failed.push(name);
            }
        }
    }
    eprintln!(
        "\n{ran} process tests run, {} failed{}",
        failed.len(),
        if failed.is_empty() {
            String::new()
        } else {
            format!(": {failed:?}")
        }
    );
    if failed.is_empty() {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}
