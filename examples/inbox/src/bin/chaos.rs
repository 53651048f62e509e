//! `chaos`: a seeded soak of the `inbox` service under faults, reconciled by message id from
//! outside Lily.
//!
//! It runs `inbox serve` workers as child processes under a supervisor that restarts them as
//! Kubernetes would, publishes orders with stable ids (exact duplicates, same-id conflicts and
//! orders for an unknown sku among them) at a steady rate, and meanwhile injects faults on a
//! seeded schedule: SIGKILL of a worker, SIGTERM of a worker, every connection closed by the
//! broker, a memory alarm, the DLQ deleted for a while, the broker's app stopped and started,
//! mongod restarted, the workers' network to the broker stalled (nothing closed), publisher
//! confirms nacked by the retry buckets and the DLQ (a policy with `max-length` 0 and
//! `overflow: reject-publish`), and the consumers cancelled by the broker (the work queue
//! deleted and declared again). With `--mongo set` it runs against the three-member replica
//! set instead of the single node: the set's primary is also SIGKILLed and stepped down, and
//! mongod's restart restarts every member. One order in 25 fails its first attempt, so retry
//! buckets are always in use. Then it lets the workers drain, stops them, and checks by id:
//!
//! - every order for a known sku has exactly one ledger entry and no DLQ copy;
//! - an order for the unknown sku has no ledger entry and its DLQ copy (`unknown sku`);
//! - an id published with two bodies has one ledger entry (for one of them) and a DLQ copy
//!   (`inbox conflict`) for the other;
//! - a DLQ copy may exist twice (an ACK lost after its confirm): counted, not a violation;
//! - stock levels equal what was seeded minus the ledger;
//! - nothing else is in the DLQ, the parking lane, the work queue or a retry bucket;
//! - no shutdown report lists a delivery as unresolved that the database does not explain;
//! - the outbox: each reservation staged one event (`<id>.entry`) in its transaction, which the
//!   workers' relays published: every ledger entry has exactly one outbox record, marked sent,
//!   no record exists without a ledger entry (an aborted transaction staged nothing), and a
//!   Lily consumer downstream of the events queue, with an inbox of its own, has exactly one
//!   effect per event; the events queue and its DLQ end empty.
//!
//! It prints the figures and exits 1, naming each violated id, when anything does not hold.
//!
//! ```text
//! chaos --service target/debug/inbox --messages 2000 --seed 7 --workers 3 --rate 400 --min-each 1 \
//!   --queue-type quorum
//! ```
//!
//! The broker and mongod are the ones `scripts/test.sh` starts (`LILY_AMQP_URL`,
//! `LILY_RABBIT_DIR`, `LILY_MONGO_URL` or, with `--mongo set`, `LILY_MONGO_SET_URL` and
//! `LILY_MONGOD_SET_DIR`): faults use `rabbitmqctl` on that node. To see what
//! the workers did, set `LILY_CHAOS_LOG_DIR` (each worker's log is written there when it exits)
//! and `LILY_CHAOS_RUST_LOG` (their filter, `warn` by default).

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};

use lily::headers::as_text;
use lily::publish::{Destination, Outgoing, Publisher};
use lily::topology::{QueueKind, Topology, TopologyMode};
use lily_mq_mongo::mongodb::bson::{Bson, Document, doc};
use lily_mq_mongo::mongodb::{self, Database};
use lily_mq_testkit::{Broker, ChildProcess, Client, MongoNode, MongoSet, TcpProxy};
use tokio::process::Command;
use tokio::sync::RwLock;

const SKUS: [&str; 4] = ["SKU-A", "SKU-B", "SKU-C", "SKU-D"];
const UNKNOWN_SKU: &str = "SKU-NONE";

/// What the soak is asked to do.
struct Args {
    service: PathBuf,
    messages: usize,
    seed: u64,
    workers: usize,
    /// Orders published per second.
    rate: u32,
    /// Orders published back to back, then a pause that keeps the rate: failures then come
    /// together and their handoffs share batches.
    burst: u32,
    /// One order in this many fails its first attempt (`INBOX_FLAKY_ONE_IN`).
    flaky_one_in: u32,
    /// One order in this many is for the unknown sku (a permanent failure: a DLQ copy).
    unknown_one_in: u64,
    /// Time between two faults.
    fault_every: Duration,
    /// Faults of each kind at least, publishing or not.
    min_each: u32,
    /// The type of the work queue and its companions.
    kind: QueueKind,
    /// The kinds of fault injected, in turn.
    faults: Vec<Fault>,
    /// Up to this much more between two faults, drawn from the seed.
    fault_jitter: Duration,
    /// The skus orders are for (their stock documents: the keys their transactions contend on).
    skus: &'static [&'static str],
    /// The database: the single node, or the three-member set (`--mongo set`), whose primary
    /// the faults kill and step down.
    mongo: Mongo,
    /// A kill storm: every order valid and sent once (no duplicates, conflicts, unknown skus or
    /// first attempts that fail), the workers at the library's own requeue limit and a 10 s
    /// lease, only SIGKILLs; no order may reach the DLQ or parking lane, and every effect must
    /// be done within [`STORM_SETTLED_WITHIN`] of the last kill.
    storm: bool,
}

/// How soon after the storm's last kill every order's effect must be done.
const STORM_SETTLED_WITHIN: Duration = Duration::from_secs(120);

/// Failed injections of one kind after which the soak stops insisting on it.
const REFUSALS: u32 = 5;
/// The workers' `LILY_MAX_REQUEUES`: deferrals wait on a dead worker's lease and on its
/// abandoned transaction (mongod's lifetime limit), from 250 ms growing to 2 s.
const MAX_REQUEUES: u32 = 400;
/// The retry delays of the inbox service.
const RETRY_DELAYS: [Duration; 2] = [Duration::from_secs(1), Duration::from_secs(5)];

impl Args {
    fn parse() -> Result<Self, String> {
        let mut args = Self {
            service: PathBuf::from("target/debug/inbox"),
            messages: 2000,
            seed: 1,
            workers: 3,
            rate: 400,
            burst: 1,
            flaky_one_in: 25,
            unknown_one_in: 50,
            fault_every: Duration::from_millis(1500),
            min_each: 1,
            kind: QueueKind::Classic,
            faults: FAULTS.to_vec(),
            fault_jitter: Duration::ZERO,
            skus: &SKUS,
            mongo: Mongo::Node,
            storm: false,
        };
        let mut it = std::env::args().skip(1);
        while let Some(flag) = it.next() {
            let value = it.next().ok_or_else(|| format!("{flag} needs a value"))?;
            let number = || {
                value
                    .parse::<u64>()
                    .map_err(|_| format!("{flag}: not a number"))
            };
            match flag.as_str() {
                "--service" => args.service = PathBuf::from(&value),
                "--messages" => args.messages = number()? as usize,
                "--seed" => args.seed = number()?,
                "--workers" => args.workers = number()?.max(1) as usize,
                "--rate" => args.rate = u32::try_from(number()?.max(1)).unwrap_or(u32::MAX),
                "--flaky-one-in" => args.flaky_one_in = u32::try_from(number()?).unwrap_or(0),
                "--unknown-one-in" => args.unknown_one_in = number()?.max(1),
                "--burst" => args.burst = u32::try_from(number()?.max(1)).unwrap_or(u32::MAX),
                "--fault-every-ms" => args.fault_every = Duration::from_millis(number()?.max(100)),
                "--min-each" => args.min_each = u32::try_from(number()?).unwrap_or(u32::MAX),
                "--fault-jitter-ms" => args.fault_jitter = Duration::from_millis(number()?),
                // Leaked once: the names live as long as the soak.
                "--skus" => {
                    let names = (0..number()?.max(1)).map(|i| &*format!("SKU-{i}").leak());
                    args.skus = names.collect::<Vec<_>>().leak();
                }
                "--storm" => {
                    args.storm = value == "on";
                    if args.storm {
                        args.faults = vec![Fault::KillWorker];
                        args.flaky_one_in = 0;
                        args.unknown_one_in = u64::MAX;
                        args.min_each = 0;
                    }
                }
                "--mongo" => {
                    args.mongo = match value.as_str() {
                        "node" => Mongo::Node,
                        "set" => Mongo::Set,
                        _ => return Err("--mongo: node or set".into()),
                    };
                    if args.mongo == Mongo::Set && args.faults == FAULTS {
                        args.faults.extend(SET_FAULTS);
                    }
                }
                "--faults" => {
                    args.faults = value
                        .split(',')
                        .map(|name| {
                            FAULTS
                                .into_iter()
                                .chain(SET_FAULTS)
                                .find(|f| format!("{f:?}").eq_ignore_ascii_case(name))
                                .ok_or_else(|| format!("--faults: no fault named {name}"))
                        })
                        .collect::<Result<_, _>>()?;
                }
                "--queue-type" => {
                    args.kind = match value.as_str() {
                        "classic" => QueueKind::Classic,
                        "quorum" => QueueKind::Quorum,
                        _ => return Err("--queue-type: classic or quorum".into()),
                    }
                }
                other => return Err(format!("unknown flag {other}")),
            }
        }
        Ok(args)
    }
}

/// A small deterministic generator (xorshift64*): the same seed gives the same run plan.
struct Rng(u64);

impl Rng {
    fn new(seed: u64) -> Self {
        Self(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }

    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

/// One publish of the plan.
#[derive(Clone, Debug)]
struct Order {
    id: String,
    sku: &'static str,
    quantity: i64,
}

impl Order {
    fn body(&self) -> Vec<u8> {
        serde_json::json!({ "order_id": self.id, "sku": self.sku, "quantity": self.quantity })
            .to_string()
            .into_bytes()
    }
}

/// Every publish, in order: each id once, then exact duplicates and conflicting bodies of some.
fn plan(args: &Args) -> Vec<Order> {
    let mut rng = Rng::new(args.seed);
    let mut orders: Vec<Order> = (0..args.messages)
        .map(|i| Order {
            id: format!("order-{i}"),
            sku: if rng.below(args.unknown_one_in) == 0 {
                UNKNOWN_SKU
            } else if args.skus.len() >= args.messages {
                // One key per order.
                args.skus[i % args.skus.len()]
            } else {
                args.skus[rng.below(args.skus.len() as u64) as usize]
            },
            quantity: 1,
        })
        .collect();
    let mut extra = Vec::new();
    for order in orders.iter().filter(|_| !args.storm) {
        match rng.below(40) {
            0 | 1 => extra.push(order.clone()),
            2 if order.sku != UNKNOWN_SKU => extra.push(Order {
                quantity: 2,
                ..order.clone()
            }),
            _ => {}
        }
    }
    // The extras interleave with the rest, later than their first copy on the whole.
    for order in extra {
        let at = orders.len() / 2 + rng.below((orders.len() / 2) as u64 + 1) as usize;
        orders.insert(at.min(orders.len()), order);
    }
    orders
}

/// A worker slot: the process running in it, and the reports of those that exited.
struct Slot {
    process: Option<ChildProcess>,
    starts: u32,
}

struct Supervisor {
    service: PathBuf,
    /// The workers reach the broker through it.
    network: TcpProxy,
    queue: String,
    kind: QueueKind,
    flaky_one_in: u32,
    /// The workers' `LILY_MAX_REQUEUES` and `LILY_LEASE_TTL_MS`.
    max_requeues: u32,
    lease_ttl_ms: u32,
    /// The workers' `LILY_DEFERRAL_MAX_MS`.
    deferral_max_ms: u32,
    database: String,
    /// The queue the workers' outbox relays publish events to.
    events: String,
    mongo: Mongo,
    slots: Vec<Slot>,
    reports: Vec<serde_json::Value>,
    exits: BTreeMap<String, u32>,
}

impl Supervisor {
    fn start(&mut self, slot: usize) {
        let broker = Broker::from_env();
        let mut command = Command::new(&self.service);
        command
            .arg("serve")
            .env("LILY_AMQP_URL", self.network.url(broker.url()))
            .env("LILY_MONGO_URL", self.mongo.url())
            .env("LILY_MONGO_DB", &self.database)
            .env("LILY_QUEUE", &self.queue)
            .env("LILY_PREFETCH", "10")
            .env("LILY_LEASE_TTL_MS", self.lease_ttl_ms.to_string())
            .env("LILY_DEFERRAL_MS", "250")
            .env("LILY_DEFERRAL_MAX_MS", self.deferral_max_ms.to_string())
            .env("LILY_MAX_REQUEUES", self.max_requeues.to_string())
            .env(
                "LILY_QUEUE_TYPE",
                match self.kind {
                    QueueKind::Classic => "classic",
                    QueueKind::Quorum => "quorum",
                },
            )
            .env("INBOX_FLAKY_ONE_IN", self.flaky_one_in.to_string())
            .env("LILY_EVENTS", &self.events)
            .env(
                "RUST_LOG",
                std::env::var("LILY_CHAOS_RUST_LOG").unwrap_or_else(|_| "warn".into()),
            )
            .env_remove("INBOX_FAULT");
        self.slots[slot].process = Some(ChildProcess::spawn(command));
        self.slots[slot].starts += 1;
    }

    /// Restarts every worker that exited, keeping the report it printed.
    async fn restart_exited(&mut self) {
        for slot in 0..self.slots.len() {
            let exited = match self.slots[slot].process.as_mut() {
                Some(process) => process.try_exit(),
                None => None,
            };
            if let Some(status) = exited {
                let mut process = self.slots[slot].process.take().expect("process");
                self.record_exit(&mut process, status).await;
                self.start(slot);
            }
        }
    }

    async fn record_exit(&mut self, process: &mut ChildProcess, status: std::process::ExitStatus) {
        let how = match (
            status.code(),
            std::os::unix::process::ExitStatusExt::signal(&status),
        ) {
            (Some(code), _) => format!("exit {code}"),
            (None, Some(signal)) => format!("signal {signal}"),
            _ => "unknown".to_owned(),
        };
        *self.exits.entry(how).or_default() += 1;
        if let Some(dir) = std::env::var_os("LILY_CHAOS_LOG_DIR") {
            let n = self.exits.values().sum::<u32>();
            let _ = std::fs::write(
                std::path::Path::new(&dir).join(format!("worker-{n}.log")),
                process.log(),
            );
        }
        let text = process.stdout().await;
        if let Ok(report) = serde_json::from_str::<serde_json::Value>(&text) {
            self.reports.push(report);
        }
    }

    fn signal(&self, slot: usize, name: &str) {
        if let Some(process) = &self.slots[slot].process {
            process.signal(name);
        }
    }

    /// SIGTERM to every worker; waits for them and keeps their reports.
    async fn stop_all(&mut self) {
        for slot in 0..self.slots.len() {
            self.signal(slot, "TERM");
        }
        for slot in 0..self.slots.len() {
            if let Some(mut process) = self.slots[slot].process.take() {
                let (status, _) = process.exit(Duration::from_secs(60)).await;
                self.record_exit(&mut process, status).await;
            }
        }
    }
}

/// The faults, drawn in turn from the seed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Fault {
    KillWorker,
    TermWorker,
    CloseConnections,
    MemoryAlarm,
    DlqGone,
    BrokerRestart,
    MongodRestart,
    StalledNetwork,
    NackedConfirms,
    ConsumerCancel,
    /// SIGKILL of the set's primary (`--mongo set`), started again once another is primary.
    PrimaryKill,
    /// `replSetStepDown` of the set's primary (`--mongo set`).
    StepDown,
}

/// The faults of the three-member set, added to [`FAULTS`] by `--mongo set`.
const SET_FAULTS: [Fault; 2] = [Fault::PrimaryKill, Fault::StepDown];

/// Which MongoDB the soak and its workers use.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Mongo {
    /// The single-member replica set (`LILY_MONGO_URL`, `LILY_MONGOD_DIR`).
    Node,
    /// The three-member replica set (`LILY_MONGO_SET_URL`, `LILY_MONGOD_SET_DIR`).
    Set,
}

impl Mongo {
    fn url(self) -> String {
        match self {
            Self::Node => MongoNode::from_env().url().to_owned(),
            Self::Set => MongoSet::from_env().url().to_owned(),
        }
    }
}

const FAULTS: [Fault; 10] = [
    Fault::KillWorker,
    Fault::TermWorker,
    Fault::CloseConnections,
    Fault::MemoryAlarm,
    Fault::DlqGone,
    Fault::BrokerRestart,
    Fault::MongodRestart,
    Fault::StalledNetwork,
    Fault::NackedConfirms,
    Fault::ConsumerCancel,
];

/// DLQ copies by id, with their reasons.
type Dead = BTreeMap<String, Vec<String>>;

/// What the soak takes out of the broker before a fault could destroy it, and at the end.
#[derive(Default)]
struct Books {
    /// The DLQ's copies (deleting the DLQ deletes them).
    dead: Dead,
    /// Deliveries by id from the firehose (its messages are transient: a broker restart drops
    /// them).
    deliveries: BTreeMap<String, Delivered>,
}

/// Injects `fault`; returns false when it could not be (the queues never came to rest for a
/// consumer cancel or a DLQ deletion).
async fn inject(
    fault: Fault,
    rng: &mut Rng,
    broker: &Broker,
    supervisor: &mut Supervisor,
    books: &mut Books,
    publishing: &RwLock<()>,
) -> bool {
    let queue = supervisor.queue.clone();
    let queue = queue.as_str();
    let slot = rng.below(supervisor.slots.len() as u64) as usize;
    match fault {
        Fault::KillWorker => supervisor.signal(slot, "KILL"),
        Fault::TermWorker => supervisor.signal(slot, "TERM"),
        Fault::CloseConnections => {
            broker.ctl(&[
                "close_all_connections",
                "-p",
                "/",
                "chaos: connections closed",
            ]);
        }
        Fault::MemoryAlarm => {
            broker.ctl(&["set_vm_memory_high_watermark", "absolute", "1"]);
            tokio::time::sleep(Duration::from_millis(1500)).await;
            broker.ctl(&["set_vm_memory_high_watermark", "0.4"]);
        }
        Fault::BrokerRestart => {
            let client = Client::connect(broker.url()).await;
            drain_trace(&client, &format!("{queue}.trace"), &mut books.deliveries).await;
            drop(client);
            broker.ctl(&["stop_app"]);
            tokio::time::sleep(Duration::from_secs(2)).await;
            broker.start_app();
            // The firehose is runtime state: on again.
            broker.ctl(&["trace_on", "-p", "/"]);
        }
        Fault::MongodRestart => match supervisor.mongo {
            Mongo::Node => restart_mongod(),
            Mongo::Set => restart_set().await,
        },
        Fault::PrimaryKill => {
            let set = MongoSet::from_env();
            let primary = set.await_primary(Duration::from_secs(60)).await;
            set.kill(primary);
            set.await_primary(Duration::from_secs(60)).await;
            set.start(primary);
        }
        Fault::StepDown => {
            MongoSet::from_env().step_down(5).await;
        }
        Fault::StalledNetwork => {
            // Nothing is closed: only timeouts and heartbeats can notice.
            supervisor.network.stall(true);
            tokio::time::sleep(Duration::from_secs(3)).await;
            supervisor.network.stall(false);
        }
        Fault::DlqGone => {
            // What the DLQ holds is kept first: deleting it deletes its messages. Nothing may
            // arrive between the drain and the delete, so the workers are let come to rest
            // first; the orders published meanwhile find the DLQ gone.
            let paused = publishing.write().await;
            if !at_rest(broker, supervisor).await {
                return false;
            }
            let dlq = format!("{queue}.dlq");
            let client = Client::connect(broker.url()).await;
            drain_dead(&client, &dlq, &mut books.dead).await;
            client.delete(&dlq).await;
            drop(paused);
            tokio::time::sleep(Duration::from_secs(2)).await;
            declare_topology(broker.url(), queue, supervisor.kind).await;
        }
        Fault::NackedConfirms => {
            // Every publish to a retry bucket or the DLQ is refused with a `basic.nack`. The
            // overflow comes first: a classic queue given `max-length` while its overflow is
            // still `drop-head` drops what it holds above the limit, and these hold copies
            // whose originals were ACKed.
            let pattern = format!("^{}\\.(retry\\..+|dlq)$", regex_escape(queue));
            for definition in [
                r#"{"overflow":"reject-publish"}"#,
                r#"{"max-length":0,"overflow":"reject-publish"}"#,
            ] {
                broker.ctl(&[
                    "set_policy",
                    "--apply-to",
                    "queues",
                    "--priority",
                    "10",
                    "chaos-nack",
                    &pattern,
                    definition,
                ]);
            }
            tokio::time::sleep(Duration::from_secs(2)).await;
            broker.ctl(&["clear_policy", "chaos-nack"]);
        }
        Fault::ConsumerCancel => {
            let _paused = publishing.write().await;
            return cancel_consumers(broker, supervisor).await;
        }
    }
    true
}

/// With the publisher paused (no publish unconfirmed), waits until the work queue and the
/// retry buckets (which dead-letter into it) hold nothing, ready or unacknowledged, twice in a
/// row 200 ms apart: then no worker holds a delivery, no copy can be published and none is on
/// its way from a bucket. Returns false if that did not happen within 30 s.
async fn at_rest(broker: &Broker, supervisor: &mut Supervisor) -> bool {
    let queue = supervisor.queue.clone();
    let topology = Topology::new(&queue, supervisor.kind, &RETRY_DELAYS);
    let mut watched = vec![queue];
    watched.extend(topology.buckets().map(|(name, _)| name.to_owned()));
    let by = Instant::now() + Duration::from_secs(30);
    let mut empty_before = false;
    while Instant::now() < by {
        supervisor.restart_exited().await;
        let depths = broker.depths();
        let empty = watched.iter().all(|q| depths.get(q) == Some(&0));
        if empty && empty_before {
            return true;
        }
        empty_before = empty;
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    false
}

/// Deletes the work queue, so the broker cancels every consumer (`basic.cancel`), and declares
/// it again. Deleting a queue destroys what it holds, which no consumer can prevent: it is
/// deleted only at rest (see [`at_rest`]); on a classic queue `if-empty` refuses the delete
/// should a message arrive in between. Returns false if it was not deleted. The publisher is
/// paused by the caller.
async fn cancel_consumers(broker: &Broker, supervisor: &mut Supervisor) -> bool {
    let queue = supervisor.queue.clone();
    let deleted = at_rest(broker, supervisor).await
        && delete_queue(broker.url(), &queue, supervisor.kind).await;
    if deleted {
        declare_topology(broker.url(), &queue, supervisor.kind).await;
    }
    deleted
}

/// Deletes `queue`, `if-empty` for a classic queue (quorum queues refuse the flag).
async fn delete_queue(url: &str, queue: &str, kind: QueueKind) -> bool {
    let Some((_connection, channel)) = open_channel(url).await else {
        return false;
    };
    let options = lapin::options::QueueDeleteOptions {
        if_empty: kind == QueueKind::Classic,
        ..lapin::options::QueueDeleteOptions::default()
    };
    channel.queue_delete(queue.into(), options).await.is_ok()
}

/// `text` with the regular expression metacharacters a queue name may hold escaped.
fn regex_escape(text: &str) -> String {
    text.chars()
        .flat_map(|c| {
            let escape = matches!(c, '.' | '-' | '+' | '*' | '?' | '(' | ')' | '[' | ']');
            escape.then_some('\\').into_iter().chain([c])
        })
        .collect()
}

/// The most deliveries of one id the soak accepts: redeliveries after faults and deferrals, and
/// each pass of a held copy, but nothing like a requeue hot loop.
const MAX_DELIVERIES: usize = 60;

/// Turns on RabbitMQ's firehose and binds a queue of its own to the work queue's deliveries;
/// returns that queue's name.
async fn trace_deliveries(broker: &Broker, queue: &str) -> String {
    broker.ctl(&["trace_on", "-p", "/"]);
    let trace = format!("{queue}.trace");
    let url = broker.url().to_owned();
    Client::connect(&url).await.declare(&trace, false).await;
    let (_connection, channel) = open_channel(&url).await.expect("trace channel");
    channel
        .queue_bind(
            trace.as_str().into(),
            "amq.rabbitmq.trace".into(),
            format!("deliver.{queue}").as_str().into(),
            lapin::options::QueueBindOptions::default(),
            lapin::types::FieldTable::default(),
        )
        .await
        .expect("bind the trace queue");
    trace
}

/// One id's deliveries, from the firehose.
#[derive(Default)]
struct Delivered {
    count: usize,
    /// How many deliveries of each kind: redelivered or not, the attempt, and the handoff id of
    /// a copy. A hot id's kinds tell a redelivery loop of one message from copies multiplying.
    kinds: BTreeMap<String, usize>,
}

/// Takes every message of the firehose's queue, counting deliveries by id.
async fn drain_trace(client: &Client, trace: &str, deliveries: &mut BTreeMap<String, Delivered>) {
    use lapin::types::AMQPValue;
    for message in client.drain(trace).await {
        let headers = message
            .delivery
            .properties
            .headers()
            .clone()
            .unwrap_or_default();
        let headers = headers.inner();
        let empty = lapin::types::FieldTable::default();
        let properties = match headers.get("properties") {
            Some(AMQPValue::FieldTable(p)) => p,
            _ => &empty,
        };
        let own = match properties.inner().get("headers") {
            Some(AMQPValue::FieldTable(h)) => h,
            _ => &empty,
        };
        let text = |table: &lapin::types::FieldTable, name: &str| {
            table.inner().get(name).map_or_else(
                || "-".to_owned(),
                |value| as_text(value).map_or_else(|| format!("{value:?}"), str::to_owned),
            )
        };
        let id = text(properties, "message_id");
        let kind = format!(
            "redelivered {} attempt {} copy {}",
            matches!(headers.get("redelivered"), Some(AMQPValue::Boolean(true))),
            own.inner()
                .get(lily::headers::ATTEMPT)
                .map_or_else(|| "-".to_owned(), |v| format!("{v:?}")),
            text(own, lily::headers::HANDOFF_ID),
        );
        let seen = deliveries.entry(id).or_default();
        seen.count += 1;
        *seen.kinds.entry(kind).or_default() += 1;
    }
}

/// The broker's deliveries of each id, from the firehose; an id delivered more than
/// [`MAX_DELIVERIES`] times is a violation, shown with its kinds of delivery.
async fn count_deliveries(
    broker: &Broker,
    client: &Client,
    trace: &str,
    deliveries: &mut BTreeMap<String, Delivered>,
) -> Vec<String> {
    broker.ctl(&["trace_off", "-p", "/"]);
    drain_trace(client, trace, deliveries).await;
    client.delete(trace).await;
    let total: usize = deliveries.values().map(|d| d.count).sum();
    let most = deliveries.iter().max_by_key(|(_, d)| d.count);
    println!(
        "deliveries (firehose): {total} for {} ids; most: {:?}",
        deliveries.len(),
        most.map(|(id, d)| (id, d.count))
    );
    deliveries
        .iter()
        .filter(|(_, d)| d.count > MAX_DELIVERIES)
        .map(|(id, d)| {
            let mut kinds: Vec<_> = d.kinds.iter().collect();
            kinds.sort_by_key(|(_, n)| std::cmp::Reverse(**n));
            let kinds: Vec<_> = kinds
                .iter()
                .take(8)
                .map(|(k, n)| format!("{n}× {k}"))
                .collect();
            format!("{id}: delivered {} times ({})", d.count, kinds.join("; "))
        })
        .collect()
}

/// Stops mongod and starts it again on its port and data directory, with the settings
/// `scripts/test.sh` gives it (a 10 s transaction lifetime unless `LILY_MONGOD_TXN_LIFETIME_S`
/// says otherwise, TLS when `LILY_TLS_DIR` is set); returns once it is a writable primary.
fn restart_mongod() {
    let node = MongoNode::from_env();
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/../../scripts/mongod.sh");
    let port = node
        .url()
        .rsplit_once(':')
        .and_then(|(_, rest)| rest.split(['/', '?']).next())
        .expect("a port in LILY_MONGO_URL")
        .to_owned();
    let dir = node.dir().to_string_lossy().into_owned();
    let run = |args: &[&str]| {
        let mut command = std::process::Command::new(script);
        command.args(args).env(
            "LILY_MONGOD_TXN_LIFETIME_S",
            std::env::var("LILY_MONGOD_TXN_LIFETIME_S").unwrap_or_else(|_| "10".to_owned()),
        );
        if let Ok(tls) = std::env::var("LILY_TLS_DIR") {
            command.env("LILY_MONGOD_TLS_DIR", tls);
        }
        let status = command.status().expect("run mongod.sh");
        assert!(status.success(), "mongod.sh {args:?} failed");
    };
    run(&["stop", &dir]);
    run(&["start", &dir, &port]);
}

/// Stops every member of the set (SIGTERM: the primary steps down, each quiesces) and starts
/// them again; returns once the set is whole.
async fn restart_set() {
    let set = MongoSet::from_env();
    std::thread::scope(|threads| {
        for member in 0..set.len() {
            let set = &set;
            threads.spawn(move || set.stop(member));
        }
    });
    for member in 0..set.len() {
        set.start(member);
    }
    set.await_healthy(Duration::from_secs(60)).await;
}

/// Takes every message of `dlq`, recording its id and reason.
async fn drain_dead(client: &Client, dlq: &str, dead: &mut Dead) {
    for message in client.drain(dlq).await {
        let properties = &message.delivery.properties;
        let id = properties
            .message_id()
            .as_ref()
            .map_or_else(String::new, |id| id.to_string());
        let reason = properties
            .headers()
            .as_ref()
            .and_then(|h| as_text(h.inner().get("x-lily-reason")?))
            .unwrap_or("(broker dead-lettered)")
            .to_owned();
        dead.entry(id).or_default().push(reason);
    }
}

/// The work queue's topology as the workers declare it (an operator's redeclare after a
/// deletion); failures are left to the workers, which declare it too.
async fn declare_topology(url: &str, queue: &str, kind: QueueKind) {
    let Some((_connection, channel)) = open_channel(url).await else {
        return;
    };
    let version = lily::topology::broker_version(url, None)
        .await
        .ok()
        .flatten();
    let topology = Topology::new(queue, kind, &RETRY_DELAYS)
        .delivery_limit(Some(MAX_REQUEUES.saturating_add(20)))
        .broker(version);
    let _ = topology.apply(&channel, TopologyMode::Declare).await;
}

async fn seed_stock(database: &Database, skus: &[&str], each: i64) {
    let stock = database.collection::<Document>("stock");
    let docs = skus
        .iter()
        .map(|sku| doc! { "_id": sku, "available": each });
    stock.insert_many(docs).await.expect("seed stock");
}

/// The queues of the work queue's topology that must end empty, with their depth now.
async fn leftovers(client: &Client, queue: &str) -> BTreeMap<String, u32> {
    let topology = Topology::new(queue, QueueKind::Classic, &RETRY_DELAYS);
    let mut names = vec![queue.to_owned(), topology.parking_queue()];
    names.extend(topology.buckets().map(|(name, _)| name.to_owned()));
    let mut left = BTreeMap::new();
    for name in names {
        let depth = client.depth(&name).await;
        if depth > 0 {
            left.insert(name, depth);
        }
    }
    left
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> ExitCode {
    let args = match Args::parse() {
        Ok(args) => args,
        Err(err) => {
            eprintln!("chaos: {err}");
            return ExitCode::from(2);
        }
    };
    // Stopped from outside (a test's timeout), it takes its workers with it: dropping the run
    // kills them, where they would otherwise outlive it, still consuming.
    let mut terminate = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        .expect("a SIGTERM handler");
    tokio::select! {
        code = run(args) => code,
        _ = terminate.recv() => {
            eprintln!("chaos: terminated; its workers killed");
            ExitCode::from(3)
        }
    }
}

/// The soak: workers, publisher and faults, the drain, then the check by id.
async fn run(args: Args) -> ExitCode {
    let started = Instant::now();
    // Each step on stderr, so a run that never ends shows where it is.
    let progress =
        |step: &str| eprintln!("chaos: {:7.1} s {step}", started.elapsed().as_secs_f64());
    let broker = Broker::from_env();
    let queue = Broker::unique("chaos");
    let database_name = MongoNode::database_name("chaos");
    let mongo = mongodb::Client::with_uri_str(args.mongo.url())
        .await
        .expect("mongo client");
    let database = mongo.database(&database_name);
    let orders = plan(&args);
    seed_stock(&database, args.skus, 10 * args.messages as i64).await;
    let events = format!("{queue}.events");
    let downstream = Downstream::start(broker.url(), &events, &args.mongo.url()).await;

    let mut supervisor = Supervisor {
        service: args.service.clone(),
        network: TcpProxy::start(broker.addr()).await,
        queue: queue.clone(),
        kind: args.kind,
        flaky_one_in: args.flaky_one_in,
        // The storm runs at the library's default requeue limit: deferrals and waits must not
        // need more. The other runs allow many (deferrals from 250 ms on 2 s leases).
        max_requeues: if args.storm { 5 } else { MAX_REQUEUES },
        lease_ttl_ms: if args.storm { 10_000 } else { 2_000 },
        // Requeues back off, as the library's default ladder does: a lane that refuses every
        // handoff for as long as an operator's policy stays (tens of seconds when
        // `rabbitmqctl` is slow on a loaded machine) redelivers its messages every 2 s, not
        // every 250 ms.
        deferral_max_ms: if args.storm { 250 } else { 2_000 },
        database: database_name.clone(),
        events: events.clone(),
        mongo: args.mongo,
        slots: (0..args.workers)
            .map(|_| Slot {
                process: None,
                starts: 0,
            })
            .collect(),
        reports: Vec::new(),
        exits: BTreeMap::new(),
    };
    for slot in 0..args.workers {
        supervisor.start(slot);
    }
    wait_declared(&broker, &queue).await;
    let trace = trace_deliveries(&broker, &queue).await;

    // Publish at the rate asked, while faults come every `fault_every`.
    // The publisher holds it for reading from each publish to its confirm; a fault that needs
    // the publisher paused takes it for writing.
    let publishing = Arc::new(RwLock::new(()));
    let publisher = {
        let (url, queue, orders, pace) = (
            broker.url().to_owned(),
            queue.clone(),
            orders.clone(),
            (args.rate, args.burst),
        );
        let gate = Arc::clone(&publishing);
        tokio::spawn(async move { publish(&url, &queue, &orders, pace, &gate).await })
    };
    let mut rng = Rng::new(args.seed ^ 0xFA17);
    let mut injected: BTreeMap<Fault, u32> = BTreeMap::new();
    let mut books = Books::default();
    let gap = |rng: &mut Rng| {
        let jitter = u64::try_from(args.fault_jitter.as_millis()).unwrap_or(u64::MAX);
        args.fault_every + Duration::from_millis(rng.below(jitter.saturating_add(1)))
    };
    let mut next_fault = Instant::now() + gap(&mut rng);
    let mut last_fault = Instant::now();
    let faults = &args.faults;
    let mut turn = rng.below(faults.len() as u64) as usize;
    // Faults go on while orders are published, and until each kind came `min_each` times.
    // A kind that could not be injected this many times in all is given up, as a violation.
    let mut refused: BTreeMap<Fault, u32> = BTreeMap::new();
    let wanting = |f: &Fault, injected: &BTreeMap<Fault, u32>, refused: &BTreeMap<Fault, u32>| {
        injected.get(f).copied().unwrap_or(0) < args.min_each
            && refused.get(f).copied().unwrap_or(0) < REFUSALS
    };
    let short = |injected: &BTreeMap<Fault, u32>, refused: &BTreeMap<Fault, u32>| {
        faults.iter().any(|f| wanting(f, injected, refused))
    };
    while !publisher.is_finished() || short(&injected, &refused) {
        supervisor.restart_exited().await;
        if Instant::now() >= next_fault {
            // Once every order is published, only the kinds still short come: the others would
            // keep the queues from coming to rest, which a DLQ deletion and a consumer cancel
            // wait for (on a loaded machine, for ever).
            let published = publisher.is_finished();
            let mut fault = faults[turn % faults.len()];
            for _ in 1..faults.len() {
                if !published || wanting(&fault, &injected, &refused) {
                    break;
                }
                turn += 1;
                fault = faults[turn % faults.len()];
            }
            turn += 1;
            let done = inject(
                fault,
                &mut rng,
                &broker,
                &mut supervisor,
                &mut books,
                &publishing,
            )
            .await;
            progress(&format!(
                "{fault:?}{}",
                if done { "" } else { " could not be injected" }
            ));
            *if done { &mut injected } else { &mut refused }
                .entry(fault)
                .or_default() += 1;
            last_fault = Instant::now();
            next_fault = last_fault + gap(&mut rng);
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let sent = publisher.await.expect("publisher");
    progress("published; draining");
    // The faults closed every connection, this one's too: a fresh one to inspect the queues.
    let client = Client::connect(broker.url()).await;

    // Drain: no more faults, workers restarted as they exit, until every queue is empty and
    // nothing is unacknowledged, seen twice a second apart (the broker's count of a quorum
    // queue can lag). Then the workers stop; should their shutdown put deliveries back (a
    // deferral still waiting), they start again and the drain goes on.
    let drain_by = Instant::now() + Duration::from_secs(180);
    loop {
        let mut empty_before = false;
        loop {
            supervisor.restart_exited().await;
            let left = leftovers(&client, &queue).await;
            // The relays publish what is staged, and downstream takes it.
            let relayed = staged(&database).await == 0 && broker.messages(&events) == 0;
            let empty = left.is_empty() && broker.messages(&queue) == 0 && relayed;
            if empty && empty_before {
                break;
            }
            empty_before = empty;
            if Instant::now() > drain_by {
                eprintln!("chaos: not drained after 180 s: {left:?}");
                break;
            }
            tokio::time::sleep(Duration::from_secs(1)).await;
        }
        supervisor.stop_all().await;
        let staged = staged(&database).await;
        if Instant::now() > drain_by || (leftovers(&client, &queue).await.is_empty() && staged == 0)
        {
            break;
        }
        for slot in 0..supervisor.slots.len() {
            supervisor.start(slot);
        }
    }

    let settled_after_last_fault = last_fault.elapsed();
    let downstream = downstream.stop().await;
    progress("drained; checking by id");
    drain_dead(&client, &format!("{queue}.dlq"), &mut books.dead).await;
    let mut violations = count_deliveries(&broker, &client, &trace, &mut books.deliveries).await;
    violations.extend(
        check(
            &args,
            &sent,
            &books,
            &client,
            &queue,
            &database,
            &supervisor,
        )
        .await,
    );
    violations.extend(check_outbox(&client, &database, &events, &downstream).await);
    if args.storm {
        println!(
            "storm: every queue drained {:.1} s after the last kill",
            settled_after_last_fault.as_secs_f64()
        );
        if settled_after_last_fault > STORM_SETTLED_WITHIN {
            violations.push(format!(
                "storm: drained {:.1} s after the last kill, past {} s",
                settled_after_last_fault.as_secs_f64(),
                STORM_SETTLED_WITHIN.as_secs()
            ));
        }
    }
    for &fault in faults {
        if injected.get(&fault).copied().unwrap_or(0) < args.min_each {
            violations.push(format!(
                "{fault:?}: injected fewer than {} times",
                args.min_each
            ));
        }
    }
    println!(
        "faults: {injected:?}; could not inject: {refused:?}; worker exits: {:?}; took {:.1} s",
        supervisor.exits,
        started.elapsed().as_secs_f64()
    );
    let _ = database.drop().await;
    let _ = downstream.database.drop().await;
    if violations.is_empty() {
        println!("chaos: every id accounted for");
        ExitCode::SUCCESS
    } else {
        for violation in &violations {
            println!("VIOLATION {violation}");
        }
        ExitCode::FAILURE
    }
}

/// Outbox records still staged.
async fn staged(database: &Database) -> u64 {
    database
        .collection::<Document>("lily_outbox")
        .count_documents(doc! { "state": "staged" })
        .await
        .unwrap_or(u64::MAX)
}

/// A Lily consumer of the workers' events with an inbox of its own: one effect per event id.
/// It connects to the broker directly, so the broker's faults reach it, the workers' network
/// stalls do not.
struct Downstream {
    shutdown: lily::shutdown::Shutdown,
    join: tokio::task::JoinHandle<Result<lily::shutdown::ShutdownReport, lily::Error>>,
    database: Database,
}

/// What downstream left: its database and its shutdown report.
struct Downstreamed {
    database: Database,
    report: Option<lily::shutdown::ShutdownReport>,
}

impl Downstream {
    async fn start(amqp_url: &str, events: &str, mongo_url: &str) -> Self {
        use lily::consumer::{Consumer, ConsumerConfig};
        use lily_mq_mongo::{MongoConfig, MongoScope, MongoTx};
        let name = MongoNode::database_name("chaos-down");
        let scope = MongoScope::connect(mongo_url, &name, MongoConfig::new("downstream"))
            .await
            .expect("downstream scope");
        let database = scope.database().clone();
        let router = lily::prelude::Router::new().route(
            "ledger.entry",
            |tx: MongoTx, meta: lily::prelude::Meta| async move {
                tx.database()
                    .collection::<Document>("effects")
                    .insert_one(doc! { "message_id": meta.message_id() })
                    .session(&mut *tx.session().await)
                    .await
                    .map_err(|e| lily_mq_mongo::handler_error("effect", e))?;
                Ok(())
            },
        );
        // Like the workers: deferrals (mongod restarted, elections) back off up to 2 s, and
        // many are allowed.
        let ladder = std::iter::successors(Some(Duration::from_millis(250)), |d| {
            (*d < Duration::from_secs(2)).then(|| (*d * 2).min(Duration::from_secs(2)))
        });
        let policy = lily::prelude::Policy::default()
            .max_requeues(MAX_REQUEUES)
            .deferral_delays(ladder);
        let config = ConsumerConfig::new(events).policy(policy);
        let consumer = Consumer::new(amqp_url, config, router).scope(scope);
        let shutdown = lily::shutdown::Shutdown::new(lily::shutdown::ShutdownBudget::new(
            Duration::from_secs(20),
        ));
        let join = tokio::spawn(consumer.run(shutdown.clone()));
        wait_declared(&Broker::from_env(), events).await;
        Self {
            shutdown,
            join,
            database,
        }
    }

    async fn stop(self) -> Downstreamed {
        self.shutdown.trigger(lily::shutdown::Trigger::Api);
        let report = match self.join.await {
            Ok(Ok(report)) => Some(report),
            Ok(Err(err)) => {
                eprintln!("chaos: downstream consumer failed: {err}");
                None
            }
            Err(err) => {
                eprintln!("chaos: downstream consumer panicked: {err}");
                None
            }
        };
        Downstreamed {
            database: self.database,
            report,
        }
    }
}

/// The outbox by id: each ledger entry's event staged once and marked sent, no event without a
/// ledger entry, one effect downstream per event, the events queue and its DLQ empty.
async fn check_outbox(
    client: &Client,
    database: &Database,
    events: &str,
    downstream: &Downstreamed,
) -> Vec<String> {
    let mut violations = Vec::new();
    let ids = |collection: mongodb::Collection<Document>, filter: Document| async move {
        let mut found: BTreeMap<String, Vec<Document>> = BTreeMap::new();
        let mut cursor = collection.find(filter).await.expect("read by id");
        while cursor.advance().await.expect("cursor") {
            let document = cursor.deserialize_current().expect("a document");
            let id = document
                .get_str("message_id")
                .unwrap_or_default()
                .to_owned();
            found.entry(id).or_default().push(document);
        }
        found
    };
    let ledger = ids(database.collection("ledger"), doc! {}).await;
    let outbox = ids(database.collection("lily_outbox"), doc! {}).await;
    let effects = ids(downstream.database.collection("effects"), doc! {}).await;
    for id in ledger.keys() {
        let event = format!("{id}.entry");
        let records = outbox.get(&event).map_or(&[][..], Vec::as_slice);
        let states: Vec<&str> = records
            .iter()
            .map(|r| r.get_str("state").unwrap_or("-"))
            .collect();
        if states != ["sent"] {
            violations.push(format!(
                "{event}: outbox records {states:?}, expected one sent"
            ));
        }
        let n = effects.get(&event).map_or(0, Vec::len);
        if n != 1 {
            violations.push(format!("{event}: {n} effects downstream"));
        }
    }
    for event in outbox.keys() {
        let id = event.strip_suffix(".entry").unwrap_or(event);
        if !ledger.contains_key(id) {
            violations.push(format!("{event}: staged without a ledger entry"));
        }
    }
    for event in effects.keys() {
        if !outbox.contains_key(event) {
            violations.push(format!("{event}: an effect downstream, never staged"));
        }
    }
    let dlq = Topology::new(events, QueueKind::Classic, &RETRY_DELAYS).dead_letter_queue();
    for queue in [events, dlq.as_str()] {
        let left = client.drain_ids(queue).await;
        if !left.is_empty() {
            violations.push(format!("{queue}: {} messages left", left.len()));
        }
    }
    // Deliveries the broker's faults left unresolved downstream are explained when their
    // event has its one effect, checked above for every event.
    match &downstream.report {
        Some(report) => println!(
            "outbox: {} events staged, each published; downstream effects {}, duplicates \
             suppressed {}, unresolved listed {}",
            outbox.len(),
            effects.len(),
            report.totals.duplicates_suppressed,
            report.unresolved.len(),
        ),
        None => violations.push("downstream: no report".to_owned()),
    }
    violations
}

/// Waits until the workers declared the work queue.
async fn wait_declared(broker: &Broker, queue: &str) {
    for _ in 0..300 {
        let names = broker.ctl(&["list_queues", "-q", "--no-table-headers", "name"]);
        if names.lines().any(|name| name.trim() == queue) {
            return;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    panic!("{queue} was never declared");
}

/// Publishes `orders` at `rate` per second, `burst` of them back to back, with publisher confirms, reconnecting when the
/// broker closes the connection (a fault does). A publish whose confirm did not come is sent
/// again, so a message may exist twice: returns how many times each (id, quantity) was sent.
/// Each order, from its first publish to its confirm, holds `gate` for reading.
async fn publish(
    url: &str,
    queue: &str,
    orders: &[Order],
    (rate, burst): (u32, u32),
    gate: &RwLock<()>,
) -> BTreeMap<(String, i64), u32> {
    let mut sent: BTreeMap<(String, i64), u32> = BTreeMap::new();
    let gap = Duration::from_secs(1) * burst / rate;
    let mut publisher: Option<Publisher> = None;
    let to = Destination::queue(queue);
    for (n, order) in (1..).zip(orders) {
        let _publishing = gate.read().await;
        // An order that stays unconfirmed says so every 30 s, with the last outcome.
        let mut since = Instant::now();
        loop {
            let Some(open) = &publisher else {
                // The broker may be down or behind a fault: connect again until it answers.
                publisher = Publisher::connect(url).await.ok();
                if publisher.is_none() {
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
                continue;
            };
            *sent.entry((order.id.clone(), order.quantity)).or_default() += 1;
            let message = Outgoing::bytes(
                "stock.reserved",
                &order.id,
                "application/json",
                order.body(),
            );
            // Anything short of a confirm is published again: the inbox deduplicates.
            let outcome = open.publish(&to, message).await;
            if outcome.is_confirmed() {
                break;
            }
            if since.elapsed() > Duration::from_secs(30) {
                eprintln!(
                    "chaos: order {} unconfirmed for 30 s: {outcome:?}",
                    order.id
                );
                since = Instant::now();
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        if n % burst == 0 {
            tokio::time::sleep(gap).await;
        }
    }
    if let Some(publisher) = publisher {
        publisher.close().await;
    }
    sent
}

/// A channel for the soak's own operations on the broker (declare, delete, bind).
async fn open_channel(url: &str) -> Option<(lapin::Connection, lapin::Channel)> {
    let connection = lapin::Connection::connect(url, lapin::ConnectionProperties::default())
        .await
        .ok()?;
    let channel = connection.create_channel().await.ok()?;
    Some((connection, channel))
}

/// Reconciles by id; returns the violations.
async fn check(
    args: &Args,
    sent: &BTreeMap<(String, i64), u32>,
    books: &Books,
    client: &Client,
    queue: &str,
    database: &Database,
    supervisor: &Supervisor,
) -> Vec<String> {
    let (dead, deliveries) = (&books.dead, &books.deliveries);
    let mut violations = Vec::new();
    // What was published, by id: the sku and how often each body (quantity) was sent.
    let orders = plan(args);
    let skus: BTreeMap<&str, &str> = orders.iter().map(|o| (o.id.as_str(), o.sku)).collect();
    let mut published: BTreeMap<&str, (&str, BTreeMap<i64, u32>)> = BTreeMap::new();
    for ((id, quantity), times) in sent {
        let sku = skus.get(id.as_str()).copied().unwrap_or(UNKNOWN_SKU);
        let entry = published.entry(id).or_insert((sku, BTreeMap::new()));
        entry.1.insert(*quantity, *times);
    }
    // The ledger, by id.
    let mut ledger: BTreeMap<String, Vec<(String, i64)>> = BTreeMap::new();
    let mut cursor = database
        .collection::<Document>("ledger")
        .find(doc! {})
        .await
        .expect("read ledger");
    while cursor.advance().await.expect("ledger cursor") {
        let entry = cursor.deserialize_current().expect("ledger entry");
        let id = entry.get_str("message_id").unwrap_or_default().to_owned();
        let sku = entry.get_str("sku").unwrap_or_default().to_owned();
        let quantity = match entry.get("quantity") {
            Some(Bson::Int64(n)) => *n,
            Some(Bson::Int32(n)) => i64::from(*n),
            _ => 0,
        };
        ledger.entry(id).or_default().push((sku, quantity));
    }
    // Unresolved deliveries the reports list, by id.
    let mut unresolved: BTreeMap<String, u32> = BTreeMap::new();
    for report in &supervisor.reports {
        for entry in report["unresolved"].as_array().into_iter().flatten() {
            if let Some(id) = entry["message_id"].as_str() {
                *unresolved.entry(id.to_owned()).or_default() += 1;
            }
        }
    }

    let (mut effects, mut conflicts, mut unknown, mut doubled_copies) = (0, 0, 0, 0);
    for (id, (sku, quantities)) in &published {
        let entries = ledger.get(*id).map_or(&[][..], Vec::as_slice);
        let reasons = dead.get(*id).map_or(&[][..], Vec::as_slice);
        let explained = unresolved.contains_key(*id);
        // A DLQ copy may exist twice: a body sent twice (its publish confirm lost to a fault),
        // or an ACK lost after the copy's confirm (the redelivery hands off again). Counted,
        // not a violation: the original is never lost for it.
        if *sku == UNKNOWN_SKU {
            unknown += 1;
            let sent = quantities.values().sum::<u32>() as usize;
            doubled_copies += reasons.len().saturating_sub(sent);
            let right = reasons.iter().all(|r| r.contains("unknown sku"));
            if !entries.is_empty() || reasons.is_empty() || !right {
                let delivered = deliveries.get(*id).map_or(0, |d| d.count);
                violations.push(format!(
                    "{id}: unknown sku, ledger {entries:?}, DLQ {reasons:?}, delivered {delivered} \
                     times"
                ));
            }
            continue;
        }
        let committed = match entries {
            [(entry_sku, quantity)] if entry_sku == sku && quantities.contains_key(quantity) => {
                effects += 1;
                Some(*quantity)
            }
            [] if explained => None,
            [] => {
                let delivered = deliveries.get(*id).map_or(0, |d| d.count);
                violations.push(format!(
                    "{id}: lost (no effect, DLQ {reasons:?}, delivered {delivered} times)"
                ));
                None
            }
            _ => {
                violations.push(format!("{id}: {} effects: {entries:?}", entries.len()));
                None
            }
        };
        // The other body, if any, is a conflict: in the DLQ at least once and at most once per
        // time it was sent; nothing else may be there.
        let other: usize = quantities
            .iter()
            .filter(|(q, _)| Some(**q) != committed)
            .map(|(_, times)| *times as usize)
            .sum();
        if quantities.len() > 1 {
            conflicts += 1;
        }
        let conflict_copies = reasons
            .iter()
            .filter(|r| r.contains("inbox conflict"))
            .count();
        let floor = usize::from(quantities.len() > 1);
        doubled_copies += conflict_copies.saturating_sub(other);
        if conflict_copies != reasons.len() || conflict_copies < floor {
            violations.push(format!(
                "{id}: DLQ {reasons:?}, expected at least {floor} inbox conflict copy and nothing else"
            ));
        }
    }
    for id in dead.keys() {
        if !published.contains_key(id.as_str()) {
            violations.push(format!("{id}: in the DLQ, never published"));
        }
    }
    for (name, depth) in leftovers(client, queue).await {
        violations.push(format!("{name}: {depth} messages left"));
    }
    // Stock: seeded minus the ledger.
    let seeded = 10 * args.messages as i64;
    let mut stock = BTreeMap::new();
    let mut docs = database
        .collection::<Document>("stock")
        .find(doc! {})
        .await
        .expect("read stock");
    while docs.advance().await.expect("read stock") {
        let doc = docs.deserialize_current().expect("a stock document");
        if let (Ok(sku), Ok(available)) = (doc.get_str("_id"), doc.get_i64("available")) {
            stock.insert(sku.to_owned(), available);
        }
    }
    let mut taken_by_sku: BTreeMap<&str, i64> = BTreeMap::new();
    for (sku, quantity) in ledger.values().flatten() {
        *taken_by_sku.entry(sku.as_ref()).or_default() += quantity;
    }
    for sku in args.skus {
        let taken = taken_by_sku.get(sku).copied().unwrap_or(0);
        let available = stock.get(*sku).copied().unwrap_or(i64::MIN);
        if available != seeded - taken {
            violations.push(format!(
                "{sku}: available {available}, expected {}",
                seeded - taken
            ));
        }
    }
    let total = |field: &str| -> u64 {
        supervisor
            .reports
            .iter()
            .filter_map(|r| r["totals"][field].as_u64())
            .sum()
    };
    let suppressed = total("duplicates_suppressed");
    println!(
        "reported: retried {}, held {}, waited {}, requeued {}, deferred {}, authority lost {}",
        total("retried"),
        total("held"),
        total("waited"),
        total("requeued"),
        total("deferred"),
        total("authority_lost"),
    );
    println!(
        "ids {}: effects {effects}, conflicts {conflicts}, unknown sku {unknown}; DLQ copies {} \
         ({doubled_copies} doubled); suppressed duplicates (reported) {suppressed}; unresolved \
         listed {}; reports {}; worker starts {}",
        published.len(),
        dead.values().map(Vec::len).sum::<usize>(),
        unresolved.len(),
        supervisor.reports.len(),
        supervisor.slots.iter().map(|s| s.starts).sum::<u32>(),
    );
    violations
}
