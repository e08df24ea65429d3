//! The regression guard (`gpu-bench --check`): every `RESULT` ratio of a fresh run against the
//! one saved in `docs/results/` from the same device. A line fails when its ratio is more than
//! its [`tolerance`] worse than the saved one, when a saved line of a section that ran is missing,
//! or when its section has no saved line at all; a new line of a section with saved ones is
//! reported as new. Both figures are printed for every line.
//!
//! Pure text in, text out: `tests/results.rs` includes this file to test it on the host.

use std::fmt::Write as _;

/// How much worse than the saved ratio a fresh one may be: 20%, unless [`tolerance`] says
/// otherwise for the line.
pub const TOLERANCE: f64 = 0.20;

/// How much worse than the saved ratio line `key`'s fresh one may be: [`TOLERANCE`], or wider
/// for a line whose reruns of one build spread past it, with the spread that was seen.
pub fn tolerance(key: &str) -> f64 {
    match key {
        // 8 GiB in one request against one raw 8 GiB handle, best of 4 rounds each: the
        // driver's state moves both (0.35x and 0.52x on the H100 with the same pool code, runs
        // of 2026-12-07; 0.35x-0.62x across the saved logs). The regression this line was
        // made for took the ratio from 0.52x to 0.03x, which fails at 50% too, and the bench's
        // own check (8 GiB in at most 4x one raw handle) stays.
        "pool/bulk-growth" => 0.50,
        _ => TOLERANCE,
    }
}

/// One `RESULT|key|what|ours|peer|peer's figure|ratio` line.
#[derive(Debug, Clone, PartialEq)]
pub struct Line {
    /// `section/name`, e.g. `pool/growth`.
    pub key: String,
    /// What was measured.
    pub what: String,
    /// Our figure, as printed.
    pub ours: String,
    /// What we were compared with.
    pub peer: String,
    /// Its figure, as printed.
    pub peer_figure: String,
    /// Above 1: elastic-vmm is better.
    pub ratio: f64,
}

impl Line {
    /// The section that prints it: the key up to its first `/`.
    pub fn section(&self) -> &str {
        self.key.split('/').next().unwrap_or_default()
    }
}

/// Parse one `RESULT|...` line (`None` for any other line).
pub fn parse_line(line: &str) -> Option<Result<Line, String>> {
    let rest = line.strip_prefix("RESULT|")?;
    let cells: Vec<&str> = rest.split('|').map(str::trim).collect();
    if cells.len() != 6 {
        return Some(Err(format!("a RESULT line needs 6 cells: {line}")));
    }
    let ratio = cells[5]
        .strip_suffix('x')
        .and_then(|r| r.parse::<f64>().ok())
        .filter(|r| r.is_finite() && *r > 0.0);
    let Some(ratio) = ratio else {
        return Some(Err(format!(
            "ratio {:?} is not a number like 1.23x: {line}",
            cells[5]
        )));
    };
    Some(Ok(Line {
        key: cells[0].into(),
        what: cells[1].into(),
        ours: cells[2].into(),
        peer: cells[3].into(),
        peer_figure: cells[4].into(),
        ratio,
    }))
}

/// Every `RESULT` line of a log, in order.
pub fn lines_of(text: &str) -> Result<Vec<Line>, String> {
    text.lines().filter_map(parse_line).collect()
}

/// The `RESULT` lines of a saved log in `docs/results/` that `gpu-bench` printed (its
/// `# command:` header runs `gpu-bench`); other saved logs (examples) yield none.
pub fn saved_bench_lines(text: &str) -> Result<Vec<Line>, String> {
    let command = text
        .lines()
        .find_map(|l| l.strip_prefix("# command: "))
        .ok_or("no '# command:' line")?;
    let program = command.split_whitespace().next().unwrap_or_default();
    if !program.ends_with("gpu-bench") {
        return Ok(Vec::new());
    }
    lines_of(text)
}

/// The device a saved log ran on: its `# gpu:` header without the driver (`NVIDIA H100 80GB
/// HBM3` of `# gpu: NVIDIA H100 80GB HBM3, driver 580.159.04`).
pub fn saved_device(text: &str) -> Option<&str> {
    let gpu = text.lines().find_map(|l| l.strip_prefix("# gpu: "))?;
    Some(gpu.split(", driver").next().unwrap_or(gpu).trim())
}

/// The saved lines (`(file, text)` of each saved log) of `gpu-bench` runs on `device`: a ratio
/// is compared only with one measured on the same kind of device (an H200's attention against
/// its own bandwidth floor is not an H100's). An error names the devices that have saved runs
/// when `device` has none.
pub fn saved_on(device: &str, logs: &[(String, String)]) -> Result<Vec<(String, Line)>, String> {
    let mut out = Vec::new();
    let mut others = Vec::new();
    for (file, text) in logs {
        let lines = saved_bench_lines(text).map_err(|e| format!("{file}: {e}"))?;
        if lines.is_empty() {
            continue;
        }
        match saved_device(text) {
            Some(d) if d == device => out.extend(lines.into_iter().map(|l| (file.clone(), l))),
            Some(d) => others.push(d.to_string()),
            None => return Err(format!("{file}: no '# gpu:' line")),
        }
    }
    if out.is_empty() {
        others.sort();
        others.dedup();
        return Err(format!(
            "no saved gpu-bench run on {device} to compare with (saved runs are on: {}); save this run as its baseline (docs/guide/benchmarks.md)",
            if others.is_empty() { "none".to_string() } else { others.join(", ") }
        ));
    }
    Ok(out)
}

/// The outcome of a check: one printed row per line, and whether all passed.
#[derive(Debug, Default)]
pub struct Report {
    /// One row per compared line: verdict, key, both figures.
    pub rows: Vec<String>,
    /// Rows that failed.
    pub failed: usize,
}

impl Report {
    /// Whether no line failed.
    pub fn passed(&self) -> bool {
        self.failed == 0
    }

    /// The rows and a summary, for printing.
    pub fn text(&self) -> String {
        let mut out = String::new();
        for r in &self.rows {
            let _ = writeln!(out, "{r}");
        }
        let _ = writeln!(
            out,
            "check: {} of {} lines {} (a ratio may be at most {:.0}% worse than the saved one, unless its line says more)",
            if self.passed() {
                self.rows.len()
            } else {
                self.failed
            },
            self.rows.len(),
            if self.passed() { "passed" } else { "FAILED" },
            TOLERANCE * 100.0
        );
        out
    }
}

fn figures(l: &Line) -> String {
    format!(
        "{:.2}x ({} vs {} {})",
        l.ratio, l.ours, l.peer, l.peer_figure
    )
}

/// Compare the fresh lines of the sections that ran with the saved ones (`(file, line)`, of
/// the device that ran them). Saved lines of sections that did not run are ignored; a fresh
/// line whose section has no saved line fails, and so does a section that ran with no line in
/// this run and none saved (a check of nothing must not pass).
pub fn compare(saved: &[(String, Line)], fresh: &[Line], sections: &[&str]) -> Report {
    let mut report = Report::default();
    for (file, s) in saved
        .iter()
        .filter(|(_, s)| sections.contains(&s.section()))
    {
        let Some(f) = fresh.iter().find(|f| f.key == s.key) else {
            report.failed += 1;
            report.rows.push(format!(
                "FAIL    {}: saved {} [{file}], missing from this run",
                s.key,
                figures(s)
            ));
            continue;
        };
        let change = f.ratio / s.ratio - 1.0;
        let tol = tolerance(&s.key);
        // Exactly the tolerance passes (a hair below it in floating point too).
        let worse = change < -tol - 1e-9;
        if worse {
            report.failed += 1;
        }
        report.rows.push(format!(
            "{} {}: saved {} [{file}], now {}: {:+.1}%{}",
            if worse { "FAIL   " } else { "ok     " },
            s.key,
            figures(s),
            figures(f),
            change * 100.0,
            if tol == TOLERANCE {
                String::new()
            } else {
                format!(" (this line may be {:.0}% worse)", tol * 100.0)
            }
        ));
    }
    for f in fresh {
        if saved.iter().any(|(_, s)| s.key == f.key) {
            continue;
        }
        // A new line of a section with a baseline is reported; a section with none at all on
        // this device has nothing to guard it: that fails (save its run as the baseline).
        if saved.iter().any(|(_, s)| s.section() == f.section()) {
            report.rows.push(format!(
                "new     {}: now {}, no saved figure",
                f.key,
                figures(f)
            ));
        } else {
            report.failed += 1;
            report.rows.push(format!(
                "FAIL    {}: now {}, and section {} has no saved line on this device to compare with",
                f.key,
                figures(f),
                f.section()
            ));
        }
    }
    for &section in sections {
        let fresh_any = fresh.iter().any(|f| f.section() == section);
        let saved_any = saved.iter().any(|(_, s)| s.section() == section);
        if !fresh_any && !saved_any {
            report.failed += 1;
            report.rows.push(format!(
                "FAIL    section {section}: no RESULT line in this run and none saved on this device: nothing guards it"
            ));
        }
    }
    report
}
