//! The connection's stream with a [`Sanitizer`] on what it reads and a deadline on the broker's
//! silence, and the reactor that lets lapin run on it.

use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use async_rs::traits::Reactor;
use async_rs::util::RuntimeParts;
use async_rs::{Runtime, Tokio};
use futures_io::{AsyncRead, AsyncWrite, IoSlice, IoSliceMut};
use lapin::tcp::AsyncTcpStream;
use tokio::runtime::Handle;
use tokio::time::{Instant, Sleep};

use super::{Rewrites, Sanitizer};
/// Bytes read from the stream at a time, at least.
const READ_CHUNK: usize = 64 * 1024;

/// How long a connection's broker may stay silent before its stream fails: twice the negotiated
/// heartbeat, as AMQP says, set once the connection is open. Unset, silence is not timed.
///
/// lapin checks for a missed heartbeat only when it wakes to send one, every half interval,
/// so on its own it notices up to half an interval late; this deadline is exact.
#[derive(Clone, Debug, Default)]
pub(crate) struct Silence(Arc<AtomicU64>);

impl Silence {
    /// Times silence from now on: the stream fails after two `heartbeat` intervals (in
    /// seconds, as negotiated) without a byte from the broker; `0` turns the timing off.
    pub(crate) fn arm(&self, heartbeat: u16) {
        self.0
            .store(u64::from(heartbeat) * 2_000, Ordering::Relaxed);
    }

    fn limit(&self) -> Option<Duration> {
        match self.0.load(Ordering::Relaxed) {
            0 => None,
            ms => Some(Duration::from_millis(ms)),
        }
    }
}

/// A connection's stream with a [`Sanitizer`] on what it reads and a deadline on the broker's
/// [`Silence`]; writes pass through.
#[derive(Debug)]
pub struct Sanitizing<S> {
    inner: S,
    sanitizer: Sanitizer,
    silence: Silence,
    /// When a byte was last read from `inner`.
    last_read: Instant,
    /// Wakes the reader at the silence's deadline, once one is set; made on `runtime` (lapin
    /// reads from a thread of its own, outside the runtime).
    deadline: Option<Pin<Box<Sleep>>>,
    runtime: Option<Handle>,
    /// Read from `inner`: `buf[..filled]`, of which `buf[..released]` is read by lapin and
    /// `buf[released..ready]` is ready for it.
    buf: Vec<u8>,
    released: usize,
    ready: usize,
    filled: usize,
    eof: bool,
}

impl<S> Sanitizing<S> {
    /// `inner` with a sanitizer on what is read from it, recording into `rewrites`.
    pub fn new(inner: S, rewrites: Rewrites) -> Self {
        Self {
            inner,
            sanitizer: Sanitizer::new(rewrites),
            silence: Silence::default(),
            last_read: Instant::now(),
            deadline: None,
            runtime: Handle::try_current().ok(),
            buf: Vec::new(),
            released: 0,
            ready: 0,
            filled: 0,
            eof: false,
        }
    }

    /// This stream, its reads failing once `silence` is armed and the broker is silent for
    /// longer. Made inside a tokio runtime, whose timer the deadline uses (outside one,
    /// silence is not timed).
    pub(crate) fn timing(mut self, silence: Silence) -> Self {
        self.silence = silence;
        self
    }
}

impl<S: AsyncRead + Unpin> Sanitizing<S> {
    /// Reads from `inner` until some bytes are ready (or the stream ended).
    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        while self.ready == self.released {
            if self.eof {
                // A frame cut short by the end passes as it is: lapin sees the same end.
                self.ready = self.filled;
                return Poll::Ready(Ok(()));
            }
            if self.released > 0 {
                self.buf.copy_within(self.released..self.filled, 0);
                self.filled -= self.released;
                self.ready -= self.released;
                self.released = 0;
            }
            if self.buf.len() - self.filled < READ_CHUNK / 4 {
                let len = (self.filled + READ_CHUNK).max(self.buf.len() * 2);
                self.buf.resize(len, 0);
            }
            let read = Pin::new(&mut self.inner).poll_read(cx, &mut self.buf[self.filled..]);
            match read {
                Poll::Pending => return self.poll_silence(cx),
                Poll::Ready(Err(err)) => return Poll::Ready(Err(err)),
                Poll::Ready(Ok(0)) => self.eof = true,
                Poll::Ready(Ok(n)) => {
                    self.last_read = Instant::now();
                    self.filled += n;
                    let ready = self.ready;
                    self.ready += self.sanitizer.scan(&mut self.buf[ready..self.filled]);
                }
            }
        }
        Poll::Ready(Ok(()))
    }

    /// Nothing to read: pending until the silence's deadline, then a `TimedOut` error, which
    /// closes the connection as a missed heartbeat would.
    fn poll_silence(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let (Some(limit), Some(runtime)) = (self.silence.limit(), &self.runtime) else {
            return Poll::Pending;
        };
        let at = self.last_read + limit;
        let deadline = self.deadline.get_or_insert_with(|| {
            let _entered = runtime.enter();
            Box::pin(tokio::time::sleep_until(at))
        });
        if deadline.deadline() != at {
            deadline.as_mut().reset(at);
        }
        match deadline.as_mut().poll(cx) {
            Poll::Pending => Poll::Pending,
            Poll::Ready(()) => Poll::Ready(Err(io::Error::new(
                io::ErrorKind::TimedOut,
                format!(
                    "nothing from the broker for {} s, two heartbeat intervals",
                    limit.as_secs()
                ),
            ))),
        }
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for Sanitizing<S> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        out: &mut [u8],
    ) -> Poll<io::Result<usize>> {
        self.poll_read_vectored(cx, &mut [IoSliceMut::new(out)])
    }

    fn poll_read_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        outs: &mut [IoSliceMut<'_>],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        if outs.iter().all(|out| out.is_empty()) {
            return Poll::Ready(Ok(0));
        }
        if let Err(err) = std::task::ready!(this.poll_ready(cx)) {
            return Poll::Ready(Err(err));
        }
        let mut copied = 0;
        for out in outs {
            let n = out.len().min(this.ready - this.released);
            out[..n].copy_from_slice(&this.buf[this.released..this.released + n]);
            this.released += n;
            copied += n;
        }
        Poll::Ready(Ok(copied))
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
    use super::*;

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
    async fn silence_is_not_timed_until_armed_or_when_heartbeats_are_off() {
        let silence = Silence::default();
        let mut stream = Sanitizing::new(Quiet, Rewrites::default()).timing(silence.clone());
        let waited = tokio::time::timeout(Duration::from_secs(3600), read(&mut stream)).await;
        assert!(waited.is_err(), "unarmed: still reading");
        silence.arm(0);
        let waited = tokio::time::timeout(Duration::from_secs(3600), read(&mut stream)).await;
        assert!(waited.is_err(), "heartbeats off: still reading");
    }
}
