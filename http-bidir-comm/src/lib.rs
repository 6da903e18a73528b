//! A typed, bidirectional channel over HTTP between one server (the per-node
//! hypervisor: async, Poem) and many clients (code injected into applications:
//! blocking, `ureq`, no runtime of the application's).
//!
//! The server cannot call a client (the client sits inside someone else's
//! process, behind no listening socket), so the client long-polls for work.
//! The life of one task:
//!
//! 1. The client says hello: `POST {prefix}/clients/{id}/hello` with JSON
//!    metadata. The [`Hub`] registers it and emits [`HubEvent::Hello`].
//! 2. The client long-polls: `GET {prefix}/clients/{id}/tasks?wait_ms=N`. With
//!    nothing queued the request parks on the client's `Notify`.
//! 3. The hypervisor calls [`Hub::submit`]: the task is serialized, queued, and
//!    the parked poll wakes at once (no polling on the server side).
//! 4. The poll answers 200 with `[{"id": 7, "task": ...}]`; the tasks leave the
//!    queue (see [`server`] for at-most-once vs at-least-once delivery). With
//!    nothing queued within the wait it answers 204.
//! 5. The client runs its handler and posts `{"id": 7, "result": ...}` to
//!    `POST {prefix}/clients/{id}/results`; the hub emits [`HubEvent::Result`].
//! 6. A client silent for the TTL (no poll in progress, no request) is removed
//!    and [`HubEvent::Expired`] carries what it held, so the hypervisor can
//!    reclaim its resources.
//!
//! Statuses: 200/204 on success; 400 bad client id, bad `wait_ms`, malformed
//! JSON; 401 refused by the [`AuthHook`]; 404 unknown route, or a result for a
//! task not awaiting one; 405 wrong method; 413 body over the limit; 429 too
//! many clients. Every error body is `{"error": "..."}`. Every response from
//! these routes carries [`INSTANCE_HEADER`], which changes when the server
//! restarts.
//!
//! The server may be on TCP (`http://host:port` base URLs) or on a Unix socket
//! (`http+unix://` and the socket's percent-encoded path, [`unix`]): a node
//! daemon whose API is on no network address.
//!
//! Client side, [`Client::spawn_loop`] runs steps 1, 2 and 5 on a thread,
//! reconnecting with bounded, jittered exponential backoff and saying hello
//! again after a reconnect or a hub restart; [`LoopHandle::stop`] ends it
//! within a bounded time.
//!
//! Why these crates: `poem` is the hypervisor's HTTP server; `tokio` gives the
//! per-client `Notify` and timers; `ureq` 3 is a small blocking client with
//! per-request timeouts and `Agent::shutdown` (interrupts a blocked read, which
//! is what makes a prompt stop possible), built here without TLS (the hub is
//! node-local: no `ring`/`rustls` in the injected library); `serde_json` the
//! wire format; `thiserror` the error types; `tracing` the logs.

#[cfg(feature = "client")]
pub mod client;
mod limits;
#[cfg(feature = "server")]
pub mod server;
pub mod unix;
mod wire;

#[cfg(feature = "client")]
pub use client::{Backoff, ChannelError, Client, ClientOptions, LoopHandle, Requester};
pub use limits::ConnLimits;
#[cfg(feature = "server")]
pub use server::{
    AuthHook, ClientInfo, Hub, HubConfig, HubEvent, HubEvents, RemovedClient, SubmitError,
};
pub use unix::{UNIX_SCHEME, split_unix_url, unix_socket_url};
pub use wire::{
    ClientId, ErrorBody, HelloReply, INSTANCE_HEADER, InvalidClientId, MAX_CLIENT_ID_LEN, Task,
    TaskId, TaskResult,
};
