//! A small SVG chart of per-model memory over time: stacked areas of physical memory held,
//! dashed lines of memory in use, and the budget. No dependencies: the SVG is written by hand.

use std::fmt::Write as _;

/// One model's samples.
pub struct Series {
    pub name: String,
    pub color: &'static str,
    /// Physical bytes held at each step.
    pub physical: Vec<u64>,
    /// Bytes in use at each step.
    pub in_use: Vec<u64>,
    /// Whether the model was asleep at each step (drawn as a band under the chart).
    pub asleep: Vec<bool>,
}

const W: f64 = 960.0;
const H: f64 = 460.0;
const LEFT: f64 = 70.0;
const RIGHT: f64 = 190.0;
const TOP: f64 = 40.0;
const BOTTOM: f64 = 50.0;

fn gib(bytes: u64) -> f64 {
    bytes as f64 / (1u64 << 30) as f64
}

/// Render the chart. `budget` and `sum_of_peaks` are drawn as horizontal lines.
pub fn render(title: &str, series: &[Series], budget: u64, sum_of_peaks: u64) -> String {
    let steps = series
        .iter()
        .map(|s| s.physical.len())
        .max()
        .unwrap_or(0)
        .max(2);
    let top_value = series
        .iter()
        .map(|s| s.physical.iter().copied().max().unwrap_or(0))
        .fold(0u64, u64::saturating_add)
        .max(budget)
        .max(sum_of_peaks);
    let ymax = gib(top_value) * 1.08;
    let pw = W - LEFT - RIGHT;
    let ph = H - TOP - BOTTOM;
    let x = |i: usize| LEFT + pw * i as f64 / (steps - 1) as f64;
    let y = |v: f64| TOP + ph * (1.0 - v / ymax);
    let mut svg = String::new();
    let _ = writeln!(
        svg,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" viewBox="0 0 {W} {H}" font-family="sans-serif" font-size="12">"#
    );
    let _ = writeln!(svg, r#"<rect width="{W}" height="{H}" fill="white"/>"#);
    let _ = writeln!(
        svg,
        r#"<text x="{LEFT}" y="22" font-size="15" font-weight="bold">{}</text>"#,
        escape(title)
    );
    // Grid and y labels at round values.
    let tick = [
        0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0,
    ]
    .into_iter()
    .find(|t| ymax / t <= 8.0)
    .unwrap_or(200.0);
    let ticks = (ymax / tick).floor() as usize;
    for t in 0..=ticks {
        let v = tick * t as f64;
        let yy = y(v);
        let _ = writeln!(
            svg,
            r##"<line x1="{LEFT}" y1="{yy:.1}" x2="{:.1}" y2="{yy:.1}" stroke="#e5e5e5"/>"##,
            LEFT + pw
        );
        let _ = writeln!(
            svg,
            r#"<text x="{:.1}" y="{:.1}" text-anchor="end">{v}</text>"#,
            LEFT - 6.0,
            yy + 4.0
        );
    }
    let _ = writeln!(
        svg,
        r#"<text x="16" y="{:.1}" transform="rotate(-90 16 {:.1})" text-anchor="middle">GiB</text>"#,
        TOP + ph / 2.0,
        TOP + ph / 2.0
    );
    let _ = writeln!(
        svg,
        r#"<text x="{:.1}" y="{:.1}" text-anchor="middle">step</text>"#,
        LEFT + pw / 2.0,
        H - 12.0
    );
    for t in 0..=5 {
        let i = (steps - 1) * t / 5;
        let _ = writeln!(
            svg,
            r#"<text x="{:.1}" y="{:.1}" text-anchor="middle">{i}</text>"#,
            x(i),
            TOP + ph + 18.0
        );
    }
    // Stacked areas of physical memory held.
    let mut base = vec![0u64; steps];
    for s in series {
        let mut top = base.clone();
        for (i, v) in s.physical.iter().enumerate() {
            top[i] = top[i].saturating_add(*v);
        }
        let mut d = String::new();
        for (i, v) in top.iter().enumerate() {
            let _ = write!(
                d,
                "{}{:.1},{:.1} ",
                if i == 0 { "M" } else { "L" },
                x(i),
                y(gib(*v))
            );
        }
        for i in (0..steps).rev() {
            let _ = write!(d, "L{:.1},{:.1} ", x(i), y(gib(base[i])));
        }
        let _ = writeln!(
            svg,
            r#"<path d="{d}Z" fill="{}" fill-opacity="0.35" stroke="{}" stroke-width="1"/>"#,
            s.color, s.color
        );
        base = top;
    }
    // Dashed lines: each model's memory in use (not stacked).
    for s in series {
        let pts: Vec<String> = s
            .in_use
            .iter()
            .enumerate()
            .map(|(i, v)| format!("{:.1},{:.1}", x(i), y(gib(*v))))
            .collect();
        let _ = writeln!(
            svg,
            r#"<polyline points="{}" fill="none" stroke="{}" stroke-width="1.6" stroke-dasharray="5,3"/>"#,
            pts.join(" "),
            s.color
        );
    }
    // Sleep bands: one row per model along the bottom of the chart, filled where it slept.
    for (k, s) in series.iter().enumerate() {
        let yy = TOP + ph - 7.0 * (k as f64 + 1.0);
        let mut i = 0;
        while i < s.asleep.len() {
            if !s.asleep[i] {
                i += 1;
                continue;
            }
            let start = i;
            while i < s.asleep.len() && s.asleep[i] {
                i += 1;
            }
            let x0 = x(start);
            let x1 = x(i.min(steps - 1)).max(x0 + 1.0);
            let _ = writeln!(
                svg,
                r#"<rect x="{x0:.1}" y="{yy:.1}" width="{:.1}" height="5" fill="{}"><title>{} asleep</title></rect>"#,
                x1 - x0,
                s.color,
                escape(&s.name)
            );
        }
    }
    // Budget and sum of peaks.
    for (v, label, color) in [
        (budget, "global budget", "#c0392b"),
        (sum_of_peaks, "sum of peaks (static)", "#555555"),
    ] {
        let yy = y(gib(v));
        let _ = writeln!(
            svg,
            r#"<line x1="{LEFT}" y1="{yy:.1}" x2="{:.1}" y2="{yy:.1}" stroke="{color}" stroke-width="2"/>"#,
            LEFT + pw
        );
        let _ = writeln!(
            svg,
            r#"<text x="{:.1}" y="{:.1}" fill="{color}">{label} {:.2} GiB</text>"#,
            LEFT + 8.0,
            yy - 5.0,
            gib(v)
        );
    }
    // Legend.
    let mut ly = TOP + 10.0;
    for s in series {
        let lx = LEFT + pw + 10.0;
        let _ = writeln!(
            svg,
            r#"<rect x="{lx:.1}" y="{:.1}" width="14" height="10" fill="{}" fill-opacity="0.35" stroke="{}"/>"#,
            ly - 9.0,
            s.color,
            s.color
        );
        let _ = writeln!(
            svg,
            r#"<text x="{:.1}" y="{ly:.1}">{} held</text>"#,
            lx + 20.0,
            escape(&s.name)
        );
        ly += 18.0;
        let _ = writeln!(
            svg,
            r#"<line x1="{lx:.1}" y1="{:.1}" x2="{:.1}" y2="{:.1}" stroke="{}" stroke-width="1.6" stroke-dasharray="5,3"/>"#,
            ly - 4.0,
            lx + 14.0,
            ly - 4.0,
            s.color
        );
        let _ = writeln!(
            svg,
            r#"<text x="{:.1}" y="{ly:.1}">{} in use</text>"#,
            lx + 20.0,
            escape(&s.name)
        );
        ly += 18.0;
        if s.asleep.iter().any(|&a| a) {
            let _ = writeln!(
                svg,
                r#"<rect x="{lx:.1}" y="{:.1}" width="14" height="5" fill="{}"/>"#,
                ly - 7.0,
                s.color
            );
            let _ = writeln!(
                svg,
                r#"<text x="{:.1}" y="{ly:.1}">{} asleep (band)</text>"#,
                lx + 20.0,
                escape(&s.name)
            );
            ly += 18.0;
        }
        ly += 6.0;
    }
    let _ = writeln!(svg, "</svg>");
    svg
}

fn escape(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}
