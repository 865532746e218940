//! `kvd-bench`: throughput and latency of kvd's data paths, measured against the machine's own
//! bounds in the same run.
//!
//! Subcommands (one per data path; more come with the remote transports):
//!
//! - `local`: engine ↔ daemon on one node, through the Unix socket and the mapped pool.
//! - `bindings`: the Rust client's half of the C / Python bindings' overhead measurement.
//! - `remote`: blocks between two daemons (push and fetch through their clients), beside raw
//!   loopback TCP and memcpy measured in the same run.
//! - `transfer`: the TCP transfer backend between two processes on loopback, beside raw
//!   loopback TCP (as many streams as kvd uses) and memcpy measured in the same run.
//! - `scale`, `mesh`, `plan`: cost curves as the work grows (resident blocks in the store,
//!   daemons pushing all to all, workers and requests in the control shim), each a table and,
//!   with `--plot DIR`, an SVG plot (see `curve`).
//!
//! Progress goes to stderr, the summary table to stdout. Every loop is bounded in count and
//! time.

mod bindings;
mod clients;
mod control_load;
mod curve;
mod local;
mod mesh;
mod plan;
mod remote;
mod rtt;
mod scale;
mod transfer;

use clap::{Parser, Subcommand};

/// kvd-bench: measure kvd's data paths against the machine's bounds.
#[derive(Debug, Parser)]
#[command(version, about, long_about = None)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Put and get throughput through a local daemon (zero-copy mapped pool), as GB/s and as a
    /// ratio to one large memcpy measured in the same run; and batched-lookup latency.
    ///
    /// By default it starts its own `kvd serve` for each page size (the `kvd` binary beside
    /// this one: build both with `cargo build --release -p kvd -p kvd-bench`). With `--socket`
    /// it measures a running daemon at that daemon's page size.
    ///
    /// With `--clients 1,2,4,8` it runs N client processes at once instead (as tensor-parallel
    /// ranks do) and reports their aggregate GB/s beside N parallel copies, and the daemon's
    /// metadata round trips per second.
    Local(local::LocalArgs),
    /// One client process of `local --clients` (started by it).
    #[command(hide = true)]
    LocalWorker(clients::WorkerArgs),
    /// The Rust client's half of the bindings' overhead measurement (run by
    /// scripts/bench-bindings.sh beside the C and Python halves): lookup of 128 tags, put and
    /// get of 64 x 2.5 MiB pages, against a running daemon.
    Bindings(bindings::BindingsArgs),
    /// TCP transfer backend throughput between two processes on loopback: write and read of
    /// 64 KiB to 4 MiB blocks in batches, checksums off and on, as GB/s, as a ratio to raw
    /// loopback TCP over as many streams (cache-hot and memory to memory, the better of the
    /// two) and to one large copy (all measured in the same run), and CPU seconds per GB of
    /// both processes beside raw TCP's.
    ///
    /// Build with `cargo build --release -p kvd-bench` and run
    /// `target/release/kvd-bench transfer`; about a minute with the defaults.
    Transfer(transfer::TransferArgs),
    /// Blocks between two `kvd serve` on loopback, end to end through their clients: an engine
    /// on node 1 writes blocks and pushes them to node 2; an engine on node 2 fetches blocks
    /// from node 1. 256 KiB, 2 MiB and 2.5 MiB blocks in batches, at least 1 GiB per run and
    /// direction; GB/s, blocks/s, and the ratio to raw loopback TCP over as many streams as a
    /// daemon's data connections (cache-hot and memory to memory, the better), measured in the
    /// same run.
    ///
    /// Build both binaries first: `cargo build --release -p kvd -p kvd-bench`.
    Remote(remote::RemoteArgs),
    /// The target process of `transfer` (started by it).
    #[command(hide = true)]
    TransferTarget(transfer::TargetArgs),
    /// The store's costs against the number of resident blocks (up to 10^6 and more): lookup,
    /// alloc, publish and evict p50 / p99, and the memory kvd spends per block.
    Scale(scale::ScaleArgs),
    /// Daemons pushing to each other all to all in network namespaces (2 to 16): aggregate
    /// throughput and per-transfer latency, beside raw TCP of the same shape. Needs root.
    Mesh(mesh::MeshArgs),
    /// The control shim's planning time against the number of workers (up to 256) and of
    /// requests in flight (up to 100,000).
    Plan(plan::PlanArgs),
    /// A metadata round trip over the local socket (heartbeat, exists of 1 and 128 keys)
    /// against the spin budget of both ends, quiet and with every CPU kept busy, with the CPU
    /// each side spends per call and while idle. Starts its own daemons.
    Rtt(rtt::RttArgs),
}

fn main() -> std::process::ExitCode {
    match Cli::parse().command {
        Command::Local(args) => match local::run(&args) {
            Ok(()) => std::process::ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("kvd-bench local: {e}");
                std::process::ExitCode::FAILURE
            }
        },
        Command::LocalWorker(args) => match clients::worker(&args) {
            Ok(()) => std::process::ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("kvd-bench local-worker: {e}");
                std::process::ExitCode::FAILURE
            }
        },
        Command::Bindings(args) => match bindings::run(&args) {
            Ok(()) => std::process::ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("kvd-bench bindings: {e}");
                std::process::ExitCode::FAILURE
            }
        },
        Command::Transfer(args) => match transfer::run(&args) {
            Ok(()) => std::process::ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("kvd-bench transfer: {e}");
                std::process::ExitCode::FAILURE
            }
        },
        Command::Remote(args) => match remote::run(&args) {
            Ok(()) => std::process::ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("kvd-bench remote: {e}");
                std::process::ExitCode::FAILURE
            }
        },
        Command::Scale(args) => match scale::run(&args) {
            Ok(()) => std::process::ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("kvd-bench scale: {e}");
                std::process::ExitCode::FAILURE
            }
        },
        Command::Mesh(args) => match mesh::run(&args) {
            Ok(()) => std::process::ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("kvd-bench mesh: {e}");
                std::process::ExitCode::FAILURE
            }
        },
        Command::Plan(args) => match plan::run(&args) {
            Ok(()) => std::process::ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("kvd-bench plan: {e}");
                std::process::ExitCode::FAILURE
            }
        },
        Command::Rtt(args) => match rtt::run(&args) {
            Ok(()) => std::process::ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("kvd-bench rtt: {e}");
                std::process::ExitCode::FAILURE
            }
        },
        Command::TransferTarget(args) => match transfer::target(&args) {
            Ok(()) => std::process::ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("kvd-bench transfer-target: {e}");
                std::process::ExitCode::FAILURE
            }
        },
    }
}
