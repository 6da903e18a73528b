//! Compiles the kubelet plugin protos (hypervisor/proto) with `protox`, a
//! pure-Rust protobuf compiler: no `protoc` binary, nothing downloaded.

use std::path::PathBuf;

const PROTOS: &[&str] = &[
    "dra/v1/dra.proto",
    "dra/v1beta1/dra.proto",
    "dra/v1beta1/legacy.proto",
    "pluginregistration/registration.proto",
];

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let root = PathBuf::from("proto");
    for proto in PROTOS {
        println!("cargo:rerun-if-changed={}", root.join(proto).display());
    }
    let descriptors = protox::compile(PROTOS, [&root])?;
    tonic_prost_build::configure()
        .build_client(true)
        .build_server(true)
        .compile_fds(descriptors)?;
    Ok(())
}
