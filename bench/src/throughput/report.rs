//! Results: the machine-readable file, the human table, the markdown table and the SVG chart.

use std::fmt::Write as _;

use serde::Serialize;

use crate::throughput::{Contender, Path, Sample};
use crate::{escape, median, nice_axis};

/// Everything one benchmark run measured.
#[derive(Debug, Serialize)]
pub struct Results {
    pub benchmark: &'static str,
    pub broker: String,
    pub broker_url: String,
    pub message_bytes: usize,
    pub messages_per_run: u64,
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
    /// How long each contender takes to start, per queue type (success path).
    pub starts: Vec<Start>,
}

/// A contender's runs from its start until one waiting message is settled: connect, topology
/// (Lily's), `basic.consume` and one delivery.
#[derive(Debug, Serialize)]
pub struct Start {
    pub queue_type: &'static str,
    pub contender: Contender,
    pub ms: Vec<f64>,
    pub median_ms: f64,
}

impl Start {
    pub fn new(queue_type: &'static str, contender: Contender, samples: &[Sample]) -> Self {
        let ms: Vec<f64> = samples.iter().map(|s| s.secs * 1000.0).collect();
        let median_ms = median(&mut ms.clone());
        Self {
            queue_type,
            contender,
            ms,
            median_ms,
        }
    }
}

/// One contender's runs in a case and their medians.
#[derive(Debug, Serialize)]
pub struct Runs {
    pub contender: Contender,
    pub samples: Vec<Sample>,
    pub median_msgs_per_sec: f64,
    /// Median client CPU µs per message (this process, every thread).
    pub client_cpu_us_per_msg: Option<f64>,
    /// Median broker CPU µs per message (the Erlang VM).
    pub broker_cpu_us_per_msg: Option<f64>,
    /// Median steady rate: messages over the time from the first delivery on.
    pub median_steady_msgs_per_sec: Option<f64>,
}

/// Lily's median over another contender's, and the target where that contender is a bar.
#[derive(Debug, Serialize)]
pub struct Ratio {
    pub over: Contender,
    pub value: f64,
    pub target: Option<f64>,
    pub met: Option<bool>,
    /// Lily's rate over the other's in each repetition (the two ran one after the other): the
    /// spread of `value`.
    pub runs: Vec<f64>,
    /// The same over the steady rates (from each one's first delivery on), if both have them.
    pub steady: Option<f64>,
    pub steady_runs: Vec<f64>,
}

/// Each repetition's `lily / other` of `rate`, where both have it.
fn paired(lily: &[Sample], other: &[Sample], rate: impl Fn(&Sample) -> Option<f64>) -> Vec<f64> {
    lily.iter()
        .zip(other)
        .filter_map(|(l, o)| Some(rate(l)? / rate(o)?))
        .collect()
}

/// One path × queue type × prefetch, all its runs and their medians.
#[derive(Debug, Serialize)]
pub struct CaseResult {
    pub path: Path,
    pub queue_type: &'static str,
    pub prefetch: u16,
    pub runs: Vec<Runs>,
    /// Lily / each other contender.
    pub lily_over: Vec<Ratio>,
    pub all_runs_complete: bool,
}

impl CaseResult {
    pub fn new(
        path: Path,
        queue_type: &'static str,
        prefetch: u16,
        samples: Vec<(Contender, Vec<Sample>)>,
    ) -> Self {
        let med = |v: &mut Vec<f64>| (!v.is_empty()).then(|| median(v));
        let runs: Vec<Runs> = samples
            .into_iter()
            .filter(|(_, s)| !s.is_empty())
            .map(|(contender, samples)| Runs {
                contender,
                median_msgs_per_sec: median(
                    &mut samples.iter().map(|x| x.msgs_per_sec).collect::<Vec<_>>(),
                ),
                client_cpu_us_per_msg: med(&mut samples
                    .iter()
                    .filter_map(|x| x.client_cpu_us_per_msg)
                    .collect()),
                broker_cpu_us_per_msg: med(&mut samples
                    .iter()
                    .filter_map(|x| x.broker_cpu_us_per_msg)
                    .collect()),
                median_steady_msgs_per_sec: med(&mut samples
                    .iter()
                    .filter_map(|x| x.steady_msgs_per_sec)
                    .collect()),
                samples,
            })
            .collect();
        let all_runs_complete = runs.iter().flat_map(|r| &r.samples).all(|s| s.complete);
        let lily_over = runs
            .iter()
            .find(|r| r.contender == Contender::Lily)
            .map(|lily| {
                runs.iter()
                    .filter(|r| r.contender != Contender::Lily)
                    .map(|r| {
                        let value = lily.median_msgs_per_sec / r.median_msgs_per_sec;
                        let target = path.target(r.contender);
                        Ratio {
                            over: r.contender,
                            value,
                            target,
                            met: target.map(|t| value >= t),
                            runs: paired(&lily.samples, &r.samples, |s| Some(s.msgs_per_sec)),
                            steady: lily
                                .median_steady_msgs_per_sec
                                .zip(r.median_steady_msgs_per_sec)
                                .map(|(l, o)| l / o),
                            steady_runs: paired(&lily.samples, &r.samples, |s| {
                                s.steady_msgs_per_sec
                            }),
                        }
                    })
                    .collect()
            })
            .unwrap_or_default();
        Self {
            path,
            queue_type,
            prefetch,
            runs,
            lily_over,
            all_runs_complete,
        }
    }

    /// The median msgs/s of `who`, if it ran.
    pub fn median(&self, who: Contender) -> Option<f64> {
        self.runs(who).map(|r| r.median_msgs_per_sec)
    }

    pub fn runs(&self, who: Contender) -> Option<&Runs> {
        self.runs.iter().find(|r| r.contender == who)
    }

    /// Lily / `over`, if both ran.
    pub fn ratio(&self, over: Contender) -> Option<&Ratio> {
        self.lily_over.iter().find(|r| r.over == over)
    }
}

/// `12 345` msgs/s.
pub fn rate(value: f64) -> String {
    if !value.is_finite() {
        return "-".into();
    }
    #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
    let v = value.round() as u64;
    let digits = v.to_string();
    let mut out = String::new();
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i).is_multiple_of(3) {
            out.push(' ');
        }
        out.push(c);
    }
    out
}

fn ratio_text(r: &Ratio) -> String {
    let verdict = match (r.target, r.met) {
        (Some(t), Some(true)) => format!(" (≥ {t:.2} ok)"),
        (Some(t), _) => format!(" (≥ {t:.2} MISS)"),
        _ => String::new(),
    };
    format!("{:.3}{verdict}{}", r.value, spread(&r.runs))
}

/// The steady ratio, the target's verdict on it and its spread.
fn steady_text(r: &Ratio) -> String {
    let Some(value) = r.steady else {
        return "-".into();
    };
    let verdict = match r.target {
        Some(t) if value >= t => format!(" (≥ {t:.2} ok)"),
        Some(t) => format!(" (≥ {t:.2} MISS)"),
        None => String::new(),
    };
    format!("{value:.3}{verdict}{}", spread(&r.steady_runs))
}

/// ` [0.931–1.024]`: the lowest and highest of the repetitions' ratios, when there are two or
/// more.
fn spread(runs: &[f64]) -> String {
    if runs.len() < 2 {
        return String::new();
    }
    let lo = runs.iter().copied().fold(f64::INFINITY, f64::min);
    let hi = runs.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    format!(" [{lo:.3}–{hi:.3}]")
}

fn header_lines(results: &Results) -> Vec<String> {
    vec![
        format!("Broker: {} on {}", results.broker, results.broker_url),
        format!(
            "Messages: {} a run, {}-byte JSON, persistent; {} repetition(s), contenders taking turns run by run, in reverse order every other repetition; medians, [lowest–highest] of the repetitions' ratios; {} CPU(s)",
            results.messages_per_run, results.message_bytes, results.repetitions, results.cpus
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

/// The contenders that ran on `path`, in [`Contender::ALL`]'s order.
fn present(results: &Results, path: Path) -> Vec<Contender> {
    Contender::ALL
        .into_iter()
        .filter(|&who| {
            results
                .cases
                .iter()
                .any(|c| c.path == path && c.runs(who).is_some())
        })
        .collect()
}

fn paths(results: &Results) -> Vec<Path> {
    [Path::Success, Path::Handoff]
        .into_iter()
        .filter(|p| results.cases.iter().any(|c| c.path == *p))
        .collect()
}

/// One table per path: msgs/s of each contender, then Lily over each; then CPU per message.
/// `row` joins cells (the human table pads them, markdown puts pipes between).
fn tables(results: &Results, row: &dyn Fn(&[String]) -> String, rule: bool) -> String {
    let mut out = String::new();
    for path in paths(results) {
        let who = present(results, path);
        let others: Vec<Contender> = who
            .iter()
            .copied()
            .filter(|&w| w != Contender::Lily)
            .collect();
        let mut head = vec!["path".to_owned(), "queue".into(), "prefetch".into()];
        head.extend(who.iter().map(|w| format!("{} msg/s", w.name())));
        head.extend(others.iter().map(|w| format!("Lily / {}", w.name())));
        head_row(&mut out, &head, 2, row, rule);
        for c in results.cases.iter().filter(|c| c.path == path) {
            let mut cells = vec![
                c.path.name().to_owned(),
                c.queue_type.to_owned(),
                c.prefetch.to_string(),
            ];
            cells.extend(
                who.iter()
                    .map(|&w| c.median(w).map_or_else(|| "-".into(), rate)),
            );
            cells.extend(
                others
                    .iter()
                    .map(|&w| c.ratio(w).map_or_else(|| "-".into(), ratio_text)),
            );
            if !c.all_runs_complete {
                cells.push("incomplete runs!".into());
            }
            let _ = writeln!(out, "{}", row(&cells));
        }
        let _ = writeln!(out);
        out.push_str(&steady_table(results, path, &who, row, rule));
        let mut head = vec!["path".to_owned(), "queue".into(), "prefetch".into()];
        head.extend(who.iter().map(|w| format!("{} client", w.name())));
        head.extend(who.iter().map(|w| format!("{} broker", w.name())));
        let _ = writeln!(
            out,
            "CPU per message, {} path (median µs, connect to close; client = this process, broker = the Erlang VM):",
            path.name()
        );
        if rule {
            let _ = writeln!(out);
        }
        head_row(&mut out, &head, 2, row, rule);
        for c in results.cases.iter().filter(|c| c.path == path) {
            let mut cells = vec![
                c.path.name().to_owned(),
                c.queue_type.to_owned(),
                c.prefetch.to_string(),
            ];
            let runs = |w| c.runs(w);
            cells.extend(
                who.iter()
                    .map(|&w| us(runs(w).and_then(|r| r.client_cpu_us_per_msg))),
            );
            cells.extend(
                who.iter()
                    .map(|&w| us(runs(w).and_then(|r| r.broker_cpu_us_per_msg))),
            );
            let _ = writeln!(out, "{}", row(&cells));
        }
        let _ = writeln!(out);
    }
    out.push_str(&start_table(results, row, rule));
    out
}

/// Writes the header row `head` and, with `rule`, the markdown rule under it: the first `text`
/// columns left-aligned, the others right-aligned.
fn head_row(
    out: &mut String,
    head: &[String],
    text: usize,
    row: &dyn Fn(&[String]) -> String,
    rule: bool,
) {
    let _ = writeln!(out, "{}", row(head));
    if rule {
        let cells: Vec<String> = (0..head.len())
            .map(|i| {
                if i < text {
                    "---".into()
                } else {
                    "---:".into()
                }
            })
            .collect();
        let _ = writeln!(out, "{}", row(&cells));
    }
}

/// The steady rates of `path`: each contender's messages over the time from its first delivery
/// on, so that the start (measured on its own) is left out; Lily over each other contender.
fn steady_table(
    results: &Results,
    path: Path,
    who: &[Contender],
    row: &dyn Fn(&[String]) -> String,
    rule: bool,
) -> String {
    let mut out = String::new();
    let cases: Vec<&CaseResult> = results.cases.iter().filter(|c| c.path == path).collect();
    let steady = |c: &CaseResult, w| c.runs(w).and_then(|r| r.median_steady_msgs_per_sec);
    let who: Vec<Contender> = who
        .iter()
        .copied()
        .filter(|&w| cases.iter().any(|c| steady(c, w).is_some()))
        .collect();
    if !who.contains(&Contender::Lily) {
        return out;
    }
    let others: Vec<Contender> = who
        .iter()
        .copied()
        .filter(|&w| w != Contender::Lily)
        .collect();
    let _ = writeln!(
        out,
        "Steady rate, {} path (median msg/s from each contender's first delivery until N are settled: the start, timed on its own below, left out):",
        path.name()
    );
    if rule {
        let _ = writeln!(out);
    }
    let mut head = vec!["path".to_owned(), "queue".into(), "prefetch".into()];
    head.extend(who.iter().map(|w| format!("{} msg/s", w.name())));
    head.extend(others.iter().map(|w| format!("Lily / {}", w.name())));
    head_row(&mut out, &head, 2, row, rule);
    for c in cases {
        let mut cells = vec![
            c.path.name().to_owned(),
            c.queue_type.to_owned(),
            c.prefetch.to_string(),
        ];
        cells.extend(
            who.iter()
                .map(|&w| steady(c, w).map_or_else(|| "-".into(), rate)),
        );
        cells.extend(
            others
                .iter()
                .map(|&w| c.ratio(w).map_or_else(|| "-".into(), steady_text)),
        );
        let _ = writeln!(out, "{}", row(&cells));
    }
    let _ = writeln!(out);
    out
}

/// How long each contender takes to start, with Lily's time over raw-batch's.
fn start_table(results: &Results, row: &dyn Fn(&[String]) -> String, rule: bool) -> String {
    let mut out = String::new();
    let Some(first) = results.starts.first() else {
        return out;
    };
    let who: Vec<Contender> = Contender::ALL
        .into_iter()
        .filter(|&w| results.starts.iter().any(|s| s.contender == w))
        .collect();
    let runs = first.ms.len();
    let _ = writeln!(
        out,
        "Start, success path (ms from consumer start until one waiting message is settled: connect, topology, consume; median of {runs}, contenders taking turns, in reverse order every other time):"
    );
    if rule {
        let _ = writeln!(out);
    }
    let mut head = vec!["queue".to_owned()];
    head.extend(who.iter().map(|w| format!("{} ms", w.name())));
    head.push("Lily − raw-batch ms".into());
    head_row(&mut out, &head, 1, row, rule);
    let mut kinds: Vec<&str> = results.starts.iter().map(|s| s.queue_type).collect();
    kinds.dedup();
    for kind in kinds {
        let median = |w: Contender| {
            results
                .starts
                .iter()
                .find(|s| s.queue_type == kind && s.contender == w)
                .map(|s| s.median_ms)
        };
        let ms = |v: Option<f64>| v.map_or_else(|| "-".into(), |v| format!("{v:.1}"));
        let mut cells = vec![kind.to_owned()];
        cells.extend(who.iter().map(|&w| ms(median(w))));
        let over = median(Contender::Lily)
            .zip(median(Contender::RawBatch))
            .map(|(l, r)| l - r);
        cells.push(ms(over));
        let _ = writeln!(out, "{}", row(&cells));
    }
    let _ = writeln!(out);
    out
}

/// The human table printed to stdout.
pub fn human(results: &Results) -> String {
    let mut out = String::new();
    for line in header_lines(results) {
        let _ = writeln!(out, "{line}");
    }
    let _ = writeln!(out);
    let pad = |cells: &[String]| {
        cells
            .iter()
            .enumerate()
            .map(|(i, c)| {
                if i < 2 {
                    format!("{c:<8}")
                } else {
                    format!("{c:>14}")
                }
            })
            .collect::<Vec<_>>()
            .join(" ")
    };
    out.push_str(&tables(results, &pad, false));
    for note in &results.notes {
        let _ = writeln!(out, "Note: {note}");
    }
    out
}

fn us(value: Option<f64>) -> String {
    value.map_or_else(|| "-".into(), |v| format!("{v:.1}"))
}

/// The markdown tables for the README.
pub fn markdown(results: &Results) -> String {
    let mut out = String::new();
    for line in header_lines(results) {
        let _ = writeln!(out, "{line}  ");
    }
    let _ = writeln!(out);
    let pipes = |cells: &[String]| format!("| {} |", cells.join(" | "));
    out.push_str(&tables(results, &pipes, true));
    for note in &results.notes {
        let _ = writeln!(out, "- {note}");
    }
    out
}

fn color(who: Contender) -> &'static str {
    match who {
        Contender::Raw => "#8c8c8c",
        Contender::RawBatch => "#4d4d4d",
        Contender::Ceiling => "#2ca02c",
        Contender::Lily => "#c2185b",
        Contender::Peer => "#1f77b4",
        Contender::RawConcurrent => "#bcbd22",
    }
}

/// Grouped bars of median msgs/s by queue type × prefetch: one panel per path.
pub fn svg(results: &Results) -> String {
    let width = 1040.0;
    let panel_h = 300.0;
    let top = 70.0;
    let gap = 70.0;
    let paths = paths(results);
    #[allow(clippy::cast_precision_loss)]
    let height = top + (panel_h + gap) * paths.len() as f64 + 20.0;
    let mut s = String::new();
    let _ = writeln!(
        s,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" viewBox="0 0 {width} {height}" font-family="sans-serif" font-size="12">"#
    );
    let _ = writeln!(
        s,
        r#"<rect width="100%" height="100%" fill="white"/><text x="{}" y="24" text-anchor="middle" font-size="16" font-weight="bold">Throughput (median msgs/s): Lily against raw lapin, hand-tuned raw-batch and the no-ack ceiling</text>"#,
        width / 2.0
    );
    let _ = writeln!(
        s,
        r##"<text x="{}" y="44" text-anchor="middle" fill="#555">{}, {}-byte JSON, {} messages a run, {} repetition(s), Lily {}</text>"##,
        width / 2.0,
        escape(&results.broker),
        results.message_bytes,
        results.messages_per_run,
        results.repetitions,
        escape(&results.lily_revision),
    );
    let mut lx = 80.0;
    for who in Contender::ALL
        .into_iter()
        .filter(|&w| paths.iter().any(|&p| present(results, p).contains(&w)))
    {
        let _ = writeln!(
            s,
            r#"<rect x="{lx}" y="54" width="12" height="12" fill="{}"/><text x="{}" y="64">{}</text>"#,
            color(who),
            lx + 16.0,
            who.name()
        );
        lx += 150.0;
    }
    for (i, path) in paths.iter().enumerate() {
        #[allow(clippy::cast_precision_loss)]
        let y0 = top + (panel_h + gap) * i as f64 + 20.0;
        panel(&mut s, results, *path, 80.0, y0, width - 110.0, panel_h);
    }
    s.push_str("</svg>\n");
    s
}

fn panel(s: &mut String, results: &Results, path: Path, x0: f64, y0: f64, w: f64, h: f64) {
    let cases: Vec<&CaseResult> = results.cases.iter().filter(|c| c.path == path).collect();
    let who = present(results, path);
    let max = cases
        .iter()
        .flat_map(|c| c.runs.iter().map(|r| r.median_msgs_per_sec))
        .filter(|v| v.is_finite())
        .fold(0.0_f64, f64::max);
    let (step, top) = nice_axis(max, (1000.0, 5000.0));
    let title = match path {
        Path::Success => "Success path: deserialize + ACK",
        Path::Handoff => "Handoff path: confirmed retry copy + ACK",
    };
    let _ = writeln!(
        s,
        r#"<text x="{x0}" y="{}" font-size="14" font-weight="bold">{title}</text>"#,
        y0 - 8.0
    );
    crate::grid(s, (x0, y0, w, h), step, top, rate);
    let _ = writeln!(
        s,
        r##"<text transform="translate({:.1},{:.1}) rotate(-90)" text-anchor="middle" fill="#555">msgs/s</text>"##,
        x0 - 62.0,
        y0 + h / 2.0
    );
    if cases.is_empty() {
        return;
    }
    #[allow(clippy::cast_precision_loss)]
    let group_w = w / cases.len() as f64;
    for (g, c) in cases.iter().enumerate() {
        let bars: Vec<(Contender, f64)> = who
            .iter()
            .filter_map(|&w| c.median(w).map(|v| (w, v)))
            .collect();
        #[allow(clippy::cast_precision_loss)]
        let gx = x0 + group_w * g as f64;
        #[allow(clippy::cast_precision_loss)]
        let bar_w = (group_w * 0.8 / who.len().max(1) as f64).min(50.0);
        #[allow(clippy::cast_precision_loss)]
        let used = bar_w * bars.len() as f64;
        let start = gx + (group_w - used) / 2.0;
        for (b, (who, v)) in bars.iter().enumerate() {
            let v = if v.is_finite() { *v } else { 0.0 };
            let bh = v / top * h;
            #[allow(clippy::cast_precision_loss)]
            let x = start + bar_w * b as f64;
            let y = y0 + h - bh;
            let _ = writeln!(
                s,
                r#"<rect x="{x:.1}" y="{y:.1}" width="{:.1}" height="{bh:.1}" fill="{}"><title>{} {} prefetch {}: {} msgs/s</title></rect><text x="{:.1}" y="{:.1}" text-anchor="middle" font-size="10">{}k</text>"#,
                bar_w - 2.0,
                color(*who),
                who.name(),
                c.queue_type,
                c.prefetch,
                rate(v),
                x + (bar_w - 2.0) / 2.0,
                y - 3.0,
                format_k(v)
            );
        }
        let label = format!("{} · prefetch {}", c.queue_type, c.prefetch);
        let _ = writeln!(
            s,
            r#"<text x="{:.1}" y="{:.1}" text-anchor="middle">{}</text>"#,
            gx + group_w / 2.0,
            y0 + h + 18.0,
            escape(&label)
        );
        let ratios: Vec<String> = c
            .lily_over
            .iter()
            .filter(|r| r.target.is_some())
            .map(|r| format!("Lily/{} {:.2}", r.over.flag(), r.value))
            .collect();
        let _ = writeln!(
            s,
            r##"<text x="{:.1}" y="{:.1}" text-anchor="middle" fill="#555">{}</text>"##,
            gx + group_w / 2.0,
            y0 + h + 34.0,
            escape(&ratios.join(" · "))
        );
    }
}

fn format_k(v: f64) -> String {
    format!("{:.1}", v / 1000.0)
}
