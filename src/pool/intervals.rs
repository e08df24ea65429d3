//! Sets of disjoint half-open byte ranges, coalesced on insert: the pool's bookkeeping of which
//! parts of its reservation are unmapped, idle, or mapped through the range API.

use std::collections::{BTreeMap, BTreeSet};

/// Disjoint, coalesced `[start, end)` ranges keyed by start.
#[derive(Debug, Default, Clone)]
pub(crate) struct Intervals {
    map: BTreeMap<u64, u64>,
    total: u64,
}

impl Intervals {
    /// Total bytes covered.
    pub(crate) fn total(&self) -> u64 {
        self.total
    }

    /// Iterate `(start, end)` in address order.
    pub(crate) fn iter(&self) -> impl Iterator<Item = (u64, u64)> + '_ {
        self.map.iter().map(|(&s, &e)| (s, e))
    }

    /// The interval containing `at`, if any.
    pub(crate) fn containing(&self, at: u64) -> Option<(u64, u64)> {
        let (&s, &e) = self.map.range(..=at).next_back()?;
        (at < e).then_some((s, e))
    }

    /// The interval ending exactly at `at`, if any.
    pub(crate) fn ending_at(&self, at: u64) -> Option<(u64, u64)> {
        let (&s, &e) = self.map.range(..at).next_back()?;
        (e == at).then_some((s, e))
    }

    /// Whether `[start, end)` lies inside one interval.
    pub(crate) fn covers(&self, start: u64, end: u64) -> bool {
        self.containing(start).is_some_and(|(_, e)| end <= e)
    }

    /// The first part of `[start, end)` covered by the set, if any.
    pub(crate) fn first_overlap(&self, start: u64, end: u64) -> Option<(u64, u64)> {
        if let Some((s, e)) = self.containing(start) {
            let _ = s;
            return Some((start, e.min(end)));
        }
        let (&s, &e) = self.map.range(start..end).next()?;
        Some((s, e.min(end)))
    }

    /// The first part of `[start, end)` not covered by the set, if any.
    pub(crate) fn first_gap(&self, start: u64, end: u64) -> Option<(u64, u64)> {
        let mut at = start;
        while at < end {
            match self.containing(at) {
                Some((_, e)) => at = e,
                None => {
                    let next = self
                        .map
                        .range(at..)
                        .next()
                        .map_or(end, |(&s, _)| s.min(end));
                    return Some((at, next));
                }
            }
        }
        None
    }

    /// Add `[start, end)`, which must not overlap the set; merges with neighbours.
    /// Returns the merged interval.
    pub(crate) fn insert(&mut self, mut start: u64, mut end: u64) -> (u64, u64) {
        debug_assert!(start < end);
        debug_assert!(
            self.first_overlap(start, end).is_none(),
            "overlapping insert [{start:#x}, {end:#x})"
        );
        self.total += end - start;
        if let Some((s, e)) = self.ending_at(start) {
            self.map.remove(&s);
            start = s;
            let _ = e;
        }
        if let Some(e) = self.map.remove(&end) {
            end = e;
        }
        self.map.insert(start, end);
        (start, end)
    }

    /// Remove `[start, end)`, which must lie inside one interval; the rest of it stays.
    pub(crate) fn remove(&mut self, start: u64, end: u64) {
        let (s, e) = self
            .containing(start)
            .filter(|&(_, e)| end <= e)
            .unwrap_or_else(|| panic!("removing [{start:#x}, {end:#x}) that is not covered"));
        self.total -= end - start;
        self.map.remove(&s);
        if s < start {
            self.map.insert(s, start);
        }
        if end < e {
            self.map.insert(end, e);
        }
    }
}

/// Idle ranges with a size index for best-fit: [`Intervals`] plus `(len, start)` ordering.
#[derive(Debug, Default)]
pub(crate) struct FreeRanges {
    ranges: Intervals,
    by_size: BTreeSet<(u64, u64)>,
}

impl FreeRanges {
    pub(crate) fn total(&self) -> u64 {
        self.ranges.total()
    }

    pub(crate) fn intervals(&self) -> &Intervals {
        &self.ranges
    }

    /// Take `size` bytes from the smallest range that fits; returns its start.
    pub(crate) fn take_best_fit(&mut self, size: u64) -> Option<u64> {
        let &(len, start) = self.by_size.range((size, 0)..).next()?;
        let _ = len;
        self.remove(start, start + size);
        Some(start)
    }

    /// The largest range length.
    pub(crate) fn largest(&self) -> u64 {
        self.by_size.last().map_or(0, |&(len, _)| len)
    }

    pub(crate) fn insert(&mut self, start: u64, end: u64) {
        if let Some((s, e)) = self.ranges.ending_at(start) {
            self.by_size.remove(&(e - s, s));
        }
        if let Some((s, e)) = self.ranges.containing(end) {
            if s == end {
                self.by_size.remove(&(e - s, s));
            }
        }
        let (s, e) = self.ranges.insert(start, end);
        self.by_size.insert((e - s, s));
    }

    pub(crate) fn remove(&mut self, start: u64, end: u64) {
        let (s, e) = self
            .ranges
            .containing(start)
            .unwrap_or_else(|| panic!("removing idle [{start:#x}, {end:#x}) that is not idle"));
        self.by_size.remove(&(e - s, s));
        self.ranges.remove(start, end);
        if s < start {
            self.by_size.insert((start - s, s));
        }
        if end < e {
            self.by_size.insert((e - end, end));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn insert_coalesces_and_remove_splits() {
        let mut iv = Intervals::default();
        iv.insert(10, 20);
        iv.insert(30, 40);
        iv.insert(20, 30);
        assert_eq!(iv.iter().collect::<Vec<_>>(), vec![(10, 40)]);
        assert_eq!(iv.total(), 30);
        iv.remove(15, 25);
        assert_eq!(iv.iter().collect::<Vec<_>>(), vec![(10, 15), (25, 40)]);
        assert_eq!(iv.total(), 20);
        assert_eq!(iv.first_gap(10, 40), Some((15, 25)));
        assert_eq!(iv.first_overlap(12, 30), Some((12, 15)));
        assert_eq!(iv.first_overlap(16, 30), Some((25, 30)));
        assert_eq!(iv.first_overlap(16, 24), None);
        assert!(iv.covers(25, 40));
        assert!(!iv.covers(14, 26));
    }

    #[test]
    fn best_fit_takes_the_smallest_fitting_range() {
        let mut fr = FreeRanges::default();
        fr.insert(0, 100);
        fr.insert(200, 230);
        fr.insert(300, 350);
        assert_eq!(fr.take_best_fit(40), Some(300));
        assert_eq!(fr.take_best_fit(25), Some(200));
        assert_eq!(fr.take_best_fit(101), None);
        fr.insert(300, 340);
        assert_eq!(fr.largest(), 100);
        assert_eq!(fr.total(), 100 + 5 + 50);
        fr.insert(225, 300);
        assert_eq!(fr.largest(), 125);
    }
}
