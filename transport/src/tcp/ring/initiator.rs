//! The ring's initiator side: chunks pulled from an endpoint's queue while fewer than its
//! window are unanswered, and the responses read in order (a read's payload straight into
//! the local range, then its CRC, and where the connection has them its MAC, checked).

use super::*;
use crate::local::crc32c;
use crate::tcp::wire::{FLAG_CHECKSUM, Kind, Status};

impl Ring {
    pub(super) fn pump_initiator(&mut self, slot: usize, endpoint: EndpointId) {
        let window = self.shared.config.window;
        let conn = self.conns[slot].as_mut().expect("live");
        if !conn.send.busy {
            conn.send.parts = 0;
            // gather chunks while the window allows (one only for a zero-copy connection,
            // whose headers must stay untouched until the kernel lets go of them)
            let gather = if conn.zero_copy { 1 } else { MAX_GATHER };
            while self.conns[slot].as_ref().expect("live").send.parts < gather
                && self.conns[slot].as_ref().expect("live").inflight.len() < window
            {
                let Some(chunk) = self
                    .endpoints
                    .get_mut(&endpoint)
                    .and_then(|ep| ep.queue.pop_front())
                else {
                    break;
                };
                self.add_chunk(slot, chunk);
            }
            if self.conns[slot].as_ref().expect("live").send.parts > 0 {
                self.start_send(slot);
            }
        }
        let conn = self.conns[slot].as_mut().expect("live");
        if !conn.recv.busy && !conn.inflight.is_empty() {
            // answers to writes carry no payload, so several can be taken in one receive;
            // an answer to a read is taken alone (its payload goes elsewhere)
            let writes = conn
                .inflight
                .iter()
                .take(MAX_ANSWERS)
                .take_while(|c| c.request.kind == Kind::Write)
                .count();
            conn.recv.stage = Stage::Header;
            conn.recv.want = writes.max(1) * Response::WIRE_BYTES;
            conn.recv.ptr = conn.recv.hdr.as_mut_ptr();
            self.post_recv(slot);
        }
    }

    /// Put one chunk into the send being gathered on `slot`.
    pub(super) fn add_chunk(&mut self, slot: usize, mut chunk: Chunk) {
        chunk.request.tag = self.next_tag;
        self.next_tag += 1;
        let checksummed = chunk.request.flags & FLAG_CHECKSUM != 0;
        let corrupt = checksummed && chunk.request.kind == Kind::Write && self.corrupt_this_one();
        let len = chunk.request.len as usize;
        let mac_key = self.conns[slot].as_ref().expect("live").payload_mac.clone();
        let (payload, payload_len, held) = match chunk.request.kind {
            Kind::Write => {
                // SAFETY: the chunk's local range holds len bytes, which nobody writes until
                // the batch settles (the posting contract).
                let bytes = unsafe { std::slice::from_raw_parts(chunk.local, len) };
                if checksummed {
                    let crc = chunk.known_crc.unwrap_or_else(|| crc32c(0, bytes));
                    chunk.request.crc = crc ^ u32::from(corrupt);
                }
                if let Some(k) = &mac_key {
                    chunk.request.mac = k.mac(bytes);
                }
                self.shared.batches().wire_taken(chunk.batch, 1);
                let held = Held {
                    batch: Some(chunk.batch),
                    window: None,
                };
                (chunk.local.cast_const(), len, held)
            }
            Kind::Read => (std::ptr::null(), 0, Held::default()),
        };
        let conn = self.conns[slot].as_mut().expect("live");
        if conn.inflight.is_empty() {
            conn.last_progress = Instant::now();
        }
        conn.send.add(
            &mut conn.seal,
            &chunk.request.encode(),
            payload,
            payload_len,
            held,
        );
        conn.inflight.push_back(chunk);
    }

    /// A full unit arrived on an initiator connection (a response header or a read's
    /// payload).
    pub(super) fn initiator_received(&mut self, slot: usize) -> std::result::Result<(), OpFailure> {
        let conn = self.conn_mut(slot).expect("live");
        match conn.recv.stage {
            Stage::Header => self.initiator_answers(slot),
            Stage::Payload => {
                let c = conn.inflight.pop_front().ok_or(OpFailure::Protocol)?;
                let batch = conn.recv.batch.take();
                // the next receive starts a fresh header buffer
                conn.recv.filled = 0;
                conn.recv.stage = Stage::Header;
                // the header kept from `initiator_answers`, whose tag was checked there
                let hdr: [u8; Response::WIRE_BYTES] = conn.recv.hdr[..Response::WIRE_BYTES]
                    .try_into()
                    .expect("a response header");
                let resp = Response::decode(&hdr).map_err(|_| OpFailure::Protocol)?;
                let mac_key = conn.payload_mac.clone();
                // SAFETY: the receive just filled these len bytes of the chunk's local range;
                // nobody else touches them before the batch settles.
                let got =
                    unsafe { std::slice::from_raw_parts_mut(c.local, c.request.len as usize) };
                if self.rewrite_this_one() {
                    crate::tcp::forge::keep_crc_change_bytes(got);
                }
                let crc_ok = c.request.flags & FLAG_CHECKSUM == 0 || crc32c(0, got) == resp.crc;
                let mac_ok = mac_key.as_ref().is_none_or(|k| k.check(got, &resp.mac));
                if !mac_ok {
                    self.tampered();
                }
                let intact = crc_ok && mac_ok;
                if let Some(b) = batch {
                    self.let_go(b);
                }
                if intact {
                    if c.request.flags & FLAG_CHECKSUM != 0 {
                        self.shared.batches().record_crc(
                            c.batch,
                            c.op,
                            c.request.offset,
                            c.request.len,
                            resp.crc,
                        );
                    }
                    self.finish(&c, ChunkOutcome::Delivered);
                } else {
                    self.shared
                        .counters
                        .checksum_failures
                        .fetch_add(1, Ordering::Relaxed);
                    self.finish(&c, ChunkOutcome::Failed(OpFailure::Corrupt));
                }
                Ok(())
            }
            Stage::Drain => Err(OpFailure::Protocol),
        }
    }

    /// Handle every whole answer in the header buffer (several answers to writes, or one to a
    /// read, which then receives its payload); keep a partial one for the next receive.
    pub(super) fn initiator_answers(&mut self, slot: usize) -> std::result::Result<(), OpFailure> {
        let mut at = 0;
        loop {
            let conn = self.conn_mut(slot).expect("live");
            if conn.recv.filled - at < Response::WIRE_BYTES {
                break;
            }
            let hdr: [u8; Response::WIRE_BYTES] = conn.recv.hdr[at..at + Response::WIRE_BYTES]
                .try_into()
                .expect("a response header");
            at += Response::WIRE_BYTES;
            if conn.unseal.open(&hdr).is_err() {
                self.tampered();
                return Err(OpFailure::Tampered);
            }
            let resp = Response::decode(&hdr).map_err(|_| OpFailure::Protocol)?;
            let front = conn.inflight.front().ok_or(OpFailure::Protocol)?;
            if resp.tag != front.request.tag {
                return Err(OpFailure::Protocol);
            }
            match (resp.status, front.request.kind) {
                (Status::Ok, Kind::Read) => {
                    // only ever asked for alone, so nothing follows it in the buffer
                    if resp.len != front.request.len || conn.recv.filled != at {
                        return Err(OpFailure::Protocol);
                    }
                    let (ptr, batch, len) = (front.local, front.batch, resp.len as usize);
                    conn.recv.stage = Stage::Payload;
                    conn.recv.ptr = ptr;
                    conn.recv.want = len;
                    conn.recv.filled = 0;
                    conn.recv.batch = Some(batch);
                    // remember the answer (its CRC) until the payload is in
                    conn.recv.hdr[..Response::WIRE_BYTES].copy_from_slice(&hdr);
                    self.shared.batches().wire_taken(batch, 1);
                    self.post_recv(slot);
                    return Ok(());
                }
                (Status::Ok, Kind::Write) => {
                    if resp.len != 0 {
                        return Err(OpFailure::Protocol);
                    }
                    let c = conn.inflight.pop_front().expect("front exists");
                    self.finish(&c, ChunkOutcome::Delivered);
                }
                (status, _) => {
                    let c = conn.inflight.pop_front().expect("front exists");
                    let why = match status {
                        Status::Refused => OpFailure::Refused(resp.refusal),
                        // counted by the target, which found it
                        Status::Corrupt => OpFailure::Corrupt,
                        _ => OpFailure::Protocol,
                    };
                    self.finish(&c, ChunkOutcome::Failed(why));
                }
            }
        }
        let r = &mut self.conn_mut(slot).expect("live").recv;
        r.hdr.copy_within(at..r.filled, 0);
        r.filled -= at;
        Ok(())
    }
}
