//! `lily`: renders, sums and compares the shutdown reports Lily services write, and inspects,
//! replays and purges a work queue's dead-letter and parking queues.
//!
//! ```text
//! lily report show FILE...             each report as readable text
//! lily report summary FILE...          one line per report, a TOTAL line, repeated ids
//! lily report diff A B                 B minus A
//! lily dlq list -q QUEUE               the DLQ grouped by reason, failure kind and type
//! lily dlq show -q QUEUE ID            one message's properties and Lily headers
//! lily dlq replay -q QUEUE SELECTION   back to the work queue: confirm, then ACK
//! lily dlq purge -q QUEUE [SELECTION]  delete, after a count and a prompt (or --yes)
//! lily parking ...                     the same for the parking queue
//! lily outbox list -d DB                what an outbox holds, failed ones by reason
//! lily outbox show -d DB ID             one message's records (never the body)
//! lily outbox retry -d DB (ID...|--all-failed)  failed messages staged again
//! lily completions SHELL               shell completions
//! ```
//!
//! Exit status: 0 success (every report clean), 1 an input, the broker or a message could not
//! be read or written, 2 usage, [`EXIT_UNRESOLVED`](lily_mq_core::EXIT_UNRESOLVED) some report
//! is unresolved, 4 some selected messages were left in their lane (see `lily dlq replay`).

mod broker;
mod lanes;
mod loaded;
#[cfg(feature = "outbox")]
mod outbox;
mod outcome;
mod render;
mod report;
mod select;
mod summary;

use std::ffi::OsString;
use std::io::{self, Write};
use std::num::NonZeroU64;
use std::process::ExitCode;

use clap::{CommandFactory, Parser, Subcommand};
use lily_mq_core::Terminal;

use crate::lanes::Target;
use crate::outcome::{EXIT_INPUT, EXIT_USAGE, Outcome};
use crate::select::Selection;

/// Reads Lily shutdown reports, and operates the dead-letter and parking queues of a work queue.
#[derive(Parser)]
#[command(name = "lily", version, propagate_version = true)]
#[command(after_help = "\
exit status: 0 success, 1 unreadable input or a broker error, 2 usage, \
3 some report unresolved, 4 some selected messages left in their lane")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Render, sum or compare shutdown reports (JSON, schema lily.shutdown-report.v1).
    #[command(subcommand)]
    Report(ReportCommand),
    /// Inspect, replay or purge the dead-letter queue (`<queue>.dlq`) of a work queue.
    #[command(subcommand)]
    Dlq(LaneCommand),
    /// Inspect, replay or purge the parking queue (`<queue>.parking`): messages whose effect may
    /// have happened, which Lily never replays on its own.
    #[command(subcommand)]
    Parking(LaneCommand),
    /// Inspect a service's transactional outbox, and stage failed messages again.
    #[cfg(feature = "outbox")]
    #[command(subcommand)]
    Outbox(OutboxCommand),
    /// Print shell completions for `lily` to stdout.
    Completions {
        /// The shell.
        shell: clap_complete::Shell,
    },
}

#[derive(Subcommand)]
enum ReportCommand {
    /// Each report: header, phases, totals, unresolved deliveries.
    Show {
        /// Report files; `-` reads stdin.
        #[arg(required = true)]
        files: Vec<OsString>,
    },
    /// One line per report, a TOTAL line, message ids unresolved in several reports.
    Summary {
        /// Report files; `-` reads stdin.
        #[arg(required = true)]
        files: Vec<OsString>,
    },
    /// Totals of B minus A, phases side by side, unresolved ids only in A, only in B, in both.
    Diff {
        /// The earlier report.
        a: OsString,
        /// The later report.
        b: OsString,
    },
}

#[cfg(feature = "outbox")]
#[derive(Subcommand)]
enum OutboxCommand {
    /// Records by state, the oldest staged one's age, failed ones by reason.
    List {
        #[command(flatten)]
        store: outbox::Store,
    },
    /// Every record of one message id: state, destination, type, body size, times, reason.
    Show {
        #[command(flatten)]
        store: outbox::Store,
        /// The message id.
        id: String,
    },
    /// Stage failed records again, for the relay to publish (after fixing their cause: a
    /// binding, an exchange, a permission).
    Retry {
        #[command(flatten)]
        store: outbox::Store,
        /// The message ids whose failed records to stage again.
        #[arg(required_unless_present = "all_failed")]
        ids: Vec<String>,
        /// Every failed record.
        #[arg(long, conflicts_with = "ids")]
        all_failed: bool,
        /// Say how many would be staged again; change nothing.
        #[arg(long)]
        dry_run: bool,
    },
}

#[derive(Subcommand)]
enum LaneCommand {
    /// Messages grouped by reason, failure kind and type, with counts and oldest/newest age.
    List {
        #[command(flatten)]
        target: Target,
    },
    /// One message's properties and Lily headers; the body only with --body.
    Show {
        #[command(flatten)]
        target: Target,
        /// The message id.
        id: String,
        /// Also print the body (escaped, never by default).
        #[arg(long)]
        body: bool,
    },
    /// Send selected messages back to the work queue: publish with confirm, then ACK here.
    ///
    /// Keeps the body, message_id and properties, restores what Lily moved aside (expiration,
    /// user_id, CC, BCC), resets the attempt and records the replay in x-lily-replayed-*
    /// headers. A crash mid-replay loses nothing: at worst one message exists twice, which an
    /// inbox absorbs.
    Replay {
        #[command(flatten)]
        target: Target,
        #[command(flatten)]
        selection: Selection,
        /// Show what would be replayed; change nothing.
        #[arg(long)]
        dry_run: bool,
        /// Replay at most this many messages, then stop.
        #[arg(long, value_name = "N")]
        batch: Option<NonZeroU64>,
        /// Replay a message whose original user_id is another user's with the user_id left in
        /// x-lily-original-user-id (RabbitMQ refuses a publish whose user_id is not the
        /// publishing user); without it such a message stays in the lane.
        #[arg(long)]
        keep_user_id_aside: bool,
    },
    /// Delete selected messages (--all for every one), after showing the count and asking.
    Purge {
        #[command(flatten)]
        target: Target,
        #[command(flatten)]
        selection: Selection,
        /// Do not ask for confirmation.
        #[arg(short, long)]
        yes: bool,
        /// Show what would be purged; remove nothing.
        #[arg(long)]
        dry_run: bool,
    },
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let outcome = match cli.command {
        Command::Report(command) => {
            let (command, files) = match &command {
                ReportCommand::Show { files } => (report::Command::Show, files.iter().collect()),
                ReportCommand::Summary { files } => {
                    (report::Command::Summary, files.iter().collect())
                }
                ReportCommand::Diff { a, b } => (report::Command::Diff, vec![a, b]),
            };
            let files: Vec<&std::ffi::OsStr> = files.into_iter().map(OsString::as_os_str).collect();
            report::run(command, &files)
        }
        Command::Dlq(command) => lane(Terminal::DeadLetter, command),
        Command::Parking(command) => lane(Terminal::Parking, command),
        #[cfg(feature = "outbox")]
        Command::Outbox(command) => {
            let (store, command) = match command {
                OutboxCommand::List { store } => (store, outbox::Command::List),
                OutboxCommand::Show { store, id } => (store, outbox::Command::Show(id)),
                OutboxCommand::Retry {
                    store,
                    ids,
                    all_failed,
                    dry_run,
                } => (
                    store,
                    outbox::Command::Retry {
                        ids,
                        all_failed,
                        dry_run,
                    },
                ),
            };
            match tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
            {
                Ok(runtime) => runtime.block_on(outbox::run(&store, command)),
                Err(e) => {
                    eprintln!("lily: cannot start: {e}");
                    Outcome::code(EXIT_INPUT)
                }
            }
        }
        Command::Completions { shell } => {
            let mut out = Vec::new();
            clap_complete::generate(shell, &mut Cli::command(), "lily", &mut out);
            Outcome::text(String::from_utf8_lossy(&out).into_owned(), 0)
        }
    };
    match io::stdout().lock().write_all(outcome.stdout.as_bytes()) {
        Ok(()) => ExitCode::from(outcome.code),
        Err(e) if e.kind() == io::ErrorKind::BrokenPipe => ExitCode::from(outcome.code),
        Err(e) => {
            eprintln!("lily: cannot write output: {e}");
            ExitCode::from(EXIT_INPUT)
        }
    }
}

/// Runs a lane command on its own runtime.
fn lane(lane: Terminal, command: LaneCommand) -> Outcome {
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(e) => {
            eprintln!("lily: cannot start: {e}");
            return Outcome::code(EXIT_INPUT);
        }
    };
    let result = runtime.block_on(async {
        match command {
            LaneCommand::List { target } => lanes::list(lane, &target).await,
            LaneCommand::Show { target, id, body } => lanes::show(lane, &target, &id, body).await,
            LaneCommand::Replay {
                target,
                selection,
                dry_run,
                batch,
                keep_user_id_aside,
            } => {
                let options = lanes::ReplayOptions {
                    dry_run,
                    batch,
                    keep_user_id_aside,
                };
                match selection.check() {
                    Ok(filter) => lanes::replay(lane, &target, &filter, &options).await,
                    Err(problem) => Err(outcome::Failure::usage(problem)),
                }
            }
            LaneCommand::Purge {
                target,
                selection,
                yes,
                dry_run,
            } => match selection.check() {
                Ok(filter) => lanes::purge(lane, &target, &filter, yes, dry_run).await,
                Err(problem) => Err(outcome::Failure::usage(problem)),
            },
        }
    });
    result.unwrap_or_else(|failure| {
        eprintln!("lily: {}", failure.message);
        if failure.code == EXIT_USAGE {
            eprintln!("\nFor more information, try '--help'.");
        }
        Outcome::code(failure.code)
    })
}
