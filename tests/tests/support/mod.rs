//! Running the example servers as real processes, and an HTTP client for both protocols; the
//! `ledger` example's processes and workload in [`ledger`], its database and stream in
//! [`ledger_stream`], the receiver of its notifications in [`notifier`]. Servers and brokers of a test's
//! own, and the environment's, come from the test kit (`idempotent_test_kit`).

#![allow(dead_code, unreachable_pub)]

pub mod ledger;
pub mod ledger_stream;
pub mod notifier;

use std::path::PathBuf;
use std::process::Stdio;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderMap, Method, Request, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client as HyperClient;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use tokio::io::{AsyncBufReadExt, AsyncReadExt, BufReader};
use tokio::process::{Child, Command};

use idempotent_test_kit::process::signal;

/// The path of an example binary built by `cargo test --workspace --all-targets` (or `cargo
/// build --example NAME`), next to this test's own binary.
pub fn example_binary(name: &str) -> PathBuf {
    let exe = std::env::current_exe().expect("test binary path");
    let profile_dir = exe
        .parent()
        .and_then(|deps| deps.parent())
        .expect("test binary lives in target/<profile>/deps");
    let path = profile_dir.join("examples").join(name);
    assert!(
        path.exists(),
        "example binary {} is missing: build it with `cargo build --example {name}` \
         (scripts/test.sh builds every example)",
        path.display()
    );
    path
}

/// How long an example may take to refuse its settings and exit.
const REFUSED_WITHIN: Duration = Duration::from_secs(60);

/// What an example that refused its settings wrote.
pub struct Refused {
    pub stdout: String,
    pub stderr: String,
}

/// Runs `command` to its end and requires exit status 2, the status the examples exit with
/// when they refuse a setting at start; `what` names the run in a failure. The process is
/// killed if it has not exited within a minute (a failure too).
pub async fn refused_at_start(command: &mut Command, what: &str) -> Refused {
    let output = tokio::time::timeout(REFUSED_WITHIN, command.kill_on_drop(true).output())
        .await
        .unwrap_or_else(|_| panic!("{what}: did not exit within {REFUSED_WITHIN:?}"))
        .unwrap_or_else(|e| panic!("{what}: cannot run: {e}"));
    let refused = Refused {
        stdout: String::from_utf8_lossy(&output.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&output.stderr).into_owned(),
    };
    assert_eq!(output.status.code(), Some(2), "{what}: {}", refused.stderr);
    refused
}

/// A running example server; killed when dropped.
pub struct Server {
    pub child: Child,
    pub port: u16,
    /// Its stderr (its log), when started with [`Server::start_logged`]; empty otherwise.
    pub logs: Logs,
    /// Prints `logs` if the server is dropped while the test panics.
    dump: Option<DumpOnPanic>,
}

/// What a child process wrote to stderr so far.
#[derive(Clone, Default)]
pub struct Logs(Arc<Mutex<Vec<u8>>>);

impl Logs {
    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.0.lock().unwrap_or_else(PoisonError::into_inner)).into_owned()
    }

    fn append(&self, bytes: &[u8]) {
        self.0
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .extend_from_slice(bytes);
    }
}

/// Prints a process's captured log when dropped during a panic, so that a failing test shows
/// what the server saw; always with `IDEMPOTENT_TEST_SHOW_LOGS=1`.
struct DumpOnPanic {
    label: String,
    logs: Logs,
}

impl Drop for DumpOnPanic {
    fn drop(&mut self) {
        let asked = std::env::var_os("IDEMPOTENT_TEST_SHOW_LOGS").is_some_and(|v| v == "1");
        if std::thread::panicking() || asked {
            eprintln!(
                "----- {} stderr -----\n{}----- end of {} stderr -----",
                self.label,
                self.logs.text(),
                self.label
            );
        }
    }
}

impl Server {
    /// Starts the `payments` example on a free port with `env` and waits until it listens.
    pub async fn payments(env: &[(&str, &str)]) -> Server {
        Server::start("payments", env, "listening on http://127.0.0.1:").await
    }

    /// Starts the `payments` example like [`Server::payments`], capturing its stderr in
    /// [`Server::logs`] (printed if the test fails). `RUST_LOG` defaults to the library's
    /// debug events.
    pub async fn payments_logged(env: &[(&str, &str)]) -> Server {
        Server::start_logged("payments", env, "listening on http://127.0.0.1:").await
    }

    pub async fn start(example: &str, env: &[(&str, &str)], ready_prefix: &str) -> Server {
        Server::spawn(example, env, ready_prefix, false).await
    }

    /// Like [`Server::start`], with stderr captured in [`Server::logs`].
    pub async fn start_logged(example: &str, env: &[(&str, &str)], ready_prefix: &str) -> Server {
        Server::spawn(example, env, ready_prefix, true).await
    }

    async fn spawn(
        example: &str,
        env: &[(&str, &str)],
        ready_prefix: &str,
        logged: bool,
    ) -> Server {
        let mut command = Command::new(example_binary(example));
        command.env("PORT", "0");
        if logged && std::env::var_os("RUST_LOG").is_none() {
            command.env(
                "RUST_LOG",
                "info,idempotent_core=debug,idempotent_tower=debug",
            );
        }
        command
            .envs(env.iter().copied())
            .stdout(Stdio::piped())
            .stderr(if logged {
                Stdio::piped()
            } else {
                Stdio::inherit()
            })
            .kill_on_drop(true);
        let mut child = command.spawn().expect("start the example");
        let logs = Logs::default();
        let dump = if logged {
            let mut stderr = child.stderr.take().expect("piped stderr");
            let sink = logs.clone();
            tokio::spawn(async move {
                let mut buffer = [0u8; 8192];
                while let Ok(n @ 1..) = stderr.read(&mut buffer).await {
                    sink.append(&buffer[..n]);
                }
            });
            Some(DumpOnPanic {
                label: format!("{example} (pid {})", child.id().unwrap_or(0)),
                logs: logs.clone(),
            })
        } else {
            None
        };
        let stdout = child.stdout.take().expect("piped stdout");
        let mut lines = BufReader::new(stdout).lines();
        let line = tokio::time::timeout(Duration::from_secs(30), lines.next_line())
            .await
            .expect("the example did not start within 30 s")
            .expect("read the example's stdout")
            .expect("the example exited before listening");
        let port = line
            .strip_prefix(ready_prefix)
            .unwrap_or_else(|| panic!("unexpected first line {line:?}"))
            .trim()
            .parse()
            .expect("port number");
        // Keep draining stdout so the child never blocks on a full pipe.
        tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
        Server {
            child,
            port,
            logs,
            dump,
        }
    }

    pub fn url(&self, path: &str) -> String {
        format!("http://127.0.0.1:{}{path}", self.port)
    }

    pub fn pid(&self) -> u32 {
        self.child.id().expect("running child")
    }

    /// Sends it `kill -NAME` (`TERM`, `KILL`, `STOP`, …), asserting it was delivered.
    pub fn signal(&self, name: &str) {
        let pid = self.pid();
        assert!(signal(pid, name), "kill -{name} {pid}");
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Protocol {
    Http1,
    Http2,
}

pub const PROTOCOLS: [Protocol; 2] = [Protocol::Http1, Protocol::Http2];

#[derive(Clone)]
pub struct Client {
    inner: HyperClient<HttpConnector, Full<Bytes>>,
}

pub struct Answer {
    pub status: StatusCode,
    pub headers: HeaderMap,
    pub body: Bytes,
}

impl Answer {
    pub fn json(&self) -> serde_json::Value {
        serde_json::from_slice(&self.body)
            .unwrap_or_else(|e| panic!("not JSON ({e}): {:?}", String::from_utf8_lossy(&self.body)))
    }

    pub fn replayed(&self) -> bool {
        self.headers
            .get("idempotent-replayed")
            .is_some_and(|v| v == "true")
    }

    /// The `code` of a problem document, checking the problem's shape.
    pub fn problem_code(&self) -> String {
        assert_eq!(self.headers["content-type"], "application/problem+json");
        assert_eq!(self.headers["cache-control"], "no-store");
        let doc = self.json();
        assert_eq!(doc["status"], self.status.as_u16());
        doc["code"].as_str().expect("problem code").to_owned()
    }
}

/// The payment id of a 2xx answer of the payments example.
pub fn payment_id(answer: &Answer) -> u64 {
    answer.json()["id"]
        .as_u64()
        .unwrap_or_else(|| panic!("no payment id in {:?}", answer.body))
}

impl Client {
    pub fn new(protocol: Protocol) -> Client {
        let mut builder = HyperClient::builder(TokioExecutor::new());
        if protocol == Protocol::Http2 {
            builder.http2_only(true);
        }
        Client {
            inner: builder.build_http(),
        }
    }

    pub async fn send(
        &self,
        method: Method,
        url: &str,
        headers: &[(&str, &str)],
        body: impl Into<Bytes>,
    ) -> Answer {
        let mut request = Request::builder().method(method).uri(url);
        for (name, value) in headers {
            request = request.header(*name, *value);
        }
        let request = request.body(Full::new(body.into())).expect("request");
        let response = self
            .inner
            .request(request)
            .await
            .expect("HTTP request failed");
        let (parts, body) = response.into_parts();
        let body = body.collect().await.expect("response body").to_bytes();
        Answer {
            status: parts.status,
            headers: parts.headers,
            body,
        }
    }

    /// Like [`Client::send`], but a request that gets no answer (the connection refused or
    /// cut: the server died) is an `Err` with what failed, not a panic.
    pub async fn try_send(
        &self,
        method: Method,
        url: &str,
        headers: &[(&str, &str)],
        body: impl Into<Bytes>,
    ) -> Result<Answer, String> {
        let mut request = Request::builder().method(method).uri(url);
        for (name, value) in headers {
            request = request.header(*name, *value);
        }
        let request = request.body(Full::new(body.into())).expect("request");
        let response = self
            .inner
            .request(request)
            .await
            .map_err(|e| format!("request failed: {e:?}"))?;
        let (parts, body) = response.into_parts();
        let body = body
            .collect()
            .await
            .map_err(|e| format!("response body failed: {e:?}"))?
            .to_bytes();
        Ok(Answer {
            status: parts.status,
            headers: parts.headers,
            body,
        })
    }

    /// `POST url` with a JSON body, an optional key and an optional bearer principal.
    pub async fn post(
        &self,
        url: &str,
        key: Option<&str>,
        principal: Option<&str>,
        json: &str,
    ) -> Answer {
        let auth = principal.map(|p| format!("Bearer {p}"));
        let mut headers = vec![("content-type", "application/json")];
        if let Some(key) = key {
            headers.push(("idempotency-key", key));
        }
        if let Some(auth) = &auth {
            headers.push(("authorization", auth.as_str()));
        }
        self.send(Method::POST, url, &headers, json.to_owned())
            .await
    }

    pub async fn get(&self, url: &str) -> Answer {
        self.send(Method::GET, url, &[], Bytes::new()).await
    }

    /// Executions so far, from `GET /payments/count`.
    pub async fn count(&self, server: &Server) -> u64 {
        self.get(&server.url("/payments/count")).await.json()["count"]
            .as_u64()
            .expect("count")
    }

    /// Charges the payments example's simulated provider actually made, from
    /// `GET /payments/count`: one per payment however often its handler ran.
    pub async fn charges(&self, server: &Server) -> u64 {
        self.get(&server.url("/payments/count")).await.json()["charges"]
            .as_u64()
            .expect("charges")
    }
}

/// The value of the sample `name` whose labels include every pair of `labels`, from a scrape
/// in Prometheus's text format; `None` if there is no such sample.
pub fn metric(scrape: &str, name: &str, labels: &[(&str, &str)]) -> Option<f64> {
    scrape.lines().find_map(|line| {
        let (series, value) = line.rsplit_once(' ')?;
        let (metric, rest) = series.split_once('{').unwrap_or((series, "}"));
        let wanted = labels
            .iter()
            .all(|(k, v)| rest.contains(&format!("{k}=\"{v}\"")));
        (metric == name && wanted).then(|| value.parse().ok())?
    })
}
