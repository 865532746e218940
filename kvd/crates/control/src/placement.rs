//! Where a request's checkpoint lives.
//!
//! For a request `r` served by worker `s` with a conservative footprint `reserve(r)`:
//!
//! ```text
//! h(r) = argmin over w ≠ s, w in full service, free(w) ≥ reserve(r) of  q_w + λ · p_w(r)
//! ```
//!
//! `q_w` (ms) is how long new work waits on `w`; `p_w(r)` (ms) estimates the restore delay `r`
//! would see on `w`. A holder is where the request resumes if `s` dies, so the rule prefers
//! workers that will start a restore soon and finish it fast. Ties go to the worker holding
//! fewer checkpoints, then to the lower worker id, so the choice is deterministic.
//!
//! Three estimates of `p_w(r)`, one per [`RestoreEstimate`]:
//!
//! - [`RestoreEstimate::PerServer`] (docs/CONTROL.md, policy `lumen`): the bytes `w` would have to
//!   load if `s` failed, `(held by w for requests served by s + reserve(r)) / bandwidth`. One
//!   server's checkpoints spread over many holders, so its failure's restores run in parallel.
//! - [`RestoreEstimate::MeanHeld`] (the first rule, policy `lumen_mean`): the mean footprint
//!   `w` already holds. It does not grow as `w` takes more checkpoints, so consecutive
//!   admissions herd onto the worker with the lowest `q_w`.
//! - [`RestoreEstimate::TotalHeld`] (policy `lumen_total`): `(everything w holds + reserve(r))
//!   / bandwidth`, the time to restore all of it, whichever servers fail.

use serde::{Deserialize, Serialize};

use super::WorkerId;
use super::load::{LoadTable, WorkerLoad};

/// The inputs of the placement score that do not depend on the worker.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ScoreParams {
    /// Weight of the restore delay against the queueing delay (λ, default 1).
    pub lambda: f64,
    /// Host-to-GPU bandwidth used to turn bytes into restore milliseconds, in bytes per ms.
    pub host_to_gpu_bytes_per_ms: u64,
    /// Prefill throughput used to turn tokens into recompute milliseconds (recovery dispatch).
    pub prefill_tokens_per_ms: u32,
    /// The engines' sequence cap (vLLM's `--max-num-seqs`), 0 when not known: recovery
    /// dispatch hands no survivor requests past it while another has room.
    pub engine_max_seqs: u32,
}

/// How the placement score estimates the restore delay `p_w(r)`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RestoreEstimate {
    /// `(held by w for s's requests + reserve(r)) / bandwidth` (docs/CONTROL.md).
    PerServer,
    /// `mean held reservation on w / bandwidth` (the first rule).
    MeanHeld,
    /// `(everything held by w + reserve(r)) / bandwidth`.
    TotalHeld,
}

/// `p_w(r)` in ms: the restore delay a request served by `serving` reserving `reserve_bytes`
/// would see on `w`, as `est` estimates it.
pub fn restore_ms(
    w: &WorkerLoad,
    serving: WorkerId,
    reserve_bytes: u64,
    est: RestoreEstimate,
    p: ScoreParams,
) -> f64 {
    let bytes = match est {
        RestoreEstimate::PerServer => (w.held_for(serving) + reserve_bytes) as f64,
        RestoreEstimate::MeanHeld => w.mean_held_reservation_bytes(),
        RestoreEstimate::TotalHeld => (w.reserved_bytes + reserve_bytes) as f64,
    };
    bytes / p.host_to_gpu_bytes_per_ms.max(1) as f64
}

/// `q_w + λ · p_w(r)`, in ms.
pub fn score(
    w: &WorkerLoad,
    serving: WorkerId,
    reserve_bytes: u64,
    est: RestoreEstimate,
    p: ScoreParams,
) -> f64 {
    w.queue_delay_ms() + p.lambda * restore_ms(w, serving, reserve_bytes, est, p)
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
    est: RestoreEstimate,
    p: ScoreParams,
) -> Option<WorkerId> {
    let mut best: Option<(f64, u32, WorkerId)> = None;
    for w in load.in_service() {
        if !eligible(w, serving, reserve_bytes) {
            continue;
        }
        let key = (
            score(w, serving, reserve_bytes, est, p),
            w.held_checkpoints,
            w.id,
        );
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
/// `(extra[w], busy_w, id)` compared lexicographically: `extra` counts work already handed to the
/// worker in the current decision (recovering requests), then `q_w` plus the prefill queued
/// there ([`crate::load::WorkerLoad::busy_ms`]) breaks ties.
pub fn least_loaded<'a>(
    candidates: impl Iterator<Item = &'a WorkerLoad>,
    extra: impl Fn(WorkerId) -> u32,
) -> Option<WorkerId> {
    let mut best: Option<(u32, f64, WorkerId)> = None;
    for w in candidates {
        let key = (extra(w.id), w.busy_ms(), w.id);
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
        prefill_tokens_per_ms: 10,
        engine_max_seqs: 0,
    };
    const ALL: [RestoreEstimate; 3] = [
        RestoreEstimate::PerServer,
        RestoreEstimate::MeanHeld,
        RestoreEstimate::TotalHeld,
    ];

    fn table(n: u32, cap: u64) -> LoadTable {
        let mut t = LoadTable::new();
        for i in 0..n {
            t.insert(WorkerLoad::new(i, cap));
        }
        t
    }

    /// Places `n` checkpoints of `reserve` bytes for requests served by `serving`, reserving
    /// each one; returns how many each worker took.
    fn place_many(
        t: &mut LoadTable,
        serving: WorkerId,
        n: u32,
        reserve: u64,
        est: RestoreEstimate,
    ) -> Vec<u32> {
        let mut per = vec![0u32; t.len()];
        for _ in 0..n {
            let h = load_aware_holder(t, serving, reserve, est, P).expect("room somewhere");
            assert_ne!(
                h, serving,
                "{est:?}: the holder is never the serving worker"
            );
            t.get_mut(h).unwrap().reserve(reserve, serving);
            per[h as usize] += 1;
        }
        per
    }

    #[test]
    fn the_holder_is_never_the_serving_worker() {
        for est in ALL {
            let t = table(2, 100);
            assert_eq!(load_aware_holder(&t, 0, 10, est, P), Some(1), "{est:?}");
            assert_eq!(load_aware_holder(&t, 1, 10, est, P), Some(0), "{est:?}");
            let one = table(1, 100);
            assert_eq!(load_aware_holder(&one, 0, 10, est, P), None, "{est:?}");
        }
    }

    #[test]
    fn the_holder_with_the_lowest_queueing_delay_wins() {
        for est in ALL {
            let mut t = table(3, 100);
            t.get_mut(1).unwrap().record_delay(50, 8);
            t.get_mut(2).unwrap().record_delay(5, 8);
            assert_eq!(load_aware_holder(&t, 0, 10, est, P), Some(2), "{est:?}");
        }
    }

    #[test]
    fn a_worker_holding_large_checkpoints_scores_its_restore_delay() {
        for est in ALL {
            let mut t = table(3, 1_000_000);
            // Worker 1 waits 1 ms but holds one 100 kB checkpoint of worker 0's: 100 ms of
            // restore delay whichever estimate reads it.
            t.get_mut(1).unwrap().record_delay(1, 8);
            t.get_mut(1).unwrap().reserve(100_000, 0);
            t.get_mut(2).unwrap().record_delay(20, 8);
            assert_eq!(load_aware_holder(&t, 0, 10, est, P), Some(2), "{est:?}");
            let small_lambda = ScoreParams { lambda: 0.0, ..P };
            assert_eq!(
                load_aware_holder(&t, 0, 10, est, small_lambda),
                Some(1),
                "{est:?}"
            );
        }
    }

    #[test]
    fn a_worker_without_room_is_never_chosen() {
        for est in ALL {
            let mut t = table(3, 100);
            t.get_mut(1).unwrap().reserve(95, 0);
            t.get_mut(2).unwrap().record_delay(1000, 8);
            assert_eq!(load_aware_holder(&t, 0, 10, est, P), Some(2), "{est:?}");
            t.get_mut(2).unwrap().reserve(91, 0);
            assert_eq!(load_aware_holder(&t, 0, 10, est, P), None, "{est:?}");
        }
    }

    #[test]
    fn a_servers_checkpoints_spread_over_every_holder_under_the_per_server_rule() {
        // Holders 1-4 wait 4, 3, 2 and 1 ms; each checkpoint is 10 ms of restore. The mean rule
        // sees 10 ms on every holder that holds anything, so it keeps choosing the fastest
        // queue; the per-server rule sees the pile grow and spreads it.
        let setup = || {
            let mut t = table(5, 1 << 30);
            for (w, q) in [(1, 4), (2, 3), (3, 2), (4, 1)] {
                t.get_mut(w).unwrap().record_delay(q, 8);
            }
            t
        };
        let spread = place_many(&mut setup(), 0, 20, 10_000, RestoreEstimate::PerServer);
        assert_eq!(spread[0], 0);
        assert!(
            spread[1..].iter().all(|&n| (4..=6).contains(&n)),
            "per server: {spread:?}"
        );
        // The mean rule gives each empty holder one (its mean is 0 until it holds one), then
        // everything else lands on the fastest queue.
        let herded = place_many(&mut setup(), 0, 20, 10_000, RestoreEstimate::MeanHeld);
        assert_eq!(herded, [0, 1, 1, 1, 17], "the mean rule herds");
    }

    #[test]
    fn the_per_server_rule_counts_only_what_the_holder_holds_for_the_same_server() {
        // Worker 2 has the shortest queue but holds 500 ms of worker 1's checkpoints. For a
        // request of worker 0 that load is irrelevant (worker 1's failure would not restore
        // it), so the per-server rule still picks worker 2; the total rule avoids it.
        let mut t = table(4, 1 << 30);
        t.get_mut(1).unwrap().record_delay(10, 8);
        t.get_mut(2).unwrap().record_delay(1, 8);
        t.get_mut(3).unwrap().record_delay(5, 8);
        t.get_mut(2).unwrap().reserve(500_000, 1);
        let pick = |est| load_aware_holder(&t, 0, 1_000, est, P);
        assert_eq!(pick(RestoreEstimate::PerServer), Some(2));
        assert_eq!(pick(RestoreEstimate::TotalHeld), Some(3));
    }

    #[test]
    fn capacity_bounds_every_rule_however_many_checkpoints_arrive() {
        // 3 holders of 100 bytes, 35-byte checkpoints: 2 fit on each, the 7th finds no room.
        for est in ALL {
            let mut t = table(4, 100);
            place_many(&mut t, 0, 6, 35, est);
            assert!(t.iter().all(|w| w.reserved_bytes <= w.capacity_bytes));
            assert_eq!(load_aware_holder(&t, 0, 35, est, P), None, "{est:?}");
        }
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
