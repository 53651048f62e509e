//! Routing by message type and schema version.

use std::collections::HashMap;

use crate::{BoxedHandler, Codec, Handler, JsonCodec, QueueHandlerError};

/// Maps `(type, schema version)` to a handler and checks the content type.
///
/// Dispatch happens before any scope opens: an unknown type, an unsupported version or content
/// type is a permanent failure and the message goes to the dead-letter queue.
#[derive(Debug, Clone)]
pub struct Router {
    routes: HashMap<Box<str>, Vec<(u32, BoxedHandler)>>,
    content_types: Vec<&'static str>,
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
            routes: HashMap::new(),
            content_types: vec![JsonCodec::CONTENT_TYPE],
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
        let versions = self.routes.entry(kind.into()).or_default();
        versions.retain(|(v, _)| *v != version);
        versions.push((version, BoxedHandler::new(handler)));
        self
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
        let versions = self
            .routes
            .get(kind)
            .ok_or_else(|| QueueHandlerError::permanent("no handler for this message type"))?;
        versions
            .iter()
            .find(|(v, _)| *v == version)
            .map(|(_, h)| h)
            .ok_or_else(|| QueueHandlerError::permanent("unsupported schema version"))
    }

    /// The routed `(type, version)` pairs.
    pub fn routes(&self) -> impl Iterator<Item = (&str, u32)> {
        self.routes
            .iter()
            .flat_map(|(k, vs)| vs.iter().map(move |(v, _)| (&**k, *v)))
    }
}
