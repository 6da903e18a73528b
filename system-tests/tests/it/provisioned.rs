//! A provisioned container (device plugin or DRA): the limiter comes from
//! `/etc/ld.so.preload` and its pod, daemon and token from the pod file
//! mounted read-only beside it. A tenant controls its environment, not those
//! files: no variable it removes, changes or adds loosens its limits.

use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Command, Output};
use std::sync::Arc;

use gpushare_utils::limits::PodLimits;
use gpushare_utils::pod_file::{PodFile, VERSION};
use gpushare_utils::shm::Creation;
use system_tests::container::{self, ContainerLib};
use system_tests::daemon::{PODS_UID, double_gpus, pods_uid_hypervisor};
use system_tests::pod::{Pod, node_tables};
use system_tests::probes;
use system_tests::probes::{CONTEXT_BYTES, GIB, MIB, info};
use system_tests::scratch::Scratch;

const TOKEN: &str = "provisioned-token";
/// Whether this process may act as the pods' uid (root).
fn root() -> bool {
    gpushare_utils::shm::effective_uid() == 0
}

/// The pod file the daemon's provisioning writes for `pod`.
fn pod_file(pod: &Pod, url: &str) -> String {
    PodFile {
        version: VERSION,
        pod: pod.0.clone(),
        hypervisor: url.to_owned(),
        token: TOKEN.to_owned(),
        limits_owner: None,
        mps_required: false,
        node_tables: node_tables(pod),
    }
    .to_json()
}

/// The probe in the container, as the pods' uid, with no CUDA variable of
/// the test's but `env` (and the double's); the pod file names the test's
/// node tables.
fn in_container(container: &ContainerLib, env: &[(&str, &str)], args: &[&str]) -> Output {
    let mut command = probe_command(env, args);
    command
        .env("LD_PRELOAD", container.library())
        .uid(PODS_UID)
        .gid(PODS_UID);
    command.output().expect("probe")
}

/// The probe with no CUDA variable of the test's but `env` (and the double's).
fn probe_command(env: &[(&str, &str)], args: &[&str]) -> Command {
    let mut command = gpushare_examples::command("cudaprobe");
    for (name, _) in std::env::vars_os() {
        if name.to_string_lossy().starts_with("CUDA_") {
            command.env_remove(name);
        }
    }
    command
        .env_remove("LD_PRELOAD")
        .env("GPUSHARE_DOUBLE_TOTAL", "16g")
        .env("CUDA_LIMITER_GRANT_TIMEOUT_MS", "2000")
        .envs(env.iter().copied())
        .args(args);
    command
}

#[test]
fn an_alias_or_a_copy_of_the_containers_limiter_keeps_the_pods_limits() {
    if !root() || !container::mount_namespaces() {
        eprintln!("skipped: a container's preload file needs a mount namespace of root's");
        return;
    }
    // The container's processes load its limiter from /etc/ld.so.preload.
    // A tenant loads it again under a name of its own, a link, a
    // descriptor, or a copy of the file: the loader maps the same file once,
    // under the tenant's name, or the copy beside it. Either way the pod's
    // quota holds, shown and enforced.
    let pod = Pod::new("provisioned-alias");
    let daemon = pods_uid_hypervisor(&pod, TOKEN);
    let container = ContainerLib::with_text(&pod_file(&pod, &daemon.url()));
    let tenant = Scratch::new("tenant-files");
    let link = tenant.dir.join("l.so");
    std::os::unix::fs::symlink(container.library(), &link).unwrap();
    let copy = tenant.dir.join("copy.so");
    std::fs::copy(system_tests::artifacts::limiter(), &copy).unwrap();
    let cases: [(&str, Option<&Path>, Option<i32>); 4] = [
        ("the preload file alone", None, None),
        ("a link", Some(&link), None),
        ("a descriptor", Some(Path::new("/proc/self/fd/7")), Some(7)),
        ("a copy", Some(&copy), None),
    ];
    for (what, preload, alias) in cases {
        let mut command =
            probe_command(&[], &["info", "alloc", "mem", "2g", "alloc", "mem", "512m"]);
        if let Some(preload) = preload {
            command.env("LD_PRELOAD", preload);
        }
        container.preloaded(&mut command, PODS_UID, alias);
        let output = command.output().expect("probe");
        assert_runs_on_its_quota(what, &output);
    }
}

#[test]
fn a_process_whose_variables_are_removed_or_changed_runs_on_its_published_limits() {
    if !root() {
        eprintln!("skipped: a container's pod file is root's, and its pods another user");
        return;
    }
    let pod = Pod::new("provisioned");
    let daemon = pods_uid_hypervisor(&pod, TOKEN);
    let container = ContainerLib::with_text(&pod_file(&pod, &daemon.url()));
    // A limits object the tenant forged for a pod name of its own, owned by
    // its uid, with 3 GiB: trusted only if the environment could name the
    // pod and say its uid owns trusted objects.
    let forged_pod = Pod::new("forged");
    let forged = PodLimits::create_or_adopt(
        &forged_pod.0,
        &Creation {
            uid: Some(PODS_UID),
            gid: Some(PODS_UID),
            mode: 0o644,
        },
    )
    .expect("forged limits");
    forged
        .set(&gpushare_examples::uuid(0), 3 * GIB)
        .expect("forged quota");
    forged.publish();
    let wrong_token = format!("{TOKEN}-not");
    let uid = PODS_UID.to_string();
    let cases: [(&str, Vec<(&str, &str)>); 4] = [
        ("no variable at all", vec![]),
        (
            "the pod, the daemon, the token and the owner changed",
            vec![
                ("CUDA_LIMITER_POD", &forged_pod.0),
                ("CUDA_LIMITER_HYPERVISOR", "http://127.0.0.1:9"),
                ("CUDA_LIMITER_TOKEN", &wrong_token),
                ("CUDA_LIMITER_REGION_OWNER", &uid),
                ("CUDA_LIMITER_ALLOW_UNPATCHED", "1"),
            ],
        ),
        (
            "a higher local limit",
            vec![
                ("CUDA_DEVICE_MEMORY_LIMIT", "8g"),
                ("CUDA_LIMITER_MEMORY_LIMIT_0", "0"),
            ],
        ),
        (
            "a higher local limit, another pod and its owner",
            vec![
                ("CUDA_LIMITER_MEMORY_LIMIT", "3g"),
                ("CUDA_LIMITER_POD", &forged_pod.0),
                ("CUDA_LIMITER_REGION_OWNER", &uid),
            ],
        ),
    ];
    for (what, env) in &cases {
        let output = in_container(
            &container,
            env,
            &["info", "alloc", "mem", "2g", "alloc", "mem", "512m"],
        );
        assert_runs_on_its_quota(what, &output);
    }
    // The daemon counts the pod's processes as its own: every one registered
    // under the pod file's pod and token.
    let status = serde_json::to_value(daemon.hypervisor().status()).expect("json");
    let ours = status["pods"]
        .as_array()
        .expect("pods")
        .iter()
        .find(|p| p["id"] == pod.0.as_str())
        .expect("the pod");
    assert_eq!(ours["gpus"][0]["memory_quota"], GIB);
    // A lower local limit tightens the published one.
    let output = in_container(
        &container,
        &[("CUDA_DEVICE_MEMORY_LIMIT", "768m")],
        &["info", "alloc", "mem", "512m"],
    );
    let lines = probes::stdout_lines(&output);
    assert_eq!(
        lines[0],
        info(0, 768 * MIB - CONTEXT_BYTES, 768 * MIB),
        "{output:?}"
    );
    assert!(lines[1].starts_with("alloc mem 512m -> 2 "), "{output:?}");
    drop(forged);
    let _ = std::fs::remove_file(format!("/dev/shm/{}", PodLimits::name_of(&forged_pod.0)));
}

#[test]
fn the_node_tables_are_the_pod_files_whatever_the_variables_name() {
    if !root() {
        eprintln!("skipped: a container's pod file is root's, and its pods another user");
        return;
    }
    // A pod with a compute cap stamps the node's activity table at its
    // launches: the table the daemon made and the pod file names, not one
    // the tenant's variables name (where it could hide from other pods).
    let pod = Pod::new("provisioned-tables");
    let text = format!(
        "listen = \"127.0.0.1:0\"\nregion_uid = {PODS_UID}\nregion_gid = {PODS_UID}\n\
         [[pods]]\nid = \"{}\"\ntoken = \"{TOKEN}\"\n[[pods.gpus]]\nindex = 0\nmemory = \"1g\"\ncap = 50\n",
        pod.0
    );
    let daemon = system_tests::daemon::hypervisor(&pod, &text, Arc::new(double_gpus(1)));
    let container = ContainerLib::with_text(&pod_file(&pod, &daemon.url()));
    let elsewhere = node_tables(&Pod::new("elsewhere"));
    let output = in_container(
        &container,
        &[
            ("GPUSHARE_NODE_REGION", &elsewhere.activity),
            ("GPUSHARE_PRIORITY_REGION", &elsewhere.priority),
        ],
        &["run", "kernel", "1000", "300"],
    );
    assert!(output.status.success(), "{output:?}");
    let table = std::fs::read(format!("/dev/shm/{}", node_tables(&pod).activity))
        .expect("the daemon's activity table");
    // After the 64-byte header, device 0's slots of 16 bytes: pod key, time.
    let key = gpushare_utils::node_table::pod_key(&pod.0);
    let stamped = (0..gpushare_utils::node_table::PODS_PER_DEVICE).any(|slot| {
        let at = 64 + slot * 16;
        table
            .get(at..at + 8)
            .is_some_and(|word| u64::from_le_bytes(word.try_into().unwrap_or_default()) == key)
    });
    assert!(
        stamped,
        "no stamp of the pod in the daemon's table: {output:?}"
    );
    for name in [&elsewhere.activity, &elsewhere.priority] {
        assert!(
            !std::path::Path::new(&format!("/dev/shm/{name}")).exists(),
            "a table was made under the variables' name {name}"
        );
    }
}

#[test]
fn a_pod_file_that_is_not_the_daemons_refuses_cuda() {
    if !root() {
        eprintln!("skipped: a container's pod file is root's, and its pods another user");
        return;
    }
    let pod = Pod::new("bad-pod-file");
    let text = pod_file(&pod, "http://127.0.0.1:9");
    type Spoil<'a> = Box<dyn Fn(&ContainerLib) + 'a>;
    let cases: [(&str, Spoil<'_>, &str); 3] = [
        (
            "owned by the tenant",
            Box::new(|c| std::os::unix::fs::chown(c.pod_file(), Some(PODS_UID), None).unwrap()),
            "not root",
        ),
        (
            "writable by others",
            Box::new(|c| {
                use std::os::unix::fs::PermissionsExt;
                std::fs::set_permissions(c.pod_file(), std::fs::Permissions::from_mode(0o666))
                    .unwrap();
            }),
            "writable by group or others",
        ),
        (
            "of another version",
            Box::new(|c| {
                let path = c.pod_file();
                std::fs::remove_file(&path).unwrap();
                std::fs::write(&path, text.replace("\"version\": 1", "\"version\": 9")).unwrap();
            }),
            "version 9",
        ),
    ];
    for (what, spoil, want) in &cases {
        let container = ContainerLib::with_text(&text);
        spoil(&container);
        let output = in_container(&container, &[], &["info"]);
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(!output.status.success(), "{what}: ran: {output:?}");
        assert!(
            stderr.contains("cuInit failed: 3")
                && stderr.contains("cuda-limiter: configuration error: ")
                && stderr.contains(want),
            "{what}: {stderr}"
        );
    }
}

#[test]
fn without_a_pod_file_the_environment_decides_as_before() {
    // Local mode: a library with nothing beside it reads its variables.
    let pod = Pod::new("local");
    let lines = probes::run(probes::probe(
        "cudaprobe",
        &pod,
        &[("CUDA_DEVICE_MEMORY_LIMIT", "2g")],
        &["info"],
    ));
    assert_eq!(lines[0], info(0, 2 * GIB - CONTEXT_BYTES, 2 * GIB));
}

/// Asserts that `output`, a probe's `info, alloc mem 2g, alloc mem 512m`,
/// ran on the pod's published 1 GiB: shown as the total, 2g refused, 512m
/// given; `what` names the case.
fn assert_runs_on_its_quota(what: &str, output: &Output) {
    let lines = probes::stdout_lines(output);
    assert!(output.status.success(), "{what}: {output:?}");
    assert_eq!(
        lines[0],
        info(0, GIB - CONTEXT_BYTES, GIB),
        "{what}: {output:?}"
    );
    assert!(
        lines[1].starts_with("alloc mem 2g -> 2 "),
        "{what}: {output:?}"
    );
    assert!(
        lines[2].starts_with("alloc mem 512m -> 0 "),
        "{what}: {output:?}"
    );
}
