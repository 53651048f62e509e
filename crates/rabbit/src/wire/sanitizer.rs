//! The frame-aware rewriter, sans-IO.

use super::{MAX_NESTING, Rewrites};

/// Method and content-header frames up to this size are buffered whole and rewritten. A larger
/// one passes unread: RabbitMQ's largest frame is far smaller, and lapin refuses it anyway.
const MAX_BUFFERED_FRAME: usize = 4 << 20;

const FRAME_METHOD: u8 = 1;
const FRAME_HEADER: u8 = 2;
const FRAME_HEADER_LEN: usize = 7;

/// Where the sanitizer is in the stream.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum State {
    /// Nothing read yet: a protocol header (`AMQP…`, the broker refusing the version) or the
    /// first frame.
    Start,
    /// At the start of a frame.
    Frame,
    /// Inside a frame passed unread: this many bytes of it (its end octet included) are left.
    Passing(usize),
    /// Not AMQP frames: everything passes unread.
    Opaque,
}

/// The frame-aware rewriter of one incoming stream. Sans-IO: [`Sanitizer::scan`] is given the
/// bytes not yet released, starting where the last scan stopped.
#[derive(Debug)]
pub struct Sanitizer {
    state: State,
    /// The delivery each channel's next content header belongs to: the tag of its last
    /// `basic.deliver` or `basic.get-ok`, `None` after a `basic.return`. A connection has a
    /// few channels: a list is cheaper than a hash map.
    content: Vec<(u16, Option<u64>)>,
    rewrites: Rewrites,
}

impl Sanitizer {
    /// A sanitizer at the start of a stream, recording into `rewrites`.
    pub fn new(rewrites: Rewrites) -> Self {
        Self {
            state: State::Start,
            content: Vec::new(),
            rewrites,
        }
    }

    /// Rewrites what it can of `bytes` in place and returns how many of them, from the start,
    /// are ready to be read by lapin. The rest (part of a frame still arriving) must be given
    /// again, with more after it, to the next call.
    pub fn scan(&mut self, bytes: &mut [u8]) -> usize {
        let mut done = 0;
        loop {
            let rest = &mut bytes[done..];
            match self.state {
                State::Opaque => return bytes.len(),
                State::Passing(left) => {
                    let n = left.min(rest.len());
                    done += n;
                    self.state = if n == left {
                        State::Frame
                    } else {
                        State::Passing(left - n)
                    };
                    if n < left {
                        return done;
                    }
                }
                State::Start | State::Frame => {
                    if rest.is_empty() {
                        return done;
                    }
                    if self.state == State::Start && rest[0] == b'A' {
                        self.state = State::Opaque;
                        continue;
                    }
                    if rest.len() < FRAME_HEADER_LEN {
                        self.state = State::Frame;
                        return done;
                    }
                    let kind = rest[0];
                    let channel = u16::from_be_bytes([rest[1], rest[2]]);
                    let size = u32::from_be_bytes([rest[3], rest[4], rest[5], rest[6]]) as usize;
                    let whole = FRAME_HEADER_LEN + size + 1;
                    let readable =
                        matches!(kind, FRAME_METHOD | FRAME_HEADER) && size <= MAX_BUFFERED_FRAME;
                    if !readable {
                        done += FRAME_HEADER_LEN;
                        self.state = State::Passing(size + 1);
                        continue;
                    }
                    if rest.len() < whole {
                        self.state = State::Frame;
                        return done;
                    }
                    let payload = &mut rest[FRAME_HEADER_LEN..FRAME_HEADER_LEN + size];
                    if kind == FRAME_METHOD {
                        if !self.owner(channel, payload) {
                            self.method(channel, payload);
                        }
                    } else if !plain_header(payload) {
                        self.header(channel, payload);
                    }
                    done += whole;
                    self.state = State::Frame;
                }
            }
        }
    }

    fn set_content(&mut self, channel: u16, owner: Option<u64>) {
        match self.content.iter_mut().find(|(c, _)| *c == channel) {
            Some(entry) => entry.1 = owner,
            None => self.content.push((channel, owner)),
        }
    }

    /// The fast path for a method frame: true when it needs no rewrite (a method without text,
    /// or a `basic.deliver` or `basic.get-ok` whose text is ASCII, whose delivery it notes as
    /// the owner of the content that follows); false when [`Sanitizer::method`] must read it.
    fn owner(&mut self, channel: u16, payload: &[u8]) -> bool {
        let (tag_at, text) = match payload.get(..4) {
            // basic.deliver: consumer tag, delivery tag, redelivered, exchange, routing key.
            Some([0, 60, 0, 60]) => {
                let tag_at = 5 + usize::from(payload.get(4).copied().unwrap_or(0));
                let ascii = payload.get(5..tag_at).is_some_and(<[u8]>::is_ascii);
                (
                    tag_at,
                    ascii && payload.get(tag_at + 9..).is_some_and(<[u8]>::is_ascii),
                )
            }
            // basic.get-ok: delivery tag, redelivered, exchange, routing key, message count.
            Some([0, 60, 0, 71]) => (4, payload.get(13..).is_some_and(<[u8]>::is_ascii)),
            Some(
                [0, 10, 0, 10 | 20 | 41 | 50 | 60]
                | [0, 20, 0, 11 | 40]
                | [0, 50, 0, 11]
                | [0, 60, 0, 21 | 30 | 31 | 50 | 72],
            ) => return false,
            _ => return true,
        };
        let Some(tag) = payload.get(tag_at..tag_at + 8) else {
            return false;
        };
        if !text {
            return false;
        }
        let tag = u64::from_be_bytes(tag.try_into().unwrap_or_default());
        self.set_content(channel, Some(tag));
        true
    }

    fn method(&mut self, channel: u16, payload: &mut [u8]) {
        let mut c = Cursor::new(payload);
        let (Some(class), Some(method)) = (c.u16(), c.u16()) else {
            return;
        };
        let fields: &[Field] = match (class, method) {
            // connection.start, .secure, .open-ok, .close, .blocked
            (10, 10) => &[U8, U8, Table(None), Long, Long],
            (10, 20) => &[Long],
            (10, 41) | (10, 60) | (50, 11) | (60, 21) | (60, 30) | (60, 31) | (60, 72) => {
                &[Short(None)]
            }
            (10, 50) | (20, 40) => &[U16, Short(None)],
            (20, 11) => {
                // channel.open-ok: the channel's delivery tags start over.
                self.content.retain(|(c, _)| *c != channel);
                self.rewrites.forget_channel(channel);
                &[Long]
            }
            (60, 50) => {
                self.set_content(channel, None);
                &[U16, Short(None), Short(None), Short(None)]
            }
            (60, 60) => &[
                Short(None),
                Tag,
                U8,
                Short(Some("exchange")),
                Short(Some("routing_key")),
            ],
            (60, 71) => &[Tag, U8, Short(Some("exchange")), Short(Some("routing_key"))],
            _ => return,
        };
        let mut tag = None;
        let mut rewritten = None;
        for field in fields {
            let step = match *field {
                U8 => c.skip(1),
                U16 => c.skip(2),
                Tag => c.u64().map(|t| tag = Some(t)),
                Long => c.long(),
                Short(name) => c.short().map(|fixed| {
                    if fixed && rewritten.is_none() {
                        rewritten = name;
                    }
                }),
                Table(name) => c.table(name, &mut rewritten),
            };
            if step.is_none() {
                break;
            }
        }
        if let Some(tag) = tag {
            self.set_content(channel, Some(tag));
            if let Some(field) = rewritten {
                self.rewrites.record(channel, tag, field);
            }
        }
    }

    fn header(&mut self, channel: u16, payload: &mut [u8]) {
        let mut c = Cursor::new(payload);
        // class, weight, body size, then one 16-bit word of property flags.
        if c.skip(12).is_none() {
            return;
        }
        let Some(flags) = c.u16() else {
            return;
        };
        let mut rewritten = None;
        for (bit, property) in PROPERTIES.iter().enumerate() {
            if flags & (0x8000 >> bit) == 0 {
                continue;
            }
            let step = match *property {
                Property::Short(name) => c.short().map(|fixed| {
                    if fixed && rewritten.is_none() {
                        rewritten = Some(name);
                    }
                }),
                Property::Headers => c.table(Some(HEADER_KEY), &mut rewritten),
                Property::Fixed(n) => c.skip(n),
            };
            if step.is_none() {
                break;
            }
        }
        let owner = self.content.iter().find(|(c, _)| *c == channel);
        if let (Some(field), Some((_, Some(tag)))) = (rewritten, owner) {
            self.rewrites.record(channel, *tag, field);
        }
    }
}

/// Whether a content header's payload needs no rewrite: everything after its class, weight,
/// body size and property flags is ASCII (so no text is invalid), and it is too short to nest
/// past the cap (each level takes at least five bytes).
fn plain_header(payload: &[u8]) -> bool {
    payload.len() < MAX_NESTING * 5 && payload.get(14..).is_some_and(<[u8]>::is_ascii)
}

/// How a rewritten header key is named: at the top of the headers or nested in them.
const HEADER_KEY: [&str; 2] = ["a header key", "a nested header key"];

/// A method argument, for the walk over a method frame.
#[derive(Clone, Copy)]
enum Field {
    U8,
    U16,
    /// The delivery tag.
    Tag,
    Long,
    /// A short string, and its name when a rewrite of it is reported.
    Short(Option<&'static str>),
    /// A field table, and how its keys are named when a rewrite is reported.
    Table(Option<[&'static str; 2]>),
}
use Field::{Long, Short, Table, Tag, U8, U16};

/// A content-header property, in flag order from the highest bit.
#[derive(Clone, Copy)]
enum Property {
    Short(&'static str),
    Headers,
    Fixed(usize),
}

const PROPERTIES: [Property; 14] = [
    Property::Short("content_type"),
    Property::Short("content_encoding"),
    Property::Headers,
    Property::Fixed(1), // delivery_mode
    Property::Fixed(1), // priority
    Property::Short("correlation_id"),
    Property::Short("reply_to"),
    Property::Short("expiration"),
    Property::Short("message_id"),
    Property::Fixed(8), // timestamp
    Property::Short("type"),
    Property::Short("user_id"),
    Property::Short("app_id"),
    Property::Short("cluster_id"),
];

/// A position in a frame's payload. Every step returns `None` past the payload's end: the
/// frame is malformed, lapin refuses it, and the rest of it is left as it is.
struct Cursor<'a> {
    bytes: &'a mut [u8],
    at: usize,
}

impl<'a> Cursor<'a> {
    fn new(bytes: &'a mut [u8]) -> Self {
        Self { bytes, at: 0 }
    }

    fn take(&mut self, n: usize) -> Option<usize> {
        let start = self.at;
        let end = start
            .checked_add(n)
            .filter(|end| *end <= self.bytes.len())?;
        self.at = end;
        Some(start)
    }

    fn skip(&mut self, n: usize) -> Option<()> {
        self.take(n).map(|_| ())
    }

    fn u16(&mut self) -> Option<u16> {
        let at = self.take(2)?;
        Some(u16::from_be_bytes([self.bytes[at], self.bytes[at + 1]]))
    }

    fn u32(&mut self) -> Option<usize> {
        let at = self.take(4)?;
        let word: [u8; 4] = self.bytes[at..at + 4].try_into().ok()?;
        Some(u32::from_be_bytes(word) as usize)
    }

    fn u64(&mut self) -> Option<u64> {
        let at = self.take(8)?;
        let word: [u8; 8] = self.bytes[at..at + 8].try_into().ok()?;
        Some(u64::from_be_bytes(word))
    }

    fn long(&mut self) -> Option<()> {
        let n = self.u32()?;
        self.skip(n)
    }

    /// A short string, made valid UTF-8; whether anything was rewritten.
    fn short(&mut self) -> Option<bool> {
        let n = usize::from(*self.bytes.get(self.at)?);
        self.at += 1;
        let at = self.take(n)?;
        Some(make_utf8(&mut self.bytes[at..at + n]))
    }

    /// A field table at the top of the nesting; `names` says how a rewritten key is reported.
    fn table(
        &mut self,
        names: Option<[&'static str; 2]>,
        rewritten: &mut Option<&'static str>,
    ) -> Option<()> {
        let n = self.u32()?;
        let at = self.take(n)?;
        let mut inner = Walk { names, rewritten };
        inner.table(&mut self.bytes[at..at + n], 1);
        Some(())
    }
}

/// The walk through a table's entries and nested values.
struct Walk<'r> {
    names: Option<[&'static str; 2]>,
    rewritten: &'r mut Option<&'static str>,
}

impl Walk<'_> {
    /// The entries of a table at `depth` (1 at the top), in `bytes`.
    fn table(&mut self, bytes: &mut [u8], depth: usize) {
        let mut c = Cursor::new(bytes);
        while c.at < c.bytes.len() {
            let Some(fixed) = c.short() else {
                return;
            };
            if fixed
                && self.rewritten.is_none()
                && let Some(names) = self.names
            {
                *self.rewritten = Some(names[usize::from(depth > 1)]);
            }
            if self.value(&mut c, depth).is_none() {
                return;
            }
        }
    }

    /// The values of an array at `depth`, in `bytes`.
    fn array(&mut self, bytes: &mut [u8], depth: usize) {
        let mut c = Cursor::new(bytes);
        while c.at < c.bytes.len() {
            if self.value(&mut c, depth).is_none() {
                return;
            }
        }
    }

    /// One tagged value in a table or array at `depth`. `None` on a tag lapin does not know or
    /// a value past the end: the rest of the table is left as it is.
    fn value(&mut self, c: &mut Cursor<'_>, depth: usize) -> Option<()> {
        let tag_at = c.take(1)?;
        match c.bytes[tag_at] {
            b't' | b'b' | b'B' => c.skip(1),
            b's' | b'u' | b'U' => c.skip(2),
            b'I' | b'i' | b'f' => c.skip(4),
            b'D' => c.skip(5),
            b'l' | b'L' | b'd' | b'T' => c.skip(8),
            b'V' => Some(()),
            b'S' | b'x' => c.long(),
            nested @ (b'F' | b'A') => {
                let n = c.u32()?;
                let at = c.take(n)?;
                if depth >= MAX_NESTING {
                    // Too deep to parse: the same bytes, read as a byte array.
                    c.bytes[tag_at] = b'x';
                } else if nested == b'F' {
                    self.table(&mut c.bytes[at..at + n], depth + 1);
                } else {
                    self.array(&mut c.bytes[at..at + n], depth + 1);
                }
                Some(())
            }
            _ => None,
        }
    }
}

/// Makes `bytes` valid UTF-8 in place, each byte of an invalid sequence becoming `?`; whether
/// anything changed.
fn make_utf8(bytes: &mut [u8]) -> bool {
    if bytes.is_ascii() {
        return false;
    }
    let mut changed = false;
    let mut at = 0;
    while let Err(err) = std::str::from_utf8(&bytes[at..]) {
        let bad = at + err.valid_up_to();
        let len = err.error_len().unwrap_or(bytes.len() - bad);
        bytes[bad..bad + len].fill(b'?');
        changed = true;
        at = bad + len;
    }
    changed
}

#[cfg(test)]
pub(in crate::wire) mod tests {
    use amq_protocol::frame::{AMQPContentHeader, AMQPFrame, WriteContext, gen_frame, parse_frame};
    use amq_protocol::protocol::{AMQPClass, basic, channel};
    use lapin::types::{AMQPValue, FieldArray, FieldTable};

    use std::sync::atomic::Ordering;

    use super::*;

    pub(in crate::wire) fn encode(frames: &[AMQPFrame]) -> Vec<u8> {
        let mut wire = Vec::new();
        for frame in frames {
            wire = gen_frame(frame)(WriteContext::from(wire))
                .expect("encodes")
                .write;
        }
        wire
    }

    fn deliver(channel: u16, tag: u64, routing_key: &str) -> AMQPFrame {
        AMQPFrame::Method(
            channel,
            AMQPClass::Basic(basic::AMQPMethod::Deliver(basic::Deliver {
                consumer_tag: "ctag".into(),
                delivery_tag: tag,
                redelivered: false,
                exchange: "".into(),
                routing_key: routing_key.into(),
            })),
        )
    }

    fn header(channel: u16, properties: basic::AMQPProperties, body: &[u8]) -> [AMQPFrame; 2] {
        [
            AMQPFrame::Header(
                channel,
                AMQPContentHeader {
                    class_id: 60,
                    body_size: body.len() as u64,
                    properties,
                },
            ),
            AMQPFrame::Body(channel, body.to_vec()),
        ]
    }

    pub(in crate::wire) fn message(
        channel: u16,
        tag: u64,
        properties: basic::AMQPProperties,
    ) -> Vec<AMQPFrame> {
        let mut frames = vec![deliver(channel, tag, "orders")];
        frames.extend(header(channel, properties, br#"{"order":1}"#));
        frames
    }

    /// Replaces the six bytes of `marker` with bytes that are not UTF-8.
    pub(in crate::wire) fn poison(wire: &mut [u8], marker: &str) {
        let at = wire
            .windows(marker.len())
            .position(|w| w == marker.as_bytes())
            .expect("marker present");
        wire[at..at + 2].copy_from_slice(&[0xff, 0xfe]);
        wire[at + 4..at + 6].copy_from_slice(&[0xc3, 0x28]);
    }

    /// Runs `wire` through a sanitizer in pieces of `piece` bytes (all at once when 0) and
    /// returns what lapin would read.
    pub(in crate::wire) fn sanitize(wire: &[u8], piece: usize, rewrites: &Rewrites) -> Vec<u8> {
        let mut sanitizer = Sanitizer::new(rewrites.clone());
        let mut pending: Vec<u8> = Vec::new();
        let mut out = Vec::new();
        let piece = if piece == 0 { wire.len().max(1) } else { piece };
        for chunk in wire.chunks(piece) {
            pending.extend_from_slice(chunk);
            let ready = sanitizer.scan(&mut pending);
            out.extend(pending.drain(..ready));
        }
        out.extend(pending);
        out
    }

    /// Every frame lapin would parse from `wire`.
    fn parse_all(mut wire: &[u8]) -> Vec<AMQPFrame> {
        let mut frames = Vec::new();
        while !wire.is_empty() {
            let (rest, frame) = parse_frame(wire).expect("parses");
            frames.push(frame);
            wire = rest;
        }
        frames
    }

    pub(in crate::wire) fn valid_traffic() -> Vec<AMQPFrame> {
        let mut headers = FieldTable::default();
        headers.insert("x-café".into(), AMQPValue::LongString("naïve".into()));
        let mut inner = FieldTable::default();
        inner.insert("ключ".into(), AMQPValue::Boolean(true));
        headers.insert(
            "nested".into(),
            AMQPValue::FieldArray(FieldArray::from(vec![AMQPValue::FieldTable(inner)])),
        );
        let properties = basic::AMQPProperties::default()
            .with_message_id("m-1".into())
            .with_type("order.placed".into())
            .with_app_id("ünïcode".into())
            .with_headers(headers);
        let mut frames = vec![
            AMQPFrame::Method(
                3,
                AMQPClass::Channel(channel::AMQPMethod::OpenOk(channel::OpenOk {})),
            ),
            AMQPFrame::Heartbeat,
        ];
        frames.extend(message(3, 1, properties.clone()));
        frames.extend(message(4, 9, basic::AMQPProperties::default()));
        frames.push(AMQPFrame::Method(
            3,
            AMQPClass::Channel(channel::AMQPMethod::Close(channel::Close {
                reply_code: 406,
                reply_text: "PRECONDITION_FAILED - é".into(),
                class_id: 60,
                method_id: 40,
            })),
        ));
        frames
    }

    #[test]
    fn valid_traffic_passes_byte_for_byte_however_it_is_split() {
        let wire = encode(&valid_traffic());
        for piece in [0, 1, 2, 3, 7, 8, 13, 64] {
            let rewrites = Rewrites::default();
            assert_eq!(sanitize(&wire, piece, &rewrites), wire, "pieces of {piece}");
            assert!(!rewrites.0.any.load(Ordering::Acquire));
        }
    }

    #[test]
    fn text_that_is_not_utf8_is_rewritten_and_reported_by_delivery() {
        let cases: [(&str, basic::AMQPProperties, &str); 4] = [
            (
                "#BAD1#",
                basic::AMQPProperties::default().with_message_id("#BAD1#".into()),
                "message_id",
            ),
            (
                "#BAD2#",
                basic::AMQPProperties::default()
                    .with_message_id("m".into())
                    .with_type("#BAD2#".into())
                    .with_app_id("#BAD9#".into()),
                "type",
            ),
            (
                "#BAD3#",
                basic::AMQPProperties::default().with_headers({
                    let mut t = FieldTable::default();
                    t.insert("#BAD3#".into(), AMQPValue::Boolean(true));
                    t
                }),
                "a header key",
            ),
            (
                "#BAD4#",
                basic::AMQPProperties::default().with_headers({
                    let mut inner = FieldTable::default();
                    inner.insert("#BAD4#".into(), AMQPValue::Boolean(true));
                    let mut t = FieldTable::default();
                    t.insert("outer".into(), AMQPValue::FieldTable(inner));
                    t
                }),
                "a nested header key",
            ),
        ];
        for (marker, properties, field) in cases {
            let mut frames = message(5, 41, basic::AMQPProperties::default());
            frames.extend(message(5, 42, properties));
            let mut wire = encode(&frames);
            poison(&mut wire, marker);
            if marker == "#BAD2#" {
                poison(&mut wire, "#BAD9#");
            }
            let unparsed = std::panic::catch_unwind(|| parse_all(&wire));
            assert!(
                unparsed.is_err(),
                "{field}: lapin's parser takes the raw bytes"
            );
            for piece in [0, 1, 5] {
                let rewrites = Rewrites::default();
                let out = sanitize(&wire, piece, &rewrites);
                assert_eq!(out.len(), wire.len());
                let parsed = parse_all(&out);
                assert_eq!(parsed.len(), 6, "{field}: every frame parses");
                assert_eq!(rewrites.take(5, 41), None);
                assert_eq!(rewrites.take(5, 42), Some(field), "pieces of {piece}");
                assert_eq!(rewrites.take(5, 42), None, "taken once");
                let text = String::from_utf8_lossy(&out);
                assert!(text.contains("??AD"), "{field}: {text:?}");
            }
        }
    }

    #[test]
    fn a_routing_key_that_is_not_utf8_is_reported_on_its_channel() {
        let mut frames = vec![deliver(2, 7, "#BAD1#")];
        frames.extend(header(2, basic::AMQPProperties::default(), b""));
        let mut wire = encode(&frames);
        poison(&mut wire, "#BAD1#");
        let rewrites = Rewrites::default();
        let out = sanitize(&wire, 0, &rewrites);
        assert_eq!(parse_all(&out).len(), 3);
        assert_eq!(rewrites.take(1, 7), None);
        assert_eq!(rewrites.take(2, 7), Some("routing_key"));
    }

    #[test]
    fn a_get_ok_owns_the_content_after_it_and_a_return_owns_none() {
        let bad = basic::AMQPProperties::default().with_message_id("#BAD1#".into());
        let mut frames = vec![AMQPFrame::Method(
            6,
            AMQPClass::Basic(basic::AMQPMethod::GetOk(basic::GetOk {
                delivery_tag: 77,
                redelivered: false,
                exchange: "".into(),
                routing_key: "lane".into(),
                message_count: 3,
            })),
        )];
        frames.extend(header(6, bad.clone(), b"{}"));
        frames.push(AMQPFrame::Method(
            6,
            AMQPClass::Basic(basic::AMQPMethod::Return(basic::Return {
                reply_code: 312,
                reply_text: "NO_ROUTE".into(),
                exchange: "".into(),
                routing_key: "gone".into(),
            })),
        ));
        frames.extend(header(6, bad, b"{}"));
        let mut wire = encode(&frames);
        poison(&mut wire, "#BAD1#");
        poison(&mut wire, "#BAD1#");
        let rewrites = Rewrites::default();
        let out = sanitize(&wire, 3, &rewrites);
        assert_eq!(parse_all(&out).len(), 6);
        assert_eq!(rewrites.take(6, 77), Some("message_id"));
        assert!(
            !rewrites.0.any.load(Ordering::Acquire),
            "the return's content is no delivery"
        );
    }

    #[test]
    fn a_channel_opened_again_forgets_its_deliveries() {
        let mut frames = message(
            2,
            1,
            basic::AMQPProperties::default().with_message_id("#BAD1#".into()),
        );
        frames.push(AMQPFrame::Method(
            2,
            AMQPClass::Channel(channel::AMQPMethod::OpenOk(channel::OpenOk {})),
        ));
        let mut wire = encode(&frames);
        poison(&mut wire, "#BAD1#");
        let rewrites = Rewrites::default();
        sanitize(&wire, 0, &rewrites);
        assert_eq!(rewrites.take(2, 1), None);
    }

    #[test]
    fn tables_nested_past_the_cap_are_cut_and_the_frame_parses() {
        let mut deep = AMQPValue::Boolean(true);
        for n in 0..300 {
            deep = if n % 2 == 0 {
                let mut t = FieldTable::default();
                t.insert("n".into(), deep);
                AMQPValue::FieldTable(t)
            } else {
                AMQPValue::FieldArray(FieldArray::from(vec![deep]))
            };
        }
        let mut headers = FieldTable::default();
        headers.insert("deep".into(), deep);
        let properties = basic::AMQPProperties::default()
            .with_message_id("m".into())
            .with_headers(headers);
        let wire = encode(&message(1, 1, properties));
        let rewrites = Rewrites::default();
        let out = sanitize(&wire, 0, &rewrites);
        assert_eq!(out.len(), wire.len());
        let frames = parse_all(&out);
        let AMQPFrame::Header(_, header) = &frames[1] else {
            panic!("a content header");
        };
        let mut depth = 0;
        let mut value = header
            .properties
            .headers()
            .as_ref()
            .and_then(|h| h.inner().get("deep"))
            .cloned();
        while let Some(v) = value {
            depth += 1;
            value = match v {
                AMQPValue::FieldTable(t) => t.inner().get("n").cloned(),
                AMQPValue::FieldArray(a) => a.as_slice().first().cloned(),
                AMQPValue::ByteArray(_) => None,
                other => panic!("unexpected {other:?}"),
            };
        }
        assert_eq!(depth, MAX_NESTING);
    }

    #[test]
    fn arbitrary_bytes_never_panic_and_keep_their_length() {
        let mut seed = 0x9e37_79b9_7f4a_7c15_u64;
        let mut next = || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed
        };
        let valid = encode(&valid_traffic());
        for round in 0..500 {
            let mut wire = valid.clone();
            for _ in 0..(round % 8) {
                let at = (next() as usize) % wire.len();
                wire[at] = next() as u8;
            }
            let piece = (next() % 40) as usize;
            let out = sanitize(&wire, piece, &Rewrites::default());
            assert_eq!(out.len(), wire.len());
            // The sanitizer agrees with itself however the stream is split.
            assert_eq!(out, sanitize(&wire, 0, &Rewrites::default()));
        }
    }

    #[test]
    fn make_utf8_keeps_valid_text_and_length() {
        let mut text = *b"ok \xc3\xa9 \xff\xc3( \xe2\x82";
        assert!(make_utf8(&mut text));
        assert_eq!(&text, b"ok \xc3\xa9 ??( ??");
        let mut fine = "naïve".as_bytes().to_vec();
        assert!(!make_utf8(&mut fine));
        assert_eq!(fine, "naïve".as_bytes());
    }
}
