//! What a request keeps of its prefill/decode hand-off (P/D mode, `--prefill-engine`): the
//! prefill in flight, the prefill workers it broke on, the prefill answer's `kv_transfer_params`
//! the decode attempts carry until the first token, and the hold the prefill node's daemon keeps
//! the prompt's blocks under, ended exactly once.
//!
//! | Window                                   | What the front does                                  |
//! |------------------------------------------|------------------------------------------------------|
//! | prefill breaks (5xx, no connection, silence) | its epoch's hold ends; epoch + 1, prefill on another prefill worker; none left: the decode worker prefills itself |
//! | prefill refuses (4xx)                    | the request fails with the refusal                    |
//! | answer hands nothing over                | the decode worker prefills itself (its hold, if any, ends) |
//! | decode breaks before its first token     | the usual recovery; the survivor gets the hand-off params |
//! | decode refuses (4xx)                     | the hold ends at once; the request fails              |
//! | client leaves during the prefill         | the prefill's connection drops; the hold it may have made ends |
//! | decode's first token                     | the hold ends (the decode has loaded the blocks)      |
//! | an older epoch's answer comes late       | dropped, counted; the hold it names ends              |
//! | any terminal state                       | a hold not ended yet ends                             |

use kvd_control::{Epoch, WorkerId};
use serde_json::{Map, Value};

use super::body::Hold;

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
