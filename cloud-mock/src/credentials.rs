//! The bearer tokens the API accepts and whose they are: `--token`, the lines of
//! `--token-file`, or the credentials of `--tenants-file` (each a tenant's, or the admin's).
//! The edge re-reads a file while it runs, so that a rotation needs no restart: add the
//! new token, roll the clients, remove the old one.
//!
//! Tokens are kept as SHA-256 hashes only (the files may hold nothing else), and a given
//! token is compared with each of them in constant time. The request path borrows the
//! current set from a `watch` channel (a shared read, no lock of its own).

use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use sha2::{Digest, Sha256};
use tandem_common::tls::ClientName;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use crate::metrics::{Metrics, TokenFileReload};
use crate::tenants::{Tenant, TenantsError, TenantsFile, tenants};

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
    /// The tenants and their credentials, JSON, re-read while the edge runs
    /// (`--tenants-file`).
    Tenants(PathBuf),
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
            Self::Tenants(path) => f.debug_tuple("Tenants").field(path).finish(),
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
    #[error("tenants file {path}: {reason}")]
    Tenants { path: PathBuf, reason: TenantsError },
}

impl CredentialsError {
    /// The bounded metric label of a refused file.
    fn reload(&self) -> TokenFileReload {
        match self {
            Self::Unreadable { .. } => TokenFileReload::Unreadable,
            Self::Empty { .. }
            | Self::Tenants {
                reason: TenantsError::Empty,
                ..
            } => TokenFileReload::Empty,
            Self::Invalid { .. } | Self::Tenants { .. } => TokenFileReload::Invalid,
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

    /// 64 hex digits, of either case.
    fn from_hex(hex: &str) -> Option<Self> {
        let bytes = data_encoding::HEXLOWER_PERMISSIVE
            .decode(hex.as_bytes())
            .ok()?;
        bytes.try_into().map(Self).ok()
    }

    /// What logs and the audit log name a credential of a token file by: the first hex
    /// digits of its hash, which tell rotations apart and give nothing away.
    fn id(&self) -> String {
        format!(
            "{HASH_PREFIX}{}",
            &data_encoding::HEXLOWER.encode(&self.0)[..12]
        )
    }

    /// A line of a token file: `sha256:<64 hex>`, or a token.
    fn from_line(line: &str) -> Result<Self, LineError> {
        if let Some(hex) = line.strip_prefix(HASH_PREFIX) {
            return Self::from_hex(hex).ok_or(LineError::BadHash);
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

/// Whose a credential is.
#[derive(Debug, Clone)]
pub enum Principal {
    /// A token of `--token` or `--token-file`: one edge, one client, no tenants; it may do
    /// everything, as the admin may.
    Unscoped,
    /// An admin credential of the tenants file.
    Admin,
    Tenant(Arc<Tenant>),
}

/// Who a request comes from: the principal and the id of the credential it showed.
#[derive(Debug, Clone)]
pub struct Caller {
    pub principal: Principal,
    pub credential: Arc<str>,
}

impl Caller {
    /// The tenant every call of this caller is scoped to; `None` sees everything.
    pub fn tenant(&self) -> Option<&Arc<Tenant>> {
        match &self.principal {
            Principal::Tenant(tenant) => Some(tenant),
            Principal::Unscoped | Principal::Admin => None,
        }
    }

    /// Whether it may call the admin routes (faults).
    pub fn may_administer(&self) -> bool {
        self.tenant().is_none()
    }

    /// The tenant's name, or what stands for none in logs.
    pub fn name(&self) -> &str {
        match &self.principal {
            Principal::Unscoped => "-",
            Principal::Admin => "admin",
            Principal::Tenant(tenant) => &tenant.name,
        }
    }
}

/// The credentials accepted at one time: never empty when built from a file.
#[derive(Clone)]
pub struct CredentialSet {
    entries: Vec<(TokenHash, Caller)>,
    /// The tenants file's tenants (with or without credentials), for the next reload.
    tenants: Vec<Arc<Tenant>>,
}

impl CredentialSet {
    pub fn single(token: &str) -> Self {
        Self::unscoped(vec![TokenHash::of(token)])
    }

    fn unscoped(hashes: Vec<TokenHash>) -> Self {
        let entries = hashes
            .into_iter()
            .map(|hash| {
                let credential = hash.id().into();
                (
                    hash,
                    Caller {
                        principal: Principal::Unscoped,
                        credential,
                    },
                )
            })
            .collect();
        Self {
            entries,
            tenants: Vec::new(),
        }
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
        Ok(Self::unscoped(hashes))
    }

    /// The credentials of a tenants file's text; a tenant whose rate limit is unchanged
    /// from `previous` keeps its bucket. `path` is for the errors.
    pub fn parse_tenants(
        text: &str,
        path: &Path,
        previous: &Self,
    ) -> Result<Self, CredentialsError> {
        let refused = |reason| CredentialsError::Tenants {
            path: path.to_owned(),
            reason,
        };
        let file = TenantsFile::parse(text).map_err(refused)?;
        let built = tenants(&file, &previous.tenants).map_err(refused)?;
        let owners = file
            .admin
            .iter()
            .map(|credential| (credential, Principal::Admin))
            .chain(file.tenants.iter().zip(&built).flat_map(|(entry, tenant)| {
                entry
                    .credentials
                    .iter()
                    .map(|credential| (credential, Principal::Tenant(tenant.clone())))
            }));
        let mut entries: Vec<(TokenHash, Caller)> = Vec::new();
        for (credential, principal) in owners {
            let id = credential.id.as_str();
            if id.is_empty() || id.len() > 63 || id.chars().any(|c| !c.is_ascii_graphic()) {
                return Err(refused(TenantsError::BadCredentialId(id.to_owned())));
            }
            let hash = TokenHash::from_hex(&credential.sha256)
                .ok_or_else(|| refused(TenantsError::BadHash { id: id.to_owned() }))?;
            // One token of two owners would make the owner depend on the order.
            if entries
                .iter()
                .any(|(known, caller)| *known == hash || &*caller.credential == id)
            {
                return Err(refused(TenantsError::DuplicateCredential(id.to_owned())));
            }
            entries.push((
                hash,
                Caller {
                    principal,
                    credential: id.into(),
                },
            ));
        }
        Ok(Self {
            entries,
            tenants: built,
        })
    }

    /// The caller whose token `given` is. Every hash is compared, so the time does not
    /// tell which one matched.
    pub fn accepts(&self, given: &str) -> Option<Caller> {
        let given = TokenHash::of(given);
        let mut found = None;
        for (index, (hash, _)) in self.entries.iter().enumerate() {
            if constant_time_eq(&hash.0, &given.0) {
                found = Some(index);
            }
        }
        found.map(|index| self.entries[index].1.clone())
    }

    /// The tenant a verified client certificate names by its common name, if any. The
    /// credential is named by the certificate's hash, which tells renewals apart.
    pub fn certificate(&self, client: &ClientName) -> Option<Caller> {
        let tenant = self
            .tenants
            .iter()
            .find(|tenant| tenant.name == client.common_name)?;
        Some(Caller {
            principal: Principal::Tenant(tenant.clone()),
            credential: format!(
                "x509:{}",
                &data_encoding::HEXLOWER.encode(&client.sha256)[..12]
            )
            .into(),
        })
    }

    pub fn count(&self) -> usize {
        self.entries.len()
    }
}

/// The tokens the API accepts now; clones see every change.
#[derive(Clone)]
pub struct Credentials(watch::Receiver<CredentialSet>);

impl Credentials {
    /// The credentials of `source` and, for a file, the task that re-reads it (run it with
    /// [`TokenFileWatch::run`]). A file that cannot be read, or holds no valid token, is an
    /// error here: at the start there is no last good set to keep.
    pub async fn load(
        source: &TokenSource,
        metrics: &Metrics,
    ) -> Result<(Self, Option<TokenFileWatch>), CredentialsError> {
        let (set, watch) = match source {
            TokenSource::Token(token) => (CredentialSet::single(token), None),
            TokenSource::File(path) | TokenSource::Tenants(path) => {
                let look = Look::at(path).await;
                let set = look.credentials(source, path, &CredentialSet::unscoped(Vec::new()))?;
                (set, Some((source.clone(), path.clone(), look)))
            }
        };
        metrics.set_tokens(set.count());
        let (sender, receiver) = watch::channel(set);
        let watch = watch.map(|(source, path, last)| TokenFileWatch {
            source,
            path,
            last,
            sender,
            metrics: metrics.clone(),
        });
        Ok((Self(receiver), watch))
    }

    /// The tokens now; a change waits while this is held, so drop it soon.
    pub fn current(&self) -> watch::Ref<'_, CredentialSet> {
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

    /// The credentials of what was read, as a file of `source`'s kind.
    fn credentials(
        &self,
        source: &TokenSource,
        path: &Path,
        previous: &CredentialSet,
    ) -> Result<CredentialSet, CredentialsError> {
        match self {
            Self::Text(text) if matches!(source, TokenSource::Tenants(_)) => {
                CredentialSet::parse_tenants(text, path, previous)
            }
            Self::Text(text) => CredentialSet::parse(text, path),
            Self::Unreadable(kind) => Err(CredentialsError::Unreadable {
                path: path.to_owned(),
                source: (*kind).into(),
            }),
        }
    }
}

/// Re-reads the token or tenants file and hands every valid change to the API.
pub struct TokenFileWatch {
    source: TokenSource,
    path: PathBuf,
    /// The last content taken (valid or not), so that a file that stays broken is
    /// reported once.
    last: Look,
    sender: watch::Sender<CredentialSet>,
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
        let read = look.credentials(&self.source, &self.path, &self.sender.borrow());
        match read {
            Ok(set) => {
                tracing::info!(
                    path = %self.path.display(),
                    tokens = set.count(),
                    "credentials file changed: accepting its tokens"
                );
                self.metrics.set_tokens(set.count());
                self.metrics.token_file_reload(TokenFileReload::Applied);
                self.sender.send_replace(set);
            }
            Err(error) => {
                tracing::warn!(%error, "credentials file refused: the tokens read last stay valid");
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

    fn parse(text: &str) -> Result<CredentialSet, CredentialsError> {
        CredentialSet::parse(text, Path::new("/tokens"))
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
        assert!(set.accepts("old-token").is_some());
        assert!(set.accepts("secret").is_some());
        for refused in ["", "secret ", "old", "# rotation of 2024-05", SECRET_SHA256] {
            assert!(set.accepts(refused).is_none(), "{refused:?}");
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

    fn parse_tenants(admin: &str, tenant: &str) -> Result<CredentialSet, CredentialsError> {
        let text = format!(
            r#"{{"admin": [{admin}], "tenants": [{{"name": "a", "clusters": ["c1"], "pools": ["default"], "credentials": [{tenant}]}}]}}"#
        );
        CredentialSet::parse_tenants(
            &text,
            Path::new("/tenants.json"),
            &CredentialSet::unscoped(Vec::new()),
        )
    }

    fn entry(id: &str, hash: &str) -> String {
        format!(r#"{{"id": "{id}", "sha256": "{hash}"}}"#)
    }

    #[test]
    fn a_tenants_file_says_whose_each_token_is() {
        let other = data_encoding::HEXLOWER.encode(&TokenHash::of("other").0);
        let set = parse_tenants(&entry("ops", SECRET_SHA256), &entry("a-1", &other)).unwrap();
        assert_eq!(set.count(), 2);
        let admin = set.accepts("secret").unwrap();
        assert!(matches!(admin.principal, Principal::Admin));
        assert_eq!((admin.name(), &*admin.credential), ("admin", "ops"));
        assert!(admin.may_administer());
        let tenant = set.accepts("other").unwrap();
        assert_eq!((tenant.name(), &*tenant.credential), ("a", "a-1"));
        assert!(!tenant.may_administer());
        assert!(set.accepts(SECRET_SHA256).is_none(), "a hash is no token");

        let refused = |admin: &str, tenant: &str| match parse_tenants(admin, tenant) {
            Err(CredentialsError::Tenants { reason, .. }) => reason,
            other => panic!("accepted: {}", other.is_ok()),
        };
        assert_eq!(
            refused(&entry("ops", SECRET_SHA256), &entry("a-1", SECRET_SHA256)),
            TenantsError::DuplicateCredential("a-1".into()),
            "one token of two owners"
        );
        assert_eq!(
            refused(&entry("x", SECRET_SHA256), &entry("x", &other)),
            TenantsError::DuplicateCredential("x".into())
        );
        assert_eq!(
            refused(&entry("ops", "abc"), ""),
            TenantsError::BadHash { id: "ops".into() }
        );
        assert_eq!(
            refused(&entry("two words", SECRET_SHA256), ""),
            TenantsError::BadCredentialId("two words".into())
        );
    }

    #[test]
    fn a_token_files_credentials_are_named_by_a_prefix_of_their_hash() {
        let set = CredentialSet::single("secret");
        let caller = set.accepts("secret").unwrap();
        assert_eq!(
            &*caller.credential,
            &format!("sha256:{}", &SECRET_SHA256[..12])
        );
        assert!(caller.may_administer() && caller.tenant().is_none());
    }

    #[test]
    fn a_single_token_is_compared_exactly() {
        let set = CredentialSet::single("s3cret");
        assert!(set.accepts("s3cret").is_some());
        assert!(set.accepts("s3cre").is_none());
        assert!(set.accepts("s3cret2").is_none());
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
        assert!(credentials.current().accepts("a").is_some());
        for broken in ["", "sha256:00\n"] {
            std::fs::write(&path, broken).unwrap();
            watch.take(Look::at(&path).await);
            assert!(credentials.current().accepts("a").is_some(), "{broken:?}");
        }
        std::fs::remove_file(&path).unwrap();
        watch.take(Look::at(&path).await);
        assert!(credentials.current().accepts("a").is_some());
        std::fs::write(&path, "b\n").unwrap();
        watch.take(Look::at(&path).await);
        assert!(credentials.current().accepts("a").is_none());
        assert!(credentials.current().accepts("b").is_some());
        assert!(matches!(
            Credentials::load(&TokenSource::File(dir.path().join("none")), &metrics).await,
            Err(CredentialsError::Unreadable { .. })
        ));
    }
}
