//! The whole DRA flow on the official control plane (kube-apiserver,
//! kube-scheduler and kube-controller-manager 1.37, with RBAC): `deploy/base`
//! applied with upstream `kubectl` as an administrator does; the real node
//! agent (on the driver double's GPUs) runs with a token of the shipped
//! ServiceAccount and publishes its ResourceSlice, which the API server
//! validates; users' pods and claims (from `deploy/example`, `kubectl`, the
//! official Python client) are allocated by the scheduler on our devices
//! with consumable capacity, claims are made from templates by the
//! controller manager; the node's kubelet double prepares them through the
//! plugin's socket and runs the pods; the CDI spec written is the
//! container's whole view: the driver double's probe runs under the
//! limiter with exactly its env (its mounts emulated by their host paths:
//! the preload file's library by `LD_PRELOAD` of a link with the pod file
//! beside it, the regions' host paths being their container paths) and gets
//! the claim's memory quota. No test writes an allocation.

use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Arc;

use gpu_fakes::FakeGpus;
use gpushare_utils::pod_file::PodFile;
use hypervisor_observer::{GpuObserver, HealthEvent};
use hypervisor_provision::{CONTAINER_POD_FILE, CONTAINER_PRELOAD, CONTAINER_SHM};
use k8s_openapi::api::core::v1::ServiceAccount;
use k8s_openapi::api::rbac::v1::{ClusterRole, ClusterRoleBinding};
use k8s_openapi::api::resource::v1::DeviceClass;
use kube_fakes::clients;
use kube_fakes::cluster_node::gpu_labels;
use kube_fakes::node::TestNode;
use kube_fakes::node_kubelet::{NodeKubelet, PreparedClaim};
use kube_fakes::tenant::Tenant;
use serde_json::{Value, json};
use system_tests::container::ContainerLib;
use system_tests::daemon::double_gpus;
use system_tests::probes::{CONTEXT_BYTES, GIB, MIB, info};
use system_tests::scratch::Scratch;
use system_tests::wait::eventually_some;
use system_tests::{artifacts, probes};

use crate::cluster::DRIVER;

const GPUS: u8 = 2;
/// The node agent's ServiceAccount in `deploy/base`.
const AGENT: (&str, &str) = ("gpushare-system", "gpushare-node");

/// The test's namespace and Node on the shared control plane, the node
/// under test and its kubelet, `kubectl` as the administrator. Fields drop
/// in order: the kubelet, the node (its node tables), the tenant (its
/// namespace and Node), the runtime their tasks run on, then the scratch
/// folder.
struct World {
    kubelet: Option<NodeKubelet>,
    node: Option<TestNode>,
    tenant: Tenant,
    runtime: tokio::runtime::Runtime,
    scratch: Scratch,
}

/// A claim the kubelet prepared: what its CDI spec gives the container.
struct Prepared {
    claim_uid: String,
    pod_uid: String,
    spec_path: PathBuf,
    env: Vec<(String, String)>,
    /// (container path, host path).
    mounts: Vec<(String, String)>,
}

impl Prepared {
    fn env(&self, key: &str) -> &str {
        self.env
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v.as_str())
            .unwrap_or_else(|| panic!("{key} not in the CDI env {:?}", self.env))
    }

    /// The host path mounted at `container`.
    fn host_path(&self, container: &str) -> &str {
        self.mounts
            .iter()
            .find(|(c, _)| c == container)
            .map(|(_, h)| h.as_str())
            .unwrap_or_else(|| panic!("no mount at {container} in {:?}", self.mounts))
    }
}

impl World {
    /// The shared control plane (`deploy/` applied by `kubectl`), the
    /// node's kubelet registering the Node, then the node agent with the
    /// shipped ServiceAccount's token on the driver double's GPUs.
    fn start(tag: &str) -> Self {
        let world = Self::bare(tag);
        world.assert_installed();
        let kubeconfig = world.tenant.agent_kubeconfig().to_owned();
        world.with_agent(&kubeconfig, Arc::new(double_gpus(GPUS)))
    }

    /// The test's namespace on the shared control plane; no node.
    fn bare(tag: &str) -> Self {
        let scratch = Scratch::new(&format!("limiter-dra-{tag}"));
        let runtime = crate::cluster::runtime();
        let tenant = runtime.block_on(crate::cluster::tenant(&format!("dra-{tag}")));
        Self {
            kubelet: None,
            node: None,
            tenant,
            runtime,
            scratch,
        }
    }

    /// The test's Node's name.
    fn node_name(&self) -> &str {
        self.tenant.node()
    }

    /// What `kubectl apply -k` printed when it installed us on the shared
    /// control plane, as an administrator does: `deploy/device-plugin`,
    /// which is `deploy/base` and the device plugin's rights.
    fn assert_installed(&self) {
        let applied = self.tenant.applied();
        for object in [
            "namespace/gpushare-system created",
            "serviceaccount/gpushare-node created",
            "clusterrole.rbac.authorization.k8s.io/gpushare-node created",
            "clusterrolebinding.rbac.authorization.k8s.io/gpushare-node created",
            "daemonset.apps/gpushare-node created",
            "deviceclass.resource.k8s.io/gpu.gpushare.dev created",
        ] {
            assert!(applied.contains(object), "{object} in {applied}");
        }
    }

    /// A kubeconfig with a token of ServiceAccount `account` of the node
    /// agent's namespace, as the DaemonSet's pod gets one.
    fn agent_kubeconfig(&self, account: &str) -> PathBuf {
        let path = self.scratch.dir.join(format!("{account}.kubeconfig"));
        self.runtime
            .block_on(
                self.tenant
                    .plane()
                    .service_account_kubeconfig(AGENT.0, account, &path),
            )
            .unwrap_or_else(|e| panic!("{e}"));
        path
    }

    /// The node's options: its folders in the scratch folder, the agent on
    /// `kubeconfig`.
    fn options(&self, kubeconfig: &Path) -> hypervisor_kubernetes::AgentOptions {
        let mut options = self
            .tenant
            .options(&self.scratch.dir, DRIVER, artifacts::limiter());
        options.kubeconfig = Some(kubeconfig.to_owned());
        // The probe runs outside any pod's cgroup.
        options.check_identity = false;
        options
    }

    /// The kubelet registers the Node (as it does before any DaemonSet pod
    /// runs), the node starts with its agent on `kubeconfig`, and the
    /// kubelet runs the pods bound to it with the plugin the agent
    /// registered.
    fn with_agent(mut self, kubeconfig: &Path, gpus: Arc<dyn GpuObserver>) -> Self {
        let options = self.options(kubeconfig);
        let kubelet_client = self
            .runtime
            .block_on(self.tenant.register_node())
            .unwrap_or_else(|e| panic!("{e:#}"));
        let node = self
            .runtime
            .block_on(TestNode::start_written(gpus, options, None))
            .unwrap_or_else(|e| panic!("{e:#}"));
        let plugin = node.kubelet.clone();
        let kubelet = self
            .runtime
            .block_on(NodeKubelet::start(
                kubelet_client,
                self.node_name(),
                gpu_labels(),
                plugin,
            ))
            .unwrap_or_else(|e| panic!("{e}"));
        self.node = Some(node);
        self.kubelet = Some(kubelet);
        self
    }

    fn node(&self) -> &TestNode {
        self.node.as_ref().unwrap()
    }

    fn kubelet(&self) -> &NodeKubelet {
        self.kubelet.as_ref().unwrap()
    }

    /// `kubectl args`, which must succeed; its stdout.
    fn ok(&self, args: &[&str]) -> String {
        self.tenant
            .kubectl
            .ok(args, None)
            .unwrap_or_else(|e| panic!("{e}"))
    }

    /// `kubectl args` with `input` on stdin, which must succeed; its stdout.
    fn ok_with(&self, args: &[&str], input: &str) -> String {
        self.tenant
            .kubectl
            .ok(args, Some(input))
            .unwrap_or_else(|e| panic!("{e}"))
    }

    fn get(&self, what: &[&str]) -> Value {
        let mut args = vec!["get"];
        args.extend_from_slice(what);
        args.extend_from_slice(&["-o", "json"]);
        let text = self.ok(&args);
        serde_json::from_str(&text).unwrap_or_else(|e| panic!("{e}: {text}"))
    }

    /// This node's ResourceSlice as `kubectl get resourceslices` lists it,
    /// once the agent has published it, owned by its Node: one device a
    /// GPU of the double, with its UUID and its shareable `memory` and
    /// `compute`.
    fn slice(&self) -> Value {
        let node = self.node_name();
        let node_uid = self.get(&["node", node])["metadata"]["uid"].clone();
        let slice = eventually_some("the node's ResourceSlice, owned by its Node", || {
            self.get(&["resourceslices"])["items"]
                .as_array()
                .into_iter()
                .flatten()
                .find(|s| {
                    s["spec"]["nodeName"] == node
                        && s["metadata"]["ownerReferences"][0]["uid"] == node_uid
                })
                .cloned()
        });
        assert_slice(&slice, node);
        slice
    }

    /// Pod `pod` once running, and its claim `gpu` as allocated: the
    /// claim's name and its (only) allocation result.
    fn running(&self, pod: &str) -> (Value, Value) {
        let pod_object = eventually_some(&format!("pod {pod} running"), || {
            let object = self.get(&["pod", pod]);
            (object["status"]["phase"] == "Running").then_some(object)
        });
        // Its regions, removed when the test ends, however it ends.
        self.scratch
            .track_pod(pod_object["metadata"]["uid"].as_str().unwrap_or_default());
        let statuses = &pod_object["status"]["resourceClaimStatuses"];
        let direct = &pod_object["spec"]["resourceClaims"][0]["resourceClaimName"];
        let claim_name = direct
            .as_str()
            .or_else(|| statuses[0]["resourceClaimName"].as_str())
            .unwrap_or_else(|| panic!("no claim for {pod_object}"))
            .to_owned();
        let claim = self.get(&["resourceclaim", &claim_name]);
        let reserved: Vec<&Value> = claim["status"]["reservedFor"]
            .as_array()
            .unwrap()
            .iter()
            .map(|r| &r["uid"])
            .collect();
        assert!(
            reserved.contains(&&pod_object["metadata"]["uid"]),
            "{claim}"
        );
        (pod_object, claim)
    }

    /// What the kubelet prepared for `claim` (JSON, allocated) of pod
    /// `pod` (JSON), allocated on GPU `gpu`: checks the plugin's answer and
    /// the CDI spec written.
    fn prepared(&self, claim: &Value, pod: &Value, gpu: u8) -> Prepared {
        let claim_uid = claim["metadata"]["uid"].as_str().unwrap().to_owned();
        let pod_uid = pod["metadata"]["uid"].as_str().unwrap().to_owned();
        let answer: PreparedClaim = eventually_some("the kubelet's prepare", || {
            self.kubelet()
                .prepared()
                .into_iter()
                .find(|p| p.uid == claim_uid)
        });
        assert_eq!(
            answer.devices,
            vec![(
                format!("gpu-{gpu}"),
                vec![format!("gpushare.dev/gpu={claim_uid}")]
            )]
        );
        self.inspect(claim_uid, pod_uid, gpu)
    }

    /// The CDI spec of claim `claim_uid` for pod `pod_uid` on GPU `gpu`,
    /// checked: its env, mounts, pod file and regions.
    fn inspect(&self, claim_uid: String, pod_uid: String, gpu: u8) -> Prepared {
        let spec_path = crate::cluster::spec_path(&self.scratch.dir, &claim_uid);
        let spec: Value = serde_json::from_slice(&std::fs::read(&spec_path).unwrap()).unwrap();
        assert_eq!(spec["kind"], "gpushare.dev/gpu");
        assert_eq!(spec["devices"][0]["name"], claim_uid.as_str());
        let edits = &spec["devices"][0]["containerEdits"];
        let env = edits["env"]
            .as_array()
            .unwrap()
            .iter()
            .map(|e| {
                let (k, v) = e.as_str().unwrap().split_once('=').unwrap();
                (k.to_owned(), v.to_owned())
            })
            .collect();
        let mounts = edits["mounts"]
            .as_array()
            .unwrap()
            .iter()
            .map(|m| {
                (
                    m["containerPath"].as_str().unwrap().to_owned(),
                    m["hostPath"].as_str().unwrap().to_owned(),
                )
            })
            .collect();
        let prepared = Prepared {
            claim_uid,
            pod_uid,
            spec_path,
            env,
            mounts,
        };
        let uuid = gpushare_examples::uuid(gpu);
        // The pod, the daemon and the token: the pod file's, not variables.
        let pod_file = PodFile::read(Path::new(prepared.host_path(CONTAINER_POD_FILE)))
            .unwrap()
            .expect("the pod file is written");
        assert_eq!(pod_file.pod, prepared.pod_uid);
        assert_eq!(pod_file.hypervisor, self.node().hv_url);
        assert!(!pod_file.token.is_empty());
        assert!(
            !prepared
                .env
                .iter()
                .any(|(k, _)| k.starts_with("CUDA_LIMITER_")),
            "{:?}",
            prepared.env
        );
        assert_eq!(prepared.env("CUDA_VISIBLE_DEVICES"), uuid);
        assert_eq!(prepared.env("NVIDIA_VISIBLE_DEVICES"), uuid);
        let device_nodes = edits["deviceNodes"].as_array().unwrap();
        assert!(
            device_nodes
                .iter()
                .any(|n| n["path"] == format!("/dev/nvidia{gpu}")),
            "{device_nodes:?}"
        );
        // The regions are where the container sees them.
        for file in Scratch::pod_files(&prepared.pod_uid) {
            let path = file.to_str().unwrap();
            assert!(path.starts_with(CONTAINER_SHM));
            assert_eq!(prepared.host_path(path), path);
            assert!(file.exists(), "{path}");
        }
        prepared
    }

    /// Once the kubelet unprepared the claim: the spec, the token, the
    /// regions and the hypervisor's pod are gone.
    fn unprepared(&self, prepared: &Prepared) {
        eventually_some("the kubelet's unprepare", || {
            self.kubelet()
                .unprepared()
                .contains(&prepared.claim_uid)
                .then_some(())
        });
        let pod_file = PathBuf::from(prepared.host_path(CONTAINER_POD_FILE));
        eventually_some("the claim's files gone", || {
            let left: Vec<PathBuf> = Scratch::pod_files(&prepared.pod_uid)
                .into_iter()
                .chain([prepared.spec_path.clone(), pod_file.clone()])
                .filter(|f| f.exists())
                .collect();
            left.is_empty().then_some(())
        });
        assert!(self.grant(&prepared.pod_uid).is_none());
    }

    fn stop(mut self) {
        self.kubelet.take();
        if let Some(node) = self.node.take() {
            self.runtime.block_on(node.stop());
        }
    }

    /// The hypervisor's view of pod `pod`: its first GPU's grant.
    fn grant(&self, pod: &str) -> Option<Value> {
        crate::cluster::pod_status(&self.node().hv, pod).map(|p| p["gpus"][0].clone())
    }

    /// The driver double's probe as the container would start it: exactly
    /// the CDI spec's env, the preload file's library by `LD_PRELOAD` with
    /// the pod file mounted beside it (which names the node's tables); the
    /// double's GPUs.
    fn probe(&self, prepared: &Prepared, args: &[String]) -> Vec<String> {
        let preload = prepared.host_path(CONTAINER_PRELOAD);
        let named = std::fs::read_to_string(preload).unwrap();
        assert_eq!(
            Path::new(prepared.host_path(named.trim())),
            artifacts::limiter()
        );
        assert_eq!(
            PodFile::beside(Path::new(named.trim())),
            Path::new(CONTAINER_POD_FILE)
        );
        let container = ContainerLib::mounting(Path::new(prepared.host_path(CONTAINER_POD_FILE)));
        let mut command = gpushare_examples::command("cudaprobe");
        command
            .env_remove("CUDA_LIMITER_LOG")
            .env("GPUSHARE_DOUBLE_DEVICES", GPUS.to_string())
            .env("GPUSHARE_DOUBLE_TOTAL", "16g")
            .envs(prepared.env.iter().map(|(k, v)| (k, v)))
            .env("LD_PRELOAD", container.library())
            .args(args);
        // The agent and the hypervisor keep serving on the runtime's threads.
        probes::run(command)
    }
}

/// The slice of this node's pool: the double's GPUs with their UUIDs,
/// shareable, with `memory` (at most the GPU's) and `compute` (100, taken
/// 1 to 100 at a time) to consume.
fn assert_slice(slice: &Value, node: &str) {
    let spec = &slice["spec"];
    assert_eq!(spec["driver"], DRIVER, "{slice}");
    assert_eq!(spec["pool"]["name"], node, "{slice}");
    let devices = spec["devices"].as_array().unwrap();
    assert_eq!(devices.len(), usize::from(GPUS), "{slice}");
    for (index, device) in (0..GPUS).zip(devices) {
        assert_eq!(device["name"], format!("gpu-{index}"), "{device}");
        assert_eq!(device["allowMultipleAllocations"], true, "{device}");
        assert_eq!(
            device["attributes"]["uuid"]["string"],
            gpushare_examples::uuid(index),
            "{device}"
        );
        let capacity = &device["capacity"];
        let memory: u64 = capacity["memory"]["value"]
            .as_str()
            .and_then(|m| m.parse().ok())
            .unwrap_or_else(|| panic!("memory capacity in {device}"));
        assert!(
            memory <= 16 * GIB && 16 * GIB - memory < 256 * MIB,
            "{device}"
        );
        assert_eq!(capacity["compute"]["value"], "100", "{device}");
        let range = &capacity["compute"]["requestPolicy"]["validRange"];
        assert_eq!((&range["min"], &range["max"]), (&json!("1"), &json!("100")));
    }
}

/// The probe's arguments: `info`, then an allocation of each of `gib`.
fn probe_args(gib: &[u64]) -> Vec<String> {
    let mut args = vec!["info".to_owned()];
    for g in gib {
        args.extend(["alloc".to_owned(), "mem".to_owned(), format!("{g}g")]);
    }
    args
}

/// The probe's lines for [`probe_args`] under a quota of `quota_gib`: the
/// quota is the total, what is free of it the quota less the context; an
/// allocation succeeds while it fits beside the context and those before.
fn assert_quota(lines: &[String], quota_gib: u64, gib: &[u64]) {
    assert_eq!(
        lines[0],
        info(0, quota_gib * GIB - CONTEXT_BYTES, quota_gib * GIB),
        "{lines:?}"
    );
    let mut used = CONTEXT_BYTES;
    for (line, g) in lines[1..].iter().zip(gib) {
        let fits = used + g * GIB <= quota_gib * GIB;
        if fits {
            used += g * GIB;
        }
        // CUDA_SUCCESS, or CUDA_ERROR_OUT_OF_MEMORY.
        assert_eq!(
            probes::result_of(line),
            if fits { 0 } else { 2 },
            "{lines:?}"
        );
    }
    assert_eq!(lines.len(), 1 + gib.len(), "{lines:?}");
}

#[test]
fn kubectl_runs_the_example_pod_from_template_to_limited_process_and_back() {
    let world = World::start("example");
    world.slice();

    let example = concat!(env!("CARGO_MANIFEST_DIR"), "/../deploy/example");
    let applied = world.ok_with(&["apply", "-f", "-"], &world.pinned(example));
    assert_eq!(
        applied,
        "resourceclaimtemplate.resource.k8s.io/gpu-4gi-30 created\npod/cuda-fraction created\n"
    );
    // The controller manager made the claim from the template, the scheduler
    // allocated it on one of our devices with the capacity it asks, the
    // claim's config copied, and the kubelet ran the pod.
    let (pod, claim) = world.running("cuda-fraction");
    let name = claim["metadata"]["name"].as_str().unwrap();
    assert!(name.starts_with("cuda-fraction-gpu-"), "{claim}");
    assert_eq!(
        claim["metadata"]["ownerReferences"][0]["uid"],
        pod["metadata"]["uid"]
    );
    let allocation = &claim["status"]["allocation"]["devices"];
    let result = &allocation["results"][0];
    assert_eq!(
        (&result["driver"], &result["pool"], &result["request"]),
        (&json!(DRIVER), &json!(world.node_name()), &json!("gpu")),
        "{claim}"
    );
    assert_eq!(
        result["consumedCapacity"],
        // The scheduler's canonical quantity: bytes, rounded to the step
        // of the device's request policy.
        json!({"memory": "4294967296", "compute": "30"}),
        "{claim}"
    );
    assert!(result["shareID"].is_string(), "{claim}");
    assert_eq!(allocation["config"][0]["source"], "FromClaim", "{claim}");
    assert_eq!(
        allocation["config"][0]["opaque"]["parameters"]["kind"],
        "GpuShareParameters"
    );
    let device = result["device"].as_str().unwrap();
    let gpu: u8 = device.trim_start_matches("gpu-").parse().unwrap();

    let prepared = world.prepared(&claim, &pod, gpu);
    let grant = world
        .grant(&prepared.pod_uid)
        .expect("pod in the hypervisor");
    assert_eq!(
        (
            &grant["memory_quota"],
            &grant["cap_percent"],
            &grant["weight"]
        ),
        (&json!(4 * GIB), &json!(30), &json!(1))
    );
    // 3 GiB fits in the 4 GiB quota; 2 GiB more does not.
    let lines = world.probe(&prepared, &probe_args(&[3, 2]));
    assert_quota(&lines, 4, &[3, 2]);

    // A graceful deletion: the kubelet unprepares, then confirms; the
    // controller deletes the claim it made.
    world.ok(&["delete", "pod", "cuda-fraction", "--timeout=90s"]);
    world.unprepared(&prepared);
    eventually_some("the generated claim deleted", || {
        let claims = world.get(&["resourceclaims"]);
        claims["items"].as_array().unwrap().is_empty().then_some(())
    });
    world.stop();
}

/// The official Python client's part: the claim (2 GiB, 20%) and its pod
/// created; the claim watched until the scheduler's allocation appears;
/// the node's slice read through `ResourceV1Api`; then, when told, pod and
/// claim deleted and watched until both are gone. Each step prints one
/// JSON line.
const PYTHON: &str = r#"
import json, sys, time
from kubernetes import client, config, watch

config.load_kube_config(config_file=sys.argv[1])
node, driver = sys.argv[2], sys.argv[3]
core, resource = client.CoreV1Api(), client.ResourceV1Api()
ns = sys.argv[4]

def say(**fields):
    print(json.dumps(fields), flush=True)

claim = {
    "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
    "metadata": {"name": "infer-gpu"},
    "spec": {"devices": {
        "requests": [{"name": "gpu", "exactly": {
            "deviceClassName": driver,
            "capacity": {"requests": {"memory": "2Gi", "compute": "20"}}}}],
        "config": [{"requests": ["gpu"], "opaque": {"driver": driver, "parameters": {
            "apiVersion": "gpu.gpushare.dev/v1alpha1", "kind": "GpuShareParameters",
            "weight": 3}}}]}},
}
pod = {
    "apiVersion": "v1", "kind": "Pod", "metadata": {"name": "infer"},
    "spec": {"nodeSelector": {"kubernetes.io/hostname": node},
             "containers": [{"name": "main", "image": "cuda",
                             "resources": {"claims": [{"name": "gpu"}]}}],
             "resourceClaims": [{"name": "gpu", "resourceClaimName": "infer-gpu"}]},
}
made = resource.create_namespaced_resource_claim(ns, claim)
assert made.status is None or made.status.allocation is None, made.status
made_pod = core.create_namespaced_pod(ns, pod)
say(step="created", claim=made.metadata.uid, pod=made_pod.metadata.uid)

allocated = None
# The watch takes its item model from the list's (V1ResourceClaimList), but
# this client names resource.k8s.io/v1's claim ResourceV1ResourceClaim.
w = watch.Watch(return_type="ResourceV1ResourceClaim")
for event in w.stream(resource.list_namespaced_resource_claim, ns,
                      field_selector="metadata.name=infer-gpu", timeout_seconds=90):
    got = event["object"]
    if got.status and got.status.allocation and got.status.reserved_for:
        allocated = got
        w.stop()
assert allocated is not None, "no allocation seen"
result = allocated.status.allocation.devices.results[0]
slices = [s for s in resource.list_resource_slice().items if s.spec.node_name == node]
assert len(slices) == 1, slices
say(step="allocated",
    result={"device": result.device, "pool": result.pool, "driver": result.driver,
            "consumedCapacity": result.consumed_capacity},
    reservedFor=[r.uid for r in allocated.status.reserved_for],
    slice=client.ApiClient().sanitize_for_serialization(slices[0]))

sys.stdin.readline()
core.delete_namespaced_pod("infer", ns)
resource.delete_namespaced_resource_claim("infer-gpu", ns)
left = None
for _ in range(900):
    left = [p.metadata.name for p in core.list_namespaced_pod(ns).items] \
        + [c.metadata.name for c in resource.list_namespaced_resource_claim(ns).items]
    if not left:
        break
    time.sleep(0.1)
say(step="deleted", left=left)
"#;

/// The Python client's process; killed if the test ends first.
struct Script(std::process::Child);

impl Script {
    fn say(&mut self, lines: &mut impl BufRead) -> Value {
        let mut line = String::new();
        lines.read_line(&mut line).unwrap();
        if line.is_empty() {
            let _ = self.0.wait();
            let mut stderr = String::new();
            if let Some(mut err) = self.0.stderr.take() {
                let _ = std::io::Read::read_to_string(&mut err, &mut stderr);
            }
            panic!("the Python client's script ended early: {stderr}");
        }
        serde_json::from_str(&line).unwrap_or_else(|e| panic!("{e}: {line}"))
    }
}

impl Drop for Script {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[test]
fn the_python_client_drives_a_claim_to_a_limited_process() {
    let python = clients::python_client().unwrap_or_else(|e| panic!("{e}"));
    let world = World::start("python");
    world.slice();
    let script = world.scratch.dir.join("claim.py");
    std::fs::write(&script, PYTHON).unwrap();
    let mut child = Script(
        Command::new(python)
            .arg(&script)
            .args([
                &world.tenant.kubectl.kubeconfig,
                Path::new(world.node_name()),
                Path::new(DRIVER),
                Path::new(world.tenant.namespace()),
            ])
            .env("HOME", &world.scratch.dir)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap(),
    );
    let mut lines = BufReader::new(child.0.stdout.take().unwrap());

    let created = child.say(&mut lines);
    assert_eq!(created["step"], "created", "{created}");
    // The scheduler allocates what the client created; the client's watch sees it.
    let allocated = child.say(&mut lines);
    assert_eq!(allocated["step"], "allocated", "{allocated}");
    let device = allocated["result"]["device"].as_str().unwrap().to_owned();
    assert_eq!(
        allocated["result"],
        json!({"device": device, "pool": world.node_name(), "driver": DRIVER,
            "consumedCapacity": {"memory": "2147483648", "compute": "20"}})
    );
    assert_eq!(allocated["reservedFor"], json!([created["pod"]]));
    assert_slice(&allocated["slice"], world.node_name());

    let (pod, claim) = world.running("infer");
    let gpu: u8 = device.trim_start_matches("gpu-").parse().unwrap();
    let prepared = world.prepared(&claim, &pod, gpu);
    assert_eq!(prepared.claim_uid, created["claim"].as_str().unwrap());
    let grant = world
        .grant(&prepared.pod_uid)
        .expect("pod in the hypervisor");
    assert_eq!(
        (
            &grant["memory_quota"],
            &grant["cap_percent"],
            &grant["weight"]
        ),
        (&json!(2 * GIB), &json!(20), &json!(3))
    );
    // 3 GiB is past the 2 GiB quota; 1 GiB fits, 1 GiB more does not.
    let gib = [3, 1, 1];
    let out = world.probe(&prepared, &probe_args(&gib));
    assert_quota(&out, 2, &gib);

    writeln!(child.0.stdin.take().unwrap(), "delete").unwrap();
    let deleted = child.say(&mut lines);
    assert_eq!(deleted, json!({"step": "deleted", "left": []}));
    let status = child.0.wait().unwrap();
    assert!(status.success(), "{status}");
    world.unprepared(&prepared);
    world.stop();
}

/// A pod `name` on node `node` whose claim `gpu` comes from a template
/// asking for `count` GPUs of class `class`, each with `memory` and
/// `compute`: the template and the pod, as YAML.
fn pod_with_template(
    node: &str,
    name: &str,
    class: &str,
    count: u8,
    memory: &str,
    compute: u8,
) -> String {
    format!(
        r#"apiVersion: resource.k8s.io/v1
kind: ResourceClaimTemplate
metadata:
  name: {name}
spec:
  spec:
    devices:
      requests:
        - name: gpu
          exactly:
            deviceClassName: {class}
            allocationMode: ExactCount
            count: {count}
            capacity:
              requests:
                memory: {memory}
                compute: "{compute}"
---
apiVersion: v1
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
        claims:
          - name: gpu
  resourceClaims:
    - name: gpu
      resourceClaimTemplateName: {name}
"#
    )
}

/// A pod `name` on node `node` using the existing claim `claim`, as YAML.
fn pod_with_claim(node: &str, name: &str, claim: &str) -> String {
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
        claims:
          - name: gpu
  resourceClaims:
    - name: gpu
      resourceClaimName: {claim}
"#
    )
}

impl World {
    /// The kustomization at `dir` as `kubectl kustomize` renders it, in the
    /// test's namespace and its pods on the test's Node (the cluster is
    /// shared), as YAML.
    fn pinned(&self, dir: &str) -> String {
        let rendered = self.ok(&["kustomize", dir]);
        serde_yaml::Deserializer::from_str(&rendered)
            .map(|document| {
                let mut object: Value = serde::Deserialize::deserialize(document).unwrap();
                object["metadata"]["namespace"] = json!(self.tenant.namespace());
                if object["kind"] == "Pod" {
                    object["spec"]["nodeSelector"] =
                        json!({"kubernetes.io/hostname": self.node_name()});
                }
                serde_json::to_string(&object).unwrap()
            })
            .collect::<Vec<_>>()
            .join("\n---\n")
    }

    /// Why the scheduler leaves pod `pod` pending, once it said so: its
    /// `PodScheduled` condition (reason and message).
    fn unschedulable(&self, pod: &str) -> Value {
        eventually_some(&format!("pod {pod} unschedulable"), || {
            let object = self.get(&["pod", pod]);
            object["status"]["conditions"]
                .as_array()
                .into_iter()
                .flatten()
                .find(|c| c["type"] == "PodScheduled" && c["status"] == "False")
                .cloned()
        })
    }
}

#[test]
fn pods_fill_the_gpus_capacity_and_the_next_waits_for_room() {
    let world = World::start("capacity");
    world.slice();
    // Two GPUs of 100% each: four pods of 50% fill them.
    let mut devices = Vec::new();
    for pod in ["half-a", "half-b", "half-c", "half-d"] {
        world.ok_with(
            &["apply", "-f", "-"],
            &pod_with_template(world.node_name(), pod, DRIVER, 1, "1Gi", 50),
        );
    }
    for pod in ["half-a", "half-b", "half-c", "half-d"] {
        let (_, claim) = world.running(pod);
        devices.push(
            claim["status"]["allocation"]["devices"]["results"][0]["device"]
                .as_str()
                .unwrap()
                .to_owned(),
        );
    }
    devices.sort();
    assert_eq!(devices, ["gpu-0", "gpu-0", "gpu-1", "gpu-1"]);

    // A fifth does not fit: the scheduler says why and leaves it pending.
    world.ok_with(
        &["apply", "-f", "-"],
        &pod_with_template(world.node_name(), "half-e", DRIVER, 1, "1Gi", 50),
    );
    let condition = world.unschedulable("half-e");
    assert_eq!(condition["reason"], "Unschedulable", "{condition}");
    let message = condition["message"].as_str().unwrap();
    assert!(message.contains("cannot allocate all claims"), "{message}");
    assert!(
        !world.kubelet().started(
            world.get(&["pod", "half-e"])["metadata"]["uid"]
                .as_str()
                .unwrap()
        )
    );

    // Room made: it is scheduled on the GPU freed, and prepared.
    world.ok(&["delete", "pod", "half-a", "--timeout=90s"]);
    let (pod, claim) = world.running("half-e");
    let device = claim["status"]["allocation"]["devices"]["results"][0]["device"]
        .as_str()
        .unwrap()
        .to_owned();
    let gpu: u8 = device.trim_start_matches("gpu-").parse().unwrap();
    world.prepared(&claim, &pod, gpu);
    world.stop();
}

#[test]
fn a_claim_shared_by_two_pods_and_a_claim_of_two_gpus() {
    let world = World::start("shared");
    world.slice();
    let claim = format!(
        r#"apiVersion: resource.k8s.io/v1
kind: ResourceClaim
metadata:
  name: shared
spec:
  devices:
    requests:
      - name: gpu
        exactly:
          deviceClassName: {DRIVER}
          capacity:
            requests:
              memory: 2Gi
              compute: "20"
"#
    );
    world.ok_with(&["apply", "-f", "-"], &claim);
    world.ok_with(
        &["apply", "-f", "-"],
        &pod_with_claim(world.node_name(), "reader-a", "shared"),
    );
    world.ok_with(
        &["apply", "-f", "-"],
        &pod_with_claim(world.node_name(), "reader-b", "shared"),
    );
    let (a, _) = world.running("reader-a");
    let (b, shared) = world.running("reader-b");
    let reserved: Vec<&Value> = shared["status"]["reservedFor"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| &r["uid"])
        .collect();
    assert_eq!(reserved.len(), 2, "{shared}");
    assert!(reserved.contains(&&a["metadata"]["uid"]), "{shared}");
    assert!(reserved.contains(&&b["metadata"]["uid"]), "{shared}");
    // One claim, prepared once for both pods of the node.
    let shared_uid = shared["metadata"]["uid"].as_str().unwrap().to_owned();
    let prepared = eventually_some("the shared claim prepared for both pods", || {
        world
            .kubelet()
            .prepared()
            .into_iter()
            .find(|p| p.uid == shared_uid && p.pods.len() == 2)
    });
    assert_eq!(prepared.devices.len(), 1, "{prepared:?}");
    // The first pod gone, the claim stays prepared for the second.
    world.ok(&["delete", "pod", "reader-a", "--timeout=90s"]);
    assert!(!world.kubelet().unprepared().contains(&shared_uid));
    world.ok(&["delete", "pod", "reader-b", "--timeout=90s"]);
    eventually_some("the shared claim unprepared", || {
        world
            .kubelet()
            .unprepared()
            .contains(&shared_uid)
            .then_some(())
    });

    // One request for two GPUs: one share of each.
    world.ok_with(
        &["apply", "-f", "-"],
        &pod_with_template(world.node_name(), "both", DRIVER, 2, "1Gi", 10),
    );
    let (_, claim) = world.running("both");
    let mut devices: Vec<&str> = claim["status"]["allocation"]["devices"]["results"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["device"].as_str().unwrap())
        .collect();
    devices.sort_unstable();
    assert_eq!(devices, ["gpu-0", "gpu-1"], "{claim}");
    let uid = claim["metadata"]["uid"].as_str().unwrap().to_owned();
    let prepared = eventually_some("the two-GPU claim prepared", || {
        world
            .kubelet()
            .prepared()
            .into_iter()
            .find(|p| p.uid == uid)
    });
    let names: Vec<&str> = prepared.devices.iter().map(|(d, _)| d.as_str()).collect();
    assert_eq!(names.len(), 2, "{prepared:?}");
    world.stop();
}

#[test]
fn a_broken_device_class_selector_leaves_the_pod_pending() {
    let world = World::start("selector");
    world.slice();
    // The shipped class with one mistake in its CEL: the driver's name,
    // under a name of the test's own (the cluster is shared).
    let typo = format!("typo-{}.gpushare.dev", world.tenant.name);
    world.tenant.delete_at_end::<DeviceClass>(None, &typo);
    let shipped = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../deploy/base/deviceclass.yaml"
    ))
    .unwrap();
    let broken = shipped
        .replace("name: gpu.gpushare.dev", &format!("name: {typo}"))
        .replace(
            "device.driver == \"gpu.gpushare.dev\"",
            "device.driver == \"gpu.gpushare.io\"",
        );
    assert_ne!(broken, shipped);
    world.ok_with(&["apply", "-f", "-"], &broken);
    world.ok_with(
        &["apply", "-f", "-"],
        &pod_with_template(world.node_name(), "mistyped", &typo, 1, "1Gi", 10),
    );
    let condition = world.unschedulable("mistyped");
    assert_eq!(condition["reason"], "Unschedulable", "{condition}");
    let message = condition["message"].as_str().unwrap();
    assert!(message.contains("cannot allocate all claims"), "{message}");
    // The same pod on the shipped class runs.
    world.ok_with(
        &["apply", "-f", "-"],
        &pod_with_template(world.node_name(), "spelled", DRIVER, 1, "1Gi", 10),
    );
    world.running("spelled");
    assert_eq!(
        world.get(&["pod", "mistyped"])["status"]["phase"],
        "Pending"
    );
    world.stop();
}

#[test]
fn the_slice_goes_with_its_node() {
    let mut world = World::start("owner");
    let slice = world.slice();
    let name = slice["metadata"]["name"].as_str().unwrap().to_owned();
    // The node is gone (its agent with it); the garbage collector deletes
    // what it owned.
    world.kubelet.take();
    if let Some(node) = world.node.take() {
        world.runtime.block_on(node.stop());
    }
    world.ok(&["delete", "node", world.node_name()]);
    eventually_some("the slice collected with its Node", || {
        let out = world
            .tenant
            .kubectl
            .run(&["get", "resourceslice", &name, "-o", "name"], None)
            .unwrap();
        String::from_utf8_lossy(&out.stderr)
            .contains("NotFound")
            .then_some(())
    });
    world.stop();
}

/// The shipped ClusterRole without `verb` on `resource`, as YAML, for
/// ServiceAccount `account` of the agent's namespace.
fn role_without(verb: &str, resource: &str, account: &str) -> String {
    let shipped = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../deploy/base/rbac.yaml"
    ))
    .unwrap();
    let mut documents: Vec<Value> = serde_yaml::Deserializer::from_str(&shipped)
        .map(|d| serde::Deserialize::deserialize(d).unwrap())
        .collect();
    let mut removed = false;
    for document in &mut documents {
        document["metadata"]["name"] = json!(account);
        if document["kind"] == "ClusterRole" {
            for rule in document["rules"].as_array_mut().unwrap() {
                if rule["resources"]
                    .as_array()
                    .unwrap()
                    .contains(&json!(resource))
                {
                    let verbs = rule["verbs"].as_array_mut().unwrap();
                    let before = verbs.len();
                    verbs.retain(|v| v != verb);
                    removed |= verbs.len() < before;
                }
            }
        } else {
            document["roleRef"]["name"] = json!(account);
            document["subjects"][0]["name"] = json!(account);
        }
    }
    assert!(removed, "the shipped role grants {verb} on {resource}");
    documents
        .iter()
        .map(|d| serde_json::to_string(d).unwrap())
        .collect::<Vec<_>>()
        .join("\n---\n")
}

#[test]
fn the_agent_fails_with_a_role_missing_a_verb_it_uses() {
    let world = World::bare("rbac");
    world.assert_installed();
    // Its own names: the cluster is shared.
    let account = &format!("no-create-{}", world.tenant.name);
    world
        .tenant
        .delete_at_end::<ServiceAccount>(Some(AGENT.0), account);
    world.tenant.delete_at_end::<ClusterRole>(None, account);
    world
        .tenant
        .delete_at_end::<ClusterRoleBinding>(None, account);
    world.ok(&["create", "serviceaccount", account, "-n", AGENT.0]);
    world.ok_with(
        &["apply", "-f", "-"],
        &role_without("create", "resourceslices", account),
    );
    let kubeconfig = world.agent_kubeconfig(account);
    let options = world.options(&kubeconfig);
    let started = world.runtime.block_on(TestNode::start_written(
        Arc::new(double_gpus(GPUS)),
        options,
        None,
    ));
    let error = match started {
        Ok(_) => panic!("the agent started without the right to create its slice"),
        Err(error) => format!("{error:#}"),
    };
    assert!(error.contains("create resourceslice"), "{error}");
    assert!(error.contains("forbidden"), "{error}");
}

#[test]
fn a_gpu_our_health_check_taints_gets_no_new_claims_and_its_pods_are_evicted() {
    let world = World::bare("taint");
    world.assert_installed();
    let kubeconfig = world.tenant.agent_kubeconfig().to_owned();
    let gpus = Arc::new(FakeGpus::new(u32::from(GPUS)));
    let world = world.with_agent(&kubeconfig, gpus.clone());
    world.ok_with(
        &["apply", "-f", "-"],
        &pod_with_template(world.node_name(), "victim", DRIVER, 1, "1Gi", 10),
    );
    let (victim, claim) = world.running("victim");
    let device = claim["status"]["allocation"]["devices"]["results"][0]["device"]
        .as_str()
        .unwrap()
        .to_owned();
    let index: u32 = device.trim_start_matches("gpu-").parse().unwrap();
    let claim_uid = claim["metadata"]["uid"].as_str().unwrap().to_owned();

    // XID 79 (fallen off the bus): the agent taints the device NoExecute.
    assert!(gpus.inject(index, HealthEvent::Xid(Some(79))).unwrap());
    // The device taint eviction controller evicts the pod using it; the
    // kubelet unprepares its claim and confirms the deletion.
    eventually_some("the pod on the tainted GPU evicted", || {
        let out = world
            .tenant
            .kubectl
            .run(&["get", "pod", "victim", "-o", "json"], None)
            .unwrap();
        let gone = String::from_utf8_lossy(&out.stderr).contains("NotFound");
        let replaced = serde_json::from_slice::<Value>(&out.stdout)
            .is_ok_and(|p| p["metadata"]["uid"] != victim["metadata"]["uid"]);
        (gone || replaced).then_some(())
    });
    eventually_some("the evicted pod's claim unprepared", || {
        world
            .kubelet()
            .unprepared()
            .contains(&claim_uid)
            .then_some(())
    });
    // A new claim goes to the other GPU, whichever it asks.
    world.ok_with(
        &["apply", "-f", "-"],
        &pod_with_template(world.node_name(), "newcomer", DRIVER, 1, "1Gi", 10),
    );
    let (_, claim) = world.running("newcomer");
    let placed = claim["status"]["allocation"]["devices"]["results"][0]["device"].clone();
    assert_ne!(placed, json!(device), "{claim}");
    world.stop();
}
