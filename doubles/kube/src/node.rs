//! A node under test: the real hypervisor and Kubernetes agent, started by
//! the builder `serve --kubernetes` uses, pointed by a kubeconfig at a fake API
//! server, with its plugin registered by the fake kubelet. Every path is
//! under one folder, except the regions (`/dev/shm`, where the ledger lives).

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use hypervisor::{Node, NodeSpec};
use hypervisor_core::node_tables::NodeTableNames;
use hypervisor_corun::{CorunOptions, MpsBoard};
use hypervisor_daemon::{Hypervisor, Options};
use hypervisor_kubernetes::dra::plugin::PluginSockets;
use hypervisor_kubernetes::{AgentOptions, NodeAgent};
use hypervisor_observer::GpuObserver;
use hypervisor_provision::ProvisionConfig;

use super::apiserver::FakeApiServer;
use super::kubelet::FakeKubelet;

/// One running node: the product's [`Node`] and the fake kubelet its
/// plugin registered with.
pub struct TestNode {
    node: Option<Node>,
    /// The node's hypervisor, to look at or drive directly.
    pub hv: Hypervisor,
    /// `http://` and the hypervisor's loopback address.
    pub hv_url: String,
    /// The node's Kubernetes agent.
    pub agent: NodeAgent,
    /// The fake kubelet its DRA plugin registered with.
    pub kubelet: FakeKubelet,
    /// The options the agent runs with (the hypervisor's URL filled in).
    pub options: AgentOptions,
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
    /// Starts the node (loopback, ephemeral port) through [`Node::start`],
    /// with its agent on `options` (`hypervisor_url` the node's address when
    /// empty), writes the kubeconfig for `api`, and registers the plugin
    /// with the fake kubelet.
    pub async fn start(
        api: &FakeApiServer,
        observer: Arc<dyn GpuObserver>,
        options: AgentOptions,
    ) -> anyhow::Result<Self> {
        Self::start_with(api, observer, options, None).await
    }

    /// [`TestNode::start`] with the co-run GPUs of `corun`.
    pub async fn start_with(
        api: &FakeApiServer,
        observer: Arc<dyn GpuObserver>,
        options: AgentOptions,
        corun: Option<CorunOptions>,
    ) -> anyhow::Result<Self> {
        use anyhow::Context;
        if let Some(path) = &options.kubeconfig {
            api.write_kubeconfig(path).context("kubeconfig")?;
        }
        Self::start_written(observer, options, corun).await
    }

    /// [`TestNode::start_with`] for an API server whose kubeconfig is
    /// already at `options.kubeconfig` (a real cluster's, with the node
    /// agent's ServiceAccount token).
    pub async fn start_written(
        observer: Arc<dyn GpuObserver>,
        options: AgentOptions,
        corun: Option<CorunOptions>,
    ) -> anyhow::Result<Self> {
        use anyhow::Context;
        let config = hypervisor_config::parse(
            "listen = \"127.0.0.1:0\"\nhealth_interval_ms = 0\n",
            Path::new("(test)"),
            Path::new("."),
        )?;
        // The tables the pod files name.
        let tables = options.provision.node_tables.clone();
        let node = Node::start(NodeSpec {
            daemon: Options {
                config,
                config_path: None,
                listen: None,
                observer,
                handle_sighup: false,
                node_tables: tables.clone(),
            },
            socket: None,
            metrics: None,
            corun,
            kubernetes: Some(options),
        })
        .await
        .inspect_err(|_| unlink(&tables))?;
        let agent = node.agent().context("the node runs no agent")?.clone();
        let options = agent.options().clone();
        let registry = options
            .sockets
            .registration
            .parent()
            .map(Path::to_owned)
            .unwrap_or_default();
        let kubelet =
            FakeKubelet::register(&registry, &options.driver, Duration::from_secs(10)).await?;
        Ok(Self {
            hv: node.hypervisor().clone(),
            hv_url: node.url(),
            node: Some(node),
            agent,
            kubelet,
            options,
            tables,
        })
    }

    /// The co-run GPUs' states, if the node has any.
    pub fn corun_board(&self) -> Option<Arc<MpsBoard>> {
        self.node.as_ref().and_then(Node::corun_board)
    }

    /// Stops the agent and the hypervisor (regions and checkpoint stay, as
    /// when the DaemonSet's pod restarts).
    pub async fn stop(mut self) {
        if let Some(node) = self.node.take()
            && let Err(error) = node.stop().await
        {
            tracing::error!(%error, "the node stopped with an error");
        }
    }
}

impl Drop for TestNode {
    fn drop(&mut self) {
        unlink(&self.tables);
    }
}

/// Removes the node tables a test node made.
fn unlink(tables: &NodeTableNames) {
    let _ = gpushare_utils::shm::unlink(&tables.activity);
    let _ = gpushare_utils::shm::unlink(&tables.priority);
}
