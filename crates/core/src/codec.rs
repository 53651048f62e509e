//! Payload codecs: JSON by default, a seam for others.

use serde::de::DeserializeOwned;

use crate::reason::Reason;

/// Turns a body into a typed payload.
pub trait Codec: Send + Sync + 'static {
    /// The content type this codec reads, without parameters.
    const CONTENT_TYPE: &'static str;

    /// Decodes `body`.
    ///
    /// # Errors
    /// A bounded reason that never quotes the body.
    fn decode<T: DeserializeOwned>(body: &[u8]) -> Result<T, Reason>;
}

/// JSON through serde_json.
#[derive(Clone, Copy, Debug, Default)]
pub struct JsonCodec;

impl Codec for JsonCodec {
    const CONTENT_TYPE: &'static str = "application/json";

    fn decode<T: DeserializeOwned>(body: &[u8]) -> Result<T, Reason> {
        serde_json::from_slice(body).map_err(|e| {
            // serde_json's message can quote the body; keep only its category and position.
            let what = match e.classify() {
                serde_json::error::Category::Io => "unreadable",
                serde_json::error::Category::Syntax => "not valid JSON",
                serde_json::error::Category::Data => "JSON of the wrong shape",
                serde_json::error::Category::Eof => "truncated JSON",
            };
            Reason::new(format!(
                "payload is {what} (line {}, column {})",
                e.line(),
                e.column()
            ))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, serde::Deserialize)]
    struct Order {
        #[allow(dead_code)]
        qty: u32,
    }

    #[test]
    fn decode_errors_never_quote_the_body() {
        let err = JsonCodec::decode::<Order>(br#"{"qty":"secret-card-4111"}"#).unwrap_err();
        assert!(!err.as_str().contains("secret"), "{err}");
        assert!(
            err.as_str()
                .starts_with("payload is JSON of the wrong shape"),
            "{err}"
        );
        let err = JsonCodec::decode::<Order>(b"{\"qty\":").unwrap_err();
        assert!(
            err.as_str().starts_with("payload is truncated JSON"),
            "{err}"
        );
    }
}
