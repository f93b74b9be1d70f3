// A hand-written impl cannot give a trait object a content hash either.
use nitro::{ContentHash, ContentHasher};

trait Layer {
    fn describe(&self) -> String;
}

impl ContentHash for dyn Layer {
    fn content_hash(&self, h: &mut ContentHasher) {
        h.write_str(&self.describe());
    }
}

fn main() {}
