//! Compiles the kubelet plugin protos (hypervisor/proto) with `protox`, a
//! pure-Rust protobuf compiler: no `protoc` binary, nothing downloaded.

use std::path::PathBuf;

/// The DRA plugin's protos, generated into `OUT_DIR`.
const PROTOS: &[&str] = &[
    "dra/v1/dra.proto",
    "dra/v1beta1/dra.proto",
    "dra/v1beta1/legacy.proto",
    "pluginregistration/registration.proto",
];

/// The device plugin's: its package `v1beta1` is also the DRA legacy one's,
/// and both define a `Device`, so they are compiled on their own, into
/// `OUT_DIR/deviceplugin`.
const DEVICE_PLUGIN_PROTOS: &[&str] = &[
    "deviceplugin/v1beta1/api.proto",
    "podresources/v1/api.proto",
];

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let root = PathBuf::from("proto");
    for proto in PROTOS.iter().chain(DEVICE_PLUGIN_PROTOS) {
        println!("cargo:rerun-if-changed={}", root.join(proto).display());
    }
    let descriptors = protox::compile(PROTOS, [&root])?;
    tonic_prost_build::configure()
        .build_client(true)
        .build_server(true)
        .compile_fds(descriptors)?;
    let out = PathBuf::from(std::env::var("OUT_DIR")?).join("deviceplugin");
    std::fs::create_dir_all(&out)?;
    let descriptors = protox::compile(DEVICE_PLUGIN_PROTOS, [&root])?;
    tonic_prost_build::configure()
        .build_client(true)
        .build_server(true)
        .out_dir(out)
        .compile_fds(descriptors)?;
    Ok(())
}
