//! Faults: a hook of [`Intercept`] that fails chosen driver calls, to prove that every
//! multi-step operation rolls back. Calls it does not fail go straight through.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use parking_lot::Mutex;

use crate::backend::intercept::{Call, Hook, Intercept};
use crate::backend::{BackendInfo, DriverCall};
use crate::error::{Error, Result};

/// A backend that fails the Nth call of a chosen kind with a `FAULT_INJECTED` error:
/// [`Intercept`] with [`Faults`] (`FaultInjector::new(inner)`).
pub type FaultInjector = Intercept<Faults>;

/// Fails the Nth call of a chosen kind with a `FAULT_INJECTED` error. A batch create fails as
/// a whole (before anything is made) when any of its chunks would; each chunk of a batch
/// release fails or goes through on its own.
#[derive(Debug, Default)]
pub struct Faults {
    calls: [AtomicU64; DriverCall::ALL.len()],
    plans: Mutex<Vec<Plan>>,
    /// Staging copies (to or from host memory) seen, and the counts at which one fails.
    copies: AtomicU64,
    copy_plans: Mutex<Vec<u64>>,
    /// Clears before mapping are refused as unsupported (as on a backend that clears only
    /// mapped memory), until [`Self::clear`].
    no_wipes: AtomicBool,
}

#[derive(Debug, Clone, Copy)]
struct Plan {
    call: DriverCall,
    /// Fail when the call counter reaches this value (1-based, counted from arming).
    at: u64,
    /// Keep failing every later call of this kind too.
    sticky: bool,
}

impl Faults {
    /// Fail the `n`-th call (1-based) of kind `call` made from now on.
    pub fn fail_nth(&self, call: DriverCall, n: u64) {
        let at = self.calls[call.index()].load(Ordering::SeqCst) + n.max(1);
        self.plans.lock().push(Plan {
            call,
            at,
            sticky: false,
        });
    }

    /// Fail every call of kind `call` from the `n`-th one (1-based) on, until [`Self::clear`].
    pub fn fail_from(&self, call: DriverCall, n: u64) {
        let at = self.calls[call.index()].load(Ordering::SeqCst) + n.max(1);
        self.plans.lock().push(Plan {
            call,
            at,
            sticky: true,
        });
    }

    /// Disarm every planned failure.
    pub fn clear(&self) {
        self.plans.lock().clear();
        self.copy_plans.lock().clear();
        self.no_wipes.store(false, Ordering::SeqCst);
    }

    /// Refuse every clear of an unmapped chunk ([`crate::Backend::wipe_chunk`]) as
    /// unsupported from now on, as a backend that can clear only mapped memory does: the pool
    /// fills such chunks once mapped.
    pub fn refuse_wipes(&self) {
        self.no_wipes.store(true, Ordering::SeqCst);
    }

    /// Fail the `n`-th staging copy (1-based; to or from host memory, as sleep and wake make
    /// them) made from now on.
    pub fn fail_copy_nth(&self, n: u64) {
        let at = self.copies.load(Ordering::SeqCst) + n.max(1);
        self.copy_plans.lock().push(at);
    }

    /// How many staging copies went through this adaptor (failed ones included).
    pub fn staging_copies(&self) -> u64 {
        self.copies.load(Ordering::SeqCst)
    }

    fn check_copy(&self, upstream: &BackendInfo) -> Result<()> {
        let n = self.copies.fetch_add(1, Ordering::SeqCst) + 1;
        let mut plans = self.copy_plans.lock();
        if let Some(i) = plans.iter().position(|&at| at == n) {
            plans.remove(i);
            drop(plans);
            tracing::debug!(n, "injecting a staging copy failure");
            return Err(Error::backend(
                upstream.name,
                "staging copy",
                "FAULT_INJECTED",
                format!("staging copy #{n} failed on purpose"),
            ));
        }
        Ok(())
    }

    /// How many calls of `call` went through this adaptor (failed ones included).
    pub fn calls(&self, call: DriverCall) -> u64 {
        self.calls[call.index()].load(Ordering::SeqCst)
    }

    /// Count the call and decide whether it fails.
    fn check(&self, call: DriverCall, upstream: &BackendInfo) -> Result<()> {
        let n = self.calls[call.index()].fetch_add(1, Ordering::SeqCst) + 1;
        let mut plans = self.plans.lock();
        let hit = plans
            .iter()
            .position(|p| p.call == call && (n == p.at || (p.sticky && n >= p.at)));
        if let Some(i) = hit {
            if !plans[i].sticky {
                plans.remove(i);
            }
            drop(plans);
            tracing::debug!(%call, n, "injecting a driver failure");
            return Err(Error::backend(
                upstream.name,
                call.name(),
                "FAULT_INJECTED",
                format!("call #{n} of {call} failed on purpose"),
            ));
        }
        Ok(())
    }
}

impl Hook for Faults {
    type Pass = ();

    fn before(&self, call: &Call, upstream: &BackendInfo) -> Result<()> {
        match call.kind() {
            // A batch: one check per chunk, the first failure fails it all.
            Some(kind) => (0..call.count()).try_for_each(|_| self.check(kind, upstream)),
            None if matches!(call, Call::StagingCopy { .. }) => self.check_copy(upstream),
            None if matches!(call, Call::Wipe { .. }) && self.no_wipes.load(Ordering::SeqCst) => {
                Err(Error::backend(
                    upstream.name,
                    "wipe_chunk",
                    "UNSUPPORTED",
                    "clearing before mapping refused on purpose",
                ))
            }
            None => Ok(()),
        }
    }
}
