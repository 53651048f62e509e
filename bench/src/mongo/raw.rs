//! The raw contender: lapin + the mongodb driver, a transactional-inbox consumer written by hand
//! as the driver's documentation describes it: a task a delivery (at most `concurrency`), one
//! transaction each (inbox record, effect, hot keys' `$inc`), the whole transaction again on a
//! `TransientTransactionError`, the commit again on `UnknownTransactionCommitResult`, then the
//! ACK; otherwise, or past Lily's 10 s budget, a NACK with requeue. In the outbox case the event
//! is published after the commit, mandatory and persistent, on a confirm channel of the same
//! connection, and the ACK waits for its confirm (a crash in between loses the event: what the
//! outbox is for). Method: `bench/README.md`.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use lapin::Confirmation;
use lapin::options::{
    BasicAckOptions, BasicCancelOptions, BasicNackOptions, BasicPublishOptions,
    ConfirmSelectOptions,
};
use lapin::{BasicProperties, Channel};
use mongodb::bson::{Document, doc};
use mongodb::error::{
    Error, ErrorKind, TRANSIENT_TRANSACTION_ERROR, UNKNOWN_TRANSACTION_COMMIT_RESULT, WriteFailure,
};
use mongodb::options::{Acknowledgment, ReadConcern, WriteConcern};
use mongodb::{Client, ClientSession, Collection};
use tokio::sync::Semaphore;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

use crate::Order;
use crate::mongo::{
    COUNTERS, Case, Counters, DATABASE, EFFECTS, EVENTS, Load, RAW_INBOX, hot_key, index_of,
};
use crate::run::{Sample, run_limit};

/// How long one delivery may spend on its transaction before it is NACKed (Lily's default
/// settlement budget).
const BUDGET: Duration = Duration::from_secs(10);

/// The collections a task writes.
struct Store {
    client: Client,
    inbox: Collection<Document>,
    effects: Collection<Document>,
    counters: Collection<Document>,
    case: Case,
    /// The outbox case's confirm channel.
    events: Option<Channel>,
}

/// Consumes until `n` messages are committed and ACKed (or the run limit passes).
///
/// # Panics
/// When the broker refuses the connection, the channel, the QoS or the consumer.
pub async fn consume(load: &Load<'_>, client: Client, counters: Arc<Counters>) -> Sample {
    let Load {
        url,
        queue,
        case,
        concurrency,
        prefetch,
        n,
    } = *load;
    let database = client.database(DATABASE);
    let started = Instant::now();
    let deadline = tokio::time::Instant::now() + run_limit(n);
    let (connection, channel, mut consumer) = crate::raw::open(url, queue, prefetch, false)
        .await
        .expect("consume");
    let events = match case {
        Case::Outbox => {
            let events = connection.create_channel().await.expect("events channel");
            events
                .confirm_select(ConfirmSelectOptions::default())
                .await
                .expect("confirm select");
            Some(events)
        }
        _ => None,
    };
    let store = Arc::new(Store {
        inbox: database.collection(RAW_INBOX),
        effects: database.collection(EFFECTS),
        counters: database.collection(COUNTERS),
        client,
        case,
        events,
    });
    let permits = Arc::new(Semaphore::new(concurrency));
    let acked = Arc::new(AtomicU64::new(0));
    let done = CancellationToken::new();
    let mut tasks = JoinSet::new();
    loop {
        let permit = tokio::select! {
            permit = Arc::clone(&permits).acquire_owned() => permit.expect("semaphore open"),
            () = done.cancelled() => break,
            () = tokio::time::sleep_until(deadline) => break,
        };
        let delivery = tokio::select! {
            delivery = crate::raw::next(&mut consumer) => match delivery {
                Some(Ok(delivery)) => delivery,
                _ => break,
            },
            () = done.cancelled() => break,
            () = tokio::time::sleep_until(deadline) => break,
        };
        let (store, counters, acked, done) = (
            Arc::clone(&store),
            Arc::clone(&counters),
            Arc::clone(&acked),
            done.clone(),
        );
        tasks.spawn(async move {
            if handle(&store, &counters, delivery).await
                && acked.fetch_add(1, Ordering::Relaxed) + 1 >= n
            {
                done.cancel();
            }
            drop(permit);
        });
        while tasks.try_join_next().is_some() {}
    }
    let elapsed = started.elapsed();
    let settled = acked.load(Ordering::Relaxed);
    // Nothing is left running after `n` ACKs but deliveries beyond them (none in a clean run).
    tasks.abort_all();
    while tasks.join_next().await.is_some() {}
    let _ = channel
        .basic_cancel(consumer.tag(), BasicCancelOptions::default())
        .await;
    let _ = channel.close(200, "done".into()).await;
    let _ = connection.close(200, "done".into()).await;
    Sample::new(settled, n, elapsed)
}

/// One delivery: the transaction, then ACK (`true` when the ACK was written) or NACK.
async fn handle(store: &Store, counters: &Counters, delivery: lapin::message::Delivery) -> bool {
    let id = delivery
        .properties
        .message_id()
        .as_ref()
        .map(|id| id.as_str().to_owned());
    let order = serde_json::from_slice::<Order>(&delivery.data);
    let (Some(id), Ok(order)) = (id, order) else {
        // Not one of ours: a careful user dead-letters it (the queue's DLX takes it).
        let _ = delivery
            .acker
            .nack(BasicNackOptions {
                multiple: false,
                requeue: false,
            })
            .await;
        return false;
    };
    let settled = async {
        let committed = transaction(store, counters, &id, &order).await?;
        if let (Some(events), Some(at)) = (&store.events, committed) {
            publish(events, &id).await?;
            let us = u64::try_from(at.elapsed().as_micros()).unwrap_or(u64::MAX);
            counters.published_us.lock().expect("latencies").push(us);
        }
        Ok::<(), Error>(())
    };
    match tokio::time::timeout(BUDGET, settled).await {
        Ok(Ok(())) => matches!(
            delivery.acker.ack(BasicAckOptions::default()).await,
            Ok(true)
        ),
        Ok(Err(_)) | Err(_) => {
            Counters::bump(&counters.requeued);
            let _ = delivery.acker.nack(crate::raw::REQUEUE).await;
            false
        }
    }
}

/// What the writes of one transaction attempt found.
enum Written {
    /// The inbox already holds the message: processed before.
    Duplicate,
    /// Inbox record and effects written; commit next.
    Ready,
}

/// The event of message `id`, mandatory and persistent, and its confirm; a return or a nack is
/// an error (the delivery is requeued, and its redelivery finds the inbox record: the event is
/// lost, as it would be in this code).
async fn publish(events: &Channel, id: &str) -> Result<(), Error> {
    let failed = |what: String| Error::custom(what);
    let properties = BasicProperties::default()
        .with_message_id(format!("{id}.event").into())
        .with_type("order.accepted".into())
        .with_content_type("application/json".into())
        .with_delivery_mode(2);
    let confirm = events
        .basic_publish(
            "".into(),
            EVENTS.into(),
            BasicPublishOptions {
                mandatory: true,
                ..BasicPublishOptions::default()
            },
            br#"{"accepted":true}"#,
            properties,
        )
        .await
        .map_err(|e| failed(format!("publish: {e}")))?
        .await
        .map_err(|e| failed(format!("confirm: {e}")))?;
    match confirm {
        Confirmation::Ack(None) => Ok(()),
        other => Err(failed(format!("not confirmed: {other:?}"))),
    }
}

/// The driver's documented pattern: the whole transaction again on a transient error, the
/// commit again on an unknown commit result. When this call committed: the time its commit
/// began; `None` for a duplicate.
async fn transaction(
    store: &Store,
    counters: &Counters,
    id: &str,
    order: &Order,
) -> Result<Option<Instant>, Error> {
    let mut session = store.client.start_session().await?;
    'transaction: loop {
        Counters::bump(&counters.attempts);
        session
            .start_transaction()
            .read_concern(ReadConcern::snapshot())
            .write_concern(WriteConcern::builder().w(Acknowledgment::Majority).build())
            .await?;
        match writes(store, &mut session, id, order).await {
            Ok(Written::Ready) => {}
            Ok(Written::Duplicate) => {
                let _ = session.abort_transaction().await;
                return Ok(None);
            }
            Err(err) if err.contains_label(TRANSIENT_TRANSACTION_ERROR) => {
                Counters::bump(&counters.conflicts);
                let _ = session.abort_transaction().await;
                continue 'transaction;
            }
            Err(err) => {
                let _ = session.abort_transaction().await;
                return Err(err);
            }
        }
        let commit = Instant::now();
        loop {
            match session.commit_transaction().await {
                Ok(()) => {
                    Counters::bump(&counters.commits);
                    return Ok(Some(commit));
                }
                Err(err) if err.contains_label(UNKNOWN_TRANSACTION_COMMIT_RESULT) => {
                    Counters::bump(&counters.unknown_commits);
                }
                Err(err) if err.contains_label(TRANSIENT_TRANSACTION_ERROR) => {
                    Counters::bump(&counters.conflicts);
                    continue 'transaction;
                }
                Err(err) => return Err(err),
            }
        }
    }
}

async fn writes(
    store: &Store,
    session: &mut ClientSession,
    id: &str,
    order: &Order,
) -> Result<Written, Error> {
    match store
        .inbox
        .insert_one(doc! { "_id": id })
        .session(&mut *session)
        .await
    {
        Ok(_) => {}
        Err(err) if is_duplicate_key(&err) => return Ok(Written::Duplicate),
        Err(err) => return Err(err),
    }
    store
        .effects
        .insert_one(doc! { "_id": id, "sku": &order.sku, "quantity": i64::from(order.quantity) })
        .session(&mut *session)
        .await?;
    if store.case == Case::HotKeys {
        let key = hot_key(index_of(id).unwrap_or(0));
        store
            .counters
            .update_one(doc! { "_id": key }, doc! { "$inc": { "n": 1_i64 } })
            .session(&mut *session)
            .await?;
    }
    Ok(Written::Ready)
}

/// A duplicate key write error (E11000).
fn is_duplicate_key(err: &Error) -> bool {
    match err.kind.as_ref() {
        ErrorKind::Write(WriteFailure::WriteError(e)) => e.code == 11000,
        ErrorKind::Command(e) => e.code == 11000,
        _ => false,
    }
}
