//! A scripted AMQP 0-9-1 peer on loopback: just enough of a broker for one consumer to drain a
//! fixed backlog, with the same frames in the same order on every run.
//!
//! A real broker decides when to deliver by its own clock: how many deliveries one read finds
//! changes from run to run, and with it how often the consumer's tasks wake, so a count of the
//! consumer's instructions moves by half of Lily's layer from one day to the next. The peer
//! removes that: it delivers exactly as much as the prefetch allows, all of it in one write, the
//! moment credit comes back. Every other method gets its `-ok`; a passive queue declare reports
//! the messages not yet delivered. It never loses or redelivers, so it only stands in for the
//! broker where the broker's behaviour is not what is measured.

use std::io;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use amq_protocol::frame::{AMQPContentHeader, AMQPFrame, WriteContext, gen_frame, parse_frame};
use amq_protocol::protocol::basic::AMQPProperties;
use amq_protocol::protocol::{AMQPClass, basic, channel, confirm, connection, exchange, queue};
use amq_protocol::types::{AMQPValue, FieldTable, LongString, ShortString};
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinHandle;

/// What the peer saw of its consumers, in total over every connection.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Tally {
    /// Deliveries sent.
    pub delivered: u64,
    /// Deliveries ACKed.
    pub acked: u64,
    /// Deliveries NACKed or rejected.
    pub refused: u64,
}

/// The backlog every consumer of the peer shares, and what became of it.
struct Backlog {
    messages: u64,
    body: Vec<u8>,
    tally: Tally,
}

type Shared = Arc<Mutex<Backlog>>;

/// A peer serving a backlog on `127.0.0.1`, until dropped.
pub struct Peer {
    addr: SocketAddr,
    backlog: Shared,
    task: JoinHandle<()>,
}

impl Peer {
    /// Listens on a free loopback port and serves `messages` copies of `body`, each with the
    /// message id `m-<n>` and the type `order.placed`.
    ///
    /// # Errors
    /// When it cannot listen.
    pub async fn start(messages: u64, body: Vec<u8>) -> io::Result<Self> {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let backlog = Arc::new(Mutex::new(Backlog {
            messages,
            body,
            tally: Tally::default(),
        }));
        let shared = Arc::clone(&backlog);
        let task = tokio::spawn(async move {
            while let Ok((stream, _)) = listener.accept().await {
                let _ = stream.set_nodelay(true);
                tokio::spawn(serve(stream, Arc::clone(&shared)));
            }
        });
        Ok(Self {
            addr,
            backlog,
            task,
        })
    }

    /// The URL a client connects with.
    pub fn url(&self) -> String {
        format!("amqp://guest:guest@{}/%2f", self.addr)
    }

    /// What it saw so far.
    pub fn tally(&self) -> Tally {
        lock(&self.backlog).tally
    }
}

impl Drop for Peer {
    fn drop(&mut self) {
        self.task.abort();
    }
}

fn lock(backlog: &Shared) -> std::sync::MutexGuard<'_, Backlog> {
    backlog.lock().unwrap_or_else(PoisonError::into_inner)
}

/// One consuming channel: its prefetch, tag and the deliveries it holds unsettled.
#[derive(Default)]
struct Consuming {
    id: u16,
    tag: String,
    prefetch: u16,
    /// The last delivery tag handed out on this channel (tags count per channel, from 1).
    next_tag: u64,
    /// Delivery tags not yet settled, ascending.
    unsettled: Vec<u64>,
}

/// One connection's state, as far as the script needs it.
#[derive(Default)]
struct Connection {
    /// Prefetch set on each channel before its consume.
    prefetch: Vec<(u16, u16)>,
    consuming: Vec<Consuming>,
    /// Confirm-mode channels and their next publish sequence number.
    confirming: Vec<(u16, u64)>,
    closed: bool,
}

/// Serves one client until it closes: the handshake, then every frame answered in order.
async fn serve(mut stream: TcpStream, backlog: Shared) -> io::Result<()> {
    let mut header = [0u8; 8];
    stream.read_exact(&mut header).await?;
    let mut out = Vec::with_capacity(1 << 16);
    push(&mut out, 0, AMQPClass::Connection(start()));
    stream.write_all(&out).await?;
    out.clear();
    let (mut input, mut connection) = (Vec::with_capacity(1 << 16), Connection::default());
    // Keeps the client's heartbeat watch satisfied on a run slowed by valgrind; the first one
    // well after the handshake.
    let every = Duration::from_secs(5);
    let mut heartbeat = tokio::time::interval_at(tokio::time::Instant::now() + every, every);
    while !connection.closed {
        tokio::select! {
            read = stream.read_buf(&mut input) => {
                if read? == 0 {
                    return Ok(());
                }
            }
            _ = heartbeat.tick() => push_frame(&mut out, &AMQPFrame::Heartbeat),
        }
        let mut at = 0;
        while let Some(size) = whole_frame(&input[at..]) {
            let frame = match parse_frame(&input[at..at + size]) {
                Ok((_, frame)) => frame,
                Err(err) => {
                    return Err(io::Error::new(io::ErrorKind::InvalidData, err.to_string()));
                }
            };
            at += size;
            connection.answer(frame, &backlog, &mut out);
        }
        input.drain(..at);
        if !out.is_empty() {
            stream.write_all(&out).await?;
            out.clear();
        }
    }
    Ok(())
}

/// The length of the whole frame at the start of `input`, if it is all there.
fn whole_frame(input: &[u8]) -> Option<usize> {
    let size = u32::from_be_bytes(input.get(3..7)?.try_into().ok()?);
    let whole = 7 + usize::try_from(size).ok()? + 1;
    (input.len() >= whole).then_some(whole)
}

impl Connection {
    /// Answers one frame from the client, and delivers whatever credit it freed.
    fn answer(&mut self, frame: AMQPFrame, backlog: &Shared, out: &mut Vec<u8>) {
        let AMQPFrame::Method(id, class) = frame else {
            // Heartbeats, and the header and body of a publish (confirmed at its method).
            return;
        };
        let reply = match class {
            AMQPClass::Connection(method) => match method {
                connection::AMQPMethod::StartOk(_) => Some(AMQPClass::Connection(
                    connection::AMQPMethod::Tune(connection::Tune {
                        channel_max: 2047,
                        frame_max: 131_072,
                        heartbeat: 60,
                    }),
                )),
                connection::AMQPMethod::Open(_) => Some(AMQPClass::Connection(
                    connection::AMQPMethod::OpenOk(connection::OpenOk {}),
                )),
                connection::AMQPMethod::Close(_) => {
                    self.closed = true;
                    Some(AMQPClass::Connection(connection::AMQPMethod::CloseOk(
                        connection::CloseOk {},
                    )))
                }
                _ => None,
            },
            AMQPClass::Channel(method) => match method {
                channel::AMQPMethod::Open(_) => Some(AMQPClass::Channel(
                    channel::AMQPMethod::OpenOk(channel::OpenOk {}),
                )),
                channel::AMQPMethod::Close(_) => {
                    self.forget(id);
                    Some(AMQPClass::Channel(channel::AMQPMethod::CloseOk(
                        channel::CloseOk {},
                    )))
                }
                _ => None,
            },
            AMQPClass::Exchange(exchange::AMQPMethod::Declare(declare)) => (!declare.nowait)
                .then_some(AMQPClass::Exchange(exchange::AMQPMethod::DeclareOk(
                    exchange::DeclareOk {},
                ))),
            AMQPClass::Exchange(exchange::AMQPMethod::Bind(bind)) => (!bind.nowait).then_some(
                AMQPClass::Exchange(exchange::AMQPMethod::BindOk(exchange::BindOk {})),
            ),
            AMQPClass::Queue(queue::AMQPMethod::Declare(declare)) => {
                let left = {
                    let backlog = lock(backlog);
                    backlog.messages - backlog.tally.delivered
                };
                (!declare.nowait).then(|| {
                    AMQPClass::Queue(queue::AMQPMethod::DeclareOk(queue::DeclareOk {
                        queue: declare.queue,
                        message_count: u32::try_from(left).unwrap_or(u32::MAX),
                        consumer_count: 0,
                    }))
                })
            }
            AMQPClass::Queue(queue::AMQPMethod::Bind(bind)) => (!bind.nowait).then_some(
                AMQPClass::Queue(queue::AMQPMethod::BindOk(queue::BindOk {})),
            ),
            AMQPClass::Confirm(confirm::AMQPMethod::Select(select)) => {
                self.confirming.push((id, 1));
                (!select.nowait).then_some(AMQPClass::Confirm(confirm::AMQPMethod::SelectOk(
                    confirm::SelectOk {},
                )))
            }
            AMQPClass::Basic(method) => self.basic(id, method, backlog),
            _ => None,
        };
        if let Some(reply) = reply {
            push(out, id, reply);
        }
        self.deliver(backlog, out);
    }

    fn basic(&mut self, id: u16, method: basic::AMQPMethod, backlog: &Shared) -> Option<AMQPClass> {
        let reply = match method {
            basic::AMQPMethod::Qos(qos) => {
                self.prefetch.retain(|&(channel, _)| channel != id);
                self.prefetch.push((id, qos.prefetch_count));
                basic::AMQPMethod::QosOk(basic::QosOk {})
            }
            basic::AMQPMethod::Consume(consume) => {
                let tag = match consume.consumer_tag.as_str() {
                    "" => format!("peer-{id}"),
                    tag => tag.to_owned(),
                };
                let prefetch = self.prefetch.iter().find(|&&(c, _)| c == id);
                self.consuming.push(Consuming {
                    id,
                    tag: tag.clone(),
                    prefetch: prefetch.map_or(0, |&(_, p)| p),
                    ..Consuming::default()
                });
                if consume.nowait {
                    return None;
                }
                basic::AMQPMethod::ConsumeOk(basic::ConsumeOk {
                    consumer_tag: tag.into(),
                })
            }
            basic::AMQPMethod::Cancel(cancel) => {
                self.forget(id);
                if cancel.nowait {
                    return None;
                }
                basic::AMQPMethod::CancelOk(basic::CancelOk {
                    consumer_tag: cancel.consumer_tag,
                })
            }
            basic::AMQPMethod::Ack(ack) => {
                let settled = self.settle(id, ack.delivery_tag, ack.multiple);
                lock(backlog).tally.acked += settled;
                return None;
            }
            basic::AMQPMethod::Nack(nack) => {
                let settled = self.settle(id, nack.delivery_tag, nack.multiple);
                lock(backlog).tally.refused += settled;
                return None;
            }
            basic::AMQPMethod::Reject(reject) => {
                let settled = self.settle(id, reject.delivery_tag, false);
                lock(backlog).tally.refused += settled;
                return None;
            }
            basic::AMQPMethod::Publish(_) => {
                let sequence = self.confirming.iter_mut().find(|(c, _)| *c == id)?;
                let tag = sequence.1;
                sequence.1 += 1;
                basic::AMQPMethod::Ack(basic::Ack {
                    delivery_tag: tag,
                    multiple: false,
                })
            }
            _ => return None,
        };
        Some(AMQPClass::Basic(reply))
    }

    /// Settles `tag` (and every earlier one when `multiple`) on channel `id`; how many.
    fn settle(&mut self, id: u16, tag: u64, multiple: bool) -> u64 {
        let Some(consuming) = self.consuming.iter_mut().find(|c| c.id == id) else {
            return 0;
        };
        let before = consuming.unsettled.len();
        if multiple {
            consuming.unsettled.retain(|&t| t > tag);
        } else {
            consuming.unsettled.retain(|&t| t != tag);
        }
        (before - consuming.unsettled.len()) as u64
    }

    /// Ends the consume on channel `id`. What it held unsettled stays delivered: the gate's
    /// consumers settle everything, and the tally shows it when one does not.
    fn forget(&mut self, id: u16) {
        self.consuming.retain(|c| c.id != id);
    }

    /// Fills every consumer's free prefetch from the backlog.
    fn deliver(&mut self, backlog: &Shared, out: &mut Vec<u8>) {
        let mut backlog = lock(backlog);
        for consuming in &mut self.consuming {
            let free = usize::from(consuming.prefetch).saturating_sub(consuming.unsettled.len());
            for _ in 0..free {
                if backlog.tally.delivered == backlog.messages {
                    return;
                }
                let number = backlog.tally.delivered;
                backlog.tally.delivered += 1;
                consuming.next_tag += 1;
                consuming.unsettled.push(consuming.next_tag);
                delivery(out, consuming, number, &backlog.body);
            }
        }
    }
}

/// The three frames of one delivery.
fn delivery(out: &mut Vec<u8>, consuming: &Consuming, number: u64, body: &[u8]) {
    let deliver = basic::AMQPMethod::Deliver(basic::Deliver {
        consumer_tag: consuming.tag.as_str().into(),
        delivery_tag: consuming.next_tag,
        redelivered: false,
        exchange: "".into(),
        routing_key: "orders".into(),
    });
    push(out, consuming.id, AMQPClass::Basic(deliver));
    let mut headers = FieldTable::default();
    headers.insert("schema-version".into(), AMQPValue::LongUInt(1));
    let properties = AMQPProperties::default()
        .with_message_id(ShortString::from(format!("m-{number}")))
        .with_type("order.placed".into())
        .with_content_type("application/json".into())
        .with_delivery_mode(2)
        .with_timestamp(1_765_000_000)
        .with_headers(headers);
    let header = AMQPContentHeader {
        class_id: 60,
        body_size: body.len() as u64,
        properties,
    };
    push_frame(out, &AMQPFrame::Header(consuming.id, header));
    push_frame(out, &AMQPFrame::Body(consuming.id, body.to_vec()));
}

fn start() -> connection::AMQPMethod {
    let mut properties = FieldTable::default();
    properties.insert(
        "product".into(),
        AMQPValue::LongString(LongString::from("lily-regress peer")),
    );
    connection::AMQPMethod::Start(connection::Start {
        version_major: 0,
        version_minor: 9,
        server_properties: properties,
        mechanisms: LongString::from("PLAIN"),
        locales: LongString::from("en_US"),
    })
}

fn push(out: &mut Vec<u8>, channel: u16, class: AMQPClass) {
    push_frame(out, &AMQPFrame::Method(channel, class));
}

fn push_frame(out: &mut Vec<u8>, frame: &AMQPFrame) {
    let taken = std::mem::take(out);
    *out = gen_frame(frame)(WriteContext::from(taken))
        .expect("a frame encodes into a Vec")
        .write;
}
