//! The broker stopped and started again while the `outbox` binary's relay has events to
//! publish: the relay backs off while the broker is gone and publishes everything once it is
//! back; checked by message id. Alone in its test binary: it stops the shared node.

mod common;

use std::time::Duration;

use common::{AllStaged, ORDERS, Service, World};
use lily::mongo::mongodb::bson::{DateTime, Document, doc};
use lily_mq_testkit::MongoNode;

/// 300 orders staged while another owner holds the outbox's lease; the broker is stopped,
/// the lease given up, and for 5 s the relay has 300 events and no broker. The broker comes
/// back: the service's consumer and relay, and the downstream consumer, reconnect, and each
/// order ends with one order, one event marked sent and one effect downstream.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_broker_stopped_and_back_every_event_is_published_and_takes_effect_once() {
    let world = World::new("outbox-broker", "quorum").await;
    let relays = world.database.collection::<Document>("lily_outbox_relays");
    let far = DateTime::from_millis(DateTime::now().timestamp_millis() + 3_600_000);
    relays
        .insert_one(doc! { "_id": "outbox", "owner": "elsewhere", "expires_at": far })
        .await
        .expect("lease held elsewhere");
    let node = MongoNode::from_env();
    let service = Service::start(&world, world.broker.url(), node.url(), &[]);
    service.ready().await;
    world.place_orders().await;
    world
        .until("every order staged", Duration::from_secs(90), AllStaged)
        .await;
    let broker = world.broker.clone();
    tokio::task::spawn_blocking(move || broker.ctl(&["stop_app"]))
        .await
        .expect("stop_app");
    relays
        .delete_one(doc! { "_id": "outbox" })
        .await
        .expect("lease given up");
    tokio::time::sleep(Duration::from_secs(5)).await;
    assert_eq!(
        world.in_state("staged").await,
        ORDERS as u64,
        "nothing marked without a broker"
    );
    let broker = world.broker.clone();
    tokio::task::spawn_blocking(move || broker.start_app())
        .await
        .expect("start_app");
    world.finish_and_check(service).await;
}
