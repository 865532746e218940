//! What a run measures: per-request latencies, split into interrupted requests (on a worker
//! when it failed) and bystanders (never interrupted, but in the system during the failure
//! window), plus recovery time, capacity-restore time, recomputed tokens, checkpoint bytes and
//! peak host memory.
//!
//! - TTFT: arrival to first output token.
//! - TPOT: (last token - first token) / (output tokens - 1); requests with one output token
//!   have no TPOT.
//! - End-to-end: arrival to last token.
//! - Stall: for one interrupted request, failure to its next token (the first after the
//!   failure).
//! - Recovery time: failure to the moment the last interrupted request produced its next
//!   token: the largest stall.
//! - Capacity-restore time: failure to the moment the last failed worker serves the full model
//!   again.

use serde::{Deserialize, Serialize};

use super::events::{SimTime, us_to_secs};

/// What happened to one request.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct RequestOutcome {
    /// Arrival at the router.
    pub arrival_us: SimTime,
    /// Output tokens asked for.
    pub output_tokens: u32,
    /// Output tokens delivered.
    pub delivered_tokens: u32,
    /// First output token.
    pub first_token_us: Option<SimTime>,
    /// Last output token (the request completed).
    pub finish_us: Option<SimTime>,
    /// Whether a failure interrupted it.
    pub interrupted: bool,
    /// Its first token after the (first) failure that interrupted it.
    pub resumed_us: Option<SimTime>,
    /// Why it failed, if it did.
    pub failed: Option<String>,
}

impl RequestOutcome {
    /// TTFT in seconds, when it produced a token.
    pub fn ttft_s(&self) -> Option<f64> {
        self.first_token_us
            .map(|t| us_to_secs(t.saturating_sub(self.arrival_us)))
    }

    /// TPOT in seconds, when it completed with more than one token.
    pub fn tpot_s(&self) -> Option<f64> {
        match (self.first_token_us, self.finish_us) {
            (Some(a), Some(b)) if self.output_tokens > 1 => {
                Some(us_to_secs(b - a) / f64::from(self.output_tokens - 1))
            }
            _ => None,
        }
    }

    /// End-to-end latency in seconds, when it completed.
    pub fn e2e_s(&self) -> Option<f64> {
        self.finish_us
            .map(|t| us_to_secs(t.saturating_sub(self.arrival_us)))
    }
}

/// Mean and 99th percentile of a sample (both 0 for an empty one).
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct Summary {
    /// Values in the sample.
    pub count: usize,
    /// Arithmetic mean.
    pub mean: f64,
    /// 99th percentile (nearest rank).
    pub p99: f64,
}

impl Summary {
    /// Summarises `values` (sorted here; NaN never enters, every value is a finite time).
    pub fn of(mut values: Vec<f64>) -> Self {
        if values.is_empty() {
            return Summary::default();
        }
        values.sort_by(f64::total_cmp);
        let n = values.len();
        let mean = values.iter().sum::<f64>() / n as f64;
        // Nearest rank: the smallest value with at least 99 % of the sample at or below it.
        let rank = ((0.99 * n as f64).ceil() as usize).clamp(1, n);
        Summary {
            count: n,
            mean,
            p99: values[rank - 1],
        }
    }
}

/// TTFT, TPOT and end-to-end latency of one group of requests.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct Latencies {
    /// Time to first token, seconds.
    pub ttft: Summary,
    /// Time per output token, seconds.
    pub tpot: Summary,
    /// End-to-end latency, seconds.
    pub e2e: Summary,
}

impl Latencies {
    /// The latencies of the records `keep` selects.
    pub fn of<'a>(
        records: impl Iterator<Item = &'a RequestOutcome>,
        keep: impl Fn(&RequestOutcome) -> bool,
    ) -> Self {
        let (mut ttft, mut tpot, mut e2e) = (Vec::new(), Vec::new(), Vec::new());
        for r in records.filter(|r| keep(r)) {
            ttft.extend(r.ttft_s());
            tpot.extend(r.tpot_s());
            e2e.extend(r.e2e_s());
        }
        Latencies {
            ttft: Summary::of(ttft),
            tpot: Summary::of(tpot),
            e2e: Summary::of(e2e),
        }
    }
}

/// Everything one run of one policy reports.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct RunMetrics {
    /// Requests that arrived.
    pub requests: usize,
    /// Requests that completed.
    pub completed: usize,
    /// Requests that failed (no survivor, migration budget, simulated-time cap).
    pub failed: usize,
    /// Requests interrupted by a failure.
    pub interrupted: usize,
    /// Bystanders: never interrupted, in the system during the failure window.
    pub bystanders: usize,
    /// All completed requests.
    pub overall: Latencies,
    /// Interrupted requests.
    pub interrupted_lat: Latencies,
    /// Bystanders.
    pub bystander_lat: Latencies,
    /// Per interrupted request that resumed: failure to its next token, seconds.
    pub stall: Summary,
    /// Failure to the last interrupted request's next token, seconds (0 without failure):
    /// the largest stall.
    pub recovery_s: f64,
    /// Failure to the last failed worker back in full service, seconds (0 without failure, or
    /// when it was not back before the simulated-time cap).
    pub capacity_restore_s: f64,
    /// Tokens whose KV had been computed before a failure and was computed again.
    pub recomputed_tokens: u64,
    /// Checkpoint bytes streamed to holders.
    pub checkpoint_bytes: u64,
    /// Checkpoint bytes read back from holders over the network for remote restores.
    pub restore_network_bytes: u64,
    /// Checkpoint bytes copied host-to-GPU in restores.
    pub restore_h2d_bytes: u64,
    /// Peak host checkpoint memory on the busiest worker, bytes.
    pub peak_host_bytes_max: u64,
    /// Mean over workers of each worker's peak host checkpoint memory, bytes.
    pub peak_host_bytes_mean: f64,
    /// Requests that ran without a checkpoint because no holder had room (policies that
    /// checkpoint only).
    pub unplaced: u64,
    /// Output tokens asked for by completed requests.
    pub tokens_requested: u64,
    /// Output tokens delivered to completed requests.
    pub tokens_delivered: u64,
    /// Simulated seconds until the last request finished.
    pub makespan_s: f64,
    /// The recovery window's latencies beside the same requests' without the failure (filled
    /// by [`window_metrics`] when the run has a no-failure twin; zero otherwise).
    #[serde(default)]
    pub window: WindowMetrics,
    /// Events processed.
    pub events: u64,
}

/// TTFT and TPOT of one group of requests.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct TtftTpot {
    /// Requests in the group.
    pub requests: usize,
    /// Time to first token, seconds.
    pub ttft: Summary,
    /// Time per output token, seconds.
    pub tpot: Summary,
}

impl TtftTpot {
    fn of<'a>(records: impl Iterator<Item = &'a RequestOutcome>) -> Self {
        let (mut ttft, mut tpot, mut n) = (Vec::new(), Vec::new(), 0);
        for r in records {
            n += 1;
            ttft.extend(r.ttft_s());
            tpot.extend(r.tpot_s());
        }
        TtftTpot {
            requests: n,
            ttft: Summary::of(ttft),
            tpot: Summary::of(tpot),
        }
    }
}

/// The recovery window: from the first failure until the last failed worker is back in full
/// service (or the last arrival, when it never is). Its requests are those that arrive in it
/// and those the failure interrupted; its bystanders are its requests that were never
/// interrupted. Each figure stands beside the same requests' in the twin run: the same
/// arrivals without the failure and without checkpoints (StopRestart, a plain engine), and the
/// failure impact is the ratio of the two means (so a policy's impact includes what its
/// checkpoint streaming costs).
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct WindowMetrics {
    /// Length of the window, seconds.
    pub length_s: f64,
    /// Every request of the window, with the failure.
    pub all: TtftTpot,
    /// Its bystanders, with the failure.
    pub bystanders: TtftTpot,
    /// The same requests in the twin run (no failure, no checkpoints).
    pub base_all: TtftTpot,
    /// The same bystanders in the twin run.
    pub base_bystanders: TtftTpot,
    /// Mean TTFT with / without the failure, all requests of the window.
    pub impact_ttft: f64,
    /// Mean TPOT with / without the failure, all requests of the window.
    pub impact_tpot: f64,
    /// Mean TTFT with / without the failure, bystanders.
    pub bys_impact_ttft: f64,
    /// Mean TPOT with / without the failure, bystanders.
    pub bys_impact_tpot: f64,
}

fn ratio(a: f64, b: f64) -> f64 {
    if b > 0.0 { a / b } else { 0.0 }
}

/// The window metrics of a run (`with`) against the run of the same arrivals without its
/// failures (`without`, records in the same order). The window is `[from_us, to_us]`.
///
/// # Panics
/// If the two runs do not have the same requests.
pub fn window_metrics(
    with: &[RequestOutcome],
    without: &[RequestOutcome],
    from_us: SimTime,
    to_us: SimTime,
) -> WindowMetrics {
    assert_eq!(
        with.len(),
        without.len(),
        "twin runs have the same arrivals"
    );
    let in_window =
        |r: &RequestOutcome| r.interrupted || (r.arrival_us >= from_us && r.arrival_us <= to_us);
    let pick = |bystanders_only: bool| {
        with.iter()
            .zip(without)
            .filter(move |(w, _)| in_window(w) && !(bystanders_only && w.interrupted))
    };
    let all = TtftTpot::of(pick(false).map(|(w, _)| w));
    let bystanders = TtftTpot::of(pick(true).map(|(w, _)| w));
    let base_all = TtftTpot::of(pick(false).map(|(_, b)| b));
    let base_bystanders = TtftTpot::of(pick(true).map(|(_, b)| b));
    WindowMetrics {
        length_s: us_to_secs(to_us.saturating_sub(from_us)),
        impact_ttft: ratio(all.ttft.mean, base_all.ttft.mean),
        impact_tpot: ratio(all.tpot.mean, base_all.tpot.mean),
        bys_impact_ttft: ratio(bystanders.ttft.mean, base_bystanders.ttft.mean),
        bys_impact_tpot: ratio(bystanders.tpot.mean, base_bystanders.tpot.mean),
        all,
        bystanders,
        base_all,
        base_bystanders,
    }
}

/// Mean and 95 % confidence interval of the mean of a sample (Student's t; the interval is
/// the mean itself for fewer than two values).
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct Spread {
    /// The mean.
    pub mean: f64,
    /// Lower end of the 95 % interval.
    pub lo: f64,
    /// Upper end of the 95 % interval.
    pub hi: f64,
}

/// Two-sided 97.5 % quantiles of Student's t for 1 to 30 degrees of freedom (any statistics
/// table, e.g. NIST/SEMATECH e-Handbook of Statistical Methods, section 1.3.6.7.2).
const T975: [f64; 30] = [
    12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160,
    2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056,
    2.052, 2.048, 2.045, 2.042,
];

impl Spread {
    /// The spread of `values` (finite numbers).
    pub fn of(values: &[f64]) -> Self {
        let n = values.len();
        if n == 0 {
            return Spread::default();
        }
        let mean = values.iter().sum::<f64>() / n as f64;
        if n < 2 {
            return Spread {
                mean,
                lo: mean,
                hi: mean,
            };
        }
        let var = values.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / (n - 1) as f64;
        // Beyond 30 degrees of freedom the normal quantile is within 2 % of t.
        let t = T975.get(n - 2).copied().unwrap_or(1.960);
        let half = t * (var / n as f64).sqrt();
        Spread {
            mean,
            lo: mean - half,
            hi: mean + half,
        }
    }

    /// Whether this interval lies wholly below `other`'s.
    pub fn below(&self, other: &Spread) -> bool {
        self.hi < other.lo
    }
}

/// One point of a time series (per simulated second).
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct SeriesPoint {
    /// Start of the second.
    pub t_s: f64,
    /// Mean TTFT of the requests that arrived in this sample period (seconds; 0 when none
    /// produced a token).
    pub ttft_mean_s: f64,
    /// Requests waiting in queues, cluster-wide, at the sample.
    pub queued: usize,
    /// Host checkpoint bytes held, cluster-wide, at the sample.
    pub host_bytes: u64,
}

/// Mean TTFT of the requests arriving in each of `buckets` periods of `period_us`, for the
/// time-series plot.
pub fn ttft_by_arrival_period(
    records: &[RequestOutcome],
    period_us: SimTime,
    buckets: usize,
) -> Vec<f64> {
    let seconds = buckets;
    let period_us = period_us.max(1);
    let mut sum = vec![0.0f64; seconds];
    let mut n = vec![0u32; seconds];
    for r in records {
        let s = (r.arrival_us / period_us) as usize;
        if let (Some(t), true) = (r.ttft_s(), s < seconds) {
            sum[s] += t;
            n[s] += 1;
        }
    }
    sum.iter()
        .zip(&n)
        .map(|(s, &n)| if n == 0 { 0.0 } else { s / f64::from(n) })
        .collect()
}

/// The field-by-field mean of several runs' metrics (integer fields rounded to the nearest
/// integer): what a scenario repeated over several seeds reports.
///
/// # Panics
/// If `runs` is empty.
pub fn mean_metrics(runs: &[RunMetrics]) -> RunMetrics {
    assert!(!runs.is_empty(), "the mean of no runs");
    if runs.len() == 1 {
        return runs[0].clone();
    }
    let values: Vec<serde_json::Value> = runs
        .iter()
        .map(|m| serde_json::to_value(m).expect("metrics serialize"))
        .collect();
    let mean = mean_value(&values);
    serde_json::from_value(mean).expect("the mean has the shape of the metrics")
}

fn mean_value(vs: &[serde_json::Value]) -> serde_json::Value {
    use serde_json::Value;
    match &vs[0] {
        Value::Object(first) => {
            let mut out = serde_json::Map::new();
            for k in first.keys() {
                let field: Vec<Value> = vs.iter().map(|v| v[k.as_str()].clone()).collect();
                out.insert(k.clone(), mean_value(&field));
            }
            Value::Object(out)
        }
        Value::Number(n) => {
            let sum: f64 = vs.iter().map(|v| v.as_f64().unwrap_or(f64::NAN)).sum();
            let mean = sum / vs.len() as f64;
            if n.is_u64() {
                Value::from(mean.round() as u64)
            } else {
                serde_json::Number::from_f64(mean).map_or(Value::Null, Value::Number)
            }
        }
        other => other.clone(),
    }
}

/// The point-by-point mean of several series (as long as the shortest).
pub fn mean_series(series: &[Vec<SeriesPoint>]) -> Vec<SeriesPoint> {
    let n = series.iter().map(Vec::len).min().unwrap_or(0);
    let k = series.len().max(1) as f64;
    (0..n)
        .map(|i| SeriesPoint {
            t_s: series[0][i].t_s,
            ttft_mean_s: series.iter().map(|s| s[i].ttft_mean_s).sum::<f64>() / k,
            queued: (series.iter().map(|s| s[i].queued as f64).sum::<f64>() / k).round() as usize,
            host_bytes: (series.iter().map(|s| s[i].host_bytes as f64).sum::<f64>() / k).round()
                as u64,
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_mean_of_runs_averages_every_field() {
        let a = RunMetrics {
            requests: 10,
            recovery_s: 1.0,
            stall: Summary {
                count: 2,
                mean: 0.5,
                p99: 1.0,
            },
            ..Default::default()
        };
        let b = RunMetrics {
            requests: 13,
            recovery_s: 2.0,
            stall: Summary {
                count: 4,
                mean: 1.5,
                p99: 2.0,
            },
            ..Default::default()
        };
        let m = mean_metrics(&[a, b]);
        assert_eq!(m.requests, 12, "11.5 rounds to 12");
        assert_eq!(m.recovery_s, 1.5);
        assert_eq!(m.stall.count, 3);
        assert_eq!(m.stall.mean, 1.0);
        assert_eq!(m.stall.p99, 1.5);
    }

    #[test]
    fn the_window_takes_arrivals_in_it_and_the_interrupted_and_compares_them_with_their_twins() {
        let at = |arrival_s: f64, ttft_s: f64, interrupted: bool| RequestOutcome {
            arrival_us: (arrival_s * 1e6) as SimTime,
            output_tokens: 1,
            delivered_tokens: 1,
            first_token_us: Some(((arrival_s + ttft_s) * 1e6) as SimTime),
            finish_us: Some(((arrival_s + ttft_s) * 1e6) as SimTime),
            interrupted,
            ..Default::default()
        };
        // Window [10 s, 20 s]: the arrival at 15 s, and the request interrupted at 5 s.
        let with = [
            at(5.0, 2.0, true),
            at(15.0, 1.0, false),
            at(25.0, 0.5, false),
        ];
        let without = [
            at(5.0, 0.5, false),
            at(15.0, 0.25, false),
            at(25.0, 0.5, false),
        ];
        let w = window_metrics(&with, &without, 10_000_000, 20_000_000);
        assert_eq!((w.all.requests, w.bystanders.requests), (2, 1));
        assert_eq!(w.length_s, 10.0);
        assert!((w.all.ttft.mean - 1.5).abs() < 1e-9);
        assert!((w.base_all.ttft.mean - 0.375).abs() < 1e-9);
        assert!((w.impact_ttft - 4.0).abs() < 1e-9);
        assert!((w.bys_impact_ttft - 4.0).abs() < 1e-9, "1 s against 0.25 s");
    }

    #[test]
    fn the_spread_is_a_students_t_interval_of_the_mean() {
        // Ten values 1..10: mean 5.5, sample sd 3.0277, t(9) = 2.262 -> half-width 2.1659.
        let v: Vec<f64> = (1..=10).map(f64::from).collect();
        let s = Spread::of(&v);
        assert!((s.mean - 5.5).abs() < 1e-12);
        assert!((s.hi - s.mean - 2.262 * (55.0f64 / 6.0).sqrt() / 10f64.sqrt()).abs() < 1e-9);
        assert!(Spread::of(&[1.0, 1.1]).below(&Spread::of(&[50.0, 50.1])));
        assert_eq!(
            Spread::of(&[3.0]),
            Spread {
                mean: 3.0,
                lo: 3.0,
                hi: 3.0
            }
        );
    }

    #[test]
    fn the_p99_is_the_nearest_rank() {
        let s = Summary::of((1..=100).map(f64::from).collect());
        assert_eq!(s.count, 100);
        assert_eq!(s.p99, 99.0);
        assert!((s.mean - 50.5).abs() < 1e-12);
        let s = Summary::of(vec![3.0]);
        assert_eq!((s.mean, s.p99), (3.0, 3.0));
        assert_eq!(Summary::of(vec![]), Summary::default());
    }

    #[test]
    fn tpot_spreads_the_decode_time_over_all_tokens_after_the_first() {
        let r = RequestOutcome {
            arrival_us: 1_000_000,
            output_tokens: 11,
            delivered_tokens: 11,
            first_token_us: Some(1_500_000),
            finish_us: Some(2_500_000),
            ..Default::default()
        };
        assert_eq!(r.ttft_s(), Some(0.5));
        assert_eq!(r.tpot_s(), Some(0.1));
        assert_eq!(r.e2e_s(), Some(1.5));
    }
}
