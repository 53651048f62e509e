//! `outbox`: an order service whose events are committed with its effects and published by the
//! consumer's outbox relay.
//!
//! Each `order.placed` message (`{"order_id", "quantity"}`) is handled in one MongoDB
//! transaction that Lily opens before the handler and commits after it: the handler inserts the
//! order into `orders` and stages an `order.accepted` event (message id `<order_id>.accepted`,
//! so a second publish of it is recognisable downstream) for the events queue. The effect, the
//! staged event and the inbox record commit together or not at all. The relay the consumer
//! runs beside itself publishes the event with a confirm, then marks it sent; the shutdown
//! report counts what it sent and what stays staged.
//!
//! `outbox serve` consumes until SIGTERM or Ctrl-C, then shuts down in phases and writes the
//! shutdown report (JSON on stdout); the exit code is 0 when settlement is clean and 3 when
//! anything is unresolved. A second signal forces the shutdown.
//!
//! Environment:
//!
//! | variable | meaning |
//! |---|---|
//! | `LILY_AMQP_URL` | broker URL (required) |
//! | `LILY_MONGO_URL` | MongoDB replica set URL (required: transactions need a replica set) |
//! | `LILY_MONGO_DB` | database, default `orders_demo` |
//! | `LILY_QUEUE` | work queue, default `orders` |
//! | `LILY_EVENTS` | the queue events are published to (through the default exchange), default `<queue>.events` |
//! | `LILY_PREFETCH` | prefetch and concurrency, default 50 |
//! | `LILY_QUEUE_TYPE` | `classic` (default) or `quorum` |
//! | `OUTBOX_FAULT` | for crash tests: `abort_after_commit:N` calls `std::process::abort()` after the Nth commit, before its ACK |

use std::error::Error as StdError;
use std::process::ExitCode;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use lily::mongo::mongodb::bson::{Document, doc};
use lily::mongo::{MongoConfig, MongoScope, MongoTx, Outbox, handler_error};
use lily::prelude::*;
use lily::topology::QueueKind;

type BoxError = Box<dyn StdError + Send + Sync>;

/// The payload of `order.placed`, and of the `order.accepted` event it causes.
#[derive(serde::Deserialize, serde::Serialize)]
struct Order {
    order_id: String,
    quantity: u32,
}

/// Accepts an order: its effect and its event, in the transaction Lily opened.
async fn accept(
    Json(order): Json<Order>,
    tx: MongoTx,
    outbox: Outbox,
    State(events): State<Destination>,
) -> HandlerResult {
    tx.database()
        .collection::<Document>("orders")
        .insert_one(doc! { "order_id": &order.order_id, "quantity": order.quantity })
        .session(&mut *tx.session().await)
        .await
        .map_err(|e| handler_error("order insert", e))?;
    let id = format!("{}.accepted", order.order_id);
    let event = Outgoing::json("order.accepted", &id, &order)
        .map_err(|e| QueueHandlerError::permanent("event does not serialize").with_source(e))?;
    outbox.stage(&events, &event).await
}

fn var(name: &str, default: &str) -> String {
    std::env::var(name).unwrap_or_else(|_| default.to_owned())
}

fn required(name: &str) -> Result<String, BoxError> {
    std::env::var(name).map_err(|_| format!("{name} is required").into())
}

/// `OUTBOX_FAULT=abort_after_commit:N`: the commit after which the process aborts.
fn fault() -> Result<Option<u64>, BoxError> {
    match std::env::var("OUTBOX_FAULT").as_deref() {
        Err(_) | Ok("") => Ok(None),
        Ok(fault) => fault
            .strip_prefix("abort_after_commit:")
            .and_then(|n| n.parse().ok())
            .filter(|n| *n > 0)
            .map(Some)
            .ok_or_else(|| "OUTBOX_FAULT must be abort_after_commit:N, N > 0".into()),
    }
}

async fn serve() -> Result<ExitCode, BoxError> {
    let queue = var("LILY_QUEUE", "orders");
    let events = var("LILY_EVENTS", &format!("{queue}.events"));
    let prefetch: u16 = var("LILY_PREFETCH", "50").parse()?;
    let kind = match var("LILY_QUEUE_TYPE", "classic").as_str() {
        "classic" => QueueKind::Classic,
        "quorum" => QueueKind::Quorum,
        other => return Err(format!("LILY_QUEUE_TYPE {other:?}: classic or quorum").into()),
    };
    let mut mongo = MongoConfig::new("order-service");
    if let Some(after) = fault()? {
        let commits = Arc::new(AtomicU64::new(0));
        mongo = mongo.on_committed(move |_| {
            if commits.fetch_add(1, Ordering::SeqCst) + 1 == after {
                eprintln!("outbox: OUTBOX_FAULT=abort_after_commit:{after}: aborting");
                std::process::abort();
            }
        });
    }
    let database = var("LILY_MONGO_DB", "orders_demo");
    let scope = MongoScope::connect(&required("LILY_MONGO_URL")?, &database, mongo).await?;
    let router = Router::new()
        .route("order.placed", accept)
        .with_state(Destination::queue(&events));
    let mut config = ConsumerConfig::new(&queue);
    config.queue_kind = kind;
    config.prefetch = prefetch;
    config.concurrency = usize::from(prefetch);
    eprintln!("outbox: serving {queue} into database {database}, events to {events}");
    let consumer = Consumer::new(required("LILY_AMQP_URL")?, config, router).scope(scope);
    let report = consumer.run_until_signal(ReportSinks::default()).await?;
    Ok(report.exit_status())
}

#[tokio::main]
async fn main() -> ExitCode {
    lily::logging::init("warn,lily_mq_rabbit=info,lily_mq_mongo=info");
    match std::env::args().nth(1).as_deref() {
        Some("serve") => serve().await.unwrap_or_else(|err| {
            eprintln!("outbox: {err}");
            ExitCode::FAILURE
        }),
        _ => {
            eprintln!("usage: outbox serve (see the crate's documentation for the environment)");
            ExitCode::from(2)
        }
    }
}
