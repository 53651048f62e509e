//! The peer serves its backlog to both measured consumers, and its tally shows every ACK: what
//! the gate relies on before it trusts a figure.

use lily_mq_regress::consume::{self, Order, Who};
use lily_mq_regress::peer::{Peer, Tally};

fn drained_by(who: Who, n: u64) -> Tally {
    let runtime = tokio::runtime::Runtime::new().expect("tokio runtime");
    let peer = runtime
        .block_on(Peer::start(n, Order::body()))
        .expect("the peer listens");
    let url = peer.url();
    // The consumer runs a runtime of its own, on a thread of its own, as in the gate's child.
    std::thread::spawn(move || consume::run(who, n, &url))
        .join()
        .expect("the consumer's thread")
        .unwrap_or_else(|err| panic!("{} consumer: {err}", who.name()));
    peer.tally()
}

#[test]
fn both_consumers_drain_the_backlog_and_ack_every_delivery() {
    for who in [Who::Raw, Who::Lily] {
        let tally = drained_by(who, 3_000);
        assert_eq!(
            (tally.delivered, tally.acked, tally.refused),
            (3_000, 3_000, 0),
            "{}: {tally:?}",
            who.name()
        );
    }
}
