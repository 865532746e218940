//! Sessions: connect, close, reconnect, the lease, and what the daemon tells about itself.

use std::ffi::{CString, c_char};
use std::sync::LazyLock;

use kvd_client::{Client, ClientOptions};
use kvd_core::Error;
use kvd_core::counters::Counters;

use crate::handles::{self, Failure, KvdClient, entry, with_client};
use crate::types::{KvdHealthReport, KvdPoolInfo, KvdStats};
use crate::{KVD_ABI_VERSION, args};

/// How to open a session. Fill it with `kvd_options_init`, then change what you need.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct KvdClientOptions {
    /// The ABI version the caller was compiled against: `KVD_ABI_VERSION` from its kvd.h.
    /// `kvd_connect` refuses any other (`KVD_ERR_PROTOCOL`).
    pub abi_version: u32,
    /// Pre-fault the pool mapping at connect (faster first writes; costs time at connect).
    pub populate: bool,
    /// A name for the daemon's logs and `/status` (NUL-terminated, at most 128 bytes; NULL:
    /// "libkvd").
    pub name: *const c_char,
    /// The session's lease, ms (10..600000): heartbeat more often than this.
    pub lease_ttl_ms: u64,
    /// How long one round trip may take before the call fails and the client is broken, ms.
    pub io_timeout_ms: u64,
}

/// Fill `*opts` with the defaults (a 10 s lease, a 30 s I/O timeout, a populated mapping, the
/// name "libkvd") and the caller's ABI version; pass `KVD_ABI_VERSION`.
///
/// Returns `KVD_ERR_PROTOCOL` (and fills nothing) when `abi_version` is not this library's,
/// `KVD_ERR_INVALID_ARGUMENT` for a null or misaligned `opts`. Thread-safe.
#[unsafe(no_mangle)]
pub extern "C" fn kvd_options_init(opts: *mut KvdClientOptions, abi_version: u32) -> i32 {
    entry("kvd_options_init", || {
        check_abi(abi_version)?;
        let o = args::out_ref(opts, "opts")?;
        let d = ClientOptions::named("libkvd");
        *o = KvdClientOptions {
            abi_version,
            populate: d.populate,
            name: std::ptr::null(),
            lease_ttl_ms: d.lease_ttl_ms,
            io_timeout_ms: d.io_timeout_ms,
        };
        Ok(())
    })
}

fn check_abi(abi_version: u32) -> kvd_core::Result<()> {
    if abi_version != KVD_ABI_VERSION {
        return Err(Error::Protocol(format!(
            "the caller was built against libkvd ABI version {abi_version}, this libkvd ({}) \
             speaks {KVD_ABI_VERSION}: rebuild against its kvd.h",
            env!("CARGO_PKG_VERSION")
        )));
    }
    Ok(())
}

/// Connect to the daemon's Unix socket at `path`, open a session and map the pool; `*out`
/// receives the client.
///
/// Errors: `KVD_ERR_PROTOCOL` for another ABI version in `opts` or another protocol version
/// at the daemon; `KVD_ERR_IO` when the socket cannot be reached; `KVD_ERR_UNAVAILABLE` while
/// the daemon drains; `KVD_ERR_OVERLOADED` at its session bounds; `KVD_ERR_INVALID_ARGUMENT`
/// for bad arguments or a lease out of range. Thread-safe (opens an independent client).
#[unsafe(no_mangle)]
pub extern "C" fn kvd_connect(
    path: *const c_char,
    opts: *const KvdClientOptions,
    out: *mut *mut KvdClient,
) -> i32 {
    entry("kvd_connect", || {
        let o = args::in_ref(opts, "opts")?;
        check_abi(o.abi_version)?;
        let out = args::out_ref(out, "out")?;
        let path = args::string(path, "path")?;
        let name = if o.name.is_null() {
            "libkvd"
        } else {
            args::string(o.name, "opts.name")?
        };
        let options = ClientOptions {
            name: name.to_owned(),
            lease_ttl_ms: o.lease_ttl_ms,
            io_timeout_ms: o.io_timeout_ms,
            populate: o.populate,
            ..ClientOptions::named(name)
        };
        let c = Client::connect(path, &options)?;
        *out = handles::insert(c)?;
        Ok(())
    })
}

/// Close the session cleanly (the daemon aborts its unfinished blocks and drops its pins) and
/// free the client. The handle is dead afterwards, whatever the result: a second
/// `kvd_close`, or any call with it, is `KVD_ERR_INVALID_ARGUMENT`. Every pointer into the pool
/// obtained through this client (views, `KvdPoolInfo.base`) is invalid from here on.
///
/// Returns the goodbye's error when the connection had already failed (the session is released
/// by the daemon either way). Thread-safe: waits for a call in flight on the client to finish.
#[unsafe(no_mangle)]
pub extern "C" fn kvd_close(client: *mut KvdClient) -> i32 {
    entry("kvd_close", || match handles::remove(client)? {
        Some(c) => Ok(c.close()?),
        None => Err(Failure::Kvd(Error::InvalidArgument(
            "the client was closed already".into(),
        ))),
    })
}

/// Open a fresh session on the same socket with the same options, replacing the client's (the
/// old one is closed first if it still works). Every handle, pin, view and pool address of the
/// old session is gone: look blocks up again and call `kvd_pool_info` again. On error the client
/// stays broken and can try again. Thread-safe (serialized per client).
#[unsafe(no_mangle)]
pub extern "C" fn kvd_reconnect(client: *mut KvdClient) -> i32 {
    with_client("kvd_reconnect", client, |c| Ok(c.reconnect()?))
}

/// Renew the session's lease; `*expires_in_ms` (may be NULL) receives the ms until it expires.
/// Thread-safe (serialized per client).
#[unsafe(no_mangle)]
pub extern "C" fn kvd_heartbeat(client: *mut KvdClient, expires_in_ms: *mut u64) -> i32 {
    with_client("kvd_heartbeat", client, |c| {
        let out = args::opt_out(expires_in_ms, "expires_in_ms")?;
        let ms = c.heartbeat()?;
        if let Some(o) = out {
            *o = ms;
        }
        Ok(())
    })
}

/// How long the lease holds at least, by the client's own reckoning, in ms (0: heartbeat or
/// reconnect before reading the pool). `*broken` (may be NULL) receives whether the
/// connection failed (every call then answers `KVD_ERR_DISCONNECTED` until `kvd_reconnect`).
/// Thread-safe (serialized per client).
#[unsafe(no_mangle)]
pub extern "C" fn kvd_lease_left(client: *mut KvdClient, ms: *mut u64, broken: *mut bool) -> i32 {
    with_client("kvd_lease_left", client, |c| {
        let ms = args::out_ref(ms, "ms")?;
        let broken = args::opt_out(broken, "broken")?;
        *ms = c.lease_left().as_millis() as u64;
        if let Some(b) = broken {
            *b = c.broken().is_some();
        }
        Ok(())
    })
}

/// The engine request the next calls on this client serve (for the daemon's traces); 0 for
/// none. Thread-safe (serialized per client).
#[unsafe(no_mangle)]
pub extern "C" fn kvd_set_request(client: *mut KvdClient, request: u64) -> i32 {
    with_client("kvd_set_request", client, |c| {
        c.set_request((request != 0).then_some(request));
        Ok(())
    })
}

/// Where the pool is mapped and what the daemon granted (page size, session, lease, batch
/// bound). No round trip. Thread-safe (serialized per client).
#[unsafe(no_mangle)]
pub extern "C" fn kvd_pool_info(client: *mut KvdClient, out: *mut KvdPoolInfo) -> i32 {
    with_client("kvd_pool_info", client, |c| {
        let out = args::out_ref(out, "out")?;
        let m = c.pool_mapping();
        let w = c.welcome();
        *out = KvdPoolInfo {
            fd: m.fd,
            page_count: m.page_count,
            base: m.base.cast_mut(),
            size_bytes: m.len,
            page_size_bytes: m.page_size,
            node_generation: w.node_generation,
            session: w.session.0,
            lease_ttl_ms: w.lease_ttl_ms,
            max_batch: w.max_batch,
            reserved: 0,
        };
        Ok(())
    })
}

/// The store's counts. Thread-safe (serialized per client).
#[unsafe(no_mangle)]
pub extern "C" fn kvd_stats(client: *mut KvdClient, out: *mut KvdStats) -> i32 {
    with_client("kvd_stats", client, |c| {
        let out = args::out_ref(out, "out")?;
        *out = KvdStats::from(&c.stats()?);
        Ok(())
    })
}

/// The number of the store's counters: what `kvd_counters` writes and `kvd_counter_name` names.
/// Counters are only ever added, at the end, so a name keeps its index. Thread-safe.
#[unsafe(no_mangle)]
pub extern "C" fn kvd_counter_count() -> usize {
    Counters::DECLARED.len()
}

/// Counter `i`'s name (`lookups`, `manifests_expired`, …: `KvdStats`' field names, and the
/// daemon's `/metrics` family `kvd_<name>_total` for most), a static NUL-terminated string; NULL
/// when `i >= kvd_counter_count()`. Thread-safe.
#[unsafe(no_mangle)]
pub extern "C" fn kvd_counter_name(i: usize) -> *const c_char {
    static NAMES: LazyLock<Vec<CString>> = LazyLock::new(|| {
        Counters::DECLARED
            .iter()
            .map(|d| CString::new(d.name).expect("a counter name has no NUL"))
            .collect()
    });
    NAMES.get(i).map_or(std::ptr::null(), |n| n.as_ptr())
}

/// The store's counters since the daemon started, every one (`KvdStats` has those of ABI 1):
/// `out[i]` is counter `i` (`kvd_counter_name(i)`). `out_cap` must be at least
/// `kvd_counter_count()`; the values past it are left alone. Thread-safe (serialized per
/// client).
#[unsafe(no_mangle)]
pub extern "C" fn kvd_counters(client: *mut KvdClient, out: *mut u64, out_cap: usize) -> i32 {
    with_client("kvd_counters", client, |c| {
        let values = c.stats()?.counters.values();
        args::fits(out_cap, values.len(), "out")?;
        args::slice_mut(out, values.len(), "out")?.copy_from_slice(&values);
        Ok(())
    })
}

/// Run the health canary: one 4 KiB block written, sealed, published, acquired, read back
/// verified and removed through the daemon. `*out` (may be NULL) receives the time it took.
/// Fails with the first step's error. Thread-safe (serialized per client).
#[unsafe(no_mangle)]
pub extern "C" fn kvd_health_check(client: *mut KvdClient, out: *mut KvdHealthReport) -> i32 {
    with_client("kvd_health_check", client, |c| {
        let out = args::opt_out(out, "out")?;
        let r = c.health_check()?;
        if let Some(o) = out {
            *o = KvdHealthReport {
                elapsed_us: r.elapsed_us,
                bytes: r.bytes,
            };
        }
        Ok(())
    })
}
