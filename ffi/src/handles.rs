//! Client handles: what a `KvdClient *` is, and how every entry point reaches its client.
//!
//! A `KvdClient *` is never a pointer to memory: it encodes a slot of a process-wide table and
//! the slot's generation (`generation << 32 | index << 8 | MAGIC`). Every call decodes it and
//! checks the magic, the index and the generation before touching anything, so a closed,
//! forged or garbage handle is `KVD_ERR_INVALID_ARGUMENT`, never a dereference of freed memory;
//! closing bumps the slot's generation, so a handle kept after `kvd_close` never reaches the
//! next client that reuses the slot.
//!
//! Each client sits behind its own mutex: calls on one client from several threads are safe
//! and run one at a time; for parallel transfers open one client per thread. A panic inside a
//! call (a libkvd bug) poisons that client: later calls on it get `KVD_ERR_INTERNAL`.

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use kvd_client::{Client, SharedClient, Submitter};
use kvd_core::Error;

use crate::status::{KVD_ERR_INTERNAL, KVD_OK, KvdErrorInfo, set_last};

/// An open session with the local daemon (opaque; see `kvd_connect`).
#[derive(Debug)]
pub struct KvdClient {
    _opaque: [u8; 0],
}

/// Clients a process may have open at once.
pub const KVD_MAX_CLIENTS: usize = 4096;

const MAGIC: usize = 0xA5;

type Cell = SharedClient;

#[derive(Default)]
struct Slot {
    generation: u32,
    client: Option<Cell>,
    /// The client's asynchronous queue, once started (reached without the client's lock, so a
    /// submit never waits for a call in flight).
    submitter: Option<Arc<Submitter>>,
}

static TABLE: Mutex<Vec<Slot>> = Mutex::new(Vec::new());

fn table() -> MutexGuard<'static, Vec<Slot>> {
    // The table's own operations cannot panic halfway; a poisoned lock still holds a table.
    TABLE.lock().unwrap_or_else(PoisonError::into_inner)
}

fn encode(index: usize, generation: u32) -> *mut KvdClient {
    (((generation as usize) << 32) | (index << 8) | MAGIC) as *mut KvdClient
}

fn decode(p: *mut KvdClient) -> Option<(usize, u32)> {
    let v = p as usize;
    (v & 0xff == MAGIC).then_some(((v >> 8) & 0xff_ffff, (v >> 32) as u32))
}

fn not_a_client(p: *mut KvdClient) -> Error {
    Error::InvalidArgument(format!(
        "{p:p} is not an open kvd client (NULL, closed, or never returned by kvd_connect)"
    ))
}

/// Put a connected client in the table; its handle.
pub(crate) fn insert(c: Client) -> kvd_core::Result<*mut KvdClient> {
    let mut t = table();
    let index = match t.iter().position(|s| s.client.is_none()) {
        Some(i) => i,
        None if t.len() < KVD_MAX_CLIENTS => {
            t.push(Slot::default());
            t.len() - 1
        }
        None => {
            return Err(Error::Overloaded {
                what: format!("{KVD_MAX_CLIENTS} kvd clients are open in this process"),
                retry_after_ms: 100,
            });
        }
    };
    let slot = &mut t[index];
    // Generation 0 is never handed out, so an all-zero-but-magic word is never a client.
    slot.generation = slot.generation.wrapping_add(1).max(1);
    slot.client = Some(Arc::new(Mutex::new(Some(c))));
    slot.submitter = None;
    Ok(encode(index, slot.generation))
}

/// The open slot `p` names, under the table's lock.
fn slot(t: &mut [Slot], p: *mut KvdClient) -> kvd_core::Result<&mut Slot> {
    let (index, generation) = decode(p).ok_or_else(|| not_a_client(p))?;
    match t.get_mut(index) {
        Some(s) if s.generation == generation && s.client.is_some() => Ok(s),
        _ => Err(not_a_client(p)),
    }
}

fn lookup(p: *mut KvdClient) -> kvd_core::Result<Cell> {
    let mut t = table();
    let s = slot(&mut t, p)?;
    Ok(Arc::clone(s.client.as_ref().expect("checked by slot")))
}

/// Start client `p`'s asynchronous queue (once).
pub(crate) fn start_submitter(p: *mut KvdClient, max_inflight: usize) -> kvd_core::Result<()> {
    let cell = lookup(p)?;
    let mut t = table();
    let s = slot(&mut t, p)?;
    if s.submitter.is_some() {
        return Err(Error::InvalidArgument(
            "this client's asynchronous queue is started already".into(),
        ));
    }
    s.submitter = Some(Arc::new(Submitter::start(cell, max_inflight)?));
    Ok(())
}

/// Run one entry point on client `p`'s asynchronous queue, without the client's lock.
pub(crate) fn with_submitter(
    name: &str,
    p: *mut KvdClient,
    f: impl FnOnce(&Submitter) -> Result<(), Failure>,
) -> i32 {
    entry(name, || {
        let sub = {
            let mut t = table();
            let s = slot(&mut t, p)?;
            s.submitter.clone().ok_or_else(|| {
                Error::InvalidArgument(
                    "this client has no asynchronous queue: call kvd_async_start first".into(),
                )
            })?
        };
        f(&sub)
    })
}

/// Take a client out of the table (its handle is dead from here on); `None` if `p` is not an
/// open client. Waits for a call in flight on it to finish.
pub(crate) fn remove(p: *mut KvdClient) -> kvd_core::Result<Option<Client>> {
    let (cell, submitter) = {
        let mut t = table();
        let s = slot(&mut t, p)?;
        (
            s.client.take().expect("checked by slot"),
            s.submitter.take(),
        )
    };
    // Stop the asynchronous worker first (it finishes the call it is running), then take the
    // client.
    drop(submitter);
    let mut g = cell.lock().unwrap_or_else(PoisonError::into_inner);
    Ok(g.take())
}

/// Why a call failed.
pub(crate) enum Failure {
    /// The client's error, with its status code.
    Kvd(Error),
    /// A libkvd bug.
    Internal(String),
}

impl From<Error> for Failure {
    fn from(e: Error) -> Self {
        Failure::Kvd(e)
    }
}

fn fail(name: &str, f: Failure) -> i32 {
    match f {
        Failure::Kvd(e) => set_last(KvdErrorInfo::of(&e), e.to_string()),
        Failure::Internal(why) => set_last(
            KvdErrorInfo {
                status: KVD_ERR_INTERNAL,
                ..KvdErrorInfo::default()
            },
            format!("{name}: internal error in libkvd: {why}"),
        ),
    }
}

fn panic_text(p: &(dyn std::any::Any + Send)) -> String {
    p.downcast_ref::<&str>()
        .map(|s| (*s).to_owned())
        .or_else(|| p.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "a panic".into())
}

/// Run one entry point: no panic crosses the boundary, every error becomes its status and this
/// thread's last error.
pub(crate) fn entry(name: &str, f: impl FnOnce() -> Result<(), Failure>) -> i32 {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(Ok(())) => KVD_OK,
        Ok(Err(e)) => fail(name, e),
        Err(p) => fail(name, Failure::Internal(panic_text(&*p))),
    }
}

/// Run one entry point on client `p`, holding its lock.
pub(crate) fn with_client(
    name: &str,
    p: *mut KvdClient,
    f: impl FnOnce(&mut Client) -> Result<(), Failure>,
) -> i32 {
    entry(name, || {
        let cell = lookup(p)?;
        let mut g = cell.lock().map_err(|_| {
            Failure::Internal("an earlier call on this client panicked; close it".into())
        })?;
        let c = g.as_mut().ok_or_else(|| not_a_client(p))?;
        f(c)
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::status::KVD_ERR_INVALID_ARGUMENT;

    #[test]
    fn garbage_null_and_forged_handles_are_refused_without_a_dereference() {
        for p in [
            std::ptr::null_mut(),
            8usize as *mut KvdClient,
            encode(0, 0),
            encode(KVD_MAX_CLIENTS + 5, 1),
            usize::MAX as *mut KvdClient,
        ] {
            let s = with_client("t", p, |_| Ok(()));
            assert_eq!(s, KVD_ERR_INVALID_ARGUMENT, "{p:p}");
        }
    }

    #[test]
    fn a_panic_inside_an_entry_point_becomes_the_internal_status() {
        let s = entry("kvd_test", || panic!("boom"));
        assert_eq!(s, KVD_ERR_INTERNAL);
        // SAFETY: the message is valid until the next failing call on this thread.
        let m = unsafe { std::ffi::CStr::from_ptr(crate::status::kvd_last_error_message()) };
        assert!(m.to_str().unwrap().contains("boom"));
    }
}
