//! The daemon's file-descriptor budget: who may hold how many of the process's open files.
//!
//! Every connection is a file descriptor, and the process has `RLIMIT_NOFILE` of them. Before
//! this budget, a flood of admin HTTP connections could take all of them, after which the Unix
//! socket could accept no engine and `/healthz` failed with `EMFILE`. Now, at start:
//!
//! 1. [`raise_nofile`] lifts the soft limit to the hard limit (an unprivileged process may; the
//!    hard limit is the operator's `ulimit -Hn` or systemd's `LimitNOFILE=`);
//! 2. [`FdBudget::plan`] shares it out, data socket first:
//!
//! ```text
//! nofile_soft ≥ [max_sessions + max_pending_connections]   the Unix socket's connections
//!             + RESERVED_FDS                                pool and page-table memfds, the
//!                                                           listeners, logs, the runtime, one
//!                                                           connection being accepted
//!             + [admin_max_connections + ADMIN_REFUSAL_FDS] admin HTTP: held connections and
//!                                                           refusals being closed (admin.rs)
//! ```
//!
//! The admin cap is the configured one, lowered to what is left; if what is left cannot hold
//! [`MIN_ADMIN_CONNECTIONS`], start-up fails and says which limit to raise. The plan is a pure
//! function of the limits and the configuration, so it is unit-tested without touching the
//! process's limits.

use serde::{Deserialize, Serialize};

use crate::{Error, Result};

/// Descriptors kept back for everything that is not a connection: the pool's and the page
/// table's memfds, the two listeners, stdio and the log, the runtime's epoll and wake-up fds,
/// and one connection between `accept` and its refusal.
pub const RESERVED_FDS: u64 = 64;

/// The fewest admin connections the daemon starts with: enough for a liveness probe, a
/// readiness probe, a scrape and an operator at the same time.
pub const MIN_ADMIN_CONNECTIONS: u32 = 4;

/// Refused admin connections that may still be open at once, each for at most
/// [`super::admin::REFUSAL_LINGER_MS`] after its `503` (see [`super::admin`]).
pub const ADMIN_REFUSAL_FDS: u32 = 16;

/// The process's `RLIMIT_NOFILE`; `u64::MAX` stands for "unlimited".
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NofileLimit {
    /// The limit in force (the soft limit).
    pub soft: u64,
    /// What the soft limit may be raised to without privilege.
    pub hard: u64,
}

/// Raise the soft open-file limit to the hard limit; return the limits in force afterwards.
///
/// An unlimited hard limit (which Linux does not allow for this resource, but other systems
/// might) leaves the soft limit as it is; so does a refusal of the raise, with a warning: the
/// plan then works with what the process has.
pub fn raise_nofile() -> NofileLimit {
    use rustix::process::{Resource, Rlimit, getrlimit, setrlimit};
    let before = getrlimit(Resource::Nofile);
    let as_u64 = |v: Option<u64>| v.unwrap_or(u64::MAX);
    let below_hard = match (before.current, before.maximum) {
        (Some(soft), Some(hard)) if soft < hard => Some(hard),
        _ => None,
    };
    if let Some(hard) = below_hard {
        let raised = Rlimit {
            current: Some(hard),
            maximum: Some(hard),
        };
        if let Err(e) = setrlimit(Resource::Nofile, raised) {
            tracing::warn!(error = %e, hard, "could not raise the open-file soft limit");
        }
    }
    let now = getrlimit(Resource::Nofile);
    NofileLimit {
        soft: as_u64(now.current),
        hard: as_u64(now.maximum),
    }
}

/// How the open-file limit is shared out (see the module documentation).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct FdBudget {
    /// The open-file limit in force.
    pub nofile_soft: u64,
    /// The hard open-file limit.
    pub nofile_hard: u64,
    /// Descriptors the Unix socket's connections may hold (`max_sessions` +
    /// `max_pending_connections`).
    pub data_socket_fds: u64,
    /// Descriptors kept back for the rest ([`RESERVED_FDS`]).
    pub reserved_fds: u64,
    /// Admin HTTP connections held at most (the configured cap, or less when the limit is
    /// short).
    pub admin_max_connections: u32,
    /// Refused admin connections open at most ([`ADMIN_REFUSAL_FDS`]).
    pub admin_refusal_fds: u32,
}

impl FdBudget {
    /// Share `nofile` out between the Unix socket, the reserve and the admin HTTP.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when the limit cannot hold the Unix socket's connections, the
    /// reserve and [`MIN_ADMIN_CONNECTIONS`]; the message names the limit to raise and the
    /// figure it needs.
    pub fn plan(
        nofile: NofileLimit,
        max_sessions: u32,
        max_pending_connections: u32,
        admin_configured: u32,
    ) -> Result<FdBudget> {
        let data_socket_fds = u64::from(max_sessions) + u64::from(max_pending_connections);
        let fixed = data_socket_fds + RESERVED_FDS + u64::from(ADMIN_REFUSAL_FDS);
        let needed = fixed + u64::from(MIN_ADMIN_CONNECTIONS);
        if nofile.soft < needed {
            return Err(Error::InvalidArgument(format!(
                "the open-file limit ({} soft, {} hard) cannot hold max_sessions ({max_sessions}) \
                 + max_pending_connections ({max_pending_connections}) + {RESERVED_FDS} reserved \
                 + {} admin connections = {needed} file descriptors; raise the hard limit to at \
                 least {needed} (`ulimit -Hn`, or LimitNOFILE= in the systemd unit) or lower \
                 --max-sessions",
                nofile.soft,
                nofile.hard,
                MIN_ADMIN_CONNECTIONS + ADMIN_REFUSAL_FDS,
            )));
        }
        let left = nofile.soft - fixed;
        let admin_max_connections =
            u32::try_from(left.min(u64::from(admin_configured))).expect("at most a u32");
        let b = FdBudget {
            nofile_soft: nofile.soft,
            nofile_hard: nofile.hard,
            data_socket_fds,
            reserved_fds: RESERVED_FDS,
            admin_max_connections,
            admin_refusal_fds: ADMIN_REFUSAL_FDS,
        };
        assert!(b.total() <= b.nofile_soft, "the plan overcommits: {b:?}");
        Ok(b)
    }

    /// Descriptors the plan gives out, at most.
    pub fn total(&self) -> u64 {
        self.data_socket_fds
            + self.reserved_fds
            + u64::from(self.admin_max_connections)
            + u64::from(self.admin_refusal_fds)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limit(soft: u64, hard: u64) -> NofileLimit {
        NofileLimit { soft, hard }
    }

    #[test]
    fn a_roomy_limit_gives_the_admin_its_configured_cap() {
        let b = FdBudget::plan(limit(1 << 20, 1 << 20), 256, 32, 64).unwrap();
        assert_eq!(b.data_socket_fds, 288);
        assert_eq!(b.admin_max_connections, 64);
        assert_eq!(b.reserved_fds, RESERVED_FDS);
        assert!(b.total() <= b.nofile_soft);
    }

    #[test]
    fn a_short_limit_lowers_the_admin_cap_never_the_sessions() {
        let data = 256 + 32;
        let fixed = data + RESERVED_FDS + u64::from(ADMIN_REFUSAL_FDS);
        let soft = fixed + 10;
        let b = FdBudget::plan(limit(soft, soft), 256, 32, 64).unwrap();
        assert_eq!(b.admin_max_connections, 10);
        assert_eq!(b.data_socket_fds, data);
        assert_eq!(b.total(), soft, "everything is given out, nothing more");
    }

    #[test]
    fn a_limit_that_cannot_hold_the_sessions_fails_and_names_what_to_raise() {
        let needed = 256 + 32 + RESERVED_FDS + u64::from(ADMIN_REFUSAL_FDS + MIN_ADMIN_CONNECTIONS);
        let ok = FdBudget::plan(limit(needed, needed), 256, 32, 64).unwrap();
        assert_eq!(ok.admin_max_connections, MIN_ADMIN_CONNECTIONS);
        let e = FdBudget::plan(limit(needed - 1, 4096), 256, 32, 64).unwrap_err();
        let m = e.to_string();
        assert!(matches!(e, Error::InvalidArgument(_)), "{m}");
        for needle in [
            "ulimit -Hn",
            "LimitNOFILE",
            &needed.to_string(),
            "--max-sessions",
        ] {
            assert!(m.contains(needle), "no {needle:?} in {m:?}");
        }
    }

    #[test]
    fn a_configured_cap_below_the_minimum_is_kept_when_it_fits() {
        let b = FdBudget::plan(limit(1 << 20, 1 << 20), 8, 2, 1).unwrap();
        assert_eq!(b.admin_max_connections, 1);
    }

    #[test]
    fn raising_the_soft_limit_never_passes_the_hard_limit() {
        let l = raise_nofile();
        assert!(l.soft <= l.hard, "{l:?}");
    }
}
