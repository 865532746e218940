//! libkvd: the C ABI over kvd's client and control shim.
//!
//! The C functions arrive with the C ABI issue (see `ROADMAP.md`); this crate exists now so that
//! the workspace layout is the final one and `kvd` is checked to build without its daemon
//! dependencies (this crate depends on `kvd` with default features off).

/// The kvd library version this libkvd was built from.
pub fn version() -> &'static str {
    env!("CARGO_PKG_VERSION")
}
