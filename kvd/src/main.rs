//! The `kvd` command: `kvd serve`, `kvd status`, `kvd drain`, `kvd key`, `kvd control`,
//! `kvd sim`.

use clap::{Parser, Subcommand};

/// kvd: the KV-cache block daemon for distributed LLM serving.
#[derive(Debug, Parser)]
#[command(version, about, long_about = None)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Run the block daemon: the pool, the local protocol on a Unix socket, the admin HTTP,
    /// and (with a cluster secret) the data port to its peers.
    #[command(
        args_override_self = true,
        after_help = "Examples:
  kvd serve                                   single node, 256 MiB pool, socket kvd-data/kvd.sock
  kvd serve --pool-mib 65536 --socket /run/kvd/kvd.sock --socket-group vllm --data-dir /var/lib/kvd
  kvd serve --config /etc/kvd.toml            the same keys in TOML (flags win)
  kvd serve --node-id 1 --cluster-secret-file secret --data-listen 10.0.0.1:7461 \\
      --peers-file /etc/kvd/peers             nodes named by hand, each with its key (the
                                              file's lines: 2=10.0.0.2:7461,key=<kvd key show>)
  kvd serve --node-id 1 --cluster-secret-file secret --data-listen 10.0.0.1:7461 \\
      --etcd http://10.0.0.9:2379             a cluster: peers and leases from etcd

Once serving it prints `kvd ready generation=N socket=PATH admin=ADDR [data=ADDR]`. Engines
connect with kvd::client (or libkvd); operators use `kvd status` and the admin port (/metrics,
/drain). SIGTERM or POST /drain drains gracefully (withdrawing from etcd first) and exits 0.
See docs/DAEMON.md."
    )]
    Serve(Box<kvd::daemon::ServeArgs>),
    /// Print a running daemon's status (pool occupancy by state, sessions, rates).
    Status(kvd::daemon::status::StatusArgs),
    /// Drain a running daemon (finish in-flight work, then exit 0), and optionally wait for it.
    Drain(kvd::daemon::status::DrainArgs),
    /// A node's identity on the data port: print its public key (for peer lists), or revoke a
    /// node's key in the cluster's etcd.
    Key(kvd::daemon::keys::KeyArgs),
    /// Run the control shim (checkpoint placement, recovery planning) as an HTTP/JSON service.
    Control(Box<kvd::control_service::ControlArgs>),
    /// Simulate a serving cluster with failing workers and compare recovery policies.
    #[cfg(feature = "sim")]
    Sim(kvd::sim::cli::SimArgs),
}

/// Log to stderr, filtered by `RUST_LOG` (default `info`): the two services, `kvd serve` and
/// `kvd control`.
fn init_logging() {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .try_init();
}

fn main() -> std::process::ExitCode {
    let cli = Cli::parse();
    if matches!(cli.command, Command::Serve(_) | Command::Control(_)) {
        init_logging();
    }
    match cli.command {
        Command::Serve(args) => kvd::daemon::run(*args),
        Command::Status(args) => kvd::daemon::status::run(args),
        Command::Drain(args) => kvd::daemon::status::drain(args),
        Command::Key(args) => kvd::daemon::keys::run(args),
        Command::Control(args) => kvd::control_service::run(*args),
        #[cfg(feature = "sim")]
        Command::Sim(args) => kvd::sim::cli::run(args),
    }
}
