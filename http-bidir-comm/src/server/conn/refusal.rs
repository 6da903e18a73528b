//! Requests refused before any route sees them, answered in the same JSON
//! as every other error (`{"error": "…"}`, `Content-Type:
//! application/json`): headers longer than [`MAX_HEADER_BYTES`], which the
//! connection refuses itself, and what hyper cannot parse (a garbage request
//! line or header, a target or headers beyond its bounds), which hyper
//! answers with an empty body that the connection replaces.

use poem::http::StatusCode;

/// The most bytes a request's head (request line and headers) may take:
/// the daemon's requests need a few hundred, a token at most 4 KiB. Hyper's
/// own bound is 400 KiB, on each of thousands of connections.
pub(super) const MAX_HEADER_BYTES: usize = 64 * 1024;

/// The statuses hyper answers a request it cannot parse with, by itself.
const HYPER_REFUSALS: [u16; 3] = [400, 414, 431];

/// An answer the connection writes in place of hyper, and how much of it
/// has been written.
pub(super) struct Answer {
    bytes: Vec<u8>,
    sent: usize,
}

impl Answer {
    /// The answer to a request refused with `status`.
    pub(super) fn new(status: u16) -> Self {
        Self {
            bytes: json_answer(status),
            sent: 0,
        }
    }

    /// What is left to write.
    pub(super) fn rest(&self) -> &[u8] {
        &self.bytes[self.sent..]
    }

    /// `n` more bytes were written; whether all are.
    pub(super) fn advance(&mut self, n: usize) -> bool {
        self.sent = (self.sent + n).min(self.bytes.len());
        self.sent == self.bytes.len()
    }
}

/// The status of `data` when it is a whole response that hyper wrote by
/// itself for a request it could not parse: `HTTP/1.1` with a status of
/// [`HYPER_REFUSALS`], headers only, `content-length: 0` and no content
/// type. The daemon's routes never answer so: their errors are JSON.
pub(super) fn hyper_refusal(data: &[u8]) -> Option<u16> {
    let head = data.strip_suffix(b"\r\n\r\n")?;
    let rest = head.strip_prefix(b"HTTP/1.1 ")?;
    let status: u16 = std::str::from_utf8(rest.get(..3)?).ok()?.parse().ok()?;
    if !HYPER_REFUSALS.contains(&status) || head.windows(4).any(|w| w == b"\r\n\r\n") {
        return None;
    }
    let mut lines = head.split(|b| *b == b'\n').skip(1).map(|line| {
        let line = line.strip_suffix(b"\r").unwrap_or(line);
        String::from_utf8_lossy(line).to_ascii_lowercase()
    });
    let mut empty = false;
    for line in &mut lines {
        if line.starts_with("content-type:") {
            return None;
        }
        empty |= line
            .split_once(':')
            .is_some_and(|(name, value)| name.trim() == "content-length" && value.trim() == "0");
    }
    empty.then_some(status)
}

/// The whole response refusing a request with `status`: a JSON body that
/// says why, and the connection closes.
fn json_answer(status: u16) -> Vec<u8> {
    let why = match status {
        414 => "request target too long".to_owned(),
        431 => format!(
            "request header fields too large: at most {MAX_HEADER_BYTES} bytes and 100 fields"
        ),
        _ => "malformed request: not an HTTP/1.1 request line and headers".to_owned(),
    };
    let body = serde_json::json!({ "error": why }).to_string();
    let reason = StatusCode::from_u16(status)
        .ok()
        .and_then(|s| s.canonical_reason())
        .unwrap_or("Bad Request");
    format!(
        "HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
        body.len()
    )
    .into_bytes()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hypers_own_refusals_are_told_from_the_routes_answers() {
        let hyper = |status: &str| {
            format!(
                "HTTP/1.1 {status}\r\nconnection: close\r\ncontent-length: 0\r\ndate: Thu, 01 Jan 2026 00:00:00 GMT\r\n\r\n"
            )
        };
        assert_eq!(
            hyper_refusal(hyper("400 Bad Request").as_bytes()),
            Some(400)
        );
        assert_eq!(
            hyper_refusal(hyper("431 Request Header Fields Too Large").as_bytes()),
            Some(431)
        );
        assert_eq!(
            hyper_refusal(hyper("414 URI Too Long").as_bytes()),
            Some(414)
        );
        let routes = [
            hyper("404 Not Found"),
            hyper("204 No Content"),
            "HTTP/1.1 400 Bad Request\r\ncontent-type: application/json\r\ncontent-length: 0\r\n\r\n"
                .to_owned(),
            "HTTP/1.1 400 Bad Request\r\ncontent-length: 21\r\n\r\n".to_owned(),
            "HTTP/1.1 400 Bad Request\r\ncontent-length: 0\r\n\r\n{}".to_owned(),
            "HTTP/1.1 400 Bad Request\r\ncontent-length: 0\r\n".to_owned(),
        ];
        for answer in routes {
            assert_eq!(hyper_refusal(answer.as_bytes()), None, "{answer:?}");
        }
    }

    #[test]
    fn the_answer_is_json_and_closes() {
        let mut answer = Answer::new(431);
        let text = String::from_utf8(answer.rest().to_vec()).unwrap();
        let (head, body) = text.split_once("\r\n\r\n").unwrap();
        assert!(head.starts_with("HTTP/1.1 431 Request Header Fields Too Large\r\n"));
        assert!(head.contains("\r\ncontent-type: application/json\r\n"));
        assert!(head.contains(&format!("\r\ncontent-length: {}\r\n", body.len())));
        assert!(head.ends_with("\r\nconnection: close"));
        let json: serde_json::Value = serde_json::from_str(body).unwrap();
        assert!(json["error"].as_str().unwrap().contains("too large"));
        assert!(!answer.advance(10));
        assert!(answer.advance(text.len()));
        assert!(answer.rest().is_empty());
    }
}
