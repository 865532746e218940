//! One request's task: its attempts on workers, what it relays, how it ends.

use std::sync::Arc;
use std::time::{Duration, Instant};

use hyper::Method;
use serde_json::{Value, json};

use super::recover::{end_at, held_at, report_held};
use super::upstream::{self, EventReader, Next};
use super::{
    Front, Outcome, PROBE_TIMEOUT, PROGRESS_EVERY, RECOVERIES_KEPT, Run, frame, token_ids,
};
use crate::control::{Decision, Event};

impl Front {
    pub(super) async fn drive(self: Arc<Self>, mut run: Run) {
        let id = run.id;
        loop {
            self.set_active(&run);
            let outcome = self.attempt(&mut run).await;
            match outcome {
                Outcome::Finished => {
                    self.apply(Event::Finished {
                        request_id: id,
                        epoch: run.epoch,
                    });
                    run.log.push(|seq| frame(id, seq, "[DONE]"));
                    self.count(|s| s.streams_finished += 1);
                    break;
                }
                Outcome::ClientGone => {
                    let ds = self.apply(Event::Cancel { request_id: id });
                    for d in ds {
                        if let Decision::Cancel { epoch, .. } = d {
                            // the engine's connection went with the attempt: it aborted
                            self.apply(Event::Cancelled {
                                request_id: id,
                                epoch,
                            });
                        }
                    }
                    self.count(|s| s.streams_cancelled += 1);
                    tracing::info!(
                        request = id,
                        generated = run.generated.len(),
                        "front: the client left; cancelled"
                    );
                    break;
                }
                Outcome::Failed(msg) => {
                    self.apply(Event::RequestFailed {
                        request_id: id,
                        epoch: run.epoch,
                        reason: msg.clone(),
                    });
                    self.fail_stream(&run, &msg);
                    break;
                }
                Outcome::Broken(reason) => {
                    if let Err(msg) = self.recover(&mut run, reason).await {
                        self.fail_stream(&run, &msg);
                        break;
                    }
                }
                Outcome::Planned(d) => {
                    if let Err(msg) = self.follow(
                        &mut run,
                        d,
                        Instant::now(),
                        "a failure event planned it".into(),
                    ) {
                        self.fail_stream(&run, &msg);
                        break;
                    }
                }
            }
        }
        self.end_checkpoints(&run).await;
        run.log.close();
        self.shared.unwatch_request(id);
        self.active
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&id);
        self.finished(id);
    }

    pub(super) fn fail_stream(&self, run: &Run, msg: &str) {
        let id = run.id;
        let data = json!({"error": {"message": msg, "type": "kvd_recovery_failed"}, "kvd": {"request": id, "epoch": run.epoch}});
        run.log.push(|seq| frame(id, seq, &data.to_string()));
        run.log.push(|seq| frame(id, seq, "[DONE]"));
        self.count(|s| s.streams_failed += 1);
        tracing::warn!(
            request = id,
            error = msg,
            "front: the stream ends with an error"
        );
    }

    /// The body for the current attempt.
    pub(super) fn upstream_body(&self, run: &Run) -> Value {
        let mut b = run.body.clone();
        let mut prompt = run.prompt.clone();
        prompt.extend_from_slice(&run.generated);
        let done = run.generated.len() as u32;
        b.insert("prompt".into(), json!(prompt));
        b.insert("max_tokens".into(), json!(run.max_tokens - done));
        if run.min_tokens > 0 {
            b.insert(
                "min_tokens".into(),
                json!(run.min_tokens.saturating_sub(done)),
            );
        }
        b.insert("stream".into(), json!(true));
        b.insert("return_token_ids".into(), json!(true));
        let mut kvd = serde_json::Map::new();
        if let Some(h) = run.holder {
            kvd.insert(
                "checkpoint".into(),
                json!({"holder": h, "request": run.id, "epoch": run.epoch}),
            );
        }
        if let Some(r) = run.restore {
            kvd.insert(
                "restore".into(),
                json!({"holder": r.holder, "request": run.id, "epoch": r.epoch, "local": r.local}),
            );
        }
        if !kvd.is_empty() {
            b.insert("kv_transfer_params".into(), json!({ "kvd": kvd }));
        }
        Value::Object(b)
    }

    /// One attempt on the serving worker.
    pub(super) async fn attempt(&self, run: &mut Run) -> Outcome {
        if run.generated.len() as u32 >= run.max_tokens || run.finish_reason.is_some() {
            return Outcome::Finished;
        }
        let Some(ep) = self.engines.get(&run.serving).cloned() else {
            return Outcome::Failed(format!(
                "worker {} has no engine address (--engine)",
                run.serving
            ));
        };
        self.apply(Event::PrefillStarted {
            request_id: run.id,
            epoch: run.epoch,
        });
        let body = self.upstream_body(run).to_string().into_bytes();
        let (status, incoming) = match upstream::send(
            &ep,
            Method::POST,
            "/v1/completions",
            Some(body),
            self.engine_timeout(),
        )
        .await
        {
            Ok(r) => r,
            Err(e) => return Outcome::Broken(e.to_string()),
        };
        if !status.is_success() {
            let text = upstream::read_all(&ep, incoming, PROBE_TIMEOUT)
                .await
                .unwrap_or_default();
            let text = String::from_utf8_lossy(&text).into_owned();
            return if status.is_server_error() {
                Outcome::Broken(format!("{ep} answered {status}: {text}"))
            } else {
                Outcome::Failed(format!("the engine refused the request ({status}): {text}"))
            };
        }
        let mut reader = EventReader::new(incoming);
        let mut plans = self.shared.plans_changed();
        let mut clients = run.log.subscribe();
        let grace = Duration::from_millis(self.args.reconnect_grace_ms);
        let mut alone_since: Option<Instant> = None;
        let mut progress = tokio::time::interval(PROGRESS_EVERY);
        progress.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut first = true;
        loop {
            plans.borrow_and_update();
            clients.borrow_and_update();
            if let Some(d) = self.shared.take_plan(run.id) {
                match d {
                    Decision::Checkpoint { holder, .. } => {
                        // the engine cannot be re-pointed mid-request: it keeps pushing to
                        // the old holder (which is gone); the new one holds nothing yet
                        tracing::warn!(request = run.id, new_holder = ?holder, "front: the holder died; this attempt runs without a checkpoint");
                        run.holder = None;
                        self.set_active(run);
                        self.count(|s| s.checkpoint_moves_unfollowed += 1);
                    }
                    d => return Outcome::Planned(d),
                }
            }
            if run.log.clients() == 0 {
                if alone_since.is_none() {
                    tracing::debug!(request = run.id, "front: no client reads the stream");
                }
                let since = *alone_since.get_or_insert_with(Instant::now);
                if since.elapsed() >= grace {
                    return Outcome::ClientGone;
                }
            } else {
                alone_since = None;
            }
            let alone_left = alone_since.map(|s| grace.saturating_sub(s.elapsed()));
            tokio::select! {
                ev = tokio::time::timeout(self.engine_timeout(), reader.next()) => match ev {
                    Err(_) => return Outcome::Broken(format!("no event from {ep} for {} ms", self.args.engine_timeout_ms)),
                    Ok(Err(e)) => return Outcome::Broken(e.to_string()),
                    Ok(Ok(Next::End)) => {
                        return if run.finish_reason.is_some() {
                            Outcome::Finished
                        } else {
                            Outcome::Broken(format!("{ep} ended the stream before its last token"))
                        };
                    }
                    Ok(Ok(Next::Data(d))) => {
                        if d.trim() == "[DONE]" {
                            return if run.finish_reason.is_some() || run.generated.len() as u32 >= run.max_tokens {
                                Outcome::Finished
                            } else {
                                Outcome::Broken(format!("{ep} sent [DONE] before the last token"))
                            };
                        }
                        if let Err(msg) = self.relay(run, &d, &mut first) {
                            return Outcome::Failed(msg);
                        }
                    }
                },
                _ = changed(&mut plans) => {}
                _ = changed(&mut clients) => {}
                _ = progress.tick() => self.report_progress(run),
                _ = sleep_opt(alone_left) => {}
            }
        }
    }

    /// Relay one event of the engine's stream.
    pub(super) fn relay(
        &self,
        run: &mut Run,
        data: &str,
        first: &mut bool,
    ) -> std::result::Result<(), String> {
        let mut v: Value = serde_json::from_str(data)
            .map_err(|e| format!("the engine sent an event that is not JSON: {e}"))?;
        if let Some(err) = v.get("error") {
            return Err(format!("the engine failed the request: {err}"));
        }
        let mut new_tokens = 0u32;
        if let Some(choice) = v.get_mut("choices").and_then(|c| c.get_mut(0)) {
            let ids = token_ids(choice.get("token_ids").unwrap_or(&Value::Null));
            let text = choice.get("text").and_then(Value::as_str).unwrap_or("");
            match ids {
                Some(ids) => {
                    new_tokens = ids.len() as u32;
                    run.generated.extend_from_slice(&ids);
                }
                None if !text.is_empty() => {
                    return Err("the engine's stream carries no token_ids (the front needs return_token_ids: vLLM ≥ 0.10.2)".into());
                }
                None => {}
            }
            if let Some(r) = choice.get("finish_reason").and_then(Value::as_str) {
                run.finish_reason = Some(r.to_string());
            }
            if let Some(o) = choice.as_object_mut() {
                o.remove("prompt_token_ids");
                if !run.want_token_ids {
                    o.remove("token_ids");
                }
            }
        }
        if let Some(o) = v.as_object_mut() {
            o.insert("id".into(), json!(format!("cmpl-kvd-{}", run.id)));
            o.remove("prompt_token_ids");
            if run.want_token_ids && run.log.next_seq() == 0 {
                o.insert("prompt_token_ids".into(), json!(run.prompt));
            }
            if let Some(u) = o.get_mut("usage").and_then(Value::as_object_mut) {
                let (p, c) = (run.prompt.len(), run.generated.len());
                u.insert("prompt_tokens".into(), json!(p));
                u.insert("completion_tokens".into(), json!(c));
                u.insert("total_tokens".into(), json!(p + c));
            }
        }
        if new_tokens > 0 {
            if *first {
                *first = false;
                self.apply(Event::DecodingStarted {
                    request_id: run.id,
                    epoch: run.epoch,
                });
                self.recovered(run);
            }
            self.apply(Event::TokensCommitted {
                request_id: run.id,
                epoch: run.epoch,
                generated_tokens: run.generated.len() as u32,
            });
            self.count(|s| s.tokens_relayed += u64::from(new_tokens));
        }
        let (id, epoch, worker) = (run.id, run.epoch, run.serving);
        run.log.push(|seq| {
            if let Some(o) = v.as_object_mut() {
                o.insert(
                    "kvd".into(),
                    json!({"request": id, "seq": seq, "epoch": epoch, "worker": worker}),
                );
            }
            frame(id, seq, &v.to_string())
        });
        Ok(())
    }

    /// The survivor's first token: the recovery is done; record it, end the old checkpoint.
    pub(super) fn recovered(&self, run: &mut Run) {
        let Some(p) = run.pending.take() else { return };
        let mut rec = p.record;
        rec.recovery_ms = p.at.elapsed().as_millis() as u64;
        tracing::info!(
            target: "kvd::recovery",
            request = rec.request,
            epoch = rec.epoch,
            from = rec.from,
            to = rec.to,
            kv_source = ?rec.kv_source,
            load_tokens = rec.load_tokens,
            recompute_tokens = rec.recompute_tokens,
            committed_tokens = rec.committed_tokens,
            recovery_ms = rec.recovery_ms,
            reason = %rec.reason,
            "request recovered"
        );
        self.count(|s| {
            s.recoveries += 1;
            if rec.kv_source.is_some() {
                s.recoveries_from_checkpoint += 1;
            } else {
                s.recoveries_recomputed += 1;
            }
            s.restored_tokens += u64::from(rec.load_tokens);
            s.recomputed_tokens += u64::from(rec.recompute_tokens);
            s.recovery_ms += rec.recovery_ms;
        });
        {
            let mut r = self.recoveries.lock().unwrap_or_else(|p| p.into_inner());
            if r.len() >= RECOVERIES_KEPT {
                r.pop_front();
            }
            r.push_back(rec);
        }
        // the restore has read what it needed: the old checkpoint goes
        if let Some(r) = run.restore.take() {
            if let Some(admin) = self.shared.node_admin(u64::from(r.holder)) {
                let id = run.id;
                tokio::spawn(async move {
                    let _ = end_at(&admin, id, r.epoch).await;
                });
            }
        }
    }

    /// Tell the controller what the holder holds for this run (in the background).
    pub(super) fn report_progress(&self, run: &Run) {
        let (Some(h), false) = (run.holder, run.generated.is_empty()) else {
            return;
        };
        let Some(admin) = self.shared.node_admin(u64::from(h)) else {
            return;
        };
        let (shared, id, epoch, history) = (
            Arc::clone(&self.shared),
            run.id,
            run.epoch,
            run.prompt.len() + run.generated.len(),
        );
        tokio::spawn(async move {
            if let Ok(Some(held)) = held_at(&admin, id).await {
                report_held(&shared, id, epoch, history, &held);
            }
        });
    }
}

pub(super) async fn changed(rx: &mut tokio::sync::watch::Receiver<u64>) {
    if rx.changed().await.is_err() {
        std::future::pending::<()>().await;
    }
}

pub(super) async fn sleep_opt(d: Option<Duration>) {
    match d {
        Some(d) => tokio::time::sleep(d).await,
        None => std::future::pending::<()>().await,
    }
}
