//! A small attention decode loop in candle whose KV cache lives in elastic memory.
//!
//! Several sequences of different lengths decode at once, each in a slot of the cache; their K
//! and V caches grow block by block (a block's memory is backed when its first token arrives) and
//! are released when a sequence finishes, and the slot takes the next sequence. The same loop
//! runs against an ordinary candle tensor cache of the same maximum, preallocated: the example
//! prints physical memory over time for both, and checks that the attention outputs are equal
//! (it exits with an error on any mismatch).
//!
//! ```sh
//! cargo run --release --features candle --example elastic_kv_cache        # needs a CUDA GPU
//! cargo run --release --features candle --example elastic_kv_cache -- 40  # 40 sequences
//! ```

use std::process::ExitCode;
use std::time::Instant;

use candle_core::{DType, Device, Tensor, D};
use elastic_vmm::candle::{ElasticKv, TensorPool};
use elastic_vmm::MemOptions;
use elastic_vmm::Pool;

type BoxError = Box<dyn std::error::Error>;

const KV_HEADS: usize = 8;
const HEAD_DIM: usize = 128;
const HIDDEN: usize = KV_HEADS * HEAD_DIM;
/// Tokens per block: a block is 64 x 8 x 128 f32 = 256 KiB, 8 blocks to a 2 MiB page.
const BLOCK_SIZE: usize = 64;
/// Sequences decoding at once.
const SLOTS: usize = 8;
/// Blocks per slot: sequences of up to 2048 tokens.
const BLOCKS_PER_SLOT: usize = 32;
const MAX_BLOCKS: usize = SLOTS * BLOCKS_PER_SLOT;
const MIB: f64 = (1u64 << 20) as f64;

/// A KV cache for one of K or V: elastic, or an ordinary candle tensor of the maximum size.
enum Cache {
    Elastic(ElasticKv),
    Static { blocks: Tensor, rows: Tensor },
}

impl Cache {
    fn new_static(device: &Device) -> candle_core::Result<Cache> {
        let blocks = Tensor::zeros(
            (MAX_BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_DIM),
            DType::F32,
            device,
        )?;
        let rows = blocks.reshape((MAX_BLOCKS * BLOCK_SIZE, KV_HEADS, HEAD_DIM))?;
        Ok(Cache::Static { blocks, rows })
    }

    /// Store one token (`[1, kv_heads, head_dim]`) at position `pos` of block `block`.
    fn write(&self, block: usize, pos: usize, token: &Tensor) -> candle_core::Result<()> {
        match self {
            Cache::Elastic(kv) => Ok(kv.write(block, pos, token)?),
            Cache::Static { rows, .. } => rows.slice_set(token, 0, block * BLOCK_SIZE + pos),
        }
    }

    /// The first `len` tokens of the sequence whose block table is `table`, as
    /// `[kv_heads, len, head_dim]`.
    fn tokens(&self, table: &[usize], len: usize) -> candle_core::Result<Tensor> {
        let blocks = match self {
            Cache::Elastic(kv) => kv.gather(table)?,
            Cache::Static { blocks, .. } => {
                let ids: Vec<u32> = table.iter().map(|&b| b as u32).collect();
                blocks.index_select(&Tensor::new(ids.as_slice(), blocks.device())?, 0)?
            }
        };
        blocks
            .reshape((table.len() * BLOCK_SIZE, KV_HEADS, HEAD_DIM))?
            .narrow(0, 0, len)?
            .transpose(0, 1)?
            .contiguous()
    }
}

/// Single-query attention of one sequence: `q` is `[kv_heads, 1, head_dim]`.
fn attend(
    q: &Tensor,
    k: &Cache,
    v: &Cache,
    table: &[usize],
    len: usize,
) -> candle_core::Result<Tensor> {
    let keys = k.tokens(table, len)?;
    let values = v.tokens(table, len)?;
    let scores = (q.matmul(&keys.t()?)? / (HEAD_DIM as f64).sqrt())?;
    let max = scores.max_keepdim(D::Minus1)?;
    let e = scores.broadcast_sub(&max)?.exp()?;
    let p = e.broadcast_div(&e.sum_keepdim(D::Minus1)?)?;
    p.matmul(&values)?.reshape((1, HIDDEN))
}

/// A sequence decoding in a slot.
struct Active {
    id: usize,
    slot: usize,
    len: usize,
    pos: usize,
}

impl Active {
    fn table(&self) -> Vec<usize> {
        let first = self.slot * BLOCKS_PER_SLOT;
        (first..first + self.pos / BLOCK_SIZE + 1).collect()
    }
}

/// Sequence lengths from a fixed xorshift generator: 80 to 2048 tokens.
fn lengths(n: usize) -> Vec<usize> {
    let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            80 + (x % (BLOCKS_PER_SLOT * BLOCK_SIZE - 80 + 1) as u64) as usize
        })
        .collect()
}

fn run(sequences: usize) -> Result<f64, BoxError> {
    let device =
        Device::new_cuda(0).map_err(|e| format!("this example needs a CUDA GPU (candle: {e})"))?;
    let pool = Pool::cuda(0, 64 << 30)?;
    let tensors = TensorPool::new(&pool, &device)?;
    let elastic_k = Cache::Elastic(ElasticKv::new(
        &tensors,
        MAX_BLOCKS,
        &[BLOCK_SIZE, KV_HEADS, HEAD_DIM],
        DType::F32,
        &MemOptions::new(),
    )?);
    let elastic_v = Cache::Elastic(ElasticKv::new(
        &tensors,
        MAX_BLOCKS,
        &[BLOCK_SIZE, KV_HEADS, HEAD_DIM],
        DType::F32,
        &MemOptions::new(),
    )?);
    let static_k = Cache::new_static(&device)?;
    let static_v = Cache::new_static(&device)?;
    let block_bytes = (BLOCK_SIZE * KV_HEADS * HEAD_DIM * 4) as u64;
    let static_bytes = 2 * MAX_BLOCKS as u64 * block_bytes;
    let physical = || -> u64 {
        [&elastic_k, &elastic_v]
            .iter()
            .map(|c| match c {
                Cache::Elastic(kv) => kv.physical_bytes(),
                Cache::Static { .. } => 0,
            })
            .sum()
    };
    let scale = 1.0 / (HIDDEN as f64).sqrt();
    let weight = || Tensor::randn(0f32, scale as f32, (HIDDEN, HIDDEN), &device);
    let (wq, wk, wv, wo) = (weight()?, weight()?, weight()?, weight()?);

    let lens = lengths(sequences);
    let mut queue = lens.iter().copied().enumerate();
    let mut slots: Vec<Option<Active>> = (0..SLOTS).map(|_| None).collect();
    let mut max_diff = 0f64;
    let (mut step, mut tokens_in_cache, mut peak, mut area) = (0usize, 0usize, 0u64, 0u128);
    let started = Instant::now();
    println!(
        "{sequences} sequences of {}..{} tokens, {SLOTS} at a time; blocks of {BLOCK_SIZE} tokens ({} KiB), static cache {:.0} MiB (K+V)",
        lens.iter().min().unwrap_or(&0),
        lens.iter().max().unwrap_or(&0),
        block_bytes >> 10,
        static_bytes as f64 / MIB
    );
    println!(
        "{:>6} {:>7} {:>9} {:>14} {:>12}",
        "step", "active", "tokens", "elastic MiB", "static MiB"
    );
    loop {
        // Fill free slots with waiting sequences.
        for (slot, s) in slots.iter_mut().enumerate() {
            if s.is_none() {
                if let Some((id, len)) = queue.next() {
                    *s = Some(Active {
                        id,
                        slot,
                        len,
                        pos: 0,
                    });
                }
            }
        }
        let active: Vec<usize> = (0..SLOTS).filter(|&i| slots[i].is_some()).collect();
        if active.is_empty() {
            break;
        }
        // One decode step for every active sequence: project the new token, store its K and V
        // in both caches, attend over the cache, project out.
        let x = Tensor::randn(0f32, 1., (active.len(), HIDDEN), &device)?;
        let q = x.matmul(&wq)?;
        let k = x.matmul(&wk)?;
        let v = x.matmul(&wv)?;
        let mut outs_elastic = Vec::with_capacity(active.len());
        let mut outs_static = Vec::with_capacity(active.len());
        for (row, &i) in active.iter().enumerate() {
            let Some(a) = &slots[i] else { continue };
            let block = a.slot * BLOCKS_PER_SLOT + a.pos / BLOCK_SIZE;
            if a.pos % BLOCK_SIZE == 0 {
                // The sequence's next block gets memory now.
                for c in [&elastic_k, &elastic_v] {
                    if let Cache::Elastic(kv) = c {
                        kv.ensure_backed([block])?;
                    }
                }
            }
            let kt = k.narrow(0, row, 1)?.reshape((1, KV_HEADS, HEAD_DIM))?;
            let vt = v.narrow(0, row, 1)?.reshape((1, KV_HEADS, HEAD_DIM))?;
            for (cache, t) in [
                (&elastic_k, &kt),
                (&elastic_v, &vt),
                (&static_k, &kt),
                (&static_v, &vt),
            ] {
                cache.write(block, a.pos % BLOCK_SIZE, t)?;
            }
            let qh = q.narrow(0, row, 1)?.reshape((KV_HEADS, 1, HEAD_DIM))?;
            let table = a.table();
            outs_elastic.push(attend(&qh, &elastic_k, &elastic_v, &table, a.pos + 1)?);
            outs_static.push(attend(&qh, &static_k, &static_v, &table, a.pos + 1)?);
        }
        let out_elastic = Tensor::cat(&outs_elastic, 0)?.matmul(&wo)?;
        let out_static = Tensor::cat(&outs_static, 0)?.matmul(&wo)?;
        let diff: f32 = (out_elastic - out_static)?.abs()?.max_all()?.to_scalar()?;
        max_diff = max_diff.max(diff as f64);
        if diff.is_nan() || diff > 1e-5 {
            return Err(format!("step {step}: attention outputs differ by {diff}").into());
        }

        // Advance; finished sequences give their blocks back and free their slot.
        for &i in &active {
            let done = match &mut slots[i] {
                Some(a) => {
                    a.pos += 1;
                    a.pos == a.len
                }
                None => false,
            };
            if done {
                if let Some(a) = slots[i].take() {
                    for c in [&elastic_k, &elastic_v] {
                        if let Cache::Elastic(kv) = c {
                            kv.release(a.table()[..a.len.div_ceil(BLOCK_SIZE)].iter().copied())?;
                        }
                    }
                    println!(
                        "{:>6} sequence {} ({} tokens) finished, blocks released",
                        step, a.id, a.len
                    );
                }
            }
        }
        tokens_in_cache = slots.iter().flatten().map(|a| a.pos).sum();
        let phys = physical();
        peak = peak.max(phys);
        area += phys as u128;
        if step % 100 == 0 {
            println!(
                "{step:>6} {:>7} {tokens_in_cache:>9} {:>14.1} {:>12.1}",
                active.len(),
                phys as f64 / MIB,
                static_bytes as f64 / MIB
            );
        }
        step += 1;
    }
    let elapsed = started.elapsed();
    let mean = area as f64 / step.max(1) as f64;
    println!(
        "\n{step} steps in {:.2} s ({:.2} ms/step, both caches); tokens left in cache: {tokens_in_cache}",
        elapsed.as_secs_f64(),
        elapsed.as_secs_f64() * 1e3 / step.max(1) as f64
    );
    println!(
        "physical KV memory: elastic peak {:.1} MiB, mean {:.1} MiB, now {:.1} MiB; static {:.1} MiB all along ({:.1}x the elastic mean)",
        peak as f64 / MIB,
        mean / MIB,
        physical() as f64 / MIB,
        static_bytes as f64 / MIB,
        static_bytes as f64 / mean.max(1.0)
    );
    println!("attention outputs, elastic vs static cache: max abs diff {max_diff:e}");
    if physical() != 0 {
        return Err(format!(
            "{} bytes still backed after every sequence finished",
            physical()
        )
        .into());
    }
    println!("{:?}", tensors.stats());
    Ok(max_diff)
}

fn main() -> ExitCode {
    let sequences = std::env::args()
        .nth(1)
        .and_then(|a| a.parse().ok())
        .unwrap_or(24);
    match run(sequences) {
        Ok(_) => {
            println!("OK: outputs equal");
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}
