//! Same-node data movement: copies into and out of the shared pool.

pub mod copy;

pub use copy::{copy, copy_with_crc32c, crc32c, crc32c_combine};
