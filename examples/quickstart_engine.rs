//! README quick start "a paged KV cache for an engine": block ids in, per-layer K/V tensor
//! addresses out, physical memory only under live blocks, under the model's limit. Runs on the
//! host backend (real memory), anywhere; on a GPU write `SharedPool::cuda(0, ..)` and hand
//! `kv.tensor_addr(t)` to the attention kernel (`candle::PagedKvTensors` gives candle tensors
//! over the same cache). The README's lines are this file's (`tests/readme.rs` checks them);
//! `scripts/test.sh` runs it.

use elastic_vmm::kv::{PagedKv, PagedKvConfig, Watermarks};
use elastic_vmm::{Error, ModelConfig, SharedPool, SharedPoolConfig};

const MIB: u64 = 1 << 20;

fn main() -> elastic_vmm::Result<()> {
    let gpu = SharedPool::host(SharedPoolConfig::new().global_limit(256 << 20))?; // cuda(0, ..)
    let model = gpu.register(ModelConfig::new("llama", 8 << 30, 66 << 20))?; // 64 MiB of blocks + the 2 MiB zero page
                                                                             // Per layer a K and a V [1024 blocks, 16 tokens, 8 heads, 128 dims] of f16 (2 bytes), 8 layers:
    let shape = PagedKvConfig::new(8, 8, 128, 16, 2, 1024); // 512 MiB of addresses, none mapped
    let kv = PagedKv::new(&model, shape.clone())?;
    let k0 = kv.tensor_addr(0).expect("layer 0's K"); // for the kernel; layer l: 2l (K), 2l+1 (V)
    assert_eq!(kv.available(), 128); // what 64 MiB backs: 2 pages of 2 MiB in each of 16 tensors

    let seq = kv.alloc(100)?; // block ids, mapped in all 16 tensors at once
    println!(
        "{} blocks live, {} MiB mapped, {} more available",
        seq.len(),
        kv.stats().mapped_bytes / MIB,
        kv.available()
    );
    let e = kv.alloc(29).expect_err("past the limit"); // all or nothing, with the numbers
    assert!(matches!(e, Error::AdmissionRefused { .. }), "{e}");
    kv.free(&seq)?; // pages no live block touches go back to the pool
    assert_eq!((kv.stats().mapped_bytes, kv.available()), (0, 128));

    // A block nobody allocated reads as zeros (the read-only zero page), e.g. a padded block table.
    let mut bytes = vec![0xffu8; kv.block_span_bytes() as usize];
    let copies = kv.pool().backend().copies();
    // SAFETY: block 700 of tensor 0 lies in the cache's region, whose unbacked pages are mapped
    // read-only to the zero page for as long as `kv` lives; this only reads.
    unsafe { copies.read(k0 + 700 * kv.block_span_bytes(), &mut bytes)? };
    assert!(bytes.iter().all(|&b| b == 0));

    // Blocks kept mapped ahead of need, so `alloc` on the token path makes no driver call.
    drop(kv);
    let kv = PagedKv::new(&model, shape.watermarks(Watermarks::new(64, 128)))?;
    let start = std::time::Instant::now();
    while kv.stats().warm < 64 && start.elapsed().as_secs() < 5 {
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    let ids = kv.alloc(16)?; // taken from the warm blocks
    println!(
        "{} warm after alloc, {} MiB mapped",
        kv.stats().warm,
        kv.stats().mapped_bytes / MIB
    );
    kv.free(&ids)?;
    println!("quickstart_engine: ok");
    Ok(())
}
