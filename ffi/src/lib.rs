//! libkvd: the C ABI over kvd's client and control shim.
//!
//! The C functions arrive with the C ABI issue; this crate exists now so that the workspace
//! layout is the final one. It depends on `kvd-client` (and `kvd-core`) only, and
//! `scripts/check-deps.py` fails the test suite if what it links ever includes a daemon
//! dependency.

/// The kvd library version this libkvd was built from.
pub fn version() -> &'static str {
    env!("CARGO_PKG_VERSION")
}
