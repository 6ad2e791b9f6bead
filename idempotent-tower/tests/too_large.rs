//! Over-limit request bodies over real connections: an HTTP/1.1 client still sending its body
//! must read the whole `413` problem document, not a connection reset.

use std::io;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use axum::Router;
use axum::body::{Body, Bytes};
use axum::routing::post;
use axum::serve::ListenerExt;
use http::{Request, StatusCode};
use idempotent_core::{Idempotency, MemoryStore};
use idempotent_tower::{DEFAULT_MAX_REQUEST_BODY, IdempotencyLayer, Principal};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::task::JoinHandle;
use tower::util::MapRequestLayer;

const LIMIT: usize = DEFAULT_MAX_REQUEST_BODY;
const TWO_MIB: usize = 2 << 20;
/// The size of each write, as curl sends a file.
const WRITE: usize = 64 * 1024;
/// No exchange takes longer than this unless something is wrong.
const DEADLINE: Duration = Duration::from_secs(30);

const GRPC_METHOD: &str = "/test.v1.Orders/Create";

/// A server on 127.0.0.1: the layer in front of a handler that takes a moment (`/orders`) and
/// a unary gRPC method, behind a middleware that authenticates every request.
struct Server {
    port: u16,
    runs: Arc<AtomicUsize>,
    connections: Arc<AtomicUsize>,
    task: JoinHandle<()>,
}

impl Drop for Server {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl Server {
    fn runs(&self) -> usize {
        self.runs.load(Ordering::SeqCst)
    }

    fn connections(&self) -> usize {
        self.connections.load(Ordering::SeqCst)
    }
}

async fn serve(layer: IdempotencyLayer) -> Server {
    let runs = Arc::new(AtomicUsize::new(0));
    let (orders, calls) = (Arc::clone(&runs), Arc::clone(&runs));
    let app = Router::new()
        .route(
            "/orders",
            post(move |body: Bytes| async move {
                tokio::time::sleep(Duration::from_millis(20)).await;
                orders.fetch_add(1, Ordering::SeqCst);
                (StatusCode::CREATED, body.len().to_string())
            }),
        )
        .route(
            GRPC_METHOD,
            post(move || async move {
                calls.fetch_add(1, Ordering::SeqCst);
                [("content-type", "application/grpc"), ("grpc-status", "0")]
            }),
        )
        .layer(layer)
        .layer(MapRequestLayer::new(|mut request: Request<Body>| {
            request.extensions_mut().insert(Principal::new("client"));
            request
        }));
    let connections = Arc::new(AtomicUsize::new(0));
    let accepted = Arc::clone(&connections);
    let listener = tokio::net::TcpListener::bind(("127.0.0.1", 0))
        .await
        .unwrap();
    let port = listener.local_addr().unwrap().port();
    let listener = listener.tap_io(move |_| {
        accepted.fetch_add(1, Ordering::SeqCst);
    });
    let task = tokio::spawn(async move {
        axum::serve(listener, app).await.unwrap();
    });
    Server {
        port,
        runs,
        connections,
        task,
    }
}

/// How the body is framed on the wire.
#[derive(Clone, Copy, Debug)]
enum Framing {
    Length,
    Chunked,
}

/// The request head for a body of `len` bytes.
fn head(framing: Framing, len: usize, key: &str, extra: &str) -> Vec<u8> {
    let framing = match framing {
        Framing::Length => format!("content-length: {len}\r\n"),
        Framing::Chunked => "transfer-encoding: chunked\r\n".to_owned(),
    };
    format!(
        "POST /orders HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/octet-stream\r\n\
         idempotency-key: {key}\r\n{framing}{extra}\r\n"
    )
    .into_bytes()
}

/// The body bytes as sent: as is, or in chunks of `piece` bytes, with the closing chunk if
/// `finish`.
fn encode(framing: Framing, len: usize, piece: usize, finish: bool) -> Vec<u8> {
    match framing {
        Framing::Length => vec![b'x'; len],
        Framing::Chunked => {
            let mut out = Vec::with_capacity(len + len / piece * 16 + 16);
            let mut left = len;
            while left > 0 {
                let n = left.min(piece);
                out.extend_from_slice(format!("{n:x}\r\n").as_bytes());
                out.resize(out.len() + n, b'x');
                out.extend_from_slice(b"\r\n");
                left -= n;
            }
            if finish {
                out.extend_from_slice(b"0\r\n\r\n");
            }
            out
        }
    }
}

/// A response as read off the socket.
#[derive(Debug)]
struct Answer {
    status: u16,
    headers: Vec<(String, String)>,
    body: Vec<u8>,
}

impl Answer {
    fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }

    fn closes(&self) -> bool {
        self.header("connection")
            .is_some_and(|v| v.eq_ignore_ascii_case("close"))
    }

    /// The `code` of a problem document; panics if the body is not one.
    fn code(&self) -> String {
        assert_eq!(
            self.header("content-type"),
            Some("application/problem+json"),
            "{self:?}"
        );
        let document: serde_json::Value = serde_json::from_slice(&self.body).unwrap();
        assert_eq!(document["status"], self.status, "{document}");
        document["code"].as_str().unwrap().to_owned()
    }

    fn assert_too_large(&self) {
        assert_eq!(self.status, 413, "{self:?}");
        assert_eq!(self.code(), "request_too_large");
    }
}

/// Reads one complete response (head and `Content-Length` body) and nothing more.
async fn read_answer(reader: &mut (impl AsyncReadExt + Unpin)) -> Result<Answer, String> {
    let mut buf = Vec::new();
    let mut chunk = [0u8; 8192];
    let mut fill = async |buf: &mut Vec<u8>| match reader.read(&mut chunk).await {
        Ok(0) => Err(format!("connection closed after {} bytes", buf.len())),
        Ok(n) => {
            buf.extend_from_slice(&chunk[..n]);
            Ok(())
        }
        Err(e) => Err(format!("{e} ({:?}) after {} bytes", e.kind(), buf.len())),
    };
    let end = loop {
        if let Some(at) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            break at;
        }
        fill(&mut buf).await?;
    };
    let text = std::str::from_utf8(&buf[..end]).map_err(|e| e.to_string())?;
    let mut lines = text.split("\r\n");
    let status_line = lines.next().unwrap_or_default();
    let status = status_line
        .strip_prefix("HTTP/1.1 ")
        .and_then(|rest| rest.get(..3))
        .and_then(|code| code.parse().ok())
        .ok_or_else(|| format!("bad status line {status_line:?}"))?;
    let headers: Vec<(String, String)> = lines
        .filter_map(|line| line.split_once(':'))
        .map(|(n, v)| (n.trim().to_owned(), v.trim().to_owned()))
        .collect();
    let mut answer = Answer {
        status,
        headers,
        body: Vec::new(),
    };
    let len: usize = match answer.header("content-length") {
        Some(len) => len.parse().map_err(|_| format!("bad length {len:?}"))?,
        None if status < 200 => 0,
        None => return Err(format!("no content-length: {answer:?}")),
    };
    let start = end + 4;
    while buf.len() < start + len {
        fill(&mut buf).await?;
    }
    answer.body = buf[start..start + len].to_vec();
    Ok(answer)
}

/// Sends `head`, then `body` in 64 KiB writes while reading the response, the way curl does;
/// returns the response and how the sending ended.
async fn exchange(
    stream: &mut TcpStream,
    head: &[u8],
    body: &[u8],
) -> Result<(Answer, io::Result<()>), String> {
    let (mut reader, mut writer) = stream.split();
    let send = async {
        writer.write_all(head).await?;
        for piece in body.chunks(WRITE) {
            writer.write_all(piece).await?;
        }
        writer.flush().await
    };
    let both = async { tokio::join!(read_answer(&mut reader), send) };
    let (answer, sent) = tokio::time::timeout(DEADLINE, both)
        .await
        .map_err(|_| "no answer before the deadline".to_owned())?;
    Ok((answer?, sent))
}

async fn connect(server: &Server) -> TcpStream {
    TcpStream::connect(("127.0.0.1", server.port))
        .await
        .unwrap()
}

/// One over-limit request on a fresh connection, which must neither fail to send nor fail to read.
async fn oversized(server: &Server, framing: Framing, key: &str) -> Result<Answer, String> {
    let mut stream = connect(server).await;
    let (answer, sent) = exchange(
        &mut stream,
        &head(framing, TWO_MIB, key, ""),
        &encode(framing, TWO_MIB, WRITE, true),
    )
    .await?;
    // curl and most HTTP libraries give up when a write fails and never read the answer.
    sent.map_err(|e| format!("sending the body failed: {e}"))?;
    Ok(answer)
}

/// Runs `n` over-limit requests one after another; returns the failures.
async fn repeat(server: &Server, framing: Framing, n: usize) -> Vec<String> {
    let mut failures = Vec::new();
    for i in 0..n {
        match oversized(server, framing, &format!("{framing:?}-{i}")).await {
            Ok(answer) => answer.assert_too_large(),
            Err(failure) => failures.push(failure),
        }
    }
    failures
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_declared_over_limit_body_gets_a_readable_413() {
    let server = serve(layer()).await;
    let failures = repeat(&server, Framing::Length, 50).await;
    assert!(
        failures.is_empty(),
        "{} of 50 clients were reset or did not read the 413: {failures:?}",
        failures.len()
    );
    assert_eq!(server.runs(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_chunked_over_limit_body_gets_a_readable_413() {
    let server = serve(layer()).await;
    let failures = repeat(&server, Framing::Chunked, 50).await;
    assert!(
        failures.is_empty(),
        "{} of 50 clients were reset or did not read the 413: {failures:?}",
        failures.len()
    );
    assert_eq!(server.runs(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn over_limit_bodies_get_a_readable_413_under_load() {
    let server = Arc::new(serve(layer()).await);
    let clients: Vec<_> = (0..8)
        .map(|client| {
            let server = Arc::clone(&server);
            tokio::spawn(async move {
                let mut failures = Vec::new();
                for i in 0..8 {
                    let framing = if (client + i) % 2 == 0 {
                        Framing::Length
                    } else {
                        Framing::Chunked
                    };
                    match oversized(&server, framing, &format!("load-{client}-{i}")).await {
                        Ok(answer) => answer.assert_too_large(),
                        Err(failure) => failures.push(failure),
                    }
                }
                failures
            })
        })
        .collect();
    let mut failures = Vec::new();
    for client in clients {
        failures.extend(client.await.unwrap());
    }
    assert!(
        failures.is_empty(),
        "{} of 64 clients were reset or did not read the 413: {failures:?}",
        failures.len()
    );
    assert_eq!(server.runs(), 0);
}
