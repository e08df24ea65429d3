//! Routing of candle's own allocations on the GPU (this target invokes
//! `route_cuda_allocations!` in `main.rs`): tensors in the model's pool, frees from other
//! threads, stream-ordered reuse across two streams, out of memory as a candle error, graph
//! capture, and 10 000 routed tensors followed by ordinary candle work on the same device;
//! a synchronous free of a block a non-blocking stream still reads.

use std::sync::Arc;

use candle_core::cuda_backend::cudarc::driver::sys::{
    CUgraphInstantiate_flags, CUstreamCaptureMode,
};
use candle_core::cuda_backend::cudarc::driver::{result, sys, CudaContext, DevicePtr};
use candle_core::cuda_backend::CudaStorageSlice;
use candle_core::{DType, Device, Storage, Tensor};
use elastic_vmm::backend::cuda::CudaBackend;
use elastic_vmm::route;
use elastic_vmm::{ModelConfig, ModelHandle, SharedPool, SharedPoolConfig, Tag};

use crate::suite::{GIB, MIB};

fn addr(t: &Tensor) -> u64 {
    let (storage, _) = t.storage_and_layout();
    let Storage::Cuda(cuda) = &*storage else {
        panic!("not a CUDA tensor")
    };
    match &cuda.slice {
        CudaStorageSlice::F32(s) => s.device_ptr(s.stream()).0,
        CudaStorageSlice::BF16(s) => s.device_ptr(s.stream()).0,
        other => panic!("unexpected storage {other:?}"),
    }
}

fn model(limit: u64) -> (SharedPool, ModelHandle) {
    let backend = Arc::new(CudaBackend::new(0).expect("CUDA device 0"));
    let gpu = SharedPool::new(backend, SharedPoolConfig::new().global_limit(8 * GIB)).unwrap();
    let m = gpu
        .register(ModelConfig::new("routed", 64 << 30, limit))
        .unwrap();
    (gpu, m)
}

fn in_pool(m: &ModelHandle, a: u64) -> bool {
    a >= m.base() && a < m.base() + m.capacity()
}

#[test]
fn candle_allocations_go_to_the_model() {
    assert!(route::is_installed());
    let dev = Device::new_cuda(0).unwrap();
    let (_gpu, m) = model(GIB);
    let (w, x) = route::with_route(&m, Tag::Weights, || {
        let w = Tensor::randn(0f32, 1.0, (1024, 1024), &dev).unwrap();
        let x = Tensor::randn(0f32, 1.0, (1024, 64), &dev).unwrap();
        (w, x)
    })
    .unwrap();
    assert!(in_pool(&m, addr(&w)) && in_pool(&m, addr(&x)));
    let y = route::with_route(&m, Tag::Activations, || w.matmul(&x).unwrap()).unwrap();
    assert!(in_pool(&m, addr(&y)));
    let unrouted = w.matmul(&x).unwrap();
    assert!(!in_pool(&m, addr(&unrouted)));
    // Same kernel, same inputs: same bits wherever the output lives.
    let (a, b) = (
        y.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
        unrouted.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
    );
    assert!(a.iter().zip(&b).all(|(p, q)| p.to_bits() == q.to_bits()));
    let st = route::stats(&m).unwrap();
    assert_eq!(
        st.tag(&Tag::Weights).unwrap().live_bytes,
        (1024 * 1024 + 1024 * 64) * 4
    );
    assert_eq!(st.tag(&Tag::Activations).unwrap().live_bytes, 1024 * 64 * 4);
    println!("{}", route::report(&m, 3).unwrap());
    drop((w, x, y));
    dev.synchronize().unwrap();
    let st = route::stats(&m).unwrap();
    assert_eq!(st.live_bytes(), 0);
    route::flush(&m);
    assert_eq!(m.stats().in_use, 0);
}

#[test]
fn free_from_another_thread_and_no_poisoned_device() {
    let dev = Device::new_cuda(0).unwrap();
    let (_gpu, m) = model(GIB);
    let ts: Vec<Tensor> = route::with_route(&m, Tag::Kv, || {
        (0..64)
            .map(|i| Tensor::ones((i + 1) * 4096, DType::F32, &dev).unwrap())
            .collect()
    })
    .unwrap();
    let addrs: Vec<u64> = ts.iter().map(addr).collect();
    std::thread::spawn(move || drop(ts)).join().unwrap();
    for a in &addrs {
        assert!(!route::is_routed(*a));
    }
    let st = route::stats(&m).unwrap();
    assert_eq!(st.tag(&Tag::Kv).unwrap().frees, 64);
    // The other thread's per-thread stream is not this thread's: nothing it freed is reused
    // here before a fence.
    let again = route::with_route(&m, Tag::Kv, || {
        Tensor::ones(4096, DType::F32, &dev).unwrap()
    })
    .unwrap();
    assert!(!addrs.contains(&addr(&again)));
    drop(again);
    // Candle's device works on: every free succeeded, no sticky error.
    let z = (Tensor::ones(1000, DType::F32, &dev).unwrap() * 3.0).unwrap();
    assert_eq!(z.sum_all().unwrap().to_scalar::<f32>().unwrap(), 3000.0);
    dev.synchronize().unwrap();
    route::flush(&m);
    assert_eq!(m.stats().in_use, 0);
}

#[test]
fn freed_memory_is_reused_on_its_stream_and_fenced_for_others() {
    let d1 = Device::new_cuda_with_stream(0).unwrap();
    let d2 = Device::new_cuda_with_stream(0).unwrap();
    let (_gpu, m) = model(4 * GIB);
    let _r = route::route(&m, Tag::Scratch).unwrap();
    let n = 4096usize;
    let a = Tensor::randn(0f32, 1.0, (n, n), &d1).unwrap();
    // A long kernel on stream 1 writes `big`, which is freed at once (on stream 1).
    let big = a.matmul(&a).unwrap();
    let freed = addr(&big);
    drop(big);
    // Stream 2 must not get that memory while the matmul may still write it.
    let y = Tensor::ones((n, n), DType::F32, &d2).unwrap();
    assert_ne!(addr(&y), freed);
    d2.synchronize().unwrap();
    d1.synchronize().unwrap();
    assert_eq!(
        y.sum_all().unwrap().to_scalar::<f32>().unwrap(),
        (n * n) as f32
    );
    // Stream 1 reuses it at once.
    let z = Tensor::zeros((n, n), DType::F32, &d1).unwrap();
    assert_eq!(addr(&z), freed);
    assert!(route::stats(&m).unwrap().tag(&Tag::Scratch).unwrap().reused >= 1);
    drop((a, y, z));
    d1.synchronize().unwrap();
    d2.synchronize().unwrap();
    route::flush(&m);
    let st = route::stats(&m).unwrap();
    assert!(st.fences >= 1);
    assert_eq!((st.cached_bytes, st.fenced_bytes), (0, 0));
    assert_eq!(m.stats().in_use, 0);
}

#[test]
fn out_of_memory_is_a_candle_error_with_the_numbers() {
    let dev = Device::new_cuda(0).unwrap();
    let (gpu, m) = model(64 * MIB);
    let _r = route::route(&m, Tag::Weights).unwrap();
    let keep = Tensor::ones((32 * MIB / 4) as usize, DType::F32, &dev).unwrap();
    let used = gpu.stats().models[0].used;
    let err = Tensor::ones((64 * MIB / 4) as usize, DType::F32, &dev).unwrap_err();
    assert!(err.to_string().contains("OUT_OF_MEMORY"), "{err}");
    let r = route::last_refusal().expect("refusal");
    assert_eq!(r.asked, 64 * MIB);
    assert!(r.reason.contains("limit"), "{r}");
    println!("refusal: {r}");
    assert_eq!(
        gpu.stats().models[0].used,
        used,
        "nothing held for the refusal"
    );
    // The device is fine: an ordinary candle allocation and kernel work.
    drop(_r);
    let ok = (Tensor::ones(1024, DType::F32, &dev).unwrap() + 1.0).unwrap();
    assert_eq!(ok.sum_all().unwrap().to_scalar::<f32>().unwrap(), 2048.0);
    drop(keep);
    dev.synchronize().unwrap();
    route::flush(&m);
    assert_eq!(m.stats().in_use, 0);
}

#[test]
fn graph_capture_uses_parked_pool_memory() {
    let dev = Device::new_cuda_with_stream(0).unwrap();
    let cuda = dev.as_cuda_device().unwrap();
    // Capture needs tensors without cudarc's cross-stream events (waiting in a capture on an
    // event recorded before it breaks capture isolation), as for any candle graph.
    // SAFETY: every tensor of this test lives on the device's one stream.
    unsafe { cuda.disable_event_tracking() };
    let stream = cuda.cuda_stream();
    let (_gpu, m) = model(GIB);
    let a = Tensor::randn(0f32, 1.0, (512, 512), &dev).unwrap();
    let b = Tensor::randn(0f32, 1.0, (512, 512), &dev).unwrap();
    let f = |a: &Tensor, b: &Tensor| ((a + b).unwrap().exp().unwrap() * a).unwrap();
    let expected = f(&a, &b).flatten_all().unwrap().to_vec1::<f32>().unwrap();
    dev.synchronize().unwrap();
    let guard = route::route(&m, "graph").unwrap();
    stream
        .begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_GLOBAL)
        .unwrap();
    let out = f(&a, &b); // the two temporaries are freed inside the capture
    let graph = stream
        .end_capture(CUgraphInstantiate_flags(0))
        .unwrap()
        .expect("a graph");
    drop(guard);
    let st = route::stats(&m).unwrap();
    assert_eq!(st.captured_allocations, 3);
    assert!(st.parked_bytes >= 2 * 512 * 512 * 4, "{st:?}");
    assert!(in_pool(&m, addr(&out)));
    for _ in 0..3 {
        graph.launch().unwrap();
    }
    dev.synchronize().unwrap();
    let got = out.flatten_all().unwrap().to_vec1::<f32>().unwrap();
    assert!(got
        .iter()
        .zip(&expected)
        .all(|(p, q)| p.to_bits() == q.to_bits()));
    // Memory freed during the capture is not handed out again while the graph may run.
    let parked_addr = addr(&out);
    drop(out);
    let later = route::with_route(&m, "graph", || f(&a, &b)).unwrap();
    assert_ne!(addr(&later), parked_addr);
    drop(later);
    drop(graph);
    dev.synchronize().unwrap();
    // SAFETY: the graph is destroyed and its launches finished (synchronized above).
    let released = unsafe { route::release_captured(&m) };
    assert!(released >= 3 * 512 * 512 * 4);
    assert_eq!(route::stats(&m).unwrap().parked_bytes, 0);
    route::flush(&m);
    assert_eq!(m.stats().in_use, 0);
}

#[test]
fn ten_thousand_routed_tensors_then_ordinary_candle_work() {
    let dev = Device::new_cuda(0).unwrap();
    let (_gpu, m) = model(4 * GIB);
    let ts: Vec<Tensor> = route::with_route(&m, "many", || {
        (0..10_000)
            .map(|i| Tensor::full(i as f32, (i % 97 + 1) * 256, &dev).unwrap())
            .collect()
    })
    .unwrap();
    let st = route::stats(&m).unwrap();
    assert_eq!(st.tag(&Tag::named("many")).unwrap().live_blocks, 10_000);
    for i in [0usize, 1, 4999, 9999] {
        let v = ts[i].to_vec1::<f32>().unwrap();
        assert!(v.iter().all(|&x| x == i as f32));
    }
    drop(ts);
    // Ordinary candle work on the same device, unrouted, checked against the CPU.
    let a = Tensor::randn(0f32, 1.0, (256, 256), &Device::Cpu).unwrap();
    let want = a
        .matmul(&a)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1::<f32>()
        .unwrap();
    let g = a.to_device(&dev).unwrap();
    let got = g
        .matmul(&g)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1::<f32>()
        .unwrap();
    let worst = want
        .iter()
        .zip(&got)
        .map(|(x, y)| (x - y).abs())
        .fold(0f32, f32::max);
    assert!(worst < 1e-2, "GPU matmul differs from the CPU by {worst}");
    dev.synchronize().unwrap();
    let st = route::stats(&m).unwrap();
    assert_eq!(st.live_bytes(), 0);
    route::flush(&m);
    assert_eq!(m.stats().in_use, 0);
    m.audit().unwrap();
}

/// With no cache, a block freed while a long kernel still writes it is fenced at once: another
/// stream cannot get it before the GPU passed the fence; afterwards it is the pool's again.
#[test]
fn a_pending_fence_keeps_memory_from_other_streams() {
    let d1 = Device::new_cuda_with_stream(0).unwrap();
    let d2 = Device::new_cuda_with_stream(0).unwrap();
    let (_gpu, m) = model(4 * GIB);
    route::set_stream_cache_limit(&m, 0);
    let _r = route::route(&m, Tag::Scratch).unwrap();
    let n = 8192usize;
    let a = Tensor::randn(0f32, 1.0, (n, n), &d1).unwrap();
    d1.synchronize().unwrap();
    let mut seen_pending = false;
    for _ in 0..4 {
        let big = a.matmul(&a).unwrap(); // ~10 ms of work queued on stream 1
        let freed = addr(&big);
        drop(big); // fenced at once (limit 0)
        seen_pending |= route::stats(&m).unwrap().fenced_bytes > 0;
        let y = Tensor::ones((n, n), DType::F32, &d2).unwrap();
        let same = addr(&y) == freed;
        d2.synchronize().unwrap();
        d1.synchronize().unwrap();
        assert_eq!(
            y.sum_all().unwrap().to_scalar::<f32>().unwrap(),
            (n * n) as f32
        );
        if same {
            // Only possible once the fence had passed, i.e. the matmul had finished.
            assert!(!seen_pending || route::stats(&m).unwrap().fenced_bytes == 0);
        }
        drop(y);
    }
    assert!(
        seen_pending,
        "no fence was ever pending behind a 10 ms kernel"
    );
    drop(a);
    d1.synchronize().unwrap();
    route::flush(&m);
    assert_eq!(route::stats(&m).unwrap().fenced_bytes, 0);
    assert_eq!(m.stats().in_use, 0);
}

/// Blocks freed on a stream are fenced before the stream is destroyed (candle's device with a
/// stream of its own destroys it when dropped).
#[test]
fn a_destroyed_stream_fences_its_blocks_first() {
    let (_gpu, m) = model(GIB);
    {
        let d = Device::new_cuda_with_stream(0).unwrap();
        let _r = route::route(&m, Tag::Kv).unwrap();
        let t = Tensor::ones(1 << 20, DType::F32, &d).unwrap();
        drop(t);
        d.synchronize().unwrap();
        assert!(route::stats(&m).unwrap().cached_bytes > 0);
    }
    // The device, its stream and every slice are gone: the blocks were fenced on the way.
    let st = route::stats(&m).unwrap();
    assert_eq!(st.cached_bytes, 0, "{st:?}");
    route::flush(&m);
    assert_eq!(m.stats().in_use, 0);
}

// The entry points as cudarc declares them; the linker binds them to the definitions of
// `route_cuda_allocations!` in `main.rs` (whichever way cudarc itself is linked).
extern "C" {
    fn cuMemAllocAsync(
        dptr: *mut sys::CUdeviceptr,
        bytesize: usize,
        stream: sys::CUstream,
    ) -> sys::CUresult;
    fn cuMemFreeAsync(dptr: sys::CUdeviceptr, stream: sys::CUstream) -> sys::CUresult;
    fn cuMemAlloc_v2(dptr: *mut sys::CUdeviceptr, bytesize: usize) -> sys::CUresult;
    fn cuMemFree_v2(dptr: sys::CUdeviceptr) -> sys::CUresult;
}

/// Issue 22, defect 8: `cuMemFree_v2` of a routed block waits for the device as the driver's
/// does, a non-blocking stream included (which the legacy stream does not wait for). A copy on
/// a non-blocking stream reads the block once a flag is set 300 ms later; the block is freed
/// synchronously at once, allocated again on the legacy stream and overwritten there: the copy
/// must still see the old bytes.
#[test]
fn a_synchronous_free_waits_for_non_blocking_streams() {
    use std::time::{Duration, Instant};
    let ctx = CudaContext::new(0).unwrap();
    ctx.bind_to_thread().unwrap();
    let busy = ctx.new_stream().unwrap(); // CU_STREAM_NON_BLOCKING
    let other = ctx.new_stream().unwrap();
    let (_gpu, m) = model(GIB);
    const N: usize = 64 << 20;
    // The flag and the copy's destination come from the driver (no route yet).
    // SAFETY: plain device allocations in the current context, freed at the end.
    let (flag, dst) = unsafe { (result::malloc_sync(4), result::malloc_sync(N)) };
    let (flag, dst) = (flag.unwrap(), dst.unwrap());
    let (bs, os) = (busy.cu_stream(), other.cu_stream());
    // SAFETY: a live 4-byte allocation; queued on our stream, waited for below.
    unsafe { sys::cuMemsetD32Async(flag, 0, 1, os) }
        .result()
        .unwrap();
    other.synchronize().unwrap();
    let route = route::route(&m, Tag::Scratch).unwrap();
    let mut a: sys::CUdeviceptr = 0;
    // SAFETY: a valid out-pointer.
    assert_eq!(
        unsafe { cuMemAlloc_v2(&mut a, N) },
        sys::CUresult::CUDA_SUCCESS
    );
    assert!(in_pool(&m, a));
    // SAFETY: `a` and `dst` are live allocations of N bytes; `flag` of 4; all work is queued
    // on our streams and finished before any of them is freed.
    unsafe {
        sys::cuMemsetD8Async(a, 0xAA, N, bs).result().unwrap();
        sys::cuStreamWaitValue32_v2(
            bs,
            flag,
            1,
            sys::CUstreamWaitValue_flags::CU_STREAM_WAIT_VALUE_EQ as u32,
        )
        .result()
        .unwrap();
        sys::cuMemcpyDtoDAsync_v2(dst, a, N, bs).result().unwrap();
    }
    let release = {
        let ctx = ctx.clone();
        let os = os as usize;
        std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(300));
            ctx.bind_to_thread().unwrap();
            // SAFETY: the flag is live until the main thread synchronized, after the join.
            unsafe { sys::cuMemsetD32Async(flag, 1, 1, os as sys::CUstream) }
                .result()
                .unwrap();
        })
    };
    let t = Instant::now();
    // SAFETY: a routed block, freed once.
    assert_eq!(unsafe { cuMemFree_v2(a) }, sys::CUresult::CUDA_SUCCESS);
    let waited = t.elapsed();
    let mut b: sys::CUdeviceptr = 0;
    // SAFETY: a valid out-pointer; the legacy stream.
    assert_eq!(
        unsafe { cuMemAllocAsync(&mut b, N, std::ptr::null_mut()) },
        sys::CUresult::CUDA_SUCCESS
    );
    // SAFETY: `b` is a live routed allocation of N bytes; the legacy stream.
    unsafe { sys::cuMemsetD8Async(b, 0x55, N, std::ptr::null_mut()) }
        .result()
        .unwrap();
    release.join().unwrap();
    ctx.synchronize().unwrap();
    let mut host = vec![0u8; N];
    // SAFETY: `dst` holds N bytes; `host` is N bytes; everything queued has finished.
    unsafe { sys::cuMemcpyDtoH_v2(host.as_mut_ptr().cast(), dst, N) }
        .result()
        .unwrap();
    let bad = host.iter().filter(|&&x| x != 0xAA).count();
    assert_eq!(
        bad,
        0,
        "{bad} bytes of a block freed with cuMemFree_v2 were overwritten while a non-blocking \
         stream still read them (the free returned after {waited:?}; reused: {})",
        a == b
    );
    // SAFETY: the routed block, freed once, on the legacy stream it was allocated on.
    assert_eq!(
        unsafe { cuMemFreeAsync(b, std::ptr::null_mut()) },
        sys::CUresult::CUDA_SUCCESS
    );
    drop(route);
    ctx.synchronize().unwrap();
    // SAFETY: driver allocations of this test, nothing queued uses them.
    unsafe {
        result::free_sync(dst).unwrap();
        result::free_sync(flag).unwrap();
    }
    route::flush(&m);
    assert_eq!(m.stats().in_use, 0);
}
