//! Profiling aid: the hot allocate+free loop on the host backend.
//! `hotloop [SIZE [PAIRS]]`: one size (bytes) and a number of pairs, for `valgrind --tool=callgrind`
//! (instructions per pair: the difference of two runs with different PAIRS, divided by their
//! difference); without arguments, 4 KiB, 2 MiB and 64 MiB, 5M pairs each.
fn main() -> elastic_vmm::Result<()> {
    let args: Vec<usize> = std::env::args()
        .skip(1)
        .map(|a| a.parse().expect("hotloop [SIZE [PAIRS]]: numbers"))
        .collect();
    let sizes = match args.first() {
        Some(&s) => vec![s],
        None => vec![4096, 2 << 20, 64 << 20],
    };
    let n = args.get(1).copied().unwrap_or(5_000_000);
    for size in sizes {
        let pool = elastic_vmm::Pool::host(16 << 30)?;
        drop(pool.allocate(size)?);
        let t = std::time::Instant::now();
        for _ in 0..n {
            let a = pool.allocate(std::hint::black_box(size))?;
            std::hint::black_box(a.addr());
        }
        println!(
            "{size:>9} bytes: {:.1} ns per allocate+free",
            t.elapsed().as_nanos() as f64 / n as f64
        );
    }
    Ok(())
}
