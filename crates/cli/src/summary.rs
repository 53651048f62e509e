//! `lily report summary` and `lily report diff`: several reports side by side.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write as _;

use lily_mq_core::{PhaseTiming, ShutdownReport};

use crate::loaded::Loaded;
use crate::render::{Table, label, status, text, trigger, unresolved_count};

/// One line per report, a TOTAL line, the summed totals, and the message ids unresolved in
/// more than one report.
pub(crate) fn summary(reports: &[Loaded]) -> String {
    let mut table = Table::new(
        &[
            "file",
            "queue",
            "trigger",
            "status",
            "used ms",
            "acked",
            "retried",
            "dead-lettered",
            "unresolved",
        ],
        "llllrrrrr",
    );
    let mut used = 0u64;
    let mut listed = 0u64;
    let mut sums = lily_mq_core::Totals::default().fields();
    for Loaded { name, report: r } in reports {
        let t = &r.totals;
        table.row(vec![
            text(name),
            text(&r.queue),
            trigger(r),
            status(r).into(),
            r.budget_used_ms.to_string(),
            t.acked.to_string(),
            t.retried.to_string(),
            t.dead_lettered.to_string(),
            unresolved_count(r).to_string(),
        ]);
        used = used.saturating_add(r.budget_used_ms);
        listed = listed.saturating_add(unresolved_count(r));
        for (sum, (_, value)) in sums.iter_mut().zip(t.fields()) {
            sum.1 = sum.1.saturating_add(value);
        }
    }
    let clean = reports.iter().filter(|l| l.report.clean).count();
    let sum = |field: &str| {
        sums.iter()
            .find(|(n, _)| *n == field)
            .map_or(0, |(_, v)| *v)
    };
    table.row(vec![
        "TOTAL".into(),
        String::new(),
        String::new(),
        format!("{clean}/{} clean", reports.len()),
        used.to_string(),
        sum("acked").to_string(),
        sum("retried").to_string(),
        sum("dead_lettered").to_string(),
        listed.to_string(),
    ]);
    let mut out = String::new();
    table.render(&mut out, "");

    let fields: Vec<String> = sums.iter().map(|(n, v)| format!("{n}={v}")).collect();
    let _ = writeln!(out, "\nsummed totals: {}", fields.join(" "));

    let mut seen: BTreeMap<&str, BTreeSet<usize>> = BTreeMap::new();
    for (index, loaded) in reports.iter().enumerate() {
        for id in unresolved_ids(&loaded.report) {
            seen.entry(id).or_default().insert(index);
        }
    }
    seen.retain(|_, files| files.len() > 1);
    if seen.is_empty() {
        out.push_str("\nno message id is unresolved in more than one report\n");
    } else {
        let _ = writeln!(
            out,
            "\nunresolved in more than one report ({}):",
            seen.len()
        );
        let mut repeated = Table::new(&["message id", "reports"], "ll");
        for (id, files) in &seen {
            let names: Vec<String> = files.iter().map(|&i| text(&reports[i].name)).collect();
            repeated.row(vec![text(id), names.join(", ")]);
        }
        repeated.render(&mut out, "  ");
    }
    out
}

/// Totals of `b` minus `a`, phases side by side, and unresolved message ids compared.
pub(crate) fn diff(a: &Loaded, b: &Loaded) -> String {
    let (ra, rb) = (&a.report, &b.report);
    let mut out = String::new();
    let _ = writeln!(
        out,
        "A: {} ({}, {})",
        text(&a.name),
        text(&ra.queue),
        status(ra)
    );
    let _ = writeln!(
        out,
        "B: {} ({}, {})",
        text(&b.name),
        text(&rb.queue),
        status(rb)
    );

    out.push_str("\ntotals\n");
    let mut totals = Table::new(&["field", "A", "B", "B - A"], "lrrr");
    let used = ("budget_used_ms", ra.budget_used_ms, rb.budget_used_ms);
    let listed = (
        "unresolved listed+overflow",
        unresolved_count(ra),
        unresolved_count(rb),
    );
    let fields = ra.totals.fields().into_iter().zip(rb.totals.fields());
    let rows = fields.map(|((name, x), (_, y))| (name, x, y));
    for (name, x, y) in rows.chain([used, listed]) {
        let delta = i128::from(y) - i128::from(x);
        let delta = if delta == 0 {
            "0".into()
        } else {
            format!("{delta:+}")
        };
        totals.row(vec![name.into(), x.to_string(), y.to_string(), delta]);
    }
    totals.render(&mut out, "  ");

    out.push_str("\nphases\n");
    let mut phases = Table::new(
        &[
            "phase",
            "A start ms",
            "A duration ms",
            "B start ms",
            "B duration ms",
        ],
        "lrrrr",
    );
    let mut order: Vec<_> = ra
        .phases
        .iter()
        .chain(&rb.phases)
        .map(|p| p.phase)
        .collect();
    order.sort();
    order.dedup();
    let cells = |timings: &[PhaseTiming], phase| match timings.iter().find(|p| p.phase == phase) {
        Some(p) => [p.start_ms.to_string(), p.duration_ms.to_string()],
        None => ["-".into(), "-".into()],
    };
    for phase in order {
        let [a_start, a_dur] = cells(&ra.phases, phase);
        let [b_start, b_dur] = cells(&rb.phases, phase);
        let name = label(serde_json::to_value(phase));
        phases.row(vec![name, a_start, a_dur, b_start, b_dur]);
    }
    phases.render(&mut out, "  ");

    let ids_a = unresolved_ids(ra);
    let ids_b = unresolved_ids(rb);
    let groups = [
        ("only in A", ids_a.difference(&ids_b).collect::<Vec<_>>()),
        ("only in B", ids_b.difference(&ids_a).collect()),
        ("in both", ids_a.intersection(&ids_b).collect()),
    ];
    for (title, ids) in groups {
        let _ = writeln!(out, "\nunresolved {title} ({}):", ids.len());
        for id in ids {
            let _ = writeln!(out, "  {}", text(id));
        }
    }
    for (side, r) in [("A", ra), ("B", rb)] {
        let anonymous = r
            .unresolved
            .iter()
            .filter(|d| d.message_id.is_none())
            .count();
        if anonymous > 0 || r.unresolved_overflow > 0 {
            let _ = writeln!(
                out,
                "\nnote: {side} also has {anonymous} unresolved without a message id and {} not \
                 listed (overflow); they cannot be compared",
                r.unresolved_overflow
            );
        }
    }
    out
}

/// The distinct message ids of a report's listed unresolved deliveries.
fn unresolved_ids(r: &ShutdownReport) -> BTreeSet<&str> {
    r.unresolved
        .iter()
        .filter_map(|d| d.message_id.as_deref())
        .collect()
}
