//! Results of the storm: the human summary, the markdown report and the SVG charts.

use std::fmt::Write as _;

use crate::storm::{Contender, Results, StormRun};
use crate::throughput::report::rate;

fn header_lines(results: &Results) -> Vec<String> {
    vec![
        format!("Broker: {} on {}", results.broker, results.broker_url),
        format!(
            "Population {} × {}-byte JSON, classic queue, retry bucket {:.0} s, prefetch {}; {} s a contender, warm-up {} s; {} CPU(s)",
            results.population,
            results.message_bytes,
            results.retry_delay_secs,
            results.prefetch,
            results.secs,
            results.warmup_secs,
            results.cpus
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

fn opt(v: Option<u32>) -> String {
    v.map_or_else(|| "?".into(), |v| v.to_string())
}

fn lines(results: &Results, bullet: &str) -> Vec<String> {
    let mut out = Vec::new();
    for run in &results.runs {
        let s = &run.summary;
        out.push(format!(
            "{bullet}{}: mean {} handoffs/s after warm-up ({} in {} s, {} failed); first {} s {} /s, last {} s {} /s, flatness last/first {:.3}; min ready depth {}",
            run.contender.name(),
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
        ));
        out.push(format!(
            "{bullet}{} VmRSS: {:.1} MiB after warm-up, max {:.1}, end {:.1}; slope {:+.2} MiB/min",
            run.contender.name(),
            s.rss_start_mib,
            s.rss_max_mib,
            s.rss_end_mib,
            s.rss_slope_mib_per_min,
        ));
        let c = &run.check;
        out.push(format!(
            "{bullet}{} by id: {} in work queue + {} in bucket of {}; missing {}, duplicates {}, strangers {}; DLQ {}, parking {} → {}",
            run.contender.name(),
            c.in_work_queue,
            c.in_bucket,
            c.population,
            c.missing,
            c.duplicates,
            c.strangers,
            opt(c.in_dead_letter_queue),
            opt(c.in_parking),
            if c.ok { "ok" } else { "FAILED" }
        ));
        if let Some(t) = &run.lily_totals {
            out.push(format!(
                "{bullet}Lily totals: retried {}, dead-lettered {}, parked {}, requeued {}, unresolved {} → {}",
                t.retried,
                t.dead_lettered,
                t.parked,
                t.requeued,
                t.unresolved,
                if t.dead_lettered == 0 && t.parked == 0 {
                    "nothing dead-lettered or parked"
                } else {
                    "DEAD-LETTERED OR PARKED"
                }
            ));
        }
    }
    if let Some(r) = results.lily_over_raw {
        out.push(format!("{bullet}Lily / raw lapin mean rate: {r:.3}"));
    }
    out
}

/// The summary printed to stdout.
pub fn human(results: &Results) -> String {
    let mut out = String::new();
    for line in header_lines(results) {
        let _ = writeln!(out, "{line}");
    }
    for line in lines(results, "  ") {
        let _ = writeln!(out, "{line}");
    }
    for note in &results.notes {
        let _ = writeln!(out, "Note: {note}");
    }
    out
}

/// The markdown report.
pub fn markdown(results: &Results) -> String {
    let mut out = String::new();
    let _ = writeln!(out, "# Failure storm: 100 % retryable failures\n");
    for line in header_lines(results) {
        let _ = writeln!(out, "{line}  ");
    }
    let _ = writeln!(out);
    let _ = writeln!(
        out,
        "| contender | mean handoffs/s | first window /s | last window /s | last/first | RSS after warm-up MiB | max MiB | end MiB | slope MiB/min | ids ok |"
    );
    let _ = writeln!(out, "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|");
    for run in &results.runs {
        let s = &run.summary;
        let _ = writeln!(
            out,
            "| {} | {} | {} | {} | {:.3} | {:.1} | {:.1} | {:.1} | {:+.2} | {} |",
            run.contender.name(),
            rate(s.mean_rate),
            rate(s.first_rate),
            rate(s.last_rate),
            s.flatness,
            s.rss_start_mib,
            s.rss_max_mib,
            s.rss_end_mib,
            s.rss_slope_mib_per_min,
            if run.check.ok { "yes" } else { "**no**" },
        );
    }
    let _ = writeln!(out);
    for line in lines(results, "- ") {
        let _ = writeln!(out, "{line}");
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
    }
}

/// Two line charts: handoffs/s over time and `VmRSS` over time, one line per contender.
pub fn svg(results: &Results) -> String {
    let (width, chart_h, left, right) = (900.0, 220.0, 70.0, 30.0);
    let height = 60.0 + 2.0 * (chart_h + 60.0);
    let mut s = String::new();
    let _ = writeln!(
        s,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" viewBox="0 0 {width} {height}" font-family="sans-serif" font-size="11">"#
    );
    let _ = writeln!(
        s,
        r#"<rect width="100%" height="100%" fill="white"/><text x="{}" y="22" text-anchor="middle" font-size="15" font-weight="bold">Failure storm: every delivery fails retryably ({} messages cycling through a {:.0} s bucket)</text>"#,
        width / 2.0,
        results.population,
        results.retry_delay_secs
    );
    let mut lx = left;
    for run in &results.runs {
        let _ = writeln!(
            s,
            r#"<rect x="{lx}" y="34" width="12" height="12" fill="{}"/><text x="{}" y="44">{}</text>"#,
            color(run.contender),
            lx + 16.0,
            run.contender.name()
        );
        lx += 110.0;
    }
    #[allow(clippy::cast_precision_loss)]
    let series = |pick: fn(&crate::storm::Second) -> f64| -> Vec<(Contender, Vec<(f64, f64)>)> {
        results
            .runs
            .iter()
            .map(|r: &StormRun| {
                (
                    r.contender,
                    r.series.iter().map(|p| (f64::from(p.t), pick(p))).collect(),
                )
            })
            .collect()
    };
    #[allow(clippy::cast_precision_loss)]
    let handoffs = series(|p| p.handoffs as f64);
    #[allow(clippy::cast_precision_loss)]
    let rss = series(|p| p.rss_bytes as f64 / (1024.0 * 1024.0));
    chart(
        &mut s,
        "handoffs per second",
        &handoffs,
        (left, 80.0, width - left - right, chart_h),
        f64::from(results.secs),
    );
    chart(
        &mut s,
        "VmRSS of the benchmark process (MiB)",
        &rss,
        (left, 80.0 + chart_h + 60.0, width - left - right, chart_h),
        f64::from(results.secs),
    );
    s.push_str("</svg>\n");
    s
}

fn chart(
    s: &mut String,
    title: &str,
    lines: &[(Contender, Vec<(f64, f64)>)],
    (x0, y0, w, h): (f64, f64, f64, f64),
    secs: f64,
) {
    let ymax = lines
        .iter()
        .flat_map(|(_, pts)| pts.iter().map(|p| p.1))
        .fold(0.0_f64, f64::max);
    let ymax = nice(ymax.max(1.0));
    let secs = secs.max(1.0);
    let _ = writeln!(
        s,
        r#"<text x="{x0}" y="{}" font-weight="bold">{title}</text>"#,
        y0 - 8.0
    );
    for i in 0..=4 {
        let v = ymax * f64::from(i) / 4.0;
        let y = y0 + h - h * f64::from(i) / 4.0;
        let _ = writeln!(
            s,
            r##"<line x1="{x0}" x2="{}" y1="{y:.1}" y2="{y:.1}" stroke="#e0e0e0"/><text x="{}" y="{:.1}" text-anchor="end">{}</text>"##,
            x0 + w,
            x0 - 6.0,
            y + 4.0,
            rate(v)
        );
    }
    for i in 0..=5 {
        let t = secs * f64::from(i) / 5.0;
        let x = x0 + w * f64::from(i) / 5.0;
        let _ = writeln!(
            s,
            r#"<text x="{x:.1}" y="{}" text-anchor="middle">{t:.0} s</text>"#,
            y0 + h + 16.0
        );
    }
    let _ = writeln!(
        s,
        r##"<rect x="{x0}" y="{y0}" width="{w}" height="{h}" fill="none" stroke="#333"/>"##
    );
    for (who, pts) in lines {
        let path: Vec<String> = pts
            .iter()
            .map(|(t, v)| format!("{:.1},{:.1}", x0 + w * t / secs, y0 + h - h * v / ymax))
            .collect();
        let _ = writeln!(
            s,
            r#"<polyline fill="none" stroke="{}" stroke-width="1.5" points="{}"/>"#,
            color(*who),
            path.join(" ")
        );
    }
}

/// A round upper bound for an axis.
fn nice(v: f64) -> f64 {
    let p = 10f64.powf(v.log10().floor());
    for m in [1.0, 2.0, 2.5, 5.0, 10.0] {
        if v <= m * p {
            return m * p;
        }
    }
    10.0 * p
}
