//! Memory overcommit under Kubernetes, on the official control plane: a
//! node whose daemon config says `[swap] overcommit = [0]` and
//! `overcommit_ratio = 1.5` publishes GPU 0 with 1.5 times its memory as
//! capacity and GPU 1 with its own; the real scheduler places two claims of
//! three quarters of a GPU each on GPU 0 and the node prepares both, while
//! on GPU 1 the second waits; no single request gets more than the GPU's
//! own memory. The node is started through `Node::start` with that config
//! (the shared test node's daemon config has no `[swap]` table).

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use hypervisor::{Node, NodeSpec};
use hypervisor_observer::{GpuObserver, SimulatedGpus};
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::resource::v1::{ResourceClaim, ResourceSlice};
use kube::api::{Api, ListParams};
use kube_fakes::cluster_node;
use kube_fakes::kubelet::FakeKubelet;
use kube_fakes::node_kubelet::NodeKubelet;
use kube_fakes::tenant::Tenant;

use system_tests::scratch::Scratch;

use super::{DRIVER, pod_status, runtime, tenant};

const GIB: u64 = 1 << 30;
/// Each simulated GPU's memory.
const N: u64 = SimulatedGpus::MEMORY;

/// Fields drop in order: the kubelet, the node, the tenant (its namespace
/// and Node), then the scratch folder.
struct World {
    kubelet: Option<NodeKubelet>,
    node: Option<Node>,
    tenant: Tenant,
    scratch: Scratch,
}

impl World {
    /// A Node of the shared control plane, and a node of two simulated
    /// GPUs whose daemon config has `swap` as its `[swap]` table.
    async fn start(tag: &str, swap: &str) -> Self {
        let scratch = Scratch::with_limiter(&format!("overcommit-{tag}"));
        let tenant = tenant(&format!("overcommit-{tag}")).await;
        let d = &scratch.dir;
        let mut options = tenant.options(d, DRIVER, &scratch.limiter());
        options.check_identity = false;
        let tables = options.provision.node_tables.clone();
        scratch.track_shm(&tables.activity);
        scratch.track_shm(&tables.priority);
        let config = hypervisor_config::parse(
            &format!("listen = \"127.0.0.1:0\"\nhealth_interval_ms = 0\n[swap]\n{swap}"),
            Path::new("(test)"),
            Path::new("."),
        )
        .unwrap();
        let kubelet_client = tenant.register_node().await.unwrap();
        let observer: Arc<dyn GpuObserver> = Arc::new(SimulatedGpus::new(2));
        let node = Node::start(NodeSpec {
            daemon: hypervisor_daemon::Options {
                config,
                config_path: None,
                listen: None,
                observer,
                handle_sighup: false,
                node_tables: tables,
            },
            socket: None,
            metrics: None,
            corun: None,
            kubernetes: Some(options.clone()),
        })
        .await
        .unwrap();
        let registry = options.sockets.registration.parent().unwrap();
        let plugin = FakeKubelet::register(registry, DRIVER, Duration::from_secs(10))
            .await
            .unwrap();
        let labels = cluster_node::gpu_labels();
        let kubelet = NodeKubelet::start(kubelet_client, tenant.node(), labels, plugin)
            .await
            .unwrap();
        tenant.schedulable().await.unwrap();
        Self {
            kubelet: Some(kubelet),
            node: Some(node),
            tenant,
            scratch,
        }
    }

    /// Device `gpu-<index>` of the node's slice: (memory capacity, largest
    /// memory one request may take, the `overcommit` attribute).
    async fn device(&self, index: u32) -> (u64, u64, Option<bool>) {
        // The other tests' nodes publish theirs on the shared cluster.
        let this_node =
            ListParams::default().fields(&format!("spec.nodeName={}", self.tenant.node()));
        let slices = Api::<ResourceSlice>::all(self.tenant.client.clone())
            .list(&this_node)
            .await
            .unwrap()
            .items;
        let device = slices[0]
            .spec
            .devices
            .iter()
            .flatten()
            .find(|d| d.name == format!("gpu-{index}"))
            .unwrap()
            .clone();
        let memory = &device.capacity.as_ref().unwrap()["memory"];
        let max = memory.request_policy.as_ref().unwrap().valid_range.as_ref();
        (
            memory.value.0.parse().unwrap(),
            max.unwrap().max.as_ref().unwrap().0.parse().unwrap(),
            device.attributes.unwrap()["overcommit"].bool,
        )
    }

    /// A pod `name` whose claim asks `memory` of GPU `index` (and 10%
    /// compute); returns the pod's UID. The scheduler places it.
    async fn pod(&self, name: &str, memory: &str, index: u32) -> String {
        let claim = format!("{name}-gpu");
        let object = cluster_node::claim(&claim, DRIVER, 1, (memory, "10"), Some(index), None);
        self.tenant.create_claim(object).await.unwrap();
        let pod = self.tenant.create_pod(name, &[&claim]).await.unwrap();
        let uid = pod.metadata.uid.unwrap();
        self.scratch.track_pod(&uid);
        uid
    }

    /// Waits until the kubelet started pod `name` of UID `uid` (its claim
    /// prepared); if it never does, says where the pod and its claim stand
    /// and how the control plane's logs end.
    async fn started(&self, name: &str, uid: &str) {
        let kubelet = self.kubelet.as_ref().unwrap();
        for _ in 0..900 {
            if kubelet.started(uid) {
                return;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let pod = Api::<Pod>::default_namespaced(self.tenant.client.clone())
            .get(name)
            .await
            .map(|p| serde_json::to_string(&(p.spec.and_then(|s| s.node_name), p.status)));
        let claim = Api::<ResourceClaim>::default_namespaced(self.tenant.client.clone())
            .get(&format!("{name}-gpu"))
            .await
            .map(|c| serde_json::to_string(&c.status));
        panic!(
            "pod {name} never started; the kubelet's last error: {:?}, its claims refused: {:?}, \
             its pass at: {:?}\npod (node, status): {pod:?}\nclaim status: {claim:?}\n{}",
            kubelet.last_error(),
            kubelet.refused(uid),
            kubelet.doing(),
            self.tenant.plane().logs()
        );
    }

    /// The daemon's memory quota for pod `uid` on its GPU.
    fn quota(&self, uid: &str) -> Option<u64> {
        let hv = self.node.as_ref().unwrap().hypervisor();
        pod_status(hv, uid).and_then(|p| p["gpus"][0]["memory_quota"].as_u64())
    }

    /// Why the scheduler leaves pod `name` pending, once it says so.
    async fn unschedulable(&self, name: &str) -> String {
        let condition = self.tenant.unschedulable(name).await.unwrap();
        condition.message.unwrap_or_default()
    }

    async fn stop(mut self) {
        drop(self.kubelet.take());
        if let Some(node) = self.node.take() {
            node.stop().await.unwrap();
        }
    }
}

#[test]
fn an_overcommitting_gpu_takes_quotas_up_to_the_ratio_and_the_other_its_memory() {
    runtime().block_on(async {
        let world = World::start("ratio", "overcommit = [0]\novercommit_ratio = 1.5\n").await;
        // GPU 0 offers 1.5 N; GPU 1, N. One request takes at most N of either.
        assert_eq!(world.device(0).await, (N * 3 / 2, N, Some(true)));
        assert_eq!(world.device(1).await, (N, N, Some(false)));

        // More than the GPU has, though less than it offers: no device for it.
        let past = N / GIB + 8;
        world.pod("past", &format!("{past}Gi"), 0).await;
        let message = world.unschedulable("past").await;
        assert!(message.contains("cannot allocate all claims"), "{message}");

        // Two pods of 0.75 N each: both placed on GPU 0 and prepared, each
        // with its own quota. The second is created once the first has
        // started: kube-scheduler 1.37 counts a claim's consumed capacity
        // twice while its allocation is both stored and still in flight,
        // and a claim that fills the device exactly, tried in that moment,
        // waits for the scheduler's five-minute retry.
        let three_quarters = format!("{}Gi", N * 3 / 4 / GIB);
        let a = world.pod("a", &three_quarters, 0).await;
        world.started("a", &a).await;
        let b = world.pod("b", &three_quarters, 0).await;
        world.started("b", &b).await;
        assert_eq!(world.quota(&a), Some(N * 3 / 4));
        assert_eq!(world.quota(&b), Some(N * 3 / 4));

        // GPU 1 does not overcommit: the second such pod waits.
        let c = world.pod("c", &three_quarters, 1).await;
        world.started("c", &c).await;
        let d = world.pod("d", &three_quarters, 1).await;
        let message = world.unschedulable("d").await;
        assert!(message.contains("cannot allocate all claims"), "{message}");
        assert_eq!(world.quota(&d), None);
        world.stop().await;
    });
}
