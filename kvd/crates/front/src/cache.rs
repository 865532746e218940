//! Cache-aware routing: which worker's node holds which blocks, learnt from the daemons' block
//! event logs (`GET /events` on each daemon's admin port), and a new request's block tags as
//! the serving engine computes them, so that the front can send the request where its prefix
//! already lives unless that worker's queue outweighs it.
//!
//! ```text
//!  feed (every --route-events-ms, per worker)        admit (each new request)
//!  GET /events?since=N ──▶ CacheIndex::apply         prompt ids ──▶ vllm_block_tags
//!    stored: tag's bit for the worker set              ──▶ CacheIndex::overlap per worker
//!    removed: cleared; a new node generation or        ──▶ choose(overlap, serving, weights)
//!    a hole (lost > 0): the worker's bits cleared,
//!    read again from the oldest event held
//! ```
//!
//! The index is a view, not a directory: a stale entry costs a worse route, never wrong bytes
//! (the engine's own lookup, and the cluster lookup behind it, decide what is loaded). Its
//! memory is bounded by `--route-max-blocks` entries of a 32-byte tag and a 64-bit worker mask
//! (about 80 bytes each in the map); stored events past the bound are dropped, counted.
//! Workers are matched by their node id (worker *i* runs on node *i*), at most 64 of them.

use std::collections::{BTreeMap, HashMap};

use kvd_control::WorkerId;
use kvd_core::keys::BlockTag;
use serde::{Deserialize, Serialize};

/// One page of a daemon's event log, as `GET /events` answers.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
pub struct EventsPage {
    /// The node's incarnation (sequence numbers restart at 1 when it changes).
    pub node_generation: u64,
    /// Where to read from next.
    pub next_seq: u64,
    /// Events the log had dropped before they were read.
    pub lost: u64,
    /// The events, in order.
    pub events: Vec<EventEntry>,
}

/// One event of an [`EventsPage`].
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct EventEntry {
    /// Its sequence number.
    pub seq: u64,
    /// Stored (`true`) or removed.
    pub stored: bool,
    /// The block's tag, hex.
    pub tag: String,
}

/// What the index has seen, for `/status`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct IndexFigures {
    /// Tags held (each by one or more workers).
    pub blocks: usize,
    /// Its bound.
    pub max_blocks: usize,
    /// Stored events dropped at the bound.
    pub dropped: u64,
    /// Times a worker's entries were cleared and read again (a restart or a hole in its log).
    pub resyncs: u64,
    /// Events that did not parse (ignored).
    pub malformed: u64,
}

#[derive(Debug, Clone, Copy)]
struct Cursor {
    generation: u64,
    next: u64,
}

/// Which workers' nodes hold which block tags.
#[derive(Debug)]
pub struct CacheIndex {
    entries: HashMap<BlockTag, u64>,
    /// The worker of each bit.
    slots: Vec<WorkerId>,
    cursors: HashMap<WorkerId, Cursor>,
    figures: IndexFigures,
    /// Workers whose last read of their node's log failed, with why (`/status`).
    failing: BTreeMap<WorkerId, String>,
}

/// Workers an index tells apart (one bit each).
pub const MAX_ROUTED_WORKERS: usize = 64;

impl CacheIndex {
    /// An empty index of at most `max_blocks` tags.
    pub fn new(max_blocks: usize) -> CacheIndex {
        CacheIndex {
            entries: HashMap::new(),
            slots: Vec::new(),
            cursors: HashMap::new(),
            figures: IndexFigures {
                max_blocks,
                ..IndexFigures::default()
            },
            failing: BTreeMap::new(),
        }
    }

    /// A read of `w`'s node's log failed (`why`); whether it read fine before (the first
    /// failure of a run, the one worth a log line).
    pub fn read_failed(&mut self, w: WorkerId, why: String) -> bool {
        self.failing.insert(w, why).is_none()
    }

    /// A read of `w`'s node's log succeeded; why the last one failed, if it did (the end of a
    /// run of failures).
    pub fn read_again(&mut self, w: WorkerId) -> Option<String> {
        self.failing.remove(&w)
    }

    /// The workers whose last read failed, with why.
    pub fn failing(&self) -> &BTreeMap<WorkerId, String> {
        &self.failing
    }

    fn bit(&mut self, w: WorkerId) -> Option<u64> {
        if let Some(i) = self.slots.iter().position(|s| *s == w) {
            return Some(1 << i);
        }
        if self.slots.len() >= MAX_ROUTED_WORKERS {
            return None;
        }
        self.slots.push(w);
        Some(1 << (self.slots.len() - 1))
    }

    fn bit_of(&self, w: WorkerId) -> Option<u64> {
        self.slots.iter().position(|s| *s == w).map(|i| 1 << i)
    }

    /// Where `w`'s feed reads from next (0: from the oldest event its node holds).
    pub fn since(&self, w: WorkerId) -> u64 {
        self.cursors.get(&w).map_or(0, |c| c.next)
    }

    /// Forget everything `w`'s node was said to hold.
    fn clear(&mut self, bit: u64) {
        self.entries.retain(|_, mask| {
            *mask &= !bit;
            *mask != 0
        });
    }

    /// Take a page of `w`'s node's event log. A page from a new incarnation of the node clears
    /// what the worker was said to hold and sends its feed back to the oldest event held; one
    /// with a hole (`lost`, read from before the oldest event held) clears it too, and is then
    /// the whole picture there is.
    pub fn apply(&mut self, w: WorkerId, page: &EventsPage) {
        let Some(bit) = self.bit(w) else {
            return;
        };
        if self
            .cursors
            .get(&w)
            .is_some_and(|c| c.generation != page.node_generation)
        {
            // a new incarnation of the node, read from where the old one stood: start over
            // from its oldest event
            self.clear(bit);
            self.figures.resyncs += 1;
            self.cursors.insert(
                w,
                Cursor {
                    generation: page.node_generation,
                    next: 0,
                },
            );
            return;
        }
        if page.lost > 0 {
            self.clear(bit);
            self.figures.resyncs += 1;
        }
        for e in &page.events {
            let Some(tag) = BlockTag::from_hex(&e.tag) else {
                self.figures.malformed += 1;
                continue;
            };
            if e.stored {
                if let Some(mask) = self.entries.get_mut(&tag) {
                    *mask |= bit;
                } else if self.entries.len() < self.figures.max_blocks {
                    self.entries.insert(tag, bit);
                } else {
                    self.figures.dropped += 1;
                }
            } else if let Some(mask) = self.entries.get_mut(&tag) {
                *mask &= !bit;
                if *mask == 0 {
                    self.entries.remove(&tag);
                }
            }
        }
        self.cursors.insert(
            w,
            Cursor {
                generation: page.node_generation,
                next: page.next_seq,
            },
        );
    }

    /// `w`'s node went away (its registration ended): forget what it held.
    pub fn forget(&mut self, w: WorkerId) {
        if let Some(bit) = self.bit_of(w) {
            self.clear(bit);
        }
        self.cursors.remove(&w);
        self.failing.remove(&w);
    }

    /// How many of `tags`, from the first, `w`'s node holds.
    pub fn overlap(&self, w: WorkerId, tags: &[BlockTag]) -> usize {
        let Some(bit) = self.bit_of(w) else {
            return 0;
        };
        tags.iter()
            .take_while(|t| self.entries.get(t).is_some_and(|m| m & bit != 0))
            .count()
    }

    /// What it has seen.
    pub fn figures(&self) -> IndexFigures {
        IndexFigures {
            blocks: self.entries.len(),
            ..self.figures
        }
    }
}

/// Why a request went where it went.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RouteReason {
    /// No worker's node held any of its prefix: the least loaded.
    Load,
    /// The worker whose node holds the longest prefix (its load did not outweigh it).
    Cache,
    /// Another worker's node held more of the prefix, but its queue outweighed it.
    LoadOverCache,
}

/// The weights of [`choose`]: a cached block counts `overlap` (in units of requests queued at
/// `load` each).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RouteWeights {
    /// What one cached block of the prompt is worth.
    pub overlap: f64,
    /// What one request already served by the worker costs.
    pub load: f64,
}

/// The worker among `candidates` (id, requests it serves, blocks of the prompt its node holds)
/// that scores best: `overlap × blocks − load × requests`; ties go to the fewer requests, then
/// the lower id. `None` for no candidate.
pub fn choose(
    candidates: &[(WorkerId, u32, usize)],
    w: RouteWeights,
) -> Option<(WorkerId, RouteReason)> {
    let score = |&(_, serving, blocks): &(WorkerId, u32, usize)| {
        w.overlap * blocks as f64 - w.load * f64::from(serving)
    };
    let best = candidates.iter().max_by(|a, b| {
        score(a)
            .total_cmp(&score(b))
            .then_with(|| b.1.cmp(&a.1))
            .then_with(|| b.0.cmp(&a.0))
    })?;
    let most = candidates.iter().map(|c| c.2).max().unwrap_or(0);
    let reason = if most == 0 {
        RouteReason::Load
    } else if best.2 == most {
        RouteReason::Cache
    } else {
        RouteReason::LoadOverCache
    };
    Some((best.0, reason))
}

/// The seed vLLM derives its first block's parent hash from when `PYTHONHASHSEED` is not set
/// (`vllm.v1.core.kv_cache_utils.DEFAULT_NONE_HASH_SEED`, vLLM 0.32).
pub const VLLM_NONE_HASH_SEED: &str = "vllm-none-hash";

/// The block hashes vLLM gives a plain prompt (no LoRA, multimodal input or cache salt) under
/// `--prefix-caching-hash-algo sha256_cbor`: for each full block of `block` tokens,
/// `sha256(cbor((parent, tuple(tokens), None)))`, the first block's parent being
/// `sha256(cbor(seed))`. These are the tags the kvd connector stores the blocks under.
pub fn vllm_block_tags(tokens: &[u32], block: usize, seed: &str) -> Vec<BlockTag> {
    let sha = |b: &[u8]| {
        let d = ring::digest::digest(&ring::digest::SHA256, b);
        let mut out = [0u8; 32];
        out.copy_from_slice(d.as_ref());
        out
    };
    let mut cbor = Vec::with_capacity(64 + 5 * block);
    cbor_head(&mut cbor, 3, seed.len() as u64);
    cbor.extend_from_slice(seed.as_bytes());
    let mut parent = sha(&cbor);
    let mut out = Vec::with_capacity(tokens.len() / block.max(1));
    if block == 0 {
        return out;
    }
    for chunk in tokens.chunks_exact(block) {
        cbor.clear();
        cbor.push(0x83); // an array of three
        cbor_head(&mut cbor, 2, 32);
        cbor.extend_from_slice(&parent);
        cbor_head(&mut cbor, 4, chunk.len() as u64);
        for &t in chunk {
            cbor_head(&mut cbor, 0, u64::from(t));
        }
        cbor.push(0xf6); // None
        parent = sha(&cbor);
        out.push(BlockTag(parent));
    }
    out
}

/// A CBOR head of major type `major` and argument `n`, in its shortest form (canonical).
fn cbor_head(out: &mut Vec<u8>, major: u8, n: u64) {
    let m = major << 5;
    match n {
        0..=23 => out.push(m | n as u8),
        24..=0xff => out.extend_from_slice(&[m | 24, n as u8]),
        0x100..=0xffff => {
            out.push(m | 25);
            out.extend_from_slice(&(n as u16).to_be_bytes());
        }
        0x1_0000..=0xffff_ffff => {
            out.push(m | 26);
            out.extend_from_slice(&(n as u32).to_be_bytes());
        }
        _ => {
            out.push(m | 27);
            out.extend_from_slice(&n.to_be_bytes());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hex(t: &BlockTag) -> String {
        t.to_hex()
    }

    fn page(generation: u64, next: u64, lost: u64, events: &[(u64, bool, u8)]) -> EventsPage {
        EventsPage {
            node_generation: generation,
            next_seq: next,
            lost,
            events: events
                .iter()
                .map(|&(seq, stored, t)| EventEntry {
                    seq,
                    stored,
                    tag: BlockTag([t; 32]).to_hex(),
                })
                .collect(),
        }
    }

    fn tags(ts: &[u8]) -> Vec<BlockTag> {
        ts.iter().map(|&t| BlockTag([t; 32])).collect()
    }

    #[test]
    fn the_tags_are_vllms_own_sha256_cbor_block_hashes() {
        // computed with vLLM 0.32's hash_block_tokens(sha256_cbor, ...) and its NONE_HASH
        let first: Vec<u32> = (5..37).collect();
        let second: Vec<u32> = [1000, 70000, 23, 24, 255, 256, 65535, 65536].repeat(4);
        let prompt = [first, second, vec![7; 5]].concat();
        let t = vllm_block_tags(&prompt, 32, VLLM_NONE_HASH_SEED);
        assert_eq!(t.len(), 2, "full blocks only");
        assert_eq!(
            hex(&t[0]),
            "e8afb5091b65cc2a1d47acfd94e0ae19e677056f72e147e1daf97af35734f839"
        );
        assert_eq!(
            hex(&t[1]),
            "dab49486422ceaa7ce50bea951f6dee2ad1b5aabcb93b3607368ec177c748270"
        );
        assert!(vllm_block_tags(&prompt, 0, VLLM_NONE_HASH_SEED).is_empty());
    }

    #[test]
    fn the_index_follows_stored_and_removed_and_starts_over_on_a_restart_or_a_hole() {
        let mut ix = CacheIndex::new(100);
        ix.apply(
            1,
            &page(7, 4, 0, &[(1, true, 1), (2, true, 2), (3, true, 3)]),
        );
        ix.apply(2, &page(9, 3, 0, &[(1, true, 1), (2, true, 2)]));
        assert_eq!(ix.since(1), 4);
        assert_eq!(ix.overlap(1, &tags(&[1, 2, 3, 4])), 3);
        assert_eq!(ix.overlap(2, &tags(&[1, 2, 3, 4])), 2);
        assert_eq!(ix.overlap(3, &tags(&[1])), 0, "a worker never seen");
        // a removed block ends the run there
        ix.apply(1, &page(7, 5, 0, &[(4, false, 2)]));
        assert_eq!(ix.overlap(1, &tags(&[1, 2, 3])), 1);
        assert_eq!(ix.overlap(2, &tags(&[1, 2, 3])), 2, "node 2 still holds it");
        // node 1 restarted (another generation): what it held before is gone, and its feed
        // reads again from the oldest event
        ix.apply(1, &page(8, 2, 0, &[(1, true, 9)]));
        assert_eq!((ix.overlap(1, &tags(&[1])), ix.since(1)), (0, 0));
        ix.apply(1, &page(8, 2, 0, &[(1, true, 9)]));
        assert_eq!(ix.overlap(1, &tags(&[9])), 1);
        // a hole in node 2's log: cleared, the page is the picture
        ix.apply(2, &page(9, 10, 5, &[(8, true, 5)]));
        assert_eq!(ix.overlap(2, &tags(&[1])), 0);
        assert_eq!(ix.overlap(2, &tags(&[5])), 1);
        assert_eq!(ix.figures().resyncs, 2);
        ix.forget(2);
        assert_eq!((ix.overlap(2, &tags(&[5])), ix.since(2)), (0, 0));
        // a malformed tag is counted and skipped
        let mut p = page(8, 3, 0, &[]);
        p.events.push(EventEntry {
            seq: 2,
            stored: true,
            tag: "zz".into(),
        });
        ix.apply(1, &p);
        assert_eq!(ix.figures().malformed, 1);
    }

    #[test]
    fn the_index_is_bounded_and_counts_what_it_drops() {
        let mut ix = CacheIndex::new(2);
        ix.apply(
            1,
            &page(1, 4, 0, &[(1, true, 1), (2, true, 2), (3, true, 3)]),
        );
        assert_eq!(ix.figures().blocks, 2);
        assert_eq!(ix.figures().dropped, 1);
        // another worker holding a known tag takes no more room
        ix.apply(2, &page(1, 2, 0, &[(1, true, 1)]));
        assert_eq!((ix.figures().blocks, ix.overlap(2, &tags(&[1]))), (2, 1));
    }

    #[test]
    fn a_run_of_failed_reads_is_new_once_and_ends_with_the_next_read_or_forget() {
        let mut ix = CacheIndex::new(8);
        assert!(ix.read_failed(1, "timeout".into()), "the first of a run");
        assert!(!ix.read_failed(1, "refused".into()), "the same run");
        assert!(ix.read_failed(2, "timeout".into()), "another worker's");
        assert_eq!(ix.failing().get(&1).map(String::as_str), Some("refused"));
        assert_eq!(ix.read_again(1).as_deref(), Some("refused"));
        assert_eq!(ix.read_again(1), None, "read fine twice: no run to end");
        ix.forget(2); // its registration ended
        assert!(ix.failing().is_empty());
    }

    #[test]
    fn a_request_goes_where_its_prefix_lives_unless_that_queue_outweighs_it() {
        let w = RouteWeights {
            overlap: 1.0,
            load: 4.0,
        };
        // nothing cached anywhere: the least loaded, ties to the lower id
        assert_eq!(
            choose(&[(1, 2, 0), (2, 1, 0), (3, 1, 0)], w),
            Some((2, RouteReason::Load))
        );
        // 10 cached blocks on 3 outweigh its 2 more requests (8)
        assert_eq!(
            choose(&[(1, 0, 0), (3, 2, 10)], w),
            Some((3, RouteReason::Cache))
        );
        // 10 cached blocks do not outweigh 3 more requests (12)
        assert_eq!(
            choose(&[(1, 0, 0), (3, 3, 10)], w),
            Some((1, RouteReason::LoadOverCache))
        );
        // a partial overlap elsewhere with less load can win
        assert_eq!(
            choose(&[(1, 0, 6), (3, 3, 10)], w),
            Some((1, RouteReason::LoadOverCache))
        );
        assert_eq!(choose(&[], w), None);
    }
}
