//! The OpenAI surface over the front's one way of running a request: which API a client
//! called ([`Api`]), what a body asks that the front cannot recover exactly ([`direct_reason`]:
//! such a request goes to one engine as it is), a completion's events as chat chunks
//! ([`chat_chunk`]), a whole answer for a client that did not ask for a stream
//! ([`Collector`]), OpenAI's error body ([`error_body`], [`status_of`]) and what the engines
//! serve ([`Models`]).
//!
//! A chat request runs as a completion: its messages are rendered by the serving engine's own
//! chat template (its `/tokenize` endpoint, which takes the same chat fields as its
//! `/v1/chat/completions`), and the tokens stream back as chat chunks. So every recovery path a
//! completion has, a chat has too, and a greedy chat's text is the engine's own.

use kvd_core::Error;
use serde_json::{Map, Value, json};

/// Which API a client called.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Api {
    /// Chat or text completions.
    pub kind: Kind,
    /// The client reads a stream (`"stream": true`); otherwise it gets one answer at the end.
    pub stream: bool,
}

/// `/v1/completions` or `/v1/chat/completions`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// `/v1/completions`.
    Completion,
    /// `/v1/chat/completions`.
    Chat,
}

impl Kind {
    /// The engine path of this API.
    pub fn path(self) -> &'static str {
        match self {
            Kind::Completion => "/v1/completions",
            Kind::Chat => "/v1/chat/completions",
        }
    }

    /// The id the client sees for request `id`.
    pub fn response_id(self, id: u64) -> String {
        match self {
            Kind::Completion => format!("cmpl-kvd-{id}"),
            Kind::Chat => format!("chatcmpl-kvd-{id}"),
        }
    }
}

/// The chat fields that shape the prompt: they go to the engine's `/tokenize` with the
/// messages, not to the completion.
pub const CHAT_PROMPT_FIELDS: [&str; 8] = [
    "messages",
    "add_generation_prompt",
    "continue_final_message",
    "add_special_tokens",
    "chat_template",
    "chat_template_kwargs",
    "documents",
    "mm_processor_kwargs",
];

fn set(body: &Map<String, Value>, k: &str) -> bool {
    match body.get(k) {
        None | Some(Value::Null) | Some(Value::Bool(false)) => false,
        Some(Value::Array(a)) => !a.is_empty(),
        Some(_) => true,
    }
}

/// Why the front cannot recover `body` exactly (`None`: it can). Such a request is served by
/// one engine as it is, and the answer says that recovery is off, and why.
pub fn direct_reason(body: &Map<String, Value>, kind: Kind) -> Option<String> {
    for k in ["n", "best_of"] {
        if body.get(k).and_then(Value::as_u64).is_some_and(|v| v > 1) {
            return Some(format!("{k} > 1: several samples of one prompt"));
        }
    }
    if set(body, "echo") {
        return Some("echo: the prompt is part of the answer".into());
    }
    for k in ["logprobs", "top_logprobs", "prompt_logprobs"] {
        if set(body, k) {
            return Some(format!(
                "{k}: log-probabilities over a resumed prompt would change"
            ));
        }
    }
    let structured = [
        "structured_outputs",
        "guided_json",
        "guided_regex",
        "guided_choice",
    ]
    .iter()
    .chain(&["guided_grammar", "guided_decoding_backend"])
    .find(|k| set(body, k))
    .copied();
    let format_set = body
        .get("response_format")
        .and_then(|f| f.get("type"))
        .and_then(Value::as_str)
        .is_some_and(|t| t != "text");
    if structured.is_some() || format_set {
        return Some(
            "structured output: the grammar's state is not replayed over the committed tokens"
                .into(),
        );
    }
    if set(body, "tools") {
        return Some("tools: the engine parses tool calls from its own chat output".into());
    }
    if set(body, "bad_words") {
        return Some("bad_words: a word begun before the break would not be seen".into());
    }
    if set(body, "prompt_embeds") {
        return Some("prompt_embeds: no token ids to resume from".into());
    }
    match kind {
        Kind::Completion => match body.get("prompt") {
            Some(Value::Array(a)) if a.first().is_some_and(|p| !p.is_number()) && a.len() > 1 => {
                Some("several prompts in one request".into())
            }
            _ => None,
        },
        Kind::Chat => {
            let multimodal = body
                .get("messages")
                .and_then(Value::as_array)
                .is_some_and(|m| {
                    m.iter().any(|m| {
                        m.get("content")
                            .and_then(Value::as_array)
                            .is_some_and(|parts| {
                                parts
                                    .iter()
                                    .any(|p| p.get("type").and_then(Value::as_str) != Some("text"))
                            })
                    })
                });
            multimodal.then(|| "multimodal content: the prompt is not only tokens".into())
        }
    }
}

/// A completion event (as [`crate::machine::relay::rewrite`] made it) as a chat chunk:
/// `delta.content` for `text`, the assistant's role on the stream's first.
pub fn chat_chunk(v: &mut Value, id: u64, first: bool) {
    let Some(o) = v.as_object_mut() else { return };
    o.insert("id".into(), json!(Kind::Chat.response_id(id)));
    o.insert("object".into(), json!("chat.completion.chunk"));
    if let Some(Value::Array(choices)) = o.get_mut("choices") {
        for c in choices.iter_mut().filter_map(Value::as_object_mut) {
            let text = c.remove("text").unwrap_or(json!(""));
            let mut delta = Map::new();
            if first {
                delta.insert("role".into(), json!("assistant"));
            }
            delta.insert("content".into(), text);
            c.insert("delta".into(), Value::Object(delta));
        }
    }
}

/// Collects a request's events into the one answer a client without a stream gets.
#[derive(Debug)]
pub struct Collector {
    kind: Kind,
    id: u64,
    text: String,
    token_ids: Option<Vec<Value>>,
    finish_reason: Value,
    stop_reason: Value,
    usage: Value,
    created: Value,
    model: Value,
    error: Option<Value>,
}

impl Collector {
    /// An empty answer to request `id`.
    pub fn new(kind: Kind, id: u64) -> Collector {
        Collector {
            kind,
            id,
            text: String::new(),
            token_ids: None,
            finish_reason: Value::Null,
            stop_reason: Value::Null,
            usage: Value::Null,
            created: Value::Null,
            model: Value::Null,
            error: None,
        }
    }

    /// Add one event's `data` (`[DONE]` adds nothing).
    pub fn add(&mut self, data: &str) {
        let Ok(v) = serde_json::from_str::<Value>(data) else {
            return;
        };
        if let Some(e) = v.get("error") {
            self.error = Some(e.clone());
            return;
        }
        for k in ["created", "model"] {
            if let Some(x) = v.get(k).filter(|x| !x.is_null()) {
                let slot = if k == "created" {
                    &mut self.created
                } else {
                    &mut self.model
                };
                *slot = x.clone();
            }
        }
        if let Some(u) = v.get("usage").filter(|u| !u.is_null()) {
            self.usage = u.clone();
        }
        let Some(c) = v.get("choices").and_then(|c| c.get(0)) else {
            return;
        };
        let text = match self.kind {
            Kind::Completion => c.get("text"),
            Kind::Chat => c.get("delta").and_then(|d| d.get("content")),
        };
        if let Some(t) = text.and_then(Value::as_str) {
            self.text.push_str(t);
        }
        if let Some(ids) = c.get("token_ids").and_then(Value::as_array) {
            self.token_ids
                .get_or_insert_with(Vec::new)
                .extend(ids.iter().cloned());
        }
        for (k, slot) in [
            ("finish_reason", &mut self.finish_reason),
            ("stop_reason", &mut self.stop_reason),
        ] {
            if let Some(x) = c.get(k).filter(|x| !x.is_null()) {
                *slot = x.clone();
            }
        }
    }

    /// The answer (`Err`: the stream ended with an error, its `error` object).
    ///
    /// # Errors
    /// The request failed.
    pub fn answer(self) -> Result<Value, Value> {
        if let Some(e) = self.error {
            return Err(e);
        }
        let mut choice = json!({
            "index": 0,
            "logprobs": null,
            "finish_reason": self.finish_reason,
            "stop_reason": self.stop_reason,
        });
        let object = match self.kind {
            Kind::Completion => {
                choice["text"] = json!(self.text);
                "text_completion"
            }
            Kind::Chat => {
                choice["message"] = json!({"role": "assistant", "content": self.text});
                "chat.completion"
            }
        };
        if let Some(ids) = self.token_ids {
            choice["token_ids"] = Value::Array(ids);
        }
        Ok(json!({
            "id": self.kind.response_id(self.id),
            "object": object,
            "created": self.created,
            "model": self.model,
            "choices": [choice],
            "usage": self.usage,
        }))
    }
}

/// OpenAI's error body (as vLLM's server writes it).
pub fn error_body(status: u16, message: &str) -> Value {
    let kind = match status {
        400 => "BadRequestError",
        404 => "NotFoundError",
        413 => "RequestEntityTooLarge",
        429 => "RateLimitError",
        503 => "ServiceUnavailableError",
        _ => "InternalServerError",
    };
    json!({"error": {"message": message, "type": kind, "param": null, "code": status}})
}

/// The HTTP status of a refusal, and the seconds a client should wait before retrying (set
/// when the refusal is one that retrying fixes: overload, no room, nothing in service).
pub fn status_of(e: &Error) -> (u16, Option<u64>) {
    match e {
        Error::InvalidArgument(_) | Error::Protocol(_) => (400, None),
        Error::NotFound(_) => (404, None),
        Error::Overloaded { retry_after_ms, .. } => {
            (503, Some(retry_after_ms.div_ceil(1000).max(1)))
        }
        Error::NoSpace { .. } | Error::Unavailable(_) => (503, Some(1)),
        _ => (500, None),
    }
}

/// What the engines serve: their `GET /v1/models` answer, the names in it, and each one's
/// context length (vLLM's `max_model_len`).
#[derive(Debug, Clone, PartialEq)]
pub struct Models {
    /// The answer, as the engine gave it.
    pub list: Value,
    served: Vec<(String, Option<u32>)>,
}

impl Models {
    /// Read an engine's `GET /v1/models` answer.
    ///
    /// # Errors
    /// [`Error::Protocol`] when it has no `data` list of models with ids.
    pub fn parse(list: Value) -> kvd_core::Result<Models> {
        let served: Option<Vec<(String, Option<u32>)>> = list
            .get("data")
            .and_then(Value::as_array)
            .map(|d| {
                d.iter()
                    .map(|m| {
                        let id = m.get("id")?.as_str()?.to_string();
                        let len = m
                            .get("max_model_len")
                            .and_then(Value::as_u64)
                            .and_then(|v| u32::try_from(v).ok());
                        Some((id, len))
                    })
                    .collect()
            })
            .and_then(|v: Option<Vec<_>>| v.filter(|v| !v.is_empty()));
        let served =
            served.ok_or_else(|| Error::Protocol(format!("/v1/models: no models in {list}")))?;
        Ok(Models { list, served })
    }

    /// The context length of `model` (the first served model when the body names none).
    ///
    /// # Errors
    /// [`Error::NotFound`] for a model no engine serves, with vLLM's message.
    pub fn context_of(&self, model: Option<&str>) -> kvd_core::Result<Option<u32>> {
        match model {
            None => Ok(self.served[0].1),
            Some(m) => self
                .served
                .iter()
                .find(|(id, _)| id == m)
                .map(|(_, len)| *len)
                .ok_or_else(|| Error::NotFound(format!("The model `{m}` does not exist."))),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn obj(v: Value) -> Map<String, Value> {
        v.as_object().cloned().unwrap()
    }

    #[test]
    fn what_cannot_be_recovered_exactly_is_named_and_the_rest_is_not() {
        let chat = Kind::Chat;
        let plain = obj(
            json!({"messages": [{"role": "user", "content": "hi"}], "seed": 3,
            "temperature": 1.0, "stop": ["x"], "frequency_penalty": 1.0, "logprobs": false,
            "tools": [], "response_format": {"type": "text"}, "n": 1, "foo": 1}),
        );
        assert_eq!(direct_reason(&plain, chat), None);
        for (k, v) in [
            ("n", json!(2)),
            ("logprobs", json!(true)),
            ("tools", json!([{"type": "function"}])),
            ("response_format", json!({"type": "json_object"})),
            ("structured_outputs", json!({"regex": "a+"})),
            ("bad_words", json!(["w1"])),
        ] {
            let mut b = plain.clone();
            b.insert(k.into(), v);
            assert!(direct_reason(&b, chat).is_some(), "{k}");
        }
        let image = obj(json!({"messages": [{"role": "user", "content": [
            {"type": "text", "text": "a"}, {"type": "image_url", "image_url": {"url": "x"}}]}]}));
        assert!(direct_reason(&image, chat).unwrap().contains("multimodal"));
        let several = obj(json!({"prompt": ["a", "b"]}));
        assert!(direct_reason(&several, Kind::Completion).is_some());
        let ids = obj(json!({"prompt": [1, 2], "logprobs": 0}));
        assert!(
            direct_reason(&ids, Kind::Completion).is_some(),
            "logprobs 0 is set"
        );
        assert_eq!(
            direct_reason(&obj(json!({"prompt": [1, 2]})), Kind::Completion),
            None
        );
    }

    #[test]
    fn a_completion_event_becomes_a_chat_chunk_with_the_role_first() {
        let mut v = json!({"id": "cmpl-kvd-5", "object": "text_completion", "model": "m",
            "choices": [{"index": 0, "text": "w1", "finish_reason": null}]});
        chat_chunk(&mut v, 5, true);
        assert_eq!(v["id"], "chatcmpl-kvd-5");
        assert_eq!(v["object"], "chat.completion.chunk");
        assert_eq!(
            v["choices"][0]["delta"],
            json!({"role": "assistant", "content": "w1"})
        );
        assert!(v["choices"][0].get("text").is_none());
        let mut v = json!({"choices": [{"text": " w2", "finish_reason": "length"}]});
        chat_chunk(&mut v, 5, false);
        assert_eq!(v["choices"][0]["delta"], json!({"content": " w2"}));
    }

    #[test]
    fn the_events_collect_into_one_answer_or_its_error() {
        let mut c = Collector::new(Kind::Chat, 7);
        let mut first = json!({"created": 9, "model": "tiny",
            "choices": [{"text": "w1", "token_ids": [5]}]});
        chat_chunk(&mut first, 7, true);
        c.add(&first.to_string());
        let mut last = json!({"choices": [{"text": " w2", "token_ids": [6],
            "finish_reason": "stop", "stop_reason": "w3"}]});
        chat_chunk(&mut last, 7, false);
        c.add(&last.to_string());
        c.add(r#"{"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 2}}"#);
        c.add("[DONE]");
        let a = c.answer().unwrap();
        assert_eq!(a["object"], "chat.completion");
        assert_eq!(a["choices"][0]["message"]["content"], "w1 w2");
        assert_eq!(a["choices"][0]["finish_reason"], "stop");
        assert_eq!(a["choices"][0]["stop_reason"], "w3");
        assert_eq!(a["choices"][0]["token_ids"], json!([5, 6]));
        assert_eq!(a["usage"]["completion_tokens"], 2);
        assert_eq!(
            (a["created"].clone(), a["model"].clone()),
            (json!(9), json!("tiny"))
        );
        let mut c = Collector::new(Kind::Completion, 7);
        c.add(r#"{"choices": [{"text": "a"}]}"#);
        c.add(r#"{"error": {"message": "gone", "type": "kvd_recovery_failed"}}"#);
        assert_eq!(c.answer().unwrap_err()["message"], "gone");
    }

    #[test]
    fn errors_take_openais_shape_and_overload_says_when_to_retry() {
        let e = error_body(404, "The model `x` does not exist.");
        assert_eq!(e["error"]["type"], "NotFoundError");
        assert_eq!(e["error"]["code"], 404);
        assert!(e["error"].get("param").is_some());
        let over = Error::Overloaded {
            what: "x".into(),
            retry_after_ms: 1500,
        };
        assert_eq!(status_of(&over), (503, Some(2)));
        assert_eq!(status_of(&Error::InvalidArgument("x".into())), (400, None));
    }

    #[test]
    fn models_name_what_is_served_and_its_context_length() {
        let m = Models::parse(json!({"object": "list", "data": [
            {"id": "tiny", "max_model_len": 2048}, {"id": "other"}]}))
        .unwrap();
        assert_eq!(m.context_of(None).unwrap(), Some(2048));
        assert_eq!(m.context_of(Some("other")).unwrap(), None);
        let e = m.context_of(Some("nope")).unwrap_err();
        assert!(matches!(e, Error::NotFound(ref s) if s.contains("`nope` does not exist")));
        assert!(Models::parse(json!({"data": []})).is_err());
        assert!(Models::parse(json!({"x": 1})).is_err());
    }
}
