//! README quick start "several candle models in one process", the routing half: every CUDA
//! allocation candle makes inside a route (weights, activations) comes from a model of a
//! shared pool, under its limit, tagged; the model sleeps and wakes at the same addresses.
//! Needs a CUDA GPU and the `candle` feature; CI compiles it (`tests/readme.rs` checks the
//! README's lines are this file's). `quickstart_models` shows the shared pool on any machine.

elastic_vmm::route_cuda_allocations!(); // once per binary, like #[global_allocator]

use candle_core::{DType, Device, Tensor};
use elastic_vmm::{route, AfterWake, ModelConfig, SharedPool, SharedPoolConfig, SleepPolicy, Tag};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let device = Device::new_cuda(0)?;
    let gpu = SharedPool::cuda(0, SharedPoolConfig::new())?; // the device's free memory, less 1 GiB
    let llama = gpu.register(ModelConfig::new("llama", 64 << 30, 2 << 30))?; // 64 GiB of addresses, 2 GiB limit
    let w = route::with_route(&llama, Tag::Weights, || {
        Tensor::randn(0f32, 1.0, (4096, 4096), &device)
    })??;
    let x = route::with_route(&llama, Tag::Activations, || {
        Tensor::ones((8, 4096), DType::F32, &device)
    })??;
    let y = route::with_route(&llama, Tag::Activations, || x.matmul(&w))??; // candle's own allocations, in llama's pool
    let before = y.sum_all()?.to_scalar::<f32>()?;
    println!(
        "{}",
        route::report(&llama, 5)
            .map(|r| r.to_string())
            .unwrap_or_default()
    );
    drop((x, y));
    llama.sleep(&SleepPolicy::offload_all())?; // weights to host, no GPU memory held
    llama.wake(AfterWake::FreeHostMemory)?; // same addresses: `w` is valid again
    let x = route::with_route(&llama, Tag::Activations, || {
        Tensor::ones((8, 4096), DType::F32, &device)
    })??;
    let after = route::with_route(&llama, Tag::Activations, || {
        x.matmul(&w)?.sum_all()?.to_scalar::<f32>()
    })??;
    assert_eq!(before, after);
    println!("quickstart_routing: ok");
    Ok(())
}
