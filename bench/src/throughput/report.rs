//! Results: the machine-readable file, the human table, the markdown table and the SVG chart.

use std::fmt::Write as _;

use serde::Serialize;

use crate::median;
use crate::throughput::{Contender, PEER_TARGET, Path, Sample};

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
}

/// One path × queue type × prefetch, all its runs and their medians.
#[derive(Debug, Serialize)]
pub struct CaseResult {
    pub path: Path,
    pub queue_type: &'static str,
    pub prefetch: u16,
    pub raw: Vec<Sample>,
    pub lily: Vec<Sample>,
    pub peer: Vec<Sample>,
    pub raw_median: f64,
    pub lily_median: f64,
    pub peer_median: Option<f64>,
    pub lily_over_raw: f64,
    pub lily_over_raw_target: f64,
    pub lily_over_raw_met: bool,
    pub lily_over_peer: Option<f64>,
    pub lily_over_peer_target: Option<f64>,
    pub lily_over_peer_met: Option<bool>,
    pub all_runs_complete: bool,
    /// Median client CPU µs per message: raw, Lily, peer.
    pub client_cpu_us_per_msg: [Option<f64>; 3],
    /// Median broker CPU µs per message: raw, Lily, peer.
    pub broker_cpu_us_per_msg: [Option<f64>; 3],
    /// Optional stricter baseline: raw lapin with a task per delivery (`--contenders raw-tasks`).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub raw_tasks: Vec<Sample>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub raw_tasks_median: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub lily_over_raw_tasks: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub raw_tasks_client_cpu_us_per_msg: Option<f64>,
}

impl CaseResult {
    pub fn new(
        path: Path,
        queue_type: &'static str,
        prefetch: u16,
        raw: Vec<Sample>,
        lily: Vec<Sample>,
        peer: Vec<Sample>,
    ) -> Self {
        let med = |s: &[Sample]| median(&mut s.iter().map(|x| x.msgs_per_sec).collect::<Vec<_>>());
        let raw_median = med(&raw);
        let lily_median = med(&lily);
        let peer_median = (!peer.is_empty()).then(|| med(&peer));
        let lily_over_raw = lily_median / raw_median;
        let lily_over_peer = peer_median.map(|p| lily_median / p);
        let all_runs_complete = raw.iter().chain(&lily).chain(&peer).all(|s| s.complete);
        let cpu = |s: &[Sample], f: fn(&Sample) -> Option<f64>| {
            let mut v: Vec<f64> = s.iter().filter_map(f).collect();
            (!v.is_empty()).then(|| median(&mut v))
        };
        let client = |s: &Sample| s.client_cpu_us_per_msg;
        let broker = |s: &Sample| s.broker_cpu_us_per_msg;
        let client_cpu_us_per_msg = [cpu(&raw, client), cpu(&lily, client), cpu(&peer, client)];
        let broker_cpu_us_per_msg = [cpu(&raw, broker), cpu(&lily, broker), cpu(&peer, broker)];
        Self {
            path,
            queue_type,
            prefetch,
            raw_median,
            lily_median,
            peer_median,
            lily_over_raw,
            lily_over_raw_target: path.raw_target(),
            lily_over_raw_met: lily_over_raw >= path.raw_target(),
            lily_over_peer,
            lily_over_peer_target: lily_over_peer.map(|_| PEER_TARGET),
            lily_over_peer_met: lily_over_peer.map(|r| r >= PEER_TARGET),
            all_runs_complete,
            client_cpu_us_per_msg,
            broker_cpu_us_per_msg,
            raw_tasks: Vec::new(),
            raw_tasks_median: None,
            lily_over_raw_tasks: None,
            raw_tasks_client_cpu_us_per_msg: None,
            raw,
            lily,
            peer,
        }
    }
}

impl CaseResult {
    /// Records the optional raw-lapin-with-tasks runs.
    pub fn add_raw_tasks(&mut self, samples: Vec<Sample>) {
        if samples.is_empty() {
            return;
        }
        let mut rates: Vec<f64> = samples.iter().map(|s| s.msgs_per_sec).collect();
        let m = median(&mut rates);
        let mut cpu: Vec<f64> = samples
            .iter()
            .filter_map(|s| s.client_cpu_us_per_msg)
            .collect();
        self.raw_tasks_client_cpu_us_per_msg = (!cpu.is_empty()).then(|| median(&mut cpu));
        self.raw_tasks_median = Some(m);
        self.lily_over_raw_tasks = Some(self.lily_median / m);
        self.all_runs_complete &= samples.iter().all(|s| s.complete);
        self.raw_tasks = samples;
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

fn ratio(value: f64, target: f64) -> String {
    let mark = if value >= target { "ok" } else { "MISS" };
    format!("{value:.3} (>= {target:.2} {mark})")
}

fn header_lines(results: &Results) -> Vec<String> {
    vec![
        format!("Broker: {} on {}", results.broker, results.broker_url),
        format!(
            "Messages: {} a run, {}-byte JSON, persistent; {} repetition(s) alternating raw/Lily/peer; medians; {} CPU(s)",
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

/// The human table printed to stdout.
pub fn human(results: &Results) -> String {
    let mut out = String::new();
    for line in header_lines(results) {
        let _ = writeln!(out, "{line}");
    }
    let _ = writeln!(
        out,
        "{:<8} {:<8} {:>8} {:>12} {:>12} {:>17} {:>24} {:>24}",
        "path",
        "queue",
        "prefetch",
        "raw msg/s",
        "Lily msg/s",
        "ruststream msg/s",
        "Lily/raw",
        "Lily/peer"
    );
    for c in &results.cases {
        let _ = writeln!(
            out,
            "{:<8} {:<8} {:>8} {:>12} {:>12} {:>17} {:>24} {:>24}{}",
            c.path.name(),
            c.queue_type,
            c.prefetch,
            rate(c.raw_median),
            rate(c.lily_median),
            c.peer_median.map_or_else(|| "-".into(), rate),
            ratio(c.lily_over_raw, c.lily_over_raw_target),
            c.lily_over_peer
                .map_or_else(|| "-".into(), |r| ratio(r, PEER_TARGET)),
            if c.all_runs_complete {
                ""
            } else {
                "  (incomplete runs!)"
            },
        );
    }
    for c in results
        .cases
        .iter()
        .filter(|c| c.raw_tasks_median.is_some())
    {
        let _ = writeln!(
            out,
            "  extra baseline {} {} prefetch {}: raw lapin with a task per delivery {} msg/s (client CPU {} µs/msg); Lily / it = {:.3}",
            c.path.name(),
            c.queue_type,
            c.prefetch,
            c.raw_tasks_median.map_or_else(|| "-".into(), rate),
            us(c.raw_tasks_client_cpu_us_per_msg),
            c.lily_over_raw_tasks.unwrap_or(f64::NAN),
        );
    }
    let _ = writeln!(
        out,
        "\nCPU per message (median µs; client = this process, broker = the Erlang VM, connect to close):"
    );
    let _ = writeln!(
        out,
        "{:<8} {:<8} {:>8} {:>11} {:>11} {:>11} {:>11} {:>11} {:>11}",
        "path",
        "queue",
        "prefetch",
        "raw client",
        "Lily client",
        "peer client",
        "raw broker",
        "Lily broker",
        "peer broker"
    );
    for c in &results.cases {
        let [a, b, p] = c.client_cpu_us_per_msg.map(us);
        let [x, y, z] = c.broker_cpu_us_per_msg.map(us);
        let _ = writeln!(
            out,
            "{:<8} {:<8} {:>8} {a:>11} {b:>11} {p:>11} {x:>11} {y:>11} {z:>11}",
            c.path.name(),
            c.queue_type,
            c.prefetch,
        );
    }
    for note in &results.notes {
        let _ = writeln!(out, "Note: {note}");
    }
    out
}

fn us(value: Option<f64>) -> String {
    value.map_or_else(|| "-".into(), |v| format!("{v:.1}"))
}

/// The markdown table for the README.
pub fn markdown(results: &Results) -> String {
    let mut out = String::new();
    for line in header_lines(results) {
        let _ = writeln!(out, "{line}  ");
    }
    let _ = writeln!(out);
    let _ = writeln!(
        out,
        "| path | queue | prefetch | raw lapin msg/s | Lily msg/s | ruststream-lapin msg/s | Lily / raw (target) | Lily / peer (target) |"
    );
    let _ = writeln!(out, "|---|---|---:|---:|---:|---:|---:|---:|");
    for c in &results.cases {
        let _ = writeln!(
            out,
            "| {} | {} | {} | {} | {} | {} | {:.3} (≥ {:.2}{}) | {} |",
            c.path.name(),
            c.queue_type,
            c.prefetch,
            rate(c.raw_median),
            rate(c.lily_median),
            c.peer_median.map_or_else(|| "–".into(), rate),
            c.lily_over_raw,
            c.lily_over_raw_target,
            if c.lily_over_raw_met { "" } else { ", missed" },
            c.lily_over_peer.map_or_else(
                || "–".into(),
                |r| format!(
                    "{r:.3} (≥ {PEER_TARGET:.2}{})",
                    if r >= PEER_TARGET { "" } else { ", missed" }
                )
            ),
        );
    }
    for c in results
        .cases
        .iter()
        .filter(|c| c.raw_tasks_median.is_some())
    {
        let _ = writeln!(
            out,
            "\nExtra baseline, {} {} prefetch {}: raw lapin with a task per delivery {} msg/s; Lily / it = {:.3}.",
            c.path.name(),
            c.queue_type,
            c.prefetch,
            c.raw_tasks_median.map_or_else(|| "–".into(), rate),
            c.lily_over_raw_tasks.unwrap_or(f64::NAN),
        );
    }
    let _ = writeln!(out);
    let _ = writeln!(
        out,
        "CPU per message (median µs, connect to close; client = the benchmark process, broker = the RabbitMQ VM):"
    );
    let _ = writeln!(out);
    let _ = writeln!(
        out,
        "| path | queue | prefetch | raw lapin client | Lily client | ruststream-lapin client | raw lapin broker | Lily broker | ruststream-lapin broker |"
    );
    let _ = writeln!(out, "|---|---|---:|---:|---:|---:|---:|---:|---:|");
    for c in &results.cases {
        let [a, b, p] = c.client_cpu_us_per_msg.map(us);
        let [x, y, z] = c.broker_cpu_us_per_msg.map(us);
        let _ = writeln!(
            out,
            "| {} | {} | {} | {a} | {b} | {p} | {x} | {y} | {z} |",
            c.path.name(),
            c.queue_type,
            c.prefetch,
        );
    }
    let _ = writeln!(out);
    for note in &results.notes {
        let _ = writeln!(out, "- {note}");
    }
    out
}

const COLORS: [(Contender, &str); 3] = [
    (Contender::Raw, "#8c8c8c"),
    (Contender::Lily, "#c2185b"),
    (Contender::Peer, "#1f77b4"),
];

/// Grouped bars of median msgs/s by queue type × prefetch: one panel per path.
pub fn svg(results: &Results) -> String {
    let width = 960.0;
    let panel_h = 300.0;
    let top = 70.0;
    let gap = 70.0;
    let paths: Vec<Path> = [Path::Success, Path::Handoff]
        .into_iter()
        .filter(|p| results.cases.iter().any(|c| c.path == *p))
        .collect();
    #[allow(clippy::cast_precision_loss)]
    let height = top + (panel_h + gap) * paths.len() as f64 + 20.0;
    let mut s = String::new();
    let _ = writeln!(
        s,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" viewBox="0 0 {width} {height}" font-family="sans-serif" font-size="12">"#
    );
    let _ = writeln!(
        s,
        r#"<rect width="100%" height="100%" fill="white"/><text x="{}" y="24" text-anchor="middle" font-size="16" font-weight="bold">Throughput (median msgs/s): raw lapin, Lily, ruststream-lapin</text>"#,
        width / 2.0
    );
    let _ = writeln!(
        s,
        r##"<text x="{}" y="44" text-anchor="middle" fill="#555">{}, {}-byte JSON, {} messages a run, {} repetition(s)</text>"##,
        width / 2.0,
        escape(&results.broker),
        results.message_bytes,
        results.messages_per_run,
        results.repetitions
    );
    // legend
    let mut lx = width - 370.0;
    for (who, color) in COLORS {
        let _ = writeln!(
            s,
            r#"<rect x="{lx}" y="54" width="12" height="12" fill="{color}"/><text x="{}" y="64">{}</text>"#,
            lx + 16.0,
            who.name()
        );
        lx += 120.0;
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
    let max = cases
        .iter()
        .flat_map(|c| [Some(c.raw_median), Some(c.lily_median), c.peer_median])
        .flatten()
        .filter(|v| v.is_finite())
        .fold(0.0_f64, f64::max);
    let (step, top) = nice_axis(max);
    let title = match path {
        Path::Success => "Success path: deserialize + ACK",
        Path::Handoff => "Handoff path: confirmed retry copy + ACK (raw lapin pipelined vs Lily)",
    };
    let _ = writeln!(
        s,
        r#"<text x="{x0}" y="{}" font-size="14" font-weight="bold">{title}</text>"#,
        y0 - 8.0
    );
    // axis and grid
    let mut v = 0.0;
    while v <= top + step / 2.0 {
        let y = y0 + h - v / top * h;
        let _ = writeln!(
            s,
            r##"<line x1="{x0}" y1="{y:.1}" x2="{:.1}" y2="{y:.1}" stroke="#e0e0e0"/><text x="{:.1}" y="{:.1}" text-anchor="end" fill="#555">{}</text>"##,
            x0 + w,
            x0 - 6.0,
            y + 4.0,
            rate(v)
        );
        v += step;
    }
    let _ = writeln!(
        s,
        r#"<line x1="{x0}" y1="{y0}" x2="{x0}" y2="{:.1}" stroke="black"/><line x1="{x0}" y1="{:.1}" x2="{:.1}" y2="{:.1}" stroke="black"/>"#,
        y0 + h,
        y0 + h,
        x0 + w,
        y0 + h
    );
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
        let bars: Vec<(Contender, f64)> = [
            (Contender::Raw, Some(c.raw_median)),
            (Contender::Lily, Some(c.lily_median)),
            (Contender::Peer, c.peer_median),
        ]
        .into_iter()
        .filter_map(|(who, v)| v.map(|v| (who, v)))
        .collect();
        #[allow(clippy::cast_precision_loss)]
        let gx = x0 + group_w * g as f64;
        let bar_w = (group_w * 0.7 / 3.0).min(60.0);
        #[allow(clippy::cast_precision_loss)]
        let used = bar_w * bars.len() as f64;
        let start = gx + (group_w - used) / 2.0;
        for (b, (who, v)) in bars.iter().enumerate() {
            let v = if v.is_finite() { *v } else { 0.0 };
            let bh = v / top * h;
            #[allow(clippy::cast_precision_loss)]
            let x = start + bar_w * b as f64;
            let y = y0 + h - bh;
            let color = COLORS
                .iter()
                .find(|(c, _)| c == who)
                .map_or("#000", |(_, col)| col);
            let _ = writeln!(
                s,
                r#"<rect x="{x:.1}" y="{y:.1}" width="{:.1}" height="{bh:.1}" fill="{color}"><title>{} {} prefetch {}: {} msgs/s</title></rect><text x="{:.1}" y="{:.1}" text-anchor="middle" font-size="10">{}k</text>"#,
                bar_w - 2.0,
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
        let mut ratios = format!("Lily/raw {:.2}", c.lily_over_raw);
        if let Some(r) = c.lily_over_peer {
            let _ = write!(ratios, " · Lily/peer {r:.2}");
        }
        let _ = writeln!(
            s,
            r##"<text x="{:.1}" y="{:.1}" text-anchor="middle" fill="#555">{}</text>"##,
            gx + group_w / 2.0,
            y0 + h + 34.0,
            escape(&ratios)
        );
    }
}

fn format_k(v: f64) -> String {
    format!("{:.1}", v / 1000.0)
}

/// A tick step and an axis top (a multiple of the step) above `max`.
fn nice_axis(max: f64) -> (f64, f64) {
    if max <= 0.0 || !max.is_finite() {
        return (1000.0, 5000.0);
    }
    let raw = max / 5.0;
    let mag = 10f64.powf(raw.log10().floor());
    let step = [1.0, 2.0, 2.5, 5.0, 10.0]
        .into_iter()
        .map(|m| m * mag)
        .find(|s| *s >= raw)
        .unwrap_or(10.0 * mag);
    let top = (max / step).ceil() * step;
    (step, top.max(step))
}

fn escape(text: &str) -> String {
    text.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}
