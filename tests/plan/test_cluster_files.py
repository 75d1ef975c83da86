"""The Kubernetes, SkyPilot and dstack files `finetune plan --write-config` writes: each loaded by its
engine's own library (the `cluster` extra), and each one's node script run on loopback as the engine
would run it on two nodes, with that engine's variables set by hand, forming one job that trains.

SkyPilot cannot be installed beside this environment (every release pins click<8.2, and bcrypt==4.0.1
where dstack needs bcrypt 5), so its file is checked against the JSON schema SkyPilot validates task
YAML with (`sky.utils.schemas.get_task_schema()` of skypilot 0.14.1, saved in engine_schemas/ by
engine_schemas/dump_skypilot_schema.py); `sky.Task.from_yaml` loaded these files in a separate venv
(docs/clusters.md, Run on SkyPilot / dstack).
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
from pathlib import Path

import pytest
import yaml

from finetune.models import catalog
from finetune.plan import cluster, gpus
from finetune.plan.choose import Request, plan
from finetune.plan.files import config_texts, launch_command
from finetune.train.accelerator import free_port

SKYPILOT_SCHEMA = Path(__file__).parent / "engine_schemas" / "skypilot-0.14.1-task.schema.json"
ENV = os.environ | {"HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1", "ACCELERATE_USE_CPU": "1"}

# multi-node plans of each strategy family, and one node (the files are written for every plan)
PLANS = {
    "qlora 2x8 H100": dict(model="llama-7b", gpu="H100", gpus_per_node=8, nodes=2, method="qlora"),
    "full zero3 2x8 A100-80GB": dict(model="llama-3.1-8b", gpu="A100-80GB", gpus_per_node=8, nodes=2, method="full", strategy="zero3"),
    "full fsdp 4x8 H200": dict(model="qwen2.5-7b", gpu="H200", gpus_per_node=8, nodes=4, method="full", strategy="fsdp"),
    "lora 1x2 A100-40GB": dict(model="mistral-7b", gpu="A100-40GB", gpus_per_node=2, method="lora"),
    "full fsdp 1x8 B200": dict(model="llama-3.1-8b", gpu="B200", gpus_per_node=8, method="full", strategy="fsdp"),
    "lora 1x8 H100-NVL": dict(model="llama-3.1-8b", gpu="H100-NVL", gpus_per_node=8, method="lora"),
    "lora 1x4 H20": dict(model="qwen2.5-7b", gpu="H20", gpus_per_node=4, method="lora"),
    "lora 1x2 48GB": dict(model="mistral-7b", gpu="48GB", gpus_per_node=2, method="lora"),
}


def recommended(model: str, gpu: str, **fields):
    plans, best = plan(Request(model=catalog.get(model), gpu=gpus.get(gpu), **fields))
    assert best is not None
    return plans[best]


def trainjob_problems(documents: list[dict]) -> list[str]:
    """What Kubeflow Trainer's API models (kubeflow-trainer-api, the Kubeflow SDK's own) refuse or drop:
    their from_dict validates types and ignores unknown keys, so a round trip must give the file back."""
    from kubeflow_trainer_api.models import IoK8sApiCoreV1ConfigMap, TrainerV1alpha1TrainJob

    problems = []
    for document, model in zip(documents, (IoK8sApiCoreV1ConfigMap, TrainerV1alpha1TrainJob)):
        try:
            loaded = model.from_dict(document).to_dict()
        except ValueError as e:  # pydantic's ValidationError
            problems.append(str(e))
            continue
        if loaded != document:
            problems.append(f"{document['kind']} does not survive {model.__name__}: {loaded}")
    return problems


def skypilot_problems(task: dict) -> list[str]:
    import jsonschema

    validator = jsonschema.Draft7Validator(json.loads(SKYPILOT_SCHEMA.read_text()))
    return [error.message for error in validator.iter_errors(task)]


def dstack_configuration(task: dict):
    """dstack's own configuration model, through the parser `dstack apply -f` uses."""
    from dstack._internal.core.models.configurations import parse_apply_configuration

    return parse_apply_configuration(task)


@pytest.mark.parametrize("name", PLANS)
def test_each_engine_loads_the_files_of_the_plan(name):
    p = recommended(**PLANS[name])
    w = p.workload
    texts = config_texts(p, "plan")
    launch = launch_command(p, "plan")
    launch_files = {file: text for file, text in texts.items() if file in ("accelerate.yaml", "ds_config.json")}
    assert ("ds_config.json" in launch_files) == w.deepspeed

    config_map, job = yaml.safe_load_all(texts[cluster.TRAINJOB_FILE])
    assert trainjob_problems([config_map, job]) == []
    assert job["apiVersion"] == "trainer.kubeflow.org/v1alpha1" and config_map["data"] == launch_files
    trainer = job["spec"]["trainer"]
    assert trainer["numNodes"] == w.nodes and trainer["resourcesPerNode"]["limits"] == {"nvidia.com/gpu": str(w.gpus_per_node)}
    assert launch in trainer["command"][2]
    node = job["spec"]["runtimePatches"][0]["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"][0]
    pod = node["template"]["spec"]["template"]["spec"]
    mounts = {mount["name"]: mount["mountPath"] for mount in pod["containers"][0]["volumeMounts"]}
    assert mounts == {"plan": "/workspace/plan", "checkpoints": cluster.CHECKPOINTS}
    assert {"name": "checkpoints", "persistentVolumeClaim": {"claimName": cluster.CHECKPOINT_CLAIM}} in pod["volumes"]

    sky = yaml.safe_load(texts[cluster.SKYPILOT_FILE])
    assert skypilot_problems(sky) == []
    alternatives = sky["resources"].get("any_of", [sky["resources"]])
    assert sky["num_nodes"] == w.nodes and all(a["accelerators"].endswith(f":{w.gpus_per_node}") for a in alternatives)
    assert launch in sky["run"]

    dstack = dstack_configuration(yaml.safe_load(texts[cluster.DSTACK_FILE]))
    assert (dstack.type, dstack.nodes) == ("task", w.nodes)
    assert dstack.resources.gpu.count.min == dstack.resources.gpu.count.max == w.gpus_per_node
    assert launch in dstack.commands[-1]
    from gpuhunt._internal.constraints import KNOWN_AMD_GPUS, KNOWN_NVIDIA_GPUS  # dstack's GPU catalog

    known = {gpu.name for gpu in KNOWN_NVIDIA_GPUS + KNOWN_AMD_GPUS}
    assert set(dstack.resources.gpu.name or ()) <= known


def test_a_card_given_by_its_memory_is_asked_for_by_its_memory_or_the_catalog_cards_of_that_size():
    """SkyPilot names accelerators: any of the catalog's 48 GiB cards; dstack takes a memory size."""
    texts = config_texts(recommended(**PLANS["lora 1x2 48GB"]), "plan")
    sky = yaml.safe_load(texts[cluster.SKYPILOT_FILE])
    assert sky["resources"] == {"any_of": [{"accelerators": "RTX6000-Ada:2"}, {"accelerators": "A6000:2"}]}
    gpu = dstack_configuration(yaml.safe_load(texts[cluster.DSTACK_FILE])).resources.gpu
    assert gpu.memory.min == gpu.memory.max == 48 and not gpu.name
    assert gpus.at_least(64.0) == ["A100-80GB", "H100-80GB"]  # no 64 GiB card: the next size up


def test_the_engines_refuse_a_mistaken_file():
    """The checks above can fail: each library refuses a misspelled or mistyped field."""
    texts = config_texts(recommended(**PLANS["qlora 2x8 H100"]), "plan")
    config_map, job = yaml.safe_load_all(texts[cluster.TRAINJOB_FILE])
    job["spec"]["trainer"]["numNode"] = job["spec"]["trainer"].pop("numNodes")
    assert trainjob_problems([config_map, job]) and trainjob_problems([config_map | {"data": {"a": 1}}, job])

    sky = yaml.safe_load(texts[cluster.SKYPILOT_FILE])
    assert skypilot_problems(sky | {"nodes": 2}) and skypilot_problems(sky | {"num_nodes": "two"})

    from dstack._internal.core.errors import ConfigurationError

    dstack = yaml.safe_load(texts[cluster.DSTACK_FILE])
    for mistake in ({"node": 2}, {"nodes": "two"}):
        with pytest.raises(ConfigurationError):
            dstack_configuration(dstack | mistake)


def test_a_cluster_of_another_shape_stops_before_launching():
    """Each node script checks the engine's counts against the plan first: one clear line, exit 1."""
    p = recommended(**PLANS["qlora 2x8 H100"])
    script = cluster.node_script(p, "plan", "echo LAUNCHED", cluster.SKYPILOT)
    done = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=30,
                          env=ENV | {"SKYPILOT_NUM_NODES": "3", "SKYPILOT_NUM_GPUS_PER_NODE": "8"})
    assert done.returncode == 1 and "LAUNCHED" not in done.stdout
    assert done.stderr.startswith("finetune: SkyPilot set SKYPILOT_NUM_NODES=3, but this plan (plan/) is for 2 node(s) x 8 GPU(s)")


def node_commands(texts: dict[str, str]) -> dict[str, str]:
    """The shell each engine runs on every node, from its file."""
    _, job = yaml.safe_load_all(texts[cluster.TRAINJOB_FILE])
    return {cluster.TRAINJOB_FILE: job["spec"]["trainer"]["command"][2],
            cluster.SKYPILOT_FILE: yaml.safe_load(texts[cluster.SKYPILOT_FILE])["run"],
            cluster.DSTACK_FILE: yaml.safe_load(texts[cluster.DSTACK_FILE])["commands"][-1]}


# each engine's variables on node `rank` of a 3-node job with 1 GPU per node, every node on loopback
NODE_VARIABLES = {
    cluster.TRAINJOB_FILE: lambda rank: {"PET_NNODES": "3", "PET_NPROC_PER_NODE": "1", "PET_NODE_RANK": str(rank),
                                         "PET_MASTER_ADDR": "127.0.0.1", "PET_MASTER_PORT": "29400"},
    cluster.SKYPILOT_FILE: lambda rank: {"SKYPILOT_NUM_NODES": "3", "SKYPILOT_NUM_GPUS_PER_NODE": "1",
                                         "SKYPILOT_NODE_RANK": str(rank), "SKYPILOT_NODE_IPS": "127.0.0.1\n127.0.0.2\n127.0.0.3"},
    cluster.DSTACK_FILE: lambda rank: {"DSTACK_NODES_NUM": "3", "DSTACK_GPUS_PER_NODE": "1", "DSTACK_NODE_RANK": str(rank),
                                       "DSTACK_MASTER_NODE_IP": "127.0.0.1", "DSTACK_NODES_IPS": "127.0.0.1\n127.0.0.2\n127.0.0.3"},
}
# appended to the launch line (the last value of a flag wins): two steps of the tiny default
QUICK = ["--max-steps", "2", "--micro-batch-size", "2", "--max-seq-len", "64", "--max-eval-examples", "0",
         "--num-samples", "0", "--no-save-final", "--log-every", "1", "--precision", "fp32"]


@pytest.mark.slow
def test_the_three_files_run_the_nodes_of_one_job_on_loopback_and_it_trains(tmp_path):
    """A 3-node plan; node 0 runs the TrainJob's command, node 1 SkyPilot's, node 2 dstack's, each with
    its engine's variables set as that engine sets them: together they form one 3-rank job and train
    (one job rather than one per engine: each costs a minute on these 2 cores). Three things differ
    from a cluster, each named here: a free port instead of 29500 (this machine is shared), the tiny
    run's step count appended, and no `cd` into the folder a ConfigMap would be mounted in."""
    p = recommended(model="tiny", gpu="H100", gpus_per_node=1, nodes=3, method="full", strategy="ddp")
    texts = config_texts(p, "plan")
    (tmp_path / "plan").mkdir()
    for name, text in texts.items():
        (tmp_path / "plan" / name).write_text(text)
    out, port = tmp_path / "out", free_port()
    nodes, logs = [], []
    for rank, (engine_file, command) in enumerate(node_commands(texts).items()):
        script = (command.replace("--main_process_port 29500", f"--main_process_port {port}")
                  .replace(f"cd {cluster.WORKDIR}\n", "").rstrip("\n") + " " + shlex.join([*QUICK, "--output-dir", str(out)]))
        logs.append(tmp_path / f"node{rank}.log")
        with open(logs[-1], "w") as log:
            nodes.append(subprocess.Popen(["bash", "-c", script], cwd=tmp_path, stdout=log, stderr=subprocess.STDOUT,
                                          env=ENV | NODE_VARIABLES[engine_file](rank)))
    codes = [node.wait(timeout=600) for node in nodes]
    logged = [log.read_text() for log in logs]
    assert codes == [0, 0, 0], "\n".join(text[-2500:] for text in logged)
    assert "world size: 3 processes on 3 machines" in logged[0]
    assert "preflight: 3 rank(s) on 3 machine(s) joined" in logged[0]
    steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if '"loss"' in line]
    assert [s["step"] for s in steps] == [1, 2] and all(0 < s["loss"] < 10 for s in steps)
    assert yaml.safe_load((out / "run.yaml").read_text())["resolved"]["world_size"] == 3
