//! `kvd control` as users run it: the real binary on a loopback port, spoken to over HTTP/1.1.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use serde_json::{Value, json};

/// A `kvd control` child process, killed on drop.
struct Daemon {
    child: Child,
    addr: SocketAddr,
}

impl Daemon {
    fn start(extra: &[&str]) -> Daemon {
        let mut child = Command::new(env!("CARGO_BIN_EXE_kvd"))
            .args(["control", "--listen", "127.0.0.1:0"])
            .args(extra)
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("start kvd control");
        let mut line = String::new();
        BufReader::new(child.stdout.take().unwrap())
            .read_line(&mut line)
            .unwrap();
        let addr = line
            .trim()
            .strip_prefix("kvd control listening on ")
            .unwrap_or_else(|| panic!("unexpected first line {line:?}"))
            .parse()
            .unwrap();
        Daemon { child, addr }
    }

    /// One HTTP/1.1 request; returns (status, body).
    fn call(&self, method: &str, path: &str, body: Option<&[u8]>) -> (u16, Vec<u8>) {
        let mut s = TcpStream::connect(self.addr).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
        let body = body.unwrap_or_default();
        let head = format!(
            "{method} {path} HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n\
             Content-Length: {}\r\nConnection: close\r\n\r\n",
            body.len()
        );
        s.write_all(head.as_bytes()).unwrap();
        let _ = s.write_all(body); // the server may refuse an oversized body before reading it
        let mut raw = Vec::new();
        let _ = s.read_to_end(&mut raw);
        let split = raw
            .windows(4)
            .position(|w| w == b"\r\n\r\n")
            .expect("a response head");
        let head = String::from_utf8_lossy(&raw[..split]).to_string();
        let status = head.split(' ').nth(1).unwrap().parse().unwrap();
        let mut rest = raw[split + 4..].to_vec();
        if head
            .to_ascii_lowercase()
            .contains("transfer-encoding: chunked")
        {
            rest = dechunk(&rest);
        }
        (status, rest)
    }

    fn json(&self, method: &str, path: &str, body: Option<Value>) -> (u16, Value) {
        let bytes = body.map(|b| serde_json::to_vec(&b).unwrap());
        let (status, out) = self.call(method, path, bytes.as_deref());
        (
            status,
            serde_json::from_slice(&out)
                .unwrap_or(Value::String(String::from_utf8_lossy(&out).into())),
        )
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn dechunk(mut b: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    loop {
        let Some(eol) = b.windows(2).position(|w| w == b"\r\n") else {
            return out;
        };
        let n = usize::from_str_radix(std::str::from_utf8(&b[..eol]).unwrap().trim(), 16).unwrap();
        if n == 0 {
            return out;
        }
        out.extend_from_slice(&b[eol + 2..eol + 2 + n]);
        b = &b[eol + 2 + n + 2..];
    }
}

#[test]
fn the_control_service_takes_events_and_answers_decisions_over_http() {
    let d = Daemon::start(&[]);
    assert_eq!(d.call("GET", "/healthz", None), (200, b"ok".to_vec()));

    let mut events: Vec<Value> = (0..4)
        .map(|w| json!({"type": "worker_joined", "worker": w, "capacity_bytes": 1u64 << 30}))
        .collect();
    events.push(
        json!({"type": "admit", "request_id": 1, "serving": 0, "prompt_tokens": 100,
        "max_new_tokens": 50, "reserve_bytes": 1u64 << 20, "deadline_ms": null}),
    );
    events.push(json!({"type": "prefill_started", "request_id": 1, "epoch": 1}));
    events.push(json!({"type": "decoding_started", "request_id": 1, "epoch": 1}));
    events.push(json!({"type": "checkpoint_stored", "request_id": 1, "epoch": 1, "tokens": 100, "bytes": 1000}));
    events.push(json!({"type": "frame_acked", "request_id": 1, "epoch": 1, "sequence_no": 4}));
    let (status, out) = d.json("POST", "/events", Some(json!({ "events": events })));
    assert_eq!(status, 200, "{out}");
    let results = out["results"].as_array().unwrap();
    assert!(results.iter().all(|r| r["ok"] == true), "{out}");
    let admitted = &results[4]["decisions"][0];
    assert_eq!(admitted["type"], "admitted");
    let holder = admitted["holder"].as_u64().unwrap();
    assert_ne!(holder, 0);

    // A stale event in a batch is refused on its own, with the stable code.
    let (_, out) = d.json(
        "POST",
        "/events",
        Some(json!({"events": [{"type": "finished", "request_id": 1, "epoch": 0}]})),
    );
    assert_eq!(out["results"][0]["ok"], false);
    assert_eq!(out["results"][0]["code"], 10);

    let (status, plan) = d.json("POST", "/workers/failed", Some(json!({"workers": [0]})));
    assert_eq!(status, 200, "{plan}");
    let r = &plan["restores"][0];
    assert_eq!(
        (r["target"].as_u64(), r["kv_source"].as_u64()),
        (Some(holder), Some(holder))
    );
    assert_eq!(r["resume_seq"], 5);
    assert_eq!(r["epoch"], 2);

    let (status, rec) = d.json("GET", "/requests/1", None);
    assert_eq!((status, rec["state"].as_str()), (200, Some("Migrating")));
    let (status, _) = d.json("GET", "/requests/999", None);
    assert_eq!(status, 404);
    let (status, stats) = d.json("GET", "/stats", None);
    assert_eq!(
        (status, stats["kv_reuse_restores"].as_u64()),
        (200, Some(1))
    );
    let (status, text) = d.json("GET", "/metrics", None);
    let text = text.as_str().unwrap_or_default().to_owned();
    assert_eq!(status, 200);
    for needle in [
        "kvd_control_kv_reuse_restores_total 1",
        "kvd_control_worker_failures_total 1",
        "kvd_control_workers{phase=\"failed\"} 1",
        "kvd_control_in_flight_requests 1",
    ] {
        assert!(text.contains(needle), "no {needle:?} in\n{text}");
    }
    let (status, _) = d.json(
        "POST",
        "/admit",
        Some(json!({"request_id": 2, "serving": 0,
        "prompt_tokens": 1, "max_new_tokens": 1, "reserve_bytes": 0, "deadline_ms": null})),
    );
    assert_eq!(status, 503, "worker 0 is failed");

    // Bad input is refused and changes nothing.
    let (status, _) = d.call("POST", "/events", Some(b"{not json"));
    assert!((400..500).contains(&status), "{status}");
    let big = vec![b' '; (1 << 20) + 16];
    let (status, _) = d.call("POST", "/events", Some(&big));
    assert_eq!(status, 413, "bodies are bounded");

    // The snapshot restores into a fresh service that answers the same.
    let (status, snap) = d.call("GET", "/snapshot", None);
    assert_eq!(status, 200);
    let dir = std::env::temp_dir().join(format!("kvd-control-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("snapshot.json");
    std::fs::write(&file, &snap).unwrap();
    let d2 = Daemon::start(&["--snapshot", file.to_str().unwrap()]);
    assert_eq!(
        d2.json("GET", "/requests/1", None),
        d.json("GET", "/requests/1", None)
    );
    assert_eq!(
        d2.json("GET", "/workers", None),
        d.json("GET", "/workers", None)
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn the_control_service_refuses_a_non_loopback_address_unless_allowed() {
    let out = Command::new(env!("CARGO_BIN_EXE_kvd"))
        .args(["control", "--listen", "0.0.0.0:0"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("--allow-remote"));
}
