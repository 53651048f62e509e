//! The scope: opens the transaction, takes the lease, inserts the inbox record.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use lily_mq_core::{Begin, BoxFuture, Meta, OutboxRelay, Reason, Resources, TransactionalScope};
use lily_mq_rabbit::Publisher;
use mongodb::bson::{Document, doc};
use mongodb::error::TRANSIENT_TRANSACTION_ERROR;
use mongodb::options::{Acknowledgment, IndexOptions, ReadConcern, WriteConcern};
use mongodb::{Client, Collection, Database, IndexModel};
use tokio::sync::Mutex;
use tracing::debug;

use crate::connect::ConnectError;
use crate::deferrals::Deferrals;
use crate::inbox;
use crate::lease::{self, Refused, is_duplicate_key};
use crate::observer::CommitObserver;
use crate::relay::{Relay, RelayConfig, ScopeRelay, Source};
use crate::tx::{MongoTransaction, TxState, code_of};

/// Settings of the MongoDB scope.
#[derive(Clone)]
#[non_exhaustive]
pub struct MongoConfig {
    /// Names this consumer in inbox keys: two services consuming the same message each get
    /// their own record.
    pub consumer: String,
    /// How long inbox records are kept (TTL index). A redelivery after that runs the handler
    /// again: keep it longer than retry delays × attempts and any DLQ replay horizon.
    pub inbox_retention: Duration,
    /// Take a lease per message before the handler, fenced at commit (off by default; see
    /// [`with_lease`](Self::with_lease)).
    pub lease: bool,
    /// Lease time to live; renewed every third of it while the handler runs.
    pub lease_ttl: Duration,
    /// Cap on total lease extension: past it the lease is left to expire.
    pub lease_max_extension: Duration,
    /// Collections used by the scope, prefixed with this.
    pub collection_prefix: String,
    /// Called after each successful commit, before settlement: for metrics, audit, or a fault
    /// point in crash tests (the gap between commit and ACK is where redelivery meets the inbox).
    pub on_committed: Option<CommitObserver>,
    /// The outbox relay a consumer with this scope runs beside itself; `None` runs none (run
    /// a [`Relay`](crate::Relay) elsewhere then, or nothing staged is published).
    pub relay: Option<RelayConfig>,
}

impl std::fmt::Debug for MongoConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MongoConfig")
            .field("consumer", &self.consumer)
            .field("inbox_retention", &self.inbox_retention)
            .field("lease", &self.lease)
            .field("lease_ttl", &self.lease_ttl)
            .field("lease_max_extension", &self.lease_max_extension)
            .field("collection_prefix", &self.collection_prefix)
            .field("on_committed", &self.on_committed.is_some())
            .field("relay", &self.relay)
            .finish()
    }
}

impl MongoConfig {
    /// Defaults for `consumer`: 7-day inbox, no lease (when turned on: 30 s, renewed up to
    /// 10 minutes).
    pub fn new(consumer: impl Into<String>) -> Self {
        Self {
            consumer: consumer.into(),
            inbox_retention: Duration::from_secs(7 * 24 * 3600),
            lease: false,
            lease_ttl: Duration::from_secs(30),
            lease_max_extension: Duration::from_secs(600),
            collection_prefix: "lily_".into(),
            on_committed: None,
            relay: Some(RelayConfig::default()),
        }
    }

    /// Sets how the relay a consumer runs beside itself works ([`MongoConfig::relay`]).
    #[must_use]
    pub fn relay(mut self, relay: RelayConfig) -> Self {
        self.relay = Some(relay);
        self
    }

    /// Runs no outbox relay in the consumer: for services that stage nothing, or that run a
    /// [`Relay`](crate::Relay) of their own.
    #[must_use]
    pub fn without_relay(mut self) -> Self {
        self.relay = None;
        self
    }

    /// Calls `observer` after each successful commit, before settlement.
    #[must_use]
    pub fn on_committed(mut self, observer: impl Fn(&Meta) + Send + Sync + 'static) -> Self {
        self.on_committed = Some(Arc::new(observer));
        self
    }

    /// Takes a lease per message before its handler runs, renewed while it runs and fenced at
    /// commit: for handlers with effects outside the database.
    ///
    /// Without it, the inbox already keeps a second delivery of a message from running its
    /// handler while the first one's transaction is open: the inbox record is the
    /// transaction's first write, and the second insert conflicts with it. The lease carries
    /// that exclusion past the transaction (a handler outliving the server's
    /// `transactionLifetimeLimitSeconds`, whose transaction mongod aborts) and makes a stale
    /// owner's commit fail on its fence. It costs four more database operations a message:
    /// two majority writes before the handler runs, one inside the transaction and one after
    /// the commit (the guide's performance chapter).
    #[must_use]
    pub fn with_lease(mut self) -> Self {
        self.lease = true;
        self
    }

    /// Sets the lease TTL and its extension cap, and takes the lease
    /// ([`with_lease`](Self::with_lease)).
    #[must_use]
    pub fn lease_ttl(mut self, ttl: Duration, max_extension: Duration) -> Self {
        self.lease = true;
        self.lease_ttl = ttl;
        self.lease_max_extension = max_extension;
        self
    }

    /// Sets the inbox retention.
    #[must_use]
    pub fn inbox_retention(mut self, retention: Duration) -> Self {
        self.inbox_retention = retention;
        self
    }
}

/// Runs every handler in a MongoDB transaction with a transactional inbox, and a fenced lease
/// when [`MongoConfig::with_lease`] asks for one.
/// Install it with `Consumer::scope`.
#[derive(Clone, Debug)]
pub struct MongoScope(Arc<Inner>);

#[derive(Debug)]
struct Inner {
    client: Client,
    database: Database,
    config: MongoConfig,
    inbox: Collection<Document>,
    leases: Collection<Document>,
    fences: Collection<Document>,
    deferrals: Collection<Document>,
    outbox: Collection<Document>,
    relays: Collection<Document>,
    /// Told when a delivery's transaction that staged a message committed: this process's
    /// relays wake at once instead of at their next poll.
    staged: Arc<tokio::sync::Notify>,
    /// The marks of the handlings this process began and has not settled yet, by message id.
    handling: std::sync::Mutex<HashMap<Box<str>, String>>,
    /// The leases this process let go of without a confirmed release.
    abandoned: Arc<lease::Abandoned>,
}

/// The most handling marks remembered at once (one per delivery being handled, removed when it
/// ends); past it, they are forgotten (their marks then count as deaths, which only errs on
/// the side of stopping a message sooner).
const MAX_MARKS: usize = 65_536;

impl MongoScope {
    /// Connects to `url` (a replica set: transactions need one), uses `database`, and creates
    /// the inbox, lease and deferral collections' indexes.
    ///
    /// # Errors
    /// The database is unreachable or refused the indexes. When mongod closed a TLS handshake,
    /// which is how it refuses a client certificate, [`ConnectError::tls_hint`] says what is
    /// wrong with the certificate the URL names.
    pub async fn connect(
        url: &str,
        database: &str,
        config: MongoConfig,
    ) -> Result<Self, ConnectError> {
        let client = Client::with_uri_str(url)
            .await
            .map_err(|e| ConnectError::new(url, e))?;
        Self::with_client(client, database, config)
            .await
            .map_err(|e| ConnectError::new(url, e))
    }

    /// Like [`connect`](Self::connect) with a client the application built.
    ///
    /// # Errors
    /// The database refused the indexes.
    pub async fn with_client(
        client: Client,
        database: &str,
        config: MongoConfig,
    ) -> mongodb::error::Result<Self> {
        let database = client.database(database);
        // Lily's own writes are acknowledged by a majority and its reads see only what a
        // majority holds, whatever the URL or the server's defaults say: a write acknowledged
        // by a primary alone can be rolled back when that primary loses its term.
        let collection = |suffix: &str| {
            let name = format!("{}{suffix}", config.collection_prefix);
            database.collection_with_options::<Document>(&name, crate::majority())
        };
        let inbox = collection("inbox");
        let leases = collection("leases");
        let fences = collection("fences");
        let deferrals = collection("deferrals");
        let outbox = collection("outbox");
        let relays = collection("outbox_relays");
        crate::outbox::create_indexes(&outbox).await?;
        let mut expiring = vec![
            (&inbox, "at", config.inbox_retention),
            (&deferrals, "at", config.inbox_retention),
        ];
        if config.lease {
            // What a crash leaves behind: a fence document is kept as long as the inbox record,
            // its lease twice as long, so a lease never goes before a fence it counted for.
            expiring.push((&fences, "at", config.inbox_retention));
            expiring.push((
                &leases,
                "acquired_at",
                config.inbox_retention.saturating_mul(2),
            ));
        }
        for (collection, field, ttl) in expiring {
            let index = IndexModel::builder()
                .keys(doc! { field: 1 })
                .options(IndexOptions::builder().expire_after(ttl).build())
                .build();
            collection.create_index(index).await?;
        }
        Ok(Self(Arc::new(Inner {
            client,
            database,
            config,
            inbox,
            leases,
            fences,
            deferrals,
            outbox,
            relays,
            staged: Arc::default(),
            handling: std::sync::Mutex::default(),
            abandoned: Arc::default(),
        })))
    }

    /// The database the scope works in.
    pub fn database(&self) -> &Database {
        &self.0.database
    }

    /// The scope's outbox, to stage messages in a transaction of the application's own (an
    /// HTTP handler writing an order, say); a handler stages through the
    /// [`Outbox`](crate::Outbox) extractor instead.
    pub fn outbox(&self) -> crate::OutboxStore {
        crate::OutboxStore::new(self.0.outbox.clone())
    }

    /// What the scope's relays work on.
    fn relay_source(&self) -> Source {
        Source {
            outbox: self.0.outbox.clone(),
            relays: self.0.relays.clone(),
            staged: Arc::clone(&self.0.staged),
        }
    }

    async fn open(&self, meta: &Meta) -> Begin {
        let inner = &self.0;
        let key = inbox::key(&inner.config.consumer, meta.message_id());
        let deferrals = Deferrals::new(inner.deferrals.clone(), key.clone());
        let defer = |reason: Reason| async {
            Begin::Defer {
                reason,
                deferrals: deferrals.count().await,
            }
        };
        let lease = if inner.config.lease {
            match lease::acquire(
                &inner.leases,
                &inner.fences,
                &inner.abandoned,
                key.clone(),
                inner.config.lease_ttl,
                inner.config.lease_max_extension,
            )
            .await
            {
                Ok(lease) => Some(lease),
                Err(Refused::Held { expires_in }) => {
                    return Begin::Wait {
                        reason: Reason::new(format!(
                            "lease held by another owner, expiring in {} ms unless renewed",
                            expires_in.as_millis()
                        )),
                        expires_in,
                    };
                }
                Err(Refused::Failed(err)) => {
                    return defer(Reason::new(format!(
                        "database unavailable: {}",
                        code_of(&err)
                    )))
                    .await;
                }
            }
        } else {
            None
        };
        let release = |lease: Option<lease::Lease>| async {
            if let Some(lease) = lease {
                lease.release(false).await;
            }
        };
        let mut session = match inner.client.start_session().await {
            Ok(session) => session,
            Err(err) => {
                release(lease).await;
                return defer(Reason::new(format!(
                    "database unavailable: {}",
                    code_of(&err)
                )))
                .await;
            }
        };
        let started = session
            .start_transaction()
            .read_concern(ReadConcern::snapshot())
            .write_concern(WriteConcern::builder().w(Acknowledgment::Majority).build())
            .await;
        if let Err(err) = started {
            release(lease).await;
            return defer(Reason::new(format!(
                "database unavailable: {}",
                code_of(&err)
            )))
            .await;
        }
        let fingerprint = inbox::fingerprint(meta, meta.body());
        let record = inbox::record(key.clone(), meta, &fingerprint);
        match inner.inbox.insert_one(record).session(&mut session).await {
            Ok(_) => {}
            Err(err) if is_duplicate_key(&err) => {
                let _ = session.abort_transaction().await;
                release(lease).await;
                return self.seen_before(key, &fingerprint, deferrals).await;
            }
            Err(err) if err.contains_label(TRANSIENT_TRANSACTION_ERROR) => {
                let _ = session.abort_transaction().await;
                release(lease).await;
                // A write conflict: another transaction holds this message's record, a
                // concurrent delivery (which may commit in a moment, and this one is then a
                // duplicate) or an abandoned one (a crashed worker, until the server aborts it).
                // Again shortly, in-process; deferred if it lasts.
                return Begin::Transient(Reason::new("inbox insert: transient transaction error"));
            }
            Err(err) => {
                let _ = session.abort_transaction().await;
                release(lease).await;
                return defer(Reason::new(format!(
                    "inbox insert failed: {}",
                    code_of(&err)
                )))
                .await;
            }
        }
        // No other handling of the message lives now (its insert would have met ours): a
        // redelivery's handling leaves its mark, and counts the marks earlier ones left.
        let deaths = if meta.redelivered() {
            self.began(meta, &deferrals).await
        } else {
            None
        };
        debug!(fence = lease.as_ref().map(|l| l.fence), "scope open");
        let state = Arc::new(TxState {
            session: Mutex::new(session),
            database: inner.database.clone(),
            outbox: inner.outbox.clone(),
            staged: std::sync::atomic::AtomicBool::new(false),
        });
        let mut resources = Resources::new();
        resources.insert(Arc::clone(&state));
        Begin::Proceed {
            resources,
            deaths,
            transaction: Box::new(MongoTransaction {
                state,
                relay: Arc::clone(&inner.staged),
                lease,
                deferrals,
                on_committed: inner
                    .config
                    .on_committed
                    .clone()
                    .map(|observer| (observer, meta.clone())),
            }),
        }
    }

    /// Marks the message as handled by this process; the deaths counted, if it could. A
    /// handling this process marked and that has not ended (its transaction run again after a
    /// conflict, or a duplicate delivery of it handled here meanwhile) keeps its mark, which is
    /// no death.
    ///
    /// The token is kept before the mark is written: a handling given up on while the write
    /// was under way (its deadline ran out) may have left the mark all the same, and its end
    /// must remove it, or the next handling would count a death no worker died.
    async fn began(&self, meta: &Meta, deferrals: &Deferrals) -> Option<u32> {
        let token = {
            let mut marks = crate::lock(&self.0.handling);
            if marks.len() >= MAX_MARKS {
                marks.clear();
            }
            marks
                .entry(meta.message_id().into())
                .or_insert_with(lease::owner_token)
                .clone()
        };
        let deaths = deferrals.began(&token).await?;
        debug!(message_id = meta.message_id(), deaths, "handling marked");
        Some(deaths)
    }

    /// The inbox already holds this message: a duplicate if the fingerprints match, a conflict
    /// otherwise.
    async fn seen_before(&self, key: Document, fingerprint: &str, deferrals: Deferrals) -> Begin {
        match self.0.inbox.find_one(doc! { "_id": key }).await {
            Ok(Some(existing)) if inbox::stored_fingerprint(&existing) == Some(fingerprint) => {
                Begin::Duplicate
            }
            Ok(Some(_)) => Begin::Conflict(Reason::new(
                "message id already handled with a different type, version or body",
            )),
            Ok(None) => Begin::Defer {
                reason: Reason::new("inbox record vanished (expired?) during the check"),
                deferrals: deferrals.count().await,
            },
            Err(err) => Begin::Defer {
                reason: Reason::new(format!("database unavailable: {}", code_of(&err))),
                deferrals: deferrals.count().await,
            },
        }
    }
}

impl Relay {
    /// A relay of `scope`'s outbox, publishing through `publisher`.
    pub fn new(scope: &MongoScope, publisher: Arc<Publisher>, config: RelayConfig) -> Self {
        Self::of(scope.relay_source(), publisher, config)
    }
}

impl TransactionalScope for MongoScope {
    fn begin<'a>(&'a self, meta: &'a Meta, deadline: Duration) -> BoxFuture<'a, Begin> {
        Box::pin(async move {
            match tokio::time::timeout(deadline, self.open(meta)).await {
                Ok(begin) => begin,
                Err(_) => Begin::Defer {
                    reason: Reason::new("database did not answer within the budget"),
                    deferrals: None,
                },
            }
        })
    }

    /// The outbox relay, unless [`MongoConfig::without_relay`].
    fn relay(&self) -> Option<Box<dyn OutboxRelay>> {
        let config = self.0.config.relay.clone()?;
        Some(Box::new(ScopeRelay {
            source: self.relay_source(),
            config,
        }))
    }

    /// Removes the mark the handling left when it ended in a settlement; one that did not
    /// stays, and the next handling counts it.
    fn ended<'a>(&'a self, meta: &'a Meta, settled: bool, deadline: Duration) -> BoxFuture<'a, ()> {
        Box::pin(async move {
            let token = crate::lock(&self.0.handling).remove(meta.message_id());
            if let (Some(token), true) = (token, settled) {
                let key = inbox::key(&self.0.config.consumer, meta.message_id());
                let marks = Deferrals::new(self.0.deferrals.clone(), key);
                let _ = tokio::time::timeout(deadline, marks.ended(&token)).await;
            }
        })
    }
}
