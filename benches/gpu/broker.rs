//! The broker on CUDA: 40 GiB handed from one engine process to another (target: 50 ms or less).
//!
//! The bench process runs the broker (in-process, CUDA device 0) and engine A; engine B is this
//! binary again in a child role (`EVMM_BENCH_ROLE=broker-engine-b`), driven over its stdin.
//! A maps 40 GiB in 1 GiB chunks, fills them, unmaps them (they stay in A's cache). Then B maps
//! 40 GiB: (1) with A's memory already given back (idle at the broker): pure hand-over, export,
//! import, map and access; (2) with A still holding it cached and the budget full: the broker
//! asks A to give back first (reclaim round trip included). Both checked byte-exact in B,
//! and the broker's creates and releases counted (0 expected for the hand-over).

use std::io::{BufRead, BufReader, Write};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use elastic_vmm::backend::cuda::CudaBackend;
use elastic_vmm::broker::{Broker, BrokerClient, BrokerConfig};
use elastic_vmm::{Backend, ModelConfig, PoolConfig};

use crate::{BoxError, GIB};

/// The variable naming the child role.
pub const ROLE: &str = "EVMM_BENCH_ROLE";

const SPAN: u64 = 40 * GIB;
const CHUNK: u64 = GIB;

fn model(
    client: &BrokerClient,
    name: &str,
    limit: u64,
) -> Result<elastic_vmm::broker::RemoteModel, BoxError> {
    Ok(client.register(
        ModelConfig::new(name, (64 * GIB) as usize, limit)
            .pool_config(PoolConfig::new((64 * GIB) as usize).max_chunk(CHUNK as usize)),
    )?)
}

pub fn run() -> Result<(), BoxError> {
    let cuda = Arc::new(CudaBackend::new(0)?);
    let free = cuda.memory_info()?.free;
    if free < SPAN + 4 * GIB {
        return Err(format!(
            "needs {} free, the device has {}",
            crate::human(SPAN + 4 * GIB),
            crate::human(free)
        )
        .into());
    }
    let dir = std::env::temp_dir().join(format!("evmm-bench-broker-{}", std::process::id()));
    let socket = dir.join("cuda0.sock");
    // Room for the 40 GiB once: B can only grow with A's memory.
    let broker = Broker::start(cuda.clone(), BrokerConfig::new(&socket, SPAN))?;
    let a_client = BrokerClient::connect(&socket, "engine-a")?;
    let a = model(&a_client, "a", SPAN)?;
    let mut child = Command::new(std::env::current_exe()?)
        .env(ROLE, "broker-engine-b")
        .env("EVMM_SOCKET", &socket)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()?;
    let mut to_b = child.stdin.take().ok_or("no stdin")?;
    let mut from_b = BufReader::new(child.stdout.take().ok_or("no stdout")?);
    let mut ask = |cmd: &str| -> Result<String, BoxError> {
        writeln!(to_b, "{cmd}")?;
        to_b.flush()?;
        let mut line = String::new();
        from_b.read_line(&mut line)?;
        Ok(line.trim().to_string())
    };
    println!("broker: 40 GiB from engine A to engine B (another process), 1 GiB chunks");
    for (round, via_reclaim) in [(1, false), (2, true)] {
        let t = Instant::now();
        a.map_chunked(0, SPAN, CHUNK)?;
        let a_map = t.elapsed();
        // SAFETY: [0, SPAN) was just mapped with access; nothing else uses it.
        unsafe { a.backend().fill(a.base(), SPAN as usize, 0x40 + round)? };
        a.unmap(0, SPAN)?;
        if !via_reclaim {
            a.trim()?;
        }
        let before = broker.snapshot().counters;
        let answer = ask("map")?;
        let after = broker.snapshot().counters;
        let ms: f64 = answer
            .strip_prefix("mapped ")
            .and_then(|r| r.split_whitespace().next())
            .and_then(|v| v.parse().ok())
            .ok_or_else(|| format!("engine B answered {answer:?}"))?;
        let check = ask(&format!("check {}", 0x40 + round))?;
        println!(
            "  {}: B mapped 40 GiB in {ms:.2} ms (target 50 ms) [A's own first map: {:.2} ms]; creates {}, releases {}, hand-overs {}; bytes {check}",
            if via_reclaim { "A holding it cached, reclaimed on demand" } else { "A gave it back first" },
            a_map.as_secs_f64() * 1e3,
            after.creates - before.creates,
            after.releases - before.releases,
            after.handovers - before.handovers,
        );
        if check != "ok" {
            return Err(format!("engine B read wrong bytes: {check}").into());
        }
        ask("unmap")?;
    }
    // Engine B killed with SIGKILL holding 40 GiB: the broker takes everything back and the
    // device's memory returns once the broker releases it.
    let f_before = cuda.memory_info()?.free;
    ask("map")?;
    child.kill()?;
    let _ = child.wait();
    let t = Instant::now();
    while broker.snapshot().models.iter().any(|m| m.name == "b")
        && t.elapsed() < Duration::from_secs(30)
    {
        std::thread::sleep(Duration::from_millis(1));
    }
    let noticed = t.elapsed();
    let s = broker.snapshot();
    let recovered = s.counters.chunks_recovered;
    drop(a);
    drop(a_client);
    let ctl = BrokerClient::connect_control(&socket, "bench")?;
    ctl.request(elastic_vmm::broker::protocol::Request::Trim)?;
    let f_after = cuda.memory_info()?.free;
    println!(
        "  B killed holding 40 GiB: noticed in {:.2} ms, {recovered} chunks taken back, device free memory {} before its map, {} after (audit {:?})",
        noticed.as_secs_f64() * 1e3,
        crate::human(f_before),
        crate::human(f_after),
        s.audit
    );
    drop(ctl);
    broker.shutdown();
    let _ = std::fs::remove_dir_all(dir);
    std::thread::sleep(Duration::from_millis(100));
    Ok(())
}

/// Engine B: `map` (answers `mapped <ms>`), `check <byte>`, `unmap` (gives everything back),
/// `quit`.
pub fn engine_b() -> Result<(), BoxError> {
    let socket = std::env::var("EVMM_SOCKET")?;
    let client = BrokerClient::connect(&socket, "engine-b")?;
    let b = model(&client, "b", SPAN)?;
    let stdin = std::io::stdin();
    let mut out = std::io::stdout();
    for line in stdin.lock().lines() {
        let line = line?;
        let answer = match line.split_whitespace().collect::<Vec<_>>().as_slice() {
            ["map"] => {
                let t = Instant::now();
                b.map_chunked(0, SPAN, CHUNK)?;
                format!("mapped {:.3}", t.elapsed().as_secs_f64() * 1e3)
            }
            ["check", byte] => {
                let byte: u8 = byte.parse()?;
                let mut ok = true;
                // The first and last bytes of every chunk.
                for i in 0..(SPAN / CHUNK) {
                    let mut buf = [0u8; 2];
                    // SAFETY: [0, SPAN) is mapped with access by `map`.
                    unsafe {
                        b.backend().read(b.base() + i * CHUNK, &mut buf[..1])?;
                        b.backend()
                            .read(b.base() + (i + 1) * CHUNK - 1, &mut buf[1..])?;
                    }
                    ok &= buf == [byte, byte];
                }
                if ok {
                    "ok".into()
                } else {
                    "mismatch".into()
                }
            }
            ["unmap"] => {
                b.unmap(0, SPAN)?;
                b.trim()?;
                "ok".into()
            }
            ["quit"] => {
                writeln!(out, "bye")?;
                return Ok(());
            }
            other => format!("unknown {other:?}"),
        };
        writeln!(out, "{answer}")?;
        out.flush()?;
    }
    Ok(())
}
