//! `serve probe --gpu small|8b`: what one engine of `serve bench` computes in how long, alone
//! on the device, so the benchmark's load 1.0 is priced from this machine's engine rather than
//! from constants.
//!
//! ```text
//! serve probe --gpu 8b [--max-batch 64] [--max-context 4096] [--prefill-chunk 512] [--prefill kernel]
//!                      [--block-shape token-major|head-major|split-k]
//! ```
//!
//! `--prefill gather` times prefill by the path before the prefill kernel (blocks gathered,
//! scores materialised), to compare the two on one machine. `--block-shape` puts the cache's
//! blocks in another engine's order (`split-k`: vLLM's paged-attention layout, as mistral.rs
//! and candle-vllm allocate it): the decode and prefill kernels read that order in place and
//! the write kernel writes it.
//!
//! The engine is `serve bench`'s (`llama::engine_model`: random bf16 weights, its KV a paged
//! KV cache, decode attended in place by the paged-attention kernel), in pools of its own.
//! It times decode steps over distinct blocks (batches 1 to `--max-batch`, contexts 512 to
//! `--max-context`) and prefill forwards of one chunk at several offsets, checks the kernels'
//! decode and prefill against attention by gather on the same cache (logits), fits the cost model of
//! `serve bench` (seconds per step, per sequence, per context token read; per prefill token),
//! and prints it as the line `cost-ms: STEP,SEQ,PREFILL_TOKEN,CONTEXT_TOKEN` that `serve bench
//! --cost-ms` takes.

use std::time::Instant;

use elastic_vmm::Pool;

use crate::cluster::BlockStore;
use crate::engine::{EngineConfig, SeqView, StepModel};
use crate::llama::{self, Size};
use crate::metrics::least_squares;
use crate::paged_llama::BLOCK_TOKENS;

const GIB: u64 = 1 << 30;
/// Timed repetitions of each shape (the median is kept), after one untimed.
const REPS: usize = 5;

/// The probe's settings.
struct ProbeArgs {
    size: Size,
    max_batch: usize,
    max_context: usize,
    chunk: usize,
    /// Prefill by gathering the blocks (`--prefill gather`).
    prefill_by_gather: bool,
    /// The cache's block order (`--block-shape`).
    shape: elastic_vmm::candle::BlockShape,
}

fn parse(args: &[String]) -> Result<ProbeArgs, String> {
    let mut a = ProbeArgs {
        size: Size::Llama8B,
        max_batch: 64,
        max_context: 4096,
        chunk: 512,
        prefill_by_gather: false,
        shape: elastic_vmm::candle::BlockShape::TokenMajor,
    };
    let mut gpu = false;
    let mut it = args.iter();
    while let Some(flag) = it.next() {
        let v = it
            .next()
            .ok_or_else(|| format!("{flag} needs a value"))?
            .as_str();
        let num = |v: &str| -> Result<usize, String> {
            v.parse::<usize>()
                .ok()
                .filter(|n| *n > 0)
                .ok_or_else(|| format!("{flag}: {v:?} is not a positive count"))
        };
        match flag.as_str() {
            "--gpu" => {
                a.size = Size::parse(v)?;
                gpu = true;
            }
            "--max-batch" => a.max_batch = num(v)?,
            "--max-context" => a.max_context = num(v)?,
            "--prefill-chunk" => a.chunk = num(v)?,
            "--block-shape" => a.shape = llama::parse_block_shape(v)?,
            "--prefill" => {
                a.prefill_by_gather = match v {
                    "kernel" => false,
                    "gather" => true,
                    _ => return Err(format!("--prefill {v:?}: kernel or gather")),
                }
            }
            _ => return Err(format!("unknown flag {flag}")),
        }
    }
    if !gpu {
        return Err("usage: serve probe --gpu small|8b [--max-batch N] [--max-context N] [--prefill-chunk N] [--prefill kernel|gather] [--block-shape token-major|head-major|split-k]".into());
    }
    // The fit needs two batch sizes and two contexts.
    if a.max_batch < 2 || a.max_context < 2 * BLOCK_TOKENS {
        return Err(format!(
            "--max-batch {} and --max-context {}: the fit needs at least 2 sequences and {} tokens",
            a.max_batch,
            a.max_context,
            2 * BLOCK_TOKENS
        ));
    }
    if a.chunk > a.max_context {
        return Err(format!(
            "--prefill-chunk {} exceeds --max-context {}",
            a.chunk, a.max_context
        ));
    }
    Ok(a)
}

/// The median of `REPS` timings of `f` (seconds), after one untimed call.
fn median(mut f: impl FnMut() -> Result<f64, String>) -> Result<f64, String> {
    f()?;
    let mut t = (0..REPS).map(|_| f()).collect::<Result<Vec<f64>, _>>()?;
    t.sort_by(f64::total_cmp);
    Ok(t[REPS / 2])
}

/// Runs the probe; see the module docs.
pub fn run(args: &[String]) -> Result<(), String> {
    let a = parse(args)?;
    let t0 = Instant::now();
    let e = |e: elastic_vmm::Error| e.to_string();
    let per_seq = a.max_context.div_ceil(BLOCK_TOKENS);
    let blocks = a.max_batch * per_seq;
    let kv_bytes = blocks as u64 * a.size.block_bytes();
    let pool = Pool::cuda(0, (a.size.weight_bytes() + 16 * GIB) as usize).map_err(e)?;
    let kv_pool = Pool::cuda(0, (kv_bytes + GIB) as usize).map_err(e)?;
    let engine = EngineConfig {
        max_batch: a.max_batch,
        max_prefill_tokens: a.chunk as u32,
        max_context: a.max_context as u32,
    };
    let mut m = llama::engine_model(
        a.size,
        &pool,
        &kv_pool,
        "probe",
        blocks + 1,
        engine,
        a.chunk,
        a.shape,
    )?;
    println!(
        "probe: {} ({:?} blocks) on {}: weights {:.2} GiB, loaded and warmed in {:.1} s; activations' peak {:.2} GiB",
        a.size.name(),
        a.shape,
        pool.backend_info().device_name,
        m.held as f64 / GIB as f64,
        t0.elapsed().as_secs_f64(),
        m.act_peak as f64 / GIB as f64
    );
    let ids = BlockStore::alloc(&m.kv, blocks)?;
    let tables: Vec<&[u32]> = ids.chunks(per_seq).collect();
    m.model.set_prefill_by_gather(a.prefill_by_gather);
    let r = measure(&a, &mut m.model, &tables);
    BlockStore::free(&m.kv, &ids)?;
    r
}

fn measure(a: &ProbeArgs, model: &mut llama::LlamaModel, tables: &[&[u32]]) -> Result<(), String> {
    // The kernel against the gather, on the same blocks: a full batch at the longest context
    // (the cache first written by a prefill of each sequence's first chunk).
    let b = a.max_batch.min(8);
    for t in &tables[..b] {
        model.prefill(&[SeqView {
            blocks: t,
            new_tokens: a.chunk as u32,
            context: a.chunk as u32,
        }])?;
    }
    let seqs: Vec<SeqView> = tables[..b]
        .iter()
        .enumerate()
        .map(|(i, t)| SeqView {
            blocks: t,
            new_tokens: 1,
            // Different lengths inside what the prefill wrote, each decode writing its
            // token's K and V at its last position (the same bytes for both paths).
            context: (a.chunk - i * a.chunk / (2 * b)) as u32,
        })
        .collect();
    // Through one layer the two paths differ by the op's own rounding (bf16): a wrong call of
    // the op (lengths, tables, heads) shows there. Through more layers of random weights the
    // difference grows on its own; it is printed, not judged.
    let layers = model.layers();
    let mut depth = 1;
    loop {
        let (diff, top) = model.decode_check(&seqs, depth)?;
        println!(
            "kernel vs gather through {depth:>2} of {layers} layers: decode logits of {b} sequences differ by at most {diff:.4} (largest logit {top:.3}, {:.2}%)",
            100.0 * diff / top.max(1e-30)
        );
        if depth == 1 && (diff.is_nan() || diff > 0.03 * top.max(1.0)) {
            return Err(format!(
                "through one layer the kernel's decode logits differ from attention by gather by {diff} (largest logit {top}): beyond bf16 rounding"
            ));
        }
        if depth == layers {
            break;
        }
        depth = (depth * 2).min(layers);
    }
    // The prefill kernel against the gather: the second half of two sequences' first chunk
    // (what the prefill above wrote: no context read is stale), ending at different places,
    // in one forward, through one layer (judged) and through all (printed).
    let half = (a.chunk / 2).max(1);
    let mut pieces = vec![SeqView {
        blocks: tables[0],
        new_tokens: half as u32,
        context: a.chunk as u32,
    }];
    if let Some(t) = tables.get(1) {
        pieces.push(SeqView {
            blocks: t,
            new_tokens: half.saturating_sub(3).max(1) as u32,
            context: a.chunk.saturating_sub(3).max(half) as u32,
        });
    }
    for depth in [1, layers] {
        let (diff, top) = model.prefill_check(&pieces, depth)?;
        println!(
            "prefill kernel vs gather through {depth:>2} of {layers} layers: logits of {} pieces of about {half} tokens differ by at most {diff:.4} (largest logit {top:.3}, {:.2}%)",
            pieces.len(),
            100.0 * diff / top.max(1e-30)
        );
        if depth == 1 && (diff.is_nan() || diff > 0.03 * top.max(1.0)) {
            return Err(format!(
                "through one layer the prefill kernel's logits differ from attention by gather by {diff} (largest logit {top}): beyond bf16 rounding"
            ));
        }
    }
    let mut contexts = vec![a.max_context / 2, 512usize, 1024, 2048, 4096, a.max_context];
    contexts.retain(|&c| c <= a.max_context);
    contexts.sort_unstable();
    contexts.dedup();
    let mut batches = vec![1usize, 8, 32, 64];
    batches.retain(|&x| x < a.max_batch);
    batches.push(a.max_batch);
    let (mut rows, mut ys) = (Vec::new(), Vec::new());
    for &c in &contexts {
        for &n in &batches {
            let seqs: Vec<SeqView> = tables[..n]
                .iter()
                .map(|t| SeqView {
                    blocks: t,
                    new_tokens: 1,
                    context: c as u32,
                })
                .collect();
            let t = median(|| model.decode(&seqs))?;
            println!(
                "decode: batch {n:>3}, context {c:>5}: {:>7.2} ms ({:>6.0} tokens/s)",
                t * 1e3,
                n as f64 / t
            );
            rows.push(vec![1.0, n as f64, (n * c) as f64]);
            ys.push(t);
        }
    }
    let d = least_squares(&rows, &ys)?;
    let worst = rows
        .iter()
        .zip(&ys)
        .map(|(r, y)| ((d[0] + d[1] * r[1] + d[2] * r[2]) / y - 1.0).abs())
        .fold(0.0, f64::max);
    println!(
        "decode fit: {:.3} ms per step + {:.4} ms per sequence + {:.2} ns per context token read (worst point off by {:.0}%)",
        d[0] * 1e3,
        d[1] * 1e3,
        d[2] * 1e9,
        worst * 100.0
    );
    let mut per_token = Vec::new();
    let mut offsets: Vec<usize> = [0, 512, 1024, 2048, a.max_context - a.chunk]
        .into_iter()
        .filter(|&o| o + a.chunk <= a.max_context)
        .collect();
    offsets.sort_unstable();
    offsets.dedup();
    for start in offsets {
        let seq = [SeqView {
            blocks: tables[0],
            new_tokens: a.chunk as u32,
            context: (start + a.chunk) as u32,
        }];
        let t = median(|| model.prefill(&seq))?;
        println!(
            "prefill ({}): {} tokens at {start}..{}: {:.2} ms ({:.0} tokens/s)",
            if a.prefill_by_gather {
                "gather"
            } else {
                "kernel"
            },
            a.chunk,
            start + a.chunk,
            t * 1e3,
            a.chunk as f64 / t
        );
        per_token.push(t / a.chunk as f64);
    }
    // Prompts of the traces run to a few thousand tokens: the mean over the chunks probed.
    let prefill = per_token.iter().sum::<f64>() / per_token.len().max(1) as f64;
    println!(
        "prefill: {:.4} ms per token on average over the offsets probed ({:.0} tokens/s)",
        prefill * 1e3,
        1.0 / prefill
    );
    println!(
        "cost-ms: {:.4},{:.5},{:.5},{:.3e}",
        d[0].max(0.0) * 1e3,
        d[1].max(0.0) * 1e3,
        prefill * 1e3,
        d[2].max(0.0) * 1e3
    );
    Ok(())
}
