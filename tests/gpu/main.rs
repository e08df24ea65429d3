//! The GPU test target: every test that needs a CUDA GPU, in one binary to carry to the GPU
//! machine (see README, "GPU tests"). Built only with the `gpu-tests` feature; on a machine
//! without a usable CUDA device every test here fails, by design, rather than skipping.

#[path = "../suite/mod.rs"]
mod suite;

mod backing;
mod broker;
mod gather;
mod kv;
mod layout;
mod p2p;
mod pool;
mod shared;
mod sleep;
mod soundness;
mod tiers;

#[cfg(feature = "candle")]
mod attention;
#[cfg(feature = "candle")]
mod candle;
#[cfg(feature = "candle")]
mod paged_kv;
#[cfg(feature = "candle")]
mod prefill;
#[cfg(feature = "candle")]
mod route;

// Candle's allocations in this binary go through routing's hooks (forwarded to the driver
// outside a route), as in an application that opts in.
elastic_vmm::route_cuda_allocations!();
#[cfg(feature = "nixl")]
mod nixl;
