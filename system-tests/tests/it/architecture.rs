//! The workspace's shape, checked: each crate uses exactly the workspace's
//! crates ARCHITECTURE.md's map says it may, modules form a one-way graph in
//! every crate, no source file is over 600 lines outside tests, the node
//! daemon's crates stay small, and all but its Kubernetes agent and the
//! binary build without Kubernetes or gRPC.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::Command;

/// The most lines one source file may have (tests excepted).
const FILE_LINES: usize = 600;
/// The most lines of source one of the node daemon's crates may have.
const DAEMON_CRATE_LINES: usize = 6_000;
/// The daemon's crates that must build without Kubernetes or gRPC.
const NO_KUBERNETES: &[&str] = &[
    "hypervisor-observer",
    "hypervisor-corun",
    "hypervisor-core",
    "hypervisor-config",
    "hypervisor-daemon",
    "hypervisor-provision",
];
/// Packages that bring Kubernetes or gRPC.
const KUBERNETES_OR_GRPC: &[&str] = &["kube", "k8s-openapi", "tonic", "prost"];

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("the workspace root")
        .to_owned()
}

/// Each member's folder, from the workspace's `Cargo.toml`.
fn members() -> Vec<PathBuf> {
    let text = std::fs::read_to_string(root().join("Cargo.toml")).unwrap();
    let start = text.find("members = [").expect("a members list") + "members = [".len();
    let end = start + text[start..].find(']').unwrap();
    text[start..end]
        .split(',')
        .map(|m| m.trim().trim_matches('"'))
        .filter(|m| !m.is_empty())
        .map(|m| root().join(m))
        .collect()
}

/// Every `.rs` file under `dir`, not following into other packages.
fn sources(dir: &Path) -> Vec<PathBuf> {
    let mut found = Vec::new();
    let Ok(entries) = std::fs::read_dir(dir) else {
        return found;
    };
    for entry in entries.flatten() {
        let path = entry.path();
        if path.is_dir() {
            if !path.join("Cargo.toml").exists() {
                found.extend(sources(&path));
            }
        } else if path.extension().is_some_and(|e| e == "rs") {
            found.push(path);
        }
    }
    found.sort();
    found
}

/// The module path of `file` under a crate's `src`.
fn module_of(src: &Path, file: &Path) -> Vec<String> {
    let rel = file.strip_prefix(src).unwrap().with_extension("");
    let mut parts: Vec<String> = rel
        .components()
        .map(|c| c.as_os_str().to_string_lossy().into_owned())
        .collect();
    if matches!(
        parts.last().map(String::as_str),
        Some("mod" | "lib" | "main")
    ) {
        parts.pop();
    }
    parts
}

/// The code of `text` before its unit tests, without comments.
fn code(text: &str) -> String {
    let text = text.split("#[cfg(test)]").next().unwrap_or("");
    text.lines()
        .filter(|line| !line.trim_start().starts_with("//"))
        .collect::<Vec<_>>()
        .join("\n")
}

/// The paths `code` names from `crate::`, `super::` or `self::`, made
/// absolute from `module` (a `{…}` group gives one path per member).
fn referenced(code: &str, module: &[String]) -> Vec<Vec<String>> {
    let mut paths = Vec::new();
    let bytes = code.as_bytes();
    for anchor in ["crate::", "super::", "self::"] {
        let mut from = 0;
        while let Some(at) = code[from..].find(anchor) {
            let start = from + at;
            from = start + anchor.len();
            let before = start.checked_sub(1).map(|i| bytes[i]);
            if before.is_some_and(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b':') {
                continue;
            }
            // The module a `super::` or `self::` path starts from.
            let mut base: Vec<String> = match anchor {
                "crate::" => Vec::new(),
                _ => module.to_vec(),
            };
            let mut rest = &code[start..];
            loop {
                if let Some(r) = rest.strip_prefix("super::") {
                    // In `a/b.rs` (module a::b), `super` is `a`.
                    base.pop();
                    rest = r;
                } else if let Some(r) = rest.strip_prefix("self::") {
                    rest = r;
                } else if let Some(r) = rest.strip_prefix("crate::") {
                    rest = r;
                } else {
                    break;
                }
            }
            if let Some(group) = rest.strip_prefix('{') {
                let end = group.find('}').unwrap_or(group.len());
                for item in group[..end].split(',') {
                    let item = item.trim();
                    if !item.is_empty() {
                        paths.push(join(&base, item));
                    }
                }
            } else {
                let end = rest
                    .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_' || c == ':'))
                    .unwrap_or(rest.len());
                paths.push(join(&base, &rest[..end]));
            }
        }
    }
    paths
}

fn join(base: &[String], path: &str) -> Vec<String> {
    let mut full = base.to_vec();
    full.extend(
        path.split("::")
            .map(str::trim)
            .filter(|p| !p.is_empty() && *p != "self")
            .map(str::to_owned),
    );
    full
}

/// For each parent module, the edges between its children: `a -> b` where
/// code in `a` (or below) names something in sibling `b` (or below).
fn sibling_edges(src: &Path) -> BTreeMap<Vec<String>, BTreeSet<(String, String)>> {
    let files = sources(src);
    let modules: BTreeSet<Vec<String>> = files.iter().map(|f| module_of(src, f)).collect();
    let mut edges: BTreeMap<Vec<String>, BTreeSet<(String, String)>> = BTreeMap::new();
    for file in &files {
        let module = module_of(src, file);
        let text = std::fs::read_to_string(file).unwrap();
        for path in referenced(&code(&text), &module) {
            let Some(target) = (1..=path.len())
                .rev()
                .map(|n| path[..n].to_vec())
                .find(|p| modules.contains(p))
            else {
                continue;
            };
            let common = module
                .iter()
                .zip(&target)
                .take_while(|(a, b)| a == b)
                .count();
            if common < module.len() && common < target.len() {
                edges
                    .entry(module[..common].to_vec())
                    .or_default()
                    .insert((module[common].clone(), target[common].clone()));
            }
        }
    }
    edges
}

/// A cycle among `edges`, if there is one.
fn cycle(edges: &BTreeSet<(String, String)>) -> Option<Vec<String>> {
    fn visit(
        node: &str,
        edges: &BTreeSet<(String, String)>,
        path: &mut Vec<String>,
        done: &mut BTreeSet<String>,
    ) -> Option<Vec<String>> {
        if let Some(at) = path.iter().position(|n| n == node) {
            let mut found = path[at..].to_vec();
            found.push(node.to_owned());
            return Some(found);
        }
        if done.contains(node) {
            return None;
        }
        path.push(node.to_owned());
        for (_, next) in edges.iter().filter(|(from, _)| from == node) {
            if let Some(found) = visit(next, edges, path, done) {
                return Some(found);
            }
        }
        path.pop();
        done.insert(node.to_owned());
        None
    }
    let mut done = BTreeSet::new();
    edges
        .iter()
        .find_map(|(from, _)| visit(from, edges, &mut Vec::new(), &mut done))
}

fn is_test_file(path: &Path) -> bool {
    path.file_name().is_some_and(|n| n == "tests.rs")
        || path
            .components()
            .any(|c| c.as_os_str() == "tests" || c.as_os_str() == "benches")
}

#[test]
fn no_two_modules_import_each_other_directly_or_in_a_circle() {
    let mut cycles = Vec::new();
    for member in members() {
        let src = member.join("src");
        for (parent, edges) in sibling_edges(&src) {
            if let Some(found) = cycle(&edges) {
                cycles.push(format!(
                    "{} in {}: {}",
                    member.strip_prefix(root()).unwrap().display(),
                    if parent.is_empty() {
                        "the crate root".to_owned()
                    } else {
                        parent.join("::")
                    },
                    found.join(" -> ")
                ));
            }
        }
    }
    assert!(cycles.is_empty(), "module cycles:\n{}", cycles.join("\n"));
}

#[test]
fn the_checker_finds_a_cycle_and_a_one_way_graph_has_none() {
    let edge = |a: &str, b: &str| (a.to_owned(), b.to_owned());
    let circle: BTreeSet<_> = [edge("a", "b"), edge("b", "c"), edge("c", "a")].into();
    assert_eq!(cycle(&circle).map(|c| c.len()), Some(4));
    let one_way: BTreeSet<_> = [edge("a", "b"), edge("b", "c"), edge("a", "c")].into();
    assert_eq!(cycle(&one_way), None);
    let module = vec!["agent".to_owned(), "state".to_owned()];
    let found = referenced(
        "use super::{consumers, claims::x};\nuse crate::dra::plugin;",
        &module,
    );
    assert!(found.contains(&vec!["agent".to_owned(), "consumers".to_owned()]));
    assert!(found.contains(&vec!["dra".to_owned(), "plugin".to_owned()]));
}

#[test]
fn no_source_file_is_over_600_lines_outside_tests() {
    let mut long = Vec::new();
    for member in members() {
        for file in sources(&member) {
            if is_test_file(&file) {
                continue;
            }
            let lines = std::fs::read_to_string(&file).unwrap().lines().count();
            if lines > FILE_LINES {
                long.push(format!(
                    "{}: {lines}",
                    file.strip_prefix(root()).unwrap().display()
                ));
            }
        }
    }
    assert!(
        long.is_empty(),
        "over {FILE_LINES} lines:\n{}",
        long.join("\n")
    );
}

#[test]
fn the_node_daemons_crates_are_small() {
    let mut big = Vec::new();
    for member in members()
        .into_iter()
        .filter(|m| m.starts_with(root().join("hypervisor")))
    {
        let lines: usize = sources(&member.join("src"))
            .iter()
            .map(|f| std::fs::read_to_string(f).unwrap().lines().count())
            .sum();
        if lines > DAEMON_CRATE_LINES {
            big.push(format!("{}: {lines}", member.display()));
        }
    }
    assert!(
        big.is_empty(),
        "over {DAEMON_CRATE_LINES} lines:\n{}",
        big.join("\n")
    );
}

/// The packages `crate_name` builds with, its normal and build dependencies
/// and theirs (`cargo tree -e normal,build`; the dev-dependencies of a
/// crate's tests are not the crate's).
fn builds_with(crate_name: &str) -> BTreeSet<String> {
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let output = Command::new(cargo)
        .args(["tree", "--locked", "-e", "normal,build"])
        .args(["--prefix", "none", "--format", "{p}", "-p", crate_name])
        .current_dir(root())
        .output()
        .unwrap();
    assert!(
        output.status.success(),
        "cargo tree -p {crate_name}: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    String::from_utf8_lossy(&output.stdout)
        .lines()
        // "name vX.Y.Z (path) (*)": the name.
        .filter_map(|line| line.split(' ').next())
        .filter(|name| !name.is_empty())
        .map(str::to_owned)
        .collect()
}

#[test]
fn the_daemons_core_builds_without_kubernetes_or_grpc() {
    for crate_name in NO_KUBERNETES {
        let seen = builds_with(crate_name);
        assert!(seen.len() > 5, "{crate_name}: {seen:?}");
        let found: Vec<_> = seen
            .iter()
            .filter(|name| {
                KUBERNETES_OR_GRPC
                    .iter()
                    .any(|k| *name == k || name.starts_with(&format!("{k}-")))
            })
            .collect();
        assert!(found.is_empty(), "{crate_name} depends on {found:?}");
    }
}

/// A workspace member as `cargo metadata` describes it.
#[derive(Debug)]
struct Member {
    name: String,
    /// Its folder from the workspace root, with a trailing `/`.
    folder: String,
    /// The members it depends on, normal and build dependencies (a test's
    /// dev-dependencies are free).
    uses: BTreeSet<String>,
}

/// Every member of the workspace, from `cargo metadata`.
fn workspace() -> Vec<Member> {
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let output = Command::new(cargo)
        .args([
            "metadata",
            "--format-version",
            "1",
            "--no-deps",
            "--offline",
        ])
        .arg("--manifest-path")
        .arg(root().join("Cargo.toml"))
        .output()
        .expect("cargo metadata runs");
    assert!(
        output.status.success(),
        "cargo metadata: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    let metadata: serde_json::Value =
        serde_json::from_slice(&output.stdout).expect("cargo metadata's JSON");
    let packages = metadata["packages"].as_array().expect("a package list");
    let names: BTreeSet<&str> = packages.iter().filter_map(|p| p["name"].as_str()).collect();
    packages
        .iter()
        .map(|package| {
            let manifest = Path::new(package["manifest_path"].as_str().expect("a manifest"));
            let folder = manifest
                .parent()
                .and_then(|f| f.strip_prefix(root()).ok())
                .expect("a member under the workspace root");
            Member {
                name: package["name"].as_str().expect("a name").to_owned(),
                folder: format!("{}/", folder.display()),
                uses: package["dependencies"]
                    .as_array()
                    .expect("a dependency list")
                    .iter()
                    .filter(|d| d["kind"].as_str() != Some("dev"))
                    .filter_map(|d| d["name"].as_str())
                    .filter(|d| names.contains(d))
                    .map(str::to_owned)
                    .collect(),
            }
        })
        .collect()
}

/// A row of ARCHITECTURE.md's crate table.
#[derive(Debug)]
struct MapRow {
    /// The first name in backticks of the first column.
    name: String,
    /// The second: the crate's folder.
    folder: String,
    /// Every name in backticks of the "may use" column (crates of the
    /// workspace and others alike).
    may_use: BTreeSet<String>,
}

/// The names in backticks in `text`.
fn quoted_names(text: &str) -> Vec<String> {
    text.split('`')
        .skip(1)
        .step_by(2)
        .map(str::to_owned)
        .collect()
}

/// The crate table of `text` (ARCHITECTURE.md): the one whose header starts
/// with "crate (folder)" and has a "may use" column.
fn crate_map(text: &str) -> Result<Vec<MapRow>, String> {
    let cells = |line: &str| -> Vec<String> {
        line.trim()
            .trim_matches('|')
            .split('|')
            .map(|c| c.trim().to_owned())
            .collect()
    };
    let mut lines = text
        .lines()
        .skip_while(|l| !l.starts_with("| crate (folder) |"));
    let header = cells(
        lines
            .next()
            .ok_or("no table whose header starts with \"crate (folder)\"")?,
    );
    let may_use = header
        .iter()
        .position(|c| c == "may use")
        .ok_or("the crate table has no \"may use\" column")?;
    let mut rows = Vec::new();
    for line in lines.skip(1).take_while(|l| l.starts_with('|')) {
        let row = cells(line);
        if row.len() != header.len() {
            return Err(format!("{} cells, not {}: {line}", row.len(), header.len()));
        }
        let mut names = quoted_names(&row[0]).into_iter();
        let (Some(name), Some(folder)) = (names.next(), names.next()) else {
            return Err(format!("a row without `crate` (`folder/`): {line}"));
        };
        rows.push(MapRow {
            name,
            folder,
            may_use: quoted_names(&row[may_use]).into_iter().collect(),
        });
    }
    Ok(rows)
}

/// Where `map` and `members` disagree: a member without a row or a row
/// without a member, a folder that is not the member's, a dependency on a
/// workspace crate the row does not name, a workspace crate named that is
/// not a dependency.
fn map_disagreements(members: &[Member], map: &[MapRow]) -> Vec<String> {
    let names: BTreeSet<&str> = members.iter().map(|m| m.name.as_str()).collect();
    let mut found = Vec::new();
    for row in map.iter().filter(|r| !names.contains(r.name.as_str())) {
        found.push(format!("{}: in the map, not in the workspace", row.name));
    }
    for member in members {
        let Some(row) = map.iter().find(|r| r.name == member.name) else {
            found.push(format!("{}: in the workspace, not in the map", member.name));
            continue;
        };
        if row.folder != member.folder {
            found.push(format!(
                "{}: the map says folder {}, it is in {}",
                member.name, row.folder, member.folder
            ));
        }
        let listed: BTreeSet<&str> = row
            .may_use
            .iter()
            .map(String::as_str)
            .filter(|n| names.contains(n))
            .collect();
        let used: BTreeSet<&str> = member.uses.iter().map(String::as_str).collect();
        for dependency in used.difference(&listed) {
            found.push(format!(
                "{}: depends on {dependency}, which its \"may use\" does not name",
                member.name
            ));
        }
        for dependency in listed.difference(&used) {
            found.push(format!(
                "{}: \"may use\" names {dependency}, which its Cargo.toml does not declare",
                member.name
            ));
        }
    }
    found
}

#[test]
fn the_crate_map_names_exactly_the_workspace_crates_each_crate_uses() {
    let text = std::fs::read_to_string(root().join("ARCHITECTURE.md")).unwrap();
    let map = crate_map(&text).unwrap_or_else(|e| panic!("ARCHITECTURE.md: {e}"));
    let members = workspace();
    assert!(members.len() > 10, "{} members found", members.len());
    let found = map_disagreements(&members, &map);
    assert!(
        found.is_empty(),
        "ARCHITECTURE.md's crate table and Cargo.toml disagree:\n{}",
        found.join("\n")
    );
}

#[test]
fn the_map_check_finds_each_kind_of_drift() {
    let text = "intro\n\
        | crate (folder) | what | may use | must not |\n\
        | --- | --- | --- | --- |\n\
        | `a` (`a/`) | the top | `b` (its types), `libc` | `c` |\n\
        | `b` (`b/`) | the bottom | `serde` | `a` |\n\
        | `gone` (`gone/`) | removed | none | |\n\
        \nafter the table\n";
    let map = crate_map(text).expect("the table");
    assert_eq!(map.len(), 3);
    assert_eq!(map[0].folder, "a/");
    let member = |name: &str, folder: &str, uses: &[&str]| Member {
        name: name.to_owned(),
        folder: folder.to_owned(),
        uses: uses.iter().map(|u| (*u).to_owned()).collect(),
    };
    let agreeing = [member("a", "a/", &["b"]), member("b", "b/", &[])];
    assert_eq!(
        map_disagreements(&agreeing, &map[..2]),
        Vec::<String>::new()
    );
    let drifted = [
        member("a", "a/", &[]),
        member("b", "lib/b/", &["c"]),
        member("c", "c/", &[]),
    ];
    let found = map_disagreements(&drifted, &map);
    let expect = [
        "gone: in the map, not in the workspace",
        "a: \"may use\" names b, which its Cargo.toml does not declare",
        "b: the map says folder b/, it is in lib/b/",
        "b: depends on c, which its \"may use\" does not name",
        "c: in the workspace, not in the map",
    ];
    assert_eq!(found, expect);
    assert!(crate_map("| crate (folder) | what |\n| --- | --- |\n").is_err());
    assert!(crate_map("| crate (folder) | may use |\n| --- | --- |\n| `a` | x | y |\n").is_err());
}
