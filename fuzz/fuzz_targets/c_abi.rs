//! The C ABI: random calls with random arguments through libkvd (the real libkvd.so, through
//! the declarations of `include/kvd.h`) against a live store: the daemon runs in this process.
//! Each input is a program of up to 64 calls; handles, keys and lengths come from the input (so
//! most are wrong) or from earlier answers (so some are right). Every call must return a status
//! (never crash or hang), and after each input the pool's accounting must balance.
#![no_main]
#![allow(
    non_camel_case_types,
    non_upper_case_globals,
    non_snake_case,
    dead_code
)]

use std::ffi::CString;
use std::sync::OnceLock;
use std::time::Duration;

use libfuzzer_sys::fuzz_target;

mod kvd_h {
    #![allow(
        non_camel_case_types,
        non_upper_case_globals,
        non_snake_case,
        dead_code
    )]
    #![allow(clippy::all)]
    include!(concat!(env!("OUT_DIR"), "/kvd_h.rs"));
}
use kvd_h::*;

struct Live {
    client: *mut KvdClient,
    ns: KvdNamespaceId,
    _dir: tempfile::TempDir,
}

// SAFETY: the client is used by the fuzzer's one thread only.
unsafe impl Send for Live {}
// SAFETY: as above.
unsafe impl Sync for Live {}

/// The daemon (a thread of this process) and one libkvd client of it.
fn live() -> &'static Live {
    static LIVE: OnceLock<Live> = OnceLock::new();
    LIVE.get_or_init(|| {
        let dir = tempfile::tempdir().unwrap();
        let socket = dir.path().join("kvd.sock");
        let (data, sock) = (dir.path().join("data"), socket.clone());
        let args = kvd::daemon::config::ServeArgs::from_cli(
            [
                "--data-dir".as_ref(),
                data.as_os_str(),
                "--socket".as_ref(),
                sock.as_os_str(),
                "--admin-listen=127.0.0.1:0".as_ref(),
                "--pool-mib=16".as_ref(),
                "--page-kib=64".as_ref(),
            ]
            .map(std::ffi::OsStr::to_os_string),
        )
        .unwrap();
        std::thread::spawn(move || kvd::daemon::run(args));
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        while !socket.exists() {
            assert!(
                std::time::Instant::now() < deadline,
                "the in-process daemon started"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        std::thread::sleep(Duration::from_millis(100));
        let path = CString::new(socket.to_str().unwrap()).unwrap();
        // SAFETY: plain C calls with valid pointers to locals.
        unsafe {
            let mut opts: KvdClientOptions = std::mem::zeroed();
            assert_eq!(kvd_options_init(&mut opts, KVD_ABI_VERSION), 0);
            opts.lease_ttl_ms = 600_000;
            let mut client = std::ptr::null_mut();
            assert_eq!(kvd_connect(path.as_ptr(), &opts, &mut client), 0);
            let mut desc: KvdNamespaceDescriptor = std::mem::zeroed();
            let (model, rev, tok, empty, rope) = (
                CString::new("fuzz/model").unwrap(),
                CString::new("r1").unwrap(),
                CString::new("tok-1").unwrap(),
                CString::new("").unwrap(),
                CString::new("theta=1e6").unwrap(),
            );
            desc.model_name = model.as_ptr();
            desc.model_revision = rev.as_ptr();
            desc.tokenizer = tok.as_ptr();
            desc.adapter = empty.as_ptr();
            desc.cache_salt = empty.as_ptr();
            desc.rope = rope.as_ptr();
            desc.num_layers = 2;
            desc.num_kv_heads = 2;
            desc.head_dim = 64;
            desc.tokens_per_block = 16;
            desc.bytes_per_block = 4096;
            desc.tp_size = 1;
            desc.pp_size = 1;
            desc.dtype = KVD_DTYPE_BF16;
            let mut ns: KvdNamespaceId = std::mem::zeroed();
            let rc = kvd_register_namespace(client, &desc, &mut ns);
            let why = std::ffi::CStr::from_ptr(kvd_last_error_message()).to_string_lossy();
            assert_eq!(rc, 0, "register the namespace: {why}");
            Live {
                client,
                ns,
                _dir: dir,
            }
        }
    })
}

/// A cursor over the input.
struct Input<'a>(&'a [u8]);

impl Input<'_> {
    fn byte(&mut self) -> u8 {
        let (b, rest) = self.0.split_first().map_or((0, &[][..]), |(b, r)| (*b, r));
        self.0 = rest;
        b
    }
    fn u64(&mut self) -> u64 {
        (0..8).fold(0u64, |a, i| a | u64::from(self.byte()) << (8 * i))
    }
    fn small(&mut self, max: usize) -> usize {
        self.byte() as usize % (max + 1)
    }
}

fuzz_target!(|data: &[u8]| {
    let l = live();
    let c = l.client;
    let mut inp = Input(data);
    let mut handles: Vec<KvdHandle> = Vec::new();
    let key = |tag: u8| -> KvdKey {
        let mut k = KvdKey {
            namespace_id: l.ns,
            tag: KvdTag { bytes: [0; 32] },
        };
        k.tag.bytes[0] = tag;
        k
    };
    let mut statuses = [0i32; 8];
    for _ in 0..64 {
        if inp.0.is_empty() {
            break;
        }
        let op = inp.byte() % 12;
        let n = inp.small(8);
        let keys: Vec<KvdKey> = (0..n).map(|_| key(inp.byte() % 16)).collect();
        let some_handle = |inp: &mut Input<'_>, hs: &[KvdHandle]| -> KvdHandle {
            if !hs.is_empty() && !inp.byte().is_multiple_of(4) {
                hs[inp.small(hs.len() - 1)]
            } else {
                KvdHandle {
                    node_generation: inp.u64(),
                    generation: inp.u64(),
                    slot: inp.byte().into(),
                    reserved: 0,
                }
            }
        };
        // SAFETY: every pointer passed is to a live local of the right type and length (or
        // null where the test means null); libkvd must answer wrong values with a status.
        unsafe {
            match op {
                0 => {
                    let mut out: Vec<KvdAllocation> = vec![std::mem::zeroed(); n];
                    let class = KvdBlockClass {
                        kind: KVD_CLASS_CACHE,
                        reserved: 0,
                        request: 0,
                        epoch: 0,
                    };
                    if kvd_alloc(
                        c,
                        keys.as_ptr(),
                        n,
                        &class,
                        0,
                        out.as_mut_ptr(),
                        statuses.as_mut_ptr(),
                    ) == 0
                    {
                        for (a, s) in out.iter().zip(statuses) {
                            if s == 0 {
                                handles.push(a.handle);
                            }
                        }
                    }
                }
                1 => {
                    let h = some_handle(&mut inp, &handles);
                    let len = inp.small(255) * 64;
                    let buf = vec![inp.byte(); len];
                    let _ = kvd_write(c, &h, inp.u64() % 8192, buf.as_ptr(), len);
                }
                2 => {
                    let h = some_handle(&mut inp, &handles);
                    let item = KvdSealItem {
                        handle: h,
                        len: inp.u64() % 8192,
                        checksum: 0,
                        has_checksum: false,
                    };
                    let mut crc = 0u32;
                    let _ = kvd_seal(c, &item, 1, &mut crc, statuses.as_mut_ptr());
                }
                3 => {
                    let h = some_handle(&mut inp, &handles);
                    let _ = kvd_publish(c, &h, 1);
                }
                4 => {
                    let h = some_handle(&mut inp, &handles);
                    let _ = kvd_abort(c, &h, 1, statuses.as_mut_ptr());
                }
                5 => {
                    let mut out: Vec<KvdBlockInfo> = vec![std::mem::zeroed(); n];
                    if kvd_acquire(
                        c,
                        keys.as_ptr(),
                        n,
                        0,
                        out.as_mut_ptr(),
                        statuses.as_mut_ptr(),
                    ) == 0
                    {
                        for (b, s) in out.iter().zip(statuses) {
                            if s == 0 {
                                handles.push(b.handle);
                            }
                        }
                    }
                }
                6 => {
                    let h = some_handle(&mut inp, &handles);
                    let _ = kvd_release(c, &h, 1, statuses.as_mut_ptr());
                }
                7 => {
                    let h = some_handle(&mut inp, &handles);
                    let len = inp.small(64) * 128;
                    let mut dst = vec![0u8; len];
                    let mut got = 0u64;
                    let _ = kvd_read_verified(c, &h, dst.as_mut_ptr(), len, &mut got);
                    let _ = kvd_read(c, &h, inp.u64() % 8192, dst.as_mut_ptr(), len);
                }
                8 => {
                    let mut bitmap = [0u8; 2];
                    let len = inp.small(2);
                    let _ = kvd_exists(c, keys.as_ptr(), n, bitmap.as_mut_ptr(), len);
                }
                9 => {
                    let h = some_handle(&mut inp, &handles);
                    let version = KvdBlockVersion {
                        node_generation: h.node_generation,
                        generation: h.generation,
                    };
                    let item = KvdRemoveItem {
                        key: key(inp.byte() % 16),
                        version,
                    };
                    let _ = kvd_remove_if(c, &item, 1, statuses.as_mut_ptr());
                }
                10 => {
                    // null and oversized arguments
                    let _ = kvd_alloc(
                        c,
                        std::ptr::null(),
                        n,
                        std::ptr::null(),
                        0,
                        std::ptr::null_mut(),
                        std::ptr::null_mut(),
                    );
                    let _ = kvd_publish(c, std::ptr::null(), usize::MAX);
                    let _ = kvd_exists(c, keys.as_ptr(), usize::MAX, std::ptr::null_mut(), 0);
                }
                _ => {
                    let _ = kvd_heartbeat(c, &mut 0u64);
                }
            }
        }
        if handles.len() > 256 {
            handles.drain(..128);
        }
    }
    // give back what this input holds: abort what it writes, release its pins
    // SAFETY: as above.
    unsafe {
        for h in &handles {
            let _ = kvd_abort(c, h, 1, statuses.as_mut_ptr());
            let _ = kvd_release(c, h, 1, statuses.as_mut_ptr());
        }
        let mut st: KvdStats = std::mem::zeroed();
        assert_eq!(kvd_stats(c, &mut st), 0, "the client still works");
        let parts = st.pages_free
            + st.pages_allocated
            + st.pages_writing
            + st.pages_sealed
            + st.pages_published
            + st.pages_retired
            + st.pages_quarantined;
        assert_eq!(parts, st.pages_total, "the pool's accounting balances");
        assert_eq!(
            st.pages_allocated + st.pages_writing + st.pages_sealed,
            0,
            "nothing left unfinished"
        );
    }
});
