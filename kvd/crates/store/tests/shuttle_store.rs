//! The store's concurrent transitions under the shuttle model checker.
//!
//! Built with `--features shuttle`, the store's mutex is shuttle's, so shuttle explores
//! interleavings of the threads below (randomly, many times, with a printed replayable seed on
//! failure): a writer publishing and then deleting a block, a reader acquiring, reading with
//! verification and releasing it, and a second writer whose session is closed while it writes.
//! After every run the invariants hold, and every read the reader completed returned the
//! writer's exact bytes.
#![cfg(feature = "shuttle")]

use std::sync::Arc;

use kvd_core::Error;
use kvd_core::clock::ManualClock;
use kvd_core::keys::{BlockKey, BlockTag, NamespaceId};
use kvd_store::{BlockClass, Store};

mod common;

fn store() -> (Arc<Store>, NamespaceId) {
    let (store, ns) = common::store(common::config(4096, 2), ManualClock::new(0));
    (Arc::new(store), ns)
}

fn key(ns: NamespaceId, n: u8) -> BlockKey {
    BlockKey {
        namespace: ns,
        tag: BlockTag([n; 32]),
    }
}

fn scenario() {
    let (store, ns) = store();
    let payload: Vec<u8> = (0..512u32).map(|i| (i * 13) as u8).collect();

    let w = {
        let (store, payload) = (store.clone(), payload.clone());
        shuttle::thread::spawn(move || {
            let s = store.open_session("writer", 60_000).unwrap();
            let Ok(a) = store.alloc(s, &[key(ns, 1)], BlockClass::Cache, None) else {
                return;
            };
            let h = a[0].as_ref().unwrap().handle;
            store.write(s, &h, 0, &payload).unwrap();
            store.seal(s, &h, payload.len() as u64, None).unwrap();
            store.publish(s, &[h]).unwrap();
            store.remove_if(&key(ns, 1), h.version()).unwrap();
            store.close_session(s);
        })
    };
    let r = {
        let (store, payload) = (store.clone(), payload.clone());
        shuttle::thread::spawn(move || {
            let s = store.open_session("reader", 60_000).unwrap();
            for _ in 0..2 {
                let got = store.acquire(s, &[key(ns, 1)], None).unwrap().remove(0);
                if let Ok(info) = got {
                    let mut out = vec![0u8; 512];
                    let n = store.read(s, &info.handle, &mut out, true).unwrap();
                    assert_eq!(
                        &out[..n as usize],
                        &payload[..],
                        "a pinned read is byte-exact"
                    );
                    store.release(s, &[info.handle]).unwrap()[0]
                        .as_ref()
                        .unwrap();
                }
            }
            store.close_session(s);
        })
    };
    let x = {
        let store = store.clone();
        shuttle::thread::spawn(move || {
            let s = store.open_session("doomed", 60_000).unwrap();
            if let Ok(a) = store.alloc(s, &[key(ns, 2)], BlockClass::Cache, None) {
                let h = a[0].as_ref().unwrap().handle;
                let closer = {
                    let store = store.clone();
                    shuttle::thread::spawn(move || {
                        store.close_session(s);
                    })
                };
                match store.write(s, &h, 0, &[9u8; 256]) {
                    Ok(()) | Err(Error::LeaseExpired(_)) | Err(Error::NotFound(_)) => {}
                    Err(Error::StaleGeneration { .. }) => {}
                    Err(e) => panic!("unexpected {e}"),
                }
                closer.join().unwrap();
            }
        })
    };
    w.join().unwrap();
    r.join().unwrap();
    x.join().unwrap();
    store.check_invariants().unwrap();
    let st = store.stats();
    assert_eq!(
        st.accounting.free, 2,
        "every page came back: {:?}",
        st.accounting
    );
    assert_eq!(st.pins, 0);
}

#[test]
fn concurrent_writers_readers_and_session_deaths_keep_the_invariants() {
    shuttle::check_random(scenario, 2_000);
}

#[test]
fn concurrent_transitions_under_pct_scheduling_keep_the_invariants() {
    shuttle::check_pct(scenario, 1_000, 3);
}
