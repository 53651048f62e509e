//! A fault-injecting TCP proxy between a client and the broker.
//!
//! It forwards bytes both ways and parses the AMQP frames the client sends. Armed, it waits
//! for the first `basic.ack` a client sends; it drops that frame and everything after it on
//! that connection and cuts the connection shortly after. A client that ACKs a delivery right
//! after its handoff was confirmed (on another connection) thus has the ACK written locally
//! but never processed by the broker: the "handoff confirmed, ack uncertain" row.
//!
//! It can also swallow the publisher confirms (`basic.ack` from the broker) on their way to the
//! client, as a broker that never confirms would look: the client's confirms time out.
//!
//! Or hold them back ([`FaultProxy::hold_confirms`]), as a broker syncing its queues to disk
//! looks: nothing it sends reaches the client from the first held confirm on, until released.
//!
//! It counts the `basic.ack` frames clients send ([`FaultProxy::acks_sent`]), and the
//! `basic.publish` frames by routing key ([`FaultProxy::publishes_to`]).
//!
//! And it can rewrite what a client sends ([`FaultProxy::rewrite`]): a publisher behind it
//! writes bytes its own library would refuse to, such as short strings that are not UTF-8.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

const FRAME_METHOD: u8 = 1;
const CLASS_BASIC: u16 = 60;
const METHOD_ACK: u16 = 80;
const METHOD_PUBLISH: u16 = 40;

/// The proxy; it runs until the test process ends.
#[derive(Debug)]
pub struct FaultProxy {
    addr: SocketAddr,
    armed: Arc<AtomicBool>,
    tripped: Arc<AtomicBool>,
    confirms: Arc<Confirms>,
    rewrites: Rewrites,
    acks: Arc<AtomicU64>,
    publishes: Publishes,
}

/// How many `basic.publish` frames clients sent, by routing key.
type Publishes = Arc<Mutex<std::collections::HashMap<String, u64>>>;

/// Byte patterns replaced in the frames clients send, each by bytes of the same length.
type Rewrites = Arc<Mutex<Vec<(Vec<u8>, Vec<u8>)>>>;

/// Which confirms are swallowed (one in `every`; none when 0), and how many were.
#[derive(Debug, Default)]
struct Confirms {
    every: AtomicU64,
    seen: AtomicU64,
    swallowed: AtomicU64,
    /// Confirms wait while this is set.
    held: AtomicBool,
    released: tokio::sync::Notify,
}

impl Confirms {
    /// Whether to swallow the confirm frame just read.
    fn swallow(&self) -> bool {
        let every = self.every.load(Ordering::Acquire);
        let seen = self.seen.fetch_add(1, Ordering::AcqRel);
        let swallow = every != 0 && seen.is_multiple_of(every);
        if swallow {
            self.swallowed.fetch_add(1, Ordering::AcqRel);
        }
        swallow
    }
}

impl FaultProxy {
    /// Listens on a free loopback port and forwards to `upstream`. It starts armed: the first
    /// connection to send a `basic.ack` loses it and is cut; later ones pass.
    ///
    /// # Panics
    /// When no loopback port can be bound.
    pub async fn start(upstream: SocketAddr) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind proxy");
        let addr = listener.local_addr().expect("proxy address");
        let armed = Arc::new(AtomicBool::new(true));
        let tripped = Arc::new(AtomicBool::new(false));
        let confirms = Arc::new(Confirms::default());
        let rewrites = Rewrites::default();
        let acks = Arc::new(AtomicU64::new(0));
        let publishes = Publishes::default();
        let (a, t, c, r, k, p) = (
            Arc::clone(&armed),
            Arc::clone(&tripped),
            Arc::clone(&confirms),
            Arc::clone(&rewrites),
            Arc::clone(&acks),
            Arc::clone(&publishes),
        );
        tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let Ok(server) = TcpStream::connect(upstream).await else {
                    continue;
                };
                tokio::spawn(relay(
                    client,
                    server,
                    Faults {
                        armed: Arc::clone(&a),
                        tripped: Arc::clone(&t),
                        confirms: Arc::clone(&c),
                        rewrites: Arc::clone(&r),
                        acks: Arc::clone(&k),
                        publishes: Arc::clone(&p),
                    },
                ));
            }
        });
        Self {
            addr,
            armed,
            tripped,
            confirms,
            rewrites,
            acks,
            publishes,
        }
    }

    /// `url` with its host and port replaced by the proxy's.
    pub fn url(&self, url: &str) -> String {
        let (scheme, rest) = url.split_once("://").unwrap_or(("amqp", url));
        let (auth, rest) = rest.rsplit_once('@').map_or(("", rest), |(a, r)| (a, r));
        let path = rest.find('/').map_or("", |i| &rest[i..]);
        let at = if auth.is_empty() { "" } else { "@" };
        format!("{scheme}://{auth}{at}{}{path}", self.addr)
    }

    /// Whether the fault has fired.
    pub fn tripped(&self) -> bool {
        self.tripped.load(Ordering::Acquire)
    }

    /// Disarms the proxy: every connection passes.
    pub fn disarm(&self) {
        self.armed.store(false, Ordering::Release);
    }

    /// From now on, one in `every` publisher confirm frames from the broker never reaches its
    /// client: 1 swallows them all, 0 none. A frame may confirm several publishes (`multiple`).
    pub fn swallow_confirms(&self, every: u64) {
        self.confirms.every.store(every, Ordering::Release);
    }

    /// From now on, every `pattern` in a frame a client sends reaches the broker as
    /// `replacement`. Frames keep their length, so both must be equally long; a pattern is
    /// matched within one frame.
    ///
    /// # Panics
    /// When the lengths differ.
    pub fn rewrite(&self, pattern: &[u8], replacement: &[u8]) {
        assert_eq!(
            pattern.len(),
            replacement.len(),
            "a rewrite keeps the length"
        );
        self.rewrites
            .lock()
            .expect("rewrites")
            .push((pattern.to_vec(), replacement.to_vec()));
    }

    /// How many `basic.ack` frames clients sent through the proxy (one may settle many
    /// deliveries: `multiple`). A frame the armed proxy drops is not counted.
    pub fn acks_sent(&self) -> u64 {
        self.acks.load(Ordering::Acquire)
    }

    /// From now on (`true`), the first publisher confirm frame from the broker and everything
    /// after it on that connection wait in the proxy, in order, until `false` releases them.
    pub fn hold_confirms(&self, hold: bool) {
        self.confirms.held.store(hold, Ordering::Release);
        if !hold {
            self.confirms.released.notify_waiters();
        }
    }

    /// How many `basic.publish` frames clients sent through the proxy with `routing_key`.
    pub fn publishes_to(&self, routing_key: &str) -> u64 {
        let publishes = self.publishes.lock().expect("publishes");
        publishes.get(routing_key).copied().unwrap_or(0)
    }

    /// How many publisher confirms were swallowed.
    pub fn swallowed(&self) -> u64 {
        self.confirms.swallowed.load(Ordering::Acquire)
    }
}

/// What one relayed connection shares with the proxy.
struct Faults {
    armed: Arc<AtomicBool>,
    tripped: Arc<AtomicBool>,
    confirms: Arc<Confirms>,
    rewrites: Rewrites,
    acks: Arc<AtomicU64>,
    publishes: Publishes,
}

async fn relay(client: TcpStream, server: TcpStream, faults: Faults) {
    let Faults {
        armed,
        tripped,
        confirms,
        rewrites,
        acks,
        publishes,
    } = faults;
    let (mut client_rx, mut client_tx) = client.into_split();
    let (mut server_rx, mut server_tx) = server.into_split();
    // The broker sends frames from the first byte.
    let downstream = tokio::spawn(async move {
        let mut pending: Vec<u8> = Vec::new();
        let mut buf = vec![0u8; 64 * 1024];
        loop {
            let n = match server_rx.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(n) => n,
            };
            pending.extend_from_slice(&buf[..n]);
            while let Some(len) = frame_len(&pending) {
                if is_basic_ack(&pending[..len]) {
                    loop {
                        let released = confirms.released.notified();
                        if !confirms.held.load(Ordering::Acquire) {
                            break;
                        }
                        released.await;
                    }
                }
                if is_basic_ack(&pending[..len]) && confirms.swallow() {
                    // Gone.
                } else if client_tx.write_all(&pending[..len]).await.is_err() {
                    return;
                }
                pending.drain(..len);
            }
        }
    });
    // The client opens with the 8-byte protocol header; frames follow.
    let mut pending: Vec<u8> = Vec::new();
    let mut header = 8;
    let mut buf = vec![0u8; 64 * 1024];
    'relay: loop {
        let n = match client_rx.read(&mut buf).await {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        pending.extend_from_slice(&buf[..n]);
        let skip = header.min(pending.len());
        if skip > 0 {
            if server_tx.write_all(&pending[..skip]).await.is_err() {
                break;
            }
            pending.drain(..skip);
            header -= skip;
        }
        while let Some(len) = frame_len(&pending) {
            if is_basic_ack(&pending[..len]) && armed.swap(false, Ordering::AcqRel) {
                // This ACK and everything after it never reach the broker; the connection is
                // cut shortly after.
                tripped.store(true, Ordering::Release);
                tokio::time::sleep(Duration::from_millis(300)).await;
                break 'relay;
            }
            if is_basic_ack(&pending[..len]) {
                acks.fetch_add(1, Ordering::AcqRel);
            }
            if let Some(key) = published_to(&pending[..len]) {
                *publishes.lock().expect("publishes").entry(key).or_default() += 1;
            }
            rewrite(&mut pending[..len], &rewrites.lock().expect("rewrites"));
            if server_tx.write_all(&pending[..len]).await.is_err() {
                break 'relay;
            }
            pending.drain(..len);
        }
    }
    downstream.abort();
}

/// Replaces every occurrence of each pattern in `frame`, in place.
fn rewrite(frame: &mut [u8], rewrites: &[(Vec<u8>, Vec<u8>)]) {
    for (pattern, replacement) in rewrites {
        let mut at = 0;
        while let Some(found) = frame[at..]
            .windows(pattern.len())
            .position(|w| w == pattern.as_slice())
        {
            let start = at + found;
            frame[start..start + pattern.len()].copy_from_slice(replacement);
            at = start + pattern.len();
        }
    }
}

/// Length of the first complete frame in `buf`, if there is one.
fn frame_len(buf: &[u8]) -> Option<usize> {
    let size = u32::from_be_bytes(buf.get(3..7)?.try_into().ok()?) as usize;
    let len = 7 + size + 1;
    (buf.len() >= len).then_some(len)
}

fn is_basic_ack(frame: &[u8]) -> bool {
    is_basic(frame, METHOD_ACK)
}

fn is_basic(frame: &[u8], method: u16) -> bool {
    frame[0] == FRAME_METHOD
        && frame.len() >= 11
        && u16::from_be_bytes([frame[7], frame[8]]) == CLASS_BASIC
        && u16::from_be_bytes([frame[9], frame[10]]) == method
}

/// The routing key of a `basic.publish` frame (after the reserved short, the exchange and the
/// routing key are short strings).
fn published_to(frame: &[u8]) -> Option<String> {
    if !is_basic(frame, METHOD_PUBLISH) {
        return None;
    }
    let exchange = usize::from(*frame.get(13)?);
    let at = 14 + exchange;
    let key = frame.get(at + 1..at + 1 + usize::from(*frame.get(at)?))?;
    Some(String::from_utf8_lossy(key).into_owned())
}
