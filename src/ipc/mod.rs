//! Messages between processes over a Unix stream socket, with file descriptors attached.
//!
//! This is how physical chunks travel between processes (the broker and its engines, or two
//! engines handing KV blocks to each other): a chunk is exported as a POSIX descriptor
//! ([`crate::Backend::export_chunk`]), attached to a frame with `SCM_RIGHTS`, and imported on the
//! other side ([`crate::Backend::import_chunk`]).
//!
//! - [`frame`]: one frame = a 5-byte header (payload length, little-endian `u32`, then the number
//!   of descriptors attached, `u8`), then the payload. Frames are bounded ([`MAX_FRAME`] bytes,
//!   [`MAX_FDS`] descriptors); a frame over the bound, a header announcing more descriptors than
//!   arrived, or a stream cut mid-frame is an error, never a panic and never an allocation of
//!   the announced size.
//! - [`codec`]: typed messages encoded with `postcard` (serde), bounded the same way, trailing
//!   bytes refused.
//! - [`writer`]: a connection's outgoing frames go through one writer thread with a bounded
//!   queue, so no lock is ever held across a socket write and a peer that stops reading cannot
//!   block the sender.
//! - [`peer`]: the peer's credentials (`SO_PEERCRED`) and process (a pidfd).
//! - [`socket_dir`]: a listening socket's folder, lock file and path, checked private before
//!   anything is made there.

pub mod codec;
pub mod frame;
pub mod peer;
pub mod socket_dir;
pub mod writer;

pub use codec::{decode, encode};
pub use frame::{
    is_disconnect, recv_frame, send_frame, Frame, PartialFrame, DISCONNECTED, MAX_FDS, MAX_FRAME,
};
pub use peer::{peer_credentials, peer_pidfd, process_exited, PeerCredentials};
pub use socket_dir::SocketDir;
pub use writer::{FrameWriter, Outgoing};

/// Raise the soft descriptor limit to the hard one: every chunk is a descriptor.
pub(crate) fn raise_fd_limit() {
    let lim = rustix::process::getrlimit(rustix::process::Resource::Nofile);
    if lim.current < lim.maximum {
        let _ = rustix::process::setrlimit(
            rustix::process::Resource::Nofile,
            rustix::process::Rlimit {
                current: lim.maximum,
                maximum: lim.maximum,
            },
        );
    }
}
