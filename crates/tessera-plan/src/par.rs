//! Running the search's independent pieces of work on the machine's cores.
//!
//! [`map`] hands items out in order (the search puts its slowest jobs first so the threads
//! stay busy), one at a time, to as many workers as the pool has threads, and keeps the
//! results in the items' order. The workers are tasks of rayon's pool, so a call made from
//! inside one (a pipeline's devices, lowered for one of several candidates) adds work the
//! pool's idle threads take, instead of more threads than cores: when the other candidates
//! are done, the last one's devices spread over every core.

use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};
use std::sync::Mutex;

/// Runs `f` over `items` on the pool's threads, keeping order.
pub fn map<T: Sync, R: Send>(items: &[T], f: impl Fn(&T) -> R + Sync) -> Vec<R> {
    if items.len() <= 1 {
        return items.iter().map(f).collect();
    }
    let workers = rayon::current_num_threads().min(items.len()).max(1);
    let next = AtomicUsize::new(0);
    let slots: Vec<Mutex<Option<R>>> = items.iter().map(|_| Mutex::new(None)).collect();
    rayon::scope(|s| {
        for _ in 0..workers {
            s.spawn(|_| loop {
                let i = next.fetch_add(1, Relaxed);
                if i >= items.len() {
                    break;
                }
                let r = f(&items[i]);
                if let Ok(mut slot) = slots[i].lock() {
                    *slot = Some(r);
                }
            });
        }
    });
    // `rayon::scope` returns once every worker has, and a worker's panic is re-raised there:
    // each slot holds its result.
    slots.into_iter().map(|m| m.into_inner().ok().flatten().expect("every item ran")).collect()
}

/// [`map`] over owned items: `f` takes each item's index and the item.
pub fn map_owned<T: Send, R: Send>(items: Vec<T>, f: impl Fn(usize, T) -> R + Sync) -> Vec<R> {
    let cells: Vec<(usize, Mutex<Option<T>>)> =
        items.into_iter().enumerate().map(|(i, t)| (i, Mutex::new(Some(t)))).collect();
    map(&cells, |(i, cell)| {
        let item = cell.lock().ok().and_then(|mut c| c.take()).expect("each item is taken once");
        f(*i, item)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Results keep the items' order, nested calls included, and every item runs once.
    #[test]
    fn keeps_order_nested_and_owned() {
        let items: Vec<usize> = (0..37).collect();
        let ran = AtomicUsize::new(0);
        let out = map(&items, |&i| {
            ran.fetch_add(1, Relaxed);
            map(&[i, i + 1, i + 2], |&j| j * 10)
        });
        assert_eq!(ran.load(Relaxed), 37);
        for (i, inner) in out.iter().enumerate() {
            assert_eq!(inner, &[i * 10, (i + 1) * 10, (i + 2) * 10]);
        }
        let owned = map_owned(vec![String::from("a"), String::from("bb")], |i, s| (i, s.len()));
        assert_eq!(owned, [(0, 1), (1, 2)]);
    }
}
