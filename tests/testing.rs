//! `lily::testing` predicts what the real consumer does. The same deliveries go to a
//! [`TestConsumer`] in process and, through [`Publisher`], to a real consumer on the real
//! node; every lane is then drained and each message id's queue, attempt, failure kind, reason
//! and header names are compared with the prediction.

mod common;

use std::collections::BTreeMap;
use std::time::Duration;

use common::{config, fast_policy, header_str, header_u32, scenario};
use lapin::BasicProperties;
use lily::prelude::*;
use lily::shutdown::{Lane, Outcome};
use lily::testing::{TestConsumer, TestDelivery};
use lily::topology::Topology;

/// Buckets so long that retry copies stay in them until the test drains them.
const DELAYS: [Duration; 2] = [Duration::from_secs(600), Duration::from_secs(900)];

#[derive(serde::Deserialize, serde::Serialize)]
struct Order {
    /// What the handler does: `ok`, `retry`, `perm`, `ind` or `panic`.
    act: String,
}

async fn handle(Json(order): Json<Order>) -> HandlerResult {
    match order.act.as_str() {
        "ok" => Ok(()),
        "retry" => Err(QueueHandlerError::retryable("stock service unavailable")),
        "perm" => Err(QueueHandlerError::permanent("quantity must be positive")),
        "ind" => Err(QueueHandlerError::indeterminate("payment outcome unknown")),
        _ => panic!("handler bug"),
    }
}

fn router() -> Router {
    Router::new().route("order.placed", handle)
}

/// A case: message id, type, body, and extra headers.
struct Case {
    id: &'static str,
    kind: &'static str,
    body: Vec<u8>,
    headers: Vec<(&'static str, HeaderValueOf)>,
}

#[derive(Clone)]
enum HeaderValueOf {
    Int(u32),
    Text(&'static str),
}

fn act(act: &str) -> Vec<u8> {
    serde_json::to_vec(&Order { act: act.into() }).unwrap()
}

fn cases() -> Vec<Case> {
    use HeaderValueOf::{Int, Text};
    let case = |id, kind, body, headers| Case {
        id,
        kind,
        body,
        headers,
    };
    vec![
        case("ok-1", "order.placed", act("ok"), vec![]),
        case("retry-1", "order.placed", act("retry"), vec![]),
        case(
            "retry-2",
            "order.placed",
            act("retry"),
            vec![("x-lily-attempt", Int(2))],
        ),
        case(
            "retry-3",
            "order.placed",
            act("retry"),
            vec![("x-lily-attempt", Int(3))],
        ),
        case("perm-1", "order.placed", act("perm"), vec![]),
        case("ind-1", "order.placed", act("ind"), vec![]),
        case("panic-1", "order.placed", act("panic"), vec![]),
        case("unknown-1", "order.shipped", act("ok"), vec![]),
        case("garbled-1", "order.placed", b"{not json".to_vec(), vec![]),
        case(
            "v9-1",
            "order.placed",
            act("ok"),
            vec![("schema-version", Int(9))],
        ),
        case(
            "replayed-1",
            "order.placed",
            act("retry"),
            vec![("x-lily-replayed-from", Text("parking"))],
        ),
    ]
}

fn properties(case: &Case) -> BasicProperties {
    let mut table = lapin::types::FieldTable::default();
    for (key, value) in &case.headers {
        let value = match value {
            HeaderValueOf::Int(n) => lapin::types::AMQPValue::LongUInt(*n),
            HeaderValueOf::Text(t) => lapin::types::AMQPValue::LongString((*t).into()),
        };
        table.insert((*key).into(), value);
    }
    // Lily's headers stand for a copy Lily wrote: sealed as it seals them.
    if table
        .inner()
        .keys()
        .any(|k| k.as_str().starts_with("x-lily-"))
    {
        let seal = lily::consumer::HeaderKey::public().seal(case.id, &table);
        table.insert("x-lily-seal".into(), seal);
    }
    common::props(case.id, case.kind).with_headers(table)
}

/// What one message id came to: the queue its copy is in (`None`: ACKed, in no queue), its
/// attempt, failure kind and reason, and the names of its headers that do not change from run
/// to run.
type Fate = (
    Option<String>,
    Option<u32>,
    Option<String>,
    Option<String>,
    Vec<String>,
);

fn fate_of(queue: Option<String>, props: Option<&BasicProperties>) -> Fate {
    let Some(props) = props else {
        return (queue, None, None, None, Vec::new());
    };
    let mut names: Vec<String> = props
        .headers()
        .as_ref()
        .map(|h| h.inner().keys().map(|k| k.as_str().to_owned()).collect())
        .unwrap_or_default();
    // The broker's own and the per-run ones.
    names.retain(|k| {
        !k.starts_with("x-death") && k != "x-delivery-count" && k != "x-lily-publish-id"
    });
    names.sort();
    (
        queue,
        header_u32(props, "x-lily-attempt"),
        header_str(props, "x-lily-failure-kind"),
        header_str(props, "x-lily-reason"),
        names,
    )
}

async fn the_test_consumer_predicts_the_real_one(kind: QueueKind) {
    let configure = |queue: &str| config(queue, kind).policy(fast_policy().retry_delays(DELAYS));
    let (broker, queue, client, running) = scenario("predict", router(), configure).await;

    let predictor = TestConsumer::new(configure(&queue), router()).expect("valid config");
    let mut predicted = BTreeMap::new();
    for case in cases() {
        let settled = predictor
            .deliver(TestDelivery::new(case.body.clone(), properties(&case)))
            .await;
        let copy = settled.copy.as_ref();
        assert!(
            matches!(
                settled.outcome,
                Outcome::Acked | Outcome::Retried | Outcome::DeadLettered | Outcome::Parked
            ),
            "{}: {:?}",
            case.id,
            settled.outcome
        );
        predicted.insert(
            case.id.to_owned(),
            fate_of(copy.map(|c| c.queue.clone()), copy.map(|c| &c.properties)),
        );
        if case.id == "retry-2" {
            let lane = copy.map(|c| c.lane);
            assert_eq!(
                lane,
                Some(Lane::Retry {
                    bucket: 1,
                    next_attempt: 3
                })
            );
        }
    }

    let publisher = Publisher::connect(broker.url()).await.expect("connect");
    for case in cases() {
        // The raw client: some of these carry Lily's own headers, as copies do.
        client.publish(&queue, &case.body, properties(&case)).await;
    }
    let n = cases().len() as u64;
    running
        .wait_for("every case settled", Duration::from_secs(30), |t| {
            t.acked + t.retried + t.dead_lettered + t.parked == n
        })
        .await;
    publisher.close().await;

    let topology = Topology::new(&queue, kind, &DELAYS);
    let mut lanes: Vec<String> = topology
        .buckets()
        .map(|(name, _)| name.to_owned())
        .collect();
    lanes.extend([
        topology.dead_letter_queue(),
        topology.parking_queue(),
        queue.clone(),
    ]);
    let mut actual = BTreeMap::new();
    for case in cases() {
        actual.insert(case.id.to_owned(), fate_of(None, None));
    }
    for lane in &lanes {
        for message in client.drain(lane).await {
            let id = message
                .delivery
                .properties
                .message_id()
                .clone()
                .unwrap()
                .to_string();
            let previous = actual.insert(
                id.clone(),
                fate_of(Some(lane.clone()), Some(&message.delivery.properties)),
            );
            assert_eq!(
                previous,
                Some(fate_of(None, None)),
                "{id} is in more than one place"
            );
        }
    }
    for (id, fate) in &predicted {
        assert_eq!(Some(fate), actual.get(id), "{id}: predicted vs real");
    }
    running.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_test_consumer_predicts_the_real_one_classic() {
    the_test_consumer_predicts_the_real_one(QueueKind::Classic).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_test_consumer_predicts_the_real_one_quorum() {
    the_test_consumer_predicts_the_real_one(QueueKind::Quorum).await;
}

/// A delivery whose DLQ fails is held in a retry bucket, as the consumer holds it; one whose
/// retry buckets fail is requeued, counted by message id across redeliveries, and
/// dead-lettered once its requeues are spent.
#[tokio::test]
async fn failing_lanes_follow_the_machine() {
    let router = || {
        Router::new().route("order.placed", |Json(o): Json<Order>| async move {
            match o.act.as_str() {
                "perm" => Err(QueueHandlerError::permanent("bad order")),
                _ => Err(QueueHandlerError::retryable("inventory locked")),
            }
        })
    };
    let config = ConsumerConfig::new("orders").policy(fast_policy());
    let no_dlq = TestConsumer::new(config.clone(), router())
        .unwrap()
        .failing_lane("orders.dlq");
    let held = no_dlq
        .deliver(TestDelivery::json(
            "order.placed",
            "p-1",
            &Order { act: "perm".into() },
        ))
        .await;
    assert_eq!(held.outcome, Outcome::Held);
    let copy = held.copy.expect("a held copy");
    assert!(copy.queue.starts_with("orders.retry."), "{}", copy.queue);
    assert_eq!(copy.header_text("x-lily-held-for"), Some("dead-letter"));

    let topology = Topology::new("orders", QueueKind::Classic, &fast_policy().retry_delays);
    let no_buckets = topology.buckets().fold(
        TestConsumer::new(config, router()).unwrap(),
        |c, (name, _)| c.failing_lane(name),
    );
    let mut outcomes = Vec::new();
    for redelivered in [false, true, true, true] {
        let delivery = TestDelivery::json(
            "order.placed",
            "r-1",
            &Order {
                act: "retry".into(),
            },
        )
        .redelivered(redelivered);
        outcomes.push(no_buckets.deliver(delivery).await.outcome);
    }
    let requeued = Outcome::Requeued(lily::shutdown::RequeueCause::HandoffFailed);
    assert_eq!(
        outcomes,
        [requeued, requeued, requeued, Outcome::DeadLettered]
    );
}

/// A scope that opens every delivery the same way, as a lease held elsewhere or an inbox that
/// has the message already would.
struct FixedScope(fn() -> lily::scope::Begin);

impl lily::scope::TransactionalScope for FixedScope {
    fn begin<'a>(
        &'a self,
        _meta: &'a Meta,
        _deadline: Duration,
    ) -> lily::handler::BoxFuture<'a, lily::scope::Begin> {
        Box::pin(std::future::ready((self.0)()))
    }
}

/// With a scope, the test consumer runs the consumer's loop through it: a deferral holds and
/// requeues without an attempt until its requeues are spent; a duplicate is ACKed without the
/// handler.
#[tokio::test]
async fn a_scope_defers_and_suppresses_duplicates_as_in_the_consumer() {
    let calls = std::sync::Arc::new(std::sync::atomic::AtomicU32::new(0));
    let counted = calls.clone();
    let router = Router::new().route("order.placed", move |_: Meta| {
        counted.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        async { Ok(()) }
    });
    let config = ConsumerConfig::new("orders").policy(fast_policy());
    let held = || lily::scope::Begin::Defer {
        reason: lily::shutdown::Reason::new("lease held by another worker"),
        deferrals: None,
    };
    let deferring = TestConsumer::new(config.clone(), router.clone())
        .unwrap()
        .scope(FixedScope(held));
    let mut outcomes = Vec::new();
    for redelivered in [false, true, true, true] {
        let delivery = TestDelivery::json("order.placed", "d-1", &Order { act: "ok".into() })
            .redelivered(redelivered);
        let settled = deferring.deliver(delivery).await;
        outcomes.push((settled.outcome, settled.held_for > Duration::ZERO));
    }
    let deferred = (
        Outcome::Requeued(lily::shutdown::RequeueCause::Deferred),
        true,
    );
    assert_eq!(outcomes[..3], [deferred; 3]);
    assert_eq!(outcomes[3].0, Outcome::DeadLettered, "its requeues spent");

    let duplicates = TestConsumer::new(config, router)
        .unwrap()
        .scope(FixedScope(|| lily::scope::Begin::Duplicate));
    let settled = duplicates
        .deliver(TestDelivery::json(
            "order.placed",
            "dup-1",
            &Order { act: "ok".into() },
        ))
        .await;
    assert_eq!(settled.outcome, Outcome::Acked);
    assert_eq!(
        calls.load(std::sync::atomic::Ordering::Relaxed),
        0,
        "no handler ran"
    );
}

/// A hook runs around the handler as in the consumer: a cleanup that fails turns a success
/// into a retryable failure.
#[tokio::test]
async fn hooks_run_around_the_handler() {
    struct FailingCleanup;
    impl Hook for FailingCleanup {
        async fn after_delivery(
            &self,
            _meta: &Meta,
            _result: lily_mq_core::transport::PipelineResult,
        ) -> Result<(), CleanupError> {
            Err(CleanupError(lily::shutdown::Reason::new(
                "outbox flush failed",
            )))
        }
    }
    let consumer = TestConsumer::new(ConsumerConfig::new("orders"), router())
        .unwrap()
        .hook(FailingCleanup);
    let settled = consumer
        .deliver(TestDelivery::json(
            "order.placed",
            "h-1",
            &Order { act: "ok".into() },
        ))
        .await;
    assert_eq!(settled.outcome, Outcome::Retried);
    // The consumer's reason names the step, not the hook's own text.
    assert!(
        settled.reason.as_str().contains("cleanup failed"),
        "{}",
        settled.reason
    );
}
