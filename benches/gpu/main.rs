//! GPU benchmark binary: elastic-vmm against the driver's allocators, measured in one run,
//! with ratios printed. Built only with the `gpu-tests` feature.

mod pool;
mod shared;
#[cfg(feature = "candle")]
mod candle;

fn main() {}
