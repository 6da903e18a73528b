//! Base URLs for a server on a Unix socket: `http+unix://` followed by the
//! socket's absolute path, percent-encoded so that it is one URL authority
//! (`http+unix://%2Frun%2Fhv.sock`), the form `requests-unixsocket` and
//! others use. Paths append as to any base URL:
//! `http+unix://%2Frun%2Fhv.sock/api/v1/workers` is `POST /api/v1/workers`
//! on the socket `/run/hv.sock`.

use std::path::{Path, PathBuf};

/// The scheme of a base URL on a Unix socket.
pub const UNIX_SCHEME: &str = "http+unix://";

/// The base URL of a server listening on the Unix socket `path`.
pub fn unix_socket_url(path: &Path) -> String {
    let mut url = String::from(UNIX_SCHEME);
    for byte in path.as_os_str().as_encoded_bytes() {
        match byte {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'.' | b'_' | b'~' => {
                url.push(char::from(*byte));
            }
            other => url.push_str(&format!("%{other:02X}")),
        }
    }
    url
}

/// Splits an `http+unix://` URL into the socket path and the request path
/// (`/` when there is none); `None` for another scheme, a path that is not
/// absolute, or bad percent-encoding.
pub fn split_unix_url(url: &str) -> Option<(PathBuf, &str)> {
    let rest = url.strip_prefix(UNIX_SCHEME)?;
    let (authority, path) = match rest.find('/') {
        Some(at) => (&rest[..at], &rest[at..]),
        None => (rest, "/"),
    };
    let decoded = percent_decode(authority)?;
    if !decoded.starts_with(b"/") {
        return None;
    }
    let socket = PathBuf::from(String::from_utf8(decoded).ok()?);
    Some((socket, path))
}

fn percent_decode(text: &str) -> Option<Vec<u8>> {
    let bytes = text.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' {
            let hex = std::str::from_utf8(bytes.get(i + 1..i + 3)?).ok()?;
            out.push(u8::from_str_radix(hex, 16).ok()?);
            i += 3;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_socket_path_round_trips_through_its_url() {
        let path = Path::new("/var/run/gpushare/hypervisor/hypervisor.sock");
        let url = unix_socket_url(path);
        assert_eq!(
            url,
            "http+unix://%2Fvar%2Frun%2Fgpushare%2Fhypervisor%2Fhypervisor.sock"
        );
        assert_eq!(split_unix_url(&url), Some((path.to_owned(), "/")));
        let request = format!("{url}/api/v1/workers");
        assert_eq!(
            split_unix_url(&request),
            Some((path.to_owned(), "/api/v1/workers"))
        );
    }

    #[test]
    fn other_urls_are_not_sockets() {
        for url in [
            "http://127.0.0.1:7070",
            "http+unix://relative.sock",
            "http+unix://%2Fbad%zz",
            "http+unix://",
        ] {
            assert_eq!(split_unix_url(url), None, "{url}");
        }
    }
}
