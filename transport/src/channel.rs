//! An authenticated connection between two nodes after its handshake: the stream, the two
//! halves of its key ([`crate::auth::Sealer`], [`crate::auth::Unsealer`]) and its place under
//! the per-peer bound. The TCP engine's ring takes data connections apart
//! ([`Channel::into_parts`]); everything else a node says to another (the daemons' own
//! control messages, the RDMA backend's side channel) goes as length-framed messages, each
//! tagged:
//!
//! ```text
//! 0  4   message bytes (u32 LE, at most the reader's bound)
//! 4  n   the message
//! 4+n 16 tag over the length and the message (and the frame's place in the stream)
//! ```
//!
//! A frame whose tag is wrong, or that announces more than the reader allows, is an error
//! and the channel must be dropped: it is out of step with its peer. So is a frame whose
//! bytes stop coming: however long a channel may idle between frames, once a frame's length
//! has arrived the rest must within [`FRAME_TIMEOUT`] (a length changed in flight to a larger
//! one, or a peer that stalls mid-frame, costs that long, not a thread forever).

use std::io::{Read, Write};
use std::net::TcpStream;
use std::os::fd::{AsFd, BorrowedFd};
use std::os::unix::net::UnixStream;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use crate::admission::Admitted;
use crate::auth::{PayloadKey, Sealer, TAG_BYTES, Unsealer};
use crate::error::{Error, Result};
use crate::link::wire::Purpose;

/// How long the rest of a frame may take once its length has arrived.
pub const FRAME_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(2);

/// A peer node's connections of one purpose: what the per-peer bound counts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct PeerPurpose {
    /// The peer's node id (as it authenticated).
    pub node: u64,
    /// What the connections are for.
    pub purpose: Purpose,
}

impl std::fmt::Display for PeerPurpose {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let what = match self.purpose {
            Purpose::Data => "data",
            Purpose::Control => "control",
            Purpose::Rdma => "RDMA side",
        };
        write!(f, "node {} ({what} connections)", self.node)
    }
}

/// What a channel's bytes travel over: a TCP connection between nodes, or one end of an
/// in-process pair (the in-process backend's control channels, which cross no network).
#[derive(Debug)]
pub enum Stream {
    /// A TCP connection (the data port).
    Tcp(TcpStream),
    /// One end of a socket pair within this process.
    Pair(UnixStream),
}

impl Stream {
    /// How long a read may block (`None`: forever).
    ///
    /// # Errors
    /// As the socket's `set_read_timeout`.
    pub fn set_read_timeout(&self, t: Option<Duration>) -> std::io::Result<()> {
        match self {
            Stream::Tcp(s) => s.set_read_timeout(t),
            Stream::Pair(s) => s.set_read_timeout(t),
        }
    }

    /// How long a write may block (`None`: forever).
    ///
    /// # Errors
    /// As the socket's `set_write_timeout`.
    pub fn set_write_timeout(&self, t: Option<Duration>) -> std::io::Result<()> {
        match self {
            Stream::Tcp(s) => s.set_write_timeout(t),
            Stream::Pair(s) => s.set_write_timeout(t),
        }
    }

    /// The read timeout set.
    ///
    /// # Errors
    /// As the socket's `read_timeout`.
    pub fn read_timeout(&self) -> std::io::Result<Option<Duration>> {
        match self {
            Stream::Tcp(s) => s.read_timeout(),
            Stream::Pair(s) => s.read_timeout(),
        }
    }

    /// Another handle on the same connection (to shut it down from elsewhere).
    ///
    /// # Errors
    /// As the socket's `try_clone` (out of descriptors).
    pub fn try_clone(&self) -> std::io::Result<Stream> {
        Ok(match self {
            Stream::Tcp(s) => Stream::Tcp(s.try_clone()?),
            Stream::Pair(s) => Stream::Pair(s.try_clone()?),
        })
    }

    /// Shut both directions down (the peer reads end of stream).
    ///
    /// # Errors
    /// As the socket's `shutdown`.
    pub fn shutdown(&self) -> std::io::Result<()> {
        match self {
            Stream::Tcp(s) => s.shutdown(std::net::Shutdown::Both),
            Stream::Pair(s) => s.shutdown(std::net::Shutdown::Both),
        }
    }
}

impl AsFd for Stream {
    fn as_fd(&self) -> BorrowedFd<'_> {
        match self {
            Stream::Tcp(s) => s.as_fd(),
            Stream::Pair(s) => s.as_fd(),
        }
    }
}

impl Read for &Stream {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        match self {
            Stream::Tcp(s) => (&*s).read(buf),
            Stream::Pair(s) => (&*s).read(buf),
        }
    }
}

impl Write for &Stream {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        match self {
            Stream::Tcp(s) => (&*s).write(buf),
            Stream::Pair(s) => (&*s).write(buf),
        }
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// One authenticated connection, ready for tagged frames.
#[derive(Debug)]
pub struct Channel {
    stream: Stream,
    seal: Sealer,
    unseal: Unsealer,
    place: Option<Admitted<PeerPurpose>>,
    /// Where frames that fail their tag are counted (the engine's counter).
    failures: Option<Arc<AtomicU64>>,
    /// The key of the connection's payload MACs, where its binds turned them on.
    payload_mac: Option<PayloadKey>,
}

/// A TCP channel taken apart for a user that frames its own (the TCP engine's ring).
#[derive(Debug)]
pub struct Parts {
    /// The connection.
    pub stream: TcpStream,
    /// Tags what this end sends.
    pub seal: Sealer,
    /// Checks what this end receives.
    pub unseal: Unsealer,
    /// The place under the per-peer bound (the responder's side holds one).
    pub place: Option<Admitted<PeerPurpose>>,
    /// The key of the payload MACs, where the connection has them.
    pub payload_mac: Option<PayloadKey>,
}

fn io(what: &str, e: &std::io::Error) -> Error {
    match e.kind() {
        std::io::ErrorKind::UnexpectedEof
        | std::io::ErrorKind::ConnectionReset
        | std::io::ErrorKind::BrokenPipe => {
            Error::PeerUnavailable(format!("{what}: the peer closed the connection ({e})"))
        }
        _ => Error::PeerUnavailable(format!("{what}: {e}")),
    }
}

impl Channel {
    /// A connection whose handshake is done: its key's halves for this end, and its place
    /// under the per-peer bound (the responder's side holds one).
    pub fn new(
        stream: TcpStream,
        seal: Sealer,
        unseal: Unsealer,
        place: Option<Admitted<PeerPurpose>>,
    ) -> Channel {
        Channel {
            stream: Stream::Tcp(stream),
            seal,
            unseal,
            place,
            failures: None,
            payload_mac: None,
        }
    }

    /// Two ends of a channel within this process, keyed with `key` (`initiator` is the
    /// first's end): what the in-process backend's control channels are. Framing, tags and
    /// bounds are the TCP channel's; only the bytes cross no network.
    ///
    /// # Errors
    /// [`Error::Io`] when the socket pair cannot be made (out of descriptors).
    pub fn pair(key: &crate::auth::SessionKey) -> Result<(Channel, Channel)> {
        use crate::auth::Role;
        let (a, b) = UnixStream::pair().map_err(|e| io("make an in-process channel", &e))?;
        let end = |s, role| {
            let (seal, unseal) = key.split(role);
            Channel {
                stream: Stream::Pair(s),
                seal,
                unseal,
                place: None,
                failures: None,
                payload_mac: None,
            }
        };
        Ok((end(a, Role::Initiator), end(b, Role::Responder)))
    }

    /// Count the frames that fail their tag in `failures`.
    #[must_use]
    pub fn counting(mut self, failures: Arc<AtomicU64>) -> Channel {
        self.failures = Some(failures);
        self
    }

    /// Carry payload MACs under `key` (the handshake's, where either end's bind asked).
    #[must_use]
    pub fn with_payload_mac(mut self, key: PayloadKey) -> Channel {
        self.payload_mac = Some(key);
        self
    }

    /// Whether the connection carries payload MACs.
    pub fn has_payload_mac(&self) -> bool {
        self.payload_mac.is_some()
    }

    /// The stream, to set its timeouts or shut it down.
    pub fn stream(&self) -> &Stream {
        &self.stream
    }

    /// Send one message as a tagged frame (blocking, within the stream's write timeout).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for a message over 4 GiB; [`Error::PeerUnavailable`] when
    /// the connection fails.
    pub fn send(&mut self, msg: &[u8]) -> Result<()> {
        let len = u32::try_from(msg.len())
            .map_err(|_| Error::InvalidArgument("a control message over 4 GiB".into()))?;
        let len = len.to_le_bytes();
        let tag = self.seal.tag(&[&len, msg]);
        let mut frame = Vec::with_capacity(4 + msg.len() + TAG_BYTES);
        frame.extend_from_slice(&len);
        frame.extend_from_slice(msg);
        frame.extend_from_slice(&tag);
        (&self.stream)
            .write_all(&frame)
            .map_err(|e| io("send on a peer connection", &e))
    }

    /// Receive one message of at most `max` bytes, its tag checked (blocking, within the
    /// stream's read timeout).
    ///
    /// # Errors
    /// [`Error::PeerUnavailable`] when the connection fails or closes; [`Error::InvalidArgument`]
    /// for a frame over `max` (nothing is allocated for it) or one whose tag is wrong.
    pub fn recv(&mut self, max: usize) -> Result<Vec<u8>> {
        let mut len = [0u8; 4];
        (&self.stream)
            .read_exact(&mut len)
            .map_err(|e| io("receive on a peer connection", &e))?;
        let n = u32::from_le_bytes(len) as usize;
        if n > max {
            return Err(Error::InvalidArgument(format!(
                "a peer frame of {n} bytes (at most {max}); the connection is closed"
            )));
        }
        let mut body = vec![0u8; n + TAG_BYTES];
        let idle = self.stream.read_timeout().unwrap_or(None);
        let within = idle.map_or(FRAME_TIMEOUT, |t| t.min(FRAME_TIMEOUT));
        let _ = self.stream.set_read_timeout(Some(within));
        let got = (&self.stream).read_exact(&mut body);
        let _ = self.stream.set_read_timeout(idle);
        got.map_err(|e| io("receive on a peer connection (mid-frame)", &e))?;
        self.unseal
            .check(&[&len, &body[..n]], &body[n..])
            .inspect_err(|_| {
                if let Some(f) = &self.failures {
                    f.fetch_add(1, Ordering::Relaxed);
                }
            })?;
        body.truncate(n);
        Ok(body)
    }

    /// The TCP stream, the key's halves, the place and the payload MAC key, for a user that
    /// frames its own (the TCP engine's ring); `None` for an in-process channel, which
    /// carries no data.
    pub fn into_parts(self) -> Option<Parts> {
        match self.stream {
            Stream::Tcp(stream) => Some(Parts {
                stream,
                seal: self.seal,
                unseal: self.unseal,
                place: self.place,
                payload_mac: self.payload_mac,
            }),
            Stream::Pair(_) => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::auth::{ClusterSecret, Initiator, Responder, Role};

    /// Two ends of a loopback connection, keyed by a real handshake's key.
    fn pair() -> (Channel, Channel) {
        let s = ClusterSecret::from_bytes(&[3; 32]).unwrap();
        let (i, hello) = Initiator::start(&s).unwrap();
        let (r, c) = Responder::answer(&s, &hello).unwrap();
        let (p, ki) = i.respond(&c).unwrap();
        let (ki, kr) = (ki.key, r.verify(&p).unwrap().key);
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let a = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (b, _) = l.accept().unwrap();
        let (si, ui) = ki.split(Role::Initiator);
        let (sr, ur) = kr.split(Role::Responder);
        (Channel::new(a, si, ui, None), Channel::new(b, sr, ur, None))
    }

    #[test]
    fn messages_go_both_ways_and_a_changed_or_oversized_frame_is_refused() {
        let (mut a, mut b) = pair();
        for n in [0usize, 1, 100, 70_000] {
            let m: Vec<u8> = (0..n).map(|i| i as u8).collect();
            a.send(&m).unwrap();
            assert_eq!(b.recv(1 << 20).unwrap(), m);
            b.send(&m).unwrap();
            assert_eq!(a.recv(1 << 20).unwrap(), m);
        }
        // a frame with one byte changed on the way (written by hand past the sealer)
        let (mut a, mut b) = pair();
        let len = 3u32.to_le_bytes();
        let tag = a.seal.tag(&[&len, b"abc"]);
        let mut raw = len.to_vec();
        raw.extend_from_slice(b"abd");
        raw.extend_from_slice(&tag);
        (&a.stream).write_all(&raw).unwrap();
        let e = b.recv(1 << 20).unwrap_err();
        assert!(e.to_string().contains("integrity"), "{e}");
        // a frame over the reader's bound: refused before its body is read
        let (mut a, mut b) = pair();
        a.send(&[0u8; 64]).unwrap();
        let e = b.recv(63).unwrap_err();
        assert!(e.to_string().contains("at most 63"), "{e}");
        // a frame whose length came and whose rest never does: cut at the frame timeout, even
        // on a channel that may idle forever between frames
        let (a, mut b) = pair();
        (&a.stream).write_all(&10u32.to_le_bytes()).unwrap();
        let t = std::time::Instant::now();
        assert!(b.recv(1 << 20).is_err());
        assert!(t.elapsed() < FRAME_TIMEOUT * 3, "{:?}", t.elapsed());
        // the peer gone: a clear error
        let (a, mut b) = pair();
        drop(a);
        let e = b.recv(10).unwrap_err();
        assert!(e.to_string().contains("closed"), "{e}");
    }

    #[test]
    fn an_in_process_pair_frames_and_checks_like_a_tcp_channel() {
        let key = crate::auth::SessionKey::fresh().unwrap();
        let (mut a, mut b) = Channel::pair(&key).unwrap();
        a.send(b"offer").unwrap();
        assert_eq!(b.recv(64).unwrap(), b"offer");
        b.send(b"granted").unwrap();
        assert_eq!(a.recv(64).unwrap(), b"granted");
        // a frame sent by the wrong end's sealer (reflected) fails its tag
        let (a, mut b) = Channel::pair(&key).unwrap();
        let len = 2u32.to_le_bytes();
        let tag = b.seal.tag(&[&len, b"hi"]);
        let mut raw = len.to_vec();
        raw.extend_from_slice(b"hi");
        raw.extend_from_slice(&tag);
        (&a.stream).write_all(&raw).unwrap();
        let e = b.recv(64).unwrap_err();
        assert!(e.to_string().contains("integrity"), "{e}");
        assert!(
            a.into_parts().is_none(),
            "an in-process channel carries no data ring"
        );
    }
}
