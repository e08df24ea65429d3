//! The engine's rules on a book alone, with a transport that moves memory in the book only.

use std::cell::RefCell;
use std::collections::BTreeMap;

use super::*;

fn line(id: &str, limit: u64, guarantee: u64, priority: i32) -> ModelBook {
    ModelBook::new(id.into(), limit, guarantee, priority)
}

/// Donors whose idle memory is a number per line; what happens is logged.
struct Fake {
    ledger: RefCell<Ledger>,
    idle: BTreeMap<u64, u64>,
    /// Whether idle memory can be handed over (a local donor) or only reclaimed.
    movable: bool,
    /// Whether a reclaim gives anything back (a remote donor that times out gives nothing).
    answers: bool,
    log: Vec<String>,
}

impl Fake {
    fn new(global: u64, lines: &[(u64, ModelBook, u64, u64)]) -> Fake {
        let mut ledger = Ledger::new(global);
        let mut idle = BTreeMap::new();
        for (key, book, used, spare) in lines {
            ledger.add(*key, book.clone()).unwrap();
            ledger.try_charge(*key, *used).unwrap();
            idle.insert(*key, *spare);
        }
        Fake {
            ledger: RefCell::new(ledger),
            idle,
            movable: true,
            answers: true,
            log: Vec::new(),
        }
    }

    fn used(&self, key: u64) -> u64 {
        self.ledger.borrow().models[&key].used
    }
}

impl Donors for Fake {
    fn with_ledger<R>(&self, f: impl FnOnce(&mut Ledger) -> R) -> R {
        f(&mut self.ledger.borrow_mut())
    }

    fn charge(&self, asker: u64, bytes: u64) -> Result<(), Refusal> {
        self.ledger.borrow_mut().try_charge(asker, bytes)
    }

    fn reachable(&mut self, _asker: u64) -> Vec<(u64, u64)> {
        self.log.push("measure".into());
        self.idle.iter().map(|(&k, &n)| (k, n)).collect()
    }

    fn hand_over(&mut self, asker: u64, from: Ask, want: u64) -> u64 {
        if !self.movable {
            return 0;
        }
        let n = want.min(from.bytes).min(self.idle[&from.key]);
        if n == 0 || !self.ledger.borrow_mut().transfer(from.key, asker, n) {
            return 0;
        }
        *self.idle.get_mut(&from.key).unwrap() -= n;
        self.log.push(format!("hand {} {n}", from.key));
        n
    }

    fn reclaim(&mut self, asks: &[Ask]) -> u64 {
        let mut got = 0;
        for a in asks {
            self.log.push(format!("reclaim {} {}", a.key, a.bytes));
            if self.answers {
                let n = a.bytes.min(self.idle[&a.key]);
                let mut l = self.ledger.borrow_mut();
                l.credit(a.key, n);
                l.note_reclaimed(a.key, n);
                *self.idle.get_mut(&a.key).unwrap() -= n;
                got += n;
            }
        }
        got
    }
}

#[test]
fn donors_in_one_order_never_the_asker_never_below_a_guarantee() {
    let mut l = Ledger::new(1000);
    l.add(1, line("asker", 500, 0, -100)).unwrap();
    l.add(2, line("hi", 500, 0, 5)).unwrap();
    l.add(3, line("lo-small", 500, 0, -1)).unwrap();
    l.add(4, line("lo-big", 500, 50, -1)).unwrap();
    l.add(5, line("lo-big-too", 500, 50, -1)).unwrap();
    l.add(6, line("gone", 500, 0, -9)).unwrap();
    l.add(7, line("guarded", 500, 100, -9)).unwrap();
    for (k, n) in [
        (1, 100),
        (2, 100),
        (3, 60),
        (4, 150),
        (5, 150),
        (6, 100),
        (7, 100),
    ] {
        l.try_charge(k, n).unwrap();
    }
    l.retire(6);
    // Everything idle (or unknown, as for a remote engine).
    let reach: Vec<(u64, u64)> = (1..=7).map(|k| (k, u64::MAX)).collect();
    let d = donors(&l, 1, &reach);
    let order: Vec<(u64, u64)> = d.iter().map(|a| (a.key, a.bytes)).collect();
    // Lowest priority first; among equals the most to give, then the lowest key; at most
    // `used - guarantee`; the asker, the retired line and the one at its guarantee never.
    assert_eq!(order, vec![(4, 100), (5, 100), (3, 60), (2, 100)]);
    // What a donor holds idle bounds it too.
    let d = donors(&l, 1, &[(2, 30), (3, 0)]);
    assert_eq!(d, vec![Ask { key: 2, bytes: 30 }]);
    assert_eq!(
        plan(
            &[Ask { key: 4, bytes: 100 }, Ask { key: 5, bytes: 100 }],
            130
        ),
        vec![Ask { key: 4, bytes: 100 }, Ask { key: 5, bytes: 30 }]
    );
}

#[test]
fn free_budget_and_own_limits_ask_no_one() {
    let mut f = Fake::new(
        100,
        &[
            (1, line("a", 50, 0, 0), 0, 0),
            (2, line("b", 100, 0, 0), 60, 60),
        ],
    );
    let got = admit(&mut f, 1, 30, false);
    assert_eq!(
        got,
        Admitted {
            handed: 0,
            charged: Ok(30)
        }
    );
    // Its own limit: refused at once, nothing measured, nothing moved.
    let got = admit(&mut f, 1, 21, false);
    assert_eq!(got.charged, Err((Refusal::ModelLimit, 21)));
    assert!(f.log.is_empty(), "{:?}", f.log);
    assert_eq!(f.ledger.borrow().models[&1].refusals, 1);
    f.ledger.borrow().audit().unwrap();
}

#[test]
fn idle_memory_is_handed_over_for_what_the_budget_lacks_only() {
    let mut f = Fake::new(
        100,
        &[
            (1, line("asker", 100, 0, 0), 0, 0),
            (2, line("lo", 100, 0, -1), 30, 30),
            (3, line("hi", 100, 0, 1), 40, 40),
        ],
    );
    // 30 free, 50 asked: 20 handed over from the lowest priority, 30 charged.
    let got = admit(&mut f, 1, 50, false);
    assert_eq!(
        got,
        Admitted {
            handed: 20,
            charged: Ok(30)
        }
    );
    assert_eq!((f.used(1), f.used(2), f.used(3)), (50, 10, 40));
    f.ledger.borrow().audit().unwrap();
}

#[test]
fn what_cannot_be_handed_over_is_reclaimed_then_charged() {
    let mut f = Fake::new(
        100,
        &[
            (1, line("asker", 100, 0, 0), 0, 0),
            (2, line("lo", 100, 0, -1), 50, 50),
            (3, line("hi", 100, 10, 1), 50, 50),
        ],
    );
    f.movable = false;
    let got = admit(&mut f, 1, 70, false);
    assert_eq!(
        got,
        Admitted {
            handed: 0,
            charged: Ok(70)
        }
    );
    // 70 lacking: 50 from the low priority, 20 from the high one (above its guarantee).
    assert!(f.log.contains(&"reclaim 2 50".to_string()), "{:?}", f.log);
    assert!(f.log.contains(&"reclaim 3 20".to_string()), "{:?}", f.log);
    assert_eq!((f.used(1), f.used(2), f.used(3)), (70, 0, 30));
    f.ledger.borrow().audit().unwrap();
}

#[test]
fn a_request_that_cannot_fit_takes_nothing_and_asks_no_one() {
    let mut f = Fake::new(
        100,
        &[
            (1, line("asker", 100, 0, 0), 0, 0),
            (2, line("lo", 100, 20, -1), 60, 60),
            (3, line("pinned", 100, 0, 1), 40, 0),
        ],
    );
    // Nothing free; lo can give 40 (above its guarantee), pinned nothing (all in use).
    let got = admit(&mut f, 1, 41, false);
    assert_eq!(
        got,
        Admitted {
            handed: 0,
            charged: Err((Refusal::Global { short: 41 }, 41))
        }
    );
    assert_eq!(
        f.log,
        vec!["measure".to_string()],
        "measured, nothing moved or asked"
    );
    assert_eq!((f.used(1), f.used(2), f.used(3)), (0, 60, 40));
    assert_eq!(f.ledger.borrow().models[&1].refusals, 1);
    // What fits is served.
    let got = admit(&mut f, 1, 40, false);
    assert_eq!(
        got,
        Admitted {
            handed: 40,
            charged: Ok(0)
        }
    );
    f.ledger.borrow().audit().unwrap();
}

#[test]
fn look_ahead_uses_the_free_budget_only() {
    let mut f = Fake::new(
        100,
        &[
            (1, line("asker", 100, 0, 0), 0, 0),
            (2, line("lo", 100, 0, -1), 90, 90),
        ],
    );
    let got = admit(&mut f, 1, 20, true);
    assert_eq!(got.charged, Err((Refusal::Global { short: 10 }, 20)));
    assert!(f.log.is_empty(), "{:?}", f.log);
    assert_eq!(
        f.ledger.borrow().models[&1].refusals,
        0,
        "not counted: optional"
    );
    assert_eq!(admit(&mut f, 1, 10, true).charged, Ok(10));
}

#[test]
fn a_reclaim_that_times_out_ends_in_a_refusal_within_the_rounds() {
    let mut f = Fake::new(
        100,
        &[
            (1, line("asker", 100, 0, 0), 0, 0),
            (2, line("far", 100, 0, -1), 100, 100),
        ],
    );
    f.movable = false;
    f.answers = false;
    let got = admit(&mut f, 1, 10, false);
    assert_eq!(got.charged, Err((Refusal::Global { short: 10 }, 10)));
    let asked = f.log.iter().filter(|l| l.starts_with("reclaim")).count();
    assert_eq!(
        asked, 1,
        "a round that gave nothing back ends the request: {:?}",
        f.log
    );
    assert_eq!(f.used(1), 0);
    f.ledger.borrow().audit().unwrap();
}

#[test]
fn room_for_a_guarantee_comes_from_the_donors_in_order() {
    let mut f = Fake::new(
        100,
        &[
            (1, line("asker", 100, 0, 0), 0, 0),
            (2, line("lo", 100, 0, -1), 50, 30),
            (3, line("hi", 100, 0, 1), 50, 50),
        ],
    );
    assert_eq!(make_room(&mut f, 1, 40), 40);
    assert_eq!(
        f.log[1..],
        ["reclaim 2 30".to_string(), "reclaim 3 10".to_string()]
    );
    f.ledger.borrow_mut().try_set_guarantee(1, 40).unwrap();
    f.ledger.borrow().audit().unwrap();
}
