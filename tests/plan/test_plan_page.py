"""`finetune plan --serve` and `--html`: the page's JSON API answers what `finetune plan --json` prints,
errors name the field at fault, requests are bounded and never reach the disk, and the standalone page
carries the same data. The real-browser test is test_plan_page_browser.py."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from pathlib import Path
from urllib.parse import urlencode

import pytest
from helpers import REPO

from finetune.cli.plan import page_answer
from finetune.models import catalog
from finetune.plan import serve

ENV = os.environ | {"PYTHONPATH": str(REPO)}


@pytest.fixture(scope="module")
def base_url():
    server = serve.start("127.0.0.1", 0, page_answer)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def http(url: str, body: bytes | None = None) -> tuple[int, dict]:
    request = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"} if body is not None else {})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def cli(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "finetune", "plan", *args], capture_output=True, text=True,
                          timeout=120, env=ENV, cwd=cwd)


def cli_json(*args: str):
    done = cli(*args, "--json")
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_what_fits_query_answers_as_the_cli_json(base_url):
    query = "what fits on 2×A100 40GB"
    status, body = http(f"{base_url}/api/plan?{urlencode({'q': query})}")
    assert status == 200
    assert body["result"] == cli_json(query)
    assert body["command"] == f"finetune plan '{query}'"
    # one set of files per model: its recommended plan's, in the folder --write-config gives it
    assert len(body["files"]) == len(body["result"])
    for contract, files in zip(body["result"], body["files"]):
        if contract["recommended"] is not None:
            assert f"plan/{contract['model']['name']}/accelerate.yaml" in files["finetune.sbatch"]


def test_fields_override_the_query_as_flags_do(base_url):
    fields = {"q": "llama-70b qlora on 2x RTX 4090", "seq_len": "1024", "tokens": "1e8", "gradient_checkpointing": "on",
              "gpu": "RTX4090", "count": "4", "method": "auto"}
    status, body = http(f"{base_url}/api/plan", json.dumps(fields).encode())  # POST, as the page sends it
    assert status == 200
    expected = cli_json(fields["q"], "--seq-len", "1024", "--tokens", "1e8", "--gradient-checkpointing", "--gpus", "4xRTX4090")
    assert body["result"] == expected
    assert body["result"]["hardware"]["count"] == 4 and body["result"]["plans"][0]["seq_len"] == 1024
    assert body["command"] == ("finetune plan 'llama-70b qlora on 2x RTX 4090' --seq-len 1024 --tokens 1e8 "
                               "--gradient-checkpointing --gpus 4xRTX4090")


def test_files_are_those_write_config_writes_plus_an_sbatch_script(base_url, tmp_path):
    query = "llama-3.1-8b full on 8xH100 zero3"
    status, body = http(f"{base_url}/api/plan?{urlencode({'q': query})}")
    assert status == 200
    done = cli(query, "--write-config", "plan", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    recommended = body["result"]["recommended"]
    files = body["files"][recommended]
    written = {path.name: path.read_text() for path in (tmp_path / "plan").iterdir()}
    assert written == {name: text for name, text in files.items() if name != "finetune.sbatch"}
    assert set(written) == {"accelerate.yaml", "ds_config.json", "trainjob.yaml", "skypilot.yaml", "dstack.yaml"}
    launch = body["result"]["plans"][recommended]["launch_command"]
    flags = launch.split(" -m finetune ")[1]
    sbatch = files["finetune.sbatch"]
    assert sbatch.startswith("#!/bin/bash") and "#SBATCH --gpus-per-node=8" in sbatch
    assert "--config_file plan/accelerate.yaml" in sbatch
    assert all(word in sbatch for word in flags.split())


@pytest.mark.parametrize(("fields", "field", "cli_args"), [
    ({"q": "llama-7b on 2xA100-40GB", "seq_len": "0"}, "seq_len", ["llama-7b on 2xA100-40GB", "--seq-len", "0"]),
    ({"q": "llama-7b on 2xA100-40GB", "seq_len": "long"}, "seq_len", ["llama-7b on 2xA100-40GB", "--seq-len", "long"]),
    ({"q": "llama-7b on 2xA100-40GB", "strategy": "single"}, "strategy", ["llama-7b on 2xA100-40GB", "--strategy", "single"]),
    ({"q": "llama-7b on 2xA1000"}, "q", ["llama-7b on 2xA1000"]),
    ({"q": "falcon-40b on 2xA100-40GB"}, "q", ["falcon-40b on 2xA100-40GB"]),
    ({"model": "llama-7b", "gpu": "B900"}, "gpu", ["--model", "llama-7b", "--gpus", "1xB900"]),
    ({"model": "lama-7b", "gpu": "H100-80GB"}, "model", ["--model", "lama-7b", "--gpus", "1xH100-80GB"]),
])
def test_errors_are_the_cli_messages_aimed_at_the_field(base_url, fields, field, cli_args):
    status, body = http(f"{base_url}/api/plan", json.dumps(fields).encode())
    assert status == 400
    done = cli(*cli_args)
    assert done.returncode == 2
    assert [error["field"] for error in body["errors"]] == [field]
    assert body["errors"][0]["message"] in done.stderr


def test_page_and_catalog_are_served(base_url):
    with urllib.request.urlopen(f"{base_url}/", timeout=30) as response:
        html = response.read().decode()
        assert "default-src 'none'" in response.headers["Content-Security-Policy"]
    assert '<script src="page.js"></script>' in html and 'id="q"' in html
    for asset in ("page.js", "page.css"):
        with urllib.request.urlopen(f"{base_url}/{asset}", timeout=30) as response:
            assert response.read().decode() == serve.page_file(asset)
    status, menus = http(f"{base_url}/api/catalog")
    assert status == 200 and "llama-2-70b" in [m["name"] for m in menus["models"]] and menus["strategy_labels"]["zero3"] == "ZeRO-3"


def test_request_sizes_are_bounded(base_url):
    status, body = http(f"{base_url}/api/plan", b'{"q": "' + b"x" * serve.MAX_BODY_BYTES + b'"}')
    assert status == 413 and "body" in body["errors"][0]["message"]
    status, _ = http(f"{base_url}/api/plan?{urlencode({'q': 'x' * serve.MAX_URL_BYTES})}")
    assert status == 413
    status, _ = http(f"{base_url}/api/plan", json.dumps({"q": "llama-7b on 1xH100-80GB", "shell": "rm"}).encode())
    assert status == 400
    status, _ = http(f"{base_url}/api/plan", b"[1, 2]")
    assert status == 400


def test_no_path_from_a_request_reaches_the_disk(base_url, tmp_path):
    config = tmp_path / "config.json"
    config.write_text(json.dumps(catalog.get("llama-7b").to_hf_config_dict()))
    assert cli("--model", str(config), "--gpus", "1xA100-80GB").returncode == 0  # the terminal reads it ...
    for fields in ({"model": str(config), "gpu": "A100-80GB"}, {"q": f"{config} on 1xA100-80GB"},
                   {"model": "acme/llama-like", "gpu": "A100-80GB"}):
        status, body = http(f"{base_url}/api/plan", json.dumps(fields).encode())  # ... the page does not
        assert status == 400 and "catalog models and pasted config.json" in body["errors"][0]["message"]
    for path in ("/../pyproject.toml", "/page.js/../command.py", "/finetune/plan/serve.py", "/%2e%2e/README.md"):
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(base_url + path, timeout=30)
        assert refused.value.code == 404
    status, body = http(f"{base_url}/api/plan", json.dumps({"host_memory": "local", "q": "llama-7b on 1xH100-80GB"}).encode())
    assert status == 400 and body["errors"][0]["field"] == "host_memory"


def test_pasted_config_is_planned_as_the_same_file_on_disk(base_url, tmp_path):
    config = dict(catalog.get("llama-7b").to_hf_config_dict(), _name_or_path="acme/llama-like",
                  auto_map={"AutoModelForCausalLM": "modeling_evil.Model"})  # code it names is never run
    (tmp_path / "config.json").write_text(json.dumps(config))
    status, body = http(f"{base_url}/api/plan", json.dumps({"config": json.dumps(config), "gpu": "A100-80GB"}).encode())
    assert status == 200
    expected = cli_json("--model", str(tmp_path / "config.json"), "--gpus", "1xA100-80GB")
    assert body["result"]["model"]["name"] == "acme/llama-like" and body["command"].endswith("--model ./config.json")
    numbers = lambda plans: [{k: v for k, v in p.items() if k not in ("launch_command", "ray_command")} for p in plans]  # noqa: E731
    assert numbers(body["result"]["plans"]) == numbers(expected["plans"])
    assert body["result"]["model"]["params"] == expected["model"]["params"]
    status, body = http(f"{base_url}/api/plan", json.dumps({"config": "{not json", "gpu": "A100-80GB"}).encode())
    assert status == 400 and body["errors"][0]["field"] == "config"


def test_html_file_is_self_contained_and_carries_the_json(tmp_path):
    query = "llama-70b qlora on 2x RTX 4090"
    page = tmp_path / "plan.html"
    done = cli(query, "--html", str(page))
    assert done.returncode == 0, done.stderr
    html = page.read_text()
    data = json.loads(html.split("window.PLAN_DATA = ", 1)[1].split(";\nwindow.PLAN_CATALOG", 1)[0])
    assert data["result"] == cli_json(query)
    assert data["command"] == f"finetune plan '{query}'"
    assert "<script src=" not in html and "<link rel=\"stylesheet\"" not in html  # CSS and JS inline
    assert "http://" not in html and "https://" not in html  # nothing to fetch
    assert "recommended" in done.stdout.lower()  # the terminal output is unchanged


def test_serve_binds_loopback_by_default_and_answers():
    server = subprocess.Popen([sys.executable, "-m", "finetune", "plan", "--serve", "--port", "0"], stderr=subprocess.PIPE,
                              text=True, env=ENV)
    try:
        line = server.stderr.readline()
        assert "http://127.0.0.1:" in line, line
        url = line.split("http://", 1)[1].split("/", 1)[0]
        status, body = http(f"http://{url}/api/plan?{urlencode({'q': 'llama-7b lora on 1xA10G'})}")
        assert status == 200 and body["result"]["recommended"] is not None
    finally:
        server.terminate()
        server.wait(timeout=30)


def test_only_requests_addressed_to_the_bound_host_are_answered(base_url):
    """DNS rebinding: a page of attacker.example whose name now resolves to 127.0.0.1 sends
    `Host: attacker.example`; it gets 421 and no plan. Loopback names and IP literals are answered."""
    port = base_url.rsplit(":", 1)[1]
    for host, status in ((f"attacker.example:{port}", 421), ("attacker.example", 421), (f"localhost:{port}", 200),
                         (f"127.0.0.1:{port}", 200), (f"LOCALHOST:{port}", 200)):
        for body in (None, b'{"q": "llama-7b lora on 1xA100 80GB"}'):
            request = urllib.request.Request(f"{base_url}/api/plan?{urlencode({'q': 'llama-7b on 1xA100 80GB'})}", data=body,
                                             headers={"Host": host})
            try:
                with urllib.request.urlopen(request, timeout=60) as response:
                    answered, payload = response.status, json.loads(response.read())
            except urllib.error.HTTPError as e:
                answered, payload = e.code, json.loads(e.read())
            assert answered == status, (host, body)
            assert ("result" in payload) == (status == 200)
    assert serve.host_names("0.0.0.0") >= {"localhost", socket.gethostname().lower()}
    assert serve.host_names("127.0.0.1") == {"localhost"}
    assert serve.host_names("planner.lab.internal") == {"localhost", "planner.lab.internal"}
