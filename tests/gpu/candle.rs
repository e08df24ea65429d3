//! Candle tensors in elastic memory on the GPU: every dtype and shape, zeroing, memory back to
//! the pool once every tensor sharing it is gone, 10 000 tensors created and dropped with the
//! candle device left clean, elastic KV tensors against an ordinary candle tensor, refusals,
//! two models under one budget, several devices, owners dropped before their tensors, copies and
//! fills in order with other threads' kernels, collects that never wait for the GPU.

use std::sync::mpsc;
use std::sync::Arc;
use std::time::{Duration, Instant};

use candle_core::cuda_backend::cudarc::driver::{CudaContext, DevicePtr};
use candle_core::cuda_backend::CudaStorageSlice;
use candle_core::{DType, Device, IndexOp, Storage, Tensor};
use elastic_vmm::backend::cuda::CudaBackend;
use elastic_vmm::backend::testing::FaultInjector;
use elastic_vmm::backend::Backend;
use elastic_vmm::candle::{
    detached_copy, reap_orphans_blocking, ElasticKv, TensorPool, SUPPORTED_DTYPES,
};
use elastic_vmm::{Error, MemOptions, ModelConfig, Pool, SharedPool, SharedPoolConfig};

use crate::suite::{GIB, MIB};

fn device() -> Device {
    Device::new_cuda(0).expect("candle CUDA device 0")
}

fn pool(capacity: u64) -> Pool {
    Pool::cuda(0, capacity as usize).expect("CUDA pool on device 0")
}

/// Every element as f64, read through the CPU.
fn host(t: &Tensor) -> Vec<f64> {
    t.to_device(&Device::Cpu)
        .and_then(|t| via_f32(t, DType::F64))
        .and_then(|t| t.flatten_all())
        .and_then(|t| t.to_vec1::<f64>())
        .expect("read back")
}

/// `t.to_dtype(to)` on the host, through F32 for F8E4M3: candle 0.11.1's host conversion
/// between F8E4M3 and F64 never returns for a zero (seen here with candle alone, no pool).
fn via_f32(t: Tensor, to: DType) -> candle_core::Result<Tensor> {
    if t.dtype() == DType::F8E4M3 || to == DType::F8E4M3 {
        t.to_dtype(DType::F32)?.to_dtype(to)
    } else {
        t.to_dtype(to)
    }
}

fn max_abs_diff(a: &Tensor, b: &Tensor) -> f64 {
    assert_eq!(a.dims(), b.dims(), "shapes differ");
    host(a)
        .iter()
        .zip(host(b))
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f64::max)
}

/// The device address of a CUDA tensor's storage.
fn device_addr(t: &Tensor) -> u64 {
    let (storage, _) = t.storage_and_layout();
    let Storage::Cuda(cuda) = &*storage else {
        panic!("not a CUDA tensor")
    };
    match &cuda.slice {
        CudaStorageSlice::F32(s) => s.device_ptr(s.stream()).0,
        CudaStorageSlice::U8(s) => s.device_ptr(s.stream()).0,
        other => panic!("device_addr: unexpected storage {other:?}"),
    }
}

fn assert_in_pool(pool: &Pool, t: &Tensor) {
    let addr = device_addr(t);
    assert!(
        addr >= pool.base() && addr < pool.base() + pool.capacity(),
        "tensor at {addr:#x} is outside the pool's reservation [{:#x}, {:#x})",
        pool.base(),
        pool.base() + pool.capacity()
    );
}

/// Check that the candle device's context holds no sticky error (reading it clears it).
fn assert_device_clean(dev: &Device) {
    let ctx = dev
        .as_cuda_device()
        .expect("cuda")
        .cuda_stream()
        .context()
        .clone();
    assert!(
        ctx.check_err().is_ok(),
        "the candle device's context holds a sticky error"
    );
}

fn assert_pool_empty(pool: &Pool) {
    let s = pool.stats();
    assert_eq!(
        (s.in_use, s.live_allocations, s.range_mapped),
        (0, 0, 0),
        "pool memory still in use: {s:?}"
    );
}

#[test]
fn every_dtype_and_shape_round_trips() {
    let dev = device();
    let pool = pool(16 * GIB);
    let tensors = TensorPool::new(&pool, &dev).expect("tensor pool");
    let shapes: [&[usize]; 7] = [
        &[],
        &[1],
        &[7],
        &[3, 5],
        &[2, 3, 4, 5],
        &[1000, 33],
        &[0, 4],
    ];
    for dtype in SUPPORTED_DTYPES {
        for &shape in &shapes {
            let z = tensors.zeros(shape, dtype).expect("zeros");
            assert_eq!((z.dims(), z.dtype()), (shape, dtype));
            assert!(z.is_contiguous() && z.device().same_device(&dev));
            assert!(
                host(&z).iter().all(|&v| v == 0.0),
                "{dtype:?} {shape:?} not zero"
            );

            let n: usize = shape.iter().product();
            let values: Vec<f64> = (0..n).map(|i| (i % 97) as f64 - 40.0).collect();
            let reference = Tensor::from_vec(values, shape, &Device::Cpu)
                .and_then(|t| via_f32(t, dtype))
                .expect("reference");
            let p = tensors.copy_in(&reference).expect("copy_in");
            assert_eq!(host(&p), host(&reference), "{dtype:?} {shape:?} differs");
            let e = tensors.empty(shape, dtype).expect("empty");
            assert_eq!((e.dims(), e.dtype()), (shape, dtype));
        }
    }
    let f = tensors.zeros((64, 64), DType::F32).expect("f32");
    assert_in_pool(&pool, &f);
    drop(f);
    for dtype in [DType::F6E2M3, DType::F6E3M2, DType::F4, DType::F8E8M0] {
        let err = tensors.zeros((4,), dtype).expect_err("dummy dtype refused");
        assert!(err.to_string().contains(&format!("{dtype:?}")), "{err}");
    }
    let report = tensors.collect_blocking().expect("collect");
    let stats = tensors.stats();
    println!("{report:?}\n{stats:?}");
    assert_eq!((stats.live_tensors, stats.awaiting_gpu), (0, 0));
    assert_eq!(stats.tensors_created, stats.tensors_returned);
    assert_pool_empty(&pool);
    assert_device_clean(&dev);
}

#[test]
fn zeros_are_zero_on_reused_memory() {
    let dev = device();
    let pool = pool(4 * GIB);
    let tensors = TensorPool::new(&pool, &dev).expect("tensor pool");
    let ones = Tensor::ones((1024, 1024), DType::F32, &dev).expect("ones");
    let t = tensors.copy_in(&ones).expect("copy_in");
    let addr = device_addr(&t);
    assert!(host(&t).iter().all(|&v| v == 1.0));
    drop(t);
    tensors.collect_blocking().expect("collect");
    let z = tensors.zeros((1024, 1024), DType::F32).expect("zeros");
    println!(
        "first tensor at {addr:#x}, zeros at {:#x} (reused: {})",
        device_addr(&z),
        addr == device_addr(&z)
    );
    assert!(
        host(&z).iter().all(|&v| v == 0.0),
        "reused memory not zeroed"
    );
    let e = tensors.empty((1024, 1024), DType::F32).expect("empty");
    assert_in_pool(&pool, &e);
}

#[test]
fn memory_goes_back_when_every_sharing_tensor_is_gone() {
    let dev = device();
    let pool = pool(4 * GIB);
    let tensors = TensorPool::new(&pool, &dev).expect("tensor pool");
    let src = Tensor::arange(0f32, 4096., &dev)
        .and_then(|t| t.reshape((64, 64)))
        .expect("src");
    let t = tensors.copy_in(&src).expect("copy_in");
    let narrow = t.narrow(0, 8, 4).expect("narrow");
    let reshaped = t.reshape((4096,)).expect("reshape");
    let clone = t.clone();
    drop(t);
    tensors.collect_blocking().expect("collect");
    assert_eq!(
        tensors.stats().live_tensors,
        1,
        "views still share the storage"
    );
    assert!(pool.stats().in_use >= 4096 * 4);
    assert_eq!(max_abs_diff(&narrow, &src.narrow(0, 8, 4).expect("n")), 0.0);
    drop(narrow);
    drop(reshaped);
    tensors.collect_blocking().expect("collect");
    assert_eq!(tensors.stats().live_tensors, 1, "a clone still shares it");
    assert_eq!(max_abs_diff(&clone, &src), 0.0);
    drop(clone);
    let report = tensors.collect_blocking().expect("collect");
    assert_eq!((report.found_dead, report.returned), (1, 1), "{report:?}");
    assert_eq!(tensors.stats().live_tensors, 0);
    assert_pool_empty(&pool);

    // A Tensor::copy() shares the original's private context: it keeps the memory until it is
    // dropped too, and the collect in between absorbs the original's failed free so the copy's
    // host reads work.
    let t = tensors.copy_in(&src).expect("copy_in");
    let copy = t.copy().expect("copy");
    drop(t);
    tensors.collect_blocking().expect("collect");
    assert_eq!(tensors.stats().live_tensors, 1, "the copy holds the memory");
    assert_eq!(max_abs_diff(&copy, &src), 0.0);
    drop(copy);
    tensors.collect_blocking().expect("collect");
    assert_pool_empty(&pool);
    assert_device_clean(&dev);
}

#[test]
fn ten_thousand_pool_tensors_leave_the_device_clean() {
    let dev = device();
    let pool = pool(4 * GIB);
    let tensors = TensorPool::new(&pool, &dev).expect("tensor pool");
    for i in 0..10_000 {
        let t = tensors.zeros((256,), DType::F32).expect("zeros");
        if i % 500 == 0 {
            let s: f32 = t
                .sum_all()
                .and_then(|s| s.to_scalar())
                .expect("sum of a pool tensor");
            assert_eq!(s, 0.0);
        }
    }
    // Ordinary candle work on the same device.
    let a = Tensor::randn(0f32, 1., (128, 64), &dev).expect("randn");
    let b = Tensor::randn(0f32, 1., (64, 32), &dev).expect("randn");
    let c = a.matmul(&b).expect("matmul");
    let c_cpu = a
        .to_device(&Device::Cpu)
        .and_then(|a| a.matmul(&b.to_device(&Device::Cpu)?))
        .expect("cpu matmul");
    assert!(max_abs_diff(&c, &c_cpu) < 1e-3);
    let big = Tensor::zeros((1 << 22,), DType::F32, &dev).expect("candle's own allocation");
    let s: f32 = (big + 1.0)
        .and_then(|t| t.sum_all())
        .and_then(|t| t.to_scalar())
        .expect("sum");
    assert_eq!(s, (1 << 22) as f32);
    dev.synchronize().expect("synchronize");
    assert_device_clean(&dev);

    tensors.collect_blocking().expect("collect");
    let stats = tensors.stats();
    println!("{stats:?}\n{:?}", pool.stats());
    assert_eq!((stats.live_tensors, stats.awaiting_gpu), (0, 0));
    assert_eq!(
        (stats.tensors_created, stats.tensors_returned),
        (10_000, 10_000)
    );
    assert_eq!(
        stats.absorbed_free_errors, 10_000,
        "one failed free per tensor, each absorbed in a private context"
    );
    assert!(
        stats.private_contexts < 64,
        "contexts are recycled: {}",
        stats.private_contexts
    );
    assert_pool_empty(&pool);
}

/// The trap the pool avoids, shown on a candle device of its own: a slice on the device's own
/// stream poisons the device's context when dropped.
#[test]
fn naive_wrapping_would_poison_the_device() {
    let victim = Device::new_cuda(0).expect("device");
    let pool = pool(GIB);
    let a = pool.allocate(4096).expect("allocation");
    let cuda = victim.as_cuda_device().expect("cuda").clone();
    let stream = cuda.cuda_stream();
    // SAFETY: the allocation holds 1024 f32 and outlives the tensor.
    let slice = unsafe { stream.upgrade_device_ptr::<f32>(a.addr(), 1024) };
    let storage = candle_core::CudaStorage::wrap_cuda_slice(slice, cuda);
    let t = Tensor::from_storage(
        Storage::Cuda(storage),
        (1024,),
        candle_core::op::BackpropOp::none(),
        false,
    );
    drop(t);
    let err = stream.context().check_err();
    println!("sticky error after dropping a naive VMM tensor: {err:?}");
    assert!(err.is_err(), "the naive drop records a sticky error");
    drop(a);
}

#[test]
fn pool_tensors_compute_like_candle_tensors() {
    let dev = device();
    let pool = pool(4 * GIB);
    let tensors = TensorPool::new(&pool, &dev).expect("tensor pool");
    let a = Tensor::randn(0f32, 1., (96, 128), &dev).expect("randn");
    let b = Tensor::randn(0f32, 1., (128, 80), &dev).expect("randn");
    let pa = tensors.copy_in(&a).expect("copy_in");
    let pb = tensors.copy_in(&b).expect("copy_in");
    let mm = max_abs_diff(
        &pa.matmul(&pb).expect("matmul"),
        &a.matmul(&b).expect("matmul"),
    );
    assert!(mm < 1e-4, "matmul differs by {mm}");
    let ids = Tensor::new(&[5u32, 0, 95, 5], &dev).expect("ids");
    assert_eq!(
        max_abs_diff(
            &pa.index_select(&ids, 0).expect("is"),
            &a.index_select(&ids, 0).expect("is")
        ),
        0.0
    );
    assert_eq!(
        max_abs_diff(
            &Tensor::cat(&[&pa, &pa.narrow(0, 3, 7).expect("n")], 0).expect("cat"),
            &Tensor::cat(&[&a, &a.narrow(0, 3, 7).expect("n")], 0).expect("cat")
        ),
        0.0
    );
    let soft = |t: &Tensor| t.exp().and_then(|e| e.sum_keepdim(1)?.log());
    assert!(max_abs_diff(&soft(&pa).expect("lse"), &soft(&a).expect("lse")) < 1e-5);
    let half = tensors
        .copy_in(&a.to_dtype(DType::BF16).expect("bf16"))
        .expect("copy_in");
    assert_eq!(
        max_abs_diff(&half, &a.to_dtype(DType::BF16).expect("bf16")),
        0.0
    );
    assert_eq!(
        max_abs_diff(
            &pa.t().expect("t").contiguous().expect("c"),
            &a.t().expect("t")
        ),
        0.0
    );
    assert_device_clean(&dev);
}

/// Blocks of `[16, 8, 128]` f32 (64 KiB): 32 blocks per 2 MiB page.
const BLOCK: [usize; 3] = [16, 8, 128];

fn reference_rows(reference: &Tensor) -> Tensor {
    reference
        .reshape((reference.dims()[0] * BLOCK[0], BLOCK[1], BLOCK[2]))
        .expect("rows")
}

#[test]
fn elastic_kv_matches_an_ordinary_tensor() {
    let dev = device();
    let pool = pool(8 * GIB);
    let tensors = TensorPool::new(&pool, &dev).expect("tensor pool");
    let kv =
        ElasticKv::new(&tensors, 128, &BLOCK, DType::F32, &MemOptions::new()).expect("elastic");
    let page = kv.page_size();
    assert_eq!(kv.shape().dims(), &[128, 16, 8, 128]);
    assert_eq!(kv.physical_bytes(), 0);
    let reference = Tensor::zeros((128, 16, 8, 128), DType::F32, &dev).expect("reference");

    for range in [0..8, 40..48, 100..104] {
        kv.ensure_backed(range.clone()).expect("ensure_backed");
        let src = Tensor::randn(0f32, 1., (range.len(), 16, 8, 128), &dev).expect("randn");
        kv.write_blocks(range.start, &src).expect("write_blocks");
        reference.slice_set(&src, 0, range.start).expect("ref");
    }
    // With 2 MiB pages: blocks 0..8 on page 0, 40..48 on page 1, 100..104 on page 3.
    let pages_of = |blocks: &[std::ops::Range<usize>]| {
        let mut pages: Vec<u64> = blocks
            .iter()
            .flat_map(|r| r.clone())
            .map(|b| b as u64 * kv.block_bytes() / page)
            .collect();
        pages.dedup();
        pages.len() as u64
    };
    assert_eq!(
        kv.physical_bytes(),
        pages_of(&[0..8, 40..48, 100..104]) * page,
        "{:?}",
        kv.stats()
    );
    let token = Tensor::randn(0f32, 1., (1, 8, 128), &dev).expect("token");
    kv.write(41, 3, &token).expect("write");
    reference_rows(&reference)
        .slice_set(&token, 0, 41 * 16 + 3)
        .expect("ref");
    let two = Tensor::randn(0f32, 1., (2, 8, 128), &dev).expect("tokens");
    kv.write(103, 14, &two).expect("write");
    reference_rows(&reference)
        .slice_set(&two, 0, 103 * 16 + 14)
        .expect("ref");

    let r = |a: usize, n: usize| reference.narrow(0, a, n).expect("narrow");
    let v0 = kv.view(0..8).expect("view");
    let v40 = kv.view(40..48).expect("view");
    let v100 = kv.view(100..104).expect("view");
    assert_eq!(max_abs_diff(&v0, &r(0, 8)), 0.0, "view");
    assert_eq!(
        max_abs_diff(
            &v40.narrow(1, 3, 5).expect("n"),
            &r(40, 8).narrow(1, 3, 5).expect("n")
        ),
        0.0,
        "narrow"
    );
    let ids = Tensor::new(&[7u32, 0, 3], &dev).expect("ids");
    assert_eq!(
        max_abs_diff(
            &v0.index_select(&ids, 0).expect("is"),
            &r(0, 8).index_select(&ids, 0).expect("is")
        ),
        0.0,
        "index_select on a view"
    );
    let order = [41usize, 0, 101, 7, 41];
    let ids = Tensor::new(&[41u32, 0, 101, 7, 41], &dev).expect("ids");
    assert_eq!(
        max_abs_diff(
            &kv.gather(&order).expect("gather"),
            &reference.index_select(&ids, 0).expect("is")
        ),
        0.0,
        "gather"
    );
    assert_eq!(
        max_abs_diff(
            &Tensor::cat(&[&v0, &v100], 0).expect("cat"),
            &Tensor::cat(&[&r(0, 8), &r(100, 4)], 0).expect("cat")
        ),
        0.0,
        "cat"
    );
    let w = Tensor::randn(0f32, 1., (1024, 32), &dev).expect("w");
    let mm = max_abs_diff(
        &v40.reshape((128, 1024))
            .and_then(|x| x.matmul(&w))
            .expect("matmul"),
        &r(40, 8)
            .reshape((128, 1024))
            .and_then(|x| x.matmul(&w))
            .expect("matmul"),
    );
    assert!(mm < 1e-3, "matmul differs by {mm}");
    let c = v100.copy().expect("copy");
    assert_eq!(max_abs_diff(&c, &r(100, 4)), 0.0, "copy");
    drop(c);
    // Writes through a view land in the cache.
    let x = Tensor::randn(0f32, 1., (1, 16, 8, 128), &dev).expect("x");
    v100.slice_set(&x, 0, 2).expect("slice_set on a view");
    reference.slice_set(&x, 0, 102).expect("ref");
    assert_eq!(
        max_abs_diff(&kv.gather(&[102]).expect("gather"), &x),
        0.0,
        "write through a view"
    );

    // Refusals: nothing reaches unbacked memory, nothing changes.
    let before = kv.stats();
    let not_backed = |e: Error, block: usize| match e {
        Error::ElasticBlockNotBacked { block: b, .. } => assert_eq!(b, block),
        other => panic!("expected block {block} not backed, got {other}"),
    };
    not_backed(kv.view(7..9).expect_err("view over 8"), 8);
    not_backed(kv.view(50..51).expect_err("view over 50"), 50);
    not_backed(kv.gather(&[0, 60]).expect_err("gather 60"), 60);
    not_backed(kv.write(60, 0, &token).expect_err("write 60"), 60);
    not_backed(
        kv.write_blocks(
            6,
            &Tensor::zeros((4, 16, 8, 128), DType::F32, &dev).expect("z"),
        )
        .expect_err("write_blocks 6..10"),
        8,
    );
    not_backed(kv.release(50..51).expect_err("release 50"), 50);
    for bad in [
        kv.view(3..3).err(),
        kv.view(127..129).err(),
        kv.gather(&[128]).err(),
        kv.gather(&[]).err(),
        kv.write(0, 15, &two).err(),
        kv.write(
            0,
            0,
            &Tensor::zeros((1, 8, 64), DType::F32, &dev).expect("z"),
        )
        .err(),
        kv.write(0, 0, &token.to_dtype(DType::F16).expect("f16"))
            .err(),
        kv.write(0, 0, &token.to_device(&Device::Cpu).expect("cpu"))
            .err(),
    ] {
        let e = bad.expect("refused");
        println!("refused: {e}");
    }
    let after = kv.stats();
    assert_eq!(before.backing, after.backing);
    assert_eq!(after.live_views, 3);

    drop((v0, v40, v100));
    let change = kv.release(0..8).expect("release");
    assert_eq!(
        change.bytes,
        (pages_of(&[0..8, 40..48, 100..104]) - pages_of(&[40..48, 100..104])) * page
    );
    assert_eq!(kv.physical_bytes(), pages_of(&[40..48, 100..104]) * page);
    not_backed(kv.view(0..1).expect_err("released"), 0);
    assert_eq!(
        max_abs_diff(&kv.gather(&[40, 103]).expect("gather"), &{
            let ids = Tensor::new(&[40u32, 103], &dev).expect("ids");
            reference.index_select(&ids, 0).expect("is")
        }),
        0.0,
        "the other blocks keep their data"
    );
    kv.release([40, 41, 42, 43, 44, 45, 46, 47, 100, 101, 102, 103])
        .expect("release the rest");
    assert_eq!(kv.physical_bytes(), 0);
    drop(kv);
    tensors.collect_blocking().expect("collect");
    assert_pool_empty(&pool);
    assert_device_clean(&dev);
}

#[test]
fn release_is_refused_while_a_view_lives() {
    let dev = device();
    let pool = pool(4 * GIB);
    let tensors = TensorPool::new(&pool, &dev).expect("tensor pool");
    let kv = ElasticKv::new(&tensors, 64, &BLOCK, DType::F32, &MemOptions::new()).expect("elastic");
    kv.ensure_backed(0..4).expect("ensure_backed");
    let v = kv.view(1..3).expect("view");
    match kv.release(2..3).expect_err("a view covers block 2") {
        Error::ElasticBlockInUse {
            block: 2,
            users: 1,
            detail,
        } => assert!(detail.contains("1..3"), "{detail}"),
        other => panic!("unexpected {other}"),
    }
    assert!(kv.is_backed(2), "nothing changed");
    kv.release(0..1).expect("block 0 is not under the view");
    let part = v.narrow(0, 0, 1).expect("narrow");
    drop(v);
    kv.release(1..2)
        .expect_err("a narrow of the view still shares it");
    drop(part);
    kv.release(1..3).expect("no view left");

    // A copy of a view holds the blocks until it is dropped, and keeps working.
    let v = kv.view(3..4).expect("view");
    let data = host(&v);
    let copy = v.copy().expect("copy");
    drop(v);
    kv.release(3..4).expect_err("the copy holds block 3");
    assert_eq!(
        host(&copy),
        data,
        "the copy reads after its view was dropped"
    );
    drop(copy);
    kv.release(3..4).expect("released");
    let stats = kv.stats();
    assert_eq!((stats.live_views, stats.backing.mapped_bytes), (0, 0));
    drop(kv);
    assert_pool_empty(&pool);
    assert_device_clean(&dev);
}

#[test]
fn two_models_share_one_budget() {
    let dev = device();
    let backend = Arc::new(CudaBackend::new(0).expect("cuda backend"));
    let shared = SharedPool::new(backend, SharedPoolConfig::new().global_limit(256 * MIB))
        .expect("shared pool");
    let a = shared
        .register(ModelConfig::new("a", (64 * GIB) as usize, 192 * MIB))
        .expect("a");
    let b = shared
        .register(ModelConfig::new("b", (64 * GIB) as usize, 224 * MIB))
        .expect("b");
    let ta = TensorPool::new(&a, &dev).expect("a's tensors");
    let tb = TensorPool::new(&b, &dev).expect("b's tensors");
    let mib_f32 = |mib: u64| (mib * MIB / 4) as usize;

    let x = ta.zeros(mib_f32(160), DType::F32).expect("a: 160 MiB");
    let err = tb
        .zeros(mib_f32(160), DType::F32)
        .expect_err("b does not fit beside a");
    println!("refused: {err}");
    assert!(
        matches!(&err, Error::AdmissionRefused { model, .. } if model == "b"),
        "{err}"
    );
    let sb = b.model_stats().expect("b's stats");
    assert_eq!((sb.in_use, sb.live_allocations), (0, 0), "nothing leaked");
    assert_eq!(tb.stats().live_tensors, 0);
    let small = tb.zeros(mib_f32(32), DType::F32).expect("b: 32 MiB fits");

    // b's elastic cache grows under the same budget: refused beyond it, nothing left mapped.
    let kv = ElasticKv::new(&tb, 4096, &BLOCK, DType::F32, &MemOptions::new()).expect("elastic");
    kv.ensure_backed(0..64).expect("4 MiB fits");
    let backed = kv.physical_bytes();
    let err = kv
        .ensure_backed(64..2048)
        .expect_err("128 MiB more does not");
    assert!(err.is_out_of_memory(), "{err}");
    assert_eq!(kv.physical_bytes(), backed, "the refusal rolled back");

    // a's tensor goes: its memory is reclaimed for b.
    drop(x);
    ta.collect_blocking().expect("collect a");
    let y = tb
        .zeros(mib_f32(160), DType::F32)
        .expect("b: 160 MiB after a gave back");
    assert!(host(&y.narrow(0, 0, 1024).expect("n"))
        .iter()
        .all(|&v| v == 0.0));
    drop((y, small, kv));
    tb.collect_blocking().expect("collect b");
    let g = shared.stats().global;
    println!("{g:?}");
    assert_eq!(g.in_use, 0);
    assert_device_clean(&dev);
}

#[test]
fn several_devices_and_pools() {
    let d1 = device();
    let d2 = Device::new_cuda_with_stream(0).expect("device with its own stream");
    let pool = pool(8 * GIB);
    let t1 = TensorPool::new(&pool, &d1).expect("tensors on d1");
    let t2 = TensorPool::new(&pool, &d2).expect("tensors on d2");
    let a = Tensor::randn(0f32, 1., (64, 64), &Device::Cpu).expect("randn");
    let x1 = t1.copy_in(&a).expect("copy_in");
    let x2 = t2.copy_in(&a).expect("copy_in");
    assert!(x1.device().same_device(&d1) && x2.device().same_device(&d2));
    let m1 = x1.matmul(&x1).expect("matmul");
    let m2 = x2.matmul(&x2).expect("matmul");
    assert!(max_abs_diff(&m1, &m2) < 1e-4);
    let kv: ElasticKv =
        ElasticKv::new(&t2, 32, &BLOCK, DType::F32, &MemOptions::new()).expect("elastic");
    kv.ensure_backed(0..2).expect("ensure");
    let src = Tensor::randn(0f32, 1., (2, 16, 8, 128), &d2).expect("randn");
    kv.write_blocks(0, &src).expect("write");
    assert_eq!(
        max_abs_diff(&kv.gather(&[0, 1]).expect("gather"), &src),
        0.0
    );
    let foreign = Tensor::zeros((1, 8, 128), DType::F32, &d1).expect("z");
    kv.write(0, 0, &foreign)
        .expect_err("a tensor of another candle device is refused");

    assert!(
        TensorPool::new(&pool, &Device::Cpu).is_err(),
        "CPU device refused"
    );
    let host = Pool::host(GIB as usize).expect("host pool");
    assert!(TensorPool::new(&host, &d1).is_err(), "host pool refused");

    let count = CudaContext::device_count().expect("device count");
    if count < 2 {
        println!("second GPU part skipped: {count} CUDA device(s) on this machine");
    } else {
        let d3 = Device::new_cuda(1).expect("device 1");
        assert!(
            TensorPool::new(&pool, &d3).is_err(),
            "a pool of GPU 0 with a device on GPU 1 is refused"
        );
        let pool1 = Pool::cuda(1, (8 * GIB) as usize).expect("pool on GPU 1");
        let t3 = TensorPool::new(&pool1, &d3).expect("tensors on GPU 1");
        let x3 = t3.copy_in(&a).expect("copy_in");
        assert!(max_abs_diff(&x3.matmul(&x3).expect("mm"), &m1) < 1e-4);
        drop(x3);
        t3.collect_blocking().expect("collect");
        assert_pool_empty(&pool1);
    }
    drop((x1, x2, m1, m2, kv));
    t1.collect_blocking().expect("collect");
    t2.collect_blocking().expect("collect");
    assert_pool_empty(&pool);
    assert_device_clean(&d1);
    assert_device_clean(&d2);
}

#[test]
fn owners_dropped_first_keep_memory_until_tensors_go() {
    let dev = device();
    let pool = pool(4 * GIB);
    let ones = Tensor::ones((256, 256), DType::F32, &dev).expect("ones");

    // A tensor pool dropped while one of its tensors lives.
    let tensors = TensorPool::new(&pool, &dev).expect("tensor pool");
    let t = tensors.copy_in(&ones).expect("copy_in");
    drop(tensors);
    assert!(host(&t).iter().all(|&v| v == 1.0), "still readable");
    assert!(pool.stats().in_use > 0, "memory kept for the live tensor");
    drop(t);
    // Other tests' orphans may wait too; ours go at the first blocking reap after their
    // tensors (a non-blocking one only fences them: see `collect_never_waits_for_the_gpu`).
    reap_orphans_blocking();
    assert_pool_empty(&pool);

    // An elastic tensor dropped (with its tensor pool) while a view of it lives.
    let tensors = TensorPool::new(&pool, &dev).expect("tensor pool");
    let kv = ElasticKv::new(&tensors, 64, &BLOCK, DType::F32, &MemOptions::new()).expect("elastic");
    kv.ensure_backed(0..1).expect("ensure");
    kv.write_blocks(
        0,
        &Tensor::ones((1, 16, 8, 128), DType::F32, &dev).expect("o"),
    )
    .expect("write");
    let view = kv.view(0..1).expect("view");
    drop(kv);
    drop(tensors);
    assert!(host(&view).iter().all(|&v| v == 1.0), "still readable");
    assert!(
        pool.stats().range_mapped > 0,
        "pages kept for the live view"
    );
    drop(view);
    reap_orphans_blocking();
    assert_pool_empty(&pool);
    assert_device_clean(&dev);
}

#[test]
fn concurrent_allocation_from_threads() {
    let dev = device();
    let pool = pool(8 * GIB);
    let tensors = TensorPool::new(&pool, &dev).expect("tensor pool");
    std::thread::scope(|s| {
        for thread in 0..4 {
            let tensors = &tensors;
            s.spawn(move || {
                for i in 0..400 {
                    let n = 1024 * (1 + (i + thread) % 7);
                    let t = tensors.zeros((n,), DType::F32).expect("zeros");
                    let u = (t + 1.0).expect("add");
                    if i % 50 == 0 {
                        let s: f32 = u.sum_all().and_then(|s| s.to_scalar()).expect("sum");
                        assert_eq!(s, n as f32);
                    }
                }
            });
        }
    });
    tensors.collect_blocking().expect("collect");
    let stats = tensors.stats();
    assert_eq!(
        (stats.tensors_created, stats.tensors_returned),
        (1600, 1600)
    );
    assert_pool_empty(&pool);
    assert_device_clean(&dev);
}

#[test]
fn indexing_a_pool_tensor_is_a_view() {
    let dev = device();
    let pool = pool(GIB);
    let tensors = TensorPool::new(&pool, &dev).expect("tensor pool");
    let t = tensors
        .copy_in(
            &Tensor::arange(0u32, 60, &dev)
                .and_then(|t| t.reshape((6, 10)))
                .expect("a"),
        )
        .expect("copy_in");
    let row = t.i(2).expect("row");
    drop(t);
    assert_eq!(host(&row), (20..30).map(f64::from).collect::<Vec<_>>());
    tensors.collect_blocking().expect("collect");
    assert_eq!(tensors.stats().live_tensors, 1);
    drop(row);
    tensors.collect_blocking().expect("collect");
    assert_pool_empty(&pool);
}

// ---- ordering with other threads' kernels, and collects that never wait ----

/// The legacy default stream's handle (`CU_STREAM_LEGACY`).
const LEGACY_STREAM: u64 = 1;

/// `links` elementwise kernels on the calling thread's stream (`x * 2`, `* 0.5`, ...: exact, so
/// the result equals `x`); only their number says how long the GPU is busy. No cuBLAS, whose
/// one handle per candle device is shared by the threads.
fn busy_chain(x: &Tensor, links: usize) -> Tensor {
    let mut t = x.affine(2.0, 0.0).expect("affine");
    for i in 1..links {
        t = t
            .affine(if i % 2 == 1 { 0.5 } else { 2.0 }, 0.0)
            .expect("affine");
    }
    if links % 2 == 1 {
        t = t.affine(0.5, 0.0).expect("affine");
    }
    t
}

/// `n x n` f32 (n a power of two) of `1/n`: `x.matmul(x)` equals `x` exactly.
fn stable_matrix(n: usize, dev: &Device) -> Tensor {
    Tensor::full(1.0f32 / n as f32, (n, n), dev).expect("full")
}

/// `links` products `x * x * ... * x` on the calling thread's stream: every link reads `x`, and
/// the result equals `x` (see [`stable_matrix`]).
fn matmul_chain(x: &Tensor, links: usize) -> Tensor {
    let mut t = x.matmul(x).expect("matmul");
    for _ in 1..links {
        t = t.matmul(x).expect("matmul");
    }
    t
}

/// How many links of `chain` on `x` keep the GPU busy for about `target` (measured here, after
/// a warm-up), and how long that many take.
fn links_for(
    x: &Tensor,
    chain: fn(&Tensor, usize) -> Tensor,
    target: Duration,
    max: usize,
) -> (usize, Duration) {
    let dev = x.device();
    drop(chain(x, 4));
    dev.synchronize().expect("synchronize");
    let probe = 16;
    let t0 = Instant::now();
    drop(chain(x, probe));
    dev.synchronize().expect("synchronize");
    let per_link = t0.elapsed() / probe as u32;
    let links = ((target.as_secs_f64() / per_link.as_secs_f64()).ceil() as usize).clamp(4, max);
    (links, per_link * links as u32)
}

/// Every value of an f32 tensor, and how many differ from `want`.
fn count_not(t: &Tensor, want: f32) -> (usize, usize, Option<f32>) {
    let values = t
        .flatten_all()
        .and_then(|t| t.to_vec1::<f32>())
        .expect("read back");
    let first = values.iter().copied().find(|&v| v != want);
    let bad = values.iter().filter(|&&v| v != want).count();
    (bad, values.len(), first)
}

/// The pool's copies, fills and host reads happen in order with kernels that *other* threads
/// queued on the same candle device (candle launches each thread's kernels on that thread's
/// per-thread stream). Producers queue a long chain whose last kernel writes the tensor a
/// consumer thread then copies (`copy_in`, `detached_copy`, `ElasticKv::write`/`write_blocks`)
/// and reads: every consumer must see the final values, never what the memory held while the
/// producer's kernels still ran. Without ordering, the copies run at once on the consumer's
/// stream and see stale values in practically every round.
#[test]
fn pool_copies_are_ordered_with_kernels_of_other_threads() {
    const ROUNDS: usize = 40;
    const PAIRS: usize = 2;
    let dev = device();
    let pool = pool(8 * GIB);
    let tensors = TensorPool::new(&pool, &dev).expect("tensor pool");
    let base = Tensor::ones((4096, 4096), DType::F32, &dev).expect("ones");
    let (links, busy) = links_for(&base, busy_chain, Duration::from_millis(10), 900);
    println!("producer chain: {links} kernels, about {busy:?} of GPU time");
    assert!(
        busy >= Duration::from_millis(2),
        "the window is too short to test anything: {busy:?}"
    );
    let failures: Vec<String> = std::thread::scope(|s| {
        let mut consumers = Vec::new();
        for pair in 0..PAIRS {
            let (tx, rx) = mpsc::sync_channel::<(f32, Tensor, Tensor)>(0);
            let (ack_tx, ack_rx) = mpsc::sync_channel::<()>(0);
            let (tensors, base) = (&tensors, &base);
            s.spawn(move || {
                for round in 0..ROUNDS {
                    let v = (pair * ROUNDS + round) as f32 + 0.5;
                    // The long chain, then the kernel that writes the tensor the other thread
                    // reads: [64, 4096] of `v`.
                    let src = busy_chain(base, links)
                        .narrow(0, 0, 64)
                        .and_then(|t| t.affine(f64::from(v), 0.0))
                        .expect("src");
                    // A pool tensor (zeroed by the pool) written in place by this thread's
                    // kernel after the chain.
                    let q = tensors.zeros((64, 4096), DType::F32).expect("zeros");
                    q.slice_set(&src, 0, 0).expect("slice_set");
                    if tx.send((v, src, q)).is_err() || ack_rx.recv().is_err() {
                        return;
                    }
                }
            });
            consumers.push(s.spawn(move || {
                let kv = ElasticKv::new(tensors, 8, &BLOCK, DType::F32, &MemOptions::new())
                    .expect("elastic");
                kv.ensure_backed(0..8).expect("backed");
                let mut failures = Vec::new();
                for (v, src, q) in rx {
                    // Queue every copy first: each one would race the producer's chain.
                    let p = tensors.copy_in(&src).expect("copy_in");
                    let d = detached_copy(tensors, &src).expect("detached_copy");
                    let rows = src.reshape((256, 8, 128)).expect("rows");
                    kv.write(1, 3, &rows.narrow(0, 0, 13).expect("n"))
                        .expect("write");
                    let blocks = src
                        .reshape((16, 16, 8, 128))
                        .and_then(|t| t.narrow(0, 0, 4))
                        .expect("blocks");
                    kv.write_blocks(4, &blocks).expect("write_blocks");
                    let checks = [
                        ("copy_in", p),
                        ("detached_copy", d),
                        ("host read of a pool tensor the other thread wrote", q),
                        (
                            "ElasticKv::write",
                            kv.gather(&[1])
                                .expect("gather")
                                .narrow(1, 3, 13)
                                .expect("narrow"),
                        ),
                        (
                            "ElasticKv::write_blocks",
                            kv.gather(&[4, 5, 6, 7]).expect("gather"),
                        ),
                    ];
                    for (what, t) in checks {
                        let (bad, n, first) = count_not(&t, v);
                        if bad > 0 {
                            failures.push(format!(
                                "pair {pair}, value {v}: {what}: {bad} of {n} values differ (e.g. {first:?})"
                            ));
                        }
                    }
                    drop(src);
                    if ack_tx.send(()).is_err() {
                        break;
                    }
                }
                failures
            }));
        }
        consumers
            .into_iter()
            .flat_map(|c| c.join().expect("consumer"))
            .collect()
    });
    assert!(
        failures.is_empty(),
        "{} of {} checks saw values from before the other thread's kernels finished:\n{}",
        failures.len(),
        PAIRS * ROUNDS * 5,
        failures.join("\n")
    );
    tensors.collect_blocking().expect("collect");
    assert_eq!(tensors.stats().live_tensors, 0);
    assert_device_clean(&dev);
}

/// The other direction: a fill or copy that one thread queues on a pool tensor while its own
/// stream is busy is seen by the kernels another thread queues on that tensor afterwards.
/// Without ordering, the other thread's kernels run before the fill and read what the memory
/// held before (ones, from the previous round).
#[test]
fn kernels_of_other_threads_see_the_pools_fills_and_copies() {
    const ROUNDS: usize = 40;
    let dev = device();
    let pool = pool(8 * GIB);
    let tensors = TensorPool::new(&pool, &dev).expect("tensor pool");
    let base = Tensor::ones((4096, 4096), DType::F32, &dev).expect("ones");
    let ones = Tensor::ones((64, 4096), DType::F32, &dev).expect("ones");
    let (links, busy) = links_for(&base, busy_chain, Duration::from_millis(10), 900);
    println!("chain: {links} kernels, about {busy:?} of GPU time");
    assert!(
        busy >= Duration::from_millis(2),
        "window too short: {busy:?}"
    );
    dev.synchronize().expect("synchronize");
    let (tx, rx) = mpsc::sync_channel::<(f32, Tensor, Tensor)>(0);
    let (ack_tx, ack_rx) = mpsc::sync_channel::<()>(0);
    let (failures, reused) = std::thread::scope(|s| {
        let tensors = &tensors;
        let (base, ones) = (&base, &ones);
        let producer = s.spawn(move || {
            // Where the last round's tensors were (both were left full of ones).
            let mut last: [u64; 2] = [0; 2];
            let mut reused = 0;
            for round in 0..ROUNDS {
                let v = round as f32 + 0.25;
                let value = (ones * f64::from(v)).expect("value");
                // This thread's stream is busy for a while; then the pool fills and copies.
                let chain = busy_chain(base, links);
                let z = tensors.zeros((64, 4096), DType::F32).expect("zeros");
                let c = tensors.copy_in(&value).expect("copy_in");
                reused += usize::from(last.contains(&device_addr(&z)));
                last = [device_addr(&z), device_addr(&c)];
                if tx.send((v, z, c)).is_err() || ack_rx.recv().is_err() {
                    break;
                }
                drop(chain);
                // The other thread filled the memory with ones and dropped its tensors: give
                // the memory back so that the next round's tensors reuse it.
                tensors.collect_blocking().expect("collect");
            }
            reused
        });
        let mut failures = Vec::new();
        for (v, z, c) in rx {
            let zero_sum: f32 = z
                .sum_all()
                .and_then(|t| t.to_scalar())
                .expect("sum of zeros");
            let off: f32 = c
                .affine(1.0, -f64::from(v))
                .and_then(|t| t.abs())
                .and_then(|t| t.sum_all())
                .and_then(|t| t.to_scalar())
                .expect("distance");
            if zero_sum != 0.0 {
                failures.push(format!("round {v}: zeros sum to {zero_sum}"));
            }
            if off != 0.0 {
                failures.push(format!("round {v}: the copy is {off} away from {v}"));
            }
            // Leave ones behind for the next round's tensors to start from.
            z.slice_set(ones, 0, 0).expect("fill");
            c.slice_set(ones, 0, 0).expect("fill");
            dev.synchronize().expect("synchronize");
            drop((z, c));
            if ack_tx.send(()).is_err() {
                break;
            }
        }
        drop(ack_tx);
        (failures, producer.join().expect("producer"))
    });
    println!(
        "zeros reused the previous round's memory in {reused} of {} rounds",
        ROUNDS - 1
    );
    assert!(
        reused * 2 >= ROUNDS,
        "premise: zeros should land on the previous round's ones in most rounds ({reused} of {ROUNDS}), else a missed fill could go unseen"
    );
    assert!(
        failures.is_empty(),
        "{} of {} checks saw memory before the other thread's fill or copy:\n{}",
        failures.len(),
        ROUNDS * 2,
        failures.join("\n")
    );
    assert_device_clean(&dev);
}

/// `collect` (and `stats`, and the collects of other tensor pools that reap the remains of
/// dropped owners) never waits for the GPU: with a long chain of kernels in flight on memory
/// that is already dropped, every collect returns in a small fraction of the chain's time and
/// gives nothing back; the memory goes back at a later collect, once the GPU has passed the
/// chain, and never before. Three owners: a live tensor pool, a tensor pool dropped before its
/// tensor, an elastic tensor dropped before its view.
#[test]
fn collect_never_waits_for_the_gpu() {
    let dev = device();
    let n = 8192;
    let x_cpu = Tensor::full(1.0f32 / n as f32, (n, n), &Device::Cpu).expect("x");
    let x_dev = stable_matrix(n, &dev);
    let (links, busy) = links_for(&x_dev, matmul_chain, Duration::from_millis(500), 400);
    drop(x_dev);
    println!("chain: {links} matmuls of {n}x{n}, about {busy:?}");
    assert!(
        busy >= Duration::from_millis(200),
        "the chain is too short to tell waiting from not waiting: {busy:?}"
    );
    let quick = busy / 10;
    let collector_pool = pool(GIB);
    let collector = TensorPool::new(&collector_pool, &dev).expect("collector");

    /// Poll `collect` until `gone()` (memory back) and check every call was quick; returns
    /// how long after `queued` the memory went back.
    fn poll_until(
        what: &str,
        collect: &dyn Fn() -> elastic_vmm::candle::CollectReport,
        gone: &dyn Fn() -> bool,
        queued: Instant,
        quick: Duration,
    ) -> Duration {
        let mut slowest = Duration::ZERO;
        let mut polls = 0;
        loop {
            let t0 = Instant::now();
            collect();
            let took = t0.elapsed();
            slowest = slowest.max(took);
            polls += 1;
            assert!(
                took < quick,
                "{what}: collect #{polls} took {took:?}, it waited for the GPU (limit {quick:?})"
            );
            if gone() {
                let after = queued.elapsed();
                println!("{what}: back {after:?} after the chain was queued, {polls} collects, slowest {slowest:?}");
                return after;
            }
            assert!(
                queued.elapsed() < Duration::from_secs(60),
                "{what}: memory never came back"
            );
            std::thread::sleep(Duration::from_millis(2));
        }
    }

    // 1. A tensor of a live tensor pool, dropped while every matmul of the chain reads it.
    let pool_a = pool(4 * GIB);
    let a = TensorPool::new(&pool_a, &dev).expect("tensor pool");
    let x = a.copy_in(&x_cpu).expect("copy_in");
    dev.synchronize().expect("synchronize");
    let queued = Instant::now();
    let y = matmul_chain(&x, links);
    drop(x);
    let t0 = Instant::now();
    let report = a.collect().expect("collect");
    let took = t0.elapsed();
    println!("own tensor: first collect {took:?}: {report:?}");
    assert!(
        took < quick,
        "collect took {took:?} with the chain in flight"
    );
    assert_eq!(
        (report.found_dead, report.returned, report.awaiting_gpu),
        (1, 0, 1),
        "the dead tensor waits behind its fence: {report:?}"
    );
    assert!(pool_a.stats().in_use >= (n * n * 4) as u64);
    let back = poll_until(
        "own tensor",
        &|| a.collect().expect("collect"),
        &|| pool_a.stats().in_use == 0,
        queued,
        quick,
    );
    assert!(
        back >= busy / 2,
        "memory came back {back:?} after queuing a chain of about {busy:?}: before the GPU was done"
    );
    assert_eq!(
        count_not(&y, 1.0 / n as f32).0,
        0,
        "the chain read good memory"
    );
    assert_eq!(a.stats().tensors_returned, 1);
    drop(y);

    // 2. A tensor pool dropped before its tensor: the tensor dies with the chain in flight,
    //    and another tensor pool's collect (which reaps the remains) must not wait.
    let pool_b = pool(4 * GIB);
    let b = TensorPool::new(&pool_b, &dev).expect("tensor pool");
    let x = b.copy_in(&x_cpu).expect("copy_in");
    drop(b);
    dev.synchronize().expect("synchronize");
    let queued = Instant::now();
    let y = matmul_chain(&x, links);
    drop(x);
    let back = poll_until(
        "orphaned tensor",
        &|| collector.collect().expect("collect"),
        &|| pool_b.stats().in_use == 0,
        queued,
        quick,
    );
    assert!(
        back >= busy / 2,
        "orphaned tensor back after {back:?}: too early"
    );
    assert_eq!(count_not(&y, 1.0 / n as f32).0, 0);
    drop(y);

    // 3. An elastic tensor dropped before its view: the last kernel of the chain reads the
    //    view; the view dies with the chain in flight.
    let pool_c = pool(4 * GIB);
    let c = TensorPool::new(&pool_c, &dev).expect("tensor pool");
    let kv = ElasticKv::new(&c, 64, &BLOCK, DType::F32, &MemOptions::new()).expect("elastic");
    kv.ensure_backed(0..64).expect("backed");
    kv.write_blocks(
        0,
        &Tensor::ones((64, 16, 8, 128), DType::F32, &dev).expect("ones"),
    )
    .expect("write");
    let view = kv.view(0..64).expect("view");
    drop(kv);
    drop(c);
    let x = stable_matrix(n, &dev);
    dev.synchronize().expect("synchronize");
    assert!(pool_c.stats().range_mapped > 0);
    let queued = Instant::now();
    let y = matmul_chain(&x, links)
        .narrow(0, 0, 128)
        .and_then(|t| t.add(&view.reshape((128, 8192))?))
        .expect("chain, then the view");
    drop(view);
    let back = poll_until(
        "orphaned elastic tensor",
        &|| collector.collect().expect("collect"),
        &|| pool_c.stats().range_mapped == 0,
        queued,
        quick,
    );
    assert!(
        back >= busy / 2,
        "elastic tensor unmapped after {back:?}: too early"
    );
    assert_eq!(
        count_not(&y, 1.0 + 1.0 / n as f32).0,
        0,
        "the view read good memory"
    );
    drop(y);

    // `stats` collects too, and does not wait either.
    let x = collector.copy_in(&x_cpu).expect("copy_in");
    dev.synchronize().expect("synchronize");
    let y = matmul_chain(&x, links);
    drop(x);
    let t0 = Instant::now();
    let stats = collector.stats();
    let took = t0.elapsed();
    assert!(took < quick, "stats took {took:?}");
    assert_eq!(
        (stats.live_tensors, stats.awaiting_gpu),
        (0, 1),
        "{stats:?}"
    );
    // A blocking collect waits, and gives everything back.
    let report = collector.collect_blocking().expect("collect");
    assert_eq!(report.returned, 1, "{report:?}");
    assert_pool_empty(&collector_pool);
    drop(y);
    for p in [&pool_a, &pool_b, &pool_c] {
        assert_pool_empty(p);
    }
    assert_device_clean(&dev);
}

/// The CUDA backend's stream-ordered copy and fill, on the legacy stream, directly and through
/// an adaptor; zero sizes queue nothing.
#[test]
fn the_cuda_backend_queues_copies_and_fills() {
    let cuda: Arc<dyn Backend> = Arc::new(CudaBackend::new(0).expect("cuda backend"));
    let wrapped: Arc<dyn Backend> = Arc::new(FaultInjector::new(cuda.clone()));
    for backend in [cuda, wrapped] {
        let pool =
            Pool::new(backend.clone(), elastic_vmm::PoolConfig::new(GIB as usize)).expect("pool");
        let len = (3 * MIB + 5) as usize;
        let a = pool.allocate(len).expect("a");
        let b = pool.allocate(len).expect("b");
        // SAFETY: both allocations are live, mapped, disjoint and `len` bytes long; nothing
        // else uses them; the reads below are synchronous on the legacy stream, after these.
        unsafe {
            backend
                .copies()
                .fill_async(a.addr(), len, 0x5a, LEGACY_STREAM)
                .expect("fill");
            backend
                .copies()
                .fill_async(b.addr(), len, 0x00, LEGACY_STREAM)
                .expect("fill");
            backend
                .copies()
                .copy_async(b.addr() + 1, a.addr(), len - 1, LEGACY_STREAM)
                .expect("copy");
            backend
                .copies()
                .copy_async(0, 0, 0, LEGACY_STREAM)
                .expect("zero-size copy");
            backend
                .copies()
                .fill_async(0, 0, 0, LEGACY_STREAM)
                .expect("zero-size fill");
        }
        let mut out = vec![0xffu8; len];
        // SAFETY: `b` is live and mapped.
        unsafe { backend.copies().read(b.addr(), &mut out) }.expect("read");
        assert_eq!(out[0], 0, "the copy started one byte in");
        assert!(
            out[1..].iter().all(|&v| v == 0x5a),
            "copy or fill lost bytes"
        );
    }
}

/// Tensors over a region's bytes with no copy (how weights kept under a broker lease become
/// candle tensors again): they read what was written there; a view past the region, at an
/// offset that is no multiple of the element, over an unmapped part or of another pool's region
/// is refused; the range cannot be unmapped while a view (or a view of it) lives, and can once
/// every view is gone and collected.
#[test]
fn tensors_view_a_regions_bytes_in_place() {
    let dev = device();
    let p = pool(GIB);
    let tensors = TensorPool::new(&p, &dev).expect("tensor pool");
    let region = p
        .reserve_region_with(8 * MIB, &MemOptions::new().tag(elastic_vmm::Tag::Weights))
        .expect("region");
    region.map(0, 4 * MIB).expect("map");
    let values: Vec<f32> = (0..1024).map(|i| i as f32 * 0.5).collect();
    let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
    // SAFETY: mapped just above by this test, nothing else uses it.
    unsafe { p.backend().copies().write(region.addr() + 4096, &bytes) }.expect("write");
    let t = tensors
        .view(&region, 4096, (32, 32), DType::F32)
        .expect("view");
    assert_eq!(device_addr(&t), region.addr() + 4096, "no copy");
    let back: Vec<f32> = t.flatten_all().and_then(|x| x.to_vec1()).expect("read");
    assert_eq!(back, values);
    let row = t.i(3).expect("row");
    for bad in [
        tensors.view(&region, 8 * MIB - 8, (4,), DType::F32),
        tensors.view(&region, 2, (4,), DType::F32),
        tensors.view(&region, 4 * MIB, (4,), DType::F32),
        tensors.view(&region, u64::MAX - 1, (4,), DType::F32),
    ] {
        assert!(bad.is_err(), "{bad:?}");
    }
    let other = pool(GIB);
    let foreign = other.reserve_region(2 * MIB).expect("region");
    foreign.map(0, 2 * MIB).expect("map");
    assert!(tensors.view(&foreign, 0, (4,), DType::F32).is_err());
    drop(t);
    assert!(region.unmap(0, 4 * MIB).is_err(), "a row of the view lives");
    assert_eq!(host(&row)[1], 97.0 * 0.5);
    drop(row);
    tensors.collect_blocking().expect("collect");
    region
        .unmap(0, 4 * MIB)
        .expect("unmap once every view is gone");
    assert_device_clean(&dev);
}
