//! A consumer of a three-node cluster (running on a cluster).

use lily::prelude::*;

/// The configuration of a consumer that knows every node of the cluster.
pub fn config() -> ConsumerConfig {
    // ANCHOR: addresses
    ConsumerConfig::new("orders")
        .queue_kind(QueueKind::Quorum)
        .addresses(["rabbit-2:5672", "rabbit-3:5672"])
        .leader_locator(Some(LeaderLocator::Balanced))
    // Consumer::new("amqp://lily:secret@rabbit-1:5672/%2f", config(), router)
    // ANCHOR_END: addresses
}
