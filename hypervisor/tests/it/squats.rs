//! Squats at the names the daemon owns (`/dev/shm/gpushare-pod-<pod>`, the
//! ledger, and `/dev/shm/gpushare-limits-<pod>`, the limits), planted by
//! another local user before the daemon configures the pod: links (to a
//! file or a directory outside `/dev/shm`) and directories (empty or not)
//! are replaced at the first try without being followed, and a pod left
//! out by a squat the daemon may not remove is served once the squat goes,
//! without a SIGHUP.

use crate::common;

use std::io::Read;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use common::daemon::{Killed, listening, serve};
use common::*;
use gpushare_utils::limits::PodLimits;
use gpushare_utils::shm::Trust;
use system_tests::probes::as_uid;

/// The pods' uid (the daemon's `region_uid`).
const PODS_UID: u32 = 65534;
/// A local user who is not a pod: the squatter.
const STRANGER_UID: u32 = 65533;
const SHM: &str = "/dev/shm";

/// Planting as another uid needs `setpriv` run by root.
fn is_root() -> bool {
    // SAFETY: geteuid has no preconditions and cannot fail.
    let root = unsafe { libc::geteuid() } == 0;
    if !root {
        eprintln!("skipped: planting squats as another uid needs root");
    }
    root
}

/// Runs the shell `script` as `uid` (its group too, no supplementary
/// groups); panics if it fails.
fn shell_as(uid: u32, script: &str) {
    let mut shell = Command::new("sh");
    shell.args(["-ec", script]);
    let status = as_uid(&shell, uid).status().expect("setpriv runs");
    assert!(status.success(), "as uid {uid}: {script}");
}

/// What a squat may point at: a file and a directory (with a file in it)
/// outside `/dev/shm`, which must come through untouched. Removed when
/// dropped.
struct Outside {
    dir: PathBuf,
}

impl Outside {
    const TEXT: &str = "keep me";

    fn new() -> Self {
        let dir = std::env::temp_dir().join(unique("outside"));
        std::fs::create_dir_all(dir.join("dir")).expect("outside dir");
        std::fs::write(dir.join("file"), Self::TEXT).expect("outside file");
        std::fs::write(dir.join("dir").join("inner"), Self::TEXT).expect("inner file");
        Self { dir }
    }

    fn file(&self) -> PathBuf {
        self.dir.join("file")
    }

    fn directory(&self) -> PathBuf {
        self.dir.join("dir")
    }

    fn assert_untouched(&self) {
        for file in [self.file(), self.directory().join("inner")] {
            assert_eq!(
                std::fs::read_to_string(&file).ok().as_deref(),
                Some(Self::TEXT),
                "{} followed or removed",
                file.display()
            );
        }
        let entries = std::fs::read_dir(self.directory())
            .expect("outside dir")
            .count();
        assert_eq!(entries, 1, "the directory a link pointed at is as it was");
    }
}

impl Drop for Outside {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// What a squatter puts at a name.
#[derive(Debug, Clone, Copy)]
enum Squat {
    LinkToFile,
    LinkToDirectory,
    EmptyDirectory,
    /// A directory holding a file, a directory and links out of `/dev/shm`.
    FullDirectory,
}

impl Squat {
    const ALL: [Squat; 4] = [
        Squat::LinkToFile,
        Squat::LinkToDirectory,
        Squat::EmptyDirectory,
        Squat::FullDirectory,
    ];

    /// Plants it at `/dev/shm/<name>` as `uid`.
    fn plant(self, name: &str, outside: &Outside, uid: u32) {
        let at = format!("{SHM}/{name}");
        let (file, dir) = (outside.file(), outside.directory());
        let script = match self {
            Squat::LinkToFile => format!("ln -s '{}' '{at}'", file.display()),
            Squat::LinkToDirectory => format!("ln -s '{}' '{at}'", dir.display()),
            Squat::EmptyDirectory => format!("mkdir '{at}'"),
            Squat::FullDirectory => format!(
                "mkdir -p '{at}/sub/deeper' && echo x > '{at}/sub/f' && echo y > '{at}/g' \
                 && ln -s '{}' '{at}/to-dir' && ln -s '{}' '{at}/sub/to-file'",
                dir.display(),
                file.display()
            ),
        };
        shell_as(uid, &script);
    }
}

/// Which of a pod's names.
#[derive(Debug, Clone, Copy)]
enum Object {
    Ledger,
    Limits,
}

impl Object {
    fn name(self, pod: &str) -> String {
        match self {
            Object::Ledger => format!("gpushare-pod-{pod}"),
            Object::Limits => PodLimits::name_of(pod),
        }
    }
}

/// `/dev/shm` entries whose name holds one of `pods` (the objects, and
/// anything a squat was moved aside as).
fn entries_of(pods: &[String]) -> Vec<PathBuf> {
    std::fs::read_dir(SHM)
        .expect("/dev/shm")
        .filter_map(Result::ok)
        .filter(|e| {
            let name = e.file_name().to_string_lossy().into_owned();
            pods.iter().any(|p| name.contains(p.as_str()))
        })
        .map(|e| e.path())
        .collect()
}

/// Leaves nothing of `pods` in `/dev/shm` when dropped (after the daemon
/// and its regions): squats a failed test left, moved-aside trees.
struct NothingLeft(Vec<String>);

impl Drop for NothingLeft {
    fn drop(&mut self) {
        for path in entries_of(&self.0) {
            let _ = std::fs::remove_file(&path).or_else(|_| std::fs::remove_dir_all(&path));
        }
    }
}

/// Whether `/dev/shm/<name>` is a regular file owned by `uid` that neither
/// group nor others may write.
fn is_object_of(name: &str, uid: u32) -> Result<(), String> {
    let meta = std::fs::symlink_metadata(Path::new(SHM).join(name)).map_err(|e| e.to_string())?;
    if !meta.file_type().is_file() || meta.uid() != uid || meta.mode() & 0o022 != 0 {
        return Err(format!(
            "{name}: {:?}, uid {}, mode {:o}",
            meta.file_type(),
            meta.uid(),
            meta.mode()
        ));
    }
    Ok(())
}

fn pods_toml(pods: &[String]) -> String {
    pods.iter()
        .map(|p| pod_toml(p, &["index = 0\nmemory = \"1g\""]))
        .collect()
}

#[test]
fn links_and_directories_at_a_pods_names_are_replaced_without_being_followed() {
    if !is_root() {
        return;
    }
    let outside = Outside::new();
    let mut pods = Vec::new();
    for squat in Squat::ALL {
        for object in [Object::Ledger, Object::Limits] {
            let pod = unique(&format!("sq{}{}", squat as u8, object as u8));
            squat.plant(&object.name(&pod), &outside, STRANGER_UID);
            pods.push(pod);
        }
    }
    let _nothing_left = NothingLeft(pods.clone());
    let names: Vec<&str> = pods.iter().map(String::as_str).collect();
    let h = Harness::start(
        &format!(
            "region_uid = {PODS_UID}\nregion_gid = {PODS_UID}\n{}",
            pods_toml(&pods)
        ),
        1,
        &names,
    );
    // Served from the start: each squat replaced at the first try, not
    // waited out.
    let status = h.hv.hypervisor().status();
    let served: Vec<&str> = status.pods.iter().map(|p| p.id.as_str()).collect();
    for pod in &pods {
        assert!(served.contains(&pod.as_str()), "{pod} left out: {served:?}");
        is_object_of(&PodLimits::name_of(pod), 0).expect("the daemon's limits");
        is_object_of(&format!("gpushare-pod-{pod}"), PODS_UID).expect("the daemon's ledger");
        let limits = PodLimits::open_read_only(pod, &Trust::root_or(None)).expect("limits open");
        let quota = limits
            .find(&gpu(0))
            .map(|g| g.quota.load(std::sync::atomic::Ordering::Acquire));
        assert_eq!(quota, Some(1 << 30), "{pod}: its limits are published");
        register_ok(&h.url(), pod);
    }
    outside.assert_untouched();
    drop(h);
    // The moved-aside trees go too, in the background.
    assert!(
        wait_for(Duration::from_secs(5), || entries_of(&pods).is_empty()),
        "left in /dev/shm: {:?}",
        entries_of(&pods)
    );
    outside.assert_untouched();
}

/// `hypervisor serve` run as `uid`, its log (at info) in a file; killed
/// when dropped.
struct Daemon {
    child: Killed,
    addr: String,
    log: PathBuf,
}

impl Daemon {
    fn start(config: &ConfigFile, uid: u32) -> Self {
        let log = config.dir.join("daemon.log");
        let mut serve = serve(config);
        serve.env("HYPERVISOR_LOG", "info");
        let mut command = as_uid(&serve, uid);
        command.stderr(std::fs::File::create(&log).expect("log file"));
        let (child, addr) = listening(command);
        Self { child, addr, log }
    }

    fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// The ids of the pods its status shows.
    fn served(&self) -> Vec<String> {
        let (code, body) = call("GET", &format!("{}/api/v1/status", self.url()), None, None);
        assert_eq!(code, 200, "{body}");
        let status: serde_json::Value = serde_json::from_str(&body).expect("status JSON");
        status["pods"]
            .as_array()
            .expect("pods")
            .iter()
            .filter_map(|p| p["id"].as_str().map(str::to_owned))
            .collect()
    }

    /// Stops it; its log.
    fn stop(self) -> String {
        drop(self.child);
        let mut text = String::new();
        let _ = std::fs::File::open(&self.log).and_then(|mut f| f.read_to_string(&mut text));
        text
    }
}

#[test]
fn a_pod_left_out_by_a_squat_it_may_not_remove_is_served_once_the_squat_goes() {
    if !is_root() {
        return;
    }
    let outside = Outside::new();
    // The daemon runs as the pods' uid: a stranger's entries in the sticky
    // /dev/shm are not its to remove.
    let (a, b) = (unique("lo-a"), unique("lo-b"));
    let pods = vec![a.clone(), b.clone()];
    let _nothing_left = NothingLeft(pods.clone());
    let _regions = Regions(pods.clone());
    Squat::LinkToFile.plant(&Object::Ledger.name(&a), &outside, STRANGER_UID);
    Squat::FullDirectory.plant(&Object::Limits.name(&b), &outside, STRANGER_UID);
    let config = ConfigFile::new(&pods_toml(&pods));
    let daemon = Daemon::start(&config, PODS_UID);
    assert!(daemon.served().is_empty(), "both pods left out");
    let (code, body) = register(&daemon.url(), &a, &token_of(&a), std::process::id());
    assert_ne!(code, 200, "a pod left out takes no registration: {body}");
    // Several retries fail the same way.
    std::thread::sleep(Duration::from_millis(2500));
    assert!(daemon.served().is_empty(), "both pods still left out");
    shell_as(
        STRANGER_UID,
        &format!(
            "rm '{SHM}/{}' && rm -r '{SHM}/{}'",
            Object::Ledger.name(&a),
            Object::Limits.name(&b)
        ),
    );
    let gone = Instant::now();
    assert!(
        wait_for(Duration::from_secs(5), || daemon.served().len() == 2),
        "served: {:?}",
        daemon.served()
    );
    let waited = gone.elapsed();
    assert!(waited < Duration::from_secs(3), "served {waited:?} after");
    for pod in &pods {
        is_object_of(&PodLimits::name_of(pod), PODS_UID).expect("the daemon's limits");
        register_ok(&daemon.url(), pod);
    }
    outside.assert_untouched();
    let log = daemon.stop();
    for pod in &pods {
        for said in ["pod left out", "pod served after being left out"] {
            let lines = log
                .lines()
                .filter(|l| l.contains(&format!("pod={pod} ")) && l.contains(said))
                .count();
            assert_eq!(lines, 1, "{pod}: {said:?} once, not at every try:\n{log}");
        }
    }
}
