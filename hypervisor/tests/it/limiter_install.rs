//! Upgrading the limiter on a node never rewrites a file a running process
//! maps (`hypervisor limiter install`, as the DaemonSet's init container
//! runs it): version A installed, a process maps it, version B installed;
//! A is still there, unchanged, and the stable name is B; once the process
//! has ended, A is collected.
//!
//! The processes looked at are the test's own mapper, through a `/proc` of
//! the test's (a link to the real entry): the sandboxes the tests run in may
//! hide other processes' maps, and a maps file that cannot be read stops a
//! collection (the daemon and the init container can read them all).

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, Command, Stdio};

use system_tests::scratch::Scratch;

fn hypervisor(args: &[&str]) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_hypervisor"))
        .args(args)
        .output()
        .unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "hypervisor {args:?}: {text}");
    text
}

fn install(source: &Path, link: &Path, version: &str, proc: &Path) -> String {
    hypervisor(&[
        "limiter",
        "install",
        "--source",
        source.to_str().unwrap(),
        "--link",
        link.to_str().unwrap(),
        "--version",
        version,
        "--proc",
        proc.to_str().unwrap(),
    ])
}

fn collect(link: &Path, proc: &Path) -> String {
    hypervisor(&[
        "limiter",
        "collect",
        "--link",
        link.to_str().unwrap(),
        "--proc",
        proc.to_str().unwrap(),
    ])
}

/// A process that maps `file` read-only (its descriptor closed: only the
/// mapping holds it) until its stdin closes.
struct Mapper(Child);

impl Mapper {
    /// Starts the process and shows it under `proc` (`proc/<pid>`, a link to
    /// the real `/proc/<pid>`, which disappears with it).
    fn start(file: &Path, proc: &Path) -> Self {
        let script = "import mmap, sys\n\
             f = open(sys.argv[1], 'rb')\n\
             m = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)\n\
             f.close()\n\
             print('mapped', flush=True)\n\
             sys.stdin.read()\n";
        let mut child = Command::new("python3")
            .args(["-c", script])
            .arg(file)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .unwrap_or_else(|e| panic!("cannot run python3 (it maps the file): {e}"));
        let mut line = String::new();
        BufReader::new(child.stdout.as_mut().unwrap())
            .read_line(&mut line)
            .unwrap();
        assert_eq!(line.trim(), "mapped");
        std::fs::create_dir_all(proc).unwrap();
        let pid = child.id().to_string();
        std::os::unix::fs::symlink(Path::new("/proc").join(&pid), proc.join(&pid)).unwrap();
        Self(child)
    }

    fn end(mut self) {
        drop(self.0.stdin.take());
        assert!(self.0.wait().unwrap().success());
    }
}

impl Drop for Mapper {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn versions(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with("libcuda_limiter-"))
        .collect();
    names.sort();
    names
}

#[test]
fn an_upgrade_keeps_the_mapped_version_until_no_process_maps_it() {
    let scratch = Scratch::new("limiter-upgrade");
    let lib = scratch.dir.join("lib");
    let link = lib.join("libcuda_limiter.so");
    let (a, b) = (scratch.dir.join("a.so"), scratch.dir.join("b.so"));
    std::fs::write(&a, b"version A of the library").unwrap();
    std::fs::write(&b, b"version B of the library, longer").unwrap();
    let proc = scratch.dir.join("proc");
    std::fs::create_dir_all(&proc).unwrap();

    let said = install(&a, &link, "1.0.0", &proc);
    assert!(said.contains("switched"), "{said}");
    let a_name = std::fs::read_link(&link).unwrap();
    let a_file = lib.join(&a_name);
    assert!(
        a_name
            .to_str()
            .unwrap()
            .starts_with("libcuda_limiter-1.0.0-"),
        "{a_name:?}"
    );
    assert!(
        a_name.is_relative(),
        "the link works from the host and the container"
    );
    assert_eq!(std::fs::read(&link).unwrap(), b"version A of the library");

    let mapper = Mapper::start(&link, &proc);
    let said = install(&b, &link, "1.1.0", &proc);
    assert!(
        said.contains(&format!("kept {}", a_file.display())),
        "{said}"
    );
    let b_name = std::fs::read_link(&link).unwrap();
    assert!(
        b_name
            .to_str()
            .unwrap()
            .starts_with("libcuda_limiter-1.1.0-")
    );
    assert_eq!(
        std::fs::read(&link).unwrap(),
        b"version B of the library, longer"
    );
    // A is there and was never written to.
    assert_eq!(std::fs::read(&a_file).unwrap(), b"version A of the library");
    assert_eq!(versions(&lib).len(), 2, "{:?}", versions(&lib));

    // Installing B again changes nothing, and A stays while it is mapped.
    let said = collect(&link, &proc);
    assert!(said.contains("kept"), "{said}");
    assert!(a_file.exists());
    let said = install(&b, &link, "1.1.0", &proc);
    assert!(said.contains("unchanged"), "{said}");

    mapper.end();
    let said = collect(&link, &proc);
    assert!(
        said.contains(&format!("removed {}", a_file.display())),
        "{said}"
    );
    assert_eq!(
        versions(&lib),
        [b_name.to_str().unwrap().to_owned()],
        "only B is left"
    );
    assert_eq!(
        std::fs::read(&link).unwrap(),
        b"version B of the library, longer"
    );
    assert!(
        !lib.read_dir()
            .unwrap()
            .any(|e| e.unwrap().file_name().to_string_lossy().starts_with('.')),
        "no temporary file left"
    );
}

#[test]
fn the_first_install_retires_a_copied_library_without_writing_to_it() {
    // Earlier releases `cp`'d the library over the stable name.
    let scratch = Scratch::new("limiter-legacy");
    let lib = scratch.dir.join("lib");
    std::fs::create_dir_all(&lib).unwrap();
    let link = lib.join("libcuda_limiter.so");
    std::fs::write(&link, b"a copied library").unwrap();
    let proc = scratch.dir.join("proc");
    let mapper = Mapper::start(&link, &proc);
    let source = scratch.dir.join("new.so");
    std::fs::write(&source, b"the new library").unwrap();
    install(&source, &link, "2.0.0", &proc);
    assert!(std::fs::symlink_metadata(&link).unwrap().is_symlink());
    assert_eq!(std::fs::read(&link).unwrap(), b"the new library");
    // The mapped copy is an unlinked inode now: what it maps is unchanged.
    let pid = mapper.0.id();
    let maps = std::fs::read_to_string(format!("/proc/{pid}/maps")).unwrap();
    assert!(
        maps.lines()
            .any(|l| l.contains("libcuda_limiter.so") && l.ends_with("(deleted)")),
        "{maps}"
    );
    mapper.end();
}
