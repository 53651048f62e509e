//! `replay` and `purge`: the commands that change a lane.

use std::fmt::Write as _;
use std::io::{BufRead, IsTerminal};
use std::num::NonZeroU64;

use lily_mq_core::Terminal;
use lily_mq_rabbit::replay::{Replay, replay_properties};
use serde_json::json;

use super::{Target, json_out, names, plural, progress};
use crate::broker::{Pass, Published};
use crate::outcome::{EXIT_LEFT, Failure, Outcome};
use crate::render::text;
use crate::select::{Seen, Selection, now_millis};

/// How a replay runs.
pub(crate) struct ReplayOptions {
    pub(crate) dry_run: bool,
    pub(crate) batch: Option<NonZeroU64>,
    pub(crate) keep_user_id_aside: bool,
}

/// `replay`: each selected message published to the work queue's replay exchange with a
/// confirm, and only then ACKed here; one at a time, so a crash leaves at most one message in
/// both places.
pub(crate) async fn replay(
    lane: Terminal,
    target: &Target,
    selection: &Selection,
    options: &ReplayOptions,
) -> Result<Outcome, Failure> {
    let (topology, queue) = names(lane, target);
    let user = replaying_user(&target.url);
    let key = target.header_key()?;
    let mut pass = Pass::open(&target.broker(), &queue).await?;
    let exchange = if options.dry_run {
        topology.replay_exchange()
    } else {
        topology.declare_replay(pass.channel()).await.map_err(|e| {
            Failure::broker(format!(
                "cannot declare the replay exchange {:?} bound to {:?}: {e}",
                topology.replay_exchange(),
                target.queue
            ))
        })?
    };
    let progress = progress(target, u64::from(pass.size), "replaying");
    let limit = options.batch.map_or(u64::MAX, NonZeroU64::get);
    let (mut replayed, mut selected) = (Vec::new(), 0u64);
    let mut left: Vec<(String, String)> = Vec::new();
    let mut stopped = None;
    while let Some(message) = pass.next().await? {
        progress.inc(1);
        let seen = Seen::of(&message.delivery.properties);
        if !selection.takes(&seen) {
            pass.hold(message.delivery.delivery_tag);
            continue;
        }
        selected += 1;
        let id = seen.message_id.clone().unwrap_or_else(|| "-".into());
        let replay = Replay {
            from: lane,
            at_millis: now_millis(),
            user: &user,
            keep_user_id_aside: options.keep_user_id_aside,
            key: &key,
        };
        let properties = match replay_properties(&message.delivery.properties, &replay) {
            Ok(properties) => properties,
            Err(refusal) => {
                pass.hold(message.delivery.delivery_tag);
                left.push((id, refusal.to_string()));
                continue;
            }
        };
        if options.dry_run {
            pass.hold(message.delivery.delivery_tag);
            replayed.push(id);
        } else {
            let published = pass
                .publish(&exchange, &target.queue, &message.delivery.data, properties)
                .await;
            match published {
                Ok(Published::Confirmed) => {
                    pass.ack(message.delivery.delivery_tag).await?;
                    audit("replayed", &queue, &id, Some(&target.queue));
                    replayed.push(id);
                }
                other => {
                    pass.hold(message.delivery.delivery_tag);
                    let why = match other {
                        Ok(Published::Returned) => format!(
                            "the replay exchange did not route it to {:?} (binding missing?)",
                            target.queue
                        ),
                        Ok(_) => "the broker nacked the publish".to_owned(),
                        Err(failure) => failure.message,
                    };
                    left.push((id, why.clone()));
                    stopped = Some(why);
                    break;
                }
            }
        }
        if replayed.len() as u64 >= limit {
            break;
        }
    }
    // The close puts back what was held and proves every ACK arrived. After a broker error
    // the channel is gone: the broker put back what it held, and processed every ACK sent
    // before the error.
    match pass.close().await {
        Err(failure) if stopped.is_none() => return Err(failure),
        _ => {}
    }
    progress.finish_and_clear();
    let code = if left.is_empty() { 0 } else { EXIT_LEFT };
    if target.json {
        let left: Vec<_> = left
            .iter()
            .map(|(id, why)| json!({"message_id": id, "why": why}))
            .collect();
        return Ok(json_out(
            &json!({"queue": queue, "to": target.queue, "dry_run": options.dry_run,
                    "selected": selected, "replayed": replayed, "left": left,
                    "stopped": stopped}),
            code,
        ));
    }
    let verb = if options.dry_run {
        "would replay"
    } else {
        "replayed"
    };
    let mut out = format!(
        "{verb} {} message{} from {queue} to {}",
        replayed.len(),
        plural(replayed.len() as u64),
        target.queue
    );
    if (replayed.len() as u64) < selected {
        let _ = write!(out, " ({selected} selected so far)");
    }
    out.push('\n');
    if options.dry_run {
        for id in &replayed {
            let _ = writeln!(out, "  {}", text(id));
        }
    }
    if !left.is_empty() {
        let _ = writeln!(out, "left in {queue}: {}", left.len());
        for (id, why) in &left {
            let _ = writeln!(out, "  {}: {why}", text(id));
        }
    }
    if let Some(why) = stopped {
        let _ = writeln!(out, "stopped: {why}");
    }
    Ok(Outcome::text(out, code))
}

/// `purge`: a count, a confirmation, then the selected messages ACKed away, each named in an
/// audit line; with `dry_run`, only the count and the ids.
pub(crate) async fn purge(
    lane: Terminal,
    target: &Target,
    selection: &Selection,
    yes: bool,
    dry_run: bool,
) -> Result<Outcome, Failure> {
    let (_, queue) = names(lane, target);
    let mut pass = Pass::open(&target.broker(), &queue).await?;
    // Delivery tags and ids only: a large selection holds no bodies.
    let mut taken = Vec::new();
    while let Some(message) = pass.next().await? {
        let tag = message.delivery.delivery_tag;
        let seen = Seen::of(&message.delivery.properties);
        // Held until the purge: none is removed before the confirmation.
        pass.hold(tag);
        if selection.takes(&seen) {
            taken.push((tag, seen.message_id.unwrap_or_else(|| "-".into())));
        }
    }
    let count = taken.len() as u64;
    if dry_run {
        pass.close().await?;
        let mut out = format!(
            "would purge {count} message{} from {queue}\n",
            plural(count)
        );
        for (_, id) in &taken {
            let _ = writeln!(out, "  {}", text(id));
        }
        if target.json {
            let ids: Vec<_> = taken.iter().map(|(_, id)| id).collect();
            return Ok(json_out(
                &json!({"queue": queue, "dry_run": true, "would_purge": ids}),
                0,
            ));
        }
        return Ok(Outcome::text(out, 0));
    }
    let question = format!(
        "purge {count} message{} from {queue}? type yes to confirm: ",
        plural(count)
    );
    if count > 0
        && !yes
        && let Err(failure) = confirm(&question)
    {
        pass.close().await?;
        return Err(failure);
    }
    for (tag, id) in &taken {
        pass.ack(*tag).await?;
        audit("purged", &queue, id, None);
    }
    pass.close().await?;
    if target.json {
        return Ok(json_out(&json!({"queue": queue, "purged": count}), 0));
    }
    Ok(Outcome::text(
        format!("purged {count} message{} from {queue}\n", plural(count)),
        0,
    ))
}

/// One line on stderr for each message a command moved or deleted: when, what, which lane,
/// which message id (never a body or a header value).
fn audit(action: &str, lane: &str, id: &str, to: Option<&str>) {
    let at = std::time::SystemTime::now();
    let to = to.map(|q| format!(" to={}", text(q))).unwrap_or_default();
    eprintln!(
        "lily audit: at={} action={action} lane={} message_id={}{to}",
        humantime::format_rfc3339_millis(at),
        text(lane),
        text(id),
    );
}

/// Asks on the terminal; anything but `yes` aborts. Without a terminal, refuses.
fn confirm(question: &str) -> Result<(), Failure> {
    let stdin = std::io::stdin();
    if !stdin.is_terminal() {
        return Err(Failure::usage(
            "refusing to purge without confirmation: stdin is not a terminal; pass --yes".into(),
        ));
    }
    eprint!("{question}");
    let mut answer = String::new();
    let _ = stdin.lock().read_line(&mut answer);
    if answer.trim() == "yes" {
        Ok(())
    } else {
        Err(Failure::broker("not confirmed: nothing purged".into()))
    }
}

/// The user a replay publishes as: the URL's, or RabbitMQ's default `guest`.
fn replaying_user(url: &str) -> String {
    url.parse::<lapin::uri::AMQPUri>()
        .map(|uri| uri.authority.userinfo.username)
        .unwrap_or_else(|_| "guest".into())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_replaying_user_comes_from_the_url() {
        assert_eq!(replaying_user("amqp://ops:secret@host/%2f"), "ops");
        assert_eq!(replaying_user("amqp://127.0.0.1:5672/%2f"), "guest");
    }
}
