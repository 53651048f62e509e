//! Consumer configuration.

use std::time::Duration;

use lily_mq_core::{HeaderKey, Limits, Policy, ShutdownBudget};

use crate::connect::ClientCertificate;
use crate::error::{ConfigError, Error};
use crate::topology::{LeaderLocator, QueueKind, TopologyMode};

/// How one work queue is consumed.
///
/// ```
/// use std::time::Duration;
/// use lily_mq_rabbit::{ConsumerConfig, QueueKind};
///
/// let config = ConsumerConfig::new("orders")
///     .queue_kind(QueueKind::Quorum)
///     .prefetch(100)
///     .concurrency(32)
///     .handler_timeout(Duration::from_secs(10));
/// assert!(config.validate().is_ok());
/// assert!(ConsumerConfig::new("orders").prefetch(0).validate().is_err());
/// ```
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct ConsumerConfig {
    /// The work queue.
    pub queue: String,
    /// Classic or quorum.
    pub queue_kind: QueueKind,
    /// Declare the topology, or only verify it.
    pub topology: TopologyMode,
    /// Unacknowledged deliveries the broker may send ahead (`basic.qos`).
    pub prefetch: u16,
    /// Deliveries handled at once, by as many long-lived workers (started on demand); capped
    /// at `prefetch`.
    pub concurrency: usize,
    /// Time a handler may run; past it the handler is cancelled and the failure is retryable.
    pub handler_timeout: Duration,
    /// Gate bounds.
    pub limits: Limits,
    /// Retry, requeue and settlement budget policy.
    pub policy: Policy,
    /// Unresolved deliveries kept in the ledger before counting them as overflow.
    pub unresolved_cap: usize,
    /// More nodes of the same cluster, as `host` or `host:port` (the port defaults to the
    /// URL scheme's), tried after the URL's own host. The URL still gives the scheme, the
    /// credentials, the virtual host and the query. Every connect resolves each name again,
    /// and a name that resolves to several IP addresses (a headless service) counts as that
    /// many nodes. A lost connection is opened again on the node after the one it had, so it
    /// moves off a node that went down; the consuming and the handoff connection dial on
    /// their own and may land on different nodes.
    pub addresses: Vec<String>,
    /// How long connecting to one node may take (TCP, TLS and the AMQP handshake) before the
    /// next is tried: a node that drops packets must not hold a reconnect for minutes.
    pub connect_timeout: Duration,
    /// First reconnect delay, after every node failed once; doubles up to `reconnect_max`.
    /// Each wait is jittered to between half of it and all of it.
    pub reconnect_min: Duration,
    /// Longest reconnect delay.
    pub reconnect_max: Duration,
    /// PEM certificates to trust for `amqps://` besides the system roots (a private CA).
    pub tls_ca_pem: Option<String>,
    /// The client certificate `amqps://` presents, for a broker that requires one (mutual
    /// TLS). Its `Debug` never shows the key.
    pub tls_client: Option<ClientCertificate>,
    /// Quorum work queues only: the broker's own backstop, declared as `x-delivery-limit`
    /// with at-least-once dead-lettering. A message delivered more often than this (requeued,
    /// or in flight when its consumer died) goes to `<queue>.dlq` without any Lily code. It
    /// must exceed `policy.max_requeues`, so Lily's own limit, with its evidence, comes
    /// first. `None` declares none (RabbitMQ 4 then applies its default of 20). A queue that
    /// exists without these arguments is refused (406) until it is recreated or this is `None`.
    pub delivery_limit: Option<u32>,
    /// Quorum queues only: where the broker places the leader of each queue Lily declares
    /// (`x-queue-leader-locator`). `None` declares none, which leaves it to the broker's
    /// policy or default (`client-local`: every queue led by the node the consumer happened to
    /// connect to). RabbitMQ compares the argument when a queue is declared again, so it must
    /// match how the queues were first declared: a queue that exists without it, with another
    /// value, or with it while this is `None`, is refused at start (406). For existing queues,
    /// keep it as they were and set the `queue-leader-locator` policy key, which places queues
    /// declared after it.
    pub leader_locator: Option<LeaderLocator>,
    /// The budget [`Consumer::run_until_signal`](crate::Consumer::run_until_signal) shuts down
    /// within (25 s by default, under Kubernetes' 30 s grace period).
    /// [`Consumer::run`](crate::Consumer::run) takes its budget from the
    /// [`Shutdown`](crate::Shutdown) it is given.
    pub shutdown_budget: ShutdownBudget,
    /// The broker's `consumer_timeout` (RabbitMQ's default: 30 minutes): a delivery left
    /// unacknowledged this long makes the broker close the channel, and every delivery on it
    /// goes back to the queue. AMQP gives a client no way to read it, so it is taken here, and
    /// at start every time a delivery may stay unacknowledged under Lily must be shorter: the
    /// policy's `release_held_after`, the handler timeout with the settlement budget after it,
    /// and the shutdown budget. Lily sets no timeout of its own on the queue or the consumer.
    pub broker_consumer_timeout: Duration,
    /// The key that seals Lily's `x-lily-*` headers on every copy and checks them when a
    /// message comes back ([`HeaderKey`]). Every worker of the queue and the `lily` command
    /// must hold the same one. Without one, the [public](HeaderKey::public) key.
    pub header_key: HeaderKey,
}

impl ConsumerConfig {
    /// Defaults for consuming `queue`.
    pub fn new(queue: impl Into<String>) -> Self {
        Self {
            queue: queue.into(),
            queue_kind: QueueKind::Classic,
            topology: TopologyMode::Declare,
            prefetch: 50,
            concurrency: 50,
            handler_timeout: Duration::from_secs(30),
            limits: Limits::default(),
            policy: Policy::default(),
            unresolved_cap: 1000,
            addresses: Vec::new(),
            connect_timeout: Duration::from_secs(5),
            reconnect_min: Duration::from_millis(100),
            reconnect_max: Duration::from_secs(5),
            tls_ca_pem: None,
            tls_client: None,
            delivery_limit: Some(20),
            leader_locator: None,
            shutdown_budget: ShutdownBudget::default(),
            broker_consumer_timeout: Duration::from_secs(30 * 60),
            header_key: HeaderKey::public(),
        }
    }

    /// Seals Lily's headers with `secret` ([`ConsumerConfig::header_key`]), at least
    /// [`HeaderKey::MIN_LEN`] bytes; every worker of the queue and the `lily` command that
    /// replays its lanes take the same.
    #[must_use]
    pub fn header_key(mut self, secret: impl AsRef<[u8]>) -> Self {
        self.header_key = HeaderKey::new(secret);
        self
    }

    /// Sets [`ConsumerConfig::broker_consumer_timeout`], as the broker's `consumer_timeout`
    /// is configured (`rabbitmq.conf`, or `x-consumer-timeout` on the queue by policy).
    #[must_use]
    pub fn broker_consumer_timeout(mut self, timeout: Duration) -> Self {
        self.broker_consumer_timeout = timeout;
        self
    }

    /// Sets [`ConsumerConfig::shutdown_budget`].
    #[must_use]
    pub fn shutdown_budget(mut self, budget: ShutdownBudget) -> Self {
        self.shutdown_budget = budget;
        self
    }

    /// Sets [`ConsumerConfig::addresses`]: more nodes of the cluster, `host` or `host:port`.
    #[must_use]
    pub fn addresses<A: Into<String>>(mut self, addresses: impl IntoIterator<Item = A>) -> Self {
        self.addresses = addresses.into_iter().map(Into::into).collect();
        self
    }

    /// Sets [`ConsumerConfig::connect_timeout`].
    #[must_use]
    pub fn connect_timeout(mut self, timeout: Duration) -> Self {
        self.connect_timeout = timeout;
        self
    }

    /// Sets [`ConsumerConfig::leader_locator`].
    #[must_use]
    pub fn leader_locator(mut self, locator: Option<LeaderLocator>) -> Self {
        self.leader_locator = locator;
        self
    }

    /// Sets [`ConsumerConfig::delivery_limit`].
    #[must_use]
    pub fn delivery_limit(mut self, limit: Option<u32>) -> Self {
        self.delivery_limit = limit;
        self
    }

    /// Sets the queue type.
    #[must_use]
    pub fn queue_kind(mut self, kind: QueueKind) -> Self {
        self.queue_kind = kind;
        self
    }

    /// Declares or verifies the topology.
    #[must_use]
    pub fn topology(mut self, mode: TopologyMode) -> Self {
        self.topology = mode;
        self
    }

    /// Sets the prefetch count.
    #[must_use]
    pub fn prefetch(mut self, prefetch: u16) -> Self {
        self.prefetch = prefetch;
        self
    }

    /// Sets how many deliveries are handled at once (capped at the prefetch).
    #[must_use]
    pub fn concurrency(mut self, concurrency: usize) -> Self {
        self.concurrency = concurrency;
        self
    }

    /// Sets [`ConsumerConfig::reconnect_min`] and [`ConsumerConfig::reconnect_max`].
    #[must_use]
    pub fn reconnect(mut self, min: Duration, max: Duration) -> Self {
        self.reconnect_min = min;
        self.reconnect_max = max;
        self
    }

    /// Sets [`ConsumerConfig::unresolved_cap`].
    #[must_use]
    pub fn unresolved_cap(mut self, cap: usize) -> Self {
        self.unresolved_cap = cap;
        self
    }

    /// Sets the handler timeout.
    #[must_use]
    pub fn handler_timeout(mut self, timeout: Duration) -> Self {
        self.handler_timeout = timeout;
        self
    }

    /// Sets the gate bounds.
    #[must_use]
    pub fn limits(mut self, limits: Limits) -> Self {
        self.limits = limits;
        self
    }

    /// Trusts the PEM certificates in `pem` (a private CA) for `amqps://` connections.
    #[must_use]
    pub fn tls_ca_pem(mut self, pem: impl Into<String>) -> Self {
        self.tls_ca_pem = Some(pem.into());
        self
    }

    /// Presents `certificate` to the broker on `amqps://` connections (mutual TLS).
    #[must_use]
    pub fn tls_client_cert(mut self, certificate: ClientCertificate) -> Self {
        self.tls_client = Some(certificate);
        self
    }

    /// The TLS settings of the consumer's connections.
    pub(crate) fn tls(&self) -> crate::connect::Tls {
        crate::connect::Tls {
            ca_pem: self.tls_ca_pem.clone(),
            client: self.tls_client.clone(),
        }
    }

    /// Sets the retry policy.
    #[must_use]
    pub fn policy(mut self, policy: Policy) -> Self {
        self.policy = policy;
        self
    }

    /// [`Self::validate`], and that `router` was given every state its handlers extract.
    pub(crate) fn validate_for(&self, router: &lily_mq_core::Router) -> Result<(), Error> {
        self.validate()?;
        match router.missing_state() {
            None => Ok(()),
            Some(state) => Err(Error::Config(ConfigError {
                field: "router",
                problem: format!(
                    "has a handler taking State<{state}> that Router::with_state never gave"
                )
                .into(),
            })),
        }
    }

    /// Checks every setting, the policy's included. [`Consumer::run`](crate::Consumer::run)
    /// calls it first, before anything is sent.
    ///
    /// # Errors
    /// [`Error::Config`](crate::Error::Config) naming the first setting that cannot work, or
    /// [`Error::Policy`](crate::Error::Policy).
    pub fn validate(&self) -> Result<(), Error> {
        let rule = |ok: bool, field, problem: &'static str| {
            if ok {
                Ok(())
            } else {
                Err(Error::Config(ConfigError {
                    field,
                    problem: problem.into(),
                }))
            }
        };
        rule(
            (1..=200).contains(&self.queue.len()),
            "queue",
            "must be 1..=200 bytes",
        )?;
        rule(self.prefetch >= 1, "prefetch", "must be at least 1")?;
        rule(
            self.header_key.is_long_enough(),
            "header_key",
            "must be at least 16 bytes",
        )?;
        rule(self.concurrency >= 1, "concurrency", "must be at least 1")?;
        rule(
            !self.handler_timeout.is_zero(),
            "handler_timeout",
            "must be above zero",
        )?;
        rule(
            !self.connect_timeout.is_zero(),
            "connect_timeout",
            "must be above zero",
        )?;
        rule(
            !self.reconnect_min.is_zero(),
            "reconnect_min",
            "must be above zero: reconnecting at once would spin",
        )?;
        rule(
            self.reconnect_max >= self.reconnect_min,
            "reconnect_max",
            "must be at least reconnect_min",
        )?;
        if let Some(problem) = self
            .tls_client
            .as_ref()
            .and_then(ClientCertificate::problem)
        {
            rule(false, "tls_client", problem)?;
        }
        let timeout = self.broker_consumer_timeout;
        rule(
            self.policy.release_held_after < timeout,
            "policy.release_held_after",
            "must be shorter than broker_consumer_timeout: the broker would close the channel \
             under a held delivery first",
        )?;
        rule(
            self.handler_timeout + self.policy.settlement_budget < timeout,
            "handler_timeout",
            "with policy.settlement_budget after it, must be shorter than \
             broker_consumer_timeout: the broker would close the channel under a running handler",
        )?;
        rule(
            self.shutdown_budget.total < timeout,
            "shutdown_budget",
            "must be shorter than broker_consumer_timeout",
        )?;
        if let (QueueKind::Quorum, Some(limit)) = (self.queue_kind, self.delivery_limit) {
            rule(
                limit > self.policy.max_requeues,
                "delivery_limit",
                "must exceed policy.max_requeues, so Lily's limit comes first",
            )?;
        }
        self.policy.validate()?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn field_of(config: &ConsumerConfig) -> Option<&'static str> {
        match config.validate() {
            Ok(()) => None,
            Err(Error::Config(e)) => Some(e.field),
            Err(Error::Policy(_)) => Some("policy"),
            Err(other) => panic!("{other}"),
        }
    }

    #[tokio::test]
    async fn run_refuses_a_setting_that_cannot_work_before_it_dials() {
        use crate::{Consumer, Shutdown};
        // Nothing listens on port 9: a consumer that dialled would retry, not return; the
        // timeout turns that into a failure.
        let within = |run| async move {
            tokio::time::timeout(Duration::from_secs(5), run)
                .await
                .expect("refused before dialling, not retrying")
        };
        let run = |url: &str, config| {
            within(Consumer::new(url, config, lily_mq_core::Router::new()).run(Shutdown::default()))
        };
        let refused = |result: Result<_, Error>| match result {
            Err(Error::Config(e)) => e.field,
            other => panic!("{:?}", other.map(|_| ())),
        };
        let url = "amqp://127.0.0.1:9/%2f";
        let config = ConsumerConfig::new("orders");
        assert_eq!(
            refused(run(url, config.clone().prefetch(0)).await),
            "prefetch"
        );
        assert_eq!(refused(run("http://x", config.clone()).await), "url");
        let addresses = config.clone().addresses(["host:port:what"]);
        assert_eq!(refused(run(url, addresses).await), "addresses");

        // A handler taking a state the router was never given: refused, the type named.
        #[derive(Clone)]
        struct Stock;
        async fn reserve(_: lily_mq_core::State<Stock>) -> lily_mq_core::HandlerResult {
            Ok(())
        }
        let router = lily_mq_core::Router::new().route("order.placed", reserve);
        let result =
            within(Consumer::new(url, config.clone(), router.clone()).run(Shutdown::default()))
                .await;
        match result {
            Err(Error::Config(e)) => {
                assert_eq!(e.field, "router");
                assert!(
                    e.problem.contains("State<") && e.problem.contains("Stock>"),
                    "{e}"
                );
            }
            other => panic!("{:?}", other.map(|_| ())),
        }
        assert!(router.with_state(Stock).missing_state().is_none());
    }

    #[test]
    fn every_rule_names_its_field() {
        let base = || ConsumerConfig::new("orders");
        assert_eq!(field_of(&base()), None);
        // A broker that times consumers out after 10 minutes.
        let ten = || base().broker_consumer_timeout(Duration::from_secs(600));
        let cases: [(ConsumerConfig, &str); 12] = [
            (ConsumerConfig::new(""), "queue"),
            (ConsumerConfig::new("q".repeat(201)), "queue"),
            (base().prefetch(0), "prefetch"),
            (base().concurrency(0), "concurrency"),
            (base().handler_timeout(Duration::ZERO), "handler_timeout"),
            (base().connect_timeout(Duration::ZERO), "connect_timeout"),
            (
                base().reconnect(Duration::ZERO, Duration::from_secs(1)),
                "reconnect_min",
            ),
            (
                base().reconnect(Duration::from_secs(2), Duration::from_secs(1)),
                "reconnect_max",
            ),
            (
                base()
                    .queue_kind(QueueKind::Quorum)
                    .delivery_limit(Some(5))
                    .policy(Policy::default().max_requeues(5)),
                "delivery_limit",
            ),
            // Holds are released after 15 minutes by default.
            (ten(), "policy.release_held_after"),
            (
                ten()
                    .policy(Policy::default().release_held_after(Duration::from_secs(300)))
                    .handler_timeout(Duration::from_secs(595)),
                "handler_timeout",
            ),
            (
                ten()
                    .policy(Policy::default().release_held_after(Duration::from_secs(300)))
                    .shutdown_budget(ShutdownBudget::new(Duration::from_secs(600))),
                "shutdown_budget",
            ),
        ];
        for (config, field) in cases {
            assert_eq!(field_of(&config), Some(field));
            let shown = config.validate().expect_err(field).to_string();
            assert!(shown.contains(field), "{shown}");
        }
        let policy = base().policy(Policy::default().max_attempts(0));
        assert_eq!(field_of(&policy), Some("policy"));
        let shown = policy.validate().expect_err("policy").to_string();
        assert!(shown.contains("policy.max_attempts"), "{shown}");
    }
}
