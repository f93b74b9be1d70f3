// #[derive(ContentHash)] on generic structs and enums, with bounds, where clauses, lifetimes and
// const parameters; the impl holds exactly when the fields are ContentHash.
#![deny(warnings)]

use nitro::{ContentHash, Digest};

#[derive(ContentHash)]
pub struct Schedule<T> {
    pub warmup: u32,
    pub values: Vec<T>,
}

#[derive(ContentHash)]
pub struct Named<'a, T: ?Sized>
where
    T: ContentHash,
{
    pub name: &'a str,
    pub value: &'a T,
}

#[derive(ContentHash)]
pub struct Table<const N: usize>(pub [u8; N]);

#[derive(ContentHash)]
pub struct Unit;

#[derive(ContentHash)]
pub enum Either<L, R> {
    Left(L),
    Right { value: R },
    Neither,
}

#[derive(ContentHash)]
pub enum Never {}

fn assert_content_hash<T: ContentHash + ?Sized>() {}

fn main() {
    assert_content_hash::<Schedule<f64>>();
    assert_content_hash::<Schedule<Schedule<String>>>();
    assert_content_hash::<Named<'static, [u32]>>();
    assert_content_hash::<Table<4>>();
    assert_content_hash::<Unit>();
    assert_content_hash::<Either<u8, Option<String>>>();
    assert_content_hash::<Never>();
    let left: Either<u32, u32> = Either::Left(1);
    let right: Either<u32, u32> = Either::Right { value: 1 };
    assert_ne!(Digest::of(&left), Digest::of(&right));
    assert_ne!(Digest::of(&Either::<u32, u32>::Neither), Digest::of(&right));
    let s = Schedule {
        warmup: 1,
        values: vec![0.5f32],
    };
    assert_eq!(
        Digest::of(&s),
        Digest::of(&Schedule {
            warmup: 1,
            values: vec![0.5f32]
        })
    );
    let _ = Digest::of(&Named {
        name: "x",
        value: &[1u8, 2][..],
    });
}
