//! The README's results table is generated from saved GPU runs, so it cannot drift from them.
//!
//! Each file in `docs/results/` is the output of one benchmark command on the GPU machine, as it
//! printed it, with two header lines added: `# gpu: <device, driver>` and `# command: <what ran>`.
//! The benchmarks print one `RESULT|key|what|ours|peer|peer's figure|ratio` line per headline
//! figure (`benches/gpu/main.rs`, `examples/routed_llama.rs`). This test rebuilds the table
//! from those lines and compares it with the README's; `BLESS_RESULTS=1 cargo test --test
//! results` writes it instead.

use std::fs;
use std::path::Path;

const BEGIN: &str = "<!-- results: generated from docs/results/ by tests/results.rs -->";
const END: &str = "<!-- end of results -->";

#[derive(Debug)]
struct Run {
    file: String,
    gpu: String,
    command: String,
    rows: Vec<Vec<String>>,
}

fn parse(file: &str, text: &str) -> Result<Run, String> {
    let header = |name: &str| {
        text.lines()
            .find_map(|l| l.strip_prefix(&format!("# {name}: ")))
            .map(str::trim)
            .map(String::from)
            .ok_or_else(|| format!("{file}: no '# {name}:' line"))
    };
    let (gpu, command) = (header("gpu")?, header("command")?);
    let mut rows = Vec::new();
    for line in text.lines().filter(|l| l.starts_with("RESULT|")) {
        let cells: Vec<String> = line.split('|').skip(1).map(|c| c.trim().into()).collect();
        if cells.len() != 6 {
            return Err(format!("{file}: a RESULT line needs 6 cells: {line}"));
        }
        let ratio = cells[5]
            .strip_suffix('x')
            .and_then(|r| r.parse::<f64>().ok());
        if !ratio.is_some_and(|r| r.is_finite() && r > 0.0) {
            return Err(format!(
                "{file}: ratio {:?} is not a number like 1.23x",
                cells[5]
            ));
        }
        rows.push(cells);
    }
    if rows.is_empty() {
        return Err(format!("{file}: no RESULT line"));
    }
    Ok(Run {
        file: file.into(),
        gpu,
        command,
        rows,
    })
}

fn table(runs: &[Run]) -> String {
    let mut rows: Vec<(String, String)> = Vec::new();
    for run in runs {
        for c in &run.rows {
            let line = format!(
                "| {} | {} | {} ({}) | **{}** | {} | `{}` ([log](docs/results/{})) |",
                c[1], c[2], c[4], c[3], c[5], run.gpu, run.command, run.file
            );
            rows.push((c[0].clone(), line));
        }
    }
    rows.sort();
    let mut out = String::from(
        "| what | elastic-vmm | what users have today | ratio (above 1: we are better) | GPU | command |\n|---|---|---|---|---|---|\n",
    );
    for (_, line) in rows {
        out.push_str(&line);
        out.push('\n');
    }
    out
}

#[test]
fn readme_results_table_is_generated_from_the_saved_runs() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut files: Vec<_> = fs::read_dir(root.join("docs/results"))
        .expect("docs/results exists")
        .map(|e| e.expect("readable entry").path())
        .filter(|p| p.extension().is_some_and(|e| e == "log"))
        .collect();
    files.sort();
    assert!(!files.is_empty(), "no saved run in docs/results/*.log");
    let runs: Vec<Run> = files
        .iter()
        .map(|p| {
            let name = p
                .file_name()
                .expect("file name")
                .to_string_lossy()
                .into_owned();
            parse(&name, &fs::read_to_string(p).expect("readable log"))
                .unwrap_or_else(|e| panic!("{e}"))
        })
        .collect();
    let generated = table(&runs);
    let readme_path = root.join("README.md");
    let readme = fs::read_to_string(&readme_path).expect("README.md");
    let start = readme.find(BEGIN).expect("README has the results marker") + BEGIN.len();
    let end = readme[start..]
        .find(END)
        .expect("README has the end-of-results marker")
        + start;
    let current = readme[start..end].trim_start_matches('\n');
    if std::env::var_os("BLESS_RESULTS").is_some() {
        let updated = format!("{}\n{generated}{}", &readme[..start], &readme[end..]);
        fs::write(&readme_path, updated).expect("write README.md");
        return;
    }
    assert_eq!(
        current, generated,
        "the README's results table differs from docs/results/*.log; \
         run `BLESS_RESULTS=1 cargo test --test results` after saving a new run"
    );
}

#[test]
fn a_result_line_without_a_number_is_refused() {
    let log = "# gpu: g\n# command: c\nRESULT|k|w|1 ns|p|2 ns|fast\n";
    assert!(parse("x.log", log).unwrap_err().contains("ratio"));
    let log = "# gpu: g\n# command: c\nnothing measured\n";
    assert!(parse("x.log", log).unwrap_err().contains("no RESULT"));
    let log = "# command: c\nRESULT|k|w|1 ns|p|2 ns|2.00x\n";
    assert!(parse("x.log", log).unwrap_err().contains("gpu"));
    let ok = parse(
        "x.log",
        "# gpu: g\n# command: c\nRESULT|k|w|1 ns|p|2 ns|2.00x\n",
    )
    .unwrap();
    assert_eq!(ok.rows.len(), 1);
}
