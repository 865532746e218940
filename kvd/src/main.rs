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
    /// Run a demonstration of the block store's lifecycle on an in-process pool.
    Demo,
    /// Run the control shim (checkpoint placement, recovery planning) as an HTTP/JSON service.
    Control(kvd::control::service::ControlArgs),
    /// Simulate a serving cluster with failing workers and compare recovery policies.
    #[cfg(feature = "sim")]
    Sim(kvd::sim::cli::SimArgs),
}

fn main() -> std::process::ExitCode {
    let cli = Cli::parse();
    match cli.command {
        Command::Demo => {
            println!("kvd {}", env!("CARGO_PKG_VERSION"));
            std::process::ExitCode::SUCCESS
        }
        Command::Control(args) => kvd::control::service::run(args),
        #[cfg(feature = "sim")]
        Command::Sim(args) => kvd::sim::cli::run(args),
    }
}
