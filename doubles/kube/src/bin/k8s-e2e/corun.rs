//! `--corun`: the claim's GPU in co-run mode, as `serve --kubernetes
//! --corun-gpu` runs it: the real MPS control daemon (or `--mps-control`'s
//! program) supervised by the node with a `/dev/shm` of its own, and the claim's CDI
//! spec making the container its MPS client.
//!
//! Written besides the usual files: `OUT/mps` (`GPU_UUID DAEMON_PID SHM_DIR`
//! once the daemon answers), so the script can check what the daemon sees
//! as `/dev/shm` and that clients share it.

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use hypervisor_corun::{CorunOptions, DEFAULT_LATENCY_RESERVE, MpsBoard, MpsState, shm_dir};
use hypervisor_observer::GpuObserver;

/// How long the daemon has to answer before the run gives up.
const UP_WITHIN: Duration = Duration::from_secs(60);

/// The co-run options for GPU `index` of `observer`, with the MPS folders
/// under `dir` and `control` as the control program.
pub(crate) fn options(
    observer: &Arc<dyn GpuObserver>,
    index: u32,
    dir: &Path,
    control: &Path,
) -> anyhow::Result<CorunOptions> {
    let gpus = observer.gpus().context("cannot list the GPUs")?;
    let Some(gpu) = gpus.iter().find(|g| g.index == index) else {
        bail!("no GPU {index} for --corun");
    };
    Ok(CorunOptions {
        gpus: vec![gpu.uuid.clone()],
        dir: dir.to_owned(),
        host_dir: dir.to_owned(),
        latency_reserve: DEFAULT_LATENCY_RESERVE,
        control: control.to_owned(),
        // Pods are containers: the daemon and its clients get a /dev/shm
        // of their own, as with --kubernetes.
        private_shm: true,
    })
}

/// Waits until the daemon on `board` answers; writes `out/mps`.
pub(crate) fn wait_up(board: &MpsBoard, options: &CorunOptions, out: &Path) -> anyhow::Result<()> {
    let deadline = Instant::now() + UP_WITHIN;
    loop {
        let gpu = board
            .snapshot()
            .into_iter()
            .next()
            .context("no co-run GPU on the board")?;
        match (&gpu.state, gpu.pid) {
            (MpsState::Up { .. }, Some(pid)) => {
                let shm = shm_dir(&options.dir, &gpu.gpu);
                std::fs::write(
                    out.join("mps"),
                    format!("{} {pid} {}\n", gpu.gpu, shm.display()),
                )?;
                return Ok(());
            }
            (MpsState::Down { reason, .. }, _) if Instant::now() >= deadline => {
                bail!("the MPS control daemon of {} is down: {reason}", gpu.gpu)
            }
            _ if Instant::now() >= deadline => {
                bail!(
                    "the MPS control daemon of {} did not answer within {UP_WITHIN:?}",
                    gpu.gpu
                )
            }
            _ => std::thread::sleep(Duration::from_millis(100)),
        }
    }
}
