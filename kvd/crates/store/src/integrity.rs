//! Integrity: every block carries a CRC-32C recorded at SEAL, either supplied by the writer
//! (computed during its copy with [`transport::local::copy_with_crc32c`], so it costs no extra
//! pass over memory) or computed by the store. Reads verify it when asked; a mismatch
//! quarantines the block: it leaves the index at once, is never read again, reads as a miss,
//! and its page returns to the pool after `quarantine_hold_ms` once no pin remains.

use crate::error::BlockState;
use crate::pins::ReadTicket;
use crate::state::Inner;

impl Inner {
    /// Take a PUBLISHED (or RETIRED) block out of service after a checksum mismatch.
    pub fn quarantine(&mut self, i: u32) {
        let st = self.slots[i as usize].state;
        if !matches!(st, Some(BlockState::Published | BlockState::Retired)) {
            return; // already quarantined, or gone
        }
        self.counters.checksum_failures += 1;
        self.unlink(i);
        self.set_state(i, BlockState::Quarantined);
        self.slots[i as usize].quarantined_at_ms = self.now();
        self.quarantine.push_back(i);
        tracing::warn!(slot = i, key = %self.slots[i as usize].key, "checksum mismatch: block quarantined");
    }

    /// Mark a PUBLISHED block in use for a checksum pass outside the lock.
    pub fn check_prepare(&mut self, i: u32) -> ReadTicket {
        let s = &mut self.slots[i as usize];
        debug_assert_eq!(s.state, Some(BlockState::Published));
        s.in_use += 1;
        ReadTicket {
            slot: i,
            page_offset: self.pool.page_offset(i),
            len: s.len,
            checksum: s.checksum,
        }
    }
}
