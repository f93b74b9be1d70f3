//! `#[derive(Tree)]`: a struct of trees is a tree; its mirror is a struct of the fields' mirrors.

use proc_macro2::{Span, TokenStream};
use quote::{format_ident, quote, quote_spanned, ToTokens};
use syn::ext::IdentExt;
use syn::spanned::Spanned;

use crate::bound;
use crate::ctxt::Ctxt;

pub(crate) fn expand(input: &syn::DeriveInput) -> TokenStream {
    let cx = Ctxt::new();
    let fields = match &input.data {
        syn::Data::Struct(s) => Some(&s.fields),
        syn::Data::Enum(e) => {
            cx.error_at(
                e.enum_token,
                "Tree cannot be derived for an enum: a traced input needs one fixed structure; \
                 use a struct, or an `Option` field for a part that may be absent",
            );
            None
        }
        syn::Data::Union(u) => {
            cx.error_at(
                u.union_token,
                "Tree cannot be derived for a union; use a struct of arrays",
            );
            None
        }
    };
    let errors = cx.finish();
    match fields {
        Some(fields) if errors.is_empty() => expand_struct(input, fields),
        _ => errors,
    }
}

fn expand_struct(input: &syn::DeriveInput, fields: &syn::Fields) -> TokenStream {
    let name = &input.ident;
    let vis = &input.vis;
    let mirror = format_ident!("{}Mirror", name);
    let tree = quote!(::nitro::__private::Tree);
    let p = quote!(::nitro::__private);

    // The leaf type parameter of the mirror; renamed if the struct already has a parameter `L`.
    let taken = bound::generic_params(&input.generics);
    let leaf = (0..)
        .map(|i| {
            if i == 0 {
                "L".to_owned()
            } else {
                format!("L{i}")
            }
        })
        .find(|n| !taken.contains(n))
        .map(|n| syn::Ident::new(&n, Span::call_site()))
        .unwrap_or_else(|| format_ident!("L"));

    let field_types: Vec<&syn::Type> = fields.iter().map(|f| &f.ty).collect();
    let (impl_generics, ty_generics, _) = input.generics.split_for_impl();

    // Every field must be a tree. A field type that mentions a type parameter gets a plain
    // bound (so `Layer<T>` is a tree exactly when `T` is). A concrete field type is checked once
    // by an assertion spanned at the field, and its bound is deferred (`for<'__w>` makes it
    // non-trivial), so a non-tree field is one error at the field instead of a cascade through
    // the mirror and its impls.
    let params = bound::generic_params(&input.generics);
    let mut preds: Vec<TokenStream> = input
        .generics
        .where_clause
        .iter()
        .flat_map(|w| w.predicates.iter().map(ToTokens::to_token_stream))
        .collect();
    let mut assertions = Vec::new();
    for ty in &field_types {
        if bound::mentions(ty, &params) {
            preds.push(quote_spanned!(ty.span()=> #ty: #tree));
        } else {
            preds.push(quote_spanned!(ty.span()=> for<'__w> #ty: #tree));
            assertions.push(quote_spanned!(ty.span()=>
                const _: fn() = || {
                    fn field_must_be_a_tree<T: ?::core::marker::Sized + #tree>() {}
                    field_must_be_a_tree::<#ty>();
                };
            ));
        }
    }
    let where_with = |extra: &[TokenStream]| {
        let all = preds.iter().chain(extra);
        quote!(where #(#all,)*)
    };
    let tree_where = where_with(&[]);

    // Mirror generics: <L, user params...>.
    let mut mirror_generics = input.generics.clone();
    mirror_generics.where_clause = None;
    mirror_generics.params.insert(0, syn::parse_quote!(#leaf));
    let (mirror_impl_generics, mirror_ty_generics, _) = mirror_generics.split_for_impl();

    let members: Vec<syn::Member> = fields
        .iter()
        .enumerate()
        .map(|(i, f)| match &f.ident {
            Some(id) => syn::Member::Named(id.clone()),
            None => syn::Member::Unnamed(syn::Index::from(i)),
        })
        .collect();
    let path_names: Vec<String> = members
        .iter()
        .map(|m| match m {
            syn::Member::Named(id) => id.unraw().to_string(),
            syn::Member::Unnamed(i) => i.index.to_string(),
        })
        .collect();

    let mirror_field_types: Vec<TokenStream> = field_types
        .iter()
        .map(|ty| quote_spanned!(ty.span()=> <#ty as #tree>::Mirror<#leaf>))
        .collect();
    let mirror_fields = fields.iter().zip(&mirror_field_types).map(|(f, mty)| {
        let fvis = &f.vis;
        let docs = f.attrs.iter().filter(|a| a.path().is_ident("doc"));
        match &f.ident {
            Some(id) => quote!(#(#docs)* #fvis #id: #mty),
            None => quote!(#(#docs)* #fvis #mty),
        }
    });
    // A struct without fields still needs to use `L`.
    let empty = fields.is_empty();
    let marker_field =
        empty.then(|| quote!(#[doc(hidden)] pub __leaf: #p::PhantomData<fn() -> #leaf>));
    let marker_init = empty.then(|| quote!(__leaf: #p::PhantomData));
    let mirror_body = match fields {
        syn::Fields::Unnamed(_) if !empty => quote!(( #(#mirror_fields,)* ) #tree_where;),
        _ => quote!(#tree_where { #(#mirror_fields,)* #marker_field }),
    };
    let mirror_doc = format!(
        "The mirror of [`{name}`]: the same structure with every array leaf an `{leaf}` \
         (a `Tensor` in traced code). Generated by `#[derive(Tree)]`."
    );

    let visit = members.iter().zip(&path_names).zip(&field_types).map(|((m, n), ty)| {
        quote_spanned!(ty.span()=> __at.with_field(#n, |__at| <#ty as #tree>::visit(&self.#m, __at, __f));)
    });
    let visit_mut = members.iter().zip(&path_names).zip(&field_types).map(|((m, n), ty)| {
        quote_spanned!(ty.span()=> __at.with_field(#n, |__at| <#ty as #tree>::visit_mut(&mut self.#m, __at, __f));)
    });
    let map = members
        .iter()
        .zip(&field_types)
        .map(|(m, ty)| quote_spanned!(ty.span()=> #m: <#ty as #tree>::map_mirror(&__m.#m, __f)));
    let build = members.iter().zip(&path_names).zip(&field_types).map(|((m, n), ty)| {
        quote_spanned!(ty.span()=> #m: __at.with_field(#n, |__at| <#ty as #tree>::mirror(&self.#m, __at, __f)))
    });

    // Clone / Copy / Debug for the mirror, bounded on what its fields need.
    let bounded = |extra: TokenStream| {
        let each: Vec<TokenStream> = mirror_field_types
            .iter()
            .map(|mty| quote!(#mty: #extra))
            .collect();
        where_with(&each)
    };
    let clone_where = bounded(quote!(#p::Clone));
    let copy_where = bounded(quote!(::core::marker::Copy));
    let debug_where = bounded(quote!(#p::fmt::Debug));
    let clone_fields = members
        .iter()
        .map(|m| quote!(#m: #p::Clone::clone(&self.#m)));
    let debug_fields = members
        .iter()
        .zip(&path_names)
        .map(|(m, n)| quote!(.field(#n, &self.#m)));
    let mirror_name = mirror.to_string();
    let mirror_args = &mirror_ty_generics;

    quote! {
        #[doc = #mirror_doc]
        // Traced code need not read every leaf.
        #[allow(dead_code)]
        #vis struct #mirror #mirror_impl_generics #mirror_body

        #(#assertions)*

        const _: () = {
            #[automatically_derived]
            impl #impl_generics #tree for #name #ty_generics #tree_where {
                type Mirror<#leaf> = #mirror #mirror_args;

                #[allow(unused_variables)]
                fn visit<'__a>(
                    &'__a self,
                    __at: &mut #p::LeafPath,
                    __f: &mut dyn ::core::ops::FnMut(&#p::LeafPath, #p::Node<'__a>),
                ) {
                    #(#visit)*
                }

                #[allow(unused_variables)]
                fn visit_mut(
                    &mut self,
                    __at: &mut #p::LeafPath,
                    __f: &mut dyn ::core::ops::FnMut(&#p::LeafPath, &mut #p::Array),
                ) {
                    #(#visit_mut)*
                }

                #[allow(unused_variables)]
                fn mirror<#leaf>(
                    &self,
                    __at: &mut #p::LeafPath,
                    __f: &mut dyn ::core::ops::FnMut(&#p::LeafPath, &#p::Array) -> #leaf,
                ) -> #mirror #mirror_args {
                    #mirror { #(#build,)* #marker_init }
                }

                #[allow(unused_variables)]
                fn map_mirror<#leaf, __M>(
                    __m: &#mirror #mirror_args,
                    __f: &mut dyn ::core::ops::FnMut(&#leaf) -> __M,
                ) -> <Self as #tree>::Mirror<__M> {
                    #mirror { #(#map,)* #marker_init }
                }
            }

            #[automatically_derived]
            impl #mirror_impl_generics #p::Clone for #mirror #mirror_ty_generics #clone_where {
                fn clone(&self) -> Self {
                    #mirror { #(#clone_fields,)* #marker_init }
                }
            }

            #[automatically_derived]
            impl #mirror_impl_generics ::core::marker::Copy for #mirror #mirror_ty_generics #copy_where {}

            #[automatically_derived]
            impl #mirror_impl_generics #p::fmt::Debug for #mirror #mirror_ty_generics #debug_where {
                fn fmt(&self, __fmt: &mut #p::fmt::Formatter<'_>) -> #p::fmt::Result {
                    __fmt.debug_struct(#mirror_name) #(#debug_fields)* .finish()
                }
            }
        };
    }
}
