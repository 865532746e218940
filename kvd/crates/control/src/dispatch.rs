//! Lumen's recovery dispatch: holders first, then a choice, by a cost model, of which
//! survivors take the recomputations.
//!
//! # Why not spread everything evenly
//!
//! A restored request whose checkpoint loads locally needs a host-to-GPU copy and a prefill of
//! the few tokens since its last checkpoint (16 at most): a few milliseconds. A recomputed one
//! (its holder died too, or it had no checkpoint yet) prefills its whole history: a thousand
//! tokens or more, several iterations. An engine resumes the requests handed to it in the
//! order they become ready, and a recomputation is ready at once while a restore waits for its
//! copy, so every recomputation on a survivor runs ahead of that survivor's restores. Spreading
//! recomputations evenly over all survivors (what a count-balanced dispatch does) therefore
//! puts a queue of long prefills in front of *every* cheap restore. With several simultaneous
//! failures this is most of the stall: the recovery trace (`kvd sim run --trace`) shows local
//! restores with a 16-token suffix waiting half a second. A fixed ring avoids it by accident:
//! its restores all land on the ring successors, and the recomputations go to the others.
//!
//! # What it does
//!
//! 1. Holders first: a request whose holder survived goes to its holder.
//! 2. For a few candidate numbers `k` of *sinks* (every count up to 8, then a quarter more
//!    each step, up to the number of recomputations, one survivor short of all), the `k`
//!    survivors with the fewest restores take every recomputation (longest first, each to
//!    the sink with the least work so far); their restores
//!    move to the other survivors (pulled over the network from the holder); restores are then
//!    rebalanced among the non-sinks by the requests each runs in all, its own and those
//!    handed to it ([`rebalance_among`]: smallest checkpointed prefix moves first).
//! 3. Each candidate, and the reference (every survivor a sink: restores stay at their
//!    holders, rebalanced the same way, and recomputations spread by work), is scored by the
//!    estimated sum of stalls (below). The candidate with the lowest sum wins, among those
//!    whose estimated largest stall (the recovery time) is at most the reference's plus the
//!    longest single recomputation (the estimate's resolution): fewer sinks shorten the typical stall but
//!    lengthen the sinks' queues, and the recovery time must not pay for the mean. Ties: the
//!    reference, then fewer sinks. Every candidate is evaluated: feasibility is not monotone
//!    in `k` (too few sinks lengthen their queues, too many pile the restores on the rest).
//!
//! 4. When the engines' sequence cap is known (`kvd control --engine-max-seqs`), the winner's
//!    requests are moved off survivors over the cap onto those with room ([`fit_slots`]): a
//!    request beyond an engine's batch waits for a running one to finish, a cost the estimate
//!    below does not see (the simulator's engines never run out of slots).
//!
//! The estimate, per survivor: prefill work runs one request at a time from `q_w` plus the
//! prefill already queued there (requests sent and not yet prefilled:
//! [`crate::load::WorkerLoad::busy_ms`]),
//! recomputations first (`history / prefill rate` each), then restores in the order their
//! copies finish (`loaded bytes / host-to-GPU bandwidth`, doubled when pulled over the network,
//! on one copy queue), each finishing at `max(copy done, prefill free) + suffix / prefill rate`.
//! It is coarse (an engine interleaves chunks of several prefills with decodes), but it ranks
//! the candidates the way the engine's order does. Bounded: at most 40 candidates for 4096
//! survivors, each `O(requests · log requests + requests · survivors)`.

use std::collections::BTreeMap;

use super::WorkerId;
use super::load::LoadTable;
use super::placement::ScoreParams;
use super::recovery::{Dispatch, Dispatched, Interrupted, rebalance_among};

/// Lumen's dispatch of one failure (see the module docs).
pub fn dispatch_by_cost(
    load: &LoadTable,
    interrupted: &[Interrupted],
    p: ScoreParams,
) -> Dispatched {
    let mut best = by_cost(load, interrupted, p);
    fit_slots(load, interrupted, &mut best, p.engine_max_seqs);
    best
}

/// Steps 1 to 3: the candidate with the lowest estimated stall sum.
fn by_cost(load: &LoadTable, interrupted: &[Interrupted], p: ScoreParams) -> Dispatched {
    let survivors: Vec<WorkerId> = load.in_service().map(|w| w.id).collect();
    if survivors.is_empty() {
        return Dispatched::default(); // nobody to resume on: every request fails
    }
    let spread = with_sinks(load, &survivors, interrupted, survivors.len(), p);
    let recomputes = interrupted.iter().filter(|r| !restorable(load, r)).count();
    if survivors.len() < 2 || recomputes == 0 {
        return spread;
    }
    let spread_est = estimate(load, interrupted, &spread, p);
    let max_allowed = spread_est.max_ms + spread_est.longest_recompute_ms;
    let mut best_sum = spread_est.sum_ms;
    let mut best = spread;
    for k in sink_counts(survivors.len(), recomputes) {
        let cand = with_sinks(load, &survivors, interrupted, k, p);
        let est = estimate(load, interrupted, &cand, p);
        if est.max_ms <= max_allowed && est.sum_ms < best_sum {
            (best_sum, best) = (est.sum_ms, cand);
        }
    }
    best
}

/// Step 4 (when the engines' sequence cap is known): no survivor is handed more than its free
/// batch slots while another has room. An engine runs at most `cap` sequences; a request over
/// the cap waits for a running one to finish (seconds of decode), which no copy or prefill
/// estimate sees. While the survivor with the most requests (those it serves plus those
/// handed to it) is over the cap and has two more than the one with the fewest, one of its
/// handed requests moves there: a recomputation first (it loses nothing by moving), the
/// longest; else a restore, pulled over the network from its holder. When every survivor is
/// over, this evens the queues. Bounded: at most one move per interrupted request.
fn fit_slots(load: &LoadTable, interrupted: &[Interrupted], d: &mut Dispatched, cap: u32) {
    if cap == 0 {
        return;
    }
    let mut count: BTreeMap<WorkerId, u32> = load
        .in_service()
        .map(|w| (w.id, w.serving_requests))
        .collect();
    for x in &d.dispatches {
        *count.entry(x.target).or_default() += 1;
    }
    for _ in 0..d.dispatches.len() {
        let key = |(w, c): (&WorkerId, &u32)| (*c, std::cmp::Reverse(*w));
        let (Some((&over, &most)), Some((&under, &fewest))) = (
            count.iter().max_by_key(|e| key(*e)),
            count.iter().min_by_key(|e| key(*e)),
        ) else {
            return;
        };
        if most <= cap || most < fewest + 2 {
            return;
        }
        let Some(i) = d
            .dispatches
            .iter()
            .enumerate()
            .filter(|(_, x)| x.target == over)
            .max_by_key(|(_, x)| {
                let r = lookup(interrupted, x.request_id);
                (x.kv_source.is_none(), r.history_tokens, r.request_id)
            })
            .map(|(i, _)| i)
        else {
            return; // over the cap with its own requests only: nothing handed to move
        };
        d.dispatches[i].target = under;
        d.rebalance_moves += 1;
        *count.get_mut(&over).expect("counted") -= 1;
        *count.get_mut(&under).expect("counted") += 1;
    }
}

/// Whether `r` can load its checkpoint from a holder still in service.
fn restorable(load: &LoadTable, r: &Interrupted) -> bool {
    r.live_holder
        .is_some_and(|h| load.get(h).is_some_and(|w| w.in_service()))
}

/// The candidate numbers of sinks below every survivor: each count up to 8, then a quarter
/// more each step, up to `min(survivors − 1, recomputes)` (at most ~40 for 4096 survivors).
fn sink_counts(survivors: usize, recomputes: usize) -> Vec<usize> {
    let top = recomputes.min(survivors - 1).max(1);
    let mut ks: Vec<usize> = Vec::new();
    let mut k = 1usize;
    while k < top {
        ks.push(k);
        k = if k < 8 { k + 1 } else { k + k.div_ceil(4) };
    }
    ks.push(top);
    ks
}

/// The dispatch with `k` sinks taking every recomputation (see the module docs, step 2). With
/// `k` = every survivor, restores stay at their holders and recomputations spread by work.
fn with_sinks(
    load: &LoadTable,
    survivors: &[WorkerId],
    interrupted: &[Interrupted],
    k: usize,
    p: ScoreParams,
) -> Dispatched {
    debug_assert!(k >= 1 && k <= survivors.len());
    let (sinks, others) = split_sinks(load, survivors, interrupted, k);
    let (mut restores, moves) = place_restores(load, interrupted, &sinks, &others);
    let checkpointed = checkpointed_of(interrupted, &restores);
    let moves = moves + rebalance_among(load, &others, &mut restores, &checkpointed);
    let mut work: BTreeMap<WorkerId, f64> = sinks.iter().map(|&w| (w, 0.0)).collect();
    for d in &restores {
        if let Some(w) = work.get_mut(&d.target) {
            *w += restore_ms(lookup(interrupted, d.request_id), d, p);
        }
    }
    let mut dispatches = restores;
    dispatches.extend(recompute_targets(load, interrupted, work, p));
    dispatches.sort_unstable_by_key(|d| d.request_id);
    Dispatched {
        dispatches,
        rebalance_moves: moves,
    }
}

/// The `k` survivors with the fewest holder-first restores (ties: lower `busy_w`, lower id) and
/// the others, each sorted by id. With `k` = every survivor, both are every survivor.
fn split_sinks(
    load: &LoadTable,
    survivors: &[WorkerId],
    interrupted: &[Interrupted],
    k: usize,
) -> (Vec<WorkerId>, Vec<WorkerId>) {
    if k == survivors.len() {
        return (survivors.to_vec(), survivors.to_vec());
    }
    let q = |w: WorkerId| load.busy_ms(w);
    let mut restores_on: BTreeMap<WorkerId, u32> = survivors.iter().map(|&w| (w, 0)).collect();
    for r in interrupted.iter().filter(|r| restorable(load, r)) {
        *restores_on
            .entry(r.live_holder.expect("restorable"))
            .or_default() += 1;
    }
    let mut by_restores = survivors.to_vec();
    by_restores.sort_by(|a, b| {
        (restores_on[a], q(*a), *a)
            .partial_cmp(&(restores_on[b], q(*b), *b))
            .expect("queue delays are finite")
    });
    let (sinks, others) = by_restores.split_at(k);
    let (mut sinks, mut others) = (sinks.to_vec(), others.to_vec());
    sinks.sort_unstable();
    others.sort_unstable();
    (sinks, others)
}

/// Every restorable request at its holder, or, when its holder is a sink (and not every
/// survivor is), at the non-sink with the fewest restores so far, pulling the KV over the
/// network. Returns the dispatches (request-id order) and the moves made.
fn place_restores(
    load: &LoadTable,
    interrupted: &[Interrupted],
    sinks: &[WorkerId],
    others: &[WorkerId],
) -> (Vec<Dispatch>, u32) {
    let every_survivor_a_sink = sinks == others;
    let q = |w: WorkerId| load.busy_ms(w);
    let mut count: BTreeMap<WorkerId, u32> = others.iter().map(|&w| (w, 0)).collect();
    for r in interrupted.iter().filter(|r| restorable(load, r)) {
        if let Some(c) = count.get_mut(&r.live_holder.expect("restorable")) {
            *c += 1;
        }
    }
    let mut moves = 0u32;
    let mut out = Vec::new();
    for r in interrupted.iter().filter(|r| restorable(load, r)) {
        let h = r.live_holder.expect("restorable");
        let mut target = h;
        if !every_survivor_a_sink && sinks.binary_search(&h).is_ok() {
            target = *others
                .iter()
                .min_by(|a, b| {
                    (count[*a], q(**a), **a)
                        .partial_cmp(&(count[*b], q(**b), **b))
                        .expect("finite")
                })
                .expect("at least one survivor is not a sink");
            *count.get_mut(&target).expect("a non-sink") += 1;
            moves += 1;
        }
        out.push(Dispatch {
            request_id: r.request_id,
            target,
            kv_source: Some(h),
        });
    }
    (out, moves)
}

/// Each restore's checkpointed prefix, in the same order (the rebalancing moves the smallest).
fn checkpointed_of(interrupted: &[Interrupted], restores: &[Dispatch]) -> Vec<u32> {
    restores
        .iter()
        .map(|d| lookup(interrupted, d.request_id).checkpointed_tokens)
        .collect()
}

fn lookup(interrupted: &[Interrupted], id: super::RequestId) -> &Interrupted {
    let i = interrupted
        .binary_search_by_key(&id, |r| r.request_id)
        .expect("a dispatched request is interrupted");
    &interrupted[i]
}

/// Where each recomputation goes: longest first, each to the sink with the least work so far
/// (`work` starts with the restores already there; ties: lower `busy_w`, lower id), which keeps
/// the busiest sink short.
fn recompute_targets(
    load: &LoadTable,
    interrupted: &[Interrupted],
    mut work: BTreeMap<WorkerId, f64>,
    p: ScoreParams,
) -> Vec<Dispatch> {
    let q = |w: WorkerId| load.busy_ms(w);
    let mut todo: Vec<&Interrupted> = interrupted
        .iter()
        .filter(|r| !restorable(load, r))
        .collect();
    todo.sort_by(|a, b| {
        b.history_tokens
            .cmp(&a.history_tokens)
            .then(a.request_id.cmp(&b.request_id))
    });
    let mut out = Vec::with_capacity(todo.len());
    for r in todo {
        let (&t, _) = work
            .iter()
            .min_by(|a, b| {
                (*a.1, q(*a.0), *a.0)
                    .partial_cmp(&(*b.1, q(*b.0), *b.0))
                    .expect("finite")
            })
            .expect("at least one sink");
        *work.get_mut(&t).expect("a sink") += recompute_ms(r, p);
        out.push(Dispatch {
            request_id: r.request_id,
            target: t,
            kv_source: None,
        });
    }
    out
}

/// A restore's estimated work on its target, ms: the copy (doubled when pulled over the
/// network) and the suffix prefill.
fn restore_ms(r: &Interrupted, d: &Dispatch, p: ScoreParams) -> f64 {
    let (copy, suffix) = restore_parts_ms(r, d, p);
    copy + suffix
}

fn restore_parts_ms(r: &Interrupted, d: &Dispatch, p: ScoreParams) -> (f64, f64) {
    let loaded = r.checkpointed_tokens.min(r.history_tokens);
    let copy =
        f64::from(loaded) * r.bytes_per_token as f64 / p.host_to_gpu_bytes_per_ms.max(1) as f64;
    let copy = if d.kv_source == Some(d.target) {
        copy
    } else {
        2.0 * copy
    };
    (copy, prefill_ms(r.history_tokens - loaded, p))
}

fn prefill_ms(tokens: u32, p: ScoreParams) -> f64 {
    f64::from(tokens) / f64::from(p.prefill_tokens_per_ms.max(1))
}

fn recompute_ms(r: &Interrupted, p: ScoreParams) -> f64 {
    prefill_ms(r.history_tokens, p)
}

/// The estimated stalls of one candidate dispatch.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct StallEstimate {
    /// Sum of the stalls, ms.
    pub sum_ms: f64,
    /// The largest stall (the recovery time), ms.
    pub max_ms: f64,
    /// Requests counted.
    pub requests: u32,
    /// The longest single recomputation, ms: the resolution of the estimate (an engine
    /// interleaves prefills in chunks, so finishing times are known to about one job).
    pub longest_recompute_ms: f64,
}

/// Per target: the recompute work (ms each) and the restores (copy ms, suffix ms) it resumes.
type Work = (Vec<f64>, Vec<(f64, f64)>);

/// The estimated stalls of `d` (see the module docs).
pub fn estimate(
    load: &LoadTable,
    interrupted: &[Interrupted],
    d: &Dispatched,
    p: ScoreParams,
) -> StallEstimate {
    let mut per: BTreeMap<WorkerId, Work> = BTreeMap::new();
    for x in &d.dispatches {
        let Ok(i) = interrupted.binary_search_by_key(&x.request_id, |r| r.request_id) else {
            continue;
        };
        let r = &interrupted[i];
        let e = per.entry(x.target).or_default();
        match x.kv_source {
            Some(_) => e.1.push(restore_parts_ms(r, x, p)),
            None => e.0.push(recompute_ms(r, p)),
        }
    }
    let mut est = StallEstimate {
        longest_recompute_ms: per
            .values()
            .flat_map(|w| w.0.iter().copied())
            .fold(0.0, f64::max),
        ..StallEstimate::default()
    };
    let mut add = |stall: f64| {
        est.sum_ms += stall;
        est.max_ms = est.max_ms.max(stall);
        est.requests += 1;
    };
    for (w, (recomputes, restores)) in per {
        let mut free = load.busy_ms(w);
        for work in recomputes {
            free += work;
            add(free);
        }
        let mut copied = 0.0;
        for (copy, suffix) in restores {
            copied += copy;
            free = free.max(copied) + suffix;
            add(free);
        }
    }
    est
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::load::WorkerLoad;

    const P: ScoreParams = ScoreParams {
        lambda: 1.0,
        host_to_gpu_bytes_per_ms: 25_000_000,
        prefill_tokens_per_ms: 20,
        engine_max_seqs: 0,
    };

    fn table(ids: std::ops::Range<WorkerId>) -> LoadTable {
        let mut t = LoadTable::new();
        for i in ids {
            t.insert(WorkerLoad::new(i, 1 << 40));
        }
        t
    }

    /// `restores` requests of 1,010 tokens checkpointed on holders 1..=`holders` round-robin,
    /// then `recomputes` of 2,000 tokens without a live holder (ids from 0).
    fn failure(holders: u64, restores: u64, recomputes: u64) -> Vec<Interrupted> {
        (0..restores + recomputes)
            .map(|i| Interrupted {
                request_id: i,
                live_holder: (i < restores).then_some(1 + (i % holders) as WorkerId),
                checkpointed_tokens: if i < restores { 1008 } else { 0 },
                history_tokens: if i < restores { 1010 } else { 2000 },
                bytes_per_token: 160_000,
            })
            .collect()
    }

    #[test]
    fn recomputations_are_kept_off_the_survivors_that_serve_the_cheap_restores() {
        // 8 survivors with 5 restores each (~6 ms of copy, a 2-token suffix) and 4
        // recomputations of 100 ms. Spread by count, 4 survivors put a recomputation in front
        // of their restores; two sinks take the recomputations instead, two each.
        let t = table(1..9);
        let rs = failure(8, 40, 4);
        let d = dispatch_by_cost(&t, &rs, P);
        let plain = with_sinks(&t, &[1, 2, 3, 4, 5, 6, 7, 8], &rs, 8, P);
        let serves = |w: WorkerId, recompute: bool| {
            d.dispatches
                .iter()
                .any(|x| x.target == w && x.kv_source.is_none() == recompute)
        };
        assert!(
            (1..9).all(|w| !(serves(w, true) && serves(w, false))),
            "no survivor serves both kinds: {:?}",
            d.dispatches
        );
        let (est, plain_est) = (estimate(&t, &rs, &d, P), estimate(&t, &rs, &plain, P));
        assert!(est.sum_ms < plain_est.sum_ms, "{est:?} vs {plain_est:?}");
        assert!(est.max_ms <= plain_est.max_ms + plain_est.longest_recompute_ms);
        assert_eq!(
            d.dispatches.len(),
            rs.len(),
            "every request dispatched once"
        );
        assert!(
            d.dispatches
                .windows(2)
                .all(|w| w[0].request_id < w[1].request_id),
            "in request-id order"
        );
    }

    #[test]
    fn with_every_checkpoint_alive_every_request_restores_at_its_holder() {
        let t = table(1..6);
        let rs = failure(5, 40, 0);
        let d = dispatch_by_cost(&t, &rs, P);
        assert!(d.dispatches.iter().all(|x| Some(x.target) == x.kv_source));
        assert_eq!(d.rebalance_moves, 0);
    }

    #[test]
    fn the_candidates_are_few_and_never_take_every_survivor_as_a_sink_but_the_last() {
        let ks = sink_counts(4096, 100_000);
        assert!(ks.len() <= 45, "{}", ks.len());
        assert_eq!(ks[..8], [1, 2, 3, 4, 5, 6, 7, 8]);
        assert_eq!(
            ks.last(),
            Some(&4095),
            "never every survivor (that is the reference)"
        );
        assert_eq!(sink_counts(5, 2), [1, 2]);
    }

    #[test]
    fn with_a_known_batch_cap_no_survivor_is_handed_past_it_while_another_has_room() {
        // Two survivors of four: worker 1 serves 5, worker 4 serves 3, cap 8. Eleven
        // interrupted requests: three restorable at worker 1, eight to recompute. The cost
        // model alone may pile the recomputations on one sink; with the cap, no survivor ends
        // more than one request above the other while either is over 8.
        let mut t = table(1..5);
        for (w, serving) in [(1, 5), (4, 3)] {
            t.get_mut(w).expect("row").serving_requests = serving;
        }
        for w in [2, 3] {
            t.get_mut(w).expect("row").phase = crate::load::WorkerPhase::Failed;
        }
        let rs = failure(1, 3, 8);
        let capped = ScoreParams {
            engine_max_seqs: 8,
            ..P
        };
        let d = dispatch_by_cost(&t, &rs, capped);
        assert_eq!(
            d.dispatches.len(),
            rs.len(),
            "every request dispatched once"
        );
        let on = |w: WorkerId, base: u32| {
            base + d.dispatches.iter().filter(|x| x.target == w).count() as u32
        };
        let (a, b) = (on(1, 5), on(4, 3));
        assert_eq!(a + b, 19);
        assert!(a.abs_diff(b) <= 1, "balanced over the cap: {a} and {b}");
        assert!(
            d.dispatches
                .iter()
                .all(|x| x.kv_source.is_none() || x.kv_source == Some(1)),
            "restores still load from their holder: {:?}",
            d.dispatches
        );
        // Without the cap the same failure is left to the cost model (the old behaviour).
        let free = dispatch_by_cost(&t, &rs, P);
        assert_eq!(free, by_cost(&t, &rs, P));
    }

    #[test]
    fn under_the_cap_the_slots_change_nothing() {
        let t = table(1..6);
        let rs = failure(5, 10, 2);
        let capped = ScoreParams {
            engine_max_seqs: 64,
            ..P
        };
        assert_eq!(dispatch_by_cost(&t, &rs, capped), by_cost(&t, &rs, P));
    }
}
