//! A pod writing garbage over the node tables, as the pods' uid may (the
//! hypervisor makes them for `region_uid`, which every pod runs as): other
//! pods' launches go on unheld, and the daemon repairs the tables.
//!
//! The batch pod has no compute limit and no latency pod shares its GPU, so
//! nothing the limits say may hold its launches: a launch call waits only
//! for the double's full launch queue (one kernel) and for a CPU. Before
//! the tables were checked, random bytes over the priority table's first 64
//! bytes (then device 0's latency line) held every launch for the 100 ms
//! starvation bound.

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use gpushare_utils::activity::NodeActivity;
use gpushare_utils::node_table::{NodeTable, TableAccess, pod_key};
use gpushare_utils::priority::NodePriority;
use system_tests::RunningNode;
use system_tests::daemon::{PODS_UID, pods_uid_hypervisor};
use system_tests::pod::{Pod, node_tables};
use system_tests::probes::as_uid;
use system_tests::wait::wait_for;
use system_tests::{daemon, probes};

const TOKEN: &str = "pod-token";
/// The batch pod's kernels.
const KERNEL_US: u64 = 100;
/// How long it launches them back to back, in ms.
const RUN_MS: u64 = 600;
/// How long the daemon may take to see a damaged table: its maintenance
/// runs every second.
const REPAIR_WITHIN: Duration = Duration::from_secs(3);

/// Names the tables and the offset the test binary, run as [`Vandal`],
/// writes over: `OFFSET:NAME,NAME`.
const VANDAL_VARIABLE: &str = "GPUSHARE_TEST_VANDAL";
/// What the vandal prints once it wrote every table.
const WRITING: &str = "vandal-writing";

/// A process of the pods' uid (this test binary, running [`vandal`])
/// writing 64 random bytes at an offset of each of the tables every few
/// milliseconds, until dropped: cheaper than a shell spawning `dd`, whose
/// processes would take the CPUs the batch pod is timed on.
struct Vandal(Child);

impl Vandal {
    fn start(tables: &[&str], offset: u64) -> Self {
        let mut me = Command::new(std::env::current_exe().expect("test binary"));
        me.args([
            "--exact",
            "node_table_attacks::vandal",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(VANDAL_VARIABLE, format!("{offset}:{}", tables.join(",")));
        let mut child = as_uid(&me, PODS_UID)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .expect("setpriv runs");
        // It says so once it has opened the tables and written them once.
        let stdout = BufReader::new(child.stdout.take().expect("stdout"));
        let writing = stdout
            .lines()
            .map_while(Result::ok)
            .any(|line| line.contains(WRITING));
        assert!(writing, "uid {PODS_UID} cannot write the tables");
        Self(child)
    }
}

impl Drop for Vandal {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// The vandal's body: does nothing unless this binary runs as [`Vandal`].
#[test]
fn vandal() {
    use std::os::unix::fs::FileExt;
    let Ok(spec) = std::env::var(VANDAL_VARIABLE) else {
        return;
    };
    let (offset, names) = spec.split_once(':').expect("OFFSET:NAMES");
    let offset: u64 = offset.parse().expect("offset");
    let files: Vec<std::fs::File> = names
        .split(',')
        .map(|name| {
            std::fs::OpenOptions::new()
                .write(true)
                .open(format!("/dev/shm/{name}"))
                .expect("the pods' uid opens the table")
        })
        .collect();
    // xorshift64, seeded by the clock: random enough for garbage.
    let mut state = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(1, |since| since.as_nanos() as u64)
        | 1;
    let mut said = false;
    loop {
        for file in &files {
            let mut bytes = [0u8; 64];
            for chunk in bytes.chunks_mut(8) {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                chunk.copy_from_slice(&state.to_le_bytes());
            }
            file.write_all_at(&bytes, offset).expect("write");
        }
        if !said {
            println!("{WRITING}");
            said = true;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// The batch pod's launches, as the pods' uid: after a first launch (which
/// maps the tables), [`RUN_MS`] of [`KERNEL_US`] kernels back to back. Its
/// `run` line and the longest a launch call took.
fn batch_run(pod: &Pod, hypervisor: &RunningNode) -> (String, u64) {
    let (kernel, run_ms) = (KERNEL_US.to_string(), RUN_MS.to_string());
    let mut command = probes::probe(
        "cudaprobe",
        pod,
        &[
            ("CUDA_LIMITER_HYPERVISOR", &hypervisor.url()),
            ("CUDA_LIMITER_TOKEN", TOKEN),
        ],
        &[
            "spin", "kernel", &kernel, "1", "run", "kernel", &kernel, &run_ms, "maxstall",
        ],
    );
    probes::use_node_tables(&mut command, pod);
    let lines = probes::run(as_uid(&command, PODS_UID));
    let run = lines
        .iter()
        .find(|line| line.starts_with("run ") && line.contains("-> 0 "))
        .unwrap_or_else(|| panic!("{lines:?}"))
        .clone();
    let stall = probes::line_field(&lines, "maxstall", "ns")
        .parse()
        .expect("maxstall ns");
    (run, stall)
}

/// Asserts that no launch of `run` was held. With no compute limit and no
/// latency pod, the limits hold none: the GPU is busy the whole run (less
/// what the launching thread waited for a CPU, the repo's tolerance of 5%
/// for a run without limits), and a launch call takes at most one kernel
/// (the double's full queue) and its wake-up, plus that wait and what the
/// machine took unseen. Each held launch would have taken 100 ms and left
/// the GPU idle as long. (The pod's count of held launches is asserted
/// too, by the caller.)
fn assert_unheld(run: &str, stall_ns: u64, context: &str) {
    /// How late a launch that slept on the double's full queue wakes up, at
    /// most, on an idle machine: the timer slack (50 µs) and scheduling.
    const WAKE_UP_NS: u64 = 1_000_000;
    /// What a machine can take from the launching thread that its run delay
    /// does not show: a virtual CPU the host runs something else on, a page
    /// fault waiting behind the vandal's write. A few milliseconds seen on
    /// two-core CI machines; a twentieth of a held launch.
    const UNSEEN_NS: u64 = 5_000_000;
    let delay_ns = probes::number(run, "delay_ns") as u64;
    let bound = KERNEL_US * 1_000 + WAKE_UP_NS + UNSEEN_NS + delay_ns;
    println!("{context}: longest launch call {stall_ns} ns (bound {bound} ns): {run}");
    assert!(
        stall_ns <= bound,
        "{context}: a launch call took {stall_ns} ns, more than one kernel ({KERNEL_US} µs) \
         and the {delay_ns} ns its thread waited for a CPU: {run}"
    );
    probes::assert_share(run, 1000, 50);
}

/// The daemon's count of repairs of `table`.
fn repairs(url: &str, table: &str) -> u64 {
    let sample = format!("gpushare_node_table_repairs_total{{table=\"{table}\"}} ");
    let text = daemon::metrics(url);
    text.lines()
        .find_map(|line| line.strip_prefix(&sample))
        .and_then(|value| value.trim().parse().ok())
        .unwrap_or_else(|| panic!("no {sample} in /metrics: {text}"))
}

/// Whether both tables' headers are exactly what the daemon writes.
fn headers_right(activity: &NodeActivity, priority: &NodePriority) -> bool {
    activity.header_is_exact() && priority.header_is_exact()
}

#[test]
fn garbage_over_the_node_tables_holds_no_launch_and_the_daemon_repairs_the_headers() {
    let _serial = probes::serial();
    let pod = Pod::new("vandal");
    let hypervisor = pods_uid_hypervisor(&pod, TOKEN);
    let tables = node_tables(&pod);
    let access = TableAccess::managed(Some(PODS_UID));
    let activity = NodeActivity::open_named(&tables.activity, &access).expect("activity table");
    let priority = NodePriority::open_named(&tables.priority, &access).expect("priority table");
    assert!(headers_right(&activity, &priority));
    let url = hypervisor.url();
    let before = [repairs(&url, "activity"), repairs(&url, "priority")];

    // Random bytes over both headers, again and again while the pod runs
    // (the daemon rewrites them every second): readers ignore the tables.
    let vandal = Vandal::start(&[&tables.activity, &tables.priority], 0);
    let (run, stall) = batch_run(&pod, &hypervisor);
    drop(vandal);
    assert_unheld(&run, stall, "headers overwritten");
    assert!(
        wait_for(REPAIR_WITHIN, || headers_right(&activity, &priority)),
        "the daemon did not repair the headers"
    );
    let after = [repairs(&url, "activity"), repairs(&url, "priority")];
    assert!(
        after[0] > before[0] && after[1] > before[1],
        "repairs {before:?} -> {after:?}"
    );
    assert_eq!(held_launches(&priority, &pod), 0, "{run}");

    // Random bytes over the entries behind a right header: device 0's
    // latency line, and the first activity slots of device 0.
    let vandal = Vandal::start(&[&tables.activity, &tables.priority], 64);
    let (run, stall) = batch_run(&pod, &hypervisor);
    drop(vandal);
    assert_unheld(&run, stall, "entries overwritten");
    assert!(
        headers_right(&activity, &priority),
        "the header was not written"
    );
    assert_eq!(held_launches(&priority, &pod), 0, "{run}");
}

/// How many launches the batch pod counted held (none before its first).
fn held_launches(priority: &NodePriority, pod: &Pod) -> u64 {
    priority
        .stats(pod_key(&pod.0))
        .map_or(0, |stats| stats.held_launches)
}

/// A turn, µs, on the GPU of [`a_turn_word_rewritten_without_launches_holds_no_neighbour`].
const TURN_US: u32 = 5_000;

/// A process of the pods' uid may write the priority table's turn line: a
/// thread naming one slot (a neighbour's, which launches nothing) the
/// holder of a fresh turn every 0.5 ms, until dropped, as a pod may.
struct TurnHog {
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl TurnHog {
    fn start(table: NodePriority, hog: &str) -> Self {
        use gpushare_utils::clock::monotonic_ns;
        use std::sync::atomic::{AtomicBool, Ordering};
        let gpu = gpushare_utils::limits::uuid_key(&gpushare_examples::uuid(0));
        let line = table.claim_turn_line(gpu).expect("the GPU's turn line");
        let slot = line.slot(pod_key(hog), monotonic_ns()).expect("a slot");
        let stop = std::sync::Arc::new(AtomicBool::new(false));
        let stopped = std::sync::Arc::clone(&stop);
        let thread = std::thread::spawn(move || {
            while !stopped.load(Ordering::Relaxed) {
                let now = monotonic_ns();
                line.want(slot, now);
                let end_us = (now + line.quantum_ns()) / 1_000;
                // The word as the line encodes it: holder slot + 1 in the top
                // byte, the turn's end (µs) below.
                line.turn
                    .store(((slot as u64 + 1) << 56) | end_us, Ordering::Release);
                std::thread::sleep(Duration::from_micros(500));
            }
        });
        Self {
            stop,
            thread: Some(thread),
        }
    }
}

impl Drop for TurnHog {
    fn drop(&mut self) {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

#[test]
fn a_turn_word_rewritten_without_launches_holds_no_neighbour() {
    let _serial = probes::serial();
    let pod = Pod::new("turn-victim");
    let text = format!(
        "listen = \"127.0.0.1:0\"\n\n[[pods]]\nid = \"{}\"\ntoken = \"{TOKEN}\"\n\n\
         [[pods.gpus]]\nindex = 0\ncap = 30\npolicy = \"fixed\"\n",
        pod.0
    );
    let hypervisor = daemon::hypervisor(&pod, &text, std::sync::Arc::new(daemon::double_gpus(1)));
    hypervisor
        .hypervisor()
        .set_turn_gpus(&hypervisor_core::turns::TurnOptions {
            gpus: vec![gpushare_examples::uuid(0)],
            auto_gpus: Vec::new(),
            quantum_us: TURN_US,
        });
    let tables = node_tables(&pod);
    let priority = NodePriority::open_named(&tables.priority, &TableAccess::managed(None))
        .expect("priority table");
    let hog = TurnHog::start(priority, "turn-hog");
    let (kernel, run_ms) = (KERNEL_US.to_string(), RUN_MS.to_string());
    let mut command = probes::probe(
        "cudaprobe",
        &pod,
        &[
            ("CUDA_LIMITER_HYPERVISOR", &hypervisor.url()),
            ("CUDA_LIMITER_TOKEN", TOKEN),
            // A real GPU's queue fills: a pod held idles its device.
            ("GPUSHARE_DOUBLE_QUEUE_DEPTH", "4"),
        ],
        &[
            "spin", "kernel", &kernel, "1", "run", "kernel", &kernel, &run_ms, "maxstall",
        ],
    );
    probes::use_node_tables(&mut command, &pod);
    let lines = probes::run(command);
    drop(hog);
    let run = lines
        .iter()
        .find(|line| line.starts_with("run ") && line.contains("-> 0 "))
        .unwrap_or_else(|| panic!("{lines:?}"));
    let stall: u64 = probes::line_field(&lines, "maxstall", "ns")
        .parse()
        .expect("maxstall ns");
    println!("longest launch call {stall} ns: {run}");
    // Round robin serves a pod within a turn of each other pod that takes
    // turns (none launches here) and the time a holder is given past its
    // turn: a launch is held a few turns at most, never the limiter's 1 s
    // bound of a wait for a turn.
    assert!(
        stall < 20 * u64::from(TURN_US) * 1_000,
        "a launch waited {stall} ns for a turn its neighbour never used: {run}"
    );
    // Its cap (30%) holds it, not the hog: a share near its limit, less
    // what its thread waited for a CPU.
    probes::assert_share(run, 300, 60);
}
