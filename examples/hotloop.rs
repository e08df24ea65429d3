//! Profiling aid: the hot allocate+free loop on the host backend.
fn main() -> elastic_vmm::Result<()> {
    let pool = elastic_vmm::Pool::host(16 << 30)?;
    drop(pool.allocate(2 << 20)?);
    let n = 5_000_000;
    let t = std::time::Instant::now();
    for _ in 0..n {
        let a = pool.allocate(std::hint::black_box(2 << 20))?;
        std::hint::black_box(a.addr());
    }
    println!(
        "{:.1} ns per allocate+free",
        t.elapsed().as_nanos() as f64 / n as f64
    );
    Ok(())
}
