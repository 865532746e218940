//! Peer authentication: a connection between two nodes proves, both ways, that each end holds
//! the cluster secret, without the secret (or anything a listener could replay) crossing the
//! wire, and agrees on a key of the connection's own that nobody else can compute, the holders
//! of the secret included.
//!
//! ```text
//! initiator                                   responder
//!   Hello { version, initiator nonce, initiator ephemeral } ──▶
//!          ◀── Challenge { responder nonce, responder ephemeral, responder proof }
//!   verify responder proof
//!   Proof { initiator proof } ────────────────▶  verify initiator proof
//! ```
//!
//! `proof(role) = blake3::keyed_hash(key, "kvd peer auth v2" ‖ role ‖ exchange)` with `key =
//! blake3::derive_key("kvd cluster secret v1", secret file)` and `exchange` the four public
//! values in order (both nonces, both ephemeral X25519 keys). Both nonces and both ephemeral
//! keys are fresh on every connection, so no proof from another connection is ever valid again
//! (replay); the role byte differs, so a responder's proof sent back as the initiator's fails
//! (reflection). Proofs are compared in constant time (`blake3::Hash`'s equality). The keyed
//! hash is blake3's own keyed mode, not a construction of ours. An unauthenticated connection
//! can do nothing but fail this handshake.
//!
//! The handshake also gives both ends a key of the connection's own ([`SessionKey`]):
//!
//! ```text
//! session key = blake3::keyed_hash(key, "kvd session key v2" ‖ exchange ‖ X25519(ephemerals))
//! ```
//!
//! The X25519 agreement (`ring`) makes it a key only the two ends know: an insider who holds
//! the cluster secret and watches or relays the connection cannot compute it, so it cannot tag
//! frames as either end (which [`crate::link::identity`]'s signatures over the
//! [`Session::transcript`] then tie to the two nodes). Every frame after the proofs carries a
//! tag over it ([`Sealer`], [`Unsealer`]):
//!
//! ```text
//! tag = blake3::keyed_hash(session key, "kvd frame v1" ‖ direction ‖ sequence ‖ frame)[..16]
//! ```
//!
//! The direction byte (initiator → responder or back) stops a frame reflected to its sender;
//! the sequence number (a count per direction, never sent) stops a frame replayed, dropped or
//! reordered within the connection; the session key stops one moved from another connection.
//! A frame whose tag is wrong closes its connection: a network that flips bits or an on-path
//! attacker without the session key can cut a connection, never change what it says.
//!
//! Payloads are not framed: they carry a CRC-32C, and, where the payload MAC is on, a
//! [`PayloadKey`] MAC (`blake3::keyed_hash(derive_key("kvd payload mac v1", session key),
//! payload)[..16]`) in their tagged header, checked after the bytes land.

use std::path::Path;

use ring::agreement::{EphemeralPrivateKey, UnparsedPublicKey, X25519, agree_ephemeral};

use crate::error::{Error, Result};

/// The version of this handshake (the first byte of [`Hello`]; 2: ephemeral key agreement).
pub const AUTH_VERSION: u8 = 2;
/// Bytes a secret file holds at least.
pub const MIN_SECRET_BYTES: usize = 32;
/// Bytes a secret file holds at most (the file is read whole).
pub const MAX_SECRET_BYTES: usize = 4096;

const KEY_CONTEXT: &str = "kvd cluster secret v1";
const PROOF_DOMAIN: &[u8] = b"kvd peer auth v2";
const SESSION_DOMAIN: &[u8] = b"kvd session key v2";
const TRANSCRIPT_DOMAIN: &[u8] = b"kvd transcript v2";
const FRAME_DOMAIN: &[u8] = b"kvd frame v1";
const PAYLOAD_CONTEXT: &str = "kvd payload mac v1";

/// Bytes of the tag every frame after the handshake carries.
pub const TAG_BYTES: usize = 16;

/// Bytes of a payload's MAC.
pub const MAC_BYTES: usize = 16;

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

/// The public values of one handshake, in the order they were sent.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Exchange {
    initiator: Nonce,
    initiator_ephemeral: [u8; 32],
    responder: Nonce,
    responder_ephemeral: [u8; 32],
}

impl Exchange {
    fn parts(&self) -> [&[u8]; 4] {
        [
            &self.initiator.0,
            &self.initiator_ephemeral,
            &self.responder.0,
            &self.responder_ephemeral,
        ]
    }

    /// What identity signatures cover: a hash of every public value of the handshake.
    fn transcript(&self) -> [u8; 32] {
        let mut h = blake3::Hasher::new();
        h.update(TRANSCRIPT_DOMAIN);
        for p in self.parts() {
            h.update(p);
        }
        *h.finalize().as_bytes()
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

    fn proof(&self, role: Role, x: &Exchange) -> blake3::Hash {
        let mut h = blake3::Hasher::new_keyed(&self.key);
        h.update(PROOF_DOMAIN);
        h.update(&[role as u8]);
        for p in x.parts() {
            h.update(p);
        }
        h.finalize()
    }

    fn session(&self, x: &Exchange, agreed: &[u8]) -> Session {
        let mut h = blake3::Hasher::new_keyed(&self.key);
        h.update(SESSION_DOMAIN);
        for p in x.parts() {
            h.update(p);
        }
        h.update(agreed);
        Session {
            key: SessionKey(*h.finalize().as_bytes()),
            transcript: x.transcript(),
        }
    }
}

/// A fresh ephemeral X25519 key and its public half.
fn ephemeral() -> Result<(EphemeralPrivateKey, [u8; 32])> {
    let rng = ring::rand::SystemRandom::new();
    let private = EphemeralPrivateKey::generate(&X25519, &rng)
        .map_err(|_| Error::Io("no randomness for an ephemeral key".into()))?;
    let public = private
        .compute_public_key()
        .map_err(|_| Error::Io("an ephemeral key's public half".into()))?;
    let mut p = [0u8; 32];
    p.copy_from_slice(public.as_ref());
    Ok((private, p))
}

/// The X25519 agreement of `mine` with the peer's `theirs`, then the session.
fn agree(
    secret: &ClusterSecret,
    mine: EphemeralPrivateKey,
    theirs: &[u8; 32],
    x: &Exchange,
    who: &str,
) -> Result<Session> {
    agree_ephemeral(mine, &UnparsedPublicKey::new(&X25519, theirs), |agreed| {
        secret.session(x, agreed)
    })
    .map_err(|_| {
        Error::InvalidArgument(format!(
            "peer authentication failed: the {who}'s ephemeral key is not a valid X25519 key"
        ))
    })
}

/// What a finished handshake gives both ends: the connection's key, and the hash of its public
/// values that identity signatures cover.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Session {
    /// The connection's key.
    pub key: SessionKey,
    /// The handshake's transcript hash (both nonces, both ephemeral keys).
    pub transcript: [u8; 32],
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

    /// The key of this connection's payload MACs (derived from the session key, so it is the
    /// connection's own, never the cluster secret's).
    pub fn payload_key(&self) -> PayloadKey {
        PayloadKey(blake3::derive_key(PAYLOAD_CONTEXT, &self.0))
    }
}

/// The key of one connection's payload MACs. Its `Debug` shows nothing of it.
#[derive(Clone, PartialEq, Eq)]
pub struct PayloadKey([u8; 32]);

impl std::fmt::Debug for PayloadKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("PayloadKey(..)")
    }
}

impl PayloadKey {
    /// The MAC of `payload`: blake3's keyed hash, truncated to [`MAC_BYTES`].
    pub fn mac(&self, payload: &[u8]) -> [u8; MAC_BYTES] {
        let mut m = [0u8; MAC_BYTES];
        m.copy_from_slice(&blake3::keyed_hash(&self.0, payload).as_bytes()[..MAC_BYTES]);
        m
    }

    /// Whether `mac` is `payload`'s (compared in constant time).
    pub fn check(&self, payload: &[u8], mac: &[u8; MAC_BYTES]) -> bool {
        let want = self.mac(payload);
        want.iter().zip(mac).fold(0u8, |acc, (a, b)| acc | (a ^ b)) == 0
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

/// The initiator's first message: 65 bytes on the wire (version, nonce, ephemeral key).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Hello {
    /// The initiator's nonce.
    pub nonce: Nonce,
    /// The initiator's ephemeral X25519 public key.
    pub ephemeral: [u8; 32],
}

/// The responder's answer: 96 bytes (its nonce, its ephemeral key, its proof).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Challenge {
    /// The responder's nonce.
    pub nonce: Nonce,
    /// The responder's ephemeral X25519 public key.
    pub ephemeral: [u8; 32],
    /// The responder's proof over the exchange.
    pub proof: [u8; 32],
}

/// The initiator's proof: 32 bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Proof(pub [u8; 32]);

impl Hello {
    /// Bytes on the wire.
    pub const WIRE_BYTES: usize = 65;

    /// The wire form: the version byte, the nonce, the ephemeral key.
    pub fn encode(&self) -> [u8; Self::WIRE_BYTES] {
        let mut b = [0u8; Self::WIRE_BYTES];
        b[0] = AUTH_VERSION;
        b[1..33].copy_from_slice(&self.nonce.0);
        b[33..].copy_from_slice(&self.ephemeral);
        b
    }

    /// Parse the wire form.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for another version.
    pub fn decode(b: &[u8; Self::WIRE_BYTES]) -> Result<Hello> {
        if b[0] != AUTH_VERSION {
            return Err(Error::InvalidArgument(format!(
                "peer speaks authentication version {}, this node {AUTH_VERSION} (every node \
                 of a cluster runs the same handshake: upgrade them together)",
                b[0]
            )));
        }
        let (mut n, mut e) = ([0u8; 32], [0u8; 32]);
        n.copy_from_slice(&b[1..33]);
        e.copy_from_slice(&b[33..]);
        Ok(Hello {
            nonce: Nonce(n),
            ephemeral: e,
        })
    }
}

impl Challenge {
    /// Bytes on the wire.
    pub const WIRE_BYTES: usize = 96;

    /// The wire form: the nonce, the ephemeral key, the proof.
    pub fn encode(&self) -> [u8; Self::WIRE_BYTES] {
        let mut b = [0u8; Self::WIRE_BYTES];
        b[..32].copy_from_slice(&self.nonce.0);
        b[32..64].copy_from_slice(&self.ephemeral);
        b[64..].copy_from_slice(&self.proof);
        b
    }

    /// Parse the wire form (any 96 bytes are a well-formed challenge; the proof decides).
    pub fn decode(b: &[u8; Self::WIRE_BYTES]) -> Challenge {
        let (mut n, mut e, mut p) = ([0u8; 32], [0u8; 32], [0u8; 32]);
        n.copy_from_slice(&b[..32]);
        e.copy_from_slice(&b[32..64]);
        p.copy_from_slice(&b[64..]);
        Challenge {
            nonce: Nonce(n),
            ephemeral: e,
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
    exchange: Exchange,
    ephemeral: EphemeralPrivateKey,
}

impl<'a> Responder<'a> {
    /// Answer `hello` with a fresh nonce, a fresh ephemeral key and this end's proof.
    ///
    /// # Errors
    /// [`Error::Io`] without randomness.
    pub fn answer(secret: &'a ClusterSecret, hello: &Hello) -> Result<(Responder<'a>, Challenge)> {
        let nonce = Nonce::fresh()?;
        let (ephemeral, public) = ephemeral()?;
        let exchange = Exchange {
            initiator: hello.nonce,
            initiator_ephemeral: hello.ephemeral,
            responder: nonce,
            responder_ephemeral: public,
        };
        let proof = *secret.proof(Role::Responder, &exchange).as_bytes();
        let r = Responder {
            secret,
            exchange,
            ephemeral,
        };
        Ok((
            r,
            Challenge {
                nonce,
                ephemeral: public,
                proof,
            },
        ))
    }

    /// Check the initiator's proof; only `Ok` lets the connection do anything, and it
    /// carries the connection's session.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when the initiator does not hold the secret, or sent no valid
    /// ephemeral key.
    pub fn verify(self, p: &Proof) -> Result<Session> {
        let want = self.secret.proof(Role::Initiator, &self.exchange);
        if want != blake3::Hash::from_bytes(p.0) {
            return Err(refused("initiator"));
        }
        let theirs = self.exchange.initiator_ephemeral;
        agree(
            self.secret,
            self.ephemeral,
            &theirs,
            &self.exchange,
            "initiator",
        )
    }
}

/// The initiator's side: send a hello, then check the challenge and prove itself.
#[derive(Debug)]
pub struct Initiator<'a> {
    secret: &'a ClusterSecret,
    nonce: Nonce,
    ephemeral: EphemeralPrivateKey,
    public: [u8; 32],
}

impl<'a> Initiator<'a> {
    /// Start a handshake with a fresh nonce and ephemeral key.
    ///
    /// # Errors
    /// [`Error::Io`] without randomness.
    pub fn start(secret: &'a ClusterSecret) -> Result<(Initiator<'a>, Hello)> {
        let nonce = Nonce::fresh()?;
        let (ephemeral, public) = ephemeral()?;
        Ok((
            Initiator {
                secret,
                nonce,
                ephemeral,
                public,
            },
            Hello {
                nonce,
                ephemeral: public,
            },
        ))
    }

    /// Check the responder's proof; if it holds, the proof to send back and the
    /// connection's session.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when the responder does not hold the secret or sent no valid
    /// ephemeral key (send nothing, close the connection).
    pub fn respond(self, c: &Challenge) -> Result<(Proof, Session)> {
        let exchange = Exchange {
            initiator: self.nonce,
            initiator_ephemeral: self.public,
            responder: c.nonce,
            responder_ephemeral: c.ephemeral,
        };
        let want = self.secret.proof(Role::Responder, &exchange);
        if want != blake3::Hash::from_bytes(c.proof) {
            return Err(refused("responder"));
        }
        let proof = Proof(*self.secret.proof(Role::Initiator, &exchange).as_bytes());
        let session = agree(
            self.secret,
            self.ephemeral,
            &c.ephemeral,
            &exchange,
            "responder",
        )?;
        Ok((proof, session))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn secret(b: u8) -> ClusterSecret {
        ClusterSecret::from_bytes(&[b; 32]).unwrap()
    }

    /// One handshake between `i` and `r` (secrets), run to the end: both ends' sessions.
    fn handshake(i: &ClusterSecret, r: &ClusterSecret) -> Result<(Session, Session)> {
        let (me, hello) = Initiator::start(i)?;
        let hello = Hello::decode(&hello.encode())?;
        let (them, challenge) = Responder::answer(r, &hello)?;
        let challenge = Challenge::decode(&challenge.encode());
        let (proof, si) = me.respond(&challenge)?;
        let sr = them.verify(&proof)?;
        Ok((si, sr))
    }

    #[test]
    fn two_ends_with_the_secret_authenticate_each_other() {
        let s = secret(7);
        let (si, sr) = handshake(&s, &s).unwrap();
        assert_eq!(si, sr, "both ends hold the same key and transcript");
        assert_eq!(format!("{:?}", si.key), "SessionKey(..)");
        let (again, _) = handshake(&s, &s).unwrap();
        assert_ne!(again.key, si.key, "every connection has a key of its own");
        assert_ne!(again.transcript, si.transcript);
    }

    #[test]
    fn an_end_without_the_secret_fails_whichever_side_it_is() {
        let (ours, theirs) = (secret(7), secret(8));
        // A responder without the secret: the initiator refuses its challenge.
        let (i, hello) = Initiator::start(&ours).unwrap();
        let (_, challenge) = Responder::answer(&theirs, &hello).unwrap();
        assert!(i.respond(&challenge).is_err());
        // An initiator without the secret: whatever proof it makes with its own key is refused.
        let (i, hello) = Initiator::start(&theirs).unwrap();
        let (r, challenge) = Responder::answer(&ours, &hello).unwrap();
        let e = i.respond(&challenge).unwrap_err();
        assert!(e.to_string().contains("does not hold"), "{e}");
        let x = Exchange {
            initiator: hello.nonce,
            initiator_ephemeral: hello.ephemeral,
            responder: challenge.nonce,
            responder_ephemeral: challenge.ephemeral,
        };
        let forged = theirs.proof(Role::Initiator, &x);
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
            "a fresh responder nonce and key void the old proof"
        );
    }

    #[test]
    fn an_insider_relaying_the_exchange_cannot_compute_the_session_key() {
        // An insider holding the secret sees every public value of a handshake and could
        // forge its proofs, but the session key needs one of the two ephemeral private keys.
        let s = secret(7);
        let (i, hello) = Initiator::start(&s).unwrap();
        let (r, c) = Responder::answer(&s, &hello).unwrap();
        let (p, si) = i.respond(&c).unwrap();
        let sr = r.verify(&p).unwrap();
        assert_eq!(si.key, sr.key);
        let x = Exchange {
            initiator: hello.nonce,
            initiator_ephemeral: hello.ephemeral,
            responder: c.nonce,
            responder_ephemeral: c.ephemeral,
        };
        // its best guesses: the key without the agreement, or with an agreement of its own
        assert_ne!(s.session(&x, &[]).key, si.key);
        let (mine, _) = ephemeral().unwrap();
        let guess = agree(&s, mine, &hello.ephemeral, &x, "test").unwrap();
        assert_ne!(guess.key, si.key);
        assert_eq!(guess.transcript, si.transcript, "the transcript is public");
    }

    #[test]
    fn a_bad_ephemeral_key_fails_the_handshake() {
        let s = secret(7);
        let (_, mut hello) = Initiator::start(&s).unwrap();
        // an all-zero X25519 key agrees on the all-zero secret, which ring refuses
        hello.ephemeral = [0; 32];
        let (r, c2) = Responder::answer(&s, &hello).unwrap();
        let x = Exchange {
            initiator: hello.nonce,
            initiator_ephemeral: hello.ephemeral,
            responder: c2.nonce,
            responder_ephemeral: c2.ephemeral,
        };
        let proof = Proof(*s.proof(Role::Initiator, &x).as_bytes());
        let e = r.verify(&proof).unwrap_err();
        assert!(e.to_string().contains("ephemeral"), "{e}");
    }

    #[test]
    fn a_payload_mac_is_the_connections_own_and_catches_any_change() {
        let s = secret(2);
        let (a, b) = handshake(&s, &s).unwrap();
        let (other, _) = handshake(&s, &s).unwrap();
        let (ka, kb) = (a.key.payload_key(), b.key.payload_key());
        let payload = vec![5u8; 4096];
        let mac = ka.mac(&payload);
        assert!(kb.check(&payload, &mac), "both ends agree");
        assert!(
            !other.key.payload_key().check(&payload, &mac),
            "another connection's key"
        );
        for at in [0, 1, 2047, 4095] {
            let mut changed = payload.clone();
            changed[at] ^= 0x10;
            assert!(!kb.check(&changed, &mac), "a byte changed at {at}");
        }
        assert_eq!(format!("{ka:?}"), "PayloadKey(..)");
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
            ephemeral: [0; 32],
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
        let (i, r) = handshake(&s, &s).unwrap();
        (i.key.split(Role::Initiator), r.key.split(Role::Responder))
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
