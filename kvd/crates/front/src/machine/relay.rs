//! One engine event, rewritten for the client: the front's completion id, the token ids only
//! when the client asked for them, `usage` counted over the whole request (not the attempt),
//! and a `kvd` field naming the request, sequence number, epoch and worker.

use kvd_control::{Epoch, RequestId, WorkerId};
use serde_json::{Value, json};

use crate::sse::token_ids;

/// What one engine event carried.
#[derive(Debug, PartialEq)]
pub struct Relayed {
    /// The event as the client gets it (less the `kvd` field; see [`stamp`]).
    pub value: Value,
    /// The tokens it generated.
    pub tokens: Vec<u32>,
    /// The finish reason, on the last one.
    pub finish_reason: Option<String>,
}

/// The request's side of a rewrite.
#[derive(Debug)]
pub struct RelayContext<'a> {
    /// The request.
    pub id: RequestId,
    /// The client wants `token_ids` (and the prompt's on the first event).
    pub want_token_ids: bool,
    /// This is the stream's first event.
    pub first_event: bool,
    /// The prompt's ids.
    pub prompt: &'a [u32],
    /// Tokens generated before this event.
    pub generated_before: usize,
}

/// Rewrite the engine event `data`.
///
/// # Errors
/// A message for the client when the event is not JSON, carries an error, or has text but no
/// token ids (the front needs them to resume).
pub fn rewrite(data: &str, cx: &RelayContext<'_>) -> Result<Relayed, String> {
    let mut v: Value = serde_json::from_str(data)
        .map_err(|e| format!("the engine sent an event that is not JSON: {e}"))?;
    if let Some(err) = v.get("error") {
        return Err(format!("the engine failed the request: {err}"));
    }
    let mut tokens = Vec::new();
    let mut finish_reason = None;
    if let Some(choice) = v.get_mut("choices").and_then(|c| c.get_mut(0)) {
        let ids = token_ids(choice.get("token_ids").unwrap_or(&Value::Null));
        let text = choice.get("text").and_then(Value::as_str).unwrap_or("");
        match ids {
            Some(ids) => tokens = ids,
            None if !text.is_empty() => {
                return Err("the engine's stream carries no token_ids (the front needs return_token_ids: vLLM ≥ 0.10.2)".into());
            }
            None => {}
        }
        if let Some(r) = choice.get("finish_reason").and_then(Value::as_str) {
            finish_reason = Some(r.to_string());
        }
        if let Some(o) = choice.as_object_mut() {
            o.remove("prompt_token_ids");
            if !cx.want_token_ids {
                o.remove("token_ids");
            }
        }
    }
    if let Some(o) = v.as_object_mut() {
        o.insert("id".into(), json!(format!("cmpl-kvd-{}", cx.id)));
        o.remove("prompt_token_ids");
        if cx.want_token_ids && cx.first_event {
            o.insert("prompt_token_ids".into(), json!(cx.prompt));
        }
        if let Some(u) = o.get_mut("usage").and_then(Value::as_object_mut) {
            let (p, c) = (cx.prompt.len(), cx.generated_before + tokens.len());
            u.insert("prompt_tokens".into(), json!(p));
            u.insert("completion_tokens".into(), json!(c));
            u.insert("total_tokens".into(), json!(p + c));
        }
    }
    Ok(Relayed {
        value: v,
        tokens,
        finish_reason,
    })
}

/// Where an event stands in its request.
#[derive(Debug, Clone, Copy)]
pub struct At {
    /// The request.
    pub id: RequestId,
    /// The event's sequence number.
    pub seq: u64,
    /// Tokens generated up to and with it.
    pub tokens: usize,
    /// The attempt's epoch.
    pub epoch: Epoch,
    /// The worker that generated it.
    pub worker: WorkerId,
}

/// Add the `kvd` field: which request, sequence number, token count, epoch and worker the
/// event is. A client that reads no SSE `id:` lines resumes with `Last-Event-ID:
/// {request}-{seq}-{tokens}` from it.
pub fn stamp(mut v: Value, at: At) -> String {
    if let Some(o) = v.as_object_mut() {
        o.insert(
            "kvd".into(),
            json!({"request": at.id, "seq": at.seq, "tokens": at.tokens, "epoch": at.epoch, "worker": at.worker}),
        );
    }
    v.to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cx(want: bool, first: bool) -> RelayContext<'static> {
        RelayContext {
            id: 9,
            want_token_ids: want,
            first_event: first,
            prompt: &[1, 2],
            generated_before: 3,
        }
    }

    #[test]
    fn an_event_is_renamed_and_counted_over_the_whole_request() {
        let data = r#"{"id":"x","choices":[{"text":"a","token_ids":[5],"prompt_token_ids":[1]}],"usage":{"prompt_tokens":5}}"#;
        let r = rewrite(data, &cx(false, true)).unwrap();
        assert_eq!(r.tokens, vec![5]);
        assert_eq!(r.value["id"], "cmpl-kvd-9");
        assert!(r.value["choices"][0].get("token_ids").is_none());
        assert!(r.value.get("prompt_token_ids").is_none());
        assert_eq!(r.value["usage"]["completion_tokens"], 4);
        let r = rewrite(data, &cx(true, true)).unwrap();
        assert_eq!(r.value["prompt_token_ids"], json!([1, 2]));
        assert_eq!(r.value["choices"][0]["token_ids"], json!([5]));
        let at = At {
            id: 9,
            seq: 4,
            tokens: 7,
            epoch: 2,
            worker: 1,
        };
        let s = stamp(r.value, at);
        assert!(
            s.contains(r#""kvd":{"epoch":2,"request":9,"seq":4,"tokens":7,"worker":1}"#),
            "{s}"
        );
    }

    #[test]
    fn an_event_without_token_ids_or_with_an_error_is_refused() {
        assert!(rewrite(r#"{"choices":[{"text":"a"}]}"#, &cx(false, false)).is_err());
        assert!(rewrite(r#"{"error":{"message":"x"}}"#, &cx(false, false)).is_err());
        assert!(rewrite("not json", &cx(false, false)).is_err());
        let r = rewrite(
            r#"{"choices":[{"text":"","finish_reason":"length"}]}"#,
            &cx(false, false),
        );
        assert_eq!(r.unwrap().finish_reason.as_deref(), Some("length"));
    }
}
