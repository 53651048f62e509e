//! What Lily's example demos share: reading their dead-letter queue as an operator would see
//! it (identity and Lily's headers, never a body), and an error with its sources on one line.

use std::error::Error as StdError;

use lapin::Connection;
use lapin::options::{BasicAckOptions, BasicGetOptions};
use lapin::types::{AMQPValue, FieldTable};
use lily::headers;

/// A dead-lettered message as the demos show it: identity and Lily's headers, no body.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeadLetter {
    /// Its `message_id`, or `-`.
    pub message_id: String,
    /// `x-lily-failure-kind`, or `-`.
    pub failure_kind: String,
    /// `x-lily-reason`, or `-`.
    pub reason: String,
    /// `x-lily-attempt`, or `-`.
    pub attempt: String,
}

/// Takes every message off `queue` (`basic.get`, then ACK), in `message_id` order. Bounded: a
/// demo's DLQ holds a handful of messages, and at most 1 000 are taken.
///
/// # Errors
/// The channel could not be opened, or a get or an ACK failed.
pub async fn drain_dead_letters(
    connection: &Connection,
    queue: &str,
) -> lapin::Result<Vec<DeadLetter>> {
    let channel = connection.create_channel().await?;
    let mut out = Vec::new();
    while out.len() < 1000 {
        let Some(message) = channel
            .basic_get(queue.into(), BasicGetOptions { no_ack: false })
            .await?
        else {
            break;
        };
        let props = &message.delivery.properties;
        let header = |key: &str| {
            props
                .headers()
                .as_ref()
                .and_then(|h: &FieldTable| h.inner().get(key))
                .map_or_else(|| "-".to_owned(), header_text)
        };
        out.push(DeadLetter {
            message_id: props
                .message_id()
                .as_ref()
                .map_or_else(|| "-".to_owned(), |id| id.as_str().to_owned()),
            failure_kind: header(headers::FAILURE_KIND),
            reason: header(headers::REASON),
            attempt: header(headers::ATTEMPT),
        });
        message
            .delivery
            .acker
            .ack(BasicAckOptions::default())
            .await?;
    }
    let _ = channel.close(200, "drained".into()).await;
    out.sort_by(|a, b| a.message_id.cmp(&b.message_id));
    Ok(out)
}

/// A header value as text.
pub fn header_text(value: &AMQPValue) -> String {
    match value {
        AMQPValue::LongString(s) => String::from_utf8_lossy(s.as_bytes()).into_owned(),
        AMQPValue::ShortString(s) => s.as_str().to_owned(),
        AMQPValue::ShortShortUInt(n) => n.to_string(),
        AMQPValue::ShortUInt(n) => n.to_string(),
        AMQPValue::LongUInt(n) => n.to_string(),
        AMQPValue::ShortShortInt(n) => n.to_string(),
        AMQPValue::ShortInt(n) => n.to_string(),
        AMQPValue::LongInt(n) => n.to_string(),
        AMQPValue::LongLongInt(n) => n.to_string(),
        other => format!("{other:?}"),
    }
}

/// An error and its sources on one line.
pub fn error_chain(err: &(dyn StdError + 'static)) -> String {
    let mut text = err.to_string();
    let mut source = err.source();
    while let Some(cause) = source {
        text.push_str(": ");
        text.push_str(&cause.to_string());
        source = cause.source();
    }
    text
}
