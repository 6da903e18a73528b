//! The checkpoint API across processes: this test process (in the role of
//! the node daemon) calls the double's `cuCheckpointProcess*` on a running
//! `ckptprobe`, and reads the probe's control block (layout in
//! `double/checkpoint.c`) to see where its memory is.
#![cfg(all(target_arch = "x86_64", target_os = "linux"))]

use std::ffi::c_int;
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use crate::common;

use common::checkpoint_api::{
    Api, CHECKPOINTED, GpuPair, LOCKED, LockArgs, RUNNING, RestoreArgs, checkpoint_dir, uuid,
};
use common::in_process::{CUDA_ERROR_ILLEGAL_STATE, CUDA_ERROR_INVALID_VALUE};
use common::interactive::Interactive;
use common::{CTX, CUDA_SUCCESS, GIB, MIB};
use gpushare_examples::{CHECKPOINT_DIR_VAR as DIR_VAR, DEFAULT_TOTAL, program};

const CUDA_ERROR_NOT_SUPPORTED: c_int = 801;
const CUDA_ERROR_TIMEOUT: c_int = 909;
const CUDA_ERROR_UNKNOWN: c_int = 999;
/// How long a reply that must not come is waited for.
const QUIET: Duration = Duration::from_millis(300);
/// How long a reply that must come may take.
const REPLY: Duration = Duration::from_secs(10);

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

// ---------------------------------------------------------------- the block

/// The tests' part of a control block.
#[derive(Debug)]
struct Block {
    magic: [u8; 8],
    version: u32,
    state: u32,
    host_bytes: u64,
    device_bytes: [u64; 16],
    gpu: [u32; 16],
    pid: i32,
    restore_tid: i32,
    moved_bytes: [u64; 16],
    devices: u32,
}

fn block(dir: &Path, pid: i32) -> Block {
    let bytes = std::fs::read(dir.join(pid.to_string())).expect("the control block");
    assert_eq!(bytes.len(), 4096);
    let u32_at = |at: usize| u32::from_le_bytes(bytes[at..at + 4].try_into().unwrap());
    let u64_at = |at: usize| u64::from_le_bytes(bytes[at..at + 8].try_into().unwrap());
    Block {
        magic: bytes[..8].try_into().unwrap(),
        version: u32_at(8),
        state: u32_at(12),
        host_bytes: u64_at(16),
        device_bytes: std::array::from_fn(|i| u64_at(24 + 8 * i)),
        gpu: std::array::from_fn(|i| u32_at(152 + 4 * i)),
        pid: u32_at(216) as i32,
        restore_tid: u32_at(220) as i32,
        moved_bytes: std::array::from_fn(|i| u64_at(232 + 8 * i)),
        devices: u32_at(360),
    }
}

// ---------------------------------------------------------------- the probe

/// Starts `ckptprobe size` with its control block in `dir`, once it is
/// ready.
fn start(dir: &Path, size: &str, env: &[(&str, &str)]) -> Interactive {
    let mut cmd = Command::new(program("ckptprobe"));
    cmd.arg(size).env(DIR_VAR, dir).envs(env.iter().copied());
    let probe = Interactive::spawn(cmd, REPLY);
    probe.ready();
    probe
}

/// Waits until /proc says the process `pid` is in `state` (a letter of
/// /proc/PID/stat: 'T' stopped, 'Z' zombie).
fn wait_for_state(pid: i32, state: char) {
    let start = Instant::now();
    loop {
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).expect("/proc/PID/stat");
        let now = stat
            .rsplit_once(") ")
            .and_then(|(_, rest)| rest.chars().next());
        if now == Some(state) {
            return;
        }
        assert!(
            start.elapsed() < REPLY,
            "{pid} never reached {state}: {stat}"
        );
        std::thread::sleep(Duration::from_millis(2));
    }
}

fn gib(n: u64) -> String {
    format!("{}", n * GIB)
}

// ---------------------------------------------------------------- tests

#[test]
fn lock_holds_calls_while_checkpoint_and_restore_move_the_memory() {
    let Some(dir) = checkpoint_dir("lock_holds_calls_while_checkpoint_and_restore_move_the_memory")
    else {
        return;
    };
    let api = Api::open();
    let mut probe = start(&dir, "1g", &[]);
    let pid = probe.pid();
    let held = CTX + GIB;

    let b = block(&dir, pid);
    assert_eq!(&b.magic, b"GSDCKPT1");
    assert_eq!((b.version, b.state, b.pid, b.devices), (1, RUNNING, pid, 1));
    assert_eq!((b.device_bytes[0], b.host_bytes), (held, 0));
    assert_eq!((b.gpu[0], b.gpu[1]), (0, u32::MAX));
    assert_eq!(api.state(pid), Ok(RUNNING));
    let tid = api.tid(pid).expect("the restore thread");
    assert_eq!(tid, b.restore_tid);
    assert_ne!(tid, pid);
    assert!(Path::new(&format!("/proc/{pid}/task/{tid}")).exists());

    assert_eq!(api.lock(pid), CUDA_SUCCESS);
    assert_eq!(api.state(pid), Ok(LOCKED));
    probe.send("info");
    assert_eq!(probe.reply(QUIET), None, "a locked process's call waits");

    assert_eq!(api.checkpoint(pid), CUDA_SUCCESS);
    assert_eq!(api.state(pid), Ok(CHECKPOINTED));
    let b = block(&dir, pid);
    assert_eq!(
        (b.state, b.device_bytes[0], b.host_bytes),
        (CHECKPOINTED, 0, held)
    );
    assert_eq!(b.moved_bytes[0], held);

    assert_eq!(api.restore(pid), CUDA_SUCCESS);
    assert_eq!(api.state(pid), Ok(LOCKED));
    let b = block(&dir, pid);
    assert_eq!(
        (b.device_bytes[0], b.host_bytes, b.moved_bytes[0]),
        (held, 0, 0)
    );
    assert_eq!(b.gpu[0], 0, "no pairs: the same GPU");
    assert_eq!(probe.reply(QUIET), None, "still locked");

    assert_eq!(api.unlock(pid), CUDA_SUCCESS);
    assert_eq!(api.state(pid), Ok(RUNNING));
    assert_eq!(
        probe.reply(REPLY).as_deref(),
        Some(format!("info 0 free={} total={DEFAULT_TOTAL}", DEFAULT_TOTAL - held).as_str()),
        "the waiting call goes on with its normal result"
    );
    for command in ["copy", "launch", "sync"] {
        assert_eq!(probe.ask(command), format!("{command} 0"));
    }
    assert_eq!(probe.ask("alloc 1m"), "alloc 0");
    assert_eq!(block(&dir, pid).device_bytes[0], held + MIB);
}

#[test]
fn every_call_waits_for_the_unlock() {
    let Some(dir) = checkpoint_dir("every_call_waits_for_the_unlock") else {
        return;
    };
    let api = Api::open();
    let mut probe = start(&dir, "1m", &[]);
    let pid = probe.pid();
    for command in ["alloc 1m", "copy", "launch", "sync", "uuid 0"] {
        assert_eq!(api.lock(pid), CUDA_SUCCESS);
        probe.send(command);
        assert_eq!(probe.reply(QUIET), None, "{command} while locked");
        assert_eq!(api.unlock(pid), CUDA_SUCCESS);
        let reply = probe.reply(REPLY).expect("a reply after the unlock");
        assert!(
            reply.starts_with(&format!("{} 0", command.split(' ').next().unwrap())),
            "{reply}"
        );
    }
}

#[test]
fn calls_out_of_order_are_illegal_state() {
    let Some(dir) = checkpoint_dir("calls_out_of_order_are_illegal_state") else {
        return;
    };
    let api = Api::open();
    let probe = start(&dir, "1m", &[]);
    let pid = probe.pid();
    // Running.
    assert_eq!(api.checkpoint(pid), CUDA_ERROR_ILLEGAL_STATE);
    assert_eq!(api.restore(pid), CUDA_ERROR_ILLEGAL_STATE);
    assert_eq!(api.unlock(pid), CUDA_ERROR_ILLEGAL_STATE);
    // Locked.
    assert_eq!(api.lock(pid), CUDA_SUCCESS);
    assert_eq!(api.lock(pid), CUDA_ERROR_ILLEGAL_STATE);
    assert_eq!(api.restore(pid), CUDA_ERROR_ILLEGAL_STATE);
    // Checkpointed.
    assert_eq!(api.checkpoint(pid), CUDA_SUCCESS);
    assert_eq!(api.checkpoint(pid), CUDA_ERROR_ILLEGAL_STATE);
    assert_eq!(api.unlock(pid), CUDA_ERROR_ILLEGAL_STATE);
    assert_eq!(api.lock(pid), CUDA_ERROR_ILLEGAL_STATE);
    assert_eq!(api.state(pid), Ok(CHECKPOINTED));
    // Restored: locked again.
    assert_eq!(api.restore(pid), CUDA_SUCCESS);
    assert_eq!(api.restore(pid), CUDA_ERROR_ILLEGAL_STATE);
    assert_eq!(api.unlock(pid), CUDA_SUCCESS);
    assert_eq!(api.state(pid), Ok(RUNNING));

    // Reserved fields must be zero.
    let args = LockArgs {
        reserved0: 1,
        ..LockArgs::default()
    };
    assert_eq!(api.lock_with(pid, args), CUDA_ERROR_INVALID_VALUE);
    assert_eq!(api.state(pid), Ok(RUNNING));
}

#[test]
fn restore_onto_other_gpus_renames_the_devices() {
    let Some(dir) = checkpoint_dir("restore_onto_other_gpus_renames_the_devices") else {
        return;
    };
    let api = Api::open();
    let mut probe = start(&dir, "2g", &[("GPUSHARE_DOUBLE_DEVICES", "3")]);
    let pid = probe.pid();
    let held = CTX + 2 * GIB;
    assert_eq!(probe.ask("uuid 0"), format!("uuid 0 {}", hex(&uuid(0))));
    assert_eq!(probe.ask("pci 0"), "pci 0 0000:18:00.0");
    assert_eq!(probe.ask("nvml 0"), format!("nvml context=1 bytes={held}"));
    assert_eq!(block(&dir, pid).gpu[..4], [0, 1, 2, u32::MAX]);

    assert_eq!(api.lock(pid), CUDA_SUCCESS);
    assert_eq!(api.checkpoint(pid), CUDA_SUCCESS);
    // Refused, and still checkpointed: a GPU the double does not have, a
    // pair list without the process's GPU 0, a GPU named twice, no pairs
    // behind a count.
    for (pairs, why) in [
        (
            vec![GpuPair {
                old: uuid(0),
                new: uuid(9),
            }],
            "unknown new GPU",
        ),
        (
            vec![GpuPair {
                old: uuid(7),
                new: uuid(1),
            }],
            "unknown old GPU",
        ),
        (
            vec![GpuPair {
                old: uuid(0),
                new: uuid(1),
            }],
            "one GPU onto another alone",
        ),
        (
            vec![
                GpuPair {
                    old: uuid(1),
                    new: uuid(2),
                },
                GpuPair {
                    old: uuid(2),
                    new: uuid(1),
                },
            ],
            "GPU 0 left out",
        ),
        (
            vec![
                GpuPair {
                    old: uuid(0),
                    new: uuid(1),
                },
                GpuPair {
                    old: uuid(0),
                    new: uuid(2),
                },
            ],
            "GPU 0 named twice",
        ),
        (
            vec![
                GpuPair {
                    old: uuid(0),
                    new: uuid(2),
                },
                GpuPair {
                    old: uuid(1),
                    new: uuid(2),
                },
            ],
            "two GPUs onto one",
        ),
    ] {
        assert_eq!(
            api.restore_onto(pid, &pairs),
            CUDA_ERROR_INVALID_VALUE,
            "{why}"
        );
        assert_eq!(api.state(pid), Ok(CHECKPOINTED), "{why}");
    }
    let mut args = RestoreArgs::with(&[]);
    args.pairs = std::ptr::null();
    args.count = 1;
    // SAFETY: the double refuses a count without pairs before reading them.
    let rc = unsafe { (api.restore)(pid, &mut args) };
    assert_eq!(rc, CUDA_ERROR_INVALID_VALUE, "a count without pairs");
    assert_eq!(
        probe.ask("nvml 0"),
        "nvml context=0 bytes=0",
        "NVML sees nothing"
    );

    // The two exchanged, as a move asks.
    let pairs = [
        GpuPair {
            old: uuid(0),
            new: uuid(1),
        },
        GpuPair {
            old: uuid(1),
            new: uuid(0),
        },
    ];
    assert_eq!(api.restore_onto(pid, &pairs), CUDA_SUCCESS);
    let b = block(&dir, pid);
    assert_eq!((b.gpu[0], b.device_bytes[0], b.host_bytes), (1, held, 0));
    assert_eq!(b.gpu[..3], [1, 0, 2]);
    assert_eq!(api.unlock(pid), CUDA_SUCCESS);
    assert_eq!(probe.ask("uuid 0"), format!("uuid 0 {}", hex(&uuid(1))));
    assert_eq!(
        probe.ask("pci 0"),
        "pci 0 0000:18:00.0",
        "the bus read at start, as the driver keeps it"
    );
    assert_eq!(probe.ask("nvml 1"), format!("nvml context=1 bytes={held}"));
    assert_eq!(probe.ask("nvml 0"), "nvml context=0 bytes=0");
    assert_eq!(probe.ask("copy"), "copy 0");
}

#[test]
fn managed_memory_refuses_a_checkpoint_and_stays_locked() {
    let Some(dir) = checkpoint_dir("managed_memory_refuses_a_checkpoint_and_stays_locked") else {
        return;
    };
    let api = Api::open();
    let mut probe = start(&dir, "1m", &[]);
    let pid = probe.pid();
    assert_eq!(probe.ask("managed 4m"), "managed 0");
    let held = block(&dir, pid).device_bytes[0];
    assert_eq!(api.lock(pid), CUDA_SUCCESS);
    assert_eq!(api.checkpoint(pid), CUDA_ERROR_NOT_SUPPORTED);
    assert_eq!(api.state(pid), Ok(LOCKED));
    let b = block(&dir, pid);
    assert_eq!((b.device_bytes[0], b.host_bytes), (held, 0));
    assert_eq!(api.unlock(pid), CUDA_SUCCESS);

    // Without it the checkpoint goes through.
    assert_eq!(probe.ask("freemanaged"), "freemanaged 0");
    assert_eq!(api.lock(pid), CUDA_SUCCESS);
    assert_eq!(api.checkpoint(pid), CUDA_SUCCESS);
    assert_eq!(block(&dir, pid).host_bytes, held - 4 * MIB);
    assert_eq!(api.restore(pid), CUDA_SUCCESS);
    assert_eq!(api.unlock(pid), CUDA_SUCCESS);
}

#[test]
fn a_failed_restore_leaves_it_checkpointed_for_a_retry() {
    let Some(dir) = checkpoint_dir("a_failed_restore_leaves_it_checkpointed_for_a_retry") else {
        return;
    };
    let api = Api::open();
    let probe = start(
        &dir,
        "1g",
        &[("GPUSHARE_DOUBLE_CHECKPOINT_FAIL_RESTORES", "1")],
    );
    let pid = probe.pid();
    assert_eq!(api.lock(pid), CUDA_SUCCESS);
    assert_eq!(api.checkpoint(pid), CUDA_SUCCESS);
    assert_eq!(api.restore(pid), CUDA_ERROR_UNKNOWN);
    assert_eq!(api.state(pid), Ok(CHECKPOINTED));
    let b = block(&dir, pid);
    assert_eq!((b.device_bytes[0], b.host_bytes), (0, CTX + GIB));
    assert_eq!(api.restore(pid), CUDA_SUCCESS);
    assert_eq!(block(&dir, pid).device_bytes[0], CTX + GIB);
    assert_eq!(api.unlock(pid), CUDA_SUCCESS);
}

#[test]
fn moves_take_time_per_gib_and_a_stopped_target_times_out() {
    let Some(dir) = checkpoint_dir("moves_take_time_per_gib_and_a_stopped_target_times_out") else {
        return;
    };
    let api = Api::open();
    // 1 GiB + the context at 400 ms per GiB: about 520 ms each way.
    let probe = start(
        &dir,
        &gib(1),
        &[("GPUSHARE_DOUBLE_CHECKPOINT_US_PER_GIB", "400000")],
    );
    let pid = probe.pid();
    assert_eq!(api.lock(pid), CUDA_SUCCESS);
    std::thread::scope(|scope| {
        let start = Instant::now();
        let checkpoint = scope.spawn(|| api.checkpoint(pid));
        std::thread::sleep(Duration::from_millis(100));
        // Under way: still locked, nothing moved yet.
        assert_eq!(api.state(pid), Ok(LOCKED));
        assert_eq!(block(&dir, pid).host_bytes, 0);
        assert_eq!(checkpoint.join().unwrap(), CUDA_SUCCESS);
        assert!(
            start.elapsed() >= Duration::from_millis(500),
            "{:?}",
            start.elapsed()
        );
    });
    let start = Instant::now();
    assert_eq!(api.restore(pid), CUDA_SUCCESS);
    assert!(start.elapsed() >= Duration::from_millis(500));
    assert_eq!(api.unlock(pid), CUDA_SUCCESS);

    // A target that does not answer: the lock times out and leaves it running.
    // SAFETY: signals to our own child.
    assert_eq!(unsafe { libc::kill(pid, libc::SIGSTOP) }, 0);
    wait_for_state(pid, 'T');
    let start = Instant::now();
    let args = LockArgs {
        timeout_ms: 200,
        ..LockArgs::default()
    };
    assert_eq!(api.lock_with(pid, args), CUDA_ERROR_TIMEOUT);
    let waited = start.elapsed();
    assert!(waited >= Duration::from_millis(200) && waited < Duration::from_secs(2));
    // SAFETY: as above.
    assert_eq!(unsafe { libc::kill(pid, libc::SIGCONT) }, 0);
    assert_eq!(api.state(pid), Ok(RUNNING));
    assert_eq!(api.lock(pid), CUDA_SUCCESS);
    assert_eq!(api.unlock(pid), CUDA_SUCCESS);
}

#[test]
fn dead_and_foreign_pids_fail_at_once() {
    let Some(dir) = checkpoint_dir("dead_and_foreign_pids_fail_at_once") else {
        return;
    };
    let api = Api::open();
    let mut probe = start(&dir, "1m", &[]);
    let pid = probe.pid();
    assert_eq!(api.lock(pid), CUDA_SUCCESS);

    let check_fails_fast = |why: &str| {
        let start = Instant::now();
        assert_eq!(api.state(pid), Err(CUDA_ERROR_INVALID_VALUE), "{why}");
        assert_eq!(api.tid(pid), Err(CUDA_ERROR_INVALID_VALUE), "{why}");
        assert_eq!(api.unlock(pid), CUDA_ERROR_INVALID_VALUE, "{why}");
        assert_eq!(api.lock(pid), CUDA_ERROR_INVALID_VALUE, "{why}");
        assert!(start.elapsed() < Duration::from_secs(1), "{why}");
    };
    // A zombie (killed, not yet reaped), then a reaped pid: the file stays.
    // SAFETY: a signal to our own child.
    assert_eq!(unsafe { libc::kill(pid, libc::SIGKILL) }, 0);
    wait_for_state(pid, 'Z');
    check_fails_fast("zombie");
    probe.wait();
    assert!(dir.join(pid.to_string()).exists());
    check_fails_fast("dead");

    // A live process that is no CUDA process of the double, and no process.
    let own = std::process::id() as i32;
    assert_eq!(api.state(own), Err(CUDA_ERROR_INVALID_VALUE));
    assert_eq!(api.lock(0), CUDA_ERROR_INVALID_VALUE);
    assert_eq!(api.lock(-1), CUDA_ERROR_INVALID_VALUE);
}

#[test]
fn without_the_variable_there_is_no_file_and_no_thread() {
    let Some(dir) = checkpoint_dir("without_the_variable_there_is_no_file_and_no_thread") else {
        return;
    };
    let mut cmd = Command::new(program("ckptprobe"));
    cmd.arg("1m").env_remove(DIR_VAR);
    let probe = Interactive::spawn(cmd, REPLY);
    let ready = probe.line();
    assert!(ready.starts_with("ready"), "{ready}");
    let pid = probe.pid();
    let threads = std::fs::read_dir(format!("/proc/{pid}/task"))
        .unwrap()
        .count();
    assert_eq!(threads, 1, "no service thread");
    assert_eq!(
        std::fs::read_dir(&dir).unwrap().count(),
        0,
        "no control block"
    );
    probe.finish();
}
