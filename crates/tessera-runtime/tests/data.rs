//! Data pipeline: tokenizers, sources, splits, batching, validation errors, entropy baseline.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use tessera_runtime::data::{
    unigram_entropy_nats, ByteTokenizer, DataOptions, Dataset, HfTokenizer, TokenDType, Tokenizer,
};

/// A fresh, empty directory under the system temp dir, removed on drop.
struct TempDir(PathBuf);

impl TempDir {
    fn new(tag: &str) -> TempDir {
        static NEXT: AtomicUsize = AtomicUsize::new(0);
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let dir =
            std::env::temp_dir().join(format!("tessera-data-{tag}-{}-{n}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        TempDir(dir)
    }

    fn path(&self, name: &str) -> PathBuf {
        self.0.join(name)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn write_u16(path: &Path, ids: &[u32]) {
    let bytes: Vec<u8> = ids.iter().flat_map(|&t| (t as u16).to_le_bytes()).collect();
    std::fs::write(path, bytes).unwrap();
}

fn write_u32(path: &Path, ids: &[u32]) {
    let bytes: Vec<u8> = ids.iter().flat_map(|&t| t.to_le_bytes()).collect();
    std::fs::write(path, bytes).unwrap();
}

/// A deterministic pseudo-random byte text of `n` bytes (varied enough that windows differ).
fn corpus(n: usize) -> Vec<u32> {
    let mut x = 0x1234_5678_u64;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x % 256) as u32
        })
        .collect()
}

fn err_text<T: std::fmt::Debug>(r: tessera_runtime::Result<T>) -> String {
    r.expect_err("expected an error").to_string()
}

// ---------------------------------------------------------------------------------------------
// Tokenizers
// ---------------------------------------------------------------------------------------------

#[test]
fn byte_tokenizer_round_trips() {
    let text = "To be, or not to be — that is the question: ½ ∀x.";
    let ids = ByteTokenizer.encode(text);
    assert_eq!(ids.len(), text.len());
    assert!(ids.iter().all(|&id| id < 256));
    assert_eq!(ids[0], u32::from(b'T'));
    assert_eq!(ByteTokenizer.decode(&ids), text);
    let t = Tokenizer::Byte;
    assert_eq!(t.vocab_size(), 256);
    assert_eq!(t.decode(&t.encode(text).unwrap()).unwrap(), text);
}

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures").join(name)
}

#[test]
fn hf_wordlevel_fixture_encodes_sentence_to_expected_ids() {
    let t = Tokenizer::from_file(fixture("wordlevel_tokenizer.json")).unwrap();
    assert_eq!(t.vocab_size(), 11);
    // Lowercase normalizer, Whitespace pre-tokenizer (`\w+|[^\w\s]+`), unknown word -> [UNK].
    let ids = t.encode("To be, or not to be: that is the Question, Hamlet").unwrap();
    assert_eq!(ids, vec![1, 2, 5, 3, 4, 1, 2, 10, 6, 7, 8, 9, 5, 0]);
    // Through the `--tokenizer` form too.
    let t2 = Tokenizer::from_arg(fixture("wordlevel_tokenizer.json").to_str().unwrap()).unwrap();
    assert_eq!(t2.encode("not the question").unwrap(), vec![4, 8, 9]);
    assert!(matches!(Tokenizer::from_arg("bytes").unwrap(), Tokenizer::Byte));
}

/// A GPT-2-style byte-level BPE: exercises the look-ahead regex of the ByteLevel pre-tokenizer
/// (why `tokenizers` is built with fancy-regex) and the merges.
const BPE_JSON: &str = r#"{
  "version": "1.0", "truncation": null, "padding": null, "added_tokens": [],
  "normalizer": null,
  "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true,
                    "use_regex": true},
  "post_processor": null,
  "decoder": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true,
              "use_regex": true},
  "model": {
    "type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
    "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false,
    "vocab": {"h": 0, "e": 1, "l": 2, "o": 3, "\u0120": 4, "he": 5, "ll": 6, "hell": 7,
              "hello": 8, "\u0120hello": 9},
    "merges": ["h e", "l l", "he ll", "hell o", "\u0120 hello"]
  }
}"#;

#[test]
fn hf_byte_level_bpe_applies_merges_and_decodes() {
    let t = HfTokenizer::from_json_bytes(BPE_JSON.as_bytes(), "inline BPE").unwrap();
    assert_eq!(t.vocab_size(), 10);
    assert_eq!(t.encode("hello hello").unwrap(), vec![8, 9]);
    assert_eq!(t.encode("hell oh").unwrap(), vec![7, 4, 3, 0]);
    assert_eq!(t.decode(&[8, 9]).unwrap(), "hello hello");
}

#[test]
fn bad_tokenizer_files_name_the_file() {
    let dir = TempDir::new("tok");
    let missing = dir.path("nope/tokenizer.json");
    let msg = err_text(Tokenizer::from_file(&missing));
    assert!(msg.contains("nope/tokenizer.json") && msg.contains("tokenizer.json"), "{msg}");
    let bad = dir.path("bad.json");
    std::fs::write(&bad, "{\"model\": 3}").unwrap();
    let msg = err_text(Tokenizer::from_file(&bad));
    assert!(msg.contains("bad.json") && msg.contains("not a valid"), "{msg}");
}

// ---------------------------------------------------------------------------------------------
// Sources and splits
// ---------------------------------------------------------------------------------------------

#[test]
fn token_dtype_parses_and_defaults_to_u16() {
    assert_eq!(TokenDType::default(), TokenDType::U16);
    assert_eq!(DataOptions::default().token_dtype, TokenDType::U16);
    assert_eq!("u32".parse::<TokenDType>().unwrap(), TokenDType::U32);
    assert_eq!("uint16".parse::<TokenDType>().unwrap(), TokenDType::U16);
    let msg = err_text("f32".parse::<TokenDType>());
    assert!(msg.contains("f32") && msg.contains("u16") && msg.contains("u32"), "{msg}");
}

#[test]
fn u16_bin_file_loads_and_splits_90_10() {
    let dir = TempDir::new("u16");
    let ids: Vec<u32> = (0..1000).map(|i| (i * 61 % 50257) as u32).collect();
    let p = dir.path("tokens.bin");
    write_u16(&p, &ids);
    let ds = Dataset::load(&p, &DataOptions::default()).unwrap();
    assert_eq!(ds.train.len(), 900);
    assert_eq!(ds.val.len(), 100);
    assert_eq!([ds.train.clone(), ds.val.clone()].concat(), ids);
    assert_eq!(ds.vocab_size, *ids.iter().max().unwrap() as usize + 1);
    assert!(ds.tokenizer.is_none());
}

#[test]
fn u32_bin_file_loads_ids_above_u16() {
    let dir = TempDir::new("u32");
    let ids: Vec<u32> = (0..200).map(|i| 70_000 + i * 250).collect();
    let p = dir.path("llama3.BIN");
    write_u32(&p, &ids);
    let opts = DataOptions { token_dtype: TokenDType::U32, ..DataOptions::default() };
    let ds = Dataset::load(&p, &opts).unwrap();
    assert_eq!((ds.train.len(), ds.val.len()), (180, 20));
    assert_eq!([ds.train.clone(), ds.val.clone()].concat(), ids);
    assert_eq!(ds.vocab_size, 70_000 + 199 * 250 + 1);
}

#[test]
fn nanogpt_directory_uses_train_and_val_bin() {
    let dir = TempDir::new("dir");
    let train: Vec<u32> = (0..300).map(|i| i % 97).collect();
    let val: Vec<u32> = (0..50).map(|i| 100 + i % 7).collect();
    write_u16(&dir.path("train.bin"), &train);
    write_u16(&dir.path("val.bin"), &val);
    let ds = Dataset::load(&dir.0, &DataOptions::default()).unwrap();
    assert_eq!(ds.train, train);
    assert_eq!(ds.val, val);
    assert_eq!(ds.vocab_size, 107);

    std::fs::remove_file(dir.path("val.bin")).unwrap();
    let msg = err_text(Dataset::load(&dir.0, &DataOptions::default()));
    assert!(msg.contains("val.bin") && msg.contains("train.bin"), "{msg}");
}

#[test]
fn text_file_splits_last_10_percent_by_tokens() {
    let dir = TempDir::new("txt");
    let text: String = (0..2000).map(|i| (b'a' + (i % 26) as u8) as char).collect();
    let p = dir.path("corpus.txt");
    std::fs::write(&p, &text).unwrap();
    let ds = Dataset::load(&p, &DataOptions::default()).unwrap();
    assert_eq!((ds.train.len(), ds.val.len()), (1800, 200));
    assert_eq!(ds.vocab_size, 256);
    assert_eq!(ds.val, ByteTokenizer.encode(&text[1800..]));

    let ds = Dataset::from_text(&text[..1234], &Tokenizer::Byte).unwrap();
    assert_eq!((ds.train.len(), ds.val.len()), (1111, 123));

    // With an HF tokenizer, the split is by tokens, not bytes.
    let t = Tokenizer::from_file(fixture("wordlevel_tokenizer.json")).unwrap();
    let sentence = "to be or not to be that is the question ";
    let ds = Dataset::from_text(&sentence.repeat(10), &t).unwrap();
    assert_eq!((ds.train.len(), ds.val.len()), (90, 10));
    assert_eq!(ds.vocab_size, 11);
    assert_eq!(ds.val, t.encode(sentence).unwrap());

    // And through `load` with a non-UTF-8 file: the byte tokenizer takes it, HF refuses.
    let raw = dir.path("latin1.txt");
    std::fs::write(&raw, [b'c', b'a', b'f', 0xE9, b' ', b'o', b'k']).unwrap();
    assert_eq!(Dataset::load(&raw, &DataOptions::default()).unwrap().train.len(), 6);
    let opts = DataOptions { tokenizer: t, ..DataOptions::default() };
    let msg = err_text(Dataset::load(&raw, &opts));
    assert!(msg.contains("latin1.txt") && msg.contains("UTF-8") && msg.contains("offset 3"));
}

// ---------------------------------------------------------------------------------------------
// Batching
// ---------------------------------------------------------------------------------------------

fn dataset(n: usize) -> Dataset {
    Dataset::from_tokens(corpus(n), 256, 0.1).unwrap()
}

#[test]
fn train_batch_rows_are_corpus_windows_with_shifted_targets() {
    let ds = dataset(5000);
    let (b, s) = (8, 32);
    let batch = ds.train_batch(7, 3, b, s).unwrap();
    assert_eq!((batch.batch, batch.seq), (b, s));
    assert_eq!(batch.inputs.len(), b * s);
    assert_eq!(batch.targets.len(), b * s);
    let offsets = ds.train_offsets(7, 3, 0..b, s).unwrap();
    for (r, &o) in offsets.iter().enumerate() {
        assert!(o + s < ds.train.len(), "offset {o} out of range");
        let row = |v: &[i64]| v[r * s..(r + 1) * s].to_vec();
        let want_in: Vec<i64> = ds.train[o..o + s].iter().map(|&t| t as i64).collect();
        let want_tg: Vec<i64> = ds.train[o + 1..o + s + 1].iter().map(|&t| t as i64).collect();
        assert_eq!(row(&batch.inputs), want_in);
        assert_eq!(row(&batch.targets), want_tg);
        // Targets are the inputs shifted by one token.
        assert_eq!(row(&batch.inputs)[1..], row(&batch.targets)[..s - 1]);
    }
}

#[test]
fn train_offsets_cover_the_range_and_stay_in_bounds() {
    // A tiny corpus: every offset must be in 0..=len-seq-1, and all of them get drawn.
    let ds = dataset(40); // 36 train tokens
    let s = 5;
    let starts = ds.train.len() - s;
    let mut seen = vec![false; starts];
    for step in 0..200 {
        for o in ds.train_offsets(1, step, 0..8, s).unwrap() {
            assert!(o < starts, "offset {o} ≥ {starts}");
            seen[o] = true;
        }
    }
    assert!(seen.iter().all(|&x| x), "some offsets never drawn: {seen:?}");
    // Exactly seq + 1 tokens: one possible window.
    let ds = Dataset::from_tokens((0..11).collect(), 256, 0.05).unwrap();
    assert_eq!(ds.train.len(), 10);
    let b = ds.train_batch(0, 0, 3, 9).unwrap();
    assert_eq!(b.inputs, (0..9).collect::<Vec<i64>>().repeat(3));
    assert_eq!(b.targets, (1..10).collect::<Vec<i64>>().repeat(3));
}

#[test]
fn train_batches_depend_only_on_seed_step_and_row() {
    let ds = dataset(100_000);
    let (b, s) = (4, 64);
    let first = ds.train_batch(42, 10, b, s).unwrap();
    // Other calls in between change nothing: the draw is counter-based, not a stream.
    for step in 0..5 {
        ds.train_batch(42, step, b, s).unwrap();
    }
    assert_eq!(ds.train_batch(42, 10, b, s).unwrap(), first);
    // A clone (e.g. a resumed run) gives the same batch.
    assert_eq!(ds.clone().train_batch(42, 10, b, s).unwrap(), first);
    // Different steps and seeds differ.
    assert_ne!(ds.train_batch(42, 11, b, s).unwrap(), first);
    assert_ne!(ds.train_batch(43, 10, b, s).unwrap(), first);
    // Rows within a batch differ.
    let offs = ds.train_offsets(42, 10, 0..b, s).unwrap();
    assert!(offs.windows(2).any(|w| w[0] != w[1]));
    // Any split of the global batch into ranks' row ranges gives the same rows.
    let all = ds.train_batch(42, 10, 8, s).unwrap();
    for ranks in [1usize, 2, 4, 8] {
        let per = 8 / ranks;
        let mut inputs = Vec::new();
        let mut targets = Vec::new();
        for r in (0..ranks).rev() {
            let part = ds.train_rows(42, 10, r * per..(r + 1) * per, s).unwrap();
            assert_eq!(part.batch, per);
            inputs.splice(0..0, part.inputs);
            targets.splice(0..0, part.targets);
        }
        assert_eq!((inputs, targets), (all.inputs.clone(), all.targets.clone()), "{ranks}");
    }
    // The first rows of a bigger batch are the smaller batch.
    assert_eq!(all.inputs[..b * s], first.inputs[..]);
}

#[test]
fn val_batches_are_deterministic_non_overlapping_windows_from_the_start() {
    let ds = dataset(10_000); // 1,000 held-out tokens
    let (b, s) = (4, 16);
    let batches = ds.val_batches(b, s, 100).unwrap();
    // (1000 - 1) / 16 = 62 windows -> 15 full batches of 4.
    assert_eq!(batches.len(), 15);
    assert_eq!(ds.val_batches(b, s, 100).unwrap(), batches);
    assert_eq!(ds.val_batches(b, s, 3).unwrap(), batches[..3]);
    for (k, batch) in batches.iter().enumerate() {
        assert_eq!((batch.batch, batch.seq), (b, s));
        for r in 0..b {
            let o = (k * b + r) * s;
            assert!(o + s < ds.val.len());
            let want_in: Vec<i64> = ds.val[o..o + s].iter().map(|&t| t as i64).collect();
            let want_tg: Vec<i64> = ds.val[o + 1..o + s + 1].iter().map(|&t| t as i64).collect();
            assert_eq!(batch.inputs[r * s..(r + 1) * s], want_in[..]);
            assert_eq!(batch.targets[r * s..(r + 1) * s], want_tg[..]);
        }
    }
    assert_eq!(ds.val_offsets(s).unwrap().len(), 62);
    let msg = err_text(ds.val_batches(100, 16, 1));
    assert!(msg.contains("1000 tokens") && msg.contains("1601"), "{msg}");
}

// ---------------------------------------------------------------------------------------------
// Entropy baseline
// ---------------------------------------------------------------------------------------------

#[test]
fn unigram_entropy_matches_hand_computed_values() {
    let h = unigram_entropy_nats(&ByteTokenizer.encode("aab"), 256);
    let want = -((2.0f64 / 3.0) * (2.0f64 / 3.0).ln() + (1.0f64 / 3.0) * (1.0f64 / 3.0).ln());
    assert!((h - want).abs() < 1e-12, "{h} vs {want}");
    let uniform: Vec<u32> = (0..256 * 4).map(|i| i % 256).collect();
    assert!((unigram_entropy_nats(&uniform, 256) - 256f64.ln()).abs() < 1e-12);
    assert_eq!(unigram_entropy_nats(&[5, 5, 5], 256), 0.0);
    assert_eq!(unigram_entropy_nats(&[], 256), 0.0);
    // Ids beyond `vocab` are counted, not a panic.
    assert!((unigram_entropy_nats(&[1, 300], 4) - 2f64.ln()).abs() < 1e-12);
}

/// The corpus shipped in `data/`: its size and split, and the byte-level unigram entropies that
/// `data/README.md` quotes (the loss a byte model must get below). If the corpus is regenerated
/// differently, update the README and these figures together.
#[test]
fn shipped_corpus_matches_its_readme() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../data/shakespeare.txt");
    let ds = Dataset::load(&path, &DataOptions::default()).unwrap();
    assert_eq!((ds.train.len(), ds.val.len()), (839_553, 93_284));
    ds.validate(256, 1024).unwrap();
    let h_train = unigram_entropy_nats(&ds.train, 256);
    let h_val = unigram_entropy_nats(&ds.val, 256);
    eprintln!(
        "shakespeare.txt: train {} / val {} bytes; unigram entropy train {h_train:.6} nats \
         ({:.6} bits), val {h_val:.6} nats ({:.6} bits)",
        ds.train.len(),
        ds.val.len(),
        h_train / std::f64::consts::LN_2,
        h_val / std::f64::consts::LN_2
    );
    assert!((h_train - 3.318848).abs() < 5e-6, "{h_train}");
    assert!((h_val - 3.355915).abs() < 5e-6, "{h_val}");
}

// ---------------------------------------------------------------------------------------------
// Bad inputs: one clear error each
// ---------------------------------------------------------------------------------------------

#[test]
fn missing_file_is_named() {
    let dir = TempDir::new("missing");
    let p = dir.path("no-such-corpus.txt");
    let msg = err_text(Dataset::load(&p, &DataOptions::default()));
    assert!(msg.contains("no-such-corpus.txt") && msg.contains("cannot read"), "{msg}");
}

#[test]
fn empty_file_is_refused() {
    let dir = TempDir::new("empty");
    for name in ["empty.txt", "empty.bin"] {
        let p = dir.path(name);
        std::fs::write(&p, b"").unwrap();
        let msg = err_text(Dataset::load(&p, &DataOptions::default()));
        assert!(msg.contains(name) && msg.contains("empty"), "{msg}");
    }
}

#[test]
fn odd_length_u16_bin_is_refused_with_the_fix() {
    let dir = TempDir::new("odd");
    let p = dir.path("odd.bin");
    std::fs::write(&p, [1u8, 0, 2, 0, 3]).unwrap();
    let msg = err_text(Dataset::load(&p, &DataOptions::default()));
    assert!(msg.contains("odd.bin") && msg.contains("5 bytes"), "{msg}");
    assert!(msg.contains("multiple of 2"), "{msg}");
    // 6 bytes as u32 fails too, and suggests u16.
    std::fs::write(&p, [1u8, 0, 2, 0, 3, 0]).unwrap();
    let opts = DataOptions { token_dtype: TokenDType::U32, ..DataOptions::default() };
    let msg = err_text(Dataset::load(&p, &opts));
    assert!(msg.contains("multiple of 4") && msg.contains("--token-dtype u16"), "{msg}");
}

#[test]
fn corpus_shorter_than_seq_plus_one_says_how_many_tokens() {
    let ds = Dataset::from_text(&"x".repeat(100), &Tokenizer::Byte).unwrap(); // 90 / 10
    let msg = err_text(ds.validate(256, 95));
    assert!(msg.contains("train split") && msg.contains("90 tokens"), "{msg}");
    assert!(msg.contains("at least 96"), "{msg}");
    let msg = err_text(ds.validate(256, 10));
    assert!(msg.contains("held-out split") && msg.contains("10 tokens"), "{msg}");
    assert!(msg.contains("at least 11"), "{msg}");
    ds.validate(256, 9).unwrap();
    let msg = err_text(ds.train_batch(0, 0, 2, 90));
    assert!(msg.contains("90 tokens") && msg.contains("at least 91"), "{msg}");
    assert!(ds.val_batches(1, 10, 1).is_err());
}

#[test]
fn token_id_beyond_model_vocab_names_id_position_and_vocab() {
    let mut tokens = corpus(1000).into_iter().map(|t| t % 100).collect::<Vec<_>>();
    tokens[123] = 50_300;
    let dir = TempDir::new("vocab");
    let p = dir.path("gpt2ish.bin");
    write_u16(&p, &tokens);
    let ds = Dataset::load(&p, &DataOptions::default()).unwrap();
    let msg = err_text(ds.validate(50_257, 64));
    assert!(msg.contains("token id 50300") && msg.contains("position 123"), "{msg}");
    assert!(msg.contains("50257") && msg.contains("gpt2ish.bin"), "{msg}");
    assert!(msg.contains("tokeniz"), "{msg}");
    ds.validate(50_301, 64).unwrap();

    // Text encoded with bytes against a too-small model: the hint names the byte tokenizer.
    let ds = Dataset::from_text(&"héllo wörld ".repeat(20), &Tokenizer::Byte).unwrap();
    let msg = err_text(ds.validate(128, 16));
    assert!(msg.contains("token id 195") && msg.contains("position 1"), "{msg}");
    assert!(msg.contains("vocabulary of 128") && msg.contains("byte tokenizer"), "{msg}");
}

/// BERT's masking: about 15% of positions are targets (labelled with their token), of which
/// about 80% read [MASK], 10% a random token and 10% themselves; every other position is
/// labelled −100 and reads itself; the same (seed, step) gives the same batch.
#[test]
fn masked_lm_draws_the_bert_proportions_deterministically() {
    use tessera_runtime::data::{MaskedLm, IGNORED};
    let m = MaskedLm { mask_id: 256, vocab_size: 260, prob: 0.15 };
    let tokens: Vec<i64> = (0..200_000).map(|i| (i * 7 % 256) as i64).collect();
    let (x, y) = m.apply(&tokens, 3, 9);
    assert_eq!((x.clone(), y.clone()), m.apply(&tokens, 3, 9));
    assert_ne!(y, m.apply(&tokens, 3, 10).1, "another step masks other positions");
    let (mut chosen, mut masked, mut kept, mut random) = (0, 0, 0, 0);
    for ((&t, &xi), &yi) in tokens.iter().zip(&x).zip(&y) {
        if yi == IGNORED {
            assert_eq!(xi, t, "an unchosen position reads itself");
            continue;
        }
        assert_eq!(yi, t, "a target is the original token");
        chosen += 1;
        match xi {
            256 => masked += 1,
            _ if xi == t => kept += 1,
            _ => random += 1,
        }
    }
    let frac = |k: usize, n: usize| k as f64 / n as f64;
    assert!((frac(chosen, tokens.len()) - 0.15).abs() < 0.005, "chosen {chosen}");
    assert!((frac(masked, chosen) - 0.8).abs() < 0.01, "masked {masked} of {chosen}");
    // A random draw equals the token 1 time in 260: the "kept" share is 10% plus that.
    assert!((frac(kept, chosen) - 0.1).abs() < 0.01, "kept {kept} of {chosen}");
    assert!((frac(random, chosen) - 0.1).abs() < 0.01, "random {random} of {chosen}");
}
