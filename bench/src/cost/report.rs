//! The human table (terminal) and its markdown twin (`target/bench/cost.md`).

use serde_json::Value;

const HEADER: [&str; 6] = [
    "measure",
    "raw lapin",
    "Lily",
    "Lily's layer",
    "target",
    "met",
];

fn num(v: &Value, digits: usize) -> String {
    match v.as_f64() {
        Some(x) if x.is_finite() => group(&format!("{x:.digits$}")),
        _ => "-".into(),
    }
}

/// `12345.6` → `12 345.6`.
fn group(text: &str) -> String {
    let (sign, rest) = text.strip_prefix('-').map_or(("", text), |r| ("-", r));
    let (int, frac) = rest
        .split_once('.')
        .map_or((rest, None), |(i, f)| (i, Some(f)));
    let mut out = String::new();
    for (i, c) in int.chars().enumerate() {
        if i > 0 && (int.len() - i).is_multiple_of(3) {
            out.push(' ');
        }
        out.push(c);
    }
    match frac {
        Some(f) => format!("{sign}{out}.{f}"),
        None => format!("{sign}{out}"),
    }
}

fn met(v: &Value) -> String {
    match v.as_bool() {
        Some(true) => "yes".into(),
        Some(false) => "NO".into(),
        None => "-".into(),
    }
}

fn rows(r: &Value) -> Vec<[String; 6]> {
    let mut rows = Vec::new();
    let s = |x: &str| x.to_owned();
    let i = &r["instructions"];
    if let Some(err) = i["error"].as_str() {
        rows.push([
            s("instructions / message"),
            s("error"),
            s(err),
            s("-"),
            s("-"),
            s("-"),
        ]);
    } else if !i.is_null() {
        rows.push([
            format!("instructions / message (callgrind, N={})", num(&i["n"], 0)),
            num(&i["raw"], 0),
            num(&i["lily"], 0),
            num(&i["lily_layer"], 0),
            s("<= 8 000"),
            met(&i["met"]),
        ]);
        rows.push([
            s("  raw lapin acking with Acker::ack().await (informative)"),
            num(&i["raw_acker"], 0),
            num(&i["lily"], 0),
            num(
                &Value::from(
                    i["lily"].as_f64().unwrap_or(f64::NAN)
                        - i["raw_acker"].as_f64().unwrap_or(f64::NAN),
                ),
                0,
            ),
            s("-"),
            s("-"),
        ]);
        let mt = &i["multi_thread"];
        if !mt.is_null() {
            rows.push([
                s("  same, multi-thread runtime (informative)"),
                num(&mt["raw"], 0),
                num(&mt["lily"], 0),
                num(&mt["lily_layer"], 0),
                s("-"),
                s("-"),
            ]);
        }
    }
    let reader = &r["reader"];
    if let Some(per) = reader["per_message"].as_f64() {
        // The frame reader is part of Lily's layer: its share of Lily's whole cost per message
        // (the target), and of the layer, against the figures of this run.
        let share = i["lily"].as_f64().map(|l| per / l);
        let of_layer = i["lily_layer"].as_f64().map_or_else(
            || s("-"),
            |l| format!("{:.0} % of the layer", per / l * 100.0),
        );
        rows.push([
            s("  of it, the frame reader (wire.rs), instructions / message"),
            s("-"),
            num(&Value::from(per), 0),
            of_layer,
            share.map_or_else(
                || s("< 5 % of Lily"),
                |x| format!("< 5 % of Lily: {:.1} %", x * 100.0),
            ),
            share.map_or_else(|| s("-"), |x| met(&Value::from(x < 0.05))),
        ]);
    } else if let Some(err) = reader["error"].as_str() {
        rows.push([
            s("the frame reader"),
            s("error"),
            s(err),
            s("-"),
            s("-"),
            s("-"),
        ]);
    }
    let a = &r["allocations"];
    if let Some(err) = a["error"].as_str() {
        rows.push([
            s("heap allocations / message"),
            s("error"),
            s(err),
            s("-"),
            s("-"),
            s("-"),
        ]);
    } else if !a.is_null() {
        let part = |key: &str| {
            [
                num(&a["raw"][key], 2),
                num(&a["lily"][key], 2),
                num(&a["lily_layer"][key], 2),
            ]
        };
        let [raw, lily, layer] = part("allocation_calls");
        rows.push([
            format!(
                "heap allocations / message (alloc+realloc, N={})",
                num(&a["n"], 0)
            ),
            raw,
            lily,
            layer,
            s("<= 10"),
            met(&a["met"]),
        ]);
        let acker = num(&a["raw_acker"]["allocation_calls"], 2);
        let over_acker = num(
            &Value::from(
                a["lily"]["allocation_calls"].as_f64().unwrap_or(f64::NAN)
                    - a["raw_acker"]["allocation_calls"]
                        .as_f64()
                        .unwrap_or(f64::NAN),
            ),
            2,
        );
        rows.push([
            s("  raw lapin acking with Acker::ack().await (informative)"),
            acker,
            num(&a["lily"]["allocation_calls"], 2),
            over_acker,
            s("-"),
            s("-"),
        ]);
        let [raw, lily, layer] = part("reallocations");
        rows.push([s("  of which realloc"), raw, lily, layer, s("-"), s("-")]);
        let [raw, lily, layer] = part("bytes_allocated");
        rows.push([
            s("heap bytes allocated / message"),
            raw,
            lily,
            layer,
            s("-"),
            s("-"),
        ]);
    }
    let m = &r["memory"];
    if let Some(err) = m["error"].as_str() {
        rows.push([
            s("memory per in-flight delivery"),
            s("error"),
            s(err),
            s("-"),
            s("-"),
            s("-"),
        ]);
    } else if !m.is_null() {
        let k = num(&m["in_flight"], 0);
        rows.push([
            format!("RSS bytes per in-flight delivery ({k} held)"),
            num(&m["raw"]["rss_per_delivery"], 0),
            num(&m["lily"]["rss_per_delivery"], 0),
            num(&m["lily_extra_over_raw"]["rss_per_delivery"], 0),
            s("-"),
            s("-"),
        ]);
        rows.push([
            format!("live heap bytes per in-flight delivery ({k} held)"),
            num(&m["raw"]["heap_per_delivery"], 0),
            num(&m["lily"]["heap_per_delivery"], 0),
            num(&m["lily_extra_over_raw"]["heap_per_delivery"], 0),
            s("-"),
            s("-"),
        ]);
        rows.push([
            format!("peak RSS, {k} in flight (MiB)"),
            num(
                &Value::from(m["raw"]["hwm_bytes"].as_f64().unwrap_or(f64::NAN) / 1048576.0),
                1,
            ),
            num(
                &Value::from(m["lily"]["hwm_bytes"].as_f64().unwrap_or(f64::NAN) / 1048576.0),
                1,
            ),
            s("-"),
            s("-"),
            s("-"),
        ]);
    }
    let d = &r["shutdown"];
    if let Some(err) = d["error"].as_str() {
        rows.push([
            s("shutdown latency"),
            s("error"),
            s(err),
            s("-"),
            s("-"),
            s("-"),
        ]);
    } else if !d.is_null() {
        let runs = num(&d["idle"]["runs"], 0);
        rows.push([
            format!("shutdown, idle: SIGTERM to exit, ms (median of {runs})"),
            s("-"),
            num(&d["idle"]["median_ms"], 1),
            s("-"),
            s("< 200"),
            met(&d["met"]),
        ]);
        let busy = &d["in_flight_1000"];
        rows.push([
            format!(
                "shutdown, {} in flight (handlers {} ms): SIGTERM to exit, ms",
                num(&busy["median_in_flight_at_sigterm"], 0),
                num(&busy["work_ms"], 0)
            ),
            s("-"),
            num(&busy["median_ms"], 1),
            s("-"),
            s("-"),
            s("-"),
        ]);
    }
    hostile_rows(&r["hostile"], &mut rows);
    rows
}

fn mib(v: &Value) -> Value {
    Value::from(v.as_f64().unwrap_or(f64::NAN) / 1048576.0)
}

fn hostile_rows(h: &Value, rows: &mut Vec<[String; 6]>) {
    let s = |x: &str| x.to_owned();
    if let Some(err) = h["error"].as_str() {
        rows.push([
            s("hostile load"),
            s("error"),
            s(err),
            s("-"),
            s("-"),
            s("-"),
        ]);
        return;
    }
    if h.is_null() {
        return;
    }
    let (raw, lily) = (&h["raw"], &h["lily"]);
    let diff = |key: &str| {
        Value::from(lily[key].as_f64().unwrap_or(f64::NAN) - raw[key].as_f64().unwrap_or(f64::NAN))
    };
    let mib_row = |label: String, key: &str, target: String, met: String| {
        [
            label,
            num(&mib(&raw[key]), 1),
            num(&mib(&lily[key]), 1),
            num(&mib(&diff(key)), 1),
            target,
            met,
        ]
    };
    rows.push(mib_row(
        format!(
            "hostile load, {} msgs at prefetch {}: peak RSS (VmHWM), MiB",
            num(&h["n"], 0),
            num(&h["prefetch"], 0)
        ),
        "hwm_bytes",
        format!("<= {}", num(&mib(&lily["bound_bytes"]), 1)),
        met(&lily["met"]),
    ));
    rows.push(mib_row(
        s("  idle RSS, MiB"),
        "rss_idle_bytes",
        s("-"),
        s("-"),
    ));
    rows.push(mib_row(
        format!(
            "  RSS with the window full ({} held), MiB",
            num(&lily["in_flight_at_full_window"], 0)
        ),
        "rss_full_window_bytes",
        s("-"),
        s("-"),
    ));
    rows.push(mib_row(
        s("  peak live heap (sampled), MiB"),
        "heap_peak_sampled_bytes",
        s("-"),
        s("-"),
    ));
    rows.push(mib_row(
        format!(
            "  bound: idle + conns x 64 x frame_max + prefetch x {} x (body + headers), MiB",
            num(&h["copies"], 0)
        ),
        "bound_bytes",
        s("-"),
        s("-"),
    ));
    rows.push([
        s("  peak / bound"),
        num(&raw["peak_over_bound"], 2),
        num(&lily["peak_over_bound"], 2),
        s("-"),
        s("<= 1"),
        met(&lily["met"]),
    ]);
    rows.push([
        format!(
            "  peak above idle per window delivery, bytes (message budget {})",
            num(&h["message_budget_bytes"], 0)
        ),
        num(&raw["peak_above_idle_per_window_delivery"], 0),
        num(&lily["peak_above_idle_per_window_delivery"], 0),
        num(&diff("peak_above_idle_per_window_delivery"), 0),
        s("-"),
        s("-"),
    ]);
    rows.push([
        s("  drain of the full queue, msg/s"),
        num(&raw["msgs_per_s"], 0),
        num(&lily["msgs_per_s"], 0),
        s("-"),
        s("-"),
        s("-"),
    ]);
    let settled = |who: &Value| {
        format!(
            "{}/{}",
            num(&who["evidence"]["settled"], 0),
            num(&who["evidence"]["sent"], 0)
        )
    };
    let all = |who: &Value| who["evidence"]["settled"] == who["evidence"]["sent"];
    rows.push([
        s("  messages settled, checked by id from outside"),
        settled(raw),
        settled(lily),
        s("-"),
        s("all"),
        met(&Value::from(all(raw) && all(lily))),
    ]);
    rows.push([
        s("  of which not where their class says (Lily)"),
        s("-"),
        num(&lily["evidence"]["unexpected"], 0),
        s("-"),
        s("-"),
        s("-"),
    ]);
}

fn conditions(r: &Value) -> String {
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
        text += &format!(
            " Memory: prefetch = concurrency = {}, multi-thread runtime.",
            num(&r["memory"]["in_flight"], 0)
        );
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

/// A plain-text table for the terminal.
pub fn table(r: &Value) -> String {
    let rows = rows(r);
    let mut widths = HEADER.map(str::len);
    for row in &rows {
        for (w, cell) in widths.iter_mut().zip(row) {
            *w = (*w).max(cell.chars().count());
        }
    }
    let line = |cells: &[String]| {
        cells
            .iter()
            .enumerate()
            .map(|(i, c)| {
                let pad = widths[i].saturating_sub(c.chars().count());
                if i == 0 {
                    format!("{c}{}", " ".repeat(pad))
                } else {
                    format!("{}{c}", " ".repeat(pad))
                }
            })
            .collect::<Vec<_>>()
            .join("  ")
    };
    let mut out = format!("Lily cost benchmark\n{}\n\n", conditions(r));
    out += &line(&HEADER.map(str::to_owned));
    out.push('\n');
    out += &widths
        .iter()
        .map(|w| "-".repeat(*w))
        .collect::<Vec<_>>()
        .join("  ");
    out.push('\n');
    for row in &rows {
        out += &line(row);
        out.push('\n');
    }
    out
}

/// The same table in markdown, ready for the README.
pub fn markdown(r: &Value) -> String {
    let mut out = format!("{}\n\n", conditions(r));
    out += &format!("| {} |\n", HEADER.join(" | "));
    out += "|---|---:|---:|---:|---:|:---:|\n";
    for row in rows(r) {
        out += &format!("| {} |\n", row.join(" | "));
    }
    out
}
