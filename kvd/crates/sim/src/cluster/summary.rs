//! Periodic samples of the cluster, and the run's metrics from the per-request outcomes.

use super::super::events::{SimEvent, secs_to_us, us_to_secs};
use super::super::metrics::{self, Latencies, RequestOutcome, SeriesPoint};
use super::{RunOutput, Sim};

impl Sim<'_> {
    pub(super) fn on_sample(&mut self) {
        let now = self.now();
        self.series.push(SeriesPoint {
            t_s: us_to_secs(now),
            ttft_mean_s: 0.0,
            queued: self
                .workers
                .iter()
                .map(|w| w.waiting.len() + w.resumed.len())
                .sum::<usize>()
                + self.backlog.len(),
            host_bytes: self.ckpt.host_bytes.iter().sum(),
        });
        if self.progress.outstanding > 0
            || self.progress.arrived < self.workload.len()
            || self.progress.down > 0
        {
            self.q
                .push(now + secs_to_us(self.cfg.sample_every_s), SimEvent::Sample);
        }
    }

    pub(super) fn finish(mut self) -> RunOutput {
        let recs = &self.records;
        let m = &mut self.m;
        m.requests = recs.len();
        m.completed = recs.iter().filter(|r| r.finish_us.is_some()).count();
        m.failed = recs.iter().filter(|r| r.failed.is_some()).count();
        m.interrupted = recs.iter().filter(|r| r.interrupted).count();
        for (r, spec) in recs.iter().zip(self.workload) {
            if r.finish_us.is_some() {
                m.tokens_requested += u64::from(spec.output_tokens);
                m.tokens_delivered += u64::from(r.delivered_tokens);
            }
        }
        m.overall = Latencies::of(recs.iter(), |r| r.finish_us.is_some());
        m.interrupted_lat = Latencies::of(recs.iter(), |r| r.interrupted && r.finish_us.is_some());
        if let Some(f) = self.progress.first_failure_us {
            let end = f + secs_to_us(self.cfg.bystander_window_s);
            let bystander = |r: &RequestOutcome| {
                !r.interrupted && r.arrival_us <= end && r.finish_us.is_some_and(|t| t >= f)
            };
            m.bystanders = recs.iter().filter(|r| bystander(r)).count();
            m.bystander_lat = Latencies::of(recs.iter(), bystander);
            let stalls: Vec<f64> = recs
                .iter()
                .filter_map(|r| r.resumed_us)
                .map(|t| us_to_secs(t.saturating_sub(f)))
                .collect();
            m.recovery_s = stalls.iter().copied().fold(0.0, f64::max);
            m.stall = metrics::Summary::of(stalls);
            m.capacity_restore_s = self
                .progress
                .capacity_restored_us
                .map_or(0.0, |t| us_to_secs(t - f));
        }
        m.peak_host_bytes_max = self.ckpt.peak_host_bytes.iter().copied().max().unwrap_or(0);
        m.peak_host_bytes_mean = self.ckpt.peak_host_bytes.iter().sum::<u64>() as f64
            / self.ckpt.peak_host_bytes.len().max(1) as f64;
        m.makespan_s = recs
            .iter()
            .filter_map(|r| r.finish_us)
            .max()
            .map_or(0.0, us_to_secs);
        m.events = self.q.popped();
        // TTFT by arrival period (one per sample) into the series.
        let seconds = self.series.len();
        let by_second =
            metrics::ttft_by_arrival_period(recs, secs_to_us(self.cfg.sample_every_s), seconds);
        for (p, t) in self.series.iter_mut().zip(by_second) {
            p.ttft_mean_s = t;
        }
        for t in &mut self.trace {
            t.settle();
        }
        RunOutput {
            metrics: self.m,
            records: self.records,
            series: self.series,
            trace: self.trace,
        }
    }
}
