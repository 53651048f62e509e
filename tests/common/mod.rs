//! Shared fixtures of the end-to-end tests.
#![allow(dead_code, unreachable_pub)]

pub mod ledger;
pub mod orders;

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use lapin::BasicProperties;
use lapin::types::{AMQPValue, FieldTable, ShortString};
use lily::consumer::Stats;
use lily::prelude::*;
use lily_mq_testkit::{Broker, Client, MongoNode, TcpProxy, eventually};
use tokio::task::JoinHandle;

/// A policy with short delays so tests run in seconds.
pub fn fast_policy() -> Policy {
    Policy::default()
        .max_attempts(3)
        .retry_delays([Duration::from_secs(1), Duration::from_secs(2)])
        .max_requeues(3)
        .settlement_budget(Duration::from_secs(5), Duration::from_millis(500))
}

pub fn config(queue: &str, kind: QueueKind) -> ConsumerConfig {
    ConsumerConfig::new(queue)
        .queue_kind(kind)
        .policy(fast_policy())
        .prefetch(20)
        .concurrency(20)
        .handler_timeout(Duration::from_secs(5))
        .reconnect(Duration::from_millis(100), Duration::from_millis(500))
}

pub fn props(message_id: &str, kind: &str) -> BasicProperties {
    BasicProperties::default()
        .with_message_id(ShortString::from(message_id))
        .with_type(ShortString::from(kind))
        .with_content_type(ShortString::from("application/json"))
        .with_delivery_mode(2)
}

/// A consumer running in the background.
pub struct Running {
    pub shutdown: Shutdown,
    join: JoinHandle<Result<ShutdownReport, lily::Error>>,
    pub stats: Stats,
}

/// The common start of a test: a fresh queue named after `prefix`, a consumer of it with the
/// configuration `configure` makes for that name (usually [`config`], adjusted), already
/// consuming, and a client on the broker. Returns the broker, the queue, the client and the
/// consumer.
pub async fn scenario(
    prefix: &str,
    router: Router,
    configure: impl FnOnce(&str) -> ConsumerConfig,
) -> (Broker, String, Client, Running) {
    let broker = Broker::from_env();
    let queue = Broker::unique(prefix);
    let running = start(broker.url(), configure(&queue), router);
    running.wait_ready().await;
    let client = Client::connect(broker.url()).await;
    (broker, queue, client, running)
}

pub fn start(url: &str, config: ConsumerConfig, router: Router) -> Running {
    start_with(url, config, router, |c| c)
}

/// Starts a consumer after `customize` (hooks, a scope) is applied to it.
pub fn start_with(
    url: &str,
    config: ConsumerConfig,
    router: Router,
    customize: impl FnOnce(Consumer) -> Consumer,
) -> Running {
    start_within(url, config, router, customize, Duration::from_secs(10))
}

/// Starts a consumer whose shutdown budget is `budget`.
pub fn start_within(
    url: &str,
    config: ConsumerConfig,
    router: Router,
    customize: impl FnOnce(Consumer) -> Consumer,
    budget: Duration,
) -> Running {
    let consumer = customize(Consumer::new(url, config, router));
    let stats = consumer.stats();
    let shutdown = Shutdown::new(ShutdownBudget::new(budget));
    let join = tokio::spawn(consumer.run(shutdown.clone()));
    Running {
        shutdown,
        join,
        stats,
    }
}

impl Running {
    /// Waits until the totals satisfy `check`, failing the test after `timeout`.
    pub async fn wait_for(
        &self,
        what: &str,
        timeout: Duration,
        check: impl Fn(&lily::consumer::Totals) -> bool,
    ) {
        let stats = self.stats.clone();
        let seen = eventually(timeout, || check(&stats.totals())).await;
        assert!(
            seen,
            "timed out waiting for {what}; totals: {:?}",
            self.stats.totals()
        );
    }

    /// Waits until the consumer is consuming, so its topology is complete: a test that deletes
    /// a queue before then races the declarations.
    pub async fn wait_ready(&self) {
        let stats = self.stats.clone();
        let ready = eventually(Duration::from_secs(30), || stats.ready()).await;
        assert!(ready, "the consumer never became ready");
    }

    /// Waits for the consumer to end on its own and returns what `run` returned.
    pub async fn ended(self) -> Result<ShutdownReport, lily::Error> {
        tokio::time::timeout(Duration::from_secs(30), self.join)
            .await
            .expect("the consumer ended")
            .expect("consumer task panicked")
    }

    pub async fn stop(self) -> ShutdownReport {
        self.shutdown.trigger(Trigger::Api);
        self.join
            .await
            .expect("consumer task panicked")
            .expect("consumer failed")
    }
}

/// Records what a handler saw.
#[derive(Clone, Default)]
pub struct Calls(Arc<Mutex<Vec<(String, u32, bool)>>>);

impl Calls {
    pub fn record(&self, meta: &Meta) {
        self.0.lock().unwrap().push((
            meta.message_id().to_owned(),
            meta.attempt(),
            meta.redelivered(),
        ));
    }

    pub fn all(&self) -> Vec<(String, u32, bool)> {
        self.0.lock().unwrap().clone()
    }

    /// A router whose `order.placed` handler records each call and succeeds.
    pub fn recording_router(&self) -> Router {
        let seen = self.clone();
        Router::new().route("order.placed", move |meta: Meta| {
            let seen = seen.clone();
            async move {
                seen.record(&meta);
                Ok(())
            }
        })
    }

    /// A router whose `order.placed` handler records each call and fails retryably with
    /// `reason` until attempt `succeeds_at`.
    pub fn router_succeeding_at(&self, succeeds_at: u32, reason: &'static str) -> Router {
        let seen = self.clone();
        Router::new().route("order.placed", move |meta: Meta| {
            let seen = seen.clone();
            async move {
                seen.record(&meta);
                if meta.attempt() < succeeds_at {
                    Err(QueueHandlerError::retryable(reason))
                } else {
                    Ok(())
                }
            }
        })
    }

    /// How many times each message id was handled.
    pub fn by_id(&self) -> std::collections::BTreeMap<String, usize> {
        let mut by_id = std::collections::BTreeMap::new();
        for (id, _, _) in self.all() {
            *by_id.entry(id).or_default() += 1;
        }
        by_id
    }

    pub fn count(&self) -> usize {
        self.0.lock().unwrap().len()
    }
}

pub fn header<'a>(props: &'a BasicProperties, key: &str) -> Option<&'a AMQPValue> {
    props
        .headers()
        .as_ref()
        .and_then(|h: &FieldTable| h.inner().get(key))
}

pub fn header_str(props: &BasicProperties, key: &str) -> Option<String> {
    match header(props, key)? {
        AMQPValue::LongString(s) => Some(String::from_utf8_lossy(s.as_bytes()).into_owned()),
        AMQPValue::ShortString(s) => Some(s.as_str().to_owned()),
        _ => None,
    }
}

pub fn header_u32(props: &BasicProperties, key: &str) -> Option<u32> {
    lily::headers::as_u32(header(props, key)?)
}

/// Waits until the broker counts exactly `depth` messages, ready and unacknowledged, in each
/// queue: the broker's facts, not Lily's counters.
pub async fn wait_depths(what: &str, timeout: Duration, depths: &[(&str, u64)]) {
    let broker = Broker::from_env();
    let at_depth = |now: &std::collections::BTreeMap<String, u64>| {
        depths
            .iter()
            .all(|(queue, depth)| now.get(*queue) == Some(depth))
    };
    let reached = eventually(timeout, || at_depth(&broker.depths())).await;
    let now = broker.depths();
    let seen: Vec<_> = depths.iter().map(|(q, _)| (*q, now.get(*q))).collect();
    assert!(
        reached,
        "timed out waiting for {what}: depths {seen:?}, expected {depths:?}"
    );
}

/// Waits until the broker holds nothing for `queue` but `dead` messages in its DLQ: the work
/// queue and the retry buckets of [`fast_policy`] empty, ready and unacknowledged.
pub async fn wait_settled(what: &str, queue: &str, dead: u64) {
    let topology =
        lily::topology::Topology::new(queue, QueueKind::Classic, &fast_policy().retry_delays);
    let dlq = topology.dead_letter_queue();
    let mut depths: Vec<(&str, u64)> = vec![(queue, 0), (&dlq, dead)];
    depths.extend(topology.buckets().map(|(bucket, _)| (bucket, 0)));
    wait_depths(what, Duration::from_secs(60), &depths).await;
}

/// Waits until `queue` exists (the consumer declares it on connect).
pub async fn wait_declared(url: &str, queue: &str) {
    for _ in 0..300 {
        let (u, q) = (url.to_owned(), queue.to_owned());
        // A passive declare of a missing queue closes its channel: probe from a throwaway client.
        let declared =
            tokio::spawn(async move { lily_mq_testkit::Client::connect(&u).await.depth(&q).await })
                .await
                .is_ok();
        if declared {
            return;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("queue {queue} was never declared");
}

/// `text` with the characters a regular expression gives meaning to escaped.
pub fn escape(text: &str) -> String {
    let mut escaped = String::with_capacity(text.len());
    for c in text.chars() {
        if r"\.+*?()|[]{}^$".contains(c) {
            escaped.push('\\');
        }
        escaped.push(c);
    }
    escaped
}

/// The security chapter's permissions for a consumer of `queue` that declares its topology:
/// `(configure, write, read)`.
pub fn declare_permissions(queue: &str) -> [String; 3] {
    let q = escape(queue);
    [
        format!(r"^{q}(\.retry\.[0-9a-z]+|\.dlq|\.parking|\.dlx)?$"),
        format!(r"^(amq\.default|{q}\.dlq|{q}\.dlx)$"),
        format!(r"^{q}(\.retry\.[0-9a-z]+|\.dlx)?$"),
    ]
}

/// The mongod address of `LILY_MONGO_URL`.
pub fn mongo_addr() -> SocketAddr {
    MongoNode::from_env().addr()
}

/// The test node's URL through `proxy`, failing fast: a refused connection is seen within
/// half a second instead of the driver's 30 s default.
pub fn mongo_via(proxy: &TcpProxy) -> String {
    MongoNode::from_env().url_via(proxy)
}
