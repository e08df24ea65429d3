//! Who is at the other end of a Unix socket.

use std::os::fd::AsFd;

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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_socket_pair_sees_this_process() {
        let (a, _b) = std::os::unix::net::UnixStream::pair().unwrap();
        let c = peer_credentials(&a).unwrap();
        assert_eq!(c.pid, std::process::id() as i32);
        assert_eq!(c.uid, rustix::process::getuid().as_raw());
    }
}
