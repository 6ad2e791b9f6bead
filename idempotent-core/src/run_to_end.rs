//! [`RunToEnd`]: a future that, dropped before it finishes, finishes on a task of its own.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

/// A future that runs to its end even if the one awaiting it goes away.
///
/// A utility for work that must not stop half-way once it has begun (recording the outcome of
/// work that ran, or a request whose handler already runs): awaited, it is polled in place and
/// costs nothing more than the boxed future it holds; dropped before it finishes, the rest of
/// it is spawned onto the current tokio runtime and runs there to its end, its output dropped.
///
/// Two cases drop it unfinished instead:
///
/// - outside a tokio runtime there is nowhere to spawn it;
/// - while a panic unwinds (the panic may have left what it holds unusable).
///
/// Whatever it holds is then dropped with it, so its own `Drop` cleans up (a claim it holds is
/// released, or ends with its lease).
///
/// ```
/// use std::sync::Arc;
/// use std::sync::atomic::{AtomicBool, Ordering};
/// use std::time::Duration;
/// use idempotent_core::RunToEnd;
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() {
/// let recorded = Arc::new(AtomicBool::new(false));
/// let record = RunToEnd::new({
///     let recorded = Arc::clone(&recorded);
///     async move {
///         tokio::time::sleep(Duration::from_millis(10)).await;
///         recorded.store(true, Ordering::SeqCst);
///     }
/// });
/// // The caller stops waiting after a millisecond; the record is written all the same.
/// let _ = tokio::time::timeout(Duration::from_millis(1), record).await;
/// tokio::time::sleep(Duration::from_millis(50)).await;
/// assert!(recorded.load(Ordering::SeqCst));
/// # }
/// ```
#[must_use = "a future does nothing unless awaited or dropped inside a runtime"]
pub struct RunToEnd<T: 'static> {
    /// `None` once it has finished.
    future: Option<Pin<Box<dyn Future<Output = T> + Send>>>,
}

impl<T: 'static> RunToEnd<T> {
    /// `future`, to be run to its end.
    pub fn new(future: impl Future<Output = T> + Send + 'static) -> Self {
        RunToEnd {
            future: Some(Box::pin(future)),
        }
    }

    /// Like [`new`](Self::new), with the future `make` returns made for its box
    /// (`Box::write` into a new box), which lets the optimizer build it there: a large future
    /// (an HTTP request's is several kilobytes) made by the caller and then given to `new` is
    /// copied into the box whole, whatever part of it is in use yet.
    pub fn new_with<F>(make: impl FnOnce() -> F) -> Self
    where
        F: Future<Output = T> + Send + 'static,
    {
        let future: Box<F> = Box::write(Box::new_uninit(), make());
        RunToEnd {
            future: Some(Box::into_pin(future)),
        }
    }
}

impl<T: 'static> Future for RunToEnd<T> {
    type Output = T;

    /// # Panics
    ///
    /// If polled again after it returned its output.
    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<T> {
        let future = self
            .future
            .as_mut()
            .expect("RunToEnd polled after completion");
        let output = std::task::ready!(future.as_mut().poll(cx));
        self.future = None;
        Poll::Ready(output)
    }
}

impl<T: 'static> Drop for RunToEnd<T> {
    fn drop(&mut self) {
        let Some(future) = self.future.take() else {
            return;
        };
        if std::thread::panicking() {
            return;
        }
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            tracing::debug!("dropped before its end; finishing on a task of its own");
            runtime.spawn(async move {
                future.await;
            });
        }
    }
}

impl<T: 'static> fmt::Debug for RunToEnd<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RunToEnd")
            .field("finished", &self.future.is_none())
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::time::Duration;

    use tokio::sync::oneshot;

    use super::*;

    /// Counts its runs to the end, and its drops (finished or not).
    struct Probe {
        ended: AtomicUsize,
        dropped: AtomicUsize,
    }

    impl Probe {
        fn new() -> Arc<Self> {
            Arc::new(Probe {
                ended: AtomicUsize::new(0),
                dropped: AtomicUsize::new(0),
            })
        }

        /// Work that waits for `go`, then counts its end; dropping it counts a drop.
        fn work(self: &Arc<Self>, go: oneshot::Receiver<()>) -> impl Future<Output = u32> + use<> {
            struct Dropped(Arc<Probe>);
            impl Drop for Dropped {
                fn drop(&mut self) {
                    self.0.dropped.fetch_add(1, Ordering::SeqCst);
                }
            }
            let dropped = Dropped(Arc::clone(self));
            async move {
                let guard = dropped;
                let _ = go.await;
                guard.0.ended.fetch_add(1, Ordering::SeqCst);
                7
            }
        }

        fn ended(&self) -> usize {
            self.ended.load(Ordering::SeqCst)
        }

        fn dropped(&self) -> usize {
            self.dropped.load(Ordering::SeqCst)
        }
    }

    #[tokio::test]
    async fn awaited_it_gives_its_output() {
        let probe = Probe::new();
        let (go, wait) = oneshot::channel();
        go.send(()).unwrap();
        assert_eq!(RunToEnd::new(probe.work(wait)).await, 7);
        assert_eq!((probe.ended(), probe.dropped()), (1, 1));
    }

    #[tokio::test]
    async fn dropped_inside_a_runtime_it_finishes_on_a_task() {
        dropped_and_finished(RunToEnd::new).await;
    }

    #[tokio::test]
    async fn made_in_its_box_and_dropped_it_finishes_on_a_task() {
        dropped_and_finished(|future| RunToEnd::new_with(|| future)).await;
    }

    type Work = Pin<Box<dyn Future<Output = u32> + Send>>;

    async fn dropped_and_finished(make: impl FnOnce(Work) -> RunToEnd<u32>) {
        let probe = Probe::new();
        let (go, wait) = oneshot::channel();
        let mut future = make(Box::pin(probe.work(wait)));
        // Polled once, so it has begun; then abandoned.
        assert!(poll_once(&mut future).await.is_pending());
        drop(future);
        assert_eq!(probe.ended(), 0);
        go.send(()).unwrap();
        tokio::time::timeout(Duration::from_secs(5), async {
            while probe.ended() == 0 {
                tokio::task::yield_now().await;
            }
        })
        .await
        .expect("the abandoned future finished on its own task");
        assert_eq!(probe.ended(), 1);
    }

    #[test]
    fn dropped_outside_a_runtime_it_is_dropped_without_a_panic() {
        let probe = Probe::new();
        let (_go, wait) = oneshot::channel();
        drop(RunToEnd::new(probe.work(wait)));
        assert_eq!((probe.ended(), probe.dropped()), (0, 1));
    }

    #[tokio::test]
    async fn dropped_while_a_panic_unwinds_it_is_dropped() {
        let probe = Probe::new();
        let (_go, wait) = oneshot::channel();
        let future = RunToEnd::new(probe.work(wait));
        let unwound = std::panic::catch_unwind(std::panic::AssertUnwindSafe(move || {
            let _future = future;
            panic!("the caller panicked");
        }));
        assert!(unwound.is_err());
        assert_eq!((probe.ended(), probe.dropped()), (0, 1));
    }

    /// Polls `future` once.
    async fn poll_once<F: Future + Unpin>(future: &mut F) -> Poll<F::Output> {
        std::future::poll_fn(|cx| Poll::Ready(Pin::new(&mut *future).poll(cx))).await
    }
}
