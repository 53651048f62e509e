//! The shutdown report's JSON matches its published schema and round-trips.

use std::time::{Duration, Instant};

use lily_mq_core::transport::{Evidence, Identity, Ledger, PhaseClock, TERMINATION_MESSAGE_MAX};
use lily_mq_core::{
    EXIT_UNRESOLVED, Incidents, OutboxReport, Outcome, Reason, ShutdownBudget, ShutdownReport,
    Trigger, Unresolved,
};
use serde_json::Value;

const SCHEMA: &str = include_str!("../schema/shutdown-report.v1.json");

fn validator() -> jsonschema::Validator {
    let schema: Value = serde_json::from_str(SCHEMA).expect("schema is JSON");
    jsonschema::validator_for(&schema).expect("schema compiles")
}

fn identity(tag: u64) -> Identity {
    Identity {
        queue: "orders".into(),
        message_id: Some(format!("order-{tag}").into()),
        delivery_tag: tag,
        attempt: 2,
        redelivered: true,
    }
}

/// A report touching every kind of unresolved entry: an unresolved outcome, lost authority,
/// an uncertain ack with its confirmed handoff, and an aborted task.
fn busy_report(extra_unresolved: u64) -> ShutdownReport {
    let t0 = Instant::now();
    let mut clock = PhaseClock::new(ShutdownBudget::new(Duration::from_secs(10)));
    clock.handle_trigger(Trigger::Sigterm, t0);
    clock.handle_timeout(t0 + Duration::from_secs(6));
    clock.handle_force(Trigger::Sigterm, t0 + Duration::from_secs(7));
    clock.handle_aborted(t0 + Duration::from_millis(7100));
    let mut ledger = Ledger::new(100);
    let acked = ledger.open(identity(1));
    ledger.close_acked(acked, Outcome::Acked, 1, None);
    let mark = ledger.ack_mark();
    ledger.confirm_acks(1, mark);
    let uncertain = ledger.open(identity(2));
    ledger.close_acked(
        uncertain,
        Outcome::Retried,
        1,
        Some("orders.retry.5s".into()),
    );
    ledger.acks_uncertain(Some(1));
    let lost = ledger.open(identity(3));
    ledger.note(lost, Evidence::AuthorityLost);
    ledger.close(lost, Outcome::AuthorityLost, || {
        Reason::new("authority lost")
    });
    for tag in 0..extra_unresolved {
        let id = ledger.open(identity(100 + tag));
        ledger.close(id, Outcome::Unresolved(Unresolved::BudgetExhausted), || {
            Reason::new("budget exhausted")
        });
    }
    let _aborted = ledger.open(identity(4));
    ledger.abort_open();
    let mut report = ShutdownReport::build(
        "orders",
        &clock,
        &ledger,
        Incidents::default(),
        t0 + Duration::from_millis(7200),
    );
    report.outbox = Some(OutboxReport {
        outbox: "outbox".into(),
        sent: 12,
        failed: 1,
        staged: Some(3),
    });
    report
}

#[test]
fn report_json_validates_against_the_published_schema_and_round_trips() {
    let report = busy_report(3);
    let json = serde_json::to_value(&report).expect("serialize");
    let errors: Vec<String> = validator()
        .iter_errors(&json)
        .map(|e| e.to_string())
        .collect();
    assert!(errors.is_empty(), "schema violations: {errors:?}");
    let back: ShutdownReport = serde_json::from_value(json).expect("deserialize");
    assert_eq!(back, report);

    assert!(report.forced && !report.clean);
    assert_eq!(report.exit_code(), EXIT_UNRESOLVED);
    let evidence: Vec<Evidence> = report.unresolved.iter().map(|d| d.last_evidence).collect();
    assert!(evidence.contains(&Evidence::SettleWritten));
    assert!(evidence.contains(&Evidence::AuthorityLost));
    assert!(evidence.contains(&Evidence::Aborted));
    let uncertain = report
        .unresolved
        .iter()
        .find(|d| d.message_id.as_deref() == Some("order-2"))
        .expect("uncertain ack listed");
    assert_eq!(
        uncertain.handoff_confirmed_to.as_deref(),
        Some("orders.retry.5s")
    );
    assert_eq!(
        (report.totals.acks_confirmed, report.totals.acks_uncertain),
        (1, 1)
    );
}

#[test]
fn the_schema_rejects_what_a_report_never_contains() {
    let mut json = serde_json::to_value(busy_report(0)).expect("serialize");
    json["unresolved"][0]["body"] = Value::String("card 4111".into());
    assert!(
        !validator().is_valid(&json),
        "extra fields such as a body are refused"
    );
    let mut json = serde_json::to_value(busy_report(0)).expect("serialize");
    json["schema"] = Value::String("lily.shutdown-report.v0".into());
    assert!(
        !validator().is_valid(&json),
        "another schema version is refused"
    );
}

#[test]
fn termination_summary_of_10000_unresolved_fits_the_kubernetes_limit() {
    let report = busy_report(10_000);
    let summary = report.termination_summary();
    assert!(
        summary.len() <= TERMINATION_MESSAGE_MAX,
        "{} bytes",
        summary.len()
    );
    assert!(summary.contains("more (see the full report)"));
}
