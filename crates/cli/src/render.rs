//! `lily report show`: each report as readable text, plus the table and naming helpers that
//! `summary` and `diff` share.

use std::fmt::Write as _;

use lily_mq_core::ShutdownReport;

use crate::loaded::Loaded;

/// Renders every report, separated by a blank line.
pub(crate) fn show(reports: &[Loaded]) -> String {
    let rendered: Vec<String> = reports.iter().map(report).collect();
    rendered.join("\n")
}

/// One report: header, phases, totals and unresolved deliveries.
fn report(loaded: &Loaded) -> String {
    let r = &loaded.report;
    let mut out = String::new();
    let _ = writeln!(out, "== {} ==", text(&loaded.name));
    let mut budget = format!("{} ms used of {} ms", r.budget_used_ms, r.budget_ms);
    if r.budget_ms > 0 {
        let _ = write!(
            budget,
            " ({}%)",
            u128::from(r.budget_used_ms) * 100 / u128::from(r.budget_ms)
        );
    }
    let mut header = Table::new(&["", ""], "ll");
    header.row(vec!["queue".into(), text(&r.queue)]);
    header.row(vec!["trigger".into(), trigger(r)]);
    header.row(vec!["forced".into(), yes_no(r.forced)]);
    header.row(vec!["status".into(), status(r).into()]);
    header.row(vec!["budget".into(), budget]);
    header.render_body(&mut out, "");

    out.push_str("\nphases\n");
    if r.phases.is_empty() {
        out.push_str("  (none: no shutdown phase was entered)\n");
    } else {
        let mut phases = Table::new(&["phase", "start ms", "duration ms"], "lrr");
        for p in &r.phases {
            phases.row(vec![
                label(serde_json::to_value(p.phase)),
                p.start_ms.to_string(),
                p.duration_ms.to_string(),
            ]);
        }
        phases.render(&mut out, "  ");
    }

    out.push_str("\ntotals\n");
    let mut totals = Table::new(&["", ""], "lr");
    for (name, value) in r.totals.fields() {
        totals.row(vec![name.into(), value.to_string()]);
    }
    totals.render_body(&mut out, "  ");
    let i = r.incidents;
    let _ = writeln!(
        out,
        "\nconnections lost: {}, of them to unparseable frames: {}",
        i.connections_lost, i.unparseable_frames
    );
    if let Some(lacks) = &r.handoffs_refused_for {
        let _ = writeln!(
            out,
            "handoffs refused {} time(s), for {}",
            i.handoffs_refused,
            crate::select::clean(lacks)
        );
    }

    if let Some(outbox) = &r.outbox {
        let staged = outbox
            .staged
            .map_or_else(|| "unknown".to_owned(), |n| n.to_string());
        let _ = writeln!(
            out,
            "outbox {}: {} sent, {} failed, {staged} still staged (durable, published by the next relay)",
            crate::select::clean(&outbox.outbox),
            outbox.sent,
            outbox.failed
        );
    }
    let _ = write!(out, "unresolved: {} listed", r.unresolved.len());
    if r.unresolved_overflow > 0 {
        let _ = write!(out, ", {} more not listed", r.unresolved_overflow);
    }
    out.push('\n');
    if !r.unresolved.is_empty() {
        let mut table = Table::new(
            &[
                "message id",
                "delivery tag",
                "attempt",
                "redelivered",
                "last evidence",
                "handoff confirmed to",
                "reason",
            ],
            "lrrllll",
        );
        for d in &r.unresolved {
            table.row(vec![
                optional(d.message_id.as_deref()),
                d.delivery_tag.to_string(),
                d.attempt.to_string(),
                yes_no(d.redelivered),
                label(serde_json::to_value(d.last_evidence)),
                optional(d.handoff_confirmed_to.as_deref()),
                text(&d.reason),
            ]);
        }
        table.render(&mut out, "  ");
    }
    out
}

/// `clean` or `UNRESOLVED`, as the report says.
pub(crate) fn status(r: &ShutdownReport) -> &'static str {
    if r.clean { "clean" } else { "UNRESOLVED" }
}

/// The trigger's JSON name, or `none`.
pub(crate) fn trigger(r: &ShutdownReport) -> String {
    r.trigger
        .map_or_else(|| "none".into(), |t| label(serde_json::to_value(t)))
}

/// Unresolved deliveries listed or overflowed.
pub(crate) fn unresolved_count(r: &ShutdownReport) -> u64 {
    (r.unresolved.len() as u64).saturating_add(r.unresolved_overflow)
}

/// The JSON name of a serialized enum variant (`settle_written`, `draining`, ...).
pub(crate) fn label(value: serde_json::Result<serde_json::Value>) -> String {
    match value {
        Ok(serde_json::Value::String(name)) => name,
        _ => "?".into(),
    }
}

fn yes_no(flag: bool) -> String {
    if flag { "yes" } else { "no" }.into()
}

fn optional(value: Option<&str>) -> String {
    value.map_or_else(|| "-".into(), text)
}

/// A value from a report, with control characters escaped so it cannot drive the terminal.
pub(crate) fn text(value: &str) -> String {
    if value.chars().any(char::is_control) {
        value.escape_debug().to_string()
    } else {
        value.to_owned()
    }
}

/// A borderless table with aligned columns, drawn by `comfy-table`.
pub(crate) struct Table {
    table: comfy_table::Table,
    columns: usize,
}

impl Table {
    /// A table with these column headings; `align` has one `l` or `r` per column.
    pub(crate) fn new(head: &[&str], align: &str) -> Self {
        use comfy_table::{CellAlignment, ContentArrangement, presets};
        let mut table = comfy_table::Table::new();
        table
            .load_preset(presets::NOTHING)
            .set_content_arrangement(ContentArrangement::Disabled)
            .set_header(head.iter().copied());
        let columns = head.len();
        for (i, column) in table.column_iter_mut().enumerate() {
            let right = align.as_bytes().get(i) == Some(&b'r');
            column.set_cell_alignment(if right {
                CellAlignment::Right
            } else {
                CellAlignment::Left
            });
            // Two spaces between columns, none before the first or after the last.
            column.set_padding((0, if i + 1 < columns { 2 } else { 0 }));
        }
        Self { table, columns }
    }

    /// Adds a row.
    pub(crate) fn row(&mut self, cells: Vec<String>) {
        debug_assert_eq!(cells.len(), self.columns);
        self.table.add_row(cells);
    }

    /// Writes the headings and rows, each line prefixed by `indent`.
    pub(crate) fn render(&self, out: &mut String, indent: &str) {
        self.write(out, indent, 0);
    }

    /// Writes the rows only (key/value lists).
    pub(crate) fn render_body(&self, out: &mut String, indent: &str) {
        self.write(out, indent, 1);
    }

    fn write(&self, out: &mut String, indent: &str, skip: usize) {
        if self.table.row_count() == 0 && skip == 1 {
            return;
        }
        for line in self.table.lines().skip(skip) {
            out.push_str(indent);
            out.push_str(line.trim_end());
            out.push('\n');
        }
    }
}
