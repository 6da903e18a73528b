//! The node daemon's cost with many pods on one GPU, on the driver double
//! (no GPU needed): N pods of fixed caps of ⌊90/N⌋% each run one process
//! launching 450 µs kernels back to back under the daemon; over a window,
//! the daemon's CPU (this process's, which runs it and otherwise sleeps),
//! the admission requests it answered, and each pod's busy share.
//!
//!   cargo bench -p system-tests --bench daemon_load [-- N... [--seconds S]]
//!
//! Default counts 1, 4, 16, 32; 3 s windows. The kernels run on the double's
//! simulated clock, so the GPU's own behaviour (time slices, MPS) is not in
//! these figures: `python3 -m scripts.bench packing` measures them on a GPU.

#![allow(
    clippy::unwrap_used,
    reason = "a benchmark stops at its first failure, by panicking"
)]

use std::process::{Child, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use system_tests::daemon::{self, double_gpus};
use system_tests::pod::Pod;
use system_tests::probes;

const KERNEL_US: &str = "450";
/// From the processes' start to the window's: registration and first launches.
const RAMP: Duration = Duration::from_millis(700);

/// This process's CPU time (user and system), from /proc/self/stat.
fn cpu_seconds() -> f64 {
    let stat = std::fs::read_to_string("/proc/self/stat").expect("read /proc/self/stat");
    // The fields after the command name, which may hold spaces: state is 3rd.
    let after = &stat[stat.rfind(')').expect("stat") + 2..];
    let fields: Vec<&str> = after.split_whitespace().collect();
    let ticks: f64 =
        fields[11].parse::<f64>().expect("utime") + fields[12].parse::<f64>().expect("stime");
    // SAFETY: sysconf reads a constant of the system.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64;
    ticks / hz
}

fn config(pods: &[Pod]) -> String {
    let cap = (90 / pods.len()).max(1);
    let mut text = String::from("listen = \"127.0.0.1:0\"\nadmin_token = \"admin\"\n");
    for (i, pod) in pods.iter().enumerate() {
        text.push_str(&format!(
            "\n[[pods]]\nid = \"{}\"\ntoken = \"tok-{i}\"\n\n[[pods.gpus]]\nindex = 0\npolicy = \"fixed\"\ncap = {cap}\n",
            pod.0
        ));
    }
    text
}

fn run(n: usize, seconds: f64) {
    let pods: Vec<Pod> = (0..n).map(|_| Pod::new("load")).collect();
    let node = daemon::hypervisor(&pods[0], &config(&pods), Arc::new(double_gpus(1)));
    let url = node.url();
    let ms = ((seconds + RAMP.as_secs_f64() + 0.3) * 1e3)
        .round()
        .to_string();
    let children: Vec<Child> = pods
        .iter()
        .enumerate()
        .map(|(i, pod)| {
            let token = format!("tok-{i}");
            let mut command = probes::probe(
                "cudaprobe",
                pod,
                &[
                    ("CUDA_LIMITER_HYPERVISOR", url.as_str()),
                    ("CUDA_LIMITER_TOKEN", token.as_str()),
                ],
                &["run", "kernel", KERNEL_US, &ms],
            );
            probes::use_node_tables(&mut command, &pods[0]);
            command
                .stdout(Stdio::piped())
                .spawn()
                .expect("spawn a probe")
        })
        .collect();
    std::thread::sleep(RAMP);
    let asked = || node.hypervisor().status().admission.count;
    let (cpu0, asks0, t0) = (cpu_seconds(), asked(), Instant::now());
    std::thread::sleep(Duration::from_secs_f64(seconds));
    let (cpu1, asks1, window) = (cpu_seconds(), asked(), t0.elapsed().as_secs_f64());
    let mut shares = Vec::new();
    for child in children {
        let output = child.wait_with_output().expect("probe");
        let lines = probes::stdout_lines(&output);
        match lines.iter().find(|l| l.starts_with("run ")) {
            Some(line) => shares.push(probes::number(line, "share_pm") as f64 / 10.0),
            None => eprintln!("a probe gave no result: {output:?}"),
        }
    }
    let (lo, hi) = shares
        .iter()
        .fold((f64::MAX, f64::MIN), |(lo, hi), s| (lo.min(*s), hi.max(*s)));
    println!(
        "pods={n} cap={}% daemon_cpu_pct={:.2} admissions_per_s={:.1} admissions={} pod_share_pct={lo:.1}-{hi:.1} window_s={window:.2}",
        (90 / n).max(1),
        (cpu1 - cpu0) / window * 100.0,
        (asks1 - asks0) as f64 / window,
        asks1 - asks0,
    );
}

fn main() {
    let mut counts = Vec::new();
    let mut seconds = 3.0;
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        match arg.as_str() {
            "--seconds" => {
                seconds = args
                    .next()
                    .and_then(|s| s.parse().ok())
                    .expect("--seconds S");
            }
            "--bench" => {}
            other => counts.push(other.parse::<usize>().expect("a pod count")),
        }
    }
    if counts.is_empty() {
        counts = vec![1, 4, 16, 32];
    }
    for n in counts {
        run(n, seconds);
    }
}
