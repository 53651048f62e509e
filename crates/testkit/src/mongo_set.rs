//! The private three-member MongoDB replica set the test command started, and the faults a
//! failover test puts it through.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use mongodb::bson::{Document, doc};
use mongodb::options::{ClientOptions, ServerAddress};

/// The three-member replica set `lily` that `scripts/test.sh` starts with
/// `scripts/mongod.sh start-set`: members `m0`, `m1` and `m2` in one directory, on three
/// consecutive loopback ports, with authentication (member authentication by key file) and TLS
/// as the single node has them. Clients reach it as a replica set, so they follow elections.
///
/// The partition hosts' set ([`crate::Partitions::mongo_set`]) is one too, its members on
/// hosts of their own; there `kill` and `start` do not apply (they act on loopback members).
#[derive(Clone, Debug)]
pub struct MongoSet {
    url: String,
    dir: PathBuf,
    members: Vec<(String, u16)>,
}

/// A member of the set, by its index (`m0`, `m1`, `m2`).
pub type Member = usize;

impl MongoSet {
    /// The set named by `LILY_MONGO_SET_URL` and `LILY_MONGOD_SET_DIR`.
    ///
    /// # Panics
    /// When they are not set: run the tests through `scripts/test.sh`.
    pub fn from_env() -> Self {
        let (Ok(url), Ok(dir)) = (
            std::env::var("LILY_MONGO_SET_URL"),
            std::env::var("LILY_MONGOD_SET_DIR"),
        ) else {
            panic!(
                "no MongoDB replica set for tests: LILY_MONGO_SET_URL and LILY_MONGOD_SET_DIR \
                 are unset. Run the suite with scripts/test.sh, which starts a private \
                 three-member set on loopback (or start one with scripts/mongod.sh start-set \
                 DIR PORT and export LILY_MONGO_SET_URL=mongodb://127.0.0.1:PORT,127.0.0.1:\
                 PORT+1,127.0.0.1:PORT+2/?replicaSet=lily and LILY_MONGOD_SET_DIR=DIR)"
            );
        };
        Self::at(url, dir.into())
    }

    /// The set whose connection string is `url` (its hosts are the members `m0`, `m1`, ... in
    /// order) and whose members keep their data in `dir/m0`, `dir/m1`, ...
    ///
    /// # Panics
    /// When `url` names no `host:port`.
    pub fn at(url: String, dir: PathBuf) -> Self {
        let hosts = url
            .split_once("://")
            .map(|(_, rest)| rest.rsplit_once('@').map_or(rest, |(_, hosts)| hosts))
            .and_then(|rest| rest.split(['/', '?']).next())
            .expect("hosts in the set's URL");
        let members = hosts
            .split(',')
            .map(|member| {
                member
                    .rsplit_once(':')
                    .and_then(|(host, port)| Some((host.to_owned(), port.parse().ok()?)))
                    .expect("host:port in the set's URL")
            })
            .collect();
        Self { url, dir, members }
    }

    /// The set's connection string (no `directConnection`: the driver follows elections).
    pub fn url(&self) -> &str {
        &self.url
    }

    /// The data directory of `member`; its log is `mongod.log` there.
    pub fn dir(&self, member: Member) -> PathBuf {
        self.dir.join(format!("m{member}"))
    }

    /// The number of members.
    pub fn len(&self) -> usize {
        self.members.len()
    }

    /// Whether the set has no member (never, for a set that started).
    pub fn is_empty(&self) -> bool {
        self.members.is_empty()
    }

    /// A client of `member` alone, with the set's credentials.
    async fn direct(&self, member: Member) -> mongodb::Client {
        let mut options = ClientOptions::parse(&self.url)
            .await
            .expect("the set's URL parses");
        let (host, port) = &self.members[member];
        options.hosts = vec![ServerAddress::Tcp {
            host: host.clone(),
            port: Some(*port),
        }];
        options.repl_set_name = None;
        options.direct_connection = Some(true);
        options.server_selection_timeout = Some(Duration::from_secs(1));
        options.connect_timeout = Some(Duration::from_secs(1));
        mongodb::Client::with_options(options).expect("a direct client")
    }

    /// Runs `command` on `member` alone, through a client shut down afterwards (a client
    /// merely dropped ends its sessions in a task of its own, which the driver lets panic when
    /// its pool went first).
    async fn run(&self, member: Member, command: Document) -> Option<Document> {
        let client = self.direct(member).await;
        let answer = client.database("admin").run_command(command).await.ok();
        client.shutdown().immediate(true).await;
        answer
    }

    /// What `member` says of itself: writable primary, secondary, or no answer.
    async fn state(&self, member: Member) -> Option<(bool, bool)> {
        let hello = self.run(member, doc! { "hello": 1 }).await?;
        let flag = |key| hello.get_bool(key).unwrap_or(false);
        Some((flag("isWritablePrimary"), flag("secondary")))
    }

    /// The member that is a writable primary now, asking each member itself.
    pub async fn primary(&self) -> Option<Member> {
        for member in 0..self.len() {
            if matches!(self.state(member).await, Some((true, _))) {
                return Some(member);
            }
        }
        None
    }

    /// Waits until some member is a writable primary, and returns it.
    ///
    /// # Panics
    /// When none is within `timeout`.
    pub async fn await_primary(&self, timeout: Duration) -> Member {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(member) = self.primary().await {
                return member;
            }
            assert!(
                Instant::now() < deadline,
                "no primary within {timeout:?} (logs in {})",
                self.dir.display()
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Waits until every member is a primary or a secondary again.
    ///
    /// # Panics
    /// When they are not within `timeout`.
    pub async fn await_healthy(&self, timeout: Duration) {
        let deadline = Instant::now() + timeout;
        loop {
            let mut up = 0;
            for member in 0..self.len() {
                if matches!(self.state(member).await, Some((true, _) | (_, true))) {
                    up += 1;
                }
            }
            if up == self.len() {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "the set is not whole again within {timeout:?}: {up} of {} members up",
                self.len()
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    /// SIGKILLs `member`: its sockets close, nothing is flushed.
    pub fn kill(&self, member: Member) {
        let pid = self.pid(member);
        let status = std::process::Command::new("kill")
            .args(["-KILL", &pid.to_string()])
            .status()
            .expect("run kill");
        assert!(status.success(), "kill -KILL {pid} failed");
        // Reaped by nobody until it is started again: wait until it no longer answers.
        let deadline = Instant::now() + Duration::from_secs(10);
        let (host, port) = &self.members[member];
        while std::net::TcpStream::connect((host.as_str(), *port)).is_ok() {
            assert!(
                Instant::now() < deadline,
                "m{member} still listens after SIGKILL"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        // Its port closes before it has finished exiting; on a loaded machine it can take
        // seconds more, and `start` refuses a member whose process still runs.
        while alive(pid) {
            assert!(
                Instant::now() < deadline,
                "m{member} (pid {pid}) still runs 10 s after SIGKILL"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Stops `member` with SIGTERM (a clean shutdown; a primary steps down first).
    pub fn stop(&self, member: Member) {
        self.script(&["stop", &self.dir(member).to_string_lossy()]);
    }

    /// Starts `member` again with the arguments it was first started with.
    pub fn start(&self, member: Member) {
        self.script(&["member-start", &self.dir(member).to_string_lossy()]);
    }

    /// Asks the primary to step down for `seconds` (`replSetStepDown`); returns the member
    /// that was primary.
    ///
    /// # Panics
    /// When there is no primary or it refuses.
    pub async fn step_down(&self, seconds: u32) -> Member {
        let primary = self.await_primary(Duration::from_secs(30)).await;
        // The command closes the connection it arrives on once the member is a secondary: an
        // error here is the step-down having happened; whether it did is checked below.
        let step_down = doc! { "replSetStepDown": i64::from(seconds), "force": true };
        let _ = self.run(primary, step_down).await;
        let deadline = Instant::now() + Duration::from_secs(10);
        while self.primary().await == Some(primary) {
            assert!(Instant::now() < deadline, "m{primary} did not step down");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        primary
    }

    /// The documents members rolled back (from the rollback files they wrote): writes a
    /// primary applied and lost with its term before a majority had them, so never
    /// acknowledged to a client that asked for a majority.
    ///
    /// # Panics
    /// When a rollback file cannot be read or parsed.
    pub fn rolled_back(&self) -> Vec<Document> {
        let mut documents = Vec::new();
        for member in 0..self.len() {
            let root = self.dir(member).join("db").join("rollback");
            let Ok(collections) = std::fs::read_dir(&root) else {
                continue;
            };
            for file in collections
                .flatten()
                .filter_map(|dir| std::fs::read_dir(dir.path()).ok())
                .flatten()
                .flatten()
            {
                let bytes = std::fs::read(file.path()).expect("read a rollback file");
                let mut reader = bytes.as_slice();
                while !reader.is_empty() {
                    documents.push(Document::from_reader(&mut reader).expect("a BSON document"));
                }
            }
        }
        documents
    }

    fn pid(&self, member: Member) -> u32 {
        let file = self.dir(member).join("mongod.pid");
        std::fs::read_to_string(&file)
            .ok()
            .and_then(|pid| pid.trim().parse().ok())
            .unwrap_or_else(|| panic!("no PID in {}", file.display()))
    }

    fn script(&self, args: &[&str]) {
        let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../scripts/mongod.sh");
        let status = std::process::Command::new(script)
            .args(args)
            .status()
            .expect("run scripts/mongod.sh");
        assert!(status.success(), "scripts/mongod.sh {args:?} failed");
    }
}

/// Whether process `pid` exists and has not exited (a zombie waiting to be reaped has).
fn alive(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|stat| {
        let state = stat.rsplit_once(") ").map_or("", |(_, rest)| rest);
        !state.starts_with(['Z', 'X'])
    })
}
