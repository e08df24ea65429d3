//! Which tag each range-API mapping carries (allocations carry theirs in their live record).
//!
//! Tags are kept per address range, not per chunk: a range may be unmapped in parts, and a
//! woken range may come back in other chunks. A stale tag over unmapped space is harmless:
//! readers intersect with what is mapped, and every map writes its tag over its whole range.

use std::collections::BTreeMap;

use crate::tag::Tag;

/// Disjoint `[start, end)` ranges, each with a tag.
#[derive(Debug, Default)]
pub(crate) struct TagMap {
    /// start -> (end, tag)
    map: BTreeMap<u64, (u64, Tag)>,
}

impl TagMap {
    /// Tag `[start, end)`, replacing whatever tags were there.
    pub(crate) fn insert(&mut self, start: u64, end: u64, tag: Tag) {
        self.remove(start, end);
        self.map.insert(start, (end, tag));
    }

    /// Forget the tags of `[start, end)`, splitting ranges that straddle its edges.
    pub(crate) fn remove(&mut self, start: u64, end: u64) {
        let first = self
            .map
            .range(..start)
            .next_back()
            .filter(|(_, (e, _))| *e > start)
            .map(|(&s, _)| s)
            .unwrap_or(start);
        let hit: Vec<u64> = self.map.range(first..end).map(|(&s, _)| s).collect();
        for s in hit {
            let Some((e, tag)) = self.map.remove(&s) else {
                continue;
            };
            if s < start {
                self.map.insert(s, (start, tag.clone()));
            }
            if e > end {
                self.map.insert(end, (e, tag));
            }
        }
    }

    /// The tagged parts of `[start, end)`, clipped to it, in address order.
    pub(crate) fn overlapping(&self, start: u64, end: u64) -> Vec<(u64, u64, Tag)> {
        let first = self
            .map
            .range(..start)
            .next_back()
            .filter(|(_, (e, _))| *e > start)
            .map(|(&s, _)| s)
            .unwrap_or(start);
        self.map
            .range(first..end)
            .map(|(&s, (e, t))| (s.max(start), (*e).min(end), t.clone()))
            .filter(|(s, e, _)| s < e)
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn insert_splits_and_replaces() {
        let mut m = TagMap::default();
        m.insert(0, 100, Tag::Weights);
        m.insert(40, 60, Tag::Kv);
        assert_eq!(
            m.overlapping(0, 100),
            vec![
                (0, 40, Tag::Weights),
                (40, 60, Tag::Kv),
                (60, 100, Tag::Weights)
            ]
        );
        m.remove(30, 50);
        assert_eq!(
            m.overlapping(10, 70),
            vec![
                (10, 30, Tag::Weights),
                (50, 60, Tag::Kv),
                (60, 70, Tag::Weights)
            ]
        );
        assert!(m.overlapping(30, 50).is_empty());
    }
}
