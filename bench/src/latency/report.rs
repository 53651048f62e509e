//! Results of the latency benchmark: the human table, the markdown table and the SVG chart.

use std::fmt::Write as _;

use crate::escape;
use crate::latency::{Case, Contender, HISTOGRAM_MS, Latencies, MaxRate, Results, Run};
use crate::throughput::report::rate;

fn ms(us: u32) -> String {
    format!("{:.2}", f64::from(us) / 1000.0)
}

fn header_lines(results: &Results) -> Vec<String> {
    vec![
        format!("Broker: {} on {}", results.broker, results.broker_url),
        format!(
            "{}-byte JSON, persistent, classic queue; paced runs of {:.0} s, the first {:.0} s not timed; {} CPU(s)",
            results.message_bytes, results.run_secs, results.warmup_secs, results.cpus
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

fn keeps_up(run: &Run) -> String {
    let mut flags = Vec::new();
    if !run.publisher_reached_target {
        flags.push("publisher short of target");
    }
    if !run.kept_up {
        flags.push("fell behind");
    }
    if !run.backlog_bounded {
        flags.push("backlog grew");
    }
    if !run.complete {
        flags.push("incomplete");
    }
    if run.failed > 0 || run.unconfirmed > 0 {
        flags.push("failures");
    }
    if flags.is_empty() {
        "yes".into()
    } else {
        flags.join(", ")
    }
}

/// Share of the timed deliveries that took over 100 ms, in %.
fn over_100ms(run: &Run) -> f64 {
    over(&run.latency, 100)
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

/// Handoff path: each run that timed its copies from their publish to their confirm, with
/// those times.
fn copy_runs(results: &Results) -> impl Iterator<Item = (&Case, &Run, &Latencies)> {
    results.cases.iter().flat_map(|c| {
        [&c.raw_batch, &c.lily]
            .into_iter()
            .filter_map(move |run| Some((c, run, run.copy_confirms.as_ref()?)))
    })
}

/// The cells of a copy row: path, prefetch, load, contender, copy p50, p99 and p99.9 (ms), the
/// share over 50 ms and the settlement's p99 (ms).
fn copy_cells(c: &Case, run: &Run, copies: &Latencies) -> [String; 9] {
    [
        c.path.name().to_owned(),
        c.prefetch.to_string(),
        format!("{:.0} %", c.load * 100.0),
        run.contender.name().to_owned(),
        ms(copies.p50_us),
        ms(copies.p99_us),
        ms(copies.p999_us),
        format!("{:.2} %", over(copies, 50)),
        ms(run.latency.p99_us),
    ]
}

/// The header of the copy rows.
const COPY_HEADER: [&str; 9] = [
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

fn verdict(case: &Case) -> String {
    let rounds = match case.rounds_p99_diff_ms.as_slice() {
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
    format!(
        "{:+.2} ms (≤ +{:.0} ms: {}{rounds})",
        case.p99_diff_ms,
        case.p99_margin_ms,
        if case.met { "met" } else { "MISSED" }
    )
}

/// The table printed to stdout.
pub fn human(results: &Results) -> String {
    let mut out = String::new();
    for line in header_lines(results) {
        let _ = writeln!(out, "{line}");
    }
    let _ = writeln!(
        out,
        "{:<8} {:>8} {:>5} {:>9} {:>9} {:<10} {:>9} {:>7} {:>7} {:>8} {:>7} {:>9} {:>24}  kept up",
        "path",
        "prefetch",
        "load",
        "target/s",
        "publ./s",
        "contender",
        "settled/s",
        "p50 ms",
        "p99 ms",
        "p99.9 ms",
        ">100ms",
        "max depth",
        "p99 Lily − raw-batch",
    );
    for c in &results.cases {
        for (run, diff) in [(&c.raw_batch, String::new()), (&c.lily, verdict(c))] {
            let _ = writeln!(
                out,
                "{:<8} {:>8} {:>4.0}% {:>9} {:>9} {:<10} {:>9} {:>7} {:>7} {:>8} {:>6.2}% {:>9} {:>24}  {}",
                c.path.name(),
                c.prefetch,
                c.load * 100.0,
                rate(c.target_rate),
                rate(run.publish_rate),
                run.contender.name(),
                rate(run.settled_per_sec),
                ms(run.latency.p50_us),
                ms(run.latency.p99_us),
                ms(run.latency.p999_us),
                over_100ms(run),
                run.max_ready_depth,
                diff,
                keeps_up(run),
            );
        }
    }
    if copy_runs(results).next().is_some() {
        let _ = writeln!(
            out,
            "\nHandoff path, each copy from its publish to its confirm: {}",
            COPY_HEADER.join(" | ")
        );
        for (c, run, copies) in copy_runs(results) {
            let _ = writeln!(out, "  {}", copy_cells(c, run, copies).join(" | "));
        }
    }
    let _ = writeln!(
        out,
        "\nMaximum rates (msgs/s; drained with nothing publishing, settled under load, then sustained by both):"
    );
    let mut seen = Vec::new();
    for c in &results.cases {
        if seen.contains(&(c.path, c.prefetch)) {
            continue;
        }
        seen.push((c.path, c.prefetch));
        let _ = writeln!(
            out,
            "  {} prefetch {}: drained Lily {}, raw-batch {}; offered {}, settled Lily {}, raw-batch {}; used {}{}",
            c.path.name(),
            c.prefetch,
            c.max_rate.lily.map_or_else(|| "-".into(), rate),
            c.max_rate.raw_batch.map_or_else(|| "-".into(), rate),
            c.max_rate.offered.map_or_else(|| "-".into(), rate),
            c.max_rate.lily_loaded.map_or_else(|| "-".into(), rate),
            c.max_rate.raw_batch_loaded.map_or_else(|| "-".into(), rate),
            rate(c.max_rate.used),
            sustained(&c.max_rate),
        );
    }
    for note in &results.notes {
        let _ = writeln!(out, "Note: {note}");
    }
    out
}

/// The markdown report.
pub fn markdown(results: &Results) -> String {
    let mut out = String::new();
    let _ = writeln!(out, "# Settlement latency: Lily and raw-batch\n");
    for line in header_lines(results) {
        let _ = writeln!(out, "{line}  ");
    }
    let _ = writeln!(out);
    let _ = writeln!(
        out,
        "| path | prefetch | load | target msg/s | published msg/s | contender | settled msg/s | p50 ms | p99 ms | p99.9 ms | > 100 ms | max ready depth | kept up | p99 Lily − raw-batch (target) |"
    );
    let _ = writeln!(
        out,
        "|---|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---|---:|"
    );
    for c in &results.cases {
        for (run, diff) in [(&c.raw_batch, String::new()), (&c.lily, verdict(c))] {
            let _ = writeln!(
                out,
                "| {} | {} | {:.0} % | {} | {} | {} | {} | {} | {} | {} | {:.2} % | {} | {} | {} |",
                c.path.name(),
                c.prefetch,
                c.load * 100.0,
                rate(c.target_rate),
                rate(run.publish_rate),
                run.contender.name(),
                rate(run.settled_per_sec),
                ms(run.latency.p50_us),
                ms(run.latency.p99_us),
                ms(run.latency.p999_us),
                over_100ms(run),
                run.max_ready_depth,
                keeps_up(run),
                diff,
            );
        }
    }
    let _ = writeln!(
        out,
        "\nLatency histogram (share of the timed deliveries at or under each bound, ms):\n"
    );
    let bounds: Vec<String> = HISTOGRAM_MS.iter().map(|b| format!("≤ {b}")).collect();
    let _ = writeln!(
        out,
        "| path | prefetch | load | contender | {} | > {} |",
        bounds.join(" | "),
        HISTOGRAM_MS[HISTOGRAM_MS.len() - 1]
    );
    let _ = writeln!(
        out,
        "|---|---:|---:|---|{}",
        "---:|".repeat(HISTOGRAM_MS.len() + 1)
    );
    for c in &results.cases {
        for run in [&c.raw_batch, &c.lily] {
            #[allow(clippy::cast_precision_loss)]
            let shares: Vec<String> = run
                .latency
                .histogram
                .iter()
                .map(|&n| {
                    format!(
                        "{:.2} %",
                        100.0 * n as f64 / run.latency.samples.max(1) as f64
                    )
                })
                .collect();
            let _ = writeln!(
                out,
                "| {} | {} | {:.0} % | {} | {} |",
                c.path.name(),
                c.prefetch,
                c.load * 100.0,
                run.contender.name(),
                shares.join(" | ")
            );
        }
    }
    if copy_runs(results).next().is_some() {
        let _ = writeln!(
            out,
            "\nHandoff path, each copy from its publish to its confirm (Lily: its `handoff` span, from the copy built to its verdict; raw-batch: from its publish written to its confirm seen at the flush that awaits it), beside the settlement's p99:\n"
        );
        let _ = writeln!(out, "| {} |", COPY_HEADER.join(" | "));
        let _ = writeln!(out, "|---|---:|---:|---|---:|---:|---:|---:|---:|");
        for (c, run, copies) in copy_runs(results) {
            let _ = writeln!(out, "| {} |", copy_cells(c, run, copies).join(" | "));
        }
    }
    let _ = writeln!(out, "\nMaximum rates (msgs/s):\n");
    let _ = writeln!(
        out,
        "| path | prefetch | Lily drained | raw-batch drained | offered | Lily settled under load | raw-batch settled under load | used (sustained by both) |"
    );
    let _ = writeln!(out, "|---|---:|---:|---:|---:|---:|---:|---:|");
    let mut seen = Vec::new();
    for c in &results.cases {
        if seen.contains(&(c.path, c.prefetch)) {
            continue;
        }
        seen.push((c.path, c.prefetch));
        let _ = writeln!(
            out,
            "| {} | {} | {} | {} | {} | {} | {} | {}{} |",
            c.path.name(),
            c.prefetch,
            c.max_rate.lily.map_or_else(|| "–".into(), rate),
            c.max_rate.raw_batch.map_or_else(|| "–".into(), rate),
            c.max_rate.offered.map_or_else(|| "–".into(), rate),
            c.max_rate.lily_loaded.map_or_else(|| "–".into(), rate),
            c.max_rate.raw_batch_loaded.map_or_else(|| "–".into(), rate),
            rate(c.max_rate.used),
            sustained(&c.max_rate),
        );
    }
    let _ = writeln!(out);
    for note in &results.notes {
        let _ = writeln!(out, "- {note}");
    }
    out
}

const SHADES: [(Contender, [&str; 3]); 2] = [
    (Contender::RawBatch, ["#cfcfcf", "#8c8c8c", "#4d4d4d"]),
    (Contender::Lily, ["#f8bbd0", "#c2185b", "#6d0c33"]),
];

/// Bars of p50 / p99 / p99.9 (log scale, ms) per case and contender.
pub fn svg(results: &Results) -> String {
    let (left, top, plot_h) = (70.0, 80.0, 320.0);
    let group_w = 150.0;
    #[allow(clippy::cast_precision_loss)]
    let width = left + group_w * results.cases.len().max(1) as f64 + 30.0;
    let height = top + plot_h + 90.0;
    let all: Vec<u32> = results
        .cases
        .iter()
        .flat_map(|c| [&c.raw_batch, &c.lily])
        .flat_map(|r| [r.latency.p50_us, r.latency.p999_us])
        .filter(|&v| v > 0)
        .collect();
    let lo = f64::from(all.iter().copied().min().unwrap_or(100).max(1))
        .log10()
        .floor();
    let hi = f64::from(all.iter().copied().max().unwrap_or(100_000).max(10))
        .log10()
        .ceil()
        .max(lo + 1.0);
    let y = |us: u32| {
        let v = f64::from(us.max(1)).log10().clamp(lo, hi);
        top + plot_h - (v - lo) / (hi - lo) * plot_h
    };
    let mut s = String::new();
    let _ = writeln!(
        s,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" viewBox="0 0 {width} {height}" font-family="sans-serif" font-size="11">"#
    );
    let _ = writeln!(
        s,
        r#"<rect width="100%" height="100%" fill="white"/><text x="{}" y="22" text-anchor="middle" font-size="15" font-weight="bold">Settlement latency, p50 / p99 / p99.9 (ms, log scale)</text>"#,
        width / 2.0
    );
    let _ = writeln!(
        s,
        r##"<text x="{}" y="40" text-anchor="middle" fill="#555">{}, {}-byte JSON, classic queue, {:.0} s paced runs</text>"##,
        width / 2.0,
        escape(&results.broker),
        results.message_bytes,
        results.run_secs
    );
    let mut lx = left;
    for (who, shades) in SHADES {
        for (i, label) in ["p50", "p99", "p99.9"].iter().enumerate() {
            let _ = writeln!(
                s,
                r#"<rect x="{lx}" y="52" width="10" height="10" fill="{}"/><text x="{}" y="61">{} {label}</text>"#,
                shades[i],
                lx + 13.0,
                who.name()
            );
            lx += 95.0;
        }
    }
    // decade grid lines
    #[allow(clippy::cast_possible_truncation)]
    for decade in (lo as i32)..=(hi as i32) {
        let us = 10f64.powi(decade);
        #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
        let yy = y(us as u32);
        let _ = writeln!(
            s,
            r##"<line x1="{left}" x2="{}" y1="{yy:.1}" y2="{yy:.1}" stroke="#e0e0e0"/><text x="{}" y="{:.1}" text-anchor="end">{}</text>"##,
            width - 30.0,
            left - 6.0,
            yy + 4.0,
            trim(us / 1000.0)
        );
    }
    let _ = writeln!(
        s,
        r#"<text x="16" y="{}" transform="rotate(-90 16 {})" text-anchor="middle">ms</text>"#,
        top + plot_h / 2.0,
        top + plot_h / 2.0
    );
    let bar = 18.0;
    for (g, case) in results.cases.iter().enumerate() {
        #[allow(clippy::cast_precision_loss)]
        let x0 = left + group_w * g as f64 + 12.0;
        for (k, (run, (_, shades))) in [&case.raw_batch, &case.lily].iter().zip(SHADES).enumerate()
        {
            #[allow(clippy::cast_precision_loss)]
            let xk = x0 + k as f64 * (3.0 * bar + 8.0);
            let values = [run.latency.p50_us, run.latency.p99_us, run.latency.p999_us];
            for (i, v) in values.iter().enumerate() {
                #[allow(clippy::cast_precision_loss)]
                let x = xk + i as f64 * bar;
                let yy = y(*v);
                let _ = writeln!(
                    s,
                    r#"<rect x="{x:.1}" y="{yy:.1}" width="{}" height="{:.1}" fill="{}"><title>{} {}: {} ms</title></rect>"#,
                    bar - 2.0,
                    top + plot_h - yy,
                    shades[i],
                    run.contender.name(),
                    ["p50", "p99", "p99.9"][i],
                    ms(*v)
                );
            }
        }
        let cx = x0 + 3.0 * bar + 4.0;
        let _ = writeln!(
            s,
            r##"<text x="{cx:.1}" y="{}" text-anchor="middle">{} p{}</text><text x="{cx:.1}" y="{}" text-anchor="middle">{:.0}% = {}/s</text><text x="{cx:.1}" y="{}" text-anchor="middle" fill="{}">Δp99 {:+.2} ms</text>"##,
            top + plot_h + 16.0,
            case.path.name(),
            case.prefetch,
            top + plot_h + 30.0,
            case.load * 100.0,
            rate(case.target_rate),
            top + plot_h + 44.0,
            if case.met { "#2e7d32" } else { "#c62828" },
            case.p99_diff_ms
        );
    }
    let _ = writeln!(
        s,
        r##"<line x1="{left}" x2="{}" y1="{}" y2="{}" stroke="#333"/>"##,
        width - 30.0,
        top + plot_h,
        top + plot_h
    );
    s.push_str("</svg>\n");
    s
}

fn trim(v: f64) -> String {
    let text = format!("{v:.3}");
    text.trim_end_matches('0').trim_end_matches('.').to_owned()
}

/// How the rate used was found: the rates checked, and whether the last was sustained.
fn sustained(max: &MaxRate) -> String {
    match (max.tries, max.sustained) {
        (Some(tries), Some(true)) => format!(" (sustained; rates checked: {tries})"),
        (Some(tries), _) => format!(" (NOT sustained; rates checked: {tries}, the last used)"),
        _ => String::new(),
    }
}
