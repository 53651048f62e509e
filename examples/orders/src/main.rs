//! `orders`: a typed Lily handler for `order.placed` messages.
//!
//! The handler never sees ACK or NACK. What it returns picks the path Lily settles the delivery
//! on:
//!
//! | message                         | handler returns                   | path                          |
//! |---------------------------------|-----------------------------------|-------------------------------|
//! | a normal order                  | `Ok(())`                          | ACK                           |
//! | `quantity: 0`                   | permanent failure                 | dead-letter queue             |
//! | sku `FLAKY`                     | retryable on attempt 1, then `Ok` | retry bucket, then ACK        |
//! | sku `DOOMED`                    | always retryable                  | 2 retries, then the DLQ       |
//! | body that is not JSON           | (the `Json` extractor fails)      | dead-letter queue             |
//! | unknown type `order.cancelled`  | (no route; the handler never runs)| dead-letter queue             |
//!
//! Modes:
//!
//! - `orders serve` consumes `LILY_QUEUE` (default `orders`) at `LILY_AMQP_URL` until Ctrl-C or
//!   SIGTERM, then shuts down in phases and writes the shutdown report (JSON on stdout). A
//!   second signal forces the shutdown.
//! - `orders demo` (the default) purges the queue and its companions, starts the consumer,
//!   publishes a sample set with publisher confirms, waits until every message is settled,
//!   stops the consumer and prints a report of the outcomes and of the dead-letter queue.

use std::collections::BTreeSet;
use std::error::Error as StdError;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use lapin::options::QueuePurgeOptions;
use lapin::{Connection, ConnectionProperties};
use lily::consumer::Totals;
use lily::prelude::*;
use lily::topology::Topology;
use lily_mq_example_support::{drain_dead_letters, error_chain};
use serde::Deserialize;
use serde_json::json;

/// Work queue consumed when `LILY_QUEUE` is not set.
const DEFAULT_QUEUE: &str = "orders";
/// The message type the handler is routed to.
const ORDER_PLACED: &str = "order.placed";
/// How long the demo waits for every message to settle.
const DEMO_CAP: Duration = Duration::from_secs(60);

type BoxError = Box<dyn StdError + Send + Sync>;

/// The payload of `order.placed`.
#[derive(Debug, Deserialize)]
struct OrderPlaced {
    order_id: String,
    sku: String,
    quantity: u32,
}

/// Places an order. Reasons are static text: they end up in headers and logs, bodies never do.
async fn place_order(
    Json(order): Json<OrderPlaced>,
    Attempt(attempt): Attempt,
) -> Result<(), QueueHandlerError> {
    if order.quantity == 0 {
        return Err(QueueHandlerError::permanent("quantity must be at least 1"));
    }
    match order.sku.as_str() {
        "FLAKY" if attempt == 1 => Err(QueueHandlerError::retryable(
            "inventory service busy on the first attempt",
        )),
        "DOOMED" => Err(QueueHandlerError::retryable(
            "inventory service unreachable",
        )),
        _ => {
            // A real service would reserve stock for `order.order_id` here.
            let _ = order.order_id;
            Ok(())
        }
    }
}

/// A short policy for the demo: 3 attempts, retry buckets of 1 s and 2 s, default budget.
fn policy() -> Policy {
    let mut policy = Policy::default();
    policy.max_attempts = 3;
    policy.retry_delays = vec![Duration::from_secs(1), Duration::from_secs(2)];
    policy
}

fn router() -> Router {
    Router::new().route(ORDER_PLACED, place_order)
}

fn config(queue: &str) -> ConsumerConfig {
    ConsumerConfig::new(queue).policy(policy())
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
        eprintln!("orders: unknown mode {mode:?}\n{}", usage());
        return ExitCode::from(2);
    }
    let Ok(url) = std::env::var("LILY_AMQP_URL") else {
        eprintln!(
            "orders: set LILY_AMQP_URL (for example amqp://guest:guest@127.0.0.1:5672/%2f), \
             or run scripts/demo.sh to start a private broker"
        );
        return ExitCode::from(2);
    };
    let queue = std::env::var("LILY_QUEUE").unwrap_or_else(|_| DEFAULT_QUEUE.to_owned());
    let result = if mode == "serve" {
        serve(&url, &queue).await
    } else {
        demo(&url, &queue).await
    };
    match result {
        Ok(code) => code,
        Err(err) => {
            eprintln!("orders {mode}: FAILED: {}", error_chain(err.as_ref()));
            ExitCode::FAILURE
        }
    }
}

fn usage() -> &'static str {
    "usage: orders [demo|serve]\n\
     \n  demo   publish a sample set, wait for every outcome, print a report (default)\
     \n  serve  consume until Ctrl-C or SIGTERM, then print the shutdown report\
     \n\nenvironment: LILY_AMQP_URL (required), LILY_QUEUE (default orders), RUST_LOG"
}

// ---------------------------------------------------------------------------------------------
// serve

async fn serve(url: &str, queue: &str) -> Result<ExitCode, BoxError> {
    eprintln!("orders: consuming {queue}; SIGTERM or Ctrl-C drains, a second one forces");
    let consumer = Consumer::new(url, config(queue), router());
    let report = consumer.run_until_signal(ReportSinks::default()).await?;
    Ok(report.exit_status())
}

fn print_unresolved(report: &ShutdownReport) {
    if report.clean {
        println!("  every delivery's settlement is known");
        return;
    }
    println!("  unresolved deliveries:");
    for d in &report.unresolved {
        println!(
            "    message_id {:<20} attempt {} delivery_tag {} last evidence {:?}: {}",
            d.message_id.as_deref().unwrap_or("-"),
            d.attempt,
            d.delivery_tag,
            d.last_evidence,
            d.reason,
        );
    }
    if report.unresolved_overflow > 0 {
        println!("    ... and {} more not listed", report.unresolved_overflow);
    }
}

fn print_totals(t: &Totals) {
    println!("  acked            {:>4}", t.acked);
    println!("  retried          {:>4}", t.retried);
    println!("  dead-lettered    {:>4}", t.dead_lettered);
    println!("  unresolved       {:>4}", t.unresolved);
    // Paths this example does not exercise, shown only when they happened.
    for (name, n) in [
        ("parked", t.parked),
        ("requeued", t.requeued),
        ("deferred", t.deferred),
        ("rejected at gate", t.rejected_at_gate),
        ("authority lost", t.authority_lost),
        ("duplicates", t.duplicates_suppressed),
    ] {
        if n > 0 {
            println!("  {name:<16} {n:>4}");
        }
    }
}

// ---------------------------------------------------------------------------------------------
// demo

/// One message of the sample set.
struct Sample {
    message_id: &'static str,
    kind: &'static str,
    body: Vec<u8>,
    expect: &'static str,
}

fn samples() -> Vec<Sample> {
    let order = |id: &str, sku: &str, quantity: u32| {
        json!({ "order_id": id, "sku": sku, "quantity": quantity })
            .to_string()
            .into_bytes()
    };
    let mut set: Vec<Sample> = (1..=5)
        .map(|n| Sample {
            message_id: ["order-1", "order-2", "order-3", "order-4", "order-5"][n - 1],
            kind: ORDER_PLACED,
            body: order(
                &format!("A-100{n}"),
                "BOOK-42",
                u32::try_from(n).unwrap_or(1),
            ),
            expect: "acked",
        })
        .collect();
    set.extend([
        Sample {
            message_id: "order-flaky",
            kind: ORDER_PLACED,
            body: order("A-2001", "FLAKY", 1),
            expect: "retried once, then acked",
        },
        Sample {
            message_id: "order-doomed",
            kind: ORDER_PLACED,
            body: order("A-2002", "DOOMED", 1),
            expect: "retried twice, then dead-lettered",
        },
        Sample {
            message_id: "order-zero-qty",
            kind: ORDER_PLACED,
            body: order("A-2003", "BOOK-42", 0),
            expect: "dead-lettered (permanent)",
        },
        Sample {
            message_id: "order-bad-json",
            kind: ORDER_PLACED,
            body: b"{\"order_id\": \"A-2004\", \"sku\": ".to_vec(),
            expect: "dead-lettered (body is not JSON)",
        },
        Sample {
            message_id: "order-cancelled",
            kind: "order.cancelled",
            body: order("A-2005", "BOOK-42", 1),
            expect: "dead-lettered (no route for the type)",
        },
    ]);
    set
}

/// What the sample set must end as.
const EXPECT_ACKED: u64 = 6;
const EXPECT_RETRIED: u64 = 3;
const EXPECT_DEAD_LETTERED: u64 = 4;
const EXPECT_DLQ: [&str; 4] = [
    "order-bad-json",
    "order-cancelled",
    "order-doomed",
    "order-zero-qty",
];

async fn demo(url: &str, queue: &str) -> Result<ExitCode, BoxError> {
    let policy = policy();
    let topology = Topology::new(queue, QueueKind::Classic, &policy.retry_delays);
    println!("Lily orders demo");
    println!(
        "  queue {queue}, policy: {} attempts, retry buckets {}",
        policy.max_attempts,
        topology
            .buckets()
            .map(|(name, _)| name)
            .collect::<Vec<_>>()
            .join(", ")
    );

    let connection = Connection::connect(url, ConnectionProperties::default())
        .await
        .map_err(|e| format!("cannot connect to the broker in LILY_AMQP_URL: {e}"))?;

    // Declare exactly what the consumer declares, then empty it so reruns start clean.
    let setup = connection.create_channel().await?;
    topology
        .apply(&setup, TopologyMode::Declare)
        .await
        .map_err(|e| format!("the broker refused the topology of {queue}: {e}"))?;
    let mut stale = 0;
    let mut names = vec![
        queue.to_owned(),
        topology.dead_letter_queue(),
        topology.parking_queue(),
    ];
    names.extend(topology.buckets().map(|(name, _)| name.to_owned()));
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
    let consumer = Consumer::new(url, config(queue), router());
    let stats = consumer.stats();
    let shutdown = Shutdown::default();
    let mut task = tokio::spawn(consumer.run(shutdown.clone()));

    let samples = samples();
    let publisher = Publisher::connect(url)
        .await
        .map_err(|e| format!("cannot connect the publisher: {e}"))?;
    let messages = samples.iter().map(|sample| {
        let body = sample.body.clone();
        Outgoing::bytes(sample.kind, sample.message_id, "application/json", body)
    });
    let published = publisher
        .publish_all(&Destination::queue(queue), messages)
        .await;
    publisher.close().await;
    for (sample, published) in samples.iter().zip(published) {
        if !published.is_confirmed() {
            let id = sample.message_id;
            return Err(format!("publish of {id} not confirmed: {published:?}").into());
        }
    }
    println!();
    println!(
        "published {} messages (persistent, publisher-confirmed):",
        samples.len()
    );
    for sample in &samples {
        println!(
            "  {:<16} {:<16} expect: {}",
            sample.message_id, sample.kind, sample.expect
        );
    }

    // Wait for every outcome.
    println!();
    println!("waiting for settlement (cap {}s)", DEMO_CAP.as_secs());
    let started = Instant::now();
    let mut last = Totals::default();
    loop {
        let t = stats.totals();
        if t != last {
            println!(
                "  +{:>4.1}s  acked {} retried {} dead-lettered {} unresolved {}",
                started.elapsed().as_secs_f64(),
                t.acked,
                t.retried,
                t.dead_lettered,
                t.unresolved
            );
            last = t;
        }
        if t.acked == EXPECT_ACKED
            && t.retried == EXPECT_RETRIED
            && t.dead_lettered == EXPECT_DEAD_LETTERED
        {
            break;
        }
        if t.acked > EXPECT_ACKED
            || t.retried > EXPECT_RETRIED
            || t.dead_lettered > EXPECT_DEAD_LETTERED
            || t.unresolved > 0
        {
            shutdown.trigger(Trigger::Api);
            return Err(format!(
                "unexpected outcomes: {}; expected acked {EXPECT_ACKED}, retried \
                 {EXPECT_RETRIED}, dead-lettered {EXPECT_DEAD_LETTERED}",
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
        if started.elapsed() > DEMO_CAP {
            shutdown.trigger(Trigger::Api);
            return Err(format!(
                "gave up after {}s waiting for outcomes; have {}, expected acked \
                 {EXPECT_ACKED}, retried {EXPECT_RETRIED}, dead-lettered {EXPECT_DEAD_LETTERED}",
                DEMO_CAP.as_secs(),
                brief(&t)
            )
            .into());
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    shutdown.trigger(Trigger::Api);
    let report = task
        .await
        .map_err(|e| format!("consumer task failed: {e}"))??;
    let dead = drain_dead_letters(&connection, &topology.dead_letter_queue()).await?;
    let _ = connection.close(200, "demo done".into()).await;

    // The report.
    println!();
    println!(
        "report (consumer stopped after {:.1}s)",
        started.elapsed().as_secs_f64()
    );
    print_totals(&report.totals);
    println!();
    println!(
        "dead-letter queue {} ({} message(s), bodies not shown)",
        topology.dead_letter_queue(),
        dead.len()
    );
    println!(
        "  {:<16} {:<13} {:<7} reason",
        "message_id", "failure-kind", "attempt"
    );
    for m in &dead {
        println!(
            "  {:<16} {:<13} {:<7} {}",
            m.message_id, m.failure_kind, m.attempt, m.reason
        );
    }

    let mut problems = Vec::new();
    if !report.clean {
        problems.push(format!(
            "{} unresolved deliveries",
            report.unresolved.len() as u64 + report.unresolved_overflow
        ));
    }
    let got: BTreeSet<&str> = dead.iter().map(|m| m.message_id.as_str()).collect();
    let want: BTreeSet<&str> = EXPECT_DLQ.into_iter().collect();
    if got != want || dead.len() != EXPECT_DLQ.len() {
        problems.push(format!(
            "dead-letter queue holds {got:?}, expected exactly {want:?}"
        ));
    }
    println!();
    if problems.is_empty() {
        println!(
            "OK: {} acked, {} retried, {} dead-lettered, nothing unresolved",
            report.totals.acked, report.totals.retried, report.totals.dead_lettered
        );
        Ok(ExitCode::SUCCESS)
    } else {
        print_unresolved(&report);
        Err(problems.join("; ").into())
    }
}

fn brief(t: &Totals) -> String {
    format!(
        "acked {} retried {} dead-lettered {} unresolved {} parked {} requeued {}",
        t.acked, t.retried, t.dead_lettered, t.unresolved, t.parked, t.requeued
    )
}
