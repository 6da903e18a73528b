//! The swap policy's decisions under a real daemon and the driver double,
//! on GPUs of 16 GiB that the probes share (the double's node file) and
//! that overcommit: a pod used often stays over one used once; the GPU's
//! headroom is kept free ahead of need, so a call on a swapped pod waits
//! for its own swap-in only; a burst of swapped pods' calls is served in
//! the order they asked, with no pod swapped back out for the next and
//! nothing killed; an allocation that only a busy pod could make room for
//! waits for it to go idle, and a library's first use is given room as an
//! allocation is; a pod refused for want of room keeps its place
//! over a later one while room can be made for it, but lets later pods
//! pass while it cannot come back; a pod that must never be swapped never
//! is.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use hypervisor_swap::{Direction, ServingReport, SwapCause, SwapEvent, WaitCause};
use system_tests::daemon::node_file_gpus;
use system_tests::pod::Pod;
use system_tests::probes::GIB;
use system_tests::swapping::{
    ADMIN, Running, TOKEN, admin_cli, checkpoint_dir, control_block, post,
};
use system_tests::wait::eventually;
use system_tests::{RunningNode, daemon};

/// One pod of the config: its id, the GPUs (NVML indexes) it is placed
/// on, its quota on each and its class.
struct Placed<'a> {
    pod: &'a Pod,
    gpus: &'a [u32],
    quota: &'a str,
    class: &'a str,
}

impl<'a> Placed<'a> {
    fn batch(pod: &'a Pod, quota: &'a str) -> Self {
        Self {
            pod,
            gpus: &[0],
            quota,
            class: "batch",
        }
    }
}

/// A daemon of `pods` on `devices` GPUs of 16 GiB shared through
/// `node_file`, pods idle after 200 ms unless `swap` says, `swap` added to
/// its `[swap]` table.
fn serving(node_file: &Path, devices: u8, pods: &[Placed], swap: &str) -> RunningNode {
    let library = gpushare_examples::double_dir().join("libcuda.so.1");
    let idle_after = if swap.contains("idle_after_ms") {
        ""
    } else {
        "idle_after_ms = 200\n"
    };
    let mut text = format!(
        "listen = \"127.0.0.1:0\"\nadmin_token = \"{ADMIN}\"\n\n[swap]\ncuda_library = \"{}\"\n\
         {idle_after}host_limit = \"64g\"\n{swap}\n",
        library.display()
    );
    for placed in pods {
        text.push_str(&format!(
            "\n[[pods]]\nid = \"{}\"\ntoken = \"{TOKEN}\"\n",
            placed.pod.0
        ));
        for index in placed.gpus {
            text.push_str(&format!(
                "[[pods.gpus]]\nindex = {index}\nmemory = \"{}\"\nclass = \"{}\"\n",
                placed.quota, placed.class
            ));
        }
    }
    let gpus = node_file_gpus(node_file.to_owned(), 16 * GIB, devices);
    daemon::hypervisor(pods[0].pod, &text, Arc::new(gpus))
}

/// A probe of `pod` on the GPU 0 of `devices` shared through `node_file`,
/// `extra` added to its environment, run up to its first `wait`; its first
/// call must succeed.
fn started(
    node: &RunningNode,
    node_file: &Path,
    devices: u8,
    pod: &Pod,
    extra: &[(&str, &str)],
    script: &[&str],
) -> Running {
    let mut running = probe(node, node_file, devices, pod, extra, script);
    let lines = running.until_ready();
    assert!(lines[0].contains("-> 0 "), "{}: {lines:?}", pod.0);
    running
}

/// A probe of `pod` on the GPU 0 of `devices` shared through `node_file`,
/// `extra` added to its environment, started.
fn probe(
    node: &RunningNode,
    node_file: &Path,
    devices: u8,
    pod: &Pod,
    extra: &[(&str, &str)],
    script: &[&str],
) -> Running {
    let devices = devices.to_string();
    let mut env = vec![
        (
            gpushare_examples::NODE_FILE_VAR,
            node_file.to_str().expect("a path"),
        ),
        ("GPUSHARE_DOUBLE_DEVICES", devices.as_str()),
        ("CUDA_VISIBLE_DEVICES", "0"),
    ];
    env.extend_from_slice(extra);
    Running::start(pod, &node.url(), &env, script)
}

fn report(node: &RunningNode) -> ServingReport {
    node.hypervisor().swap_status().serving
}

fn event(pod: &Pod, direction: Direction, cause: SwapCause) -> SwapEvent {
    SwapEvent {
        pod: pod.0.clone(),
        direction,
        cause,
    }
}

fn ended(mut running: Running) {
    running.resume();
    let (rest, status) = running.finish();
    assert!(status.success(), "{rest:?}");
}

fn killed(mut running: Running) {
    running.child.kill().expect("kill the probe");
    let _ = running.child.wait();
}

#[test]
fn a_pod_used_often_stays_over_one_used_once_more_recently() {
    let popular = Pod::new("policy-popular");
    let once = Pod::new("policy-once");
    let asker = Pod::new("policy-asker");
    let node_file = checkpoint_dir().join(format!("{}.node", asker.0));
    let node = serving(
        &node_file,
        1,
        &[
            Placed::batch(&popular, "7g"),
            Placed::batch(&once, "7g"),
            Placed::batch(&asker, "7g"),
        ],
        "overcommit = true",
    );
    // Two uses of the popular pod a second apart, then one of the other.
    let script = ["alloc", "mem", "6g", "wait", "alloc", "mem", "16m", "wait"];
    let mut used = started(&node, &node_file, 1, &popular, &[], &script);
    std::thread::sleep(Duration::from_secs(1));
    used.resume();
    assert!(used.until_ready()[1].contains("-> 0 "));
    std::thread::sleep(Duration::from_millis(300));
    let called_once = started(
        &node,
        &node_file,
        1,
        &once,
        &[],
        &["alloc", "mem", "6g", "wait"],
    );
    std::thread::sleep(Duration::from_millis(400));

    // 6 GiB does not fit beside the 12 GiB held: one pod must go. The
    // popular pod's last call is the older, yet the other goes.
    let asking = started(
        &node,
        &node_file,
        1,
        &asker,
        &[],
        &["alloc", "mem", "6g", "wait"],
    );
    assert_eq!(
        control_block(called_once.pid()).state,
        2,
        "the pod used once went"
    );
    assert_eq!(control_block(used.pid()).state, 0, "the popular pod stays");
    assert_eq!(
        Vec::from(report(&node).recent),
        [event(&once, Direction::Out, SwapCause::Demand)]
    );
    ended(asking);
    ended(used);
    killed(called_once);
}

#[test]
fn headroom_is_kept_ahead_of_need_and_a_swap_in_waits_for_no_swap_out() {
    let first = Pod::new("policy-ahead-a");
    let second = Pod::new("policy-ahead-b");
    let node_file = checkpoint_dir().join(format!("{}.node", second.0));
    let node = serving(
        &node_file,
        1,
        &[Placed::batch(&first, "6g"), Placed::batch(&second, "6g")],
        "overcommit = true\nheadroom = \"6g\"",
    );
    let mut a = started(
        &node,
        &node_file,
        1,
        &first,
        &[],
        &["alloc", "mem", "5g", "wait", "alloc", "mem", "16m", "wait"],
    );
    let b = started(
        &node,
        &node_file,
        1,
        &second,
        &[],
        &["alloc", "mem", "5g", "wait"],
    );

    // Less than 6 GiB is free: the idle pod least used goes before anyone
    // asks for room.
    eventually("the first pod is swapped out ahead of need", || {
        control_block(a.pid()).state == 2
    });
    let seen = report(&node);
    assert_eq!(
        Vec::from(seen.recent),
        [event(&first, Direction::Out, SwapCause::Ahead)]
    );
    assert_eq!(control_block(b.pid()).state, 0, "one was enough");

    // Its next call brings it back at once: the GPU has its room free.
    a.resume();
    assert!(a.until_ready()[1].contains("-> 0 "));
    let seen = report(&node);
    assert_eq!(seen.waits_of(WaitCause::SwapIn), 1);
    assert_eq!(
        seen.waits_of(WaitCause::SwapOut),
        0,
        "no swap-out waited for"
    );
    // Then the headroom is made again, by the pod that is idle now (its
    // process is checkpointed a moment before the daemon counts the swap).
    eventually("the second pod is swapped out ahead of need", || {
        control_block(b.pid()).state == 2
            && report(&node).swaps_of(Direction::Out, SwapCause::Ahead) == 2
    });
    assert_eq!(control_block(a.pid()).state, 0, "the pod just back stays");
    let seen = report(&node);
    assert_eq!(seen.swaps_of(Direction::Out, SwapCause::Ahead), 2);
    assert_eq!(seen.swaps_of(Direction::Out, SwapCause::Demand), 0);
    ended(a);
    killed(b);
}

#[test]
fn a_burst_of_swapped_pods_is_served_in_the_order_they_asked_without_thrash() {
    let pods = ["a", "b", "c", "d"].map(|name| Pod::new(&format!("policy-burst-{name}")));
    let [a, b, c, d] = &pods;
    let node_file = checkpoint_dir().join(format!("{}.node", d.0));
    let placed: Vec<Placed> = pods.iter().map(|pod| Placed::batch(pod, "7g")).collect();
    let node = serving(&node_file, 1, &placed, "overcommit = true");
    // Two pods of 6 GiB fit the GPU, not three. The first two go to host
    // memory; the two that take their place are slow to checkpoint, so
    // that the second pod's call comes while the first's swap-in runs.
    let callers = ["alloc", "mem", "6g", "wait", "info", "wait"];
    let mut first = started(&node, &node_file, 1, a, &[], &callers);
    let mut second = started(&node, &node_file, 1, b, &[], &callers);
    for pod in [a, b] {
        let (ok, answer) = admin_cli(&node, &["swap", "out", &pod.0]);
        assert!(ok, "{answer}");
    }
    let slow = [("GPUSHARE_DOUBLE_CHECKPOINT_US_PER_GIB", "150000")];
    let once = started(
        &node,
        &node_file,
        1,
        c,
        &slow,
        &["alloc", "mem", "6g", "wait"],
    );
    // The fourth pod is used twice: after the third, and after the first
    // pod's first use, so by the uses alone the first would go before it.
    let twice = ["alloc", "mem", "6g", "wait", "alloc", "mem", "16m", "wait"];
    let mut often = started(&node, &node_file, 1, d, &slow, &twice);
    std::thread::sleep(Duration::from_secs(1));
    often.resume();
    assert!(often.until_ready()[1].contains("-> 0 "));
    std::thread::sleep(Duration::from_millis(400));

    first.resume();
    std::thread::sleep(Duration::from_millis(300));
    second.resume();
    for running in [&mut first, &mut second] {
        let lines = running.until_ready();
        assert!(lines.iter().any(|l| l.starts_with("info 0 ")), "{lines:?}");
    }

    // The first back made room with the pod used once, the second with the
    // other; the pod just back stayed, though idle and used least of late.
    let seen = report(&node);
    assert_eq!(
        Vec::from(seen.recent.clone()),
        [
            event(a, Direction::Out, SwapCause::Operator),
            event(b, Direction::Out, SwapCause::Operator),
            event(c, Direction::Out, SwapCause::Demand),
            event(a, Direction::In, SwapCause::Demand),
            event(d, Direction::Out, SwapCause::Demand),
            event(b, Direction::In, SwapCause::Demand),
        ]
    );
    assert_eq!(seen.waits_of(WaitCause::Queue), 2, "{seen:?}");
    assert_eq!(seen.waits_of(WaitCause::SwapOut), 2, "{seen:?}");
    assert!(seen.waiting.is_empty(), "{seen:?}");
    for running in [&once, &often] {
        assert_eq!(
            control_block(running.pid()).state,
            2,
            "in host memory, alive"
        );
    }
    assert_eq!(node.hypervisor().swap_status().totals.failures, 0);
    ended(first);
    ended(second);
    killed(once);
    killed(often);
}

#[test]
fn a_pod_refused_for_want_of_room_keeps_its_place_over_a_later_one() {
    // Latency pods never go to make room: the two that stay leave less
    // than either swapped pod needs; when one of them ends, the room is
    // enough for one swapped pod, not two.
    let stays = Pod::new("policy-place-stays");
    let ends = Pod::new("policy-place-ends");
    let first = Pod::new("policy-place-first");
    let later = Pod::new("policy-place-later");
    let node_file = checkpoint_dir().join(format!("{}.node", later.0));
    let latency = |pod, quota| Placed {
        class: "latency",
        ..Placed::batch(pod, quota)
    };
    let node = serving(
        &node_file,
        1,
        &[
            latency(&stays, "8g"),
            latency(&ends, "5g"),
            latency(&first, "6g"),
            Placed::batch(&later, "6g"),
        ],
        "overcommit = true\nlatency_pods = \"never\"",
    );
    let callers = ["alloc", "mem", "5g", "wait", "alloc", "mem", "16m", "wait"];
    let swapped_out = |pod: &Pod| {
        let running = started(&node, &node_file, 1, pod, &[], &callers);
        let (ok, answer) = admin_cli(&node, &["swap", "out", &pod.0]);
        assert!(ok, "{answer}");
        running
    };
    let mut came_first = swapped_out(&first);
    let mut later_asks = swapped_out(&later);
    let staying = started(
        &node,
        &node_file,
        1,
        &stays,
        &[],
        &["alloc", "mem", "7g", "wait"],
    );
    let ending = started(
        &node,
        &node_file,
        1,
        &ends,
        &[],
        &["alloc", "mem", "4g", "wait"],
    );

    came_first.resume();
    eventually("the first pod waits for room", || {
        report(&node).waiting == [first.0.clone()]
    });
    later_asks.resume();
    std::thread::sleep(Duration::from_millis(300));

    // Room for one: the later pod asks at once, before the first asks
    // again, and waits behind it.
    ended(ending);
    let worker = node.hypervisor().workers_of(&later.0)[0].to_string();
    let (status, answer) = post(
        &node,
        "/swap-in",
        TOKEN,
        &format!("{{\"worker_id\":\"{worker}\"}}"),
    );
    assert_eq!(status, 409, "{answer}");
    let lines = came_first.until_ready();
    assert!(lines[1].contains("-> 0 "), "the first is back: {lines:?}");
    assert_eq!(control_block(later_asks.pid()).state, 2, "the later waits");
    let seen = report(&node);
    assert_eq!(
        seen.recent.back(),
        Some(&event(&first, Direction::In, SwapCause::Demand))
    );
    assert!(
        seen.recent
            .iter()
            .all(|e| e.pod != later.0 || e.direction == Direction::Out),
        "{seen:?}"
    );
    assert_eq!(seen.waits_of(WaitCause::Room), 1, "{seen:?}");
    ended(came_first);
    ended(staying);
    killed(later_asks);
}

#[test]
fn a_pod_that_cannot_come_back_lets_later_pods_pass_until_it_could_and_has_waited() {
    // No batch pod is idle here; a latency pod never goes. The large pod
    // first cannot come back even were the busy one to go: a small pod
    // asking later passes it. Once the latency pod ends, the large one
    // could come back when the busy one goes, and has waited its
    // `room_wait`: a later pod waits behind it, and what frees up is its.
    let large = Pod::new("policy-pass-large");
    let small = Pod::new("policy-pass-small");
    let later = Pod::new("policy-pass-later");
    let latency = Pod::new("policy-pass-latency");
    let busy = Pod::new("policy-pass-busy");
    let node_file = checkpoint_dir().join(format!("{}.node", large.0));
    let node = serving(
        &node_file,
        1,
        &[
            Placed::batch(&large, "12g"),
            Placed::batch(&small, "2g"),
            Placed::batch(&later, "2g"),
            Placed {
                class: "latency",
                ..Placed::batch(&latency, "7g")
            },
            Placed::batch(&busy, "7g"),
        ],
        "overcommit = true\nlatency_pods = \"never\"\nidle_after_ms = 600000\nroom_wait_ms = 200",
    );
    let swapped_out = |pod: &Pod, size| {
        let running = started(
            &node,
            &node_file,
            1,
            pod,
            &[],
            &["alloc", "mem", size, "wait", "alloc", "mem", "16m", "wait"],
        );
        let (ok, answer) = admin_cli(&node, &["swap", "out", &pod.0]);
        assert!(ok, "{answer}");
        running
    };
    let mut large_asks = swapped_out(&large, "11g");
    let mut small_asks = swapped_out(&small, "1g");
    let later_waits = swapped_out(&later, "1g");
    let holding = ["alloc", "mem", "6g", "wait"];
    let staying = started(&node, &node_file, 1, &latency, &[], &holding);
    let using = started(&node, &node_file, 1, &busy, &[], &holding);

    // 4 GiB free: the large pod's 11 cannot be had, even with the busy
    // pod's 6. The small pod passes it.
    large_asks.resume();
    eventually("the large pod waits for room", || {
        report(&node).waiting == [large.0.clone()]
    });
    small_asks.resume();
    eventually("the small pod is back", || {
        control_block(small_asks.pid()).state == 0
    });
    let lines = small_asks.until_ready();
    assert!(lines[1].contains("-> 0 "), "{lines:?}");
    assert_eq!(control_block(large_asks.pid()).state, 2, "still waits");

    // 9 GiB free once the latency pod ends, 15 were the busy pod to go.
    ended(staying);
    std::thread::sleep(Duration::from_millis(300));
    let worker = node.hypervisor().workers_of(&later.0)[0].to_string();
    let (status, answer) = post(
        &node,
        "/swap-in",
        TOKEN,
        &format!("{{\"worker_id\":\"{worker}\"}}"),
    );
    assert_eq!(status, 409, "the later pod waits behind: {answer}");
    assert_eq!(control_block(later_waits.pid()).state, 2);
    assert_eq!(report(&node).waiting, std::slice::from_ref(&large.0));

    // The busy pod ends: the large pod is back.
    ended(using);
    eventually("the large pod is back", || {
        control_block(large_asks.pid()).state == 0
    });
    let lines = large_asks.until_ready();
    assert!(lines[1].contains("-> 0 "), "{lines:?}");
    assert_eq!(node.hypervisor().swap_status().totals.failures, 0);
    ended(large_asks);
    ended(small_asks);
    killed(later_waits);
}

#[test]
fn an_allocation_waits_for_a_busy_pod_to_go_idle_and_make_room() {
    // Pods idle 3 s after their last call: the first pod has just
    // allocated as the second asks for more than is free. The second's
    // allocation waits for the first to go idle and out, and is served.
    let busy = Pod::new("policy-wait-busy");
    let asker = Pod::new("policy-wait-asker");
    let node_file = checkpoint_dir().join(format!("{}.node", asker.0));
    let node = serving(
        &node_file,
        1,
        &[Placed::batch(&busy, "10g"), Placed::batch(&asker, "10g")],
        "overcommit = true\nidle_after_ms = 3000",
    );
    let holding = ["alloc", "mem", "9g", "wait"];
    let first = started(&node, &node_file, 1, &busy, &[], &holding);
    let mut second = probe(&node, &node_file, 1, &asker, &[], &holding);
    let lines = second.until_ready();
    assert!(
        lines[0].contains("-> 0 "),
        "served once room was made: {lines:?}"
    );
    assert_eq!(control_block(first.pid()).state, 2, "the first went out");
    let seen = report(&node);
    assert_eq!(
        seen.recent.front(),
        Some(&event(&busy, Direction::Out, SwapCause::Demand)),
        "{seen:?}"
    );
    ended(second);
    killed(first);
}

#[test]
fn a_pod_has_only_so_many_room_asks_in_flight() {
    // A busy pod that never goes idle holds most of the GPU: each room ask
    // of the other waits out room_wait, polling the swap lock. Past the
    // cap, an ask is answered at once; a slot is free again once one ends.
    let busy = Pod::new("policy-asks-busy");
    let asker = Pod::new("policy-asks-asker");
    let node_file = checkpoint_dir().join(format!("{}.node", asker.0));
    let node = serving(
        &node_file,
        1,
        &[Placed::batch(&busy, "10g"), Placed::batch(&asker, "10g")],
        "overcommit = true\nidle_after_ms = 600000\nroom_wait_ms = 3000",
    );
    let holding = started(
        &node,
        &node_file,
        1,
        &busy,
        &[],
        &["alloc", "mem", "9g", "wait"],
    );
    let asking = started(
        &node,
        &node_file,
        1,
        &asker,
        &[],
        &["alloc", "mem", "64m", "wait"],
    );
    let worker = node.hypervisor().workers_of(&asker.0)[0].to_string();
    let body = format!(
        "{{\"worker_id\":\"{worker}\",\"uuid\":\"{}\",\"bytes\":{}}}",
        gpushare_examples::uuid(0),
        9 * GIB
    );
    let ask = || {
        let began = std::time::Instant::now();
        let (status, answer) = post(&node, "/room", TOKEN, &body);
        (status, answer, began.elapsed())
    };
    let cap = hypervisor_daemon::ROOM_ASKS_PER_POD as usize;
    let answers: Vec<(u16, String, Duration)> = std::thread::scope(|scope| {
        let asks: Vec<_> = (0..=cap).map(|_| scope.spawn(ask)).collect();
        asks.into_iter()
            .map(|a| a.join().expect("an ask"))
            .collect()
    });
    let refused: Vec<&(u16, String, Duration)> = answers
        .iter()
        .filter(|(status, ..)| *status == 429)
        .collect();
    assert_eq!(refused.len(), 1, "{answers:?}");
    assert!(
        refused[0].2 < Duration::from_secs(2),
        "at once: {answers:?}"
    );
    for (status, _, took) in answers.iter().filter(|(status, ..)| *status != 429) {
        assert_eq!(*status, 200, "{answers:?}");
        assert!(*took >= Duration::from_millis(2_500), "waited: {answers:?}");
    }
    let (status, answer, _) = ask();
    assert_eq!(status, 200, "a slot is free again: {answer}");
    ended(asking);
    killed(holding);
}

#[test]
fn a_librarys_first_use_the_gpu_has_no_room_for_is_given_room() {
    // A library loaded lazily, whose globals (8 GiB) the GPU has no room
    // for beside an idle pod: its first launch has the idle pod swapped
    // out, and runs.
    let idle = Pod::new("policy-load-idle");
    let loader = Pod::new("policy-load-asker");
    let node_file = checkpoint_dir().join(format!("{}.node", loader.0));
    let node = serving(
        &node_file,
        1,
        &[Placed::batch(&idle, "10g"), Placed::batch(&loader, "10g")],
        "overcommit = true",
    );
    let holding = started(
        &node,
        &node_file,
        1,
        &idle,
        &[],
        &["alloc", "mem", "9g", "wait"],
    );
    std::thread::sleep(Duration::from_millis(400));
    let mut loading = probe(
        &node,
        &node_file,
        1,
        &loader,
        &[],
        &[
            "fatlib",
            "8g",
            "libkernel",
            "0",
            "k0",
            "launchk",
            "0",
            "wait",
        ],
    );
    let lines = loading.until_ready();
    assert!(lines[2].starts_with("launchk 0 -> 0"), "{lines:?}");
    assert_eq!(control_block(holding.pid()).state, 2, "the idle pod went");
    assert_eq!(
        report(&node).recent.front(),
        Some(&event(&idle, Direction::Out, SwapCause::Demand))
    );
    ended(loading);
    killed(holding);
}

#[test]
fn a_pod_that_must_never_be_swapped_is_never_chosen() {
    // A latency pod under `latency_pods = "never"`, and a pod also placed
    // on a GPU that does not overcommit (as a Kubernetes claim asking for
    // `overcommit == false` is), beside a batch pod; the headroom asks for
    // more than the batch pod frees.
    let latency = Pod::new("policy-never-latency");
    let pinned = Pod::new("policy-never-pinned");
    let batch = Pod::new("policy-never-batch");
    let asker = Pod::new("policy-never-asker");
    let node_file = checkpoint_dir().join(format!("{}.node", asker.0));
    let node = serving(
        &node_file,
        2,
        &[
            Placed {
                class: "latency",
                ..Placed::batch(&latency, "5g")
            },
            Placed {
                gpus: &[0, 1],
                ..Placed::batch(&pinned, "5g")
            },
            Placed::batch(&batch, "5g"),
            Placed::batch(&asker, "9g"),
        ],
        "overcommit = [0]\nheadroom = \"12g\"\nlatency_pods = \"never\"",
    );
    let holding = ["alloc", "mem", "4g", "wait"];
    let stays = [&latency, &pinned].map(|pod| started(&node, &node_file, 2, pod, &[], &holding));
    let goes = started(&node, &node_file, 2, &batch, &[], &holding);
    eventually("the batch pod is swapped out ahead of need", || {
        control_block(goes.pid()).state == 2
    });

    // 8 GiB does not fit, and no pod that is left may go for it.
    let mut asking = probe(
        &node,
        &node_file,
        2,
        &asker,
        &[],
        &["alloc", "mem", "8g", "wait"],
    );
    let lines = asking.until_ready();
    assert!(lines[0].contains("-> 2 "), "out of memory: {lines:?}");
    for running in &stays {
        assert_eq!(control_block(running.pid()).state, 0);
    }
    let status = node.hypervisor().swap_status();
    for pod in [&latency, &pinned] {
        assert!(
            !status.pods.contains_key(&pod.0),
            "{} never swapped: {status:?}",
            pod.0
        );
    }
    // (The asker, idle once refused, may go ahead of need in turn.)
    assert_eq!(
        status.serving.recent.front(),
        Some(&event(&batch, Direction::Out, SwapCause::Ahead))
    );
    assert!(
        status
            .serving
            .recent
            .iter()
            .all(|e| e.pod != latency.0 && e.pod != pinned.0),
        "{status:?}"
    );
    ended(asking);
    for running in stays {
        ended(running);
    }
    killed(goes);
}
