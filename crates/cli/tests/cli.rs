//! Runs the `lily` binary on report files written to a temporary directory.

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};

use lily_mq_core::transport::Evidence;
use lily_mq_core::{
    EXIT_UNRESOLVED, Incidents, OutboxReport, Phase, PhaseTiming, SCHEMA, ShutdownReport, Totals,
    Trigger, UnresolvedDelivery,
};

/// A temporary directory removed on drop.
struct TempDir(PathBuf);

impl TempDir {
    fn new(test: &str) -> Self {
        static NEXT: AtomicU32 = AtomicU32::new(0);
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let dir = std::env::temp_dir().join(format!("lily-cli-{}-{test}-{n}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("create temp dir");
        Self(dir)
    }

    fn write(&self, name: &str, contents: &str) -> PathBuf {
        let path = self.0.join(name);
        std::fs::write(&path, contents).expect("write report");
        path
    }

    fn report(&self, name: &str, report: &ShutdownReport) -> PathBuf {
        self.write(
            name,
            &serde_json::to_string_pretty(report).expect("serialize"),
        )
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A report with `acked` acks and these unresolved message ids.
fn report(acked: u64, unresolved: &[&str]) -> ShutdownReport {
    let unresolved: Vec<UnresolvedDelivery> = unresolved
        .iter()
        .enumerate()
        .map(|(tag, id)| UnresolvedDelivery {
            queue: "orders".into(),
            message_id: Some((*id).into()),
            delivery_tag: tag as u64 + 41,
            attempt: 2,
            redelivered: true,
            last_evidence: Evidence::SettleWritten,
            handoff_confirmed_to: Some("orders.retry.5s".into()),
            reason: "ack written; channel closed before a round trip confirmed it".into(),
        })
        .collect();
    ShutdownReport {
        handoffs_refused_for: None,
        outbox: None,
        schema: SCHEMA.into(),
        queue: "orders".into(),
        trigger: Some(Trigger::Sigterm),
        forced: false,
        phases: vec![
            PhaseTiming {
                phase: Phase::Draining,
                start_ms: 0,
                duration_ms: 1500,
            },
            PhaseTiming {
                phase: Phase::Closed,
                start_ms: 1500,
                duration_ms: 20,
            },
        ],
        budget_ms: 25_000,
        budget_used_ms: 1520,
        totals: Totals {
            acked,
            retried: 3,
            dead_lettered: 1,
            acks_confirmed: acked,
            unresolved: unresolved.len() as u64,
            ..Totals::default()
        },
        clean: unresolved.is_empty(),
        unresolved,
        unresolved_overflow: 0,
        incidents: Incidents::default(),
        error: None,
    }
}

fn lily(args: &[&Path]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_lily"))
        .args(args)
        .stdin(Stdio::null())
        .output()
        .expect("run lily")
}

fn stdout(out: &Output) -> String {
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

fn p(s: &str) -> &Path {
    Path::new(s)
}

#[test]
fn show_of_a_clean_report_exits_zero_and_shows_totals() {
    let dir = TempDir::new("show-clean");
    let file = dir.report("clean.json", &report(120, &[]));
    let out = lily(&[p("report"), p("show"), &file]);
    let text = stdout(&out);
    assert_eq!(out.status.code(), Some(0), "{text}{}", stderr(&out));
    assert!(text.contains("status   clean"), "{text}");
    assert!(text.contains("trigger  sigterm"), "{text}");
    assert!(text.contains("1520 ms used of 25000 ms"), "{text}");
    assert!(
        text.contains("  draining         0         1500\n"),
        "{text}"
    );
    assert!(text.contains("  acked                  120\n"), "{text}");
    assert!(text.contains("  acks_uncertain           0\n"), "{text}");
    assert!(text.contains("unresolved: 0 listed"), "{text}");
}

#[test]
fn show_counts_what_the_outbox_left_staged_and_stays_clean() {
    let dir = TempDir::new("show-outbox");
    let mut r = report(12, &[]);
    r.outbox = Some(OutboxReport {
        outbox: "outbox".into(),
        sent: 40,
        failed: 2,
        staged: Some(7),
    });
    let file = dir.report("outbox.json", &r);
    let out = lily(&[p("report"), p("show"), &file]);
    let text = stdout(&out);
    assert_eq!(out.status.code(), Some(0), "{text}{}", stderr(&out));
    assert!(
        text.contains("outbox outbox: 40 sent, 2 failed, 7 still staged"),
        "{text}"
    );
}

#[test]
fn show_of_an_unresolved_report_exits_3_and_lists_the_message_id() {
    let dir = TempDir::new("show-unresolved");
    let mut r = report(10, &["order-7"]);
    r.unresolved_overflow = 4;
    let file = dir.report("bad.json", &r);
    let out = lily(&[p("report"), p("show"), &file]);
    let text = stdout(&out);
    assert_eq!(out.status.code(), Some(EXIT_UNRESOLVED), "{text}");
    assert!(text.contains("status   UNRESOLVED"), "{text}");
    assert!(
        text.contains("unresolved: 1 listed, 4 more not listed"),
        "{text}"
    );
    let row = text
        .lines()
        .find(|l| l.contains("order-7"))
        .expect("order-7 listed");
    for cell in [
        "41",
        "yes",
        "settle_written",
        "orders.retry.5s",
        "ack written",
    ] {
        assert!(row.contains(cell), "{row}");
    }
}

#[test]
fn show_reads_stdin_for_dash() {
    let json = serde_json::to_string(&report(5, &[])).expect("serialize");
    let mut child = Command::new(env!("CARGO_BIN_EXE_lily"))
        .args(["report", "show", "-"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("run lily");
    std::io::Write::write_all(&mut child.stdin.take().expect("stdin"), json.as_bytes())
        .expect("write stdin");
    let out = child.wait_with_output().expect("wait");
    assert_eq!(out.status.code(), Some(0));
    assert!(stdout(&out).contains("== <stdin> =="));
}

#[test]
fn summary_sums_totals_across_reports_and_lists_repeated_ids() {
    let dir = TempDir::new("summary");
    let a = dir.report("a.json", &report(100, &["order-1", "order-2"]));
    let b = dir.report("b.json", &report(50, &["order-2"]));
    let out = lily(&[p("report"), p("summary"), &a, &b]);
    let text = stdout(&out);
    assert_eq!(out.status.code(), Some(EXIT_UNRESOLVED), "{text}");
    let total = text
        .lines()
        .find(|l| l.starts_with("TOTAL"))
        .expect("TOTAL line");
    let cells: Vec<&str> = total.split_whitespace().collect();
    // TOTAL, "0/2", "clean", used, acked, retried, dead-lettered, unresolved
    assert_eq!(
        cells,
        ["TOTAL", "0/2", "clean", "3040", "150", "6", "2", "3"],
        "{text}"
    );
    assert!(
        text.contains("summed totals: acked=150 retried=6 dead_lettered=2"),
        "{text}"
    );
    let repeated = text
        .lines()
        .find(|l| l.contains("order-2") && l.contains("a.json") && l.contains("b.json"));
    assert!(repeated.is_some(), "{text}");
    assert!(!text.lines().any(|l| l.contains("order-1")), "{text}");
}

#[test]
fn summary_of_clean_reports_exits_zero() {
    let dir = TempDir::new("summary-clean");
    let a = dir.report("a.json", &report(1, &[]));
    let b = dir.report("b.json", &report(2, &[]));
    let out = lily(&[p("report"), p("summary"), &a, &b]);
    assert_eq!(out.status.code(), Some(0), "{}", stdout(&out));
    assert!(stdout(&out).contains("no message id is unresolved in more than one report"));
}

#[test]
fn diff_shows_signed_differences_and_ids_only_in_b() {
    let dir = TempDir::new("diff");
    let a = dir.report("a.json", &report(100, &["order-1", "order-2"]));
    let mut rb = report(40, &["order-2", "order-3"]);
    rb.totals.retried = 5;
    let b = dir.report("b.json", &rb);
    let out = lily(&[p("report"), p("diff"), &a, &b]);
    let text = stdout(&out);
    assert_eq!(out.status.code(), Some(0), "{text}{}", stderr(&out));
    let row = |field: &str| -> Vec<String> {
        let line = text
            .lines()
            .find(|l| l.split_whitespace().next() == Some(field))
            .unwrap_or_else(|| panic!("{field} row in {text}"));
        line.split_whitespace().map(String::from).collect()
    };
    assert_eq!(row("acked"), ["acked", "100", "40", "-60"]);
    assert_eq!(row("retried"), ["retried", "3", "5", "+2"]);
    assert_eq!(row("parked"), ["parked", "0", "0", "0"]);
    assert_eq!(row("draining"), ["draining", "0", "1500", "0", "1500"]);
    let after = |title: &str| -> Vec<String> {
        let start = text
            .find(title)
            .unwrap_or_else(|| panic!("{title} in {text}"));
        text[start..]
            .lines()
            .skip(1)
            .take_while(|l| l.starts_with("  "))
            .map(|l| l.trim().to_owned())
            .collect()
    };
    assert_eq!(after("unresolved only in A (1):"), ["order-1"]);
    assert_eq!(after("unresolved only in B (1):"), ["order-3"]);
    assert_eq!(after("unresolved in both (1):"), ["order-2"]);
}

#[test]
fn a_malformed_file_exits_1_naming_the_file_without_printing_it() {
    let dir = TempDir::new("malformed");
    let file = dir.write("broken.json", "{\n  \"schema\": \"hunter2-secret\"\n  oops");
    let out = lily(&[p("report"), p("show"), &file]);
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("broken.json"), "{err}");
    assert!(err.contains("line 3, column 3"), "{err}");
    assert!(!err.contains("hunter2"), "{err}");
    assert!(stdout(&out).is_empty());
}

#[test]
fn a_mistyped_value_is_located_but_not_quoted() {
    let dir = TempDir::new("mistyped");
    let mut value = serde_json::to_value(report(1, &[])).expect("to value");
    value["totals"]["acked"] = "hunter2-secret".into();
    let file = dir.write(
        "typed.json",
        &serde_json::to_string_pretty(&value).expect("json"),
    );
    let out = lily(&[p("report"), p("summary"), &file]);
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("typed.json"), "{err}");
    assert!(err.contains("invalid type, expected u64"), "{err}");
    assert!(!err.contains("hunter2"), "{err}");
}

#[test]
fn a_missing_file_exits_1_naming_it() {
    let dir = TempDir::new("missing");
    let out = lily(&[p("report"), p("show"), &dir.0.join("nope.json")]);
    assert_eq!(out.status.code(), Some(1));
    assert!(stderr(&out).contains("nope.json: cannot read"));
}

#[test]
fn a_report_with_another_schema_is_refused() {
    let dir = TempDir::new("schema");
    let mut r = report(1, &[]);
    r.schema = "lily.shutdown-report.v2".into();
    let file = dir.report("v2.json", &r);
    let out = lily(&[p("report"), p("show"), &file]);
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.contains("v2.json: unsupported report schema \"lily.shutdown-report.v2\""),
        "{err}"
    );
    let other = dir.write("other.json", r#"{"hello": "world"}"#);
    let out = lily(&[p("report"), p("show"), &other]);
    assert_eq!(out.status.code(), Some(1));
    assert!(stderr(&out).contains("not a Lily shutdown report"));
}

#[test]
fn usage_errors_print_usage_on_stderr_and_exit_2() {
    for args in [
        &[][..],
        &["frobnicate"],
        &["report", "show"],
        &["report", "diff", "a.json"],
        &["report", "show", "--verbose", "a.json"],
        &["dlq", "replay", "-q", "orders"],
        &["dlq", "replay", "-q", "orders", "--all", "--id", "x"],
        &["parking", "list"],
        &["dlq", "replay", "-q", "orders", "--since", "yesterday"],
    ] {
        let args: Vec<&Path> = args.iter().map(|a| p(a)).collect();
        let out = lily(&args);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {}", stderr(&out));
        assert!(
            stderr(&out).contains("Usage:") || stderr(&out).contains("--help"),
            "{args:?}: {}",
            stderr(&out)
        );
        assert!(stdout(&out).is_empty(), "{args:?}");
    }
}

#[test]
fn every_subcommand_has_help_and_completions_are_generated() {
    for (args, expect) in [
        (&["--help"][..], "Usage: lily"),
        (&["report", "show", "--help"], "Report files"),
        (&["dlq", "list", "--help"], "--queue"),
        (&["dlq", "show", "--help"], "--body"),
        (&["dlq", "replay", "--help"], "--dry-run"),
        (&["parking", "replay", "--help"], "--keep-user-id-aside"),
        (&["parking", "purge", "--help"], "--yes"),
        (&["completions", "bash"], "_lily"),
    ] {
        let args: Vec<&Path> = args.iter().map(|a| p(a)).collect();
        let out = lily(&args);
        assert_eq!(out.status.code(), Some(0), "{args:?}");
        assert!(stdout(&out).contains(expect), "{args:?}: {}", stdout(&out));
    }
}

#[test]
fn help_never_shows_the_url_from_the_environment() {
    let out = Command::new(env!("CARGO_BIN_EXE_lily"))
        .args(["dlq", "list", "--help"])
        .env("LILY_AMQP_URL", "amqp://ops:hunter2@example:5672/%2f")
        .output()
        .expect("run lily");
    assert_eq!(out.status.code(), Some(0));
    assert!(stdout(&out).contains("LILY_AMQP_URL"));
    assert!(!stdout(&out).contains("hunter2"), "{}", stdout(&out));
}
