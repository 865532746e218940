//! The synchronisation primitives the store uses: `std`'s, or shuttle's under the model checker.

#[cfg(feature = "shuttle")]
pub(crate) use shuttle::sync::{Mutex, MutexGuard};
#[cfg(not(feature = "shuttle"))]
pub(crate) use std::sync::{Mutex, MutexGuard};
