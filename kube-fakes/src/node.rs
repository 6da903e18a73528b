//! A node under test: the real hypervisor and Kubernetes agent (the library
//! code `serve --kubernetes` runs), pointed by a kubeconfig at a fake API
//! server, with its plugin registered by the fake kubelet. Every path is
//! under one folder, except the regions (`/dev/shm`, where the ledger lives).

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use hypervisor::dra::plugin::PluginSockets;
use hypervisor::kubernetes::{AgentOptions, NodeAgent};
use hypervisor::node_tables::NodeTableNames;
use hypervisor::observer::GpuObserver;
use hypervisor::provision::ProvisionConfig;
use hypervisor::{Hypervisor, Options};

use super::apiserver::FakeApiServer;
use super::kubelet::FakeKubelet;

/// One running node.
pub struct TestNode {
    pub hv: Hypervisor,
    pub hv_url: String,
    pub agent: NodeAgent,
    pub kubelet: FakeKubelet,
    pub options: AgentOptions,
    stop: tokio::sync::watch::Sender<bool>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
    /// The node tables its hypervisor made: removed when the node is dropped.
    tables: NodeTableNames,
}

/// Node tables of their own for the node whose folders are under `dir`.
pub fn node_tables(dir: &Path) -> NodeTableNames {
    let id = dir
        .file_name()
        .map(|name| name.to_string_lossy().replace(['/', '\0'], "_"))
        .unwrap_or_default();
    NodeTableNames {
        activity: format!("gpushare-node-test-{id}"),
        priority: format!("gpushare-priority-test-{id}"),
    }
}

/// The agent's options with every folder under `dir` and the limiter at `limiter`.
pub fn options(dir: &Path, node: &str, driver: &str, limiter: &Path) -> AgentOptions {
    let provision = ProvisionConfig {
        state_dir: dir.join("state"),
        host_state_dir: dir.join("state"),
        cdi_dir: dir.join("cdi"),
        region_dir: PathBuf::from("/dev/shm"),
        host_region_dir: PathBuf::from("/dev/shm"),
        host_limiter: limiter.to_owned(),
        hypervisor_url: String::new(),
        host_socket_dir: None,
        cdi_vendor: "gpushare.dev".to_owned(),
        cdi_class: "gpu".to_owned(),
        host_root: PathBuf::from("/"),
        corun: None,
        node_tables: node_tables(dir),
    };
    AgentOptions {
        node: node.to_owned(),
        driver: driver.to_owned(),
        kubeconfig: Some(dir.join("kubeconfig")),
        provision,
        sockets: PluginSockets::under(&dir.join("kubelet"), driver),
        proc_root: PathBuf::from("/proc"),
        check_identity: true,
        resync: Duration::from_millis(500),
        device_plugin: None,
    }
}

impl TestNode {
    /// Starts the hypervisor (loopback, ephemeral port) and the agent with
    /// `options` (its `hypervisor_url` filled in), writes the kubeconfig for
    /// `api`, and registers the plugin with the fake kubelet.
    pub async fn start(
        api: &FakeApiServer,
        observer: Arc<dyn GpuObserver>,
        mut options: AgentOptions,
    ) -> anyhow::Result<Self> {
        use anyhow::Context;
        if let Some(path) = &options.kubeconfig {
            api.write_kubeconfig(path).context("kubeconfig")?;
        }
        let config = hypervisor::config::parse(
            "listen = \"127.0.0.1:0\"\nhealth_interval_ms = 0\n",
            Path::new("(test)"),
            Path::new("."),
        )?;
        let gpus = observer.gpus()?;
        // The tables the pod files name.
        let tables = options.provision.node_tables.clone();
        let hv = Hypervisor::new(Options {
            config,
            config_path: None,
            listen: None,
            observer,
            handle_sighup: false,
            node_tables: tables.clone(),
        })?;
        let listener = tokio::net::TcpListener::bind(hv.listen_addr()).await?;
        let hv_url = format!("http://{}", listener.local_addr()?);
        if options.provision.hypervisor_url.is_empty() {
            options.provision.hypervisor_url = hv_url.clone();
        }
        let (stop, stopped) = tokio::sync::watch::channel(false);
        let wait = |mut rx: tokio::sync::watch::Receiver<bool>| async move {
            let _ = rx.wait_for(|s| *s).await;
        };
        let mut tasks = Vec::new();
        let serving = hv.clone();
        let until = wait(stopped.clone());
        tasks.push(tokio::spawn(async move {
            let _ = serving.serve(listener, until).await;
        }));
        let agent = NodeAgent::start(hv.clone(), gpus, options.clone()).await?;
        let running = agent.clone();
        let until = wait(stopped);
        tasks.push(tokio::spawn(async move {
            if let Err(error) = running.run(until).await {
                tracing::error!(%error, "agent ended");
            }
        }));
        let registry = options
            .sockets
            .registration
            .parent()
            .map(Path::to_owned)
            .unwrap_or_default();
        let kubelet =
            FakeKubelet::register(&registry, &options.driver, Duration::from_secs(10)).await?;
        Ok(Self {
            hv,
            hv_url,
            agent,
            kubelet,
            options,
            stop,
            tasks,
            tables,
        })
    }

    /// Stops the agent and the hypervisor (regions and checkpoint stay, as
    /// when the DaemonSet's pod restarts).
    pub async fn stop(mut self) {
        let _ = self.stop.send(true);
        for task in std::mem::take(&mut self.tasks) {
            let _ = tokio::time::timeout(Duration::from_secs(5), task).await;
        }
    }
}

impl Drop for TestNode {
    fn drop(&mut self) {
        let _ = gpushare_utils::shm::unlink(&self.tables.activity);
        let _ = gpushare_utils::shm::unlink(&self.tables.priority);
    }
}
