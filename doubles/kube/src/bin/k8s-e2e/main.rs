//! `k8s-e2e`: a claim for a GPU fraction taken through the real DRA path
//! (fake API server, the agent and hypervisor of `serve --kubernetes`, fake
//! kubelet over the plugin's Unix sockets), on the machine's GPUs or
//! simulated ones; then exactly what the CDI spec gives a container is
//! written out for `scripts/gpu/k8s_e2e.sh`:
//!
//! - `OUT/env`: the spec's variables, `KEY=VALUE` a line;
//! - `OUT/mounts`: `HOST_PATH CONTAINER_PATH OPTIONS` a line;
//! - `OUT/device-nodes`: one path a line;
//! - `OUT/cdi-spec.json`, `OUT/cdi-devices` (the IDs prepare returned);
//! - `OUT/ready`: written last (the pod UID).
//!
//! The hypervisor then serves until `OUT/stop` appears (or SIGTERM); at the
//! end it writes `OUT/status.json` (pods, workers, memory used), unprepares
//! the claim and writes `OUT/unprepared` (`clean` when spec, token and region
//! are gone).
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

use anyhow::{Context, bail, ensure};
use clap::Parser;
use hypervisor_kubernetes::DRIVER;
use hypervisor_observer::{GpuObserver, NvmlObserver, SimulatedGpus};
use kube_fakes::apiserver::FakeApiServer;
use kube_fakes::cluster;
use kube_fakes::kubelet::Version;
use kube_fakes::node::{self, TestNode};
use serde_json::Value;

#[derive(Parser)]
#[command(
    name = "k8s-e2e",
    about = "The DRA path end to end against fake Kubernetes"
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
    gpushare_utils::logging::init("HYPERVISOR_LOG");
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
    runtime.block_on(async move {
        let api = FakeApiServer::start().await?;
        let mut options = node::options(&out.join("node"), "e2e-node", DRIVER, &limiter);
        options.check_identity = !args.skip_identity;
        std::fs::create_dir_all(out.join("node"))?;
        let devices: Vec<&str> = args.device.split(',').map(str::trim).collect();
        ensure!(
            !(args.corun && devices.len() > 1),
            "--corun takes one --device: an MPS client sees one co-run GPU"
        );
        let mps = if args.corun {
            let index = args
                .device
                .strip_prefix("gpu-")
                .and_then(|n| n.parse().ok())
                .with_context(|| format!("--device {}: not gpu-N", args.device))?;
            Some(corun::options(
                &observer,
                index,
                &out.join("node").join("mps"),
                &args.mps_control,
            )?)
        } else {
            None
        };
        let node = TestNode::start_with(&api, observer, options, mps.clone()).await?;
        if let (Some(mps), Some(board)) = (mps, node.corun_board()) {
            let out = out.clone();
            tokio::task::spawn_blocking(move || corun::wait_up(&board, &mps, &out)).await??;
        }
        let client = hypervisor_kubernetes::client(node.options.kubeconfig.as_deref()).await?;
        cluster::create_node(&client, "e2e-node").await?;
        let claim = cluster::create_claim_for_gpus(
            &client,
            "default",
            "e2e-gpu",
            DRIVER,
            devices.len(),
            (&args.memory, &args.compute),
            None,
        )
        .await?;
        let pod = cluster::create_pod(&client, "default", "e2e", "e2e-node", "e2e-gpu").await?;
        let claim =
            cluster::allocate_on(&client, &claim, &pod, DRIVER, "e2e-node", &devices).await?;
        let uid = claim.metadata.uid.clone().unwrap_or_default();
        let pod_uid = pod.metadata.uid.clone().unwrap_or_default();
        let prepared = node
            .kubelet
            .prepare(Version::V1, "default", "e2e-gpu", &uid)
            .await?;
        if !prepared.error.is_empty() {
            bail!("prepare refused: {}", prepared.error);
        }
        let cdi: Vec<String> = prepared
            .devices
            .iter()
            .flat_map(|(_, ids)| ids.clone())
            .collect();
        let spec_path = node
            .options
            .provision
            .cdi_dir
            .join(format!("gpushare.dev-gpu_{uid}.json"));
        write_outputs(&out, &spec_path, &cdi)?;
        // The node's slice as the API stored it: the GPUs as NVML sees them,
        // and a taint on any the health watch found unhealthy.
        std::fs::write(
            out.join("resourceslice.json"),
            serde_json::to_vec_pretty(&api.list("resourceslices"))?,
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
        let error = node
            .kubelet
            .unprepare(Version::V1, "default", "e2e-gpu", &uid)
            .await?;
        let token = node.options.provision.state_dir.join("pods").join(&pod_uid);
        let region =
            Path::new("/dev/shm").join(gpushare_utils::ledger::PodLedger::name_of(&pod_uid));
        let error = (!error.is_empty()).then(|| format!("error={error:?}"));
        let clean = write_unprepared(
            &out,
            error,
            &[("spec", &spec_path), ("token", &token), ("region", &region)],
        )?;
        // Stopping the node quits the MPS control daemon too.
        node.stop().await;
        ensure!(clean, "unprepare left files behind");
        Ok(())
    })
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
