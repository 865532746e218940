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
    /// Events processed.
    pub events: u64,
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
