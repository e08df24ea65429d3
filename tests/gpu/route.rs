//! Routing of candle's own allocations on the GPU (this target invokes
//! `route_cuda_allocations!` in `main.rs`): tensors in the model's pool, frees from other
//! threads, stream-ordered reuse across two streams, out of memory as a candle error, graph
//! capture, and 10 000 routed tensors followed by ordinary candle work on the same device.

use std::sync::Arc;

use candle_core::cuda_backend::cudarc::driver::sys::{
    CUgraphInstantiate_flags, CUstreamCaptureMode,
};
use candle_core::cuda_backend::cudarc::driver::DevicePtr;
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
