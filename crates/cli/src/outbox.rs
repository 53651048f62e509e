//! `lily outbox`: what a service's transactional outbox holds, one message's records, and
//! failed messages staged again for the relay.

use std::fmt::Write as _;

use lily_mq_mongo::mongodb::Client;
use lily_mq_mongo::{OutboxRecord, OutboxStore};

use crate::outcome::{EXIT_INPUT, Outcome};

/// The database whose outbox a command reads.
#[derive(clap::Args, Clone)]
pub(crate) struct Store {
    /// The MongoDB URL (a replica set). Never printed.
    #[arg(long, env = "LILY_MONGO_URL", hide_env_values = true)]
    pub(crate) mongo_url: String,
    /// The database the service's scope works in.
    #[arg(short, long, env = "LILY_MONGO_DB")]
    pub(crate) database: String,
    /// The scope's collection prefix.
    #[arg(long, default_value = "lily_")]
    pub(crate) prefix: String,
    /// Print JSON instead of text.
    #[arg(long)]
    pub(crate) json: bool,
}

/// What to do.
pub(crate) enum Command {
    List,
    Show(String),
    Retry {
        ids: Vec<String>,
        all_failed: bool,
        dry_run: bool,
    },
}

/// Runs `command` against the outbox `store` names.
pub(crate) async fn run(store: &Store, command: Command) -> Outcome {
    match run_inner(store, command).await {
        Ok(outcome) => outcome,
        Err(err) => {
            // The driver's message names hosts at most, never the URL's password.
            eprintln!(
                "lily: outbox: {}",
                lily_mq_mongo::handler_error("read", err).reason()
            );
            Outcome::code(EXIT_INPUT)
        }
    }
}

async fn run_inner(
    store: &Store,
    command: Command,
) -> Result<Outcome, lily_mq_mongo::mongodb::error::Error> {
    let client = Client::with_uri_str(&store.mongo_url).await?;
    let outbox = OutboxStore::of(&client.database(&store.database), &store.prefix);
    let outcome = match command {
        Command::List => {
            let summary = outbox.summary().await?;
            if store.json {
                let value = serde_json::json!({
                    "staged": summary.staged,
                    "sent": summary.sent,
                    "failed": summary.failed,
                    "oldest_staged_seconds": summary.oldest_staged.map(|d| d.as_secs_f64()),
                    "failed_by_reason": summary.failed_by_reason.iter()
                        .map(|(reason, n)| serde_json::json!({ "reason": reason, "count": n }))
                        .collect::<Vec<_>>(),
                });
                Outcome::text(format!("{value}\n"), 0)
            } else {
                let mut out = String::new();
                let oldest = summary
                    .oldest_staged
                    .map(|d| format!(" (oldest {})", humantime::format_duration(whole_seconds(d))))
                    .unwrap_or_default();
                let _ = writeln!(
                    out,
                    "staged {}{oldest}, sent {}, failed {}",
                    summary.staged, summary.sent, summary.failed
                );
                for (reason, n) in &summary.failed_by_reason {
                    let _ = writeln!(out, "  {n:>6}  {reason}");
                }
                Outcome::text(out, 0)
            }
        }
        Command::Show(id) => {
            let records = outbox.records(&id).await?;
            if records.is_empty() {
                eprintln!("lily: outbox: no record of message id {id:?}");
                return Ok(Outcome::code(EXIT_INPUT));
            }
            let out = if store.json {
                let value: Vec<_> = records.iter().map(record_json).collect();
                format!("{}\n", serde_json::Value::Array(value))
            } else {
                records.iter().map(|r| record_text(&id, r)).collect()
            };
            Outcome::text(out, 0)
        }
        Command::Retry {
            ids,
            all_failed,
            dry_run,
        } => {
            let selected = (!all_failed).then_some(ids.as_slice());
            let failed = match selected {
                Some(ids) => {
                    let mut n = 0;
                    for id in ids {
                        n += outbox
                            .records(id)
                            .await?
                            .iter()
                            .filter(|r| r.state == "failed")
                            .count() as u64;
                    }
                    n
                }
                None => outbox.summary().await?.failed,
            };
            if dry_run {
                Outcome::text(format!("would stage again {failed} failed record(s)\n"), 0)
            } else {
                let staged = outbox.retry(selected).await?;
                Outcome::text(format!("staged again {staged} failed record(s)\n"), 0)
            }
        }
    };
    Ok(outcome)
}

fn whole_seconds(d: std::time::Duration) -> std::time::Duration {
    std::time::Duration::from_secs(d.as_secs())
}

fn time(at: Option<lily_mq_mongo::mongodb::bson::DateTime>) -> String {
    at.and_then(|at| at.try_to_rfc3339_string().ok())
        .unwrap_or_else(|| "-".to_owned())
}

fn record_text(id: &str, r: &OutboxRecord) -> String {
    let mut out = format!(
        "{id}: {}, exchange '{}', routing key '{}', type {}, body {} bytes, staged {}",
        r.state,
        r.exchange,
        r.routing_key,
        r.kind.as_deref().unwrap_or("-"),
        r.body_bytes
            .map_or_else(|| "-".to_owned(), |n| n.to_string()),
        time(r.staged_at),
    );
    if r.sent_at.is_some() {
        let _ = write!(out, ", sent {}", time(r.sent_at));
    }
    if let Some(reason) = &r.reason {
        let _ = write!(out, ", reason: {reason}");
    }
    if r.failures > 0 {
        let _ = write!(out, ", {} failed tries", r.failures);
    }
    out.push('\n');
    out
}

fn record_json(r: &OutboxRecord) -> serde_json::Value {
    serde_json::json!({
        "state": r.state,
        "exchange": r.exchange,
        "routing_key": r.routing_key,
        "type": r.kind,
        "body_bytes": r.body_bytes,
        "staged_at": time(r.staged_at),
        "sent_at": r.sent_at.map(|_| time(r.sent_at)),
        "reason": r.reason,
        "failures": r.failures,
    })
}
