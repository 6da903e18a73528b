//! Runs real programs with the built `libadd_path.so` loaded and asserts the
//! exact `PATH`, `LD_PRELOAD` and `LD_LIBRARY_PATH` their children print.
//!
//! Every case runs through every launcher that applies: shells (`sh -c env`,
//! `exec`, a shell started by a shell) and a small C program compiled here
//! with `cc` that prints its own environment or starts `env` with `execve`,
//! `posix_spawn` or `system`. The C program is built twice: once plain, for
//! `LD_PRELOAD`, and once with `libadd_path.so` as a `DT_NEEDED` dependency, the
//! only way to load the library with `LD_PRELOAD` unset.

#![allow(
    clippy::unwrap_used,
    reason = "test code: a helper fails its test by panicking, as the test itself does"
)]

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

const SH: &str = "/bin/sh";
const ENV: &str = "/usr/bin/env";
const VARS: [&str; 3] = ["PATH", "LD_PRELOAD", "LD_LIBRARY_PATH"];
/// Stands for the absolute path of the built library in case tables.
const LIB: &str = "{lib}";

/// `target/<profile>/deps/libadd_path.so`, next to this test executable.
///
/// Cargo builds the package's library (cdylib and rlib in one rustc run) into
/// `deps/` before the integration tests, because the rlib is linkable; it
/// copies it up to `target/<profile>/` only when the library itself was asked
/// for, so the copy there may be stale during `cargo test`.
fn lib_path() -> &'static Path {
    static LIB_PATH: OnceLock<PathBuf> = OnceLock::new();
    LIB_PATH.get_or_init(|| {
        let exe = std::env::current_exe().expect("path of the test executable");
        let deps = exe
            .parent()
            .expect("test executable is in target/<profile>/deps/");
        let lib = deps.join("libadd_path.so");
        assert!(
            lib.is_file(),
            "{} is missing: cargo builds it before the integration tests as long \
             as add-path's crate-type lists \"rlib\" next to \"cdylib\"",
            lib.display()
        );
        lib
    })
}

const HELPER_C: &str = r#"
#include <spawn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

extern char **environ;

/* argv[1]: self | execve | posix_spawn | system; argv[2]: absolute path of env. */
int main(int argc, char **argv) {
    if (argc != 3) return 2;
    const char *mode = argv[1];
    char *child_argv[] = {argv[2], NULL};
    if (strcmp(mode, "self") == 0) {
        for (char **e = environ; *e != NULL; e++) printf("%s\n", *e);
        return 0;
    }
    if (strcmp(mode, "execve") == 0) {
        execve(argv[2], child_argv, environ);
        perror("execve");
        return 127;
    }
    if (strcmp(mode, "posix_spawn") == 0) {
        pid_t pid;
        int status;
        if (posix_spawn(&pid, argv[2], NULL, NULL, child_argv, environ) != 0) return 127;
        if (waitpid(pid, &status, 0) != pid) return 127;
        return WIFEXITED(status) ? WEXITSTATUS(status) : 126;
    }
    if (strcmp(mode, "system") == 0) {
        return system(argv[2]) == 0 ? 0 : 1;
    }
    return 2;
}
"#;

/// The helper program: `linked` with `libadd_path.so` as `DT_NEEDED`, or plain.
fn helper(linked: bool) -> &'static Path {
    static PLAIN: OnceLock<PathBuf> = OnceLock::new();
    static LINKED: OnceLock<PathBuf> = OnceLock::new();
    let slot = if linked { &LINKED } else { &PLAIN };
    slot.get_or_init(|| {
        let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("add-path-children");
        std::fs::create_dir_all(&dir).expect("create helper build dir");
        let name = if linked { "helper-linked" } else { "helper" };
        // The target dir is shared: build under a name of our own, then rename
        // into place, which is atomic, so a concurrent run never sees half a file.
        let pid = std::process::id();
        let source = dir.join(format!("{name}.{pid}.c"));
        let built = dir.join(format!("{name}.{pid}"));
        std::fs::write(&source, HELPER_C).expect("write helper source");
        let mut cc = Command::new("cc");
        cc.arg("-o").arg(&built).arg(&source);
        if linked {
            let lib_dir = lib_path().parent().expect("library folder");
            // --no-as-needed: the library exports nothing the program uses.
            cc.arg(format!("-L{}", lib_dir.display()))
                .arg("-Wl,--no-as-needed")
                .arg("-ladd_path")
                .arg(format!("-Wl,-rpath,{}", lib_dir.display()));
        }
        let result = cc
            .output()
            .expect("run `cc` (a C compiler is needed for these tests)");
        std::fs::remove_file(&source).ok();
        assert!(
            result.status.success(),
            "cc failed: {}",
            String::from_utf8_lossy(&result.stderr)
        );
        let out = dir.join(name);
        std::fs::rename(&built, &out).expect("move the helper into place");
        out
    })
}

/// How a case's program is started, and how it starts the `env` that prints.
#[derive(Clone, Copy, Debug)]
enum Launcher {
    ShEnv,
    ShExecEnv,
    ShShEnv,
    Helper { linked: bool, mode: &'static str },
}

const LAUNCHERS: [Launcher; 11] = [
    Launcher::ShEnv,
    Launcher::ShExecEnv,
    Launcher::ShShEnv,
    Launcher::Helper {
        linked: false,
        mode: "self",
    },
    Launcher::Helper {
        linked: false,
        mode: "execve",
    },
    Launcher::Helper {
        linked: false,
        mode: "posix_spawn",
    },
    Launcher::Helper {
        linked: false,
        mode: "system",
    },
    Launcher::Helper {
        linked: true,
        mode: "self",
    },
    Launcher::Helper {
        linked: true,
        mode: "execve",
    },
    Launcher::Helper {
        linked: true,
        mode: "posix_spawn",
    },
    Launcher::Helper {
        linked: true,
        mode: "system",
    },
];

impl Launcher {
    /// Only the linked helper loads the library without `LD_PRELOAD`.
    fn needs_preload(self) -> bool {
        !matches!(self, Launcher::Helper { linked: true, .. })
    }

    fn command(self) -> Command {
        match self {
            Launcher::ShEnv => sh(ENV),
            Launcher::ShExecEnv => sh(&format!("exec {ENV}")),
            Launcher::ShShEnv => sh(&format!("{SH} -c {ENV}")),
            Launcher::Helper { linked, mode } => {
                let mut command = Command::new(helper(linked));
                command.args([mode, ENV]);
                command
            }
        }
    }
}

fn sh(script: &str) -> Command {
    let mut command = Command::new(SH);
    command.args(["-c", script]);
    command
}

/// One environment and the three values every child must see (`None`: unset).
struct Case {
    name: &'static str,
    env: &'static [(&'static str, &'static str)],
    path: Option<&'static str>,
    ld_preload: Option<&'static str>,
    ld_library_path: Option<&'static str>,
}

fn with_lib(value: &str) -> String {
    value.replace(LIB, &lib_path().display().to_string())
}

/// Runs every case through every launcher that applies; reports all mismatches.
fn check(cases: &[Case]) {
    let mut failures = Vec::new();
    for case in cases {
        let preloaded = case.env.iter().any(|(name, _)| *name == "LD_PRELOAD");
        let expected: BTreeMap<&str, Option<String>> = VARS
            .into_iter()
            .zip([case.path, case.ld_preload, case.ld_library_path])
            .map(|(name, value)| (name, value.map(with_lib)))
            .collect();
        let mut ran = 0;
        for launcher in LAUNCHERS {
            if launcher.needs_preload() && !preloaded {
                continue;
            }
            ran += 1;
            let output = launcher
                .command()
                .env_clear()
                .envs(
                    case.env
                        .iter()
                        .map(|&(name, value)| (name, with_lib(value))),
                )
                .output()
                .expect("start the child");
            let stdout = String::from_utf8_lossy(&output.stdout);
            let stderr = String::from_utf8_lossy(&output.stderr);
            if !output.status.success() || stderr.contains("libadd_path:") {
                failures.push(format!(
                    "{} via {launcher:?}: {}, stderr: {stderr}",
                    case.name, output.status
                ));
                continue;
            }
            let printed: BTreeMap<&str, &str> = stdout
                .lines()
                .filter_map(|line| line.split_once('='))
                .collect();
            for (&name, want) in &expected {
                let got = printed.get(name).copied();
                if got != want.as_deref() {
                    failures.push(format!(
                        "{} via {launcher:?}: {name} expected {want:?}, got {got:?}",
                        case.name
                    ));
                }
            }
        }
        assert!(ran > 0, "{}: no launcher applies", case.name);
    }
    assert!(failures.is_empty(), "\n{}", failures.join("\n"));
}

#[test]
fn library_is_built() {
    assert!(lib_path().is_absolute());
}

#[test]
fn no_tf_variables_leave_everything_alone() {
    check(&[
        Case {
            name: "odd values stay byte for byte",
            env: &[
                ("PATH", "/usr/bin::/bin:"),
                ("LD_PRELOAD", " {lib} "),
                ("LD_LIBRARY_PATH", ":/l:/l"),
            ],
            path: Some("/usr/bin::/bin:"),
            ld_preload: Some(" {lib} "),
            ld_library_path: Some(":/l:/l"),
        },
        Case {
            name: "unset stays unset",
            env: &[("LD_PRELOAD", "{lib}")],
            path: None,
            ld_preload: Some("{lib}"),
            ld_library_path: None,
        },
        Case {
            name: "unset LD_PRELOAD stays unset",
            env: &[("PATH", "/usr/bin")],
            path: Some("/usr/bin"),
            ld_preload: None,
            ld_library_path: None,
        },
        Case {
            name: "empty TF values change nothing",
            env: &[
                ("PATH", "/usr/bin::/bin:"),
                ("LD_PRELOAD", "{lib} "),
                ("LD_LIBRARY_PATH", "/l:"),
                ("TF_PATH", ""),
                ("TF_PREPEND_PATH", ""),
                ("TF_LD_PRELOAD", " "),
                ("TF_PREPEND_LD_PRELOAD", ""),
                ("TF_LD_LIBRARY_PATH", "::"),
                ("TF_PREPEND_LD_LIBRARY_PATH", ":"),
            ],
            path: Some("/usr/bin::/bin:"),
            ld_preload: Some("{lib} "),
            ld_library_path: Some("/l:"),
        },
        Case {
            name: "all entries already present",
            env: &[
                ("PATH", "/opt/a:/usr/bin:/bin"),
                ("LD_PRELOAD", "{lib}"),
                ("TF_PATH", "/usr/bin:/opt/a"),
                ("TF_PREPEND_PATH", "/bin"),
                ("TF_LD_PRELOAD", "{lib}"),
            ],
            path: Some("/opt/a:/usr/bin:/bin"),
            ld_preload: Some("{lib}"),
            ld_library_path: None,
        },
    ]);
}

#[test]
fn path() {
    check(&[
        Case {
            name: "append",
            env: &[
                ("PATH", "/usr/bin:/bin"),
                ("LD_PRELOAD", "{lib}"),
                ("TF_PATH", "/opt/tf/bin:/usr/bin"),
            ],
            path: Some("/usr/bin:/bin:/opt/tf/bin"),
            ld_preload: Some("{lib}"),
            ld_library_path: None,
        },
        Case {
            name: "prepend, own duplicates collapsed",
            env: &[
                ("PATH", "/usr/bin:/bin"),
                ("LD_PRELOAD", "{lib}"),
                ("TF_PREPEND_PATH", "/opt/a:/bin:/opt/a:/opt/b"),
            ],
            path: Some("/opt/a:/opt/b:/usr/bin:/bin"),
            ld_preload: Some("{lib}"),
            ld_library_path: None,
        },
        Case {
            name: "both, prepend wins for shared entries",
            env: &[
                ("PATH", "/usr/bin:/bin"),
                ("LD_PRELOAD", "{lib}"),
                ("TF_PATH", "/opt/z:/opt/y"),
                ("TF_PREPEND_PATH", "/opt/y:/opt/p"),
            ],
            path: Some("/opt/y:/opt/p:/usr/bin:/bin:/opt/z"),
            ld_preload: Some("{lib}"),
            ld_library_path: None,
        },
        Case {
            name: "unset PATH is created",
            env: &[
                ("LD_PRELOAD", "{lib}"),
                ("TF_PATH", "/opt/tf/bin::/usr/bin"),
            ],
            path: Some("/opt/tf/bin:/usr/bin"),
            ld_preload: Some("{lib}"),
            ld_library_path: None,
        },
        Case {
            name: "empty PATH counts as no entries",
            env: &[
                ("PATH", ""),
                ("LD_PRELOAD", "{lib}"),
                ("TF_PREPEND_PATH", "/opt/p"),
            ],
            path: Some("/opt/p"),
            ld_preload: Some("{lib}"),
            ld_library_path: None,
        },
        Case {
            name: "empty elements of TF values dropped",
            env: &[
                ("PATH", "/usr/bin"),
                ("LD_PRELOAD", "{lib}"),
                ("TF_PATH", ":/opt/a::/opt/b:"),
                ("TF_PREPEND_PATH", ":"),
            ],
            path: Some("/usr/bin:/opt/a:/opt/b"),
            ld_preload: Some("{lib}"),
            ld_library_path: None,
        },
        Case {
            name: "empty elements of the existing value kept",
            env: &[
                ("PATH", ":/usr/bin::/bin"),
                ("LD_PRELOAD", "{lib}"),
                ("TF_PATH", "/opt/a"),
                ("TF_PREPEND_PATH", "/opt/p"),
            ],
            path: Some("/opt/p::/usr/bin::/bin:/opt/a"),
            ld_preload: Some("{lib}"),
            ld_library_path: None,
        },
    ]);
}

#[test]
fn ld_preload() {
    check(&[
        Case {
            name: "append",
            env: &[("LD_PRELOAD", "{lib}"), ("TF_LD_PRELOAD", "/opt/a.so")],
            path: None,
            ld_preload: Some("{lib}:/opt/a.so"),
            ld_library_path: None,
        },
        Case {
            name: "prepend, own duplicates and the library itself collapsed",
            env: &[
                ("LD_PRELOAD", "{lib}"),
                ("TF_PREPEND_LD_PRELOAD", "/opt/p.so {lib} /opt/p.so"),
            ],
            path: None,
            ld_preload: Some("/opt/p.so:{lib}"),
            ld_library_path: None,
        },
        Case {
            name: "both, prepend wins for shared entries",
            env: &[
                ("LD_PRELOAD", "{lib}"),
                ("TF_LD_PRELOAD", "/opt/a.so:/opt/b.so"),
                ("TF_PREPEND_LD_PRELOAD", "/opt/b.so"),
            ],
            path: None,
            ld_preload: Some("/opt/b.so:{lib}:/opt/a.so"),
            ld_library_path: None,
        },
        Case {
            name: "space-separated existing value keeps its spaces",
            env: &[
                ("LD_PRELOAD", "{lib} /opt/e.so"),
                ("TF_LD_PRELOAD", "/opt/e.so:/opt/n.so  "),
            ],
            path: None,
            ld_preload: Some("{lib} /opt/e.so:/opt/n.so"),
            ld_library_path: None,
        },
        Case {
            name: "empty elements of TF values dropped",
            env: &[
                ("LD_PRELOAD", "{lib}"),
                ("TF_LD_PRELOAD", " :/opt/a.so::/opt/b.so: :"),
            ],
            path: None,
            ld_preload: Some("{lib}:/opt/a.so:/opt/b.so"),
            ld_library_path: None,
        },
        Case {
            name: "unset LD_PRELOAD is created (library linked, not preloaded)",
            env: &[
                ("TF_LD_PRELOAD", "/opt/a.so /opt/b.so"),
                ("TF_PREPEND_LD_PRELOAD", "/opt/p.so"),
            ],
            path: None,
            ld_preload: Some("/opt/p.so:/opt/a.so:/opt/b.so"),
            ld_library_path: None,
        },
    ]);
}

#[test]
fn ld_library_path() {
    check(&[
        Case {
            name: "append to unset",
            env: &[
                ("LD_PRELOAD", "{lib}"),
                ("TF_LD_LIBRARY_PATH", "/opt/l1:/opt/l2"),
            ],
            path: None,
            ld_preload: Some("{lib}"),
            ld_library_path: Some("/opt/l1:/opt/l2"),
        },
        Case {
            name: "prepend",
            env: &[
                ("LD_PRELOAD", "{lib}"),
                ("LD_LIBRARY_PATH", "/usr/lib"),
                ("TF_PREPEND_LD_LIBRARY_PATH", "/opt/l:/usr/lib"),
            ],
            path: None,
            ld_preload: Some("{lib}"),
            ld_library_path: Some("/opt/l:/usr/lib"),
        },
        Case {
            name: "both, with duplicates and empty elements",
            env: &[
                ("LD_PRELOAD", "{lib}"),
                ("LD_LIBRARY_PATH", "/usr/lib"),
                ("TF_LD_LIBRARY_PATH", "/opt/a::/opt/a:/usr/lib:/opt/z"),
                ("TF_PREPEND_LD_LIBRARY_PATH", ":/opt/p:/opt/a"),
            ],
            path: None,
            ld_preload: Some("{lib}"),
            ld_library_path: Some("/opt/p:/opt/a:/usr/lib:/opt/z"),
        },
        Case {
            name: "empty existing value counts as no entries",
            env: &[
                ("LD_PRELOAD", "{lib}"),
                ("LD_LIBRARY_PATH", ""),
                ("TF_LD_LIBRARY_PATH", "/opt/l"),
            ],
            path: None,
            ld_preload: Some("{lib}"),
            ld_library_path: Some("/opt/l"),
        },
    ]);
}

#[test]
fn all_three_at_once() {
    check(&[
        Case {
            name: "entrypoint reset everything",
            env: &[
                ("PATH", "/usr/bin:/bin"),
                ("LD_PRELOAD", "{lib}"),
                ("TF_PATH", "/opt/tf/bin"),
                ("TF_PREPEND_PATH", "/opt/first/bin"),
                ("TF_LD_PRELOAD", "/opt/limiter.so"),
                ("TF_LD_LIBRARY_PATH", "/opt/tf/lib"),
                ("TF_PREPEND_LD_LIBRARY_PATH", "/opt/first/lib"),
            ],
            path: Some("/opt/first/bin:/usr/bin:/bin:/opt/tf/bin"),
            ld_preload: Some("{lib}:/opt/limiter.so"),
            ld_library_path: Some("/opt/first/lib:/opt/tf/lib"),
        },
        Case {
            name: "linked, nothing set but the TF variables",
            env: &[
                ("TF_PATH", "/opt/tf/bin"),
                ("TF_LD_PRELOAD", "{lib}"),
                ("TF_LD_LIBRARY_PATH", "/opt/tf/lib"),
            ],
            path: Some("/opt/tf/bin"),
            ld_preload: Some("{lib}"),
            ld_library_path: Some("/opt/tf/lib"),
        },
    ]);
}
