//! Cluster-mode helpers: the secret, nodes registered in a real etcd, their membership views,
//! and `kvd control --etcd`.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use super::{Daemon, Etcd};

/// A cluster secret file (mode 0600) in `dir`.
pub fn secret_file(dir: &Path) -> PathBuf {
    use std::os::unix::fs::PermissionsExt;
    let p = dir.join("secret");
    std::fs::write(&p, [7u8; 32]).unwrap();
    std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o600)).unwrap();
    p
}

/// A node `id` with a data port on loopback, registered in `etcd` under a lease of `ttl_ms`,
/// with `extra` flags.
pub fn node(
    dir: &Path,
    secret: &Path,
    etcd: &Etcd,
    id: u64,
    ttl_ms: u64,
    extra: &[&str],
) -> Daemon {
    let (s, id, ttl) = (secret.to_str().unwrap(), id.to_string(), ttl_ms.to_string());
    let mut args = vec![
        "--cluster-secret-file",
        s,
        "--data-listen",
        "127.0.0.1:0",
        "--node-id",
        &id,
        "--etcd",
        &etcd.url,
        "--etcd-lease-ttl-ms",
        &ttl,
    ];
    args.extend_from_slice(extra);
    Daemon::start_in(dir, &args)
}

/// `d`'s membership view: (node id, generation) of every registered node.
pub fn view(d: &Daemon) -> Vec<(u64, u64)> {
    d.status()
        .cluster
        .map(|c| c.nodes.iter().map(|n| (n.node_id, n.generation)).collect())
        .unwrap_or_default()
}

/// `n` empty state directories under `root`, one per node: `n1`, `n2`, …
pub fn node_dirs(root: &Path, n: u64) -> Vec<PathBuf> {
    let dirs: Vec<PathBuf> = (1..=n).map(|i| root.join(format!("n{i}"))).collect();
    for d in &dirs {
        std::fs::create_dir(d).unwrap();
    }
    dirs
}

/// Wait until every one of `nodes` has the view `want`; how long it took.
pub fn wait_views(
    nodes: &[&Daemon],
    want: &[(u64, u64)],
    timeout: Duration,
    what: &str,
) -> Duration {
    let t = Instant::now();
    super::wait_until(timeout, what, || nodes.iter().all(|d| view(d) == want));
    t.elapsed()
}

/// A running `kvd control --etcd`, killed on drop.
#[derive(Debug)]
pub struct Control {
    /// The process.
    pub child: std::process::Child,
    /// Its HTTP address.
    pub addr: std::net::SocketAddr,
    /// It resumed from a snapshot in etcd.
    pub resumed: bool,
}

impl Control {
    /// Start one on a free loopback port, fed by `etcd`.
    pub fn start(etcd: &Etcd) -> Control {
        use std::io::BufRead;
        let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_kvd"))
            .args(["control", "--listen", "127.0.0.1:0", "--etcd", &etcd.url])
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap();
        let out = std::io::BufReader::new(child.stdout.take().unwrap());
        let mut resumed = false;
        let mut addr = None;
        for line in out.lines().map_while(Result::ok).take(10) {
            resumed |= line.contains("resumed from the snapshot");
            if let Some(a) = line.strip_prefix("kvd control listening on ") {
                addr = Some(a.trim().parse().unwrap());
                break;
            }
        }
        Control {
            child,
            addr: addr.expect("kvd control started"),
            resumed,
        }
    }

    /// Worker id → phase, as the controller has them.
    pub fn workers(&self) -> Vec<(u64, String)> {
        let (_, body) = kvd::daemon::status::http(self.addr, "GET", "/workers").unwrap();
        let v: serde_json::Value = serde_json::from_str(&body).unwrap_or_default();
        let mut out: Vec<(u64, String)> = v["workers"]
            .as_object()
            .map(|m| {
                m.iter()
                    .map(|(k, w)| {
                        (
                            k.parse().unwrap_or(0),
                            w["phase"].as_str().unwrap_or("").to_string(),
                        )
                    })
                    .collect()
            })
            .unwrap_or_default();
        out.sort();
        out
    }
}

impl Drop for Control {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// `/status` of a daemon in network namespace `ns` (through `kvd status` run there).
pub fn status_in(ns: &str, d: &Daemon) -> kvd::daemon::admin::StatusReport {
    let out = std::process::Command::new("ip")
        .args([
            "netns",
            "exec",
            ns,
            env!("CARGO_BIN_EXE_kvd"),
            "status",
            "--json",
        ])
        .args(["--admin", &d.admin.to_string()])
        .output()
        .unwrap();
    serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
        panic!(
            "kvd status in {ns}: {e}: {}",
            String::from_utf8_lossy(&out.stderr)
        )
    })
}

/// The node ids in the membership view of a daemon in network namespace `ns`.
pub fn view_in(ns: &str, d: &Daemon) -> Vec<u64> {
    status_in(ns, d)
        .cluster
        .map(|c| c.nodes.iter().map(|n| n.node_id).collect())
        .unwrap_or_default()
}
