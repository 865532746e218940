//! Grants: the only ranges of local memory a remote peer may touch.
//!
//! A peer never names an address. It names a segment, an offset and a length, and says which
//! transfer it acts for; the engine that owns the memory lets the access through only when one
//! live grant of that transfer covers the whole range, in that direction, at that transfer's
//! epoch. Everything else is refused with the reason, counted, and touches nothing. (A
//! well-known engine writes to whatever address the wire names; this is the opposite.)
//!
//! ```text
//! grant(transfer T, epoch e, segment S, [off, off+len), direction, expiry)
//!    └─▶ check(S, range, direction, T, e, now): inside one of T's live grants? → Ok | Refused
//! revoke(T)     when the transfer ends (its grants go, whatever their expiry)
//! expire(now)   bounded per call, for grants whose transfer never ended
//! ```
//!
//! Bounds: at most [`GrantLimits::max_grants`] live grants in all and
//! [`GrantLimits::max_grants_per_transfer`] per transfer; past either, `grant` fails with a
//! retryable [`GrantError::TooMany`]. A grant's range must lie inside its registered segment.

use std::collections::{BTreeSet, HashMap};

/// A registered local memory segment, as a peer names it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SegmentId(pub u32);

/// One transfer, as both ends number it (the requester chooses it).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct TransferId(pub u64);

/// What the remote peer may do to the range.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Direction {
    /// The peer reads our bytes (a fetch from us).
    RemoteRead,
    /// The peer writes our bytes (a push to us).
    RemoteWrite,
}

/// A peer node in one incarnation, as its connection's handshake authenticated it. A grant
/// bound to one is refused to any other node and to the same node after a restart.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct PeerNode {
    /// Its node id.
    pub node: u64,
    /// Its incarnation.
    pub generation: u64,
}

/// One grant.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Grant {
    /// The transfer it is for.
    pub transfer: TransferId,
    /// The transfer's epoch: an access naming another epoch of the same transfer is refused.
    pub epoch: u64,
    /// The segment.
    pub segment: SegmentId,
    /// First byte granted, within the segment.
    pub offset: u64,
    /// Bytes granted.
    pub len: u64,
    /// What the peer may do.
    pub direction: Direction,
    /// When the grant ends on its own (the engine's clock, ms).
    pub expires_at_ms: u64,
    /// The only peer node, in the only incarnation, that may use it (`None`: any authenticated
    /// peer). A daemon grants a transfer's pages to the node it negotiated the transfer with,
    /// so a third node holding the cluster secret cannot write into another pair's transfer,
    /// nor the negotiating node's next incarnation into its predecessor's.
    pub peer: Option<PeerNode>,
}

impl Grant {
    fn covers(&self, offset: u64, len: u64) -> bool {
        offset >= self.offset
            && offset
                .checked_add(len)
                .is_some_and(|end| end <= self.offset + self.len)
    }
}

/// One access a peer asks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Access {
    /// The segment named.
    pub segment: SegmentId,
    /// First byte, within the segment.
    pub offset: u64,
    /// Bytes.
    pub len: u64,
    /// Read or write.
    pub direction: Direction,
    /// The transfer the peer acts for.
    pub transfer: TransferId,
    /// The epoch it names.
    pub epoch: u64,
    /// The node (and incarnation) the access comes from, authenticated at the connection's
    /// handshake.
    pub peer: PeerNode,
}

/// Why a grant or an access was refused. Each is counted (see [`Grants::refusals`]).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum GrantError {
    /// The segment is not registered here.
    #[error("segment {0} is not registered")]
    UnknownSegment(u32),
    /// The range leaves the segment (or is empty, or overflows).
    #[error("range {offset}+{len} is outside segment {segment} ({segment_len} bytes)")]
    OutsideSegment {
        /// The segment.
        segment: u32,
        /// Range start.
        offset: u64,
        /// Range length.
        len: u64,
        /// The segment's length.
        segment_len: u64,
    },
    /// No live grant of the transfer covers the range (it may lie in another transfer's grant,
    /// straddle two grants, or never have been granted).
    #[error("no live grant of transfer {transfer} covers segment {segment} range {offset}+{len}")]
    NotGranted {
        /// The transfer named.
        transfer: u64,
        /// The segment.
        segment: u32,
        /// Range start.
        offset: u64,
        /// Range length.
        len: u64,
    },
    /// A grant covers the range, but for the other direction.
    #[error("transfer {0}'s grant does not allow this direction")]
    WrongDirection(u64),
    /// The transfer is at another epoch than the access names.
    #[error("transfer {transfer} is at epoch {current}, the access names {got}")]
    WrongEpoch {
        /// The transfer.
        transfer: u64,
        /// The epoch named.
        got: u64,
        /// The grant's epoch.
        current: u64,
    },
    /// The covering grant has expired.
    #[error("transfer {0}'s grant has expired")]
    Expired(u64),
    /// A bound on live grants was reached; retry when transfers end.
    #[error("{0} grants live (the limit); retry when transfers end")]
    TooMany(usize),
}

impl GrantError {
    fn kind(&self) -> usize {
        match self {
            GrantError::UnknownSegment(_) => 0,
            GrantError::OutsideSegment { .. } => 1,
            GrantError::NotGranted { .. } => 2,
            GrantError::WrongDirection(_) => 3,
            GrantError::WrongEpoch { .. } => 4,
            GrantError::Expired(_) => 5,
            GrantError::TooMany(_) => 6,
        }
    }

    /// The reason's code, as [`Grants::refusals`] orders them.
    pub fn code(&self) -> u8 {
        self.kind() as u8
    }

    /// Whether trying again later can succeed.
    pub fn is_retryable(&self) -> bool {
        matches!(self, GrantError::TooMany(_))
    }
}

/// The bounds of a grant table.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GrantLimits {
    /// Live grants in all.
    pub max_grants: usize,
    /// Live grants of one transfer.
    pub max_grants_per_transfer: usize,
}

impl Default for GrantLimits {
    fn default() -> GrantLimits {
        GrantLimits {
            max_grants: 65_536,
            max_grants_per_transfer: 1_024,
        }
    }
}

/// The live grants of one engine, and its registered segments' lengths.
#[derive(Debug)]
pub struct Grants {
    limits: GrantLimits,
    segments: HashMap<SegmentId, u64>,
    by_transfer: HashMap<TransferId, Vec<Grant>>,
    /// (expires_at_ms, transfer): what `expire` visits, earliest first.
    expiry: BTreeSet<(u64, TransferId)>,
    live: usize,
    refused: [u64; 7],
}

impl Grants {
    /// An empty table.
    pub fn new(limits: GrantLimits) -> Grants {
        Grants {
            limits,
            segments: HashMap::new(),
            by_transfer: HashMap::new(),
            expiry: BTreeSet::new(),
            live: 0,
            refused: [0; 7],
        }
    }

    /// Register a segment of `len` bytes (or change its length).
    pub fn register_segment(&mut self, segment: SegmentId, len: u64) {
        self.segments.insert(segment, len);
    }

    /// Forget a segment; its grants go with it.
    pub fn unregister_segment(&mut self, segment: SegmentId) {
        self.segments.remove(&segment);
        for grants in self.by_transfer.values_mut() {
            let before = grants.len();
            grants.retain(|g| g.segment != segment);
            self.live -= before - grants.len();
        }
        self.by_transfer.retain(|_, g| !g.is_empty());
    }

    fn refuse(&mut self, e: GrantError) -> GrantError {
        self.refused[e.kind()] += 1;
        e
    }

    fn in_segment(&self, segment: SegmentId, offset: u64, len: u64) -> Result<(), GrantError> {
        let Some(&segment_len) = self.segments.get(&segment) else {
            return Err(GrantError::UnknownSegment(segment.0));
        };
        let inside = len > 0
            && offset
                .checked_add(len)
                .is_some_and(|end| end <= segment_len);
        if inside {
            Ok(())
        } else {
            Err(GrantError::OutsideSegment {
                segment: segment.0,
                offset,
                len,
                segment_len,
            })
        }
    }

    /// Grant `g`. A transfer's grants all carry its one epoch: a grant at a newer epoch
    /// replaces the transfer's older grants; one at an older epoch is refused.
    ///
    /// # Errors
    /// [`GrantError::UnknownSegment`], [`GrantError::OutsideSegment`],
    /// [`GrantError::WrongEpoch`] (older than the transfer's), [`GrantError::TooMany`]; nothing
    /// changes then.
    pub fn grant(&mut self, g: Grant) -> Result<(), GrantError> {
        if let Err(e) = self.in_segment(g.segment, g.offset, g.len) {
            return Err(self.refuse(e));
        }
        let current = self.by_transfer.get(&g.transfer);
        let (replaced, held) = match current.and_then(|v| v.first()) {
            Some(old) if old.epoch > g.epoch => {
                let e = GrantError::WrongEpoch {
                    transfer: g.transfer.0,
                    got: g.epoch,
                    current: old.epoch,
                };
                return Err(self.refuse(e));
            }
            Some(old) if old.epoch < g.epoch => (current.map_or(0, Vec::len), 0),
            _ => (0, current.map_or(0, Vec::len)),
        };
        let live_after = self.live - replaced + 1;
        if live_after > self.limits.max_grants || held + 1 > self.limits.max_grants_per_transfer {
            let e = GrantError::TooMany(self.live);
            return Err(self.refuse(e));
        }
        if replaced > 0 {
            self.revoke(g.transfer);
        }
        self.expiry.insert((g.expires_at_ms, g.transfer));
        self.by_transfer.entry(g.transfer).or_default().push(g);
        self.live += 1;
        Ok(())
    }

    /// The transfer ended: all its grants go. Returns how many.
    pub fn revoke(&mut self, transfer: TransferId) -> usize {
        let Some(grants) = self.by_transfer.remove(&transfer) else {
            return 0;
        };
        for g in &grants {
            self.expiry.remove(&(g.expires_at_ms, transfer));
        }
        self.live -= grants.len();
        grants.len()
    }

    /// Drop the grants expired at `now_ms`, at most `budget` transfers' worth per call. Returns
    /// the grants dropped.
    pub fn expire(&mut self, now_ms: u64, budget: usize) -> usize {
        let mut dropped = 0;
        for _ in 0..budget {
            let Some(&(at, transfer)) = self.expiry.first() else {
                break;
            };
            if at > now_ms {
                break;
            }
            self.expiry.pop_first();
            if let Some(grants) = self.by_transfer.get_mut(&transfer) {
                let before = grants.len();
                grants.retain(|g| g.expires_at_ms > now_ms);
                let gone = before - grants.len();
                self.live -= gone;
                dropped += gone;
                if grants.is_empty() {
                    self.by_transfer.remove(&transfer);
                }
            }
        }
        dropped
    }

    /// Whether `a` may proceed at `now_ms`: one live grant of its transfer covers its whole
    /// range, in its direction, at its epoch. Checked before a byte is touched.
    ///
    /// # Errors
    /// The reason, counted.
    pub fn check(&mut self, a: &Access, now_ms: u64) -> Result<(), GrantError> {
        let r = self.verdict(a, now_ms);
        r.map_err(|e| self.refuse(e))
    }

    fn verdict(&self, a: &Access, now_ms: u64) -> Result<(), GrantError> {
        self.in_segment(a.segment, a.offset, a.len)?;
        let not_granted = || GrantError::NotGranted {
            transfer: a.transfer.0,
            segment: a.segment.0,
            offset: a.offset,
            len: a.len,
        };
        let grants = self.by_transfer.get(&a.transfer).ok_or_else(not_granted)?;
        if let Some(g) = grants.first()
            && g.epoch != a.epoch
        {
            return Err(GrantError::WrongEpoch {
                transfer: a.transfer.0,
                got: a.epoch,
                current: g.epoch,
            });
        }
        // a grant bound to another peer (or incarnation) is, to this one, not granted at all
        let covering = || {
            grants.iter().filter(|g| {
                g.segment == a.segment
                    && g.covers(a.offset, a.len)
                    && g.peer.is_none_or(|p| p == a.peer)
            })
        };
        let same_direction = || covering().filter(|g| g.direction == a.direction);
        if same_direction().any(|g| g.expires_at_ms > now_ms) {
            return Ok(());
        }
        Err(if same_direction().next().is_some() {
            GrantError::Expired(a.transfer.0)
        } else if covering().next().is_some() {
            GrantError::WrongDirection(a.transfer.0)
        } else {
            not_granted()
        })
    }

    /// How many live grants `transfer` has.
    pub fn grants_of(&self, transfer: TransferId) -> usize {
        self.by_transfer.get(&transfer).map_or(0, Vec::len)
    }

    /// Whether `transfer` has live grants.
    pub fn has_transfer(&self, transfer: TransferId) -> bool {
        self.by_transfer.contains_key(&transfer)
    }

    /// Live grants.
    pub fn live(&self) -> usize {
        self.live
    }

    /// Refusals so far, by reason: unknown segment, outside segment, not granted, wrong
    /// direction, wrong epoch, expired, too many.
    pub fn refusals(&self) -> [u64; 7] {
        self.refused
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const S: SegmentId = SegmentId(1);
    const T: TransferId = TransferId(10);
    const U: TransferId = TransferId(11);

    fn table() -> Grants {
        let mut g = Grants::new(GrantLimits {
            max_grants: 8,
            max_grants_per_transfer: 4,
        });
        g.register_segment(S, 1 << 20);
        g
    }

    fn grant(transfer: TransferId, offset: u64, len: u64, direction: Direction) -> Grant {
        Grant {
            transfer,
            epoch: 1,
            segment: S,
            offset,
            len,
            direction,
            expires_at_ms: 1_000,
            peer: None,
        }
    }

    fn access(transfer: TransferId, offset: u64, len: u64, direction: Direction) -> Access {
        Access {
            segment: S,
            offset,
            len,
            direction,
            transfer,
            epoch: 1,
            peer: PEER,
        }
    }

    const PEER: PeerNode = PeerNode {
        node: 2,
        generation: 7,
    };

    #[test]
    fn a_grant_bound_to_a_peer_refuses_other_nodes_and_that_nodes_next_incarnation() {
        let mut g = table();
        g.grant(Grant {
            peer: Some(PEER),
            ..grant(T, 0, 4096, Direction::RemoteWrite)
        })
        .unwrap();
        let from = |peer| Access {
            peer,
            ..access(T, 0, 4096, Direction::RemoteWrite)
        };
        g.check(&from(PEER), 10).unwrap();
        for other in [
            PeerNode { node: 3, ..PEER },
            PeerNode {
                generation: 8,
                ..PEER
            },
        ] {
            let e = g.check(&from(other), 10).unwrap_err();
            assert!(matches!(e, GrantError::NotGranted { .. }), "{other:?}: {e}");
        }
        assert_eq!(g.refusals().iter().sum::<u64>(), 2);
        g.check(&from(PEER), 10).unwrap();
    }

    #[test]
    fn only_a_live_grant_of_the_same_transfer_direction_and_epoch_lets_an_access_through() {
        let mut g = table();
        g.grant(grant(T, 4096, 8192, Direction::RemoteWrite))
            .unwrap();
        g.grant(grant(U, 65_536, 4096, Direction::RemoteRead))
            .unwrap();
        g.check(&access(T, 4096, 8192, Direction::RemoteWrite), 10)
            .unwrap();
        g.check(&access(T, 8192, 100, Direction::RemoteWrite), 10)
            .unwrap();
        let cases = [
            // Past the segment's end.
            (
                access(T, (1 << 20) - 10, 20, Direction::RemoteWrite),
                10,
                "outside",
            ),
            // Straddles the end of T's grant.
            (
                access(T, 12_000, 1_000, Direction::RemoteWrite),
                10,
                "no live grant",
            ),
            // Inside U's grant, acting for T: another transfer's range.
            (
                access(T, 65_536, 100, Direction::RemoteRead),
                10,
                "no live grant",
            ),
            (access(T, 4096, 10, Direction::RemoteRead), 10, "direction"),
            (
                Access {
                    epoch: 2,
                    ..access(T, 4096, 10, Direction::RemoteWrite)
                },
                10,
                "epoch",
            ),
            (
                access(T, 4096, 10, Direction::RemoteWrite),
                1_000,
                "expired",
            ),
            (
                Access {
                    segment: SegmentId(9),
                    ..access(T, 0, 10, Direction::RemoteWrite)
                },
                10,
                "not registered",
            ),
            (access(T, 4096, 0, Direction::RemoteWrite), 10, "outside"),
        ];
        for (a, now, why) in cases {
            let e = g.check(&a, now).unwrap_err();
            assert!(e.to_string().contains(why), "{a:?}: {e}");
        }
        assert_eq!(g.refusals().iter().sum::<u64>(), cases.len() as u64);
    }

    #[test]
    fn a_grant_outside_its_segment_or_past_the_bounds_is_refused_and_changes_nothing() {
        let mut g = table();
        assert!(matches!(
            g.grant(grant(T, (1 << 20) - 1, 2, Direction::RemoteRead)),
            Err(GrantError::OutsideSegment { .. })
        ));
        for i in 0..4 {
            g.grant(grant(T, i * 4096, 4096, Direction::RemoteRead))
                .unwrap();
        }
        let e = g
            .grant(grant(T, 1 << 19, 4096, Direction::RemoteRead))
            .unwrap_err();
        assert!(e.is_retryable(), "{e}");
        for i in 0..4 {
            g.grant(grant(U, i * 4096, 4096, Direction::RemoteRead))
                .unwrap();
        }
        assert!(matches!(
            g.grant(grant(TransferId(12), 0, 1, Direction::RemoteRead)),
            Err(GrantError::TooMany(8))
        ));
        assert_eq!(g.live(), 8);
    }

    #[test]
    fn a_newer_epoch_replaces_the_transfers_grants_and_an_older_one_is_refused() {
        let mut g = table();
        g.grant(grant(T, 0, 4096, Direction::RemoteWrite)).unwrap();
        g.grant(Grant {
            epoch: 2,
            ..grant(T, 8192, 4096, Direction::RemoteWrite)
        })
        .unwrap();
        assert_eq!(g.live(), 1, "the epoch-1 grant went");
        assert!(
            g.check(
                &Access {
                    epoch: 2,
                    ..access(T, 0, 10, Direction::RemoteWrite)
                },
                10
            )
            .is_err()
        );
        assert!(matches!(
            g.grant(grant(T, 0, 4096, Direction::RemoteWrite)),
            Err(GrantError::WrongEpoch {
                got: 1,
                current: 2,
                ..
            })
        ));
    }

    #[test]
    fn revoke_expire_and_unregister_leave_no_grant_behind() {
        let mut g = table();
        g.grant(grant(T, 0, 4096, Direction::RemoteWrite)).unwrap();
        g.grant(Grant {
            expires_at_ms: 50,
            ..grant(U, 0, 4096, Direction::RemoteRead)
        })
        .unwrap();
        assert_eq!(g.expire(49, 10), 0);
        assert_eq!(g.expire(50, 10), 1);
        assert_eq!(g.revoke(T), 1);
        assert_eq!(g.revoke(T), 0, "idempotent");
        g.grant(grant(T, 0, 4096, Direction::RemoteWrite)).unwrap();
        g.unregister_segment(S);
        assert_eq!(g.live(), 0);
        assert!(matches!(
            g.check(&access(T, 0, 1, Direction::RemoteWrite), 0),
            Err(GrantError::UnknownSegment(1))
        ));
    }

    proptest! {
        /// Against the plain definition: an access passes exactly when one of its transfer's
        /// grants, in its direction, unexpired, contains the whole range inside the segment.
        #[test]
        fn check_agrees_with_the_plain_definition(
            grants in proptest::collection::vec((0u64..2, 0u64..64, 1u64..32, any::<bool>(), 0u64..100), 0..4),
            a in (0u64..2, 0u64..80, 0u64..40, any::<bool>()),
            now in 0u64..100,
        ) {
            let dir = |w: bool| if w { Direction::RemoteWrite } else { Direction::RemoteRead };
            let mut g = Grants::new(GrantLimits::default());
            g.register_segment(S, 64);
            let mut granted = Vec::new();
            for (t, off, len, w, exp) in grants {
                let gr = Grant { transfer: TransferId(t), epoch: 1, segment: S, offset: off, len, direction: dir(w), expires_at_ms: exp, peer: None };
                if g.grant(gr).is_ok() {
                    granted.push(gr);
                }
            }
            let acc = Access { segment: S, offset: a.1, len: a.2, direction: dir(a.3), transfer: TransferId(a.0), epoch: 1 , peer: PEER};
            let expected = a.2 > 0 && a.1 + a.2 <= 64 && granted.iter().any(|gr| {
                gr.transfer == acc.transfer && gr.direction == acc.direction && gr.expires_at_ms > now
                    && acc.offset >= gr.offset && acc.offset + acc.len <= gr.offset + gr.len
            });
            prop_assert_eq!(g.check(&acc, now).is_ok(), expected, "{:?} with {:?} at {}", acc, granted, now);
        }
    }
}
