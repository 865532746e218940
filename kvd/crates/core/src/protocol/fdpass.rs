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
    let n = rustix::net::sendmsg(
        socket,
        &[IoSlice::new(bytes)],
        &mut control,
        SendFlags::NOSIGNAL,
    )?;
    Ok(n)
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
    let msg = rustix::net::recvmsg(
        socket,
        &mut [IoSliceMut::new(buf)],
        &mut control,
        RecvFlags::CMSG_CLOEXEC,
    )?;
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
