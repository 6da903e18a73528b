//! Where the built control plane is: `<target>/control-plane/control-plane`,
//! which `scripts/build-control-plane.sh` (run by the README's test command)
//! builds from `doubles/control-plane/go`, with the sources it was built
//! from beside it (`stamp`): a program built from other sources is stale,
//! and the tests say so rather than run it.

use std::path::{Path, PathBuf};

use crate::Error;

/// `$GPUSHARE_CONTROL_PLANE`, which names a program built elsewhere.
pub const PROGRAM_VAR: &str = "GPUSHARE_CONTROL_PLANE";

const SOURCES: [&str; 3] = ["go.mod", "go.sum", "main.go"];

/// The control plane built from the current sources.
pub fn find() -> Result<PathBuf, Error> {
    if let Some(path) = std::env::var_os(PROGRAM_VAR) {
        return Ok(PathBuf::from(path));
    }
    let target = target_dir().ok_or_else(|| Error::NotBuilt {
        path: PathBuf::from("target/control-plane/control-plane"),
        why: "no Cargo target folder above this test's executable".to_owned(),
    })?;
    let dir = target.join("control-plane");
    let program = dir.join("control-plane");
    if !program.is_file() {
        return Err(Error::NotBuilt {
            path: program,
            why: "missing".to_owned(),
        });
    }
    let sources = Path::new(env!("CARGO_MANIFEST_DIR")).join("go");
    let mut current = Vec::new();
    for name in SOURCES {
        let bytes = std::fs::read(sources.join(name)).map_err(|source| Error::Io {
            what: format!("read {}", sources.join(name).display()),
            source,
        })?;
        current.extend(bytes);
    }
    if std::fs::read(dir.join("stamp")).ok() != Some(current) {
        return Err(Error::NotBuilt {
            path: program,
            why: "built from other sources than doubles/control-plane/go".to_owned(),
        });
    }
    Ok(program)
}

/// The Cargo target folder this test was built in: the nearest folder
/// above the running executable that holds a built control plane's
/// `control-plane/stamp`, or else that Cargo tagged (`CACHEDIR.TAG`; Cargo
/// tags only a folder it made itself, and on a fresh clone the control
/// plane's build, or the test command's tools, can make it first).
fn target_dir() -> Option<PathBuf> {
    let exe = std::env::current_exe().ok()?;
    let above = || exe.ancestors().skip(1);
    above()
        .find(|dir| dir.join("control-plane/stamp").is_file())
        .or_else(|| above().find(|dir| dir.join("CACHEDIR.TAG").is_file()))
        .map(Path::to_owned)
}
