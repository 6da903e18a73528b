//! The control plane every test of one process shares, and the folders of
//! control planes whose process was killed.
//!
//! Its components are children of a thread that lives as long as the
//! process, since the kernel kills them when the thread that started them
//! ends (their parent-death signal): a test's thread, which libtest ends
//! with the test, cannot be it. libtest leaves through
//! `std::process::exit`, which runs `atexit` handlers but no destructor of
//! a static: a handler stops the components and removes the folder then.
//! A process killed outright runs no handler; the kernel still kills its
//! components, and the next control plane started removes its folder.

use std::path::Path;

use tokio::sync::OnceCell;

use crate::{ControlPlane, Error};

/// The shared control plane, once started.
static SHARED: OnceCell<ControlPlane> = OnceCell::const_new();

/// What every control plane's folder name starts with.
const FOLDER: &str = "gpushare-control-plane-pid";

impl ControlPlane {
    /// The control plane shared by every test of this process that can
    /// share one: started on first use (a failed start is tried again by
    /// the next caller), stopped and its folder removed when the process
    /// exits. Its users keep to objects of their own (a namespace, a Node)
    /// and delete them when done.
    pub async fn shared() -> Result<&'static Self, Error> {
        SHARED.get_or_try_init(start_shared).await
    }
}

/// Starts the control plane on a thread of its own that never ends, and
/// has it stopped at exit.
async fn start_shared() -> Result<ControlPlane, Error> {
    let io = |what: &str, source| Error::Io {
        what: what.to_owned(),
        source,
    };
    let (sender, receiver) = tokio::sync::oneshot::channel();
    std::thread::Builder::new()
        .name("control-plane".to_owned())
        .spawn(move || {
            let started = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .map_err(|e| io("build the control plane's runtime", e))
                .and_then(|runtime| runtime.block_on(ControlPlane::start()));
            let running = started.is_ok();
            // The caller gone (its test ended), the plane is dropped here.
            let delivered = sender.send(started).is_ok();
            // Its components die with this thread.
            if running && delivered {
                loop {
                    std::thread::park();
                }
            }
        })
        .map_err(|e| io("start the control plane's thread", e))?;
    let plane = receiver.await.map_err(|_| {
        io(
            "start the control plane",
            std::io::Error::other("its thread ended"),
        )
    })??;
    // SAFETY: `stop_at_exit` is an `extern "C" fn()` that never unwinds.
    if unsafe { libc::atexit(stop_at_exit) } != 0 {
        return Err(io(
            "have the control plane stopped at exit",
            std::io::Error::last_os_error(),
        ));
    }
    Ok(plane)
}

/// Stops the shared control plane and removes its folder (an `atexit`
/// handler: it must not unwind).
extern "C" fn stop_at_exit() {
    if let Some(plane) = SHARED.get() {
        let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| plane.stop()));
    }
}

/// The start of this process's control planes' folder names.
pub(crate) fn folder_prefix() -> String {
    format!("{FOLDER}{}-", std::process::id())
}

/// Removes the folders of control planes whose process is gone.
pub(crate) fn remove_abandoned_folders() {
    let Ok(entries) = std::fs::read_dir(std::env::temp_dir()) else {
        return;
    };
    for entry in entries.flatten() {
        let name = entry.file_name();
        let pid = name
            .to_str()
            .and_then(|n| n.strip_prefix(FOLDER))
            .and_then(|rest| rest.split('-').next())
            .and_then(|pid| pid.parse::<u32>().ok());
        if let Some(pid) = pid
            && !Path::new("/proc").join(pid.to_string()).exists()
        {
            // Another user's, or removed meanwhile: not ours to mind.
            let _ = std::fs::remove_dir_all(entry.path());
        }
    }
}
