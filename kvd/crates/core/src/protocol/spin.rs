//! A bounded spin before blocking: poll a socket for its next byte for a few tens of
//! microseconds before the caller sleeps in `read` (or in its event loop).
//!
//! A metadata call is a few microseconds of work on each side, but a thread that blocks at once
//! lets its CPU go idle, and waking an idle CPU (on a virtual machine: an interrupt to a halted
//! vCPU) costs tens of microseconds, more than the work. The answer that comes within the
//! budget is then read by a thread that never slept; one that comes later costs at most the
//! budget in CPU. Nothing is spent while no call waits. Both ends of the local socket use it:
//! the client waiting for an answer and the daemon's session waiting for the next request.
//!
//! [`Spinner`] makes it adaptive per connection: a spin that ran out disarms it (a client that
//! thinks between calls, a long batch), and a wait that ended within the budget without
//! spinning arms it again, so a connection whose peer is slow spends one budget, not one per
//! call.

use std::os::fd::AsFd;
use std::time::{Duration, Instant};

/// Spin on `fd` (peek, never consuming) until a byte is readable, the peer closed, or `budget`
/// has passed. Returns whether the socket became readable (or closed) within the budget; the
/// caller's read then finds it without sleeping. A zero budget returns `false` at once.
pub fn until_readable(fd: impl AsFd, budget: Duration) -> bool {
    if budget.is_zero() {
        return false;
    }
    let until = Instant::now() + budget;
    let flags = rustix::net::RecvFlags::PEEK | rustix::net::RecvFlags::DONTWAIT;
    let mut probe = [0u8; 1];
    loop {
        match rustix::net::recv(fd.as_fd(), &mut probe, flags) {
            Err(rustix::io::Errno::AGAIN | rustix::io::Errno::INTR) => {}
            // bytes, the peer's close or an error: the read that follows sees it at once
            _ => return true,
        }
        if Instant::now() >= until {
            return false;
        }
        // Yield rather than spin in place: where the peer waits for this very CPU (more
        // runnable threads than CPUs), a pure spin would hold it off until the budget ran out.
        std::thread::yield_now();
    }
}

/// The adaptive spin of one connection (see the module doc).
#[derive(Debug, Clone)]
pub struct Spinner {
    budget: Duration,
    armed: bool,
    began: Instant,
}

impl Spinner {
    /// A spinner with this budget per wait (zero: never spin).
    pub fn new(budget: Duration) -> Spinner {
        Spinner {
            budget,
            armed: !budget.is_zero(),
            began: Instant::now(),
        }
    }

    /// Before the blocking wait on `fd`: spin if armed; a spin that runs out disarms.
    pub fn before_wait(&mut self, fd: impl AsFd) {
        self.began = Instant::now();
        if self.armed {
            self.armed = until_readable(fd, self.budget);
        }
    }

    /// After the wait ended: one that took no longer than the budget arms the spinner again.
    pub fn after_wait(&mut self) {
        if !self.armed && !self.budget.is_zero() && self.began.elapsed() <= self.budget {
            self.armed = true;
        }
    }

    /// Whether the next wait spins.
    pub fn armed(&self) -> bool {
        self.armed
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;
    use std::os::unix::net::UnixStream;

    #[test]
    fn it_returns_when_a_byte_waits_and_gives_up_after_its_budget_without_consuming() {
        let (mut a, b) = UnixStream::pair().unwrap();
        let t = Instant::now();
        assert!(!until_readable(&b, Duration::from_millis(5)));
        assert!(t.elapsed() >= Duration::from_millis(5));
        assert!(!until_readable(&b, Duration::ZERO));
        a.write_all(b"x").unwrap();
        assert!(until_readable(&b, Duration::from_secs(5)));
        // peeked, not read: the byte is still there
        let mut got = [0u8; 1];
        std::io::Read::read_exact(&mut &b, &mut got).unwrap();
        assert_eq!(&got, b"x");
        drop(a);
        assert!(
            until_readable(&b, Duration::from_secs(5)),
            "a close ends the spin too"
        );
    }

    #[test]
    fn a_spin_that_runs_out_disarms_and_a_quick_wait_rearms() {
        let (mut a, b) = UnixStream::pair().unwrap();
        let mut s = Spinner::new(Duration::from_millis(2));
        assert!(s.armed());
        s.before_wait(&b);
        s.after_wait();
        assert!(!s.armed(), "nothing came within the budget");
        a.write_all(b"x").unwrap();
        s.before_wait(&b);
        s.after_wait();
        assert!(s.armed(), "the byte was there at once");
        assert!(!Spinner::new(Duration::ZERO).armed());
    }
}
