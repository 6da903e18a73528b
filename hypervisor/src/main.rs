//! `hypervisor serve` runs the node daemon; `hypervisor status` prints its
//! state as a table; `hypervisor limiter install` puts a limiter library on
//! the host without touching the files running processes map.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context, bail};
use clap::{Parser, Subcommand};
use hypervisor::node::{Node, NodeSpec};
use hypervisor::status_table::render_table;
use hypervisor_config as config;
use hypervisor_core::node_tables::NodeTableNames;
use hypervisor_core::turns::TurnArgs;
use hypervisor_corun::CorunArgs;
use hypervisor_daemon::Options;
use hypervisor_daemon::api::ApiRoute;
use hypervisor_observer::flags::ObserverArgs;
use hypervisor_status::status::Status;
use kube_args::KubeArgs;

mod kube_args;

#[derive(Parser)]
#[command(name = "hypervisor", version, about = "Per-node GPU-sharing daemon")]
struct Cli {
    #[command(subcommand)]
    command: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Run the daemon (log level: HYPERVISOR_LOG=info|debug|…; default warn).
    Serve {
        /// The TOML config file; reloaded on SIGHUP and when it changes. With
        /// --kubernetes, optional and read once for its settings (its pods
        /// are ignored: they come from the prepared claims).
        #[arg(long, required_unless_present = "kubernetes")]
        config: Option<PathBuf>,
        /// Listen address (IP:port), overriding the file's `listen`.
        #[arg(long)]
        listen: Option<SocketAddr>,
        /// Also serve the whole API on this Unix socket (the pods' way in,
        /// with --kubernetes: their CDI specs mount its folder).
        #[arg(long, value_name = "PATH")]
        socket: Option<PathBuf>,
        /// Serve /metrics, /healthz and /readyz alone on this address too
        /// (probes and Prometheus; nothing else of the API is there).
        #[arg(long, value_name = "IP:PORT")]
        metrics_listen: Option<SocketAddr>,
        #[command(flatten)]
        gpus: ObserverArgs,
        #[command(flatten)]
        corun: CorunArgs,
        #[command(flatten)]
        turns: TurnArgs,
        #[command(flatten)]
        kubernetes: Box<KubeArgs>,
    },
    /// Print the daemon's pods, GPUs and workers.
    Status {
        /// The daemon's address.
        #[arg(long, default_value = config::DEFAULT_LISTEN)]
        addr: String,
        /// Print the JSON instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// Swap a pod's device memory to host memory (`out`) or back (`in`),
    /// through the daemon's admin API.
    Swap {
        /// `out` or `in`.
        #[arg(value_parser = ["out", "in"])]
        direction: String,
        /// The pod's id.
        pod: String,
        #[command(flatten)]
        daemon: AdminTarget,
    },
    /// Move a pod to another GPU of the node, through the daemon's admin
    /// API: its processes are checkpointed and restored there, with their
    /// quota and usage.
    Move {
        /// The pod's id.
        pod: String,
        /// The GPU it goes to: its NVML index or UUID.
        #[arg(long)]
        to: String,
        /// The GPU it leaves (needed for a pod on several GPUs).
        #[arg(long)]
        from: Option<String>,
        #[command(flatten)]
        daemon: AdminTarget,
    },
    /// Empty a GPU (one that reports an XID, or is to be serviced): each of
    /// its pods moves to another GPU, or is swapped out where none has room.
    Drain {
        /// The GPU: its NVML index or UUID.
        gpu: String,
        #[command(flatten)]
        daemon: AdminTarget,
    },
    /// Check a config file and print what it says.
    CheckConfig {
        #[arg(long)]
        config: PathBuf,
    },
    /// The limiter library on the host: versioned files, an atomic switch.
    Limiter {
        #[command(subcommand)]
        command: LimiterCmd,
    },
}

/// The daemon an admin command talks to.
#[derive(clap::Args)]
struct AdminTarget {
    /// The daemon's address.
    #[arg(long, default_value = config::DEFAULT_LISTEN)]
    addr: String,
    /// A file holding the admin token (else `GPUSHARE_ADMIN_TOKEN`).
    #[arg(long, value_name = "PATH")]
    admin_token_file: Option<PathBuf>,
}

#[derive(Subcommand)]
enum LimiterCmd {
    /// Write LIBRARY as a file named by version and content hash beside
    /// LINK, switch LINK (a symlink) to it in one rename, then remove the
    /// old versions no process maps.
    Install {
        /// The library to install.
        #[arg(long, value_name = "LIBRARY")]
        source: PathBuf,
        /// The stable name that CDI specs and preload files use.
        #[arg(long, default_value = "/var/lib/gpushare/lib/libcuda_limiter.so")]
        link: PathBuf,
        /// The version in the file name; default: this binary's.
        #[arg(long, default_value = env!("CARGO_PKG_VERSION"))]
        version: String,
        /// The host's /proc (hostPID): which files processes map.
        #[arg(long, default_value = "/proc")]
        proc: PathBuf,
    },
    /// Remove the versions behind LINK that it does not name and that no
    /// process maps.
    Collect {
        #[arg(long, default_value = "/var/lib/gpushare/lib/libcuda_limiter.so")]
        link: PathBuf,
        #[arg(long, default_value = "/proc")]
        proc: PathBuf,
    },
}

fn main() {
    let cli = Cli::parse();
    let result = match cli.command {
        Cmd::Serve {
            config,
            listen,
            socket,
            metrics_listen,
            gpus,
            corun,
            turns,
            kubernetes,
        } => serve(
            config,
            Where {
                listen,
                socket,
                metrics: metrics_listen,
            },
            &gpus,
            &corun,
            &turns,
            &kubernetes,
        ),
        Cmd::Status { addr, json } => status(&addr, json),
        Cmd::Swap {
            direction,
            pod,
            daemon,
        } => admin(&daemon, &format!("swap {direction}"), &[("id", &pod)], None),
        Cmd::Move {
            pod,
            to,
            from,
            daemon,
        } => admin(
            &daemon,
            "move",
            &[("id", &pod)],
            Some(serde_json::json!({ "to": to, "from": from })),
        ),
        Cmd::Drain { gpu, daemon } => admin(&daemon, "drain", &[("gpu", &gpu)], None),
        Cmd::CheckConfig { config } => check_config(&config),
        Cmd::Limiter { command } => limiter(command),
    };
    if let Err(error) = result {
        eprintln!(
            "hypervisor: {}",
            gpushare_utils::logging::one_line(error.as_ref())
        );
        std::process::exit(1);
    }
}

/// Where `serve` listens.
struct Where {
    listen: Option<SocketAddr>,
    socket: Option<PathBuf>,
    metrics: Option<SocketAddr>,
}

fn serve(
    path: Option<PathBuf>,
    at: Where,
    gpus: &ObserverArgs,
    corun: &CorunArgs,
    turns: &TurnArgs,
    kube: &KubeArgs,
) -> anyhow::Result<()> {
    gpushare_utils::logging::init_quieting(
        "HYPERVISOR_LOG",
        hypervisor_kubernetes::QUIET_LOG_TARGETS,
    );
    let mut config = match &path {
        Some(path) => config::load(path)?,
        None => config::parse(
            "",
            std::path::Path::new("(defaults)"),
            std::path::Path::new("."),
        )?,
    };
    // Kubernetes: pods come from the prepared claims, never from the file.
    let config_path = if kube.kubernetes {
        if !config.pods.is_empty() {
            tracing::warn!("--kubernetes: the config file's pods are ignored");
        }
        config.pods.clear();
        None
    } else {
        path
    };
    for warning in config::warnings(&config) {
        tracing::warn!("{warning}");
        eprintln!("hypervisor: warning: {warning}");
    }
    // Room for the runtime, the regions, NVML and the log besides the connections.
    let files = usize::try_from(hypervisor_daemon::conn::raise_fd_limit()).unwrap_or(usize::MAX);
    let connections = &mut config.settings.connections;
    connections.max_connections = connections
        .max_connections
        .min(files.saturating_sub(64).max(16));
    let observer = gpus.observer().context(
        "NVML is not available (no NVIDIA driver here?); --simulate-gpus N runs without it",
    )?;
    let listed = observer.gpus().context("cannot list the GPUs")?;
    let corun = corun.options(&listed, kube.kubernetes)?;
    let turns = turns.options(&listed, corun.as_ref())?;
    let kubernetes = if kube.kubernetes {
        Some(kube.options(at.socket.as_deref())?)
    } else {
        None
    };
    let spec = NodeSpec {
        daemon: Options {
            config,
            config_path,
            listen: at.listen,
            observer,
            handle_sighup: true,
            node_tables: NodeTableNames::from_env(),
        },
        socket: at.socket.clone(),
        metrics: at.metrics,
        corun,
        kubernetes,
    };
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .thread_name("hypervisor")
        .enable_all()
        .build()
        .context("cannot start the async runtime")?;
    runtime.block_on(async move {
        let bound = Node::bind(spec).await?;
        if let Some(turns) = &turns {
            bound.hypervisor().set_turn_gpus(turns);
        }
        // One line each on stdout, for scripts and tests that asked for port 0.
        println!("hypervisor listening on {}", bound.addr());
        if let Some(socket) = &at.socket {
            println!("hypervisor listening on {}", socket.display());
        }
        if let Some(metrics) = bound.metrics_addr() {
            println!("hypervisor metrics on {metrics}");
        }
        let node = bound.start().await?;
        node.run_until(shutdown_signal()).await?;
        Ok(())
    })
}

fn limiter(command: LimiterCmd) -> anyhow::Result<()> {
    use hypervisor::limiter_files;
    let collected = match command {
        LimiterCmd::Install {
            source,
            link,
            version,
            proc,
        } => {
            let installed = limiter_files::install(&source, &link, &version, &proc)?;
            println!(
                "{} {} -> {}",
                if installed.switched {
                    "switched"
                } else {
                    "unchanged"
                },
                link.display(),
                installed.file.display()
            );
            installed.collected
        }
        LimiterCmd::Collect { link, proc } => limiter_files::collect(&link, &proc)?,
    };
    for path in &collected.removed {
        println!("removed {} (no process maps it)", path.display());
    }
    for path in &collected.in_use {
        println!("kept {} (in use)", path.display());
    }
    if let Some(reason) = &collected.unknown {
        println!("kept every old version: {reason}");
    }
    Ok(())
}

async fn shutdown_signal() {
    use tokio::signal::unix::{SignalKind, signal};
    let mut term = match signal(SignalKind::terminate()) {
        Ok(term) => term,
        Err(error) => {
            tracing::error!(%error, "cannot listen for SIGTERM");
            let _ = tokio::signal::ctrl_c().await;
            return;
        }
    };
    tokio::select! {
        _ = term.recv() => {}
        _ = tokio::signal::ctrl_c() => {}
    }
    tracing::info!("shutting down; regions stay");
}

fn base_url(addr: &str) -> String {
    if addr.starts_with("http://") {
        addr.trim_end_matches('/').to_owned()
    } else {
        format!("http://{addr}")
    }
}

fn agent(timeout: Duration) -> ureq::Agent {
    ureq::Agent::config_builder()
        .http_status_as_error(false)
        .proxy(None)
        .timeout_global(Some(timeout))
        .build()
        .new_agent()
}

/// The API route that `hypervisor <command>` calls, from the daemon's
/// route table.
fn route_of(command: &str) -> anyhow::Result<&'static ApiRoute> {
    ApiRoute::of_command(command)
        .with_context(|| format!("the API has no route for `hypervisor {command}`"))
}

/// `hypervisor swap`, `move` and `drain`: sends `body` (or nothing) with the
/// admin token to the route `command` calls, its parameters `params`, and
/// prints the daemon's answer, or fails with its refusal.
fn admin(
    daemon: &AdminTarget,
    command: &str,
    params: &[(&str, &str)],
    body: Option<serde_json::Value>,
) -> anyhow::Result<()> {
    let route = route_of(command)?;
    let token = match &daemon.admin_token_file {
        Some(path) => std::fs::read_to_string(path)
            .with_context(|| format!("cannot read {}", path.display()))?
            .trim()
            .to_owned(),
        None => std::env::var("GPUSHARE_ADMIN_TOKEN")
            .context("give --admin-token-file or set GPUSHARE_ADMIN_TOKEN")?,
    };
    let url = format!("{}{}", base_url(&daemon.addr), route.path_with(params));
    let request = ureq::http::Request::builder()
        .method(route.method.as_str())
        .uri(&url)
        .header("Authorization", format!("Bearer {token}"));
    // A swap or move of tens of GiB takes tens of seconds; a drain, one
    // for each pod of the GPU.
    let agent = agent(Duration::from_secs(900));
    let response = match body {
        Some(body) => request
            .header("Content-Type", "application/json")
            .body(body.to_string())
            .map(|request| agent.run(request)),
        None => request.body(()).map(|request| agent.run(request)),
    }
    .with_context(|| format!("cannot form a request to {url}"))?;
    println!("{}", answer(&url, response)?);
    Ok(())
}

/// The body of the daemon's 200 answer to `url`; anything else an error
/// naming the status and the daemon's words.
fn answer(
    url: &str,
    response: Result<ureq::http::Response<ureq::Body>, ureq::Error>,
) -> anyhow::Result<String> {
    let mut response = response.with_context(|| format!("cannot reach {url}"))?;
    let code = response.status().as_u16();
    let body = response
        .body_mut()
        .read_to_string()
        .context("cannot read the answer")?;
    if code != 200 {
        bail!("{url} answered {code}: {body}");
    }
    Ok(body)
}

fn status(addr: &str, json: bool) -> anyhow::Result<()> {
    let url = format!("{}{}", base_url(addr), route_of("status")?.path);
    let body = answer(&url, agent(Duration::from_secs(5)).get(&url).call())?;
    if json {
        println!("{body}");
        return Ok(());
    }
    let status: Status = serde_json::from_str(&body).context("unexpected status answer")?;
    print!("{}", render_table(&status));
    Ok(())
}

fn check_config(path: &std::path::Path) -> anyhow::Result<()> {
    let config = config::load(path)?;
    for warning in config::warnings(&config) {
        println!("warning: {warning}");
    }
    println!("listen {}", config.listen);
    println!(
        "admin API {}",
        if config.admin_token.is_some() {
            "on"
        } else {
            "off"
        }
    );
    let swap = &config.settings.swap;
    // Only when some GPU overcommits: the operators' swap needs no setting.
    if swap.overcommit.as_ref().is_none_or(|gpus| !gpus.is_empty()) {
        println!(
            "swap: overcommit on {}, ratio {}, idle after {} ms, host limit {} bytes",
            swap.overcommit
                .as_ref()
                .map_or("every GPU".to_owned(), |gpus| {
                    let indexes: Vec<String> = gpus.iter().map(u32::to_string).collect();
                    format!("GPUs {}", indexes.join(", "))
                }),
            swap.overcommit_ratio,
            swap.idle_after.as_millis(),
            swap.host_limit
        );
    }
    for pod in &config.pods {
        println!("pod {} ({} GPUs)", pod.id, pod.gpus.len());
        for gpu in &pod.gpus {
            println!(
                "  {}: memory {}, weight {}, cap {}, share {}, policy {}",
                gpu.gpu,
                if gpu.memory_bytes == 0 {
                    "unlimited".to_owned()
                } else {
                    format!("{} bytes", gpu.memory_bytes)
                },
                gpu.weight,
                gpu.cap_percent.map_or("-".to_owned(), |c| format!("{c}%")),
                gpu.share_percent
                    .map_or("-".to_owned(), |s| format!("{s}%")),
                gpu.policy
            );
        }
    }
    Ok(())
}
