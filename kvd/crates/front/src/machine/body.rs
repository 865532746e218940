//! Request bodies: what the client's `/v1/completions` body asks for (checked once, at
//! admission), the body each attempt sends to an engine, and in P/D the prefill's body and what
//! its answer hands over (vLLM's own P/D proxy contract: NixlConnector's `kv_transfer_params`
//! keys, kvd's own under `kvd`).

use kvd_control::{Epoch, RequestId, WorkerId};
use kvd_core::{Error, Result};
use serde_json::{Map, Value, json};

use super::stops::Stops;
use crate::openai::{Api, CHAT_PROMPT_FIELDS, Kind, direct_reason};
use crate::sse::token_ids;

/// The prompt as the client gave it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Prompt {
    /// Text, to be tokenized by the engine that serves it.
    Text(String),
    /// Token ids.
    Ids(Vec<u32>),
    /// A chat: the messages and the fields that shape their rendering (the engine's
    /// `/tokenize` body, less the model).
    Chat(Map<String, Value>),
}

/// A client's body, checked.
#[derive(Debug, Clone)]
pub struct Asked {
    /// The API it came in by.
    pub api: Api,
    /// The body, less what the front sets per attempt.
    pub body: Map<String, Value>,
    /// The prompt.
    pub prompt: Prompt,
    /// Tokens to generate at most, as given (`None`: OpenAI's default, 16 for a completion;
    /// the rest of the context for a chat).
    pub max_tokens: Option<u32>,
    /// Tokens to generate at least.
    pub min_tokens: u32,
    /// Whether the client wants `token_ids` in its events.
    pub want_token_ids: bool,
    /// Whether the request is checkpointed (`"kvd": {"checkpoint": false}` turns it off).
    pub checkpoint: bool,
    /// Its stop strings, which the front applies itself.
    pub stops: Option<Stops>,
}

/// What the front does with a body.
#[derive(Debug, Clone)]
pub enum Parsed {
    /// It runs the request, recoverably.
    Front(Box<Asked>),
    /// One engine serves the body as it is, without recovery, for this reason.
    Direct {
        /// The client's body.
        body: Value,
        /// Why recovery is off.
        reason: String,
    },
}

fn positive(k: &str, v: Option<Value>) -> Result<Option<u32>> {
    match v {
        None | Some(Value::Null) => Ok(None),
        Some(v) => v
            .as_u64()
            .and_then(|v| u32::try_from(v).ok())
            .filter(|v| *v > 0)
            .map(Some)
            .ok_or_else(|| {
                Error::InvalidArgument(format!("{k} must be a positive integer, not {v}"))
            }),
    }
}

/// Check a client's body.
///
/// # Errors
/// [`Error::InvalidArgument`] for a body that is not an object, or a bad prompt, messages,
/// `max_tokens` or `stop`.
pub fn parse_body(body: Value, api: Api) -> Result<Parsed> {
    let Value::Object(mut body) = body else {
        return Err(Error::InvalidArgument(
            "the body is not a JSON object".into(),
        ));
    };
    if let Some(reason) = direct_reason(&body, api.kind) {
        return Ok(Parsed::Direct {
            body: Value::Object(body),
            reason,
        });
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
    let completion_max = positive(
        "max_completion_tokens",
        body.remove("max_completion_tokens"),
    )?;
    let max_tokens = positive("max_tokens", body.remove("max_tokens"))?.or(completion_max);
    let min_tokens = body
        .remove("min_tokens")
        .and_then(|v| v.as_u64())
        .map_or(0, |v| {
            v.min(u64::from(max_tokens.unwrap_or(u32::MAX))) as u32
        });
    let stops = Stops::take(&mut body, min_tokens).map_err(Error::InvalidArgument)?;
    let prompt = match api.kind {
        Kind::Completion => match body.remove("prompt") {
            Some(Value::String(s)) => Prompt::Text(s),
            Some(v) => Prompt::Ids(token_ids(&v).ok_or_else(|| {
                Error::InvalidArgument(
                    "prompt: a string or a list of token ids (one prompt)".into(),
                )
            })?),
            None => return Err(Error::InvalidArgument("no prompt".into())),
        },
        Kind::Chat => {
            let mut chat = Map::new();
            for k in CHAT_PROMPT_FIELDS {
                if let Some(v) = body.remove(k) {
                    chat.insert(k.into(), v);
                }
            }
            let messages = chat.get("messages").and_then(Value::as_array);
            if messages.is_none_or(Vec::is_empty) {
                return Err(Error::InvalidArgument("messages: a non-empty list".into()));
            }
            // chat-only fields a completion does not take (vLLM's defaults for them hold)
            for k in ["tool_choice", "parallel_tool_calls", "response_format"] {
                body.remove(k);
            }
            Prompt::Chat(chat)
        }
    };
    Ok(Parsed::Front(Box::new(Asked {
        api,
        body,
        prompt,
        max_tokens,
        min_tokens,
        want_token_ids,
        checkpoint,
        stops,
    })))
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
    /// P/D: the prefill answer's `kv_transfer_params`, passed on unchanged (kvd's own entries
    /// added inside its `kvd` object).
    pub handoff: Option<&'a Map<String, Value>>,
    /// vLLM's `priority` for a resuming attempt (the client's own, if lower, is kept).
    pub priority: Option<i64>,
}

/// The engine body of an attempt: prompt + committed tokens, the remaining budget, and kvd's
/// `kv_transfer_params` (`checkpoint`: where the connector streams blocks; `restore`: where
/// it loads the prefix from). With a P/D hand-off, the params are the prefill answer's, kvd's
/// entries added inside their `kvd` object.
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
    if let Some(p) = a.priority {
        let theirs = b.get("priority").and_then(Value::as_i64).unwrap_or(p);
        b.insert("priority".into(), json!(p.min(theirs)));
    }
    // the front's own entries for every attempt (the routing's cluster hint)
    let mut kvd = match b.remove("kv_transfer_params") {
        Some(Value::Object(mut p)) => match p.remove("kvd") {
            Some(Value::Object(k)) => k,
            _ => Map::new(),
        },
        _ => Map::new(),
    };
    if let Some(h) = a.holder {
        kvd.insert(
            "checkpoint".into(),
            json!({"holder": h, "request": a.id, "epoch": a.epoch}),
        );
    }
    if done > 0 {
        // the last `done` prompt tokens were generated: the engine draws and penalises as if
        // they still were (kvd.vllm_sampling)
        kvd.insert("continues".into(), json!({ "generated": done }));
    }
    if let Some(r) = a.restore {
        kvd.insert(
            "restore".into(),
            json!({"holder": r.holder, "request": a.id, "epoch": r.epoch, "local": r.local}),
        );
    }
    if let Some(h) = a.handoff {
        let mut params = h.clone();
        match params.get_mut("kvd") {
            Some(Value::Object(theirs)) => theirs.extend(kvd),
            _ => {
                params.insert("kvd".into(), Value::Object(kvd));
            }
        }
        b.insert("kv_transfer_params".into(), Value::Object(params));
    } else if !kvd.is_empty() {
        b.insert("kv_transfer_params".into(), json!({ "kvd": kvd }));
    }
    Value::Object(b)
}

/// The body of a P/D prefill (vLLM's `toy_proxy_server.py` contract): the client's body with
/// the prompt's ids, one token, no stream, and the producer's `kv_transfer_params`
/// (`do_remote_decode`), kvd's `{request, epoch}` naming the hold the prefill node's daemon
/// keeps the prompt's blocks under.
pub fn prefill_body(
    body: &Map<String, Value>,
    prompt: &[u32],
    min_tokens: u32,
    id: RequestId,
    epoch: Epoch,
) -> Value {
    let mut b = body.clone();
    b.insert("prompt".into(), json!(prompt));
    b.insert("max_tokens".into(), json!(1));
    if b.contains_key("max_completion_tokens") {
        b.insert("max_completion_tokens".into(), json!(1));
    }
    b.insert("stream".into(), json!(false));
    // its one token may go to the client as the request's first (see `first_token_event`)
    b.insert("return_token_ids".into(), json!(true));
    b.remove("stream_options");
    if min_tokens > 0 {
        // the client forbids a stop at the first token: so must the prefill
        b.insert("min_tokens".into(), json!(1));
    } else {
        b.remove("min_tokens");
    }
    b.insert(
        "kv_transfer_params".into(),
        json!({
            "do_remote_decode": true,
            "do_remote_prefill": false,
            "remote_engine_id": null,
            "remote_block_ids": null,
            "remote_host": null,
            "remote_port": null,
            "kvd": {"request": id, "epoch": epoch},
        }),
    );
    Value::Object(b)
}

/// Why the prefill's token cannot be the request's first, for a client body (`None`: it can).
///
/// The decode then continues from prompt + that token, as a recovery resumes from the
/// committed tokens; that is exact unless the continuation depends on what the decode engine
/// saw of the first token itself: a seeded sampler (a fresh generator would draw the second
/// token), stop strings (one could span the first and second tokens), logprobs (the prefill
/// answer's shape differs from a stream's).
pub fn first_token_barred(body: &Map<String, Value>) -> Option<&'static str> {
    let set = |k: &str| body.get(k).is_some_and(|v| !v.is_null());
    let greedy = body
        .get("temperature")
        .and_then(Value::as_f64)
        .is_some_and(|t| t == 0.0);
    if set("seed") && !greedy {
        return Some("a seeded sampler");
    }
    let stops = match body.get("stop") {
        None | Some(Value::Null) => false,
        Some(Value::String(s)) => !s.is_empty(),
        Some(Value::Array(a)) => !a.is_empty(),
        Some(_) => true,
    };
    if stops {
        return Some("stop strings");
    }
    if set("logprobs") || set("prompt_logprobs") {
        return Some("logprobs");
    }
    None
}

/// The prefill answer's one token as the data of a stream event, as the engine would have
/// streamed it (`None`: the answer carries no single token id). `more`: the client wants more
/// tokens than this one, so a `length` finish (the prefill's own `max_tokens` 1) is no finish.
pub fn first_token_event(answer: &Value, more: bool) -> Option<String> {
    let choice = answer.get("choices")?.get(0)?;
    let ids = token_ids(choice.get("token_ids")?)?;
    if ids.len() != 1 {
        return None;
    }
    let finish = match choice.get("finish_reason").and_then(Value::as_str) {
        Some("length") if more => None,
        r => r,
    };
    let stop_reason = finish.and_then(|_| choice.get("stop_reason").cloned());
    let mut event = Map::new();
    for k in ["id", "object", "created", "model"] {
        if let Some(v) = answer.get(k) {
            event.insert(k.into(), v.clone());
        }
    }
    event.insert(
        "choices".into(),
        json!([{
            "index": 0,
            "text": choice.get("text").and_then(Value::as_str).unwrap_or(""),
            "logprobs": null,
            "finish_reason": finish,
            "stop_reason": stop_reason,
            "token_ids": ids,
        }]),
    );
    Some(Value::Object(event).to_string())
}

/// A hand-off hold: the prefill node's daemon keeps the prompt's blocks for the decode worker
/// under (request, epoch) until the front ends it (or its lease runs out).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Hold {
    /// The prefill node.
    pub node: WorkerId,
    /// The epoch the hold is bound to.
    pub epoch: Epoch,
}

/// What a prefill answer hands to the decode worker: its `kv_transfer_params` when usable (an
/// object with `do_remote_prefill` true), and the hold it names (`kvd.handoff`) when it names one
/// for request `id`.
pub fn handoff_of(answer: &Value, id: RequestId) -> (Option<Map<String, Value>>, Option<Hold>) {
    let hold = hold_of(answer, id);
    let params = match answer.get("kv_transfer_params") {
        Some(Value::Object(p)) if p.get("do_remote_prefill") == Some(&Value::Bool(true)) => {
            Some(p.clone())
        }
        _ => None,
    };
    (params, hold)
}

/// The hold a prefill answer names (`kv_transfer_params.kvd.handoff {node, request, epoch}`).
pub fn hold_of(answer: &Value, id: RequestId) -> Option<Hold> {
    let h = answer
        .get("kv_transfer_params")?
        .get("kvd")?
        .get("handoff")?;
    if h.get("request")?.as_u64()? != id {
        return None;
    }
    Some(Hold {
        node: WorkerId::try_from(h.get("node")?.as_u64()?).ok()?,
        epoch: h.get("epoch")?.as_u64()?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_body_is_checked_and_stripped_of_what_the_front_sets() {
        let api = Api {
            kind: Kind::Completion,
            stream: true,
        };
        let front = |v| match parse_body(v, api).unwrap() {
            Parsed::Front(a) => a,
            Parsed::Direct { reason, .. } => panic!("direct: {reason}"),
        };
        let a = front(json!({"stream": true, "prompt": [[1, 2]], "max_tokens": 5,
            "min_tokens": 9, "kvd": {"checkpoint": false}, "return_token_ids": true,
            "kv_transfer_params": {"x": 1}, "temperature": 0, "stop": "w1"}));
        assert_eq!(a.prompt, Prompt::Ids(vec![1, 2]));
        assert_eq!((a.max_tokens, a.min_tokens), (Some(5), 5));
        assert!(a.want_token_ids && !a.checkpoint && a.stops.is_some());
        assert_eq!(a.body.keys().collect::<Vec<_>>(), ["temperature"]);
        assert_eq!(
            front(json!({"prompt": "x"})).max_tokens,
            None,
            "no stream is served"
        );
        assert!(matches!(
            parse_body(json!({"prompt": "x", "n": 2}), api),
            Ok(Parsed::Direct { .. })
        ));
        assert!(matches!(
            parse_body(json!({"prompt": "x", "echo": true}), api),
            Ok(Parsed::Direct { .. })
        ));
        assert!(parse_body(json!({"prompt": "x", "max_tokens": 0}), api).is_err());
        assert!(parse_body(json!({"prompt": "x", "stop": 5}), api).is_err());
        assert!(parse_body(json!({"stream": true}), api).is_err());
        assert!(parse_body(json!([1]), api).is_err());
    }

    #[test]
    fn a_chat_keeps_its_messages_for_the_engines_template_and_runs_as_a_completion() {
        let api = Api {
            kind: Kind::Chat,
            stream: false,
        };
        let Parsed::Front(a) = parse_body(
            json!({"model": "m", "messages": [{"role": "user", "content": "w1"}],
            "add_generation_prompt": true, "max_completion_tokens": 7, "tool_choice": "none",
            "chat_template_kwargs": {"x": 1}}),
            api,
        )
        .unwrap() else {
            panic!()
        };
        let Prompt::Chat(chat) = &a.prompt else {
            panic!("{:?}", a.prompt)
        };
        assert_eq!(
            chat.keys().collect::<Vec<_>>(),
            ["add_generation_prompt", "chat_template_kwargs", "messages"]
        );
        assert_eq!(a.max_tokens, Some(7));
        assert_eq!(a.body.keys().collect::<Vec<_>>(), ["model"]);
        assert!(parse_body(json!({"messages": []}), api).is_err());
        assert!(parse_body(json!({"prompt": "x"}), api).is_err());
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
            handoff: None,
            priority: None,
        });
        assert_eq!(v["prompt"], json!([1, 2, 3]));
        assert_eq!(
            v.get("priority"),
            None,
            "no priority unless --resume-priority"
        );
        assert_eq!(
            (v["max_tokens"].clone(), v["min_tokens"].clone()),
            (json!(3), json!(1))
        );
        assert_eq!(
            v["kv_transfer_params"]["kvd"],
            json!({"checkpoint": {"holder": 3, "request": 7, "epoch": 2},
                   "restore": {"holder": 2, "request": 7, "epoch": 1, "local": true},
                   "continues": {"generated": 1}})
        );
    }

    #[test]
    fn a_resuming_attempt_carries_the_resume_priority_unless_the_client_asked_a_lower_one() {
        let priority = |client: Value| {
            let body = json!({ "priority": client });
            attempt_body(&AttemptSpec {
                id: 7,
                body: body.as_object().unwrap(),
                prompt: &[1],
                generated: &[2],
                max_tokens: 4,
                min_tokens: 0,
                epoch: 2,
                holder: None,
                restore: None,
                handoff: None,
                priority: Some(-1),
            })["priority"]
                .clone()
        };
        assert_eq!(priority(json!(0)), json!(-1));
        assert_eq!(priority(json!(3)), json!(-1));
        assert_eq!(
            priority(json!(-5)),
            json!(-5),
            "the client's more urgent priority"
        );
        assert_eq!(priority(Value::Null), json!(-1), "no client priority");
    }

    #[test]
    fn the_routings_cluster_hint_rides_with_every_attempts_own_entries() {
        let body = json!({"kv_transfer_params": {"kvd": {"cluster_blocks": 5}}});
        let spec = |holder| AttemptSpec {
            id: 7,
            body: body.as_object().unwrap(),
            prompt: &[1, 2],
            generated: &[],
            max_tokens: 4,
            min_tokens: 0,
            epoch: 1,
            holder,
            restore: None,
            handoff: None,
            priority: None,
        };
        assert_eq!(
            attempt_body(&spec(Some(3)))["kv_transfer_params"]["kvd"],
            json!({"cluster_blocks": 5, "checkpoint": {"holder": 3, "request": 7, "epoch": 1}})
        );
        assert_eq!(
            attempt_body(&spec(None))["kv_transfer_params"],
            json!({"kvd": {"cluster_blocks": 5}})
        );
    }

    #[test]
    fn a_prefill_body_asks_one_token_without_a_stream_and_names_the_hold() {
        let body = json!({"temperature": 0, "min_tokens": 3, "stream_options": {}});
        let v = prefill_body(body.as_object().unwrap(), &[1, 2], 0, 7, 3);
        assert_eq!(
            (&v["prompt"], &v["max_tokens"], &v["stream"]),
            (&json!([1, 2]), &json!(1), &json!(false))
        );
        assert!(v.get("min_tokens").is_none() && v.get("stream_options").is_none());
        assert_eq!(
            v["return_token_ids"], true,
            "its token may be the client's first"
        );
        let v = prefill_body(body.as_object().unwrap(), &[1, 2], 3, 7, 3);
        assert_eq!(
            v["min_tokens"], 1,
            "no stop at the first token when the client forbids it"
        );
        assert_eq!(v["temperature"], 0);
        let p = &v["kv_transfer_params"];
        assert_eq!(
            (&p["do_remote_decode"], &p["do_remote_prefill"]),
            (&json!(true), &json!(false))
        );
        assert!(p["remote_engine_id"].is_null() && p["remote_block_ids"].is_null());
        assert_eq!(p["kvd"], json!({"request": 7, "epoch": 3}));
    }

    #[test]
    fn a_prefill_answers_token_becomes_a_stream_event_unless_the_body_bars_it() {
        let answer = json!({"id": "cmpl-p", "object": "text_completion", "created": 5,
            "model": "m", "choices": [{"index": 0, "text": " a", "token_ids": [42],
            "finish_reason": "length", "stop_reason": null, "prompt_token_ids": [1, 2],
            "logprobs": null}], "usage": {"prompt_tokens": 2},
            "kv_transfer_params": {"do_remote_prefill": true}});
        let e: Value = serde_json::from_str(&first_token_event(&answer, true).unwrap()).unwrap();
        assert_eq!(
            e,
            json!({"id": "cmpl-p", "object": "text_completion", "created": 5, "model": "m",
                "choices": [{"index": 0, "text": " a", "logprobs": null, "finish_reason": null,
                "stop_reason": null, "token_ids": [42]}]})
        );
        let e: Value = serde_json::from_str(&first_token_event(&answer, false).unwrap()).unwrap();
        assert_eq!(
            e["choices"][0]["finish_reason"], "length",
            "the client wanted one token"
        );
        let mut stop = answer.clone();
        stop["choices"][0]["finish_reason"] = json!("stop");
        let e: Value = serde_json::from_str(&first_token_event(&stop, true).unwrap()).unwrap();
        assert_eq!(
            e["choices"][0]["finish_reason"], "stop",
            "an end of sequence ends it"
        );
        for bad in [
            json!({}),
            json!({"choices": [{"text": "a"}]}),
            json!({"choices": [{"token_ids": [1, 2]}]}),
            json!({"choices": [{"token_ids": []}]}),
        ] {
            assert_eq!(first_token_event(&bad, true), None, "{bad}");
        }
        let barred = |b: Value| first_token_barred(b.as_object().unwrap());
        assert_eq!(
            barred(json!({"temperature": 0, "seed": 3, "stop": []})),
            None
        );
        assert_eq!(
            barred(json!({"temperature": 0.7})),
            None,
            "unseeded: any draw is a sample"
        );
        assert_eq!(barred(json!({"seed": 3})), Some("a seeded sampler"));
        assert_eq!(barred(json!({"stop": "x"})), Some("stop strings"));
        assert_eq!(barred(json!({"stop": ["x"]})), Some("stop strings"));
        assert_eq!(barred(json!({"logprobs": 2})), Some("logprobs"));
    }

    #[test]
    fn a_decode_body_carries_the_prefill_answers_params_unchanged_with_kvds_entries_added() {
        let answer = json!({"choices": [], "kv_transfer_params": {"do_remote_prefill": true,
            "do_remote_decode": false, "remote_engine_id": "e", "remote_block_ids": [1, 2],
            "remote_host": "h", "remote_port": 5,
            "kvd": {"handoff": {"node": 4, "namespace": "ab", "blocks": 2, "request": 7, "epoch": 1}}}});
        let (params, hold) = handoff_of(&answer, 7);
        assert_eq!(hold, Some(Hold { node: 4, epoch: 1 }));
        let body = Map::new();
        let v = attempt_body(&AttemptSpec {
            id: 7,
            body: &body,
            prompt: &[1, 2],
            generated: &[],
            max_tokens: 4,
            min_tokens: 0,
            epoch: 1,
            holder: Some(3),
            restore: None,
            handoff: params.as_ref(),
            priority: None,
        });
        let mut want = answer["kv_transfer_params"].clone();
        want["kvd"]["checkpoint"] = json!({"holder": 3, "request": 7, "epoch": 1});
        assert_eq!(v["kv_transfer_params"], want);
        assert_eq!(
            handoff_of(&answer, 8).1,
            None,
            "another request's hold is not ours"
        );
        for unusable in [
            json!({}),
            json!({"kv_transfer_params": 3}),
            json!({"kv_transfer_params": {"remote_host": "h"}}),
        ] {
            assert_eq!(handoff_of(&unusable, 7).0, None, "{unusable}");
        }
    }
}
