//! The workload: Poisson arrivals of requests whose prompt and output lengths follow a
//! conversation-trace shape.
//!
//! Lengths are drawn by inverse transform from an empirical quantile table, interpolated
//! linearly in log space between anchors (what trace-driven simulators do with a CDF taken from
//! a trace). The anchors are fitted so that the distribution has the moments the issue names:
//! prompts with median 1,000, mean about 1,150, p99 4,100 tokens; outputs with median 130,
//! mean about 210, p99 600 tokens. The test `the_length_distributions_match_the_stated_moments`
//! shows the fit on 200,000 samples.
//!
//! The whole arrival list is generated up front from the seed, so every policy in a comparison
//! sees exactly the same requests at exactly the same times.

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use rand_distr::{Distribution, Exp};
use serde::Serialize;

use super::events::{SimTime, secs_to_us};

/// `(cumulative probability, tokens)` anchors of the prompt-length quantile function.
pub const PROMPT_QUANTILES: &[(f64, f64)] = &[
    (0.0, 16.0),
    (0.05, 180.0),
    (0.25, 560.0),
    (0.5, 1000.0),
    (0.75, 1465.0),
    (0.9, 2200.0),
    (0.97, 3150.0),
    (0.99, 4100.0),
    (1.0, 8000.0),
];

/// `(cumulative probability, tokens)` anchors of the output-length quantile function.
pub const OUTPUT_QUANTILES: &[(f64, f64)] = &[
    (0.0, 2.0),
    (0.05, 12.0),
    (0.25, 52.0),
    (0.5, 130.0),
    (0.75, 360.0),
    (0.9, 560.0),
    (0.97, 590.0),
    (0.99, 600.0),
    (1.0, 1000.0),
];

/// A length distribution given by its quantile anchors.
#[derive(Debug, Clone, Copy)]
pub struct QuantileTable {
    anchors: &'static [(f64, f64)],
}

impl QuantileTable {
    /// The table of `anchors`, which must start at probability 0, end at 1, increase in both
    /// columns and hold positive token counts.
    ///
    /// # Panics
    /// If the anchors are not so (a programming error in a constant table).
    pub fn new(anchors: &'static [(f64, f64)]) -> Self {
        assert!(anchors.len() >= 2, "a quantile table needs two anchors");
        assert_eq!(anchors[0].0, 0.0, "the first anchor is at probability 0");
        assert_eq!(anchors[anchors.len() - 1].0, 1.0, "the last anchor is at 1");
        for w in anchors.windows(2) {
            assert!(w[0].0 < w[1].0 && w[0].1 <= w[1].1 && w[0].1 > 0.0);
        }
        QuantileTable { anchors }
    }

    /// The quantile at probability `u` in `[0, 1]`, in tokens (not rounded).
    pub fn quantile(&self, u: f64) -> f64 {
        let u = u.clamp(0.0, 1.0);
        for w in self.anchors.windows(2) {
            let ((p0, v0), (p1, v1)) = (w[0], w[1]);
            if u <= p1 {
                let t = (u - p0) / (p1 - p0);
                return (v0.ln() + t * (v1.ln() - v0.ln())).exp();
            }
        }
        self.anchors[self.anchors.len() - 1].1
    }

    /// One draw, rounded to whole tokens, at least 1.
    pub fn sample(&self, rng: &mut impl Rng) -> u32 {
        let u: f64 = rng.random();
        (self.quantile(u).round() as u32).max(1)
    }
}

/// One request of the workload.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct RequestSpec {
    /// Index in arrival order.
    pub id: usize,
    /// Arrival time at the router.
    pub arrival_us: SimTime,
    /// Prompt tokens.
    pub prompt_tokens: u32,
    /// Output tokens the request will generate (known to the simulator, not to the policies).
    pub output_tokens: u32,
}

/// What to generate.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct WorkloadConfig {
    /// Mean arrivals per second (Poisson).
    pub rate_per_s: f64,
    /// Arrivals stop at this time.
    pub duration_s: f64,
    /// The seed of the ChaCha8 stream.
    pub seed: u64,
}

/// Generates the arrival list for `cfg`: Poisson arrivals in `[0, duration)`, lengths from the
/// conversation-trace tables. Identical for identical configs.
///
/// # Errors
/// [`crate::Error::InvalidArgument`] for a non-positive rate or duration, or more than
/// `max_requests` requests expected.
pub fn generate(cfg: &WorkloadConfig, max_requests: usize) -> crate::Result<Vec<RequestSpec>> {
    if !(cfg.rate_per_s.is_finite() && cfg.rate_per_s > 0.0) {
        return Err(crate::Error::InvalidArgument(format!(
            "workload: the arrival rate must be positive, got {}",
            cfg.rate_per_s
        )));
    }
    if !(cfg.duration_s.is_finite() && cfg.duration_s > 0.0) {
        return Err(crate::Error::InvalidArgument(format!(
            "workload: the duration must be positive, got {} s",
            cfg.duration_s
        )));
    }
    let expected = cfg.rate_per_s * cfg.duration_s;
    if expected > max_requests as f64 {
        return Err(crate::Error::InvalidArgument(format!(
            "workload: {expected:.0} requests expected, over the cap of {max_requests}; \
             lower the load or the duration"
        )));
    }
    let mut rng = ChaCha8Rng::seed_from_u64(cfg.seed);
    let gap = Exp::new(cfg.rate_per_s).map_err(|e| {
        crate::Error::InvalidArgument(format!("workload: arrival rate {}: {e}", cfg.rate_per_s))
    })?;
    let prompts = QuantileTable::new(PROMPT_QUANTILES);
    let outputs = QuantileTable::new(OUTPUT_QUANTILES);
    let end_us = secs_to_us(cfg.duration_s);
    let mut t_s = 0.0f64;
    let mut out = Vec::with_capacity(expected as usize + 16);
    // Bounded: the cap is checked on every step.
    loop {
        t_s += gap.sample(&mut rng);
        let arrival_us = secs_to_us(t_s);
        if arrival_us >= end_us {
            break;
        }
        if out.len() >= max_requests {
            return Err(crate::Error::InvalidArgument(format!(
                "workload: more than {max_requests} requests; lower the load or the duration"
            )));
        }
        let prompt_tokens = prompts.sample(&mut rng);
        let output_tokens = outputs.sample(&mut rng);
        out.push(RequestSpec {
            id: out.len(),
            arrival_us,
            prompt_tokens,
            output_tokens,
        });
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn moments(table: QuantileTable) -> (f64, f64, f64) {
        let mut rng = ChaCha8Rng::seed_from_u64(7);
        let mut v: Vec<u32> = (0..200_000).map(|_| table.sample(&mut rng)).collect();
        v.sort_unstable();
        let mean = v.iter().map(|&x| f64::from(x)).sum::<f64>() / v.len() as f64;
        (
            mean,
            f64::from(v[v.len() / 2]),
            f64::from(v[v.len() * 99 / 100]),
        )
    }

    #[test]
    fn the_length_distributions_match_the_stated_moments() {
        let (mean, median, p99) = moments(QuantileTable::new(PROMPT_QUANTILES));
        assert!((mean - 1150.0).abs() < 30.0, "prompt mean {mean}");
        assert!((median - 1000.0).abs() < 25.0, "prompt median {median}");
        assert!((p99 - 4100.0).abs() < 150.0, "prompt p99 {p99}");
        let (mean, median, p99) = moments(QuantileTable::new(OUTPUT_QUANTILES));
        assert!((mean - 210.0).abs() < 8.0, "output mean {mean}");
        assert!((median - 130.0).abs() < 5.0, "output median {median}");
        assert!((p99 - 600.0).abs() < 15.0, "output p99 {p99}");
    }

    #[test]
    fn arrivals_are_poisson_at_the_asked_rate_and_replay_from_the_seed() {
        let cfg = WorkloadConfig {
            rate_per_s: 50.0,
            duration_s: 200.0,
            seed: 11,
        };
        let a = generate(&cfg, 1_000_000).unwrap();
        let b = generate(&cfg, 1_000_000).unwrap();
        assert_eq!(a, b);
        let n = a.len() as f64;
        // 10,000 expected; a Poisson count has sd 100.
        assert!((n - 10_000.0).abs() < 400.0, "{n} arrivals");
        assert!(a.windows(2).all(|w| w[0].arrival_us <= w[1].arrival_us));
        let other = generate(&WorkloadConfig { seed: 12, ..cfg }, 1_000_000).unwrap();
        assert_ne!(a, other);
    }

    #[test]
    fn a_workload_over_the_request_cap_is_refused() {
        let cfg = WorkloadConfig {
            rate_per_s: 1000.0,
            duration_s: 100.0,
            seed: 1,
        };
        assert!(matches!(
            generate(&cfg, 10),
            Err(crate::Error::InvalidArgument(_))
        ));
    }
}
