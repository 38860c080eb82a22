"""The names users type are the public interface: every training command line of the README and the
guide (user_docs.PAGES) and of the recipes' comments, and every recipe (with its own sweep), composes
and validates as written (composition and validation only, nothing trained; checked as for the launch
the line names, not this machine); each model option sets the model-config field it names; an unknown
key is refused naming the nearest ones."""

import itertools
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import user_docs
from omegaconf import OmegaConf

from moevlm.config import compose_job, validate
from moevlm.config.model_section import model_fields, spec_fields
from moevlm.config.schema import options
from moevlm.errors import ConfigError
from moevlm.model.config import VLMConfig

REPO = Path(__file__).resolve().parents[2]
RECIPES = sorted((REPO / "conf" / "experiment").glob("*.yaml"))


def command_lines() -> list[str]:
    """`train.py` lines of the README's and the guide's bash blocks and of the recipes' comments (fragments
    with `...` after train.py left out), each once."""
    lines = [
        line
        for block in user_docs.blocks("bash")
        for line in block.replace("\\\n", " ").splitlines()
    ]
    lines += [
        line.lstrip("# ")
        for p in RECIPES
        for line in p.read_text().splitlines()
        if line.startswith("#")
    ]
    lines = [line.split(" #")[0].split("&&")[-1].strip() for line in lines if "train.py" in line]
    return list(dict.fromkeys(line for line in lines if "..." not in line.split("train.py", 1)[1]))


def jobs(line: str) -> tuple[int, list[list[str]]]:
    """(processes launched, the override lists of its jobs: a `-m` sweep's comma lists expanded)."""
    words = shlex.split(line)
    count = lambda flag: int(words[words.index(flag) + 1]) if flag in words else 1  # noqa: E731
    args = [
        a
        for a in words[words.index("train.py") + 1 :]
        if "=" in a and not a.startswith(("-", "hydra."))
    ]
    if "-m" not in words:
        return count("--nproc-per-node") * count("--nnodes"), [args]
    choices = [[f"{a.split('=')[0]}={v}" for v in a.split("=", 1)[1].split(",")] for a in args]
    return count("--nproc-per-node") * count("--nnodes"), [
        list(c) for c in itertools.product(*choices)
    ]


def test_the_lines_are_found():
    lines = command_lines()
    assert (
        len(lines) >= 20
        and any("+scale=cpu" in line for line in lines)
        and any("-m" in line for line in lines)
    )


@pytest.mark.parametrize("line", command_lines())
def test_readme_and_recipe_command_lines_are_accepted_as_written(line):
    world, overrides = jobs(line)
    for job_overrides in overrides:
        job = compose_job(job_overrides)  # every key known to the schema
        validate(job, world, environment=False)


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.stem)
def test_every_recipe_and_its_sweep_validate(path):
    """Each recipe on the launch it is laid out for, and each job of the sweep it defines."""
    sweep = OmegaConf.load(path).get("hydra", {}).get("sweeper", {}).get("params", {})
    points = itertools.product(
        *[[f"{k}={v}" for v in str(vs).split(",")] for k, vs in sweep.items()]
    )
    for point in points:
        job = compose_job([f"+experiment={path.stem}", "data.shards=DIR", *point])
        plan = validate(job, job.parallel.world_size or 1, environment=False)
        assert plan.model.text.num_layers >= 1


# every model option that is a model-config field, set away from its default (the tiny preset's)
SET = {
    "attn_backend": "sdpa",
    "grouped_gemm": "loop",
    "dispatcher": "alltoall",
    "permute": "torch",
    "moe_capacity_factor": 1.25,
    "moe_capacity_overflow": "error",
    "fp8": "blockwise",
    "fp8_modules": ["experts", "attn"],
    "fp8_backend": "emulate",
    "fp8_pow2_scales": True,
    "fp8_cache_weights": False,
    "fp8_pad_experts": False,
    "num_layers": 2,
    "num_experts": 4,
    "vision_depth": 1,
    "vision_taps": [0],
    "aux_loss_coef": 0.01,
    "moe_aux_loss": "sequence",
    "moe_router_bias_rate": 0.001,
    "moe_z_loss_coeff": 0.001,
    "moe_router_force_balance": True,
    "deepep_api": "v1",
    "dispatcher_max_tokens_per_rank": 4096,
    "dispatcher_num_sms": 24,
    "loss_chunk_tokens": 256,
    "vocab_size": 2048,
    "image_token_id": 2000,
    "video_token_id": 2001,
    "vision_start_token_id": 1998,
    "vision_end_token_id": 1999,
    "lora_rank": 0,  # off: LoRA over FP8 (set above) is refused; the other lora fields still land
    "lora_alpha": 4.0,
    "lora_dropout": 0.1,
    "lora_modules": ["attn", "experts"],
    "lora_router": "trained",
}


def _override(key: str, value) -> str:
    if isinstance(value, list):
        return f"model.{key}=[{','.join(map(str, value))}]"
    return f"model.{key}={str(value).lower() if isinstance(value, bool) else value}"


def test_each_model_option_is_the_model_config_field_it_names():
    """`model.moe_capacity_factor=1.25` is VLMConfig's moe.capacity_factor = 1.25, and so on for every
    declared field: the plan's model config equals the library's preset with those fields set, and its
    dispatcher spec has the dispatcher fields set (`model.dispatcher_num_sms=24` is its num_sms)."""
    assert set(SET) == set(model_fields()) | set(spec_fields())
    plan = validate(compose_job([_override(k, v) for k, v in SET.items()]), 1, environment=False)
    for key, name in spec_fields().items():
        assert getattr(plan.dispatcher, name) == SET[key], key
    want = VLMConfig.preset("tiny")
    for key, path in model_fields().items():
        *parents, name = path.split(".")
        node = want
        for p in parents:
            node = getattr(node, p)
        setattr(node, name, tuple(SET[key]) if isinstance(SET[key], list) else SET[key])
    want.vision.deepstack_visual_indexes = (0,)  # the tiny preset's one tap, inside depth 1
    assert plan.model == want.validate()
    helps = {o.path: o.help for o in options()}
    assert all(f"VLMConfig.{path}" in helps[f"model.{key}"] for key, path in model_fields().items())
    assert all(f"DispatcherSpec.{f}" in helps[f"model.{key}"] for key, f in spec_fields().items())


@pytest.mark.parametrize(
    "override, message",
    [
        (
            "model.moe_capacity_factor=0",
            "model.moe_capacity_factor=0.0 must be a finite number > 0",
        ),
        ("model.fp8_backend=cutlass", "model.fp8_backend='cutlass'; choose one of"),
        ("model.attn_backend=xformers", "model.attn_backend='xformers'; choose one of"),
        (
            "model.moe_capacity_overflow=never",
            "model.moe_capacity_overflow='never'; choose one of ['drop', 'error']",
        ),
    ],
)
def test_a_model_field_error_names_the_key_the_user_typed(override, message):
    with pytest.raises(ConfigError) as err:
        validate(compose_job([override, "model.dispatcher=alltoall"]), 1)
    assert message in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize(
    "override, message",
    [
        (
            "model.capacity_factor=1.25",
            "model.capacity_factor is not an option; did you mean model.moe_capacity_factor",
        ),
        (
            "model.moe.capacity_factor=1.25",
            "model.moe.capacity_factor is not an option; did you mean model.moe_capacity_factor?",
        ),
        (
            "model.fp8.recipe=blockwise",
            "model.fp8.recipe is not an option; did you mean model.fp8?",
        ),
        ("parallel.expert_parallel=2", "parallel.expert_parallel is not an option"),
    ],
)
def test_an_unknown_key_is_refused_naming_the_nearest(override, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        compose_job([override])


@pytest.mark.slow
def test_train_py_refuses_an_unknown_key_in_one_line():
    proc = subprocess.run(
        [sys.executable, str(REPO / "train.py"), "model.moe.capacity_factor=1.25"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip() == (
        "config error: model.moe.capacity_factor is not an option; did you mean "
        "model.moe_capacity_factor? (python train.py --help lists them all)"
    )
