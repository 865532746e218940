//! Where a request's checkpoint lives.
//!
//! For a request `r` served by worker `s` with a conservative footprint `reserve(r)`:
//!
//! ```text
//! h(r) = argmin over w ≠ s, w in full service, free(w) ≥ reserve(r) of  q_w + λ · p_w(r)
//! p_w(r) = (mean reservation of the checkpoints w already holds) / host-to-GPU bandwidth
//! ```
//!
//! `q_w` (ms) is how long new work waits on `w`; `p_w` (ms) is how long a restore on `w` is
//! expected to take. A holder is where the request resumes if `s` dies, so the rule prefers
//! workers that will start a restore soon and finish it fast. Ties go to the worker holding
//! fewer checkpoints, then to the lower worker id, so the choice is deterministic.

use super::WorkerId;
use super::load::{LoadTable, WorkerLoad};

/// The inputs of the placement score that do not depend on the worker.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ScoreParams {
    /// Weight of the restore delay against the queueing delay (λ, default 1).
    pub lambda: f64,
    /// Host-to-GPU bandwidth used to turn bytes into restore milliseconds, in bytes per ms.
    pub host_to_gpu_bytes_per_ms: u64,
}

/// `q_w + λ · p_w`, in ms.
pub fn score(w: &WorkerLoad, p: ScoreParams) -> f64 {
    let restore_ms = w.mean_held_reservation_bytes() / p.host_to_gpu_bytes_per_ms.max(1) as f64;
    w.queue_delay_ms() + p.lambda * restore_ms
}

/// Whether `w` may hold a checkpoint of `reserve_bytes` for a request served by `serving`.
pub fn eligible(w: &WorkerLoad, serving: WorkerId, reserve_bytes: u64) -> bool {
    w.id != serving && w.in_service() && w.free_bytes() >= reserve_bytes
}

/// The load-aware holder `h(r)`, or `None` when no worker other than `serving` has room.
pub fn load_aware_holder(
    load: &LoadTable,
    serving: WorkerId,
    reserve_bytes: u64,
    p: ScoreParams,
) -> Option<WorkerId> {
    let mut best: Option<(f64, u32, WorkerId)> = None;
    for w in load.in_service() {
        if !eligible(w, serving, reserve_bytes) {
            continue;
        }
        let key = (score(w, p), w.held_checkpoints, w.id);
        let better = match best {
            None => true,
            Some(b) => key.0 < b.0 || (key.0 == b.0 && (key.1, key.2) < (b.1, b.2)),
        };
        if better {
            best = Some(key);
        }
    }
    best.map(|b| b.2)
}

/// The fixed ring holder (DejaVu's design): the next worker in full service after `serving`
/// in worker-id order, wrapping around. `None` when that worker lacks room or no other exists.
pub fn ring_holder(load: &LoadTable, serving: WorkerId, reserve_bytes: u64) -> Option<WorkerId> {
    let next = load
        .in_service()
        .find(|w| w.id > serving)
        .or_else(|| load.in_service().find(|w| w.id != serving))?;
    eligible(next, serving, reserve_bytes).then_some(next.id)
}

/// The least-loaded worker among `candidates` (rows in full service), where load is
/// `(extra[w], q_w, id)` compared lexicographically: `extra` counts work already handed to the
/// worker in the current decision (recovering requests), then queueing delay breaks ties.
pub fn least_loaded<'a>(
    candidates: impl Iterator<Item = &'a WorkerLoad>,
    extra: impl Fn(WorkerId) -> u32,
) -> Option<WorkerId> {
    let mut best: Option<(u32, f64, WorkerId)> = None;
    for w in candidates {
        let key = (extra(w.id), w.queue_delay_ms(), w.id);
        let better = match best {
            None => true,
            Some(b) => {
                key.0 < b.0 || (key.0 == b.0 && (key.1 < b.1 || (key.1 == b.1 && key.2 < b.2)))
            }
        };
        if better {
            best = Some(key);
        }
    }
    best.map(|b| b.2)
}

#[cfg(test)]
mod tests {
    use super::*;

    const P: ScoreParams = ScoreParams {
        lambda: 1.0,
        host_to_gpu_bytes_per_ms: 1000,
    };

    fn table(n: u32, cap: u64) -> LoadTable {
        let mut t = LoadTable::new();
        for i in 0..n {
            t.insert(WorkerLoad::new(i, cap));
        }
        t
    }

    #[test]
    fn the_holder_is_never_the_serving_worker() {
        let t = table(2, 100);
        assert_eq!(load_aware_holder(&t, 0, 10, P), Some(1));
        assert_eq!(load_aware_holder(&t, 1, 10, P), Some(0));
        let one = table(1, 100);
        assert_eq!(load_aware_holder(&one, 0, 10, P), None);
    }

    #[test]
    fn the_holder_with_the_lowest_queueing_delay_wins() {
        let mut t = table(3, 100);
        t.get_mut(1).unwrap().record_delay(50, 8);
        t.get_mut(2).unwrap().record_delay(5, 8);
        assert_eq!(load_aware_holder(&t, 0, 10, P), Some(2));
    }

    #[test]
    fn a_worker_holding_large_checkpoints_scores_its_restore_delay() {
        let mut t = table(3, 1_000_000);
        // Worker 1 waits 1 ms but holds one 100 kB checkpoint: 100 ms restore delay.
        t.get_mut(1).unwrap().record_delay(1, 8);
        t.get_mut(1).unwrap().reserve(100_000);
        t.get_mut(2).unwrap().record_delay(20, 8);
        assert_eq!(load_aware_holder(&t, 0, 10, P), Some(2));
        let small_lambda = ScoreParams { lambda: 0.0, ..P };
        assert_eq!(load_aware_holder(&t, 0, 10, small_lambda), Some(1));
    }

    #[test]
    fn a_worker_without_room_is_never_chosen() {
        let mut t = table(3, 100);
        t.get_mut(1).unwrap().reserve(95);
        t.get_mut(2).unwrap().record_delay(1000, 8);
        assert_eq!(load_aware_holder(&t, 0, 10, P), Some(2));
        t.get_mut(2).unwrap().reserve(91);
        assert_eq!(load_aware_holder(&t, 0, 10, P), None);
    }

    #[test]
    fn the_ring_holder_is_the_next_worker_wrapping_around() {
        let t = table(3, 100);
        assert_eq!(ring_holder(&t, 0, 10), Some(1));
        assert_eq!(ring_holder(&t, 2, 10), Some(0));
        assert_eq!(ring_holder(&t, 2, 1000), None);
    }

    #[test]
    fn least_loaded_counts_handed_work_first_then_queueing_delay() {
        let mut t = table(3, 100);
        t.get_mut(0).unwrap().record_delay(10, 8);
        assert_eq!(least_loaded(t.in_service(), |_| 0), Some(1));
        assert_eq!(
            least_loaded(t.in_service(), |w| if w == 0 { 0 } else { 1 }),
            Some(0)
        );
    }
}
