//! Same-node memory primitives: the shared region engines map, the page-generation table that
//! tells a reader when a page moved on, and the copies into and out of them (plain,
//! non-temporal, fused with a CRC-32C). No backend lives here: every backend and the store use
//! these (the in-process backend is [`crate::inproc`]).

pub mod copy;
pub mod generations;
pub mod region;

pub use copy::{copy, copy_with_crc32c, crc32c, crc32c_combine};
pub use generations::PageGenerations;
pub use region::{Backing, HugePages, SharedRegion};
