//! `k8s-e2e`: a claim for a GPU fraction taken through the real DRA path
//! (the official control plane of `kube-control-plane`: its scheduler
//! allocates the claim; the agent and hypervisor of `serve --kubernetes`;
//! the kubelet double preparing it over the plugin's Unix sockets), on the
//! machine's GPUs or simulated ones; then exactly what the CDI spec gives a
//! container is written out for `scripts/gpu/k8s_e2e.sh`:
//!
//! - `OUT/env`: the spec's variables, `KEY=VALUE` a line;
//! - `OUT/mounts`: `HOST_PATH CONTAINER_PATH OPTIONS` a line;
//! - `OUT/device-nodes`: one path a line;
//! - `OUT/cdi-spec.json`, `OUT/cdi-devices` (the IDs prepare returned);
//! - `OUT/ready`: written last (the pod UID).
//!
//! The hypervisor then serves until `OUT/stop` appears (or SIGTERM); at the
//! end it writes `OUT/status.json` (pods, workers, memory used), deletes the
//! pod (the kubelet unprepares the claim) and writes `OUT/unprepared`
//! (`clean` when spec, token and region are gone).
//!
//! The control plane is the program `$GPUSHARE_CONTROL_PLANE` names, or the
//! one the test command built under `target/control-plane/`. The agent runs
//! with the administrator's credentials here: no `kubectl` installs
//! `deploy/base`'s ServiceAccount on a GPU machine (the tests run it with
//! exactly that role).
//!
//! `--device-plugin` takes a HAMi-style pod (`--gpumem` MiB, `--gpucores`
//! percent) through the device plugin instead; the files are the same, from
//! the `Allocate` answer, and the end deletes the pod.
//!
//! `--corun` puts the claim's GPU in co-run mode first (see `corun`).

mod corun;
mod device_plugin;

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, ensure};
use clap::Parser;
use hypervisor_kubernetes::DRIVER;
use hypervisor_observer::{GpuObserver, NvmlObserver, SimulatedGpus};
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::resource::v1::{DeviceClass, ResourceClaim, ResourceSlice};
use kube::api::{Api, DeleteParams, ListParams, PostParams};
use kube_control_plane::ControlPlane;
use kube_fakes::cluster_node::{self, ClusterNode};
use kube_fakes::node;
use serde_json::Value;

#[derive(Parser)]
#[command(
    name = "k8s-e2e",
    about = "The DRA path end to end on the official control plane"
)]
struct Args {
    /// Where the env, mounts and the rest are written (created).
    #[arg(long)]
    out: PathBuf,
    /// The limiter library (the host path the CDI spec mounts).
    #[arg(long)]
    limiter: PathBuf,
    #[arg(long, default_value = "4Gi")]
    memory: String,
    #[arg(long, default_value = "30")]
    compute: String,
    /// The slice devices to allocate, comma-separated: several make one
    /// request for as many GPUs, each with `--memory` and `--compute`.
    #[arg(long, default_value = "gpu-0")]
    device: String,
    /// Simulate N GPUs instead of asking NVML.
    #[arg(long, value_name = "N")]
    simulate_gpus: Option<u32>,
    /// Accept workers outside the pod's cgroup (programs started by hand).
    #[arg(long)]
    skip_identity: bool,
    /// Through the device plugin, with a HAMi-style pod, instead of a claim.
    #[arg(long)]
    device_plugin: bool,
    /// Device plugin: `nvidia.com/gpu`, the GPUs the container asks.
    #[arg(long, default_value_t = 1)]
    gpus: usize,
    /// Device plugin: `nvidia.com/gpumem` (MiB).
    #[arg(long, default_value_t = 4096)]
    gpumem: u64,
    /// Device plugin: `nvidia.com/gpucores` (percent).
    #[arg(long, default_value_t = 30, value_parser = clap::value_parser!(u8).range(0..=100))]
    gpucores: u8,
    /// Stop by itself after this many seconds.
    #[arg(long, default_value_t = 600)]
    max_seconds: u64,
    /// The claim's GPU in co-run mode: its pods are MPS clients of the
    /// control daemon this run supervises (DRA only).
    #[arg(long, conflicts_with = "device_plugin")]
    corun: bool,
    /// With --corun: the nvidia-cuda-mps-control program.
    #[arg(long, default_value = hypervisor_corun::DEFAULT_MPS_CONTROL)]
    mps_control: PathBuf,
}

fn main() {
    if let Err(error) = run(Args::parse()) {
        eprintln!("k8s-e2e: {error:#}");
        std::process::exit(1);
    }
}

fn run(args: Args) -> anyhow::Result<()> {
    gpushare_utils::logging::init_quieting(
        "HYPERVISOR_LOG",
        hypervisor_kubernetes::QUIET_LOG_TARGETS,
    );
    std::fs::create_dir_all(&args.out)
        .with_context(|| format!("cannot create {}", args.out.display()))?;
    let out = args.out.canonicalize()?;
    let limiter = args
        .limiter
        .canonicalize()
        .with_context(|| format!("no limiter at {}", args.limiter.display()))?;
    let observer: Arc<dyn GpuObserver> = match args.simulate_gpus {
        Some(n) => Arc::new(SimulatedGpus::new(n)),
        None => Arc::new(
            NvmlObserver::new()
                .context("NVML is not available; --simulate-gpus N runs without it")?,
        ),
    };
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    if args.device_plugin {
        let wait = wait_for_stop(out.clone(), args.max_seconds);
        return runtime.block_on(device_plugin::run(
            &out,
            &limiter,
            observer,
            (args.gpus, args.gpumem, args.gpucores),
            !args.skip_identity,
            wait,
        ));
    }
    runtime.block_on(dra(args, out, limiter, observer))
}

/// The shipped DeviceClass.
const DEVICE_CLASS: &str = include_str!("../../../../../deploy/base/deviceclass.yaml");

async fn dra(
    args: Args,
    out: PathBuf,
    limiter: PathBuf,
    observer: Arc<dyn GpuObserver>,
) -> anyhow::Result<()> {
    let plane = ControlPlane::start().await?;
    let client = plane.admin().await?;
    let class: DeviceClass = serde_yaml::from_str(DEVICE_CLASS)?;
    Api::<DeviceClass>::all(client.clone())
        .create(&PostParams::default(), &class)
        .await?;
    let mut options = node::options(&out.join("node"), "e2e-node", DRIVER, &limiter);
    options.kubeconfig = Some(plane.admin_kubeconfig().to_owned());
    options.check_identity = !args.skip_identity;
    std::fs::create_dir_all(out.join("node"))?;
    let devices: Vec<u32> = args
        .device
        .split(',')
        .map(|d| {
            d.trim()
                .strip_prefix("gpu-")
                .and_then(|n| n.parse().ok())
                .with_context(|| format!("--device {d}: not gpu-N"))
        })
        .collect::<anyhow::Result<_>>()?;
    ensure!(
        !(args.corun && devices.len() > 1),
        "--corun takes one --device: an MPS client sees one co-run GPU"
    );
    let mps = if args.corun {
        Some(corun::options(
            &observer,
            devices[0],
            &out.join("node").join("mps"),
            &args.mps_control,
        )?)
    } else {
        None
    };
    let gpu_count = observer.gpus()?.len();
    let cluster = ClusterNode::start(&plane, observer, options, mps.clone()).await?;
    if let (Some(mps), Some(board)) = (mps, cluster.node.corun_board()) {
        let out = out.clone();
        tokio::task::spawn_blocking(move || corun::wait_up(&board, &mps, &out)).await??;
    }
    // One GPU: pinned by a CEL selector on its index; several: a request
    // for as many, which the scheduler spreads over distinct GPUs.
    ensure!(
        devices.len() == 1 || devices.len() == gpu_count,
        "--device names one GPU or every GPU of the node ({gpu_count})"
    );
    let pin = (devices.len() == 1).then(|| devices[0]);
    let claim = cluster_node::claim(
        "e2e-gpu",
        DRIVER,
        devices.len(),
        (&args.memory, &args.compute),
        pin,
        None,
    );
    let claim: ResourceClaim = serde_json::from_value(claim)?;
    let claims = Api::<ResourceClaim>::namespaced(client.clone(), "default");
    let claim = claims.create(&PostParams::default(), &claim).await?;
    let pod: Pod = serde_json::from_value(cluster_node::pod("e2e", "e2e-node", &["e2e-gpu"]))?;
    let pods = Api::<Pod>::namespaced(client.clone(), "default");
    let pod = pods.create(&PostParams::default(), &pod).await?;
    let uid = claim.metadata.uid.clone().unwrap_or_default();
    let pod_uid = pod.metadata.uid.clone().unwrap_or_default();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(120);
    while !cluster.kubelet.started(&pod_uid) {
        ensure!(
            tokio::time::Instant::now() < deadline,
            "the pod did not start in 120 s (kubelet: {:?})",
            cluster.kubelet.last_error()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let prepared = cluster
        .kubelet
        .prepared()
        .into_iter()
        .find(|p| p.uid == uid)
        .context("the claim is not prepared")?;
    let cdi: Vec<String> = prepared
        .devices
        .iter()
        .flat_map(|(_, ids)| ids.clone())
        .collect();
    let node = &cluster.node;
    let spec_path = node
        .options
        .provision
        .cdi_dir
        .join(format!("gpushare.dev-gpu_{uid}.json"));
    write_outputs(&out, &spec_path, &cdi)?;
    // The node's slice as the API stored it: the GPUs as NVML sees them,
    // and a taint on any the health watch found unhealthy.
    let slices = Api::<ResourceSlice>::all(client.clone())
        .list(&ListParams::default())
        .await?;
    std::fs::write(
        out.join("resourceslice.json"),
        serde_json::to_vec_pretty(&slices.items)?,
    )?;
    mark_ready(&out, &pod_uid)?;
    println!(
        "k8s-e2e: claim {uid} of pod {pod_uid} prepared: {}",
        cdi.join(" ")
    );
    println!(
        "k8s-e2e: env and mounts in {}; touch {}/stop to finish",
        out.display(),
        out.display()
    );

    wait_for_stop(out.clone(), args.max_seconds).await?;
    std::fs::write(
        out.join("status.json"),
        serde_json::to_vec_pretty(&node.hv.status())?,
    )?;
    // The pod deleted: the kubelet unprepares the claim, then confirms.
    pods.delete("e2e", &DeleteParams::default()).await?;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    while !cluster.kubelet.unprepared().contains(&uid) && tokio::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let error = (!cluster.kubelet.unprepared().contains(&uid)).then(|| {
        format!(
            "error=\"not unprepared: {}\"",
            cluster.kubelet.last_error().unwrap_or_default()
        )
    });
    let token = node.options.provision.state_dir.join("pods").join(&pod_uid);
    let region = Path::new("/dev/shm").join(gpushare_utils::ledger::PodLedger::name_of(&pod_uid));
    let clean = write_unprepared(
        &out,
        error,
        &[("spec", &spec_path), ("token", &token), ("region", &region)],
    )?;
    // Stopping the node quits the MPS control daemon too.
    cluster.stop().await;
    drop(plane);
    ensure!(clean, "unprepare left files behind");
    Ok(())
}

/// Writes `OUT/unprepared`: `clean`, or what is left (an error, and which
/// of `files` still exist); returns whether it was clean.
fn write_unprepared(
    out: &Path,
    error: Option<String>,
    files: &[(&str, &Path)],
) -> anyhow::Result<bool> {
    let left: Vec<String> = error
        .into_iter()
        .chain(
            files
                .iter()
                .filter(|(_, path)| path.exists())
                .map(|(name, _)| (*name).to_owned()),
        )
        .collect();
    let text = if left.is_empty() {
        "clean\n".to_owned()
    } else {
        format!("left: {}\n", left.join(" "))
    };
    std::fs::write(out.join("unprepared"), text)?;
    Ok(left.is_empty())
}

/// Until `OUT/stop` appears, SIGTERM, or `max_seconds`.
async fn wait_for_stop(out: PathBuf, max_seconds: u64) -> anyhow::Result<()> {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(max_seconds);
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    while !out.join("stop").exists() && tokio::time::Instant::now() < deadline {
        tokio::select! {
            _ = tokio::time::sleep(Duration::from_millis(200)) => {}
            _ = term.recv() => break,
        }
    }
    Ok(())
}

fn write_outputs(out: &Path, spec_path: &Path, cdi: &[String]) -> anyhow::Result<()> {
    let text = std::fs::read(spec_path)
        .with_context(|| format!("no CDI spec at {}", spec_path.display()))?;
    std::fs::write(out.join("cdi-spec.json"), &text)?;
    let spec: Value = serde_json::from_slice(&text)?;
    let edits = &spec["devices"][0]["containerEdits"];
    let strings = |v: &Value| -> Vec<String> {
        v.as_array()
            .into_iter()
            .flatten()
            .filter_map(|s| s.as_str().map(str::to_owned))
            .collect()
    };
    let env = strings(&edits["env"]);
    std::fs::write(out.join("env"), env.join("\n") + "\n")?;
    let mounts: Vec<String> = edits["mounts"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|m| {
            format!(
                "{} {} {}",
                m["hostPath"].as_str().unwrap_or(""),
                m["containerPath"].as_str().unwrap_or(""),
                strings(&m["options"]).join(",")
            )
        })
        .collect();
    std::fs::write(out.join("mounts"), mounts.join("\n") + "\n")?;
    let nodes: Vec<String> = edits["deviceNodes"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|n| n["path"].as_str().map(str::to_owned))
        .collect();
    std::fs::write(out.join("device-nodes"), nodes.join("\n") + "\n")?;
    std::fs::write(out.join("cdi-devices"), cdi.join("\n") + "\n")?;
    Ok(())
}

/// Writes the pod's UID to `out/ready` whole, by renaming a finished file:
/// whoever waits for `ready` to exist never reads it half written.
pub(crate) fn mark_ready(out: &Path, pod_uid: &str) -> std::io::Result<()> {
    let partial = out.join("ready.partial");
    std::fs::write(&partial, format!("{pod_uid}\n"))?;
    std::fs::rename(&partial, out.join("ready"))
}
