//! libkvd: the C ABI over kvd's client (`kvd-client`), for engines that link kvd from C, C++
//! or Python. The header is `include/kvd.h`, generated from this crate by cbindgen.
//!
//! libkvd adds no logic of its own: each `kvd_*` function checks and converts its arguments,
//! calls the matching `kvd_client::Client` method, and returns a status code.
//!
//! - Status codes (`status`): `KVD_OK` is 0; every `kvd_core::Error` variant has its own code,
//!   the same number as `Error::code()`; `kvd_status_str` gives its text; the calling thread's
//!   last error (`kvd_last_error_message`, `kvd_last_error_info`) the detail.
//! - No panic crosses the boundary: every entry point runs inside one wrapper
//!   (`handles::entry`) that turns a panic into `KVD_ERR_INTERNAL`.
//! - Every pointer and length is checked (`args`): NULL, misaligned, too short and out-of-range
//!   arguments are `KVD_ERR_INVALID_ARGUMENT`. A `KvdClient *` is a checked handle, not an
//!   address: use after `kvd_close`, a double close and a forged handle are errors.
//! - Thread-safety: every function may be called from any thread. Calls on one client are
//!   serialized by the client's own lock; open one client per thread to move bytes in parallel.
//!   Functions without a client (`kvd_version`, `kvd_status_str`, `kvd_namespace_id`,
//!   `kvd_block_tags`, ...) share nothing.
//! - ABI: `KVD_ABI_VERSION` changes whenever a struct or a signature does; the caller passes
//!   the one it was compiled with in `KvdClientOptions.abi_version` and `kvd_connect` refuses
//!   another (`KVD_ERR_PROTOCOL`).
//!
//! - Asynchronous lookups (`kvd_async_*`): a worker thread per client, started only by
//!   `kvd_async_start`, with a bounded queue and an eventfd, so a scheduler never blocks on kvd.
//!
//! This crate depends on `kvd-client` and `kvd-core` only; `scripts/check-deps.py` fails the
//! test suite if what it links ever includes a daemon dependency.
//!
//! - CUDA copies (`kvd_cuda_*`, `cuda`): in every build; without the `cuda` feature (or a
//!   driver) they answer `KVD_ERR_UNSUPPORTED`.
//!
//! All of its `unsafe` (turning the caller's pointers into references) is in `args.rs`, except
//! the two CUDA copy calls in `cuda.rs`, whose device pointers and stream are the caller's
//! contract.

#![cfg(target_pointer_width = "64")]

mod args;
mod asynchronous;
mod blocks;
mod checkpoints;
mod cuda;
mod events;
mod handles;
mod session;
mod status;
mod transfers;
mod types;
mod views;

use std::ffi::c_char;

pub use asynchronous::*;
pub use blocks::*;
pub use checkpoints::*;
pub use cuda::*;
pub use events::*;
pub use handles::{KVD_MAX_CLIENTS, KvdClient};
pub use session::*;
pub use status::*;
pub use transfers::*;
pub use types::*;
pub use views::*;

/// The version of libkvd's C ABI (structs and signatures). A caller built against another one
/// is refused at connect.
pub const KVD_ABI_VERSION: u32 = 1;

/// The kvd release this libkvd was built from, e.g. "0.1.0" (a static string). Thread-safe.
#[unsafe(no_mangle)]
pub extern "C" fn kvd_version() -> *const c_char {
    concat!(env!("CARGO_PKG_VERSION"), "\0").as_ptr().cast()
}

/// This libkvd's `KVD_ABI_VERSION` (to compare with the header a caller was built against).
/// Thread-safe.
#[unsafe(no_mangle)]
pub extern "C" fn kvd_abi_version() -> u32 {
    KVD_ABI_VERSION
}
