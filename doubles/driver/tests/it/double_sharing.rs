//! Memory shared between processes (`double/vmm.c`): VMM memory exported as
//! a POSIX file descriptor and imported over the same bytes, charged to its
//! exporter only, and legacy IPC, which the double refuses; through the
//! probe's commands and through the entry points themselves.
#![cfg(all(target_arch = "x86_64", target_os = "linux"))]

use std::ffi::{CStr, c_char, c_int, c_uint, c_void};
use std::time::Duration;

use crate::common;
use crate::double_vmm::{
    CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, CUDA_ERROR_NOT_SUPPORTED, DevPtr, GRANULARITY, READ_WRITE,
    Vmm, pattern,
};

use common::in_process::{CUDA_ERROR_INVALID_HANDLE, CUDA_ERROR_INVALID_VALUE, Lib};
use common::interactive::Interactive;
use common::{CTX, CUDA_SUCCESS, GIB, MIB, VARIANTS, assert_malformed, in_fresh_process, lines};

const CUDA_ERROR_NOT_INITIALIZED: c_int = 3;
const CUDA_ERROR_INVALID_DEVICE: c_int = 101;
const POSIX_FD: c_int = 1;
const WIN32: c_int = 2;
const FABRIC: c_int = 8;
const CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS: c_uint = 1;
/// The double's default GPU.
const TOTAL: u64 = 16 * GIB;
const REPLY: Duration = Duration::from_secs(10);

/// A probe line with its addresses and descriptor numbers, which vary from
/// run to run, as `at=ADDR` and `fd=FD` (a failed export's `fd=-1` stays).
fn masked(line: &str) -> String {
    line.split(' ')
        .map(|word| {
            if word.starts_with("at=0x") {
                "at=ADDR"
            } else if word.starts_with("fd=") && word != "fd=-1" {
                "fd=FD"
            } else {
                word
            }
        })
        .collect::<Vec<_>>()
        .join(" ")
}

fn masked_lines(name: &str, options: &[&str], script: &str, env: &[(&str, &str)]) -> Vec<String> {
    lines(name, options, script, env)
        .iter()
        .map(|line| masked(line))
        .collect()
}

#[test]
fn legacy_ipc_is_refused_through_every_variant() {
    let zeros = "0".repeat(128);
    let script = format!(
        "alloc mem 64m ipc-export 0 ipc-open {zeros} ipc-close 0 vmm-alloc 2m ipc-export 1 \
         free 1 free 0"
    );
    let expected = [
        "alloc mem 64m -> 0 0".to_owned(),
        format!("ipc-export 0 -> {CUDA_ERROR_NOT_SUPPORTED} handle={zeros}"),
        format!("ipc-open -> {CUDA_ERROR_INVALID_VALUE}"),
        format!("ipc-close 0 -> {CUDA_ERROR_INVALID_VALUE}"),
        "vmm-alloc 2m -> 0 id=1 at=ADDR size=2097152".to_owned(),
        // VMM memory cannot be exported this way, as on the real driver.
        format!("ipc-export 1 -> {CUDA_ERROR_INVALID_VALUE} handle={zeros}"),
        "free 1 -> 0".to_owned(),
        "free 0 -> 0".to_owned(),
    ];
    assert_eq!(expected[1], format!("ipc-export 0 -> 801 handle={zeros}"));
    for &(name, options) in VARIANTS {
        assert_eq!(
            masked_lines(name, options, &script, &[]),
            expected,
            "{name} {options:?}"
        );
    }
    assert_malformed("ipc-open 00");
    assert_malformed(&format!("ipc-open {}", "g".repeat(128)));
    assert_malformed("vmm-alloc 2m vmm-import last vmm-export 0");
    assert_malformed("vmm-import 2147483648");
}

#[test]
fn imported_memory_shares_its_bytes_and_the_exporters_charge() {
    let charged = |bytes: u64| format!("info 0 free={} total={TOTAL}", TOTAL - CTX - bytes);
    let script = "vmm-alloc 4m write 0 5 vmm-export 0 info vmm-import last info check 1 5 \
                  write 1 6 check 0 6 ptr 1 nvml_procs free 0 info check 1 6 free 1 info \
                  free 1 alloc create 2m vmm-export 2 free 2";
    let expected = [
        "vmm-alloc 4m -> 0 id=0 at=ADDR size=4194304".to_owned(),
        "write 0 5 -> 0 at=ADDR".to_owned(),
        "vmm-export 0 -> 0 fd=FD".to_owned(),
        charged(4 * MIB),
        "vmm-import last -> 0 id=1 at=ADDR size=4194304".to_owned(),
        // Charged once, to the exporter.
        charged(4 * MIB),
        "check 1 5 -> 0 differ=0 at=ADDR".to_owned(),
        "write 1 6 -> 0 at=ADDR".to_owned(),
        "check 0 6 -> 0 differ=0 at=ADDR".to_owned(),
        "ptr 1 -> 0 type=2 size=4194304 start=1".to_owned(),
        format!("nvml_procs 0 count=1 used={}", CTX + 4 * MIB),
        // The exporter's last reference and mapping take its charge; the
        // importer keeps the bytes.
        "free 0 -> 0".to_owned(),
        charged(0),
        "check 1 6 -> 0 differ=0 at=ADDR".to_owned(),
        "free 1 -> 0".to_owned(),
        charged(0),
        format!("free 1 -> {CUDA_ERROR_INVALID_VALUE}"),
        // Memory made without the POSIX descriptor type cannot be exported.
        "alloc create 2m -> 0 2".to_owned(),
        format!("vmm-export 2 -> {CUDA_ERROR_INVALID_VALUE} fd=-1"),
        "free 2 -> 0".to_owned(),
    ];
    for &(name, options) in VARIANTS {
        assert_eq!(
            masked_lines(name, options, script, &[]),
            expected,
            "{name} {options:?}"
        );
    }
}

#[test]
fn another_process_imports_memory_by_its_descriptor() {
    // The exporter runs on GPU 1; the importer sees that GPU as its device
    // 0, so the descriptor must name the GPU, not the ordinal.
    let mut cmd = common::probe_command(
        "cudaprobe",
        &["--device", "1"],
        "vmm-alloc 4m write 0 5 vmm-export 0 wait check 0 6 free 0 info",
        &[("GPUSHARE_DOUBLE_DEVICES", "2")],
    );
    cmd.env_remove("CUDA_VISIBLE_DEVICES");
    let mut exporter = Interactive::spawn(cmd, REPLY);
    assert_eq!(
        masked(&exporter.line()),
        "vmm-alloc 4m -> 0 id=0 at=ADDR size=4194304"
    );
    assert_eq!(masked(&exporter.line()), "write 0 5 -> 0 at=ADDR");
    let export = exporter.line();
    let fd = export
        .strip_prefix("vmm-export 0 -> 0 fd=")
        .unwrap_or_else(|| panic!("{export}"));
    exporter.expect(&["ready"]);

    let path = format!("/proc/{}/fd/{fd}", exporter.pid());
    let importer = masked_lines(
        "cudaprobe",
        &[],
        &format!("vmm-import {path} check 0 5 write 0 6 info free 0"),
        &[
            ("GPUSHARE_DOUBLE_DEVICES", "2"),
            ("CUDA_VISIBLE_DEVICES", "1"),
        ],
    );
    assert_eq!(
        importer,
        [
            format!("vmm-import {path} -> 0 id=0 at=ADDR size=4194304"),
            "check 0 5 -> 0 differ=0 at=ADDR".to_owned(),
            "write 0 6 -> 0 at=ADDR".to_owned(),
            format!("info 0 free={} total={TOTAL}", TOTAL - CTX),
            "free 0 -> 0".to_owned(),
        ]
    );

    exporter.send("");
    exporter.expect(&["resumed"]);
    assert_eq!(masked(&exporter.line()), "check 0 6 -> 0 differ=0 at=ADDR");
    exporter.expect(&[
        "free 0 -> 0",
        &format!("info 0 free={} total={TOTAL}", TOTAL - CTX),
    ]);
    exporter.finish();
}

/// `CUipcMemHandle` of cuda.h, passed by value.
#[repr(C)]
#[derive(Clone, Copy)]
struct IpcMemHandle {
    reserved: [c_char; 64],
}

type IpcOpen = unsafe extern "C" fn(*mut DevPtr, IpcMemHandle, c_uint) -> c_int;

/// The sharing entry points, with the signatures of cuda.h.
struct Sharing {
    export: unsafe extern "C" fn(*mut c_void, u64, c_int, u64) -> c_int,
    import: unsafe extern "C" fn(*mut u64, *mut c_void, c_int) -> c_int,
    ipc_get: unsafe extern "C" fn(*mut IpcMemHandle, DevPtr) -> c_int,
    ipc_open: IpcOpen,
    ipc_open_v1: IpcOpen,
    ipc_close: unsafe extern "C" fn(DevPtr) -> c_int,
}

impl Sharing {
    /// The double's libcuda in this process, as it is (cuInit or not).
    fn open() -> Sharing {
        let lib = Lib::open("libcuda.so.1");
        // SAFETY: each field's type is the signature of the export in cuda.h.
        unsafe {
            Sharing {
                export: lib.function("cuMemExportToShareableHandle"),
                import: lib.function("cuMemImportFromShareableHandle"),
                ipc_get: lib.function("cuIpcGetMemHandle"),
                ipc_open: lib.function("cuIpcOpenMemHandle_v2"),
                ipc_open_v1: lib.function("cuIpcOpenMemHandle"),
                ipc_close: lib.function("cuIpcCloseMemHandle"),
            }
        }
    }

    fn export(&self, handle: u64, kind: c_int, flags: u64) -> Result<c_int, c_int> {
        let mut fd: c_int = -1;
        // SAFETY: an int for the descriptor, as the POSIX type writes.
        match unsafe { (self.export)((&raw mut fd).cast(), handle, kind, flags) } {
            CUDA_SUCCESS => Ok(fd),
            rc => Err(rc),
        }
    }

    fn import(&self, fd: c_int, kind: c_int) -> Result<u64, c_int> {
        let mut handle = 0;
        // SAFETY: a valid out-pointer; the descriptor travels as the pointer's value.
        match unsafe { (self.import)(&mut handle, fd as isize as *mut c_void, kind) } {
            CUDA_SUCCESS => Ok(handle),
            rc => Err(rc),
        }
    }

    /// cuIpcOpenMemHandle_v2 and the v1, which must agree.
    fn ipc_open(&self, handle: IpcMemHandle) -> c_int {
        let (mut ptr, mut ptr_v1) = (0, 0);
        // SAFETY: valid out-pointers; the handle is passed by value.
        let (rc, rc_v1) = unsafe {
            (
                (self.ipc_open)(&mut ptr, handle, CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS),
                (self.ipc_open_v1)(&mut ptr_v1, handle, CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS),
            )
        };
        assert_eq!(rc, rc_v1);
        rc
    }

    fn ipc_get(&self, ptr: DevPtr) -> c_int {
        let mut handle = IpcMemHandle { reserved: [0; 64] };
        // SAFETY: a valid out-pointer.
        unsafe { (self.ipc_get)(&mut handle, ptr) }
    }
}

/// A memfd of `size` bytes named `name`, as another program could make.
fn memfd(name: &CStr, size: usize) -> c_int {
    // SAFETY: a valid C string; the descriptor is ours.
    let fd = unsafe { libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC) };
    assert!(fd >= 0);
    // SAFETY: our descriptor.
    assert_eq!(unsafe { libc::ftruncate(fd, size as libc::off_t) }, 0);
    fd
}

fn close(fd: c_int) {
    // SAFETY: a descriptor this test owns, closed once.
    assert_eq!(unsafe { libc::close(fd) }, 0);
}

/// The descriptor flags of `fd`, or -1 when it is not open.
fn fd_flags(fd: c_int) -> c_int {
    // SAFETY: F_GETFD only reads the descriptor table.
    unsafe { libc::fcntl(fd, libc::F_GETFD) }
}

#[test]
fn shareable_handles_and_ipc_refuse_what_the_driver_refuses() {
    if !in_fresh_process(
        "shareable_handles_and_ipc_refuse_what_the_driver_refuses",
        &[],
    ) {
        return;
    }
    let sharing = Sharing::open();
    assert_eq!(sharing.import(0, POSIX_FD), Err(CUDA_ERROR_NOT_INITIALIZED));
    assert_eq!(sharing.ipc_get(0x1000), CUDA_ERROR_NOT_INITIALIZED);
    assert_eq!(
        sharing.ipc_open(IpcMemHandle { reserved: [0; 64] }),
        CUDA_ERROR_NOT_INITIALIZED
    );
    let vmm = Vmm::open();
    let g = GRANULARITY;

    // Only the POSIX descriptor type is had, and only from memory asking for it.
    assert_eq!(vmm.create_with(g, WIN32), Err(CUDA_ERROR_NOT_SUPPORTED));
    assert_eq!(
        vmm.create_with(g, POSIX_FD | FABRIC),
        Err(CUDA_ERROR_NOT_SUPPORTED)
    );
    let plain = vmm.create(g).unwrap();
    assert_eq!(
        sharing.export(plain, POSIX_FD, 0),
        Err(CUDA_ERROR_INVALID_VALUE)
    );
    let shared = vmm.create_with(g, POSIX_FD).unwrap();
    assert_eq!(
        sharing.export(shared, POSIX_FD, 1),
        Err(CUDA_ERROR_INVALID_VALUE)
    );
    assert_eq!(
        sharing.export(shared, FABRIC, 0),
        Err(CUDA_ERROR_INVALID_VALUE)
    );
    assert_eq!(
        sharing.export(12345, POSIX_FD, 0),
        Err(CUDA_ERROR_INVALID_VALUE)
    );
    // SAFETY: a NULL destination, refused before any write.
    let rc = unsafe { (sharing.export)(std::ptr::null_mut(), shared, POSIX_FD, 0) };
    assert_eq!(rc, CUDA_ERROR_INVALID_VALUE);
    let fd = sharing.export(shared, POSIX_FD, 0).unwrap();
    assert_ne!(fd_flags(fd) & libc::FD_CLOEXEC, 0, "close-on-exec");

    // Only the double's memfds import, of whole granules of a GPU we see.
    // SAFETY: a NULL destination, refused before any write.
    let rc = unsafe { (sharing.import)(std::ptr::null_mut(), fd as isize as *mut c_void, 1) };
    assert_eq!(rc, CUDA_ERROR_INVALID_VALUE);
    assert_eq!(sharing.import(fd, WIN32), Err(CUDA_ERROR_NOT_SUPPORTED));
    assert_eq!(sharing.import(fd, FABRIC), Err(CUDA_ERROR_NOT_SUPPORTED));
    assert_eq!(sharing.import(fd, 0), Err(CUDA_ERROR_INVALID_VALUE));
    assert_eq!(sharing.import(-1, POSIX_FD), Err(CUDA_ERROR_INVALID_VALUE));
    for (name, size, rc) in [
        (c"someone-else", g, CUDA_ERROR_INVALID_VALUE),
        (c"gpushare-double-vmm-dev0", g / 2, CUDA_ERROR_INVALID_VALUE),
        (c"gpushare-double-vmm-dev0x", g, CUDA_ERROR_INVALID_VALUE),
        (c"gpushare-double-vmm-dev", g, CUDA_ERROR_INVALID_VALUE),
        (c"gpushare-double-vmm-dev7", g, CUDA_ERROR_INVALID_DEVICE),
    ] {
        let other = memfd(name, size);
        assert_eq!(sharing.import(other, POSIX_FD), Err(rc), "{name:?}");
        close(other);
    }
    let imported = sharing.import(fd, POSIX_FD).unwrap();
    assert_ne!(imported, shared);
    assert_ne!(fd_flags(fd), -1, "the caller keeps its descriptor");
    close(fd);

    // Legacy IPC: no handle is made, so none opens or closes.
    let va = vmm.reserve(g, 0);
    // SAFETY: the double's entry points, with valid arguments.
    unsafe {
        assert_eq!((vmm.map)(va, g, 0, shared, 0), CUDA_SUCCESS);
        assert_eq!(sharing.ipc_get(va), CUDA_ERROR_INVALID_VALUE, "VMM memory");
        assert_eq!(sharing.ipc_get(0x1000), CUDA_ERROR_NOT_SUPPORTED);
        assert_eq!(sharing.ipc_get(0), CUDA_ERROR_INVALID_VALUE);
        assert_eq!(
            (sharing.ipc_get)(std::ptr::null_mut(), 0x1000),
            CUDA_ERROR_INVALID_VALUE
        );
        let mut handle = IpcMemHandle { reserved: [0; 64] };
        handle.reserved[0] = 1;
        assert_eq!(sharing.ipc_open(handle), CUDA_ERROR_INVALID_VALUE);
        assert_eq!((sharing.ipc_close)(va), CUDA_ERROR_INVALID_VALUE);
        assert_eq!((vmm.unmap)(va, g), CUDA_SUCCESS);
        for handle in [plain, shared, imported] {
            assert_eq!((vmm.release)(handle), CUDA_SUCCESS);
        }
    }
}

#[test]
fn imported_memory_outlives_its_exporter_uncharged() {
    if !in_fresh_process("imported_memory_outlives_its_exporter_uncharged", &[]) {
        return;
    }
    let sharing = Sharing::open();
    let vmm = Vmm::open();
    let size = 2 * GRANULARITY;
    let before = vmm.free();
    let exported = vmm.create_with(size, POSIX_FD).unwrap();
    let fd = sharing.export(exported, POSIX_FD, 0).unwrap();
    let imported = sharing.import(fd, POSIX_FD).unwrap();
    close(fd);
    assert_eq!(vmm.free(), before - size, "charged once, to the exporter");
    let (va, other) = (vmm.reserve(size, 0), vmm.reserve(size, 0));
    let (first, second) = (pattern(size, 1), pattern(size, 2));
    // SAFETY: the double's entry points, with valid arguments.
    unsafe {
        assert_eq!((vmm.map)(va, size, 0, exported, 0), CUDA_SUCCESS);
        assert_eq!((vmm.map)(other, size, 0, imported, 0), CUDA_SUCCESS);
        assert_eq!(vmm.access(va, size, READ_WRITE), CUDA_SUCCESS);
        assert_eq!(vmm.access(other, size, READ_WRITE), CUDA_SUCCESS);
        assert_eq!(vmm.write(va, &first), CUDA_SUCCESS);
        assert_eq!(vmm.read(other, size), Ok(first.clone()), "the same bytes");
        assert_eq!(vmm.write(other + 4096, &second[..64]), CUDA_SUCCESS);
        assert_eq!(vmm.read(va + 4096, 64), Ok(second[..64].to_vec()));
        assert_eq!(
            vmm.attribute(CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, other),
            0,
            "the exporter's GPU"
        );

        // Imported memory exports again, and its imports are not charged.
        let again = sharing.export(imported, POSIX_FD, 0).unwrap();
        let twice = sharing.import(again, POSIX_FD).unwrap();
        close(again);
        assert_eq!((vmm.release)(twice), CUDA_SUCCESS);
        assert_eq!(vmm.free(), before - size);

        // The exporter lets go: its charge goes with its last mapping.
        assert_eq!((vmm.release)(exported), CUDA_SUCCESS);
        assert_eq!(vmm.free(), before - size, "still mapped");
        assert_eq!((vmm.unmap)(va, size), CUDA_SUCCESS);
        assert_eq!(vmm.free(), before, "the exporter's charge is gone");
        assert_eq!(
            (vmm.map)(va, size, 0, exported, 0),
            CUDA_ERROR_INVALID_HANDLE
        );
        let mut head = first[..4096].to_vec();
        head.extend_from_slice(&second[..64]);
        assert_eq!(
            vmm.read(other, 4096 + 64),
            Ok(head),
            "the importer keeps the bytes"
        );

        // The importer's references and mapping, as for created memory.
        let mut retained = 0;
        let rc = (vmm.retain_handle)(&mut retained, (other + 8) as *mut c_void);
        assert_eq!(rc, CUDA_SUCCESS);
        assert_eq!(retained, imported);
        assert_eq!((vmm.release)(imported), CUDA_SUCCESS);
        assert_eq!((vmm.release)(imported), CUDA_SUCCESS);
        assert_eq!((vmm.release)(imported), CUDA_ERROR_INVALID_VALUE);
        assert_eq!(vmm.read(other, 8), Ok(first[..8].to_vec()), "still mapped");
        assert_eq!((vmm.unmap)(other, size), CUDA_SUCCESS);
        assert_eq!(
            (vmm.map)(other, size, 0, imported, 0),
            CUDA_ERROR_INVALID_HANDLE,
            "gone with its last mapping"
        );
        assert_eq!(vmm.free(), before);
    }
}
