//! `#[derive(ContentHash)]`: structs hash their fields in order; enums hash the variant index,
//! then its fields.

use proc_macro2::{Span, TokenStream};
use quote::{format_ident, quote, quote_spanned};
use syn::spanned::Spanned;

use crate::bound;
use crate::ctxt::Ctxt;

pub(crate) fn expand(input: &syn::DeriveInput) -> TokenStream {
    let cx = Ctxt::new();
    let name = &input.ident;
    let trait_path = quote!(::nitro::__private::ContentHash);
    let hasher = format_ident!("__hasher");

    let (body, field_types): (TokenStream, Vec<&syn::Type>) = match &input.data {
        syn::Data::Struct(s) => {
            let (pattern, writes) = destructure(&s.fields, &hasher);
            let types = s.fields.iter().map(|f| &f.ty).collect();
            (
                quote! {
                    let #name #pattern = self;
                    #writes
                },
                types,
            )
        }
        syn::Data::Enum(e) => {
            let arms = e.variants.iter().enumerate().map(|(index, v)| {
                let index = index as u32;
                let variant = &v.ident;
                let (pattern, writes) = destructure(&v.fields, &hasher);
                // What a miss reason prints for the variant (`Relu`, `Scale(…)`).
                let shown = match &v.fields {
                    syn::Fields::Unit => variant.to_string(),
                    syn::Fields::Unnamed(_) => format!("{variant}(…)"),
                    syn::Fields::Named(_) => format!("{variant} {{ … }}"),
                };
                quote! {
                    #name::#variant #pattern => {
                        #hasher.show(|| ::std::borrow::ToOwned::to_owned(#shown));
                        #hasher.write_variant(#index);
                        #writes
                    }
                }
            });
            let types = e
                .variants
                .iter()
                .flat_map(|v| &v.fields)
                .map(|f| &f.ty)
                .collect();
            let body = if e.variants.is_empty() {
                quote!(match *self {})
            } else {
                quote!(match self { #(#arms)* })
            };
            (body, types)
        }
        syn::Data::Union(u) => {
            cx.error_at(
                u.union_token,
                "ContentHash cannot be derived for a union: which field is live is not known, so \
                 its contents cannot be hashed; use an enum",
            );
            (quote!(), Vec::new())
        }
    };
    let errors = cx.finish();
    if !errors.is_empty() {
        return errors;
    }

    let (impl_generics, ty_generics, _) = input.generics.split_for_impl();
    let where_clause = bound::where_clause_with(&input.generics, &field_types, &trait_path);
    quote! {
        #[automatically_derived]
                impl #impl_generics #trait_path for #name #ty_generics #where_clause {
            #[allow(unused_variables)]
            fn content_hash(&self, #hasher: &mut ::nitro::__private::ContentHasher) {
                #body
            }
        }
    }
}

/// A pattern binding every field (`{ a: __f0, b: __f1 }` or `(__f0, __f1)`), and the writes
/// of each binding, each spanned at its field's type so an unhashable field is reported there.
/// Each write is one named field of the hasher's (the same bytes; a recording hasher makes it
/// the part `….a`, see `ContentHasher::parts_of`).
fn destructure(fields: &syn::Fields, hasher: &syn::Ident) -> (TokenStream, TokenStream) {
    let bindings: Vec<syn::Ident> = (0..fields.len())
        .map(|i| syn::Ident::new(&format!("__f{i}"), Span::call_site()))
        .collect();
    let writes = fields.iter().zip(&bindings).enumerate().map(|(i, (f, b))| {
        let ty = &f.ty;
        let name = f.ident.as_ref().map_or_else(
            || i.to_string(),
            |ident| ident.to_string().trim_start_matches("r#").to_owned(),
        );
        quote_spanned!(ty.span()=> #hasher.field(#name, |#hasher| {
            <#ty as ::nitro::__private::ContentHash>::content_hash(#b, #hasher)
        });)
    });
    let writes = quote!(#(#writes)*);
    let pattern = match fields {
        syn::Fields::Named(named) => {
            let names = named.named.iter().map(|f| &f.ident);
            quote!({ #(#names: #bindings),* })
        }
        syn::Fields::Unnamed(_) => quote!(( #(#bindings),* )),
        syn::Fields::Unit => quote!(),
    };
    (pattern, writes)
}
