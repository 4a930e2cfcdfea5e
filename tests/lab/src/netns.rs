//! Moving the calling thread into a harness namespace.

use std::fs::File;

use nix::sched::CloneFlags;

#[derive(Debug, thiserror::Error)]
pub enum EnterError {
    #[error("opening /run/netns/{netns}: {source}")]
    Open {
        netns: String,
        source: std::io::Error,
    },
    #[error("entering network namespace {netns}: {source}")]
    Setns { netns: String, source: nix::Error },
}

/// Moves the calling thread into network namespace `name`. Threads it starts afterwards
/// (a tokio runtime's workers) inherit it, so call this before building the runtime: from
/// then on every socket the process opens is inside the virtual cluster.
pub fn enter(name: &str) -> Result<(), EnterError> {
    let path = format!("/run/netns/{name}");
    let file = File::open(&path).map_err(|source| EnterError::Open {
        netns: name.to_owned(),
        source,
    })?;
    nix::sched::setns(&file, CloneFlags::CLONE_NEWNET).map_err(|source| EnterError::Setns {
        netns: name.to_owned(),
        source,
    })
}
