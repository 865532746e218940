//! What a sweep writes: one CSV per experiment (one row per scenario and policy), one CSV of
//! time series per experiment, a Markdown summary with each policy's change against
//! StopRestart, and PNG plots (bars per policy; mean TTFT over time around the failure).
//!
//! Everything is written in a fixed order with fixed number formats, so the same seed gives
//! byte-identical CSV and Markdown.
//!
//! Plots render their text with a TrueType font read at run time (DejaVu Sans from Debian's
//! `fonts-dejavu-core`, or the file named by `KVD_SIM_FONT`); without a font the plots are
//! skipped with a note, and the CSV and Markdown are still written.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use plotters::prelude::*;

use super::experiments::BASELINE;
use super::experiments::{Experiment, ScenarioResult};
use super::metrics::{Latencies, RunMetrics, Spread};
use kvd_control::PolicyKind;

/// The CSV header of [`metrics_csv`].
pub const CSV_HEADER: &str = "experiment,scenario,model,workers,load,failed_workers,policy,\
seeds,rate_per_s,requests,completed,failed,interrupted,bystanders,\
ttft_mean_s,ttft_p99_s,tpot_mean_s,tpot_p99_s,e2e_mean_s,e2e_p99_s,\
int_ttft_mean_s,int_ttft_p99_s,int_tpot_mean_s,int_tpot_p99_s,int_e2e_mean_s,int_e2e_p99_s,\
bys_ttft_mean_s,bys_ttft_p99_s,bys_tpot_mean_s,bys_tpot_p99_s,bys_e2e_mean_s,bys_e2e_p99_s,\
stall_mean_s,stall_p99_s,recovery_s,capacity_restore_s,recomputed_tokens,checkpoint_bytes,restore_network_bytes,\
restore_h2d_bytes,peak_host_bytes_max,peak_host_bytes_mean,unplaced,tokens_requested,\
tokens_delivered,makespan_s,events,\
win_length_s,win_requests,win_bystanders,win_ttft_mean_s,win_ttft_p99_s,win_tpot_mean_s,win_tpot_p99_s,\
win_bys_ttft_mean_s,win_bys_ttft_p99_s,win_bys_tpot_mean_s,win_bys_tpot_p99_s,\
base_win_ttft_mean_s,base_win_tpot_mean_s,base_win_bys_ttft_mean_s,base_win_bys_tpot_mean_s,\
impact_ttft,impact_tpot,bys_impact_ttft,bys_impact_tpot,\
stall_mean_lo_s,stall_mean_hi_s,recovery_lo_s,recovery_hi_s,win_ttft_mean_lo_s,win_ttft_mean_hi_s,\
bys_impact_ttft_lo,bys_impact_ttft_hi,bys_impact_tpot_lo,bys_impact_tpot_hi";

/// The metrics reported with their spread over the seeds, by name.
pub type Pick = fn(&RunMetrics) -> f64;
/// Mean stall of the interrupted requests.
pub const STALL: Pick = |m| m.stall.mean;
/// Recovery time.
pub const RECOVERY: Pick = |m| m.recovery_s;
/// Mean TTFT of the recovery window's requests.
pub const WINDOW_TTFT: Pick = |m| m.window.all.ttft.mean;
/// Bystanders' failure impact on mean TTFT.
pub const BYS_IMPACT_TTFT: Pick = |m| m.window.bys_impact_ttft;
/// Bystanders' failure impact on mean TPOT.
pub const BYS_IMPACT_TPOT: Pick = |m| m.window.bys_impact_tpot;

fn window_cols(out: &mut String, r: &ScenarioResult, p: PolicyKind, m: &RunMetrics) {
    let w = &m.window;
    let _ = write!(
        out,
        ",{:.3},{},{},{:.6},{:.6},{:.6},{:.6},{:.6},{:.6},{:.6},{:.6},{:.6},{:.6},{:.6},{:.6},{:.4},{:.4},{:.4},{:.4}",
        w.length_s,
        w.all.requests,
        w.bystanders.requests,
        w.all.ttft.mean,
        w.all.ttft.p99,
        w.all.tpot.mean,
        w.all.tpot.p99,
        w.bystanders.ttft.mean,
        w.bystanders.ttft.p99,
        w.bystanders.tpot.mean,
        w.bystanders.tpot.p99,
        w.base_all.ttft.mean,
        w.base_all.tpot.mean,
        w.base_bystanders.ttft.mean,
        w.base_bystanders.tpot.mean,
        w.impact_ttft,
        w.impact_tpot,
        w.bys_impact_ttft,
        w.bys_impact_tpot,
    );
    for (pick, digits) in [
        (STALL, 6),
        (RECOVERY, 6),
        (WINDOW_TTFT, 6),
        (BYS_IMPACT_TTFT, 4),
        (BYS_IMPACT_TPOT, 4),
    ] {
        let s = r.spread(p, pick);
        let _ = write!(out, ",{:.digits$},{:.digits$}", s.lo, s.hi);
    }
}

fn lat(out: &mut String, l: &Latencies) {
    for s in [l.ttft, l.tpot, l.e2e] {
        let _ = write!(out, ",{:.6},{:.6}", s.mean, s.p99);
    }
}

/// One experiment's results as CSV (header plus one row per scenario and policy).
pub fn metrics_csv(exp: Experiment, results: &[ScenarioResult]) -> String {
    let mut out = String::from(CSV_HEADER);
    out.push('\n');
    for r in results {
        let sc = &r.scenario;
        let failed: Vec<String> = sc
            .failures
            .iter()
            .flat_map(|f| f.workers.iter().map(|w| w.to_string()))
            .collect();
        for (p, o) in &r.runs {
            let m = &o.metrics;
            let _ = write!(
                out,
                "{},{},{},{},{:.2},{},{},{},{:.4},{},{},{},{},{}",
                exp.name(),
                sc.label,
                sc.cluster.model.name,
                sc.cluster.workers,
                sc.load,
                failed.join(" "),
                p.name(),
                r.repeats,
                r.rate_per_s,
                m.requests,
                m.completed,
                m.failed,
                m.interrupted,
                m.bystanders,
            );
            lat(&mut out, &m.overall);
            lat(&mut out, &m.interrupted_lat);
            lat(&mut out, &m.bystander_lat);
            let _ = write!(
                out,
                ",{:.6},{:.6},{:.6},{:.6},{},{},{},{},{},{:.0},{},{},{},{:.6},{}",
                m.stall.mean,
                m.stall.p99,
                m.recovery_s,
                m.capacity_restore_s,
                m.recomputed_tokens,
                m.checkpoint_bytes,
                m.restore_network_bytes,
                m.restore_h2d_bytes,
                m.peak_host_bytes_max,
                m.peak_host_bytes_mean,
                m.unplaced,
                m.tokens_requested,
                m.tokens_delivered,
                m.makespan_s,
                m.events,
            );
            window_cols(&mut out, r, *p, m);
            out.push('\n');
        }
    }
    out
}

/// One experiment's time series as CSV: per scenario, policy and simulated second, the mean
/// TTFT of the requests that arrived in that second, the queued requests and the host bytes.
pub fn series_csv(exp: Experiment, results: &[ScenarioResult]) -> String {
    let mut out = String::from("experiment,scenario,policy,t_s,ttft_mean_s,queued,host_bytes\n");
    for r in results {
        for (p, o) in &r.runs {
            for s in &o.series {
                let _ = writeln!(
                    out,
                    "{},{},{},{:.3},{:.6},{},{}",
                    exp.name(),
                    r.scenario.label,
                    p.name(),
                    s.t_s,
                    s.ttft_mean_s,
                    s.queued,
                    s.host_bytes
                );
            }
        }
    }
    out
}

/// `value` with its relative change against `base` ("1.23 (-45 %)"); the baseline itself
/// without.
fn vs(value: f64, base: f64, is_base: bool, digits: usize) -> String {
    if is_base {
        return format!("{value:.digits$}");
    }
    if base.abs() < 1e-12 {
        return format!("{value:.digits$} (n/a)");
    }
    let pct = (value - base) / base * 100.0;
    format!("{value:.digits$} ({pct:+.0} %)")
}

/// `mean [lo, hi]` of a spread.
fn ci(s: Spread, digits: usize) -> String {
    format!("{:.digits$} [{:.digits$}, {:.digits$}]", s.mean, s.lo, s.hi)
}

/// How `lumen`'s interval sits against `other`'s: below, above, or overlapping (no claim).
fn verdict(lumen: Spread, other: Spread) -> &'static str {
    if lumen.below(&other) {
        "below"
    } else if other.below(&lumen) {
        "**above**"
    } else {
        "overlaps"
    }
}

/// The Markdown summary of every experiment run: per scenario and policy, the recovery
/// window's TTFT and TPOT (all requests and bystanders) with their failure impact against the
/// same arrivals without the failure, the whole-run TTFT beside them, the stall and recovery
/// time of the interrupted requests (mean and 95 % interval over the seeds), recomputation
/// and memory; then, per scenario, where Lumen's intervals lie against the others'.
pub fn summary_markdown(all: &BTreeMap<Experiment, Vec<ScenarioResult>>) -> String {
    let mut out = String::new();
    for (exp, results) in all {
        let _ = writeln!(out, "### Experiment {}: {}\n", exp.name(), exp.title());
        let seeds = results.first().map_or(0, |r| r.repeats);
        let _ = writeln!(
            out,
            "Means over {seeds} seeds, 95 % intervals in brackets. Window: failure until the \
             failed workers serve again; impact: window mean / the same requests' mean without \
             the failure.\n"
        );
        out.push_str(
            "| scenario | policy | stall mean (s) | recovery (s) | window TTFT mean (s) | \
             window TTFT p99 (s) | window TPOT mean / p99 (ms) | bystanders: impact TTFT | \
             impact TPOT | whole-run TTFT mean (s) | recomputed tokens | peak host GB |\n",
        );
        out.push_str("|---|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|\n");
        for r in results {
            for (p, o) in &r.runs {
                let m: &RunMetrics = &o.metrics;
                let w = &m.window;
                let _ = writeln!(
                    out,
                    "| {} | {} | {} | {} | {} | {:.2} | {:.1} / {:.1} | {} | {} | {:.3} | {} | {:.1} |",
                    r.scenario.label,
                    p.name(),
                    ci(r.spread(*p, STALL), 3),
                    ci(r.spread(*p, RECOVERY), 2),
                    ci(r.spread(*p, WINDOW_TTFT), 3),
                    w.all.ttft.p99,
                    w.all.tpot.mean * 1e3,
                    w.all.tpot.p99 * 1e3,
                    ci(r.spread(*p, BYS_IMPACT_TTFT), 2),
                    ci(r.spread(*p, BYS_IMPACT_TPOT), 2),
                    m.overall.ttft.mean,
                    m.recomputed_tokens,
                    m.peak_host_bytes_max as f64 / 1e9,
                );
            }
        }
        out.push('\n');
        out.push_str(&verdict_table(results));
        out.push('\n');
    }
    out
}

/// Per scenario: Lumen's interval against FixedRing's and StopRestart's for the stall, the
/// recovery time and the window's mean TTFT ("below" is a claim; "overlaps" is none).
fn verdict_table(results: &[ScenarioResult]) -> String {
    let mut out = String::from(
        "| scenario | stall vs fixed_ring | vs stop_restart | recovery vs fixed_ring | \
         vs stop_restart | window TTFT vs fixed_ring | vs stop_restart |\n|---|---|---|---|---|---|---|\n",
    );
    for r in results {
        if r.metrics(PolicyKind::Lumen).is_none() {
            continue;
        }
        let mut cells = Vec::new();
        for pick in [STALL, RECOVERY, WINDOW_TTFT] {
            let l = r.spread(PolicyKind::Lumen, pick);
            for other in [PolicyKind::FixedRing, BASELINE] {
                cells.push(if r.metrics(other).is_some() {
                    verdict(l, r.spread(other, pick))
                } else {
                    "-"
                });
            }
        }
        let _ = writeln!(out, "| {} | {} |", r.scenario.label, cells.join(" | "));
    }
    out
}

/// A short fixed-width table for the terminal: per scenario and policy, interrupted TTFT p99,
/// recovery time, and their change against StopRestart.
pub fn terminal_table(all: &BTreeMap<Experiment, Vec<ScenarioResult>>) -> String {
    let mut out = format!(
        "{:<4} {:<8} {:<19} {:>6} {:>16} {:>16} {:>16}\n",
        "exp", "scenario", "policy", "inter.", "stall mean (s)", "recovery (s)", "TTFT p99 all (s)"
    );
    for (exp, results) in all {
        for r in results {
            let Some(base) = r.metrics(BASELINE) else {
                continue;
            };
            for (p, o) in &r.runs {
                let m = &o.metrics;
                let b = *p == BASELINE;
                let _ = writeln!(
                    out,
                    "{:<4} {:<8} {:<19} {:>6} {:>16} {:>16} {:>16}",
                    exp.name(),
                    r.scenario.label,
                    p.name(),
                    m.interrupted,
                    vs(m.stall.mean, base.stall.mean, b, 3),
                    vs(m.recovery_s, base.recovery_s, b, 2),
                    vs(m.overall.ttft.p99, base.overall.ttft.p99, b, 2),
                );
            }
        }
    }
    out
}

/// Writes `<dir>/<exp>.csv`, `<dir>/<exp>_series.csv`, `<dir>/summary.md` and, when a font is
/// found, `<dir>/<exp>_bars.png` and `<dir>/<exp>_timeline.png`. Returns the files written and
/// notes (a plot skipped, and why).
///
/// # Errors
/// [`crate::Error::Io`] when the directory or a file cannot be written.
pub fn write_all(
    dir: &Path,
    all: &BTreeMap<Experiment, Vec<ScenarioResult>>,
    plots: bool,
) -> crate::Result<(Vec<PathBuf>, Vec<String>)> {
    std::fs::create_dir_all(dir).map_err(|e| {
        crate::Error::Io(format!(
            "cannot create the output directory {}: {e}; pass --out with a writable path",
            dir.display()
        ))
    })?;
    let mut files = Vec::new();
    let mut notes = Vec::new();
    let write = |path: PathBuf, text: &str, files: &mut Vec<PathBuf>| -> crate::Result<()> {
        std::fs::write(&path, text)
            .map_err(|e| crate::Error::Io(format!("cannot write {}: {e}", path.display())))?;
        files.push(path);
        Ok(())
    };
    for (exp, results) in all {
        write(
            dir.join(format!("{}.csv", exp.name())),
            &metrics_csv(*exp, results),
            &mut files,
        )?;
        write(
            dir.join(format!("{}_series.csv", exp.name())),
            &series_csv(*exp, results),
            &mut files,
        )?;
        if results.iter().any(|r| !r.traces.is_empty()) {
            let rows: Vec<(String, Vec<crate::trace::RecoveryTrace>)> = results
                .iter()
                .flat_map(|r| {
                    r.traces.iter().map(|(p, seed, t)| {
                        (
                            format!("{},{},{p},{seed}", exp.name(), r.scenario.label),
                            t.clone(),
                        )
                    })
                })
                .collect();
            write(
                dir.join(format!("{}_trace.csv", exp.name())),
                &crate::trace::trace_csv("experiment,scenario,policy,seed", &rows),
                &mut files,
            )?;
        }
    }
    write(dir.join("summary.md"), &summary_markdown(all), &mut files)?;
    if plots {
        match ensure_font() {
            Ok(()) => {
                for (exp, results) in all {
                    let p = dir.join(format!("{}_bars.png", exp.name()));
                    bars_png(&p, *exp, results)?;
                    files.push(p);
                    let p = dir.join(format!("{}_timeline.png", exp.name()));
                    timeline_png(&p, *exp, results)?;
                    files.push(p);
                }
            }
            Err(why) => notes.push(format!("PNG plots skipped: {why}")),
        }
    }
    Ok((files, notes))
}

const FONT_CANDIDATES: &[&str] = &[
    "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf",
    "/usr/share/fonts/dejavu/DejaVuSans.ttf",
    "/usr/share/fonts/TTF/DejaVuSans.ttf",
    "/usr/share/fonts/dejavu-sans-fonts/DejaVuSans.ttf",
    "/usr/share/fonts/truetype/liberation/LiberationSans-Regular.ttf",
];

/// Registers a TrueType font with plotters once per process.
fn ensure_font() -> Result<(), String> {
    static FONT: std::sync::OnceLock<Result<(), String>> = std::sync::OnceLock::new();
    FONT.get_or_init(|| {
        let mut candidates: Vec<PathBuf> = Vec::new();
        if let Some(p) = std::env::var_os("KVD_SIM_FONT") {
            candidates.push(p.into());
        }
        candidates.extend(FONT_CANDIDATES.iter().map(PathBuf::from));
        for path in &candidates {
            let Ok(bytes) = std::fs::read(path) else {
                continue;
            };
            // plotters keeps fonts for the life of the process; leaking one file once is that.
            let bytes: &'static [u8] = Box::leak(bytes.into_boxed_slice());
            if plotters::style::register_font("sans-serif", FontStyle::Normal, bytes).is_ok() {
                return Ok(());
            }
        }
        Err(format!(
            "no TrueType font found (tried KVD_SIM_FONT and {}); install fonts-dejavu-core or \
             set KVD_SIM_FONT=/path/to/font.ttf",
            FONT_CANDIDATES.join(", ")
        ))
    })
    .clone()
}

fn policy_color(p: PolicyKind) -> RGBColor {
    match p {
        PolicyKind::Lumen => RGBColor(31, 119, 180),
        PolicyKind::FixedRing => RGBColor(255, 127, 14),
        PolicyKind::StopRestart => RGBColor(127, 127, 127),
        PolicyKind::LumenMean => RGBColor(148, 103, 189),
        PolicyKind::LumenTotal => RGBColor(44, 160, 44),
    }
}

fn plot_err(path: &Path, e: impl std::fmt::Display) -> crate::Error {
    crate::Error::Io(format!("cannot draw {}: {e}", path.display()))
}

/// Grouped bars: per scenario, one bar per policy, for the interrupted requests' TTFT p99 and
/// the recovery time.
fn bars_png(path: &Path, exp: Experiment, results: &[ScenarioResult]) -> crate::Result<()> {
    let root = BitMapBackend::new(path, (1650, 420)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| plot_err(path, e))?;
    let root = root
        .titled(
            &format!("Experiment {}: {}", exp.name(), exp.title()),
            ("sans-serif", 17),
        )
        .map_err(|e| plot_err(path, e))?;
    let (left, rest) = root.split_horizontally(550);
    let (middle, right) = rest.split_horizontally(550);
    let panels: [(&DrawingArea<BitMapBackend<'_>, _>, &str, Pick); 3] = [
        (
            &left,
            "mean stall of interrupted requests: failure to next token (s)",
            STALL,
        ),
        (
            &middle,
            "recovery time: failure to the last one's next token (s)",
            RECOVERY,
        ),
        (
            &right,
            "bystanders' failure impact on mean TTFT in the window (x)",
            BYS_IMPACT_TTFT,
        ),
    ];
    let policies: Vec<PolicyKind> = results
        .first()
        .map(|r| r.runs.iter().map(|(p, _)| *p).collect())
        .unwrap_or_default();
    let labels: Vec<String> = results.iter().map(|r| r.scenario.label.clone()).collect();
    for (area, title, pick) in panels {
        bars_panel(path, area, title, pick, results, &labels, &policies)?;
    }
    root.present().map_err(|e| plot_err(path, e))?;
    Ok(())
}

/// One panel of [`bars_png`]: per scenario a group of bars (one per policy, the mean over the
/// seeds) with the 95 % interval as a whisker.
fn bars_panel(
    path: &Path,
    area: &DrawingArea<BitMapBackend<'_>, plotters::coord::Shift>,
    title: &str,
    pick: Pick,
    results: &[ScenarioResult],
    labels: &[String],
    policies: &[PolicyKind],
) -> crate::Result<()> {
    let groups = results.len().max(1) as i32;
    // Each scenario is a group of one bar per policy and a gap, `width` x units; each bar is
    // two units wide, so a whisker can sit at its middle.
    let width = 2 * policies.len() as i32 + 2;
    let ymax = results
        .iter()
        .flat_map(|r| r.runs.iter().map(|(p, _)| r.spread(*p, pick).hi))
        .fold(0.0f64, f64::max)
        .max(1e-3)
        * 1.15;
    let mut chart = ChartBuilder::on(area)
        .caption(title, ("sans-serif", 15))
        .margin(10)
        .x_label_area_size(30)
        .y_label_area_size(50)
        .build_cartesian_2d(0..groups * width, 0.0..ymax)
        .map_err(|e| plot_err(path, e))?;
    let fmt = |x: &i32| {
        if x.rem_euclid(width) == width / 2 {
            labels
                .get((x / width) as usize)
                .cloned()
                .unwrap_or_default()
        } else {
            String::new()
        }
    };
    chart
        .configure_mesh()
        .disable_x_mesh()
        .light_line_style(WHITE)
        .x_labels((groups * width) as usize + 1)
        .x_label_formatter(&fmt)
        .y_label_style(("sans-serif", 12))
        .x_label_style(("sans-serif", 12))
        .draw()
        .map_err(|e| plot_err(path, e))?;
    for (pi, p) in policies.iter().enumerate() {
        let color = policy_color(*p);
        let bars = results.iter().enumerate().filter_map(|(g, r)| {
            let m = r.metrics(*p)?;
            let x0 = g as i32 * width + 2 * pi as i32 + 1;
            Some(Rectangle::new(
                [(x0, 0.0), (x0 + 2, pick(m))],
                color.filled(),
            ))
        });
        chart
            .draw_series(bars)
            .map_err(|e| plot_err(path, e))?
            .label(p.name())
            .legend(move |(x, y)| Rectangle::new([(x, y - 5), (x + 12, y + 5)], color.filled()));
        // The 95 % interval over the seeds, as a whisker over each bar.
        let whiskers = results.iter().enumerate().map(|(g, r)| {
            let s = r.spread(*p, pick);
            let x = g as i32 * width + 2 * pi as i32 + 2;
            PathElement::new(vec![(x, s.lo.max(0.0)), (x, s.hi)], BLACK.stroke_width(2))
        });
        chart.draw_series(whiskers).map_err(|e| plot_err(path, e))?;
    }
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .label_font(("sans-serif", 12))
        .position(SeriesLabelPosition::UpperLeft)
        .draw()
        .map_err(|e| plot_err(path, e))?;
    Ok(())
}

/// Mean TTFT by arrival second around the failure, one line per policy, for the first and the
/// last scenario of the experiment.
fn timeline_png(path: &Path, exp: Experiment, results: &[ScenarioResult]) -> crate::Result<()> {
    let mut picked: Vec<&ScenarioResult> = results.iter().take(1).collect();
    if results.len() > 1 {
        picked.push(&results[results.len() - 1]);
    }
    let root = BitMapBackend::new(path, (1100, 420)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| plot_err(path, e))?;
    let root = root
        .titled(
            &format!(
                "Experiment {}: mean TTFT by arrival time around the failure",
                exp.name()
            ),
            ("sans-serif", 17),
        )
        .map_err(|e| plot_err(path, e))?;
    let areas = root.split_evenly((1, picked.len().max(1)));
    for (area, r) in areas.iter().zip(picked) {
        let fail_s = r.scenario.failures.first().map_or(0.0, |f| f.at_s);
        let (lo, hi) = ((fail_s - 20.0).max(0.0), fail_s + 100.0);
        let ymax = r
            .runs
            .iter()
            .flat_map(|(_, o)| o.series.iter())
            .filter(|s| s.t_s >= lo && s.t_s <= hi)
            .map(|s| s.ttft_mean_s)
            .fold(0.0f64, f64::max)
            .max(1e-3)
            * 1.1;
        let mut chart = ChartBuilder::on(area)
            .caption(
                format!(
                    "{} ({} workers, failure at {:.0} s)",
                    r.scenario.label, r.scenario.cluster.workers, fail_s
                ),
                ("sans-serif", 15),
            )
            .margin(10)
            .x_label_area_size(35)
            .y_label_area_size(50)
            .build_cartesian_2d(lo..hi, 0.0..ymax)
            .map_err(|e| plot_err(path, e))?;
        chart
            .configure_mesh()
            .light_line_style(WHITE)
            .x_desc("arrival time (s)")
            .y_desc("mean TTFT (s)")
            .label_style(("sans-serif", 12))
            .draw()
            .map_err(|e| plot_err(path, e))?;
        for (p, o) in &r.runs {
            let color = policy_color(*p);
            let pts = o
                .series
                .iter()
                .filter(|s| s.t_s >= lo && s.t_s <= hi)
                .map(|s| (s.t_s, s.ttft_mean_s));
            chart
                .draw_series(LineSeries::new(pts, color.stroke_width(2)))
                .map_err(|e| plot_err(path, e))?
                .label(p.name())
                .legend(move |(x, y)| {
                    PathElement::new(vec![(x, y), (x + 14, y)], color.stroke_width(2))
                });
        }
        chart
            .draw_series(std::iter::once(PathElement::new(
                vec![(fail_s, 0.0), (fail_s, ymax)],
                RED.stroke_width(1),
            )))
            .map_err(|e| plot_err(path, e))?;
        chart
            .configure_series_labels()
            .background_style(WHITE.mix(0.8))
            .border_style(BLACK)
            .label_font(("sans-serif", 12))
            .position(SeriesLabelPosition::UpperRight)
            .draw()
            .map_err(|e| plot_err(path, e))?;
    }
    root.present().map_err(|e| plot_err(path, e))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_change_is_shown_against_the_baseline() {
        assert_eq!(vs(0.5, 1.0, false, 2), "0.50 (-50 %)");
        assert_eq!(vs(1.0, 1.0, true, 2), "1.00");
        assert_eq!(vs(1.0, 0.0, false, 1), "1.0 (n/a)");
    }
}
