//! README quick start "several candle models in one process", the routing half: every CUDA
//! allocation candle makes inside a route (weights, activations) comes from a model of a
//! shared pool, under its limit, tagged; the model sleeps and wakes at the same addresses.
//! Needs a CUDA GPU and the `candle` feature; CI compiles it (`tests/readme.rs` checks the
//! README's lines are this file's). `quickstart_models` shows the shared pool on any machine.

elastic_vmm::route_cuda_allocations!(); // once per binary, like #[global_allocator]

use candle_core::{DType, Device, Tensor};
use elastic_vmm::{route, AfterWake, ModelConfig, SharedPool, SharedPoolConfig, SleepPolicy, Tag};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let dev = Device::new_cuda(0)?;
    let gpu = SharedPool::cuda(0, SharedPoolConfig::new())?; // the GPU's free memory less 1 GiB
    let llama = gpu.register(ModelConfig::new("llama", 64 << 30, 2 << 30))?; // 2 GiB limit
    let load = || Tensor::randn(0f32, 1.0, (4096, 4096), &dev); // stands for loading weights
    let w = route::with_route(&llama, Tag::Weights, load)??; // candle's allocations, llama's pool
    let x = Tensor::ones((8, 4096), DType::F32, &dev)?; // outside a route: candle's own memory
    let y = route::with_route(&llama, Tag::Activations, || x.matmul(&w))??;
    let before = y.sum_all()?.to_scalar::<f32>()?;
    if let Some(report) = route::report(&llama, 5) {
        println!("{report}"); // live routed bytes by tag, the largest blocks
    }
    drop(y);
    llama.sleep(&SleepPolicy::offload_all())?; // weights to host memory, no GPU memory held
    llama.wake(AfterWake::FreeHostMemory)?; // same addresses: `w` is valid again
    let y = route::with_route(&llama, Tag::Activations, || x.matmul(&w))??;
    assert_eq!(y.sum_all()?.to_scalar::<f32>()?, before);
    println!("quickstart_routing: ok");
    Ok(())
}
