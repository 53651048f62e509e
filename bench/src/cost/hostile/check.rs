//! The evidence of a hostile run, read from outside the consumer: every queue of the topology
//! drained with `basic.get` by message id, beside the handler's own record of its successes
//! (the application's effect). Bodies are measured, never printed.

use std::collections::BTreeMap;
use std::time::Duration;

use lapin::types::AMQPValue;
use lily::headers;
use lily::headers::as_text;
use lily::topology::Topology;
use lily_mq_testkit::Client;
use serde_json::{Value, json};

use super::limits;
use super::messages::{CLASSES, Class, Expected, KEY_PREFIX, body_len, id, index};

/// One place a message ended in.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Outcome {
    /// The handler succeeded, on this attempt.
    Handled(u32),
    /// A copy in the DLQ with this failure kind.
    DeadLettered(String),
    /// Still in this queue after the consumer exited: not settled.
    Left(String),
}

impl Outcome {
    fn name(&self) -> String {
        match self {
            Self::Handled(attempt) => format!("handled on attempt {attempt}"),
            Self::DeadLettered(kind) => format!("dlq: {kind}"),
            Self::Left(queue) => format!("left in {queue}"),
        }
    }

    fn matches(&self, expected: Expected) -> bool {
        match (self, expected) {
            (Self::Handled(a), Expected::Handled { attempt }) => *a == attempt,
            (Self::DeadLettered(k), Expected::DeadLettered(kind)) => k == kind,
            _ => false,
        }
    }
}

/// What a DLQ copy says about itself.
fn failure_kind(properties: &lapin::BasicProperties) -> String {
    let table = properties.headers().as_ref().map(|t| t.inner());
    let text = |key: &str| table.and_then(|t| t.get(key)).and_then(as_text);
    if let Some(kind) = text(headers::FAILURE_KIND) {
        return kind.to_owned();
    }
    match table.and_then(|t| t.get("x-death")) {
        Some(AMQPValue::FieldArray(_)) => {
            format!("broker-{}", text("x-first-death-reason").unwrap_or("dlx"))
        }
        _ => "unmarked".to_owned(),
    }
}

/// What [`drain`] reads of one message (never its body, only its length).
struct Seen {
    index: Option<usize>,
    kind: String,
    /// `x-lily-reason`, bounded and sanitized by Lily.
    reason: Option<String>,
    body_len: usize,
    hostile_headers: bool,
}

/// Drains `queue` and calls `each` with what it reads of every message.
async fn drain(client: &Client, queue: &str, mut each: impl FnMut(Seen)) -> usize {
    let mut count = 0;
    while let Some(message) = client.take(queue, Duration::ZERO).await {
        let properties = &message.delivery.properties;
        let i = properties
            .message_id()
            .as_ref()
            .and_then(|m| index(m.as_str()));
        let hostile_headers = properties
            .headers()
            .as_ref()
            .is_some_and(|t| t.inner().keys().any(|k| k.as_str().starts_with(KEY_PREFIX)));
        let reason = properties
            .headers()
            .as_ref()
            .and_then(|t| t.inner().get(headers::REASON))
            .and_then(as_text)
            .map(str::to_owned);
        each(Seen {
            index: i,
            kind: failure_kind(properties),
            reason,
            body_len: message.delivery.data.len(),
            hostile_headers,
        });
        count += 1;
    }
    count
}

/// Drains every queue of `topology` and judges each of the `n` ids against `expected`, given
/// the handler's record (`tally` of the child's `RESULT`).
pub async fn evidence(
    client: &Client,
    topology: &Topology,
    n: usize,
    tally: &Value,
    expected: impl Fn(Class) -> Expected,
) -> Value {
    let limits = limits();
    let mut outcomes: Vec<Vec<Outcome>> = vec![Vec::new(); n];
    let ok = tally["ok"].as_array().cloned().unwrap_or_default();
    let attempt = tally["attempt"].as_array().cloned().unwrap_or_default();
    for (i, slot) in outcomes.iter_mut().enumerate() {
        let times = ok.get(i).and_then(Value::as_u64).unwrap_or(0);
        let at = attempt.get(i).and_then(Value::as_u64).unwrap_or(0) as u32;
        slot.extend((0..times).map(|_| Outcome::Handled(at)));
    }
    let mut strangers = 0;
    let mut wrong_body = 0;
    let mut sanitized = 0;
    let mut unsanitized_refusals = 0;
    let dlq = topology.dead_letter_queue();
    let mut lanes = vec![topology.queue().to_owned(), topology.parking_queue()];
    lanes.extend(topology.buckets().map(|(name, _)| name.to_owned()));
    let mut left = BTreeMap::new();
    for lane in &lanes {
        let count = drain(client, lane, |seen| match seen.index.filter(|i| *i < n) {
            Some(i) => outcomes[i].push(Outcome::Left(lane.clone())),
            None => strangers += 1,
        })
        .await;
        if count > 0 {
            left.insert(lane.clone(), count);
        }
    }
    let mut reasons: BTreeMap<String, BTreeMap<String, usize>> = BTreeMap::new();
    let dead_lettered = drain(client, &dlq, |seen| {
        let Some(i) = seen.index.filter(|i| *i < n) else {
            strangers += 1;
            return;
        };
        let class = Class::of(i, n);
        if seen.body_len != body_len(class, &limits) {
            wrong_body += 1;
        }
        if seen.kind == "rejected" {
            if seen.hostile_headers {
                unsanitized_refusals += 1;
            } else {
                sanitized += 1;
            }
        }
        let reason = seen.reason.unwrap_or_else(|| "-".into());
        *reasons
            .entry(class.name().to_owned())
            .or_default()
            .entry(reason)
            .or_default() += 1;
        outcomes[i].push(Outcome::DeadLettered(seen.kind));
    })
    .await;

    let mut missing = Vec::new();
    let mut duplicated = 0;
    let mut unexpected = 0;
    let mut by_class: BTreeMap<Class, BTreeMap<String, usize>> = BTreeMap::new();
    let mut examples = Vec::new();
    for (i, found) in outcomes.iter().enumerate() {
        let class = Class::of(i, n);
        let tally = by_class.entry(class).or_default();
        match found.as_slice() {
            [] => {
                missing.push(id(i));
                *tally.entry("missing".into()).or_default() += 1;
            }
            [one] => {
                *tally.entry(one.name()).or_default() += 1;
                if !one.matches(expected(class)) {
                    unexpected += 1;
                    if examples.len() < 5 {
                        examples.push(format!("{} ({}): {}", id(i), class.name(), one.name()));
                    }
                }
            }
            many => {
                duplicated += 1;
                let names: Vec<String> = many.iter().map(Outcome::name).collect();
                *tally.entry(names.join(" + ")).or_default() += 1;
                if examples.len() < 5 {
                    examples.push(format!(
                        "{} ({}): {}",
                        id(i),
                        class.name(),
                        names.join(" + ")
                    ));
                }
            }
        }
    }
    let classes: serde_json::Map<String, Value> = CLASSES
        .iter()
        .filter_map(|class| {
            let seen = by_class.get(class)?;
            Some((
                class.name().to_owned(),
                json!({
                    "sent": seen.values().sum::<usize>(),
                    "expected": match expected(*class) {
                        Expected::Handled { attempt } => format!("handled on attempt {attempt}"),
                        Expected::DeadLettered(kind) => format!("dlq: {kind}"),
                    },
                    "found": seen,
                }),
            ))
        })
        .collect();
    let unsettled = outcomes
        .iter()
        .filter(|o| o.iter().any(|x| matches!(x, Outcome::Left(_))))
        .count();
    let missing_count = missing.len();
    missing.truncate(20);
    json!({
        "sent": n,
        "settled": n - missing_count - unsettled,
        "missing_count": missing_count,
        "missing": missing,
        "unsettled": unsettled,
        "left_in_queues": left,
        "dead_lettered": dead_lettered,
        "duplicated": duplicated,
        "unexpected": unexpected,
        "examples": examples,
        "copies_with_wrong_body_length": wrong_body,
        "refusals_sanitized": sanitized,
        "refusals_with_hostile_headers": unsanitized_refusals,
        "messages_of_other_runs": strangers,
        "dlq_reasons_by_class": reasons,
        "by_class": classes,
    })
}
