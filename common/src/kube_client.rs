//! The one way every Tandem component builds its Kubernetes client.

use std::path::{Path, PathBuf};

use kube::config::{KubeConfigOptions, Kubeconfig};

#[derive(Debug, thiserror::Error)]
pub enum KubeClientError {
    #[error("kubeconfig {}: {source}", path.display())]
    Read {
        path: PathBuf,
        #[source]
        source: kube::config::KubeconfigError,
    },
    #[error("loading the kubeconfig: {0}")]
    Load(#[source] kube::config::KubeconfigError),
    #[error("no kubeconfig given and none found (in-cluster or the usual defaults): {0}")]
    Infer(#[source] kube::config::InferConfigError),
    #[error("building the Kubernetes client: {0}")]
    Client(#[source] kube::Error),
}

/// A client from the kubeconfig file at `path`; without one, from the in-cluster
/// environment or the usual defaults (`$KUBECONFIG`, `~/.kube/config`), as kubectl does.
pub async fn kube_client(path: Option<&Path>) -> Result<kube::Client, KubeClientError> {
    let config = match path {
        Some(path) => {
            let kubeconfig =
                Kubeconfig::read_from(path).map_err(|source| KubeClientError::Read {
                    path: path.to_path_buf(),
                    source,
                })?;
            return client_from_kubeconfig(kubeconfig).await;
        }
        None => kube::Config::infer()
            .await
            .map_err(KubeClientError::Infer)?,
    };
    kube::Client::try_from(config).map_err(KubeClientError::Client)
}

/// A client for the current context of an in-memory kubeconfig.
pub async fn client_from_kubeconfig(
    kubeconfig: Kubeconfig,
) -> Result<kube::Client, KubeClientError> {
    let config = kube::Config::from_custom_kubeconfig(kubeconfig, &KubeConfigOptions::default())
        .await
        .map_err(KubeClientError::Load)?;
    kube::Client::try_from(config).map_err(KubeClientError::Client)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_missing_kubeconfig_names_its_path() {
        let Err(error) = kube_client(Some(Path::new("/nonexistent/tandem-kubeconfig"))).await
        else {
            panic!("a missing kubeconfig must be an error");
        };
        assert!(
            error.to_string().contains("/nonexistent/tandem-kubeconfig"),
            "{error}"
        );
    }
}
