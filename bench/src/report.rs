//! What every program writes: `<name>.json` (its results serialized), `<name>.md` (printed too)
//! and, for four of them, `<name>.svg`; the tables and charts of each program, and the number
//! formats they share.

use std::fmt::Write as _;
use std::path::Path;

use serde::Serialize;

use crate::chart::Chart;
use crate::latency::{self, HISTOGRAM_MS, Latencies};
use crate::{Meta, cost, group, mongo, storm, throughput};

/// Prints `markdown` and writes `<name>.json`, `<name>.md` and, when given, `<name>.svg` into
/// `out`, saying where.
///
/// # Panics
/// When the directory or a file cannot be written.
pub fn write(out: &Path, name: &str, results: &impl Serialize, markdown: &str, svg: Option<&str>) {
    println!("\n{markdown}");
    std::fs::create_dir_all(out).expect("create the output directory");
    let json = serde_json::to_string_pretty(results).expect("json") + "\n";
    for (ext, text) in [
        ("json", Some(json.as_str())),
        ("md", Some(markdown)),
        ("svg", svg),
    ] {
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
        for cell in cells {
            let _ = write!(self.0, "| {} ", cell.as_ref());
        }
        self.0 += "|\n";
    }

    /// The table and a blank line.
    pub fn end(self) -> String {
        self.0 + "\n"
    }
}

/// `12 345`: a rate rounded, thousands apart; `-` when not finite or absent.
pub fn rate(value: impl Into<Option<f64>>) -> String {
    match value.into() {
        Some(v) if v.is_finite() => group(&format!("{v:.0}")),
        _ => "-".into(),
    }
}

/// `value` with `digits` decimals, or `-`.
pub fn fixed(value: Option<f64>, digits: usize) -> String {
    value.map_or_else(|| "-".into(), |v| format!("{v:.digits$}"))
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
    let [start, end] = meta.load_average.map(|load| fixed(load, 2));
    format!(
        "# {title}\n\nBroker: {} on {}  \n{conditions}; {} CPU(s)  \nLily {}; load average {start} \
         at start, {end} at end; {:.0} s\n\n",
        meta.broker, meta.broker_url, meta.cpus, meta.lily_revision, meta.wall_secs
    )
}

/// `out` and the notes, one bullet each.
fn with_notes(mut out: String, meta: &Meta) -> String {
    for note in &meta.notes {
        let _ = writeln!(out, "- {note}");
    }
    out
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
    use throughput::{CaseResult, Contender, Path, Ratio};
    let conditions = format!(
        "{} messages a run, persistent; {} repetition(s), contenders taking turns run by run, in reverse order every other repetition; medians, [lowest–highest] of the repetitions' ratios; a target is met when, over at least {} repetitions, the median is within 3 % of it and the range reaches it; raw-batch again / raw-batch is the A/A ratio of the same run",
        r.messages_per_run,
        r.repetitions,
        throughput::RULE_REPS
    );
    let mut out = opening("Throughput", &r.meta, &conditions);
    for path in [Path::Success, Path::Handoff] {
        let cases: Vec<_> = r.cases.iter().filter(|c| c.path == path).collect();
        if cases.is_empty() {
            continue;
        }
        let who = Contender::those(|w| cases.iter().any(|c| c.runs(w).is_some()));
        let others = who
            .iter()
            .filter(|w| !matches!(w, Contender::Lily | Contender::RawBatchAgain));
        let aa = cases.iter().any(|c| c.aa.is_some());
        let head = |units: &[&str]| {
            let cells = units
                .iter()
                .flat_map(|u| who.iter().map(move |w| format!("|{} {u}", w.name())));
            "path|queue|prefetch".to_owned() + &cells.collect::<String>()
        };
        let mut ratios: String = others
            .clone()
            .map(|w| format!("|Lily / {}", w.name()))
            .collect();
        if aa {
            ratios += "|A/A: raw-batch again / raw-batch";
        }
        let key = |c: &CaseResult| {
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
            let mut table = Table::new(&(head(&["msg/s"]) + &ratios), 2);
            for c in &cases {
                let rates = who.iter().map(|&w| {
                    let runs = c.runs(w);
                    rate(if steady {
                        runs.and_then(|x| x.median_steady_msgs_per_sec)
                    } else {
                        runs.map(|x| x.median_msgs_per_sec)
                    })
                });
                let cell = |x: Option<&Ratio>| match x {
                    Some(x) if steady => ratio(x.steady, &x.steady_runs, x.target, true),
                    Some(x) => ratio(Some(x.value), &x.runs, x.target, true),
                    None => "-".into(),
                };
                let ratios = others.clone().map(|&w| cell(c.ratio(w)));
                let aa = aa.then(|| cell(c.aa.as_ref()));
                let flag = (!c.all_runs_complete).then(|| "incomplete runs!".to_owned());
                let cells = key(c).into_iter().chain(rates).chain(ratios);
                table.row(cells.chain(aa).chain(flag));
            }
            out += &table.end();
        }
        let _ = writeln!(
            out,
            "CPU per message, {} path (median µs, connect to close; client = this process, broker = the Erlang VM):\n",
            path.name()
        );
        let cpu_head = head(&["client", "broker"]) + "|Lily / raw-batch client|A/A client";
        let mut table = Table::new(&cpu_head, 2);
        for c in &cases {
            let cpu = |pick: fn(&throughput::Runs) -> Option<f64>| {
                who.iter().map(move |&w| fixed(c.runs(w).and_then(pick), 1))
            };
            let client = cpu(|x| x.client_cpu_us_per_msg);
            let broker = cpu(|x| x.broker_cpu_us_per_msg);
            let target = (path == Path::Success).then_some(throughput::CPU_TARGET);
            let ratios = [
                (c.ratio(Contender::RawBatch), target),
                (c.aa.as_ref(), None),
            ]
            .map(|(x, t)| x.map_or("-".into(), |x| ratio(x.cpu, &x.cpu_runs, t, false)));
            table.row(key(c).into_iter().chain(client).chain(broker).chain(ratios));
        }
        out += &table.end();
    }
    if let Some(first) = r.starts.first() {
        let who = Contender::those(|w| r.starts.iter().any(|s| s.contender == w));
        let _ = writeln!(
            out,
            "Start, success path (ms from consumer start until one waiting message is settled: connect, topology, consume; median of {}, contenders taking turns):\n",
            first.ms.len()
        );
        let head: String = who.iter().map(|w| format!("|{} ms", w.name())).collect();
        let mut table = Table::new(&format!("queue{head}|Lily − raw-batch ms"), 1);
        for kind in r.starts.chunk_by(|a, b| a.queue_type == b.queue_type) {
            let median = |w| kind.iter().find(|s| s.contender == w).map(|s| s.median_ms);
            let over = median(Contender::Lily)
                .zip(median(Contender::RawBatch))
                .map(|(l, b)| l - b);
            let medians = who.iter().map(|&w| fixed(median(w), 1));
            let cells = [kind[0].queue_type.to_owned()].into_iter().chain(medians);
            table.row(cells.chain([fixed(over, 1)]));
        }
        out += &table.end();
    }
    with_notes(out, &r.meta)
}

/// `1.023 (≥ 1.00 met) [0.931–1.024]`: a ratio, its verdict against `target` by
/// [`throughput::meets`] (`floor`: at least, else at most) and its spread; `-` without one.
fn ratio(value: Option<f64>, runs: &[f64], target: Option<f64>, floor: bool) -> String {
    let Some(v) = value else { return "-".into() };
    let met = target.and_then(|t| throughput::meets(v, runs, t, floor));
    format!("{v:.3}{}{}", verdict(target, met, floor), spread(runs))
}

/// The throughput chart: a panel per path, a group per queue type × prefetch, a bar per
/// contender.
pub fn throughput_chart(r: &throughput::Results) -> String {
    use throughput::{Contender, Path};
    let what = format!("{} messages a run", r.messages_per_run);
    let mut chart = Chart::new("Throughput (median msg/s)", &subtitle(&r.meta, &what));
    for path in [Path::Success, Path::Handoff] {
        let cases: Vec<_> = r.cases.iter().filter(|c| c.path == path).collect();
        if cases.is_empty() {
            continue;
        }
        let who = Contender::those(|w| {
            w != Contender::RawBatchAgain && cases.iter().any(|c| c.runs(w).is_some())
        });
        let names: Vec<&str> = who.iter().map(|w| w.name()).collect();
        let groups: Vec<_> = cases
            .iter()
            .map(|c| {
                let label = format!("{} {}", c.queue_type, c.prefetch);
                let medians = who
                    .iter()
                    .map(|&w| c.runs(w).map(|x| x.median_msgs_per_sec));
                (label, medians.collect())
            })
            .collect();
        chart.bars(
            &format!("{} path", path.name()),
            "msg/s",
            &names,
            &groups,
            false,
        );
    }
    chart.finish()
}

/// `1.23`: microseconds as milliseconds.
pub fn ms(us: u32) -> String {
    format!("{:.2}", f64::from(us) / 1000.0)
}

/// Share of `latencies` over `bound` ms (one of [`HISTOGRAM_MS`]), in %.
#[allow(clippy::cast_precision_loss)]
fn over(latencies: &Latencies, bound: u32) -> String {
    let slot = HISTOGRAM_MS.iter().position(|&ms| ms == bound);
    let over: usize = latencies.histogram[slot.map_or(HISTOGRAM_MS.len(), |i| i + 1)..]
        .iter()
        .sum();
    let share = 100.0 * over as f64 / latencies.samples.max(1) as f64;
    format!("{share:.2} %")
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
    let title = "Settlement latency: Lily and raw-batch";
    let mut out = opening(title, &r.meta, &conditions);
    let head = "path|prefetch|load|target msg/s|published msg/s|contender|settled msg/s|p50 ms|p99 ms|p99.9 ms|> 100 ms|kept up|p99 Lily − raw-batch (target)";
    let mut table = Table::new(head, 2);
    let load = |c: &latency::Case| format!("{:.0} %", c.load * 100.0);
    for c in &r.cases {
        let diffs: Vec<String> = c
            .rounds_p99_diff_ms
            .iter()
            .map(|d| format!("{d:+.2}"))
            .collect();
        let rounds = match diffs.len() {
            0 | 1 => String::new(),
            n => format!(", median of {n}: {}", diffs.join(", ")),
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
        let head = "path|prefetch|load|contender|copy p50 ms|copy p99 ms|copy p99.9 ms|copies > 50 ms|settled p99 ms";
        let mut table = Table::new(head, 1);
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
    let head = "path|prefetch|Lily drained|raw-batch drained|offered|Lily settled under load|raw-batch settled under load|used";
    let mut table = Table::new(head, 1);
    // One row a path × prefetch: its cases share the maximum rate.
    for c in r.cases.iter().filter(|c| c.load == latency::LOADS[0]) {
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
        ];
        table.row(
            [c.path.name().into(), c.prefetch.to_string()]
                .into_iter()
                .chain(rates.map(rate))
                .chain([format!("{}{how}", rate(m.used))]),
        );
    }
    with_notes(out + &table.end(), &r.meta)
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
                let values = [b.p50_us, b.p99_us, l.p50_us, l.p99_us];
                let label = format!("prefetch {}, {:.0} %", c.prefetch, c.load * 100.0);
                (
                    label,
                    values.map(|us| Some(f64::from(us) / 1000.0)).to_vec(),
                )
            })
            .collect();
        if !groups.is_empty() {
            let title = format!("{} path", path.name());
            chart.bars(&title, "ms, log scale", &series, &groups, true);
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
    let title = "Failure storm: 100 % retryable failures";
    let mut out = opening(title, &r.meta, &conditions);
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
    with_notes(out, &r.meta)
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
        let points =
            |run: &storm::StormRun| run.series.iter().map(|s| (f64::from(s.t), y(s))).collect();
        r.runs
            .iter()
            .map(|run| (run.contender.name(), points(run)))
            .collect()
    };
    let handoffs = series(|s| s.handoffs as f64);
    chart.lines(
        "Handoffs a second",
        "handoffs/s over the run's seconds",
        &handoffs,
    );
    let rss = series(|s| s.rss_bytes as f64 / 1_048_576.0);
    chart.lines("This process's RSS", "MiB over the run's seconds", &rss);
    chart.finish()
}

/// The Mongo scope report: rates and ratios, mongod's operations, the verdicts.
pub fn mongo(r: &mongo::Results) -> String {
    let conditions = format!(
        "Database: {} on {}  \nQueue: {}; {}-byte JSON orders, persistent, pre-published; {} repetition(s) alternating the contenders; medians",
        r.mongodb, r.mongodb_url, r.queue_type, r.meta.message_bytes, r.repetitions
    );
    let title = "The Mongo scope against a driver transaction";
    let mut out = opening(title, &r.meta, &conditions);
    let head = "case|N|concurrency|prefetch|contender|msgs/s|/ raw|runs' range|target|tries/msg|conflicts/msg|DLQ + parked|verified|client µs/msg|mongod µs/msg|broker µs/msg|mongod ops/msg";
    let mut table = Table::new(head, 1);
    let mut ops = Table::new("case|contender|insert|update|query|delete|command", 2);
    let mut published = Table::new("case|contender|published p50 ms|published p99 ms", 2);
    for case in &r.cases {
        let load = &case.load;
        for c in &case.contenders {
            let target = match verdict(c.over_raw_target, c.over_raw_met, true) {
                v if v.is_empty() => "-".to_owned(),
                v => v.trim().to_owned(),
            };
            let range = c
                .over_raw_range
                .map_or_else(|| "-".into(), |(l, h)| format!("{l:.3}–{h:.3}"));
            row!(table; load.case.name(), load.n, load.concurrency, load.prefetch, c.contender.name(), rate(c.median_msgs_per_sec), fixed(c.over_raw, 3), range, target, format!("{:.3}", c.attempts_per_msg), format!("{:.3}", c.conflicts_per_msg), c.dead_lettered_or_parked, (if c.all_verified { "yes" } else { "**no**" }), fixed(c.client_cpu_us_per_msg, 1), fixed(c.mongod_cpu_us_per_msg, 1), fixed(c.broker_cpu_us_per_msg, 1), fixed(c.mongod_ops_per_msg.as_ref().map(|o| o.values().sum()), 2));
            if let Some(o) = &c.mongod_ops_per_msg {
                let values = ["insert", "update", "query", "delete", "command"].map(|k| o[k]);
                let names = [load.case.name().into(), c.contender.name().into()];
                ops.row(names.into_iter().chain(values.map(|v| format!("{v:.2}"))));
            }
            if load.case == mongo::Case::Outbox {
                row!(published; load.case.name(), c.contender.name(), fixed(c.published_p50_ms, 1), fixed(c.published_p99_ms, 1));
            }
        }
    }
    out += &table.end();
    if r.cases.iter().any(|c| c.load.case == mongo::Case::Outbox) {
        out += "The outbox case's events, from the commit's start to the confirm (raw: published after the commit) or from staging to the sent mark (Lily: the relay; the database's clock, millisecond resolution); medians of each run's percentiles:\n\n";
        out += &published.end();
    }
    out += "mongod operations per message (median; `serverStatus.opcounters` over the run):\n\n";
    with_notes(out + &ops.end(), &r.meta)
}

/// The Mongo chart: a group per case, a bar per contender.
pub fn mongo_chart(r: &mongo::Results) -> String {
    let what = format!("{}, {} repetition(s)", r.mongodb, r.repetitions);
    let mut chart = Chart::new("The Mongo scope (median msg/s)", &subtitle(&r.meta, &what));
    // Every case runs the same contenders, in the same order.
    let first = r.cases.first().map_or(&[][..], |case| &case.contenders);
    let names: Vec<&str> = first.iter().map(|c| c.contender.name()).collect();
    let groups: Vec<_> = r
        .cases
        .iter()
        .map(|case| {
            let load = &case.load;
            let label = format!("{}, concurrency {}", load.case.name(), load.concurrency);
            let rates = case.contenders.iter().map(|c| Some(c.median_msgs_per_sec));
            (label, rates.collect())
        })
        .collect();
    chart.bars("Messages a second", "msg/s", &names, &groups, false);
    chart.finish()
}

/// The cost report: a row a measure (raw lapin, Lily, Lily's layer, target, met).
pub fn cost(r: &cost::Results) -> String {
    let mut table = Table::new("measure|raw lapin|Lily|Lily's layer|target|met", 1);
    let dash = || "-".to_owned();
    let num = |v: f64, digits: usize| group(&format!("{v:.digits$}"));
    let met = |ok: bool| if ok { "yes" } else { "NO" }.to_owned();
    #[allow(clippy::cast_precision_loss)]
    let mib = |bytes: u64| format!("{:.1}", bytes as f64 / 1_048_576.0);
    if let Some(i) = &r.instructions {
        row!(table; format!("instructions / message (callgrind, N={})", i.n), num(i.raw, 0), num(i.lily, 0), num(i.lily_layer, 0), "<= 8 000", met(i.met));
    }
    if let Some(per) = r.reader {
        // Its share of Lily's whole cost a message, when the instructions ran too.
        let share = r.instructions.as_ref().map(|i| per / i.lily);
        let target = share.map_or_else(
            || "< 5 % of Lily".into(),
            |x| format!("< 5 % of Lily: {:.1} %", x * 100.0),
        );
        row!(table; "  of it, the frame reader (wire.rs), instructions / message", dash(), num(per, 0), dash(), target, share.map_or_else(dash, |x| met(x < 0.05)));
    }
    if let Some(a) = &r.allocations {
        row!(table; format!("heap allocations / message (alloc+realloc, N={})", a.n), num(a.raw, 2), num(a.lily, 2), num(a.lily_layer, 2), "<= 10", met(a.met));
    }
    if let Some(m) = &r.memory {
        let layer = m.lily.rss_per_delivery - m.raw.rss_per_delivery;
        row!(table; format!("RSS bytes per in-flight delivery ({} held)", m.in_flight), num(m.raw.rss_per_delivery, 0), num(m.lily.rss_per_delivery, 0), num(layer, 0), dash(), dash());
    }
    if let Some(d) = &r.shutdown {
        row!(table; format!("shutdown, idle: SIGTERM to exit, ms (median of {})", d.runs), dash(), num(d.median_ms, 1), dash(), "< 200", met(d.met));
    }
    if let Some(h) = &r.hostile {
        let (raw, lily) = (&h.raw, &h.lily);
        let all = raw.settled == raw.sent && lily.settled == lily.sent;
        let settled = |r: &cost::hostile::Run| format!("{}/{}", r.settled, r.sent);
        row!(table; format!("hostile load, {} msgs at prefetch {}: peak RSS (VmHWM), MiB", h.n, h.prefetch), mib(raw.hwm_bytes), mib(lily.hwm_bytes), dash(), format!("<= {}", mib(lily.bound_bytes)), met(lily.hwm_bytes <= lily.bound_bytes));
        row!(table; "  idle RSS, MiB", mib(raw.rss_idle_bytes), mib(lily.rss_idle_bytes), dash(), dash(), dash());
        row!(table; format!("  bound: {}, MiB", h.bound_formula), mib(raw.bound_bytes), mib(lily.bound_bytes), dash(), dash(), dash());
        row!(table; "  peak / bound", format!("{:.2}", raw.peak_over_bound), format!("{:.2}", lily.peak_over_bound), dash(), "<= 1", met(lily.peak_over_bound <= 1.0));
        row!(table; "  drain of the full queue, msg/s", rate(raw.msgs_per_s), rate(lily.msgs_per_s), dash(), dash(), dash());
        row!(table; "  messages settled, checked by id from outside", settled(raw), settled(lily), dash(), "all", met(all));
        row!(table; "  of which not where their class says (Lily)", dash(), lily.unexpected, dash(), dash(), dash());
    }
    for error in &r.errors {
        table.row([error.as_str(), "error", "-", "-", "-", "-"]);
    }
    let conditions = format!(
        "classic queues, {}-byte persistent JSON messages; prefetch {}, tokio current-thread runtime for the per-message cost; Lily's layer = Lily − a hand-written lapin consumer that deserializes and ACKs each message as Lily does",
        r.meta.message_bytes, r.prefetch
    );
    with_notes(
        opening("Cost", &r.meta, &conditions) + &table.end(),
        &r.meta,
    )
}
