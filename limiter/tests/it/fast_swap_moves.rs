//! The limiter's own swap of the memory it backs (`CUDA_LIMITER_FAST_SWAP`),
//! on the hypervisor's `SwapOut` and `SwapIn` over the command channel (a
//! hypervisor of the tests' own): the backed ranges go to pinned host
//! memory and the GPU's memory is given back (the double's per-process
//! figure, as NVML shows it, falls by their bytes), then come back at the
//! same addresses with the same contents and the quota untouched. A
//! swap-in that fails part-way leaves everything in host memory and
//! succeeds when asked again; a swap-out that fails part-way is undone. The
//! memory the driver keeps for the threads' stacks is given back while
//! swapped and taken again after. Host copies asked for ahead
//! (`PrepareHost`) are pinned while the memory stays on the GPU, and the
//! swap-out then pins nothing. A process without the setting refuses.

use crate::common;

use std::io::{BufRead, BufReader, Lines, Write};
use std::process::{Child, ChildStdin, ChildStdout, Stdio};

use common::hypervisor::FakeHypervisor;
use common::{CONTEXT_BYTES, GIB, MIB, Pod, info, number, probe, result_of};
use gpushare_utils::limits::PodLimits;
use gpushare_utils::protocol::{Command, CommandResult, FastSwapReport};
use gpushare_utils::shm::Creation;

const QUOTA: u64 = 4 * GIB;
/// The backed allocations' bytes: 64 MiB, and 3 MiB rounded to 4.
const BACKED: u64 = 68 * MIB;

/// Two backed allocations and a small one the driver makes, written, then
/// what the process holds, twice over a `wait`: before the swap-out, while
/// swapped, and after the swap-in, where the contents are checked.
const SCRIPT: &[&str] = &[
    "alloc",
    "mem",
    "64m",
    "alloc",
    "mem",
    "3m",
    "alloc",
    "mem",
    "1m",
    "write",
    "0",
    "5",
    "write",
    "1",
    "6",
    "nvml_procs",
    "info",
    "wait",
    "nvml_procs",
    "info",
    "wait",
    "nvml_procs",
    "info",
    "check",
    "0",
    "5",
    "check",
    "1",
    "6",
    "alloc",
    "mem",
    "4g",
];

/// A probe of `pod` under `hypervisor`, run up to each `wait`.
pub(crate) struct Stepped {
    child: Child,
    stdin: ChildStdin,
    lines: Lines<BufReader<ChildStdout>>,
}

impl Stepped {
    fn start(pod: &Pod, hypervisor: &FakeHypervisor, fast: bool, env: &[(&str, &str)]) -> Self {
        Self::run(pod, hypervisor, fast, env, SCRIPT)
    }

    pub(crate) fn run(
        pod: &Pod,
        hypervisor: &FakeHypervisor,
        fast: bool,
        env: &[(&str, &str)],
        script: &[&str],
    ) -> Self {
        // SAFETY: geteuid has no preconditions.
        let uid = unsafe { libc::geteuid() }.to_string();
        let mut vars = vec![
            ("CUDA_DEVICE_MEMORY_LIMIT", "4g"),
            ("CUDA_LIMITER_HYPERVISOR", hypervisor.url()),
            ("CUDA_LIMITER_TOKEN", "token"),
            ("CUDA_LIMITER_REGION_OWNER", uid.as_str()),
        ];
        if fast {
            vars.push(("CUDA_LIMITER_FAST_SWAP", "1"));
        }
        vars.extend_from_slice(env);
        let mut child = probe("cudaprobe", pod, &vars, script)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let stdin = child.stdin.take().unwrap();
        let lines = BufReader::new(child.stdout.take().unwrap()).lines();
        Self {
            child,
            stdin,
            lines,
        }
    }

    pub(crate) fn pid(&self) -> u32 {
        self.child.id()
    }

    /// The lines up to the next `ready`, without it; from a `wait` on, the
    /// first is `resumed`.
    pub(crate) fn until_ready(&mut self) -> Vec<String> {
        let mut seen = Vec::new();
        for line in self.lines.by_ref() {
            let line = line.unwrap();
            if line == "ready" {
                return seen;
            }
            if line != "resumed" {
                seen.push(line);
            }
        }
        panic!("the probe ended early: {seen:?}");
    }

    pub(crate) fn resume(&mut self) {
        writeln!(self.stdin).unwrap();
    }

    /// The rest of the lines, the probe having exited well.
    pub(crate) fn finish(mut self) -> Vec<String> {
        self.resume();
        drop(self.stdin);
        let rest: Vec<String> = self
            .lines
            .map(Result::unwrap)
            .filter(|l| l != "resumed")
            .collect();
        assert!(self.child.wait().unwrap().success(), "{rest:?}");
        rest
    }
}

/// The pod's limits as a hypervisor publishes them: the quota on GPU 0.
pub(crate) fn publish(pod: &Pod) -> PodLimits {
    let limits = PodLimits::create_or_adopt(&pod.0, &Creation::default()).unwrap();
    limits.set(&gpushare_examples::uuid(0), QUOTA).unwrap();
    limits.publish();
    limits
}

/// What the process holds on the GPU, by NVML (`nvml_procs … used=U`).
fn held(lines: &[String]) -> u64 {
    let line = lines.iter().find(|l| l.starts_with("nvml_procs")).unwrap();
    u64::try_from(number(line, "used")).unwrap()
}

/// The `info` line.
fn info_line(lines: &[String]) -> &str {
    lines.iter().find(|l| l.starts_with("info")).unwrap()
}

pub(crate) fn report(answer: &CommandResult) -> &FastSwapReport {
    assert!(answer.ok, "{answer:?}");
    answer.swap.as_ref().unwrap()
}

/// `at=0x…` of the probe's `write` lines: where the program's memory is.
fn addresses(lines: &[String], command: &str) -> Vec<String> {
    lines
        .iter()
        .filter(|l| l.starts_with(command))
        .map(|l| l.split("at=").nth(1).unwrap().to_owned())
        .collect()
}

/// Runs the script to its first `wait`, checking what it did: the
/// process's lines so far and what it holds on the GPU.
fn ready(running: &mut Stepped) -> (Vec<String>, u64) {
    let before = running.until_ready();
    for line in &before[..5] {
        assert_eq!(result_of(line), 0, "{before:?}");
    }
    let free = QUOTA - CONTEXT_BYTES - BACKED - MIB;
    assert_eq!(info_line(&before), info(0, free, QUOTA), "{before:?}");
    let held = held(&before);
    assert_eq!(held, CONTEXT_BYTES + BACKED + MIB, "{before:?}");
    (before, held)
}

/// After the swap-in: the contents, the addresses, the quota, as before.
fn assert_back(before: &[String], rest: &[String], held_before: u64) {
    assert_eq!(held(rest), held_before, "all of it back: {rest:?}");
    assert_eq!(info_line(rest), info_line(before), "{rest:?}");
    let checks: Vec<&String> = rest.iter().filter(|l| l.starts_with("check")).collect();
    for line in &checks {
        assert_eq!(result_of(line), 0, "{rest:?}");
        assert_eq!(number(line, "differ"), 0, "contents kept: {rest:?}");
    }
    assert_eq!(
        addresses(rest, "check"),
        addresses(before, "write"),
        "same addresses"
    );
    assert_eq!(result_of(rest.last().unwrap()), 2, "quota intact: {rest:?}");
}

#[test]
fn swap_out_gives_the_gpu_memory_back_and_swap_in_brings_the_same_bytes_to_the_same_addresses() {
    let pod = Pod::new("fast-moves");
    let _limits = publish(&pod);
    let mut hypervisor = FakeHypervisor::start();
    let mut running = Stepped::start(&pod, &hypervisor, true, &[]);
    let (before, held_before) = ready(&mut running);
    assert!(hypervisor.registration(running.pid()).fast_swap);

    let out = hypervisor.ask(running.pid(), Command::SwapOut);
    let moved = report(&out);
    assert_eq!((moved.bytes, moved.allocations), (BACKED, 2), "{out:?}");
    assert_eq!(moved.pinned_bytes, BACKED, "{out:?}");
    assert_eq!(
        moved.pinned_new_bytes, BACKED,
        "pinned as it copied: {out:?}"
    );
    assert_eq!(
        moved.unmoved_bytes,
        Some(CONTEXT_BYTES + MIB),
        "the context and the driver's own allocation stay: {out:?}"
    );
    running.resume();
    let swapped = running.until_ready();
    assert_eq!(
        held(&swapped),
        held_before - BACKED,
        "the GPU's memory given back: {swapped:?}"
    );
    assert_eq!(
        info_line(&swapped),
        info_line(&before),
        "the quota still charges it"
    );

    // Away, the host copies are the only ones: none is given back.
    let kept = hypervisor.ask(running.pid(), Command::ReleaseHost);
    assert_eq!(
        (report(&kept).bytes, report(&kept).pinned_bytes),
        (0, BACKED),
        "{kept:?}"
    );

    let back = hypervisor.ask(running.pid(), Command::SwapIn);
    let moved = report(&back);
    assert_eq!((moved.bytes, moved.allocations), (BACKED, 2), "{back:?}");
    assert_eq!(moved.unmoved_bytes, Some(CONTEXT_BYTES + MIB), "{back:?}");
    assert_eq!(
        moved.pinned_bytes, BACKED,
        "kept for the next swap: {back:?}"
    );

    // On the GPU again, the copies go when asked; the next swap-out pins
    // new ones and moves the same bytes.
    let released = hypervisor.ask(running.pid(), Command::ReleaseHost);
    assert_eq!(
        (report(&released).bytes, report(&released).pinned_bytes),
        (BACKED, 0),
        "{released:?}"
    );
    let again = hypervisor.ask(running.pid(), Command::SwapOut);
    assert_eq!(report(&again).pinned_bytes, BACKED, "{again:?}");
    assert_eq!(report(&again).pinned_new_bytes, BACKED, "{again:?}");
    assert_eq!(
        report(&hypervisor.ask(running.pid(), Command::SwapIn)).bytes,
        BACKED
    );
    assert_back(&before, &running.finish(), held_before);
}

#[test]
fn host_copies_prepared_ahead_leave_the_memory_on_the_gpu_and_the_swap_out_nothing_to_pin() {
    let pod = Pod::new("fast-prepare");
    let _limits = publish(&pod);
    let mut hypervisor = FakeHypervisor::start();
    let mut running = Stepped::start(&pod, &hypervisor, true, &[]);
    let (before, held_before) = ready(&mut running);

    let prepared = hypervisor.ask(running.pid(), Command::PrepareHost);
    let made = report(&prepared);
    assert_eq!(
        (
            made.bytes,
            made.allocations,
            made.pinned_bytes,
            made.pinned_new_bytes
        ),
        (BACKED, 2, BACKED, BACKED),
        "a pinned copy for each backed range: {prepared:?}"
    );
    // The program runs on, its memory still on the GPU.
    running.resume();
    let prepared_lines = running.until_ready();
    assert_eq!(held(&prepared_lines), held_before, "{prepared_lines:?}");
    assert_eq!(info_line(&prepared_lines), info_line(&before));

    let again = hypervisor.ask(running.pid(), Command::PrepareHost);
    assert_eq!(
        (report(&again).bytes, report(&again).pinned_new_bytes),
        (0, 0),
        "nothing left to prepare: {again:?}"
    );
    let out = hypervisor.ask(running.pid(), Command::SwapOut);
    let moved = report(&out);
    assert_eq!((moved.bytes, moved.allocations), (BACKED, 2), "{out:?}");
    assert_eq!(
        (moved.pinned_bytes, moved.pinned_new_bytes),
        (BACKED, 0),
        "the swap-out only copied: {out:?}"
    );
    assert_eq!(
        report(&hypervisor.ask(running.pid(), Command::SwapIn)).bytes,
        BACKED
    );
    assert_back(&before, &running.finish(), held_before);
}

#[test]
fn the_stacks_the_driver_keeps_are_given_back_while_swapped_and_set_again_after() {
    // A stack raised above the default, which the double then holds for
    // every thread the GPU runs, beside one backed allocation.
    const STACK: &[&str] = &[
        "setlimit",
        "stack",
        "8192",
        "alloc",
        "mem",
        "64m",
        "write",
        "0",
        "5",
        "nvml_procs",
        "wait",
        "nvml_procs",
        "wait",
        "nvml_procs",
        "getlimit",
        "stack",
        "check",
        "0",
        "5",
    ];
    let pod = Pod::new("fast-stacks");
    let _limits = publish(&pod);
    let mut hypervisor = FakeHypervisor::start();
    let mut running = Stepped::run(&pod, &hypervisor, true, &[], STACK);
    let before = running.until_ready();
    assert!(before[..3].iter().all(|l| result_of(l) == 0), "{before:?}");
    let held_before = held(&before);
    let stacks = held_before - CONTEXT_BYTES - 64 * MIB;
    assert!(stacks > 0, "the raised stack is held: {before:?}");

    let out = hypervisor.ask(running.pid(), Command::SwapOut);
    assert_eq!(report(&out).bytes, 64 * MIB, "{out:?}");
    assert_eq!(
        report(&out).unmoved_bytes,
        Some(CONTEXT_BYTES),
        "nothing of the stacks stays: {out:?}"
    );
    running.resume();
    let swapped = running.until_ready();
    assert_eq!(held(&swapped), CONTEXT_BYTES, "{swapped:?}");

    let back = hypervisor.ask(running.pid(), Command::SwapIn);
    assert_eq!(report(&back).bytes, 64 * MIB, "{back:?}");
    let rest = running.finish();
    assert_eq!(held(&rest), held_before, "all of it back: {rest:?}");
    let limit = rest.iter().find(|l| l.starts_with("getlimit")).unwrap();
    assert_eq!(limit, "getlimit stack -> 0 8192", "set as it was: {rest:?}");
    let check = rest.iter().find(|l| l.starts_with("check")).unwrap();
    assert_eq!(number(check, "differ"), 0, "{rest:?}");
}

#[test]
fn a_swap_in_failing_part_way_keeps_everything_in_host_memory_and_is_retried() {
    let pod = Pod::new("fast-retry");
    let _limits = publish(&pod);
    let mut hypervisor = FakeHypervisor::start();
    // The two allocations map once each; the swap-in's second map fails.
    let env = [("GPUSHARE_DOUBLE_FAIL_VMM", "cuMemMap@4")];
    let mut running = Stepped::start(&pod, &hypervisor, true, &env);
    let (before, held_before) = ready(&mut running);
    assert!(report(&hypervisor.ask(running.pid(), Command::SwapOut)).bytes == BACKED);

    let failed = hypervisor.ask(running.pid(), Command::SwapIn);
    assert!(!failed.ok, "{failed:?}");
    assert!(failed.message.contains("mapping"), "{failed:?}");
    running.resume();
    let swapped = running.until_ready();
    assert_eq!(
        held(&swapped),
        held_before - BACKED,
        "what the failed swap-in mapped is given back: {swapped:?}"
    );

    let back = hypervisor.ask(running.pid(), Command::SwapIn);
    assert_eq!(report(&back).bytes, BACKED, "{back:?}");
    assert_back(&before, &running.finish(), held_before);
}

#[test]
fn a_swap_out_failing_part_way_is_undone() {
    let pod = Pod::new("fast-undo");
    let _limits = publish(&pod);
    let mut hypervisor = FakeHypervisor::start();
    // The swap-out's second unmap fails, after the first range went out.
    let env = [("GPUSHARE_DOUBLE_FAIL_VMM", "cuMemUnmap@2")];
    let mut running = Stepped::start(&pod, &hypervisor, true, &env);
    let (before, held_before) = ready(&mut running);

    let failed = hypervisor.ask(running.pid(), Command::SwapOut);
    assert!(!failed.ok, "{failed:?}");
    assert!(
        failed.message.contains("every range is resident again"),
        "{failed:?}"
    );
    running.resume();
    let undone = running.until_ready();
    assert_eq!(
        held(&undone),
        held_before,
        "all of it on the GPU: {undone:?}"
    );
    // Nothing to bring back: a swap-in after it moves nothing.
    let back = hypervisor.ask(running.pid(), Command::SwapIn);
    assert_eq!(report(&back).bytes, 0, "{back:?}");
    assert_back(&before, &running.finish(), held_before);
}

#[test]
fn a_process_without_the_setting_refuses_and_keeps_its_memory() {
    let pod = Pod::new("fast-off");
    let _limits = publish(&pod);
    let mut hypervisor = FakeHypervisor::start();
    let mut running = Stepped::start(&pod, &hypervisor, false, &[]);
    running.until_ready();
    assert!(!hypervisor.registration(running.pid()).fast_swap);
    let refused = hypervisor.ask(running.pid(), Command::SwapOut);
    assert!(!refused.ok, "{refused:?}");
    assert!(
        refused.message.contains("CUDA_LIMITER_FAST_SWAP"),
        "{refused:?}"
    );
    assert_eq!(refused.swap, None);
    running.finish();
}
