//! `kvd key`: a node's identity from the command line.
//!
//! - `kvd key show` prints the public key of a node's key file, the form `--peer` entries and
//!   peers files take (`--as-peer` prints the whole entry); `--create` makes the file first
//!   where there is none, as `kvd serve` does at its first start, so that a static peer list
//!   can be written before any node runs.
//! - `kvd key revoke` revokes a node's key in a cluster's etcd (the registered key of
//!   `--node`, or `--key`): every node drops it from its peer table within a watch's delivery
//!   and closes that node's connections; the node can no longer connect, and is no longer
//!   connected to, until it has a new key. In a static cluster, revoking is deleting the
//!   node's line from the peers file (docs/OPERATIONS.md, "Revoking a node's key").

use std::path::PathBuf;

use transport::link::identity::{NodeKey, PublicKey};

use crate::config::NODE_KEY_FILE;
use crate::{Error, Result};

/// `kvd key` arguments.
#[derive(Debug, clap::Args)]
pub struct KeyArgs {
    /// What to do.
    #[command(subcommand)]
    pub command: KeyCommand,
}

/// `kvd key`'s subcommands.
#[derive(Debug, clap::Subcommand)]
pub enum KeyCommand {
    /// Print a node's public key (64 hex digits), as peer lists take it.
    #[command(after_help = "Examples:
  kvd key show --data-dir /var/lib/kvd                the key of the node that serves there
  kvd key show --data-dir /var/lib/kvd --create       make it first (before the first start)
  kvd key show --data-dir /var/lib/kvd --as-peer 2=10.0.0.2:7461
                                                      2=10.0.0.2:7461,key=<hex>: a --peer entry,
                                                      or a line of a --peers-file")]
    Show(ShowArgs),
    /// Revoke a node's key in the cluster's etcd: no node accepts it from then on, and the
    /// connections of the node that holds it are closed.
    #[command(after_help = "Examples:
  kvd key revoke --etcd http://10.0.0.9:2379 --node 3     the key node 3 registered
  kvd key revoke --etcd http://10.0.0.9:2379 --key <hex>  a key, registered or not

Node 3 comes back only with a new key: stop it, delete its key file (DATA_DIR/node.key) and
start it; it registers the new one. A revocation stays in etcd (<prefix>/revoked/<key>).
In a static cluster, delete the node's line from the --peers-file instead.")]
    Revoke(RevokeArgs),
}

/// `kvd key show` arguments.
#[derive(Debug, clap::Args)]
pub struct ShowArgs {
    /// The data directory `kvd serve` uses: its key is DATA_DIR/node.key.
    #[arg(long, default_value = "kvd-data")]
    pub data_dir: PathBuf,
    /// The key file, where `kvd serve` is given --node-key-file.
    #[arg(long)]
    pub node_key_file: Option<PathBuf>,
    /// Make the key file (mode 0600; the data directory 0700) if there is none.
    #[arg(long)]
    pub create: bool,
    /// Print the whole peer entry for this node, NODE_ID=ADDR,key=PUBLIC_KEY, given its id
    /// and data port address.
    #[arg(long, value_name = "NODE_ID=ADDR")]
    pub as_peer: Option<String>,
}

/// `kvd key revoke` arguments.
#[derive(Debug, clap::Args)]
pub struct RevokeArgs {
    /// How to reach the cluster's etcd.
    #[command(flatten)]
    pub etcd: kvd_cluster::EtcdArgs,
    /// The node whose registered key to revoke.
    #[arg(long, required_unless_present = "key", conflicts_with = "key")]
    pub node: Option<u64>,
    /// The key to revoke (64 hex digits, as `kvd key show` prints it).
    #[arg(long)]
    pub key: Option<String>,
}

/// Run `kvd key`; exit 0, or 1 with what went wrong on stderr.
pub fn run(args: KeyArgs) -> std::process::ExitCode {
    let done = match args.command {
        KeyCommand::Show(a) => show(&a),
        KeyCommand::Revoke(a) => revoke(&a),
    };
    match done {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("kvd key: {e}");
            std::process::ExitCode::from(1)
        }
    }
}

fn show(a: &ShowArgs) -> Result<()> {
    let (path, default) = match &a.node_key_file {
        Some(p) => (p.clone(), false),
        None => (a.data_dir.join(NODE_KEY_FILE), true),
    };
    if a.create && default {
        use std::os::unix::fs::DirBuilderExt;
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(&a.data_dir)
            .map_err(|e| Error::Io(format!("{}: {e}", a.data_dir.display())))?;
    }
    let (key, made) = NodeKey::open(&path, a.create).map_err(|e| match e {
        transport::Error::InvalidArgument(m) if !path.exists() => Error::InvalidArgument(format!(
            "{m} (`kvd serve` makes DATA_DIR/{NODE_KEY_FILE} at its first start; `kvd key show \
             --create` makes it now)"
        )),
        e => e.into(),
    })?;
    if made {
        eprintln!("kvd key: made {}", path.display());
    }
    match &a.as_peer {
        Some(entry) => {
            // the entry must read back as one, so what is printed can be pasted as it is
            let line = format!("{entry},key={}", key.public());
            kvd_remote::peers::parse_entry(&line)?;
            println!("{line}");
        }
        None => println!("{}", key.public()),
    }
    Ok(())
}

fn revoke(a: &RevokeArgs) -> Result<()> {
    if !a.etcd.is_on() {
        return Err(Error::InvalidArgument(
            "--etcd is needed (a static cluster revokes a key by deleting the node's line from \
             its --peers-file)"
                .into(),
        ));
    }
    let given: Option<PublicKey> = a.key.as_deref().map(str::parse).transpose()?;
    let security = a.etcd.security()?;
    let prefix = a.etcd.prefix();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| Error::Io(format!("a runtime: {e}")))?;
    rt.block_on(async {
        let timeout = std::time::Duration::from_secs(5);
        let mut etcd = kvd_cluster::Etcd::connect(&a.etcd.etcd, &security, timeout).await?;
        let key = match (given, a.node) {
            (Some(k), _) => k,
            (None, Some(node)) => {
                let r = etcd.registration(&prefix, node).await?.ok_or_else(|| {
                    Error::NotFound(format!(
                        "node {node} is not registered under {prefix}; revoke its key with --key"
                    ))
                })?;
                r.node_key.parse().map_err(|_| {
                    Error::InvalidArgument(format!(
                        "node {node}'s registration holds no valid key ({:?}); no node accepts \
                         it as it is",
                        r.node_key
                    ))
                })?
            }
            (None, None) => {
                return Err(Error::InvalidArgument(
                    "--node or --key names the key".into(),
                ));
            }
        };
        etcd.revoke_key(&prefix, &key, a.node).await?;
        println!("revoked {key}");
        eprintln!(
            "kvd key: every node drops the key from its peer table as the watch delivers it \
             and closes its connections; the node needs a new key to come back"
        );
        Ok(())
    })
}
