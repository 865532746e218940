//! Request bodies: what the client's `/v1/completions` body asks for (checked once, at
//! admission), and the body each attempt sends to an engine.

use kvd_control::{Epoch, RequestId, WorkerId};
use kvd_core::{Error, Result};
use serde_json::{Map, Value, json};

use crate::sse::token_ids;

/// The prompt as the client gave it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Prompt {
    /// Text, to be tokenized by the engine that serves it.
    Text(String),
    /// Token ids.
    Ids(Vec<u32>),
}

/// A client's body, checked.
#[derive(Debug, Clone)]
pub struct Asked {
    /// The body, less what the front sets per attempt.
    pub body: Map<String, Value>,
    /// The prompt.
    pub prompt: Prompt,
    /// Tokens to generate at most (16 when not given, as OpenAI's default).
    pub max_tokens: u32,
    /// Tokens to generate at least.
    pub min_tokens: u32,
    /// Whether the client wants `token_ids` in its events.
    pub want_token_ids: bool,
    /// Whether the request is checkpointed (`"kvd": {"checkpoint": false}` turns it off).
    pub checkpoint: bool,
}

/// Check a client's body.
///
/// # Errors
/// [`Error::InvalidArgument`] for what this front does not serve (no stream, `n` > 1, `echo`,
/// a bad prompt or `max_tokens`).
pub fn parse_body(body: Value) -> Result<Asked> {
    let Value::Object(mut body) = body else {
        return Err(Error::InvalidArgument(
            "the body is not a JSON object".into(),
        ));
    };
    if body.get("stream").and_then(Value::as_bool) != Some(true) {
        return Err(Error::InvalidArgument(
            "this front serves streams only: set \"stream\": true".into(),
        ));
    }
    for (k, ok) in [("n", 1), ("best_of", 1)] {
        if body.get(k).and_then(Value::as_u64).is_some_and(|v| v != ok) {
            return Err(Error::InvalidArgument(format!("{k} must be 1 here")));
        }
    }
    if body.get("echo").and_then(Value::as_bool) == Some(true) {
        return Err(Error::InvalidArgument("echo is not supported here".into()));
    }
    let checkpoint = body
        .remove("kvd")
        .and_then(|k| k.get("checkpoint").and_then(Value::as_bool))
        .unwrap_or(true);
    body.remove("kv_transfer_params");
    body.remove("stream");
    let want_token_ids = body
        .remove("return_token_ids")
        .and_then(|v| v.as_bool())
        .unwrap_or(false);
    let max_tokens = match body.remove("max_tokens") {
        None | Some(Value::Null) => 16,
        Some(v) => v
            .as_u64()
            .and_then(|v| u32::try_from(v).ok())
            .filter(|v| *v > 0)
            .ok_or_else(|| Error::InvalidArgument(format!("max_tokens {v}")))?,
    };
    let min_tokens = body
        .remove("min_tokens")
        .and_then(|v| v.as_u64())
        .map_or(0, |v| v.min(u64::from(max_tokens)) as u32);
    let prompt = match body.remove("prompt") {
        Some(Value::String(s)) => Prompt::Text(s),
        Some(v) => Prompt::Ids(token_ids(&v).ok_or_else(|| {
            Error::InvalidArgument("prompt: a string or a list of token ids (one prompt)".into())
        })?),
        None => return Err(Error::InvalidArgument("no prompt".into())),
    };
    Ok(Asked {
        body,
        prompt,
        max_tokens,
        min_tokens,
        want_token_ids,
        checkpoint,
    })
}

/// Where an attempt loads its prefix from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RestoreFrom {
    /// The holder of the checkpoint.
    pub holder: WorkerId,
    /// The epoch whose checkpoint it loads.
    pub epoch: Epoch,
    /// The survivor is the holder: the blocks are on its own node.
    pub local: bool,
}

/// What one attempt's engine body is made of.
#[derive(Debug)]
pub struct AttemptSpec<'a> {
    /// The request.
    pub id: RequestId,
    /// The client's body (less what is set here).
    pub body: &'a Map<String, Value>,
    /// The prompt's ids.
    pub prompt: &'a [u32],
    /// The tokens generated so far (they become prompt).
    pub generated: &'a [u32],
    /// The client's `max_tokens`.
    pub max_tokens: u32,
    /// The client's `min_tokens`.
    pub min_tokens: u32,
    /// The attempt's epoch.
    pub epoch: Epoch,
    /// Where it streams its checkpoint.
    pub holder: Option<WorkerId>,
    /// Where it loads its prefix from.
    pub restore: Option<RestoreFrom>,
}

/// The engine body of an attempt: prompt + committed tokens, the remaining budget, and kvd's
/// `kv_transfer_params` (`checkpoint`: where the connector streams blocks; `restore`: where
/// it loads the prefix from).
pub fn attempt_body(a: &AttemptSpec<'_>) -> Value {
    let mut b = a.body.clone();
    let mut prompt = a.prompt.to_vec();
    prompt.extend_from_slice(a.generated);
    let done = a.generated.len() as u32;
    b.insert("prompt".into(), json!(prompt));
    b.insert("max_tokens".into(), json!(a.max_tokens - done));
    if a.min_tokens > 0 {
        b.insert(
            "min_tokens".into(),
            json!(a.min_tokens.saturating_sub(done)),
        );
    }
    b.insert("stream".into(), json!(true));
    b.insert("return_token_ids".into(), json!(true));
    let mut kvd = Map::new();
    if let Some(h) = a.holder {
        kvd.insert(
            "checkpoint".into(),
            json!({"holder": h, "request": a.id, "epoch": a.epoch}),
        );
    }
    if let Some(r) = a.restore {
        kvd.insert(
            "restore".into(),
            json!({"holder": r.holder, "request": a.id, "epoch": r.epoch, "local": r.local}),
        );
    }
    if !kvd.is_empty() {
        b.insert("kv_transfer_params".into(), json!({ "kvd": kvd }));
    }
    Value::Object(b)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_body_is_checked_and_stripped_of_what_the_front_sets() {
        let a = parse_body(json!({"stream": true, "prompt": [[1, 2]], "max_tokens": 5,
            "min_tokens": 9, "kvd": {"checkpoint": false}, "return_token_ids": true,
            "kv_transfer_params": {"x": 1}, "temperature": 0}))
        .unwrap();
        assert_eq!(a.prompt, Prompt::Ids(vec![1, 2]));
        assert_eq!((a.max_tokens, a.min_tokens), (5, 5));
        assert!(a.want_token_ids && !a.checkpoint);
        assert_eq!(a.body.keys().collect::<Vec<_>>(), ["temperature"]);
        assert!(parse_body(json!({"prompt": "x"})).is_err(), "streams only");
        assert!(parse_body(json!({"stream": true, "prompt": "x", "n": 2})).is_err());
        assert!(parse_body(json!({"stream": true, "prompt": "x", "echo": true})).is_err());
        assert!(parse_body(json!({"stream": true, "prompt": "x", "max_tokens": 0})).is_err());
        assert!(parse_body(json!({"stream": true})).is_err());
    }

    #[test]
    fn a_resumed_attempt_asks_for_the_rest_with_the_committed_tokens_as_prompt() {
        let body = Map::new();
        let v = attempt_body(&AttemptSpec {
            id: 7,
            body: &body,
            prompt: &[1, 2],
            generated: &[3],
            max_tokens: 4,
            min_tokens: 2,
            epoch: 2,
            holder: Some(3),
            restore: Some(RestoreFrom {
                holder: 2,
                epoch: 1,
                local: true,
            }),
        });
        assert_eq!(v["prompt"], json!([1, 2, 3]));
        assert_eq!(
            (v["max_tokens"].clone(), v["min_tokens"].clone()),
            (json!(3), json!(1))
        );
        assert_eq!(
            v["kv_transfer_params"]["kvd"],
            json!({"checkpoint": {"holder": 3, "request": 7, "epoch": 2},
                   "restore": {"holder": 2, "request": 7, "epoch": 1, "local": true}})
        );
    }
}
