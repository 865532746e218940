//! A million lifecycle cycles leave the pool's accounting exactly as it started.

mod common;

use kvd_core::clock::ManualClock;
use kvd_core::keys::{BlockKey, BlockTag};
use kvd_store::BlockClass;

const CYCLES: u32 = 1_000_000;

#[test]
fn a_million_alloc_abort_and_alloc_publish_remove_cycles_leave_the_accounting_as_it_started() {
    let (store, ns) = common::store(common::config(4096, 64), ManualClock::new(0));
    let before = store.audit();
    assert!(before.1);
    let s = store.open_session("cycles", 60_000).unwrap();
    let mut tag = [0u8; 32];
    for i in 0..CYCLES {
        tag[..4].copy_from_slice(&i.to_le_bytes());
        let key = BlockKey {
            namespace: ns,
            tag: BlockTag(tag),
        };
        let h = store.alloc(s, &[key], BlockClass::Cache, None).unwrap()[0]
            .as_ref()
            .unwrap()
            .handle;
        if i % 2 == 0 {
            store.abort(s, &[h]).unwrap()[0].as_ref().unwrap();
        } else {
            store.write(s, &h, 0, &tag).unwrap();
            store.seal(s, &h, 32, None).unwrap();
            store.publish(s, &[h]).unwrap();
            store.remove_if(&key, h.version()).unwrap();
        }
    }
    store.close_session(s);
    let after = store.audit();
    assert!(after.1, "accounting drifted: {:?}", after.0);
    assert_eq!(after.0, before.0, "the pool is exactly as it started");
    let st = store.stats();
    assert_eq!(st.counters.blocks_aborted, u64::from(CYCLES / 2));
    assert_eq!(st.counters.blocks_removed, u64::from(CYCLES / 2));
    store.check_invariants().unwrap();
}
