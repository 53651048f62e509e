//! The `lily-bench` command line: one subcommand per benchmark program (their shared
//! arguments are in [`crate::args`]).

use std::pin::Pin;
use std::process::ExitCode;

use clap::{Parser, Subcommand};

/// Lily's benchmarks against a private RabbitMQ node; run them through `scripts/bench.sh`.
#[derive(Parser)]
#[command(name = "lily-bench")]
struct Cli {
    #[command(subcommand)]
    command: Program,
}

#[derive(Subcommand)]
enum Program {
    /// Throughput: Lily against raw lapin contenders, the no-ack ceiling and ruststream-lapin.
    Throughput(crate::throughput::cli::Args),
    /// Settlement latency against raw-batch at 50 % and 90 % of the maximum rate.
    Latency(crate::latency::cli::Args),
    /// Failure storm: every delivery fails retryably for minutes; throughput and RSS over time.
    Storm(crate::storm::cli::Args),
    /// Lily's MongoDB scope against a hand-written driver transaction.
    Mongo(crate::mongo::cli::Args),
    /// Per-message cost, memory per delivery, shutdown latency and the hostile load.
    Cost(crate::cost::cli::Args),
    /// Lily and raw lapin on a three-node cluster beside one node.
    Cluster(crate::cluster::Args),
}

/// Parses the command line and runs the benchmark it names. `counting` says whether this
/// process counts its heap allocations (the `lily-bench-counting` binary): `cost` always runs
/// there, re-executing itself when it is not.
pub fn main(counting: bool) -> ExitCode {
    let program: Pin<Box<dyn Future<Output = ()>>> = match Cli::parse().command {
        Program::Throughput(args) => Box::pin(crate::throughput::cli::run(args)),
        Program::Latency(args) => Box::pin(crate::latency::cli::run(args)),
        Program::Storm(args) => Box::pin(crate::storm::cli::run(args)),
        Program::Mongo(args) => Box::pin(crate::mongo::cli::run(args)),
        Program::Cluster(args) => Box::pin(crate::cluster::run(args)),
        Program::Cost(args) if counting => return crate::cost::cli::main(args),
        Program::Cost(_) => return in_counting_binary(),
    };
    crate::runtime(true).block_on(program);
    ExitCode::SUCCESS
}

/// Runs this command line again in `lily-bench-counting`, beside this executable.
fn in_counting_binary() -> ExitCode {
    let exe = std::env::current_exe().expect("current_exe");
    let counted = exe.with_file_name("lily-bench-counting");
    match std::process::Command::new(&counted)
        .args(std::env::args_os().skip(1))
        .status()
    {
        Ok(status) if status.success() => ExitCode::SUCCESS,
        Ok(_) => ExitCode::FAILURE,
        Err(err) => {
            eprintln!("cost runs in {}: {err}", counted.display());
            ExitCode::FAILURE
        }
    }
}
