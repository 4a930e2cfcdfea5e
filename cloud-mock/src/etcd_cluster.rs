//! A real etcd cluster for tests and benchmarks (feature `test-support`): Debian's `etcd`
//! (3.4), several members on loopback ports of their own, each in a temporary data
//! directory; members can be stopped and started again on their data. Every process is
//! ended by its PID, and the directories removed, when the cluster is dropped. A member
//! that does not start ends the test that needs it, with the reason.
#![allow(clippy::expect_used)]

use std::net::{Ipv4Addr, TcpListener};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use etcd_client::Client;

pub struct Member {
    pub name: String,
    pub client_url: String,
    peer_url: String,
    data_dir: PathBuf,
    process: Option<Child>,
}

pub struct EtcdCluster {
    pub members: Vec<Member>,
    root: PathBuf,
}

/// A free loopback port (the listener is closed before etcd binds it).
fn free_port() -> u16 {
    let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).expect("a free loopback port");
    listener.local_addr().expect("its address").port()
}

impl EtcdCluster {
    /// Starts `size` members and waits until the cluster answers.
    pub async fn start(size: usize) -> Self {
        assert!(
            Command::new("etcd").arg("--version").output().is_ok(),
            "these tests run a real etcd: install Debian's etcd-server (bash .ci/run does)"
        );
        let root = std::env::temp_dir().join(format!(
            "cloud-mock-etcd-{}-{}",
            std::process::id(),
            rand_suffix()
        ));
        let members: Vec<Member> = (0..size)
            .map(|index| Member {
                name: format!("m{index}"),
                client_url: format!("http://127.0.0.1:{}", free_port()),
                peer_url: format!("http://127.0.0.1:{}", free_port()),
                data_dir: root.join(format!("m{index}")),
                process: None,
            })
            .collect();
        let mut cluster = Self { members, root };
        for index in 0..size {
            cluster.start_member(index);
        }
        cluster.wait_healthy().await;
        cluster
    }

    fn initial_cluster(&self) -> String {
        self.members
            .iter()
            .map(|member| format!("{}={}", member.name, member.peer_url))
            .collect::<Vec<_>>()
            .join(",")
    }

    /// Starts member `index` (again, on its data, after [`Self::stop_member`]).
    pub fn start_member(&mut self, index: usize) {
        let initial_cluster = self.initial_cluster();
        let member = &mut self.members[index];
        assert!(member.process.is_none(), "{} runs already", member.name);
        std::fs::create_dir_all(&member.data_dir).expect("a data directory");
        let log = std::fs::File::create(member.data_dir.with_extension("log")).expect("a log file");
        let child = Command::new("etcd")
            .args(["--name", &member.name])
            .arg("--data-dir")
            .arg(&member.data_dir)
            .args(["--listen-client-urls", &member.client_url])
            .args(["--advertise-client-urls", &member.client_url])
            .args(["--listen-peer-urls", &member.peer_url])
            .args(["--initial-advertise-peer-urls", &member.peer_url])
            .args(["--initial-cluster", &initial_cluster])
            .args(["--initial-cluster-state", "new"])
            .args(["--initial-cluster-token", "cloud-mock-test"])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("etcd starts");
        member.process = Some(child);
    }

    /// Kills member `index` (SIGKILL, by its PID) and waits for it to end.
    pub fn stop_member(&mut self, index: usize) {
        if let Some(mut child) = self.members[index].process.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    pub fn endpoints(&self) -> Vec<String> {
        self.members
            .iter()
            .map(|member| member.client_url.clone())
            .collect()
    }

    /// The index of the member that leads the cluster now, as member `asked` sees it.
    pub async fn leader(&self, asked: usize) -> usize {
        let mut client = Client::connect([&self.members[asked].client_url], None)
            .await
            .expect("a client of the member");
        let leader = client.status().await.expect("its status").leader();
        let members = client.member_list().await.expect("the members");
        let name = members
            .members()
            .iter()
            .find(|member| member.id() == leader)
            .map(|member| member.name().to_owned())
            .expect("the leader is a member");
        self.members
            .iter()
            .position(|member| member.name == name)
            .expect("a member of this cluster")
    }

    /// Waits until a write through every running member succeeds.
    pub async fn wait_healthy(&self) {
        let deadline = Instant::now() + Duration::from_secs(30);
        for member in self.members.iter().filter(|m| m.process.is_some()) {
            loop {
                let attempt = async {
                    let mut client = Client::connect([&member.client_url], None).await?;
                    client
                        .put("/health-probe", member.name.as_str(), None)
                        .await
                };
                match tokio::time::timeout(Duration::from_secs(2), attempt).await {
                    Ok(Ok(_)) => break,
                    _ if Instant::now() < deadline => {
                        tokio::time::sleep(Duration::from_millis(100)).await;
                    }
                    other => panic!("etcd member {} is not healthy: {other:?}", member.name),
                }
            }
        }
    }
}

impl Drop for EtcdCluster {
    fn drop(&mut self) {
        for index in 0..self.members.len() {
            self.stop_member(index);
        }
        let _ = std::fs::remove_dir_all(&self.root);
    }
}

fn rand_suffix() -> u32 {
    use std::sync::atomic::{AtomicU32, Ordering};
    static NEXT: AtomicU32 = AtomicU32::new(0);
    NEXT.fetch_add(1, Ordering::Relaxed)
}
