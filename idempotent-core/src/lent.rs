//! [`Lent`]: a future kept where its owner pinned it, polled and dropped by a borrower.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

/// A future pinned where its owner keeps it (in an `Option`, `None` once dropped), lent to
/// another future that polls it in the owner's place.
///
/// A large future (a handler's, with its request) costs a copy each time it moves, and a
/// future that takes it by value as an `async fn` argument holds it twice: once as the
/// argument, once where it is moved to. Lent, it stays where it is. The borrower drops it in
/// place as the owner would have: as soon as it is ready, when [`stop`](Lent::stop) is called,
/// and when the `Lent` itself is dropped, never later than if the borrower owned it.
///
/// ```
/// use std::pin::pin;
/// use idempotent_core::Lent;
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() {
/// let mut place = pin!(Some(async { 7 }));
/// assert_eq!(Lent::new(place.as_mut()).await, 7);
/// // Ready, it was dropped where it stood.
/// assert!(place.is_none());
/// # }
/// ```
#[must_use = "a future does nothing unless awaited"]
pub struct Lent<'a, F>(Pin<&'a mut Option<F>>);

impl<'a, F> Lent<'a, F> {
    /// Lends the future in `place`.
    pub fn new(place: Pin<&'a mut Option<F>>) -> Self {
        Lent(place)
    }

    /// Drops the future where it stands, unfinished.
    pub fn stop(&mut self) {
        self.0.set(None);
    }
}

impl<F: Future> Future for Lent<'_, F> {
    type Output = F::Output;

    /// Polls the lent future; once it is ready, drops it.
    ///
    /// # Panics
    ///
    /// If polled after it returned its output, after [`stop`](Lent::stop), or when its
    /// place was empty from the start.
    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<F::Output> {
        let this = self.get_mut();
        let future = this
            .0
            .as_mut()
            .as_pin_mut()
            .expect("a lent future is not polled after it ended");
        let output = std::task::ready!(future.poll(cx));
        this.0.set(None);
        Poll::Ready(output)
    }
}

impl<F> Drop for Lent<'_, F> {
    fn drop(&mut self) {
        self.0.set(None);
    }
}

impl<F> fmt::Debug for Lent<'_, F> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Lent")
            .field("finished", &self.0.is_none())
            .finish()
    }
}
