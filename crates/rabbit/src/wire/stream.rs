//! The connection's stream with a [`Sanitizer`] on what it reads and a deadline on the broker's
//! silence, and the reactor that lets lapin run on it.

use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use async_rs::traits::Reactor;
use async_rs::util::RuntimeParts;
use async_rs::{Runtime, Tokio};
use futures_io::{AsyncRead, AsyncWrite, IoSlice, IoSliceMut};
use lapin::tcp::AsyncTcpStream;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::{Rewrites, Sanitizer};
use crate::sync::lock;

/// Bytes read from the stream at a time, at least.
const READ_CHUNK: usize = 64 * 1024;

/// How long a connection's broker may stay silent before its stream fails: twice the negotiated
/// heartbeat, as AMQP says, timed once the connection is open. Until then, silence is not timed.
///
/// lapin checks for a missed heartbeat only when it wakes to send one, every half interval,
/// so on its own it notices up to half an interval late; this deadline is exact. A task on the
/// runtime keeps it, because lapin reads from a thread of its own: the reader only notes when
/// it read and leaves its waker.
#[derive(Clone, Debug, Default)]
pub(crate) struct Silence(Arc<Watch>);

#[derive(Debug)]
struct Watch {
    /// The origin of `last_read`.
    origin: Instant,
    /// Milliseconds from `origin` to the last byte read.
    last_read: AtomicU64,
    /// The silence allowed, in milliseconds, once armed.
    limit: AtomicU64,
    /// Set once the broker was silent for longer.
    expired: AtomicBool,
    /// The reader waiting for bytes, woken when the silence expires.
    reader: Mutex<Option<Waker>>,
    /// Ends the watch when the stream goes.
    gone: CancellationToken,
}

impl Default for Watch {
    fn default() -> Self {
        Self {
            origin: Instant::now(),
            last_read: AtomicU64::new(0),
            limit: AtomicU64::new(0),
            expired: AtomicBool::new(false),
            reader: Mutex::new(None),
            gone: CancellationToken::new(),
        }
    }
}

impl Silence {
    /// Times silence from now on, on the current runtime: the stream fails after two
    /// `heartbeat` intervals (in seconds, as negotiated) without a byte from the broker; `0`
    /// (heartbeats off) leaves it untimed.
    pub(crate) fn arm(&self, heartbeat: u16) {
        if heartbeat == 0 {
            return;
        }
        let limit = Duration::from_secs(u64::from(heartbeat) * 2);
        let watch = Arc::clone(&self.0);
        watch.limit.store(millis(limit), Ordering::Relaxed);
        watch.read();
        tokio::spawn(watch.keep());
    }
}

impl Watch {
    /// Notes that a byte was read now.
    fn read(&self) {
        let since = millis(self.origin.elapsed());
        self.last_read.store(since, Ordering::Relaxed);
    }

    fn limit(&self) -> Duration {
        Duration::from_millis(self.limit.load(Ordering::Relaxed))
    }

    fn last_read(&self) -> Instant {
        self.origin + Duration::from_millis(self.last_read.load(Ordering::Relaxed))
    }

    /// Leaves the reader's waker, then says whether the silence expired (the watch sets the
    /// flag, then wakes: one of the two sees the other).
    fn expired(&self, reader: &Waker) -> bool {
        {
            let mut waiting = lock(&self.reader);
            if !waiting.as_ref().is_some_and(|w| w.will_wake(reader)) {
                *waiting = Some(reader.clone());
            }
        }
        self.expired.load(Ordering::Acquire)
    }

    /// Sleeps until the last read's deadline, again while bytes keep coming; when one passes
    /// without a read, marks the silence expired and wakes the reader.
    async fn keep(self: Arc<Self>) {
        let limit = self.limit();
        loop {
            let deadline = self.last_read() + limit;
            tokio::select! {
                () = self.gone.cancelled() => return,
                () = tokio::time::sleep_until(deadline) => {}
            }
            if self.last_read() + limit <= Instant::now() {
                self.expired.store(true, Ordering::Release);
                if let Some(reader) = lock(&self.reader).take() {
                    reader.wake();
                }
                return;
            }
        }
    }
}

fn millis(duration: Duration) -> u64 {
    u64::try_from(duration.as_millis()).unwrap_or(u64::MAX)
}

/// A connection's stream with a [`Sanitizer`] on what it reads and a deadline on the broker's
/// silence (twice the negotiated heartbeat, once the connection is open); writes pass through.
///
/// Reads go straight into the reader's buffer and are rewritten there: only the start of a
/// frame still arriving at the end of a read is kept back here, and given first, ahead of the
/// next read. A frame kept back that grows past 1 KiB, or past the room the
/// reader offers, is gathered here whole instead.
#[derive(Debug)]
pub struct Sanitizing<S> {
    inner: S,
    sanitizer: Sanitizer,
    silence: Silence,
    /// Read from `inner` and not yet read by lapin: `buf[start..ready]` is scanned and ready for
    /// it, `buf[ready..end]` is part of a frame still arriving.
    buf: Vec<u8>,
    start: usize,
    ready: usize,
    end: usize,
    eof: bool,
}

/// A frame still arriving is passed on through the reader's buffer while this many of its bytes
/// are kept back at most; a longer one is gathered here, so that a frame arriving in many small
/// reads is not copied again on each.
const KEPT_IN_PASSING: usize = 1024;

impl<S> Sanitizing<S> {
    /// `inner` with a sanitizer on what is read from it, recording into `rewrites`.
    pub fn new(inner: S, rewrites: Rewrites) -> Self {
        Self {
            inner,
            sanitizer: Sanitizer::new(rewrites),
            silence: Silence::default(),
            buf: Vec::new(),
            start: 0,
            ready: 0,
            end: 0,
            eof: false,
        }
    }

    /// This stream, its reads failing once `silence` is armed and the broker is silent for
    /// longer.
    pub(crate) fn timing(mut self, silence: Silence) -> Self {
        self.silence = silence;
        self
    }
}

impl<S> Drop for Sanitizing<S> {
    fn drop(&mut self) {
        self.silence.0.gone.cancel();
    }
}

impl<S: AsyncRead + Unpin> Sanitizing<S> {
    /// Fills `out` with bytes ready for lapin: those kept here first, else a read from `inner`
    /// rewritten in `out` itself.
    fn poll_sanitized(&mut self, cx: &mut Context<'_>, out: &mut [u8]) -> Poll<io::Result<usize>> {
        loop {
            if self.start < self.ready {
                let n = out.len().min(self.ready - self.start);
                out[..n].copy_from_slice(&self.buf[self.start..self.start + n]);
                self.start += n;
                return Poll::Ready(Ok(n));
            }
            if self.eof {
                // A frame cut short by the end passes as it is: lapin sees the same end.
                if self.ready == self.end {
                    return Poll::Ready(Ok(0));
                }
                self.ready = self.end;
                continue;
            }
            let kept = self.end - self.start;
            if kept < out.len() && kept <= KEPT_IN_PASSING {
                out[..kept].copy_from_slice(&self.buf[self.start..self.end]);
                let read = Pin::new(&mut self.inner).poll_read(cx, &mut out[kept..]);
                let Some(n) = std::task::ready!(self.poll_inner(cx, read))? else {
                    continue;
                };
                let filled = kept + n;
                let ready = self.sanitizer.scan(&mut out[..filled]);
                let arriving = filled - ready;
                if self.buf.len() < arriving {
                    self.buf.resize(arriving.max(KEPT_IN_PASSING), 0);
                }
                self.buf[..arriving].copy_from_slice(&out[ready..filled]);
                (self.start, self.ready, self.end) = (0, 0, arriving);
                if ready > 0 {
                    return Poll::Ready(Ok(ready));
                }
                continue;
            }
            // A long frame still arriving: gathered here until it is whole.
            if self.start > 0 {
                self.buf.copy_within(self.start..self.end, 0);
                (self.ready, self.end) = (self.ready - self.start, self.end - self.start);
                self.start = 0;
            }
            if self.buf.len() - self.end < READ_CHUNK / 4 {
                let len = (self.end + READ_CHUNK).max(self.buf.len() * 2);
                self.buf.resize(len, 0);
            }
            let read = Pin::new(&mut self.inner).poll_read(cx, &mut self.buf[self.end..]);
            if let Some(n) = std::task::ready!(self.poll_inner(cx, read))? {
                self.end += n;
                let ready = self.ready;
                self.ready += self.sanitizer.scan(&mut self.buf[ready..self.end]);
            }
        }
    }

    /// What a read from `inner` came to: `Some(n)` bytes; `None` at the end of the stream
    /// (noted); pending, or a `TimedOut` error once the broker was silent for too long.
    fn poll_inner(
        &mut self,
        cx: &mut Context<'_>,
        read: Poll<io::Result<usize>>,
    ) -> Poll<io::Result<Option<usize>>> {
        match read {
            Poll::Pending => self.poll_silence(cx).map_ok(|()| None),
            Poll::Ready(Err(err)) => Poll::Ready(Err(err)),
            Poll::Ready(Ok(0)) => {
                self.eof = true;
                Poll::Ready(Ok(None))
            }
            Poll::Ready(Ok(n)) => {
                self.silence.0.read();
                Poll::Ready(Ok(Some(n)))
            }
        }
    }

    /// Nothing to read: pending until the silence's deadline, then a `TimedOut` error, which
    /// closes the connection as a missed heartbeat would.
    fn poll_silence(&self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let watch = &self.silence.0;
        if !watch.expired(cx.waker()) {
            return Poll::Pending;
        }
        let limit = watch.limit();
        Poll::Ready(Err(io::Error::new(
            io::ErrorKind::TimedOut,
            format!(
                "nothing from the broker for {} s, two heartbeat intervals",
                limit.as_secs()
            ),
        )))
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for Sanitizing<S> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        out: &mut [u8],
    ) -> Poll<io::Result<usize>> {
        if out.is_empty() {
            return Poll::Ready(Ok(0));
        }
        self.get_mut().poll_sanitized(cx, out)
    }

    /// Reads into the first buffer that has room only: a frame is scanned where it lies, whole.
    fn poll_read_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        outs: &mut [IoSliceMut<'_>],
    ) -> Poll<io::Result<usize>> {
        match outs.iter_mut().find(|out| !out.is_empty()) {
            Some(out) => self.get_mut().poll_sanitized(cx, out),
            None => Poll::Ready(Ok(0)),
        }
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for Sanitizing<S> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write_vectored(cx, bufs)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_close(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_close(cx)
    }
}

/// The stream a connection runs on: TCP, with TLS when the URL says `amqps`.
pub(crate) type Transport = AsyncTcpStream<<Tokio as Reactor>::TcpStream>;

/// The reactor lapin runs Lily's connections on: tokio's, with [`Sanitizing`] streams.
///
/// lapin's connector takes the stream its runtime's reactor makes, so a stream of Lily's own
/// needs a reactor of Lily's own. Lily opens every stream itself (see
/// [`crate::connect`]): [`Reactor::tcp_connect_addr`] only serves a runtime asked directly.
#[derive(Clone, Debug)]
pub(crate) struct Wire(Tokio);

impl Wire {
    /// The runtime of a connection: tokio's executor, this reactor.
    pub(crate) fn runtime() -> Runtime<RuntimeParts<Tokio, Wire>> {
        Runtime::new(RuntimeParts::new(Tokio::current(), Wire(Tokio::current())))
    }
}

impl Reactor for Wire {
    type TcpStream = Sanitizing<Transport>;
    type Sleep = <Tokio as Reactor>::Sleep;

    fn register<H: io::Read + io::Write + Send + 'static>(
        &self,
        _socket: H,
    ) -> io::Result<impl AsyncRead + AsyncWrite + Send + Unpin + 'static> {
        Err::<async_rs::util::DummyIO, _>(io::Error::other(
            "Lily's connections register no raw sockets",
        ))
    }

    fn sleep(&self, dur: std::time::Duration) -> Self::Sleep {
        self.0.sleep(dur)
    }

    fn interval(
        &self,
        dur: std::time::Duration,
    ) -> impl futures_core::Stream<Item = std::time::Instant> + Send + 'static {
        self.0.interval(dur)
    }

    fn tcp_connect_addr(
        &self,
        addr: std::net::SocketAddr,
    ) -> impl Future<Output = io::Result<Self::TcpStream>> + Send + 'static {
        let connect = self.0.tcp_connect_addr(addr);
        async move {
            let stream = AsyncTcpStream::Plain(connect.await?);
            Ok(Sanitizing::new(stream, Rewrites::default()))
        }
    }
}

#[cfg(test)]
mod tests {
    use amq_protocol::protocol::basic::AMQPProperties;
    use lapin::types::{AMQPValue, FieldTable};

    use super::super::sanitizer::tests::{encode, message, poison, sanitize, valid_traffic};
    use super::*;

    /// A broker whose bytes arrive in reads of `sizes`, in turn.
    struct Trickle {
        wire: Vec<u8>,
        sizes: Vec<usize>,
        reads: usize,
    }

    impl AsyncRead for Trickle {
        fn poll_read(
            mut self: Pin<&mut Self>,
            _: &mut Context<'_>,
            out: &mut [u8],
        ) -> Poll<io::Result<usize>> {
            let size = self.sizes[self.reads % self.sizes.len()];
            let n = size.min(out.len()).min(self.wire.len());
            out[..n].copy_from_slice(&self.wire[..n]);
            self.wire.drain(..n);
            self.reads += 1;
            Poll::Ready(Ok(n))
        }
    }

    /// What lapin reads from `wire` arriving in reads of `sizes`, when it reads into a buffer
    /// of `room` bytes at a time, offered (as lapin's ring buffer does) after an empty slice.
    fn read_through(wire: &[u8], sizes: &[usize], room: usize) -> Vec<u8> {
        let broker = Trickle {
            wire: wire.to_vec(),
            sizes: sizes.to_vec(),
            reads: 0,
        };
        let mut stream = Sanitizing::new(broker, Rewrites::default());
        let mut cx = Context::from_waker(Waker::noop());
        let (mut read, mut room) = (Vec::new(), vec![0; room]);
        loop {
            let outs = &mut [IoSliceMut::new(&mut []), IoSliceMut::new(&mut room)];
            match Pin::new(&mut stream).poll_read_vectored(&mut cx, outs) {
                Poll::Ready(Ok(0)) => return read,
                Poll::Ready(Ok(n)) => read.extend_from_slice(&room[..n]),
                other => panic!("a read from a broker that always has bytes: {other:?}"),
            }
        }
    }

    #[test]
    fn what_lapin_reads_is_the_rewritten_stream_however_reads_and_room_fall() {
        let mut long = FieldTable::default();
        long.insert(
            "note".into(),
            AMQPValue::LongString("#BAD3#".repeat(900).into()),
        );
        let mut frames = valid_traffic();
        frames.extend(message(
            5,
            2,
            AMQPProperties::default().with_message_id("#BAD1#".into()),
        ));
        frames.extend(message(5, 3, AMQPProperties::default().with_headers(long)));
        frames.extend(valid_traffic());
        let mut wire = encode(&frames);
        for marker in ["#BAD1#", "#BAD3#"] {
            poison(&mut wire, marker);
        }
        let rewritten = sanitize(&wire, 0, &Rewrites::default());
        assert_ne!(rewritten, wire, "the stream holds frames to rewrite");
        for sizes in [&[1][..], &[3, 7], &[13, 64], &[4096], &[100_000]] {
            for room in [1, 8, 100, 2000, 8192, 1 << 20] {
                assert!(
                    read_through(&wire, sizes, room) == rewritten,
                    "reads of {sizes:?}, room for {room}: not the rewritten stream"
                );
            }
        }
    }

    #[test]
    fn a_frame_cut_short_by_the_end_passes_as_it_is() {
        let wire = encode(&valid_traffic());
        let cut = &wire[..wire.len() - 5];
        for room in [3, 4096] {
            assert!(read_through(cut, &[64], room) == cut, "room for {room}");
        }
    }

    /// A broker that never sends a byte.
    struct Quiet;

    impl AsyncRead for Quiet {
        fn poll_read(
            self: Pin<&mut Self>,
            _: &mut Context<'_>,
            _: &mut [u8],
        ) -> Poll<io::Result<usize>> {
            Poll::Pending
        }
    }

    async fn read(stream: &mut Sanitizing<Quiet>) -> io::Result<usize> {
        let mut buf = [0; 8];
        std::future::poll_fn(|cx| Pin::new(&mut *stream).poll_read(cx, &mut buf)).await
    }

    #[tokio::test(start_paused = true)]
    async fn a_silent_broker_fails_the_read_two_heartbeats_after_its_last_byte() {
        let silence = Silence::default();
        let mut stream = Sanitizing::new(Quiet, Rewrites::default()).timing(silence.clone());
        silence.arm(3);
        let started = Instant::now();
        let err = read(&mut stream)
            .await
            .expect_err("the silence ends the read");
        assert_eq!(err.kind(), io::ErrorKind::TimedOut);
        assert_eq!(started.elapsed(), Duration::from_secs(6));
    }

    #[tokio::test(start_paused = true)]
    async fn silence_is_timed_from_the_arming_also_for_a_read_already_waiting() {
        let silence = Silence::default();
        let mut stream = Sanitizing::new(Quiet, Rewrites::default()).timing(silence.clone());
        let reading = tokio::spawn(async move { read(&mut stream).await });
        tokio::time::sleep(Duration::from_secs(3600)).await;
        assert!(!reading.is_finished(), "unarmed: still reading");
        silence.arm(0);
        tokio::time::sleep(Duration::from_secs(3600)).await;
        assert!(!reading.is_finished(), "heartbeats off: still reading");
        let armed = Instant::now();
        silence.arm(2);
        let err = reading
            .await
            .expect("the read")
            .expect_err("the silence ends the read");
        assert_eq!(err.kind(), io::ErrorKind::TimedOut);
        assert_eq!(armed.elapsed(), Duration::from_secs(4));
    }
}
