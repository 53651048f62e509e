//! What a lane command knows about one message, and which messages a selection takes.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use clap::Args;
use lapin::BasicProperties;
use lapin::types::{AMQPValue, FieldTable};
use lily_mq_core::headers;
use lily_mq_core::transport::as_text;

/// The failure kind of a message the broker dead-lettered itself (an oversized message Lily
/// rejected, a quorum queue's delivery limit): it carries `x-death`, not Lily's headers.
pub(crate) const BROKER: &str = "broker";

/// One message in a lane, as its properties and headers describe it. Never its body.
#[derive(Clone, Debug)]
pub(crate) struct Seen {
    /// The `message_id` property.
    pub(crate) message_id: Option<String>,
    /// `retryable`, `permanent`, `indeterminate`, `rejected` (the gate refused the envelope),
    /// [`BROKER`], or `unknown`.
    pub(crate) kind: String,
    /// The `type` property.
    pub(crate) message_type: Option<String>,
    /// Lily's bounded, sanitized reason, or what the broker's `x-death` says.
    pub(crate) reason: String,
    /// When it failed (last), in milliseconds since the Unix epoch.
    pub(crate) failed_at_ms: Option<i64>,
}

impl Seen {
    /// Reads a message's properties.
    pub(crate) fn of(props: &BasicProperties) -> Self {
        let table = props.headers().as_ref();
        let header = |key: &str| table.and_then(|t| t.inner().get(key));
        let text = |key: &str| header(key).and_then(as_text).map(clean);
        let death = table.and_then(latest_death);
        let (kind, reason) = match (text(headers::FAILURE_KIND), &death) {
            (Some(kind), _) => (kind, text(headers::REASON).unwrap_or_default()),
            (None, Some((why, _))) => (
                BROKER.to_owned(),
                format!("dead-lettered by the broker: {why}"),
            ),
            (None, None) => ("unknown".to_owned(), String::new()),
        };
        let failed_at_ms = match header(headers::LAST_FAILURE_AT) {
            Some(AMQPValue::LongLongInt(ms)) => Some(*ms),
            _ => death.and_then(|(_, at)| at),
        };
        Self {
            message_id: props.message_id().as_ref().map(|s| clean(s.as_str())),
            kind,
            message_type: props.kind().as_ref().map(|s| clean(s.as_str())),
            reason,
            failed_at_ms,
        }
    }
}

pub(crate) use lily_mq_cli::message::clean;

/// The reason and time (ms) of the latest `x-death` entry.
fn latest_death(table: &FieldTable) -> Option<(String, Option<i64>)> {
    let AMQPValue::FieldArray(deaths) = table.inner().get("x-death")? else {
        return None;
    };
    let AMQPValue::FieldTable(latest) = deaths.as_slice().first()? else {
        return None;
    };
    let reason = latest
        .inner()
        .get("reason")
        .and_then(as_text)
        .map_or_else(|| "unknown".to_owned(), clean);
    let at = match latest.inner().get("time") {
        Some(AMQPValue::Timestamp(seconds)) => i64::try_from(*seconds)
            .ok()
            .and_then(|s| s.checked_mul(1000)),
        _ => None,
    };
    Some((reason, at))
}

/// Which messages a replay or a purge takes. Criteria combine with AND; several `--id`s with OR.
#[derive(Args, Clone, Debug, Default)]
pub(crate) struct Selection {
    /// Take this message id (repeat for several).
    #[arg(long = "id", value_name = "ID")]
    ids: Vec<String>,
    /// Take messages whose reason contains this text.
    #[arg(long, value_name = "TEXT")]
    reason: Option<String>,
    /// Take messages of this failure kind: retryable, permanent, indeterminate, rejected
    /// (refused by the gate) or broker (dead-lettered by the broker).
    #[arg(long, value_name = "KIND")]
    kind: Option<String>,
    /// Take messages of this type (the `type` property).
    #[arg(long = "type", value_name = "TYPE")]
    message_type: Option<String>,
    /// Take messages that failed at or after TIME: RFC 3339 (2026-12-01T09:00:00Z) or an age
    /// (90m, 2h, 1d).
    #[arg(long, value_name = "TIME", value_parser = parse_when)]
    since: Option<i64>,
    /// Take messages that failed before TIME (same forms as --since).
    #[arg(long, value_name = "TIME", value_parser = parse_when)]
    until: Option<i64>,
    /// Take every message.
    #[arg(long, conflicts_with_all = ["ids", "reason", "kind", "message_type", "since", "until"])]
    all: bool,
}

impl Selection {
    /// The selection, once it says what it takes.
    ///
    /// # Errors
    /// Nothing was selected: neither a criterion nor `--all`.
    pub(crate) fn check(self) -> Result<Self, String> {
        let any = !self.ids.is_empty()
            || self.reason.is_some()
            || self.kind.is_some()
            || self.message_type.is_some()
            || self.since.is_some()
            || self.until.is_some();
        if any || self.all {
            Ok(self)
        } else {
            Err(
                "say which messages: --id, --reason, --kind, --type, --since, --until, or --all"
                    .into(),
            )
        }
    }

    /// Whether it takes `seen`.
    pub(crate) fn takes(&self, seen: &Seen) -> bool {
        if self.all {
            return true;
        }
        let id = seen.message_id.as_deref();
        (self.ids.is_empty() || self.ids.iter().any(|want| Some(want.as_str()) == id))
            && self
                .reason
                .as_ref()
                .is_none_or(|text| seen.reason.contains(text.as_str()))
            && self.kind.as_ref().is_none_or(|kind| *kind == seen.kind)
            && self
                .message_type
                .as_ref()
                .is_none_or(|t| seen.message_type.as_deref() == Some(t.as_str()))
            && self
                .since
                .is_none_or(|since| seen.failed_at_ms.is_some_and(|at| at >= since))
            && self
                .until
                .is_none_or(|until| seen.failed_at_ms.is_some_and(|at| at < until))
    }
}

/// Milliseconds since the Unix epoch, now.
pub(crate) fn now_millis() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
}

/// An RFC 3339 time, or an age before now, in milliseconds since the Unix epoch.
fn parse_when(text: &str) -> Result<i64, String> {
    let millis = |d: Duration| i64::try_from(d.as_millis()).unwrap_or(i64::MAX);
    if let Ok(at) = humantime::parse_rfc3339_weak(text) {
        return at
            .duration_since(UNIX_EPOCH)
            .map(millis)
            .map_err(|_| "a time before 1970".into());
    }
    humantime::parse_duration(text)
        .map(|age| now_millis().saturating_sub(millis(age)))
        .map_err(|_| "expected an RFC 3339 time (2026-12-01T09:00:00Z) or an age (90m, 2h)".into())
}

#[cfg(test)]
mod tests {
    use lapin::types::{FieldArray, LongString};

    use super::*;

    fn long(text: &str) -> AMQPValue {
        AMQPValue::LongString(LongString::from(text.as_bytes().to_vec()))
    }

    fn copy(id: &str, kind: &str, reason: &str, at: i64) -> Seen {
        let mut table = FieldTable::default();
        table.insert(headers::FAILURE_KIND.into(), long(kind));
        table.insert(headers::REASON.into(), long(reason));
        table.insert(headers::LAST_FAILURE_AT.into(), AMQPValue::LongLongInt(at));
        Seen::of(
            &BasicProperties::default()
                .with_message_id(id.into())
                .with_type("order.placed".into())
                .with_headers(table),
        )
    }

    #[test]
    fn criteria_combine_with_and_and_ids_with_or() {
        let a = copy("a", "permanent", "unknown sku", 1_000);
        let b = copy("b", "retryable", "attempts exhausted: stock down", 2_000);
        let take = |s: Selection| [&a, &b].map(|seen| s.takes(seen));
        let ids = Selection {
            ids: vec!["a".into(), "b".into()],
            ..Selection::default()
        };
        assert_eq!(take(ids.clone()), [true, true]);
        let narrowed = Selection {
            kind: Some("retryable".into()),
            ..ids
        };
        assert_eq!(take(narrowed), [false, true]);
        let reason = Selection {
            reason: Some("sku".into()),
            ..Selection::default()
        };
        assert_eq!(take(reason), [true, false]);
        let window = Selection {
            since: Some(1_500),
            until: Some(2_001),
            ..Selection::default()
        };
        assert_eq!(take(window), [false, true]);
        assert!(Selection::default().check().is_err());
    }

    #[test]
    fn a_message_the_broker_dead_lettered_is_described_by_its_x_death() {
        let mut death = FieldTable::default();
        death.insert("reason".into(), long("rejected"));
        death.insert("time".into(), AMQPValue::Timestamp(1_700_000_000));
        let mut table = FieldTable::default();
        table.insert(
            "x-death".into(),
            AMQPValue::FieldArray(FieldArray::from(vec![AMQPValue::FieldTable(death)])),
        );
        let seen = Seen::of(&BasicProperties::default().with_headers(table));
        assert_eq!(seen.kind, BROKER);
        assert_eq!(seen.reason, "dead-lettered by the broker: rejected");
        assert_eq!(seen.failed_at_ms, Some(1_700_000_000_000));
    }

    #[test]
    fn times_are_rfc_3339_or_ages() {
        assert_eq!(parse_when("1970-01-01T00:00:01Z"), Ok(1000));
        let two_hours_ago = parse_when("2h").expect("an age");
        assert!((now_millis() - two_hours_ago - 7_200_000).abs() < 60_000);
        assert!(parse_when("yesterday").is_err());
    }
}
