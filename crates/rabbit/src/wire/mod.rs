//! What the broker sends, made parseable before lapin reads it.
//!
//! lapin parses every short string as UTF-8 and every field table to any depth. One publisher
//! that puts bytes which are not UTF-8 in a property, a routing key or a header key, or nests
//! a header table thousands deep, would fail the frame, and lapin closes the connection on a
//! frame it cannot parse: the broker delivers the message again to the next connection, which
//! fails the same way, and the queue stops behind it.
//!
//! [`Sanitizer`] reads the incoming byte stream frame by frame and, before lapin sees a method
//! or content-header frame, rewrites it in place:
//!
//! - each byte of a short string that is not part of valid UTF-8 becomes `?`;
//! - a table or array nested deeper than [`MAX_NESTING`] becomes a byte array (`x`), whose
//!   layout (a 32-bit length, then bytes) is the same.
//!
//! Nothing changes length, so frame sizes and the framing itself stay exactly as the broker
//! sent them; input that needs no rewrite passes byte for byte. Body frames and heartbeats are
//! not looked into. A delivery rewritten this way is recorded in [`Rewrites`] by its channel and
//! delivery tag, with the first field rewritten, and the gate refuses it with that field named:
//! its text is only an approximation of what was sent.
//!
//! [`Sanitizing`] wraps the connection's stream (plain TCP or TLS) with a sanitizer, and
//! [`Wire`] is the reactor that lets lapin run on such streams: lapin's connector accepts a
//! stream only of its runtime's own type.

mod sanitizer;
mod stream;

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use crate::sync::lock;

pub use self::sanitizer::Sanitizer;
pub use self::stream::Sanitizing;
pub(crate) use self::stream::{Silence, Transport, Wire};

/// Tables and arrays nested deeper than this are cut (read as byte arrays): lapin parses
/// nesting by recursion, and a frame can hold thousands of levels.
pub const MAX_NESTING: usize = 64;

/// Deliveries whose metadata was rewritten at most remembered per connection; the gate takes
/// each as its delivery arrives, and a channel opened again forgets its own.
const MAX_REWRITES: usize = 65_536;

/// The deliveries of one connection whose metadata was rewritten, by channel and delivery tag,
/// with the first field rewritten.
#[derive(Clone, Debug, Default)]
pub struct Rewrites(Arc<RewritesInner>);

#[derive(Debug, Default)]
struct RewritesInner {
    /// Whether `map` may hold anything: the gate asks for every delivery, and nearly always
    /// finds nothing without taking the lock.
    any: AtomicBool,
    map: Mutex<HashMap<(u16, u64), &'static str>>,
}

impl Rewrites {
    /// The first field rewritten in delivery `tag` on `channel`, forgotten once read.
    pub fn take(&self, channel: u16, tag: u64) -> Option<&'static str> {
        if !self.0.any.load(Ordering::Acquire) {
            return None;
        }
        let mut map = lock(&self.0.map);
        let field = map.remove(&(channel, tag));
        if map.is_empty() {
            self.0.any.store(false, Ordering::Release);
        }
        field
    }

    fn record(&self, channel: u16, tag: u64, field: &'static str) {
        let mut map = lock(&self.0.map);
        if map.len() >= MAX_REWRITES {
            tracing::warn!(
                channel,
                "too many rewritten deliveries are waiting for the gate; this one is not recorded"
            );
            return;
        }
        map.entry((channel, tag)).or_insert(field);
        self.0.any.store(true, Ordering::Release);
    }

    /// A channel opened (again): its delivery tags start over.
    fn forget_channel(&self, channel: u16) {
        if !self.0.any.load(Ordering::Acquire) {
            return;
        }
        let mut map = lock(&self.0.map);
        map.retain(|(c, _), _| *c != channel);
        if map.is_empty() {
            self.0.any.store(false, Ordering::Release);
        }
    }

    /// A new stream: channels and delivery tags start over.
    pub(crate) fn clear(&self) {
        lock(&self.0.map).clear();
        self.0.any.store(false, Ordering::Release);
    }
}
