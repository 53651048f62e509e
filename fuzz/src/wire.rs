//! A small writer of the AMQP wire forms [`crate::delivery`] reads, for the seed generator and
//! tests: short and long strings, field tables and arrays, basic properties. It takes raw bytes
//! everywhere, so a seed can carry text that is not UTF-8 or a length at a bound.

/// A header value, in RabbitMQ's flavour of the field types.
#[derive(Clone, Debug)]
pub enum Value {
    /// `t`
    Bool(bool),
    /// `I`
    I32(i32),
    /// `i`
    U32(u32),
    /// `l`
    I64(i64),
    /// `d`
    F64(f64),
    /// `T`
    Timestamp(u64),
    /// `S`: a long string, any bytes.
    Text(Vec<u8>),
    /// `x`
    Bytes(Vec<u8>),
    /// `V`
    Void,
    /// `A`
    Array(Vec<Value>),
    /// `F`
    Table(Table),
}

impl Value {
    /// A long-string value.
    pub fn text(text: impl AsRef<[u8]>) -> Self {
        Self::Text(text.as_ref().to_vec())
    }

    fn write(&self, out: &mut Vec<u8>) {
        match self {
            Self::Bool(b) => {
                out.push(b't');
                out.push(u8::from(*b));
            }
            Self::I32(n) => {
                out.push(b'I');
                out.extend(n.to_be_bytes());
            }
            Self::U32(n) => {
                out.push(b'i');
                out.extend(n.to_be_bytes());
            }
            Self::I64(n) => {
                out.push(b'l');
                out.extend(n.to_be_bytes());
            }
            Self::F64(x) => {
                out.push(b'd');
                out.extend(x.to_bits().to_be_bytes());
            }
            Self::Timestamp(t) => {
                out.push(b'T');
                out.extend(t.to_be_bytes());
            }
            Self::Text(bytes) => {
                out.push(b'S');
                long(out, bytes);
            }
            Self::Bytes(bytes) => {
                out.push(b'x');
                long(out, bytes);
            }
            Self::Void => out.push(b'V'),
            Self::Array(items) => {
                out.push(b'A');
                let mut inner = Vec::new();
                for item in items {
                    item.write(&mut inner);
                }
                long(out, &inner);
            }
            Self::Table(table) => {
                out.push(b'F');
                table.write(out);
            }
        }
    }
}

/// A field table: keys (any bytes, at most 255) and values, in order.
#[derive(Clone, Debug, Default)]
pub struct Table(pub Vec<(Vec<u8>, Value)>);

impl Table {
    /// Adds an entry.
    #[must_use]
    pub fn with(mut self, key: impl AsRef<[u8]>, value: Value) -> Self {
        self.0.push((key.as_ref().to_vec(), value));
        self
    }

    fn write(&self, out: &mut Vec<u8>) {
        let mut inner = Vec::new();
        for (key, value) in &self.0 {
            short(&mut inner, key);
            value.write(&mut inner);
        }
        long(out, &inner);
    }
}

/// Basic properties; text fields are raw bytes.
#[derive(Clone, Debug, Default)]
pub struct Properties {
    /// `content_type`
    pub content_type: Option<Vec<u8>>,
    /// `content_encoding`
    pub content_encoding: Option<Vec<u8>>,
    /// `headers`
    pub headers: Option<Table>,
    /// `delivery_mode`
    pub delivery_mode: Option<u8>,
    /// `priority`
    pub priority: Option<u8>,
    /// `correlation_id`
    pub correlation_id: Option<Vec<u8>>,
    /// `reply_to`
    pub reply_to: Option<Vec<u8>>,
    /// `expiration`
    pub expiration: Option<Vec<u8>>,
    /// `message_id`
    pub message_id: Option<Vec<u8>>,
    /// `timestamp`
    pub timestamp: Option<u64>,
    /// `type`
    pub kind: Option<Vec<u8>>,
    /// `user_id`
    pub user_id: Option<Vec<u8>>,
    /// `app_id`
    pub app_id: Option<Vec<u8>>,
    /// `cluster_id`
    pub cluster_id: Option<Vec<u8>>,
}

impl Properties {
    /// Properties with a message id and a type, as a Lily publisher sends them (JSON).
    pub fn message(id: &str, kind: &str) -> Self {
        Self {
            message_id: Some(id.into()),
            kind: Some(kind.into()),
            content_type: Some(b"application/json".to_vec()),
            delivery_mode: Some(2),
            ..Self::default()
        }
    }

    /// Adds a header.
    #[must_use]
    pub fn header(mut self, key: impl AsRef<[u8]>, value: Value) -> Self {
        let table = self.headers.take().unwrap_or_default();
        self.headers = Some(table.with(key, value));
        self
    }

    /// The wire form: 16 bits of property flags, then each present field in order.
    pub fn write(&self, out: &mut Vec<u8>) {
        let texts = [
            &self.content_type,
            &self.content_encoding,
            &self.correlation_id,
            &self.reply_to,
            &self.expiration,
            &self.message_id,
            &self.kind,
            &self.user_id,
            &self.app_id,
            &self.cluster_id,
        ];
        // Flag bits from the top, in field order.
        let present = [
            texts[0].is_some(),
            texts[1].is_some(),
            self.headers.is_some(),
            self.delivery_mode.is_some(),
            self.priority.is_some(),
            texts[2].is_some(),
            texts[3].is_some(),
            texts[4].is_some(),
            texts[5].is_some(),
            self.timestamp.is_some(),
            texts[6].is_some(),
            texts[7].is_some(),
            texts[8].is_some(),
            texts[9].is_some(),
        ];
        let flags = present
            .iter()
            .enumerate()
            .fold(0u16, |f, (i, on)| if *on { f | (1 << (15 - i)) } else { f });
        out.extend(flags.to_be_bytes());
        let text = |out: &mut Vec<u8>, t: &Option<Vec<u8>>| {
            if let Some(t) = t {
                short(out, t);
            }
        };
        text(out, texts[0]);
        text(out, texts[1]);
        if let Some(headers) = &self.headers {
            headers.write(out);
        }
        out.extend(self.delivery_mode);
        out.extend(self.priority);
        text(out, texts[2]);
        text(out, texts[3]);
        text(out, texts[4]);
        text(out, texts[5]);
        if let Some(t) = self.timestamp {
            out.extend(t.to_be_bytes());
        }
        for t in &texts[6..] {
            text(out, t);
        }
    }
}

/// The input [`crate::delivery::Delivery::decode`] reads: limit bytes, exchange, routing key,
/// properties, body.
pub fn delivery(
    limits: [u8; crate::delivery::LIMIT_BYTES],
    exchange: &[u8],
    routing_key: &[u8],
    properties: &Properties,
    body: &[u8],
) -> Vec<u8> {
    let mut out = limits.to_vec();
    short(&mut out, exchange);
    short(&mut out, routing_key);
    properties.write(&mut out);
    out.extend_from_slice(body);
    out
}

/// A short string: one length byte, then at most 255 bytes.
fn short(out: &mut Vec<u8>, bytes: &[u8]) {
    let len = u8::try_from(bytes.len()).expect("a short string is at most 255 bytes");
    out.push(len);
    out.extend_from_slice(bytes);
}

/// A long string, table or array body: a 32-bit length, then the bytes.
fn long(out: &mut Vec<u8>, bytes: &[u8]) {
    let len = u32::try_from(bytes.len()).expect("at most 4 GiB");
    out.extend(len.to_be_bytes());
    out.extend_from_slice(bytes);
}
