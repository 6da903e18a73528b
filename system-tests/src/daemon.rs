//! The node daemon for one test's pods: on loopback, seeing the driver
//! double's GPUs, with the test's node tables ([`node_tables`]).

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use hypervisor_observer::{GpuInfo, GpuObserver, ObserverError, ProcessMemory};

use crate::RunningNode;
use crate::pod::{Pod, node_tables};
use crate::probes::GIB;

/// The driver double's first `.0` GPUs, as NVML would show them to a
/// hypervisor.
pub struct DoubleGpus(pub u8);

impl GpuObserver for DoubleGpus {
    fn gpus(&self) -> Result<Vec<GpuInfo>, ObserverError> {
        Ok((0..self.0)
            .map(|index| GpuInfo {
                index: u32::from(index),
                uuid: gpushare_examples::uuid(index),
                name: "driver double".to_owned(),
                memory_total: 16 * GIB,
                memory_used: 0,
            })
            .collect())
    }
}

/// The driver double's first `.0` GPUs as [`DoubleGpus`], with the device
/// memory each of the double's processes holds there, as NVML attributes
/// it to processes ([`crate::swapping::processes_on`]).
pub struct ProcessGpus(pub u8);

impl GpuObserver for ProcessGpus {
    fn gpus(&self) -> Result<Vec<GpuInfo>, ObserverError> {
        DoubleGpus(self.0).gpus()
    }

    fn process_memory(&self, index: u32) -> Result<Vec<ProcessMemory>, ObserverError> {
        Ok(crate::swapping::processes_on(index)
            .into_iter()
            .map(|(pid, bytes)| ProcessMemory { pid, bytes })
            .collect())
    }
}

/// The driver double's first GPUs as its processes share them through a
/// node file (`gpushare_examples::NODE_FILE_VAR`): what NVML would show a
/// hypervisor of GPUs several pods use.
pub struct NodeFileGpu {
    /// The node file the pods' processes name.
    pub path: std::path::PathBuf,
    /// Each GPU's size, as the processes' `GPUSHARE_DOUBLE_TOTAL` says.
    pub total: u64,
    /// How many GPUs (the processes' `GPUSHARE_DOUBLE_DEVICES`).
    pub devices: u8,
}

impl GpuObserver for NodeFileGpu {
    fn gpus(&self) -> Result<Vec<GpuInfo>, ObserverError> {
        Ok((0..self.devices)
            .map(|index| GpuInfo {
                index: u32::from(index),
                uuid: gpushare_examples::uuid(index),
                name: "driver double".to_owned(),
                memory_total: self.total,
                memory_used: gpushare_examples::node_used(&self.path, usize::from(index))
                    .unwrap_or(0),
            })
            .collect())
    }
}

/// A hypervisor on loopback running `config` (its TOML) for `pod`'s test,
/// seeing GPUs through `observer`, with the test's node tables.
pub fn hypervisor(pod: &Pod, config: &str, observer: Arc<dyn GpuObserver>) -> RunningNode {
    let config =
        hypervisor_config::parse(config, Path::new("test.toml"), Path::new(".")).expect("config");
    RunningNode::daemon(hypervisor_daemon::Options {
        config,
        config_path: None,
        listen: None,
        observer,
        handle_sighup: false,
        node_tables: node_tables(pod),
    })
    .expect("hypervisor starts")
}

/// The uid the pods run as, in the tests whose hypervisor has it as
/// `region_uid` ([`pods_uid_hypervisor`]).
pub const PODS_UID: u32 = 65534;

/// A hypervisor for `pod`'s test that makes the pods' objects and the node
/// tables for uid [`PODS_UID`] (`region_uid`, `region_gid`; mode 0600, the
/// default `region_mode`), with the test's node tables: `pod`, of `token`,
/// has 1 GiB on GPU 0 and no compute limit.
pub fn pods_uid_hypervisor(pod: &Pod, token: &str) -> RunningNode {
    let text = format!(
        "listen = \"127.0.0.1:0\"\nregion_uid = {PODS_UID}\nregion_gid = {PODS_UID}\n\n\
         [[pods]]\nid = \"{}\"\ntoken = \"{token}\"\n\n[[pods.gpus]]\nindex = 0\nmemory = \"1g\"\n",
        pod.0
    );
    hypervisor(pod, &text, Arc::new(DoubleGpus(1)))
}

/// `GET /metrics` on the hypervisor at `url`: the whole answer, its status
/// line first.
pub fn metrics(url: &str) -> String {
    let address = url.trim_start_matches("http://");
    let mut stream = TcpStream::connect(address).expect("daemon listens");
    stream
        .set_read_timeout(Some(Duration::from_secs(5)))
        .expect("timeout");
    write!(
        stream,
        "GET /metrics HTTP/1.1\r\nHost: {address}\r\nConnection: close\r\n\r\n"
    )
    .expect("request");
    let mut answer = String::new();
    let _ = stream.read_to_string(&mut answer);
    answer
}
