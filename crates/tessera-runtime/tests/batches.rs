//! Step batches of every family against hand computations: fine-tuning rows mask the prompt
//! and the padding, and the model's loss on them is the mean over the completion tokens
//! computed by hand from its logits; image CSVs parse, normalise and split as documented;
//! top-1 accuracy counts what it should.

use tessera_ir::{DType, Program};
use tessera_models::{build, BuildOptions, ModelConfig};
use tessera_runtime::data::{Tokenizer, IGNORED};
use tessera_runtime::examples::ExampleSet;
use tessera_runtime::images::ImageSet;
use tessera_runtime::tensor::to_f64_vec;
use tessera_runtime::trainer::top1_hits;
use tessera_runtime::{CpuBackend, Executor, StepBatch};

const I: i64 = IGNORED;

fn bytes(s: &str) -> Vec<i64> {
    s.bytes().map(i64::from).collect()
}

#[test]
fn prompt_completion_rows_mask_the_prompt_and_the_padding() {
    let text = concat!(
        "{\"prompt\": \"ab\", \"completion\": \"cde\"}\n",
        "\n",
        "{\"prompt\": \"xyz\", \"completion\": \"w\"}\n",
        "{\"text\": \"hi!\"}\n",
        "{\"text\": \"held out\"}\n",
    );
    let set = ExampleSet::parse(text, &Tokenizer::Byte, "<test>").unwrap();
    assert_eq!(set.train.len(), 3);
    assert_eq!(set.val.len(), 1);
    assert_eq!(set.train[1].line, 3, "lines count blank ones");
    let row = |k: usize, seq: usize| set.train[k].row(seq);
    let (a, b, c, d, e) = (97, 98, 99, 100, 101);
    // "ab" + "cde": targets c, d, e (predicted from b, c, d); padding after.
    assert_eq!(row(0, 6), (vec![a, b, c, d, 0, 0], vec![I, c, d, e, I, I]));
    // Cut at seq + 1 tokens: the last target is the 4th token.
    assert_eq!(row(0, 3), (vec![a, b, c], vec![I, c, d]));
    let (x, y, z, w) = (120, 121, 122, 119);
    assert_eq!(row(1, 5), (vec![x, y, z, 0, 0], vec![I, I, w, I, I]));
    // A text record: every token after the first is a target.
    let (h, i) = (104, 105);
    assert_eq!(row(2, 4), (vec![h, i, 0, 0], [&bytes("i!")[..], &[I, I]].concat()));
}

/// gpt2-tiny's loss on two fine-tuning rows is the mean cross-entropy over the completion
/// tokens alone, computed here from its logits.
#[test]
fn the_loss_counts_the_completion_tokens_only() {
    let text = concat!(
        "{\"prompt\": \"ab\", \"completion\": \"cde\"}\n",
        "{\"prompt\": \"xyz\", \"completion\": \"w\"}\n",
        "{\"text\": \"unused\"}\n",
    );
    let set = ExampleSet::parse(text, &Tokenizer::Byte, "<test>").unwrap();
    let (seq, rows) = (6, 2);
    let mut inputs = Vec::new();
    let mut labels = Vec::new();
    for e in &set.train {
        let (x, y) = e.row(seq);
        inputs.extend(x);
        labels.extend(y);
    }
    let batch = StepBatch::tokens(inputs, labels.clone(), rows, seq).unwrap();
    assert_eq!(batch.num_targets().unwrap(), 4.0, "c, d, e and w");

    let cfg = ModelConfig::resolve("gpt2-tiny").unwrap();
    let m = build(&cfg, &BuildOptions::new(rows, seq, DType::F32)).unwrap();
    let (loss, logits) = (m.loss, m.logits);
    let inputs: Vec<_> = m.inputs.iter().map(|i| (i.name, i.tensor)).collect();
    let graph = m.builder.finish();
    let params = tessera_runtime::init::init_parameters(&graph, 5).unwrap();
    let mut exec = Executor::new(
        Program::lower_graph(graph, vec![loss, logits], &[]),
        CpuBackend::new(0),
        None,
    );
    for (t, v) in params {
        exec.bind(t, v).unwrap();
    }
    for (name, t) in inputs {
        let v = match name {
            "num_targets" => {
                candle_core::Tensor::new(batch.num_targets().unwrap(), &candle_core::Device::Cpu)
                    .unwrap()
            }
            _ => batch.get(name).unwrap().clone(),
        };
        exec.bind(t, v).unwrap();
    }
    exec.run().unwrap();
    let got = to_f64_vec(exec.get(loss).unwrap()).unwrap()[0];
    let z = to_f64_vec(exec.get(logits).unwrap()).unwrap();
    let vocab = 256;
    let (mut sum, mut n) = (0.0, 0);
    for (pos, &label) in labels.iter().enumerate() {
        if label < 0 {
            continue;
        }
        let row = &z[pos * vocab..(pos + 1) * vocab];
        let max = row.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        let lse = max + row.iter().map(|v| (v - max).exp()).sum::<f64>().ln();
        sum += lse - row[label as usize];
        n += 1;
    }
    let want = sum / n as f64;
    assert_eq!(n, 4);
    assert!((got - want).abs() <= 1e-5 * want, "model {got} vs by hand {want}");
    // Counting every position instead would give another number: the mask matters.
    let all: f64 = (0..rows * seq)
        .map(|pos| {
            let row = &z[pos * vocab..(pos + 1) * vocab];
            let max = row.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            max + row.iter().map(|v| (v - max).exp()).sum::<f64>().ln() - row[0]
        })
        .sum::<f64>()
        / (rows * seq) as f64;
    assert!((all - want).abs() > 1e-3);
}

#[test]
fn image_csv_parses_normalises_and_splits() {
    // Five 1×1×2 images (two pixels, then the class); values up to 4 scale to [-1, 1].
    let text = "0,4,0\n2,2,1\n\n4,0,2\n1,3,1\n3,1,0\n";
    let set = ImageSet::parse_csv(text, [1, 1, 2], 0.2, "<test>").unwrap();
    assert_eq!(set.train_labels, [0, 1, 2, 1]);
    assert_eq!(set.val_labels, [0], "the last ⌈20%⌉ is held out");
    assert_eq!(set.train, [-1.0, 1.0, 0.0, 0.0, 1.0, -1.0, -0.5, 0.5]);
    assert_eq!(set.val, [0.5, -0.5]);
    assert_eq!(set.num_classes, 3);
    assert!(set.validate(3).is_ok());
    let err = set.validate(2).unwrap_err().to_string();
    assert!(err.contains("num_labels ≥ 3"), "{err}");

    let b = set.train_batch(1, 7, 5).unwrap();
    assert_eq!(b.get("pixel_values").unwrap().dims(), &[5, 1, 1, 2]);
    assert_eq!(b.get("labels").unwrap().dims(), &[5]);
    // Keyed by (seed, step, row): the same batch on every call.
    assert_eq!(b.labels().unwrap(), set.train_batch(1, 7, 5).unwrap().labels().unwrap());
    assert!(set.val_batches(2, 9).unwrap_err().to_string().contains("fewer than one batch"));

    for (bad, want) in [
        ("1,2\n", "line 1: 2 values, but a 1×1×2 image needs 2 pixels and a label (3 values)"),
        ("1,x,0\n1,1,0\n", "line 1: pixel `x` is not a number"),
        ("1,1,-1\n1,1,0\n", "line 1: label `-1` is not a class id"),
        ("1,1,0\n", "has 1 images"),
    ] {
        let err = ImageSet::parse_csv(bad, [1, 1, 2], 0.2, "<test>").unwrap_err().to_string();
        assert!(err.contains(want), "{bad:?}: {err}");
    }
}

#[test]
fn top1_counts_the_argmax_of_each_counted_row() {
    let logits = candle_core::Tensor::new(
        &[[0.1f32, 0.9, 0.0], [2.0, 1.0, 0.5], [0.0, 0.0, 3.0], [1.0, 5.0, 0.0]],
        &candle_core::Device::Cpu,
    )
    .unwrap();
    // Rows 0 and 2 right, row 1 wrong, row 3 ignored.
    assert_eq!(top1_hits(&logits, &[1, 2, 2, -100]).unwrap(), (2, 3));
    assert!(top1_hits(&logits, &[1, 2]).is_err());
}
