//! Admission and every per-request event: the epoch compare-and-swap, the checkpoint holder's
//! reservation, and retiring a request to a terminal state.

use serde::{Deserialize, Serialize};

use super::{Controller, Decision, Found, Stats};
use crate::load::{LoadTable, WorkerLoad};
use crate::policy::{Policy, PolicyKind};
use crate::request::{RequestRecord, RequestState};
use crate::{Epoch, RequestId, WorkerId};
use crate::{Error, Result};

/// A request as a gateway admits it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct AdmitRequest {
    /// Unique id.
    pub request_id: RequestId,
    /// The worker the router chose to serve it (must be in service).
    pub serving: WorkerId,
    /// Prompt length.
    pub prompt_tokens: u32,
    /// Generation limit.
    pub max_new_tokens: u32,
    /// Conservative checkpoint footprint (max context × bytes per token); 0 = no checkpoint.
    pub reserve_bytes: u64,
    /// Absolute deadline, ms on the caller's clock, if any.
    pub deadline_ms: Option<u64>,
}

/// The answer to an admission.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Admission {
    /// The request.
    pub request_id: RequestId,
    /// Its epoch (1 for a fresh admission); name it in every later event.
    pub epoch: Epoch,
    /// Where to stream its checkpoint (`None`: it runs without one).
    pub holder: Option<WorkerId>,
    /// Bytes reserved on the holder.
    pub reserved_bytes: u64,
}

impl Controller {
    /// Admit a request arriving at `now_ms` on `req.serving` and place its checkpoint.
    ///
    /// Replaying the same admission returns the same answer and changes nothing.
    ///
    /// # Errors
    /// [`Error::Unavailable`] when the serving worker is not in service; [`Error::NotFound`] for
    /// an unknown worker; [`Error::Overloaded`] beyond `max_in_flight`; [`Error::AlreadyExists`]
    /// when the id is taken by another request.
    pub fn admit(&mut self, req: AdmitRequest, now_ms: u64) -> Result<Admission> {
        if let Some(replayed) = self.replayed_admission(&req) {
            return replayed;
        }
        let w = self
            .load
            .get(req.serving)
            .ok_or_else(|| Error::NotFound(format!("worker {}", req.serving)))?;
        if !w.in_service() {
            return Err(Error::Unavailable(format!(
                "worker {} is {}",
                req.serving, w.phase
            )));
        }
        if self.requests.len() >= self.config.max_in_flight as usize {
            return Err(Error::Overloaded {
                what: format!("{} requests in flight", self.requests.len()),
                retry_after_ms: 10,
            });
        }
        let mut rec = RequestRecord {
            id: req.request_id,
            state: RequestState::Admitted,
            epoch: 1,
            serving: req.serving,
            holder: None,
            reserved_bytes: 0,
            reserve_bytes: req.reserve_bytes,
            checkpointed_tokens: 0,
            checkpoint_bytes: 0,
            prompt_tokens: req.prompt_tokens,
            max_new_tokens: req.max_new_tokens,
            generated_tokens: 0,
            acked_seq: None,
            arrival_ms: now_ms,
            deadline_ms: req.deadline_ms,
            migrations_left: self.config.migration_budget,
            migrations: 0,
            failure: None,
        };
        Self::place(
            &*self.policy,
            &mut self.load,
            &mut rec,
            &mut self.stats,
            true,
        );
        self.load
            .get_mut(req.serving)
            .expect("checked")
            .serving_requests += 1;
        self.stats.admitted += 1;
        let adm = Admission {
            request_id: rec.id,
            epoch: 1,
            holder: rec.holder,
            reserved_bytes: rec.reserved_bytes,
        };
        self.requests.insert(rec.id, rec);
        Ok(adm)
    }

    /// Admit a request that another front began and lost (its process died) at `lost_epoch`,
    /// taken over here: as [`Controller::admit`], at the epoch after it, so that nothing the
    /// lost front's attempts wrote (checkpoints under their epochs) passes for this one's.
    ///
    /// # Errors
    /// Those of [`Controller::admit`]; [`Error::AlreadyExists`] when the id is known here.
    pub fn admit_taken_over(
        &mut self,
        req: AdmitRequest,
        lost_epoch: Epoch,
        now_ms: u64,
    ) -> Result<Admission> {
        if self.request(req.request_id).is_some() {
            return Err(Error::AlreadyExists(format!("request {}", req.request_id)));
        }
        let mut adm = self.admit(req, now_ms)?;
        adm.epoch = lost_epoch.saturating_add(1).max(1);
        if let Some(r) = self.requests.get_mut(&adm.request_id) {
            r.epoch = adm.epoch;
        }
        Ok(adm)
    }

    /// The answer to an admission of an id already known: the same answer for a replay of the
    /// same admission, [`Error::AlreadyExists`] for another request under that id.
    fn replayed_admission(&mut self, req: &AdmitRequest) -> Option<Result<Admission>> {
        let rec = self.request(req.request_id)?;
        let same = rec.prompt_tokens == req.prompt_tokens
            && rec.max_new_tokens == req.max_new_tokens
            && rec.reserve_bytes == req.reserve_bytes
            && rec.epoch == 1
            && rec.migrations == 0;
        if !same {
            return Some(Err(Error::AlreadyExists(format!(
                "request {}",
                req.request_id
            ))));
        }
        let adm = Admission {
            request_id: rec.id,
            epoch: rec.epoch,
            holder: rec.holder,
            reserved_bytes: rec.reserved_bytes,
        };
        self.stats.duplicate_events += 1;
        Some(Ok(adm))
    }

    /// Prefill started. From `ADMITTED` this records a queueing-delay sample
    /// (`now − arrival`) on the serving worker.
    ///
    /// # Errors
    /// As the epoch check: unknown request, stale or future epoch, cancelled request.
    pub fn prefill_started(
        &mut self,
        id: RequestId,
        epoch: Epoch,
        now_ms: u64,
    ) -> Result<Vec<Decision>> {
        let window = self.config.queue_delay_window;
        let Some(rec) = self.advance(id, epoch, RequestState::Prefilling)? else {
            return Ok(vec![]);
        };
        if rec.0 == RequestState::Admitted {
            let (serving, arrival) = (rec.1, rec.2);
            if let Some(w) = self.load.get_mut(serving) {
                w.record_delay(now_ms.saturating_sub(arrival), window);
            }
        }
        Ok(vec![])
    }

    /// The prefill of `epoch` failed on a prefill worker the controller does not place (P/D):
    /// a new incarnation under epoch + 1, `MIGRATING`, on the same serving worker. Only a request
    /// that has not begun its transfer can retry its prefill.
    ///
    /// # Errors
    /// As the epoch check; [`Error::InvalidArgument`] past `PREFILLING`.
    pub fn prefill_retried(
        &mut self,
        id: RequestId,
        epoch: Epoch,
        _now_ms: u64,
    ) -> Result<Vec<Decision>> {
        let Found::Live = self.checked(id, epoch)? else {
            return Ok(vec![]);
        };
        let rec = self.requests.get_mut(&id).expect("live");
        if !matches!(rec.state, RequestState::Admitted | RequestState::Prefilling) {
            return Err(Error::InvalidArgument(format!(
                "request {id} is {}: only a prefill retries",
                rec.state
            )));
        }
        rec.epoch += 1;
        rec.state = RequestState::Migrating;
        Ok(vec![])
    }

    /// KV hand-off to decode worker `to` started; `to` serves the request from now on. When `to`
    /// was its holder, the checkpoint moves elsewhere ([`Decision::Checkpoint`]).
    ///
    /// # Errors
    /// As the epoch check; [`Error::Unavailable`] when `to` is not in service.
    pub fn transfer_started(
        &mut self,
        id: RequestId,
        epoch: Epoch,
        to: WorkerId,
        _now_ms: u64,
    ) -> Result<Vec<Decision>> {
        if !self.load.get(to).is_some_and(WorkerLoad::in_service) {
            // Validate the request first so stale events are still counted as stale.
            self.checked(id, epoch)?;
            return Err(Error::Unavailable(format!("worker {to} is not in service")));
        }
        let Some(_) = self.advance(id, epoch, RequestState::Transferring)? else {
            return Ok(vec![]);
        };
        let rec = self.requests.get_mut(&id).expect("advanced");
        let mut out = vec![];
        if rec.serving != to {
            if let Some(w) = self.load.get_mut(rec.serving) {
                w.serving_requests = w.serving_requests.saturating_sub(1);
            }
            Self::reattribute_holder(&mut self.load, rec, to);
            rec.serving = to;
            self.load.get_mut(to).expect("in service").serving_requests += 1;
            if rec.holder == Some(to) {
                Self::release_holder(&mut self.load, rec);
                Self::place(&*self.policy, &mut self.load, rec, &mut self.stats, false);
                self.stats.checkpoint_moves += 1;
                out.push(Decision::Checkpoint {
                    request_id: id,
                    epoch,
                    holder: rec.holder,
                });
            }
        }
        self.debug_check();
        Ok(out)
    }

    /// Decoding started.
    ///
    /// # Errors
    /// As the epoch check.
    pub fn decoding_started(
        &mut self,
        id: RequestId,
        epoch: Epoch,
        _now_ms: u64,
    ) -> Result<Vec<Decision>> {
        self.advance(id, epoch, RequestState::Decoding)?;
        Ok(vec![])
    }

    /// The engine committed `generated_tokens` generated tokens in all (monotonic; a smaller
    /// number is a replay).
    ///
    /// # Errors
    /// As the epoch check; [`Error::InvalidArgument`] beyond `max_new_tokens`.
    pub fn tokens_committed(
        &mut self,
        id: RequestId,
        epoch: Epoch,
        generated_tokens: u32,
        _now_ms: u64,
    ) -> Result<Vec<Decision>> {
        let Found::Live = self.checked(id, epoch)? else {
            return Ok(vec![]);
        };
        let rec = self.requests.get_mut(&id).expect("live");
        if generated_tokens > rec.max_new_tokens {
            return Err(Error::InvalidArgument(format!(
                "request {id}: {generated_tokens} tokens committed, limit {}",
                rec.max_new_tokens
            )));
        }
        if generated_tokens <= rec.generated_tokens || !rec.state.is_running() {
            self.stats.duplicate_events += 1;
        } else {
            rec.generated_tokens = generated_tokens;
        }
        Ok(vec![])
    }

    /// The holder published a verified checkpoint of `tokens` tokens in `bytes` bytes
    /// (monotonic).
    ///
    /// # Errors
    /// As the epoch check; [`Error::InvalidArgument`] without a holder, or beyond the
    /// history or the reservation.
    pub fn checkpoint_stored(
        &mut self,
        id: RequestId,
        epoch: Epoch,
        tokens: u32,
        bytes: u64,
        _now_ms: u64,
    ) -> Result<Vec<Decision>> {
        let Found::Live = self.checked(id, epoch)? else {
            return Ok(vec![]);
        };
        let rec = self.requests.get_mut(&id).expect("live");
        if rec.holder.is_none() {
            return Err(Error::InvalidArgument(format!(
                "request {id} has no checkpoint holder"
            )));
        }
        if tokens > rec.history_tokens() || bytes > rec.reserved_bytes {
            return Err(Error::InvalidArgument(format!(
                "request {id}: checkpoint of {tokens} tokens / {bytes} bytes exceeds history {} / reservation {}",
                rec.history_tokens(),
                rec.reserved_bytes
            )));
        }
        if tokens <= rec.checkpointed_tokens {
            self.stats.duplicate_events += 1;
        } else {
            rec.checkpointed_tokens = tokens;
            rec.checkpoint_bytes = bytes;
        }
        Ok(vec![])
    }

    /// The gateway acknowledged stream frame `sequence_no` (monotonic).
    ///
    /// # Errors
    /// As the epoch check.
    pub fn frame_acked(
        &mut self,
        id: RequestId,
        epoch: Epoch,
        sequence_no: u64,
        _now_ms: u64,
    ) -> Result<Vec<Decision>> {
        let Found::Live = self.checked(id, epoch)? else {
            return Ok(vec![]);
        };
        let rec = self.requests.get_mut(&id).expect("live");
        if rec.acked_seq.is_some_and(|a| a >= sequence_no) {
            self.stats.duplicate_events += 1;
        } else {
            rec.acked_seq = Some(sequence_no);
        }
        Ok(vec![])
    }

    /// The request finished: `COMPLETED`, its reservation released.
    ///
    /// # Errors
    /// As the epoch check; [`Error::InvalidArgument`] while cancelling.
    pub fn finished(&mut self, id: RequestId, epoch: Epoch, _now_ms: u64) -> Result<Vec<Decision>> {
        let Found::Live = self.checked(id, epoch)? else {
            return Ok(vec![]);
        };
        if !self.requests[&id].state.is_running() {
            return Err(Error::InvalidArgument(format!(
                "request {id} is {}",
                self.requests[&id].state
            )));
        }
        self.retire(id, RequestState::Completed, None);
        Ok(vec![])
    }

    /// The client cancels: `CANCELLING` under a new epoch (so every late event of the running
    /// incarnation is dropped), and a [`Decision::Cancel`] for the worker. A request that is
    /// cancelling or terminal is left alone.
    ///
    /// # Errors
    /// [`Error::NotFound`] for an unknown request.
    pub fn cancel(&mut self, id: RequestId, _now_ms: u64) -> Result<Vec<Decision>> {
        if self.terminal.contains_key(&id) {
            self.stats.duplicate_events += 1;
            return Ok(vec![]);
        }
        let rec = self
            .requests
            .get_mut(&id)
            .ok_or_else(|| Error::NotFound(format!("request {id}")))?;
        if rec.state == RequestState::Cancelling {
            self.stats.duplicate_events += 1;
            return Ok(vec![]);
        }
        rec.epoch += 1;
        rec.state = RequestState::Cancelling;
        Ok(vec![Decision::Cancel {
            request_id: id,
            epoch: rec.epoch,
            worker: rec.serving,
        }])
    }

    /// The worker confirms the cancel: `CANCELLED`, reservation released.
    ///
    /// # Errors
    /// As the epoch check; [`Error::InvalidArgument`] when no cancel is pending.
    pub fn cancelled(
        &mut self,
        id: RequestId,
        epoch: Epoch,
        _now_ms: u64,
    ) -> Result<Vec<Decision>> {
        let Found::Live = self.checked(id, epoch)? else {
            return Ok(vec![]);
        };
        if self.requests[&id].state != RequestState::Cancelling {
            return Err(Error::InvalidArgument(format!(
                "request {id} has no pending cancel"
            )));
        }
        self.retire(id, RequestState::Cancelled, None);
        Ok(vec![])
    }

    /// The engine failed the request: `FAILED`, reservation released.
    ///
    /// # Errors
    /// As the epoch check.
    pub fn request_failed(
        &mut self,
        id: RequestId,
        epoch: Epoch,
        reason: &str,
        _now_ms: u64,
    ) -> Result<Vec<Decision>> {
        let Found::Live = self.checked(id, epoch)? else {
            return Ok(vec![]);
        };
        let reason: String = reason.chars().take(512).collect();
        self.retire(id, RequestState::Failed, Some(reason));
        Ok(vec![])
    }

    /// The compare half of the CAS: the request exists and `epoch` is its current epoch.
    /// Stale epochs are counted and refused; a terminal request's own epoch is a duplicate.
    pub(super) fn checked(&mut self, id: RequestId, epoch: Epoch) -> Result<Found> {
        let (rec, found) = match self.requests.get(&id) {
            Some(r) => (r, Found::Live),
            None => match self.terminal.get(&id) {
                Some(r) => (r, Found::Terminal),
                None => return Err(Error::NotFound(format!("request {id}"))),
            },
        };
        if let Err(e) = rec.check_epoch(epoch) {
            if matches!(e, Error::StaleEpoch { .. }) {
                self.stats.stale_events += 1;
            }
            return Err(e);
        }
        if let Found::Terminal = found {
            self.stats.duplicate_events += 1;
        }
        Ok(found)
    }

    /// Move a running request forward to `to` within its epoch. Returns the previous state,
    /// serving worker and arrival time when something changed, `None` for a replay.
    pub(super) fn advance(
        &mut self,
        id: RequestId,
        epoch: Epoch,
        to: RequestState,
    ) -> Result<Option<(RequestState, WorkerId, u64)>> {
        let Found::Live = self.checked(id, epoch)? else {
            return Ok(None);
        };
        let rec = self.requests.get_mut(&id).expect("live");
        let (Some(from), Some(target)) = (rec.state.progress_rank(), to.progress_rank()) else {
            return Err(Error::InvalidArgument(format!(
                "request {id} is {}, cannot become {to}",
                rec.state
            )));
        };
        if from >= target && rec.state != RequestState::Migrating {
            self.stats.duplicate_events += 1;
            return Ok(None);
        }
        let prev = rec.state;
        rec.state = to;
        Ok(Some((prev, rec.serving, rec.arrival_ms)))
    }

    pub(super) fn release_holder(load: &mut LoadTable, rec: &mut RequestRecord) {
        if let Some(h) = rec.holder.take() {
            load.get_mut(h)
                .expect("a holder is in service")
                .release(rec.reserved_bytes, rec.serving);
        }
        rec.reserved_bytes = 0;
        rec.checkpointed_tokens = 0;
        rec.checkpoint_bytes = 0;
    }

    /// `rec` is about to be served by `to`: its holder's bytes for it count for `to` from now on
    /// (call before changing `rec.serving`).
    pub(super) fn reattribute_holder(load: &mut LoadTable, rec: &RequestRecord, to: WorkerId) {
        if let Some(h) = rec.holder {
            load.get_mut(h)
                .expect("a holder is in service")
                .reattribute(rec.serving, to, rec.reserved_bytes);
        }
    }

    /// Place `rec`'s checkpoint (it has none now) with the policy, and reserve.
    pub(super) fn place(
        policy: &dyn Policy,
        load: &mut LoadTable,
        rec: &mut RequestRecord,
        stats: &mut Stats,
        count_miss: bool,
    ) {
        debug_assert!(rec.holder.is_none());
        if rec.reserve_bytes == 0 {
            return;
        }
        match policy.place(load, rec.serving, rec.reserve_bytes) {
            Some(h) => {
                let row = load.get_mut(h).expect("policy chose a known worker");
                assert!(
                    h != rec.serving && row.in_service() && row.free_bytes() >= rec.reserve_bytes,
                    "policy {:?} chose an ineligible holder {h} for request {}",
                    policy.kind(),
                    rec.id
                );
                row.reserve(rec.reserve_bytes, rec.serving);
                rec.holder = Some(h);
                rec.reserved_bytes = rec.reserve_bytes;
            }
            None => {
                if count_miss && policy.kind() != PolicyKind::StopRestart {
                    stats.no_holder += 1;
                }
            }
        }
    }

    /// Move a live request to a terminal state and release what it holds.
    pub(super) fn retire(&mut self, id: RequestId, state: RequestState, failure: Option<String>) {
        debug_assert!(state.is_terminal());
        let mut rec = self.requests.remove(&id).expect("retire a live request");
        Self::release_holder(&mut self.load, &mut rec);
        if let Some(w) = self.load.get_mut(rec.serving) {
            w.serving_requests = w.serving_requests.saturating_sub(1);
        }
        rec.state = state;
        rec.failure = failure;
        match state {
            RequestState::Completed => self.stats.completed += 1,
            RequestState::Cancelled => self.stats.cancelled += 1,
            _ => self.stats.failed += 1,
        }
        if self.config.max_terminal_retained == 0 {
            return;
        }
        while self.terminal_order.len() >= self.config.max_terminal_retained as usize {
            if let Some(old) = self.terminal_order.pop_front() {
                self.terminal.remove(&old);
            }
        }
        self.terminal_order.push_back(id);
        self.terminal.insert(id, rec);
    }
}
