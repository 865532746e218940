//! Same-node data movement: the shared region engines map, the page-generation table that
//! tells a reader when a page moved on, and the copies into and out of them.

pub mod copy;
pub mod generations;
pub mod region;

pub use copy::{copy, copy_with_crc32c, crc32c, crc32c_combine};
pub use generations::PageGenerations;
pub use region::{Backing, HugePages, SharedRegion};
