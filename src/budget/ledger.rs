//! The budget's book of physical memory: pure arithmetic, no driver, no pool (the shared pool's
//! and the broker's alike; the decisions on top are the engine's, [`super`]).
//!
//! Every byte a model holds (mapped, cached, or being created) is charged here before the driver
//! is asked for it, and credited back after the driver has it again. The invariants, checked on
//! every charge under one lock, so that they hold at every instant:
//! - each model: `used <= limit` (growth is also held below `cap` while a lower limit is being
//!   reached);
//! - globally: `used + unused guarantees of the other models <= global limit`, where a model's
//!   unused guarantee is `max(0, guarantee - used)`; hence `used <= global limit`.

use std::collections::BTreeMap;
use std::sync::Arc;

use crate::error::Error;

/// One model's line in the book.
#[derive(Debug, Clone)]
pub(crate) struct ModelBook {
    pub(crate) id: Arc<str>,
    pub(crate) limit: u64,
    /// Growth is admitted only up to `min(limit, cap)`; `cap < limit` while lowering the limit.
    pub(crate) cap: u64,
    pub(crate) guarantee: u64,
    pub(crate) priority: i32,
    pub(crate) used: u64,
    pub(crate) peak: u64,
    pub(crate) refusals: u64,
    pub(crate) reclaimed: u64,
    /// Unregistered: no new memory; its guarantee no longer reserved.
    pub(crate) retired: bool,
    /// Bumped by every limit change: a change still under way when a later one begins is
    /// replaced by it (see [`super::change`]).
    pub(crate) changes: u64,
}

impl ModelBook {
    /// A fresh line, nothing used.
    pub(crate) fn new(id: Arc<str>, limit: u64, guarantee: u64, priority: i32) -> ModelBook {
        ModelBook {
            id,
            limit,
            cap: limit,
            guarantee,
            priority,
            used: 0,
            peak: 0,
            refusals: 0,
            reclaimed: 0,
            retired: false,
            changes: 0,
        }
    }

    fn unused_guarantee(&self) -> u64 {
        if self.retired {
            0
        } else {
            self.guarantee.saturating_sub(self.used)
        }
    }
}

/// Why a charge was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Refusal {
    /// The model's own limit.
    ModelLimit,
    /// The global budget (after other models' unused guarantees); `short` bytes are missing.
    Global { short: u64 },
    /// The model was unregistered.
    Retired,
    /// The transport's own policy (the broker's bytes per user); the transport says more.
    #[cfg(feature = "broker")]
    Policy,
}

/// The book of every model of one shared pool.
#[derive(Debug)]
pub(crate) struct Ledger {
    pub(crate) global_limit: u64,
    /// Bytes charged: every model's `used` plus `leaked`.
    pub(crate) used: u64,
    /// Bytes of models gone whose memory could not be given back to the driver (a release or
    /// unmap failed at teardown): the memory still exists, so it stays counted.
    pub(crate) leaked: u64,
    /// Sum of every model's unused guarantee, kept up to date on each change.
    unused_guarantees: u64,
    pub(crate) models: BTreeMap<u64, ModelBook>,
    /// Caps held below models' limits while a lower limit is being reached, as `(ticket, cap)`
    /// by model (see [`Ledger::hold_cap`]): a model's cap is its limit or the lowest hold.
    holds: BTreeMap<u64, Vec<(u64, u64)>>,
    next_hold: u64,
}

impl Ledger {
    pub(crate) fn new(global_limit: u64) -> Self {
        Ledger {
            global_limit,
            used: 0,
            leaked: 0,
            unused_guarantees: 0,
            models: BTreeMap::new(),
            holds: BTreeMap::new(),
            next_hold: 0,
        }
    }

    /// Unused guarantees of every model but `key`.
    pub(crate) fn reserved_for_others(&self, key: u64) -> u64 {
        let own = self.models.get(&key).map_or(0, ModelBook::unused_guarantee);
        self.unused_guarantees - own
    }

    pub(crate) fn unused_guarantees(&self) -> u64 {
        self.unused_guarantees
    }

    /// Apply `f` to a model's book, keeping the guarantee sum in step.
    fn update(&mut self, key: u64, f: impl FnOnce(&mut ModelBook)) {
        if let Some(m) = self.models.get_mut(&key) {
            let before = m.unused_guarantee();
            f(m);
            let after = m.unused_guarantee();
            self.unused_guarantees = self.unused_guarantees - before + after;
        }
    }

    /// Add a model; checks that its guarantee fits beside everything already promised.
    pub(crate) fn add(&mut self, key: u64, book: ModelBook) -> Result<(), u64> {
        let room = self
            .global_limit
            .saturating_sub(self.used.saturating_add(self.unused_guarantees));
        if book.guarantee > room {
            return Err(room);
        }
        self.unused_guarantees += book.unused_guarantee();
        self.models.insert(key, book);
        Ok(())
    }

    /// Drop a model's line. Memory still charged to it (its release failed at teardown)
    /// still exists: it stays counted as leaked.
    pub(crate) fn remove(&mut self, key: u64) {
        self.holds.remove(&key);
        if let Some(m) = self.models.remove(&key) {
            self.unused_guarantees -= m.unused_guarantee();
            if m.used > 0 {
                tracing::error!(model = %m.id, bytes = m.used, "model gone with memory the driver did not take back; it stays counted as leaked");
                self.leaked += m.used;
            }
        }
    }

    /// How many more bytes `key` could be charged right now.
    pub(crate) fn headroom(&self, key: u64) -> u64 {
        let Some(m) = self.models.get(&key) else {
            return 0;
        };
        if m.retired {
            return 0;
        }
        let own = m.limit.min(m.cap).saturating_sub(m.used);
        let global = self
            .global_limit
            .saturating_sub(self.used.saturating_add(self.reserved_for_others(key)));
        own.min(global)
    }

    /// How many more bytes `key` may hold under its own limit, whatever the global budget.
    pub(crate) fn headroom_own(&self, key: u64) -> u64 {
        match self.models.get(&key) {
            Some(m) if !m.retired => m.limit.min(m.cap).saturating_sub(m.used),
            _ => 0,
        }
    }

    /// Move a charge of `bytes` from `from` to `to` (memory handed over, not created): global
    /// use is unchanged; `to` must stay within its limit. Returns whether it was moved.
    pub(crate) fn transfer(&mut self, from: u64, to: u64, bytes: u64) -> bool {
        // The donor keeps its guarantee: its unused guarantee must not grow while `to` uses more.
        let donor_ok = self
            .models
            .get(&from)
            .is_some_and(|m| m.used >= bytes && (m.retired || m.used - bytes >= m.guarantee));
        if !donor_ok || bytes > self.headroom_own(to) {
            return false;
        }
        self.update(from, |m| m.used -= bytes);
        self.update(to, |m| {
            m.used += bytes;
            m.peak = m.peak.max(m.used);
        });
        true
    }

    /// Whether `bytes` more could be charged to `key` now, or why not.
    pub(crate) fn check(&self, key: u64, bytes: u64) -> Result<(), Refusal> {
        let m = match self.models.get(&key) {
            Some(m) if !m.retired => m,
            _ => return Err(Refusal::Retired),
        };
        if m.used
            .checked_add(bytes)
            .is_none_or(|n| n > m.limit.min(m.cap))
        {
            return Err(Refusal::ModelLimit);
        }
        // A sum past `u64::MAX` is past any limit (the shortfall then saturates).
        match self
            .used
            .checked_add(bytes)
            .and_then(|n| n.checked_add(self.reserved_for_others(key)))
        {
            Some(need) if need <= self.global_limit => Ok(()),
            need => Err(Refusal::Global {
                short: need.map_or(u64::MAX, |n| n - self.global_limit),
            }),
        }
    }

    /// Charge `bytes` to `key`, or say why not.
    pub(crate) fn try_charge(&mut self, key: u64, bytes: u64) -> Result<(), Refusal> {
        self.check(key, bytes)?;
        self.used += bytes;
        self.update(key, |m| {
            m.used += bytes;
            m.peak = m.peak.max(m.used);
        });
        Ok(())
    }

    /// Give `bytes` charged to `key` back.
    pub(crate) fn credit(&mut self, key: u64, bytes: u64) {
        if self.models.contains_key(&key) {
            self.used -= bytes;
            self.update(key, |m| m.used -= bytes);
        }
    }

    pub(crate) fn note_refusal(&mut self, key: u64) {
        self.update(key, |m| m.refusals += 1);
    }

    pub(crate) fn note_reclaimed(&mut self, key: u64, bytes: u64) {
        self.update(key, |m| m.reclaimed += bytes);
    }

    /// A limit change of `key` begins: the ones still under way are replaced. Returns its
    /// number.
    pub(crate) fn begin_change(&mut self, key: u64) -> u64 {
        let mut n = 0;
        self.update(key, |m| {
            m.changes += 1;
            n = m.changes;
        });
        n
    }

    /// Set a model's limit; its cap becomes the limit, or the lowest cap still held.
    pub(crate) fn set_limit(&mut self, key: u64, limit: u64) {
        self.update(key, |m| m.limit = limit);
        self.settle_cap(key);
    }

    /// Hold model `key`'s growth at or below `cap` until [`Ledger::release_cap`] of the ticket
    /// returned: other holds and limit changes meanwhile never lift it, and releasing it never
    /// lifts theirs (so concurrent limit changes cannot restore a stale cap over each other).
    pub(crate) fn hold_cap(&mut self, key: u64, cap: u64) -> u64 {
        self.next_hold += 1;
        let ticket = self.next_hold;
        self.holds.entry(key).or_default().push((ticket, cap));
        self.settle_cap(key);
        ticket
    }

    /// End the hold `ticket` on model `key`'s cap.
    pub(crate) fn release_cap(&mut self, key: u64, ticket: u64) {
        if let Some(h) = self.holds.get_mut(&key) {
            h.retain(|&(t, _)| t != ticket);
            if h.is_empty() {
                self.holds.remove(&key);
            }
        }
        self.settle_cap(key);
    }

    /// A model's cap from its limit and the caps held.
    fn settle_cap(&mut self, key: u64) {
        let held = self
            .holds
            .get(&key)
            .and_then(|h| h.iter().map(|&(_, c)| c).min());
        self.update(key, |m| m.cap = held.map_or(m.limit, |c| c.min(m.limit)));
    }

    /// Set a guarantee if it fits; else return the largest guarantee that would fit now.
    pub(crate) fn try_set_guarantee(&mut self, key: u64, guarantee: u64) -> Result<(), u64> {
        let Some(m) = self.models.get(&key) else {
            return Err(0);
        };
        let new_unused = guarantee.saturating_sub(m.used);
        let others = self.reserved_for_others(key);
        let room = self
            .global_limit
            .saturating_sub(self.used.saturating_add(others));
        if new_unused > room {
            return Err(m.used.saturating_add(room));
        }
        self.update(key, |m| m.guarantee = guarantee);
        Ok(())
    }

    pub(crate) fn retire(&mut self, key: u64) {
        self.update(key, |m| m.retired = true);
    }

    /// A retired model serves again (a lease re-attached): its guarantee is reserved again as
    /// far as the budget has room beside everything used or promised, and lowered to that
    /// otherwise. Returns the guarantee it has now.
    #[cfg(feature = "broker")]
    pub(crate) fn unretire(&mut self, key: u64) -> u64 {
        let room = self
            .global_limit
            .saturating_sub(self.used.saturating_add(self.unused_guarantees));
        let mut now = 0;
        self.update(key, |m| {
            m.retired = false;
            let unused = m.guarantee.saturating_sub(m.used);
            if unused > room {
                tracing::warn!(model = %m.id, guarantee = m.guarantee, room, "a re-attached model's guarantee does not fit beside the others'; lowered");
                m.guarantee = m.used.saturating_add(room);
            }
            now = m.guarantee;
        });
        now
    }

    /// The error for a refusal of `bytes` to `key`.
    pub(crate) fn refusal_error(&self, key: u64, bytes: u64, why: Refusal) -> Error {
        let m = self.models.get(&key);
        Error::AdmissionRefused {
            model: m.map_or_else(String::new, |m| m.id.to_string()),
            requested: bytes,
            cause: match why {
                Refusal::ModelLimit => "the model's limit",
                Refusal::Global { .. } => "the global budget",
                Refusal::Retired => "the model is unregistered",
                #[cfg(feature = "broker")]
                Refusal::Policy => "the operator's policy",
            },
            model_used: m.map_or(0, |m| m.used),
            model_limit: m.map_or(0, |m| m.limit.min(m.cap)),
            global_used: self.used,
            global_limit: self.global_limit,
            reserved_for_others: self.reserved_for_others(key),
        }
    }

    /// Check the book against itself (tests and debugging).
    pub(crate) fn audit(&self) -> Result<(), String> {
        let used: u64 = self.models.values().map(|m| m.used).sum::<u64>() + self.leaked;
        if used != self.used {
            return Err(format!(
                "models use {used} (leaked {} included), global says {}",
                self.leaked, self.used
            ));
        }
        let ug: u64 = self.models.values().map(ModelBook::unused_guarantee).sum();
        if ug != self.unused_guarantees {
            return Err(format!(
                "unused guarantees sum to {ug}, cached sum {}",
                self.unused_guarantees
            ));
        }
        if self.used > self.global_limit {
            return Err(format!(
                "global use {} above limit {}",
                self.used, self.global_limit
            ));
        }
        for m in self.models.values() {
            if m.used > m.limit {
                return Err(format!(
                    "model {} uses {} above its limit {}",
                    m.id, m.used, m.limit
                ));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn book(id: &str, limit: u64, guarantee: u64) -> ModelBook {
        ModelBook::new(id.into(), limit, guarantee, 0)
    }

    #[test]
    fn guarantees_are_kept_for_their_owner() {
        let mut l = Ledger::new(100);
        l.add(1, book("a", 100, 30)).unwrap();
        l.add(2, book("b", 100, 0)).unwrap();
        assert_eq!(l.headroom(2), 70);
        assert_eq!(l.try_charge(2, 71), Err(Refusal::Global { short: 1 }));
        l.try_charge(2, 70).unwrap();
        // a can still take its 30.
        l.try_charge(1, 30).unwrap();
        assert_eq!(l.try_charge(1, 1), Err(Refusal::Global { short: 1 }));
        l.credit(2, 70);
        l.try_charge(1, 50).unwrap();
        assert_eq!(l.used, 80);
        l.audit().unwrap();
        assert_eq!(l.add(3, book("c", 100, 21)), Err(20));
    }

    #[test]
    fn limits_and_caps() {
        let mut l = Ledger::new(1000);
        l.add(1, book("a", 100, 0)).unwrap();
        assert_eq!(l.try_charge(1, 101), Err(Refusal::ModelLimit));
        l.try_charge(1, 60).unwrap();
        let held = l.hold_cap(1, 50);
        assert_eq!(l.try_charge(1, 1), Err(Refusal::ModelLimit));
        l.release_cap(1, held);
        l.credit(1, 20);
        l.set_limit(1, 50);
        l.try_charge(1, 10).unwrap();
        assert_eq!(l.try_set_guarantee(1, 2000), Err(1000));
        l.try_set_guarantee(1, 50).unwrap();
        // Holds stack: releasing one never lifts another, nor does a new limit.
        let first = l.hold_cap(1, 40);
        let second = l.hold_cap(1, 30);
        assert_eq!(l.models[&1].cap, 30);
        l.release_cap(1, first);
        assert_eq!(l.models[&1].cap, 30);
        l.set_limit(1, 45);
        assert_eq!(l.models[&1].cap, 30);
        l.release_cap(1, second);
        assert_eq!(l.models[&1].cap, 45);
        l.set_limit(1, 50);
        assert_eq!(l.models[&1].cap, 50);
        l.retire(1);
        assert_eq!(l.try_charge(1, 1), Err(Refusal::Retired));
        assert_eq!(l.unused_guarantees(), 0);
        l.audit().unwrap();
    }
}
