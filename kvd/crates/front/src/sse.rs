//! The wire shapes the front reads and writes: server-sent events (`id: R-S` frames to the
//! client, `data:` events off an engine's stream) and OpenAI token-id lists.

use kvd_control::RequestId;
use kvd_core::{Error, Result};
use serde_json::Value;

/// Largest single event of an engine's stream, bytes.
pub const MAX_EVENT_BYTES: usize = 1 << 20;

/// One event to the client: `id: R-S-T` and its data. `Last-Event-ID` then names the request,
/// the last event the client has, and the tokens it has with it: another front that takes the
/// stream over continues from there (docs/CONTROL.md, "Front replicas").
pub fn frame(id: RequestId, seq: u64, tokens: usize, data: &str) -> String {
    format!("id: {id}-{seq}-{tokens}\ndata: {data}\n\n")
}

/// The data of a frame [`frame`] wrote.
pub fn frame_data(frame: &str) -> Option<&str> {
    frame
        .lines()
        .find_map(|l| l.strip_prefix("data: ").or_else(|| l.strip_prefix("data:")))
}

/// What a client's `Last-Event-ID` says it has.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EventId {
    /// The request.
    pub request: RequestId,
    /// The last event's sequence number.
    pub seq: u64,
    /// The tokens generated up to and with it (`None`: an id without them, `R-S`).
    pub tokens: Option<usize>,
}

/// `Last-Event-ID: R-S-T` (or `R-S`) → what it names.
pub fn parse_event_id(v: &str) -> Option<EventId> {
    let mut parts = v.trim().split('-');
    let request = parts.next()?.parse().ok()?;
    let seq = parts.next()?.parse().ok()?;
    let tokens = match parts.next() {
        None => None,
        Some(t) => Some(t.parse().ok()?),
    };
    if parts.next().is_some() {
        return None;
    }
    Some(EventId {
        request,
        seq,
        tokens,
    })
}

/// Token ids in a JSON value: a list of integers (or a list holding one such list).
pub fn token_ids(v: &Value) -> Option<Vec<u32>> {
    let a = v.as_array()?;
    if let [inner @ Value::Array(_)] = a.as_slice() {
        return token_ids(inner);
    }
    a.iter()
        .map(|t| t.as_u64().and_then(|t| u32::try_from(t).ok()))
        .collect()
}

/// Collects an engine's `text/event-stream` bytes and hands out whole events' `data`.
#[derive(Debug, Default)]
pub struct EventBuffer {
    buf: Vec<u8>,
}

impl EventBuffer {
    /// Add bytes read off the stream.
    ///
    /// # Errors
    /// [`Error::Protocol`] when an event passes [`MAX_EVENT_BYTES`].
    pub fn extend(&mut self, data: &[u8]) -> Result<()> {
        self.buf.extend_from_slice(data);
        if self.buf.len() > MAX_EVENT_BYTES {
            return Err(Error::Protocol(format!(
                "an event over {MAX_EVENT_BYTES} bytes"
            )));
        }
        Ok(())
    }

    /// The next whole event with data (comments and events without data are skipped);
    /// `None` until one is whole.
    ///
    /// # Errors
    /// [`Error::Protocol`] for an event that is not UTF-8.
    pub fn next_data(&mut self) -> Result<Option<String>> {
        while let Some(ev) = take_event(&mut self.buf)? {
            if ev.is_some() {
                return Ok(ev);
            }
        }
        Ok(None)
    }
}

/// Take one whole event off the front of `buf`: `None` when no whole event is there yet;
/// `Some(None)` for an event without data (a comment, a keep-alive).
fn take_event(buf: &mut Vec<u8>) -> Result<Option<Option<String>>> {
    let Some((end, sep)) = find_blank_line(buf) else {
        return Ok(None);
    };
    let raw: Vec<u8> = buf.drain(..end + sep).collect();
    let text = std::str::from_utf8(&raw[..end])
        .map_err(|_| Error::Protocol("an event that is not UTF-8".into()))?;
    let mut data: Option<String> = None;
    for line in text.lines() {
        if let Some(v) = line.strip_prefix("data:") {
            let v = v.strip_prefix(' ').unwrap_or(v);
            match &mut data {
                Some(d) => {
                    d.push('\n');
                    d.push_str(v);
                }
                None => data = Some(v.to_string()),
            }
        }
    }
    Ok(Some(data))
}

/// Where the first blank line is: (index of the event's end, length of the separator).
fn find_blank_line(buf: &[u8]) -> Option<(usize, usize)> {
    let mut i = 0;
    while i + 1 < buf.len() {
        if buf[i] == b'\n' && buf[i + 1] == b'\n' {
            return Some((i, 2));
        }
        if buf[i..].starts_with(b"\r\n\r\n") {
            return Some((i, 4));
        }
        i += 1;
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn events_split_on_blank_lines_whatever_the_line_ends() {
        let mut b =
            b"data: {\"a\":1}\n\n: keep-alive\n\ndata: x\r\ndata: y\r\n\r\ndata: [DO".to_vec();
        assert_eq!(
            take_event(&mut b).unwrap(),
            Some(Some("{\"a\":1}".to_string()))
        );
        assert_eq!(take_event(&mut b).unwrap(), Some(None));
        assert_eq!(take_event(&mut b).unwrap(), Some(Some("x\ny".to_string())));
        assert_eq!(take_event(&mut b).unwrap(), None, "a partial event waits");
        b.extend_from_slice(b"NE]\n\n");
        assert_eq!(
            take_event(&mut b).unwrap(),
            Some(Some("[DONE]".to_string()))
        );
        assert!(b.is_empty());
    }

    #[test]
    fn a_buffer_skips_comments_and_hands_out_whole_events() {
        let mut b = EventBuffer::default();
        b.extend(b": keep-alive\n\ndata: 1\n\ndata: 2").unwrap();
        assert_eq!(b.next_data().unwrap().as_deref(), Some("1"));
        assert_eq!(b.next_data().unwrap(), None);
        b.extend(b"\n\n").unwrap();
        assert_eq!(b.next_data().unwrap().as_deref(), Some("2"));
    }

    #[test]
    fn event_ids_name_the_request_and_the_sequence_number() {
        let id = |request, seq, tokens| {
            Some(EventId {
                request,
                seq,
                tokens,
            })
        };
        assert_eq!(parse_event_id("77-12"), id(77, 12, None));
        assert_eq!(parse_event_id(" 77-0 "), id(77, 0, None));
        assert_eq!(parse_event_id("77-5-31"), id(77, 5, Some(31)));
        assert_eq!(parse_event_id("77"), None);
        assert_eq!(parse_event_id("a-1"), None);
        assert_eq!(parse_event_id("7-1-x"), None);
        assert_eq!(parse_event_id("7-1-2-3"), None);
        assert_eq!(frame(5, 3, 9, "x"), "id: 5-3-9\ndata: x\n\n");
    }

    #[test]
    fn token_ids_come_as_a_list_or_a_list_of_one_list() {
        assert_eq!(token_ids(&json!([1, 2, 3])), Some(vec![1, 2, 3]));
        assert_eq!(token_ids(&json!([[4, 5]])), Some(vec![4, 5]));
        assert_eq!(token_ids(&json!(["a"])), None);
        assert_eq!(token_ids(&json!([-1])), None);
        assert_eq!(token_ids(&json!("x")), None);
    }
}
