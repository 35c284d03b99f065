// ---- Vision ops (vision.rs): convolution, GroupNorm, pooling, upsampling ----
