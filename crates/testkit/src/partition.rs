//! The partition hosts of `scripts/partition.sh`: a three-node RabbitMQ cluster, a
//! three-member MongoDB replica set and the host `lily` in network namespaces of their own,
//! joined by a bridge whose rules cut links on purpose.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::{Command, Output};
use std::time::Duration;

use crate::{MongoSet, eventually};

const SCRIPT: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../../scripts/partition.sh");

/// A host of the partition set-up.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Host {
    /// RabbitMQ node `rabbit@n1` (0), `n2` (1) or `n3` (2).
    Node(usize),
    /// Member `m0`, `m1` or `m2` of the MongoDB replica set (its index in
    /// [`Partitions::mongo_set`]).
    Member(usize),
    /// Where the process under test runs.
    Lily,
}

impl Host {
    fn name(self) -> String {
        match self {
            Self::Node(n) => format!("n{}", n + 1),
            Self::Member(m) => format!("m{m}"),
            Self::Lily => "lily".to_owned(),
        }
    }
}

/// The partition hosts set up in `LILY_PARTITION_DIR` (`scripts/partition.sh up DIR`).
#[derive(Clone, Debug)]
pub struct Partitions {
    dir: PathBuf,
}

impl Partitions {
    /// The hosts of `LILY_PARTITION_DIR`.
    ///
    /// # Panics
    /// When it is unset: run the partition tests through `scripts/test.sh`.
    pub fn from_env() -> Self {
        let Ok(dir) = std::env::var("LILY_PARTITION_DIR") else {
            panic!(
                "no partition hosts for tests: LILY_PARTITION_DIR is unset. Run the suite with \
                 scripts/test.sh, which sets them up (or run scripts/partition.sh up DIR as root \
                 and export LILY_PARTITION_DIR=DIR)"
            );
        };
        Self { dir: dir.into() }
    }

    /// The broker's AMQP heartbeat the hosts were set up with (`LILY_PARTITION_HEARTBEAT`).
    pub fn heartbeat(&self) -> Duration {
        self.setting("heartbeat")
    }

    /// The nodes' `net_ticktime` (`LILY_PARTITION_TICKTIME`).
    pub fn ticktime(&self) -> Duration {
        self.setting("ticktime")
    }

    /// The RabbitMQ version the nodes run (`LILY_RABBIT_VERSION` at `up`): `3.10` or `4.0`.
    pub fn version(&self) -> String {
        std::fs::read_to_string(self.dir.join("version"))
            .map_or_else(|_| "3.10".to_owned(), |v| v.trim().to_owned())
    }

    /// The replica set's `electionTimeoutMillis` (`LILY_PARTITION_ELECTION_MS`).
    pub fn election_timeout(&self) -> Duration {
        Duration::from_millis(self.number("election_ms").unwrap_or(10_000))
    }

    /// A timer `up` recorded, in seconds (RabbitMQ's default, 60, when it did not).
    fn setting(&self, name: &str) -> Duration {
        Duration::from_secs(self.number(name).unwrap_or(60))
    }

    fn number(&self, name: &str) -> Option<u64> {
        std::fs::read_to_string(self.dir.join(name))
            .ok()
            .and_then(|s| s.trim().parse().ok())
    }

    /// The replica set on `m0` .. `m2`, as the host `lily` reaches it (a replica-set URL: the
    /// driver follows elections).
    pub fn mongo_set(&self) -> MongoSet {
        let members: Vec<String> = (0..3)
            .map(|m| format!("10.77.0.{}:27017", 20 + m))
            .collect();
        let url = format!("mongodb://{}/?replicaSet=lily", members.join(","));
        MongoSet::at(url, self.dir.clone())
    }

    /// The URL of node `node`'s default vhost, as the host `lily` reaches it.
    pub fn url(&self, node: usize) -> String {
        format!("amqp://guest:guest@{}/%2f", self.address(node))
    }

    /// The URLs of the three nodes, in order.
    pub fn urls(&self) -> Vec<String> {
        (0..3).map(|n| self.url(n)).collect()
    }

    /// `ADDRESS:5672` of node `node`.
    pub fn address(&self, node: usize) -> String {
        format!("10.77.0.{}:5672", 11 + node)
    }

    /// The `amqps://` URL of node `node`'s default vhost: the node presents a certificate of its
    /// own name and address, signed by [`Partitions::ca_pem`].
    pub fn tls_url(&self, node: usize) -> String {
        format!("amqps://guest:guest@{}/%2f", self.tls_address(node))
    }

    /// `ADDRESS:5671` of node `node`.
    pub fn tls_address(&self, node: usize) -> String {
        format!("10.77.0.{}:5671", 11 + node)
    }

    /// The PEM of the CA that signed the nodes' certificates.
    ///
    /// # Panics
    /// When `up` made none.
    pub fn ca_pem(&self) -> String {
        std::fs::read_to_string(self.dir.join("ca.pem")).expect("the hosts' CA (ca.pem)")
    }

    /// Moves the calling thread into the host `lily`'s network: the sockets it opens from now
    /// on, and those of the threads it starts (a runtime's workers), are `lily`'s. Call it on
    /// a thread of its own, before building the runtime.
    ///
    /// # Panics
    /// When the namespace is missing or the move is refused (it needs root).
    pub fn enter_lily(&self) {
        let prefix = std::fs::read_to_string(self.dir.join("prefix")).expect("the hosts' prefix");
        let path = format!("/var/run/netns/{}-lily", prefix.trim());
        let namespace = std::fs::File::open(&path).unwrap_or_else(|e| panic!("{path}: {e}"));
        rustix::thread::move_into_link_name_space(
            std::os::fd::AsFd::as_fd(&namespace),
            Some(rustix::thread::LinkNameSpaceType::Network),
        )
        .unwrap_or_else(|e| panic!("enter {path}: {e}"));
    }

    fn script(&self, args: &[&str]) -> Output {
        let dir = self.dir.to_str().expect("utf-8 path");
        let (command, rest) = args.split_first().expect("a command");
        // A node wedged in its boot holds `rabbitmqctl` without end: a minute at most.
        Command::new("timeout")
            .arg("60")
            .arg(SCRIPT)
            .arg(command)
            .arg(dir)
            .args(rest)
            .output()
            .expect("run scripts/partition.sh")
    }

    fn must(&self, args: &[&str]) -> String {
        let out = self.script(args);
        assert!(
            out.status.success(),
            "partition.sh {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// Drops every packet between `a` and `b`, both ways, silently.
    pub fn cut(&self, a: Host, b: Host) {
        self.must(&["cut", &a.name(), &b.name()]);
    }

    /// Drops `percent` % of the packets between `a` and `b`, at random.
    pub fn loss(&self, a: Host, b: Host, percent: u8) {
        self.must(&["loss", &a.name(), &b.name(), &percent.to_string()]);
    }

    /// Cuts `a` from every other host.
    pub fn isolate(&self, a: Host) {
        self.must(&["isolate", &a.name()]);
    }

    /// Removes every cut and loss.
    pub fn heal(&self) {
        self.must(&["heal"]);
    }

    /// `rabbitmqctl ARGS` against `node`, its output; `None` when it failed (a paused node, a
    /// node cut from the others).
    pub fn ctl(&self, node: usize, args: &[&str]) -> Option<String> {
        let name = Host::Node(node).name();
        let mut all = vec!["ctl", name.as_str()];
        all.extend_from_slice(args);
        let out = self.script(&all);
        out.status
            .success()
            .then(|| String::from_utf8_lossy(&out.stdout).into_owned())
    }

    /// Whether `node` runs the RabbitMQ application (`pause_minority` stops it on the side
    /// that lost the majority).
    pub fn running(&self, node: usize) -> bool {
        self.ctl(node, &["-q", "eval", "rabbit:is_running()."])
            .is_some_and(|out| out.trim() == "true")
    }

    /// The peers `node` records a partition with (`rabbit_node_monitor:partitions()`, what
    /// `rabbitmqctl cluster_status` lists under "Network Partitions"): while any is recorded,
    /// the two sides' metadata do not replicate, so a queue declared on one side is unroutable
    /// from the other. `None` when the node does not answer.
    pub fn partitions(&self, node: usize) -> Option<Vec<usize>> {
        let out = self.ctl(node, &["-q", "eval", "rabbit_node_monitor:partitions()."])?;
        Some(
            (0..3)
                .filter(|n| out.contains(&format!("rabbit@n{}", n + 1)))
                .collect(),
        )
    }

    /// Waits until all three nodes run, each is connected to the two others and none records a
    /// partition. What an operator would do after a minute without that is done, and the nodes
    /// restarted are returned: a node still paused is restarted (RabbitMQ 3.10's
    /// `pause_minority` left one so, wedged in its boot), then, while partitions stay recorded
    /// (4.0.5 left them so after successive partitions), the node that records the most, one at
    /// a time, as RabbitMQ's guide says (restart the side you trust least).
    ///
    /// # Panics
    /// When the cluster is not whole after three such restarts, or two minutes after one.
    pub async fn await_whole(&self) -> Vec<usize> {
        let peers = r#"length([N || N <- nodes(), lists:prefix("rabbit@", atom_to_list(N))])."#;
        let connected = || {
            (0..3).all(|n| {
                self.running(n)
                    && self
                        .ctl(n, &["-q", "eval", peers])
                        .is_some_and(|out| out.trim() == "2")
            })
        };
        let clear = || (0..3).all(|n| self.partitions(n).is_some_and(|p| p.is_empty()));
        let whole = || connected() && clear();
        if eventually(Duration::from_secs(60), whole).await {
            return Vec::new();
        }
        let mut restarted: Vec<usize> = (0..3).filter(|n| !self.running(*n)).collect();
        for node in &restarted {
            self.must(&["restart", &Host::Node(*node).name()]);
        }
        for _ in 0..3 {
            let up = eventually(Duration::from_secs(120), connected).await;
            assert!(
                up,
                "the cluster did not come back whole after healing (restarted: {restarted:?})"
            );
            if eventually(Duration::from_secs(30), clear).await {
                return restarted;
            }
            let recorded: Vec<usize> = (0..3)
                .map(|n| self.partitions(n).map_or(0, |p| p.len()))
                .collect();
            let Some(most) = (0..3)
                .filter(|n| recorded[*n] > 0)
                .max_by_key(|n| (recorded[*n], 3 - n))
            else {
                continue;
            };
            self.must(&["restart", &Host::Node(most).name()]);
            restarted.push(most);
        }
        let whole = eventually(Duration::from_secs(120), whole).await;
        assert!(
            whole,
            "partitions stay recorded after restarting {restarted:?}"
        );
        restarted
    }

    /// The node leading quorum queue `queue`, as a running node tells.
    pub fn leader(&self, queue: &str) -> Option<usize> {
        let out = (0..3).find_map(|n| {
            self.ctl(
                n,
                &["list_queues", "-q", "--no-table-headers", "name", "leader"],
            )
        })?;
        let leader = out.lines().find_map(|line| {
            let mut cols = line.split_whitespace();
            (cols.next()? == queue).then(|| cols.next().map(str::to_owned))?
        })?;
        (0..3).find(|n| leader == format!("rabbit@n{}", n + 1))
    }

    /// The node the client connection named `name` (its `connection_name`) is open on, by the
    /// address it was opened to (`rabbitmqctl list_connections` lists the whole cluster's). A
    /// connection its client gave up across a partition stays listed until its node's heartbeat
    /// check closes it: of several by that name, the one opened last is the client's.
    pub fn serving(&self, name: &str) -> Option<usize> {
        let quoted = format!("\"{name}\"");
        let out = (0..3).find_map(|n| {
            self.ctl(
                n,
                &[
                    "list_connections",
                    "-q",
                    "--no-table-headers",
                    "host",
                    "connected_at",
                    "client_properties",
                ],
            )
        })?;
        let (_, host) = out
            .lines()
            .filter(|line| line.contains(&quoted))
            .filter_map(|line| {
                let mut columns = line.split_whitespace();
                let host = columns.next()?;
                let opened: u64 = columns.next()?.parse().ok()?;
                Some((opened, host))
            })
            .max()?;
        (0..3).find(|n| self.address(*n).split(':').next() == Some(host))
    }

    /// Every queue's messages, ready and unacknowledged, as node `node` counts them.
    pub fn depths(&self, node: usize) -> BTreeMap<String, u64> {
        crate::depths(&self.ctl(node, &crate::DEPTHS).unwrap_or_default())
    }
}
