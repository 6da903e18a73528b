//! Every example of `examples/` runs as its README says, one test each:
//! the local-mode program under its quota and share on the driver double;
//! the PyTorch programs parse and their daemon configuration passes
//! `hypervisor check-config` (they need a GPU: the GPU check runs them);
//! the README's install commands for the swap and overcommit configuration
//! run up to its check, which prints what the README shows; and the
//! Kubernetes manifests validate against the upstream schemas and ask for
//! what their comments say, as the daemon reads them. The DRA pod is not
//! applied to a control plane (starting one costs more than the check is
//! worth here): `dra_cluster` takes `deploy/example`, the same shape, there.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use hypervisor_kubernetes::deviceplugin::DEFAULT_RESOURCE;
use hypervisor_kubernetes::deviceplugin::ask::{self, ContainerAsk, MemoryAsk};
use k8s_openapi::api::core::v1::Pod as KubePod;
use k8s_openapi::api::resource::v1::ResourceClaimTemplate;
use serde::Deserialize;
use serde_json::Value;
use system_tests::artifacts;
use system_tests::pod::Pod;
use system_tests::probes::{self, serial};
use system_tests::scratch::Scratch;
use system_tests::tools;

const README: &str = include_str!("../../../examples/README.md");

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// The README's first block of `kind` (`sh`, `text`) after `marker`.
fn readme_block(marker: &str, kind: &str) -> &'static str {
    README
        .split_once(marker)
        .unwrap_or_else(|| panic!("the examples' README says {marker:?}"))
        .1
        .split_once(&format!("```{kind}\n"))
        .and_then(|(_, rest)| rest.split_once("```"))
        .unwrap_or_else(|| panic!("a {kind} block after {marker:?}"))
        .0
}

/// stdout and stderr, for a failure's message.
fn said(output: &Output) -> String {
    format!(
        "{:?}\nstdout:\n{}\nstderr:\n{}",
        output.status,
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    )
}

/// `hypervisor check-config` on `config`: its stdout lines, the check
/// having passed.
fn check_config(config: &Path) -> Vec<String> {
    let output = Command::new(artifacts::hypervisor())
        .arg("check-config")
        .arg("--config")
        .arg(config)
        .output()
        .expect("the daemon runs");
    assert!(output.status.success(), "{}", said(&output));
    probes::stdout_lines(&output)
}

#[test]
fn local_quota_runs_under_its_quota_and_share() {
    let _serial = serial();
    let pod = Pod::new("example-quota");
    let mut command = Command::new("bash");
    command
        .arg(root().join("examples/local-quota/run.sh"))
        .env("LIMITER", artifacts::limiter())
        .env("GPUSHARE_DOUBLE_DIR", gpushare_examples::double_dir())
        .env("CUDA_LIMITER_POD", &pod.0)
        .env_remove("GPUSHARE_DOUBLE_TOTAL")
        .env_remove("CUDA_LIMITER_LOG");
    probes::use_node_tables(&mut command, &pod);
    let output = command.output().expect("bash runs");
    assert!(output.status.success(), "{}", said(&output));
    let lines = probes::stdout_lines(&output);
    let shown: Vec<&str> = readme_block("runs on the driver double", "text")
        .lines()
        .collect();
    let [driver, memory, allocations, kernels] = shown[..] else {
        panic!("the README's output of local-quota changed: {shown:?}");
    };
    assert_eq!(lines.len(), 4, "{}", said(&output));
    assert_eq!(
        lines[..3],
        [driver, memory, allocations],
        "{}",
        said(&output)
    );
    // The last line's time varies; its GPU time and the share's bound do not.
    let (work, _) = kernels.split_once(" in ").expect("`... in N s: ...`");
    assert!(lines[3].starts_with(work), "{}", said(&output));
    let share: i64 = lines[3]
        .rsplit_once(": ")
        .and_then(|(_, rest)| rest.split_once('%'))
        .and_then(|(percent, _)| percent.parse().ok())
        .unwrap_or_else(|| panic!("no share in {:?}", lines[3]));
    // A limit caps the share however loaded the machine; 3 points of
    // tolerance, as the limiter's own share tests take.
    assert!(share <= 33, "share {share}% under a 30% limit: {lines:?}");
}

#[test]
fn pytorch_programs_parse_and_their_daemon_config_passes_its_check() {
    let dir = root().join("examples/pytorch");
    // Compiled, not run (PyTorch and a GPU: the GPU check's part), and
    // without writing a `__pycache__` into the repository.
    let compiled = Command::new("python3")
        .args([
            "-c",
            "import sys\nfor path in sys.argv[1:]:\n    compile(open(path).read(), path, 'exec')",
        ])
        .arg(dir.join("train_step.py"))
        .arg(dir.join("infer_loop.py"))
        .output()
        .expect("python3 runs");
    assert!(compiled.status.success(), "{}", said(&compiled));
    let syntax = Command::new("bash")
        .arg("-n")
        .arg(dir.join("run.sh"))
        .output()
        .expect("bash runs");
    assert!(syntax.status.success(), "{}", said(&syntax));

    // The configuration with the token files run.sh makes beside it.
    let scratch = Scratch::new("example-pytorch");
    let config = scratch.dir.join("hypervisor.toml");
    std::fs::copy(dir.join("hypervisor.toml"), &config).expect("copy the configuration");
    std::fs::create_dir(scratch.dir.join("tokens")).expect("the tokens' folder");
    for pod in ["train", "infer"] {
        std::fs::write(
            scratch.dir.join("tokens").join(pod),
            format!("token-{pod}\n"),
        )
        .expect("a token file");
    }
    assert_eq!(
        check_config(&config),
        [
            "listen 127.0.0.1:7070",
            "admin API off",
            "pod train (1 GPUs)",
            "  index 0: memory 8589934592 bytes, weight 1, cap 60%, share -, policy fixed",
            "pod infer (1 GPUs)",
            "  index 0: memory 4294967296 bytes, weight 1, cap -, share -, policy none",
        ]
    );
}

#[test]
fn daemon_config_with_swap_and_overcommit_installs_as_the_readme_says() {
    let scratch = Scratch::new("example-daemon");
    let etc = scratch.dir.join("gpushare");
    let script = readme_block("To install it:", "sh")
        .replace("/etc/gpushare", etc.to_str().expect("a UTF-8 scratch path"));
    assert!(script.contains("hypervisor check-config"), "{script}");
    let binary = artifacts::hypervisor();
    let path = format!(
        "{}:{}",
        binary.parent().expect("the binary's folder").display(),
        std::env::var("PATH").unwrap_or_default()
    );
    let output = Command::new("bash")
        .args(["-euo", "pipefail", "-c", &script])
        .env("PATH", path)
        .current_dir(root())
        .output()
        .expect("bash runs");
    assert!(output.status.success(), "{script}\n{}", said(&output));
    let shown: Vec<&str> = readme_block("prints what the file says", "text")
        .lines()
        .collect();
    assert_eq!(probes::stdout_lines(&output), shown, "{}", said(&output));
}

/// The objects of `examples/kubernetes/<file>`, after
/// `scripts/validate-manifests.py` has validated them against the upstream
/// schemas (it fails with the install command when its tools are missing).
fn validated(file: &str) -> Vec<Value> {
    let relative = format!("examples/kubernetes/{file}");
    let output = tools::command("python3")
        .args(["scripts/validate-manifests.py", &relative])
        .current_dir(root())
        .output()
        .expect("python3 runs");
    assert_ne!(
        output.status.code(),
        Some(2),
        "the validator's tools are missing \
         (scripts/test.sh installs them under target/tools): {}",
        said(&output)
    );
    assert!(output.status.success(), "{}", said(&output));
    let verdict = format!("ok   {relative}:");
    assert!(
        String::from_utf8_lossy(&output.stdout).contains(&verdict),
        "{}",
        said(&output)
    );
    let text = std::fs::read_to_string(root().join(&relative)).expect("the example");
    serde_yaml::Deserializer::from_str(&text)
        .map(|document| Value::deserialize(document).expect("YAML"))
        .filter(|value| !value.is_null())
        .collect()
}

#[test]
fn kubernetes_dra_claim_and_pod_validate_and_ask_the_driver() {
    let objects = validated("dra.yaml");
    let [template, pod] = &objects[..] else {
        panic!("dra.yaml holds a ResourceClaimTemplate and a Pod: {objects:?}");
    };
    let template: ResourceClaimTemplate =
        serde_json::from_value(template.clone()).expect("a ResourceClaimTemplate");
    let pod: KubePod = serde_json::from_value(pod.clone()).expect("a Pod");
    let spec = template
        .spec
        .and_then(|spec| spec.spec)
        .expect("the claim's spec");
    let devices = spec.devices.expect("devices");
    let [request] = &devices.requests.expect("requests")[..] else {
        panic!("one request");
    };
    let exactly = request.exactly.as_ref().expect("exactly");
    assert_eq!(exactly.device_class_name, hypervisor_kubernetes::DRIVER);
    let asked = exactly
        .capacity
        .as_ref()
        .and_then(|c| c.requests.as_ref())
        .expect("capacity requests");
    assert_eq!(
        hypervisor_kubernetes::quantity::parse(&asked["memory"].0),
        Some(6 << 30)
    );
    assert_eq!(asked["compute"].0, "25");
    let [config] = &devices.config.expect("config")[..] else {
        panic!("one config");
    };
    let opaque = config.opaque.as_ref().expect("opaque parameters");
    assert_eq!(opaque.driver, hypervisor_kubernetes::DRIVER);
    let parameters = &opaque.parameters.0;
    assert_eq!(parameters["kind"], "GpuShareParameters");
    assert_eq!(parameters["policy"], "elastic");
    assert_eq!(parameters["class"], "latency");
    // The pod uses the template, in the container that runs.
    let pod_spec = pod.spec.expect("the pod's spec");
    let [claim] = &pod_spec.resource_claims.expect("resourceClaims")[..] else {
        panic!("one claim");
    };
    assert_eq!(
        claim.resource_claim_template_name, template.metadata.name,
        "the pod names the template"
    );
    let claims = pod_spec.containers[0]
        .resources
        .as_ref()
        .and_then(|r| r.claims.as_ref())
        .expect("the container's claims");
    assert_eq!(claims[0].name, claim.name);
}

#[test]
fn kubernetes_device_plugin_pod_validates_and_asks_4096_mib_and_30_percent() {
    let objects = validated("device-plugin.yaml");
    let [pod] = &objects[..] else {
        panic!("device-plugin.yaml holds one Pod: {objects:?}");
    };
    let pod: KubePod = serde_json::from_value(pod.clone()).expect("a Pod");
    let container = &pod.spec.as_ref().expect("the pod's spec").containers[0];
    // Read as the plugin reads a container at Allocate.
    let asked = ask::container_ask(container, DEFAULT_RESOURCE).expect("a valid ask");
    assert_eq!(
        asked,
        Some(ContainerAsk {
            container: "main".to_owned(),
            count: 1,
            memory: MemoryAsk::Mib(4096),
            cores: Some(30),
        })
    );
    ask::pod_prefs(&pod).expect("valid annotations");
}
