//! What a scope or the router hands the handler's extractors, looked up by type.

use std::any::{Any, TypeId};
use std::sync::Arc;

/// Resources a scope gives the handler's extractors, looked up by type.
#[derive(Clone, Default)]
pub struct Resources(Vec<Arc<dyn Any + Send + Sync>>);

impl Resources {
    /// No resources.
    pub const fn new() -> Self {
        Self(Vec::new())
    }

    /// Adds a resource, replacing one of the same type.
    pub fn insert<T: Any + Send + Sync>(&mut self, resource: Arc<T>) {
        self.0.retain(|r| (**r).type_id() != TypeId::of::<T>());
        self.0.push(resource);
    }

    /// Whether a resource of this type is there.
    pub fn contains(&self, id: TypeId) -> bool {
        self.0.iter().any(|r| (**r).type_id() == id)
    }

    /// The resource of type `T`, if the scope provided one.
    pub fn get<T: Any + Send + Sync>(&self) -> Option<Arc<T>> {
        self.0
            .iter()
            .find_map(|r| Arc::clone(r).downcast::<T>().ok())
    }
}

impl std::fmt::Debug for Resources {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Resources({} items)", self.0.len())
    }
}
