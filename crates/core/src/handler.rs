//! Handlers: async functions whose arguments are extractors and whose result is
//! `Result<(), QueueHandlerError>`.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;

use crate::error::QueueHandlerError;
use crate::extract::{Context, FromDelivery, StateNeed};

/// A boxed, sendable future.
pub type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// The result of one handler call.
pub type HandlerResult = Result<(), QueueHandlerError>;

/// An async function usable as a queue handler.
///
/// Implemented for every `async fn(A, B, ...) -> Result<(), QueueHandlerError>` (up to eight
/// arguments) whose arguments implement [`FromDelivery`]. `Args` only tells the impls apart.
#[diagnostic::on_unimplemented(
    message = "`{Self}` is not a Lily handler",
    label = "not a handler",
    note = "a handler is an async fn returning `Result<(), QueueHandlerError>` whose arguments \
            implement `FromDelivery`"
)]
pub trait Handler<Args>: Clone + Send + Sync + 'static {
    /// Extracts the arguments and starts the call. An extractor failure becomes the result
    /// without running the function.
    fn call(&self, cx: Context<'_>) -> BoxFuture<'static, HandlerResult>;

    /// The router state its arguments take ([`State`](crate::State)).
    fn state_needs(&self) -> Vec<StateNeed> {
        Vec::new()
    }
}

macro_rules! impl_handler {
    ($($arg:ident),*) => {
        impl<F, Fut, $($arg,)*> Handler<($($arg,)*)> for F
        where
            F: Fn($($arg),*) -> Fut + Clone + Send + Sync + 'static,
            Fut: Future<Output = HandlerResult> + Send + 'static,
            $($arg: FromDelivery,)*
        {
            #[allow(non_snake_case, unused_variables)]
            fn call(&self, cx: Context<'_>) -> BoxFuture<'static, HandlerResult> {
                $(
                    let $arg = match $arg::from_delivery(&cx) {
                        Ok(value) => value,
                        Err(err) => return Box::pin(std::future::ready(Err(err))),
                    };
                )*
                Box::pin((self)($($arg),*))
            }

            fn state_needs(&self) -> Vec<StateNeed> {
                #[allow(unused_mut)]
                let mut needs = Vec::new();
                $(needs.extend($arg::state_need());)*
                needs
            }
        }
    };
}

impl_handler!();
impl_handler!(A1);
impl_handler!(A1, A2);
impl_handler!(A1, A2, A3);
impl_handler!(A1, A2, A3, A4);
impl_handler!(A1, A2, A3, A4, A5);
impl_handler!(A1, A2, A3, A4, A5, A6);
impl_handler!(A1, A2, A3, A4, A5, A6, A7);
impl_handler!(A1, A2, A3, A4, A5, A6, A7, A8);

/// A handler with its argument types erased.
pub(crate) trait ErasedHandler: Send + Sync + 'static {
    fn call(&self, cx: Context<'_>) -> BoxFuture<'static, HandlerResult>;
}

struct Erased<H, Args> {
    handler: H,
    _args: std::marker::PhantomData<fn() -> Args>,
}

impl<H: Handler<Args>, Args: 'static> ErasedHandler for Erased<H, Args> {
    fn call(&self, cx: Context<'_>) -> BoxFuture<'static, HandlerResult> {
        self.handler.call(cx)
    }
}

/// A type-erased handler, as stored by the router.
#[derive(Clone)]
pub struct BoxedHandler(Arc<dyn ErasedHandler>);

impl BoxedHandler {
    /// Erases a handler.
    pub fn new<H: Handler<Args>, Args: 'static>(handler: H) -> Self {
        Self(Arc::new(Erased {
            handler,
            _args: std::marker::PhantomData,
        }))
    }

    /// Calls the handler.
    pub fn call(&self, cx: Context<'_>) -> BoxFuture<'static, HandlerResult> {
        self.0.call(cx)
    }
}

impl std::fmt::Debug for BoxedHandler {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("BoxedHandler")
    }
}
