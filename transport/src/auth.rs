//! Peer authentication: a connection between two nodes proves, both ways, that each end holds
//! the cluster secret, without the secret (or anything a listener could replay) crossing the
//! wire.
//!
//! ```text
//! initiator                                   responder
//!   Hello { version, initiator nonce } ───────▶
//!                       ◀─────── Challenge { responder nonce, responder proof }
//!   verify responder proof
//!   Proof { initiator proof } ────────────────▶  verify initiator proof
//! ```
//!
//! `proof(role) = blake3::keyed_hash(key, "kvd peer auth v1" ‖ role ‖ initiator nonce ‖
//! responder nonce)` with `key = blake3::derive_key("kvd cluster secret v1", secret file)`. Both
//! nonces are fresh 32 random bytes, so no proof from another connection is ever valid again
//! (replay); the role byte differs, so a responder's proof sent back as the initiator's fails
//! (reflection). Proofs are compared in constant time (`blake3::Hash`'s equality). The keyed
//! hash is blake3's own keyed mode, not a construction of ours. An unauthenticated connection
//! can do nothing but fail this handshake.
//!
//! The handshake also gives both ends a key of the connection's own ([`SessionKey`]:
//! `blake3::keyed_hash(key, "kvd session key v1" ‖ initiator nonce ‖ responder nonce)`),
//! which nobody without the secret can compute. Every frame after the proofs carries a tag
//! over it ([`Sealer`], [`Unsealer`]):
//!
//! ```text
//! tag = blake3::keyed_hash(session key, "kvd frame v1" ‖ direction ‖ sequence ‖ frame)[..16]
//! ```
//!
//! The direction byte (initiator → responder or back) stops a frame reflected to its sender;
//! the sequence number (a count per direction, never sent) stops a frame replayed, dropped or
//! reordered within the connection; the session key stops one moved from another connection.
//! A frame whose tag is wrong closes its connection: a network that flips bits or an on-path
//! attacker without the secret can cut a connection, never change what it says.

use std::path::Path;

use crate::error::{Error, Result};

/// The version of this handshake (the first byte of [`Hello`]).
pub const AUTH_VERSION: u8 = 1;
/// Bytes a secret file holds at least.
pub const MIN_SECRET_BYTES: usize = 32;
/// Bytes a secret file holds at most (the file is read whole).
pub const MAX_SECRET_BYTES: usize = 4096;

const KEY_CONTEXT: &str = "kvd cluster secret v1";
const PROOF_DOMAIN: &[u8] = b"kvd peer auth v1";
const SESSION_DOMAIN: &[u8] = b"kvd session key v1";
const FRAME_DOMAIN: &[u8] = b"kvd frame v1";

/// Bytes of the tag every frame after the handshake carries.
pub const TAG_BYTES: usize = 16;

/// The cluster secret, as a key derived from the secret file. Its `Debug` shows nothing of it.
#[derive(Clone)]
pub struct ClusterSecret {
    key: [u8; 32],
}

impl std::fmt::Debug for ClusterSecret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ClusterSecret(..)")
    }
}

impl ClusterSecret {
    /// A secret from the bytes of a secret file.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for fewer than [`MIN_SECRET_BYTES`] or more than
    /// [`MAX_SECRET_BYTES`] bytes.
    pub fn from_bytes(bytes: &[u8]) -> Result<ClusterSecret> {
        if bytes.len() < MIN_SECRET_BYTES || bytes.len() > MAX_SECRET_BYTES {
            return Err(Error::InvalidArgument(format!(
                "a cluster secret holds {MIN_SECRET_BYTES} to {MAX_SECRET_BYTES} bytes, not {}; \
                 make one with `head -c 32 /dev/urandom > FILE && chmod 600 FILE`",
                bytes.len()
            )));
        }
        Ok(ClusterSecret {
            key: blake3::derive_key(KEY_CONTEXT, bytes),
        })
    }

    /// Read the secret file at `path`: it must exist, and be readable by its owner only.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for a missing, unreadable, group- or world-readable file, or
    /// one of the wrong size.
    pub fn from_file(path: &Path) -> Result<ClusterSecret> {
        use std::os::unix::fs::PermissionsExt;
        let shown = path.display();
        let meta = std::fs::metadata(path)
            .map_err(|e| Error::InvalidArgument(format!("cluster secret {shown}: {e}")))?;
        let mode = meta.permissions().mode();
        if mode & 0o077 != 0 {
            return Err(Error::InvalidArgument(format!(
                "cluster secret {shown} is readable by others (mode {:o}); `chmod 600 {shown}`",
                mode & 0o777
            )));
        }
        let bytes = std::fs::read(path)
            .map_err(|e| Error::InvalidArgument(format!("cluster secret {shown}: {e}")))?;
        ClusterSecret::from_bytes(&bytes)
    }

    fn proof(&self, role: Role, initiator: &Nonce, responder: &Nonce) -> blake3::Hash {
        let mut h = blake3::Hasher::new_keyed(&self.key);
        h.update(PROOF_DOMAIN);
        h.update(&[role as u8]);
        h.update(&initiator.0);
        h.update(&responder.0);
        h.finalize()
    }

    fn session(&self, initiator: &Nonce, responder: &Nonce) -> SessionKey {
        let mut h = blake3::Hasher::new_keyed(&self.key);
        h.update(SESSION_DOMAIN);
        h.update(&initiator.0);
        h.update(&responder.0);
        SessionKey(*h.finalize().as_bytes())
    }
}

/// The key one connection's handshake gave both its ends (and nobody else). Its `Debug`
/// shows nothing of it.
#[derive(Clone, PartialEq, Eq)]
pub struct SessionKey([u8; 32]);

impl std::fmt::Debug for SessionKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("SessionKey(..)")
    }
}

impl SessionKey {
    /// A fresh random key, for a channel whose two ends are both in this process (there is
    /// nobody to run a handshake with).
    ///
    /// # Errors
    /// As [`Nonce::fresh`].
    pub fn fresh() -> Result<SessionKey> {
        Ok(SessionKey(Nonce::fresh()?.0))
    }

    /// The two halves of a connection's integrity for the end `me`: what tags the frames it
    /// sends, what checks the frames it receives.
    pub fn split(&self, me: Role) -> (Sealer, Unsealer) {
        let other = match me {
            Role::Initiator => Role::Responder,
            Role::Responder => Role::Initiator,
        };
        (
            Sealer(Tagger::new(&self.0, me)),
            Unsealer(Tagger::new(&self.0, other)),
        )
    }
}

/// The tags of one direction of a connection: the sender's role and the next sequence number.
#[derive(Clone)]
struct Tagger {
    key: [u8; 32],
    from: Role,
    seq: u64,
}

impl std::fmt::Debug for Tagger {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tagger")
            .field("from", &self.from)
            .field("seq", &self.seq)
            .finish_non_exhaustive()
    }
}

impl Tagger {
    fn new(key: &[u8; 32], from: Role) -> Tagger {
        Tagger {
            key: *key,
            from,
            seq: 0,
        }
    }

    /// The next frame's tag (the sequence moves on).
    fn next(&mut self, frame: &[&[u8]]) -> [u8; TAG_BYTES] {
        let mut h = blake3::Hasher::new_keyed(&self.key);
        h.update(FRAME_DOMAIN);
        h.update(&[self.from as u8]);
        h.update(&self.seq.to_le_bytes());
        for part in frame {
            h.update(part);
        }
        self.seq += 1;
        let mut tag = [0u8; TAG_BYTES];
        tag.copy_from_slice(&h.finalize().as_bytes()[..TAG_BYTES]);
        tag
    }
}

/// Tags the frames one end sends on a connection, in the order they go on the wire.
#[derive(Debug, Clone)]
pub struct Sealer(Tagger);

impl Sealer {
    /// The tag of the next frame sent, made of its parts in order (the frame's bytes are
    /// their concatenation).
    pub fn tag(&mut self, frame: &[&[u8]]) -> [u8; TAG_BYTES] {
        self.0.next(frame)
    }

    /// Tag a frame held in `buf` whose last [`TAG_BYTES`] are its tag's place.
    ///
    /// # Panics
    /// If `buf` is shorter than a tag (a caller's bug: frames are fixed-size or length-framed).
    pub fn seal(&mut self, buf: &mut [u8]) {
        let at = buf.len() - TAG_BYTES;
        let tag = self.0.next(&[&buf[..at]]);
        buf[at..].copy_from_slice(&tag);
    }
}

/// Checks the frames one end receives on a connection, in the order they arrive.
#[derive(Debug, Clone)]
pub struct Unsealer(Tagger);

impl Unsealer {
    /// Check the next frame received against `tag`.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when the tag is wrong: the frame was changed, replayed,
    /// reordered or made without the session's key. The connection is out of step from here
    /// on and must be closed.
    pub fn check(&mut self, frame: &[&[u8]], tag: &[u8]) -> Result<()> {
        let want = self.0.next(frame);
        // constant time: every byte is looked at whatever the first difference
        let diff = want
            .iter()
            .zip(tag.iter())
            .fold(u8::from(tag.len() != TAG_BYTES), |acc, (a, b)| {
                acc | (a ^ b)
            });
        if diff == 0 {
            Ok(())
        } else {
            Err(Error::InvalidArgument(
                "a frame failed its integrity check (changed in flight, replayed, or not \
                 from the authenticated peer); the connection is closed"
                    .into(),
            ))
        }
    }

    /// Check a frame held in `buf` whose last [`TAG_BYTES`] are its tag.
    ///
    /// # Errors
    /// As [`Unsealer::check`]; also for a `buf` shorter than a tag.
    pub fn open(&mut self, buf: &[u8]) -> Result<()> {
        let Some(at) = buf.len().checked_sub(TAG_BYTES) else {
            return Err(Error::InvalidArgument(
                "a frame shorter than its tag".into(),
            ));
        };
        self.check(&[&buf[..at]], &buf[at..])
    }
}

/// Which end of the connection a proof comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Role {
    /// The end that connected.
    Initiator = 1,
    /// The end that accepted.
    Responder = 2,
}

/// 32 fresh random bytes, one per end per connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Nonce(pub [u8; 32]);

impl Nonce {
    /// A fresh nonce from the kernel's random source.
    ///
    /// # Errors
    /// [`Error::Io`] if the kernel gives no randomness.
    pub fn fresh() -> Result<Nonce> {
        let mut n = [0u8; 32];
        let got = rustix::rand::getrandom(&mut n, rustix::rand::GetRandomFlags::empty())
            .map_err(|e| Error::Io(format!("getrandom: {e}")))?;
        if got != n.len() {
            return Err(Error::Io("getrandom returned a short read".into()));
        }
        Ok(Nonce(n))
    }
}

/// The initiator's first message: 33 bytes on the wire (version, nonce).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Hello {
    /// The initiator's nonce.
    pub nonce: Nonce,
}

/// The responder's answer: 64 bytes (its nonce, its proof).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Challenge {
    /// The responder's nonce.
    pub nonce: Nonce,
    /// The responder's proof over both nonces.
    pub proof: [u8; 32],
}

/// The initiator's proof: 32 bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Proof(pub [u8; 32]);

impl Hello {
    /// Bytes on the wire.
    pub const WIRE_BYTES: usize = 33;

    /// The wire form: the version byte, then the nonce.
    pub fn encode(&self) -> [u8; Self::WIRE_BYTES] {
        let mut b = [0u8; Self::WIRE_BYTES];
        b[0] = AUTH_VERSION;
        b[1..].copy_from_slice(&self.nonce.0);
        b
    }

    /// Parse the wire form.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for another version.
    pub fn decode(b: &[u8; Self::WIRE_BYTES]) -> Result<Hello> {
        if b[0] != AUTH_VERSION {
            return Err(Error::InvalidArgument(format!(
                "peer speaks authentication version {}, this node {AUTH_VERSION}",
                b[0]
            )));
        }
        let mut n = [0u8; 32];
        n.copy_from_slice(&b[1..]);
        Ok(Hello { nonce: Nonce(n) })
    }
}

impl Challenge {
    /// Bytes on the wire.
    pub const WIRE_BYTES: usize = 64;

    /// The wire form: the nonce, then the proof.
    pub fn encode(&self) -> [u8; Self::WIRE_BYTES] {
        let mut b = [0u8; Self::WIRE_BYTES];
        b[..32].copy_from_slice(&self.nonce.0);
        b[32..].copy_from_slice(&self.proof);
        b
    }

    /// Parse the wire form (any 64 bytes are a well-formed challenge; the proof decides).
    pub fn decode(b: &[u8; Self::WIRE_BYTES]) -> Challenge {
        let (mut n, mut p) = ([0u8; 32], [0u8; 32]);
        n.copy_from_slice(&b[..32]);
        p.copy_from_slice(&b[32..]);
        Challenge {
            nonce: Nonce(n),
            proof: p,
        }
    }
}

fn refused(who: &str) -> Error {
    Error::InvalidArgument(format!(
        "peer authentication failed: the {who} does not hold this cluster's secret"
    ))
}

/// The responder's side: answer a hello, then check the initiator's proof.
#[derive(Debug)]
pub struct Responder<'a> {
    secret: &'a ClusterSecret,
    initiator: Nonce,
    nonce: Nonce,
}

impl<'a> Responder<'a> {
    /// Answer `hello` with a fresh nonce and this end's proof.
    ///
    /// # Errors
    /// [`Error::Io`] without randomness.
    pub fn answer(secret: &'a ClusterSecret, hello: &Hello) -> Result<(Responder<'a>, Challenge)> {
        Ok(Responder::answer_with(secret, hello, Nonce::fresh()?))
    }

    fn answer_with(
        secret: &'a ClusterSecret,
        hello: &Hello,
        nonce: Nonce,
    ) -> (Responder<'a>, Challenge) {
        let proof = *secret
            .proof(Role::Responder, &hello.nonce, &nonce)
            .as_bytes();
        let r = Responder {
            secret,
            initiator: hello.nonce,
            nonce,
        };
        (r, Challenge { nonce, proof })
    }

    /// Check the initiator's proof; only `Ok` lets the connection do anything, and it
    /// carries the connection's key.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when the initiator does not hold the secret.
    pub fn verify(self, p: &Proof) -> Result<SessionKey> {
        let want = self
            .secret
            .proof(Role::Initiator, &self.initiator, &self.nonce);
        if want == blake3::Hash::from_bytes(p.0) {
            Ok(self.secret.session(&self.initiator, &self.nonce))
        } else {
            Err(refused("initiator"))
        }
    }
}

/// The initiator's side: send a hello, then check the challenge and prove itself.
#[derive(Debug)]
pub struct Initiator<'a> {
    secret: &'a ClusterSecret,
    nonce: Nonce,
}

impl<'a> Initiator<'a> {
    /// Start a handshake with a fresh nonce.
    ///
    /// # Errors
    /// [`Error::Io`] without randomness.
    pub fn start(secret: &'a ClusterSecret) -> Result<(Initiator<'a>, Hello)> {
        let nonce = Nonce::fresh()?;
        Ok((Initiator { secret, nonce }, Hello { nonce }))
    }

    /// Check the responder's proof; if it holds, the proof to send back and the
    /// connection's key.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when the responder does not hold the secret (send nothing,
    /// close the connection).
    pub fn respond(self, c: &Challenge) -> Result<(Proof, SessionKey)> {
        let want = self.secret.proof(Role::Responder, &self.nonce, &c.nonce);
        if want != blake3::Hash::from_bytes(c.proof) {
            return Err(refused("responder"));
        }
        let proof = Proof(
            *self
                .secret
                .proof(Role::Initiator, &self.nonce, &c.nonce)
                .as_bytes(),
        );
        Ok((proof, self.secret.session(&self.nonce, &c.nonce)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn secret(b: u8) -> ClusterSecret {
        ClusterSecret::from_bytes(&[b; 32]).unwrap()
    }

    #[test]
    fn two_ends_with_the_secret_authenticate_each_other() {
        let s = secret(7);
        let (i, hello) = Initiator::start(&s).unwrap();
        let hello = Hello::decode(&hello.encode()).unwrap();
        let (r, challenge) = Responder::answer(&s, &hello).unwrap();
        let challenge = Challenge::decode(&challenge.encode());
        let (proof, key_i) = i.respond(&challenge).unwrap();
        let key_r = r.verify(&proof).unwrap();
        assert_eq!(key_i, key_r, "both ends hold the same connection key");
        assert_eq!(format!("{key_i:?}"), "SessionKey(..)");
    }

    #[test]
    fn an_end_without_the_secret_fails_whichever_side_it_is() {
        let (ours, theirs) = (secret(7), secret(8));
        // A responder without the secret: the initiator refuses its challenge.
        let (i, hello) = Initiator::start(&ours).unwrap();
        let (_, challenge) = Responder::answer(&theirs, &hello).unwrap();
        assert!(i.respond(&challenge).is_err());
        // An initiator without the secret: whatever proof it makes with its own key is refused.
        let (_, hello) = Initiator::start(&theirs).unwrap();
        let (r, challenge) = Responder::answer(&ours, &hello).unwrap();
        let forged = theirs.proof(Role::Initiator, &hello.nonce, &challenge.nonce);
        let e = r.verify(&Proof(*forged.as_bytes())).unwrap_err();
        assert!(e.to_string().contains("does not hold"), "{e}");
    }

    #[test]
    fn a_reflected_or_replayed_proof_is_refused() {
        let s = secret(7);
        let (_, hello) = Initiator::start(&s).unwrap();
        let (r, challenge) = Responder::answer(&s, &hello).unwrap();
        // Reflection: the responder's own proof sent back as the initiator's.
        assert!(r.verify(&Proof(challenge.proof)).is_err());
        // Replay: a valid proof of one connection, presented on the next.
        let (i, hello) = Initiator::start(&s).unwrap();
        let (r1, c1) = Responder::answer(&s, &hello).unwrap();
        let (good, _) = i.respond(&c1).unwrap();
        r1.verify(&good).unwrap();
        let (r2, _) = Responder::answer(&s, &hello).unwrap();
        assert!(
            r2.verify(&good).is_err(),
            "a fresh responder nonce voids the old proof"
        );
    }

    #[test]
    fn the_two_roles_give_different_proofs_and_a_fixed_exchange_verifies() {
        let s = secret(1);
        let hello = Hello {
            nonce: Nonce([2; 32]),
        };
        let (r, c) = Responder::answer_with(&s, &hello, Nonce([3; 32]));
        let i = Initiator {
            secret: &s,
            nonce: hello.nonce,
        };
        let (p, _) = i.respond(&c).unwrap();
        assert_ne!(p.0, c.proof, "the roles give different proofs");
        r.verify(&p).unwrap();
    }

    #[test]
    fn the_secret_file_must_be_private_and_long_enough_and_is_never_shown() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile_dir();
        let f = dir.join("secret");
        std::fs::write(&f, [9u8; 32]).unwrap();
        std::fs::set_permissions(&f, std::fs::Permissions::from_mode(0o644)).unwrap();
        let e = ClusterSecret::from_file(&f).unwrap_err();
        assert!(e.to_string().contains("chmod 600"), "{e}");
        std::fs::set_permissions(&f, std::fs::Permissions::from_mode(0o600)).unwrap();
        let s = ClusterSecret::from_file(&f).unwrap();
        assert_eq!(format!("{s:?}"), "ClusterSecret(..)");
        std::fs::write(&f, [9u8; 8]).unwrap();
        assert!(ClusterSecret::from_file(&f).is_err(), "too short");
        assert!(ClusterSecret::from_file(&dir.join("missing")).is_err());
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn another_handshake_version_is_refused() {
        let mut b = Hello {
            nonce: Nonce([0; 32]),
        }
        .encode();
        b[0] = 9;
        assert!(
            Hello::decode(&b)
                .unwrap_err()
                .to_string()
                .contains("version 9")
        );
    }

    /// A connection's two ends, keyed by a real handshake.
    fn session_pair() -> ((Sealer, Unsealer), (Sealer, Unsealer)) {
        let s = secret(5);
        let (i, hello) = Initiator::start(&s).unwrap();
        let (r, c) = Responder::answer(&s, &hello).unwrap();
        let (p, ki) = i.respond(&c).unwrap();
        let kr = r.verify(&p).unwrap();
        (ki.split(Role::Initiator), kr.split(Role::Responder))
    }

    #[test]
    fn frames_in_order_pass_and_any_change_replay_reorder_or_reflection_fails() {
        let ((mut i_seal, mut i_open), (mut r_seal, mut r_open)) = session_pair();
        // in order, both ways, whole or in parts
        for n in 0..4u8 {
            let mut f = vec![n; 40];
            i_seal.seal(&mut f);
            r_open.open(&f).unwrap();
            let t = r_seal.tag(&[b"head", &[n]]);
            i_open.check(&[b"he", b"ad", &[n]], &t).unwrap();
        }
        // one flipped bit anywhere, the tag included
        for bit in 0..(40 * 8) {
            let ((mut s, _), (_, mut o)) = session_pair();
            let mut f = vec![7u8; 40];
            s.seal(&mut f);
            f[bit / 8] ^= 1 << (bit % 8);
            assert!(o.open(&f).is_err(), "bit {bit} flipped passed");
        }
        // replay: the same frame twice; reorder: the second before the first
        let ((mut s, _), (_, mut o)) = session_pair();
        let (mut a, mut b) = (vec![1u8; 24], vec![2u8; 24]);
        s.seal(&mut a);
        s.seal(&mut b);
        let mut replayed = o.clone();
        replayed.open(&a).unwrap();
        assert!(replayed.open(&a).is_err(), "a replayed frame");
        assert!(o.open(&b).is_err(), "a frame out of order");
        // reflection: a frame sent back to its sender
        let ((mut s, mut back), _) = session_pair();
        let mut f = vec![3u8; 24];
        s.seal(&mut f);
        assert!(back.open(&f).is_err(), "a reflected frame");
        // another connection's frame, in its place
        let ((mut s1, _), _) = session_pair();
        let (_, (_, mut o2)) = session_pair();
        let mut f = vec![4u8; 24];
        s1.seal(&mut f);
        assert!(o2.open(&f).is_err(), "a frame from another connection");
        assert!(o2.open(&[0u8; 3]).is_err(), "shorter than a tag");
    }

    fn tempfile_dir() -> std::path::PathBuf {
        let d = std::env::temp_dir().join(format!(
            "kvd-auth-test-{}-{:?}",
            std::process::id(),
            std::thread::current().id()
        ));
        std::fs::create_dir_all(&d).unwrap();
        d
    }
}
