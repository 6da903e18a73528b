//! The daemon's route table ([`ROUTES`]) against what is written or built
//! apart from it: the route list in `docs/hypervisor.md` (every route, its
//! caller and its CLI command, and no other) and the `hypervisor` CLI (each
//! command that calls the daemon sends its table route's method and path,
//! and every such command is in the table). The router and the fuzz are
//! checked in `api_fuzz`.

use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::net::TcpListener;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use hypervisor_daemon::api::{ApiRoute, ROUTES};

use crate::common::daemon::bin;

/// The commands of the CLI that call no route of the daemon.
const LOCAL_COMMANDS: [&str; 4] = ["serve", "check-config", "limiter", "help"];

/// `METHOD path` of a route, as the docs write it.
fn key(route: &ApiRoute) -> String {
    format!("{} {}", route.method, route.path)
}

/// The rows of the docs' route table: `METHOD path` → (who, CLI).
fn documented() -> BTreeMap<String, (String, String)> {
    let docs = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../docs/hypervisor.md"
    ))
    .expect("docs/hypervisor.md");
    let section = docs
        .split("\n## API\n")
        .nth(1)
        .and_then(|rest| rest.split("\n## ").next())
        .expect("docs/hypervisor.md has an API section");
    section
        .lines()
        .filter(|line| line.starts_with("| `"))
        .map(|line| {
            let cells: Vec<&str> = line.split('|').skip(1).map(str::trim).collect();
            let unquote = |cell: &str| cell.trim_matches('`').to_owned();
            (
                unquote(cells[0]),
                (
                    cells[1].to_owned(),
                    unquote(cells.get(2).copied().unwrap_or("")),
                ),
            )
        })
        .collect()
}

#[test]
fn the_docs_list_every_route_and_no_other() {
    let mut docs = documented();
    let mut wrong = Vec::new();
    for route in ROUTES {
        let key = key(route);
        let Some((who, cli)) = docs.remove(&key) else {
            wrong.push(format!("{key}: in the route table, missing from the docs"));
            continue;
        };
        if !who.starts_with(route.caller.as_str()) {
            wrong.push(format!(
                "{key}: the docs say {who:?}, the table {:?}",
                route.caller.as_str()
            ));
        }
        let command = route
            .cli
            .map_or(String::new(), |c| format!("hypervisor {c}"));
        if cli != command {
            wrong.push(format!(
                "{key}: the docs' CLI {cli:?}, the table's {command:?}"
            ));
        }
    }
    wrong.extend(
        docs.keys()
            .map(|key| format!("{key}: in the docs, not in the route table")),
    );
    assert!(
        wrong.is_empty(),
        "docs/hypervisor.md's API table:\n{}",
        wrong.join("\n")
    );
}

/// The request line `hypervisor args…` sends to a daemon at a listener of
/// the test's, which answers `{}`; with what the command printed.
fn request_of(args: &[&str]) -> (Option<String>, String) {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
    listener.set_nonblocking(true).expect("nonblocking");
    let mut child = Command::new(bin())
        .args(args)
        .args([
            "--addr",
            &listener.local_addr().expect("address").to_string(),
        ])
        .env("GPUSHARE_ADMIN_TOKEN", "token")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("hypervisor runs");
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut line = None;
    while line.is_none() && Instant::now() < deadline {
        match listener.accept() {
            Ok((mut stream, _)) => {
                stream.set_nonblocking(false).expect("blocking");
                stream
                    .set_read_timeout(Some(Duration::from_secs(10)))
                    .expect("timeout");
                let mut head = Vec::new();
                let mut byte = [0u8];
                while !head.ends_with(b"\r\n\r\n") && stream.read(&mut byte).unwrap_or(0) == 1 {
                    head.push(byte[0]);
                }
                let _ = stream.write_all(
                    b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\n{}",
                );
                let head = String::from_utf8_lossy(&head).into_owned();
                line = head.lines().next().map(str::to_owned);
            }
            Err(_) if child.try_wait().ok().flatten().is_some() => break,
            Err(_) => std::thread::sleep(Duration::from_millis(10)),
        }
    }
    let _ = child.kill();
    let output = child.wait_with_output().expect("hypervisor ends");
    let printed = format!(
        "{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    (line, printed)
}

#[test]
fn each_cli_command_calls_its_table_route() {
    let params = [("id", "pod-a"), ("gpu", "1"), ("worker", "w-1")];
    let fill = |text: &str| {
        params.iter().fold(text.to_owned(), |text, (name, value)| {
            text.replace(&format!("{{{name}}}"), value)
        })
    };
    let mut called = Vec::new();
    for route in ROUTES {
        let Some(cli) = route.cli else { continue };
        let command = fill(cli);
        let args: Vec<&str> = command.split(' ').collect();
        let (line, printed) = request_of(&args);
        let expected = format!("{} {} HTTP/1.1", route.method, route.path_with(&params));
        assert_eq!(
            line.as_deref(),
            Some(expected.as_str()),
            "`hypervisor {command}` (the route table's CLI for {}): {printed}",
            key(route)
        );
        called.push(args[0].to_owned());
    }
    // Every command of the CLI either calls a route of the table or none.
    let help = Command::new(bin())
        .arg("help")
        .output()
        .expect("hypervisor help");
    let help = String::from_utf8_lossy(&help.stdout).into_owned();
    let commands: Vec<&str> = help
        .split("Commands:\n")
        .nth(1)
        .expect("the CLI's commands")
        .lines()
        .take_while(|line| line.starts_with("  "))
        .filter_map(|line| line.split_whitespace().next())
        .collect();
    let unlisted: Vec<&&str> = commands
        .iter()
        .filter(|c| !LOCAL_COMMANDS.contains(c) && !called.iter().any(|k| k == *c))
        .collect();
    assert!(
        unlisted.is_empty(),
        "CLI commands that are neither a route's `cli` in the route table nor local: {unlisted:?}"
    );
}
