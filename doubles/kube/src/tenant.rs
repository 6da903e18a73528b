//! A test's part of the official control plane that every test of the
//! process shares ([`ControlPlane::shared`]): `deploy/device-plugin` (the
//! base and the device plugin's rights) installed once by `kubectl` as an
//! administrator does, with the node agent's kubeconfig on a token of the
//! shipped ServiceAccount; each test in a namespace of its own and on a
//! Node of its own (its pods pinned there), both deleted when it ends, with
//! the cluster-scoped objects it made.
//!
//! A test that needs the cluster to itself (one that stops the API server,
//! or adds what every other test would see) starts a [`ControlPlane`] of
//! its own instead.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use anyhow::Context;
use hypervisor_corun::CorunOptions;
use hypervisor_kubernetes::AgentOptions;
use hypervisor_observer::GpuObserver;
use k8s_openapi::api::core::v1::{Namespace, Node, Pod, PodCondition, ServiceAccount};
use k8s_openapi::api::resource::v1::ResourceClaim;
use kube::api::{Api, ApiResource, DeleteParams, DynamicObject, PostParams};
use kube_control_plane::ControlPlane;
use serde_json::{Value, json};
use tokio::sync::OnceCell;

use crate::clients::Kubectl;
use crate::cluster_node::{self, AGENT_ACCOUNT, ClusterNode, Overlay};
use crate::node;

/// The shared control plane with `deploy/` installed.
struct Installed {
    plane: &'static ControlPlane,
    /// What `kubectl apply -k` printed.
    applied: String,
    /// A kubeconfig with a token of the agent's ServiceAccount.
    agent_kubeconfig: PathBuf,
}

/// Installs `deploy/device-plugin` on the shared control plane, once.
async fn installed() -> anyhow::Result<&'static Installed> {
    static INSTALLED: OnceCell<Installed> = OnceCell::const_new();
    INSTALLED
        .get_or_try_init(|| async {
            let plane = ControlPlane::shared().await?;
            let home = plane.dir().join("kubectl");
            std::fs::create_dir_all(&home).context("kubectl's home")?;
            let kubectl = Kubectl::new(plane.admin_kubeconfig(), &home);
            let applied = tokio::task::spawn_blocking(move || {
                cluster_node::install(&kubectl, Overlay::DevicePlugin)
            })
            .await??;
            let agent_kubeconfig = plane.dir().join("agent.kubeconfig");
            cluster_node::agent_kubeconfig(plane, AGENT_ACCOUNT.1, &agent_kubeconfig).await?;
            Ok(Installed {
                plane,
                applied,
                agent_kubeconfig,
            })
        })
        .await
}

/// An object outside the tenant's namespace, deleted when it ends.
struct Owned {
    resource: ApiResource,
    namespace: Option<String>,
    name: String,
}

/// One test's namespace and Node on the shared control plane; dropping it
/// deletes both (the namespace's objects with it, and what the Node owns)
/// and the objects given to [`Tenant::delete_at_end`]. Drop the node's
/// kubelet and agent first.
pub struct Tenant {
    /// The namespace, and the Node's name.
    pub name: String,
    /// An administrator's client, the tenant's namespace its default.
    pub client: kube::Client,
    /// `kubectl` as the administrator, in the tenant's namespace.
    pub kubectl: Kubectl,
    installed: &'static Installed,
    /// Its kubeconfig and kubectl's home, in the control plane's folder.
    folder: PathBuf,
    owned: Mutex<Vec<Owned>>,
}

impl Tenant {
    /// Namespace `name` on the shared control plane (started and
    /// installed on first use), ready for pods (its `default`
    /// ServiceAccount made); its Node, `name` too, is registered by
    /// [`Tenant::register_node`] or [`Tenant::start_node`]. `name` must be
    /// unique in the process and among processes beside it.
    pub async fn new(name: &str) -> anyhow::Result<Self> {
        let installed = installed().await?;
        let plane = installed.plane;
        let folder = plane.dir().join("tenants").join(name);
        std::fs::create_dir_all(&folder).context("the tenant's folder")?;
        let kubeconfig = folder.join("admin.kubeconfig");
        plane.write_admin_kubeconfig(&kubeconfig, name)?;
        let client = kube_control_plane::client(&kubeconfig).await?;
        let kubectl = Kubectl::new(&kubeconfig, &folder.join("home"));
        let tenant = Self {
            name: name.to_owned(),
            client,
            kubectl,
            installed,
            folder,
            owned: Mutex::new(Vec::new()),
        };
        let namespace: Namespace = serde_json::from_value(json!({"metadata": {"name": name}}))?;
        Api::<Namespace>::all(tenant.client.clone())
            .create(&PostParams::default(), &namespace)
            .await
            .context("the tenant's namespace")?;
        // Pods are refused until the controller manager made it.
        let accounts = Api::<ServiceAccount>::default_namespaced(tenant.client.clone());
        for _ in 0..900 {
            if accounts.get_opt("default").await?.is_some() {
                return Ok(tenant);
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        anyhow::bail!("namespace {name}'s default ServiceAccount never made")
    }

    /// The shared control plane.
    pub fn plane(&self) -> &'static ControlPlane {
        self.installed.plane
    }

    /// The tenant's namespace.
    pub fn namespace(&self) -> &str {
        &self.name
    }

    /// The tenant's Node's name.
    pub fn node(&self) -> &str {
        &self.name
    }

    /// What `kubectl apply -k deploy/device-plugin` printed when the
    /// control plane was installed.
    pub fn applied(&self) -> &str {
        &self.installed.applied
    }

    /// A kubeconfig with a token of the shipped ServiceAccount of the
    /// agent, as the DaemonSet's pod gets one.
    pub fn agent_kubeconfig(&self) -> &Path {
        &self.installed.agent_kubeconfig
    }

    /// The agent's options for the tenant's Node: every folder under `dir`
    /// ([`node::options`]), the limiter at `limiter`, on the shipped
    /// ServiceAccount's token.
    pub fn options(&self, dir: &Path, driver: &str, limiter: &Path) -> AgentOptions {
        let mut options = node::options(dir, self.node(), driver, limiter);
        options.kubeconfig = Some(self.agent_kubeconfig().to_owned());
        options
    }

    /// The tenant's Node registered by its kubelet (see
    /// [`cluster_node::register_node`]); a client with its credentials.
    pub async fn register_node(&self) -> anyhow::Result<kube::Client> {
        cluster_node::register_node(self.plane(), self.node()).await
    }

    /// The tenant's node started on `options` (for its Node: see
    /// [`Tenant::options`]), its kubelet running the pods bound there.
    pub async fn start_node(
        &self,
        observer: Arc<dyn GpuObserver>,
        options: AgentOptions,
        corun: Option<CorunOptions>,
    ) -> anyhow::Result<ClusterNode> {
        anyhow::ensure!(options.node == self.name, "the options are another Node's");
        ClusterNode::start(self.plane(), observer, options, corun).await
    }

    /// Waits until the tenant's Node takes pods ([`cluster_node::schedulable`]).
    pub async fn schedulable(&self) -> anyhow::Result<()> {
        cluster_node::schedulable(&self.client, self.node()).await
    }

    /// Has `name` (of kind `K`, in `namespace` if namespaced) deleted when
    /// the tenant ends: what a test made outside its namespace.
    pub fn delete_at_end<K: kube::Resource<DynamicType = ()>>(
        &self,
        namespace: Option<&str>,
        name: &str,
    ) {
        self.owned
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push(Owned {
                resource: ApiResource::erase::<K>(&()),
                namespace: namespace.map(str::to_owned),
                name: name.to_owned(),
            });
    }

    /// Creates `claim` (JSON, [`cluster_node::claim`]) in the namespace.
    pub async fn create_claim(&self, claim: Value) -> anyhow::Result<ResourceClaim> {
        let claim: ResourceClaim = serde_json::from_value(claim)?;
        Ok(Api::default_namespaced(self.client.clone())
            .create(&PostParams::default(), &claim)
            .await?)
    }

    /// Creates pod `name` on the tenant's Node whose container uses the
    /// claims `claims` ([`cluster_node::pod`]); the scheduler binds it.
    pub async fn create_pod(&self, name: &str, claims: &[&str]) -> anyhow::Result<Pod> {
        let pod: Pod = serde_json::from_value(cluster_node::pod(name, self.node(), claims))?;
        Ok(Api::default_namespaced(self.client.clone())
            .create(&PostParams::default(), &pod)
            .await?)
    }

    /// Deletes pod `name` as a user does: gracefully, its kubelet
    /// confirming once its claims are unprepared.
    pub async fn delete_pod(&self, name: &str) -> anyhow::Result<()> {
        Api::<Pod>::default_namespaced(self.client.clone())
            .delete(name, &DeleteParams::default())
            .await?;
        Ok(())
    }

    /// Pod `name`'s `PodScheduled` condition once the scheduler says it
    /// cannot place it.
    pub async fn unschedulable(&self, name: &str) -> anyhow::Result<PodCondition> {
        let pods = Api::<Pod>::default_namespaced(self.client.clone());
        for _ in 0..900 {
            let pod = pods.get(name).await?;
            let conditions = pod.status.and_then(|s| s.conditions).unwrap_or_default();
            if let Some(c) = conditions
                .into_iter()
                .find(|c| c.type_ == "PodScheduled" && c.status == "False")
            {
                return Ok(c);
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        anyhow::bail!("pod {name} never said unschedulable")
    }
}

impl Drop for Tenant {
    fn drop(&mut self) {
        let owned = std::mem::take(self.owned.get_mut().unwrap_or_else(PoisonError::into_inner));
        let kubeconfig = self.kubectl.kubeconfig.clone();
        let name = self.name.clone();
        // A runtime of its own: the caller may be a runtime's thread, or a
        // test unwinding out of one.
        let deleted = std::thread::spawn(move || {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()?;
            runtime.block_on(delete(&kubeconfig, &name, owned))
        })
        .join();
        match deleted {
            Ok(Ok(())) => {}
            Ok(Err(error)) => tracing::warn!(tenant = %self.name, "not deleted: {error:#}"),
            Err(_) => tracing::warn!(tenant = %self.name, "its deletion panicked"),
        }
        let _ = std::fs::remove_dir_all(&self.folder);
    }
}

/// Deletes Node `name`, namespace `name` and `owned`; one gone already is
/// deleted.
async fn delete(kubeconfig: &Path, name: &str, owned: Vec<Owned>) -> anyhow::Result<()> {
    let client = kube_control_plane::client(kubeconfig).await?;
    let params = DeleteParams::default();
    gone(Api::<Node>::all(client.clone()).delete(name, &params).await)?;
    gone(
        Api::<Namespace>::all(client.clone())
            .delete(name, &params)
            .await,
    )?;
    for object in owned {
        let api = match &object.namespace {
            Some(ns) => Api::<DynamicObject>::namespaced_with(client.clone(), ns, &object.resource),
            None => Api::<DynamicObject>::all_with(client.clone(), &object.resource),
        };
        gone(api.delete(&object.name, &params).await)?;
    }
    Ok(())
}

/// `Ok` if the deletion was made or found nothing to delete.
fn gone<T>(deleted: Result<T, kube::Error>) -> Result<(), kube::Error> {
    match deleted {
        Err(kube::Error::Api(status)) if status.code == 404 => Ok(()),
        other => other.map(drop),
    }
}
