//! GPU health published to Kubernetes, end to end on the official control
//! plane: health events injected into simulated GPUs; the real agent, on a
//! token of the shipped ServiceAccount, taints the unhealthy GPU's device
//! in its ResourceSlice (read back from the real API server as it stored
//! it) and, in device-plugin mode (with the rights `deploy/device-plugin`
//! adds), leaves it out of the node's allocatable and lists its shares
//! unhealthy in the device-plugin kubelet double's `ListAndWatch`. The
//! kubelet double registers the Node with the node's credentials and keeps
//! it Ready.

use std::sync::Arc;
use std::time::Duration;

use gpu_fakes::FakeGpus;
use hypervisor_kubernetes::dra::slice::slice_name;
use hypervisor_observer::{GpuObserver, HealthEvent};
use k8s_openapi::api::core::v1::Node;
use k8s_openapi::api::resource::v1::{DeviceTaint, ResourceSlice};
use kube::api::Api;
use kube_fakes::cluster;
use kube_fakes::cluster_node::ClusterNode;
use kube_fakes::device_kubelet::{FakeDeviceKubelet, PluginClient};
use kube_fakes::tenant::Tenant;
use serde_json::json;

use system_tests::scratch::Scratch;
use system_tests::wait::eventually_some_async;

use super::{DRIVER, device_plugin_kubelet, runtime, tenant};

const GPU: &str = "nvidia.com/gpu";
const TAINT_KEY: &str = "gpu.gpushare.dev/unhealthy";

/// Fields drop in order: the node, the device plugin's kubelet, the tenant
/// (its namespace and Node), then the scratch folder.
struct World {
    node: Option<ClusterNode>,
    plugin: Option<(FakeDeviceKubelet, PluginClient)>,
    tenant: Tenant,
    gpus: Arc<FakeGpus>,
    scratch: Scratch,
}

impl World {
    /// A node of the shared control plane with two simulated GPUs; a
    /// device plugin too with `device_plugin`, with the rights
    /// `deploy/device-plugin` adds (events, the Node's status).
    async fn start(tag: &str, device_plugin: bool) -> Self {
        let scratch = Scratch::with_limiter(&format!("health-{tag}"));
        let d = &scratch.dir;
        let tenant = tenant(&format!("health-{tag}")).await;
        let mut options = tenant.options(d, DRIVER, &scratch.limiter());
        options.check_identity = false;
        let mut kubelet = None;
        if device_plugin {
            // Serves on the test's runtime, which this runs on.
            let (config, double) = device_plugin_kubelet(&d.join("kubelet"), 2, false);
            kubelet = Some(double);
            options.device_plugin = Some(config);
        }
        let gpus = Arc::new(FakeGpus::new(2));
        let observer: Arc<dyn GpuObserver> = gpus.clone();
        // The kubelet registers the Node, then the agent starts.
        let node = tenant.start_node(observer, options, None).await.unwrap();
        let plugin = match kubelet {
            Some(kubelet) => {
                let plugin = kubelet.plugin(GPU, Duration::from_secs(10)).await.unwrap();
                Some((kubelet, plugin))
            }
            None => None,
        };
        Self {
            node: Some(node),
            plugin,
            tenant,
            gpus,
            scratch,
        }
    }

    async fn slice(&self) -> ResourceSlice {
        Api::<ResourceSlice>::all(self.tenant.client.clone())
            .get(&slice_name(self.tenant.node(), DRIVER))
            .await
            .unwrap()
    }

    /// The slice once `done` holds of it.
    async fn slice_when(&self, done: impl Fn(&ResourceSlice) -> bool) -> ResourceSlice {
        eventually_some_async("the slice", || async {
            let slice = self.slice().await;
            done(&slice).then_some(slice)
        })
        .await
    }

    /// Starts a HAMi pod's container of 1 GiB, with `packing`, on `share`
    /// as the kubelet picks; returns the GPU it got. The pod is bound by
    /// name, as HAMi's scheduler binds: the kubelet double advertises no
    /// `nvidia.com/gpu`, so the default scheduler would find no room for it.
    async fn container(&mut self, name: &str, share: String, packing: &str) -> String {
        let ns = self.tenant.namespace();
        let pod = cluster::create_gpu_pod(
            &self.tenant.client,
            ns,
            name,
            self.tenant.node(),
            json!({"nvidia.com/gpu": "1", "nvidia.com/gpumem": "1024"}),
            json!({"hami.io/gpu-scheduler-policy": packing}),
        )
        .await
        .unwrap();
        self.scratch.track_pod(&pod.metadata.uid.unwrap());
        let (kubelet, plugin) = self.plugin.as_ref().expect("a device plugin");
        kubelet.admit(ns, name, &["main"]);
        let answer = plugin
            .start_container((ns, name, "main"), vec![share])
            .await
            .unwrap();
        answer.envs["CUDA_VISIBLE_DEVICES"].clone()
    }

    fn plugin(&self) -> &PluginClient {
        &self.plugin.as_ref().expect("a device plugin").1
    }

    async fn stop(mut self) {
        if let Some(node) = self.node.take() {
            node.stop().await;
        }
    }
}

/// The taints of each device, by name.
fn taints(slice: &ResourceSlice) -> Vec<(String, Vec<DeviceTaint>)> {
    slice
        .spec
        .devices
        .iter()
        .flatten()
        .map(|d| (d.name.clone(), d.taints.clone().unwrap_or_default()))
        .collect()
}

fn tainted(slice: &ResourceSlice) -> bool {
    taints(slice).iter().any(|(_, t)| !t.is_empty())
}

/// The one taint of `gpu-1` as (key, value, effect); `gpu-0` untainted.
fn gpu1_taint(slice: &ResourceSlice) -> (String, String, String) {
    let devices = taints(slice);
    assert_eq!(devices.len(), 2, "{devices:?}");
    assert_eq!(devices[0], ("gpu-0".to_owned(), Vec::new()));
    let (name, taints) = &devices[1];
    assert_eq!((name.as_str(), taints.len()), ("gpu-1", 1), "{taints:?}");
    let t = &taints[0];
    assert!(t.time_added.is_some());
    (
        t.key.clone(),
        t.value.clone().unwrap_or_default(),
        t.effect.clone(),
    )
}

/// Longer than the agent's resync (500 ms): whatever would be published is.
const SETTLE: Duration = Duration::from_millis(1_500);

#[test]
fn an_xid_taints_its_gpu_and_an_ignored_one_changes_nothing() {
    runtime().block_on(async {
        let world = World::start("xid", false).await;
        let first = world.slice().await;
        assert!(!tainted(&first), "{:?}", taints(&first));
        let generation = first.spec.pool.generation;

        // XID 13 is the application's: nothing changes.
        assert!(!world.gpus.inject(1, HealthEvent::Xid(Some(13))).unwrap());
        tokio::time::sleep(SETTLE).await;
        let same = world.slice().await;
        assert!(!tainted(&same));
        assert_eq!(same.spec.pool.generation, generation);
        assert_eq!(
            same.metadata.resource_version,
            first.metadata.resource_version
        );

        // XID 48 (double-bit ECC) is the GPU's: gpu-1 alone is tainted.
        assert!(world.gpus.inject(1, HealthEvent::Xid(Some(48))).unwrap());
        let slice = world.slice_when(tainted).await;
        assert_eq!(
            gpu1_taint(&slice),
            (
                TAINT_KEY.to_owned(),
                "xid-48".to_owned(),
                "NoSchedule".to_owned()
            )
        );
        assert!(slice.spec.pool.generation > generation);
        let generation = slice.spec.pool.generation;

        // The GPU answering again is no reset: the taint stays, and the
        // slice is not rewritten at each resync.
        assert!(!world.gpus.inject(1, HealthEvent::Found).unwrap());
        tokio::time::sleep(SETTLE).await;
        let kept = world.slice().await;
        assert_eq!(gpu1_taint(&kept).1, "xid-48");
        assert_eq!(kept.spec.pool.generation, generation);

        // Off the bus: the worse XID replaces it, and evicts.
        assert!(world.gpus.inject(1, HealthEvent::Xid(Some(79))).unwrap());
        let slice = world
            .slice_when(|s| {
                taints(s)[1].1.first().and_then(|t| t.value.as_deref()) == Some("xid-79")
            })
            .await;
        assert_eq!(gpu1_taint(&slice).2, "NoExecute");
        assert!(slice.spec.pool.generation > generation);
        world.stop().await;
    });
}

#[test]
fn a_lost_gpu_is_tainted_until_it_answers_again() {
    runtime().block_on(async {
        let world = World::start("lost", false).await;
        let generation = world.slice().await.spec.pool.generation;

        assert!(world.gpus.inject(1, HealthEvent::Lost).unwrap());
        let lost = world.slice_when(tainted).await;
        assert_eq!(
            gpu1_taint(&lost),
            (
                TAINT_KEY.to_owned(),
                "gpu-lost".to_owned(),
                "NoExecute".to_owned()
            )
        );
        assert!(lost.spec.pool.generation > generation);
        let node = &world.node.as_ref().unwrap().node;
        assert_eq!(
            node.hv.unhealthy_gpus().keys().collect::<Vec<_>>(),
            [&FakeGpus::uuid(1)]
        );

        assert!(world.gpus.inject(1, HealthEvent::Found).unwrap());
        let back = world.slice_when(|s| !tainted(s)).await;
        assert!(back.spec.pool.generation > lost.spec.pool.generation);
        assert!(node.hv.unhealthy_gpus().is_empty());
        world.stop().await;
    });
}

#[test]
fn the_device_plugin_lists_an_unhealthy_gpu_as_unhealthy_and_places_nothing_on_it() {
    runtime().block_on(async {
        let mut world = World::start("dp", true).await;
        let (gpu0, gpu1) = (FakeGpus::uuid(0), FakeGpus::uuid(1));
        let devices = world.plugin().devices().await.unwrap();
        assert_eq!(devices.len(), 4);
        assert!(devices.iter().all(|d| d.health == "Healthy"));
        // A first container on gpu-0, so that one asking to spread would
        // go to gpu-1 were it healthy.
        let first = world
            .container("first", format!("{gpu1}::0"), "binpack")
            .await;
        assert_eq!(first, gpu0);

        assert!(!world.gpus.inject(1, HealthEvent::Xid(Some(31))).unwrap());
        assert!(world.gpus.inject(1, HealthEvent::Xid(Some(94))).unwrap());
        let devices = eventually_some_async("gpu-1's shares unhealthy", || async {
            let devices = world.plugin().devices().await.unwrap();
            devices
                .iter()
                .any(|d| d.health == "Unhealthy")
                .then_some(devices)
        })
        .await;
        for device in &devices {
            let on_gpu1 = device.id.starts_with(&format!("{gpu1}::"));
            assert!(on_gpu1 || device.id.starts_with(&format!("{gpu0}::")));
            let expected = if on_gpu1 { "Unhealthy" } else { "Healthy" };
            assert_eq!(device.health, expected, "{devices:?}");
        }
        // The slice says so too, and the node's allocatable leaves gpu-1 out.
        assert_eq!(gpu1_taint(&world.slice_when(tainted).await).1, "xid-94");
        let nodes = Api::<Node>::all(world.tenant.client.clone());
        let status = eventually_some_async("gpu-1 out of the node's allocatable", || async {
            let status = nodes.get(world.tenant.node()).await.unwrap().status?;
            let memory = status.allocatable.as_ref()?.get("nvidia.com/gpumem")?;
            (memory.0 == "81920").then_some(status)
        })
        .await;
        let capacity = status.capacity.unwrap_or_default();
        assert_eq!(capacity["nvidia.com/gpumem"].0, "163840");

        // A pod that asks to spread goes to gpu-0 whichever share the
        // kubelet picked: gpu-1 takes no new container.
        assert_eq!(
            world
                .container("second", format!("{gpu1}::1"), "spread")
                .await,
            gpu0
        );
        world.stop().await;
    });
}
