//! A health canary: one small block written, sealed, published, read back and verified through
//! the daemon, then removed. It exercises every part an engine's data path depends on (the
//! socket, the store's lifecycle, the mapped pool, the checksums) in one call, so a liveness
//! probe of the engine can tell "kvd works for me" from "kvd's process is up".

use std::time::Instant;

use kvd_core::error::Corruption;
use kvd_core::keys::{BlockKey, BlockTag, NamespaceDescriptor};
use kvd_core::protocol::SealItem;
use kvd_core::types::{BlockClass, Handle};
use kvd_core::{Error, Result};

use crate::Client;

/// Bytes the canary block holds.
pub const CANARY_BYTES: usize = 4096;

/// What a passed canary measured.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HealthReport {
    /// Microseconds the whole write-read-verify-remove cycle took (six round trips).
    pub elapsed_us: u64,
    /// Bytes written and read back.
    pub bytes: u64,
}

/// The canary's own layout, apart from every engine's.
fn canary_namespace() -> NamespaceDescriptor {
    NamespaceDescriptor {
        head_dim: 1,
        ..NamespaceDescriptor::minimal("kvd.health", "1", 1, CANARY_BYTES as u64)
    }
}

impl Client {
    /// Run the canary: register the canary namespace, allocate one block under a key no one else
    /// uses, write a pattern (CRC in the copy), seal, publish, acquire, read it back verified,
    /// compare, release, and compare-and-delete it. Whatever fails, nothing is left behind
    /// beyond what the session's end cleans up.
    ///
    /// # Errors
    /// The first step's error ([`Error::NoSpace`] when the pool has no page for it,
    /// [`Error::Corrupt`] when the bytes read back differ, the connection's errors).
    pub fn health_check(&mut self) -> Result<HealthReport> {
        let started = Instant::now();
        let ns = self.register_namespace(&canary_namespace())?;
        let nonce = self.next_id;
        let mut h = blake3::Hasher::new();
        h.update(&self.welcome.session.0.to_le_bytes());
        h.update(&std::process::id().to_le_bytes());
        h.update(&nonce.to_le_bytes());
        let key = BlockKey {
            namespace: ns,
            tag: BlockTag(*h.finalize().as_bytes()),
        };
        let data: Vec<u8> = (0..CANARY_BYTES)
            .map(|i| (i as u64).wrapping_mul(31).wrapping_add(nonce) as u8)
            .collect();
        let a = self
            .alloc(&[key], BlockClass::Cache, None)?
            .pop()
            .ok_or_else(|| Error::Protocol("no allocation item for the canary".into()))??;
        let written = self.canary_publish(&a.handle, &data);
        if let Err(e) = written {
            let _ = self.abort(&[a.handle]);
            return Err(e);
        }
        let checked = self.canary_read_back(key, &data);
        let removed = self.remove_if(&[(key, a.handle.version())]);
        checked?;
        removed?.pop().unwrap_or(Ok(()))?;
        Ok(HealthReport {
            elapsed_us: started.elapsed().as_micros() as u64,
            bytes: CANARY_BYTES as u64,
        })
    }

    fn canary_publish(&mut self, h: &Handle, data: &[u8]) -> Result<()> {
        let crc = self.write_with_crc(h, 0, data, 0)?;
        let item = SealItem {
            handle: *h,
            len: data.len() as u64,
            checksum: Some(crc),
        };
        self.seal(&[item])?.pop().unwrap_or(Ok(0))?;
        self.publish(&[*h])
    }

    fn canary_read_back(&mut self, key: BlockKey, data: &[u8]) -> Result<()> {
        let b = self
            .acquire(&[key], None)?
            .pop()
            .ok_or_else(|| Error::Protocol("no acquire item for the canary".into()))??;
        let mut back = vec![0u8; data.len()];
        let read = self.read_verified(&b.handle, &mut back);
        let released = self.release(&[b.handle]);
        read?;
        released?;
        if back != data {
            return Err(Error::Corrupt {
                expected: b.checksum,
                found: transport::local::crc32c(0, &back),
                outcome: Corruption::ReaderCopy,
            });
        }
        Ok(())
    }
}
