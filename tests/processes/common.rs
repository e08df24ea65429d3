//! Spawning this test binary in a child role, and the roles' dispatch.

use std::path::PathBuf;
use std::process::{Child, Command, ExitCode, Stdio};

/// The variable naming a child's role.
pub const ROLE_VAR: &str = "EVMM_CHILD_ROLE";

/// Spawn this binary as `role`, with `vars` set.
pub fn spawn(role: &str, vars: &[(&str, String)]) -> Child {
    let exe = std::env::current_exe().expect("current_exe");
    let mut cmd = Command::new(exe);
    cmd.env(ROLE_VAR, role).stdin(Stdio::null());
    for (k, v) in vars {
        cmd.env(k, v);
    }
    cmd.spawn().expect("spawn child process")
}

/// Spawn this binary as `role` under another user and group (the tests run as root; the child
/// drops to `uid`/`gid` before it runs, with no supplementary groups), stdin and stdout piped.
pub fn spawn_as(role: &str, vars: &[(&str, String)], uid: u32, gid: u32) -> Child {
    use std::os::unix::process::CommandExt;
    let exe = std::env::current_exe().expect("current_exe");
    let mut cmd = Command::new(exe);
    cmd.env(ROLE_VAR, role)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .uid(uid)
        .gid(gid);
    for (k, v) in vars {
        cmd.env(k, v);
    }
    cmd.spawn().expect("spawn child process under another user")
}

/// Spawn this binary as `role` with stdin and stdout piped (the parent drives it line by line).
pub fn spawn_piped(role: &str, vars: &[(&str, String)]) -> Child {
    let exe = std::env::current_exe().expect("current_exe");
    let mut cmd = Command::new(exe);
    cmd.env(ROLE_VAR, role)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped());
    for (k, v) in vars {
        cmd.env(k, v);
    }
    cmd.spawn().expect("spawn child process")
}

/// The backend the broker tests run on: `EVMM_PROCESS_BACKEND` (`host`, the default, or
/// `cuda` on a GPU machine, where the same tests run with CUDA chunks).
pub fn backend_kind() -> String {
    std::env::var("EVMM_PROCESS_BACKEND").unwrap_or_else(|_| "host".into())
}

/// Whether the broker tests run on CUDA.
pub fn on_cuda() -> bool {
    backend_kind() == "cuda"
}

/// A variable the parent set for a child.
pub fn var(name: &str) -> String {
    std::env::var(name).unwrap_or_else(|_| panic!("child needs {name}"))
}

/// A fresh temporary folder for sockets (private: mode 0700, as a broker's socket folder must
/// be), removed by the caller (or left in /tmp).
pub fn temp_dir(tag: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!(
        "evmm-{tag}-{}-{}",
        std::process::id(),
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_nanos()
    ));
    std::fs::create_dir_all(&d).unwrap();
    std::fs::set_permissions(&d, std::os::unix::fs::PermissionsExt::from_mode(0o700)).unwrap();
    d
}

/// Wait for a child with a deadline; kill it on overrun. Returns its exit status.
pub fn wait_for(mut child: Child, secs: u64) -> std::process::ExitStatus {
    let end = std::time::Instant::now() + std::time::Duration::from_secs(secs);
    loop {
        if let Some(st) = child.try_wait().unwrap() {
            return st;
        }
        if std::time::Instant::now() > end {
            let _ = child.kill();
            let _ = child.wait();
            panic!("child {} did not finish within {secs} s", child.id());
        }
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
}

/// Run a child role; its panics become a failing exit status.
pub fn run_child(role: &str) -> ExitCode {
    let f: fn() = match super::chunks::role(role)
        .or_else(|| super::broker::role(role))
        .or_else(|| super::security::role(role))
        .or_else(|| super::p2p::role(role))
        .or_else(|| super::host_tier::role(role))
        .or_else(|| super::lease::role(role))
    {
        Some(f) => f,
        None => {
            eprintln!("unknown child role {role:?}");
            return ExitCode::from(2);
        }
    };
    match std::panic::catch_unwind(f) {
        Ok(()) => ExitCode::SUCCESS,
        Err(_) => ExitCode::FAILURE,
    }
}

/// A child killed (SIGKILL) and reaped when dropped, so a failing test leaves no process behind.
pub struct KillOnDrop(pub Child);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}
