//! The device plugin end to end on the official control plane, without a
//! real kubelet: `deploy/device-plugin` applied by `kubectl`; the Node
//! registered with the kubelet's credentials; the real agent (with
//! `--device-plugin`), on a token of the shipped ServiceAccount and exactly
//! its roles, registered with and called by the device-plugin kubelet
//! double over the device plugin's Unix sockets, for pods written for HAMi.
//! The pods are created by an administrator already bound to the node by
//! name, as HAMi's scheduler binds them: the kubelet double advertises no
//! `nvidia.com/gpu`, so the default scheduler would find no room for them
//! (`system-tests/tests/device_plugin_cluster.rs` covers the scheduler's
//! part). The agent's events and the node's capacity are read back from
//! the real API server.

use std::sync::Arc;
use std::time::Duration;

use hypervisor_observer::{GpuObserver, SimulatedGpus};
use k8s_openapi::api::core::v1::{Event, Node, Pod};
use kube::api::{Api, DeleteParams, ListParams, Preconditions};
use kube_fakes::device_kubelet::{FakeDeviceKubelet, PluginClient};
use kube_fakes::node::TestNode;
use kube_fakes::tenant::Tenant;
use serde_json::{Value, json};

use system_tests::scratch::Scratch;
use system_tests::wait::eventually_some_async;

use super::{DRIVER, device_plugin_kubelet, pod_status, runtime, tenant};

const GPU: &str = "nvidia.com/gpu";

/// Fields drop in order: the node, the device plugin's kubelet, the tenant
/// (its namespace and Node), then the scratch folder.
struct World {
    node: Option<TestNode>,
    kubelet: FakeDeviceKubelet,
    plugin: PluginClient,
    tenant: Tenant,
    gpus: Arc<SimulatedGpus>,
    scratch: Scratch,
}

impl World {
    /// A Node of the shared control plane (`deploy/device-plugin`
    /// applied) registered by its kubelet, and the agent with the device
    /// plugin on two GPUs (4 shares each); with `pod_resources`, the
    /// kubelet double serves the pod-resources list too.
    async fn start(tag: &str, pod_resources: bool) -> Self {
        let scratch = Scratch::with_limiter(&format!("dp-{tag}"));
        let dir = &scratch.dir;
        let tenant = tenant(&format!("dp-{tag}")).await;
        // The kubelet registers the Node before the agent starts.
        tenant.register_node().await.unwrap();
        let mut options = tenant.options(dir, DRIVER, &scratch.limiter());
        options.check_identity = false;
        let (config, kubelet) = device_plugin_kubelet(&dir.join("kubelet"), 4, pod_resources);
        options.device_plugin = Some(config);
        let gpus = Arc::new(SimulatedGpus::new(2));
        let observer: Arc<dyn GpuObserver> = gpus.clone();
        let node = TestNode::start_written(observer, options, None)
            .await
            .unwrap_or_else(|e| panic!("{e:#}"));
        let plugin = kubelet.plugin(GPU, Duration::from_secs(10)).await.unwrap();
        Self {
            node: Some(node),
            kubelet,
            plugin,
            tenant,
            gpus,
            scratch,
        }
    }

    fn dir(&self) -> &std::path::Path {
        &self.scratch.dir
    }

    /// A pending HAMi-style pod, admitted by the kubelet; returns its UID.
    /// Its container `main` has `limits` (HAMi's names; the API server
    /// takes extended resources in whole numbers, and sets the requests to
    /// the limits) and the pod `annotations`. It is created bound to the
    /// node by name (see the module's comment).
    async fn pod(&self, name: &str, limits: Value, annotations: Value) -> String {
        let ns = self.tenant.namespace();
        let pod = json!({
            "metadata": {"name": name, "namespace": ns, "annotations": annotations},
            "spec": {
                "nodeName": self.tenant.node(),
                "containers": [{"name": "main", "image": "cuda", "resources": {"limits": limits}}],
            },
        });
        let pod: Pod = serde_json::from_value(pod).unwrap();
        let uid = Api::<Pod>::default_namespaced(self.tenant.client.clone())
            .create(&Default::default(), &pod)
            .await
            .unwrap_or_else(|e| panic!("pod {name}: {e}"))
            .metadata
            .uid
            .unwrap();
        self.scratch.track_pod(&uid);
        self.kubelet.admit(ns, name, &["main"]);
        uid
    }

    async fn start_container(
        &self,
        name: &str,
        devices: &[&str],
    ) -> Result<hypervisor_kubernetes::deviceplugin::pb::v1beta1::ContainerAllocateResponse, String>
    {
        self.plugin
            .start_container(
                (self.tenant.namespace(), name, "main"),
                devices.iter().map(|d| (*d).to_owned()).collect(),
            )
            .await
            .map_err(|e| e.to_string())
    }

    fn uuid(&self, index: usize) -> String {
        self.gpus.gpus().unwrap()[index].uuid.clone()
    }

    fn pod_gpu(&self, uid: &str) -> Option<Value> {
        pod_status(&self.node.as_ref()?.hv, uid).map(|p| p["gpus"][0].clone())
    }

    /// The (reason, message) of the events the API server holds about pod
    /// `uid`, once there is one: the agent records them before it answers
    /// the kubelet.
    async fn events(&self, uid: &str) -> Vec<(String, String)> {
        let events = Api::<Event>::default_namespaced(self.tenant.client.clone());
        let about = ListParams::default().fields(&format!("involvedObject.uid={uid}"));
        eventually_some_async(&format!("an event about pod {uid}"), || async {
            let listed = events.list(&about).await.unwrap();
            let found: Vec<(String, String)> = listed
                .items
                .into_iter()
                .filter(|e| e.involved_object.uid.as_deref() == Some(uid))
                .map(|e| (e.reason.unwrap_or_default(), e.message.unwrap_or_default()))
                .collect();
            (!found.is_empty()).then_some(found)
        })
        .await
    }

    /// The Node's status as the API server stores it, once the agent
    /// advertised its names there.
    async fn node_status(&self) -> Value {
        let nodes = Api::<Node>::all(self.tenant.client.clone());
        eventually_some_async("the agent's capacity on the Node", || async {
            let node = nodes.get(self.tenant.node()).await.unwrap();
            let node = serde_json::to_value(node).unwrap();
            let status = node["status"].clone();
            status["allocatable"]
                .get("nvidia.com/gpucores")
                .is_some()
                .then_some(status)
        })
        .await
    }

    /// Deletes pod `name` (UID `uid`) as a user does, then as its kubelet
    /// confirms once the containers stopped (at once, for that UID); waits
    /// until the API server no longer has it.
    async fn delete_pod(&self, name: &str, uid: &str) {
        let pods = Api::<Pod>::default_namespaced(self.tenant.client.clone());
        pods.delete(name, &DeleteParams::default()).await.unwrap();
        let confirm = DeleteParams {
            grace_period_seconds: Some(0),
            preconditions: Some(Preconditions {
                uid: Some(uid.to_owned()),
                resource_version: None,
            }),
            ..DeleteParams::default()
        };
        pods.delete(name, &confirm).await.unwrap();
        eventually_some_async(&format!("pod {name} gone"), || async {
            pods.get_opt(name).await.unwrap().is_none().then_some(())
        })
        .await;
    }

    async fn stop(mut self) {
        if let Some(node) = self.node.take() {
            node.stop().await;
        }
    }
}

#[test]
fn registers_lists_shares_and_allocates_a_hami_pod() {
    runtime().block_on(async {
        let world = World::start("alloc", true).await;
        let registered = &world.plugin.registered;
        assert_eq!(
            (registered.version.as_str(), registered.resource_name.as_str()),
            ("v1beta1", GPU)
        );
        assert!(registered.options.as_ref().unwrap().pre_start_required);
        let devices = world.plugin.devices().await.unwrap();
        let (gpu0, gpu1) = (world.uuid(0), world.uuid(1));
        let ids: Vec<&str> = devices.iter().map(|d| d.id.as_str()).collect();
        assert_eq!(ids.len(), 8);
        assert!(ids.contains(&format!("{gpu1}::3").as_str()), "{ids:?}");
        assert!(devices.iter().all(|d| d.health == "Healthy"));

        let uid = world
            .pod(
                "hami",
                json!({"nvidia.com/gpu": "1", "nvidia.com/gpumem": "4096", "nvidia.com/gpucores": "30"}),
                json!({}),
            )
            .await;
        // The kubelet's choice of share does not decide the GPU: the plugin does.
        let answer = world
            .start_container("hami", &[&format!("{gpu1}::2")])
            .await
            .unwrap();
        let env = &answer.envs;
        assert_eq!(env["CUDA_VISIBLE_DEVICES"], gpu0);
        // The pod, the daemon and the token are the pod file's: no variable.
        assert!(!env.keys().any(|k| k.starts_with("CUDA_LIMITER_")), "{env:?}");
        let mounts: Vec<(&str, &str, bool)> = answer
            .mounts
            .iter()
            .map(|m| (m.host_path.as_str(), m.container_path.as_str(), m.read_only))
            .collect();
        let region = format!("/dev/shm/gpushare-pod-{uid}");
        let token = world.dir().join(format!("state/pods/{uid}/gpushare-pod.json"));
        assert!(mounts.contains(&(region.as_str(), region.as_str(), false)), "{mounts:?}");
        let limits = format!("/dev/shm/gpushare-limits-{uid}");
        assert!(mounts.contains(&(limits.as_str(), limits.as_str(), true)), "{mounts:?}");
        assert!(mounts.contains(&(
            token.to_str().unwrap(),
            "/usr/local/gpushare/lib/gpushare-pod.json",
            true
        )));
        assert!(mounts.iter().any(|m| m.1 == "/etc/ld.so.preload" && m.2));
        assert!(mounts.iter().any(|m| m.1 == "/usr/local/gpushare/lib/libcuda_limiter.so" && m.2));
        assert!(answer.devices.iter().any(|d| d.host_path == "/dev/nvidia0" && d.permissions == "rw"));
        assert!(std::path::Path::new(&region).exists());
        let pod_file: gpushare_utils::pod_file::PodFile =
            serde_json::from_slice(&std::fs::read(&token).unwrap()).unwrap();
        assert_eq!(pod_file.pod, uid);
        assert_eq!(pod_file.hypervisor, world.node.as_ref().unwrap().hv_url);
        assert_eq!(pod_file.token.len(), 64);
        let gpu = world.pod_gpu(&uid).expect("pod in the hypervisor");
        assert_eq!(
            (gpu["uuid"].as_str(), gpu["memory_quota"].as_u64(), gpu["cap_percent"].as_u64()),
            (Some(gpu0.as_str()), Some(4 << 30), Some(30))
        );
        assert_eq!(world.events(&uid).await[0].0, "GpuShareAllocated");

        // A second pod shares the GPU (binpack); a third asks to spread.
        let b = world
            .pod(
                "second",
                json!({"nvidia.com/gpu": "1", "nvidia.com/gpumem-percentage": "25", "nvidia.com/gpucores": "50"}),
                json!({}),
            )
            .await;
        let answer = world.start_container("second", &[&format!("{gpu0}::1")]).await.unwrap();
        assert_eq!(answer.envs["CUDA_VISIBLE_DEVICES"], gpu0);
        let gpu = world.pod_gpu(&b).unwrap();
        assert_eq!(
            (gpu["memory_quota"].as_u64(), gpu["cap_percent"].as_u64()),
            (Some(20 << 30), Some(50))
        );
        let c = world
            .pod(
                "spread",
                json!({"nvidia.com/gpu": "1", "nvidia.com/gpumem": "1024"}),
                json!({"hami.io/gpu-scheduler-policy": "spread"}),
            )
            .await;
        let answer = world.start_container("spread", &[&format!("{gpu0}::2")]).await.unwrap();
        assert_eq!(answer.envs["CUDA_VISIBLE_DEVICES"], gpu1);
        // No gpucores: no compute limit.
        assert_eq!(world.pod_gpu(&c).unwrap()["cap_percent"], Value::Null);

        // The node advertises the memory and compute names for the
        // scheduler, stored by the real API server.
        let status = world.node_status().await;
        assert_eq!(status["capacity"]["nvidia.com/gpumem"], "163840");
        assert_eq!(status["allocatable"]["nvidia.com/gpucores"], "200");

        // The pod is deleted: its claim, token and region go.
        world.delete_pod("hami", &uid).await;
        eventually_some_async("the deleted pod's region removed", || async {
            (!std::path::Path::new(&region).exists()).then_some(())
        })
        .await;
        assert!(!std::path::Path::new(&region).exists());
        assert!(world.pod_gpu(&uid).is_none());
        world.stop().await;
    });
}

#[test]
fn a_pod_that_fits_nowhere_is_refused_with_an_event_without_pod_resources() {
    runtime().block_on(async {
        let world = World::start("refuse", false).await;
        let gpu0 = world.uuid(0);
        // 70 GiB on GPU 0, then 20 GiB fits only on GPU 1 (fragmentation
        // resolved here), then 70 GiB fits nowhere.
        let a = world
            .pod("big", json!({"nvidia.com/gpu": "1", "nvidia.com/gpumem": "71680", "nvidia.com/gpucores": "10"}), json!({}))
            .await;
        world.start_container("big", &[&format!("{gpu0}::0")]).await.unwrap();
        let b = world
            .pod("mid", json!({"nvidia.com/gpu": "1", "nvidia.com/gpumem": "20480"}), json!({}))
            .await;
        let answer = world.start_container("mid", &[&format!("{gpu0}::1")]).await.unwrap();
        assert_eq!(answer.envs["CUDA_VISIBLE_DEVICES"], world.uuid(1));
        let c = world
            .pod("huge", json!({"nvidia.com/gpu": "1", "nvidia.com/gpumem": "71680"}), json!({}))
            .await;
        let refused = world
            .start_container("huge", &[&format!("{gpu0}::2")])
            .await
            .unwrap_err();
        assert!(refused.contains("0 of the node's GPUs fit"), "{refused}");
        let events = world.events(&c).await;
        assert_eq!(events.len(), 1, "{events:?}");
        assert_eq!(events[0].0, "GpuShareAllocationFailed");
        assert!(
            events[0].1.contains("asks for 1 GPU(s) with 71680 MiB")
                && events[0].1.contains("has 10240 of 81920 MiB"),
            "{events:?}"
        );
        assert!(world.pod_gpu(&c).is_none());
        assert!(world.pod_gpu(&a).is_some() && world.pod_gpu(&b).is_some());
        world.stop().await;
    });
}
