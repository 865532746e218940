//! Bounds on connections being admitted, in all and per source: what keeps a flood of
//! connections that never finish (a handshake, a request line) from one place from taking the
//! slots of peers connecting from elsewhere. Used by the data port's handshakes
//! (`tcp/listener.rs` and `link::handshake`, by source address before authentication and by peer node and purpose
//! after it) and the daemon's probe listener.
//!
//! A reserve ([`Admission::with_reserve`]) keeps some of the slots for sources the caller
//! vouches for (the data port: members' addresses): others may hold `max_total - reserved` at
//! most, so a flood from any number of other sources leaves the reserve free; vouched-for
//! sources may use any slot. The per-source bound holds for both.

use std::collections::HashMap;
use std::fmt::{Debug, Display};
use std::hash::Hash;
use std::net::IpAddr;
use std::sync::{Arc, Mutex, PoisonError};

/// What a bound is kept per: a source address, a peer node's connections of one purpose.
pub trait Source: Hash + Eq + Clone + Display + Debug + Send + 'static {}
impl<T: Hash + Eq + Clone + Display + Debug + Send + 'static> Source for T {}

#[derive(Debug)]
struct Open<K> {
    total: usize,
    /// Of `total`, those from sources not vouched for.
    others: usize,
    by_source: HashMap<K, usize>,
}

impl<K> Default for Open<K> {
    fn default() -> Self {
        Open {
            total: 0,
            others: 0,
            by_source: HashMap::new(),
        }
    }
}

/// The connections admitted now, within `max_total` and `max_per_source`, `reserved` of the
/// total kept for sources vouched for.
#[derive(Debug, Clone)]
pub struct Admission<K: Source = IpAddr> {
    open: Arc<Mutex<Open<K>>>,
    max_total: usize,
    max_per_source: usize,
    reserved: usize,
}

/// One admitted connection's place; given back when dropped.
#[derive(Debug)]
pub struct Admitted<K: Source = IpAddr> {
    open: Arc<Mutex<Open<K>>>,
    source: K,
    vouched: bool,
}

impl<K: Source> Admission<K> {
    /// Bounds of `max_total` connections at once, `max_per_source` of them from one address.
    pub fn new(max_total: usize, max_per_source: usize) -> Admission<K> {
        Admission {
            open: Arc::default(),
            max_total,
            max_per_source,
            reserved: 0,
        }
    }

    /// Keep `reserved` of the total for sources vouched for ([`Admission::admit_as`]); at most
    /// the total.
    #[must_use]
    pub fn with_reserve(mut self, reserved: usize) -> Admission<K> {
        self.reserved = reserved.min(self.max_total);
        self
    }

    /// A place for a connection from `source`, not vouched for, or the bound that refuses it,
    /// in words ("64 at once", "4 at once from 10.0.0.7").
    ///
    /// # Errors
    /// The bound reached.
    pub fn admit(&self, source: K) -> std::result::Result<Admitted<K>, String> {
        self.admit_as(source, false)
    }

    /// A place for a connection from `source`, which the caller vouches for or not: only
    /// vouched-for sources take the reserved slots.
    ///
    /// # Errors
    /// The bound reached: in all, per source, or (not vouched for) the slots outside the
    /// reserve.
    pub fn admit_as(&self, source: K, vouched: bool) -> std::result::Result<Admitted<K>, String> {
        let mut o = self.open.lock().unwrap_or_else(PoisonError::into_inner);
        let from = o.by_source.get(&source).copied().unwrap_or(0);
        if o.total >= self.max_total {
            return Err(format!("{} at once", self.max_total));
        }
        let open_to_others = self.max_total - self.reserved;
        if !vouched && o.others >= open_to_others {
            return Err(format!(
                "{open_to_others} at once from non-members ({} kept for members)",
                self.reserved
            ));
        }
        if from >= self.max_per_source {
            return Err(format!("{} at once from {source}", self.max_per_source));
        }
        o.total += 1;
        if !vouched {
            o.others += 1;
        }
        o.by_source.insert(source.clone(), from + 1);
        Ok(Admitted {
            open: self.open.clone(),
            source,
            vouched,
        })
    }
}

impl<K: Source> Drop for Admitted<K> {
    fn drop(&mut self) {
        let mut o = self.open.lock().unwrap_or_else(PoisonError::into_inner);
        o.total -= 1;
        if !self.vouched {
            o.others -= 1;
        }
        if let Some(n) = o.by_source.get_mut(&self.source) {
            *n -= 1;
            if *n == 0 {
                o.by_source.remove(&self.source);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_source_cannot_take_anothers_share_and_places_come_back_when_dropped() {
        let a = Admission::new(3, 2);
        let (x, y): (IpAddr, IpAddr) = ("10.0.0.1".parse().unwrap(), "10.0.0.2".parse().unwrap());
        let p1 = a.admit(x).unwrap();
        let _p2 = a.admit(x).unwrap();
        assert_eq!(a.admit(x).unwrap_err(), "2 at once from 10.0.0.1");
        let _p3 = a.admit(y).unwrap();
        assert_eq!(a.admit(y).unwrap_err(), "3 at once");
        drop(p1);
        assert!(a.admit(x).is_ok());
    }

    #[test]
    fn strangers_from_any_number_of_sources_never_take_the_members_reserve() {
        let a = Admission::new(8, 2).with_reserve(3);
        let ip = |i: u32| IpAddr::from(std::net::Ipv4Addr::from(0x0a00_0000 + i));
        // a flood from 100 sources, two each at most: five places, then refused
        let mut flood = Vec::new();
        let mut refused = 0;
        for i in 0..100 {
            for _ in 0..3 {
                match a.admit(ip(i)) {
                    Ok(p) => flood.push(p),
                    Err(e) => {
                        refused += 1;
                        assert!(e.contains("non-members") || e.contains("from 10."), "{e}");
                    }
                }
            }
        }
        assert_eq!((flood.len(), refused), (5, 295));
        // members find the reserve, each within its own per-source bound
        let m = ip(1000);
        let m1 = a.admit_as(m, true).unwrap();
        let _m2 = a.admit_as(m, true).unwrap();
        assert_eq!(
            a.admit_as(m, true).unwrap_err(),
            "2 at once from 10.0.3.232"
        );
        let _m3 = a.admit_as(ip(1001), true).unwrap();
        assert_eq!(a.admit_as(ip(1002), true).unwrap_err(), "8 at once");
        // a member's place given back is a member's again, never a stranger's
        drop(m1);
        assert!(a.admit(ip(2000)).is_err());
        let _m4 = a.admit_as(ip(1002), true).unwrap();
        // a stranger's place given back is open to strangers again
        drop(flood.pop());
        assert!(a.admit(ip(2000)).is_ok());
    }

    #[test]
    fn members_may_use_every_slot_when_no_stranger_holds_one() {
        let a = Admission::new(4, 4).with_reserve(1);
        let m: IpAddr = "10.0.0.9".parse().unwrap();
        let held: Vec<_> = (0..4).map(|_| a.admit_as(m, true).unwrap()).collect();
        assert_eq!(
            a.admit("10.0.0.1".parse().unwrap()).unwrap_err(),
            "4 at once"
        );
        drop(held);
        let others: Vec<_> = (1..=3u8)
            .map(|i| a.admit(IpAddr::from([10, 0, 0, i])).unwrap())
            .collect();
        assert!(a.admit("10.0.0.4".parse().unwrap()).is_err(), "one kept");
        assert!(a.admit_as(m, true).is_ok());
        drop(others);
    }
}
