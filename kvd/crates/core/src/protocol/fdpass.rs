//! Passing the pool's file descriptors over the Unix socket (SCM_RIGHTS).
//!
//! The daemon sends the [`super::HelloReply::Welcome`] frame with two memfds attached to its
//! first byte, in this order: the pool region, then the page-generation table (sealed, so the
//! client can map it read-only only). The client receives the frame and the descriptors in one
//! `recvmsg`. Both sides use these two functions (rustix's safe wrappers: no `unsafe` here). The
//! kernel installs new descriptors in the client (close-on-exec); nothing else about them crosses
//! the socket.

use std::io::{IoSlice, IoSliceMut};
use std::mem::MaybeUninit;
use std::os::fd::{BorrowedFd, OwnedFd};

use rustix::net::{
    RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags, SendAncillaryBuffer,
    SendAncillaryMessage, SendFlags,
};

/// Descriptors one message may carry: the pool and the page table (more are closed on receipt).
pub const MAX_FDS: usize = 2;

/// Send `bytes` with `fds` (at most [`MAX_FDS`]) attached. Returns the bytes sent (the rest, if
/// any, must follow with ordinary writes; the fds went with the first byte).
///
/// # Errors
/// The socket's error (`WouldBlock` on a non-blocking socket that is full).
///
/// # Panics
/// With more than [`MAX_FDS`] descriptors (a caller bug).
pub fn send_with_fds(
    socket: BorrowedFd<'_>,
    bytes: &[u8],
    fds: &[BorrowedFd<'_>],
) -> std::io::Result<usize> {
    assert!(
        fds.len() <= MAX_FDS,
        "at most {MAX_FDS} descriptors per message"
    );
    let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(MAX_FDS))];
    let mut control = SendAncillaryBuffer::new(&mut space);
    let pushed = control.push(SendAncillaryMessage::ScmRights(fds));
    debug_assert!(pushed, "space for MAX_FDS fds was reserved");
    let n = retry_interrupted(|| {
        rustix::net::sendmsg(
            socket,
            &[IoSlice::new(bytes)],
            &mut control,
            SendFlags::NOSIGNAL,
        )
    })?;
    Ok(n)
}

/// How many times in a row a call a signal interrupted is made again.
pub const MAX_INTERRUPTED_RETRIES: u32 = 64;

/// `f`, made again while a signal interrupts it before it did anything (`EINTR`: the thread
/// caught a signal, e.g. an engine's timer or child handler), at most
/// [`MAX_INTERRUPTED_RETRIES`] times in a row.
fn retry_interrupted<T>(mut f: impl FnMut() -> rustix::io::Result<T>) -> std::io::Result<T> {
    let mut tries = 0;
    loop {
        match f() {
            Err(rustix::io::Errno::INTR) if tries < MAX_INTERRUPTED_RETRIES => tries += 1,
            r => return r.map_err(Into::into),
        }
    }
}

/// Receive up to `buf.len()` bytes and the file descriptors that came with them, in order, at
/// most [`MAX_FDS`]. Extra descriptors (a confused or hostile peer) are closed at once.
///
/// # Errors
/// The socket's error.
pub fn recv_with_fds(
    socket: BorrowedFd<'_>,
    buf: &mut [u8],
) -> std::io::Result<(usize, Vec<OwnedFd>)> {
    let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(MAX_FDS + 2))];
    let mut control = RecvAncillaryBuffer::new(&mut space);
    let msg = retry_interrupted(|| {
        rustix::net::recvmsg(
            socket,
            &mut [IoSliceMut::new(buf)],
            &mut control,
            RecvFlags::CMSG_CLOEXEC,
        )
    })?;
    let mut received = Vec::new();
    for m in control.drain() {
        if let RecvAncillaryMessage::ScmRights(fds) = m {
            for fd in fds {
                if received.len() < MAX_FDS {
                    received.push(fd);
                } // else: dropped, i.e. closed
            }
        }
    }
    Ok((msg.bytes, received))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::AsFd;
    use std::os::unix::net::UnixStream;
    use std::os::unix::thread::JoinHandleExt;
    use std::time::Duration;

    extern "C" fn ignore(_: libc::c_int) {}

    /// A handler installed without `SA_RESTART`, as an engine's runtime may: a blocking call the
    /// signal interrupts fails with `EINTR` instead of going on.
    fn interrupting_handler(signal: libc::c_int) {
        // SAFETY: a zeroed sigaction is valid; the handler does nothing, so it is
        // async-signal-safe; `sa_flags` 0 leaves SA_RESTART out on purpose.
        unsafe {
            let mut action: libc::sigaction = std::mem::zeroed();
            action.sa_sigaction = ignore as extern "C" fn(libc::c_int) as usize;
            assert_eq!(libc::sigaction(signal, &action, std::ptr::null_mut()), 0);
        }
    }

    #[test]
    fn a_welcome_read_a_signal_interrupts_goes_on_and_gets_its_bytes_and_fds() {
        interrupting_handler(libc::SIGUSR2);
        let (daemon, client) = UnixStream::pair().unwrap();
        let reader = std::thread::spawn(move || {
            let mut buf = [0u8; 16];
            recv_with_fds(client.as_fd(), &mut buf).map(|(n, fds)| (buf[..n].to_vec(), fds.len()))
        });
        for _ in 0..5 {
            std::thread::sleep(Duration::from_millis(20));
            // SAFETY: the reader thread is alive (it is joined below, after the send).
            let sent = unsafe { libc::pthread_kill(reader.as_pthread_t(), libc::SIGUSR2) };
            assert_eq!(sent, 0);
        }
        let (a, b) = UnixStream::pair().unwrap();
        let n = send_with_fds(daemon.as_fd(), b"welcome", &[a.as_fd(), b.as_fd()]).unwrap();
        assert_eq!(n, 7);
        let (got, fds) = reader.join().unwrap().expect("no EINTR reaches the caller");
        assert_eq!((got.as_slice(), fds), (&b"welcome"[..], 2));
    }
}
