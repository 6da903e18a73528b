//! Pods that name the device plugin's resources are checked when they are
//! written: the ValidatingAdmissionPolicy of `deploy/device-plugin`
//! refuses, on the official API server, a limit outside what the plugin
//! accepts, naming the container's field and the range; and it refuses
//! every value the plugin would refuse at allocation, for every resource
//! name the plugin reads.

use hypervisor_kubernetes::deviceplugin::DEFAULT_RESOURCE;
use hypervisor_kubernetes::deviceplugin::ask::{self, CORES, MEMORY_MIB, MEMORY_PERCENT};
use k8s_openapi::api::core::v1::{Container, Pod};
use kube::api::{Api, PostParams};
use serde_json::{Value, json};

use super::claim_validation::refused_once_enforced;
use super::{runtime, tenant};

/// The other count the plugin can serve (`--device-plugin-resource`).
const VGPU_NUMBER: &str = "nvidia.com/vgpu-number";

/// The most MiB of one GPU the policy admits: 288Gi, the most memory of
/// any GPU. The plugin itself refuses more than a GPU has only when it
/// allocates, on the node.
const MOST_MIB: u64 = 288 << 10;

/// A HAMi pod, a bad one, and one with an init container out of range.
const PODS: &str = r#"
apiVersion: v1
kind: Pod
metadata: {name: hami}
spec:
  containers:
    - name: main
      image: pytorch/pytorch:2.6.0-cuda12.4-cudnn9-runtime
      resources:
        limits: {nvidia.com/gpu: 1, nvidia.com/gpumem: 4096, nvidia.com/gpucores: 30}
---
apiVersion: v1
kind: Pod
metadata: {name: too-much}
spec:
  containers:
    - name: main
      image: pytorch/pytorch:2.6.0-cuda12.4-cudnn9-runtime
      resources:
        limits: {nvidia.com/gpu: 65, nvidia.com/gpucores: 150, nvidia.com/gpumem-percentage: 0}
---
apiVersion: v1
kind: Pod
metadata: {name: init-too-big}
spec:
  initContainers:
    - name: warm
      image: pytorch/pytorch:2.6.0-cuda12.4-cudnn9-runtime
      resources:
        limits: {nvidia.com/gpu: 1, nvidia.com/gpumem: 300000}
  containers:
    - name: main
      image: pytorch/pytorch:2.6.0-cuda12.4-cudnn9-runtime
"#;

#[test]
fn device_plugin_pods_out_of_range_are_refused_as_the_plugin_would() {
    runtime().block_on(async {
        let tenant = tenant("pod-check").await;
        let (kubectl, namespace) = (tenant.kubectl.clone(), tenant.name.clone());
        tokio::task::spawn_blocking(move || {
            let bad = PODS.split("---").nth(1).unwrap();
            refused_once_enforced(&kubectl, &namespace, bad);
            let out = kubectl
                .run(
                    &["apply", "--dry-run=server", "-n", &namespace, "-f", "-"],
                    Some(PODS),
                )
                .unwrap();
            let (stdout, stderr) = (
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr),
            );
            assert!(stdout.contains("pod/hami created"), "{stdout}{stderr}");
            let refusal = |name: &str| {
                stderr
                    .lines()
                    .find(|l| l.contains(&format!("pods \"{name}\" is forbidden")))
                    .unwrap_or_else(|| panic!("{name} not refused: {stderr}"))
                    .split("denied request: ")
                    .nth(1)
                    .unwrap()
                    .to_owned()
            };
            let limits = "spec.containers[0].resources.limits";
            assert_eq!(
                refusal("too-much"),
                format!(
                    "{limits}[nvidia.com/gpu]: 65 is not within 0..64; \
                     {limits}[nvidia.com/gpumem-percentage]: 0 is not within 1..100; \
                     {limits}[nvidia.com/gpucores]: 150 is not within 0..100"
                )
            );
            assert_eq!(
                refusal("init-too-big"),
                format!(
                    "spec.initContainers[0].resources.limits[nvidia.com/gpumem]: \
                     300000 is not within 0..{MOST_MIB}"
                )
            );
        })
        .await
        .unwrap();

        // Every name the plugin reads, at and past its bounds.
        let api = Api::<Pod>::namespaced(tenant.client.clone(), &tenant.name);
        let mut cases: Vec<(&str, &str, u64)> = Vec::new();
        for resource in [DEFAULT_RESOURCE, VGPU_NUMBER] {
            cases.extend([0, 1, 64, 65].map(|n| (resource, resource, n)));
        }
        for name in MEMORY_MIB {
            cases.extend([0, 4096, MOST_MIB, MOST_MIB + 1].map(|n| (DEFAULT_RESOURCE, name, n)));
        }
        cases.extend([0, 1, 100, 101].map(|n| (DEFAULT_RESOURCE, MEMORY_PERCENT, n)));
        for name in CORES {
            cases.extend([0, 100, 101].map(|n| (DEFAULT_RESOURCE, name, n)));
        }
        for (i, (resource, name, value)) in cases.into_iter().enumerate() {
            let mut limits = json!({resource: "1"});
            limits[name] = json!(value.to_string());
            let container =
                json!({"name": "main", "image": "busybox:1.37", "resources": {"limits": limits}});
            let plugin = ask::container_ask(
                &serde_json::from_value::<Container>(container.clone()).unwrap(),
                resource,
            )
            .is_ok();
            let policy = admitted(&api, &format!("case-{i}"), container).await;
            // The policy's one bound of its own: more MiB than any GPU has.
            let beyond_any_gpu = MEMORY_MIB.contains(&name) && value > MOST_MIB;
            assert_eq!(
                policy.is_ok(),
                plugin && !beyond_any_gpu,
                "{name}: {value}: {policy:?}"
            );
            if let Err(message) = policy {
                assert!(
                    message.contains(&format!("[{name}]: {value} is not within ")),
                    "{message}"
                );
            }
        }
    });
}

/// The API server's answer to a pod of `container` (a dry run): `Ok`, or
/// the policy's message.
async fn admitted(api: &Api<Pod>, name: &str, container: Value) -> Result<(), String> {
    let pod: Pod = serde_json::from_value(json!({
        "metadata": {"name": name},
        "spec": {"containers": [container]},
    }))
    .unwrap();
    let dry_run = PostParams {
        dry_run: true,
        ..PostParams::default()
    };
    match api.create(&dry_run, &pod).await {
        Ok(_) => Ok(()),
        Err(kube::Error::Api(status)) if status.message.contains("denied request: ") => {
            Err(status.message)
        }
        Err(other) => panic!("{name}: {other}"),
    }
}
