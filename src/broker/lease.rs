//! Leases: a model's memory that outlives its engine. An engine arms a lease on one of its
//! models and names the regions to keep (their chunks and where they lie); when its connection
//! ends without unregistering the model (a crash, or an exit that keeps it), the broker keeps
//! those chunks charged to the model for its grace period and releases the rest. An engine of
//! the same user presenting the lease's token takes the model over, maps the kept chunks at the
//! same offsets of a region of its own and finds their bytes as they were.
//!
//! Bookkeeping only, under the book's lock (`book.rs`): no driver call, no socket write.
//!
//! Rules (README, "Security model", and `tests/processes/lease.rs`):
//! - Only the model's own user attaches: another user's attach is answered as if there were no
//!   lease (it cannot learn that one exists), a wrong token is refused (counted), and every
//!   attach rotates the token, so a token used once is void.
//! - One engine at a time: a lease attached elsewhere, or whose previous engine's process still
//!   lives (it may still map the chunks), is busy; of two engines racing, one wins.
//! - A held lease grows no memory, is asked for none (nobody could answer), keeps its name
//!   (a register of it is refused), and counts against its user's caps like any model.
//! - A chunk given back drops its region from the lease (the region is no longer whole).
//! - A broker restart ends every lease: the memory is the broker process's.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Instant;

use super::book::{check_name, Book, BookError, Holder};
use super::protocol::{
    Attachment, KeptChunk, KeptRegionInfo, LeaseInfo, LeaseState, LeaseToken, MAX_BLOB, MAX_KEEP,
    MAX_KEPT_REGIONS,
};
use crate::backend::PhysicalChunk;

/// A model's lease.
#[derive(Debug)]
pub(crate) struct Lease {
    pub(crate) token: LeaseToken,
    pub(crate) state: LeaseState,
    /// Kept regions by tag.
    pub(crate) regions: BTreeMap<String, KeptRegion>,
    pub(crate) blob: Vec<u8>,
    /// When a held lease ends.
    pub(crate) expires: Option<Instant>,
}

/// A kept region: its length and its chunks by offset.
#[derive(Debug, Default)]
pub(crate) struct KeptRegion {
    pub(crate) len: u64,
    pub(crate) chunks: BTreeMap<u64, u64>,
}

impl Lease {
    fn kept_ids(&self) -> BTreeSet<u64> {
        self.regions
            .values()
            .flat_map(|r| r.chunks.values().copied())
            .collect()
    }
}

impl Book {
    /// The lease of connection `conn`'s model `model`, armed (with a new token if it had one).
    pub(crate) fn arm_lease(
        &mut self,
        conn: u64,
        model: u64,
        token: LeaseToken,
    ) -> Result<(), BookError> {
        self.own_model(conn, model)?;
        let m = self
            .models
            .get_mut(&model)
            .ok_or_else(|| BookError::Unknown(format!("no model {model}")))?;
        match &mut m.lease {
            Some(l) => l.token = token,
            None => {
                m.lease = Some(Lease {
                    token,
                    state: LeaseState::Armed,
                    regions: BTreeMap::new(),
                    blob: Vec::new(),
                    expires: None,
                })
            }
        }
        self.counters.leases += 1;
        Ok(())
    }

    /// Record `chunks` of the leased model as the region `tag` (or more of it, `append`).
    /// Each must be the model's, lie within `len` and overlap no other kept chunk; on any
    /// error nothing changes.
    pub(crate) fn keep(
        &mut self,
        conn: u64,
        model: u64,
        tag: &str,
        len: u64,
        chunks: &[KeptChunk],
        append: bool,
    ) -> Result<(), BookError> {
        self.own_model(conn, model)?;
        check_name("region tag", tag)?;
        if chunks.len() > MAX_KEEP {
            return Err(BookError::Invalid(format!(
                "{} chunks kept in one message, at most {MAX_KEEP}",
                chunks.len()
            )));
        }
        let Some(m) = self.models.get(&model) else {
            return Err(BookError::Unknown(format!("no model {model}")));
        };
        let Some(lease) = &m.lease else {
            return Err(BookError::Invalid(format!(
                "model {}: no lease armed; ask for one before keeping regions",
                m.name
            )));
        };
        if len == 0 {
            return Err(BookError::Invalid(format!(
                "region {tag:?} of model {}: length 0",
                m.name
            )));
        }
        let existing = lease.regions.get(tag).filter(|_| append);
        if append && existing.is_none() {
            return Err(BookError::Unknown(format!(
                "region {tag:?} of model {}: appended to, but not kept (a chunk of it went back meanwhile?)",
                m.name
            )));
        }
        if let Some(r) = existing {
            if r.len != len {
                return Err(BookError::Invalid(format!(
                    "region {tag:?} of model {}: appended with length {len}, kept with {}",
                    m.name, r.len
                )));
            }
        } else if !lease.regions.contains_key(tag) && lease.regions.len() >= MAX_KEPT_REGIONS {
            return Err(BookError::Invalid(format!(
                "model {}: {} regions kept, at most {MAX_KEPT_REGIONS}",
                m.name,
                lease.regions.len()
            )));
        }
        // Chunks kept elsewhere (other regions; this one too when appending).
        let others: BTreeSet<u64> = lease
            .regions
            .iter()
            .filter(|(t, _)| append || t.as_str() != tag)
            .flat_map(|(_, r)| r.chunks.values().copied())
            .collect();
        let mut placed: BTreeMap<u64, (u64, u64)> = existing
            .map(|r| {
                r.chunks
                    .iter()
                    .map(|(&o, &c)| {
                        (
                            o,
                            (c, self.chunks.get(&c).map_or(0, |e| e.chunk.size as u64)),
                        )
                    })
                    .collect()
            })
            .unwrap_or_default();
        let mut seen = BTreeSet::new();
        for k in chunks {
            let size = match self.chunks.get(&k.chunk) {
                Some(e) if e.holder == Holder::Model(model) => e.chunk.size as u64,
                _ => {
                    return Err(BookError::Unknown(format!(
                        "model {}: holds no chunk {}",
                        m.name, k.chunk
                    )))
                }
            };
            if others.contains(&k.chunk) || !seen.insert(k.chunk) {
                return Err(BookError::Invalid(format!(
                    "model {}: chunk {} is kept twice",
                    m.name, k.chunk
                )));
            }
            if k.offset.checked_add(size).is_none_or(|e| e > len) {
                return Err(BookError::Invalid(format!(
                    "region {tag:?} of model {}: chunk {} of {size} bytes at offset {} ends past the region's {len} bytes",
                    m.name, k.chunk, k.offset
                )));
            }
            let before = placed.range(..=k.offset).next_back();
            let after = placed.range(k.offset..).next();
            let overlaps = before.is_some_and(|(&o, &(_, s))| o + s > k.offset)
                || after.is_some_and(|(&o, _)| o < k.offset + size);
            if overlaps {
                return Err(BookError::Invalid(format!(
                    "region {tag:?} of model {}: chunk {} at offset {} overlaps another kept chunk",
                    m.name, k.chunk, k.offset
                )));
            }
            placed.insert(k.offset, (k.chunk, size));
        }
        let region = KeptRegion {
            len,
            chunks: placed.into_iter().map(|(o, (c, _))| (o, c)).collect(),
        };
        if let Some(l) = self.models.get_mut(&model).and_then(|m| m.lease.as_mut()) {
            l.regions.insert(tag.to_string(), region);
        }
        Ok(())
    }

    /// Stop keeping the region `tag` of a leased model.
    pub(crate) fn forget(&mut self, conn: u64, model: u64, tag: &str) -> Result<(), BookError> {
        self.own_model(conn, model)?;
        let lease = self.lease_mut(model)?;
        match lease.regions.remove(tag) {
            Some(_) => Ok(()),
            None => Err(BookError::Unknown(format!("no region {tag:?} kept"))),
        }
    }

    /// Store the engine's blob with the lease.
    pub(crate) fn store_blob(
        &mut self,
        conn: u64,
        model: u64,
        blob: Vec<u8>,
    ) -> Result<(), BookError> {
        self.own_model(conn, model)?;
        if blob.len() > MAX_BLOB {
            return Err(BookError::Invalid(format!(
                "a blob of {} bytes, at most {MAX_BLOB}",
                blob.len()
            )));
        }
        self.lease_mut(model)?.blob = blob;
        Ok(())
    }

    fn lease_mut(&mut self, model: u64) -> Result<&mut Lease, BookError> {
        self.models
            .get_mut(&model)
            .and_then(|m| m.lease.as_mut())
            .ok_or_else(|| BookError::Invalid(format!("model {model}: no lease armed")))
    }

    /// Chunk `cid` of `model` went back: a region that kept it is no longer whole and goes.
    pub(crate) fn unkeep(&mut self, model: u64, cid: u64) {
        let Some(lease) = self.models.get_mut(&model).and_then(|m| m.lease.as_mut()) else {
            return;
        };
        let before = lease.regions.len();
        lease
            .regions
            .retain(|_, r| !r.chunks.values().any(|&c| c == cid));
        if lease.regions.len() < before {
            tracing::warn!(
                model,
                chunk = cid,
                "a kept chunk was given back; its region is no longer kept"
            );
        }
    }

    /// The engine of leased `model` is gone: the lease holds the kept chunks (still charged)
    /// until `expires`; every other chunk comes back (returned moving, charges credited).
    pub(crate) fn hold(&mut self, model: u64, expires: Instant) -> Vec<(u64, PhysicalChunk)> {
        let Some(m) = self.models.get_mut(&model) else {
            return Vec::new();
        };
        let Some(lease) = m.lease.as_mut() else {
            return Vec::new();
        };
        let kept = lease.kept_ids();
        lease.state = LeaseState::Held;
        lease.expires = Some(expires);
        m.conn = 0;
        m.orphaned = false;
        (m.in_use, m.idle, m.cached) = (0, 0, 0);
        let free: Vec<u64> = m.chunks.difference(&kept).copied().collect();
        let mut out = Vec::new();
        for cid in free {
            m.chunks.remove(&cid);
            if let Some(e) = self.chunks.get_mut(&cid) {
                self.ledger.credit(model, e.chunk.size as u64);
                e.holder = Holder::Moving;
                out.push((cid, e.chunk));
            }
        }
        self.ledger.retire(model);
        self.counters.leases_held += 1;
        out
    }

    /// Connection `conn` of user `uid` takes over the held lease of model `name` presenting
    /// `token`. The token stays until the engine arms the lease anew (a crash half way leaves
    /// the lease held under it). Another user's lease, or none, is "unknown".
    pub(crate) fn attach(
        &mut self,
        conn: u64,
        uid: u32,
        name: &str,
        token: &LeaseToken,
        now: Instant,
    ) -> Result<Attachment, BookError> {
        let model = match self.attachable(conn, uid, name, token, now) {
            Ok(model) => model,
            Err(e) => {
                self.counters.attach_refusals += 1;
                return Err(e);
            }
        };
        // Both are there (checked above); were the books broken, the attach is refused.
        let missing = || BookError::Unknown(format!("model {name:?} left the books"));
        let m = self.models.get_mut(&model).ok_or_else(missing)?;
        let lease = m.lease.as_mut().ok_or_else(missing)?;
        lease.state = LeaseState::Armed;
        lease.expires = None;
        m.conn = conn;
        let regions = lease
            .regions
            .iter()
            .map(|(tag, r)| KeptRegionInfo {
                tag: tag.clone(),
                len: r.len,
                chunks: r.chunks.len() as u32,
                bytes: r
                    .chunks
                    .values()
                    .filter_map(|c| self.chunks.get(c))
                    .map(|e| e.chunk.size as u64)
                    .sum(),
            })
            .collect();
        let blob = lease.blob.clone();
        let guarantee = self.ledger.unretire(model);
        let (limit, priority) = self
            .ledger
            .models
            .get(&model)
            .map_or((0, 0), |b| (b.limit, b.priority));
        self.counters.reattaches += 1;
        Ok(Attachment {
            model,
            limit,
            guarantee,
            priority,
            regions,
            blob,
        })
    }

    /// The model whose held lease `conn` of user `uid` may take over with `token`, or why not.
    fn attachable(
        &self,
        conn: u64,
        uid: u32,
        name: &str,
        token: &LeaseToken,
        now: Instant,
    ) -> Result<u64, BookError> {
        let unknown = || BookError::Unknown(format!("no lease on a model {name:?} of user {uid}"));
        let model = *self.names.get(name).ok_or_else(unknown)?;
        let m = self.models.get(&model).ok_or_else(unknown)?;
        let lease = m
            .lease
            .as_ref()
            .filter(|_| m.uid == uid)
            .ok_or_else(unknown)?;
        match lease.state {
            LeaseState::Armed => Err(BookError::Busy(format!(
                "model {name:?} is attached to another engine (connection {})",
                m.conn
            ))),
            LeaseState::Waiting => Err(BookError::Busy(format!(
                "model {name:?}: the process of its previous engine still lives and may map its memory; it can be attached once that process is gone"
            ))),
            LeaseState::Held if lease.expires.is_some_and(|e| e <= now) => Err(unknown()),
            LeaseState::Held if !lease.token.matches(token) => {
                tracing::debug!(conn, uid, model = name, "attach with a wrong lease token refused");
                Err(BookError::Forbidden(format!("model {name:?}: wrong lease token")))
            }
            LeaseState::Held => Ok(model),
        }
    }

    /// Connection `conn` gives its attached model back to the lease (held again, same token):
    /// an attach that failed in the engine. Returns the chunks no region keeps (moving).
    pub(crate) fn detach(
        &mut self,
        conn: u64,
        model: u64,
    ) -> Result<Vec<(u64, PhysicalChunk)>, BookError> {
        self.own_model(conn, model)?;
        self.lease_mut(model)?;
        let expires = self.lease_expiry();
        Ok(self.hold(model, expires))
    }

    /// Chunks `from..from + count` of the kept region `tag` of `conn`'s model `model`, in
    /// offset order.
    pub(crate) fn take_kept(
        &self,
        conn: u64,
        model: u64,
        tag: &str,
        from: u32,
        count: u32,
    ) -> Result<Vec<(KeptChunk, PhysicalChunk)>, BookError> {
        let m = self.own_model(conn, model)?;
        let region = m
            .lease
            .as_ref()
            .and_then(|l| l.regions.get(tag))
            .ok_or_else(|| BookError::Unknown(format!("no region {tag:?} kept")))?;
        let n = region.chunks.len();
        if from as usize > n {
            return Err(BookError::Invalid(format!(
                "region {tag:?}: chunks from {from} asked, it has {n}"
            )));
        }
        region
            .chunks
            .iter()
            .skip(from as usize)
            .take(count as usize)
            .map(|(&offset, &chunk)| match self.chunks.get(&chunk) {
                Some(e) if e.holder == Holder::Model(model) => {
                    Ok((KeptChunk { chunk, offset }, e.chunk))
                }
                _ => Err(BookError::Unknown(format!(
                    "region {tag:?}: chunk {chunk} is no longer the model's"
                ))),
            })
            .collect()
    }

    /// Held leases whose grace period ended by `now` go, with their chunks (returned moving,
    /// charges credited).
    pub(crate) fn expire(&mut self, now: Instant) -> Vec<(u64, PhysicalChunk)> {
        let ended: Vec<u64> = self
            .models
            .iter()
            .filter(|(_, m)| {
                m.lease.as_ref().is_some_and(|l| {
                    l.state == LeaseState::Held && l.expires.is_some_and(|e| e <= now)
                })
            })
            .map(|(&k, _)| k)
            .collect();
        let mut out = Vec::new();
        for model in ended {
            tracing::warn!(model, "a lease's grace period ended; its memory comes back");
            out.extend(self.unregister(model));
            self.counters.leases_expired += 1;
        }
        out
    }

    /// When the next held lease ends.
    pub(crate) fn next_expiry(&self) -> Option<Instant> {
        self.models
            .values()
            .filter_map(|m| m.lease.as_ref().and_then(|l| l.expires))
            .min()
    }

    /// A model's lease as the view shows it.
    pub(crate) fn lease_info(&self, model: u64, now: Instant) -> Option<LeaseInfo> {
        let l = self.models.get(&model)?.lease.as_ref()?;
        let ids = l.kept_ids();
        Some(LeaseInfo {
            state: l.state,
            regions: l.regions.len() as u32,
            kept: ids
                .iter()
                .filter_map(|c| self.chunks.get(c))
                .map(|e| e.chunk.size as u64)
                .sum(),
            blob: l.blob.len() as u64,
            expires_in_ms: l
                .expires
                .map(|e| e.saturating_duration_since(now).as_millis() as u64),
        })
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::broker::book::{Policy, IDLE};
    use crate::broker::protocol::MAX_BLOB;

    fn book() -> Book {
        Book::new(
            1000,
            Policy {
                broker_uid: 7,
                max_models_per_user: 32,
                max_guarantee_total: None,
                max_guarantee_per_user: None,
                max_priority_per_user: 0,
                max_bytes_per_user: u64::MAX,
            },
        )
    }

    /// A model of user 7 on connection 1 holding three chunks of 10 bytes, leased.
    fn leased(b: &mut Book) -> (u64, [u64; 3]) {
        let m = b.register(1, 7, "m", 100, 30, 0).unwrap();
        let mut ids = [0; 3];
        for (i, id) in ids.iter_mut().enumerate() {
            b.ledger.try_charge(m, 10).unwrap();
            *id = b.add_created(
                m,
                PhysicalChunk {
                    raw: 100 + i as u64,
                    size: 10,
                },
            );
        }
        b.arm_lease(1, m, LeaseToken([1; 32])).unwrap();
        (m, ids)
    }

    fn kc(chunk: u64, offset: u64) -> KeptChunk {
        KeptChunk { chunk, offset }
    }

    #[test]
    fn keeping_checks_every_chunk_and_changes_nothing_on_error() {
        let mut b = book();
        let (m, [c0, c1, c2]) = leased(&mut b);
        let other = b.register(2, 7, "o", 100, 0, 0).unwrap();
        assert!(matches!(
            b.keep(2, m, "w", 40, &[], false),
            Err(BookError::Unknown(_))
        ));
        assert!(
            matches!(
                b.keep(2, other, "w", 40, &[], false),
                Err(BookError::Invalid(_))
            ),
            "no lease on it"
        );
        // Past the end, overlapping, twice, not the model's, zero length, a bad tag.
        for (chunks, len) in [
            (vec![kc(c0, 35)], 40),
            (vec![kc(c0, 0), kc(c1, 5)], 40),
            (vec![kc(c0, 0), kc(c0, 20)], 40),
            (vec![kc(999, 0)], 40),
            (vec![kc(c0, 0)], 0),
            (vec![kc(c0, u64::MAX - 3)], u64::MAX),
        ] {
            assert!(
                b.keep(1, m, "w", len, &chunks, false).is_err(),
                "{chunks:?} in {len}"
            );
        }
        assert!(b.keep(1, m, "a b", 40, &[kc(c0, 0)], false).is_err());
        assert!(b.lease_info(m, Instant::now()).unwrap().regions == 0);
        // Good: two in one message, one more appended; appending a different length or a
        // chunk kept already is refused.
        b.keep(1, m, "w", 40, &[kc(c0, 0), kc(c1, 20)], false)
            .unwrap();
        assert!(b.keep(1, m, "w", 50, &[kc(c2, 30)], true).is_err());
        assert!(b.keep(1, m, "w", 40, &[kc(c1, 10)], true).is_err());
        assert!(
            b.keep(1, m, "w", 40, &[kc(c2, 15)], true).is_err(),
            "15..25 overlaps c1's 20..30"
        );
        b.keep(1, m, "w", 40, &[kc(c2, 30)], true).unwrap();
        assert!(
            b.keep(1, m, "v", 10, &[kc(c2, 0)], false).is_err(),
            "kept in another region"
        );
        let info = b.lease_info(m, Instant::now()).unwrap();
        assert_eq!(
            (info.state, info.regions, info.kept),
            (LeaseState::Armed, 1, 30)
        );
        // Blobs: bounded.
        assert!(b.store_blob(1, m, vec![0; MAX_BLOB + 1]).is_err());
        b.store_blob(1, m, b"tables".to_vec()).unwrap();
        b.forget(1, m, "w").unwrap();
        assert!(b.forget(1, m, "w").is_err());
        b.audit().unwrap();
    }

    #[test]
    fn a_dead_engines_lease_holds_what_it_kept_until_attached_or_expired() {
        let mut b = book();
        let (m, [c0, c1, c2]) = leased(&mut b);
        b.keep(1, m, "w", 20, &[kc(c0, 0), kc(c2, 10)], false)
            .unwrap();
        b.store_blob(1, m, b"blob".to_vec()).unwrap();
        let used = b.ledger.used;
        // Dead: the unkept chunk comes back, the kept stay charged; the name stays taken.
        let back = b.drop_conn(1);
        assert_eq!(back.iter().map(|&(c, _)| c).collect::<Vec<_>>(), vec![c1]);
        b.released(c1, None);
        assert_eq!(b.ledger.used, used - 10);
        assert_eq!(b.models[&m].conn, 0);
        assert!(
            matches!(b.register(2, 7, "m", 10, 0, 0), Err(BookError::Duplicate(e)) if e.contains("lease"))
        );
        assert!(
            !b.reachable(99).iter().any(|&(k, _)| k == m),
            "nobody to ask"
        );
        assert_eq!(b.ledger.headroom(m), 0, "a held lease grows nothing");
        b.audit().unwrap();
        let now = Instant::now();
        // Another user: as if there were none. A wrong token: refused. Both counted.
        assert!(matches!(
            b.attach(5, 8, "m", &LeaseToken([1; 32]), now),
            Err(BookError::Unknown(_))
        ));
        assert!(matches!(
            b.attach(5, 7, "m", &LeaseToken([9; 32]), now),
            Err(BookError::Forbidden(_))
        ));
        assert!(matches!(
            b.attach(5, 7, "nope", &LeaseToken([1; 32]), now),
            Err(BookError::Unknown(_))
        ));
        assert_eq!(b.counters.attach_refusals, 3);
        let a = b.attach(5, 7, "m", &LeaseToken([1; 32]), now).unwrap();
        assert_eq!(
            (a.model, a.limit, a.guarantee, a.blob.as_slice()),
            (m, 100, 30, &b"blob"[..])
        );
        assert_eq!(a.regions.len(), 1);
        assert_eq!((a.regions[0].chunks, a.regions[0].bytes), (2, 20));
        let taken = b.take_kept(5, m, "w", 0, 16).unwrap();
        assert_eq!(
            taken
                .iter()
                .map(|(k, _)| (k.chunk, k.offset))
                .collect::<Vec<_>>(),
            vec![(c0, 0), (c2, 10)]
        );
        assert!(
            b.take_kept(1, m, "w", 0, 16).is_err(),
            "the old connection owns nothing"
        );
        assert!(b.take_kept(5, m, "w", 3, 1).is_err());
        // Busy while attached.
        assert!(matches!(
            b.attach(6, 7, "m", &LeaseToken([1; 32]), now),
            Err(BookError::Busy(_))
        ));
        // An attach that failed in the engine: given back, held again under the same token,
        // nothing released (everything is kept).
        assert!(b.detach(6, m).is_err(), "not this connection's");
        assert!(b.detach(5, m).unwrap().is_empty());
        assert_eq!(b.lease_info(m, now).unwrap().state, LeaseState::Held);
        b.attach(5, 7, "m", &LeaseToken([1; 32]), now).unwrap();
        // The engine re-arms on success: the presented token is void from then on.
        b.arm_lease(5, m, LeaseToken([4; 32])).unwrap();
        assert!(b.models[&m]
            .lease
            .as_ref()
            .unwrap()
            .token
            .matches(&LeaseToken([4; 32])));
        b.ledger.try_charge(m, 10).unwrap();
        assert_eq!(b.counters.reattaches, 2);
        b.ledger.credit(m, 10);
        // Appending to a region that is not kept is refused (half a region is no region).
        assert!(matches!(
            b.keep(5, m, "gone", 20, &[], true),
            Err(BookError::Unknown(_))
        ));
        // A chunk given back drops its region.
        assert_eq!(b.give_back(5, m, c2).unwrap(), None);
        assert_eq!(b.lease_info(m, now).unwrap().regions, 0);
        b.audit().unwrap();
        // The next engine dies too; its lease expires; everything comes back.
        b.lease_grace = Duration::ZERO;
        let back = b.drop_conn(5);
        assert_eq!(back.len(), 1, "c0 is not kept any more");
        for (c, _) in back {
            b.released(c, None);
        }
        assert!(b.next_expiry().is_some());
        let back = b.expire(Instant::now() + Duration::from_millis(1));
        assert!(back.is_empty(), "nothing kept");
        assert!(!b.models.contains_key(&m));
        assert_eq!(b.counters.leases_expired, 1);
        assert_eq!(b.ledger.used, b.ledger.models[&IDLE].used);
        b.register(2, 7, "m", 10, 0, 0).unwrap();
        b.audit().unwrap();
    }

    #[test]
    fn a_lease_waits_for_a_live_process_and_holds_when_it_is_reaped() {
        let mut b = book();
        let (m, [c0, _, _]) = leased(&mut b);
        b.keep(1, m, "w", 10, &[kc(c0, 0)], false).unwrap();
        let fd: std::os::fd::OwnedFd = std::fs::File::open("/dev/null").unwrap().into();
        let back = b.end_conn(1, Some((1, std::sync::Arc::new(fd))));
        assert!(back.is_empty(), "the process may still map every chunk");
        assert_eq!(
            b.lease_info(m, Instant::now()).unwrap().state,
            LeaseState::Waiting
        );
        let now = Instant::now();
        assert!(matches!(
            b.attach(5, 7, "m", &LeaseToken([1; 32]), now),
            Err(BookError::Busy(_))
        ));
        let back = b.reap(1);
        assert_eq!(
            back.len(),
            2,
            "the unkept chunks come back once the process is gone"
        );
        for (c, _) in back {
            b.released(c, None);
        }
        assert_eq!(b.lease_info(m, now).unwrap().state, LeaseState::Held);
        b.attach(5, 7, "m", &LeaseToken([1; 32]), now).unwrap();
        b.audit().unwrap();
    }

    /// An orphan reaped after a newer model took its name leaves that model's name alone (a
    /// lease of the newer one could not be attached by name otherwise).
    #[test]
    fn a_reaped_orphan_leaves_a_newer_models_name() {
        let mut b = book();
        let old = b.register(1, 7, "m", 100, 0, 0).unwrap();
        b.ledger.try_charge(old, 10).unwrap();
        b.add_created(old, PhysicalChunk { raw: 1, size: 10 });
        let fd: std::os::fd::OwnedFd = std::fs::File::open("/dev/null").unwrap().into();
        assert!(b.end_conn(1, Some((1, std::sync::Arc::new(fd)))).is_empty());
        let new = b.register(2, 7, "m", 100, 0, 0).unwrap();
        for (c, _) in b.reap(1) {
            b.released(c, None);
        }
        assert_eq!(b.names.get("m"), Some(&new));
        assert!(b.register(3, 7, "m", 100, 0, 0).is_err());
        // Another user does not learn that a name is leased.
        b.arm_lease(2, new, LeaseToken([1; 32])).unwrap();
        b.drop_conn(2);
        let theirs = b.register(3, 8, "m", 1, 0, 0).unwrap_err();
        assert!(
            matches!(&theirs, BookError::Duplicate(e) if !e.contains("lease")),
            "{theirs:?}"
        );
        let mine = b.register(3, 7, "m", 1, 0, 0).unwrap_err();
        assert!(
            matches!(&mine, BookError::Duplicate(e) if e.contains("lease")),
            "{mine:?}"
        );
        b.audit().unwrap();
    }
}
