//! Helpers for generics: which types mention a type parameter, and where-clause building.

use std::collections::BTreeSet;

use proc_macro2::TokenStream;
use quote::{quote_spanned, ToTokens};
use syn::spanned::Spanned;
use syn::visit::Visit;

/// The names of `generics`' parameters: types, consts, and lifetimes (with their `'`).
pub(crate) fn generic_params(generics: &syn::Generics) -> BTreeSet<String> {
    generics
        .params
        .iter()
        .map(|p| match p {
            syn::GenericParam::Type(t) => t.ident.to_string(),
            syn::GenericParam::Const(c) => c.ident.to_string(),
            syn::GenericParam::Lifetime(l) => l.lifetime.to_string(),
        })
        .collect()
}

/// Whether `ty` mentions one of `params` (`T`, `Vec<T>`, `T::Item`, `[u8; N]`, `&'a X`).
pub(crate) fn mentions(ty: &syn::Type, params: &BTreeSet<String>) -> bool {
    struct Finder<'a> {
        params: &'a BTreeSet<String>,
        found: bool,
    }
    impl<'ast> Visit<'ast> for Finder<'_> {
        fn visit_path(&mut self, path: &'ast syn::Path) {
            if let Some(first) = path.segments.first() {
                if self.params.contains(&first.ident.to_string()) {
                    self.found = true;
                }
            }
            syn::visit::visit_path(self, path);
        }
        fn visit_lifetime(&mut self, lifetime: &'ast syn::Lifetime) {
            if self.params.contains(&lifetime.to_string()) {
                self.found = true;
            }
        }
    }
    let mut f = Finder {
        params,
        found: false,
    };
    f.visit_type(ty);
    f.found
}

/// A where clause: `generics`' own predicates plus `Ty: Trait` for each given field type that
/// mentions a type parameter. Each added predicate is spanned at its field type.
pub(crate) fn where_clause_with(
    generics: &syn::Generics,
    field_types: &[&syn::Type],
    trait_path: &TokenStream,
) -> TokenStream {
    let params = generic_params(generics);
    let own = generics
        .where_clause
        .as_ref()
        .map(|w| {
            w.predicates
                .iter()
                .map(|p| p.to_token_stream())
                .collect::<Vec<_>>()
        })
        .unwrap_or_default();
    let added = field_types
        .iter()
        .filter(|ty| mentions(ty, &params))
        .map(|ty| quote_spanned!(ty.span()=> #ty: #trait_path));
    let all: Vec<TokenStream> = own.into_iter().chain(added).collect();
    if all.is_empty() {
        TokenStream::new()
    } else {
        quote::quote!(where #(#all),*)
    }
}

/// The type's text with all whitespace removed (`Vec<Dense>`), as it enters schema digests and docs.
pub(crate) fn type_text(ty: &syn::Type) -> String {
    ty.to_token_stream()
        .to_string()
        .chars()
        .filter(|c| !c.is_whitespace())
        .collect()
}
