//! Size of a header table, measured the way [`Limits`] describes it, independently of the gate
//! (`crates/core/src/envelope.rs`): the targets check the gate's verdict against it.
//!
//! - Groups: each top-level header belongs, with everything it holds, to the producer's group
//!   or to the group Lily and the broker write ([`headers::is_reserved`]); each group's entries
//!   and bytes are bounded apart.
//! - Entries: every value, those of nested tables and arrays included.
//! - Depth: the values of the headers table are at depth 1; a table or array held by a value at
//!   depth `d` is at depth `d + 1`, and so are its values. The headers table itself does not
//!   count.
//! - Bytes: every key, plus every string or byte-array value by its length and every other
//!   scalar as 8 bytes (the gate's convention); tables and arrays add only what they hold.

use amq_protocol_types::{AMQPValue, FieldTable};
use lily_mq_core::{Limits, headers};

/// Entries and bytes of one group of headers.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Group {
    /// Entries, nested ones included.
    pub entries: usize,
    /// Bytes of keys and values.
    pub bytes: usize,
}

/// What a header table holds, in the terms of [`Limits`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Size {
    /// The producer's headers.
    pub producer: Group,
    /// The headers Lily and the broker write.
    pub reserved: Group,
    /// Deepest table or array.
    pub depth: usize,
    /// Longest key.
    pub longest_key: usize,
    /// Longest string or byte-array value.
    pub longest_value: usize,
}

impl Size {
    /// Measures `table`.
    pub fn of(table: &FieldTable) -> Self {
        let mut size = Self::default();
        for (key, value) in table.inner() {
            let mut group = Group::default();
            size.entry(&mut group, key, value, 1);
            let total = if headers::is_reserved(key.as_str()) {
                &mut size.reserved
            } else {
                &mut size.producer
            };
            total.entries += group.entries;
            total.bytes += group.bytes;
        }
        size
    }

    /// Whether this fits `limits`: what the gate must accept, as far as headers go.
    pub fn fits(&self, limits: &Limits) -> bool {
        let fits =
            |g: &Group| g.entries <= limits.max_headers && g.bytes <= limits.max_header_bytes;
        fits(&self.producer)
            && fits(&self.reserved)
            && self.depth <= limits.max_header_depth
            && self.longest_key <= limits.max_header_key_len
            && self.longest_value <= limits.max_header_value_len
    }

    fn entry(
        &mut self,
        group: &mut Group,
        key: &amq_protocol_types::ShortString,
        value: &AMQPValue,
        depth: usize,
    ) {
        let len = key.as_str().len();
        self.longest_key = self.longest_key.max(len);
        group.bytes += len;
        self.value(group, value, depth);
    }

    fn value(&mut self, group: &mut Group, value: &AMQPValue, depth: usize) {
        group.entries += 1;
        let len = match value {
            AMQPValue::FieldTable(table) => {
                self.depth = self.depth.max(depth + 1);
                for (key, value) in table.inner() {
                    self.entry(group, key, value, depth + 1);
                }
                return;
            }
            AMQPValue::FieldArray(array) => {
                self.depth = self.depth.max(depth + 1);
                for item in array.as_slice() {
                    self.value(group, item, depth + 1);
                }
                return;
            }
            AMQPValue::ShortString(s) => s.as_str().len(),
            AMQPValue::LongString(s) => s.len(),
            AMQPValue::ByteArray(b) => b.len(),
            _ => {
                group.bytes += 8;
                return;
            }
        };
        self.longest_value = self.longest_value.max(len);
        group.bytes += len;
    }
}
