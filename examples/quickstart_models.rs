//! README quick start "several models in one process": two models on one shared pool, each
//! under its own limit, idle memory moving to the busy one, a model put to sleep and woken at
//! the same addresses. Runs on the host backend (real memory), anywhere; on a GPU write
//! `SharedPool::cuda(0, SharedPoolConfig::new())`. The README's lines are this file's
//! (`tests/readme.rs` checks them); `scripts/test.sh` runs it.
//!
//! Routing candle's own allocations into these models is `quickstart_routing` (a GPU).

use elastic_vmm::{
    AfterWake, MemOptions, ModelConfig, SharedPool, SharedPoolConfig, SleepPolicy, Tag,
};

const MIB: u64 = 1 << 20;

fn main() -> elastic_vmm::Result<()> {
    let gpu = SharedPool::host(SharedPoolConfig::new().global_limit(64 << 20))?; // 64 MiB for all
    let llama = gpu.register(ModelConfig::new("llama", 1 << 30, 48 << 20))?; // 1 GiB of addresses, 48 MiB limit
    let qwen = gpu.register(ModelConfig::new("qwen", 1 << 30, 48 << 20).guarantee(8 << 20))?;

    let mut weights = llama.allocate_with(24 << 20, &MemOptions::new().tag(Tag::Weights))?;
    weights.write(0, b"llama's weights")?;
    let activations = llama.allocate_with(24 << 20, &MemOptions::new().tag(Tag::Activations))?;
    drop(activations); // idle now: mapped, llama's, and anyone's who needs it
    let burst = qwen.allocate(32 << 20)?; // more than is free: llama's idle memory moves over
    let stats = gpu.stats();
    for m in &stats.models {
        println!(
            "{:>6}: uses {:>3} MiB, limit {} MiB",
            m.id,
            m.used / MIB,
            m.limit / MIB
        );
    }
    assert!(qwen.allocate(32 << 20).is_err()); // qwen's 48 MiB limit: refused, with the numbers
    drop(burst);

    let at = weights.addr();
    llama.sleep(&SleepPolicy::offload_all())?; // weights to host memory, nothing physical left
    assert_eq!(llama.model_stats().map(|m| m.used), Some(0));
    llama.wake(AfterWake::FreeHostMemory)?; // back at the same addresses, same bytes
    let mut back = [0u8; 15];
    weights.read(0, &mut back)?;
    assert_eq!((weights.addr(), &back), (at, b"llama's weights"));

    gpu.set_global_limit(40 << 20)?; // a live change: idle memory goes back to make it fit
    println!(
        "global limit {} MiB, {} MiB used",
        gpu.global_limit() / MIB,
        gpu.stats().global.used / MIB
    );
    assert_eq!(gpu.audit(), Ok(())); // the books match the memory
    println!("quickstart_models: ok");
    Ok(())
}
