//! Routing by message type and schema version.

use std::sync::Arc;

use crate::codec::{Codec, JsonCodec};
use crate::error::QueueHandlerError;
use crate::extract::StateNeed;
use crate::handler::{BoxedHandler, Handler};
use crate::resources::Resources;

/// Maps `(type, schema version)` to a handler and checks the content type.
///
/// Dispatch happens before any scope opens: an unknown type, an unsupported version or content
/// type is a permanent failure and the message goes to the dead-letter queue.
///
/// Routes are kept in a short list and matched by comparison: services route a handful of
/// types, and comparing a few strings is cheaper per delivery than hashing one.
///
/// ```
/// use lily_mq_core::{Json, Meta, QueueHandlerError, Router, State};
///
/// #[derive(serde::Deserialize)]
/// struct OrderPlaced { quantity: u32 }
///
/// #[derive(Clone)]
/// struct Prices { unit_cents: u64 }
///
/// async fn place(State(prices): State<Prices>, Json(o): Json<OrderPlaced>) -> Result<(), QueueHandlerError> {
///     let _total = prices.unit_cents * u64::from(o.quantity);
///     Ok(())
/// }
///
/// async fn place_v2(meta: Meta) -> Result<(), QueueHandlerError> {
///     let _ = meta.schema_version(); // 2
///     Ok(())
/// }
///
/// let router = Router::new()
///     .route("order.placed", place) // schema version 1
///     .route_version("order.placed", 2, place_v2)
///     .with_state(Prices { unit_cents: 250 });
/// assert!(router.missing_state().is_none());
/// ```
#[derive(Debug, Clone)]
pub struct Router {
    routes: Vec<(Box<str>, u32, BoxedHandler)>,
    content_types: Vec<&'static str>,
    state: Resources,
    /// The state types the routed handlers take.
    needs: Vec<StateNeed>,
}

impl Default for Router {
    fn default() -> Self {
        Self::new()
    }
}

impl Router {
    /// A router accepting `application/json` (and messages without a content type).
    pub fn new() -> Self {
        Self {
            routes: Vec::new(),
            content_types: vec![JsonCodec::CONTENT_TYPE],
            state: Resources::new(),
            needs: Vec::new(),
        }
    }

    /// Routes schema version 1 of `kind` to `handler`.
    #[must_use]
    pub fn route<H: Handler<Args>, Args: 'static>(self, kind: &str, handler: H) -> Self {
        self.route_version(kind, 1, handler)
    }

    /// Routes one schema version of `kind` to `handler`. A later route for the same pair
    /// replaces the earlier one.
    #[must_use]
    pub fn route_version<H: Handler<Args>, Args: 'static>(
        mut self,
        kind: &str,
        version: u32,
        handler: H,
    ) -> Self {
        self.routes
            .retain(|(k, v, _)| !(**k == *kind && *v == version));
        self.needs.extend(handler.state_needs());
        self.routes
            .push((kind.into(), version, BoxedHandler::new(handler)));
        self
    }

    /// Gives every handler taking [`State<S>`](crate::State) a clone of `state`, as axum's
    /// `with_state` does; before or after the routes. A second call with the same type
    /// replaces the first. The consumer does not start while a handler takes a state no call
    /// gave ([`Router::missing_state`]).
    #[must_use]
    pub fn with_state<S: Clone + Send + Sync + 'static>(mut self, state: S) -> Self {
        self.state.insert(Arc::new(state));
        self
    }

    /// The state handlers take from the router.
    pub fn state(&self) -> &Resources {
        &self.state
    }

    /// The type name of a state some handler takes and [`Router::with_state`] never gave.
    pub fn missing_state(&self) -> Option<&'static str> {
        self.needs
            .iter()
            .find(|need| !self.state.contains(need.id))
            .map(|need| need.name)
    }

    /// Also accepts messages whose content type is `codec`'s.
    #[must_use]
    pub fn accept<C: Codec>(mut self) -> Self {
        if !self.content_types.contains(&C::CONTENT_TYPE) {
            self.content_types.push(C::CONTENT_TYPE);
        }
        self
    }

    /// Finds the handler for a delivery.
    ///
    /// # Errors
    /// A permanent failure naming what is unsupported.
    pub fn dispatch(
        &self,
        kind: &str,
        version: u32,
        content_type: Option<&str>,
    ) -> Result<&BoxedHandler, QueueHandlerError> {
        if let Some(ct) = content_type
            && !self
                .content_types
                .iter()
                .any(|a| a.eq_ignore_ascii_case(ct))
        {
            return Err(QueueHandlerError::permanent("unsupported content type"));
        }
        let mut known_type = false;
        for (k, v, handler) in &self.routes {
            if **k == *kind {
                if *v == version {
                    return Ok(handler);
                }
                known_type = true;
            }
        }
        Err(QueueHandlerError::permanent(if known_type {
            "unsupported schema version"
        } else {
            "no handler for this message type"
        }))
    }

    /// The routed `(type, version)` pairs.
    pub fn routes(&self) -> impl Iterator<Item = (&str, u32)> {
        self.routes.iter().map(|(k, v, _)| (&**k, *v))
    }
}
