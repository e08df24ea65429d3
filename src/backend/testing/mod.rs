//! Test adaptors: [`DelayInjector`] and [`FaultInjector`], hooks of the one
//! [`Intercept`](super::intercept::Intercept) adaptor that widen race windows and prove
//! rollbacks. Not part of the supported API (hidden from the docs); the crate's own tests, the
//! GPU tests and the benchmarks use them.

mod delay;
mod fault;

pub use delay::{Delay, DelayInjector, DelayPoint, Delays};
pub use fault::{FaultInjector, Faults};
