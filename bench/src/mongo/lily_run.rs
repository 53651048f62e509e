//! The Lily contenders: the raw contender's effect writes in a handler, through `MongoTx`, in the
//! transaction Lily's `MongoScope` opens (with the inbox record) and commits before the ACK; in
//! the outbox case the handler also stages the event and the consumer's own relay publishes it.

use std::sync::Arc;
use std::time::Instant;

use lily::mongo::Outbox;
use lily::mongo::mongodb::Client;
use lily::mongo::mongodb::error::TRANSIENT_TRANSACTION_ERROR;
use lily::prelude::{
    Consumer, ConsumerConfig, Destination, Json, Meta, MongoConfig, MongoScope, MongoTx, Outgoing,
    Policy, QueueHandlerError, QueueKind, Router,
};

use crate::Order;
use crate::mongo::{
    CONSUMER, Case, Contender, Counters, DATABASE, EVENTS, Load, QUEUE, bump, effect,
};
use crate::run::{Lily, Sample, run_limit};
use crate::throughput::POLL;

/// The scope a contender runs with, on `client`, its indexes created (before the clock).
///
/// # Panics
/// When the database refuses the scope's indexes.
pub async fn scope(client: Client, who: Contender, counters: &Arc<Counters>) -> MongoScope {
    let committed = Arc::clone(counters);
    let mut config = MongoConfig::new(CONSUMER).on_committed(move |_| bump(&committed.commits));
    if who == Contender::LilyLease {
        config = config.with_lease();
    }
    MongoScope::with_client(client, DATABASE, config)
        .await
        .unwrap_or_else(|e| panic!("Lily's scope refused: {}", crate::mongo::db::kind(&e)))
}

/// Consumes until Lily's ledger counts `n` ACKs (or the run limit passes).
pub async fn consume(url: &str, load: &Load, scope: MongoScope, counters: Arc<Counters>) -> Sample {
    let (case, n) = (load.case, load.n);
    let router = Router::new().route(
        "order.placed",
        move |Json(order): Json<Order>, meta: Meta, tx: MongoTx, outbox: Outbox| {
            let counters = Arc::clone(&counters);
            async move {
                bump(&counters.attempts);
                let (database, id) = (tx.database(), meta.message_id());
                let written = effect(database, &mut *tx.session().await, id, &order, case).await;
                // A write conflict is transient: Lily runs the whole scope again, in-process.
                written.map_err(|err| {
                    if err.contains_label(TRANSIENT_TRANSACTION_ERROR) {
                        bump(&counters.conflicts);
                        QueueHandlerError::transient("effect write: transient transaction error")
                            .with_source(err)
                    } else {
                        QueueHandlerError::retryable("effect write failed").with_source(err)
                    }
                })?;
                if case == Case::Outbox {
                    let event = Outgoing::bytes(
                        "order.accepted",
                        &format!("{id}.event"),
                        "application/json",
                        br#"{"accepted":true}"#.to_vec(),
                    );
                    outbox.stage(&Destination::queue(EVENTS), &event).await?;
                }
                Ok(())
            }
        },
    );
    let config = ConsumerConfig::new(QUEUE)
        .queue_kind(QueueKind::Classic)
        .prefetch(load.prefetch)
        .concurrency(load.concurrency)
        .policy(Policy::default());
    let started = Instant::now();
    let lily = Lily::start(Consumer::new(url, config, router).scope(scope));
    let (limit, events) = (run_limit(n), u32::try_from(n).unwrap_or(u32::MAX));
    // The relay publishes after the commits: the outbox case ends with the last event queued.
    while !(lily.stats.totals().acked >= n
        && (case != Case::Outbox || crate::depth(url, EVENTS).await.unwrap_or(0) >= events))
        && started.elapsed() < limit
        && !lily.finished()
    {
        tokio::time::sleep(POLL).await;
    }
    let (elapsed, count) = (started.elapsed(), lily.stats.totals().acked);
    lily.stopped().await;
    Sample::new(count, n, elapsed)
}
