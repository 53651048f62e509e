//! The three-node RabbitMQ cluster the test command starts (`scripts/rabbitmq.sh
//! cluster-start`), and the faults a cluster sees: a node's app stopped, a node's VM killed.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::{Command, Output};
use std::time::Duration;

use crate::eventually;

/// The private three-node cluster of `LILY_CLUSTER_DIR`, AMQP on `LILY_CLUSTER_PORT`, +10 and
/// +20.
#[derive(Clone, Debug)]
pub struct Cluster {
    dir: PathBuf,
    ports: [u16; 3],
}

const SCRIPT: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../../scripts/rabbitmq.sh");

impl Cluster {
    /// The cluster named by `LILY_CLUSTER_DIR` and `LILY_CLUSTER_PORT`.
    ///
    /// # Panics
    /// When they are not set: run the tests through `scripts/test.sh`.
    pub fn from_env() -> Self {
        let (Ok(dir), Ok(port)) = (
            std::env::var("LILY_CLUSTER_DIR"),
            std::env::var("LILY_CLUSTER_PORT"),
        ) else {
            panic!(
                "no RabbitMQ cluster for tests: LILY_CLUSTER_DIR and LILY_CLUSTER_PORT are \
                 unset. Run the suite with scripts/test.sh, which starts a private three-node \
                 cluster on loopback (or start one with scripts/rabbitmq.sh cluster-start DIR \
                 PORT and export both)"
            );
        };
        let port: u16 = port.parse().expect("LILY_CLUSTER_PORT is a port");
        Self {
            dir: dir.into(),
            ports: [port, port + 10, port + 20],
        }
    }

    /// The nodes, `0..3`.
    pub fn nodes(&self) -> std::ops::Range<usize> {
        0..self.ports.len()
    }

    /// The URL of node `node`'s default vhost.
    pub fn url(&self, node: usize) -> String {
        format!("amqp://guest:guest@127.0.0.1:{}/%2f", self.ports[node])
    }

    /// `127.0.0.1:PORT` of node `node`.
    pub fn address(&self, node: usize) -> String {
        format!("127.0.0.1:{}", self.ports[node])
    }

    /// The Erlang name of node `node`, as `rabbitmqctl` shows it.
    pub fn name(&self, node: usize) -> String {
        format!("lily{}@localhost", self.ports[node])
    }

    fn node_dir(&self, node: usize) -> PathBuf {
        self.dir.join(format!("n{}", node + 1))
    }

    fn script(&self, args: &[&str]) -> Output {
        Command::new(SCRIPT)
            .args(args)
            .output()
            .expect("run scripts/rabbitmq.sh")
    }

    fn ctl_on(&self, node: usize, args: &[&str]) -> Output {
        let dir = self.node_dir(node);
        let mut all = vec!["ctl", dir.to_str().expect("utf-8 path")];
        all.extend_from_slice(args);
        self.script(&all)
    }

    /// Runs `rabbitmqctl` on the first node that answers.
    ///
    /// # Panics
    /// When no node answers.
    pub fn ctl(&self, args: &[&str]) -> String {
        let mut errors = Vec::new();
        for node in self.nodes() {
            let out = self.ctl_on(node, args);
            if out.status.success() {
                return String::from_utf8_lossy(&out.stdout).into_owned();
            }
            errors.push(String::from_utf8_lossy(&out.stderr).into_owned());
        }
        panic!("rabbitmqctl {args:?} failed on every node: {errors:?}");
    }

    /// The node leading quorum queue `queue`, if the cluster names one.
    pub fn leader(&self, queue: &str) -> Option<usize> {
        let out = self.ctl(&["list_queues", "-q", "--no-table-headers", "name", "leader"]);
        let leader = out.lines().find_map(|line| {
            let mut cols = line.split_whitespace();
            (cols.next()? == queue).then(|| cols.next().map(str::to_owned))?
        })?;
        self.nodes().find(|n| self.name(*n) == leader)
    }

    /// Messages in every queue of the default vhost, ready and unacknowledged, by name. Copies
    /// a quorum queue's at-least-once dead-lettering holds on their way out are not counted.
    pub fn depths(&self) -> BTreeMap<String, u64> {
        crate::depths(&self.ctl(&crate::DEPTHS))
    }

    /// Stops the RabbitMQ application of `node` (`rabbitmqctl stop_app`): its connections
    /// close and its queue replicas stop, as in a rolling upgrade; the VM stays up.
    ///
    /// # Panics
    /// When the node refuses.
    pub fn stop_app(&self, node: usize) {
        let out = self.ctl_on(node, &["stop_app"]);
        assert!(
            out.status.success(),
            "stop_app: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }

    /// Starts the application of `node` again and waits for it to run.
    ///
    /// # Panics
    /// When it does not start.
    pub fn start_app(&self, node: usize) {
        let out = self.ctl_on(node, &["start_app"]);
        assert!(
            out.status.success(),
            "start_app: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        self.await_online();
    }

    /// Kills the Erlang VM of `node` with SIGKILL: no clean stop, as a crash looks.
    pub fn kill(&self, node: usize) {
        let dir = self.node_dir(node);
        let out = self.script(&["kill", dir.to_str().expect("utf-8 path")]);
        assert!(
            out.status.success(),
            "kill: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }

    /// Starts the VM of `node` again, after [`Cluster::kill`], with its data: it rejoins.
    ///
    /// # Panics
    /// When it does not start.
    pub fn restart(&self, node: usize) {
        let dir = self.node_dir(node);
        let port = self.ports[node].to_string();
        let dir = dir.to_str().expect("utf-8 path");
        crate::retry_failed_boot(&format!("restart of node {node}"), || {
            self.script(&["start", dir, &port])
        });
        self.await_online();
    }

    /// Brings back every node an earlier test left down (its VM killed, or its app stopped),
    /// and waits until all three run.
    pub fn heal(&self) {
        for node in self.nodes() {
            let running = self.ctl_on(node, &["eval", "rabbit:is_running()."]);
            if !running.status.success() {
                self.restart(node);
            } else if !String::from_utf8_lossy(&running.stdout).contains("true") {
                self.start_app(node);
            }
        }
        self.await_online();
    }

    /// Waits until all three nodes run the application.
    ///
    /// # Panics
    /// After 60 s.
    pub fn await_online(&self) {
        let out = self.ctl_on(0, &["await_online_nodes", "3", "--timeout", "60"]);
        if !out.status.success() {
            self.ctl(&["await_online_nodes", "3", "--timeout", "60"]);
        }
    }

    /// Waits until every member of quorum queue `queue` is online again (a node back from a
    /// stop catches up before the next fault).
    pub async fn await_members(&self, queue: &str) -> bool {
        eventually(Duration::from_secs(60), || {
            let out = self.ctl(&["list_queues", "-q", "--no-table-headers", "name", "online"]);
            out.lines().any(|line| {
                line.split_whitespace().next() == Some(queue)
                    && self.nodes().all(|n| line.contains(&self.name(n)))
            })
        })
        .await
    }
}
