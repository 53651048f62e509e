//! Fuzz target `frames`: Lily's rewriter of what the broker sends
//! (`lily_mq_rabbit::testing::Sanitizer`), over arbitrary byte streams split at arbitrary
//! points.
//!
//! Input: one byte that chooses how the stream is split into reads, then the stream. Checked:
//!
//! - nothing panics, and the rewriter releases every byte it is given once the stream ends;
//! - nothing changes length, and the output is the same however the stream was split;
//! - frames stay in sync: every frame header (type, channel, size) of the input is where it was
//!   and unchanged in the output;
//! - rewriting is idempotent: the output, rewritten again, is unchanged;
//! - valid input passes unchanged: when amq-protocol's own parser reads the whole input, the
//!   only bytes rewritten are tables or arrays nested past the cap, turned into byte arrays.

use amq_protocol::frame::parse_frame;
use lily_mq_rabbit::testing::{Rewrites, Sanitizer};

fn main() {
    lily_mq_fuzz::run(check);
}

/// Runs `stream` through a rewriter in reads whose sizes cycle through `pattern`'s.
fn rewrite(stream: &[u8], pattern: u8) -> Vec<u8> {
    let sizes = [
        usize::from(pattern & 0x0f) + 1,
        usize::from(pattern >> 4) * 7 + 1,
        4096,
    ];
    let mut sanitizer = Sanitizer::new(Rewrites::default());
    let (mut pending, mut out) = (Vec::new(), Vec::new());
    let mut at = 0;
    for size in sizes.iter().cycle() {
        if at == stream.len() {
            break;
        }
        let end = (at + size).min(stream.len());
        pending.extend_from_slice(&stream[at..end]);
        at = end;
        let ready = sanitizer.scan(&mut pending);
        assert!(ready <= pending.len());
        out.extend(pending.drain(..ready));
    }
    // The stream ended: what is left is a frame cut short, passed as it is.
    out.extend(pending);
    out
}

/// The offsets of the frame headers in `stream`, as a reader of frames sees them.
fn frame_headers(stream: &[u8]) -> Vec<usize> {
    let mut at = 0;
    let mut headers = Vec::new();
    if stream.first() == Some(&b'A') {
        return headers;
    }
    while at + 7 <= stream.len() {
        headers.push(at);
        let size = u32::from_be_bytes([
            stream[at + 3],
            stream[at + 4],
            stream[at + 5],
            stream[at + 6],
        ]);
        at += 7 + size as usize + 1;
    }
    headers
}

fn check(data: &[u8]) {
    let Some((&pattern, stream)) = data.split_first() else {
        return;
    };
    let out = rewrite(stream, pattern);
    assert_eq!(out.len(), stream.len(), "a rewrite changed the length");
    assert_eq!(
        out,
        rewrite(stream, 0xff),
        "the output depends on how the stream was split"
    );
    for at in frame_headers(stream) {
        assert_eq!(
            out[at..at + 7],
            stream[at..at + 7],
            "a frame header moved or changed"
        );
    }
    assert_eq!(
        rewrite(&out, pattern),
        out,
        "a second rewrite changed the output"
    );

    let mut rest = stream;
    while !rest.is_empty() {
        match parse_frame(rest) {
            Ok((next, _)) => rest = next,
            Err(_) => return,
        }
    }
    for (i, (before, after)) in stream.iter().zip(&out).enumerate() {
        assert!(
            before == after || (matches!(before, b'F' | b'A') && *after == b'x'),
            "valid input rewritten at byte {i}"
        );
    }
}
