//! Fixtures for Lily's tests against the real local RabbitMQ node and three-node cluster.
//!
//! `scripts/test.sh` starts a private node on loopback and exports `LILY_AMQP_URL` and
//! `LILY_RABBIT_DIR`, and a private cluster, exporting `LILY_CLUSTER_DIR` and
//! `LILY_CLUSTER_PORT`. [`Broker::from_env`] and [`Cluster::from_env`] fail loudly when they are
//! missing: a test that cannot reach its broker never passes.

mod cluster;
mod mongo;
mod mongo_set;
mod partition;
mod process;
mod proxy;
mod tcp_proxy;

pub use cluster::Cluster;
pub use mongo::MongoNode;
pub use mongo_set::{Member, MongoSet};
pub use partition::{Host, Partitions};
pub use process::ChildProcess;
pub use proxy::FaultProxy;
pub use tcp_proxy::TcpProxy;

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::Command;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use futures_util::StreamExt;
use lapin::message::BasicGetMessage;
use lapin::options::{
    BasicAckOptions, BasicGetOptions, BasicPublishOptions, ConfirmSelectOptions,
    QueueDeclareOptions, QueueDeleteOptions,
};
use lapin::types::FieldTable;
use lapin::{BasicProperties, Channel, Confirmation, Connection, ConnectionProperties};
use lily_mq_rabbit::{Destination, Outgoing, Published, Publisher, PublisherConfig};

/// The private RabbitMQ node the test command started.
#[derive(Clone, Debug)]
pub struct Broker {
    url: String,
    dir: PathBuf,
}

static COUNTER: AtomicU32 = AtomicU32::new(0);

impl Broker {
    /// The node named by `LILY_AMQP_URL` and `LILY_RABBIT_DIR`.
    ///
    /// # Panics
    /// When they are not set: run the tests through `scripts/test.sh`.
    pub fn from_env() -> Self {
        let (Ok(url), Ok(dir)) = (
            std::env::var("LILY_AMQP_URL"),
            std::env::var("LILY_RABBIT_DIR"),
        ) else {
            panic!(
                "no RabbitMQ node for tests: LILY_AMQP_URL and LILY_RABBIT_DIR are unset. \
                 Run the suite with scripts/test.sh, which starts a private node on loopback \
                 (or start one with scripts/rabbitmq.sh start DIR PORT and export both)"
            );
        };
        Self {
            url,
            dir: dir.into(),
        }
    }

    /// URL of the default vhost.
    pub fn url(&self) -> &str {
        &self.url
    }

    /// The node's AMQP address.
    ///
    /// # Panics
    /// When the URL has no `host:port`.
    pub fn addr(&self) -> std::net::SocketAddr {
        let rest = self
            .url
            .split_once("://")
            .map_or(self.url.as_str(), |(_, r)| r);
        let rest = rest.rsplit_once('@').map_or(rest, |(_, r)| r);
        let host = rest.split('/').next().unwrap_or(rest);
        host.parse().expect("LILY_AMQP_URL names 127.0.0.1:PORT")
    }

    /// A name no other test uses.
    pub fn unique(prefix: &str) -> String {
        let n = COUNTER.fetch_add(1, Ordering::Relaxed);
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.subsec_nanos());
        format!("{prefix}-{}-{n}-{nanos}", std::process::id())
    }

    /// Starts the node's application again after `stop_app`; a boot that fails 4.0's
    /// deprecated-feature check under load is tried again, at most three times in all.
    ///
    /// # Panics
    /// When it does not start.
    pub fn start_app(&self) {
        retry_failed_boot("start_app", || self.ctl_output(&["start_app"]));
    }

    fn ctl_output(&self, args: &[&str]) -> std::process::Output {
        let script = concat!(env!("CARGO_MANIFEST_DIR"), "/../../scripts/rabbitmq.sh");
        Command::new(script)
            .arg("ctl")
            .arg(&self.dir)
            .args(args)
            .output()
            .expect("run scripts/rabbitmq.sh ctl")
    }

    /// Runs `rabbitmqctl` against the node.
    ///
    /// # Panics
    /// When the command fails.
    pub fn ctl(&self, args: &[&str]) -> String {
        let out = self.ctl_output(args);
        assert!(
            out.status.success(),
            "rabbitmqctl {args:?} failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// Sets policy `name` on the queues (`apply_to`: `queues`, `quorum_queues`, …) named
    /// `queue` followed by one of the `suffixes` (a regular expression's alternatives, such as
    /// `dlq|parking`), with `definition` (JSON).
    ///
    /// # Panics
    /// When rabbitmqctl fails.
    pub fn set_policy(
        &self,
        name: &str,
        apply_to: &str,
        queue: &str,
        suffixes: &str,
        definition: &str,
    ) {
        let pattern = format!(r"^{}\.({suffixes})$", queue.replace('.', r"\."));
        self.ctl(&[
            "set_policy",
            "--apply-to",
            apply_to,
            name,
            &pattern,
            definition,
        ]);
    }

    /// A user `name` with `password` and `permissions` (configure, write, read, as
    /// `rabbitmqctl set_permissions` takes them) on the default vhost; returns its URL.
    ///
    /// # Panics
    /// When rabbitmqctl fails.
    pub fn add_user(&self, name: &str, password: &str, permissions: [&str; 3]) -> String {
        self.ctl(&["add_user", name, password]);
        let [configure, write, read] = permissions;
        self.ctl(&["set_permissions", "-p", "/", name, configure, write, read]);
        let (_, rest) = self.url.split_once('@').expect("the URL has credentials");
        format!("amqp://{name}:{password}@{rest}")
    }

    /// A fresh vhost with full permissions for the URL's user; returns its URL. Tests that
    /// close connections use one so they never touch other tests.
    pub fn vhost(&self, name: &str) -> String {
        self.ctl(&["add_vhost", name]);
        self.ctl(&["set_permissions", "-p", name, "guest", ".*", ".*", ".*"]);
        let base = self
            .url
            .rsplit_once('/')
            .map_or(self.url.as_str(), |(b, _)| b);
        format!("{base}/{name}")
    }

    /// Messages in `queue` of the default vhost, ready and unacknowledged, as the broker counts
    /// them.
    ///
    /// # Panics
    /// When the queue is not listed.
    pub fn messages(&self, queue: &str) -> u64 {
        let depths = self.depths();
        depths
            .get(queue)
            .copied()
            .unwrap_or_else(|| panic!("queue {queue} not listed: {depths:?}"))
    }

    /// Messages in every queue of the default vhost, ready and unacknowledged, as the broker
    /// counts them, by queue name: one `rabbitmqctl` call.
    pub fn depths(&self) -> BTreeMap<String, u64> {
        depths(&self.ctl(&DEPTHS))
    }

    /// Channels open on the client connection named `name` (its `connection_name` client
    /// property), as the broker counts them; `None` when no such connection is open.
    pub fn channels_of(&self, name: &str) -> Option<u32> {
        let out = self.ctl(&[
            "list_connections",
            "-q",
            "--no-table-headers",
            "channels",
            "client_properties",
        ]);
        let quoted = format!("\"{name}\"");
        out.lines()
            .find(|line| line.contains(&quoted))
            .and_then(|line| line.split_whitespace().next()?.parse().ok())
    }

    /// Closes the client connection named `name` (its `connection_name` client property), as
    /// an operator or a network fault would; the others stay open.
    ///
    /// # Panics
    /// When no such connection is open.
    pub fn close_connection_named(&self, name: &str) {
        let out = self.ctl(&[
            "list_connections",
            "-q",
            "--no-table-headers",
            "pid",
            "client_properties",
        ]);
        let quoted = format!("\"{name}\"");
        let pid = out
            .lines()
            .find(|line| line.contains(&quoted))
            .and_then(|line| line.split_whitespace().next())
            .unwrap_or_else(|| panic!("no connection named {name}:\n{out}"))
            .to_owned();
        self.ctl(&["close_connection", &pid, "lily test: connection closed"]);
    }

    /// Closes every client connection in `vhost`, as an operator or a network fault would.
    pub fn close_connections(&self, vhost: &str) {
        self.ctl(&[
            "close_all_connections",
            "-p",
            vhost,
            "lily test: connection killed",
        ]);
    }
}

/// The longest wait for the broker's answer to one `basic.get` or its ACK.
const ANSWER: Duration = Duration::from_secs(30);

/// The `rabbitmqctl` arguments that list every queue's messages, ready and unacknowledged.
const DEPTHS: [&str; 5] = [
    "list_queues",
    "-q",
    "--no-table-headers",
    "name",
    "messages",
];

/// The depths by queue name in the output of `rabbitmqctl` run with [`DEPTHS`].
fn depths(out: &str) -> BTreeMap<String, u64> {
    out.lines()
        .filter_map(|line| {
            let mut cols = line.split_whitespace();
            Some((cols.next()?.to_owned(), cols.next()?.parse().ok()?))
        })
        .collect()
}

/// A client for publishing and inspecting queues: well-formed messages go through Lily's own
/// [`Publisher`] ([`Client::send`]); a plain lapin channel publishes what that publisher would
/// refuse ([`Client::publish`]) and inspects queues.
pub struct Client {
    _connection: Connection,
    channel: Channel,
    url: String,
    /// Opened by the first [`Client::send`].
    publisher: tokio::sync::OnceCell<Publisher>,
}

impl Client {
    /// Connects to `url` with a confirm-mode channel.
    ///
    /// # Panics
    /// When the broker cannot be reached.
    pub async fn connect(url: &str) -> Self {
        let connection = Connection::connect(url, ConnectionProperties::default())
            .await
            .unwrap_or_else(|e| panic!("cannot reach the test broker: {e}"));
        let channel = connection.create_channel().await.expect("channel");
        channel
            .confirm_select(ConfirmSelectOptions::default())
            .await
            .expect("confirm_select");
        Self {
            _connection: connection,
            channel,
            url: url.to_owned(),
            publisher: tokio::sync::OnceCell::new(),
        }
    }

    /// Publishes a JSON message of type `kind` with id `id` to `queue` through Lily's
    /// [`Publisher`] and asserts that it was confirmed.
    pub async fn send(&self, queue: &str, kind: &str, id: &str, body: &[u8]) {
        let published = self.try_send(queue, kind, id, body).await;
        assert_eq!(
            published,
            Published::Confirmed,
            "test publish of {id} to {queue}"
        );
    }

    /// Publishes as [`Client::send`] does and returns what the broker said.
    pub async fn try_send(&self, queue: &str, kind: &str, id: &str, body: &[u8]) -> Published {
        let publisher = self
            .publisher
            .get_or_init(|| async {
                let config = PublisherConfig::default().name("testkit");
                Publisher::connect_with(&self.url, config)
                    .await
                    .unwrap_or_else(|e| panic!("cannot reach the test broker: {e}"))
            })
            .await;
        let message = Outgoing::bytes(kind, id, "application/json", body.to_vec());
        publisher.publish(&Destination::queue(queue), message).await
    }

    /// Publishes to `queue` through the default exchange, with exactly `properties`, and waits
    /// for the confirm: for messages [`Client::send`] would refuse (no id, Lily's own headers,
    /// `user_id`, `CC`).
    pub async fn publish(&self, queue: &str, body: &[u8], properties: BasicProperties) {
        let confirm = self
            .channel
            .basic_publish(
                "".into(),
                queue.into(),
                BasicPublishOptions {
                    mandatory: true,
                    immediate: false,
                },
                body,
                properties,
            )
            .await
            .expect("publish")
            .await
            .expect("confirm");
        assert_eq!(
            confirm,
            Confirmation::Ack(None),
            "test publish to {queue} not routed"
        );
    }

    /// Ready messages in `queue` (unacknowledged ones are not counted).
    pub async fn depth(&self, queue: &str) -> u32 {
        self.channel
            .queue_declare(
                queue.into(),
                QueueDeclareOptions {
                    passive: true,
                    ..QueueDeclareOptions::default()
                },
                FieldTable::default(),
            )
            .await
            .unwrap_or_else(|e| panic!("queue {queue} missing: {e}"))
            .message_count()
    }

    /// Takes one message from `queue` (acknowledging it), waiting up to `timeout`.
    pub async fn take(&self, queue: &str, timeout: Duration) -> Option<BasicGetMessage> {
        let start = Instant::now();
        loop {
            // A reply that never comes fails the test loudly instead of holding it (seen once
            // in a benchmark's drain after 10 000 gets).
            let got = tokio::time::timeout(
                ANSWER,
                self.channel
                    .basic_get(queue.into(), BasicGetOptions::default()),
            )
            .await
            .unwrap_or_else(|_| panic!("basic_get on {queue}: no answer in {ANSWER:?}"))
            .expect("basic_get");
            if let Some(message) = got {
                tokio::time::timeout(
                    ANSWER,
                    message.delivery.acker.ack(BasicAckOptions::default()),
                )
                .await
                .unwrap_or_else(|_| panic!("ack on {queue}: no answer in {ANSWER:?}"))
                .expect("ack");
                return Some(message);
            }
            if start.elapsed() > timeout {
                return None;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Closes the connection: whatever it held unacknowledged goes back to its queue.
    pub async fn close(self) {
        let _ = self._connection.close(200, "done".into()).await;
    }

    /// Consumes up to `n` messages of `queue` and holds them unacknowledged, as a consumer
    /// that is slow or stuck would, until this client is dropped (its connection's close puts
    /// them back); returns the consumer, which stays registered while it lives, and how many
    /// it holds.
    pub async fn hold(&self, queue: &str, n: u16) -> (lapin::Consumer, u32) {
        self.channel
            .basic_qos(n, lapin::options::BasicQosOptions::default())
            .await
            .expect("basic_qos");
        let mut consumer = self
            .channel
            .basic_consume(
                queue.into(),
                "testkit-holder".into(),
                lapin::options::BasicConsumeOptions::default(),
                FieldTable::default(),
            )
            .await
            .expect("basic_consume");
        let mut held = 0;
        while held < u32::from(n) {
            let next = tokio::time::timeout(Duration::from_secs(5), consumer.next()).await;
            match next {
                Ok(Some(Ok(_))) => held += 1,
                _ => break,
            }
        }
        (consumer, held)
    }

    /// Takes every ready message of `queue` (acknowledging each) until it is empty.
    pub async fn drain(&self, queue: &str) -> Vec<BasicGetMessage> {
        let mut messages = Vec::new();
        while let Some(message) = self.take(queue, Duration::ZERO).await {
            messages.push(message);
        }
        messages
    }

    /// How many times each `message_id` occurs in the ready messages of `queue`, which it
    /// drains. A message without an id counts under `""`. Only the ids are kept: a process that
    /// drains a large queue does not hold every body at once (and keep that memory after).
    pub async fn drain_ids(&self, queue: &str) -> BTreeMap<String, usize> {
        let mut ids = BTreeMap::new();
        while let Some(message) = self.take(queue, Duration::ZERO).await {
            let id = message
                .delivery
                .properties
                .message_id()
                .as_ref()
                .map_or_else(String::new, |id| id.as_str().to_owned());
            *ids.entry(id).or_insert(0) += 1;
        }
        ids
    }

    /// Declares `queue`, durable, with `x-queue-type: quorum` when `quorum`: a queue Lily
    /// declares that way (its DLQ, its parking lane) comes back as it was.
    pub async fn declare(&self, queue: &str, quorum: bool) {
        let mut args = FieldTable::default();
        if quorum {
            args.insert(
                "x-queue-type".into(),
                lapin::types::AMQPValue::LongString("quorum".into()),
            );
        }
        self.declare_with(queue, args).await;
    }

    /// Declares `queue`, durable, with `args`.
    pub async fn declare_with(&self, queue: &str, args: FieldTable) {
        self.channel
            .queue_declare(
                queue.into(),
                QueueDeclareOptions {
                    durable: true,
                    ..QueueDeclareOptions::default()
                },
                args,
            )
            .await
            .unwrap_or_else(|e| panic!("declare {queue}: {e}"));
    }

    /// Deletes `queue`.
    pub async fn delete(&self, queue: &str) {
        self.channel
            .queue_delete(queue.into(), QueueDeleteOptions::default())
            .await
            .expect("queue_delete");
    }
}

/// An HTTP response, as a real client read it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HttpResponse {
    /// The status code.
    pub status: u16,
    /// The `content-type` header, empty when absent.
    pub content_type: String,
    /// The body.
    pub body: String,
}

/// `GET http://{addr}{path}` with a real HTTP client (`ureq`), within 10 s; any status is a
/// response.
///
/// # Panics
/// When the request fails: the endpoint cannot be reached or does not speak HTTP.
pub async fn http_get(addr: impl std::fmt::Display, path: &str) -> HttpResponse {
    let url = format!("http://{addr}{path}");
    tokio::task::spawn_blocking(move || {
        let agent: ureq::Agent = ureq::Agent::config_builder()
            .http_status_as_error(false)
            .timeout_global(Some(Duration::from_secs(10)))
            .build()
            .into();
        let mut response = agent
            .get(&url)
            .call()
            .unwrap_or_else(|e| panic!("GET {url}: {e}"));
        let content_type = response
            .headers()
            .get("content-type")
            .and_then(|v| v.to_str().ok())
            .unwrap_or_default()
            .to_owned();
        HttpResponse {
            status: response.status().as_u16(),
            content_type,
            body: response
                .body_mut()
                .read_to_string()
                .unwrap_or_else(|e| panic!("GET {url}: body: {e}")),
        }
    })
    .await
    .expect("the HTTP request task")
}

/// Polls `check` every 50 ms until it is true or `timeout` passes; returns the last value.
pub async fn eventually<F: FnMut() -> bool>(timeout: Duration, check: F) -> bool {
    eventually_every(Duration::from_millis(50), timeout, check).await
}

/// Polls `check` every `every` until it is true or `timeout` passes; returns the last value.
pub async fn eventually_every<F: FnMut() -> bool>(
    every: Duration,
    timeout: Duration,
    mut check: F,
) -> bool {
    let start = Instant::now();
    loop {
        if check() {
            return true;
        }
        if start.elapsed() > timeout {
            return false;
        }
        tokio::time::sleep(every).await;
    }
}

/// Runs `start` until it succeeds, at most three times: a 4.0 node under load can fail its
/// boot's deprecated-feature check (`failed_to_deny_deprecated_features`: it reads the metadata
/// store before its tables are there), and only that failure is tried again.
///
/// # Panics
/// When `start` fails otherwise, or a third time.
pub(crate) fn retry_failed_boot(what: &str, mut start: impl FnMut() -> std::process::Output) {
    for attempt in 1.. {
        let out = start();
        if out.status.success() {
            return;
        }
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            attempt < 3 && err.contains("failed_to_deny_deprecated_features"),
            "{what} failed: {err}"
        );
        eprintln!("{what}: the deprecated-feature check failed; again in 2 s");
        std::thread::sleep(Duration::from_secs(2));
    }
}
