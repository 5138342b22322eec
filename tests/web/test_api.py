"""The page's HTTP API against a live server in this process: answers, errors, limits, speed, never blocking."""

from __future__ import annotations

import http.client
import json
import threading
import time

import pytest

from anatomist.anatomy import MemoryCategory
from anatomist.web.uploads import MAX_UPLOAD_BYTES
from tests.web.conftest import TINY_LLAMA, LiveServer


def _config_id(live: LiveServer, **overrides: object) -> str:
    reply = live.upload("config", "config.json", json.dumps({**TINY_LLAMA, **overrides}))
    assert reply.status == 200, reply.body
    return str(reply.body["id"])


def test_a_cold_trace_blocks_no_request_and_a_second_estimate_answers_in_under_half_a_second(live: LiveServer) -> None:
    """The estimate runs in the worker while the server answers; then torch and the trace cache are warm, so
    a new batch size of the same model reuses its traces."""
    config = _config_id(live, hidden_size=40, num_attention_heads=5, num_key_value_heads=5)  # traced by no other test
    params = {"view": "estimate", "config": config, "gpu": "A100-80GB", "seq_len": "64"}
    start = time.perf_counter()
    reply = live.request("POST", "/api/run", params)
    assert reply.status == 202 and reply.body["status"] in ("queued", "running")
    timings = []
    for path in ("/api/schema", f"/api/jobs/{reply.body['id']}", "/", "/static/app.js"):
        asked = time.perf_counter()
        assert live.request("GET", path).status in (200, 202)
        timings.append(time.perf_counter() - asked)
    assert live.request("GET", f"/api/jobs/{reply.body['id']}").body["status"] != "done"  # still tracing meanwhile
    assert max(timings) < 1.0, timings
    while reply.status == 202:
        time.sleep(0.05)
        reply = live.request("GET", f"/api/jobs/{reply.body['id']}")
    cold_s = time.perf_counter() - start
    assert reply.status == 200, reply.body
    assert reply.body["to_trace"] > 0 and reply.body["traced"] == reply.body["to_trace"]  # the progress the page shows

    warm, warm_s = live.run({**params, "per_device_train_batch_size": "24"})
    assert warm.status == 200 and warm.body["view"]["result"]["recipe"]["per_device_train_batch_size"] == 24
    assert warm.body["view"]["result"]["memory"]["device_total"] > reply.body["view"]["result"]["memory"]["device_total"]
    print(f"first estimate {cold_s:.2f} s, second {warm_s:.3f} s, ratio {warm_s / cold_s:.3f}")
    assert warm_s < 0.5 and warm_s / cold_s < 0.25


def test_an_estimate_is_the_cli_json_with_what_the_page_draws(live: LiveServer, cli, tiny_config) -> None:  # type: ignore[no-untyped-def]
    config = _config_id(live)
    reply, _ = live.run({"view": "estimate", "config": config, "gpu": "A100-80GB", "seq_len": "64",
                         "gradient_checkpointing": "true"})
    assert reply.status == 200, reply.body
    view = reply.body["view"]
    assert view["command"] == "anatomist estimate --gpu=A100-80GB --seq-len=64 --gradient-checkpointing config.json"
    expected = json.loads(cli("estimate", str(tiny_config), "--gpu", "A100-80GB", "--seq-len", "64",
                              "--gradient-checkpointing", "--json").stdout)
    assert view["result"]["memory"] == expected["memory"] and view["result"]["time"] == expected["time"]
    assert view["result"]["model"] == "uploaded llama config.json"  # never the server's folder
    assert [row["key"] for row in view["anatomy"]] == [c.value for c in MemoryCategory]
    assert sum(row["bytes"] for row in view["anatomy"]) == expected["memory"]["device_total"]
    png = live.request("GET", f"/api/jobs/{reply.body['id']}/charts/memory.png")
    assert png.status == 200 and png.headers["content-type"] == "image/png" and png.body[:4] == b"\x89PNG"


def test_the_longest_sequence_on_the_page_is_the_clis(live: LiveServer, cli, tiny_config) -> None:  # type: ignore[no-untyped-def]
    reply, _ = live.run({"view": "estimate", "config": _config_id(live), "gpu": "A100-80GB", "longest_seq_len": "true"})
    assert reply.status == 200, reply.body
    view = reply.body["view"]
    expected = json.loads(cli("estimate", str(tiny_config), "--gpu", "A100-80GB", "--longest-seq-len", "--json").stdout)
    assert view["result"]["longest_seq_len"] == expected["longest_seq_len"]
    assert view["result"]["seq_len"] == expected["seq_len"] == expected["longest_seq_len"]["tokens"]
    assert view["longest"].startswith(f"longest sequence that fits: {expected['seq_len']:,} tokens at batch")


def test_a_recipe_file_is_read_as_recipe_reads_it_and_its_notes_reach_the_page(live: LiveServer) -> None:
    sft = "per_device_train_batch_size: 2\ngradient_accumulation_steps: 4\nlearning_rate: 2.0e-4\noutput_dir: out\n"
    recipe = live.upload("recipe", "my args.yaml", sft)
    assert recipe.status == 200 and recipe.body["name"] == "my_args.yaml"
    reply, _ = live.run({"view": "estimate", "config": _config_id(live), "recipe": recipe.body["id"], "gpu": "A100-80GB",
                         "seq_len": "64", "gradient_accumulation_steps": "8"})
    assert reply.status == 200, reply.body
    result = reply.body["view"]["result"]["recipe"]
    assert (result["per_device_train_batch_size"], result["gradient_accumulation_steps"]) == (2, 8)  # the field wins
    assert any(m.startswith("my_args.yaml (TrainingArguments): not modelled: learning_rate")
               for m in reply.body["view"]["messages"])


@pytest.mark.parametrize(("params", "message"), [
    ({"model": "no-such-model"}, "not in the local HF cache (this server does not ask the Hub: upload the model's"),
    ({"model": "/etc/hostname"}, "model '/etc/hostname': the page takes a catalog name or a Hub id, not a path"),
    ({"model": "gpt2", "gpu": "a100"}, "'a100'"),
    ({"model": "gpt2", "fp16": "true", "bf16": "true"}, "fp16 and bf16 are mutually exclusive"),
    ({"model": "gpt2", "seq_len": "-5"}, "Sequence length (seq_len) must be at least 1, got -5"),
    ({"model": "gpt2", "per_device_train_batch_size": "100000000000000000000"},
     "Batch per GPU (per_device_train_batch_size) must be at most 2^31 - 1 = 2,147,483,647"),
    ({"model": "gpt2", "config": "0123456789abcdef"}, "give a model name or upload a config.json, not both"),
    ({"config": "0123456789abcdef"}, "the config.json this link names is not on this server any more"),
    ({"model": "gpt2", "nope": "1"}, "unknown field 'nope' for the estimate view"),
])
def test_bad_input_is_http_400_with_one_line(live: LiveServer, params: dict[str, str], message: str) -> None:
    reply = live.request("POST", "/api/run", {"view": "estimate", "gpu": "T4", **params})
    assert reply.status == 400, reply.body
    error = reply.body["error"]
    assert message in error and "\n" not in error and "Traceback" not in error


@pytest.mark.slow  # two cold tensor parallel estimates, the page's worker's and the CLI's: 40 s on 2 cores
def test_a_tensor_parallel_estimate_on_the_page_is_the_clis(live: LiveServer, cli, tiny_config) -> None:  # type: ignore[no-untyped-def]
    """The page's "Tensor parallel GPUs per group" (tp_size) reaches the estimate as the CLI's --tp-size does; a size
    the model's heads cannot take is one line on the page too."""
    config = _config_id(live)
    reply, _ = live.run({"view": "estimate", "config": config, "gpu": "H100", "seq_len": "64", "gpus": "2",
                         "tp_size": "2"})
    assert reply.status == 200, reply.body
    expected = json.loads(cli("estimate", str(tiny_config), "--gpu", "H100", "--seq-len", "64", "--gpus", "2",
                              "--tp-size", "2", "--json").stdout)
    assert reply.body["view"]["result"]["memory"] == expected["memory"]
    assert reply.body["view"]["result"]["recipe"]["tp_size"] == 2
    bad = live.request("POST", "/api/run", {"view": "estimate", "config": config, "gpu": "H100", "seq_len": "64",
                                            "gpus": "8", "tp_size": "8", "fsdp": "full_shard"})
    assert bad.status == 400 and "does not divide its 4 attention heads" in bad.body["error"]


@pytest.mark.parametrize(("kind", "name", "text", "message"), [
    ("config", "config.json", '{"model_type": "llama", "hidden_size": ', "config.json: not valid JSON (Expecting value"),
    ("config", "config.json", "[1, 2]", "config.json: a config.json must hold a JSON object"),
    ("config", "config.json", '{"model_type": "llama", "num_hidden_layers": 0}', "config.json: field num_hidden_layers"),
    ("config", "config.json", '{"model_type": "mystery", "auto_map": {"AutoConfig": "x.MysteryConfig"}}',
     "config.json: model_type='mystery' needs the model's own code (auto_map); the page never runs a model's own code"),
    ("recipe", "ta.json", '{"per_device_train_batch_size": 4, "deepspeed": "/etc/ds.json"}',
     "ta.json: deepspeed names another file ('/etc/ds.json')"),
    ("recipe", "acc.yaml", "distributed_type: DEEPSPEED\ndeepspeed_config:\n  deepspeed_config_file: ds.json\n",
     "acc.yaml: deepspeed_config.deepspeed_config_file names another file"),
    ("recipe", "sft.yaml", "model_name_or_path: ./my-model\nmax_length: 64\n", "sft.yaml's model './my-model'"),
    ("recipe", "bad.yaml", "per_device_train_batch_size: [\n", "bad.yaml:2:1: recipe file is not valid YAML"),
    ("recipe", "notes.txt", "a: 1", "notes.txt: a recipe file is JSON or YAML"),
    ("recipe", "x.json", "", "x.json is empty"),
    ("config", "config.json", '{"per_device_train_batch_size": 4, "learning_rate": 2e-5, "output_dir": "out"}',
     "config.json is not a model's config.json: it reads as a recipe file (TrainingArguments); upload it as the "
     "recipe file instead"),
    ("config", "config.json", '{"version": "1.0", "truncation": null, "added_tokens": []}',
     "config.json is not a model's config.json (it has no model_type; its keys: added_tokens, truncation, version)"),
    ("lengths", "lengths.txt", "512\n300\nabc\n", "line 3 is 'abc', not a positive whole number of tokens"),
    ("cat", "x.json", "{}", "unknown upload kind 'cat'"),
])
def test_bad_uploads_are_refused_with_one_line(live: LiveServer, kind: str, name: str, text: str, message: str) -> None:
    reply = live.upload(kind, name, text)
    assert reply.status == 400 and message in reply.body["error"], reply.body
    assert "/tmp" not in reply.body["error"] and "anatomist-web-" not in reply.body["error"]


def test_a_bad_value_names_its_field_for_the_page_to_point_at(live: LiveServer) -> None:
    reply = live.request("POST", "/api/run", {"view": "plan", "model": "gpt2", "gpu": "T4", "global_batch_size": "0"})
    assert reply.status == 400 and reply.body == {
        "error": "Global batch (global_batch_size) must be at least 1, got 0", "field": "global_batch_size"}


def test_an_internal_error_is_one_line_with_what_to_try_and_its_traceback_logged(live: LiveServer, monkeypatch,
                                                                              caplog) -> None:  # type: ignore[no-untyped-def]
    from anatomist.web import service

    def broken(*args, **kwargs):  # type: ignore[no-untyped-def]
        raise RuntimeError("a bug in the library")

    monkeypatch.setattr(service, "run_view", broken)
    with caplog.at_level("ERROR", logger="anatomist.web"):
        reply, _ = live.run({"view": "estimate", "model": "gpt2", "gpu": "T4", "seq_len": "77"})
    assert reply.status == 500
    error = reply.body["error"]
    assert "\n" not in error and "a bug in the library" not in error and "Traceback" not in error
    assert error.startswith("the server could not compute this (an internal error, logged on the server): try "
                            "another setting, or run `anatomist estimate --gpu=T4 --seq-len=77 gpt2` on your own machine")
    assert any("a bug in the library" in (r.exc_text or str(r.exc_info)) for r in caplog.records)


def test_the_icon_and_a_lengths_file(live: LiveServer) -> None:
    icon = live.request("GET", "/favicon.ico")
    assert icon.status == 200 and icon.headers["content-type"].startswith("image/svg+xml") and b"<svg" in icon.body
    lengths = live.upload("lengths", "my lengths.txt", "120\n64\n200\n")
    assert lengths.status == 200 and lengths.body["name"] == "my_lengths.txt"
    reply, _ = live.run({"view": "estimate", "config": _config_id(live), "gpu": "A100-80GB", "seq_len": "128",
                         "trainer": "sft", "padding_free": "true", "attn_implementation": "flash_attention_2",
                         "lengths": lengths.body["id"]})
    assert reply.status == 200, reply.body
    assert "--lengths=my_lengths.txt" in reply.body["view"]["command"]


def test_uploads_and_requests_are_size_limited(live: LiveServer) -> None:
    big = live.upload("config", "config.json", json.dumps({**TINY_LLAMA, "padding": "x" * MAX_UPLOAD_BYTES}))
    assert big.status == 400 and "uploads are limited to 256 KiB" in big.body["error"]
    # Refused from its content-length, before the body is read: the reply may reach the client, or the
    # connection close under it while it still sends; either way nothing was read, and the server goes on.
    host, port = live.url.removeprefix("http://").strip("/").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    body = b"{" + b" " * (3 * MAX_UPLOAD_BYTES) + b"}"
    try:
        conn.request("POST", "/api/uploads", body=body, headers={"content-type": "application/json"})
        reply = conn.getresponse()
        assert reply.status == 413 and "larger than" in json.loads(reply.read())["error"]
    except ConnectionError:
        pass
    finally:
        conn.close()
    assert live.request("GET", "/api/schema").status == 200


def test_the_same_request_twice_is_one_job(live: LiveServer) -> None:
    params = {"view": "estimate", "config": _config_id(live), "gpu": "L4", "seq_len": "64"}
    replies: list = []
    threads = [threading.Thread(target=lambda: replies.append(live.request("POST", "/api/run", params))) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len({r.body["id"] for r in replies}) == 1
    # An error is never reused: what it depended on (an upload, the Hub) may be there the next time. The first is
    # awaited: a request made while the same one still runs shares its job, whatever it turns out to be.
    bad = {"view": "estimate", "model": "no-such-model"}
    first, _ = live.run(bad)
    assert first.body["status"] == "error"
    assert live.request("POST", "/api/run", bad).body["id"] != first.body["id"]


def test_the_page_is_served_with_a_same_origin_policy_and_only_to_local_host_names(live: LiveServer) -> None:
    page = live.request("GET", "/")
    assert page.status == 200 and b"/static/app.js" in page.body
    assert page.headers["content-security-policy"].startswith("default-src 'self'")
    assert b"http" not in page.body.replace(b'http-equiv', b"")  # nothing loaded from elsewhere
    assert live.request("GET", "/", headers={"host": "attacker.example"}).status == 400


@pytest.mark.slow
def test_emitted_files_of_a_plan_pick(live: LiveServer) -> None:
    reply, _ = live.run({"view": "plan", "config": _config_id(live), "gpu": "A100-80GB", "seq_len": "64",
                         "optims": "adamw_torch_fused", "precisions": "bf16", "no_compile": "true",
                         "global_batch_size": "16"})
    assert reply.status == 200, reply.body
    view = reply.body["view"]
    assert view["result"]["feasible"] > 0 and any(p["best"] for p in view["picks"]) and view["picks"][0]["reasons"]
    best = next(i for i, p in enumerate(view["picks"]) if p["best"])
    listing = live.request("GET", f"/api/jobs/{reply.body['id']}/files/{best}/trainer").body["files"]
    assert [f["name"] for f in listing] == ["training_args.json", "training_args.ds_config.json", "training_args.py"]
    args = live.request("GET", listing[0]["url"])
    assert args.headers["content-disposition"] == 'attachment; filename="training_args.json"'
    assert args.body["per_device_train_batch_size"] == view["picks"][best]["recipe"]["per_device_train_batch_size"]
    assert live.request("GET", f"/api/jobs/{reply.body['id']}/files/{best}/xla").status == 400
    assert live.request("GET", f"/api/jobs/{reply.body['id']}/files/99/trainer").status == 400
    assert live.request("GET", f"/api/jobs/{reply.body['id']}/charts/throughput.png").status == 200
    assert live.request("GET", "/api/jobs/nope/charts/memory.png").status == 404
