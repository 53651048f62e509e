//! Orders through a cluster under faults, and their reconciliation by message id: the cluster
//! tests (nodes stopped and killed) and the partition tests (links cut) share them.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use lily::prelude::*;
use lily::topology::Topology;
use lily_mq_testkit::{Client, eventually};

/// Each call's success, by message id.
type Calls = BTreeMap<String, Vec<bool>>;

/// What the handler did, by message id.
#[derive(Clone, Default)]
pub struct Handled(Arc<Mutex<Calls>>);

impl Handled {
    pub fn succeeded(&self) -> usize {
        let all = self.0.lock().unwrap();
        all.values().filter(|r| r.contains(&true)).count()
    }

    pub fn ok_count(&self, id: &str) -> usize {
        let all = self.0.lock().unwrap();
        all.get(id)
            .map_or(0, |r| r.iter().filter(|ok| **ok).count())
    }

    /// Records a call for `id` and whether it succeeded.
    pub fn record(&self, id: &str, ok: bool) {
        self.0
            .lock()
            .unwrap()
            .entry(id.to_owned())
            .or_default()
            .push(ok);
    }

    pub fn calls(&self, id: &str) -> usize {
        self.0.lock().unwrap().get(id).map_or(0, Vec::len)
    }
}

/// Order `n`: 1 in 5 fails for good (DLQ), 1 in 5 fails its first attempt (a retry bucket),
/// the rest succeed.
pub fn expected_dead(n: usize) -> bool {
    n.is_multiple_of(5)
}

/// The failure planned for order `id` at `attempt`: refused for good ([`expected_dead`]), or
/// failing its first attempt (the order after such a one); `None`: the order succeeds.
pub fn planned_failure(id: &str, attempt: u32) -> Option<QueueHandlerError> {
    let n: usize = id.trim_start_matches("order-").parse().unwrap_or(0);
    if expected_dead(n) {
        Some(QueueHandlerError::permanent("refused by the test"))
    } else if n % 5 == 1 && attempt == 1 {
        Some(QueueHandlerError::retryable("first attempt fails"))
    } else {
        None
    }
}

/// The handler: 5 ms of work, then the outcome [`planned_failure`] says.
pub fn router(handled: &Handled) -> Router {
    router_working(handled, Duration::from_millis(5))
}

/// [`router`] with `work` of work a call.
pub fn router_working(handled: &Handled, work: Duration) -> Router {
    let handled = handled.clone();
    Router::new().route("order.placed", move |meta: Meta| {
        let handled = handled.clone();
        async move {
            tokio::time::sleep(work).await;
            let id = meta.message_id().to_owned();
            let result = planned_failure(&id, meta.attempt()).map_or(Ok(()), Err);
            handled.record(&id, result.is_ok());
            result
        }
    })
}

/// [`publish_until`] in a task of its own, through `urls` starting with `urls[first]`, until
/// the flag returned is set.
pub fn publishing(
    urls: Vec<String>,
    first: usize,
    queue: &str,
    rate: usize,
) -> (Arc<AtomicBool>, tokio::task::JoinHandle<(usize, usize)>) {
    let stop = Arc::new(AtomicBool::new(false));
    let publisher = tokio::spawn(publish_until(
        urls,
        first,
        queue.to_owned(),
        rate,
        Arc::clone(&stop),
    ));
    (stop, publisher)
}

/// Publishes orders at `rate` a second, 25 to a batch, each batch confirmed, until `stop`,
/// starting with `urls[first]`; returns how many were confirmed and how many were tried (a
/// batch that failed last may have reached the queue in part). A batch whose publish or
/// confirms fail, or that takes longer than 10 s (a link gone silent), is published again
/// through the next node, so an id may be published twice but never not at all.
pub async fn publish_until(
    urls: Vec<String>,
    first: usize,
    queue: String,
    rate: usize,
    stop: Arc<AtomicBool>,
) -> (usize, usize) {
    let mut node = first;
    let mut publisher: Option<Publisher> = None;
    let to = Destination::queue(&queue);
    let batch = 25;
    let started = Instant::now();
    let mut n = 0;
    let mut tried = 0;
    while !stop.load(Ordering::Acquire) {
        let due = started + Duration::from_secs_f64(n as f64 / rate as f64);
        tokio::time::sleep_until(due.into()).await;
        let Some(open) = &publisher else {
            let connecting = Publisher::connect(&urls[node]);
            publisher = tokio::time::timeout(Duration::from_secs(10), connecting)
                .await
                .ok()
                .and_then(Result::ok);
            if publisher.is_none() {
                node = (node + 1) % urls.len();
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            continue;
        };
        tried = tried.max(n + batch);
        let messages = (n..n + batch).map(|i| {
            let body = format!(r#"{{"n":{i}}}"#).into_bytes();
            Outgoing::bytes(
                "order.placed",
                &format!("order-{i}"),
                "application/json",
                body,
            )
        });
        let published =
            tokio::time::timeout(Duration::from_secs(10), open.publish_all(&to, messages)).await;
        if published.is_ok_and(|p| p.iter().all(Published::is_confirmed)) {
            n += batch;
        } else {
            publisher = None;
            node = (node + 1) % urls.len();
        }
    }
    (n, tried)
}

/// Waits until `more` further orders than now were handled to success: consuming goes on.
///
/// # Panics
/// When it does not within `within`.
pub async fn progress(handled: &Handled, more: usize, within: Duration, what: &str) {
    let target = handled.succeeded() + more;
    let resumed = eventually(within, || handled.succeeded() >= target).await;
    assert!(
        resumed,
        "{what}: consuming did not resume ({} succeeded, waiting for {target})",
        handled.succeeded()
    );
}

/// Waits for every valid order of `0..orders` to be handled to success, then for two readings
/// a second apart (by `depths`) with the work queue and the buckets of `topology` empty; how
/// long the first wait took. The broker's counts do not show a copy its dead-lettering holds
/// between a bucket and the work queue, and quorum counts lag; a copy still in a bucket is
/// read back by [`Ending::read`].
pub async fn settle(
    handled: &Handled,
    orders: usize,
    topology: &Topology,
    depths: impl Fn() -> BTreeMap<String, u64>,
) -> Duration {
    let succeeded = |n: usize| expected_dead(n) || handled.ok_count(&format!("order-{n}")) > 0;
    let waiting = Instant::now();
    eventually(Duration::from_secs(90), || (0..orders).all(succeeded)).await;
    let waited = waiting.elapsed();
    let empty = || {
        let depths = depths();
        std::iter::once(topology.queue())
            .chain(topology.buckets().map(|(b, _)| b))
            .all(|q| depths.get(q) == Some(&0))
    };
    for _ in 0..2 {
        eventually(Duration::from_secs(60), empty).await;
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
    waited
}

/// What the queues held at the end and what the report named, read back through one client.
pub struct Ending {
    pub dead: BTreeMap<String, usize>,
    pub parked: BTreeMap<String, usize>,
    pub left: BTreeMap<String, usize>,
    pub in_buckets: BTreeMap<String, usize>,
    pub unresolved: Vec<String>,
}

impl Ending {
    /// Drains the work queue, the DLQ, the parking lane and the buckets of `topology` through
    /// `client`; `report` names what stayed unresolved.
    pub async fn read(client: &Client, topology: &Topology, report: &ShutdownReport) -> Self {
        let mut in_buckets = BTreeMap::new();
        for (b, _) in topology.buckets() {
            in_buckets.extend(client.drain_ids(b).await);
        }
        Self {
            dead: client.drain_ids(&topology.dead_letter_queue()).await,
            parked: client.drain_ids(&topology.parking_queue()).await,
            left: client.drain_ids(topology.queue()).await,
            in_buckets,
            unresolved: report
                .unresolved
                .iter()
                .filter_map(|u| u.message_id.clone())
                .collect(),
        }
    }

    /// Every confirmed order `0..orders` accounted for, by id: a valid one handled to success,
    /// a refused one in the DLQ, or either still in a bucket or named unresolved; nothing left
    /// in the work queue or parked; nothing that was never published (ids from `tried` on).
    pub fn violations(&self, handled: &Handled, orders: usize, tried: usize) -> Vec<String> {
        let mut violations = Vec::new();
        for n in 0..orders {
            let id = format!("order-{n}");
            let in_dlq = self.dead.get(&id).copied().unwrap_or(0);
            let named = self.unresolved.contains(&id);
            let in_bucket = self.in_buckets.contains_key(&id);
            if self.left.contains_key(&id) && !named {
                violations.push(format!("{id}: left in the work queue"));
            }
            if self.parked.contains_key(&id) {
                violations.push(format!("{id}: parked"));
            }
            if expected_dead(n) {
                if in_dlq == 0 && !named && !in_bucket {
                    violations.push(format!(
                        "{id}: lost (not in the DLQ, {} calls)",
                        handled.calls(&id)
                    ));
                }
            } else {
                if handled.ok_count(&id) == 0 && !named && !in_bucket {
                    violations.push(format!(
                        "{id}: lost (never handled to success, {} calls)",
                        handled.calls(&id)
                    ));
                }
                if in_dlq > 0 {
                    violations.push(format!("{id}: a valid order in the DLQ"));
                }
            }
        }
        violations.extend(
            self.dead
                .keys()
                .chain(self.parked.keys())
                .filter(|id| {
                    id.trim_start_matches("order-")
                        .parse::<usize>()
                        .map_or(true, |n| n >= tried)
                })
                .map(|id| format!("{id}: never published")),
        );
        violations
    }

    /// Prints what `what` ended with and fails the test on any of [`Ending::violations`].
    pub fn assert_accounted(
        &self,
        what: &str,
        handled: &Handled,
        (orders, tried): (usize, usize),
        report: &ShutdownReport,
    ) {
        let violations = self.violations(handled, orders, tried);
        let (rerun, rerun_unnamed) = self.reruns(handled, orders);
        eprintln!(
            "{what}: {orders} orders confirmed ({tried} tried), {} in the DLQ ({} doubled), \
             {rerun} handled to success more than once ({rerun_unnamed} of them not named \
             unresolved), {} unresolved, {} still in a bucket, connections lost {}, totals {:?}",
            self.dead.len(),
            self.doubled(),
            self.unresolved.len(),
            self.in_buckets.len(),
            report.incidents.connections_lost,
            report.totals
        );
        assert!(
            violations.is_empty(),
            "{what}: {} violations, the first: {:#?}",
            violations.len(),
            &violations[..violations.len().min(20)]
        );
    }

    /// Orders in the DLQ more than once (an ACK lost after its confirm).
    pub fn doubled(&self) -> usize {
        self.dead.values().filter(|n| **n > 1).count()
    }

    /// Orders handled to success more than once, and how many of them the report did not name
    /// (a second success is allowed, at least once: an order published twice, a delivery whose
    /// authority was lost, an ACK lost with its leader).
    pub fn reruns(&self, handled: &Handled, orders: usize) -> (usize, usize) {
        let rerun: Vec<String> = (0..orders)
            .map(|n| format!("order-{n}"))
            .filter(|id| handled.ok_count(id) > 1)
            .collect();
        let unnamed = rerun
            .iter()
            .filter(|id| !self.unresolved.contains(id))
            .count();
        (rerun.len(), unnamed)
    }
}
