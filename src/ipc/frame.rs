//! Framing over a Unix stream socket, with descriptors attached through `SCM_RIGHTS`.

use std::io::{IoSlice, IoSliceMut};
use std::mem::MaybeUninit;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};

use rustix::io::Errno;
use rustix::net::{
    recvmsg, sendmsg, RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags, ReturnFlags,
    SendAncillaryBuffer, SendAncillaryMessage, SendFlags,
};

use crate::error::{Error, Result};

/// Largest payload of one frame, in bytes.
pub const MAX_FRAME: usize = 64 * 1024;
/// Most descriptors attached to one frame.
pub const MAX_FDS: usize = 16;
/// Header: payload length (`u32`, little-endian), descriptor count (`u8`).
pub const HEADER: usize = 5;

/// A frame received: its payload and the descriptors that came with it.
#[derive(Debug)]
pub struct Frame {
    /// The payload bytes.
    pub payload: Vec<u8>,
    /// Descriptors attached to the frame, in the order they were sent.
    pub fds: Vec<OwnedFd>,
}

pub(crate) fn ipc_error(op: &'static str, detail: impl Into<String>) -> Error {
    Error::Ipc {
        op,
        detail: detail.into(),
    }
}

/// The `op` of errors that mean the peer went away (closed, reset, killed), as opposed to a
/// peer that sent something wrong: see [`is_disconnect`].
pub const DISCONNECTED: &str = "peer disconnected";

/// Whether `e` says the peer went away (the connection closed or was reset, even mid-frame)
/// rather than sent something malformed.
pub fn is_disconnect(e: &Error) -> bool {
    matches!(e, Error::Ipc { op, .. } if *op == DISCONNECTED)
}

fn errno_error(op: &'static str, e: Errno) -> Error {
    if e == Errno::AGAIN {
        return ipc_error(op, "timed out (EAGAIN)");
    }
    if e == Errno::CONNRESET || e == Errno::PIPE {
        return ipc_error(DISCONNECTED, format!("{op}: {e}"));
    }
    ipc_error(op, format!("{} ({})", e, e.raw_os_error()))
}

/// Send one frame: `payload` (at most [`MAX_FRAME`] bytes) with `fds` (at most [`MAX_FDS`])
/// attached. Blocks until the whole frame is written (or the socket's send timeout fires).
pub fn send_frame(socket: impl AsFd, payload: &[u8], fds: &[BorrowedFd<'_>]) -> Result<()> {
    let socket = socket.as_fd();
    if payload.is_empty() || payload.len() > MAX_FRAME {
        return Err(ipc_error(
            "send frame",
            format!(
                "payload of {} bytes (1 to {MAX_FRAME} allowed)",
                payload.len()
            ),
        ));
    }
    if fds.len() > MAX_FDS {
        return Err(ipc_error(
            "send frame",
            format!("{} descriptors attached ({MAX_FDS} allowed)", fds.len()),
        ));
    }
    let mut header = [0u8; HEADER];
    header[..4].copy_from_slice(&(payload.len() as u32).to_le_bytes());
    header[4] = fds.len() as u8;
    let total = HEADER + payload.len();
    let mut sent = 0usize;
    let mut space = [MaybeUninit::<u8>::uninit(); rustix::cmsg_space!(ScmRights(MAX_FDS))];
    while sent < total {
        let (h, p) = if sent < HEADER {
            (&header[sent..], payload)
        } else {
            (&header[..0], &payload[sent - HEADER..])
        };
        let iov = [IoSlice::new(h), IoSlice::new(p)];
        let mut control = SendAncillaryBuffer::new(&mut space);
        // The descriptors ride with the first bytes of the frame, exactly once.
        if sent == 0 && !fds.is_empty() && !control.push(SendAncillaryMessage::ScmRights(fds)) {
            return Err(ipc_error("send frame", "control buffer too small"));
        }
        match sendmsg(socket, &iov, &mut control, SendFlags::NOSIGNAL) {
            Ok(0) => return Err(ipc_error("send frame", "peer closed the connection")),
            Ok(n) => sent += n,
            Err(Errno::INTR) => continue,
            Err(e) => return Err(errno_error("send frame", e)),
        }
    }
    Ok(())
}

/// Read into `buf` completely, collecting descriptors. `Ok(false)`: the stream ended before
/// the first byte (only allowed where `at_boundary`).
fn read_exact(
    socket: BorrowedFd<'_>,
    buf: &mut [u8],
    fds: &mut Vec<OwnedFd>,
    at_boundary: bool,
) -> Result<bool> {
    let mut got = 0;
    let mut space = [MaybeUninit::<u8>::uninit(); rustix::cmsg_space!(ScmRights(MAX_FDS))];
    while got < buf.len() {
        let mut control = RecvAncillaryBuffer::new(&mut space);
        let mut iov = [IoSliceMut::new(&mut buf[got..])];
        let msg = match recvmsg(socket, &mut iov, &mut control, RecvFlags::CMSG_CLOEXEC) {
            Ok(m) => m,
            Err(Errno::INTR) => continue,
            Err(e) => return Err(errno_error("receive frame", e)),
        };
        for m in control.drain() {
            if let RecvAncillaryMessage::ScmRights(received) = m {
                fds.extend(received);
            }
        }
        if msg.flags.contains(ReturnFlags::CTRUNC) || fds.len() > MAX_FDS {
            // The kernel also truncates when this process cannot take more descriptors.
            let lim = rustix::process::getrlimit(rustix::process::Resource::Nofile);
            return Err(ipc_error(
                "receive frame",
                format!(
                    "descriptors lost: more than {MAX_FDS} attached, or this process is at its descriptor limit ({} soft, {} hard; {} received)",
                    lim.current.map_or("none".into(), |v| v.to_string()),
                    lim.maximum.map_or("none".into(), |v| v.to_string()),
                    fds.len()
                ),
            ));
        }
        if msg.bytes == 0 {
            if got == 0 && at_boundary {
                return Ok(false);
            }
            return Err(ipc_error(
                "receive frame",
                format!(
                    "connection closed {got} bytes into a {}-byte read",
                    buf.len()
                ),
            ));
        }
        got += msg.bytes;
    }
    Ok(true)
}

/// Receive one frame whose payload is at most `max_payload` bytes (itself at most
/// [`MAX_FRAME`]). `Ok(None)`: the peer closed the connection between frames. A frame over the
/// bound is refused after reading its header only; the connection is then unusable (the caller
/// closes it).
pub fn recv_frame(socket: impl AsFd, max_payload: usize) -> Result<Option<Frame>> {
    let socket = socket.as_fd();
    let max_payload = max_payload.min(MAX_FRAME);
    let mut fds = Vec::new();
    let mut header = [0u8; HEADER];
    if !read_exact(socket, &mut header, &mut fds, true)? {
        return Ok(None);
    }
    let len = u32::from_le_bytes([header[0], header[1], header[2], header[3]]) as usize;
    let announced = header[4] as usize;
    if len == 0 || len > max_payload {
        return Err(ipc_error(
            "receive frame",
            format!("frame of {len} bytes announced (1 to {max_payload} allowed)"),
        ));
    }
    if announced > MAX_FDS {
        return Err(ipc_error(
            "receive frame",
            format!("{announced} descriptors announced ({MAX_FDS} allowed)"),
        ));
    }
    let mut payload = vec![0u8; len];
    read_exact(socket, &mut payload, &mut fds, false)?;
    if fds.len() != announced {
        return Err(ipc_error(
            "receive frame",
            format!("{announced} descriptors announced, {} arrived", fds.len()),
        ));
    }
    Ok(Some(Frame { payload, fds }))
}

/// A frame arriving on a non-blocking socket, read as its bytes come, by a thread that serves
/// many sockets (the broker's hello stage): [`PartialFrame::read_available`] takes what is
/// there and never waits.
#[derive(Debug, Default)]
pub struct PartialFrame {
    header: [u8; HEADER],
    payload: Vec<u8>,
    got: usize,
    fds: Vec<OwnedFd>,
}

impl PartialFrame {
    /// Read what the socket (non-blocking) has. `Ok(Some)`: the whole frame; `Ok(None)`: not
    /// yet; an error: the peer closed, sent a frame over `max_payload` bytes, or attached
    /// descriptors (a frame read this way carries none).
    pub fn read_available(
        &mut self,
        socket: impl AsFd,
        max_payload: usize,
    ) -> Result<Option<Frame>> {
        let socket = socket.as_fd();
        let max_payload = max_payload.min(MAX_FRAME);
        let mut space = [MaybeUninit::<u8>::uninit(); rustix::cmsg_space!(ScmRights(MAX_FDS))];
        loop {
            let total = HEADER + self.payload.len();
            if self.got >= HEADER && self.got == total {
                return Ok(Some(Frame {
                    payload: std::mem::take(&mut self.payload),
                    fds: std::mem::take(&mut self.fds),
                }));
            }
            let mut control = RecvAncillaryBuffer::new(&mut space);
            let buf: &mut [u8] = if self.got < HEADER {
                &mut self.header[self.got..]
            } else {
                &mut self.payload[self.got - HEADER..]
            };
            let mut iov = [IoSliceMut::new(buf)];
            let msg = match recvmsg(
                socket,
                &mut iov,
                &mut control,
                RecvFlags::CMSG_CLOEXEC | RecvFlags::DONTWAIT,
            ) {
                Ok(m) => m,
                Err(Errno::INTR) => continue,
                Err(Errno::AGAIN) => return Ok(None),
                Err(e) => return Err(errno_error("receive frame", e)),
            };
            for m in control.drain() {
                if let RecvAncillaryMessage::ScmRights(received) = m {
                    self.fds.extend(received);
                }
            }
            if !self.fds.is_empty() || msg.flags.contains(ReturnFlags::CTRUNC) {
                // Closed here as they drop.
                self.fds.clear();
                return Err(ipc_error("receive frame", "descriptors attached"));
            }
            if msg.bytes == 0 {
                return Err(ipc_error(
                    DISCONNECTED,
                    format!("connection closed {} bytes into a frame", self.got),
                ));
            }
            self.got += msg.bytes;
            if self.got == HEADER {
                let len = u32::from_le_bytes([
                    self.header[0],
                    self.header[1],
                    self.header[2],
                    self.header[3],
                ]) as usize;
                if len == 0 || len > max_payload {
                    return Err(ipc_error(
                        "receive frame",
                        format!("frame of {len} bytes announced (1 to {max_payload} allowed)"),
                    ));
                }
                if self.header[4] != 0 {
                    return Err(ipc_error(
                        "receive frame",
                        format!("{} descriptors announced (none allowed)", self.header[4]),
                    ));
                }
                self.payload = vec![0u8; len];
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::io::Write;
    use std::os::fd::AsFd;
    use std::os::unix::net::UnixStream;

    use super::*;

    #[test]
    fn frames_round_trip_with_descriptors() {
        let (a, b) = UnixStream::pair().unwrap();
        let (x, y) = UnixStream::pair().unwrap();
        send_frame(&a, b"hello", &[x.as_fd()]).unwrap();
        send_frame(&a, &vec![7u8; MAX_FRAME], &[]).unwrap();
        let f = recv_frame(&b, MAX_FRAME).unwrap().unwrap();
        assert_eq!(f.payload, b"hello");
        assert_eq!(f.fds.len(), 1);
        let big = recv_frame(&b, MAX_FRAME).unwrap().unwrap();
        assert_eq!(big.payload.len(), MAX_FRAME);
        assert!(big.fds.is_empty());
        // The received descriptor is the other socket's end: bytes written through it arrive.
        let mut via = UnixStream::from(f.fds.into_iter().next().unwrap());
        via.write_all(b"x").unwrap();
        drop((via, x));
        let mut got = String::new();
        std::io::Read::read_to_string(&mut &y, &mut got).unwrap();
        assert_eq!(got, "x");
        drop(a);
        assert!(recv_frame(&b, MAX_FRAME).unwrap().is_none());
    }

    #[test]
    fn partial_frames_are_read_as_bytes_come() {
        let (mut a, b) = UnixStream::pair().unwrap();
        b.set_nonblocking(true).unwrap();
        let mut p = PartialFrame::default();
        assert!(p.read_available(&b, 64).unwrap().is_none());
        a.write_all(&3u32.to_le_bytes()).unwrap();
        assert!(p.read_available(&b, 64).unwrap().is_none());
        a.write_all(&[0, b'a']).unwrap();
        assert!(p.read_available(&b, 64).unwrap().is_none());
        a.write_all(b"bc").unwrap();
        let f = p.read_available(&b, 64).unwrap().unwrap();
        assert_eq!(f.payload, b"abc");
        // Over the bound, descriptors announced, descriptors attached, closed: errors.
        let mut p = PartialFrame::default();
        a.write_all(&65u32.to_le_bytes()).unwrap();
        a.write_all(&[0]).unwrap();
        let e = p.read_available(&b, 64).unwrap_err().to_string();
        assert!(
            e.contains("frame of 65 bytes announced (1 to 64 allowed)"),
            "{e}"
        );
        let (a, b) = UnixStream::pair().unwrap();
        b.set_nonblocking(true).unwrap();
        send_frame(&a, b"x", &[a.as_fd()]).unwrap();
        let e = PartialFrame::default()
            .read_available(&b, 64)
            .unwrap_err()
            .to_string();
        assert!(e.contains("descriptors"), "{e}");
        let (a, b) = UnixStream::pair().unwrap();
        b.set_nonblocking(true).unwrap();
        drop(a);
        let e = PartialFrame::default().read_available(&b, 64).unwrap_err();
        assert!(is_disconnect(&e), "{e}");
    }

    #[test]
    fn oversized_and_cut_frames_are_errors() {
        let (mut a, b) = UnixStream::pair().unwrap();
        a.write_all(&(1u32 << 30).to_le_bytes()).unwrap();
        a.write_all(&[0]).unwrap();
        let e = recv_frame(&b, MAX_FRAME).unwrap_err().to_string();
        assert!(e.contains("1073741824"), "{e}");

        let (mut a, b) = UnixStream::pair().unwrap();
        a.write_all(&10u32.to_le_bytes()).unwrap();
        a.write_all(&[0, 1, 2]).unwrap();
        drop(a);
        let e = recv_frame(&b, MAX_FRAME).unwrap_err().to_string();
        assert!(e.contains("closed"), "{e}");

        let (mut a, b) = UnixStream::pair().unwrap();
        a.write_all(&3u32.to_le_bytes()).unwrap();
        a.write_all(&[2, 1, 2, 3]).unwrap();
        let e = recv_frame(&b, MAX_FRAME).unwrap_err().to_string();
        assert!(e.contains("2 descriptors announced, 0 arrived"), "{e}");

        let (a, _b) = UnixStream::pair().unwrap();
        let e = send_frame(&a, &vec![0u8; MAX_FRAME + 1], &[]).unwrap_err();
        assert!(e.to_string().contains(&(MAX_FRAME + 1).to_string()));
    }
}
