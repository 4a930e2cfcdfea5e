//! Starting Tandem's binaries in the lab: as processes in its namespaces, or from their
//! container images.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use tandem_netlab::Netns;

use crate::binaries;
use crate::components::Component;
use crate::images::{ContainerRun, Images};

/// Starts Tandem's binaries: as processes in the lab's namespaces, or from their images.
#[derive(Clone)]
pub struct Launcher {
    /// The images and the engine configuration, or `None` for processes.
    pub(crate) images: Option<(Images, PathBuf)>,
    pub(crate) prefix: String,
    pub(crate) run_dir: PathBuf,
    pub(crate) logs: PathBuf,
}

impl Launcher {
    /// Makes `dir` for `binary`'s data: its image's non-root user owns it.
    pub(crate) fn hand_over(&self, binary: &str, dir: &Path) -> Result<()> {
        match &self.images {
            Some((images, _)) => images.hand_over(binary, dir)?,
            None => std::fs::create_dir_all(dir)
                .with_context(|| format!("creating {}", dir.display()))?,
        }
        Ok(())
    }

    /// Starts `binary args` in `netns` as `name`; a container gets `capabilities` (a
    /// process runs as root with all of them).
    pub(crate) fn start(
        &self,
        netns: &Netns,
        name: &str,
        binary: &str,
        capabilities: &[&'static str],
        args: &[String],
    ) -> Result<Component> {
        let component = match &self.images {
            None => Component::start(
                netns,
                name,
                &binaries::locate(binary)?,
                args,
                &[],
                &self.logs,
            )?,
            Some((images, config)) => {
                let run = ContainerRun {
                    config: config.to_owned(),
                    name: format!("tandem-lab-{}-{name}", self.prefix),
                    image: images.reference(binary),
                    netns: netns.name().to_owned(),
                    add_capabilities: capabilities.to_vec(),
                    // Kubeconfig, cloud token and the cloud's data, at the same paths.
                    mounts: vec![self.run_dir.clone()],
                };
                Component::start_container(&run, name, args, &self.logs)?
            }
        };
        Ok(component)
    }
}
