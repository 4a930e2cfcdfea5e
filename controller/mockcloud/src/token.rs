//! The bearer token of `tokenFile`, read again when it changes, so that a rotated token
//! needs no restart. Kubernetes updates a mounted Secret by swapping a `..data` symlink
//! (the file gets another inode), so the file is read by its path, each time.
//!
//! The provider is built off the async runtime and has no shutdown of its own, so no
//! task polls the file: the calls look at it, at most once per [`LOOK_INTERVAL`], and at
//! once after the edge refused the token.

use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::{Mutex, PoisonError};
use std::time::{Duration, Instant};

use crate::config::ConfigError;

/// How stale the token a call sends may be, at the most, when the edge still takes it.
pub const LOOK_INTERVAL: Duration = Duration::from_secs(1);

/// The bearer token in `path`, trimmed: the one reader of token files.
pub fn read(path: &Path) -> Result<String, ConfigError> {
    let shown = path.display().to_string();
    let token = std::fs::read_to_string(path)
        .map_err(|source| ConfigError::File {
            what: "token file",
            path: shown.clone(),
            source,
        })?
        .trim()
        .to_owned();
    if token.is_empty() {
        return Err(ConfigError::EmptyToken(shown));
    }
    Ok(token)
}

/// A token file and what was last read from it.
pub struct TokenFile {
    path: PathBuf,
    seen: Mutex<Seen>,
}

struct Seen {
    read_at: Instant,
    token: String,
    /// Whether the last read failed, so that a file that stays broken is logged once.
    failing: bool,
}

impl fmt::Debug for TokenFile {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TokenFile")
            .field("path", &self.path)
            .finish_non_exhaustive()
    }
}

impl TokenFile {
    /// The file and the token it holds now; unreadable or empty, it is an error here (at
    /// the start there is no token to keep).
    pub fn open(path: &Path) -> Result<(Self, String), ConfigError> {
        let token = read(path)?;
        let file = Self {
            path: path.to_owned(),
            seen: Mutex::new(Seen {
                read_at: Instant::now(),
                token: token.clone(),
                failing: false,
            }),
        };
        Ok((file, token))
    }

    /// The token in the file, when it is another than the one read last. The file is read
    /// if the last read is [`LOOK_INTERVAL`] old, or at once with `now`. An unreadable or
    /// empty file (a Secret being replaced, a half-written file) keeps the token read
    /// last, with a warning.
    pub(crate) async fn changed(&self, now: bool) -> Option<String> {
        {
            let mut seen = self.lock();
            if !now && seen.read_at.elapsed() < LOOK_INTERVAL {
                return None;
            }
            seen.read_at = Instant::now();
        }
        let path = self.path.clone();
        let read = match tokio::task::spawn_blocking(move || read(&path)).await {
            Ok(read) => read,
            Err(error) => {
                tracing::error!(%error, "reading the token file failed");
                return None;
            }
        };
        let mut seen = self.lock();
        match read {
            Ok(token) => {
                if seen.failing {
                    tracing::info!(path = %self.path.display(), "token file readable again");
                }
                seen.failing = false;
                (token != seen.token).then(|| {
                    seen.token.clone_from(&token);
                    token
                })
            }
            Err(error) => {
                if !seen.failing {
                    tracing::warn!(%error, "token file refused: calls keep the token read last");
                }
                seen.failing = true;
                None
            }
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Seen> {
        self.seen.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A directory removed on drop.
    struct TempDir(PathBuf);

    impl TempDir {
        fn new(label: &str) -> Self {
            let path =
                std::env::temp_dir().join(format!("tdm-mockcloud-{label}-{}", std::process::id()));
            std::fs::create_dir_all(&path).unwrap();
            Self(path)
        }
    }

    impl Drop for TempDir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    #[test]
    fn token_is_read_and_trimmed() {
        let dir = TempDir::new("read");
        let file = dir.0.join("token");
        std::fs::write(&file, "secret\n").unwrap();
        assert_eq!(read(&file).unwrap(), "secret");
        std::fs::write(&file, " \n").unwrap();
        assert!(matches!(read(&file), Err(ConfigError::EmptyToken(_))));
        std::fs::remove_file(&file).unwrap();
        assert!(matches!(read(&file), Err(ConfigError::File { .. })));
        assert!(TokenFile::open(&file).is_err());
    }

    /// Writes `token` as the kubelet updates a Secret volume: a new directory, and the
    /// `..data` symlink that `token` goes through swapped to it by a rename.
    fn kubelet_write(dir: &Path, generation: u32, token: &str) {
        let data = dir.join(format!("..{generation}"));
        std::fs::create_dir_all(&data).unwrap();
        std::fs::write(data.join("token"), token).unwrap();
        let next = dir.join("..data_tmp");
        std::os::unix::fs::symlink(&data, &next).unwrap();
        std::fs::rename(&next, dir.join("..data")).unwrap();
        let link = dir.join("token");
        if std::fs::symlink_metadata(&link).is_err() {
            std::os::unix::fs::symlink("..data/token", &link).unwrap();
        }
    }

    #[tokio::test]
    async fn a_swapped_secret_is_read_by_its_path() {
        let dir = TempDir::new("swap");
        kubelet_write(&dir.0, 1, "first\n");
        let (file, token) = TokenFile::open(&dir.0.join("token")).unwrap();
        assert_eq!(token, "first");
        assert_eq!(file.changed(true).await, None, "unchanged");
        kubelet_write(&dir.0, 2, "second\n");
        assert_eq!(
            file.changed(false).await,
            None,
            "read less than a second ago"
        );
        assert_eq!(file.changed(true).await.as_deref(), Some("second"));
        assert_eq!(file.changed(true).await, None, "taken once");
        kubelet_write(&dir.0, 3, "");
        assert_eq!(
            file.changed(true).await,
            None,
            "an empty file keeps the token"
        );
        std::fs::remove_file(dir.0.join("token")).unwrap();
        assert_eq!(file.changed(true).await, None, "so does a missing one");
        kubelet_write(&dir.0, 4, "third");
        assert_eq!(file.changed(true).await.as_deref(), Some("third"));
    }
}
