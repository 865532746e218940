//! The transfer protocol between nodes in one process: two (or three) data ports over the
//! in-process backend (`Backends::in_process`), each on a block store of its own. Offers,
//! grants, batches, commits, aborts and their wire run as between daemons; only the bytes
//! cross no socket. No root, no network, no daemon binary.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvd_core::clock::MonotonicClock;
use kvd_core::keys::{BlockKey, BlockTag, KvDtype, NamespaceDescriptor, NamespaceId};
use kvd_core::protocol::{TransferInfo, TransferState};
use kvd_remote::port::DataPort;
use kvd_remote::transfer::outgoing::Kind;
use kvd_remote::{DataPortConfig, RdmaSettings, TransportChoice};
use kvd_store::pool::{HugePages, PoolConfig};
use kvd_store::{BlockClass, Store, StoreConfig};
use transport::inproc::InProcNet;
use transport::registry::Backends;

const PAGE: u64 = 64 << 10;

struct Node {
    id: u64,
    store: Arc<Store>,
    ns: NamespaceId,
    port: Arc<DataPort>,
}

fn descriptor() -> NamespaceDescriptor {
    NamespaceDescriptor {
        model_name: "m".into(),
        model_revision: "r".into(),
        tokenizer: "t".into(),
        adapter: String::new(),
        cache_salt: String::new(),
        dtype: KvDtype::Bf16,
        num_layers: 1,
        num_kv_heads: 1,
        head_dim: 8,
        tokens_per_block: 4,
        bytes_per_block: PAGE,
        tp_rank: 0,
        tp_size: 1,
        pp_rank: 0,
        pp_size: 1,
        rope: String::new(),
    }
}

/// Node `id` of `net`, its peers named (in process a peer's address is never dialled).
fn node(net: &Arc<InProcNet>, id: u64, peers: &[u64], pages: u32) -> Node {
    let store = Arc::new(
        Store::new(
            StoreConfig::new(PoolConfig {
                page_size_bytes: PAGE,
                page_count: pages,
                huge_pages: HugePages::Off,
            }),
            Arc::new(MonotonicClock::new()),
        )
        .unwrap(),
    );
    let ns = store.register_namespace(&descriptor()).unwrap();
    let unused: SocketAddr = "127.0.0.1:9".parse().unwrap();
    let config = DataPortConfig {
        listen: unused,
        cluster_secret_file: "/nonexistent".into(),
        node_key_file: "/nonexistent".into(),
        create_node_key: false,
        // in process there is no handshake: a peer's key is never asked for
        peers: peers
            .iter()
            .map(|&p| {
                (
                    p,
                    kvd_remote::Peer {
                        addr: unused,
                        key: None,
                    },
                )
            })
            .collect::<BTreeMap<_, _>>(),
        peers_file: None,
        member_handshakes: 16,
        payload_mac: false,
        max_transfers_per_peer: 4,
        max_transfers: 8,
        max_incoming_per_peer: 4,
        max_incoming: 8,
        transfer_deadline_ms: 10_000,
        lanes: 1,
        transport: TransportChoice::Tcp,
        rdma: RdmaSettings::default(),
    };
    let engine = Backends::in_process(net, id, store.node_generation()).unwrap();
    let port = DataPort::over(engine, &config, id, &store).unwrap();
    Node {
        id,
        store,
        ns,
        port,
    }
}

fn key(ns: NamespaceId, n: u8) -> BlockKey {
    BlockKey {
        namespace: ns,
        tag: BlockTag([n; 32]),
    }
}

fn bytes(seed: u8) -> Vec<u8> {
    (0..PAGE as usize)
        .map(|i| (i as u8).wrapping_mul(13) ^ seed ^ (i >> 10) as u8)
        .collect()
}

impl Node {
    /// Put blocks `tags` (each a page of its own pattern), published.
    fn put(&self, tags: &[u8]) -> Vec<BlockKey> {
        let sid = self.store.open_session("put", 10_000).unwrap();
        let keys: Vec<BlockKey> = tags.iter().map(|&t| key(self.ns, t)).collect();
        let mut handles = Vec::new();
        for (a, &t) in self
            .store
            .alloc_for_write(sid, &keys, BlockClass::Cache, None)
            .unwrap()
            .into_iter()
            .zip(tags)
        {
            let h = a.unwrap().handle;
            self.store.write(sid, &h, 0, &bytes(t)).unwrap();
            self.store.seal(sid, &h, PAGE, None).unwrap();
            handles.push(h);
        }
        self.store.publish(sid, &handles).unwrap();
        self.store.close_session(sid);
        keys
    }

    /// The published bytes of `k` (verified against its sealed checksum), or `None`.
    fn get(&self, k: BlockKey) -> Option<Vec<u8>> {
        let sid = self.store.open_session("get", 10_000).unwrap();
        let got = match self.store.acquire(sid, &[k], None).unwrap().remove(0) {
            Ok(info) => {
                let mut b = vec![0u8; info.len as usize];
                self.store.read(sid, &info.handle, &mut b, true).unwrap();
                Some(b)
            }
            Err(_) => None,
        };
        self.store.close_session(sid);
        got
    }

    /// Run one transfer to its end.
    fn transfer(&self, kind: Kind, peer: u64, keys: &[BlockKey]) -> TransferInfo {
        let id = self.port.start_transfer(kind, peer, keys.to_vec()).unwrap();
        let t = Instant::now();
        loop {
            let info = self.port.transfers(&[id]).remove(0);
            if info.state != TransferState::InFlight {
                return info;
            }
            assert!(t.elapsed() < Duration::from_secs(20), "transfer {id} hangs");
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    /// Nothing of any transfer is left: no grant, no incoming transfer, no session, no pin,
    /// no page between allocation and publication.
    fn settled(&self) {
        let t = Instant::now();
        loop {
            let r = self.port.report(self.id);
            let s = self.store.stats();
            let a = s.accounting;
            let quiet = r.live_grants == 0
                && r.incoming_in_flight == 0
                && r.pushes_in_flight == 0
                && s.sessions == 0
                && s.pins == 0
                && a.allocated + a.writing + a.sealed == 0;
            if quiet {
                self.store.check_invariants().unwrap();
                return;
            }
            assert!(
                t.elapsed() < Duration::from_secs(10),
                "node {} never settled: {r:?} {s:?}",
                self.id
            );
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

#[test]
fn a_push_and_a_fetch_between_nodes_in_one_process_publish_byte_exact_and_settle_both_ends() {
    let net = InProcNet::new();
    let a = node(&net, 1, &[2], 64);
    let b = node(&net, 2, &[1], 64);
    // push eight blocks from a to b
    let pushed = a.put(&[1, 2, 3, 4, 5, 6, 7, 8]);
    let info = a.transfer(Kind::Push, 2, &pushed);
    assert_eq!(info.state, TransferState::Done, "{info:?}");
    assert_eq!((info.blocks, info.bytes), (8, 8 * PAGE));
    for (k, t) in pushed.iter().zip(1u8..) {
        // both namespaces are registered from one descriptor: the same id on both nodes
        assert_eq!(b.get(*k).as_deref(), Some(&bytes(t)[..]), "block {t} at b");
    }
    // a pushed again: what b holds already is skipped, nothing is sent twice
    let again = a.transfer(Kind::Push, 2, &pushed);
    assert_eq!(again.state, TransferState::Done, "{again:?}");
    assert_eq!(again.blocks, 0, "{again:?}");
    // fetch four of b's own blocks into a (one key b lacks is skipped)
    let held = b.put(&[20, 21, 22, 23]);
    let mut wanted = held.clone();
    wanted.push(key(b.ns, 99));
    let info = a.transfer(Kind::Fetch, 2, &wanted);
    assert_eq!(info.state, TransferState::Done, "{info:?}");
    assert_eq!((info.blocks, info.bytes), (4, 4 * PAGE));
    for (k, t) in held.iter().zip(20u8..) {
        assert_eq!(a.get(*k).as_deref(), Some(&bytes(t)[..]), "block {t} at a");
    }
    assert_eq!(a.get(key(a.ns, 99)), None);
    let (ca, cb) = (a.port.transfer_counters(), b.port.transfer_counters());
    assert_eq!((ca.transfers_done, ca.transfers_failed), (3, 0));
    assert_eq!((ca.blocks_sent, cb.blocks_received), (8, 8));
    assert_eq!(ca.blocks_received, 4);
    assert_eq!(a.port.report(1).transport.preferred, "in_process");
    a.settled();
    b.settled();
}

#[test]
fn a_push_the_destination_has_no_room_for_fails_whole_and_leaves_nothing_at_either_end() {
    let net = InProcNet::new();
    let a = node(&net, 1, &[2], 64);
    // b has room for four blocks of the eight
    let b = node(&net, 2, &[1], 4);
    let pushed = a.put(&[1, 2, 3, 4, 5, 6, 7, 8]);
    let info = a.transfer(Kind::Push, 2, &pushed);
    let TransferState::Failed(e) = &info.state else {
        panic!("a push past the destination's room: {info:?}");
    };
    assert!(format!("{e:?}").to_lowercase().contains("space"), "{e:?}");
    for k in &pushed {
        assert_eq!(b.get(*k), None, "nothing of a failed push is published");
    }
    assert_eq!(b.store.stats().accounting.published, 0);
    // the source's blocks are all still there, unpinned
    for (k, t) in pushed.iter().zip(1u8..) {
        assert_eq!(a.get(*k).as_deref(), Some(&bytes(t)[..]));
    }
    a.settled();
    b.settled();
    // and the pair still works: four blocks fit
    let info = a.transfer(Kind::Push, 2, &pushed[..4]);
    assert_eq!(info.state, TransferState::Done, "{info:?}");
    assert_eq!(info.blocks, 4);
}

#[test]
fn a_transfer_to_a_node_not_in_the_process_fails_retryably_and_one_to_a_restarted_node_is_refused_then_redone()
 {
    let net = InProcNet::new();
    let a = node(&net, 1, &[2, 3], 64);
    let pushed = a.put(&[1, 2]);
    // node 3 is named but not there
    let info = a.transfer(Kind::Push, 3, &pushed);
    let TransferState::Failed(e) = &info.state else {
        panic!("{info:?}");
    };
    assert!(format!("{e:?}").contains("node 3"), "{e:?}");
    assert_eq!(a.port.transfer_failures().get("peer"), Some(&1));
    // b: a push lands; then b comes back as a new incarnation (its generation advances, as
    // cluster mode's re-registration does): a's idle control connection speaks to the old one
    let b = node(&net, 2, &[1], 64);
    assert_eq!(
        a.transfer(Kind::Push, 2, &pushed[..1]).state,
        TransferState::Done
    );
    b.port.set_generation(b.port.generation() + 1);
    let info = a.transfer(Kind::Push, 2, &pushed[1..]);
    match &info.state {
        // the offer named b's old incarnation: refused before anything was granted
        TransferState::Failed(e) => {
            assert_eq!(b.get(pushed[1]), None, "{e:?}");
            assert!(b.port.transfer_counters().binding_mismatches >= 1, "{e:?}");
            // the next transfer opens a new connection and is bound to the new incarnation
            let retry = a.transfer(Kind::Push, 2, &pushed[1..]);
            assert_eq!(retry.state, TransferState::Done, "{retry:?}");
        }
        TransferState::Done => panic!("a transfer bound to b's old incarnation was accepted"),
        TransferState::InFlight => unreachable!(),
    }
    assert_eq!(b.get(pushed[1]).as_deref(), Some(&bytes(2)[..]));
    a.settled();
    b.settled();
}

#[test]
fn a_cluster_fetch_takes_a_prefix_split_over_two_holders_from_each_and_stops_where_no_one_holds_the_next()
 {
    let net = InProcNet::new();
    // node 4 is named by b but not there: it answers no locate, and the others carry on
    let a = node(&net, 1, &[2, 3], 64);
    let b = node(&net, 2, &[1, 3, 4], 64);
    let c = node(&net, 3, &[1, 2], 64);
    // the chain 1..=10: a holds 1-6, c holds 1-3 and 7-9, nobody holds 10; b holds 2 already
    a.put(&[1, 2, 3, 4, 5, 6]);
    c.put(&[1, 2, 3, 7, 8, 9]);
    b.put(&[2]);
    let chain: Vec<BlockKey> = (1..=10).map(|t| key(b.ns, t)).collect();
    let info = b.transfer(Kind::FetchCluster, kvd_core::protocol::ANY_NODE, &chain);
    assert_eq!(info.state, TransferState::Done, "{info:?}");
    // 1 and 3-6 from a (2 is here already), 7-9 from c
    assert_eq!((info.blocks, info.bytes), (8, 8 * PAGE), "{info:?}");
    assert_eq!(info.peer, 1, "the first piece's holder");
    for t in 1..=9u8 {
        assert_eq!(
            b.get(key(b.ns, t)).as_deref(),
            Some(&bytes(t)[..]),
            "block {t} at b"
        );
    }
    assert_eq!(b.get(key(b.ns, 10)), None);
    let cb = b.port.transfer_counters();
    assert_eq!(cb.cluster_fetches, 1);
    assert_eq!(cb.cluster_located_blocks, 9, "{cb:?}");
    assert_eq!(cb.cluster_fetched_blocks, 8, "{cb:?}");
    // the block b held already was skipped, not short
    assert_eq!(cb.cluster_shortfall_blocks, 0, "{cb:?}");
    assert_eq!(cb.cluster_locate_unanswered, 1, "node 4: {cb:?}");
    assert_eq!(a.port.transfer_counters().locates_served, 1);
    assert_eq!(c.port.transfer_counters().locates_served, 1);
    // a chain nobody holds the first block of: a miss, nothing moves
    let other: Vec<BlockKey> = (50..55).map(|t| key(b.ns, t)).collect();
    let info = b.transfer(Kind::FetchCluster, kvd_core::protocol::ANY_NODE, &other);
    assert_eq!(
        (info.state.clone(), info.blocks, info.peer),
        (TransferState::Done, 0, 0),
        "{info:?}"
    );
    a.settled();
    b.settled();
    c.settled();
}
