//! `lily dlq` and `lily parking`: list, show, replay and purge a work queue's lane.

mod replay;

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::io::IsTerminal;

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use lily_mq_core::{HeaderKey, Terminal, headers};
use lily_mq_rabbit::{QueueKind, Topology};
use serde_json::json;

use crate::broker::{Broker, Pass};
use crate::outcome::{Failure, Outcome};
use crate::render::{Table, text};
use crate::select::{Seen, now_millis};
use lily_mq_cli::message::{age, clean, value_text};

pub(crate) use self::replay::{ReplayOptions, purge, replay};

/// The broker and the work queue whose lane a command reads.
#[derive(clap::Args, Clone)]
pub(crate) struct Target {
    /// The work queue (not the lane): `orders` for `orders.dlq` and `orders.parking`.
    #[arg(short, long, env = "LILY_QUEUE")]
    pub(crate) queue: String,
    /// The broker, as an AMQP URL (amqps:// for TLS). Never printed.
    #[arg(
        long,
        env = "LILY_AMQP_URL",
        hide_env_values = true,
        default_value = "amqp://127.0.0.1:5672/%2f"
    )]
    pub(crate) url: String,
    /// PEM certificates to trust for amqps:// besides the system roots.
    #[arg(long, env = "LILY_TLS_CA", value_name = "FILE")]
    pub(crate) tls_ca: Option<std::path::PathBuf>,
    /// Print JSON instead of text.
    #[arg(long)]
    pub(crate) json: bool,
    /// The key the consumers seal Lily's headers with (`ConsumerConfig::header_key`), read
    /// from this file (trailing newline ignored); the environment's `LILY_HEADER_KEY` gives it
    /// directly. Without either, the public key. Never printed.
    #[arg(long, env = "LILY_HEADER_KEY_FILE", value_name = "FILE")]
    pub(crate) header_key_file: Option<std::path::PathBuf>,
}

impl Target {
    /// The key Lily's headers are sealed with.
    fn header_key(&self) -> Result<HeaderKey, Failure> {
        let secret = match &self.header_key_file {
            Some(path) => Some(std::fs::read(path).map_err(|e| {
                Failure::usage(format!(
                    "cannot read --header-key-file {}: {e}",
                    path.display()
                ))
            })?),
            None => std::env::var_os("LILY_HEADER_KEY").map(|k| k.into_encoded_bytes()),
        };
        let Some(mut secret) = secret else {
            return Ok(HeaderKey::public());
        };
        while secret.last().is_some_and(|b| *b == b'\n' || *b == b'\r') {
            secret.pop();
        }
        let key = HeaderKey::new(secret);
        if key.is_long_enough() {
            Ok(key)
        } else {
            Err(Failure::usage(format!(
                "the header key must be at least {} bytes",
                HeaderKey::MIN_LEN
            )))
        }
    }

    /// Where the broker is, for [`Pass::open`].
    fn broker(&self) -> Broker<'_> {
        Broker {
            url: &self.url,
            tls_ca: self.tls_ca.as_deref(),
            queue: &self.queue,
        }
    }
}

/// The lane's queue and the topology it belongs to.
fn names(lane: Terminal, target: &Target) -> (Topology, String) {
    let topology = Topology::new(&target.queue, QueueKind::Classic, &[]);
    let queue = match lane {
        Terminal::DeadLetter => topology.dead_letter_queue(),
        Terminal::Parking => topology.parking_queue(),
    };
    (topology, queue)
}

/// Messages sharing a reason, failure kind and type.
#[derive(Default)]
struct Group {
    count: u64,
    oldest_ms: Option<i64>,
    newest_ms: Option<i64>,
}

/// `list`: one pass, every message put back.
pub(crate) async fn list(lane: Terminal, target: &Target) -> Result<Outcome, Failure> {
    let (_, queue) = names(lane, target);
    let mut pass = Pass::open(&target.broker(), &queue).await?;
    let progress = progress(target, u64::from(pass.size), "reading");
    let mut groups: BTreeMap<(String, String, String), Group> = BTreeMap::new();
    let mut total = 0u64;
    while let Some(message) = pass.next().await? {
        pass.hold(message.delivery.delivery_tag);
        progress.inc(1);
        let seen = Seen::of(&message.delivery.properties);
        let key = (
            seen.reason,
            seen.kind,
            seen.message_type.unwrap_or_else(|| "-".into()),
        );
        let group = groups.entry(key).or_default();
        group.count += 1;
        if let Some(at) = seen.failed_at_ms {
            group.oldest_ms = Some(group.oldest_ms.map_or(at, |o| o.min(at)));
            group.newest_ms = Some(group.newest_ms.map_or(at, |n| n.max(at)));
        }
        total += 1;
    }
    pass.close().await?;
    progress.finish_and_clear();
    let mut groups: Vec<_> = groups.into_iter().collect();
    groups.sort_by(|a, b| b.1.count.cmp(&a.1.count).then_with(|| a.0.cmp(&b.0)));
    if target.json {
        let groups: Vec<_> = groups
            .iter()
            .map(|((reason, kind, message_type), g)| {
                json!({"reason": reason, "kind": kind, "type": message_type,
                       "count": g.count, "oldest_ms": g.oldest_ms, "newest_ms": g.newest_ms})
            })
            .collect();
        return Ok(json_out(
            &json!({"queue": queue, "messages": total, "groups": groups}),
            0,
        ));
    }
    let mut out = format!(
        "{queue}: {total} message{} in {} group{}\n",
        plural(total),
        groups.len(),
        plural(groups.len() as u64)
    );
    if !groups.is_empty() {
        let now = now_millis();
        let mut table = Table::new(
            &["count", "kind", "type", "oldest", "newest", "reason"],
            "rlllll",
        );
        for ((reason, kind, message_type), g) in &groups {
            table.row(vec![
                g.count.to_string(),
                text(kind),
                text(message_type),
                age(now, g.oldest_ms),
                age(now, g.newest_ms),
                text(reason),
            ]);
        }
        out.push('\n');
        table.render(&mut out, "");
    }
    Ok(Outcome::text(out, 0))
}

/// `show`: the first message with this id; every message put back.
pub(crate) async fn show(
    lane: Terminal,
    target: &Target,
    id: &str,
    body: bool,
) -> Result<Outcome, Failure> {
    let (_, queue) = names(lane, target);
    let mut pass = Pass::open(&target.broker(), &queue).await?;
    let mut found = None;
    let mut copies = 0u32;
    while let Some(message) = pass.next().await? {
        pass.hold(message.delivery.delivery_tag);
        let props = &message.delivery.properties;
        if props.message_id().as_ref().map(|s| s.as_str()) == Some(id) {
            copies += 1;
            if found.is_none() {
                found = Some(message);
            }
        }
    }
    pass.close().await?;
    let Some(message) = found else {
        return Err(Failure::broker(format!(
            "no message with id {:?} in {queue}",
            id.escape_debug().to_string()
        )));
    };
    let props = &message.delivery.properties;
    let mut fields: Vec<(&str, String)> = Vec::new();
    let mut field = |name, value: Option<String>| {
        if let Some(value) = value {
            fields.push((name, value));
        }
    };
    let short = |v: &Option<lapin::types::ShortString>| v.as_ref().map(|s| clean(s.as_str()));
    field("message_id", short(props.message_id()));
    field("type", short(props.kind()));
    field("content_type", short(props.content_type()));
    field("content_encoding", short(props.content_encoding()));
    field("correlation_id", short(props.correlation_id()));
    field("app_id", short(props.app_id()));
    field("timestamp", props.timestamp().map(|t| t.to_string()));
    field(
        "delivery_mode",
        props.delivery_mode().map(|m| m.to_string()),
    );
    field("priority", props.priority().map(|p| p.to_string()));
    field("body_bytes", Some(message.delivery.data.len().to_string()));
    let table = props.headers().as_ref().map(|t| t.inner().clone());
    let mut lily = Vec::new();
    let mut others = Vec::new();
    for (key, value) in table.iter().flatten() {
        let key = key.as_str();
        if key.starts_with("x-lily-")
            || key.starts_with("x-first-death-")
            || key == "x-death"
            || key == headers::SCHEMA_VERSION
        {
            lily.push((clean(key), value_text(key, value)));
        } else {
            others.push(clean(key));
        }
    }
    let body_text = body.then(|| {
        String::from_utf8_lossy(&message.delivery.data)
            .escape_debug()
            .to_string()
    });
    if target.json {
        let fields: serde_json::Map<_, _> = fields
            .iter()
            .map(|(k, v)| ((*k).to_owned(), json!(v)))
            .collect();
        let lily: serde_json::Map<_, _> = lily.iter().map(|(k, v)| (k.clone(), json!(v))).collect();
        return Ok(json_out(
            &json!({"queue": queue, "copies": copies, "properties": fields,
                    "lily_headers": lily, "other_headers": others, "body": body_text}),
            0,
        ));
    }
    let mut out = format!("{queue}: message {}", text(id));
    if copies > 1 {
        let _ = write!(out, " ({copies} copies; the first shown)");
    }
    out.push_str("\n\nproperties\n");
    let mut t = Table::new(&["", ""], "ll");
    for (k, v) in &fields {
        t.row(vec![(*k).to_owned(), v.clone()]);
    }
    t.render_body(&mut out, "  ");
    out.push_str("\nLily's and the broker's headers\n");
    let mut t = Table::new(&["", ""], "ll");
    for (k, v) in &lily {
        t.row(vec![k.clone(), v.clone()]);
    }
    t.render_body(&mut out, "  ");
    if !others.is_empty() {
        let _ = writeln!(
            out,
            "\nother headers (values not shown): {}",
            others.join(", ")
        );
    }
    match body_text {
        Some(body) => {
            let _ = writeln!(out, "\nbody\n  {body}");
        }
        None => out.push_str("\nbody not shown (--body shows it)\n"),
    }
    Ok(Outcome::text(out, 0))
}

/// A progress bar on stderr, only when it is a terminal and the output is text.
fn progress(target: &Target, len: u64, what: &'static str) -> ProgressBar {
    if target.json || !std::io::stderr().is_terminal() {
        return ProgressBar::hidden();
    }
    let bar = ProgressBar::with_draw_target(Some(len), ProgressDrawTarget::stderr());
    if let Ok(style) = ProgressStyle::with_template("{msg} {bar:40} {pos}/{len} ({eta})") {
        bar.set_style(style);
    }
    bar.set_message(what);
    bar
}

fn json_out(value: &serde_json::Value, code: u8) -> Outcome {
    let mut text = serde_json::to_string_pretty(value).unwrap_or_default();
    text.push('\n');
    Outcome::text(text, code)
}

fn plural(n: u64) -> &'static str {
    if n == 1 { "" } else { "s" }
}
