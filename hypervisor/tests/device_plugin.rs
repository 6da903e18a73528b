//! The device plugin end to end without a cluster: the real agent (with
//! `--device-plugin`) against the fake API server, registered with and
//! called by the fake kubelet over the device plugin's Unix sockets, for
//! pods written for HAMi.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use hypervisor_kubernetes::deviceplugin::DevicePluginConfig;
use hypervisor_observer::{GpuObserver, SimulatedGpus};
use kube_fakes::apiserver::FakeApiServer;
use kube_fakes::cluster;
use kube_fakes::device_kubelet::{FakeDeviceKubelet, PluginClient};
use kube_fakes::node::{self, TestNode};
use serde_json::{Value, json};

const NODE: &str = "node-dp";
const GPU: &str = "nvidia.com/gpu";

struct World {
    dir: PathBuf,
    pods: Vec<String>,
    api: FakeApiServer,
    client: kube::Client,
    kubelet: FakeDeviceKubelet,
    node: Option<TestNode>,
    plugin: PluginClient,
    gpus: Arc<SimulatedGpus>,
}

impl World {
    async fn start(tag: &str, pod_resources: bool) -> Self {
        let dir = std::env::temp_dir().join(format!("hv-dp-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let limiter = dir.join("libcuda_limiter.so");
        std::fs::write(&limiter, b"").unwrap();
        let api = FakeApiServer::start().await.unwrap();
        let mut options = node::options(&dir, NODE, "gpu.gpushare.dev", &limiter);
        options.check_identity = false;
        let mut config = DevicePluginConfig::under(&dir.join("kubelet"), 4);
        if !pod_resources {
            config.pod_resources = dir.join("no-pod-resources.sock");
        }
        options.device_plugin = Some(config.clone());
        std::fs::create_dir_all(&config.dir).unwrap();
        let kubelet =
            FakeDeviceKubelet::start(&config.dir, pod_resources.then_some(&*config.pod_resources))
                .unwrap();
        api.write_kubeconfig(&dir.join("kubeconfig")).unwrap();
        let client = hypervisor_kubernetes::client(Some(&dir.join("kubeconfig")))
            .await
            .unwrap();
        cluster::create_node(&client, NODE).await.unwrap();
        let gpus = Arc::new(SimulatedGpus::new(2));
        let observer: Arc<dyn GpuObserver> = gpus.clone();
        let node = TestNode::start(&api, observer, options).await.unwrap();
        let plugin = kubelet.plugin(GPU, Duration::from_secs(10)).await.unwrap();
        Self {
            dir,
            pods: Vec::new(),
            api,
            client,
            kubelet,
            node: Some(node),
            plugin,
            gpus,
        }
    }

    /// A pending HAMi-style pod, admitted by the kubelet; returns its UID.
    async fn pod(&mut self, name: &str, limits: Value, annotations: Value) -> String {
        let pod = cluster::create_gpu_pod(&self.client, "default", name, NODE, limits, annotations)
            .await
            .unwrap();
        self.kubelet.admit("default", name, &["main"]);
        let uid = pod.metadata.uid.unwrap();
        self.pods.push(uid.clone());
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
                ("default", name, "main"),
                devices.iter().map(|d| (*d).to_owned()).collect(),
            )
            .await
            .map_err(|e| e.to_string())
    }

    fn uuid(&self, index: usize) -> String {
        self.gpus.gpus().unwrap()[index].uuid.clone()
    }

    fn pod_gpu(&self, uid: &str) -> Option<Value> {
        let status = serde_json::to_value(self.node.as_ref()?.hv.status()).unwrap();
        status["pods"]
            .as_array()?
            .iter()
            .find(|p| p["id"] == uid)
            .map(|p| p["gpus"][0].clone())
    }

    fn events(&self, uid: &str) -> Vec<(String, String)> {
        self.api
            .list("events")
            .into_iter()
            .filter(|e| e["involvedObject"]["uid"] == uid)
            .map(|e| {
                (
                    e["reason"].as_str().unwrap_or_default().to_owned(),
                    e["message"].as_str().unwrap_or_default().to_owned(),
                )
            })
            .collect()
    }

    async fn stop(mut self) {
        if let Some(node) = self.node.take() {
            node.stop().await;
        }
    }
}

impl Drop for World {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
        for pod in &self.pods {
            for prefix in ["gpushare-pod-", "gpushare-limits-"] {
                let _ = std::fs::remove_file(format!("/dev/shm/{prefix}{pod}"));
            }
        }
    }
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
}

#[test]
fn registers_lists_shares_and_allocates_a_hami_pod() {
    runtime().block_on(async {
        let mut world = World::start("alloc", true).await;
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
        let token = world.dir.join(format!("state/pods/{uid}/gpushare-pod.json"));
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
        assert_eq!(world.events(&uid)[0].0, "GpuShareAllocated");

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

        // The node advertises the memory and compute names for the scheduler.
        let node = world.api.get("nodes", "", NODE).unwrap();
        assert_eq!(node["status"]["capacity"]["nvidia.com/gpumem"], "163840");
        assert_eq!(node["status"]["allocatable"]["nvidia.com/gpucores"], "200");

        // The pod is deleted: its claim, token and region go.
        world.api.delete("pods", "default", "hami");
        for _ in 0..100 {
            if !std::path::Path::new(&region).exists() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        assert!(!std::path::Path::new(&region).exists());
        assert!(world.pod_gpu(&uid).is_none());
        world.stop().await;
    });
}

#[test]
fn a_pod_that_fits_nowhere_is_refused_with_an_event_without_pod_resources() {
    runtime().block_on(async {
        let mut world = World::start("refuse", false).await;
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
        let events = world.events(&c);
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
