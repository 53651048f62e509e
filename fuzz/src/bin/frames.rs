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
//!   only bytes rewritten are tables or arrays nested past the cap, turned into byte arrays;
//! - the stream lapin reads (`Sanitizing`, which rewrites in the reader's own buffer and keeps
//!   back a frame still arriving) gives the same bytes, the broker's reads and the reader's room
//!   both of sizes the first byte chooses.

use std::pin::Pin;
use std::task::{Context, Poll, Waker};

use amq_protocol::frame::parse_frame;
use futures_io::AsyncRead;
use lily_mq_rabbit::testing::{Rewrites, Sanitizer, Sanitizing};

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

/// A broker whose bytes arrive in reads of `sizes`, in turn.
struct Broker {
    rest: Vec<u8>,
    sizes: [usize; 2],
    reads: usize,
}

impl AsyncRead for Broker {
    fn poll_read(
        mut self: Pin<&mut Self>,
        _: &mut Context<'_>,
        out: &mut [u8],
    ) -> Poll<std::io::Result<usize>> {
        let size = self.sizes[self.reads % 2];
        let n = size.min(out.len()).min(self.rest.len());
        out[..n].copy_from_slice(&self.rest[..n]);
        self.rest.drain(..n);
        self.reads += 1;
        Poll::Ready(Ok(n))
    }
}

/// What lapin reads through a `Sanitizing` stream from `stream`, which arrives in reads of
/// sizes from `pattern`, when its room for each read is of other sizes from `pattern`.
fn read_through(stream: &[u8], pattern: u8) -> Vec<u8> {
    let broker = Broker {
        rest: stream.to_vec(),
        sizes: [usize::from(pattern & 0x0f) * 5 + 1, 4096],
        reads: 0,
    };
    let rooms = [usize::from(pattern >> 4) * 3 + 1, 64 * 1024];
    let mut sanitizing = Sanitizing::new(broker, Rewrites::default());
    let mut cx = Context::from_waker(Waker::noop());
    let (mut out, mut room) = (Vec::new(), vec![0; rooms[1]]);
    for turn in 0.. {
        let room = &mut room[..rooms[turn % 2]];
        match Pin::new(&mut sanitizing).poll_read(&mut cx, room) {
            Poll::Ready(Ok(0)) => break,
            Poll::Ready(Ok(n)) => out.extend_from_slice(&room[..n]),
            other => panic!("a read from a broker that always has bytes: {other:?}"),
        }
    }
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
    assert!(
        read_through(stream, pattern) == out,
        "what lapin reads is not the rewritten stream"
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
