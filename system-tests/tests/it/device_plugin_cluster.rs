//! The device-plugin mode on the official control plane, as far as the API
//! goes without a real kubelet: `deploy/device-plugin` applied by
//! `kubectl`; the agent, on the shipped ServiceAccount's token and exactly
//! its roles, advertises the HAMi memory and compute names as the node's
//! capacity, which the real API server stores; the kubelet double lists the
//! plugin's shares and advertises them as `nvidia.com/gpu`, as a kubelet
//! does; a pod written for HAMi is accepted by the real API server and
//! placed by the real scheduler on those names, and its container's
//! `Allocate` gives it its limits; a pod asking more than the node has
//! stays pending with the scheduler's reason. The control plane is the one
//! the binary's tests share: the pods are pinned to the test's Node, as
//! other tests' nodes advertise the same names.

use std::sync::Arc;
use std::time::Duration;

use hypervisor_observer::{GpuObserver, SimulatedGpus};
use k8s_openapi::api::core::v1::Node;
use kube::api::{Api, Patch, PatchParams};
use kube_fakes::node::TestNode;
use serde_json::{Value, json};
use system_tests::scratch::Scratch;
use system_tests::wait::eventually_some;

use crate::cluster::{DRIVER, device_plugin_kubelet, pod_status, runtime, tenant};

const GPU: &str = "nvidia.com/gpu";

/// A HAMi pod `name` for node `node` asking `gpumem` MiB and `gpucores`
/// percent of one GPU.
fn hami_pod(node: &str, name: &str, gpumem: u64, gpucores: u8) -> String {
    format!(
        r#"apiVersion: v1
kind: Pod
metadata:
  name: {name}
spec:
  nodeSelector:
    kubernetes.io/hostname: {node}
  containers:
    - name: main
      image: cuda
      resources:
        limits:
          nvidia.com/gpu: 1
          nvidia.com/gpumem: {gpumem}
          nvidia.com/gpucores: {gpucores}
"#
    )
}

#[test]
fn a_hami_pod_is_placed_by_the_real_scheduler_on_the_names_the_agent_advertises() {
    let scratch = Scratch::new("dp-cluster");
    let d = &scratch.dir;
    let runtime = runtime();
    // The kubelet double serves on this runtime.
    let _entered = runtime.enter();
    let tenant = runtime.block_on(tenant("dp-cluster"));
    let (kubectl, node_name) = (&tenant.kubectl, tenant.node());
    let applied = tenant.applied();
    assert!(
        applied.contains("clusterrole.rbac.authorization.k8s.io/gpushare-device-plugin created"),
        "{applied}"
    );

    // The kubelet registers the Node; the agent starts with the device
    // plugin, which registers with the kubelet double.
    let kubelet_client = runtime.block_on(tenant.register_node()).unwrap();
    let limiter = d.join("libcuda_limiter.so");
    std::fs::write(&limiter, b"").unwrap();
    let mut options = tenant.options(d, DRIVER, &limiter);
    options.check_identity = false;
    let (config, device_kubelet) = device_plugin_kubelet(&d.join("kubelet"), 4, true);
    options.device_plugin = Some(config);
    let gpus: Arc<dyn GpuObserver> = Arc::new(SimulatedGpus::new(2));
    let node = runtime
        .block_on(TestNode::start_written(gpus, options, None))
        .unwrap_or_else(|e| panic!("{e:#}"));
    let plugin = runtime
        .block_on(device_kubelet.plugin(GPU, Duration::from_secs(10)))
        .unwrap();
    // The kubelet's part: the plugin's shares become nvidia.com/gpu.
    let shares = runtime.block_on(plugin.devices()).unwrap().len();
    assert_eq!(shares, 8, "4 shares of each of 2 GPUs");
    let count = json!(shares.to_string());
    let patch = json!({"status": {"capacity": {GPU: count}, "allocatable": {GPU: count}}});
    runtime
        .block_on(Api::<Node>::all(kubelet_client).patch_status(
            node_name,
            &PatchParams::default(),
            &Patch::Merge(&patch),
        ))
        .unwrap();

    // The agent's own names, stored by the real server.
    let get = |what: &[&str]| -> Value {
        let mut args = vec!["get"];
        args.extend_from_slice(what);
        args.extend_from_slice(&["-o", "json"]);
        serde_json::from_str(&kubectl.ok(&args, None).unwrap()).unwrap()
    };
    let allocatable = eventually_some("the agent's capacity on the Node", || {
        let node = get(&["node", node_name]);
        let allocatable = node["status"]["allocatable"].clone();
        allocatable
            .get("nvidia.com/gpumem")
            .is_some()
            .then_some(allocatable)
    });
    let mib = 2 * (SimulatedGpus::new(2).gpus().unwrap()[0].memory_total >> 20);
    assert_eq!(allocatable["nvidia.com/gpumem"], json!(mib.to_string()));
    assert_eq!(allocatable["nvidia.com/gpucores"], json!("200"));
    assert_eq!(allocatable[GPU], json!("8"));

    // A HAMi pod: accepted, and placed on the node by the real scheduler.
    kubectl
        .ok(
            &["apply", "-f", "-"],
            Some(&hami_pod(node_name, "hami", 4096, 30)),
        )
        .unwrap();
    let pod = eventually_some("the HAMi pod scheduled", || {
        let pod = get(&["pod", "hami"]);
        (pod["spec"]["nodeName"] == node_name).then_some(pod)
    });
    let uid = pod["metadata"]["uid"].as_str().unwrap().to_owned();
    scratch.track_pod(&uid);
    // The kubelet admits it and allocates one share for its container.
    let ns = tenant.namespace();
    device_kubelet.admit(ns, "hami", &["main"]);
    let share = runtime.block_on(plugin.devices()).unwrap()[0].id.clone();
    let answer = runtime
        .block_on(plugin.start_container((ns, "hami", "main"), vec![share]))
        .unwrap_or_else(|e| panic!("{e}"));
    assert!(
        !answer.cdi_devices.is_empty() || !answer.envs.is_empty(),
        "{answer:?}"
    );
    let held = pod_status(&node.hv, &uid).expect("the pod in the hypervisor")["gpus"][0].clone();
    assert_eq!(
        (&held["memory_quota"], &held["cap_percent"]),
        (&json!(4096u64 << 20), &json!(30))
    );

    // More memory than the node has: pending, with the scheduler's reason.
    kubectl
        .ok(
            &["apply", "-f", "-"],
            Some(&hami_pod(node_name, "huge", mib + 1, 10)),
        )
        .unwrap();
    let reason = eventually_some("the scheduler's reason", || {
        let pod = get(&["pod", "huge"]);
        pod["status"]["conditions"]
            .as_array()
            .into_iter()
            .flatten()
            .find(|c| c["type"] == "PodScheduled" && c["status"] == "False")
            .and_then(|c| c["message"].as_str().map(str::to_owned))
    });
    assert!(
        reason.contains("Insufficient nvidia.com/gpumem"),
        "{reason}"
    );
    runtime.block_on(node.stop());
}
