//! Leases with fencing: one live owner per message, a fence that grows with every takeover.
//!
//! The lease document (owner, fence, expiry) is renewed outside any transaction while the
//! handler runs. The fence is published in a document of its own that only acquisitions write,
//! naming the acquisition's owner: the commit checks it inside the transaction, so the owner's
//! own renewals never conflict with its commit, while a takeover — which rewrites the fence
//! document — always does.
//!
//! Nothing outlives its message. The commit deletes the fence document inside the transaction
//! (the delete is the check), and the release after it deletes the lease; a delivery that ends
//! without a commit deletes both, the fence document first. What a crash leaves expires: a
//! fence document with the inbox retention, a lease after twice that. So a lease, whose
//! document carries the fence count, never goes before a fence document it counted for (a lease
//! created again would count from one, below that document's fence, and never pass its check).
//! A count started again is safe: every check names the owner token too, unique to one
//! acquisition, so a stale owner's check never matches another's document, whatever its fence
//! number.
//!
//! A lease this process let go of without its release confirmed (the database did not answer,
//! as through an election, or the delivery was dropped) is [`Abandoned`]: the process's own
//! next handling of that message takes it over at once rather than waiting out its TTL. The
//! takeover raises the fence like any other: a commit of the abandoned acquisition not yet at
//! its check fails it, and one past it holds the fence document, so the raise waits for that
//! transaction to end and the new handling then finds its inbox record. Only another process,
//! which cannot know the owner is gone, waits the TTL out.

use std::collections::HashMap;
use std::hash::{BuildHasher, Hasher, RandomState};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use mongodb::bson::{Bson, DateTime, Document, doc};
use mongodb::error::{Error, ErrorKind, WriteFailure};
use mongodb::options::ReturnDocument;
use mongodb::{ClientSession, Collection};
use tokio_util::sync::CancellationToken;

/// A lease this worker holds.
#[derive(Debug)]
pub(crate) struct Lease {
    pub(crate) key: Document,
    pub(crate) owner: String,
    pub(crate) fence: i64,
    /// How long an acquisition lives unrenewed: what a newer owner's lease may live too.
    pub(crate) ttl: Duration,
    renewal: CancellationToken,
    leases: Collection<Document>,
    fences: Collection<Document>,
    /// Where this acquisition is remembered if it ends without its release confirmed.
    abandoned: Arc<Abandoned>,
    /// Set once the release's delete was answered.
    released: bool,
}

/// The owner tokens of the leases this process abandoned, by message key: the acquisitions
/// that ended without a confirmed release, and those whose write was sent and not answered (it
/// may have taken the lease all the same). See the module's documentation.
#[derive(Debug, Default)]
pub(crate) struct Abandoned(std::sync::Mutex<HashMap<String, Vec<String>>>);

/// The most messages with abandoned leases remembered, and the most tokens per message; past
/// either, the oldest are forgotten, and a forgotten lease is waited out as any other owner's.
const MAX_ABANDONED: usize = 65_536;
const MAX_TOKENS: usize = 8;

impl Abandoned {
    fn owners(&self, key: &Document) -> Option<Vec<String>> {
        crate::lock(&self.0).get(&key.to_string()).cloned()
    }

    fn remember(&self, key: &Document, owner: &str) {
        let mut owners = crate::lock(&self.0);
        if owners.len() >= MAX_ABANDONED {
            owners.clear();
        }
        let tokens = owners.entry(key.to_string()).or_default();
        if tokens.len() >= MAX_TOKENS {
            tokens.remove(0);
        }
        tokens.push(owner.to_owned());
    }

    /// The lease is this process's again: none of the tokens before can own it any more.
    fn forget(&self, key: &Document) {
        crate::lock(&self.0).remove(&key.to_string());
    }
}

/// Why a lease was not acquired.
pub(crate) enum Refused {
    /// Another owner holds it, until its expiry at the latest unless renewed.
    Held {
        /// How long until it expires (zero when it just did, or could not be read).
        expires_in: Duration,
    },
    /// The database failed.
    Failed(Error),
}

static TOKENS: AtomicU64 = AtomicU64::new(0);

/// A token unique to this attempt of this process. A remembered token lets its process take
/// the lease over, so two processes must never make the same one: processes in containers
/// often share a pid, so a random part drawn once per process comes first.
pub(crate) fn owner_token() -> String {
    static PROCESS: OnceLock<u64> = OnceLock::new();
    let process = PROCESS.get_or_init(|| RandomState::new().build_hasher().finish());
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    format!(
        "{process:016x}-{}-{nanos:x}-{}",
        std::process::id(),
        TOKENS.fetch_add(1, Ordering::Relaxed)
    )
}

fn expires(ttl: Duration) -> DateTime {
    let ms = i64::try_from(ttl.as_millis()).unwrap_or(i64::MAX);
    DateTime::from_millis(DateTime::now().timestamp_millis().saturating_add(ms))
}

/// Acquires the lease on `key` atomically: it is free, expired, or one this process abandoned.
/// The fence grows by one with every acquisition.
pub(crate) async fn acquire(
    leases: &Collection<Document>,
    fences: &Collection<Document>,
    abandoned: &Arc<Abandoned>,
    key: Document,
    ttl: Duration,
    max_extension: Duration,
) -> Result<Lease, Refused> {
    let owner = owner_token();
    // From the write on, this acquisition is remembered if it ends without a lease: its write
    // may have taken the lease even when no answer came, or the caller gave up waiting.
    let mut pending = Pending {
        abandoned: Arc::clone(abandoned),
        key: key.clone(),
        owner: owner.clone(),
        armed: true,
    };
    let now = DateTime::now();
    let expired = doc! { "expires_at": { "$lt": now } };
    let filter = match abandoned.owners(&key) {
        Some(ours) => doc! { "_id": key.clone(), "$or": [expired, { "owner": { "$in": ours } }] },
        None => doc! { "_id": key.clone(), "expires_at": { "$lt": now } },
    };
    let update = doc! {
        "$set": { "owner": &owner, "expires_at": expires(ttl), "acquired_at": now },
        "$inc": { "fence": 1_i64 },
    };
    let taken = leases
        .find_one_and_update(filter, update)
        .upsert(true)
        .return_document(ReturnDocument::After)
        .await;
    let doc = match taken {
        Ok(Some(doc)) => doc,
        // The upsert collided with a live owner's document.
        Ok(None) => {
            pending.armed = false;
            return Err(held(leases, key).await);
        }
        Err(err) if is_duplicate_key(&err) => {
            pending.armed = false;
            return Err(held(leases, key).await);
        }
        Err(err) => {
            // Sent and unanswered, it may have taken the lease: if so, this process's next try
            // may too (`pending` remembers it). One that found no server to send to took
            // nothing.
            if matches!(err.kind.as_ref(), ErrorKind::ServerSelection { .. }) {
                pending.armed = false;
            }
            return Err(Refused::Failed(err));
        }
    };
    let fence = match doc.get("fence") {
        Some(Bson::Int64(f)) => *f,
        Some(Bson::Int32(f)) => i64::from(*f),
        _ => 0,
    };
    // Publish the fence, and whose it is, where only acquisitions write. A newer owner's raise
    // that got there first is kept: the document only moves to a higher fence.
    let stored = doc! { "$ifNull": ["$fence", 0_i64] };
    let newer = doc! { "$lt": [stored.clone(), fence] };
    let raise = vec![doc! { "$set": {
        "owner": { "$cond": [newer.clone(), &owner, "$owner"] },
        "at": { "$cond": [newer, now, "$at"] },
        "fence": { "$max": [stored, fence] },
    } }];
    let raised = fences
        .update_one(doc! { "_id": key.clone() }, raise)
        .upsert(true)
        .await;
    // Taken: the leases this process abandoned are done with (the raise fences them off).
    abandoned.forget(&key);
    if let Err(err) = raised {
        // Taken but not fenced: given up, it is abandoned too (`pending` remembers it).
        return Err(Refused::Failed(err));
    }
    // Held from here by the `Lease`, which remembers it if it is not released.
    pending.armed = false;
    let renewal = spawn_renewal(
        leases.clone(),
        key.clone(),
        owner.clone(),
        fence,
        ttl,
        max_extension,
    );
    Ok(Lease {
        key,
        owner,
        fence,
        ttl,
        renewal,
        leases: leases.clone(),
        fences: fences.clone(),
        abandoned: Arc::clone(abandoned),
        released: false,
    })
}

/// An acquisition under way: remembered as [`Abandoned`] when dropped armed, which is also how
/// an acquisition cancelled by its caller (a budget run out while the database did not answer)
/// is remembered.
struct Pending {
    abandoned: Arc<Abandoned>,
    key: Document,
    owner: String,
    armed: bool,
}

impl Drop for Pending {
    fn drop(&mut self) {
        if self.armed {
            self.abandoned.remember(&self.key, &self.owner);
        }
    }
}

/// The refusal of a lease another owner holds, with how long until its recorded expiry.
async fn held(leases: &Collection<Document>, key: Document) -> Refused {
    let expires_at = leases
        .find_one(doc! { "_id": key })
        .await
        .ok()
        .flatten()
        .and_then(|doc| doc.get_datetime("expires_at").ok().copied());
    let expires_in = expires_at.map_or(Duration::ZERO, |at| {
        let ms = at.timestamp_millis() - DateTime::now().timestamp_millis();
        Duration::from_millis(u64::try_from(ms).unwrap_or(0))
    });
    Refused::Held { expires_in }
}

/// Renews the lease every third of its TTL while work progresses, up to `max_extension` in all.
fn spawn_renewal(
    leases: Collection<Document>,
    key: Document,
    owner: String,
    fence: i64,
    ttl: Duration,
    max_extension: Duration,
) -> CancellationToken {
    let stop = CancellationToken::new();
    let stopped = stop.clone();
    tokio::spawn(async move {
        let started = tokio::time::Instant::now();
        let every = (ttl / 3).max(Duration::from_millis(50));
        loop {
            tokio::select! {
                () = stopped.cancelled() => return,
                () = tokio::time::sleep(every) => {}
            }
            if started.elapsed() >= max_extension {
                return; // the cap on total extension: let it expire
            }
            let filter = doc! { "_id": key.clone(), "owner": &owner, "fence": fence };
            let renewed = leases
                .update_one(filter, doc! { "$set": { "expires_at": expires(ttl) } })
                .await;
            if !matches!(renewed, Ok(r) if r.matched_count == 1) {
                return; // taken over or unreachable: the fence check at commit decides
            }
        }
    });
    stop
}

impl Lease {
    /// Inside the transaction: proves no newer owner raised the fence, by deleting this
    /// acquisition's fence document, so the commit removes it. `Ok(false)` means this lease was
    /// taken over — either before (the document names a newer owner) or during the transaction
    /// (the takeover's write conflicts with this one).
    pub(crate) async fn check_fence(&self, session: &mut ClientSession) -> Result<bool, Error> {
        let checked = self.fences.delete_one(self.ours()).session(session).await;
        match checked {
            Ok(result) => Ok(result.deleted_count == 1),
            Err(err) if is_write_conflict(&err) => Ok(false),
            Err(err) => Err(err),
        }
    }

    /// Stops renewing and deletes the lease, where it is still this acquisition's. Without a
    /// commit, which took the fence document, that document goes first, and the lease only once
    /// its delete was answered: the lease carries the fence count, so were it to go alone (the
    /// process killed between two concurrent deletes, or the fence's delete failing), the next
    /// acquisition would count from one again, below the fence document left behind, and fail
    /// every check until that document expired. A lease whose release is not answered (or is
    /// dropped) is remembered as [`Abandoned`] and keeps its count.
    pub(crate) async fn release(mut self, committed: bool) {
        self.renewal.cancel();
        if !committed && self.fences.delete_one(self.ours()).await.is_err() {
            return;
        }
        self.released = self.leases.delete_one(self.ours()).await.is_ok();
    }

    /// The filter matching this acquisition's documents only.
    fn ours(&self) -> Document {
        doc! { "_id": self.key.clone(), "owner": &self.owner, "fence": self.fence }
    }
}

impl Drop for Lease {
    /// A lease dropped without a confirmed [`Lease::release`] (the database did not answer,
    /// or its delivery was dropped: a timeout, a shutdown's abort) stops renewing, so it
    /// expires after its TTL instead of being extended by a task nobody owns, and is
    /// remembered as [`Abandoned`], so this process's next handling of the message need not
    /// wait for that.
    fn drop(&mut self) {
        self.renewal.cancel();
        if !self.released {
            self.abandoned.remember(&self.key, &self.owner);
        }
    }
}

/// True for a write conflict with another transaction or write (code 112).
fn is_write_conflict(err: &Error) -> bool {
    matches!(err.kind.as_ref(), ErrorKind::Command(e) if e.code == 112)
}

/// True for a duplicate key write error (E11000).
pub(crate) fn is_duplicate_key(err: &Error) -> bool {
    match err.kind.as_ref() {
        ErrorKind::Write(WriteFailure::WriteError(e)) => e.code == 11000,
        ErrorKind::Command(e) => e.code == 11000,
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn abandoned_leases_are_remembered_per_message_newest_kept() {
        let abandoned = Abandoned::default();
        let (a, b) = (doc! { "c": "x", "m": "a" }, doc! { "c": "x", "m": "b" });
        assert_eq!(abandoned.owners(&a), None);
        for n in 0..=MAX_TOKENS {
            abandoned.remember(&a, &format!("t{n}"));
        }
        abandoned.remember(&b, "u");
        let kept = abandoned.owners(&a).expect("remembered");
        assert_eq!(kept.len(), MAX_TOKENS);
        assert_eq!(
            kept.first().map(String::as_str),
            Some("t1"),
            "the oldest goes"
        );
        assert_eq!(kept.last().map(String::as_str), Some("t8"));
        abandoned.forget(&a);
        assert_eq!(abandoned.owners(&a), None);
        assert_eq!(abandoned.owners(&b), Some(vec!["u".to_owned()]));
    }
}
