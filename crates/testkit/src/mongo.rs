//! The private MongoDB node the test command started.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, Ordering};

/// The private single-node MongoDB replica set (`lily`) that `scripts/test.sh` starts on
/// loopback with `scripts/mongod.sh`. It is a replica set so that transactions work.
#[derive(Clone, Debug)]
pub struct MongoNode {
    url: String,
    dir: PathBuf,
}

static COUNTER: AtomicU32 = AtomicU32::new(0);

/// MongoDB rejects database names of 64 bytes or more.
const MAX_DATABASE_NAME: usize = 63;

impl MongoNode {
    /// The node named by `LILY_MONGO_URL` and `LILY_MONGOD_DIR`.
    ///
    /// # Panics
    /// When they are not set: run the tests through `scripts/test.sh`.
    pub fn from_env() -> Self {
        let (Ok(url), Ok(dir)) = (
            std::env::var("LILY_MONGO_URL"),
            std::env::var("LILY_MONGOD_DIR"),
        ) else {
            panic!(
                "no MongoDB node for tests: LILY_MONGO_URL and LILY_MONGOD_DIR are unset. \
                 Run the suite with scripts/test.sh, which starts a private replica set on \
                 loopback (or start one with scripts/mongod.sh start DIR PORT and export \
                 LILY_MONGO_URL=mongodb://127.0.0.1:PORT/?replicaSet=lily&directConnection=true \
                 and LILY_MONGOD_DIR=DIR)"
            );
        };
        Self {
            url,
            dir: dir.into(),
        }
    }

    /// Connection string of the replica set, e.g.
    /// `mongodb://127.0.0.1:27517/?replicaSet=lily&directConnection=true`.
    pub fn url(&self) -> &str {
        &self.url
    }

    /// The node's address, for a [`TcpProxy`](crate::TcpProxy) in front of it.
    ///
    /// # Panics
    /// When the URL does not name one `host:port` that parses as a socket address.
    pub fn addr(&self) -> std::net::SocketAddr {
        let rest = self.url.split_once("://").map_or(&*self.url, |(_, r)| r);
        let rest = rest.rsplit_once('@').map_or(rest, |(_, r)| r);
        let host = rest.split(['/', '?', ',']).next().unwrap_or(rest);
        host.parse().expect("LILY_MONGO_URL names 127.0.0.1:PORT")
    }

    /// The node's URL through `proxy`, failing fast: a refused connection is seen within half
    /// a second instead of the driver's 30 s default.
    pub fn url_via(&self, proxy: &crate::TcpProxy) -> String {
        let url = proxy.url(&self.url);
        let join = if url.contains('?') { '&' } else { '?' };
        let direct = if url.contains("directConnection=") {
            ""
        } else {
            "&directConnection=true"
        };
        format!("{url}{join}serverSelectionTimeoutMS=500&connectTimeoutMS=500{direct}")
    }

    /// The node's data directory; its log is `mongod.log` there.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// A user of `database` with `role` on it only, made by the suite's administrator (the
    /// URL's user); returns the user's URL, authenticating against `database`.
    ///
    /// # Panics
    /// When the node refuses `createUser`.
    pub async fn add_user(&self, database: &str, role: &str, password: &str) -> String {
        use mongodb::bson::doc;
        let admin = mongodb::Client::with_uri_str(&self.url)
            .await
            .expect("the administrator's URL");
        let name = format!("{database}-user");
        admin
            .database(database)
            .run_command(doc! {
                "createUser": &name,
                "pwd": password,
                "roles": [{ "role": role, "db": database }],
            })
            .await
            .expect("createUser");
        let (_, rest) = self.url.split_once('@').expect("the URL has credentials");
        let rest = rest.replace("authSource=admin", &format!("authSource={database}"));
        format!("mongodb://{name}:{password}@{rest}")
    }

    /// A database name no other test uses: `prefix` (characters MongoDB forbids in database
    /// names replaced by `_`, shortened when needed) followed by the process id, a counter and
    /// the clock's nanoseconds.
    pub fn database_name(prefix: &str) -> String {
        let n = COUNTER.fetch_add(1, Ordering::Relaxed);
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.subsec_nanos());
        let suffix = format!("-{}-{n}-{nanos}", std::process::id());
        let mut name: String = prefix
            .chars()
            .map(|c| {
                if c.is_ascii_alphanumeric() || c == '_' || c == '-' {
                    c
                } else {
                    '_'
                }
            })
            .take(MAX_DATABASE_NAME - suffix.len())
            .collect();
        name.push_str(&suffix);
        name
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn database_names_are_unique_and_valid() {
        let a = MongoNode::database_name("orders");
        let b = MongoNode::database_name("orders");
        assert_ne!(a, b);
        assert!(a.starts_with("orders-"));
        let long = MongoNode::database_name(&"x.y/z $".repeat(20));
        assert!(long.len() <= MAX_DATABASE_NAME, "{long}");
        assert!(!long.contains(['.', '/', ' ', '$']), "{long}");
    }
}
