//! The `kvd` command: `kvd serve`, `kvd status`, `kvd control`, `kvd sim`.

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
    /// Run the block daemon: the pool, the local protocol on a Unix socket, the admin HTTP.
    Serve(kvd::daemon::ServeArgs),
    /// Print a running daemon's status (pool occupancy by state, sessions, rates).
    Status(kvd::daemon::status::StatusArgs),
    /// Run the control shim (checkpoint placement, recovery planning) as an HTTP/JSON service.
    Control(kvd::control::service::ControlArgs),
    /// Simulate a serving cluster with failing workers and compare recovery policies.
    #[cfg(feature = "sim")]
    Sim(kvd::sim::cli::SimArgs),
}

fn main() -> std::process::ExitCode {
    let cli = Cli::parse();
    match cli.command {
        Command::Serve(args) => kvd::daemon::run(args),
        Command::Status(args) => kvd::daemon::status::run(args),
        Command::Control(args) => kvd::control::service::run(args),
        #[cfg(feature = "sim")]
        Command::Sim(args) => kvd::sim::cli::run(args),
    }
}
