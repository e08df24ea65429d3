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

    /// The intervals overlapping `[start, end)`, whole, in address order: a lookup, not a scan
    /// of the set (region unmaps call this per run, with thousands of intervals in the set).
    pub(crate) fn overlapping(
        &self,
        start: u64,
        end: u64,
    ) -> impl Iterator<Item = (u64, u64)> + '_ {
        let first = self
            .map
            .range(..start)
            .next_back()
            .filter(|(_, &e)| e > start)
            .map(|(&s, &e)| (s, e));
        let rest = self.map.range(start..end.max(start)).map(|(&s, &e)| (s, e));
        first.into_iter().chain(rest)
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

    /// `overlapping` gives exactly the intervals a scan filtering on overlap gives, whole.
    #[test]
    fn overlapping_is_the_filtered_scan() {
        let mut iv = Intervals::default();
        for k in 0..50u64 {
            iv.insert(k * 10, k * 10 + 4);
        }
        for (start, end) in [
            (0, 1),
            (3, 12),
            (4, 10),
            (5, 9),
            (0, 500),
            (497, 600),
            (42, 42),
            (600, 700),
        ] {
            let scan: Vec<(u64, u64)> = iv.iter().filter(|&(s, e)| s < end && e > start).collect();
            assert_eq!(
                iv.overlapping(start, end).collect::<Vec<_>>(),
                scan,
                "[{start}, {end})"
            );
        }
    }

    /// The size index holds exactly one `(len, start)` per range: what best-fit relies on.
    fn assert_consistent(fr: &FreeRanges) {
        let from_ranges: BTreeSet<(u64, u64)> = fr.ranges.iter().map(|(s, e)| (e - s, s)).collect();
        assert_eq!(
            fr.by_size, from_ranges,
            "size index out of step with the ranges"
        );
        let sum: u64 = fr.ranges.iter().map(|(s, e)| e - s).sum();
        assert_eq!(fr.total(), sum, "total out of step with the ranges");
    }

    #[test]
    fn best_fit_takes_the_smallest_fitting_range() {
        let mut fr = FreeRanges::default();
        fr.insert(0, 100);
        fr.insert(200, 230);
        fr.insert(300, 350);
        assert_consistent(&fr);
        assert_eq!(fr.take_best_fit(40), Some(300)); // [300, 340) taken, [340, 350) left
        assert_eq!(fr.take_best_fit(25), Some(200)); // [200, 225) taken, [225, 230) left
        assert_eq!(fr.take_best_fit(101), None);
        assert_consistent(&fr);
        assert_eq!(
            fr.intervals().iter().collect::<Vec<_>>(),
            vec![(0, 100), (225, 230), (340, 350)]
        );
        fr.insert(300, 340); // merges with [340, 350)
        assert_eq!(fr.largest(), 100);
        assert_eq!(fr.total(), 100 + 5 + 50);
        // The gap between [225, 230) and [300, 350): all three become one range. (This test
        // used to insert [225, 300), which overlaps [225, 230): the debug assertion in
        // `Intervals::insert` rejects it, and without assertions it double-counted 5 bytes
        // and left a stale entry in the size index.)
        fr.insert(230, 300);
        assert_eq!(fr.largest(), 125);
        assert_eq!(fr.total(), 100 + 125);
        assert_eq!(
            fr.intervals().iter().collect::<Vec<_>>(),
            vec![(0, 100), (225, 350)]
        );
        assert_consistent(&fr);
        assert_eq!(fr.take_best_fit(120), Some(225));
        assert_eq!(fr.take_best_fit(100), Some(0));
        assert_eq!(fr.total(), 5);
        assert_consistent(&fr);
    }

    #[test]
    fn best_fit_prefers_the_lowest_address_among_equal_sizes() {
        let mut fr = FreeRanges::default();
        fr.insert(500, 510);
        fr.insert(100, 110);
        fr.insert(300, 310);
        assert_eq!(fr.take_best_fit(10), Some(100));
        assert_eq!(fr.take_best_fit(10), Some(300));
        assert_eq!(fr.take_best_fit(10), Some(500));
        assert_eq!(fr.take_best_fit(1), None);
        assert_eq!(fr.total(), 0);
        assert_consistent(&fr);
    }

    #[test]
    fn remove_from_the_middle_keeps_both_sides_indexed() {
        let mut fr = FreeRanges::default();
        fr.insert(0, 64);
        fr.remove(16, 32);
        assert_eq!(
            fr.intervals().iter().collect::<Vec<_>>(),
            vec![(0, 16), (32, 64)]
        );
        assert_eq!(fr.largest(), 32);
        assert_consistent(&fr);
        fr.insert(16, 32);
        assert_eq!(fr.intervals().iter().collect::<Vec<_>>(), vec![(0, 64)]);
        assert_consistent(&fr);
    }

    #[test]
    fn gaps_and_overlaps_at_the_edges() {
        let mut iv = Intervals::default();
        assert_eq!(iv.first_gap(0, 10), Some((0, 10)));
        assert_eq!(iv.first_overlap(0, 10), None);
        iv.insert(10, 20);
        assert_eq!(iv.first_gap(10, 20), None);
        assert_eq!(iv.first_gap(0, 30), Some((0, 10)));
        assert_eq!(iv.first_gap(15, 30), Some((20, 30)));
        // Half-open: a range ending where the set starts does not overlap it.
        assert_eq!(iv.first_overlap(0, 10), None);
        assert_eq!(iv.first_overlap(20, 30), None);
        assert_eq!(iv.containing(20), None);
        assert_eq!(iv.containing(19), Some((10, 20)));
        assert_eq!(iv.ending_at(20), Some((10, 20)));
        assert_eq!(iv.ending_at(19), None);
    }

    /// The assertion the old best-fit test tripped over: overlapping inserts are caught in
    /// builds with debug assertions (scripts/test.sh runs the suite with them on).
    #[test]
    #[cfg(debug_assertions)]
    #[should_panic(expected = "overlapping insert")]
    fn overlapping_insert_is_caught_with_debug_assertions() {
        let mut iv = Intervals::default();
        iv.insert(225, 230);
        iv.insert(225, 300);
    }
}
