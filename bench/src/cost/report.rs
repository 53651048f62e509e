//! The cost program's report.

use crate::report::{Table, group, met, mib, notes, opening, rate, row};

use super::{Results, hostile};

/// The cost report in markdown: a row a measure (raw lapin, Lily, Lily's layer, target, met).
pub fn markdown(r: &Results) -> String {
    let mut table = Table::new("measure|raw lapin|Lily|Lily's layer|target|met", 1);
    let dash = || "-".to_owned();
    let num = |v: f64, digits: usize| group(&format!("{v:.digits$}"));
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
        let settled = |r: &hostile::Run| format!("{}/{}", r.settled, r.sent);
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
    let mut out = opening("Cost", &r.meta, &conditions) + &table.end();
    notes(&mut out, &r.meta.notes);
    out
}
