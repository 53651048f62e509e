//! Bounded, sanitized reasons.
//!
//! Reasons travel into headers, logs and reports. They are written by strangers (a hostile
//! message id quoted in an error) as often as by the application, so every reason is cut to
//! [`Reason::MAX_LEN`] bytes on a character boundary and stripped of control characters before
//! it is stored.

use std::borrow::Cow;
use std::fmt;

/// A short, printable explanation of a failure: at most [`Reason::MAX_LEN`] bytes, no control
/// characters.
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct Reason(Cow<'static, str>);

impl Reason {
    /// The longest reason kept, in bytes. Longer text is cut and ends in `…`.
    pub const MAX_LEN: usize = 200;

    /// Builds a reason, sanitizing and bounding `text`. A `&'static str` that is already clean is
    /// stored without allocating.
    pub fn new(text: impl Into<Cow<'static, str>>) -> Self {
        let text = text.into();
        if is_clean(&text) {
            return Self(text);
        }
        Self(Cow::Owned(sanitize(&text)))
    }

    /// A reason from text known at compile time to be clean (short, no control characters);
    /// checked when the constant is built.
    pub const fn from_static(text: &'static str) -> Self {
        assert!(text.len() <= Self::MAX_LEN, "a static reason must be short");
        let bytes = text.as_bytes();
        let mut i = 0;
        while i < bytes.len() {
            assert!(
                !bytes[i].is_ascii_control(),
                "a static reason has no control characters"
            );
            i += 1;
        }
        Self(Cow::Borrowed(text))
    }

    /// The reason as text.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

fn is_clean(text: &str) -> bool {
    text.len() <= Reason::MAX_LEN && !text.chars().any(char::is_control)
}

fn sanitize(text: &str) -> String {
    const ELLIPSIS: char = '…';
    let budget = Reason::MAX_LEN - ELLIPSIS.len_utf8();
    let mut out = String::with_capacity(text.len().min(Reason::MAX_LEN));
    for c in text.chars() {
        let c = if c.is_control() { ' ' } else { c };
        if out.len() + c.len_utf8() > budget && text.len() > Reason::MAX_LEN {
            out.push(ELLIPSIS);
            return out;
        }
        out.push(c);
    }
    out
}

impl fmt::Display for Reason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl fmt::Debug for Reason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(&*self.0, f)
    }
}

impl From<&'static str> for Reason {
    fn from(text: &'static str) -> Self {
        Self::new(text)
    }
}

impl From<String> for Reason {
    fn from(text: String) -> Self {
        Self::new(text)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn clean_static_text_is_kept_as_is() {
        let reason = Reason::new("stock service unavailable");
        assert!(matches!(reason.0, Cow::Borrowed(_)));
        assert_eq!(reason.as_str(), "stock service unavailable");
    }

    #[test]
    fn control_characters_become_spaces() {
        assert_eq!(Reason::new("a\nb\u{0}c").as_str(), "a b c");
    }

    #[test]
    fn long_text_is_cut_on_a_char_boundary() {
        let reason = Reason::new("é".repeat(500));
        assert!(reason.as_str().len() <= Reason::MAX_LEN);
        assert!(reason.as_str().ends_with('…'));
    }

    proptest! {
        #[test]
        fn every_reason_is_bounded_and_printable(text in ".{0,600}") {
            let reason = Reason::new(text);
            prop_assert!(reason.as_str().len() <= Reason::MAX_LEN);
            prop_assert!(!reason.as_str().chars().any(char::is_control));
        }
    }
}
