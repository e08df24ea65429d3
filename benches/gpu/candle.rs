//! Candle on the GPU, in one run:
//! - hot path: a tensor from the pool (`TensorPool::empty`/`zeros`, then dropped) against candle's
//!   own allocation of the same tensor (`Tensor::empty`/`zeros`, `cuMemAllocAsync` underneath);
//! - one decode step of attention over 8 sequences with an elastic KV cache against the same step
//!   with a static candle KV cache (target: within 1%), at short contexts (100..1700 tokens: the
//!   host launching kernels bounds the step, the worst case for the elastic bookkeeping) and long
//!   ones (4000..14500 tokens), with the host time of each part of the step. Its `RESULT`
//!   lines: each step's static time over the elastic one.

use std::time::Instant;

use candle_core::{DType, Device, Tensor, D};
use elastic_vmm::candle::{ElasticKv, TensorPool};
use elastic_vmm::MemOptions;
use elastic_vmm::Pool;

use crate::{median, ratio_line, BoxError, GIB};

/// Seconds per iteration of `f` over `n` iterations, the device synchronized at the end.
fn per_iter(device: &Device, n: usize, mut f: impl FnMut()) -> f64 {
    let t = Instant::now();
    for _ in 0..n {
        f();
    }
    if let Err(e) = device.synchronize() {
        eprintln!("synchronize failed: {e}");
    }
    t.elapsed().as_secs_f64() / n as f64
}

pub fn run() -> Result<(), BoxError> {
    let device = Device::new_cuda(0)?;
    let pool = Pool::cuda(0, (64 * GIB) as usize)?;
    let tensors = TensorPool::new(&pool, &device)?;
    println!("== candle: {} ==", pool.backend_info().device_name);
    hot_path(&device, &tensors)?;
    // Short contexts, where the step is bound by the host launching kernels (the worst case for
    // the elastic bookkeeping), and long ones, where the GPU's work grows with the context.
    decode_step(&device, &tensors, 128, 100, 200)?;
    decode_step(&device, &tensors, 1024, 4000, 1500)?;
    let stats = tensors.stats();
    println!("{stats:?}");
    Ok(())
}

fn hot_path(device: &Device, tensors: &TensorPool) -> Result<(), BoxError> {
    for (elems, n) in [
        (4096usize, 20_000usize),
        (512 << 10, 20_000),
        (16 << 20, 2_000),
    ] {
        let bytes = (elems * 4) as u64;
        // Warm both: the pool maps its memory, candle's stream-ordered pool holds some.
        drop(tensors.zeros(elems, DType::F32)?);
        drop(Tensor::zeros(elems, DType::F32, device)?);
        tensors.collect_blocking()?;
        let mut err = None;
        let mut note = |r: Result<Tensor, BoxError>| {
            if let Err(e) = r {
                err.get_or_insert(e);
            }
        };
        let pool_empty = median(5, || {
            per_iter(device, n, || {
                note(tensors.empty(elems, DType::F32).map_err(Into::into))
            })
        });
        let candle_empty = median(5, || {
            per_iter(device, n, || {
                // SAFETY: the tensor is dropped unread.
                note(unsafe { Tensor::empty(elems, DType::F32, device) }.map_err(Into::into))
            })
        });
        let pool_zeros = median(5, || {
            per_iter(device, n, || {
                note(tensors.zeros(elems, DType::F32).map_err(Into::into))
            })
        });
        let candle_zeros = median(5, || {
            per_iter(device, n, || {
                note(Tensor::zeros(elems, DType::F32, device).map_err(Into::into))
            })
        });
        if let Some(e) = err {
            return Err(e);
        }
        println!(
            "hot tensor {:>9} f32: pool empty {:7.2} us, candle empty {:7.2} us | pool zeros {:7.2} us, candle zeros {:7.2} us",
            crate::human(bytes),
            pool_empty * 1e6,
            candle_empty * 1e6,
            pool_zeros * 1e6,
            candle_zeros * 1e6
        );
        ratio_line(
            &format!("  candle/pool, uninitialised {}", crate::human(bytes)),
            candle_empty,
            pool_empty,
        );
        ratio_line(
            &format!("  candle/pool, zeroed {}", crate::human(bytes)),
            candle_zeros,
            pool_zeros,
        );
    }
    Ok(())
}

const KV_HEADS: usize = 8;
const HEAD_DIM: usize = 128;
const HIDDEN: usize = KV_HEADS * HEAD_DIM;
const BLOCK_SIZE: usize = 16;
const SEQS: usize = 8;
/// Timed steps per cache (one step each, the three caches interleaved); medians are reported.
const SAMPLES: usize = 151;

enum Cache {
    Elastic(ElasticKv),
    Static { blocks: Tensor, rows: Tensor },
}

thread_local! {
    /// Host time spent in the cache operations of `step`: ensure, write, tokens, the rest.
    static SPENT: std::cell::Cell<[f64; 4]> = const { std::cell::Cell::new([0.0; 4]) };
}

/// Add the seconds since `t` to bucket `i` of [`SPENT`]; returns a fresh start.
fn spent(i: usize, t: Instant) -> Instant {
    let now = Instant::now();
    SPENT.with(|c| {
        let mut v = c.get();
        v[i] += (now - t).as_secs_f64();
        c.set(v);
    });
    now
}

impl Cache {
    fn write(&self, block: usize, pos: usize, t: &Tensor) -> Result<(), BoxError> {
        match self {
            Cache::Elastic(kv) => kv.write(block, pos, t)?,
            Cache::Static { rows, .. } => rows.slice_set(t, 0, block * BLOCK_SIZE + pos)?,
        }
        Ok(())
    }

    fn tokens(&self, table: &[usize], len: usize) -> Result<Tensor, BoxError> {
        let blocks = match self {
            Cache::Elastic(kv) => kv.gather(table)?,
            Cache::Static { blocks, .. } => {
                let ids: Vec<u32> = table.iter().map(|&b| b as u32).collect();
                blocks.index_select(&Tensor::new(ids.as_slice(), blocks.device())?, 0)?
            }
        };
        Ok(blocks
            .reshape((table.len() * BLOCK_SIZE, KV_HEADS, HEAD_DIM))?
            .narrow(0, 0, len)?
            .transpose(0, 1)?
            .contiguous()?)
    }
}

/// Per-call cost of the cache operations a decode step makes, elastic against static, each
/// timed over many calls with one synchronize at the end.
fn op_costs(device: &Device, elastic: &Cache, fixed: &Cache, bps: usize) -> Result<(), BoxError> {
    const N: usize = 2000;
    let token = Tensor::randn(0f32, 1., (1, KV_HEADS, HEAD_DIM), device)?;
    // The longest sequence's first 100 blocks, all backed.
    let first = (SEQS - 1) * bps;
    let table: Vec<usize> = (first..first + 100).collect();
    let Cache::Elastic(kv) = elastic else {
        return Err("op_costs needs the elastic cache first".into());
    };
    let mut line = Vec::new();
    for (name, cache) in [("elastic", elastic), ("static", fixed)] {
        let mut err: Option<BoxError> = None;
        let write = per_iter(device, N, || {
            if let Err(e) = cache.write(first + 7, 3, &token) {
                err.get_or_insert(e);
            }
        });
        let gather = per_iter(device, N, || {
            if let Err(e) = cache.tokens(&table, 1600) {
                err.get_or_insert(e);
            }
        });
        if let Some(e) = err {
            return Err(e);
        }
        line.push(format!(
            "{name}: write {:.2} us, gather 100 blocks {:.2} us",
            write * 1e6,
            gather * 1e6
        ));
    }
    let ensure = per_iter(device, N, || {
        let _ = kv.ensure_backed([first + 7]);
    });
    println!(
        "  per call: {}; ensure_backed of a backed block {:.2} us",
        line.join(" | "),
        ensure * 1e6
    );
    Ok(())
}

/// A preallocated cache of the same maximum: an ordinary candle tensor, or (with `tensors`) a
/// fully mapped pool tensor driven by the same candle calls (which separates the memory's
/// effect from the elastic bookkeeping's).
fn static_cache(
    device: &Device,
    tensors: Option<&TensorPool>,
    max_blocks: usize,
) -> Result<Cache, BoxError> {
    let shape = (max_blocks, BLOCK_SIZE, KV_HEADS, HEAD_DIM);
    let blocks = match tensors {
        None => Tensor::zeros(shape, DType::F32, device)?,
        Some(t) => t.zeros(shape, DType::F32)?,
    };
    let rows = blocks.reshape((max_blocks * BLOCK_SIZE, KV_HEADS, HEAD_DIM))?;
    Ok(Cache::Static { blocks, rows })
}

struct Weights {
    wq: Tensor,
    wk: Tensor,
    wv: Tensor,
    wo: Tensor,
}

/// One decode step of every sequence (lengths `lens`, advanced by one; sequence `s` owns blocks
/// `s * bps..`) against `k`, `v`.
fn step(
    k: &Cache,
    v: &Cache,
    w: &Weights,
    x: &Tensor,
    lens: &mut [usize],
    bps: usize,
) -> Result<Tensor, BoxError> {
    let q = x.matmul(&w.wq)?;
    let kx = x.matmul(&w.wk)?;
    let vx = x.matmul(&w.wv)?;
    let mut outs = Vec::with_capacity(lens.len());
    for (s, len) in lens.iter_mut().enumerate() {
        let t = Instant::now();
        let pos = *len;
        let block = s * bps + pos / BLOCK_SIZE;
        if pos % BLOCK_SIZE == 0 {
            if let Cache::Elastic(kv) = k {
                kv.ensure_backed([block])?;
            }
            if let Cache::Elastic(kv) = v {
                kv.ensure_backed([block])?;
            }
        }
        let t = spent(0, t);
        k.write(
            block,
            pos % BLOCK_SIZE,
            &kx.narrow(0, s, 1)?.reshape((1, KV_HEADS, HEAD_DIM))?,
        )?;
        v.write(
            block,
            pos % BLOCK_SIZE,
            &vx.narrow(0, s, 1)?.reshape((1, KV_HEADS, HEAD_DIM))?,
        )?;
        let t = spent(1, t);
        *len += 1;
        let first = s * bps;
        let table: Vec<usize> = (first..first + len.div_ceil(BLOCK_SIZE)).collect();
        let keys = k.tokens(&table, *len)?;
        let values = v.tokens(&table, *len)?;
        let t = spent(2, t);
        let qh = q.narrow(0, s, 1)?.reshape((KV_HEADS, 1, HEAD_DIM))?;
        let scores = (qh.matmul(&keys.t()?)? / (HEAD_DIM as f64).sqrt())?;
        let e = scores
            .broadcast_sub(&scores.max_keepdim(D::Minus1)?)?
            .exp()?;
        let p = e.broadcast_div(&e.sum_keepdim(D::Minus1)?)?;
        outs.push(p.matmul(&values)?.reshape((1, HIDDEN))?);
        spent(3, t);
    }
    Ok(Tensor::cat(&outs, 0)?.matmul(&w.wo)?)
}

/// Decode steps of `SEQS` sequences of `base + s * spread` tokens, each with room for `bps`
/// blocks, over the three caches.
fn decode_step(
    device: &Device,
    tensors: &TensorPool,
    bps: usize,
    base: usize,
    spread: usize,
) -> Result<(), BoxError> {
    let max_blocks = SEQS * bps;
    let shape = [BLOCK_SIZE, KV_HEADS, HEAD_DIM];
    let ek = Cache::Elastic(ElasticKv::new(
        tensors,
        max_blocks,
        &shape,
        DType::F32,
        &MemOptions::new(),
    )?);
    let ev = Cache::Elastic(ElasticKv::new(
        tensors,
        max_blocks,
        &shape,
        DType::F32,
        &MemOptions::new(),
    )?);
    let sk = static_cache(device, None, max_blocks)?;
    let sv = static_cache(device, None, max_blocks)?;
    let pk = static_cache(device, Some(tensors), max_blocks)?;
    let pv = static_cache(device, Some(tensors), max_blocks)?;
    let scale = (1.0 / (HIDDEN as f64).sqrt()) as f32;
    let w = Weights {
        wq: Tensor::randn(0f32, scale, (HIDDEN, HIDDEN), device)?,
        wk: Tensor::randn(0f32, scale, (HIDDEN, HIDDEN), device)?,
        wv: Tensor::randn(0f32, scale, (HIDDEN, HIDDEN), device)?,
        wo: Tensor::randn(0f32, scale, (HIDDEN, HIDDEN), device)?,
    };
    // Sequences of 100 to 1500 tokens already in the caches (their blocks backed and filled).
    let start: Vec<usize> = (0..SEQS).map(|s| base + s * spread).collect();
    for (s, &len) in start.iter().enumerate() {
        let first = s * bps;
        let n = len.div_ceil(BLOCK_SIZE);
        let data = Tensor::randn(0f32, 1., (n, BLOCK_SIZE, KV_HEADS, HEAD_DIM), device)?;
        for c in [&ek, &ev] {
            if let Cache::Elastic(kv) = c {
                kv.ensure_backed(first..first + n)?;
                kv.write_blocks(first, &data)?;
            }
        }
        for c in [&sk, &sv, &pk, &pv] {
            if let Cache::Static { blocks, .. } = c {
                blocks.slice_set(&data, 0, first)?;
            }
        }
    }
    let mut lens_e = start.clone();
    let mut lens_s = start.clone();
    let mut lens_p = start.clone();
    // Warm up, and check that the caches compute the same.
    let x = Tensor::randn(0f32, 1., (SEQS, HIDDEN), device)?;
    let reference = step(&sk, &sv, &w, &x, &mut lens_s, bps)?;
    let mut diff = 0f32;
    for (k, v, lens) in [(&ek, &ev, &mut lens_e), (&pk, &pv, &mut lens_p)] {
        let d: f32 = (step(k, v, &w, &x, lens, bps)? - &reference)?
            .abs()?
            .max_all()?
            .to_scalar()?;
        diff = diff.max(d);
    }
    if diff > 1e-5 {
        return Err(format!("decode step: elastic and static outputs differ by {diff}").into());
    }
    // Round-robin over the three so that drift hits all alike; each sample is one step.
    let mut times_e = Vec::new();
    let mut times_s = Vec::new();
    let mut times_p = Vec::new();
    let (mut host_e, mut host_s, mut host_p) = ([0f64; 4], [0f64; 4], [0f64; 4]);
    // The order rotates every round, so that no cache always runs right after the same one.
    for round in 0..SAMPLES {
        let mut order = [
            (&ek, &ev, &mut lens_e, (&mut times_e, &mut host_e)),
            (&sk, &sv, &mut lens_s, (&mut times_s, &mut host_s)),
            (&pk, &pv, &mut lens_p, (&mut times_p, &mut host_p)),
        ];
        order.rotate_left(round % 3);
        for (k, v, lens, (times, host)) in order {
            device.synchronize()?;
            SPENT.with(|c| c.set([0.0; 4]));
            let t = Instant::now();
            drop(step(k, v, &w, &x, lens, bps)?);
            device.synchronize()?;
            times.push(t.elapsed().as_secs_f64());
            let h = SPENT.with(|c| c.get());
            for (acc, x) in host.iter_mut().zip(h) {
                *acc += x / SAMPLES as f64;
            }
        }
    }
    let mut it_e = times_e.into_iter();
    let mut it_s = times_s.into_iter();
    let mut it_p = times_p.into_iter();
    let elastic = median(SAMPLES, || it_e.next().unwrap_or(f64::NAN));
    let fixed = median(SAMPLES, || it_s.next().unwrap_or(f64::NAN));
    let pooled = median(SAMPLES, || it_p.next().unwrap_or(f64::NAN));
    let physical: u64 = [&ek, &ev]
        .iter()
        .map(|c| match c {
            Cache::Elastic(kv) => kv.physical_bytes(),
            Cache::Static { .. } => 0,
        })
        .sum();
    println!(
        "decode step, {SEQS} sequences of {}..{} tokens: elastic {:.1} us, static {:.1} us ({:+.2}%); KV memory elastic {} vs static {}; outputs equal (max diff {diff:e})",
        lens_e.iter().min().unwrap_or(&0),
        lens_e.iter().max().unwrap_or(&0),
        elastic * 1e6,
        fixed * 1e6,
        (elastic / fixed - 1.0) * 100.0,
        crate::human(physical),
        crate::human(2 * (max_blocks * BLOCK_SIZE * HIDDEN * 4) as u64)
    );
    ratio_line("  static/elastic, decode step", fixed, elastic);
    let (key, what) = if base < 1000 {
        (
            "candle/decode-step-short",
            "candle decode step, 8 short sequences, over an elastic KV cache",
        )
    } else {
        (
            "candle/decode-step-long",
            "candle decode step, 8 long sequences, over an elastic KV cache",
        )
    };
    crate::result(
        key,
        what,
        format!("{:.1} us", elastic * 1e6),
        "the same step over static candle tensors",
        format!("{:.1} us", fixed * 1e6),
        fixed / elastic,
    );
    let fmt = |h: [f64; 4]| {
        format!(
            "ensure {:.1}, write {:.1}, tokens {:.1}, attention {:.1}",
            h[0] * 1e6,
            h[1] * 1e6,
            h[2] * 1e6,
            h[3] * 1e6
        )
    };
    println!(
        "  host time per step (us): elastic {} | static {} | pool tensor {}",
        fmt(host_e),
        fmt(host_s),
        fmt(host_p)
    );
    op_costs(device, &ek, &sk, bps)?;
    println!(
        "  same step over a preallocated pool tensor (pool memory, no elastic bookkeeping): {:.1} us ({:+.2}% vs static candle)",
        pooled * 1e6,
        (pooled / fixed - 1.0) * 100.0
    );
    Ok(())
}
