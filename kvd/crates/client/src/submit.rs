//! Asynchronous calls for event loops: an engine's scheduler submits a lookup and polls for its
//! completion, and never blocks on kvd.
//!
//! A [`Submitter`] owns one worker thread (started only when the engine asks for it) that runs
//! the submitted calls on a shared client, one at a time, and an eventfd that becomes readable
//! when completions are waiting, for the engine's own `epoll`/`poll`/asyncio loop. Submissions
//! are bounded: at most `max_inflight` calls submitted and not yet polled; one more is
//! [`Error::Overloaded`] at once, never a wait. The calls run on the same client (and session)
//! as the engine's other calls, so blocks pinned by an asynchronous lookup are read through that
//! client as usual.

use std::collections::VecDeque;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::sync::mpsc::{Receiver, SyncSender, TrySendError, sync_channel};
use std::sync::{Arc, Condvar, Mutex, PoisonError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use kvd_core::keys::{BlockTag, NamespaceId};
use kvd_core::types::Handle;
use kvd_core::types::PrefixHit;
use kvd_core::{Error, Result};

use crate::Client;

/// A client shared between the engine's threads and a [`Submitter`]'s worker (`None` once
/// closed).
pub type SharedClient = Arc<Mutex<Option<Client>>>;

/// The most calls a submitter can have in flight.
pub const MAX_INFLIGHT: usize = 4096;

/// A call to run asynchronously.
#[derive(Debug, Clone)]
pub enum AsyncOp {
    /// [`Client::lookup_prefix`].
    LookupPrefix {
        /// The layout.
        namespace: NamespaceId,
        /// The chain.
        tags: Vec<BlockTag>,
        /// Pin what is found.
        pin: bool,
        /// The pins' TTL.
        pin_ttl_ms: Option<u64>,
    },
    /// [`Client::release`]: pins handed back without waiting for the answer.
    Release {
        /// The pins.
        handles: Vec<Handle>,
    },
}

/// What a finished call answered.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AsyncReply {
    /// The lookup's hit.
    Prefix(PrefixHit),
    /// How many of a release's pins were released (the others were stale or gone already:
    /// their TTL ends them in any case).
    Released(usize),
}

/// One finished call.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Completion {
    /// The tag the caller gave at submit.
    pub user_tag: u64,
    /// A second word passed through untouched (a binding's out-buffer, for example).
    pub context: u64,
    /// The call's result.
    pub result: Result<AsyncReply>,
}

#[derive(Debug)]
struct Job {
    user_tag: u64,
    context: u64,
    op: AsyncOp,
}

#[derive(Debug, Default)]
struct Done {
    queue: VecDeque<Completion>,
    /// Submitted and not yet polled.
    inflight: usize,
}

/// The asynchronous side of a shared client: a bounded queue, one worker, an eventfd.
#[derive(Debug)]
pub struct Submitter {
    tx: Option<SyncSender<Job>>,
    done: Arc<(Mutex<Done>, Condvar)>,
    eventfd: Arc<OwnedFd>,
    max_inflight: usize,
    worker: Option<JoinHandle<()>>,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

impl Submitter {
    /// Start the worker for `client`, with at most `max_inflight` calls submitted and not yet
    /// polled (1..=[`MAX_INFLIGHT`]).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for a bound out of range; [`Error::Io`] if the eventfd or the
    /// thread cannot be created.
    pub fn start(client: SharedClient, max_inflight: usize) -> Result<Submitter> {
        if max_inflight == 0 || max_inflight > MAX_INFLIGHT {
            return Err(Error::InvalidArgument(format!(
                "max_inflight {max_inflight} is outside 1..={MAX_INFLIGHT}"
            )));
        }
        let eventfd = rustix::event::eventfd(
            0,
            rustix::event::EventfdFlags::CLOEXEC | rustix::event::EventfdFlags::NONBLOCK,
        )
        .map_err(|e| Error::Io(format!("eventfd: {e}")))?;
        let eventfd = Arc::new(eventfd);
        let (tx, rx) = sync_channel(max_inflight);
        let done = Arc::new((Mutex::new(Done::default()), Condvar::new()));
        let worker = {
            let (done, eventfd) = (Arc::clone(&done), Arc::clone(&eventfd));
            std::thread::Builder::new()
                .name("kvd-submit".into())
                .spawn(move || work(&client, &rx, &done, &eventfd))
                .map_err(|e| Error::Io(format!("starting the submit thread: {e}")))?
        };
        Ok(Submitter {
            tx: Some(tx),
            done,
            eventfd,
            max_inflight,
            worker: Some(worker),
        })
    }

    /// The eventfd: readable while completions wait to be polled.
    pub fn fd(&self) -> BorrowedFd<'_> {
        self.eventfd.as_fd()
    }

    /// Queue a call; it runs on the worker. Never waits.
    ///
    /// # Errors
    /// [`Error::Overloaded`] when `max_inflight` calls are submitted and not yet polled.
    pub fn submit(&self, user_tag: u64, context: u64, op: AsyncOp) -> Result<()> {
        {
            let mut d = lock(&self.done.0);
            if d.inflight >= self.max_inflight {
                return Err(Error::Overloaded {
                    what: format!(
                        "{} asynchronous calls are in flight: poll their completions",
                        self.max_inflight
                    ),
                    retry_after_ms: 1,
                });
            }
            d.inflight += 1;
        }
        let job = Job {
            user_tag,
            context,
            op,
        };
        match self.tx.as_ref().map(|tx| tx.try_send(job)) {
            Some(Ok(())) => Ok(()),
            Some(Err(TrySendError::Full(_))) | Some(Err(TrySendError::Disconnected(_))) | None => {
                lock(&self.done.0).inflight -= 1;
                Err(Error::Disconnected("the submit thread has stopped".into()))
            }
        }
    }

    /// Take up to `max` completions, waiting at most `timeout` for the first (zero: do not
    /// wait).
    pub fn poll(&self, max: usize, timeout: Duration) -> Vec<Completion> {
        let deadline = Instant::now() + timeout;
        let (m, cv) = &*self.done;
        let mut d = lock(m);
        while d.queue.is_empty() {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                break;
            }
            d = cv
                .wait_timeout(d, left)
                .unwrap_or_else(PoisonError::into_inner)
                .0;
        }
        let n = max.min(d.queue.len());
        let out: Vec<Completion> = d.queue.drain(..n).collect();
        d.inflight -= out.len();
        if d.queue.is_empty() {
            // Reset the eventfd's counter: nothing waits any more.
            let mut b = [0u8; 8];
            let _ = rustix::io::read(&*self.eventfd, &mut b);
        }
        out
    }
}

impl Drop for Submitter {
    fn drop(&mut self) {
        self.tx.take(); // the worker's receive fails once the queue is empty: it exits
        if let Some(w) = self.worker.take() {
            let _ = w.join();
        }
    }
}

fn work(
    client: &SharedClient,
    rx: &Receiver<Job>,
    done: &(Mutex<Done>, Condvar),
    eventfd: &OwnedFd,
) {
    while let Ok(job) = rx.recv() {
        let result = match client.lock() {
            Err(_) => Err(Error::Disconnected(
                "an earlier call on this client panicked; close it".into(),
            )),
            Ok(mut g) => match g.as_mut() {
                None => Err(Error::Disconnected("the client was closed".into())),
                Some(c) => run(c, job.op),
            },
        };
        lock(&done.0).queue.push_back(Completion {
            user_tag: job.user_tag,
            context: job.context,
            result,
        });
        done.1.notify_all();
        let _ = rustix::io::write(eventfd, &1u64.to_ne_bytes());
    }
}

fn run(c: &mut Client, op: AsyncOp) -> Result<AsyncReply> {
    match op {
        AsyncOp::LookupPrefix {
            namespace,
            tags,
            pin,
            pin_ttl_ms,
        } => c
            .lookup_prefix(&namespace, &tags, pin, pin_ttl_ms)
            .map(AsyncReply::Prefix),
        AsyncOp::Release { handles } => c
            .release(&handles)
            .map(|each| AsyncReply::Released(each.iter().filter(|r| r.is_ok()).count())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn closed() -> SharedClient {
        Arc::new(Mutex::new(None))
    }

    fn lookup() -> AsyncOp {
        AsyncOp::LookupPrefix {
            namespace: NamespaceId([0; 32]),
            tags: vec![BlockTag([1; 32])],
            pin: false,
            pin_ttl_ms: None,
        }
    }

    #[test]
    fn a_bound_outside_its_range_is_refused() {
        assert!(Submitter::start(closed(), 0).is_err());
        assert!(Submitter::start(closed(), MAX_INFLIGHT + 1).is_err());
    }

    #[test]
    fn a_call_on_a_closed_client_completes_with_disconnected_and_signals_the_eventfd() {
        let s = Submitter::start(closed(), 2).unwrap();
        s.submit(1, 10, lookup()).unwrap();
        s.submit(2, 20, lookup()).unwrap();
        assert!(matches!(
            s.submit(3, 30, lookup()),
            Err(Error::Overloaded { .. })
        ));
        let fd = s.fd();
        let mut fds = [rustix::event::PollFd::new(
            &fd,
            rustix::event::PollFlags::IN,
        )];
        let ten_s = rustix::event::Timespec {
            tv_sec: 10,
            tv_nsec: 0,
        };
        assert_eq!(rustix::event::poll(&mut fds, Some(&ten_s)).unwrap(), 1);
        let mut got = Vec::new();
        for _ in 0..100 {
            got.extend(s.poll(4, Duration::from_millis(100)));
            if got.len() == 2 {
                break;
            }
        }
        assert_eq!(
            got.iter()
                .map(|c| (c.user_tag, c.context))
                .collect::<Vec<_>>(),
            vec![(1, 10), (2, 20)],
            "in submission order, context passed through"
        );
        assert!(
            got.iter()
                .all(|c| matches!(c.result, Err(Error::Disconnected(_))))
        );
        s.submit(3, 30, lookup()).unwrap();
    }
}
