//! Tags: what a piece of a model's memory holds (weights, KV cache, activations...).
//!
//! A tag travels with every routed candle allocation (see `route`) and is what per-tag stats,
//! reports and sleep policies are keyed by.

use std::fmt;
use std::sync::Arc;

/// What a piece of memory holds. Cheap to clone; compares and hashes by value.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Tag {
    /// Model weights: loaded once, read by every step.
    Weights,
    /// KV cache.
    Kv,
    /// Activations and other per-step temporaries.
    Activations,
    /// Scratch space (workspaces, staging buffers).
    Scratch,
    /// Anything else, by name.
    Named(Arc<str>),
}

impl Tag {
    /// A tag from a name: `"weights"`, `"kv"`, `"activations"` and `"scratch"` give the
    /// built-in tags, anything else a [`Tag::Named`].
    pub fn named(name: &str) -> Tag {
        match name {
            "weights" => Tag::Weights,
            "kv" => Tag::Kv,
            "activations" => Tag::Activations,
            "scratch" => Tag::Scratch,
            other => Tag::Named(Arc::from(other)),
        }
    }

    /// The tag's name, as [`Tag::named`] takes it.
    pub fn as_str(&self) -> &str {
        match self {
            Tag::Weights => "weights",
            Tag::Kv => "kv",
            Tag::Activations => "activations",
            Tag::Scratch => "scratch",
            Tag::Named(n) => n,
        }
    }
}

impl Default for Tag {
    /// Untagged memory counts as [`Tag::Scratch`].
    fn default() -> Self {
        Tag::Scratch
    }
}

impl fmt::Display for Tag {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl From<&str> for Tag {
    fn from(name: &str) -> Tag {
        Tag::named(name)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip() {
        for t in [
            Tag::Weights,
            Tag::Kv,
            Tag::Activations,
            Tag::Scratch,
            Tag::named("lora"),
        ] {
            assert_eq!(Tag::named(t.as_str()), t);
            assert_eq!(t.to_string(), t.as_str());
        }
        assert_eq!(Tag::from("kv"), Tag::Kv);
        assert!(matches!(Tag::from("draft"), Tag::Named(ref n) if &**n == "draft"));
    }
}
