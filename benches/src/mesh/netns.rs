//! The mesh's namespaces: a hub with a bridge, one namespace per daemon with a veth into it,
//! the daemons started in them, and the clean-up of all of it (see the parent module).

use super::*;

/// The address of daemon `i` in its namespace.
pub(super) fn addr(i: usize) -> Ipv4Addr {
    Ipv4Addr::new(10, 79, 0, (i + 1) as u8)
}

/// Run `ip` with `args`.
pub(super) fn ip(args: &[&str]) -> Result<(), String> {
    let out = Command::new("ip")
        .args(args)
        .stdin(Stdio::null())
        .output()
        .map_err(|e| format!("ip: {e} (the mesh needs iproute2)"))?;
    if !out.status.success() {
        return Err(format!(
            "ip {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        ));
    }
    Ok(())
}

/// Kill what still runs in namespace `ns` (this bench's daemons, or a dead bench's).
pub(super) fn kill_in(ns: &str) {
    let Ok(out) = Command::new("ip").args(["netns", "pids", ns]).output() else {
        return;
    };
    for pid in String::from_utf8_lossy(&out.stdout).split_whitespace() {
        if let Some(pid) = pid
            .parse::<i32>()
            .ok()
            .and_then(rustix::process::Pid::from_raw)
        {
            let _ = rustix::process::kill_process(pid, rustix::process::Signal::KILL);
        }
    }
}

/// Remove the namespaces (and what runs in them) of meshes whose bench is gone: a pid that no
/// longer exists or is no longer a `kvd-bench`.
pub(super) fn remove_stale() {
    let Ok(out) = Command::new("ip").args(["netns", "list"]).output() else {
        return;
    };
    for line in String::from_utf8_lossy(&out.stdout).lines() {
        let name = line.split_whitespace().next().unwrap_or("");
        let Some(pid) = name
            .strip_prefix(PREFIX)
            .and_then(|r| r.split('-').next())
            .and_then(|p| p.parse::<u32>().ok())
        else {
            continue;
        };
        // /proc/PID/stat: `PID (COMM) STATE ...`; a zombie is as good as gone
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
        let alive = stat.split_once(" (").is_some_and(|(_, r)| {
            r.starts_with("kvd-bench")
                && r.rsplit_once(") ")
                    .is_some_and(|(_, st)| !st.starts_with(['Z', 'X']))
        });
        if pid == std::process::id() || !alive {
            eprintln!("kvd-bench mesh: removing leftover namespace {name}");
            kill_in(name);
            let _ = ip(&["netns", "del", name]);
        }
    }
}

/// The namespaces and the bridge, removed (with whatever still runs in them) on drop.
#[derive(Debug)]
pub(super) struct Mesh {
    pub(super) tag: String,
    /// Every namespace made so far, the hub first.
    pub(super) made: Vec<String>,
}

impl Mesh {
    /// A hub namespace with a bridge, and `n` namespaces each with a veth into it
    /// (10.79.0.<i+1>/24) and loopback up.
    pub(super) fn new(n: usize) -> Result<Mesh, String> {
        remove_stale();
        let mut m = Mesh {
            tag: format!("{PREFIX}{}", std::process::id()),
            made: Vec::new(),
        };
        let hub = format!("{}-hub", m.tag);
        ip(&["netns", "add", &hub])?;
        m.made.push(hub.clone());
        ip(&["-n", &hub, "link", "add", "br0", "type", "bridge"])?;
        ip(&["-n", &hub, "link", "set", "br0", "up"])?;
        for i in 0..n {
            let ns = m.ns(i);
            ip(&["netns", "add", &ns])?;
            m.made.push(ns.clone());
            let v = format!("v{i}");
            ip(&[
                "-n", &hub, "link", "add", &v, "type", "veth", "peer", "name", "eth0", "netns", &ns,
            ])?;
            ip(&["-n", &hub, "link", "set", &v, "master", "br0"])?;
            ip(&["-n", &hub, "link", "set", &v, "up"])?;
            let a = format!("{}/24", addr(i));
            ip(&["-n", &ns, "addr", "add", &a, "dev", "eth0"])?;
            ip(&["-n", &ns, "link", "set", "eth0", "up"])?;
            ip(&["-n", &ns, "link", "set", "lo", "up"])?;
        }
        Ok(m)
    }

    /// Daemon `i`'s namespace.
    pub(super) fn ns(&self, i: usize) -> String {
        format!("{}-{i}", self.tag)
    }
}

impl Drop for Mesh {
    fn drop(&mut self) {
        for ns in self.made.iter().rev() {
            kill_in(ns);
            if let Err(e) = ip(&["netns", "del", ns]) {
                eprintln!("kvd-bench mesh: {e}");
            }
        }
    }
}

/// A `kvd serve` in a namespace; stopped (SIGTERM, bounded wait, then kill) on drop.
pub(super) struct NsDaemon {
    pub(super) child: Option<Child>,
    pub(super) socket: PathBuf,
    pub(super) lines: Receiver<String>,
    pub(super) _dir: tempfile::TempDir,
}

impl NsDaemon {
    /// Start `kvd serve` in namespace `ns` with `extra` flags; it is ready after
    /// [`NsDaemon::wait_ready`].
    pub(super) fn spawn(
        kvd: &Path,
        ns: &str,
        plan: &Plan,
        extra: &[String],
    ) -> Result<NsDaemon, String> {
        use std::os::unix::process::CommandExt;
        let dir = tempfile::tempdir().map_err(|e| e.to_string())?;
        let socket = dir.path().join("kvd.sock");
        let pool_mib = (plan.block * plan.pool_pages).div_ceil(1 << 20);
        let mut cmd = Command::new("ip");
        cmd.args(["netns", "exec", ns])
            .arg(kvd)
            .args(["serve", "--data-dir"])
            .arg(dir.path())
            .arg("--socket")
            .arg(&socket)
            .args(["--admin-listen", "127.0.0.1:0", "--huge-pages", "try"])
            .args(["--pool-mib", &pool_mib.to_string()])
            .args(["--page-kib", &(plan.block >> 10).to_string()])
            .args(extra)
            .env("RUST_LOG", "warn")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit());
        // SAFETY: the hook only calls prctl(2), which is async-signal-safe, between fork and
        // exec; `ip netns exec` execs kvd, which keeps the death signal, so a daemon goes when
        // the thread that started it (this bench's main thread) does, however the bench ends.
        unsafe {
            cmd.pre_exec(|| {
                libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM);
                Ok(())
            });
        }
        let mut child = cmd
            .spawn()
            .map_err(|e| format!("starting {} in {ns}: {e}", kvd.display()))?;
        let lines = crate::local::stdout_lines(&mut child);
        Ok(NsDaemon {
            child: Some(child),
            socket,
            lines,
            _dir: dir,
        })
    }

    /// Wait (until `deadline`) for its `kvd ready` line.
    pub(super) fn wait_ready(&self, deadline: Instant) -> Result<(), String> {
        loop {
            match self
                .lines
                .recv_timeout(deadline.saturating_duration_since(Instant::now()))
            {
                Ok(l) if l.starts_with("kvd ready") => return Ok(()),
                Ok(_) => {}
                Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {
                    return Err("a kvd serve did not become ready within 60 s".into());
                }
                Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => {
                    return Err(
                        "a kvd serve ended before it was ready (its errors are above)".into(),
                    );
                }
            }
        }
    }

    /// Ask it to stop (SIGTERM), without waiting.
    pub(super) fn term(&self) {
        if let Some(pid) = self
            .child
            .as_ref()
            .and_then(|c| rustix::process::Pid::from_raw(c.id() as i32))
        {
            let _ = rustix::process::kill_process(pid, rustix::process::Signal::TERM);
        }
    }
}

impl Drop for NsDaemon {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            crate::local::stop_child(&mut c);
        }
    }
}

/// Run `f` on a thread that entered namespace `ns` (sockets it opens belong to `ns` and work
/// from any thread after).
pub(super) fn in_netns<T: Send>(
    ns: &str,
    f: impl FnOnce() -> std::io::Result<T> + Send,
) -> Result<T, String> {
    let path = format!("/var/run/netns/{ns}");
    std::thread::scope(|sc| {
        sc.spawn(|| {
            let file = std::fs::File::open(&path).map_err(|e| format!("{path}: {e}"))?;
            // SAFETY: setns(2) with a descriptor this thread owns (open for the call); it moves
            // only this thread, which does nothing but `f` and then ends.
            if unsafe { libc::setns(file.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
                return Err(format!("setns {ns}: {}", std::io::Error::last_os_error()));
            }
            f().map_err(|e| format!("in {ns}: {e}"))
        })
        .join()
        .unwrap_or_else(|_| Err("a namespace thread panicked".into()))
    })
}
