//! Same-node data movement: the shared region engines map, the page-generation table that
//! tells a reader when a page moved on, the copies into and out of them, and the `local`
//! transfer backend (the transfer interface as memcpy between segments).

pub mod copy;
pub mod engine;
pub mod generations;
pub mod region;

pub use copy::{copy, copy_with_crc32c, crc32c, crc32c_combine};
pub use engine::{LocalRegistration, LocalTransport};
pub use generations::PageGenerations;
pub use region::{Backing, HugePages, SharedRegion};
