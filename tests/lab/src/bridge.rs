//! Running the lab against a real API server: a relay that makes it reachable as
//! `198.18.0.2:6443` inside the control-plane namespace.
//!
//! The relay dials the real server from the namespace its runtime's threads live in, so it
//! runs on its own thread, started in the root namespace before the lab process moves into
//! the control plane. No packet goes from the root namespace into the lab: the relay's
//! listening socket lives in the control plane, and only its upstream side is outside.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::mpsc;
use std::thread::JoinHandle;

use anyhow::{Context, Result, anyhow};
use kube::config::Kubeconfig;
use tandem_netlab::{Netns, Relay, addr, plan_relay, write_kubeconfig};
use tokio::sync::oneshot;

/// A netlab [`Relay`] on a thread of its own, with its own runtime: the relay dials from
/// the namespace its runtime's thread lives in, which is `dial_from` when given (else the
/// caller's), and listens in `listen_in`. Stops the relay and joins on drop.
pub struct NamespaceRelay {
    stop: Option<oneshot::Sender<()>>,
    thread: Option<JoinHandle<()>>,
}

impl NamespaceRelay {
    /// Starts the relay and waits until it listens (briefly blocking the caller).
    pub fn start(
        dial_from: Option<&Netns>,
        listen_in: &Netns,
        listen: SocketAddr,
        upstream: String,
    ) -> Result<Self> {
        let (ready_tx, ready_rx) = mpsc::channel();
        let (stop_tx, stop_rx) = oneshot::channel();
        let dial_from = dial_from.map(|netns| netns.name().to_owned());
        let listen_in = listen_in.clone();
        let thread = std::thread::Builder::new()
            .name("relay".into())
            .spawn(move || {
                let runtime = dial_from
                    .map_or(Ok(()), |netns| {
                        crate::netns::enter(&netns).map_err(Into::into)
                    })
                    .and_then(|()| {
                        tokio::runtime::Builder::new_current_thread()
                            .enable_all()
                            .build()
                            .map_err(|e| anyhow!("relay runtime: {e}"))
                    });
                let runtime = match runtime {
                    Ok(runtime) => runtime,
                    Err(e) => {
                        let _ = ready_tx.send(Err(e));
                        return;
                    }
                };
                runtime.block_on(async move {
                    match Relay::start(&listen_in, listen, upstream).await {
                        Ok(relay) => {
                            let _ = ready_tx.send(Ok(()));
                            let _ = stop_rx.await;
                            relay.stop().await;
                        }
                        Err(e) => {
                            let _ = ready_tx.send(Err(anyhow!("starting the relay: {e}")));
                        }
                    }
                });
            })?;
        ready_rx
            .recv()
            .context("the relay thread ended")?
            .with_context(|| format!("relaying {listen}"))?;
        Ok(Self {
            stop: Some(stop_tx),
            thread: Some(thread),
        })
    }
}

impl Drop for NamespaceRelay {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// The API server's relay; stops it on drop.
pub struct RelayThread {
    /// The kubeconfig for everything inside the lab.
    pub kubeconfig: PathBuf,
    _relay: NamespaceRelay,
}

impl RelayThread {
    /// Starts the relay for `original`'s current context, listening in `control_plane`,
    /// and writes the in-lab kubeconfig to `kubeconfig`. Call from the root namespace.
    pub fn start(original: &Path, control_plane: &Netns, kubeconfig: &Path) -> Result<Self> {
        let original = Kubeconfig::read_from(original)
            .with_context(|| format!("reading {}", original.display()))?;
        let listen = SocketAddr::from((addr::CONTROL_PLANE_IP, addr::API_RELAY_PORT));
        let plan = plan_relay(&original, listen)?;
        write_kubeconfig(kubeconfig, &plan.kubeconfig)?;
        let relay = NamespaceRelay::start(None, control_plane, listen, plan.upstream)
            .context("the API relay")?;
        Ok(Self {
            kubeconfig: kubeconfig.to_path_buf(),
            _relay: relay,
        })
    }
}
