//! README quick start "one GPU shared by several engine processes": a broker owns the budget
//! and every physical chunk; an engine connects, registers a model and allocates from an
//! ordinary pool; the operator's view shows it. Here the broker runs in this process on the
//! host backend (real memory, chunks shared as memfds); in production it is
//! `elastic-vmm --backend cuda broker` and each engine connects to its socket. The README's
//! lines are this file's (`tests/readme.rs` checks them); `scripts/test.sh` runs it.

use elastic_vmm::broker::{Broker, BrokerClient, BrokerConfig};
use elastic_vmm::ModelConfig;

fn main() -> elastic_vmm::Result<()> {
    let dir = std::env::temp_dir().join(format!("evmm-quickstart-{}", std::process::id()));
    let config = BrokerConfig::new(dir.join("host.sock"), 256 << 20); // a 256 MiB budget
    let broker = Broker::host(config)?; // `elastic-vmm broker`, in-process (Broker::cuda on a GPU)
    let socket = broker.socket(); // elsewhere: elastic_vmm::broker::default_socket("cuda", Some(0))

    let engine = BrokerClient::connect(socket, "engine-1")?;
    let llama = engine.register(ModelConfig::new("llama", 1 << 30, 64 << 20))?; // a Pool, as above
    let mut kv = llama.allocate(16 << 20)?; // chunks granted by the broker, mapped here
    kv.write(0, b"served by the broker")?;
    assert!(llama.allocate(64 << 20).is_err()); // the broker enforces the limit, with the numbers

    let view = BrokerClient::connect_control(socket, "ctl")?.snapshot()?; // what `ctl list` prints
    let m = &view.models[0];
    println!(
        "{}: uses {} of {} bytes; broker budget {} of {}",
        m.name, m.used, m.limit, view.global_used, view.global_limit
    );
    assert!(m.used >= 16 << 20);
    drop((kv, llama, engine));
    broker.shutdown();
    std::fs::remove_dir_all(&dir).ok(); // the socket's folder
    println!("quickstart_broker: ok");
    Ok(())
}
