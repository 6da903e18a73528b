//! The client over a Unix socket (`http+unix://` base URLs), as pods reach a
//! node daemon that is on no network address: plain requests, the channel's
//! hello, long-poll and results, a prompt stop during a long-poll, and the
//! errors of a socket nobody listens on.

use crate::common;

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use common::{PREFIX, fast_options, wait_event};
use http_bidir_comm::{
    ChannelError, Client, ClientId, ClientOptions, Hub, HubConfig, HubEvent, Requester, Task,
    unix_socket_url,
};
use poem::listener::{Listener, UnixListener};
use poem::{Route, Server, handler, post, web::Json};
use serde_json::{Value, json};
use system_tests::wait::wait_for;

#[handler]
fn echo(Json(body): Json<Value>) -> Json<Value> {
    Json(json!({ "echo": body }))
}

/// A hub and an echo route served on a Unix socket in a folder of the test's.
struct SocketServer {
    dir: PathBuf,
    socket: PathBuf,
    rt: Option<tokio::runtime::Runtime>,
}

impl SocketServer {
    fn start(hub: &Hub<Value, Value>, name: &str) -> Self {
        let dir = std::env::temp_dir().join(format!("bidir-unix-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let socket = dir.join("hub.sock");
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap();
        let acceptor = rt
            .block_on(UnixListener::bind(&socket).into_acceptor())
            .unwrap();
        let app = {
            let _rt = rt.enter();
            Route::new()
                .nest(PREFIX, hub.route())
                .at("/echo", post(echo))
        };
        rt.spawn(async move {
            let _ = Server::new_with_acceptor(acceptor).run(app).await;
        });
        Self {
            dir,
            socket,
            rt: Some(rt),
        }
    }

    fn url(&self) -> String {
        unix_socket_url(&self.socket)
    }
}

impl Drop for SocketServer {
    fn drop(&mut self) {
        if let Some(rt) = self.rt.take() {
            rt.shutdown_timeout(Duration::from_secs(1));
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

#[test]
fn requests_and_the_channel_work_over_a_unix_socket() {
    let (hub, mut events) = Hub::<Value, Value>::new(HubConfig::default());
    let server = SocketServer::start(&hub, "channel");
    let base = server.url();
    assert!(base.starts_with("http+unix://%2F"), "{base}");

    let requests = Requester::new(&base, fast_options()).unwrap();
    assert_eq!(requests.base_url(), base);
    let answer: Value = requests.post_json("/echo", &json!({"n": 7}), None).unwrap();
    assert_eq!(answer, json!({"echo": {"n": 7}}));

    // The channel below the same base, as the limiter derives it.
    let channel = format!("{}{PREFIX}", requests.base_url());
    let client = Client::new(&channel, "worker-1", fast_options()).unwrap();
    client.hello(&json!({"pid": 1})).unwrap();
    let handle = client
        .spawn_loop(|task: Task<Value>| json!({"done": task.task}))
        .unwrap();
    let id = ClientId::new("worker-1").unwrap();
    assert!(wait_for(Duration::from_secs(5), || hub
        .client(&id)
        .is_some_and(|c| c.polling)));
    hub.submit(&id, json!("suspend")).unwrap();
    let result = wait_event(&mut events, Duration::from_secs(5), |e| {
        matches!(e, HubEvent::Result { .. })
    });
    match result {
        Some(HubEvent::Result { result, .. }) => assert_eq!(result, json!({"done": "suspend"})),
        other => panic!("no result: {other:?}"),
    }
    // A long-poll in progress on the socket is cut short by a stop.
    let t = Instant::now();
    handle.stop().unwrap();
    assert!(
        t.elapsed() < Duration::from_secs(2),
        "stop took {:?}",
        t.elapsed()
    );
}

#[test]
fn a_socket_nobody_listens_on_is_a_retryable_transport_error() {
    let missing = Path::new("/nonexistent-gpushare-test/hub.sock");
    let requests = Requester::new(&unix_socket_url(missing), fast_options()).unwrap();
    let error = requests
        .post_json::<_, Value>("/echo", &json!({}), None)
        .unwrap_err();
    assert!(error.is_retryable(), "{error:?}");
    let options = ClientOptions {
        connect_timeout: Duration::from_millis(100),
        ..fast_options()
    };
    let client = Client::new(&unix_socket_url(missing), "w", options).unwrap();
    assert!(matches!(
        client.poll_wait::<Value>(Duration::ZERO),
        Err(e) if e.is_retryable()
    ));
}

#[test]
fn malformed_socket_urls_are_refused_up_front() {
    for url in ["http+unix://relative.sock", "http+unix://%2Fx.sock/api?q=1"] {
        assert!(
            matches!(
                Requester::new(url, fast_options()),
                Err(ChannelError::InvalidUrl { .. })
            ),
            "{url}"
        );
    }
}
