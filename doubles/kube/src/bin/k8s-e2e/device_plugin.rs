//! `k8s-e2e --device-plugin`: a HAMi-style pod (`nvidia.com/gpu`: `--gpus`,
//! `nvidia.com/gpumem`, `nvidia.com/gpucores`) taken through the device
//! plugin (the official control plane, the agent of `serve --kubernetes
//! --device-plugin`, the kubelet double over the device plugin's sockets;
//! the pod is bound to the node by name, as no kubelet here advertises
//! `nvidia.com/gpu` to the scheduler); the
//! `Allocate` answer is written out as `env`, `mounts` and `device-nodes`,
//! in the same formats as the DRA mode's.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, ensure};
use hypervisor_kubernetes::DRIVER;
use hypervisor_kubernetes::deviceplugin::DevicePluginConfig;
use hypervisor_observer::GpuObserver;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, DeleteParams};
use kube_control_plane::ControlPlane;
use kube_fakes::device_kubelet::FakeDeviceKubelet;
use kube_fakes::node::{self, TestNode};
use kube_fakes::{cluster, cluster_node, node_kubelet};
use serde_json::json;

const NODE: &str = "e2e-node";

/// Runs the mode; `wait` serves until the caller's stop condition.
pub(crate) async fn run(
    out: &Path,
    limiter: &Path,
    observer: Arc<dyn GpuObserver>,
    (gpus, gpumem, gpucores): (usize, u64, u8),
    check_identity: bool,
    wait: impl std::future::Future<Output = anyhow::Result<()>>,
) -> anyhow::Result<()> {
    let plane = ControlPlane::start().await?;
    let client = plane.admin().await?;
    let kubelet_client = kube_control_plane::client(&plane.node_kubeconfig(NODE)?).await?;
    node_kubelet::register(&kubelet_client, NODE, cluster_node::gpu_labels()).await?;
    let dir = out.join("node");
    std::fs::create_dir_all(&dir)?;
    let mut options = node::options(&dir, NODE, DRIVER, limiter);
    options.check_identity = check_identity;
    options.kubeconfig = Some(plane.admin_kubeconfig().to_owned());
    let config = DevicePluginConfig::under(&dir.join("kubelet"), 10);
    std::fs::create_dir_all(&config.dir)?;
    options.device_plugin = Some(config.clone());
    let kubelet = FakeDeviceKubelet::start(&config.dir, Some(&config.pod_resources))?;
    let node = TestNode::start_written(observer, options, None).await?;
    let plugin = kubelet
        .plugin("nvidia.com/gpu", Duration::from_secs(10))
        .await?;
    let devices = plugin.devices().await?;
    let limits = json!({
        "nvidia.com/gpu": gpus.to_string(),
        "nvidia.com/gpumem": gpumem.to_string(),
        "nvidia.com/gpucores": gpucores.to_string(),
    });
    let pod = cluster::create_gpu_pod(&client, "default", "e2e", NODE, limits, json!({})).await?;
    kubelet.admit("default", "e2e", &["main"]);
    // The kubelet's pick: the first advertised shares; the plugin places
    // the container's GPUs itself.
    let shares: Vec<String> = devices.iter().take(gpus).map(|d| d.id.clone()).collect();
    ensure!(shares.len() == gpus, "{} devices advertised", devices.len());
    let share = shares.join(",");
    let answer = plugin
        .start_container(("default", "e2e", "main"), shares)
        .await
        .context("Allocate refused")?;
    let pod_uid = pod.metadata.uid.clone().unwrap_or_default();
    let mut env: Vec<String> = answer
        .envs
        .iter()
        .map(|(k, v)| format!("{k}={v}"))
        .collect();
    env.sort();
    std::fs::write(out.join("env"), env.join("\n") + "\n")?;
    let mounts: Vec<String> = answer
        .mounts
        .iter()
        .map(|m| {
            let mode = if m.read_only { "ro" } else { "rw" };
            format!(
                "{} {} {mode},nosuid,nodev,bind",
                m.host_path, m.container_path
            )
        })
        .collect();
    std::fs::write(out.join("mounts"), mounts.join("\n") + "\n")?;
    let nodes: Vec<&str> = answer
        .devices
        .iter()
        .map(|d| d.host_path.as_str())
        .collect();
    std::fs::write(out.join("device-nodes"), nodes.join("\n") + "\n")?;
    std::fs::write(out.join("cdi-devices"), format!("{share}\n"))?;
    crate::mark_ready(out, &pod_uid)?;
    println!("k8s-e2e: pod {pod_uid} allocated through the device plugin ({share})");
    println!(
        "k8s-e2e: env and mounts in {}; touch {}/stop to finish",
        out.display(),
        out.display()
    );
    wait.await?;
    std::fs::write(
        out.join("status.json"),
        serde_json::to_vec_pretty(&node.hv.status())?,
    )?;
    // The pod is deleted: the agent removes its claim, token and region.
    let now = DeleteParams {
        grace_period_seconds: Some(0),
        ..DeleteParams::default()
    };
    Api::<Pod>::namespaced(client, "default")
        .delete("e2e", &now)
        .await?;
    let token = node.options.provision.state_dir.join("pods").join(&pod_uid);
    let region =
        std::path::Path::new("/dev/shm").join(gpushare_utils::ledger::PodLedger::name_of(&pod_uid));
    for _ in 0..100 {
        if !token.exists() && !region.exists() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let clean = super::write_unprepared(out, None, &[("token", &token), ("region", &region)])?;
    node.stop().await;
    drop(plane);
    ensure!(clean, "deleting the pod left files behind");
    Ok(())
}
