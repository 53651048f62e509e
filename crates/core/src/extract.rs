//! Extractors: the arguments a handler may take.
//!
//! Each handler argument implements [`FromDelivery`]. An extractor that cannot produce its value
//! fails the delivery as a permanent failure with a clear reason; the handler does not run.
//! None of them can settle the delivery.

use std::marker::PhantomData;
use std::sync::Arc;

use amq_protocol::protocol::BasicProperties;
use amq_protocol_types::{AMQPValue, FieldTable};
use serde::de::DeserializeOwned;
use tokio_util::sync::CancellationToken;

use crate::codec::{Codec, JsonCodec};
use crate::error::QueueHandlerError;
use crate::message::Incoming;
use crate::resources::Resources;

/// The per-delivery cancellation token, made on first use: most handlers never ask for it, and
/// a child token costs two allocations and a lock on its parent.
#[derive(Debug)]
pub struct DeliveryCancel<'a> {
    parent: &'a CancellationToken,
    token: std::sync::OnceLock<CancellationToken>,
}

impl<'a> DeliveryCancel<'a> {
    /// A token that will be a child of `parent` (cancelled at shutdown).
    pub fn new(parent: &'a CancellationToken) -> Self {
        Self {
            parent,
            token: std::sync::OnceLock::new(),
        }
    }

    /// The token, made now if nobody asked before.
    pub fn token(&self) -> CancellationToken {
        self.token.get_or_init(|| self.parent.child_token()).clone()
    }

    /// Cancels this delivery's token, if anyone holds it.
    pub fn cancel(&self) {
        if let Some(token) = self.token.get() {
            token.cancel();
        }
    }

    /// Whether this delivery was cancelled (by its own timeout or by shutdown).
    pub fn is_cancelled(&self) -> bool {
        self.parent.is_cancelled()
            || self
                .token
                .get()
                .is_some_and(CancellationToken::is_cancelled)
    }
}

/// What extractors read from: the delivery and its cancellation token.
#[derive(Clone, Copy, Debug)]
pub struct Context<'a> {
    /// The delivery.
    pub incoming: &'a Arc<Incoming>,
    /// Fires when the handler should stop (shutdown, timeout).
    pub cancel: &'a DeliveryCancel<'a>,
    /// Resources of the delivery's transactional scope, if any.
    pub resources: &'a Resources,
    /// The state given with [`Router::with_state`](crate::Router::with_state).
    pub state: &'a Resources,
}

/// A type of state an extractor takes from the router ([`State`]), checked when the consumer
/// starts, so a missing one stops it instead of failing deliveries.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StateNeed {
    /// The state's type.
    pub id: std::any::TypeId,
    /// Its name, for the error.
    pub name: &'static str,
}

/// A value a handler can take as an argument.
#[diagnostic::on_unimplemented(
    message = "`{Self}` cannot be a Lily handler argument",
    label = "not an extractor",
    note = "handler arguments implement `FromDelivery`: Json<T>, Payload<T, C>, Meta, Headers, \
            Attempt, Cancellation, RawDelivery or State<S>"
)]
pub trait FromDelivery: Sized + Send + 'static {
    /// Extracts the value.
    ///
    /// # Errors
    /// A permanent failure saying why the value is not there.
    fn from_delivery(cx: &Context<'_>) -> Result<Self, QueueHandlerError>;

    /// The router state this extractor takes, if any (only [`State`] takes one).
    fn state_need() -> Option<StateNeed> {
        None
    }
}

/// State shared by every delivery, given once with
/// [`Router::with_state`](crate::Router::with_state): `async fn place(State(stock): State<Stock>,
/// ...)`. Each call gets a clone, so share an `Arc` (or a pool) inside.
///
/// ```
/// use std::sync::Arc;
/// use std::sync::atomic::{AtomicU64, Ordering};
/// use lily_mq_core::{QueueHandlerError, Router, State};
///
/// #[derive(Clone, Default)]
/// struct Counter(Arc<AtomicU64>);
///
/// async fn count(State(counter): State<Counter>) -> Result<(), QueueHandlerError> {
///     counter.0.fetch_add(1, Ordering::Relaxed);
///     Ok(())
/// }
///
/// let router = Router::new().route("order.placed", count).with_state(Counter::default());
/// assert_eq!(router.missing_state(), None);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct State<S>(pub S);

impl<S: Clone + Send + Sync + 'static> FromDelivery for State<S> {
    fn from_delivery(cx: &Context<'_>) -> Result<Self, QueueHandlerError> {
        // The consumer does not start without it (`Router::missing_state`).
        cx.state
            .get::<S>()
            .map(|s| Self(S::clone(&s)))
            .ok_or_else(|| {
                QueueHandlerError::permanent("the router was not given this handler's state")
            })
    }

    fn state_need() -> Option<StateNeed> {
        Some(StateNeed {
            id: std::any::TypeId::of::<S>(),
            name: std::any::type_name::<S>(),
        })
    }
}

/// A payload decoded by codec `C` (see [`Codec`]); `Payload(value, _)` destructures it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Payload<T, C = JsonCodec>(pub T, PhantomData<fn() -> C>);

/// A JSON payload: `async fn handle(Json(order): Json<Order>) -> ...`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Json<T>(pub T);

impl<T: DeserializeOwned + Send + 'static> FromDelivery for Json<T> {
    fn from_delivery(cx: &Context<'_>) -> Result<Self, QueueHandlerError> {
        JsonCodec::decode(cx.incoming.body())
            .map(Self)
            .map_err(QueueHandlerError::permanent)
    }
}

impl<T, C> Payload<T, C> {
    /// Wraps a value.
    pub fn new(value: T) -> Self {
        Self(value, PhantomData)
    }

    /// The decoded value.
    pub fn into_inner(self) -> T {
        self.0
    }
}

impl<T, C> std::ops::Deref for Payload<T, C> {
    type Target = T;

    fn deref(&self) -> &T {
        &self.0
    }
}

impl<T: DeserializeOwned + Send + 'static, C: Codec> FromDelivery for Payload<T, C> {
    fn from_delivery(cx: &Context<'_>) -> Result<Self, QueueHandlerError> {
        C::decode(cx.incoming.body())
            .map(Self::new)
            .map_err(QueueHandlerError::permanent)
    }
}

/// Message metadata: id, type, attempt, redelivered flag, schema version, queue.
#[derive(Debug, Clone)]
pub struct Meta(Arc<Incoming>);

impl Meta {
    /// Metadata of a delivery.
    pub fn new(incoming: Arc<Incoming>) -> Self {
        Self(incoming)
    }

    /// The `message_id` property: the operation identity.
    pub fn message_id(&self) -> &str {
        self.0.message_id()
    }

    /// The `type` property.
    pub fn kind(&self) -> &str {
        self.0.kind()
    }

    /// Application attempt, starting at 1.
    pub fn attempt(&self) -> u32 {
        self.0.attempt()
    }

    /// The broker's `redelivered` flag. It does not say whether earlier work committed.
    pub fn redelivered(&self) -> bool {
        self.0.redelivered()
    }

    /// Schema version of the payload.
    pub fn schema_version(&self) -> u32 {
        self.0.schema_version()
    }

    /// Queue the message was consumed from.
    pub fn queue(&self) -> &str {
        self.0.queue()
    }

    /// Delivery tag on the consuming channel.
    pub fn delivery_tag(&self) -> u64 {
        self.0.delivery_tag()
    }

    /// The body, for scopes that fingerprint it.
    pub fn body(&self) -> &[u8] {
        self.0.body()
    }
}

impl FromDelivery for Meta {
    fn from_delivery(cx: &Context<'_>) -> Result<Self, QueueHandlerError> {
        Ok(Self(Arc::clone(cx.incoming)))
    }
}

/// Read-only view of the headers. They passed the gate's bounds (count, key and value length,
/// nesting depth, total bytes).
#[derive(Debug, Clone)]
pub struct Headers(Arc<Incoming>);

impl Headers {
    /// A header value.
    pub fn get(&self, key: &str) -> Option<&AMQPValue> {
        self.0.header(key)
    }

    /// A string header (short or long string, valid UTF-8).
    pub fn get_str(&self, key: &str) -> Option<&str> {
        crate::headers::as_text(self.get(key)?)
    }

    /// All headers, in key order.
    pub fn iter(&self) -> impl Iterator<Item = (&str, &AMQPValue)> {
        self.0
            .headers()
            .into_iter()
            .flat_map(|t: &FieldTable| t.inner().iter())
            .map(|(k, v)| (k.as_str(), v))
    }

    /// Number of top-level headers.
    pub fn len(&self) -> usize {
        self.0.headers().map_or(0, |t| t.inner().len())
    }

    /// True when there are no headers.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl FromDelivery for Headers {
    fn from_delivery(cx: &Context<'_>) -> Result<Self, QueueHandlerError> {
        Ok(Self(Arc::clone(cx.incoming)))
    }
}

/// The application attempt, starting at 1.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Attempt(pub u32);

impl FromDelivery for Attempt {
    fn from_delivery(cx: &Context<'_>) -> Result<Self, QueueHandlerError> {
        Ok(Self(cx.incoming.attempt()))
    }
}

/// The per-delivery cancellation token. It fires at shutdown (the force notification) and when
/// the handler's timeout expires; a handler doing long work should watch it.
#[derive(Debug, Clone)]
pub struct Cancellation(pub CancellationToken);

impl FromDelivery for Cancellation {
    fn from_delivery(cx: &Context<'_>) -> Result<Self, QueueHandlerError> {
        Ok(Self(cx.cancel.token()))
    }
}

/// Body and properties, as bytes, for handlers that decode themselves. It has no way to settle.
#[derive(Debug, Clone)]
pub struct RawDelivery(Arc<Incoming>);

impl RawDelivery {
    /// The body.
    pub fn body(&self) -> &[u8] {
        self.0.body()
    }

    /// The properties, headers included.
    pub fn properties(&self) -> &BasicProperties {
        self.0.properties()
    }

    /// Metadata of the delivery.
    pub fn meta(&self) -> Meta {
        Meta(Arc::clone(&self.0))
    }
}

impl FromDelivery for RawDelivery {
    fn from_delivery(cx: &Context<'_>) -> Result<Self, QueueHandlerError> {
        Ok(Self(Arc::clone(cx.incoming)))
    }
}
