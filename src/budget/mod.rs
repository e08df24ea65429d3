//! The budget engine: who may hold how much physical memory, and where memory comes from when
//! the budget is full. One engine for both users of a budget: the in-process shared pool
//! ([`crate::shared`], whose donors are other models' pools in this process) and the broker
//! (`crate::broker`, whose donors are its own idle list and engines in other processes). They
//! differ only in how memory moves ([`Donors`]), never in who is asked or in what order.
//!
//! The book ([`Ledger`]) is pure arithmetic, one line per model; this module decides.
//!
//! # The rules
//! - **Admission.** A request of `N` bytes by model `M` is admitted when `M`'s use plus `N` stays
//!   within `min(limit, cap)` of `M` (the cap is held below the limit while a lowering of the
//!   limit is being reached), and the global use plus `N` stays within the global limit less
//!   the unused guarantees of the other models. A refusal by `M`'s own limit (or because `M` is
//!   unregistered) asks no one: only a short global budget makes donors give.
//! - **Who is asked first.** Donors are every other line above its guarantee, in one order:
//!   lowest priority first, then the one with the most to give, then the oldest line (lowest
//!   key). For each donor, its idle memory is taken first: whole chunks that fit the asker are
//!   handed over (no driver release or create: their charge moves from donor to asker), then
//!   what could not be handed over is reclaimed (given back to the driver; a donor with a
//!   reclaim callback, a model of this process or an engine the broker asks, may run it to
//!   free more than its idle memory). Memory no model holds (the broker's idle list, a line of the lowest priority)
//!   is the first donor; a transport may also reuse it before asking for a charge at all, as a
//!   pool reuses its own cache.
//! - **Never from the asker, never below a guarantee.** The asker is never its own donor (a
//!   transport may leave out more lines it cannot reach while the asker waits; the broker
//!   reaches every open connection's models, the asker's own other models included, since an
//!   engine's give-backs are served while its own growth waits). A donor
//!   gives at most `used - guarantee`; retired lines (unregistered or orphaned models) give
//!   nothing (their memory leaves with them).
//! - **What a guarantee protects.** A model's unused guarantee (`guarantee - used`, when
//!   positive) is budget no other model can be charged, and the guaranteed bytes it uses are
//!   never taken from it. A guarantee is admitted (at registration or raised later) only if it
//!   fits beside everything already used or promised, after donors were asked once.
//! - **What priority means.** Only the order in which donors give: it never lets a model exceed
//!   its limit or take a guarantee, and a higher priority does not make a model's own requests
//!   go first.
//! - **A request that cannot fit takes nothing.** When even every donor's spare memory would not
//!   cover what the global budget lacks, the request is refused before anything moves or anyone
//!   is asked (memory handed over to a doomed request would stay charged to it, out of
//!   everyone's reach). Look-ahead (optional) requests use the free budget only.
//! - **Bounded.** A request makes at most [`MAX_ROUNDS`] attempts to charge, and stops earlier
//!   when a round moved nothing. A reclaim waits at most its deadline (for a remote donor,
//!   `BrokerConfig::reclaim_wait`, from the request's first ask; engines are asked again only
//!   after an ask that gave something back, which engines growing at once may have taken
//!   first): when it times out the request goes on with what came back (only what the engines
//!   said they gave back counts) and is refused if that is not enough;
//!   memory given back late goes to the idle list and serves the next request.
//! - **Bookkeeping.** Everything moved is booked in the same critical section as the move's
//!   charge: a hand-over moves the charge (global use unchanged), a reclaim credits the donor
//!   when the driver has the memory back, and both count in the donor's `reclaimed`; a
//!   required request finally refused counts in the asker's `refusals`.
//!
//! Locks: the engine holds no lock of its own. [`Donors::with_ledger`] and [`Donors::charge`]
//! run under the transport's book lock; everything else ([`Donors::reachable`],
//! [`Donors::hand_over`], [`Donors::reclaim`]) is called with no lock held, and may make driver
//! calls, run callbacks or wait.

pub(crate) mod change;
pub(crate) mod ledger;

use std::sync::Arc;

use crate::pool::Inner as PoolInner;
pub(crate) use ledger::{Ledger, ModelBook, Refusal};

/// A model's reclaim callback: asked to free `bytes` of its memory (for example by evicting
/// KV blocks). It runs with no lock held; what it freed is given back afterwards.
pub type ReclaimCallback = Arc<dyn Fn(u64) + Send + Sync>;

/// The most attempts to charge one request makes (each after a round of donors).
pub(crate) const MAX_ROUNDS: usize = 4;

/// One donor of a plan: a ledger line and how many bytes it is asked for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Ask {
    pub(crate) key: u64,
    pub(crate) bytes: u64,
}

/// How memory moves for one request: between pools of this process, or through the broker.
/// The engine calls it; it never decides who gives or in what order.
pub(crate) trait Donors {
    /// Run `f` on the book, under its lock.
    fn with_ledger<R>(&self, f: impl FnOnce(&mut Ledger) -> R) -> R;

    /// Charge `bytes` to `asker` (under the book's lock, with whatever else the transport must
    /// book in the same critical section), or say why not.
    fn charge(&self, asker: u64, bytes: u64) -> Result<(), Refusal>;

    /// The lines that could give now, with what each holds idle or could be asked for
    /// (`u64::MAX` when only the donor knows), measured with no lock held. Lines left out are
    /// not reachable for this request.
    fn reachable(&mut self, asker: u64) -> Vec<(u64, u64)>;

    /// Hand over idle memory of donor `from` to `asker` as whole chunks, at most `want` bytes
    /// or one chunk that serves the whole request (the broker's), moving their charge in the
    /// book; returns the bytes moved (0 when this transport cannot move the donor's memory
    /// directly).
    fn hand_over(&mut self, asker: u64, from: Ask, want: u64) -> u64;

    /// Bytes the same request will ask for after this charge (the rest of a batch of chunks,
    /// admitted one at a time): donors are asked for them too, as they are asked at most once
    /// per request.
    fn rest(&self) -> u64 {
        0
    }

    /// Make `asks` (in order) give memory back to the driver or the idle list, within the
    /// transport's deadline; returns the bytes given back.
    fn reclaim(&mut self, asks: &[Ask]) -> u64;
}

/// The donors for `asker`, in the engine's one order (lowest priority, then most to give, then
/// lowest key), each with what it may give: what it holds idle (`reachable`) but never below
/// its guarantee. The asker, retired lines and lines with nothing to give are left out.
pub(crate) fn donors(ledger: &Ledger, asker: u64, reachable: &[(u64, u64)]) -> Vec<Ask> {
    let mut out: Vec<(i32, Ask)> = reachable
        .iter()
        .filter(|&&(key, _)| key != asker)
        .filter_map(|&(key, idle)| {
            let m = ledger.models.get(&key).filter(|m| !m.retired)?;
            let bytes = idle.min(m.used.saturating_sub(m.guarantee));
            (bytes > 0).then_some((m.priority, Ask { key, bytes }))
        })
        .collect();
    out.sort_by_key(|&(p, a)| (p, std::cmp::Reverse(a.bytes), a.key));
    out.into_iter().map(|(_, a)| a).collect()
}

/// `donors` cut to `want` bytes in all, in order.
pub(crate) fn plan(donors: &[Ask], want: u64) -> Vec<Ask> {
    let mut left = want;
    let mut out = Vec::new();
    for a in donors {
        if left == 0 {
            break;
        }
        let bytes = a.bytes.min(left);
        left -= bytes;
        out.push(Ask { key: a.key, bytes });
    }
    out
}

/// What [`admit`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Admitted {
    /// Bytes handed over to the asker (charged to it already).
    pub(crate) handed: u64,
    /// Bytes charged for the asker to create, or why the rest (`left` bytes) was refused.
    pub(crate) charged: Result<u64, (Refusal, u64)>,
}

/// Admission of `bytes` for `asker` under the rules of the module documentation. `optional`:
/// a look-ahead, served from the free budget only. A refused request may still come back with
/// bytes handed over (it lost a race for the rest): the caller gives them back.
pub(crate) fn admit(d: &mut impl Donors, asker: u64, bytes: u64, optional: bool) -> Admitted {
    let mut left = bytes;
    let mut handed = 0u64;
    let mut why = Refusal::Retired;
    for round in 0..MAX_ROUNDS {
        let short = match d.charge(asker, left) {
            Ok(()) => {
                return Admitted {
                    handed,
                    charged: Ok(left),
                }
            }
            Err(r @ Refusal::Global { short }) if !optional && round + 1 < MAX_ROUNDS => {
                why = r;
                short
            }
            Err(r) => {
                why = r;
                break;
            }
        };
        let reach = d.reachable(asker);
        let donors = d.with_ledger(|l| donors(l, asker, &reach));
        let spare = donors.iter().fold(0u64, |s, a| s.saturating_add(a.bytes));
        if spare < short {
            tracing::debug!(
                model = asker,
                short,
                spare,
                "other models' spare memory cannot make room"
            );
            break;
        }
        // Idle memory first, as whole chunks: only what the budget lacks moves.
        let want = short.min(left);
        let mut moved = 0u64;
        for &a in &donors {
            if moved >= want {
                break;
            }
            moved += d.hand_over(asker, a, want - moved);
        }
        let moved = moved.min(left);
        if moved > 0 {
            handed += moved;
            left -= moved;
            if left == 0 {
                return Admitted {
                    handed,
                    charged: Ok(0),
                };
            }
            continue;
        }
        if d.reclaim(&plan(&donors, short.saturating_add(d.rest()))) == 0 {
            break;
        }
    }
    if !optional {
        d.with_ledger(|l| l.note_refusal(asker));
    }
    Admitted {
        handed,
        charged: Err((why, left)),
    }
}

/// Make room for `want` bytes of guarantee (at registration or when raised) for `asker`
/// (whose line may not exist yet): the donors, in order, asked once. Returns the bytes given
/// back.
pub(crate) fn make_room(d: &mut impl Donors, asker: u64, want: u64) -> u64 {
    let reach = d.reachable(asker);
    let donors = d.with_ledger(|l| donors(l, asker, &reach));
    d.reclaim(&plan(&donors, want))
}

/// What a model gave back when asked: from its idle memory, and after its callback.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct GivenBack {
    pub(crate) idle: u64,
    pub(crate) by_callback: u64,
}

/// A model asked for `bytes` (a donor for another model, or its own limit lowered): its idle
/// and cached memory first (front caches flushed), then its callback, then what that freed.
/// Runs with no lock held; the same in this process and in an engine asked by the broker.
pub(crate) fn give_back(
    pool: &PoolInner,
    callback: Option<&ReclaimCallback>,
    bytes: u64,
) -> (GivenBack, crate::error::Result<()>) {
    let mut got = GivenBack::default();
    // Freed blocks front caches keep (routing's) are idle memory of the model too.
    pool.flush_fronts();
    let mut result = pool.reclaim(bytes).map(|n| got.idle = n);
    if result.is_ok() && got.idle < bytes {
        if let Some(cb) = callback {
            tracing::info!(pool = %pool.name(), bytes = bytes - got.idle, "asking the model to free memory");
            cb(bytes - got.idle);
            pool.flush_fronts();
            result = pool.reclaim(bytes - got.idle).map(|n| got.by_callback = n);
        }
    }
    (got, result)
}

#[cfg(test)]
mod tests;
