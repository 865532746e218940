//! Recovery: where every interrupted request resumes, and what it loads and recomputes.
//!
//! On the failure of a set of workers `F` (one event may name several):
//!
//! 1. **Dispatch.** Every running request served by a worker in `F` is interrupted. Holders
//!    first: a request whose holder survived goes to its holder (KV reuse, no network). The
//!    others (holder in `F` too, or no checkpoint) are recomputed on the least-loaded survivor,
//!    one at a time, counting what was already handed out.
//! 2. **Rebalance** ([`rebalance_among`], used by [`super::dispatch`], Lumen's dispatch, which
//!    also decides which survivors take the recomputations). With `n` survivors and `m`
//!    recovering requests, the threshold is `⌈m / n⌉`. While some survivor has more than the
//!    threshold, its recovering request with the smallest checkpointed prefix (cheapest to
//!    move) moves to the survivor with the fewest. Each move lowers `Σ count²` by at least 2,
//!    so the loop ends; it is also capped at `m` moves. Afterwards no survivor is above
//!    `mean + 1`.
//! 3. **Plan.** Per request a [`RestorePlan`]: the longest contiguous verified checkpoint prefix
//!    to load (whole blocks only, from the holder, local when the target is the holder), the
//!    suffix to prefill, and the stream sequence number to resume at.

use serde::{Deserialize, Serialize};

use super::load::LoadTable;
use super::placement::least_loaded;
use super::{Epoch, RequestId, WorkerId};

/// One interrupted request, as a policy sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Interrupted {
    /// The request.
    pub request_id: RequestId,
    /// Its checkpoint holder, when that holder is still in service.
    pub live_holder: Option<WorkerId>,
    /// Tokens its checkpoint covers (0 without a live holder).
    pub checkpointed_tokens: u32,
    /// Its token history (prompt + committed generated tokens): what a recomputation prefills.
    #[serde(default)]
    pub history_tokens: u32,
    /// KV bytes per token of its model: what loading a checkpointed token copies.
    #[serde(default)]
    pub bytes_per_token: u64,
}

/// A policy's answer for one interrupted request: where it resumes and where its KV comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Dispatch {
    /// The request.
    pub request_id: RequestId,
    /// The survivor that resumes it.
    pub target: WorkerId,
    /// The worker whose checkpoint it loads (`None`: recompute everything).
    pub kv_source: Option<WorkerId>,
}

/// The policy's dispatch of a whole failure.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Dispatched {
    /// One entry per interrupted request that has a survivor to go to, in request-id order.
    pub dispatches: Vec<Dispatch>,
    /// Moves the rebalancing made.
    pub rebalance_moves: u32,
}

/// What the engine on `target` does to resume one request.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RestorePlan {
    /// The request.
    pub request_id: RequestId,
    /// The epoch of the resumed incarnation; the engine names it in every later event.
    pub epoch: Epoch,
    /// The survivor that resumes it.
    pub target: WorkerId,
    /// The worker holding the checkpoint to load (`None`: recompute from scratch). Equal to
    /// `target` when the KV is local; otherwise pulled worker to worker.
    pub kv_source: Option<WorkerId>,
    /// Tokens to load from the checkpoint: the longest contiguous verified prefix, whole blocks.
    /// The engine rebuilds the tags from the token history and may load less if fewer blocks
    /// verify (prefer miss over misuse); it never loads more.
    pub load_tokens: u32,
    /// Tokens to prefill after the loaded prefix (history − load).
    pub prefill_tokens: u32,
    /// Full token history: prompt plus committed generated tokens.
    pub history_tokens: u32,
    /// The first stream sequence number the resumed stream sends (last acknowledged + 1).
    pub resume_seq: u64,
    /// Where the request's next checkpoint goes (a new holder when the old one is the target).
    pub new_holder: Option<WorkerId>,
}

/// What the dispatch saw of one survivor when it placed the interrupted requests: the two parts
/// of its estimate of when recovery work handed to it would start
/// ([`crate::load::WorkerLoad::busy_ms`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SurvivorEstimate {
    /// The survivor.
    pub worker: WorkerId,
    /// Live requests it served before the dispatch.
    pub serving: u32,
    /// `q_w`: its mean queueing delay over past requests, ms (rounded).
    pub queue_delay_ms: u64,
    /// The prefill queued on it (requests sent and not yet at their first token), ms at the
    /// configured prefill rate (rounded).
    pub queued_prefill_ms: u64,
}

/// Everything one failure event decided.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct RecoveryPlan {
    /// The workers that failed in this event (already-failed ones are left out).
    pub failed_workers: Vec<WorkerId>,
    /// One plan per interrupted request that resumes, in request-id order.
    pub restores: Vec<RestorePlan>,
    /// Requests that could not resume: `(request, epoch, reason)` — budget, deadline, no survivor.
    pub failed_requests: Vec<(RequestId, Epoch, String)>,
    /// Requests that were cancelling on a dead worker and are now cancelled.
    pub cancelled_requests: Vec<RequestId>,
    /// Live requests whose holder died: `(request, epoch, new holder)`; they restart
    /// checkpointing from scratch there (`None`: no room anywhere, they run without one).
    pub checkpoint_moves: Vec<(RequestId, Epoch, Option<WorkerId>)>,
    /// Moves the rebalancing made.
    pub rebalance_moves: u32,
    /// Recovering workers in ASSIST whose assisted survivor failed: `(worker, new partner)`
    /// (`None`: every survivor is assisted already; it assists nobody until one frees up or it
    /// moves on to HOTSWAP).
    #[serde(default)]
    pub assist_pairs: Vec<(WorkerId, Option<WorkerId>)>,
    /// The survivors in service as the dispatch saw them, by worker id (empty when nothing
    /// was interrupted): what a trace of where a request resumed needs.
    #[serde(default)]
    pub survivors: Vec<SurvivorEstimate>,
}

impl RecoveryPlan {
    /// Whether the event changed nothing (every named worker was already failed).
    pub fn is_empty(&self) -> bool {
        self.failed_workers.is_empty()
    }
}

/// Step 1: holders first, then the least-loaded survivor for the rest.
///
/// `interrupted` must be sorted by request id; the output is in the same order.
pub fn dispatch_holders_first(
    load: &LoadTable,
    interrupted: &[Interrupted],
    use_holders: bool,
) -> Vec<Dispatch> {
    let mut counts = std::collections::BTreeMap::<WorkerId, u32>::new();
    let mut out: Vec<Option<Dispatch>> = vec![None; interrupted.len()];
    if use_holders {
        for (i, r) in interrupted.iter().enumerate() {
            if let Some(h) = r
                .live_holder
                .filter(|h| load.get(*h).is_some_and(|w| w.in_service()))
            {
                *counts.entry(h).or_default() += 1;
                out[i] = Some(Dispatch {
                    request_id: r.request_id,
                    target: h,
                    kv_source: Some(h),
                });
            }
        }
    }
    for (i, r) in interrupted.iter().enumerate() {
        if out[i].is_some() {
            continue;
        }
        let Some(t) = least_loaded(load.in_service(), |w| counts.get(&w).copied().unwrap_or(0))
        else {
            break; // no survivor at all
        };
        *counts.entry(t).or_default() += 1;
        out[i] = Some(Dispatch {
            request_id: r.request_id,
            target: t,
            kv_source: None,
        });
    }
    out.into_iter().flatten().collect()
}

/// Step 2 (the paper's average-based request-count rule): while a survivor that was handed
/// requests serves more than `⌈mean⌉` requests in all (those it already runs plus those
/// handed to it; the mean over the survivors), its handed request with the smallest
/// checkpointed prefix moves to the idlest survivor (the least `busy_w`: `q_w` plus the prefill
/// queued there; ties: fewer requests, lower id) among those serving at least two fewer.
/// Returns the number of moves.
///
/// A holder that runs fewer requests than the others keeps its restores (they load locally):
/// balancing the restores alone, as this did before, moved them off an idle holder onto
/// survivors already busier, where the LUMEN runs saw them wait behind new prompts.
///
/// `checkpointed` gives each dispatched request's checkpointed prefix (same order as
/// `dispatches`). Bounded by `dispatches.len()` moves.
pub fn rebalance(load: &LoadTable, dispatches: &mut [Dispatch], checkpointed: &[u32]) -> u32 {
    let survivors: Vec<WorkerId> = load.in_service().map(|w| w.id).collect();
    rebalance_among(load, &survivors, dispatches, checkpointed)
}

/// [`rebalance`] over the survivors in `survivors` only (sorted by id, all in service): the
/// mean is over them; dispatches to other workers stay.
pub fn rebalance_among(
    load: &LoadTable,
    survivors: &[WorkerId],
    dispatches: &mut [Dispatch],
    checkpointed: &[u32],
) -> u32 {
    debug_assert_eq!(dispatches.len(), checkpointed.len());
    debug_assert!(
        survivors.windows(2).all(|w| w[0] < w[1]),
        "sorted survivors"
    );
    let n = survivors.len();
    if n == 0 || dispatches.is_empty() {
        return 0;
    }
    let slot = |w: WorkerId| survivors.binary_search(&w).ok();
    // Per survivor: indices into `dispatches`, sorted so the smallest prefix pops last.
    let mut lists: Vec<Vec<usize>> = vec![Vec::new(); n];
    for (i, d) in dispatches.iter().enumerate() {
        if let Some(s) = slot(d.target) {
            lists[s].push(i);
        }
    }
    for l in &mut lists {
        l.sort_by_key(|&i| std::cmp::Reverse((checkpointed[i], dispatches[i].request_id)));
    }
    let mut count: Vec<u64> = (0..n)
        .map(|s| {
            load.get(survivors[s])
                .map_or(0, |l| u64::from(l.serving_requests))
                + lists[s].len() as u64
        })
        .collect();
    let threshold = count.iter().sum::<u64>().div_ceil(n as u64);
    let busy: Vec<f64> = survivors.iter().map(|&w| load.busy_ms(w)).collect();
    let mut moves = 0u32;
    for _ in 0..dispatches.len() {
        // The most loaded survivor with a handed request to move (lowest id on ties), and,
        // among those serving at least two fewer, the idlest: the least `busy_w` (then the
        // fewest requests, then the lowest id).
        let Some(hi) = (0..n)
            .filter(|&s| !lists[s].is_empty())
            .max_by_key(|&s| (count[s], std::cmp::Reverse(s)))
        else {
            break;
        };
        if count[hi] <= threshold {
            break;
        }
        let Some(lo) = (0..n)
            .filter(|&s| count[s] + 2 <= count[hi])
            .min_by(|&a, &b| {
                (busy[a], count[a], a)
                    .partial_cmp(&(busy[b], count[b], b))
                    .expect("finite")
            })
        else {
            break;
        };
        let i = lists[hi].pop().expect("a survivor with handed requests");
        dispatches[i].target = survivors[lo];
        // Keep the list order: insert by key.
        let key = std::cmp::Reverse((checkpointed[i], dispatches[i].request_id));
        let pos = lists[lo]
            .binary_search_by_key(&key, |&j| {
                std::cmp::Reverse((checkpointed[j], dispatches[j].request_id))
            })
            .unwrap_or_else(|p| p);
        lists[lo].insert(pos, i);
        (count[hi], count[lo]) = (count[hi] - 1, count[lo] + 1);
        moves += 1;
    }
    moves
}

/// Step 3: the longest loadable prefix, in whole blocks, no longer than the history.
pub fn loadable_prefix(
    checkpointed_tokens: u32,
    history_tokens: u32,
    tokens_per_block: u32,
) -> u32 {
    let t = checkpointed_tokens.min(history_tokens);
    let b = tokens_per_block.max(1);
    t - t % b
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::load::WorkerLoad;

    /// Requests 0..n, each restoring at its holder `holder`.
    fn restores_at(holder: WorkerId, n: u64) -> Vec<Dispatch> {
        (0..n)
            .map(|i| Dispatch {
                request_id: i,
                target: holder,
                kv_source: Some(holder),
            })
            .collect()
    }

    fn table(ids: &[WorkerId]) -> LoadTable {
        let mut t = LoadTable::new();
        for &i in ids {
            t.insert(WorkerLoad::new(i, 1 << 30));
        }
        t
    }

    #[test]
    fn requests_go_to_their_live_holder_first() {
        let t = table(&[1, 2, 3]);
        let rs = [
            Interrupted {
                request_id: 1,
                live_holder: Some(2),
                checkpointed_tokens: 64,
                history_tokens: 80,
                bytes_per_token: 1,
            },
            Interrupted {
                request_id: 2,
                live_holder: None,
                checkpointed_tokens: 0,
                history_tokens: 80,
                bytes_per_token: 1,
            },
        ];
        let d = dispatch_holders_first(&t, &rs, true);
        assert_eq!(
            d[0],
            Dispatch {
                request_id: 1,
                target: 2,
                kv_source: Some(2)
            }
        );
        assert_eq!(d[1].kv_source, None);
        assert_ne!(
            d[1].target, 2,
            "the recompute goes to a less loaded survivor"
        );
    }

    #[test]
    fn rebalancing_moves_the_smallest_prefix_to_the_least_loaded() {
        let t = table(&[1, 2]);
        let mut d = restores_at(1, 4);
        let cp = [40, 10, 30, 20];
        let moves = rebalance(&t, &mut d, &cp);
        assert_eq!(moves, 2);
        let moved: Vec<RequestId> = d
            .iter()
            .filter(|x| x.target == 2)
            .map(|x| x.request_id)
            .collect();
        assert_eq!(moved, [1, 3], "prefixes 10 and 20 moved");
        assert!(
            d.iter().all(|x| x.kv_source == Some(1)),
            "moved requests still pull the holder's KV"
        );
    }

    #[test]
    fn a_holder_running_fewer_requests_than_the_mean_keeps_its_restores() {
        // Two restores at holder 1 (prefixes 10 and 20): the moves made, and each one's target.
        let rebalanced = |t: &LoadTable| {
            let mut d = restores_at(1, 2);
            let moves = rebalance(t, &mut d, &[10, 20]);
            (moves, d.iter().map(|x| x.target).collect::<Vec<_>>())
        };
        // Holder 1 runs nothing, survivors 2 and 3 run three each: with its two restores it
        // serves 2 against a mean of 8 / 3, so they stay and load locally. Balanced by restores
        // alone, one would have moved onto a survivor already running three.
        let mut t = table(&[1, 2, 3]);
        for w in [2, 3] {
            t.get_mut(w).unwrap().serving_requests = 3;
        }
        assert_eq!(rebalanced(&t), (0, vec![1, 1]));
        // Running four requests, it serves 6 against a mean of 12 / 3: two move, one to each
        // (the least loaded, then the lower id), the smaller prefix first.
        t.get_mut(1).unwrap().serving_requests = 4;
        assert_eq!(rebalanced(&t), (2, vec![2, 3]));
        // Survivor 2 was just sent a prompt it has not prefilled: the first move goes to the
        // idle 3, the second to 2 (3 has no room left below the holder).
        t.get_mut(2).unwrap().queued_prefill_ms = 500.0;
        assert_eq!(rebalanced(&t), (2, vec![3, 2]));
    }

    #[test]
    fn rebalancing_an_uneven_total_stops_at_the_ceiling_of_the_mean() {
        let t = table(&[1, 2]);
        let mut d: Vec<Dispatch> = (0..3)
            .map(|i| Dispatch {
                request_id: i,
                target: 1,
                kv_source: None,
            })
            .collect();
        assert_eq!(rebalance(&t, &mut d, &[0, 0, 0]), 1);
    }

    #[test]
    fn the_loadable_prefix_is_whole_blocks_within_the_history() {
        assert_eq!(loadable_prefix(100, 1000, 16), 96);
        assert_eq!(loadable_prefix(100, 40, 16), 32);
        assert_eq!(loadable_prefix(0, 40, 16), 0);
    }
}
