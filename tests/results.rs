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

// The RESULT line format and the regression guard (`gpu-bench --check`), shared with the bench.
#[allow(dead_code)]
#[path = "../benches/gpu/check.rs"]
mod check;

use check::Line;

const BEGIN: &str = "<!-- results: generated from docs/results/ by tests/results.rs -->";
const END: &str = "<!-- end of results -->";

#[derive(Debug)]
struct Run {
    file: String,
    gpu: String,
    command: String,
    rows: Vec<Line>,
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
    let rows = check::lines_of(text).map_err(|e| format!("{file}: {e}"))?;
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
                "| {} | {} | {} ({}) | **{:.2}x** | {} | `{}` ([log](docs/results/{})) |",
                c.what, c.ours, c.peer_figure, c.peer, c.ratio, run.gpu, run.command, run.file
            );
            rows.push((c.key.clone(), line));
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

/// A saved pool log with two lines, as `docs/results/` holds them.
const SAVED: &str = "# gpu: g\n# command: ./gpu-bench pool\n\
RESULT|pool/hot-pair|hot pair|100 ns|async|700 ns|7.00x\n\
RESULT|pool/growth|steps|1300 GiB/s|raw|57 GiB/s|20.00x\n";

fn saved() -> Vec<(String, Line)> {
    check::saved_bench_lines(SAVED)
        .expect("parses")
        .into_iter()
        .map(|l| ("pool.log".to_string(), l))
        .collect()
}

fn fresh(hot: &str, growth: Option<&str>) -> Vec<Line> {
    let mut text = format!("RESULT|pool/hot-pair|hot pair|x|async|y|{hot}\n");
    if let Some(g) = growth {
        text.push_str(&format!("RESULT|pool/growth|steps|x|raw|y|{g}\n"));
    }
    check::lines_of(&text).expect("parses")
}

#[test]
fn the_guard_fails_a_ratio_25_percent_worse_and_passes_10_percent() {
    // 7.00x -> 5.25x is 25% worse: fails; 20.00x -> 18.00x is 10% worse: passes.
    let r = check::compare(&saved(), &fresh("5.25x", Some("18.00x")), &["pool"]);
    assert!(!r.passed(), "{}", r.text());
    assert_eq!(r.failed, 1, "{}", r.text());
    let text = r.text();
    assert!(
        text.contains("FAIL    pool/hot-pair: saved 7.00x") && text.contains("now 5.25x"),
        "{text}"
    );
    assert!(
        text.contains("ok      pool/growth: saved 20.00x") && text.contains("now 18.00x"),
        "{text}"
    );
    // 10% worse and better both pass.
    let r = check::compare(&saved(), &fresh("6.30x", Some("25.00x")), &["pool"]);
    assert!(r.passed(), "{}", r.text());
    // Exactly at the edge (20% worse) passes; just past it fails.
    assert!(check::compare(&saved(), &fresh("5.60x", Some("20.00x")), &["pool"]).passed());
    assert!(!check::compare(&saved(), &fresh("5.59x", Some("20.00x")), &["pool"]).passed());
}

/// Bulk growth's ratio spreads wider between reruns of one build (0.35x and 0.52x on the
/// H100): 33% worse passes with the line's 50%, saying so; the regression the line was made
/// for (0.52x to 0.03x) still fails.
#[test]
fn bulk_growth_has_its_wider_tolerance_and_still_catches_the_regression() {
    let saved: Vec<(String, Line)> = check::saved_bench_lines(
        "# gpu: g\n# command: ./gpu-bench pool\n\
RESULT|pool/bulk-growth|8 GiB|1.085 ms|raw|0.562 ms|0.52x\n",
    )
    .expect("parses")
    .into_iter()
    .map(|l| ("pool.log".to_string(), l))
    .collect();
    let fresh = |r: &str| {
        check::lines_of(&format!("RESULT|pool/bulk-growth|8 GiB|x|raw|y|{r}\n")).expect("parses")
    };
    let r = check::compare(&saved, &fresh("0.35x"), &["pool"]);
    assert!(r.passed(), "{}", r.text());
    assert!(
        r.text().contains("(this line may be 50% worse)"),
        "{}",
        r.text()
    );
    assert!(!check::compare(&saved, &fresh("0.03x"), &["pool"]).passed());
    assert!(!check::compare(&saved, &fresh("0.25x"), &["pool"]).passed());
    assert_eq!(check::tolerance("pool/hot-pair"), check::TOLERANCE);
}

#[test]
fn the_guard_fails_a_missing_line_and_reports_a_new_one() {
    let r = check::compare(&saved(), &fresh("7.00x", None), &["pool"]);
    assert!(!r.passed());
    assert!(
        r.text().contains(
            "FAIL    pool/growth: saved 20.00x (1300 GiB/s vs raw 57 GiB/s) [pool.log], missing"
        ),
        "{}",
        r.text()
    );
    // A line with no saved figure is printed, not failed; saved lines of sections that did not
    // run are not expected.
    let mut lines = fresh("7.00x", Some("20.00x"));
    lines.extend(check::lines_of("RESULT|pool/bulk|one request|1 ms|raw|0.5 ms|0.50x").unwrap());
    let r = check::compare(&saved(), &lines, &["pool"]);
    assert!(r.passed(), "{}", r.text());
    assert!(
        r.text().contains("new     pool/bulk: now 0.50x"),
        "{}",
        r.text()
    );
    // A section that ran, printed no line and has none saved is a check of nothing: it fails.
    let r = check::compare(&saved(), &[], &["pool", "sleep"]);
    assert!(!r.passed(), "{}", r.text());
    assert!(
        r.text().contains(
            "FAIL    section sleep: no RESULT line in this run and none saved on this device"
        ),
        "{}",
        r.text()
    );
    // A section with no saved line at all has nothing to guard it: its lines fail.
    let kv = check::lines_of("RESULT|kv/compaction|c|1 ms|raw|1 ms|1.00x").unwrap();
    let r = check::compare(&saved(), &kv, &["kv"]);
    assert!(!r.passed(), "{}", r.text());
    assert!(
        r.text().contains(
            "FAIL    kv/compaction: now 1.00x (1 ms vs raw 1 ms), and section kv has no saved line on this device"
        ),
        "{}",
        r.text()
    );
}

#[test]
fn the_guard_compares_only_runs_on_the_same_device() {
    let h100 = "# gpu: NVIDIA H100 80GB HBM3, driver 580.159.04\n# command: ./gpu-bench pool\n\
RESULT|pool/hot-pair|hot pair|80 ns|async|600 ns|7.50x\n";
    let h200 = "# gpu: NVIDIA H200, driver 580.159.04\n# command: ./gpu-bench pool\n\
RESULT|pool/hot-pair|hot pair|63 ns|async|578 ns|9.17x\n";
    let example = "# gpu: NVIDIA H100 80GB HBM3, driver 580.159.04\n# command: ./routed_llama\n\
RESULT|candle/decode|d|1 ms|p|1 ms|1.00x\n";
    let logs: Vec<(String, String)> = [("a.log", h100), ("b.log", h200), ("c.log", example)]
        .iter()
        .map(|(f, t)| (f.to_string(), t.to_string()))
        .collect();
    assert_eq!(check::saved_device(h200), Some("NVIDIA H200"));
    let on = |d: &str| check::saved_on(d, &logs);
    let h200_lines = on("NVIDIA H200").expect("saved on the H200");
    assert_eq!(h200_lines.len(), 1);
    assert_eq!(
        (h200_lines[0].0.as_str(), h200_lines[0].1.ratio),
        ("b.log", 9.17)
    );
    // 7.00x is 24% worse than the H200's 9.17x: fails there, though it passes against the
    // H100's 7.50x.
    let r = check::compare(&h200_lines, &fresh("7.00x", None), &["pool"]);
    assert!(!r.passed(), "{}", r.text());
    let h100_lines = on("NVIDIA H100 80GB HBM3").expect("saved on the H100");
    assert!(check::compare(&h100_lines, &fresh("7.00x", None), &["pool"]).passed());
    // A device with no saved run is an error naming the devices that have one.
    let e = on("NVIDIA B200").expect_err("no B200 run");
    assert!(
        e.contains("no saved gpu-bench run on NVIDIA B200")
            && e.contains("NVIDIA H100 80GB HBM3, NVIDIA H200"),
        "{e}"
    );
    // A bench log with no device is refused.
    let bare = vec![(
        "d.log".to_string(),
        "# command: ./gpu-bench pool\nRESULT|pool/x|w|1|p|1|1.00x\n".to_string(),
    )];
    let e = check::saved_on("NVIDIA H200", &bare).expect_err("no gpu line");
    assert!(e.contains("d.log: no '# gpu:' line"), "{e}");
}

#[test]
fn every_saved_bench_log_passes_against_itself() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("docs/results");
    let mut logs = Vec::new();
    for e in fs::read_dir(&root).expect("docs/results") {
        let p = e.expect("entry").path();
        if p.extension().is_some_and(|x| x == "log") {
            let text = fs::read_to_string(&p).expect("readable");
            logs.push((p.file_name().unwrap().to_string_lossy().into_owned(), text));
        }
    }
    // Through what `--check` reads: each device's saved runs.
    let mut devices: Vec<&str> = logs
        .iter()
        .filter(|(_, t)| !check::saved_bench_lines(t).unwrap_or_default().is_empty())
        .map(|(f, t)| check::saved_device(t).unwrap_or_else(|| panic!("{f}: no '# gpu:' line")))
        .collect();
    devices.sort_unstable();
    devices.dedup();
    assert!(!devices.is_empty(), "no saved gpu-bench run");
    let mut keys = Vec::new();
    for device in devices {
        let all = check::saved_on(device, &logs).unwrap_or_else(|e| panic!("{e}"));
        assert!(
            !all.iter().any(|(_, l)| l.key == "candle/decode"),
            "the routed_llama log (its line candle/decode) is no gpu-bench run"
        );
        let fresh: Vec<Line> = all.iter().map(|(_, l)| l.clone()).collect();
        let sections: Vec<&str> = fresh.iter().map(Line::section).collect();
        let r = check::compare(&all, &fresh, &sections);
        assert!(r.passed(), "{device}: {}", r.text());
        assert_eq!(r.rows.len(), all.len());
        keys.extend(fresh.into_iter().map(|l| l.key));
    }
    assert!(keys.iter().any(|k| k == "pool/growth"), "{keys:?}");
}
