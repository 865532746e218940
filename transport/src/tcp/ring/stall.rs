//! Telling a stalled connection from a slow one: the ring's periodic stall check (completions
//! first, then the socket's own byte counts from `TCP_INFO`), and the report a failed
//! connection's warning carries.

use super::*;

impl Ring {
    /// Fail the connections that made no progress for the stall timeout. Progress is a
    /// completion, or failing that bytes moving under the socket: a slow but healthy link (many
    /// peers sharing few cores, a shaped link) may take longer than the timeout to complete
    /// one large send or receive, while a stopped peer or a cut link moves nothing. So at half
    /// the timeout without a completion the socket's byte counts (TCP_INFO: bytes acked by the
    /// peer, bytes received from it) are noted, and at the timeout a connection whose counts
    /// rose at [`MIN_BYTES_MOVING_PER_S`] or more since is given another period instead of
    /// failed.
    /// A connection that moves nothing fails at the timeout, as before; one that stops moving
    /// after its counts were noted fails at most one period later.
    pub(super) fn check_stalls(&mut self) {
        let timeout = self.shared.config.stall_timeout;
        let moving = (MIN_BYTES_MOVING_PER_S * (timeout / 2).as_secs_f64()).max(1.0) as u64;
        let now = Instant::now();
        let gap = now - std::mem::replace(&mut self.last_check, now);
        let mut stalled = Vec::new();
        for (slot, c) in self.conns.iter_mut().enumerate() {
            let Some(c) = c else { continue };
            let waiting = c.has_work_out();
            let quiet = now - c.last_progress;
            if c.closing.is_some() || !waiting || quiet <= timeout / 2 {
                c.tcp_seen = None;
                continue;
            }
            if quiet <= timeout {
                if c.tcp_seen.is_none() {
                    c.tcp_seen = tcp_bytes(c.fd);
                }
                continue;
            }
            // no counts noted (none to be had, or the loop did not run in the second half):
            // a stall, as by completions alone
            match (c.tcp_seen, tcp_bytes(c.fd)) {
                (Some(seen), Some(b)) if b.moved_since(&seen) >= moving => {
                    c.last_progress = now;
                    c.tcp_seen = None;
                    self.shared
                        .counters
                        .slow_progress
                        .fetch_add(1, Ordering::Relaxed);
                }
                _ => stalled.push(slot),
            }
        }
        self.last_gap = gap;
        for slot in stalled {
            self.fail_conn(slot, OpFailure::Timeout);
        }
        if now - self.last_expire > Duration::from_millis(100) {
            self.last_expire = now;
            let _ = self.shared.target.expire(64);
        }
    }
}

/// What a stalled connection was doing, for its warning: which side, what it had under way,
/// and the bytes queued in its socket each way (a full send queue and an empty receive queue
/// point at the peer; bytes waiting to be received with no receive posted point here).
pub(super) fn stall_report(c: &Conn, now: Instant) -> String {
    let mut inq: libc::c_int = 0;
    let mut outq: libc::c_int = 0;
    // SAFETY: FIONREAD and TIOCOUTQ write one int through a valid pointer; the fd is the
    // connection's open socket.
    let (rin, rout) = unsafe {
        (
            libc::ioctl(c.fd, libc::FIONREAD, &raw mut inq),
            libc::ioctl(c.fd, libc::TIOCOUTQ, &raw mut outq),
        )
    };
    let peer = c
        .stream
        .peer_addr()
        .map_or_else(|_| "?".to_string(), |a| a.to_string());
    let local = c
        .stream
        .local_addr()
        .map_or_else(|_| "?".to_string(), |a| a.to_string());
    format!(
        "{role} {local}->{peer} quiet={quiet}ms send(busy={sb} {sd}/{st} parts={sp} zc={zc}) \
         recv(busy={rb} {stage:?} {rf}/{rw}) inflight={inf} serving={srv} replies={rep} \
         sockq(in={i} out={o}) tcp_seen={seen:?} tcp_now={tnow:?}",
        role = match c.role {
            Role::Initiator { .. } => "initiator",
            Role::Target { .. } => "target",
        },
        quiet = (now - c.last_progress).as_millis(),
        sb = c.send.busy,
        sd = c.send.done,
        st = c.send.total,
        sp = c.send.parts,
        zc = c.send.zero_copy,
        rb = c.recv.busy,
        stage = c.recv.stage,
        rf = c.recv.filled,
        rw = c.recv.want,
        inf = c.inflight.len(),
        srv = c.serving.as_ref().map_or(0, |s| s.request.len),
        rep = c.replies.len(),
        i = if rin == 0 { inq } else { -1 },
        o = if rout == 0 { outq } else { -1 },
        seen = c.tcp_seen,
        tnow = tcp_bytes(c.fd),
    )
}

/// The rate at which bytes must move under a connection's socket, over the second half of a
/// stall timeout, for it to count as slow rather than stalled: 32 KiB/s (80 KiB per half of
/// the 5 s default), far below any link kvd serves over and far above a peer that trickles
/// bytes to hold its connection.
const MIN_BYTES_MOVING_PER_S: f64 = 32.0 * 1024.0;

/// A socket's byte counts, from TCP_INFO.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct TcpBytes {
    /// Bytes this end sent that the peer acknowledged.
    acked: u64,
    /// Bytes this end received.
    received: u64,
}

impl TcpBytes {
    fn moved_since(&self, before: &TcpBytes) -> u64 {
        self.acked.saturating_sub(before.acked) + self.received.saturating_sub(before.received)
    }
}

/// `struct tcp_info` up to `tcpi_bytes_received` (Linux ≥ 4.2; the `libc` crate's copy ends
/// before the byte counts): 8 one-byte fields, 24 `u32`, then `u64`s of which the third and
/// fourth are the byte counts.
#[repr(C)]
#[derive(Default)]
struct TcpInfoBytes {
    _flags: [u8; 8],
    _u32s: [u32; 24],
    _pacing: [u64; 2],
    bytes_acked: u64,
    bytes_received: u64,
}

/// The socket's byte counts, or `None` where the kernel gives fewer fields (or none).
fn tcp_bytes(fd: RawFd) -> Option<TcpBytes> {
    let mut info = TcpInfoBytes::default();
    let mut len = std::mem::size_of::<TcpInfoBytes>() as libc::socklen_t;
    // SAFETY: `info` is a plain repr(C) struct of `len` bytes that outlives the call; the
    // kernel writes at most `len` bytes into it and says how many in `len`.
    let rc = unsafe {
        libc::getsockopt(
            fd,
            libc::IPPROTO_TCP,
            libc::TCP_INFO,
            (&raw mut info).cast(),
            &mut len,
        )
    };
    (rc == 0 && len as usize >= std::mem::size_of::<TcpInfoBytes>()).then_some(TcpBytes {
        acked: info.bytes_acked,
        received: info.bytes_received,
    })
}
