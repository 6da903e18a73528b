//! CUDA IPC of the memory the limiter backs (`CUDA_LIMITER_FAST_SWAP`): the
//! driver's legacy IPC cannot export VMM memory, so the limiter exports a
//! backed range as a file descriptor behind `cuIpcGetMemHandle`, and
//! another process of the pod maps the same bytes behind
//! `cuIpcOpenMemHandle` (charged to the exporter alone) and unmaps them
//! behind `cuIpcCloseMemHandle`. Handles and memory the limiter did not
//! make stay the driver's. A process whose memory is shared declines the
//! fast swap (its copies would not be the importer's), until the shared
//! range is freed.

use crate::common;
use crate::fast_swap_moves::{Stepped, publish, report};

use common::hypervisor::FakeHypervisor;
use common::{CONTEXT_BYTES, GIB, MIB, Pod, info, number, probe, result_of, run};
use gpushare_utils::protocol::Command;

/// The exporter: a backed range written with seed 5 and exported, and a
/// small allocation the driver makes, whose export is the driver's to
/// refuse; then, once the importer wrote seed 7 through its mapping, the
/// check of that, and the range freed.
const EXPORTER: &[&str] = &[
    "alloc",
    "mem",
    "64m",
    "write",
    "0",
    "5",
    "alloc",
    "mem",
    "1m",
    "ipc-export",
    "0",
    "ipc-export",
    "1",
    "wait",
    "check",
    "0",
    "7",
    "free",
    "0",
    "wait",
];

#[test]
fn backed_memory_is_shared_by_cuda_ipc_and_its_exporter_declines_the_fast_swap() {
    let pod = Pod::new("fast-ipc");
    let _limits = publish(&pod);
    let mut hypervisor = FakeHypervisor::start();
    let mut exporter = Stepped::run(&pod, &hypervisor, true, &[], EXPORTER);
    let lines = exporter.until_ready();
    let exports: Vec<&String> = lines
        .iter()
        .filter(|l| l.starts_with("ipc-export"))
        .collect();
    assert_eq!(
        result_of(exports[0]),
        0,
        "backed memory exported: {lines:?}"
    );
    assert_eq!(
        result_of(exports[1]),
        801,
        "the driver's own memory is the driver's (the double refuses it): {lines:?}"
    );
    let handle = exports[0].split("handle=").nth(1).unwrap();

    // Another process maps the same bytes, uncharged, and writes them.
    let importer = [
        "ipc-open",
        handle,
        "info",
        "check",
        "0",
        "5",
        "write",
        "0",
        "7",
        "ipc-close",
        "0",
        "ipc-open",
        &"0".repeat(128),
    ];
    let imported = run(probe(
        "cudaprobe",
        &Pod::new("fast-ipc-importer"),
        &[
            ("CUDA_DEVICE_MEMORY_LIMIT", "4g"),
            ("CUDA_LIMITER_FAST_SWAP", "1"),
        ],
        &importer,
    ));
    assert_eq!(result_of(&imported[0]), 0, "{imported:?}");
    assert_eq!(
        number(&imported[0], "size"),
        64 * MIB as i64,
        "{imported:?}"
    );
    assert_eq!(
        imported[1],
        info(0, 4 * GIB - CONTEXT_BYTES, 4 * GIB),
        "charged to the exporter alone: {imported:?}"
    );
    assert!(
        imported[2].contains("-> 0 differ=0"),
        "the exporter's bytes: {imported:?}"
    );
    assert_eq!(result_of(&imported[3]), 0, "{imported:?}");
    assert_eq!(imported[4], "ipc-close 0 -> 0", "{imported:?}");
    assert_eq!(
        imported[5], "ipc-open -> 1",
        "another handle is the driver's to refuse: {imported:?}"
    );

    // Shared, the exporter's memory cannot move by its own copies.
    let declined = hypervisor.ask(exporter.pid(), Command::SwapOut);
    assert!(
        !declined.ok && declined.message.contains("CUDA IPC"),
        "{declined:?}"
    );
    exporter.resume();
    let rest = exporter.until_ready();
    assert!(
        rest[0].starts_with("check 0 7 -> 0 differ=0"),
        "the importer's bytes: {rest:?}"
    );
    assert_eq!(result_of(&rest[1]), 0, "{rest:?}");

    // Freed, nothing of it is shared any more.
    let out = hypervisor.ask(exporter.pid(), Command::SwapOut);
    assert_eq!(report(&out).bytes, 0, "{out:?}");
    let back = hypervisor.ask(exporter.pid(), Command::SwapIn);
    report(&back);
    exporter.finish();
}
