"""`anatomist check MODEL --recipe FILE`: exit 0 fits, 3 does not (the smallest change on stderr), 2 bad input."""

from __future__ import annotations

import json

import pytest

from anatomist.hardware import detect_local_gpu

MIB = 2**20


@pytest.fixture
def setup(tiny_model, tmp_path, cli):
    model = tiny_model("llama")
    recipe = tmp_path / "args.json"  # a TrainingArguments file, as to_json_string() writes one
    recipe.write_text(json.dumps({"per_device_train_batch_size": 16, "gradient_accumulation_steps": 1,
                                  "output_dir": "out", "optim": "adamw_torch_fused"}))
    flags = [str(model), "--recipe", str(recipe), "--gpu", "A100-80GB", "--seq-len", "64", "--task", "causal-lm"]
    estimated = cli("estimate", *flags, "--json")
    assert estimated.returncode == 0, estimated.stderr
    return flags, json.loads(estimated.stdout)["memory"]["device_total"]


def test_exit_0_when_it_fits_3_with_the_smallest_change_when_not(setup, cli):
    flags, device_total = setup
    fits = cli("check", *flags, "--limit-gib", str((device_total + MIB) / 2**30))
    assert fits.returncode == 0 and "fits            yes" in fits.stdout
    short = cli("check", *flags, "--limit-gib", str((device_total - MIB) / 2**30))
    assert short.returncode == 3
    assert "will not fit" in short.stderr and "smallest change that fits: per_device_train_batch_size=16 -> " in short.stderr
    assert "effective batch 16 kept" in short.stderr
    out = cli("check", *flags, "--limit-gib", str((device_total - MIB) / 2**30), "--json")
    data = json.loads(out.stdout)
    assert out.returncode == 3 and data["fits"] is False
    change = data["smallest_change"]["recipe"]
    assert change["per_device_train_batch_size"] * change["gradient_accumulation_steps"] == 16
    assert data["smallest_change"]["device_total"] <= (device_total - MIB)


def test_bad_input_is_one_line_and_exit_2(setup, cli):
    flags, _ = setup
    for args, message in (
        (["--limit-gib", "-1"], "--limit-gib must be greater than 0"),
        (["--limit-gib", "0.0001"], "weights alone"),
        (["--gpu", "A100-90GB"], "GPU"),
    ):
        result = cli("check", *flags, *args)
        assert result.returncode == 2 and message in result.stderr, (args, result.stderr)
        assert "Traceback" not in result.stderr
    if detect_local_gpu() is None:
        result = cli("check", *flags[:3], "--seq-len", "64")
        assert result.returncode == 2 and "no GPU found through NVML" in result.stderr
