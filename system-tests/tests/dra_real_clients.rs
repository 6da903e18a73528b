//! The whole DRA flow driven by the real clients against the fakes: the
//! real node agent (on the driver double's GPUs) publishes its
//! ResourceSlice to the fake API server; upstream `kubectl` 1.37, or the
//! official Python client, reads it, creates the claim and its pod, and
//! writes the scheduler's allocation and the pod's status as those would;
//! the fake kubelet prepares the claim over the plugin's socket; the CDI
//! spec written is the container's whole view: the driver double's probe
//! runs under the limiter with exactly its env (its mounts emulated by
//! their host paths: the preload file's library by `LD_PRELOAD` of a link
//! with the pod file beside it, the regions' host paths being their
//! container paths)
//! and gets the claim's memory quota; deleting pod and claim, then the
//! kubelet's unprepare, leaves nothing in the CDI folder or `/dev/shm`.

use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use gpushare_utils::pod_file::PodFile;
use hypervisor_provision::{CONTAINER_POD_FILE, CONTAINER_PRELOAD, CONTAINER_SHM};
use kube_fakes::apiserver::FakeApiServer;
use kube_fakes::clients::{self, Kubectl};
use kube_fakes::cluster;
use kube_fakes::kubelet::Version;
use kube_fakes::node::{self, TestNode};
use serde_json::{Value, json};
use system_tests::container::ContainerLib;
use system_tests::daemon::DoubleGpus;
use system_tests::probes::{CONTEXT_BYTES, GIB, MIB, info};
use system_tests::{artifacts, probes};

const DRIVER: &str = "gpu.gpushare.dev";
const NODE: &str = "node-dra";
const GPUS: u8 = 2;

/// A folder under the temp dir and the regions of the pods it names,
/// removed when the test ends, however it ends.
struct Scratch {
    dir: PathBuf,
    shm: Mutex<Vec<PathBuf>>,
}

impl Scratch {
    fn new(tag: &str) -> Self {
        let dir = std::env::temp_dir().join(format!("limiter-dra-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        Self {
            dir,
            shm: Mutex::new(Vec::new()),
        }
    }

    /// The pod's region and limits, as the hypervisor names them in `/dev/shm`.
    fn pod_files(pod: &str) -> [PathBuf; 2] {
        [
            PathBuf::from(format!("/dev/shm/gpushare-pod-{pod}")),
            PathBuf::from(format!("/dev/shm/gpushare-limits-{pod}")),
        ]
    }

    fn track(&self, pod: &str) {
        self.shm.lock().unwrap().extend(Self::pod_files(pod));
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
        for file in self.shm.lock().unwrap().iter() {
            let _ = std::fs::remove_file(file);
        }
    }
}

/// The fake API server, the node under test, `kubectl` for them. Fields
/// drop in order: the node (its node tables), the server, the runtime its
/// tasks run on, then the scratch folder.
struct World {
    node: Option<TestNode>,
    api: FakeApiServer,
    kubectl: Kubectl,
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
    /// The server, the Node object (by `kubectl apply`), the shipped
    /// DeviceClass, then the node agent on the driver double's GPUs.
    fn start(tag: &str) -> Self {
        let scratch = Scratch::new(tag);
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap();
        let api = runtime.block_on(FakeApiServer::start()).unwrap();
        let kubeconfig = scratch.dir.join("kubeconfig");
        api.write_kubeconfig(&kubeconfig).unwrap();
        let kubectl = Kubectl::new(&kubeconfig, &scratch.dir.join("home"));
        let mut world = Self {
            node: None,
            api,
            kubectl,
            runtime,
            scratch,
        };
        world.ok_with(
            &["apply", "-f", "-"],
            &format!("apiVersion: v1\nkind: Node\nmetadata:\n  name: {NODE}\n"),
        );
        let class = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../deploy/base/deviceclass.yaml"
        );
        world.ok(&["apply", "-f", class]);
        let mut options = node::options(&world.scratch.dir, NODE, DRIVER, artifacts::limiter());
        // The probe runs outside any pod's cgroup.
        options.check_identity = false;
        let node = world
            .runtime
            .block_on(TestNode::start(
                &world.api,
                Arc::new(DoubleGpus(GPUS)),
                options,
            ))
            .unwrap();
        world.node = Some(node);
        world
    }

    fn node(&self) -> &TestNode {
        self.node.as_ref().unwrap()
    }

    /// `kubectl args`, which must succeed; its stdout.
    fn ok(&self, args: &[&str]) -> String {
        self.kubectl
            .ok(args, None)
            .unwrap_or_else(|e| panic!("{e}"))
    }

    /// `kubectl args` with `input` on stdin, which must succeed; its stdout.
    fn ok_with(&self, args: &[&str], input: &str) -> String {
        self.kubectl
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
    /// once the agent has published it: one device a GPU of the double,
    /// with its UUID and its shareable `memory` and `compute`.
    fn slice(&self) -> Value {
        let slice = eventually("the node's ResourceSlice", || {
            self.get(&["resourceslices"])["items"]
                .as_array()
                .into_iter()
                .flatten()
                .find(|s| s["spec"]["nodeName"] == NODE)
                .cloned()
        });
        assert_slice(&slice);
        slice
    }

    /// The scheduler's writes, by `kubectl patch --subresource=status`: the
    /// claim allocated on `device` of this node (its consumed capacity, a
    /// share ID, its config, the pod reserving it), then the pod running.
    fn allocate(&self, claim: &str, pod: &str, device: &str) {
        let claim_object = self.get(&["resourceclaim", claim]);
        let pod_object = self.get(&["pod", pod]);
        let allocation = cluster::allocation(&claim_object, &pod_object, DRIVER, NODE, device);
        let status_patch = |patch: &Value, what: &[&str]| {
            let patch = patch.to_string();
            let mut args = vec![
                "patch",
                "--subresource=status",
                "--type=merge",
                "-p",
                &patch,
            ];
            args.extend_from_slice(what);
            args.extend_from_slice(&["-o", "json"]);
            let text = self.ok(&args);
            serde_json::from_str::<Value>(&text).unwrap_or_else(|e| panic!("{e}: {text}"))
        };
        let patched = status_patch(&allocation, &["resourceclaim", claim]);
        assert_eq!(patched["status"], allocation["status"], "{patched}");
        let patched = status_patch(&cluster::running(claim), &["pod", pod]);
        assert_eq!(patched["status"]["phase"], "Running", "{patched}");
    }

    /// The kubelet's `NodePrepareResources` for `claim` (of pod `pod`),
    /// allocated on GPU `gpu`; checks the answer and the CDI spec written.
    fn prepare(&self, claim: &str, pod: &str, gpu: u8) -> Prepared {
        let claim_uid = self.get(&["resourceclaim", claim])["metadata"]["uid"]
            .as_str()
            .unwrap()
            .to_owned();
        let pod_uid = self.get(&["pod", pod])["metadata"]["uid"]
            .as_str()
            .unwrap()
            .to_owned();
        self.scratch.track(&pod_uid);
        let answer = self
            .runtime
            .block_on(
                self.node()
                    .kubelet
                    .prepare(Version::V1, "default", claim, &claim_uid),
            )
            .unwrap();
        assert_eq!(answer.error, "");
        assert_eq!(
            answer.devices,
            vec![(
                format!("gpu-{gpu}"),
                vec![format!("gpushare.dev/gpu={claim_uid}")]
            )]
        );
        let spec_path = self
            .scratch
            .dir
            .join("cdi")
            .join(format!("gpushare.dev-gpu_{claim_uid}.json"));
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

    /// The hypervisor's view of pod `pod`: its first GPU's grant.
    fn grant(&self, pod: &str) -> Option<Value> {
        let status = serde_json::to_value(self.node().hv.status()).unwrap();
        status["pods"]
            .as_array()
            .unwrap()
            .iter()
            .find(|p| p["id"] == pod)
            .map(|p| p["gpus"][0].clone())
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

    /// The kubelet's `NodeUnprepareResources` once pod and claim are
    /// deleted; then the spec, the token, the regions and the hypervisor's
    /// pod are gone, and so are the objects.
    fn unprepare(&self, claim: &str, pod: &str, prepared: &Prepared) {
        let error = self
            .runtime
            .block_on(self.node().kubelet.unprepare(
                Version::V1,
                "default",
                claim,
                &prepared.claim_uid,
            ))
            .unwrap();
        assert_eq!(error, "");
        let pod_file = PathBuf::from(prepared.host_path(CONTAINER_POD_FILE));
        eventually("the claim's files gone", || {
            let left: Vec<PathBuf> = Scratch::pod_files(&prepared.pod_uid)
                .into_iter()
                .chain([prepared.spec_path.clone(), pod_file.clone()])
                .filter(|f| f.exists())
                .collect();
            left.is_empty().then_some(())
        });
        assert!(self.grant(&prepared.pod_uid).is_none());
        let left = self.ok(&["get", "pods,resourceclaims", "-o", "name"]);
        assert_eq!(left, "", "{pod} and {claim} deleted");
    }

    fn stop(mut self) {
        if let Some(node) = self.node.take() {
            self.runtime.block_on(node.stop());
        }
    }
}

/// Polls `check` (every 50 ms, up to 10 s) until it gives a value.
fn eventually<T>(what: &str, mut check: impl FnMut() -> Option<T>) -> T {
    for _ in 0..200 {
        if let Some(found) = check() {
            return found;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    panic!("timed out waiting for {what}");
}

/// The slice of this node's pool: the double's GPUs with their UUIDs,
/// shareable, with `memory` (at most the GPU's) and `compute` (100, taken
/// 1 to 100 at a time) to consume.
fn assert_slice(slice: &Value) {
    let spec = &slice["spec"];
    assert_eq!(spec["driver"], DRIVER, "{slice}");
    assert_eq!(spec["pool"]["name"], NODE, "{slice}");
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

const CLAIM_AND_POD: &str = r#"apiVersion: resource.k8s.io/v1
kind: ResourceClaim
metadata:
  name: train-gpu
spec:
  devices:
    requests:
      - name: gpu
        exactly:
          deviceClassName: gpu.gpushare.dev
          capacity:
            requests:
              memory: 4Gi
              compute: "30"
    config:
      - requests: ["gpu"]
        opaque:
          driver: gpu.gpushare.dev
          parameters:
            apiVersion: gpu.gpushare.dev/v1alpha1
            kind: GpuShareParameters
            weight: 2
---
apiVersion: v1
kind: Pod
metadata:
  name: train
spec:
  nodeName: node-dra
  containers:
    - name: main
      image: cuda
      resources:
        claims:
          - name: gpu
  resourceClaims:
    - name: gpu
      resourceClaimName: train-gpu
"#;

#[test]
fn kubectl_drives_a_claim_from_slice_to_limited_process_and_back() {
    let world = World::start("kubectl");
    world.slice();

    let applied = world.ok_with(&["apply", "-f", "-"], CLAIM_AND_POD);
    assert_eq!(
        applied,
        "resourceclaim.resource.k8s.io/train-gpu created\npod/train created\n"
    );
    // Applied again: nothing to change.
    let again = world.ok_with(&["apply", "-f", "-"], CLAIM_AND_POD);
    assert!(again.contains("train-gpu unchanged"), "{again}");
    world.allocate("train-gpu", "train", "gpu-1");

    let prepared = world.prepare("train-gpu", "train", 1);
    let grant = world
        .grant(&prepared.pod_uid)
        .expect("pod in the hypervisor");
    assert_eq!(
        (
            &grant["memory_quota"],
            &grant["cap_percent"],
            &grant["weight"]
        ),
        (&json!(4 * GIB), &json!(30), &json!(2))
    );
    // 3 GiB fits in the 4 GiB quota; 2 GiB more does not.
    let lines = world.probe(&prepared, &probe_args(&[3, 2]));
    assert_quota(&lines, 4, &[3, 2]);
    assert_eq!(
        lines
            .iter()
            .skip(1)
            .map(|l| probes::result_of(l))
            .collect::<Vec<_>>(),
        [0, 2]
    );

    world.ok(&["delete", "pod", "train"]);
    world.ok(&["delete", "resourceclaim", "train-gpu"]);
    world.unprepare("train-gpu", "train", &prepared);
    world.stop();
}

/// The official Python client's part: the claim (2 GiB, 20%) and its pod
/// created; the claim watched until the scheduler's allocation appears;
/// the node's slice read through `ResourceV1Api`; then, when told, pod and
/// claim deleted. Each step prints one JSON line.
const PYTHON: &str = r#"
import json, sys
from kubernetes import client, config, watch

config.load_kube_config(config_file=sys.argv[1])
node, driver = sys.argv[2], sys.argv[3]
core, resource = client.CoreV1Api(), client.ResourceV1Api()
ns = "default"

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
    "spec": {"nodeName": node,
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
                      field_selector="metadata.name=infer-gpu", timeout_seconds=30):
    got = event["object"]
    if got.status and got.status.allocation:
        allocated = got
        w.stop()
assert allocated is not None, "no allocation seen"
result = allocated.status.allocation.devices.results[0]
slices = [s for s in resource.list_resource_slice().items if s.spec.node_name == node]
assert len(slices) == 1, slices
say(step="allocated",
    result={"device": result.device, "pool": result.pool, "driver": result.driver,
            "consumedCapacity": result.consumed_capacity, "shareID": result.share_id},
    reservedFor=[r.uid for r in allocated.status.reserved_for],
    slice=client.ApiClient().sanitize_for_serialization(slices[0]))

sys.stdin.readline()
core.delete_namespaced_pod("infer", ns)
resource.delete_namespaced_resource_claim("infer-gpu", ns)
say(step="deleted", left=[p.metadata.name for p in core.list_namespaced_pod(ns).items]
    + [c.metadata.name for c in resource.list_namespaced_resource_claim(ns).items])
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
    let script = world.scratch.dir.join("claim.py");
    std::fs::write(&script, PYTHON).unwrap();
    let mut child = Script(
        Command::new(python)
            .arg(&script)
            .args([
                &world.kubectl.kubeconfig,
                Path::new(NODE),
                Path::new(DRIVER),
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
    world.allocate("infer-gpu", "infer", "gpu-0");
    let allocated = child.say(&mut lines);
    assert_eq!(allocated["step"], "allocated", "{allocated}");
    assert_eq!(
        allocated["result"],
        json!({"device": "gpu-0", "pool": NODE, "driver": DRIVER,
            "consumedCapacity": {"memory": "2Gi", "compute": "20"},
            "shareID": allocated["result"]["shareID"]})
    );
    assert_eq!(allocated["reservedFor"], json!([created["pod"]]));
    assert_slice(&allocated["slice"]);

    let prepared = world.prepare("infer-gpu", "infer", 0);
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
    assert_eq!(
        out.iter()
            .skip(1)
            .map(|l| probes::result_of(l))
            .collect::<Vec<_>>(),
        [2, 0, 2]
    );

    writeln!(child.0.stdin.take().unwrap(), "delete").unwrap();
    let deleted = child.say(&mut lines);
    assert_eq!(deleted, json!({"step": "deleted", "left": []}));
    let status = child.0.wait().unwrap();
    assert!(status.success(), "{status}");
    world.unprepare("infer-gpu", "infer", &prepared);
    world.stop();
}
