//! Where provisioning puts things, as the agent and as the host see them.

use std::path::{Path, PathBuf};

use super::{CONTAINER_SOCKET_DIR, ProvisionError};

/// Where things are, as the agent sees them and as the host (the container
/// runtime reading the CDI spec) sees them. In the DaemonSet both views
/// coincide except for the regions: the agent's `/dev/shm` is the host
/// directory `host_region_dir`.
#[derive(Debug, Clone)]
pub struct ProvisionConfig {
    /// Checkpoint, preload file and per-pod tokens (`/var/lib/gpushare`).
    pub state_dir: PathBuf,
    /// `state_dir` as the host sees it.
    pub host_state_dir: PathBuf,
    /// Where CDI specs are written (`/var/run/cdi`).
    pub cdi_dir: PathBuf,
    /// Where the agent's regions are (`/dev/shm`).
    pub region_dir: PathBuf,
    /// `region_dir` as the host sees it (`/var/lib/gpushare/shm`).
    pub host_region_dir: PathBuf,
    /// The limiter library on the host.
    pub host_limiter: PathBuf,
    /// `CUDA_LIMITER_HYPERVISOR` for the pods: `http+unix://` and the socket's
    /// path in the container, or an `http://` address.
    pub hypervisor_url: String,
    /// The host folder of the hypervisor's Unix socket, mounted read-only
    /// at [`CONTAINER_SOCKET_DIR`] (`None`: the pods use a TCP address).
    pub host_socket_dir: Option<PathBuf>,
    /// CDI vendor (`gpushare.dev`): devices are
    /// `<vendor>/<class>=<claim uid>`, in files `<vendor>-<class>_<claim uid>.json`.
    pub cdi_vendor: String,
    /// CDI class (`gpu`), the second half of [`Self::cdi_kind`].
    pub cdi_class: String,
    /// Root of the host's `/dev` and `/proc/driver/nvidia` (`/`): where the
    /// GPU device nodes and their minor numbers are looked up.
    pub host_root: PathBuf,
    /// The node's co-run GPUs, whose pods are provisioned as MPS clients
    /// ([`super::mps`]); `None`: no GPU is in co-run mode.
    pub corun: Option<hypervisor_corun::CorunOptions>,
    /// The node tables the daemon made, named in the pod files.
    pub node_tables: hypervisor_core::node_tables::NodeTableNames,
}

impl ProvisionConfig {
    /// The defaults of the DaemonSet in `deploy/`, with the hypervisor at `url`.
    pub fn daemonset(url: &str) -> Self {
        Self {
            state_dir: PathBuf::from("/var/lib/gpushare"),
            host_state_dir: PathBuf::from("/var/lib/gpushare"),
            cdi_dir: PathBuf::from("/var/run/cdi"),
            region_dir: PathBuf::from("/dev/shm"),
            host_region_dir: PathBuf::from("/var/lib/gpushare/shm"),
            host_limiter: PathBuf::from("/var/lib/gpushare/lib/libcuda_limiter.so"),
            hypervisor_url: url.to_owned(),
            host_socket_dir: None,
            cdi_vendor: "gpushare.dev".to_owned(),
            cdi_class: "gpu".to_owned(),
            host_root: PathBuf::from("/"),
            corun: None,
            node_tables: Default::default(),
        }
    }

    /// The defaults of the DaemonSet, with the hypervisor on the Unix socket
    /// `socket` (the same path on the host and in the agent): the pods get
    /// its folder and an `http+unix://` address.
    pub fn daemonset_socket(socket: &Path) -> Result<Self, ProvisionError> {
        let bad = || ProvisionError::SocketPath(socket.to_owned());
        let dir = socket
            .parent()
            .filter(|d| !d.as_os_str().is_empty())
            .ok_or_else(bad)?;
        let name = socket.file_name().ok_or_else(bad)?;
        let inside = Path::new(CONTAINER_SOCKET_DIR).join(name);
        let mut config = Self::daemonset(&http_bidir_comm::unix_socket_url(&inside));
        config.host_socket_dir = Some(dir.to_owned());
        Ok(config)
    }

    /// `<vendor>/<class>`.
    pub fn cdi_kind(&self) -> String {
        format!("{}/{}", self.cdi_vendor, self.cdi_class)
    }

    pub(super) fn preload_file(&self) -> PathBuf {
        self.state_dir.join("ld.so.preload")
    }
}
