//! The MongoDB side of every run: the URL from `LILY_MONGO_URL` (never printed with its
//! credentials), a client checked to be on a replica set, and a dropped and re-created
//! database, so no run inherits another's documents, indexes or write conflicts.

use mongodb::bson::{Document, doc};
use mongodb::{Client, Database};

use crate::mongo::{
    COUNTERS, Case, DATABASE, EFFECTS, HOT_KEYS, LILY_COLLECTIONS, RAW_INBOX, hot_key,
};

/// The replica set named by `LILY_MONGO_URL`.
///
/// # Errors
/// When it is unset, with a message that says how to start one.
pub fn mongo_url() -> Result<String, String> {
    std::env::var("LILY_MONGO_URL").map_err(|_| {
        "LILY_MONGO_URL is unset: start a single-node replica set \
         (scripts/mongod.sh install && scripts/mongod.sh start DIR PORT) and set \
         LILY_MONGO_URL=mongodb://127.0.0.1:PORT/?replicaSet=lily&directConnection=true"
            .to_owned()
    })
}

/// `scheme://hosts/path` without the user info, and the query with only the options that are
/// never secret (a password can hide in several options: `tlsCertificateKeyFilePassword`,
/// `authMechanismProperties`, …).
pub fn redact(url: &str) -> String {
    let (scheme, rest) = url.split_once("://").unwrap_or(("mongodb", url));
    // Everything up to the last `@` goes, so no user info survives whatever it holds.
    let rest = rest.rsplit_once('@').map_or(rest, |(_, host)| host);
    let (address, query) = rest.split_once('?').unwrap_or((rest, ""));
    let kept: Vec<&str> = query
        .split('&')
        .filter(|kv| {
            let key = kv.split('=').next().unwrap_or("").to_ascii_lowercase();
            [
                "replicaset",
                "directconnection",
                "tls",
                "ssl",
                "maxpoolsize",
            ]
            .contains(&key.as_str())
        })
        .collect();
    let dropped = query.split('&').filter(|kv| !kv.is_empty()).count() > kept.len();
    let mut out = format!("{scheme}://{address}");
    if !kept.is_empty() || dropped {
        out.push('?');
        out.push_str(&kept.join("&"));
        if dropped {
            out.push_str(if kept.is_empty() { "…" } else { "&…" });
        }
    }
    out
}

/// A client for `url`, its pool warmed by a `ping`, after checking that the node is a
/// replica-set member (transactions need one).
///
/// # Errors
/// The node cannot be reached or is not part of a replica set. The messages name neither the
/// URL nor the driver's error text (which may quote the URL).
pub async fn client(url: &str) -> Result<Client, String> {
    let client = Client::with_uri_str(url)
        .await
        .map_err(|e| format!("LILY_MONGO_URL is not a usable MongoDB URL ({})", kind(&e)))?;
    let hello = client
        .database("admin")
        .run_command(doc! { "hello": 1 })
        .await
        .map_err(|e| format!("MongoDB did not answer `hello` ({})", kind(&e)))?;
    if hello.get_str("setName").is_err() {
        return Err(
            "MongoDB is not a replica set member: transactions need one \
             (scripts/mongod.sh starts a single-node replica set)"
                .into(),
        );
    }
    Ok(client)
}

/// The server's version, from `buildInfo`.
pub async fn server_version(client: &Client) -> String {
    client
        .database("admin")
        .run_command(doc! { "buildInfo": 1 })
        .await
        .ok()
        .and_then(|info| info.get_str("version").ok().map(str::to_owned))
        .map_or_else(
            || "MongoDB (version unknown)".into(),
            |v| format!("MongoDB {v}"),
        )
}

/// Drops [`DATABASE`] and creates every collection any contender writes (so no contender pays
/// for implicit creation inside its transactions); the hot-keys case seeds its counters at 0.
///
/// # Panics
/// When the database refuses.
pub async fn fresh(client: &Client, case: Case) -> Database {
    let database = client.database(DATABASE);
    database.drop().await.expect("drop the benchmark database");
    for name in [EFFECTS, RAW_INBOX, COUNTERS]
        .into_iter()
        .chain(LILY_COLLECTIONS)
    {
        database
            .create_collection(name)
            .await
            .unwrap_or_else(|e| panic!("create collection {name}: {}", kind(&e)));
    }
    if case == Case::HotKeys {
        let counters: Vec<Document> = (0..HOT_KEYS)
            .map(|k| doc! { "_id": hot_key(k), "n": 0_i64 })
            .collect();
        database
            .collection::<Document>(COUNTERS)
            .insert_many(counters)
            .await
            .expect("seed the counters");
    }
    database
}

/// A short description of a driver error that never carries the URL or documents.
pub fn kind(err: &mongodb::error::Error) -> String {
    use mongodb::error::ErrorKind;
    match err.kind.as_ref() {
        ErrorKind::Command(e) => format!("server error {} ({})", e.code, e.code_name),
        ErrorKind::Write(_) => "write error".to_owned(),
        ErrorKind::ServerSelection { .. } => "no server available".to_owned(),
        ErrorKind::Io(_) => "network error".to_owned(),
        ErrorKind::InvalidArgument { .. } => "invalid argument".to_owned(),
        ErrorKind::Authentication { .. } => "authentication failed".to_owned(),
        _ => "database error".to_owned(),
    }
}

/// mongod's operation counters (`serverStatus.opcounters`); operations inside transactions
/// count like any other.
#[derive(Clone, Copy, Debug, Default, PartialEq, serde::Serialize)]
pub struct Ops {
    pub insert: f64,
    pub query: f64,
    pub update: f64,
    pub delete: f64,
    pub getmore: f64,
    /// Commands: commits, aborts, `findAndModify`, `hello`s, …
    pub command: f64,
}

impl Ops {
    /// The counters now, or `None` when `serverStatus` is refused.
    pub async fn read(client: &Client) -> Option<Self> {
        let status = client
            .database("admin")
            .run_command(doc! { "serverStatus": 1 })
            .await
            .ok()?;
        let counters = status.get_document("opcounters").ok()?;
        #[allow(clippy::cast_precision_loss)]
        let get = |name: &str| match counters.get(name) {
            Some(mongodb::bson::Bson::Int64(v)) => *v as f64,
            Some(mongodb::bson::Bson::Int32(v)) => f64::from(*v),
            Some(mongodb::bson::Bson::Double(v)) => *v,
            _ => 0.0,
        };
        Some(Self {
            insert: get("insert"),
            query: get("query"),
            update: get("update"),
            delete: get("delete"),
            getmore: get("getmore"),
            command: get("command"),
        })
    }

    /// `(after - self) / n`: operations per message over a run.
    pub fn per_message(&self, after: &Self, n: u64) -> Self {
        #[allow(clippy::cast_precision_loss)]
        let n = n.max(1) as f64;
        let per = |b: f64, a: f64| ((a - b) / n * 100.0).round() / 100.0;
        Self {
            insert: per(self.insert, after.insert),
            query: per(self.query, after.query),
            update: per(self.update, after.update),
            delete: per(self.delete, after.delete),
            getmore: per(self.getmore, after.getmore),
            command: per(self.command, after.command),
        }
    }

    pub fn total(&self) -> f64 {
        self.insert + self.query + self.update + self.delete + self.getmore + self.command
    }
}

/// mongod's pid, from `LILY_MONGO_DIR/mongod.pid` (the file `scripts/mongod.sh` keeps).
pub fn mongod_pid() -> Option<u32> {
    let dir = std::env::var_os("LILY_MONGO_DIR")?;
    let pid = std::fs::read_to_string(std::path::Path::new(&dir).join("mongod.pid")).ok()?;
    pid.trim().parse().ok()
}

#[cfg(test)]
mod tests {
    use super::redact;

    #[test]
    fn redact_drops_credentials_and_secret_options() {
        assert_eq!(
            redact("mongodb://u:secret@127.0.0.1:27700/?replicaSet=lily&directConnection=true"),
            "mongodb://127.0.0.1:27700/?replicaSet=lily&directConnection=true"
        );
        let r = redact("mongodb://h:1/?tlsCertificateKeyFilePassword=pw&replicaSet=rs");
        assert!(!r.contains("pw"), "{r}");
        assert_eq!(r, "mongodb://h:1/?replicaSet=rs&…");
        assert_eq!(redact("mongodb://h:1"), "mongodb://h:1");
    }
}
