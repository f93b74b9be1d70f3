//! Expansion of a checked `#[experiment]` struct.

use proc_macro2::TokenStream;
use quote::{format_ident, quote, quote_spanned, ToTokens};
use syn::spanned::Spanned;

use super::ast::{Field, Role};
use super::docs;
use crate::bound::{self, type_text};

pub(crate) fn expand(input: &mut syn::DeriveInput, fields: &[Field]) -> TokenStream {
    let p = quote!(::nitro::__private);
    let name = input.ident.clone();
    let view = format_ident!("{}View", name);
    let vis = input.vis.clone();
    let lt = syn::Lifetime::new("'__nitro", proc_macro2::Span::call_site());

    let key_docs = docs::compile_key_section(&name, fields);
    let struct_attrs = std::mem::take(&mut input.attrs);
    let struct_tokens = {
        // Re-emit the struct (markers already stripped) with the compile-key section appended.
        let item = &*input;
        quote!(#(#struct_attrs)* #key_docs #item)
    };

    let graph_consts: Vec<&Field> = fields
        .iter()
        .filter(|f| f.role == Role::GraphConst)
        .collect();
    let devices: Vec<(usize, &Field)> = fields
        .iter()
        .enumerate()
        .filter(|(_, f)| f.role.is_device())
        .collect();

    // ---- the view types ------------------------------------------------------------------
    let (view_struct, view_args) = view_type(
        input,
        fields,
        (&view, &docs::view_doc(&name), &lt),
        |r| r != Role::Host,
        true,
    );
    let frozen_view = format_ident!("{}FrozenView", name);
    let (frozen_struct, _) = view_type(
        input,
        fields,
        (&frozen_view, &docs::frozen_view_doc(&name), &lt),
        |r| matches!(r, Role::GraphConst | Role::Frozen),
        false,
    );

    // ---- impl Experiment -----------------------------------------------------------------
    let (impl_generics, ty_generics, _) = input.generics.split_for_impl();
    let gc_types: Vec<&syn::Type> = graph_consts.iter().map(|f| &f.ty).collect();
    let dev_types: Vec<&syn::Type> = devices.iter().map(|(_, f)| &f.ty).collect();
    let where_gc = bound::where_clause_with(&input.generics, &gc_types, &quote!(#p::ContentHash));
    let where_all = extend_where(
        where_gc,
        &bound::where_clause_with(&strip_where(&input.generics), &dev_types, &quote!(#p::Tree)),
    );

    let field_infos = fields.iter().map(|f| {
        let n = &f.name;
        let t = type_text(&f.ty);
        let role = f.role.tokens();
        quote!(#p::FieldInfo { name: #n, ty: #t, role: #role })
    });
    let schema = schema_digest(&name, fields);

    let gc_digests = graph_consts.iter().map(|f| {
        let ident = &f.ident;
        let ty = &f.ty;
        let n = &f.name;
        quote_spanned!(ty.span()=> (#n, graph_const_must_be_content_hash::<#ty>(&self.#ident)))
    });

    let gc_parts = graph_consts.iter().map(|f| {
        let ident = &f.ident;
        let n = &f.name;
        quote!(::core::iter::Extend::extend(
            &mut __parts,
            (&#p::PartsProbe(&self.#ident)).nitro_parts(#n),
        );)
    });

    let gc_values = graph_consts.iter().map(|f| {
        let ident = &f.ident;
        let n = &f.name;
        quote!((#n, (&#p::DebugProbe(&self.#ident)).nitro_print()))
    });

    let visit = devices.iter().map(|(i, f)| {
        let (ident, ty, n) = (&f.ident, &f.ty, &f.name);
        quote_spanned!(ty.span()=>
            <#ty as #p::Tree>::visit(&self.#ident, &mut #p::LeafPath::root(#n), &mut |__path, __node| {
                __f(&<Self as #p::Experiment>::FIELDS[#i], __path, __node)
            });
        )
    });
    let visit_mut = devices.iter().map(|(i, f)| {
        let (ident, ty, n) = (&f.ident, &f.ty, &f.name);
        quote_spanned!(ty.span()=>
            <#ty as #p::Tree>::visit_mut(&mut self.#ident, &mut #p::LeafPath::root(#n), &mut |__path, __leaf| {
                __f(&<Self as #p::Experiment>::FIELDS[#i], __path, __leaf)
            });
        )
    });
    let build_view = |include: fn(Role) -> bool| {
        let p = p.clone();
        fields
            .iter()
            .enumerate()
            .filter(move |(_, f)| include(f.role))
            .filter_map(move |(i, f)| {
                let (ident, ty, n) = (&f.ident, &f.ty, &f.name);
                // Spanned at the type, like the view's field, so a non-tree type is one error.
                let mut ident_at_ty = ident.clone();
                ident_at_ty.set_span(ty.span());
                match f.role {
                    Role::GraphConst => Some(quote!(#ident: &self.#ident)),
                    Role::Device { .. } | Role::Frozen => Some(quote_spanned!(ty.span()=>
                        #ident_at_ty: <#ty as #p::Tree>::mirror(&self.#ident, &mut #p::LeafPath::root(#n), &mut |__path, __leaf| {
                            __leaf_fn(&<Self as #p::Experiment>::FIELDS[#i], __path, __leaf)
                        })
                    )),
                    Role::Host => None,
                }
            })
    };
    // The full view's placeholders of the Host fields (see `view_type`).
    let host_placeholders = fields.iter().filter(|f| f.role == Role::Host).map(|f| {
        let ident = &f.ident;
        quote!(#ident: #p::HostField)
    });
    let build_full_view = build_view(|r| r != Role::Host).chain(host_placeholders);
    let build_frozen_view = build_view(|r| matches!(r, Role::GraphConst | Role::Frozen));

    // A struct without generic parameters is 'static: its TypeId is there to take.
    let type_identity = if input.generics.params.is_empty() {
        quote! {
            fn type_identity() -> ::core::option::Option<::core::any::TypeId> {
                ::core::option::Option::Some(::core::any::TypeId::of::<Self>())
            }
        }
    } else {
        quote!()
    };

    quote! {
        #struct_tokens

        #view_struct

        #frozen_struct

        impl #impl_generics #name #ty_generics #where_all {
            /// Declares a program of this experiment: a `fn` over its compile view and traced
            /// inputs of type `M`, returning `O`. Generated by `#[experiment]`.
            #[allow(dead_code)]
            #vis const fn program<__M, __O: ::nitro::program::Outputs>(
                name: &'static ::core::primitive::str,
                f: for<#lt> fn(&#view #view_args, &__M) -> __O,
            ) -> ::nitro::program::Program<Self, __M, __O> {
                ::nitro::program::Program::new(name, f)
            }
        }

        const _: () = {
            #[automatically_derived]
            impl #impl_generics #p::Experiment for #name #ty_generics #where_all {
                const TYPE_PATH: &'static ::core::primitive::str =
                    ::core::concat!(::core::module_path!(), "::", ::core::stringify!(#name));
                const FIELDS: &'static [#p::FieldInfo] = &[#(#field_infos),*];
                const SCHEMA_DIGEST: #p::Digest = #p::Digest::from_bytes(#schema);

                type View<#lt> = #view #view_args where Self: #lt;

                type ProgramFn<__M, __O> = for<#lt> fn(&#view #view_args, &__M) -> __O;

                fn erase_program<__M, __O>(
                    __f: for<#lt> fn(&<Self as #p::Experiment>::View<#lt>, &__M) -> __O,
                ) -> Self::ProgramFn<__M, __O>
                where
                    Self: 'static,
                {
                    __f
                }

                fn program_address<__M, __O>(__f: Self::ProgramFn<__M, __O>) -> ::core::primitive::usize {
                    __f as ::core::primitive::usize
                }

                #type_identity

                fn call_program<#lt, __M, __O>(
                    __f: Self::ProgramFn<__M, __O>,
                    __view: &Self::View<#lt>,
                    __inputs: &__M,
                ) -> __O
                where
                    Self: #lt,
                {
                    __f(__view, __inputs)
                }

                fn graph_const_field_digests(&self) -> #p::Vec<(&'static ::core::primitive::str, #p::Digest)> {
                    fn graph_const_must_be_content_hash<T: ?::core::marker::Sized + #p::ContentHash>(
                        value: &T,
                    ) -> #p::Digest {
                        #p::Digest::of(value)
                    }
                    ::std::vec![#(#gc_digests),*]
                }

                fn graph_const_field_parts(&self) -> #p::Vec<#p::Part> {
                    #[allow(unused_imports)]
                    use #p::{HasParts as _, NoParts as _};
                    #[allow(unused_mut)]
                    let mut __parts = #p::Vec::new();
                    #(#gc_parts)*
                    __parts
                }

                fn graph_const_field_values(&self) -> #p::Vec<(&'static ::core::primitive::str, #p::Option<::std::string::String>)> {
                    #[allow(unused_imports)]
                    use #p::{Printable as _, Unprintable as _};
                    ::std::vec![#(#gc_values),*]
                }

                #[allow(unused_variables)]
                fn visit_device<'__a>(
                    &'__a self,
                    __f: &mut dyn ::core::ops::FnMut(&#p::FieldInfo, &#p::LeafPath, #p::Node<'__a>),
                ) {
                    #(#visit)*
                }

                #[allow(unused_variables)]
                fn visit_device_mut(
                    &mut self,
                    __f: &mut dyn ::core::ops::FnMut(&#p::FieldInfo, &#p::LeafPath, &mut #p::Array),
                ) {
                    #(#visit_mut)*
                }

                // The Host fields' placeholders are deprecated, to explain a read in traced code.
                #[allow(unused_variables, deprecated)]
                fn view<#lt>(
                    &#lt self,
                    __leaf_fn: &mut dyn ::core::ops::FnMut(&#p::FieldInfo, &#p::LeafPath, &#p::Array) -> #p::Tensor,
                ) -> #view #view_args {
                    #view {
                        #(#build_full_view,)*
                        __nitro_marker: #p::PhantomData,
                    }
                }
            }

            #[automatically_derived]
            impl #impl_generics ::nitro::stage::Frozen for #name #ty_generics #where_all {
                type FrozenView<#lt> = #frozen_view #view_args where Self: #lt;

                #[allow(unused_variables)]
                fn frozen_view<#lt>(
                    &#lt self,
                    __leaf_fn: &mut dyn ::core::ops::FnMut(&#p::FieldInfo, &#p::LeafPath, &#p::Array) -> #p::Tensor,
                ) -> #frozen_view #view_args {
                    #frozen_view {
                        #(#build_frozen_view,)*
                        __nitro_marker: #p::PhantomData,
                    }
                }
            }
        };
    }
}

/// A view struct holding the fields whose role `include` accepts (GraphConsts by reference,
/// Device fields as tensor trees), and the generic arguments naming it (`<'__nitro, T, N>`).
fn view_type(
    input: &syn::DeriveInput,
    fields: &[Field],
    (view, doc, lt): (&syn::Ident, &str, &syn::Lifetime),
    include: fn(Role) -> bool,
    host_placeholders: bool,
) -> (TokenStream, TokenStream) {
    let p = quote!(::nitro::__private);
    let vis = &input.vis;
    let named: Vec<&syn::Field> = match &input.data {
        syn::Data::Struct(s) => s.fields.iter().collect(),
        _ => Vec::new(),
    };
    // What a read of a Host field in traced code is told: the field is Host, and which fields
    // (of which roles) the view holds.
    let in_view: Vec<String> = fields
        .iter()
        .filter(|f| f.role != Role::Host)
        .map(|f| format!("`{}`", f.name))
        .collect();
    let in_view = match in_view.is_empty() {
        true => "none here".to_owned(),
        false => in_view.join(", "),
    };
    let type_name = &input.ident;
    let view_fields = fields.iter().zip(named).filter_map(|(f, orig)| {
        if f.role == Role::Host && host_placeholders {
            // A placeholder of the Host field's name, so that reading it in traced code is
            // nitro's explanation (the deprecation note, on every use) and an error at its
            // first use (`HostField` has nothing to read) rather than rustc's "no field" with
            // the view's internals listed.
            let (ident, fvis) = (&f.ident, &orig.vis);
            let note = format!(
                "`{}` is a Host field of `{type_name}` (unmarked or #[host]): traced code cannot \
                 read it. The compile view holds the #[graph_const] fields, by reference, and \
                 the #[device] fields, as tensors ({in_view}). Mark `{}` #[device] to trace it \
                 as an input, or #[graph_const] if its value shapes the graph",
                f.name, f.name
            );
            return Some(quote! {
                #[doc(hidden)]
                #[deprecated(note = #note)]
                #fvis #ident: #p::HostField
            });
        }
        if !include(f.role) {
            return None;
        }
        let (ident, ty, fvis) = (&f.ident, &f.ty, &orig.vis);
        let user_docs = orig.attrs.iter().filter(|a| a.path().is_ident("doc"));
        let role_doc = docs::view_field_doc(f);
        let field = match f.role {
            Role::GraphConst => quote!(#fvis #ident: &#lt #ty),
            // Spanned wholly at the field's type: if the type is not a `Tree`, the view's error
            // then coincides with the impl's and rustc reports it once.
            Role::Device { .. } | Role::Frozen => {
                let span = ty.span();
                let fvis = respan(fvis.to_token_stream(), span);
                let mut ident = ident.clone();
                ident.set_span(span);
                quote_spanned!(span=> #fvis #ident: <#ty as #p::Tree>::Mirror<#p::Tensor>)
            }
            Role::Host => return None,
        };
        Some(quote! {
            #(#user_docs)*
            #[doc = ""]
            #[doc = #role_doc]
            #field
        })
    });

    // Every generic parameter is carried by a hidden marker, so parameters used only by Host
    // fields (which the view drops) stay used.
    let markers = input.generics.params.iter().map(|gp| match gp {
        syn::GenericParam::Type(t) => {
            let i = &t.ident;
            quote!(fn() -> #i)
        }
        syn::GenericParam::Lifetime(l) => {
            let l = &l.lifetime;
            quote!(&#l ())
        }
        syn::GenericParam::Const(_) => quote!(()),
    });
    let args = input.generics.params.iter().map(|gp| match gp {
        syn::GenericParam::Type(t) => {
            let i = &t.ident;
            quote!(#i)
        }
        syn::GenericParam::Lifetime(l) => {
            let l = &l.lifetime;
            quote!(#l)
        }
        syn::GenericParam::Const(c) => {
            let i = &c.ident;
            quote!(#i)
        }
    });
    let params = input.generics.params.iter();
    let where_clause = &input.generics.where_clause;
    let tokens = quote! {
        #[doc = #doc]
        // A program need not read every field of the view.
        #[allow(dead_code)]
        #vis struct #view<#lt #(, #params)*> #where_clause {
            #(#view_fields,)*
            #[doc(hidden)]
            pub __nitro_marker: #p::PhantomData<(&#lt () #(, #markers)*)>,
        }
    };
    (tokens, quote!(<#lt #(, #args)*>))
}

/// `tokens` with every span (including inside groups) set to `span`.
fn respan(tokens: TokenStream, span: proc_macro2::Span) -> TokenStream {
    tokens
        .into_iter()
        .map(|mut t| {
            if let proc_macro2::TokenTree::Group(g) = &t {
                let mut inner = proc_macro2::Group::new(g.delimiter(), respan(g.stream(), span));
                inner.set_span(span);
                t = proc_macro2::TokenTree::Group(inner);
            } else {
                t.set_span(span);
            }
            t
        })
        .collect()
}

/// `generics` without its where clause (so predicates are not repeated when two clauses merge).
fn strip_where(generics: &syn::Generics) -> syn::Generics {
    let mut g = generics.clone();
    g.where_clause = None;
    g
}

/// Joins two `where …` clauses (either may be empty).
fn extend_where(a: TokenStream, b: &TokenStream) -> TokenStream {
    match (a.is_empty(), b.is_empty()) {
        (_, true) => a,
        (true, false) => b.clone(),
        (false, false) => {
            let rest: TokenStream = b.clone().into_iter().skip(1).collect();
            quote!(#a, #rest)
        }
    }
}

/// The schema digest, computed while expanding: the type name, then each field's name, type
/// text and role tag, length-prefixed.
fn schema_digest(name: &syn::Ident, fields: &[Field]) -> TokenStream {
    let mut h = blake3::Hasher::new();
    let write_str = |h: &mut blake3::Hasher, s: &str| {
        h.update(&(s.len() as u64).to_le_bytes());
        h.update(s.as_bytes());
    };
    write_str(&mut h, &name.to_string());
    h.update(&(fields.len() as u64).to_le_bytes());
    for f in fields {
        write_str(&mut h, &f.name);
        write_str(&mut h, &type_text(&f.ty));
        h.update(&[f.role.tag()]);
    }
    let bytes = h.finalize();
    let bytes = bytes.as_bytes().iter();
    quote!([#(#bytes),*])
}
