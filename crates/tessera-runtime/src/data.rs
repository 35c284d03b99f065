//! Training data: tokenizers, corpus loading, train/held-out splits and batching.
//!
//! A [`Dataset`] is two token streams, `train` and `val`, read by [`Dataset::load`] from
//!
//! - a **directory** holding `train.bin` and `val.bin` (nanoGPT's layout): those two files are
//!   the splits;
//! - a **token file** (`*.bin`): raw little-endian token ids, `u16` by default as in nanoGPT or
//!   `u32` ([`TokenDType`]); the last 10% of its tokens is the held-out split;
//! - a **text file** (any other extension), encoded with the [`Tokenizer`] of the
//!   [`DataOptions`] — bytes as ids ([`ByteTokenizer`], vocabulary 256) or a Hugging Face
//!   `tokenizer.json` ([`HfTokenizer`]); again the last 10% of the tokens is held out.
//!
//! [`Dataset::validate`] checks a dataset against a model (vocabulary, sequence length) before
//! any step runs, so a bad corpus fails with one line that names the problem and the fix.
//!
//! Batches follow nanoGPT: a row is a window of `seq + 1` consecutive tokens, `inputs` its first
//! `seq` and `targets` its last `seq` (the next token at each position). Training rows start at
//! offsets drawn by a counter-based generator keyed by `(seed, step, row)` (splitmix64), so a
//! batch depends only on the seed, the step and the row's global index: resuming at step `k`
//! replays exactly, call order does not matter, and a data-parallel rank that takes rows
//! `lo..hi` of the global batch ([`Dataset::train_rows`]) sees the same rows whatever the
//! device count. Evaluation ([`Dataset::val_batches`]) walks the held-out split from its start
//! in non-overlapping windows, the same ones every time.
//!
//! [`unigram_entropy_nats`] is the loss of the best model that ignores context: the baseline a
//! trained model must beat.

use crate::{Result, RuntimeError};
use std::fmt;
use std::ops::Range;
use std::path::Path;
use std::str::FromStr;
use std::sync::Arc;
use tessera_ir::rng::splitmix64;

/// The fraction of a single file's tokens held out for evaluation (the tail of the file).
pub const DEFAULT_VAL_FRACTION: f64 = 0.1;

fn data_err(msg: impl Into<String>) -> RuntimeError {
    RuntimeError::Data(msg.into())
}

// ---------------------------------------------------------------------------------------------
// Tokenizers
// ---------------------------------------------------------------------------------------------

/// Bytes as token ids: vocabulary 256, lossless for any input, no file needed.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ByteTokenizer;

impl ByteTokenizer {
    pub const VOCAB_SIZE: usize = 256;

    /// The UTF-8 bytes of `text`, one id each.
    pub fn encode(&self, text: &str) -> Vec<u32> {
        self.encode_bytes(text.as_bytes())
    }

    /// Any bytes, one id each (the corpus need not be UTF-8).
    pub fn encode_bytes(&self, bytes: &[u8]) -> Vec<u32> {
        bytes.iter().map(|&b| u32::from(b)).collect()
    }

    /// The bytes back as text; invalid UTF-8 and ids above 255 become U+FFFD.
    pub fn decode(&self, ids: &[u32]) -> String {
        let bytes: Vec<u8> = ids.iter().map(|&id| u8::try_from(id).unwrap_or(0xFF)).collect();
        String::from_utf8_lossy(&bytes).into_owned()
    }

    pub fn vocab_size(&self) -> usize {
        Self::VOCAB_SIZE
    }
}

/// A Hugging Face `tokenizer.json` (BPE, WordPiece, WordLevel or Unigram), run by the
/// `tokenizers` crate built without network access: files only, no hub downloads.
#[derive(Clone, Debug)]
pub struct HfTokenizer {
    /// Shared: a `tokenizer.json` can hold a large vocabulary, and datasets clone tokenizers.
    inner: Arc<tokenizers::Tokenizer>,
    /// Where it came from, for messages.
    source: String,
}

impl HfTokenizer {
    /// Reads a `tokenizer.json` file.
    pub fn from_file(path: impl AsRef<Path>) -> Result<HfTokenizer> {
        let path = path.as_ref();
        // The JSON and the vocabulary and merges parsed from it.
        let bytes = read_bounded(path, 16, |e| {
            data_err(format!(
                "cannot read tokenizer file {}: {e}; pass the path of a Hugging Face \
                 tokenizer.json (or `bytes` for the byte tokenizer)",
                path.display()
            ))
        })?;
        Self::from_json_bytes(&bytes, &path.display().to_string())
    }

    /// Parses the contents of a `tokenizer.json`; `source` names it in messages.
    pub fn from_json_bytes(json: &[u8], source: &str) -> Result<HfTokenizer> {
        let inner = tokenizers::Tokenizer::from_bytes(json).map_err(|e| {
            data_err(format!(
                "{source} is not a valid Hugging Face tokenizer.json: {e}; pass the \
                 tokenizer.json saved with the model (tokenizers' `Tokenizer::save`)"
            ))
        })?;
        Ok(HfTokenizer { inner: Arc::new(inner), source: source.to_string() })
    }

    /// Token ids of `text`, without special tokens (no BOS/EOS/CLS: a corpus is one stream).
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        let enc = self.inner.encode(text, false).map_err(|e| {
            data_err(format!("tokenizer {} failed to encode the text: {e}", self.source))
        })?;
        Ok(enc.get_ids().to_vec())
    }

    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        self.inner.decode(ids, false).map_err(|e| {
            data_err(format!("tokenizer {} failed to decode {} ids: {e}", self.source, ids.len()))
        })
    }

    /// Vocabulary size including added tokens: ids are `0..vocab_size()`.
    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    /// The underlying `tokenizers` tokenizer.
    pub fn inner(&self) -> &tokenizers::Tokenizer {
        &self.inner
    }
}

/// The tokenizer that turns a text corpus into ids.
#[derive(Clone, Debug, Default)]
pub enum Tokenizer {
    /// Bytes as ids (vocabulary 256).
    #[default]
    Byte,
    /// A Hugging Face `tokenizer.json`.
    Hf(HfTokenizer),
}

impl Tokenizer {
    /// `bytes` (or `byte`) for the byte tokenizer, anything else is a `tokenizer.json` path:
    /// the form a `--tokenizer` command-line flag takes.
    pub fn from_arg(arg: &str) -> Result<Tokenizer> {
        match arg {
            "byte" | "bytes" => Ok(Tokenizer::Byte),
            path => Ok(Tokenizer::Hf(HfTokenizer::from_file(path)?)),
        }
    }

    /// Reads a Hugging Face `tokenizer.json`.
    pub fn from_file(path: impl AsRef<Path>) -> Result<Tokenizer> {
        Ok(Tokenizer::Hf(HfTokenizer::from_file(path)?))
    }

    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        match self {
            Tokenizer::Byte => Ok(ByteTokenizer.encode(text)),
            Tokenizer::Hf(t) => t.encode(text),
        }
    }

    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        match self {
            Tokenizer::Byte => Ok(ByteTokenizer.decode(ids)),
            Tokenizer::Hf(t) => t.decode(ids),
        }
    }

    pub fn vocab_size(&self) -> usize {
        match self {
            Tokenizer::Byte => ByteTokenizer::VOCAB_SIZE,
            Tokenizer::Hf(t) => t.vocab_size(),
        }
    }

    /// The id of BERT's `[MASK]`: the tokenizer's own token, or for bytes the first id past
    /// them (256), which the model's vocabulary must hold (`bert-tiny` does).
    pub fn mask_id(&self, model_vocab: usize) -> Result<i64> {
        let id = match self {
            Tokenizer::Byte => Some(ByteTokenizer::VOCAB_SIZE as i64),
            Tokenizer::Hf(t) => t.inner().token_to_id("[MASK]").map(i64::from),
        };
        match id {
            Some(id) if (id as usize) < model_vocab => Ok(id),
            Some(id) => Err(data_err(format!(
                "masked-LM training needs a [MASK] token: {} gives it id {id}, outside the \
                 model's vocabulary of {model_vocab}; use a model whose vocabulary holds it \
                 (bert-tiny for bytes) or a --tokenizer with a [MASK] token",
                self.describe()
            ))),
            None => Err(data_err(format!(
                "masked-LM training needs a [MASK] token and {} has none: pass the BERT \
                 tokenizer.json",
                self.describe()
            ))),
        }
    }

    /// A short name for messages: `bytes` or the tokenizer file.
    pub fn describe(&self) -> String {
        match self {
            Tokenizer::Byte => "the byte tokenizer (vocabulary 256)".to_string(),
            Tokenizer::Hf(t) => {
                format!("the tokenizer {} (vocabulary {})", t.source, t.vocab_size())
            }
        }
    }

    /// Encodes a file's bytes; `name` names the file in messages.
    fn encode_file(&self, bytes: &[u8], name: &str) -> Result<Vec<u32>> {
        match self {
            Tokenizer::Byte => Ok(ByteTokenizer.encode_bytes(bytes)),
            Tokenizer::Hf(t) => {
                let text = std::str::from_utf8(bytes).map_err(|e| {
                    data_err(format!(
                        "{name} is not UTF-8 (invalid byte at offset {}); the tokenizer {} needs \
                         UTF-8 text: re-encode the file, or use the byte tokenizer",
                        e.valid_up_to(),
                        t.source
                    ))
                })?;
                t.encode(text)
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Sources and options
// ---------------------------------------------------------------------------------------------

/// The width of the ids in a `.bin` token file (little-endian, no header).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum TokenDType {
    /// nanoGPT's default (`np.uint16`): vocabularies up to 65,536 ids (GPT-2's 50,257 fits).
    #[default]
    U16,
    /// For vocabularies beyond 65,536 ids (LLaMA 3's 128,256, ...).
    U32,
}

impl TokenDType {
    /// Bytes per token.
    pub fn size(self) -> usize {
        match self {
            TokenDType::U16 => 2,
            TokenDType::U32 => 4,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            TokenDType::U16 => "u16",
            TokenDType::U32 => "u32",
        }
    }
}

impl fmt::Display for TokenDType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for TokenDType {
    type Err = RuntimeError;

    /// `u16`/`uint16` or `u32`/`uint32` (a `--token-dtype` flag).
    fn from_str(s: &str) -> Result<TokenDType> {
        match s.to_ascii_lowercase().as_str() {
            "u16" | "uint16" => Ok(TokenDType::U16),
            "u32" | "uint32" => Ok(TokenDType::U32),
            other => Err(data_err(format!(
                "unknown token dtype `{other}`: use u16 (nanoGPT's default) or u32"
            ))),
        }
    }
}

/// How [`Dataset::load`] reads a corpus.
#[derive(Clone, Debug)]
pub struct DataOptions {
    /// Width of the ids in `.bin` files.
    pub token_dtype: TokenDType,
    /// Encodes text files (ignored for `.bin` files).
    pub tokenizer: Tokenizer,
    /// Fraction of a single file's tokens held out (its tail); in `(0, 1)`.
    pub val_fraction: f64,
}

impl Default for DataOptions {
    fn default() -> Self {
        DataOptions {
            token_dtype: TokenDType::U16,
            tokenizer: Tokenizer::Byte,
            val_fraction: DEFAULT_VAL_FRACTION,
        }
    }
}

fn is_token_file(path: &Path) -> bool {
    path.extension().is_some_and(|e| e.eq_ignore_ascii_case("bin"))
}

/// The most read from a data "file" that is not a regular file (a device such as /dev/zero, a
/// pipe): its size is unknown until read, so the read stops here and refuses.
pub const MAX_STREAM_BYTES: u64 = 256 << 20;

/// Reads the data file `path` whole, when it fits: a regular file of `size` bytes must leave
/// `size × factor` bytes of host memory available (`factor`: what loading makes of each byte —
/// the bytes, their tokens, the splits); anything else (a device, a pipe) is read up to
/// [`MAX_STREAM_BYTES`] and refused past it. Without this, `--data /dev/zero` reads until the
/// kernel kills the process. `io_err` words a failed open or read.
pub fn read_bounded(
    path: &Path,
    factor: u64,
    io_err: impl Fn(std::io::Error) -> RuntimeError,
) -> Result<Vec<u8>> {
    use std::io::Read as _;
    let file = std::fs::File::open(path).map_err(&io_err)?;
    let meta = file.metadata().map_err(&io_err)?;
    let p = path.display();
    if meta.is_file() {
        let need = meta.len().saturating_mul(factor);
        if let Some(avail) = crate::host::available_memory().filter(|&a| need > a) {
            let gib = |b: u64| format!("{:.2} GiB", b as f64 / (1u64 << 30) as f64);
            return Err(data_err(format!(
                "data file {p} is {}; loading it takes about {} of memory and {} are available: \
                 use a smaller file (a slice of the corpus), or free memory",
                gib(meta.len()),
                gib(need),
                gib(avail)
            )));
        }
        let mut bytes = Vec::new();
        file.take(meta.len()).read_to_end(&mut bytes).map_err(&io_err)?;
        return Ok(bytes);
    }
    let mut bytes = Vec::new();
    file.take(MAX_STREAM_BYTES + 1).read_to_end(&mut bytes).map_err(&io_err)?;
    if bytes.len() as u64 > MAX_STREAM_BYTES {
        return Err(data_err(format!(
            "data path {p} is not a regular file (a device or a pipe) and holds more than {} \
             MiB, the most read from one: write the data to a regular file and pass its path",
            MAX_STREAM_BYTES >> 20
        )));
    }
    Ok(bytes)
}

fn read_file(path: &Path, factor: u64) -> Result<Vec<u8>> {
    let bytes = read_bounded(path, factor, |e| {
        data_err(format!(
            "cannot read data file {}: {e}; check the path (a text file, a .bin token file, or \
             a directory with train.bin and val.bin)",
            path.display()
        ))
    })?;
    if bytes.is_empty() {
        return Err(data_err(format!(
            "data file {} is empty; point at a non-empty corpus",
            path.display()
        )));
    }
    Ok(bytes)
}

/// Reads a raw little-endian token file.
fn read_token_file(path: &Path, dtype: TokenDType) -> Result<Vec<u32>> {
    // The bytes, then a u32 token per `size` of them, then the train/val split's copy.
    let size = dtype.size();
    let bytes = read_file(path, 1 + 8 / size as u64)?;
    if bytes.len() % size != 0 {
        let other = match dtype {
            TokenDType::U16 => "u32",
            TokenDType::U32 => "u16",
        };
        return Err(data_err(format!(
            "token file {} is {} bytes, not a multiple of {size} ({dtype} tokens): the file is \
             truncated or holds another width; if it was written as {other}, pass \
             --token-dtype {other}",
            path.display(),
            bytes.len()
        )));
    }
    Ok(match dtype {
        TokenDType::U16 => {
            bytes.chunks_exact(2).map(|c| u32::from(u16::from_le_bytes([c[0], c[1]]))).collect()
        }
        TokenDType::U32 => {
            bytes.chunks_exact(4).map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect()
        }
    })
}

// ---------------------------------------------------------------------------------------------
// Dataset
// ---------------------------------------------------------------------------------------------

/// A training corpus: a train split and a held-out split of token ids.
#[derive(Clone, Debug)]
pub struct Dataset {
    pub train: Vec<u32>,
    pub val: Vec<u32>,
    /// The tokenizer's vocabulary for text; for token files, which carry no vocabulary, one
    /// more than the largest id seen (a lower bound on the vocabulary that produced them).
    pub vocab_size: usize,
    /// Where the data came from (a path, or `<text>`), for messages.
    pub source: String,
    /// The tokenizer that produced the ids (text sources only), e.g. to decode samples.
    pub tokenizer: Option<Tokenizer>,
}

/// `inputs` and `targets` of one step, row-major `[batch, seq]`; `targets[i]` is the token
/// after `inputs[i]` in the corpus.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Batch {
    pub inputs: Vec<i64>,
    pub targets: Vec<i64>,
    pub batch: usize,
    pub seq: usize,
}

impl Batch {
    /// Rows starting at `offsets` in `tokens` (each needs `seq + 1` tokens from its offset).
    fn from_windows(tokens: &[u32], offsets: &[usize], seq: usize) -> Batch {
        let mut inputs = Vec::with_capacity(offsets.len() * seq);
        let mut targets = Vec::with_capacity(offsets.len() * seq);
        for &o in offsets {
            let window = &tokens[o..o + seq + 1];
            inputs.extend(window[..seq].iter().map(|&t| i64::from(t)));
            targets.extend(window[1..].iter().map(|&t| i64::from(t)));
        }
        Batch { inputs, targets, batch: offsets.len(), seq }
    }
}

/// A uniform draw in `0..n` (n ≥ 1) that depends only on `(seed, step, row)`.
pub(crate) fn counter_draw(seed: u64, step: u64, row: u64, n: usize) -> usize {
    let key = splitmix64(splitmix64(splitmix64(seed) ^ step) ^ row);
    // Lemire's multiply-high: bias below 2^-40 for any corpus that fits in memory.
    ((u128::from(key) * n as u128) >> 64) as usize
}

impl Dataset {
    /// Reads a corpus: a directory with `train.bin` + `val.bin`, a `.bin` token file, or a text
    /// file (see the module docs). Single files are split: the last `val_fraction` of the
    /// tokens is the held-out split.
    pub fn load(path: impl AsRef<Path>, opts: &DataOptions) -> Result<Dataset> {
        let path = path.as_ref();
        let meta = std::fs::metadata(path).map_err(|e| {
            data_err(format!(
                "cannot read data path {}: {e}; check the path (a text file, a .bin token file, \
                 or a directory with train.bin and val.bin)",
                path.display()
            ))
        })?;
        let source = path.display().to_string();
        if meta.is_dir() {
            let (train_path, val_path) = (path.join("train.bin"), path.join("val.bin"));
            for p in [&train_path, &val_path] {
                if !p.is_file() {
                    return Err(data_err(format!(
                        "data directory {source} has no {}: a directory must hold nanoGPT's \
                         train.bin and val.bin token files; add it, or point at a single \
                         corpus file",
                        p.file_name().and_then(|n| n.to_str()).unwrap_or("?")
                    )));
                }
            }
            let train = read_token_file(&train_path, opts.token_dtype)?;
            let val = read_token_file(&val_path, opts.token_dtype)?;
            let vocab_size = max_id_plus_one(&train).max(max_id_plus_one(&val));
            return Ok(Dataset { train, val, vocab_size, source, tokenizer: None });
        }
        if is_token_file(path) {
            let tokens = read_token_file(path, opts.token_dtype)?;
            let vocab_size = max_id_plus_one(&tokens);
            return Self::split(tokens, vocab_size, opts.val_fraction, source, None);
        }
        // The bytes, up to a u32 token per byte, then the train/val split's copy.
        let bytes = read_file(path, 9)?;
        let tokens = opts.tokenizer.encode_file(&bytes, &source)?;
        if tokens.is_empty() {
            return Err(data_err(format!(
                "data file {source} encodes to no tokens with {}; point at a corpus with text",
                opts.tokenizer.describe()
            )));
        }
        let vocab = opts.tokenizer.vocab_size();
        Self::split(tokens, vocab, opts.val_fraction, source, Some(opts.tokenizer.clone()))
    }

    /// Encodes `text` and holds out its last 10% of tokens.
    pub fn from_text(text: &str, tokenizer: &Tokenizer) -> Result<Dataset> {
        let tokens = tokenizer.encode(text)?;
        let vocab = tokenizer.vocab_size();
        Self::split(
            tokens,
            vocab,
            DEFAULT_VAL_FRACTION,
            "<text>".to_string(),
            Some(tokenizer.clone()),
        )
    }

    /// Splits a token stream: the last `val_fraction` (rounded to whole tokens) is held out.
    pub fn from_tokens(tokens: Vec<u32>, vocab_size: usize, val_fraction: f64) -> Result<Dataset> {
        Self::split(tokens, vocab_size, val_fraction, "<tokens>".to_string(), None)
    }

    fn split(
        mut tokens: Vec<u32>,
        vocab_size: usize,
        val_fraction: f64,
        source: String,
        tokenizer: Option<Tokenizer>,
    ) -> Result<Dataset> {
        if !(val_fraction > 0.0 && val_fraction < 1.0) {
            return Err(data_err(format!(
                "held-out fraction {val_fraction} is not in (0, 1); use e.g. 0.1 (the last 10% \
                 of the tokens)"
            )));
        }
        let n_val = ((tokens.len() as f64 * val_fraction).round() as usize).min(tokens.len());
        let val = tokens.split_off(tokens.len() - n_val);
        Ok(Dataset { train: tokens, val, vocab_size, source, tokenizer })
    }

    /// Checks the data against a model before training: both splits hold at least `seq + 1`
    /// tokens (one window), and every id is below `model_vocab`.
    pub fn validate(&self, model_vocab: usize, seq: usize) -> Result<()> {
        for (name, split) in [("train", &self.train), ("held-out", &self.val)] {
            self.check_len(name, split, seq)?;
        }
        for (name, split) in [("train", &self.train), ("held-out", &self.val)] {
            if let Some((pos, &id)) =
                split.iter().enumerate().find(|(_, &id)| id as usize >= model_vocab)
            {
                let hint = match &self.tokenizer {
                    Some(t) => format!(
                        "the data was encoded with {}, larger than the model's: use a model \
                         whose vocab_size is at least {} or the model's own tokenizer",
                        t.describe(),
                        t.vocab_size()
                    ),
                    None => format!(
                        "the token file was written with a larger vocabulary than the model's: \
                         re-tokenize it with the model's tokenizer, or use a model whose \
                         vocab_size is at least {}",
                        self.vocab_size.max(id as usize + 1)
                    ),
                };
                return Err(data_err(format!(
                    "token id {id} at position {pos} of the {name} split of {} is out of range \
                     for the model's vocabulary of {model_vocab} (ids 0..{model_vocab}); {hint}",
                    self.source
                )));
            }
        }
        Ok(())
    }

    fn check_len(&self, name: &str, split: &[u32], seq: usize) -> Result<()> {
        if seq == 0 {
            return Err(data_err("sequence length 0: use --seq of at least 1"));
        }
        if split.len() < seq + 1 {
            return Err(data_err(format!(
                "the {name} split of {} has {} tokens, but sequence length {seq} needs at least \
                 {} (seq + 1: the inputs and their next-token targets); use a longer corpus or \
                 a shorter --seq",
                self.source,
                split.len(),
                seq + 1
            )));
        }
        Ok(())
    }

    /// Start offsets of rows `rows` of training step `step`: each a uniform draw in
    /// `0..=train.len() - seq - 1` keyed by `(seed, step, row)` alone.
    pub fn train_offsets(
        &self,
        seed: u64,
        step: u64,
        rows: Range<usize>,
        seq: usize,
    ) -> Result<Vec<usize>> {
        self.check_len("train", &self.train, seq)?;
        let starts = self.train.len() - seq; // offsets 0..starts keep seq + 1 tokens in range
        Ok(rows.map(|row| counter_draw(seed, step, row as u64, starts)).collect())
    }

    /// The global batch of training step `step`: `batch` random windows of the train split.
    pub fn train_batch(&self, seed: u64, step: u64, batch: usize, seq: usize) -> Result<Batch> {
        self.train_rows(seed, step, 0..batch, seq)
    }

    /// Rows `rows` of step `step`'s global batch (a data-parallel rank's share): row `r` is
    /// the same window whichever range it is asked for in.
    pub fn train_rows(
        &self,
        seed: u64,
        step: u64,
        rows: Range<usize>,
        seq: usize,
    ) -> Result<Batch> {
        if rows.is_empty() {
            return Err(data_err(format!(
                "empty row range {rows:?}: a batch needs at least one row (--batch ≥ 1)"
            )));
        }
        let offsets = self.train_offsets(seed, step, rows, seq)?;
        Ok(Batch::from_windows(&self.train, &offsets, seq))
    }

    /// Start offsets of the held-out windows: `0, seq, 2·seq, ...` while `seq + 1` tokens fit.
    /// Inputs never overlap, so each held-out token (but the first) is predicted exactly once.
    pub fn val_offsets(&self, seq: usize) -> Result<Vec<usize>> {
        self.check_len("held-out", &self.val, seq)?;
        Ok((0..(self.val.len() - 1) / seq).map(|i| i * seq).collect())
    }

    /// Evaluation batches: the held-out windows of [`Dataset::val_offsets`] from the start of
    /// the split, `batch` per batch, at most `max_batches` batches, only full batches. The same
    /// batches on every call.
    pub fn val_batches(&self, batch: usize, seq: usize, max_batches: usize) -> Result<Vec<Batch>> {
        if batch == 0 {
            return Err(data_err("batch size 0: use --batch of at least 1"));
        }
        let offsets = self.val_offsets(seq)?;
        if offsets.len() < batch {
            return Err(data_err(format!(
                "the held-out split of {} has {} tokens: {} windows of seq {seq}, fewer than one \
                 batch of {batch}, which needs {} tokens; use a longer corpus, a smaller \
                 --batch or a shorter --seq",
                self.source,
                self.val.len(),
                offsets.len(),
                batch * seq + 1
            )));
        }
        Ok(offsets
            .chunks_exact(batch)
            .take(max_batches)
            .map(|rows| Batch::from_windows(&self.val, rows, seq))
            .collect())
    }
}

fn max_id_plus_one(tokens: &[u32]) -> usize {
    tokens.iter().max().map_or(0, |&m| m as usize + 1)
}

/// Shannon entropy, in nats, of the empirical unigram distribution of `tokens`:
/// `-Σ p(t) ln p(t)`. The cross-entropy of the best context-free predictor, so a model that
/// learnt anything has a lower loss. `vocab` sizes the count table (ids ≥ `vocab` are still
/// counted); 0 for an empty slice.
pub fn unigram_entropy_nats(tokens: &[u32], vocab: usize) -> f64 {
    if tokens.is_empty() {
        return 0.0;
    }
    let mut counts = vec![0u64; vocab.max(max_id_plus_one(tokens))];
    for &t in tokens {
        counts[t as usize] += 1;
    }
    let n = tokens.len() as f64;
    -counts
        .iter()
        .filter(|&&c| c > 0)
        .map(|&c| {
            let p = c as f64 / n;
            p * p.ln()
        })
        .sum::<f64>()
}

/// What a model learns from a window of tokens: the next token at every position (causal
/// LMs), or masked positions from both sides (BERT's masked-LM).
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Objective {
    CausalLm,
    MaskedLm(MaskedLm),
}

impl Objective {
    /// The `(inputs, labels)` of training step `step` (global `[batch, seq]`, row-major).
    pub fn train_batch(
        &self,
        data: &Dataset,
        seed: u64,
        step: u64,
        batch: usize,
        seq: usize,
    ) -> Result<(Vec<i64>, Vec<i64>)> {
        let b = data.train_batch(seed, step, batch, seq)?;
        Ok(match self {
            Objective::CausalLm => (b.inputs, b.targets),
            Objective::MaskedLm(m) => m.apply(&b.inputs, seed, step),
        })
    }

    /// Up to `max_batches` held-out `(inputs, labels)` batches (masks keyed apart from every
    /// training step's).
    pub fn val_batches(
        &self,
        data: &Dataset,
        seed: u64,
        batch: usize,
        seq: usize,
        max_batches: usize,
    ) -> Result<Vec<(Vec<i64>, Vec<i64>)>> {
        let batches = data.val_batches(batch, seq, max_batches)?;
        Ok(batches
            .into_iter()
            .enumerate()
            .map(|(i, b)| match self {
                Objective::CausalLm => (b.inputs, b.targets),
                Objective::MaskedLm(m) => m.apply(&b.inputs, seed, u64::MAX - i as u64),
            })
            .collect())
    }
}

/// BERT's masked-LM targets (Devlin et al. 2019, as `transformers`' data collator draws them):
/// each position is chosen with probability `prob` (0.15); a chosen position is labelled with
/// its token, and its input becomes `mask_id` 80% of the time, a random token 10%, and stays
/// 10%; every other position is labelled −100 (ignored by the loss). Draws are keyed by (seed,
/// step, element index), so every device of every plan builds the same batch.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct MaskedLm {
    pub mask_id: i64,
    pub vocab_size: usize,
    pub prob: f64,
}

/// The label of a position the loss ignores (HF's `ignore_index`).
pub const IGNORED: i64 = -100;

impl MaskedLm {
    /// `(inputs, labels)` for `tokens` at `step`.
    pub fn apply(&self, tokens: &[i64], seed: u64, step: u64) -> (Vec<i64>, Vec<i64>) {
        use tessera_ir::rng::splitmix64 as mix;
        let unit = |h: u64| (h >> 11) as f64 / (1u64 << 53) as f64;
        let base = mix(seed ^ mix(step ^ 0x4D4C_4D5F_4D41_534B));
        let mut inputs = tokens.to_vec();
        let mut labels = vec![IGNORED; tokens.len()];
        for (i, (&t, (x, l))) in tokens.iter().zip(inputs.iter_mut().zip(&mut labels)).enumerate() {
            let h = mix(base.wrapping_add(3 * i as u64));
            if unit(h) >= self.prob {
                continue;
            }
            *l = t;
            let how = unit(mix(base.wrapping_add(3 * i as u64 + 1)));
            if how < 0.8 {
                *x = self.mask_id;
            } else if how < 0.9 {
                *x = (mix(base.wrapping_add(3 * i as u64 + 2)) % self.vocab_size as u64) as i64;
            }
        }
        (inputs, labels)
    }
}
