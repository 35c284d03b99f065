//! Tests of the config-string grammar: parsing, the canonical form, validation and the
//! flags it maps to.

use super::grammar::GRAMMAR;
use crate::config::layout::ScheduleKind;
use crate::config::{CpComm, LossMode, MlpMode, ParallelConfig, Pins};
use tessera_ir::CkptMode;

fn cfg(dp: usize, tp: usize, zero: u8, micro_batches: usize, sp: bool) -> ParallelConfig {
    ParallelConfig::new(dp, tp).with_zero(zero).with_micro_batches(micro_batches).with_sp(sp)
}

fn err(s: &str) -> String {
    ParallelConfig::parse(s).expect_err(s).to_string()
}

#[test]
fn parses_tokens_in_any_order_and_case() {
    let cases = [
        ("dp2 tp4 zero1 mb2 sp", cfg(2, 4, 1, 2, true)),
        ("SP+TP4+dp2", cfg(2, 4, 0, 1, true)),
        ("zero2", cfg(1, 1, 2, 1, false)),
        ("dp8", cfg(8, 1, 0, 1, false)),
        ("  tp2 +  dp4  ", cfg(4, 2, 0, 1, false)),
        ("dp1 tp1 zero0 mb1", ParallelConfig::default()),
        ("dp4 zero3", cfg(4, 1, 3, 1, false)),
        ("zero1", cfg(1, 1, 1, 1, false)),
    ];
    for (s, want) in cases {
        assert_eq!(ParallelConfig::parse(s).unwrap(), want, "{s}");
        assert_eq!(s.parse::<ParallelConfig>().unwrap(), want, "{s}");
    }
}

#[test]
fn canonical_form_and_round_trip() {
    assert_eq!(cfg(2, 4, 1, 4, true).canonical(), "dp2 tp4 sp zero1 mb4");
    assert_eq!(cfg(8, 1, 0, 1, false).canonical(), "dp8 tp1");
    assert_eq!(cfg(1, 1, 2, 1, false).to_string(), "dp1 tp1 zero2");
    for s in [
        "dp2 tp4 zero1 mb2 sp",
        "zero2",
        "dp8",
        "mb8+tp2+sp",
        "dp16 tp8 zero3",
        "pp4 mb8 sched=interleaved:2 ckpt=selective",
    ] {
        let c = ParallelConfig::parse(s).unwrap();
        let canon = c.canonical();
        let back = ParallelConfig::parse(&canon).unwrap();
        assert_eq!(back, c, "{s}");
        assert_eq!(back.canonical(), canon, "{s}");
    }
}

#[test]
fn devices_is_dp_times_tp() {
    let c = ParallelConfig::parse("dp2 tp4").unwrap();
    assert_eq!(c.devices(), 8);
    assert!(c.check_devices(8).is_ok());
    let e = c.check_devices(16).unwrap_err().to_string();
    assert!(e.contains("8 devices") && e.contains("16"), "{e}");
}

fn pipe(dp: usize, tp: usize, pp: usize, schedule: Option<ScheduleKind>) -> ParallelConfig {
    ParallelConfig::new(dp, tp).with_pp(pp).with_schedule(schedule)
}

#[test]
fn pipeline_tokens_parse_and_round_trip() {
    let cases = [
        ("pp4", pipe(1, 1, 4, None), "dp1 tp1 pp4"),
        ("tp2+pp4", pipe(1, 2, 4, None), "dp1 tp2 pp4"),
        ("dp2 tp2 pp4 zero1", pipe(2, 2, 4, None).with_zero(1), "dp2 tp2 pp4 zero1"),
        (
            "pp2 sched=interleaved:2",
            pipe(1, 1, 2, Some(ScheduleKind::Interleaved { v: 2 })),
            "dp1 tp1 pp2 sched=interleaved:2",
        ),
        ("pp2 sched=zb-h1", pipe(1, 1, 2, Some(ScheduleKind::ZbH1)), "dp1 tp1 pp2 sched=zb-h1"),
        ("pp2 sched=gpipe", pipe(1, 1, 2, Some(ScheduleKind::Gpipe)), "dp1 tp1 pp2 sched=gpipe"),
        ("PP2 SCHED=1F1B", pipe(1, 1, 2, Some(ScheduleKind::OneFOneB)), "dp1 tp1 pp2 sched=1f1b"),
        ("sched=1f1b pp2", pipe(1, 1, 2, Some(ScheduleKind::OneFOneB)), "dp1 tp1 pp2 sched=1f1b"),
        ("pp1 dp4", pipe(4, 1, 1, None), "dp4 tp1"),
        (
            "ckpt=full sched=Interleaved:4 mb8 sp tp2 pp3 zero1 dp2",
            pipe(2, 2, 3, Some(ScheduleKind::Interleaved { v: 4 }))
                .with_zero(1)
                .with_micro_batches(8)
                .with_sp(true)
                .with_ckpt(Some(CkptMode::Full)),
            "dp2 tp2 pp3 sp zero1 mb8 sched=interleaved:4 ckpt=full",
        ),
    ];
    for (s, want, canon) in cases {
        let c = ParallelConfig::parse(s).unwrap();
        assert_eq!(c, want, "{s}");
        assert_eq!(c.canonical(), canon, "{s}");
        assert_eq!(c.to_string(), canon, "{s}");
        assert_eq!(canon.parse::<ParallelConfig>().unwrap(), c, "{s}");
        assert!(c.validate().is_ok(), "{s}");
        let json = serde_json::to_string(&c).unwrap();
        assert_eq!(serde_json::from_str::<ParallelConfig>(&json).unwrap(), c, "{json}");
    }
    // pp1 and no schedule stay out of plan files written before pipelines.
    let json = serde_json::to_value(ParallelConfig::parse("dp2").unwrap()).unwrap();
    assert!(json.get("pp").is_none() && json.get("schedule").is_none(), "{json}");
}

#[test]
fn malformed_pipeline_tokens_name_the_problem() {
    let e = err("pp0");
    assert!(e.contains("`pp0`: pp must be at least 1"), "{e}");
    let e = err("ppx");
    assert!(e.contains("expected a number after `pp`") && e.contains("pp4"), "{e}");
    let e = err("pp2 sched=foo");
    assert!(e.contains("`sched=foo`: schedules are gpipe, 1f1b, interleaved:V"), "{e}");
    assert!(e.contains("zb-h1"), "{e}");
    let e = err("pp2 sched=");
    assert!(e.contains("schedules are"), "{e}");
    let e = err("pp2 sched");
    assert!(e.contains("write sched=gpipe"), "{e}");
    let e = err("pp2 sched=interleaved");
    assert!(e.contains("`sched=interleaved`") && e.contains("interleaved:2"), "{e}");
    let e = err("pp2 sched=interleaved:1");
    assert!(e.contains("at least 2 chunks") && e.contains("sched=1f1b"), "{e}");
    let e = err("pp2 sched=interleaved:0");
    assert!(e.contains("at least 2 chunks"), "{e}");
    let e = err("pp2 sched=interleaved:x");
    assert!(e.contains("expected a number after `interleaved:`"), "{e}");
    let e = err("pp2 sched=interleaved:99999999999999999999999");
    assert!(e.contains("too large"), "{e}");
    let e = err("sched=1f1b");
    assert!(e.contains("a schedule needs pp >= 2; add ppN"), "{e}");
    let e = err("dp2 pp1 sched=zb-h1");
    assert!(e.contains("a schedule needs pp >= 2") && e.contains("pp2 sched=zb-h1"), "{e}");
    let e = err("pp2 pp4");
    assert!(e.contains("`pp` is given twice"), "{e}");
    let e = err("pp2 sched=1f1b sched=gpipe");
    assert!(e.contains("`sched` is given twice"), "{e}");
    let e = err("dp4294967296 pp4294967296");
    assert!(e.contains("overflows") && e.contains("pp4294967296"), "{e}");
}

#[test]
fn devices_count_the_pipeline() {
    let c = ParallelConfig::parse("dp2 tp2 pp4 zero1").unwrap();
    assert_eq!(c.devices(), 16);
    assert!(c.check_devices(16).is_ok());
    let e = ParallelConfig::parse("dp2 pp4").unwrap().check_devices(4).unwrap_err();
    let e = e.to_string();
    assert!(e.contains("dp×tp×pp = 2×1×4 = 8 devices"), "{e}");
    assert!(e.contains("the cluster has 4") && e.contains("multiply to 4"), "{e}");
    assert!(e.contains("e.g. `dp1 tp1 pp4`"), "{e}");
    // No data-parallel degree fits: no example.
    let e = ParallelConfig::parse("tp2 pp4").unwrap().check_devices(4).unwrap_err();
    assert!(!e.to_string().contains("e.g."), "{e}");
}

#[test]
fn check_pipeline_needs_enough_blocks() {
    let c = ParallelConfig::parse("pp8").unwrap();
    let e = c.check_pipeline(4, None).unwrap_err().to_string();
    assert!(e.contains("pp8 needs at least 8 blocks; the model has 4: use pp4 or fewer"), "{e}");
    assert!(c.check_pipeline(8, None).is_ok());
    assert!(c.check_pipeline(13, Some(3)).is_ok(), "1f1b has no micro-batch rule");
    let e = ParallelConfig::parse("pp2").unwrap().check_pipeline(1, None).unwrap_err();
    assert!(e.to_string().contains("drop ppN"), "{e}");
    // No pipeline, nothing to check.
    assert!(ParallelConfig::parse("dp4").unwrap().check_pipeline(0, Some(3)).is_ok());
    for s in ["pp4 sched=gpipe mb3", "pp4 sched=zb-h1", "pp4 sched=1f1b mb5"] {
        assert!(ParallelConfig::parse(s).unwrap().check_pipeline(6, Some(7)).is_ok(), "{s}");
    }
}

#[test]
fn check_pipeline_interleaved_rules() {
    let c = ParallelConfig::parse("pp2 sched=interleaved:3").unwrap();
    // 8 blocks: 4 per stage, which 3 chunks do not split.
    let e = c.check_pipeline(8, None).unwrap_err().to_string();
    assert!(e.contains("sched=interleaved:3 on pp2"), "{e}");
    assert!(e.contains("each stage's 4 blocks (8 blocks / pp2) do not split into 3"), "{e}");
    assert!(e.contains("interleaved:2, interleaved:4"), "{e}");
    assert!(c.check_pipeline(12, None).is_ok());
    // Uneven stages: only every virtual stage needing a block.
    assert!(c.check_pipeline(7, None).is_ok());
    let e = c.check_pipeline(5, None).unwrap_err().to_string();
    assert!(e.contains("pp × V = 2 × 3 virtual stages") && e.contains("has 5 blocks"), "{e}");
    assert!(e.contains("use sched=interleaved:2 or fewer chunks"), "{e}");
    let e = c.check_pipeline(3, None).unwrap_err().to_string();
    assert!(e.contains("use sched=1f1b"), "{e}");
    // Megatron: micro-batches a multiple of pp.
    let c = ParallelConfig::parse("pp4 mb6 sched=interleaved:2").unwrap();
    let e = c.check_pipeline(16, None).unwrap_err().to_string();
    assert!(e.contains("multiple of pp = 4") && e.contains("but it is 6"), "{e}");
    assert!(e.contains("use mb4 or mb8"), "{e}");
    assert!(c.check_pipeline(16, Some(8)).is_err(), "the config's mb wins over the hint");
    let c = ParallelConfig::parse("pp4 sched=interleaved:2").unwrap();
    assert!(c.check_pipeline(16, None).is_ok());
    assert!(c.check_pipeline(16, Some(8)).is_ok());
    let e = c.check_pipeline(16, Some(2)).unwrap_err().to_string();
    assert!(e.contains("but it is 2: use mb4"), "{e}");
    // Hand-built configs are validated first.
    let bad = pipe(1, 1, 0, None);
    assert!(bad.check_pipeline(4, None).is_err());
    let bad = pipe(1, 1, 2, Some(ScheduleKind::Interleaved { v: 1 }));
    assert!(bad.check_pipeline(4, None).unwrap_err().to_string().contains("V >= 2"));
}

#[test]
fn ckpt_modes_parse_and_round_trip() {
    for (s, mode) in [
        ("dp2 ckpt=none", CkptMode::None),
        ("dp2 tp2 ckpt=Selective", CkptMode::Selective),
        ("dp2+ckpt=full", CkptMode::Full),
    ] {
        let c = ParallelConfig::parse(s).unwrap();
        assert_eq!(c.ckpt, Some(mode), "{s}");
        assert_eq!(ParallelConfig::parse(&c.canonical()).unwrap(), c, "{s}");
    }
    assert_eq!(ParallelConfig::parse("dp2").unwrap().ckpt, None);
    let e = err("dp2 ckpt=some");
    assert!(e.contains("none, selective and full"), "{e}");
    let e = err("dp2 ckpt");
    assert!(e.contains("ckpt=full"), "{e}");
    let e = err("ckpt=full ckpt=none");
    assert!(e.contains("`ckpt` is given twice"), "{e}");
}

#[test]
fn malformed_configs_name_the_problem() {
    let e = err("dp2 foo");
    assert!(e.contains("unknown token `foo`") && e.contains("dpN"), "{e}");
    let e = err("dp2 dp4");
    assert!(e.contains("`dp` is given twice"), "{e}");
    let e = err("dp2 tp2 sp sp");
    assert!(e.contains("`sp` is given twice"), "{e}");
    let e = err("dp0");
    assert!(e.contains("at least 1"), "{e}");
    let e = err("tp0");
    assert!(e.contains("at least 1"), "{e}");
    let e = err("mb0");
    assert!(e.contains("at least 1"), "{e}");
    let e = err("zero4");
    assert!(e.contains("stages 0 to 3"), "{e}");
    let e = err("dp2 sp");
    assert!(e.contains("add tpN with N > 1"), "{e}");
    let e = err("tp1 sp");
    assert!(e.contains("add tpN with N > 1"), "{e}");
    let e = err("dpx");
    assert!(e.contains("expected a number after `dp`"), "{e}");
    let e = err("zero");
    assert!(e.contains("expected a number after `zero`"), "{e}");
    let e = err("tp-2");
    assert!(e.contains("expected a number"), "{e}");
    let e = err("dp99999999999999999999999");
    assert!(e.contains("too large"), "{e}");
    let e = err("   ");
    assert!(e.contains("empty") && e.contains("e.g."), "{e}");
    let e = err("++");
    assert!(e.contains("empty"), "{e}");
}

#[test]
fn zero_without_dp_is_kept() {
    let c = ParallelConfig::parse("tp2 zero1").unwrap();
    assert_eq!(c.zero, 1);
    assert_eq!(c.canonical(), "dp1 tp2 zero1");
}

#[test]
fn megatron_and_deepspeed_exports() {
    let c = ParallelConfig::parse("dp2 tp4 sp zero1 mb4").unwrap();
    assert_eq!(
        c.megatron_flags(),
        "--tensor-model-parallel-size 4 --sequence-parallel --use-distributed-optimizer"
    );
    assert_eq!(
        ParallelConfig::parse("dp8").unwrap().megatron_flags(),
        "--tensor-model-parallel-size 1"
    );
    let ds = ParallelConfig::parse("dp8 zero3 mb2").unwrap().deepspeed_config();
    assert_eq!(ds["zero_optimization"]["stage"], 3);
    assert_eq!(ds["gradient_accumulation_steps"], 2);
    assert!(ds.get("pipeline").is_none(), "{ds}");
    let c = ParallelConfig::parse("dp2 tp2 pp4 zero1 mb8").unwrap();
    assert_eq!(
        c.megatron_flags(),
        "--tensor-model-parallel-size 2 --pipeline-model-parallel-size 4 \
         --use-distributed-optimizer"
    );
    let ds = c.deepspeed_config();
    assert_eq!(ds["pipeline"]["stages"], 4);
    assert_eq!(ds["gradient_accumulation_steps"], 8);
    let c = ParallelConfig::parse("tp2 pp4 sp mb8 sched=interleaved:2").unwrap();
    assert_eq!(
        c.megatron_flags(),
        "--tensor-model-parallel-size 2 --pipeline-model-parallel-size 4 \
         --num-virtual-stages-per-pipeline-rank 2 --sequence-parallel"
    );
    for s in ["pp2 sched=gpipe", "pp2 sched=zb-h1", "pp2 sched=1f1b", "pp2"] {
        assert_eq!(
            ParallelConfig::parse(s).unwrap().megatron_flags(),
            "--tensor-model-parallel-size 1 --pipeline-model-parallel-size 2",
            "{s}"
        );
    }
}

#[test]
fn validate_catches_hand_built_configs() {
    assert!(cfg(0, 1, 0, 1, false).validate().is_err());
    assert!(cfg(1, 1, 4, 1, false).validate().is_err());
    assert!(cfg(2, 1, 0, 1, true).validate().is_err());
    assert!(cfg(2, 2, 0, 1, true).validate().is_ok());
    assert!(pipe(1, 1, 0, None).validate().is_err());
    assert!(pipe(1, 1, 1, Some(ScheduleKind::OneFOneB)).validate().is_err());
    assert!(pipe(1, 1, 2, Some(ScheduleKind::Interleaved { v: 1 })).validate().is_err());
    assert!(pipe(1, 1, 2, Some(ScheduleKind::Interleaved { v: 2 })).validate().is_ok());
    assert!(pipe(usize::MAX, 1, 2, None).validate().is_err());
}

#[test]
fn unequal_stages_parse_round_trip_and_are_checked() {
    let c = ParallelConfig::parse("pp4 stages=7:full,8,9,8 mb8").unwrap();
    assert_eq!(c.stages.len(), 4);
    assert_eq!(c.canonical(), "dp1 tp1 pp4 mb8 stages=7:full,8,9,8");
    assert_eq!(ParallelConfig::parse(&c.canonical()).unwrap(), c);
    assert!(c.check_pipeline(32, None).is_ok());
    let e = c.check_pipeline(30, None).unwrap_err().to_string();
    assert!(e.contains("32 blocks") && e.contains("has 30"), "{e}");
    // Megatron-core's first/last stage flags when the middle stages are equal.
    assert!(!c.megatron_flags().contains("first"), "8, 9 in the middle: no Megatron flag");
    let flags = ParallelConfig::parse("pp4 stages=7:full,9,9,7").unwrap().megatron_flags();
    assert!(flags.contains("--decoder-first-pipeline-num-layers 7"), "{flags}");
    assert!(flags.contains("--decoder-last-pipeline-num-layers 7"), "{flags}");
    // One count per virtual stage: pp · V under interleaving.
    let il = ParallelConfig::parse("pp2 sched=interleaved:2 stages=1,3,3,1").unwrap();
    assert!(il.check_pipeline(8, Some(4)).is_ok());
    for (s, want) in [
        ("stages=4,4", "need a pipeline"),
        ("pp2 stages=4,4,4", "lists 3 stages but pp2 makes 2"),
        ("pp2 sched=interleaved:2 stages=4,4", "makes 4 virtual"),
        ("pp2 stages=4,0", "not a stage"),
        ("pp2 stages=4:fast,4", "checkpoint modes"),
        ("pp2 stages", "stages=7:full"),
        ("pp2 stages=4,4 stages=4,4", "given twice"),
    ] {
        let e = err(s);
        assert!(e.contains(want), "{s}: {e}");
    }
}

#[test]
fn offload_parses_round_trips_and_is_checked() {
    use crate::offload::{Offload, OffloadKind, CHUNKS};
    let c = ParallelConfig::parse("dp2 zero3 offload=grads+opt:8/16 nvme:2").unwrap();
    assert_eq!(
        c.offload,
        Some(Offload { kind: OffloadKind::GradsOpt, chunks: 8, nvme: 2, act: false })
    );
    assert_eq!(c.canonical(), "dp2 tp1 zero3 offload=grads+opt:8/16 nvme:2");
    assert_eq!(ParallelConfig::parse(&c.canonical()).unwrap(), c);
    // `+` joins tokens, but not inside `grads+opt`; `nvme` alone takes every offloaded chunk.
    let c = ParallelConfig::parse("tp2+OFFLOAD=GRADS+OPT+nvme").unwrap();
    assert_eq!(
        c.offload,
        Some(Offload { kind: OffloadKind::GradsOpt, chunks: CHUNKS, nvme: 16, act: false })
    );
    assert_eq!(c.canonical(), "dp1 tp2 offload=grads+opt nvme");
    assert_eq!(ParallelConfig::parse("offload=opt").unwrap().canonical(), "dp1 tp1 offload=opt");
    for (s, want) in [
        ("offload=cpu", "offload is opt, grads+opt or all"),
        ("offload=opt:8/12", "K/16"),
        ("offload=opt:0/16", "K/16"),
        ("offload", "offload=opt"),
        ("nvme", "add offload=opt"),
        ("offload=opt:4/16 nvme:5", "more chunks than the 4 offloaded"),
        ("pp2 offload=opt", "offload with a pipeline"),
        ("offload=opt offload=all", "given twice"),
    ] {
        let e = err(s);
        assert!(e.contains(want), "{s}: {e}");
    }
}

#[test]
fn activation_offload_parses_round_trips_and_is_checked() {
    use crate::offload::{Offload, OffloadKind};
    let c = ParallelConfig::parse("dp1 ckpt=full offload=act").unwrap();
    assert_eq!(c.offload, Some(Offload::activations()));
    assert_eq!(c.canonical(), "dp1 tp1 ckpt=full offload=act");
    // Composed with model state (written after `act+`), `+` inside the value included.
    for (s, canonical, kind, chunks, nvme) in [
        ("offload=act+opt", "dp1 tp1 offload=act+opt", OffloadKind::Opt, 16, 0),
        (
            "dp2+zero1+OFFLOAD=ACT+GRADS+OPT:8/16+nvme:2",
            "dp2 tp1 zero1 offload=act+grads+opt:8/16 nvme:2",
            OffloadKind::GradsOpt,
            8,
            2,
        ),
        ("offload=act+all nvme", "dp1 tp1 offload=act+all nvme", OffloadKind::All, 16, 16),
    ] {
        let c = ParallelConfig::parse(s).unwrap();
        assert_eq!(c.offload, Some(Offload { kind, chunks, nvme, act: true }), "{s}");
        assert_eq!(c.canonical(), canonical, "{s}");
        assert_eq!(ParallelConfig::parse(&c.canonical()).unwrap(), c, "{s}");
    }
    // Plan files: a config without it serialises as before (no `act` key) and reads back.
    let plain = ParallelConfig::parse("offload=opt").unwrap();
    let json = serde_json::to_string(&plain).unwrap();
    assert!(!json.contains("act"), "{json}");
    assert_eq!(serde_json::from_str::<ParallelConfig>(&json).unwrap(), plain);
    let act = ParallelConfig::parse("offload=act+opt").unwrap();
    let json = serde_json::to_string(&act).unwrap();
    assert_eq!(serde_json::from_str::<ParallelConfig>(&json).unwrap(), act);
    for (s, want) in [
        ("offload=act nvme", "add offload=opt"),
        ("offload=opt+act", "offload=act+opt"),
        ("offload=act+act", "write act once"),
        ("offload=act+cpu", "offload is opt, grads+opt or all"),
        ("pp2 offload=act", "offload with a pipeline"),
    ] {
        let e = err(s);
        assert!(e.contains(want), "{s}: {e}");
    }
}

#[test]
fn hybrid_sharding_parses_round_trips_and_is_checked() {
    let c = ParallelConfig::parse("dp16 zero3 shard=8 mb2").unwrap();
    assert_eq!((c.shard, c.replicas()), (Some(8), 2));
    assert_eq!(c.canonical(), "dp16 tp1 zero3 shard=8 mb2");
    assert_eq!(ParallelConfig::parse(&c.canonical()).unwrap(), c);
    // Megatron-LM: the distributed optimizer's instances, one per replica group.
    let c = ParallelConfig::parse("dp8 tp2 zero1 shard=4").unwrap();
    assert!(c.megatron_flags().ends_with("--num-distributed-optimizer-instances 2"));
    assert_eq!(ParallelConfig::parse("dp8 zero1").unwrap().replicas(), 1);
    for (s, want) in [
        ("dp8 shard=4", "add zero1, zero2 or zero3"),
        ("dp8 zero3 shard=8", "shard=dp is plain ZeRO"),
        ("dp8 zero3 shard=3", "N dividing dp8"),
        ("dp8 zero3 shard=1", "1 < N < dp"),
        ("dp8 zero3 shard=0", "at least 1"),
        ("dp8 pp2 zero1 shard=4", "with a pipeline"),
        ("dp8 zero3 shard=4 offload=all", "with offload="),
        ("dp8 zero3 shard=4 shard=2", "given twice"),
        ("dp8 zero3 shard", "unknown token"),
    ] {
        let e = err(s);
        assert!(e.contains(want), "{s}: {e}");
    }
}

/// Context parallelism (`cpN`, all-to-all): its tokens, canonical form (the variant written
/// after tp), device count and flags.
#[test]
fn context_parallel_tokens_parse_and_print_canonically() {
    let c = ParallelConfig::parse("cp2").unwrap();
    assert_eq!((c.cp, c.cp_comm), (2, None));
    assert_eq!(c.canonical(), "dp1 tp1 cp2 cp=a2a");
    let c = ParallelConfig::parse("zero3 CP4 cp=A2A dp2 tp2 sp pp2 mb4").unwrap();
    assert_eq!((c.cp, c.cp_comm), (4, Some(CpComm::A2a)));
    assert_eq!(c.canonical(), "dp2 tp2 cp4 cp=a2a pp2 sp zero3 mb4");
    assert_eq!(c.devices(), 2 * 4 * 2 * 2);
    for s in ["cp2", "dp2 cp2 zero1", "tp2 cp2 sp ckpt=full", "cp4 pp2 mb2", "cp1 dp2"] {
        let c = ParallelConfig::parse(s).unwrap();
        let back = ParallelConfig::parse(&c.canonical()).unwrap();
        // `cp=a2a` is the default: written or not, the same layout.
        assert_eq!((back.cp, back.canonical()), (c.cp, c.canonical()), "{s}");
    }
    // cp1 is no context parallelism: nothing written.
    assert_eq!(ParallelConfig::parse("cp1 dp2").unwrap().canonical(), "dp2 tp1");
    assert!(ParallelConfig::parse("dp2 cp2").unwrap().check_devices(4).is_ok());
    let e = ParallelConfig::parse("dp2 cp2").unwrap().check_devices(8).unwrap_err().to_string();
    assert!(e.contains("dp×cp×tp×pp = 2×2×1×1 = 4") && e.contains("`dp4 tp1 cp2 cp=a2a`"), "{e}");
    let flags = ParallelConfig::parse("dp2 tp2 cp2 zero1").unwrap().megatron_flags();
    assert_eq!(
        flags,
        "--tensor-model-parallel-size 2 --context-parallel-size 2 --cp-comm-type a2a \
         --use-distributed-optimizer"
    );
}

#[test]
fn context_parallel_refusals_name_the_fix() {
    let e = err("cp2 pp2 cp=ring");
    assert!(e.contains("ring attention") && e.contains("use cp=a2a"), "{e}");
    let e = err("dp2 cp=a2a");
    assert!(e.contains("add cpN with N > 1"), "{e}");
    let e = err("cp1 cp=a2a");
    assert!(e.contains("add cpN with N > 1"), "{e}");
    assert!(err("cp0").contains("at least 1"));
    assert!(err("cp").contains("e.g. cp2"));
    assert!(err("cp=rings").contains("a2a"));
    assert!(err("cp2 cp4").contains("given twice"));
    assert!(err("cp2 cp=a2a cp=a2a").contains("given twice"));
    let e = err("dp4 cp2 zero1 shard=2");
    assert!(e.contains("shard=") && e.contains("not supported yet"), "{e}");
    let e = err("cp2 offload=opt");
    assert!(e.contains("offload=act") && e.contains("not supported yet"), "{e}");
    // Activation offload alone composes with cp.
    let c = ParallelConfig::parse("cp2 offload=act").unwrap();
    assert!(c.offload.is_some_and(|o| o.act && !o.moves_state()));
}

#[test]
fn loss_chunking_parses_round_trips_and_is_checked() {
    let c = ParallelConfig::parse("dp2 loss=chunk64").unwrap();
    assert_eq!(c.loss, Some(LossMode::Chunk(64)));
    assert_eq!(c.loss.and_then(LossMode::chunk_rows), Some(64));
    assert_eq!(c.canonical(), "dp2 tp1 loss=chunk64");
    let w = ParallelConfig::parse("LOSS=WHOLE+dp2").unwrap();
    assert_eq!(w.loss, Some(LossMode::Whole));
    assert_eq!(w.loss.and_then(LossMode::chunk_rows), None);
    assert_eq!(w.canonical(), "dp2 tp1 loss=whole");
    // Unwritten: the planner's choice, and no token in the canonical form.
    assert_eq!(ParallelConfig::parse("dp2").unwrap().loss, None);
    for s in [
        "dp2 tp2 sp zero1 mb2 ckpt=full loss=chunk4096",
        "tp2 sp loss=whole",
        "dp2 zero1 offload=opt loss=chunk8",
    ] {
        let c = ParallelConfig::parse(s).unwrap();
        let back = ParallelConfig::parse(&c.canonical()).unwrap();
        assert_eq!(back, c, "{s}");
        assert!(c.canonical().ends_with(&format!("loss={}", c.loss.unwrap())), "{s}");
    }
    assert!(err("loss=chunk0").contains("at least 1"), "{}", err("loss=chunk0"));
    assert!(err("loss=half").contains("loss=whole or loss=chunkN"), "{}", err("loss=half"));
    assert!(err("loss=chunk").contains("loss=chunk"), "{}", err("loss=chunk"));
    assert!(err("loss").contains("write loss=whole or loss=chunkN"), "{}", err("loss"));
    assert!(err("loss=whole loss=chunk2").contains("given twice"));
    assert!(GRAMMAR.contains("loss=whole|chunkN"));
}

#[test]
fn mlp_tiling_parses_round_trips_and_is_checked() {
    let c = ParallelConfig::parse("dp2 mlp=tile64 loss=chunk8").unwrap();
    assert_eq!(c.mlp, Some(MlpMode::Tile(64)));
    assert_eq!(c.mlp.and_then(MlpMode::tile_rows), Some(64));
    assert_eq!(c.canonical(), "dp2 tp1 loss=chunk8 mlp=tile64");
    assert_eq!(ParallelConfig::parse(&c.canonical()).unwrap(), c);
    let w = ParallelConfig::parse("MLP=WHOLE tp2").unwrap();
    assert_eq!((w.mlp, w.canonical().as_str()), (Some(MlpMode::Whole), "dp1 tp2 mlp=whole"));
    assert_eq!(ParallelConfig::parse("dp2").unwrap().mlp, None);
    assert!(err("mlp=tile0").contains("at least 1"), "{}", err("mlp=tile0"));
    assert!(err("mlp=chunk4").contains("mlp=whole or mlp=tileN"), "{}", err("mlp=chunk4"));
    assert!(err("mlp").contains("write mlp=whole or mlp=tileN"), "{}", err("mlp"));
    assert!(err("mlp=whole mlp=tile2").contains("given twice"));
    assert!(GRAMMAR.contains("mlp=whole|tileN"));
}

#[test]
fn written_knobs_are_pinned_and_the_rest_left_to_the_search() {
    let pins = |s: &str| ParallelConfig::parse_pinned(s).unwrap();
    // Nothing but degrees: every knob free, the config holding the defaults.
    let (c, p) = pins("dp2 tp2 pp4 zero1");
    assert_eq!(p, Pins::default());
    assert_eq!(
        (c.micro_batches, c.sp, c.schedule, c.ckpt, c.offload),
        (1, false, None, None, None)
    );
    assert!(!p.complete_for(&c));
    // Each knob, written at its default value, is pinned there.
    let (c, p) = pins("dp2 tp2 pp4 zero1 mb1 sp=off sched=1f1b ckpt=none offload=none");
    assert_eq!(p, Pins::ALL);
    assert!(p.complete_for(&c));
    assert_eq!(c, ParallelConfig::parse("dp2 tp2 pp4 zero1 sched=1f1b ckpt=none").unwrap());
    // `sp=off` and `sp` pin the same knob; the canonical form omits off, as before.
    let (c, p) = pins("dp2 tp4 sp=off");
    assert!(p.sp && !c.sp && c.canonical() == "dp2 tp4");
    assert!(err("dp2 tp4 sp sp=off").contains("`sp` is given twice"));
    assert!(pins("dp2 tp4 SP=OFF").1.sp);
    // `offload=none` pins offload off (and `nvme` needs an offload).
    let (c, p) = pins("dp8 zero3 offload=none");
    assert!(p.offload && c.offload.is_none());
    assert!(err("dp8 zero3 offload=none nvme").contains("add offload=opt"));
    // `stages=` fixes the stages' checkpointing.
    assert!(pins("pp2 stages=3,5").1.ckpt);
    // What completeness asks for: sp only with tp, a schedule and checkpointing only with pp.
    let (c, p) = pins("dp8 mb2");
    assert!(p.complete_for(&c));
    let (c, p) = pins("dp2 tp4 mb2");
    assert!(!p.complete_for(&c));
    let (c, p) = pins("dp2 pp2 mb4 sched=zb-h1");
    assert!(!p.complete_for(&c), "checkpointing is searched with a pipeline: {c}");
}

#[test]
fn the_builder_makes_what_the_grammar_parses_and_serde_reads_it_back() {
    let built = ParallelConfig::new(2, 4)
        .with_zero(1)
        .with_micro_batches(8)
        .with_sp(true)
        .with_cp(2)
        .with_ckpt(Some(CkptMode::Full));
    assert_eq!(built, ParallelConfig::parse("dp2 tp4 cp2 zero1 mb8 sp ckpt=full").unwrap());
    built.validate().unwrap();
    // The seal is not part of the plan file: the JSON names the knobs only.
    let json = serde_json::to_value(&built).unwrap();
    assert!(json.get("built").is_none(), "{json}");
    let back: ParallelConfig = serde_json::from_value(json).unwrap();
    assert_eq!(back, built);
    // The setters do not check; validate does.
    let bad = ParallelConfig::new(2, 4).with_micro_batches(0);
    assert!(bad.validate().unwrap_err().to_string().contains("at least 1"));
}

#[test]
fn validation_errors_are_typed_by_kind_with_the_messages_users_read() {
    use crate::{ConfigError, PlanError};
    let sp = ParallelConfig::new(2, 1).with_sp(true).validate();
    assert!(matches!(sp, Err(ConfigError::Requires { knob: "sp", needs: "tp", .. })), "{sp:?}");
    let zero = ParallelConfig::new(0, 1).validate();
    assert!(matches!(zero, Err(ConfigError::Zero { knob: "dp", .. })), "{zero:?}");
    let stage = ParallelConfig::new(2, 1).with_zero(4).validate();
    assert!(matches!(stage, Err(ConfigError::OutOfRange { knob: "zero", .. })), "{stage:?}");
    let cp_shard = ParallelConfig::new(4, 1).with_cp(2).with_zero(1).with_shard(Some(2));
    let e = cp_shard.validate().expect_err("cp with shard= is refused");
    assert_eq!(e.knob(), "cp");
    assert!(matches!(e, ConfigError::Unsupported { with: "shard", .. }), "{e:?}");
    // A parsed string's error carries the string and reads as before.
    match ParallelConfig::parse("dp2 sp") {
        Err(PlanError::Config { config: Some(c), error }) => {
            assert_eq!(c, "dp2 sp");
            assert_eq!(error.knob(), "sp");
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(
        err("dp2 sp"),
        "config `dp2 sp`: sp shards the sequence over the tensor-parallel axis: add tpN with \
         N > 1"
    );
}
