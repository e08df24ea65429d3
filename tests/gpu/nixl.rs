//! NIXL on the GPU (feature `nixl`): VMM-mapped device memory registered as VRAM with its
//! device id, one registration per physical chunk; two agents in one process; WRITE then READ
//! verified byte for byte; bandwidth against plain `cuMemAlloc` memory in the same run.
//!
//! The GPU machine has no NIXL: carry the runtime (`scripts/nixl-runtime.sh --pack` makes
//! `.carry/nixl-runtime.tar.xz`) and run with
//! `LD_LIBRARY_PATH=<unpacked>/nixl/.nixl_cu13.mesonpy.libs`. Without it these tests fail (the
//! GPU target never skips). `UCX_PROTO_INFO=y` makes UCX print the protocols it picked.

use std::sync::Arc;

use cudarc::driver::{result, sys, CudaContext};
use elastic_vmm::backend::cuda::CudaBackend;
use elastic_vmm::layout::{
    BlockDim, KvLayout, LayoutBuilder, LayoutViews, MemoryRange, REGION_ALIGNMENT,
};
use elastic_vmm::nixl::{self, RegisteredLayout};
use elastic_vmm::{Backend, MemoryKind};

use crate::suite::layout::nixl::{
    agent, bandwidth, bandwidth_config, bandwidth_layouts, measure, AsKv,
};
use crate::suite::layout::Bytes;

fn cuda() -> Arc<dyn Backend> {
    Arc::new(CudaBackend::new(0).expect("CUDA device 0 with VMM support"))
}

/// The GPU target fails rather than skips: the library must be there.
fn require() -> bool {
    if let Err(e) = nixl::available() {
        panic!(
            "{e}: carry the NIXL runtime (scripts/nixl-runtime.sh --pack) and set LD_LIBRARY_PATH"
        );
    }
    true
}

crate::nixl_suite!(cuda, require);

/// A layout over `cuMemAlloc` memory the test owns, with its own host-to-device copies.
struct PlainDevice {
    layout: RegisteredLayout,
}

impl Bytes for PlainDevice {
    fn views(&self) -> &LayoutViews {
        KvLayout::views(&self.layout)
    }
    fn put(&self, addr: u64, data: &[u8]) -> elastic_vmm::Result<()> {
        // SAFETY: `addr..+len` lies in a live cuMemAlloc buffer (a unit view of the layout),
        // the context is current on this thread, and nothing else uses the bytes meanwhile.
        unsafe { result::memcpy_htod_sync(addr as sys::CUdeviceptr, data) }
            .map_err(|e| elastic_vmm::Error::InvalidArgument(format!("cuMemcpyHtoD: {e:?}")))
    }
    fn get(&self, addr: u64, out: &mut [u8]) -> elastic_vmm::Result<()> {
        // SAFETY: as in `put`.
        unsafe { result::memcpy_dtoh_sync(out, addr as sys::CUdeviceptr) }
            .map_err(|e| elastic_vmm::Error::InvalidArgument(format!("cuMemcpyDtoH: {e:?}")))
    }
}

impl AsKv for PlainDevice {
    fn kv(&self) -> &dyn KvLayout {
        &self.layout
    }
}

/// VMM-mapped VRAM (pool chunks and elastic 2 MiB pages, each registered as VRAM of device 0)
/// against plain cuMemAlloc buffers with the same layouts, same agents' setup, same run.
#[test]
fn vram_vmm_against_cumemalloc() {
    require();
    const BYTES: u64 = 256 << 20;
    let backend = cuda();
    println!(
        "device: {}; UCX_TLS={:?}",
        backend.info().device_name,
        std::env::var("UCX_TLS").ok()
    );
    let (vmm_w, vmm_r) = bandwidth(backend.clone(), BYTES);

    // Control: the same layouts (fully contiguous -> layer separate, block first) over
    // cuMemAlloc memory supplied by the caller.
    let ctx = CudaContext::new(0).expect("context");
    ctx.bind_to_thread().expect("bind");
    // SAFETY: plain driver allocations, freed below after every registration is dropped.
    let (sp, dp) = unsafe {
        (
            result::malloc_sync(BYTES as usize).expect("cuMemAlloc src"),
            result::malloc_sync(BYTES as usize).expect("cuMemAlloc dst"),
        )
    };
    assert_eq!(sp % REGION_ALIGNMENT, 0);
    let c = bandwidth_config(BYTES);
    let range = |addr: u64, len: u64| MemoryRange {
        addr,
        len,
        kind: MemoryKind::Device,
        device: Some(0),
    };
    let (a, b) = (agent("ctl-a"), agent("ctl-b"));
    let layer = BYTES / c.num_layers as u64;
    // SAFETY: both ranges are live cuMemAlloc buffers of device 0, freed below only after the
    // layouts, their registrations and every transfer over them are gone.
    let (src, dst) = unsafe {
        (
            LayoutBuilder::new()
                .config(c)
                .fully_contiguous()
                .regions(vec![range(sp, BYTES)]),
            LayoutBuilder::new()
                .config(c)
                .layer_separate(BlockDim::First)
                .regions(
                    (0..c.num_layers as u64)
                        .map(|l| range(dp + l * layer, layer))
                        .collect(),
                ),
        )
    };
    let (src, dst) = (src.build().expect("src"), dst.build().expect("dst"));
    let src = PlainDevice {
        layout: a.register(src).expect("register cuMemAlloc src as VRAM"),
    };
    let dst = PlainDevice {
        layout: b.register(dst).expect("register cuMemAlloc dst as VRAM"),
    };
    let what = format!(
        "cuMemAlloc control ({} + {} registrations)",
        a.registrations(),
        b.registrations()
    );
    let (ctl_w, ctl_r) = measure(&what, &a, &src, &b, &dst);
    assert_eq!(
        a.reap_transfers(),
        0,
        "no transfer over the buffers still runs"
    );
    drop((src, dst));
    assert_eq!((a.registrations(), b.registrations()), (0, 0));
    // SAFETY: no registration or layout refers to the buffers any more.
    unsafe {
        result::free_sync(sp).expect("free");
        result::free_sync(dp).expect("free");
    }
    println!(
        "UCX with VMM-mapped VRAM: registered as VRAM per chunk and moved byte-exact (WRITE and READ); \
         VMM / cuMemAlloc bandwidth: WRITE {:.2}x ({vmm_w:.2} vs {ctl_w:.2} GB/s), READ {:.2}x ({vmm_r:.2} vs {ctl_r:.2} GB/s)",
        vmm_w / ctl_w,
        vmm_r / ctl_r
    );
}

/// A timed-out VRAM transfer keeps its blocks pinned until NIXL reports it finished (see the
/// suite). In one process UCX moves VMM memory in the background over TCP loopback, so a
/// zero timeout catches it running.
#[test]
fn timed_out_transfer_keeps_blocks_pinned() {
    require();
    crate::suite::layout::nixl::timed_out_transfer_keeps_blocks_pinned(cuda());
}

/// Device memory between two agents of one process takes the crate's device copy by default,
/// at device speed (UCX moves it at 0.3-0.5 GB/s there, over TCP loopback: a bandwidth above
/// 50 GB/s cannot be that path), and memory the caller owns, which the crate cannot copy, is
/// refused with the override named, before any byte moves.
#[test]
fn vram_takes_the_device_copy_or_is_refused() {
    use elastic_vmm::layout::StorageKind;
    use elastic_vmm::nixl::{transfer_blocks_via, BlockSet, TransferOp, TransferPath, TransferVia};
    use elastic_vmm::{Error, Pool, PoolConfig};
    use std::time::Duration;

    require();
    const BYTES: u64 = 256 << 20;
    let backend = cuda();
    let pool = Pool::new(backend.clone(), PoolConfig::new(4 * BYTES as usize)).expect("pool");
    let (a, b) = (agent("copy-a"), agent("copy-b"));
    let c = bandwidth_config(BYTES);
    let (src, dst) = bandwidth_layouts(&pool, BYTES, &a, &b);
    let all: Vec<usize> = (0..c.num_blocks).collect();
    let go = |via| {
        transfer_blocks_via(
            TransferOp::Write,
            BlockSet {
                agent: &a,
                layout: &src,
                blocks: &all,
            },
            BlockSet {
                agent: &b,
                layout: &dst,
                blocks: &all,
            },
            Duration::from_secs(120),
            via,
        )
    };
    go(TransferVia::Auto).expect("warm-up");
    let best = (0..5)
        .map(|_| go(TransferVia::Auto).expect("device copy"))
        .min_by_key(|r| r.elapsed)
        .expect("runs");
    assert_eq!(best.path, TransferPath::DeviceCopy);
    let gbs = best.bytes as f64 / best.elapsed.as_secs_f64() / 1e9;
    println!(
        "VMM VRAM, one process, TransferVia::Auto: {} MiB in {} copies, {:?}: {gbs:.1} GB/s",
        best.bytes >> 20,
        best.descriptors,
        best.elapsed
    );
    assert!(gbs > 50.0, "the device copy ran at {gbs:.2} GB/s");

    // Memory the caller owns (cuMemAlloc): no pool to copy with.
    let ctx = CudaContext::new(0).expect("context");
    ctx.bind_to_thread().expect("bind");
    // SAFETY: a plain driver allocation, freed below after its layout and registration.
    let raw = unsafe { result::malloc_sync(c.sizes().expect("sizes").total as usize) }
        .expect("cuMemAlloc");
    let range = MemoryRange {
        addr: raw,
        len: c.sizes().expect("sizes").total,
        kind: MemoryKind::Device,
        device: Some(0),
    };
    // SAFETY: the range is a live cuMemAlloc buffer of device 0, freed below only after the
    // layout and its registration are gone.
    let own = unsafe {
        LayoutBuilder::new()
            .config(c)
            .fully_contiguous()
            .regions(vec![range])
    }
    .build()
    .expect("caller's layout");
    assert_eq!(own.views().storage(), StorageKind::Device(0));
    let own = a.register(own).expect("register");
    let refused = transfer_blocks_via(
        TransferOp::Write,
        BlockSet {
            agent: &a,
            layout: &own,
            blocks: &all[..2],
        },
        BlockSet {
            agent: &b,
            layout: &dst,
            blocks: &all[..2],
        },
        Duration::from_secs(30),
        TransferVia::Auto,
    );
    match refused {
        Err(e @ Error::NixlNoDevicePath { .. }) => {
            assert!(e.to_string().contains("TransferVia::Nixl"), "{e}");
            println!("refused as it should be: {e}");
        }
        other => panic!("expected NixlNoDevicePath, got {other:?}"),
    }
    drop(own);
    // SAFETY: no layout or registration refers to the buffer any more.
    unsafe { result::free_sync(raw) }.expect("free");
    drop((src, dst));
}
