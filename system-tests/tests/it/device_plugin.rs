//! The device plugin's answer makes the limiter apply a HAMi-style pod's
//! limits: a pod asking `nvidia.com/gpumem: 4096` and `nvidia.com/gpucores:
//! 30` is allocated by the real agent (on the official control plane, with
//! `deploy/device-plugin` applied and the agent on a token of the shipped
//! ServiceAccount; the device-plugin kubelet double calls it), then the
//! driver double's probe runs with exactly the env `Allocate` returned,
//! the mounts emulated by their host paths (the preload file's library by
//! `LD_PRELOAD` of a link with the pod file beside it; the region's host
//! path is its container path here). The pod is created by an
//! administrator already bound to the node by name, as HAMi's scheduler
//! binds it: the kubelet double advertises no `nvidia.com/gpu`, so the
//! default scheduler would find no room for it (`device_plugin_cluster.rs`
//! covers the scheduler's part).

use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, PostParams};
use kube_fakes::node::TestNode;
use serde_json::json;
use system_tests::container::ContainerLib;
use system_tests::daemon::double_gpus;
use system_tests::probes::{CONTEXT_BYTES, GIB, MIB, info};
use system_tests::{artifacts, probes};

use crate::cluster::{DRIVER, device_plugin_kubelet, runtime, tenant};

struct Cleanup {
    dir: std::path::PathBuf,
    files: Vec<String>,
}

impl Drop for Cleanup {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
        for file in &self.files {
            let _ = std::fs::remove_file(file);
        }
    }
}

#[test]
fn allocate_answer_makes_the_limiter_apply_gpumem_and_gpucores() {
    let dir = std::env::temp_dir().join(format!("limiter-dp-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let mut cleanup = Cleanup {
        dir: dir.clone(),
        files: Vec::new(),
    };
    let runtime = runtime();
    // A namespace and a Node of its own on the shared control plane
    // (`deploy/device-plugin` applied); dropped after the node (declared
    // before it).
    let tenant = runtime.block_on(tenant("limiter-dp"));
    let ns = tenant.namespace();
    let (answer, pod, node) = runtime.block_on(async {
        // The kubelet registers the Node before the agent starts.
        tenant.register_node().await.unwrap();
        let mut options = tenant.options(&dir, DRIVER, artifacts::limiter());
        // The probe runs outside any pod's cgroup.
        options.check_identity = false;
        let (config, kubelet) = device_plugin_kubelet(&dir.join("kubelet"), 4, true);
        options.device_plugin = Some(config);
        let node = TestNode::start_written(Arc::new(double_gpus(2)), options, None)
            .await
            .unwrap_or_else(|e| panic!("{e:#}"));
        let plugin = kubelet
            .plugin("nvidia.com/gpu", Duration::from_secs(10))
            .await
            .unwrap();
        // Bound by name (see the module's comment); the API server takes
        // extended resources in whole numbers and sets the requests to the
        // limits.
        let pod: Pod = serde_json::from_value(json!({
            "metadata": {
                "name": "hami",
                "namespace": ns,
                "annotations": {
                    "hami.io/gpu-scheduler-policy": "spread",
                    "nvidia.com/nouse-gpuuuid": gpushare_examples::uuid(0),
                },
            },
            "spec": {
                "nodeName": tenant.node(),
                "containers": [{
                    "name": "main",
                    "image": "cuda",
                    "resources": {"limits": {
                        "nvidia.com/gpu": "1", "nvidia.com/gpumem": "4096", "nvidia.com/gpucores": "30",
                    }},
                }],
            },
        }))
        .unwrap();
        let pod = Api::<Pod>::default_namespaced(tenant.client.clone())
            .create(&PostParams::default(), &pod)
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        kubelet.admit(ns, "hami", &["main"]);
        let share = format!("{}::0", gpushare_examples::uuid(0));
        let answer = plugin
            .start_container((ns, "hami", "main"), vec![share])
            .await
            .unwrap();
        (answer, pod.metadata.uid.unwrap(), (node, kubelet))
    });
    cleanup.files.push(format!("/dev/shm/gpushare-pod-{pod}"));
    cleanup
        .files
        .push(format!("/dev/shm/gpushare-limits-{pod}"));
    // GPU 0 excluded by the annotation: GPU 1, the double's second.
    assert_eq!(
        answer.envs["CUDA_VISIBLE_DEVICES"],
        gpushare_examples::uuid(1)
    );

    let pod_file = answer
        .mounts
        .iter()
        .find(|m| m.container_path == hypervisor_provision::CONTAINER_POD_FILE)
        .expect("pod file mount");
    assert!(pod_file.read_only);
    assert!(
        !answer.envs.keys().any(|k| k.starts_with("CUDA_LIMITER_")),
        "{:?}",
        answer.envs
    );
    let container = ContainerLib::mounting(std::path::Path::new(&pod_file.host_path));
    let mut command = gpushare_examples::command("cudaprobe");
    command
        .env_remove("CUDA_LIMITER_LOG")
        .env("GPUSHARE_DOUBLE_DEVICES", "2")
        .env("GPUSHARE_DOUBLE_TOTAL", "16g")
        .env("LD_PRELOAD", container.library())
        .envs(&answer.envs);
    command.args([
        "info", "alloc", "mem", "5g", "alloc", "mem", "3g", "run", "kernel", "1000", "1500",
    ]);
    // The agent keeps serving on the runtime's threads meanwhile.
    let output = command.output().unwrap();
    probes::check(&output);
    let stdout = String::from_utf8_lossy(&output.stdout);
    let lines: Vec<&str> = stdout.lines().collect();
    // The quota is the total; 5 GiB is refused (CUDA_ERROR_OUT_OF_MEMORY), 3 GiB fits.
    assert_eq!(
        lines[0],
        info(0, 4096 * MIB - CONTEXT_BYTES, 4 * GIB),
        "{lines:?}"
    );
    assert!(lines[1].contains("-> 2 "), "{lines:?}");
    assert!(lines[2].contains("-> 0 "), "{lines:?}");
    probes::assert_share(lines[3], 300, 40);
    runtime.block_on(async move { node.0.stop().await });
    drop(tenant);
}
