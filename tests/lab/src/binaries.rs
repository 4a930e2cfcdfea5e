//! Where the lab finds the binaries it runs.

use std::path::{Path, PathBuf};

/// Directory holding every Tandem binary; defaults to the one the running executable is in
/// (`target/debug/`, or its parent for test executables in `target/debug/deps/`).
pub const BIN_DIR_ENV: &str = "TANDEM_BIN_DIR";

#[derive(Debug, thiserror::Error)]
#[error(
    "{name} not found (looked in {searched:?}): build it with `cargo build --workspace --bins`, or set {BIN_DIR_ENV}"
)]
pub struct BinaryNotFound {
    pub name: String,
    pub searched: Vec<PathBuf>,
}

pub fn locate(name: &str) -> Result<PathBuf, BinaryNotFound> {
    let searched = candidates(
        name,
        std::env::var_os(BIN_DIR_ENV).map(PathBuf::from),
        std::env::current_exe()
            .ok()
            .as_deref()
            .and_then(Path::parent),
    );
    searched
        .iter()
        .find(|p| p.is_file())
        .cloned()
        .ok_or_else(|| BinaryNotFound {
            name: name.to_owned(),
            searched,
        })
}

fn candidates(name: &str, bin_dir: Option<PathBuf>, exe_dir: Option<&Path>) -> Vec<PathBuf> {
    if let Some(dir) = bin_dir {
        // An explicit choice is the only one: never silently run another build.
        return vec![dir.join(name)];
    }
    let mut out = Vec::new();
    if let Some(dir) = exe_dir {
        out.push(dir.join(name));
        if dir.file_name().is_some_and(|n| n == "deps")
            && let Some(parent) = dir.parent()
        {
            out.push(parent.join(name));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn explicit_directory_wins_alone() {
        let c = candidates(
            "cloud-mock",
            Some("/opt/t".into()),
            Some(Path::new("/x/target/debug")),
        );
        assert_eq!(c, vec![PathBuf::from("/opt/t/cloud-mock")]);
    }

    #[test]
    fn test_executables_look_one_level_up() {
        let c = candidates("cloud-mock", None, Some(Path::new("/x/target/debug/deps")));
        assert_eq!(
            c,
            vec![
                PathBuf::from("/x/target/debug/deps/cloud-mock"),
                PathBuf::from("/x/target/debug/cloud-mock")
            ]
        );
    }
}
