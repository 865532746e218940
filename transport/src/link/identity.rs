//! A node's identity: an Ed25519 key pair of its own ([`NodeKey`]), whose public half
//! ([`PublicKey`]) the other nodes know from where membership lives (etcd under the node's
//! lease, or the static peer list). The handshake ([`super::handshake`]) has each end sign the
//! connection's transcript with it, so a bind's node id is proven, not claimed: holding the
//! cluster secret lets a node connect, holding node N's private key lets it speak as N.
//!
//! ```text
//! signature = Ed25519(node key, "kvd node identity v1" ‖ role ‖ transcript ‖ bind body)
//! ```
//!
//! The transcript ([`crate::auth::Session::transcript`]) is a hash of both ends' nonces and
//! ephemeral key-agreement keys, fresh on every connection, so a signature from one connection
//! is worthless on any other (replay); the role byte stops a responder's signature being sent
//! back as an initiator's (reflection); the bind body names both the signer and the node it
//! means to talk to, so an insider who relays a signature to a third node fails too.
//!
//! The key file is PKCS#8 v2 (DER, as `ring` writes it), readable by its owner only, like the
//! cluster secret file. `kvd serve` creates it in its data directory at first start; `kvd key
//! show` prints the public half as 64 hex digits, the form peer lists take.

use std::path::Path;

use ring::signature::{ED25519, Ed25519KeyPair, KeyPair, UnparsedPublicKey};

use crate::error::{Error, Result};

/// Bytes of an Ed25519 signature.
pub const SIGNATURE_BYTES: usize = 64;

/// The domain every identity signature starts with.
const IDENTITY_DOMAIN: &[u8] = b"kvd node identity v1";

/// Bytes a key file holds at most (a PKCS#8 v2 Ed25519 document is 83 to 85 bytes).
const MAX_KEY_FILE_BYTES: u64 = 1024;

/// A node's public key: 32 bytes, written as 64 lowercase hex digits.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct PublicKey(pub [u8; 32]);

impl std::fmt::Display for PublicKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        for b in self.0 {
            write!(f, "{b:02x}")?;
        }
        Ok(())
    }
}

impl std::fmt::Debug for PublicKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "PublicKey({self})")
    }
}

impl std::str::FromStr for PublicKey {
    type Err = Error;

    /// 64 hex digits (either case).
    fn from_str(s: &str) -> Result<PublicKey> {
        let bad = || {
            Error::InvalidArgument(format!(
                "a node's public key is 64 hex digits (`kvd key show` prints it), not {:?}",
                s.chars().take(80).collect::<String>()
            ))
        };
        let s = s.trim();
        if s.len() != 64 || !s.is_ascii() {
            return Err(bad());
        }
        let mut k = [0u8; 32];
        for (i, byte) in k.iter_mut().enumerate() {
            *byte = u8::from_str_radix(&s[2 * i..2 * i + 2], 16).map_err(|_| bad())?;
        }
        Ok(PublicKey(k))
    }
}

impl PublicKey {
    /// Whether `signature` is this key's over `message`.
    pub fn verifies(&self, message: &[u8], signature: &[u8]) -> bool {
        UnparsedPublicKey::new(&ED25519, &self.0)
            .verify(message, signature)
            .is_ok()
    }
}

use crate::auth::Role;

/// What an identity signature covers: the domain, the signer's role, the connection's
/// transcript and the signer's bind body.
fn signed_message(role: Role, transcript: &[u8; 32], body: &[u8]) -> Vec<u8> {
    let mut m = Vec::with_capacity(IDENTITY_DOMAIN.len() + 1 + 32 + body.len());
    m.extend_from_slice(IDENTITY_DOMAIN);
    m.push(role as u8);
    m.extend_from_slice(transcript);
    m.extend_from_slice(body);
    m
}

/// Whether `signature` proves that the holder of `key` sent `body` as `role` on the connection
/// whose transcript is `transcript`.
pub fn verify_bind(
    key: &PublicKey,
    role: Role,
    transcript: &[u8; 32],
    body: &[u8],
    signature: &[u8],
) -> bool {
    key.verifies(&signed_message(role, transcript, body), signature)
}

/// A node's key pair. Its `Debug` shows the public half only.
pub struct NodeKey {
    pair: Ed25519KeyPair,
}

impl std::fmt::Debug for NodeKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "NodeKey(public {})", self.public())
    }
}

fn rejected(what: &str, e: impl std::fmt::Display) -> Error {
    Error::InvalidArgument(format!("{what}: {e}"))
}

impl NodeKey {
    /// A fresh key pair and its PKCS#8 v2 document (what a key file holds).
    ///
    /// # Errors
    /// [`Error::Io`] without randomness.
    pub fn generate() -> Result<(NodeKey, Vec<u8>)> {
        let rng = ring::rand::SystemRandom::new();
        let doc = Ed25519KeyPair::generate_pkcs8(&rng)
            .map_err(|_| Error::Io("no randomness for a node key".into()))?;
        let key = NodeKey::from_pkcs8(doc.as_ref())?;
        Ok((key, doc.as_ref().to_vec()))
    }

    /// The key pair a PKCS#8 v2 document holds.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for anything but an Ed25519 PKCS#8 v2 document whose halves
    /// agree.
    pub fn from_pkcs8(doc: &[u8]) -> Result<NodeKey> {
        let pair = Ed25519KeyPair::from_pkcs8(doc)
            .map_err(|e| rejected("not an Ed25519 PKCS#8 v2 key", e))?;
        Ok(NodeKey { pair })
    }

    /// The key pair of a 32-byte seed: for tests that need the same key every run.
    ///
    /// # Errors
    /// Never for 32 bytes.
    pub fn from_seed(seed: &[u8; 32]) -> Result<NodeKey> {
        let pair = Ed25519KeyPair::from_seed_unchecked(seed)
            .map_err(|e| rejected("an Ed25519 seed", e))?;
        Ok(NodeKey { pair })
    }

    /// Read the key file at `path`: it must exist and be readable by its owner only.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for a missing, unreadable, group- or world-readable file or
    /// one that holds no Ed25519 key.
    pub fn from_file(path: &Path) -> Result<NodeKey> {
        use std::io::Read;
        use std::os::unix::fs::PermissionsExt;
        let shown = path.display();
        let file = std::fs::File::open(path)
            .map_err(|e| Error::InvalidArgument(format!("node key {shown}: {e}")))?;
        let meta = file
            .metadata()
            .map_err(|e| Error::InvalidArgument(format!("node key {shown}: {e}")))?;
        let mode = meta.permissions().mode();
        if mode & 0o077 != 0 {
            return Err(Error::InvalidArgument(format!(
                "node key {shown} is readable by others (mode {:o}); `chmod 600 {shown}`",
                mode & 0o777
            )));
        }
        let mut doc = Vec::new();
        file.take(MAX_KEY_FILE_BYTES)
            .read_to_end(&mut doc)
            .map_err(|e| Error::InvalidArgument(format!("node key {shown}: {e}")))?;
        NodeKey::from_pkcs8(&doc).map_err(|e| Error::InvalidArgument(format!("{shown}: {e}")))
    }

    /// Make a new key file at `path` (mode 0600, never over an existing file) and return its
    /// key.
    ///
    /// # Errors
    /// [`Error::Io`] when the file exists or cannot be written.
    pub fn create(path: &Path) -> Result<NodeKey> {
        use std::io::Write;
        use std::os::unix::fs::OpenOptionsExt;
        let (key, doc) = NodeKey::generate()?;
        let shown = path.display();
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(path)
            .map_err(|e| Error::Io(format!("creating the node key {shown}: {e}")))?;
        f.write_all(&doc)
            .and_then(|()| f.sync_all())
            .map_err(|e| Error::Io(format!("writing the node key {shown}: {e}")))?;
        Ok(key)
    }

    /// The key at `path`, made there first if there is none (and `create` allows it); whether
    /// it was made.
    ///
    /// # Errors
    /// As [`NodeKey::from_file`] and [`NodeKey::create`].
    pub fn open(path: &Path, create: bool) -> Result<(NodeKey, bool)> {
        match std::fs::symlink_metadata(path) {
            Err(e) if e.kind() == std::io::ErrorKind::NotFound && create => {
                Ok((NodeKey::create(path)?, true))
            }
            _ => Ok((NodeKey::from_file(path)?, false)),
        }
    }

    /// The public half, as peers know it.
    pub fn public(&self) -> PublicKey {
        let mut k = [0u8; 32];
        k.copy_from_slice(self.pair.public_key().as_ref());
        PublicKey(k)
    }

    /// Sign `body` as `role` on the connection whose transcript is `transcript`.
    pub fn sign_bind(
        &self,
        role: Role,
        transcript: &[u8; 32],
        body: &[u8],
    ) -> [u8; SIGNATURE_BYTES] {
        let sig = self.pair.sign(&signed_message(role, transcript, body));
        let mut out = [0u8; SIGNATURE_BYTES];
        out.copy_from_slice(sig.as_ref());
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_signature_verifies_only_under_its_key_role_transcript_and_body() {
        let (a, _) = NodeKey::generate().unwrap();
        let (b, _) = NodeKey::generate().unwrap();
        let t = [7u8; 32];
        let sig = a.sign_bind(Role::Initiator, &t, b"body");
        assert!(verify_bind(&a.public(), Role::Initiator, &t, b"body", &sig));
        assert!(
            !verify_bind(&b.public(), Role::Initiator, &t, b"body", &sig),
            "wrong key"
        );
        assert!(
            !verify_bind(&a.public(), Role::Responder, &t, b"body", &sig),
            "reflected"
        );
        assert!(
            !verify_bind(&a.public(), Role::Initiator, &[8; 32], b"body", &sig),
            "another connection's transcript (a replay)"
        );
        assert!(
            !verify_bind(&a.public(), Role::Initiator, &t, b"bodY", &sig),
            "another body"
        );
        let mut flipped = sig;
        flipped[10] ^= 1;
        assert!(!verify_bind(
            &a.public(),
            Role::Initiator,
            &t,
            b"body",
            &flipped
        ));
        assert!(!verify_bind(
            &a.public(),
            Role::Initiator,
            &t,
            b"body",
            &sig[..63]
        ));
    }

    #[test]
    fn a_public_key_reads_back_from_its_hex_and_nothing_else_reads() {
        let k = NodeKey::from_seed(&[3; 32]).unwrap().public();
        let text = k.to_string();
        assert_eq!(text.len(), 64);
        assert_eq!(text.parse::<PublicKey>().unwrap(), k);
        assert_eq!(text.to_uppercase().parse::<PublicKey>().unwrap(), k);
        for bad in [
            "",
            "abc",
            &text[..62],
            &format!("{text}00"),
            &text.replace('a', "g"),
        ] {
            if bad != text {
                assert!(bad.parse::<PublicKey>().is_err(), "{bad:?}");
            }
        }
        assert!("é".repeat(32).parse::<PublicKey>().is_err());
    }

    #[test]
    fn the_key_file_is_made_private_never_overwritten_and_must_stay_private() {
        use std::os::unix::fs::PermissionsExt;
        let dir = std::env::temp_dir().join(format!("kvd-identity-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("node.key");
        let _ = std::fs::remove_file(&path);
        assert!(
            NodeKey::open(&path, false).is_err(),
            "not made unless asked"
        );
        let (made, created) = NodeKey::open(&path, true).unwrap();
        assert!(created);
        let mode = std::fs::metadata(&path).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o600);
        let (again, created) = NodeKey::open(&path, true).unwrap();
        assert!(!created);
        assert_eq!(again.public(), made.public(), "read back, not made anew");
        assert!(
            NodeKey::create(&path).is_err(),
            "never over an existing key"
        );
        assert_eq!(
            format!("{again:?}"),
            format!("NodeKey(public {})", made.public())
        );
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o640)).unwrap();
        let e = NodeKey::from_file(&path).unwrap_err();
        assert!(e.to_string().contains("chmod 600"), "{e}");
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).unwrap();
        std::fs::write(&path, b"not a key").unwrap();
        assert!(NodeKey::from_file(&path).is_err());
        let _ = std::fs::remove_dir_all(&dir);
    }
}
