//! The evidence after a storm, read from outside the contender: the work queue and the bucket
//! drained and counted by message id, every id of the population exactly once, and the DLQ and
//! the parking lane empty.

use lily::topology::Topology;
use lily_mq_testkit::Client;
use serde::Serialize;

/// What the queues held after a contender stopped.
#[derive(Clone, Debug, Default, Serialize)]
pub struct Check {
    pub population: u64,
    /// Messages found in the work queue and in the bucket.
    pub in_work_queue: u64,
    pub in_bucket: u64,
    /// Ready messages in the DLQ and the parking lane (not drained).
    pub in_dead_letter_queue: Option<u32>,
    pub in_parking: Option<u32>,
    /// Population ids found nowhere; extra copies of population ids; ids not in it.
    pub missing: u64,
    pub duplicates: u64,
    pub strangers: u64,
    /// Every id exactly once, nothing else, DLQ and parking empty.
    pub ok: bool,
}

/// Drains the work queue and the bucket of `topology`, reads the depths of its DLQ and parking
/// lane, and checks the ids `m-0 … m-{population − 1}`.
pub async fn check(url: &str, topology: &Topology, population: u64) -> Check {
    let client = Client::connect(url).await;
    let mut ids = client
        .drain_ids(topology.bucket(0).expect("a retry bucket"))
        .await;
    let in_bucket = ids.values().sum::<usize>() as u64;
    let mut in_work_queue = 0;
    for (id, count) in client.drain_ids(topology.queue()).await {
        in_work_queue += count as u64;
        *ids.entry(id).or_insert(0) += count;
    }
    let in_dead_letter_queue = crate::depth(url, &topology.dead_letter_queue()).await;
    let in_parking = crate::depth(url, &topology.parking_queue()).await;
    let (mut missing, mut duplicates) = (0, 0);
    for i in 0..population {
        match ids.remove(&format!("m-{i}")) {
            None => missing += 1,
            Some(n) => duplicates += n as u64 - 1,
        }
    }
    let strangers = ids.values().sum::<usize>() as u64;
    let ok = missing + duplicates + strangers == 0
        && in_dead_letter_queue == Some(0)
        && in_parking == Some(0);
    Check {
        population,
        in_work_queue,
        in_bucket,
        in_dead_letter_queue,
        in_parking,
        missing,
        duplicates,
        strangers,
        ok,
    }
}
