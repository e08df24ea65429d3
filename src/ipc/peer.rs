//! Who is at the other end of a Unix socket.

use std::os::fd::{AsFd, AsRawFd, FromRawFd, OwnedFd};

use serde::{Deserialize, Serialize};

use super::frame::ipc_error;
use crate::error::Result;

/// The peer's process, user and group as the kernel recorded them at `connect` (`SO_PEERCRED`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct PeerCredentials {
    /// Process id.
    pub pid: i32,
    /// User id.
    pub uid: u32,
    /// Group id.
    pub gid: u32,
}

/// The credentials of the process connected to `socket`.
pub fn peer_credentials(socket: impl AsFd) -> Result<PeerCredentials> {
    let c = rustix::net::sockopt::socket_peercred(socket)
        .map_err(|e| ipc_error("SO_PEERCRED", e.to_string()))?;
    Ok(PeerCredentials {
        pid: c.pid.as_raw_nonzero().get(),
        uid: c.uid.as_raw(),
        gid: c.gid.as_raw(),
    })
}

/// `SO_PEERPIDFD` (Linux 6.5): a pidfd of the peer's process, taken by the kernel at connect.
const SO_PEERPIDFD: libc::c_int = 77;

/// A descriptor naming the process at the other end of `socket` (a pidfd): `SO_PEERPIDFD` where
/// the kernel has it, else `pidfd_open` on the `SO_PEERCRED` pid (that fallback names the wrong
/// process only if the peer died and its pid was reused before this call). `None` when neither
/// works (no pidfd support, or the peer's pid is not visible in this pid namespace).
pub fn peer_pidfd(socket: impl AsFd, pid: i32) -> Option<OwnedFd> {
    let fd = socket.as_fd();
    let mut raw: libc::c_int = -1;
    let mut len = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
    // SAFETY: `fd` is a live socket for the call; `raw` and `len` are valid for writes of the
    // sizes given; on success the kernel stored a new descriptor in `raw`, owned from here on.
    let got = unsafe {
        libc::getsockopt(
            fd.as_raw_fd(),
            libc::SOL_SOCKET,
            SO_PEERPIDFD,
            (&mut raw as *mut libc::c_int).cast(),
            &mut len,
        )
    };
    if got == 0 && raw >= 0 {
        // SAFETY: `raw` is a descriptor the kernel just gave this process; nothing else owns it.
        return Some(unsafe { OwnedFd::from_raw_fd(raw) });
    }
    let pid = rustix::process::Pid::from_raw(pid)?;
    rustix::process::pidfd_open(pid, rustix::process::PidfdFlags::empty()).ok()
}

/// Whether the process `pidfd` names has exited (a pidfd turns readable then), waiting up to
/// `wait` (at most a second) for it.
pub fn process_exited(pidfd: impl AsFd, wait: std::time::Duration) -> bool {
    let mut fds = [rustix::event::PollFd::new(
        &pidfd,
        rustix::event::PollFlags::IN,
    )];
    let wait = wait.min(std::time::Duration::from_secs(1));
    let timeout = rustix::event::Timespec {
        tv_sec: wait.as_secs() as i64,
        tv_nsec: i64::from(wait.subsec_nanos()),
    };
    matches!(rustix::event::poll(&mut fds, Some(&timeout)), Ok(n) if n > 0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_peer_pidfd_says_when_its_process_exits() {
        let (a, _b) = std::os::unix::net::UnixStream::pair().unwrap();
        let me = peer_pidfd(&a, std::process::id() as i32).expect("a pidfd of this process");
        assert!(!process_exited(&me, std::time::Duration::ZERO));
        let mut child = std::process::Command::new("sleep")
            .arg("0.05")
            .spawn()
            .unwrap();
        let pidfd = rustix::process::pidfd_open(
            rustix::process::Pid::from_child(&child),
            rustix::process::PidfdFlags::empty(),
        )
        .unwrap();
        assert!(!process_exited(&pidfd, std::time::Duration::ZERO));
        // Waited for: the exit is seen within the wait, before the child is reaped.
        assert!(process_exited(&pidfd, std::time::Duration::from_secs(1)));
        child.wait().unwrap();
        assert!(process_exited(&pidfd, std::time::Duration::ZERO));
    }

    #[test]
    fn a_socket_pair_sees_this_process() {
        let (a, _b) = std::os::unix::net::UnixStream::pair().unwrap();
        let c = peer_credentials(&a).unwrap();
        assert_eq!(c.pid, std::process::id() as i32);
        assert_eq!(c.uid, rustix::process::getuid().as_raw());
    }
}
