//! One request's numbered event log, and the clients reading it.
//!
//! The driver appends every event it relays (already formatted as an SSE frame carrying its
//! sequence number); each client connection reads the log from the sequence number it asks for
//! and then waits for more, so a client that reconnects with `Last-Event-ID` gets exactly the
//! events after the last one it saw. The log is bounded in bytes: past the bound the oldest
//! frames are dropped, and a client asking for one of those gets an error event instead of a
//! gap. One `watch` channel wakes everyone: appends, the end, and a client coming or going.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};

use tokio::sync::watch;

/// A request's event log.
#[derive(Debug)]
pub struct StreamLog {
    inner: Mutex<Inner>,
    version: watch::Sender<u64>,
    max_bytes: usize,
}

#[derive(Debug, Default)]
struct Inner {
    frames: VecDeque<Arc<str>>,
    /// Sequence number of `frames[0]`.
    first_seq: u64,
    bytes: usize,
    done: bool,
    clients: u32,
    /// An engine took the request (its stream opened, or a prefill or catch-up went out).
    open: bool,
}

/// What a read of the log gave.
#[derive(Debug, PartialEq, Eq)]
pub enum Read {
    /// Frames from the asked sequence number on (possibly none yet), and whether the log ended.
    Frames(Vec<Arc<str>>, bool),
    /// The asked frames were dropped to keep the log in its bound; the oldest kept is this.
    Gone(u64),
}

impl StreamLog {
    /// An empty log that keeps at most `max_bytes` of frames.
    pub fn new(max_bytes: usize) -> Arc<Self> {
        Arc::new(StreamLog {
            inner: Mutex::new(Inner::default()),
            version: watch::channel(0).0,
            max_bytes,
        })
    }

    /// An empty log whose first frame gets sequence number `first_seq` (a stream another
    /// front began: the client has the frames before it).
    pub fn starting_at(max_bytes: usize, first_seq: u64) -> Arc<Self> {
        let log = Self::new(max_bytes);
        log.lock().first_seq = first_seq;
        log
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn bump(&self) {
        self.version.send_modify(|v| *v = v.wrapping_add(1));
    }

    /// Append the frame `format(seq)` makes for the next sequence number; that number.
    pub fn push(&self, format: impl FnOnce(u64) -> String) -> u64 {
        let seq = {
            let mut g = self.lock();
            let seq = g.first_seq + g.frames.len() as u64;
            let frame: Arc<str> = format(seq).into();
            g.bytes += frame.len();
            g.frames.push_back(frame);
            while g.bytes > self.max_bytes && g.frames.len() > 1 {
                let old = g.frames.pop_front().expect("more than one");
                g.bytes -= old.len();
                g.first_seq += 1;
            }
            seq
        };
        self.bump();
        seq
    }

    /// The sequence number the next frame gets.
    pub fn next_seq(&self) -> u64 {
        let g = self.lock();
        g.first_seq + g.frames.len() as u64
    }

    /// No more frames will come.
    pub fn close(&self) {
        self.lock().done = true;
        self.bump();
    }

    /// An engine took the request: a client's answer head need not wait for the first event
    /// any longer (see [`StreamLog::is_open`]).
    pub fn mark_open(&self) {
        let changed = {
            let mut g = self.lock();
            !std::mem::replace(&mut g.open, true)
        };
        if changed {
            self.bump();
        }
    }

    /// Whether an engine took the request. Until then a refusal may still come, which the
    /// client gets as its answer's status rather than as an event.
    pub fn is_open(&self) -> bool {
        self.lock().open
    }

    /// Whether the log ended.
    pub fn is_done(&self) -> bool {
        self.lock().done
    }

    /// Frames from sequence number `from` on.
    pub fn read(&self, from: u64) -> Read {
        let g = self.lock();
        if from < g.first_seq {
            return Read::Gone(g.first_seq);
        }
        let skip = (from - g.first_seq) as usize;
        Read::Frames(g.frames.iter().skip(skip).cloned().collect(), g.done)
    }

    /// Clients reading now.
    pub fn clients(&self) -> u32 {
        self.lock().clients
    }

    /// A receiver that changes on every append, the end, and every client change.
    pub fn subscribe(&self) -> watch::Receiver<u64> {
        self.version.subscribe()
    }

    /// Count a client in; it is counted out when the guard drops.
    pub fn client(self: &Arc<Self>) -> ClientGuard {
        self.lock().clients += 1;
        self.bump();
        ClientGuard(Arc::clone(self))
    }
}

/// A client connection reading a log (see [`StreamLog::client`]).
#[derive(Debug)]
pub struct ClientGuard(Arc<StreamLog>);

impl Drop for ClientGuard {
    fn drop(&mut self) {
        {
            let mut g = self.0.lock();
            g.clients = g.clients.saturating_sub(1);
        }
        self.0.bump();
    }
}

/// Wait for `rx` to change (forever once its sender is gone).
pub async fn changed(rx: &mut watch::Receiver<u64>) {
    if rx.changed().await.is_err() {
        std::future::pending::<()>().await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_reader_gets_every_frame_after_the_one_it_saw_and_the_end() {
        let log = StreamLog::new(1 << 20);
        for i in 0..5 {
            assert_eq!(log.push(|s| format!("id: {s}\ndata: {i}\n\n")), i);
        }
        let Read::Frames(f, done) = log.read(3) else {
            panic!()
        };
        assert_eq!(f.len(), 2);
        assert!(f[0].starts_with("id: 3\n"));
        assert!(!done);
        log.close();
        assert_eq!(log.read(5), Read::Frames(vec![], true));
    }

    #[test]
    fn past_its_bound_the_log_drops_its_oldest_frames_and_says_so() {
        let log = StreamLog::new(100);
        for _ in 0..10 {
            log.push(|s| format!("{s:020}"));
        }
        match log.read(0) {
            Read::Gone(first) => assert_eq!(first, 5, "five frames of 20 bytes fit in 100"),
            r => panic!("{r:?}"),
        }
        let Read::Frames(f, _) = log.read(5) else {
            panic!()
        };
        assert_eq!(f.len(), 5);
    }

    #[test]
    fn clients_are_counted_while_their_guard_lives() {
        let log = StreamLog::new(100);
        let mut rx = log.subscribe();
        rx.borrow_and_update();
        let a = log.client();
        let b = log.client();
        assert_eq!(log.clients(), 2);
        drop(a);
        assert_eq!(log.clients(), 1);
        assert!(rx.has_changed().unwrap());
        drop(b);
        assert_eq!(log.clients(), 0);
    }
}
