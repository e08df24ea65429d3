//! The broker's answers to lease requests (the books' side is `lease.rs`): arm, keep, forget,
//! store a blob, attach, take the kept chunks. Bookkeeping under the book's lock; the kept
//! chunks' descriptors are exported after it.

use std::os::fd::OwnedFd;
use std::time::Instant;

use super::book::BookError;
use super::protocol::{ErrorKind, LeaseToken, Reply, Request, MAX_BATCH};
use super::server::{book_error, error_reply, Shared};
use crate::backend::Backend;

/// A fresh token from the operating system's random source.
fn new_token() -> Result<LeaseToken, String> {
    let mut t = [0u8; 32];
    getrandom::fill(&mut t).map_err(|e| format!("no random bytes for a lease token: {e}"))?;
    Ok(LeaseToken(t))
}

impl Shared {
    /// One lease request of engine connection `conn`.
    pub(super) fn handle_lease(&self, conn: u64, request: Request) -> (Reply, Vec<OwnedFd>) {
        let grace_ms = self.config.lease_grace.as_millis() as u64;
        let done = |r: Result<(), BookError>| match r {
            Ok(()) => Reply::Done,
            Err(e) => book_error(e),
        };
        let reply = match request {
            Request::Lease { model } => match new_token() {
                Ok(token) => match self.book.lock().arm_lease(conn, model, token) {
                    Ok(()) => {
                        tracing::info!(conn, model, grace_ms, "lease armed");
                        Reply::Leased { token, grace_ms }
                    }
                    Err(e) => book_error(e),
                },
                Err(e) => error_reply(ErrorKind::Backend, e),
            },
            Request::Keep {
                model,
                tag,
                len,
                chunks,
                append,
            } => done(
                self.book
                    .lock()
                    .keep(conn, model, &tag, len, &chunks, append),
            ),
            Request::Forget { model, tag } => done(self.book.lock().forget(conn, model, &tag)),
            Request::StoreBlob { model, blob } => {
                done(self.book.lock().store_blob(conn, model, blob))
            }
            Request::Detach { model } => {
                let r = self.book.lock().detach(conn, model);
                match r {
                    Ok(back) => {
                        tracing::info!(conn, model, "attached model given back to its lease");
                        self.release_all(back, None);
                        self.changed.notify_all();
                        Reply::Done
                    }
                    Err(e) => book_error(e),
                }
            }
            Request::Attach { model, token } => {
                let r = {
                    let mut book = self.book.lock();
                    match book.conns.get(&conn).map(|c| c.peer.uid) {
                        Some(uid) => book.attach(conn, uid, &model, &token, Instant::now()),
                        None => Err(BookError::Unknown(format!("connection {conn} is closing"))),
                    }
                };
                match r {
                    Ok(a) => {
                        tracing::info!(conn, model = %model, id = a.model, regions = a.regions.len(), "lease attached");
                        Reply::Attached(Box::new(a))
                    }
                    Err(e) => book_error(e),
                }
            }
            Request::TakeKept {
                model,
                tag,
                from,
                count,
            } => {
                if count == 0 || count > MAX_BATCH {
                    return (
                        error_reply(
                            ErrorKind::InvalidArgument,
                            format!(
                                "{count} kept chunks asked for at once: 1 to {MAX_BATCH} allowed"
                            ),
                        ),
                        Vec::new(),
                    );
                }
                let taken = self.book.lock().take_kept(conn, model, &tag, from, count);
                let taken = match taken {
                    Ok(t) => t,
                    Err(e) => return (book_error(e), Vec::new()),
                };
                // The chunks stay the model's in the book whatever happens to the export: a
                // failure only means this engine did not get them this time.
                let mut fds = Vec::with_capacity(taken.len());
                for (_, chunk) in &taken {
                    match self.backend.export_chunk(*chunk) {
                        Ok(fd) => fds.push(fd),
                        Err(e) => {
                            return (error_reply(ErrorKind::Backend, e.to_string()), Vec::new())
                        }
                    }
                }
                let sizes = taken.iter().map(|(_, c)| c.size as u64).collect();
                let chunks = taken.into_iter().map(|(k, _)| k).collect();
                return (Reply::KeptChunks { chunks, sizes }, fds);
            }
            other => error_reply(
                ErrorKind::InvalidArgument,
                format!("not a lease request: {other:?}"),
            ),
        };
        (reply, Vec::new())
    }
}
