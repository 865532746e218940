//! The raw TCP bound of the same shape as the mesh: sockets opened inside the namespaces,
//! kept across a daemon count's runs, and the 1 MiB send and receive loops.

use super::*;

/// The raw bound's connections for one daemon count, opened once and kept across its runs
/// (as a daemon keeps its data connections): `STREAMS` per (source, destination) pair.
pub(super) struct RawMesh {
    pub(super) senders: Vec<TcpStream>,
    /// In the order of the destinations.
    pub(super) receivers: Vec<TcpStream>,
}

impl RawMesh {
    /// Connect the mesh's first `n` namespaces all to all: a listener in each (opened by a
    /// thread inside it), `STREAMS` connections from each of the others.
    pub(super) fn connect(mesh: &Mesh, n: usize) -> Result<RawMesh, String> {
        let listeners = (0..n)
            .map(|d| in_netns(&mesh.ns(d), move || TcpListener::bind((addr(d), 0))))
            .collect::<Result<Vec<_>, _>>()?;
        let mut ports = Vec::with_capacity(n);
        for l in &listeners {
            ports.push(l.local_addr().map_err(|e| e.to_string())?.port());
            l.set_nonblocking(true).map_err(|e| e.to_string())?;
        }
        let mut senders = Vec::new();
        for s in 0..n {
            let ports = &ports;
            senders.extend(in_netns(&mesh.ns(s), move || {
                let mut v = Vec::new();
                for d in (0..n).filter(|&d| d != s) {
                    let to = SocketAddr::from((addr(d), ports[d]));
                    for _ in 0..STREAMS {
                        v.push(TcpStream::connect_timeout(&to, IO_TIMEOUT)?);
                    }
                }
                Ok(v)
            })?);
        }
        let mut receivers = Vec::with_capacity(senders.len());
        for l in &listeners {
            receivers.extend(accept(l, (n - 1) * STREAMS)?);
        }
        for c in senders.iter().chain(&receivers) {
            c.set_read_timeout(Some(IO_TIMEOUT))
                .and_then(|()| c.set_write_timeout(Some(IO_TIMEOUT)))
                .map_err(|e| e.to_string())?;
        }
        Ok(RawMesh { senders, receivers })
    }

    /// One run: every stream carries `stream_bytes` from `src` into a share of `dst` of its
    /// own, all at once; GB/s over all streams. Each stream's bytes pass through the kernel
    /// in full, so which receiver reads which sender's bytes does not matter.
    pub(super) fn run(&self, stream_bytes: u64, src: &[u8], dst: &mut [u8]) -> Result<f64, String> {
        let total = self.senders.len();
        let share = dst.len() / total.max(1) / PIECE * PIECE;
        if total == 0 || share < PIECE || src.len() < 2 * PIECE {
            return Err("the raw buffers are too small for the streams".into());
        }
        let step = (src.len() - PIECE) / total / 4096 * 4096;
        let mut tasks: Vec<Task<'_, ()>> = Vec::with_capacity(2 * total);
        for (i, c) in self.senders.iter().enumerate() {
            tasks.push(Box::new(move || send(c, src, i * step, stream_bytes)));
        }
        for (c, part) in self.receivers.iter().zip(dst.chunks_mut(share)) {
            tasks.push(Box::new(move || receive(c, part, stream_bytes)));
        }
        let (secs, _) = gated(tasks, Some(RAW_STACK))?;
        Ok((total as u64 * stream_bytes) as f64 / 1e9 / secs)
    }
}

/// Accept `count` connections on non-blocking `l` (they are all connected already), within
/// 10 s.
pub(super) fn accept(l: &TcpListener, count: usize) -> Result<Vec<TcpStream>, String> {
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut out = Vec::with_capacity(count);
    while out.len() < count {
        match l.accept() {
            Ok((c, _)) => {
                c.set_nonblocking(false).map_err(|e| e.to_string())?;
                out.push(c);
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock && Instant::now() < deadline => {
                std::thread::sleep(Duration::from_millis(1));
            }
            Err(e) => return Err(format!("raw accept: {e}")),
        }
    }
    Ok(out)
}

/// Send `bytes` from `src` in 1 MiB writes, walking it from `at`.
pub(super) fn send(mut c: &TcpStream, src: &[u8], mut at: usize, bytes: u64) -> Result<(), String> {
    let mut sent = 0u64;
    while sent < bytes {
        let n = ((bytes - sent) as usize).min(PIECE);
        if at + n > src.len() {
            at = 0;
        }
        c.write_all(&src[at..at + n])
            .map_err(|e| format!("raw send: {e}"))?;
        sent += n as u64;
        at += n;
    }
    Ok(())
}

/// Receive `bytes` into `dst` in 1 MiB reads, walking it round.
pub(super) fn receive(mut c: &TcpStream, dst: &mut [u8], bytes: u64) -> Result<(), String> {
    let (mut got, mut at) = (0u64, 0usize);
    while got < bytes {
        let n = ((bytes - got) as usize).min(PIECE);
        if at + n > dst.len() {
            at = 0;
        }
        c.read_exact(&mut dst[at..at + n])
            .map_err(|e| format!("raw receive: {e}"))?;
        got += n as u64;
        at += n;
    }
    Ok(())
}
