//! [`RunningNode`]: a node started through the product's own builder on a
//! runtime of its own, for tests that are not async.

use std::net::SocketAddr;
use std::time::Duration;

use hypervisor::{Node, NodeError, NodeSpec};
use hypervisor_daemon::{Hypervisor, Options};

/// A node serving on a runtime of its own. Dropping it stops the node
/// (regions stay, as when the daemon restarts).
pub struct RunningNode {
    /// The node: there from the start until it is stopped or dropped.
    node: Option<Node>,
    runtime: Option<tokio::runtime::Runtime>,
}

impl RunningNode {
    /// Starts `spec` (port 0 in its config: an ephemeral port).
    pub fn start(spec: NodeSpec) -> Result<Self, NodeError> {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name("hypervisor")
            .enable_all()
            .build()
            .expect("a tokio runtime for the node");
        let node = runtime.block_on(Node::start(spec))?;
        Ok(Self {
            node: Some(node),
            runtime: Some(runtime),
        })
    }

    /// Starts the daemon alone: no socket, no co-run GPU, no Kubernetes.
    pub fn daemon(options: Options) -> Result<Self, NodeError> {
        Self::start(NodeSpec {
            daemon: options,
            socket: None,
            metrics: None,
            corun: None,
            kubernetes: None,
        })
    }

    /// Where the API listens.
    pub fn addr(&self) -> SocketAddr {
        self.node().addr()
    }

    /// `http://ADDR`.
    pub fn url(&self) -> String {
        self.node().url()
    }

    /// The state, to look at or drive directly.
    pub fn hypervisor(&self) -> &Hypervisor {
        self.node().hypervisor()
    }

    fn node(&self) -> &Node {
        self.node
            .as_ref()
            .expect("a RunningNode holds its node until stopped")
    }

    /// Stops the node and waits (bounded) for its runtime to wind down.
    pub fn stop(mut self) {
        self.shutdown();
    }

    fn shutdown(&mut self) {
        if let (Some(node), Some(runtime)) = (self.node.take(), &self.runtime) {
            let _ = runtime.block_on(node.stop());
        }
        if let Some(runtime) = self.runtime.take() {
            runtime.shutdown_timeout(Duration::from_secs(3));
        }
    }
}

impl Drop for RunningNode {
    fn drop(&mut self) {
        self.shutdown();
    }
}
