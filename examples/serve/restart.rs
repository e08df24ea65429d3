//! `serve restart --gpu 8b`: an engine process that restarts without reloading its weights
//! (issue 35). Everything runs on the GPU as processes, under a broker in this process:
//! 1. `save`: the serving benchmark's model with random bf16 weights, written to a safetensors
//!    file (then warm in the page cache);
//! 2. `candle`: an engine as candle engines start today: the weights loaded by candle's loader
//!    (`VarBuilder::from_mmaped_safetensors`), a prompt prefilled, decode steps;
//! 3. `lease`: an engine that loads the same file into a region of a broker model under a
//!    lease (kept, with a manifest of tensor names, shapes and offsets as the lease's blob),
//!    decodes the same steps, then keeps decoding until it is killed (SIGKILL, mid-decode);
//! 4. `attach` (twice, the second after killing the first): a new engine process takes the
//!    lease over with its token, makes candle tensors over the kept weights with no copy
//!    (`TensorPool::view`), and decodes the same steps.
//!
//! Each engine prints the time from its process's start to its first token (the prompt's
//! prefill, logits on the host) and the logits of the last decode step; the driver prints the
//! ratios and whether every engine's last logits are bit for bit the never-crashed engine's.
//! The KV cache is not kept: an attached engine prefills the prompt again.

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdout, Command, Stdio};
use std::time::{Duration, Instant};

use candle_core::{DType, Device, Shape, Tensor};
use candle_nn::var_builder::SimpleBackend;
use candle_nn::{Init, VarBuilder};
use elastic_vmm::broker::{Broker, BrokerClient, BrokerConfig, LeaseToken, RemoteModel};
use elastic_vmm::candle::{BlockShape, PagedKvTensors, TensorPool};
use elastic_vmm::{MemOptions, ModelConfig, Pool, Region, Tag};
use serde::{Deserialize, Serialize};

use crate::llama::{RandomWeights, Size, DTYPE};
use crate::paged_llama::{PagedLlama, Piece, BLOCK_TOKENS};

/// The variable naming this process's restart role.
const ROLE_VAR: &str = "SERVE_RESTART_ROLE";
/// Prompt tokens prefilled, then decode steps.
const PROMPT: usize = 512;
const STEPS: usize = 8;
/// Weights lie at offsets aligned to this in the kept region.
const ALIGN: u64 = 256;

/// One tensor of the kept weights: the lease's blob lists them.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct Entry {
    name: String,
    shape: Vec<usize>,
    offset: u64,
}

/// Run a restart role if this process has one.
pub fn run_role() -> Option<Result<(), String>> {
    let role = std::env::var(ROLE_VAR).ok()?;
    let var = |k: &str| std::env::var(k).map_err(|_| format!("{k} not set"));
    Some((|| {
        let size = Size::parse(&var("SERVE_SIZE")?)?;
        let file = PathBuf::from(var("SERVE_WEIGHTS")?);
        match role.as_str() {
            "save" => save(size, &file),
            "candle" | "lease" | "attach" => engine(size, &role, &file),
            other => Err(format!("unknown restart role {other:?}")),
        }
    })())
}

fn ce(e: candle_core::Error) -> String {
    e.to_string()
}

fn ee(e: elastic_vmm::Error) -> String {
    e.to_string()
}

fn say(line: &str) {
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{line}");
    let _ = out.flush();
}

/// Random weights of `size`'s model into `file`.
fn save(size: Size, file: &Path) -> Result<(), String> {
    let device = Device::new_cuda(0).map_err(ce)?;
    let scratch = Pool::cuda(0, 8 << 30).map_err(ee)?;
    let recorder = Recorder {
        inner: RandomWeights { scratch },
        seen: Default::default(),
    };
    let seen = recorder.seen.clone();
    let vb = VarBuilder::from_backend(Box::new(recorder), DTYPE, device.clone());
    drop(PagedLlama::load(size.config(), vb).map_err(ce)?);
    let tensors: HashMap<String, Tensor> =
        std::mem::take(&mut *seen.lock().map_err(|_| "the weights' recorder panicked")?)
            .into_iter()
            .map(|(k, t)| Ok((k, t.to_device(&Device::Cpu).map_err(ce)?)))
            .collect::<Result<_, String>>()?;
    candle_core::safetensors::save(&tensors, file).map_err(ce)?;
    say(&format!("saved {}", tensors.len()));
    Ok(())
}

/// Records the tensors another backend makes, by name.
struct Recorder {
    inner: RandomWeights,
    seen: std::sync::Arc<std::sync::Mutex<HashMap<String, Tensor>>>,
}

impl SimpleBackend for Recorder {
    fn get(
        &self,
        s: Shape,
        name: &str,
        h: Init,
        dtype: DType,
        dev: &Device,
    ) -> candle_core::Result<Tensor> {
        let t = self.inner.get(s, name, h, dtype, dev)?;
        if let Ok(mut seen) = self.seen.lock() {
            seen.insert(name.to_string(), t.clone());
        }
        Ok(t)
    }

    fn get_unchecked(&self, name: &str, dtype: DType, dev: &Device) -> candle_core::Result<Tensor> {
        self.inner.get_unchecked(name, dtype, dev)
    }

    fn contains_tensor(&self, name: &str) -> bool {
        self.inner.contains_tensor(name)
    }
}

/// Tensors by name (views of the kept weights), for a `VarBuilder`.
struct Named(HashMap<String, Tensor>);

impl SimpleBackend for Named {
    fn get(
        &self,
        s: Shape,
        name: &str,
        _: Init,
        dtype: DType,
        _: &Device,
    ) -> candle_core::Result<Tensor> {
        let t = self.get_unchecked(name, dtype, &Device::Cpu)?;
        if t.shape() != &s {
            candle_core::bail!("{name}: kept as {:?}, asked as {s:?}", t.shape());
        }
        Ok(t)
    }

    fn get_unchecked(&self, name: &str, dtype: DType, _: &Device) -> candle_core::Result<Tensor> {
        match self.0.get(name) {
            Some(t) if t.dtype() == dtype => Ok(t.clone()),
            Some(t) => candle_core::bail!("{name}: kept as {:?}, asked as {dtype:?}", t.dtype()),
            None => candle_core::bail!("{name}: not among the kept weights"),
        }
    }

    fn contains_tensor(&self, name: &str) -> bool {
        self.0.contains_key(name)
    }
}

/// The broker model's config: room for the weights twice over.
fn model_config(size: Size) -> ModelConfig {
    let w = size.weight_bytes();
    ModelConfig::new("restart-llama", (4 * w) as usize, 2 * w)
}

/// The file's tensors laid out back to back (aligned): the manifest and the region's length.
fn layout(st: &candle_core::safetensors::MmapedSafetensors) -> Result<(Vec<Entry>, u64), String> {
    let mut names: Vec<(String, Vec<usize>, usize)> = st
        .tensors()
        .into_iter()
        .map(|(n, v)| (n, v.shape().to_vec(), v.data().len()))
        .collect();
    names.sort();
    let mut at = 0u64;
    let mut out = Vec::with_capacity(names.len());
    for (name, shape, bytes) in names {
        out.push(Entry {
            name,
            shape,
            offset: at,
        });
        at = (at + bytes as u64).div_ceil(ALIGN) * ALIGN;
    }
    Ok((out, at))
}

/// An engine: its weights by `role` (candle's loader; loaded into a leased region; attached),
/// a prompt prefilled and decode steps; says `first <ms>` and `logits <..>`.
fn engine(size: Size, role: &str, file: &Path) -> Result<(), String> {
    let born = Instant::now();
    // Where the time to the first token goes: each phase's end, in ms from the process's start.
    let mut phases: Vec<(&str, f64)> = Vec::new();
    let mut mark = |what: &'static str| phases.push((what, born.elapsed().as_secs_f64() * 1e3));
    let device = Device::new_cuda(0).map_err(ce)?;
    mark("cuda");
    let socket = std::env::var("SERVE_SOCKET").map_err(|_| "SERVE_SOCKET not set")?;
    let client = BrokerClient::connect(&socket, role).map_err(ee)?;
    mark("connect");
    // Kept alive for the tensors that view them; dropped in this order (views collected
    // before the region goes).
    let mut held: Option<(TensorPool, Region, RemoteModel)> = None;
    let vb = match role {
        "candle" => {
            // SAFETY: the file is this run's own, not changed while mapped.
            unsafe { VarBuilder::from_mmaped_safetensors(&[file], DTYPE, &device) }.map_err(ce)?
        }
        _ => {
            let (model, region, manifest, token) = if role == "lease" {
                lease_and_load(size, &client, file)?
            } else {
                let token: LeaseToken = std::env::var("SERVE_TOKEN")
                    .map_err(|_| "SERVE_TOKEN not set")?
                    .parse()
                    .map_err(ee)?;
                let mut back = client.attach(model_config(size), &token).map_err(ee)?;
                let manifest: Vec<Entry> =
                    serde_json::from_slice(&back.blob).map_err(|e| e.to_string())?;
                let region = back.regions.pop().ok_or("no region came back")?;
                (back.model, region, manifest, back.lease.token)
            };
            mark(if role == "lease" { "load" } else { "attach" });
            let tensors = TensorPool::new(model.pool(), &device).map_err(ee)?;
            let mut map = HashMap::with_capacity(manifest.len());
            for e in &manifest {
                let t = tensors
                    .view(&region, e.offset, e.shape.clone(), DTYPE)
                    .map_err(ee)?;
                map.insert(e.name.clone(), t);
            }
            say(&format!("token {token}"));
            held = Some((tensors, region, model));
            VarBuilder::from_backend(Box::new(Named(map)), DTYPE, device.clone())
        }
    };
    let llama = PagedLlama::load(size.config(), vb).map_err(ce)?;
    mark("model");
    // The KV cache: a pool of this process's own (not kept).
    let kv_pool = Pool::cuda(0, 4 << 30).map_err(ee)?;
    let kv_tensors = TensorPool::new(&kv_pool, &device).map_err(ee)?;
    let blocks = (PROMPT + STEPS).div_ceil(BLOCK_TOKENS) + 1;
    let kv = PagedKvTensors::with_shape(
        &kv_tensors,
        size.kv_config(blocks),
        DTYPE,
        BlockShape::TokenMajor,
    )
    .map_err(ee)?;
    let ids: Vec<u32> = kv
        .alloc(blocks)
        .map_err(ee)?
        .into_iter()
        .map(|b| b as u32)
        .collect();
    mark("kv");
    let first = llama
        .prefill_chunked(
            &kv,
            &[Piece {
                blocks: &ids,
                start: 0,
                len: PROMPT,
            }],
            PROMPT,
        )
        .map_err(ce)?;
    let last = first.last().ok_or("no prefill logits")?;
    let _: Vec<f32> = last
        .to_dtype(DType::F32)
        .and_then(|t| t.flatten_all())
        .and_then(|t| t.to_vec1())
        .map_err(ce)?;
    mark("prefill");
    let mut last_at = 0.0;
    let parts: Vec<String> = phases
        .iter()
        .map(|(what, at)| {
            let part = format!("{what} {:.1}", at - last_at);
            last_at = *at;
            part
        })
        .collect();
    say(&format!("phases {}", parts.join(", ")));
    say(&format!("first {:.1}", born.elapsed().as_secs_f64() * 1e3));
    let step = |at: usize| -> Result<Vec<f32>, String> {
        llama
            .forward(
                &kv,
                &[Piece {
                    blocks: &ids,
                    start: at,
                    len: 1,
                }],
            )
            .and_then(|t| t.to_dtype(DType::F32))
            .and_then(|t| t.flatten_all())
            .and_then(|t| t.to_vec1())
            .map_err(ce)
    };
    let mut logits = Vec::new();
    for at in PROMPT..PROMPT + STEPS {
        logits = step(at)?;
    }
    let bits: u64 = logits.iter().fold(0xcbf29ce484222325u64, |h, x| {
        (h ^ x.to_bits() as u64).wrapping_mul(0x100000001b3)
    });
    say(&format!(
        "logits {bits:016x} {:?}",
        &logits[..4.min(logits.len())]
    ));
    if role == "lease" {
        // Mid-decode until the driver kills this process.
        let mut at = PROMPT;
        loop {
            step(at)?;
            at = PROMPT + (at + 1 - PROMPT) % STEPS;
        }
    }
    drop(llama);
    drop(held);
    Ok(())
}

/// Register the model, lease it, load `file` into a region of it (kept, its manifest the
/// blob).
fn lease_and_load(
    size: Size,
    client: &BrokerClient,
    file: &Path,
) -> Result<(RemoteModel, Region, Vec<Entry>, LeaseToken), String> {
    let model = client.register(model_config(size)).map_err(ee)?;
    let lease = model.lease().map_err(ee)?;
    // SAFETY: as for candle's loader.
    let st = unsafe { candle_core::safetensors::MmapedSafetensors::new(file) }.map_err(ce)?;
    let (manifest, len) = layout(&st)?;
    let region = model
        .reserve_region_with(len, &MemOptions::new().tag(Tag::Weights).chunk(64 << 20))
        .map_err(ee)?;
    region.map(0, region.len()).map_err(ee)?;
    for e in &manifest {
        let view = st.get(&e.name).map_err(ce)?;
        // SAFETY: the region is mapped whole, by this process, and nothing reads it yet.
        unsafe {
            model
                .backend()
                .copies()
                .write(region.addr() + e.offset, view.data())
                .map_err(ee)?
        };
    }
    model.keep(&region).map_err(ee)?;
    let blob = serde_json::to_vec(&manifest).map_err(|e| e.to_string())?;
    model.store_blob(&blob).map_err(ee)?;
    Ok((model, region, manifest, lease.token))
}

/// A child in a restart role, its lines read as they come.
struct Engine {
    child: Child,
    out: BufReader<ChildStdout>,
    started: Instant,
}

impl Engine {
    fn spawn(role: &str, vars: &[(&str, String)]) -> Result<Engine, String> {
        let exe = std::env::current_exe().map_err(|e| e.to_string())?;
        let mut cmd = Command::new(exe);
        cmd.env(ROLE_VAR, role)
            .stdin(Stdio::null())
            .stdout(Stdio::piped());
        for (k, v) in vars {
            cmd.env(k, v);
        }
        let started = Instant::now();
        let mut child = cmd.spawn().map_err(|e| format!("spawning {role}: {e}"))?;
        let out = BufReader::new(child.stdout.take().ok_or("no stdout")?);
        Ok(Engine {
            child,
            out,
            started,
        })
    }

    /// Its next line starting with `word`, the rest of it (other lines skipped).
    fn line(&mut self, word: &str) -> Result<String, String> {
        let mut l = String::new();
        loop {
            l.clear();
            if self.out.read_line(&mut l).map_err(|e| e.to_string())? == 0 {
                let st = self.child.wait().map_err(|e| e.to_string())?;
                return Err(format!("the engine ended ({st}) before saying {word:?}"));
            }
            if let Some(rest) = l.trim().strip_prefix(word) {
                return Ok(rest.trim().to_string());
            }
        }
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// What one engine measured: seconds from spawn to its first token (driver's clock), ms the
/// engine counted from its own start, and its last logits.
struct Measured {
    spawn_to_first: f64,
    own_ms: f64,
    /// Each phase's ms in the process, in order (`cuda 210.3, connect 0.4, ...`).
    phases: String,
    logits: String,
}

fn measure(e: &mut Engine) -> Result<Measured, String> {
    let phases = e.line("phases")?;
    let own_ms: f64 = e
        .line("first")?
        .parse()
        .map_err(|x| format!("first: {x}"))?;
    let spawn_to_first = e.started.elapsed().as_secs_f64();
    let logits = e.line("logits")?;
    Ok(Measured {
        spawn_to_first,
        own_ms,
        phases,
        logits,
    })
}

/// The driver: `serve restart --gpu 8b|small [--weights FILE]`.
pub fn run(args: &[String]) -> Result<(), String> {
    let mut size = Size::Llama8B;
    let mut file: Option<PathBuf> = None;
    let mut it = args.iter();
    while let Some(flag) = it.next() {
        let v = it.next().ok_or_else(|| format!("{flag} needs a value"))?;
        match flag.as_str() {
            "--gpu" => size = Size::parse(v)?,
            "--weights" => file = Some(PathBuf::from(v)),
            _ => return Err(format!("unknown flag {flag}: --gpu SIZE, --weights FILE")),
        }
    }
    let dir = std::env::temp_dir().join(format!("serve-restart-{}", std::process::id()));
    std::fs::create_dir_all(&dir).map_err(|e| e.to_string())?;
    std::fs::set_permissions(&dir, std::os::unix::fs::PermissionsExt::from_mode(0o700))
        .map_err(|e| e.to_string())?;
    let file = file.unwrap_or_else(|| dir.join("weights.safetensors"));
    let socket = dir.join("broker.sock");
    let broker = Broker::cuda(
        0,
        BrokerConfig::new(&socket, u64::MAX).lease_grace(Duration::from_secs(120)),
    )
    .map_err(ee)?;
    let vars = |extra: &[(&'static str, String)]| {
        let mut v = vec![
            ("SERVE_SIZE", size.name().to_string()),
            ("SERVE_WEIGHTS", file.display().to_string()),
            ("SERVE_SOCKET", socket.display().to_string()),
        ];
        v.extend(extra.iter().cloned());
        v
    };
    if !file.exists() {
        let t = Instant::now();
        let mut s = Engine::spawn("save", &vars(&[]))?;
        let n = s.line("saved")?;
        let _ = s.child.wait();
        println!(
            "restart: {} tensors of random weights saved to {} in {:.1} s ({:.2} GiB)",
            n,
            file.display(),
            t.elapsed().as_secs_f64(),
            std::fs::metadata(&file).map_or(0, |m| m.len()) as f64 / (1u64 << 30) as f64
        );
    }
    let report = |what: &str, m: &Measured| {
        println!(
            "restart: {what:<34} first token {:>7.3} s after spawn ({:>8.1} ms in the process); last logits {}",
            m.spawn_to_first, m.own_ms, m.logits
        );
        println!("restart:   where the process's time went, ms: {}", m.phases);
    };
    // Candle's own loader, as engines start today (twice: the second with the file warm).
    let mut candle = Vec::new();
    for _ in 0..2 {
        let mut e = Engine::spawn("candle", &vars(&[]))?;
        let m = measure(&mut e)?;
        report("candle's loader (page cache)", &m);
        candle.push(m);
    }
    let mut e = Engine::spawn("lease", &vars(&[]))?;
    let mut token = e.line("token")?;
    let leased = measure(&mut e)?;
    report("loaded into a leased region", &leased);
    let mut attached = Vec::new();
    for round in 0..2 {
        // Killed mid-decode.
        e.child.kill().map_err(|x| x.to_string())?;
        let _ = e.child.wait();
        let held = wait_held(&broker)?;
        println!(
            "restart: engine killed mid-decode; the broker holds {:.2} GiB under the lease",
            held as f64 / (1u64 << 30) as f64
        );
        e = Engine::spawn("attach", &vars(&[("SERVE_TOKEN", token.clone())]))?;
        token = e.line("token")?;
        let m = measure(&mut e)?;
        report(&format!("re-attached ({})", round + 1), &m);
        attached.push(m);
    }
    drop(e);
    let best_candle = candle
        .iter()
        .map(|m| m.spawn_to_first)
        .fold(f64::INFINITY, f64::min);
    let reference = &leased.logits;
    for m in candle.iter().chain(&attached) {
        if &m.logits != reference {
            return Err(format!(
                "last logits differ: {} against the never-killed engine's {reference}",
                m.logits
            ));
        }
    }
    for (i, m) in attached.iter().enumerate() {
        println!(
            "restart: re-attach {}: {:.1}x faster to the first token than candle's loader at its best ({:.3} s against {best_candle:.3} s)",
            i + 1,
            best_candle / m.spawn_to_first,
            m.spawn_to_first
        );
    }
    println!("restart: every engine's last logits are bit for bit the never-killed engine's");
    broker.shutdown();
    let _ = std::fs::remove_dir_all(&dir);
    Ok(())
}

/// Bytes the broker holds under held leases, once the killed engine's lease holds.
fn wait_held(broker: &Broker) -> Result<u64, String> {
    let end = Instant::now() + Duration::from_secs(30);
    loop {
        let s = broker.snapshot();
        let held: u64 = s
            .models
            .iter()
            .filter_map(|m| m.lease.as_ref())
            .filter(|l| l.state == elastic_vmm::broker::protocol::LeaseState::Held)
            .map(|l| l.kept)
            .sum();
        if held > 0 {
            return Ok(held);
        }
        if Instant::now() > end {
            return Err("the killed engine's lease never held".into());
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}
