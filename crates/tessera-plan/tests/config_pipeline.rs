//! Pipeline tokens in config strings (`ppN`, `sched=...`): any mix of them with the other
//! tokens parses to a valid config or a clear error, never a panic; what parses round-trips
//! through its canonical form, spans dp × tp × pp devices, and is checked against a model's
//! block count without a panic.

use proptest::prelude::*;
use tessera_plan::config::ParallelConfig;
use tessera_plan::pipeline::ScheduleKind;

/// Config strings built from each kind at most once, pipeline kinds included, with valid and
/// invalid values, in any order and case.
fn pipeline_config() -> impl Strategy<Value = String> {
    let kinds = vec!["dp", "tp", "pp", "mb", "zero", "sp", "sched=", "ckpt="];
    let number = prop_oneof![
        8 => (0u64..9).prop_map(|n| n.to_string()),
        1 => prop::sample::select(vec!["", "x", "01", "18446744073709551616", "4294967296"])
            .prop_map(String::from),
    ];
    let sched = prop::sample::select(vec![
        "gpipe",
        "1f1b",
        "1F1B",
        "zb-h1",
        "ZB-H1",
        "interleaved",
        "interleaved:",
        "interleaved:0",
        "interleaved:1",
        "interleaved:2",
        "Interleaved:3",
        "interleaved:4",
        "interleaved:99999999999999999999",
        "zbh1",
        "",
    ]);
    let separator = prop::sample::select(vec![" ", "+", " + ", "\t"]);
    (prop::sample::subsequence(kinds, 1..=8), prop::collection::vec((number, sched, separator), 8))
        .prop_map(|(kinds, args)| {
            kinds
                .into_iter()
                .zip(args)
                .map(|(k, (n, sched, sep))| match k {
                    "sp" => format!("sp{sep}"),
                    "sched=" => format!("sched={sched}{sep}"),
                    "ckpt=" => format!("ckpt=full{sep}"),
                    _ => format!("{k}{n}{sep}"),
                })
                .collect::<Vec<_>>()
        })
        .prop_shuffle()
        .prop_map(|ts| ts.concat())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

    #[test]
    fn pipeline_configs_parse_round_trip_or_refuse(
        s in pipeline_config(),
        blocks in 0usize..40,
        hint in prop::option::of(0usize..20),
    ) {
        let c = match ParallelConfig::parse(&s) {
            Ok(c) => c,
            Err(e) => {
                prop_assert!(e.to_string().starts_with("config"), "{s:?}: {e}");
                return Ok(());
            }
        };
        prop_assert!(c.validate().is_ok(), "{s:?} parsed to an invalid {c:?}");
        prop_assert!(c.schedule.is_none() || c.pp >= 2, "{s:?}: a schedule without a pipeline");
        let canon = c.canonical();
        prop_assert_eq!(ParallelConfig::parse(&canon).ok(), Some(c.clone()), "{:?}", s);
        prop_assert_eq!(c.to_string(), canon.clone());
        prop_assert_eq!(c.devices(), c.dp * c.tp * c.pp);
        prop_assert_eq!(c.check_devices(c.devices()).is_ok(), true);
        let e = c.check_devices(c.devices() + 1).unwrap_err().to_string();
        prop_assert!(e.contains("dp×tp×pp"), "{e}");
        if c.pp > 1 {
            let flag = format!("--pipeline-model-parallel-size {}", c.pp);
            prop_assert!(c.megatron_flags().contains(&flag), "{}", c.megatron_flags());
            prop_assert_eq!(&c.deepspeed_config()["pipeline"]["stages"], c.pp);
        }
        // Model checks: an error names the numbers, success means the rules hold.
        match c.check_pipeline(blocks, hint) {
            Err(e) => prop_assert!(e.to_string().contains(&format!("pp{}", c.pp)), "{e}"),
            Ok(()) => {
                prop_assert!(c.pp <= blocks || c.pp == 1);
                if let Some(ScheduleKind::Interleaved { v }) = c.schedule {
                    prop_assert!(c.pp * v <= blocks);
                    if blocks % c.pp == 0 {
                        prop_assert_eq!((blocks / c.pp) % v, 0);
                    }
                    let mb = if c.micro_batches > 1 { Some(c.micro_batches) } else { hint };
                    prop_assert!(mb.is_none_or(|m| m % c.pp == 0));
                }
            }
        }
    }
}

#[test]
fn seeds_shorthands_parse() {
    for (s, canon, devices) in [
        ("tp2+pp4", "dp1 tp2 pp4", 8),
        ("dp2 tp2 pp4 zero1", "dp2 tp2 pp4 zero1", 16),
        ("DP2+TP2+PP4+ZERO1+MB8+SCHED=ZB-H1", "dp2 tp2 pp4 zero1 mb8 sched=zb-h1", 16),
    ] {
        let c = ParallelConfig::parse(s).unwrap();
        assert_eq!(c.canonical(), canon, "{s}");
        assert_eq!(c.devices(), devices, "{s}");
    }
}
