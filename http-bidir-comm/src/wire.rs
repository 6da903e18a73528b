//! What travels on the wire: identifiers, task and result envelopes, the
//! error body, and the header names both sides agree on.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

/// Longest accepted client id, in bytes (all accepted characters are ASCII).
pub const MAX_CLIENT_ID_LEN: usize = 128;

/// Response header carrying the hub's instance id. It changes when the server
/// restarts, which is how a client notices a restart that happened between two
/// of its requests (no error seen) and knows to say hello again.
pub const INSTANCE_HEADER: &str = "x-bidir-instance";

/// A validated client id: 1..=128 characters of `[A-Za-z0-9_.:-]`, and not
/// `.` or `..` (those two would be read as path navigation in a URL).
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct ClientId(String);

/// Why a string is not a [`ClientId`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum InvalidClientId {
    /// The id is empty.
    #[error("client id is empty")]
    Empty,
    /// The id is longer than [`MAX_CLIENT_ID_LEN`].
    #[error("client id is longer than {MAX_CLIENT_ID_LEN} characters")]
    TooLong,
    /// The id holds a character outside `[A-Za-z0-9_.:-]`.
    #[error("client id may only contain A-Z a-z 0-9 _ . : -")]
    BadCharacter,
    /// The id is `.` or `..`.
    #[error("client id may not be \".\" or \"..\"")]
    DotSegment,
}

impl ClientId {
    /// Validates `id`.
    pub fn new(id: impl Into<String>) -> Result<Self, InvalidClientId> {
        let id = id.into();
        Self::check(&id)?;
        Ok(Self(id))
    }

    /// Checks `id` without allocating.
    pub fn check(id: &str) -> Result<(), InvalidClientId> {
        if id.is_empty() {
            return Err(InvalidClientId::Empty);
        }
        if id.len() > MAX_CLIENT_ID_LEN {
            return Err(InvalidClientId::TooLong);
        }
        if !id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'.' | b':' | b'-'))
        {
            return Err(InvalidClientId::BadCharacter);
        }
        if id == "." || id == ".." {
            return Err(InvalidClientId::DotSegment);
        }
        Ok(())
    }

    /// The id as a string slice.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl TryFrom<String> for ClientId {
    type Error = InvalidClientId;
    fn try_from(id: String) -> Result<Self, Self::Error> {
        Self::new(id)
    }
}

impl TryFrom<&str> for ClientId {
    type Error = InvalidClientId;
    fn try_from(id: &str) -> Result<Self, Self::Error> {
        Self::new(id)
    }
}

impl FromStr for ClientId {
    type Err = InvalidClientId;
    fn from_str(id: &str) -> Result<Self, Self::Err> {
        Self::new(id)
    }
}

impl From<ClientId> for String {
    fn from(id: ClientId) -> Self {
        id.0
    }
}

impl AsRef<str> for ClientId {
    fn as_ref(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for ClientId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl fmt::Debug for ClientId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(&self.0, f)
    }
}

/// Id of one submitted task, unique within one hub (one server lifetime).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(transparent)]
pub struct TaskId(pub u64);

impl fmt::Display for TaskId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(&self.0, f)
    }
}

/// A task as a client receives it: `{ "id": 7, "task": T }`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Task<T> {
    /// Id to quote when posting the result.
    pub id: TaskId,
    /// The task itself.
    pub task: T,
}

/// A result as a client posts it: `{ "id": 7, "result": R }`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TaskResult<R> {
    /// Id of the task this answers.
    pub id: TaskId,
    /// The result.
    pub result: R,
}

/// Body of every 4xx/5xx answer from the hub's routes: `{ "error": "..." }`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ErrorBody {
    /// A short, human-readable reason.
    pub error: String,
}

/// Answer to `hello`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct HelloReply {
    /// The id the hub registered.
    pub client_id: ClientId,
    /// The hub's instance id (also sent in [`INSTANCE_HEADER`]).
    pub instance: String,
    /// How long the hub keeps a silent client, in milliseconds.
    pub ttl_ms: u64,
    /// The longest long-poll wait the hub grants, in milliseconds.
    pub max_wait_ms: u64,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn client_id_table() {
        let long_ok = "a".repeat(MAX_CLIENT_ID_LEN);
        let too_long = "a".repeat(MAX_CLIENT_ID_LEN + 1);
        let cases: &[(&str, Result<(), InvalidClientId>)] = &[
            ("a", Ok(())),
            ("pod-1_x.y:z", Ok(())),
            ("...", Ok(())),
            (&long_ok, Ok(())),
            ("", Err(InvalidClientId::Empty)),
            (&too_long, Err(InvalidClientId::TooLong)),
            ("a/b", Err(InvalidClientId::BadCharacter)),
            ("a b", Err(InvalidClientId::BadCharacter)),
            ("a%2F", Err(InvalidClientId::BadCharacter)),
            ("é", Err(InvalidClientId::BadCharacter)),
            (".", Err(InvalidClientId::DotSegment)),
            ("..", Err(InvalidClientId::DotSegment)),
        ];
        for (input, want) in cases {
            assert_eq!(&ClientId::check(input), want, "{input:?}");
        }
    }

    #[test]
    fn client_id_serde_validates() {
        let ok: ClientId = serde_json::from_str("\"w-1\"").unwrap();
        assert_eq!(ok.as_str(), "w-1");
        assert!(serde_json::from_str::<ClientId>("\"a/b\"").is_err());
        assert_eq!(serde_json::to_string(&ok).unwrap(), "\"w-1\"");
    }

    #[test]
    fn envelopes_have_the_documented_shape() {
        let task = Task {
            id: TaskId(7),
            task: "x",
        };
        assert_eq!(
            serde_json::to_string(&task).unwrap(),
            r#"{"id":7,"task":"x"}"#
        );
        let result: TaskResult<u32> = serde_json::from_str(r#"{"id":7,"result":3}"#).unwrap();
        assert_eq!(
            result,
            TaskResult {
                id: TaskId(7),
                result: 3
            }
        );
    }
}
