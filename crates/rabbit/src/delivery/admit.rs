//! A delivery before and after the gate: what the consumer and [`testing`](crate::testing) both
//! build the machine's [`Arrival`] from, and the copy a handoff publishes.

use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use lapin::BasicProperties;
use lapin::types::ShortString;
use lily_mq_core::machine::{Arrival, CopyOf, HeldCopy, Verdict, replayed_from};
use lily_mq_core::transport::{
    BoxedHandler, Cause, Envelope, Handoff, HandoffId, IncomingParts, Known, PropertiesView,
    as_text, as_u32, inspect, is_token,
};
use lily_mq_core::{HeaderKey, Incoming, Lane, Limits, Reason, Router, headers};

use crate::copy::handoff::{FailureNote, copy_properties, sanitized_properties};

/// A delivery as the broker handed it over.
pub(crate) struct Raw {
    pub(crate) body: Vec<u8>,
    pub(crate) properties: BasicProperties,
    pub(crate) exchange: ShortString,
    pub(crate) routing_key: ShortString,
    pub(crate) delivery_tag: u64,
    pub(crate) redelivered: bool,
    /// The first field whose bytes were not valid UTF-8 (see [`crate::wire`]).
    pub(crate) not_utf8: Option<&'static str>,
}

/// What the gate and dispatch made of a delivery.
pub(crate) struct Admitted {
    /// What the machine starts from. Its `local_requeues` is 0 for a valid id (`None`
    /// otherwise): the consumer fills in what its books know.
    pub(crate) arrival: Arrival,
    pub(crate) source: Source,
    pub(crate) handler: Option<BoxedHandler>,
}

/// The text of property `field`, unless its bytes were not UTF-8 (`not_utf8` names it).
fn sent<'p>(
    field: &str,
    value: &'p Option<ShortString>,
    not_utf8: Option<&str>,
) -> Option<&'p str> {
    value
        .as_ref()
        .filter(|_| not_utf8 != Some(field))
        .map(ShortString::as_str)
}

/// Runs the gate over `raw` and, if it passes, dispatches it through `router`.
pub(crate) fn admit(
    raw: Raw,
    router: &Router,
    limits: &Limits,
    queue: &Arc<str>,
    scoped: bool,
    key: &HeaderKey,
) -> Admitted {
    let Raw {
        body,
        properties,
        exchange,
        routing_key,
        delivery_tag,
        redelivered,
        not_utf8,
    } = raw;
    // A property whose bytes were rewritten is not read as the sender's: it only looks like it.
    let text = |field: &str, value| sent(field, value, not_utf8);
    let view = PropertiesView {
        message_id: text("message_id", properties.message_id()),
        kind: text("type", properties.kind()),
        content_type: text("content_type", properties.content_type()),
        headers: properties.headers().as_ref(),
        not_utf8,
        key: Some(key),
    };
    let ((verdict, handler), attempt, schema_version, delivery_count, known) =
        match inspect(&view, body.len(), limits) {
            Ok(env) => {
                let dispatched =
                    match router.dispatch(env.kind, env.schema_version, env.content_type) {
                        Ok(handler) => (Verdict::Dispatched, Some(handler.clone())),
                        Err(err) => (Verdict::Undispatched(err.reason().clone()), None),
                    };
                let Envelope {
                    attempt,
                    schema_version,
                    delivery_count,
                    known,
                    ..
                } = env;
                (dispatched, attempt, schema_version, delivery_count, known)
            }
            Err(rejection) => {
                let reason = rejection.reason(limits);
                let refused = (Verdict::Refused { rejection, reason }, None);
                let known = Known::lookup(view.headers, view.message_id, Some(key));
                (refused, 1, 1, known.delivery_count.and_then(as_u32), known)
            }
        };
    let refused = matches!(verdict, Verdict::Refused { .. });
    let arrival = Arrival {
        verdict,
        attempt,
        redelivered,
        delivery_count,
        local_requeues: None,
        scoped,
        held: HeldCopy::from_known(&known),
        replayed_from: replayed_from(&known),
        waits: known.waits.and_then(as_u32).unwrap_or(0),
    };
    let source = if refused {
        Source::Refused(Box::new(Refused {
            body,
            properties,
            exchange,
            routing_key,
            not_utf8,
        }))
    } else {
        Source::Passed(Arc::new(Incoming::from_parts(IncomingParts {
            body,
            properties,
            exchange,
            routing_key,
            queue: Arc::clone(queue),
            delivery_tag,
            redelivered,
            attempt,
            schema_version,
        })))
    };
    let mut admitted = Admitted {
        arrival,
        source,
        handler,
    };
    // The key of its requeue count: none without a valid id.
    admitted.arrival.local_requeues = admitted.source.message_id(limits).map(|_| 0);
    admitted
}

/// The message as the handler and the copies see it.
pub(crate) enum Source {
    /// It passed the gate.
    Passed(Arc<Incoming>),
    /// The gate refused it: a copy carries only sanitized metadata.
    Refused(Box<Refused>),
}

/// What a copy of a refused message is made from.
pub(crate) struct Refused {
    body: Vec<u8>,
    properties: BasicProperties,
    exchange: ShortString,
    routing_key: ShortString,
    /// The field whose bytes were not UTF-8: its rewritten text is not copied.
    not_utf8: Option<&'static str>,
}

/// What a handoff's copy says, besides what the machine chose.
pub(crate) struct CopyFacts<'a> {
    /// The work queue the original came from.
    pub(crate) source_queue: &'a str,
    pub(crate) id: HandoffId,
    /// Now, in milliseconds since the Unix epoch.
    pub(crate) at_millis: i64,
    pub(crate) limits: &'a Limits,
    /// Seals Lily's headers on the copy.
    pub(crate) key: &'a HeaderKey,
}

impl Source {
    /// The message's properties, headers included.
    pub(crate) fn properties(&self) -> &BasicProperties {
        match self {
            Self::Passed(incoming) => incoming.properties(),
            Self::Refused(refused) => &refused.properties,
        }
    }

    /// A text header of the message, if it has one.
    fn header_text(&self, key: &str) -> Option<&str> {
        as_text(self.properties().headers().as_ref()?.inner().get(key)?)
    }

    /// The message's valid id, if it has one: the key of its requeue count.
    pub(crate) fn message_id(&self, limits: &Limits) -> Option<&str> {
        match self {
            Self::Passed(incoming) => Some(incoming.message_id()),
            Self::Refused(refused) => refused
                .properties
                .message_id()
                .as_ref()
                .map(|s| s.as_str())
                .filter(|id| is_token(id, limits.max_message_id_len)),
        }
    }

    /// The body and properties of the copy `handoff` publishes; `reason` is the machine's.
    pub(crate) fn copy(
        &self,
        handoff: Handoff,
        reason: &Reason,
        copy: CopyOf,
        facts: &CopyFacts<'_>,
    ) -> (&[u8], BasicProperties) {
        let reason = match handoff.cause {
            // A held copy's own reason goes on unchanged.
            Cause::Held => self
                .header_text(headers::REASON)
                .map_or_else(|| reason.clone(), |text| Reason::new(text.to_owned())),
            cause => Reason::new(format!("{}: {reason}", cause.as_str())),
        };
        let note = FailureNote {
            lane: handoff.lane,
            kind: match (handoff.kind, handoff.lane) {
                (Some(kind), _) => kind.as_str(),
                (None, Lane::Wait { .. }) => "lease-wait",
                (None, _) => "rejected",
            },
            reason: &reason,
            key: facts.key,
            source_queue: facts.source_queue,
            id: facts.id,
            at_millis: facts.at_millis,
        };
        match (copy, self) {
            (CopyOf::Original, Self::Passed(incoming)) => {
                (incoming.body(), copy_properties(incoming, &note))
            }
            (CopyOf::Sanitized, Self::Passed(incoming)) => (
                incoming.body(),
                sanitized_properties(
                    incoming.properties(),
                    (incoming.exchange(), incoming.routing_key()),
                    None,
                    &note,
                    facts.limits,
                ),
            ),
            (_, Self::Refused(refused)) => (
                refused.body.as_slice(),
                sanitized_properties(
                    &refused.properties,
                    (refused.exchange.as_str(), refused.routing_key.as_str()),
                    refused.not_utf8,
                    &note,
                    facts.limits,
                ),
            ),
        }
    }
}

/// Now, in milliseconds since the Unix epoch, for the copy's failure headers.
pub(crate) fn epoch_millis() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
}
