//! The data directory: the node generation, persisted and increased at every start, and a lock
//! so that two daemons never share one directory (they would hand out the same generation).
//!
//! The new generation is written to `generation.tmp`, fsynced, renamed over `generation`, and the
//! directory fsynced: a crash at any point leaves either the old or the new number, never a torn
//! one, and a generation once handed out is never handed out again.

use std::fs::{File, OpenOptions};
use std::io::Write;
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use crate::{Error, Result};

/// An open, locked data directory.
#[derive(Debug)]
pub struct DataDir {
    path: PathBuf,
    /// Holds the exclusive lock while the daemon runs.
    _lock: File,
    generation: u64,
}

impl DataDir {
    /// Open (creating it 0700 if needed) and lock `path`, then increase and persist the node
    /// generation.
    ///
    /// # Errors
    /// [`Error::Unavailable`] if another daemon holds the directory; [`Error::Io`] for file
    /// system errors; [`Error::InvalidArgument`] for a corrupt generation file.
    pub fn open(path: &Path) -> Result<DataDir> {
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(path)
            .map_err(|e| Error::Io(format!("creating data dir {}: {e}", path.display())))?;
        let lock = OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .mode(0o600)
            .open(path.join("lock"))
            .map_err(|e| Error::Io(format!("opening {}/lock: {e}", path.display())))?;
        rustix::fs::flock(&lock, rustix::fs::FlockOperation::NonBlockingLockExclusive).map_err(
            |_| {
                Error::Unavailable(format!(
                    "another kvd holds the data dir {}; give each daemon its own",
                    path.display()
                ))
            },
        )?;
        let file = path.join("generation");
        let previous = match std::fs::read_to_string(&file) {
            Ok(s) => s.trim().parse::<u64>().map_err(|_| {
                Error::InvalidArgument(format!(
                    "{} does not hold a generation number ({s:?}); fix or remove it",
                    file.display()
                ))
            })?,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => 0,
            Err(e) => return Err(Error::Io(format!("reading {}: {e}", file.display()))),
        };
        let generation = previous
            .checked_add(1)
            .ok_or_else(|| Error::InvalidArgument("node generation overflow".into()))?;
        persist(path, &file, generation)?;
        Ok(DataDir {
            path: path.to_owned(),
            _lock: lock,
            generation,
        })
    }

    /// This start's node generation (or the latest [`DataDir::advance`] gave).
    pub fn generation(&self) -> u64 {
        self.generation
    }

    /// Hand out (and persist) the next generation without a restart: cluster mode's
    /// re-registration after a lost lease, so that nothing of the old lease's work can be
    /// taken for the new one's. A number once handed out is never handed out again.
    ///
    /// # Errors
    /// [`Error::Io`] when it cannot be persisted (the generation is then unchanged).
    pub fn advance(&mut self) -> Result<u64> {
        let next = self
            .generation
            .checked_add(1)
            .ok_or_else(|| Error::InvalidArgument("node generation overflow".into()))?;
        persist(&self.path, &self.path.join("generation"), next)?;
        self.generation = next;
        Ok(next)
    }

    /// The directory.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

fn persist(dir: &Path, file: &Path, generation: u64) -> Result<()> {
    let io = |what: &str, e: std::io::Error| Error::Io(format!("{what} in {}: {e}", dir.display()));
    let tmp = dir.join("generation.tmp");
    let mut f = OpenOptions::new()
        .create(true)
        .truncate(true)
        .write(true)
        .mode(0o600)
        .open(&tmp)
        .map_err(|e| io("creating generation.tmp", e))?;
    writeln!(f, "{generation}").map_err(|e| io("writing generation.tmp", e))?;
    f.sync_all().map_err(|e| io("fsync of generation.tmp", e))?;
    std::fs::rename(&tmp, file).map_err(|e| io("renaming generation.tmp", e))?;
    File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(|e| io("fsync of the directory", e))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_generation_increases_at_every_open() {
        let d = tempfile::tempdir().unwrap();
        let g1 = DataDir::open(d.path()).unwrap().generation();
        let g2 = DataDir::open(d.path()).unwrap().generation();
        assert_eq!(g1, 1);
        assert_eq!(g2, 2);
    }

    #[test]
    fn two_daemons_cannot_share_a_data_dir() {
        let d = tempfile::tempdir().unwrap();
        let _held = DataDir::open(d.path()).unwrap();
        let e = DataDir::open(d.path()).unwrap_err();
        assert!(matches!(e, Error::Unavailable(_)), "{e}");
    }

    #[test]
    fn a_corrupt_generation_file_is_refused_not_reset() {
        let d = tempfile::tempdir().unwrap();
        std::fs::write(d.path().join("generation"), "garbage").unwrap();
        assert!(matches!(
            DataDir::open(d.path()).unwrap_err(),
            Error::InvalidArgument(_)
        ));
    }
}
