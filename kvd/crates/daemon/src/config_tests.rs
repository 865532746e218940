//! `config.rs`'s tests: each setting parsed, bounded and resolved, and the docs table
//! checked against the flags.

use super::*;

/// A well-formed public key (64 hex digits) for peer entries.
const KEY: &str = "3b6a27bcceb6a42d62a3a8d02a6f0d73653215771de243a63ac048a18b59da29";

/// The settings and the configuration `args` (what follows `serve`) give.
fn resolve(args: &[&str]) -> Result<DaemonConfig> {
    DaemonConfig::resolve(&ServeArgs::from_cli(args.iter().map(OsString::from))?)
}

fn file(text: &str) -> (tempfile::TempDir, String) {
    let dir = tempfile::tempdir().unwrap();
    let f = dir.path().join("kvd.toml");
    std::fs::write(&f, text).unwrap();
    (dir, f.to_str().unwrap().to_string())
}

#[test]
fn flags_win_over_the_file_and_the_file_over_the_defaults() {
    let (_d, f) = file(&format!(
        "pool_mib = 64\nmax_sessions = 8\npage_kib = 160\npeer = [\"2=127.0.0.1:1,key={k}\", \
             \"3=127.0.0.1:2,key={k}\"]\ncluster_secret_file = \"s\"\nallow_remote_admin = true\n",
        k = KEY
    ));
    let four = format!("4=127.0.0.1:3,key={KEY}");
    let c = resolve(&["--config", &f, "--max-sessions=4", "--peer", &four]).unwrap();
    assert_eq!(c.pool_bytes, 64 << 20);
    assert_eq!(c.page_bytes, 160 * 1024);
    assert_eq!(c.settings.max_sessions, 4, "the flag wins");
    assert_eq!(c.settings.max_inflight, 32, "the default");
    assert_eq!(c.socket, PathBuf::from("kvd-data/kvd.sock"));
    // a list given as flags replaces the file's (it is not added to it)
    let peers = c.data_port.unwrap().peers;
    assert_eq!(peers.keys().copied().collect::<Vec<_>>(), vec![4]);
    // without the flags, the file's list and its boolean
    let c = resolve(&["--config", &f, "--admin-listen", "0.0.0.0:7460"]).unwrap();
    assert_eq!(c.data_port.unwrap().peers.len(), 2);
    assert_eq!(c.settings.max_sessions, 8);
}

#[test]
fn check_config_shows_each_setting_once_as_given_or_resolved() {
    let (_dir, f) = file("max_sessions = 100\nhuge_pages = \"off\"\n");
    let c = resolve(&[
        "--config",
        &f,
        "--socket",
        "/tmp/k.sock",
        "--pool-mib",
        "64",
    ])
    .unwrap();
    // as `--check-config` prints it: one top-level key a line, indented by two
    let text = serde_json::to_string_pretty(&c).unwrap();
    let top: Vec<&str> = text
        .lines()
        .filter_map(|l| l.strip_prefix("  \""))
        .filter_map(|l| l.split_once('"').map(|(k, _)| k))
        .collect();
    let mut once = top.clone();
    once.sort_unstable();
    once.dedup();
    assert_eq!(
        once.len(),
        top.len(),
        "a key given and resolved twice: {text}"
    );
    for line in [
        "\"socket\": \"/tmp/k.sock\"",
        "\"pool_bytes\": 67108864",
        "\"huge_pages\": \"Off\"",
        "\"max_sessions\": 100",
    ] {
        assert!(text.contains(line), "no {line} in {text}");
    }
    for resolved_away in ["pool_mib", "page_kib", "config", "check_config", "etcd"] {
        assert!(!top.contains(&resolved_away), "{resolved_away} in {text}");
    }
}

#[test]
fn a_non_loopback_admin_address_needs_an_explicit_flag() {
    assert!(resolve(&["--admin-listen", "0.0.0.0:7460"]).is_err());
    let c = resolve(&["--admin-listen", "0.0.0.0:7460", "--allow-remote-admin"]).unwrap();
    assert!(!c.settings.allow_remote_drain);
}

#[test]
fn a_value_from_the_file_is_bounded_as_its_flag_and_the_error_says_where_it_came_from() {
    let (_d, f) = file("admin_max_connections = 8\nadmin_idle_timeout_ms = 900\n");
    let c = resolve(&["--config", &f, "--admin-idle-timeout-ms", "700"]).unwrap();
    assert_eq!(c.settings.admin_max_connections, 8);
    assert_eq!(
        c.settings.admin_header_timeout_ms,
        DEFAULT_ADMIN_HEADER_TIMEOUT_MS
    );
    assert_eq!(c.settings.admin_idle_timeout_ms, 700);
    for (flag, bad) in [
        ("admin_max_connections", "0".to_string()),
        ("admin_header_timeout_ms", "0".to_string()),
        (
            "admin_idle_timeout_ms",
            (MAX_ADMIN_TIMEOUT_MS + 1).to_string(),
        ),
        ("event_log_capacity", "0".to_string()),
        (
            "event_log_capacity",
            (crate::store::events::MAX_EVENT_LOG_CAPACITY + 1).to_string(),
        ),
        ("max_batch", "4097".to_string()),
        ("transfer_deadline_ms", "999".to_string()),
        ("data_lanes", "0".to_string()),
        ("data_lanes", "17".to_string()),
        ("cpu_wake_latency_us", "1000001".to_string()),
        ("cpu_wake_hold_ms", "0".to_string()),
        ("huge_pages", "\"sometimes\"".to_string()),
    ] {
        let long = format!("--{}", flag.replace('_', "-"));
        let from_flag = resolve(&[&format!("{long}={}", bad.trim_matches('"'))]).unwrap_err();
        assert!(from_flag.to_string().contains(&long), "{from_flag}");
        let (_d, f) = file(&format!("{flag} = {bad}\n"));
        let from_file = resolve(&["--config", &f]).unwrap_err();
        assert!(
            from_file.to_string().contains(&long) && from_file.to_string().contains(&f),
            "{from_file}"
        );
    }
}

#[test]
fn the_wake_latency_request_is_off_unless_set_and_takes_its_hold_time() {
    assert_eq!(resolve(&[]).unwrap().cpu_wake, None);
    let (_d, f) = file("cpu_wake_latency_us = 0\ncpu_wake_hold_ms = 250\n");
    assert_eq!(
        resolve(&["--config", &f]).unwrap().cpu_wake,
        Some(CpuWakeConfig {
            latency_us: 0,
            hold_ms: 250
        })
    );
    assert_eq!(
        resolve(&["--cpu-wake-latency-us", "20"]).unwrap().cpu_wake,
        Some(CpuWakeConfig {
            latency_us: 20,
            hold_ms: 100
        })
    );
}

#[test]
fn the_event_log_capacity_comes_from_the_flag_or_the_file() {
    let (_d, f) = file("event_log_capacity = 16\n");
    assert_eq!(
        resolve(&["--config", &f])
            .unwrap()
            .settings
            .event_log_capacity,
        16
    );
    assert_eq!(
        resolve(&[]).unwrap().settings.event_log_capacity,
        DEFAULT_EVENT_LOG_CAPACITY
    );
}

#[test]
fn an_unknown_key_or_a_table_in_the_file_is_an_error_that_names_it() {
    for (text, names) in [
        ("pool_gib = 1\n", "pool_gib"),
        ("config = \"other.toml\"\n", "config"),
        ("[etcd]\nurl = \"x\"\n", "etcd"),
    ] {
        let (_d, f) = file(text);
        let e = resolve(&["--config", &f]).unwrap_err();
        assert!(e.to_string().contains(names), "{e}");
    }
}

#[test]
fn settings_that_do_not_fit_together_are_refused() {
    for (args, says) in [
        (
            &[
                "--max-transfers-per-peer",
                "9",
                "--max-transfers",
                "8",
                "--cluster-secret-file",
                "s",
            ][..],
            "per peer",
        ),
        (
            &["--peer", "2=127.0.0.1:1,key=00"][..],
            "--cluster-secret-file",
        ),
        (
            &["--cluster-secret-file", "s", "--peer", "2=127.0.0.1:1"][..],
            "no key",
        ),
        (&["--peers-file", "p"][..], "--cluster-secret-file"),
        (
            &["--etcd", "http://127.0.0.1:2379"][..],
            "--cluster-secret-file",
        ),
        (&["--drain-deadline-ms", "50000"][..], "hard deadline"),
        (
            &["--pool-mib", "1", "--page-kib", "2048"][..],
            "at least one page",
        ),
        (
            &["--max-sessions", "2", "--max-sessions-per-uid", "3"][..],
            "session bounds",
        ),
    ] {
        let e = resolve(args).unwrap_err();
        assert!(e.to_string().contains(says), "{args:?}: {e}");
    }
}

#[cfg(test)]
mod documented {
    use super::ServeArgs;

    /// `docs/DAEMON.md`'s settings: the first cell of every table row that names one.
    fn documented() -> std::collections::BTreeSet<String> {
        include_str!("../../../../docs/DAEMON.md")
            .lines()
            .filter_map(|l| l.strip_prefix("| `"))
            .filter_map(|l| l.split_once('`').map(|(k, _)| k.to_string()))
            .collect()
    }

    #[test]
    fn every_setting_of_kvd_serve_has_its_row_in_docs_daemon_md_and_every_row_is_a_setting() {
        use clap::Args;
        let cmd = ServeArgs::augment_args(clap::Command::new("serve"));
        let flags: std::collections::BTreeSet<String> = cmd
            .get_arguments()
            .filter_map(|a| a.get_long())
            .filter(|l| !matches!(*l, "config" | "check-config"))
            .map(|l| l.replace('-', "_"))
            .collect();
        let docs = documented();
        let missing: Vec<&String> = flags.iter().filter(|f| !docs.contains(*f)).collect();
        assert!(
            missing.is_empty(),
            "settings of `kvd serve` without a row in docs/DAEMON.md's tables: {missing:?}"
        );
        // rows that name a setting key (snake_case, no spaces) must be one
        let stale: Vec<&String> = docs
            .iter()
            .filter(|d| d.chars().all(|c| c.is_ascii_lowercase() || c == '_'))
            .filter(|d| d.contains('_') && !flags.contains(*d))
            .collect();
        assert!(
            stale.is_empty(),
            "docs/DAEMON.md rows for no setting: {stale:?}"
        );
    }

    #[test]
    fn every_default_in_docs_daemon_md_is_the_one_the_setting_declares() {
        use clap::Args;
        let cmd = ServeArgs::augment_args(clap::Command::new("serve"));
        // the settings table's row of each key (the first: later tables may name it too)
        let mut rows = std::collections::BTreeMap::new();
        for l in include_str!("../../../../docs/DAEMON.md").lines() {
            let Some((key, rest)) = l.strip_prefix("| `").and_then(|l| l.split_once('`')) else {
                continue;
            };
            if let Some(default) = rest.split('|').nth(1) {
                rows.entry(key.to_string())
                    .or_insert_with(|| default.trim().trim_matches('`').to_string());
            }
        }
        let mut wrong = Vec::new();
        for a in cmd.get_arguments() {
            let (Some(long), [declared]) = (a.get_long(), a.get_default_values()) else {
                continue;
            };
            let key = long.replace('-', "_");
            let declared = declared.to_string_lossy();
            if rows.get(&key).map(String::as_str) != Some(&*declared) {
                wrong.push(format!(
                    "{key}: declared {declared}, documented {:?}",
                    rows.get(&key)
                ));
            }
        }
        assert!(
            wrong.is_empty(),
            "docs/DAEMON.md's defaults differ: {wrong:#?}"
        );
    }
}
