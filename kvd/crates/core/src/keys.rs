//! Namespaces and block keys.
//!
//! A **namespace** is the identity of a KV layout: two engines may share a cached page only if
//! every field that shapes its bytes is the same. [`NamespaceDescriptor::id`] hashes a canonical,
//! versioned byte encoding of the descriptor with blake3, so readers and writers that build the
//! same descriptor get the same [`NamespaceId`], and any difference (another revision, adapter,
//! dtype, block size, rank) gives another one: a mismatched layout is a miss, never a wrong hit.
//!
//! A **block tag** (page tag) is chained and deterministic from the token history:
//! `tag_i = blake3(namespace_id ‖ tag_{i-1} ‖ tokens of block i)` with `tag_{-1}` all zeros and
//! tokens as little-endian `u32`. Anyone holding the token history rebuilds every tag
//! ([`block_tags`]); engines that bring their own block hashes use them as opaque 32-byte tags
//! ([`BlockTag::from_bytes`]). A [`BlockKey`] is (namespace, tag).

use serde::{Deserialize, Serialize};

use crate::{Error, Result};

/// The version of the key scheme (canonical encoding plus tag chaining). Part of every
/// descriptor's encoding: a new scheme never collides with an old one.
pub const KEY_SCHEME_VERSION: u32 = 1;

/// The longest string field a descriptor may carry, in bytes.
pub const MAX_DESCRIPTOR_STRING_BYTES: usize = 256;

/// Element type of the cached K/V tensors.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum KvDtype {
    /// bfloat16.
    Bf16,
    /// IEEE half.
    F16,
    /// float32.
    F32,
    /// FP8 E4M3.
    Fp8E4m3,
    /// FP8 E5M2.
    Fp8E5m2,
}

impl KvDtype {
    fn code(self) -> u8 {
        match self {
            KvDtype::Bf16 => 1,
            KvDtype::F16 => 2,
            KvDtype::F32 => 3,
            KvDtype::Fp8E4m3 => 4,
            KvDtype::Fp8E5m2 => 5,
        }
    }
}

/// Everything that determines the bytes of one KV block. Build it from the engine's model
/// config; every field takes part in the [`NamespaceId`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct NamespaceDescriptor {
    /// Model name, e.g. `Qwen/Qwen3-14B`.
    pub model_name: String,
    /// Exact model revision (commit hash or version tag).
    pub model_revision: String,
    /// Tokenizer identity (name and revision).
    pub tokenizer: String,
    /// Adapter (LoRA) id and revision; empty for none.
    pub adapter: String,
    /// A salt the engine uses to partition caches (tenant isolation); empty for none.
    pub cache_salt: String,
    /// K/V element type.
    pub dtype: KvDtype,
    /// Transformer layers held in one block.
    pub num_layers: u32,
    /// KV heads held in one block (after tensor-parallel sharding).
    pub num_kv_heads: u32,
    /// Head dimension.
    pub head_dim: u32,
    /// Tokens per block.
    pub tokens_per_block: u32,
    /// Bytes of one block as the engine lays it out.
    pub bytes_per_block: u64,
    /// Tensor-parallel rank and size.
    pub tp_rank: u32,
    /// Tensor-parallel size.
    pub tp_size: u32,
    /// Pipeline-parallel rank.
    pub pp_rank: u32,
    /// Pipeline-parallel size.
    pub pp_size: u32,
    /// RoPE / position parameters, canonicalised by the engine adapter (e.g. `theta=1e6;yarn=4`).
    pub rope: String,
}

impl NamespaceDescriptor {
    /// Check the descriptor's fields: non-empty model identity, non-zero geometry, ranks in range,
    /// bounded strings.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] naming the first bad field.
    pub fn validate(&self) -> Result<()> {
        let bad = |m: &str| Err(Error::InvalidArgument(format!("namespace descriptor: {m}")));
        for (name, s) in [
            ("model_name", &self.model_name),
            ("model_revision", &self.model_revision),
            ("tokenizer", &self.tokenizer),
            ("adapter", &self.adapter),
            ("cache_salt", &self.cache_salt),
            ("rope", &self.rope),
        ] {
            if s.len() > MAX_DESCRIPTOR_STRING_BYTES {
                return bad(&format!(
                    "{name} is {} bytes, at most {MAX_DESCRIPTOR_STRING_BYTES}",
                    s.len()
                ));
            }
        }
        if self.model_name.is_empty() || self.model_revision.is_empty() {
            return bad("model_name and model_revision must be set");
        }
        if self.num_layers == 0
            || self.num_kv_heads == 0
            || self.head_dim == 0
            || self.tokens_per_block == 0
            || self.bytes_per_block == 0
        {
            return bad(
                "layers, kv heads, head dim, tokens per block and bytes per block must be > 0",
            );
        }
        if self.tp_size == 0 || self.tp_rank >= self.tp_size {
            return bad("tp_rank must be < tp_size");
        }
        if self.pp_size == 0 || self.pp_rank >= self.pp_size {
            return bad("pp_rank must be < pp_size");
        }
        Ok(())
    }

    /// The canonical encoding: `"kvd.ns"`, the key-scheme version (u32 LE), then every field in
    /// declaration order; strings as u32 LE length + UTF-8 bytes, integers little-endian, the
    /// dtype as one byte. Stable across releases of the same key scheme.
    pub fn canonical_bytes(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(160);
        out.extend_from_slice(b"kvd.ns");
        out.extend_from_slice(&KEY_SCHEME_VERSION.to_le_bytes());
        let put_str = |out: &mut Vec<u8>, s: &str| {
            out.extend_from_slice(&(s.len() as u32).to_le_bytes());
            out.extend_from_slice(s.as_bytes());
        };
        put_str(&mut out, &self.model_name);
        put_str(&mut out, &self.model_revision);
        put_str(&mut out, &self.tokenizer);
        put_str(&mut out, &self.adapter);
        put_str(&mut out, &self.cache_salt);
        out.push(self.dtype.code());
        for v in [
            self.num_layers,
            self.num_kv_heads,
            self.head_dim,
            self.tokens_per_block,
        ] {
            out.extend_from_slice(&v.to_le_bytes());
        }
        out.extend_from_slice(&self.bytes_per_block.to_le_bytes());
        for v in [self.tp_rank, self.tp_size, self.pp_rank, self.pp_size] {
            out.extend_from_slice(&v.to_le_bytes());
        }
        put_str(&mut out, &self.rope);
        out
    }

    /// `blake3(canonical encoding)`.
    pub fn id(&self) -> NamespaceId {
        NamespaceId(*blake3::hash(&self.canonical_bytes()).as_bytes())
    }
}

/// The identity of a KV layout: blake3 of a [`NamespaceDescriptor`]'s canonical encoding.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct NamespaceId(pub [u8; 32]);

/// A block's tag inside its namespace: chained from token history, or an engine's own hash.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct BlockTag(pub [u8; 32]);

impl BlockTag {
    /// An engine-provided opaque 32-byte key.
    pub fn from_bytes(bytes: [u8; 32]) -> Self {
        BlockTag(bytes)
    }

    /// The tag as 64 lowercase hex digits (the admin port's event feed writes it so).
    pub fn to_hex(&self) -> String {
        use std::fmt::Write;
        self.0.iter().fold(String::with_capacity(64), |mut s, b| {
            let _ = write!(s, "{b:02x}");
            s
        })
    }

    /// A tag from 64 hex digits (either case); `None` for anything else.
    pub fn from_hex(hex: &str) -> Option<BlockTag> {
        let hex = hex.as_bytes();
        if hex.len() != 64 {
            return None;
        }
        let digit = |c: u8| (c as char).to_digit(16);
        let mut out = [0u8; 32];
        for (o, pair) in out.iter_mut().zip(hex.chunks_exact(2)) {
            *o = u8::try_from(digit(pair[0])? * 16 + digit(pair[1])?).ok()?;
        }
        Some(BlockTag(out))
    }
}

/// The full key of a block: its namespace and its tag.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct BlockKey {
    /// The layout the block's bytes follow.
    pub namespace: NamespaceId,
    /// The block's tag within the namespace.
    pub tag: BlockTag,
}

fn short_hex(bytes: &[u8; 32], f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
    for b in &bytes[..8] {
        write!(f, "{b:02x}")?;
    }
    Ok(())
}

impl std::fmt::Debug for NamespaceId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ns:")?;
        short_hex(&self.0, f)
    }
}

impl std::fmt::Debug for BlockTag {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("tag:")?;
        short_hex(&self.0, f)
    }
}

impl std::fmt::Display for BlockKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{:?}/{:?}", self.namespace, self.tag)
    }
}

/// The tag of the block that follows `previous` (None for the first block) and holds `tokens`.
pub fn next_tag(namespace: &NamespaceId, previous: Option<&BlockTag>, tokens: &[u32]) -> BlockTag {
    let mut h = blake3::Hasher::new();
    h.update(&namespace.0);
    h.update(&previous.map_or([0u8; 32], |t| t.0));
    // Feed the tokens 64 at a time through a stack buffer: one `update` per 256 bytes instead of
    // one per token (4-byte updates cost more than the hashing itself).
    let mut buf = [0u8; 256];
    for chunk in tokens.chunks(64) {
        for (dst, t) in buf.chunks_exact_mut(4).zip(chunk) {
            dst.copy_from_slice(&t.to_le_bytes());
        }
        h.update(&buf[..chunk.len() * 4]);
    }
    BlockTag(*h.finalize().as_bytes())
}

/// The chained tags of every full block of `tokens` (a trailing partial block has no tag).
///
/// # Errors
/// [`Error::InvalidArgument`] if `tokens_per_block` is 0.
pub fn block_tags(
    namespace: &NamespaceId,
    tokens_per_block: u32,
    tokens: &[u32],
) -> Result<Vec<BlockTag>> {
    if tokens_per_block == 0 {
        return Err(Error::InvalidArgument(
            "tokens_per_block must be > 0".into(),
        ));
    }
    let mut tags = Vec::with_capacity(tokens.len() / tokens_per_block as usize);
    let mut prev: Option<BlockTag> = None;
    for chunk in tokens.chunks_exact(tokens_per_block as usize) {
        let tag = next_tag(namespace, prev.as_ref(), chunk);
        tags.push(tag);
        prev = Some(tag);
    }
    Ok(tags)
}

impl NamespaceDescriptor {
    /// A minimal layout for tools, canaries and tests: `model_name` at `model_revision`, bf16,
    /// one layer of one KV head of 64, no TP/PP, no adapter, salt or RoPE string; blocks of
    /// `tokens_per_block` tokens in `bytes_per_block` bytes. Override fields with struct update.
    pub fn minimal(
        model_name: &str,
        model_revision: &str,
        tokens_per_block: u32,
        bytes_per_block: u64,
    ) -> NamespaceDescriptor {
        NamespaceDescriptor {
            model_name: model_name.into(),
            model_revision: model_revision.into(),
            tokenizer: String::new(),
            adapter: String::new(),
            cache_salt: String::new(),
            dtype: KvDtype::Bf16,
            num_layers: 1,
            num_kv_heads: 1,
            head_dim: 64,
            tokens_per_block,
            bytes_per_block,
            tp_rank: 0,
            tp_size: 1,
            pp_rank: 0,
            pp_size: 1,
            rope: String::new(),
        }
    }

    /// A Qwen3-14B-shaped layout (bf16, 40 layers, 8 KV heads of 128, 16 tokens per block of
    /// 2.5 MiB), for examples and tests.
    pub fn example_qwen3_14b() -> NamespaceDescriptor {
        NamespaceDescriptor {
            model_name: "Qwen/Qwen3-14B".into(),
            model_revision: "rev-1".into(),
            tokenizer: "qwen3".into(),
            adapter: String::new(),
            cache_salt: String::new(),
            dtype: KvDtype::Bf16,
            num_layers: 40,
            num_kv_heads: 8,
            head_dim: 128,
            tokens_per_block: 16,
            bytes_per_block: 16 * 163_840,
            tp_rank: 0,
            tp_size: 1,
            pp_rank: 0,
            pp_size: 1,
            rope: "theta=1000000".into(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn qwen14b() -> NamespaceDescriptor {
        NamespaceDescriptor::example_qwen3_14b()
    }

    #[test]
    fn a_tag_goes_to_hex_and_back_and_anything_else_is_refused() {
        let t = BlockTag(std::array::from_fn(|i| (i * 37) as u8));
        let h = t.to_hex();
        assert_eq!(h.len(), 64);
        assert_eq!(&h[..6], "00254a");
        assert_eq!(BlockTag::from_hex(&h), Some(t));
        assert_eq!(BlockTag::from_hex(&h.to_uppercase()), Some(t));
        for bad in [
            "",
            &h[..63],
            &format!("{h}0"),
            &h.replacen('0', "g", 1),
            &h.replacen('0', "+", 1),
        ] {
            assert_eq!(BlockTag::from_hex(bad), None, "{bad}");
        }
    }

    #[test]
    fn the_same_descriptor_always_gives_the_same_namespace_id() {
        assert_eq!(qwen14b().id(), qwen14b().id());
    }

    #[test]
    fn any_layout_difference_gives_another_namespace_id() {
        let base = qwen14b().id();
        let mut variants = Vec::new();
        let mut d = qwen14b();
        d.model_revision = "rev-2".into();
        variants.push(d);
        let mut d = qwen14b();
        d.adapter = "lora-a@1".into();
        variants.push(d);
        let mut d = qwen14b();
        d.dtype = KvDtype::Fp8E4m3;
        variants.push(d);
        let mut d = qwen14b();
        d.tp_size = 2;
        variants.push(d);
        let mut d = qwen14b();
        d.cache_salt = "tenant-7".into();
        variants.push(d);
        let mut d = qwen14b();
        d.tokens_per_block = 32;
        variants.push(d);
        for v in variants {
            assert_ne!(v.id(), base, "{v:?}");
        }
    }

    #[test]
    fn string_fields_cannot_be_shifted_into_each_other() {
        let mut a = qwen14b();
        a.tokenizer = "ab".into();
        a.adapter = "c".into();
        let mut b = qwen14b();
        b.tokenizer = "a".into();
        b.adapter = "bc".into();
        assert_ne!(a.id(), b.id());
    }

    #[test]
    fn a_descriptor_with_zero_geometry_is_rejected() {
        let mut d = qwen14b();
        d.tokens_per_block = 0;
        assert!(matches!(d.validate(), Err(Error::InvalidArgument(_))));
        let mut d = qwen14b();
        d.tp_rank = 1;
        assert!(d.validate().is_err());
        assert!(qwen14b().validate().is_ok());
    }

    #[test]
    fn a_tag_is_blake3_of_namespace_previous_tag_and_tokens_little_endian() {
        let ns = qwen14b().id();
        let tokens: Vec<u32> = (0..300).map(|i| i * 7919).collect(); // > 64: several buffers
        let mut bytes = Vec::new();
        bytes.extend_from_slice(&ns.0);
        bytes.extend_from_slice(&[0u8; 32]);
        for t in &tokens {
            bytes.extend_from_slice(&t.to_le_bytes());
        }
        let first = next_tag(&ns, None, &tokens);
        assert_eq!(first.0, *blake3::hash(&bytes).as_bytes());
        bytes[32..64].copy_from_slice(&first.0);
        assert_eq!(
            next_tag(&ns, Some(&first), &tokens).0,
            *blake3::hash(&bytes).as_bytes()
        );
    }

    #[test]
    fn tags_chain_over_the_whole_history() {
        let ns = qwen14b().id();
        let a: Vec<u32> = (0..64).collect();
        let mut b = a.clone();
        b[3] = 999; // differs in the first block only
        let ta = block_tags(&ns, 16, &a).unwrap();
        let tb = block_tags(&ns, 16, &b).unwrap();
        assert_eq!(ta.len(), 4);
        for i in 0..4 {
            assert_ne!(ta[i], tb[i], "block {i} must depend on block 0's tokens");
        }
    }

    #[test]
    fn a_partial_trailing_block_has_no_tag_and_a_prefix_has_the_same_tags() {
        let ns = qwen14b().id();
        let tokens: Vec<u32> = (0..50).collect();
        let all = block_tags(&ns, 16, &tokens).unwrap();
        assert_eq!(all.len(), 3);
        let prefix = block_tags(&ns, 16, &tokens[..32]).unwrap();
        assert_eq!(&all[..2], &prefix[..]);
    }

    #[test]
    fn the_same_tokens_in_another_namespace_give_other_tags() {
        let mut d = qwen14b();
        d.model_revision = "rev-2".into();
        let tokens: Vec<u32> = (0..16).collect();
        assert_ne!(
            block_tags(&qwen14b().id(), 16, &tokens).unwrap(),
            block_tags(&d.id(), 16, &tokens).unwrap()
        );
    }
}
