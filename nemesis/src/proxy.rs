//! A load balancer in front of the two `payments` instances, for the `payments_client`
//! batches (which take one URL): each connection goes to the next instance that accepts it,
//! round robin, and its bytes are copied both ways until either side closes.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use tokio::net::{TcpListener, TcpStream};

pub(crate) struct Proxy {
    pub(crate) url: String,
    task: tokio::task::JoinHandle<()>,
}

impl Proxy {
    /// Listens on a free loopback port and forwards to `backends` (`127.0.0.1:PORT` each).
    pub(crate) async fn start(backends: Vec<String>) -> Result<Proxy, String> {
        let listener = TcpListener::bind(("127.0.0.1", 0))
            .await
            .map_err(|e| format!("the load balancer cannot listen: {e}"))?;
        let port = listener
            .local_addr()
            .map_err(|e| format!("the load balancer's address: {e}"))?
            .port();
        let backends = Arc::new(backends);
        let next = Arc::new(AtomicUsize::new(0));
        let task = tokio::spawn(async move {
            loop {
                let Ok((mut client, _)) = listener.accept().await else {
                    continue;
                };
                let (backends, next) = (Arc::clone(&backends), Arc::clone(&next));
                tokio::spawn(async move {
                    // The next instance that takes the connection (a killed one refuses).
                    for _ in 0..backends.len() {
                        let i = next.fetch_add(1, Ordering::Relaxed) % backends.len();
                        let connect = TcpStream::connect(backends[i].as_str());
                        if let Ok(Ok(mut server)) =
                            tokio::time::timeout(Duration::from_secs(1), connect).await
                        {
                            let _ = tokio::io::copy_bidirectional(&mut client, &mut server).await;
                            return;
                        }
                    }
                });
            }
        });
        Ok(Proxy {
            url: format!("http://127.0.0.1:{port}"),
            task,
        })
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.task.abort();
    }
}
