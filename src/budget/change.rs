//! Live changes of a model's limit and guarantee: the same rules for the shared pool and the
//! broker (see the module documentation of [`super`]).
//!
//! - Raising a limit, or lowering it to no less than the model uses, takes effect at once.
//! - Lowering below its use holds the model's growth at the new limit at once (a cap held for
//!   this change only), asks the model for the difference (its idle memory first, then its
//!   reclaim callback) and, if it then uses no more than the new limit, sets it. Otherwise (the
//!   model could not free enough, or a remote engine did not within the deadline) the old limit
//!   stays, and only this change's cap is lifted: concurrent changes never restore a stale cap
//!   over each other.
//! - A later change of the same model replaces one still under way: the earlier one stops
//!   waiting (a remote one) or, done asking (a local one), leaves the limit as the later change
//!   set it, and says so.
//! - A limit is at least 1 byte and at least the model's guarantee.
//! - Raising a guarantee needs room beside every other model's use and unused guarantee; the
//!   donors are asked once to make it (as for a growth: lowest priority first, above their
//!   guarantees), else nothing changes and the refusal says how much would fit.

use super::{make_room, Donors, GivenBack, Ledger};
use crate::error::Error;

/// How a model is asked for its own memory when its limit is lowered.
pub(crate) trait Lowering {
    /// Run `f` on the book, under its lock.
    fn with_ledger<R>(&self, f: impl FnOnce(&mut Ledger) -> R) -> R;

    /// Ask model `key` to give back `bytes` of its own memory (idle first, then its callback),
    /// booking what it gave in its `reclaimed`; return when it answered, or as soon as
    /// `settled` holds, or at the transport's deadline. Called with no lock held.
    fn ask_own(
        &mut self,
        key: u64,
        bytes: u64,
        settled: &dyn Fn(&Ledger) -> bool,
    ) -> (GivenBack, Result<(), Error>);
}

/// A limit change that took effect.
#[derive(Debug)]
pub(crate) struct LimitChanged {
    /// What the model used when the change began (the broker reports the difference), and
    /// after.
    #[cfg_attr(not(feature = "broker"), allow(dead_code))]
    pub(crate) before: u64,
    pub(crate) used: u64,
    /// What the model gave back, as far as this process knows.
    pub(crate) given: GivenBack,
}

/// Why a limit change did not take effect.
#[derive(Debug)]
pub(crate) enum LimitRefused {
    /// No such model (or it is unregistered).
    Unknown,
    /// The limit is 0 or below the guarantee.
    Invalid { guarantee: u64 },
    /// A later change began while this one was under way; the limit is now `now`.
    Replaced { now: u64 },
    /// The model still uses `used` bytes; the limit stays `standing`.
    NotReached {
        before: u64,
        used: u64,
        standing: u64,
        error: Option<Box<Error>>,
    },
}

/// Set model `key`'s limit under the rules of the module documentation.
pub(crate) fn set_limit(
    o: &mut impl Lowering,
    key: u64,
    limit: u64,
) -> Result<LimitChanged, LimitRefused> {
    let (old, before, change, hold) = o.with_ledger(|l| {
        let m = l.models.get(&key).filter(|m| !m.retired);
        let m = m.ok_or(LimitRefused::Unknown)?;
        if limit == 0 || limit < m.guarantee {
            return Err(LimitRefused::Invalid {
                guarantee: m.guarantee,
            });
        }
        let (old, used) = (m.limit, m.used);
        let change = l.begin_change(key);
        if used <= limit {
            l.set_limit(key, limit);
            return Ok((old, used, change, None));
        }
        // Growth stops at the new limit at once; the model is asked for the rest.
        Ok((old, used, change, Some(l.hold_cap(key, limit))))
    })?;
    let Some(hold) = hold else {
        tracing::info!(model = key, old, limit, "limit changed");
        return Ok(LimitChanged {
            before,
            used: before,
            given: GivenBack::default(),
        });
    };
    let settled = |l: &Ledger| {
        l.models
            .get(&key)
            .is_none_or(|m| m.used <= limit || m.changes != change)
    };
    let (given, result) = o.ask_own(key, before - limit, &settled);
    o.with_ledger(|l| {
        l.release_cap(key, hold);
        let m = l.models.get(&key).ok_or(LimitRefused::Unknown)?;
        let (used, standing) = (m.used, m.limit);
        if m.changes != change {
            return Err(LimitRefused::Replaced { now: standing });
        }
        if m.guarantee > limit {
            // Raised while the model was asked (no lock held): checked again, as at the start.
            return Err(LimitRefused::Invalid {
                guarantee: m.guarantee,
            });
        }
        if used <= limit {
            l.set_limit(key, limit);
            if let Err(e) = &result {
                tracing::warn!(model = key, error = %e, "giving memory back partly failed; the limit is reached");
            }
            tracing::info!(model = key, old, limit, reclaimed = before.saturating_sub(used), "limit lowered");
            return Ok(LimitChanged {
                before,
                used,
                given,
            });
        }
        tracing::warn!(model = key, limit, used, "limit could not be lowered");
        Err(LimitRefused::NotReached {
            before,
            used,
            standing,
            error: result.err().map(Box::new),
        })
    })
}

/// Why a guarantee change did not take effect.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum GuaranteeRefused {
    Unknown,
    AboveLimit {
        limit: u64,
    },
    /// At most `max` bytes fit; `reclaimed` bytes were given back trying.
    NoRoom {
        max: u64,
        reclaimed: u64,
    },
}

/// Set model `key`'s guarantee: lowering at once, raising if it fits, after the donors were
/// asked once to make room. `allowed` is the transport's own policy, checked with the book.
/// Returns the model's use and the bytes given back to make room.
pub(crate) fn set_guarantee<E>(
    d: &mut impl Donors,
    key: u64,
    guarantee: u64,
    allowed: impl Fn(&Ledger) -> Result<(), E>,
) -> Result<Result<(u64, u64), GuaranteeRefused>, E> {
    enum Step {
        Done(u64),
        Refused(GuaranteeRefused),
        Short(u64),
    }
    let mut reclaimed = 0;
    for attempt in 0..2 {
        let step = d.with_ledger(|l| {
            let Some(m) = l.models.get(&key).filter(|m| !m.retired) else {
                return Ok(Step::Refused(GuaranteeRefused::Unknown));
            };
            if guarantee > m.limit {
                let limit = m.limit;
                return Ok(Step::Refused(GuaranteeRefused::AboveLimit { limit }));
            }
            allowed(l)?;
            Ok(match l.try_set_guarantee(key, guarantee) {
                Ok(()) => Step::Done(l.models.get(&key).map_or(0, |m| m.used)),
                Err(max) => Step::Short(max),
            })
        })?;
        match step {
            Step::Done(used) => {
                tracing::info!(model = key, guarantee, "guarantee changed");
                return Ok(Ok((used, reclaimed)));
            }
            Step::Refused(r) => return Ok(Err(r)),
            Step::Short(max) => {
                let got = if attempt == 0 {
                    make_room(d, key, guarantee - max)
                } else {
                    0
                };
                reclaimed += got;
                if got == 0 {
                    return Ok(Err(GuaranteeRefused::NoRoom { max, reclaimed }));
                }
            }
        }
    }
    Ok(Err(GuaranteeRefused::NoRoom { max: 0, reclaimed }))
}
