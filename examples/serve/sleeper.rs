//! An engine process's sleep and wake under the sleep policies of `deploy.rs`, through the
//! broker's interfaces only.
//!
//! Asleep, a model holds nothing the others could use: its base pool sleeps (`Pool::sleep`:
//! every live byte, weights and whatever else lives there, copied to host memory, chunks given
//! back to the broker, addresses kept), then its base model's guarantee goes to 0 and its KV
//! model's to the zero page, over the engine's own control connection, as an operator's
//! `elastic-vmm ctl` would. A wake asks the guarantees back first: the broker grants them
//! only where the budget has room beside every other model's use and guarantees (asking idle
//! engines to give back), so no more models are awake than the memory holds; refused, nothing
//! is held and the engine tries again while its requests wait (in their TTFT). Then the pool
//! wakes at the same addresses. Sleeping a model with work queued is the caller's to avoid.

use std::path::Path;
use std::time::{Duration, Instant};

use elastic_vmm::broker::protocol::{ErrorKind, Reply, Request};
use elastic_vmm::broker::BrokerClient;
use elastic_vmm::kv::PagedKv;
use elastic_vmm::{AfterWake, Error, Pool, SleepPolicy};

/// Back-off between wake attempts the broker had no room for: from the first, doubling to
/// the second, each drawn at random between half and all of it, so that engines waiting
/// together do not keep asking in step.
const BACKOFF: (Duration, Duration) = (Duration::from_millis(2), Duration::from_millis(32));

/// What a run's sleeps and wakes did.
#[derive(Debug, Clone, Copy, Default)]
pub struct SleepCounts {
    /// Sleeps.
    pub sleeps: u64,
    /// Wakes.
    pub wakes: u64,
    /// Wakes that waited for room (their first attempt refused).
    pub waited: u64,
    /// Seconds those waited, from the first refused attempt to the wake.
    pub wait_s: f64,
    /// Wall seconds in sleeps.
    pub sleep_s: f64,
    /// Wall seconds in wakes that succeeded.
    pub wake_s: f64,
}

/// One engine's sleeps and wakes.
pub struct Sleeper {
    control: BrokerClient,
    pool: Pool,
    base_model: String,
    kv_model: String,
    /// The base model's guarantee while awake.
    base: u64,
    /// The KV model's guarantee while asleep.
    zero_page: u64,
    /// Since when a wake has waited for room, and the attempts refused.
    waiting: Option<(Instant, u32)>,
    /// This run's counts.
    pub counts: SleepCounts,
}

impl Sleeper {
    /// A sleeper for model `id` (its base model `id`, its KV model `{id}-kv`) whose base pool
    /// is `pool`, awake with a guarantee of `base`; `staging` bytes of host memory are set
    /// aside now for its copies (pinned once, off the sleep path).
    pub fn new(
        socket: &Path,
        id: &str,
        pool: &Pool,
        base: u64,
        zero_page: u64,
        staging: u64,
    ) -> Result<Sleeper, String> {
        let control = BrokerClient::connect_control(socket, &format!("{id}-sleeper"))
            .map_err(|e| format!("{id}: control connection: {e}"))?;
        pool.reserve_host_staging(staging)
            .map_err(|e| format!("{id}: {staging} bytes of host staging: {e}"))?;
        Ok(Sleeper {
            control,
            pool: pool.clone(),
            base_model: id.to_string(),
            kv_model: format!("{id}-kv"),
            base,
            zero_page,
            waiting: None,
            counts: SleepCounts::default(),
        })
    }

    /// Whether the model is asleep (its base pool's own state: a sleep whose rollback failed
    /// leaves it asleep too).
    pub fn is_asleep(&self) -> bool {
        self.pool.is_asleep()
    }

    /// Put the model to sleep: the KV cache's warm blocks and `kv_pool`'s pages back to the
    /// broker (the caller holds no block), the base pool asleep, then both guarantees down.
    pub fn sleep(&mut self, kv: &PagedKv, kv_pool: &Pool) -> Result<(), String> {
        if self.is_asleep() {
            return Ok(());
        }
        let t = Instant::now();
        kv.trim();
        kv_pool.trim().map_err(|e| e.to_string())?;
        self.pool
            .sleep(&SleepPolicy::offload_all())
            .map_err(|e| format!("{}: sleep: {e}", self.base_model))?;
        self.set(&self.base_model, 0)
            .and_then(|()| self.set(&self.kv_model, self.zero_page))
            .map_err(|r| r.unwrap_or_else(|| "lowering a guarantee had no room".into()))?;
        self.counts.sleeps += 1;
        self.counts.sleep_s += t.elapsed().as_secs_f64();
        Ok(())
    }

    /// Wake the model if the broker has room for its base, and for `kv_guarantee` (its KV
    /// model's guarantee while awake; `None` leaves the KV model's as it is): `Ok(false)`,
    /// holding nothing more, when not; call again after [`Sleeper::backoff`]. Any other
    /// failure is an error.
    pub fn try_wake(&mut self, kv_guarantee: Option<u64>) -> Result<bool, String> {
        if !self.is_asleep() {
            return Ok(true);
        }
        let t = Instant::now();
        let held = self
            .set(&self.base_model, self.base)
            .and_then(|()| match kv_guarantee {
                Some(g) => self.set(&self.kv_model, g),
                None => Ok(()),
            });
        let woke = match held {
            Ok(()) => match self.pool.wake(AfterWake::KeepHostMemory) {
                Ok(_) => Ok(()),
                // Room the guarantee held was taken before the pool's growth (its sleeping
                // bytes above the base): wait like a refused guarantee.
                Err(e @ Error::WakeRefused { .. }) => {
                    tracing::debug!(model = %self.base_model, error = %e, "wake refused");
                    Err(())
                }
                Err(e) => return Err(format!("{}: wake: {e}", self.base_model)),
            },
            Err(Some(e)) => return Err(e),
            Err(None) => Err(()),
        };
        if woke.is_err() {
            // Nothing kept while the model waits: the room goes back to the others.
            self.set(&self.base_model, 0)
                .and_then(|()| match kv_guarantee {
                    Some(_) => self.set(&self.kv_model, self.zero_page),
                    None => Ok(()),
                })
                .map_err(|r| r.unwrap_or_else(|| "lowering a guarantee had no room".into()))?;
            let (_, n) = self.waiting.get_or_insert((t, 0));
            *n += 1;
            if *n == 1 {
                self.counts.waited += 1;
            }
            return Ok(false);
        }
        self.counts.wakes += 1;
        self.counts.wake_s += t.elapsed().as_secs_f64();
        if let Some((since, _)) = self.waiting.take() {
            self.counts.wait_s += since.elapsed().as_secs_f64();
        }
        Ok(true)
    }

    /// How long to wait before the next wake attempt after a refused one.
    pub fn backoff(&self) -> Duration {
        let n = self.waiting.map_or(0, |(_, n)| n.saturating_sub(1)).min(8);
        let d = BACKOFF.0.saturating_mul(1 << n).min(BACKOFF.1);
        d.mul_f64(0.5 + rand::random::<f64>() / 2.0)
    }

    /// Set `model`'s guarantee: `Err(None)` where the broker has no room, `Err(Some)` for
    /// any other failure.
    fn set(&self, model: &str, guarantee: u64) -> Result<(), Option<String>> {
        let request = Request::SetGuarantee {
            model: model.to_string(),
            guarantee,
        };
        match self.control.request(request) {
            Ok((Reply::Changed(c), _)) if c.guarantee == guarantee => Ok(()),
            Ok((
                Reply::Error {
                    kind: ErrorKind::NotReached,
                    ..
                },
                _,
            )) => Err(None),
            Ok((other, _)) => Err(Some(format!("{model}: guarantee {guarantee}: {other:?}"))),
            Err(e) => Err(Some(format!("{model}: guarantee {guarantee}: {e}"))),
        }
    }
}
