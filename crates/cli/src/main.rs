//! `lily`: reads the shutdown reports Lily services write and renders, sums or compares them.
//!
//! ```text
//! lily report show FILE...      each report as readable text
//! lily report summary FILE...   one line per report, a TOTAL line, repeatedly unresolved ids
//! lily report diff A B          B minus A
//! ```
//!
//! `-` reads standard input. Exit status: 0 all reports clean, 1 an input could not be read or
//! parsed, 2 usage, [`EXIT_UNRESOLVED`] some report is unresolved (`show` and `summary`).

mod loaded;
mod render;
mod summary;

use std::ffi::{OsStr, OsString};
use std::io::{self, Read, Write};
use std::path::Path;
use std::process::ExitCode;

use lily_mq_core::{EXIT_UNRESOLVED, SCHEMA, ShutdownReport};
use serde_json::{Value, error::Category};

use crate::loaded::Loaded;

/// Printed on stderr for `--help` and any usage error.
const USAGE: &str = "\
usage: lily report show FILE...
       lily report summary FILE...
       lily report diff A B

Reads Lily shutdown reports (JSON, schema lily.shutdown-report.v1). `-` reads stdin.

  show     each report: header, phases, totals, unresolved deliveries
  summary  one line per report, a TOTAL line, message ids unresolved in several reports
  diff     totals of B minus A, phases side by side, unresolved ids only in A / only in B / both

exit status: 0 all clean, 1 unreadable or invalid input, 2 usage, 3 some report unresolved
";

/// Exit status when an input cannot be read or parsed.
const EXIT_INPUT: u8 = 1;
/// Exit status for a usage error.
const EXIT_USAGE: u8 = 2;

/// A `lily report` subcommand.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Command {
    Show,
    Summary,
    Diff,
}

fn main() -> ExitCode {
    let args: Vec<OsString> = std::env::args_os().skip(1).collect();
    let (command, files) = match parse_args(&args) {
        Ok(parsed) => parsed,
        Err(problem) => {
            if !problem.is_empty() {
                eprintln!("lily: {problem}\n");
            }
            eprint!("{USAGE}");
            return ExitCode::from(EXIT_USAGE);
        }
    };
    let mut reports = Vec::with_capacity(files.len());
    let mut failed = false;
    for file in files {
        match load(file) {
            Ok(loaded) => reports.push(loaded),
            Err(problem) => {
                eprintln!("lily: {problem}");
                failed = true;
            }
        }
    }
    if failed {
        return ExitCode::from(EXIT_INPUT);
    }
    let (text, code) = match (command, reports.as_slice()) {
        (Command::Show, all) => (render::show(all), status(all)),
        (Command::Summary, all) => (summary::summary(all), status(all)),
        (Command::Diff, [a, b]) => (summary::diff(a, b), 0),
        (Command::Diff, _) => return ExitCode::from(EXIT_USAGE),
    };
    match io::stdout().lock().write_all(text.as_bytes()) {
        Ok(()) => ExitCode::from(code),
        Err(e) if e.kind() == io::ErrorKind::BrokenPipe => ExitCode::from(code),
        Err(e) => {
            eprintln!("lily: cannot write output: {e}");
            ExitCode::from(EXIT_INPUT)
        }
    }
}

/// Splits the arguments into a command and its files; `Err` holds the problem (empty for help).
fn parse_args(args: &[OsString]) -> Result<(Command, Vec<&OsStr>), String> {
    let word = |arg: &OsString| arg.to_str().unwrap_or("").to_owned();
    let Some((group, rest)) = args.split_first() else {
        return Err("missing command".into());
    };
    match word(group).as_str() {
        "report" => {}
        "-h" | "--help" | "help" => return Err(String::new()),
        other => return Err(format!("unknown command `{}`", other.escape_debug())),
    }
    let Some((verb, rest)) = rest.split_first() else {
        return Err("missing subcommand of `report`".into());
    };
    let command = match word(verb).as_str() {
        "show" => Command::Show,
        "summary" => Command::Summary,
        "diff" => Command::Diff,
        "-h" | "--help" | "help" => return Err(String::new()),
        other => return Err(format!("unknown subcommand `{}`", other.escape_debug())),
    };
    let mut files = Vec::new();
    let mut options_ended = false;
    for arg in rest {
        if !options_ended && arg == "--" {
            options_ended = true;
        } else if !options_ended && arg != "-" && arg.to_string_lossy().starts_with('-') {
            return Err(format!(
                "unknown option `{}`",
                arg.to_string_lossy().escape_debug()
            ));
        } else {
            files.push(arg.as_os_str());
        }
    }
    match (command, files.len()) {
        (Command::Diff, 2) => Ok((command, files)),
        (Command::Diff, _) => Err("`diff` takes exactly two files".into()),
        (_, 0) => Err("no report file given".into()),
        _ => Ok((command, files)),
    }
}

/// Reads and parses one report; `-` is stdin. The error names the input, never its content.
fn load(arg: &OsStr) -> Result<Loaded, String> {
    let (name, read) = if arg == "-" {
        let mut text = String::new();
        let read = io::stdin().read_to_string(&mut text).map(|_| text);
        ("<stdin>".to_owned(), read)
    } else {
        (
            Path::new(arg).display().to_string(),
            std::fs::read_to_string(arg),
        )
    };
    let text = read.map_err(|e| format!("{name}: cannot read: {e}"))?;
    let report = parse_report(&text).map_err(|problem| format!("{name}: {problem}"))?;
    Ok(Loaded { name, report })
}

/// Parses a report, refusing any schema other than [`SCHEMA`].
fn parse_report(text: &str) -> Result<ShutdownReport, String> {
    let value: Value = serde_json::from_str(text).map_err(|e| describe(&e))?;
    match value.get("schema") {
        Some(Value::String(schema)) if schema == SCHEMA => {}
        Some(Value::String(schema)) => {
            let shown: String = schema.chars().take(64).collect();
            return Err(format!(
                "unsupported report schema {shown:?}; this lily reads only {SCHEMA:?}"
            ));
        }
        _ => {
            return Err(format!(
                "no string \"schema\" field: not a Lily shutdown report (expected {SCHEMA:?})"
            ));
        }
    }
    serde_json::from_str(text).map_err(|e| describe(&e))
}

/// Describes a parse error by its line, column and kind, without quoting input values.
fn describe(e: &serde_json::Error) -> String {
    let full = e.to_string();
    let message = match full.rsplit_once(" at line ") {
        Some((message, _)) if e.line() > 0 => message,
        _ => full.as_str(),
    };
    // Data errors quote the offending value ("invalid type: string \"…\", expected u64");
    // keep only their kind and what was expected.
    let message = match (e.classify(), message.split_once(", expected ")) {
        (Category::Data, Some((head, expected))) => {
            let kind: Vec<&str> = head.split_whitespace().take(2).collect();
            format!(
                "{}, expected {expected}",
                kind.join(" ").trim_end_matches(':')
            )
        }
        _ => message.to_owned(),
    };
    format!(
        "invalid report at line {}, column {}: {message}",
        e.line(),
        e.column()
    )
}

/// 0 when every report is clean, [`EXIT_UNRESOLVED`] otherwise.
fn status(reports: &[Loaded]) -> u8 {
    if reports.iter().all(|l| l.report.clean) {
        0
    } else {
        u8::try_from(EXIT_UNRESOLVED).unwrap_or(EXIT_INPUT)
    }
}
