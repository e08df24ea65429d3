//! The GPU test target: every test that needs a CUDA GPU, in one binary to carry to the GPU
//! machine (see README, "GPU tests"). Built only with the `gpu-tests` feature; on a machine
//! without a usable CUDA device every test here fails, by design, rather than skipping.

#[path = "../suite/mod.rs"]
mod suite;

mod backing;
mod layout;
mod pool;
mod shared;
mod sleep;
mod soundness;

#[cfg(feature = "candle")]
mod candle;
#[cfg(feature = "nixl")]
mod nixl;
