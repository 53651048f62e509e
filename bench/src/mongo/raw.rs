//! The raw contender: lapin + the mongodb driver, a transactional-inbox consumer written by hand
//! as the driver's documentation describes it; in the outbox case the event is published after
//! the commit, on a confirm channel (what the outbox is for). Method: `bench/README.md`.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use lapin::options::{BasicAckOptions, BasicNackOptions};
use lapin::{BasicProperties, Channel, Confirmation};
use mongodb::bson::{Document, doc};
use mongodb::error::{
    Error, ErrorKind, TRANSIENT_TRANSACTION_ERROR, UNKNOWN_TRANSACTION_COMMIT_RESULT, WriteFailure,
};
use mongodb::options::{Acknowledgment, ReadConcern, WriteConcern};
use mongodb::{ClientSession, Database};
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

use crate::Order;
use crate::mongo::{Case, Counters, EVENTS, Load, QUEUE, RAW_INBOX, bump, effect};
use crate::raw::{MANDATORY, REQUEUE, close, confirm_channel, next, open};
use crate::run::{Sample, run_limit};

/// How long one delivery may spend before it is NACKed (Lily's default settlement budget).
const BUDGET: Duration = Duration::from_secs(10);

/// What every delivery's task shares.
struct Store {
    database: Database,
    case: Case,
    /// The outbox case's confirm channel.
    events: Option<Channel>,
    counters: Arc<Counters>,
    /// Deliveries written and ACKed; `done` when `n` are.
    acked: AtomicU64,
    n: u64,
    done: CancellationToken,
}

/// Consumes until `n` messages are committed and ACKed (or the run limit passes): a task a
/// delivery, at most `concurrency`.
///
/// # Panics
/// When the broker refuses the connection, the channel, the QoS or the consumer.
pub async fn consume(
    url: &str,
    load: &Load,
    database: Database,
    counters: Arc<Counters>,
) -> Sample {
    let started = Instant::now();
    let deadline = tokio::time::Instant::now() + run_limit(load.n);
    let (connection, channel, mut consumer) = open(url, QUEUE, load.prefetch, false)
        .await
        .expect("consume");
    let events = match load.case {
        Case::Outbox => Some(confirm_channel(&connection).await),
        _ => None,
    };
    let store = Arc::new(Store {
        database,
        case: load.case,
        events,
        counters,
        acked: AtomicU64::new(0),
        n: load.n,
        done: CancellationToken::new(),
    });
    let mut tasks = JoinSet::new();
    let feed = async {
        loop {
            while tasks.len() >= load.concurrency {
                tasks.join_next().await;
            }
            let Some(Ok(delivery)) = next(&mut consumer).await else {
                break;
            };
            tasks.spawn(handle(Arc::clone(&store), delivery));
        }
    };
    let _ = tokio::time::timeout_at(deadline, store.done.run_until_cancelled(feed)).await;
    let elapsed = started.elapsed();
    let settled = store.acked.load(Ordering::Relaxed);
    // Nothing is left running after `n` ACKs but deliveries beyond them (none in a clean run).
    tasks.abort_all();
    while tasks.join_next().await.is_some() {}
    close(connection, channel, &consumer).await;
    Sample::new(settled, load.n, elapsed)
}

/// One delivery: the transaction (and the event), then the ACK, counted; on any other failure,
/// or past [`BUDGET`], a NACK with requeue.
async fn handle(store: Arc<Store>, delivery: lapin::message::Delivery) {
    let id = delivery
        .properties
        .message_id()
        .as_ref()
        .map(|id| id.as_str().to_owned());
    let order = serde_json::from_slice::<Order>(&delivery.data);
    let (Some(id), Ok(order)) = (id, order) else {
        // Not one of ours: a careful user dead-letters it (the queue's DLX takes it).
        let _ = delivery.acker.nack(BasicNackOptions::default()).await;
        return;
    };
    let settled = async {
        let committed = transaction(&store, &id, &order).await?;
        if let (Some(events), Some(at)) = (&store.events, committed) {
            publish(events, &id).await?;
            let us = u64::try_from(at.elapsed().as_micros()).unwrap_or(u64::MAX);
            let published = &store.counters.published_us;
            published.lock().expect("latencies").push(us);
        }
        Ok::<(), Error>(())
    };
    match tokio::time::timeout(BUDGET, settled).await {
        Ok(Ok(())) => {
            let acked = delivery.acker.ack(BasicAckOptions::default()).await;
            if matches!(acked, Ok(true))
                && store.acked.fetch_add(1, Ordering::Relaxed) + 1 >= store.n
            {
                store.done.cancel();
            }
        }
        Ok(Err(_)) | Err(_) => {
            let _ = delivery.acker.nack(REQUEUE).await;
        }
    }
}

/// The event of message `id`, mandatory and persistent, and its confirm; a return or a nack is
/// an error (the delivery is requeued, and its redelivery finds the inbox record: the event is
/// lost, as it would be in this code).
async fn publish(events: &Channel, id: &str) -> Result<(), Error> {
    let properties = BasicProperties::default()
        .with_message_id(format!("{id}.event").into())
        .with_type("order.accepted".into())
        .with_content_type("application/json".into())
        .with_delivery_mode(2);
    let body = br#"{"accepted":true}"#;
    let confirm = match events
        .basic_publish("".into(), EVENTS.into(), MANDATORY, body, properties)
        .await
    {
        Ok(confirm) => confirm.await,
        Err(err) => Err(err),
    };
    match confirm {
        Ok(Confirmation::Ack(None)) => Ok(()),
        other => Err(Error::custom(format!("event not confirmed: {other:?}"))),
    }
}

/// The driver's documented pattern: the whole transaction again on a transient error, the
/// commit again on an unknown commit result. When this call committed: the time its commit
/// began; `None` for a duplicate.
async fn transaction(store: &Store, id: &str, order: &Order) -> Result<Option<Instant>, Error> {
    let counters = &store.counters;
    let mut session = store.database.client().start_session().await?;
    'transaction: loop {
        bump(&counters.attempts);
        session
            .start_transaction()
            .read_concern(ReadConcern::snapshot())
            .write_concern(WriteConcern::builder().w(Acknowledgment::Majority).build())
            .await?;
        let written = writes(store, &mut session, id, order).await;
        if !matches!(written, Ok(true)) {
            let _ = session.abort_transaction().await;
        }
        match written {
            Ok(true) => {}
            Ok(false) => return Ok(None),
            Err(err) if err.contains_label(TRANSIENT_TRANSACTION_ERROR) => {
                bump(&counters.conflicts);
                continue 'transaction;
            }
            Err(err) => return Err(err),
        }
        let commit = Instant::now();
        loop {
            match session.commit_transaction().await {
                Ok(()) => {
                    bump(&counters.commits);
                    return Ok(Some(commit));
                }
                Err(err) if err.contains_label(UNKNOWN_TRANSACTION_COMMIT_RESULT) => {}
                Err(err) if err.contains_label(TRANSIENT_TRANSACTION_ERROR) => {
                    bump(&counters.conflicts);
                    continue 'transaction;
                }
                Err(err) => return Err(err),
            }
        }
    }
}

/// The inbox record and the effect, in `session`'s transaction: `false` when the inbox holds
/// the message already (processed before: nothing written).
async fn writes(
    store: &Store,
    session: &mut ClientSession,
    id: &str,
    order: &Order,
) -> Result<bool, Error> {
    let inbox = store.database.collection::<Document>(RAW_INBOX);
    match inbox
        .insert_one(doc! { "_id": id })
        .session(&mut *session)
        .await
    {
        Err(err) if is_duplicate_key(&err) => return Ok(false),
        inserted => inserted?,
    };
    effect(&store.database, session, id, order, store.case).await?;
    Ok(true)
}

/// A duplicate key write error (E11000).
fn is_duplicate_key(err: &Error) -> bool {
    match err.kind.as_ref() {
        ErrorKind::Write(WriteFailure::WriteError(e)) => e.code == 11000,
        ErrorKind::Command(e) => e.code == 11000,
        _ => false,
    }
}
