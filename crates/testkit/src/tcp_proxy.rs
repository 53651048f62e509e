//! A controllable loopback TCP proxy, protocol-agnostic (MongoDB wire protocol, AMQP, ...).
//!
//! Tests put it between a client and a real server to make the network fail on cue:
//!
//! - [`TcpProxy::cut`] closes every current connection (both sides), as a network fault would;
//! - [`TcpProxy::refuse`] closes new connections as soon as they are accepted while it is set;
//! - [`TcpProxy::stall`] stops forwarding in both directions without closing anything, as a
//!   network that silently drops everything would look: only timeouts can notice;
//! - [`TcpProxy::drop_reply_after`] arms a one-shot trap: the first connection whose
//!   client→server bytes contain a pattern (e.g. `b"commitTransaction"`) has those bytes
//!   forwarded, then the server's reply is swallowed, the connection is cut and new
//!   connections are refused for a while. The server did the work; the client never learns it.
//! - [`TcpProxy::silence_reply_after`] is the same trap, but the connection stays open and
//!   silent for a while before it is cut, so the client gives up waiting (a timeout, a budget)
//!   before any error reaches it.
//! - [`TcpProxy::cut_when_sent`]: while set, a connection about to carry a pattern to the
//!   server is cut before those bytes are forwarded. The server never sees the command.
//!
//! [`TcpProxy::stall_to_server`] stalls one direction only, as a link that fails one way does.
//! [`TcpProxy::last_to_marked`] tells when the server's bytes last reached a client on a
//! connection whose client sent a pattern ([`TcpProxy::mark`]), so a test can time what that
//! client notices from the last byte it was given.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::AbortHandle;

/// How long a trapped connection waits for the server's reply (to swallow it) before it is cut
/// anyway.
const REPLY_WAIT: Duration = Duration::from_secs(2);

/// The proxy. It stops accepting and cuts its connections when dropped.
#[derive(Debug)]
pub struct TcpProxy {
    addr: SocketAddr,
    shared: Arc<Shared>,
    accept: AbortHandle,
}

#[derive(Debug, Default)]
struct Shared {
    refusing: AtomicBool,
    stalled: AtomicBool,
    refuse_until: Mutex<Option<Instant>>,
    trap: Mutex<Option<Trap>>,
    tripped: AtomicBool,
    cut_on: Mutex<Option<&'static [u8]>>,
    cut_sends: AtomicU64,
    accepted: AtomicU64,
    refused: AtomicU64,
    next_id: AtomicU64,
    live: Mutex<HashMap<u64, AbortHandle>>,
    mark: Mutex<Option<&'static [u8]>>,
    stalled_to_server: AtomicBool,
    last_to_marked: Mutex<Option<Instant>>,
}

#[derive(Clone, Copy, Debug)]
struct Trap {
    pattern: &'static [u8],
    /// New connections are refused for this long after the hit.
    hold: Duration,
    /// Set: the trapped connection swallows what the server sends for this long, then is cut.
    /// Unset: it is cut as soon as the reply arrives, or after [`REPLY_WAIT`].
    silence: Option<Duration>,
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

impl TcpProxy {
    /// Listens on a free loopback port and forwards every accepted connection to `upstream`.
    ///
    /// # Panics
    /// When no loopback port can be bound.
    pub async fn start(upstream: SocketAddr) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind proxy");
        let addr = listener.local_addr().expect("proxy address");
        let shared = Arc::new(Shared::default());
        let state = Arc::clone(&shared);
        let accept = tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                if state.refusing_now() {
                    state.refused.fetch_add(1, Ordering::Relaxed);
                    drop(client);
                    continue;
                }
                state.accepted.fetch_add(1, Ordering::Relaxed);
                let id = state.next_id.fetch_add(1, Ordering::Relaxed);
                // Registered under the lock, so the relay cannot unregister before it is in.
                let mut live = lock(&state.live);
                let task = tokio::spawn(relay(client, upstream, Arc::clone(&state), id));
                live.insert(id, task.abort_handle());
            }
        })
        .abort_handle();
        Self {
            addr,
            shared,
            accept,
        }
    }

    /// The proxy's loopback address.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// `url` (`mongodb://…`, `amqp://user:pass@…/vhost`, …) with its `host:port` replaced by the
    /// proxy's; credentials, path and query are kept.
    pub fn url(&self, url: &str) -> String {
        rewrite(url, self.addr)
    }

    /// Closes every current connection, both towards the client and towards the server.
    pub fn cut(&self) {
        let live: Vec<AbortHandle> = lock(&self.shared.live).drain().map(|(_, h)| h).collect();
        for handle in live {
            handle.abort();
        }
    }

    /// While `refuse` is set, new connections are closed as soon as they are accepted. Current
    /// connections are untouched: combine with [`cut`](Self::cut) for a full outage.
    pub fn refuse(&self, refuse: bool) {
        self.shared.refusing.store(refuse, Ordering::Release);
    }

    /// While `stall` is set, nothing is forwarded either way on any connection, and nothing is
    /// closed: bytes wait in the sockets' buffers (a read already under way when it is set is
    /// held until it is cleared).
    pub fn stall(&self, stall: bool) {
        self.shared.stalled.store(stall, Ordering::Release);
    }

    /// Arms a one-shot trap: the first connection whose client→server bytes contain `pattern`
    /// forwards those bytes, then swallows what the server sends back (the reply is lost), is
    /// cut as soon as the reply arrives (or after 2 s), and new connections are refused for
    /// `hold` from the moment the pattern was seen.
    pub fn drop_reply_after(&self, pattern: &'static [u8], hold: Duration) {
        self.arm(Trap {
            pattern,
            hold,
            silence: None,
        });
    }

    /// Arms a one-shot trap: the first connection whose client→server bytes contain `pattern`
    /// forwards those bytes, then stays open and forwards nothing back for `silence` (the
    /// server's reply is swallowed), then is cut. Other connections are untouched.
    pub fn silence_reply_after(&self, pattern: &'static [u8], silence: Duration) {
        self.arm(Trap {
            pattern,
            hold: Duration::ZERO,
            silence: Some(silence),
        });
    }

    fn arm(&self, trap: Trap) {
        assert!(
            !trap.pattern.is_empty(),
            "an empty pattern would match anything"
        );
        *lock(&self.shared.trap) = Some(trap);
        self.shared.tripped.store(false, Ordering::Release);
    }

    /// Whether the trap of [`drop_reply_after`](Self::drop_reply_after) or
    /// [`silence_reply_after`](Self::silence_reply_after) fired.
    pub fn tripped(&self) -> bool {
        self.shared.tripped.load(Ordering::Acquire)
    }

    /// While `pattern` is set, every connection whose client→server bytes contain it is cut
    /// before those bytes are forwarded (a retry on a new connection is cut too); `None` stops
    /// it.
    pub fn cut_when_sent(&self, pattern: Option<&'static [u8]>) {
        assert!(
            pattern.is_none_or(|p| !p.is_empty()),
            "an empty pattern would match anything"
        );
        *lock(&self.shared.cut_on) = pattern;
    }

    /// Connections cut by [`cut_when_sent`](Self::cut_when_sent) so far.
    pub fn cut_sends(&self) -> u64 {
        self.shared.cut_sends.load(Ordering::Relaxed)
    }

    /// While `stall` is set, nothing from the clients is forwarded to the server (what the server
    /// sends still is), and nothing is closed by the proxy (a side that closes while no chunk is
    /// held still closes the connection).
    pub fn stall_to_server(&self, stall: bool) {
        self.shared
            .stalled_to_server
            .store(stall, Ordering::Release);
    }

    /// Marks the connections whose client→server bytes contain `pattern` (a connection's name,
    /// say), from the next bytes they send.
    pub fn mark(&self, pattern: &'static [u8]) {
        assert!(!pattern.is_empty(), "an empty pattern would match anything");
        *lock(&self.shared.mark) = Some(pattern);
    }

    /// When bytes from the server were last written to a client on a marked connection.
    pub fn last_to_marked(&self) -> Option<Instant> {
        *lock(&self.shared.last_to_marked)
    }

    /// Connections accepted and forwarded so far.
    pub fn accepted(&self) -> u64 {
        self.shared.accepted.load(Ordering::Relaxed)
    }

    /// Connections refused so far.
    pub fn refused(&self) -> u64 {
        self.shared.refused.load(Ordering::Relaxed)
    }
}

impl Drop for TcpProxy {
    fn drop(&mut self) {
        self.accept.abort();
        self.cut();
    }
}

impl Shared {
    /// Returns once the proxy is not stalled.
    async fn unstalled(&self) {
        while self.stalled.load(Ordering::Acquire) {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    fn refusing_now(&self) -> bool {
        if self.refusing.load(Ordering::Acquire) {
            return true;
        }
        let mut until = lock(&self.refuse_until);
        match *until {
            Some(t) if Instant::now() < t => true,
            Some(_) => {
                *until = None;
                false
            }
            None => false,
        }
    }

    /// Whether the bytes about to be forwarded, `chunk` after what `seen` kept of the previous
    /// ones, carry the pattern of [`TcpProxy::cut_when_sent`].
    fn cuts(&self, seen: &mut Vec<u8>, chunk: &[u8]) -> bool {
        let Some(pattern) = *lock(&self.cut_on) else {
            seen.clear();
            return false;
        };
        let hit = found(seen, chunk, pattern);
        if hit {
            self.cut_sends.fetch_add(1, Ordering::Relaxed);
        }
        hit
    }

    /// Looks for the armed pattern in `chunk`, with the previous chunk's tail in `window` so a
    /// pattern split across reads is found. On a hit the trap is disarmed, the hold starts and
    /// the trap is returned.
    fn trap_hit(&self, window: &mut Vec<u8>, chunk: &[u8]) -> Option<Trap> {
        let mut trap = lock(&self.trap);
        let Some(armed @ Trap { pattern, hold, .. }) = *trap else {
            window.clear();
            return None;
        };
        if !found(window, chunk, pattern) {
            return None;
        }
        *trap = None;
        *lock(&self.refuse_until) = Some(Instant::now() + hold);
        self.tripped.store(true, Ordering::Release);
        Some(armed)
    }
}

/// Whether `pattern` is in `chunk` read after what `window` kept of the earlier bytes, so a
/// pattern split across reads is found; `window` then keeps the tail a split could start in.
fn found(window: &mut Vec<u8>, chunk: &[u8], pattern: &[u8]) -> bool {
    window.extend_from_slice(chunk);
    let hit = window.windows(pattern.len()).any(|w| w == pattern);
    let keep = pattern.len() - 1;
    if window.len() > keep {
        window.drain(..window.len() - keep);
    }
    hit
}

/// `url` with its `host:port` replaced by `addr`.
fn rewrite(url: &str, addr: SocketAddr) -> String {
    let (scheme, rest) = url.split_once("://").unwrap_or(("tcp", url));
    let (auth, rest) = rest.rsplit_once('@').map_or(("", rest), |(a, r)| (a, r));
    let tail = rest.find(['/', '?']).map_or("", |i| &rest[i..]);
    let at = if auth.is_empty() { "" } else { "@" };
    format!("{scheme}://{auth}{at}{addr}{tail}")
}

/// What one turn of [`relay`] read.
enum Relayed {
    /// From the client, towards the server.
    Up(std::io::Result<usize>),
    /// From the server, towards the client.
    Down(std::io::Result<usize>),
}

/// Forwards one connection until either side closes, the proxy cuts it, or its trap fires.
async fn relay(client: TcpStream, upstream: SocketAddr, shared: Arc<Shared>, id: u64) {
    let Ok(server) = TcpStream::connect(upstream).await else {
        lock(&shared.live).remove(&id);
        return;
    };
    let _ = client.set_nodelay(true);
    let _ = server.set_nodelay(true);
    let (mut client_rx, mut client_tx) = client.into_split();
    let (mut server_rx, mut server_tx) = server.into_split();
    let mut up = vec![0u8; 64 * 1024];
    let mut down = vec![0u8; 64 * 1024];
    let mut window = Vec::new();
    let mut seen = Vec::new();
    // Set once the trap fired on this connection: the server's next bytes are its reply,
    // swallowed until then; `silent` keeps swallowing instead of cutting at the reply.
    let mut swallow_until: Option<tokio::time::Instant> = None;
    let mut silent = false;
    let (mut marked, mut mark_window) = (false, Vec::new());
    // The length of a chunk in `up` read while the clients' bytes were stalled, forwarded once
    // they are not.
    let mut held: Option<usize> = None;
    loop {
        shared.unstalled().await;
        let to_server = !shared.stalled_to_server.load(Ordering::Acquire);
        let event = match held {
            Some(n) if to_server => {
                held = None;
                Relayed::Up(Ok(n))
            }
            _ => {
                let reply_wait = async {
                    match swallow_until {
                        Some(t) => tokio::time::sleep_until(t).await,
                        None => std::future::pending().await,
                    }
                };
                tokio::select! {
                    read = client_rx.read(&mut up), if held.is_none() => Relayed::Up(read),
                    read = server_rx.read(&mut down) => Relayed::Down(read),
                    // Looks again at the stall towards the server.
                    () = tokio::time::sleep(Duration::from_millis(20)), if !to_server => {
                        continue;
                    }
                    () = reply_wait => break,
                }
            }
        };
        match event {
            Relayed::Up(read) => {
                let n = match read {
                    Ok(0) | Err(_) => break,
                    Ok(n) => n,
                };
                shared.unstalled().await;
                if shared.stalled_to_server.load(Ordering::Acquire) {
                    held = Some(n);
                    continue;
                }
                if shared.cuts(&mut seen, &up[..n]) {
                    break;
                }
                if !marked && let Some(pattern) = *lock(&shared.mark) {
                    marked = found(&mut mark_window, &up[..n], pattern);
                }
                let hit = swallow_until
                    .is_none()
                    .then(|| shared.trap_hit(&mut window, &up[..n]))
                    .flatten();
                if let Some(trap) = hit {
                    // Before forwarding, so a fast reply cannot slip through.
                    let wait = trap.silence.unwrap_or(REPLY_WAIT);
                    swallow_until = Some(tokio::time::Instant::now() + wait);
                    silent = trap.silence.is_some();
                }
                if server_tx.write_all(&up[..n]).await.is_err() {
                    break;
                }
            }
            Relayed::Down(read) => {
                let n = match read {
                    Ok(0) | Err(_) => break,
                    Ok(n) => n,
                };
                shared.unstalled().await;
                if silent {
                    continue; // swallowed; the cut comes when the silence ends
                }
                if swallow_until.is_some() {
                    break; // the reply is lost with the connection
                }
                if client_tx.write_all(&down[..n]).await.is_err() {
                    break;
                }
                if marked {
                    *lock(&shared.last_to_marked) = Some(Instant::now());
                }
            }
        }
    }
    lock(&shared.live).remove(&id);
    // Dropping the halves closes both sockets.
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_keep_credentials_path_and_query() {
        let addr: SocketAddr = "127.0.0.1:4000".parse().unwrap();
        let rewrite = |url: &str| rewrite(url, addr);
        assert_eq!(
            rewrite("amqp://guest:guest@127.0.0.1:5672/%2f"),
            "amqp://guest:guest@127.0.0.1:4000/%2f"
        );
        assert_eq!(
            rewrite("mongodb://127.0.0.1:27017/?replicaSet=lily&directConnection=true"),
            "mongodb://127.0.0.1:4000/?replicaSet=lily&directConnection=true"
        );
        assert_eq!(
            rewrite("mongodb://127.0.0.1:27017"),
            "mongodb://127.0.0.1:4000"
        );
    }

    #[test]
    fn trap_finds_a_pattern_split_across_reads_once() {
        let shared = Shared::default();
        *lock(&shared.trap) = Some(Trap {
            pattern: b"commitTransaction",
            hold: Duration::from_secs(1),
            silence: None,
        });
        let mut window = Vec::new();
        assert!(shared.trap_hit(&mut window, b"....commitTra").is_none());
        assert!(shared.trap_hit(&mut window, b"nsaction....").is_some());
        assert!(shared.tripped.load(Ordering::Acquire));
        assert!(shared.refusing_now());
        assert!(
            shared.trap_hit(&mut window, b"commitTransaction").is_none(),
            "one-shot"
        );
    }
}
