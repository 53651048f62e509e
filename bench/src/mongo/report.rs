//! Results of the Mongo scope benchmark: the machine-readable file, the human table, the
//! markdown table and the SVG chart (median msgs/s per contender, one panel per case).

use std::fmt::Write as _;

use serde::Serialize;

use crate::mongo::db::Ops;
use crate::mongo::{Case, Contender, Run, TARGET};
use crate::throughput::report::rate;
use crate::{escape, median, nice_axis};

/// Everything one benchmark run measured.
#[derive(Debug, Serialize)]
pub struct Results {
    pub benchmark: &'static str,
    pub broker: String,
    pub broker_url: String,
    pub mongodb: String,
    pub mongodb_url: String,
    pub queue_type: &'static str,
    pub message_bytes: usize,
    pub repetitions: u32,
    pub cpus: usize,
    pub started_at_unix: u64,
    /// `git describe --always --dirty` of the tree the benchmark ran in.
    pub lily_revision: String,
    /// 1-minute load average when the run started and when it ended (the machine is shared).
    pub load_average: [Option<f64>; 2],
    pub wall_secs: f64,
    pub notes: Vec<String>,
    pub cases: Vec<CaseResult>,
}

/// One case, every contender's runs and medians.
#[derive(Debug, Serialize)]
pub struct CaseResult {
    pub case: Case,
    pub messages_per_run: u64,
    pub concurrency: usize,
    pub prefetch: u16,
    pub contenders: Vec<ContenderResult>,
}

/// One contender in one case.
#[derive(Debug, Serialize)]
pub struct ContenderResult {
    pub contender: Contender,
    pub median_msgs_per_sec: f64,
    /// This contender's median over the raw contender's (Lily only).
    pub over_raw: Option<f64>,
    /// The target of `over_raw` (the scope case only).
    pub over_raw_target: Option<f64>,
    pub over_raw_met: Option<bool>,
    /// Median transaction attempts (raw) or handler runs (Lily) per message.
    pub attempts_per_msg: f64,
    /// Median transient transaction errors seen per message.
    pub conflicts_per_msg: f64,
    /// Valid messages found in the DLQ or the parking lane, all runs together (must be 0).
    pub dead_lettered_or_parked: u64,
    /// Every run passed its checks by message id.
    pub all_verified: bool,
    /// Every run settled all its messages within the limit.
    pub all_complete: bool,
    /// Median CPU µs per message: this process, the broker's VM, mongod.
    pub client_cpu_us_per_msg: Option<f64>,
    pub broker_cpu_us_per_msg: Option<f64>,
    pub mongod_cpu_us_per_msg: Option<f64>,
    /// Median mongod operations per message, by kind.
    pub mongod_ops_per_msg: Option<Ops>,
    pub runs: Vec<Run>,
}

impl ContenderResult {
    pub fn new(contender: Contender, runs: Vec<Run>) -> Self {
        let med = |f: &dyn Fn(&Run) -> Option<f64>| {
            let mut v: Vec<f64> = runs.iter().filter_map(f).collect();
            (!v.is_empty()).then(|| median(&mut v))
        };
        #[allow(clippy::cast_precision_loss)]
        let per_msg = |count: u64, run: &Run| count as f64 / run.sample.expected.max(1) as f64;
        Self {
            contender,
            median_msgs_per_sec: med(&|r| Some(r.sample.msgs_per_sec)).unwrap_or(f64::NAN),
            over_raw: None,
            over_raw_target: None,
            over_raw_met: None,
            attempts_per_msg: med(&|r| Some(per_msg(r.observed.attempts, r))).unwrap_or(f64::NAN),
            conflicts_per_msg: med(&|r| Some(per_msg(r.observed.conflicts, r))).unwrap_or(f64::NAN),
            dead_lettered_or_parked: runs
                .iter()
                .map(|r| r.check.dead_lettered + r.check.parked)
                .sum(),
            all_verified: runs.iter().all(|r| r.check.passed),
            all_complete: runs.iter().all(|r| r.sample.complete),
            client_cpu_us_per_msg: med(&|r| r.sample.client_cpu_us_per_msg),
            broker_cpu_us_per_msg: med(&|r| r.sample.broker_cpu_us_per_msg),
            mongod_cpu_us_per_msg: med(&|r| r.mongod_cpu_us_per_msg),
            mongod_ops_per_msg: med(&|r| r.mongod_ops_per_msg.map(|o| o.insert)).map(|insert| {
                let m = |f: fn(&Ops) -> f64| med(&|r| r.mongod_ops_per_msg.as_ref().map(f));
                Ops {
                    insert,
                    query: m(|o| o.query).unwrap_or(f64::NAN),
                    update: m(|o| o.update).unwrap_or(f64::NAN),
                    delete: m(|o| o.delete).unwrap_or(f64::NAN),
                    getmore: m(|o| o.getmore).unwrap_or(f64::NAN),
                    command: m(|o| o.command).unwrap_or(f64::NAN),
                }
            }),
            runs,
        }
    }
}

impl CaseResult {
    /// Computes the ratios to the raw contender, when it ran.
    pub fn new(
        case: Case,
        messages_per_run: u64,
        concurrency: usize,
        prefetch: u16,
        mut contenders: Vec<ContenderResult>,
    ) -> Self {
        let raw = contenders
            .iter()
            .find(|c| c.contender == Contender::Raw)
            .map(|c| c.median_msgs_per_sec);
        for c in contenders
            .iter_mut()
            .filter(|c| c.contender != Contender::Raw)
        {
            c.over_raw = raw.map(|r| c.median_msgs_per_sec / r);
            // The target is the default scope's, the like-for-like one: the lease is an
            // opt-in for effects outside the database, which the raw contender does not guard.
            if case == Case::Scope && c.contender == Contender::Lily {
                c.over_raw_target = c.over_raw.map(|_| TARGET);
                c.over_raw_met = c.over_raw.map(|r| r >= TARGET);
            }
        }
        Self {
            case,
            messages_per_run,
            concurrency,
            prefetch,
            contenders,
        }
    }
}

fn opt(value: Option<f64>) -> String {
    value.map_or_else(|| "-".into(), |v| format!("{v:.1}"))
}

fn ratio(c: &ContenderResult) -> (String, String, String) {
    let r = c.over_raw.map_or_else(|| "-".into(), |r| format!("{r:.3}"));
    let t = c
        .over_raw_target
        .map_or_else(|| "-".into(), |t| format!(">= {t:.2}"));
    let m = match c.over_raw_met {
        Some(true) => "yes",
        Some(false) => "NO",
        None => "-",
    };
    (r, t, m.into())
}

fn header_lines(results: &Results) -> Vec<String> {
    vec![
        format!("Broker: {} on {}", results.broker, results.broker_url),
        format!("Database: {} on {}", results.mongodb, results.mongodb_url),
        format!(
            "Queue: {}; {}-byte JSON orders, persistent, pre-published; {} repetition(s) alternating the contenders; medians; {} CPU(s)",
            results.queue_type, results.message_bytes, results.repetitions, results.cpus
        ),
        format!(
            "Lily {}; load average {} at start, {} at end; {:.0} s",
            results.lily_revision,
            results.load_average[0].map_or_else(|| "?".into(), |l| format!("{l:.2}")),
            results.load_average[1].map_or_else(|| "?".into(), |l| format!("{l:.2}")),
            results.wall_secs
        ),
    ]
}

/// The human table printed to stdout.
pub fn human(results: &Results) -> String {
    let mut out = String::new();
    for line in header_lines(results) {
        let _ = writeln!(out, "{line}");
    }
    let _ = writeln!(
        out,
        "{:<9} {:>6} {:>5} {:>5} {:<16} {:>9} {:>8} {:>8} {:>4} {:>9} {:>9} {:>7} {:>8} {:>7} {:>7} {:>7}",
        "case",
        "N",
        "conc",
        "pref",
        "contender",
        "msg/s",
        "vs raw",
        "target",
        "met",
        "tries/msg",
        "confl/msg",
        "DLQ+park",
        "verified",
        "cli µs",
        "mdb µs",
        "brk µs"
    );
    for case in &results.cases {
        for c in &case.contenders {
            let (r, t, m) = ratio(c);
            let _ = writeln!(
                out,
                "{:<9} {:>6} {:>5} {:>5} {:<16} {:>9} {r:>8} {t:>8} {m:>4} {:>9.3} {:>9.3} {:>7} {:>8} {:>7} {:>7} {:>7}{}",
                case.case.name(),
                case.messages_per_run,
                case.concurrency,
                case.prefetch,
                c.contender.name(),
                rate(c.median_msgs_per_sec),
                c.attempts_per_msg,
                c.conflicts_per_msg,
                c.dead_lettered_or_parked,
                if c.all_verified { "yes" } else { "NO" },
                opt(c.client_cpu_us_per_msg),
                opt(c.mongod_cpu_us_per_msg),
                opt(c.broker_cpu_us_per_msg),
                if c.all_complete {
                    ""
                } else {
                    "  (incomplete runs!)"
                },
            );
        }
    }
    let _ = writeln!(
        out,
        "\nmongod operations per message (median; serverStatus.opcounters over the run):"
    );
    let _ = writeln!(
        out,
        "{:<9} {:<18} {:>7} {:>7} {:>7} {:>7} {:>8} {:>7}",
        "case", "contender", "insert", "update", "query", "delete", "command", "total"
    );
    for case in &results.cases {
        for c in &case.contenders {
            let Some(o) = &c.mongod_ops_per_msg else {
                continue;
            };
            let _ = writeln!(
                out,
                "{:<9} {:<18} {:>7.2} {:>7.2} {:>7.2} {:>7.2} {:>8.2} {:>7.2}",
                case.case.name(),
                c.contender.name(),
                o.insert,
                o.update,
                o.query,
                o.delete,
                o.command,
                o.total()
            );
        }
    }
    for line in verdicts(results) {
        let _ = writeln!(out, "{line}");
    }
    for note in &results.notes {
        let _ = writeln!(out, "Note: {note}");
    }
    out
}

/// One line per requirement: the scope ratios, no valid message dead-lettered, every run
/// verified.
pub fn verdicts(results: &Results) -> Vec<String> {
    let mut lines = Vec::new();
    for case in &results.cases {
        for c in &case.contenders {
            if let (Some(r), Some(t), Some(met)) = (c.over_raw, c.over_raw_target, c.over_raw_met) {
                lines.push(format!(
                    "{}: {} / raw driver = {r:.3} (target >= {t:.2}): {}",
                    case.case.name(),
                    c.contender.name(),
                    if met { "met" } else { "MISSED" }
                ));
            }
        }
        let dead: u64 = case
            .contenders
            .iter()
            .map(|c| c.dead_lettered_or_parked)
            .sum();
        let verified = case.contenders.iter().all(|c| c.all_verified);
        lines.push(format!(
            "{}: valid messages dead-lettered or parked: {dead} (required 0): {}; every run verified by message id: {}",
            case.case.name(),
            if dead == 0 { "met" } else { "MISSED" },
            if verified { "yes" } else { "NO" },
        ));
    }
    lines
}

/// The markdown table.
pub fn markdown(results: &Results) -> String {
    let mut out = String::new();
    for line in header_lines(results) {
        let _ = writeln!(out, "{line}  ");
    }
    let _ = writeln!(out);
    let _ = writeln!(
        out,
        "| case | N | concurrency | prefetch | contender | msgs/s | / raw | target | tries/msg | conflicts/msg | DLQ + parked | verified | client µs/msg | mongod µs/msg | broker µs/msg |"
    );
    let _ = writeln!(
        out,
        "|---|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|"
    );
    for case in &results.cases {
        for c in &case.contenders {
            let (r, t, m) = ratio(c);
            let target = if t == "-" {
                t
            } else {
                format!("{} ({m})", t.replace(">=", "≥"))
            };
            let _ = writeln!(
                out,
                "| {} | {} | {} | {} | {} | {} | {r} | {target} | {:.3} | {:.3} | {} | {} | {} | {} | {} |",
                case.case.name(),
                case.messages_per_run,
                case.concurrency,
                case.prefetch,
                c.contender.name(),
                rate(c.median_msgs_per_sec),
                c.attempts_per_msg,
                c.conflicts_per_msg,
                c.dead_lettered_or_parked,
                if c.all_verified { "yes" } else { "**no**" },
                opt(c.client_cpu_us_per_msg),
                opt(c.mongod_cpu_us_per_msg),
                opt(c.broker_cpu_us_per_msg),
            );
        }
    }
    let _ = writeln!(out);
    let _ = writeln!(
        out,
        "mongod operations per message (median; `serverStatus.opcounters` over the run):"
    );
    let _ = writeln!(out);
    let _ = writeln!(
        out,
        "| case | contender | insert | update | query | delete | command | total |"
    );
    let _ = writeln!(out, "|---|---|---:|---:|---:|---:|---:|---:|");
    for case in &results.cases {
        for c in &case.contenders {
            if let Some(o) = &c.mongod_ops_per_msg {
                let _ = writeln!(
                    out,
                    "| {} | {} | {:.2} | {:.2} | {:.2} | {:.2} | {:.2} | {:.2} |",
                    case.case.name(),
                    c.contender.name(),
                    o.insert,
                    o.update,
                    o.query,
                    o.delete,
                    o.command,
                    o.total()
                );
            }
        }
    }
    let _ = writeln!(out);
    for line in verdicts(results) {
        let _ = writeln!(out, "- {line}");
    }
    let _ = writeln!(out);
    for note in &results.notes {
        let _ = writeln!(out, "- {note}");
    }
    out
}

fn color(who: Contender) -> &'static str {
    match who {
        Contender::Raw => "#8c8c8c",
        Contender::Lily => "#c2185b",
        Contender::LilyLease => "#f48fb1",
        Contender::RawLilyRecord => "#bdbdbd",
    }
}

/// Bars of median msgs/s, one panel per case.
pub fn svg(results: &Results) -> String {
    let width = 760.0;
    let panel_h = 260.0;
    let top = 80.0;
    let gap = 80.0;
    #[allow(clippy::cast_precision_loss)]
    let height = top + (panel_h + gap) * results.cases.len() as f64;
    let mut s = String::new();
    let _ = writeln!(
        s,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" viewBox="0 0 {width} {height}" font-family="sans-serif" font-size="12">"#
    );
    let _ = writeln!(
        s,
        r#"<rect width="100%" height="100%" fill="white"/><text x="{}" y="24" text-anchor="middle" font-size="16" font-weight="bold">Mongo scope (median msgs/s): raw lapin + mongodb vs Lily</text>"#,
        width / 2.0
    );
    let _ = writeln!(
        s,
        r##"<text x="{}" y="44" text-anchor="middle" fill="#555">{} · {} · {} queue, {}-byte JSON, {} repetition(s)</text>"##,
        width / 2.0,
        escape(&results.broker),
        escape(&results.mongodb),
        results.queue_type,
        results.message_bytes,
        results.repetitions
    );
    let shown: Vec<Contender> = Contender::ALL
        .into_iter()
        .filter(|who| {
            results
                .cases
                .iter()
                .any(|c| c.contenders.iter().any(|r| r.contender == *who))
        })
        .collect();
    #[allow(clippy::cast_precision_loss)]
    let mut lx = width - 135.0 * shown.len() as f64 - 10.0;
    for who in shown {
        let _ = writeln!(
            s,
            r#"<rect x="{lx}" y="56" width="12" height="12" fill="{}"/><text x="{}" y="66">{}</text>"#,
            color(who),
            lx + 16.0,
            who.name()
        );
        lx += 135.0;
    }
    for (i, case) in results.cases.iter().enumerate() {
        #[allow(clippy::cast_precision_loss)]
        let y0 = top + (panel_h + gap) * i as f64 + 30.0;
        panel(&mut s, case, 80.0, y0, width - 110.0, panel_h - 40.0);
    }
    s.push_str("</svg>\n");
    s
}

fn panel(s: &mut String, case: &CaseResult, x0: f64, y0: f64, w: f64, h: f64) {
    let max = case
        .contenders
        .iter()
        .map(|c| c.median_msgs_per_sec)
        .filter(|v| v.is_finite())
        .fold(0.0_f64, f64::max);
    let (step, top) = nice_axis(max, (100.0, 500.0));
    let title = match case.case {
        Case::Scope => format!(
            "Scope: inbox record + one effect insert per transaction, concurrency {}, prefetch {}",
            case.concurrency, case.prefetch
        ),
        Case::HotKeys => format!(
            "Hot keys: + $inc on one of 5 counters, concurrency {}, prefetch {}",
            case.concurrency, case.prefetch
        ),
    };
    let _ = writeln!(
        s,
        r#"<text x="{x0}" y="{}" font-size="14" font-weight="bold">{}</text>"#,
        y0 - 10.0,
        escape(&title)
    );
    crate::grid(s, (x0, y0, w, h), step, top, rate);
    if case.contenders.is_empty() {
        return;
    }
    #[allow(clippy::cast_precision_loss)]
    let slot = w / case.contenders.len() as f64;
    let bar_w = (slot * 0.6).min(90.0);
    for (i, c) in case.contenders.iter().enumerate() {
        let v = if c.median_msgs_per_sec.is_finite() {
            c.median_msgs_per_sec
        } else {
            0.0
        };
        let bh = v / top * h;
        #[allow(clippy::cast_precision_loss)]
        let x = x0 + slot * i as f64 + (slot - bar_w) / 2.0;
        let y = y0 + h - bh;
        let _ = writeln!(
            s,
            r#"<rect x="{x:.1}" y="{y:.1}" width="{bar_w:.1}" height="{bh:.1}" fill="{}"><title>{}: {} msgs/s</title></rect><text x="{:.1}" y="{:.1}" text-anchor="middle" font-size="11">{}</text>"#,
            color(c.contender),
            c.contender.name(),
            rate(v),
            x + bar_w / 2.0,
            y - 4.0,
            rate(v)
        );
        let mut label = c.contender.name().to_owned();
        if let Some(r) = c.over_raw {
            let _ = write!(label, " · {r:.2}× raw");
        }
        let _ = writeln!(
            s,
            r#"<text x="{:.1}" y="{:.1}" text-anchor="middle">{}</text>"#,
            x + bar_w / 2.0,
            y0 + h + 18.0,
            escape(&label)
        );
    }
}
