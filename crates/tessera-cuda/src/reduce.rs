//! Reductions and norms on the GPU: the `Reduce` op by the path that suits its dims (column
//! partials for leading dims, many-block partials for a few outputs over many elements — the
//! gradient norms —, one block per output otherwise), its backward, and layer/RMS norm forward
//! and backward (dx per row; the weight and bias gradients as column partials).

use crate::alloc::Purpose;
use crate::backend::CudaBackend;
use crate::launch::NormCodes;
use crate::launch::{elementwise, launch, per_row, Arg};
use crate::source::{float_code, reduce_code};
use crate::tensor::{row_major, CudaTensor, Layout};
use tessera_ir::{DType, ReduceOp, TensorMeta};
use tessera_runtime::{Result, RuntimeError};

fn bad(msg: String) -> RuntimeError {
    RuntimeError::Binding(msg)
}

impl CudaBackend {
    /// `y[j]` = partials `part[j·sj + g·sg]` (g < groups) combined by reduce op `code`.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn combine_partials(
        &self,
        code: i32,
        part: &CudaTensor,
        groups: usize,
        sj: usize,
        n: usize,
        r: usize,
        y: &CudaTensor,
    ) -> Result<()> {
        let sg = if sj == 1 { n } else { 1 };
        let mut args = vec![
            Arg::I32(code),
            Arg::Ptr(part.ptr()),
            Arg::I64(groups as i64),
            Arg::I64(sj as i64),
            Arg::I64(sg as i64),
            Arg::I64(r as i64),
            Arg::Ptr(y.ptr()),
            Arg::I32(float_code("reduce", y.dtype())?),
        ];
        // Sums of many partials for few outputs: a block per output (max keeps the thread).
        if code != crate::source::reduce_code(ReduceOp::Max) && groups >= 64 && n <= 4096 {
            return launch(self.gpu(), "reduce_partials_block", per_row(n), &args);
        }
        args.push(Arg::I64(n as i64));
        launch(self.gpu(), "reduce_partials", elementwise(n), &args)
    }

    pub(crate) fn reduce(
        &self,
        r: ReduceOp,
        dims: &[usize],
        x: &CudaTensor,
        out: &TensorMeta,
        p: Purpose,
    ) -> Result<CudaTensor> {
        let y = self.new_out(out, p)?;
        let rank = x.dims().len();
        if dims.iter().any(|&d| d >= rank) {
            return Err(bad(format!("reduce: dims {dims:?} out of range for rank {rank}")));
        }
        let code = reduce_code(r);
        let cx = float_code("reduce", x.dtype())?;
        let cy = float_code("reduce", y.dtype())?;
        let nr: usize = dims.iter().map(|&d| x.dims()[d]).product();
        let n_out = y.numel();
        // Leading dims of a contiguous tensor (bias gradients): coalesced column partials.
        let leading = dims.len() < rank && (0..dims.len()).all(|i| dims.contains(&i));
        if leading && x.is_contiguous() && nr > 1 {
            let (groups, chunk) = row_chunks(nr);
            let part =
                CudaTensor::empty(self.gpu(), &[groups, n_out], DType::F64, Purpose::Scratch)?;
            launch(
                self.gpu(),
                "reduce_cols_partial",
                col_tiles(n_out, groups),
                &[
                    Arg::I32(code),
                    Arg::Ptr(x.ptr()),
                    Arg::I32(cx),
                    Arg::I64(nr as i64),
                    Arg::I64(n_out as i64),
                    Arg::I64(chunk as i64),
                    Arg::Ptr(part.ptr()),
                ],
            )?;
            self.combine_partials(code, &part, groups, 1, n_out, nr, &y)?;
            return Ok(y);
        }
        let (mut lo, mut lr) =
            (Layout { offset: x.offset as i64, ..Default::default() }, Layout::default());
        for i in 0..rank {
            let l = if dims.contains(&i) { &mut lr } else { &mut lo };
            let j = l.ndim as usize;
            l.dims[j] = x.dims()[i] as i64;
            l.strides[j] = x.strides[i] as i64;
            l.ndim += 1;
        }
        // Few outputs over many elements (gradient norms): many blocks per output, combined.
        if r != ReduceOp::Max && nr >= 1 << 16 && n_out <= 1024 {
            // Enough blocks to fill the GPU (a thread keeps four loads in flight).
            let chunk = 1 << 12;
            let groups = nr.div_ceil(chunk).min(1024);
            // A multiple of 8, so that each chunk of a dense, aligned tensor starts on a 16-byte
            // boundary (the kernel's vector loads).
            let chunk = nr.div_ceil(groups).div_ceil(8) * 8;
            let groups = nr.div_ceil(chunk);
            let part =
                CudaTensor::empty(self.gpu(), &[n_out, groups], DType::F64, Purpose::Scratch)?;
            let cfg = cudarc::driver::LaunchConfig {
                grid_dim: (n_out as u32, groups as u32, 1),
                block_dim: (crate::launch::THREADS, 1, 1),
                shared_mem_bytes: 0,
            };
            launch(
                self.gpu(),
                "reduce_partial",
                cfg,
                &[
                    Arg::I32(code),
                    Arg::Ptr(x.base()),
                    Arg::I32(cx),
                    Arg::Layout(lo),
                    Arg::Layout(lr),
                    Arg::I64(nr as i64),
                    Arg::I64(chunk as i64),
                    Arg::Ptr(part.ptr()),
                ],
            )?;
            self.combine_partials(code, &part, groups, groups, n_out, nr, &y)?;
            return Ok(y);
        }
        launch(
            self.gpu(),
            "reduce",
            per_row(y.numel()),
            &[
                Arg::I32(reduce_code(r)),
                Arg::Ptr(x.base()),
                Arg::I32(cx),
                Arg::Layout(lo),
                Arg::Layout(lr),
                Arg::I64(nr as i64),
                Arg::Ptr(y.ptr()),
                Arg::I32(cy),
            ],
        )?;
        Ok(y)
    }

    #[allow(clippy::too_many_arguments)]
    pub(crate) fn reduce_backward(
        &self,
        r: ReduceOp,
        dims: &[usize],
        keepdim: bool,
        x: &CudaTensor,
        dy: &CudaTensor,
        out: &TensorMeta,
        p: Purpose,
    ) -> Result<CudaTensor> {
        let x = self.dense(x)?;
        let dy = self.dense(dy)?;
        let xd = x.dims().to_vec();
        // dy as x-shaped: stride 0 along reduced dims.
        let kept: Vec<usize> = (0..xd.len()).filter(|i| keepdim || !dims.contains(i)).collect();
        let dstr = row_major(dy.dims());
        let mut ld = Layout { ndim: xd.len() as i32, ..Default::default() };
        for (i, &d) in xd.iter().enumerate() {
            ld.dims[i] = d as i64;
            ld.strides[i] = if dims.contains(&i) {
                0
            } else {
                let k = kept.iter().position(|&j| j == i).unwrap_or(0);
                dstr[k] as i64
            };
        }
        let nr: usize = dims.iter().map(|&d| xd[d]).product();
        let ym = if r == ReduceOp::Max {
            let m = TensorMeta { shape: tessera_ir::Shape::from(dy.dims()), dtype: DType::F32 };
            Some(self.reduce(r, dims, &x, &m, Purpose::Scratch)?)
        } else {
            None
        };
        let y = self.new_out(out, p)?;
        let n = y.numel();
        launch(
            self.gpu(),
            "reduce_backward",
            elementwise(n),
            &[
                Arg::I32(reduce_code(r)),
                Arg::Ptr(x.ptr()),
                Arg::I32(float_code("reduce_backward", x.dtype())?),
                Arg::Ptr(dy.ptr()),
                Arg::I32(float_code("reduce_backward", dy.dtype())?),
                Arg::Layout(ld),
                Arg::Ptr(ym.as_ref().map_or(0, |t| t.ptr())),
                Arg::I64(nr as i64),
                Arg::Ptr(y.ptr()),
                Arg::I32(float_code("reduce_backward", y.dtype())?),
                Arg::I64(n as i64),
            ],
        )?;
        Ok(y)
    }

    pub(crate) fn norm(
        &self,
        x: &CudaTensor,
        w: &CudaTensor,
        b: Option<&CudaTensor>,
        eps: f64,
        out: &TensorMeta,
        p: Purpose,
    ) -> Result<CudaTensor> {
        let (x, w) = (self.dense(x)?, self.dense(w)?);
        let b = b.map(|b| self.dense(b)).transpose()?;
        let y = self.new_out(out, p)?;
        let cols = *x.dims().last().unwrap_or(&1);
        let rows = x.numel() / cols.max(1);
        launch(
            self.gpu(),
            "norm_forward",
            per_row(rows),
            &[
                Arg::Ptr(x.ptr()),
                Arg::Ptr(w.ptr()),
                Arg::Ptr(b.as_ref().map_or(0, |b| b.ptr())),
                Arg::Ptr(y.ptr()),
                Arg::Norm(NormCodes {
                    x: float_code("norm", x.dtype())?,
                    w: float_code("norm", w.dtype())?,
                    b: b.as_ref().map_or(Ok(0), |b| float_code("norm", b.dtype()))?,
                    y: float_code("norm", y.dtype())?,
                    dy: 0,
                }),
                Arg::I64(cols as i64),
                Arg::F32(eps as f32),
                Arg::I32(i32::from(b.is_none())),
            ],
        )?;
        Ok(y)
    }

    #[allow(clippy::too_many_arguments)]
    pub(crate) fn norm_backward(
        &self,
        x: &CudaTensor,
        w: &CudaTensor,
        dy: &CudaTensor,
        eps: f64,
        rms: bool,
        out: &[TensorMeta],
        p: Purpose,
    ) -> Result<Vec<CudaTensor>> {
        let (x, w, dy) = (self.dense(x)?, self.dense(w)?, self.dense(dy)?);
        let cols = *x.dims().last().unwrap_or(&1);
        let rows = x.numel() / cols.max(1);
        let dx = self.new_out(&out[0], p)?;
        let stats = CudaTensor::empty(self.gpu(), &[rows, 2], DType::F32, Purpose::Scratch)?;
        // Rows of at most eight columns per thread take the kernel built for one group of eight
        // (fewer registers, more rows in flight).
        let one_group = cols <= 8 * crate::launch::THREADS as usize;
        launch(
            self.gpu(),
            if one_group { "norm_backward_dx1" } else { "norm_backward_dx" },
            per_row(rows),
            &[
                Arg::Ptr(x.ptr()),
                Arg::Ptr(w.ptr()),
                Arg::Ptr(dy.ptr()),
                Arg::Ptr(dx.ptr()),
                Arg::Norm(NormCodes {
                    x: float_code("norm_backward", x.dtype())?,
                    w: float_code("norm_backward", w.dtype())?,
                    b: 0,
                    y: float_code("norm_backward", dx.dtype())?,
                    dy: float_code("norm_backward", dy.dtype())?,
                }),
                Arg::Ptr(stats.ptr()),
                Arg::I64(cols as i64),
                Arg::F32(eps as f32),
                Arg::I32(i32::from(rms)),
            ],
        )?;
        let dw = self.new_out(&out[1], p)?;
        let db = if rms { None } else { Some(self.new_out(&out[2], p)?) };
        // Column sums in two stages: row-chunk partials (coalesced over 32 columns, or 256 by
        // 16-byte loads where the rows allow), combined.
        let float = |d: DType| matches!(d, DType::F32 | DType::BF16 | DType::F16);
        let vec = cols % 8 == 0
            && x.ptr() % 16 == 0
            && dy.ptr() % 16 == 0
            && float(x.dtype())
            && float(dy.dtype());
        let (groups, chunk) = if vec { vec_row_chunks(rows) } else { row_chunks(rows) };
        let pw = CudaTensor::empty(self.gpu(), &[groups, cols], DType::F64, Purpose::Scratch)?;
        let pb = if rms {
            None
        } else {
            Some(CudaTensor::empty(self.gpu(), &[groups, cols], DType::F64, Purpose::Scratch)?)
        };
        launch(
            self.gpu(),
            if vec { "norm_dw_partial8" } else { "norm_dw_partial" },
            col_tiles(if vec { cols.div_ceil(8) } else { cols }, groups),
            &[
                Arg::Ptr(x.ptr()),
                Arg::I32(float_code("norm_backward", x.dtype())?),
                Arg::Ptr(dy.ptr()),
                Arg::I32(float_code("norm_backward", dy.dtype())?),
                Arg::Ptr(stats.ptr()),
                Arg::I64(rows as i64),
                Arg::I64(cols as i64),
                Arg::I64(chunk as i64),
                Arg::Ptr(pw.ptr()),
                Arg::Ptr(pb.as_ref().map_or(0, |t| t.ptr())),
            ],
        )?;
        self.combine_partials(0, &pw, groups, 1, cols, 1, &dw)?;
        if let (Some(pb), Some(db)) = (&pb, &db) {
            self.combine_partials(0, pb, groups, 1, cols, 1, db)?;
        }
        let mut v = vec![dx, dw];
        v.extend(db);
        Ok(v)
    }
}

/// Row chunks of a two-stage column reduction over `rows` rows: (groups, rows per group).
fn row_chunks(rows: usize) -> (usize, usize) {
    let groups = rows.div_ceil(256).clamp(1, 128);
    (groups, rows.div_ceil(groups))
}

/// The same for the 16-byte path: chunks of 32 rows (four per row lane), up to 256 of them,
/// so that its fewer, wider blocks still fill the GPU.
fn vec_row_chunks(rows: usize) -> (usize, usize) {
    let groups = rows.div_ceil(32).clamp(1, 256);
    (groups, rows.div_ceil(groups))
}

/// Blocks of 32 columns × 8 row lanes, `groups` row chunks.
fn col_tiles(cols: usize, groups: usize) -> cudarc::driver::LaunchConfig {
    cudarc::driver::LaunchConfig {
        grid_dim: (cols.div_ceil(32) as u32, groups as u32, 1),
        block_dim: (32, 8, 1),
        shared_mem_bytes: 0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Both partial passes of the norm's weight gradient cover every row exactly once (each
    /// chunk non-empty, the last one ending at or past the rows) within the partial buffer's
    /// groups, and the 16-byte pass's blocks cover every column.
    #[test]
    fn norm_weight_partials_cover_every_row_and_column() {
        for rows in [1, 7, 31, 32, 33, 255, 256, 257, 4096, 8192, 16384, 100_003] {
            for (f, max) in
                [(row_chunks as fn(usize) -> (usize, usize), 128), (vec_row_chunks, 256)]
            {
                let (groups, chunk) = f(rows);
                assert!((1..=max).contains(&groups), "{rows} rows: {groups} groups");
                assert!(groups * chunk >= rows, "{rows} rows: {groups} × {chunk} miss some");
                assert!((groups - 1) * chunk < rows, "{rows} rows: the last chunk is empty");
            }
        }
        for cols in [8usize, 64, 248, 256, 264, 2048, 5504] {
            let cfg = col_tiles(cols.div_ceil(8), 4);
            // A block is 32 threads of eight columns each.
            assert!(cfg.grid_dim.0 as usize * 32 * 8 >= cols);
            assert!((cfg.grid_dim.0 as usize - 1) * 32 * 8 < cols);
        }
    }
}
