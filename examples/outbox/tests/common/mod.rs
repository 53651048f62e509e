//! The `outbox` binary as a child process, the queues and databases of one test, and a Lily
//! consumer downstream of the events queue; checks by message id.
#![allow(dead_code, unreachable_pub)]
use std::time::{Duration, Instant};

use lily::mongo::mongodb::bson::{Document, doc};
use lily::mongo::{MongoConfig, MongoScope, MongoTx, handler_error};
use lily::prelude::*;
use lily::topology::{QueueKind, Topology};
use lily_mq_testkit::{Broker, ChildProcess, Client, MongoNode};
use serde_json::Value;
use tokio::process::Command;

/// Orders published at once, with the service's prefetch at 50.
pub const ORDERS: usize = 300;

/// A running `outbox serve`.
pub struct Service(pub ChildProcess);

impl Service {
    pub fn start(world: &World, amqp_url: &str, mongo_url: &str, env: &[(&str, &str)]) -> Self {
        let mut command = Command::new(env!("CARGO_BIN_EXE_outbox"));
        command
            .arg("serve")
            .env("LILY_AMQP_URL", amqp_url)
            .env("LILY_MONGO_URL", mongo_url)
            .env("LILY_MONGO_DB", &world.upstream)
            .env("LILY_QUEUE", &world.queue)
            .env("LILY_EVENTS", &world.events)
            .env("LILY_QUEUE_TYPE", world.kind)
            .env("RUST_LOG", "warn,lily_mq_rabbit=info")
            .env_remove("OUTBOX_FAULT")
            .envs(env.iter().copied());
        Self(ChildProcess::spawn(command))
    }

    pub async fn ready(&self) {
        self.0
            .wait_for_line("consuming", Duration::from_secs(30))
            .await;
    }

    pub fn kill(&mut self) {
        self.0.signal("KILL");
    }

    /// SIGTERM, then the shutdown report the service printed; it must exit clean.
    pub async fn stop(mut self) -> Value {
        self.0.signal("TERM");
        let (status, _) = self.0.exit(Duration::from_secs(40)).await;
        let text = self.0.stdout().await;
        let report: Value = serde_json::from_str(&text).unwrap_or_else(|e| {
            panic!(
                "report is not JSON ({e}): {text:?}\nstderr:\n{}",
                self.0.log()
            )
        });
        assert_eq!(status.code(), Some(0), "clean exit: {report:#}");
        report
    }
}

/// The queues and databases of one test, and the Lily consumer downstream of the events.
pub struct World {
    pub broker: Broker,
    pub client: Client,
    pub queue: String,
    pub events: String,
    pub kind: &'static str,
    pub upstream: String,
    pub database: lily::mongo::mongodb::Database,
    pub downstream: Downstream,
}

/// A Lily consumer of the events queue with the MongoDB scope: one effect per event id.
pub struct Downstream {
    pub scope: MongoScope,
    pub shutdown: Shutdown,
    pub stats: lily::consumer::Stats,
    pub join: tokio::task::JoinHandle<Result<ShutdownReport, lily::Error>>,
}

impl World {
    pub async fn new(name: &str, kind: &'static str) -> Self {
        let broker = Broker::from_env();
        let client = Client::connect(broker.url()).await;
        let queue = Broker::unique(name);
        let events = format!("{queue}.events");
        let upstream = MongoNode::database_name(&format!("{name}-up"));
        let mongo = lily::mongo::mongodb::Client::with_uri_str(MongoNode::from_env().url())
            .await
            .expect("mongo client");
        let database = mongo.database(&upstream);
        let scope = MongoScope::connect(
            MongoNode::from_env().url(),
            &MongoNode::database_name(&format!("{name}-down")),
            MongoConfig::new("downstream"),
        )
        .await
        .expect("downstream scope");
        let router = Router::new().route("order.accepted", |tx: MongoTx, meta: Meta| async move {
            tx.database()
                .collection::<Document>("effects")
                .insert_one(doc! { "message_id": meta.message_id() })
                .session(&mut *tx.session().await)
                .await
                .map_err(|e| handler_error("effect", e))?;
            Ok(())
        });
        let consumer =
            Consumer::new(broker.url(), ConsumerConfig::new(&events), router).scope(scope.clone());
        let stats = consumer.stats();
        let shutdown = Shutdown::new(ShutdownBudget::new(Duration::from_secs(10)));
        let join = tokio::spawn(consumer.run(shutdown.clone()));
        let ready = Instant::now();
        while !stats.ready() {
            assert!(
                ready.elapsed() < Duration::from_secs(30),
                "downstream ready"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        Self {
            broker,
            client,
            queue,
            events,
            kind,
            upstream,
            database,
            downstream: Downstream {
                scope,
                shutdown,
                stats,
                join,
            },
        }
    }

    pub async fn place_orders(&self) {
        for n in 0..ORDERS {
            let body = format!(r#"{{"order_id":"o-{n}","quantity":{}}}"#, n % 7 + 1);
            self.client
                .send(
                    &self.queue,
                    "order.placed",
                    &format!("o-{n}"),
                    body.as_bytes(),
                )
                .await;
        }
    }

    /// Outbox records in `state`.
    pub async fn in_state(&self, state: &str) -> u64 {
        self.database
            .collection::<Document>("lily_outbox")
            .count_documents(doc! { "state": state })
            .await
            .expect("count outbox")
    }

    /// Events delivered downstream so far, duplicates included.
    pub fn delivered(&self) -> u64 {
        let t = self.downstream.stats.totals();
        t.acked + t.duplicates_suppressed
    }

    /// Effects downstream, one per event id.
    pub async fn effects(&self) -> u64 {
        self.downstream
            .scope
            .database()
            .collection::<Document>("effects")
            .count_documents(doc! {})
            .await
            .expect("count effects")
    }

    /// Waits until `check` holds, at most `timeout`.
    pub async fn until(&self, what: &str, timeout: Duration, check: impl AsyncCheck) {
        let start = Instant::now();
        while !check.holds(self).await {
            assert!(
                start.elapsed() < timeout,
                "timed out waiting for {what}; downstream {:?}, staged {}",
                self.downstream.stats.totals(),
                self.in_state("staged").await
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// A second, healthy process finishes what the first left
    /// ([`finish_and_check`](Self::finish_and_check)).
    pub async fn recover_and_check(self) -> ShutdownReport {
        let node = MongoNode::from_env();
        let second = Service::start(&self, self.broker.url(), node.url(), &[]);
        second.ready().await;
        self.finish_and_check(second).await
    }

    /// `service` finishes: the orders settle, nothing stays staged, every event comes
    /// downstream; its report is clean and counts no staged message. Then everything is
    /// checked by id. Returns the downstream report.
    pub async fn finish_and_check(self, second: Service) -> ShutdownReport {
        self.until("the orders settled", Duration::from_secs(90), Settled)
            .await;
        self.until("nothing staged", Duration::from_secs(60), Unstaged)
            .await;
        self.until(
            "every event downstream",
            Duration::from_secs(60),
            Downstreamed,
        )
        .await;
        let report = second.stop().await;
        assert_eq!(report["clean"], true, "{report:#}");
        assert_eq!(report["outbox"]["staged"], 0, "{report:#}");
        let shutdown = self.downstream.shutdown.clone();
        shutdown.trigger(Trigger::Api);
        let downstream = self
            .downstream
            .join
            .await
            .expect("downstream task")
            .expect("downstream report");
        assert!(downstream.clean, "{downstream:?}");

        let orders = self.database.collection::<Document>("orders");
        let outbox = self.database.collection::<Document>("lily_outbox");
        let effects = self
            .downstream
            .scope
            .database()
            .collection::<Document>("effects");
        for n in 0..ORDERS {
            let order = format!("o-{n}");
            let event = format!("{order}.accepted");
            let count = |c: &lily::mongo::mongodb::Collection<Document>, filter| {
                let c = c.clone();
                async move { c.count_documents(filter).await.expect("count") }
            };
            assert_eq!(
                count(&orders, doc! { "order_id": &order }).await,
                1,
                "{order}: one order"
            );
            assert_eq!(
                count(&outbox, doc! { "message_id": &event, "state": "sent" }).await,
                1,
                "{event}: staged once, sent"
            );
            assert_eq!(
                count(&effects, doc! { "message_id": &event }).await,
                1,
                "{event}: one effect downstream"
            );
        }
        assert_eq!(
            outbox.count_documents(doc! {}).await.expect("count"),
            ORDERS as u64
        );
        // A connection of its own: the test's may have died with the broker.
        let client = Client::connect(self.broker.url()).await;
        for queue in [&self.queue, &self.events] {
            let topology =
                Topology::new(queue, QueueKind::Classic, &Policy::default().retry_delays);
            let dlq = topology.dead_letter_queue();
            assert!(client.drain_ids(queue).await.is_empty(), "{queue} empty");
            assert!(client.drain_ids(&dlq).await.is_empty(), "{dlq} empty");
        }
        downstream
    }
}

/// A condition [`World::until`] polls.
pub trait AsyncCheck {
    async fn holds(&self, world: &World) -> bool;
}

/// The orders' queue, its retry buckets and its DLQ are empty.
pub struct Settled;
impl AsyncCheck for Settled {
    async fn holds(&self, world: &World) -> bool {
        let topology = Topology::new(
            &world.queue,
            QueueKind::Classic,
            &Policy::default().retry_delays,
        );
        let mut queues = vec![world.queue.clone(), topology.dead_letter_queue()];
        queues.extend(topology.buckets().map(|(bucket, _)| bucket.to_owned()));
        let broker = world.broker.clone();
        tokio::task::spawn_blocking(move || queues.iter().map(|q| broker.messages(q)).sum::<u64>())
            .await
            .expect("list_queues")
            == 0
    }
}

/// Every order staged its event.
pub struct AllStaged;
impl AsyncCheck for AllStaged {
    async fn holds(&self, world: &World) -> bool {
        world.in_state("staged").await == ORDERS as u64
    }
}

/// Nothing in the outbox is staged, and every order staged its event.
pub struct Unstaged;
impl AsyncCheck for Unstaged {
    async fn holds(&self, world: &World) -> bool {
        world.in_state("staged").await == 0 && world.in_state("sent").await == ORDERS as u64
    }
}

/// The relay's first batch took effect downstream.
pub struct FirstBatch;
impl AsyncCheck for FirstBatch {
    async fn holds(&self, world: &World) -> bool {
        world.effects().await > 0
    }
}

/// Every event took effect downstream and the events queue is empty.
pub struct Downstreamed;
impl AsyncCheck for Downstreamed {
    async fn holds(&self, world: &World) -> bool {
        let (broker, events) = (world.broker.clone(), world.events.clone());
        let depth = tokio::task::spawn_blocking(move || broker.messages(&events))
            .await
            .expect("list_queues");
        depth == 0 && world.effects().await == ORDERS as u64
    }
}
