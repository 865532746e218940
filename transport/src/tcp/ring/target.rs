//! The ring's target side: a request header read, its grant checked before anything is
//! touched, a write's payload received straight into the window (or drained when refused)
//! and its CRC (and, where the connection has them, its MAC) checked, a read's payload sent
//! straight from the window, answers in order.

use super::*;
use crate::grant::{Access, Direction, SegmentId, TransferId};
use crate::local::crc32c;
use crate::tcp::wire::{FLAG_CHECKSUM, Kind, Status};

impl Ring {
    pub(super) fn pump_target(&mut self, slot: usize) {
        let conn = self.conns[slot].as_mut().expect("live");
        if !conn.send.busy && !conn.replies.is_empty() {
            conn.send.parts = 0;
            // header-only replies go together; a reply with a payload goes alone
            while conn.send.parts < MAX_GATHER {
                let alone = conn.replies.front().is_some_and(|r| r.window.is_some());
                if alone && conn.send.parts > 0 {
                    break;
                }
                let Some(reply) = conn.replies.pop_front() else {
                    break;
                };
                let (payload, len) = match &reply.window {
                    Some(w) => (w.ptr.cast_const(), w.len),
                    None => (std::ptr::null(), 0),
                };
                let held = Held {
                    batch: None,
                    window: reply.window,
                };
                conn.send
                    .add(&mut conn.seal, &reply.response.encode(), payload, len, held);
                if alone {
                    break;
                }
            }
            self.start_send(slot);
        }
        let conn = self.conns[slot].as_mut().expect("live");
        if !conn.recv.busy && conn.serving.is_none() && conn.replies.len() < MAX_REPLIES {
            conn.recv.stage = Stage::Header;
            conn.recv.want = Request::WIRE_BYTES;
            conn.recv.filled = 0;
            conn.recv.ptr = conn.recv.hdr.as_mut_ptr();
            self.post_recv(slot);
        }
    }

    /// A full unit arrived on a target connection (a request header, a write's payload, or a
    /// piece of a refused write's payload being drained).
    pub(super) fn target_received(&mut self, slot: usize) -> std::result::Result<(), OpFailure> {
        let chunk_bytes = self.shared.config.chunk_bytes;
        let conn = self.conn_mut(slot).expect("live");
        match conn.recv.stage {
            Stage::Header => {
                let hdr: &[u8; Request::WIRE_BYTES] = conn.recv.hdr[..Request::WIRE_BYTES]
                    .try_into()
                    .expect("a request header");
                if conn.unseal.open(hdr).is_err() {
                    self.tampered();
                    return Err(OpFailure::Tampered);
                }
                let req = Request::decode(hdr).map_err(|_| OpFailure::Protocol)?;
                if req.len > chunk_bytes {
                    return Err(OpFailure::Protocol);
                }
                let Role::Target { peer } = conn.role else {
                    return Err(OpFailure::Protocol);
                };
                let access = Access {
                    segment: SegmentId(req.segment),
                    offset: req.offset,
                    len: u64::from(req.len),
                    direction: match req.kind {
                        Kind::Write => Direction::RemoteWrite,
                        Kind::Read => Direction::RemoteRead,
                    },
                    transfer: TransferId(req.transfer),
                    epoch: req.epoch,
                    peer,
                };
                let verdict = self.shared.target.begin(&access, req.node_generation);
                if verdict.is_err() {
                    self.shared.counters.refused.fetch_add(1, Ordering::Relaxed);
                }
                match req.kind {
                    Kind::Write => self.receive_write(slot, req, verdict),
                    Kind::Read => self.answer_read(slot, req, verdict),
                }
                Ok(())
            }
            Stage::Payload => {
                let serving = conn.serving.take().ok_or(OpFailure::Protocol)?;
                let mac_key = conn.payload_mac.clone();
                let w = serving.window.expect("a payload stage has a window");
                let req = serving.request;
                // SAFETY: the window's len bytes just arrived; the grant keeps others off.
                let got = unsafe { std::slice::from_raw_parts_mut(w.ptr, w.len) };
                if self.rewrite_this_one() {
                    crate::tcp::forge::keep_crc_change_bytes(got);
                }
                let crc_ok = req.flags & FLAG_CHECKSUM == 0 || crc32c(0, got) == req.crc;
                let mac_ok = mac_key.as_ref().is_none_or(|k| k.check(got, &req.mac));
                if !mac_ok {
                    self.tampered();
                }
                let intact = crc_ok && mac_ok;
                if !intact {
                    self.shared.target.end_corrupt(w);
                } else if req.flags & FLAG_CHECKSUM != 0 {
                    self.shared.target.end_verified(w, req.offset, req.crc);
                } else {
                    // No checksum came with it: the transfer's ledger no longer says what its
                    // pages hold, so its commit reads them (a write never skips its check).
                    self.shared.target.end_unverified(w);
                }
                let status = if intact {
                    self.shared
                        .counters
                        .chunks_served
                        .fetch_add(1, Ordering::Relaxed);
                    Status::Ok
                } else {
                    self.shared
                        .counters
                        .checksum_failures
                        .fetch_add(1, Ordering::Relaxed);
                    Status::Corrupt
                };
                self.reply(slot, Response::header(req.tag, status), None);
                Ok(())
            }
            Stage::Drain => {
                let serving = conn.serving.as_mut().ok_or(OpFailure::Protocol)?;
                serving.left -= conn.recv.want;
                let left = serving.left;
                if left > 0 {
                    let piece = left.min(DRAIN_BYTES);
                    conn.recv.want = piece;
                    conn.recv.filled = 0;
                    conn.recv.ptr = conn.scratch.as_mut_ptr();
                    self.post_recv(slot);
                    return Ok(());
                }
                let s = conn.serving.take().expect("checked");
                let refused = Response {
                    refusal: s.refusal,
                    ..Response::header(s.request.tag, Status::Refused)
                };
                self.reply(slot, refused, None);
                Ok(())
            }
        }
    }

    pub(super) fn receive_write(
        &mut self,
        slot: usize,
        req: Request,
        verdict: std::result::Result<Window, u8>,
    ) {
        let conn = self.conn_mut(slot).expect("live");
        match verdict {
            Ok(w) => {
                conn.recv.stage = Stage::Payload;
                conn.recv.ptr = w.ptr;
                conn.recv.want = w.len;
                conn.recv.filled = 0;
                conn.serving = Some(Serving {
                    request: req,
                    window: Some(w),
                    refusal: 0,
                    left: 0,
                });
            }
            Err(code) => {
                if conn.scratch.is_empty() {
                    conn.scratch = vec![0; DRAIN_BYTES];
                }
                let piece = (req.len as usize).min(DRAIN_BYTES);
                conn.recv.stage = Stage::Drain;
                conn.recv.ptr = conn.scratch.as_mut_ptr();
                conn.recv.want = piece;
                conn.recv.filled = 0;
                conn.serving = Some(Serving {
                    request: req,
                    window: None,
                    refusal: code,
                    left: req.len as usize,
                });
            }
        }
        self.post_recv(slot);
    }

    pub(super) fn answer_read(
        &mut self,
        slot: usize,
        req: Request,
        verdict: std::result::Result<Window, u8>,
    ) {
        match verdict {
            Ok(w) => {
                // SAFETY: the window lies inside a live read grant, which nobody writes.
                let bytes = unsafe { std::slice::from_raw_parts(w.ptr, w.len) };
                let crc = if req.flags & FLAG_CHECKSUM != 0 {
                    let known = self.shared.target.known_checksum(
                        TransferId(req.transfer),
                        SegmentId(req.segment),
                        req.offset,
                        u64::from(req.len),
                    );
                    let crc = known.unwrap_or_else(|| crc32c(0, bytes));
                    crc ^ u32::from(self.corrupt_this_one())
                } else {
                    0
                };
                self.shared
                    .counters
                    .chunks_served
                    .fetch_add(1, Ordering::Relaxed);
                let conn = self.conn_mut(slot).expect("live");
                let mac = conn
                    .payload_mac
                    .as_ref()
                    .map(|k| k.mac(bytes))
                    .unwrap_or_default();
                let ok = Response {
                    len: w.len as u32,
                    crc,
                    mac,
                    ..Response::header(req.tag, Status::Ok)
                };
                self.reply(slot, ok, Some(w));
            }
            Err(code) => {
                let refused = Response {
                    refusal: code,
                    ..Response::header(req.tag, Status::Refused)
                };
                self.reply(slot, refused, None);
            }
        }
    }

    /// Queue `response` (and a read's payload, from `window`) behind the replies before it.
    pub(super) fn reply(&mut self, slot: usize, response: Response, window: Option<Window>) {
        let conn = self.conn_mut(slot).expect("live");
        conn.replies.push_back(Reply { response, window });
    }
}
