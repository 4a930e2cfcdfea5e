//! The bearer tokens the API accepts: `--token`, or the lines of `--token-file`, which the
//! edge re-reads while it runs, so that a rotation needs no restart: add the new token,
//! roll the clients, remove the old one.
//!
//! Tokens are kept as SHA-256 hashes only (the file may hold nothing else), and a given
//! token is compared with each of them in constant time. The request path borrows the
//! current set from a `watch` channel (a shared read, no lock of its own).

use std::fmt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use sha2::{Digest, Sha256};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use crate::metrics::{Metrics, TokenFileReload};

/// How often the token file is read again. By path: a Kubernetes Secret volume or an
/// `mv` over the file replaces its inode, which a watch on one inode would miss.
const POLL: Duration = Duration::from_secs(1);

/// How long a changed content must hold still before it is taken: a writer that truncates
/// and then writes is now and then read half-way.
const SETTLE: Duration = Duration::from_millis(100);

/// The prefix of a line that holds a token's hash instead of the token.
const HASH_PREFIX: &str = "sha256:";

/// Where the tokens come from.
#[derive(Clone, PartialEq, Eq)]
pub enum TokenSource {
    /// One token, for the edge's whole life (`--token`).
    Token(String),
    /// A file of tokens or their hashes, one a line, re-read while the edge runs
    /// (`--token-file`).
    File(PathBuf),
}

impl From<&str> for TokenSource {
    fn from(token: &str) -> Self {
        Self::Token(token.to_owned())
    }
}

impl fmt::Debug for TokenSource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Token(_) => f.write_str("Token(<redacted>)"),
            Self::File(path) => f.debug_tuple("File").field(path).finish(),
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum CredentialsError {
    #[error("token file {path}: {source}")]
    Unreadable {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("token file {path} holds no token")]
    Empty { path: PathBuf },
    #[error("token file {path}, line {line}: {reason}")]
    Invalid {
        path: PathBuf,
        line: usize,
        reason: LineError,
    },
}

impl CredentialsError {
    /// The bounded metric label of a refused file.
    fn reload(&self) -> TokenFileReload {
        match self {
            Self::Unreadable { .. } => TokenFileReload::Unreadable,
            Self::Empty { .. } => TokenFileReload::Empty,
            Self::Invalid { .. } => TokenFileReload::Invalid,
        }
    }
}

/// Why a line of a token file is no credential.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum LineError {
    #[error("`sha256:` must be followed by 64 hex digits")]
    BadHash,
    /// A bearer token is one word of visible characters (RFC 6750's b64token is narrower).
    #[error("a token may not contain white space or control characters")]
    BadToken,
}

/// The SHA-256 of a token.
#[derive(Clone, Copy, PartialEq, Eq)]
struct TokenHash([u8; 32]);

impl TokenHash {
    fn of(token: &str) -> Self {
        Self(Sha256::digest(token.as_bytes()).into())
    }

    /// A line of a token file: `sha256:<64 hex>`, or a token.
    fn from_line(line: &str) -> Result<Self, LineError> {
        if let Some(hex) = line.strip_prefix(HASH_PREFIX) {
            let bytes = data_encoding::HEXLOWER_PERMISSIVE
                .decode(hex.as_bytes())
                .map_err(|_| LineError::BadHash)?;
            return bytes.try_into().map(Self).map_err(|_| LineError::BadHash);
        }
        if line.chars().any(|c| c.is_whitespace() || c.is_control()) {
            return Err(LineError::BadToken);
        }
        Ok(Self::of(line))
    }
}

/// Compares in time independent of where the first difference is.
fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// The tokens accepted at one time: never empty when built from a file.
#[derive(Clone, PartialEq, Eq)]
pub struct TokenSet(Vec<TokenHash>);

impl TokenSet {
    pub fn single(token: &str) -> Self {
        Self(vec![TokenHash::of(token)])
    }

    /// The credentials of a token file's text: one a line, blank lines and lines starting
    /// with `#` left out. `path` is for the errors.
    pub fn parse(text: &str, path: &Path) -> Result<Self, CredentialsError> {
        let mut hashes = Vec::new();
        for (index, line) in text.lines().enumerate() {
            let line = line.trim();
            if line.is_empty() || line.starts_with('#') {
                continue;
            }
            let hash = TokenHash::from_line(line).map_err(|reason| CredentialsError::Invalid {
                path: path.to_owned(),
                line: index + 1,
                reason,
            })?;
            if !hashes.contains(&hash) {
                hashes.push(hash);
            }
        }
        if hashes.is_empty() {
            return Err(CredentialsError::Empty {
                path: path.to_owned(),
            });
        }
        Ok(Self(hashes))
    }

    /// Whether `given` is one of the tokens. Every hash is compared, so the time does not
    /// tell which one matched.
    pub fn accepts(&self, given: &str) -> bool {
        let given = TokenHash::of(given);
        self.0.iter().fold(false, |found, hash| {
            found | constant_time_eq(&hash.0, &given.0)
        })
    }

    pub fn count(&self) -> usize {
        self.0.len()
    }
}

/// The tokens the API accepts now; clones see every change.
#[derive(Clone)]
pub struct Credentials(watch::Receiver<TokenSet>);

impl Credentials {
    /// The credentials of `source` and, for a file, the task that re-reads it (run it with
    /// [`TokenFileWatch::run`]). A file that cannot be read, or holds no valid token, is an
    /// error here: at the start there is no last good set to keep.
    pub async fn load(
        source: &TokenSource,
        metrics: &Metrics,
    ) -> Result<(Self, Option<TokenFileWatch>), CredentialsError> {
        let (set, watch) = match source {
            TokenSource::Token(token) => (TokenSet::single(token), None),
            TokenSource::File(path) => {
                let look = Look::at(path).await;
                let set = look.credentials(path)?;
                (set, Some((path.clone(), look)))
            }
        };
        metrics.set_tokens(set.count());
        let (sender, receiver) = watch::channel(set);
        let watch = watch.map(|(path, last)| TokenFileWatch {
            path,
            last,
            sender,
            metrics: metrics.clone(),
        });
        Ok((Self(receiver), watch))
    }

    /// The tokens now; a change waits while this is held, so drop it soon.
    pub fn current(&self) -> watch::Ref<'_, TokenSet> {
        self.0.borrow()
    }
}

/// What one read of the token file found.
#[derive(Debug, PartialEq, Eq)]
enum Look {
    Text(String),
    Unreadable(std::io::ErrorKind),
}

impl Look {
    async fn at(path: &Path) -> Self {
        match tokio::fs::read_to_string(path).await {
            Ok(text) => Self::Text(text),
            Err(error) => Self::Unreadable(error.kind()),
        }
    }

    fn credentials(&self, path: &Path) -> Result<TokenSet, CredentialsError> {
        match self {
            Self::Text(text) => TokenSet::parse(text, path),
            Self::Unreadable(kind) => Err(CredentialsError::Unreadable {
                path: path.to_owned(),
                source: (*kind).into(),
            }),
        }
    }
}

/// Re-reads the token file and hands every valid change to the API.
pub struct TokenFileWatch {
    path: PathBuf,
    /// The last content taken (valid or not), so that a file that stays broken is
    /// reported once.
    last: Look,
    sender: watch::Sender<TokenSet>,
    metrics: Metrics,
}

impl TokenFileWatch {
    /// Runs until `cancel`.
    pub async fn run(mut self, cancel: CancellationToken) {
        let mut poll = tokio::time::interval(POLL);
        poll.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                () = cancel.cancelled() => return,
                _ = poll.tick() => {}
            }
            let look = Look::at(&self.path).await;
            if look == self.last {
                continue;
            }
            tokio::time::sleep(SETTLE).await;
            if Look::at(&self.path).await != look {
                continue;
            }
            self.take(look);
        }
    }

    /// Takes a changed content: a valid one replaces the tokens, any other keeps the last
    /// good set, so that a file half-written or removed for a moment locks no one out.
    fn take(&mut self, look: Look) {
        match look.credentials(&self.path) {
            Ok(set) => {
                tracing::info!(
                    path = %self.path.display(),
                    tokens = set.count(),
                    "token file changed: accepting its tokens"
                );
                self.metrics.set_tokens(set.count());
                self.metrics.token_file_reload(TokenFileReload::Applied);
                self.sender.send_replace(set);
            }
            Err(error) => {
                tracing::warn!(%error, "token file refused: the tokens read last stay valid");
                self.metrics.token_file_reload(error.reload());
            }
        }
        self.last = look;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The SHA-256 of `secret`, as `printf %s secret | sha256sum` prints it.
    const SECRET_SHA256: &str = "2bb80d537b1da3e38bd30361aa855686bde0eacd7162fef6a25fe97bf527a25b";

    fn parse(text: &str) -> Result<TokenSet, CredentialsError> {
        TokenSet::parse(text, Path::new("/tokens"))
    }

    #[test]
    fn hashes_are_sha256_of_the_token() {
        assert_eq!(
            data_encoding::HEXLOWER.encode(&TokenHash::of("secret").0),
            SECRET_SHA256
        );
    }

    #[test]
    fn a_file_holds_tokens_and_hashes_one_a_line() {
        let set = parse(&format!(
            "# rotation of 2024-05\n\n  old-token  \n{HASH_PREFIX}{}\n",
            SECRET_SHA256.to_uppercase()
        ))
        .unwrap();
        assert_eq!(set.count(), 2);
        assert!(set.accepts("old-token"));
        assert!(set.accepts("secret"));
        for refused in ["", "secret ", "old", "# rotation of 2024-05", SECRET_SHA256] {
            assert!(!set.accepts(refused), "{refused:?}");
        }
        assert_eq!(parse("a\na\n").unwrap().count(), 1, "a repeat counts once");
    }

    #[test]
    fn files_without_a_valid_token_are_refused() {
        for empty in ["", "\n \n", "# only a comment\n"] {
            assert!(
                matches!(parse(empty), Err(CredentialsError::Empty { .. })),
                "{empty:?}"
            );
        }
        let invalid = |text: &str| match parse(text) {
            Err(CredentialsError::Invalid { line, reason, .. }) => Some((line, reason)),
            _ => None,
        };
        assert_eq!(invalid("ok\nsha256:abc\n"), Some((2, LineError::BadHash)));
        assert_eq!(
            invalid(&format!("sha256:{}0", SECRET_SHA256)),
            Some((1, LineError::BadHash))
        );
        assert_eq!(invalid("two words"), Some((1, LineError::BadToken)));
        assert_eq!(invalid("tab\there"), Some((1, LineError::BadToken)));
    }

    #[test]
    fn a_single_token_is_compared_exactly() {
        let set = TokenSet::single("s3cret");
        assert!(set.accepts("s3cret"));
        assert!(!set.accepts("s3cre"));
        assert!(!set.accepts("s3cret2"));
        assert!(constant_time_eq(b"abc", b"abc"));
        assert!(!constant_time_eq(b"abc", b"abd"));
        assert!(!constant_time_eq(b"abc", b"ab"));
    }

    #[test]
    fn the_token_stays_out_of_debug_output() {
        assert_eq!(
            format!("{:?}", TokenSource::from("s3cret")),
            "Token(<redacted>)"
        );
    }

    #[tokio::test]
    async fn a_broken_file_keeps_the_last_good_set() {
        let dir = crate::testutil::TempDir::new("credentials");
        let path = dir.path().join("tokens");
        std::fs::write(&path, "a\n").unwrap();
        let metrics = Metrics::default();
        let source = TokenSource::File(path.clone());
        let (credentials, watch) = Credentials::load(&source, &metrics).await.unwrap();
        let mut watch = watch.unwrap();
        assert!(credentials.current().accepts("a"));
        for broken in ["", "sha256:00\n"] {
            std::fs::write(&path, broken).unwrap();
            watch.take(Look::at(&path).await);
            assert!(credentials.current().accepts("a"), "{broken:?}");
        }
        std::fs::remove_file(&path).unwrap();
        watch.take(Look::at(&path).await);
        assert!(credentials.current().accepts("a"));
        std::fs::write(&path, "b\n").unwrap();
        watch.take(Look::at(&path).await);
        assert!(!credentials.current().accepts("a"));
        assert!(credentials.current().accepts("b"));
        assert!(matches!(
            Credentials::load(&TokenSource::File(dir.path().join("none")), &metrics).await,
            Err(CredentialsError::Unreadable { .. })
        ));
    }
}
