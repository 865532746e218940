//! A request's prefill/decode hand-off (P/D mode, `--prefill-engine`): what it keeps (the
//! prefill in flight, the prefill workers it broke on, the prefill answer's `kv_transfer_params`
//! the decode attempts carry until the first token, and the hold the prefill node's daemon keeps
//! the prompt's blocks under, ended exactly once), and the request machine's transitions for it.
//!
//! | Window                                   | What the front does                                  |
//! |------------------------------------------|------------------------------------------------------|
//! | prefill breaks (5xx, no connection, silence) | its epoch's hold ends; epoch + 1, prefill on another prefill worker; none left: the decode worker prefills itself |
//! | prefill answers                         | its token goes to the client at once (unless the request is seeded, has stop strings or logprobs); the decode continues from prompt + that token |
//! | prefill refuses (4xx)                    | the request fails with the refusal                    |
//! | answer hands nothing over                | the decode worker prefills itself (its hold, if any, ends) |
//! | decode breaks before its first token     | the usual recovery; the survivor gets the hand-off params |
//! | decode refuses (4xx)                     | the hold ends at once; the request fails              |
//! | client leaves during the prefill         | the prefill's connection drops; the hold it may have made ends |
//! | decode's first token                     | the hold ends (the decode has loaded the blocks)      |
//! | an older epoch's answer comes late       | dropped, counted; the hold it names ends              |
//! | any terminal state                       | a hold not ended yet ends                             |

use kvd_control::{Epoch, Event, WorkerId};
use serde_json::{Map, Value};

use super::body::{Hold, first_token_barred, first_token_event, handoff_of, hold_of, prefill_body};
use super::relay::stamp;
use super::{Action, Attempt, Request, State};
use crate::stats::HandoffRecord;

/// The prefill in flight.
#[derive(Debug, Clone, Copy)]
pub(super) struct Prefill {
    pub epoch: Epoch,
    pub worker: WorkerId,
    pub at_ms: u64,
}

/// A prefill's answer that hands the prompt over.
#[derive(Debug, Clone)]
pub(super) struct Handoff {
    /// Its `kv_transfer_params`, passed on unchanged.
    pub params: Map<String, Value>,
    /// The prefill worker.
    pub from: WorkerId,
    /// When it answered, ms.
    pub answered_ms: u64,
    /// How long the prefill took, ms.
    pub prefill_ms: u64,
}

/// A request's P/D state.
#[derive(Debug, Default)]
pub(super) struct Pd {
    /// The prefill in flight.
    pub prefill: Option<Prefill>,
    /// Prefill workers whose prefill broke (each is tried once: at most the pool).
    pub tried: Vec<WorkerId>,
    /// The hand-off the decode attempts carry until the first token.
    pub handoff: Option<Handoff>,
    /// The decode worker prefills itself (no prefill worker left, or no hand-off).
    pub self_prefill: bool,
    /// The hold not ended yet.
    pub hold: Option<Hold>,
    /// Holds ended (one per prefill that answered or was dropped: bounded by the attempts).
    pub ended: Vec<Hold>,
}

impl Pd {
    /// Whether an attempt must prefill on a prefill worker first.
    pub fn wants_prefill(&self, generated: usize) -> bool {
        generated == 0 && self.handoff.is_none() && !self.self_prefill
    }

    /// Take `hold` to end, unless it was ended already.
    pub fn end(&mut self, hold: Hold) -> Option<Hold> {
        if self.hold == Some(hold) {
            self.hold = None;
        }
        if self.ended.contains(&hold) {
            return None;
        }
        self.ended.push(hold);
        Some(hold)
    }
}

/// Something of a P/D hand-off worth a log line and a counter (the driver writes both).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HandoffNote {
    /// The prefill answered with a hand-off: the decode attempt starts with its params.
    Started {
        /// The prefill worker.
        prefill: WorkerId,
        /// The decode worker.
        decode: WorkerId,
        /// How long the prefill took, ms.
        prefill_ms: u64,
        /// Why the prefill's token did not go to the client as its first (`None`: it did).
        not_relayed: Option<String>,
    },
    /// The decode's first token after a hand-off (its hold ended).
    Done(crate::stats::HandoffRecord),
    /// A prefill broke: the request goes on under `epoch` on another prefill worker (or the
    /// decode worker, if none is left).
    PrefillRetried {
        /// The prefill worker that broke.
        from: WorkerId,
        /// The new epoch.
        epoch: Epoch,
        /// Why.
        reason: String,
    },
    /// The decode worker prefills the prompt itself.
    SelfPrefill {
        /// Why.
        reason: String,
    },
    /// The prefill worker refused the request: it fails.
    PrefillRefused {
        /// Its HTTP status.
        status: u16,
    },
    /// The decode worker refused the hand-off's request: the hold ended, it fails.
    DecodeRefused,
    /// The decode broke before its first token: the survivor gets the hand-off params.
    Resumed {
        /// The survivor.
        to: WorkerId,
    },
    /// The client left during the prefill or the transfer: the hold ended.
    Cancelled {
        /// Where it was.
        during: kvd_control::RequestState,
    },
    /// An older epoch's prefill answer came late: dropped (its hold ended, if it named one).
    StaleAnswer {
        /// Its epoch.
        epoch: Epoch,
    },
}

/// The request machine's P/D transitions: the prefill's worker, answer and break, the hold's
/// ends, and the hand-off's end at the decode's first token.
impl Request {
    /// P/D: attempt `epoch` waits for its prefill worker.
    pub(super) fn picking(&self, epoch: Epoch) -> bool {
        epoch == self.epoch
            && self.state == State::Prefilling
            && self
                .pd
                .as_ref()
                .is_some_and(|pd| pd.prefill.is_none() && pd.handoff.is_none() && !pd.self_prefill)
    }

    /// P/D: attempt `epoch`'s prefill is in flight.
    pub(super) fn prefilling(&self, epoch: Epoch) -> bool {
        self.state == State::Prefilling
            && self.prefill_in_flight().is_some_and(|p| p.epoch == epoch)
    }

    pub(super) fn take_prefill(&mut self) -> Option<Prefill> {
        self.pd.as_mut().and_then(|pd| pd.prefill.take())
    }

    /// P/D: the prefill worker for this attempt (`None`: the decode worker prefills itself).
    pub(super) fn on_prefill_worker(
        &mut self,
        worker: Option<WorkerId>,
        now_ms: u64,
        out: &mut Vec<Action>,
    ) {
        let (request_id, epoch) = (self.a.id, self.epoch);
        let pd = self.pd.as_mut().expect("picking is P/D");
        let Some(worker) = worker else {
            pd.self_prefill = true;
            let reason = format!("no prefill worker is left ({} broke)", pd.tried.len());
            out.push(Action::Handoff(HandoffNote::SelfPrefill { reason }));
            self.control(Event::PrefillStarted { request_id, epoch }, out);
            return self.decode_attempt(false, out);
        };
        pd.prefill = Some(Prefill {
            epoch,
            worker,
            at_ms: now_ms,
        });
        self.control(Event::PrefillStarted { request_id, epoch }, out);
        out.push(Action::Prefill(Attempt {
            epoch,
            worker,
            body: prefill_body(
                &self.a.body,
                &self.a.prompt,
                self.a.min_tokens,
                request_id,
                epoch,
            ),
        }));
    }

    /// P/D: the prefill answered: the decode attempt carries its hand-off (or, with none, the
    /// decode worker prefills itself).
    pub(super) fn on_prefill_done(&mut self, answer: &Value, now_ms: u64, out: &mut Vec<Action>) {
        let p = self.take_prefill().expect("prefilling");
        let (params, hold) = handoff_of(answer, self.a.id);
        let prefill_ms = now_ms.saturating_sub(p.at_ms);
        self.end_hold(out); // none is held before a prefill answers; never leave one pinned
        let pd = self.pd.as_mut().expect("prefilling is P/D");
        pd.hold = hold;
        let not_relayed = self.prefill_token(answer, p.worker, out).err();
        if self.complete() {
            // the prefill's token was the request's last: nothing to hand over (the hold ends)
            return self.finish(out);
        }
        let pd = self.pd.as_mut().expect("prefilling is P/D");
        let Some(params) = params else {
            pd.self_prefill = true;
            let reason = format!(
                "worker {}'s prefill answer hands nothing over (no usable kv_transfer_params)",
                p.worker
            );
            out.push(Action::Handoff(HandoffNote::SelfPrefill { reason }));
            self.end_hold(out);
            return self.decode_attempt(false, out);
        };
        pd.handoff = Some(Handoff {
            params,
            from: p.worker,
            answered_ms: now_ms,
            prefill_ms,
        });
        out.push(Action::Handoff(HandoffNote::Started {
            prefill: p.worker,
            decode: self.serving,
            prefill_ms,
            not_relayed,
        }));
        self.start_attempt(out);
    }

    /// P/D: the prefill answer's token goes to the client at once, as the request's first: the
    /// decode continues from prompt + that token, as a recovery does from the committed ones,
    /// so time to first token is the prefill's, not the prefill's plus the hand-off's (`Err`:
    /// why not; the decode then generates the first token itself).
    fn prefill_token(
        &mut self,
        answer: &Value,
        worker: WorkerId,
        out: &mut Vec<Action>,
    ) -> Result<(), String> {
        // the front applies stop strings itself: they are off the body, still barring
        let stops = self.a.stops.as_ref().map(|_| "stop strings");
        if let Some(why) = first_token_barred(&self.a.body).or(stops) {
            return Err(format!("the request asks for {why}"));
        }
        let event = first_token_event(answer, self.a.max_tokens > 1)
            .ok_or("the prefill answer carries no single token id")?;
        let (value, n) = self.take_tokens(&event)?;
        let data = stamp(value, self.at(worker));
        self.push(&data, n, out);
        Ok(())
    }

    /// P/D: the prefill broke: epoch + 1 and prefill again elsewhere (at most once per prefill
    /// worker, never past the deadline).
    pub(super) fn on_prefill_broken(&mut self, reason: String, now_ms: u64, out: &mut Vec<Action>) {
        let p = self.take_prefill().expect("prefilling");
        // the engine may have held its run just before it broke, or may still: that epoch's
        // hold ends (a hold begun after the end is refused as stale at the node)
        let h = self.pd.as_mut().expect("prefilling is P/D").end(Hold {
            node: p.worker,
            epoch: p.epoch,
        });
        if let Some(h) = h {
            out.push(self.end_hold_action(h));
        }
        if now_ms >= self.a.deadline_ms {
            let msg = format!("the prefill broke ({reason}) past the request's deadline");
            return self.fail(&msg, out);
        }
        let pd = self.pd.as_mut().expect("prefilling is P/D");
        pd.tried.push(p.worker);
        self.control(
            Event::PrefillRetried {
                request_id: self.a.id,
                epoch: self.epoch,
            },
            out,
        );
        self.epoch += 1;
        out.push(Action::Handoff(HandoffNote::PrefillRetried {
            from: p.worker,
            epoch: self.epoch,
            reason,
        }));
        self.start_attempt(out);
    }

    /// P/D: a prefill answer of an older epoch (or one that came after the request moved on):
    /// dropped, and the hold it names ended so nothing stays pinned.
    pub(super) fn stale_answer(&mut self, epoch: Epoch, answer: &Value, out: &mut Vec<Action>) {
        self.stale_dropped += 1;
        let Some(pd) = self.pd.as_mut() else { return };
        out.push(Action::Handoff(HandoffNote::StaleAnswer { epoch }));
        if let Some(h) = hold_of(answer, self.a.id).and_then(|h| pd.end(h)) {
            out.push(self.end_hold_action(h));
        }
    }

    pub(super) fn end_hold_action(&self, h: Hold) -> Action {
        Action::EndHold {
            node: h.node,
            request: self.a.id,
            epoch: h.epoch,
        }
    }

    /// P/D: end the hand-off's hold, if one is held and not ended yet.
    pub(super) fn end_hold(&mut self, out: &mut Vec<Action>) {
        let Some(pd) = self.pd.as_mut() else { return };
        if let Some(h) = pd.hold.and_then(|h| pd.end(h)) {
            out.push(self.end_hold_action(h));
        }
    }

    /// P/D: the prefill in flight is dropped (its connection closes): the prefill may have
    /// finished and held the prompt's blocks at its node under its epoch, so that hold ends.
    pub(super) fn drop_prefill(&mut self, out: &mut Vec<Action>) {
        let Some(p) = self.take_prefill() else { return };
        out.push(Action::Cancel { epoch: p.epoch });
        let pd = self.pd.as_mut().expect("a prefill is P/D");
        let h = Hold {
            node: p.worker,
            epoch: p.epoch,
        };
        if let Some(h) = pd.end(h) {
            out.push(self.end_hold_action(h));
        }
    }

    /// P/D: the decode's first token: the blocks are loaded, the source's hold ends.
    pub(super) fn handoff_done(&mut self, now_ms: u64, out: &mut Vec<Action>) {
        let Some(h) = self.pd.as_mut().and_then(|pd| pd.handoff.take()) else {
            return;
        };
        let hold_node = self.pd.as_ref().and_then(|pd| pd.hold).map(|h| h.node);
        self.end_hold(out);
        let handoff_ms = now_ms.saturating_sub(h.answered_ms);
        out.push(Action::Handoff(HandoffNote::Done(HandoffRecord {
            request: self.a.id,
            epoch: self.epoch,
            prefill: h.from,
            decode: self.serving,
            hold_node,
            prefill_ms: h.prefill_ms,
            handoff_ms,
        })));
    }
}
