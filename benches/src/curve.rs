//! Cost curves: a figure measured at growing sizes of the work, printed as a table and drawn as
//! an SVG line plot, both written by the bench that measured them (`--plot DIR`), so the plots
//! in `docs/perf/` are never drawn by hand.
//!
//! One [`Curve`] is one plot: an x axis (the size of the work: resident blocks, daemons,
//! workers, clients), a y axis (a cost or a rate), and one or more [`Series`] (p50 and p99, or
//! kvd and its bound). Each point carries its median and the spread of its runs.

use std::fmt::Write as _;
use std::path::Path;

/// One measured point: the x value, the median of the runs and their min and max.
#[derive(Debug, Clone, Copy)]
pub struct Point {
    /// The size of the work.
    pub x: f64,
    /// Median of the runs.
    pub y: f64,
    /// Smallest run.
    pub lo: f64,
    /// Largest run.
    pub hi: f64,
}

impl Point {
    /// A point from its runs (at least one): median, min, max.
    pub fn of_runs(x: f64, runs: &[f64]) -> Point {
        let mut v = runs.to_vec();
        v.sort_by(f64::total_cmp);
        let y = if v.is_empty() {
            f64::NAN
        } else {
            v[v.len() / 2]
        };
        Point {
            x,
            y,
            lo: v.first().copied().unwrap_or(f64::NAN),
            hi: v.last().copied().unwrap_or(f64::NAN),
        }
    }
}

/// One line of a plot.
#[derive(Debug, Clone)]
pub struct Series {
    /// What the line is ("lookup p50", "raw TCP").
    pub name: String,
    /// Its points, in increasing x.
    pub points: Vec<Point>,
}

/// One plot.
#[derive(Debug, Clone)]
pub struct Curve {
    /// The plot's title (also the table's heading).
    pub title: String,
    /// What x is, with its unit ("resident blocks").
    pub x_label: String,
    /// What y is, with its unit ("µs").
    pub y_label: String,
    /// Logarithmic x axis.
    pub log_x: bool,
    /// Logarithmic y axis.
    pub log_y: bool,
    /// The lines.
    pub series: Vec<Series>,
}

/// An x value: a count (daemons, clients, blocks) is printed whole.
fn fmt_x(v: f64) -> String {
    if v.is_finite() && v.abs() < 1000.0 && v.fract() == 0.0 {
        format!("{v:.0}")
    } else {
        fmt_num(v)
    }
}

/// A number printed with a sensible number of digits for a table.
pub fn fmt_num(v: f64) -> String {
    if !v.is_finite() {
        return "-".into();
    }
    let a = v.abs();
    if a >= 1000.0 {
        let mut s = format!("{v:.0}");
        // thousands separators for readability
        let neg = s.starts_with('-');
        let digits: String = s.trim_start_matches('-').to_string();
        let mut out = String::new();
        for (i, c) in digits.chars().enumerate() {
            if i > 0 && (digits.len() - i) % 3 == 0 {
                out.push(',');
            }
            out.push(c);
        }
        s = if neg { format!("-{out}") } else { out };
        s
    } else if a >= 100.0 {
        format!("{v:.0}")
    } else if a >= 10.0 {
        format!("{v:.1}")
    } else if a >= 1.0 {
        format!("{v:.2}")
    } else {
        format!("{v:.3}")
    }
}

impl Curve {
    /// The curve as a Markdown table: one row per x, one column per series (median, with the
    /// spread in brackets when the runs differ).
    pub fn table(&self) -> String {
        let mut xs: Vec<f64> = self
            .series
            .iter()
            .flat_map(|s| s.points.iter().map(|p| p.x))
            .collect();
        xs.sort_by(f64::total_cmp);
        xs.dedup();
        let mut t = String::new();
        let _ = write!(t, "| {} |", self.x_label);
        for s in &self.series {
            let _ = write!(t, " {} ({}) |", s.name, self.y_label);
        }
        t.push('\n');
        t.push_str("|---|");
        for _ in &self.series {
            t.push_str("---|");
        }
        t.push('\n');
        for x in xs {
            let _ = write!(t, "| {} |", fmt_x(x));
            for s in &self.series {
                match s.points.iter().find(|p| p.x == x) {
                    Some(p) if p.lo < p.hi => {
                        let _ = write!(
                            t,
                            " {} ({}..{}) |",
                            fmt_num(p.y),
                            fmt_num(p.lo),
                            fmt_num(p.hi)
                        );
                    }
                    Some(p) => {
                        let _ = write!(t, " {} |", fmt_num(p.y));
                    }
                    None => t.push_str(" - |"),
                }
            }
            t.push('\n');
        }
        t
    }

    /// The curve as a self-contained SVG line plot (lines through the medians, whiskers for
    /// the spread, a legend).
    pub fn svg(&self) -> String {
        let f = self.frame();
        let mut s = String::new();
        let _ = writeln!(
            s,
            r#"<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" viewBox="0 0 {W} {H}" font-family="sans-serif" font-size="12">"#
        );
        let _ = writeln!(s, r#"<rect width="{W}" height="{H}" fill="white"/>"#);
        let _ = writeln!(
            s,
            r#"<text x="{}" y="22" text-anchor="middle" font-size="14">{}</text>"#,
            W / 2.0,
            xml(&self.title)
        );
        self.svg_axes(&mut s, &f);
        for (i, series) in self.series.iter().enumerate() {
            svg_series(&mut s, &f, i, series);
        }
        s.push_str("</svg>\n");
        s
    }

    /// The plotted ranges of both axes, from every point's median and spread.
    fn frame(&self) -> Frame {
        let pts = || self.series.iter().flat_map(|s| s.points.iter());
        let xs: Vec<f64> = pts()
            .map(|p| p.x)
            .filter(|&x| finite(x, self.log_x))
            .collect();
        let ys: Vec<f64> = pts()
            .flat_map(|p| [p.y, p.lo, p.hi])
            .filter(|&y| finite(y, self.log_y))
            .collect();
        let (x0, x1) = axis_range(&xs, self.log_x, false);
        let (y0, y1) = axis_range(&ys, self.log_y, true);
        Frame {
            x0,
            x1,
            y0,
            y1,
            log_x: self.log_x,
            log_y: self.log_y,
        }
    }

    fn svg_axes(&self, s: &mut String, f: &Frame) {
        let ticks = |a: f64, b: f64, log: bool| -> Vec<f64> {
            if log {
                (a as i32..=b as i32).map(|e| 10f64.powi(e)).collect()
            } else {
                let step = (b - a) / 5.0;
                // whole-number axes (daemons, clients) get whole-number ticks
                let step = if a.fract() == 0.0 && step > 1.0 {
                    step.ceil()
                } else {
                    step
                };
                (0..=5)
                    .map(|i| a + step * f64::from(i))
                    .take_while(|&t| t <= b + 1e-9)
                    .collect()
            }
        };
        let _ = writeln!(
            s,
            r#"<path d="M{L},{T} V{} H{}" fill="none" stroke="black"/>"#,
            H - B,
            W - R
        );
        for t in ticks(f.x0, f.x1, f.log_x) {
            let x = f.px(t);
            let _ = writeln!(
                s,
                r##"<path d="M{x:.1},{} v5" stroke="black"/><text x="{x:.1}" y="{}" text-anchor="middle">{}</text>"##,
                H - B,
                H - B + 18.0,
                fmt_x(t)
            );
        }
        for t in ticks(f.y0, f.y1, f.log_y) {
            let y = f.py(t);
            let _ = writeln!(
                s,
                r##"<path d="M{L},{y:.1} h-5" stroke="black"/><path d="M{L},{y:.1} H{}" stroke="#ddd"/><text x="{}" y="{:.1}" text-anchor="end">{}</text>"##,
                W - R,
                L - 8.0,
                y + 4.0,
                fmt_num(t)
            );
        }
        let _ = writeln!(
            s,
            r#"<text x="{}" y="{}" text-anchor="middle">{}</text>"#,
            (L + W - R) / 2.0,
            H - 12.0,
            xml(&self.x_label)
        );
        let _ = writeln!(
            s,
            r#"<text transform="translate(16,{}) rotate(-90)" text-anchor="middle">{}</text>"#,
            (T + H - B) / 2.0,
            xml(&self.y_label)
        );
    }

    /// Print the table to stdout and, with a directory, write `<stem>.svg` and `<stem>.md`
    /// into it.
    ///
    /// # Errors
    /// When a file cannot be written (the message names it).
    pub fn emit(&self, plot_dir: Option<&Path>, stem: &str) -> Result<(), String> {
        println!("\n{}\n\n{}", self.title, self.table());
        if let Some(dir) = plot_dir {
            std::fs::create_dir_all(dir).map_err(|e| format!("create {}: {e}", dir.display()))?;
            for (ext, body) in [
                ("svg", self.svg()),
                ("md", format!("{}\n\n{}", self.title, self.table())),
            ] {
                let p = dir.join(format!("{stem}.{ext}"));
                std::fs::write(&p, body).map_err(|e| format!("write {}: {e}", p.display()))?;
            }
            eprintln!("kvd-bench: wrote {}/{stem}.svg and .md", dir.display());
        }
        Ok(())
    }
}

/// The plot's size and margins (left, right, top, bottom), in SVG units.
const W: f64 = 640.0;
const H: f64 = 400.0;
const L: f64 = 70.0;
const R: f64 = 20.0;
const T: f64 = 40.0;
const B: f64 = 55.0;
const COLOURS: [&str; 6] = [
    "#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b",
];

/// Whether a value can be plotted on an axis (positive on a log axis).
fn finite(v: f64, log: bool) -> bool {
    v.is_finite() && (!log || v > 0.0)
}

/// An axis's range: whole decades on a log axis, from zero (for y) with 5 % headroom on a
/// linear one.
fn axis_range(v: &[f64], log: bool, from_zero: bool) -> (f64, f64) {
    let lo = v.iter().copied().fold(f64::INFINITY, f64::min);
    let hi = v.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    if !lo.is_finite() {
        return (0.0, 1.0);
    }
    if log {
        let (a, b) = (lo.log10().floor(), hi.log10().ceil());
        (a, if b > a { b } else { a + 1.0 })
    } else {
        let lo = if from_zero { lo.min(0.0) } else { lo };
        let hi = if hi > lo { hi * 1.05 } else { lo + 1.0 };
        (lo, hi)
    }
}

/// The axes' ranges (log10 of them on a log axis) and the mapping into the plot.
struct Frame {
    x0: f64,
    x1: f64,
    y0: f64,
    y1: f64,
    log_x: bool,
    log_y: bool,
}

impl Frame {
    fn px(&self, x: f64) -> f64 {
        let v = if self.log_x { x.log10() } else { x };
        L + (v - self.x0) / (self.x1 - self.x0) * (W - L - R)
    }

    fn py(&self, y: f64) -> f64 {
        let v = if self.log_y { y.log10() } else { y };
        H - B - (v - self.y0) / (self.y1 - self.y0) * (H - T - B)
    }
}

/// One series: its line, a dot and a whisker per point, its legend entry.
fn svg_series(s: &mut String, f: &Frame, i: usize, series: &Series) {
    let c = COLOURS[i % COLOURS.len()];
    let ok: Vec<&Point> = series
        .points
        .iter()
        .filter(|p| finite(p.x, f.log_x) && finite(p.y, f.log_y))
        .collect();
    let d: Vec<String> = ok
        .iter()
        .enumerate()
        .map(|(j, p)| {
            format!(
                "{}{:.1},{:.1}",
                if j == 0 { "M" } else { "L" },
                f.px(p.x),
                f.py(p.y)
            )
        })
        .collect();
    let _ = writeln!(
        s,
        r#"<path d="{}" fill="none" stroke="{c}" stroke-width="2"/>"#,
        d.join(" ")
    );
    for p in ok {
        let _ = write!(
            s,
            r#"<circle cx="{:.1}" cy="{:.1}" r="3" fill="{c}"/>"#,
            f.px(p.x),
            f.py(p.y)
        );
        if finite(p.lo, f.log_y) && finite(p.hi, f.log_y) && p.lo < p.hi {
            let _ = write!(
                s,
                r#"<path d="M{:.1},{:.1} V{:.1}" stroke="{c}"/>"#,
                f.px(p.x),
                f.py(p.lo),
                f.py(p.hi)
            );
        }
        s.push('\n');
    }
    let ly = T + 8.0 + 16.0 * i as f64;
    let _ = writeln!(
        s,
        r#"<path d="M{},{ly} h18" stroke="{c}" stroke-width="2"/><text x="{}" y="{}">{}</text>"#,
        L + 12.0,
        L + 36.0,
        ly + 4.0,
        xml(&series.name)
    );
}

fn xml(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn curve() -> Curve {
        Curve {
            title: "t".into(),
            x_label: "blocks".into(),
            y_label: "µs".into(),
            log_x: true,
            log_y: false,
            series: vec![Series {
                name: "p50".into(),
                points: vec![
                    Point::of_runs(1000.0, &[3.0, 1.0, 2.0]),
                    Point::of_runs(1_000_000.0, &[5.0]),
                ],
            }],
        }
    }

    #[test]
    fn a_point_is_the_median_and_spread_of_its_runs() {
        let p = Point::of_runs(1.0, &[3.0, 1.0, 2.0]);
        assert_eq!((p.y, p.lo, p.hi), (2.0, 1.0, 3.0));
    }

    #[test]
    fn the_table_has_a_row_per_x_with_the_spread() {
        let t = curve().table();
        assert!(t.contains("| 1,000 | 2.00 (1.00..3.00) |"), "{t}");
        assert!(t.contains("| 1,000,000 | 5.00 |"), "{t}");
    }

    #[test]
    fn the_svg_draws_one_line_and_a_marker_per_point() {
        let s = curve().svg();
        assert!(s.starts_with("<svg"));
        assert_eq!(s.matches("<circle").count(), 2);
        assert!(s.trim_end().ends_with("</svg>"));
    }
}
