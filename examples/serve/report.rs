//! The benchmark's output: a summary table printed as runs finish, every run's summary saved as
//! JSON (so a run cut off later still reports what it measured), and two SVG plots written by
//! hand (memory per model over time; p99 TTFT against load per policy).

use std::fmt::Write as _;
use std::path::Path;

use crate::cluster::RunSummary;

const GIB: f64 = (1u64 << 30) as f64;

/// The table's header. `tpot mean` is token-weighted; `batch` the mean decode batch; `held`
/// the mean of what the policy holds per model (its use or its guarantee, whichever is more);
/// `drv/st` and `bud/st` driver calls and budget calls (KV guarantee changes) per step.
pub fn header() -> String {
    format!(
        "{:<14} {:<8} {:>6} {:>9} {:>8} {:>8} {:>8} {:>9} {:>7} {:>5} {:>5} {:>5} {:>4} {:>8} {:>8} {:>8} {:>6} {:>6} {:>6}",
        "run",
        "policy",
        "load",
        "finished",
        "ttft p50",
        "ttft p99",
        "tpot p50",
        "tpot mean",
        "tok/s",
        "batch",
        "preem",
        "refus",
        "oom",
        "peak GiB",
        "mean GiB",
        "held GiB",
        "drv/st",
        "bud/st",
        "wall s"
    )
}

/// One run's overall line, then one line per model.
pub fn lines(s: &RunSummary) -> String {
    let mut out = String::new();
    for (i, m) in std::iter::once(&s.overall).chain(&s.models).enumerate() {
        let run = if i == 0 {
            s.label.clone()
        } else {
            format!("  {}", m.id)
        };
        let per_step = |x: u64| x as f64 / m.steps.max(1) as f64;
        let _ = writeln!(
            out,
            "{:<14} {:<8} {:>6.2} {:>4}/{:<4} {:>8.3} {:>8.3} {:>8.4} {:>9.5} {:>7.0} {:>5.1} {:>5} {:>5} {:>4} {:>8.2} {:>8.2} {:>8.2} {:>6.2} {:>6.2} {:>6}",
            run,
            s.policy.name(),
            s.peak_rate,
            m.finished,
            m.requests,
            m.ttft_p50,
            m.ttft_p99,
            m.tpot_p50,
            m.tpot_mean,
            m.throughput,
            m.decode_batch,
            m.preemptions,
            m.refused,
            m.oom,
            m.peak_bytes as f64 / GIB,
            m.mean_bytes / GIB,
            m.mean_held_bytes / GIB,
            per_step(m.driver_calls),
            per_step(m.budget_calls),
            if i == 0 { format!("{:.1}", s.wall_s) } else { String::new() },
        );
    }
    if !s.errors.is_empty() {
        let _ = writeln!(out, "  errors: {:?}", s.errors);
    }
    out
}

/// Save `s` as `dir/<label>-<policy>.json`.
pub fn save(dir: &Path, s: &RunSummary) -> Result<std::path::PathBuf, String> {
    std::fs::create_dir_all(dir).map_err(|e| format!("creating {}: {e}", dir.display()))?;
    let path = dir.join(format!("{}-{}.json", s.label, s.policy.name()));
    let json = serde_json::to_vec_pretty(s).map_err(|e| e.to_string())?;
    std::fs::write(&path, json).map_err(|e| format!("writing {}: {e}", path.display()))?;
    Ok(path)
}

const COLORS: [&str; 8] = [
    "#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf",
];

fn esc(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}

/// A named line with a band: points `(x, y, low, high)`.
pub type BandSeries = (String, Vec<(f64, f64, f64, f64)>);

/// A line chart: `series` of (name, points), axes labelled; y on a log scale if `log_y`.
pub fn line_chart(
    title: &str,
    x_label: &str,
    y_label: &str,
    series: &[(String, Vec<(f64, f64)>)],
    log_y: bool,
) -> String {
    let banded: Vec<BandSeries> = series
        .iter()
        .map(|(n, p)| (n.clone(), p.iter().map(|&(x, y)| (x, y, y, y)).collect()))
        .collect();
    band_chart(title, x_label, y_label, &banded, log_y)
}

/// A line chart with bands: `series` of (name, points `(x, y, low, high)`), each line drawn
/// over a shaded band from `low` to `high` (a confidence interval; none where they equal `y`).
pub fn band_chart(
    title: &str,
    x_label: &str,
    y_label: &str,
    series: &[BandSeries],
    log_y: bool,
) -> String {
    let (w, h, l, r, t, b) = (720.0, 420.0, 70.0, 150.0, 40.0, 50.0);
    let fy = |y: f64| if log_y { y.max(1e-6).log10() } else { y };
    let (mut x0, mut x1, mut y0, mut y1) = (f64::MAX, f64::MIN, f64::MAX, f64::MIN);
    for &(x, y, lo, hi) in series.iter().flat_map(|s| s.1.iter()) {
        for v in [y, lo, hi].into_iter().filter(|v| v.is_finite()) {
            x0 = x0.min(x);
            x1 = x1.max(x);
            y0 = y0.min(fy(v));
            y1 = y1.max(fy(v));
        }
    }
    if x0 > x1 {
        (x0, x1, y0, y1) = (0.0, 1.0, 0.0, 1.0);
    }
    if !log_y {
        y0 = y0.min(0.0);
    }
    if x1 - x0 < 1e-12 {
        x1 = x0 + 1.0;
    }
    if y1 - y0 < 1e-12 {
        y1 = y0 + 1.0;
    }
    let px = |x: f64| l + (x - x0) / (x1 - x0) * (w - l - r);
    let py = |y: f64| h - b - (fy(y) - y0) / (y1 - y0) * (h - t - b);
    let mut svg = format!(
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{w}\" height=\"{h}\" font-family=\"sans-serif\" font-size=\"12\">\n<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n<text x=\"{}\" y=\"22\" text-anchor=\"middle\" font-size=\"15\">{}</text>\n",
        w / 2.0,
        esc(title)
    );
    let _ = writeln!(
        svg,
        "<line x1=\"{l}\" y1=\"{}\" x2=\"{}\" y2=\"{}\" stroke=\"black\"/><line x1=\"{l}\" y1=\"{t}\" x2=\"{l}\" y2=\"{}\" stroke=\"black\"/>",
        h - b,
        w - r,
        h - b,
        h - b
    );
    for i in 0..=4 {
        let f = i as f64 / 4.0;
        let xv = x0 + f * (x1 - x0);
        let yv = y0 + f * (y1 - y0);
        let yshow = if log_y { 10f64.powf(yv) } else { yv };
        let (xp, yp) = (l + f * (w - l - r), h - b - f * (h - t - b));
        let _ = writeln!(
            svg,
            "<text x=\"{xp}\" y=\"{}\" text-anchor=\"middle\">{xv:.3}</text><text x=\"{}\" y=\"{}\" text-anchor=\"end\">{yshow:.3}</text><line x1=\"{l}\" y1=\"{yp}\" x2=\"{}\" y2=\"{yp}\" stroke=\"#ddd\"/>",
            h - b + 16.0,
            l - 6.0,
            yp + 4.0,
            w - r
        );
    }
    let _ = writeln!(
        svg,
        "<text x=\"{}\" y=\"{}\" text-anchor=\"middle\">{}</text><text x=\"16\" y=\"{}\" transform=\"rotate(-90 16 {})\" text-anchor=\"middle\">{}</text>",
        (l + w - r) / 2.0,
        h - 12.0,
        esc(x_label),
        (t + h - b) / 2.0,
        (t + h - b) / 2.0,
        esc(y_label)
    );
    for (i, (name, points)) in series.iter().enumerate() {
        let c = COLORS[i % COLORS.len()];
        let banded: Vec<_> = points
            .iter()
            .filter(|p| p.2.is_finite() && p.3.is_finite() && p.2 < p.3)
            .collect();
        if banded.len() == points.len() && !banded.is_empty() {
            let edge: Vec<String> = banded
                .iter()
                .map(|p| format!("{:.1},{:.1}", px(p.0), py(p.3)))
                .chain(
                    banded
                        .iter()
                        .rev()
                        .map(|p| format!("{:.1},{:.1}", px(p.0), py(p.2))),
                )
                .collect();
            let _ = writeln!(
                svg,
                "<polygon fill=\"{c}\" fill-opacity=\"0.18\" stroke=\"none\" points=\"{}\"/>",
                edge.join(" ")
            );
        }
        let path: Vec<String> = points
            .iter()
            .filter(|p| p.1.is_finite())
            .map(|&(x, y, _, _)| format!("{:.1},{:.1}", px(x), py(y)))
            .collect();
        let _ = writeln!(
            svg,
            "<polyline fill=\"none\" stroke=\"{c}\" stroke-width=\"1.5\" points=\"{}\"/>",
            path.join(" ")
        );
        if points.len() <= 20 {
            for p in &path {
                let (x, y) = p.split_once(',').unwrap_or(("0", "0"));
                let _ = writeln!(svg, "<circle cx=\"{x}\" cy=\"{y}\" r=\"3\" fill=\"{c}\"/>");
            }
        }
        let ly = t + 10.0 + 18.0 * i as f64;
        let _ = writeln!(
            svg,
            "<line x1=\"{}\" y1=\"{ly}\" x2=\"{}\" y2=\"{ly}\" stroke=\"{c}\" stroke-width=\"3\"/><text x=\"{}\" y=\"{}\">{}</text>",
            w - r + 10.0,
            w - r + 30.0,
            w - r + 36.0,
            ly + 4.0,
            esc(name)
        );
    }
    svg.push_str("</svg>\n");
    svg
}

/// Memory per model over one run.
pub fn memory_svg(s: &RunSummary) -> String {
    let n = s.models.len();
    let series: Vec<(String, Vec<(f64, f64)>)> = (0..n)
        .map(|i| {
            let pts = s
                .timeline
                .iter()
                .map(|(t, v)| (*t, v.get(i).copied().unwrap_or(0) as f64 / GIB))
                .collect();
            (s.models[i].id.clone(), pts)
        })
        .collect();
    line_chart(
        &format!("{} {}: physical memory per model", s.label, s.policy.name()),
        "time (s)",
        "GiB",
        &series,
        false,
    )
}

/// p99 TTFT against load, one line per policy, for the runs of one model size.
pub fn ttft_svg(title: &str, runs: &[RunSummary]) -> String {
    let mut series: Vec<(String, Vec<(f64, f64)>)> = Vec::new();
    for r in runs {
        let name = r.policy.name().to_string();
        let point = (r.peak_rate, r.overall.ttft_p99);
        match series.iter_mut().find(|s| s.0 == name) {
            Some(s) => s.1.push(point),
            None => series.push((name, vec![point])),
        }
    }
    for s in &mut series {
        s.1.sort_by(|a, b| a.0.total_cmp(&b.0));
    }
    line_chart(
        title,
        "peak load per model (requests/s)",
        "p99 TTFT (s, log)",
        &series,
        true,
    )
}

/// Write `svg` to `path`.
pub fn write_svg(path: &Path, svg: &str) -> Result<(), String> {
    std::fs::write(path, svg).map_err(|e| format!("writing {}: {e}", path.display()))
}
