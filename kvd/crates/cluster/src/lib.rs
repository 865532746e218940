//! kvd's cluster mode, as a library that `kvd serve`, `kvd control` and `kvd status` share:
//! how to reach etcd, a node's registration under a lease, the membership view that the data
//! port follows (`kvd_remote::Membership`), and the watch of every node's registration that
//! the control shim turns into worker events.
//!
//! Two registries. **Embedded** (the default): this node alone, peers only from `--peer`; it
//! needs nothing but itself ([`Membership::embedded`]). **etcd** (`--etcd URL[,URL...]`): the
//! node registers `(node_id, generation, data address, admin address, capacity, free)` under
//! `<prefix>/nodes/<node_id>` with a TTL lease it keeps alive itself, and keeps a view of every
//! registered node, rebuilt from a full read (with its revision) on every (re)connect and then
//! fed by a watch from that revision ([`EtcdRegistry`]).
//!
//! **Lease lost** (no keep-alive answer for a whole TTL): the node is not ready (`/readyz` 503
//! says why), takes no new work from engines or peers, and keeps finishing what it has; it
//! registers again (a new lease, a new generation) when etcd answers again. The view is kept as
//! it was (routing continues on the last view); a reconnect replaces it from a full read, not
//! from deltas.
//!
//! ```text
//!  settings.rs   EtcdArgs (the flags), EtcdSecurity (password, TLS), ClusterConfig
//!  etcd.rs       Etcd: connect, get, put, watch_nodes → NodeWatch of NodeChange,
//!                watch_revoked → KeyWatch of KeyChange, revoke_key
//!                (the only module that names etcd-client's types)
//!  view.rs       Membership (the view, the lease flag, the revoked keys, the peer table with
//!                each node's key), Registration, ClusterReport
//!  registry.rs   EtcdRegistry: register under a lease, keep it alive, feed the view
//! ```

mod etcd;
mod registry;
mod settings;
mod view;

pub use etcd::{Etcd, KeyChange, KeyWatch, Lease, NodeChange, NodeWatch};
pub use kvd_core::{Error, Result};
pub use registry::EtcdRegistry;
pub use settings::{ClusterConfig, EtcdArgs, EtcdSecurity, EtcdTls};
pub use view::{ClusterReport, Membership, PeerSink, Registration};
