//! The consumer's side of a scope's outbox relay ([`OutboxRelay`]): started with a publisher of
//! its own on the consumer's broker, stopped when shutdown begins, awaited within the budget.

use std::sync::Arc;
use std::time::Duration;

use lily_mq_core::{OutboxRelay, OutboxReport, Resources, ShutdownBudget};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tracing::warn;

use crate::config::ConsumerConfig;
use crate::error::Error;
use crate::publish::publisher::{Publisher, PublisherConfig};

/// The longest a relay's publish waits for its confirm: a batch under way when shutdown begins
/// ends within twice this (its first message to a new exchange goes ahead of the rest), well
/// inside the budget's drain time.
const CONFIRM_TIMEOUT: Duration = Duration::from_secs(5);

/// A relay running beside the consumer.
pub(crate) struct RelayTask {
    task: JoinHandle<OutboxReport>,
    publisher: Arc<Publisher>,
    stop: CancellationToken,
}

impl RelayTask {
    /// Starts `relay` with a publisher of `url` that connects on its first publish.
    pub(crate) fn start(
        relay: Box<dyn OutboxRelay>,
        url: &str,
        config: &ConsumerConfig,
        budget: ShutdownBudget,
    ) -> Result<Self, Error> {
        let tls = config.tls();
        let mut settings = PublisherConfig::default()
            .name(&config.queue)
            .addresses(config.addresses.clone())
            .connect_timeout(config.connect_timeout)
            .confirm_timeout(
                CONFIRM_TIMEOUT
                    .min(budget.total / 5)
                    .max(Duration::from_millis(100)),
            )
            .limits(config.limits.clone());
        if let Some(pem) = tls.ca_pem {
            settings = settings.tls_ca_pem(pem);
        }
        if let Some(certificate) = tls.client {
            settings = settings.tls_client_cert(certificate);
        }
        let publisher = Arc::new(Publisher::unconnected(url, settings)?);
        let mut offered = Resources::new();
        offered.insert(Arc::clone(&publisher));
        let stop = CancellationToken::new();
        let task = tokio::spawn(relay.run(offered, stop.clone()));
        Ok(Self {
            task,
            publisher,
            stop,
        })
    }

    /// Stops the relay and waits for it, at most `within`; its report, or `None` when it did
    /// not finish in time (it is dropped: what it staged stays durable) or panicked.
    pub(crate) async fn finish(self, within: Duration) -> Option<OutboxReport> {
        self.stop.cancel();
        let end = tokio::time::Instant::now() + within;
        let mut task = self.task;
        let report = match tokio::time::timeout(within, &mut task).await {
            Ok(Ok(report)) => Some(report),
            Ok(Err(err)) => {
                warn!(error = %err, "the outbox relay ended without a report");
                None
            }
            Err(_) => {
                warn!(
                    "the outbox relay did not finish within the shutdown budget; what it staged stays in the outbox"
                );
                task.abort();
                let _ = task.await;
                None
            }
        };
        if let Ok(publisher) = Arc::try_unwrap(self.publisher) {
            let left = end
                .saturating_duration_since(tokio::time::Instant::now())
                .max(Duration::from_millis(100));
            let _ = tokio::time::timeout(left, publisher.close()).await;
        }
        report
    }

    /// Tells the relay to stop after what it is doing.
    pub(crate) fn stop(&self) {
        self.stop.cancel();
    }
}
