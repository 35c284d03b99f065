"""Loads Tessera's golden export files with the engines' own configuration code.

usage: python check_exports.py GOLDEN_DIR DEEPSPEED_SRC TORCHTITAN_SRC

- DeepSpeed (its source tree): `deepspeed.runtime.config.DeepSpeedConfig` parses each JSON file,
  runs its batch-size arithmetic (train_batch_size = micro x accumulation x data-parallel size,
  with the data-parallel size from a model-parallel unit the size the file's comment names)
  and its pydantic checks of the ZeRO, precision and checkpointing sections.
- torchtitan (0.2.x, the release that reads job TOML files): `ConfigManager.parse_args`
  loads each TOML through tyro into its `JobConfig`, and `ParallelDims` validates the degrees
  against the world size.

Neither touches a tensor. Without PyTorch installed (its Linux wheel is a ~5 GB CUDA build), a
stub module stands in for `torch` so the configuration code imports; with PyTorch present, the
real one is used.
"""

import abc
import importlib.abc
import importlib.machinery
import importlib.util
import json
import re
import sys
import tomllib
import types
from pathlib import Path
from unittest import mock


class _StubMeta(abc.ABCMeta):
    """Stub classes: attributes of a class are stub classes too (`ReduceOp.SUM`)."""

    def __getattr__(cls, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _stub_class(f"{cls.__name__}.{name}")


class _StubObject:
    """What calling a stub returns: falsy, empty, zero, and stubs all the way down."""

    def __init__(self, *args, **kwargs):
        pass

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _stub_class(name)()

    def __call__(self, *args, **kwargs):
        return _StubObject()

    def __bool__(self):
        return False

    def __iter__(self):
        return iter(())

    def __len__(self):
        return 0

    def __int__(self):
        return 0

    __index__ = __int__


def _stub_class(name):
    """A class that can be subclassed, isinstance-checked, called and read from."""
    return _StubMeta(name.rsplit(".", 1)[-1], (_StubObject,), {})


_DTYPES = {
    "float16", "half", "bfloat16", "float32", "float", "float64", "double", "int8", "uint8",
    "int16", "int32", "int64", "long", "bool", "float8_e4m3fn", "float8_e5m2",
}


class _StubModule(types.ModuleType):
    """A `torch` module whose every attribute is a stub class (every submodule a stub)."""

    def __getattr__(self, name):
        if name.startswith("__") and name != "__version__":
            raise AttributeError(name)
        if name == "__version__":
            value = "2.7.0"
        elif self.__name__ == "torch" and name in _DTYPES:
            value = self.dtype()  # `torch.float16` is an instance of `torch.dtype`
        else:
            value = _stub_class(f"{self.__name__}.{name}")
        setattr(self, name, value)
        return value


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self, roots):
        self.roots = roots

    def find_spec(self, fullname, path, target=None):
        if fullname.split(".")[0] in self.roots:
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        m = _StubModule(spec.name)
        m.__path__ = []
        return m

    def exec_module(self, module):
        if module.__name__ == "torch.version":
            module.cuda = module.hip = None
            module.__version__ = "2.7.0"


def stub_torch():
    """Stubs PyTorch and its GPU-side companions where they are not installed."""
    missing = {r for r in _STUBBED if importlib.util.find_spec(r) is None}
    if missing:
        sys.meta_path.insert(0, _StubFinder(missing))
    return "real torch" if "torch" not in missing else "a stub " + ", ".join(sorted(missing))


# Packages the configuration code imports but never calls while parsing a config.
_STUBBED = ["torch", "triton", "torchao", "torchdata", "torchft"]


def check_deepspeed(golden: Path, src: Path) -> int:
    sys.path.insert(0, str(src))
    from deepspeed.runtime.config import DeepSpeedConfig

    n = 0
    for f in sorted(golden.glob("deepspeed-*.json")):
        doc = json.loads(f.read_text())
        # The data-parallel size: devices / pipeline stages, from the comment's config.
        cfg = re.search(r"`([^`]*)`", doc["comment"]).group(1)
        dp = int(re.search(r"\bdp(\d+)", cfg).group(1))

        class Mpu:
            def get_data_parallel_world_size(self):
                return dp

            def get_data_parallel_rank(self):
                return 0

            def get_model_parallel_world_size(self):
                return 1

            def get_model_parallel_rank(self):
                return 0

        # No process group here: rank 0, and the data-parallel size from the unit above.
        with mock.patch("deepspeed.runtime.config.dist.get_rank", return_value=0):
            ds = DeepSpeedConfig(str(f), mpu=Mpu())
        assert ds.train_batch_size == doc["train_batch_size"], f
        assert ds.train_micro_batch_size_per_gpu == doc["train_micro_batch_size_per_gpu"], f
        assert ds.gradient_accumulation_steps == doc["gradient_accumulation_steps"], f
        assert int(ds.zero_optimization_stage) == doc["zero_optimization"]["stage"], f
        assert ds.bfloat16_config.enabled == ("bf16" in doc), f
        assert ds.pipeline["stages"] == doc.get("pipeline", {}).get("stages", "auto"), f
        assert ds.gradient_clipping == doc.get("gradient_clipping", 0.0), f
        # Offload sections, as DeepSpeed's pydantic models read them.
        zero = doc["zero_optimization"]
        for key, got in (("offload_optimizer", ds.zero_config.offload_optimizer),
                         ("offload_param", ds.zero_config.offload_param)):
            want = zero.get(key, {}).get("device")
            device = None if got is None else str(getattr(got.device, "value", got.device))
            got = None if device in (None, "none") else device
            assert got == want, f"{f.name}: {key} device {got!r}, the file says {want!r}"
        # The check can fail: one sequence too many is refused.
        with mock.patch("deepspeed.runtime.config.dist.get_rank", return_value=0):
            try:
                DeepSpeedConfig({**doc, "train_batch_size": doc["train_batch_size"] + 1}, mpu=Mpu())
                raise SystemExit(f"{f.name}: DeepSpeed took a wrong batch size")
            except AssertionError:
                pass
        offload = ", ".join(f"{k} on {zero[k]['device']}" for k in ("offload_optimizer", "offload_param")
                            if k in zero)
        print(f"deepspeed  ok  {f.name}: batch {ds.train_batch_size} = "
              f"{ds.train_micro_batch_size_per_gpu} x {ds.gradient_accumulation_steps} x dp{dp}, "
              f"ZeRO-{int(ds.zero_optimization_stage)}" + (f", {offload}" if offload else ""))
        n += 1
    return n


def check_torchtitan(golden: Path, src: Path) -> int:
    sys.path.insert(0, str(src))
    from torchtitan.config.manager import ConfigManager
    from torchtitan.distributed.parallel_dims import ParallelDims

    n = 0
    for f in sorted(golden.glob("torchtitan-*.toml")):
        want = tomllib.loads(f.read_text())
        job = ConfigManager().parse_args([f"--job.config_file={f}"])
        for section, table in want.items():
            for key, value in table.items():
                got = getattr(getattr(job, section), key)
                assert got == value, f"{f.name}: {section}.{key} = {got!r}, the file says {value!r}"
        p = job.parallelism
        world = int(re.search(r"--nnodes (\d+) --nproc-per-node (\d+)", f.read_text())
                    .group(1)) * int(re.search(r"--nproc-per-node (\d+)", f.read_text()).group(1))
        dims = ParallelDims(
            dp_replicate=p.data_parallel_replicate_degree,
            dp_shard=p.data_parallel_shard_degree,
            cp=p.context_parallel_degree,
            tp=p.tensor_parallel_degree,
            pp=p.pipeline_parallel_degree,
            ep=p.expert_parallel_degree,
            etp=p.expert_tensor_parallel_degree,
            world_size=world,
        )
        try:  # the check can fail: one device too many is refused
            ParallelDims(
                dp_replicate=dims.dp_replicate, dp_shard=dims.dp_shard, cp=dims.cp, tp=dims.tp,
                pp=dims.pp, ep=dims.ep, etp=dims.etp, world_size=world + 1,
            )
            raise SystemExit(f"{f.name}: torchtitan took a wrong world size")
        except AssertionError:
            pass
        print(f"torchtitan ok  {f.name}: world {world} = dp_replicate {dims.dp_replicate} x "
              f"dp_shard {dims.dp_shard} x tp {dims.tp} x pp {dims.pp}")
        n += 1
    return n


def main():
    golden, ds_src, tt_src = (Path(a) for a in sys.argv[1:4])
    print(f"checking with {stub_torch()}")
    n = check_deepspeed(golden, ds_src) + check_torchtitan(golden, tt_src)
    print(f"{n} export files load")


if __name__ == "__main__":
    main()
