//! Stop strings, applied by the front rather than the engine, so that one that spans a
//! recovery's break still stops the request where the uninterrupted run would have.
//!
//! An engine resumed with the committed tokens as prompt checks its stop strings against the
//! text it generates itself only: a stop string whose first characters came before the break
//! would be missed, and the characters an engine holds back while a stop string may be
//! forming would be lost with the broken stream. So the front takes `stop` off the engine's
//! body and does what vLLM's detokenizer does (`vllm/v1/engine/detokenizer.py`,
//! `check_stop_strings` and `get_next_output_text`), over the whole request's text:
//! - a stop string is looked for only where it could overlap the new text, and only once more
//!   than `min_tokens` tokens were generated;
//! - of several that match, the one that completes earliest wins (ties: list order);
//! - the text is cut before it (after it with `include_stop_str_in_output`);
//! - while streaming, the last `longest stop − 1` characters are held back (none with
//!   `include_stop_str_in_output`), and given out with the last event.
//!
//! Characters are Unicode scalar values, as Python's `str` counts them.

use serde_json::{Map, Value};

/// Most stop strings a request may give (vLLM takes any number; each costs a search per token).
pub const MAX_STOPS: usize = 64;
/// Longest stop string, characters.
pub const MAX_STOP_CHARS: usize = 1024;

/// A request's stop strings and where its text stands.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Stops {
    strings: Vec<Vec<char>>,
    include: bool,
    min_tokens: usize,
    /// The request's text so far (uncut).
    text: Vec<char>,
    /// Characters given out.
    emitted: usize,
}

/// What one event's text becomes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Filtered {
    /// The text to give out with this event.
    pub text: String,
    /// The stop string that ended the request.
    pub stop: Option<String>,
}

impl Stops {
    /// The stop strings of a client's body (`stop`, `include_stop_str_in_output`), taken off
    /// it: `None` when it has none.
    ///
    /// # Errors
    /// A message for the client: `stop` is not a string or a list of strings, or past the
    /// bounds.
    pub fn take(body: &mut Map<String, Value>, min_tokens: u32) -> Result<Option<Stops>, String> {
        let strings: Vec<String> = match body.remove("stop") {
            None | Some(Value::Null) => Vec::new(),
            Some(Value::String(s)) => vec![s],
            Some(Value::Array(a)) => a
                .into_iter()
                .map(|v| match v {
                    Value::String(s) => Ok(s),
                    other => Err(format!("stop: {other} is not a string")),
                })
                .collect::<Result<_, _>>()?,
            Some(other) => return Err(format!("stop: {other} is not a string or a list")),
        };
        let include = match body.remove("include_stop_str_in_output") {
            None | Some(Value::Null) => false,
            Some(Value::Bool(b)) => b,
            Some(other) => return Err(format!("include_stop_str_in_output: {other}")),
        };
        let strings: Vec<Vec<char>> = strings
            .into_iter()
            .filter(|s| !s.is_empty())
            .map(|s| s.chars().collect())
            .collect();
        if strings.len() > MAX_STOPS || strings.iter().any(|s| s.len() > MAX_STOP_CHARS) {
            return Err(format!(
                "stop: at most {MAX_STOPS} strings of at most {MAX_STOP_CHARS} characters here"
            ));
        }
        if strings.is_empty() {
            return Ok(None);
        }
        Ok(Some(Stops {
            strings,
            include,
            min_tokens: min_tokens as usize,
            ..Stops::default()
        }))
    }

    /// Characters held back while streaming.
    fn buffer(&self) -> usize {
        if self.include {
            0
        } else {
            self.strings.iter().map(Vec::len).max().unwrap_or(1) - 1
        }
    }

    /// The next event's `text`, generated as the request's tokens reached `tokens`;
    /// `last`: the engine ended the request with it.
    pub fn feed(&mut self, text: &str, tokens: usize, last: bool) -> Filtered {
        let before = self.text.len();
        self.text.extend(text.chars());
        let new = self.text.len() - before;
        let mut stop = None;
        if new > 0 && tokens > self.min_tokens {
            if let Some((i, s)) = self.find(new) {
                let cut = if self.include {
                    i + self.strings[s].len()
                } else {
                    i
                };
                self.text.truncate(cut);
                stop = Some(self.strings[s].iter().collect::<String>());
            }
        }
        let end = if last || stop.is_some() {
            self.text.len()
        } else {
            self.text.len().saturating_sub(self.buffer())
        };
        let out: String = if end > self.emitted {
            self.text[self.emitted..end].iter().collect()
        } else {
            String::new()
        };
        self.emitted = self.emitted.max(end);
        Filtered { text: out, stop }
    }

    /// The stop string that completes earliest where it could overlap the last `new`
    /// characters: (where it starts, which).
    fn find(&self, new: usize) -> Option<(usize, usize)> {
        let mut best: Option<(usize, usize, usize)> = None; // (end, start, which)
        for (k, s) in self.strings.iter().enumerate() {
            let from = (self.text.len() + 1).saturating_sub(new + s.len());
            let Some(at) = self.text[from..]
                .windows(s.len())
                .position(|w| w == s.as_slice())
            else {
                continue;
            };
            let start = from + at;
            let end = start + s.len();
            if best.is_none_or(|(e, _, _)| end < e) {
                best = Some((end, start, k));
            }
        }
        best.map(|(_, start, k)| (start, k))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn stops(v: Value, include: bool, min: u32) -> Stops {
        let mut b = json!({"stop": v, "include_stop_str_in_output": include})
            .as_object()
            .cloned()
            .unwrap();
        let s = Stops::take(&mut b, min).unwrap().unwrap();
        assert!(b.is_empty(), "taken off the body");
        s
    }

    /// Feed one token's text at a time; the text given out, and the stop.
    fn run(s: &mut Stops, pieces: &[&str]) -> (String, Option<String>) {
        let mut out = String::new();
        for (i, p) in pieces.iter().enumerate() {
            let f = s.feed(p, i + 1, i + 1 == pieces.len());
            out.push_str(&f.text);
            if f.stop.is_some() {
                return (out, f.stop);
            }
        }
        (out, None)
    }

    #[test]
    fn a_stop_string_cuts_the_text_before_it_and_holds_back_what_may_begin_one() {
        let mut s = stops(json!(["w7 w8"]), false, 0);
        // 4 characters are held back: " w1" may be the start of something
        assert_eq!(s.feed(" w1", 1, false).text, "");
        let (rest, stop) = run(&mut s, &[" w7", " w8", " w9"]);
        assert_eq!(stop.as_deref(), Some("w7 w8"));
        assert_eq!(rest, " w1 ");
    }

    #[test]
    fn a_stop_string_split_over_any_pieces_matches_as_in_one_run() {
        let whole = "ab cd ef gh";
        let mut one = stops(json!("d e"), false, 0);
        let (a, sa) = run(&mut one, &[whole]);
        // the same text a character at a time, as if broken anywhere
        let chars: Vec<String> = whole.chars().map(String::from).collect();
        let refs: Vec<&str> = chars.iter().map(String::as_str).collect();
        let mut each = stops(json!("d e"), false, 0);
        let (b, sb) = run(&mut each, &refs);
        assert_eq!((a.as_str(), sa.as_deref()), ("ab c", Some("d e")));
        assert_eq!((b, sb), (a, sa));
    }

    #[test]
    fn include_keeps_the_stop_string_and_holds_nothing_back() {
        let mut s = stops(json!(["x"]), true, 0);
        assert_eq!(s.feed("ab", 1, false).text, "ab");
        let f = s.feed("cxd", 2, false);
        assert_eq!((f.text.as_str(), f.stop.as_deref()), ("cx", Some("x")));
    }

    #[test]
    fn the_earliest_completing_stop_wins_and_min_tokens_defers_the_search() {
        let mut s = stops(json!(["bcd", "bc"]), false, 0);
        assert_eq!(s.feed("abcde", 1, false).stop.as_deref(), Some("bc"));
        let mut s = stops(json!(["a"]), false, 2);
        let f1 = s.feed("a", 1, false);
        let f2 = s.feed("a", 2, false);
        assert_eq!((f1.stop, f2.stop), (None, None), "not before min_tokens");
        let f = s.feed("ba", 3, false);
        let all = format!("{}{}{}", f1.text, f2.text, f.text);
        assert_eq!((all.as_str(), f.stop.as_deref()), ("aab", Some("a")));
    }

    #[test]
    fn the_last_event_gives_out_what_was_held_back() {
        let mut s = stops(json!(["long stop"]), false, 0);
        assert_eq!(s.feed("abc", 1, false).text, "");
        assert_eq!(s.feed("def", 2, true).text, "abcdef");
    }

    #[test]
    fn bad_stops_are_refused_and_empty_ones_are_none() {
        let mut b = json!({"stop": 3}).as_object().cloned().unwrap();
        assert!(Stops::take(&mut b, 0).is_err());
        let mut b = json!({"stop": ["a", 1]}).as_object().cloned().unwrap();
        assert!(Stops::take(&mut b, 0).is_err());
        let mut b = json!({"stop": [""]}).as_object().cloned().unwrap();
        assert_eq!(Stops::take(&mut b, 0), Ok(None));
        let many: Vec<String> = (0..=MAX_STOPS).map(|i| i.to_string()).collect();
        let mut b = json!({ "stop": many }).as_object().cloned().unwrap();
        assert!(Stops::take(&mut b, 0).is_err());
    }
}
