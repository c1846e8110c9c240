"""--variant: the levels measured again with another token2wav worker on the same LM engine, and
--compile-flow's variant, which compiles the eagerly served flow in place (cosyapp/bench/run.py)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from cosyapp.bench.__main__ import parse_args
from cosyapp.engine.text_workers import default_lanes

REPO = Path(__file__).resolve().parents[1]


def test_compile_hift_is_no_variant_field(capsys):
    with pytest.raises(SystemExit):  # it changes the model's HiFT, not the swapped worker
        parse_args(["--variant", "fused:compile_hift=true"])
    assert "'compile_hift' is not one of" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        # compiling is one way: a later variant would measure the compiled flow it did not ask for
        (["--variant", "c:compile_flow=true", "--variant", "h:first_hop=15"], "the last variant only"),
        (["--compile-flow", "--variant", "c:compile_flow=true"], "compiles an eagerly served flow"),
        (["--variant", "c:compile_flow=false"], "compiles an eagerly served flow"),
        # the flow is compiled by default on a GPU: there the variant needs --no-compile-flow
        (["--device", "cuda", "--variant", "c:compile_flow=true"], "add --no-compile-flow"),
    ],
)
def test_a_compile_flow_variant_compiles_an_eager_flow_last(capsys, argv, message):
    with pytest.raises(SystemExit):
        parse_args(argv)
    assert message in capsys.readouterr().err
    for eager in (["--device", "cpu"], ["--device", "cuda", "--no-compile-flow"]):
        args = parse_args([*eager, "--variant", "h:first_hop=15", "--variant", "c:compile_flow=true"])
        assert args.variants == {"h": {"first_hop": 15}, "c": {"compile_flow": True}}


def test_a_variant_measures_the_levels_again_with_its_worker_options(tmp_path):
    out = tmp_path / "variants.json"
    command = [
        sys.executable, "-m", "cosyapp.bench", "--device", "cpu", "--drivers", "pipeline",
        "--texts", "tokens", "--tokens", "100", "--modes", "stream", "--clients", "1,2",
        "--first-hop", "25", "--variant", "hop15:first_hop=15,max_batch=2,text_lanes=2",
        "--workdir", str(tmp_path / "work"), "--out", str(out),
    ]  # fmt: skip
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["variants"] == {"hop15": {"first_hop": 15, "max_batch": 2, "text_lanes": 2}}
    levels = result["levels"]
    marks = [(lv.get("variant"), lv["clients"]) for lv in levels]
    assert marks == [(None, 1), (None, 2), ("hop15", 1), ("hop15", 2)]
    for level in result["levels"]:
        assert level["requests"] == level["clients"] and level["failed"] == 0, level["errors"]
        assert level["audio_s"] > 0 and level["stages"]["flow_calls"] > 0
    # Each level says which worker served it: the variant's own.
    workers = [(lv.get("variant"), lv["worker"]["first_hop"], lv["worker"]["max_batch"]) for lv in levels]
    assert workers == [(None, 25, 64), (None, 25, 64), ("hop15", 15, 2), ("hop15", 15, 2)]
    lanes = [lv["worker"]["text_lanes"] for lv in levels]
    assert lanes[:2] == [default_lanes()] * 2 and lanes[2:] == [2, 2]
    assert all(lv["flow_max_batch"] <= 2 for lv in result["levels"] if lv.get("variant"))
    assert "[hop15] pipeline" in done.stdout
    # Each level was also kept as a JSON line the moment it was measured, in the same order.
    kept = [json.loads(line) for line in (tmp_path / "variants-levels.jsonl").read_text().splitlines()]
    assert kept == levels


def test_a_compile_flow_variant_measures_the_flow_compiled_in_place(tmp_path):
    """The eager levels first, then the same flow compiled on the compile thread (compiling.py), its
    levels measured once what the variant's warm-up met is compiled."""
    out = tmp_path / "compiled.json"
    command = [
        sys.executable, "-m", "cosyapp.bench", "--device", "cpu", "--drivers", "pipeline",
        "--texts", "tokens", "--tokens", "60", "--modes", "stream", "--clients", "1",
        "--variant", "compiled:compile_flow=true", "--workdir", str(tmp_path / "work"), "--out", str(out),
    ]  # fmt: skip
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    eager, compiled = json.loads(out.read_text())["levels"]
    assert eager.get("variant") is None and compiled["variant"] == "compiled"
    for level in (eager, compiled):
        assert level["requests"] == 1 and level["failed"] == 0, level["errors"]
    assert "compile_wait_s" not in eager and compiled["compile_wait_s"] > 0
    # Nothing compiled before the variant; then the compile thread did before its level, and only it.
    assert eager["stages"]["flow_compiles"] == 0 and "compiled_before" not in eager
    assert compiled["compiled_before"] > 0 and compiled["stages"]["compiles_elsewhere"] == 0
