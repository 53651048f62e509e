//! What every program writes: `<name>.json` (its results serialized), `<name>.md` (printed too)
//! and, for four of them, `<name>.svg`; the tables and charts of each program, and the number
//! formats they share.

use std::fmt::Write as _;
use std::path::Path;

use serde::Serialize;

use crate::chart::Chart;
use crate::latency::{self, HISTOGRAM_MS, Latencies};
pub use crate::number::{group, rate};
use crate::{Meta, mongo, storm, throughput};

/// Prints `markdown` and writes `<name>.json`, `<name>.md` and, when given, `<name>.svg` into
/// `out`, saying where.
///
/// # Panics
/// When the directory or a file cannot be written.
pub fn write(out: &Path, name: &str, results: &impl Serialize, markdown: &str, svg: Option<&str>) {
    println!("\n{markdown}");
    std::fs::create_dir_all(out).expect("create the output directory");
    let json = serde_json::to_string_pretty(results).expect("json") + "\n";
    let files = [
        ("json", Some(json.as_str())),
        ("md", Some(markdown)),
        ("svg", svg),
    ];
    for (ext, text) in files {
        let Some(text) = text else { continue };
        let file = out.join(format!("{name}.{ext}"));
        std::fs::write(&file, text).expect("write results");
        println!("wrote {}", file.display());
    }
}

/// Adds a row of cells that implement `Display` to a [`Table`].
macro_rules! row {
    ($table:expr; $($cell:expr),* $(,)?) => {
        $table.row([$($cell.to_string()),*])
    };
}
pub(crate) use row;

/// A markdown table: the first `text` columns left-aligned, the others right-aligned.
pub struct Table(String);

impl Table {
    /// A table whose head is `head`'s cells, `|` apart.
    pub fn new(head: &str, text: usize) -> Self {
        let mut table = Self(String::new());
        table.row(head.split('|'));
        let rule: String = (0..head.split('|').count())
            .map(|i| if i < text { "---|" } else { "---:|" })
            .collect();
        table.0 += &format!("|{rule}\n");
        table
    }

    pub fn row<S: AsRef<str>>(&mut self, cells: impl IntoIterator<Item = S>) {
        let cells: Vec<S> = cells.into_iter().collect();
        let cells: Vec<&str> = cells.iter().map(AsRef::as_ref).collect();
        let _ = writeln!(self.0, "| {} |", cells.join(" | "));
    }

    /// The table and a blank line.
    pub fn end(self) -> String {
        self.0 + "\n"
    }
}

/// `value` with `digits` decimals, or `-`.
pub fn fixed(value: Option<f64>, digits: usize) -> String {
    value.map_or_else(|| "-".into(), |v| format!("{v:.digits$}"))
}

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

/// ` (≥ 1.00 met)`, ` (≥ 1.00 MISSED)` or ` (≥ 1.00: fewer than 5 reps)` for a ratio against
/// `target` judged `met` by [`throughput::meets`]; `floor` for `≥`, else `≤`.
fn verdict(target: Option<f64>, met: Option<bool>, floor: bool) -> String {
    let Some(t) = target else {
        return String::new();
    };
    let sign = if floor { '≥' } else { '≤' };
    match met {
        Some(true) => format!(" ({sign} {t:.2} met)"),
        Some(false) => format!(" ({sign} {t:.2} MISSED)"),
        None => format!(
            " ({sign} {t:.2}: fewer than {} reps)",
            throughput::RULE_REPS
        ),
    }
}

/// The lines every report opens with: its title, the broker, `conditions`, and the revision,
/// load and duration.
pub fn opening(title: &str, meta: &Meta, conditions: &str) -> String {
    let (start, end) = (
        fixed(meta.load_average[0], 2),
        fixed(meta.load_average[1], 2),
    );
    format!(
        "# {title}\n\nBroker: {} on {}  \n{conditions}; {} CPU(s)  \nLily {}; load average {start} \
         at start, {end} at end; {:.0} s\n\n",
        meta.broker, meta.broker_url, meta.cpus, meta.lily_revision, meta.wall_secs
    )
}

/// The notes, one bullet each.
pub fn notes(out: &mut String, notes: &[String]) {
    for note in notes {
        let _ = writeln!(out, "- {note}");
    }
}

/// The chart's subtitle: broker, message and revision.
fn subtitle(meta: &Meta, what: &str) -> String {
    format!(
        "{}, {}-byte JSON, {what}, Lily {}",
        meta.broker, meta.message_bytes, meta.lily_revision
    )
}

/// The throughput report: per path the rates and Lily's ratios, the steady rates and the CPU a
/// message; then each contender's start.
pub fn throughput(r: &throughput::Results) -> String {
    use throughput::{Contender, Path};
    let conditions = format!(
        "{} messages a run, persistent; {} repetition(s), contenders taking turns run by run, in reverse order every other repetition; medians, [lowest–highest] of the repetitions' ratios; a target is met when, over at least {} repetitions, the median is within 3 % of it and the range reaches it; raw-batch again / raw-batch is the A/A ratio of the same run",
        r.messages_per_run,
        r.repetitions,
        throughput::RULE_REPS
    );
    let mut out = opening("Throughput", &r.meta, &conditions);
    for path in [Path::Success, Path::Handoff] {
        let cases: Vec<_> = r.cases.iter().filter(|c| c.path == path).collect();
        let who: Vec<Contender> = Contender::ALL
            .into_iter()
            .filter(|&w| cases.iter().any(|c| c.runs(w).is_some()))
            .collect();
        let others: Vec<Contender> = who
            .iter()
            .copied()
            .filter(|&w| !matches!(w, Contender::Lily | Contender::RawBatchAgain))
            .collect();
        if cases.is_empty() {
            continue;
        }
        let aa = cases.iter().any(|c| c.aa.is_some());
        let head = |units: &[&str], ratios: bool| {
            let mut head = String::from("path|queue|prefetch");
            for unit in units {
                who.iter()
                    .for_each(|w| head += &format!("|{} {unit}", w.name()));
            }
            if ratios {
                others
                    .iter()
                    .for_each(|w| head += &format!("|Lily / {}", w.name()));
            }
            if ratios && aa {
                head += "|A/A: raw-batch again / raw-batch";
            }
            head
        };
        let key = |c: &throughput::CaseResult| {
            [
                c.path.name().to_owned(),
                c.queue_type.to_owned(),
                c.prefetch.to_string(),
            ]
        };
        for steady in [false, true] {
            if steady {
                let _ = writeln!(
                    out,
                    "Steady rate, {} path (median msg/s from each contender's first delivery until N are settled: the start, timed on its own below, left out):\n",
                    path.name()
                );
            }
            let mut table = Table::new(&head(&["msg/s"], true), 2);
            for c in &cases {
                let rates = who.iter().map(|&w| {
                    let runs = c.runs(w);
                    opt_rate(if steady {
                        runs.and_then(|x| x.median_steady_msgs_per_sec)
                    } else {
                        runs.map(|x| x.median_msgs_per_sec)
                    })
                });
                let cell = |x: Option<&throughput::Ratio>| {
                    let Some(x) = x else {
                        return "-".into();
                    };
                    let (value, runs) = if steady {
                        (x.steady, &x.steady_runs)
                    } else {
                        (Some(x.value), &x.runs)
                    };
                    value.map_or_else(
                        || "-".into(),
                        |v| {
                            let met = x.target.and_then(|t| throughput::meets(v, runs, t, true));
                            format!("{v:.3}{}{}", verdict(x.target, met, true), spread(runs))
                        },
                    )
                };
                let ratios = others.iter().map(|&w| cell(c.ratio(w)));
                let aa = aa.then(|| cell(c.aa.as_ref()));
                let flag = (!c.all_runs_complete).then(|| "incomplete runs!".to_owned());
                table.row(
                    key(c)
                        .into_iter()
                        .chain(rates)
                        .chain(ratios)
                        .chain(aa)
                        .chain(flag),
                );
            }
            out += &table.end();
        }
        let _ = writeln!(
            out,
            "CPU per message, {} path (median µs, connect to close; client = this process, broker = the Erlang VM):\n",
            path.name()
        );
        let cpu_head = format!(
            "{}|Lily / raw-batch client|A/A client",
            head(&["client", "broker"], false)
        );
        let mut table = Table::new(&cpu_head, 2);
        for c in &cases {
            let client = who
                .iter()
                .map(|&w| fixed(c.runs(w).and_then(|x| x.client_cpu_us_per_msg), 1));
            let broker = who
                .iter()
                .map(|&w| fixed(c.runs(w).and_then(|x| x.broker_cpu_us_per_msg), 1));
            let cpu = |x: Option<&throughput::Ratio>, target| {
                x.and_then(|x| {
                    let v = x.cpu?;
                    Some(format!(
                        "{v:.3}{}{}",
                        verdict(target, x.cpu_met, false),
                        spread(&x.cpu_runs)
                    ))
                })
                .unwrap_or_else(|| "-".into())
            };
            let ratios = [
                cpu(
                    c.ratio(Contender::RawBatch),
                    (path == Path::Success).then_some(throughput::CPU_TARGET),
                ),
                cpu(c.aa.as_ref(), None),
            ];
            table.row(key(c).into_iter().chain(client).chain(broker).chain(ratios));
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
            "Start, success path (ms from consumer start until one waiting message is settled: connect, topology, consume; median of {}, contenders taking turns):\n",
            first.ms.len()
        );
        let head: String = who.iter().map(|w| format!("|{} ms", w.name())).collect();
        let mut table = Table::new(&format!("queue{head}|Lily − raw-batch ms"), 1);
        let mut kinds: Vec<&str> = r.starts.iter().map(|s| s.queue_type).collect();
        kinds.dedup();
        for kind in kinds {
            let median = |w| {
                r.starts
                    .iter()
                    .find(|s| s.queue_type == kind && s.contender == w)
                    .map(|s| s.median_ms)
            };
            let over = median(Contender::Lily)
                .zip(median(Contender::RawBatch))
                .map(|(l, b)| l - b);
            table.row(
                [kind.to_owned()]
                    .into_iter()
                    .chain(who.iter().map(|&w| fixed(median(w), 1)))
                    .chain([fixed(over, 1)]),
            );
        }
        out += &table.end();
    }
    notes(&mut out, &r.meta.notes);
    out
}

/// The throughput chart: a panel per path, a group per queue type × prefetch, a bar per
/// contender.
pub fn throughput_chart(r: &throughput::Results) -> String {
    use throughput::{Contender, Path};
    let what = format!("{} messages a run", r.messages_per_run);
    let mut chart = Chart::new("Throughput (median msg/s)", &subtitle(&r.meta, &what));
    for path in [Path::Success, Path::Handoff] {
        let cases: Vec<_> = r.cases.iter().filter(|c| c.path == path).collect();
        let who: Vec<Contender> = Contender::ALL
            .into_iter()
            .filter(|&w| w != Contender::RawBatchAgain)
            .filter(|&w| cases.iter().any(|c| c.runs(w).is_some()))
            .collect();
        let names: Vec<&str> = who.iter().map(|w| w.name()).collect();
        let groups: Vec<_> = cases
            .iter()
            .map(|c| {
                (
                    format!("{} {}", c.queue_type, c.prefetch),
                    who.iter().map(|&w| c.median(w)).collect(),
                )
            })
            .collect();
        if !cases.is_empty() {
            chart.bars(
                &format!("{} path", path.name()),
                "msg/s",
                &names,
                &groups,
                false,
            );
        }
    }
    chart.finish()
}

/// `1.23`: microseconds as milliseconds.
fn ms(us: u32) -> String {
    format!("{:.2}", f64::from(us) / 1000.0)
}

/// Share of `latencies` over `bound` ms (one of [`HISTOGRAM_MS`]), in %.
#[allow(clippy::cast_precision_loss)]
fn over(latencies: &Latencies, bound: u32) -> String {
    let slot = HISTOGRAM_MS
        .iter()
        .position(|&ms| ms == bound)
        .map_or(HISTOGRAM_MS.len(), |i| i + 1);
    let over: usize = latencies.histogram[slot..].iter().sum();
    format!(
        "{:.2} %",
        100.0 * over as f64 / latencies.samples.max(1) as f64
    )
}

/// `yes`, or what went wrong in a paced run.
fn keeps_up(run: &latency::Run) -> String {
    let flags: Vec<&str> = [
        (!run.publisher_reached_target, "publisher short of target"),
        (!run.kept_up, "fell behind"),
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

/// The latency report: every case's percentiles, the copies' confirms and the maximum rates.
pub fn latency(r: &latency::Results) -> String {
    let conditions = format!(
        "{}-byte JSON, persistent, classic queue; paced runs of {:.0} s, the first {:.0} s not timed",
        r.meta.message_bytes, r.run_secs, r.warmup_secs
    );
    let mut out = opening(
        "Settlement latency: Lily and raw-batch",
        &r.meta,
        &conditions,
    );
    let head = "path|prefetch|load|target msg/s|published msg/s|contender|settled msg/s|p50 ms|p99 ms|p99.9 ms|> 100 ms|kept up|p99 Lily − raw-batch (target)";
    let mut table = Table::new(head, 2);
    let load = |c: &latency::Case| format!("{:.0} %", c.load * 100.0);
    for c in &r.cases {
        let rounds = match c.rounds_p99_diff_ms.as_slice() {
            [_] | [] => String::new(),
            all => format!(
                ", median of {}: {}",
                all.len(),
                all.iter()
                    .map(|d| format!("{d:+.2}"))
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
        };
        let met = if c.met { "met" } else { "MISSED" };
        let diff = format!(
            "{:+.2} ms (≤ +{:.0} ms: {met}{rounds})",
            c.p99_diff_ms, c.p99_margin_ms
        );
        for (run, diff) in [(&c.raw_batch, String::new()), (&c.lily, diff)] {
            let l = &run.latency;
            row!(table; c.path.name(), c.prefetch, load(c), rate(c.target_rate), rate(run.publish_rate), run.contender.name(), rate(run.settled_per_sec), ms(l.p50_us), ms(l.p99_us), ms(l.p999_us), over(l, 100), keeps_up(run), diff);
        }
    }
    out += &table.end();
    if r.cases.iter().any(|c| c.lily.copy_confirms.is_some()) {
        out += "Handoff path, each copy from its publish to its confirm (Lily: its `handoff` span, from the copy built to its verdict; raw-batch: from its publish written to its confirm seen at the flush that awaits it), beside the settlement's p99:\n\n";
        let mut table = Table::new(
            "path|prefetch|load|contender|copy p50 ms|copy p99 ms|copy p99.9 ms|copies > 50 ms|settled p99 ms",
            1,
        );
        for c in &r.cases {
            for run in [&c.raw_batch, &c.lily] {
                if let Some(l) = &run.copy_confirms {
                    row!(table; c.path.name(), c.prefetch, load(c), run.contender.name(), ms(l.p50_us), ms(l.p99_us), ms(l.p999_us), over(l, 50), ms(run.latency.p99_us));
                }
            }
        }
        out += &table.end();
    }
    out += "Maximum rates (msg/s; drained with nothing publishing, settled while the higher drain rate was offered, and the rate used: the first from 90 % of the lower down that both sustained):\n\n";
    let mut table = Table::new(
        "path|prefetch|Lily drained|raw-batch drained|offered|Lily settled under load|raw-batch settled under load|used",
        1,
    );
    let mut seen = Vec::new();
    for c in r.cases.iter().filter(|c| {
        let new = !seen.contains(&(c.path, c.prefetch));
        seen.push((c.path, c.prefetch));
        new
    }) {
        let m = &c.max_rate;
        let how = match (m.tries, m.sustained) {
            (Some(tries), Some(true)) => format!(" (sustained; rates checked: {tries})"),
            (Some(tries), _) => format!(" (NOT sustained; rates checked: {tries}, the last used)"),
            _ => String::new(),
        };
        let rates = [
            m.lily,
            m.raw_batch,
            m.offered,
            m.lily_loaded,
            m.raw_batch_loaded,
        ]
        .map(opt_rate);
        table.row(
            [c.path.name().into(), c.prefetch.to_string()]
                .into_iter()
                .chain(rates)
                .chain([format!("{}{how}", rate(m.used))]),
        );
    }
    out += &table.end();
    notes(&mut out, &r.meta.notes);
    out
}

/// The latency chart: a panel per path, a group per prefetch × load, p50 and p99 of each
/// contender on a logarithmic axis.
pub fn latency_chart(r: &latency::Results) -> String {
    let what = format!("{:.0} s paced runs", r.run_secs);
    let mut chart = Chart::new("Settlement latency (ms)", &subtitle(&r.meta, &what));
    let series = ["raw-batch p50", "raw-batch p99", "Lily p50", "Lily p99"];
    for path in [latency::Path::Success, latency::Path::Handoff] {
        let groups: Vec<_> = r
            .cases
            .iter()
            .filter(|c| c.path == path)
            .map(|c| {
                let (b, l) = (&c.raw_batch.latency, &c.lily.latency);
                let values =
                    [b.p50_us, b.p99_us, l.p50_us, l.p99_us].map(|us| Some(f64::from(us) / 1000.0));
                (
                    format!("prefetch {}, {:.0} %", c.prefetch, c.load * 100.0),
                    values.to_vec(),
                )
            })
            .collect();
        if !groups.is_empty() {
            chart.bars(
                &format!("{} path", path.name()),
                "ms, log scale",
                &series,
                &groups,
                true,
            );
        }
    }
    chart.finish()
}

/// The storm report: each contender's rates, RSS and check by id.
pub fn storm(r: &storm::Results) -> String {
    let conditions = format!(
        "Population {} × {}-byte JSON, classic queue, retry bucket {:.0} s, prefetch {}; {} s a contender, warm-up {} s",
        r.population, r.meta.message_bytes, r.retry_delay_secs, r.prefetch, r.secs, r.warmup_secs
    );
    let mut out = opening(
        "Failure storm: 100 % retryable failures",
        &r.meta,
        &conditions,
    );
    let head = "contender|mean handoffs/s|first window /s|last window /s|last/first|RSS after warm-up MiB|max MiB|end MiB|slope MiB/min|failed|ids: missing, duplicates, strangers|DLQ, parking|ids ok";
    let mut table = Table::new(head, 1);
    let opt = |v: Option<u32>| v.map_or_else(|| "?".into(), |v| v.to_string());
    for run in &r.runs {
        let (s, c) = (&run.summary, &run.check);
        row!(table; run.contender.name(), rate(s.mean_rate), rate(s.first_rate), rate(s.last_rate), format!("{:.3}", s.flatness), format!("{:.1}", s.rss_start_mib), format!("{:.1}", s.rss_max_mib), format!("{:.1}", s.rss_end_mib), format!("{:+.2}", s.rss_slope_mib_per_min), run.failed, format!("{}, {}, {}", c.missing, c.duplicates, c.strangers), format!("{}, {}", opt(c.in_dead_letter_queue), opt(c.in_parking)), (if c.ok { "yes" } else { "**no**" }));
    }
    out += &table.end();
    if let Some(x) = r.lily_over_raw {
        let _ = writeln!(out, "- Lily / raw lapin mean rate: {x:.3}");
    }
    for t in r.runs.iter().filter_map(|run| run.lily_totals.as_ref()) {
        let _ = writeln!(out, "- Lily's totals: {t:?}");
    }
    notes(&mut out, &r.meta.notes);
    out
}

/// The storm chart: handoffs a second and RSS over time, a line per contender.
#[allow(clippy::cast_precision_loss)]
pub fn storm_chart(r: &storm::Results) -> String {
    let what = format!(
        "{} messages, bucket {:.0} s",
        r.population, r.retry_delay_secs
    );
    let mut chart = Chart::new("Failure storm over time", &subtitle(&r.meta, &what));
    let series = |y: fn(&storm::Second) -> f64| -> Vec<(&str, Vec<(f64, f64)>)> {
        r.runs
            .iter()
            .map(|run| {
                (
                    run.contender.name(),
                    run.series.iter().map(|s| (f64::from(s.t), y(s))).collect(),
                )
            })
            .collect()
    };
    chart.lines(
        "Handoffs a second",
        "handoffs/s over the run's seconds",
        &series(|s| s.handoffs as f64),
    );
    chart.lines(
        "This process's RSS",
        "MiB over the run's seconds",
        &series(|s| s.rss_bytes as f64 / 1_048_576.0),
    );
    chart.finish()
}

/// The Mongo scope report: rates and ratios, mongod's operations, the verdicts.
pub fn mongo(r: &mongo::Results) -> String {
    let conditions = format!(
        "Database: {} on {}  \nQueue: {}; {}-byte JSON orders, persistent, pre-published; {} repetition(s) alternating the contenders; medians",
        r.mongodb, r.mongodb_url, r.queue_type, r.meta.message_bytes, r.repetitions
    );
    let mut out = opening(
        "The Mongo scope against a driver transaction",
        &r.meta,
        &conditions,
    );
    let head = "case|N|concurrency|prefetch|contender|msgs/s|/ raw|runs' range|target|tries/msg|conflicts/msg|DLQ + parked|verified|client µs/msg|mongod µs/msg|broker µs/msg|mongod ops/msg";
    let mut table = Table::new(head, 1);
    let mut ops = Table::new("case|contender|insert|update|query|delete|command", 2);
    for case in &r.cases {
        for c in &case.contenders {
            let target = match (c.over_raw_target, c.over_raw_met) {
                (Some(t), Some(met)) => {
                    format!("≥ {t:.2} ({})", if met { "met" } else { "MISSED" })
                }
                _ => "-".into(),
            };
            row!(table; case.case.name(), case.messages_per_run, case.concurrency, case.prefetch, c.contender.name(), rate(c.median_msgs_per_sec), fixed(c.over_raw, 3), c.over_raw_range.map_or_else(|| "-".into(), |(l, h)| format!("{l:.3}–{h:.3}")), target, format!("{:.3}", c.attempts_per_msg), format!("{:.3}", c.conflicts_per_msg), c.dead_lettered_or_parked, (if c.all_verified { "yes" } else { "**no**" }), fixed(c.client_cpu_us_per_msg, 1), fixed(c.mongod_cpu_us_per_msg, 1), fixed(c.broker_cpu_us_per_msg, 1), fixed(c.mongod_ops_per_msg.map(|o| o.total()), 2));
            if let Some(o) = &c.mongod_ops_per_msg {
                let values =
                    [o.insert, o.update, o.query, o.delete, o.command].map(|v| format!("{v:.2}"));
                ops.row(
                    [case.case.name().into(), c.contender.name().into()]
                        .into_iter()
                        .chain(values),
                );
            }
        }
    }
    out += &table.end();
    let mut published = Table::new("case|contender|published p50 ms|published p99 ms", 2);
    for case in r.cases.iter().filter(|c| c.case == mongo::Case::Outbox) {
        for c in &case.contenders {
            row!(published; case.case.name(), c.contender.name(), fixed(c.published_p50_ms, 1), fixed(c.published_p99_ms, 1));
        }
    }
    if r.cases.iter().any(|c| c.case == mongo::Case::Outbox) {
        out += "The outbox case's events, from the commit's start to the confirm (raw: published after the commit) or from staging to the sent mark (Lily: the relay; the database's clock, millisecond resolution); medians of each run's percentiles:\n\n";
        out += &published.end();
    }
    out += "mongod operations per message (median; `serverStatus.opcounters` over the run):\n\n";
    out += &ops.end();
    notes(&mut out, &r.meta.notes);
    out
}

/// The Mongo chart: a group per case, a bar per contender.
pub fn mongo_chart(r: &mongo::Results) -> String {
    let what = format!("{}, {} repetition(s)", r.mongodb, r.repetitions);
    let mut chart = Chart::new("The Mongo scope (median msg/s)", &subtitle(&r.meta, &what));
    let mut who: Vec<mongo::Contender> = Vec::new();
    for c in r.cases.iter().flat_map(|case| &case.contenders) {
        if !who.contains(&c.contender) {
            who.push(c.contender);
        }
    }
    let names: Vec<&str> = who.iter().map(|w| w.name()).collect();
    let groups: Vec<_> = r
        .cases
        .iter()
        .map(|case| {
            let rate = |w| {
                case.contenders
                    .iter()
                    .find(|c| c.contender == w)
                    .map(|c| c.median_msgs_per_sec)
            };
            (
                format!("{}, concurrency {}", case.case.name(), case.concurrency),
                who.iter().map(|&w| rate(w)).collect(),
            )
        })
        .collect();
    chart.bars("Messages a second", "msg/s", &names, &groups, false);
    chart.finish()
}

/// MiB with one decimal.
#[allow(clippy::cast_precision_loss)]
pub fn mib(bytes: u64) -> String {
    format!("{:.1}", bytes as f64 / 1_048_576.0)
}

/// `yes` or `NO`.
pub fn met(ok: bool) -> String {
    (if ok { "yes" } else { "NO" }).into()
}
