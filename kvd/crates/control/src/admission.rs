//! Where a new request goes: the in-service worker whose engine will start it soonest, by
//! what the controller knows of each.
//!
//! A count of the requests a worker serves (what the front used alone before) misses two
//! things the LUMEN runs traced (docs/PERFORMANCE.md, "Eighth sitting"):
//!
//! - **A full batch.** An engine runs at most `--engine-max-seqs` sequences; a request sent to
//!   an engine at its cap waits for a running one to finish: seconds of decode, where a free
//!   slot elsewhere costs nothing. Among full engines the one whose slot frees first is the
//!   better bet: the fewest tokens left to generate, from what each request asked for and what
//!   its engine reported.
//! - **Work queued ahead of a prefill.** A request admitted and not yet at its first token,
//!   or one resumed after a failure and not yet at its next (a restore or a recomputation),
//!   takes the engine's prefill budget before a new prompt does, and it holds a slot. It counts
//!   twice.
//!
//! So the key, smallest first: the tokens until a slot frees (0 below the cap or with the cap
//! unknown), then the requests served plus those still starting, then the worker id. Below
//! the cap and with nothing starting, this is the least-loaded choice it replaced.

use std::collections::BTreeMap;

use super::WorkerId;
use super::controller::Controller;

/// One in-service worker as admission sees it ([`Controller::admission_rows`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AdmissionRow {
    /// The worker.
    pub id: WorkerId,
    /// Live requests it serves.
    pub serving: u32,
    /// Of those, the ones its engine has not started: admitted and not at their first token,
    /// or resumed here and not at their next.
    pub starting: u32,
    /// With the engines' sequence cap known and `serving` at or over it: the tokens its
    /// requests must still generate before a slot frees for one more (the
    /// `serving − cap + 1`-th fewest left). 0 otherwise.
    pub slot_wait_tokens: u32,
}

impl AdmissionRow {
    /// The admission key: smaller is sooner (see the module docs).
    pub fn key(&self) -> (u32, u32, WorkerId) {
        (
            self.slot_wait_tokens,
            self.serving.saturating_add(self.starting),
            self.id,
        )
    }
}

/// The worker among `rows` a new request goes to: the smallest [`AdmissionRow::key`]. `None`
/// when `rows` is empty.
pub fn pick(rows: impl IntoIterator<Item = AdmissionRow>) -> Option<WorkerId> {
    rows.into_iter().min_by_key(AdmissionRow::key).map(|r| r.id)
}

impl Controller {
    /// Every worker in full service as admission sees it, by worker id. `O(live requests ·
    /// log)`.
    pub fn admission_rows(&self) -> Vec<AdmissionRow> {
        let cap = self.config().engine_max_seqs;
        let load = self.load();
        let mut left: BTreeMap<WorkerId, (u32, Vec<u32>)> =
            load.in_service().map(|w| (w.id, (0, Vec::new()))).collect();
        for r in self.live_requests() {
            let Some((starting, tokens)) = left.get_mut(&r.serving) else {
                continue; // a failed worker's, or one cancelling
            };
            if !r.state.is_running() {
                continue;
            }
            if r.state.awaits_start() {
                *starting += 1;
            }
            tokens.push(r.max_new_tokens.saturating_sub(r.generated_tokens));
        }
        left.into_iter()
            .map(|(id, (starting, mut tokens))| {
                let serving = load.get(id).map_or(0, |w| w.serving_requests);
                AdmissionRow {
                    id,
                    serving,
                    starting,
                    slot_wait_tokens: slot_wait(&mut tokens, serving, cap),
                }
            })
            .collect()
    }
}

/// The tokens until one more sequence fits under `cap`: the `serving − cap + 1`-th smallest
/// of `tokens` (each request's tokens left), 0 below the cap or with no cap. A count past the
/// requests listed (the table and the requests disagree only between events) takes the most.
fn slot_wait(tokens: &mut [u32], serving: u32, cap: u32) -> u32 {
    if cap == 0 || serving < cap || tokens.is_empty() {
        return 0;
    }
    let k = ((serving - cap) as usize).min(tokens.len() - 1);
    *tokens.select_nth_unstable(k).1
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{AdmitRequest, ControlConfig};

    fn row(id: WorkerId, serving: u32, starting: u32, slot_wait_tokens: u32) -> AdmissionRow {
        AdmissionRow {
            id,
            serving,
            starting,
            slot_wait_tokens,
        }
    }

    #[test]
    fn below_the_cap_it_is_least_loaded_with_starting_requests_counted_twice() {
        assert_eq!(pick([row(1, 3, 0, 0), row(2, 2, 0, 0)]), Some(2));
        // 2 serving with both still starting weighs 4: worse than 3 running
        assert_eq!(pick([row(1, 3, 0, 0), row(2, 2, 2, 0)]), Some(1));
        assert_eq!(
            pick([row(4, 3, 0, 0), row(2, 3, 0, 0)]),
            Some(2),
            "ties: lowest id"
        );
        assert_eq!(pick(Vec::new()), None);
    }

    #[test]
    fn a_free_slot_wins_and_among_full_engines_the_soonest_to_free_one() {
        assert_eq!(pick([row(1, 8, 0, 40), row(2, 2, 2, 0)]), Some(2));
        assert_eq!(pick([row(1, 8, 0, 40), row(2, 8, 0, 5)]), Some(2));
    }

    #[test]
    fn slot_wait_takes_the_kth_fewest_tokens_left() {
        assert_eq!(slot_wait(&mut [9, 3, 7], 3, 0), 0, "no cap");
        assert_eq!(slot_wait(&mut [9, 3, 7], 3, 4), 0, "below the cap");
        assert_eq!(
            slot_wait(&mut [9, 3, 7], 3, 3),
            3,
            "at the cap: the first to finish"
        );
        assert_eq!(slot_wait(&mut [9, 3, 7], 4, 3), 7, "one over: the second");
        assert_eq!(
            slot_wait(&mut [9, 3, 7], 9, 3),
            9,
            "past the list: the most"
        );
        assert_eq!(slot_wait(&mut [], 9, 3), 0);
    }

    #[test]
    fn rows_come_from_the_requests_each_worker_serves() {
        let cfg = ControlConfig {
            engine_max_seqs: 2,
            ..ControlConfig::default()
        };
        let mut c = Controller::new(cfg).unwrap();
        for w in 0..3 {
            c.add_worker(w, 1 << 30, 0).unwrap();
        }
        let mut admit = |id, serving, max_new| {
            let req = AdmitRequest {
                request_id: id,
                serving,
                prompt_tokens: 100,
                max_new_tokens: max_new,
                reserve_bytes: 1 << 20,
                deadline_ms: None,
            };
            c.admit(req, 10).unwrap().epoch
        };
        let e1 = admit(1, 0, 50);
        let e2 = admit(2, 0, 30);
        let _ = admit(3, 1, 20);
        c.prefill_started(1, e1, 20).unwrap();
        c.decoding_started(1, e1, 21).unwrap();
        c.prefill_started(2, e2, 20).unwrap();
        c.decoding_started(2, e2, 21).unwrap();
        c.tokens_committed(2, e2, 25, 30).unwrap();
        let rows = c.admission_rows();
        assert_eq!(
            rows,
            vec![row(0, 2, 0, 5), row(1, 1, 1, 0), row(2, 0, 0, 0)],
            "worker 0 is at its cap of 2, its soonest finish 30 − 25 tokens away; \
             worker 1's one request has not started"
        );
        assert_eq!(pick(rows), Some(2));
        c.fail_workers(&[2], 40).unwrap();
        assert_eq!(
            pick(c.admission_rows()),
            Some(1),
            "a failed worker has no row"
        );
    }
}
