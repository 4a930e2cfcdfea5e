//! Running the lab's components from their container images (`scripts/images.sh` builds
//! them): each a podman container joined to its lab namespace, as a kubelet would run it on
//! a node (the node proxy with the host network and NET_ADMIN/NET_RAW, the others as their
//! image's non-root user, every root filesystem read-only).

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

/// The container engine; `runc` because crun does not work with this machine's cgroup
/// layout.
pub const ENGINE: &str = "podman";
const RUNTIME: &str = "runc";

#[derive(Debug, thiserror::Error)]
pub enum ImageError {
    #[error("running {ENGINE}: {0} (install podman and runc)")]
    Engine(#[source] std::io::Error),
    #[error("image {0} is missing: build it with scripts/images.sh")]
    Missing(String),
    #[error("image {image} runs as {user:?}, which is not uid[:gid]")]
    User { image: String, user: String },
    #[error("writing {path}: {source}")]
    CreateDir {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("handing {path} to the image's user: {source}")]
    Chown {
        path: PathBuf,
        #[source]
        source: nix::Error,
    },
}

/// Where the lab takes its images from: `<registry>/<name>:<tag>`, the tag being this
/// workspace's version, as `scripts/images.sh` tags them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Images {
    pub registry: String,
    pub tag: String,
}

impl Images {
    pub fn new(registry: impl Into<String>) -> Self {
        Self {
            registry: registry.into(),
            tag: env!("CARGO_PKG_VERSION").to_owned(),
        }
    }

    pub fn reference(&self, binary: &str) -> String {
        format!("{}/{binary}:{}", self.registry, self.tag)
    }

    /// Fails with the way to build them when an image is missing.
    pub fn check_present(&self, binaries: &[&str]) -> Result<(), ImageError> {
        for binary in binaries {
            let reference = self.reference(binary);
            let status = Command::new(ENGINE)
                .args(["image", "exists", &reference])
                .status()
                .map_err(ImageError::Engine)?;
            if !status.success() {
                return Err(ImageError::Missing(reference));
            }
        }
        Ok(())
    }

    /// The numeric user the image runs as (`None`: root).
    pub fn user(&self, binary: &str) -> Result<Option<(u32, u32)>, ImageError> {
        let image = self.reference(binary);
        let output = Command::new(ENGINE)
            .args(["image", "inspect", "--format", "{{.Config.User}}", &image])
            .output()
            .map_err(ImageError::Engine)?;
        if !output.status.success() {
            return Err(ImageError::Missing(image));
        }
        let user = String::from_utf8_lossy(&output.stdout).trim().to_owned();
        parse_user(&user).ok_or(ImageError::User { image, user })
    }

    /// Makes `dir` (created if needed) writable by the user `binary`'s image runs as.
    pub fn hand_over(&self, binary: &str, dir: &Path) -> Result<(), ImageError> {
        std::fs::create_dir_all(dir).map_err(|source| ImageError::CreateDir {
            path: dir.to_owned(),
            source,
        })?;
        if let Some((uid, gid)) = self.user(binary)? {
            nix::unistd::chown(
                dir,
                Some(nix::unistd::Uid::from_raw(uid)),
                Some(nix::unistd::Gid::from_raw(gid)),
            )
            .map_err(|source| ImageError::Chown {
                path: dir.to_owned(),
                source,
            })?;
        }
        Ok(())
    }
}

/// `""`/`root`/`0` → root; `uid` or `uid:gid` → that user. Names other than root are not
/// resolved: our images use numeric users.
fn parse_user(user: &str) -> Option<Option<(u32, u32)>> {
    if user.is_empty() || user == "root" {
        return Some(None);
    }
    let (uid, gid) = user.split_once(':').unwrap_or((user, user));
    let uid: u32 = uid.parse().ok()?;
    let gid: u32 = gid.parse().ok()?;
    Some((uid != 0).then_some((uid, gid)))
}

/// The engine configuration for the lab's containers (podman reads only this file when
/// `CONTAINERS_CONF` names it). No default sysctls: runc refuses network sysctls in what
/// it takes for the host's namespace, which the control-plane namespace is for the lab's
/// own processes. No default ulimits: raising RLIMIT_NOFILE is not permitted here.
const ENGINE_CONFIG: &str = "[containers]\ndefault_sysctls = []\ndefault_ulimits = []\n";

/// Writes [`ENGINE_CONFIG`] into `dir`; returns its path for [`ContainerRun::config`].
pub fn write_engine_config(dir: &Path) -> Result<PathBuf, ImageError> {
    let path = dir.join("containers.conf");
    std::fs::write(&path, ENGINE_CONFIG).map_err(|source| ImageError::CreateDir {
        path: path.clone(),
        source,
    })?;
    Ok(path)
}

/// One component's container.
#[derive(Debug, Clone)]
pub struct ContainerRun {
    /// The engine configuration (see [`write_engine_config`]).
    pub config: PathBuf,
    /// Unique per lab (the topology prefix is in it), so parallel labs never collide.
    pub name: String,
    pub image: String,
    pub netns: String,
    /// Capabilities beyond the runtime's defaults.
    pub add_capabilities: Vec<&'static str>,
    /// Host directories mounted at the same path (kubeconfig, token, data).
    pub mounts: Vec<PathBuf>,
}

impl ContainerRun {
    /// `podman run` in the foreground: its output is the component's output, and it ends
    /// when the container does.
    pub fn command(&self, args: &[String]) -> Command {
        let mut cmd = Command::new(ENGINE);
        cmd.env("CONTAINERS_CONF", &self.config);
        cmd.args([
            "run",
            "--rm",
            "--pull=never",
            "--read-only",
            "--runtime",
            RUNTIME,
        ])
        .arg(format!("--name={}", self.name))
        .arg(format!("--network=ns:/run/netns/{}", self.netns))
        // Inside the lab's namespace the pods' names are not known; no resolv.conf edits.
        .arg("--dns=none")
        .arg("--cap-drop=ALL");
        if !self.add_capabilities.is_empty() {
            cmd.arg(format!("--cap-add={}", self.add_capabilities.join(",")));
        }
        for dir in &self.mounts {
            let mut mount = OsString::from("--volume=");
            mount.push(dir);
            mount.push(":");
            mount.push(dir);
            cmd.arg(mount);
        }
        cmd.arg(&self.image).args(args);
        cmd
    }
}

/// Removes the container (also a running one) when dropped: killing `podman run` alone
/// would leave it behind.
#[derive(Debug)]
pub struct ContainerGuard {
    name: String,
}

impl ContainerGuard {
    pub fn new(name: &str) -> Self {
        Self {
            name: name.to_owned(),
        }
    }
}

impl Drop for ContainerGuard {
    fn drop(&mut self) {
        let removed = Command::new(ENGINE)
            .args(["rm", "--force", "--time=0", "--ignore", &self.name])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status();
        if !removed.is_ok_and(|s| s.success()) {
            tracing::warn!(container = %self.name, "removing the container failed");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn image_users() {
        assert_eq!(parse_user(""), Some(None));
        assert_eq!(parse_user("0:0"), Some(None));
        assert_eq!(parse_user("65532:65532"), Some(Some((65532, 65532))));
        assert_eq!(parse_user("65532"), Some(Some((65532, 65532))));
        assert_eq!(parse_user("nonroot"), None);
    }

    #[test]
    fn run_command_joins_the_namespace_read_only() {
        let run = ContainerRun {
            config: "/tmp/lab/containers.conf".into(),
            name: "tandem-lab-x-controller".into(),
            image: Images::new("example.test/t").reference("tandem-controller"),
            netns: "x-cp".into(),
            add_capabilities: vec!["NET_ADMIN"],
            mounts: vec!["/tmp/lab".into()],
        };
        let cmd = run.command(&["--flag".into()]);
        let argv: Vec<_> = cmd
            .get_args()
            .map(|a| a.to_string_lossy().into_owned())
            .collect();
        for expected in [
            "--read-only",
            "--network=ns:/run/netns/x-cp",
            "--cap-add=NET_ADMIN",
            "--volume=/tmp/lab:/tmp/lab",
            "--name=tandem-lab-x-controller",
        ] {
            assert!(argv.iter().any(|a| a == expected), "{expected} in {argv:?}");
        }
        let image = format!(
            "example.test/t/tandem-controller:{}",
            env!("CARGO_PKG_VERSION")
        );
        assert_eq!(argv[argv.len() - 2..], [image, "--flag".to_owned()]);
    }
}
