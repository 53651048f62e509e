//! What every program writes: `<name>.json` (its results serialized) and `<name>.md` (printed
//! too), the tables of each program, and the number formats they share.

use std::fmt::Write as _;
use std::path::Path;

use serde::Serialize;
use serde_json::Value;

use crate::latency::{self, HISTOGRAM_MS, Latencies, MaxRate};
use crate::{mongo, storm, throughput};

/// Prints `markdown` and writes `<name>.json` and `<name>.md` into `out`, saying where.
///
/// # Panics
/// When the directory or a file cannot be written.
pub fn write(out: &Path, name: &str, results: &impl Serialize, markdown: &str) {
    println!("\n{markdown}");
    std::fs::create_dir_all(out).expect("create the output directory");
    let json = serde_json::to_string_pretty(results).expect("json") + "\n";
    for (ext, text) in [("json", json.as_str()), ("md", markdown)] {
        let file = out.join(format!("{name}.{ext}"));
        std::fs::write(&file, text).expect("write results");
        println!("wrote {}", file.display());
    }
}

/// A markdown table: the first `text` columns left-aligned, the others right-aligned.
pub struct Table(String);

impl Table {
    pub fn new<S: AsRef<str>>(head: &[S], text: usize) -> Self {
        let mut table = Self(String::new());
        table.row(head);
        let rule: String = (0..head.len())
            .map(|i| if i < text { "---|" } else { "---:|" })
            .collect();
        table.0 += &format!("|{rule}\n");
        table
    }

    pub fn row<S: AsRef<str>>(&mut self, cells: &[S]) {
        let cells: Vec<&str> = cells.iter().map(AsRef::as_ref).collect();
        let _ = writeln!(self.0, "| {} |", cells.join(" | "));
    }

    /// The table and a blank line.
    pub fn end(self) -> String {
        self.0 + "\n"
    }
}

/// `12 345`: a rate rounded, thousands apart; `-` when not finite.
pub fn rate(value: f64) -> String {
    if !value.is_finite() {
        return "-".into();
    }
    group(&format!("{value:.0}"))
}

/// `12345.6` → `12 345.6`.
pub fn group(text: &str) -> String {
    let (sign, rest) = text.strip_prefix('-').map_or(("", text), |r| ("-", r));
    let (int, frac) = rest.split_once('.').map_or((rest, ""), |(i, f)| (i, f));
    let mut out = String::from(sign);
    for (i, c) in int.chars().enumerate() {
        if i > 0 && (int.len() - i).is_multiple_of(3) {
            out.push(' ');
        }
        out.push(c);
    }
    if !frac.is_empty() {
        out = format!("{out}.{frac}");
    }
    out
}

/// `value` with `digits` decimals, or `-`.
pub fn fixed(value: Option<f64>, digits: usize) -> String {
    value.map_or_else(|| "-".into(), |v| format!("{v:.digits$}"))
}

/// `rate` of a value that may be missing.
fn opt_rate(value: Option<f64>) -> String {
    value.map_or_else(|| "-".into(), rate)
}

/// ` [0.931–1.024]`: the lowest and highest of the repetitions' ratios, with two or more.
pub fn spread(runs: &[f64]) -> String {
    if runs.len() < 2 {
        return String::new();
    }
    let lo = runs.iter().copied().fold(f64::INFINITY, f64::min);
    let hi = runs.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    format!(" [{lo:.3}–{hi:.3}]")
}

/// The line every report opens with after its title: revision, load and duration.
fn run_line(meta: &crate::Meta) -> String {
    let (revision, load, wall_secs) = (&meta.lily_revision, meta.load_average, meta.wall_secs);
    let (start, end) = (fixed(load[0], 2), fixed(load[1], 2));
    format!("Lily {revision}; load average {start} at start, {end} at end; {wall_secs:.0} s  \n")
}

/// The notes, one bullet each.
fn notes(out: &mut String, notes: &[String]) {
    for note in notes {
        let _ = writeln!(out, "- {note}");
    }
}

/// `(≥ 1.00 ok)` or `(≥ 1.00 MISS)` for `value` against `target`.
fn verdict(value: f64, target: Option<f64>) -> String {
    match target {
        Some(t) if value >= t => format!(" (≥ {t:.2} ok)"),
        Some(t) => format!(" (≥ {t:.2} MISS)"),
        None => String::new(),
    }
}

/// The throughput report: per path, the rates and Lily's ratios, the steady rates and CPU per
/// message; then each contender's start.
pub fn throughput(r: &throughput::Results) -> String {
    use throughput::{CaseResult, Contender, Path};
    let mut out = format!("Broker: {} on {}  \n", r.meta.broker, r.meta.broker_url);
    let _ = writeln!(
        out,
        "Messages: {} a run, {}-byte JSON, persistent; {} repetition(s), contenders taking turns \
         run by run, in reverse order every other repetition; medians, [lowest–highest] of the \
         repetitions' ratios; {} CPU(s)  ",
        r.messages_per_run, r.meta.message_bytes, r.repetitions, r.meta.cpus
    );
    out += &run_line(&r.meta);
    out.push('\n');
    let key = |c: &CaseResult| {
        [
            c.path.name().into(),
            c.queue_type.into(),
            c.prefetch.to_string(),
        ]
    };
    for path in [Path::Success, Path::Handoff] {
        let cases: Vec<&CaseResult> = r.cases.iter().filter(|c| c.path == path).collect();
        let who: Vec<Contender> = Contender::ALL
            .into_iter()
            .filter(|&w| cases.iter().any(|c| c.runs(w).is_some()))
            .collect();
        if cases.is_empty() {
            continue;
        }
        let others: Vec<Contender> = who
            .iter()
            .copied()
            .filter(|&w| w != Contender::Lily)
            .collect();
        let head = |unit: &str, ratios: bool| {
            let mut head: Vec<String> = vec!["path".into(), "queue".into(), "prefetch".into()];
            head.extend(who.iter().map(|w| format!("{} {unit}", w.name())));
            if ratios {
                head.extend(others.iter().map(|w| format!("Lily / {}", w.name())));
            }
            head
        };
        let mut table = Table::new(&head("msg/s", true), 2);
        for c in &cases {
            let mut cells = key(c).to_vec();
            cells.extend(who.iter().map(|&w| opt_rate(c.median(w))));
            cells.extend(others.iter().map(|&w| {
                c.ratio(w).map_or_else(
                    || "-".into(),
                    |x| {
                        format!(
                            "{:.3}{}{}",
                            x.value,
                            verdict(x.value, x.target),
                            spread(&x.runs)
                        )
                    },
                )
            }));
            if !c.all_runs_complete {
                cells.push("incomplete runs!".into());
            }
            table.row(&cells);
        }
        out += &table.end();
        let steady = |c: &CaseResult, w| c.runs(w).and_then(|x| x.median_steady_msgs_per_sec);
        if cases.iter().any(|c| steady(c, Contender::Lily).is_some()) {
            let _ = writeln!(
                out,
                "Steady rate, {} path (median msg/s from each contender's first delivery until N \
                 are settled: the start, timed on its own below, left out):\n",
                path.name()
            );
            let mut table = Table::new(&head("msg/s", true), 2);
            for c in &cases {
                let mut cells = key(c).to_vec();
                cells.extend(who.iter().map(|&w| opt_rate(steady(c, w))));
                cells.extend(others.iter().map(|&w| match c.ratio(w) {
                    Some(x) if x.steady.is_some() => {
                        let v = x.steady.unwrap_or_default();
                        format!("{v:.3}{}{}", verdict(v, x.target), spread(&x.steady_runs))
                    }
                    _ => "-".into(),
                }));
                table.row(&cells);
            }
            out += &table.end();
        }
        let _ = writeln!(
            out,
            "CPU per message, {} path (median µs, connect to close; client = this process, broker \
             = the Erlang VM):\n",
            path.name()
        );
        let mut head = head("client", false);
        head.extend(who.iter().map(|w| format!("{} broker", w.name())));
        let mut table = Table::new(&head, 2);
        for c in &cases {
            let mut cells = key(c).to_vec();
            let runs = |w| c.runs(w);
            cells.extend(
                who.iter()
                    .map(|&w| fixed(runs(w).and_then(|x| x.client_cpu_us_per_msg), 1)),
            );
            cells.extend(
                who.iter()
                    .map(|&w| fixed(runs(w).and_then(|x| x.broker_cpu_us_per_msg), 1)),
            );
            table.row(&cells);
        }
        out += &table.end();
    }
    if let Some(first) = r.starts.first() {
        let who: Vec<Contender> = Contender::ALL
            .into_iter()
            .filter(|&w| r.starts.iter().any(|s| s.contender == w))
            .collect();
        let _ = writeln!(
            out,
            "Start, success path (ms from consumer start until one waiting message is settled: \
             connect, topology, consume; median of {}, contenders taking turns, in reverse order \
             every other time):\n",
            first.ms.len()
        );
        let mut head = vec!["queue".to_owned()];
        head.extend(who.iter().map(|w| format!("{} ms", w.name())));
        head.push("Lily − raw-batch ms".into());
        let mut table = Table::new(&head, 1);
        let mut kinds: Vec<&str> = r.starts.iter().map(|s| s.queue_type).collect();
        kinds.dedup();
        for kind in kinds {
            let median = |w: Contender| {
                r.starts
                    .iter()
                    .find(|s| s.queue_type == kind && s.contender == w)
                    .map(|s| s.median_ms)
            };
            let mut cells = vec![kind.to_owned()];
            cells.extend(who.iter().map(|&w| fixed(median(w), 1)));
            let over = median(Contender::Lily).zip(median(Contender::RawBatch));
            cells.push(fixed(over.map(|(l, b)| l - b), 1));
            table.row(&cells);
        }
        out += &table.end();
    }
    notes(&mut out, &r.meta.notes);
    out
}

/// `1.23`: microseconds as milliseconds.
fn ms(us: u32) -> String {
    format!("{:.2}", f64::from(us) / 1000.0)
}

/// Share of `latencies` over `bound` ms (one of [`HISTOGRAM_MS`]), in %.
fn over(latencies: &Latencies, bound: u32) -> f64 {
    let slot = HISTOGRAM_MS
        .iter()
        .position(|&ms| ms == bound)
        .map_or(HISTOGRAM_MS.len(), |i| i + 1);
    let over: usize = latencies.histogram[slot..].iter().sum();
    #[allow(clippy::cast_precision_loss)]
    let share = 100.0 * over as f64 / latencies.samples.max(1) as f64;
    share
}

/// `yes`, or what went wrong in a paced run.
fn keeps_up(run: &latency::Run) -> String {
    let flags: Vec<&str> = [
        (!run.publisher_reached_target, "publisher short of target"),
        (!run.kept_up, "fell behind"),
        (!run.backlog_bounded, "backlog grew"),
        (!run.complete, "incomplete"),
        (run.failed > 0 || run.unconfirmed > 0, "failures"),
    ]
    .into_iter()
    .filter_map(|(bad, flag)| bad.then_some(flag))
    .collect();
    if flags.is_empty() {
        "yes".into()
    } else {
        flags.join(", ")
    }
}

/// How the rate used was found: the rates checked, and whether the last was sustained.
fn sustained(max: &MaxRate) -> String {
    match (max.tries, max.sustained) {
        (Some(tries), Some(true)) => format!(" (sustained; rates checked: {tries})"),
        (Some(tries), _) => format!(" (NOT sustained; rates checked: {tries}, the last used)"),
        _ => String::new(),
    }
}

/// The latency report: every case's percentiles, the histogram, the copies' confirms and the
/// maximum rates.
pub fn latency(r: &latency::Results) -> String {
    let mut out = "# Settlement latency: Lily and raw-batch\n\n".to_owned();
    let _ = writeln!(out, "Broker: {} on {}  ", r.meta.broker, r.meta.broker_url);
    let _ = writeln!(
        out,
        "{}-byte JSON, persistent, classic queue; paced runs of {:.0} s, the first {:.0} s not \
         timed; {} CPU(s)  ",
        r.meta.message_bytes, r.run_secs, r.warmup_secs, r.meta.cpus
    );
    out += &run_line(&r.meta);
    out.push('\n');
    let head = [
        "path",
        "prefetch",
        "load",
        "target msg/s",
        "published msg/s",
        "contender",
        "settled msg/s",
        "p50 ms",
        "p99 ms",
        "p99.9 ms",
        "> 100 ms",
        "max ready depth",
        "kept up",
        "p99 Lily − raw-batch (target)",
    ];
    let mut table = Table::new(&head, 2);
    for c in &r.cases {
        let rounds = match c.rounds_p99_diff_ms.as_slice() {
            [_] | [] => String::new(),
            all => {
                let all: Vec<String> = all.iter().map(|d| format!("{d:+.2}")).collect();
                format!(", median of {}: {}", all.len(), all.join(", "))
            }
        };
        let met = if c.met { "met" } else { "MISSED" };
        let diff = format!(
            "{:+.2} ms (≤ +{:.0} ms: {met}{rounds})",
            c.p99_diff_ms, c.p99_margin_ms
        );
        for (run, diff) in [(&c.raw_batch, String::new()), (&c.lily, diff)] {
            table.row(&[
                c.path.name().into(),
                c.prefetch.to_string(),
                format!("{:.0} %", c.load * 100.0),
                rate(c.target_rate),
                rate(run.publish_rate),
                run.contender.name().into(),
                rate(run.settled_per_sec),
                ms(run.latency.p50_us),
                ms(run.latency.p99_us),
                ms(run.latency.p999_us),
                format!("{:.2} %", over(&run.latency, 100)),
                run.max_ready_depth.to_string(),
                keeps_up(run),
                diff,
            ]);
        }
    }
    out += &table.end();
    out += "Latency histogram (share of the timed deliveries at or under each bound, ms):\n\n";
    let mut head: Vec<String> = ["path", "prefetch", "load", "contender"]
        .map(String::from)
        .to_vec();
    head.extend(HISTOGRAM_MS.iter().map(|b| format!("≤ {b}")));
    head.push(format!("> {}", HISTOGRAM_MS[HISTOGRAM_MS.len() - 1]));
    let mut table = Table::new(&head, 1);
    for c in &r.cases {
        for run in [&c.raw_batch, &c.lily] {
            let l = &run.latency;
            let mut cells = vec![
                c.path.name().into(),
                c.prefetch.to_string(),
                format!("{:.0} %", c.load * 100.0),
                run.contender.name().into(),
            ];
            #[allow(clippy::cast_precision_loss)]
            let share = |n: usize| format!("{:.2} %", 100.0 * n as f64 / l.samples.max(1) as f64);
            cells.extend(l.histogram.iter().map(|&n| share(n)));
            table.row(&cells);
        }
    }
    out += &table.end();
    let copies: Vec<_> = r
        .cases
        .iter()
        .flat_map(|c| [(c, &c.raw_batch), (c, &c.lily)])
        .filter_map(|(c, run)| Some((c, run, run.copy_confirms.as_ref()?)))
        .collect();
    if !copies.is_empty() {
        out += "Handoff path, each copy from its publish to its confirm (Lily: its `handoff` span, \
                from the copy built to its verdict; raw-batch: from its publish written to its \
                confirm seen at the flush that awaits it), beside the settlement's p99:\n\n";
        let head = [
            "path",
            "prefetch",
            "load",
            "contender",
            "copy p50 ms",
            "copy p99 ms",
            "copy p99.9 ms",
            "copies > 50 ms",
            "settled p99 ms",
        ];
        let mut table = Table::new(&head, 1);
        for (c, run, l) in copies {
            table.row(&[
                c.path.name().into(),
                c.prefetch.to_string(),
                format!("{:.0} %", c.load * 100.0),
                run.contender.name().into(),
                ms(l.p50_us),
                ms(l.p99_us),
                ms(l.p999_us),
                format!("{:.2} %", over(l, 50)),
                ms(run.latency.p99_us),
            ]);
        }
        out += &table.end();
    }
    out += "Maximum rates (msgs/s):\n\n";
    let head = [
        "path",
        "prefetch",
        "Lily drained",
        "raw-batch drained",
        "offered",
        "Lily settled under load",
        "raw-batch settled under load",
        "used (sustained by both)",
    ];
    let mut table = Table::new(&head, 1);
    let mut seen = Vec::new();
    for c in &r.cases {
        if seen.contains(&(c.path, c.prefetch)) {
            continue;
        }
        seen.push((c.path, c.prefetch));
        let m = &c.max_rate;
        table.row(&[
            c.path.name().into(),
            c.prefetch.to_string(),
            opt_rate(m.lily),
            opt_rate(m.raw_batch),
            opt_rate(m.offered),
            opt_rate(m.lily_loaded),
            opt_rate(m.raw_batch_loaded),
            format!("{}{}", rate(m.used), sustained(m)),
        ]);
    }
    out += &table.end();
    notes(&mut out, &r.meta.notes);
    out
}

/// The storm report: each contender's rates, RSS and check by id.
pub fn storm(r: &storm::Results) -> String {
    let mut out = "# Failure storm: 100 % retryable failures\n\n".to_owned();
    let _ = writeln!(out, "Broker: {} on {}  ", r.meta.broker, r.meta.broker_url);
    let _ = writeln!(
        out,
        "Population {} × {}-byte JSON, classic queue, retry bucket {:.0} s, prefetch {}; {} s a \
         contender, warm-up {} s; {} CPU(s)  ",
        r.population,
        r.meta.message_bytes,
        r.retry_delay_secs,
        r.prefetch,
        r.secs,
        r.warmup_secs,
        r.meta.cpus
    );
    out += &run_line(&r.meta);
    out.push('\n');
    let head = [
        "contender",
        "mean handoffs/s",
        "first window /s",
        "last window /s",
        "last/first",
        "RSS after warm-up MiB",
        "max MiB",
        "end MiB",
        "slope MiB/min",
        "ids ok",
    ];
    let mut table = Table::new(&head, 1);
    for run in &r.runs {
        let s = &run.summary;
        table.row(&[
            run.contender.name().into(),
            rate(s.mean_rate),
            rate(s.first_rate),
            rate(s.last_rate),
            format!("{:.3}", s.flatness),
            format!("{:.1}", s.rss_start_mib),
            format!("{:.1}", s.rss_max_mib),
            format!("{:.1}", s.rss_end_mib),
            format!("{:+.2}", s.rss_slope_mib_per_min),
            (if run.check.ok { "yes" } else { "**no**" }).into(),
        ]);
    }
    out += &table.end();
    let opt = |v: Option<u32>| v.map_or_else(|| "?".into(), |v| v.to_string());
    for run in &r.runs {
        let (s, c, who) = (&run.summary, &run.check, run.contender.name());
        let _ = writeln!(
            out,
            "- {who}: mean {} handoffs/s after warm-up ({} in {} s, {} failed); first {} s {} /s, \
             last {} s {} /s, flatness last/first {:.3}; min ready depth {}",
            rate(s.mean_rate),
            run.handoffs,
            run.secs,
            run.failed,
            s.window_secs,
            rate(s.first_rate),
            s.window_secs,
            rate(s.last_rate),
            s.flatness,
            opt(s.min_ready),
        );
        let _ = writeln!(
            out,
            "- {who} VmRSS: {:.1} MiB after warm-up, max {:.1}, end {:.1}; slope {:+.2} MiB/min",
            s.rss_start_mib, s.rss_max_mib, s.rss_end_mib, s.rss_slope_mib_per_min,
        );
        let _ = writeln!(
            out,
            "- {who} by id: {} in work queue + {} in bucket of {}; missing {}, duplicates {}, \
             strangers {}; DLQ {}, parking {} → {}",
            c.in_work_queue,
            c.in_bucket,
            c.population,
            c.missing,
            c.duplicates,
            c.strangers,
            opt(c.in_dead_letter_queue),
            opt(c.in_parking),
            if c.ok { "ok" } else { "FAILED" }
        );
        if let Some(t) = &run.lily_totals {
            let clean = t.dead_lettered == 0 && t.parked == 0;
            let _ = writeln!(
                out,
                "- Lily totals: retried {}, dead-lettered {}, parked {}, requeued {}, unresolved {} \
                 → {}",
                t.retried,
                t.dead_lettered,
                t.parked,
                t.requeued,
                t.unresolved,
                if clean {
                    "nothing dead-lettered or parked"
                } else {
                    "DEAD-LETTERED OR PARKED"
                }
            );
        }
    }
    if let Some(x) = r.lily_over_raw {
        let _ = writeln!(out, "- Lily / raw lapin mean rate: {x:.3}");
    }
    out.push('\n');
    notes(&mut out, &r.meta.notes);
    out
}

/// The Mongo scope report: rates and ratios, mongod's operations, the verdicts.
pub fn mongo(r: &mongo::Results) -> String {
    let mut out = format!("Broker: {} on {}  \n", r.meta.broker, r.meta.broker_url);
    let _ = writeln!(out, "Database: {} on {}  ", r.mongodb, r.mongodb_url);
    let _ = writeln!(
        out,
        "Queue: {}; {}-byte JSON orders, persistent, pre-published; {} repetition(s) alternating \
         the contenders; medians; {} CPU(s)  ",
        r.queue_type, r.meta.message_bytes, r.repetitions, r.meta.cpus
    );
    out += &run_line(&r.meta);
    out.push('\n');
    let head = [
        "case",
        "N",
        "concurrency",
        "prefetch",
        "contender",
        "msgs/s",
        "/ raw",
        "target",
        "tries/msg",
        "conflicts/msg",
        "DLQ + parked",
        "verified",
        "client µs/msg",
        "mongod µs/msg",
        "broker µs/msg",
    ];
    let mut table = Table::new(&head, 1);
    for case in &r.cases {
        for c in &case.contenders {
            let target = match (c.over_raw_target, c.over_raw_met) {
                (Some(t), Some(met)) => format!("≥ {t:.2} ({})", if met { "yes" } else { "NO" }),
                (Some(t), None) => format!("≥ {t:.2} (-)"),
                _ => "-".into(),
            };
            table.row(&[
                case.case.name().into(),
                case.messages_per_run.to_string(),
                case.concurrency.to_string(),
                case.prefetch.to_string(),
                c.contender.name().into(),
                rate(c.median_msgs_per_sec),
                fixed(c.over_raw, 3),
                target,
                format!("{:.3}", c.attempts_per_msg),
                format!("{:.3}", c.conflicts_per_msg),
                c.dead_lettered_or_parked.to_string(),
                (if c.all_verified { "yes" } else { "**no**" }).into(),
                fixed(c.client_cpu_us_per_msg, 1),
                fixed(c.mongod_cpu_us_per_msg, 1),
                fixed(c.broker_cpu_us_per_msg, 1),
            ]);
        }
    }
    out += &table.end();
    out += "mongod operations per message (median; `serverStatus.opcounters` over the run):\n\n";
    let head = [
        "case",
        "contender",
        "insert",
        "update",
        "query",
        "delete",
        "command",
        "total",
    ];
    let mut table = Table::new(&head, 2);
    for case in &r.cases {
        for c in &case.contenders {
            if let Some(o) = &c.mongod_ops_per_msg {
                let mut cells = vec![case.case.name().to_owned(), c.contender.name().into()];
                let values = [o.insert, o.update, o.query, o.delete, o.command, o.total()];
                cells.extend(values.iter().map(|v| format!("{v:.2}")));
                table.row(&cells);
            }
        }
    }
    out += &table.end();
    for case in &r.cases {
        for c in &case.contenders {
            if let (Some(x), Some(t), Some(met)) = (c.over_raw, c.over_raw_target, c.over_raw_met) {
                let _ = writeln!(
                    out,
                    "- {}: {} / raw driver = {x:.3} (target >= {t:.2}): {}",
                    case.case.name(),
                    c.contender.name(),
                    if met { "met" } else { "MISSED" }
                );
            }
        }
        let dead: u64 = case
            .contenders
            .iter()
            .map(|c| c.dead_lettered_or_parked)
            .sum();
        let verified = case.contenders.iter().all(|c| c.all_verified);
        let _ = writeln!(
            out,
            "- {}: valid messages dead-lettered or parked: {dead} (required 0): {}; every run \
             verified by message id: {}",
            case.case.name(),
            if dead == 0 { "met" } else { "MISSED" },
            if verified { "yes" } else { "NO" },
        );
    }
    out.push('\n');
    notes(&mut out, &r.meta.notes);
    out
}

/// A JSON number with `digits` decimals, thousands apart; `-` when missing.
fn num(v: &Value, digits: usize) -> String {
    match v.as_f64() {
        Some(x) if x.is_finite() => group(&format!("{x:.digits$}")),
        _ => "-".into(),
    }
}

/// `yes`, `NO` or `-` for a JSON boolean.
fn met(v: &Value) -> String {
    let text = match v.as_bool() {
        Some(true) => "yes",
        Some(false) => "NO",
        None => "-",
    };
    text.into()
}

/// `a - b` of two JSON numbers.
fn minus(a: &Value, b: &Value) -> Value {
    Value::from(a.as_f64().unwrap_or(f64::NAN) - b.as_f64().unwrap_or(f64::NAN))
}

/// Bytes as MiB.
fn mib(v: &Value) -> Value {
    Value::from(v.as_f64().unwrap_or(f64::NAN) / 1_048_576.0)
}

/// One row of the cost table: measure, raw lapin, Lily, Lily's layer, target, met.
type Row = [String; 6];

/// A row of a measure with nothing but a label and three figures.
fn plain(label: impl Into<String>, raw: String, lily: String, layer: String) -> Row {
    [label.into(), raw, lily, layer, "-".into(), "-".into()]
}

/// The row of a step that failed, or `None`.
fn failed(step: &Value, label: &str) -> Option<Row> {
    let err = step["error"].as_str()?;
    Some(plain(label, "error".into(), err.into(), "-".into()))
}

/// The cost table's rows, from `cost.json`.
fn cost_rows(r: &Value) -> Vec<Row> {
    let dash = || "-".to_owned();
    let mut rows = Vec::new();
    let i = &r["instructions"];
    if let Some(row) = failed(i, "instructions / message") {
        rows.push(row);
    } else if !i.is_null() {
        let label = format!("instructions / message (callgrind, N={})", num(&i["n"], 0));
        let (raw, lily, layer) = (
            num(&i["raw"], 0),
            num(&i["lily"], 0),
            num(&i["lily_layer"], 0),
        );
        rows.push([label, raw, lily, layer, "<= 8 000".into(), met(&i["met"])]);
        rows.push(plain(
            "  raw lapin acking with Acker::ack().await (informative)",
            num(&i["raw_acker"], 0),
            num(&i["lily"], 0),
            num(&minus(&i["lily"], &i["raw_acker"]), 0),
        ));
        let mt = &i["multi_thread"];
        if !mt.is_null() {
            let (raw, lily, layer) = (
                num(&mt["raw"], 0),
                num(&mt["lily"], 0),
                num(&mt["lily_layer"], 0),
            );
            rows.push(plain(
                "  same, multi-thread runtime (informative)",
                raw,
                lily,
                layer,
            ));
        }
    }
    let reader = &r["reader"];
    if let Some(per) = reader["per_message"].as_f64() {
        // The frame reader is part of Lily's layer: its share of Lily's whole cost per message
        // (the target), and of the layer, against the figures of this run.
        let share = i["lily"].as_f64().map(|l| per / l);
        let of_layer = i["lily_layer"]
            .as_f64()
            .map_or_else(dash, |l| format!("{:.0} % of the layer", per / l * 100.0));
        rows.push([
            "  of it, the frame reader (wire.rs), instructions / message".into(),
            dash(),
            num(&Value::from(per), 0),
            of_layer,
            share.map_or_else(
                || "< 5 % of Lily".into(),
                |x| format!("< 5 % of Lily: {:.1} %", x * 100.0),
            ),
            share.map_or_else(dash, |x| met(&Value::from(x < 0.05))),
        ]);
    } else if let Some(row) = failed(reader, "the frame reader") {
        rows.push(row);
    }
    let a = &r["allocations"];
    if let Some(row) = failed(a, "heap allocations / message") {
        rows.push(row);
    } else if !a.is_null() {
        let part = |key: &str| {
            let (raw, lily, layer) = (&a["raw"][key], &a["lily"][key], &a["lily_layer"][key]);
            (num(raw, 2), num(lily, 2), num(layer, 2))
        };
        let (raw, lily, layer) = part("allocation_calls");
        let label = format!(
            "heap allocations / message (alloc+realloc, N={})",
            num(&a["n"], 0)
        );
        rows.push([label, raw, lily, layer, "<= 10".into(), met(&a["met"])]);
        let (lily_calls, acker) = (
            &a["lily"]["allocation_calls"],
            &a["raw_acker"]["allocation_calls"],
        );
        rows.push(plain(
            "  raw lapin acking with Acker::ack().await (informative)",
            num(acker, 2),
            num(lily_calls, 2),
            num(&minus(lily_calls, acker), 2),
        ));
        let (raw, lily, layer) = part("reallocations");
        rows.push(plain("  of which realloc", raw, lily, layer));
        let (raw, lily, layer) = part("bytes_allocated");
        rows.push(plain("heap bytes allocated / message", raw, lily, layer));
    }
    let m = &r["memory"];
    if let Some(row) = failed(m, "memory per in-flight delivery") {
        rows.push(row);
    } else if !m.is_null() {
        let k = num(&m["in_flight"], 0);
        for (what, key) in [
            ("RSS", "rss_per_delivery"),
            ("live heap", "heap_per_delivery"),
        ] {
            rows.push(plain(
                format!("{what} bytes per in-flight delivery ({k} held)"),
                num(&m["raw"][key], 0),
                num(&m["lily"][key], 0),
                num(&m["lily_extra_over_raw"][key], 0),
            ));
        }
        let peak = |who: &str| num(&mib(&m[who]["hwm_bytes"]), 1);
        rows.push(plain(
            format!("peak RSS, {k} in flight (MiB)"),
            peak("raw"),
            peak("lily"),
            dash(),
        ));
    }
    let d = &r["shutdown"];
    if let Some(row) = failed(d, "shutdown latency") {
        rows.push(row);
    } else if !d.is_null() {
        let runs = num(&d["idle"]["runs"], 0);
        let label = format!("shutdown, idle: SIGTERM to exit, ms (median of {runs})");
        let idle = num(&d["idle"]["median_ms"], 1);
        rows.push([label, dash(), idle, dash(), "< 200".into(), met(&d["met"])]);
        let busy = &d["in_flight_1000"];
        let label = format!(
            "shutdown, {} in flight (handlers {} ms): SIGTERM to exit, ms",
            num(&busy["median_in_flight_at_sigterm"], 0),
            num(&busy["work_ms"], 0)
        );
        rows.push(plain(label, dash(), num(&busy["median_ms"], 1), dash()));
    }
    hostile_rows(&r["hostile"], &mut rows);
    rows
}

/// The hostile load's rows.
fn hostile_rows(h: &Value, rows: &mut Vec<Row>) {
    if let Some(row) = failed(h, "hostile load") {
        rows.push(row);
        return;
    }
    if h.is_null() {
        return;
    }
    let (raw, lily) = (&h["raw"], &h["lily"]);
    let mib_row = |label: String, key: &str| {
        let layer = num(&mib(&minus(&lily[key], &raw[key])), 1);
        plain(
            label,
            num(&mib(&raw[key]), 1),
            num(&mib(&lily[key]), 1),
            layer,
        )
    };
    let (n, prefetch) = (num(&h["n"], 0), num(&h["prefetch"], 0));
    let mut peak = mib_row(
        format!("hostile load, {n} msgs at prefetch {prefetch}: peak RSS (VmHWM), MiB"),
        "hwm_bytes",
    );
    peak[4] = format!("<= {}", num(&mib(&lily["bound_bytes"]), 1));
    peak[5] = met(&lily["met"]);
    rows.push(peak);
    rows.push(mib_row("  idle RSS, MiB".into(), "rss_idle_bytes"));
    let held = num(&lily["in_flight_at_full_window"], 0);
    let label = format!("  RSS with the window full ({held} held), MiB");
    rows.push(mib_row(label, "rss_full_window_bytes"));
    rows.push(mib_row(
        "  peak live heap (sampled), MiB".into(),
        "heap_peak_sampled_bytes",
    ));
    let label = format!(
        "  bound: idle + conns x 64 x frame_max + prefetch x {} x (body + headers), MiB",
        num(&h["copies"], 0)
    );
    rows.push(mib_row(label, "bound_bytes"));
    let (raw_over, lily_over) = (
        num(&raw["peak_over_bound"], 2),
        num(&lily["peak_over_bound"], 2),
    );
    rows.push([
        "  peak / bound".into(),
        raw_over,
        lily_over,
        "-".into(),
        "<= 1".into(),
        met(&lily["met"]),
    ]);
    let key = "peak_above_idle_per_window_delivery";
    rows.push(plain(
        format!(
            "  peak above idle per window delivery, bytes (message budget {})",
            num(&h["message_budget_bytes"], 0)
        ),
        num(&raw[key], 0),
        num(&lily[key], 0),
        num(&minus(&lily[key], &raw[key]), 0),
    ));
    let drain = |who: &Value| num(&who["msgs_per_s"], 0);
    rows.push(plain(
        "  drain of the full queue, msg/s",
        drain(raw),
        drain(lily),
        "-".into(),
    ));
    let e = |who: &Value| {
        (
            num(&who["evidence"]["settled"], 0),
            num(&who["evidence"]["sent"], 0),
        )
    };
    let all = |who: &Value| who["evidence"]["settled"] == who["evidence"]["sent"];
    let ((rs, rn), (ls, ln)) = (e(raw), e(lily));
    rows.push([
        "  messages settled, checked by id from outside".into(),
        format!("{rs}/{rn}"),
        format!("{ls}/{ln}"),
        "-".into(),
        "all".into(),
        met(&Value::from(all(raw) && all(lily))),
    ]);
    let unexpected = num(&lily["evidence"]["unexpected"], 0);
    rows.push(plain(
        "  of which not where their class says (Lily)",
        "-".into(),
        unexpected,
        "-".into(),
    ));
}

/// The conditions the cost figures were measured under.
fn cost_conditions(r: &Value) -> String {
    let mut text = format!(
        "{}, classic queues, {}-byte persistent JSON messages, {} cores. Per-message cost: prefetch \
         {}, {} runtime; Lily's layer = Lily - a hand-written lapin consumer that deserializes and \
         acks each message as Lily does (`Channel::basic_ack`, the frame queued and its write not \
         awaited; a final `basic.qos` round trip proves the ACKs). The informative rows compare \
         with the same consumer acking through lapin's `Acker`, as its documentation shows.",
        r["broker"].as_str().unwrap_or("RabbitMQ"),
        r["message_bytes"],
        r["cores"],
        r["prefetch"],
        r["runtime"].as_str().unwrap_or("tokio"),
    );
    if r["memory"]["in_flight"].is_number() {
        let k = num(&r["memory"]["in_flight"], 0);
        text += &format!(" Memory: prefetch = concurrency = {k}, multi-thread runtime.");
    }
    if r["shutdown"].is_object() {
        text += " Shutdown: examples/k8s-shutdown, SIGTERM to process exit.";
    }
    let h = &r["hostile"];
    if h["n"].is_number() {
        text += &format!(
            " Hostile load: {} persistent messages with bodies and headers just under the \
             limits in force (max_body_bytes {}, the other limits Lily's defaults), 5 % just \
             over one, 10 % failing; prefetch = concurrency = {}, the queue full when the \
             drain starts; bound = {}.",
            num(&h["n"], 0),
            num(&h["limits"]["max_body_bytes"], 0),
            num(&h["prefetch"], 0),
            h["bound_formula"].as_str().unwrap_or("-"),
        );
    }
    text + " For reference, the peer ruststream-lapin reports about 17 300 instructions and 16 \
            allocations per message."
}

/// The cost report, from `cost.json`.
pub fn cost(r: &Value) -> String {
    let head = [
        "measure",
        "raw lapin",
        "Lily",
        "Lily's layer",
        "target",
        "met",
    ];
    let mut table = Table::new(&head, 1);
    for row in cost_rows(r) {
        table.row(&row);
    }
    format!("{}\n\n{}", cost_conditions(r), table.end())
}
