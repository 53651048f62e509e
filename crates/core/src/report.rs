//! The shutdown report: what settled, what did not, and how long each phase took.
//!
//! Its JSON form is versioned ([`SCHEMA`]) and described by
//! `crates/core/schema/shutdown-report.v1.json`. It carries identities and short reasons only:
//! no bodies, no credentials.

use std::fmt::Write as _;
use std::time::Instant;

use serde::{Deserialize, Serialize};

use crate::ledger::{Evidence, Ledger, Totals};
use crate::shutdown::{PhaseClock, PhaseTiming, Trigger};

/// Schema identifier written in every report.
pub const SCHEMA: &str = "lily.shutdown-report.v1";

/// Exit code of a process whose shutdown left settlement unresolved.
pub const EXIT_UNRESOLVED: i32 = 3;

/// Longest Kubernetes termination message, in bytes.
pub const TERMINATION_MESSAGE_MAX: usize = 4096;

/// A delivery whose settlement is unresolved, as reported.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct UnresolvedDelivery {
    /// Queue it was consumed from.
    pub queue: String,
    /// Its message id, when the gate found a valid one.
    pub message_id: Option<String>,
    /// Delivery tag on its channel.
    pub delivery_tag: u64,
    /// Application attempt.
    pub attempt: u32,
    /// The broker's redelivered flag.
    pub redelivered: bool,
    /// The last evidence observed.
    pub last_evidence: Evidence,
    /// Queue holding a confirmed handoff copy, if any.
    pub handoff_confirmed_to: Option<String>,
    /// Why it is unresolved.
    pub reason: String,
}

/// The shutdown report.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ShutdownReport {
    /// Always [`SCHEMA`].
    pub schema: String,
    /// The work queue.
    pub queue: String,
    /// What started the shutdown (`None` when the consumer stopped without one).
    pub trigger: Option<Trigger>,
    /// Whether it was forced (second signal, API force or deadline reached aborting).
    pub forced: bool,
    /// Phases entered since the trigger.
    pub phases: Vec<PhaseTiming>,
    /// The configured budget, in milliseconds.
    pub budget_ms: u64,
    /// Time from the trigger to the report, in milliseconds.
    pub budget_used_ms: u64,
    /// Totals over the process lifetime.
    pub totals: Totals,
    /// Unresolved deliveries (bounded list).
    pub unresolved: Vec<UnresolvedDelivery>,
    /// Unresolved deliveries not listed because the list was full.
    pub unresolved_overflow: u64,
    /// What happened to the connection over the process lifetime.
    #[serde(default)]
    pub incidents: Incidents,
    /// Why the consumer stopped, when an error stopped it ([`Trigger::Error`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    /// The permission the broker last refused handoff copies for, and its resource, when it
    /// did ([`Incidents::handoffs_refused`]): `the write permission on exchange 'amq.default'
    /// in vhost '/' (needed to publish handoff copies)`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub handoffs_refused_for: Option<String>,
    /// What the scope's outbox relay, run beside the consumer, did and left staged; absent
    /// when no relay ran.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub outbox: Option<OutboxReport>,
    /// True when nothing is unresolved and no frame from the broker was unparseable.
    pub clean: bool,
}

/// What an outbox relay did: messages it published and ended, and what stays staged. Staged
/// messages are durable in the database, not lost: the next relay publishes them.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct OutboxReport {
    /// The outbox's name.
    pub outbox: String,
    /// Messages confirmed by the broker and marked sent.
    pub sent: u64,
    /// Messages marked failed, each with its reason (`lily outbox list`).
    pub failed: u64,
    /// Messages still staged when the relay stopped, or `None` when the database did not say.
    pub staged: Option<u64>,
}

/// What happened over the process lifetime that no single delivery's outcome shows.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Incidents {
    /// Sessions that ended because the connection or the consumer was lost.
    pub connections_lost: u64,
    /// Of those, the ones lost because the client could not parse a frame from the broker. The
    /// delivery in that frame went back to the queue and came first again on the next session:
    /// any such loss makes the report unclean, since the queue may have stalled behind it.
    pub unparseable_frames: u64,
    /// Times the broker came to refuse handoff copies for want of a permission (`write` on the
    /// default exchange taken away while running). Each is logged at WARN naming the permission
    /// and the resource, and so is one still under way at shutdown.
    #[serde(default)]
    pub handoffs_refused: u64,
}

impl ShutdownReport {
    /// Builds the report at `now`.
    pub fn build(
        queue: &str,
        clock: &PhaseClock,
        ledger: &Ledger,
        incidents: Incidents,
        now: Instant,
    ) -> Self {
        let ms = |d: std::time::Duration| u64::try_from(d.as_millis()).unwrap_or(u64::MAX);
        let unresolved: Vec<UnresolvedDelivery> = ledger
            .unresolved()
            .map(|e| UnresolvedDelivery {
                queue: e.identity.queue.to_string(),
                message_id: e.identity.message_id.map(String::from),
                delivery_tag: e.identity.delivery_tag,
                attempt: e.identity.attempt,
                redelivered: e.identity.redelivered,
                last_evidence: e.last,
                handoff_confirmed_to: e.handoff.map(String::from),
                reason: e.reason.to_string(),
            })
            .collect();
        let overflow = ledger.overflow();
        // Deliveries still open at the end (aborted, or in flight) are listed as unresolved:
        // the totals count them too, so the two agree.
        let mut totals = ledger.totals();
        totals.unresolved += ledger.in_flight() as u64;
        Self {
            schema: SCHEMA.to_owned(),
            queue: queue.to_owned(),
            trigger: clock.trigger(),
            forced: clock.forced(),
            phases: clock.timings(now),
            budget_ms: ms(clock.budget().total),
            budget_used_ms: ms(clock.used(now)),
            totals,
            clean: unresolved.is_empty() && overflow == 0 && incidents.unparseable_frames == 0,
            unresolved,
            unresolved_overflow: overflow,
            incidents,
            error: None,
            handoffs_refused_for: None,
            outbox: None,
        }
    }

    /// 0 when settlement is clean, [`EXIT_UNRESOLVED`] otherwise.
    pub fn exit_code(&self) -> i32 {
        if self.clean { 0 } else { EXIT_UNRESOLVED }
    }

    /// The report's [`exit_code`](Self::exit_code) as an [`ExitCode`](std::process::ExitCode).
    pub fn exit_status(&self) -> std::process::ExitCode {
        std::process::ExitCode::from(if self.clean { 0 } else { EXIT_UNRESOLVED as u8 })
    }

    /// A short summary for the Kubernetes termination message, at most
    /// [`TERMINATION_MESSAGE_MAX`] bytes however many deliveries are unresolved.
    pub fn termination_summary(&self) -> String {
        let t = &self.totals;
        let mut out = format!(
            "lily {} queue={} trigger={} forced={} used={}ms/{}ms acked={} retried={} \
             dead_lettered={} parked={} held={} waited={} requeued={} deferred={} rejected={} duplicates={} \
             authority_lost={} acks_uncertain={} unresolved={} connections_lost={} \
             unparseable_frames={}\n",
            if self.clean { "clean" } else { "UNRESOLVED" },
            self.queue,
            self.trigger.map_or("none", |t| match t {
                Trigger::Sigterm => "sigterm",
                Trigger::Sigint => "sigint",
                Trigger::Api => "api",
                Trigger::Error => "error",
            }),
            self.forced,
            self.budget_used_ms,
            self.budget_ms,
            t.acked,
            t.retried,
            t.dead_lettered,
            t.parked,
            t.held,
            t.waited,
            t.requeued,
            t.deferred,
            t.rejected_at_gate,
            t.duplicates_suppressed,
            t.authority_lost,
            t.acks_uncertain,
            self.unresolved.len() as u64 + self.unresolved_overflow,
            self.incidents.connections_lost,
            self.incidents.unparseable_frames,
        );
        if let Some(o) = &self.outbox {
            // Outbox names are at most 255 bytes: the line always fits.
            let staged = o
                .staged
                .map_or_else(|| "unknown".to_owned(), |n| n.to_string());
            let _ = writeln!(
                out,
                "outbox {} sent={} failed={} staged={staged} (durable)",
                o.outbox, o.sent, o.failed
            );
        }
        if t.dead_lettered > 0 || t.parked > 0 {
            // Queue names are at most 255 bytes: the line always fits.
            let _ = writeln!(
                out,
                "waiting for an operator: `lily dlq list -q {0}`, `lily parking list -q {0}` \
                 (the guide: Operating the DLQ)",
                self.queue
            );
        }
        let limit = TERMINATION_MESSAGE_MAX - 64;
        for (shown, d) in self.unresolved.iter().enumerate() {
            let mut line = String::new();
            let _ = writeln!(
                line,
                "- {} tag={} attempt={} {:?}",
                d.message_id.as_deref().unwrap_or("-"),
                d.delivery_tag,
                d.attempt,
                d.last_evidence
            );
            if out.len() + line.len() > limit {
                let rest = self.unresolved.len() - shown + self.unresolved_overflow as usize;
                let _ = writeln!(out, "... and {rest} more (see the full report)");
                break;
            }
            out.push_str(&line);
        }
        truncate(&mut out, TERMINATION_MESSAGE_MAX);
        out
    }
}

fn truncate(text: &mut String, max: usize) {
    if text.len() > max {
        let mut cut = max;
        while !text.is_char_boundary(cut) {
            cut -= 1;
        }
        text.truncate(cut);
    }
}

/// `main` can return the report: exit status 0 when settlement is clean, [`EXIT_UNRESOLVED`]
/// otherwise.
impl std::process::Termination for ShutdownReport {
    fn report(self) -> std::process::ExitCode {
        self.exit_status()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::decision::{Outcome, Unresolved};
    use crate::ledger::Identity;
    use crate::reason::Reason;
    use crate::shutdown::ShutdownBudget;
    use std::time::Duration;

    fn report_with_unresolved(n: u64) -> ShutdownReport {
        let t0 = Instant::now();
        let mut clock = PhaseClock::new(ShutdownBudget::default());
        clock.handle_trigger(Trigger::Sigterm, t0);
        let mut ledger = Ledger::new(1000);
        for tag in 0..n {
            let id = ledger.open(Identity {
                queue: "orders".into(),
                message_id: Some(format!("order-{tag:0>60}").into()),
                delivery_tag: tag,
                attempt: 1,
                redelivered: false,
            });
            ledger.close(id, Outcome::Unresolved(Unresolved::BudgetExhausted), || {
                Reason::new("budget exhausted")
            });
        }
        ShutdownReport::build(
            "orders",
            &clock,
            &ledger,
            Incidents::default(),
            t0 + Duration::from_secs(1),
        )
    }

    #[test]
    fn main_can_return_the_report_exit_status_3_when_unresolved() {
        use std::process::{ExitCode, Termination};
        let clean = report_with_unresolved(0);
        assert_eq!(clean.report(), ExitCode::SUCCESS);
        let unresolved = report_with_unresolved(2);
        assert_eq!(unresolved.exit_status(), ExitCode::from(3));
        assert_eq!(unresolved.report(), ExitCode::from(3));
    }

    #[test]
    fn the_summary_points_operators_to_the_lanes_only_when_something_waits_there() {
        let mut report = report_with_unresolved(0);
        assert!(!report.termination_summary().contains("lily dlq"));
        report.totals.parked = 1;
        let summary = report.termination_summary();
        let line = summary.lines().nth(1).expect("a second line");
        assert!(line.contains("`lily dlq list -q orders`"), "{summary}");
        assert!(line.contains("`lily parking list -q orders`"), "{summary}");
    }

    #[test]
    fn termination_summary_stays_under_4096_bytes_with_10000_unresolved() {
        let report = report_with_unresolved(10_000);
        assert_eq!(report.unresolved.len(), 1000);
        assert_eq!(report.unresolved_overflow, 9000);
        let summary = report.termination_summary();
        assert!(
            summary.len() <= TERMINATION_MESSAGE_MAX,
            "{}",
            summary.len()
        );
        assert!(summary.starts_with("lily UNRESOLVED queue=orders trigger=sigterm"));
        assert!(summary.contains("unresolved=10000"));
        assert!(summary.contains("more (see the full report)"));
        assert_eq!(report.exit_code(), EXIT_UNRESOLVED);
    }

    #[test]
    fn clean_report_exits_zero() {
        let report = report_with_unresolved(0);
        assert!(report.clean);
        assert_eq!(report.exit_code(), 0);
        assert_eq!(report.schema, SCHEMA);
    }
}
