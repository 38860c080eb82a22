"""bench/plans.py's command line: config overrides may follow `--recipe`, as bench/gpu_suite.sh passes
them on a GPU (`device --recipe h100_1gpu model.image_token_id=...`)."""

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "bench"))

import plans  # noqa: E402


def test_overrides_after_the_recipe_option():
    ids = ["model.image_token_id=1020", "model.video_token_id=1021"]
    args = plans.parser().parse_intermixed_args(["device", "--recipe", "h100_1gpu", *ids])
    assert (args.what, args.recipe, args.overrides) == ("device", "h100_1gpu", ids)
    args = plans.parser().parse_intermixed_args(
        ["recipes", "model.recompute=full", "--only", "a,b"]
    )
    assert (args.only, args.overrides) == ("a,b", ["model.recompute=full"])
