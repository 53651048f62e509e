//! `inbox`: a stock/ledger service whose effects are written through Lily's MongoDB scope.
//!
//! Each `stock.reserved` message (`{"order_id", "sku", "quantity"}`) is handled in **one MongoDB
//! transaction** that Lily opens before the handler and commits after it:
//!
//! 1. Lily inserts the inbox record `(consumer, message_id)` with the message's fingerprint
//!    (type, schema version, SHA-256 of the body);
//! 2. the handler decrements `stock.available` for the sku — or fails **permanently** when the
//!    sku is unknown or has too little stock (a business rule: retrying cannot help, the
//!    message goes to the dead-letter queue and nothing is written);
//! 3. the handler inserts a `ledger` entry `{order_id, sku, quantity, message_id}`;
//! 4. Lily commits, then ACKs the original delivery.
//!
//! The inbox makes redeliveries safe: a redelivery of a committed message (the process died
//! between the commit and the ACK, the connection dropped) finds the record and is ACKed
//! without running the handler — a *suppressed duplicate*. The same `message_id` with another
//! body is a *conflict* and goes to the dead-letter queue; it never inherits the first
//! message's result. A crash before the commit leaves nothing behind: the next delivery does the
//! work once.
//!
//! Modes:
//!
//! - `inbox serve` consumes `LILY_QUEUE` until SIGTERM or Ctrl-C, then shuts down in phases and
//!   writes the shutdown report (JSON on stdout); the exit code is 0 when settlement is clean
//!   and 3 when anything is unresolved. A second signal forces the shutdown.
//! - `inbox demo` (the default) resets the demo collections, seeds stock, runs the consumer,
//!   publishes a sample set that includes an exact duplicate and a conflicting message, waits
//!   for every outcome and prints the ledger, the stock levels, the duplicates suppressed and
//!   the dead-letter reasons. It exits 0 when the outcomes are the expected ones.
//!
//! Environment:
//!
//! | variable | meaning |
//! |---|---|
//! | `LILY_AMQP_URL` | broker URL (required) |
//! | `LILY_MONGO_URL` | MongoDB replica set URL (required: transactions need a replica set) |
//! | `LILY_MONGO_DB` | database, default `inbox_demo` |
//! | `LILY_QUEUE` | work queue, default `stock` |
//! | `LILY_PREFETCH` | `serve`: prefetch and concurrency, default 10 (the demo uses 1) |
//! | `LILY_DEFERRAL_MS` | how long a deferred delivery waits before its requeue, default 1000 |
//! | `LILY_DEFERRAL_MAX_MS` | each further requeue of one message waits twice as long, up to this; default `LILY_DEFERRAL_MS` (no growth) |
//! | `LILY_LEASE_TTL_MS` | per-message lease TTL, default 30000 |
//! | `LILY_MAX_REQUEUES` | deferrals (and failed handoffs) before the DLQ, default 100 |
//! | `LILY_QUEUE_TYPE` | `classic` (default) or `quorum`; a quorum work queue gets `x-delivery-limit` `LILY_MAX_REQUEUES` + 20 |
//! | `LILY_TERMINATION_LOG` | `serve`: termination message file, default `/dev/termination-log` (written only when it exists) |
//! | `INBOX_FAULT` | `serve` only, for crash tests: `abort_after_commit` or `abort_in_handler` |
//! | `LILY_EVENTS` | `serve` only: a queue each reservation's event (`ledger.entry`, message id `<message id>.entry`) is staged for in the transaction, through the outbox; the consumer's relay publishes it. Unset (default): no event |
//! | `INBOX_FLAKY_ONE_IN` | `serve` only, for soaks: the first attempt of one order in N (chosen by its message id) fails with a retryable error before any write, so it goes through a retry bucket; 0 (default) never |
//!
//! Keep `LILY_MAX_REQUEUES × LILY_DEFERRAL_MS` longer than `LILY_LEASE_TTL_MS` plus mongod's
//! `transactionLifetimeLimitSeconds` (60 s unless configured): after a crash in the handler, the
//! dead worker's lease and its abandoned transaction (which holds the inbox key) keep later
//! deliveries deferring until the lease expires and mongod aborts the transaction.
//!
//! `INBOX_FAULT=abort_after_commit` calls `std::process::abort()` from
//! `MongoConfig::on_committed`: the transaction committed, the original was not ACKed yet.
//! `INBOX_FAULT=abort_in_handler` aborts in the handler after its writes, before it returns:
//! the inbox record and the writes are in an open transaction that never commits.

use std::collections::BTreeSet;
use std::error::Error as StdError;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use lapin::options::QueuePurgeOptions;
use lapin::{Connection, ConnectionProperties};
use lily::consumer::Totals;
use lily::prelude::*;
use lily::topology::{QueueKind, Topology};
use lily_mq_example_support::{DeadLetter, drain_dead_letters, error_chain};
use lily_mq_mongo::mongodb::bson::{Bson, Document, doc};
use lily_mq_mongo::mongodb::error::ErrorKind;
use lily_mq_mongo::mongodb::{self, Database};
use lily_mq_mongo::{MongoConfig, MongoScope, MongoTx, Outbox, handler_error};
use serde::Deserialize;
use serde_json::json;

/// The message type the handler is routed to.
const STOCK_RESERVED: &str = "stock.reserved";
/// The consumer name in inbox keys.
const CONSUMER: &str = "stock-service";
/// Stock levels: `{_id: sku, available}`.
const STOCK: &str = "stock";
/// One entry per reservation: `{order_id, sku, quantity, message_id}`.
const LEDGER: &str = "ledger";
/// Collections of Lily's MongoDB scope (default prefix `lily_`).
const SCOPE_COLLECTIONS: [&str; 4] = ["lily_inbox", "lily_leases", "lily_fences", "lily_deferrals"];
/// How long the demo waits for every outcome.
const DEMO_CAP: Duration = Duration::from_secs(60);

type BoxError = Box<dyn StdError + Send + Sync>;

/// The payload of `stock.reserved`.
#[derive(Debug, Deserialize)]
struct StockReserved {
    order_id: String,
    sku: String,
    quantity: u32,
}

/// A crash injected for tests.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Fault {
    /// Abort right after the commit, before the original is ACKed.
    AbortAfterCommit,
    /// Abort in the handler after its writes, before it returns (nothing commits).
    AbortInHandler,
}

impl Fault {
    fn from_env() -> Result<Option<Self>, String> {
        match std::env::var("INBOX_FAULT").as_deref() {
            Err(_) | Ok("") => Ok(None),
            Ok("abort_after_commit") => Ok(Some(Self::AbortAfterCommit)),
            Ok("abort_in_handler") => Ok(Some(Self::AbortInHandler)),
            Ok(_) => Err("INBOX_FAULT must be abort_after_commit or abort_in_handler".into()),
        }
    }
}

/// Reserves stock and records it in the ledger, inside the transaction Lily opened. Reasons are
/// static text: they end up in headers and logs, bodies never do.
async fn reserve(
    fault: Option<Fault>,
    flaky_one_in: u32,
    events: Option<Destination>,
    Json(order): Json<StockReserved>,
    meta: Meta,
    tx: MongoTx,
    outbox: Outbox,
) -> Result<(), QueueHandlerError> {
    if meta.attempt() == 1
        && flaky_one_in > 0
        && fnv1a(meta.message_id()).is_multiple_of(u64::from(flaky_one_in))
    {
        return Err(QueueHandlerError::retryable(
            "INBOX_FLAKY_ONE_IN: the first attempt of this order fails",
        ));
    }
    if order.quantity == 0 {
        return Err(QueueHandlerError::permanent("quantity must be at least 1"));
    }
    let quantity = i64::from(order.quantity);
    let stock = tx.database().collection::<Document>(STOCK);
    let ledger = tx.database().collection::<Document>(LEDGER);
    let mut session = tx.session().await;

    let taken = stock
        .update_one(
            doc! { "_id": &order.sku, "available": { "$gte": quantity } },
            doc! { "$inc": { "available": -quantity } },
        )
        .session(&mut *session)
        .await
        .map_err(|e| handler_error("stock update", e))?;
    if taken.matched_count == 0 {
        let known = stock
            .find_one(doc! { "_id": &order.sku })
            .session(&mut *session)
            .await
            .map_err(|e| handler_error("stock lookup", e))?;
        // The transaction is aborted: no inbox record, no ledger entry, stock untouched.
        return Err(QueueHandlerError::permanent(if known.is_some() {
            "insufficient stock for the reservation"
        } else {
            "unknown sku"
        }));
    }
    ledger
        .insert_one(doc! {
            "order_id": &order.order_id,
            "sku": &order.sku,
            "quantity": quantity,
            "message_id": meta.message_id(),
        })
        .session(&mut *session)
        .await
        .map_err(|e| handler_error("ledger insert", e))?;
    drop(session);
    if let Some(events) = events {
        let entry = json!({ "order_id": &order.order_id, "sku": &order.sku, "quantity": quantity });
        let id = format!("{}.entry", meta.message_id());
        let event = Outgoing::json("ledger.entry", &id, &entry)
            .map_err(|e| QueueHandlerError::permanent("event does not serialize").with_source(e))?;
        outbox.stage(&events, &event).await?;
    }

    if fault == Some(Fault::AbortInHandler) {
        eprintln!(
            "inbox: INBOX_FAULT=abort_in_handler: aborting after the writes of {}, before the commit",
            meta.message_id()
        );
        std::process::abort();
    }
    Ok(()) // Lily commits, then ACKs
}

/// FNV-1a of `text`: picks the flaky orders the same way in every process.
fn fnv1a(text: &str) -> u64 {
    text.bytes().fold(0xcbf2_9ce4_8422_2325, |hash, byte| {
        (hash ^ u64::from(byte)).wrapping_mul(0x0100_0000_01b3)
    })
}

/// Settings read from the environment.
#[derive(Clone, Debug)]
struct Settings {
    amqp_url: String,
    mongo_url: String,
    database: String,
    queue: String,
    prefetch: u16,
    deferral: Duration,
    deferral_max: Duration,
    lease_ttl: Duration,
    max_requeues: u32,
    queue_kind: QueueKind,
    flaky_one_in: u32,
    events: Option<String>,
}

fn env_number<T: std::str::FromStr>(name: &str, default: T) -> Result<T, String> {
    match std::env::var(name) {
        Ok(v) => v.parse().map_err(|_| format!("{name} must be a number")),
        Err(_) => Ok(default),
    }
}

impl Settings {
    fn from_env() -> Result<Self, String> {
        let required = |name: &str, example: &str| {
            std::env::var(name).map_err(|_| format!("set {name} (for example {example})"))
        };
        let amqp_url = required("LILY_AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/%2f")?;
        let mongo_url = required(
            "LILY_MONGO_URL",
            "mongodb://127.0.0.1:27017/?replicaSet=rs0&directConnection=true",
        )?;
        let deferral = Duration::from_millis(env_number("LILY_DEFERRAL_MS", 1000)?);
        if deferral.is_zero() {
            return Err("LILY_DEFERRAL_MS must be above zero: a deferral must wait".into());
        }
        let deferral_max = Duration::from_millis(env_number(
            "LILY_DEFERRAL_MAX_MS",
            u64::try_from(deferral.as_millis()).unwrap_or(u64::MAX),
        )?);
        if deferral_max < deferral {
            return Err("LILY_DEFERRAL_MAX_MS must be at least LILY_DEFERRAL_MS".into());
        }
        let lease_ttl = Duration::from_millis(env_number("LILY_LEASE_TTL_MS", 30_000)?);
        if lease_ttl < Duration::from_millis(100) {
            return Err("LILY_LEASE_TTL_MS must be at least 100".into());
        }
        Ok(Self {
            amqp_url,
            mongo_url,
            database: std::env::var("LILY_MONGO_DB").unwrap_or_else(|_| "inbox_demo".into()),
            queue: std::env::var("LILY_QUEUE").unwrap_or_else(|_| "stock".into()),
            prefetch: env_number("LILY_PREFETCH", 10_u16)?.max(1),
            deferral,
            deferral_max,
            lease_ttl,
            max_requeues: env_number("LILY_MAX_REQUEUES", 100)?,
            queue_kind: match std::env::var("LILY_QUEUE_TYPE").as_deref() {
                Err(_) | Ok("" | "classic") => QueueKind::Classic,
                Ok("quorum") => QueueKind::Quorum,
                Ok(_) => return Err("LILY_QUEUE_TYPE must be classic or quorum".into()),
            },
            flaky_one_in: env_number("INBOX_FLAKY_ONE_IN", 0)?,
            events: std::env::var("LILY_EVENTS").ok().filter(|q| !q.is_empty()),
        })
    }

    /// Short delays: 3 attempts with retry buckets of 1 s and 5 s; up to `LILY_MAX_REQUEUES`
    /// deferrals (and failed handoffs), the first waiting `LILY_DEFERRAL_MS`, each next one
    /// twice as long up to `LILY_DEFERRAL_MAX_MS`.
    fn policy(&self) -> Policy {
        let ladder = std::iter::successors(Some(self.deferral), |d| {
            (*d < self.deferral_max).then(|| (*d * 2).min(self.deferral_max))
        });
        Policy::default()
            .max_attempts(3)
            .retry_delays([Duration::from_secs(1), Duration::from_secs(5)])
            .max_requeues(self.max_requeues)
            .deferral_delays(ladder)
    }

    fn consumer_config(&self, prefetch: u16) -> ConsumerConfig {
        ConsumerConfig::new(&self.queue)
            .queue_kind(self.queue_kind)
            // Above the requeues Lily allows itself: the broker's limit is the backstop.
            .delivery_limit(Some(self.max_requeues.saturating_add(20)))
            .policy(self.policy())
            .prefetch(prefetch)
            .concurrency(usize::from(prefetch))
    }

    fn mongo_config(&self, fault: Option<Fault>) -> MongoConfig {
        // The lease is opt-in (setting its TTL takes it): the example takes one, so its crash
        // tests and the chaos soak go through the lease and its fence too.
        let config = MongoConfig::new(CONSUMER)
            .lease_ttl(self.lease_ttl, Duration::from_secs(600).max(self.lease_ttl));
        if fault == Some(Fault::AbortAfterCommit) {
            config.on_committed(|meta| {
                eprintln!(
                    "inbox: INBOX_FAULT=abort_after_commit: aborting after the commit of {}, \
                     before the ACK",
                    meta.message_id()
                );
                std::process::abort();
            })
        } else {
            config
        }
    }

    async fn scope(&self, fault: Option<Fault>) -> Result<MongoScope, BoxError> {
        MongoScope::connect(&self.mongo_url, &self.database, self.mongo_config(fault))
            .await
            .map_err(|e| format!("LILY_MONGO_URL: {e}").into())
    }
}

fn router(fault: Option<Fault>, flaky_one_in: u32, events: Option<&str>) -> Router {
    let events = events.map(Destination::queue);
    Router::new().route(
        STOCK_RESERVED,
        move |order: Json<StockReserved>, meta: Meta, tx: MongoTx, outbox: Outbox| {
            reserve(fault, flaky_one_in, events.clone(), order, meta, tx, outbox)
        },
    )
}

#[tokio::main]
async fn main() -> ExitCode {
    lily::logging::init("warn,lily_mq_rabbit=info");

    let mode = std::env::args().nth(1).unwrap_or_else(|| "demo".to_owned());
    if matches!(mode.as_str(), "-h" | "--help" | "help") {
        println!("{}", usage());
        return ExitCode::SUCCESS;
    }
    if mode != "serve" && mode != "demo" {
        eprintln!("inbox: unknown mode {mode:?}\n{}", usage());
        return ExitCode::from(2);
    }
    let settings = match Settings::from_env() {
        Ok(settings) => settings,
        Err(err) => {
            eprintln!("inbox: {err}\n{}", usage());
            return ExitCode::from(2);
        }
    };
    let result = if mode == "serve" {
        match Fault::from_env() {
            Ok(fault) => serve(&settings, fault).await,
            Err(err) => {
                eprintln!("inbox: {err}");
                return ExitCode::from(2);
            }
        }
    } else {
        demo(&settings).await
    };
    match result {
        Ok(code) => code,
        Err(err) => {
            eprintln!("inbox {mode}: FAILED: {}", error_chain(err.as_ref()));
            ExitCode::FAILURE
        }
    }
}

fn usage() -> &'static str {
    "usage: inbox [demo|serve]\n\
     \n  demo   seed stock, publish a sample set with a duplicate and a conflict, print the outcome\
     \n  serve  consume until SIGTERM or Ctrl-C, then print the shutdown report (JSON)\
     \n\nenvironment: LILY_AMQP_URL, LILY_MONGO_URL (required); LILY_MONGO_DB (inbox_demo), \
     LILY_QUEUE (stock), LILY_PREFETCH (10), LILY_DEFERRAL_MS (1000), LILY_LEASE_TTL_MS (30000), \
     LILY_MAX_REQUEUES (100), LILY_QUEUE_TYPE (classic), INBOX_FAULT, INBOX_FLAKY_ONE_IN (0), \
     RUST_LOG"
}

// ---------------------------------------------------------------------------------------------
// serve

async fn serve(settings: &Settings, fault: Option<Fault>) -> Result<ExitCode, BoxError> {
    let shutdown = Shutdown::default();
    shutdown.listen_for_signals()?;
    let scope = settings.scope(fault).await?;
    eprintln!(
        "inbox: serving {} into database {}{}; SIGTERM or Ctrl-C drains, a second one forces",
        settings.queue,
        settings.database,
        fault.map_or(String::new(), |f| format!(" (fault injected: {f:?})")),
    );
    let consumer = Consumer::new(
        settings.amqp_url.clone(),
        settings.consumer_config(settings.prefetch),
        router(fault, settings.flaky_one_in, settings.events.as_deref()),
    )
    .scope(scope);
    let report = consumer.run(shutdown).await?;
    let mut sinks = ReportSinks::default();
    if let Ok(path) = std::env::var("LILY_TERMINATION_LOG") {
        sinks = sinks.termination_log(path);
    }
    emit(&report, &sinks)?;
    Ok(report.exit_status())
}

// ---------------------------------------------------------------------------------------------
// demo

/// Stock seeded before the demo: (sku, available).
const SEED: [(&str, i64); 2] = [("SKU-A", 10), ("SKU-B", 3)];

/// One message of the sample set.
struct Sample {
    message_id: &'static str,
    order_id: &'static str,
    sku: &'static str,
    quantity: u32,
    expect: &'static str,
}

impl Sample {
    fn body(&self) -> Vec<u8> {
        json!({ "order_id": self.order_id, "sku": self.sku, "quantity": self.quantity })
            .to_string()
            .into_bytes()
    }
}

const SAMPLES: [Sample; 6] = [
    Sample {
        message_id: "res-1001",
        order_id: "A-1001",
        sku: "SKU-A",
        quantity: 2,
        expect: "reserved: ledger entry, SKU-A -2",
    },
    Sample {
        message_id: "res-1002",
        order_id: "A-1002",
        sku: "SKU-B",
        quantity: 1,
        expect: "reserved: ledger entry, SKU-B -1",
    },
    Sample {
        message_id: "res-1003",
        order_id: "A-1003",
        sku: "SKU-A",
        quantity: 3,
        expect: "reserved: ledger entry, SKU-A -3",
    },
    Sample {
        message_id: "res-1004",
        order_id: "A-1004",
        sku: "SKU-B",
        quantity: 5,
        expect: "insufficient stock: DLQ, nothing written",
    },
    Sample {
        message_id: "res-1001",
        order_id: "A-1001",
        sku: "SKU-A",
        quantity: 2,
        expect: "exact duplicate: suppressed by the inbox, ACKed",
    },
    Sample {
        message_id: "res-1002",
        order_id: "A-1002",
        sku: "SKU-B",
        quantity: 2,
        expect: "same id, other body: inbox conflict, DLQ",
    },
];

/// What the sample set must end as.
const EXPECT_ACKED: u64 = 4;
const EXPECT_DUPLICATES: u64 = 1;
const EXPECT_DEAD_LETTERED: u64 = 2;
/// Ledger entries: (message_id, order_id, sku, quantity).
const EXPECT_LEDGER: [(&str, &str, &str, i64); 3] = [
    ("res-1001", "A-1001", "SKU-A", 2),
    ("res-1002", "A-1002", "SKU-B", 1),
    ("res-1003", "A-1003", "SKU-A", 3),
];
const EXPECT_STOCK: [(&str, i64); 2] = [("SKU-A", 5), ("SKU-B", 2)];
/// Dead letters: (message_id, a part of the reason).
const EXPECT_DLQ: [(&str, &str); 2] = [
    ("res-1002", "inbox conflict"),
    ("res-1004", "insufficient stock"),
];

async fn demo(settings: &Settings) -> Result<ExitCode, BoxError> {
    // One handler at a time so the printed sequence is the same on every run (concurrent
    // reservations of one sku conflict in MongoDB and are retried: correct, but noisier).
    let config = settings.consumer_config(1);
    // Declared as the consumer declares it, for the broker's version (on RabbitMQ 4 the lanes
    // of a quorum queue get no delivery limit).
    let version = lily::topology::broker_version(&settings.amqp_url, None)
        .await
        .map_err(|e| format!("cannot connect to the broker in LILY_AMQP_URL: {e}"))?;
    let topology = Topology::new(
        &settings.queue,
        settings.queue_kind,
        &config.policy.retry_delays,
    )
    .delivery_limit(config.delivery_limit)
    .broker(version);
    println!("Lily inbox demo");
    println!(
        "  queue {}, database {}, consumer {CONSUMER}",
        settings.queue, settings.database
    );

    // MongoDB: reset the demo's collections, seed stock.
    let client = mongodb::Client::with_uri_str(&settings.mongo_url).await?;
    let database = client.database(&settings.database);
    for name in [STOCK, LEDGER].into_iter().chain(SCOPE_COLLECTIONS) {
        drop_collection(&database, name)
            .await
            .map_err(|e| format!("cannot reset collection {name} at LILY_MONGO_URL: {e}"))?;
    }
    let stock = database.collection::<Document>(STOCK);
    for (sku, available) in SEED {
        stock
            .insert_one(doc! { "_id": sku, "available": available })
            .await?;
    }
    println!(
        "  reset collections {}; seeded stock {}",
        [STOCK, LEDGER]
            .into_iter()
            .chain(SCOPE_COLLECTIONS)
            .collect::<Vec<_>>()
            .join(", "),
        SEED.iter()
            .map(|(sku, n)| format!("{sku}={n}"))
            .collect::<Vec<_>>()
            .join(", ")
    );

    // RabbitMQ: declare exactly what the consumer declares, then empty it.
    let connection = Connection::connect(&settings.amqp_url, ConnectionProperties::default())
        .await
        .map_err(|e| format!("cannot connect to the broker in LILY_AMQP_URL: {e}"))?;
    let setup = connection.create_channel().await?;
    topology
        .apply(&setup, TopologyMode::Declare)
        .await
        .map_err(|e| format!("the broker refused the topology of {}: {e}", settings.queue))?;
    let mut names = vec![
        settings.queue.clone(),
        topology.dead_letter_queue(),
        topology.parking_queue(),
    ];
    names.extend(topology.buckets().map(|(name, _)| name.to_owned()));
    let mut stale = 0;
    for name in &names {
        stale += setup
            .queue_purge(name.as_str().into(), QueuePurgeOptions::default())
            .await?;
    }
    let _ = setup.close(200, "setup done".into()).await;
    if stale > 0 {
        println!("  purged {stale} message(s) left by an earlier run");
    }

    // The consumer runs in its own task until `shutdown` fires.
    let scope = settings.scope(None).await?;
    let consumer =
        Consumer::new(settings.amqp_url.clone(), config, router(None, 0, None)).scope(scope);
    let stats = consumer.stats();
    let shutdown = Shutdown::default();
    let mut task = tokio::spawn(consumer.run(shutdown.clone()));

    let publisher = Publisher::connect(&settings.amqp_url)
        .await
        .map_err(|e| format!("cannot connect the publisher: {e}"))?;
    let to = Destination::queue(&settings.queue);
    println!();
    println!(
        "published {} messages of type {STOCK_RESERVED} (persistent, publisher-confirmed):",
        SAMPLES.len()
    );
    for sample in &SAMPLES {
        let message = Outgoing::bytes(
            STOCK_RESERVED,
            sample.message_id,
            "application/json",
            sample.body(),
        );
        let published = publisher.publish(&to, message).await;
        if !published.is_confirmed() {
            let id = sample.message_id;
            return Err(format!("publish of {id} not confirmed: {published:?}").into());
        }
        println!(
            "  {:<9} {} {} x{:<2} expect: {}",
            sample.message_id, sample.order_id, sample.sku, sample.quantity, sample.expect
        );
    }
    publisher.close().await;

    // Wait for every outcome.
    println!();
    println!("waiting for outcomes (cap {}s)", DEMO_CAP.as_secs());
    let started = Instant::now();
    let mut last = Totals::default();
    loop {
        let t = stats.totals();
        if t != last {
            println!(
                "  +{:>4.1}s  {}",
                started.elapsed().as_secs_f64(),
                brief(&t)
            );
            last = t;
        }
        if t.acked == EXPECT_ACKED
            && t.duplicates_suppressed == EXPECT_DUPLICATES
            && t.dead_lettered == EXPECT_DEAD_LETTERED
        {
            break;
        }
        let unexpected = t.acked > EXPECT_ACKED
            || t.duplicates_suppressed > EXPECT_DUPLICATES
            || t.dead_lettered > EXPECT_DEAD_LETTERED
            || t.unresolved > 0
            || t.parked > 0;
        if unexpected || started.elapsed() > DEMO_CAP {
            shutdown.trigger(Trigger::Api);
            return Err(format!(
                "{}: have {}; expected acked {EXPECT_ACKED} (duplicates suppressed \
                 {EXPECT_DUPLICATES}), dead-lettered {EXPECT_DEAD_LETTERED}",
                if unexpected {
                    "unexpected outcomes".to_owned()
                } else {
                    format!("gave up after {}s", DEMO_CAP.as_secs())
                },
                brief(&t)
            )
            .into());
        }
        if task.is_finished() {
            let err = match (&mut task).await {
                Ok(Ok(_)) => "it stopped on its own".to_owned(),
                Ok(Err(err)) => error_chain(&err),
                Err(join) => join.to_string(),
            };
            return Err(format!("the consumer stopped before the demo finished: {err}").into());
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    shutdown.trigger(Trigger::Api);
    let report = task
        .await
        .map_err(|e| format!("consumer task failed: {e}"))??;
    let dead = drain_dead_letters(&connection, &topology.dead_letter_queue()).await?;
    let _ = connection.close(200, "demo done".into()).await;
    let ledger = read_ledger(&database).await?;
    let levels = read_stock(&database).await?;

    // The report.
    println!();
    println!(
        "outcomes (consumer stopped after {:.1}s)",
        started.elapsed().as_secs_f64()
    );
    // The three this demo is about always, the others when they happened.
    let always = ["acked", "duplicates_suppressed", "dead_lettered"];
    for (name, n) in report.totals.fields() {
        if always.contains(&name) || (n > 0 && !name.starts_with("acks_")) {
            println!("  {:<21} {n:>3}", name.replace('_', " "));
        }
    }
    println!();
    println!("ledger ({} entries)", ledger.len());
    println!("  {:<9} {:<7} {:<6} quantity", "message", "order", "sku");
    for (message_id, order_id, sku, quantity) in &ledger {
        println!("  {message_id:<9} {order_id:<7} {sku:<6} {quantity}");
    }
    println!();
    println!("stock");
    for (sku, available) in &levels {
        let seeded = SEED
            .iter()
            .find(|(s, _)| s == sku)
            .map_or_else(|| "?".to_owned(), |(_, n)| n.to_string());
        println!("  {sku:<6} {seeded:>3} -> {available}");
    }
    println!();
    println!(
        "dead-letter queue {} ({} message(s), bodies not shown)",
        topology.dead_letter_queue(),
        dead.len()
    );
    for m in &dead {
        println!("  {:<9} {:<10} {}", m.message_id, m.failure_kind, m.reason);
    }

    let problems = check(&report, &ledger, &levels, &dead);
    println!();
    if problems.is_empty() {
        println!(
            "OK: {} reservations written once; the exact duplicate was suppressed by the inbox \
             ({} duplicate), the conflicting message and the business-rule failure are in the \
             DLQ; nothing unresolved",
            ledger.len(),
            report.totals.duplicates_suppressed
        );
        Ok(ExitCode::SUCCESS)
    } else {
        Err(problems.join("; ").into())
    }
}

/// Compares what the demo produced with what it must produce.
fn check(
    report: &ShutdownReport,
    ledger: &[(String, String, String, i64)],
    levels: &[(String, i64)],
    dead: &[DeadLetter],
) -> Vec<String> {
    let mut problems = Vec::new();
    if !report.clean {
        problems.push(format!(
            "{} unresolved deliveries",
            report.unresolved.len() as u64 + report.unresolved_overflow
        ));
    }
    let want: Vec<(String, String, String, i64)> = EXPECT_LEDGER
        .iter()
        .map(|(m, o, s, q)| ((*m).to_owned(), (*o).to_owned(), (*s).to_owned(), *q))
        .collect();
    if ledger != want.as_slice() {
        problems.push(format!("ledger holds {ledger:?}, expected {want:?}"));
    }
    let want: Vec<(String, i64)> = EXPECT_STOCK
        .iter()
        .map(|(s, n)| ((*s).to_owned(), *n))
        .collect();
    if levels != want.as_slice() {
        problems.push(format!("stock is {levels:?}, expected {want:?}"));
    }
    let got: BTreeSet<&str> = dead.iter().map(|m| m.message_id.as_str()).collect();
    let ids: BTreeSet<&str> = EXPECT_DLQ.iter().map(|(id, _)| *id).collect();
    let reasons_ok = EXPECT_DLQ.iter().all(|(id, part)| {
        dead.iter()
            .any(|m| m.message_id == *id && m.reason.contains(part))
    });
    if got != ids || dead.len() != EXPECT_DLQ.len() || !reasons_ok {
        problems.push(format!(
            "dead-letter queue holds {:?}, expected {EXPECT_DLQ:?}",
            dead.iter()
                .map(|m| (m.message_id.as_str(), m.reason.as_str()))
                .collect::<Vec<_>>()
        ));
    }
    problems
}

/// Drops a collection; a missing one is fine.
async fn drop_collection(database: &Database, name: &str) -> mongodb::error::Result<()> {
    match database.collection::<Document>(name).drop().await {
        Err(err) if matches!(err.kind.as_ref(), ErrorKind::Command(e) if e.code == 26) => Ok(()),
        other => other,
    }
}

/// Ledger entries sorted by message id: (message_id, order_id, sku, quantity).
async fn read_ledger(
    database: &Database,
) -> mongodb::error::Result<Vec<(String, String, String, i64)>> {
    let mut cursor = database
        .collection::<Document>(LEDGER)
        .find(doc! {})
        .sort(doc! { "message_id": 1, "_id": 1 })
        .await?;
    let mut out = Vec::new();
    while cursor.advance().await? {
        let entry: Document = cursor.deserialize_current()?;
        let text = |key: &str| entry.get_str(key).unwrap_or("?").to_owned();
        out.push((
            text("message_id"),
            text("order_id"),
            text("sku"),
            number(entry.get("quantity")),
        ));
    }
    Ok(out)
}

/// Stock levels sorted by sku.
async fn read_stock(database: &Database) -> mongodb::error::Result<Vec<(String, i64)>> {
    let mut cursor = database
        .collection::<Document>(STOCK)
        .find(doc! {})
        .sort(doc! { "_id": 1 })
        .await?;
    let mut out = Vec::new();
    while cursor.advance().await? {
        let entry: Document = cursor.deserialize_current()?;
        out.push((
            entry.get_str("_id").unwrap_or("?").to_owned(),
            number(entry.get("available")),
        ));
    }
    Ok(out)
}

fn number(value: Option<&Bson>) -> i64 {
    match value {
        Some(Bson::Int64(n)) => *n,
        Some(Bson::Int32(n)) => i64::from(*n),
        _ => i64::MIN,
    }
}

fn brief(t: &Totals) -> String {
    format!(
        "acked {} (duplicates suppressed {}) dead-lettered {} retried {} deferred {} \
         unresolved {}",
        t.acked, t.duplicates_suppressed, t.dead_lettered, t.retried, t.deferred, t.unresolved
    )
}
