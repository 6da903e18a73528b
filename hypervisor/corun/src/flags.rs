//! `serve`'s co-run flags, and the [`CorunOptions`] they make once the GPUs
//! are known (an index names a GPU through the observer).

use std::path::PathBuf;

use super::{
    CorunError, CorunOptions, DEFAULT_LATENCY_RESERVE, DEFAULT_MPS_CONTROL, MAX_PIPE_DIR_LEN,
    pipe_dir,
};
use hypervisor_observer::GpuInfo;

/// Where the MPS folders are by default.
pub const DEFAULT_CORUN_DIR: &str = "/run/gpushare/mps";

/// `serve`'s co-run flags.
#[derive(Debug, Clone, clap::Args)]
pub struct CorunArgs {
    /// Run this GPU in co-run mode (pods as MPS clients, kernels side by
    /// side): its UUID or index; repeatable.
    #[arg(long = "corun-gpu", value_name = "UUID|INDEX")]
    pub corun_gpus: Vec<String>,
    /// Folder of the MPS pipe and log folders (one pair per co-run GPU);
    /// short enough for MPS's sockets: `<DIR>/<GPU UUID>/pipe` of at most
    /// 87 bytes.
    #[arg(long, value_name = "DIR", default_value = DEFAULT_CORUN_DIR)]
    pub corun_dir: PathBuf,
    /// --corun-dir as the host sees it (what the pods' CDI specs mount);
    /// default: --corun-dir.
    #[arg(long, value_name = "DIR")]
    pub corun_host_dir: Option<PathBuf>,
    /// Percent of a co-run GPU's SMs kept from batch pods for latency pods,
    /// for each batch client's whole life; beside batch pods, a latency
    /// client keeps to it (0: no reserve, every client on every SM).
    #[arg(
        long,
        value_name = "PERCENT",
        default_value_t = DEFAULT_LATENCY_RESERVE,
        value_parser = clap::value_parser!(u8).range(0..=99)
    )]
    pub corun_latency_reserve: u8,
    /// The nvidia-cuda-mps-control program.
    #[arg(long, value_name = "PATH", default_value = DEFAULT_MPS_CONTROL)]
    pub mps_control: PathBuf,
}

impl CorunArgs {
    /// The options, `None` without `--corun-gpu`; each GPU by the UUID the
    /// observer reports, once. Where pods are containers (Kubernetes), each
    /// daemon and its clients share a `/dev/shm` of their own.
    pub fn options(
        &self,
        gpus: &[GpuInfo],
        pods_are_containers: bool,
    ) -> Result<Option<CorunOptions>, CorunError> {
        if self.corun_gpus.is_empty() {
            return Ok(None);
        }
        let mut uuids: Vec<String> = Vec::new();
        for named in &self.corun_gpus {
            let uuid = GpuInfo::find(gpus, named)
                .map(|g| g.uuid.clone())
                .ok_or_else(|| CorunError::UnknownGpu(named.clone()))?;
            let pipe = pipe_dir(&self.corun_dir, &uuid);
            let len = pipe.as_os_str().len();
            if len > MAX_PIPE_DIR_LEN {
                return Err(CorunError::PipeFolderTooLong { path: pipe, len });
            }
            if !uuids.contains(&uuid) {
                uuids.push(uuid);
            }
        }
        Ok(Some(CorunOptions {
            gpus: uuids,
            dir: self.corun_dir.clone(),
            host_dir: self
                .corun_host_dir
                .clone()
                .unwrap_or_else(|| self.corun_dir.clone()),
            latency_reserve: self.corun_latency_reserve,
            control: self.mps_control.clone(),
            private_shm: pods_are_containers,
        }))
    }
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::*;
    use hypervisor_observer::{GpuObserver, SimulatedGpus};

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        corun: CorunArgs,
    }

    fn parse(args: &[&str]) -> Result<CorunArgs, clap::Error> {
        Cli::try_parse_from(std::iter::once("hv").chain(args.iter().copied())).map(|c| c.corun)
    }

    #[test]
    fn flags_make_the_options() {
        let gpus = SimulatedGpus::new(3).gpus().unwrap();
        assert_eq!(parse(&[]).unwrap().options(&gpus, false).unwrap(), None);
        let uuid2 = gpus[2].uuid.to_lowercase();
        let args = parse(&[
            "--corun-gpu",
            "0",
            "--corun-gpu",
            &uuid2,
            "--corun-gpu",
            "2",
            "--corun-latency-reserve",
            "30",
        ])
        .unwrap();
        let options = args.options(&gpus, false).unwrap().unwrap();
        assert_eq!(options.gpus, [gpus[0].uuid.clone(), gpus[2].uuid.clone()]);
        assert_eq!(options.dir, PathBuf::from(DEFAULT_CORUN_DIR));
        assert_eq!(options.host_dir, options.dir);
        assert_eq!(options.latency_reserve, 30);
        assert_eq!(options.control, PathBuf::from(DEFAULT_MPS_CONTROL));
        assert!(!options.private_shm);

        let moved = parse(&["--corun-gpu", "1", "--corun-host-dir", "/var/run/mps"]).unwrap();
        let options = moved.options(&gpus, true).unwrap().unwrap();
        assert_eq!(options.host_dir, PathBuf::from("/var/run/mps"));
        assert!(options.private_shm);
        assert_eq!(options.latency_reserve, DEFAULT_LATENCY_RESERVE);

        for unknown in ["7", "GPU-nope"] {
            let error = parse(&["--corun-gpu", unknown])
                .unwrap()
                .options(&gpus, false)
                .unwrap_err();
            assert!(error.to_string().contains(unknown), "{error}");
        }
        assert!(parse(&["--corun-latency-reserve", "100"]).is_err());
    }

    #[test]
    fn a_corun_dir_too_long_for_the_mps_sockets_is_refused_with_the_reason() {
        let gpus = SimulatedGpus::new(1).gpus().unwrap();
        // `<dir>/<uuid>/pipe`: the dir's length that makes the pipe folder `len` bytes.
        let dir_of = |len: usize| {
            let rest = "/".len() + gpus[0].uuid.len() + "/pipe".len();
            format!("/{}", "d".repeat(len - rest - 1))
        };
        let longest = dir_of(MAX_PIPE_DIR_LEN);
        let options = parse(&["--corun-gpu", "0", "--corun-dir", &longest])
            .unwrap()
            .options(&gpus, false)
            .unwrap()
            .unwrap();
        assert_eq!(
            pipe_dir(&options.dir, &options.gpus[0]).as_os_str().len(),
            MAX_PIPE_DIR_LEN
        );

        let too_long = dir_of(MAX_PIPE_DIR_LEN + 1);
        let error = parse(&["--corun-gpu", "0", "--corun-dir", &too_long])
            .unwrap()
            .options(&gpus, false)
            .unwrap_err();
        assert!(
            matches!(&error, CorunError::PipeFolderTooLong { len, .. } if *len == MAX_PIPE_DIR_LEN + 1),
            "{error}"
        );
        let text = error.to_string();
        assert!(
            text.contains(&too_long) && text.contains("--corun-dir"),
            "{text}"
        );
    }
}
