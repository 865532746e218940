//! The ring's socket I/O: posting each connection's one send (header and payload gathered,
//! zero-copy for large payloads where the kernel supports it) and one receive, and what their
//! completions do (partial sends resumed, zero-copy notifications awaited before a buffer is
//! let go, received bytes handed to the initiator's or the target's side).

use super::*;

impl Ring {
    /// Send the parts gathered in `conn.send`, holding what they hold until the kernel lets
    /// go of their payloads.
    pub(super) fn start_send(&mut self, slot: usize) {
        let conn = self.conns[slot].as_mut().expect("live");
        let s = &mut conn.send;
        s.busy = true;
        s.seq = conn.next_seq;
        conn.next_seq += 1;
        s.done = 0;
        s.total = (0..s.parts).map(|i| s.hdr_lens[i] + s.payloads[i].1).sum();
        s.zero_copy = conn.zero_copy && s.parts == 1 && s.payloads[0].1 >= ZERO_COPY_MIN_BYTES;
        let k = &self.shared.counters;
        if s.zero_copy {
            k.zero_copy_sends.fetch_add(1, Ordering::Relaxed);
        } else {
            k.copied_sends.fetch_add(1, Ordering::Relaxed);
        }
        self.post_send(slot);
    }

    /// Post what remains of the current send.
    pub(super) fn post_send(&mut self, slot: usize) {
        let conn = self.conns[slot].as_mut().expect("live");
        let s = &mut conn.send;
        let fd = types::Fd(conn.fd);
        debug_assert!(s.done < s.total);
        if s.zero_copy {
            // Header by copy, then the payload zero-copy, linked so they go in order. The
            // header buffer is not touched again until this send completes.
            let (hdr_len, (payload, payload_len)) = (s.hdr_lens[0], s.payloads[0]);
            let mut entries = Vec::with_capacity(2);
            let payload_done = if s.done < hdr_len {
                let e = opcode::Send::new(
                    fd,
                    // SAFETY: done < hdr_len <= the header buffer's length.
                    unsafe { s.hdrs[0].as_ptr().add(s.done) },
                    (hdr_len - s.done) as u32,
                )
                .flags(libc::MSG_WAITALL)
                .build()
                .flags(squeue::Flags::IO_LINK)
                .user_data(user_data(slot, SQE_SEND_HEADER, s.seq));
                entries.push(e);
                0
            } else {
                s.done - hdr_len
            };
            let e = opcode::SendZc::new(
                fd,
                // SAFETY: payload_done < payload_len; the payload is valid until its
                // notification (held until then).
                unsafe { payload.add(payload_done) },
                (payload_len - payload_done) as u32,
            )
            .flags(libc::MSG_WAITALL)
            .build()
            .user_data(user_data(slot, SQE_SEND, s.seq));
            entries.push(e);
            conn.outstanding += entries.len() as u32;
            for e in entries {
                self.push(e);
            }
            return;
        }
        // the iovecs of what is not sent yet: skip `done` bytes across the parts
        let mut skip = s.done;
        let mut n = 0;
        for i in 0..s.parts {
            let (payload, payload_len) = s.payloads[i];
            let pieces = [
                (s.hdrs[i].as_mut_ptr(), s.hdr_lens[i]),
                (payload.cast_mut(), payload_len),
            ];
            for (ptr, len) in pieces {
                if len == 0 {
                    continue;
                }
                if skip >= len {
                    skip -= len;
                    continue;
                }
                s.iov[n] = libc::iovec {
                    // SAFETY: skip < len, and ptr holds len bytes (a header buffer, or a
                    // payload held until the send completes).
                    iov_base: unsafe { ptr.add(skip) }.cast(),
                    iov_len: len - skip,
                };
                skip = 0;
                n += 1;
            }
        }
        s.msg.msg_iov = s.iov.as_mut_ptr();
        s.msg.msg_iovlen = n as _;
        let e = opcode::SendMsg::new(fd, &s.msg)
            .flags(libc::MSG_WAITALL as u32)
            .build()
            .user_data(user_data(slot, SQE_SEND, s.seq));
        conn.outstanding += 1;
        self.push(e);
    }

    pub(super) fn post_recv(&mut self, slot: usize) {
        let conn = self.conns[slot].as_mut().expect("live");
        let r = &mut conn.recv;
        r.busy = true;
        let left = (r.want - r.filled) as u32;
        // payloads: wait for all of it; headers: take what has come (several answers may be
        // wanted, and fewer may be due yet)
        let flags = if r.stage == Stage::Header {
            0
        } else {
            libc::MSG_WAITALL
        };
        let e = opcode::Recv::new(
            types::Fd(conn.fd),
            // SAFETY: filled < want, and ptr holds want bytes (the header buffer, a granted
            // window, a local range held by a wire reference, or the scratch).
            unsafe { r.ptr.add(r.filled) },
            left,
        )
        .flags(flags)
        .build()
        .user_data(user_data(slot, SQE_RECV, 0));
        conn.outstanding += 1;
        self.push(e);
    }

    // ---- completions -----------------------------------------------------------------------

    pub(super) fn on_notif(&mut self, slot: usize, seq: u64) {
        let Some(conn) = self.conn_mut(slot) else {
            return;
        };
        conn.outstanding -= 1;
        let mut done = None;
        if let Some(i) = conn.zc.iter().position(|z| z.seq == seq) {
            let z = &mut conn.zc[i];
            z.notifs -= 1;
            if z.notifs == 0 && z.finished {
                done = conn.zc.remove(i);
            }
        }
        if let Some(z) = done {
            self.release_held(z.held);
        }
        self.free_if_drained(slot);
    }

    pub(super) fn on_send_header(&mut self, slot: usize, res: i32) {
        let Some(conn) = self.conn_mut(slot) else {
            return;
        };
        conn.outstanding -= 1;
        if res > 0 {
            conn.send.done += res as usize;
            conn.last_progress = Instant::now();
        }
        // On error the linked payload send completes with -ECANCELED and handles it.
        self.free_if_drained(slot);
    }

    pub(super) fn on_send(&mut self, slot: usize, res: i32, more: bool) {
        let Some(conn) = self.conn_mut(slot) else {
            return;
        };
        conn.outstanding -= 1;
        let zero_copy = conn.send.zero_copy;
        if zero_copy && more {
            // a notification will follow for this SQE
            conn.outstanding += 1;
            let seq = conn.send.seq;
            match conn.zc.iter_mut().find(|z| z.seq == seq) {
                Some(z) => z.notifs += 1,
                None => conn.zc.push_back(ZcPending {
                    seq,
                    notifs: 1,
                    finished: false,
                    held: Held::default(),
                }),
            }
        }
        if conn.closing.is_some() {
            self.finish_send(slot);
            self.free_if_drained(slot);
            return;
        }
        if res < 0 {
            let errno = -res;
            if zero_copy && matches!(errno, libc::EOPNOTSUPP | libc::EINVAL) {
                // The socket cannot send zero-copy: fall back to copying, once and for all.
                conn.zero_copy = false;
                conn.send.zero_copy = false;
                self.post_send(slot);
                return;
            }
            self.finish_send(slot);
            self.errno = Some(errno);
            self.fail_conn(slot, failure_of(errno));
            return;
        }
        let s = &mut conn.send;
        s.done += res as usize;
        conn.last_progress = Instant::now();
        if s.done < s.total {
            if res == 0 {
                self.finish_send(slot);
                self.fail_conn(slot, OpFailure::PeerClosed);
            } else {
                self.post_send(slot);
            }
            return;
        }
        self.finish_send(slot);
    }

    /// The current send is over (done or abandoned): release what it held, or hand it to the
    /// zero-copy notifications still due.
    pub(super) fn finish_send(&mut self, slot: usize) {
        let Some(conn) = self.conn_mut(slot) else {
            return;
        };
        if !conn.send.busy {
            return;
        }
        conn.send.busy = false;
        let mut held = conn.send.take_held();
        let seq = conn.send.seq;
        if let Some(i) = conn.zc.iter().position(|z| z.seq == seq) {
            if conn.zc[i].notifs > 0 {
                // a zero-copy send has one part
                conn.zc[i].finished = true;
                conn.zc[i].held = held.pop().unwrap_or_default();
                for h in held {
                    self.release_held(h);
                }
                return;
            }
            conn.zc.remove(i);
        }
        for h in held {
            self.release_held(h);
        }
    }

    pub(super) fn on_recv(&mut self, slot: usize, res: i32) {
        let Some(conn) = self.conn_mut(slot) else {
            return;
        };
        conn.outstanding -= 1;
        conn.recv.busy = false;
        if conn.closing.is_some() {
            let batch = conn.recv.batch.take();
            let window = conn.serving.take().and_then(|s| s.window);
            if let Some(b) = batch {
                self.let_go(b);
            }
            if let Some(w) = window {
                self.shared.target.end(w);
            }
            self.free_if_drained(slot);
            return;
        }
        if res <= 0 {
            let why = if res == 0 {
                OpFailure::PeerClosed
            } else {
                self.errno = Some(-res);
                failure_of(-res)
            };
            self.fail_conn(slot, why);
            return;
        }
        let r = &mut conn.recv;
        r.filled += res as usize;
        conn.last_progress = Instant::now();
        // an initiator's answers are taken as soon as one whole answer is in
        let enough = match (&conn.role, r.stage) {
            (Role::Initiator { .. }, Stage::Header) => r.filled >= Response::WIRE_BYTES,
            _ => r.filled >= r.want,
        };
        if !enough {
            self.post_recv(slot);
            return;
        }
        let outcome = match conn.role {
            Role::Initiator { .. } => self.initiator_received(slot),
            Role::Target { .. } => self.target_received(slot),
        };
        if let Err(why) = outcome {
            self.fail_conn(slot, why);
        }
    }
}
