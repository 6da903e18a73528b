//! GPUs shared by processes through the node file (layout in
//! `double/node.c`): probes charge the same GPUs, a killed one is reclaimed,
//! racing ones never pass the total, a checkpoint frees a process's bytes on
//! the node and a restore needs room for them, NVML reports the node's use.
#![cfg(all(target_arch = "x86_64", target_os = "linux"))]

use std::ffi::c_int;
use std::path::Path;
use std::process::Command;
use std::time::Duration;

use crate::common;

use common::checkpoint_api::{Api, CHECKPOINTED, LOCKED, checkpoint_dir, pairs};
use common::interactive::Interactive;
use common::{CTX, CUDA_SUCCESS, GIB, MIB, lines};
use gpushare_examples::{NODE_FILE_VAR, command, node_used, program};

const CUDA_ERROR_OUT_OF_MEMORY: c_int = 2;
/// Every GPU's size in these tests.
const TOTAL: u64 = 16 * GIB;
/// How long a reply that must come may take.
const REPLY: Duration = Duration::from_secs(20);

/// A new folder for a node file, under the target's temporary directory
/// (removed when dropped).
fn node_dir() -> tempfile::TempDir {
    tempfile::Builder::new()
        .prefix("node")
        .tempdir_in(env!("CARGO_TARGET_TMPDIR"))
        .expect("a temporary folder")
}

/// GPU `gpu`'s shared used bytes.
fn used(node: &Path, gpu: usize) -> u64 {
    node_used(node, gpu).expect("a node file with that GPU")
}

/// The double's knobs for a probe: 16 GiB GPUs sharing `node` (none when
/// `None`), `devices` of them, nothing inherited but the checkpoint folder.
fn configure(cmd: &mut Command, node: Option<&Path>, devices: u32) {
    for var in [
        "LD_PRELOAD",
        "GPUSHARE_DOUBLE_CONTEXT_BYTES",
        "GPUSHARE_DOUBLE_KERNEL_NS",
        "GPUSHARE_DOUBLE_QUEUE_DEPTH",
        NODE_FILE_VAR,
    ] {
        cmd.env_remove(var);
    }
    cmd.env("GPUSHARE_DOUBLE_TOTAL", TOTAL.to_string())
        .env("GPUSHARE_DOUBLE_DEVICES", devices.to_string());
    if let Some(node) = node {
        cmd.env(NODE_FILE_VAR, node);
    }
}

/// `cudaprobe [--device DEVICE] SCRIPT` on `devices` GPUs sharing `node`.
fn cuda(node: Option<&Path>, devices: u32, device: u32, script: &str) -> Interactive {
    let mut cmd = command("cudaprobe");
    configure(&mut cmd, node, devices);
    cmd.args(["--device", &device.to_string()])
        .args(script.split_whitespace());
    Interactive::spawn(cmd, REPLY)
}

/// `ckptprobe SIZE` on `devices` GPUs sharing `node`, once ready; its pid.
fn ckpt(node: &Path, devices: u32, size: &str) -> (Interactive, i32) {
    let mut cmd = Command::new(program("ckptprobe"));
    configure(&mut cmd, Some(node), devices);
    cmd.arg(size);
    let probe = Interactive::spawn(cmd, REPLY);
    probe.ready();
    let pid = probe.pid();
    (probe, pid)
}

/// The stdout lines of a `cudaprobe` script that runs to its end, on one
/// 16 GiB GPU shared through `node` (none when `None`).
fn script(node: Option<&Path>, text: &str) -> Vec<String> {
    let total = TOTAL.to_string();
    let mut env = vec![
        ("GPUSHARE_DOUBLE_TOTAL", total.as_str()),
        ("GPUSHARE_DOUBLE_DEVICES", "1"),
    ];
    if let Some(node) = node {
        env.push((NODE_FILE_VAR, node.to_str().expect("a UTF-8 path")));
    }
    lines("cudaprobe", &[], text, &env)
}

fn nvml(name: &str, used: u64) -> String {
    format!("{name} 0 free={} used={used} total={TOTAL}", TOTAL - used)
}

#[test]
fn a_holder_leaves_no_room_until_it_is_killed() {
    let dir = node_dir();
    let node = dir.path().join("node");
    let a = cuda(Some(&node), 1, 0, "alloc mem 10g wait");
    a.expect(&["alloc mem 10g -> 0 0", "ready"]);
    assert_eq!(used(&node, 0), CTX + 10 * GIB);
    assert_eq!(node_used(&node, 1), None, "one GPU");
    assert_eq!(node_used(&dir.path().join("none"), 0), None);

    // B's own GPU would hold 8 GiB; the node's has A's 10 GiB on it. NVML's
    // memory info is the node's, the process figures B's own.
    let both = 2 * CTX + 10 * GIB;
    assert_eq!(
        script(Some(&node), "alloc mem 8g nvml nvml_v2 nvml_procs"),
        [
            "alloc mem 8g -> 2 -".to_owned(),
            nvml("nvml", both),
            nvml("nvml_v2", both),
            format!("nvml_procs 0 count=1 used={CTX}"),
        ]
    );
    assert_eq!(used(&node, 0), CTX + 10 * GIB, "B's context left with B");

    a.kill();
    assert_eq!(
        used(&node, 0),
        CTX + 10 * GIB,
        "until someone needs the room"
    );
    assert_eq!(
        script(Some(&node), "alloc mem 8g info"),
        [
            "alloc mem 8g -> 0 0".to_owned(),
            format!("info 0 free={} total={TOTAL}", TOTAL - CTX - 8 * GIB),
        ],
        "A's charges reclaimed; cuMemGetInfo stays per process"
    );
    assert_eq!(used(&node, 0), 0);
}

#[test]
fn an_exiting_process_takes_its_charges_off() {
    let dir = node_dir();
    let node = dir.path().join("node");
    let mut a = cuda(Some(&node), 1, 0, "alloc mem 1g wait");
    a.expect(&["alloc mem 1g -> 0 0", "ready"]);
    assert_eq!(used(&node, 0), CTX + GIB);
    a.send("");
    a.expect(&["resumed"]);
    a.finish();
    assert_eq!(used(&node, 0), 0);
}

#[test]
fn without_the_file_each_process_has_its_own_gpus() {
    let a = cuda(None, 1, 0, "alloc mem 10g wait");
    a.expect(&["alloc mem 10g -> 0 0", "ready"]);
    assert_eq!(
        script(None, "alloc mem 8g nvml"),
        [
            "alloc mem 8g -> 0 0".to_owned(),
            nvml("nvml", CTX + 8 * GIB)
        ]
    );
}

#[test]
fn racing_processes_never_pass_the_total() {
    const PROBES: u64 = 3;
    let dir = node_dir();
    let node = dir.path().join("node");
    let mut probes: Vec<Interactive> = (0..PROBES)
        .map(|_| {
            cuda(
                Some(&node),
                1,
                0,
                "wait fill 1m wait freeall hammer 2 2000 3g wait",
            )
        })
        .collect();
    for probe in &probes {
        probe.expect(&["ready"]);
    }
    for probe in &mut probes {
        probe.send("");
    }
    let mut blocks = 0;
    for probe in &probes {
        probe.expect(&["resumed"]);
        let fill = probe.line();
        let count: u64 = fill
            .strip_prefix("fill 1m count=")
            .and_then(|rest| rest.strip_suffix(" last=2"))
            .and_then(|count| count.parse().ok())
            .unwrap_or_else(|| panic!("{fill}"));
        blocks += count;
        probe.expect(&["ready"]);
    }
    let charged = PROBES * CTX + blocks * MIB;
    assert!(charged <= TOTAL, "{blocks} blocks of 1 MiB");
    assert!(TOTAL - charged < MIB, "a block fits still: {blocks}");
    assert_eq!(used(&node, 0), charged);

    // Allocations and frees racing, 3 GiB each, up to 6 at once (18 GiB):
    // the shared used never passes the total, and nothing is left behind.
    let done = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let observer = {
        let (done, node) = (done.clone(), node.clone());
        std::thread::spawn(move || {
            let mut most = 0;
            while !done.load(std::sync::atomic::Ordering::Acquire) {
                most = most.max(used(&node, 0));
                std::thread::sleep(Duration::from_micros(50));
            }
            most
        })
    };
    for probe in &mut probes {
        probe.send("");
    }
    let mut ok = 0;
    for probe in &probes {
        probe.expect(&["resumed", "freeall 0"]);
        let hammer = probe.line();
        let counts: Vec<u64> = hammer
            .strip_prefix("hammer ")
            .map(|rest| {
                rest.split(' ')
                    .filter_map(|field| field.split_once('=')?.1.parse().ok())
                    .collect()
            })
            .unwrap_or_default();
        assert!(
            counts.len() == 3 && counts[0] + counts[1] == 4000 && counts[2] == 0,
            "{hammer}"
        );
        ok += counts[0];
        probe.expect(&["ready"]);
    }
    done.store(true, std::sync::atomic::Ordering::Release);
    let most = observer.join().unwrap();
    assert!(ok > 0);
    assert!(most <= TOTAL, "{most} bytes used at once");
    assert_eq!(used(&node, 0), PROBES * CTX);
    for probe in probes {
        probe.finish();
    }
    assert_eq!(used(&node, 0), 0);
}

// ---------------------------------------------------------------- checkpoints

#[test]
fn a_checkpoint_makes_room_and_a_restore_needs_it() {
    let Some(dir) = checkpoint_dir("a_checkpoint_makes_room_and_a_restore_needs_it") else {
        return;
    };
    let node = dir.join("node");
    let api = Api::open();
    let (mut a, pid) = ckpt(&node, 1, "10g");
    assert_eq!(used(&node, 0), CTX + 10 * GIB);
    let mut b = cuda(
        Some(&node),
        1,
        0,
        "alloc mem 8g wait alloc mem 8g wait free 0 wait",
    );
    b.expect(&["alloc mem 8g -> 2 -", "ready"]);

    api.park(pid);
    assert_eq!(used(&node, 0), CTX, "A's bytes are in host memory");
    b.send("");
    b.expect(&["resumed", "alloc mem 8g -> 0 0", "ready"]);
    assert_eq!(used(&node, 0), CTX + 8 * GIB);

    assert_eq!(api.restore_onto(pid, &[]), CUDA_ERROR_OUT_OF_MEMORY);
    assert_eq!(api.state(pid), Ok(CHECKPOINTED));
    assert_eq!(used(&node, 0), CTX + 8 * GIB, "nothing changed");

    b.send("");
    b.expect(&["resumed", "free 0 -> 0", "ready"]);
    assert_eq!(api.restore_onto(pid, &[]), CUDA_SUCCESS);
    assert_eq!(api.state(pid), Ok(LOCKED));
    assert_eq!(used(&node, 0), 2 * CTX + 10 * GIB);
    assert_eq!(api.unlock(pid), CUDA_SUCCESS);

    // A's own GPU has room for 4.5 GiB more; the node's, with B's context, not.
    assert_eq!(a.ask("alloc 1g"), "alloc 0");
    assert_eq!(a.ask("alloc 4608m"), "alloc 2");
    assert_eq!(used(&node, 0), 2 * CTX + 11 * GIB);
    b.send("");
    b.expect(&["resumed"]);
    b.finish();
    assert_eq!(a.ask("alloc 4608m"), "alloc 0");
    assert_eq!(used(&node, 0), CTX + 11 * GIB + 4608 * MIB);
    a.finish();
    assert_eq!(used(&node, 0), 0);
}

#[test]
fn a_restore_onto_another_gpu_needs_room_there() {
    let Some(dir) = checkpoint_dir("a_restore_onto_another_gpu_needs_room_there") else {
        return;
    };
    let node = dir.join("node");
    let api = Api::open();
    let (mut a, pid) = ckpt(&node, 2, "10g");
    let mut b = cuda(Some(&node), 2, 1, "alloc mem 8g wait free 0 wait");
    b.expect(&["alloc mem 8g -> 0 0", "ready"]);
    assert_eq!(
        (used(&node, 0), used(&node, 1)),
        (CTX + 10 * GIB, CTX + 8 * GIB)
    );

    api.park(pid);
    assert_eq!((used(&node, 0), used(&node, 1)), (0, CTX + 8 * GIB));
    assert_eq!(
        api.restore_onto(pid, &pairs(&[(0, 1), (1, 0)])),
        CUDA_ERROR_OUT_OF_MEMORY
    );
    assert_eq!(api.state(pid), Ok(CHECKPOINTED));
    assert_eq!((used(&node, 0), used(&node, 1)), (0, CTX + 8 * GIB));

    b.send("");
    b.expect(&["resumed", "free 0 -> 0", "ready"]);
    assert_eq!(
        api.restore_onto(pid, &pairs(&[(0, 1), (1, 0)])),
        CUDA_SUCCESS
    );
    assert_eq!((used(&node, 0), used(&node, 1)), (0, 2 * CTX + 10 * GIB));
    assert_eq!(api.unlock(pid), CUDA_SUCCESS);
    assert_eq!(
        a.ask("nvml 1"),
        format!("nvml context=1 bytes={}", CTX + 10 * GIB)
    );
    assert_eq!(a.ask("alloc 1g"), "alloc 0");
    assert_eq!(used(&node, 1), 2 * CTX + 11 * GIB, "its new GPU's");
    a.kill();
    b.send("");
    b.expect(&["resumed"]);
    b.finish();
    assert_eq!(used(&node, 1), CTX + 11 * GIB, "until reclaimed");
}
