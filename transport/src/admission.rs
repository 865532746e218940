//! Bounds on connections being admitted, in all and per source: what keeps a flood of
//! connections that never finish (a handshake, a request line) from one place from taking the
//! slots of peers connecting from elsewhere. Used by the data port's handshakes
//! (`tcp/listener.rs` and `link::handshake`, by source address before authentication and by peer node and purpose
//! after it) and the daemon's probe listener.

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
    by_source: HashMap<K, usize>,
}

impl<K> Default for Open<K> {
    fn default() -> Self {
        Open {
            total: 0,
            by_source: HashMap::new(),
        }
    }
}

/// The connections admitted now, within `max_total` and `max_per_source`.
#[derive(Debug, Clone)]
pub struct Admission<K: Source = IpAddr> {
    open: Arc<Mutex<Open<K>>>,
    max_total: usize,
    max_per_source: usize,
}

/// One admitted connection's place; given back when dropped.
#[derive(Debug)]
pub struct Admitted<K: Source = IpAddr> {
    open: Arc<Mutex<Open<K>>>,
    source: K,
}

impl<K: Source> Admission<K> {
    /// Bounds of `max_total` connections at once, `max_per_source` of them from one address.
    pub fn new(max_total: usize, max_per_source: usize) -> Admission<K> {
        Admission {
            open: Arc::default(),
            max_total,
            max_per_source,
        }
    }

    /// A place for a connection from `source`, or the bound that refuses it, in words
    /// ("64 at once", "4 at once from 10.0.0.7").
    ///
    /// # Errors
    /// The bound reached.
    pub fn admit(&self, source: K) -> std::result::Result<Admitted<K>, String> {
        let mut o = self.open.lock().unwrap_or_else(PoisonError::into_inner);
        let from = o.by_source.get(&source).copied().unwrap_or(0);
        if o.total >= self.max_total {
            return Err(format!("{} at once", self.max_total));
        }
        if from >= self.max_per_source {
            return Err(format!("{} at once from {source}", self.max_per_source));
        }
        o.total += 1;
        o.by_source.insert(source.clone(), from + 1);
        Ok(Admitted {
            open: self.open.clone(),
            source,
        })
    }
}

impl<K: Source> Drop for Admitted<K> {
    fn drop(&mut self) {
        let mut o = self.open.lock().unwrap_or_else(PoisonError::into_inner);
        o.total -= 1;
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
}
