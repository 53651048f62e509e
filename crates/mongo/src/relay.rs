//! The outbox relay: publishes staged messages with the [`Publisher`]'s evidence, in staging
//! order batch by batch (a batch's publishes go out together, so their order at the broker
//! within it is not promised), and only then marks them sent; ends what can never be sent as
//! failed, with its reason; backs off while the broker fails. One relay publishes an outbox at
//! a time.
//!
//! **At least once.** A relay that stops between a confirm and its mark (a crash, a lost
//! database) leaves the message staged, and the next relay publishes it again with the same
//! message id: a Lily consumer's inbox suppresses the second copy.
//!
//! **One at a time.** Relays share the outbox through a lease (`<prefix>outbox_relays`, one
//! document per outbox name), renewed before each batch. A batch's publishes end within twice
//! the publisher's confirm timeout (the first message to a new exchange goes ahead of the rest),
//! so with a lease TTL longer than that a relay that lost its lease has finished publishing
//! before another may start. Clocks: the lease's expiry is the database's time
//! written by the relay's host; hosts whose clocks differ by more than the TTL's margin can
//! overlap, which costs duplicates, never a loss.
//!
//! **Never a loop.** A message the broker can never take ends `failed` with its reason: no
//! queue bound for it (returned), an exchange that does not exist, a body over the broker's
//! maximum message size, a permission the broker refuses, or a message that keeps failing
//! while others in its batch are confirmed ([`RelayConfig::max_failures`] times). A batch
//! none of whose messages is confirmed is the broker failing: it is tried again after a backoff
//! that doubles up to [`RelayConfig::max_backoff`], and nothing is counted against its messages.

use std::sync::Arc;
use std::time::Duration;

use lily_mq_core::{BoxFuture, OutboxRelay, OutboxReport, Reason, Resources};
use lily_mq_rabbit::{Destination, Outgoing, Published, Publisher};
use mongodb::bson::{Bson, DateTime, Document, doc};
use mongodb::{Collection, error::ErrorKind};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use crate::outbox::{FAILED, SENT, STAGED};

/// How the relay works.
#[derive(Clone, Debug)]
pub struct RelayConfig {
    name: String,
    batch: usize,
    poll: Duration,
    lease_ttl: Duration,
    sent_retention: Duration,
    max_body: usize,
    max_failures: u32,
    max_backoff: Duration,
}

impl Default for RelayConfig {
    fn default() -> Self {
        Self {
            name: "outbox".to_owned(),
            batch: 100,
            poll: Duration::from_millis(250),
            lease_ttl: Duration::from_secs(30),
            sent_retention: Duration::from_secs(7 * 24 * 3600),
            max_body: 16 * 1024 * 1024,
            max_failures: 10,
            max_backoff: Duration::from_secs(5),
        }
    }
}

impl RelayConfig {
    /// The outbox's name in the lease, the metrics and the shutdown report (`outbox` unless
    /// set), cut to 255 bytes.
    #[must_use]
    pub fn name(mut self, name: &str) -> Self {
        let mut end = name.len().min(255);
        while !name.is_char_boundary(end) {
            end -= 1;
        }
        name[..end].clone_into(&mut self.name);
        self
    }

    /// How long the relay waits when nothing is staged (250 ms unless set).
    #[must_use]
    pub fn poll(mut self, every: Duration) -> Self {
        self.poll = every;
        self
    }

    /// The relay's lease time to live (30 s unless set); keep it longer than twice the
    /// publisher's confirm timeout.
    #[must_use]
    pub fn lease_ttl(mut self, ttl: Duration) -> Self {
        self.lease_ttl = ttl;
        self
    }

    /// How long sent records are kept before their TTL index deletes them (7 days unless set).
    #[must_use]
    pub fn sent_retention(mut self, retention: Duration) -> Self {
        self.sent_retention = retention;
        self
    }

    /// The broker's largest message body (`max_message_size`: 16 MiB on RabbitMQ 4.0, 128 MiB
    /// on 3.x); a larger one ends failed, unpublished.
    #[must_use]
    pub fn max_body(mut self, bytes: usize) -> Self {
        self.max_body = bytes;
        self
    }

    /// How many times a message may fail while others are confirmed before it ends failed
    /// (10 unless set).
    #[must_use]
    pub fn max_failures(mut self, failures: u32) -> Self {
        self.max_failures = failures.max(1);
        self
    }

    /// The longest pause while the broker fails (5 s unless set).
    #[must_use]
    pub fn max_backoff(mut self, backoff: Duration) -> Self {
        self.max_backoff = backoff;
        self
    }
}

/// Publishes an outbox's staged messages; see the module's documentation.
pub struct Relay {
    outbox: Collection<Document>,
    relays: Collection<Document>,
    publisher: Arc<Publisher>,
    config: RelayConfig,
    owner: String,
    /// Told when a delivery's transaction in this process staged and committed.
    staged: Arc<tokio::sync::Notify>,
    /// The exchanges publishes were confirmed to (the default exchange always exists).
    known: std::sync::Mutex<std::collections::HashSet<String>>,
}

/// What a relay works on: a scope's outbox, the relays' leases, and the notice of this
/// process's commits that staged.
pub(crate) struct Source {
    pub(crate) outbox: Collection<Document>,
    pub(crate) relays: Collection<Document>,
    pub(crate) staged: Arc<tokio::sync::Notify>,
}

/// The outcome of one staged message's publish.
enum Verdict {
    Sent,
    Failed(Reason),
    /// The exchange named does not exist.
    Missing(String),
    Again(Reason),
}

impl Relay {
    /// A relay of `source`, publishing through `publisher` (a user's comes from
    /// [`Relay::new`], beside the scope).
    pub(crate) fn of(source: Source, publisher: Arc<Publisher>, config: RelayConfig) -> Self {
        Self {
            outbox: source.outbox,
            relays: source.relays,
            publisher,
            config,
            owner: crate::lease::owner_token(),
            staged: source.staged,
            known: std::sync::Mutex::default(),
        }
    }

    /// Publishes until `stop` is cancelled; a batch under way is finished first (within twice
    /// the publisher's confirm timeout), then the lease is given up and what stays staged is
    /// counted (each within 2 s).
    pub async fn run(self, stop: CancellationToken) -> OutboxReport {
        let mut report = OutboxReport {
            outbox: self.config.name.clone(),
            ..OutboxReport::default()
        };
        let mut backoff = Duration::ZERO;
        let gauges = Gauges::new(&self.config.name);
        let mut measured: Option<Instant> = None;
        let mut unmarked = Vec::new();
        // Reads, the lease and the marks give way to `stop` (a database that does not answer
        // must not hold shutdown); a batch being published is finished.
        while !stop.is_cancelled() {
            if measured.is_none_or(|at| at.elapsed() >= Duration::from_secs(5)) {
                if or_stop(&stop, gauges.measure(&self.outbox)).await.is_none() {
                    break;
                }
                measured = Some(Instant::now());
            }
            let pause = if !unmarked.is_empty() {
                // Confirmed, not yet marked: their marks are written before anything else is
                // published, so a database that reads but does not write gets no duplicates.
                let Some(marked) = or_stop(&stop, self.mark_sent(&mut unmarked, &mut report)).await
                else {
                    break;
                };
                backoff = next_backoff(backoff, !marked, self.config.max_backoff);
                backoff
            } else {
                // The lease is renewed only when there is something to publish: an idle outbox
                // costs one indexed read a poll.
                let Some(staged) = or_stop(&stop, self.anything_staged()).await else {
                    break;
                };
                let held = if staged {
                    or_stop(&stop, self.hold()).await
                } else {
                    Some(false)
                };
                match held {
                    None => break,
                    Some(false) if !staged => self.config.poll,
                    Some(false) => self.config.poll.max(self.config.lease_ttl / 10),
                    Some(true) => match or_stop(&stop, self.batch()).await {
                        None => break,
                        Some(Ok(batch)) if batch.is_empty() => self.config.poll,
                        Some(Ok(batch)) => {
                            let failing = self.publish(batch, &mut report, &mut unmarked).await;
                            backoff = next_backoff(backoff, failing, self.config.max_backoff);
                            backoff
                        }
                        Some(Err(err)) => {
                            warn!(outbox = %self.config.name, error = %crate::tx::code_of(&err), "outbox read failed");
                            self.config.max_backoff
                        }
                    },
                }
            };
            // Idle, a commit in this process that staged a message wakes the relay at once;
            // what other processes stage waits for the poll.
            let idle = pause == self.config.poll;
            if !pause.is_zero() {
                tokio::select! {
                    () = stop.cancelled() => {}
                    () = tokio::time::sleep(pause) => {}
                    () = self.staged.notified(), if idle => {}
                }
            }
        }
        if !unmarked.is_empty() {
            let marked = self.mark_sent(&mut unmarked, &mut report);
            let _ = tokio::time::timeout(FINAL_WAIT, marked).await;
        }
        let released = self
            .relays
            .delete_one(doc! { "_id": &self.config.name, "owner": &self.owner });
        let _ = tokio::time::timeout(FINAL_WAIT, released).await;
        let staged = self.outbox.count_documents(doc! { "state": STAGED });
        report.staged = tokio::time::timeout(FINAL_WAIT, staged)
            .await
            .ok()
            .and_then(Result::ok);
        let _ = tokio::time::timeout(FINAL_WAIT, gauges.measure(&self.outbox)).await;
        report
    }

    /// Whether anything is staged; a read that fails says yes, and the batch's read reports it.
    async fn anything_staged(&self) -> bool {
        let found = self
            .outbox
            .find_one(doc! { "state": STAGED })
            .projection(doc! { "_id": 1 })
            .await;
        !matches!(found, Ok(None))
    }

    /// Takes or renews the lease; whether this relay holds it now.
    async fn hold(&self) -> bool {
        let now = DateTime::now();
        let ttl = i64::try_from(self.config.lease_ttl.as_millis()).unwrap_or(i64::MAX);
        let expires = DateTime::from_millis(now.timestamp_millis().saturating_add(ttl));
        let filter = doc! {
            "_id": &self.config.name,
            "$or": [{ "owner": &self.owner }, { "expires_at": { "$lt": now } }],
        };
        let update = doc! { "$set": { "owner": &self.owner, "expires_at": expires } };
        match self.relays.update_one(filter, update).upsert(true).await {
            Ok(_) => true,
            Err(err) if crate::lease::is_duplicate_key(&err) => false,
            Err(err) => {
                if !matches!(err.kind.as_ref(), ErrorKind::ServerSelection { .. }) {
                    warn!(outbox = %self.config.name, error = %crate::tx::code_of(&err), "outbox lease not renewed");
                }
                false
            }
        }
    }

    /// The oldest staged records, at most a batch.
    async fn batch(&self) -> mongodb::error::Result<Vec<Document>> {
        let mut cursor = self
            .outbox
            .find(doc! { "state": STAGED })
            .sort(doc! { "_id": 1 })
            .limit(i64::try_from(self.config.batch).unwrap_or(100))
            .await?;
        let mut batch = Vec::new();
        while cursor.advance().await? {
            batch.push(cursor.deserialize_current()?);
        }
        Ok(batch)
    }

    /// Publishes `batch` at once, in staging order, and marks what became of each; whether to
    /// back off: the broker failed the batch (nothing confirmed, something to try again), or
    /// the sent marks were not written.
    ///
    /// A publish to an exchange that does not exist closes its channel, and every publish in
    /// flight on it ends without evidence (to be published again). So the first message to an
    /// exchange this relay has not seen confirm goes first, alone with the others of its kind;
    /// the rest of the batch follows, and what is addressed to an exchange found missing ends
    /// failed without being published.
    async fn publish(
        &self,
        batch: Vec<Document>,
        report: &mut OutboxReport,
        unmarked: &mut Vec<Bson>,
    ) -> bool {
        let exchange = |record: &Document| record.get_str("exchange").unwrap_or("").to_owned();
        let mut firsts = Vec::new();
        {
            let known = crate::lock(&self.known);
            let mut seen = std::collections::HashSet::new();
            for (i, record) in batch.iter().enumerate() {
                let name = exchange(record);
                if !name.is_empty() && !known.contains(&name) && seen.insert(name) {
                    firsts.push(i);
                }
            }
        }
        let mut verdicts: Vec<Option<Verdict>> = batch.iter().map(|_| None).collect();
        let probes = firsts
            .iter()
            .map(|i| Box::pin(self.publish_one(&batch[*i])));
        for (i, verdict) in firsts
            .iter()
            .zip(futures_util::future::join_all(probes).await)
        {
            verdicts[*i] = Some(verdict);
        }
        let missing: std::collections::HashSet<String> = firsts
            .iter()
            .filter(|i| matches!(verdicts[**i], Some(Verdict::Missing(_))))
            .map(|i| exchange(&batch[*i]))
            .collect();
        let rest: Vec<usize> = (0..batch.len())
            .filter(|i| verdicts[*i].is_none())
            .collect();
        let publishes = rest.iter().map(|i| {
            let record = &batch[*i];
            let missing = missing.contains(&exchange(record));
            Box::pin(async move {
                if missing {
                    Verdict::Missing(exchange(record))
                } else {
                    self.publish_one(record).await
                }
            })
        });
        for (i, verdict) in rest
            .iter()
            .zip(futures_util::future::join_all(publishes).await)
        {
            verdicts[*i] = Some(verdict);
        }
        let verdicts: Vec<Verdict> = verdicts.into_iter().flatten().collect();
        {
            let mut known = crate::lock(&self.known);
            for (record, verdict) in batch.iter().zip(&verdicts) {
                match verdict {
                    Verdict::Sent => known.insert(exchange(record)),
                    Verdict::Missing(name) => known.remove(name),
                    _ => false,
                };
            }
        }
        let any_sent = verdicts.iter().any(|v| matches!(v, Verdict::Sent));
        let any_again = verdicts.iter().any(|v| matches!(v, Verdict::Again(_)));
        let now = DateTime::now();
        let mut sent = Vec::new();
        for (record, verdict) in batch.iter().zip(verdicts) {
            let Some(id) = record.get("_id").cloned() else {
                continue;
            };
            let message_id = record.get_str("message_id").unwrap_or("-");
            let tries = u32::try_from(crate::outbox::count(record.get("failures")))
                .unwrap_or(u32::MAX)
                .saturating_add(1);
            let failed = match verdict {
                Verdict::Sent => {
                    sent.push(id);
                    continue;
                }
                Verdict::Failed(reason) => reason,
                Verdict::Missing(name) => Reason::new(format!("exchange '{name}' does not exist")),
                // The broker takes the others: this one is the trouble.
                Verdict::Again(reason) if any_sent && tries >= self.config.max_failures => {
                    Reason::new(format!("not confirmed in {tries} tries: {reason}"))
                }
                Verdict::Again(_) if any_sent => {
                    let _ = self
                        .outbox
                        .update_one(
                            doc! { "_id": id, "state": STAGED },
                            doc! { "$inc": { "failures": 1 } },
                        )
                        .await;
                    continue;
                }
                Verdict::Again(_) => continue,
            };
            let marked = self
                .outbox
                .update_one(
                    doc! { "_id": id, "state": STAGED },
                    doc! { "$set": { "state": FAILED, "reason": failed.as_str(), "failed_at": now } },
                )
                .await;
            if matches!(marked, Ok(r) if r.modified_count == 1) {
                report.failed += 1;
                warn!(outbox = %self.config.name, message_id, reason = %failed, "outbox message failed");
            }
        }
        *unmarked = sent;
        if !self.mark_sent(unmarked, report).await {
            return true;
        }
        !any_sent && any_again
    }

    /// Marks the confirmed records of `ids` sent and empties `ids`; false, keeping them, when
    /// the marks were not written (they are tried again after the backoff; a relay that stops
    /// first leaves them staged, to be published again).
    async fn mark_sent(&self, ids: &mut Vec<Bson>, report: &mut OutboxReport) -> bool {
        if ids.is_empty() {
            return true;
        }
        let now = DateTime::now();
        let retention = i64::try_from(self.config.sent_retention.as_millis()).unwrap_or(i64::MAX);
        let expires = DateTime::from_millis(now.timestamp_millis().saturating_add(retention));
        let marked = self
            .outbox
            .update_many(
                doc! { "_id": { "$in": ids.as_slice() }, "state": STAGED },
                doc! { "$set": { "state": SENT, "sent_at": now, "expires_at": expires } },
            )
            .await;
        match marked {
            Ok(r) => {
                report.sent += r.modified_count;
                ids.clear();
                true
            }
            Err(err) => {
                info!(outbox = %self.config.name, error = %crate::tx::code_of(&err), "outbox sent marks not written; tried again before anything else is published");
                false
            }
        }
    }

    async fn publish_one(&self, record: &Document) -> Verdict {
        let (Ok(exchange), Ok(routing_key), Ok(bytes)) = (
            record.get_str("exchange"),
            record.get_str("routing_key"),
            record.get_binary_generic("message"),
        ) else {
            return Verdict::Failed(Reason::new("not an outbox record"));
        };
        let message = match Outgoing::decode(bytes) {
            Ok(message) => message,
            Err(reason) => return Verdict::Failed(reason),
        };
        if message.body().len() > self.config.max_body {
            return Verdict::Failed(Reason::new(format!(
                "body of {} bytes is over the broker's maximum message size ({} bytes)",
                message.body().len(),
                self.config.max_body
            )));
        }
        let to = Destination::exchange(exchange, routing_key);
        match self.publisher.publish(&to, message).await {
            Published::Confirmed => Verdict::Sent,
            Published::Returned => Verdict::Failed(Reason::new(format!(
                "returned: no queue bound to exchange '{exchange}' for routing key '{routing_key}'"
            ))),
            Published::NoExchange => Verdict::Missing(exchange.to_owned()),
            Published::Refused(reason) => Verdict::Failed(reason),
            // The refusal names the exchange it was for: the publishes that failed with it on
            // the same channel, to other exchanges, are tried again.
            Published::Failed => match self.publisher.refused() {
                Some(missing) if refuses(&missing.resource, exchange) => {
                    Verdict::Failed(Reason::new(format!("access refused: {missing}")))
                }
                _ => Verdict::Again(Reason::new("publish failed")),
            },
            other => Verdict::Again(Reason::new(format!("{other:?}"))),
        }
    }
}

/// Whether the resource a refusal names (`exchange 'orders' in vhost '/'`) is `exchange` (`""`
/// being the default exchange, which the broker calls `amq.default`).
fn refuses(resource: &str, exchange: &str) -> bool {
    let name = if exchange.is_empty() {
        "amq.default"
    } else {
        exchange
    };
    resource
        .strip_prefix("exchange '")
        .and_then(|rest| rest.strip_prefix(name))
        .is_some_and(|rest| rest.starts_with('\''))
}

/// `work`'s output, or `None` when `stop` fires first.
async fn or_stop<T>(stop: &CancellationToken, work: impl Future<Output = T>) -> Option<T> {
    tokio::select! {
        biased;
        () = stop.cancelled() => None,
        out = work => Some(out),
    }
}

/// The pause after `backoff`: doubled (from 100 ms) up to `max` while `failing`, none otherwise.
fn next_backoff(backoff: Duration, failing: bool, max: Duration) -> Duration {
    if failing {
        (backoff * 2).max(Duration::from_millis(100)).min(max)
    } else {
        Duration::ZERO
    }
}

/// The longest wait for each of the database's last answers once the relay stops.
const FINAL_WAIT: Duration = Duration::from_secs(2);

/// A scope's relay before it has a publisher: the consumer lends one when it starts it.
pub(crate) struct ScopeRelay {
    pub(crate) source: Source,
    pub(crate) config: RelayConfig,
}

impl OutboxRelay for ScopeRelay {
    fn run(
        self: Box<Self>,
        offered: Resources,
        stop: CancellationToken,
    ) -> BoxFuture<'static, OutboxReport> {
        Box::pin(async move {
            let Some(publisher) = offered.get::<Publisher>() else {
                warn!(outbox = %self.config.name, "the consumer lent the outbox relay no publisher; it does not run");
                return OutboxReport {
                    outbox: self.config.name,
                    ..OutboxReport::default()
                };
            };
            Relay::of(self.source, publisher, self.config)
                .run(stop)
                .await
        })
    }
}

/// `lily_outbox_pending{outbox}` and `lily_outbox_oldest_seconds{outbox}`.
struct Gauges {
    pending: metrics::Gauge,
    oldest: metrics::Gauge,
}

impl Gauges {
    fn new(name: &str) -> Self {
        Self {
            pending: metrics::gauge!("lily_outbox_pending", "outbox" => name.to_owned()),
            oldest: metrics::gauge!("lily_outbox_oldest_seconds", "outbox" => name.to_owned()),
        }
    }

    async fn measure(&self, outbox: &Collection<Document>) {
        if let Ok(n) = outbox.count_documents(doc! { "state": STAGED }).await {
            self.pending.set(n as f64);
        }
        let oldest = outbox
            .find_one(doc! { "state": STAGED })
            .sort(doc! { "_id": 1 })
            .await;
        if let Ok(oldest) = oldest {
            let age = oldest
                .and_then(|r| r.get_datetime("staged_at").ok().copied())
                .map_or(0, |at| {
                    DateTime::now().timestamp_millis() - at.timestamp_millis()
                });
            self.oldest.set(age.max(0) as f64 / 1000.0);
        }
    }
}
