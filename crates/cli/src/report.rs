//! `lily report`: reads the shutdown reports Lily services write and renders, sums or compares
//! them.

use std::ffi::OsStr;
use std::io::{self, Read};
use std::path::Path;

use lily_mq_core::{EXIT_UNRESOLVED, SCHEMA, ShutdownReport};
use serde_json::{Value, error::Category};

use crate::loaded::Loaded;
use crate::outcome::{EXIT_INPUT, EXIT_USAGE, Outcome};
use crate::{render, summary};

/// A `lily report` subcommand.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum Command {
    Show,
    Summary,
    Diff,
}

/// Loads every file (`-` is stdin) and runs `command` on them.
pub(crate) fn run(command: Command, files: &[&OsStr]) -> Outcome {
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
        return Outcome::code(EXIT_INPUT);
    }
    match (command, reports.as_slice()) {
        (Command::Show, all) => Outcome::text(render::show(all), status(all)),
        (Command::Summary, all) => Outcome::text(summary::summary(all), status(all)),
        (Command::Diff, [a, b]) => Outcome::text(summary::diff(a, b), 0),
        (Command::Diff, _) => Outcome::code(EXIT_USAGE),
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
