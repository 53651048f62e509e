//! Proof that Lily wrote the `x-lily-*` headers a message carries.
//!
//! Anyone who can publish to a work queue can set headers in Lily's namespace: an attempt
//! number, a held copy's lane, the original expiration a replay restores. Lily reads them only
//! under a seal it wrote itself ([`SEAL`](crate::headers::SEAL)): an HMAC-SHA-256 over the
//! message id and every `x-lily-*` header but the seal, in the table's order, truncated to
//! 128 bits. The gate ignores the namespace of a message whose seal is missing or wrong, and a
//! copy of it carries none of those headers: they never reach a lane as if Lily had written
//! them.
//!
//! The key comes from configuration. Without one, Lily uses a key written in its own source:
//! the seal then tells Lily's headers from a publisher's that were set by mistake or copied
//! from elsewhere, but a publisher who reads the source can forge it. What that buys is stated
//! beside [`HeaderKey::public`].

use std::fmt;
use std::sync::Arc;

use amq_protocol_types::{AMQPValue, FieldTable};
use hmac::{Hmac, KeyInit, Mac};
use sha2::Sha256;

use crate::headers::{SEAL, is_lily};

/// The bytes of a seal: 128 bits of the MAC.
const SEAL_BYTES: usize = 16;

/// What the MAC is bound to besides the headers: the scheme and its version.
const DOMAIN: &[u8] = b"lily-header-seal/1\0";

/// The key without configuration: public, written here.
const PUBLIC: &[u8] = b"lily: a public key, written in the source; configure your own";

/// The key that seals Lily's headers on the copies it publishes and checks them when a message
/// comes back. Every worker of a queue, and the `lily` command that replays its lanes, must
/// hold the same key. Its bytes are never printed.
#[derive(Clone)]
pub struct HeaderKey {
    key: Arc<[u8]>,
    public: bool,
}

impl HeaderKey {
    /// The fewest bytes a configured key may have.
    pub const MIN_LEN: usize = 16;

    /// A secret key of at least [`MIN_LEN`](Self::MIN_LEN) bytes (checked by the consumer's
    /// configuration; a shorter one is refused there).
    pub fn new(secret: impl AsRef<[u8]>) -> Self {
        Self {
            key: secret.as_ref().into(),
            public: false,
        }
    }

    /// The key Lily uses when none is configured. It is written in Lily's source, so the seal
    /// proves only that a header did not come from a publisher who set it without reading
    /// Lily's code: a forged attempt number, held-copy lane or replay header with a valid
    /// public seal is read as Lily's. What that buys a publisher is its own message in a lane
    /// it names, with the attempt number it chose, or restored with the properties it chose
    /// on replay; nothing of other messages.
    pub fn public() -> Self {
        Self {
            key: PUBLIC.into(),
            public: true,
        }
    }

    /// The public key, made once.
    pub fn public_ref() -> &'static Self {
        static PUBLIC_KEY: std::sync::LazyLock<HeaderKey> =
            std::sync::LazyLock::new(HeaderKey::public);
        &PUBLIC_KEY
    }

    /// Whether this is the [`public`](Self::public) key.
    pub fn is_public(&self) -> bool {
        self.public
    }

    /// Whether the configured key is long enough.
    pub fn is_long_enough(&self) -> bool {
        self.public || self.key.len() >= Self::MIN_LEN
    }

    /// The seal of `headers` for the message `message_id`: the value of
    /// [`SEAL`](crate::headers::SEAL).
    pub fn seal(&self, message_id: &str, headers: &FieldTable) -> AMQPValue {
        let tag = self.mac(message_id, headers).finalize().into_bytes();
        let mut hex = String::with_capacity(SEAL_BYTES * 2);
        for byte in &tag[..SEAL_BYTES] {
            hex.push(char::from(HEX[usize::from(byte >> 4)]));
            hex.push(char::from(HEX[usize::from(byte & 0xf)]));
        }
        AMQPValue::LongString(hex.into())
    }

    /// Whether `headers` carry a valid seal for the message `message_id`.
    pub fn verify(&self, message_id: &str, headers: &FieldTable) -> bool {
        let Some(seal) = headers.inner().get(SEAL).and_then(crate::headers::as_text) else {
            return false;
        };
        let Some(tag) = from_hex(seal) else {
            return false;
        };
        self.mac(message_id, headers)
            .verify_truncated_left(&tag)
            .is_ok()
    }

    fn mac(&self, message_id: &str, headers: &FieldTable) -> Hmac<Sha256> {
        let mut mac = <Hmac<Sha256> as KeyInit>::new_from_slice(&self.key)
            .unwrap_or_else(|_| unreachable!("HMAC takes a key of any length"));
        mac.update(DOMAIN);
        bytes(&mut mac, message_id.as_bytes());
        for (key, value) in headers.inner() {
            if is_lily(key.as_str()) && key.as_str() != SEAL {
                bytes(&mut mac, key.as_str().as_bytes());
                encode(&mut mac, value);
            }
        }
        mac
    }
}

impl Default for HeaderKey {
    fn default() -> Self {
        Self::public()
    }
}

impl fmt::Debug for HeaderKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("HeaderKey")
            .field("public", &self.public)
            .finish_non_exhaustive()
    }
}

const HEX: &[u8; 16] = b"0123456789abcdef";

fn from_hex(text: &str) -> Option<[u8; SEAL_BYTES]> {
    let text = text.as_bytes();
    if text.len() != SEAL_BYTES * 2 {
        return None;
    }
    let nibble = |c: u8| {
        HEX.iter()
            .position(|h| *h == c)
            .and_then(|n| u8::try_from(n).ok())
    };
    let mut out = [0; SEAL_BYTES];
    for (byte, pair) in out.iter_mut().zip(text.chunks_exact(2)) {
        *byte = nibble(pair[0])? << 4 | nibble(pair[1])?;
    }
    Some(out)
}

/// Length-prefixed bytes: no two sequences of fields encode alike.
fn bytes(mac: &mut Hmac<Sha256>, data: &[u8]) {
    mac.update(&u64::try_from(data.len()).unwrap_or(u64::MAX).to_be_bytes());
    mac.update(data);
}

/// A value, tagged with its type.
fn encode(mac: &mut Hmac<Sha256>, value: &AMQPValue) {
    let mut tag = |t: u8, data: &[u8]| {
        mac.update(&[t]);
        bytes(mac, data);
    };
    match value {
        AMQPValue::Boolean(b) => tag(b't', &[u8::from(*b)]),
        AMQPValue::ShortShortInt(n) => tag(b'b', &n.to_be_bytes()),
        AMQPValue::ShortShortUInt(n) => tag(b'B', &n.to_be_bytes()),
        AMQPValue::ShortInt(n) => tag(b's', &n.to_be_bytes()),
        AMQPValue::ShortUInt(n) => tag(b'u', &n.to_be_bytes()),
        AMQPValue::LongInt(n) => tag(b'I', &n.to_be_bytes()),
        AMQPValue::LongUInt(n) => tag(b'i', &n.to_be_bytes()),
        AMQPValue::LongLongInt(n) => tag(b'l', &n.to_be_bytes()),
        AMQPValue::Float(n) => tag(b'f', &n.to_bits().to_be_bytes()),
        AMQPValue::Double(n) => tag(b'd', &n.to_bits().to_be_bytes()),
        AMQPValue::DecimalValue(d) => {
            let mut data = vec![d.scale];
            data.extend_from_slice(&d.value.to_be_bytes());
            tag(b'D', &data);
        }
        AMQPValue::ShortString(s) => tag(b's', s.as_str().as_bytes()),
        AMQPValue::LongString(s) => tag(b'S', s.as_bytes()),
        AMQPValue::Timestamp(n) => tag(b'T', &n.to_be_bytes()),
        AMQPValue::ByteArray(a) => tag(b'x', a.as_slice()),
        AMQPValue::Void => tag(b'V', &[]),
        AMQPValue::FieldArray(array) => {
            let items = array.as_slice();
            tag(
                b'A',
                &u64::try_from(items.len()).unwrap_or(u64::MAX).to_be_bytes(),
            );
            for item in items {
                encode(mac, item);
            }
        }
        AMQPValue::FieldTable(table) => {
            let entries = table.inner();
            tag(
                b'F',
                &u64::try_from(entries.len())
                    .unwrap_or(u64::MAX)
                    .to_be_bytes(),
            );
            for (key, item) in entries {
                bytes(mac, key.as_str().as_bytes());
                encode(mac, item);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use amq_protocol_types::{AMQPValue, FieldArray, FieldTable};

    use super::HeaderKey;
    use crate::headers::{ATTEMPT, HELD_FOR, SEAL};

    fn lily_headers() -> FieldTable {
        let mut table = FieldTable::default();
        table.insert(ATTEMPT.into(), AMQPValue::LongUInt(3));
        table.insert(HELD_FOR.into(), AMQPValue::LongString("dead-letter".into()));
        table.insert(
            "x-lily-original-cc".into(),
            AMQPValue::FieldArray(FieldArray::from(vec![AMQPValue::LongString("a".into())])),
        );
        table.insert("producer".into(), AMQPValue::LongString("kept".into()));
        table
    }

    fn sealed(key: &HeaderKey, id: &str) -> FieldTable {
        let mut table = lily_headers();
        let seal = key.seal(id, &table);
        table.insert(SEAL.into(), seal);
        table
    }

    #[test]
    fn a_seal_holds_for_its_message_and_key_only() {
        let key = HeaderKey::new("a secret of sixteen bytes or more");
        let table = sealed(&key, "m-1");
        assert!(key.verify("m-1", &table));
        assert!(!key.verify("m-2", &table), "another message's id");
        assert!(!HeaderKey::public().verify("m-1", &table), "another key");
        assert!(!key.verify("m-1", &lily_headers()), "no seal");
    }

    #[test]
    fn any_change_to_lilys_headers_breaks_the_seal_and_the_producers_do_not() {
        let key = HeaderKey::public();
        let mut changed = sealed(&key, "m-1");
        changed.insert(ATTEMPT.into(), AMQPValue::LongUInt(1));
        assert!(!key.verify("m-1", &changed), "a changed value");
        let mut changed = sealed(&key, "m-1");
        changed.insert(ATTEMPT.into(), AMQPValue::LongInt(3));
        assert!(
            !key.verify("m-1", &changed),
            "the same number as another type"
        );
        let mut added = sealed(&key, "m-1");
        added.insert(
            "x-lily-original-expiration".into(),
            AMQPValue::LongString("60000".into()),
        );
        assert!(!key.verify("m-1", &added), "a header added");
        let mut producer = sealed(&key, "m-1");
        producer.insert("producer".into(), AMQPValue::LongString("changed".into()));
        assert!(
            key.verify("m-1", &producer),
            "the producer's own headers are not sealed"
        );
        let mut garbled = sealed(&key, "m-1");
        garbled.insert(SEAL.into(), AMQPValue::LongString("zz".into()));
        assert!(!key.verify("m-1", &garbled), "a malformed seal");
    }

    #[test]
    fn the_key_is_never_printed() {
        let key = HeaderKey::new("a secret of sixteen bytes or more");
        assert!(!format!("{key:?}").contains("secret"));
    }
}
