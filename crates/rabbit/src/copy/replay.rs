//! What a replay publishes: the inverse of a handoff's copy.
//!
//! A copy in the dead-letter or parking lane keeps the message's body, `message_id` and
//! properties, and moves aside what RabbitMQ would act on in the lane (see the handoff's
//! `copy_properties`). [`replay_properties`] turns such a copy back into the message the
//! producer sent: it restores `expiration`, `user_id`, `CC` and `BCC`, drops Lily's failure
//! headers (so the attempt starts again at 1) and records the replay in
//! [`REPLAYED_FROM`](headers::REPLAYED_FROM), [`REPLAYED_AT`](headers::REPLAYED_AT) and
//! [`REPLAYS`](headers::REPLAYS). What the copy learnt on the way (`x-death`, the original
//! exchange and routing key) stays, and Lily's headers are sealed again
//! ([`HeaderKey`]). A copy whose `x-lily-*` headers carry no valid seal is not Lily's to
//! restore: it is replayed as it is, without any of them.
//!
//! A replay is published to the work queue's replay exchange ([`Topology::replay_exchange`]),
//! never the default exchange: the restored `CC` and `BCC` name routing keys of the original
//! exchange, and on the default exchange they would name queues, sending the message to
//! queues it was never meant for. The replay exchange routes only the work queue's name.
//!
//! [`Topology::replay_exchange`]: crate::Topology::replay_exchange

use std::fmt;

use lapin::BasicProperties;
use lapin::types::{AMQPValue, FieldTable, LongString, ShortString};
use lily_mq_core::transport::{as_text, as_u32};
use lily_mq_core::{HeaderKey, Terminal, headers};

/// Lily's headers about a failure, dropped on replay: the replayed message starts again.
const FAILURE_HEADERS: [&str; 10] = [
    headers::ATTEMPT,
    headers::FIRST_FAILURE_AT,
    headers::LAST_FAILURE_AT,
    headers::FAILURE_KIND,
    headers::REASON,
    headers::SOURCE_QUEUE,
    headers::HANDOFF_ID,
    headers::HELD_FOR,
    headers::HOLDS,
    headers::DELIVERY_COUNT,
];

/// How to replay a copy.
#[derive(Clone, Debug)]
pub struct Replay<'a> {
    /// The lane the copy is in.
    pub from: Terminal,
    /// When the replay happens, in milliseconds since the Unix epoch.
    pub at_millis: i64,
    /// The user the replay publishes as.
    pub user: &'a str,
    /// Leave an original `user_id` that is not `user` in its
    /// [`ORIGINAL_USER_ID`](headers::ORIGINAL_USER_ID) header instead of refusing the copy.
    pub keep_user_id_aside: bool,
    /// The key the consumers seal Lily's headers with: it checks the copy's and seals the
    /// replay's.
    pub key: &'a HeaderKey,
}

/// Why a copy cannot be replayed as it is.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Refusal {
    /// The original `user_id` is another user's: RabbitMQ refuses a publish whose `user_id` is
    /// not the publishing user.
    UserId {
        /// The original `user_id`.
        original: String,
    },
    /// What the copy would restore is not something the broker accepts (its `expiration` not
    /// a number of milliseconds, its `CC` not a list of routing keys): published, it would
    /// close the channel. Left in the lane.
    Invalid {
        /// The header that holds it.
        header: &'static str,
        /// What is wrong with it.
        problem: &'static str,
    },
}

impl fmt::Display for Refusal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::UserId { original } => write!(
                f,
                "its original user_id {:?} is not the replaying user, and RabbitMQ refuses such a \
                 publish: replay as that user, or keep the user_id aside",
                original.escape_debug().to_string()
            ),
            Self::Invalid { header, problem } => {
                write!(f, "{header} cannot be restored: {problem}")
            }
        }
    }
}

/// Checks what a replay would restore the way the broker will: an `expiration` of decimal
/// milliseconds (at most 2^32-1), `CC` and `BCC` as arrays, a textual `user_id`.
fn check_restorable(
    map: &std::collections::BTreeMap<ShortString, AMQPValue>,
) -> Result<(), Refusal> {
    let invalid = |header, problem| Err(Refusal::Invalid { header, problem });
    if let Some(value) = map.get(headers::ORIGINAL_EXPIRATION) {
        let ms = as_text(value).filter(|t| !t.is_empty() && t.bytes().all(|b| b.is_ascii_digit()));
        if ms.and_then(|t| t.parse::<u32>().ok()).is_none() {
            return invalid(
                headers::ORIGINAL_EXPIRATION,
                "not a whole number of milliseconds up to 4294967295",
            );
        }
    }
    for header in [headers::ORIGINAL_CC, headers::ORIGINAL_BCC] {
        match map.get(header) {
            None => {}
            // RabbitMQ refuses anything but an array here, and skips what in it is not text.
            Some(AMQPValue::FieldArray(_)) => {}
            Some(_) => return invalid(header, "not an array of routing keys"),
        }
    }
    if map
        .get(headers::ORIGINAL_USER_ID)
        .is_some_and(|v| as_text(v).is_none())
    {
        return invalid(headers::ORIGINAL_USER_ID, "not text");
    }
    Ok(())
}

/// The properties a replay of `copy` publishes: the producer's message, the attempt reset, the
/// replay recorded.
///
/// # Errors
/// [`Refusal::UserId`] when the original `user_id` is not `replay.user` and
/// [`Replay::keep_user_id_aside`] is off; [`Refusal::Invalid`] when what it would restore is
/// not something the broker accepts.
pub fn replay_properties(
    copy: &BasicProperties,
    replay: &Replay<'_>,
) -> Result<BasicProperties, Refusal> {
    let message_id = copy.message_id().as_ref().map_or("", |id| id.as_str());
    let mut map = match copy.headers() {
        // Not sealed by Lily: nothing of its namespace is restored or carried.
        Some(table) if !replay.key.verify(message_id, table) => {
            let mut map = table.inner().clone();
            map.retain(|key, _| !headers::is_lily(key.as_str()));
            map
        }
        Some(table) => table.inner().clone(),
        None => Default::default(),
    };
    map.remove(headers::SEAL);
    check_restorable(&map)?;
    for key in FAILURE_HEADERS {
        map.remove(key);
    }
    for (aside, routing) in [
        (headers::ORIGINAL_CC, headers::CC),
        (headers::ORIGINAL_BCC, headers::BCC),
    ] {
        if let Some(value) = map.remove(aside) {
            map.insert(routing.into(), value);
        }
    }
    let text = |value: Option<&AMQPValue>| value.and_then(as_text).map(str::to_owned);
    let mut props = copy.clone();
    if let Some(expiration) = text(map.get(headers::ORIGINAL_EXPIRATION)) {
        map.remove(headers::ORIGINAL_EXPIRATION);
        props = props.with_expiration(ShortString::from(expiration));
    }
    if let Some(user_id) = text(map.get(headers::ORIGINAL_USER_ID)) {
        if user_id == replay.user {
            map.remove(headers::ORIGINAL_USER_ID);
            props = props.with_user_id(ShortString::from(user_id));
        } else if !replay.keep_user_id_aside {
            return Err(Refusal::UserId { original: user_id });
        }
    }
    let replays = map
        .get(headers::REPLAYS)
        .and_then(as_u32)
        .unwrap_or(0)
        .saturating_add(1);
    map.insert(headers::REPLAYED_FROM.into(), long(replay.from.as_str()));
    map.insert(
        headers::REPLAYED_AT.into(),
        AMQPValue::LongLongInt(replay.at_millis),
    );
    map.insert(headers::REPLAYS.into(), AMQPValue::LongUInt(replays));
    let mut table = FieldTable::from(map);
    let seal = replay.key.seal(message_id, &table);
    table.insert(headers::SEAL.into(), seal);
    Ok(props.with_headers(table))
}

fn long(text: &str) -> AMQPValue {
    AMQPValue::LongString(LongString::from(text.as_bytes().to_vec()))
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use lily_mq_core::transport::{HandoffId, IncomingParts};
    use lily_mq_core::{Incoming, Lane, Reason};
    use proptest::prelude::*;

    use super::*;
    use crate::copy::handoff::{FailureNote, copy_properties};

    fn copy_of(original: &BasicProperties, lane: Lane) -> BasicProperties {
        let incoming = Incoming::from_parts(IncomingParts {
            body: b"{}".to_vec(),
            properties: original.clone(),
            exchange: "shop".into(),
            routing_key: "order.placed".into(),
            queue: Arc::from("orders"),
            delivery_tag: 1,
            redelivered: false,
            attempt: 3,
            schema_version: 1,
        });
        let reason = Reason::new("stock service down");
        copy_properties(
            &incoming,
            &FailureNote {
                lane,
                kind: "retryable",
                reason: &reason,
                key: lily_mq_core::HeaderKey::public_ref(),
                source_queue: "orders",
                id: HandoffId::new(7),
                at_millis: 1_700_000_000_000,
            },
        )
    }

    fn replay(from: Terminal, user: &str) -> Replay<'_> {
        Replay {
            from,
            at_millis: 1_800_000_000_000,
            user,
            keep_user_id_aside: false,
            key: HeaderKey::public_ref(),
        }
    }

    fn header<'a>(p: &'a BasicProperties, key: &str) -> Option<&'a AMQPValue> {
        p.headers().as_ref()?.inner().get(key)
    }

    /// A `CC` or `BCC` value: an array of routing keys, as RabbitMQ requires.
    fn keys(key: &str) -> AMQPValue {
        AMQPValue::FieldArray(vec![long(key)].into())
    }

    #[test]
    fn what_the_broker_would_refuse_is_not_restored() {
        let original = BasicProperties::default().with_message_id("order-1".into());
        let copy = copy_of(&original, Lane::DeadLetter);
        let mut table = copy.headers().clone().unwrap_or_default();
        for (key, value, problem) in [
            (
                headers::ORIGINAL_EXPIRATION,
                long("garbage"),
                "milliseconds",
            ),
            (headers::ORIGINAL_EXPIRATION, long("-1"), "milliseconds"),
            (
                headers::ORIGINAL_EXPIRATION,
                long("4294967296"),
                "milliseconds",
            ),
            (headers::ORIGINAL_CC, long("not-an-array"), "array"),
            (headers::ORIGINAL_BCC, AMQPValue::LongUInt(3), "array"),
            (headers::ORIGINAL_USER_ID, AMQPValue::LongUInt(3), "text"),
        ] {
            let mut forged = table.clone();
            forged.insert(key.into(), value);
            let seal = HeaderKey::public().seal("order-1", &forged);
            forged.insert(headers::SEAL.into(), seal);
            let refused = replay_properties(
                &copy.clone().with_headers(forged),
                &replay(Terminal::DeadLetter, "producer"),
            );
            match refused {
                Err(Refusal::Invalid { header, problem: p }) => {
                    assert_eq!(header, key);
                    assert!(p.contains(problem), "{key}: {p}");
                }
                other => panic!("{key}: {other:?}"),
            }
        }
        table.insert(headers::ORIGINAL_EXPIRATION.into(), long("60000"));
        let seal = HeaderKey::public().seal("order-1", &table);
        table.insert(headers::SEAL.into(), seal);
        let replayed = replay_properties(
            &copy.with_headers(table),
            &replay(Terminal::DeadLetter, "producer"),
        )
        .expect("a valid expiration is restored");
        assert_eq!(
            replayed.expiration().as_ref().map(|e| e.as_str()),
            Some("60000")
        );
    }

    /// The replay headers and the history a copy keeps, removed to compare with the original.
    fn without_replay_and_history(mut p: BasicProperties) -> BasicProperties {
        let mut map = p.headers().as_ref().map(|t| t.inner().clone());
        if let Some(map) = map.as_mut() {
            for key in [
                headers::REPLAYED_FROM,
                headers::REPLAYED_AT,
                headers::REPLAYS,
                headers::ORIGINAL_EXCHANGE,
                headers::ORIGINAL_ROUTING_KEY,
            ] {
                map.remove(key);
            }
            map.remove(headers::SEAL);
        }
        p = p.with_headers(FieldTable::from(map.unwrap_or_default()));
        p
    }

    #[test]
    fn a_replay_restores_what_the_copy_moved_aside_and_records_itself() {
        let mut table = FieldTable::default();
        table.insert(headers::CC.into(), keys("audit.orders"));
        table.insert(headers::BCC.into(), keys("hidden"));
        table.insert("customer".into(), long("kept"));
        let original = BasicProperties::default()
            .with_headers(table)
            .with_expiration("60000".into())
            .with_user_id("producer".into())
            .with_message_id("order-1".into())
            .with_type("order.placed".into())
            .with_delivery_mode(2);
        let copy = copy_of(&original, Lane::Parking);
        let replayed =
            replay_properties(&copy, &replay(Terminal::Parking, "producer")).expect("replayable");

        assert_eq!(replayed.expiration(), original.expiration());
        assert_eq!(replayed.user_id(), original.user_id());
        assert_eq!(header(&replayed, headers::CC), Some(&keys("audit.orders")));
        assert_eq!(header(&replayed, headers::BCC), Some(&keys("hidden")));
        assert_eq!(header(&replayed, headers::ATTEMPT), None, "attempt reset");
        assert_eq!(header(&replayed, headers::REASON), None);
        assert_eq!(
            header(&replayed, headers::REPLAYED_FROM),
            Some(&long("parking"))
        );
        assert_eq!(
            header(&replayed, headers::REPLAYS),
            Some(&AMQPValue::LongUInt(1))
        );
        assert_eq!(
            header(&replayed, headers::ORIGINAL_EXCHANGE),
            Some(&long("shop"))
        );
        // Replayed, it fails again and is replayed again: the count goes on.
        let again = replay_properties(
            &copy_of(&replayed, Lane::DeadLetter),
            &replay(Terminal::DeadLetter, "producer"),
        )
        .expect("replayable");
        assert_eq!(
            header(&again, headers::REPLAYS),
            Some(&AMQPValue::LongUInt(2))
        );
        assert_eq!(
            header(&again, headers::REPLAYED_FROM),
            Some(&long("dead-letter"))
        );
    }

    #[test]
    fn another_users_user_id_is_refused_or_kept_aside_never_published() {
        let original = BasicProperties::default()
            .with_user_id("producer".into())
            .with_message_id("order-1".into());
        let copy = copy_of(&original, Lane::DeadLetter);
        let refused = replay_properties(&copy, &replay(Terminal::DeadLetter, "operator"));
        assert_eq!(
            refused,
            Err(Refusal::UserId {
                original: "producer".into()
            })
        );
        let aside = replay_properties(
            &copy,
            &Replay {
                keep_user_id_aside: true,
                ..replay(Terminal::DeadLetter, "operator")
            },
        )
        .expect("kept aside");
        assert_eq!(aside.user_id(), &None);
        assert_eq!(
            header(&aside, headers::ORIGINAL_USER_ID),
            Some(&long("producer"))
        );
    }

    fn text() -> impl Strategy<Value = String> {
        "[a-z0-9.]{1,12}"
    }

    proptest! {
        /// Copy, then replay: the producer's properties and headers come back, whatever they
        /// were, with only the replay's record and the copy's history added.
        #[test]
        fn a_replay_of_a_copy_is_the_original(
            expiration in proptest::option::of("[1-9][0-9]{0,6}"),
            cc in proptest::option::of(text()),
            bcc in proptest::option::of(text()),
            extra in proptest::collection::btree_map("[a-w][a-z]{0,8}", text(), 0..4),
            priority in proptest::option::of(0u8..10),
            correlation in proptest::option::of(text()),
            parking in proptest::bool::ANY,
        ) {
            let mut table = FieldTable::default();
            if let Some(cc) = &cc {
                table.insert(headers::CC.into(), keys(cc));
            }
            if let Some(bcc) = &bcc {
                table.insert(headers::BCC.into(), keys(bcc));
            }
            for (k, v) in &extra {
                table.insert(k.as_str().into(), long(v));
            }
            let mut original = BasicProperties::default()
                .with_headers(table)
                .with_message_id("order-9".into())
                .with_type("order.placed".into())
                .with_user_id("producer".into())
                .with_delivery_mode(2);
            if let Some(e) = &expiration {
                original = original.with_expiration(e.as_str().into());
            }
            if let Some(p) = priority {
                original = original.with_priority(p);
            }
            if let Some(c) = &correlation {
                original = original.with_correlation_id(c.as_str().into());
            }
            let (lane, from) = if parking {
                (Lane::Parking, Terminal::Parking)
            } else {
                (Lane::DeadLetter, Terminal::DeadLetter)
            };
            let replayed = replay_properties(&copy_of(&original, lane), &replay(from, "producer"))
                .expect("replayable");
            prop_assert_eq!(without_replay_and_history(replayed), original);
        }
    }
}
