//! Passing the pool's file descriptor over the Unix socket (SCM_RIGHTS).
//!
//! The daemon sends the [`super::HelloReply::Welcome`] frame with the memfd attached to its
//! first byte; the client receives the frame and the descriptor in one `recvmsg`. Both sides use
//! these two functions (rustix's safe wrappers: no `unsafe` here). The kernel installs a new
//! descriptor in the client (close-on-exec); nothing else about the fd crosses the socket.

use std::io::{IoSlice, IoSliceMut};
use std::mem::MaybeUninit;
use std::os::fd::{BorrowedFd, OwnedFd};

use rustix::net::{
    RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags, SendAncillaryBuffer,
    SendAncillaryMessage, SendFlags,
};

/// Send `bytes` with `fd` attached. Returns the bytes sent (the rest, if any, must follow with
/// ordinary writes; the fd went with the first byte).
///
/// # Errors
/// The socket's error (`WouldBlock` on a non-blocking socket that is full).
pub fn send_with_fd(
    socket: BorrowedFd<'_>,
    bytes: &[u8],
    fd: BorrowedFd<'_>,
) -> std::io::Result<usize> {
    let fds = [fd];
    let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(1))];
    let mut control = SendAncillaryBuffer::new(&mut space);
    let pushed = control.push(SendAncillaryMessage::ScmRights(&fds));
    debug_assert!(pushed, "space for one fd was reserved");
    let n = rustix::net::sendmsg(
        socket,
        &[IoSlice::new(bytes)],
        &mut control,
        SendFlags::NOSIGNAL,
    )?;
    Ok(n)
}

/// Receive up to `buf.len()` bytes and, if one came with them, a file descriptor. Extra
/// descriptors (a confused or hostile peer) are closed at once.
///
/// # Errors
/// The socket's error.
pub fn recv_with_fd(
    socket: BorrowedFd<'_>,
    buf: &mut [u8],
) -> std::io::Result<(usize, Option<OwnedFd>)> {
    let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(4))];
    let mut control = RecvAncillaryBuffer::new(&mut space);
    let msg = rustix::net::recvmsg(
        socket,
        &mut [IoSliceMut::new(buf)],
        &mut control,
        RecvFlags::CMSG_CLOEXEC,
    )?;
    let mut received = None;
    for m in control.drain() {
        if let RecvAncillaryMessage::ScmRights(fds) = m {
            for fd in fds {
                if received.is_none() {
                    received = Some(fd);
                } // else: dropped, i.e. closed
            }
        }
    }
    Ok((msg.bytes, received))
}
