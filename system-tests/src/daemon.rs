//! The node daemon for one test's pods: on loopback, seeing the driver
//! double's GPUs, with the test's node tables ([`node_tables`]).

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use gpu_fakes::FakeGpus;
use hypervisor_observer::{GpuInfo, GpuObserver, HealthPolicy, ProcessMemory};

use crate::RunningNode;
use crate::pod::{Pod, node_tables};
use crate::probes::GIB;

/// The driver double's first `count` GPUs as NVML would show them to a
/// hypervisor: 16 GiB each, with nothing in use.
pub fn double_gpus(count: u8) -> FakeGpus {
    sized_double_gpus(count, 16 * GIB)
}

/// The driver double's first `count` GPUs as [`double_gpus`], with the
/// device memory each of the double's processes holds there, as NVML
/// attributes it to processes ([`crate::swapping::processes_on`]).
pub fn process_gpus(count: u8) -> FakeGpus {
    with_process_memory(double_gpus(count))
}

/// `gpus`, with the device memory each of the double's processes holds
/// there, as NVML attributes it to processes.
pub fn with_process_memory(gpus: FakeGpus) -> FakeGpus {
    gpus.process_memory_from(|index| {
        crate::swapping::processes_on(index)
            .into_iter()
            .map(|(pid, bytes)| ProcessMemory { pid, bytes })
            .collect()
    })
}

/// The driver double's first `devices` GPUs of `total` bytes each, as its
/// processes share them through the node file at `path`
/// (`gpushare_examples::NODE_FILE_VAR`; the processes'
/// `GPUSHARE_DOUBLE_DEVICES` and `GPUSHARE_DOUBLE_TOTAL` say the same):
/// what NVML would show a hypervisor of GPUs several pods use.
pub fn node_file_gpus(path: PathBuf, total: u64, devices: u8) -> FakeGpus {
    sized_double_gpus(devices, total).memory_used_from(move |index| {
        usize::try_from(index)
            .ok()
            .and_then(|index| gpushare_examples::node_used(&path, index))
    })
}

fn sized_double_gpus(count: u8, total: u64) -> FakeGpus {
    let gpus = (0..count)
        .map(|index| GpuInfo {
            index: u32::from(index),
            uuid: gpushare_examples::uuid(index),
            name: "driver double".to_owned(),
            memory_total: total,
            memory_used: 0,
        })
        .collect();
    FakeGpus::from_gpus(gpus, HealthPolicy::default())
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
    hypervisor(pod, &text, Arc::new(double_gpus(1)))
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
