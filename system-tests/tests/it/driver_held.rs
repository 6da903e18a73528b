//! Device memory the driver takes without an allocation call (context
//! limits, module and library globals, graph allocation nodes, what pools
//! keep, extra contexts) is charged to the pod: refused past the quota with
//! CUDA_ERROR_OUT_OF_MEMORY, the process left usable, and given back when
//! the driver gives it back. Against the driver double, which holds these
//! bytes as the real driver does (its header comment says when).

use std::io::{BufRead, BufReader, Write};
use std::process::Stdio;
use std::sync::Arc;
use std::time::{Duration, Instant};

use hypervisor_observer::{GpuObserver, ProcessMemory};
use system_tests::daemon::double_gpus;
use system_tests::pod::Pod;
use system_tests::probes::{CONTEXT_BYTES, GIB, MIB, info, probe, result_of, run};
use system_tests::{daemon, probes};

const QUOTA: u64 = 4 * GIB;
/// The double's default malloc heap, held by every context already.
const DEFAULT_HEAP: u64 = 8 * MIB;

fn quota4g(pod: &Pod, script: &[&str]) -> Vec<String> {
    quota4g_with(pod, &[], script)
}

fn quota4g_with(pod: &Pod, env: &[(&str, &str)], script: &[&str]) -> Vec<String> {
    let mut env = env.to_vec();
    env.push(("CUDA_DEVICE_MEMORY_LIMIT", "4g"));
    run(probe("cudaprobe", pod, &env, script))
}

/// The free bytes of an `info` line.
fn free_of(line: &str) -> u64 {
    line.split_whitespace()
        .find_map(|field| field.strip_prefix("free="))
        .and_then(|value| value.parse().ok())
        .unwrap_or_else(|| panic!("no free= in {line:?}"))
}

#[test]
fn the_malloc_heap_is_reserved_when_set_and_refused_past_the_quota() {
    let pod = Pod::new("heap");
    let lines = quota4g(
        &pod,
        &[
            "setlimit", "heap", "5g", "getlimit", "heap", "setlimit", "heap", "2g", "info",
            "alloc", "mem", "2g", "alloc", "mem", "1g",
        ],
    );
    assert_eq!(result_of(&lines[0]), 2, "{lines:?}");
    // Refused: the heap is as it was.
    assert_eq!(
        lines[1],
        format!("getlimit heap -> 0 {DEFAULT_HEAP}"),
        "{lines:?}"
    );
    assert_eq!(result_of(&lines[2]), 0, "{lines:?}");
    let heap = 2 * GIB - DEFAULT_HEAP;
    assert_eq!(lines[3], info(0, QUOTA - CONTEXT_BYTES - heap, QUOTA));
    assert_eq!(result_of(&lines[4]), 2, "the heap is charged: {lines:?}");
    assert_eq!(result_of(&lines[5]), 0, "{lines:?}");
}

#[test]
fn thread_stacks_are_reserved_for_every_resident_thread() {
    let pod = Pod::new("stack");
    // Each byte of stack is held for each of the double's 132 x 2048
    // resident threads, as on an H100.
    let threads = 132 * 2048;
    let lines = quota4g(
        &pod,
        &[
            "info", "setlimit", "stack", "16k", "getlimit", "stack", "info", "setlimit", "stack",
            "2k", "info", "alloc", "mem", "1g", "setlimit", "stack", "1k", "info",
        ],
    );
    let before = free_of(&lines[0]);
    // 15 KiB a thread: 3.9 GiB, past what the context leaves.
    assert_eq!(result_of(&lines[1]), 2, "{lines:?}");
    assert_eq!(lines[2], "getlimit stack -> 0 1024", "as it was: {lines:?}");
    assert_eq!(
        free_of(&lines[3]),
        before,
        "nothing stays charged: {lines:?}"
    );
    assert_eq!(result_of(&lines[4]), 0, "{lines:?}");
    assert_eq!(free_of(&lines[5]), before - 1024 * threads, "{lines:?}");
    assert_eq!(result_of(&lines[6]), 0, "{lines:?}");
    assert_eq!(result_of(&lines[7]), 0, "{lines:?}");
    assert_eq!(free_of(&lines[8]), before - GIB, "given back: {lines:?}");
}

#[test]
fn module_and_library_globals_are_charged_and_one_past_the_quota_is_unloaded() {
    for kind in ["module", "module_ex", "library", "library_file"] {
        let pod = Pod::new("globals");
        // The double's text images are loaded at once, as libraries are
        // under eager loading (lazy ones are the fat binaries below).
        let eager: &[(&str, &str)] = if kind == "library" {
            &[("CUDA_MODULE_LOADING", "EAGER")]
        } else {
            &[]
        };
        let lines = quota4g_with(
            &pod,
            eager,
            &[
                "info", kind, "1g", "info", kind, "3g", "info", "alloc", "mem", "1g", "unload",
                "0", "info",
            ],
        );
        let before = free_of(&lines[0]);
        assert_eq!(result_of(&lines[1]), 0, "{kind}: {lines:?}");
        assert_eq!(free_of(&lines[2]), before - GIB, "{kind}: {lines:?}");
        assert_eq!(result_of(&lines[3]), 2, "{kind}: {lines:?}");
        assert_eq!(
            free_of(&lines[4]),
            before - GIB,
            "{kind}: unloaded: {lines:?}"
        );
        assert_eq!(result_of(&lines[5]), 0, "{kind}: still usable: {lines:?}");
        assert_eq!(result_of(&lines[6]), 0, "{kind}: {lines:?}");
        assert_eq!(
            free_of(&lines[7]),
            before - GIB,
            "{kind}: given back: {lines:?}"
        );
    }
}

/// The runtime's libraries (fat binaries, loaded lazily): their globals are
/// taken at the first use in a context; the limiter reads their size from
/// the image and reserves it before, so a first use past the quota takes
/// nothing and is refused, and one that fits is charged once.
#[test]
fn lazily_loaded_library_globals_are_reserved_at_their_first_use() {
    for first_use in ["launchk", "kernelfunc", "libglobal"] {
        let pod = Pod::new("lazy");
        let use_it = |id: &'static str| -> [&'static str; 2] { [first_use, id] };
        let (kernel, library) = ("0", "0");
        let target = if first_use == "libglobal" {
            library
        } else {
            kernel
        };
        let mut script = vec![
            "info",
            "fatlib",
            "3g",
            "info",
            "alloc",
            "mem",
            "1g",
            "libkernel",
            "0",
            "k0",
        ];
        script.extend(use_it(target));
        script.extend(["info", "free", "0"]);
        script.extend(use_it(target));
        script.extend([
            "info",
            "libkernel",
            "0",
            "k1",
            "launchk",
            "1",
            "info",
            "alloc",
            "mem",
            "1g",
        ]);
        script.extend(["unload", "0", "info"]);
        let lines = quota4g(&pod, &script);
        let before = free_of(&lines[0]);
        assert_eq!(result_of(&lines[1]), 0, "{first_use}: {lines:?}");
        assert_eq!(
            free_of(&lines[2]),
            before,
            "{first_use}: the load takes nothing: {lines:?}"
        );
        assert_eq!(result_of(&lines[3]), 0, "{first_use}: {lines:?}");
        // 1 GiB allocated, 3 GiB of globals and the context: past 4 GiB.
        assert_eq!(result_of(&lines[5]), 2, "{first_use}: refused: {lines:?}");
        assert_eq!(
            free_of(&lines[6]),
            before - GIB,
            "{first_use}: nothing taken: {lines:?}"
        );
        assert_eq!(result_of(&lines[7]), 0, "{first_use}: {lines:?}");
        assert_eq!(result_of(&lines[8]), 0, "{first_use}: fits now: {lines:?}");
        assert_eq!(
            free_of(&lines[9]),
            before - 3 * GIB,
            "{first_use}: {lines:?}"
        );
        // Another kernel of the library: nothing more.
        assert_eq!(result_of(&lines[11]), 0, "{first_use}: {lines:?}");
        assert_eq!(
            free_of(&lines[12]),
            before - 3 * GIB,
            "{first_use}: once: {lines:?}"
        );
        assert_eq!(result_of(&lines[13]), 2, "{first_use}: charged: {lines:?}");
        assert_eq!(result_of(&lines[14]), 0, "{first_use}: {lines:?}");
        assert_eq!(
            free_of(&lines[15]),
            before,
            "{first_use}: given back: {lines:?}"
        );
    }
}

/// Small globals are not reserved ahead (no NVML call at every small
/// library's first launch): the next measurement (at most 200 ms apart)
/// charges them.
#[test]
fn small_library_globals_are_charged_by_the_next_measurement() {
    let pod = Pod::new("lazy-small");
    let lines = quota4g(
        &pod,
        &[
            "info",
            "fatlib",
            "512k",
            "libkernel",
            "0",
            "k",
            "launchk",
            "0",
            "sleep",
            "250",
            "alloc",
            "mem",
            "1m",
            "info",
        ],
    );
    let before = free_of(&lines[0]);
    assert_eq!(result_of(&lines[3]), 0, "{lines:?}");
    assert_eq!(free_of(&lines[6]), before - 512 * 1024 - MIB, "{lines:?}");
}

#[test]
fn graph_allocation_nodes_are_charged_at_instantiation_until_trimmed() {
    let pod = Pod::new("graph");
    let lines = quota4g(
        &pod,
        &[
            "info",
            "graph_alloc",
            "3g",
            "info",
            "graph_alloc",
            "1g",
            "capture_alloc",
            "1g",
            "graph_launch",
            "0",
            "info",
            "graph_destroy",
            "0",
            "info",
            "graph_trim",
            "info",
            "capture_alloc",
            "2g",
            "graph_launch",
            "1",
            "info",
        ],
    );
    let before = free_of(&lines[0]);
    assert_eq!(result_of(&lines[1]), 0, "{lines:?}");
    assert_eq!(
        free_of(&lines[2]),
        before - 3 * GIB,
        "charged when instantiated: {lines:?}"
    );
    assert_eq!(result_of(&lines[3]), 2, "{lines:?}");
    assert_eq!(
        result_of(&lines[4]),
        2,
        "a captured allocation too: {lines:?}"
    );
    assert_eq!(result_of(&lines[5]), 0, "{lines:?}");
    assert_eq!(
        free_of(&lines[6]),
        before - 3 * GIB,
        "launched: once: {lines:?}"
    );
    assert_eq!(result_of(&lines[7]), 0, "{lines:?}");
    assert_eq!(
        free_of(&lines[8]),
        before - 3 * GIB,
        "the graph pool keeps it: {lines:?}"
    );
    assert_eq!(result_of(&lines[9]), 0, "{lines:?}");
    assert_eq!(free_of(&lines[10]), before, "trimmed: {lines:?}");
    assert_eq!(result_of(&lines[11]), 0, "{lines:?}");
    assert_eq!(result_of(&lines[12]), 0, "{lines:?}");
    assert_eq!(free_of(&lines[13]), before - 2 * GIB, "{lines:?}");
}

/// Where NVML cannot tell what a process holds (a container's pid it does
/// not know, a figure it does not have): what pools keep is charged from
/// what the driver says they reserve all the same.
const NVML_BLIND: (&str, &str) = ("GPUSHARE_DOUBLE_NVML_UNAVAILABLE", "1");
/// What the context is charged where NVML cannot measure it: its estimate.
const CONTEXT_ESTIMATE: u64 = 512 * MIB;

#[test]
fn what_a_pool_keeps_is_charged_until_trimmed() {
    for env in [&[][..], &[NVML_BLIND]] {
        what_the_default_pool_keeps_is_charged(env);
    }
}

fn what_the_default_pool_keeps_is_charged(env: &[(&str, &str)]) {
    let pod = Pod::new("pool");
    let lines = quota4g_with(
        &pod,
        env,
        &[
            "pool_threshold",
            "max",
            "alloc",
            "async",
            "3g",
            "free",
            "0",
            "pool_reserved",
            "alloc",
            "mem",
            "1g",
            "pool_trim",
            "0",
            "alloc",
            "mem",
            "1g",
        ],
    );
    assert_eq!(result_of(&lines[0]), 0, "{lines:?}");
    assert_eq!(result_of(&lines[1]), 0, "{lines:?}");
    assert_eq!(result_of(&lines[2]), 0, "{lines:?}");
    assert!(
        lines[3].contains(&format!("reserved={}", 3 * GIB)),
        "the pool keeps it: {lines:?}"
    );
    assert_eq!(
        result_of(&lines[4]),
        2,
        "kept memory is charged: {env:?} {lines:?}"
    );
    assert_eq!(result_of(&lines[5]), 0, "{lines:?}");
    assert_eq!(result_of(&lines[6]), 0, "trimmed, it fits: {lines:?}");
}

#[test]
fn a_pool_of_its_own_is_charged_what_it_reserves_whatever_its_threshold() {
    // A pool made by the program, keeping whatever is freed into it, 1 GiB
    // at a time: what it reserves is charged at every step, and an
    // allocation from it that passes the quota first takes back what it
    // keeps unused. NVML is blind here: nothing but the driver's own figure
    // of the pool can tell.
    let pod = Pod::new("own-pool");
    let lines = quota4g_with(
        &pod,
        &[NVML_BLIND],
        &[
            "pool_create",
            "max",
            "alloc",
            "pool",
            "1g",
            "alloc",
            "pool",
            "1g",
            "alloc",
            "pool",
            "1g",
            "free",
            "1",
            "pool_reserved",
            "alloc",
            "mem",
            "1g",
            "info",
            "alloc",
            "pool",
            "1g",
            "alloc",
            "pool",
            "1g",
            "info",
            "pool_destroy",
            "info",
            "free",
            "0",
            "free",
            "2",
            "free",
            "3",
            "info",
        ],
    );
    let ok = |i: usize| assert_eq!(result_of(&lines[i]), 0, "line {i}: {lines:?}");
    (0..5).for_each(ok);
    assert_eq!(
        lines[5],
        format!("pool_reserved 0 reserved={} used={}", 3 * GIB, 2 * GIB),
        "the pool keeps what was freed: {lines:?}"
    );
    assert_eq!(
        result_of(&lines[6]),
        2,
        "what it keeps is charged: {lines:?}"
    );
    let kept = QUOTA - CONTEXT_ESTIMATE - 3 * GIB;
    assert_eq!(lines[7], info(0, kept, QUOTA), "{lines:?}");
    assert_eq!(
        result_of(&lines[8]),
        0,
        "the pool gives back what it keeps, and grows again: {lines:?}"
    );
    assert_eq!(result_of(&lines[9]), 2, "past the quota: {lines:?}");
    assert_eq!(lines[10], info(0, kept, QUOTA), "{lines:?}");
    ok(11);
    assert_eq!(
        lines[12],
        info(0, kept, QUOTA),
        "its live allocations stay charged: {lines:?}"
    );
    (13..16).for_each(ok);
    assert_eq!(
        lines[16],
        info(0, QUOTA - CONTEXT_ESTIMATE, QUOTA),
        "all back: {lines:?}"
    );
}

/// Thirteen contexts made by `command` under the 4 GiB quota: the primary
/// context and 12 more hold 13 x 300 MiB, the 13th is refused, and
/// destroying one makes room again.
fn contexts_are_charged_each(pod: &str, command: &str, env: &[(&str, &str)]) {
    let pod = Pod::new(pod);
    let mut script = vec!["info"];
    script.extend(std::iter::repeat_n(command, 13));
    script.extend(["info", "context_destroy", "0", "info", command]);
    let lines = quota4g_with(&pod, env, &script);
    let before = free_of(&lines[0]);
    let made = lines[1..14].iter().filter(|l| result_of(l) == 0).count() as u64;
    assert_eq!(made, 12, "{lines:?}");
    assert_eq!(result_of(&lines[13]), 2, "{lines:?}");
    assert_eq!(
        free_of(&lines[14]),
        before - 12 * CONTEXT_BYTES,
        "{lines:?}"
    );
    assert_eq!(result_of(&lines[15]), 0, "{lines:?}");
    assert_eq!(
        free_of(&lines[16]),
        before - 11 * CONTEXT_BYTES,
        "{lines:?}"
    );
    assert_eq!(result_of(&lines[17]), 0, "room again: {lines:?}");
}

#[test]
fn extra_contexts_are_charged_each_and_given_back_when_destroyed() {
    contexts_are_charged_each("contexts", "context", &[]);
}

/// Green contexts are measured, not reserved at a context's size: ones as
/// large as a context are refused past the quota like contexts, and small
/// ones (as on an H100) are not refused where a context would not fit.
#[test]
fn green_contexts_are_charged_at_what_they_take() {
    let context = CONTEXT_BYTES.to_string();
    let large = [("GPUSHARE_DOUBLE_GREEN_CONTEXT_BYTES", context.as_str())];
    contexts_are_charged_each("green", "green_context", &large);
    let pod = Pod::new("green-small");
    let mut script = vec!["info", "alloc", "mem", "3500m", "context", "info"];
    script.extend(std::iter::repeat_n("green_context", 16));
    script.push("info");
    let lines = quota4g(&pod, &script);
    let before = free_of(&lines[0]);
    assert_eq!(result_of(&lines[1]), 0, "{lines:?}");
    assert_eq!(result_of(&lines[2]), 2, "no room for a context: {lines:?}");
    assert_eq!(free_of(&lines[3]), before - 3500 * MIB, "{lines:?}");
    let made = lines[4..20].iter().filter(|l| result_of(l) == 0).count();
    assert_eq!(made, 16, "5 MiB each fit: {lines:?}");
    assert_eq!(
        free_of(&lines[20]),
        before - 3500 * MIB - 16 * 5 * MIB,
        "{lines:?}"
    );
}

#[test]
fn memory_the_audit_finds_beyond_the_ledger_is_charged_to_the_pod() {
    let pod = Pod::new("audit");
    let seen = Arc::new(double_gpus(1));
    let text = format!(
        "listen = \"127.0.0.1:0\"\nadmin_token = \"admin\"\n\n[[pods]]\nid = \"{}\"\ntoken = \"t\"\n\n[[pods.gpus]]\nindex = 0\nmemory = \"4g\"\n",
        pod.0
    );
    let hypervisor = daemon::hypervisor(&pod, &text, Arc::clone(&seen) as Arc<dyn GpuObserver>);
    let mut command = probe(
        "cudaprobe",
        &pod,
        &[
            ("CUDA_LIMITER_HYPERVISOR", &hypervisor.url()),
            ("CUDA_LIMITER_TOKEN", "t"),
        ],
        &[
            "info", "pid", "wait", "info", "alloc", "mem", "2500m", "alloc", "mem", "1g",
        ],
    );
    probes::use_node_tables(&mut command, &pod);
    let mut child = command
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("probe");
    let mut out = BufReader::new(child.stdout.take().expect("stdout"));
    let mut line = String::new();
    let mut lines = Vec::new();
    while !line.starts_with("ready") {
        line.clear();
        assert!(out.read_line(&mut line).expect("read") > 0, "{lines:?}");
        lines.push(line.trim().to_owned());
    }
    let pid: u32 = lines[1]
        .strip_prefix("pid ")
        .and_then(|pid| pid.parse().ok())
        .expect("pid line");
    // NVML says the process holds 1.5 GiB more than its ledger counts (its
    // context): memory no hook saw.
    let hidden = 3 * GIB / 2;
    seen.set_process_memory(
        0,
        vec![ProcessMemory {
            pid,
            bytes: CONTEXT_BYTES + hidden,
        }],
    );
    let status = || hypervisor.hypervisor().status().pods[0].gpus[0].clone();
    let deadline = Instant::now() + Duration::from_secs(10);
    while status().memory_unaccounted != hidden && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(50));
    }
    assert_eq!(status().memory_unaccounted, hidden, "{:?}", status());
    child
        .stdin
        .take()
        .expect("stdin")
        .write_all(b"go\n")
        .expect("resume");
    let rest: Vec<String> = out.lines().map(|l| l.expect("line")).collect();
    assert!(child.wait().expect("exit").success(), "{rest:?}");
    assert_eq!(lines[0], info(0, QUOTA - CONTEXT_BYTES, QUOTA));
    // After "resumed": charged in the report and in refusals.
    assert_eq!(
        rest[1],
        info(0, QUOTA - CONTEXT_BYTES - hidden, QUOTA),
        "{rest:?}"
    );
    assert_eq!(result_of(&rest[2]), 2, "{rest:?}");
    assert_eq!(result_of(&rest[3]), 0, "{rest:?}");
    let metrics = hypervisor_status::metrics::render(&hypervisor.hypervisor().status());
    assert!(
        metrics.contains("gpushare_pod_memory_unaccounted_bytes{")
            && metrics.contains(&format!(" {hidden}")),
        "{metrics}"
    );
}
