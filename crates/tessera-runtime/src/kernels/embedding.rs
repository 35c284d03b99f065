//! Embedding lookup (a row gather) and its scatter-add backward.
//!
//! The backward is race-free and deterministic without atomics: the token positions are
//! bucketed by id (a stable counting sort, O(tokens + vocabulary) scratch), then vocabulary
//! rows are filled in parallel, each summing its tokens' gradient rows in token order in f64.

use super::elementwise::{expect_f32, expect_i64, numel};
use super::reduce::par_rows;
use crate::tensor::{contiguous, from_vec, read};
use crate::{Result, RuntimeError};
use candle_core::Tensor;
use tessera_ir::dist::TableRows;

/// The first id outside `0..vocab`, as a clear data error.
fn check_ids(op: &str, ids: &[i64], vocab: usize) -> Result<()> {
    match ids.iter().position(|&id| id < 0 || id as u64 >= vocab as u64) {
        None => Ok(()),
        Some(k) => Err(RuntimeError::Data(format!(
            "{op}: token id {} (at flat position {k}) is out of range for a vocabulary of {vocab} \
             (valid ids are 0..{vocab}); check the tokenizer against the model's vocab_size",
            ids[k]
        ))),
    }
}

/// A table of `count` rows must be the shard `rows` describes.
fn check_rows(op: &str, rows: &TableRows, count: usize) -> Result<()> {
    if rows.count != count {
        return Err(RuntimeError::Binding(format!(
            "{op}: the table has {count} rows, its shard {} (of {})",
            rows.count, rows.vocab
        )));
    }
    Ok(())
}

/// `table [V, D]`, `ids [..]` → `[.., D]`: the table is `rows` of the vocabulary (all of it,
/// or a device's shard: ids another shard holds read zero rows).
pub fn embedding(table: &Tensor, ids: &Tensor, rows: &TableRows) -> Result<Tensor> {
    expect_f32(table, "embedding", "table")?;
    expect_i64(ids, "embedding", "ids")?;
    let &[v, d] = table.dims() else {
        return Err(RuntimeError::Binding(format!(
            "embedding: table {:?} must be [num_embeddings, dim]",
            table.dims()
        )));
    };
    let (tc, ic) = (contiguous(table)?, contiguous(ids)?);
    let (ts, is) = (read::<f32>(&tc)?, read::<i64>(&ic)?);
    check_ids("embedding", &is, rows.vocab)?;
    check_rows("embedding", rows, v)?;
    let mut out = vec![0f32; is.len() * d];
    if d > 0 {
        par_rows(&mut out, d, |r, orow| {
            if let Some(row) = rows.local(is[r] as usize) {
                orow.copy_from_slice(&ts[row * d..(row + 1) * d]);
            }
        });
    }
    let mut dims = ids.dims().to_vec();
    dims.push(d);
    from_vec(out, &dims)
}

/// `ids [..]`, `dy [.., D]` → `[num_embeddings, D]`, the rows of `dy` summed by id: the table's
/// `rows` (all of it, or a device's shard, to which ids another shard holds add nothing).
pub fn embedding_backward(
    ids: &Tensor,
    dy: &Tensor,
    num_embeddings: usize,
    rows: &TableRows,
) -> Result<Tensor> {
    expect_i64(ids, "embedding_backward", "ids")?;
    expect_f32(dy, "embedding_backward", "dy")?;
    let (idd, dyd) = (ids.dims(), dy.dims());
    if dyd.len() != idd.len() + 1 || &dyd[..idd.len()] != idd {
        return Err(RuntimeError::Binding(format!(
            "embedding_backward: dy {dyd:?} must be ids' shape {idd:?} plus one dim"
        )));
    }
    let d = dyd[idd.len()];
    let (ic, gc) = (contiguous(ids)?, contiguous(dy)?);
    let (is, gs) = (read::<i64>(&ic)?, read::<f32>(&gc)?);
    check_ids("embedding_backward", &is, rows.vocab)?;
    check_rows("embedding_backward", rows, num_embeddings)?;
    let n = numel(idd);
    // start[v]..start[v + 1] indexes `order`, the positions holding local row v, in token
    // order (positions whose id another shard holds are left out).
    let local: Vec<Option<usize>> = is.iter().map(|&id| rows.local(id as usize)).collect();
    let mut start = vec![0usize; num_embeddings + 1];
    for r in local.iter().flatten() {
        start[r + 1] += 1;
    }
    for v in 0..num_embeddings {
        start[v + 1] += start[v];
    }
    let mut next = start.clone();
    let mut order = vec![0usize; n];
    for (k, r) in local.iter().enumerate() {
        if let Some(r) = *r {
            order[next[r]] = k;
            next[r] += 1;
        }
    }
    drop(next);
    let mut out = vec![0f32; num_embeddings * d];
    if d > 0 {
        par_rows(&mut out, d, |v, orow| {
            let toks = &order[start[v]..start[v + 1]];
            match toks {
                [] => {}
                [k] => orow.copy_from_slice(&gs[k * d..(k + 1) * d]),
                _ => {
                    let mut acc = vec![0f64; d];
                    for &k in toks {
                        for (a, &g) in acc.iter_mut().zip(&gs[k * d..(k + 1) * d]) {
                            *a += g as f64;
                        }
                    }
                    for (o, a) in orow.iter_mut().zip(&acc) {
                        *o = *a as f32;
                    }
                }
            }
        });
    }
    from_vec(out, &[num_embeddings, d])
}
