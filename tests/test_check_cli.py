"""`anatomist check MODEL --recipe FILE`: exit 0 fits (or borderline: the limit inside the memory interval, said
on stderr with the smallest change that fits even at the interval's top), 3 does not (the change on stderr), 2 bad
input."""

from __future__ import annotations

import json

import pytest

from anatomist.hardware import detect_local_gpu

MIB = 2**20


@pytest.fixture
def setup(tiny_model, tmp_path, cli):
    model = tiny_model("llama")
    recipe = tmp_path / "args.json"  # a TrainingArguments file, as to_json_string() writes one
    # activations well above the CUDA context, so that a smaller micro-batch fits even at the top of its interval
    recipe.write_text(json.dumps({"per_device_train_batch_size": 512, "gradient_accumulation_steps": 1,
                                  "output_dir": "out", "optim": "adamw_torch_fused"}))
    flags = [str(model), "--recipe", str(recipe), "--gpu", "A100-80GB", "--seq-len", "64", "--task", "causal-lm"]
    estimated = cli("estimate", *flags, "--json")
    assert estimated.returncode == 0, estimated.stderr
    return flags, json.loads(estimated.stdout)["memory"]


def _gib(nbytes: float) -> str:
    return str(nbytes / 2**30)


def test_exit_0_when_it_fits_3_with_the_smallest_change_when_not(setup, cli):
    flags, memory = setup
    low, high = memory["interval"]["low"], memory["interval"]["high"]
    fits = cli("check", *flags, "--limit-gib", _gib(high + MIB))
    assert fits.returncode == 0 and "fits            yes" in fits.stdout and "fit:" not in fits.stderr
    borderline = cli("check", *flags, "--limit-gib", _gib(memory["device_total"] - MIB))
    assert borderline.returncode == 0 and "borderline" in borderline.stdout
    assert "may not fit" in borderline.stderr and "smallest change that fits at the top of its interval" in \
        borderline.stderr
    short = cli("check", *flags, "--limit-gib", _gib(low - MIB))
    assert short.returncode == 3
    assert "will not fit" in short.stderr
    assert "smallest change that fits at the top of its interval: per_device_train_batch_size=512 -> " in short.stderr
    assert "effective batch 512 kept" in short.stderr
    out = cli("check", *flags, "--limit-gib", _gib(low - MIB), "--json")
    data = json.loads(out.stdout)
    assert out.returncode == 3 and data["fits"] is False and data["verdict"] == "does not fit"
    change = data["smallest_change"]["recipe"]
    assert change["per_device_train_batch_size"] * change["gradient_accumulation_steps"] == 512
    assert data["smallest_change"]["device_total"] <= (low - MIB)


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
