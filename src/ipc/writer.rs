//! One writer thread per connection: outgoing frames are queued (bounded) and written by it, so
//! no lock is held across a socket write, and a peer that stops reading fills the queue and is
//! then refused instead of blocking its sender.

use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::sync::mpsc::{sync_channel, SyncSender, TrySendError};
use std::thread::JoinHandle;

use super::frame::{ipc_error, send_frame};
use crate::error::Result;

/// A frame waiting to be written: encoded payload and the descriptors to attach (closed once
/// sent).
#[derive(Debug)]
pub struct Outgoing {
    /// Encoded payload.
    pub payload: Vec<u8>,
    /// Descriptors to attach.
    pub fds: Vec<OwnedFd>,
}

/// The sending half of a connection. Cheap to clone; the thread ends when every clone is gone
/// or a write fails (the socket is then shut down, which wakes the reader too).
#[derive(Debug, Clone)]
pub struct FrameWriter {
    queue: SyncSender<Outgoing>,
}

impl FrameWriter {
    /// Start a writer thread for `stream` (a clone of the connection's socket) with room for
    /// `depth` queued frames.
    pub fn spawn(
        stream: UnixStream,
        depth: usize,
        name: &str,
    ) -> Result<(FrameWriter, JoinHandle<()>)> {
        let (queue, rx) = sync_channel::<Outgoing>(depth.max(1));
        let thread = std::thread::Builder::new()
            .name(format!("{name}-writer"))
            .spawn(move || {
                for out in rx {
                    let fds: Vec<_> = out.fds.iter().map(|f| f.as_fd()).collect();
                    if let Err(e) = send_frame(&stream, &out.payload, &fds) {
                        tracing::debug!(error = %e, "connection write failed; shutting it down");
                        let _ = stream.shutdown(std::net::Shutdown::Both);
                        return;
                    }
                }
            })
            .map_err(|e| ipc_error("spawn writer", e.to_string()))?;
        Ok((FrameWriter { queue }, thread))
    }

    /// Queue a frame. Fails when the connection is closed or its queue is full (a peer that
    /// does not read).
    pub fn send(&self, out: Outgoing) -> Result<()> {
        match self.queue.try_send(out) {
            Ok(()) => Ok(()),
            Err(TrySendError::Full(_)) => Err(ipc_error(
                "queue frame",
                "the peer is not reading (send queue full)",
            )),
            Err(TrySendError::Disconnected(_)) => {
                Err(ipc_error("queue frame", "connection closed"))
            }
        }
    }
}
