//! The broker's version, as it announces it, and what Lily sets because of it.
//!
//! AMQP 0-9-1 tells a client the broker's version once, in `connection.start`, and lapin does
//! not keep it. So Lily asks for it on a connection of its own that ends after that first
//! frame: the protocol header out, `connection.start` in, the socket closed (the broker logs a
//! connection closed during its handshake).

use std::fmt;
use std::time::Duration;

use futures_io::{AsyncRead, AsyncWrite};
use futures_util::io::{AsyncReadExt, AsyncWriteExt};
use lapin::protocol::{AMQPClass, connection};
use lapin::tcp::AsyncTcpStream;
use lapin::types::AMQPValue;

/// A RabbitMQ version, `major.minor.patch`, as its `connection.start` names it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct BrokerVersion {
    /// 3 or 4.
    pub major: u16,
    /// 10 of 3.10.8.
    pub minor: u16,
    /// 8 of 3.10.8.
    pub patch: u16,
}

impl BrokerVersion {
    /// The version in `text`: `4.0.5`, `3.10.8`, `4.1.0-rc.1` (a suffix after the numbers
    /// is ignored). `None` when it does not start with two numbers.
    pub fn parse(text: &str) -> Option<Self> {
        let numbers = text.split(['-', '+']).next()?;
        let mut parts = numbers.split('.').map(str::parse::<u16>);
        let major = parts.next()?.ok()?;
        let minor = parts.next()?.ok()?;
        let patch = parts.next().and_then(Result::ok).unwrap_or(0);
        Some(Self {
            major,
            minor,
            patch,
        })
    }

    /// Whether a quorum queue declared without `x-delivery-limit` has a limit anyway (4.0 and
    /// later: 20), so a queue that must have none is declared with `-1`. Before 4.0 a queue has
    /// none unless asked, and `-1` is taken as a limit that drops every message at its first
    /// return: never sent there.
    pub fn limits_deliveries_by_default(self) -> bool {
        self.major >= 4
    }
}

impl fmt::Display for BrokerVersion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}.{}.{}", self.major, self.minor, self.patch)
    }
}

/// The longest `connection.start` frame read: RabbitMQ's is about 500 bytes.
const START_FRAME_MAX: usize = 64 * 1024;

/// Sends the protocol header on `stream` and reads the broker's version from its
/// `connection.start`, within `wait`. `None` when the broker said nothing parseable in time.
pub(crate) async fn read_version<S>(
    stream: &mut AsyncTcpStream<S>,
    wait: Duration,
) -> Option<BrokerVersion>
where
    S: AsyncRead + AsyncWrite + Send + Unpin + 'static,
{
    let exchange = async {
        stream.write_all(b"AMQP\x00\x00\x09\x01").await.ok()?;
        stream.flush().await.ok()?;
        let mut frame = vec![0u8; 7];
        stream.read_exact(&mut frame).await.ok()?;
        let size = u32::from_be_bytes([frame[3], frame[4], frame[5], frame[6]]) as usize;
        if size > START_FRAME_MAX {
            return None;
        }
        frame.resize(7 + size + 1, 0);
        stream.read_exact(&mut frame[7..]).await.ok()?;
        version_of(&frame)
    };
    tokio::time::timeout(wait, exchange).await.ok().flatten()
}

/// The `version` server property of a `connection.start` frame.
fn version_of(frame: &[u8]) -> Option<BrokerVersion> {
    let (_, parsed) = amq_protocol::frame::parse_frame(frame).ok()?;
    let amq_protocol::frame::AMQPFrame::Method(
        0,
        AMQPClass::Connection(connection::AMQPMethod::Start(start)),
    ) = parsed
    else {
        return None;
    };
    match start.server_properties.inner().get("version")? {
        AMQPValue::LongString(text) => BrokerVersion::parse(&text.to_string()),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn versions_parse_with_and_without_a_suffix() {
        let v = |major, minor, patch| BrokerVersion {
            major,
            minor,
            patch,
        };
        assert_eq!(BrokerVersion::parse("4.0.5"), Some(v(4, 0, 5)));
        assert_eq!(BrokerVersion::parse("3.10.8"), Some(v(3, 10, 8)));
        assert_eq!(BrokerVersion::parse("4.1.0-rc.1"), Some(v(4, 1, 0)));
        assert_eq!(BrokerVersion::parse("4.2"), Some(v(4, 2, 0)));
        assert_eq!(BrokerVersion::parse("4"), None);
        assert_eq!(BrokerVersion::parse("x.y"), None);
        assert!(v(4, 0, 5).limits_deliveries_by_default());
        assert!(!v(3, 13, 7).limits_deliveries_by_default());
        assert_eq!(v(3, 10, 8).to_string(), "3.10.8");
    }

    #[test]
    fn the_version_is_read_from_a_connection_start_frame() {
        use amq_protocol::frame::{AMQPFrame, WriteContext, gen_frame};
        use lapin::types::{FieldTable, LongString};
        let mut properties = FieldTable::default();
        properties.insert(
            "product".into(),
            AMQPValue::LongString(LongString::from("RabbitMQ")),
        );
        properties.insert(
            "version".into(),
            AMQPValue::LongString(LongString::from("4.0.5")),
        );
        let start = connection::Start {
            version_major: 0,
            version_minor: 9,
            server_properties: properties,
            mechanisms: LongString::from("PLAIN"),
            locales: LongString::from("en_US"),
        };
        let frame = AMQPFrame::Method(
            0,
            AMQPClass::Connection(connection::AMQPMethod::Start(start)),
        );
        let wire = gen_frame(&frame)(WriteContext::from(Vec::new()))
            .expect("encodes")
            .write;
        assert_eq!(
            version_of(&wire),
            Some(BrokerVersion {
                major: 4,
                minor: 0,
                patch: 5
            })
        );
        assert_eq!(version_of(&wire[..wire.len() - 3]), None);
    }
}
