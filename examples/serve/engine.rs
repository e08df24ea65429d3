//! One model's continuous-batching engine, as vLLM's (v0) scheduler works: a FCFS request queue;
//! each step is either a prefill of newly admitted requests or one decode step over the running
//! batch. A request is admitted only when the KV blocks for its whole context can be had now;
//! when a decode step needs a block that cannot be had, the most recently admitted running
//! request is preempted: its blocks are freed and it goes back to the head of the queue, to be
//! recomputed (prefilled again over its prompt and the tokens it had generated).
//!
//! The engine knows its KV cache only through [`KvBlocks`] and its model only through
//! [`StepModel`], so the same scheduler runs over a simulated model and counter (host tests), a
//! pool-backed KV cache on the host backend, and a real candle model on the GPU.

use std::collections::VecDeque;

use serde::{Deserialize, Serialize};

use crate::trace::Request;

/// A model's KV cache as the scheduler sees it: blocks of `block_tokens()` tokens.
pub trait KvBlocks {
    /// Tokens per block.
    fn block_tokens(&self) -> u32;
    /// Blocks that can be had now (an estimate the allocation itself confirms).
    fn available(&mut self) -> usize;
    /// The most blocks this model could ever hold (a request needing more is refused).
    fn capacity(&self) -> usize;
    /// `n` blocks, all or nothing: `None` when they cannot be had (nothing is held then).
    fn alloc(&mut self, n: usize) -> Option<Vec<u32>>;
    /// Give blocks back.
    fn free(&mut self, ids: &[u32]);
    /// Blocks held now.
    fn used(&self) -> usize;
}

/// One sequence of a step: its KV blocks and how many tokens of context it has after the step.
pub struct SeqView<'a> {
    /// Its KV blocks.
    pub blocks: &'a [u32],
    /// Tokens this step computes (the prompt and recomputed tokens for a prefill, 1 for decode).
    pub new_tokens: u32,
    /// Context length after the step.
    pub context: u32,
}

/// A model's compute: runs a step and says how long it took (seconds; measured on a real model,
/// modelled by a simulated one). An error is an out-of-memory or device failure: counted, and
/// the run reports it.
pub trait StepModel {
    /// Prefill `seqs` (one forward over their new tokens).
    fn prefill(&mut self, seqs: &[SeqView]) -> Result<f64, String>;
    /// One decode step over `seqs`.
    fn decode(&mut self, seqs: &[SeqView]) -> Result<f64, String>;
}

/// Engine limits.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct EngineConfig {
    /// Most sequences in the running batch.
    pub max_batch: usize,
    /// Most prompt tokens in one prefill step (a single longer prompt still goes alone).
    pub max_prefill_tokens: u32,
    /// Longest context (prompt and output) the model was sized for (its warm-up ran a step of
    /// this context): a longer request is refused. 0: no limit.
    pub max_context: u32,
}

/// A request's fate, for the metrics.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Finished {
    /// The request.
    pub req: Request,
    /// Time of its first token (seconds).
    pub first_token: f64,
    /// Time of its last token.
    pub done: f64,
    /// Times it was preempted.
    pub preemptions: u32,
}

struct Seq {
    req: Request,
    blocks: Vec<u32>,
    /// Tokens generated so far (kept across a preemption: recomputed, not regenerated).
    generated: u32,
    first_token: Option<f64>,
    preemptions: u32,
}

impl Seq {
    fn context(&self) -> u32 {
        self.req.prompt + self.generated
    }
}

/// Counters of one engine.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct EngineCounters {
    /// Prefill steps run.
    pub prefills: u64,
    /// Decode steps run.
    pub decodes: u64,
    /// Preemptions (free and recompute).
    pub preemptions: u64,
    /// Requests refused: they need more KV than the model could ever hold.
    pub refused: u64,
    /// Steps that failed (out of memory or a device error): must stay 0.
    pub oom: u64,
    /// Tokens generated (recomputed ones not counted again).
    pub tokens: u64,
    /// Sequences over all decode steps (their mean batch is this over `decodes`).
    pub decode_seqs: u64,
}

/// One model's engine.
pub struct Engine<K: KvBlocks, M: StepModel> {
    /// Its KV cache.
    pub kv: K,
    /// Its model.
    pub model: M,
    config: EngineConfig,
    waiting: VecDeque<Seq>,
    running: Vec<Seq>,
    /// Finished requests, drained by the caller.
    pub finished: Vec<Finished>,
    /// Requests refused (drained by the caller).
    pub refused: Vec<Request>,
    /// Counters.
    pub counters: EngineCounters,
    /// The last error a step returned.
    pub last_error: Option<String>,
    /// Where token times come from: `None`, the virtual clock (a step's tokens come at `now`
    /// plus what the model says the step took); `Some`, a wall clock read when the step's
    /// compute returns (allocation, mapping and any wait inside the step included).
    pub clock: Option<Box<dyn Fn() -> f64 + Send>>,
}

/// A request still queued or running when a run ends.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Unfinished {
    /// The request.
    pub req: Request,
    /// Time of its first token, if it had one.
    pub first_token: Option<f64>,
    /// Tokens generated.
    pub generated: u32,
    /// Times it was preempted.
    pub preemptions: u32,
}

fn blocks_for(tokens: u32, block_tokens: u32) -> usize {
    tokens.div_ceil(block_tokens.max(1)) as usize
}

/// The scheduler's own invariant, checked before every step: each sequence holds the blocks
/// for its context.
fn covered(views: &[SeqView], block_tokens: u32) -> Result<(), String> {
    match views
        .iter()
        .find(|v| blocks_for(v.context, block_tokens) > v.blocks.len())
    {
        None => Ok(()),
        Some(v) => Err(format!(
            "scheduler bug: a context of {} tokens over {} blocks of {block_tokens}",
            v.context,
            v.blocks.len()
        )),
    }
}

impl<K: KvBlocks, M: StepModel> Engine<K, M> {
    /// An idle engine.
    pub fn new(kv: K, model: M, config: EngineConfig) -> Self {
        Engine {
            kv,
            model,
            config,
            waiting: VecDeque::new(),
            running: Vec::new(),
            finished: Vec::new(),
            refused: Vec::new(),
            counters: EngineCounters::default(),
            last_error: None,
            clock: None,
        }
    }

    /// Queue a request.
    pub fn submit(&mut self, req: Request) {
        // Its whole context (prompt and output) must fit the model's largest possible share
        // and the context the model was sized for.
        let context = req.prompt + req.output;
        let too_long = self.config.max_context > 0 && context > self.config.max_context;
        if too_long || blocks_for(context, self.kv.block_tokens()) > self.kv.capacity() {
            self.counters.refused += 1;
            self.refused.push(req);
            return;
        }
        self.waiting.push_back(Seq {
            req,
            blocks: Vec::new(),
            generated: 0,
            first_token: None,
            preemptions: 0,
        });
    }

    /// Whether it has anything to do.
    pub fn has_work(&self) -> bool {
        !self.waiting.is_empty() || !self.running.is_empty()
    }

    /// Blocks the request at the head of the queue needs to be admitted (`None` when nothing
    /// waits or the batch is full: not waiting for memory).
    pub fn head_need(&self) -> Option<usize> {
        let head = self.waiting.front()?;
        (self.running.len() < self.config.max_batch)
            .then(|| blocks_for(head.context() + 1, self.kv.block_tokens()))
    }

    /// Requests queued, running.
    pub fn load(&self) -> (usize, usize) {
        (self.waiting.len(), self.running.len())
    }

    /// Preempt the most recently admitted running request (free its blocks, requeue it at the
    /// head). Returns whether there was one. Also used by a caller that needs this model's
    /// memory for another model (waking it).
    pub fn preempt_one(&mut self) -> bool {
        let Some(mut s) = self.running.pop() else {
            return false;
        };
        self.kv.free(&s.blocks);
        s.blocks.clear();
        s.preemptions += 1;
        self.counters.preemptions += 1;
        self.waiting.push_front(s);
        true
    }

    /// Admit what fits from the head of the queue: the requests to prefill.
    fn admit(&mut self) -> Vec<Seq> {
        let mut admitted: Vec<Seq> = Vec::new();
        let mut tokens = 0u32;
        while let Some(head) = self.waiting.front() {
            if self.running.len() + admitted.len() >= self.config.max_batch {
                break;
            }
            let ctx = head.context();
            if !admitted.is_empty() && tokens + ctx > self.config.max_prefill_tokens {
                break;
            }
            // Blocks for its context and the next token.
            let need = blocks_for(ctx + 1, self.kv.block_tokens());
            if self.kv.available() < need {
                break;
            }
            let Some(blocks) = self.kv.alloc(need) else {
                break;
            };
            let Some(mut s) = self.waiting.pop_front() else {
                break;
            };
            s.blocks = blocks;
            tokens += ctx;
            admitted.push(s);
        }
        admitted
    }

    /// Run one step at time `now`; returns its duration (0 when there was nothing to run).
    /// A failed step (an error from the model) counts as OOM and its sequences are preempted
    /// (their blocks freed; they retry later).
    pub fn step(&mut self, now: f64) -> f64 {
        let mut prefill = self.admit();
        if !prefill.is_empty() {
            let views: Vec<SeqView> = prefill
                .iter()
                .map(|s| SeqView {
                    blocks: &s.blocks,
                    new_tokens: s.context(),
                    context: s.context(),
                })
                .collect();
            let bt = self.kv.block_tokens();
            let r = covered(&views, bt).and_then(|()| self.model.prefill(&views));
            drop(views);
            self.counters.prefills += 1;
            let dt = match r {
                Ok(dt) => dt,
                Err(e) => {
                    self.fail(e, prefill);
                    return 0.0;
                }
            };
            let t = self.stamp(now, dt);
            for mut s in prefill.drain(..) {
                if s.first_token.is_none() {
                    s.first_token = Some(t);
                    s.generated = 1;
                    self.counters.tokens += 1;
                }
                self.running.push(s);
            }
            self.retire(t);
            return dt;
        }
        if self.running.is_empty() {
            return 0.0;
        }
        // Every running sequence needs room for its next token; preempt the newest until so.
        let bt = self.kv.block_tokens();
        let mut i = 0;
        while i < self.running.len() {
            let s = &self.running[i];
            if blocks_for(s.context() + 1, bt) <= s.blocks.len() {
                i += 1;
                continue;
            }
            if let Some(b) = self.kv.alloc(1) {
                self.running[i].blocks.extend(b);
                i += 1;
            } else {
                // The victim may be this very sequence (it is then the newest).
                self.preempt_one();
            }
        }
        if self.running.is_empty() {
            return 0.0;
        }
        let views: Vec<SeqView> = self
            .running
            .iter()
            .map(|s| SeqView {
                blocks: &s.blocks,
                new_tokens: 1,
                context: s.context() + 1,
            })
            .collect();
        let r = covered(&views, bt).and_then(|()| self.model.decode(&views));
        drop(views);
        self.counters.decodes += 1;
        let dt = match r {
            Ok(dt) => dt,
            Err(e) => {
                let batch = std::mem::take(&mut self.running);
                self.fail(e, batch);
                return 0.0;
            }
        };
        for s in &mut self.running {
            s.generated += 1;
        }
        self.counters.tokens += self.running.len() as u64;
        self.counters.decode_seqs += self.running.len() as u64;
        let t = self.stamp(now, dt);
        self.retire(t);
        dt
    }

    /// When a step that started at `now` and computed for `dt` seconds produced its tokens.
    fn stamp(&self, now: f64, dt: f64) -> f64 {
        self.clock.as_ref().map_or(now + dt, |c| c())
    }

    fn fail(&mut self, e: String, seqs: Vec<Seq>) {
        self.counters.oom += 1;
        self.last_error = Some(e);
        for mut s in seqs.into_iter().rev() {
            self.kv.free(&s.blocks);
            s.blocks.clear();
            self.waiting.push_front(s);
        }
    }

    /// Finished sequences leave the batch and give their blocks back.
    fn retire(&mut self, t: f64) {
        let mut i = 0;
        while i < self.running.len() {
            if self.running[i].generated >= self.running[i].req.output {
                let s = self.running.remove(i);
                self.kv.free(&s.blocks);
                self.finished.push(Finished {
                    req: s.req,
                    first_token: s.first_token.unwrap_or(t),
                    done: t,
                    preemptions: s.preemptions,
                });
            } else {
                i += 1;
            }
        }
    }

    /// Requests still queued or running (unfinished at the end of a run), taken out with what
    /// they got; their blocks freed.
    pub fn take_unfinished(&mut self) -> Vec<Unfinished> {
        let mut out = Vec::new();
        let running = std::mem::take(&mut self.running);
        let waiting = std::mem::take(&mut self.waiting);
        for s in running.into_iter().chain(waiting) {
            self.kv.free(&s.blocks);
            out.push(Unfinished {
                req: s.req,
                first_token: s.first_token,
                generated: s.generated,
                preemptions: s.preemptions,
            });
        }
        out
    }

    /// Requests still queued or running (unfinished at the end of a run), dropped; their blocks
    /// freed.
    pub fn abandon(&mut self) -> usize {
        let n = self.waiting.len() + self.running.len();
        for s in self.running.drain(..) {
            self.kv.free(&s.blocks);
        }
        self.waiting.clear();
        n
    }
}

/// A simulated model: a step costs a fixed overhead, time per token computed, and time per
/// token of context read (the roofline of a memory-bound decode).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct SimCost {
    /// Seconds per step.
    pub step_s: f64,
    /// Seconds per prefill token.
    pub prefill_token_s: f64,
    /// Seconds per decoded sequence.
    pub decode_seq_s: f64,
    /// Seconds per token of context read in a decode step.
    pub context_token_s: f64,
}

impl SimCost {
    /// Roughly a small Llama on an H100: 5 ms per step, 20 µs per prefill token, 50 µs per
    /// decoded sequence, 10 ns per context token.
    pub fn small() -> Self {
        SimCost {
            step_s: 5e-3,
            prefill_token_s: 20e-6,
            decode_seq_s: 50e-6,
            context_token_s: 10e-9,
        }
    }
}

impl SimCost {
    /// Compute cheap against memory (the deployment benchmark on the host, where the KV
    /// budget is small): 2 ms per step, 2 µs per prefill token, 20 µs per decoded sequence,
    /// 1 ns per context token. A model's share of the KV budget fills before its steps
    /// take all its time.
    pub fn memory_bound() -> Self {
        SimCost {
            step_s: 2e-3,
            prefill_token_s: 2e-6,
            decode_seq_s: 20e-6,
            context_token_s: 1e-9,
        }
    }
}

impl StepModel for SimCost {
    fn prefill(&mut self, seqs: &[SeqView]) -> Result<f64, String> {
        let tokens: u64 = seqs.iter().map(|s| s.new_tokens as u64).sum();
        Ok(self.step_s + tokens as f64 * self.prefill_token_s)
    }
    fn decode(&mut self, seqs: &[SeqView]) -> Result<f64, String> {
        let ctx: u64 = seqs.iter().map(|s| s.context as u64).sum();
        Ok(self.step_s + seqs.len() as f64 * self.decode_seq_s + ctx as f64 * self.context_token_s)
    }
}
