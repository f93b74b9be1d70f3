//! Collects errors so every problem of one item is reported in one compile.

use std::cell::RefCell;

use proc_macro2::TokenStream;
use quote::ToTokens;

/// An error collector. Push errors while checking; [`Ctxt::finish`] returns them combined.
pub(crate) struct Ctxt {
    errors: RefCell<Vec<syn::Error>>,
}

impl Ctxt {
    pub(crate) fn new() -> Self {
        Ctxt {
            errors: RefCell::new(Vec::new()),
        }
    }

    /// Records an error spanned at `at`'s tokens.
    pub(crate) fn error_at<T: ToTokens, M: std::fmt::Display>(&self, at: T, msg: M) {
        self.errors
            .borrow_mut()
            .push(syn::Error::new_spanned(at.into_token_stream(), msg));
    }

    /// Records a ready error.
    pub(crate) fn push(&self, err: syn::Error) {
        self.errors.borrow_mut().push(err);
    }

    /// The collected errors as `compile_error!` invocations (empty when there were none).
    pub(crate) fn finish(self) -> TokenStream {
        self.errors
            .into_inner()
            .into_iter()
            .map(|e| e.to_compile_error())
            .collect()
    }
}
